//! Why a rank could not join its job: [`QuicError`], and [`Who`], the rank (or the process not
//! yet given one) that its messages name.

use std::time::Duration;

use bonfire_topology::Rank;

/// A rank in error messages, or a process whose rank the rendezvous has not assigned yet.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Who(pub Option<Rank>);

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(rank) => write!(f, "{rank}"),
            None => write!(f, "this process (no rank assigned yet)"),
        }
    }
}

/// Why a rank could not join its job.
#[derive(Debug, Clone, thiserror::Error)]
pub enum QuicError {
    /// Local setup failed (bind, certificate, configuration).
    #[error("{0}")]
    Setup(String),
    /// The master address did not resolve or answer.
    #[error("the rendezvous at {master} did not answer within {waited:?}: {detail}")]
    Unreachable {
        /// The master address.
        master: String,
        /// How long this rank tried.
        waited: Duration,
        /// The last error.
        detail: String,
    },
    /// The other side refused this rank.
    #[error("{by} refused {me}: {reason}")]
    Refused {
        /// This rank.
        me: Who,
        /// Who refused, in words.
        by: String,
        /// Their reason.
        reason: String,
    },
    /// The other side failed authentication.
    #[error("{me} refused {peer}: {reason}")]
    Unauthenticated {
        /// This rank.
        me: Who,
        /// The peer, in words.
        peer: String,
        /// What failed.
        reason: String,
    },
    /// Not every rank arrived in time.
    #[error("{me} timed out after {waited:?} waiting for {stage}; missing: {missing}")]
    Timeout {
        /// This rank.
        me: Who,
        /// What was awaited.
        stage: &'static str,
        /// How long.
        waited: Duration,
        /// The ranks that did not arrive, in words.
        missing: String,
    },
    /// A link to a peer failed while the job came up.
    #[error("{me} could not link to {peer}: {reason}")]
    Link {
        /// This rank.
        me: Who,
        /// The peer.
        peer: Rank,
        /// Why.
        reason: String,
    },
}
