use std::fmt;

use crate::Rank;

/// The 2-D layout of a job's ranks: `dp` data-parallel replicas, each split over `tp`
/// tensor-parallel ranks.
///
/// Tensor-parallel ranks are adjacent (`rank = dp_index * tp + tp_index`), as in Megatron-LM:
/// they exchange the most data, so they should share a node. A rank's *tp group* is the `tp`
/// ranks with its `dp_index`; its *dp group* is the `dp` ranks with its `tp_index`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    dp: usize,
    tp: usize,
}

/// A mesh that does not fit the world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshError {
    /// The number of ranks in the job.
    pub world: usize,
    /// The requested tensor-parallel size.
    pub tp: usize,
}

impl fmt::Display for MeshError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a tensor-parallel size of {} does not divide the world size {}",
            self.tp, self.world
        )
    }
}

impl std::error::Error for MeshError {}

impl Mesh {
    /// The mesh of `world` ranks with tensor-parallel size `tp`.
    pub fn new(world: usize, tp: usize) -> Result<Mesh, MeshError> {
        if world == 0 || tp == 0 || !world.is_multiple_of(tp) {
            return Err(MeshError { world, tp });
        }
        Ok(Mesh { dp: world / tp, tp })
    }

    /// Number of data-parallel replicas.
    pub fn dp(&self) -> usize {
        self.dp
    }

    /// Ranks per tensor-parallel group.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// Total number of ranks.
    pub fn world(&self) -> usize {
        self.dp * self.tp
    }

    /// `(dp_index, tp_index)` of a rank.
    pub fn coords(&self, rank: Rank) -> (usize, usize) {
        let r = rank.index();
        assert!(
            r < self.world(),
            "{rank} is outside a mesh of {} ranks",
            self.world()
        );
        (r / self.tp, r % self.tp)
    }

    /// The rank at `(dp_index, tp_index)`.
    pub fn rank_at(&self, dp_index: usize, tp_index: usize) -> Rank {
        assert!(dp_index < self.dp && tp_index < self.tp);
        Rank::from(dp_index * self.tp + tp_index)
    }

    /// The members of `rank`'s tensor-parallel group, in tp order.
    pub fn tp_group(&self, rank: Rank) -> Vec<Rank> {
        let (d, _) = self.coords(rank);
        (0..self.tp).map(|t| self.rank_at(d, t)).collect()
    }

    /// The members of `rank`'s data-parallel group, in dp order.
    pub fn dp_group(&self, rank: Rank) -> Vec<Rank> {
        let (_, t) = self.coords(rank);
        (0..self.dp).map(|d| self.rank_at(d, t)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_partition_the_world() {
        let m = Mesh::new(8, 2).unwrap();
        assert_eq!((m.dp(), m.tp()), (4, 2));
        assert_eq!(m.coords(Rank(5)), (2, 1));
        assert_eq!(m.tp_group(Rank(5)), vec![Rank(4), Rank(5)]);
        assert_eq!(
            m.dp_group(Rank(5)),
            vec![Rank(1), Rank(3), Rank(5), Rank(7)]
        );
        for r in 0..8u32 {
            assert!(m.tp_group(Rank(r)).contains(&Rank(r)));
            assert!(m.dp_group(Rank(r)).contains(&Rank(r)));
        }
        assert_eq!(Mesh::new(6, 4), Err(MeshError { world: 6, tp: 4 }));
        assert!(Mesh::new(0, 1).is_err());
    }
}
