//! Settling a run: the job-independent options ([`RunOptions`]), the settled run every rank
//! trains ([`Settings`]), and the rules that get from one to the other ([`settle`]): on a resume,
//! options left out take the checkpoint's values and settings that decide the result must match
//! it; a fresh run gets a new `runs/<job>-N` directory.

use std::path::{Path, PathBuf};

use bonfire_datasets::cache_root;
use serde::{Deserialize, Serialize};

use crate::JobError;
use crate::backend::BackendKind;
use crate::checkpoint;
use crate::job::{Job, JobConfig};
use crate::report::Reporter;

/// Where runs without `--checkpoint-dir` go, relative to the working directory.
pub const RUNS_DIR: &str = "runs";

/// What a caller asks of any job, besides the job's own request: `None` (or `false`) where left
/// to the default, or on a resume to the checkpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunOptions {
    /// Epochs in all; a resumed run counts the ones already done (default: the job's, or the
    /// checkpoint's).
    pub epochs: Option<usize>,
    /// Where checkpoints, plots and the report go (default: a new `runs/<job>-N`; on a resume,
    /// the newest).
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue from the latest checkpoint of `checkpoint_dir`.
    pub resume: bool,
    /// The backend to train on (default: auto, the fastest the device has).
    pub backend: Option<BackendKind>,
    /// The data set cache (default: [`cache_root`]).
    pub data_dir: Option<PathBuf>,
    /// Keep only the newest this many checkpoints, deleting older ones as new ones are written
    /// (default: keep all; at least 1).
    pub keep_checkpoints: Option<usize>,
    /// Times the parent starts the ranks again after one fails (default: 0); each time they
    /// resume from the newest checkpoint any rank can read (sent to the ranks that lack it).
    pub max_restarts: u32,
    /// Draw the loss plot on a logarithmic scale.
    pub log_loss: bool,
    /// Shard the model's state over the data-parallel replicas at this ZeRO stage: 1, the
    /// optimizer's state ([`bonfire::sharded`]); 2, the gradients too; 3, the parameters too
    /// ([`bonfire::fully_shard`], the GPT job only) (default: `None`, every rank keeps the whole
    /// state). It changes no result, so a resumed run may turn it on, off or to another stage.
    pub zero: Option<u8>,
    /// Refuse to train when a rank would hold more than this many MiB of model state
    /// (parameters, gradients and Adam's state), and say what it held after training (the GPT
    /// job; default: no limit).
    pub model_state_limit_mib: Option<f64>,
    /// Under ZeRO-3, how many parameters each rank gathers ahead of need at a time
    /// ([`bonfire::prefetch_gathers`]; default: 8). It changes no result.
    pub prefetch: Option<usize>,
    /// Load checkpoints that have no `SHA256SUMS` (written before bonfire checksummed them),
    /// unchecked; without it they are passed over as damaged ones are.
    pub allow_unchecked: bool,
}

/// A settled run: what every rank trains with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings<C> {
    /// The settings that decide the result.
    pub config: C,
    /// Epochs in all (those a resumed run already holds included).
    pub epochs: usize,
    /// Where checkpoints, plots and the report go.
    pub checkpoint_dir: PathBuf,
    /// Whether the run continues from the latest checkpoint of `checkpoint_dir`.
    pub resume: bool,
    /// The backend it trains on.
    pub backend: BackendKind,
    /// The data set cache.
    pub data_dir: PathBuf,
    /// How many checkpoints to keep (`None`: all).
    #[serde(default)]
    pub keep_checkpoints: Option<usize>,
    /// Whether the loss plot has a logarithmic scale.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub log_loss: bool,
    /// The ZeRO stage the optimizer's state is sharded with (`None`: not sharded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero: Option<u8>,
    /// The most model state a rank may hold, in MiB (`None`: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_state_limit_mib: Option<f64>,
    /// Under ZeRO-3, the parameters gathered ahead of need at a time (`None`: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<usize>,
    /// Whether checkpoints without `SHA256SUMS` load (unchecked).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_unchecked: bool,
}

impl<C> Settings<C> {
    /// What each data-parallel rank keeps only its share of (`--zero`): the optimizer's state,
    /// and at stage 2 the gradients too; `None` for whole on every rank.
    pub fn zero_stage(&self) -> Option<bonfire::ZeroStage> {
        self.zero.and_then(bonfire::ZeroStage::from_number)
    }

    /// Whether checkpoints without `SHA256SUMS` load.
    pub fn unchecked(&self) -> checkpoint::Unchecked {
        checkpoint::Unchecked::allowed(self.allow_unchecked)
    }
}

/// The runs of job `job` under `base` (`<base>/<job>-N`): the newest (highest N), if any, and
/// the directory the next one gets.
pub fn runs(base: &Path, job: &str) -> (Option<PathBuf>, PathBuf) {
    let prefix = format!("{job}-");
    let mut best: Option<u64> = None;
    if let Ok(entries) = std::fs::read_dir(base) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(n) = name
                .strip_prefix(&prefix)
                .and_then(|n| n.parse::<u64>().ok())
            {
                best = Some(best.map_or(n, |b| b.max(n)));
            }
        }
    }
    (
        best.map(|n| base.join(format!("{job}-{n}"))),
        base.join(format!("{job}-{}", best.map_or(1, |n| n + 1))),
    )
}

/// Settles a run of `job` from `request` and `options` (and, on a resume, the checkpoint), in a
/// job of `world_size` ranks if it runs in one already; fetches what the run reads. A fallback
/// taken is told to `reporter`.
pub fn settle<J: Job>(
    job: &J,
    request: &J::Request,
    options: &RunOptions,
    world_size: Option<usize>,
    reporter: &mut dyn Reporter,
) -> Result<Settings<J::Config>, JobError> {
    job.check(request)?;
    if let Some(mib) = options.model_state_limit_mib
        && !(mib.is_finite() && mib > 0.0)
    {
        return Err(JobError::Invalid {
            flag: "--model-state-limit",
            given: mib.to_string(),
            why: "must be a positive number of MiB",
        });
    }
    if let Some(stage) = options
        .zero
        .filter(|&s| bonfire::ZeroStage::from_number(s).is_none())
    {
        return Err(JobError::Invalid {
            flag: "--zero",
            given: stage.to_string(),
            why: "bonfire has ZeRO stages 1 (the optimizer's state sharded over the replicas), \
                  2 (the gradients too) and 3 (the parameters too)",
        });
    }
    // A resumed run's ranks are the checkpoint's (with what the request may change): checked
    // once it is settled.
    if let (Some(world), Some(ranks)) = (world_size, job.requested_ranks(request))
        && world != ranks
        && !options.resume
    {
        return Err(JobError::RanksMismatch { ranks, world });
    }
    let settings = if options.resume {
        settle_resumed(job, request, options)
    } else if crate::rank::restart_round() > 0 {
        settle_restarted(job, request, options, world_size, reporter)
    } else {
        settle_fresh(job, request, options, world_size, reporter)
    }?;
    if let Some(world) = world_size
        && world != settings.config.ranks()
    {
        return Err(JobError::RanksMismatch {
            ranks: settings.config.ranks(),
            world,
        });
    }
    Ok(settings)
}

/// The environment the parent passes to its ranks, checked before it makes a run directory or
/// starts a rank, so that a bad value is refused once, as a bad flag is: what the ranks read
/// from it as `bonfire::init` reads it ([`bonfire::check_env`]), and the variables the parent
/// sets from the run's flags (`BONFIRE_TP`, `BONFIRE_PP`, `BONFIRE_GRAD_DTYPE`), which where
/// set must say what the flags say (otherwise the ranks would inherit a mesh or a gradient type
/// the run did not ask for).
pub(crate) fn inherited_env<C: JobConfig>(config: &C) -> Result<(), JobError> {
    // What init would read: its own parsers first, so that a malformed value gets its message.
    readable_env(config.ranks())?;
    env_matches_flags(config)
}

/// What `bonfire::init` would refuse to read in the environment of a job of `ranks` ranks.
fn readable_env(ranks: usize) -> Result<(), JobError> {
    bonfire::check_env(ranks).map_err(|e| JobError::Environment(Box::new(e)))
}

/// The variables the parent sets from the run's flags, where set, say what the flags say.
fn env_matches_flags<C: JobConfig>(config: &C) -> Result<(), JobError> {
    let (tp, pp) = (config.tensor_parallel(), config.pipeline_stages());
    let number = |v: &str| v.trim().parse::<usize>().ok();
    let set = |var: &str| std::env::var(var).ok().filter(|v| !v.trim().is_empty());
    let mismatch = |var, value, run_has| JobError::SetByFlags {
        var,
        value,
        run_has,
    };
    if let Some(v) = set("BONFIRE_TP").filter(|v| number(v) != Some(tp)) {
        return Err(mismatch(
            "BONFIRE_TP",
            v,
            format!("{tp} rank(s) per tensor-parallel group"),
        ));
    }
    if let Some(v) = set("BONFIRE_PP").filter(|v| number(v) != Some(pp)) {
        return Err(mismatch("BONFIRE_PP", v, format!("{pp} pipeline stage(s)")));
    }
    if let Some(v) = set("BONFIRE_GRAD_DTYPE") {
        // Parsed as the ranks parse it (f32, float32, bf16, bfloat16, any case).
        let theirs = bonfire::backend::DataParallelConfig::from_env()
            .map_err(|e| JobError::Environment(Box::new(bonfire::InitError::Config(e))))?
            .grad_dtype;
        let bf16 = theirs == bonfire::backend::GradDType::Bf16;
        if bf16 != config.bf16_gradients() {
            let ours = if config.bf16_gradients() {
                "bf16"
            } else {
                "f32"
            };
            return Err(mismatch(
                "BONFIRE_GRAD_DTYPE",
                v,
                format!("{ours} gradients"),
            ));
        }
    }
    Ok(())
}

/// `--zero` with pipeline stages or a local strategy, and `--zero 3` with tensor parallelism or
/// in a job that does not shard its parameters: refused (a fresh run refuses it before making
/// its directory).
fn zero_with_stages<C: JobConfig>(options: &RunOptions, config: &C) -> Result<(), JobError> {
    // A job that checks its model state (the GPT job) does so for all-reduce runs without
    // pipeline stages (what it predicts a rank holds).
    if let Some(mib) = options.model_state_limit_mib {
        let why = if !config.checks_model_state() {
            Some("this job does not check its model state; the GPT job does")
        } else if config.pipeline_stages() > 1 {
            Some("a pipeline's stages hold their own blocks; the limit is checked without --pp")
        } else if config.local_strategy() {
            Some(
                "local strategies and parameter servers hold other state; the limit is checked \
                 for --strategy allreduce",
            )
        } else {
            None
        };
        if let Some(why) = why {
            return Err(JobError::Invalid {
                flag: "--model-state-limit",
                given: mib.to_string(),
                why,
            });
        }
    }
    if let Some(depth) = options.prefetch
        && options.zero != Some(3)
    {
        return Err(JobError::Invalid {
            flag: "--prefetch",
            given: depth.to_string(),
            why: "it starts ZeRO-3's parameter gathers ahead of need; give it with --zero 3",
        });
    }
    if options.zero == Some(3) {
        if !config.fully_shards() {
            return Err(JobError::Invalid {
                flag: "--zero",
                given: "3".into(),
                why: "this job shards the optimizer's state and the gradients (--zero 1 or 2), \
                      not its parameters",
            });
        }
        let tp = config.tensor_parallel();
        if tp > 1 {
            return Err(JobError::Invalid {
                flag: "--zero",
                given: format!("3 with --tp {tp}"),
                why: "ZeRO-3 shards the parameters over the data-parallel replicas, and \
                      tensor parallelism splits them already; use --zero 1 or 2 with --tp",
            });
        }
    }
    let stages = config.pipeline_stages();
    match options.zero.filter(|_| stages > 1) {
        Some(zero) => Err(JobError::Invalid {
            flag: "--zero",
            given: format!("{zero} with --pp {stages}"),
            why: "a pipeline's stages keep their own optimizer state already; ZeRO shards it \
                  over data-parallel replicas without stages",
        }),
        None if options.zero.is_some() && config.local_strategy() => Err(JobError::Invalid {
            flag: "--zero",
            given: "with a --strategy other than allreduce".into(),
            why: "local-sgd and diloco keep each replica's optimizer state, and parameter \
                  servers keep it on the servers; ZeRO shards one state over replicas that \
                  all-reduce",
        }),
        None => Ok(()),
    }
}

/// A fresh run started again by the launcher after a failure (`BONFIRE_RESTART_ROUND` above
/// 0): the run directory the first round settled (the one named, or the newest
/// `runs/<job>-N`), resumed if it holds a checkpoint, else started afresh in it.
fn settle_restarted<J: Job>(
    job: &J,
    request: &J::Request,
    options: &RunOptions,
    world_size: Option<usize>,
    reporter: &mut dyn Reporter,
) -> Result<Settings<J::Config>, JobError> {
    let dir = match &options.checkpoint_dir {
        Some(d) => d.clone(),
        None => {
            let (newest, next) = runs(Path::new(RUNS_DIR), J::NAME);
            newest.unwrap_or(next)
        }
    };
    let options = RunOptions {
        checkpoint_dir: Some(dir.clone()),
        resume: checkpoint::latest(&dir)?.is_some(),
        ..options.clone()
    };
    if options.resume {
        settle_resumed(job, request, &options)
    } else {
        settle_fresh(job, request, &options, world_size, reporter)
    }
}

fn data_dir(options: &RunOptions) -> PathBuf {
    options.data_dir.clone().unwrap_or_else(cache_root)
}

/// The backend the run trains on: the one asked for, or for `auto` (the default) the fastest the
/// device has; settled once, so every rank trains on the same.
fn backend(options: &RunOptions) -> BackendKind {
    options.backend.unwrap_or_default().resolve()
}

/// A resumed run: the checkpoint's settings, which the request may repeat but not change.
fn settle_resumed<J: Job>(
    job: &J,
    request: &J::Request,
    options: &RunOptions,
) -> Result<Settings<J::Config>, JobError> {
    let dir = match &options.checkpoint_dir {
        Some(d) => d.clone(),
        None => runs(Path::new(RUNS_DIR), J::NAME)
            .0
            .ok_or(JobError::NothingToResume)?,
    };
    let loaded = checkpoint::load::<J::Config, J::Record>(
        &dir,
        checkpoint::Unchecked::allowed(options.allow_unchecked),
    )?;
    let clashes = job.clashes(request, &loaded.state.config);
    if !clashes.is_empty() {
        return Err(JobError::CannotResume { dir, clashes });
    }
    let epochs = options
        .epochs
        .or_else(|| job.rounds(&loaded.state.config))
        .unwrap_or(loaded.state.epochs);
    if epochs < loaded.state.epochs_done {
        return Err(JobError::EpochsBelowDone {
            epochs,
            dir,
            done: loaded.state.epochs_done,
        });
    }
    let data_dir = data_dir(options);
    job.prepare(&loaded.state.config, &data_dir)?;
    let config = job.resumed_config(request, loaded.state.config)?;
    zero_with_stages(options, &config)?;
    Ok(Settings {
        config,
        epochs,
        checkpoint_dir: dir,
        resume: true,
        backend: backend(options),
        data_dir,
        keep_checkpoints: options.keep_checkpoints,
        log_loss: options.log_loss,
        zero: options.zero,
        model_state_limit_mib: options.model_state_limit_mib,
        prefetch: options.prefetch,
        allow_unchecked: options.allow_unchecked,
    })
}

/// A fresh run: a new directory (or an empty one named), the request's settings and defaults.
fn settle_fresh<J: Job>(
    job: &J,
    request: &J::Request,
    options: &RunOptions,
    world_size: Option<usize>,
    reporter: &mut dyn Reporter,
) -> Result<Settings<J::Config>, JobError> {
    let checkpoint_dir = match &options.checkpoint_dir {
        Some(d) => {
            if let Some(latest) = checkpoint::latest(d)? {
                return Err(JobError::CheckpointsExist {
                    dir: d.clone(),
                    latest,
                });
            }
            d.clone()
        }
        None => runs(Path::new(RUNS_DIR), J::NAME).1,
    };
    let ranks = world_size.unwrap_or(job.requested_ranks(request).unwrap_or(J::DEFAULT_RANKS));
    if world_size.is_none() {
        // What the ranks would refuse to read, refused before `configure` fetches a data set.
        readable_env(ranks)?;
    }
    let data_dir = data_dir(options);
    let config = job.configure(request, ranks, &data_dir, reporter)?;
    zero_with_stages(options, &config)?;
    if world_size.is_none() {
        env_matches_flags(&config)?;
    }
    // Made once the settings hold: a refused run leaves no directory behind.
    std::fs::create_dir_all(&checkpoint_dir).map_err(JobError::io(&checkpoint_dir))?;
    let epochs = options
        .epochs
        .or_else(|| job.rounds(&config))
        .unwrap_or(J::DEFAULT_EPOCHS);
    debug_assert_eq!(config.ranks(), ranks);
    Ok(Settings {
        config,
        epochs,
        checkpoint_dir,
        resume: false,
        backend: backend(options),
        data_dir,
        keep_checkpoints: options.keep_checkpoints,
        log_loss: options.log_loss,
        zero: options.zero,
        model_state_limit_mib: options.model_state_limit_mib,
        prefetch: options.prefetch,
        allow_unchecked: options.allow_unchecked,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_numbered_per_job() {
        let base = std::env::temp_dir().join(format!("bonfire-runs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        assert_eq!(runs(&base, "vision"), (None, base.join("vision-1")));
        for d in ["vision-1", "vision-7", "vision-x", "gpt-9"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        assert_eq!(
            runs(&base, "vision"),
            (Some(base.join("vision-7")), base.join("vision-8"))
        );
        assert_eq!(
            runs(&base, "gpt"),
            (Some(base.join("gpt-9")), base.join("gpt-10"))
        );
        std::fs::remove_dir_all(&base).unwrap();
    }
}
