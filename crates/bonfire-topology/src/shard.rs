//! Which items of a data set each rank reads: the one rule every bonfire data path follows.

use std::fmt;
use std::ops::Range;

/// How the `n` items of a data set are divided among the `world` ranks of a job.
///
/// This is bonfire's one definition of "rank `r` of `world` gets these positions of `n`": the
/// data sets' `Shard`, `DistributedSampler`, the burn-train strategy and the bundled jobs all ask
/// it. Positions index whatever order the caller keeps the items in (the file's order, or an
/// epoch's shuffle).
///
/// Two needs genuinely differ, so there are two kinds of policy:
///
/// - *equal* shards for lock-step training, where every rank must run the same number of steps:
///   the remainder `n % world` is either dropped ([`Sharding::EqualDrop`]) or made up by repeating
///   the first positions ([`Sharding::EqualPad`]);
/// - *balanced* shards for evaluation, where every item counts once and the counts are summed
///   afterwards ([`Sharding::Balanced`]).
///
/// (A [`crate::Partition`] splits a buffer among ranks for a collective; its balanced split puts
/// the remainder on the first ranks, which [`Sharding::Balanced`] does not. Data shards keep their
/// own rule so that a rank reads the same items it always did.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sharding {
    /// Equal consecutive shards, remainder dropped: every rank gets `n / world` positions, rank
    /// `r` positions `r * (n / world) .. (r + 1) * (n / world)`; the last `n % world` positions
    /// are in no shard (PyTorch's `drop_last=True`). Needs at least one item per rank.
    EqualDrop,
    /// Equal interleaved shards, padded: every rank gets `ceil(n / world)` positions, rank `r`
    /// positions `r, r + world, r + 2 * world, ...` of the order extended to
    /// `world * ceil(n / world)` items by repeating it from its start (PyTorch's
    /// `DistributedSampler`, `drop_last=False`). Any `n`, zero included.
    EqualPad,
    /// Balanced consecutive shards that together hold every position once, sizes differing by at
    /// most one: rank `r` gets `r * n / world .. (r + 1) * n / world`. Needs at least one item per
    /// rank.
    Balanced,
}

impl Sharding {
    /// Rank `rank`'s shard of `n` items among `world` ranks.
    pub fn shard(self, rank: usize, world: usize, n: usize) -> Result<RankShard, ShardError> {
        if world == 0 || rank >= world {
            return Err(ShardError::NotARank { rank, world });
        }
        if n < world && self != Sharding::EqualPad {
            return Err(ShardError::TooFewItems {
                rank,
                world,
                items: n,
            });
        }
        Ok(RankShard {
            sharding: self,
            rank,
            world,
            n,
        })
    }
}

/// One rank's positions of a data set under a [`Sharding`], from [`Sharding::shard`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankShard {
    sharding: Sharding,
    rank: usize,
    world: usize,
    n: usize,
}

impl RankShard {
    /// The policy it follows.
    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// The rank it belongs to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Items in the whole data set.
    pub fn items(&self) -> usize {
        self.n
    }

    /// Positions in this shard.
    pub fn len(&self) -> usize {
        match self.sharding {
            Sharding::EqualDrop => self.n / self.world,
            Sharding::EqualPad => self.n.div_ceil(self.world),
            Sharding::Balanced => {
                (self.rank + 1) * self.n / self.world - self.rank * self.n / self.world
            }
        }
    }

    /// Whether it holds no position (only [`Sharding::EqualPad`] of no items).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The positions as one range, for the consecutive policies ([`Sharding::EqualDrop`] and
    /// [`Sharding::Balanced`]); `None` for [`Sharding::EqualPad`].
    pub fn range(&self) -> Option<Range<usize>> {
        let (r, w, n) = (self.rank, self.world, self.n);
        match self.sharding {
            Sharding::EqualDrop => {
                let per = n / w;
                Some(r * per..(r + 1) * per)
            }
            Sharding::Balanced => Some(r * n / w..(r + 1) * n / w),
            Sharding::EqualPad => None,
        }
    }

    /// The position of this shard's `i`-th item, `i < len()`.
    pub fn position(&self, i: usize) -> usize {
        debug_assert!(i < self.len(), "item {i} of a shard of {}", self.len());
        match self.sharding {
            Sharding::EqualDrop => self.rank * (self.n / self.world) + i,
            Sharding::Balanced => self.rank * self.n / self.world + i,
            // The extended order repeats the order from its start: position p is p mod n.
            Sharding::EqualPad => (self.rank + i * self.world) % self.n,
        }
    }

    /// The positions, in shard order.
    pub fn positions(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        (0..self.len()).map(|i| self.position(i))
    }

    /// This shard of `order`, a list of the `n` items (or of their indices, e.g. an epoch's
    /// shuffle): `order[p]` for each position `p`.
    ///
    /// # Panics
    /// If `order` does not hold exactly the `n` items the shard was cut from.
    pub fn pick<T: Clone>(&self, order: &[T]) -> Vec<T> {
        assert_eq!(
            order.len(),
            self.n,
            "a shard of {} items applied to {} items",
            self.n,
            order.len()
        );
        self.positions().map(|p| order[p].clone()).collect()
    }
}

/// A shard that cannot be cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardError {
    /// The rank is not below the number of ranks (or there are no ranks).
    NotARank {
        /// The rank asked for.
        rank: usize,
        /// The number of ranks.
        world: usize,
    },
    /// Fewer items than ranks, under a policy that gives every rank at least one.
    TooFewItems {
        /// The rank asked for.
        rank: usize,
        /// The number of ranks.
        world: usize,
        /// The items there are.
        items: usize,
    },
}

impl fmt::Display for ShardError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardError::NotARank { rank, world } => write!(
                f,
                "shard {rank} of {world}: the rank must be below the number of shards"
            ),
            ShardError::TooFewItems { rank, world, items } => {
                write!(f, "shard {rank} of {world}: only {items} items to share")
            }
        }
    }
}

impl std::error::Error for ShardError {}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bonfire-datasets`' `Shard::range` before it asked [`Sharding`]: (equal, balanced).
    fn old_dataset_range(equal: bool, rank: usize, world: usize, len: usize) -> Range<usize> {
        if equal {
            let per = len / world;
            rank * per..(rank + 1) * per
        } else {
            rank * len / world..(rank + 1) * len / world
        }
    }

    /// `DistributedSampler::indices` before it asked [`Sharding`], over a given order.
    fn old_sampler(order: &[usize], world: usize, rank: usize) -> Vec<usize> {
        if order.is_empty() {
            return Vec::new();
        }
        let mut order = order.to_vec();
        let total = order.len().div_ceil(world) * world;
        let mut i = 0;
        while order.len() < total {
            order.push(order[i]);
            i += 1;
        }
        order.into_iter().skip(rank).step_by(world).collect()
    }

    /// The burn-train strategy's slice of its loader before it asked [`Sharding`].
    fn old_strategy_slice(rank: usize, world: usize, n: usize) -> Option<Range<usize>> {
        let per = n / world;
        (per > 0).then(|| rank * per..(rank + 1) * per)
    }

    /// Every rank gets exactly the positions the four old rules gave it, for every data set
    /// size up to 300 and every job up to 12 ranks (and the old rules' failures stay failures).
    #[test]
    fn the_rule_gives_every_rank_what_the_old_rules_gave_it() {
        for world in 1..=12 {
            for n in 0..=300 {
                // A fixed non-trivial order, as a shuffle would give.
                let order: Vec<usize> = (0..n).map(|i| (i * 7919 + 13) % n.max(1)).collect();
                for rank in 0..world {
                    let drop = Sharding::EqualDrop.shard(rank, world, n);
                    let bal = Sharding::Balanced.shard(rank, world, n);
                    if world > n {
                        // The data sets refused these, and the strategy aborted.
                        assert!(drop.is_err() && bal.is_err());
                        assert!(old_strategy_slice(rank, world, n).is_none());
                    } else {
                        let (drop, bal) = (drop.unwrap(), bal.unwrap());
                        assert_eq!(drop.range(), Some(old_dataset_range(true, rank, world, n)));
                        assert_eq!(drop.range(), old_strategy_slice(rank, world, n));
                        assert_eq!(bal.range(), Some(old_dataset_range(false, rank, world, n)));
                        let range = drop.range().unwrap();
                        assert!(drop.positions().eq(range.clone()));
                        assert_eq!(drop.len(), range.len());
                        let range = bal.range().unwrap();
                        assert!(bal.positions().eq(range.clone()));
                        assert_eq!(bal.len(), range.len());
                    }
                    let pad = Sharding::EqualPad.shard(rank, world, n).unwrap();
                    assert_eq!(pad.pick(&order), old_sampler(&order, world, rank));
                    assert_eq!(pad.len(), n.div_ceil(world));
                    assert_eq!(pad.range(), None);
                }
            }
        }
    }

    #[test]
    fn balanced_shards_cover_everything_once_and_equal_ones_are_equal() {
        let bal: Vec<_> = (0..3)
            .map(|r| Sharding::Balanced.shard(r, 3, 10).unwrap().range().unwrap())
            .collect();
        assert_eq!(bal, vec![0..3, 3..6, 6..10]);
        let drop: Vec<_> = (0..3)
            .map(|r| {
                Sharding::EqualDrop
                    .shard(r, 3, 10)
                    .unwrap()
                    .range()
                    .unwrap()
            })
            .collect();
        assert_eq!(drop, vec![0..3, 3..6, 6..9]);
        let pad: Vec<Vec<usize>> = (0..3)
            .map(|r| {
                Sharding::EqualPad
                    .shard(r, 3, 10)
                    .unwrap()
                    .positions()
                    .collect()
            })
            .collect();
        assert_eq!(
            pad,
            vec![vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]
        );
        assert!(Sharding::EqualPad.shard(0, 2, 0).unwrap().is_empty());
    }

    #[test]
    fn bad_shards_say_which() {
        let e = Sharding::EqualDrop.shard(2, 2, 10).unwrap_err();
        assert_eq!(e, ShardError::NotARank { rank: 2, world: 2 });
        assert!(e.to_string().contains("shard 2 of 2"), "{e}");
        let e = Sharding::Balanced.shard(0, 11, 10).unwrap_err();
        assert_eq!(e.to_string(), "shard 0 of 11: only 10 items to share");
        assert!(Sharding::EqualPad.shard(0, 0, 10).is_err());
    }
}
