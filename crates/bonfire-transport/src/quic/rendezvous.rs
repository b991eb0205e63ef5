//! The rendezvous: rank 0 admits workers (checks each hello, assigns or confirms its rank,
//! welcomes it) and, once every rank is in, sends them all the roster; a worker dials rank 0,
//! proves it holds the secret, learns its rank and waits for the roster.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bonfire_topology::{NodeLayout, Rank};
use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};

use super::admission::{
    Claim, MalformedRoster, Refusal, assigned_rank, check_roster, layout, list, missing_workers,
    roster,
};
use super::auth::{ROLE_CLIENT, ROLE_SERVER};
use super::config::QuicConfig;
use super::control::{
    self, CLOSE_REFUSED, Control, ControlError, JobKey, PROTOCOL, PeerEntry, Unexpected, refuse,
};
use super::endpoint::{ExporterError, dial, exporter, peer_cert};
use super::error::{QuicError, Who};
use super::shared::{Joined, Shared, lock};

/// The links rank 0 leaves the rendezvous with (one per worker), and the job's node layout.
pub(crate) type Links = (Vec<Option<Connection>>, NodeLayout);

/// What went wrong between a worker and rank 0 once they were connected.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JoinError {
    #[error(transparent)]
    Exporter(#[from] ExporterError),
    /// The control stream to rank 0 could not be opened.
    #[error("{0}")]
    OpenControl(quinn::ConnectionError),
    /// The hello could not be sent.
    #[error(transparent)]
    SendHello(ControlError),
    /// Rank 0 said nothing before the deadline.
    #[error("rank 0 accepted the connection but never answered")]
    Silent,
    /// Rank 0's control stream ended or failed.
    #[error("rank 0 closed the rendezvous: {0}")]
    Closed(ControlError),
    /// Rank 0 assigned a rank this worker cannot take.
    #[error("rank 0 assigned an invalid rank {rank}")]
    InvalidRank { rank: u32 },
    #[error(transparent)]
    Unexpected(#[from] Unexpected),
    #[error(transparent)]
    Roster(#[from] MalformedRoster),
}

/// The error of a link to rank 0 that failed while joining.
fn to_host(me: Who, e: impl Into<JoinError>) -> QuicError {
    QuicError::Link {
        me,
        peer: Rank(0),
        reason: e.into().to_string(),
    }
}

/// Why rank 0 dropped a worker's hello.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HelloError {
    /// Refused, and told why.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The welcome could not be sent; the rank is free again.
    #[error(transparent)]
    Welcome(ControlError),
}

/// Rank 0: wait for every worker, send the roster.
pub(crate) async fn host_rendezvous(
    shared: &Arc<Shared>,
    config: &QuicConfig,
    ep: &Endpoint,
    deadline: Instant,
) -> Result<Links, QuicError> {
    let me = Who(Some(shared.me));
    let arrived = shared
        .wait_for_ranks(deadline, || missing_workers(&lock(&shared.joined)))
        .await;
    // From here on the rendezvous is closed, in success or in failure.
    lock(&shared.admission).close();
    let mut joined: Vec<Joined> = lock(&shared.joined)
        .iter_mut()
        .filter_map(Option::take)
        .collect();
    if let Err(missing) = arrived {
        let reason = Refusal::TimedOut {
            missing: missing.clone(),
            world: shared.world,
        }
        .to_string();
        for j in &mut joined {
            let reject = control::reject(&j.conn, &shared.secret, reason.clone());
            let _ = control::write(&mut j.send, &reject).await;
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
    let own = PeerEntry {
        rank: 0,
        node: config.node,
        addr: own,
        cert: shared.identity_cert.to_vec(),
    };
    let peers = roster(own, joined.iter().map(|j| j.entry.clone()));
    let roster = Control::Roster {
        peers: peers.clone(),
    };
    let mut conns: Vec<Option<Connection>> = (0..shared.world).map(|_| None).collect();
    for j in &mut joined {
        let rank = j.entry.rank;
        control::write(&mut j.send, &roster)
            .await
            .map_err(|e| QuicError::Link {
                me,
                peer: Rank(rank),
                reason: e.to_string(),
            })?;
        let _ = j.send.finish();
        conns[rank as usize] = Some(j.conn.clone());
    }
    Ok((conns, layout(&peers)))
}

/// A worker that rank 0 has welcomed, waiting for the roster.
pub(crate) struct Joining {
    pub(crate) rank: Rank,
    conn: Connection,
    recv: RecvStream,
    by: String,
}

/// How long a worker waits before dialling the rendezvous again after an answer that did not
/// prove the job secret.
const REDIAL_PAUSE: Duration = Duration::from_millis(500);

/// What one attempt to join ended with, when it did not join.
enum Attempt {
    /// Rank 0 (it proved the secret, or sealed its refusal) or this rank's own side ended the
    /// join: no point dialling again.
    Final(QuicError),
    /// Whatever answered at the master address proved nothing (a refusal without a valid seal, a
    /// welcome with a wrong proof, a connection closed before any answer): a stranger, another
    /// job, or rank 0 cutting a slow hello short. The worker dials again until its deadline and
    /// then fails with this.
    Unproven(QuicError),
}

/// Workers: join through rank 0 and learn (or confirm) this process's rank. An answer that does
/// not prove the job secret ends nothing: the worker dials again until `deadline` (so a
/// stranger answering at the master address cannot stop a job forming), and fails with the last
/// such answer only then.
pub(crate) async fn join(
    ep: &Endpoint,
    config: &QuicConfig,
    master: SocketAddr,
    deadline: Instant,
) -> Result<Joining, QuicError> {
    let mut said = false;
    loop {
        match attempt(ep, config, master, deadline).await {
            Ok(joining) => return Ok(joining),
            Err(Attempt::Final(e)) => return Err(e),
            Err(Attempt::Unproven(e)) => {
                if Instant::now() + REDIAL_PAUSE >= deadline {
                    return Err(e);
                }
                if !said {
                    said = true;
                    tracing::warn!(
                        "{}: {e}; that answer did not prove this job's secret, so this rank \
                         dials again until its connect timeout",
                        Who(config.rank)
                    );
                }
                tokio::time::sleep(REDIAL_PAUSE).await;
            }
        }
    }
}

/// One attempt of [`join`]: dial rank 0, send the hello, read the answer.
async fn attempt(
    ep: &Endpoint,
    config: &QuicConfig,
    master: SocketAddr,
    deadline: Instant,
) -> Result<Joining, Attempt> {
    let me = Who(config.rank);
    let started = Instant::now();
    let by = format!("the rendezvous at {} (rank 0)", config.master);
    let conn = dial(ep, master, deadline)
        .await
        .map_err(|e| QuicError::Unreachable {
            master: config.master.clone(),
            waited: started.elapsed(),
            detail: e.to_string(),
        })
        .map_err(Attempt::Final)?;
    let ex = exporter(&conn).map_err(|e| Attempt::Final(to_host(me, e)))?;
    let (mut send, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| Attempt::Unproven(to_host(me, JoinError::OpenControl(e))))?;
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
    control::write(&mut send, &hello)
        .await
        .map_err(|e| Attempt::Unproven(to_host(me, JoinError::SendHello(e))))?;
    let _ = send.finish();
    let reply = tokio::time::timeout_at(deadline.into(), control::read(&mut recv))
        .await
        .map_err(|_| Attempt::Final(to_host(me, JoinError::Silent)))?
        .map_err(|e| Attempt::Unproven(to_host(me, JoinError::Closed(e))))?;
    match reply {
        Control::Welcome { proof, rank } => {
            if !config.secret.verify(ROLE_SERVER, &ex, &proof) {
                conn.close(VarInt::from_u32(CLOSE_REFUSED), b"wrong job secret");
                return Err(Attempt::Unproven(QuicError::Unauthenticated {
                    me,
                    peer: by,
                    reason: "it does not hold this job's secret (is another job using this port?)"
                        .into(),
                }));
            }
            let Some(rank) = assigned_rank(config.rank, rank, config.world_size) else {
                return Err(Attempt::Final(to_host(me, JoinError::InvalidRank { rank })));
            };
            // Rank 0 proved the secret: this connection stays as the data link to it.
            super::endpoint::proven(&conn);
            Ok(Joining {
                rank,
                conn,
                recv,
                by,
            })
        }
        Control::Reject { reason, seal } => {
            if control::sealed(&config.secret, &ex, &reason, &seal) {
                return Err(Attempt::Final(QuicError::Refused { me, by, reason }));
            }
            // Unauthenticated: shown escaped, and not taken as final.
            Err(Attempt::Unproven(QuicError::Refused {
                me,
                by,
                reason: format!(
                    "{} (the refusal was not sealed with this job's secret: the rendezvous \
                     holds another secret, or another process answers at this address)",
                    crate::printable(&reason)
                ),
            }))
        }
        other => Err(Attempt::Unproven(to_host(me, other.unexpected()))),
    }
}

/// Workers: wait for the roster from rank 0 and publish it to the accept loop; returns the
/// connection to rank 0 (it stays as the data link) and the roster.
pub(crate) async fn finish_join(
    shared: &Shared,
    config: &QuicConfig,
    joining: Joining,
    deadline: Instant,
) -> Result<(Connection, Arc<Vec<PeerEntry>>), QuicError> {
    let me = Who(Some(shared.me));
    let Joining {
        conn, mut recv, by, ..
    } = joining;
    let reply = tokio::time::timeout_at(deadline.into(), control::read(&mut recv))
        .await
        .map_err(|_| QuicError::Timeout {
            me,
            stage: "the roster from rank 0",
            waited: config.connect_timeout,
            missing: "the rendezvous did not complete (other ranks did not join)".into(),
        })?
        .map_err(|e| to_host(me, JoinError::Closed(e)))?;
    let peers = match reply {
        Control::Roster { peers } => peers,
        // Rank 0 proved the secret on this connection already.
        Control::Reject { reason, .. } => {
            return Err(QuicError::Refused {
                me,
                by,
                reason: crate::printable(&reason),
            });
        }
        other => return Err(to_host(me, other.unexpected())),
    };
    check_roster(&peers, shared.world).map_err(|e| to_host(me, e))?;
    let peers = Arc::new(peers);
    shared.roster.send_replace(Some(peers.clone()));
    Ok((conn, peers))
}

/// What a worker's hello announced, and the address it is reached at.
pub(crate) struct WorkerHello {
    pub(crate) claim: Claim,
    pub(crate) rank: Option<u32>,
    pub(crate) node: u32,
    pub(crate) addr: SocketAddr,
}

/// Rank 0: admits (or refuses) a worker that sent its hello, and welcomes it.
pub(crate) async fn accept_hello(
    shared: &Arc<Shared>,
    conn: Connection,
    mut send: SendStream,
    ex: &[u8],
    hello: WorkerHello,
) -> Result<(), HelloError> {
    let WorkerHello {
        claim,
        rank,
        node,
        addr,
    } = hello;
    // TLS asks every client for a certificate, so this is a formality; it comes first so that
    // a refusal never holds a reservation.
    let Some(cert) = peer_cert(&conn) else {
        return Err(refuse(&conn, &shared.secret, send, Refusal::NoCertificate)
            .await
            .into());
    };
    // The rank is reserved (or the lowest free one assigned) before the welcome is sent, so a
    // duplicate cannot slip in meanwhile.
    let admitted = lock(&shared.admission).admit(rank, &claim, &shared.secret, ex);
    let rank = match admitted {
        Ok(r) => r,
        Err(reason) => return Err(refuse(&conn, &shared.secret, send, reason).await.into()),
    };
    // The worker proved the secret: this connection is its data link to rank 0.
    super::endpoint::proven(&conn);
    let reply = Control::Welcome {
        proof: shared.secret.proof(ROLE_SERVER, ex),
        rank,
    };
    if let Err(e) = control::write(&mut send, &reply).await {
        lock(&shared.admission).release(rank);
        return Err(HelloError::Welcome(e));
    }
    let mut joined = lock(&shared.joined);
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
