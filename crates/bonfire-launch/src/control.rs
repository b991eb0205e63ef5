//! How the launchers of a job on several nodes act as one.
//!
//! Node 0's launcher (the *leader*) listens on TCP at the rendezvous address (the ranks'
//! rendezvous is QUIC, on UDP, at the same port). Every other node's launcher (a *member*) joins
//! it and both prove they hold the job secret: each side's HMAC covers a fresh nonce of the
//! other's, so a recorded handshake cannot be replayed, and every later line carries an HMAC over
//! its sequence number, so nothing can be injected or replayed into a session.
//!
//! The leader starts each round on every node at once (`Start`), hears of every failure (a
//! member's rank failed, a member's launcher was lost, one of its own ranks failed) and then
//! either stops every node and starts the next round once every node is back (a job restart), or
//! ends the job on every node, naming the failure. A member that loses the leader stops its ranks
//! and joins again, so a leader restarted by a supervisor picks the job up in a new round.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bonfire_transport::{Secret, printable};
use serde::{Deserialize, Serialize};

use crate::env::vars;
use crate::launcher::{
    Failure, LaunchConfig, LaunchError, Launched, LocalRanks, name_nodes, restarts_used,
};

/// Version of the launchers' protocol; a member of another version is refused. 2: a member's
/// proof covers what it says it is (node, nodes, ranks, last round), not only the nonces. 3:
/// proofs are keyed by a slow derivation of the secret (`bonfire_transport::KDF_ROUNDS`).
const PROTOCOL: u32 = 3;
const ROLE_MEMBER: &[u8] = b"bonfire launch member";
const ROLE_LEADER: &[u8] = b"bonfire launch leader";
/// The longest line either side accepts.
const MAX_LINE: usize = 4096;
/// Time a connection gets to prove itself: a deadline for the whole handshake, not for each
/// read (a peer trickling a byte at a time does not hold a slot longer).
const HANDSHAKE: Duration = Duration::from_secs(5);
/// Handshakes in progress at once from one address; beyond it, that address's connections are
/// closed at once (so one host cannot take every slot of [`MAX_HANDSHAKES`]).
const MAX_HANDSHAKES_PER_ADDRESS: usize = 4;
/// The highest round a member may say it ran: rounds count restarts from 0, so a larger one is
/// not a launcher's (and `u32::MAX` would overflow the next round's number).
const MAX_ROUND: u32 = 1 << 20;
/// How often each side says it is alive.
const HEARTBEAT: Duration = Duration::from_millis(500);
/// Silence after which the other side's launcher is declared lost.
const SILENCE: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; connections beyond are closed at once.
const MAX_HANDSHAKES: usize = 16;
/// Time the members get to stop their ranks and say so.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
const TICK: Duration = Duration::from_millis(20);

/// The job secret from `BONFIRE_SECRET` or `BONFIRE_SECRET_FILE`.
pub(crate) fn secret_from_env() -> Result<Secret, LaunchError> {
    if let Some(s) = std::env::var_os(vars::SECRET) {
        return Ok(Secret::new(s.as_encoded_bytes())?);
    }
    if let Some(p) = std::env::var_os(vars::SECRET_FILE) {
        return Ok(Secret::from_file(Path::new(&p))?);
    }
    Err(LaunchError::NeedsSecret)
}

/// What the launchers say to each other, one JSON object per line.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Msg {
    /// Leader, first line of a connection: its nonce, and its clock (milliseconds since the
    /// Unix epoch; `bonfire doctor --master` reads the offset from it).
    Challenge {
        protocol: u32,
        nonce: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unix_ms: Option<u64>,
    },
    /// Member: its nonce, its proof of the secret, and its part of the job.
    Join {
        protocol: u32,
        nonce: String,
        proof: String,
        node: usize,
        nnodes: usize,
        nproc: usize,
        /// The last round this member ran, if any (a leader that was restarted continues after
        /// it).
        last_round: Option<u32>,
    },
    /// Leader: its proof; the member is in.
    Welcome { proof: String },
    /// Leader: refused, and why; the connection closes.
    Refuse { why: String },
    /// Leader: start your ranks in round `round`.
    Start { round: u32 },
    /// Member: a rank of round `round` failed.
    Failed {
        round: u32,
        rank: usize,
        pid: u32,
        status: String,
    },
    /// Member: every rank of round `round` succeeded.
    Done { round: u32 },
    /// Leader: stop your ranks of round `round`; a restart follows.
    Stop { round: u32, why: String },
    /// Member: my ranks of round `round` are stopped.
    Stopped { round: u32 },
    /// Leader: the job is over.
    End {
        ok: bool,
        why: String,
        rank: Option<usize>,
    },
    /// Either side: still here.
    Ping,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes from lowercase hex, as [`hex`] writes them. Only that form: a seal or proof whose
/// digits were re-cased is not the line that was sent (the control-line campaign found uppercase
/// digits accepted).
fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// One line of at most [`MAX_LINE`] bytes, without its newline.
fn read_line(reader: &mut impl BufRead) -> Result<Vec<u8>, String> {
    let mut line = Vec::new();
    let n = reader
        .by_ref()
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut line)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                "it fell silent".to_string()
            }
            _ => format!("reading failed: {e}"),
        })?;
    if n == 0 {
        return Err("the connection was closed".into());
    }
    if line.last() != Some(&b'\n') {
        return Err(if line.len() > MAX_LINE {
            format!("it sent a line longer than {MAX_LINE} bytes")
        } else {
            "the connection was closed mid-line".into()
        });
    }
    line.pop();
    Ok(line)
}

/// One line of at most [`MAX_LINE`] bytes, without its newline, read before `deadline`: each
/// read waits only for what is left of it.
fn read_line_before(
    reader: &mut BufReader<TcpStream>,
    deadline: Instant,
) -> Result<Vec<u8>, String> {
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "it did not finish its handshake within {HANDSHAKE:?}"
            ));
        }
        let _ = reader.get_ref().set_read_timeout(Some(left));
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(e) => return Err(format!("reading failed: {e}")),
        };
        if buf.is_empty() {
            return Err(if line.is_empty() {
                "the connection was closed".into()
            } else {
                "the connection was closed mid-line".into()
            });
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if line.len() > MAX_LINE + usize::from(done) {
            return Err(format!("it sent a line longer than {MAX_LINE} bytes"));
        }
        if done {
            line.pop();
            return Ok(line);
        }
    }
}

/// What a member's proof covers: the nonces of the session and what the member says it is.
fn join_material(session: &[u8], j: &Joined) -> Vec<u8> {
    let claims = format!(
        "node={};nnodes={};nproc={};last_round={}",
        j.node,
        j.nnodes,
        j.nproc,
        j.last_round.map_or("none".to_string(), |r| r.to_string())
    );
    [session, b"|", claims.as_bytes()].concat()
}

fn write_plain(stream: &mut TcpStream, msg: &Msg) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).expect("messages serialize");
    line.push(b'\n');
    stream.write_all(&line)
}

fn parse(line: &[u8]) -> Result<Msg, String> {
    serde_json::from_slice(line).map_err(|e| format!("it sent a line that is not a message ({e})"))
}

/// The HMAC of one direction of a session: over the session's nonces, the line's sequence
/// number and the line.
struct Seal {
    secret: Secret,
    session: Vec<u8>,
    role: &'static [u8],
    seq: u64,
}

impl Seal {
    fn material(&self, json: &[u8]) -> Vec<u8> {
        let mut m = Vec::with_capacity(self.session.len() + 8 + json.len());
        m.extend_from_slice(&self.session);
        m.extend_from_slice(&self.seq.to_le_bytes());
        m.extend_from_slice(json);
        m
    }

    fn seal(&mut self, json: &[u8]) -> String {
        let mac = self.secret.proof(self.role, &self.material(json));
        self.seq += 1;
        hex(&mac)
    }

    fn open(&mut self, mac: &[u8], json: &[u8]) -> bool {
        let ok = self.secret.verify(self.role, &self.material(json), mac);
        self.seq += 1;
        ok
    }
}

/// The sending half of a session.
struct Writer {
    stream: TcpStream,
    seal: Seal,
}

impl Writer {
    fn send(&mut self, msg: &Msg) -> std::io::Result<()> {
        let json = serde_json::to_vec(msg).expect("messages serialize");
        let mut line = self.seal.seal(&json).into_bytes();
        line.push(b' ');
        line.extend_from_slice(&json);
        line.push(b'\n');
        self.stream.write_all(&line)
    }
}

/// The receiving half of a session.
struct Reader {
    reader: BufReader<TcpStream>,
    seal: Seal,
}

impl Reader {
    fn recv(&mut self) -> Result<Msg, String> {
        let line = read_line(&mut self.reader)?;
        open_line(&mut self.seal, &line)
    }
}

/// The message of one sealed line (`<64 hex digits of seal> <json>`), if its seal is the next
/// one `seal` expects.
fn open_line(seal: &mut Seal, line: &[u8]) -> Result<Msg, String> {
    let (mac, json) = line
        .split_at_checked(64)
        .filter(|(_, rest)| rest.first() == Some(&b' '))
        .map(|(m, rest)| (m, &rest[1..]))
        .ok_or("it sent a line without a seal")?;
    let mac = std::str::from_utf8(mac)
        .ok()
        .and_then(unhex)
        .ok_or("it sent a line with a malformed seal")?;
    if !seal.open(&mac, json) {
        return Err(
            "it sent a line whose seal does not match (altered, replayed or forged)".into(),
        );
    }
    parse(json)
}

/// A session's halves, and the flag that stops its heartbeat.
struct Session {
    writer: Arc<Mutex<Writer>>,
    reader: Reader,
    alive: Arc<AtomicBool>,
}

impl Session {
    /// The session on `stream`, read through `reader` (the handshake's: it may already hold
    /// the first lines that followed the handshake).
    fn new(
        stream: TcpStream,
        reader: BufReader<TcpStream>,
        secret: &Secret,
        session: Vec<u8>,
        leader: bool,
    ) -> Session {
        let (mine, theirs) = if leader {
            (ROLE_LEADER, ROLE_MEMBER)
        } else {
            (ROLE_MEMBER, ROLE_LEADER)
        };
        let seal = |role| Seal {
            secret: secret.clone(),
            session: session.clone(),
            role,
            seq: 0,
        };
        // The reader's socket is the same one: its timeout is the stream's.
        let _ = stream.set_read_timeout(Some(SILENCE));
        let _ = stream.set_write_timeout(Some(HANDSHAKE));
        Session {
            writer: Arc::new(Mutex::new(Writer {
                stream,
                seal: seal(mine),
            })),
            reader: Reader {
                reader,
                seal: seal(theirs),
            },
            alive: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Starts the session's heartbeat and its reader, which files what arrives under `link`.
    fn spawn(self, link: u64, events: Sender<Event>) -> Link {
        let Session {
            writer,
            mut reader,
            alive,
        } = self;
        {
            let writer = writer.clone();
            let alive = alive.clone();
            std::thread::spawn(move || {
                while alive.load(Ordering::Relaxed) {
                    std::thread::sleep(HEARTBEAT);
                    if lock(&writer).send(&Msg::Ping).is_err() {
                        break;
                    }
                }
            });
        }
        std::thread::spawn(move || {
            loop {
                match reader.recv() {
                    Ok(Msg::Ping) => {}
                    Ok(msg) => {
                        if events.send(Event::Msg { link, msg }).is_err() {
                            break;
                        }
                    }
                    Err(why) => {
                        let _ = events.send(Event::Lost { link, why });
                        break;
                    }
                }
            }
        });
        Link {
            id: link,
            writer,
            alive,
        }
    }
}

fn lock(writer: &Mutex<Writer>) -> std::sync::MutexGuard<'_, Writer> {
    writer.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running session, as its owner holds it.
struct Link {
    id: u64,
    writer: Arc<Mutex<Writer>>,
    alive: Arc<AtomicBool>,
}

impl Link {
    /// Sends `msg`; a failure shows up as the session's loss, so it is not reported here.
    fn send(&self, msg: &Msg) {
        let _ = lock(&self.writer).send(msg);
    }

    fn close(&self) {
        self.alive.store(false, Ordering::Relaxed);
        let _ = lock(&self.writer).stream.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.close();
    }
}

/// What reaches a launcher's loop.
enum Event {
    /// A member proved the secret (the leader's acceptor).
    Joined {
        join: Joined,
        session: Session,
        peer: SocketAddr,
    },
    /// A connection was refused before it proved the secret (the leader's acceptor).
    Refused { peer: SocketAddr, why: String },
    /// A message on session `link`.
    Msg { link: u64, msg: Msg },
    /// Session `link` ended.
    Lost { link: u64, why: String },
}

/// What a member said it is.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Joined {
    node: usize,
    nnodes: usize,
    nproc: usize,
    last_round: Option<u32>,
}

/// The leader's side of a handshake on an accepted connection.
fn admit(mut stream: TcpStream, secret: &Secret) -> Result<(Joined, Session), String> {
    let deadline = Instant::now() + HANDSHAKE;
    let _ = stream.set_read_timeout(Some(HANDSHAKE));
    let _ = stream.set_write_timeout(Some(HANDSHAKE));
    let _ = stream.set_nodelay(true);
    let nonce: [u8; 32] = rand::random();
    write_plain(
        &mut stream,
        &Msg::Challenge {
            protocol: PROTOCOL,
            nonce: hex(&nonce),
            unix_ms: Some(unix_ms()),
        },
    )
    .map_err(|e| format!("writing failed: {e}"))?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let msg = parse(&read_line_before(&mut reader, deadline)?)?;
    let Msg::Join {
        protocol,
        nonce: theirs,
        proof,
        node,
        nnodes,
        nproc,
        last_round,
    } = msg
    else {
        return Err(format!("it sent {msg:?} instead of joining"));
    };
    let mut refuse = |why: String| {
        let _ = write_plain(&mut stream, &Msg::Refuse { why: why.clone() });
        why
    };
    if protocol != PROTOCOL {
        return Err(refuse(format!(
            "its launcher speaks protocol {protocol}, this one {PROTOCOL} (run the same bonfire on every node)"
        )));
    }
    let theirs = unhex(&theirs)
        .filter(|n| n.len() == 32)
        .ok_or_else(|| refuse("its nonce is not 32 bytes of hex".into()))?;
    let session = [&nonce[..], &theirs[..]].concat();
    let joined = Joined {
        node,
        nnodes,
        nproc,
        last_round,
    };
    let proof = unhex(&proof).unwrap_or_default();
    if !secret.verify(ROLE_MEMBER, &join_material(&session, &joined), &proof) {
        return Err(refuse(
            "it does not hold this job's secret, or what it says of itself was changed on the \
             way (is it another job's launcher?)"
                .into(),
        ));
    }
    if last_round.is_some_and(|r| r > MAX_ROUND) {
        return Err(refuse(format!(
            "it says it ran round {}, past any round a launcher reaches ({MAX_ROUND})",
            last_round.unwrap_or_default()
        )));
    }
    write_plain(
        &mut stream,
        &Msg::Welcome {
            proof: hex(&secret.proof(ROLE_LEADER, &session)),
        },
    )
    .map_err(|e| format!("writing failed: {e}"))?;
    Ok((joined, Session::new(stream, reader, secret, session, true)))
}

/// A member's join message for the leader's nonce `theirs`: a fresh nonce, and the proof over
/// both nonces and what the member says it is. Returns the session (the two nonces) with it.
fn join_message(secret: &Secret, theirs: &[u8], me: &Joined) -> (Vec<u8>, Msg) {
    let mine: [u8; 32] = rand::random();
    let session = [theirs, &mine[..]].concat();
    let msg = Msg::Join {
        protocol: PROTOCOL,
        nonce: hex(&mine),
        proof: hex(&secret.proof(ROLE_MEMBER, &join_material(&session, me))),
        node: me.node,
        nnodes: me.nnodes,
        nproc: me.nproc,
        last_round: me.last_round,
    };
    (session, msg)
}

/// Why a member could not join.
enum JoinFailure {
    /// Nothing (or nothing finished a handshake) at the address yet: try again.
    NotYet(String),
    /// The leader refused, or is not of this job: give up.
    Refused(String),
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a launcher leader said when asked (its first line; nothing is proved).
#[derive(Clone, Debug, PartialEq)]
pub struct LeaderProbe {
    /// Its launcher protocol.
    pub protocol: u32,
    /// Whether this bonfire speaks it too.
    pub compatible: bool,
    /// The round trip of the connection and its first line.
    pub round_trip: Duration,
    /// Its clock minus this machine's, in seconds (to within half the round trip), when it
    /// sends its clock.
    pub clock_offset: Option<f64>,
}

/// Connects to the launcher leader at `addr`, reads its first line and hangs up: whether a
/// bonfire launcher listens there, and how far its clock is from this one.
pub fn probe_leader(addr: SocketAddr, timeout: Duration) -> Result<LeaderProbe, String> {
    let before = unix_ms();
    let started = std::time::Instant::now();
    let stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    let _ = stream.set_read_timeout(Some(timeout));
    let mut reader = BufReader::new(stream);
    let line = read_line(&mut reader).map_err(|e| format!("{addr} sent no first line: {e}"))?;
    let round_trip = started.elapsed();
    let msg = parse(&line).map_err(|e| format!("{addr} is not a bonfire launcher: {e}"))?;
    let Msg::Challenge {
        protocol, unix_ms, ..
    } = msg
    else {
        return Err(format!(
            "{addr} is not a bonfire launcher (it sent {msg:?})"
        ));
    };
    let middle = before as f64 + round_trip.as_secs_f64() * 500.0;
    Ok(LeaderProbe {
        protocol,
        compatible: protocol == PROTOCOL,
        round_trip,
        clock_offset: unix_ms.map(|t| (t as f64 - middle) / 1000.0),
    })
}

/// The member's side of a handshake.
fn join(addr: SocketAddr, secret: &Secret, me: Joined) -> Result<Session, JoinFailure> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
        .map_err(|e| JoinFailure::NotYet(e.to_string()))?;
    let deadline = Instant::now() + HANDSHAKE;
    let _ = stream.set_read_timeout(Some(HANDSHAKE));
    let _ = stream.set_write_timeout(Some(HANDSHAKE));
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(
        stream
            .try_clone()
            .map_err(|e| JoinFailure::NotYet(e.to_string()))?,
    );
    let not_yet = JoinFailure::NotYet;
    let challenge = parse(&read_line_before(&mut reader, deadline).map_err(not_yet)?)
        .map_err(JoinFailure::Refused)?;
    let Msg::Challenge {
        protocol, nonce, ..
    } = challenge
    else {
        return Err(JoinFailure::Refused(format!(
            "it is not a bonfire launcher (it sent {challenge:?})"
        )));
    };
    if protocol != PROTOCOL {
        return Err(JoinFailure::Refused(format!(
            "it speaks launcher protocol {protocol}, this one {PROTOCOL} (run the same bonfire on every node)"
        )));
    }
    let theirs = unhex(&nonce)
        .filter(|n| n.len() == 32)
        .ok_or_else(|| JoinFailure::Refused("its nonce is not 32 bytes of hex".into()))?;
    let (session, join_msg) = join_message(secret, &theirs, &me);
    write_plain(&mut stream, &join_msg).map_err(|e| JoinFailure::NotYet(e.to_string()))?;
    match parse(&read_line_before(&mut reader, deadline).map_err(not_yet)?)
        .map_err(JoinFailure::Refused)?
    {
        Msg::Welcome { proof } => {
            let proof = unhex(&proof).unwrap_or_default();
            if !secret.verify(ROLE_LEADER, &session, &proof) {
                return Err(JoinFailure::Refused(
                    "it does not hold this job's secret (is another job using this port?)".into(),
                ));
            }
            Ok(Session::new(stream, reader, secret, session, false))
        }
        // Unauthenticated (the leader cannot prove it holds a secret this node does not): said
        // as the peer said it, escaped.
        Msg::Refuse { why } => Err(JoinFailure::Refused(format!(
            "it refused this node: {}",
            printable(&why)
        ))),
        other => Err(JoinFailure::Refused(format!(
            "it sent {other:?} instead of welcoming this node"
        ))),
    }
}

/// Runs this node's part of a job on several nodes: as the leader on node 0, as a member
/// elsewhere.
pub(crate) fn run(
    c: &LaunchConfig,
    env: &[(OsString, OsString)],
    (host, port): (&str, u16),
    secret: Secret,
    grace: Duration,
    cleanup: &dyn Fn(),
) -> Result<Launched, LaunchError> {
    let master = format!("{host}:{port}");
    if c.node_rank == 0 {
        let listener = match TcpListener::bind((host, port)) {
            Ok(l) => Ok(l),
            // The master's name may not be an address of this host's interfaces (a NAT, a
            // load balancer): listen on all of them.
            Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                TcpListener::bind(("0.0.0.0", port))
            }
            Err(e) => Err(e),
        }
        .map_err(|source| LaunchError::Listen {
            addr: master.clone(),
            source,
        })?;
        Leader::new(c, env, grace, cleanup, listener, secret).run()
    } else {
        let addr = (host, port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| LaunchError::CannotJoin {
                master: master.clone(),
                why: "the host name does not resolve".into(),
            })?;
        Member {
            c,
            env,
            grace,
            cleanup,
            secret,
            addr,
            master,
        }
        .run()
    }
}

/// Accepts connections until `stop` is set, admitting them on their own threads (at most
/// [`MAX_HANDSHAKES`] at once, and [`MAX_HANDSHAKES_PER_ADDRESS`] from one address).
fn accept(listener: TcpListener, secret: Secret, events: Sender<Event>, stop: Arc<AtomicBool>) {
    let _ = listener.set_nonblocking(true);
    // Handshakes in progress, by the address they come from.
    let pending: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    while !stop.load(Ordering::Relaxed) {
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(TICK);
                continue;
            }
            Err(_) => {
                std::thread::sleep(TICK);
                continue;
            }
        };
        {
            let mut pending = pending.lock().unwrap_or_else(|e| e.into_inner());
            let total: usize = pending.values().sum();
            let from_peer = pending.get(&peer.ip()).copied().unwrap_or(0);
            let full = if total >= MAX_HANDSHAKES {
                Some(format!(
                    "{MAX_HANDSHAKES} handshakes were already in progress"
                ))
            } else if from_peer >= MAX_HANDSHAKES_PER_ADDRESS {
                Some(format!(
                    "{MAX_HANDSHAKES_PER_ADDRESS} handshakes from {} were already in progress",
                    peer.ip()
                ))
            } else {
                None
            };
            if let Some(why) = full {
                drop(pending);
                let _ = events.send(Event::Refused { peer, why });
                continue;
            }
            *pending.entry(peer.ip()).or_default() += 1;
        }
        let _ = stream.set_nonblocking(false);
        let (secret, events, pending) = (secret.clone(), events.clone(), pending.clone());
        std::thread::spawn(move || {
            let event = match admit(stream, &secret) {
                Ok((join, session)) => Event::Joined {
                    join,
                    session,
                    peer,
                },
                Err(why) => Event::Refused { peer, why },
            };
            {
                let mut pending = pending.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(n) = pending.get_mut(&peer.ip()) {
                    *n -= 1;
                    if *n == 0 {
                        pending.remove(&peer.ip());
                    }
                }
            }
            let _ = events.send(event);
        });
    }
}

/// A member as the leader holds it.
struct Node {
    link: Link,
    peer: SocketAddr,
    last_round: Option<u32>,
    done: bool,
    stopped: bool,
}

/// How a round ended, for the leader.
enum RoundEnd {
    /// Every rank of every node succeeded.
    Done,
    /// Something failed: what, in words; the failed rank if a rank failed; the error to end
    /// with when no restart is left.
    Failed {
        what: String,
        rank: Option<usize>,
        error: LaunchError,
    },
}

struct Leader<'a> {
    c: &'a LaunchConfig,
    env: &'a [(OsString, OsString)],
    grace: Duration,
    cleanup: &'a dyn Fn(),
    events: Receiver<Event>,
    sender: Sender<Event>,
    nodes: Vec<Option<Node>>,
    next_link: u64,
    refused: usize,
    stop_accepting: Arc<AtomicBool>,
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        self.stop_accepting.store(true, Ordering::Relaxed);
    }
}

impl<'a> Leader<'a> {
    fn new(
        c: &'a LaunchConfig,
        env: &'a [(OsString, OsString)],
        grace: Duration,
        cleanup: &'a dyn Fn(),
        listener: TcpListener,
        secret: Secret,
    ) -> Leader<'a> {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (stop, tx) = (stop.clone(), tx.clone());
            std::thread::spawn(move || accept(listener, secret, tx, stop));
        }
        Leader {
            c,
            env,
            grace,
            cleanup,
            events: rx,
            sender: tx,
            nodes: (0..c.nnodes).map(|_| None).collect(),
            next_link: 0,
            refused: 0,
            stop_accepting: stop,
        }
    }

    fn members(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().flatten()
    }

    fn broadcast(&self, msg: &Msg) {
        for n in self.members() {
            n.link.send(msg);
        }
    }

    /// The node whose current session is `link`.
    fn node_of(&self, link: u64) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.as_ref().is_some_and(|n| n.link.id == link))
    }

    /// Takes a member in, or refuses it (it is told why).
    fn welcome(&mut self, join: Joined, session: Session, peer: SocketAddr) {
        let c = self.c;
        let refusal = if join.node == 0 || join.node >= c.nnodes {
            Some(format!(
                "--node-rank {} is not a node of this job (1 to {} join node 0)",
                join.node,
                c.nnodes - 1
            ))
        } else if join.nnodes != c.nnodes {
            Some(format!(
                "it was started with --nnodes {}, node 0 with --nnodes {}",
                join.nnodes, c.nnodes
            ))
        } else if join.nproc != c.nproc_per_node {
            Some(format!(
                "it was started with --nproc-per-node {}, node 0 with {} (every node starts the same number of ranks)",
                join.nproc, c.nproc_per_node
            ))
        } else {
            self.nodes[join.node].as_ref().map(|n| {
                format!(
                    "node {} is already in the job (joined from {})",
                    join.node, n.peer
                )
            })
        };
        if let Some(why) = refusal {
            tracing::warn!("bonfire launch: refused the launcher at {peer}: {why}");
            let mut writer = lock(&session.writer);
            let _ = writer.send(&Msg::Refuse { why });
            let _ = writer.stream.shutdown(std::net::Shutdown::Both);
            return;
        }
        self.next_link += 1;
        let link = session.spawn(self.next_link, self.sender.clone());
        tracing::info!("bonfire launch: node {} joined from {peer}", join.node);
        self.nodes[join.node] = Some(Node {
            link,
            peer,
            last_round: join.last_round,
            done: false,
            stopped: true,
        });
    }

    /// Says (a few times, then every hundredth time) that a connection was refused.
    fn refused(&mut self, peer: SocketAddr, why: &str) {
        self.refused += 1;
        if self.refused <= 3 || self.refused.is_multiple_of(100) {
            tracing::warn!(
                "bonfire launch: refused a connection from {peer}: {} ({} refused so far)",
                printable(why),
                self.refused
            );
        }
    }

    /// Handles the events every phase handles alike; returns a message event for the phase.
    /// A lost member is dropped and returned as `Lost` with its node.
    fn next(&mut self, timeout: Duration) -> Option<Happened> {
        match self.events.recv_timeout(timeout) {
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => None,
            Ok(Event::Joined {
                join,
                session,
                peer,
            }) => {
                self.welcome(join, session, peer);
                None
            }
            Ok(Event::Refused { peer, why }) => {
                self.refused(peer, &why);
                None
            }
            Ok(Event::Msg { link, msg }) => {
                let node = self.node_of(link)?;
                Some(Happened::Said(node, msg))
            }
            Ok(Event::Lost { link, why }) => {
                let node = self.node_of(link)?;
                self.nodes[node] = None;
                Some(Happened::Lost(node, why))
            }
        }
    }

    /// Waits until every node has joined, or the join timeout passes.
    fn gather(&mut self) -> Result<(), LaunchError> {
        let started = Instant::now();
        loop {
            let missing: Vec<usize> = (1..self.c.nnodes)
                .filter(|&n| self.nodes[n].is_none())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= self.c.join_timeout {
                self.broadcast(&Msg::End {
                    ok: false,
                    why: format!("{} did not join in time", name_nodes(&missing)),
                    rank: None,
                });
                return Err(LaunchError::NodesMissing {
                    missing,
                    waited: self.c.join_timeout,
                });
            }
            if let Some(Happened::Lost(node, why)) = self.next(TICK) {
                tracing::warn!(
                    "bonfire launch: node {node}'s launcher left while the job gathered: {why}"
                );
            }
        }
    }

    /// Runs round `round` on every node until it succeeds or something fails.
    fn run_round(&mut self, round: u32, local: &mut LocalRanks) -> RoundEnd {
        let per = self.c.nproc_per_node;
        loop {
            let (failure, all) = local.poll();
            if let Some(Failure { rank, pid, status }) = failure {
                return RoundEnd::Failed {
                    what: format!("rank {rank} (pid {pid}, node 0) {status}"),
                    rank: Some(rank),
                    error: LaunchError::RankFailed {
                        rank,
                        pid,
                        status,
                        restarts: String::new(),
                    },
                };
            }
            if all && local.succeeded() && self.members().all(|n| n.done) {
                return RoundEnd::Done;
            }
            match self.next(TICK) {
                Some(Happened::Said(node, Msg::Done { round: r })) if r == round => {
                    if let Some(n) = &mut self.nodes[node] {
                        n.done = true;
                    }
                }
                Some(Happened::Said(
                    node,
                    Msg::Failed {
                        round: r,
                        rank,
                        pid,
                        status,
                    },
                )) if r == round => {
                    let status = if rank / per == node {
                        status
                    } else {
                        format!("{status} (node {node} says)")
                    };
                    return RoundEnd::Failed {
                        what: format!("rank {rank} (pid {pid}, node {node}) {status}"),
                        rank: Some(rank),
                        error: LaunchError::RankFailed {
                            rank,
                            pid,
                            status: format!("on node {node} {status}"),
                            restarts: String::new(),
                        },
                    };
                }
                Some(Happened::Lost(node, why)) => {
                    return RoundEnd::Failed {
                        what: format!("node {node}'s launcher was lost ({why})"),
                        rank: None,
                        error: LaunchError::NodeLost {
                            node,
                            why,
                            restarts: String::new(),
                        },
                    };
                }
                _ => {}
            }
        }
    }

    /// After `Stop`: waits until every member says its ranks are stopped; one that does not
    /// within [`STOP_TIMEOUT`] is dropped (it must join again).
    fn await_stopped(&mut self, round: u32) {
        let started = Instant::now();
        loop {
            let waiting: Vec<usize> = (1..self.c.nnodes)
                .filter(|&n| self.nodes[n].as_ref().is_some_and(|n| !n.stopped))
                .collect();
            if waiting.is_empty() {
                return;
            }
            if started.elapsed() >= STOP_TIMEOUT {
                for n in waiting {
                    tracing::warn!(
                        "bonfire launch: node {n} did not stop its ranks within {STOP_TIMEOUT:?}; it must join again"
                    );
                    self.nodes[n] = None;
                }
                return;
            }
            if let Some(Happened::Said(node, Msg::Stopped { round: r })) = self.next(TICK)
                && r == round
                && let Some(n) = &mut self.nodes[node]
            {
                n.stopped = true;
            }
        }
    }

    fn run(mut self) -> Result<Launched, LaunchError> {
        let c = self.c;
        let mut restarts = 0u32;
        let mut launched = Launched::default();
        let mut round: Option<u32> = None;
        loop {
            self.gather()?;
            // A leader that was itself restarted continues after the rounds its members ran.
            let after = self.members().filter_map(|n| n.last_round).max();
            let r = match (round, after) {
                (Some(r), Some(a)) => (r + 1).max(a + 1),
                (Some(r), None) => r + 1,
                (None, Some(a)) => a + 1,
                (None, None) => 0,
            };
            round = Some(r);
            for n in self.nodes.iter_mut().flatten() {
                n.done = false;
                n.stopped = false;
                n.last_round = Some(r);
            }
            self.broadcast(&Msg::Start { round: r });
            let mut local = LocalRanks::start(c, self.env, r)?;
            match self.run_round(r, &mut local) {
                RoundEnd::Done => {
                    self.broadcast(&Msg::End {
                        ok: true,
                        why: "every rank succeeded".into(),
                        rank: None,
                    });
                    local.stop(Duration::ZERO);
                    (self.cleanup)();
                    launched.lost.append(&mut local.lost);
                    return Ok(launched);
                }
                RoundEnd::Failed { what, .. } if restarts < c.max_restarts => {
                    restarts += 1;
                    tracing::info!(
                        "bonfire launch: {what}; restarting the job on every node (restart {restarts} of {}, round {}): its ranks resume from their newest checkpoint",
                        c.max_restarts,
                        r + 1
                    );
                    launched.restarts.push(what.clone());
                    self.broadcast(&Msg::Stop {
                        round: r,
                        why: what,
                    });
                    local.stop(Duration::ZERO);
                    (self.cleanup)();
                    launched.lost.append(&mut local.lost);
                    self.await_stopped(r);
                }
                RoundEnd::Failed { what, rank, error } => {
                    let restarts = restarts_used(restarts, c.max_restarts);
                    self.broadcast(&Msg::End {
                        ok: false,
                        why: format!("{what}{restarts}"),
                        rank,
                    });
                    local.stop(self.grace);
                    (self.cleanup)();
                    return Err(match error {
                        LaunchError::RankFailed {
                            rank, pid, status, ..
                        } => LaunchError::RankFailed {
                            rank,
                            pid,
                            status,
                            restarts,
                        },
                        LaunchError::NodeLost { node, why, .. } => LaunchError::NodeLost {
                            node,
                            why,
                            restarts,
                        },
                        other => other,
                    });
                }
            }
        }
    }
}

/// What a leader's phase hears.
enum Happened {
    /// Node `.0` said `.1`.
    Said(usize, Msg),
    /// Node `.0`'s launcher was lost, for the reason `.1`.
    Lost(usize, String),
}

/// A node other than node 0.
struct Member<'a> {
    c: &'a LaunchConfig,
    env: &'a [(OsString, OsString)],
    grace: Duration,
    cleanup: &'a dyn Fn(),
    secret: Secret,
    addr: SocketAddr,
    master: String,
}

impl Member<'_> {
    /// Joins node 0's launcher, retrying until the join timeout.
    fn connect(&self, last_round: Option<u32>) -> Result<Session, LaunchError> {
        let started = Instant::now();
        let me = Joined {
            node: self.c.node_rank,
            nnodes: self.c.nnodes,
            nproc: self.c.nproc_per_node,
            last_round,
        };
        let mut said = false;
        loop {
            match join(self.addr, &self.secret, me) {
                Ok(session) => return Ok(session),
                // Nothing before the leader's proof is authenticated: a stranger at the master
                // address (or on the way) can refuse as well as the leader, so a refusal does not
                // end the attempts; the last one is the error when the join timeout passes.
                Err(JoinFailure::Refused(why)) if started.elapsed() >= self.c.join_timeout => {
                    return Err(LaunchError::CannotJoin {
                        master: self.master.clone(),
                        why,
                    });
                }
                Err(JoinFailure::Refused(why)) => {
                    if !said {
                        said = true;
                        tracing::warn!(
                            "bonfire launch: {} did not let this node join: {why}; trying again \
                             until the join timeout ({:.0?}), as the refusal is not authenticated",
                            self.master,
                            self.c.join_timeout
                        );
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(JoinFailure::NotYet(why)) if started.elapsed() >= self.c.join_timeout => {
                    return Err(LaunchError::CannotJoin {
                        master: self.master.clone(),
                        why: format!(
                            "no launcher answered within {:.0?} (--join-timeout; last: {why})",
                            self.c.join_timeout
                        ),
                    });
                }
                Err(JoinFailure::NotYet(_)) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    fn run(self) -> Result<Launched, LaunchError> {
        let mut launched = Launched::default();
        let mut last_round: Option<u32> = None;
        let mut local: Option<LocalRanks> = None;
        // Stops this node's ranks, keeping how its expendable ranks that failed ended.
        let stop = |local: &mut Option<LocalRanks>, grace: Duration, lost: &mut Vec<String>| {
            if let Some(mut l) = local.take() {
                l.stop(grace);
                (self.cleanup)();
                lost.append(&mut l.lost);
            }
        };
        loop {
            let session = match self.connect(last_round) {
                Ok(s) => s,
                Err(e) => {
                    stop(&mut local, Duration::ZERO, &mut launched.lost);
                    return Err(e);
                }
            };
            let (tx, rx) = mpsc::channel();
            let link = session.spawn(1, tx);
            let mut round = last_round.unwrap_or(0);
            let mut said_done = false;
            let why = loop {
                if let Some(l) = &mut local {
                    let (failure, all) = l.poll();
                    if let Some(Failure { rank, pid, status }) = failure {
                        link.send(&Msg::Failed {
                            round,
                            rank,
                            pid,
                            status,
                        });
                    }
                    if all && l.succeeded() && !said_done {
                        link.send(&Msg::Done { round });
                        said_done = true;
                    }
                }
                match rx.recv_timeout(TICK) {
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break "its session ended".to_string(),
                    Ok(Event::Msg { msg, .. }) => match msg {
                        Msg::Start { round: r } => {
                            stop(&mut local, Duration::ZERO, &mut launched.lost);
                            round = r;
                            last_round = Some(r);
                            said_done = false;
                            local = Some(LocalRanks::start(self.c, self.env, r)?);
                        }
                        Msg::Stop { round: r, why } => {
                            tracing::info!(
                                "bonfire launch: node 0 restarts the job after round {r}: {why}"
                            );
                            stop(&mut local, Duration::ZERO, &mut launched.lost);
                            link.send(&Msg::Stopped { round: r });
                            launched.restarts.push(why);
                        }
                        Msg::End { ok, why, rank } => {
                            stop(
                                &mut local,
                                if ok { Duration::ZERO } else { self.grace },
                                &mut launched.lost,
                            );
                            return if ok {
                                Ok(launched)
                            } else {
                                Err(LaunchError::JobEnded { rank, why })
                            };
                        }
                        Msg::Refuse { why } => {
                            stop(&mut local, Duration::ZERO, &mut launched.lost);
                            return Err(LaunchError::CannotJoin {
                                master: self.master.clone(),
                                why,
                            });
                        }
                        _ => {}
                    },
                    Ok(Event::Lost { why, .. }) => break why,
                    Ok(_) => {}
                }
            };
            drop(link);
            tracing::warn!(
                "bonfire launch: lost node 0's launcher at {} ({why}); stopping this node's ranks and joining again",
                self.master
            );
            stop(&mut local, Duration::ZERO, &mut launched.lost);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launcher::{free_local_port, launch};

    const SECRET: &str = "control-test-secret-0123456789abcdef";

    /// A job of `nnodes` nodes of one `sh -c script` rank each, on a fresh port, with the
    /// secret in a file; the ranks run in `dir`.
    fn nodes(nnodes: usize, script: &str, dir: &Path) -> Vec<LaunchConfig> {
        std::fs::create_dir_all(dir).unwrap();
        let secret = dir.join("secret");
        std::fs::write(&secret, SECRET).unwrap();
        let port = free_local_port().unwrap();
        (0..nnodes)
            .map(|node| {
                let mut c = LaunchConfig::local(1, "sh");
                c.args = vec!["-c".into(), script.into()];
                c.nnodes = nnodes;
                c.node_rank = node;
                c.master = Some(format!("127.0.0.1:{port}"));
                c.secret_file = Some(secret.clone());
                c.peer_timeout = Some(Duration::from_millis(200));
                c.join_timeout = Duration::from_secs(20);
                c.extra_env.push(("OUT".into(), dir.as_os_str().into()));
                c
            })
            .collect()
    }

    fn run_all(configs: Vec<LaunchConfig>) -> Vec<Result<Launched, LaunchError>> {
        let threads: Vec<_> = configs
            .into_iter()
            .map(|c| std::thread::spawn(move || launch(&c)))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("bonfire-control-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_failure_on_one_node_restarts_every_node() {
        let dir = scratch("restart");
        // Node 1's rank fails in round 0 while node 0's would sleep for a minute; in round 1
        // both write down their round and succeed.
        let script = "if [ $BONFIRE_RESTART_ROUND = 0 ]; then if [ $RANK = 1 ]; then exit 7; fi; sleep 60; fi; echo $BONFIRE_RESTART_ROUND > $OUT/rank-$RANK";
        let mut configs = nodes(2, script, &dir);
        for c in &mut configs {
            c.max_restarts = 2;
        }
        let started = Instant::now();
        for r in run_all(configs) {
            let launched = r.unwrap();
            assert_eq!(launched.restarts.len(), 1, "{launched:?}");
            assert!(launched.restarts[0].contains("rank 1 (pid"), "{launched:?}");
        }
        assert!(started.elapsed() < Duration::from_secs(30));
        for rank in 0..2 {
            let round = std::fs::read_to_string(dir.join(format!("rank-{rank}"))).unwrap();
            assert_eq!(round.trim(), "1", "rank {rank}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn with_no_restart_left_every_node_ends_naming_the_rank() {
        let dir = scratch("end");
        let script = "if [ $RANK = 1 ]; then exit 7; fi; sleep 60";
        let mut configs = nodes(2, script, &dir);
        for c in &mut configs {
            c.max_restarts = 1;
        }
        let started = Instant::now();
        let results = run_all(configs);
        assert!(started.elapsed() < Duration::from_secs(40));
        let leader = results[0].as_ref().unwrap_err();
        assert_eq!(leader.failed_rank(), Some(1), "{leader}");
        let text = leader.to_string();
        assert!(
            text.contains("on node 1 exited with status 7")
                && text.contains("after 1 of 1 restarts"),
            "{text}"
        );
        let member = results[1].as_ref().unwrap_err();
        assert_eq!(member.failed_rank(), Some(1), "{member}");
        assert!(
            member.to_string().contains("exited with status 7"),
            "{member}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_node_that_never_joins_is_named() {
        let dir = scratch("missing");
        let mut configs = nodes(3, "true", &dir);
        configs[0].join_timeout = Duration::from_millis(800);
        configs.truncate(2);
        configs[1].join_timeout = Duration::from_millis(800);
        let results = run_all(configs);
        let e = results[0].as_ref().unwrap_err();
        assert!(
            matches!(e, LaunchError::NodesMissing { missing, .. } if missing == &[2]),
            "{e}"
        );
        assert!(e.to_string().contains("node 2 did not join"), "{e}");
        let e = results[1].as_ref().unwrap_err();
        assert!(e.to_string().contains("node 2 did not join"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_probe_reads_the_leaders_protocol_and_clock() {
        let dir = scratch("probe");
        let mut configs = nodes(2, "true", &dir);
        configs.truncate(1);
        configs[0].join_timeout = Duration::from_secs(4);
        let addr: SocketAddr = configs[0].master.clone().unwrap().parse().unwrap();
        let leader = std::thread::spawn({
            let c = configs.remove(0);
            move || launch(&c)
        });
        let deadline = Instant::now() + Duration::from_secs(3);
        let probe = loop {
            match probe_leader(addr, Duration::from_secs(1)) {
                Ok(p) => break p,
                Err(e) if Instant::now() > deadline => panic!("{e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        assert!(probe.compatible, "{probe:?}");
        let offset = probe.clock_offset.expect("the leader sends its clock");
        assert!(
            offset.abs() < 1.0,
            "{offset} s between two clocks of one machine"
        );
        // Nothing listens on a port just freed.
        let free = free_local_port().unwrap();
        let nobody: SocketAddr = format!("127.0.0.1:{free}").parse().unwrap();
        let e = probe_leader(nobody, Duration::from_millis(500)).unwrap_err();
        assert!(e.starts_with(&format!("cannot connect to {nobody}")), "{e}");
        let e = leader.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("node 1 did not join"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Talks to the leader at `addr` by hand.
    fn raw(addr: &str) -> (TcpStream, BufReader<TcpStream>) {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let r = BufReader::new(s.try_clone().unwrap());
        (s, r)
    }

    #[test]
    fn strangers_on_the_port_get_nothing_and_the_job_runs_on() {
        let dir = scratch("strangers");
        // The ranks run long enough for the attacks below to land while the job is up.
        let configs = nodes(2, "sleep 3; echo ok > $OUT/rank-$RANK", &dir);
        let addr = configs[0].master.clone().unwrap();
        let job = std::thread::spawn(move || run_all(configs));
        std::thread::sleep(Duration::from_millis(500));

        // A member's genuine handshake, recorded: its join line answers one challenge only.
        let secret = Secret::new(SECRET.as_bytes()).unwrap();
        let (s, mut r) = raw(&addr);
        let Msg::Challenge { nonce, .. } = parse(&read_line(&mut r).unwrap()).unwrap() else {
            panic!("no challenge")
        };
        let mine = [7u8; 32];
        let session = [unhex(&nonce).unwrap(), mine.to_vec()].concat();
        let me = Joined {
            node: 1,
            nnodes: 2,
            nproc: 1,
            last_round: None,
        };
        let genuine = Msg::Join {
            protocol: PROTOCOL,
            nonce: hex(&mine),
            proof: hex(&secret.proof(ROLE_MEMBER, &join_material(&session, &me))),
            node: 1,
            nnodes: 2,
            nproc: 1,
            last_round: None,
        };
        drop((s.shutdown(std::net::Shutdown::Both), r));

        let refused = |line: Vec<u8>| {
            let (mut s, mut r) = raw(&addr);
            let _ = read_line(&mut r);
            let _ = s.write_all(&line);
            // The leader answers with a refusal or closes; it never welcomes.
            let answer = read_line(&mut r).ok().map(|l| parse(&l));
            assert!(
                !matches!(answer, Some(Ok(Msg::Welcome { .. }))),
                "{answer:?} after {:?}",
                String::from_utf8_lossy(&line[..line.len().min(80)])
            );
        };
        // Garbage, a line too long, a replayed join (a fresh challenge each time), a wrong
        // secret.
        refused(b"GET / HTTP/1.1\r\n\r\n".to_vec());
        refused(vec![b'x'; 10_000]);
        let mut replay = serde_json::to_vec(&genuine).unwrap();
        replay.push(b'\n');
        refused(replay);
        let wrong = Secret::new(b"another-jobs-secret-0123456789abcdef").unwrap();
        let (mut s, mut r) = raw(&addr);
        let Msg::Challenge { nonce, .. } = parse(&read_line(&mut r).unwrap()).unwrap() else {
            panic!("no challenge")
        };
        let session = [unhex(&nonce).unwrap(), mine.to_vec()].concat();
        let forged = Msg::Join {
            protocol: PROTOCOL,
            nonce: hex(&mine),
            proof: hex(&wrong.proof(ROLE_MEMBER, &session)),
            node: 1,
            nnodes: 2,
            nproc: 1,
            last_round: None,
        };
        write_plain(&mut s, &forged).unwrap();
        let answer = parse(&read_line(&mut r).unwrap()).unwrap();
        assert!(
            matches!(&answer, Msg::Refuse { why } if why.contains("secret")),
            "{answer:?}"
        );
        // A flood of connections that say nothing.
        let flood: Vec<TcpStream> = (0..200)
            .filter_map(|_| TcpStream::connect(&addr).ok())
            .collect();
        // Datagrams of garbage at the ranks' rendezvous port.
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for i in 0..100u8 {
            let _ = udp.send_to(&[i; 1200], &addr);
        }
        let results = job.join().unwrap();
        drop(flood);
        for r in results {
            r.unwrap();
        }
        for rank in 0..2 {
            assert!(dir.join(format!("rank-{rank}")).exists());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A leader that sends its welcome and its first sealed line in one write: the member's
    /// session must still read that line (the handshake's buffer is handed on, not dropped).
    #[test]
    fn a_line_right_behind_the_welcome_is_not_lost() {
        let secret = Secret::new(SECRET.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let leader_secret = secret.clone();
        let leader = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let nonce = [3u8; 32];
            write_plain(
                &mut s,
                &Msg::Challenge {
                    protocol: PROTOCOL,
                    nonce: hex(&nonce),
                    unix_ms: None,
                },
            )
            .unwrap();
            let Msg::Join { nonce: theirs, .. } = parse(&read_line(&mut r).unwrap()).unwrap()
            else {
                panic!("no join")
            };
            let session = [nonce.to_vec(), unhex(&theirs).unwrap()].concat();
            let mut both = serde_json::to_vec(&Msg::Welcome {
                proof: hex(&leader_secret.proof(ROLE_LEADER, &session)),
            })
            .unwrap();
            both.push(b'\n');
            let mut seal = Seal {
                secret: leader_secret.clone(),
                session,
                role: ROLE_LEADER,
                seq: 0,
            };
            let json = serde_json::to_vec(&Msg::Start { round: 4 }).unwrap();
            both.extend_from_slice(seal.seal(&json).as_bytes());
            both.push(b' ');
            both.extend_from_slice(&json);
            both.push(b'\n');
            s.write_all(&both).unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        let me = Joined {
            node: 1,
            nnodes: 2,
            nproc: 1,
            last_round: None,
        };
        let Ok(mut session) = join(addr, &secret, me) else {
            panic!("the handshake failed")
        };
        assert_eq!(session.reader.recv(), Ok(Msg::Start { round: 4 }));
        leader.join().unwrap();
    }

    #[test]
    fn a_seal_refuses_altered_and_replayed_lines() {
        let secret = Secret::new(SECRET.as_bytes()).unwrap();
        let seal = |role| Seal {
            secret: secret.clone(),
            session: vec![1; 64],
            role,
            seq: 0,
        };
        let (mut tx, mut rx) = (seal(ROLE_LEADER), seal(ROLE_LEADER));
        let a = tx.seal(b"{\"kind\":\"ping\"}");
        assert!(rx.open(&unhex(&a).unwrap(), b"{\"kind\":\"ping\"}"));
        // The same line again (a replay) no longer matches: the sequence moved on.
        assert!(!rx.open(&unhex(&a).unwrap(), b"{\"kind\":\"ping\"}"));
        let b = tx.seal(b"{\"kind\":\"done\",\"round\":0}");
        let mut rx2 = seal(ROLE_LEADER);
        rx2.seq = 1;
        assert!(!rx2.open(&unhex(&b).unwrap(), b"{\"kind\":\"done\",\"round\":1}"));
        // The other direction's role does not verify.
        let mut member = seal(ROLE_MEMBER);
        member.seq = 1;
        assert!(!member.open(&unhex(&b).unwrap(), b"{\"kind\":\"done\",\"round\":0}"));
    }

    /// A stranger that trickles its join line a byte at a time (each byte well within the read
    /// timeout) loses its handshake slot when the handshake's 5 s are up, not when it stops; it
    /// held it for as long as it kept trickling.
    #[test]
    fn a_trickling_stranger_holds_a_handshake_for_its_deadline_only() {
        let secret = Secret::new(SECRET.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let leader = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let started = Instant::now();
            (admit(stream, &secret).err(), started.elapsed())
        });
        let (mut s, mut r) = raw(&addr.to_string());
        read_line(&mut r).unwrap();
        let trickle = std::thread::spawn(move || {
            // 9 s of one byte every 250 ms: the old per-read timeout never fired.
            for _ in 0..36 {
                if s.write_all(b"{").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        let (why, held) = leader.join().unwrap();
        trickle.join().unwrap();
        let why = why.expect("a trickle is not a join");
        assert!(
            why.contains("did not finish its handshake within 5s"),
            "{why}"
        );
        assert!(
            held < HANDSHAKE + Duration::from_millis(1500),
            "held for {held:?}"
        );
    }

    /// The member's proof covers what it says of itself: a relay that changes its node, or its
    /// last round, is refused; a genuine member saying it ran round `u32::MAX` (whose next round
    /// overflowed) is refused too.
    #[test]
    fn a_members_claims_are_proved_and_bounded() {
        let secret = Secret::new(SECRET.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let answer = |claimed: Joined, sent: Joined| {
            let leader_secret = secret.clone();
            let (s, mut r) = raw(&addr);
            let (stream, _) = listener.accept().unwrap();
            let leader = std::thread::spawn(move || admit(stream, &leader_secret).map(|(j, _)| j));
            let Msg::Challenge { nonce, .. } = parse(&read_line(&mut r).unwrap()).unwrap() else {
                panic!("no challenge")
            };
            let mine = [3u8; 32];
            let session = [unhex(&nonce).unwrap(), mine.to_vec()].concat();
            let mut s = s;
            write_plain(
                &mut s,
                &Msg::Join {
                    protocol: PROTOCOL,
                    nonce: hex(&mine),
                    proof: hex(&secret.proof(ROLE_MEMBER, &join_material(&session, &claimed))),
                    node: sent.node,
                    nnodes: sent.nnodes,
                    nproc: sent.nproc,
                    last_round: sent.last_round,
                },
            )
            .unwrap();
            leader.join().unwrap()
        };
        let me = Joined {
            node: 1,
            nnodes: 2,
            nproc: 1,
            last_round: Some(3),
        };
        let joined = answer(me, me).unwrap();
        assert_eq!((joined.node, joined.last_round), (1, Some(3)));
        for changed in [
            Joined { node: 0, ..me },
            Joined { nproc: 8, ..me },
            Joined {
                last_round: None,
                ..me
            },
        ] {
            let why = answer(me, changed).err().unwrap();
            assert!(why.contains("changed on the way"), "{why}");
        }
        let past = Joined {
            last_round: Some(u32::MAX),
            ..me
        };
        let why = answer(past, past).err().unwrap();
        assert!(why.contains("past any round a launcher reaches"), "{why}");
    }

    /// One address gets at most 4 handshakes in progress: its fifth connection is refused at
    /// once, leaving the other slots to other nodes.
    #[test]
    fn one_address_cannot_take_every_handshake_slot() {
        let secret = Secret::new(SECRET.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopper = stop.clone();
        let acceptor = std::thread::spawn(move || accept(listener, secret, tx, stopper));
        let silent: Vec<TcpStream> = (0..MAX_HANDSHAKES_PER_ADDRESS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let _fifth = TcpStream::connect(addr).unwrap();
        let event = rx.recv_timeout(Duration::from_secs(3)).unwrap();
        let Event::Refused { why, .. } = event else {
            panic!("the fifth connection was not refused")
        };
        assert_eq!(
            why,
            format!(
                "{MAX_HANDSHAKES_PER_ADDRESS} handshakes from 127.0.0.1 were already in progress"
            )
        );
        stop.store(true, Ordering::Relaxed);
        drop(silent);
        acceptor.join().unwrap();
    }

    /// A stranger at the master address that refuses every join (unauthenticated: it holds no
    /// secret) does not make a member give up at once: it tries until the join timeout, and
    /// the error quotes the refusal escaped (its newline cannot forge a line of the log).
    #[test]
    fn an_unauthenticated_refusal_does_not_end_a_members_attempts() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let stopper = stop.clone();
        let fake = std::thread::spawn(move || {
            let _ = listener.set_nonblocking(true);
            let mut answered = 0;
            while !stopper.load(Ordering::Relaxed) {
                let Ok((mut s, _)) = listener.accept() else {
                    std::thread::sleep(TICK);
                    continue;
                };
                let _ = s.set_nonblocking(false);
                let _ = write_plain(
                    &mut s,
                    &Msg::Challenge {
                        protocol: PROTOCOL,
                        nonce: hex(&[1u8; 32]),
                        unix_ms: None,
                    },
                );
                let mut r = BufReader::new(s.try_clone().unwrap());
                let _ = read_line(&mut r);
                let _ = write_plain(
                    &mut s,
                    &Msg::Refuse {
                        why: "go away\nbonfire launch: every rank succeeded".into(),
                    },
                );
                answered += 1;
            }
            answered
        });
        let dir = scratch("refused");
        let mut c = nodes(2, "true", &dir).remove(1);
        c.master = Some(format!("127.0.0.1:{port}"));
        c.join_timeout = Duration::from_secs(2);
        let started = Instant::now();
        let e = launch(&c).err().unwrap().to_string();
        let took = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        let answered = fake.join().unwrap();
        assert!(took >= Duration::from_secs(2), "gave up after {took:?}");
        assert!(answered >= 3, "{answered} attempts");
        assert!(
            e.contains(r"it refused this node: go away\nbonfire launch: every rank succeeded"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Damages `line` in 1 to 4 places: bit flips, bytes that matter to JSON, cuts, deletions,
    /// insertions, repeated slices, and numbers made extreme.
    fn mutate(line: &[u8], next: &mut impl FnMut() -> u64) -> Vec<u8> {
        const BYTES: &[u8] = b"\0\xff\"\\{}[]:,-.0123456789eE \t\nnulltrue";
        const NUMBERS: &[&str] = &[
            "-1",
            "0",
            "4294967295",
            "4294967296",
            "18446744073709551615",
            "18446744073709551616",
            "1e999",
            "1.5",
            "null",
            "\"7\"",
        ];
        let mut out = line.to_vec();
        for _ in 0..1 + next() % 4 {
            let len = out.len().max(1);
            let at = (next() as usize) % len;
            match next() % 8 {
                0 if !out.is_empty() => out[at] ^= 1 << (next() % 8),
                1 if !out.is_empty() => out[at] = BYTES[(next() as usize) % BYTES.len()],
                2 => out.truncate(at),
                3 if !out.is_empty() => {
                    let end = (at + 1 + (next() as usize) % 16).min(out.len());
                    out.drain(at..end);
                }
                4 => {
                    let junk: Vec<u8> = (0..1 + next() % 8).map(|_| next() as u8).collect();
                    out.splice(at.min(out.len())..at.min(out.len()), junk);
                }
                5 if !out.is_empty() => {
                    let end = (at + 1 + (next() as usize) % 32).min(out.len());
                    let slice = out[at..end].to_vec();
                    out.splice(at..at, slice);
                }
                _ => {
                    // The next number (a run of digits) from `at` on, replaced.
                    let start = out[at.min(out.len())..]
                        .iter()
                        .position(u8::is_ascii_digit)
                        .map(|i| at + i);
                    if let Some(start) = start {
                        let end = out[start..]
                            .iter()
                            .position(|b| !b.is_ascii_digit())
                            .map_or(out.len(), |i| start + i);
                        let n = NUMBERS[(next() as usize) % NUMBERS.len()];
                        out.splice(start..end, n.bytes());
                    }
                }
            }
        }
        out
    }

    /// Counts one campaign input in `counts` (accepted as sent, refused, failures): a failure is
    /// an input accepted although `as_sent` says it was changed, or a panic.
    fn tally<T: std::fmt::Debug, E>(
        counts: &mut (u64, u64, u64),
        failures: &mut Vec<String>,
        outcome: std::thread::Result<Result<T, E>>,
        as_sent: impl FnOnce(&T) -> bool,
        what: &str,
        line: &[u8],
    ) {
        let line = String::from_utf8_lossy(line);
        match outcome {
            Ok(Ok(got)) if as_sent(&got) => counts.0 += 1,
            Ok(Ok(got)) => {
                counts.2 += 1;
                failures.push(format!("{what} accepted {got:?} from {line:?}"));
            }
            Ok(Err(_)) => counts.1 += 1,
            Err(_) => {
                counts.2 += 1;
                failures.push(format!("{what} panicked on {line:?}"));
            }
        }
    }

    /// A mutation campaign over the control channel's lines, as a stranger or a damaged network
    /// would deliver them, through the code that reads them:
    /// - a member's join line, valid (the leader's nonce, a true proof) and then damaged, to a
    ///   leader's `admit` over a real socket;
    /// - a leader's challenge or welcome line, damaged, to a member's `join`;
    /// - a sealed line of each message of a session, damaged, to a session's reader.
    ///
    /// Every input must end in a refusal with a message, or in acceptance only where the line
    /// still says exactly what was sent (the same claims, the same message); never in a panic
    /// or a wait past the handshake. CI runs 300 inputs of each socket kind and 3,000 sealed
    /// lines; the campaign:
    /// `BONFIRE_FUZZ_SEED=1 BONFIRE_FUZZ_SECS=60 cargo test --release -p bonfire-launch --lib control_line_campaign -- --nocapture`
    #[test]
    fn control_line_campaign() {
        let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let seed = env("BONFIRE_FUZZ_SEED").unwrap_or(34);
        let budget = env("BONFIRE_FUZZ_SECS").map(Duration::from_secs);
        let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let secret = Secret::new(SECRET.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let me = Joined {
            node: 1,
            nnodes: 2,
            nproc: 3,
            last_round: Some(4),
        };
        let started = Instant::now();
        // With a budget, each of the three parts runs for a third of it.
        let more = |part: u32, done: u64, ci: u64| match budget {
            Some(b) => started.elapsed() < b * (part + 1) / 3,
            None => done < ci,
        };
        let first_line = |bytes: &[u8]| -> Vec<u8> {
            bytes
                .split(|&b| b == b'\n')
                .next()
                .unwrap_or_default()
                .to_vec()
        };
        // (accepted unchanged, refused, accepted changed or panicked)
        let mut admits = (0u64, 0u64, 0u64);
        let mut joins = (0u64, 0u64, 0u64);
        let mut sealed = (0u64, 0u64, 0u64);
        let mut failures: Vec<String> = Vec::new();

        // A leader's admit, fed damaged join lines.
        while more(0, admits.0 + admits.1 + admits.2, 300) {
            let mut client = TcpStream::connect(addr).unwrap();
            let (server, _) = listener.accept().unwrap();
            let leader_secret = secret.clone();
            let leader = std::thread::spawn(move || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    admit(server, &leader_secret).map(|(joined, _)| joined)
                }))
            });
            client
                .set_read_timeout(Some(HANDSHAKE + Duration::from_secs(1)))
                .unwrap();
            let mut reader = BufReader::new(client.try_clone().unwrap());
            let Ok(Msg::Challenge { nonce, .. }) = parse(&read_line(&mut reader).unwrap()) else {
                panic!("the leader did not challenge");
            };
            let (_, valid) = join_message(&secret, &unhex(&nonce).unwrap(), &me);
            let line = mutate(&serde_json::to_vec(&valid).unwrap(), &mut next);
            let _ = client.write_all(&[&line[..], b"\n"].concat());
            let _ = client.shutdown(std::net::Shutdown::Write);
            let unchanged = parse(&first_line(&line)).is_ok_and(|m| m == valid);
            tally(
                &mut admits,
                &mut failures,
                leader.join().unwrap(),
                |joined| unchanged && *joined == me,
                "admit",
                &line,
            );
        }

        // A member's join, fed a damaged challenge or a damaged welcome.
        while more(1, joins.0 + joins.1 + joins.2, 300) {
            let member_secret = secret.clone();
            let member = std::thread::spawn(move || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    join(addr, &member_secret, me).is_ok()
                }))
            });
            let (mut server, _) = listener.accept().unwrap();
            server
                .set_read_timeout(Some(HANDSHAKE + Duration::from_secs(1)))
                .unwrap();
            let mut reader = BufReader::new(server.try_clone().unwrap());
            let nonce: [u8; 32] = rand::random();
            let challenge = Msg::Challenge {
                protocol: PROTOCOL,
                nonce: hex(&nonce),
                unix_ms: Some(unix_ms()),
            };
            let damage_challenge = next() % 2 == 0;
            let mut line = serde_json::to_vec(&challenge).unwrap();
            if damage_challenge {
                line = mutate(&line, &mut next);
            }
            let _ = server.write_all(&[&line[..], b"\n"].concat());
            let unchanged = parse(&first_line(&line)).is_ok_and(|m| match (m, &challenge) {
                (
                    Msg::Challenge {
                        protocol, nonce, ..
                    },
                    Msg::Challenge {
                        protocol: p,
                        nonce: n,
                        ..
                    },
                ) => protocol == *p && nonce == *n,
                _ => false,
            });
            let mut welcome_line = Vec::new();
            if let Ok(Msg::Join { nonce: theirs, .. }) = read_line(&mut reader)
                .map_err(|_| ())
                .and_then(|l| parse(&l).map_err(|_| ()))
                && let Some(theirs) = unhex(&theirs)
            {
                let session = [&nonce[..], &theirs[..]].concat();
                let welcome = Msg::Welcome {
                    proof: hex(&secret.proof(ROLE_LEADER, &session)),
                };
                welcome_line = serde_json::to_vec(&welcome).unwrap();
                let damaged = if damage_challenge {
                    welcome_line.clone()
                } else {
                    mutate(&welcome_line, &mut next)
                };
                let same = parse(&first_line(&damaged)).is_ok_and(|m| m == welcome);
                welcome_line = if same { Vec::new() } else { damaged.clone() };
                let _ = server.write_all(&[&damaged[..], b"\n"].concat());
            }
            let _ = server.shutdown(std::net::Shutdown::Write);
            let accepted_changed = !welcome_line.is_empty() || !unchanged;
            let outcome = member
                .join()
                .unwrap()
                .map(|joined| if joined { Ok(()) } else { Err(()) });
            let shown = [&line[..], b" then ", &welcome_line[..]].concat();
            tally(
                &mut joins,
                &mut failures,
                outcome,
                |_| !accepted_changed,
                "join (a damaged challenge, then welcome)",
                &shown,
            );
        }

        // A session's reader, fed damaged sealed lines of every message.
        let messages = [
            Msg::Start { round: 7 },
            Msg::Failed {
                round: 7,
                rank: 3,
                pid: 4242,
                status: "exit status: 1".into(),
            },
            Msg::Done { round: 7 },
            Msg::Stop {
                round: 7,
                why: "rank 3 failed".into(),
            },
            Msg::Stopped { round: 7 },
            Msg::End {
                ok: false,
                why: "no restart left".into(),
                rank: Some(3),
            },
            Msg::Ping,
        ];
        let seal = || Seal {
            secret: secret.clone(),
            session: vec![7; 64],
            role: ROLE_LEADER,
            seq: 0,
        };
        let mut i = 0usize;
        while more(2, sealed.0 + sealed.1 + sealed.2, 3000) {
            let msg = &messages[i % messages.len()];
            i += 1;
            let json = serde_json::to_vec(msg).unwrap();
            let mut line = seal().seal(&json).into_bytes();
            line.push(b' ');
            line.extend_from_slice(&json);
            let damaged = mutate(&line, &mut next);
            let damaged = first_line(&damaged);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                open_line(&mut seal(), &damaged)
            }));
            tally(
                &mut sealed,
                &mut failures,
                outcome,
                |got| damaged == line && got == msg,
                "a session's reader",
                &damaged,
            );
        }
        eprintln!(
            "control_line_campaign seed {seed}, {:.1} s: admit {admits:?}, join {joins:?}, \
             sealed {sealed:?} (accepted unchanged, refused, failures)",
            started.elapsed().as_secs_f64()
        );
        assert!(
            failures.is_empty(),
            "{} failures: {failures:#?}",
            failures.len()
        );
        assert!(admits.1 > 0 && joins.1 > 0 && sealed.1 > 0);
    }
}
