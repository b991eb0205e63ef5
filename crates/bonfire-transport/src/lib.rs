//! How bonfire ranks move bytes: the [`Transport`] trait, the [`Mailbox`] every transport
//! delivers into, and [`InProcess`], a transport for ranks that are threads of one process.
//!
//! A transport knows nothing of tensors, dtypes or collectives. It carries *frames*: a
//! [`Tag`] and an opaque payload ([`bytes::Bytes`], moved, never copied by the transport), from
//! one rank to another. Frames may arrive in any order; the receiver's [`Mailbox`] files them by
//! tag until the consumer asks for them, so a consumer sees exactly the frame it waits for,
//! whatever the network did.
//!
//! Loss of a peer (its endpoint dropped, its connection closed) is reported to the mailbox, so a
//! consumer waiting for that peer wakes up with an error instead of hanging.

mod error;
mod inproc;
mod job;
mod mailbox;
pub mod placement;
pub mod pool;
pub mod quic;
pub mod shm;
mod sink;
mod tag;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bonfire_topology::Rank;
use bytes::Bytes;

pub use error::TransportError;
pub use inproc::{InProcess, InProcessTransport};
pub use job::{JobTransport, JobTransportError, Lane};
pub use mailbox::{Inbox, Mailbox, OpenError};
pub use quic::{KDF_ROUNDS, QuicConfig, QuicError, QuicTransport, Secret, SecretError, SetupError};
pub use sink::{Expected, Sink};
pub use tag::Tag;

/// `text` a peer sent before proving anything (a refusal's reason, say), safe to log: control
/// characters escaped, so a newline cannot forge a line of the log, and at most 200 characters.
pub fn printable(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(200)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().count() > 200 {
        out.push_str("...");
    }
    out
}

/// Not API: the QUIC frame decoder, for the cargo-fuzz target in `fuzz/` (it enables the
/// `fuzzing` feature). Nothing here is covered by semver; do not use it from other crates.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::quic::frame::{
        FrameError, FrameHeader, FrameKind, HEADER_LEN, MAGIC, SplitFrames, VERSION, split_frames,
    };
}

/// Locks `m`, shrugging off poisoning: every table behind these locks holds plain data that a
/// panic cannot leave half-written (each update is a single insert, remove or store).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The future of [`Transport::send`].
pub type SendFuture<'a> = Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send + 'a>>;

/// Moves frames between the ranks of one job.
///
/// # Contract
/// - `send` hands `payload` to the transport without copying it in the caller's thread beyond
///   what the medium needs; it completes when the frame is on its way (queued or written), not
///   when it is received. Frames to one peer may be delivered in any order.
/// - Frames received from peers are delivered into [`Transport::mailbox`], keyed by sender and
///   tag. A frame is delivered at most once.
/// - When a peer becomes unreachable, the transport calls [`Mailbox::peer_lost`] once, with a
///   reason a person can act on.
pub trait Transport: Send + Sync + 'static {
    /// This endpoint's rank in the world.
    fn rank(&self) -> Rank;

    /// Number of ranks in the world.
    fn world_size(&self) -> usize;

    /// Sends `payload` to `to` under `tag`.
    fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> SendFuture<'_>;

    /// Sends a copy of `payload` to `to` under `tag`, written straight from the caller's memory
    /// where the lane to `to` allows it (shared memory): no frame is allocated and no other
    /// thread copies it. The calling thread does the copy, and may wait for the peer to make
    /// room, as long as the peer is alive and at most until `deadline`. Returns `None`, having
    /// done nothing, where the lane cannot take the bytes this way now; the caller then sends
    /// a frame with [`Transport::send`]. The default never can.
    fn send_from(
        &self,
        to: Rank,
        tag: Tag,
        payload: &[u8],
        deadline: std::time::Instant,
    ) -> Option<Result<(), TransportError>> {
        let _ = (to, tag, payload, deadline);
        None
    }

    /// Asks that the frame `tag` from `from`, if it comes with exactly `sink.len()` bytes, go
    /// straight into `sink` as it comes off the lane, where the lane allows it (shared memory),
    /// instead of into a frame of its own: the receiver's working memory then takes the bytes,
    /// combined into or copied over, without a copy into a frame and out again. When it has
    /// gone there, the lane files an empty frame under `tag` (to wake whoever waits for it) and
    /// [`Expected::filled`] says so; a frame of another length, or one filed before this call,
    /// is filed as usual. Returns `None` where the lane from `from` cannot do this; the default
    /// never can. Dropping the [`Expected`] withdraws the sink.
    fn expect(&self, from: Rank, tag: Tag, sink: Arc<dyn Sink>) -> Option<Expected> {
        let _ = (from, tag, sink);
        None
    }

    /// Where this endpoint's incoming frames are filed.
    fn mailbox(&self) -> &Arc<Mailbox>;

    /// Files, on the calling thread, incoming frames that have wholly arrived but that the
    /// transport's own threads have not filed yet, where the lane allows it (shared memory);
    /// never waits. A thread that waits for a frame calls this while it spins, so that a frame
    /// already in memory does not wait for another thread to be scheduled. Returns whether it
    /// filed any. The default files nothing.
    fn progress(&self) -> bool {
        false
    }

    /// A short name for messages and benchmarks ("in-process", "quic").
    fn kind(&self) -> &'static str;
}

/// Reports a message that ends this process (a failed collective under the exit policy): as a
/// `tracing` error when a subscriber shows errors, else straight on standard error, so it is
/// never lost.
pub fn fatal(message: &str) {
    if tracing::enabled!(tracing::Level::ERROR) {
        tracing::error!("{message}");
    } else {
        eprintln!("{message}");
    }
}
