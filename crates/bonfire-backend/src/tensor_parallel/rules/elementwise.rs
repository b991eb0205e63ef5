//! Elementwise ops: they keep `Replicate` and `Shard` (a whole operand is sliced to the other's
//! split, or broadcast when its split dimension is 1), keep `Partial` when they are linear in it,
//! and sum it first otherwise.

use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, Scalar, TensorMetadata};

use super::{binary, keep_partial, map_local, settled, unary};
use crate::tensor_parallel::placement::{Placement, owned_ranges};
use crate::tensor_parallel::redistribute::local_of;
use crate::tensor_parallel::tensor::{Repr, TpTensor};

pub(crate) fn float_exp<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_exp", I::float_exp)
}

pub(crate) fn float_log<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_log", I::float_log)
}

pub(crate) fn float_log1p<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_log1p", I::float_log1p)
}

pub(crate) fn float_sqrt<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_sqrt", I::float_sqrt)
}

pub(crate) fn float_abs<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_abs", I::float_abs)
}

pub(crate) fn float_cos<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_cos", I::float_cos)
}

pub(crate) fn float_sin<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_sin", I::float_sin)
}

pub(crate) fn float_tan<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_tan", I::float_tan)
}

pub(crate) fn float_cosh<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_cosh", I::float_cosh)
}

pub(crate) fn float_sinh<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_sinh", I::float_sinh)
}

pub(crate) fn float_tanh<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_tanh", I::float_tanh)
}

pub(crate) fn float_acos<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_acos", I::float_acos)
}

pub(crate) fn float_acosh<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_acosh", I::float_acosh)
}

pub(crate) fn float_asin<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_asin", I::float_asin)
}

pub(crate) fn float_asinh<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_asinh", I::float_asinh)
}

pub(crate) fn float_atan<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_atan", I::float_atan)
}

pub(crate) fn float_atanh<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_atanh", I::float_atanh)
}

pub(crate) fn float_round<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_round", I::float_round)
}

pub(crate) fn float_floor<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_floor", I::float_floor)
}

pub(crate) fn float_ceil<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_ceil", I::float_ceil)
}

pub(crate) fn float_trunc<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_trunc", I::float_trunc)
}

pub(crate) fn float_erf<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_erf", I::float_erf)
}

pub(crate) fn float_recip<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_recip", I::float_recip)
}

pub(crate) fn float_sign<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "float_sign", I::float_sign)
}

pub(crate) fn float_clamp_min<I: Backend>(tensor: TpTensor<I>, min: Scalar) -> TpTensor<I> {
    unary::<I>(tensor, "float_clamp_min", |t| I::float_clamp_min(t, min))
}

pub(crate) fn float_clamp_max<I: Backend>(tensor: TpTensor<I>, max: Scalar) -> TpTensor<I> {
    unary::<I>(tensor, "float_clamp_max", |t| I::float_clamp_max(t, max))
}

pub(crate) fn float_powf_scalar<I: Backend>(tensor: TpTensor<I>, value: Scalar) -> TpTensor<I> {
    unary::<I>(tensor, "float_powf_scalar", |t| {
        I::float_powf_scalar(t, value)
    })
}

pub(crate) fn float_powf_scalar_impl<I: Backend>(
    tensor: TpTensor<I>,
    value: Scalar,
) -> TpTensor<I> {
    unary::<I>(tensor, "float_powf_scalar_impl", |t| {
        I::float_powf_scalar_impl(t, value)
    })
}

pub(crate) fn float_remainder_scalar<I: Backend>(lhs: TpTensor<I>, rhs: Scalar) -> TpTensor<I> {
    unary::<I>(lhs, "float_remainder_scalar", |t| {
        I::float_remainder_scalar(t, rhs)
    })
}

pub(crate) fn float_powi_scalar<I: Backend>(lhs: TpTensor<I>, rhs: Scalar) -> TpTensor<I> {
    unary::<I>(lhs, "float_powi_scalar", |t| I::float_powi_scalar(t, rhs))
}

pub(crate) fn float_powi_scalar_impl<I: Backend>(lhs: TpTensor<I>, rhs: Scalar) -> TpTensor<I> {
    unary::<I>(lhs, "float_powi_scalar_impl", |t| {
        I::float_powi_scalar_impl(t, rhs)
    })
}

pub(crate) fn float_clamp<I: Backend>(
    tensor: TpTensor<I>,
    min: Scalar,
    max: Scalar,
) -> TpTensor<I> {
    unary::<I>(tensor, "float_clamp", |t| I::float_clamp(t, min, max))
}

/// `-x`: linear, so a `Partial` stays one; a constant stays a constant.
pub(crate) fn float_neg<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    scale::<I>(tensor, -1.0, I::float_neg)
}

pub(crate) fn float_mul_scalar<I: Backend>(lhs: TpTensor<I>, rhs: Scalar) -> TpTensor<I> {
    let s = rhs.elem::<f64>();
    scale::<I>(lhs, s, move |t| I::float_mul_scalar(t, rhs))
}

pub(crate) fn float_div_scalar<I: Backend>(lhs: TpTensor<I>, rhs: Scalar) -> TpTensor<I> {
    let s = rhs.elem::<f64>();
    scale::<I>(lhs, 1.0 / s, move |t| I::float_div_scalar(t, rhs))
}

/// A scale by `factor`, which `f` computes.
fn scale<I: Backend>(
    t: TpTensor<I>,
    factor: f64,
    f: impl Fn(FloatTensor<I>) -> FloatTensor<I> + Send + Sync + 'static,
) -> TpTensor<I> {
    if let Repr::Fill { value, device } = &t.repr {
        return TpTensor::fill(value * factor, t.shape.clone(), t.dtype, device.clone());
    }
    keep_partial::<I, _>(t, f, |t, f| map_local::<I>(t, f))
}

pub(crate) fn float_add_scalar<I: Backend>(lhs: TpTensor<I>, rhs: Scalar) -> TpTensor<I> {
    if let Repr::Fill { value, device } = &lhs.repr {
        return TpTensor::fill(
            value + rhs.elem::<f64>(),
            lhs.shape.clone(),
            lhs.dtype,
            device.clone(),
        );
    }
    unary::<I>(lhs, "float_add_scalar", |t| I::float_add_scalar(t, rhs))
}

pub(crate) fn float_sub_scalar<I: Backend>(lhs: TpTensor<I>, rhs: Scalar) -> TpTensor<I> {
    if let Repr::Fill { value, device } = &lhs.repr {
        return TpTensor::fill(
            value - rhs.elem::<f64>(),
            lhs.shape.clone(),
            lhs.dtype,
            device.clone(),
        );
    }
    unary::<I>(lhs, "float_sub_scalar", |t| I::float_sub_scalar(t, rhs))
}

/// `P + P` stays a `Partial`.
pub(crate) fn float_add<I: Backend>(lhs: TpTensor<I>, rhs: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(lhs, rhs, "float_add", Some(false), I::float_add)
}

/// `P - P` stays a `Partial`.
pub(crate) fn float_sub<I: Backend>(lhs: TpTensor<I>, rhs: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(lhs, rhs, "float_sub", Some(true), I::float_sub)
}

pub(crate) fn float_mul<I: Backend>(lhs: TpTensor<I>, rhs: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(lhs, rhs, "float_mul", None, I::float_mul)
}

pub(crate) fn float_div<I: Backend>(lhs: TpTensor<I>, rhs: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(lhs, rhs, "float_div", None, I::float_div)
}

pub(crate) fn float_remainder<I: Backend>(lhs: TpTensor<I>, rhs: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(lhs, rhs, "float_remainder", None, I::float_remainder)
}

pub(crate) fn float_powf<I: Backend>(lhs: TpTensor<I>, rhs: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(lhs, rhs, "float_powf", None, I::float_powf)
}

pub(crate) fn float_atan2<I: Backend>(lhs: TpTensor<I>, rhs: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(lhs, rhs, "float_atan2", None, I::float_atan2)
}

/// A whole bool tensor's part for an output placed `target` (broadcast when its split dimension
/// is 1).
pub(super) fn bool_part<I: Backend>(mask: BoolTensor<I>, target: Placement) -> BoolTensor<I> {
    let Placement::Shard { dim, blocks } = target else {
        return mask;
    };
    let shape = mask.shape();
    if shape[dim] == 1 {
        return mask;
    }
    let (r, n) = super::rank_and_size();
    let pieces: Vec<BoolTensor<I>> = owned_ranges(shape[dim], blocks, n, r)
        .into_iter()
        .map(|range| {
            I::bool_slice(
                mask.clone(),
                &super::layout::full_slices(&shape, dim, range),
            )
        })
        .collect();
    if pieces.len() == 1 {
        pieces.into_iter().next().expect("one piece")
    } else {
        I::bool_cat(pieces, dim)
    }
}

/// `tensor` where `mask` is false, `value` where it is true. The mask (whole on every rank) is
/// sliced to the tensor's split.
pub(crate) fn float_mask_fill<I: Backend>(
    tensor: TpTensor<I>,
    mask: BoolTensor<I>,
    value: Scalar,
) -> TpTensor<I> {
    let tensor = match tensor.repr {
        Repr::Fill { .. } => TpTensor::replicated(local_of::<I>(tensor)),
        _ => settled::<I>(tensor, "float_mask_fill"),
    };
    let target = tensor.placement();
    let mask = bool_part::<I>(mask, target);
    map_local::<I>(tensor, |t| I::float_mask_fill(t, mask, value))
}

/// `tensor` where `mask` is false, `value` where it is true (elementwise, with broadcasting).
pub(crate) fn float_mask_where<I: Backend>(
    tensor: TpTensor<I>,
    mask: BoolTensor<I>,
    value: TpTensor<I>,
) -> TpTensor<I> {
    let shape = super::broadcast(&tensor.shape, &value.shape);
    let (tensor, value) = (
        settled::<I>(tensor, "float_mask_where"),
        settled::<I>(value, "float_mask_where"),
    );
    let target = match (tensor.placement(), value.placement()) {
        (p @ Placement::Shard { .. }, _) | (_, p @ Placement::Shard { .. }) => p,
        _ => Placement::Replicate,
    };
    let t = super::operand::<I>(tensor, target, "float_mask_where");
    let v = super::operand::<I>(value, target, "float_mask_where");
    let mask = bool_part::<I>(mask, target);
    TpTensor::local(I::float_mask_where(t, mask, v), target, Some(shape))
}
