//! [`JobTransport`]: the transport of a launched job, with two lanes. Ranks of one host move
//! frames through shared memory; every other pair (and any pair of one host that could not set
//! shared memory up) through QUIC.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bonfire_topology::{NodeLayout, Rank};
use bytes::Bytes;

use crate::quic::{QuicConfig, QuicError, QuicTransport};
use crate::shm::{self, InLink, OutLink, ShmConfig, ShmSetupError};
use crate::{Mailbox, SendFuture, Tag, Transport};

/// How frames to one rank travel.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Lane {
    /// This rank itself: straight into its own mailbox.
    Local,
    /// A ring in shared memory (a rank of this host).
    SharedMemory,
    /// An authenticated QUIC connection.
    Quic,
}

impl Lane {
    /// A short name: `self`, `shm`, `quic`.
    pub const fn name(self) -> &'static str {
        match self {
            Lane::Local => "self",
            Lane::SharedMemory => "shm",
            Lane::Quic => "quic",
        }
    }

    /// A one-byte code, for gathering lanes across ranks.
    pub const fn code(self) -> u8 {
        match self {
            Lane::Local => 0,
            Lane::SharedMemory => 1,
            Lane::Quic => 2,
        }
    }

    /// The lane of a code.
    pub fn from_code(code: u8) -> Option<Lane> {
        [Lane::Local, Lane::SharedMemory, Lane::Quic]
            .get(usize::from(code))
            .copied()
    }
}

/// Why a rank could not join its job.
#[derive(Debug, thiserror::Error)]
pub enum JobTransportError {
    /// The QUIC transport (rendezvous, links) failed.
    #[error(transparent)]
    Quic(#[from] QuicError),
    /// Shared memory was required and could not be set up, or its setup exchange failed.
    #[error(transparent)]
    Shm(#[from] ShmSetupError),
}

/// The transport of one rank of a job: QUIC to every rank, and shared memory to the ranks of
/// its own host. Made by [`JobTransport::connect`]; call [`JobTransport::shutdown`] before the
/// process exits.
pub struct JobTransport {
    quic: QuicTransport,
    out: Vec<Option<Arc<OutLink>>>,
    inbound: Vec<Arc<InLink>>,
    stop: Arc<AtomicBool>,
    fallback: Option<String>,
    /// Whether expected frames go straight into place ([`ShmConfig::in_place`]).
    in_place: bool,
}

impl JobTransport {
    /// Joins the job over QUIC, then sets up shared memory with the ranks of this rank's node
    /// (as `shm` says). Must run inside a Tokio runtime with I/O and time enabled.
    pub async fn connect(
        quic: QuicConfig,
        shm: &ShmConfig,
    ) -> Result<JobTransport, JobTransportError> {
        let (max_frame, stall) = (quic.max_frame, quic.peer_timeout);
        let quic = QuicTransport::connect(quic).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let nodes = quic.nodes().clone();
        let lanes = match shm::setup(&quic, &nodes, shm, max_frame, stall, &stop).await {
            Ok(lanes) => lanes,
            Err(e) => {
                stop.store(true, Ordering::Release);
                quic.shutdown().await;
                return Err(e.into());
            }
        };
        let me = quic.rank();
        let local: Vec<usize> = (0..lanes.out.len())
            .filter(|&r| lanes.out[r].is_some())
            .collect();
        tracing::debug!(
            "{me}: job transport up: shared memory to ranks {local:?} of this host, QUIC to the others"
        );
        if let Some(why) = &lanes.fallback {
            // Said once per node, by its first rank.
            let first = (0..quic.world_size())
                .map(Rank::from)
                .find(|&r| nodes.node_of(r) == nodes.node_of(me));
            if first == Some(me) {
                tracing::warn!(
                    "{me}: shared memory is unavailable between some ranks of this host, which talk over QUIC instead ({why})"
                );
            }
        }
        Ok(JobTransport {
            quic,
            out: lanes.out.into_iter().map(|l| l.map(Arc::new)).collect(),
            inbound: lanes.inbound,
            stop,
            fallback: lanes.fallback,
            in_place: shm.in_place,
        })
    }

    /// The lane frames to each rank take, in rank order.
    pub fn lanes(&self) -> Vec<Lane> {
        let me = self.quic.rank();
        (0..self.quic.world_size())
            .map(|r| {
                if Rank::from(r) == me {
                    Lane::Local
                } else if self.out[r].is_some() {
                    Lane::SharedMemory
                } else {
                    Lane::Quic
                }
            })
            .collect()
    }

    /// Payload bytes this rank received straight into a collective's memory (frames a collective
    /// expected, see [`Transport::expect`]), over all its shared-memory lanes.
    pub fn received_in_place(&self) -> u64 {
        self.inbound.iter().map(|l| l.received_in_place()).sum()
    }

    /// Why some ranks of this host talk QUIC although shared memory was allowed, if they do.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Which node each rank runs on, as the rendezvous established it.
    pub fn nodes(&self) -> &NodeLayout {
        self.quic.nodes()
    }

    /// The QUIC transport underneath.
    pub fn quic(&self) -> &QuicTransport {
        &self.quic
    }

    /// Ends the job for this rank cleanly: each shared-memory lane says goodbye and waits until
    /// its peer has filed every frame, then the QUIC links do the same, each for at most
    /// 10 seconds (a peer that is alive but stopped or stuck takes nothing). Idempotent.
    pub async fn shutdown(&self) {
        // Finishing blocks (the writers drain their rings): run it off the runtime's workers.
        let finishing: Vec<_> = self
            .out
            .iter()
            .flatten()
            .map(|link| {
                let link = link.clone();
                tokio::task::spawn_blocking(move || (link.peer(), link.finish(GOODBYE_WAIT)))
            })
            .collect();
        for f in finishing {
            if let Ok((peer, false)) = f.await {
                tracing::warn!(
                    peer = peer.0,
                    "rank {} did not take this rank's last frames on the shared-memory lane \
                     within {GOODBYE_WAIT:?}; closing the lane anyway",
                    peer.0
                );
            }
        }
        self.quic.shutdown().await;
        // The readers see this within a tick and end.
        self.stop.store(true, Ordering::Release);
    }
}

/// How long a rank ending its job waits for each peer to take the frames it sent last (the QUIC
/// links wait as long).
pub(crate) const GOODBYE_WAIT: Duration = Duration::from_secs(10);

impl Drop for JobTransport {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Transport for JobTransport {
    fn rank(&self) -> Rank {
        self.quic.rank()
    }

    fn world_size(&self) -> usize {
        self.quic.world_size()
    }

    fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> SendFuture<'_> {
        match self.out.get(to.index()).and_then(Option::as_ref) {
            Some(link) => Box::pin(link.queue(tag, payload)),
            None => self.quic.send(to, tag, payload),
        }
    }

    fn send_from(
        &self,
        to: Rank,
        tag: Tag,
        payload: &[u8],
        deadline: std::time::Instant,
    ) -> Option<Result<(), crate::TransportError>> {
        self.out
            .get(to.index())
            .and_then(Option::as_ref)?
            .send_from(tag, payload, deadline)
    }

    fn expect(&self, from: Rank, tag: Tag, sink: Arc<dyn crate::Sink>) -> Option<crate::Expected> {
        if !self.in_place {
            return None;
        }
        let link = self.inbound.iter().find(|l| l.peer() == from)?;
        Some(link.expect(tag, sink))
    }

    fn mailbox(&self) -> &Arc<Mailbox> {
        self.quic.mailbox()
    }

    fn progress(&self) -> bool {
        let mut filed = false;
        for link in &self.inbound {
            filed |= link.take_ready();
        }
        filed
    }

    fn kind(&self) -> &'static str {
        if self.out.iter().any(Option::is_some) {
            "quic+shm"
        } else {
            "quic"
        }
    }
}
