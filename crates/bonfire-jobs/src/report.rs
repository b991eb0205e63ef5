//! Where a job's output goes ([`Reporter`]: [`Console`] prints what `bonfire train` prints,
//! [`Silent`] nothing), and the job-independent lines of the end report.

use std::path::Path;
use std::time::Duration;

use bonfire::StepStats;

use crate::progress::{ProgressLine, StepProgress, clock};
use crate::stragglers::{StepSplit, WARM_UP_BATCHES};

/// What a line of a job's output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Say {
    /// Something the user should know about a decision (a fallback taken, nothing left to do).
    Notice,
    /// Rank 0's opening line: what is about to train, on what.
    Start,
    /// Rank 0 resumes a run from a checkpoint.
    Resume,
    /// Rank 0's results of an epoch, after its checkpoint is written.
    Epoch,
    /// A line of rank 0's end report (the first is empty).
    Report,
}

/// Where a job's output goes. Only the deciding process (the parent, or rank 0) reports; the
/// other ranks are silent.
///
/// The library never prints on its own: it hands every line to a reporter. [`Console`] prints
/// them as `bonfire train` does; a program that wants them elsewhere (a log, a UI, nowhere)
/// implements this trait, or uses [`Silent`] and reads the typed result instead.
pub trait Reporter {
    /// A line of output, of kind `kind`.
    fn say(&mut self, kind: Say, text: &str);
    /// Rank 0's progress through an epoch, after each step.
    fn step(&mut self, progress: &StepProgress);
}

/// Prints to standard output: every line as it comes, and the progress as an `indicatif` bar on
/// a terminal (a plain line per quarter epoch otherwise). What `bonfire train` shows.
#[derive(Debug)]
pub struct Console {
    progress: ProgressLine,
}

impl Console {
    /// A reporter on standard output.
    pub fn new() -> Console {
        Console {
            progress: ProgressLine::new(),
        }
    }
}

impl Default for Console {
    fn default() -> Self {
        Console::new()
    }
}

impl Reporter for Console {
    fn say(&mut self, _: Say, text: &str) {
        self.progress.println(text);
    }

    fn step(&mut self, progress: &StepProgress) {
        self.progress.draw(progress);
    }
}

/// Reports nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Silent;

impl Reporter for Silent {
    fn say(&mut self, _: Say, _: &str) {}
    fn step(&mut self, _: &StepProgress) {}
}

/// What a run's training moved: items over all ranks and the seconds spent training them (not
/// evaluating), with the run's whole duration.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Throughput {
    /// Items trained, over all ranks.
    pub items: usize,
    /// Seconds spent in training steps.
    pub seconds: f64,
    /// Ranks that trained.
    pub ranks: usize,
    /// The run's wall-clock time on this rank, evaluation and checkpoints included.
    pub wall: Duration,
    /// Items trained, over all ranks, in the batches after the process's first
    /// [`WARM_UP_BATCHES`](crate::stragglers::WARM_UP_BATCHES).
    pub steady_items: usize,
    /// The seconds those batches took.
    pub steady_seconds: f64,
    /// Training seconds times the ranks that trained in them, summed over the run's stretches
    /// ([`Throughput::trained`]): the per-rank rate's measure where ranks left the run (workers
    /// asynchronous parameter servers dropped). 0: `ranks` trained throughout.
    pub rank_seconds: f64,
    /// The ranks that trained the last stretch; 0: `ranks`.
    pub ranks_left: usize,
}

impl Throughput {
    /// Adds a stretch of training (an epoch, the steps between evaluations): `items` trained,
    /// over all ranks, in `seconds`, by `ranks` ranks (fewer than [`Throughput::ranks`] once
    /// some have left the run).
    pub fn trained(&mut self, items: usize, seconds: f64, ranks: usize) {
        self.items += items;
        self.seconds += seconds;
        self.rank_seconds += seconds * ranks as f64;
        self.ranks_left = ranks;
    }

    /// Adds an epoch's steady batches (rank 0's, from its [`StepSplit`]) as `copies` ranks'
    /// worth of items: the ranks that train distinct batches (every rank in the vision job, the
    /// data-parallel replicas in the GPT's).
    pub fn add_steady(&mut self, split: &StepSplit, copies: usize) {
        self.steady_items += split.steady_items as usize * copies;
        self.steady_seconds += split.steady.as_secs_f64();
    }

    /// `throughput      1234 images/s over 2 rank(s) (617 per rank); this run trained for 0:10
    /// of 0:12 in all; 1301 images/s after the first 10 batches`, or `None` when nothing was
    /// trained. The last part, the steady rate without the warm-up (kernel compilation on a
    /// GPU), only when the run trained more batches than that.
    pub fn line(&self, unit: &str) -> Option<String> {
        (self.items > 0).then(|| {
            let rate = self.items as f64 / self.seconds;
            let steady = match self.steady_items {
                0 => String::new(),
                items => format!(
                    "; {:.0} {unit}/s after the first {WARM_UP_BATCHES} batches",
                    items as f64 / self.steady_seconds
                ),
            };
            // Ranks that left trained part of the run: the rate per rank is over the seconds
            // each rank trained.
            let (ranks, per_rank) = match self.ranks_left {
                left if left != 0 && left != self.ranks && self.rank_seconds > 0.0 => (
                    format!("{} rank(s), {left} at the end", self.ranks),
                    self.items as f64 / self.rank_seconds,
                ),
                _ => (format!("{} rank(s)", self.ranks), rate / self.ranks as f64),
            };
            format!(
                "throughput      {rate:.0} {unit}/s over {ranks} ({per_rank:.0} per rank); this \
                 run trained for {} of {} in all{steady}",
                clock(Duration::from_secs_f64(self.seconds)),
                clock(self.wall),
            )
        })
    }
}

/// The data-parallel lines of the end report: time per step, how much of the gradient traffic
/// backward hid, and (over several ranks) the bound that puts on scaling. `seconds` is the
/// training time the steps took; nothing when no step was measured.
pub fn data_parallel_lines(stats: Option<&StepStats>, seconds: f64, ranks: usize) -> Vec<String> {
    let Some(st) = stats.filter(|st| st.steps > 0) else {
        return Vec::new();
    };
    let ms = |d: Duration| 1e3 * d.as_secs_f64() / st.steps as f64;
    let step_ms = 1e3 * seconds / st.steps as f64;
    let exposed = ms(st.exposed);
    let mut lines = vec![format!(
        "data parallel   {:.1} ms per step: backward {:.1} ms, communication {:.2} ms of which \
         {:.0}% hidden by backward, {:.2} ms exposed ({:.1}% of the step); {} KiB of gradients \
         per step in {} bucket(s){}{}",
        step_ms,
        ms(st.backward),
        ms(st.communication),
        100.0 * st.hidden_fraction(),
        exposed,
        100.0 * exposed / step_ms.max(1e-9),
        st.bytes / st.steps / 1024,
        st.buckets / st.steps,
        scatter_words(st),
        lane_words(st),
    )];
    lines.extend(bucket_lines(st));
    lines.extend(late_line(st));
    if ranks > 1 {
        lines.push(format!(
            "scaling         compute is {:.1}% of the step (the rest waits on communication): \
             the upper bound on this run's scaling efficiency",
            100.0 * (1.0 - exposed / step_ms.max(1e-9)).max(0.0)
        ));
    }
    lines
}

/// How much of the gradient traffic this rank received, when buckets were reduce-scattered
/// (ZeRO stages 2 and 3): `", reduce-scattered (1586 KiB received)"`.
fn scatter_words(st: &StepStats) -> String {
    if st.received < st.bytes {
        format!(
            ", reduce-scattered ({} KiB received)",
            st.received / st.steps / 1024
        )
    } else {
        String::new()
    }
}

/// Where the buckets went when not all through the host: `"; 398 of 400 buckets in all
/// through the device lane"` (the first step's buckets are planned on the host).
fn lane_words(st: &StepStats) -> String {
    if st.device_lane > 0 {
        format!(
            "; {} of {} buckets in all through the device lane (CUDA IPC, never on the host)",
            st.device_lane, st.buckets
        )
    } else if st.device_packed > 0 {
        ", packed on the device, all-reduced on the host".into()
    } else {
        String::new()
    }
}

/// Most buckets the report lists (the last ones backward fills: they decide the exposed time).
const LISTED_BUCKETS: usize = 4;

/// Each bucket's mean timeline: when it was ready, handed to the communicator, first moved and
/// done, in ms from the start of backward, and how far past backward's end it finished.
fn bucket_lines(st: &StepStats) -> Vec<String> {
    let n = st.timeline.len();
    if n == 0 {
        return Vec::new();
    }
    let backward = 1e3 * st.backward.as_secs_f64() / st.steps.max(1) as f64;
    let mut lines = vec![format!(
        "buckets         mean times in ms from the start of backward, which ends at {backward:.2}{}:",
        if n > LISTED_BUCKETS {
            format!(" (the last {LISTED_BUCKETS} of {n} buckets)")
        } else {
            String::new()
        }
    )];
    for (b, t) in st
        .timeline
        .iter()
        .enumerate()
        .skip(n.saturating_sub(LISTED_BUCKETS))
    {
        let steps = t.steps.max(1) as f64;
        let ms = |d: Duration| 1e3 * d.as_secs_f64() / steps;
        lines.push(format!(
            "                #{b} ({} KiB): ready {:.2}, called {:.2}, first frame {:.2}, every \
             peer in {:.2}, done {:.2} ({:.2} after backward)",
            t.bytes / t.steps.max(1) / 1024,
            ms(t.ready),
            ms(t.called),
            ms(t.started),
            ms(t.peers),
            ms(t.finished),
            (ms(t.finished) - backward).max(0.0),
        ));
    }
    lines
}

/// `waited for      rank 1 in 40 of 48 steps (2.61 ms past backward each)`: the peers this rank
/// waited for after its own backward, the latest first by time.
fn late_line(st: &StepStats) -> Option<String> {
    let mut late: Vec<_> = st.late_peers.iter().collect();
    if late.is_empty() {
        return None;
    }
    late.sort_by_key(|(_, l)| std::cmp::Reverse(l.waited));
    let parts: Vec<String> = late
        .iter()
        .map(|(rank, l)| {
            format!(
                "rank {rank} in {} of {} steps ({:.2} ms past backward each)",
                l.steps,
                st.steps,
                1e3 * l.waited.as_secs_f64() / l.steps.max(1) as f64
            )
        })
        .collect();
    Some(format!("waited for      {}", parts.join(", ")))
}

/// Under ZeRO-3, rank 0's reads of sharded parameters while training (how many found their
/// gather started ahead), the all-gathers they took and how long those held the rank's thread,
/// and how many more all-gathers `elsewhere` ran (`all` counts the whole run): the report's
/// `fully sharded` line.
pub fn fully_sharded_line(
    all: &bonfire::backend::tensor_parallel::TpStats,
    train: &bonfire::backend::tensor_parallel::TpStats,
    train_seconds: f64,
    elsewhere: &str,
) -> String {
    let reads = train.gathers - train.gathers_started_ahead + train.served_ahead;
    format!(
        "fully sharded   on rank 0, training: {reads} reads of sharded parameters, {} served by \
         gathers started ahead; {} all-gathers ({:.1} MiB of slices sent), waited {:.2} s ({:.0}% \
         of the training time); {elsewhere}: {} more all-gathers",
        train.served_ahead,
        train.gathers,
        train.gather_bytes as f64 / (1 << 20) as f64,
        train.gather_time.as_secs_f64(),
        100.0 * train.gather_time.as_secs_f64() / train_seconds.max(1e-9),
        all.gathers.saturating_sub(train.gathers),
    )
}

/// What writing a run's checkpoints cost the rank that wrote them (rank 0, or the first rank
/// left where rank 0 has left the run).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Saves {
    /// Checkpoints this run wrote.
    pub count: usize,
    /// Seconds the writing rank spent writing them (a per-rank checkpoint waits for every rank's
    /// file).
    pub secs: f64,
    /// The rank that wrote the newest.
    pub rank: usize,
    /// Whether each rank wrote its own file (ZeRO-3's per-rank checkpoints).
    pub per_rank: bool,
    /// Bytes rank 0 wrote to the newest one: its own file, or the whole model and state.
    pub bytes: u64,
    /// The job's ranks.
    pub ranks: usize,
}

impl Saves {
    /// Rank 0's bytes in checkpoint `dir`: its per-rank file (with the manifest), or the model's
    /// and optimizer's records.
    pub fn bytes_in(dir: &Path) -> (bool, u64) {
        let size = |name: &str| std::fs::metadata(dir.join(name)).map_or(0, |m| m.len());
        let manifest = bonfire::backend::tensor_parallel::MANIFEST;
        let per_rank = dir.join(manifest).exists();
        let bytes = if per_rank {
            let own = std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .find(|n| n.starts_with("zero3-rank0-of-") && n.ends_with(".bin"));
            own.map_or(0, |n| size(&n)) + size(manifest)
        } else {
            size("model.bin") + size("optimizer.bin")
        };
        (per_rank, bytes)
    }

    /// `checkpoint cost 6 saves, 12.3 ms each on rank 0; each rank wrote its own slices
    /// (ZeRO-3): 0.52 MiB by rank 0 of 2`, or `...; rank 0 wrote the whole model and state:
    /// 9.30 MiB`.
    pub fn line(&self) -> String {
        let mib = self.bytes as f64 / (1 << 20) as f64;
        let each = 1e3 * self.secs / self.count.max(1) as f64;
        let rank = self.rank;
        let what = if self.per_rank {
            format!(
                "each rank wrote its own slices (ZeRO-3): {mib:.2} MiB by rank {rank} of {}",
                self.ranks
            )
        } else {
            format!("rank {rank} wrote the whole model and state: {mib:.2} MiB")
        };
        format!(
            "checkpoint cost {} save(s), {each:.1} ms each on rank {rank}; {what}",
            self.count
        )
    }
}

/// `checkpoints     runs/vision-1 (latest: epoch-3); plots runs/vision-1/loss.png and
/// runs/vision-1/accuracy.png`.
pub fn checkpoints_line(dir: &Path, last_epoch: usize, plots: &[&str]) -> String {
    let plots: Vec<String> = plots
        .iter()
        .map(|p| dir.join(p).display().to_string())
        .collect();
    let plots = match plots.as_slice() {
        [] => String::new(),
        [one] => format!("; plot {one}"),
        [init @ .., last] => format!("; plots {} and {last}", init.join(", ")),
    };
    format!(
        "checkpoints     {} (latest: epoch-{last_epoch}){plots}",
        dir.display()
    )
}

/// What each rank of a data-parallel run held of the model's state after training, and its
/// peak resident memory: the end report's `model state` line.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelMemory {
    /// Bytes of the parameters each rank holds: whole on every rank, or under ZeRO-3 its
    /// slices (the same on every rank).
    pub parameters: usize,
    /// Bytes of the whole parameters (with the buffers, such as a batch norm's running
    /// statistics, which stay whole on every rank).
    pub parameters_whole: usize,
    /// Bytes of the whole trained parameters: those that get gradients and optimizer state.
    pub trained_whole: usize,
    /// Bytes of the gradients each rank's last optimizer step got, by rank: every trained
    /// parameter's, whole on every rank, without ZeRO or with stage 1 (which averages whole
    /// gradients); this rank's share under stage 2.
    pub gradients: Vec<usize>,
    /// Bytes of each rank's optimizer state, by rank, as Burn records it at full precision
    /// (sharded: each rank's share; the whole state is their sum).
    pub optimizer: Vec<usize>,
    /// Each rank's peak resident memory (the kernel's `VmHWM`), by rank; `None` where the
    /// system does not say.
    pub peak_resident: Vec<Option<usize>>,
    /// The ZeRO stage the run sharded its state at; `None` for whole on every rank.
    pub zero: Option<bonfire::ZeroStage>,
}

impl ModelMemory {
    /// The largest rank's model state in bytes: parameters, gradients and optimizer state.
    pub fn per_rank(&self) -> usize {
        let rank = |(g, o): (&usize, &usize)| g + o;
        self.parameters
            + self
                .gradients
                .iter()
                .zip(&self.optimizer)
                .map(rank)
                .max()
                .unwrap_or(0)
    }

    /// The end report's line.
    pub fn line(&self) -> String {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        // The rank with the most of a part, and what share of the whole that is.
        let most = |v: &[usize]| {
            let most = v.iter().copied().max().unwrap_or(0);
            let whole: usize = v.iter().sum();
            (most, 100.0 * most as f64 / whole.max(1) as f64, whole)
        };
        let stage = self.zero.map(bonfire::ZeroStage::number);
        // Under ZeRO-3 a parameter that does not split stays whole on every rank, so the sum
        // over the ranks is not the whole: it is the trained parameters' (gradients), twice
        // (Adam).
        let most = |v: &[usize], whole: Option<usize>| {
            let (m, share, sum) = most(v);
            match whole {
                Some(w) => (m, 100.0 * m as f64 / w.max(1) as f64, w),
                None => (m, share, sum),
            }
        };
        let three = |k: usize| (stage == Some(3)).then_some(k * self.trained_whole);
        let (grads, grads_share, grads_whole) = most(&self.gradients, three(1));
        let parameters = if stage == Some(3) {
            format!(
                "parameters {:.2} MiB (ZeRO-3: {:.0}% of the whole {:.2} MiB)",
                mib(self.parameters),
                100.0 * self.parameters as f64 / self.parameters_whole.max(1) as f64,
                mib(self.parameters_whole)
            )
        } else {
            format!("parameters {:.2} MiB", mib(self.parameters))
        };
        let gradients = if let Some(n @ (2 | 3)) = stage {
            format!(
                "gradients {:.2} MiB on the rank with most (ZeRO-{n}: {grads_share:.0}% of the \
                 whole {:.2} MiB)",
                mib(grads),
                mib(grads_whole)
            )
        } else {
            format!("gradients {:.2} MiB", mib(grads))
        };
        let (state, state_share, state_whole) = most(&self.optimizer, three(2));
        let optimizer = match self.zero.map(bonfire::ZeroStage::number) {
            Some(n) => format!(
                "optimizer state {:.2} MiB on the rank with most (ZeRO-{n}: {state_share:.0}% of \
                 the whole {:.2} MiB)",
                mib(state),
                mib(state_whole)
            ),
            None if self.optimizer.iter().all(|&b| b == state) => format!(
                "optimizer state {:.2} MiB (whole on every rank)",
                mib(state)
            ),
            // Parameter servers: the servers hold it, each its share.
            None => format!(
                "optimizer state {:.2} MiB on the rank with most ({state_share:.0}% of the {:.2} \
                 MiB held in all)",
                mib(state),
                mib(state_whole)
            ),
        };
        let peaks: Vec<String> = self
            .peak_resident
            .iter()
            .map(|p| p.map_or_else(|| "?".into(), |b| format!("{:.0}", mib(b))))
            .collect();
        format!(
            "model state     per rank: {parameters}, {gradients}, {optimizer}: {:.2} MiB; peak \
             resident memory by rank {} MiB",
            mib(self.per_rank()),
            peaks.join(", ")
        )
    }
}

/// This process's peak resident memory in bytes (Linux's `VmHWM`); `None` elsewhere.
pub fn peak_resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: usize = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use bonfire::{BucketTimes, LatePeer};

    use super::*;

    #[test]
    fn the_model_state_line_gives_the_largest_share_and_every_peak() {
        let mib = 1 << 20;
        let sharded = ModelMemory {
            parameters: 3 * mib,
            parameters_whole: 3 * mib,
            trained_whole: 3 * mib,
            gradients: vec![3 * mib; 2],
            optimizer: vec![3 * mib, 3 * mib + mib / 2],
            peak_resident: vec![Some(200 * mib), None],
            zero: Some(bonfire::ZeroStage::One),
        };
        assert_eq!(sharded.per_rank(), 9 * mib + mib / 2);
        assert_eq!(
            sharded.line(),
            "model state     per rank: parameters 3.00 MiB, gradients 3.00 MiB, optimizer state \
             3.50 MiB on the rank with most (ZeRO-1: 54% of the whole 6.50 MiB): 9.50 MiB; peak \
             resident memory by rank 200, ? MiB"
        );
        let whole = ModelMemory {
            optimizer: vec![6 * mib; 2],
            zero: None,
            ..sharded.clone()
        };
        assert!(
            whole
                .line()
                .contains("optimizer state 6.00 MiB (whole on every rank): 12.00 MiB"),
            "{}",
            whole.line()
        );
        // Stage 2: the largest rank is the one with the most gradients and state together.
        let zero2 = ModelMemory {
            gradients: vec![2 * mib, mib],
            optimizer: vec![2 * mib, 4 * mib],
            zero: Some(bonfire::ZeroStage::Two),
            ..sharded.clone()
        };
        assert_eq!(zero2.per_rank(), 8 * mib);
        assert!(
            zero2.line().contains(
                "gradients 2.00 MiB on the rank with most (ZeRO-2: 67% of the whole 3.00 MiB), \
                 optimizer state 4.00 MiB on the rank with most (ZeRO-2: 67% of the whole 6.00 \
                 MiB): 8.00 MiB"
            ),
            "{}",
            zero2.line()
        );
        // Stage 3: the parameters are each rank's slices too.
        let zero3 = ModelMemory {
            parameters: mib + mib / 2,
            gradients: vec![mib + mib / 2; 2],
            optimizer: vec![3 * mib; 2],
            zero: Some(bonfire::ZeroStage::Three),
            ..sharded
        };
        assert_eq!(zero3.per_rank(), 6 * mib);
        assert!(
            zero3.line().contains(
                "per rank: parameters 1.50 MiB (ZeRO-3: 50% of the whole 3.00 MiB), gradients \
                 1.50 MiB on the rank with most (ZeRO-3: 50% of the whole 3.00 MiB), optimizer \
                 state 3.00 MiB on the rank with most (ZeRO-3: 50% of the whole 6.00 MiB): 6.00 \
                 MiB"
            ),
            "{}",
            zero3.line()
        );
        // Buffers (a batch norm's running statistics) stay whole on every rank and get no
        // gradients: the gradients' and the state's shares are of the trained parameters.
        let buffers = ModelMemory {
            parameters: 2 * mib + mib / 2,
            parameters_whole: 4 * mib,
            ..zero3
        };
        assert!(
            buffers.line().contains(
                "per rank: parameters 2.50 MiB (ZeRO-3: 62% of the whole 4.00 MiB), gradients \
                 1.50 MiB on the rank with most (ZeRO-3: 50% of the whole 3.00 MiB), optimizer \
                 state 3.00 MiB on the rank with most (ZeRO-3: 50% of the whole 6.00 MiB)"
            ),
            "{}",
            buffers.line()
        );
        // This process has touched more than a MiB by now.
        assert!(peak_resident_bytes().is_some_and(|b| b > mib));
    }

    #[test]
    fn a_checkpoints_cost_says_who_wrote_what() {
        let dir = std::env::temp_dir().join(format!("bonfire-saves-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model.bin"), vec![0u8; 3 << 19]).unwrap();
        std::fs::write(dir.join("optimizer.bin"), vec![0u8; 1 << 19]).unwrap();
        assert_eq!(Saves::bytes_in(&dir), (false, 4 << 19));
        let whole = Saves {
            count: 4,
            secs: 0.1,
            per_rank: false,
            bytes: 4 << 19,
            ranks: 2,
            rank: 0,
        };
        assert_eq!(
            whole.line(),
            "checkpoint cost 4 save(s), 25.0 ms each on rank 0; rank 0 wrote the whole model and \
             state: 2.00 MiB"
        );
        // Rank 1 writes where rank 0 has left the run (a worker asynchronous servers dropped).
        assert!(
            Saves {
                rank: 1,
                ..whole.clone()
            }
            .line()
            .ends_with("each on rank 1; rank 1 wrote the whole model and state: 2.00 MiB")
        );
        std::fs::remove_file(dir.join("model.bin")).unwrap();
        std::fs::remove_file(dir.join("optimizer.bin")).unwrap();
        std::fs::write(dir.join("manifest.json"), vec![b' '; 1 << 10]).unwrap();
        std::fs::write(dir.join("zero3-rank0-of-2.bin"), vec![0u8; 1 << 20]).unwrap();
        std::fs::write(dir.join("zero3-rank1-of-2.bin"), vec![0u8; 1 << 20]).unwrap();
        assert_eq!(Saves::bytes_in(&dir), (true, (1 << 20) + (1 << 10)));
        let mine = Saves {
            per_rank: true,
            bytes: 1 << 20,
            ..whole
        };
        assert_eq!(
            mine.line(),
            "checkpoint cost 4 save(s), 25.0 ms each on rank 0; each rank wrote its own slices \
             (ZeRO-3): 1.00 MiB by rank 0 of 2"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn report_lines_read_as_before() {
        assert_eq!(
            checkpoints_line(Path::new("runs/vision-1"), 3, &["loss.png", "accuracy.png"]),
            "checkpoints     runs/vision-1 (latest: epoch-3); plots runs/vision-1/loss.png and \
             runs/vision-1/accuracy.png"
        );
        let mut t = Throughput {
            items: 2000,
            seconds: 2.0,
            ranks: 2,
            wall: Duration::from_secs(3),
            ..Throughput::default()
        };
        assert_eq!(
            t.line("images").unwrap(),
            "throughput      1000 images/s over 2 rank(s) (500 per rank); this run trained for \
             0:02 of 0:03 in all"
        );
        // Two epochs' steady batches of rank 0, each rank training its own.
        let split = StepSplit {
            steady: Duration::from_millis(500),
            steady_items: 400,
            ..StepSplit::default()
        };
        t.add_steady(&split, 2);
        t.add_steady(&split, 2);
        assert_eq!(
            t.line("images").unwrap(),
            "throughput      1000 images/s over 2 rank(s) (500 per rank); this run trained for \
             0:02 of 0:03 in all; 1600 images/s after the first 10 batches"
        );
        assert!(Throughput::default().line("images").is_none());
        // A worker of 4 dropped after the first of two stretches: 3 ranks trained the second.
        let mut t = Throughput {
            ranks: 4,
            wall: Duration::from_secs(3),
            ..Throughput::default()
        };
        t.trained(4000, 1.0, 4);
        t.trained(3000, 1.0, 3);
        assert_eq!(
            t.line("images").unwrap(),
            "throughput      3500 images/s over 4 rank(s), 3 at the end (1000 per rank); this run \
             trained for 0:02 of 0:03 in all"
        );
        assert!(data_parallel_lines(None, 1.0, 2).is_empty());
    }

    #[test]
    fn the_bucket_timeline_is_a_mean_per_step_from_the_start_of_backward() {
        let ms = Duration::from_millis;
        let bucket = |ready, finished| BucketTimes {
            steps: 2,
            bytes: 2 * 80 * 1024,
            ready: ms(ready),
            called: ms(ready),
            started: ms(ready + 2),
            peers: ms(ready + 4),
            finished: ms(finished),
        };
        let st = StepStats {
            steps: 2,
            backward: ms(100),
            communication: ms(10),
            exposed: ms(4),
            bytes: 2 * 5 * 80 * 1024,
            received: 2 * 5 * 80 * 1024,
            buckets: 10,
            device_packed: 0,
            device_lane: 0,
            timeline: (0..5).map(|b| bucket(20 * b, 20 * b + 8)).collect(),
            late_peers: [
                (
                    1,
                    LatePeer {
                        steps: 1,
                        waited: ms(3),
                    },
                ),
                (
                    2,
                    LatePeer {
                        steps: 2,
                        waited: ms(1),
                    },
                ),
            ]
            .into(),
        };
        let lines = data_parallel_lines(Some(&st), 0.2, 2);
        assert!(
            lines[1].ends_with("which ends at 50.00 (the last 4 of 5 buckets):"),
            "{lines:#?}"
        );
        assert_eq!(lines.len(), 1 + 1 + 4 + 1 + 1, "{lines:#?}");
        assert_eq!(
            lines[6],
            "waited for      rank 1 in 1 of 2 steps (3.00 ms past backward each), rank 2 in 2 of \
             2 steps (0.50 ms past backward each)"
        );
        assert_eq!(
            lines[5].trim(),
            "#4 (80 KiB): ready 40.00, called 40.00, first frame 41.00, every peer in 42.00, \
             done 44.00 (0.00 after backward)"
        );
        assert!(
            lines[2].trim().starts_with("#1 (80 KiB): ready 10.00"),
            "{lines:#?}"
        );
        assert!(
            lines[0].ends_with("; 400 KiB of gradients per step in 5 bucket(s)"),
            "{lines:#?}"
        );
        // Reduce-scattered buckets (ZeRO stages 2 and 3): what this rank received of them.
        let scattered = StepStats {
            received: 2 * 5 * 40 * 1024,
            ..st
        };
        let lines = data_parallel_lines(Some(&scattered), 0.2, 2);
        assert!(
            lines[0].ends_with(
                "; 400 KiB of gradients per step in 5 bucket(s), reduce-scattered (200 KiB \
                 received)"
            ),
            "{lines:#?}"
        );
    }
}
