//! Burn backend decorators for distributed training.
//!
//! [`DataParallel<B>`] is the data-parallel decorator: a Burn 0.21 project that trains on
//! `Autodiff<B>` trains data-parallel on `Autodiff<DataParallel<B>>`, with gradients averaged
//! across ranks in buckets while backward is still running.
//!
//! ```ignore
//! type B = Autodiff<DataParallel<Flex>>;          // was Autodiff<Flex>
//! let world = bonfire::init()?;                    // joins the job, installs its communicator
//! let model = bonfire::replicate(model);           // rank 0's parameters on every rank
//! // ... the usual loop: forward, loss.backward(), optimizer step ...
//! ```
//!
//! # What a build must enable
//!
//! This crate turns on Burn's `distributed` feature (the gradient-ready hook in `burn-autodiff`,
//! and parameter marking in `burn-optim`). Cargo unifies features, so in a build that contains
//! bonfire, `Autodiff<Flex>` and `Autodiff<NdArray>` are no longer autodiff backends: Burn 0.21
//! then asks every autodiff backend's inner backend to implement `DistributedBackend`, which only
//! the CubeCL backends, Fusion and `DataParallel` do. Wrap every backend you differentiate through
//! in `DataParallel` (at world size 1 it is a pass-through that computes exactly what `B` does).

mod data_parallel;
#[doc(hidden)]
pub mod passthrough;
pub mod pipeline;
pub mod tensor_parallel;

pub use data_parallel::ShardAtRest;
pub use data_parallel::{
    BindGuard, BucketTimes, BufferSync, ConfigError, DILOCO_OUTER, DataParallel,
    DataParallelConfig, DeltaDType, Departure, DistributedSampler, FailurePolicy, GradDType,
    InOrder, LatePeer, LocalParts, LocalSgd, LocalSgdRecord, MeetingInFlight, NoSyncGuard, Outer,
    OuterState, OuterStats, Overlap, ParamServer, PsMode, PsReport, PsRole, PsStats, Sharded,
    StepStats, SyncError, ZeroStage, abort, accumulate, bind_thread, broadcast_parameters,
    communicator, diloco, discard_kept_gradients, forgot_init_message, gradient_bytes, held_bytes,
    install, keep_gradients, last_step_stats, local_sgd, no_sync, param_server,
    register_local_parts, replicate, sharded, sync_buffers, total_stats,
};
#[cfg(feature = "cuda")]
pub use data_parallel::{CommCross, CommLink, NodeLane};
pub use tensor_parallel::fsdp::{forward_only, fully_shard, prefetch_gathers, without_prefetch};
pub use tensor_parallel::{Placement, PlanError, Split, TensorParallel, TpPlan, tensor_parallel};
pub use tensor_parallel::{
    ShardedCheckpointError, check_sharded_checkpoint, consolidate_sharded_checkpoint,
    consolidate_sharded_model, load_sharded_checkpoint, save_sharded_checkpoint, shard_checkpoint,
};

/// Data x tensor parallelism: `Autodiff<Hybrid<B>>` splits each model over its rank's
/// tensor-parallel group (as [`TensorParallel`]) and averages each shard's gradients over its
/// data-parallel group (as [`DataParallel`]), the ranks that hold the same shard. Split the model
/// with [`tensor_parallel`] first, then [`replicate`] it.
pub type Hybrid<B> = DataParallel<TensorParallel<B>>;

#[cfg(test)]
mod send_sync {
    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn user_types_are_send_and_sync() {
        assert_send_sync::<crate::DataParallelConfig>();
        assert_send_sync::<crate::StepStats>();
        assert_send_sync::<crate::DistributedSampler>();
    }
}
