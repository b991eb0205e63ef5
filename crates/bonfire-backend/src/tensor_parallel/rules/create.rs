//! Making tensors, reading them, and the autodiff bookkeeping ops that keep a placement.

use std::future::Future;

use burn_backend::distribution::Distribution;
use burn_backend::tensor::Device;
use burn_backend::{Backend, DType, ExecutionError, FloatDType, Scalar, Shape, TensorData};

use super::{map_local, settled};
use crate::tensor_parallel::redistribute::{Why, derive_partial, whole};
use crate::tensor_parallel::tensor::{Repr, TpTensor};
use crate::tensor_parallel::{TensorParallel, context};

/// Data becomes a whole tensor on every rank (each rank is given the same data).
pub(crate) fn float_from_data<I: Backend>(
    data: TensorData,
    device: &Device<TensorParallel<I>>,
) -> TpTensor<I> {
    TpTensor::replicated(I::float_from_data(data, device))
}

/// A whole random tensor, the same on every rank: drawn from the group's generator, which every
/// rank seeded alike (the inner backend's generator is per process, so ranks run as threads of
/// one process would draw different numbers from it).
pub(crate) fn float_random<I: Backend>(
    shape: Shape,
    distribution: Distribution,
    device: &Device<TensorParallel<I>>,
    dtype: FloatDType,
) -> TpTensor<I> {
    let Some(g) = context::current() else {
        return TpTensor::replicated(I::float_random(shape, distribution, device, dtype));
    };
    let data = TensorData::random::<f32, _, _>(shape, distribution, &mut *g.rng());
    let data = if DType::from(dtype) == DType::F32 {
        data
    } else {
        data.convert_dtype(dtype.into())
    };
    TpTensor::replicated(I::float_from_data(data, device))
}

pub(crate) fn float_zeros<I: Backend>(
    shape: Shape,
    device: &Device<TensorParallel<I>>,
    dtype: FloatDType,
) -> TpTensor<I> {
    TpTensor::fill(0.0, shape, dtype.into(), device.clone())
}

pub(crate) fn float_ones<I: Backend>(
    shape: Shape,
    device: &Device<TensorParallel<I>>,
    dtype: FloatDType,
) -> TpTensor<I> {
    TpTensor::fill(1.0, shape, dtype.into(), device.clone())
}

pub(crate) fn float_full<I: Backend>(
    shape: Shape,
    fill_value: Scalar,
    device: &Device<TensorParallel<I>>,
    dtype: FloatDType,
) -> TpTensor<I> {
    TpTensor::fill(
        fill_value.elem::<f64>(),
        shape,
        dtype.into(),
        device.clone(),
    )
}

pub(crate) fn float_empty<I: Backend>(
    shape: Shape,
    device: &Device<TensorParallel<I>>,
    dtype: FloatDType,
) -> TpTensor<I> {
    TpTensor::fill(0.0, shape, dtype.into(), device.clone())
}

/// The whole tensor's data (a split tensor is gathered, a partial one summed).
pub(crate) fn float_into_data<I: Backend>(
    tensor: TpTensor<I>,
) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    let whole = if context::alone() {
        crate::tensor_parallel::fallback::alone::<I>(tensor)
    } else if context::reading_parts() {
        crate::tensor_parallel::redistribute::local_of::<I>(tensor)
    } else {
        whole::<I>(tensor, Why::Read)
    };
    I::float_into_data(whole)
}

pub(crate) fn float_device<I: Backend>(tensor: &TpTensor<I>) -> Device<TensorParallel<I>> {
    tensor.device()
}

pub(crate) fn float_to_device<I: Backend>(
    tensor: TpTensor<I>,
    device: &Device<TensorParallel<I>>,
) -> TpTensor<I> {
    let tensor = match context::placing_param() {
        Some((param, how)) if context::fully_sharded() && tensor.placement().is_replicate() => {
            match how {
                context::Placing::Cut => {
                    crate::tensor_parallel::fsdp::place_as_param::<I>(tensor, param)
                }
                context::Placing::Adopt => {
                    crate::tensor_parallel::fsdp::adopt_as_param::<I>(tensor, param)
                }
            }
        }
        _ => tensor,
    };
    match tensor.repr {
        Repr::Fill { value, .. } => {
            TpTensor::fill(value, tensor.shape, tensor.dtype, device.clone())
        }
        _ => {
            let t = settled::<I>(tensor, "float_to_device");
            map_local::<I>(t, |t| I::float_to_device(t, device))
        }
    }
}

pub(crate) fn float_cast<I: Backend>(tensor: TpTensor<I>, dtype: FloatDType) -> TpTensor<I> {
    match tensor.repr {
        Repr::Fill { value, device } => TpTensor::fill(value, tensor.shape, dtype.into(), device),
        _ => {
            let t = settled::<I>(tensor, "float_cast");
            map_local::<I>(t, |t| I::float_cast(t, dtype))
        }
    }
}

/// Autodiff's bookkeeping: keeps the placement (a `Partial` stays one).
// Detaching and marking a tensor for gradients change neither its values nor its layout: a
// parameter's shard at rest keeps its tag (a model's `valid()` copy reads the same registered
// shards, so an evaluation's gathers can be served ahead).
pub(crate) fn float_detach<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    match tensor.repr {
        Repr::Partial(_) => derive_partial::<I>(&tensor, std::sync::Arc::new(I::float_detach)),
        Repr::Fill { .. } => tensor,
        _ => {
            let tag = tensor.tag.clone();
            map_local::<I>(tensor, I::float_detach).tagged(tag)
        }
    }
}

pub(crate) fn float_set_require_grad<I: Backend>(
    tensor: TpTensor<I>,
    require_grad: bool,
) -> TpTensor<I> {
    match tensor.repr {
        Repr::Partial(_) => derive_partial::<I>(
            &tensor,
            std::sync::Arc::new(move |t| I::float_set_require_grad(t, require_grad)),
        ),
        Repr::Fill { .. } => tensor,
        _ => {
            let tag = tensor.tag.clone();
            map_local::<I>(tensor, |t| I::float_set_require_grad(t, require_grad)).tagged(tag)
        }
    }
}

pub(crate) fn float_is_require_grad<I: Backend>(tensor: &TpTensor<I>) -> bool {
    match &tensor.repr {
        Repr::Local { tensor, .. } => I::float_is_require_grad(tensor),
        _ => false,
    }
}
