//! The kernels. Arithmetic in f32 whatever the storage type, one fixed order of operations so
//! that every rank computes the same bits, and vectors of `N` elements per unit (4 where every
//! length allows it).
//!
//! Pack and unpack cover many buffers in one launch with a *tile table*: every cube (workgroup)
//! works on one tile of one buffer, given by four u32 per cube: the buffer's index, the tile's
//! first vector in that buffer, its first vector in the bucket, and how many vectors it holds.
//! The choice of buffer is the same for every unit of a cube, so the branch that picks it never
//! diverges, and no unit reads a buffer it does not copy.

use cubecl::prelude::*;

/// Fields per tile in the tile table.
pub(crate) const TILE_FIELDS: usize = 4;

/// `bucket[tile.out + u] = O(scale * f32(inputs[tile.input][tile.start + u]))`.
#[cube(launch)]
pub(crate) fn pack_kernel<F: Float, O: Float, N: Size>(
    inputs: &Sequence<Array<Vector<F, N>>>,
    tiles: &Array<u32>,
    bucket: &mut Array<Vector<O, N>>,
    num_tiles: u32,
    scale: f32,
) {
    let tile = CUBE_POS;
    if tile < usize::cast_from(num_tiles) {
        let base = tile * 4;
        let which = tiles[base];
        let unit = usize::cast_from(UNIT_POS);
        if unit < usize::cast_from(tiles[base + 3]) {
            let src = usize::cast_from(tiles[base + 1]) + unit;
            let dst = usize::cast_from(tiles[base + 2]) + unit;
            let k = comptime!(inputs.len());
            #[unroll]
            for j in 0..k {
                if which == u32::cast_from(j) {
                    let x = Vector::<f32, N>::cast_from(inputs[j][src]);
                    bucket[dst] = Vector::<O, N>::cast_from(x * Vector::new(scale));
                }
            }
        }
    }
}

/// [`pack_kernel`] with error feedback: `v = scale * f32(input) + residual`, the bucket gets
/// `O(v)` and the residual keeps what the cast lost, `v - f32(O(v))`.
#[cube(launch)]
pub(crate) fn pack_feedback_kernel<F: Float, O: Float, N: Size>(
    inputs: &Sequence<Array<Vector<F, N>>>,
    tiles: &Array<u32>,
    bucket: &mut Array<Vector<O, N>>,
    residual: &mut Array<Vector<f32, N>>,
    num_tiles: u32,
    scale: f32,
) {
    let tile = CUBE_POS;
    if tile < usize::cast_from(num_tiles) {
        let base = tile * 4;
        let which = tiles[base];
        let unit = usize::cast_from(UNIT_POS);
        if unit < usize::cast_from(tiles[base + 3]) {
            let src = usize::cast_from(tiles[base + 1]) + unit;
            let dst = usize::cast_from(tiles[base + 2]) + unit;
            let k = comptime!(inputs.len());
            #[unroll]
            for j in 0..k {
                if which == u32::cast_from(j) {
                    let v = Vector::<f32, N>::cast_from(inputs[j][src]) * Vector::new(scale)
                        + residual[dst];
                    let q = Vector::<O, N>::cast_from(v);
                    bucket[dst] = q;
                    residual[dst] = v - Vector::<f32, N>::cast_from(q);
                }
            }
        }
    }
}

/// `outputs[tile.output][tile.start + u] = O(scale * f32(bucket[tile.out + u]))`.
#[cube(launch)]
pub(crate) fn unpack_kernel<F: Float, O: Float, N: Size>(
    bucket: &Array<Vector<F, N>>,
    tiles: &Array<u32>,
    outputs: &mut Sequence<Array<Vector<O, N>>>,
    num_tiles: u32,
    scale: f32,
) {
    let tile = CUBE_POS;
    if tile < usize::cast_from(num_tiles) {
        let base = tile * 4;
        let which = tiles[base];
        let unit = usize::cast_from(UNIT_POS);
        if unit < usize::cast_from(tiles[base + 3]) {
            let dst = usize::cast_from(tiles[base + 1]) + unit;
            let src = usize::cast_from(tiles[base + 2]) + unit;
            let x = Vector::<f32, N>::cast_from(bucket[src]) * Vector::new(scale);
            let k = comptime!(outputs.len());
            #[unroll]
            for j in 0..k {
                if which == u32::cast_from(j) {
                    let output = outputs.index_mut(j);
                    output[dst] = Vector::<O, N>::cast_from(x);
                }
            }
        }
    }
}

/// `out[i] = O(scale * (f32(inputs[0][i]) + f32(inputs[1][i]) + ...))`, summed in that order.
#[cube(launch)]
pub(crate) fn reduce_kernel<F: Float, O: Float, N: Size>(
    inputs: &Sequence<Array<Vector<F, N>>>,
    out: &mut Array<Vector<O, N>>,
    vectors: u32,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos < usize::cast_from(vectors) {
        let mut acc = Vector::<f32, N>::new(0.0);
        let k = comptime!(inputs.len());
        #[unroll]
        for j in 0..k {
            acc += Vector::<f32, N>::cast_from(inputs[j][pos]);
        }
        out[pos] = Vector::<O, N>::cast_from(acc * Vector::new(scale));
    }
}

/// In place, at an offset (in vectors):
/// `acc[offset + i] = A(scale * (f32(acc[offset + i]) + f32(chunk[i])))`, the ring's reduce step.
#[cube(launch)]
pub(crate) fn accumulate_kernel<A: Float, F: Float, N: Size>(
    acc: &mut Array<Vector<A, N>>,
    chunk: &Array<Vector<F, N>>,
    offset: u32,
    vectors: u32,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos < usize::cast_from(vectors) {
        let at = usize::cast_from(offset) + pos;
        let sum = Vector::<f32, N>::cast_from(acc[at]) + Vector::<f32, N>::cast_from(chunk[pos]);
        acc[at] = Vector::<A, N>::cast_from(sum * Vector::new(scale));
    }
}

/// `dst[offset + i] = src[i]` (offset in vectors).
#[cube(launch)]
pub(crate) fn copy_kernel<T: Float, N: Size>(
    dst: &mut Array<Vector<T, N>>,
    src: &Array<Vector<T, N>>,
    offset: u32,
    vectors: u32,
) {
    let pos = ABSOLUTE_POS;
    if pos < usize::cast_from(vectors) {
        dst[usize::cast_from(offset) + pos] = src[pos];
    }
}
