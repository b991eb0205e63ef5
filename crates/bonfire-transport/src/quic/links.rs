//! Making the direct links: the accept loop (every incoming connection is read, checked and
//! handed to the rendezvous or to the peer handshake), and the worker-to-worker handshake on
//! both sides: the higher rank dials, checks the certificate pinned at the rendezvous and
//! proves it holds the secret; the lower rank checks the same of it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bonfire_topology::Rank;
use quinn::{Connection, ConnectionError, Endpoint, SendStream, VarInt};

use super::admission::{
    Claim, Refusal, admit_peer, higher_ranks, list, lower_workers, missing_links, reach_addr,
};
use super::auth::{ROLE_CLIENT, ROLE_SERVER};
use super::control::refuse;
use super::control::{self, CLOSE_REFUSED, Control, ControlError, PROTOCOL, PeerEntry, Unexpected};
use super::endpoint::{DialError, ExporterError, dial, exporter, peer_cert, proven};
use super::error::{QuicError, Who};
use super::rendezvous::{HelloError, WorkerHello, accept_hello};
use super::shared::{Shared, lock, log};

/// Why a worker could not link to a lower worker.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PeerDialError {
    /// The peer refused this rank, in its words.
    #[error("{reason}")]
    Refused { reason: String },
    /// The peer's address did not answer.
    #[error("no connection to {addr}: {source}")]
    Unreachable { addr: SocketAddr, source: DialError },
    /// Someone answered at the address, but not with the certificate rank 0 recorded.
    #[error("{addr} answered with a certificate other than the one pinned at the rendezvous")]
    NotPinned { addr: SocketAddr },
    #[error(transparent)]
    Exporter(#[from] ExporterError),
    /// The control stream could not be opened.
    #[error("{0}")]
    OpenControl(ConnectionError),
    /// The hello could not be sent or the answer read.
    #[error(transparent)]
    Control(ControlError),
    /// The peer said nothing before the deadline.
    #[error("accepted but never answered")]
    Silent,
    /// The peer's proof did not verify.
    #[error("it failed to prove it holds the job secret")]
    BadProof,
    #[error(transparent)]
    Unexpected(#[from] Unexpected),
    /// The task dialling the peer panicked or was cancelled.
    #[error("dial task failed: {0}")]
    Task(tokio::task::JoinError),
}

impl PeerDialError {
    /// The error of this rank's job coming up: a refusal names who refused.
    fn into_quic(self, me: Who, peer: Rank) -> QuicError {
        match self {
            PeerDialError::Refused { reason } => QuicError::Refused {
                me,
                by: peer.to_string(),
                reason,
            },
            other => QuicError::Link {
                me,
                peer,
                reason: other.to_string(),
            },
        }
    }
}

/// Why this rank dropped a connection it accepted. Logged, with the address it came from.
#[derive(Debug, thiserror::Error)]
enum IncomingError {
    /// The TLS handshake failed.
    #[error("handshake failed: {0}")]
    Handshake(ConnectionError),
    /// The handshake, the control stream or the hello did not come within the pre-proof limit.
    #[error("no {what} within {limit:?}")]
    NoHello { what: &'static str, limit: Duration },
    /// The peer opened no control stream.
    #[error("no control stream: {0}")]
    NoControlStream(ConnectionError),
    /// Its first message was unreadable (it was refused with this reason).
    #[error(transparent)]
    Unreadable(ControlError),
    #[error(transparent)]
    Exporter(#[from] ExporterError),
    /// Its first message was neither hello (it was refused with this reason).
    #[error(transparent)]
    Unexpected(#[from] Unexpected),
    /// Refused, and told why.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The rendezvous dropped the worker.
    #[error(transparent)]
    Hello(#[from] HelloError),
    /// The welcome to a peer could not be sent.
    #[error(transparent)]
    Welcome(ControlError),
    /// A second link from the same rank.
    #[error("rank {rank} dialled twice")]
    DialledTwice { rank: u32 },
}

/// Workers: dial every lower worker (concurrently), then wait for every higher rank to dial in.
/// Returns a connection for every worker rank but this one; rank 0's slot is left empty (that
/// link is the rendezvous connection).
pub(crate) async fn link_workers(
    shared: &Arc<Shared>,
    ep: &Endpoint,
    peers: &[PeerEntry],
    deadline: Instant,
    waited: Duration,
) -> Result<Vec<Option<Connection>>, QuicError> {
    let me = Who(Some(shared.me));
    let mut conns: Vec<Option<Connection>> = (0..shared.world).map(|_| None).collect();
    // Dial every lower worker, concurrently.
    let mut dials = tokio::task::JoinSet::new();
    // Which rank each task dials, to name it should the task itself fail.
    let mut dialling = HashMap::new();
    for r in lower_workers(shared.me) {
        let (ep, shared, entry) = (ep.clone(), shared.clone(), peers[r].clone());
        let rank = entry.rank;
        let task = dials.spawn(async move { dial_peer(&ep, &shared, &entry, deadline).await });
        dialling.insert(task.id(), rank);
    }
    while let Some(done) = dials.join_next_with_id().await {
        let (rank, result) = match done {
            Ok((id, result)) => (dialling[&id], result),
            Err(e) => (dialling[&e.id()], Err(PeerDialError::Task(e))),
        };
        let conn = result.map_err(|e| e.into_quic(me, Rank(rank)))?;
        conns[rank as usize] = Some(conn);
    }
    // Wait for every higher rank to dial in.
    shared
        .wait_for_ranks(deadline, || {
            missing_links(shared.me, &lock(&shared.accepted))
        })
        .await
        .map_err(|missing| QuicError::Timeout {
            me,
            stage: "links from higher ranks",
            waited,
            missing: list(missing),
        })?;
    let mut accepted = lock(&shared.accepted);
    for r in higher_ranks(shared.me, shared.world) {
        conns[r] = accepted[r].take();
    }
    Ok(conns)
}

/// The higher rank of a direct link: dials the lower one, checks its certificate against the
/// roster's pin, and exchanges proofs of the secret.
async fn dial_peer(
    ep: &Endpoint,
    shared: &Shared,
    entry: &PeerEntry,
    deadline: Instant,
) -> Result<Connection, PeerDialError> {
    let addr = entry.addr;
    let conn = dial(ep, addr, deadline)
        .await
        .map_err(|source| PeerDialError::Unreachable { addr, source })?;
    if peer_cert(&conn).as_deref() != Some(&entry.cert[..]) {
        conn.close(VarInt::from_u32(CLOSE_REFUSED), b"certificate not pinned");
        return Err(PeerDialError::NotPinned { addr });
    }
    let ex = exporter(&conn)?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(PeerDialError::OpenControl)?;
    let hello = Control::PeerHello {
        protocol: PROTOCOL,
        job: shared.job,
        rank: shared.me.0,
        proof: shared.secret.proof(ROLE_CLIENT, &ex),
    };
    control::write(&mut send, &hello)
        .await
        .map_err(PeerDialError::Control)?;
    let reply = tokio::time::timeout_at(deadline.into(), control::read(&mut recv))
        .await
        .map_err(|_| PeerDialError::Silent)?
        .map_err(PeerDialError::Control)?;
    match reply {
        Control::PeerWelcome { proof } if shared.secret.verify(ROLE_SERVER, &ex, &proof) => {
            let _ = send.finish();
            proven(&conn);
            tracing::debug!(
                "{}: QUIC link to rank {} at {addr} up (both proved the job secret)",
                shared.me,
                entry.rank
            );
            Ok(conn)
        }
        Control::PeerWelcome { .. } => Err(PeerDialError::BadProof),
        // The peer showed the certificate pinned at the rendezvous: this is its word.
        Control::Reject { reason, .. } => Err(PeerDialError::Refused {
            reason: crate::printable(&reason),
        }),
        other => Err(other.unexpected().into()),
    }
}

/// Connections whose peer has not proved the job secret yet, at most, at once: beyond it the
/// handshake is refused (a real rank's dial retries until its deadline), so a flood of strangers
/// holds at most this many times [`super::endpoint::PRE_PROOF_WINDOW`] of a rank's memory.
pub(crate) const MAX_UNPROVEN: usize = 256;

/// How long an accepted connection has to complete its TLS handshake and send its hello (the
/// proof of the secret): a real rank sends it at once, so this only bounds how long a silent or
/// trickling stranger holds one of the [`MAX_UNPROVEN`] places. A real rank cut short dials
/// again.
pub(crate) const PRE_PROOF_LIMIT: Duration = Duration::from_secs(4);

/// Says that a connection was refused: the first few, then every hundredth, with the count (a
/// flood of strangers does not flood the log).
fn refused(me: Rank, count: &AtomicUsize, what: impl std::fmt::Display) {
    let n = count.fetch_add(1, Ordering::Relaxed) + 1;
    if n <= 5 || n.is_multiple_of(100) {
        log(
            me,
            format!("refused a connection from {what} ({n} refused so far)"),
        );
    }
}

/// Accepts connections for the life of the endpoint: rendezvous joins on rank 0, direct links
/// from higher ranks elsewhere. Each is handled in its own task with a time limit, so a silent
/// or hostile client delays nobody; at most [`MAX_UNPROVEN`] are handled at once.
pub(crate) async fn accept_loop(ep: Endpoint, shared: Arc<Shared>) {
    let unproven = Arc::new(AtomicUsize::new(0));
    let count = Arc::new(AtomicUsize::new(0));
    while let Some(incoming) = ep.accept().await {
        let from = incoming.remote_address();
        if unproven.load(Ordering::Relaxed) >= MAX_UNPROVEN {
            incoming.refuse();
            refused(
                shared.me,
                &count,
                format_args!("{from}: {MAX_UNPROVEN} connections were already proving themselves"),
            );
            continue;
        }
        unproven.fetch_add(1, Ordering::Relaxed);
        let (shared, unproven, count) = (shared.clone(), unproven.clone(), count.clone());
        tokio::spawn(async move {
            // The hello's own limit is PRE_PROOF_LIMIT; a proven peer may then wait for the
            // roster, at most as long as the job may take to form.
            let limit = shared.connect_timeout.max(PRE_PROOF_LIMIT);
            let handled = tokio::time::timeout(limit, handle_incoming(incoming, &shared)).await;
            unproven.fetch_sub(1, Ordering::Relaxed);
            match handled {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => refused(shared.me, &count, format_args!("{from}: {reason}")),
                Err(_) => refused(
                    shared.me,
                    &count,
                    format_args!("{from}: it did not complete its handshake within {limit:?}"),
                ),
            }
        });
    }
}

/// Reads an accepted connection's first message and hands it to the rendezvous (a worker's
/// hello, rank 0 only) or to the peer handshake (a higher rank's hello); anything else is
/// refused.
async fn handle_incoming(
    incoming: quinn::Incoming,
    shared: &Arc<Shared>,
) -> Result<(), IncomingError> {
    let from = incoming.remote_address();
    let pre_proof = tokio::time::Instant::now() + PRE_PROOF_LIMIT;
    let in_time = |what| {
        move |_: tokio::time::error::Elapsed| IncomingError::NoHello {
            what,
            limit: PRE_PROOF_LIMIT,
        }
    };
    let conn = tokio::time::timeout_at(pre_proof, incoming)
        .await
        .map_err(in_time("handshake"))?
        .map_err(IncomingError::Handshake)?;
    let (send, mut recv) = tokio::time::timeout_at(pre_proof, conn.accept_bi())
        .await
        .map_err(in_time("control stream"))?
        .map_err(IncomingError::NoControlStream)?;
    // A first message is a hello, a few hundred bytes: nothing longer is read or decoded.
    let read = control::read_at_most(&mut recv, control::MAX_HELLO);
    let msg = match tokio::time::timeout_at(pre_proof, read).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            return Err(IncomingError::Unreadable(
                refuse(&conn, &shared.secret, send, e).await,
            ));
        }
        Err(elapsed) => {
            conn.close(VarInt::from_u32(CLOSE_REFUSED), b"no hello in time");
            return Err(in_time("hello")(elapsed));
        }
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
                return Err(refuse(&conn, &shared.secret, send, Refusal::NotHost { me })
                    .await
                    .into());
            }
            let hello = WorkerHello {
                claim: Claim {
                    protocol,
                    job,
                    proof,
                },
                rank,
                node,
                addr: reach_addr(from, port, advertise),
            };
            Ok(accept_hello(shared, conn, send, &ex, hello).await?)
        }
        Control::PeerHello {
            protocol,
            job,
            rank,
            proof,
        } => {
            let claim = Claim {
                protocol,
                job,
                proof,
            };
            accept_peer_hello(shared, conn, send, &ex, rank, &claim).await
        }
        other => Err(refuse(&conn, &shared.secret, send, other.unexpected())
            .await
            .into()),
    }
}

/// The lower rank of a direct link: checks the higher rank's hello against the job and the
/// roster, and welcomes it.
async fn accept_peer_hello(
    shared: &Arc<Shared>,
    conn: Connection,
    mut send: SendStream,
    ex: &[u8],
    rank: u32,
    claim: &Claim,
) -> Result<(), IncomingError> {
    let admitted = admit_peer(shared.job, shared.me, rank, claim, &shared.secret, ex);
    if let Err(reason) = admitted {
        return Err(refuse(&conn, &shared.secret, send, reason).await.into());
    }
    // The roster comes from rank 0 at about the time the peer got its own.
    let mut roster = shared.roster.subscribe();
    let waited = roster.wait_for(Option::is_some).await.map(|r| r.clone());
    let Ok(Some(roster)) = waited else {
        return Err(refuse(&conn, &shared.secret, send, Refusal::ShuttingDown)
            .await
            .into());
    };
    if peer_cert(&conn).as_deref() != Some(&roster[rank as usize].cert[..]) {
        return Err(
            refuse(&conn, &shared.secret, send, Refusal::NotPinned { rank })
                .await
                .into(),
        );
    }
    proven(&conn);
    control::write(
        &mut send,
        &Control::PeerWelcome {
            proof: shared.secret.proof(ROLE_SERVER, ex),
        },
    )
    .await
    .map_err(IncomingError::Welcome)?;
    let _ = send.finish();
    let mut accepted = lock(&shared.accepted);
    if accepted[rank as usize].is_some() {
        return Err(IncomingError::DialledTwice { rank });
    }
    accepted[rank as usize] = Some(conn);
    drop(accepted);
    shared.changed.notify_waiters();
    Ok(())
}
