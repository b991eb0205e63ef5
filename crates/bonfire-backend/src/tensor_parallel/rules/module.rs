//! Module ops written as the tensor ops Burn's defaults are made of, so that the placement rules
//! apply to each step (a linear layer is a matmul and an add; its backward, matmuls and sums),
//! and the embedding lookup, whose table may be split by rows (vocabulary-parallel) or columns.

use burn_backend::tensor::IntTensor;
use burn_backend::{Backend, Scalar, Shape, TensorMetadata};

use super::index::masked_rows;
use super::{
    float_add, float_add_scalar, float_div, float_matmul, float_mean_dim, float_mul, float_reshape,
    float_sqrt, float_sub, float_sum_dim, float_swap_dims, settled,
};
use crate::tensor_parallel::placement::Placement;
use crate::tensor_parallel::redistribute::{Why, local_of, whole};
use crate::tensor_parallel::tensor::TpTensor;

/// `t` with leading size-1 dimensions added up to `rank`.
fn unsqueeze_leading<I: Backend>(t: TpTensor<I>, rank: usize) -> TpTensor<I> {
    let n = t.shape.num_dims();
    if n >= rank {
        return t;
    }
    let mut dims = vec![1; rank - n];
    dims.extend_from_slice(t.shape.as_slice());
    float_reshape::<I>(t, Shape::from(dims))
}

/// `x @ weight + bias`, weight `[d_in, d_out]` (a column-split weight gives a column-split
/// output; a row-split weight and split input, a `Partial` summed when the bias is added).
pub(crate) fn linear<I: Backend>(
    x: TpTensor<I>,
    weight: TpTensor<I>,
    bias: Option<TpTensor<I>>,
) -> TpTensor<I> {
    let rank = x.shape.num_dims();
    let out = float_matmul::<I>(x, unsqueeze_leading::<I>(weight, rank));
    match bias {
        Some(b) => float_add::<I>(out, unsqueeze_leading::<I>(b, rank)),
        None => out,
    }
}

/// `output_grad @ weight^T`.
pub(crate) fn linear_x_backward<I: Backend>(
    weight: TpTensor<I>,
    output_grad: TpTensor<I>,
) -> TpTensor<I> {
    let rank = output_grad.shape.num_dims();
    let w = unsqueeze_leading::<I>(float_swap_dims::<I>(weight, 0, 1), rank);
    float_matmul::<I>(output_grad, w)
}

/// `x^T @ output_grad`, summed over the batch dimensions.
pub(crate) fn linear_weight_backward<I: Backend>(
    x: TpTensor<I>,
    output_grad: TpTensor<I>,
) -> TpTensor<I> {
    let rank = x.shape.num_dims();
    let xt = float_swap_dims::<I>(x, rank - 2, rank - 1);
    let mut grad = float_matmul::<I>(xt, output_grad);
    if rank > 2 {
        for dim in 0..rank - 2 {
            grad = float_sum_dim::<I>(grad, dim);
        }
        let (d0, d1) = (grad.shape[rank - 2], grad.shape[rank - 1]);
        grad = float_reshape::<I>(grad, Shape::new([d0, d1]));
    }
    grad
}

/// `output_grad` summed over every dimension but the last.
pub(crate) fn linear_bias_backward<I: Backend>(output_grad: TpTensor<I>) -> TpTensor<I> {
    let rank = output_grad.shape.num_dims();
    let mut grad = output_grad;
    for dim in 0..rank - 1 {
        grad = float_sum_dim::<I>(grad, dim);
    }
    let d = grad.shape[rank - 1];
    float_reshape::<I>(grad, Shape::new([d]))
}

/// Layer normalisation over the last dimension, as Burn's default computes it, so that a split
/// of another dimension stays split (a split of the normalised dimension is reduced over the
/// group by the mean's rule).
pub(crate) fn layer_norm<I: Backend>(
    tensor: TpTensor<I>,
    gamma: TpTensor<I>,
    beta: Option<TpTensor<I>>,
    epsilon: f64,
) -> TpTensor<I> {
    let rank = tensor.shape.num_dims();
    let last = rank - 1;
    let mean = float_mean_dim::<I>(tensor.clone(), last);
    let centered = float_sub::<I>(tensor, mean);
    let var = float_mean_dim::<I>(float_mul::<I>(centered.clone(), centered.clone()), last);
    let denom = float_sqrt::<I>(float_add_scalar::<I>(var, Scalar::from(epsilon)));
    let normalized = float_div::<I>(centered, denom);
    let scaled = float_mul::<I>(normalized, unsqueeze_leading::<I>(gamma, rank));
    match beta {
        Some(b) => float_add::<I>(scaled, unsqueeze_leading::<I>(b, rank)),
        None => scaled,
    }
}

/// Looks up rows of `weights` `[vocab, d]` for `indices` `[b, s]`: a table split by rows gives
/// each rank the rows it holds (zero elsewhere): a `Partial` of `[b, s, d]`, as Megatron's
/// vocabulary-parallel embedding; split by columns, a column split of the output.
pub(crate) fn embedding<I: Backend>(weights: TpTensor<I>, indices: IntTensor<I>) -> TpTensor<I> {
    let [b, s] = indices.shape().dims();
    let out_shape = Shape::new([b, s, weights.shape[1]]);
    let weights = settled::<I>(weights, "embedding");
    match weights.placement() {
        Placement::Shard { dim: 0, blocks: 1 } => {
            let (idx, outside) = masked_rows::<I>(indices, weights.shape[0]);
            let rows = I::embedding(local_of::<I>(weights), idx);
            let outside = I::bool_reshape(outside, Shape::new([b, s, 1]));
            TpTensor::partial(I::float_mask_fill(rows, outside, 0f32.into()))
        }
        Placement::Shard { dim: 1, blocks } => {
            let out = I::embedding(local_of::<I>(weights), indices);
            TpTensor::local(out, Placement::Shard { dim: 2, blocks }, Some(out_shape))
        }
        _ => TpTensor::replicated(I::embedding(
            whole::<I>(weights, Why::Fallback("embedding")),
            indices,
        )),
    }
}

/// The gradient of [`embedding`]'s table: placed as the table is.
pub(crate) fn embedding_backward<I: Backend>(
    weights: TpTensor<I>,
    output_grad: TpTensor<I>,
    indices: IntTensor<I>,
) -> TpTensor<I> {
    let wshape = weights.shape.clone();
    match weights.placement() {
        Placement::Shard { dim: 0, blocks: 1 } => {
            // Each rank scatters the gradient of the rows it holds.
            let [b, s] = indices.shape().dims();
            let grad = whole::<I>(output_grad, Why::Rule("embedding_backward"));
            let (idx, outside) = masked_rows::<I>(indices, wshape[0]);
            let outside = I::bool_reshape(outside, Shape::new([b, s, 1]));
            let grad = I::float_mask_fill(grad, outside, 0f32.into());
            let local = I::embedding_backward(local_of::<I>(weights), grad, idx);
            TpTensor::local(local, Placement::shard(0), Some(wshape))
        }
        Placement::Shard { dim: 1, blocks } => {
            let target = Placement::Shard { dim: 2, blocks };
            let grad = crate::tensor_parallel::redistribute::part::<I>(
                settled::<I>(output_grad, "embedding_backward"),
                target,
                Why::Fallback("embedding_backward"),
            );
            let local = I::embedding_backward(local_of::<I>(weights), grad, indices);
            TpTensor::local(local, Placement::Shard { dim: 1, blocks }, Some(wshape))
        }
        _ => {
            let w = whole::<I>(weights, Why::Fallback("embedding_backward"));
            let g = whole::<I>(output_grad, Why::Rule("embedding_backward"));
            TpTensor::replicated(I::embedding_backward(w, g, indices))
        }
    }
}
