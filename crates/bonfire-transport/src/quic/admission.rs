//! The rendezvous' decisions, sans-IO: whether a hello is from this job (protocol, world size,
//! round, rank, proof of the secret), and every reason a rank refuses a process, in words the
//! refused side shows its user. No sockets here: the socket code in `rendezvous.rs` and
//! `links.rs` asks, then acts.

use std::fmt;

use bonfire_topology::Rank;

use super::auth::{PROOF_LEN, ROLE_CLIENT, Secret};
use super::control::{JobKey, PROTOCOL};

/// What a hello claims about the job it belongs to, and its proof of the secret.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Claim {
    pub(crate) protocol: u32,
    pub(crate) job: JobKey,
    pub(crate) proof: [u8; PROOF_LEN],
}

/// The process behind a hello, in words: the rank it claims, or none yet.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Claimant(pub(crate) Option<u32>);

impl fmt::Display for Claimant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(r) => write!(f, "the process claiming rank {r}"),
            None => write!(f, "a process asking for a rank"),
        }
    }
}

/// Why a rank refuses a process. The text goes to the refused side in `Reject`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// Another version of the control protocol.
    #[error(
        "protocol version {theirs} against this rank's {PROTOCOL}: run the same bonfire version on every rank"
    )]
    Protocol { theirs: u32 },
    /// A job of another size.
    #[error("world size mismatch: {claimant} expects {theirs} ranks, this job has {ours}")]
    WorldSize {
        claimant: Claimant,
        theirs: u32,
        ours: u32,
    },
    /// Another restart round.
    #[error("restart round mismatch: {claimant} is in round {theirs}, this job is in round {ours}")]
    Round {
        claimant: Claimant,
        theirs: u32,
        ours: u32,
    },
    /// A rank that no worker of this job has.
    #[error("rank {rank} is not a worker rank of a job of {world} ranks")]
    NotAWorker { rank: u32, world: usize },
    /// The proof does not verify: another job's secret, or none.
    #[error("wrong job secret: {claimant} does not hold the secret of this job")]
    WrongSecret { claimant: Claimant },
    /// A worker's hello sent to a rank other than 0.
    #[error("{me} does not host the rendezvous (rank 0 does)")]
    NotHost { me: Rank },
    /// A hello after the rendezvous closed.
    #[error("the job has already started")]
    Started,
    /// A handshake without a client certificate.
    #[error("no client certificate")]
    NoCertificate,
    /// The rank asked for is taken.
    #[error("rank {rank} has already joined this job")]
    Taken { rank: u32 },
    /// No worker rank is left to assign.
    #[error("the job is full: all {world} ranks have joined")]
    Full { world: usize },
    /// A lower rank dialled a higher one (the higher rank dials).
    #[error("rank {rank} should be dialled by {me}, not dial it")]
    WrongDirection { rank: u32, me: Rank },
    /// This rank stopped before the roster came.
    #[error("this rank is shutting down")]
    ShuttingDown,
    /// A peer whose certificate is not the one rank 0 recorded for its rank.
    #[error(
        "the process claiming rank {rank} shows a certificate other than the one pinned at the rendezvous"
    )]
    NotPinned { rank: u32 },
    /// The rendezvous timed out; sent to the workers that did join.
    #[error(
        "the rendezvous timed out waiting for {} of {world} ranks ({})",
        .missing.len(),
        list(.missing.iter().copied())
    )]
    TimedOut { missing: Vec<usize>, world: usize },
}

/// Checks a hello's protocol, job, rank and proof of the secret (bound to `exporter`, the
/// connection's keying material), in that order, against this job's key `ours`. `rank` is the
/// rank the hello claims, `None` for a worker asking to be assigned one.
pub(crate) fn check_hello(
    ours: JobKey,
    rank: Option<u32>,
    claim: &Claim,
    secret: &Secret,
    exporter: &[u8],
) -> Result<(), Refusal> {
    let claimant = Claimant(rank);
    if claim.protocol != PROTOCOL {
        return Err(Refusal::Protocol {
            theirs: claim.protocol,
        });
    }
    if claim.job.world_size != ours.world_size {
        return Err(Refusal::WorldSize {
            claimant,
            theirs: claim.job.world_size,
            ours: ours.world_size,
        });
    }
    if claim.job.round != ours.round {
        return Err(Refusal::Round {
            claimant,
            theirs: claim.job.round,
            ours: ours.round,
        });
    }
    let world = ours.world_size as usize;
    if let Some(rank) = rank
        && (rank == 0 || rank as usize >= world)
    {
        return Err(Refusal::NotAWorker { rank, world });
    }
    if !secret.verify(ROLE_CLIENT, exporter, &claim.proof) {
        return Err(Refusal::WrongSecret { claimant });
    }
    Ok(())
}

/// Ranks in words: "none", or "ranks 1, 3".
pub(crate) fn list(ranks: impl IntoIterator<Item = usize>) -> String {
    let v: Vec<String> = ranks.into_iter().map(|r| r.to_string()).collect();
    if v.is_empty() {
        "none".into()
    } else {
        format!("ranks {}", v.join(", "))
    }
}
