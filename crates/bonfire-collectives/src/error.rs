use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bonfire_topology::Rank;
use bonfire_transport::TransportError;

use crate::{Algorithm, Fingerprint};

/// Why a collective failed. Every variant names the rank that reports it (`me`), the collective
/// (its [`Fingerprint`]: operation, sequence number, sizes, group) and the other rank involved.
/// Ranks are world ranks.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CollectiveError {
    /// Two ranks called different collectives at the same point of the same group.
    #[error("collective mismatch: {me} called {mine}, but {peer} called {theirs}")]
    Mismatch {
        /// The reporting rank.
        me: Rank,
        /// What the reporting rank called.
        mine: Fingerprint,
        /// The rank that called something else.
        peer: Rank,
        /// What that rank called.
        theirs: Fingerprint,
    },
    /// A wait took longer than the communicator's timeout.
    #[error("{collective} timed out on {me} after {:.1?}: {}", waited, Stall { missing, waiting_for })]
    Timeout {
        /// The reporting rank.
        me: Rank,
        /// The collective.
        collective: Fingerprint,
        /// How long the failed wait lasted.
        waited: Duration,
        /// Ranks that never announced that they had started this collective.
        missing: Vec<Rank>,
        /// The rank and step of the frame the reporting rank was waiting for, if any.
        waiting_for: Option<(Rank, u32)>,
    },
    /// A rank this collective needs became unreachable.
    #[error("{collective} failed on {me}: {peer} is unreachable: {reason}")]
    PeerLost {
        /// The reporting rank.
        me: Rank,
        /// The collective.
        collective: Fingerprint,
        /// The unreachable rank.
        peer: Rank,
        /// Why, as the transport saw it.
        reason: Arc<str>,
    },
    /// Another rank failed this collective and told the others.
    #[error("{collective} failed on {me}: {peer} aborted it: {reason}")]
    PeerAborted {
        /// The reporting rank.
        me: Rank,
        /// The collective.
        collective: Fingerprint,
        /// The rank that failed first.
        peer: Rank,
        /// That rank's error.
        reason: String,
    },
    /// A frame did not fit the collective: wrong size or unreadable.
    #[error(
        "{collective} failed on {me}: {peer} sent a malformed frame (step {step:#x}): {problem}"
    )]
    BadFrame {
        /// The reporting rank.
        me: Rank,
        /// The collective.
        collective: Fingerprint,
        /// The sender.
        peer: Rank,
        /// The frame's step.
        step: u32,
        /// What is wrong with it.
        problem: String,
    },
    /// Sending a frame failed.
    #[error("{collective} failed on {me}: {source}")]
    Transport {
        /// The reporting rank.
        me: Rank,
        /// The collective.
        collective: Fingerprint,
        /// The transport's error.
        source: TransportError,
    },
    /// The call's arguments are invalid; the other ranks are told, so they fail too.
    #[error("invalid {op} on {me}: {problem}")]
    InvalidArgument {
        /// The reporting rank.
        me: Rank,
        /// The operation called.
        op: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// A forced algorithm that this collective does not implement.
    #[error(
        "{op} on {me} has no {algorithm} schedule; it implements {}",
        names(supported)
    )]
    UnsupportedAlgorithm {
        /// The reporting rank.
        me: Rank,
        /// The operation called.
        op: &'static str,
        /// The algorithm asked for.
        algorithm: Algorithm,
        /// The algorithms the operation implements.
        supported: &'static [Algorithm],
    },
    /// A defect in bonfire (a panic in a collective's task); please report it.
    #[error("internal error in {op} on {me}: {problem}")]
    Internal {
        /// The reporting rank.
        me: Rank,
        /// The operation.
        op: &'static str,
        /// What happened.
        problem: String,
    },
}

impl CollectiveError {
    /// The rank that reported the error.
    pub fn rank(&self) -> Rank {
        match self {
            CollectiveError::Mismatch { me, .. }
            | CollectiveError::Timeout { me, .. }
            | CollectiveError::PeerLost { me, .. }
            | CollectiveError::PeerAborted { me, .. }
            | CollectiveError::BadFrame { me, .. }
            | CollectiveError::Transport { me, .. }
            | CollectiveError::InvalidArgument { me, .. }
            | CollectiveError::UnsupportedAlgorithm { me, .. }
            | CollectiveError::Internal { me, .. } => *me,
        }
    }
}

fn names(algorithms: &[Algorithm]) -> String {
    let names: Vec<_> = algorithms.iter().map(|a| a.name()).collect();
    names.join(", ")
}

struct Stall<'a> {
    missing: &'a [Rank],
    waiting_for: &'a Option<(Rank, u32)>,
}

impl fmt::Display for Stall<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.missing.is_empty() {
            let ranks: Vec<String> = self.missing.iter().map(|r| r.0.to_string()).collect();
            let s = if self.missing.len() == 1 { "" } else { "s" };
            write!(f, "rank{s} {} did not arrive", ranks.join(", "))?;
            if self.waiting_for.is_some() {
                f.write_str("; ")?;
            }
        }
        match self.waiting_for {
            Some((peer, step)) => write!(f, "no frame from {peer} for step {step:#x}"),
            None if self.missing.is_empty() => f.write_str("nothing was pending"),
            None => Ok(()),
        }
    }
}
