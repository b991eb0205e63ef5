//! Joining the job a process was started in: [`init`].

use std::sync::Arc;

use bonfire_backend::{ConfigError, DataParallelConfig};
use bonfire_collectives::{CollectiveError, CommConfig, Communicator, MeshGroups, runtime};
use bonfire_launch::{EnvError, JobEnv, JoinError};
use bonfire_topology::{Mesh, NodeLayout, Rank};
use bonfire_transport::shm::{ShmConfig, ShmConfigError};
use bonfire_transport::{JobTransport, JobTransportError, Lane, SecretError};

/// Why [`init`] failed. Its message says what to fix.
///
/// Its `Debug` form is that message too, so a `main` that returns `Result<(), Box<dyn Error>>`
/// and uses `bonfire::init()?` prints `Error: bonfire::init: ...` rather than the variant's
/// fields.
#[derive(thiserror::Error)]
pub enum InitError {
    /// The job environment is malformed.
    #[error("bonfire::init: {0}")]
    Env(#[from] EnvError),
    /// `BONFIRE_SECRET` holds no usable secret.
    #[error("bonfire::init: BONFIRE_SECRET: {0}")]
    SecretVar(#[source] SecretError),
    /// The secret file named by `BONFIRE_SECRET_FILE` holds no usable secret.
    #[error("bonfire::init: {0}")]
    SecretFile(#[source] SecretError),
    /// A job of several ranks was described without a secret.
    #[error("bonfire::init: this job of {world_size} ranks has no secret: {hint}")]
    NoSecret {
        /// Ranks in the job.
        world_size: usize,
        /// How to give it one.
        hint: &'static str,
    },
    /// The job could not be joined.
    #[error("bonfire::init: {0}")]
    Connect(#[from] JobTransportError),
    /// `BONFIRE_LOG` (or `RUST_LOG`) is not a log filter.
    #[error("bonfire::init: {0}")]
    Log(#[from] bonfire_launch::LogFilterError),
    /// `BONFIRE_COMM_CPUS` (where the rank's communication threads run) is malformed.
    #[error("bonfire::init: {0}")]
    Placement(#[from] bonfire_transport::placement::PlacementError),
    /// A transport setting (`BONFIRE_TRANSPORT`, `BONFIRE_SHM_*`) is malformed.
    #[error("bonfire::init: {0}")]
    Transport(#[from] ShmConfigError),
    /// The world communicator could not be built over the joined transport.
    #[error("bonfire::init: cannot build the world communicator: {0}")]
    Communicator(#[from] CollectiveError),
    /// `BONFIRE_TP` is not a positive number that divides the world size.
    #[error(
        "bonfire::init: BONFIRE_TP={value:?}: expected a positive number of ranks per tensor-parallel group that divides the world size {world_size}"
    )]
    TensorParallelSize {
        /// The value found.
        value: String,
        /// Ranks in the job.
        world_size: usize,
    },
    /// `BONFIRE_PP` is not a positive number of stages that, times the tensor-parallel size,
    /// divides the world size.
    #[error(
        "bonfire::init: BONFIRE_PP={value:?}: expected a positive number of pipeline stages that, times BONFIRE_TP={tp}, divides the world size {world_size}"
    )]
    PipelineSize {
        /// The value found.
        value: String,
        /// The tensor-parallel size.
        tp: usize,
        /// Ranks in the job.
        world_size: usize,
    },
    /// The data-parallel, tensor-parallel and pipeline groups could not be formed.
    #[error("bonfire::init: cannot form the {what} group: {source}")]
    Groups {
        /// Which group.
        what: &'static str,
        /// The collective's error.
        #[source]
        source: Box<CollectiveError>,
    },
    /// A data-parallel setting (`BONFIRE_BUCKET_CAP_MB`, `BONFIRE_GRAD_DTYPE`,
    /// `BONFIRE_DEVICE_PACK`) is malformed.
    #[error("bonfire::init: {0}")]
    Config(#[from] ConfigError),
}

impl From<JoinError> for InitError {
    fn from(e: JoinError) -> Self {
        match e {
            JoinError::SecretVar(e) => InitError::SecretVar(e),
            JoinError::SecretFile(e) => InitError::SecretFile(e),
            JoinError::NoSecret { world_size, hint } => InitError::NoSecret { world_size, hint },
            JoinError::Connect(e) => InitError::Connect(e),
        }
    }
}

impl std::fmt::Debug for InitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// This process's place in its job: its rank, the world communicator, and the links behind it.
///
/// Keep it alive until the end of the program: dropping it (or calling [`World::shutdown`])
/// delivers whatever is still in flight to the peers and closes the links cleanly.
pub struct World {
    rank: Rank,
    comm: Communicator,
    mesh: Mesh,
    dp: Communicator,
    tp: Communicator,
    pp: Communicator,
    env: JobEnv,
    nodes: NodeLayout,
    transport: Option<Arc<JobTransport>>,
}

impl World {
    /// The communicator over every rank of the job.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// The pipeline x data x tensor-parallel layout of the job (`BONFIRE_TP` ranks per
    /// tensor-parallel group, adjacent ranks, so a group shares a node when it fits in one;
    /// `BONFIRE_PP` pipeline stages, outermost; 1 each when unset).
    pub fn mesh(&self) -> Mesh {
        self.mesh
    }

    /// The ranks holding the same part of the model, over which `DataParallel` averages
    /// gradients (the whole world without tensor or pipeline parallelism; the ranks of this
    /// rank's stage with its tensor-parallel index with them).
    pub fn dp_group(&self) -> &Communicator {
        &self.dp
    }

    /// The ranks holding the stages of this rank's replica, one per stage in stage order, over
    /// which a [`crate::pipeline::Pipeline`] runs (`BONFIRE_PP` ranks; a group of one when
    /// unset). This rank's stage is its index in it.
    pub fn pp_group(&self) -> &Communicator {
        &self.pp
    }

    /// The ranks sharing one replica of the model, over which `TensorParallel` splits it (a
    /// group of one without tensor parallelism). `TensorParallel` ops already run over it.
    pub fn tp_group(&self) -> &Communicator {
        &self.tp
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    /// This rank's index on its node.
    pub fn local_rank(&self) -> usize {
        self.env.local_rank
    }

    /// Ranks on this node.
    pub fn local_world_size(&self) -> usize {
        self.env.local_world_size
    }

    /// Which node each rank runs on.
    pub fn nodes(&self) -> &NodeLayout {
        &self.nodes
    }

    /// True on rank 0, the rank that writes logs, metrics and checkpoints.
    pub fn is_main(&self) -> bool {
        self.rank == Rank(0)
    }

    /// The environment the job was described by.
    pub fn env(&self) -> &JobEnv {
        &self.env
    }

    /// How frames from this rank to each rank travel, in rank order: shared memory to the ranks
    /// of this host (unless `BONFIRE_TRANSPORT=quic`, or it could not be set up), QUIC to the
    /// others.
    pub fn lanes(&self) -> Vec<Lane> {
        match &self.transport {
            Some(t) => t.lanes(),
            None => vec![Lane::Local],
        }
    }

    /// Payload bytes this rank has received straight into its collectives' buffers: large frames
    /// over shared memory that a collective expected, combined or copied into place as they came
    /// off the ring instead of into a frame of their own. 0 without shared-memory lanes.
    pub fn received_in_place(&self) -> u64 {
        self.transport.as_ref().map_or(0, |t| t.received_in_place())
    }

    /// Leaves the job cleanly: everything sent reaches its peer before the links close.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let Some(quic) = self.transport.take() else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // Inside an async context we may not block; finish in the background.
            runtime().spawn(async move { quic.shutdown().await });
        } else {
            runtime().block_on(quic.shutdown());
        }
    }
}

/// Joins the job this process was started in: by `bonfire launch` or torchrun-style variables,
/// by Slurm, or, with none of them, as the single rank of a job of one. With `WORLD_SIZE` set
/// and no `RANK`, the rendezvous assigns this process the lowest free rank (rank 0, which hosts
/// the rendezvous, must be given).
///
/// It also installs the groups the decorators run over: with `BONFIRE_TP=t`, the job is a mesh
/// of world / t data-parallel replicas of t tensor-parallel ranks each (adjacent ranks form a
/// tensor-parallel group), [`crate::TensorParallel`] splits over the rank's tensor-parallel group
/// and [`crate::DataParallel`] averages gradients over its data-parallel group; without it,
/// `DataParallel` averages over every rank (with the bucket cap and gradient dtype from
/// `BONFIRE_BUCKET_CAP_MB` and `BONFIRE_GRAD_DTYPE`, when set). With `BONFIRE_PP=p` as well,
/// the ranks are first cut into p pipeline stages of world / p consecutive ranks each, every
/// stage laid out as above: [`World::pp_group`] is the rank's pipeline, and its data-parallel
/// group holds the ranks of its own stage only.
///
/// First it installs bonfire's log subscriber ([`crate::init_logging`]: `BONFIRE_LOG`, else
/// `RUST_LOG`, lines prefixed with the rank) unless the program installed one of its own, and
/// fixes glibc's `malloc` thresholds so that freed tensors stay in the process for the next step
/// ([`crate::steady_heap`]; `BONFIRE_MALLOC=system` leaves them alone).
///
/// ```no_run
/// let world = bonfire::init()?;
/// let sum = world.comm().all_reduce(vec![world.rank().0 as f32], bonfire::topology::ReduceOp::Sum).wait()?;
/// println!("rank {} of {}: {sum:?}", world.rank().0, world.world_size());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn init() -> Result<World, InitError> {
    init_with(CommConfig::default())
}

/// [`init`] with a communicator configuration of the caller's (`BONFIRE_TIMEOUT`, when set,
/// still sets the timeout).
pub fn init_with(config: CommConfig) -> Result<World, InitError> {
    init_from(JobEnv::from_env()?, config)
}

/// [`init_with`] with the shared-memory lane's settings given instead of read from
/// `BONFIRE_TRANSPORT` and `BONFIRE_SHM_*` (see [`ShmConfig::from_env`] for them).
pub fn init_with_transport(config: CommConfig, shm: ShmConfig) -> Result<World, InitError> {
    init_parts(JobEnv::from_env()?, config, shm)
}

/// [`init_with`] from a job description read elsewhere.
pub fn init_from(env: JobEnv, config: CommConfig) -> Result<World, InitError> {
    init_parts(env, config, ShmConfig::from_env()?)
}

/// Checks the settings [`init`] reads from the environment as a rank of a job of `world_size`
/// ranks, started on this machine by bonfire's launcher, would read them, without joining
/// anything: the log filter, the transport's, data-parallel and mesh settings (`BONFIRE_TP`,
/// `BONFIRE_PP`) and the timeouts and addresses, with the launcher's own variables (the rank's
/// place, the rendezvous, the restart round) taken as the launcher sets them. For a program
/// that starts ranks which inherit its environment, as `bonfire train` does, and would refuse a
/// malformed value once, before it starts them, rather than have every rank fail with it. The
/// error is the one [`init`] would return.
pub fn check_env(world_size: usize) -> Result<(), InitError> {
    use bonfire_launch::env::vars;
    bonfire_launch::filter_from_env()?;
    ShmConfig::from_env()?;
    DataParallelConfig::from_env()?;
    let tp = tp_from_env(world_size)?;
    pp_from_env(world_size, tp)?;
    let n = world_size.max(1);
    // The first and the last rank: addresses and ports are per local rank.
    for rank in [0, n - 1] {
        let (rank, n) = (rank.to_string(), n.to_string());
        let launcher = [
            (vars::RANK, rank.as_str()),
            (vars::WORLD_SIZE, n.as_str()),
            (vars::LOCAL_RANK, rank.as_str()),
            (vars::LOCAL_WORLD_SIZE, n.as_str()),
            (vars::GROUP_RANK, "0"),
            (vars::MASTER_ADDR, "127.0.0.1"),
            (vars::MASTER_PORT, "29500"),
            (vars::RESTART_ROUND, "0"),
        ];
        let get = |k: &str| match launcher.iter().find(|(var, _)| *var == k) {
            Some((_, v)) => Some(v.to_string()),
            None => std::env::var(k).ok(),
        };
        JobEnv::from_vars(&get)?;
    }
    Ok(())
}

fn init_parts(env: JobEnv, mut config: CommConfig, shm: ShmConfig) -> Result<World, InitError> {
    bonfire_launch::init_logging()?;
    let heap = crate::steady_heap();
    tracing::debug!(?heap, "malloc thresholds");
    let placement = bonfire_transport::placement::current().map_err(Clone::clone)?;
    tracing::debug!(?placement, "thread placement");
    if let Some(t) = env.timeout {
        config.timeout = t;
    }
    let dp = DataParallelConfig::from_env()?;
    let tp = tp_from_env(env.world_size)?;
    let pp = pp_from_env(env.world_size, tp)?;
    let Some(transport) = bonfire_launch::connect(&env, &shm, runtime().handle())? else {
        // A job of one rank: no links.
        let comm = Communicator::in_process(1, config).remove(0);
        let (mesh, g) = groups(&comm, tp, pp)?;
        bonfire_backend::install(g.dp.clone(), dp);
        return Ok(World {
            rank: Rank(0),
            comm,
            mesh,
            dp: g.dp,
            tp: g.tp,
            pp: g.pp,
            nodes: NodeLayout::single_node(1),
            env,
            transport: None,
        });
    };
    let transport = Arc::new(transport);
    let nodes = transport.nodes().clone();
    let rank = bonfire_transport::Transport::rank(transport.as_ref());
    let comm = Communicator::builder(transport.clone())
        .nodes(nodes.clone())
        .config(config)
        .build()?;
    let (mesh, g) = groups(&comm, tp, pp)?;
    bonfire_backend::install(g.dp.clone(), dp);
    Ok(World {
        rank,
        comm,
        mesh,
        dp: g.dp,
        tp: g.tp,
        pp: g.pp,
        env,
        nodes,
        transport: Some(transport),
    })
}

/// `BONFIRE_TP`: ranks per tensor-parallel group (1 when unset).
fn tp_from_env(world_size: usize) -> Result<usize, InitError> {
    let Ok(value) = std::env::var("BONFIRE_TP") else {
        return Ok(1);
    };
    match value.trim().parse::<usize>() {
        Ok(t) if t > 0 && world_size.is_multiple_of(t) => Ok(t),
        _ => Err(InitError::TensorParallelSize { value, world_size }),
    }
}

/// `BONFIRE_PP`: pipeline stages (1 when unset).
fn pp_from_env(world_size: usize, tp: usize) -> Result<usize, InitError> {
    let Ok(value) = std::env::var("BONFIRE_PP") else {
        return Ok(1);
    };
    match value.trim().parse::<usize>() {
        Ok(p)
            if p > 0
                && p.checked_mul(tp)
                    .is_some_and(|n| world_size.is_multiple_of(n)) =>
        {
            Ok(p)
        }
        _ => Err(InitError::PipelineSize {
            value,
            tp,
            world_size,
        }),
    }
}

/// The mesh of `world` with `tp` ranks per tensor-parallel group and `pp` stages, this rank's
/// groups, and the tensor-parallel one installed for `TensorParallel`.
fn groups(world: &Communicator, tp: usize, pp: usize) -> Result<(Mesh, MeshGroups), InitError> {
    let mesh = Mesh::with_stages(world.size(), tp, pp).map_err(|e| {
        if e.pp == 1 {
            InitError::TensorParallelSize {
                value: e.tp.to_string(),
                world_size: e.world,
            }
        } else {
            InitError::PipelineSize {
                value: e.pp.to_string(),
                tp: e.tp,
                world_size: e.world,
            }
        }
    })?;
    if tp == 1 && pp == 1 {
        let alone = || Communicator::in_process(1, world.config().clone()).remove(0);
        let g = MeshGroups {
            dp: world.clone(),
            tp: alone(),
            pp: alone(),
        };
        return Ok((mesh, g));
    }
    let g = world
        .split_mesh(&mesh)
        .map_err(|source| InitError::Groups {
            what: "pipeline x data x tensor-parallel",
            source: Box::new(source),
        })?;
    if tp > 1 {
        bonfire_backend::tensor_parallel::install(
            g.tp.clone(),
            bonfire_backend::FailurePolicy::Exit,
        )
        .map_err(|source| InitError::Groups {
            what: "tensor-parallel",
            source: Box::new(source),
        })?;
    }
    Ok((mesh, g))
}
