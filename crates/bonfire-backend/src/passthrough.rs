//! Conversions for decorators that keep their inner backend's primitives (`DataParallel<B>`, and
//! the op-counting decorator of bonfire-testkit): the few op-trait types that are generic over the
//! backend itself, rather than over its primitives, change only their type parameter, so each
//! conversion only moves fields. `D` is the decorator, `B` the backend it wraps.
//!
//! Public for the generated pass-through code of other crates; not part of bonfire's API.

use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitive,
};
use burn_backend::quantization::QuantizationParametersPrimitive;
use burn_backend::{Backend, TensorPrimitive};

/// Burn's backend traits, for [`same_primitives_backend!`](crate::same_primitives_backend)'s
/// expansion in other crates.
pub use burn_backend;

/// A backend whose primitives are exactly `B`'s.
pub trait SamePrimitives<B: Backend>:
    Backend<
        FloatTensorPrimitive = B::FloatTensorPrimitive,
        IntTensorPrimitive = B::IntTensorPrimitive,
        BoolTensorPrimitive = B::BoolTensorPrimitive,
        QuantizedTensorPrimitive = B::QuantizedTensorPrimitive,
    >
{
}

impl<D, B> SamePrimitives<B> for D
where
    B: Backend,
    D: Backend<
            FloatTensorPrimitive = B::FloatTensorPrimitive,
            IntTensorPrimitive = B::IntTensorPrimitive,
            BoolTensorPrimitive = B::BoolTensorPrimitive,
            QuantizedTensorPrimitive = B::QuantizedTensorPrimitive,
        >,
{
}

/// A decorator's float-or-quantized argument, as the inner backend's.
pub fn primitive_in<D: SamePrimitives<B>, B: Backend>(t: TensorPrimitive<D>) -> TensorPrimitive<B> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

/// The inner backend's float-or-quantized result, as the decorator's.
pub fn primitive_out<D: SamePrimitives<B>, B: Backend>(
    t: TensorPrimitive<B>,
) -> TensorPrimitive<D> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

/// Quantization parameters, as the inner backend's.
pub fn qparams_in<D: SamePrimitives<B>, B: Backend>(
    q: QuantizationParametersPrimitive<D>,
) -> QuantizationParametersPrimitive<B> {
    QuantizationParametersPrimitive { scales: q.scales }
}

/// A transaction, as the inner backend's.
pub fn transaction_in<D: SamePrimitives<B>, B: Backend>(
    t: TransactionPrimitive<D>,
) -> TransactionPrimitive<B> {
    // Each kind keeps its own order, which is all `tr_execute` reports.
    TransactionPrimitive::new(t.read_floats, t.read_qfloats, t.read_ints, t.read_bools)
}

/// A 1-d max pool's output and indices, as the decorator's.
pub fn max_pool1d_indices_out<D: SamePrimitives<B>, B: Backend>(
    r: MaxPool1dWithIndices<B>,
) -> MaxPool1dWithIndices<D> {
    MaxPool1dWithIndices::new(r.output, r.indices)
}

/// A 2-d max pool's output and indices, as the decorator's.
pub fn max_pool2d_indices_out<D: SamePrimitives<B>, B: Backend>(
    r: MaxPool2dWithIndices<B>,
) -> MaxPool2dWithIndices<D> {
    MaxPool2dWithIndices::new(r.output, r.indices)
}

/// A 1-d max pool's input gradient, as the decorator's.
pub fn max_pool1d_backward_out<D: SamePrimitives<B>, B: Backend>(
    r: MaxPool1dBackward<B>,
) -> MaxPool1dBackward<D> {
    MaxPool1dBackward::new(r.x_grad)
}

/// A 2-d max pool's input gradient, as the decorator's.
pub fn max_pool2d_backward_out<D: SamePrimitives<B>, B: Backend>(
    r: MaxPool2dBackward<B>,
) -> MaxPool2dBackward<D> {
    MaxPool2dBackward::new(r.x_grad)
}

/// A deformable convolution's gradients, as the decorator's.
pub fn deform_conv2d_backward_out<D: SamePrimitives<B>, B: Backend>(
    r: DeformConv2dBackward<B>,
) -> DeformConv2dBackward<D> {
    DeformConv2dBackward::new(
        r.x_grad,
        r.offset_grad,
        r.weight_grad,
        r.mask_grad,
        r.bias_grad,
    )
}

/// Writes `BackendTypes` and `Backend` for a decorator `$ty<B>` that keeps `B`'s primitives and
/// devices and forwards every backend-level method to `B`; `name()` reads `"$name<inner>"`.
/// (Its op traits are the generated files; see `gen/passthrough.py`.)
#[doc(hidden)]
#[macro_export]
macro_rules! same_primitives_backend {
    ($ty:ident, $name:literal) => {
        impl<B: $crate::passthrough::burn_backend::Backend>
            $crate::passthrough::burn_backend::BackendTypes for $ty<B>
        {
            type Device = B::Device;
            type FloatTensorPrimitive = B::FloatTensorPrimitive;
            type FloatElem = B::FloatElem;
            type IntTensorPrimitive = B::IntTensorPrimitive;
            type IntElem = B::IntElem;
            type BoolTensorPrimitive = B::BoolTensorPrimitive;
            type BoolElem = B::BoolElem;
            type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
        }

        impl<B: $crate::passthrough::burn_backend::Backend>
            $crate::passthrough::burn_backend::Backend for $ty<B>
        {
            fn ad_enabled(device: &Self::Device) -> bool {
                B::ad_enabled(device)
            }

            fn memory_persistent_allocations<
                Output: Send,
                Input: Send,
                Func: Fn(Input) -> Output + Send,
            >(
                device: &Self::Device,
                input: Input,
                func: Func,
            ) -> Output {
                B::memory_persistent_allocations(device, input, func)
            }

            fn memory_cleanup(device: &Self::Device) {
                B::memory_cleanup(device)
            }

            fn name(device: &Self::Device) -> String {
                format!(concat!($name, "<{}>"), B::name(device))
            }

            fn seed(device: &Self::Device, seed: u64) {
                B::seed(device, seed)
            }

            fn sync(
                device: &Self::Device,
            ) -> Result<(), $crate::passthrough::burn_backend::ExecutionError> {
                B::sync(device)
            }

            fn staging<'a, Iter>(data: Iter, device: &Self::Device)
            where
                Iter: Iterator<Item = &'a mut $crate::passthrough::burn_backend::TensorData>,
            {
                B::staging(data, device)
            }

            fn supports_dtype(
                device: &Self::Device,
                dtype: $crate::passthrough::burn_backend::DType,
            ) -> bool {
                B::supports_dtype(device, dtype)
            }

            fn dtype_usage(
                device: &Self::Device,
                dtype: $crate::passthrough::burn_backend::DType,
            ) -> $crate::passthrough::burn_backend::DTypeUsageSet {
                B::dtype_usage(device, dtype)
            }

            fn device_count(type_id: u16) -> usize {
                B::device_count(type_id)
            }
        }
    };
}
