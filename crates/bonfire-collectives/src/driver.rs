//! Runs one rank's [`Program`] over a [`Transport`], with the safety nets every collective has:
//! the arrival exchange (fingerprints), a timeout on every wait, and abort notices.
//!
//! # Protocol
//! 1. On start, a rank sends its [`Fingerprint`] to every other participant (an *arrival*).
//! 2. It runs its program. Whenever it waits for a frame it also files the arrivals that came in
//!    and compares each with its own fingerprint; a difference fails the call at once with
//!    [`CollectiveError::Mismatch`], on every rank, since every rank gets every arrival.
//! 3. It completes only once every participant's arrival has come and matched: a call cannot
//!    return a result built from a peer that was doing something else.
//! 4. A rank that fails for any other reason sends an *abort* notice with its error to every
//!    participant, which fail with [`CollectiveError::PeerAborted`] instead of waiting out their
//!    timeouts.
//!
//! Every wait lasts at most the communicator's timeout. On expiry the error lists the
//! participants whose arrival never came (they did not call the collective) and the frame the
//! rank was waiting for.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bonfire_topology::{DType, Rank, ReduceOp};
use bonfire_transport::{Expected, Inbox, Sink, Tag, Transport, TransportError};
use bytes::Bytes;
use tokio::time::Instant;

use crate::CollectiveError;
use crate::exec::{Action, Arith, Executor, Span};
use crate::fingerprint::Fingerprint;
use crate::reducer::Reducer;
use crate::schedule::{Apply, CONTROL_PHASE, Instr, Program};

/// Step of the arrival frame.
const ARRIVAL: u32 = (CONTROL_PHASE as u32) << 24;
/// Step of the abort notice.
const ABORT: u32 = ARRIVAL | 1;
/// Longest abort reason sent, in bytes.
const MAX_REASON: usize = 2048;
/// How long a failing rank tries to deliver each abort notice.
const ABORT_PATIENCE: Duration = Duration::from_secs(5);
/// How long a failing rank waits for the arrival of the peer it blames, in case that arrival
/// shows a mismatch that explains the failure.
const EXPLAIN_GRACE: Duration = Duration::from_millis(250);

/// When a rank had seen every other participant's arrival, and whose came last (`None` without
/// other participants).
pub(crate) type Arrived = Arc<OnceLock<(std::time::Instant, Option<Rank>)>>;

/// Who takes part in one exchange, and how.
pub(crate) struct Exchange {
    pub(crate) transport: Arc<dyn Transport>,
    /// World rank of each group member.
    pub(crate) members: Arc<[Rank]>,
    /// Group indices of the participants, including this rank.
    pub(crate) participants: Vec<u32>,
    /// This rank's group index.
    pub(crate) me: u32,
    /// Conversation the frames belong to.
    pub(crate) context: u64,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) timeout: Duration,
    /// Set when this rank has seen every other participant's arrival (all of them had called
    /// the collective by then), with the participant whose arrival it saw last.
    pub(crate) arrived: Arrived,
}

impl Exchange {
    fn world(&self, member: u32) -> Rank {
        self.members[member as usize]
    }

    fn me_world(&self) -> Rank {
        self.world(self.me)
    }

    fn tag(&self, step: u32) -> Tag {
        Tag {
            context: self.context,
            seq: self.fingerprint.seq,
            step,
        }
    }

    fn others(&self) -> impl Iterator<Item = u32> + '_ {
        self.participants
            .iter()
            .copied()
            .filter(move |&m| m != self.me)
    }

    /// Sends a frame; like every wait, a send that the transport cannot complete (a peer that
    /// stopped reading, a full window) fails after the timeout.
    async fn send(&self, to: u32, step: u32, payload: Bytes) -> Result<(), CollectiveError> {
        let peer = self.world(to);
        let sent = tokio::time::timeout(
            self.timeout,
            self.transport.send(peer, self.tag(step), payload),
        )
        .await;
        let source = match sent {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(source)) => source,
            Err(_) => TransportError::Send {
                peer,
                reason: format!("the frame was not accepted within {:.1?}", self.timeout),
            },
        };
        Err(CollectiveError::Transport {
            me: self.me_world(),
            collective: self.fingerprint,
            source,
        })
    }

    /// Sends a copy of `data`: written straight into the lane where it allows that, otherwise
    /// as `frame`, made from `data` the first time it is needed (so that sending one range to
    /// several peers copies it once).
    async fn send_from(
        &self,
        to: u32,
        step: u32,
        data: &[u8],
        frame: &mut Option<Bytes>,
    ) -> Result<(), CollectiveError> {
        let peer = self.world(to);
        let deadline = std::time::Instant::now() + self.timeout;
        match self
            .transport
            .send_from(peer, self.tag(step), data, deadline)
        {
            Some(Ok(())) => Ok(()),
            Some(Err(source)) => Err(CollectiveError::Transport {
                me: self.me_world(),
                collective: self.fingerprint,
                source,
            }),
            None => {
                let payload = frame
                    .get_or_insert_with(|| bonfire_transport::pool::frame(data))
                    .clone();
                self.send(to, step, payload).await
            }
        }
    }

    /// Tells every other participant that this rank failed the exchange. Best effort.
    pub(crate) async fn abort(&self, reason: &str) {
        let mut end = reason.len().min(MAX_REASON);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        let payload = Bytes::copy_from_slice(&reason.as_bytes()[..end]);
        let patience = self.timeout.min(ABORT_PATIENCE);
        for m in self.others() {
            let send = self
                .transport
                .send(self.world(m), self.tag(ABORT), payload.clone());
            let _ = tokio::time::timeout(patience, send).await;
        }
    }
}

/// Runs `program` over `buf` as this rank's part of the exchange.
pub(crate) async fn run(
    exchange: &Exchange,
    program: &Program,
    buf: &mut [u8],
    arith: &Arith,
) -> Result<(), CollectiveError> {
    let result = run_inner(exchange, program, buf, arith).await;
    if let Err(e) = &result
        && !matches!(e, CollectiveError::PeerAborted { .. })
    {
        exchange.abort(&e.to_string()).await;
    }
    result
}

async fn run_inner(
    ex: &Exchange,
    program: &Program,
    buf: &mut [u8],
    arith: &Arith,
) -> Result<(), CollectiveError> {
    let inbox = ex
        .transport
        .mailbox()
        .open(ex.context, ex.fingerprint.seq)
        .map_err(|e| CollectiveError::Internal {
            me: ex.me_world(),
            op: "collective",
            problem: e.to_string(),
        })?;
    let mut waiter = Waiter {
        ex,
        inbox,
        pending: ex.others().collect(),
    };
    if waiter.pending.is_empty() {
        ex.arrived.get_or_init(|| (std::time::Instant::now(), None));
    }
    let result = run_program(&mut waiter, program, buf, arith).await;
    match result {
        Ok(()) => Ok(()),
        Err(e) => Err(waiter.explain(e).await),
    }
}

async fn run_program(
    waiter: &mut Waiter<'_>,
    program: &Program,
    buf: &mut [u8],
    arith: &Arith,
) -> Result<(), CollectiveError> {
    let ex = waiter.ex;
    let arrival = Bytes::copy_from_slice(&ex.fingerprint.encode());
    for m in ex.others() {
        waiter.send(m, ARRIVAL, arrival.clone()).await?;
    }

    let buf = Span::new(buf);
    // Declared after `buf`, so dropped before it: every sink is withdrawn before the buffer is
    // the caller's again, however this returns.
    let mut ahead = InPlace::new(program, arith);
    let mut exec = Executor::default();
    loop {
        ahead.expect(ex, program, exec.position(), &buf, arith);
        match exec.next(program, &buf, arith) {
            Action::Done => break,
            Action::Send { bytes, to } => {
                // SAFETY: no lane writes a range that an instruction before its receive reads
                // (see `InPlace::expect`), and this send comes before every receive not yet run.
                let data = unsafe { buf.get(bytes) };
                let mut frame = None;
                for &(peer, step) in to {
                    waiter.ex.send_from(peer, step, data, &mut frame).await?;
                }
            }
            Action::Await { from, step } => {
                let frame = waiter
                    .wait(Some((from, step)))
                    .await?
                    .expect("a frame was awaited");
                // Withdrawn before anything else touches the range.
                let in_place = ahead.take(exec.position());
                if in_place {
                    let (bytes, forward) = exec.received_in_place(program, arith);
                    // SAFETY: the lane is done with this range (its sink is withdrawn), and
                    // only receives whose range is disjoint from it have sinks (a receive that
                    // forwards has one only if it copies, so the range holds the frame).
                    let data = unsafe { buf.get(bytes) };
                    let mut owned = None;
                    for &(peer, step) in forward {
                        waiter.ex.send_from(peer, step, data, &mut owned).await?;
                    }
                    continue;
                }
                let forward = exec
                    .deliver(program, &buf, &frame, arith)
                    .map_err(|problem| CollectiveError::BadFrame {
                        me: ex.me_world(),
                        collective: ex.fingerprint,
                        peer: ex.world(from),
                        step,
                        problem,
                    })?;
                let mut owned = Some(frame.clone());
                for &(peer, step) in forward {
                    waiter.ex.send_from(peer, step, &frame, &mut owned).await?;
                }
            }
        }
    }
    waiter.wait(None).await?;
    Ok(())
}

/// Frames smaller than this are copied out as usual: copying them costs less than expecting
/// them (a sink, a registration), and the small collectives' microseconds stay as they were.
pub(crate) const IN_PLACE_MIN: usize = 64 << 10;
/// How many instructions ahead of the program's position receives are expected.
const LOOKAHEAD: usize = 64;

/// The receives of one program whose frames are expected straight into the working buffer
/// (see [`Transport::expect`]): the lane combines or copies each as it comes off shared memory,
/// with no frame of its own, even while this rank is still sending what comes before.
///
/// A receive is expected only when nothing between the program's position and it touches its
/// range (no send reads it, no finalize or other receive writes it): the lane then writes memory
/// that nobody else uses until the program reaches that receive. One that forwards its frame is
/// expected only if it copies it (the range then holds the frame to forward).
struct InPlace {
    /// Whether any receive is large enough (if none, nothing is ever expected).
    any: bool,
    /// Expected frames by instruction index.
    expected: HashMap<usize, Expected>,
    /// The lanes that cannot (by peer): not asked again.
    unable: Vec<Rank>,
    /// Ranges touched between the position and the receive looked at (scratch).
    touched: Vec<Range<usize>>,
}

impl InPlace {
    fn new(program: &Program, arith: &Arith) -> InPlace {
        let any = program.instrs.iter().any(
            |i| matches!(i, Instr::Recv { range, .. } if arith.bytes(range).len() >= IN_PLACE_MIN),
        );
        InPlace {
            any,
            expected: HashMap::new(),
            unable: Vec::new(),
            touched: Vec::new(),
        }
    }

    /// Expects the frames of the receives ahead of `pc` that can go straight into `buf`.
    fn expect(
        &mut self,
        ex: &Exchange,
        program: &Program,
        pc: usize,
        buf: &Span<'_>,
        arith: &Arith,
    ) {
        if !self.any {
            return;
        }
        self.touched.clear();
        for (i, instr) in program.instrs.iter().enumerate().skip(pc).take(LOOKAHEAD) {
            let (range, from, step, apply, forward) = match instr {
                Instr::Send { range, .. } | Instr::Finalize { range } => {
                    self.touched.push(range.clone());
                    continue;
                }
                Instr::Recv {
                    range,
                    from,
                    step,
                    apply,
                    forward,
                } => (range, *from, *step, *apply, forward),
            };
            let bytes = arith.bytes(range);
            let free = self
                .touched
                .iter()
                .all(|t| t.end <= range.start || range.end <= t.start);
            self.touched.push(range.clone());
            let peer = ex.world(from);
            if !free
                || bytes.len() < IN_PLACE_MIN
                || (apply != Apply::Copy && !forward.is_empty())
                || self.expected.contains_key(&i)
                || self.unable.contains(&peer)
            {
                continue;
            }
            let sink = Arc::new(IntoRange {
                at: buf.at(&bytes),
                len: bytes.len(),
                apply,
                dtype: arith.dtype,
                op: arith.op,
                reducer: arith.reducer.clone(),
            });
            match ex.transport.expect(peer, ex.tag(step), sink) {
                Some(expected) => {
                    self.expected.insert(i, expected);
                }
                None => self.unable.push(peer),
            }
        }
    }

    /// Withdraws the sink of receive `pc`, if it had one; returns whether its whole frame went
    /// there.
    fn take(&mut self, pc: usize) -> bool {
        self.expected.remove(&pc).is_some_and(|e| e.filled())
    }
}

/// A receive's range of the working buffer, as a sink: a frame's pieces are combined into it
/// (or copied over it) as they come off the lane.
struct IntoRange {
    at: *mut u8,
    len: usize,
    apply: Apply,
    dtype: DType,
    op: ReduceOp,
    reducer: Arc<dyn Reducer>,
}

// SAFETY: `at` points into a working buffer that outlives the sink's registration (the
// `Expected` is dropped before the buffer's borrow ends), and only the lane writes the range
// while it is registered (see `InPlace`).
unsafe impl Send for IntoRange {}
// SAFETY: as above; the lane calls `take` from one thread at a time.
unsafe impl Sync for IntoRange {}

impl Sink for IntoRange {
    fn len(&self) -> usize {
        self.len
    }

    fn take(&self, at: usize, piece: &[u8]) {
        assert!(
            at + piece.len() <= self.len,
            "a piece past the end of its range"
        );
        // SAFETY: in the range (checked above), which nothing else touches while the sink is
        // registered; pieces of a frame come one at a time.
        let acc = unsafe { std::slice::from_raw_parts_mut(self.at.add(at), piece.len()) };
        match self.apply {
            Apply::Copy => acc.copy_from_slice(piece),
            Apply::Reduce(order) => self.reducer.combine(self.dtype, self.op, order, acc, piece),
        }
    }
}

/// Waits for frames of one exchange while watching arrivals, aborts and lost peers.
struct Waiter<'a> {
    ex: &'a Exchange,
    inbox: Inbox,
    /// Participants whose arrival has not come yet.
    pending: Vec<u32>,
}

impl Waiter<'_> {
    async fn send(&mut self, to: u32, step: u32, payload: Bytes) -> Result<(), CollectiveError> {
        self.ex.send(to, step, payload).await
    }

    /// The root cause of `error`. A failure is often the consequence of another: a peer is gone,
    /// or sent a frame of the wrong size, *because* it called something else, and its arrival or
    /// abort notice may have landed just after this rank last looked. So before reporting, look
    /// again: a mismatch explains everything, then an abort notice, then the error itself.
    ///
    /// If the error implicates a peer whose arrival has not come, it is given
    /// [`EXPLAIN_GRACE`] to come: over a network its arrival can trail its data.
    async fn explain(&mut self, error: CollectiveError) -> CollectiveError {
        if matches!(error, CollectiveError::Mismatch { .. }) {
            return error;
        }
        let culprit = match &error {
            CollectiveError::BadFrame { peer, .. } | CollectiveError::PeerLost { peer, .. } => {
                Some(*peer)
            }
            CollectiveError::Transport { source, .. } => match source {
                TransportError::PeerLost { peer, .. } | TransportError::Send { peer, .. } => {
                    Some(*peer)
                }
                TransportError::NoSuchPeer { .. } => None,
            },
            _ => None,
        };
        let deadline = Instant::now() + EXPLAIN_GRACE;
        loop {
            if let Err(mismatch @ CollectiveError::Mismatch { .. }) = self.file_arrivals() {
                return mismatch;
            }
            let waiting =
                culprit.is_some_and(|c| self.pending.iter().any(|&m| self.ex.world(m) == c));
            if !waiting
                || tokio::time::timeout_at(deadline, self.inbox.changed())
                    .await
                    .is_err()
            {
                break;
            }
        }
        if matches!(error, CollectiveError::PeerAborted { .. }) {
            return error;
        }
        match self.check_aborts() {
            Err(aborted) => aborted,
            Ok(()) => error,
        }
    }

    /// Fails if another participant has sent an abort notice.
    fn check_aborts(&self) -> Result<(), CollectiveError> {
        let ex = self.ex;
        for m in ex.others() {
            if let Some(reason) = self.inbox.take(ex.world(m), ABORT) {
                return Err(CollectiveError::PeerAborted {
                    me: ex.me_world(),
                    collective: ex.fingerprint,
                    peer: ex.world(m),
                    reason: String::from_utf8_lossy(&reason).into_owned(),
                });
            }
        }
        Ok(())
    }

    /// Waits for frame `want` (or, with `None`, for every arrival) for at most the timeout.
    async fn wait(&mut self, want: Option<(u32, u32)>) -> Result<Option<Bytes>, CollectiveError> {
        let ex = self.ex;
        let started = Instant::now();
        let deadline = started + ex.timeout;
        loop {
            // Losses seen *before* looking for frames. A transport files a peer's frames before
            // it reports the peer lost, so a frame still absent after the loss was seen will
            // never come; a loss seen only afterwards may have raced with the frame's delivery,
            // and gets one more look.
            let lost_before: Vec<u32> = want
                .map(|(from, _)| from)
                .into_iter()
                .chain(self.pending.iter().copied())
                .filter(|&m| self.inbox.lost(ex.world(m)).is_some())
                .collect();
            self.file_arrivals()?;
            self.check_aborts()?;
            match want {
                Some((from, step)) => {
                    if let Some(frame) = self.inbox.take(ex.world(from), step) {
                        return Ok(Some(frame));
                    }
                }
                None if self.pending.is_empty() => return Ok(None),
                None => {}
            }
            let needed = want
                .map(|(from, _)| from)
                .into_iter()
                .chain(self.pending.iter().copied());
            let mut look_again = false;
            for m in needed {
                if let Some(reason) = self.inbox.lost(ex.world(m)) {
                    if !lost_before.contains(&m) {
                        look_again = true;
                        continue;
                    }
                    return Err(CollectiveError::PeerLost {
                        me: ex.me_world(),
                        collective: ex.fingerprint,
                        peer: ex.world(m),
                        reason,
                    });
                }
            }
            if look_again {
                continue;
            }
            if tokio::time::timeout_at(deadline, self.inbox.changed())
                .await
                .is_err()
            {
                return Err(CollectiveError::Timeout {
                    me: ex.me_world(),
                    collective: ex.fingerprint,
                    waited: started.elapsed(),
                    missing: self.pending.iter().map(|&m| ex.world(m)).collect(),
                    waiting_for: want.map(|(from, step)| (ex.world(from), step)),
                });
            }
        }
    }

    /// Takes the arrivals that came and checks them against this rank's fingerprint.
    fn file_arrivals(&mut self) -> Result<(), CollectiveError> {
        let ex = self.ex;
        let mut i = 0;
        while i < self.pending.len() {
            let m = self.pending[i];
            let Some(frame) = self.inbox.take(ex.world(m), ARRIVAL) else {
                i += 1;
                continue;
            };
            let theirs =
                Fingerprint::decode(&frame).map_err(|problem| CollectiveError::BadFrame {
                    me: ex.me_world(),
                    collective: ex.fingerprint,
                    peer: ex.world(m),
                    step: ARRIVAL,
                    problem,
                })?;
            if theirs != ex.fingerprint {
                return Err(CollectiveError::Mismatch {
                    me: ex.me_world(),
                    mine: ex.fingerprint,
                    peer: ex.world(m),
                    theirs,
                });
            }
            self.pending.swap_remove(i);
            if self.pending.is_empty() {
                ex.arrived
                    .get_or_init(|| (std::time::Instant::now(), Some(ex.world(m))));
            }
        }
        Ok(())
    }
}
