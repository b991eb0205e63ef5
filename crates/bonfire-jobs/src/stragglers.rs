//! Timing a rank's epoch for the straggler rule of `bonfire::launch::stragglers` (re-exported
//! here): [`EpochTimer`] and [`StepSplit`].

use std::time::{Duration, Instant};

pub use bonfire::launch::stragglers::{
    Cause, MIN_EXCESS_SECS, RankTimes, Straggler, THRESHOLD, report_line, report_line_of,
    stragglers,
};

/// The end report's straggler line over each round's (number, every rank's times, the job's
/// ranks gone by then): parameter servers (the last `servers` ranks) train nothing, so only the
/// workers are compared, named by their rank in the job (the ranks left, once some are gone).
pub(crate) fn workers_line<'a>(
    rounds: impl IntoIterator<Item = (usize, &'a [RankTimes], &'a [usize])>,
    servers: usize,
) -> Option<String> {
    report_line_of(rounds.into_iter().map(|(n, times, gone)| {
        let workers = times.len().saturating_sub(servers);
        let ranks = (0..).filter(|k| !gone.contains(k)).take(workers).collect();
        (n, &times[..workers], ranks)
    }))
}

/// A parameter server's times for a round it served since `since`: all of it counted as
/// compute (the straggler rule compares only the workers).
pub(crate) fn serving_times(since: Instant) -> RankTimes {
    RankTimes {
        input: 0.0,
        compute: since.elapsed().as_secs_f64(),
        wait: 0.0,
    }
}

/// Batches at the start of a process's training that the steady rate leaves out: the first steps
/// compile (and, with autotune, tune) a GPU backend's kernels and fault in fresh memory on any
/// backend, which the peers' own timings leave out as warm-up (`benches/ddp_mnist_style.py`
/// and `benches/gpt_ddp_torch.py` time after 10 steps).
pub const WARM_UP_BATCHES: u64 = 10;

/// Times one rank's steps through an epoch: call [`input_done`](EpochTimer::input_done) when the
/// batch is made, [`forward_done`](EpochTimer::forward_done) when the loss is read,
/// [`backward_done`](EpochTimer::backward_done) when backward has returned (its gradients
/// averaged) and [`step_done`](EpochTimer::step_done) after the optimizer step. A loop that does
/// not mark the forward and backward passes counts them as the optimizer's.
#[derive(Debug)]
pub struct EpochTimer {
    split: StepSplit,
    wait_at_start: Duration,
    mark: Instant,
    step_began: Instant,
    before: u64,
}

impl Default for EpochTimer {
    fn default() -> Self {
        EpochTimer::start()
    }
}

impl EpochTimer {
    /// Starts timing the process's first epoch, now.
    pub fn start() -> EpochTimer {
        EpochTimer::start_after(0)
    }

    /// Starts timing an epoch, now, after `batches` timed in this process before it (the sum
    /// of the earlier epochs' [`StepSplit::batches`]), so that only the process's first
    /// [`WARM_UP_BATCHES`] are left out of the steady rate.
    pub fn start_after(batches: u64) -> EpochTimer {
        let now = Instant::now();
        EpochTimer {
            split: StepSplit::default(),
            wait_at_start: exposed(),
            mark: now,
            step_began: now,
            before: batches,
        }
    }

    fn lap(&mut self) -> Duration {
        let now = Instant::now();
        let lap = now - self.mark;
        self.mark = now;
        lap
    }

    /// The batch is made.
    pub fn input_done(&mut self) {
        let lap = self.lap();
        self.split.input += lap;
    }

    /// The forward pass is done and its loss read.
    pub fn forward_done(&mut self) {
        let lap = self.lap();
        self.split.forward += lap;
    }

    /// Backward has returned, with the gradients averaged over the ranks.
    pub fn backward_done(&mut self) {
        let lap = self.lap();
        self.split.backward += lap;
    }

    /// The step is done (forward, backward, the optimizer), on `items` of this rank's (images,
    /// tokens).
    pub fn step_done(&mut self, items: u64) {
        self.steps_done(1, items);
    }

    /// A step of `batches` micro-batches that ran together is done (a pipeline step: its
    /// forwards and backwards interleave), on `items`: it counts as that many batches, and into
    /// the steady rate when it ends after the process's first [`WARM_UP_BATCHES`].
    pub fn steps_done(&mut self, batches: u64, items: u64) {
        let lap = self.lap();
        self.split.optimizer += lap;
        self.split.batches += batches;
        if self.before + self.split.batches > WARM_UP_BATCHES {
            self.split.steady += self.mark - self.step_began;
            self.split.steady_items += items;
        }
        self.step_began = self.mark;
    }

    /// This rank's times so far.
    pub fn times(&self) -> RankTimes {
        let step = self.split.forward + self.split.backward + self.split.optimizer;
        let wait = exposed().saturating_sub(self.wait_at_start).min(step);
        RankTimes {
            input: self.split.input.as_secs_f64(),
            compute: (step - wait).as_secs_f64(),
            wait: wait.as_secs_f64(),
        }
    }

    /// Where this rank's step time went so far.
    pub fn split(&self) -> StepSplit {
        StepSplit {
            exposed: exposed().saturating_sub(self.wait_at_start),
            ..self.split
        }
    }
}

/// Where one rank's training time went, summed over its batches: making them, the forward pass
/// (to the loss read on the host), backward (its exposed communication included, also given
/// apart) and the optimizer step. On a GPU backend each phase ends when the host has what it
/// waits for, so queued work may be counted in a later phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepSplit {
    /// Batches timed.
    pub batches: u64,
    /// Making batches.
    pub input: Duration,
    /// Forward passes, to the loss read.
    pub forward: Duration,
    /// Backward passes, with the gradient averaging that backward did not hide.
    pub backward: Duration,
    /// The part of `backward` spent waiting for the gradient all-reduce.
    pub exposed: Duration,
    /// Optimizer steps.
    pub optimizer: Duration,
    /// The whole time of the batches after the process's first [`WARM_UP_BATCHES`], from the
    /// end of the batch before each to its own end.
    pub steady: Duration,
    /// The items of those batches.
    pub steady_items: u64,
}

impl std::ops::AddAssign for StepSplit {
    fn add_assign(&mut self, o: StepSplit) {
        self.batches += o.batches;
        self.steady += o.steady;
        self.steady_items += o.steady_items;
        self.input += o.input;
        self.forward += o.forward;
        self.backward += o.backward;
        self.exposed += o.exposed;
        self.optimizer += o.optimizer;
    }
}

impl StepSplit {
    /// `step split      per batch on rank 0: input 0.4 ms, forward 51.0 ms, backward 120.3 ms
    /// (0.8 ms of it exposed communication), optimizer 6.2 ms`, for the split `rank` timed;
    /// nothing when no batch was timed.
    pub fn line(&self, rank: usize) -> Option<String> {
        (self.batches > 0).then(|| {
            let ms = |d: Duration| 1e3 * d.as_secs_f64() / self.batches as f64;
            format!(
                "step split      per batch on rank {rank}: input {:.1} ms, forward {:.1} ms, \
                 backward {:.1} ms ({:.1} ms of it exposed communication), optimizer {:.1} ms",
                ms(self.input),
                ms(self.forward),
                ms(self.backward),
                ms(self.exposed),
                ms(self.optimizer)
            )
        })
    }
}

/// The data-parallel decorator's exposed communication on this rank so far.
fn exposed() -> Duration {
    bonfire::total_stats().map_or(Duration::ZERO, |s| s.exposed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_split_adds_up_and_reads_per_batch() {
        let mut timer = EpochTimer::start();
        for _ in 0..2 {
            timer.input_done();
            std::thread::sleep(Duration::from_millis(4));
            timer.forward_done();
            std::thread::sleep(Duration::from_millis(8));
            timer.backward_done();
            timer.step_done(64);
        }
        let split = timer.split();
        assert_eq!(split.batches, 2);
        assert_eq!((split.steady, split.steady_items), (Duration::ZERO, 0));
        assert!(split.forward >= Duration::from_millis(8), "{split:?}");
        assert!(split.backward >= Duration::from_millis(16), "{split:?}");
        let step = Duration::from_secs_f64(timer.times().compute + timer.times().wait);
        let parts = split.forward + split.backward + split.optimizer;
        assert!(
            step.abs_diff(parts) < Duration::from_millis(1),
            "{step:?} vs {parts:?}"
        );
        let mut sum = split;
        sum += split;
        assert_eq!((sum.batches, sum.forward), (4, split.forward * 2));
        let line = StepSplit {
            batches: 2,
            input: Duration::from_millis(1),
            forward: Duration::from_millis(100),
            backward: Duration::from_millis(240),
            exposed: Duration::from_millis(2),
            optimizer: Duration::from_millis(12),
            ..StepSplit::default()
        }
        .line(1)
        .unwrap();
        // Rank 1 reports where rank 0 has left the run.
        assert_eq!(
            line,
            "step split      per batch on rank 1: input 0.5 ms, forward 50.0 ms, backward 120.0 \
             ms (1.0 ms of it exposed communication), optimizer 6.0 ms"
        );
        assert_eq!(StepSplit::default().line(0), None);
    }

    #[test]
    fn the_steady_time_leaves_out_the_process_s_first_batches_only() {
        // A slow first batch (a GPU compiling its kernels), then quick ones, over two epochs of 8.
        let step = |timer: &mut EpochTimer, ms: u64| {
            timer.input_done();
            std::thread::sleep(Duration::from_millis(ms));
            timer.step_done(4);
        };
        let mut first = EpochTimer::start();
        step(&mut first, 60);
        for _ in 1..8 {
            step(&mut first, 2);
        }
        let mut total = first.split();
        assert_eq!((total.steady, total.steady_items), (Duration::ZERO, 0));
        // An evaluation between the epochs: not a batch's time.
        std::thread::sleep(Duration::from_millis(60));
        let mut second = EpochTimer::start_after(total.batches);
        for _ in 0..8 {
            step(&mut second, 2);
        }
        total += second.split();
        // Batches 11-16 are steady: 6 of them, 24 items, about 12 ms, neither the first batch's
        // 60 ms nor the evaluation's.
        assert_eq!((total.batches, total.steady_items), (16, 24));
        assert!(
            total.steady >= Duration::from_millis(12) && total.steady < Duration::from_millis(55),
            "{total:?}"
        );
    }
}
