//! Distributed code fails loudly and never hangs: mismatched calls, ranks that never come, ranks
//! that die, bad arguments and malformed frames give every rank an error naming the culprit,
//! quickly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bonfire_collectives::{Algorithm, CollectiveError, CommConfig, Communicator};
use bonfire_testkit::run_ranks;
use bonfire_topology::{GroupId, Rank, ReduceOp};
use bonfire_transport::{InProcess, Tag, Transport};
use bytes::Bytes;

const DEADLINE: Duration = Duration::from_secs(60);

fn patient() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(30),
        ..CommConfig::default()
    }
}

/// Runs `call` on every rank and returns (error text, seconds until the error) per rank.
fn errors<F>(n: usize, config: CommConfig, call: F) -> Vec<(String, f64)>
where
    F: Fn(&Communicator) -> Result<(), CollectiveError> + Send + Sync + 'static,
{
    run_ranks(Communicator::in_process(n, config), DEADLINE, move |comm| {
        let start = Instant::now();
        let err = call(&comm).expect_err("the call must fail");
        assert_eq!(
            err.rank(),
            comm.world_rank(),
            "an error names the rank that reports it"
        );
        (err.to_string(), start.elapsed().as_secs_f64())
    })
}

#[test]
fn a_count_mismatch_fails_every_rank_within_a_second_naming_both() {
    let errs = errors(4, patient(), |comm| {
        let len = if comm.rank() == 2 { 5 } else { 4 };
        comm.all_reduce(vec![1.0f32; len], ReduceOp::Sum)
            .wait()
            .map(drop)
    });
    for (rank, (e, secs)) in errs.iter().enumerate() {
        assert!(*secs < 1.0, "rank {rank} took {secs}s: {e}");
        assert!(e.contains("mismatch"), "rank {rank}: {e}");
        assert!(e.contains("rank 2"), "rank {rank} must name rank 2: {e}");
        assert!(
            e.contains("of 4 x f32") && e.contains("of 5 x f32"),
            "rank {rank} must show both calls: {e}"
        );
    }
}

#[test]
fn different_operations_at_the_same_point_fail_instead_of_mixing() {
    let errs = errors(3, patient(), |comm| {
        if comm.rank() == 0 {
            comm.broadcast(vec![1i32; 8], 0).wait().map(drop)
        } else {
            comm.all_reduce(vec![1i32; 8], ReduceOp::Max)
                .wait()
                .map(drop)
        }
    });
    for (rank, (e, secs)) in errs.iter().enumerate() {
        assert!(*secs < 1.0, "rank {rank} took {secs}s");
        assert!(
            e.contains("broadcast #0") && e.contains("all_reduce(max) #0"),
            "rank {rank}: {e}"
        );
        assert!(e.contains("rank 0"), "rank {rank}: {e}");
    }
}

#[test]
fn a_dtype_or_algorithm_mismatch_is_reported() {
    let errs = errors(2, patient(), |comm| {
        if comm.rank() == 0 {
            comm.all_reduce(vec![1.0f32; 8], ReduceOp::Sum)
                .wait()
                .map(drop)
        } else {
            comm.all_reduce(vec![1.0f64; 8], ReduceOp::Sum)
                .wait()
                .map(drop)
        }
    });
    assert!(
        errs.iter()
            .all(|(e, _)| e.contains("x f32") && e.contains("x f64")),
        "{errs:?}"
    );
    let errs = errors(2, patient(), |comm| {
        let algorithm = if comm.rank() == 0 {
            Algorithm::Ring
        } else {
            Algorithm::RecursiveDoubling
        };
        comm.with_algorithm(algorithm)
            .all_reduce(vec![1u8; 8], ReduceOp::Sum)
            .wait()
            .map(drop)
    });
    assert!(
        errs.iter()
            .all(|(e, _)| e.contains("[ring") && e.contains("[recursive-doubling")),
        "{errs:?}"
    );
}

#[test]
fn a_rank_that_never_calls_is_named_in_the_timeout() {
    let config = CommConfig {
        timeout: Duration::from_millis(300),
        ..CommConfig::default()
    };
    let results = run_ranks(Communicator::in_process(3, config), DEADLINE, |comm| {
        if comm.rank() == 2 {
            // Alive (its endpoint open) but busy elsewhere.
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let start = Instant::now();
        let err = comm
            .all_reduce(vec![0i32; 100], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        Some((err, start.elapsed()))
    });
    for (rank, r) in results.into_iter().take(2).enumerate() {
        let (err, took) = r.expect("ranks 0 and 1 report");
        match &err {
            CollectiveError::Timeout { missing, .. } => {
                assert_eq!(missing, &vec![Rank(2)], "rank {rank}")
            }
            // A rank may learn of the other's timeout first.
            CollectiveError::PeerAborted { reason, .. } => {
                assert!(reason.contains("rank 2 did not arrive"), "{reason}")
            }
            other => panic!("rank {rank}: unexpected {other}"),
        }
        assert!(err.to_string().contains("rank 2 did not arrive"), "{err}");
        assert!(took < Duration::from_secs(2), "rank {rank} took {took:?}");
    }
}

#[test]
fn a_rank_that_dies_mid_collective_is_named_quickly() {
    let results = run_ranks(Communicator::in_process(4, patient()), DEADLINE, |comm| {
        if comm.rank() == 1 {
            // Dies while the others wait for it inside the collective.
            std::thread::sleep(Duration::from_millis(200));
            drop(comm);
            return None;
        }
        let start = Instant::now();
        let err = comm
            .all_reduce(vec![0.5f32; 1 << 16], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        Some((err.to_string(), start.elapsed()))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let Some((e, took)) = r else { continue };
        assert!(e.contains("rank 1"), "rank {rank}: {e}");
        assert!(
            e.contains("unreachable") || e.contains("aborted"),
            "rank {rank}: {e}"
        );
        assert!(
            took < Duration::from_secs(2),
            "rank {rank} took {took:?}: {e}"
        );
    }
}

/// After a member dies the others, agreeing on who is left, go on in a subgroup formed without
/// a collective: its all-reduce and all-gather equal a sequential oracle over the survivors, in
/// the order the list gives, and the parent group still names the dead member.
#[test]
fn the_survivors_of_a_dead_rank_go_on_in_a_subgroup() {
    let results = run_ranks(Communicator::in_process(4, patient()), DEADLINE, |comm| {
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(100));
            drop(comm);
            return None;
        }
        let err = comm
            .all_reduce(vec![1.0f32; 64], ReduceOp::Sum)
            .wait()
            .unwrap_err()
            .to_string();
        let survivors = [3, 0, 1];
        assert_eq!(
            comm.subgroup(&[1, 3]).is_some(),
            comm.rank() != 0,
            "members get the group, the others none"
        );
        let sub = comm.subgroup(&survivors).expect("a survivor is a member");
        let x: Vec<f64> = (0..1000)
            .map(|i| ((i * 7 + comm.rank() * 13) % 17) as f64 * 0.25)
            .collect();
        let sum = sub.all_reduce(x, ReduceOp::Sum).wait().unwrap();
        let gathered = sub.all_gather(vec![comm.rank() as i64]).wait().unwrap();
        Some((err, sub.rank(), sub.size(), sum, gathered))
    });
    let oracle: Vec<f64> = (0..1000)
        .map(|i| {
            [3usize, 0, 1]
                .iter()
                .map(|r| ((i * 7 + r * 13) % 17) as f64 * 0.25)
                .sum()
        })
        .collect();
    for (rank, r) in results.into_iter().enumerate() {
        let Some((err, at, size, sum, gathered)) = r else {
            assert_eq!(rank, 2);
            continue;
        };
        assert!(err.contains("rank 2"), "rank {rank}: {err}");
        assert_eq!(
            at,
            [1, 2, 99, 0][rank],
            "rank {rank}'s place in the subgroup"
        );
        assert_eq!(size, 3);
        assert_eq!(sum, oracle, "rank {rank}");
        assert_eq!(gathered, vec![3, 0, 1], "rank {rank}");
    }
}

#[test]
fn invalid_arguments_fail_the_caller_and_abort_the_others() {
    let errs = errors(3, patient(), |comm| {
        let root = if comm.rank() == 1 { 7 } else { 0 };
        comm.broadcast(vec![0u8; 4], root).wait().map(drop)
    });
    assert!(
        errs[1]
            .0
            .contains("invalid broadcast on rank 1: root 7 is outside a group of 3"),
        "{}",
        errs[1].0
    );
    for rank in [0, 2] {
        let (e, secs) = &errs[rank];
        assert!(
            e.contains("rank 1 aborted it") && e.contains("root 7"),
            "rank {rank}: {e}"
        );
        assert!(*secs < 1.0);
    }
    let errs = errors(2, patient(), |comm| {
        comm.all_gather_uneven(vec![1i64; 2], &[2, 2, 2])
            .wait()
            .map(drop)
    });
    assert!(
        errs.iter()
            .all(|(e, _)| e.contains("3 counts given for a group of 2")),
        "{errs:?}"
    );
}

#[test]
fn an_unsupported_algorithm_is_refused_by_name() {
    let comm = Communicator::in_process(1, patient()).remove(0);
    let err = comm
        .with_algorithm(Algorithm::Tree)
        .all_reduce(vec![1.0f32], ReduceOp::Sum)
        .wait()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "all_reduce on rank 0 has no tree schedule; it implements ring, recursive-doubling, halving-doubling, hierarchical"
    );
}

#[test]
fn a_malformed_arrival_is_a_bad_frame_naming_the_sender() {
    let mut world = InProcess::world(2);
    let rogue = world.pop().unwrap();
    let honest = Communicator::builder(Arc::new(world.pop().unwrap()))
        .config(patient())
        .build()
        .unwrap();
    let arrival = Tag {
        context: GroupId::WORLD.0,
        seq: 0,
        step: 0xFF00_0000,
    };
    let work = honest.all_reduce(vec![1.0f32; 4], ReduceOp::Sum);
    futures_lite_block_on(rogue.send(Rank(0), arrival, Bytes::from_static(b"not a fingerprint")))
        .unwrap();
    let err = work.wait().unwrap_err();
    assert!(
        matches!(err, CollectiveError::BadFrame { peer: Rank(1), .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("rank 1 sent a malformed frame"),
        "{err}"
    );
    drop(rogue);
}

#[test]
fn a_dropped_work_still_completes_for_the_others() {
    let results = run_ranks(Communicator::in_process(3, patient()), DEADLINE, |comm| {
        let w = comm.all_reduce(vec![comm.rank() as u8; 10], ReduceOp::Sum);
        if comm.rank() == 0 {
            drop(w);
            // The next call still lines up with the others.
            comm.all_reduce(vec![1u8], ReduceOp::Sum).wait().unwrap();
            None
        } else {
            let r = w.wait().unwrap();
            comm.all_reduce(vec![1u8], ReduceOp::Sum).wait().unwrap();
            Some(r)
        }
    });
    assert_eq!(results[1], Some(vec![3u8; 10]));
}

fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

/// A transport whose sends never complete: a peer that stopped reading, a full window.
struct Stalled(bonfire_transport::InProcessTransport);

impl Transport for Stalled {
    fn rank(&self) -> Rank {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn send(&self, _to: Rank, _tag: Tag, _payload: Bytes) -> bonfire_transport::SendFuture<'_> {
        Box::pin(std::future::pending())
    }
    fn mailbox(&self) -> &Arc<bonfire_transport::Mailbox> {
        self.0.mailbox()
    }
    fn kind(&self) -> &'static str {
        "stalled"
    }
}

#[test]
fn a_send_that_never_completes_times_out_naming_the_peer() {
    let mut world = InProcess::world(2);
    let _peer = world.pop().unwrap();
    let config = CommConfig {
        timeout: Duration::from_millis(200),
        ..CommConfig::default()
    };
    let comm = Communicator::builder(Arc::new(Stalled(world.pop().unwrap())))
        .config(config)
        .build()
        .unwrap();
    let start = Instant::now();
    let err = comm
        .all_reduce(vec![1.0f32; 8], ReduceOp::Sum)
        .wait()
        .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(
        err.to_string()
            .contains("sending to rank 1 failed: the frame was not accepted within"),
        "{err}"
    );
}
