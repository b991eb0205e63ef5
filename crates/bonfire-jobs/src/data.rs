//! What jobs share about their data and models: the order a rank visits its shard in each epoch,
//! and a digest of a model's parameters.
//!
//! Which items a rank holds is bonfire's one rule for data shards, [`Sharding`] (the data sets'
//! [`bonfire_datasets::Shard`] follows it); [`shuffled`] only orders a rank's own items.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use sha2::{Digest, Sha256};

pub use bonfire_datasets::{RankShard, ShardError, Sharding};

/// A permutation of `0..n` fixed by (seed, epoch, rank): every rank shuffles its own shard
/// afresh each epoch, the same way in a resumed run as in an uninterrupted one.
pub fn shuffled(n: usize, seed: u64, epoch: usize, rank: usize) -> Vec<usize> {
    let mut state = seed
        ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (rank as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    let mut next = move || {
        // SplitMix64.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(state)
    };
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// SplitMix64's finaliser: a well-mixed 64-bit value from any 64-bit key (consecutive keys give
/// unrelated values), for draws that must be the same on every run.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SHA-256 of every parameter's values, in module order, as little-endian f32, in hex: two runs
/// with the same digest ended with the same weights.
pub fn param_digest<B: Backend, M: Module<B>>(model: &M) -> String {
    struct Hash(Sha256);
    impl<B: Backend> ModuleVisitor<B> for Hash {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            for x in p.val().into_data().convert::<f32>().iter::<f32>() {
                self.0.update(x.to_le_bytes());
            }
        }
    }
    let mut h = Hash(Sha256::new());
    model.visit(&mut h);
    h.0.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffles_are_permutations_fixed_by_seed_epoch_and_rank() {
        let a = shuffled(100, 7, 0, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(a, shuffled(100, 7, 0, 0));
        assert_ne!(a, shuffled(100, 7, 1, 0));
        assert_ne!(a, shuffled(100, 7, 0, 1));
        assert_ne!(a, (0..100).collect::<Vec<_>>());
        // The order the vision job has always trained in (seed 42, epoch 0, rank 1).
        assert_eq!(shuffled(8, 42, 0, 1), vec![4, 6, 5, 1, 7, 0, 2, 3]);
    }
}
