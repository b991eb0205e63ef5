//! Why gradient synchronisation failed. Burn's ops cannot return errors, so these never reach the
//! caller as a `Result`: [`super::context::Replica::fail`] is the one place that turns each into
//! the rank's [`crate::FailurePolicy`] (a message and exit status 1, or a panic).

use bonfire_collectives::CollectiveError;
use bonfire_kernels::KernelError;
use thiserror::Error;

use super::config::GradDType;

/// A failure of the data-parallel gradient hook, naming the parameter, bucket or collective.
#[derive(Debug, Error)]
pub enum SyncError {
    /// The check that every rank planned the same buckets could not run.
    #[error("while checking the bucket plan: {0}")]
    PlanCheck(#[source] CollectiveError),
    /// Some ranks planned other buckets than rank 0.
    #[error(
        "ranks {ranks:?} have different parameters or bucket settings than rank 0 \
         ({params} parameters, {elements} elements, bucket cap {cap_bytes} bytes, {dtype:?} here). \
         Every rank must build the same model and call bonfire::replicate(model) before \
         training, with the same BONFIRE_BUCKET_CAP_MB and BONFIRE_GRAD_DTYPE"
    )]
    PlanMismatch {
        /// The ranks whose plan differs from rank 0's.
        ranks: Vec<usize>,
        /// Parameters in this rank's plan.
        params: usize,
        /// Elements in this rank's plan.
        elements: usize,
        /// This rank's bucket cap.
        cap_bytes: usize,
        /// This rank's communicated element type.
        dtype: GradDType,
    },
    /// A gradient arrived for a parameter backward did not announce.
    #[error(
        "a gradient arrived for parameter {id:#018x}, which was not registered when backward started"
    )]
    UnknownParameter {
        /// The parameter's id.
        id: u64,
    },
    /// A backward ran under `no_sync` and its gradients never reached `keep_gradients`.
    #[error(
        "a backward pass over {params} parameters ran under bonfire::no_sync() and its gradients \
         were not handed to bonfire::keep_gradients before the next one: the backward after it \
         was not averaged over the {world} ranks (Burn's autodiff drops every parameter's \
         synchronisation mark in each backward), so the last optimizer step used this rank's \
         gradients alone and the replicas now differ. To accumulate gradients, call \
         `model = bonfire::accumulate(model, loss)` for every micro-batch but the last and step on \
         the last backward's gradients alone (they are the average of all of them); do not sum \
         no_sync gradients in a GradientsAccumulator"
    )]
    GradientsNotKept {
        /// Marked parameters in that backward.
        params: usize,
        /// Ranks in the group.
        world: usize,
    },
    /// A parameter's gradient changed size between steps.
    #[error("{param} changed size from {from} to {to} elements")]
    SizeChanged {
        /// The parameter's name.
        param: String,
        /// Its size so far.
        from: usize,
        /// Its size now.
        to: usize,
    },
    /// Parameters whose size could not be learned from their first backward.
    #[error(
        "no gradient arrived for {params:?} in its first backward; call bonfire::replicate(model) \
         before training so sizes are known up front"
    )]
    NoGradient {
        /// Their names.
        params: Vec<String>,
    },
    /// A bucket's all-reduce failed (a peer died, timed out, or called something else).
    #[error("all-reduce of gradient bucket {bucket} of {buckets} ({elements} elements): {source}")]
    AllReduce {
        /// The bucket.
        bucket: usize,
        /// Buckets in the plan.
        buckets: usize,
        /// Elements in the bucket.
        elements: usize,
        /// The collective's error, which names the peer.
        #[source]
        source: CollectiveError,
    },
    /// Under ZeRO stage 2 or 3, a bucket's reduce-scatter failed (at stage 2 it sends each
    /// gradient to its owner, at stage 3 each rank its slice of every gradient).
    #[error(
        "reduce-scatter of gradient bucket {bucket} of {buckets} ({elements} elements, \
         {counts:?} to each rank; ZeRO stage {stage}): {source}"
    )]
    ReduceScatter {
        /// The bucket.
        bucket: usize,
        /// Buckets in the plan.
        buckets: usize,
        /// Elements in the bucket.
        elements: usize,
        /// Elements each rank receives (its gradients or slices and their presence flags).
        counts: Vec<usize>,
        /// The ZeRO stage (2 or 3).
        stage: u8,
        /// The collective's error, which names the peer.
        #[source]
        source: CollectiveError,
    },
    /// A parameter had a gradient on some ranks but not on others.
    #[error(
        "{param} ({elements} elements) has a gradient on {with:.0} of {world} ranks in this step: \
         every rank must use every parameter it trains in every step"
    )]
    PartialGradient {
        /// The parameter's name.
        param: String,
        /// Its elements.
        elements: usize,
        /// How many ranks had a gradient for it.
        with: f32,
        /// Ranks in the group.
        world: usize,
    },
    /// A bucket could not be packed or unpacked on the device.
    #[error("bucket {bucket} of {buckets}: {stage} a gradient bucket on the device: {source}")]
    DevicePack {
        /// The bucket.
        bucket: usize,
        /// Buckets in the plan.
        buckets: usize,
        /// "packing" or "unpacking".
        stage: &'static str,
        /// The kernel's error.
        #[source]
        source: KernelError,
    },
    /// A bucket could not be all-reduced through the device lane.
    #[error("bucket {bucket} of {buckets} ({elements} elements) through the device lane: {detail}")]
    DeviceLane {
        /// The bucket.
        bucket: usize,
        /// Buckets in the plan.
        buckets: usize,
        /// Its elements.
        elements: usize,
        /// The lane's error (it names the collective, the sizes and the failed rank).
        detail: String,
    },
    /// A tensor could not be read to the host.
    #[error("cannot read {what}: {reason}")]
    Read {
        /// What was being read ("a gradient", "all_reduce's tensor").
        what: String,
        /// Why.
        reason: String,
    },
    /// An explicit all-reduce (`DistributedBackend::all_reduce`) failed.
    #[error("all_reduce of {elements} elements: {source}")]
    ExplicitAllReduce {
        /// Its elements.
        elements: usize,
        /// The collective's error.
        #[source]
        source: CollectiveError,
    },
    /// Making the ranks' buffers equal (`sync_buffers`) failed.
    #[error("{how:?} of buffer {buffer} ({elements} elements): {source}")]
    Buffer {
        /// The buffer's name.
        buffer: String,
        /// What was asked.
        how: super::buffers::BufferSync,
        /// Its elements.
        elements: usize,
        /// The collective's error.
        #[source]
        source: CollectiveError,
    },
    /// A step of [`crate::Sharded`] failed: its all-gather, or a model that changed.
    #[error("sharded optimizer step: {what}{}", source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
    Sharded {
        /// What failed, with the sizes.
        what: String,
        /// The collective's error, which names the peer.
        #[source]
        source: Option<CollectiveError>,
    },
    /// A meeting of [`crate::LocalSgd`]'s replicas failed: its all-reduce, a model that changed,
    /// or replicas that started apart.
    #[error("local SGD / DiLoCo: {what}{}", source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
    Outer {
        /// What failed, with the sizes.
        what: String,
        /// The collective's error, which names the peer.
        #[source]
        source: Option<CollectiveError>,
    },
    /// A parameter server or worker ([`crate::ParamServer`]) failed: a push or pull, a worker
    /// that stopped or pushed another step under synchronous servers, a model that changed, or
    /// a worker that started from other parameters.
    #[error("parameter server: {what}{}", source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
    ParamServer {
        /// What failed, naming the worker, the server and the sizes.
        what: String,
        /// The collective's error, which names the peer.
        #[source]
        source: Option<CollectiveError>,
    },
    /// Broadcasting rank 0's parameters (`replicate`) failed.
    #[error("broadcasting parameter {param} ({what}): {source}")]
    Broadcast {
        /// The parameter's name.
        param: String,
        /// What of it: its id, or its values with their shape.
        what: String,
        /// The collective's error.
        #[source]
        source: CollectiveError,
    },
}
