//! What an op without a rule does: its float inputs are made whole (a `Shard` gathered and
//! counted as that op's fallback, a `Partial` summed), the inner backend runs the op, and float
//! results are replicated. Always correct, only slower. The generated op impls in `ops/` call
//! these; the conversions of the op-trait types that are generic over the backend are here too.

use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitive,
};
use burn_backend::quantization::QuantizationParametersPrimitive;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorPrimitive};

use super::TensorParallel;
use super::redistribute::{Why, whole};
use super::tensor::{Repr, TpTensor};

/// `t` whole, for the inner backend's `op`.
pub(crate) fn full<I: Backend>(t: TpTensor<I>, op: &'static str) -> FloatTensor<I> {
    whole::<I>(t, Why::Fallback(op))
}

/// `t` as the inner backend's tensor in a group of one, where a split holds the whole tensor: no
/// communication, no fallback counted. (A constant or a pending sum made before the group became
/// one rank is made whole as usual.)
pub(crate) fn alone<I: Backend>(t: TpTensor<I>) -> FloatTensor<I> {
    match t.repr {
        Repr::Local { tensor, .. } => tensor,
        _ => whole::<I>(t, Why::Read),
    }
}

/// Whether `t` is a whole tensor of this rank's own: in a fully sharded data-parallel group (see
/// `fsdp`) the ranks' whole tensors may differ (activations of different batches), so an op that
/// reads one must not follow a rule that assumes the group agrees on it. A constant counts as
/// one too (its shape may be a batch's). Shards and pending sums are of tensors every rank
/// agrees on.
pub(crate) fn private<I: Backend>(t: &TpTensor<I>) -> bool {
    matches!(
        t.repr,
        Repr::Local {
            placement: super::Placement::Replicate,
            ..
        } | Repr::Fill { .. }
    )
}

/// Every tensor of `ts` whole, for the inner backend's `op`.
pub(crate) fn full_all<I: Backend>(ts: Vec<TpTensor<I>>, op: &'static str) -> Vec<FloatTensor<I>> {
    ts.into_iter().map(|t| full::<I>(t, op)).collect()
}

/// A result of the inner backend, the same on every rank.
pub(crate) fn replicated<I: Backend>(t: FloatTensor<I>) -> TpTensor<I> {
    TpTensor::replicated(t)
}

/// A (float, other) result with its float part replicated.
pub(crate) fn replicated_first<I: Backend, X>((t, x): (FloatTensor<I>, X)) -> (TpTensor<I>, X) {
    (TpTensor::replicated(t), x)
}

/// A (float, float) result, both replicated.
pub(crate) fn replicated_pair<I: Backend>(
    (a, b): (FloatTensor<I>, FloatTensor<I>),
) -> (TpTensor<I>, TpTensor<I>) {
    (TpTensor::replicated(a), TpTensor::replicated(b))
}

pub(crate) fn primitive_in<I: Backend>(
    t: TensorPrimitive<TensorParallel<I>>,
    op: &'static str,
) -> TensorPrimitive<I> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(full::<I>(t, op)),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub(crate) fn primitive_out<I: Backend>(
    t: TensorPrimitive<I>,
) -> TensorPrimitive<TensorParallel<I>> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(TpTensor::replicated(t)),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub(crate) fn qparams_in<I: Backend>(
    q: QuantizationParametersPrimitive<TensorParallel<I>>,
    op: &'static str,
) -> QuantizationParametersPrimitive<I> {
    QuantizationParametersPrimitive {
        scales: full::<I>(q.scales, op),
    }
}

pub(crate) fn transaction_in<I: Backend>(
    t: TransactionPrimitive<TensorParallel<I>>,
    op: &'static str,
) -> TransactionPrimitive<I> {
    // Each kind keeps its own order, which is all `tr_execute` reports.
    TransactionPrimitive::new(
        full_all::<I>(t.read_floats, op),
        t.read_qfloats,
        t.read_ints,
        t.read_bools,
    )
}

pub(crate) fn max_pool1d_indices_out<I: Backend>(
    r: MaxPool1dWithIndices<I>,
) -> MaxPool1dWithIndices<TensorParallel<I>> {
    MaxPool1dWithIndices::new(TpTensor::replicated(r.output), r.indices)
}

pub(crate) fn max_pool2d_indices_out<I: Backend>(
    r: MaxPool2dWithIndices<I>,
) -> MaxPool2dWithIndices<TensorParallel<I>> {
    MaxPool2dWithIndices::new(TpTensor::replicated(r.output), r.indices)
}

pub(crate) fn max_pool1d_backward_out<I: Backend>(
    r: MaxPool1dBackward<I>,
) -> MaxPool1dBackward<TensorParallel<I>> {
    MaxPool1dBackward::new(TpTensor::replicated(r.x_grad))
}

pub(crate) fn max_pool2d_backward_out<I: Backend>(
    r: MaxPool2dBackward<I>,
) -> MaxPool2dBackward<TensorParallel<I>> {
    MaxPool2dBackward::new(TpTensor::replicated(r.x_grad))
}

pub(crate) fn deform_conv2d_backward_out<I: Backend>(
    r: DeformConv2dBackward<I>,
) -> DeformConv2dBackward<TensorParallel<I>> {
    DeformConv2dBackward::new(
        TpTensor::replicated(r.x_grad),
        TpTensor::replicated(r.offset_grad),
        TpTensor::replicated(r.weight_grad),
        r.mask_grad.map(TpTensor::replicated),
        r.bias_grad.map(TpTensor::replicated),
    )
}
