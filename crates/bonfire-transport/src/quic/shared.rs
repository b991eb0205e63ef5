//! What every task of one rank shares: [`Shared`], the rank's identity in the job, its mailbox
//! and settings, and the tables the rendezvous and the accept loop fill in while the job comes
//! up; with the small helpers (locking, logging, waiting for ranks) the other files use.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bonfire_topology::Rank;
use quinn::{Connection, SendStream};
use rustls::pki_types::CertificateDer;
use tokio::sync::{Notify, watch};

use super::admission::Admission;
use super::auth::Secret;
use super::config::QuicConfig;
use super::control::{JobKey, PeerEntry};
use crate::Mailbox;

/// The state one rank's transport, accept loop and link tasks share.
pub(crate) struct Shared {
    pub(crate) me: Rank,
    pub(crate) world: usize,
    pub(crate) job: JobKey,
    pub(crate) secret: Secret,
    pub(crate) identity_cert: CertificateDer<'static>,
    pub(crate) mailbox: Arc<Mailbox>,
    pub(crate) max_frame: u64,
    pub(crate) streams: usize,
    pub(crate) peer_timeout: Duration,
    /// How long the job may take to form.
    pub(crate) connect_timeout: Duration,
    pub(crate) closing: AtomicBool,
    /// Rank 0: the workers that have joined, with what they announced.
    pub(crate) joined: Mutex<Vec<Option<Joined>>>,
    /// Rank 0: which worker ranks are taken, and whether the rendezvous has closed.
    pub(crate) admission: Mutex<Admission>,
    /// Workers: the roster, once rank 0 sent it.
    pub(crate) roster: watch::Sender<Option<Arc<Vec<PeerEntry>>>>,
    /// Links accepted from higher ranks.
    pub(crate) accepted: Mutex<Vec<Option<Connection>>>,
    /// Signalled whenever a worker joins (rank 0) or a higher rank links (workers).
    pub(crate) changed: Notify,
    /// Tests: milliseconds the acceptor waits before taking each stream and each reader waits
    /// before filing a frame, to stand for a busy rank.
    #[cfg(test)]
    pub(crate) slow_filing_ms: std::sync::atomic::AtomicU64,
}

/// A worker that rank 0 has welcomed: its connection, the control stream the roster goes out
/// on, and what it announced.
pub(crate) struct Joined {
    pub(crate) conn: Connection,
    pub(crate) send: SendStream,
    pub(crate) entry: PeerEntry,
}

impl Shared {
    /// The state of rank `me`, before anyone has joined or linked.
    pub(crate) fn new(
        me: Rank,
        config: &QuicConfig,
        identity_cert: CertificateDer<'static>,
    ) -> Shared {
        let world = config.world_size;
        let (roster, _) = watch::channel(None);
        let job = JobKey {
            world_size: world as u32,
            round: config.round,
        };
        Shared {
            me,
            world,
            job,
            secret: config.secret.clone(),
            identity_cert,
            mailbox: Arc::new(Mailbox::new()),
            max_frame: config.max_frame,
            streams: config.streams,
            peer_timeout: config.peer_timeout,
            connect_timeout: config.connect_timeout,
            closing: AtomicBool::new(false),
            joined: Mutex::new((0..world).map(|_| None).collect()),
            admission: Mutex::new(Admission::new(job)),
            roster,
            accepted: Mutex::new((0..world).map(|_| None).collect()),
            changed: Notify::new(),
            #[cfg(test)]
            slow_filing_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Waits until `missing()` is empty, re-checking whenever a rank joins or links; on timeout,
    /// the ranks still missing.
    pub(crate) async fn wait_for_ranks(
        &self,
        deadline: Instant,
        missing: impl Fn() -> Vec<usize>,
    ) -> Result<(), Vec<usize>> {
        loop {
            // Registered before looking, so a change between the look and the wait is not lost.
            let notified = self.changed.notified();
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
}

pub(crate) use crate::lock;

/// A warning, for what happens off any caller's path (refused strangers, closed links).
pub(crate) fn log(me: Rank, msg: impl std::fmt::Display) {
    tracing::warn!("{me}: {msg}");
}
