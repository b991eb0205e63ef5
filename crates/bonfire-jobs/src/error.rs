//! What can go wrong in a job, typed; every message names the setting, file, rank or collective
//! involved, and says what to do next where there is something to do.
//!
//! Settings are named by their `bonfire train` flag (`--batch`), which is also the name of the
//! request field with `-` for `_`.

use std::fmt;
use std::path::PathBuf;

use bonfire::collectives::CollectiveError;

/// A setting a resumed run's request contradicts: the request gives `given`, the checkpoint was
/// made with `saved`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Clash {
    /// The setting, by its flag (`--batch`).
    pub flag: &'static str,
    /// The value asked for.
    pub given: String,
    /// The checkpoint's value.
    pub saved: String,
}

impl Clash {
    /// The clash of a setting the request gives (`Some`) with the checkpoint's `saved` value,
    /// if they differ; `show` writes a value as the message shows it.
    pub fn check<T: PartialEq>(
        flag: &'static str,
        given: Option<&T>,
        saved: &T,
        show: impl Fn(&T) -> String,
    ) -> Option<Clash> {
        given.filter(|g| *g != saved).map(|g| Clash {
            flag,
            given: show(g),
            saved: show(saved),
        })
    }
}

impl fmt::Display for Clash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} (the checkpoint has {})",
            self.flag, self.given, self.saved
        )
    }
}

fn joined(clashes: &[Clash]) -> String {
    clashes
        .iter()
        .map(Clash::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn found_what(epoch: &Option<usize>) -> String {
    match epoch {
        Some(e) => format!("epoch {e}"),
        None => "no readable checkpoint".to_string(),
    }
}

/// Why a job could not be settled, started, trained or recorded.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// `--backend` names no backend bonfire trains on.
    #[error("--backend {given:?}: expected one of {}", crate::BackendKind::names())]
    UnknownBackend {
        /// What was given (lower-cased).
        given: String,
    },
    /// `--dataset` names no data set of the job.
    #[error("--dataset {given:?}: expected {expected}")]
    UnknownDataset {
        /// What was given.
        given: String,
        /// The names the job takes, in words.
        expected: &'static str,
    },
    /// A setting outside the values it can take.
    #[error("{flag} {given}: {why}")]
    Invalid {
        /// The setting.
        flag: &'static str,
        /// The value given.
        given: String,
        /// What it must be.
        why: &'static str,
    },
    /// `--ranks` disagrees with the job this process runs in.
    #[error("--ranks {ranks}, but this job has {world} ranks")]
    RanksMismatch {
        /// The ranks asked for.
        ranks: usize,
        /// The ranks of the job.
        world: usize,
    },
    /// `--resume` without a checkpoint directory, and no run in `./runs`.
    #[error("--resume: no run in ./runs to continue (pass --checkpoint-dir to name one)")]
    NothingToResume,
    /// A resumed run was asked for settings that would change its result.
    #[error(
        "cannot resume {} with {}: a resumed run must keep the settings that decide its result \
         (leave these flags out to take the checkpoint's)",
        .dir.display(),
        joined(.clashes)
    )]
    CannotResume {
        /// The run's checkpoint directory.
        dir: PathBuf,
        /// Every setting that differs.
        clashes: Vec<Clash>,
    },
    /// `--epochs` is below what the resumed run has already trained.
    #[error("--epochs {epochs}: {} already holds {done} epochs", .dir.display())]
    EpochsBelowDone {
        /// The epochs asked for.
        epochs: usize,
        /// The run's checkpoint directory.
        dir: PathBuf,
        /// The epochs its latest checkpoint holds.
        done: usize,
    },
    /// A fresh run was pointed at a directory that already holds one.
    #[error(
        "{} already holds checkpoints (latest {}): pass --resume to continue that run, or \
         choose another --checkpoint-dir",
        .dir.display(),
        .latest.display()
    )]
    CheckpointsExist {
        /// The directory.
        dir: PathBuf,
        /// Its latest checkpoint.
        latest: PathBuf,
    },
    /// A file or directory could not be read or written.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A data set could not be fetched or read (the message says which, and what to do).
    #[error(transparent)]
    Data(#[from] bonfire_datasets::DataError),
    /// The checkpoint directory has no `latest` checkpoint.
    #[error("{} holds no checkpoint to resume from (no `latest` file)", .dir.display())]
    NoCheckpoint {
        /// The directory.
        dir: PathBuf,
    },
    /// Every checkpoint in the directory failed its check (a file missing or unreadable, a
    /// checksum that does not match, a state that does not parse).
    #[error(
        "{} holds no usable checkpoint: {}",
        .dir.display(),
        .problems.join("; ")
    )]
    NoUsableCheckpoint {
        /// The directory.
        dir: PathBuf,
        /// What is wrong with each checkpoint, newest first (`epoch-N: ...`).
        problems: Vec<String>,
    },
    /// The state could not be written as JSON.
    #[error("cannot encode the checkpoint state: {0}")]
    EncodeState(#[source] serde_json::Error),
    /// A checkpoint's model or optimizer bytes are not a record that fits the job (damaged, cut
    /// short, or another model's).
    #[error("{}: the {what} cannot be read: {why}", .dir.display())]
    DamagedRecord {
        /// The checkpoint.
        dir: PathBuf,
        /// `model` or `optimizer state`.
        what: &'static str,
        /// What is wrong.
        why: String,
    },
    /// A model or optimizer could not be recorded as bytes.
    #[error("cannot record the {what}: {source}")]
    EncodeRecord {
        /// `model` or `optimizer state`.
        what: &'static str,
        /// The cause.
        source: burn::record::RecorderError,
    },
    /// The model rank 0 shared for evaluation cannot be read.
    #[error("rank 0's model: {0}")]
    Rank0Model(#[source] burn::record::RecorderError),
    /// The plots could not be written.
    #[error("{}: cannot write the plots: {source}", .dir.display())]
    Plots {
        /// The run's directory.
        dir: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Ranks found different checkpoints to resume from.
    #[error(
        "rank {rank} found {} in {}, this rank epoch {mine}: the ranks' checkpoints disagree",
        found_what(.found),
        .dir.display()
    )]
    CheckpointMismatch {
        /// The first rank that found something else.
        rank: usize,
        /// The epoch it found (`None`: no readable checkpoint).
        found: Option<usize>,
        /// The checkpoint directory.
        dir: PathBuf,
        /// The epoch this rank found.
        mine: usize,
    },
    /// The newest checkpoint could not be sent to the ranks whose directory lacks it.
    #[error(transparent)]
    ShareCheckpoint(bonfire::checkpoint::CheckpointError),
    /// A per-rank checkpoint (ZeRO-3) could not be written or read.
    #[error("per-rank checkpoint: {0}")]
    ShardedCheckpoint(#[from] bonfire::ShardedCheckpointError),
    /// This program's own path is unknown, so it cannot start its ranks.
    #[error("cannot find this program: {0}")]
    CurrentExe(#[source] std::io::Error),
    /// Starting or running the ranks failed (the message names the rank).
    #[error(transparent)]
    Launch(#[from] bonfire::launch::LaunchError),
    /// This rank could not join its job.
    #[error(transparent)]
    Init(Box<bonfire::InitError>),
    /// A collective failed (its message names the ranks it waited for).
    #[error("{during}: {source}")]
    Collective {
        /// What the ranks were doing.
        during: &'static str,
        /// The cause.
        source: Box<CollectiveError>,
    },
    /// Asynchronous parameter servers dropped this rank, which is alive (it was silent past the
    /// timeout): the ranks left go on without it.
    #[error(
        "rank {rank}: the parameter servers dropped this worker (it was silent past the timeout); \
         the ranks left go on without it"
    )]
    DroppedAlive {
        /// This rank.
        rank: usize,
    },
    /// Rank 0 could not settle the run; this rank took its decision.
    #[error("rank 0: {message}")]
    FromRank0 {
        /// Rank 0's error.
        message: String,
    },
    /// The settled run could not be handed from the parent or rank 0 to the ranks.
    #[error("the settled run could not be handed to the ranks: {0}")]
    Handoff(#[source] serde_json::Error),
    /// The settled run handed down belongs to another job.
    #[error("this rank runs `{expected}` but was handed the settled run of `{found}`")]
    WrongJob {
        /// The job this process runs.
        expected: &'static str,
        /// The job the settings were made for.
        found: String,
    },
    /// The environment `bonfire train` passes to its ranks holds a setting they would refuse
    /// (found before any rank starts).
    #[error("{0} (in the environment the ranks would inherit)")]
    Environment(Box<bonfire::InitError>),
    /// A variable `bonfire train` sets from its flags is set to something else in its
    /// environment.
    #[error(
        "{var}={value:?} is set in the environment, but this run has {run_has}: `bonfire train` \
         sets {var} from its flags; unset it"
    )]
    SetByFlags {
        /// The variable.
        var: &'static str,
        /// Its value in the environment.
        value: String,
        /// What the run's flags give, in words.
        run_has: String,
    },
    /// bf16 gradients were asked for, but the rank's data-parallel backend was not told.
    #[error(
        "--bf16 under `bonfire launch`: set BONFIRE_GRAD_DTYPE=bf16 for every rank \
         (`bonfire train {job} --bf16` does it for you)"
    )]
    Bf16NotSet {
        /// The job.
        job: &'static str,
    },
    /// A GPU could not be opened.
    #[error("cannot open the {device} device ({why}); {hint}")]
    Gpu {
        /// The runtime (`wgpu`, `CUDA`).
        device: String,
        /// The runtime's first panic message.
        why: String,
        /// What to do.
        hint: &'static str,
    },
    /// CUDA was asked for, but this build has none.
    #[error(
        "this bonfire was built without CUDA: rebuild it with \
         `CUDARC_CUDA_VERSION=13000 cargo build --release -p bonfire-cli --features cuda` \
         (CUDARC_CUDA_VERSION names your CUDA version; no toolkit is needed to build)"
    )]
    NoCuda,
    /// LibTorch was asked for, but this build has none.
    #[error(
        "this bonfire was built without LibTorch: rebuild it with \
         `LIBTORCH_USE_PYTORCH=1 cargo build --release -p bonfire-cli --features libtorch` \
         in a Python environment with PyTorch 2.9.0 (`pip install torch==2.9.0`), and run it \
         with that PyTorch's lib directory on LD_LIBRARY_PATH"
    )]
    NoLibtorch,
    /// A text cannot be trained on as the settings ask (too short for a window of the context).
    #[error(transparent)]
    Text(#[from] bonfire_datasets::text::TextError),
    /// Too few items to give every rank a shard.
    #[error(transparent)]
    Shard(#[from] bonfire_datasets::ShardError),
    /// A resumed GPT run's text has another vocabulary than its checkpoint.
    #[error(
        "the checkpoint's vocabulary ({saved} characters) is not the vocabulary of the \
         {dataset} text here ({found} characters): the text changed since the run began, and \
         the model's characters would no longer mean the same; resume with the text it began \
         with, or start a fresh run"
    )]
    VocabMismatch {
        /// The data set.
        dataset: &'static str,
        /// Characters in the checkpoint's vocabulary.
        saved: usize,
        /// Characters in the text's.
        found: usize,
    },
    /// A `--sample` prompt has characters the model never saw.
    #[error(
        "the prompt has characters outside the model's vocabulary: {outside:?} (it knows \
         {vocab:?})"
    )]
    PromptOutsideVocab {
        /// The characters it lacks.
        outside: String,
        /// The vocabulary.
        vocab: String,
    },
    /// A pipeline step failed (a neighbouring stage lost, or a stage's output not what its
    /// place gives).
    #[error(transparent)]
    Pipeline(#[from] bonfire::pipeline::PipelineError),
    /// The run is pipeline-parallel but this rank's job was started with another `BONFIRE_PP`.
    #[error(
        "this {job} run has {pp} pipeline stage(s), but the job was started with \
         BONFIRE_PP={found}: start it with `bonfire train {job}` (which sets it), or set \
         BONFIRE_PP={pp} for `bonfire launch`"
    )]
    PpNotSet {
        /// The job.
        job: &'static str,
        /// The run's stages.
        pp: usize,
        /// The job's.
        found: usize,
    },
    /// The run is tensor-parallel but this rank's job was started with another `BONFIRE_TP`.
    #[error(
        "this {job} run has {tp} tensor-parallel rank(s) per replica, but the job was started \
         with BONFIRE_TP={found}: start it with `bonfire train {job}` (which sets it), or set \
         BONFIRE_TP={tp} for `bonfire launch`"
    )]
    TpNotSet {
        /// The job.
        job: &'static str,
        /// The run's tensor-parallel size.
        tp: usize,
        /// The job's.
        found: usize,
    },
    /// A tensor-parallel plan did not apply to the model.
    #[error(transparent)]
    Plan(#[from] bonfire::PlanError),
    /// A rank would hold, or held, more model state than `--model-state-limit` allows.
    #[error(
        "--model-state-limit {limit_mib} MiB: {what} {held_mib:.2} MiB of model state ({parts}); \
         shard it over the ranks (--zero 3 holds 1/N of it, --zero 1 or 2 less), or raise the \
         limit"
    )]
    ModelStateLimit {
        /// The limit.
        limit_mib: f64,
        /// When: `each rank would hold` (checked before training).
        what: &'static str,
        /// What the rank holds, in MiB.
        held_mib: f64,
        /// Its parts: `parameters ..., gradients ..., Adam's state ... MiB`.
        parts: String,
    },
    /// `--sample` without a checkpoint directory, and no GPT run in `./runs`.
    #[error("--sample: no run in ./runs to sample from (pass --checkpoint-dir to name one)")]
    NothingToSample,
}

/// Refuses a setting given as zero (or below): `--batch 0: must be positive`.
pub(crate) fn positive<T: PartialOrd + Default + fmt::Display>(
    flag: &'static str,
    v: Option<T>,
) -> Result<(), JobError> {
    match v {
        Some(v) if v <= T::default() => Err(JobError::Invalid {
            flag,
            given: v.to_string(),
            why: "must be positive",
        }),
        _ => Ok(()),
    }
}

impl JobError {
    /// Whether the error is the caller's input (a flag, a value, a run directory or checkpoint
    /// that is not there or not usable): `bonfire train` exits 2 for these, as for a bad flag,
    /// and 1 for failures of the run itself.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            JobError::UnknownBackend { .. }
                | JobError::UnknownDataset { .. }
                | JobError::Invalid { .. }
                | JobError::RanksMismatch { .. }
                | JobError::NothingToResume
                | JobError::NothingToSample
                | JobError::ModelStateLimit { .. }
                | JobError::CannotResume { .. }
                | JobError::EpochsBelowDone { .. }
                | JobError::CheckpointsExist { .. }
                | JobError::NoCheckpoint { .. }
                | JobError::VocabMismatch { .. }
                | JobError::PromptOutsideVocab { .. }
                | JobError::Text(_)
                | JobError::Shard(_)
                | JobError::Environment(_)
                | JobError::SetByFlags { .. }
        )
    }

    /// A `path: cause` error maker for `map_err`.
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> JobError {
        let path = path.into();
        move |source| JobError::Io { path, source }
    }

    /// A collective error maker for `map_err`, saying what the ranks were doing.
    pub(crate) fn collective(during: &'static str) -> impl FnOnce(CollectiveError) -> JobError {
        move |source| JobError::Collective {
            during,
            source: Box::new(source),
        }
    }
}

impl From<bonfire::InitError> for JobError {
    fn from(e: bonfire::InitError) -> Self {
        JobError::Init(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_is_involved() {
        let e = JobError::CannotResume {
            dir: "runs/vision-1".into(),
            clashes: vec![
                Clash::check("--batch", Some(&32), &64, |v| v.to_string()).unwrap(),
                Clash::check("--lr", Some(&0.1), &0.003, |v| v.to_string()).unwrap(),
            ],
        };
        assert_eq!(
            e.to_string(),
            "cannot resume runs/vision-1 with --batch 32 (the checkpoint has 64), --lr 0.1 (the \
             checkpoint has 0.003): a resumed run must keep the settings that decide its result \
             (leave these flags out to take the checkpoint's)"
        );
        assert!(Clash::check("--batch", Some(&64), &64, |v| v.to_string()).is_none());
        assert!(Clash::check("--batch", None, &64, |v: &i32| v.to_string()).is_none());
        let e = JobError::CheckpointMismatch {
            rank: 1,
            found: None,
            dir: "d".into(),
            mine: 2,
        };
        assert!(
            e.to_string()
                .starts_with("rank 1 found no readable checkpoint in d")
        );
    }
}
