//! The part of a tensor that data parallelism averages and broadcasts: for most inner backends the
//! whole tensor; for an inner backend that splits tensors over other ranks (`TensorParallel`, in
//! the hybrid `DataParallel<TensorParallel<B>>`), this rank's own part, so that gradients are
//! averaged over the data-parallel axis shard by shard and never gathered on the other axis.
//!
//! Such a backend registers its float primitive's [`LocalParts`] (`DataParallel` is generic over
//! any backend and cannot name it); the functions here fall back to the whole tensor for every
//! primitive that has not.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, ExecutionError, Shape, TensorData, TensorMetadata};

pub use super::scatter::ShardAtRest;

/// How `DataParallel` reads and writes this rank's part of one kind of float primitive.
pub trait LocalParts: Send + Sync {
    /// The shape of this rank's part of `tensor`.
    fn shape(&self, tensor: &dyn Any) -> Shape;
    /// This rank's part of `tensor`, in host memory (a pending sum is resolved first).
    fn read(&self, tensor: &dyn Any) -> Result<TensorData, ExecutionError>;
    /// A tensor placed as `like` whose part on this rank is `data` (of [`LocalParts::shape`]).
    fn write(&self, like: &dyn Any, data: TensorData) -> Box<dyn Any>;
    /// [`LocalParts::write`] for the value or gradient of parameter `param` (its id's number):
    /// a backend that keeps parameters in a layout of their own (sharded at rest) places the
    /// result as the parameter is placed. By default, `write`.
    fn write_param(&self, like: &dyn Any, data: TensorData, param: u64) -> Box<dyn Any> {
        let _ = param;
        self.write(like, data)
    }
    /// The shape of what this rank holds of `tensor` in memory (its bytes), where that differs
    /// from the part it averages ([`LocalParts::shape`]). By default, `shape`.
    fn held(&self, tensor: &dyn Any) -> Shape {
        self.shape(tensor)
    }
    /// `tensor`, a value of parameter `param` that the backend keeps sharded at rest but that is
    /// whole now (an op without a rule, or a loaded record, made it whole), placed as the
    /// parameter is; `None` when it is placed so already, or the backend does not shard it. By
    /// default, `None`.
    fn reshard(&self, tensor: &dyn Any, param: u64) -> Option<Box<dyn Any>> {
        let _ = (tensor, param);
        None
    }
    /// `tensor`, parameter `param`'s value as an optimizer step left it (placed at rest, after
    /// [`LocalParts::reshard`]), marked for the next step: under ZeRO stage 3 it is registered
    /// so that its gathers can start ahead of need. `None` where nothing changes (by default).
    fn at_rest(&self, tensor: &dyn Any, param: u64) -> Option<Box<dyn Any>> {
        let _ = (tensor, param);
        None
    }
    /// An optimizer step begins: values marked at rest by the last one are let go. By default,
    /// nothing.
    fn step_begins(&self) {}
    /// An optimizer step ended, its parameters' values marked ([`LocalParts::at_rest`]). By
    /// default, nothing.
    fn step_ended(&self) {}
    /// How parameter `param` (its id's number) is sharded at rest over the data-parallel ranks
    /// themselves (ZeRO stage 3), so that its gradient is reduce-scattered and each rank
    /// receives only its slice; `None` for a parameter kept whole (all-reduced). By default,
    /// `None`. A backend that returns a split here writes slices with
    /// [`LocalParts::write_slice`].
    fn shard_at_rest(&self, param: u64) -> Option<ShardAtRest> {
        let _ = param;
        None
    }
    /// A gradient of a parameter split as `split` ([`LocalParts::shard_at_rest`]), placed as the
    /// parameter is, whose slice on this rank is `data` (of the slice's shape); `like` is the
    /// rank's whole gradient. Called only for a split `shard_at_rest` gave.
    fn write_slice(&self, like: &dyn Any, data: TensorData, split: &ShardAtRest) -> Box<dyn Any> {
        let _ = (like, data);
        unreachable!("write_slice for {split:?}, which shard_at_rest never gives")
    }
}

type Registry = RwLock<HashMap<TypeId, &'static dyn LocalParts>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Makes `DataParallel` read and write tensors of primitive type `P` through `parts` (once per
/// type; later calls for the same type are ignored).
pub fn register<P: 'static>(parts: impl LocalParts + 'static) {
    let mut map = registry().write().unwrap_or_else(|e| e.into_inner());
    map.entry(TypeId::of::<P>())
        .or_insert_with(|| Box::leak(Box::new(parts)));
}

fn parts_of<P: 'static>() -> Option<&'static dyn LocalParts> {
    let map = registry().read().unwrap_or_else(|e| e.into_inner());
    map.get(&TypeId::of::<P>()).copied()
}

/// The shape of this rank's part of `t`.
pub(crate) fn shape<B: Backend>(t: &FloatTensor<B>) -> Shape {
    match parts_of::<FloatTensor<B>>() {
        Some(parts) => parts.shape(t),
        None => t.shape(),
    }
}

/// This rank's part of `t`, in host memory.
pub(crate) fn read<B: Backend>(t: FloatTensor<B>) -> Result<TensorData, ExecutionError> {
    match parts_of::<FloatTensor<B>>() {
        Some(parts) => parts.read(&t),
        None => futures::executor::block_on(B::float_into_data(t)),
    }
}

/// The shape of what this rank holds of `t` in memory.
pub(crate) fn held<B: Backend>(t: &FloatTensor<B>) -> Shape {
    match parts_of::<FloatTensor<B>>() {
        Some(parts) => parts.held(t),
        None => t.shape(),
    }
}

/// A tensor on `device` whose part on this rank is `data`, placed as `like` (when given), or as
/// parameter `param` is (the number of its id, when the tensor is its value or gradient).
pub(crate) fn write<B: Backend>(
    like: Option<&FloatTensor<B>>,
    data: TensorData,
    device: &B::Device,
    param: Option<u64>,
) -> FloatTensor<B> {
    let placed = match (parts_of::<FloatTensor<B>>(), like, param) {
        (Some(parts), Some(like), Some(param)) => parts.write_param(like, data, param),
        (Some(parts), Some(like), None) => parts.write(like, data),
        _ => return B::float_from_data(data, device),
    };
    *placed
        .downcast::<FloatTensor<B>>()
        .expect("LocalParts::write returns the primitive it was registered for")
}

/// How [`placed_as`] places new values of a tensor's part ([`part_of`]).
pub(crate) enum Layout<B: Backend> {
    /// As this tensor, of a backend that splits tensors ([`LocalParts::write`]).
    Like(FloatTensor<B>),
    /// Whole, on this device, in this dtype: the tensor itself is not kept.
    Whole(B::Device, DType),
}

/// This rank's part of `t` (see [`read`]) as f32 values with their shape, and the [`Layout`]
/// that places new values of that part as `t` is placed ([`placed_as`]). Only a backend that
/// splits tensors keeps `t` itself for that (its part, which the values copy, stays alive until
/// they are placed); any other drops it here.
pub(crate) fn part_of<B: Backend, const D: usize>(
    t: burn::tensor::Tensor<B, D>,
) -> Result<(Layout<B>, Shape, Vec<f32>), String> {
    let t = t.into_primitive().tensor();
    let layout = match parts_of::<FloatTensor<B>>() {
        Some(_) => Layout::Like(t.clone()),
        None => Layout::Whole(B::float_device(&t), t.dtype()),
    };
    let data = read::<B>(t).map_err(|e| format!("cannot read a tensor's part: {e}"))?;
    let shape = data.shape.clone();
    let values = data
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("cannot read a tensor's part: {e:?}"))?;
    Ok((layout, shape, values))
}

/// A tensor placed as `layout` says whose part on this rank is `values` of `shape`, in the
/// dtype of the tensor it was read from (the inverse of [`part_of`]).
pub(crate) fn placed_as<B: Backend, const D: usize>(
    layout: &Layout<B>,
    shape: Shape,
    values: Vec<f32>,
) -> burn::tensor::Tensor<B, D> {
    let data = TensorData::new(values, shape);
    let placed = match layout {
        Layout::Like(like) => write::<B>(
            Some(like),
            data.convert_dtype(like.dtype()),
            &B::float_device(like),
            None,
        ),
        Layout::Whole(device, dtype) => B::float_from_data(data.convert_dtype(*dtype), device),
    };
    burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(placed))
}

/// How parameter `param` is sharded at rest over the data-parallel ranks (ZeRO stage 3), if it
/// is (see [`LocalParts::shard_at_rest`]).
pub(crate) fn shard_at_rest<B: Backend>(param: u64) -> Option<ShardAtRest> {
    parts_of::<FloatTensor<B>>().and_then(|parts| parts.shard_at_rest(param))
}

/// A gradient placed as its parameter is split (`split`), whose slice on this rank is `data`;
/// `like` is the rank's whole gradient (see [`LocalParts::write_slice`]).
pub(crate) fn write_slice<B: Backend>(
    like: &FloatTensor<B>,
    data: TensorData,
    split: &ShardAtRest,
) -> FloatTensor<B> {
    let parts = parts_of::<FloatTensor<B>>().expect("a split comes from registered parts");
    *parts
        .write_slice(like, data, split)
        .downcast::<FloatTensor<B>>()
        .expect("LocalParts::write_slice returns the primitive it was registered for")
}

/// Parameter `id`'s value `t` placed as the backend keeps the parameter at rest, if it is not
/// (see [`LocalParts::reshard`]): a leaf again, requiring gradients and marked as `t` was.
pub(crate) fn resharded<B: burn::tensor::backend::AutodiffBackend, const D: usize>(
    t: burn::tensor::Tensor<B, D>,
    id: burn::module::ParamId,
) -> burn::tensor::Tensor<B, D> {
    let Some(parts) = parts_of::<FloatTensor<B::InnerBackend>>() else {
        return t;
    };
    let inner = t.clone().inner().into_primitive().tensor();
    let placed = parts.reshard(&inner, id.val());
    let current: &dyn Any = placed.as_deref().unwrap_or(&inner);
    let marked = parts.at_rest(current, id.val());
    let Some(placed) = marked.or(placed) else {
        return t;
    };
    let placed = *placed
        .downcast::<FloatTensor<B::InnerBackend>>()
        .expect("LocalParts::reshard returns the primitive it was registered for");
    let mut fresh: burn::tensor::Tensor<B, D> = burn::tensor::Tensor::from_inner(
        burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(placed)),
    );
    if t.is_require_grad() {
        fresh = fresh.require_grad();
    }
    if t.is_distributed() {
        fresh = fresh.set_distributed(burn_backend::distributed::DistributedParamId::from(
            id.val(),
        ));
    }
    fresh
}

/// Tells the backend of `B` that an optimizer step begins (see [`LocalParts::step_begins`]).
pub(crate) fn step_begins<B: burn::tensor::backend::AutodiffBackend>() {
    if let Some(parts) = parts_of::<FloatTensor<B::InnerBackend>>() {
        parts.step_begins();
    }
}

/// Tells the backend of `B` that an optimizer step ended, its parameters' values placed at rest
/// by [`resharded`] (see [`LocalParts::step_ended`]).
pub(crate) fn step_ended<B: burn::tensor::backend::AutodiffBackend>() {
    if let Some(parts) = parts_of::<FloatTensor<B::InnerBackend>>() {
        parts.step_ended();
    }
}

/// This rank's part of parameter `id`'s value `t` as f32, in host memory; a failed read fails
/// the rank through `rep`.
pub(crate) fn param_values<B: burn::tensor::backend::AutodiffBackend, const D: usize>(
    rep: &super::context::Replica,
    id: burn::module::ParamId,
    t: burn::tensor::Tensor<B, D>,
) -> Vec<f32> {
    let data = read::<B::InnerBackend>(t.inner().into_primitive().tensor()).unwrap_or_else(|e| {
        rep.fail(super::error::SyncError::Read {
            what: format!("parameter {id}"),
            reason: e.to_string(),
        })
    });
    data.convert::<f32>().into_vec::<f32>().unwrap_or_else(|e| {
        rep.fail(super::error::SyncError::Read {
            what: format!("parameter {id} as f32"),
            reason: format!("{e:?}"),
        })
    })
}

/// Elements of this rank's part of `t`.
pub(crate) fn param_len<B: burn::tensor::backend::AutodiffBackend, const D: usize>(
    t: &burn::tensor::Tensor<B, D>,
) -> usize {
    shape::<B::InnerBackend>(&t.clone().inner().into_primitive().tensor()).num_elements()
}

/// Parameter `id`'s tensor `t` with this rank's part replaced by `values` (converted to its
/// dtype): a leaf again, requiring gradients as `t` did, and marked for gradient averaging when
/// `mark`.
pub(crate) fn with_values<B: burn::tensor::backend::AutodiffBackend, const D: usize>(
    t: burn::tensor::Tensor<B, D>,
    values: &[f32],
    id: burn::module::ParamId,
    mark: bool,
) -> burn::tensor::Tensor<B, D> {
    let inner = t.clone().inner().into_primitive().tensor();
    let shape = shape::<B::InnerBackend>(&inner);
    let data = TensorData::new(values.to_vec(), shape).convert_dtype(t.dtype());
    let placed = write::<B::InnerBackend>(Some(&inner), data, &t.device(), Some(id.val()));
    let mut fresh: burn::tensor::Tensor<B, D> = burn::tensor::Tensor::from_inner(
        burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(placed)),
    );
    if t.is_require_grad() {
        fresh = fresh.require_grad();
    }
    if mark {
        fresh = fresh.set_distributed(burn_backend::distributed::DistributedParamId::from(
            id.val(),
        ));
    }
    fresh
}
