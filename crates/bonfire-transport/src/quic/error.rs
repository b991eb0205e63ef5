//! Why a rank could not join its job: [`QuicError`], its local part [`SetupError`], and
//! [`Who`], the rank (or the process not yet given one) that their messages name.

use std::error::Error;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
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
    /// Local setup failed (configuration, certificate, TLS, socket, master address), before
    /// any peer was involved.
    #[error(transparent)]
    Setup(#[from] SetupError),
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

/// Why a rank could not set itself up, before talking to any peer.
///
/// Causes from other libraries are kept (as [`Error::source`]) behind an [`Arc`], so the error
/// stays cheap to clone.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SetupError {
    /// The rank is not one of the job's, or the job has no ranks.
    #[error("{rank} is outside a job of {world_size} ranks")]
    OutsideJob {
        /// The rank given.
        rank: Who,
        /// The job's size.
        world_size: usize,
    },
    /// The configuration asks for links without streams.
    #[error("a link needs at least one stream")]
    NoStreams,
    /// The peer timeout is out of QUIC's range for an idle timeout.
    #[error("peer timeout {timeout:?} is out of range")]
    PeerTimeout {
        /// The timeout given.
        timeout: Duration,
    },
    /// The master address did not resolve.
    #[error("cannot resolve {master:?}: {source} (expected HOST:PORT)")]
    Resolve {
        /// The master address.
        master: String,
        /// The resolver's error.
        source: Arc<io::Error>,
    },
    /// The master address resolved to nothing.
    #[error("{master:?} resolves to no address")]
    NoAddress {
        /// The master address.
        master: String,
    },
    /// This rank's certificate could not be made.
    #[error("cannot generate this rank's certificate: {source}")]
    Certificate {
        /// The certificate library's error.
        source: Arc<dyn Error + Send + Sync>,
    },
    /// TLS refused bonfire's configuration.
    #[error("TLS configuration failed: {source}")]
    Tls {
        /// The TLS library's error.
        source: Arc<dyn Error + Send + Sync>,
    },
    /// QUIC refused the TLS configuration of one side.
    #[error("QUIC {side} config: {source}")]
    QuicConfig {
        /// `"server"` or `"client"`.
        side: &'static str,
        /// The QUIC library's error.
        source: Arc<dyn Error + Send + Sync>,
    },
    /// No UDP socket could be opened.
    #[error("cannot open a UDP socket: {source}")]
    Socket {
        /// The system's error.
        source: Arc<io::Error>,
    },
    /// The UDP socket could not be bound to the address.
    #[error(
        "cannot listen on UDP {addr}: {source} (another job or a stale rank may hold the port; pick another one)"
    )]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The system's error.
        source: Arc<io::Error>,
    },
    /// The UDP socket could not be made non-blocking.
    #[error("cannot configure the UDP socket: {source}")]
    ConfigureSocket {
        /// The system's error.
        source: Arc<io::Error>,
    },
    /// The QUIC endpoint did not start on the socket.
    #[error("cannot start the QUIC endpoint on {addr}: {source}")]
    Endpoint {
        /// The address.
        addr: SocketAddr,
        /// The system's error.
        source: Arc<io::Error>,
    },
}
