//! The decorator type and its `Backend` impl. The op traits are in `ops/` (generated: each method
//! calls its rule in `rules/` or falls back); `DistributedBackend` is here.

use core::marker::PhantomData;

use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedConfig, DistributedParams, ReduceOperation,
    TensorRef,
};
use burn_backend::tensor::FloatTensor;
use burn_backend::{
    Backend, BackendTypes, DType, DTypeUsageSet, DeviceId, ExecutionError, TensorData,
};

use super::context;
use super::tensor::TpTensor;

/// Tensor-model parallelism as a Burn backend: `Autodiff<TensorParallel<B>>` runs a model whose
/// layers are split over the ranks of a group, as Megatron-LM splits them, without rewriting the
/// model.
///
/// # Contract
///
/// - **Placements.** Every float tensor is [`crate::Placement::Replicate`] (whole on every rank),
///   `Shard` (each rank holds a slice of one dimension) or `Partial` (each rank holds a term of a
///   sum); its shape, as every op and the model see it, is the global one. Int and bool tensors
///   are always whole on every rank.
/// - **Ops.** Each op has a rule that picks its output's placement from its inputs' (a matmul of a
///   whole input by a column-split weight gives a column-split output; of a split input by a
///   row-split weight, a `Partial`), communicating only when the rule needs a `Partial` whole
///   (an all-reduce). An op without a rule for its inputs' placements gathers them and runs on
///   the whole tensors: correct, only slower, and counted ([`crate::tensor_parallel::TpStats`]).
/// - **Backward** runs the same rules, so it gets Megatron's conjugate communication (the
///   all-reduce of a column-split layer's input gradient) from them.
/// - **Which parameters are split** is a plan's choice ([`crate::TpPlan`], applied by
///   [`crate::tensor_parallel()`]); with no plan, or in a group of one, every tensor is whole and
///   every op is the inner backend's.
/// - **The group** is the calling thread's ([`crate::tensor_parallel::bind_thread`]) or the
///   process's ([`crate::tensor_parallel::install`]). Every rank of the group must run the same
///   ops in the same order; a collective that fails (a rank died, timed out or ran something
///   else) stops the rank with a message naming it, by the group's failure policy.
#[derive(Clone, Default, Debug)]
pub struct TensorParallel<B> {
    _inner: PhantomData<B>,
}

impl<B: Backend> BackendTypes for TensorParallel<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = TpTensor<B>;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> Backend for TensorParallel<B> {
    fn ad_enabled(device: &Self::Device) -> bool {
        B::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        B::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        B::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("tensor-parallel<{}>", B::name(device))
    }

    /// Seeds the inner backend and the group's random generator (every rank of the group draws
    /// the same numbers, so a random tensor is the same whole tensor on every rank). Outside a
    /// group, the seed waits for the group this rank joins next: either order of seeding and
    /// joining gives the same draws.
    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed);
        match context::current() {
            Some(g) => g.reseed(seed),
            None => context::seed_before_joining(seed),
        }
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        B::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        B::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        B::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        B::device_count(type_id)
    }
}

const NOT_DATA_PARALLEL: &str = "bonfire: parameters of a TensorParallel<B> model are marked for \
     data-parallel gradient averaging (bonfire::replicate, or burn-train's DDP), but \
     TensorParallel does not average gradients across replicas: use \
     Autodiff<DataParallel<TensorParallel<B>>> (bonfire::Hybrid<B>) for data x tensor parallelism";

/// `Autodiff<TensorParallel<B>>` needs this impl in a build with Burn's `distributed` feature (as
/// every bonfire build is). Tensor parallelism has no gradient to average across replicas:
/// a model whose parameters are marked for it belongs under `DataParallel<TensorParallel<B>>`.
impl<B: Backend> DistributedBackend for TensorParallel<B> {
    fn start_communication_server(_devices: &[Self::Device], _config: DistributedConfig) {
        panic!("{NOT_DATA_PARALLEL}");
    }

    fn close_communication_server(_device: &Self::Device) {}

    fn register_sync_parameters(_device: &Self::Device, _params: Vec<DistributedParams>) {
        panic!("{NOT_DATA_PARALLEL}");
    }

    fn submit_gradient_sync(_tensor: TensorRef<Self>, _params: DistributedParams) {
        panic!("{NOT_DATA_PARALLEL}");
    }

    fn submit_sync_collective(_device: &Self::Device) {}

    fn all_reduce(
        _tensor: FloatTensor<Self>,
        _op: ReduceOperation,
        _device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        panic!("{NOT_DATA_PARALLEL}");
    }

    fn sync_collective(_device: &Self::Device) {}
}

/// A backend whose float tensors are (or wrap) `TensorParallel`'s: `TensorParallel<I>` itself,
/// `Autodiff` over one, and `DataParallel` over one (the hybrid). Plans and checkpoints reach a
/// model's split parameters through it.
pub trait TensorParallelBackend: Backend {
    /// The backend `TensorParallel` runs each rank's part on.
    type Inner: Backend;

    /// The tensor-parallel tensor inside `t` (for `Autodiff`, its value, off the graph).
    fn tp_part(t: FloatTensor<Self>) -> TpTensor<Self::Inner>;

    /// A float tensor of this backend holding `t` (for `Autodiff`, a new leaf).
    fn from_tp(t: TpTensor<Self::Inner>) -> FloatTensor<Self>;
}

impl<I: Backend> TensorParallelBackend for TensorParallel<I> {
    type Inner = I;

    fn tp_part(t: FloatTensor<Self>) -> TpTensor<I> {
        t
    }

    fn from_tp(t: TpTensor<I>) -> FloatTensor<Self> {
        t
    }
}

impl<B, C> TensorParallelBackend for burn::backend::Autodiff<B, C>
where
    B: TensorParallelBackend + DistributedBackend,
    C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy,
{
    type Inner = B::Inner;

    fn tp_part(t: FloatTensor<Self>) -> TpTensor<B::Inner> {
        B::tp_part(<Self as burn::tensor::backend::AutodiffBackend>::inner(t))
    }

    fn from_tp(t: TpTensor<B::Inner>) -> FloatTensor<Self> {
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(B::from_tp(t))
    }
}

impl<B: TensorParallelBackend> TensorParallelBackend for crate::DataParallel<B> {
    type Inner = B::Inner;

    fn tp_part(t: FloatTensor<Self>) -> TpTensor<B::Inner> {
        B::tp_part(t)
    }

    fn from_tp(t: TpTensor<B::Inner>) -> FloatTensor<Self> {
        B::from_tp(t)
    }
}
