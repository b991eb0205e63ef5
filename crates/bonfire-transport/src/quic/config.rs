//! How a rank joins a QUIC job: [`QuicConfig`], with bonfire's defaults for everything but the
//! rank, the world size, the master address and the secret.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use bonfire_topology::Rank;

use super::auth::Secret;
use super::error::{SetupError, Who};

/// The congestion controller of every connection (quinn's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Congestion {
    /// CUBIC (RFC 9438), quinn's default: loss-based, so random loss on a long link caps it far
    /// below the link's bandwidth.
    #[default]
    Cubic,
    /// NewReno (RFC 9002's reference controller).
    NewReno,
    /// BBR (quinn's experimental port of quiche's BBRv1): paces at the bandwidth it measures and
    /// does not take random loss for congestion.
    Bbr,
}

impl Congestion {
    /// The name `BONFIRE_QUIC_CONGESTION` takes.
    pub fn name(self) -> &'static str {
        match self {
            Congestion::Cubic => "cubic",
            Congestion::NewReno => "newreno",
            Congestion::Bbr => "bbr",
        }
    }

    pub(crate) fn factory(
        self,
    ) -> std::sync::Arc<dyn quinn::congestion::ControllerFactory + Send + Sync> {
        use std::sync::Arc;
        match self {
            Congestion::Cubic => Arc::new(quinn::congestion::CubicConfig::default()),
            Congestion::NewReno => Arc::new(quinn::congestion::NewRenoConfig::default()),
            Congestion::Bbr => Arc::new(quinn::congestion::BbrConfig::default()),
        }
    }
}

impl std::fmt::Display for Congestion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Congestion {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cubic" => Ok(Congestion::Cubic),
            "newreno" | "new-reno" => Ok(Congestion::NewReno),
            "bbr" => Ok(Congestion::Bbr),
            _ => Err("expected cubic, newreno or bbr".into()),
        }
    }
}

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
    pub streams: usize,
    /// Every connection's congestion controller.
    pub congestion: Congestion,
}

impl QuicConfig {
    /// A configuration with bonfire's defaults: listen on all interfaces, 120 s to connect,
    /// 6 s peer timeout, 1 GiB frame limit, 2 streams, CUBIC.
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
            streams: 2,
            congestion: Congestion::Cubic,
        }
    }

    /// Checks what can be checked before opening anything: the rank lies in the job and a link
    /// has at least one stream.
    pub(crate) fn validate(&self) -> Result<(), SetupError> {
        if self.world_size == 0 || self.rank.is_some_and(|r| r.index() >= self.world_size) {
            return Err(SetupError::OutsideJob {
                rank: Who(self.rank),
                world_size: self.world_size,
            });
        }
        if self.streams == 0 {
            return Err(SetupError::NoStreams);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_outside_the_job_and_links_without_streams_are_refused() {
        let secret = Secret::new(b"0123456789abcdef-config").unwrap();
        let config = |rank: Option<u32>, world: usize, streams: usize| {
            let mut c = QuicConfig::new(rank.map(Rank), world, "127.0.0.1:1", secret.clone());
            c.streams = streams;
            c
        };
        let cases: [(Option<u32>, usize, usize, Option<&str>); 7] = [
            (Some(0), 1, 2, None),
            (Some(3), 4, 1, None),
            (None, 4, 2, None),
            (Some(4), 4, 2, Some("rank 4 is outside a job of 4 ranks")),
            (Some(0), 0, 2, Some("rank 0 is outside a job of 0 ranks")),
            (
                None,
                0,
                2,
                Some("this process (no rank assigned yet) is outside a job of 0 ranks"),
            ),
            (Some(1), 2, 0, Some("a link needs at least one stream")),
        ];
        for (rank, world, streams, want) in cases {
            let got = config(rank, world, streams)
                .validate()
                .err()
                .map(|e| e.to_string());
            assert_eq!(
                got.as_deref(),
                want,
                "rank {rank:?}, world {world}, streams {streams}"
            );
        }
    }
}
