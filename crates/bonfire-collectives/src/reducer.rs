//! Elementwise reduction of byte buffers, behind the small [`Reducer`] trait so that a device
//! implementation (a CubeCL kernel) can stand in for the host one.

use bonfire_topology::{DType, ReduceOp};
use bytemuck::Pod;
use half::{bf16, f16};

/// Which operand comes first when a rank combines a received buffer with its own.
///
/// Schedules fix the order of every combination, so that results do not depend on which frame
/// arrived first, and so that ranks that compute the same value compute it with the same operand
/// order (bitwise equal even for non-commutative corner cases such as `max(+0, -0)`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// `acc = incoming ∘ acc`: the received value is the left operand.
    IncomingFirst,
    /// `acc = acc ∘ incoming`: the local value is the left operand.
    LocalFirst,
}

/// Combines buffers of elements of a [`DType`], held as native-endian bytes.
///
/// Contract: `combine` and `divide` are pure functions of their inputs (no dependence on timing,
/// threads or earlier calls): determinism of every collective rests on it. `combine` works
/// element by element: over shared memory a large received frame is combined in 64 KiB pieces,
/// as it comes off the lane, on whichever thread takes it off (the lane's reader thread, or a
/// thread waiting for a collective; see `bonfire_transport::Sink`), so it must not block; a
/// panic there fails the collective with a bad frame.
pub trait Reducer: Send + Sync + 'static {
    /// `acc[i] = acc[i] ∘ incoming[i]` (or the reverse order) for every element; [`ReduceOp::Mean`]
    /// combines as a sum. Both slices hold the same number of whole elements.
    fn combine(&self, dtype: DType, op: ReduceOp, order: Order, acc: &mut [u8], incoming: &[u8]);

    /// `acc[i] = acc[i] / n`: the final step of [`ReduceOp::Mean`].
    fn divide(&self, dtype: DType, acc: &mut [u8], n: usize);
}

/// The reducer on the CPU. Buffers need not be aligned.
#[derive(Copy, Clone, Debug, Default)]
pub struct HostReducer;

fn zip_apply<T: Pod>(acc: &mut [u8], incoming: &[u8], f: impl Fn(T, T) -> T) {
    assert_eq!(acc.len(), incoming.len(), "reduce of unequal buffers");
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(acc),
        bytemuck::try_cast_slice::<u8, T>(incoming),
    ) {
        (Ok(a), Ok(b)) => {
            for (x, y) in a.iter_mut().zip(b) {
                *x = f(*x, *y);
            }
        }
        _ => {
            let size = std::mem::size_of::<T>();
            for (x, y) in acc.chunks_exact_mut(size).zip(incoming.chunks_exact(size)) {
                let v = f(
                    bytemuck::pod_read_unaligned(x),
                    bytemuck::pod_read_unaligned(y),
                );
                x.copy_from_slice(bytemuck::bytes_of(&v));
            }
        }
    }
}

fn map_in_place<T: Pod>(acc: &mut [u8], f: impl Fn(T) -> T) {
    match bytemuck::try_cast_slice_mut::<u8, T>(acc) {
        Ok(a) => a.iter_mut().for_each(|x| *x = f(*x)),
        Err(_) => {
            for x in acc.chunks_exact_mut(std::mem::size_of::<T>()) {
                let v = f(bytemuck::pod_read_unaligned(x));
                x.copy_from_slice(bytemuck::bytes_of(&v));
            }
        }
    }
}

/// `f(local, incoming)` applied in the requested operand order.
fn ordered<T: Pod>(acc: &mut [u8], incoming: &[u8], order: Order, f: impl Fn(T, T) -> T) {
    match order {
        Order::LocalFirst => zip_apply(acc, incoming, f),
        Order::IncomingFirst => zip_apply(acc, incoming, |local, inc| f(inc, local)),
    }
}

/// The larger operand, NaN if either is NaN, the left one on ties (`+0` and `-0` tie).
fn fmax<T: PartialOrd + Copy>(a: T, b: T, nan: impl Fn(T) -> bool) -> T {
    if nan(a) || (!nan(b) && a >= b) { a } else { b }
}

/// The smaller operand, NaN if either is NaN, the left one on ties.
fn fmin<T: PartialOrd + Copy>(a: T, b: T, nan: impl Fn(T) -> bool) -> T {
    if nan(a) || (!nan(b) && a <= b) { a } else { b }
}

macro_rules! float_combine {
    ($t:ty, $acc:ident, $inc:ident, $op:ident, $order:ident) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Mean => ordered::<$t>($acc, $inc, $order, |a, b| a + b),
            ReduceOp::Product => ordered::<$t>($acc, $inc, $order, |a, b| a * b),
            ReduceOp::Max => {
                ordered::<$t>($acc, $inc, $order, |a, b| fmax(a, b, |x: $t| x.is_nan()))
            }
            ReduceOp::Min => {
                ordered::<$t>($acc, $inc, $order, |a, b| fmin(a, b, |x: $t| x.is_nan()))
            }
        }
    };
}

macro_rules! half_combine {
    ($t:ty, $acc:ident, $inc:ident, $op:ident, $order:ident) => {
        // Each combination is computed in f32 and rounded once: f32 holds the exact sum or
        // product of two halves, so this is the correctly rounded half-precision result.
        match $op {
            ReduceOp::Sum | ReduceOp::Mean => ordered::<$t>($acc, $inc, $order, |a, b| {
                <$t>::from_f32(a.to_f32() + b.to_f32())
            }),
            ReduceOp::Product => ordered::<$t>($acc, $inc, $order, |a, b| {
                <$t>::from_f32(a.to_f32() * b.to_f32())
            }),
            ReduceOp::Max => {
                ordered::<$t>($acc, $inc, $order, |a, b| fmax(a, b, |x: $t| x.is_nan()))
            }
            ReduceOp::Min => {
                ordered::<$t>($acc, $inc, $order, |a, b| fmin(a, b, |x: $t| x.is_nan()))
            }
        }
    };
}

macro_rules! int_combine {
    ($t:ty, $acc:ident, $inc:ident, $op:ident, $order:ident) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Mean => ordered::<$t>($acc, $inc, $order, <$t>::wrapping_add),
            ReduceOp::Product => ordered::<$t>($acc, $inc, $order, <$t>::wrapping_mul),
            ReduceOp::Max => ordered::<$t>($acc, $inc, $order, |a, b| a.max(b)),
            ReduceOp::Min => ordered::<$t>($acc, $inc, $order, |a, b| a.min(b)),
        }
    };
}

impl Reducer for HostReducer {
    fn combine(&self, dtype: DType, op: ReduceOp, order: Order, acc: &mut [u8], inc: &[u8]) {
        match dtype {
            DType::F32 => float_combine!(f32, acc, inc, op, order),
            DType::F64 => float_combine!(f64, acc, inc, op, order),
            DType::F16 => half_combine!(f16, acc, inc, op, order),
            DType::BF16 => half_combine!(bf16, acc, inc, op, order),
            DType::I32 => int_combine!(i32, acc, inc, op, order),
            DType::I64 => int_combine!(i64, acc, inc, op, order),
            DType::U8 => int_combine!(u8, acc, inc, op, order),
        }
    }

    fn divide(&self, dtype: DType, acc: &mut [u8], n: usize) {
        match dtype {
            DType::F32 => map_in_place::<f32>(acc, |x| x / n as f32),
            DType::F64 => map_in_place::<f64>(acc, |x| x / n as f64),
            DType::F16 => map_in_place::<f16>(acc, |x| f16::from_f32(x.to_f32() / n as f32)),
            DType::BF16 => map_in_place::<bf16>(acc, |x| bf16::from_f32(x.to_f32() / n as f32)),
            DType::I32 => map_in_place::<i32>(acc, |x| x / n as i32),
            DType::I64 => map_in_place::<i64>(acc, |x| x / n as i64),
            DType::U8 => map_in_place::<u8>(acc, |x| x / n as u8),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn combines_in_the_requested_order() {
        let r = HostReducer;
        let mut acc = bytes(&[1.0f32, 5.0, f32::NAN]);
        r.combine(
            DType::F32,
            ReduceOp::Max,
            Order::LocalFirst,
            &mut acc,
            &bytes(&[2.0f32, 3.0, 1.0]),
        );
        let out: &[f32] = bytemuck::cast_slice(&acc);
        assert_eq!(out[..2], [2.0, 5.0]);
        assert!(out[2].is_nan(), "max propagates NaN");

        // max(+0, -0) keeps the left operand, so order matters bitwise.
        let mut acc = bytes(&[0.0f32]);
        r.combine(
            DType::F32,
            ReduceOp::Max,
            Order::IncomingFirst,
            &mut acc,
            &bytes(&[-0.0f32]),
        );
        assert!(bytemuck::cast_slice::<u8, f32>(&acc)[0].is_sign_negative());

        let mut acc = bytes(&[250u8, 3]);
        r.combine(
            DType::U8,
            ReduceOp::Sum,
            Order::LocalFirst,
            &mut acc,
            &bytes(&[10u8, 4]),
        );
        assert_eq!(acc, vec![4, 7], "integer sums wrap");
        r.divide(DType::U8, &mut acc, 2);
        assert_eq!(acc, vec![2, 3]);
    }

    #[test]
    fn unaligned_buffers_give_the_same_result() {
        let r = HostReducer;
        let a: Vec<f64> = (0..17).map(|i| i as f64 * 0.37).collect();
        let b: Vec<f64> = (0..17).map(|i| 1.0 / (i as f64 + 1.0)).collect();
        let mut aligned = bytes(&a);
        r.combine(
            DType::F64,
            ReduceOp::Sum,
            Order::IncomingFirst,
            &mut aligned,
            &bytes(&b),
        );
        let mut store = vec![0u8; aligned.len() + 1];
        store[1..].copy_from_slice(&bytes(&a));
        let mut inc = vec![0u8; aligned.len() + 3];
        inc[3..].copy_from_slice(&bytes(&b));
        r.combine(
            DType::F64,
            ReduceOp::Sum,
            Order::IncomingFirst,
            &mut store[1..],
            &inc[3..],
        );
        assert_eq!(&store[1..], &aligned[..]);
    }

    #[test]
    fn half_types_round_once() {
        let r = HostReducer;
        let mut acc = bytes(&[bf16::from_f32(1.0), bf16::from_f32(3.0)]);
        r.combine(
            DType::BF16,
            ReduceOp::Sum,
            Order::LocalFirst,
            &mut acc,
            &bytes(&[bf16::from_f32(2.0), bf16::from_f32(4.0)]),
        );
        r.divide(DType::BF16, &mut acc, 2);
        let out: &[bf16] = bytemuck::cast_slice(&acc);
        assert_eq!(out, &[bf16::from_f32(1.5), bf16::from_f32(3.5)]);
    }
}
