//! Where a tensor's elements live across the ranks of a tensor-parallel group.

use std::fmt;
use std::ops::Range;

use burn_backend::Shape;

/// How a float tensor of `TensorParallel<B>` is laid out over the `n` ranks of its group.
///
/// ```text
///   global [4, 6]        Replicate           Shard(1), n = 2                Partial
///  a b c d e f         every rank:      rank 0: a b c   rank 1: d e f   rank 0: x   rank 1: y
///  g h i j k l         a b c d e f              g h i           j k l   global = x + y
///  ...                 ...                      ...             ...     (same shape)
/// ```
///
/// - `Replicate`: every rank holds the whole tensor.
/// - `Shard { dim, blocks }`: dimension `dim` (of global size `s`, a multiple of `n * blocks`) is
///   cut into `blocks` equal blocks, and each block into `n` equal chunks; rank `r` holds chunk `r`
///   of every block, in block order. With `blocks = 1` (written `Shard(dim)`) rank `r` holds the
///   `r`-th of `n` contiguous slices, as Megatron's column and row splits do; `blocks = 3` is a
///   fused query/key/value projection whose three parts are each split over the ranks.
/// - `Partial`: every rank holds a tensor of the global shape, and the tensor's value is their
///   sum (a pending all-reduce, as a row-parallel matmul leaves it).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Placement {
    /// Every rank holds the whole tensor.
    Replicate,
    /// Each rank holds a slice of one dimension.
    Shard {
        /// The split dimension.
        dim: usize,
        /// Equal blocks of that dimension, each split over the ranks (1: one contiguous split).
        blocks: usize,
    },
    /// The tensor is the sum over the ranks of what each holds.
    Partial,
}

impl Placement {
    /// `Shard { dim, blocks: 1 }`.
    pub const fn shard(dim: usize) -> Placement {
        Placement::Shard { dim, blocks: 1 }
    }

    /// The split dimension, if sharded.
    pub fn shard_dim(&self) -> Option<usize> {
        match *self {
            Placement::Shard { dim, .. } => Some(dim),
            _ => None,
        }
    }

    /// True for `Replicate`.
    pub fn is_replicate(&self) -> bool {
        matches!(self, Placement::Replicate)
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Placement::Replicate => write!(f, "Replicate"),
            Placement::Shard { dim, blocks: 1 } => write!(f, "Shard({dim})"),
            Placement::Shard { dim, blocks } => write!(f, "Shard({dim}, {blocks} blocks)"),
            Placement::Partial => write!(f, "Partial"),
        }
    }
}

/// Whether `shape` can be split on `dim` into `blocks` blocks of `n` equal chunks.
pub(crate) fn divisible(shape: &Shape, dim: usize, blocks: usize, n: usize) -> bool {
    dim < shape.num_dims() && blocks > 0 && shape[dim].is_multiple_of(blocks * n) && shape[dim] > 0
}

/// The local shape rank `r`'s part of a tensor of global `shape` has under `placement` (over `n`
/// ranks).
pub(crate) fn local_shape(shape: &Shape, placement: Placement, n: usize) -> Shape {
    match placement {
        Placement::Shard { dim, .. } => {
            let mut dims = shape.to_vec();
            dims[dim] /= n;
            Shape::from(dims)
        }
        _ => shape.clone(),
    }
}

/// The global index ranges along the split dimension that rank `r` holds, in local order: one
/// range per block.
pub(crate) fn owned_ranges(size: usize, blocks: usize, n: usize, r: usize) -> Vec<Range<usize>> {
    let block = size / blocks;
    let chunk = block / n;
    (0..blocks)
        .map(|b| b * block + r * chunk..b * block + (r + 1) * chunk)
        .collect()
}

/// Which global dimension a reshape from `from` to `to` moves a split of `from`'s dimension `dim`
/// (`blocks` blocks over `n` ranks) to, with its new block count; `None` when no rank's part
/// stays a `Shard` of the new shape (the reshape cuts the split dimension finer than the chunks,
/// or merges it with the dimensions before it other than whole).
///
/// Merging whole leading dimensions into the split one keeps it local: `[b, h, s, d]` split on
/// the heads `h` and reshaped to `[b*h, s, d]` is a split of the first dimension in `b` blocks
/// (each rank holds its heads of every batch row), which is what Burn's `RotaryEncoding` does to
/// a split attention; the reshape back finds the heads again.
pub(crate) fn reshape_shard(
    from: &Shape,
    to: &Shape,
    dim: usize,
    blocks: usize,
    n: usize,
) -> Option<(usize, usize)> {
    let prefix: usize = from.as_slice()[..dim].iter().product();
    // `to`'s dimensions that lie wholly before the split one (unit dimensions at its start too).
    let mut acc = 1usize;
    let mut j = 0;
    while j < to.num_dims() && acc * to[j] <= prefix {
        acc *= to[j];
        j += 1;
    }
    if j == to.num_dims() || prefix == 0 {
        return None;
    }
    // `to[j]` starts at a boundary of `from`'s dimensions (at `k`) and takes in `from[k..dim]`
    // whole, each of their indices a block of its own.
    let k = (0..=dim).find(|&k| from.as_slice()[..k].iter().product::<usize>() == acc)?;
    let mut merged: usize = from.as_slice()[k..dim].iter().product();
    let mut blocks = blocks;
    loop {
        let size = to[j];
        if !size.is_multiple_of(merged) {
            return None;
        }
        let own = size / merged;
        if own.is_multiple_of(blocks * n) {
            return Some((j, blocks * merged));
        }
        // The dimension holds whole blocks: the split continues in the next dimension.
        if own > 1 && blocks.is_multiple_of(own) && j + 1 < to.num_dims() {
            blocks /= own;
            merged = 1;
            j += 1;
            continue;
        }
        return None;
    }
}

/// The broadcast shape of two shapes of equal rank (Burn's rule: sizes equal, or one of them 1).
pub(crate) fn broadcast(a: &Shape, b: &Shape) -> Shape {
    Shape::from(
        a.iter()
            .zip(b.iter())
            .map(|(&x, &y)| if x == 1 { y } else { x })
            .collect::<Vec<_>>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(d: &[usize]) -> Shape {
        Shape::from(d.to_vec())
    }

    #[test]
    fn ranges_cover_each_block_once() {
        assert_eq!(owned_ranges(8, 1, 2, 1), vec![4..8]);
        assert_eq!(owned_ranges(12, 3, 2, 0), vec![0..2, 4..6, 8..10]);
        let mut all: Vec<usize> = (0..4)
            .flat_map(|r| owned_ranges(24, 3, 4, r))
            .flatten()
            .collect();
        all.sort();
        assert_eq!(all, (0..24).collect::<Vec<_>>());
    }

    #[test]
    fn reshapes_that_keep_a_shard() {
        // Heads split out of the model dimension, and merged back.
        assert_eq!(
            reshape_shard(&s(&[2, 5, 8]), &s(&[2, 5, 4, 2]), 2, 1, 2),
            Some((2, 1))
        );
        assert_eq!(
            reshape_shard(&s(&[2, 5, 4, 2]), &s(&[2, 5, 8]), 2, 1, 2),
            Some((2, 1))
        );
        // A leading unit dimension is skipped.
        assert_eq!(
            reshape_shard(&s(&[6, 8]), &s(&[1, 6, 8]), 1, 1, 2),
            Some((2, 1))
        );
        // A fused q/k/v split into its three parts: the split moves to the heads.
        assert_eq!(
            reshape_shard(&s(&[2, 5, 24]), &s(&[2, 5, 3, 4, 2]), 2, 3, 2),
            Some((3, 1))
        );
        // Heads not divisible by the ranks, or the split merged with the dimension before.
        assert_eq!(
            reshape_shard(&s(&[2, 5, 8]), &s(&[2, 5, 2, 4]), 2, 1, 4),
            None
        );
        // The split merged with whole dimensions before it (a rotary encoding's
        // `[b, h, s, d] -> [b*h, s, d/2, 2]`): each batch row is a block; and back.
        assert_eq!(
            reshape_shard(&s(&[3, 4, 5, 6]), &s(&[12, 5, 3, 2]), 1, 1, 2),
            Some((0, 3))
        );
        assert_eq!(
            reshape_shard(&s(&[12, 5, 6]), &s(&[3, 4, 5, 6]), 0, 3, 2),
            Some((1, 1))
        );
        assert_eq!(
            reshape_shard(&s(&[2, 4, 6]), &s(&[8, 6]), 1, 1, 2),
            Some((0, 2))
        );
        // Merged and cut so that a rank's chunk straddles the new dimensions: no shard.
        assert_eq!(reshape_shard(&s(&[2, 6, 4]), &s(&[4, 3, 4]), 1, 1, 3), None);
        assert_eq!(
            reshape_shard(&s(&[2, 6, 4]), &s(&[4, 3, 4]), 1, 1, 2),
            Some((0, 2))
        );
        // A flattened batch keeps a split of the last dimension.
        assert_eq!(
            reshape_shard(&s(&[2, 5, 8]), &s(&[10, 8]), 2, 1, 2),
            Some((1, 1))
        );
    }
}
