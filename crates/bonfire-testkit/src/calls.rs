//! Calls of every kind built from a few numbers, and a check that runs them all against the
//! oracle; shared by the in-process, simulated and multi-process tests.

use bonfire_collectives::{Algorithm, Collective, Communicator};
use bonfire_topology::ReduceOp;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::oracle::{self, OracleElement};

/// Element counts that stress the partitions: empty, single, primes, not divisible by any world
/// size, and large enough to need many pieces.
pub const LENGTHS: &[usize] = &[0, 1, 2, 3, 5, 7, 11, 13, 31, 64, 97, 257, 1031];

/// The kinds of call, for strategies.
pub const KINDS: usize = 8;

/// Call kind `kind` for a world of `n`; `len` is the caller-side length (the total for
/// reduce-scatter, each rank's for all-gather) and `salt` picks roots and uneven counts.
/// Returns the call and every rank's input length.
pub fn make(
    kind: usize,
    op: ReduceOp,
    n: usize,
    len: usize,
    salt: usize,
) -> (Collective, Vec<usize>) {
    let uneven: Vec<usize> = (0..n).map(|r| (r * 7 + salt) % (len + 1)).collect();
    match kind {
        0 => (Collective::AllReduce(op), vec![len; n]),
        1 => (Collective::ReduceScatter { op, counts: None }, vec![len; n]),
        2 => {
            let total = uneven.iter().sum();
            (
                Collective::ReduceScatter {
                    op,
                    counts: Some(uneven),
                },
                vec![total; n],
            )
        }
        3 => (Collective::AllGather { counts: None }, vec![len; n]),
        4 => (
            Collective::AllGather {
                counts: Some(uneven.clone()),
            },
            uneven,
        ),
        5 => (Collective::Broadcast { root: salt % n }, vec![len; n]),
        6 => (Collective::Reduce { op, root: salt % n }, vec![len; n]),
        _ => (Collective::Barrier, vec![0; n]),
    }
}

/// Runs every kind of call with every algorithm on `comm`, on lengths 0, 1, 13 and 130, and
/// checks this rank's result bit for bit against the oracle. Every rank derives every rank's
/// input from `seed`, so each can check its own result without talking to the others.
///
/// # Panics
/// On an error or a wrong result, naming the call, the algorithm, the length and the rank.
pub fn every_call<T: OracleElement>(comm: &Communicator, seed: u64) {
    every_call_of::<T>(comm, seed, &[0, 1, 13, 130]);
}

/// As [`every_call`], on the element counts `lengths`.
///
/// # Panics
/// On an error or a wrong result, naming the call, the algorithm, the length and the rank.
pub fn every_call_of<T: OracleElement>(comm: &Communicator, seed: u64, lengths: &[usize]) {
    let n = comm.size();
    let me = comm.rank();
    for kind in 0..KINDS {
        for (li, &len) in lengths.iter().enumerate() {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
                let (collective, lens) = make(kind, op, n, len, li + kind);
                let mut algorithms = vec![Algorithm::Auto];
                algorithms.extend_from_slice(collective.algorithms());
                for algorithm in algorithms {
                    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (kind * 1000 + li) as u64);
                    let inputs: Vec<Vec<T>> = lens
                        .iter()
                        .map(|&l| oracle::exact_inputs::<T>(op, 1, l, &mut rng).remove(0))
                        .collect();
                    let got = comm
                        .with_algorithm(algorithm)
                        .run(collective.clone(), inputs[me].clone())
                        .wait()
                        .unwrap_or_else(|e| panic!("{collective:?} {algorithm}: {e}"));
                    if let Some(want) = &oracle::expected(&collective, &inputs)[me] {
                        let context = format!(
                            "{collective:?} {algorithm} n={n} len={len} {} rank {me}",
                            T::DTYPE
                        );
                        let mut gots = vec![Vec::new(); n];
                        let mut wants = vec![None; n];
                        gots[me] = got;
                        wants[me] = Some(want.clone());
                        oracle::assert_bitwise(&gots, &wants, &context);
                    }
                }
            }
        }
    }
}
