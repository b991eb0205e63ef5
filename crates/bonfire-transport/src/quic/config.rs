//! How a rank joins a QUIC job: [`QuicConfig`], with bonfire's defaults for everything but the
//! rank, the world size, the master address and the secret.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use bonfire_topology::Rank;

use super::auth::Secret;

/// How a rank joins a QUIC job.
#[derive(Clone, Debug)]
pub struct QuicConfig {
    /// This rank; `None` asks the rendezvous for one (the lowest free worker rank). Rank 0
    /// must be given: it hosts the rendezvous.
    pub rank: Option<Rank>,
    /// Ranks in the job.
    pub world_size: usize,
    /// The node (host) this rank runs on, for hierarchical collectives.
    pub node: u32,
    /// Where rank 0 hosts the rendezvous, `host:port`; rank 0 listens on its port.
    pub master: String,
    /// The address to listen on (port 0 for workers picks one; rank 0 always uses the master
    /// port).
    pub bind: SocketAddr,
    /// The address other ranks should dial to reach this one, if not the one the rendezvous
    /// sees (behind a relay, a NAT, a service name).
    pub advertise: Option<SocketAddr>,
    /// The job's shared secret.
    pub secret: Secret,
    /// The launch round (restarts increase it); ranks of different rounds refuse each other.
    pub round: u32,
    /// How long to wait for the rendezvous and for every link to come up.
    pub connect_timeout: Duration,
    /// A peer silent for this long is declared lost.
    pub peer_timeout: Duration,
    /// The largest frame payload accepted from a peer.
    pub max_frame: u64,
    /// Unidirectional streams per direction of each link.
    pub lanes: usize,
}

impl QuicConfig {
    /// A configuration with bonfire's defaults: listen on all interfaces, 120 s to connect,
    /// 6 s peer timeout, 1 GiB frame limit, 2 lanes.
    pub fn new(
        rank: Option<Rank>,
        world_size: usize,
        master: impl Into<String>,
        secret: Secret,
    ) -> Self {
        QuicConfig {
            rank,
            world_size,
            node: 0,
            master: master.into(),
            bind: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            advertise: None,
            secret,
            round: 0,
            connect_timeout: Duration::from_secs(120),
            peer_timeout: Duration::from_secs(6),
            max_frame: 1 << 30,
            lanes: 2,
        }
    }
}
