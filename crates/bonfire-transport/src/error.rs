use std::sync::Arc;

use bonfire_topology::Rank;

/// What can go wrong when moving a frame.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    /// The peer is unreachable: its endpoint closed, its process died, its connection failed.
    #[error("{peer} is unreachable: {reason}")]
    PeerLost {
        /// The unreachable peer.
        peer: Rank,
        /// Why, in words.
        reason: Arc<str>,
    },
    /// A frame was addressed to a rank outside the job.
    #[error("{peer} is not part of this job of {world} ranks")]
    NoSuchPeer {
        /// The rank that was addressed.
        peer: Rank,
        /// Number of ranks in the job.
        world: usize,
    },
    /// The medium refused the frame.
    #[error("sending to {peer} failed: {reason}")]
    Send {
        /// The addressee.
        peer: Rank,
        /// Why, in words.
        reason: String,
    },
}
