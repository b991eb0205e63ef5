//! `DataParallel<B>`: every rank trains a full replica; gradients are averaged across ranks in
//! buckets while backward runs.
//!
//! How the files depend on each other (no loop): `context` owns each rank's state
//! (`Replica`: its communicator, `config`, bucket `state` and `stats`); the hooks in `sync` and
//! the module helpers in `replicate` take a replica from it and act on its state; `distributed`
//! is Burn's gradient hook, which looks the replica up once per call and hands it to `sync`;
//! `device_pack` packs buckets on CubeCL devices; `scatter` lays a bucket out for the
//! reduce-scatter of ZeRO stage 2 (with the owners `sharded` registers) and of stage 3 (with the
//! splits `local` reports); `local` reads and writes the part of a tensor
//! this rank averages (the whole tensor, or its shard under `TensorParallel`); `error` names every failure, and
//! `Replica::fail` applies the failure policy to it.

mod backend;
mod buffers;
mod config;
mod context;
mod device_pack;
mod distributed;
mod error;
mod int8;
#[cfg(feature = "cuda")]
mod lane;
mod local;
mod ops;
mod outer;
mod param_server;
mod replicate;
mod sampler;
mod scatter;
mod sharded;
mod state;
mod stats;
mod sync;

pub use backend::DataParallel;
pub use buffers::{BufferSync, sync_buffers};
pub use config::{ConfigError, DataParallelConfig, FailurePolicy, GradDType, Overlap};
pub use context::{
    BindGuard, abort, bind_thread, communicator, forgot_init_message, install, last_step_stats,
    total_stats,
};
pub(crate) use context::{failure_policy, process_wide};
pub use error::SyncError;
#[cfg(feature = "cuda")]
pub use lane::{CommCross, CommLink, NodeLane};
pub(crate) use local::{Layout, part_of, placed_as};
pub use local::{LocalParts, ShardAtRest, register as register_local_parts};
pub use outer::{
    DILOCO_OUTER, DeltaDType, LocalSgd, LocalSgdRecord, MeetingInFlight, Outer, OuterState,
    OuterStats, diloco, local_sgd,
};
pub use param_server::{Departure, ParamServer, PsMode, PsReport, PsRole, PsStats, param_server};
pub use replicate::{
    accumulate, broadcast_parameters, discard_kept_gradients, keep_gradients, replicate,
};
pub use sampler::DistributedSampler;
pub use sharded::{InOrder, Sharded, ZeroStage, gradient_bytes, held_bytes, sharded};
pub use stats::{BucketTimes, LatePeer, StepStats};
pub use sync::{NoSyncGuard, no_sync};
