//! Every collective, every algorithm, every dtype, world sizes 1 to 8, awkward lengths, on a
//! simulated network that delivers frames in a random order: results equal the sequential
//! oracle bit for bit (inputs are chosen so every combination order is exact), all ranks agree,
//! and a different delivery order gives the same bits.

mod common;

use bonfire_collectives::{Algorithm, CommConfig, sim};
use bonfire_testkit::oracle::{self, OracleElement};
use bonfire_topology::{NodeLayout, ReduceOp};
use half::{bf16, f16};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Copy, Debug)]
struct Case {
    kind: usize,
    op: ReduceOp,
    n: usize,
    len: usize,
    salt: usize,
    algorithm_pick: usize,
    chunk_elems: usize,
    per_node: usize,
    seed: u64,
}

fn check<T: OracleElement>(case: &Case) -> Result<(), TestCaseError> {
    let (collective, lens) = common::make(case.kind, case.op, case.n, case.len, case.salt);
    let mut algorithms = vec![Algorithm::Auto];
    algorithms.extend_from_slice(collective.algorithms());
    let algorithm = algorithms[case.algorithm_pick % algorithms.len()];
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let inputs: Vec<Vec<T>> = lens
        .iter()
        .map(|&l| oracle::exact_inputs::<T>(case.op, 1, l, &mut rng).remove(0))
        .collect();
    let config = |seed| sim::SimConfig {
        seed,
        algorithm,
        comm: CommConfig {
            chunk_bytes: case.chunk_elems * std::mem::size_of::<T>(),
            // Small thresholds so Auto exercises every size class on small buffers.
            small_bytes: 16 * std::mem::size_of::<T>(),
            large_bytes: 128 * std::mem::size_of::<T>(),
            ..CommConfig::default()
        },
        nodes: Some(NodeLayout::uniform(case.n, case.per_node)),
    };
    let context = format!(
        "{collective:?} {algorithm} n={} len={} {} chunk={} per_node={}",
        case.n,
        case.len,
        T::DTYPE,
        case.chunk_elems,
        case.per_node
    );
    let got = sim::run(&collective, inputs.clone(), &config(case.seed))
        .map_err(|e| TestCaseError::fail(format!("{context}: {e}")))?;
    let want = oracle::expected(&collective, &inputs);
    oracle::assert_bitwise(&got, &want, &context);
    let agreeing: Vec<Vec<T>> = match &collective {
        bonfire_collectives::Collective::AllReduce(_)
        | bonfire_collectives::Collective::AllGather { .. }
        | bonfire_collectives::Collective::Broadcast { .. } => got.clone(),
        _ => Vec::new(),
    };
    if !agreeing.is_empty() {
        oracle::assert_ranks_agree(&agreeing, &context);
    }
    let again = sim::run(&collective, inputs, &config(case.seed ^ 0x9e37_79b9))
        .expect("same call succeeds again");
    for (r, (a, b)) in got.iter().zip(&again).enumerate() {
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_bits(y));
        if matches!(collective, bonfire_collectives::Collective::Reduce { root, .. } if root != r) {
            continue;
        }
        prop_assert!(
            same,
            "{context}: rank {r} differs between two delivery orders"
        );
    }
    Ok(())
}

fn case() -> impl Strategy<Value = (Case, usize)> {
    (
        0..common::KINDS,
        0..ReduceOp::ALL.len(),
        1usize..=8,
        0..common::LENGTHS.len(),
        0usize..64,
        0usize..8,
        prop_oneof![
            Just(1usize),
            Just(2),
            Just(3),
            Just(7),
            Just(64),
            Just(1 << 16)
        ],
        1usize..=4,
        any::<u64>(),
        0usize..7,
    )
        .prop_map(
            |(kind, op, n, len, salt, algorithm_pick, chunk_elems, per_node, seed, dtype)| {
                (
                    Case {
                        kind,
                        op: ReduceOp::ALL[op],
                        n,
                        len: common::LENGTHS[len],
                        salt,
                        algorithm_pick,
                        chunk_elems,
                        per_node,
                        seed,
                    },
                    dtype,
                )
            },
        )
}

fn dispatch(case: &Case, dtype: usize) -> Result<(), TestCaseError> {
    match dtype {
        0 => check::<f32>(case),
        1 => check::<f64>(case),
        2 => check::<f16>(case),
        3 => check::<bf16>(case),
        4 => check::<i32>(case),
        5 => check::<i64>(case),
        _ => check::<u8>(case),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn collectives_match_the_oracle_under_reordering((case, dtype) in case()) {
        dispatch(&case, dtype)?;
    }
}

/// The exhaustive corner: every kind, every algorithm, every world size, every length, f32 and
/// u8, with 3-element frames.
#[test]
fn exhaustive_small_grid() {
    for n in 1..=8 {
        for kind in 0..common::KINDS {
            for len in [0usize, 1, 3, 7, 13] {
                for algorithm_pick in 0..5 {
                    let case = Case {
                        kind,
                        op: ReduceOp::Sum,
                        n,
                        len,
                        salt: n + len,
                        algorithm_pick,
                        chunk_elems: 3,
                        per_node: 3,
                        seed: (n * 1000 + kind * 100 + len) as u64,
                    };
                    check::<f32>(&case).unwrap();
                    check::<u8>(&Case {
                        op: ReduceOp::Mean,
                        ..case
                    })
                    .unwrap();
                }
            }
        }
    }
}

/// Real-valued floats (not exact): within the rounding bound of any summation order, and still
/// identical on every rank and across delivery orders.
#[test]
fn real_valued_sums_are_close_and_identical_everywhere() {
    use rand::Rng;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for n in [2usize, 3, 5, 8] {
        for algorithm in [
            Algorithm::Ring,
            Algorithm::RecursiveDoubling,
            Algorithm::HalvingDoubling,
            Algorithm::Hierarchical,
        ] {
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|_| (0..1000).map(|_| rng.random_range(-1.0..1.0)).collect())
                .collect();
            let config = |seed| sim::SimConfig {
                seed,
                algorithm,
                comm: CommConfig {
                    chunk_bytes: 256,
                    ..CommConfig::default()
                },
                nodes: Some(NodeLayout::uniform(n, 2)),
            };
            let op = bonfire_collectives::Collective::AllReduce(ReduceOp::Sum);
            let a = sim::run(&op, inputs.clone(), &config(1)).unwrap();
            let b = sim::run(&op, inputs.clone(), &config(2)).unwrap();
            oracle::assert_ranks_agree(&a, "real-valued");
            assert_eq!(a, b, "delivery order changed the bits ({algorithm}, n={n})");
            for i in 0..1000 {
                let exact: f64 = inputs.iter().map(|v| f64::from(v[i])).sum();
                let bound: f64 = inputs.iter().map(|v| f64::from(v[i].abs())).sum::<f64>()
                    * n as f64
                    * f64::from(f32::EPSILON);
                assert!(
                    (f64::from(a[0][i]) - exact).abs() <= bound,
                    "{algorithm} n={n} element {i}"
                );
            }
        }
    }
}
