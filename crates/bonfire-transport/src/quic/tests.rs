//! Ranks of one process on 127.0.0.1, over real UDP sockets: the job forms, frames flow,
//! strangers are refused, and a hostile frame is an error that names its sender.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bonfire_topology::{NodeId, Rank};
use bytes::Bytes;

use super::auth::Identity;
use super::auth::ROLE_CLIENT;
use super::control::{self, Control, JobKey, PROTOCOL};
use super::endpoint::{endpoint, exporter};
use super::frame::FrameHeader;
use super::{Congestion, QuicConfig, QuicTransport, Secret};
use crate::{Tag, Transport};

pub(crate) fn secret(s: &str) -> Secret {
    Secret::new(format!("test-secret-{s}-0123456789").as_bytes()).unwrap()
}

pub(crate) fn master() -> String {
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

pub(crate) fn config(rank: u32, world: usize, master: &str, secret: Secret) -> QuicConfig {
    let mut c = QuicConfig::new(Some(Rank(rank)), world, master, secret);
    c.bind = "127.0.0.1:0".parse().unwrap();
    c.node = rank / 2;
    c.connect_timeout = Duration::from_secs(20);
    c
}

async fn job(world: usize) -> Vec<QuicTransport> {
    job_with(world, Congestion::default()).await
}

async fn job_with(world: usize, congestion: Congestion) -> Vec<QuicTransport> {
    let m = master();
    let s = secret("job");
    let handles: Vec<_> = (0..world as u32)
        .map(|r| {
            let mut c = config(r, world, &m, s.clone());
            c.congestion = congestion;
            tokio::spawn(QuicTransport::connect(c))
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap().unwrap());
    }
    out
}

/// The frame `tag` from rank `from`, within 20 s; panics with the reason if `from` was lost.
pub(crate) async fn take(t: &impl Transport, from: u32, tag: Tag) -> Bytes {
    let inbox = t.mailbox().open(tag.context, tag.seq).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let changed = inbox.changed();
        if let Some(b) = inbox.take(Rank(from), tag.step) {
            return b;
        }
        if let Some(why) = inbox.lost(Rank(from)) {
            panic!("rank {from} lost: {why}");
        }
        tokio::time::timeout_at(deadline, changed)
            .await
            .expect("frame did not arrive");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_forms_and_every_pair_exchanges_frames() {
    for congestion in [Congestion::Cubic, Congestion::NewReno, Congestion::Bbr] {
        every_pair_exchanges_frames(congestion).await;
    }
}

async fn every_pair_exchanges_frames(congestion: Congestion) {
    let ranks = job_with(3, congestion).await;
    for t in &ranks {
        assert_eq!(t.nodes().node_of(Rank(2)), NodeId(1));
    }
    let big: Bytes = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    for (i, t) in ranks.iter().enumerate() {
        for j in 0..3u32 {
            let payload = if j as usize == (i + 1) % 3 {
                big.clone()
            } else {
                Bytes::from(format!("{i}->{j}"))
            };
            let tag = Tag {
                context: 9,
                seq: i as u64,
                step: j,
            };
            t.send(Rank(j), tag, payload).await.unwrap();
        }
    }
    for (j, t) in ranks.iter().enumerate() {
        for i in 0..3u32 {
            let tag = Tag {
                context: 9,
                seq: i as u64,
                step: j as u32,
            };
            let got = take(t, i, tag).await;
            if j == (i as usize + 1) % 3 {
                assert_eq!(got, big);
            } else {
                assert_eq!(got, format!("{i}->{j}").as_bytes());
            }
        }
    }
    for t in &ranks {
        t.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_refused_on_both_sides() {
    let m = master();
    let mut c0 = config(0, 2, &m, secret("right"));
    // Rank 1 dials again after each unproven refusal until its own timeout, and reports the
    // last answer: rank 0 must still be there to give it. With equal timeouts rank 0 could go
    // first, and rank 1's last dial then found nobody ("did not answer within 0.48 s", seen
    // on every run on a fresh machine). Rank 0 waits its whole timeout for a rank 1 that never
    // joins.
    c0.connect_timeout = Duration::from_secs(8);
    let host = tokio::spawn(QuicTransport::connect(c0));
    let mut c1 = config(1, 2, &m, secret("wrong"));
    c1.connect_timeout = Duration::from_secs(4);
    let err = QuicTransport::connect(c1)
        .await
        .err()
        .expect("must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("refused rank 1") && msg.contains("wrong job secret"),
        "{msg}"
    );
    let err = host
        .await
        .unwrap()
        .err()
        .expect("rank 0 must not form a job");
    let msg = err.to_string();
    assert!(
        msg.contains("timed out") && msg.contains("missing: ranks 1"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_and_garbage_do_not_stop_the_job() {
    let m = master();
    let s = secret("job");
    let host = tokio::spawn(QuicTransport::connect(config(0, 2, &m, s.clone())));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let addr: SocketAddr = m.parse().unwrap();
    // Random datagrams, and one shaped like a QUIC Initial.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for i in 0..50u8 {
        let junk: Vec<u8> = (0..1200u32)
            .map(|k| (k as u8).wrapping_mul(i | 1))
            .collect();
        udp.send_to(&junk, addr).unwrap();
    }
    let mut initial = vec![0xc3, 0, 0, 0, 1, 8];
    initial.resize(1200, 0xab);
    udp.send_to(&initial, addr).unwrap();
    // TLS-complete strangers: one sends garbage, one announces a huge message, one a hello
    // without the secret.
    let stranger = endpoint(
        "127.0.0.1:0".parse().unwrap(),
        &Identity::generate().unwrap(),
        Duration::from_secs(5),
        1,
    )
    .unwrap();
    for body in [
        vec![3, 0, 0, 0, 0xff, 0xff, 0xff],
        vec![0xff, 0xff, 0xff, 0x7f],
        control::encode(&Control::Hello {
            protocol: PROTOCOL,
            job: JobKey {
                world_size: 2,
                round: 0,
            },
            rank: Some(1),
            node: 0,
            port: 1,
            advertise: None,
            proof: [0; 32],
        }),
    ] {
        let conn = stranger.connect(addr, "bonfire").unwrap().await.unwrap();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        send.write_all(&body).await.unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(5), control::read(&mut recv)).await;
        assert!(
            matches!(reply, Ok(Ok(Control::Reject { .. })) | Ok(Err(_))),
            "a stranger must be refused: {reply:?}"
        );
    }
    // The real rank 1 still joins.
    let worker = QuicTransport::connect(config(1, 2, &m, s)).await.unwrap();
    let host = host.await.unwrap().unwrap();
    exchange(&worker, &host, Bytes::from_static(b"hi")).await;
}

/// Rank 0 of a job of two, starting at `m` (its rendezvous up), the address, and the endpoint of
/// a stranger: its own certificate, and no secret.
async fn host_and_stranger(
    m: &str,
    s: &Secret,
) -> (
    tokio::task::JoinHandle<Result<QuicTransport, super::QuicError>>,
    SocketAddr,
    quinn::Endpoint,
) {
    let host = tokio::spawn(QuicTransport::connect(config(0, 2, m, s.clone())));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stranger = endpoint(
        "127.0.0.1:0".parse().unwrap(),
        &Identity::generate().unwrap(),
        Duration::from_secs(5),
        1,
    )
    .unwrap();
    (host, m.parse().unwrap(), stranger)
}

/// Rank 1 joins the job of [`host_and_stranger`] and sends rank 0 `payload`, which arrives
/// whole; both shut down.
async fn worker_reaches_host(
    m: &str,
    s: Secret,
    host: tokio::task::JoinHandle<Result<QuicTransport, super::QuicError>>,
    payload: Bytes,
) {
    let worker = QuicTransport::connect(config(1, 2, m, s)).await.unwrap();
    let host = host.await.unwrap().unwrap();
    exchange(&worker, &host, payload).await;
}

/// Rank 1 (`worker`) sends rank 0 (`host`) `payload`, which arrives whole; both shut down.
async fn exchange(worker: &QuicTransport, host: &QuicTransport, payload: Bytes) {
    let tag = Tag {
        context: 1,
        seq: 2,
        step: 3,
    };
    worker.send(Rank(0), tag, payload.clone()).await.unwrap();
    assert_eq!(take(host, 1, tag).await, payload);
    worker.shutdown().await;
    host.shutdown().await;
}

/// A hello whose proof of the secret is genuine but was made for another connection (what a
/// replayed handshake carries) is refused, and so is a flood of connections that never say
/// anything; the real rank still joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_proof_and_a_flood_are_refused() {
    let m = master();
    let s = secret("job");
    let (host, addr, stranger) = host_and_stranger(&m, &s).await;
    // The proof of a first connection, sent on a second one.
    let first = stranger.connect(addr, "bonfire").unwrap().await.unwrap();
    let recorded = s.proof(ROLE_CLIENT, &exporter(&first).unwrap());
    let hello = |proof| {
        control::encode(&Control::Hello {
            protocol: PROTOCOL,
            job: JobKey {
                world_size: 2,
                round: 0,
            },
            rank: Some(1),
            node: 0,
            port: 1,
            advertise: None,
            proof,
        })
    };
    let second = stranger.connect(addr, "bonfire").unwrap().await.unwrap();
    let (mut send, mut recv) = second.open_bi().await.unwrap();
    send.write_all(&hello(recorded)).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(5), control::read(&mut recv)).await;
    assert!(
        matches!(reply, Ok(Ok(Control::Reject { .. })) | Ok(Err(_))),
        "a replayed proof must be refused: {reply:?}"
    );
    // Sanity: the same secret's proof for this very connection would have been a valid one.
    assert_ne!(recorded, s.proof(ROLE_CLIENT, &exporter(&second).unwrap()));
    // A flood: 64 connections that open and say nothing.
    let mut idle = Vec::new();
    for _ in 0..64 {
        if let Ok(connecting) = stranger.connect(addr, "bonfire")
            && let Ok(Ok(conn)) = tokio::time::timeout(Duration::from_secs(5), connecting).await
        {
            idle.push(conn);
        }
    }
    worker_reaches_host(&m, s, host, Bytes::from_static(b"hi")).await;
    drop(idle);
}

/// Before its proof, a connection's first message may be a hello's size only: a length prefix
/// announcing more (up to the 16 MiB any control message could have) is refused without a byte
/// of it read, and a stranger's connection cannot have more than the small pre-proof window in
/// flight; the real rank then joins and its link carries a frame larger than that window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_make_a_rank_read_more_than_a_hello() {
    let m = master();
    let s = secret("job");
    let (host, addr, stranger) = host_and_stranger(&m, &s).await;
    let conn = stranger.connect(addr, "bonfire").unwrap().await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let announced = (control::MAX_HELLO + 1) as u32;
    send.write_all(&announced.to_le_bytes()).await.unwrap();
    // Streams the rank never reads: whatever it buffers is bounded by the pre-proof window.
    let mut stuffed = 0usize;
    let stuffing = async {
        let mut uni = conn.open_uni().await.unwrap();
        let chunk = vec![0u8; 64 << 10];
        while uni.write_all(&chunk).await.is_ok() {
            stuffed += chunk.len();
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), stuffing).await;
    assert!(
        stuffed <= super::endpoint::PRE_PROOF_WINDOW as usize,
        "{stuffed} bytes were taken in before any proof"
    );
    let reply = tokio::time::timeout(Duration::from_secs(5), control::read(&mut recv))
        .await
        .unwrap();
    match reply {
        Ok(Control::Reject { reason, .. }) => assert!(
            reason.contains(&format!(
                "control message of {announced} bytes exceeds the limit of 4096 bytes"
            )),
            "{reason}"
        ),
        other => panic!("an oversized first message was not refused: {other:?}"),
    }
    worker_reaches_host(&m, s, host, Bytes::from(vec![7u8; 4 << 20])).await;
}

/// Whatever answers at the master address first, without the job secret, cannot end a worker's
/// join: a refusal it cannot seal and a welcome whose proof is wrong are passed over, the worker
/// dials again, and it joins the real rank 0 that comes up at the address afterwards. (Before,
/// the first unauthenticated refusal ended the worker's join for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_answering_at_the_master_address_cannot_stop_a_join() {
    let m = master();
    let s = secret("job");
    let addr: SocketAddr = m.parse().unwrap();
    let impostor = endpoint(
        addr,
        &Identity::generate().unwrap(),
        Duration::from_secs(5),
        1,
    )
    .unwrap();
    let worker = tokio::spawn(QuicTransport::connect(config(1, 2, &m, s.clone())));
    // A forged refusal (its seal is another secret's), then a welcome with a forged proof.
    let other = secret("other");
    for answer in 0..2 {
        let incoming = tokio::time::timeout(Duration::from_secs(10), impostor.accept())
            .await
            .unwrap_or_else(|_| panic!("the worker did not dial again after answer {answer}"))
            .unwrap();
        let conn = incoming.await.unwrap();
        let (mut send, mut recv) = conn.accept_bi().await.unwrap();
        let hello = control::read(&mut recv).await.unwrap();
        assert!(matches!(hello, Control::Hello { .. }), "{hello:?}");
        let reply = if answer == 0 {
            control::reject(&conn, &other, "wrong job secret: go away".into())
        } else {
            Control::Welcome {
                proof: other.proof(super::auth::ROLE_SERVER, &exporter(&conn).unwrap()),
                rank: 1,
            }
        };
        control::write(&mut send, &reply).await.unwrap();
        let _ = send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
    }
    impostor.close(0u32.into(), b"gone");
    impostor.wait_idle().await;
    drop(impostor);
    // Its socket closes once the endpoint's driver has noticed.
    let freed = Instant::now() + Duration::from_secs(5);
    while std::net::UdpSocket::bind(addr).is_err() {
        assert!(Instant::now() < freed, "the impostor's port stayed taken");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !worker.is_finished(),
        "the worker gave up on a stranger's word"
    );
    // The real rank 0 takes the address; the worker, still dialling, joins it.
    let host = QuicTransport::connect(config(0, 2, &m, s)).await.unwrap();
    let worker = worker.await.unwrap().unwrap();
    exchange(&worker, &host, Bytes::from_static(b"hi")).await;
}

/// A refusal rank 0 seals (it holds the job secret: here, a worker of another world size) ends
/// the join at once, without dialling again until the connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_refusal_ends_the_join_at_once() {
    let m = master();
    let s = secret("job");
    let host = tokio::spawn(QuicTransport::connect(config(0, 2, &m, s.clone())));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let err = QuicTransport::connect(config(1, 3, &m, s))
        .await
        .err()
        .expect("a worker of another world size must be refused");
    assert!(err.to_string().contains("world size mismatch"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "a sealed refusal took {:?} (the connect timeout is 20 s)",
        started.elapsed()
    );
    host.abort();
}

/// A connection that completes its handshake and then says nothing is closed by the rank once
/// the pre-proof limit passes (it held one of the rank's places for 10 s before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_at_the_pre_proof_limit() {
    let m = master();
    let s = secret("job");
    let (host, addr, stranger) = host_and_stranger(&m, &s).await;
    let conn = stranger.connect(addr, "bonfire").unwrap().await.unwrap();
    let started = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(9), conn.closed()).await;
    let held = started.elapsed();
    assert!(
        closed.is_ok(),
        "a silent stranger was still connected after {held:?}"
    );
    assert!(
        held >= super::links::PRE_PROOF_LIMIT - Duration::from_millis(500),
        "closed after {held:?}, before the limit"
    );
    worker_reaches_host(&m, s, host, Bytes::from_static(b"hi")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_is_an_error_naming_its_sender() {
    let ranks = job(2).await;
    let link = ranks[1].links[0].as_ref().unwrap();
    let mut s = link.conn.open_uni().await.unwrap();
    let bad = FrameHeader::data(
        Tag {
            context: 0,
            seq: 0,
            step: 0,
        },
        u64::MAX,
    )
    .encode();
    s.write_all(&bad).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let reason = loop {
        if let Some(r) = ranks[0].mailbox().lost_reason(Rank(1)) {
            break r;
        }
        assert!(Instant::now() < deadline, "the bad frame went unnoticed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(reason.contains("rank 1 sent a malformed frame"), "{reason}");
    assert!(reason.contains("exceeds the limit"), "{reason}");
    // Rank 1 learns that its link was closed, with the reason.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ranks[1].mailbox().lost_reason(Rank(0)).is_none() {
        assert!(Instant::now() < deadline, "the sender was not told");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_without_a_rank_are_assigned_distinct_ones() {
    let m = master();
    let s = secret("job");
    let mut handles = vec![tokio::spawn(QuicTransport::connect(config(
        0,
        4,
        &m,
        s.clone(),
    )))];
    for _ in 0..3 {
        let mut c = config(0, 4, &m, s.clone());
        c.rank = None;
        handles.push(tokio::spawn(QuicTransport::connect(c)));
    }
    let mut ranks = Vec::new();
    let mut ts = Vec::new();
    for h in handles {
        let t = h.await.unwrap().unwrap();
        ranks.push(t.rank().0);
        ts.push(t);
    }
    ranks.sort();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
    // Every pair is linked: each rank reaches the next.
    for t in &ts {
        let to = Rank((t.rank().0 + 1) % 4);
        let tag = Tag {
            context: 5,
            seq: u64::from(t.rank().0),
            step: 0,
        };
        t.send(to, tag, Bytes::from_static(b"x")).await.unwrap();
    }
    for t in &ts {
        let from = (t.rank().0 + 3) % 4;
        let tag = Tag {
            context: 5,
            seq: u64::from(from),
            step: 0,
        };
        assert_eq!(take(t, from, tag).await, &b"x"[..]);
    }
    // A fifth process finds the job full.
    let mut c = config(0, 4, &m, s);
    c.rank = None;
    c.connect_timeout = Duration::from_secs(5);
    let err = QuicTransport::connect(c)
        .await
        .err()
        .expect("the job is full");
    assert!(
        err.to_string().contains("has already started") || err.to_string().contains("full"),
        "{err}"
    );
    for t in &ts {
        t.shutdown().await;
    }
}

/// A rank that sends and then shuts down at once must not be reported gone before its frames
/// are filed: a busy receiver may still be reading them from its buffers when the close arrives.
/// (Seen in CI: a two-rank benchmark's last all-reduce failed on the slower rank.) The receiver
/// here waits 100 ms before taking each stream and before filing each frame, standing for that
/// busy rank, so the close arrives before its streams are even accepted (also seen in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_is_reported_only_after_its_frames_are_filed() {
    const FRAMES: u32 = 8;
    let mut ranks = job(2).await;
    let receiver = ranks.pop().unwrap();
    let sender = ranks.pop().unwrap();
    receiver
        .shared
        .slow_filing_ms
        .store(100, std::sync::atomic::Ordering::Relaxed);
    let inbox = receiver.mailbox().open(11, 0).unwrap();
    let payload = |step: u32| Bytes::from(format!("frame {step}"));
    for step in 0..FRAMES {
        let tag = Tag {
            context: 11,
            seq: 0,
            step,
        };
        sender.send(Rank(1), tag, payload(step)).await.unwrap();
    }
    sender.shutdown().await;
    // Take nothing until the loss is reported; then every frame must already be there.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let changed = inbox.changed();
        if let Some(reason) = inbox.lost(Rank(0)) {
            assert!(reason.contains("shut down"), "{reason}");
            break;
        }
        tokio::time::timeout_at(deadline, changed)
            .await
            .expect("the sender's shutdown was never reported");
    }
    assert_eq!(
        inbox.pending(),
        FRAMES as usize,
        "the shutdown was reported before the frames already received were filed"
    );
    for step in 0..FRAMES {
        assert_eq!(inbox.take(Rank(0), step), Some(payload(step)));
    }
    receiver.shutdown().await;
}

/// What a flood of strangers may add to a rank's resident memory at most: [`MAX_UNPROVEN`]
/// connections at once, each holding at most its pre-proof window and a hello, and quinn's own
/// state per connection (measured: see BENCHMARKS.md, "A flood of strangers").
///
/// [`MAX_UNPROVEN`]: super::links::MAX_UNPROVEN
const FLOOD_BOUND: u64 = 96 << 20;

/// A resident-memory figure of process `pid` (`VmRSS`, `VmHWM` for its peak), in bytes.
fn memory_of(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kib << 10
}

/// Strangers at `addr` until `until`: at most 2 x MAX_UNPROVEN connections at once, each with
/// the largest first message a rank reads (a hello's 4 KiB, its last byte withheld so the rank
/// keeps waiting) and two streams stuffed until the window closes. Returns how many connections
/// completed their handshake and how many were refused.
async fn flood(stranger: quinn::Endpoint, addr: SocketAddr, until: Instant) -> (usize, usize) {
    let stuff = |conn: quinn::Connection| async move {
        let (mut send, _recv) = conn.open_bi().await?;
        let len = control::MAX_HELLO as u32;
        send.write_all(&len.to_le_bytes()).await?;
        send.write_all(&vec![0xa5; control::MAX_HELLO - 1]).await?;
        let chunk = Bytes::from(vec![0x5a; 64 << 10]);
        for _ in 0..2 {
            let mut uni = conn.open_uni().await?;
            let chunk = chunk.clone();
            tokio::spawn(async move { while uni.write_all(&chunk).await.is_ok() {} });
        }
        let _ = tokio::time::timeout(Duration::from_secs(8), conn.closed()).await;
        Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
    };
    let places = Arc::new(tokio::sync::Semaphore::new(2 * super::links::MAX_UNPROVEN));
    let (mut held, mut refused) = (0, 0);
    let mut tasks = tokio::task::JoinSet::new();
    while Instant::now() < until {
        let place = places.clone().acquire_owned().await.unwrap();
        let Ok(connecting) = stranger.connect(addr, "bonfire") else {
            continue;
        };
        tasks.spawn(async move {
            let _place = place;
            match tokio::time::timeout(Duration::from_secs(3), connecting).await {
                Ok(Ok(conn)) => {
                    let _ = stuff(conn).await;
                    true
                }
                _ => false,
            }
        });
        while let Some(done) = tasks.try_join_next() {
            if done.unwrap() {
                held += 1
            } else {
                refused += 1
            }
        }
    }
    tasks.abort_all();
    (held, refused)
}

/// The rank-0 process of [`a_flood_of_strangers_stays_within_its_memory_bound`], which starts
/// it (this test binary run again for this test alone); on its own it does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the rank process of the flood test, which starts it"]
async fn flood_rank_0_process() {
    let Ok(m) = std::env::var("BONFIRE_FLOOD_MASTER") else {
        return;
    };
    let mut c = config(0, 2, &m, secret("flood"));
    c.connect_timeout = Duration::from_secs(60);
    let host = QuicTransport::connect(c).await.unwrap();
    let tag = |step| Tag {
        context: 7,
        seq: 1,
        step,
    };
    let got = take(&host, 1, tag(0)).await;
    host.send(Rank(1), tag(1), got).await.unwrap();
    host.shutdown().await;
}

/// A flood of strangers (connections with the largest first message a rank reads and stuffed
/// streams, twice as many at once as the rank handles) adds at most [`FLOOD_BOUND`] to the
/// rank's resident memory at its peak, and the real rank 1, joining in the middle of it, forms
/// the job and moves a frame larger than the pre-proof window both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_strangers_stays_within_its_memory_bound() {
    let m = master();
    let addr: SocketAddr = m.parse().unwrap();
    let mut rank0 = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["quic::tests::flood_rank_0_process", "--exact", "--ignored"])
        .env("BONFIRE_FLOOD_MASTER", &m)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Rank 0 is up once its port is taken.
    let up = Instant::now() + Duration::from_secs(30);
    while std::net::UdpSocket::bind(addr).is_ok() {
        assert!(Instant::now() < up, "rank 0 did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = memory_of(rank0.id(), "VmRSS");
    let stranger = endpoint(
        "127.0.0.1:0".parse().unwrap(),
        &Identity::generate().unwrap(),
        Duration::from_secs(10),
        1,
    )
    .unwrap();
    let started = Instant::now();
    let flooding = tokio::spawn(flood(stranger, addr, started + Duration::from_secs(6)));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut c = config(1, 2, &m, secret("flood"));
    c.connect_timeout = Duration::from_secs(60);
    let worker = QuicTransport::connect(c).await.unwrap();
    let joined = started.elapsed();
    let (held, refused) = flooding.await.unwrap();
    let peak = memory_of(rank0.id(), "VmHWM");
    let tag = |step| Tag {
        context: 7,
        seq: 1,
        step,
    };
    let payload = Bytes::from(vec![3u8; 4 << 20]);
    worker.send(Rank(0), tag(0), payload.clone()).await.unwrap();
    assert_eq!(take(&worker, 0, tag(1)).await, payload);
    worker.shutdown().await;
    let exited = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = rank0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < exited, "rank 0 did not exit");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "rank 0 failed: {status}");
    let added = peak.saturating_sub(before);
    println!(
        "flood: {held} strangers' connections held, {refused} refused; rank 1 joined after \
         {joined:?}; rank 0 resident {} MiB before, peak {} MiB (+{} MiB, bound {} MiB)",
        before >> 20,
        peak >> 20,
        added >> 20,
        FLOOD_BOUND >> 20
    );
    assert!(
        held >= super::links::MAX_UNPROVEN,
        "the flood was too small: {held} held"
    );
    assert!(
        added <= FLOOD_BOUND,
        "a flood added {} MiB to rank 0's resident memory (bound {} MiB)",
        added >> 20,
        FLOOD_BOUND >> 20
    );
}
