//! How a bucket is reduce-scattered instead of all-reduced, when each rank needs only part of
//! the averaged gradients:
//!
//! - **ZeRO stage 2** ([`crate::Sharded`] with [`crate::ZeroStage::Two`]): each parameter's
//!   gradient goes whole to the rank that owns it ([`Scatter::owners`]).
//! - **ZeRO stage 3** ([`crate::fully_shard`]): each rank holds a slice of every parameter, so
//!   each gets its slice of every gradient ([`Scatter::shards`]), and sends half the bytes an
//!   all-reduce would. A parameter its backend keeps whole (no dimension the ranks divide) is
//!   all-reduced beside the reduce-scatter: a reduce-scatter sums each rank's share in an order
//!   of its own, and every rank must end with the same bits of a whole parameter.
//!
//! A bucket lays its gradients out in the order they became final; the reduce-scatter needs each
//! rank's share contiguous, so the bucket is sent permuted: every rank's pieces in turn (bucket
//! order within a rank), each followed by presence flags (its own slots' at stage 2, every slot's
//! at stage 3: a sum of zeros and ones is exact in any order). A rank receives exactly its own
//! pieces and flags, reduced.

use std::ops::Range;

use std::collections::HashMap;

use bonfire_topology::Bucket;

/// Which rank each parameter's gradient goes to (by the parameter's id), as the sharded optimizer
/// planned it on every rank alike.
pub(crate) struct GradOwners {
    pub(crate) rank: usize,
    pub(crate) ranks: usize,
    pub(crate) owner: HashMap<u64, usize>,
}

impl GradOwners {
    /// The owner of parameter `id`. A parameter the optimizer never saw (its plan is of the
    /// module it steps) goes to rank 0, the same on every rank.
    pub(crate) fn owner(&self, id: u64) -> usize {
        self.owner.get(&id).copied().unwrap_or(0)
    }

    /// Whether this rank keeps parameter `id`'s gradient.
    pub(crate) fn owns(&self, id: u64) -> bool {
        self.owner(id) == self.rank
    }
}

/// How a backend that keeps a parameter sharded at rest over the data-parallel ranks themselves
/// (ZeRO stage 3) splits it, and so which part of its gradient each rank keeps: along `dim`,
/// which holds `blocks` equal blocks, each cut into `ranks` equal chunks; rank `r` holds chunk `r`
/// of every block, in block order (the layout of [`crate::Placement::Shard`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardAtRest {
    /// The whole parameter's shape.
    pub shape: Vec<usize>,
    /// The dimension split.
    pub dim: usize,
    /// Blocks along it (1 for a plain split).
    pub blocks: usize,
    /// Ranks it is split over.
    pub ranks: usize,
    /// This rank's place among them.
    pub rank: usize,
}

impl ShardAtRest {
    /// The ranges of the whole parameter, row-major (its flat indices), that rank `r` holds, in
    /// the order its slice lays them out.
    pub(crate) fn runs(&self, r: usize) -> Vec<Range<usize>> {
        let shape = &self.shape;
        let size = shape[self.dim];
        let inner: usize = shape[self.dim + 1..].iter().product();
        let outer: usize = shape[..self.dim].iter().product();
        let block = size / self.blocks;
        let chunk = block / self.ranks;
        let mut runs = Vec::with_capacity(outer * self.blocks);
        for o in 0..outer {
            for b in 0..self.blocks {
                let start = (o * size + b * block + r * chunk) * inner;
                let end = start + chunk * inner;
                match runs.last_mut() {
                    Some(Range { end: last, .. }) if *last == start => *last = end,
                    _ => runs.push(start..end),
                }
            }
        }
        runs
    }

    /// The shape of a rank's slice.
    pub(crate) fn local_shape(&self) -> Vec<usize> {
        let mut local = self.shape.clone();
        local[self.dim] /= self.ranks;
        local
    }

    /// Whether a gradient of `numel` elements splits this way over the ranks evenly (otherwise
    /// it is all-reduced whole).
    pub(crate) fn fits(&self, numel: usize) -> bool {
        self.dim < self.shape.len()
            && self.blocks > 0
            && self.ranks > 0
            && self.rank < self.ranks
            && self.shape[self.dim].is_multiple_of(self.blocks * self.ranks)
            && self.shape.iter().product::<usize>() == numel
    }
}

/// What a rank receives of one slot (parameter) of a bucket, in the order its share holds them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Received {
    /// The slot: the parameter's position among the bucket's.
    pub(crate) slot: usize,
    /// Elements of it received.
    pub(crate) elements: usize,
    /// Its slice only (ZeRO stage 3), as the parameter is split; otherwise the whole gradient.
    pub(crate) slice: Option<ShardAtRest>,
}

/// One bucket's reduce-scatter layout.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Scatter {
    /// Per rank, the ranges of the bucket's values it receives, in the order its share holds
    /// them.
    pieces: Vec<Vec<Range<usize>>>,
    /// Per rank, the slots whose presence flags follow its values.
    flags: Vec<Vec<usize>>,
    /// Elements each rank receives: its values, then its flags.
    counts: Vec<usize>,
    /// What this rank's share holds, slot by slot.
    mine: Vec<Received>,
    /// The slots all-reduced whole beside the reduce-scatter (stage 3: parameters kept whole),
    /// in bucket order.
    whole: Vec<usize>,
    /// This rank.
    rank: usize,
}

/// Elements of the bucket's `k`-th parameter.
pub(crate) fn slot_len(bucket: &Bucket, k: usize) -> usize {
    bucket.offsets.get(k + 1).copied().unwrap_or(bucket.len) - bucket.offsets[k]
}

impl Scatter {
    /// ZeRO stage 2: each gradient whole to its owner under `owners`; `id(p)` is the id of the
    /// bucket's parameter `p`.
    pub(crate) fn owners(bucket: &Bucket, id: impl Fn(usize) -> u64, owners: &GradOwners) -> Self {
        let mut by_rank = vec![Vec::new(); owners.ranks];
        for (k, &p) in bucket.params.iter().enumerate() {
            let r = owners.owner(id(p)).min(owners.ranks - 1);
            by_rank[r].push(k);
        }
        let piece = |k: usize| bucket.offsets[k]..bucket.offsets[k] + slot_len(bucket, k);
        let pieces: Vec<Vec<Range<usize>>> = by_rank
            .iter()
            .map(|slots| slots.iter().map(|&k| piece(k)).collect())
            .collect();
        let mine = by_rank[owners.rank]
            .iter()
            .map(|&k| Received {
                slot: k,
                elements: slot_len(bucket, k),
                slice: None,
            })
            .collect();
        Scatter::laid_out(pieces, by_rank, mine, Vec::new(), owners.rank)
    }

    /// ZeRO stage 3: `split(k)` says how the bucket's `k`-th parameter is sharded at rest
    /// (`None`: kept whole); every rank gets its slice of each sharded gradient and the flags of
    /// every slot, and the whole ones are all-reduced apart. `None` when no parameter of the
    /// bucket is sharded over these `ranks` (the bucket is all-reduced).
    pub(crate) fn shards(
        bucket: &Bucket,
        split: impl Fn(usize) -> Option<ShardAtRest>,
        rank: usize,
        ranks: usize,
    ) -> Option<Self> {
        let slots = bucket.params.len();
        let mut pieces = vec![Vec::new(); ranks];
        let mut mine = Vec::new();
        let mut whole = Vec::new();
        for k in 0..slots {
            let laid = split(k)
                .filter(|s| s.ranks == ranks && s.rank == rank && s.fits(slot_len(bucket, k)));
            let Some(s) = laid else {
                whole.push(k);
                continue;
            };
            let off = bucket.offsets[k];
            for (r, pieces) in pieces.iter_mut().enumerate() {
                pieces.extend(s.runs(r).into_iter().map(|p| off + p.start..off + p.end));
            }
            mine.push(Received {
                slot: k,
                elements: slot_len(bucket, k) / ranks,
                slice: Some(s),
            });
        }
        if mine.is_empty() {
            return None;
        }
        let flags = vec![(0..slots).collect(); ranks];
        Some(Scatter::laid_out(pieces, flags, mine, whole, rank))
    }

    fn laid_out(
        pieces: Vec<Vec<Range<usize>>>,
        flags: Vec<Vec<usize>>,
        mine: Vec<Received>,
        whole: Vec<usize>,
        rank: usize,
    ) -> Self {
        let counts = pieces
            .iter()
            .zip(&flags)
            .map(|(p, f)| p.iter().map(|r| r.len()).sum::<usize>() + f.len())
            .collect();
        Scatter {
            pieces,
            flags,
            counts,
            mine,
            whole,
            rank,
        }
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Elements each rank receives (the reduce-scatter's counts).
    pub(crate) fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// What this rank's share holds, slot by slot, in order.
    pub(crate) fn mine(&self) -> &[Received] {
        &self.mine
    }

    /// The slots whose presence flags follow this rank's values, in order.
    pub(crate) fn my_flags(&self) -> &[usize] {
        &self.flags[self.rank]
    }

    /// Elements of gradient in this rank's share (its flags follow them).
    pub(crate) fn my_elements(&self) -> usize {
        self.mine.iter().map(|m| m.elements).sum()
    }

    /// The slots all-reduced whole beside the reduce-scatter, in bucket order.
    pub(crate) fn whole(&self) -> &[usize] {
        &self.whole
    }

    /// `buf` (the bucket's gradients in its own layout, then its flags) in the send layout.
    pub(crate) fn permute<T: Copy>(&self, bucket: &Bucket, buf: &[T]) -> Vec<T> {
        let mut out = Vec::with_capacity(self.counts.iter().sum());
        for (pieces, flags) in self.pieces.iter().zip(&self.flags) {
            for p in pieces {
                out.extend_from_slice(&buf[p.clone()]);
            }
            out.extend(flags.iter().map(|&k| buf[bucket.len + k]));
        }
        out
    }

    /// Elements of the slots all-reduced whole.
    pub(crate) fn whole_elements(&self, bucket: &Bucket) -> usize {
        self.whole.iter().map(|&k| slot_len(bucket, k)).sum()
    }

    /// The values of the slots all-reduced whole ([`Scatter::whole`]), one after another, from
    /// `buf` (the bucket's layout); `None` when there are none.
    pub(crate) fn whole_values<T: Copy>(&self, bucket: &Bucket, buf: &[T]) -> Option<Vec<T>> {
        if self.whole.is_empty() {
            return None;
        }
        let mut out = Vec::new();
        for &k in &self.whole {
            let off = bucket.offsets[k];
            out.extend_from_slice(&buf[off..off + slot_len(bucket, k)]);
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_its_own_gradients_and_flags_and_nothing_else() {
        // Parameters 0..4 (ids 10..14) of 3, 1, 2 and 4 elements; the bucket holds 2, 0, 3, 1.
        let params = [10u64, 11, 12, 13];
        let bucket = Bucket {
            params: vec![2, 0, 3, 1],
            offsets: vec![0, 2, 5, 9],
            len: 10,
        };
        // Ids 10 and 13 to rank 1, 12 to rank 0, 11 to rank 2; rank 1's view.
        let owners = GradOwners {
            rank: 1,
            ranks: 3,
            owner: [(10, 1), (11, 2), (12, 0), (13, 1)].into_iter().collect(),
        };
        let s = Scatter::owners(&bucket, |p| params[p], &owners);
        // Values: the parameter's id times 100 plus the element; flags: 1000 + slot.
        let mut buf = Vec::new();
        for (k, &p) in bucket.params.iter().enumerate() {
            buf.extend((0..slot_len(&bucket, k)).map(|e| (params[p] * 100 + e as u64) as f32));
        }
        buf.extend((0..4).map(|k| 1000.0 + k as f32));
        let sent = s.permute(&bucket, &buf);
        assert_eq!(sent.len(), buf.len());
        assert_eq!(s.counts(), &[2 + 1, 3 + 4 + 2, 1 + 1]);
        let expect: Vec<f32> = [
            // rank 0: id 12 (slot 0), its flag
            vec![1200.0, 1201.0, 1000.0],
            // rank 1: id 10 (slot 1), id 13 (slot 2), their flags
            vec![
                1000.0, 1001.0, 1002.0, 1300.0, 1301.0, 1302.0, 1303.0, 1001.0, 1002.0,
            ],
            // rank 2: id 11 (slot 3), its flag
            vec![1100.0, 1003.0],
        ]
        .concat();
        assert_eq!(sent, expect);
        let mine: Vec<(usize, usize)> = s.mine().iter().map(|m| (m.slot, m.elements)).collect();
        assert_eq!(mine, [(1, 3), (2, 4)]);
        assert_eq!(s.my_flags(), &[1, 2]);
        assert_eq!(s.my_elements(), 7);
        assert!(s.whole().is_empty());
    }

    #[test]
    fn a_parameter_the_plan_never_saw_goes_to_rank_zero() {
        let params = [1u64, 2];
        let bucket = Bucket {
            params: vec![0, 1],
            offsets: vec![0, 1],
            len: 2,
        };
        let owners = GradOwners {
            rank: 0,
            ranks: 2,
            owner: [(2, 1)].into_iter().collect(),
        };
        let s = Scatter::owners(&bucket, |p| params[p], &owners);
        assert_eq!(s.my_flags(), &[0]);
        assert_eq!(s.counts(), &[2, 2]);
    }

    /// Rank `r`'s slice of `t` (row-major, of `shape`) under `s`, element by element: the oracle
    /// for `ShardAtRest::runs`.
    fn slice_reference(t: &[f32], s: &ShardAtRest, r: usize) -> Vec<f32> {
        let shape = &s.shape;
        let local = s.local_shape();
        let block = shape[s.dim] / s.blocks;
        let chunk = block / s.ranks;
        let n: usize = local.iter().product();
        let mut out = Vec::with_capacity(n);
        for flat in 0..n {
            // The local multi-index, then the global one.
            let mut rest = flat;
            let mut index = vec![0; local.len()];
            for d in (0..local.len()).rev() {
                index[d] = rest % local[d];
                rest /= local[d];
            }
            let j = index[s.dim];
            index[s.dim] = (j / chunk) * block + r * chunk + j % chunk;
            let global = index
                .iter()
                .zip(shape)
                .fold(0, |acc, (&i, &dim)| acc * dim + i);
            out.push(t[global]);
        }
        out
    }

    #[test]
    fn runs_cover_each_ranks_slice_in_its_order() {
        let cases: &[(&[usize], usize, usize, usize)] = &[
            (&[8], 0, 1, 2),
            (&[6, 4], 0, 1, 3),
            (&[6, 4], 1, 1, 2),
            (&[2, 12, 3], 1, 3, 2),
            (&[4, 3, 8], 2, 2, 4),
            (&[16, 3, 3, 3], 0, 1, 4),
        ];
        for &(shape, dim, blocks, ranks) in cases {
            let numel: usize = shape.iter().product();
            let t: Vec<f32> = (0..numel).map(|i| i as f32).collect();
            let mut seen = vec![0; numel];
            for r in 0..ranks {
                let s = ShardAtRest {
                    shape: shape.to_vec(),
                    dim,
                    blocks,
                    ranks,
                    rank: r,
                };
                assert!(s.fits(numel));
                let got: Vec<f32> = s.runs(r).into_iter().flat_map(|p| t[p].to_vec()).collect();
                assert_eq!(got, slice_reference(&t, &s, r), "{shape:?} {dim} {blocks}");
                for v in got {
                    seen[v as usize] += 1;
                }
            }
            assert!(
                seen.iter().all(|&c| c == 1),
                "every element to one rank: {shape:?}"
            );
        }
    }

    #[test]
    fn each_rank_receives_its_slices_every_flag_and_nothing_whole() {
        // Four parameters in bucket order, over 2 ranks: [4, 6] split on 1, [3] kept whole, [8]
        // split on 0, [2, 4] split on 1 in two blocks.
        let ranks = 2;
        let shapes: Vec<Vec<usize>> = vec![vec![4, 6], vec![3], vec![8], vec![2, 4]];
        let splits = [Some((1, 1)), None, Some((0, 1)), Some((1, 2))];
        let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
        let mut offsets = vec![0];
        for l in &lens[..lens.len() - 1] {
            offsets.push(offsets.last().unwrap() + l);
        }
        let bucket = Bucket {
            params: vec![0, 1, 2, 3],
            offsets,
            len: lens.iter().sum(),
        };
        // Each rank's bucket: distinct values, then its flags (all present).
        let buf = |r: usize| -> Vec<f32> {
            let mut b: Vec<f32> = (0..bucket.len).map(|i| (i * 10 + r) as f32).collect();
            b.extend([1.0; 4]);
            b
        };
        let layouts: Vec<Scatter> = (0..ranks)
            .map(|rank| {
                Scatter::shards(
                    &bucket,
                    |k| {
                        splits[k].map(|(dim, blocks)| ShardAtRest {
                            shape: shapes[k].clone(),
                            dim,
                            blocks,
                            ranks,
                            rank,
                        })
                    },
                    rank,
                    ranks,
                )
                .expect("some parameters are split")
            })
            .collect();
        // Every rank agrees on the counts; the reduce-scatter's oracle: sum the ranks' sent
        // buffers, then cut by the counts.
        let counts = layouts[0].counts().to_vec();
        assert!(layouts.iter().all(|l| l.counts() == counts));
        let sent: Vec<Vec<f32>> = (0..ranks)
            .map(|r| layouts[r].permute(&bucket, &buf(r)))
            .collect();
        let total: Vec<f32> = (0..sent[0].len())
            .map(|i| sent.iter().map(|s| s[i]).sum())
            .collect();
        let summed: Vec<f32> = (0..bucket.len + 4)
            .map(|i| (0..ranks).map(|r| buf(r)[i]).sum())
            .collect();
        let mut at = 0;
        for (r, layout) in layouts.iter().enumerate() {
            let share = &total[at..at + counts[r]];
            at += counts[r];
            assert_eq!(layout.whole(), &[1]);
            let mut got = 0;
            for m in layout.mine() {
                let k = m.slot;
                let whole = &summed[bucket.offsets[k]..bucket.offsets[k] + lens[k]];
                let s = m.slice.as_ref().expect("a split slot arrives as its slice");
                let want = slice_reference(whole, s, r);
                assert_eq!(
                    &share[got..got + m.elements],
                    want.as_slice(),
                    "rank {r} slot {k}"
                );
                got += m.elements;
            }
            assert_eq!(got, layout.my_elements());
            assert_eq!(layout.my_flags(), &[0, 1, 2, 3]);
            assert_eq!(&share[got..], &[2.0; 4]);
            let whole = layout
                .whole_values(&bucket, &buf(r))
                .expect("one whole slot");
            assert_eq!(
                whole,
                buf(r)[bucket.offsets[1]..bucket.offsets[1] + 3].to_vec()
            );
        }
        // Half the values (but the whole slot) cross per rank, against an all-reduce's whole.
        assert_eq!(counts, [(bucket.len - 3) / 2 + 4; 2]);
    }

    #[test]
    fn a_bucket_with_nothing_split_is_all_reduced() {
        let bucket = Bucket {
            params: vec![0],
            offsets: vec![0],
            len: 3,
        };
        assert!(Scatter::shards(&bucket, |_| None, 0, 2).is_none());
        // A split the ranks do not divide, of another group's size, or of another size than
        // the gradient is no split.
        let odd = ShardAtRest {
            shape: vec![3],
            dim: 0,
            blocks: 1,
            ranks: 2,
            rank: 0,
        };
        assert!(Scatter::shards(&bucket, |_| Some(odd.clone()), 0, 2).is_none());
        let other = ShardAtRest {
            shape: vec![6],
            ranks: 3,
            ..odd.clone()
        };
        let bigger = Bucket { len: 6, ..bucket };
        assert!(Scatter::shards(&bigger, |_| Some(other.clone()), 0, 2).is_none());
        let elsewhere = ShardAtRest {
            shape: vec![4],
            ..odd
        };
        assert!(Scatter::shards(&bigger, |_| Some(elsewhere.clone()), 0, 2).is_none());
    }
}
