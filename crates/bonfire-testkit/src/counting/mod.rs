//! `Counting<B>`: a backend decorator that changes no op and counts every call it receives, by
//! the op method's name, on the calling thread. Put it at the bottom of a stack
//! (`Autodiff<DataParallel<Counting<Flex>>>`) and compare with `Autodiff<Counting<Flex>>`: a
//! decorator that computes more than its inner backend shows up as more calls of some op.
//!
//! Counts are per thread (Burn runs a backend's ops, autodiff's backward included, on the thread
//! that calls them), so tests running in parallel do not see each other's ops.

mod ops;

use core::marker::PhantomData;
use std::cell::RefCell;
use std::collections::BTreeMap;

use burn_backend::distributed::DistributedBackend;
use burn_backend::{Backend, BackendTypes, DType, DTypeUsageSet, ExecutionError, TensorData};

thread_local! {
    static COUNTS: RefCell<BTreeMap<&'static str, u64>> = const { RefCell::new(BTreeMap::new()) };
}

/// Counts one call of `op` on this thread (called by the generated ops).
pub(crate) fn count(op: &'static str) {
    COUNTS.with(|c| *c.borrow_mut().entry(op).or_default() += 1);
}

/// The calls counted on this thread since the last `take`, by op method, and starts afresh.
pub fn take() -> BTreeMap<&'static str, u64> {
    COUNTS.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

/// Counts every op call, then runs it on `B` (see the module docs).
#[derive(Clone, Default, Debug)]
pub struct Counting<B> {
    _inner: PhantomData<B>,
}

impl<B: Backend> BackendTypes for Counting<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = B::FloatTensorPrimitive;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> Backend for Counting<B> {
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
        format!("counting<{}>", B::name(device))
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

/// Burn's defaults (no communication): enough for `Autodiff<Counting<B>>` to be an autodiff
/// backend in a build with Burn's `distributed` feature, as the single-device reference. Its
/// hooks are never called there: nothing marks a parameter distributed without bonfire.
impl<B: Backend> DistributedBackend for Counting<B> {}
