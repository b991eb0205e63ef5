//! A single-producer, single-consumer byte ring in a shared segment: the producer copies bytes
//! in at `head`, the consumer copies them out at `tail`, and each wakes the other through a futex
//! word only when the other is asleep. Waits spin briefly, then sleep in short ticks, checking
//! between ticks that the other process is alive and that nobody closed the ring, so a peer that
//! dies mid-write (or holding nothing: there are no locks) never hangs this one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use super::segment::Segment;
use super::sys::{Process, futex_wait, futex_wake};

/// Marks a segment as a bonfire ring of this layout ("bfshmrg2"; the sleep flags became 64-bit
/// words holding the counter their side read).
const MAGIC: u64 = 0x6266_7368_6d72_6732;
/// Where the data starts; the control block lives in the first page.
pub(crate) const DATA_OFFSET: usize = 4096;
/// How long one sleep lasts before the other process's liveness is checked again.
const TICK: Duration = Duration::from_millis(20);
/// Busy-wait iterations before yielding, and yields before sleeping.
const SPINS: u32 = 64;
const YIELDS: u32 = 64;
/// Set in a sleep flag while its side sleeps; the low 32 bits hold the word it sleeps on, as it
/// read it before it went to sleep.
const ASLEEP: u64 = 1 << 32;

#[cfg(test)]
thread_local! {
    /// Yields this thread has made in ring waits (tests only).
    pub(crate) static YIELDED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The control block at the start of the segment: the creator's settings, then each counter on
/// its own cache line.
#[repr(C)]
struct Control {
    magic: AtomicU64,
    capacity: AtomicU64,
    nonce: [AtomicU64; 2],
    _settings: [u8; 32],
    /// Bytes ever written (producer).
    head: AtomicU64,
    _h: [u8; 56],
    /// Bytes ever consumed (consumer).
    tail: AtomicU64,
    _t: [u8; 56],
    /// Bumped by the producer after each publish; the consumer sleeps on it.
    data_seq: AtomicU32,
    _dp: [u8; 4],
    /// The consumer's sleep flag: 0 awake, else [`ASLEEP`] and the value of `data_seq` it read
    /// before it went to sleep.
    consumer_sleeps: AtomicU64,
    _d: [u8; 48],
    /// Bumped by the consumer after each release; the producer sleeps on it.
    space_seq: AtomicU32,
    _sp: [u8; 4],
    /// The producer's sleep flag, as `consumer_sleeps` with `space_seq`.
    producer_sleeps: AtomicU64,
    _s: [u8; 48],
    /// Set by the consumer when it stops reading for good.
    consumer_closed: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Control>() <= DATA_OFFSET);

/// Why a ring operation stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RingStop {
    /// The other process exited.
    PeerExited,
    /// The consumer closed the ring (the peer is shutting down).
    Closed,
    /// This rank is shutting down.
    Stopping,
    /// The deadline passed while waiting for room (the consumer is alive but not reading).
    TimedOut,
    /// The ring's counters say something no ring holds (more published than it has room for,
    /// or more taken than published): the segment was damaged or written by something else.
    Corrupt {
        /// Bytes ever written, as read.
        head: u64,
        /// Bytes ever taken, as read.
        tail: u64,
    },
}

/// Where [`Ring::read`] puts the bytes it takes. The bytes are copied out of the shared mapping
/// with raw copies: a reference to memory another process may write is not sound in Rust's
/// model, whatever that process is supposed to do.
pub(crate) enum Dest<'a> {
    /// Dropped (the caller already has them from [`Ring::peek`]).
    Nowhere,
    /// Appended.
    Append(&'a mut Vec<u8>),
    /// Written from the start, in order; it must be at least as long as what is read.
    Slice(&'a mut [u8]),
}

/// Who waits: the consumer (for data), or the producer (for room, until an optional deadline).
#[derive(Copy, Clone)]
enum Side {
    /// The rest of a frame that is being written.
    Consumer,
    /// The next frame, which may be a whole step away: no yields (see [`Ring::wait_data`]).
    NextFrame,
    Producer(Option<Instant>),
}

/// One side's view of a ring.
pub(crate) struct Ring {
    seg: Arc<Segment>,
    capacity: usize,
}

impl Ring {
    /// The segment length that holds a ring of `capacity` bytes.
    pub(crate) fn segment_len(capacity: usize) -> usize {
        DATA_OFFSET + capacity
    }

    /// Writes the control block of a fresh segment (before anyone else maps it).
    pub(crate) fn init(seg: Arc<Segment>, nonce: [u64; 2]) -> Ring {
        let capacity = seg.len() - DATA_OFFSET;
        let ring = Ring { seg, capacity };
        let c = ring.control();
        c.capacity.store(capacity as u64, Ordering::Relaxed);
        c.nonce[0].store(nonce[0], Ordering::Relaxed);
        c.nonce[1].store(nonce[1], Ordering::Relaxed);
        c.magic.store(MAGIC, Ordering::Release);
        ring
    }

    /// The ring of a segment another rank made, if its control block says what the offer said.
    pub(crate) fn attach(seg: Arc<Segment>, nonce: [u64; 2]) -> Result<Ring, String> {
        if seg.len() <= DATA_OFFSET {
            return Err("the segment is too small".into());
        }
        let capacity = seg.len() - DATA_OFFSET;
        let ring = Ring { seg, capacity };
        let c = ring.control();
        if c.magic.load(Ordering::Acquire) != MAGIC {
            return Err("the segment is not a bonfire ring".into());
        }
        if c.capacity.load(Ordering::Relaxed) != capacity as u64
            || c.nonce[0].load(Ordering::Relaxed) != nonce[0]
            || c.nonce[1].load(Ordering::Relaxed) != nonce[1]
        {
            return Err("the segment's control block does not match the offer".into());
        }
        Ok(ring)
    }

    /// Publishes so far (tests).
    #[cfg(test)]
    pub(crate) fn publishes(&self) -> u32 {
        self.control().data_seq.load(Ordering::SeqCst)
    }

    /// Whether the consumer says it sleeps (tests).
    #[cfg(test)]
    pub(crate) fn consumer_asleep(&self) -> bool {
        self.control().consumer_sleeps.load(Ordering::SeqCst) != 0
    }

    fn control(&self) -> &Control {
        // SAFETY: the mapping is page-aligned and at least DATA_OFFSET long; Control is made of
        // atomics and padding, valid for any bit pattern.
        unsafe { &*(self.seg.ptr() as *const Control) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: DATA_OFFSET is inside the mapping.
        unsafe { self.seg.ptr().add(DATA_OFFSET) }
    }

    /// The bytes published and not taken, if the counters are those of a ring.
    fn used(&self, head: u64, tail: u64) -> Result<usize, RingStop> {
        head.checked_sub(tail)
            .filter(|&d| d <= self.capacity as u64)
            .map(|d| d as usize)
            .ok_or(RingStop::Corrupt { head, tail })
    }

    /// Producer: the bytes that can be written without waiting (none when the counters are
    /// damaged: the write then finds out).
    pub(crate) fn room(&self) -> usize {
        let c = self.control();
        let (head, tail) = (
            c.head.load(Ordering::Relaxed),
            c.tail.load(Ordering::Acquire),
        );
        self.used(head, tail).map_or(0, |used| self.capacity - used)
    }

    /// Producer: copies every byte of `parts`, in order, waiting for room as needed. Publishes
    /// at most a quarter of the ring at a time, so the consumer copies out while this copies in.
    pub(crate) fn write(
        &self,
        parts: &[&[u8]],
        peer: &Process,
        stop: &AtomicBool,
    ) -> Result<(), RingStop> {
        self.write_until(parts, peer, stop, None)
    }

    /// As [`Ring::write`], giving up with [`RingStop::TimedOut`] once `deadline` passes while
    /// waiting for room. What was written before then stays written: after a timeout the ring
    /// holds part of a record, so the producer must not write to it again.
    pub(crate) fn write_until(
        &self,
        parts: &[&[u8]],
        peer: &Process,
        stop: &AtomicBool,
        deadline: Option<Instant>,
    ) -> Result<(), RingStop> {
        let c = self.control();
        let cap = self.capacity;
        let step = (cap / 4).max(1);
        let mut head = c.head.load(Ordering::Relaxed);
        let mut left: usize = parts.iter().map(|p| p.len()).sum();
        // Where the next byte comes from: part `part`, at `off`.
        let (mut part, mut off) = (0, 0);
        while left > 0 {
            let mut tail = c.tail.load(Ordering::Acquire);
            if self.used(head, tail)? == cap {
                self.wait(
                    &c.space_seq,
                    &c.producer_sleeps,
                    // Damaged counters end the wait too: the check below reports them.
                    || {
                        !matches!(
                            self.used(head, c.tail.load(Ordering::Acquire)),
                            Ok(used) if used == cap
                        )
                    },
                    peer,
                    stop,
                    Side::Producer(deadline),
                )?;
                tail = c.tail.load(Ordering::Acquire);
            }
            // One publish per piece, across parts: a frame that fits in one piece goes out
            // whole when the room allows, so the consumer does not wake for its record alone.
            let mut n = (cap - self.used(head, tail)?).min(left).min(step);
            left -= n;
            let mut at = (head % cap as u64) as usize;
            head += n as u64;
            while n > 0 {
                let src = &parts[part][off..];
                let k = src.len().min(n).min(cap - at);
                // SAFETY: [at, at + k) lies in the data area, and the consumer does not read it
                // until `head` is published below.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(at), k);
                }
                n -= k;
                at = (at + k) % cap;
                off += k;
                if off == parts[part].len() {
                    part += 1;
                    off = 0;
                }
            }
            c.head.store(head, Ordering::Release);
            signal(&c.data_seq, &c.consumer_sleeps);
        }
        Ok(())
    }

    /// Producer: waits until the consumer has taken everything written.
    pub(crate) fn drain(&self, peer: &Process, stop: &AtomicBool) -> Result<(), RingStop> {
        let c = self.control();
        let head = c.head.load(Ordering::Relaxed);
        self.wait(
            &c.space_seq,
            &c.producer_sleeps,
            || c.tail.load(Ordering::Acquire) == head,
            peer,
            stop,
            Side::Producer(None),
        )
    }

    /// Consumer: the bytes published and not yet taken.
    pub(crate) fn available(&self) -> Result<usize, RingStop> {
        let c = self.control();
        self.used(
            c.head.load(Ordering::Acquire),
            c.tail.load(Ordering::Acquire),
        )
    }

    /// Consumer: copies the next `out.len()` bytes without taking them; they must be
    /// [`Ring::available`].
    pub(crate) fn peek(&self, out: &mut [u8]) {
        let c = self.control();
        let cap = self.capacity;
        debug_assert!(self.available().is_ok_and(|n| out.len() <= n));
        let at = (c.tail.load(Ordering::Relaxed) % cap as u64) as usize;
        let first = out.len().min(cap - at);
        let (a, b) = out.split_at_mut(first);
        // SAFETY: the producer published these bytes and does not write them again until
        // `tail` moves past them, which only the consumer does.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().add(at), a.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data(), b.as_mut_ptr(), b.len());
        }
    }

    /// Consumer: waits until something is published that nobody has taken (another thread of
    /// this rank may take it first).
    ///
    /// It spins briefly, then sleeps, and never yields: the next frame may be a whole training
    /// step away, and a yielding thread is a runnable one. Where this rank's compute shares its
    /// core with the reader threads of the node (two ranks on two cores), each yield handed the
    /// core to the other yielding reader and back, 64 times per frame, and the rank computed
    /// its backward about 1 ms slower per step, which kept it late for good (BENCHMARKS.md,
    /// "Page faults decided which rank was late"). A waiting collective takes ready frames itself
    /// ([`crate::Transport::progress`]), so the reader thread's wake-up is off the short path.
    pub(crate) fn wait_data(&self, peer: &Process, stop: &AtomicBool) -> Result<(), RingStop> {
        let c = self.control();
        self.wait(
            &c.data_seq,
            &c.consumer_sleeps,
            || c.head.load(Ordering::Acquire) != c.tail.load(Ordering::Acquire),
            peer,
            stop,
            Side::NextFrame,
        )
    }

    /// Consumer: takes exactly `n` bytes into `dest`, releasing each contiguous piece's room as
    /// soon as it is copied.
    pub(crate) fn read(
        &self,
        n: usize,
        peer: &Process,
        stop: &AtomicBool,
        mut dest: Dest<'_>,
    ) -> Result<(), RingStop> {
        if let Dest::Slice(out) = &dest {
            assert!(out.len() >= n, "a slice of {} bytes for {n}", out.len());
        }
        let mut filled = 0;
        let c = self.control();
        let cap = self.capacity;
        let mut tail = c.tail.load(Ordering::Relaxed);
        let mut left = n;
        while left > 0 {
            let mut head = c.head.load(Ordering::Acquire);
            if head == tail {
                self.wait(
                    &c.data_seq,
                    &c.consumer_sleeps,
                    || c.head.load(Ordering::Acquire) != tail,
                    peer,
                    stop,
                    Side::Consumer,
                )?;
                head = c.head.load(Ordering::Acquire);
            }
            let at = (tail % cap as u64) as usize;
            let k = self.used(head, tail)?.min(left).min(cap - at);
            // SAFETY: [at, at + k) lies in the data area; the producer published it and writes
            // there again only after `tail` moves past it below. Raw copies: no reference to the
            // shared bytes is made.
            unsafe {
                let src = self.data().add(at);
                match &mut dest {
                    Dest::Nowhere => {}
                    Dest::Append(v) => {
                        v.reserve(k);
                        std::ptr::copy_nonoverlapping(src, v.as_mut_ptr().add(v.len()), k);
                        v.set_len(v.len() + k);
                    }
                    Dest::Slice(out) => {
                        std::ptr::copy_nonoverlapping(src, out.as_mut_ptr().add(filled), k);
                    }
                }
            }
            filled += k;
            tail += k as u64;
            left -= k;
            c.tail.store(tail, Ordering::Release);
            signal(&c.space_seq, &c.producer_sleeps);
        }
        Ok(())
    }

    /// Sets the counters as a damaged segment would have them, and wakes both sides (tests).
    #[cfg(test)]
    pub(crate) fn damage(&self, head: u64, tail: u64) {
        let c = self.control();
        c.head.store(head, Ordering::Release);
        c.tail.store(tail, Ordering::Release);
        signal(&c.data_seq, &c.consumer_sleeps);
        signal(&c.space_seq, &c.producer_sleeps);
    }

    /// Consumer: stops reading for good; a producer waiting for room gives up.
    pub(crate) fn close(&self) {
        let c = self.control();
        c.consumer_closed.store(1, Ordering::Release);
        c.space_seq.fetch_add(1, Ordering::Release);
        futex_wake(&c.space_seq);
    }

    /// Waits until `ready`, spinning, then yielding, then sleeping on `word` in ticks (cut short
    /// by a producer's deadline).
    fn wait(
        &self,
        word: &AtomicU32,
        sleeps: &AtomicU64,
        ready: impl Fn() -> bool,
        peer: &Process,
        stop: &AtomicBool,
        side: Side,
    ) -> Result<(), RingStop> {
        let (producer, deadline, yields) = match side {
            Side::Producer(deadline) => (true, deadline, YIELDS),
            Side::Consumer => (false, None, YIELDS),
            Side::NextFrame => (false, None, 0),
        };
        let c = self.control();
        for _ in 0..SPINS {
            if ready() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        for _ in 0..yields {
            if ready() {
                return Ok(());
            }
            #[cfg(test)]
            YIELDED.with(|y| y.set(y.get() + 1));
            std::thread::yield_now();
        }
        loop {
            let seen = word.load(Ordering::Acquire);
            sleeps.store(ASLEEP | u64::from(seen), Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if ready() {
                sleeps.store(0, Ordering::Relaxed);
                return Ok(());
            }
            let tick = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        sleeps.store(0, Ordering::Relaxed);
                        return if ready() {
                            Ok(())
                        } else {
                            Err(RingStop::TimedOut)
                        };
                    }
                    left.min(TICK)
                }
                None => TICK,
            };
            futex_wait(word, seen, tick);
            sleeps.store(0, Ordering::Relaxed);
            if ready() {
                return Ok(());
            }
            if producer && c.consumer_closed.load(Ordering::Acquire) != 0 {
                return Err(RingStop::Closed);
            }
            if stop.load(Ordering::Acquire) {
                return Err(RingStop::Stopping);
            }
            if !peer.alive() {
                // A last look: it may have published just before it exited.
                return if ready() {
                    Ok(())
                } else {
                    Err(RingStop::PeerExited)
                };
            }
        }
    }
}

/// Publishes a change of `word` and wakes the other side if it sleeps on it.
///
/// One system call per sleep: the first publish that changes the word from the value the
/// sleeper read before it went to sleep takes the sleeper's flag down (a compare-and-swap) and
/// makes the call; the publishes after it, before the sleeper has run, find the flag down. That
/// publish's change guarantees the sleep ends: either the sleeper is already in `futex_wait` and
/// is woken, or it gets there later and finds the word no longer what it read. A publish the
/// sleeper had already seen when it read the word leaves the flag alone (its bytes were visible
/// to the sleeper's last look, and another thread of the consumer may have taken them): taking
/// the flag down then would let the sleeper sleep through the next publish.
fn signal(word: &AtomicU32, sleeps: &AtomicU64) {
    let before = word.fetch_add(1, Ordering::Release);
    wake_if_asleep(word, sleeps, before);
}

/// The second half of [`signal`], for the publish that found the word at `before`.
fn wake_if_asleep(word: &AtomicU32, sleeps: &AtomicU64, before: u32) {
    fence(Ordering::SeqCst);
    let flag = sleeps.load(Ordering::SeqCst);
    if flag != 0
        && changes_what_it_read(flag, before)
        && sleeps
            .compare_exchange(flag, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    {
        futex_wake(word);
    }
}

/// Whether a publish that found the word at `before` came after the sleeper whose flag is
/// `flag` read it (counters wrap; they are never 2^31 apart).
fn changes_what_it_read(flag: u64, before: u32) -> bool {
    let seen = flag as u32;
    before.wrapping_sub(seen) as i32 >= 0
}

#[cfg(test)]
mod flag_tests {
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    use super::super::sys::WAKES;
    use super::{ASLEEP, changes_what_it_read, signal, wake_if_asleep};

    /// The order a review found a wake-up lost in: a publish bumps the counter; another thread
    /// of the consumer takes its frame; the reader reads the counter, raises its flag, finds
    /// nothing and is about to sleep; only then does the publish look at the flag. It must
    /// leave the flag up (the reader saw its bump), so that the next publish, which the reader
    /// has not seen, takes it down and wakes it. (Before, the late look took the flag down and
    /// woke nobody, and the next publish found the flag down: the reader slept a whole tick.)
    #[test]
    fn a_late_look_at_the_flag_leaves_it_for_the_next_publish() {
        let (word, sleeps) = (AtomicU32::new(41), AtomicU64::new(0));
        let wakes = || WAKES.with(std::cell::Cell::get);
        let start = wakes();
        // The publish's bump.
        let before = word.fetch_add(1, Ordering::Release);
        // The reader, after the frame was taken: reads 42 and raises its flag.
        let seen = word.load(Ordering::Acquire);
        sleeps.store(ASLEEP | u64::from(seen), Ordering::SeqCst);
        // The publish's late look.
        wake_if_asleep(&word, &sleeps, before);
        assert_eq!(
            sleeps.load(Ordering::SeqCst),
            ASLEEP | 42,
            "the flag was taken down"
        );
        assert_eq!(wakes(), start);
        // The next publish wakes the reader, once.
        signal(&word, &sleeps);
        assert_eq!(sleeps.load(Ordering::SeqCst), 0);
        assert_eq!(wakes(), start + 1);
        signal(&word, &sleeps);
        assert_eq!(wakes(), start + 1);
    }

    /// A publish wakes a sleeper only if its change came after the sleeper's read of the word,
    /// across the counter's wrap.
    #[test]
    fn a_publish_the_sleeper_had_seen_leaves_its_flag_alone() {
        for seen in [0u32, 7, u32::MAX - 1, u32::MAX] {
            let flag = ASLEEP | u64::from(seen);
            // The publish that moved the word from `seen`, and later ones.
            assert!(changes_what_it_read(flag, seen));
            assert!(changes_what_it_read(flag, seen.wrapping_add(3)));
            // Publishes before the read.
            assert!(!changes_what_it_read(flag, seen.wrapping_sub(1)));
            assert!(!changes_what_it_read(flag, seen.wrapping_sub(1000)));
        }
    }
}
