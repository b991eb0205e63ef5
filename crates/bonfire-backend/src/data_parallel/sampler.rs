//! Which samples each rank trains on.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Gives each rank a disjoint shard of a data set, reshuffled every epoch from a seed all ranks
/// share, as PyTorch's `DistributedSampler`.
///
/// - Every rank gets the same number of samples, `ceil(len / world)`: when `len` is not a
///   multiple of the world size, the first few samples of the epoch's order are used twice.
///   Equal shards keep ranks in step (every rank runs the same number of steps), which
///   `DataParallel` requires.
/// - Shards are strided over the epoch's order (rank r takes positions r, r + world, ...), so
///   they are disjoint apart from that padding and together cover the data set.
/// - The order depends only on `(seed, epoch)`: the same on every rank and in every run.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    rank: usize,
    seed: u64,
    shuffle: bool,
}

impl DistributedSampler {
    /// A shuffling sampler over `len` samples for `rank` of `world`.
    pub fn new(len: usize, world: usize, rank: usize, seed: u64) -> Self {
        assert!(
            world > 0 && rank < world,
            "rank {rank} is not in a world of {world}"
        );
        DistributedSampler {
            len,
            world,
            rank,
            seed,
            shuffle: true,
        }
    }

    /// Keeps the data set's order (for validation).
    pub fn without_shuffle(mut self) -> Self {
        self.shuffle = false;
        self
    }

    /// Samples per rank per epoch.
    pub fn num_samples(&self) -> usize {
        self.len.div_ceil(self.world)
    }

    /// This rank's sample indices for `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        if self.len == 0 {
            return Vec::new();
        }
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng =
                ChaCha8Rng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            order.shuffle(&mut rng);
        }
        // Padded, interleaved equal shards: bonfire's one rule for data shards.
        bonfire_topology::Sharding::EqualPad
            .shard(self.rank, self.world, self.len)
            .expect("checked in new")
            .pick(&order)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_equal_disjoint_and_cover_the_data() {
        for (len, world) in [(10, 3), (9, 3), (1, 4), (0, 2), (1000, 7)] {
            let shards: Vec<Vec<usize>> = (0..world)
                .map(|r| DistributedSampler::new(len, world, r, 42).indices(3))
                .collect();
            let per = len.div_ceil(world);
            assert!(
                shards
                    .iter()
                    .all(|s| s.len() == if len == 0 { 0 } else { per })
            );
            let mut all: Vec<usize> = shards.concat();
            all.sort_unstable();
            all.dedup();
            assert_eq!(
                all,
                (0..len).collect::<Vec<_>>(),
                "len {len}, world {world}"
            );
            // Only the padding repeats.
            let repeats: usize = shards.iter().map(Vec::len).sum::<usize>() - len;
            assert!(repeats < world);
        }
    }

    #[test]
    fn order_changes_by_epoch_and_is_reproducible() {
        let s = DistributedSampler::new(100, 2, 1, 7);
        assert_eq!(s.indices(0), s.clone().indices(0));
        assert_ne!(s.indices(0), s.indices(1));
        assert_ne!(
            s.indices(0),
            DistributedSampler::new(100, 2, 1, 8).indices(0)
        );
        let plain = DistributedSampler::new(10, 2, 0, 7)
            .without_shuffle()
            .indices(5);
        assert_eq!(plain, vec![0, 2, 4, 6, 8]);
    }
}
