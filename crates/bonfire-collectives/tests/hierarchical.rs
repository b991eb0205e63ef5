//! The hierarchical all-reduce on two nodes of two ranks: the result is the oracle's, bit for bit
//! on every rank, and the bytes that cross between nodes (what QUIC carries in a real job) are
//! counted against the flat ring's.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bonfire_collectives::{Algorithm, CommConfig, Communicator};
use bonfire_testkit::{oracle, run_ranks};
use bonfire_topology::{NodeLayout, Rank, ReduceOp};
use bonfire_transport::{InProcess, Mailbox, SendFuture, Tag, Transport};
use bytes::Bytes;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Counts the data bytes this rank sends to ranks of another node.
struct Counting {
    inner: Arc<dyn Transport>,
    layout: NodeLayout,
    across: Arc<AtomicUsize>,
}

impl Transport for Counting {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> SendFuture<'_> {
        // Phase 0xFF holds the control frames (arrival and call fingerprints), not data.
        let data = tag.step >> 24 != 0xFF;
        if data && self.layout.node_of(to) != self.layout.node_of(self.rank()) {
            self.across.fetch_add(payload.len(), Ordering::Relaxed);
        }
        self.inner.send(to, tag, payload)
    }
    fn mailbox(&self) -> &Arc<Mailbox> {
        self.inner.mailbox()
    }
    fn kind(&self) -> &'static str {
        "counting"
    }
}

/// Runs one all-reduce of `count` f32 on 2 nodes x 2 ranks with `algorithm`; returns each rank's
/// result and the bytes each rank sent across nodes.
fn run(algorithm: Algorithm, op: ReduceOp, count: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<usize>) {
    let layout = NodeLayout::uniform(4, 2);
    let counters: Vec<Arc<AtomicUsize>> = (0..4).map(|_| Arc::default()).collect();
    let comms: Vec<Communicator> = InProcess::world(4)
        .into_iter()
        .zip(&counters)
        .map(|(t, across)| {
            let t = Counting {
                inner: Arc::new(t),
                layout: layout.clone(),
                across: across.clone(),
            };
            Communicator::builder(Arc::new(t))
                .nodes(layout.clone())
                .config(CommConfig {
                    chunk_bytes: 4096,
                    ..CommConfig::default()
                })
                .build()
                .unwrap()
                .with_algorithm(algorithm)
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let inputs = Arc::new(oracle::exact_inputs::<f32>(op, 4, count, &mut rng));
    let want = oracle::reduce_all(&inputs, op);
    let results = run_ranks(comms, Duration::from_secs(60), move |comm| {
        comm.all_reduce(inputs[comm.rank()].clone(), op)
            .wait()
            .unwrap()
    });
    for (r, got) in results.iter().enumerate() {
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "rank {r}, {algorithm}, {op}, {count}"
            );
        }
    }
    (
        results,
        counters.iter().map(|c| c.load(Ordering::Relaxed)).collect(),
    )
}

#[test]
fn two_nodes_of_two_match_the_oracle_and_cross_with_half_the_buffer_per_rank() {
    for (i, count) in [0usize, 1, 3, 1001, 65_536].into_iter().enumerate() {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            run(Algorithm::Hierarchical, op, count, i as u64);
        }
    }
    let count = 1 << 16;
    let bytes = count * 4;
    let (_, flat) = run(Algorithm::Ring, ReduceOp::Sum, count, 7);
    let (_, two_level) = run(Algorithm::Hierarchical, ReduceOp::Sum, count, 7);
    // Flat ring 0 -> 1 -> 2 -> 3 -> 0: ranks 1 and 3 each send 2(n-1)/n = 1.5 buffers across.
    assert_eq!(flat, [0, bytes * 3 / 2, 0, bytes * 3 / 2]);
    // Two levels: every rank all-reduces its half with its peer on the other node (a 2-rank
    // ring moves half of that half each way, twice): half a buffer per rank.
    assert_eq!(two_level, [bytes / 2; 4]);
    let total = |v: &[usize]| v.iter().sum::<usize>();
    assert!(
        total(&two_level) * 3 == total(&flat) * 2,
        "{two_level:?} {flat:?}"
    );
}
