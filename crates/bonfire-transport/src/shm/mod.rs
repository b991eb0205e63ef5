//! The shared-memory lane between ranks of one host.
//!
//! Ranks that the job's node layout places on one node (and that really share a host: the same
//! boot, each other's processes visible) move frames through rings in memory-mapped segments
//! instead of QUIC: no encryption, no packets, one copy in by the sender's writer thread and one
//! copy out by the receiver's reader thread. QUIC still links every pair; over it the ranks of a
//! node agree on their segments, and it carries everything between nodes.
//!
//! # Setting up, and who may map what
//! For every ordered pair `(p -> r)` on one node, the receiver `r` creates the ring: a file in
//! the shared-memory directory (`/dev/shm`), created exclusively, owner-only (0600), with memory
//! reserved up front and a name of 128 random bits (`bonfire-<job tag>-<random>`). It offers the
//! name, size, a random nonce, its pid and its boot id to `p` over their authenticated QUIC link,
//! so only a process that proved the job secret ever learns a name. `p` maps the file only if it
//! is a private file of this user of the announced size whose control block carries the nonce,
//! and answers; `r` unlinks the file as soon as the answer arrives, mapped or not. A rank killed
//! between creating and unlinking leaves a file the launcher removes (it knows the job tag); the
//! name also carries the creator's pid (`bonfire-<tag>-p<pid>-<random>`), so that ranks started
//! without a launcher, which share the tag `job`, remove such files at their next setup on the
//! host ([`remove_orphans`]).
//!
//! # Failure
//! Waits on a ring spin briefly, then sleep on a futex in 20 ms ticks, checking between ticks
//! that the peer's process is alive (through a pidfd): a rank killed mid-write is reported to
//! the mailbox within a tick, with its pid. A clean shutdown writes a goodbye and waits until the
//! peer has filed every frame before the QUIC links close.

mod link;
mod ring;
mod segment;
mod sys;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bonfire_topology::{NodeLayout, Rank};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use link::start_reader;
pub(crate) use link::{InLink, OutLink};
use ring::Ring;
use segment::Segment;
use sys::Process;

use crate::{Tag, Transport};

/// Environment variables of the shared-memory lane.
pub mod vars {
    /// `auto` (shared memory between ranks of one host where it works, QUIC elsewhere), `quic`
    /// (QUIC between every pair) or `shm` (shared memory between ranks of one host, or fail).
    pub const TRANSPORT: &str = "BONFIRE_TRANSPORT";
    /// The directory segments are made in (default `/dev/shm`).
    pub const SHM_DIR: &str = "BONFIRE_SHM_DIR";
    /// The job's tag in segment names; `bonfire launch` sets it and removes what is left.
    pub const SHM_TAG: &str = "BONFIRE_SHM_TAG";
    /// The ring from one rank to another, in bytes with an optional binary unit (`512K`, `1M`;
    /// default 1M).
    pub const SHM_RING: &str = "BONFIRE_SHM_RING";
    /// `1` (default): large frames a collective expects go straight from the ring into its
    /// buffer; `0`: every frame is copied out into a frame of its own first.
    pub const SHM_IN_PLACE: &str = "BONFIRE_SHM_IN_PLACE";
}

/// Where frames between ranks of one host travel.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum TransportMode {
    /// Shared memory between ranks of one host where it can be set up, QUIC otherwise (said
    /// once).
    #[default]
    Auto,
    /// QUIC between every pair of ranks.
    Quic,
    /// Shared memory between ranks of one host; a pair that cannot have it fails the job.
    Shm,
}

impl std::str::FromStr for TransportMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" | "" => Ok(TransportMode::Auto),
            "quic" => Ok(TransportMode::Quic),
            "shm" => Ok(TransportMode::Shm),
            other => Err(format!(
                "{other:?} is not a transport: use auto, quic or shm"
            )),
        }
    }
}

/// Settings of the shared-memory lane.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Whether to use it.
    pub mode: TransportMode,
    /// Where segments are made.
    pub dir: PathBuf,
    /// The job's tag in segment names (letters and digits).
    pub tag: String,
    /// Bytes of the ring from one rank to another.
    pub ring_bytes: usize,
    /// How long setting up may take before it fails (mode `shm`) or falls back (mode `auto`).
    pub setup_timeout: Duration,
    /// Whether frames a collective expects go straight from the ring into its buffer
    /// ([`crate::Transport::expect`]).
    pub in_place: bool,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            mode: TransportMode::Auto,
            dir: PathBuf::from("/dev/shm"),
            tag: "job".into(),
            ring_bytes: 1 << 20,
            setup_timeout: Duration::from_secs(30),
            in_place: true,
        }
    }
}

/// A bad shared-memory setting in the environment.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{var}={value:?}: {why}")]
pub struct ShmConfigError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub why: String,
}

impl ShmConfig {
    /// The settings from `BONFIRE_TRANSPORT`, `BONFIRE_SHM_DIR`, `BONFIRE_SHM_TAG`,
    /// `BONFIRE_SHM_RING` and `BONFIRE_SHM_IN_PLACE`, with defaults for those unset.
    pub fn from_env() -> Result<ShmConfig, ShmConfigError> {
        let mut c = ShmConfig::default();
        let get = |var: &str| std::env::var(var).ok().filter(|v| !v.trim().is_empty());
        if let Some(v) = get(vars::TRANSPORT) {
            c.mode = v.parse().map_err(|why| ShmConfigError {
                var: vars::TRANSPORT,
                value: v.clone(),
                why,
            })?;
        }
        if let Some(v) = get(vars::SHM_DIR) {
            c.dir = PathBuf::from(v);
        }
        if let Some(v) = get(vars::SHM_TAG) {
            if !valid_tag(&v) {
                return Err(ShmConfigError {
                    var: vars::SHM_TAG,
                    value: v,
                    why: "use 1 to 32 letters and digits".into(),
                });
            }
            c.tag = v;
        }
        if let Some(v) = get(vars::SHM_RING) {
            match parse_size(&v) {
                Some(n) if (64 << 10..=1 << 30).contains(&n) => c.ring_bytes = n,
                _ => {
                    return Err(ShmConfigError {
                        var: vars::SHM_RING,
                        value: v,
                        why: "use a size from 64K to 1G (binary units: 512K, 4M)".into(),
                    });
                }
            }
        }
        if let Some(v) = get(vars::SHM_IN_PLACE) {
            c.in_place = match v.trim() {
                "1" => true,
                "0" => false,
                _ => {
                    return Err(ShmConfigError {
                        var: vars::SHM_IN_PLACE,
                        value: v,
                        why: "use 1 (large expected frames go straight into place) or 0".into(),
                    });
                }
            };
        }
        Ok(c)
    }
}

/// `512K`, `4M`, `1G` (binary units) or a plain number of bytes.
fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, shift) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 10),
        (i, 'm' | 'M') => (&s[..i], 20),
        (i, 'g' | 'G') => (&s[..i], 30),
        _ => (s, 0),
    };
    digits.trim().parse::<usize>().ok()?.checked_mul(1 << shift)
}

fn valid_tag(t: &str) -> bool {
    (1..=32).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// A fresh job tag for segment names, for a launcher.
pub fn new_tag() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The prefix of every segment of the job tagged `tag`.
fn prefix(tag: &str) -> String {
    format!("bonfire-{tag}-")
}

/// How old an orphan must be at least before [`remove_orphans`] takes it: a live rank unlinks each
/// segment it makes within its setup timeout (30 s by default).
pub const ORPHAN_AGE: Duration = Duration::from_secs(120);

/// Removes the segments in `dir` left by ranks of any job that were killed while setting up
/// their lanes: files of this user named as this module names them, whose creating process (the
/// pid in the name) no longer exists, and not modified for `older_than` (a live rank unlinks its
/// segments within its setup timeout; the age keeps a process of another pid namespace that
/// shares the directory safe). Every rank's setup runs it first: ranks started without `bonfire
/// launch` have no launcher to remove what a crash left. Returns how many it removed.
pub fn remove_orphans(dir: &Path, older_than: Duration) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(creator_of) else {
                return false;
            };
            let Ok(meta) = e.metadata() else {
                return false;
            };
            let old = meta
                .modified()
                .ok()
                .and_then(|m| m.elapsed().ok())
                .is_some_and(|age| age >= older_than);
            meta.is_file() && meta.uid() == uid && old && !alive(pid)
        })
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

/// The pid in a segment's name (`bonfire-<tag>-p<pid>-<32 hex digits>`); `None` for other names.
fn creator_of(name: &str) -> Option<i32> {
    let rest = name.strip_prefix("bonfire-")?;
    let (tag, rest) = rest.split_once("-p")?;
    let (pid, random) = rest.split_once('-')?;
    let hex = random.len() == 32 && random.bytes().all(|b| b.is_ascii_hexdigit());
    (valid_tag(tag) && hex)
        .then(|| pid.parse::<i32>().ok())
        .flatten()
        .filter(|&p| p > 0)
}

/// Whether process `pid` exists (as this process sees them).
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes every segment of the job tagged `tag` left in `dir` (by ranks killed while setting up);
/// returns how many there were. For launchers, after their ranks exited.
pub fn remove_segments(dir: &Path, tag: &str) -> usize {
    if !valid_tag(tag) {
        return 0;
    }
    let prefix = prefix(tag);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

/// The exchange the ranks of a node agree on their segments in. Collectives derive their
/// contexts from hashes, so a fixed one cannot collide with theirs in practice.
const SETUP_CONTEXT: u64 = 0x6266_7368_6d73_6574;
const STEP_OFFER: u32 = 0;
const STEP_ANSWER: u32 = 1;
const STEP_CONFIRM: u32 = 2;

#[derive(Serialize, Deserialize)]
enum Offer {
    Ring {
        name: String,
        len: u64,
        nonce: [u64; 2],
        pid: u32,
        boot: String,
    },
    Declined {
        reason: String,
    },
}

#[derive(Serialize, Deserialize)]
enum Answer {
    Mapped { pid: u32 },
    Refused { reason: String },
}

/// The offering rank's last word on its ring: it reads it, or it does not (and the mapping
/// rank sends over QUIC instead). No rank writes into a ring before it has this word, so no
/// frame goes into a ring nobody reads.
#[derive(Serialize, Deserialize)]
enum Confirm {
    Reading,
    NotReading { reason: String },
}

/// The shared-memory lanes of one rank, once set up.
pub(crate) struct Lanes {
    /// The lane to each rank, where there is one.
    pub(crate) out: Vec<Option<OutLink>>,
    /// The lanes from other ranks.
    pub(crate) inbound: Vec<Arc<InLink>>,
    /// Why some pairs of this node talk QUIC although they share it (auto mode), or `None`.
    pub(crate) fallback: Option<String>,
}

/// Why a rank could not set up its lanes.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ShmSetupError {
    /// `BONFIRE_TRANSPORT=shm` and a pair of this host could not share memory.
    #[error(
        "BONFIRE_TRANSPORT=shm, but {me} and {peer} cannot share memory: {reason} (use BONFIRE_TRANSPORT=auto to fall back to QUIC)"
    )]
    Unavailable {
        /// This rank.
        me: Rank,
        /// The peer.
        peer: Rank,
        /// Why.
        reason: String,
    },
    /// The exchange with a peer failed (it died, or the time ran out).
    #[error("setting up shared memory with {peer} failed: {reason}")]
    Exchange {
        /// The peer.
        peer: Rank,
        /// Why.
        reason: String,
    },
}

/// Sets up the lanes of this rank with every other rank of its node, talking over `quic`.
pub(crate) async fn setup<T: Transport>(
    quic: &T,
    nodes: &NodeLayout,
    config: &ShmConfig,
    max_frame: u64,
    stall: Duration,
    stop: &Arc<AtomicBool>,
) -> Result<Lanes, ShmSetupError> {
    let me = quic.rank();
    let world = quic.world_size();
    let mut lanes = Lanes {
        out: (0..world).map(|_| None).collect(),
        inbound: Vec::new(),
        fallback: None,
    };
    let peers: Vec<Rank> = (0..world)
        .map(Rank::from)
        .filter(|&p| p != me && nodes.node_of(p) == nodes.node_of(me))
        .collect();
    if peers.is_empty() {
        return Ok(lanes);
    }
    let inbox = quic
        .mailbox()
        .open(SETUP_CONTEXT, 0)
        .map_err(|e| ShmSetupError::Exchange {
            peer: me,
            reason: e.to_string(),
        })?;
    let tag = |step| Tag {
        context: SETUP_CONTEXT,
        seq: 0,
        step,
    };
    let send = |peer: Rank, step: u32, body: Vec<u8>| {
        let fut = quic.send(peer, tag(step), Bytes::from(body));
        async move {
            fut.await.map_err(|e| ShmSetupError::Exchange {
                peer,
                reason: e.to_string(),
            })
        }
    };
    let deadline = tokio::time::Instant::now() + config.setup_timeout;
    let receive = |peer: Rank, step: u32| {
        let inbox = &inbox;
        async move {
            loop {
                let changed = inbox.changed();
                if let Some(frame) = inbox.take(peer, step) {
                    return Ok(frame);
                }
                if let Some(reason) = inbox.lost(peer) {
                    return Err(ShmSetupError::Exchange {
                        peer,
                        reason: reason.to_string(),
                    });
                }
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    return Err(ShmSetupError::Exchange {
                        peer,
                        reason: format!("no answer within {:?}", config.setup_timeout),
                    });
                }
            }
        }
    };
    let boot = sys::boot_id();
    let pid = std::process::id();
    let orphans = remove_orphans(&config.dir, ORPHAN_AGE.max(config.setup_timeout * 2));
    if orphans > 0 {
        tracing::info!(
            "bonfire[{me}]: removed {orphans} shared-memory segment(s) from {} left by ranks \
             that died while setting up their lanes",
            config.dir.display()
        );
    }
    let mut fallback: Vec<String> = Vec::new();
    let mut refuse = |peer: Rank, reason: String| -> Result<(), ShmSetupError> {
        if config.mode == TransportMode::Shm {
            return Err(ShmSetupError::Unavailable { me, peer, reason });
        }
        fallback.push(format!("{me} and {peer}: {reason}"));
        Ok(())
    };

    // 1. Offer each peer a ring into this rank. Every segment made here is unlinked when setup
    // ends, whichever way it ends (an early return used to leave the files of the peers not yet
    // answered in the directory).
    let mut offered: Vec<(Rank, Option<Arc<Segment>>, [u64; 2])> = Vec::new();
    let mut made = Unlink(Vec::new());
    for &peer in &peers {
        let nonce: [u64; 2] = rand::random();
        let (offer, seg) = if config.mode == TransportMode::Quic {
            let reason = format!("{}=quic", vars::TRANSPORT);
            (Offer::Declined { reason }, None)
        } else {
            let name = format!(
                "{}p{pid}-{:032x}",
                prefix(&config.tag),
                rand::random::<u128>()
            );
            let len = Ring::segment_len(config.ring_bytes);
            match Segment::create(&config.dir.join(&name), len) {
                Ok(seg) => {
                    let seg = Arc::new(seg);
                    made.0.push(seg.clone());
                    let _ = Ring::init(seg.clone(), nonce);
                    let offer = Offer::Ring {
                        name,
                        len: len as u64,
                        nonce,
                        pid,
                        boot: boot.clone(),
                    };
                    (offer, Some(seg))
                }
                Err(e) => (
                    Offer::Declined {
                        reason: e.to_string(),
                    },
                    None,
                ),
            }
        };
        let body = postcard::to_allocvec(&offer).expect("offers serialise");
        send(peer, STEP_OFFER, body).await?;
        offered.push((peer, seg, nonce));
    }

    // 2. Map each peer's offer, and answer it. The writer is held back until the peer confirms
    // that it reads the ring (step 4).
    let mut mapped: Vec<Option<OutLink>> = (0..world).map(|_| None).collect();
    for &peer in &peers {
        let frame = receive(peer, STEP_OFFER).await?;
        let decided: Result<(Ring, Process), String> = match postcard::from_bytes::<Offer>(&frame) {
            Err(e) => Err(format!("its offer is malformed: {e}")),
            Ok(Offer::Declined { reason }) => Err(reason),
            Ok(_) if config.mode == TransportMode::Quic => Err(format!("{}=quic", vars::TRANSPORT)),
            Ok(Offer::Ring {
                name,
                len,
                nonce,
                pid,
                boot: theirs,
            }) => map_offer(config, &name, len, nonce, pid, &theirs, &boot),
        };
        let answer = match decided {
            Ok((ring, process)) => {
                let link = OutLink::start(
                    me,
                    peer,
                    ring,
                    process,
                    quic.mailbox().clone(),
                    stop.clone(),
                    stall,
                )
                .map_err(|e| ShmSetupError::Exchange {
                    peer,
                    reason: format!("starting a writer thread: {e}"),
                })?;
                mapped[peer.index()] = Some(link);
                Answer::Mapped { pid }
            }
            Err(reason) => {
                refuse(peer, reason.clone())?;
                Answer::Refused { reason }
            }
        };
        let body = postcard::to_allocvec(&answer).expect("answers serialise");
        send(peer, STEP_ANSWER, body).await?;
    }

    // 3. Read the answers; start a reader for each ring that was mapped, and tell its writer
    // whether it did.
    for (peer, seg, nonce) in offered {
        let frame = receive(peer, STEP_ANSWER).await;
        if let Some(seg) = &seg {
            seg.unlink();
        }
        let answer = match frame {
            Ok(frame) => postcard::from_bytes::<Answer>(&frame)
                .map_err(|e| format!("its answer is malformed: {e}")),
            Err(e) => {
                return Err(e);
            }
        };
        let reading: Result<(), String> = match (answer, seg) {
            (Ok(Answer::Mapped { pid }), Some(seg)) => match watch_answer(config, pid) {
                None => Err(format!("its process (pid {pid}) is not visible from here")),
                Some(process) => {
                    let ring = Ring::attach(seg, nonce)
                        .map_err(|reason| ShmSetupError::Exchange { peer, reason })?;
                    // The reader runs until its peer says goodbye or exits, or this rank stops.
                    let (inbound, _reader) = start_reader(
                        me,
                        peer,
                        ring,
                        process,
                        quic.mailbox().clone(),
                        stop.clone(),
                        max_frame,
                    )
                    .map_err(|e| ShmSetupError::Exchange {
                        peer,
                        reason: format!("starting a reader thread: {e}"),
                    })?;
                    lanes.inbound.push(inbound);
                    Ok(())
                }
            },
            (Ok(Answer::Mapped { .. }), None) => {
                return Err(ShmSetupError::Exchange {
                    peer,
                    reason: "it mapped a ring that was never offered".into(),
                });
            }
            (Ok(Answer::Refused { reason }), _) | (Err(reason), _) => Err(reason),
        };
        let confirm = match &reading {
            Ok(()) => Confirm::Reading,
            Err(reason) => Confirm::NotReading {
                reason: reason.clone(),
            },
        };
        let body = postcard::to_allocvec(&confirm).expect("confirmations serialise");
        send(peer, STEP_CONFIRM, body).await?;
        if let Err(reason) = reading {
            refuse(peer, reason)?;
        }
    }

    // 4. Write into a peer's ring only once it said it reads it; otherwise send over QUIC.
    for &peer in &peers {
        let frame = receive(peer, STEP_CONFIRM).await?;
        let link = mapped[peer.index()].take();
        let confirm = postcard::from_bytes::<Confirm>(&frame)
            .map_err(|e| format!("its confirmation is malformed: {e}"));
        match (confirm, link) {
            (Ok(Confirm::Reading), Some(link)) => lanes.out[peer.index()] = Some(link),
            (Ok(Confirm::Reading), None) => {
                return Err(ShmSetupError::Exchange {
                    peer,
                    reason: "it reads a ring this rank never mapped".into(),
                });
            }
            (Ok(Confirm::NotReading { reason }), link) | (Err(reason), link) => {
                if let Some(link) = link {
                    link.abandon();
                    refuse(
                        peer,
                        format!("it does not read the ring it offered: {reason}"),
                    )?;
                }
            }
        }
    }
    if !fallback.is_empty() && config.mode != TransportMode::Quic {
        lanes.fallback = Some(fallback.join("; "));
    }
    Ok(lanes)
}

/// Unlinks its segments when dropped (the files only: mappings stay valid).
struct Unlink(Vec<Arc<Segment>>);

impl Drop for Unlink {
    fn drop(&mut self) {
        for seg in &self.0 {
            seg.unlink();
        }
    }
}

/// The process of a peer that mapped this rank's ring, to watch while reading from it. In this
/// crate's tests, a tag ending in `hidden` makes every such process invisible, as a pid
/// namespace between the ranks would.
fn watch_answer(config: &ShmConfig, pid: u32) -> Option<Process> {
    if cfg!(test) && config.tag.ends_with("hidden") {
        return None;
    }
    Process::watch(pid)
}

/// Maps the ring a peer offered, if it really is on this host and the segment is what it said.
fn map_offer(
    config: &ShmConfig,
    name: &str,
    len: u64,
    nonce: [u64; 2],
    pid: u32,
    their_boot: &str,
    my_boot: &str,
) -> Result<(Ring, Process), String> {
    if their_boot != my_boot {
        return Err("it runs on another host (or boot)".into());
    }
    if !name.starts_with(&prefix(&config.tag))
        || name.contains('/')
        || len as usize != Ring::segment_len(config.ring_bytes)
    {
        return Err(format!(
            "its segment {name:?} of {len} bytes is not one this job makes (do both ranks have the same {} and {}?)",
            vars::SHM_TAG,
            vars::SHM_RING
        ));
    }
    let process = Process::watch(pid)
        .ok_or_else(|| format!("its process (pid {pid}) is not visible from here"))?;
    let seg = Segment::open(&config.dir.join(name), len as usize).map_err(|e| e.to_string())?;
    let ring = Ring::attach(Arc::new(seg), nonce)?;
    Ok((ring, process))
}
