//! Shared by the integration tests: building a collective call of every kind from a few numbers.
#![allow(dead_code, unreachable_pub)]

use bonfire_collectives::Collective;
use bonfire_topology::ReduceOp;

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
