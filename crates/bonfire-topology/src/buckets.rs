//! The gradient bucket plan: which parameters share a bucket, in what order buckets go out.
//!
//! Policy (the same on every rank, because it depends only on the parameter sizes, the order
//! they are taken in and the caps):
//! - Parameters are taken in the order their gradients become final in backward, as PyTorch
//!   DDP rebuilds its buckets after the first iteration: the data-parallel layer observes that
//!   order in its first backward and every rank uses rank 0's ([`BucketPlan::in_order`]).
//!   Without an observed order ([`BucketPlan::new`]) they are taken in **reverse** module
//!   order, since backward produces the last layers' gradients first. A parameter used twice (a
//!   tied embedding and output head) is final only at its first use's backward, so module order
//!   can put it in the first bucket and hold every bucket back until backward ends.
//! - A bucket is closed when adding the next parameter would take it past the cap, so buckets
//!   fill in the order gradients become ready.
//! - The first bucket has its own, smaller cap so communication starts early in backward
//!   (PyTorch DDP does the same with 1 MiB).
//! - A parameter larger than the cap gets a bucket of its own; no parameter is split.
//! - Buckets are numbered in the order they are sent; bucket k starts only after bucket k - 1
//!   has started, on every rank.

/// One bucket: parameters (indices in module order) and where each starts in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Parameter indices (module order), in the order they are laid out.
    pub params: Vec<usize>,
    /// Element offset of each parameter in the bucket, parallel to `params`.
    pub offsets: Vec<usize>,
    /// Elements in the bucket.
    pub len: usize,
}

/// A deterministic bucket plan over parameters of given sizes (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    buckets: Vec<Bucket>,
    place: Vec<(usize, usize, usize)>,
}

impl BucketPlan {
    /// Plans buckets for parameters of `numels` elements (module order), `elem_bytes` bytes each,
    /// with `cap_bytes` per bucket and `first_cap_bytes` for the first one, taking them in
    /// reverse module order.
    pub fn new(
        numels: &[usize],
        elem_bytes: usize,
        cap_bytes: usize,
        first_cap_bytes: usize,
    ) -> Self {
        let order: Vec<usize> = (0..numels.len()).rev().collect();
        Self::in_order(numels, &order, elem_bytes, cap_bytes, first_cap_bytes)
    }

    /// As [`BucketPlan::new`], taking the parameters in `order` (indices in module order: the
    /// order their gradients become final). Indices out of range or repeated are skipped, and
    /// parameters `order` leaves out follow in reverse module order, so every parameter has a
    /// place.
    pub fn in_order(
        numels: &[usize],
        order: &[usize],
        elem_bytes: usize,
        cap_bytes: usize,
        first_cap_bytes: usize,
    ) -> Self {
        let mut seen = vec![false; numels.len()];
        let mut taken = Vec::with_capacity(numels.len());
        for &p in order
            .iter()
            .chain((0..numels.len()).rev().collect::<Vec<_>>().iter())
        {
            if p < numels.len() && !seen[p] {
                seen[p] = true;
                taken.push(p);
            }
        }
        let mut buckets = Vec::new();
        let mut current = Bucket {
            params: Vec::new(),
            offsets: Vec::new(),
            len: 0,
        };
        for p in taken {
            let cap = if buckets.is_empty() {
                first_cap_bytes.min(cap_bytes)
            } else {
                cap_bytes
            };
            let bytes = numels[p] * elem_bytes;
            if !current.params.is_empty() && (current.len * elem_bytes + bytes) > cap {
                buckets.push(std::mem::replace(
                    &mut current,
                    Bucket {
                        params: Vec::new(),
                        offsets: Vec::new(),
                        len: 0,
                    },
                ));
            }
            current.params.push(p);
            current.offsets.push(current.len);
            current.len += numels[p];
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        let mut place = vec![(usize::MAX, 0, 0); numels.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for (k, (&p, &off)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
                place[p] = (b, off, k);
            }
        }
        BucketPlan { buckets, place }
    }

    /// The buckets, in sending order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The bucket and element offset of parameter `p` (module order).
    pub fn place(&self, p: usize) -> (usize, usize) {
        let (b, off, _) = self.place[p];
        (b, off)
    }

    /// Parameter `p`'s position among its bucket's parameters.
    pub fn slot(&self, p: usize) -> usize {
        self.place[p].2
    }

    /// Parameters planned.
    pub fn num_params(&self) -> usize {
        self.place.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_observed_order_is_followed_and_completed() {
        // Parameter 0 (a tied embedding) is final last; 2 never got a gradient and follows;
        // 9 is no parameter and the second 3 a repeat.
        let plan = BucketPlan::in_order(&[4, 1, 1, 1], &[3, 1, 9, 3, 0], 4, 8, 4);
        let got: Vec<Vec<usize>> = plan.buckets().iter().map(|b| b.params.clone()).collect();
        assert_eq!(got, vec![vec![3], vec![1], vec![0], vec![2]]);
        assert_eq!(plan.num_params(), 4);
        assert_eq!(plan.place(2), (3, 0));
        let plan = BucketPlan::in_order(&[1, 1, 1, 1], &[2, 3], 4, 8, 4);
        let got: Vec<Vec<usize>> = plan.buckets().iter().map(|b| b.params.clone()).collect();
        assert_eq!(got, vec![vec![2], vec![3, 1], vec![0]]);
        let reverse: Vec<usize> = (0..4).rev().collect();
        assert_eq!(
            BucketPlan::in_order(&[4, 1, 1, 1], &reverse, 4, 8, 4),
            BucketPlan::new(&[4, 1, 1, 1], 4, 8, 4)
        );
    }

    #[test]
    fn reverse_order_caps_and_oversized_parameters() {
        // 4-byte elements; first cap 8 bytes (2 elements), then 16 bytes (4 elements).
        let plan = BucketPlan::new(&[3, 1, 1, 10, 2, 1], 4, 16, 8);
        let got: Vec<Vec<usize>> = plan.buckets().iter().map(|b| b.params.clone()).collect();
        // Reverse: 5 (1), 4 (2) -> 3 > 2, so bucket 0 = [5]; then [4], then 3 alone (10 > 4),
        // then [2, 1, 0]? 1 + 1 + 3 = 5 > 4, so [2, 1], [0].
        assert_eq!(got, vec![vec![5], vec![4], vec![3], vec![2, 1], vec![0]]);
        assert_eq!(plan.place(1), (3, 1));
        assert_eq!(plan.slot(1), 1);
        assert_eq!(plan.slot(2), 0);
        assert_eq!(plan.buckets()[3].len, 2);
        for (p, &n) in [3usize, 1, 1, 10, 2, 1].iter().enumerate() {
            let (b, off) = plan.place(p);
            let bucket = &plan.buckets()[b];
            assert!(off + n <= bucket.len);
        }
    }

    #[test]
    fn every_parameter_is_placed_once_without_overlap() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        for _ in 0..200 {
            let n = (seed % 40) as usize;
            let numels: Vec<usize> = (0..n)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (seed >> 40) as usize % 5000
                })
                .collect();
            let cap = 1 + (seed >> 20) as usize % 40_000;
            let plan = BucketPlan::new(&numels, 4, cap, cap / 3 + 1);
            let mut seen = vec![0; n];
            for b in plan.buckets() {
                assert!(!b.params.is_empty());
                let mut end = 0;
                for (&p, &off) in b.params.iter().zip(&b.offsets) {
                    assert_eq!(off, end, "parameters are packed back to back");
                    end += numels[p];
                    seen[p] += 1;
                }
                assert_eq!(end, b.len);
                // Over the cap only when the bucket is one parameter.
                assert!(b.len * 4 <= cap || b.params.len() == 1);
            }
            assert!(seen.iter().all(|&s| s == 1));
            // Deterministic.
            assert_eq!(plan, BucketPlan::new(&numels, 4, cap, cap / 3 + 1));
        }
    }
}
