//! The rendezvous' decisions, sans-IO: whether a hello is from this job (protocol, world size,
//! round, rank, proof of the secret); which rank a worker gets, or why it is refused
//! ([`Admission`], rank 0's reservation table); who links to whom and who is still missing; and
//! the roster and node layout the ranks form. No sockets here: the socket code in
//! `rendezvous.rs` and `links.rs` asks, then acts, and `admission/tests.rs` checks the
//! decisions without a network.

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;

use bonfire_topology::{NodeId, NodeLayout, Rank};

use super::auth::{PROOF_LEN, ROLE_CLIENT, Secret};
use super::control::{JobKey, PROTOCOL, PeerEntry};

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

/// Rank 0's reservation table: which worker ranks are taken (a welcome was sent, or is being
/// sent), and whether the rendezvous has closed. A rank is reserved before its welcome goes out,
/// so a duplicate cannot slip in meanwhile.
#[derive(Debug)]
pub(crate) struct Admission {
    job: JobKey,
    /// Indexed by rank; rank 0 is never reserved (it hosts).
    reserved: Vec<bool>,
    closed: bool,
}

impl Admission {
    /// An open rendezvous for the job `job`, with every worker rank free.
    pub(crate) fn new(job: JobKey) -> Admission {
        Admission {
            job,
            reserved: vec![false; job.world_size as usize],
            closed: false,
        }
    }

    /// Decides a worker's hello: checks it (see [`check_hello`]), then reserves the rank it asks
    /// for, or assigns the lowest free worker rank when it asks for none.
    pub(crate) fn admit(
        &mut self,
        rank: Option<u32>,
        claim: &Claim,
        secret: &Secret,
        exporter: &[u8],
    ) -> Result<u32, Refusal> {
        check_hello(self.job, rank, claim, secret, exporter)?;
        if self.closed {
            return Err(Refusal::Started);
        }
        let world = self.reserved.len();
        let rank = match rank {
            Some(r) if self.reserved[r as usize] => return Err(Refusal::Taken { rank: r }),
            Some(r) => r,
            None => (1..world)
                .find(|&r| !self.reserved[r])
                .ok_or(Refusal::Full { world })? as u32,
        };
        self.reserved[rank as usize] = true;
        Ok(rank)
    }

    /// Frees a reserved rank whose welcome could not be sent.
    pub(crate) fn release(&mut self, rank: u32) {
        if let Some(r) = self.reserved.get_mut(rank as usize) {
            *r = false;
        }
    }

    /// Closes the rendezvous (every rank is in, or time is up): later hellos are refused.
    pub(crate) fn close(&mut self) {
        self.closed = true;
    }
}

/// Decides a higher rank's hello on a direct link to `me`: the same checks as at the
/// rendezvous, and the higher rank must be the one dialling.
pub(crate) fn admit_peer(
    job: JobKey,
    me: Rank,
    rank: u32,
    claim: &Claim,
    secret: &Secret,
    exporter: &[u8],
) -> Result<u32, Refusal> {
    check_hello(job, Some(rank), claim, secret, exporter)?;
    if rank as usize <= me.index() {
        return Err(Refusal::WrongDirection { rank, me });
    }
    Ok(rank)
}

/// Where a worker is reached: the address it advertised, else the one rank 0 saw it come from
/// with the port it listens on.
pub(crate) fn reach_addr(seen: SocketAddr, port: u16, advertise: Option<SocketAddr>) -> SocketAddr {
    advertise.unwrap_or_else(|| SocketAddr::new(seen.ip(), port))
}

/// The rank rank 0 assigned, if this worker may take it: a worker rank of the job, and the one
/// it asked for if it asked.
pub(crate) fn assigned_rank(asked: Option<Rank>, assigned: u32, world: usize) -> Option<Rank> {
    let valid =
        assigned != 0 && (assigned as usize) < world && asked.is_none_or(|r| r.0 == assigned);
    valid.then_some(Rank(assigned))
}

/// The workers rank 0 still waits for: every rank but 0 with no entry in `joined` (indexed by
/// rank).
pub(crate) fn missing_workers<T>(joined: &[Option<T>]) -> Vec<usize> {
    (1..joined.len()).filter(|&r| joined[r].is_none()).collect()
}

/// The ranks a worker `me` dials once it has the roster: every worker below it (rank 0 is
/// already linked through the rendezvous). The higher rank dials, so each pair links once.
pub(crate) fn lower_workers(me: Rank) -> Range<usize> {
    1..me.index().max(1)
}

/// The ranks that dial a worker `me` once they have the roster: every rank above it. None dial
/// rank 0: workers reach it through the rendezvous.
pub(crate) fn higher_ranks(me: Rank, world: usize) -> Range<usize> {
    if me.index() == 0 {
        return 1..1;
    }
    me.index() + 1..world.max(me.index() + 1)
}

/// The higher ranks whose link `me` still waits for (`accepted` is indexed by rank).
pub(crate) fn missing_links<T>(me: Rank, accepted: &[Option<T>]) -> Vec<usize> {
    higher_ranks(me, accepted.len())
        .filter(|&r| accepted[r].is_none())
        .collect()
}

/// The roster rank 0 sends: its own entry and every joined worker's, in rank order.
pub(crate) fn roster(
    own: PeerEntry,
    joined: impl IntoIterator<Item = PeerEntry>,
) -> Vec<PeerEntry> {
    let mut peers = vec![own];
    peers.extend(joined);
    peers.sort_by_key(|p| p.rank);
    peers
}

/// A roster that does not list every rank once, in order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed roster: {entries} entries for {world} ranks")]
pub(crate) struct MalformedRoster {
    pub(crate) entries: usize,
    pub(crate) world: usize,
}

/// Checks a roster from rank 0: one entry per rank of the job, entry `i` for rank `i`.
pub(crate) fn check_roster(peers: &[PeerEntry], world: usize) -> Result<(), MalformedRoster> {
    let ranks_ok =
        peers.len() == world && peers.iter().enumerate().all(|(i, p)| p.rank as usize == i);
    if ranks_ok {
        Ok(())
    } else {
        Err(MalformedRoster {
            entries: peers.len(),
            world,
        })
    }
}

/// Which node each rank runs on, from the roster.
pub(crate) fn layout(peers: &[PeerEntry]) -> NodeLayout {
    NodeLayout::from_nodes(peers.iter().map(|p| NodeId(p.node)).collect())
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

#[cfg(test)]
mod tests;
