//! Reductions. Over a split dimension a sum becomes a `Partial` (no communication until the sum is
//! needed whole), a max or min is reduced over the group; over another dimension the split stays.

use bonfire_topology::ReduceOp;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Shape};

use super::{keep_partial, map_local, settled, with_dim};
use crate::tensor_parallel::placement::Placement;
use crate::tensor_parallel::redistribute::{all_reduce, group, local_of};
use crate::tensor_parallel::tensor::{Repr, TpTensor};

/// A sum-like reduction (`sum`, `mean` and their `_dim` forms): linear, so a `Partial` stays
/// one. `over_split`: whether it reduces over `S(d)`'s dimension d (then each rank's result is a
/// term of the whole: a `Partial`); `scale` turns a local sum into the op's value (1 for sums,
/// 1 / count for means).
fn sum_like<I: Backend>(
    t: TpTensor<I>,
    out_shape: Shape,
    over_split: impl FnOnce(usize) -> bool,
    local_op: impl Fn(FloatTensor<I>) -> FloatTensor<I> + Send + Sync + 'static,
    split_op: impl FnOnce(FloatTensor<I>) -> FloatTensor<I>,
    fill: impl FnOnce(f64) -> f64,
) -> TpTensor<I> {
    if let Repr::Fill { value, device } = &t.repr {
        return TpTensor::fill(fill(*value), out_shape, t.dtype, device.clone());
    }
    keep_partial::<I, _>(t, local_op, move |t, f| match t.placement() {
        Placement::Shard { dim, .. } if over_split(dim) => {
            TpTensor::partial(split_op(local_of::<I>(t)))
        }
        Placement::Shard { .. } => map_local::<I>(t, f),
        _ => TpTensor::replicated(f(local_of::<I>(t))),
    })
}

pub(crate) fn float_sum<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    let count = tensor.shape.num_elements() as f64;
    sum_like::<I>(
        tensor,
        Shape::new([1]),
        |_| true,
        I::float_sum,
        I::float_sum,
        |v| v * count,
    )
}

pub(crate) fn float_mean<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    let count = tensor.shape.num_elements();
    sum_like::<I>(
        tensor,
        Shape::new([1]),
        |_| true,
        I::float_mean,
        move |t| I::float_div_scalar(I::float_sum(t), (count as f64).into()),
        |v| v,
    )
}

pub(crate) fn float_sum_dim<I: Backend>(tensor: TpTensor<I>, dim: usize) -> TpTensor<I> {
    let size = tensor.shape[dim] as f64;
    let out = with_dim(&tensor.shape, dim, 1);
    sum_like::<I>(
        tensor,
        out,
        move |d| d == dim,
        move |t| I::float_sum_dim(t, dim),
        move |t| I::float_sum_dim(t, dim),
        move |v| v * size,
    )
}

pub(crate) fn float_mean_dim<I: Backend>(tensor: TpTensor<I>, dim: usize) -> TpTensor<I> {
    let size = tensor.shape[dim];
    let out = with_dim(&tensor.shape, dim, 1);
    sum_like::<I>(
        tensor,
        out,
        move |d| d == dim,
        move |t| I::float_mean_dim(t, dim),
        move |t| I::float_div_scalar(I::float_sum_dim(t, dim), (size as f64).into()),
        |v| v,
    )
}

/// A max or min over `dim`: over a split dimension, each rank's extreme of its part, reduced
/// over the group (one all-reduce of the output's size).
fn extreme_dim<I: Backend>(
    t: TpTensor<I>,
    dim: usize,
    op: &'static str,
    how: ReduceOp,
    f: impl Fn(FloatTensor<I>, usize) -> FloatTensor<I>,
) -> TpTensor<I> {
    let out = with_dim(&t.shape, dim, 1);
    if let Repr::Fill { value, device } = &t.repr {
        return TpTensor::fill(*value, out, t.dtype, device.clone());
    }
    let t = settled::<I>(t, op);
    match (t.placement(), group()) {
        (Placement::Shard { dim: d, .. }, Some(g)) if d == dim => {
            let local = f(local_of::<I>(t), dim);
            TpTensor::replicated(all_reduce::<I>(&g, local, op, how))
        }
        _ => map_local::<I>(t, |x| f(x, dim)),
    }
}

pub(crate) fn float_max_dim<I: Backend>(tensor: TpTensor<I>, dim: usize) -> TpTensor<I> {
    extreme_dim::<I>(
        tensor,
        dim,
        "float_max_dim",
        ReduceOp::Max,
        I::float_max_dim,
    )
}

pub(crate) fn float_min_dim<I: Backend>(tensor: TpTensor<I>, dim: usize) -> TpTensor<I> {
    extreme_dim::<I>(
        tensor,
        dim,
        "float_min_dim",
        ReduceOp::Min,
        I::float_min_dim,
    )
}

/// The max (or min) of every element: each rank's over its part, reduced over the group when
/// split.
fn extreme<I: Backend>(
    t: TpTensor<I>,
    op: &'static str,
    how: ReduceOp,
    f: impl Fn(FloatTensor<I>) -> FloatTensor<I>,
) -> TpTensor<I> {
    if let Repr::Fill { value, device } = &t.repr {
        return TpTensor::fill(*value, Shape::new([1]), t.dtype, device.clone());
    }
    let t = settled::<I>(t, op);
    match (t.placement(), group()) {
        (Placement::Shard { .. }, Some(g)) => {
            let local = f(local_of::<I>(t));
            TpTensor::replicated(all_reduce::<I>(&g, local, op, how))
        }
        _ => TpTensor::replicated(f(local_of::<I>(t))),
    }
}

pub(crate) fn float_max<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    extreme::<I>(tensor, "float_max", ReduceOp::Max, I::float_max)
}

pub(crate) fn float_min<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    extreme::<I>(tensor, "float_min", ReduceOp::Min, I::float_min)
}
