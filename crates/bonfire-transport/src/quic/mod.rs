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
//! Each side of a link opens a few unidirectional streams ("lanes"). A frame is a 36-byte header
//! (see [`frame`]) and the payload, written from the caller's [`Bytes`] without a copy; the
//! receiver reads the payload into one buffer and files it in the [`Mailbox`].
//!
//! # Failure
//! A link that goes silent for the peer timeout (keep-alives run every quarter of it) or closes
//! is reported to the mailbox with the reason, so every wait on that peer ends with an error that
//! names it.

pub mod frame;

mod auth;
mod control;
#[cfg(test)]
mod tests;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bonfire_topology::{NodeId, NodeLayout, Rank};
use bytes::{Bytes, BytesMut};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, ConnectionError, Endpoint, RecvStream, SendStream, VarInt};
use rustls::pki_types::CertificateDer;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

pub use auth::{Secret, SecretError};

use self::auth::{Identity, PinAfterHandshake};
use self::control::{Control, JobKey, PROTOCOL, PeerEntry};
use self::frame::{FrameHeader, FrameKind, HEADER_LEN};
use crate::{Mailbox, SendFuture, Tag, Transport, TransportError};

const ALPN: &[u8] = b"bonfire/1";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-bonfire-proof";
const ROLE_CLIENT: &[u8] = b"bonfire client proof";
const ROLE_SERVER: &[u8] = b"bonfire server proof";

/// Application close codes.
const CLOSE_SHUTDOWN: u32 = 0;
const CLOSE_REFUSED: u32 = 1;
const CLOSE_BAD_FRAME: u32 = 2;
const CLOSE_DROPPED: u32 = 3;

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

/// The QUIC transport of one rank. Made by [`QuicTransport::connect`]; call
/// [`QuicTransport::shutdown`] before the process exits so the last frames reach their peers.
pub struct QuicTransport {
    shared: Arc<Shared>,
    endpoint: Endpoint,
    links: Vec<Option<Arc<Link>>>,
    nodes: NodeLayout,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

struct Shared {
    me: Rank,
    world: usize,
    job: JobKey,
    secret: Secret,
    identity_cert: CertificateDer<'static>,
    mailbox: Arc<Mailbox>,
    max_frame: u64,
    lanes: usize,
    peer_timeout: Duration,
    closing: AtomicBool,
    /// Rank 0: the workers that have joined, with what they announced.
    joined: Mutex<Vec<Option<Joined>>>,
    /// Rank 0: ranks whose hello was accepted (set before the welcome is sent).
    reserved: Mutex<Vec<bool>>,
    /// Workers: the roster, once rank 0 sent it.
    roster: watch::Sender<Option<Arc<Vec<PeerEntry>>>>,
    /// Links accepted from higher ranks.
    accepted: Mutex<Vec<Option<Connection>>>,
    changed: Notify,
    master_done: AtomicBool,
}

struct Joined {
    conn: Connection,
    send: SendStream,
    entry: PeerEntry,
}

struct Link {
    peer: Rank,
    conn: Connection,
    lanes: Vec<tokio::sync::Mutex<SendStream>>,
    next: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn log(me: Rank, msg: impl std::fmt::Display) {
    eprintln!("bonfire[{me}]: {msg}");
}

fn peer_cert(conn: &Connection) -> Option<CertificateDer<'static>> {
    conn.peer_identity()?
        .downcast::<Vec<CertificateDer<'static>>>()
        .ok()?
        .first()
        .cloned()
}

fn exporter(conn: &Connection) -> Result<[u8; 32], String> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, EXPORTER_LABEL, b"")
        .map_err(|e| format!("cannot export TLS keying material: {e:?}"))?;
    Ok(out)
}

fn list(ranks: impl IntoIterator<Item = usize>) -> String {
    let v: Vec<String> = ranks.into_iter().map(|r| r.to_string()).collect();
    if v.is_empty() {
        "none".into()
    } else {
        format!("ranks {}", v.join(", "))
    }
}

/// The TLS provider: ring, with AES-128-GCM preferred (the fastest AEAD where the CPU has AES
/// instructions, which is everywhere bonfire trains).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites.sort_by_key(|s| match s.suite() {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    });
    Arc::new(p)
}

fn transport_config(
    peer_timeout: Duration,
    lanes: usize,
) -> Result<quinn::TransportConfig, String> {
    let mut t = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(peer_timeout)
        .map_err(|_| format!("peer timeout {peer_timeout:?} is out of range"))?;
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some((peer_timeout / 4).max(Duration::from_millis(100))));
    // Bulk transfer: windows large enough to keep a fast link busy.
    t.stream_receive_window(VarInt::from_u32(32 << 20));
    t.receive_window(VarInt::from_u32(128 << 20));
    t.send_window(128 << 20);
    t.max_concurrent_uni_streams(VarInt::from_u32((lanes as u32).saturating_add(4)));
    t.max_concurrent_bidi_streams(VarInt::from_u32(4));
    // Discover datagrams up to jumbo size: loopback and jumbo-frame networks use them.
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(8952);
    t.mtu_discovery_config(Some(mtu));
    t.enable_segmentation_offload(true);
    Ok(t)
}

fn endpoint(
    bind: SocketAddr,
    identity: &Identity,
    peer_timeout: Duration,
    lanes: usize,
) -> Result<Endpoint, String> {
    use socket2::{Domain, Protocol, Socket, Type};
    let provider = provider();
    let tls = |e: rustls::Error| format!("TLS configuration failed: {e}");
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_client_cert_verifier(Arc::new(PinAfterHandshake(provider.clone())))
        .with_single_cert(vec![identity.cert.clone()], identity.key.clone_key())
        .map_err(tls)?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinAfterHandshake(provider)))
        .with_client_auth_cert(vec![identity.cert.clone()], identity.key.clone_key())
        .map_err(tls)?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    let transport = Arc::new(transport_config(peer_timeout, lanes)?);
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(
        QuicServerConfig::try_from(server).map_err(|e| format!("QUIC server config: {e}"))?,
    ));
    server.transport_config(transport.clone());
    let mut client = quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(client).map_err(|e| format!("QUIC client config: {e}"))?,
    ));
    client.transport_config(transport);

    let socket = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| format!("cannot open a UDP socket: {e}"))?;
    // Large kernel buffers stop drops under bursts; the kernel may cap them, which is fine.
    let _ = socket.set_recv_buffer_size(8 << 20);
    let _ = socket.set_send_buffer_size(8 << 20);
    if bind.is_ipv6() {
        let _ = socket.set_only_v6(false);
    }
    socket.bind(&bind.into()).map_err(|e| {
        format!("cannot listen on UDP {bind}: {e} (another job or a stale rank may hold the port; pick another one)")
    })?;
    socket
        .set_nonblocking(true)
        .map_err(|e| format!("cannot configure the UDP socket: {e}"))?;
    let mut ep = Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server),
        socket.into(),
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(|e| format!("cannot start the QUIC endpoint on {bind}: {e}"))?;
    ep.set_default_client_config(client);
    Ok(ep)
}

async fn resolve(master: &str) -> Result<SocketAddr, String> {
    let mut addrs = tokio::net::lookup_host(master)
        .await
        .map_err(|e| format!("cannot resolve {master:?}: {e} (expected HOST:PORT)"))?;
    addrs
        .next()
        .ok_or_else(|| format!("{master:?} resolves to no address"))
}

/// Dials `addr` until it answers or `deadline` passes.
async fn dial(ep: &Endpoint, addr: SocketAddr, deadline: Instant) -> Result<Connection, String> {
    let mut attempt = Duration::from_secs(2);
    let mut last = String::from("no attempt made");
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(last);
        }
        let budget = attempt.min(deadline - now);
        match ep.connect(addr, "bonfire") {
            Err(e) => return Err(format!("cannot connect to {addr}: {e}")),
            Ok(connecting) => match tokio::time::timeout(budget, connecting).await {
                Ok(Ok(conn)) => return Ok(conn),
                Ok(Err(e)) => last = format!("{e}"),
                Err(_) => last = format!("no answer from {addr}"),
            },
        }
        // A refused or lost handshake returns at once; do not spin.
        let pause =
            Duration::from_millis(200).min(deadline.saturating_duration_since(Instant::now()));
        tokio::time::sleep(pause).await;
        attempt = (attempt * 2).min(Duration::from_secs(4));
    }
}

impl QuicTransport {
    /// Joins the job: rendezvous, authentication, one link to every peer. Must run inside a
    /// Tokio runtime with I/O and time enabled.
    pub async fn connect(config: QuicConfig) -> Result<QuicTransport, QuicError> {
        let given = Who(config.rank);
        if config.world_size == 0 || config.rank.is_some_and(|r| r.index() >= config.world_size) {
            return Err(QuicError::Setup(format!(
                "{given} is outside a job of {} ranks",
                config.world_size
            )));
        }
        if config.lanes == 0 {
            return Err(QuicError::Setup("a link needs at least one lane".into()));
        }
        let hosting = config.rank == Some(Rank(0));
        let identity = Identity::generate().map_err(QuicError::Setup)?;
        let master = resolve(&config.master).await;
        let bind = if hosting {
            let master = master.as_ref().map_err(|e| QuicError::Setup(e.clone()))?;
            SocketAddr::new(config.bind.ip(), master.port())
        } else {
            config.bind
        };
        let ep = endpoint(bind, &identity, config.peer_timeout, config.lanes)
            .map_err(QuicError::Setup)?;
        let deadline = Instant::now() + config.connect_timeout;
        // Workers join first and learn their rank; connections that arrive meanwhile wait in the
        // endpoint until the accept loop starts.
        let joining = if hosting {
            None
        } else {
            let master = master.map_err(|e| QuicError::Unreachable {
                master: config.master.clone(),
                waited: Duration::ZERO,
                detail: e,
            })?;
            Some(join(&ep, &config, master, deadline).await?)
        };
        let me = joining.as_ref().map_or(Rank(0), |j| j.rank);
        let world = config.world_size;
        let (roster, _) = watch::channel(None);
        let shared = Arc::new(Shared {
            me,
            world,
            job: JobKey {
                world_size: world as u32,
                round: config.round,
            },
            secret: config.secret.clone(),
            identity_cert: identity.cert.clone(),
            mailbox: Arc::new(Mailbox::new()),
            max_frame: config.max_frame,
            lanes: config.lanes,
            peer_timeout: config.peer_timeout,
            closing: AtomicBool::new(false),
            joined: Mutex::new((0..world).map(|_| None).collect()),
            reserved: Mutex::new(vec![false; world]),
            roster,
            accepted: Mutex::new((0..world).map(|_| None).collect()),
            changed: Notify::new(),
            master_done: AtomicBool::new(false),
        });
        let accept_task = tokio::spawn(accept_loop(ep.clone(), shared.clone()));
        let mut transport = QuicTransport {
            shared: shared.clone(),
            endpoint: ep.clone(),
            links: (0..world).map(|_| None).collect(),
            nodes: NodeLayout::single_node(world),
            tasks: Mutex::new(vec![accept_task]),
        };
        let conns = match joining {
            None => host_rendezvous(&shared, &config, &ep, deadline).await?,
            Some(joining) => finish_join(&shared, &config, &ep, joining, deadline).await?,
        };
        let (conns, nodes) = conns;
        transport.nodes = nodes;
        for (peer, conn) in conns.into_iter().enumerate() {
            if let Some(conn) = conn {
                let (link, tasks) =
                    start_link(&shared, Rank(peer as u32), conn)
                        .await
                        .map_err(|reason| QuicError::Link {
                            me: Who(Some(me)),
                            peer: Rank(peer as u32),
                            reason,
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

    /// Ends the job for this rank cleanly: says goodbye on every lane, waits (at most 10 s) until
    /// peers have received everything sent, then closes the links. Idempotent.
    pub async fn shutdown(&self) {
        if self.shared.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let goodbye = Bytes::copy_from_slice(&FrameHeader::goodbye().encode());
        let drain = async {
            let mut stopped = Vec::new();
            for link in self.links.iter().flatten() {
                for lane in &link.lanes {
                    let mut lane = lane.lock().await;
                    if lane.write_all(&goodbye).await.is_ok() && lane.finish().is_ok() {
                        stopped.push(lane.stopped());
                    }
                }
            }
            for s in stopped {
                let _ = s.await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
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
            let header =
                Bytes::copy_from_slice(&FrameHeader::data(tag, payload.len() as u64).encode());
            // Take a free lane if there is one, else queue on the next in turn.
            let mut guard = None;
            for lane in &link.lanes {
                if let Ok(g) = lane.try_lock() {
                    guard = Some(g);
                    break;
                }
            }
            let mut lane = match guard {
                Some(g) => g,
                None => {
                    let i = link.next.fetch_add(1, Ordering::Relaxed) % link.lanes.len();
                    link.lanes[i].lock().await
                }
            };
            lane.write_all_chunks(&mut [header, payload])
                .await
                .map_err(|e| match self.shared.mailbox.lost_reason(to) {
                    Some(reason) => TransportError::PeerLost { peer: to, reason },
                    None => TransportError::Send {
                        peer: to,
                        reason: e.to_string(),
                    },
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

type Links = (Vec<Option<Connection>>, NodeLayout);

/// Waits until `missing()` is empty, re-checking whenever a rank joins or links; on timeout,
/// the ranks still missing.
async fn wait_for_ranks(
    shared: &Shared,
    deadline: Instant,
    missing: impl Fn() -> Vec<usize>,
) -> Result<(), Vec<usize>> {
    loop {
        // Registered before looking, so a change between the look and the wait is not lost.
        let notified = shared.changed.notified();
        let now_missing = missing();
        if now_missing.is_empty() {
            return Ok(());
        }
        if tokio::time::timeout_at(deadline.into(), notified)
            .await
            .is_err()
        {
            return Err(now_missing);
        }
    }
}

fn layout(peers: &[PeerEntry]) -> NodeLayout {
    NodeLayout::from_nodes(peers.iter().map(|p| NodeId(p.node)).collect())
}

/// Rank 0: wait for every worker, send the roster.
async fn host_rendezvous(
    shared: &Arc<Shared>,
    config: &QuicConfig,
    ep: &Endpoint,
    deadline: Instant,
) -> Result<Links, QuicError> {
    let me = Who(Some(shared.me));
    let arrived = wait_for_ranks(shared, deadline, || {
        lock(&shared.joined)
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, j)| j.is_none())
            .map(|(r, _)| r)
            .collect()
    })
    .await;
    // From here on the rendezvous is closed, in success or in failure.
    shared.master_done.store(true, Ordering::Release);
    let mut joined: Vec<Joined> = lock(&shared.joined)
        .iter_mut()
        .filter_map(Option::take)
        .collect();
    if let Err(missing) = arrived {
        let reason = format!(
            "the rendezvous timed out waiting for {} of {} ranks ({})",
            missing.len(),
            shared.world,
            list(missing.iter().copied())
        );
        for j in &mut joined {
            let _ = control::write(
                &mut j.send,
                &Control::Reject {
                    reason: reason.clone(),
                },
            )
            .await;
            let _ = j.send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(1), j.send.stopped()).await;
        }
        return Err(QuicError::Timeout {
            me,
            stage: "every rank to join the rendezvous",
            waited: config.connect_timeout,
            missing: list(missing),
        });
    }
    let own = config
        .advertise
        .unwrap_or_else(|| ep.local_addr().unwrap_or(config.bind));
    let mut peers = vec![PeerEntry {
        rank: 0,
        node: config.node,
        addr: own,
        cert: shared.identity_cert.to_vec(),
    }];
    peers.extend(joined.iter().map(|j| j.entry.clone()));
    peers.sort_by_key(|p| p.rank);
    let roster = Control::Roster {
        peers: peers.clone(),
    };
    let mut conns: Vec<Option<Connection>> = (0..shared.world).map(|_| None).collect();
    for j in &mut joined {
        let rank = j.entry.rank;
        control::write(&mut j.send, &roster)
            .await
            .map_err(|reason| QuicError::Link {
                me,
                peer: Rank(rank),
                reason,
            })?;
        let _ = j.send.finish();
        conns[rank as usize] = Some(j.conn.clone());
    }
    Ok((conns, layout(&peers)))
}

/// A worker that rank 0 has welcomed, waiting for the roster.
struct Joining {
    rank: Rank,
    conn: Connection,
    recv: RecvStream,
    by: String,
}

/// Workers: join through rank 0 and learn (or confirm) this process's rank.
async fn join(
    ep: &Endpoint,
    config: &QuicConfig,
    master: SocketAddr,
    deadline: Instant,
) -> Result<Joining, QuicError> {
    let me = Who(config.rank);
    let started = Instant::now();
    let by = format!("the rendezvous at {} (rank 0)", config.master);
    let conn = dial(ep, master, deadline)
        .await
        .map_err(|detail| QuicError::Unreachable {
            master: config.master.clone(),
            waited: started.elapsed(),
            detail,
        })?;
    let fail = |reason: String| QuicError::Link {
        me,
        peer: Rank(0),
        reason,
    };
    let ex = exporter(&conn).map_err(fail)?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| fail(e.to_string()))?;
    let port = ep.local_addr().map(|a| a.port()).unwrap_or(0);
    let hello = Control::Hello {
        protocol: PROTOCOL,
        job: JobKey {
            world_size: config.world_size as u32,
            round: config.round,
        },
        rank: config.rank.map(|r| r.0),
        node: config.node,
        port,
        advertise: config.advertise,
        proof: config.secret.proof(ROLE_CLIENT, &ex),
    };
    control::write(&mut send, &hello).await.map_err(fail)?;
    let _ = send.finish();
    let reply = tokio::time::timeout_at(deadline.into(), control::read(&mut recv))
        .await
        .map_err(|_| fail("rank 0 accepted the connection but never answered".into()))?
        .map_err(|e| fail(format!("rank 0 closed the rendezvous: {e}")))?;
    match reply {
        Control::Welcome { proof, rank } => {
            if !config.secret.verify(ROLE_SERVER, &ex, &proof) {
                conn.close(VarInt::from_u32(CLOSE_REFUSED), b"wrong job secret");
                return Err(QuicError::Unauthenticated {
                    me,
                    peer: by,
                    reason: "it does not hold this job's secret (is another job using this port?)"
                        .into(),
                });
            }
            let valid = rank != 0
                && (rank as usize) < config.world_size
                && config.rank.is_none_or(|r| r.0 == rank);
            if !valid {
                return Err(fail(format!("rank 0 assigned an invalid rank {rank}")));
            }
            Ok(Joining {
                rank: Rank(rank),
                conn,
                recv,
                by,
            })
        }
        Control::Reject { reason } => Err(QuicError::Refused { me, by, reason }),
        other => Err(fail(format!("unexpected {} message", other.name()))),
    }
}

/// Workers: take the roster from rank 0, then link to every other worker.
async fn finish_join(
    shared: &Arc<Shared>,
    config: &QuicConfig,
    ep: &Endpoint,
    joining: Joining,
    deadline: Instant,
) -> Result<Links, QuicError> {
    let me = Who(Some(shared.me));
    let Joining {
        conn, mut recv, by, ..
    } = joining;
    let fail = |reason: String| QuicError::Link {
        me,
        peer: Rank(0),
        reason,
    };
    let reply = tokio::time::timeout_at(deadline.into(), control::read(&mut recv))
        .await
        .map_err(|_| QuicError::Timeout {
            me,
            stage: "the roster from rank 0",
            waited: config.connect_timeout,
            missing: "the rendezvous did not complete (other ranks did not join)".into(),
        })?
        .map_err(|e| fail(format!("rank 0 closed the rendezvous: {e}")))?;
    let peers = match reply {
        Control::Roster { peers } => peers,
        Control::Reject { reason } => return Err(QuicError::Refused { me, by, reason }),
        other => return Err(fail(format!("unexpected {} message", other.name()))),
    };
    let ranks_ok =
        peers.len() == shared.world && peers.iter().enumerate().all(|(i, p)| p.rank as usize == i);
    if !ranks_ok {
        return Err(fail(format!(
            "malformed roster: {} entries for {} ranks",
            peers.len(),
            shared.world
        )));
    }
    let peers = Arc::new(peers);
    shared.roster.send_replace(Some(peers.clone()));

    let mut conns: Vec<Option<Connection>> = (0..shared.world).map(|_| None).collect();
    conns[0] = Some(conn);
    // Dial every lower worker, concurrently.
    let mut dials = tokio::task::JoinSet::new();
    for j in 1..shared.me.index() {
        let (ep, shared, entry) = (ep.clone(), shared.clone(), peers[j].clone());
        dials.spawn(async move {
            let r = dial_peer(&ep, &shared, &entry, deadline).await;
            (entry.rank, r)
        });
    }
    while let Some(done) = dials.join_next().await {
        let (rank, result) = done.map_err(|e| fail(format!("dial task failed: {e}")))?;
        let conn = result.map_err(|e| match e {
            DialError::Refused(reason) => QuicError::Refused {
                me,
                by: format!("rank {rank}"),
                reason,
            },
            DialError::Other(reason) => QuicError::Link {
                me,
                peer: Rank(rank),
                reason,
            },
        })?;
        conns[rank as usize] = Some(conn);
    }
    // Wait for every higher rank to dial in.
    wait_for_ranks(shared, deadline, || {
        let accepted = lock(&shared.accepted);
        (shared.me.index() + 1..shared.world)
            .filter(|&r| accepted[r].is_none())
            .collect()
    })
    .await
    .map_err(|missing| QuicError::Timeout {
        me,
        stage: "links from higher ranks",
        waited: config.connect_timeout,
        missing: list(missing),
    })?;
    let mut accepted = lock(&shared.accepted);
    for r in shared.me.index() + 1..shared.world {
        conns[r] = accepted[r].take();
    }
    Ok((conns, layout(&peers)))
}

enum DialError {
    Refused(String),
    Other(String),
}

async fn dial_peer(
    ep: &Endpoint,
    shared: &Shared,
    entry: &PeerEntry,
    deadline: Instant,
) -> Result<Connection, DialError> {
    let conn = dial(ep, entry.addr, deadline)
        .await
        .map_err(|e| DialError::Other(format!("no connection to {}: {e}", entry.addr)))?;
    if peer_cert(&conn).as_deref() != Some(&entry.cert[..]) {
        conn.close(VarInt::from_u32(CLOSE_REFUSED), b"certificate not pinned");
        return Err(DialError::Other(format!(
            "{} answered with a certificate other than the one pinned at the rendezvous",
            entry.addr
        )));
    }
    let ex = exporter(&conn).map_err(DialError::Other)?;
    let (mut send, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| DialError::Other(e.to_string()))?;
    let hello = Control::PeerHello {
        protocol: PROTOCOL,
        job: shared.job,
        rank: shared.me.0,
        proof: shared.secret.proof(ROLE_CLIENT, &ex),
    };
    control::write(&mut send, &hello)
        .await
        .map_err(DialError::Other)?;
    let reply = tokio::time::timeout_at(deadline.into(), control::read(&mut recv))
        .await
        .map_err(|_| DialError::Other("accepted but never answered".into()))?
        .map_err(DialError::Other)?;
    match reply {
        Control::PeerWelcome { proof } if shared.secret.verify(ROLE_SERVER, &ex, &proof) => {
            let _ = send.finish();
            Ok(conn)
        }
        Control::PeerWelcome { .. } => Err(DialError::Other(
            "it failed to prove it holds the job secret".into(),
        )),
        Control::Reject { reason } => Err(DialError::Refused(reason)),
        other => Err(DialError::Other(format!(
            "unexpected {} message",
            other.name()
        ))),
    }
}

/// Accepts connections for the life of the endpoint: rendezvous joins on rank 0, direct links
/// from higher ranks elsewhere. Each is handled in its own task with a time limit, so a silent
/// or hostile client delays nobody.
async fn accept_loop(ep: Endpoint, shared: Arc<Shared>) {
    while let Some(incoming) = ep.accept().await {
        let shared = shared.clone();
        tokio::spawn(async move {
            let from = incoming.remote_address();
            let limit = Duration::from_secs(10);
            match tokio::time::timeout(limit, handle_incoming(incoming, &shared)).await {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => log(
                    shared.me,
                    format!("refused a connection from {from}: {reason}"),
                ),
                Err(_) => log(
                    shared.me,
                    format!("refused a connection from {from}: it sent no hello within {limit:?}"),
                ),
            }
        });
    }
}

async fn handle_incoming(incoming: quinn::Incoming, shared: &Arc<Shared>) -> Result<(), String> {
    let from = incoming.remote_address();
    let conn = incoming
        .await
        .map_err(|e| format!("handshake failed: {e}"))?;
    let (mut send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("no control stream: {e}"))?;
    let msg = match control::read(&mut recv).await {
        Ok(m) => m,
        Err(e) => return refuse(&conn, send, e).await,
    };
    let ex = exporter(&conn)?;
    let me = shared.me;
    match msg {
        Control::Hello {
            protocol,
            job,
            rank,
            node,
            port,
            advertise,
            proof,
        } => {
            if me.index() != 0 {
                return refuse(
                    &conn,
                    send,
                    format!("{me} does not host the rendezvous (rank 0 does)"),
                )
                .await;
            }
            if let Err(reason) = check_hello(shared, protocol, job, rank, &ex, &proof) {
                return refuse(&conn, send, reason).await;
            }
            if shared.master_done.load(Ordering::Acquire) {
                return refuse(&conn, send, "the job has already started".into()).await;
            }
            let Some(cert) = peer_cert(&conn) else {
                return refuse(&conn, send, "no client certificate".into()).await;
            };
            // Reserve the rank (or assign the lowest free one) first, so a duplicate cannot slip
            // in while the welcome is sent.
            let assigned: Result<u32, String> = {
                let mut reserved = lock(&shared.reserved);
                match rank {
                    Some(r) if reserved[r as usize] => {
                        Err(format!("rank {r} has already joined this job"))
                    }
                    Some(r) => Ok(r),
                    None => (1..shared.world)
                        .find(|&r| !reserved[r])
                        .map(|r| r as u32)
                        .ok_or_else(|| {
                            format!("the job is full: all {} ranks have joined", shared.world)
                        }),
                }
                .inspect(|&r| reserved[r as usize] = true)
            };
            let rank = match assigned {
                Ok(r) => r,
                Err(reason) => return refuse(&conn, send, reason).await,
            };
            let reply = Control::Welcome {
                proof: shared.secret.proof(ROLE_SERVER, &ex),
                rank,
            };
            if let Err(e) = control::write(&mut send, &reply).await {
                lock(&shared.reserved)[rank as usize] = false;
                return Err(e);
            }
            let mut joined = lock(&shared.joined);
            let addr = advertise.unwrap_or_else(|| SocketAddr::new(from.ip(), port));
            joined[rank as usize] = Some(Joined {
                conn: conn.clone(),
                send,
                entry: PeerEntry {
                    rank,
                    node,
                    addr,
                    cert: cert.to_vec(),
                },
            });
            drop(joined);
            shared.changed.notify_waiters();
            Ok(())
        }
        Control::PeerHello {
            protocol,
            job,
            rank,
            proof,
        } => {
            if let Err(reason) = check_hello(shared, protocol, job, Some(rank), &ex, &proof) {
                return refuse(&conn, send, reason).await;
            }
            if rank as usize <= me.index() {
                return refuse(
                    &conn,
                    send,
                    format!("rank {rank} should be dialled by {me}, not dial it"),
                )
                .await;
            }
            // The roster comes from rank 0 at about the time the peer got its own.
            let mut roster = shared.roster.subscribe();
            let waited = roster.wait_for(Option::is_some).await.map(|r| r.clone());
            let Ok(Some(roster)) = waited else {
                return refuse(&conn, send, "this rank is shutting down".into()).await;
            };
            if peer_cert(&conn).as_deref() != Some(&roster[rank as usize].cert[..]) {
                return refuse(&conn, send, format!(
                    "the process claiming rank {rank} shows a certificate other than the one pinned at the rendezvous"
                ))
                .await;
            }
            control::write(
                &mut send,
                &Control::PeerWelcome {
                    proof: shared.secret.proof(ROLE_SERVER, &ex),
                },
            )
            .await?;
            let _ = send.finish();
            let mut accepted = lock(&shared.accepted);
            if accepted[rank as usize].is_some() {
                return Err(format!("rank {rank} dialled twice"));
            }
            accepted[rank as usize] = Some(conn);
            drop(accepted);
            shared.changed.notify_waiters();
            Ok(())
        }
        other => refuse(&conn, send, format!("unexpected {} message", other.name())).await,
    }
}

async fn refuse(conn: &Connection, mut send: SendStream, reason: String) -> Result<(), String> {
    let msg = control::encode(&Control::Reject {
        reason: reason.clone(),
    });
    let _ = send.write_all(&msg).await;
    let _ = send.finish();
    let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
    conn.close(VarInt::from_u32(CLOSE_REFUSED), b"refused");
    Err(reason)
}

/// Checks a hello's protocol, job, rank and proof of the secret.
fn check_hello(
    shared: &Shared,
    protocol: u32,
    job: JobKey,
    rank: Option<u32>,
    exporter: &[u8],
    proof: &[u8],
) -> Result<(), String> {
    let claimed = match rank {
        Some(r) => format!("the process claiming rank {r}"),
        None => "a process asking for a rank".to_string(),
    };
    if protocol != PROTOCOL {
        return Err(format!(
            "protocol version {protocol} against this rank's {PROTOCOL}: run the same bonfire version on every rank"
        ));
    }
    if job.world_size != shared.job.world_size {
        return Err(format!(
            "world size mismatch: {claimed} expects {} ranks, this job has {}",
            job.world_size, shared.job.world_size
        ));
    }
    if job.round != shared.job.round {
        return Err(format!(
            "restart round mismatch: {claimed} is in round {}, this job is in round {}",
            job.round, shared.job.round
        ));
    }
    if let Some(rank) = rank
        && (rank == 0 || rank as usize >= shared.world)
    {
        return Err(format!(
            "rank {rank} is not a worker rank of a job of {} ranks",
            shared.world
        ));
    }
    if !shared.secret.verify(ROLE_CLIENT, exporter, proof) {
        return Err(format!(
            "wrong job secret: {claimed} does not hold the secret of this job"
        ));
    }
    Ok(())
}

/// Opens the lanes of a link and starts its readers and its loss watcher.
async fn start_link(
    shared: &Arc<Shared>,
    peer: Rank,
    conn: Connection,
) -> Result<(Arc<Link>, Vec<JoinHandle<()>>), String> {
    let mut lanes = Vec::with_capacity(shared.lanes);
    for _ in 0..shared.lanes {
        let s = conn
            .open_uni()
            .await
            .map_err(|e| format!("cannot open a data stream: {e}"))?;
        lanes.push(tokio::sync::Mutex::new(s));
    }
    let link = Arc::new(Link {
        peer,
        conn: conn.clone(),
        lanes,
        next: AtomicUsize::new(0),
    });
    let mut tasks = Vec::new();
    // Readers: one per incoming lane.
    {
        let (shared, conn) = (shared.clone(), conn.clone());
        tasks.push(tokio::spawn(async move {
            while let Ok(stream) = conn.accept_uni().await {
                let (shared, conn) = (shared.clone(), conn.clone());
                tokio::spawn(async move {
                    if let Err(reason) = read_lane(&shared, peer, stream).await {
                        shared.mailbox.peer_lost(peer, reason.clone());
                        log(shared.me, format!("closing the link to {peer}: {reason}"));
                        conn.close(VarInt::from_u32(CLOSE_BAD_FRAME), reason.as_bytes());
                    }
                });
            }
        }));
    }
    // Loss watcher.
    {
        let (shared, link) = (shared.clone(), link.clone());
        tasks.push(tokio::spawn(async move {
            let err = link.conn.closed().await;
            if shared.closing.load(Ordering::Acquire) {
                return;
            }
            let reason = match err {
                ConnectionError::ApplicationClosed(c) if c.error_code.into_inner() == 0 => {
                    "shut down (its program finished or released bonfire)".to_string()
                }
                ConnectionError::ApplicationClosed(c) => {
                    format!("closed its link: {}", String::from_utf8_lossy(&c.reason))
                }
                ConnectionError::TimedOut => format!(
                    "sent nothing for {:?}: its process died or hung, or the network failed",
                    shared.peer_timeout
                ),
                ConnectionError::LocallyClosed => return,
                other => format!("its link failed: {other}"),
            };
            shared.mailbox.peer_lost(link.peer, reason);
        }));
    }
    Ok((link, tasks))
}

/// Reads frames from one lane until it ends. Errors are protocol violations by the peer.
async fn read_lane(shared: &Shared, peer: Rank, mut stream: RecvStream) -> Result<(), String> {
    let mut header = [0u8; HEADER_LEN];
    // Payloads are read into one arena and split off it; once the consumer has dropped them,
    // `reserve` takes the same memory back, so steady traffic allocates (and faults in pages)
    // once instead of once per frame.
    let mut arena = BytesMut::new();
    loop {
        // A clean end of stream is allowed only between frames.
        let mut got = 0;
        while got < HEADER_LEN {
            match stream.read(&mut header[got..]).await {
                Ok(Some(n)) => got += n,
                Ok(None) if got == 0 => return Ok(()),
                Ok(None) => return Err(format!("{peer} ended a stream inside a frame header")),
                // Connection-level failures are reported by the loss watcher.
                Err(_) => return Ok(()),
            }
        }
        let h = FrameHeader::decode(&header, shared.max_frame)
            .map_err(|e| format!("{peer} sent a malformed frame: {e}"))?;
        match h.kind {
            FrameKind::Goodbye => return Ok(()),
            FrameKind::Data => {
                let len = h.len as usize;
                // Grow with the data that actually arrives: an announced length is not an
                // allocation the peer can make us do up front.
                arena.reserve(len.min(64 << 20));
                let buf = &mut arena;
                while buf.len() < len {
                    match stream.read_chunk(len - buf.len(), true).await {
                        Ok(Some(chunk)) => buf.extend_from_slice(&chunk.bytes),
                        Ok(None) => {
                            return Err(format!(
                                "{peer} ended a stream inside a frame ({} of {len} bytes)",
                                buf.len()
                            ));
                        }
                        Err(_) => return Ok(()),
                    }
                }
                let frame = arena.split().freeze();
                shared.mailbox.deliver(peer, h.tag, frame);
            }
        }
    }
}

/// The link's own limit, for benchmarks: `bytes` bytes written in 1 MiB chunks over `streams`
/// streams of one connection between two endpoints of this process on 127.0.0.1, with
/// bonfire's TLS and transport settings. Returns GB/s (10^9 bytes per second), measured from
/// the first write to the last byte read.
pub async fn loopback_throughput(bytes: usize, streams: usize) -> Result<f64, String> {
    let streams = streams.max(1);
    let local: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let timeout = Duration::from_secs(10);
    let server = endpoint(local, &Identity::generate()?, timeout, streams)?;
    let client = endpoint(local, &Identity::generate()?, timeout, streams)?;
    let addr = server.local_addr().map_err(|e| e.to_string())?;
    let per_stream = bytes / streams / (1 << 20);
    let reader = tokio::spawn(async move {
        let conn = server
            .accept()
            .await
            .ok_or("no connection")?
            .await
            .map_err(|e| e.to_string())?;
        let mut readers = Vec::new();
        for _ in 0..streams {
            let mut s = conn.accept_uni().await.map_err(|e| e.to_string())?;
            readers.push(tokio::spawn(async move {
                let mut n = 0usize;
                while let Ok(Some(chunk)) = s.read_chunk(usize::MAX, true).await {
                    n += chunk.bytes.len();
                }
                n
            }));
        }
        let mut total = 0;
        for r in readers {
            total += r.await.map_err(|e| e.to_string())?;
        }
        Ok::<(usize, Instant), String>((total, Instant::now()))
    });
    let conn = client
        .connect(addr, "bonfire")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let chunk = Bytes::from(vec![0x5au8; 1 << 20]);
    let start = Instant::now();
    let mut writers = Vec::new();
    for _ in 0..streams {
        let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
        let chunk = chunk.clone();
        writers.push(tokio::spawn(async move {
            for _ in 0..per_stream {
                s.write_chunk(chunk.clone())
                    .await
                    .map_err(|e| e.to_string())?;
            }
            s.finish().map_err(|e| e.to_string())?;
            s.stopped().await.map_err(|e| e.to_string())?;
            Ok::<(), String>(())
        }));
    }
    for w in writers {
        w.await.map_err(|e| e.to_string())??;
    }
    let (total, end) = reader.await.map_err(|e| e.to_string())??;
    if total != per_stream * streams * (1 << 20) {
        return Err(format!(
            "read {total} bytes, wrote {}",
            per_stream * streams * (1 << 20)
        ));
    }
    conn.close(VarInt::from_u32(CLOSE_SHUTDOWN), b"done");
    Ok(total as f64 / (end - start).as_secs_f64() / 1e9)
}
