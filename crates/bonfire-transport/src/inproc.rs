use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bonfire_topology::Rank;
use bytes::Bytes;

use crate::{Mailbox, SendFuture, Tag, Transport, TransportError};

/// A transport for ranks that are threads of one process.
///
/// A frame is handed to the receiver's mailbox as the same [`Bytes`]: no copy, no
/// serialisation. Dropping a rank's endpoint tells every other rank it is gone.
pub struct InProcess;

impl InProcess {
    /// Endpoints for a world of `n` ranks; endpoint `i` is rank `i`.
    pub fn world(n: usize) -> Vec<InProcessTransport> {
        let shared = Arc::new(Shared {
            mailboxes: (0..n).map(|_| Arc::new(Mailbox::new())).collect(),
            alive: (0..n).map(|_| AtomicBool::new(true)).collect(),
        });
        (0..n)
            .map(|r| InProcessTransport {
                rank: Rank::from(r),
                shared: shared.clone(),
            })
            .collect()
    }
}

struct Shared {
    mailboxes: Vec<Arc<Mailbox>>,
    alive: Vec<AtomicBool>,
}

/// One rank's endpoint of an [`InProcess`] world.
pub struct InProcessTransport {
    rank: Rank,
    shared: Arc<Shared>,
}

impl Transport for InProcessTransport {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.mailboxes.len()
    }

    fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> SendFuture<'_> {
        let result = match self.shared.alive.get(to.index()) {
            None => Err(TransportError::NoSuchPeer {
                peer: to,
                world: self.world_size(),
            }),
            Some(alive) if !alive.load(Ordering::Acquire) => Err(TransportError::PeerLost {
                peer: to,
                reason: "its in-process endpoint was dropped".into(),
            }),
            Some(_) => {
                self.shared.mailboxes[to.index()].deliver(self.rank, tag, payload);
                Ok(())
            }
        };
        Box::pin(std::future::ready(result))
    }

    fn mailbox(&self) -> &Arc<Mailbox> {
        &self.shared.mailboxes[self.rank.index()]
    }

    fn kind(&self) -> &'static str {
        "in-process"
    }
}

impl Drop for InProcessTransport {
    fn drop(&mut self) {
        self.shared.alive[self.rank.index()].store(false, Ordering::Release);
        for (r, mailbox) in self.shared.mailboxes.iter().enumerate() {
            if r != self.rank.index() {
                mailbox.peer_lost(self.rank, "its in-process endpoint was dropped");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn frames_move_without_copies() {
        let mut world = InProcess::world(2);
        let b = world.pop().unwrap();
        let a = world.pop().unwrap();
        let payload = Bytes::from(vec![1u8, 2, 3]);
        let ptr = payload.as_ptr();
        let tag = Tag {
            context: 1,
            seq: 0,
            step: 0,
        };
        a.send(Rank(1), tag, payload).await.unwrap();
        let inbox = b.mailbox().open(1, 0).unwrap();
        let got = inbox.take(Rank(0), 0).unwrap();
        assert_eq!(
            got.as_ptr(),
            ptr,
            "the receiver sees the sender's allocation"
        );
        assert!(matches!(
            a.send(Rank(5), tag, Bytes::new()).await,
            Err(TransportError::NoSuchPeer { .. })
        ));
        drop(b);
        assert!(matches!(
            a.send(Rank(1), tag, Bytes::new()).await,
            Err(TransportError::PeerLost { peer: Rank(1), .. })
        ));
        assert!(a.mailbox().lost_reason(Rank(1)).is_some());
    }
}
