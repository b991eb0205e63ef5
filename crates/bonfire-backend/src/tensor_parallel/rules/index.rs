//! Indexed reads and writes. A table split along the looked-up dimension gives each rank the
//! entries it holds and zero elsewhere: a `Partial` (Megatron's vocabulary-parallel lookups, and
//! the target logit of a vocabulary-parallel cross-entropy, which never gathers the logits).

use burn_backend::tensor::{BoolTensor, IntTensor};
use burn_backend::{Backend, Scalar, Shape, TensorMetadata, get_device_settings};

use super::layout::full_slices;
use super::settled;
use crate::tensor_parallel::placement::{Placement, owned_ranges};
use crate::tensor_parallel::redistribute::{Why, local_of, part, whole};
use crate::tensor_parallel::tensor::TpTensor;

/// The range of rows of a table of `rows` rows, split in one block, that this rank holds.
pub(super) fn rows_owned(rows: usize) -> std::ops::Range<usize> {
    let (r, n) = super::rank_and_size();
    owned_ranges(rows, 1, n, r).remove(0)
}

/// `indices` into a table of `rows` rows split by rows, made local to this rank's rows: each
/// index minus the first row held, clamped into range, and a mask of the indices this rank does
/// not hold.
pub(super) fn masked_rows<I: Backend>(
    indices: IntTensor<I>,
    rows: usize,
) -> (IntTensor<I>, BoolTensor<I>) {
    let owned = rows_owned(rows);
    let bool_dtype = get_device_settings::<I>(&I::int_device(&indices)).bool_dtype;
    let shifted = I::int_sub_scalar(indices, Scalar::from(owned.start as i64));
    let below = I::int_lower_elem(shifted.clone(), Scalar::from(0i64), bool_dtype);
    let above = I::int_greater_equal_elem(
        shifted.clone(),
        Scalar::from(owned.len() as i64),
        bool_dtype,
    );
    let outside = I::bool_or(below, above);
    let local = I::int_clamp(
        shifted,
        Scalar::from(0i64),
        Scalar::from(owned.len() as i64 - 1),
    );
    (local, outside)
}

/// This rank's part, along `dim` split as `target`, of a whole int tensor.
fn int_part<I: Backend>(t: IntTensor<I>, dim: usize, blocks: usize) -> IntTensor<I> {
    let shape = t.shape();
    let (r, n) = super::rank_and_size();
    let pieces: Vec<IntTensor<I>> = owned_ranges(shape[dim], blocks, n, r)
        .into_iter()
        .map(|range| I::int_slice(t.clone(), &full_slices(&shape, dim, range)))
        .collect();
    if pieces.len() == 1 {
        pieces.into_iter().next().expect("one piece")
    } else {
        I::int_cat(pieces, dim)
    }
}

/// `out[i][j] = tensor[i][indices[i][j]]` (along `dim`).
pub(crate) fn float_gather<I: Backend>(
    dim: usize,
    tensor: TpTensor<I>,
    indices: IntTensor<I>,
) -> TpTensor<I> {
    let out_shape = indices.shape();
    let tensor = settled::<I>(tensor, "float_gather");
    match tensor.placement() {
        Placement::Replicate => {
            TpTensor::replicated(I::float_gather(dim, local_of::<I>(tensor), indices))
        }
        Placement::Shard { dim: d, blocks: 1 } if d == dim => {
            let (idx, outside) = masked_rows::<I>(indices, tensor.shape[dim]);
            let got = I::float_gather(dim, local_of::<I>(tensor), idx);
            TpTensor::partial(I::float_mask_fill(got, outside, 0f32.into()))
        }
        Placement::Shard { dim: d, blocks } if d != dim && out_shape[d] == tensor.shape[d] => {
            let idx = int_part::<I>(indices, d, blocks);
            let p = tensor.placement();
            let got = I::float_gather(dim, local_of::<I>(tensor), idx);
            TpTensor::local(got, p, Some(out_shape))
        }
        _ => TpTensor::replicated(I::float_gather(
            dim,
            whole::<I>(tensor, Why::Fallback("float_gather")),
            indices,
        )),
    }
}

/// Rows `indices` of `tensor` along `dim`.
pub(crate) fn float_select<I: Backend>(
    tensor: TpTensor<I>,
    dim: usize,
    indices: IntTensor<I>,
) -> TpTensor<I> {
    let mut out_shape = tensor.shape.clone();
    out_shape[dim] = indices.shape()[0];
    let tensor = settled::<I>(tensor, "float_select");
    match tensor.placement() {
        Placement::Replicate => {
            TpTensor::replicated(I::float_select(local_of::<I>(tensor), dim, indices))
        }
        Placement::Shard { dim: d, blocks: 1 } if d == dim => {
            let (idx, outside) = masked_rows::<I>(indices, tensor.shape[dim]);
            let got = I::float_select(local_of::<I>(tensor), dim, idx);
            let mut mshape = vec![1; out_shape.num_dims()];
            mshape[dim] = out_shape[dim];
            let outside = I::bool_reshape(outside, Shape::from(mshape));
            TpTensor::partial(I::float_mask_fill(got, outside, 0f32.into()))
        }
        Placement::Shard { dim: d, .. } if d != dim => {
            let p = tensor.placement();
            TpTensor::local(
                I::float_select(local_of::<I>(tensor), dim, indices),
                p,
                Some(out_shape),
            )
        }
        _ => TpTensor::replicated(I::float_select(
            whole::<I>(tensor, Why::Fallback("float_select")),
            dim,
            indices,
        )),
    }
}

/// Adds `value`'s rows into `tensor`'s rows `indices` along `dim` (autodiff's backward of
/// `select` adds the gradient into zeros).
pub(crate) fn float_select_add<I: Backend>(
    tensor: TpTensor<I>,
    dim: usize,
    indices: IntTensor<I>,
    value: TpTensor<I>,
) -> TpTensor<I> {
    let shape = tensor.shape.clone();
    let (tensor, value) = (
        settled::<I>(tensor, "float_select_add"),
        settled::<I>(value, "float_select_add"),
    );
    // A split along another dimension: both sides split alike.
    let split = match (tensor.placement(), value.placement()) {
        (p @ Placement::Shard { dim: d, .. }, _) | (_, p @ Placement::Shard { dim: d, .. })
            if d != dim =>
        {
            Some(p)
        }
        _ => None,
    };
    if let Some(p) = split {
        let t = part::<I>(tensor, p, Why::Fallback("float_select_add"));
        let v = part::<I>(value, p, Why::Fallback("float_select_add"));
        return TpTensor::local(I::float_select_add(t, dim, indices, v), p, Some(shape));
    }
    // Rows split along `dim`: each rank adds the rows it holds.
    if let Placement::Shard { dim: d, blocks: 1 } = tensor.placement()
        && d == dim
        && value.placement() == Placement::Replicate
    {
        let (idx, outside) = masked_rows::<I>(indices, shape[dim]);
        let v = local_of::<I>(value);
        let mut mshape = vec![1; v.shape().num_dims()];
        mshape[dim] = v.shape()[dim];
        let outside = I::bool_reshape(outside, Shape::from(mshape));
        let v = I::float_mask_fill(v, outside, 0f32.into());
        let p = tensor.placement();
        return TpTensor::local(
            I::float_select_add(local_of::<I>(tensor), dim, idx, v),
            p,
            Some(shape),
        );
    }
    let t = whole::<I>(tensor, Why::Fallback("float_select_add"));
    let v = whole::<I>(value, Why::Fallback("float_select_add"));
    TpTensor::replicated(I::float_select_add(t, dim, indices, v))
}
