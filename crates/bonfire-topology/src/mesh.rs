use std::fmt;

use crate::Rank;

/// The layout of a job's ranks: `pp` pipeline stages, each held by `dp` data-parallel replicas,
/// each split over `tp` tensor-parallel ranks (`pp` is 1 without pipeline parallelism).
///
/// As in Megatron-LM, tensor-parallel ranks are adjacent and stages outermost
/// (`rank = (stage * dp + dp_index) * tp + tp_index`): tensor-parallel ranks exchange the most
/// data, so they should share a node, and neighbouring stages exchange one activation per
/// micro-batch, the least. A rank's *tp group* is the `tp` ranks of its stage with its
/// `dp_index`; its *dp group* is the `dp` ranks of its stage with its `tp_index`; its *pp group*
/// is the `pp` ranks with its `dp_index` and `tp_index`, one per stage, in stage order.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    dp: usize,
    tp: usize,
    pp: usize,
}

/// A mesh that does not fit the world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshError {
    /// The number of ranks in the job.
    pub world: usize,
    /// The requested tensor-parallel size.
    pub tp: usize,
    /// The requested number of pipeline stages.
    pub pp: usize,
}

impl fmt::Display for MeshError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.pp == 1 {
            write!(
                f,
                "a tensor-parallel size of {} does not divide the world size {}",
                self.tp, self.world
            )
        } else {
            write!(
                f,
                "a tensor-parallel size of {} times {} pipeline stages does not divide the world size {}",
                self.tp, self.pp, self.world
            )
        }
    }
}

impl std::error::Error for MeshError {}

impl Mesh {
    /// The mesh of `world` ranks with tensor-parallel size `tp` (one pipeline stage).
    pub fn new(world: usize, tp: usize) -> Result<Mesh, MeshError> {
        Mesh::with_stages(world, tp, 1)
    }

    /// The mesh of `world` ranks with tensor-parallel size `tp` and `pp` pipeline stages.
    pub fn with_stages(world: usize, tp: usize, pp: usize) -> Result<Mesh, MeshError> {
        let error = MeshError { world, tp, pp };
        let Some(slice) = tp.checked_mul(pp) else {
            return Err(error);
        };
        if world == 0 || slice == 0 || !world.is_multiple_of(slice) {
            return Err(error);
        }
        Ok(Mesh {
            dp: world / slice,
            tp,
            pp,
        })
    }

    /// Number of data-parallel replicas.
    pub fn dp(&self) -> usize {
        self.dp
    }

    /// Ranks per tensor-parallel group.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// Pipeline stages.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// Total number of ranks.
    pub fn world(&self) -> usize {
        self.pp * self.dp * self.tp
    }

    /// `(dp_index, tp_index)` of a rank, within its stage.
    pub fn coords(&self, rank: Rank) -> (usize, usize) {
        let (_, d, t) = self.coords3(rank);
        (d, t)
    }

    /// `(stage, dp_index, tp_index)` of a rank.
    pub fn coords3(&self, rank: Rank) -> (usize, usize, usize) {
        let r = rank.index();
        assert!(
            r < self.world(),
            "{rank} is outside a mesh of {} ranks",
            self.world()
        );
        let slice = self.dp * self.tp;
        (r / slice, (r % slice) / self.tp, r % self.tp)
    }

    /// The pipeline stage of a rank.
    pub fn stage(&self, rank: Rank) -> usize {
        self.coords3(rank).0
    }

    /// The rank at `(dp_index, tp_index)` of the first stage.
    pub fn rank_at(&self, dp_index: usize, tp_index: usize) -> Rank {
        self.rank_at_stage(0, dp_index, tp_index)
    }

    /// The rank at `(stage, dp_index, tp_index)`.
    pub fn rank_at_stage(&self, stage: usize, dp_index: usize, tp_index: usize) -> Rank {
        assert!(stage < self.pp && dp_index < self.dp && tp_index < self.tp);
        Rank::from((stage * self.dp + dp_index) * self.tp + tp_index)
    }

    /// The members of `rank`'s tensor-parallel group, in tp order.
    pub fn tp_group(&self, rank: Rank) -> Vec<Rank> {
        let (p, d, _) = self.coords3(rank);
        (0..self.tp).map(|t| self.rank_at_stage(p, d, t)).collect()
    }

    /// The members of `rank`'s data-parallel group, in dp order.
    pub fn dp_group(&self, rank: Rank) -> Vec<Rank> {
        let (p, _, t) = self.coords3(rank);
        (0..self.dp).map(|d| self.rank_at_stage(p, d, t)).collect()
    }

    /// The members of `rank`'s pipeline group, one per stage, in stage order.
    pub fn pp_group(&self, rank: Rank) -> Vec<Rank> {
        let (_, d, t) = self.coords3(rank);
        (0..self.pp).map(|p| self.rank_at_stage(p, d, t)).collect()
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
        assert_eq!(
            Mesh::new(6, 4),
            Err(MeshError {
                world: 6,
                tp: 4,
                pp: 1
            })
        );
        assert!(Mesh::new(0, 1).is_err());
        assert_eq!(m.pp_group(Rank(5)), vec![Rank(5)]);
    }

    /// Every rank is in exactly one group of each kind, the groups have the mesh's sizes, and a
    /// rank's three groups meet only in it.
    #[test]
    fn three_dimensional_groups_partition_the_world() {
        let m = Mesh::with_stages(12, 2, 3).unwrap();
        assert_eq!((m.pp(), m.dp(), m.tp(), m.world()), (3, 2, 2, 12));
        // Megatron's order: tp fastest, then dp, stages outermost.
        assert_eq!(m.coords3(Rank(7)), (1, 1, 1));
        assert_eq!(m.rank_at_stage(1, 1, 1), Rank(7));
        assert_eq!(m.pp_group(Rank(7)), vec![Rank(3), Rank(7), Rank(11)]);
        assert_eq!(m.dp_group(Rank(7)), vec![Rank(5), Rank(7)]);
        assert_eq!(m.tp_group(Rank(7)), vec![Rank(6), Rank(7)]);
        type Groups = fn(&Mesh, Rank) -> Vec<Rank>;
        for (kind, size) in [
            (Mesh::pp_group as Groups, 3),
            (Mesh::dp_group as Groups, 2),
            (Mesh::tp_group as Groups, 2),
        ] {
            let mut groups: Vec<Vec<Rank>> = Vec::new();
            for r in 0..12u32 {
                let g = kind(&m, Rank(r));
                assert_eq!(g.len(), size);
                assert!(g.contains(&Rank(r)));
                for x in &g {
                    assert_eq!(kind(&m, *x), g, "{r}: groups agree");
                }
                if !groups.contains(&g) {
                    groups.push(g);
                }
            }
            // The distinct groups cover every rank exactly once.
            let mut seen = [0; 12];
            for x in groups.iter().flatten() {
                seen[x.index()] += 1;
            }
            assert_eq!(seen, [1; 12]);
            assert_eq!(groups.len(), 12 / size);
        }
        for r in 0..12u32 {
            let (p, d, t) = (
                m.pp_group(Rank(r)),
                m.dp_group(Rank(r)),
                m.tp_group(Rank(r)),
            );
            for x in &p {
                assert!(*x == Rank(r) || (!d.contains(x) && !t.contains(x)));
            }
        }
        assert_eq!(
            Mesh::with_stages(8, 2, 3),
            Err(MeshError {
                world: 8,
                tp: 2,
                pp: 3
            })
        );
        assert!(Mesh::with_stages(4, 1, 0).is_err());
    }
}
