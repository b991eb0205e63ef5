//! The shared-memory lane: rings move every byte of frames of any size in order, a dead peer
//! ends every wait within a tick, and a job of ranks of one host sets the lanes up, unlinks its
//! segments, falls back or fails as configured, and delivers everything on shutdown.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bonfire_topology::Rank;
use bytes::Bytes;
use rand::{Rng, SeedableRng};

use super::link::{MAX_QUEUED_BYTES, OutLink, start_reader};
use super::ring::{Dest, Ring, RingStop, YIELDED};
use super::segment::Segment;
use super::sys::{Process, WAKES};
use super::{ShmConfig, TransportMode};
use crate::quic::tests::{config, master, secret, take};
use crate::{JobTransport, Lane, Mailbox, Tag, Transport};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bonfire-shm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn ring_pair(dir: &std::path::Path, capacity: usize) -> (Ring, Ring) {
    let path = dir.join("ring");
    let len = Ring::segment_len(capacity);
    let a = Arc::new(Segment::create(&path, len).unwrap());
    let producer = Ring::init(a, [1, 2]);
    let b = Arc::new(Segment::open(&path, len).unwrap());
    let consumer = Ring::attach(b, [1, 2]).unwrap();
    std::fs::remove_file(&path).unwrap();
    (producer, consumer)
}

fn me() -> Process {
    Process::watch(std::process::id()).unwrap()
}

/// Rank 0's lane to rank 1 (this process plays both), writing into `producer`.
fn link_to_1(producer: Ring, mailbox: &Arc<Mailbox>, stop: &Arc<AtomicBool>) -> OutLink {
    link_to_1_stalling(producer, mailbox, stop, Duration::from_secs(30))
}

/// As [`link_to_1`], its writer thread giving a queued frame `stall` to find room.
fn link_to_1_stalling(
    producer: Ring,
    mailbox: &Arc<Mailbox>,
    stop: &Arc<AtomicBool>,
    stall: Duration,
) -> OutLink {
    OutLink::start(
        Rank(0),
        Rank(1),
        producer,
        me(),
        mailbox.clone(),
        stop.clone(),
        stall,
    )
    .unwrap()
}

/// Rank 1's reader of the lane from rank 0 (this process plays both), reading `consumer`.
fn reader_from_0(
    consumer: Ring,
    mailbox: &Arc<Mailbox>,
    stop: &Arc<AtomicBool>,
) -> (Arc<super::link::InLink>, std::thread::JoinHandle<()>) {
    start_reader(
        Rank(1),
        Rank(0),
        consumer,
        me(),
        mailbox.clone(),
        stop.clone(),
        1 << 30,
    )
    .unwrap()
}

fn tag(step: u32) -> Tag {
    Tag {
        context: 0xc0ffee,
        seq: 3,
        step,
    }
}

#[test]
fn frames_of_any_size_cross_a_small_ring_intact_and_in_order() {
    let dir = temp_dir("frames");
    let (producer, consumer) = ring_pair(&dir, 4096);
    let mailbox = Arc::new(Mailbox::new());
    let stop = Arc::new(AtomicBool::new(false));
    let (inbound, reader) = reader_from_0(consumer, &mailbox, &stop);
    // A second thread takes whole frames out of the ring as a waiting collective does, racing
    // the reader thread: the two must never split a frame or reorder frames.
    let taking = Arc::new(AtomicBool::new(true));
    let taker = {
        let (inbound, taking) = (inbound.clone(), taking.clone());
        std::thread::spawn(move || {
            while taking.load(Ordering::Relaxed) {
                inbound.take_ready();
            }
        })
    };
    let link = link_to_1(producer, &mailbox, &stop);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    // Sizes around the ring's capacity and its quarter, empty frames, and odd lengths.
    let mut sizes = vec![
        0usize, 1, 31, 32, 1023, 1024, 1025, 4095, 4096, 4097, 100_003, 0,
    ];
    sizes.extend((0..40).map(|_| rng.random_range(0..20_000)));
    let frames: Vec<Bytes> = sizes
        .iter()
        .map(|&n| Bytes::from((0..n).map(|_| rng.random::<u8>()).collect::<Vec<u8>>()))
        .collect();
    let inbox = mailbox.open(tag(0).context, tag(0).seq).unwrap();
    // Half the frames are queued for the writer thread, half written by this thread straight
    // from its own memory (or queued behind the others when the writer is still busy).
    let deadline = Instant::now() + Duration::from_secs(30);
    for (i, f) in frames.iter().enumerate() {
        if i % 2 == 1
            && let Some(written) = link.send_from(tag(i as u32), f, deadline)
        {
            written.unwrap();
            continue;
        }
        link.send(tag(i as u32), f.clone()).unwrap();
    }
    assert!(link.finish(Duration::from_secs(10)));
    reader.join().unwrap();
    taking.store(false, Ordering::Relaxed);
    taker.join().unwrap();
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(inbox.take(Rank(0), i as u32).as_ref(), Some(f), "frame {i}");
    }
    assert_eq!(inbox.pending(), 0);
    assert!(
        mailbox.lost_reason(Rank(0)).is_none(),
        "a goodbye is not a loss"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_direct_write_nobody_reads_gives_up_at_its_deadline_and_ends_the_lane() {
    let dir = temp_dir("deadline");
    let (producer, _consumer) = ring_pair(&dir, 4096);
    let mailbox = Arc::new(Mailbox::new());
    let stop = Arc::new(AtomicBool::new(false));
    // The peer process is alive (this one) but never reads: only the deadline ends the wait.
    let link = link_to_1(producer, &mailbox, &stop);
    let started = Instant::now();
    let written = link.send_from(tag(0), &[5u8; 10_000], started + Duration::from_millis(150));
    let waited = started.elapsed();
    let Some(Err(crate::TransportError::PeerLost { peer, reason })) = written else {
        panic!("expected the write to give up, got {written:?}");
    };
    assert_eq!(peer, Rank(1));
    assert!(reason.contains("stayed full"), "{reason}");
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    assert!(
        mailbox.lost_reason(Rank(1)).is_some(),
        "the peer is reported lost"
    );
    // The ring holds part of a frame now: nothing more goes down this lane.
    assert!(matches!(
        link.send_from(tag(1), &[1u8], Instant::now() + Duration::from_secs(5)),
        Some(Err(_))
    ));
    assert!(link.send(tag(2), Bytes::from_static(b"x")).is_err());
    stop.store(true, std::sync::atomic::Ordering::Release);
    assert!(link.finish(Duration::from_secs(10)));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_dead_peer_ends_a_wait_within_a_tick() {
    let dir = temp_dir("dead");
    let (producer, consumer) = ring_pair(&dir, 4096);
    let stop = AtomicBool::new(false);
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let peer = Process::watch(child.id()).unwrap();
    // Fill the ring; nobody reads it.
    producer.write(&[&[7u8; 4096]], &peer, &stop).unwrap();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        child.kill().unwrap();
        child.wait().unwrap();
    });
    let t = Instant::now();
    assert_eq!(
        producer.write(&[&[1u8]], &peer, &stop),
        Err(RingStop::PeerExited)
    );
    let took = t.elapsed();
    assert!(took < Duration::from_secs(2), "took {took:?}");
    killer.join().unwrap();
    // The reader side: its producer is gone, after the bytes it wrote were read.
    let mut got = Vec::new();
    consumer
        .read(4096, &peer, &stop, Dest::Append(&mut got))
        .unwrap();
    assert_eq!(got, vec![7u8; 4096]);
    assert_eq!(
        consumer.read(1, &peer, &stop, Dest::Nowhere),
        Err(RingStop::PeerExited)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn shm_config(dir: &std::path::Path, mode: TransportMode) -> ShmConfig {
    ShmConfig {
        mode,
        dir: dir.to_path_buf(),
        tag: "test".into(),
        ring_bytes: 64 << 10,
        setup_timeout: Duration::from_secs(20),
        in_place: true,
    }
}

/// `world` ranks of this process, with `per_node` on each node.
async fn job(
    world: usize,
    per_node: u32,
    shm: &ShmConfig,
) -> Vec<Result<JobTransport, crate::JobTransportError>> {
    let m = master();
    let s = secret("shm");
    let handles: Vec<_> = (0..world as u32)
        .map(|r| {
            let mut c = config(r, world, &m, s.clone());
            c.node = r / per_node;
            let shm = shm.clone();
            tokio::spawn(async move { JobTransport::connect(c, &shm).await })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_of_one_node_talk_through_shared_memory_and_others_over_quic() {
    let dir = temp_dir("job");
    let ranks: Vec<JobTransport> = job(4, 2, &shm_config(&dir, TransportMode::Auto))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    use Lane::{Local, Quic, SharedMemory as Shm};
    assert_eq!(ranks[0].lanes(), [Local, Shm, Quic, Quic]);
    assert_eq!(ranks[3].lanes(), [Quic, Quic, Shm, Local]);
    assert_eq!(ranks[1].kind(), "quic+shm");
    assert!(ranks.iter().all(|r| r.fallback().is_none()));
    // Every segment was unlinked once both sides had mapped it.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // Every pair exchanges a frame; the last ones are sent just before shutting down.
    for (i, a) in ranks.iter().enumerate() {
        for j in 0..4 {
            let payload = Bytes::from(vec![i as u8; 100_000 + j]);
            let t = Tag {
                seq: i as u64,
                ..tag(0)
            };
            a.send(Rank(j as u32), t, payload).await.unwrap();
        }
    }
    for (j, b) in ranks.iter().enumerate() {
        for i in 0..4u32 {
            let got = take(
                b,
                i,
                Tag {
                    seq: u64::from(i),
                    ..tag(0)
                },
            )
            .await;
            assert_eq!(got.len(), 100_000 + j);
            assert!(got.iter().all(|&x| x == i as u8));
        }
    }
    for r in &ranks {
        r.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_usable_directory_auto_falls_back_and_shm_fails() {
    let missing = std::env::temp_dir().join(format!("bonfire-shm-none-{}", std::process::id()));
    let ranks: Vec<JobTransport> = job(2, 2, &shm_config(&missing, TransportMode::Auto))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(ranks[0].lanes(), [Lane::Local, Lane::Quic]);
    let why = ranks[0].fallback().expect("says why");
    assert!(
        why.contains("creating") && why.contains("bonfire-shm-none"),
        "{why}"
    );
    for r in &ranks {
        r.shutdown().await;
    }
    let errs: Vec<String> = job(2, 2, &shm_config(&missing, TransportMode::Shm))
        .await
        .into_iter()
        .map(|r| r.err().expect("shm was required").to_string())
        .collect();
    for e in &errs {
        assert!(e.contains("BONFIRE_TRANSPORT=shm"), "{e}");
    }
    let quic: Vec<JobTransport> = job(2, 2, &shm_config(&missing, TransportMode::Quic))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(quic[1].lanes(), [Lane::Quic, Lane::Local]);
    assert!(quic[1].fallback().is_none(), "quic was asked for");
    for r in &quic {
        r.shutdown().await;
    }
}

/// A rank that mapped its peer's ring must not write into it until the peer says it reads it:
/// here neither rank can watch the process that mapped its ring (as across pid namespaces), so
/// neither reads. Both keep QUIC to the other, say why, and every frame arrives. Before the
/// confirmation step each rank wrote into the ring its peer never read, and the frames were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_its_offerer_does_not_read_is_never_written() {
    let dir = temp_dir("hidden");
    let mut shm = shm_config(&dir, TransportMode::Auto);
    shm.tag = "testhidden".into();
    let ranks: Vec<JobTransport> = job(2, 2, &shm)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(ranks[0].lanes(), [Lane::Local, Lane::Quic]);
    assert_eq!(ranks[1].lanes(), [Lane::Quic, Lane::Local]);
    for r in &ranks {
        let why = r.fallback().expect("says why");
        assert!(
            why.contains("does not read the ring it offered") && why.contains("not visible"),
            "{why}"
        );
    }
    for (i, a) in ranks.iter().enumerate() {
        let t = Tag {
            seq: i as u64,
            ..tag(0)
        };
        a.send(Rank(1 - i as u32), t, Bytes::from(vec![i as u8; 100_000]))
            .await
            .unwrap();
    }
    for (j, b) in ranks.iter().enumerate() {
        let i = 1 - j as u32;
        let t = Tag {
            seq: u64::from(i),
            ..tag(0)
        };
        let got = tokio::time::timeout(Duration::from_secs(20), take(b, i, t))
            .await
            .expect("the frame arrives");
        assert!(got.len() == 100_000 && got.iter().all(|&x| u32::from(x) == i));
    }
    for r in &ranks {
        r.shutdown().await;
    }
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "no segment left"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A thread waiting for the next frame spins, then sleeps; it never yields. Where ranks share
/// cores, each yield handed a computing rank's core to a reader thread and back (64 per frame,
/// about 1 ms of a 5 ms step; BENCHMARKS.md, issue 30), and the rank stayed late for good.
#[test]
fn waiting_for_the_next_frame_sleeps_without_yielding() {
    let dir = temp_dir("no-yields");
    let (producer, consumer) = ring_pair(&dir, 4096);
    let stop = AtomicBool::new(false);
    let writer = std::thread::spawn(move || {
        let stop = AtomicBool::new(false);
        for round in 0..3u8 {
            std::thread::sleep(Duration::from_millis(20));
            producer.write(&[&[round; 16]], &me(), &stop).unwrap();
        }
        producer
    });
    for round in 0..3u8 {
        consumer.wait_data(&me(), &stop).unwrap();
        let mut got = Vec::new();
        consumer
            .read(16, &me(), &stop, Dest::Append(&mut got))
            .unwrap();
        assert_eq!(got, vec![round; 16]);
    }
    let _producer = writer.join().unwrap();
    assert_eq!(
        YIELDED.with(std::cell::Cell::get),
        0,
        "the consumer yielded while it waited for frames 20 ms apart"
    );
}

/// A frame goes into the ring in one publish per piece (a quarter of the ring at most), its
/// record and payload together, and a consumer asleep waiting for data is woken at most once,
/// however many publishes come before it runs. Each wake-up is a system call that cost the
/// writer 6-7 µs on this project's virtual machines when the sleeper's core was idle
/// (BENCHMARKS.md, "Where a small all-reduce's time goes"); before, a small frame was two
/// publishes and every publish until
/// the sleeper ran made one.
#[test]
fn a_frame_is_one_publish_per_piece_and_a_sleeper_is_woken_once() {
    let dir = temp_dir("publish");
    let (producer, consumer) = ring_pair(&dir, 4096);
    let consumer = Arc::new(consumer);
    let stop = AtomicBool::new(false);
    let (a, b, c) = ([1u8; 32], [2u8; 900], [3u8; 5]);
    let before = consumer.publishes();
    producer.write(&[&a, &b, &c], &me(), &stop).unwrap();
    assert_eq!(consumer.publishes() - before, 1, "a 937-byte frame");
    // More than a quarter of the ring goes in quarters (1,024 bytes), across the parts.
    let (d, e) = ([4u8; 32], (0..2968).map(|i| i as u8).collect::<Vec<u8>>());
    let before = consumer.publishes();
    producer.write(&[&d, &e], &me(), &stop).unwrap();
    assert_eq!(consumer.publishes() - before, 3, "a 3,000-byte frame");
    let mut got = Vec::new();
    consumer
        .read(937 + 3000, &me(), &stop, Dest::Append(&mut got))
        .unwrap();
    let want: Vec<u8> = [&a[..], &b, &c, &d, &e].concat();
    assert_eq!(got, want);

    // A consumer asleep for its next frame; 20 small frames come before it runs.
    let sleeper = {
        let consumer = consumer.clone();
        std::thread::spawn(move || consumer.wait_data(&me(), &AtomicBool::new(false)))
    };
    let t = Instant::now();
    while !consumer.consumer_asleep() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the consumer never slept"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let wakes = || WAKES.with(std::cell::Cell::get);
    let before = wakes();
    for i in 0..20u8 {
        producer.write(&[&[i; 32], &[i; 16]], &me(), &stop).unwrap();
    }
    // At most: the consumer also wakes every 20 ms tick to look, and if the first frame lands
    // while it is up between two sleeps, it finds the frames itself and no call is needed.
    assert!(
        wakes() - before <= 1,
        "{} wake-up calls for one sleeping consumer",
        wakes() - before
    );
    sleeper.join().unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer that is alive but takes nothing (stopped by SIGSTOP, or stuck) cannot hold a rank's
/// shutdown: the goodbye waits at most the given time. Before, the writer waited for the peer to
/// drain the ring as long as the peer lived, and the chaos campaign's stall trial hung.
#[test]
fn a_live_peer_that_takes_nothing_cannot_hold_the_goodbye() {
    let dir = temp_dir("goodbye");
    let (producer, _consumer) = ring_pair(&dir, 4096);
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let mailbox = Arc::new(Mailbox::new());
    let stop = Arc::new(AtomicBool::new(false));
    let link = OutLink::start(
        Rank(0),
        Rank(1),
        producer,
        Process::watch(child.id()).unwrap(),
        mailbox,
        stop.clone(),
        Duration::from_secs(30),
    )
    .unwrap();
    // More than the ring holds; nobody reads it.
    link.send(tag(0), Bytes::from(vec![3u8; 10_000])).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    let t = Instant::now();
    std::thread::spawn(move || {
        let _ = done.send(link.finish(Duration::from_millis(300)));
    });
    let drained = finished
        .recv_timeout(Duration::from_secs(10))
        .expect("the goodbye still waits for a peer that takes nothing");
    let took = t.elapsed();
    assert!(
        !drained,
        "the peer took nothing, yet the lane reports drained"
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(stop.load(Ordering::Acquire), "the writer was told to stop");
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Counters no ring holds (more taken than written, or more written than the ring's room), as
/// a damaged or foreign segment has: every side of the ring says so instead of subtracting past
/// zero (a panic of the reader thread in a debug build, leaving receives to hang; garbage frames
/// in a release build), and the reader thread ends the lane, reporting the peer lost with why.
#[test]
fn damaged_ring_counters_end_the_lane_naming_the_peer() {
    let dir = temp_dir("damaged");
    let (producer, consumer) = ring_pair(&dir, 4096);
    let stop = AtomicBool::new(false);
    producer.write(&[&[5u8; 100]], &me(), &stop).unwrap();
    for (head, tail) in [(50, 100), (100 + 4097, 100)] {
        consumer.damage(head, tail);
        let corrupt = RingStop::Corrupt { head, tail };
        assert_eq!(consumer.available(), Err(corrupt.clone()));
        assert_eq!(
            consumer.read(1, &me(), &stop, Dest::Nowhere),
            Err(corrupt.clone())
        );
        assert_eq!(producer.write(&[&[1u8; 8]], &me(), &stop), Err(corrupt));
        assert_eq!(producer.room(), 0);
    }

    let (producer, consumer) = ring_pair(&dir, 4096);
    let mailbox = Arc::new(Mailbox::new());
    let stop = Arc::new(AtomicBool::new(false));
    let (_inbound, reader) = reader_from_0(consumer, &mailbox, &stop);
    // The producer's side of the mapping, damaged: more published than the ring has room for.
    producer.damage(1 << 40, 0);
    reader.join().unwrap();
    let why = mailbox
        .lost_reason(Rank(0))
        .expect("the peer is reported lost");
    assert!(
        why.contains("its shared-memory ring is damaged (bytes written 1099511627776, taken 0"),
        "{why}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A setup that fails after offering its rings (here each rank looks for its peer's segment in
/// a directory of its own, so neither can map the other's, and shared memory is required)
/// leaves no segment file behind: each rank's offered ring was left in the directory before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_setup_leaves_no_segment_behind() {
    let dirs = [temp_dir("left-0"), temp_dir("left-1")];
    let m = master();
    let s = secret("shm");
    let handles: Vec<_> = (0..2u32)
        .map(|r| {
            let c = config(r, 2, &m, s.clone());
            let shm = shm_config(&dirs[r as usize], TransportMode::Shm);
            tokio::spawn(async move { JobTransport::connect(c, &shm).await })
        })
        .collect();
    for h in handles {
        let e = h
            .await
            .unwrap()
            .err()
            .expect("shared memory was required")
            .to_string();
        assert!(e.contains("BONFIRE_TRANSPORT=shm"), "{e}");
    }
    for dir in &dirs {
        let left: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{} holds {left:?}", dir.display());
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A queued frame (one the writer thread copies) to a live peer that takes nothing: the writer
/// gives it the stall limit (the peer timeout, in a job) to find room, then ends the lane and
/// reports the peer lost; it waited for as long as the peer stayed alive before.
#[test]
fn a_queued_frame_nobody_reads_ends_the_lane_after_the_stall_limit() {
    let dir = temp_dir("stall");
    let (producer, _consumer) = ring_pair(&dir, 4096);
    let mailbox = Arc::new(Mailbox::new());
    let stop = Arc::new(AtomicBool::new(false));
    let link = link_to_1_stalling(producer, &mailbox, &stop, Duration::from_millis(300));
    let started = Instant::now();
    // Larger than the ring: queued for the writer thread, which fills the ring and waits.
    link.send(tag(0), Bytes::from(vec![5u8; 10_000])).unwrap();
    let reason = loop {
        if let Some(reason) = mailbox.lost_reason(Rank(1)) {
            break reason;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the writer is still waiting for a peer that takes nothing"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(reason.contains("stayed full"), "{reason}");
    assert!(link.send(tag(1), Bytes::from_static(b"x")).is_err());
    assert!(link.finish(Duration::from_secs(10)));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer that reads nothing for a while holds its sender back once [`MAX_QUEUED_BYTES`] are
/// queued: the queue stops growing just past it (it grew with every send before, however long
/// the peer took), and every frame arrives, in order, once the peer reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_reads_nothing_holds_the_sender_back_at_the_queue_bound() {
    let dir = temp_dir("backlog");
    let (producer, consumer) = ring_pair(&dir, 1 << 20);
    let mailbox = Arc::new(Mailbox::new());
    let stop = Arc::new(AtomicBool::new(false));
    let link = Arc::new(link_to_1(producer, &mailbox, &stop));
    let frame = Bytes::from(
        (0..1u32 << 20)
            .map(|i| (i % 253) as u8)
            .collect::<Vec<u8>>(),
    );
    let frames = MAX_QUEUED_BYTES / frame.len() + 16;
    let sender = {
        let (link, frame) = (link.clone(), frame.clone());
        tokio::spawn(async move {
            for i in 0..frames {
                link.queue(tag(i as u32), frame.clone()).await.unwrap();
            }
        })
    };
    // Nobody reads yet: the sender stops one frame past the bound.
    let mut held = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = link.queued_bytes();
        if now == held && now > MAX_QUEUED_BYTES {
            break;
        }
        held = now;
    }
    assert!(
        !sender.is_finished(),
        "every frame was queued for a peer that reads nothing"
    );
    assert!(
        held > MAX_QUEUED_BYTES && held <= MAX_QUEUED_BYTES + frame.len(),
        "{held} bytes queued (bound {MAX_QUEUED_BYTES})"
    );
    // The peer reads: the sender goes on, and everything arrives.
    let (_inbound, reader) = reader_from_0(consumer, &mailbox, &stop);
    tokio::time::timeout(Duration::from_secs(60), sender)
        .await
        .expect("the sender was not released once the peer read")
        .unwrap();
    let finishing = link.clone();
    assert!(
        tokio::task::spawn_blocking(move || finishing.finish(Duration::from_secs(30)))
            .await
            .unwrap()
    );
    reader.join().unwrap();
    let inbox = mailbox.open(tag(0).context, tag(0).seq).unwrap();
    for i in 0..frames {
        assert_eq!(
            inbox.take(Rank(0), i as u32).as_ref(),
            Some(&frame),
            "frame {i}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a rank killed while setting up leaves is removed by the next setup on the host, tag or
/// no tag: a segment of a process that is gone, old enough. Segments of live processes, recent
/// ones, other users' names and other files stay.
#[test]
fn a_dead_ranks_old_segments_are_removed_at_the_next_setup() {
    let dir = temp_dir("orphans");
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let live = std::process::id();
    let random = "0123456789abcdef0123456789abcdef";
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);
    let make = |name: &str, aged: bool| {
        let f = std::fs::File::create(dir.join(name)).unwrap();
        if aged {
            f.set_modified(old).unwrap();
        }
    };
    let orphan = format!("bonfire-job-p{dead}-{random}");
    make(&orphan, true);
    let orphan2 = format!("bonfire-1f2e3d-p{dead}-{random}");
    make(&orphan2, true);
    let kept = [
        (format!("bonfire-job-p{live}-{random}"), true),
        (format!("bonfire-job-p{dead}-{random}a"), true),
        (format!("bonfire-job-{random}"), true),
        (format!("other-job-p{dead}-{random}"), true),
        (format!("bonfire-job-p{dead}-{}", &random[..31]), true),
    ];
    for (name, aged) in &kept {
        make(name, *aged);
    }
    let recent = format!("bonfire-job-p{dead}-{}", random.replace('0', "f"));
    make(&recent, false);
    assert_eq!(super::remove_orphans(&dir, super::ORPHAN_AGE), 2);
    assert!(!dir.join(&orphan).exists() && !dir.join(&orphan2).exists());
    for (name, _) in &kept {
        assert!(dir.join(name).exists(), "{name} was removed");
    }
    assert!(dir.join(&recent).exists(), "a recent segment was removed");
    assert_eq!(super::remove_orphans(&dir, super::ORPHAN_AGE), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A sink that records every piece it is given.
#[derive(Default)]
struct Recording {
    len: usize,
    pieces: std::sync::Mutex<Vec<(usize, Vec<u8>)>>,
}

impl crate::Sink for Recording {
    fn len(&self) -> usize {
        self.len
    }

    fn take(&self, at: usize, piece: &[u8]) {
        self.pieces.lock().unwrap().push((at, piece.to_vec()));
    }
}

/// Rank 0's lane to rank 1 through a 16 KiB ring, far smaller than the frames the sink tests
/// send (this process plays both ranks): the writer's end, rank 1's reader thread, and rank 1's
/// inbox for the collective of [`tag`].
struct SinkLane {
    dir: PathBuf,
    mailbox: Arc<Mailbox>,
    inbound: Arc<super::link::InLink>,
    reader: std::thread::JoinHandle<()>,
    link: OutLink,
    inbox: crate::Inbox,
}

fn sink_lane(name: &str) -> SinkLane {
    let dir = temp_dir(name);
    let (producer, consumer) = ring_pair(&dir, 16 << 10);
    let mailbox = Arc::new(Mailbox::new());
    let stop = Arc::new(AtomicBool::new(false));
    let (inbound, reader) = reader_from_0(consumer, &mailbox, &stop);
    let link = link_to_1(producer, &mailbox, &stop);
    let inbox = mailbox.open(tag(0).context, tag(0).seq).unwrap();
    SinkLane {
        dir,
        mailbox,
        inbound,
        reader,
        link,
        inbox,
    }
}

#[test]
fn an_expected_frame_goes_straight_into_its_sink_and_the_others_are_filed() {
    // The frames stream through the small ring while being taken.
    let SinkLane {
        dir,
        inbound,
        reader,
        link,
        inbox,
        ..
    } = sink_lane("sink");
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let mut frame = |n: usize| Bytes::from((0..n).map(|_| rng.random::<u8>()).collect::<Vec<u8>>());
    let (big, other, wrong, late) = (frame(200_003), frame(70_000), frame(1000), frame(65_536));

    let sink = |len| {
        Arc::new(Recording {
            len,
            ..Recording::default()
        })
    };
    // Frame 1 is expected; frame 0, ahead of it in the ring, is not (it is copied out, and
    // does not hold frame 1 back); frame 2 is expected with another length (filed as usual);
    // frame 3's sink is withdrawn before it comes (filed as usual).
    let (s1, s2, s3) = (sink(big.len()), sink(7), sink(late.len()));
    let e1 = inbound.expect(tag(1), s1.clone());
    let e2 = inbound.expect(tag(2), s2.clone());
    drop(inbound.expect(tag(3), s3.clone()));
    link.send(tag(0), other.clone()).unwrap();
    link.send(tag(1), big.clone()).unwrap();
    link.send(tag(2), wrong.clone()).unwrap();
    link.send(tag(3), late.clone()).unwrap();
    assert!(link.finish(Duration::from_secs(10)));
    reader.join().unwrap();

    assert_eq!(inbox.take(Rank(0), 0), Some(other));
    // The expected frame's marker is empty; its bytes are in the sink, in pieces of 64 KiB.
    assert_eq!(inbox.take(Rank(0), 1), Some(Bytes::new()));
    assert!(e1.filled());
    let pieces = s1.pieces.lock().unwrap().clone();
    let starts: Vec<usize> = pieces.iter().map(|(at, _)| *at).collect();
    assert_eq!(starts, [0, 65_536, 131_072, 196_608]);
    let joined: Vec<u8> = pieces.into_iter().flat_map(|(_, p)| p).collect();
    assert_eq!(joined, big);
    assert_eq!(inbound.received_in_place(), big.len() as u64);
    // The others were filed as frames of their own, and their sinks got nothing.
    assert_eq!(inbox.take(Rank(0), 2), Some(wrong));
    assert!(!e2.filled());
    assert_eq!(inbox.take(Rank(0), 3), Some(late));
    assert!(s2.pieces.lock().unwrap().is_empty() && s3.pieces.lock().unwrap().is_empty());
    assert_eq!(inbox.pending(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_sink_withdrawn_while_its_frame_streams_in_gets_nothing_more() {
    use super::link::{KIND_DATA, KIND_GOODBYE, record};
    let dir = temp_dir("sink-withdrawn");
    let (producer, consumer) = ring_pair(&dir, 16 << 10);
    let mailbox = Arc::new(Mailbox::new());
    let stop = Arc::new(AtomicBool::new(false));
    let (inbound, reader) = reader_from_0(consumer, &mailbox, &stop);
    let inbox = mailbox.open(tag(0).context, tag(0).seq).unwrap();
    let len = 1 << 20;
    let sink = Arc::new(Recording {
        len,
        ..Recording::default()
    });
    let expected = inbound.expect(tag(0), sink.clone());
    // The frame's first three pieces and a little more, written as a writer thread would.
    let payload = vec![7u8; len];
    let first = 3 * (64 << 10) + 100;
    let head = record(KIND_DATA, tag(0), len as u64);
    producer
        .write(&[&head, &payload[..first]], &me(), &stop)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sink.pieces.lock().unwrap().len() < 3 {
        assert!(Instant::now() < deadline, "the sink never got its pieces");
        std::thread::yield_now();
    }
    drop(expected);
    // Once withdrawn, it is never called again: the rest is taken off the ring and dropped, and
    // the lane carries on.
    let bye = record(KIND_GOODBYE, tag(0), 0);
    producer
        .write(&[&payload[first..], &bye], &me(), &stop)
        .unwrap();
    reader.join().unwrap();
    assert_eq!(sink.pieces.lock().unwrap().len(), 3);
    assert_eq!(inbox.take(Rank(0), 0), Some(Bytes::new()));
    assert_eq!(inbound.received_in_place(), 0);
    assert!(mailbox.lost_reason(Rank(0)).is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A sink whose every piece panics, as a faulty reducer would.
struct Panicking(usize);

impl crate::Sink for Panicking {
    fn len(&self) -> usize {
        self.0
    }

    fn take(&self, _at: usize, _piece: &[u8]) {
        panic!("a faulty reducer");
    }
}

#[test]
fn a_sink_that_panics_loses_its_frame_and_the_lane_carries_on() {
    let SinkLane {
        dir,
        mailbox,
        inbound,
        reader,
        link,
        inbox,
    } = sink_lane("sink-panics");
    let expected = inbound.expect(tag(0), Arc::new(Panicking(200_000)));
    link.send(tag(0), Bytes::from(vec![1u8; 200_000])).unwrap();
    link.send(tag(1), Bytes::from(vec![2u8; 300])).unwrap();
    assert!(link.finish(Duration::from_secs(10)));
    // The reader thread survived the panic and stayed in step: the next frame is intact.
    reader.join().unwrap();
    assert_eq!(inbox.take(Rank(0), 0), Some(Bytes::new()));
    assert!(!expected.filled());
    assert_eq!(inbox.take(Rank(0), 1), Some(Bytes::from(vec![2u8; 300])));
    assert!(mailbox.lost_reason(Rank(0)).is_none());
    assert_eq!(inbound.received_in_place(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
