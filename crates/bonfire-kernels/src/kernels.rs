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

/// `bucket[tile.out + v] = O(scale * f32(inputs[tile.input][tile.start + v]))` for the tile's
/// vectors `v`: unit `u` of the cube moves vectors `u`, `u + units`, `u + 2 units`, ... (`per_unit`
/// of them, loaded together before any is stored, so that several loads are in flight per unit).
///
/// Launched unchecked: every index is bounded by the tile table, which the host builds from the
/// buffers' lengths ([`crate::tile_table`]).
#[cube(launch_unchecked)]
pub(crate) fn pack_kernel<F: Float, O: Float, N: Size>(
    inputs: &Sequence<Array<Vector<F, N>>>,
    tiles: &Array<u32>,
    bucket: &mut Array<Vector<O, N>>,
    num_tiles: u32,
    scale: f32,
    #[comptime] units: usize,
    #[comptime] per_unit: usize,
) {
    let tile = CUBE_POS;
    if tile < usize::cast_from(num_tiles) {
        let base = tile * 4;
        let which = tiles[base];
        let start = usize::cast_from(tiles[base + 1]);
        let out = usize::cast_from(tiles[base + 2]);
        let count = usize::cast_from(tiles[base + 3]);
        let unit = usize::cast_from(UNIT_POS);
        let k = comptime!(inputs.len());
        #[unroll]
        for j in 0..k {
            if which == u32::cast_from(j) {
                let mut regs = Array::<Vector<f32, N>>::new(per_unit);
                #[unroll]
                for i in 0..per_unit {
                    let v = unit + i * units;
                    if v < count {
                        regs[i] = Vector::<f32, N>::cast_from(inputs[j][start + v]);
                    }
                }
                #[unroll]
                for i in 0..per_unit {
                    let v = unit + i * units;
                    if v < count {
                        bucket[out + v] = Vector::<O, N>::cast_from(regs[i] * Vector::new(scale));
                    }
                }
            }
        }
    }
}

/// [`pack_kernel`] with error feedback: `v = scale * f32(input) + residual`, the bucket gets
/// `O(v)` and the residual keeps what the cast lost, `v - f32(O(v))`.
#[cube(launch_unchecked)]
pub(crate) fn pack_feedback_kernel<F: Float, O: Float, N: Size>(
    inputs: &Sequence<Array<Vector<F, N>>>,
    tiles: &Array<u32>,
    bucket: &mut Array<Vector<O, N>>,
    residual: &mut Array<Vector<f32, N>>,
    num_tiles: u32,
    scale: f32,
    #[comptime] units: usize,
    #[comptime] per_unit: usize,
) {
    let tile = CUBE_POS;
    if tile < usize::cast_from(num_tiles) {
        let base = tile * 4;
        let which = tiles[base];
        let start = usize::cast_from(tiles[base + 1]);
        let out = usize::cast_from(tiles[base + 2]);
        let count = usize::cast_from(tiles[base + 3]);
        let unit = usize::cast_from(UNIT_POS);
        let k = comptime!(inputs.len());
        #[unroll]
        for j in 0..k {
            if which == u32::cast_from(j) {
                #[unroll]
                for i in 0..per_unit {
                    let v = unit + i * units;
                    if v < count {
                        let dst = out + v;
                        let x = Vector::<f32, N>::cast_from(inputs[j][start + v])
                            * Vector::new(scale)
                            + residual[dst];
                        let q = Vector::<O, N>::cast_from(x);
                        bucket[dst] = q;
                        residual[dst] = x - Vector::<f32, N>::cast_from(q);
                    }
                }
            }
        }
    }
}

/// `outputs[tile.output][tile.start + v] = O(scale * f32(bucket[tile.out + v]))`, the tile's
/// vectors shared among the cube's units as in [`pack_kernel`].
#[cube(launch_unchecked)]
pub(crate) fn unpack_kernel<F: Float, O: Float, N: Size>(
    bucket: &Array<Vector<F, N>>,
    tiles: &Array<u32>,
    outputs: &mut Sequence<Array<Vector<O, N>>>,
    num_tiles: u32,
    scale: f32,
    #[comptime] units: usize,
    #[comptime] per_unit: usize,
) {
    let tile = CUBE_POS;
    if tile < usize::cast_from(num_tiles) {
        let base = tile * 4;
        let which = tiles[base];
        let start = usize::cast_from(tiles[base + 1]);
        let out = usize::cast_from(tiles[base + 2]);
        let count = usize::cast_from(tiles[base + 3]);
        let unit = usize::cast_from(UNIT_POS);
        let mut regs = Array::<Vector<f32, N>>::new(per_unit);
        #[unroll]
        for i in 0..per_unit {
            let v = unit + i * units;
            if v < count {
                regs[i] = Vector::<f32, N>::cast_from(bucket[out + v]) * Vector::new(scale);
            }
        }
        let k = comptime!(outputs.len());
        #[unroll]
        for j in 0..k {
            if which == u32::cast_from(j) {
                let output = outputs.index_mut(j);
                #[unroll]
                for i in 0..per_unit {
                    let v = unit + i * units;
                    if v < count {
                        output[start + v] = Vector::<O, N>::cast_from(regs[i]);
                    }
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
pub(crate) fn add_into_kernel<A: Float, F: Float, N: Size>(
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

/// `dst[dst_offset + i] = src[src_offset + i]` (offsets in vectors).
#[cube(launch)]
pub(crate) fn copy_kernel<T: Float, N: Size>(
    dst: &mut Array<Vector<T, N>>,
    src: &Array<Vector<T, N>>,
    dst_offset: u32,
    src_offset: u32,
    vectors: u32,
) {
    let pos = ABSOLUTE_POS;
    if pos < usize::cast_from(vectors) {
        dst[usize::cast_from(dst_offset) + pos] = src[usize::cast_from(src_offset) + pos];
    }
}
