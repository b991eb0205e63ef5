//! The QUIC endpoint every rank opens: bonfire's TLS and transport settings, the UDP socket under
//! it, resolving the master address, dialling with retries until a deadline, and what a
//! connection tells about its peer (its certificate, the keying material proofs are bound to).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, VarInt};
use rustls::pki_types::CertificateDer;

use super::auth::{Identity, PinAfterHandshake};
use super::config::Congestion;
use super::error::SetupError;

const ALPN: &[u8] = b"bonfire/1";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-bonfire-proof";

/// The certificate the peer showed in the TLS handshake.
pub(crate) fn peer_cert(conn: &Connection) -> Option<CertificateDer<'static>> {
    conn.peer_identity()?
        .downcast::<Vec<CertificateDer<'static>>>()
        .ok()?
        .first()
        .cloned()
}

/// Keying material exported from the connection's TLS session: what proofs are bound to.
pub(crate) fn exporter(conn: &Connection) -> Result<[u8; 32], ExporterError> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, EXPORTER_LABEL, b"")
        .map_err(ExporterError)?;
    Ok(out)
}

/// The TLS session would not export keying material, so no proof can be bound to it.
#[derive(Debug, thiserror::Error)]
#[error("cannot export TLS keying material: {0:?}")]
pub(crate) struct ExporterError(quinn::crypto::ExportKeyingMaterialError);

/// Why [`dial`] got no connection.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    /// The endpoint refused to start the attempt (a bad address, a closed endpoint).
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: quinn::ConnectError,
    },
    /// The last attempt's handshake failed.
    #[error("handshake failed: {0}")]
    Handshake(quinn::ConnectionError),
    /// The last attempt got no answer in its time.
    #[error("no answer from {addr}")]
    NoAnswer { addr: SocketAddr },
    /// The deadline had passed before the first attempt.
    #[error("no attempt made")]
    NoAttempt,
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

/// What a connection may have in flight unread before its peer has proved the job secret: a
/// stranger that fills streams the application never reads holds at most this much of a rank's
/// memory per connection (the accept loop takes at most [`super::links::MAX_UNPROVEN`] at once).
pub(crate) const PRE_PROOF_WINDOW: u32 = 64 << 10;
/// A connection's receive window once its peer has proved the job secret ([`proven`]).
pub(crate) const RECEIVE_WINDOW: u32 = 128 << 20;

/// Raises `conn`'s receive window for bulk transfer: its peer proved the job secret.
pub(crate) fn proven(conn: &Connection) {
    conn.set_receive_window(VarInt::from_u32(RECEIVE_WINDOW));
}

/// Idle timeout and keep-alives from the peer timeout; windows, stream limits and MTU for bulk
/// transfer (the connection's window starts small, [`PRE_PROOF_WINDOW`], until [`proven`]).
fn transport_config(
    peer_timeout: Duration,
    streams: usize,
    congestion: Congestion,
) -> Result<quinn::TransportConfig, SetupError> {
    let mut t = quinn::TransportConfig::default();
    t.congestion_controller_factory(congestion.factory());
    let idle = quinn::IdleTimeout::try_from(peer_timeout).map_err(|_| SetupError::PeerTimeout {
        timeout: peer_timeout,
    })?;
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some((peer_timeout / 4).max(Duration::from_millis(100))));
    // Bulk transfer: windows large enough to keep a fast link busy.
    t.stream_receive_window(VarInt::from_u32(32 << 20));
    t.receive_window(VarInt::from_u32(PRE_PROOF_WINDOW));
    t.send_window(128 << 20);
    t.max_concurrent_uni_streams(VarInt::from_u32((streams as u32).saturating_add(4)));
    t.max_concurrent_bidi_streams(VarInt::from_u32(4));
    // Discover datagrams up to jumbo size: loopback and jumbo-frame networks use them.
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(8952);
    t.mtu_discovery_config(Some(mtu));
    t.enable_segmentation_offload(true);
    Ok(t)
}

/// Opens this rank's UDP socket on `bind` and the QUIC endpoint on it, as server and client.
pub(crate) fn endpoint(
    bind: SocketAddr,
    identity: &Identity,
    peer_timeout: Duration,
    streams: usize,
) -> Result<Endpoint, SetupError> {
    endpoint_with(bind, identity, peer_timeout, streams, Congestion::default())
}

/// [`endpoint`] with a congestion controller.
pub(crate) fn endpoint_with(
    bind: SocketAddr,
    identity: &Identity,
    peer_timeout: Duration,
    streams: usize,
    congestion: Congestion,
) -> Result<Endpoint, SetupError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let provider = provider();
    let tls = |e: rustls::Error| SetupError::Tls {
        source: Arc::new(e),
    };
    let quic = |side: &'static str| {
        move |e: quinn::crypto::rustls::NoInitialCipherSuite| SetupError::QuicConfig {
            side,
            source: Arc::new(e),
        }
    };
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
    let transport = Arc::new(transport_config(peer_timeout, streams, congestion)?);
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(
        QuicServerConfig::try_from(server).map_err(quic("server"))?,
    ));
    server.transport_config(transport.clone());
    let mut client = quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(client).map_err(quic("client"))?,
    ));
    client.transport_config(transport);

    let socket =
        Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP)).map_err(|e| {
            SetupError::Socket {
                source: Arc::new(e),
            }
        })?;
    // Large kernel buffers stop drops under bursts; the kernel may cap them, which is fine.
    let _ = socket.set_recv_buffer_size(8 << 20);
    let _ = socket.set_send_buffer_size(8 << 20);
    if bind.is_ipv6() {
        let _ = socket.set_only_v6(false);
    }
    socket.bind(&bind.into()).map_err(|e| SetupError::Bind {
        addr: bind,
        source: Arc::new(e),
    })?;
    socket
        .set_nonblocking(true)
        .map_err(|e| SetupError::ConfigureSocket {
            source: Arc::new(e),
        })?;
    let mut ep = Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server),
        socket.into(),
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(|e| SetupError::Endpoint {
        addr: bind,
        source: Arc::new(e),
    })?;
    ep.set_default_client_config(client);
    Ok(ep)
}

/// The first address `master` (`host:port`) resolves to.
pub(crate) async fn resolve(master: &str) -> Result<SocketAddr, SetupError> {
    let mut addrs = tokio::net::lookup_host(master)
        .await
        .map_err(|e| SetupError::Resolve {
            master: master.to_string(),
            source: Arc::new(e),
        })?;
    addrs.next().ok_or_else(|| SetupError::NoAddress {
        master: master.to_string(),
    })
}

/// Dials `addr` until it answers or `deadline` passes.
pub(crate) async fn dial(
    ep: &Endpoint,
    addr: SocketAddr,
    deadline: Instant,
) -> Result<Connection, DialError> {
    let mut attempt = Duration::from_secs(2);
    let mut last = DialError::NoAttempt;
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(last);
        }
        let budget = attempt.min(deadline - now);
        match ep.connect(addr, "bonfire") {
            Err(source) => return Err(DialError::Connect { addr, source }),
            Ok(connecting) => match tokio::time::timeout(budget, connecting).await {
                Ok(Ok(conn)) => return Ok(conn),
                Ok(Err(e)) => last = DialError::Handshake(e),
                Err(_) => last = DialError::NoAnswer { addr },
            },
        }
        // A refused or lost handshake returns at once; do not spin.
        let pause =
            Duration::from_millis(200).min(deadline.saturating_duration_since(Instant::now()));
        tokio::time::sleep(pause).await;
        attempt = (attempt * 2).min(Duration::from_secs(4));
    }
}
