//! What can go wrong in a command, typed; `main` prints `error: {message}` and exits 2 for the
//! caller's input (as clap's own errors, bad flag values included, do) and 1 for a failure.

use bonfire::collectives::CollectiveError;

/// A command failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// A training job failed (the message names the flag, file, rank or collective).
    #[error(transparent)]
    Job(#[from] bonfire_jobs::JobError),
    /// Starting or running ranks failed (the message names the rank).
    #[error(transparent)]
    Launch(#[from] bonfire::launch::LaunchError),
    /// This process could not join its job.
    #[error(transparent)]
    Init(#[from] bonfire::InitError),
    /// A collective failed (the message names the ranks and the collective).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// `--resolved` was given outside a launched job.
    #[error("--resolved is set by `bonfire train` on the ranks it starts")]
    ResolvedByHand,
    /// `bonfire doctor` found something essential missing (its lines say what and how to fix).
    #[error("bonfire doctor: {0} failed (see above)")]
    Doctor(String),
    /// `bonfire launch` was given no program.
    #[error("no program to launch")]
    NoProgram,
    /// `bench collectives --transport` asks for other lanes than `bonfire launch --transport`.
    #[error(
        "--transport {asked}, but this job was launched with BONFIRE_TRANSPORT={launched}: pass `bonfire launch --transport {asked}` (or --transport {launched} here)"
    )]
    TransportMismatch {
        asked: &'static str,
        launched: String,
    },
    /// This program's own path is unknown, so it cannot start its ranks.
    #[error("cannot find this program: {0}")]
    CurrentExe(#[source] std::io::Error),
    /// A benchmark's socket failed.
    #[error("{during}: {source}")]
    Io {
        /// What the benchmark was doing.
        during: &'static str,
        /// The cause.
        source: std::io::Error,
    },
    /// The QUIC link benchmark failed (its message says where).
    #[error("QUIC loopback: {0}")]
    Quic(#[source] bonfire::transport::quic::bench::BenchError),
    /// A tensor-parallel plan did not apply.
    #[error(transparent)]
    Plan(#[from] bonfire::PlanError),
    /// A pipeline step failed (the message names the stage, the micro-batch and the peer).
    #[error(transparent)]
    Pipeline(#[from] bonfire::pipeline::PipelineError),
    /// A benchmark's result file could not be written or read.
    #[error("{}: {source}", path.display())]
    ResultFile {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A benchmark's result file did not parse.
    #[error("{}: {source}", path.display())]
    ResultJson {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// `bonfire bench tp`'s mesh does not fit its batch.
    #[error("--dp {dp} x --tp {tp}: both must be at least 1, and dp must divide --batch {batch}")]
    Mesh {
        /// Replicas.
        dp: usize,
        /// Ranks per replica.
        tp: usize,
        /// The global batch.
        batch: usize,
    },
    /// A flag combination this build or machine cannot run (the message says which).
    #[error("{0}")]
    Usage(String),
    /// The device lane failed (the message names the collective, its size and the rank).
    #[cfg(feature = "cuda")]
    #[error("{0}")]
    Lane(String),
    /// A benchmark thread panicked.
    #[error("{0} panicked")]
    Panicked(&'static str),
    /// `bonfire bench wan` could not make its two sites.
    #[error(
        "bonfire bench wan needs network namespaces (root and the `ip` tool, from iproute2): {0}"
    )]
    NoNamespaces(String),
    /// A site's launcher of `bonfire bench wan` failed.
    #[error("bonfire bench wan: site {site}'s launcher {status} (its output above names the rank)")]
    SiteFailed {
        /// `A` or `B`.
        site: &'static str,
        /// How it ended.
        status: std::process::ExitStatus,
    },
}

impl CliError {
    /// 2 for the caller's input (as clap exits for a bad flag), 1 for a failure of the command.
    pub(crate) fn exit_code(&self) -> std::process::ExitCode {
        match self {
            CliError::Job(e) if e.is_usage() => std::process::ExitCode::from(2),
            CliError::ResolvedByHand
            | CliError::NoProgram
            | CliError::Mesh { .. }
            | CliError::Usage(_)
            | CliError::TransportMismatch { .. } => std::process::ExitCode::from(2),
            // The launcher's own code: 2 for the job's input, 1 for a failed rank.
            CliError::SiteFailed { status, .. } => status
                .code()
                .and_then(|c| u8::try_from(c).ok())
                .filter(|&c| c != 0)
                .map_or(
                    std::process::ExitCode::FAILURE,
                    std::process::ExitCode::from,
                ),
            _ => std::process::ExitCode::FAILURE,
        }
    }

    /// An I/O error maker for `map_err`, saying what was being done.
    pub(crate) fn io(during: &'static str) -> impl FnOnce(std::io::Error) -> CliError {
        move |source| CliError::Io { during, source }
    }
}

/// A flag's value clap cannot take (clap prints it and exits 2).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ArgError {
    /// Not a number above zero.
    #[error("{0:?} is not a positive number")]
    NotPositive(String),
    /// Not a number of seconds.
    #[error("{0:?} is not a number of seconds")]
    NotSeconds(String),
    /// Not above zero seconds (or absurdly many).
    #[error("{0} is not a positive number of seconds")]
    NotPositiveSeconds(String),
    /// Not a byte size.
    #[error("`{0}` is not a size (examples: 4096, 64K, 1MiB, 2G)")]
    NotASize(String),
    /// A byte size with a unit that is not K, M or G.
    #[error("`{given}` has an unknown unit `{unit}` (use K, M or G)")]
    UnknownUnit {
        /// The size given.
        given: String,
        /// Its unit.
        unit: String,
    },
    /// A byte size beyond this machine's addresses.
    #[error("`{0}` is too large")]
    TooLarge(String),
    /// Not a number of zero or more.
    #[error("{0:?} is not a number of zero or more")]
    NotNonNegative(String),
    /// Not a percentage below 100.
    #[error("{0:?} is not a percentage from 0 up to (not including) 100")]
    NotPercent(String),
}
