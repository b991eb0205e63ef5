//! The device lane (CUDA IPC windows and the lane's fused kernel) against the host reference:
//! every collective, f32/f16/bf16, sizes from 0 to 64 MiB with odd lengths, between threads of
//! one process and between processes (where the windows cross through CUDA IPC); the
//! hierarchical all-reduce across nodes (threads standing in for the ranks of several nodes); and
//! a rank that dies before or in the middle of a collective, which its peer must name instead of
//! waiting for it.
//!
//! GPU only: without a CUDA device (or without `--features cuda`) each test says so and passes.
#![cfg(feature = "cuda")]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bonfire_kernels::GradElement;
use bonfire_kernels::lane::{self, CrossLink, DeviceLane, LaneOp, NodeLink};
use half::{bf16, f16};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const WAIT: Duration = Duration::from_secs(60);

fn gpu() -> bool {
    match lane::devices() {
        Ok(_) => true,
        Err(why) => {
            eprintln!("skipped: {why}");
            false
        }
    }
}

/// Rank `rank`'s input of `len` elements for case `seed`, the same in every process.
fn input<T: GradElement>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed * 1000 + rank as u64);
    (0..len)
        .map(|_| T::narrow(rng.random_range(-4.0f32..4.0)))
        .collect()
}

/// Ranks as threads of this process, with a timed barrier (a test that fails must not hang).
struct Threads {
    rank: usize,
    shared: Arc<Shared>,
}

struct Shared {
    size: usize,
    state: Mutex<(usize, u64, Vec<Vec<u8>>)>,
    turn: Condvar,
}

impl Threads {
    fn group(size: usize) -> Vec<Threads> {
        let shared = Arc::new(Shared {
            size,
            state: Mutex::new((0, 0, vec![Vec::new(); size])),
            turn: Condvar::new(),
        });
        (0..size)
            .map(|rank| Threads {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn wait(&self) -> Result<(), String> {
        let s = &self.shared;
        let mut g = s.state.lock().unwrap();
        let generation = g.1;
        g.0 += 1;
        if g.0 == s.size {
            g.0 = 0;
            g.1 += 1;
            s.turn.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        while g.1 == generation {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("rank {}: barrier timed out", self.rank));
            }
            g = s.turn.wait_timeout(g, left).unwrap().0;
        }
        Ok(())
    }
}

impl NodeLink for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
        self.shared.state.lock().unwrap().2[self.rank] = mine;
        self.wait()?;
        let all = self.shared.state.lock().unwrap().2.clone();
        self.wait()?;
        Ok(all)
    }
    fn barrier(&self) -> Result<(), String> {
        self.wait()
    }
}

/// Checks every collective of the lane for element type `T` on this rank, for each length.
fn check_all<T: GradElement + PartialEq + std::fmt::Debug, L: NodeLink>(
    lane: &DeviceLane<L>,
    lens: &[usize],
    seed: u64,
) {
    let (rank, n) = (lane.rank(), lane.size());
    let name = std::any::type_name::<T>();
    for (k, &len) in lens.iter().enumerate() {
        let seed = seed + k as u64;
        let inputs: Vec<Vec<T>> = (0..n).map(|r| input(seed, r, len)).collect();
        for op in [LaneOp::Sum, LaneOp::Mean] {
            lane.write(&inputs[rank]).unwrap();
            lane.all_reduce::<T>(len, op).unwrap();
            let mut got = vec![T::narrow(0.0); len];
            lane.read(&mut got).unwrap();
            let want = lane::reference::all_reduce(&inputs, op);
            let bad = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a.widen().to_bits() != b.widen().to_bits());
            assert!(
                bad.is_none(),
                "all-reduce {op:?} of {len} {name} on rank {rank} of {n}: element {bad:?} is {:?}, the reference says {:?}",
                bad.map(|i| got[i]),
                bad.map(|i| want[i]),
            );
        }
        // Uneven segments, one of them empty where there are several ranks.
        let counts: Vec<usize> = (0..n)
            .map(|r| if n > 1 && r == 1 { 0 } else { len / n + r })
            .collect();
        let total: usize = counts.iter().sum();
        let inputs: Vec<Vec<T>> = (0..n).map(|r| input(seed + 500, r, total)).collect();
        lane.write(&inputs[rank]).unwrap();
        lane.reduce_scatter::<T>(&counts, LaneOp::Mean).unwrap();
        let mut got = vec![T::narrow(0.0); total];
        lane.read(&mut got).unwrap();
        let want = lane::reference::all_reduce(&inputs, LaneOp::Mean);
        let start: usize = counts[..rank].iter().sum();
        let seg = start..start + counts[rank];
        assert_eq!(
            bits(&got[seg.clone()]),
            bits(&want[seg.clone()]),
            "reduce-scatter of {total} {name} on rank {rank} of {n}, segment {seg:?}"
        );
        // All-gather of those segments: afterwards every window holds every rank's result.
        lane.all_gather::<T>(&counts).unwrap();
        lane.read(&mut got).unwrap();
        assert_eq!(
            bits(&got),
            bits(&want),
            "all-gather of {total} {name} on rank {rank} of {n}"
        );
    }
}

fn bits<T: GradElement>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.widen().to_bits()).collect()
}

/// Lengths from empty to 64 MiB of f32 (16 Mi elements and an odd tail), most of them odd.
const LENS: &[usize] = &[
    0,
    1,
    7,
    63,
    64,
    1000,
    4097,
    65_537,
    (1 << 20) + 3,
    (16 << 20) + 5,
];
const CAPACITY: usize = ((16 << 20) + 64) * 4;

#[test]
fn lane_collectives_between_threads_match_the_reference() {
    if !gpu() {
        return;
    }
    for n in [1, 2, 3] {
        let links = Threads::group(n);
        std::thread::scope(|s| {
            for link in &links {
                s.spawn(move || {
                    let mut lane = DeviceLane::new(link, 0, CAPACITY).expect("the lane sets up");
                    assert!(lane.one_device(), "threads of one process share device 0");
                    // Rank 0's kernels for every rank, then each rank's own.
                    for seed in [1, 4] {
                        check_all::<f32, _>(&lane, LENS, seed);
                        check_all::<f16, _>(&lane, LENS, seed + 1);
                        check_all::<bf16, _>(&lane, LENS, seed + 2);
                        lane.split_kernels();
                    }
                });
            }
        });
    }
}

/// The ranks of one local index on every node, as threads: a sum is an all-gather of every
/// node's chunk, added in node order.
impl CrossLink for Threads {
    fn nodes(&self) -> usize {
        self.shared.size
    }
    fn start_sum(&self, chunk: Vec<f32>) -> Box<dyn FnOnce() -> Result<Vec<f32>, String> + '_> {
        let bytes = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.all_gather(bytes);
        Box::new(move || {
            let all = all?;
            let value = |node: usize, i: usize| {
                f32::from_le_bytes(all[node][4 * i..4 * i + 4].try_into().unwrap())
            };
            Ok((0..chunk.len())
                .map(|i| (1..all.len()).fold(value(0, i), |acc, node| acc + value(node, i)))
                .collect())
        })
    }
}

/// Lengths for the hierarchical all-reduce: odd ones, and shares of several chunks crossing
/// nodes ([`lane::CROSS_CHUNK`]).
const ACROSS_LENS: &[usize] = &[0, 1, 63, 257, 65_537, (1 << 20) + 3, (5 << 20) + 7];

#[test]
fn the_all_reduce_across_nodes_matches_the_node_by_node_reference() {
    if !gpu() {
        return;
    }
    let capacity = ((5 << 20) + 64) * 4;
    for (nodes, per_node) in [(2, 2), (3, 1), (2, 3)] {
        let node_links: Vec<Vec<Threads>> = (0..nodes).map(|_| Threads::group(per_node)).collect();
        let cross_links: Vec<Vec<Threads>> = (0..per_node).map(|_| Threads::group(nodes)).collect();
        let world = nodes * per_node;
        std::thread::scope(|s| {
            for (node, links) in node_links.iter().enumerate() {
                for (local, link) in links.iter().enumerate() {
                    let cross = &cross_links[local][node];
                    s.spawn(move || {
                        let rank = node * per_node + local;
                        let mut lane = DeviceLane::new(link, 0, capacity).expect("the lane sets up");
                        for (k, &len) in ACROSS_LENS.iter().enumerate() {
                            for op in [LaneOp::Sum, LaneOp::Mean] {
                                let seed = 500 + k as u64;
                                let inputs: Vec<Vec<f32>> =
                                    (0..world).map(|r| input(seed, r, len)).collect();
                                lane.write(&inputs[rank]).unwrap();
                                lane.all_reduce_across(len, op, cross).unwrap();
                                let mut got = vec![0.0f32; len];
                                lane.read(&mut got).unwrap();
                                // Each node sums its ranks in order (the lane's kernel), the
                                // nodes' sums are added in node order, then scaled once.
                                let scale = match op {
                                    LaneOp::Sum => 1.0,
                                    LaneOp::Mean => 1.0 / world as f32,
                                };
                                let want = (0..len).map(|i| {
                                    let node_sum = |n: usize| {
                                        (1..per_node).fold(inputs[n * per_node][i], |acc, l| {
                                            acc + inputs[n * per_node + l][i]
                                        })
                                    };
                                    let total = (1..nodes).fold(node_sum(0), |acc, n| acc + node_sum(n));
                                    if scale == 1.0 { total } else { total * scale }
                                });
                                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                                    assert_eq!(
                                        g.to_bits(),
                                        w.to_bits(),
                                        "{nodes} nodes of {per_node}, rank {rank}, {op:?} of {len}: element {i} is {g}, the reference says {w}"
                                    );
                                }
                            }
                            // The one-device schedule first, then one kernel per rank.
                            if k == ACROSS_LENS.len() / 2 {
                                lane.split_kernels();
                            }
                        }
                    });
                }
            }
        });
    }
}

#[test]
fn ranks_that_cannot_all_join_all_go_without_the_lane() {
    if !gpu() {
        return;
    }
    // Rank 1 asks for another window size, then for a device that does not exist: both ranks
    // get the same refusal naming rank 1, and their link back.
    for (ordinal, capacity, says) in [
        (0, 2 << 20, "capacity"),
        (999, 1 << 20, "set up its window"),
    ] {
        let links = Threads::group(2);
        std::thread::scope(|s| {
            let joins: Vec<_> = links
                .iter()
                .map(|link| {
                    s.spawn(move || {
                        let (o, c) = if link.rank == 1 {
                            (ordinal, capacity)
                        } else {
                            (0, 1 << 20)
                        };
                        match DeviceLane::new(link, o, c) {
                            Ok(_) => panic!("rank {} set the lane up", link.rank),
                            Err(declined) => {
                                // The link still works for whatever comes next.
                                declined.link.barrier().expect("the link survives");
                                declined.error.to_string()
                            }
                        }
                    })
                })
                .collect();
            for j in joins {
                let e = j.join().expect("a rank panicked");
                assert!(e.contains("rank 1") && e.contains(says), "{e}");
            }
        });
    }
}

/// Ranks as processes: rank 0 accepts the others on a local TCP port; an all-gather goes through
/// rank 0. Every read and write has a timeout.
struct Tcp {
    rank: usize,
    size: usize,
    streams: Mutex<Vec<(usize, TcpStream)>>,
}

impl Tcp {
    fn connect(rank: usize, size: usize, port: u16) -> Tcp {
        let mut streams = Vec::new();
        if rank == 0 {
            let listener = TcpListener::bind(("127.0.0.1", port)).expect("rank 0 listens");
            for _ in 1..size {
                let (mut s, _) = listener.accept().expect("a rank connects");
                s.set_read_timeout(Some(WAIT)).unwrap();
                let mut r = [0u8; 8];
                s.read_exact(&mut r).unwrap();
                streams.push((u64::from_le_bytes(r) as usize, s));
            }
            streams.sort_by_key(|(r, _)| *r);
        } else {
            let deadline = Instant::now() + WAIT;
            let mut s = loop {
                match TcpStream::connect(("127.0.0.1", port)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() > deadline => panic!("rank {rank}: {e}"),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            s.set_read_timeout(Some(WAIT)).unwrap();
            s.write_all(&(rank as u64).to_le_bytes()).unwrap();
            streams.push((0, s));
        }
        Tcp {
            rank,
            size,
            streams: Mutex::new(streams),
        }
    }
}

fn send(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u64).to_le_bytes())?;
    s.write_all(b)
}

fn recv(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let mut b = vec![0u8; u64::from_le_bytes(len) as usize];
    s.read_exact(&mut b)?;
    Ok(b)
}

impl NodeLink for Tcp {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
        let mut streams = self.streams.lock().unwrap();
        if self.rank == 0 {
            let mut all = vec![mine];
            for (r, s) in streams.iter_mut() {
                all.push(recv(s).map_err(|e| format!("rank {r} left the link: {e}"))?);
            }
            let mut frame = Vec::new();
            for a in &all {
                frame.extend_from_slice(&(a.len() as u64).to_le_bytes());
                frame.extend_from_slice(a);
            }
            for (r, s) in streams.iter_mut() {
                send(s, &frame).map_err(|e| format!("rank {r} left the link: {e}"))?;
            }
            Ok(all)
        } else {
            let (_, s) = &mut streams[0];
            send(s, &mine).map_err(|e| format!("rank 0 left the link: {e}"))?;
            let frame = recv(s).map_err(|e| format!("rank 0 left the link: {e}"))?;
            let mut all = Vec::new();
            let mut at = 0;
            while at < frame.len() {
                let len = u64::from_le_bytes(frame[at..at + 8].try_into().unwrap()) as usize;
                all.push(frame[at + 8..at + 8 + len].to_vec());
                at += 8 + len;
            }
            Ok(all)
        }
    }
    fn barrier(&self) -> Result<(), String> {
        self.all_gather(Vec::new()).map(|_| ())
    }
}

const CHILD: &str = "BONFIRE_LANE_TEST_RANK";

/// Runs `test` in `n` child processes of this test binary (rank by environment), returning each
/// one's exit status and output.
fn processes(test: &str, n: usize, extra: &[(&str, &str)]) -> Vec<(bool, String)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut c = std::process::Command::new(std::env::current_exe().unwrap());
            c.args([test, "--exact", "--nocapture", "--test-threads", "1"])
                .env(CHILD, r.to_string())
                .env("BONFIRE_LANE_TEST_SIZE", n.to_string())
                .env("BONFIRE_LANE_TEST_PORT", port.to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            for (k, v) in extra {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            (out.status.success(), text)
        })
        .collect()
}

/// This process's rank, link size and port when it is a child of [`processes`].
fn as_child() -> Option<(usize, usize, u16)> {
    let var = |k: &str| std::env::var(k).ok()?.parse::<usize>().ok();
    Some((
        var(CHILD)?,
        var("BONFIRE_LANE_TEST_SIZE")?,
        var("BONFIRE_LANE_TEST_PORT")? as u16,
    ))
}

#[test]
fn lane_collectives_between_processes_match_the_reference() {
    if let Some((rank, size, port)) = as_child() {
        let link = Tcp::connect(rank, size, port);
        let mut lane = DeviceLane::new(&link, 0, CAPACITY).expect("the lane sets up");
        assert_eq!(
            lane.ipc_peers(),
            size - 1,
            "every peer's window crossed through IPC"
        );
        for seed in [11, 21] {
            check_all::<f32, _>(&lane, LENS, seed);
            check_all::<f16, _>(&lane, &LENS[..8], seed + 1);
            check_all::<bf16, _>(&lane, &LENS[..8], seed + 2);
            lane.split_kernels();
        }
        println!("rank {rank}: every collective matched the reference");
        return;
    }
    if !gpu() {
        return;
    }
    for (r, (ok, out)) in processes(
        "lane_collectives_between_processes_match_the_reference",
        2,
        &[],
    )
    .into_iter()
    .enumerate()
    {
        assert!(ok, "rank {r} failed:\n{out}");
        assert!(out.contains("matched the reference"), "rank {r}:\n{out}");
    }
}

#[test]
fn a_rank_that_dies_is_named_by_its_peer() {
    if let Some((rank, size, port)) = as_child() {
        let link = Tcp::connect(rank, size, port);
        let lane = DeviceLane::new(&link, 0, 1 << 20).expect("the lane sets up");
        lane.write(&vec![1.0f32; 1000]).unwrap();
        if rank == 1 {
            // Dies as kill -9 would: no destructor, no goodbye on the link.
            std::process::abort();
        }
        match lane.all_reduce::<f32>(1000, LaneOp::Sum) {
            Ok(()) => panic!("the all-reduce finished without rank 1"),
            Err(e) => println!("rank {rank}: {e}"),
        }
        return;
    }
    if !gpu() {
        return;
    }
    let outs = processes("a_rank_that_dies_is_named_by_its_peer", 2, &[]);
    let (ok, out) = &outs[0];
    assert!(ok, "rank 0 failed:\n{out}");
    assert!(
        out.contains("all-reduce of 4000 bytes on rank 0 of 2") && out.contains("rank 1 left"),
        "rank 0 did not name the collective, its size and the dead rank:\n{out}"
    );
    assert!(!outs[1].0, "rank 1 was meant to die");
}

/// A link whose rank kills its process (as kill -9 would) at its `n`th barrier once armed.
struct DiesAt<'a> {
    link: &'a Tcp,
    left: AtomicUsize,
}

impl NodeLink for DiesAt<'_> {
    fn rank(&self) -> usize {
        self.link.rank()
    }
    fn size(&self) -> usize {
        self.link.size()
    }
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
        self.link.all_gather(mine)
    }
    fn barrier(&self) -> Result<(), String> {
        if self.left.fetch_sub(1, Ordering::SeqCst) == 1 {
            std::process::abort();
        }
        self.link.barrier()
    }
}

#[test]
fn a_rank_that_dies_in_the_middle_of_a_collective_is_named_by_its_peer() {
    if let Some((rank, size, port)) = as_child() {
        let link = Tcp::connect(rank, size, port);
        let link = DiesAt {
            link: &link,
            left: AtomicUsize::new(usize::MAX),
        };
        let lane = DeviceLane::new(&link, 0, 1 << 20).expect("the lane sets up");
        lane.write(&vec![1.0f32; 1000]).unwrap();
        if rank == 1 {
            // Through the collective's first barrier (inputs written); dead at its second, while
            // rank 0's kernel reduces both windows.
            link.left.store(2, Ordering::SeqCst);
        }
        match lane.all_reduce::<f32>(1000, LaneOp::Sum) {
            Ok(()) => panic!("the all-reduce finished without rank 1"),
            Err(e) => println!("rank {rank}: {e}"),
        }
        // Closing the lane unmaps the dead rank's window too, and returns.
        drop(lane);
        println!("rank {rank}: lane closed");
        return;
    }
    if !gpu() {
        return;
    }
    let outs = processes(
        "a_rank_that_dies_in_the_middle_of_a_collective_is_named_by_its_peer",
        2,
        &[],
    );
    let (ok, out) = &outs[0];
    assert!(ok, "rank 0 failed:\n{out}");
    assert!(
        out.contains("all-reduce of 4000 bytes on rank 0 of 2")
            && out.contains("rank 1 left")
            && out.contains("lane closed"),
        "rank 0 did not name the collective, its size and the dead rank:\n{out}"
    );
    assert!(!outs[1].0, "rank 1 was meant to die");
}
