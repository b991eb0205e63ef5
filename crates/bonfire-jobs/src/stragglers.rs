//! Stragglers: each rank's time in an epoch's steps, split into input (making batches), compute
//! (forward, backward, optimizer) and wait (communication backward did not hide), gathered on
//! every rank after the epoch; a rank whose input plus compute exceeds the median of the other
//! ranks' by more than [`THRESHOLD`] (and [`MIN_EXCESS_SECS`]) is named, with the part that made
//! it slow.
//!
//! In a synchronous job the others wait for the slowest rank at every all-reduce, so a straggler
//! shows up twice: as its own long compute or input, and as the others' wait.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How much slower than the median of the other ranks a rank must be to be named: 20%.
pub const THRESHOLD: f64 = 0.20;

/// And by how many seconds at least in the epoch: below that, an epoch is too short for its
/// timing to say anything.
pub const MIN_EXCESS_SECS: f64 = 0.1;

/// One rank's seconds in one epoch's training steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankTimes {
    /// Making batches (reading, decoding, moving to the device).
    pub input: f64,
    /// Forward, backward and the optimizer step, less the wait.
    pub compute: f64,
    /// Communication that backward did not hide: mostly waiting for the slowest rank.
    pub wait: f64,
}

impl RankTimes {
    /// The time the rank itself needed: input and compute.
    pub fn busy(&self) -> f64 {
        self.input + self.compute
    }
}

/// What made a straggler slow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Its forward, backward and optimizer steps.
    Compute,
    /// Its batches.
    Input,
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cause::Compute => "compute",
            Cause::Input => "input",
        })
    }
}

/// A rank slower than the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Straggler {
    /// The rank.
    pub rank: usize,
    /// How much slower than the median of the other ranks, as a fraction (0.38: 38% slower).
    pub slower: f64,
    /// What made it slow: the part where it exceeds the others' median most.
    pub cause: Cause,
    /// Its times.
    pub times: RankTimes,
    /// The median of the other ranks' times, part by part.
    pub others: RankTimes,
}

impl Straggler {
    /// `rank 1 is 38% slower than the median of the other ranks (compute 2.10 s against 1.52 s,
    /// input 0.12 s against 0.11 s); the others waited 0.61 s for it`.
    pub fn describe(&self) -> String {
        let (t, o) = (&self.times, &self.others);
        format!(
            "rank {} is {:.0}% slower than the median of the other ranks ({} {:.2} s against {:.2} s, {} {:.2} s against {:.2} s); the others waited {:.2} s",
            self.rank,
            100.0 * self.slower,
            self.cause,
            part(t, self.cause),
            part(o, self.cause),
            other(self.cause),
            part(t, other(self.cause)),
            part(o, other(self.cause)),
            o.wait,
        )
    }

    /// `rank 1 +38% (compute)`, for the progress line.
    pub fn short(&self) -> String {
        format!(
            "rank {} +{:.0}% ({})",
            self.rank,
            100.0 * self.slower,
            self.cause
        )
    }
}

fn part(t: &RankTimes, c: Cause) -> f64 {
    match c {
        Cause::Compute => t.compute,
        Cause::Input => t.input,
    }
}

fn other(c: Cause) -> Cause {
    match c {
        Cause::Compute => Cause::Input,
        Cause::Input => Cause::Compute,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The ranks of `times` (indexed by rank) slower than the median of the others by more than
/// `threshold`, slowest first.
pub fn stragglers(times: &[RankTimes], threshold: f64) -> Vec<Straggler> {
    let mut found = Vec::new();
    if times.len() < 2 {
        return found;
    }
    for (rank, t) in times.iter().enumerate() {
        let rest = || times.iter().enumerate().filter(move |(r, _)| *r != rank);
        let others = RankTimes {
            input: median(rest().map(|(_, o)| o.input).collect()),
            compute: median(rest().map(|(_, o)| o.compute).collect()),
            wait: median(rest().map(|(_, o)| o.wait).collect()),
        };
        let base = median(rest().map(|(_, o)| o.busy()).collect());
        if base <= 0.0 {
            continue;
        }
        let slower = t.busy() / base - 1.0;
        if slower > threshold && t.busy() - base >= MIN_EXCESS_SECS {
            let cause = if t.input - others.input > t.compute - others.compute {
                Cause::Input
            } else {
                Cause::Compute
            };
            found.push(Straggler {
                rank,
                slower,
                cause,
                times: *t,
                others,
            });
        }
    }
    found.sort_by(|a, b| b.slower.total_cmp(&a.slower));
    found
}

/// The end report's line on stragglers, from each epoch's (number, every rank's times):
/// `stragglers      rank 1 in epochs 2, 3 (compute; up to 41% slower than the median of the
/// others)`, or that there were none; `None` when no epoch timed more than one rank.
pub fn report_line<'a>(
    epochs: impl IntoIterator<Item = (usize, &'a [RankTimes])>,
) -> Option<String> {
    let mut timed = false;
    // rank -> (epochs, worst, its cause)
    let mut by_rank: std::collections::BTreeMap<usize, (Vec<usize>, f64, Cause)> =
        std::collections::BTreeMap::new();
    for (epoch, times) in epochs {
        timed |= times.len() > 1;
        for s in stragglers(times, THRESHOLD) {
            let e = by_rank.entry(s.rank).or_insert((Vec::new(), 0.0, s.cause));
            e.0.push(epoch);
            if s.slower > e.1 {
                (e.1, e.2) = (s.slower, s.cause);
            }
        }
    }
    if !timed {
        return None;
    }
    if by_rank.is_empty() {
        return Some(format!(
            "stragglers      none (every rank within {:.0}% of the median of the others in every epoch)",
            100.0 * THRESHOLD
        ));
    }
    let parts: Vec<String> = by_rank
        .iter()
        .map(|(rank, (epochs, worst, cause))| {
            let list: Vec<String> = epochs.iter().map(|e| e.to_string()).collect();
            format!(
                "rank {rank} in epoch{} {} ({cause}; up to {:.0}% slower than the median of the others)",
                if epochs.len() == 1 { "" } else { "s" },
                list.join(", "),
                100.0 * worst
            )
        })
        .collect();
    Some(format!("stragglers      {}", parts.join("; ")))
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
    /// (0.8 ms of it exposed communication), optimizer 6.2 ms`; nothing when no batch was timed.
    pub fn line(&self) -> Option<String> {
        (self.batches > 0).then(|| {
            let ms = |d: Duration| 1e3 * d.as_secs_f64() / self.batches as f64;
            format!(
                "step split      per batch on rank 0: input {:.1} ms, forward {:.1} ms, backward \
                 {:.1} ms ({:.1} ms of it exposed communication), optimizer {:.1} ms",
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

    fn t(input: f64, compute: f64, wait: f64) -> RankTimes {
        RankTimes {
            input,
            compute,
            wait,
        }
    }

    #[test]
    fn a_slow_rank_is_named_with_its_cause() {
        let times = [
            t(0.1, 1.0, 0.5),
            t(0.1, 1.6, 0.0),
            t(0.1, 1.05, 0.5),
            t(0.1, 0.95, 0.55),
        ];
        let s = stragglers(&times, THRESHOLD);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!((s[0].rank, s[0].cause), (1, Cause::Compute));
        assert!((s[0].slower - (1.7 / 1.1 - 1.0)).abs() < 1e-9);
        assert!(
            s[0].describe().starts_with(
                "rank 1 is 55% slower than the median of the other ranks (compute 1.60 s against 1.00 s, input 0.10 s against 0.10 s); the others waited 0.50 s"
            ),
            "{}",
            s[0].describe()
        );
        assert_eq!(s[0].short(), "rank 1 +55% (compute)");
        // Slow batches instead.
        let s = stragglers(&[t(0.1, 1.0, 0.4), t(0.9, 1.0, 0.0)], THRESHOLD);
        assert_eq!((s[0].rank, s[0].cause), (1, Cause::Input));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn the_report_names_each_straggler_once_with_its_epochs() {
        let slow = [t(0.1, 1.0, 0.5), t(0.1, 1.5, 0.0)];
        let even = [t(0.1, 1.0, 0.0), t(0.1, 1.0, 0.0)];
        let line = report_line([(1, &even[..]), (2, &slow[..]), (3, &slow[..])]).unwrap();
        assert_eq!(
            line,
            "stragglers      rank 1 in epochs 2, 3 (compute; up to 45% slower than the median of the others)"
        );
        let line = report_line([(1, &even[..])]).unwrap();
        assert!(line.starts_with("stragglers      none"), "{line}");
        assert_eq!(report_line([(1, &even[..1])]), None);
    }

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
        .line()
        .unwrap();
        assert_eq!(
            line,
            "step split      per batch on rank 0: input 0.5 ms, forward 50.0 ms, backward 120.0 \
             ms (1.0 ms of it exposed communication), optimizer 6.0 ms"
        );
        assert_eq!(StepSplit::default().line(), None);
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

    #[test]
    fn ranks_within_the_threshold_and_lone_ranks_are_not_named() {
        assert!(stragglers(&[t(0.1, 1.0, 0.1), t(0.1, 1.15, 0.0)], THRESHOLD).is_empty());
        assert!(stragglers(&[t(0.1, 9.0, 0.0)], THRESHOLD).is_empty());
        // 50% slower, but by 0.05 s: too short an epoch to tell.
        assert!(stragglers(&[t(0.0, 0.1, 0.0), t(0.0, 0.15, 0.0)], THRESHOLD).is_empty());
        assert!(stragglers(&[], THRESHOLD).is_empty());
    }
}
