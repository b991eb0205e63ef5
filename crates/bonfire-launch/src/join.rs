//! Connecting to the job this process was started in, with no deep-learning framework and no
//! collectives involved: the job's secret, the QUIC rendezvous and the shared-memory lanes
//! ([`connect`]). `bonfire::init` builds its communicators over the transport it returns, and so
//! does the crate for Burn 0.22.

use std::time::Duration;

use bonfire_transport::shm::ShmConfig;
use bonfire_transport::{JobTransport, JobTransportError, QuicConfig, Secret, SecretError};
use tokio::runtime::Handle;

use crate::env::{self, EnvSource, JobEnv, SecretSource};

/// Why [`connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// `BONFIRE_SECRET` holds no usable secret.
    #[error("BONFIRE_SECRET: {0}")]
    SecretVar(#[source] SecretError),
    /// The secret file named by `BONFIRE_SECRET_FILE` holds no usable secret.
    #[error("{0}")]
    SecretFile(#[source] SecretError),
    /// A job of several ranks was described without a secret.
    #[error("this job of {world_size} ranks has no secret: {hint}")]
    NoSecret {
        /// Ranks in the job.
        world_size: usize,
        /// How to give it one.
        hint: &'static str,
    },
    /// The job could not be joined.
    #[error("{0}")]
    Connect(#[from] JobTransportError),
}

/// Connects to the job `env` describes, on `runtime` (the collectives' runtime, which keeps
/// driving the links afterwards): `None` for a job of one rank, which needs no transport;
/// otherwise QUIC between hosts and shared memory (`shm`) within one, authenticated by the job's
/// secret (`BONFIRE_SECRET` or `BONFIRE_SECRET_FILE`). Call `JobTransport::shutdown` before the
/// process ends, so that what is in flight reaches the peers.
pub fn connect(
    env: &JobEnv,
    shm: &ShmConfig,
    runtime: &Handle,
) -> Result<Option<JobTransport>, JoinError> {
    if env.world_size == 1 {
        return Ok(None);
    }
    let secret = match &env.secret {
        SecretSource::Env => Secret::new(
            std::env::var(env::vars::SECRET)
                .unwrap_or_default()
                .as_bytes(),
        )
        .map_err(JoinError::SecretVar)?,
        SecretSource::File(path) => Secret::from_file(path).map_err(JoinError::SecretFile)?,
        SecretSource::Missing => {
            let hint = match env.source {
                EnvSource::Slurm => "set BONFIRE_SECRET_FILE to a file on a shared file system",
                _ => {
                    "run under `bonfire launch` (which makes one), or set BONFIRE_SECRET_FILE to a file holding it (the same on every node)"
                }
            };
            return Err(JoinError::NoSecret {
                world_size: env.world_size,
                hint,
            });
        }
    };
    let mut quic = QuicConfig::new(env.rank, env.world_size, env.master.clone(), secret);
    quic.node = env.node_rank;
    quic.round = env.round;
    quic.advertise = env.advertise;
    if let Some(bind) = env.bind {
        quic.bind = bind;
    }
    if let Some(t) = env.peer_timeout {
        quic.peer_timeout = t;
    }
    if let Some(c) = env.congestion {
        quic.congestion = c;
    }
    quic.connect_timeout = env.connect_timeout.unwrap_or(Duration::from_secs(120));
    Ok(Some(runtime.block_on(JobTransport::connect(quic, shm))?))
}
