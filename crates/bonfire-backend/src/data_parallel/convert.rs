//! Conversions between `DataParallel<B>`'s and `B`'s forms of the few op-trait types that are
//! generic over the backend itself (rather than over its primitives). The primitives are the same
//! types, so each conversion only moves fields.

use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitive,
};
use burn_backend::quantization::QuantizationParametersPrimitive;
use burn_backend::{Backend, TensorPrimitive};

use super::DataParallel;

pub(crate) fn primitive_in<B: Backend>(t: TensorPrimitive<DataParallel<B>>) -> TensorPrimitive<B> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub(crate) fn primitive_out<B: Backend>(t: TensorPrimitive<B>) -> TensorPrimitive<DataParallel<B>> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub(crate) fn qparams_in<B: Backend>(
    q: QuantizationParametersPrimitive<DataParallel<B>>,
) -> QuantizationParametersPrimitive<B> {
    QuantizationParametersPrimitive { scales: q.scales }
}

pub(crate) fn transaction_in<B: Backend>(
    t: TransactionPrimitive<DataParallel<B>>,
) -> TransactionPrimitive<B> {
    // Each kind keeps its own order, which is all `tr_execute` reports.
    TransactionPrimitive::new(t.read_floats, t.read_qfloats, t.read_ints, t.read_bools)
}

pub(crate) fn max_pool1d_indices_out<B: Backend>(
    r: MaxPool1dWithIndices<B>,
) -> MaxPool1dWithIndices<DataParallel<B>> {
    MaxPool1dWithIndices::new(r.output, r.indices)
}

pub(crate) fn max_pool2d_indices_out<B: Backend>(
    r: MaxPool2dWithIndices<B>,
) -> MaxPool2dWithIndices<DataParallel<B>> {
    MaxPool2dWithIndices::new(r.output, r.indices)
}

pub(crate) fn max_pool1d_backward_out<B: Backend>(
    r: MaxPool1dBackward<B>,
) -> MaxPool1dBackward<DataParallel<B>> {
    MaxPool1dBackward::new(r.x_grad)
}

pub(crate) fn max_pool2d_backward_out<B: Backend>(
    r: MaxPool2dBackward<B>,
) -> MaxPool2dBackward<DataParallel<B>> {
    MaxPool2dBackward::new(r.x_grad)
}

pub(crate) fn deform_conv2d_backward_out<B: Backend>(
    r: DeformConv2dBackward<B>,
) -> DeformConv2dBackward<DataParallel<B>> {
    DeformConv2dBackward::new(
        r.x_grad,
        r.offset_grad,
        r.weight_grad,
        r.mask_grad,
        r.bias_grad,
    )
}
