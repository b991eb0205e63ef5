//! Joining the job a process was started in: [`init`].

use std::sync::Arc;

use bonfire_collectives::{CollectiveError, CommConfig, Communicator, runtime};
use bonfire_launch::{EnvError, JobEnv, JoinError, LogFilterError};
use bonfire_topology::{NodeLayout, Rank};
use bonfire_transport::shm::{ShmConfig, ShmConfigError};
use bonfire_transport::{JobTransport, Lane, Transport};
use burn::data::dataloader::DataLoader;
use burn::module::Module;
use burn::optim::GradientsParams;

use crate::sync::{self, DEFAULT_BUCKET_CAP_BYTES, SyncError};

/// Why [`init`] failed. Its message says what to fix; its `Debug` form is that message too, so
/// `bonfire_burn022::init()?` in a `main` returning `Result<(), Box<dyn Error>>` prints it.
#[derive(thiserror::Error)]
pub enum InitError {
    /// The job environment is malformed.
    #[error("bonfire_burn022::init: {0}")]
    Env(#[from] EnvError),
    /// A transport setting (`BONFIRE_TRANSPORT`, `BONFIRE_SHM_*`) is malformed.
    #[error("bonfire_burn022::init: {0}")]
    Transport(#[from] ShmConfigError),
    /// `BONFIRE_LOG` (or `RUST_LOG`) is not a log filter.
    #[error("bonfire_burn022::init: {0}")]
    Log(#[from] LogFilterError),
    /// The job could not be joined (no secret, a peer unreachable, a wrong secret...).
    #[error("bonfire_burn022::init: {0}")]
    Join(#[from] JoinError),
    /// The world communicator could not be built over the joined transport.
    #[error("bonfire_burn022::init: cannot build the world communicator: {0}")]
    Communicator(#[from] CollectiveError),
    /// `BONFIRE_BUCKET_CAP_MB` is not a positive number of MiB.
    #[error(
        "bonfire_burn022::init: BONFIRE_BUCKET_CAP_MB={0:?}: expected a positive number of MiB"
    )]
    BucketCap(String),
}

impl std::fmt::Debug for InitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// This process's place in its job: its rank and the communicator over every rank.
///
/// Keep it alive until the end of the program: dropping the last clone delivers whatever is
/// still in flight to the peers and closes the links cleanly. Clones share the job.
#[derive(Clone)]
pub struct World {
    job: Arc<Job>,
    bucket_cap_bytes: usize,
}

/// What the clones of a [`World`] share: the communicator and the links under it.
struct Job {
    rank: Rank,
    comm: Communicator,
    nodes: NodeLayout,
    transport: Option<Arc<JobTransport>>,
}

impl Drop for Job {
    fn drop(&mut self) {
        let Some(transport) = self.transport.take() else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // Inside an async context we may not block; finish in the background.
            runtime().spawn(async move { transport.shutdown().await });
        } else {
            runtime().block_on(transport.shutdown());
        }
    }
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish()
    }
}

/// Joins the job this process was started in: by `bonfire launch`, by torchrun-style variables
/// (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) or by Slurm's `srun`; with none of them,
/// as the single rank of a job of one. Ranks of one host talk through shared memory, hosts over
/// QUIC authenticated by the job's secret, exactly as for the Burn 0.21 crate.
///
/// It also installs bonfire's log subscriber (`BONFIRE_LOG`, else `RUST_LOG`; lines prefixed with
/// the rank) unless the program installed one, and reads `BONFIRE_BUCKET_CAP_MB` (the most
/// gradient bytes averaged in one all-reduce; 25 when unset).
pub fn init() -> Result<World, InitError> {
    init_from(JobEnv::from_env()?, CommConfig::default())
}

/// [`init`] from a job description read elsewhere, with a communicator configuration of the
/// caller's (`BONFIRE_TIMEOUT`, when the job sets it, still sets the timeout).
pub fn init_from(env: JobEnv, config: CommConfig) -> Result<World, InitError> {
    bonfire_launch::init_logging()?;
    let bucket_cap_bytes = bucket_cap_from_env()?;
    let mut config = config;
    if let Some(t) = env.timeout {
        config.timeout = t;
    }
    let shm = ShmConfig::from_env()?;
    let job = match bonfire_launch::connect(&env, &shm, runtime().handle())? {
        None => Job {
            rank: Rank(0),
            comm: Communicator::in_process(1, config).remove(0),
            nodes: NodeLayout::single_node(1),
            transport: None,
        },
        Some(transport) => {
            let transport = Arc::new(transport);
            let nodes = transport.nodes().clone();
            let comm = Communicator::builder(transport.clone())
                .nodes(nodes.clone())
                .config(config)
                .build()?;
            Job {
                rank: transport.rank(),
                comm,
                nodes,
                transport: Some(transport),
            }
        }
    };
    Ok(World {
        job: Arc::new(job),
        bucket_cap_bytes,
    })
}

impl World {
    /// A world over a communicator built elsewhere, such as one of
    /// `Communicator::in_process(n, ..)`'s ranks running as threads of one process (tests, and
    /// programs that train several replicas in one process); no links of its own, the bucket
    /// cap at its default.
    pub fn from_communicator(comm: Communicator) -> World {
        World {
            job: Arc::new(Job {
                rank: comm.world_rank(),
                nodes: NodeLayout::single_node(comm.size()),
                comm,
                transport: None,
            }),
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
        }
    }
}

fn bucket_cap_from_env() -> Result<usize, InitError> {
    let Ok(value) = std::env::var("BONFIRE_BUCKET_CAP_MB") else {
        return Ok(DEFAULT_BUCKET_CAP_BYTES);
    };
    match value.trim().parse::<f64>() {
        Ok(mb) if mb.is_finite() && mb > 0.0 => Ok(((mb * 1024.0 * 1024.0) as usize).max(4)),
        _ => Err(InitError::BucketCap(value)),
    }
}

impl World {
    /// This rank.
    pub fn rank(&self) -> Rank {
        self.job.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.job.comm.size()
    }

    /// True on rank 0, the rank that validates, renders and writes checkpoints.
    pub fn is_main(&self) -> bool {
        self.job.rank == Rank(0)
    }

    /// The communicator over every rank of the job.
    pub fn comm(&self) -> &Communicator {
        &self.job.comm
    }

    /// Which node each rank runs on.
    pub fn nodes(&self) -> &NodeLayout {
        &self.job.nodes
    }

    /// How frames from this rank to each rank travel, in rank order: shared memory to the ranks
    /// of this host (unless `BONFIRE_TRANSPORT=quic`), QUIC to the others.
    pub fn lanes(&self) -> Vec<Lane> {
        match &self.job.transport {
            Some(t) => t.lanes(),
            None => vec![Lane::Local],
        }
    }

    /// The most gradient bytes [`World::average`] reduces in one all-reduce.
    pub fn bucket_cap_bytes(&self) -> usize {
        self.bucket_cap_bytes
    }

    /// The same world averaging at most `bytes` of gradients per all-reduce (at least one value).
    pub fn with_bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.bucket_cap_bytes = bytes.max(4);
        self
    }

    /// The mean of every rank's gradients, parameter by parameter: call it between `backward`
    /// and the optimizer's step. See [`average`].
    pub fn average<M: Module>(
        &self,
        grads: GradientsParams,
        model: &M,
    ) -> Result<GradientsParams, SyncError> {
        sync::average(self.comm(), grads, model, self.bucket_cap_bytes)
    }

    /// `model` with rank 0's parameters on every rank. See [`replicate`].
    pub fn replicate<M: Module>(&self, model: M) -> Result<M, SyncError> {
        sync::replicate(self.comm(), model, self.bucket_cap_bytes)
    }

    /// This rank's share of a data loader's items. See [`shard`].
    pub fn shard<O: 'static>(&self, loader: Arc<dyn DataLoader<O>>) -> Arc<dyn DataLoader<O>> {
        sync::shard(loader, self.comm().rank(), self.world_size())
    }
}
