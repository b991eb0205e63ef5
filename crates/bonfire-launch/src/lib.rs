//! How a bonfire job starts: the environment a rank reads ([`JobEnv`]: torchrun names, Slurm,
//! or a single rank) and the launcher that starts a node's ranks ([`launch`], behind
//! `bonfire launch`), connecting to a job's transport ([`connect`]), the rule that names a
//! job's stragglers ([`stragglers`]), and the log subscriber every bonfire process installs
//! ([`init_logging`]);
//! network namespaces ([`netns`]) and a user-space slow link ([`wan`]) play separate hosts and
//! sites on one machine (`bonfire bench wan`, the tests).

mod control;
pub use control::{LeaderProbe, probe_leader};
pub mod env;
pub mod join;
mod launcher;
pub mod logging;
pub mod netns;
pub mod slurm;
pub mod stragglers;
pub mod wan;

pub use env::{EnvError, EnvSource, JobEnv, SecretSource};
pub use join::{JoinError, connect};
pub use launcher::{
    AddrError, CpuBind, DEFAULT_JOIN_TIMEOUT, LaunchConfig, LaunchError, Launched, free_local_port,
    launch, split_host_port,
};
pub use logging::{LogFilterError, filter_from_env, init_logging, init_logging_with_prefix};
