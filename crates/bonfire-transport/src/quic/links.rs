//! Making the direct links: the accept loop (every incoming connection is read, checked and
//! handed to the rendezvous or to the peer handshake), and the worker-to-worker handshake on
//! both sides: the higher rank dials, checks the certificate pinned at the rendezvous and
//! proves it holds the secret; the lower rank checks the same of it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bonfire_topology::Rank;
use quinn::{Connection, Endpoint, SendStream, VarInt};

use super::auth::{ROLE_CLIENT, ROLE_SERVER};
use super::control::{self, CLOSE_REFUSED, Control, JobKey, PROTOCOL, PeerEntry, refuse};
use super::endpoint::{dial, exporter, peer_cert};
use super::error::{QuicError, Who};
use super::rendezvous::{WorkerHello, accept_hello, check_hello};
use super::shared::{Shared, list, lock, log};

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
    let fail = |reason: String| QuicError::Link {
        me,
        peer: Rank(0),
        reason,
    };
    let mut conns: Vec<Option<Connection>> = (0..shared.world).map(|_| None).collect();
    // Dial every lower worker, concurrently.
    let mut dials = tokio::task::JoinSet::new();
    for entry in peers.iter().take(shared.me.index()).skip(1) {
        let (ep, shared, entry) = (ep.clone(), shared.clone(), entry.clone());
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
    shared
        .wait_for_ranks(deadline, || {
            let accepted = lock(&shared.accepted);
            (shared.me.index() + 1..shared.world)
                .filter(|&r| accepted[r].is_none())
                .collect()
        })
        .await
        .map_err(|missing| QuicError::Timeout {
            me,
            stage: "links from higher ranks",
            waited,
            missing: list(missing),
        })?;
    let mut accepted = lock(&shared.accepted);
    for r in shared.me.index() + 1..shared.world {
        conns[r] = accepted[r].take();
    }
    Ok(conns)
}

pub(crate) enum DialError {
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
pub(crate) async fn accept_loop(ep: Endpoint, shared: Arc<Shared>) {
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
    let (send, mut recv) = conn
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
            let hello = WorkerHello {
                protocol,
                job,
                rank,
                node,
                addr: advertise.unwrap_or_else(|| SocketAddr::new(from.ip(), port)),
                proof,
            };
            accept_hello(shared, conn, send, &ex, hello).await
        }
        Control::PeerHello {
            protocol,
            job,
            rank,
            proof,
        } => accept_peer_hello(shared, conn, send, &ex, protocol, job, rank, &proof).await,
        other => refuse(&conn, send, format!("unexpected {} message", other.name())).await,
    }
}

/// The lower rank of a direct link: checks the higher rank's hello against the job and the
/// roster, and welcomes it.
#[allow(clippy::too_many_arguments)]
async fn accept_peer_hello(
    shared: &Arc<Shared>,
    conn: Connection,
    mut send: SendStream,
    ex: &[u8],
    protocol: u32,
    job: JobKey,
    rank: u32,
    proof: &[u8],
) -> Result<(), String> {
    let me = shared.me;
    if let Err(reason) = check_hello(shared, protocol, job, Some(rank), ex, proof) {
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
            proof: shared.secret.proof(ROLE_SERVER, ex),
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
