//! The QUIC transport: one authenticated connection per pair of ranks, found through a
//! rendezvous hosted by rank 0.
//!
//! # How a job comes up
//! 1. Every rank makes a fresh certificate and opens one UDP endpoint. Rank 0 listens on the
//!    master address; the others on an ephemeral port.
//! 2. Each worker connects to rank 0, sends `Hello` (rank, node, listening port, proof of the
//!    secret bound to this TLS session) and gets `Welcome` (rank 0's proof) or `Reject`.
//! 3. When every rank has joined, rank 0 sends each worker the roster: every rank's address,
//!    node and certificate. The connection to rank 0 stays as the data link to rank 0.
//! 4. Workers connect directly to each other (the higher rank dials), check the pinned
//!    certificate, and exchange proofs again. The rendezvous carries no tensor data.
//!
//! # Data path
//! Each side of a link opens a few unidirectional QUIC streams. A frame is a 36-byte header
//! (see `frame.rs`) and the payload, written from the caller's [`Bytes`] without a copy; the
//! receiver reads the payload into one buffer and files it in the [`Mailbox`].
//!
//! # Failure
//! A link that goes silent for the peer timeout (keep-alives run every quarter of it) or closes
//! is reported to the mailbox with the reason, so every wait on that peer ends with an error that
//! names it.
//!
//! # Where things are
//! `config.rs` and `error.rs` hold the public configuration and errors; `endpoint.rs` the TLS and
//! QUIC settings and dialling; `auth.rs` the secret, certificates and proofs; `control.rs` the
//! control messages; `admission/` the rendezvous' decisions, sans-IO; `rendezvous.rs` rank 0
//! hosting and workers joining; `links.rs` the accept loop and the worker-to-worker handshake;
//! `streams.rs` and `frame.rs` the data path; `shared.rs` the state a rank's tasks share;
//! `bench.rs` the loopback benchmark.

mod admission;
mod auth;
pub mod bench;
mod config;
mod control;
mod endpoint;
mod error;
// Its items are `pub` so that the `fuzzing` feature can re-export them; without it they are
// reachable from this crate only.
#[cfg_attr(not(feature = "fuzzing"), allow(unreachable_pub))]
pub(crate) mod frame;
mod links;
mod rendezvous;
mod shared;
mod streams;
#[cfg(test)]
pub(crate) mod tests;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bonfire_topology::{NodeLayout, Rank};
use bytes::Bytes;
use quinn::{Endpoint, VarInt};
use tokio::task::JoinHandle;

pub use auth::{KDF_ROUNDS, Secret, SecretError};
pub use config::{Congestion, QuicConfig};
pub use error::{QuicError, SetupError, Who};

use self::admission::layout;
use self::auth::Identity;
use self::control::{CLOSE_DROPPED, CLOSE_SHUTDOWN};
use self::endpoint::{endpoint_with, resolve};
use self::frame::FrameHeader;
use self::links::{accept_loop, link_workers};
use self::rendezvous::{finish_join, host_rendezvous, join};
use self::shared::{Shared, lock};
use self::streams::{Link, start_link};
use crate::{Mailbox, SendFuture, Tag, Transport, TransportError};

/// The QUIC transport of one rank. Made by [`QuicTransport::connect`]; call
/// [`QuicTransport::shutdown`] before the process exits so the last frames reach their peers.
pub struct QuicTransport {
    shared: Arc<Shared>,
    endpoint: Endpoint,
    links: Vec<Option<Arc<Link>>>,
    nodes: NodeLayout,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl QuicTransport {
    /// Joins the job: rendezvous, authentication, one link to every peer. Must run inside a
    /// Tokio runtime with I/O and time enabled.
    pub async fn connect(config: QuicConfig) -> Result<QuicTransport, QuicError> {
        config.validate()?;
        let hosting = config.rank == Some(Rank(0));
        let identity = Identity::generate()?;
        let master = resolve(&config.master).await;
        let bind = if hosting {
            let master = master.as_ref().map_err(|e| e.clone())?;
            SocketAddr::new(config.bind.ip(), master.port())
        } else {
            config.bind
        };
        let ep = endpoint_with(
            bind,
            &identity,
            config.peer_timeout,
            config.streams,
            config.congestion,
        )?;
        let deadline = Instant::now() + config.connect_timeout;
        // Workers join first and learn their rank; connections that arrive meanwhile wait in the
        // endpoint until the accept loop starts.
        let joining = if hosting {
            None
        } else {
            let master = master.map_err(|e| QuicError::Unreachable {
                master: config.master.clone(),
                waited: Duration::ZERO,
                detail: e.to_string(),
            })?;
            Some(join(&ep, &config, master, deadline).await?)
        };
        let me = joining.as_ref().map_or(Rank(0), |j| j.rank);
        let world = config.world_size;
        let shared = Arc::new(Shared::new(me, &config, identity.cert.clone()));
        let accept_task = tokio::spawn(accept_loop(ep.clone(), shared.clone()));
        let mut transport = QuicTransport {
            shared: shared.clone(),
            endpoint: ep.clone(),
            links: (0..world).map(|_| None).collect(),
            nodes: NodeLayout::single_node(world),
            tasks: Mutex::new(vec![accept_task]),
        };
        let (conns, nodes) = match joining {
            None => host_rendezvous(&shared, &config, &ep, deadline).await?,
            Some(joining) => {
                let (host, peers) = finish_join(&shared, &config, joining, deadline).await?;
                let mut conns =
                    link_workers(&shared, &ep, &peers, deadline, config.connect_timeout).await?;
                conns[0] = Some(host);
                (conns, layout(&peers))
            }
        };
        transport.nodes = nodes;
        for (peer, conn) in conns.into_iter().enumerate() {
            if let Some(conn) = conn {
                let (link, tasks) =
                    start_link(&shared, Rank(peer as u32), conn)
                        .await
                        .map_err(|e| QuicError::Link {
                            me: Who(Some(me)),
                            peer: Rank(peer as u32),
                            reason: e.to_string(),
                        })?;
                transport.links[peer] = Some(link);
                lock(&transport.tasks).extend(tasks);
            }
        }
        Ok(transport)
    }

    /// Which node each rank runs on, as announced at the rendezvous.
    pub fn nodes(&self) -> &NodeLayout {
        &self.nodes
    }

    /// The UDP address this rank listens on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.endpoint.local_addr().ok()
    }

    /// Ends the job for this rank cleanly: says goodbye on every stream, waits (at most 10 s) until
    /// peers have received everything sent, then closes the links. Idempotent.
    pub async fn shutdown(&self) {
        if self.shared.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let goodbye = Bytes::copy_from_slice(&FrameHeader::goodbye().encode());
        let drain = async {
            let mut stopped = Vec::new();
            for link in self.links.iter().flatten() {
                for stream in &link.streams {
                    let mut stream = stream.lock().await;
                    if stream.write_all(&goodbye).await.is_ok() && stream.finish().is_ok() {
                        stopped.push(stream.stopped());
                    }
                }
            }
            for s in stopped {
                let _ = s.await;
            }
        };
        let _ = tokio::time::timeout(crate::job::GOODBYE_WAIT, drain).await;
        for link in self.links.iter().flatten() {
            link.conn
                .close(VarInt::from_u32(CLOSE_SHUTDOWN), b"shut down");
        }
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        if !self.shared.closing.swap(true, Ordering::AcqRel) {
            // Dropped without `shutdown`: tell the peers at once rather than letting them wait
            // for the peer timeout.
            for link in self.links.iter().flatten() {
                link.conn.close(
                    VarInt::from_u32(CLOSE_DROPPED),
                    b"its transport was dropped without a clean shutdown",
                );
            }
        }
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

impl Transport for QuicTransport {
    fn rank(&self) -> Rank {
        self.shared.me
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> SendFuture<'_> {
        Box::pin(async move {
            if to == self.shared.me {
                self.shared.mailbox.deliver(to, tag, payload);
                return Ok(());
            }
            let Some(link) = self.links.get(to.index()).and_then(Option::as_ref) else {
                return Err(TransportError::NoSuchPeer {
                    peer: to,
                    world: self.shared.world,
                });
            };
            if let Some(reason) = self.shared.mailbox.lost_reason(to) {
                return Err(TransportError::PeerLost { peer: to, reason });
            }
            link.write_frame(tag, payload).await.map_err(|e| {
                match self.shared.mailbox.lost_reason(to) {
                    Some(reason) => TransportError::PeerLost { peer: to, reason },
                    None => TransportError::Send {
                        peer: to,
                        reason: e.to_string(),
                    },
                }
            })
        })
    }

    fn mailbox(&self) -> &Arc<Mailbox> {
        &self.shared.mailbox
    }

    fn kind(&self) -> &'static str {
        "quic"
    }
}
