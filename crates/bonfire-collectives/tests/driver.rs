//! The async driver over an in-process transport that delays every frame by a random time:
//! every collective and algorithm against the oracle, non-blocking calls in flight together,
//! send/recv, split and the 2-D mesh.

mod common;

use std::time::Duration;

use bonfire_collectives::{CommConfig, Communicator, Element};
use bonfire_testkit::{calls, chaos_world, run_ranks};
use bonfire_topology::{Mesh, ReduceOp};
use half::bf16;

const DEADLINE: Duration = Duration::from_secs(120);

fn config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(30),
        chunk_bytes: 24,
        small_bytes: 64,
        large_bytes: 512,
    }
}

#[test]
fn every_collective_and_algorithm_over_a_reordering_transport() {
    for n in [1usize, 2, 3, 5, 8] {
        let comms = chaos_world(n, config(), Duration::from_micros(300), n as u64);
        run_ranks(comms, DEADLINE, move |comm| {
            calls::every_call::<f32>(&comm, 1);
            calls::every_call::<bf16>(&comm, 2);
            calls::every_call::<i64>(&comm, 3);
        });
    }
}

#[test]
fn calls_in_flight_together_complete_in_any_wait_order() {
    let comms = chaos_world(4, config(), Duration::from_micros(500), 9);
    let results = run_ranks(comms, DEADLINE, |comm| {
        let r = comm.rank() as f64;
        let a = comm.all_reduce(vec![r; 100], ReduceOp::Sum);
        let b = comm.all_gather(vec![comm.rank() as i32; 3]);
        let c = comm.broadcast(vec![r as u8; 50], 2);
        let d = comm.reduce_scatter(vec![1.0f32; 10], ReduceOp::Sum);
        let barrier = comm.barrier();
        // Wait in the reverse order of the calls.
        barrier.wait().unwrap();
        let d = d.wait().unwrap();
        let c = c.wait().unwrap();
        let b = b.wait().unwrap();
        let a = a.wait().unwrap();
        (a, b, c, d)
    });
    for (rank, (a, b, c, d)) in results.into_iter().enumerate() {
        assert_eq!(a, vec![6.0; 100]);
        assert_eq!(b, vec![0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
        assert_eq!(c, vec![2u8; 50]);
        let seg = if rank < 2 { 3 } else { 2 };
        assert_eq!(d, vec![4.0; seg], "rank {rank}");
    }
}

#[test]
fn futures_can_be_awaited() {
    let comms = Communicator::in_process(3, config());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let sums = rt.block_on(async {
        let works: Vec<_> = comms
            .iter()
            .map(|c| c.all_reduce(vec![c.rank() as i32 + 1], ReduceOp::Product))
            .collect();
        let mut out = Vec::new();
        for w in works {
            out.push(w.await.unwrap());
        }
        out
    });
    assert_eq!(sums, vec![vec![6]; 3]);
}

#[test]
fn the_times_of_a_work_split_waiting_for_a_late_peer_from_the_transfer() {
    let late = Duration::from_millis(80);
    // Eager (the call runs it) and not (the runtime does), in chunks of the default size.
    for bytes in [256usize, 256 * 1024] {
        let comms = Communicator::in_process(3, CommConfig::default());
        let times = run_ranks(comms, DEADLINE, move |comm| {
            if comm.rank() == 2 {
                std::thread::sleep(late);
            }
            let called = std::time::Instant::now();
            let work = comm.all_reduce(vec![1.0f32; bytes / 4], ReduceOp::Sum);
            let (sum, t) = work.wait_times();
            assert_eq!(sum.unwrap(), vec![3.0; bytes / 4]);
            assert!(called <= t.started && t.started <= t.arrived && t.arrived <= t.finished);
            (
                t.started - called,
                t.arrived - t.started,
                t.finished - t.arrived,
                t.last_peer.map(|r| r.index()),
            )
        });
        for (rank, &(scheduled, waited, moved, last)) in times.iter().enumerate() {
            let what = format!("{bytes} B, rank {rank}: {times:?}");
            assert!(scheduled < late / 2, "{what}");
            assert!(moved < late / 2, "{what}");
            if rank == 2 {
                assert!(
                    waited < late / 2,
                    "the late rank found the others in: {what}"
                );
            } else {
                assert!(waited >= late * 3 / 4, "waited for the late rank: {what}");
                assert_eq!(last, Some(2), "named the late rank: {what}");
            }
        }
    }
}

#[test]
fn a_caller_driven_collective_moves_only_when_its_caller_looks() {
    // Large enough not to be finished by the call's own first step.
    let n = 256 * 1024;
    let comms = Communicator::in_process(2, CommConfig::default());
    let sums = run_ranks(comms, DEADLINE, move |comm| {
        if comm.rank() == 1 {
            // Late, so that rank 0's call has returned before any frame of this rank came.
            std::thread::sleep(Duration::from_millis(100));
            return comm
                .all_reduce(vec![1.0f32; n], ReduceOp::Sum)
                .wait()
                .unwrap();
        }
        let work = comm
            .caller_driven()
            .all_reduce(vec![2.0f32; n], ReduceOp::Sum);
        // The peer's frames arrive meanwhile; no communication thread takes them up.
        std::thread::sleep(Duration::from_millis(300));
        assert!(!work.is_finished(), "a thread other than the caller ran it");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !work.progress() {
            assert!(
                std::time::Instant::now() < deadline,
                "progress never finished it"
            );
            std::thread::yield_now();
        }
        work.wait().unwrap()
    });
    assert_eq!(sums, vec![vec![3.0f32; n]; 2]);
}

#[test]
fn send_and_recv_match_in_call_order() {
    let comms = chaos_world(4, config(), Duration::from_micros(300), 4);
    let got = run_ranks(comms, DEADLINE, |comm| {
        let n = comm.size();
        let me = comm.rank();
        let next = (me + 1) % n;
        let prev = (me + n - 1) % n;
        // Three messages around the ring, all in flight at once.
        let sends: Vec<_> = (0..3)
            .map(|k| comm.send(vec![(me * 10 + k) as u16 as f32; 40 + k], next))
            .collect();
        let recvs: Vec<_> = (0..3)
            .map(|k| comm.recv(vec![0.0f32; 40 + k], prev))
            .collect();
        let got: Vec<Vec<f32>> = recvs.into_iter().map(|w| w.wait().unwrap()).collect();
        for s in sends {
            s.wait().unwrap();
        }
        got
    });
    for (me, msgs) in got.iter().enumerate() {
        let prev = (me + 3) % 4;
        for (k, m) in msgs.iter().enumerate() {
            assert_eq!(
                m,
                &vec![(prev * 10 + k) as f32; 40 + k],
                "rank {me} message {k}"
            );
        }
    }
}

#[test]
fn send_and_recv_of_different_sizes_fail_on_both_sides() {
    let comms = Communicator::in_process(2, config());
    let errs = run_ranks(comms, DEADLINE, |comm| {
        if comm.rank() == 0 {
            comm.send(vec![1u8; 10], 1).wait().unwrap_err().to_string()
        } else {
            comm.recv(vec![0u8; 11], 0).wait().unwrap_err().to_string()
        }
    });
    for e in &errs {
        assert!(e.contains("rank 0") && e.contains("rank 1"), "{e}");
        assert!(e.contains("of 10 x u8") && e.contains("of 11 x u8"), "{e}");
    }
}

#[test]
fn split_groups_by_color_and_orders_by_key() {
    let comms = chaos_world(6, config(), Duration::from_micros(200), 6);
    let got = run_ranks(comms, DEADLINE, |comm| {
        let me = comm.rank();
        // Even ranks form a group ordered by descending rank; rank 5 joins none.
        let color = if me == 5 { None } else { Some((me % 2) as u32) };
        let sub = comm.split(color, (10 - me) as u32).unwrap();
        // The parent keeps working after a split, in flight with the subgroups' calls.
        let all = comm.all_reduce(vec![1u8], ReduceOp::Sum);
        let result = sub.map(|sub| {
            let members: Vec<u32> = sub.members().iter().map(|r| r.0).collect();
            let sum = sub
                .all_reduce(vec![me as i64], ReduceOp::Sum)
                .wait()
                .unwrap();
            (sub.rank(), members, sum[0])
        });
        assert_eq!(all.wait().unwrap(), vec![6]);
        result
    });
    assert_eq!(got[0], Some((2, vec![4, 2, 0], 6)));
    assert_eq!(got[4], Some((0, vec![4, 2, 0], 6)));
    assert_eq!(got[1], Some((1, vec![3, 1], 4)));
    assert_eq!(got[5], None);
}

#[test]
fn a_mesh_gives_dp_and_tp_groups() {
    let comms = Communicator::in_process(8, config());
    let got = run_ranks(comms, DEADLINE, |comm| {
        let groups = comm.split_mesh(&Mesh::new(8, 2).unwrap()).unwrap();
        let me = comm.rank() as i32;
        let dp = groups
            .dp
            .all_reduce(vec![me], ReduceOp::Sum)
            .wait()
            .unwrap()[0];
        let tp = groups.tp.all_gather(vec![me]).wait().unwrap();
        (groups.dp.size(), groups.tp.size(), dp, tp)
    });
    // tp groups: {0,1} {2,3} {4,5} {6,7}; dp groups: {0,2,4,6} {1,3,5,7}.
    assert_eq!(got[0], (4, 2, 12, vec![0, 1]));
    assert_eq!(got[5], (4, 2, 16, vec![4, 5]));
}

/// A mesh of 2 stages x 2 replicas x 2 tensor-parallel ranks: each group all-gathers its
/// members' ranks, which must be the mesh's groups, in their order.
#[test]
fn a_mesh_with_stages_gives_pipeline_groups() {
    let comms = Communicator::in_process(8, config());
    let mesh = Mesh::with_stages(8, 2, 2).unwrap();
    let got = run_ranks(comms, DEADLINE, move |comm| {
        let groups = comm.split_mesh(&mesh).unwrap();
        let me = comm.rank() as i32;
        let members = |g: &Communicator| g.all_gather(vec![me]).wait().unwrap();
        (
            members(&groups.dp),
            members(&groups.tp),
            members(&groups.pp),
            groups.pp.rank(),
        )
    });
    for (r, (dp, tp, pp, stage)) in got.iter().enumerate() {
        let ranks = |g: Vec<bonfire_topology::Rank>| -> Vec<i32> {
            g.into_iter().map(|x| x.index() as i32).collect()
        };
        let me = bonfire_topology::Rank::from(r);
        assert_eq!(dp, &ranks(mesh.dp_group(me)), "rank {r}'s dp group");
        assert_eq!(tp, &ranks(mesh.tp_group(me)), "rank {r}'s tp group");
        assert_eq!(pp, &ranks(mesh.pp_group(me)), "rank {r}'s pp group");
        assert_eq!(*stage, mesh.stage(me));
    }
    // Rank 5 = stage 1, replica 0, tp rank 1.
    assert_eq!(got[5].2, vec![1, 5]);
    assert_eq!(got[5].0, vec![5, 7]);
}

#[test]
fn one_rank_is_a_pass_through() {
    let comm = Communicator::in_process(1, config()).remove(0);
    let v: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    assert_eq!(
        comm.all_reduce(v.clone(), ReduceOp::Mean).wait().unwrap(),
        v
    );
    assert_eq!(comm.all_gather(v.clone()).wait().unwrap(), v);
    assert_eq!(
        comm.reduce_scatter(v.clone(), ReduceOp::Sum)
            .wait()
            .unwrap(),
        v
    );
    comm.barrier().wait().unwrap();
}

fn _element_is_implemented_for_every_dtype<T: Element>() {}
