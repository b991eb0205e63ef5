//! Pipeline parallelism: a model's sequence of blocks split into contiguous stages, one stage per
//! member of a pipeline group, each batch cut into micro-batches that flow through the stages.
//!
//! Each rank builds only its stage's blocks ([`partition`] says which) and calls
//! [`Pipeline::step`] with its forward. A stage receives its input activation from the stage
//! before it (the first stage reads its own micro-batch), sends its output to the stage after it,
//! and in backward receives the gradient of that output, runs Burn's autodiff on its own graph
//! (the received gradient fed in as `sum(output * gradient)`, whose gradient is exactly the
//! vector-Jacobian product the whole model's backward would compute there), and sends the
//! gradient of its input back. The last stage returns the loss; the step's gradients are those of
//! the mean of the micro-batches' losses, as one device's on the whole batch when the
//! micro-batches are equal parts of it.
//!
//! Two schedules: [`Schedule::GPipe`] (every forward, then every backward: each stage holds the
//! graphs of all `m` micro-batches) and [`Schedule::OneFOneB`] (after a warm-up of `p - 1 - s`
//! forwards, stage `s` alternates one forward and one backward: at most `p - s` graphs held).
//! Both idle for the same bubble, `(p - 1) / (m + p - 1)` of a step at `p` stages and `m`
//! micro-batches ([`bubble`]). Activations travel as f32 over the group's point-to-point sends,
//! each preceded by its shape; a send is not waited for until the step ends, so the transfer
//! overlaps the stage's next compute.
//!
//! Interleaved 1F1B ([`Pipeline::interleaved`], Megatron-LM's virtual pipeline stages): the
//! model is cut into `v * p` chunks and rank `r` holds chunks `r`, `r + p`, ..., so a
//! micro-batch passes every rank `v` times, and [`Pipeline::step_chunks`] runs them in
//! Megatron-LM's order (micro-batches in groups of `p`, each group through a rank's chunks in
//! turn). Each chunk is `1/v` of a stage's work, so the bubble shrinks to
//! `(p - 1) / (v * m + p - 1)` ([`bubble_interleaved`]), for `(v p - 1) / (p - 1)` times the
//! transfers per micro-batch (3 at 2 stages of 2 chunks).

use std::ops::Range;
use std::time::{Duration, Instant};

use bonfire_collectives::{CollectiveError, Communicator, Work};
use bonfire_topology::ReduceOp;
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorData};

use crate::data_parallel::{Layout, part_of, placed_as};

/// The order of a stage's forwards and backwards within a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Schedule {
    /// Every micro-batch's forward, then every backward (GPipe).
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward in the steady state, after `p - 1 - stage` forwards of warm-up
    /// (PipeDream-flush's 1F1B): at most `p - stage` micro-batches in flight on a stage.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl Schedule {
    /// The schedule's name: `gpipe` or `1f1b`.
    pub const fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Schedule {
    type Err = String;

    fn from_str(s: &str) -> Result<Schedule, String> {
        match s {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            other => Err(format!("{other:?}: expected gpipe or 1f1b")),
        }
    }
}

/// What a stage's forward of one micro-batch gives.
pub enum StageOutput<B: AutodiffBackend, const D: usize> {
    /// The activation that goes to the next stage (every stage but the last).
    Activation(Tensor<B, D>),
    /// The micro-batch's loss, of one element (the last stage).
    Loss(Tensor<B, 1>),
}

/// Why a pipeline step failed.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A pipeline needs at least one micro-batch.
    #[error("a pipeline step needs at least 1 micro-batch, not 0")]
    NoMicroBatches,
    /// Interleaved stages the pipeline cannot run.
    #[error(
        "{chunks} chunks per stage over {stages} stages and {micro_batches} micro-batches: {problem}"
    )]
    Interleave {
        /// The chunks asked for.
        chunks: usize,
        /// The pipeline's stages.
        stages: usize,
        /// Micro-batches per step.
        micro_batches: usize,
        /// What does not fit.
        problem: String,
    },
    /// A second stage in a process that already runs one.
    #[error(
        "this process already runs a pipeline stage: run one stage per process (Burn 0.21 keeps \
         the bookkeeping of its autodiff graphs process-wide, and graphs walked backward on \
         several threads at once were seen to lose gradients)"
    )]
    SecondStage,
    /// Moving an activation or a gradient between neighbouring stages failed.
    #[error("pipeline stage {stage} of {stages}: {what} of micro-batch {micro}: {source}")]
    Transfer {
        /// This stage.
        stage: usize,
        /// The pipeline's stages.
        stages: usize,
        /// What moved, in words (`receiving the activation`, ...).
        what: &'static str,
        /// The micro-batch.
        micro: usize,
        /// The collective's error, naming the peer.
        #[source]
        source: Box<CollectiveError>,
    },
    /// The stage's forward returned what its place in the pipeline does not give, or a shape the
    /// transfer cannot carry.
    #[error("pipeline stage {stage} of {stages}: micro-batch {micro}: {problem}")]
    Stage {
        /// This stage.
        stage: usize,
        /// The pipeline's stages.
        stages: usize,
        /// The micro-batch.
        micro: usize,
        /// What was wrong.
        problem: String,
    },
}

/// What one [`Pipeline::step`] measured on this stage.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    /// The mean of the micro-batches' losses (the last stage only).
    pub loss: Option<f32>,
    /// The step, from its first to its last instant on this stage.
    pub wall: Duration,
    /// The time this stage waited for a neighbour (an activation, a gradient, or its own sends
    /// to be taken at the end): the bubble, and any transfer not hidden behind compute.
    pub idle: Duration,
    /// The most micro-batches whose graphs this stage held at once (each chunk's counted under
    /// interleaving).
    pub max_in_flight: usize,
    /// The most activation bytes (outputs sent and inputs received, kept for backward) this stage
    /// held at once.
    pub max_activation_bytes: usize,
}

impl StepReport {
    /// The part of the step this stage waited: compare with [`bubble`].
    pub fn idle_fraction(&self) -> f64 {
        if self.wall.is_zero() {
            0.0
        } else {
            self.idle.as_secs_f64() / self.wall.as_secs_f64()
        }
    }
}

/// The part of a step a stage idles in a pipeline of `stages` stages over `micro_batches`
/// micro-batches of equal cost, under GPipe or 1F1B: `(p - 1) / (m + p - 1)`.
pub fn bubble(stages: usize, micro_batches: usize) -> f64 {
    bubble_interleaved(stages, micro_batches, 1)
}

/// The part of a step a rank idles under interleaved 1F1B with `chunks` chunks per rank
/// ([`Pipeline::interleaved`]): `(p - 1) / (v * m + p - 1)`, [`bubble`] at `v = 1`.
pub fn bubble_interleaved(stages: usize, micro_batches: usize, chunks: usize) -> f64 {
    let (p, m, v) = (stages as f64, micro_batches as f64, chunks.max(1) as f64);
    (p - 1.0) / (v * m + p - 1.0)
}

/// Contiguous ranges of `costs.len()` blocks over `stages` stages, the largest stage's cost as
/// small as can be (a block's cost: its parameter count, or a measured time); every stage gets at
/// least one block when there are enough. Deterministic: every rank computes the same split.
pub fn partition(costs: &[u64], stages: usize) -> Vec<Range<usize>> {
    let n = costs.len();
    let stages = stages.max(1);
    if n == 0 {
        return vec![0..0; stages];
    }
    // The smallest largest-stage cost that fits in `stages` contiguous stages: binary search.
    let fits = |limit: u64| {
        let (mut used, mut sum) = (1, 0u64);
        for &c in costs {
            if c > limit {
                return false;
            }
            if sum + c > limit {
                used += 1;
                sum = 0;
            }
            sum += c;
        }
        used <= stages
    };
    let (mut lo, mut hi) = (0u64, costs.iter().sum::<u64>());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) { hi = mid } else { lo = mid + 1 }
    }
    // Fill greedily up to that limit, leaving at least one block for each stage still to come.
    let mut ranges = Vec::with_capacity(stages);
    let mut start = 0;
    for s in 0..stages {
        let left_after = stages - s - 1;
        let mut end = start;
        let mut sum = 0u64;
        while end < n && n - end > left_after && (end == start || sum + costs[end] <= lo) {
            sum += costs[end];
            end += 1;
        }
        if s == stages - 1 {
            end = n;
        }
        ranges.push(start..end);
        start = end;
    }
    ranges
}

/// The work of stage `stage` of `stages` in a step of `micro_batches` micro-batches under
/// `schedule`, with `chunks` chunks per stage (interleaved 1F1B above 1), in order. Under
/// interleaving it is Megatron-LM's order: the micro-batches in groups of `p`, each group through
/// the stage's chunks in turn (forwards from its first chunk, backwards from its last), after a
/// warm-up of `2 (p - 1 - stage) + (v - 1) p` forwards.
///
/// Panics if `stage` is not below `stages`, or if `chunks` is above 1 and `stages` does not
/// divide `micro_batches` ([`Pipeline::interleaved`] refuses that).
pub fn tasks(
    schedule: Schedule,
    stages: usize,
    stage: usize,
    micro_batches: usize,
    chunks: usize,
) -> Vec<Task> {
    let (p, r, m, v) = (stages.max(1), stage, micro_batches, chunks.max(1));
    assert!(r < p, "stage {r} of a pipeline of {p} stages");
    assert!(
        v == 1 || m.is_multiple_of(p),
        "{v} chunks per stage need micro-batches that the {p} stages divide, not {m}"
    );
    let at = |forward: bool, k: usize| {
        if v == 1 {
            return Task {
                forward,
                chunk: 0,
                micro: k,
            };
        }
        let turn = (k / p) % v;
        Task {
            forward,
            chunk: if forward { turn } else { v - 1 - turn },
            micro: (k / (p * v)) * p + k % p,
        }
    };
    let total = m * v;
    let warmup = match (schedule, v) {
        (Schedule::GPipe, _) => total,
        (Schedule::OneFOneB, 1) => (p - 1 - r).min(m),
        (Schedule::OneFOneB, _) => ((p - 1 - r) * 2 + (v - 1) * p).min(total),
    };
    let mut tasks: Vec<Task> = (0..warmup).map(|k| at(true, k)).collect();
    for k in 0..total - warmup {
        tasks.push(at(true, warmup + k));
        tasks.push(at(false, k));
    }
    tasks.extend((total - warmup..total).map(|k| at(false, k)));
    tasks
}

/// One stage of a pipeline: this rank's place in the pipeline group, the schedule and the number
/// of micro-batches per step.
#[derive(Clone)]
pub struct Pipeline {
    group: Communicator,
    schedule: Schedule,
    micro_batches: usize,
    /// Model chunks on this rank (1 but under [`Pipeline::interleaved`]).
    chunks: usize,
    /// The gradients' channel when chunks are interleaved (a communicator of its own over the
    /// group, so that a gradient and an activation going the same way between two ranks are
    /// never matched against each other); the group otherwise.
    gradients: Communicator,
    _one: std::sync::Arc<OneStage>,
}

/// One piece of a stage's work in a step: a forward or a backward of a micro-batch through one
/// of the rank's chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Task {
    /// A forward (`false`: a backward).
    pub forward: bool,
    /// The rank's chunk (0 but under [`Pipeline::interleaved`]).
    pub chunk: usize,
    /// The micro-batch.
    pub micro: usize,
}

/// A micro-batch this stage has run forward and not yet backward.
struct InFlight<B: AutodiffBackend, M, const D: usize> {
    /// The module this micro-batch ran through: the stage's, each parameter a leaf of its own
    /// (see [`own_leaves`]).
    module: M,
    output: Output<B, D>,
    /// The received activation, tracked so that its gradient can go back.
    input: Option<Tensor<B, D>>,
    bytes: usize,
}

enum Output<B: AutodiffBackend, const D: usize> {
    Activation(Tensor<B, D>),
    Loss(Tensor<B, 1>),
}

/// A send the step waits for when it ends.
enum Pending {
    Shape(Work<Vec<i64>>),
    Values(Work<Vec<f32>>),
}

/// A step's running account: time waited, graphs and bytes held.
struct Account {
    idle: Duration,
    in_flight: usize,
    max_in_flight: usize,
    bytes: usize,
    max_bytes: usize,
}

impl Pipeline {
    /// Stage `group.rank()` of a pipeline of `group.size()` stages, running `schedule` over
    /// `micro_batches` micro-batches per step. A process runs one stage at a time (a second
    /// while the first is alive is refused).
    pub fn new(
        group: Communicator,
        schedule: Schedule,
        micro_batches: usize,
    ) -> Result<Pipeline, PipelineError> {
        if micro_batches == 0 {
            return Err(PipelineError::NoMicroBatches);
        }
        let one = OneStage::take().ok_or(PipelineError::SecondStage)?;
        Ok(Pipeline {
            gradients: group.clone(),
            group,
            schedule,
            micro_batches,
            chunks: 1,
            _one: std::sync::Arc::new(one),
        })
    }

    /// This stage with `chunks` model chunks per rank, run by interleaved 1F1B (Megatron-LM's
    /// virtual pipeline stages): cut the model into `chunks * p` contiguous chunks (for example
    /// with [`partition`]); rank `r` holds chunks `r`, `r + p`, `r + 2p`, ..., its chunk `c`
    /// being the model's chunk `c * p + r`, and trains them with [`Pipeline::step_chunks`]. The
    /// model's first chunk (rank 0's chunk 0) reads the micro-batches; its last (rank `p - 1`'s
    /// chunk `chunks - 1`) computes the loss. Needs the 1F1B schedule, 2 stages or more and a
    /// number of micro-batches the stages divide (the order takes them `p` at a time). 1 chunk
    /// is the stage as it was. Collective over the pipeline group (the gradients get a channel
    /// of their own).
    pub fn interleaved(mut self, chunks: usize) -> Result<Pipeline, PipelineError> {
        let (p, m) = (self.stages(), self.micro_batches);
        let refuse = |problem: &str| {
            Err(PipelineError::Interleave {
                chunks,
                stages: p,
                micro_batches: m,
                problem: problem.to_string(),
            })
        };
        if chunks == 0 {
            return refuse("a rank holds 1 chunk or more");
        }
        if chunks == 1 {
            self.chunks = 1;
            self.gradients = self.group.clone();
            return Ok(self);
        }
        if self.schedule != Schedule::OneFOneB {
            return refuse("interleaving runs the 1f1b schedule");
        }
        if p < 2 {
            return refuse("interleaving needs 2 stages or more");
        }
        if !m.is_multiple_of(p) {
            return refuse("the stages must divide the micro-batches");
        }
        self.gradients = match self.group.split(Some(0), self.stage() as u32) {
            Ok(g) => g.expect("every stage chose the same color"),
            Err(source) => {
                return refuse(&format!("making the gradients' channel: {source}"));
            }
        };
        self.chunks = chunks;
        Ok(self)
    }

    /// This rank's stage.
    pub fn stage(&self) -> usize {
        self.group.rank()
    }

    /// The pipeline's stages.
    pub fn stages(&self) -> usize {
        self.group.size()
    }

    /// Whether this stage reads the micro-batches (it receives no activation; under
    /// interleaving, its first chunk reads them and its later chunks receive from the last
    /// stage).
    pub fn is_first(&self) -> bool {
        self.stage() == 0
    }

    /// Whether this stage computes the loss (it sends no activation; under interleaving, its
    /// last chunk computes it and its earlier chunks send to the first stage).
    pub fn is_last(&self) -> bool {
        self.stage() + 1 == self.stages()
    }

    /// Micro-batches per step.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The schedule.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// Model chunks on this rank (1 but under [`Pipeline::interleaved`]).
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// The bubble this stage's schedule leaves: [`bubble_interleaved`] of its stages,
    /// micro-batches and chunks.
    pub fn bubble(&self) -> f64 {
        bubble_interleaved(self.stages(), self.micro_batches, self.chunks)
    }

    /// The pipeline group: one rank per stage, in stage order.
    pub fn group(&self) -> &Communicator {
        &self.group
    }

    /// Sums the gradient of a parameter that the first and the last stage both hold (a token
    /// embedding tied to the head: the first stage's input and the last stage's output) over the
    /// two, as Megatron-LM's embedding group does: each ends with the first stage's gradient
    /// plus the last's, in that order, so the two copies take the same optimizer step, bit for
    /// bit. The first and the last stage call it after [`Pipeline::step`] with their copy; the
    /// stages between do not. Under interleaving the copies are the model's first and last
    /// chunks: rank 0 passes its chunk 0's gradients, rank `p - 1` its last chunk's. A no-op in
    /// a pipeline of one stage.
    ///
    /// Each rank sums its own part, as [`average_gradients`] averages: on stages split over a
    /// tensor-parallel group the pipeline group joins the ranks of the same place in their
    /// groups, so each sums its shard with the same shard of the other copy (the GPT's token
    /// table is split by vocabulary on both ends). Parts of two shapes fail the call, naming
    /// both.
    pub fn sum_shared<B: AutodiffBackend, const D: usize>(
        &self,
        grads: &mut GradientsParams,
        param: &Param<Tensor<B, D>>,
    ) -> Result<(), PipelineError> {
        let (stage, stages) = (self.stage(), self.stages());
        if stages == 1 {
            return Ok(());
        }
        let what = "summing a parameter shared by the first and the last stage";
        let other = match stage {
            0 => stages - 1,
            s if s + 1 == stages => 0,
            _ => {
                return Err(self.problem(
                    0,
                    "only the first and the last stage share parameters".to_string(),
                ));
            }
        };
        let Some(mine) = grads.remove::<B::InnerBackend, D>(param.id) else {
            return Err(self.problem(
                0,
                format!(
                    "the shared parameter {} has no gradient on this stage",
                    param.id
                ),
            ));
        };
        let (layout, shape, values) = part_of(mine).map_err(|e| self.problem(0, e))?;
        // The two parts must be the same part of the tensor: their shapes first (a part split
        // on another dimension, or a pending sum read whole against a shard, has another).
        let dims: Vec<i64> = shape.dims::<D>().iter().map(|&d| d as i64).collect();
        let shape_sent = self.group.send(dims.clone(), other);
        let their_dims = self
            .group
            .recv(vec![0i64; D], other)
            .wait()
            .map_err(|source| self.transfer(what, 0, source))?;
        shape_sent
            .wait()
            .map_err(|source| self.transfer(what, 0, source))?;
        if their_dims != dims {
            return Err(self.problem(
                0,
                format!(
                    "the shared parameter {}: this stage's part of its gradient has shape \
                     {dims:?}, stage {other}'s {their_dims:?} (the two copies are not split alike)",
                    param.id
                ),
            ));
        }
        let len = values.len();
        let sent = self.group.send(values, other);
        let theirs = self
            .group
            .recv(vec![0f32; len], other)
            .wait()
            .map_err(|source| self.transfer(what, 0, source))?;
        // The send gives its buffer back once the other stage has taken it.
        let values = sent
            .wait()
            .map_err(|source| self.transfer(what, 0, source))?;
        let (first, last) = if stage == 0 {
            (&values, &theirs)
        } else {
            (&theirs, &values)
        };
        let sum: Vec<f32> = first.iter().zip(last).map(|(a, b)| a + b).collect();
        let sum = placed_as::<B::InnerBackend, D>(&layout, shape, sum);
        grads.register::<B::InnerBackend, D>(param.id, sum);
        Ok(())
    }

    /// The order of this stage's work in a step: `true` a forward, `false` a backward (which
    /// micro-batch and chunk each is: [`Pipeline::tasks`]).
    pub fn order(&self) -> Vec<bool> {
        self.tasks().iter().map(|t| t.forward).collect()
    }

    /// This stage's work in a step, in order: each forward and backward of each micro-batch
    /// through each of its chunks ([`tasks`] of its place).
    pub fn tasks(&self) -> Vec<Task> {
        tasks(
            self.schedule,
            self.stages(),
            self.stage(),
            self.micro_batches,
            self.chunks,
        )
    }

    /// One training step of this stage: every micro-batch forward and backward in the
    /// schedule's order. `forward(module, i, input)` is the stage's forward of micro-batch `i`:
    /// `input` is `None` on the first stage (which reads its own micro-batch `i`) and the
    /// previous stage's activation elsewhere; it returns [`StageOutput::Activation`] on every
    /// stage but the last, which returns [`StageOutput::Loss`]. Returns the gradients of the
    /// stage's parameters for the mean of the micro-batches' losses, ready for the optimizer,
    /// and what the step measured. Every stage of the group calls it for every step. Under
    /// [`Pipeline::interleaved`], [`Pipeline::step_chunks`].
    pub fn step<B, M, const D: usize, F>(
        &self,
        module: &M,
        device: &B::Device,
        mut forward: F,
    ) -> Result<(GradientsParams, StepReport), PipelineError>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        F: FnMut(&M, usize, Option<Tensor<B, D>>) -> StageOutput<B, D>,
    {
        let modules = std::slice::from_ref(module);
        let (mut grads, report) =
            self.step_chunks(modules, device, |m, _, i, input| forward(m, i, input))?;
        Ok((grads.remove(0), report))
    }

    /// One training step of this rank's chunks under [`Pipeline::interleaved`] (or of its one
    /// stage, `modules` of one): `modules[c]` is its chunk `c`, and `forward(module, c, i,
    /// input)` runs micro-batch `i` through chunk `c`: `input` is `None` for the model's first
    /// chunk (rank 0's chunk 0), which reads its own micro-batch `i`, and the previous chunk's
    /// activation elsewhere; the model's last chunk (rank `p - 1`'s last) returns
    /// [`StageOutput::Loss`], every other one [`StageOutput::Activation`]. Returns each chunk's
    /// gradients for the mean of the micro-batches' losses, in chunk order, and what the step
    /// measured.
    pub fn step_chunks<B, M, const D: usize, F>(
        &self,
        modules: &[M],
        device: &B::Device,
        mut forward: F,
    ) -> Result<(Vec<GradientsParams>, StepReport), PipelineError>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        F: FnMut(&M, usize, usize, Option<Tensor<B, D>>) -> StageOutput<B, D>,
    {
        let started = Instant::now();
        let (stage, stages, m, v) = (self.stage(), self.stages(), self.micro_batches, self.chunks);
        if modules.len() != v {
            return Err(self.problem(
                0,
                format!(
                    "{} module(s) for a stage of {v} chunk(s): pass one per chunk",
                    modules.len()
                ),
            ));
        }
        // Where a chunk's activation comes from and goes to, and its gradient the other way:
        // the neighbouring ranks, round the ring between a rank's chunks.
        let (next, previous) = ((stage + 1) % stages, (stage + stages - 1) % stages);
        let is_first = |c: usize| stage == 0 && c == 0;
        let is_last = |c: usize| stage + 1 == stages && c + 1 == v;
        let mut account = Account {
            idle: Duration::ZERO,
            in_flight: 0,
            max_in_flight: 0,
            bytes: 0,
            max_bytes: 0,
        };
        let mut held: Vec<Option<InFlight<B, M, D>>> = (0..m * v).map(|_| None).collect();
        let mut sends = Vec::new();
        let mut grads: Vec<GradientsAccumulator<M>> =
            (0..v).map(|_| GradientsAccumulator::new()).collect();
        let mut losses = Vec::new();
        for Task {
            forward: is_forward,
            chunk: c,
            micro: i,
        } in self.tasks()
        {
            if is_forward {
                let received = if is_first(c) {
                    None
                } else {
                    Some(self.receive_activation::<D>(previous, i, &mut account)?)
                };
                let input = received.map(|(values, dims)| {
                    Tensor::<B, D>::from_data(TensorData::new(values, dims), device).require_grad()
                });
                let in_bytes = input.as_ref().map_or(0, |t| 4 * t.shape().num_elements());
                let local = own_leaves(modules[c].clone());
                let output = match (forward(&local, c, i, input.clone()), is_last(c)) {
                    (StageOutput::Activation(a), false) => {
                        sends.extend(self.send(
                            &self.group,
                            &a,
                            next,
                            i,
                            "sending the activation",
                            true,
                        )?);
                        Output::Activation(a)
                    }
                    (StageOutput::Loss(l), true) => {
                        losses.push(l.clone().into_scalar().elem::<f32>());
                        Output::Loss(l)
                    }
                    (StageOutput::Activation(_), true) => {
                        return Err(
                            self.problem(i, "the last stage returned an activation, not a loss")
                        );
                    }
                    (StageOutput::Loss(_), false) if v > 1 => {
                        return Err(self.problem(
                            i,
                            format!(
                                "chunk {c} of stage {stage} returned a loss, but the model's \
                                 last chunk is chunk {} of stage {}",
                                v - 1,
                                stages - 1
                            ),
                        ));
                    }
                    (StageOutput::Loss(_), false) => {
                        return Err(self.problem(
                            i,
                            format!(
                                "stage {stage} returned a loss, but stage {} comes after it",
                                stage + 1
                            ),
                        ));
                    }
                };
                let out_bytes = match &output {
                    Output::Activation(a) => 4 * a.shape().num_elements(),
                    Output::Loss(_) => 0,
                };
                let bytes = in_bytes + out_bytes;
                held[c * m + i] = Some(InFlight {
                    module: local,
                    output,
                    input,
                    bytes,
                });
                account.in_flight += 1;
                account.bytes += bytes;
                account.max_in_flight = account.max_in_flight.max(account.in_flight);
                account.max_bytes = account.max_bytes.max(account.bytes);
            } else {
                let entry = held[c * m + i]
                    .take()
                    .expect("a micro-batch goes backward after its forward");
                let gradients = match entry.output {
                    Output::Loss(l) => l.div_scalar(m as f32).backward(),
                    Output::Activation(a) => {
                        let dims = a.shape().dims::<D>();
                        let what = "receiving the gradient";
                        let values = self.receive_values(
                            &self.gradients,
                            dims,
                            next,
                            i,
                            what,
                            &mut account,
                        )?;
                        let g = Tensor::<B, D>::from_data(TensorData::new(values, dims), device);
                        (a * g).sum().backward()
                    }
                };
                if let Some(input) = &entry.input {
                    let Some(g) = input.grad(&gradients) else {
                        return Err(
                            self.problem(i, "the stage's output does not depend on its input")
                        );
                    };
                    sends.extend(self.send(
                        &self.gradients,
                        &g,
                        previous,
                        i,
                        "sending the gradient",
                        false,
                    )?);
                }
                let local = &entry.module;
                grads[c]
                    .accumulate::<B>(&modules[c], GradientsParams::from_grads(gradients, local));
                account.in_flight -= 1;
                account.bytes -= entry.bytes;
            }
        }
        let waited = Instant::now();
        for (work, micro, what) in sends {
            let taken = match work {
                Pending::Shape(w) => w.wait().map(drop),
                Pending::Values(w) => w.wait().map(drop),
            };
            taken.map_err(|source| self.transfer(what, micro, source))?;
        }
        account.idle += waited.elapsed();
        let loss = (!losses.is_empty()).then(|| losses.iter().sum::<f32>() / losses.len() as f32);
        Ok((
            grads.into_iter().map(|mut g| g.grads()).collect(),
            StepReport {
                loss,
                wall: started.elapsed(),
                idle: account.idle,
                max_in_flight: account.max_in_flight,
                max_activation_bytes: account.max_bytes,
            },
        ))
    }

    fn problem(&self, micro: usize, problem: impl Into<String>) -> PipelineError {
        PipelineError::Stage {
            stage: self.stage(),
            stages: self.stages(),
            micro,
            problem: problem.into(),
        }
    }

    fn transfer(&self, what: &'static str, micro: usize, source: CollectiveError) -> PipelineError {
        PipelineError::Transfer {
            stage: self.stage(),
            stages: self.stages(),
            what,
            micro,
            source: Box::new(source),
        }
    }

    /// Starts sending `t` to stage `to`: an activation's shape first (`with_shape`; a gradient's
    /// shape is its activation's, which the receiver knows), then its values as f32. No send is
    /// waited for here (a stage waiting for its neighbour to take an activation while that
    /// neighbour waits for it to take a gradient would never end); the step waits for them all
    /// when it ends.
    fn send<B2: burn::tensor::backend::Backend, const D: usize>(
        &self,
        over: &Communicator,
        t: &Tensor<B2, D>,
        to: usize,
        micro: usize,
        what: &'static str,
        with_shape: bool,
    ) -> Result<Vec<(Pending, usize, &'static str)>, PipelineError> {
        let dims = t.shape().dims::<D>();
        let shape: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let values = f32_values(t).map_err(|e| self.problem(micro, e))?;
        let mut sends = Vec::with_capacity(2);
        if with_shape {
            sends.push((Pending::Shape(over.send(shape, to)), micro, what));
        }
        sends.push((Pending::Values(over.send(values, to)), micro, what));
        Ok(sends)
    }

    /// Receives the activation of micro-batch `micro` from stage `from`, the one before (the
    /// last, for a rank's chunk after its first under interleaving): its values and shape.
    fn receive_activation<const D: usize>(
        &self,
        from: usize,
        micro: usize,
        account: &mut Account,
    ) -> Result<(Vec<f32>, [usize; D]), PipelineError> {
        let what = "receiving the activation";
        let waited = Instant::now();
        let shape = self
            .group
            .recv(vec![0i64; D], from)
            .wait()
            .map_err(|source| self.transfer(what, micro, source))?;
        account.idle += waited.elapsed();
        let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        if shape.iter().any(|&d| d < 0)
            || dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .is_none()
        {
            return Err(self.problem(
                micro,
                format!("stage {from} sent an activation of shape {shape:?}"),
            ));
        }
        let dims: [usize; D] = dims.try_into().expect("D dimensions were received");
        let values = self.receive_values(&self.group, dims, from, micro, what, account)?;
        Ok((values, dims))
    }

    /// Receives the values of a tensor of `dims` from stage `from` over `over`.
    fn receive_values<const D: usize>(
        &self,
        over: &Communicator,
        dims: [usize; D],
        from: usize,
        micro: usize,
        what: &'static str,
        account: &mut Account,
    ) -> Result<Vec<f32>, PipelineError> {
        let waited = Instant::now();
        let len = dims.iter().product();
        let values = over
            .recv(vec![0f32; len], from)
            .wait()
            .map_err(|source| self.transfer(what, micro, source))?;
        account.idle += waited.elapsed();
        Ok(values)
    }
}

/// Averages a step's gradients (from [`Pipeline::step`]) over `group`, the ranks that hold the
/// same stage (the stage's data-parallel group), in one all-reduce of the gradients in
/// `module`'s parameter order, after the step's last backward. Every member calls it with the
/// same stage. Returns the gradients, averaged; a group of one returns them as they are.
///
/// Each rank averages its own part of each gradient: on a stage split over a tensor-parallel
/// group (`TensorParallel<B>`), its shard of a split gradient, averaged with the same shard of
/// the other replicas and never gathered over the tensor-parallel group (a pending sum is summed
/// over that group first); on any other backend the whole gradient.
pub fn average_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &Communicator,
    module: &M,
    grads: GradientsParams,
) -> Result<GradientsParams, CollectiveError> {
    if group.size() == 1 {
        return Ok(grads);
    }
    type Part<B> = (ParamId, Layout<B>, burn::tensor::Shape, usize);
    struct Take<B: AutodiffBackend> {
        grads: GradientsParams,
        flat: Vec<f32>,
        taken: Vec<Part<B::InnerBackend>>,
        failed: Option<String>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Take<B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let Some(g) = self.grads.remove::<B::InnerBackend, D>(p.id) else {
                return;
            };
            match part_of(g) {
                Ok((like, shape, values)) => {
                    self.taken.push((p.id, like, shape, values.len()));
                    self.flat.extend(values);
                }
                Err(e) => self.failed = Some(e),
            }
        }
    }
    let mut take = Take::<B> {
        grads,
        flat: Vec::new(),
        taken: Vec::new(),
        failed: None,
    };
    module.visit(&mut take);
    if let Some(problem) = take.failed {
        return Err(CollectiveError::InvalidArgument {
            me: group.world_rank(),
            op: "all_reduce",
            problem,
        });
    }
    let averaged = group.all_reduce(take.flat, ReduceOp::Mean).wait()?;
    struct Put<'a, B: AutodiffBackend> {
        grads: GradientsParams,
        averaged: &'a [f32],
        taken: std::iter::Peekable<std::vec::IntoIter<Part<B::InnerBackend>>>,
        at: usize,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Put<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let Some((_, layout, shape, len)) = self.taken.next_if(|(id, ..)| *id == p.id) else {
                return;
            };
            let values = self.averaged[self.at..self.at + len].to_vec();
            self.at += len;
            let g = placed_as::<B::InnerBackend, D>(&layout, shape, values);
            self.grads.register::<B::InnerBackend, D>(p.id, g);
        }
    }
    let mut put = Put::<B> {
        grads: take.grads,
        averaged: &averaged,
        taken: take.taken.into_iter().peekable(),
        at: 0,
    };
    module.visit(&mut put);
    Ok(put.grads)
}

/// `module` with every parameter drawn now. Burn draws a parameter's values lazily, when it is
/// first used, from whatever the backend's generator holds then; a stage that builds the whole
/// model from a seed and keeps its own blocks calls this first, so that its blocks have the
/// values one process building the whole model draws (in module order).
pub fn materialised<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(module: M) -> M {
    struct Now;
    impl<B: burn::tensor::backend::Backend> burn::module::ModuleMapper<B> for Now {}
    module.map(&mut Now)
}

/// A tensor's values as f32.
fn f32_values<B: burn::tensor::backend::Backend, const D: usize>(
    t: &Tensor<B, D>,
) -> Result<Vec<f32>, String> {
    t.clone()
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("cannot read a tensor's values: {e:?}"))
}

/// `module` with each parameter a new leaf over the same values (same parameter ids, no copy):
/// each micro-batch's graph is then its own, as in plain gradient accumulation, instead of
/// every micro-batch in flight hanging off the same parameter nodes. Burn 0.21's autodiff
/// bookkeeping lost track of an input's gradient when several graphs that shared parameter
/// nodes were walked backward one after another (a GPipe step failed so in 3 of 5 runs).
fn own_leaves<B: AutodiffBackend, M: AutodiffModule<B>>(module: M) -> M {
    struct Leaves;
    impl<B: AutodiffBackend> burn::module::ModuleMapper<B> for Leaves {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let leaf = if tensor.is_require_grad() {
                tensor.detach().require_grad()
            } else {
                tensor
            };
            burn::module::Param::from_mapped_value(id, leaf, mapper)
        }
    }
    module.map(&mut Leaves)
}

/// The stages alive in this process (at most one: see [`PipelineError::SecondStage`]).
static STAGES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// This process's one live stage; the place is given back when the last clone of its
/// [`Pipeline`] is dropped.
struct OneStage;

impl OneStage {
    fn take() -> Option<OneStage> {
        use std::sync::atomic::Ordering;
        STAGES
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| OneStage)
    }
}

impl Drop for OneStage {
    fn drop(&mut self) {
        STAGES.store(0, std::sync::atomic::Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(ranges: &[Range<usize>]) -> Vec<usize> {
        ranges.iter().map(|r| r.len()).collect()
    }

    /// Stages are contiguous, cover every block once, each holds one at least, and the largest
    /// stage's cost is the smallest any contiguous split reaches (checked against every split).
    #[test]
    fn partition_is_contiguous_complete_and_balanced() {
        let cases: Vec<(Vec<u64>, usize)> = vec![
            (vec![1; 8], 2),
            (vec![1; 8], 4),
            (vec![5, 1, 1, 1, 1, 1], 2),
            (vec![1, 2, 3, 4, 5, 6, 7], 3),
            (vec![10, 1, 1, 1, 10], 3),
            (vec![3, 3], 2),
            (vec![2, 9, 2, 9, 2], 4),
        ];
        for (costs, stages) in cases {
            let ranges = partition(&costs, stages);
            assert_eq!(ranges.len(), stages);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[stages - 1].end, costs.len());
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(
                ranges.iter().all(|r| !r.is_empty()),
                "{costs:?}: {ranges:?}"
            );
            let worst = |rs: &[Range<usize>]| {
                rs.iter()
                    .map(|r| costs[r.clone()].iter().sum::<u64>())
                    .max()
                    .unwrap()
            };
            // Every split into `stages` non-empty contiguous parts: the cut points.
            let n = costs.len();
            let mut best = u64::MAX;
            let mut cuts: Vec<usize> = (1..stages).collect();
            loop {
                let mut rs = Vec::new();
                let mut start = 0;
                for &c in &cuts {
                    rs.push(start..c);
                    start = c;
                }
                rs.push(start..n);
                best = best.min(worst(&rs));
                // Next combination of cut points in 1..n.
                let mut i = stages - 1;
                loop {
                    if i == 0 {
                        break;
                    }
                    i -= 1;
                    if cuts[i] < n - (stages - 1 - i) {
                        cuts[i] += 1;
                        for j in i + 1..stages - 1 {
                            cuts[j] = cuts[j - 1] + 1;
                        }
                        break;
                    }
                    if i == 0 {
                        cuts.clear();
                    }
                }
                if cuts.len() != stages - 1 || stages == 1 {
                    break;
                }
            }
            assert_eq!(
                worst(&ranges),
                best,
                "{costs:?} over {stages}: {:?}",
                sizes(&ranges)
            );
        }
        assert_eq!(sizes(&partition(&[1; 8], 4)), vec![2, 2, 2, 2]);
    }

    #[test]
    fn the_bubble_is_the_textbook_fraction() {
        assert_eq!(bubble(1, 8), 0.0);
        assert!((bubble(2, 4) - 0.2).abs() < 1e-12);
        assert!((bubble(4, 8) - 3.0 / 11.0).abs() < 1e-12);
    }

    #[test]
    fn schedules_names_round_trip() {
        for s in [Schedule::GPipe, Schedule::OneFOneB] {
            assert_eq!(s.name().parse::<Schedule>(), Ok(s));
        }
        assert!("pipedream".parse::<Schedule>().is_err());
    }
}
