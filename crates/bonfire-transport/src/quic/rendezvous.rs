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

/// Workers: join through rank 0 and learn (or confirm) this process's rank.
pub(crate) async fn join(
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
        .map_err(|e| QuicError::Unreachable {
            master: config.master.clone(),
            waited: started.elapsed(),
            detail: e.to_string(),
        })?;
    let ex = exporter(&conn).map_err(|e| to_host(me, e))?;
    let (mut send, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| to_host(me, JoinError::OpenControl(e)))?;
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
        .map_err(|e| to_host(me, JoinError::SendHello(e)))?;
    let _ = send.finish();
    let reply = tokio::time::timeout_at(deadline.into(), control::read(&mut recv))
        .await
        .map_err(|_| to_host(me, JoinError::Silent))?
        .map_err(|e| to_host(me, JoinError::Closed(e)))?;
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
            let Some(rank) = assigned_rank(config.rank, rank, config.world_size) else {
                return Err(to_host(me, JoinError::InvalidRank { rank }));
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
        // Unauthenticated (rank 0 has proved nothing yet): shown escaped.
        Control::Reject { reason } => Err(QuicError::Refused {
            me,
            by,
            reason: crate::printable(&reason),
        }),
        other => Err(to_host(me, other.unexpected())),
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
        Control::Reject { reason } => return Err(QuicError::Refused { me, by, reason }),
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
        return Err(refuse(&conn, send, Refusal::NoCertificate).await.into());
    };
    // The rank is reserved (or the lowest free one assigned) before the welcome is sent, so a
    // duplicate cannot slip in meanwhile.
    let admitted = lock(&shared.admission).admit(rank, &claim, &shared.secret, ex);
    let rank = match admitted {
        Ok(r) => r,
        Err(reason) => return Err(refuse(&conn, send, reason).await.into()),
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
