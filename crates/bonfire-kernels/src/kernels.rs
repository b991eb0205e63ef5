//! The kernels. One unit per element of the bucket (pack, unpack) or of the output (reduce),
//! arithmetic in f32 whatever the storage type, one fixed order of operations so that every
//! rank computes the same bits.

use cubecl::prelude::*;

/// `bucket[offsets[j] + i] = O(scale * f32(inputs[j][i]))` for every input `j`.
#[cube(launch)]
pub(crate) fn pack_kernel<F: Float, O: Float>(
    inputs: &Sequence<Array<F>>,
    offsets: &Array<u32>,
    bucket: &mut Array<O>,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos < bucket.len() {
        let n = comptime!(inputs.len());
        #[unroll]
        for j in 0..n {
            let input = &inputs[j];
            let start = usize::cast_from(offsets[j]);
            let end = usize::cast_from(offsets[j + 1]);
            if pos >= start && pos < end {
                let x = f32::cast_from(input[pos - start]);
                bucket[pos] = O::cast_from(x * scale);
            }
        }
    }
}

/// [`pack_kernel`] with error feedback: `v = scale * f32(input) + residual`, the bucket gets
/// `O(v)` and the residual keeps what the cast lost, `v - f32(O(v))`.
#[cube(launch)]
pub(crate) fn pack_feedback_kernel<F: Float, O: Float>(
    inputs: &Sequence<Array<F>>,
    offsets: &Array<u32>,
    bucket: &mut Array<O>,
    residual: &mut Array<f32>,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos < bucket.len() {
        let n = comptime!(inputs.len());
        #[unroll]
        for j in 0..n {
            let input = &inputs[j];
            let start = usize::cast_from(offsets[j]);
            let end = usize::cast_from(offsets[j + 1]);
            if pos >= start && pos < end {
                let v = f32::cast_from(input[pos - start]) * scale + residual[pos];
                let q = O::cast_from(v);
                bucket[pos] = q;
                residual[pos] = v - f32::cast_from(q);
            }
        }
    }
}

/// `outputs[j][i] = O(scale * f32(bucket[offsets[j] + i]))` for every output `j`.
#[cube(launch)]
pub(crate) fn unpack_kernel<F: Float, O: Float>(
    bucket: &Array<F>,
    offsets: &Array<u32>,
    outputs: &mut Sequence<Array<O>>,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos < bucket.len() {
        let x = f32::cast_from(bucket[pos]) * scale;
        let n = comptime!(outputs.len());
        #[unroll]
        for j in 0..n {
            let output = outputs.index_mut(j);
            let start = usize::cast_from(offsets[j]);
            let end = usize::cast_from(offsets[j + 1]);
            if pos >= start && pos < end {
                output[pos - start] = O::cast_from(x);
            }
        }
    }
}

/// `out[i] = O(scale * (f32(inputs[0][i]) + f32(inputs[1][i]) + ...))`, summed in that order.
#[cube(launch)]
pub(crate) fn reduce_kernel<F: Float, O: Float>(
    inputs: &Sequence<Array<F>>,
    out: &mut Array<O>,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos < out.len() {
        let mut acc = 0.0f32;
        let n = comptime!(inputs.len());
        #[unroll]
        for j in 0..n {
            acc += f32::cast_from(inputs[j][pos]);
        }
        out[pos] = O::cast_from(acc * scale);
    }
}

/// In place: `acc[i] = A(scale * (f32(acc[i]) + f32(chunk[i])))`, the ring's reduce step.
#[cube(launch)]
pub(crate) fn accumulate_kernel<A: Float, F: Float>(
    acc: &mut Array<A>,
    chunk: &Array<F>,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos < acc.len() {
        let sum = f32::cast_from(acc[pos]) + f32::cast_from(chunk[pos]);
        acc[pos] = A::cast_from(sum * scale);
    }
}

/// In place, at an offset: `acc[offset + i] = A(scale * (f32(acc[offset + i]) + f32(chunk[i])))`.
#[cube(launch)]
pub(crate) fn accumulate_at_kernel<A: Float, F: Float>(
    acc: &mut Array<A>,
    chunk: &Array<F>,
    offset: u32,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos < chunk.len() {
        let at = usize::cast_from(offset) + pos;
        let sum = f32::cast_from(acc[at]) + f32::cast_from(chunk[pos]);
        acc[at] = A::cast_from(sum * scale);
    }
}

/// `dst[offset + i] = src[i]`.
#[cube(launch)]
pub(crate) fn copy_at_kernel<T: Float>(dst: &mut Array<T>, src: &Array<T>, offset: u32) {
    let pos = ABSOLUTE_POS;
    if pos < src.len() {
        dst[usize::cast_from(offset) + pos] = src[pos];
    }
}
