//! Frames received straight into the working buffer: over shared memory a large frame that a
//! collective expects is combined into (or copied over) its range as it comes off the ring, with
//! no frame of its own. Every collective and algorithm still matches the oracle bit for bit, and
//! the frames really went in place.

use std::sync::Arc;
use std::time::Duration;

use bonfire_collectives::{CommConfig, Communicator};
use bonfire_testkit::{calls, run_ranks};
use bonfire_topology::{Rank, ReduceOp};
use bonfire_transport::shm::{ShmConfig, TransportMode};
use bonfire_transport::{JobTransport, QuicConfig, Secret};
use half::bf16;

const DEADLINE: Duration = Duration::from_secs(300);

/// `n` ranks of this process on one node, with shared-memory lanes between every pair
/// (receiving large expected frames in place, or not).
fn shm_world(
    n: usize,
    name: &str,
    config: CommConfig,
    in_place: bool,
) -> (Vec<Communicator>, Vec<Arc<JobTransport>>) {
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master = format!("127.0.0.1:{port}");
    let secret = Secret::new(b"in-place-test-secret-0123456789").unwrap();
    let dir = std::env::temp_dir().join(format!("bonfire-in-place-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shm = ShmConfig {
        mode: TransportMode::Shm,
        dir,
        tag: "inplace".into(),
        ring_bytes: 1 << 20,
        setup_timeout: Duration::from_secs(30),
        in_place,
    };
    let runtime = bonfire_collectives::runtime();
    let transports: Vec<Arc<JobTransport>> = runtime.block_on(async {
        let handles: Vec<_> = (0..n as u32)
            .map(|r| {
                let mut c = QuicConfig::new(Some(Rank(r)), n, &master, secret.clone());
                c.bind = "127.0.0.1:0".parse().unwrap();
                c.connect_timeout = Duration::from_secs(30);
                let shm = shm.clone();
                tokio::spawn(async move { JobTransport::connect(c, &shm).await })
            })
            .collect();
        let mut out = Vec::new();
        for h in handles {
            out.push(Arc::new(h.await.unwrap().unwrap()));
        }
        out
    });
    let comms = transports
        .iter()
        .map(|t| {
            Communicator::builder(t.clone())
                .config(config.clone())
                .build()
                .unwrap()
        })
        .collect();
    (comms, transports)
}

fn shut_down(transports: Vec<Arc<JobTransport>>) {
    bonfire_collectives::runtime().block_on(async {
        for t in &transports {
            t.shutdown().await;
        }
    });
}

#[test]
fn every_collective_and_algorithm_is_exact_with_frames_received_in_place() {
    // Pieces of 256 KiB: every large segment crosses in several frames, each expected.
    let config = CommConfig {
        chunk_bytes: 256 << 10,
        ..CommConfig::default()
    };
    let (comms, transports) = shm_world(3, "every", config, true);
    run_ranks(comms, DEADLINE, |comm| {
        calls::every_call_of::<f32>(&comm, 1, &[70_001]);
        calls::every_call_of::<bf16>(&comm, 2, &[150_001]);
        calls::every_call_of::<i64>(&comm, 3, &[40_001]);
    });
    let in_place: Vec<u64> = transports.iter().map(|t| t.received_in_place()).collect();
    assert!(
        in_place.iter().all(|&b| b > 0),
        "bytes received in place per rank: {in_place:?}"
    );
    shut_down(transports);
}

/// Two ranks, rank 1 coming 200 ms late to each of `calls` all-reduces of `count` floats:
/// every rank's sums, and the bytes rank 0 received in place.
fn late_peer_sums(calls: usize, count: usize, in_place: bool) -> (Vec<Vec<Vec<f32>>>, u64) {
    let name = if in_place { "late" } else { "late-copied" };
    let (comms, transports) = shm_world(2, name, CommConfig::default(), in_place);
    let sums = run_ranks(comms, DEADLINE, move |comm| {
        let me = comm.rank();
        (0..calls)
            .map(|k| {
                // Rank 0 expects every frame of the reduce-scatter before any of them is sent.
                comm.barrier().wait().unwrap();
                if me == 1 {
                    std::thread::sleep(Duration::from_millis(200));
                }
                let input: Vec<f32> = (0..count)
                    .map(|i| ((i * 7 + me * 3 + k) % 1000) as f32 * 0.25)
                    .collect();
                comm.all_reduce(input, ReduceOp::Sum).wait().unwrap()
            })
            .collect::<Vec<_>>()
    });
    let got = transports[0].received_in_place();
    shut_down(transports);
    (sums, got)
}

#[test]
fn a_rank_waiting_for_its_peer_reduces_every_frame_in_place() {
    let (count, calls) = (1 << 20, 3);
    let (sums, got) = late_peer_sums(calls, count, true);
    for (k, (a, b)) in sums[0].iter().zip(&sums[1]).enumerate() {
        let want: Vec<f32> = (0..count)
            .map(|i| {
                let x = |me: usize| ((i * 7 + me * 3 + k) % 1000) as f32 * 0.25;
                x(1) + x(0)
            })
            .collect();
        assert!(a == &want && b == &want, "call {k}: a wrong sum");
    }
    // Half of each all-reduce comes back to rank 0 in the reduce-scatter: at least that much
    // went straight into its buffer.
    let half = (calls * count * 4 / 2) as u64;
    assert!(
        got >= half,
        "rank 0 received {got} bytes in place, expected at least {half}"
    );
    // Turned off, nothing goes in place, and the sums are the same bits.
    let (copied, none) = late_peer_sums(calls, count, false);
    assert_eq!(none, 0);
    assert!(
        copied == sums,
        "the sums differ with BONFIRE_SHM_IN_PLACE=0"
    );
}
