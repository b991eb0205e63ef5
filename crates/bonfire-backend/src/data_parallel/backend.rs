//! The decorator type and its `Backend` impl. The op traits are forwarded in `ops/` (generated);
//! the gradient hook is in `distributed.rs`.

use core::marker::PhantomData;

use burn_backend::{Backend, BackendTypes, DType, DTypeUsageSet, ExecutionError, TensorData};

/// Data-parallel training as a Burn backend: `Autodiff<DataParallel<B>>` trains like
/// `Autodiff<B>` on every rank, and averages gradients across the ranks during backward.
///
/// # Contract
///
/// - **What it changes.** No op: every tensor operation runs on `B`, with `B`'s tensors
///   (`DataParallel<B>` reuses `B`'s primitives and devices). Only the gradients of parameters
///   marked distributed ([`crate::replicate`] marks them) are changed: when `backward` returns,
///   each holds the **mean over all ranks** of that parameter's gradient.
/// - **When it synchronises.** Gradients are copied into buckets (default cap 25 MiB) as backward
///   produces them; a bucket's all-reduce starts, asynchronously, as soon as it is full and every
///   bucket before it has started, so communication overlaps the rest of backward. `backward`
///   returns once every bucket is reduced and written back.
/// - **What order it assumes.** Every rank runs the same model and calls `backward` the same
///   number of times, in the same order. Buckets are planned from the module's parameter order
///   (the same on every rank), never from the order gradients arrive in.
/// - **World size 1** is a pass-through: the hook returns at once and `Autodiff<DataParallel<B>>`
///   computes exactly what `Autodiff<B>` computes.
/// - **Failures.** A rank that dies, leaves early or calls with a different bucket layout makes
///   every other rank's `backward` fail with a message naming it (see [`crate::FailurePolicy`]).
#[derive(Clone, Default, Debug)]
pub struct DataParallel<B> {
    _inner: PhantomData<B>,
}

impl<B: Backend> BackendTypes for DataParallel<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = B::FloatTensorPrimitive;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> Backend for DataParallel<B> {
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
        format!("data-parallel<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed)
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
