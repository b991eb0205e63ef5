//! Frames received in place: a [`Sink`] is the receiver's own memory, registered for one frame
//! before it arrives (see [`crate::Transport::expect`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::{Tag, lock};

/// Where the payload of one expected frame goes as it comes off a lane.
pub trait Sink: Send + Sync {
    /// The payload's length in bytes; a frame of another length is filed as usual.
    fn len(&self) -> usize;

    /// Whether [`Sink::len`] is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the payload's bytes `at..at + piece.len()`. Pieces come in order, each once, and
    /// together cover the payload; every piece but the last is a multiple of 64 KiB long. Runs on
    /// whichever thread takes the frame off the lane (the lane's reader thread, or a thread
    /// waiting for a collective), so it must not wait for anything. A panic withdraws the sink:
    /// the rest of the frame is dropped and [`Expected::filled`] stays false.
    fn take(&self, at: usize, piece: &[u8]);
}

/// A sink registered for one frame, as the lane holds it.
pub(crate) struct Slot {
    pub(crate) tag: Tag,
    pub(crate) len: usize,
    /// `None` once withdrawn: the lane takes the rest of the frame and drops it.
    pub(crate) sink: Mutex<Option<Arc<dyn Sink>>>,
    /// Set once every byte of the frame went into the sink.
    pub(crate) filled: AtomicBool,
}

/// The sinks registered on one lane.
pub(crate) type Sinks = Arc<Mutex<Vec<Arc<Slot>>>>;

impl Slot {
    /// Registers `sink` for frame `tag` on the lane whose sinks are `sinks`.
    pub(crate) fn register(sinks: &Sinks, tag: Tag, sink: Arc<dyn Sink>) -> Expected {
        let slot = Arc::new(Slot {
            tag,
            len: sink.len(),
            sink: Mutex::new(Some(sink)),
            filled: AtomicBool::new(false),
        });
        lock(sinks).push(slot.clone());
        Expected {
            slot,
            sinks: sinks.clone(),
        }
    }

    /// Takes the slot registered for a frame `tag` of `len` bytes off `sinks`, if there is one.
    pub(crate) fn claim(sinks: &Sinks, tag: Tag, len: usize) -> Option<Arc<Slot>> {
        let mut sinks = lock(sinks);
        let i = sinks.iter().position(|s| s.tag == tag && s.len == len)?;
        Some(sinks.swap_remove(i))
    }
}

/// A frame expected straight into a [`Sink`] (see [`crate::Transport::expect`]). Dropping it
/// withdraws the sink: once the drop returns, the lane never calls the sink again, so the memory
/// behind it is the caller's again.
pub struct Expected {
    slot: Arc<Slot>,
    sinks: Sinks,
}

impl Expected {
    /// Whether the whole frame went into the sink. Once the lane has filed the frame's empty
    /// marker, this is final.
    pub fn filled(&self) -> bool {
        self.slot.filled.load(Ordering::Acquire)
    }
}

impl Drop for Expected {
    fn drop(&mut self) {
        lock(&self.sinks).retain(|s| !Arc::ptr_eq(s, &self.slot));
        // Waits for a piece being taken now, if any.
        *lock(&self.slot.sink) = None;
    }
}

impl std::fmt::Debug for Expected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Expected")
            .field("tag", &self.slot.tag)
            .field("len", &self.slot.len)
            .field("filled", &self.filled())
            .finish()
    }
}
