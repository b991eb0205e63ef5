//! ZeRO stage 2's gradient routing: under [`crate::Sharded`] with [`crate::ZeroStage::Two`] each
//! parameter's gradient is needed only by the rank that owns it, so a bucket is reduce-scattered
//! instead of all-reduced. A bucket lays its gradients out in the order they became final; the
//! reduce-scatter needs each rank's share contiguous, so the bucket is sent permuted: every
//! rank's gradients in turn (bucket order within a rank), each followed by their presence flags.
//! A rank receives exactly its own gradients and flags, reduced.

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

/// One bucket's reduce-scatter layout.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Scatter {
    /// Per rank, the slots (positions among the bucket's parameters) it owns, in bucket order.
    by_rank: Vec<Vec<usize>>,
    /// Elements each rank receives: its gradients, then one presence flag per parameter.
    counts: Vec<usize>,
    /// This rank.
    rank: usize,
}

/// Elements of the bucket's `k`-th parameter.
pub(crate) fn slot_len(bucket: &Bucket, k: usize) -> usize {
    bucket.offsets.get(k + 1).copied().unwrap_or(bucket.len) - bucket.offsets[k]
}

impl Scatter {
    /// The layout of `bucket` under `owners`; `id(p)` is the id of the bucket's parameter `p`.
    pub(crate) fn new(bucket: &Bucket, id: impl Fn(usize) -> u64, owners: &GradOwners) -> Scatter {
        let mut by_rank = vec![Vec::new(); owners.ranks];
        let mut counts = vec![0; owners.ranks];
        for (k, &p) in bucket.params.iter().enumerate() {
            let r = owners.owner(id(p)).min(owners.ranks - 1);
            by_rank[r].push(k);
            counts[r] += slot_len(bucket, k) + 1;
        }
        Scatter {
            by_rank,
            counts,
            rank: owners.rank,
        }
    }

    /// Elements each rank receives (the reduce-scatter's counts).
    pub(crate) fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// The slots this rank owns, in the order its share holds them.
    pub(crate) fn mine(&self) -> &[usize] {
        &self.by_rank[self.rank]
    }

    /// Elements of gradient in this rank's share (its flags follow them).
    pub(crate) fn my_elements(&self, bucket: &Bucket) -> usize {
        self.mine().iter().map(|&k| slot_len(bucket, k)).sum()
    }

    /// `buf` (the bucket's gradients in its own layout, then its flags) in the send layout.
    pub(crate) fn permute<T: Copy>(&self, bucket: &Bucket, buf: &[T]) -> Vec<T> {
        let mut out = Vec::with_capacity(buf.len());
        for slots in &self.by_rank {
            for &k in slots {
                let off = bucket.offsets[k];
                out.extend_from_slice(&buf[off..off + slot_len(bucket, k)]);
            }
            out.extend(slots.iter().map(|&k| buf[bucket.len + k]));
        }
        out
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
        let s = Scatter::new(&bucket, |p| params[p], &owners);
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
        assert_eq!(s.mine(), &[1, 2]);
        assert_eq!(s.my_elements(&bucket), 7);
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
        let s = Scatter::new(&bucket, |p| params[p], &owners);
        assert_eq!(s.mine(), &[0]);
        assert_eq!(s.counts(), &[2, 2]);
    }
}
