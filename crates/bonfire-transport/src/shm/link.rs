//! The two ends of a shared-memory lane: [`OutLink`], whose writer thread copies queued frames
//! into the peer's ring, and the reader thread, which copies them out and files them.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bonfire_topology::Rank;
use bytes::Bytes;

use super::ring::{Dest, Ring, RingStop};
use super::sys::Process;
use crate::sink::{Sinks, Slot};
use crate::{Expected, Mailbox, Sink, Tag, TransportError};

/// Bytes of a frame's record header in the ring: kind, step, context, seq, length.
const RECORD: usize = 32;
pub(super) const KIND_DATA: u32 = 1;
pub(super) const KIND_GOODBYE: u32 = 2;

pub(super) fn record(kind: u32, tag: Tag, len: u64) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[0..4].copy_from_slice(&kind.to_le_bytes());
    r[4..8].copy_from_slice(&tag.step.to_le_bytes());
    r[8..16].copy_from_slice(&tag.context.to_le_bytes());
    r[16..24].copy_from_slice(&tag.seq.to_le_bytes());
    r[24..32].copy_from_slice(&len.to_le_bytes());
    r
}

fn why(stop: &RingStop, peer: &Process) -> String {
    match stop {
        RingStop::PeerExited => format!(
            "its process (pid {}) exited (seen on the shared-memory lane)",
            peer.pid()
        ),
        RingStop::Closed => "closed its shared-memory lane (it is shutting down)".into(),
        RingStop::Stopping => "this rank is shutting down".into(),
        RingStop::TimedOut => format!(
            "stopped taking frames on the shared-memory lane (pid {} is alive, but its ring \
             stayed full until the deadline; the lane is unusable after a partial write)",
            peer.pid()
        ),
        RingStop::Corrupt { head, tail } => format!(
            "its shared-memory ring is damaged (bytes written {head}, taken {tail}: no ring \
             holds that; pid {}): the lane is closed",
            peer.pid()
        ),
    }
}

/// Frames up to this size are written by the sending task itself when the ring has room and
/// nothing is queued: a small message then costs no hand-over to the writer thread.
const INLINE_MAX: usize = 64 << 10;

/// Bytes of frames queued for the writer thread past which a sender waits ([`OutLink::queue`])
/// until the writer has caught up: a peer that reads slowly holds the sender back instead of
/// letting the queue grow without bound. Each sender queues its frame before it waits (frames
/// keep their order), so the queue holds at most this much plus one frame per waiting sender.
pub(crate) const MAX_QUEUED_BYTES: usize = 64 << 20;

/// What the sending task and the writer thread share.
struct Producer {
    ring: Ring,
    process: Process,
    stop: Arc<AtomicBool>,
    /// Held while writing a frame, so frames do not interleave.
    writing: Mutex<()>,
    /// Frames queued for the writer thread and not yet written.
    queued: AtomicUsize,
    /// Their bytes.
    queued_bytes: AtomicUsize,
    /// Signalled whenever the writer thread finished a queued frame or the lane ended.
    progress: tokio::sync::Notify,
    /// Set once the lane said goodbye (or failed): nothing more may be written.
    done: AtomicBool,
    mailbox: Arc<Mailbox>,
    lost: Arc<OnceLock<Arc<str>>>,
    peer: Rank,
    /// How long the writer thread waits for room for one queued frame: a live peer that takes
    /// nothing for this long (a stopped process) is lost, as QUIC's idle timeout loses it.
    stall: Duration,
}

impl Producer {
    /// Ends the lane after a write stopped for `s`: nothing more is written, and unless this
    /// rank is the one stopping, the peer is reported lost with the reason.
    fn fail(&self, s: &RingStop) {
        self.done.store(true, Ordering::Release);
        if *s != RingStop::Stopping {
            let reason: Arc<str> = why(s, &self.process).into();
            let _ = self.lost.set(reason.clone());
            self.mailbox.peer_lost(self.peer, reason);
        }
        self.progress.notify_waiters();
    }
}

/// The sending end of a lane to one peer on this host.
pub(crate) struct OutLink {
    queue: Mutex<Option<Sender<(Tag, Bytes)>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    producer: Arc<Producer>,
    lost: Arc<OnceLock<Arc<str>>>,
    peer: Rank,
}

impl OutLink {
    /// Starts the writer thread of the lane to `peer`, writing into `ring`; it gives a queued
    /// frame `stall` to find room before it ends the lane.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        me: Rank,
        peer: Rank,
        ring: Ring,
        process: Process,
        mailbox: Arc<Mailbox>,
        stop: Arc<AtomicBool>,
        stall: Duration,
    ) -> std::io::Result<OutLink> {
        let (tx, rx) = channel();
        let lost: Arc<OnceLock<Arc<str>>> = Arc::default();
        let producer = Arc::new(Producer {
            ring,
            process,
            stop,
            writing: Mutex::new(()),
            queued: AtomicUsize::new(0),
            queued_bytes: AtomicUsize::new(0),
            progress: tokio::sync::Notify::new(),
            done: AtomicBool::new(false),
            mailbox,
            lost: lost.clone(),
            peer,
            stall,
        });
        let producer2 = producer.clone();
        let writer = std::thread::Builder::new()
            .name(format!("bonfire-shm-{}to{}", me.0, peer.0))
            .spawn(move || {
                crate::placement::enter(crate::placement::Role::Communication);
                write_loop(&producer2, &rx)
            })?;
        Ok(OutLink {
            queue: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
            producer,
            lost,
            peer,
        })
    }

    /// Writes a small frame right away if the ring has room for it and nothing is queued
    /// before it; returns it otherwise.
    fn try_inline(&self, tag: Tag, payload: Bytes) -> Option<(Tag, Bytes)> {
        let p = &self.producer;
        if payload.len() > INLINE_MAX || p.queued.load(Ordering::Acquire) != 0 {
            return Some((tag, payload));
        }
        let Ok(_writing) = p.writing.try_lock() else {
            return Some((tag, payload));
        };
        if p.done.load(Ordering::Acquire)
            || p.queued.load(Ordering::Acquire) != 0
            || p.ring.room() < RECORD + payload.len()
        {
            return Some((tag, payload));
        }
        let head = record(KIND_DATA, tag, payload.len() as u64);
        // There is room, and only the consumer changes it (by making more): this cannot wait.
        let _ = p.ring.write(&[&head, &payload], &p.process, &p.stop);
        None
    }

    /// Writes a frame into the ring from `payload` itself, in the calling thread: no frame is
    /// allocated and no thread hands it over. Waits for room as long as the peer is alive, at
    /// most until `deadline`; a timeout leaves part of the frame in the ring, so it ends the
    /// lane and reports the peer lost. Returns `None`, having written nothing, while frames
    /// queued for the writer thread must go first (the caller then queues this one with
    /// [`OutLink::send`]).
    pub(crate) fn send_from(
        &self,
        tag: Tag,
        payload: &[u8],
        deadline: Instant,
    ) -> Option<Result<(), TransportError>> {
        let p = &self.producer;
        if let Some(reason) = self.lost.get() {
            return Some(Err(TransportError::PeerLost {
                peer: self.peer,
                reason: reason.clone(),
            }));
        }
        if p.queued.load(Ordering::Acquire) != 0 {
            return None;
        }
        let _writing = p.writing.try_lock().ok()?;
        if p.done.load(Ordering::Acquire) || p.queued.load(Ordering::Acquire) != 0 {
            return None;
        }
        let head = record(KIND_DATA, tag, payload.len() as u64);
        let written = p
            .ring
            .write_until(&[&head, payload], &p.process, &p.stop, Some(deadline));
        Some(written.map_err(|s| {
            p.fail(&s);
            TransportError::PeerLost {
                peer: self.peer,
                reason: self
                    .lost
                    .get()
                    .cloned()
                    .unwrap_or_else(|| why(&s, &p.process).into()),
            }
        }))
    }

    /// Queues a frame; the writer thread copies it into the ring.
    pub(crate) fn send(&self, tag: Tag, payload: Bytes) -> Result<(), TransportError> {
        let lost = |reason: Arc<str>| TransportError::PeerLost {
            peer: self.peer,
            reason,
        };
        if let Some(reason) = self.lost.get() {
            return Err(lost(reason.clone()));
        }
        let Some((tag, payload)) = self.try_inline(tag, payload) else {
            return Ok(());
        };
        let queue = crate::lock(&self.queue);
        self.producer.queued.fetch_add(1, Ordering::AcqRel);
        self.producer
            .queued_bytes
            .fetch_add(payload.len(), Ordering::AcqRel);
        match queue.as_ref().map(|q| q.send((tag, payload))) {
            Some(Ok(())) => Ok(()),
            _ => Err(lost(
                self.lost
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "this rank is shutting down".into()),
            )),
        }
    }

    /// Queues a frame as [`OutLink::send`] does, then waits while more than
    /// [`MAX_QUEUED_BYTES`] are queued: until the writer thread has caught up, or the lane ends
    /// (the writer gives each frame the stall limit to find room, then ends the lane and this
    /// wait with it). The wait itself gives up after twice the stall limit without progress.
    pub(crate) async fn queue(&self, tag: Tag, payload: Bytes) -> Result<(), TransportError> {
        self.send(tag, payload)?;
        let p = &self.producer;
        let quiet = 2 * p.stall;
        loop {
            let progress = p.progress.notified();
            let mut progress = std::pin::pin!(progress);
            progress.as_mut().enable();
            if let Some(reason) = self.lost.get() {
                return Err(TransportError::PeerLost {
                    peer: self.peer,
                    reason: reason.clone(),
                });
            }
            if p.queued_bytes.load(Ordering::Acquire) <= MAX_QUEUED_BYTES
                || p.done.load(Ordering::Acquire)
            {
                return Ok(());
            }
            if tokio::time::timeout(quiet, progress).await.is_err() {
                return Err(TransportError::PeerLost {
                    peer: self.peer,
                    reason: format!(
                        "the shared-memory lane's writer made no progress for {quiet:?} with {} \
                         bytes queued",
                        p.queued_bytes.load(Ordering::Acquire)
                    )
                    .into(),
                });
            }
        }
    }

    /// Bytes queued for the writer thread and not yet written.
    #[cfg(test)]
    pub(crate) fn queued_bytes(&self) -> usize {
        self.producer.queued_bytes.load(Ordering::Acquire)
    }

    /// Ends a lane that never carried a frame (its reader never started): the writer thread
    /// stops without a goodbye, which nobody would read.
    pub(crate) fn abandon(self) {
        self.producer.done.store(true, Ordering::Release);
        drop(crate::lock(&self.queue).take());
        if let Some(w) = crate::lock(&self.writer).take() {
            let _ = w.join();
        }
    }

    /// The rank this lane writes to.
    pub(crate) fn peer(&self) -> Rank {
        self.peer
    }

    /// Ends the lane: the writer says goodbye after the queued frames and waits until the peer
    /// has filed them all, for at most `within`. A peer that is alive but takes nothing (stopped,
    /// or stuck) would hold that wait forever: past `within` this sets the job's `stop`, which
    /// ends the writer's wait within a tick, and returns false.
    pub(crate) fn finish(&self, within: Duration) -> bool {
        drop(crate::lock(&self.queue).take());
        let Some(w) = crate::lock(&self.writer).take() else {
            return true;
        };
        let deadline = Instant::now() + within;
        let mut drained = true;
        while !w.is_finished() {
            if Instant::now() >= deadline {
                self.producer.stop.store(true, Ordering::Release);
                drained = false;
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = w.join();
        drained
    }
}

fn write_loop(p: &Producer, rx: &Receiver<(Tag, Bytes)>) {
    let (ring, process, stop) = (&p.ring, &p.process, &*p.stop);
    for (tag, payload) in rx {
        let head = record(KIND_DATA, tag, payload.len() as u64);
        let written = {
            let _writing = crate::lock(&p.writing);
            if p.done.load(Ordering::Acquire) {
                // A direct write failed part-way: the lane is over, and already reported.
                Err(RingStop::Stopping)
            } else {
                let deadline = Instant::now() + p.stall;
                ring.write_until(&[&head, &payload], process, stop, Some(deadline))
            }
        };
        p.queued.fetch_sub(1, Ordering::AcqRel);
        p.queued_bytes.fetch_sub(payload.len(), Ordering::AcqRel);
        p.progress.notify_waiters();
        if let Err(s) = written {
            p.fail(&s);
            return;
        }
    }
    p.progress.notify_waiters();
    let _writing = crate::lock(&p.writing);
    if p.done.swap(true, Ordering::AcqRel) {
        return;
    }
    // The queue closed: this rank is shutting down. Say goodbye and wait until the peer has
    // filed everything, so that it never sees this rank gone with frames still in the ring.
    let bye = record(
        KIND_GOODBYE,
        Tag {
            context: 0,
            seq: 0,
            step: 0,
        },
        0,
    );
    if let Err(s) = ring
        .write(&[&bye], process, stop)
        .and_then(|()| ring.drain(process, stop))
        && s == RingStop::PeerExited
    {
        p.fail(&s);
    }
}

/// The receiving end of the lane from one peer. Its reader thread files every frame in the
/// mailbox; a thread waiting for a collective may take whole frames that are already in the ring
/// itself ([`InLink::take_ready`]), which saves the hand-over to the reader thread and back.
/// Frames are taken whole, under `reading`, so the two never split one between them.
///
/// A frame that a collective expects ([`InLink::expect`]) goes straight into the collective's
/// memory instead, piece by piece as it comes off the ring; every other frame is copied out into
/// a frame of its own. So a frame never waits in the ring for its consumer: nothing pins the
/// ring, and two collectives in flight on one lane never wait on each other.
pub(crate) struct InLink {
    peer: Rank,
    ring: Ring,
    process: Process,
    mailbox: Arc<Mailbox>,
    stop: Arc<AtomicBool>,
    max_frame: u64,
    /// Held while a frame is taken out of the ring.
    reading: Mutex<()>,
    /// The frames expected straight into a sink.
    sinks: Sinks,
    /// Where pieces of a frame going into a sink pass through (one piece, in cache).
    bounce: Mutex<Vec<u8>>,
    /// Payload bytes that went straight into sinks.
    in_place: AtomicU64,
}

/// The piece of an expected frame copied out of the ring at a time: small enough to stay in the
/// core's cache between the copy and the sink's use of it.
const PIECE: usize = 64 << 10;

impl InLink {
    /// Files the frames that are wholly in the ring now, on this thread, unless the reader
    /// thread is taking one. Never waits. Returns whether it filed any.
    pub(crate) fn take_ready(&self) -> bool {
        let Ok(_reading) = self.reading.try_lock() else {
            return false;
        };
        let mut filed = false;
        loop {
            // Damaged counters are the reader thread's to report.
            let Ok(available) = self.ring.available() else {
                return filed;
            };
            if available < RECORD {
                return filed;
            }
            let mut head = [0u8; RECORD];
            self.ring.peek(&mut head);
            let (kind, tag, len) = parse(&head);
            // Anything unusual (a goodbye, a malformed record, a frame still arriving) is the
            // reader thread's.
            if kind != KIND_DATA || len > self.max_frame || available - RECORD < len as usize {
                return filed;
            }
            // The record and its payload are in the ring: taking them cannot wait, so it cannot
            // fail.
            let taken = self
                .ring
                .read(RECORD, &self.process, &self.stop, Dest::Nowhere)
                .and_then(|()| self.file(tag, len as usize));
            debug_assert!(taken.is_ok());
            filed = true;
        }
    }

    /// The peer this lane reads from.
    pub(crate) fn peer(&self) -> Rank {
        self.peer
    }

    /// Registers `sink` for the frame `tag` (see [`crate::Transport::expect`]).
    pub(crate) fn expect(&self, tag: Tag, sink: Arc<dyn Sink>) -> Expected {
        Slot::register(&self.sinks, tag, sink)
    }

    /// Payload bytes that went straight into sinks so far.
    pub(crate) fn received_in_place(&self) -> u64 {
        self.in_place.load(Ordering::Relaxed)
    }

    /// Takes the next `len` bytes, the payload of the frame tagged `tag`, and files the frame,
    /// or hands them to the sink expecting it.
    fn file(&self, tag: Tag, len: usize) -> Result<(), RingStop> {
        if len > 0
            && let Some(slot) = Slot::claim(&self.sinks, tag, len)
        {
            return self.fill(&slot, tag, len);
        }
        // Payloads are copied into recycled buffers, so steady traffic does not fault in fresh
        // pages (the frames usually outlive the next one's arrival, in the mailbox).
        let mut read = Ok(());
        let frame = crate::pool::filled(len, |buf| {
            read = self
                .ring
                .read(len, &self.process, &self.stop, Dest::Append(buf));
        });
        read?;
        self.mailbox.deliver(self.peer, tag, frame);
        Ok(())
    }
}

impl InLink {
    /// Takes the next `len` bytes into `slot`'s sink, piece by piece through the bounce buffer,
    /// then files an empty frame under `tag` to wake whoever waits for it. A sink withdrawn
    /// part-way gets nothing more: the rest of the frame is taken and dropped.
    fn fill(&self, slot: &Slot, tag: Tag, len: usize) -> Result<(), RingStop> {
        let mut bounce = crate::lock(&self.bounce);
        if bounce.len() < PIECE {
            bounce.resize(PIECE, 0);
        }
        let mut at = 0;
        let mut kept = true;
        while at < len {
            let k = (len - at).min(PIECE);
            self.ring
                .read(k, &self.process, &self.stop, Dest::Slice(&mut bounce[..k]))?;
            // A sink that panics (a user's reducer, say) gets nothing more: the rest of the
            // frame is taken off the ring all the same, so the lane stays in step, and its
            // collective sees an empty frame where it expected one and fails naming the peer.
            let mut sink = crate::lock(&slot.sink);
            let took = sink.as_ref().is_some_and(|s| {
                let piece = &bounce[..k];
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.take(at, piece))).is_ok()
            });
            if !took {
                *sink = None;
                kept = false;
            }
            drop(sink);
            at += k;
        }
        if kept {
            self.in_place.fetch_add(len as u64, Ordering::Relaxed);
            slot.filled.store(true, Ordering::Release);
        }
        self.mailbox.deliver(self.peer, tag, Bytes::new());
        Ok(())
    }
}

/// A record's kind, tag and payload length.
fn parse(head: &[u8; RECORD]) -> (u32, Tag, u64) {
    let word = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b[..r.len()].copy_from_slice(&head[r]);
        u64::from_le_bytes(b)
    };
    let tag = Tag {
        context: word(8..16),
        seq: word(16..24),
        step: word(4..8) as u32,
    };
    (word(0..4) as u32, tag, word(24..32))
}

/// Starts the reader thread of the lane from `peer`: it files every frame in `mailbox` and
/// reports the peer lost if its process exits without saying goodbye.
pub(crate) fn start_reader(
    me: Rank,
    peer: Rank,
    ring: Ring,
    process: Process,
    mailbox: Arc<Mailbox>,
    stop: Arc<AtomicBool>,
    max_frame: u64,
) -> std::io::Result<(Arc<InLink>, JoinHandle<()>)> {
    let link = Arc::new(InLink {
        peer,
        ring,
        process,
        mailbox,
        stop,
        max_frame,
        reading: Mutex::new(()),
        sinks: Sinks::default(),
        bounce: Mutex::new(Vec::new()),
        in_place: AtomicU64::new(0),
    });
    let l = link.clone();
    let thread = std::thread::Builder::new()
        .name(format!("bonfire-shm-{}from{}", me.0, peer.0))
        .spawn(move || {
            crate::placement::enter(crate::placement::Role::Communication);
            if let Err(reason) = read_loop(&l) {
                l.mailbox.peer_lost(peer, reason);
            }
            l.ring.close();
        })?;
    Ok((link, thread))
}

fn read_loop(link: &InLink) -> Result<(), String> {
    let InLink {
        ring,
        process,
        stop,
        max_frame,
        reading,
        ..
    } = link;
    let max_frame = *max_frame;
    let err = |s: RingStop| match s {
        RingStop::Stopping => Ok(()),
        s => Err(why(&s, process)),
    };
    loop {
        if let Err(s) = ring.wait_data(process, stop) {
            return err(s);
        }
        let _reading = crate::lock(reading);
        match ring.available() {
            Err(s) => return err(s),
            // A waiting collective took it.
            Ok(0) => continue,
            Ok(_) => {}
        }
        let mut head = [0u8; RECORD];
        if let Err(s) = ring.read(RECORD, process, stop, Dest::Slice(&mut head)) {
            return err(s);
        }
        let (kind, tag, len) = parse(&head);
        match kind {
            KIND_GOODBYE => return Ok(()),
            KIND_DATA if len <= max_frame => {}
            _ => {
                return Err(format!(
                    "sent a malformed frame on the shared-memory lane (kind {kind}, {len} bytes)"
                ));
            }
        }
        if let Err(s) = link.file(tag, len as usize) {
            return err(s);
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
    }
}
