//! Structural checks of every schedule: each frame one rank sends is received exactly once, by
//! the rank it is addressed to, with the same size.

use bonfire_topology::{NodeId, ReduceOp};

use super::Instr;
use crate::{Algorithm, Collective, CommConfig};

fn collectives(n: usize) -> Vec<Collective> {
    let uneven: Vec<usize> = (0..n).map(|i| (i * 7 + 3) % 5).collect();
    vec![
        Collective::AllReduce(ReduceOp::Mean),
        Collective::ReduceScatter {
            op: ReduceOp::Sum,
            counts: None,
        },
        Collective::ReduceScatter {
            op: ReduceOp::Mean,
            counts: Some(uneven.clone()),
        },
        Collective::AllGather { counts: None },
        Collective::AllGather {
            counts: Some(uneven),
        },
        Collective::Broadcast { root: n - 1 },
        Collective::Reduce {
            op: ReduceOp::Mean,
            root: n / 2,
        },
        Collective::Barrier,
    ]
}

#[test]
fn every_send_meets_exactly_one_receive() {
    let config = CommConfig {
        chunk_bytes: 12, // 3 f32 per frame: many pieces
        ..CommConfig::default()
    };
    for n in 1..=9 {
        let node_sets: Vec<Vec<NodeId>> = vec![
            vec![NodeId(0); n],
            (0..n).map(|r| NodeId((r / 2) as u32)).collect(),
            (0..n).map(|r| NodeId((r % 3) as u32)).collect(),
        ];
        for nodes in &node_sets {
            for c in collectives(n) {
                let mut algorithms = c.algorithms().to_vec();
                algorithms.push(Algorithm::Auto);
                for &alg in &algorithms {
                    for len in [0usize, 1, 5, 23] {
                        check(&c, alg, n, len, nodes, &config);
                    }
                }
            }
        }
    }
}

fn check(
    c: &Collective,
    alg: Algorithm,
    n: usize,
    len: usize,
    nodes: &[NodeId],
    config: &CommConfig,
) {
    let mut sent = Vec::new();
    let mut received = Vec::new();
    for me in 0..n {
        let input = match c {
            Collective::AllGather {
                counts: Some(counts),
            } => counts[me],
            Collective::ReduceScatter {
                counts: Some(counts),
                ..
            } => counts.iter().sum(),
            Collective::Barrier => 0,
            _ => len,
        };
        let shape = c.shape(n, me, input).expect("valid call");
        let alg = c
            .resolve(alg, shape.count * 4, nodes, config)
            .expect("supported");
        let program = c.program(alg, &shape, me, nodes, 4, config);
        for (to, step, elems) in program.sends() {
            assert_ne!(to as usize, me, "{} {alg} sends to itself", c.name());
            sent.push((me as u32, to, step, elems));
        }
        for i in &program.instrs {
            if let Instr::Recv {
                from, step, range, ..
            } = i
            {
                received.push((*from, me as u32, *step, range.len()));
            }
        }
    }
    sent.sort_unstable();
    received.sort_unstable();
    let mut dedup = sent.clone();
    dedup.dedup_by_key(|(f, t, s, _)| (*f, *t, *s));
    assert_eq!(
        dedup.len(),
        sent.len(),
        "{} {alg} n={n} len={len}: a (from, to, step) is sent twice",
        c.name()
    );
    assert_eq!(
        sent,
        received,
        "{} {alg} n={n} len={len} nodes={nodes:?}",
        c.name()
    );
}
