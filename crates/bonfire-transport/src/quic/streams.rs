//! The data path of one link: its unidirectional QUIC streams, opened when the link starts;
//! a reader per incoming stream that files frames in the mailbox; the watcher that reports the
//! link's loss; and writing one frame, header and payload, on a free stream.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bonfire_topology::Rank;
use bytes::{Bytes, BytesMut};
use quinn::{Connection, ConnectionError, RecvStream, SendStream, VarInt};
use tokio::task::JoinHandle;

use super::control::{CLOSE_BAD_FRAME, CLOSE_SHUTDOWN};
use super::frame::{FrameError, FrameHeader, FrameKind, HEADER_LEN};
use super::shared::{Shared, lock, log};
use crate::Tag;

/// How long the loss watcher lets the readers of a peer that shut down cleanly file the frames
/// already received before it reports the peer gone.
const READERS_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// A link to one peer: the connection and this side's streams to it.
pub(crate) struct Link {
    pub(crate) peer: Rank,
    pub(crate) conn: Connection,
    pub(crate) streams: Vec<tokio::sync::Mutex<SendStream>>,
    next: AtomicUsize,
}

impl Link {
    /// Writes one data frame, from the caller's bytes without a copy, on a free stream if there
    /// is one, else on the next stream in turn once it is free.
    pub(crate) async fn write_frame(
        &self,
        tag: Tag,
        payload: Bytes,
    ) -> Result<(), quinn::WriteError> {
        let header = Bytes::copy_from_slice(&FrameHeader::data(tag, payload.len() as u64).encode());
        // Take a free stream if there is one, else queue on the next in turn.
        let mut guard = None;
        for stream in &self.streams {
            if let Ok(g) = stream.try_lock() {
                guard = Some(g);
                break;
            }
        }
        let mut stream = match guard {
            Some(g) => g,
            None => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
                self.streams[i].lock().await
            }
        };
        stream.write_all_chunks(&mut [header, payload]).await
    }
}

/// What went wrong on a stream: opening it, or a protocol violation by the peer on it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StreamError {
    /// This side could not open its streams to the peer.
    #[error("cannot open a data stream: {0}")]
    Open(ConnectionError),
    /// The peer ended a stream part-way through a frame header.
    #[error("{peer} ended a stream inside a frame header")]
    EndedInHeader { peer: Rank },
    /// The peer sent a header the decoder refused.
    #[error("{peer} sent a malformed frame: {source}")]
    Malformed { peer: Rank, source: FrameError },
    /// The peer ended a stream part-way through a payload.
    #[error("{peer} ended a stream inside a frame ({got} of {len} bytes)")]
    EndedInFrame { peer: Rank, got: usize, len: usize },
}

/// Opens the streams of a link and starts its readers and its loss watcher.
pub(crate) async fn start_link(
    shared: &Arc<Shared>,
    peer: Rank,
    conn: Connection,
) -> Result<(Arc<Link>, Vec<JoinHandle<()>>), StreamError> {
    let mut streams = Vec::with_capacity(shared.streams);
    for _ in 0..shared.streams {
        let s = conn.open_uni().await.map_err(StreamError::Open)?;
        streams.push(tokio::sync::Mutex::new(s));
    }
    let link = Arc::new(Link {
        peer,
        conn: conn.clone(),
        streams,
        next: AtomicUsize::new(0),
    });
    let mut tasks = Vec::new();
    // The readers' tasks, so that the loss watcher can let them file what already arrived.
    let readers: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>> = Arc::default();
    // Says when the acceptor has taken every stream the peer opened: after a close, quinn still
    // hands out the streams that had arrived, then fails.
    let (accepted_all, all_accepted) = tokio::sync::oneshot::channel::<()>();
    // Readers: one per incoming stream.
    {
        let (shared, conn, readers) = (shared.clone(), conn.clone(), readers.clone());
        tasks.push(tokio::spawn(async move {
            while let Ok(stream) = conn.accept_uni().await {
                #[cfg(test)]
                {
                    let ms = shared.slow_filing_ms.load(Ordering::Relaxed);
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                }
                let (shared, conn) = (shared.clone(), conn.clone());
                lock(&readers).push(tokio::spawn(async move {
                    if let Err(e) = read_stream(&shared, peer, stream).await {
                        let reason = e.to_string();
                        shared.mailbox.peer_lost(peer, reason.clone());
                        log(shared.me, format!("closing the link to {peer}: {reason}"));
                        conn.close(VarInt::from_u32(CLOSE_BAD_FRAME), reason.as_bytes());
                    }
                }));
            }
            let _ = accepted_all.send(());
        }));
    }
    // Loss watcher.
    {
        let (shared, link) = (shared.clone(), link.clone());
        tasks.push(tokio::spawn(async move {
            let err = link.conn.closed().await;
            if shared.closing.load(Ordering::Acquire) {
                return;
            }
            // A peer that shut down cleanly waited until this side had acknowledged everything
            // it sent, so its last frames may still sit in this side's stream buffers. Declaring
            // it lost now would fail a receive whose frame is about to be filed: let the readers
            // reach its goodbyes first (they can: buffered data stays readable after a close).
            // The acceptor may not even have taken every stream yet: wait for it first, so that
            // the list of readers is complete.
            if matches!(&err, ConnectionError::ApplicationClosed(c)
                if c.error_code.into_inner() == u64::from(CLOSE_SHUTDOWN))
            {
                let drain = async {
                    // An error means the acceptor was stopped: the job is closing.
                    let _ = all_accepted.await;
                    let pending = std::mem::take(&mut *lock(&readers));
                    for reader in pending {
                        let _ = reader.await;
                    }
                };
                let _ = tokio::time::timeout(READERS_DRAIN, drain).await;
            }
            let reason = match err {
                ConnectionError::ApplicationClosed(c)
                    if c.error_code.into_inner() == u64::from(CLOSE_SHUTDOWN) =>
                {
                    "shut down (its program finished or released bonfire)".to_string()
                }
                ConnectionError::ApplicationClosed(c) => {
                    format!("closed its link: {}", String::from_utf8_lossy(&c.reason))
                }
                ConnectionError::TimedOut => format!(
                    "sent nothing for {:?}: its process died or hung, or the network failed",
                    shared.peer_timeout
                ),
                ConnectionError::LocallyClosed => return,
                other => format!("its link failed: {other}"),
            };
            shared.mailbox.peer_lost(link.peer, reason);
        }));
    }
    Ok((link, tasks))
}

/// Reads frames from one stream until it ends. Errors are protocol violations by the peer.
async fn read_stream(
    shared: &Shared,
    peer: Rank,
    mut stream: RecvStream,
) -> Result<(), StreamError> {
    let mut header = [0u8; HEADER_LEN];
    // Payloads are read into one arena and split off it; once the consumer has dropped them,
    // `reserve` takes the same memory back, so steady traffic allocates (and faults in pages)
    // once instead of once per frame.
    let mut arena = BytesMut::new();
    loop {
        // A clean end of stream is allowed only between frames.
        let mut got = 0;
        while got < HEADER_LEN {
            match stream.read(&mut header[got..]).await {
                Ok(Some(n)) => got += n,
                Ok(None) if got == 0 => return Ok(()),
                Ok(None) => return Err(StreamError::EndedInHeader { peer }),
                // Connection-level failures are reported by the loss watcher.
                Err(_) => return Ok(()),
            }
        }
        let h = FrameHeader::decode(&header, shared.max_frame)
            .map_err(|source| StreamError::Malformed { peer, source })?;
        match h.kind {
            FrameKind::Goodbye => return Ok(()),
            FrameKind::Data => {
                let len = h.len as usize;
                // Grow with the data that actually arrives: an announced length is not an
                // allocation the peer can make us do up front.
                arena.reserve(len.min(64 << 20));
                let buf = &mut arena;
                while buf.len() < len {
                    match stream.read_chunk(len - buf.len(), true).await {
                        Ok(Some(chunk)) => buf.extend_from_slice(&chunk.bytes),
                        Ok(None) => {
                            return Err(StreamError::EndedInFrame {
                                peer,
                                got: buf.len(),
                                len,
                            });
                        }
                        Err(_) => return Ok(()),
                    }
                }
                let frame = arena.split().freeze();
                #[cfg(test)]
                {
                    let ms = shared.slow_filing_ms.load(Ordering::Relaxed);
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                }
                shared.mailbox.deliver(peer, h.tag, frame);
            }
        }
    }
}
