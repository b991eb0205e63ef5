//! Tensor-level access to placements, for programs and tests that place tensors themselves (as
//! PyTorch's `distribute_tensor` and `DTensor.from_local` do).

use burn::tensor::{Tensor, TensorPrimitive};

use super::backend::TensorParallelBackend;
use super::placement::Placement;
use super::redistribute::{Why, group, local_of, shard_of, whole};
use super::tensor::TpTensor;

fn tp<B: TensorParallelBackend, const D: usize>(t: Tensor<B, D>) -> TpTensor<B::Inner> {
    B::tp_part(t.into_primitive().tensor())
}

fn wrap<B: TensorParallelBackend, const D: usize>(t: TpTensor<B::Inner>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::from_tp(t)))
}

/// Where `tensor` lives over the calling thread's group.
pub fn placement<B: TensorParallelBackend, const D: usize>(tensor: &Tensor<B, D>) -> Placement {
    tp::<B, D>(tensor.clone()).placement()
}

/// `tensor`, the same whole tensor on every rank, placed as `placement`: a `Shard` keeps this
/// rank's slice, a `Partial` keeps the tensor on rank 0 and zeros elsewhere. No communication.
/// (For `Autodiff` backends the result is a new leaf.)
///
/// # Panics
/// If a `Shard`'s dimension does not divide among the group's ranks.
pub fn distribute<B: TensorParallelBackend, const D: usize>(
    tensor: Tensor<B, D>,
    placement: Placement,
) -> Tensor<B, D> {
    super::hybrid::register::<B::Inner>();
    let t = tp::<B, D>(tensor);
    let shape = t.shape.clone();
    let (rank, n) = group().map_or((0, 1), |g| (g.rank(), g.size()));
    let full = whole::<B::Inner>(t, Why::Read);
    let placed = match placement {
        Placement::Replicate => TpTensor::replicated(full),
        Placement::Shard { dim, blocks } => {
            assert!(
                super::placement::divisible(&shape, dim, blocks, n),
                "cannot split dimension {dim} of {shape:?} in {blocks} block(s) over {n} ranks"
            );
            let local = shard_of::<B::Inner>(full, dim, blocks, n, rank);
            TpTensor::local(local, placement, Some(shape))
        }
        Placement::Partial => {
            let term = if rank == 0 {
                full
            } else {
                <B::Inner as burn_backend::ops::FloatTensorOps<B::Inner>>::float_mul_scalar(
                    full,
                    0f32.into(),
                )
            };
            TpTensor::partial(term)
        }
    };
    wrap::<B, D>(placed)
}

/// A `Partial` tensor whose value is the sum over the group's ranks of each rank's `term` (all
/// of one shape). No communication.
pub fn from_terms<B: TensorParallelBackend, const D: usize>(term: Tensor<B, D>) -> Tensor<B, D> {
    let t = tp::<B, D>(term);
    let local = whole::<B::Inner>(t, Why::Read);
    wrap::<B, D>(TpTensor::partial(local))
}

/// This rank's part of `tensor` as a whole tensor of its own (a `Shard`'s slice, a `Partial`'s
/// term, a `Replicate`'s whole value): what a per-rank checkpoint saves. No communication.
pub fn local_part<B: TensorParallelBackend, const D: usize>(tensor: Tensor<B, D>) -> Tensor<B, D> {
    let local = local_of::<B::Inner>(tp::<B, D>(tensor));
    wrap::<B, D>(TpTensor::replicated(local))
}
