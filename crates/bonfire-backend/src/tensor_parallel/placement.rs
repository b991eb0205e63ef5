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
/// (`blocks` blocks over `n` ranks) to, with its new block count; `None` when the reshape mixes the
/// split dimension with the dimensions before it, or splits it finer than the chunks, so that no
/// rank's part stays a `Shard` of the new shape.
pub(crate) fn reshape_shard(
    from: &Shape,
    to: &Shape,
    dim: usize,
    blocks: usize,
    n: usize,
) -> Option<(usize, usize)> {
    let prefix: usize = from.as_slice()[..dim].iter().product();
    // The first dimension of `to` at the same boundary whose size is not 1.
    let mut acc = 1usize;
    let mut j = 0;
    while j < to.num_dims() && (acc < prefix || (acc == prefix && to[j] == 1)) {
        acc *= to[j];
        j += 1;
    }
    if acc != prefix || j == to.num_dims() {
        return None;
    }
    let mut blocks = blocks;
    loop {
        let size = to[j];
        if size.is_multiple_of(blocks * n) {
            return Some((j, blocks));
        }
        // The dimension holds whole blocks: the split continues in the next dimension.
        if size > 1 && blocks.is_multiple_of(size) && j + 1 < to.num_dims() {
            blocks /= size;
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
        assert_eq!(reshape_shard(&s(&[2, 4, 6]), &s(&[8, 6]), 1, 1, 2), None);
        // A flattened batch keeps a split of the last dimension.
        assert_eq!(
            reshape_shard(&s(&[2, 5, 8]), &s(&[10, 8]), 2, 1, 2),
            Some((1, 1))
        );
    }
}
