//! Layout ops: the split moves with its dimension. A `Partial` stays one (these are linear).

use std::ops::Range;

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Shape, Slice, TensorMetadata};

use super::{keep_partial, settled};
use crate::tensor_parallel::placement::{Placement, local_shape, reshape_shard};
use crate::tensor_parallel::redistribute::{
    Why, cat_partials, derive_partial, local_of, part, ranks, whole,
};
use crate::tensor_parallel::tensor::{ParamTag, Repr, TpTensor};

/// Slices that keep every dimension of `shape` whole except `dim`, cut to `range`.
pub(super) fn full_slices(shape: &Shape, dim: usize, range: Range<usize>) -> Vec<Slice> {
    (0..shape.num_dims())
        .map(|d| {
            if d == dim {
                Slice::from(range.clone())
            } else {
                Slice::from(0..shape[d])
            }
        })
        .collect()
}

/// `t` whole, by `op`'s fallback, with `f` run on it.
fn gathered<I: Backend>(
    t: TpTensor<I>,
    op: &'static str,
    f: impl FnOnce(FloatTensor<I>) -> FloatTensor<I>,
) -> TpTensor<I> {
    TpTensor::replicated(f(whole::<I>(t, Why::Fallback(op))))
}

/// A layout op: `Replicate` and `Partial` run it as they are (`Partial` lazily), a constant
/// takes the new shape, `Shard` runs it locally when `moved` says where the split goes.
fn layout<I: Backend>(
    t: TpTensor<I>,
    op: &'static str,
    out_shape: Shape,
    moved: impl FnOnce(usize, usize) -> Option<(usize, usize)>,
    f: impl Fn(FloatTensor<I>, &Shape) -> FloatTensor<I> + Send + Sync + 'static,
) -> TpTensor<I> {
    if let Repr::Fill { value, device } = &t.repr {
        return TpTensor::fill(*value, out_shape, t.dtype, device.clone());
    }
    let shape_for_partial = out_shape.clone();
    keep_partial::<I, _>(
        t,
        move |x| f(x, &shape_for_partial),
        |t, f| match t.placement() {
            Placement::Replicate => TpTensor::replicated(f(local_of::<I>(t))),
            Placement::Shard { dim, blocks } => match moved(dim, blocks) {
                Some((d, b)) => {
                    let p = Placement::Shard { dim: d, blocks: b };
                    let tag = t.tag.clone();
                    let out = TpTensor::local(f(local_of::<I>(t)), p, Some(out_shape));
                    // `f` runs alike on every rank's part (it ignores the shape it is given).
                    out.tagged(ParamTag::viewed(&tag, f))
                }
                None => gathered::<I>(t, op, f),
            },
            Placement::Partial => unreachable!("handled by linear"),
        },
    )
}

pub(crate) fn float_reshape<I: Backend>(tensor: TpTensor<I>, shape: Shape) -> TpTensor<I> {
    let from = tensor.shape.clone();
    let n = ranks();
    let to = shape.clone();
    match tensor.placement() {
        // The local reshape of a split tensor takes the local shape, so it is done here.
        Placement::Shard { dim, blocks } => match reshape_shard(&from, &to, dim, blocks, n) {
            Some((d, b)) => {
                let p = Placement::Shard { dim: d, blocks: b };
                let local = local_shape(&to, p, n);
                let tag = tensor.tag.clone();
                let out = I::float_reshape(local_of::<I>(tensor), local.clone());
                TpTensor::local(out, p, Some(to)).tagged(ParamTag::viewed(&tag, move |t| {
                    I::float_reshape(t, local.clone())
                }))
            }
            None => gathered::<I>(tensor, "float_reshape", |t| I::float_reshape(t, to)),
        },
        _ => layout::<I>(
            tensor,
            "float_reshape",
            shape,
            |_, _| None,
            |t, s| I::float_reshape(t, s.clone()),
        ),
    }
}

pub(crate) fn float_swap_dims<I: Backend>(
    tensor: TpTensor<I>,
    dim1: usize,
    dim2: usize,
) -> TpTensor<I> {
    let mut out = tensor.shape.clone();
    out.as_mut_slice().swap(dim1, dim2);
    let swap = move |d: usize| {
        if d == dim1 {
            dim2
        } else if d == dim2 {
            dim1
        } else {
            d
        }
    };
    layout::<I>(
        tensor,
        "float_swap_dims",
        out,
        move |d, b| Some((swap(d), b)),
        move |t, _| I::float_swap_dims(t, dim1, dim2),
    )
}

pub(crate) fn float_transpose<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    let n = tensor.shape.num_dims();
    float_swap_dims::<I>(tensor, n - 2, n - 1)
}

pub(crate) fn float_permute<I: Backend>(tensor: TpTensor<I>, axes: &[usize]) -> TpTensor<I> {
    let out = Shape::from(axes.iter().map(|&a| tensor.shape[a]).collect::<Vec<_>>());
    let axes_owned = axes.to_vec();
    let moved_axes = axes_owned.clone();
    layout::<I>(
        tensor,
        "float_permute",
        out,
        move |d, b| moved_axes.iter().position(|&a| a == d).map(|p| (p, b)),
        move |t, _| I::float_permute(t, &axes_owned),
    )
}

/// Broadcasts size-1 dimensions (and adds leading ones); a split dimension is never size 1, so
/// it keeps its size and moves by the added leading dimensions.
pub(crate) fn float_expand<I: Backend>(tensor: TpTensor<I>, shape: Shape) -> TpTensor<I> {
    let added = shape.num_dims() - tensor.shape.num_dims();
    let n = ranks();
    match tensor.placement() {
        Placement::Shard { dim, blocks } => {
            let p = Placement::Shard {
                dim: dim + added,
                blocks,
            };
            let local = local_shape(&shape, p, n);
            let tag = tensor.tag.clone();
            let out = I::float_expand(local_of::<I>(tensor), local.clone());
            TpTensor::local(out, p, Some(shape)).tagged(ParamTag::viewed(&tag, move |t| {
                I::float_expand(t, local.clone())
            }))
        }
        _ => layout::<I>(
            tensor,
            "float_expand",
            shape,
            |_, _| None,
            |t, s| I::float_expand(t, s.clone()),
        ),
    }
}

/// Slicing keeps a split when the split dimension is taken whole, or (for a split in blocks)
/// when whole blocks are taken; otherwise the tensor is gathered.
pub(crate) fn float_slice<I: Backend>(tensor: TpTensor<I>, slices: &[Slice]) -> TpTensor<I> {
    let shape = tensor.shape.clone();
    let out = Shape::from(
        (0..shape.num_dims())
            .map(|d| slices.get(d).map_or(shape[d], |s| s.output_size(shape[d])))
            .collect::<Vec<_>>(),
    );
    let owned = slices.to_vec();
    match tensor.placement() {
        Placement::Shard { dim, blocks } => {
            let n = ranks();
            let whole_dim = Slice::from(0..shape[dim]);
            let s = slices.get(dim).copied().unwrap_or(whole_dim);
            let (range, step) = s.to_range_and_step(shape[dim]);
            let block = shape[dim] / blocks;
            let aligned = step == 1
                && range.start % block == 0
                && range.end % block == 0
                && range.end > range.start;
            if !aligned {
                return gathered::<I>(tensor, "float_slice", |t| I::float_slice(t, &owned));
            }
            // Whole blocks `first..last` of the split dimension: locally, the same blocks of the
            // local part (each block's local chunk has `block / n` elements).
            let (first, last) = (range.start / block, range.end / block);
            let chunk = block / n;
            let local_slices: Vec<Slice> = (0..shape.num_dims())
                .map(|d| match owned.get(d) {
                    _ if d == dim => Slice::from(first * chunk..last * chunk),
                    Some(s) => *s,
                    None => Slice::from(0..shape[d]),
                })
                .collect();
            let p = Placement::Shard {
                dim,
                blocks: last - first,
            };
            let tag = tensor.tag.clone();
            let out = TpTensor::local(
                I::float_slice(local_of::<I>(tensor), &local_slices),
                p,
                Some(out),
            );
            out.tagged(ParamTag::viewed(&tag, move |t| {
                I::float_slice(t, &local_slices)
            }))
        }
        _ => layout::<I>(
            tensor,
            "float_slice",
            out,
            |_, _| None,
            move |t, _| I::float_slice(t, &owned),
        ),
    }
}

/// Writes `value` into `tensor` at `slices`. Autodiff's slice backward writes a gradient into
/// zeros: with a split gradient and the split dimension whole, the zeros are made split; with a
/// `Partial` gradient, the result is a `Partial` (zeros are a sum of zeros).
pub(crate) fn float_slice_assign<I: Backend>(
    tensor: TpTensor<I>,
    slices: &[Slice],
    value: TpTensor<I>,
) -> TpTensor<I> {
    let shape = tensor.shape.clone();
    let zeros = matches!(tensor.repr, Repr::Fill { value: v, .. } if v == 0.0);
    if zeros && matches!(value.repr, Repr::Partial(_)) {
        // Writing into zeros is linear in the value.
        let (shape, dtype, device) = (tensor.shape.clone(), tensor.dtype, tensor.device());
        let owned = slices.to_vec();
        return derive_partial::<I>(
            &value,
            std::sync::Arc::new(move |v| {
                let zeros = I::float_zeros(shape.clone(), &device, dtype.into());
                I::float_slice_assign(zeros, &owned, v)
            }),
        );
    }
    let (tensor, value) = (
        settled::<I>(tensor, "float_slice_assign"),
        settled::<I>(value, "float_slice_assign"),
    );
    if let Placement::Shard { dim, blocks: 1 } = value.placement() {
        let taken_whole = slices
            .get(dim)
            .is_none_or(|s| s.to_range_and_step(shape[dim]) == (0..shape[dim], 1));
        if taken_whole && value.shape[dim] == shape[dim] {
            let target = value.placement();
            let base = part::<I>(tensor, target, Why::Fallback("float_slice_assign"));
            let mut local_slices = slices.to_vec();
            if dim < local_slices.len() {
                local_slices[dim] = Slice::from(0..base.shape()[dim]);
            }
            let out = I::float_slice_assign(base, &local_slices, local_of::<I>(value));
            return TpTensor::local(out, target, Some(shape));
        }
    }
    let base = whole::<I>(tensor, Why::Fallback("float_slice_assign"));
    let v = whole::<I>(value, Why::Fallback("float_slice_assign"));
    TpTensor::replicated(I::float_slice_assign(base, slices, v))
}

/// Concatenation along a dimension that is not split keeps the split; along the split
/// dimension, parts of equal size become the blocks of a split in blocks. All `Partial`s stay
/// `Partial`.
pub(crate) fn float_cat<I: Backend>(tensors: Vec<TpTensor<I>>, dim: usize) -> TpTensor<I> {
    let mut shape = tensors[0].shape.clone();
    shape[dim] = tensors.iter().map(|t| t.shape[dim]).sum();
    if tensors.iter().all(|t| matches!(t.repr, Repr::Partial(_))) {
        return cat_partials::<I>(tensors, dim);
    }
    let first = tensors[0].placement();
    let same = tensors.iter().all(|t| t.placement() == first);
    if same && let Placement::Shard { dim: d, blocks } = first {
        if d != dim {
            let locals = tensors.into_iter().map(local_of::<I>).collect();
            return TpTensor::local(I::float_cat(locals, dim), first, Some(shape));
        }
        let size = tensors[0].shape[d];
        if blocks == 1 && tensors.iter().all(|t| t.shape[d] == size) {
            let p = Placement::Shard {
                dim,
                blocks: tensors.len(),
            };
            let locals = tensors.into_iter().map(local_of::<I>).collect();
            return TpTensor::local(I::float_cat(locals, dim), p, Some(shape));
        }
    }
    if tensors
        .iter()
        .all(|t| t.placement() == Placement::Replicate)
    {
        let locals = tensors.into_iter().map(local_of::<I>).collect();
        return TpTensor::replicated(I::float_cat(locals, dim));
    }
    let wholes = tensors
        .into_iter()
        .map(|t| whole::<I>(t, Why::Fallback("float_cat")))
        .collect();
    TpTensor::replicated(I::float_cat(wholes, dim))
}
