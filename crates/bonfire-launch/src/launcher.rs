//! Starts the local ranks of a job, watches them, and tears the job down when one fails.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bonfire_transport::placement;
use bonfire_transport::shm::{self, vars as shm_vars};
use bonfire_transport::{Secret, SecretError};

use crate::env::vars;

/// How long the launchers of a job on several nodes wait for every node by default.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(300);

/// What `bonfire launch` was asked to do.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// Ranks to start on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// The rendezvous, `HOST:PORT`; a free local port when omitted on a single node.
    pub master: Option<String>,
    /// The job secret's file (required on several nodes unless `BONFIRE_SECRET` is set).
    pub secret_file: Option<PathBuf>,
    /// Collective timeout handed to the ranks.
    pub timeout: Option<Duration>,
    /// Peer timeout handed to the ranks.
    pub peer_timeout: Option<Duration>,
    /// How many times to restart the job after a failure: every node's ranks are stopped and
    /// started again in a new round (`BONFIRE_RESTART_ROUND`).
    pub max_restarts: u32,
    /// On several nodes: how long the launchers wait for every node to join (at the start and
    /// after each restart) before the job ends, naming the nodes missing.
    pub join_timeout: Duration,
    /// The program each rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra variables for every rank (tests, wrappers).
    pub extra_env: Vec<(OsString, OsString)>,
    /// Prefix each line of a rank's output with `[rank N]`.
    pub prefix_output: bool,
    /// Ranks whose failure does not stop the job (the workers of asynchronous parameter
    /// servers): the launcher says how each ended, and the job goes on without it. A job
    /// whose other ranks all succeed succeeds.
    pub expendable: Vec<usize>,
    /// Forgive an expendable rank only when a signal ended it (it died: killed, crashed), not
    /// when it exited with an error of its own, which still stops the job (the bundled jobs'
    /// parameter-server workers: a dead worker is dropped, a failing one is a failure).
    pub expendable_deaths_only: bool,
    /// How this node's ranks are placed on its CPUs.
    pub cpu_bind: CpuBind,
}

/// How `bonfire launch` places a node's ranks on the CPUs it may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuBind {
    /// Every rank may run on every CPU (torchrun's default).
    #[default]
    None,
    /// Each rank gets a block of its own of equal size, a core's hardware threads together
    /// (`BONFIRE_CPUS` names it), and in a job of several ranks a block of 3 CPUs or more keeps
    /// its highest-numbered CPU for the rank's communication threads
    /// ([`bonfire_transport::placement`]).
    Cores,
}

impl CpuBind {
    /// The variable `bonfire train` and `bonfire launch` take the placement from when no flag
    /// gives it.
    pub const VAR: &str = "BONFIRE_CPU_BIND";

    /// `none` or `cores`.
    pub fn parse(text: &str) -> Option<CpuBind> {
        match text {
            "none" => Some(CpuBind::None),
            "cores" => Some(CpuBind::Cores),
            _ => None,
        }
    }

    /// From [`CpuBind::VAR`]; [`CpuBind::None`] when it is unset or empty.
    pub fn from_env() -> Result<CpuBind, LaunchError> {
        match std::env::var(Self::VAR) {
            Ok(v) if !v.trim().is_empty() => {
                CpuBind::parse(v.trim()).ok_or(LaunchError::CpuBindVar(v))
            }
            _ => Ok(CpuBind::None),
        }
    }
}

impl LaunchConfig {
    /// One node, `nproc` ranks, defaults elsewhere.
    pub fn local(nproc: usize, program: impl Into<OsString>) -> LaunchConfig {
        LaunchConfig {
            nproc_per_node: nproc,
            nnodes: 1,
            node_rank: 0,
            master: None,
            secret_file: None,
            timeout: None,
            peer_timeout: None,
            max_restarts: 0,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            program: program.into(),
            args: Vec::new(),
            extra_env: Vec::new(),
            prefix_output: true,
            expendable: Vec::new(),
            expendable_deaths_only: false,
            cpu_bind: CpuBind::None,
        }
    }

    /// Each local rank's block of CPUs under `--cpu-bind cores` (none otherwise), refused as
    /// [`launch`] refuses it.
    pub fn cpu_blocks(&self) -> Result<Option<Vec<Vec<usize>>>, LaunchError> {
        if self.cpu_bind == CpuBind::None {
            return Ok(None);
        }
        let cpus = placement::thread_cpus().map_err(LaunchError::Cpus)?;
        if cpus.is_empty() {
            // Nothing to bind off Linux.
            return Ok(None);
        }
        let blocks = placement::blocks(&placement::physical_order(&cpus), self.nproc_per_node)
            .ok_or_else(|| LaunchError::TooFewCpus {
                ranks: self.nproc_per_node,
                cpus: placement::format_cpu_list(&cpus),
                count: cpus.len(),
            })?;
        // A list of communication CPUs names CPUs of the machine, and a bound rank may use its
        // block only. (A malformed list is the rank's `bonfire::init` to report.)
        let setting = self
            .extra_env
            .iter()
            .rev()
            .find(|(k, _)| k == placement::COMM_CPUS_VAR)
            .map(|(_, v)| v.to_string_lossy().into_owned())
            .or_else(|| std::env::var(placement::COMM_CPUS_VAR).ok());
        if let Some(setting) = setting
            && let Ok(list) = placement::parse_cpu_list(&setting)
        {
            for (local, block) in blocks.iter().enumerate() {
                if let Some(&cpu) = list.iter().find(|c| !block.contains(c)) {
                    return Err(LaunchError::CommCpusOutsideBlocks {
                        setting,
                        cpu,
                        rank: self.node_rank * self.nproc_per_node + local,
                        block: placement::format_cpu_list(block),
                    });
                }
            }
        }
        Ok(Some(blocks))
    }
}

/// How a launch that succeeded went.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Launched {
    /// The job's restarts, in order: why each happened.
    pub restarts: Vec<String>,
    /// Expendable ranks of this node that failed while the job went on: how each ended.
    pub lost: Vec<String>,
}

impl Launched {
    /// `"after 2 restarts (rank 1 (pid 7) was killed by signal 9 (SIGKILL); ...)"`, or `None`
    /// when the job ran once.
    pub fn summary(&self) -> Option<String> {
        let restarts = match self.restarts.len() {
            0 => None,
            n => Some(format!(
                "after {n} restart{} ({})",
                if n == 1 { "" } else { "s" },
                self.restarts.join("; ")
            )),
        };
        let lost = (!self.lost.is_empty()).then(|| {
            format!(
                "without the expendable rank{} that failed ({})",
                if self.lost.len() == 1 { "" } else { "s" },
                self.lost.join("; ")
            )
        });
        match (restarts, lost) {
            (Some(r), Some(l)) => Some(format!("{r}, {l}")),
            (r, l) => r.or(l),
        }
    }
}

/// How a launch ended badly.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `nproc_per_node` is zero; nothing was started.
    #[error("--nproc-per-node must be at least 1")]
    NoRanks,
    /// `nnodes` is zero; nothing was started.
    #[error("--nnodes must be at least 1")]
    NoNodes,
    /// `node_rank` is not a node of the job; nothing was started.
    #[error(
        "--node-rank {node_rank} is outside a job of {nnodes} nodes (0 to {})",
        nnodes - 1
    )]
    NodeRankOutOfRange {
        /// The node asked for.
        node_rank: usize,
        /// Nodes in the job.
        nnodes: usize,
    },
    /// The rendezvous address cannot be read; nothing was started.
    #[error(transparent)]
    MasterAddr(#[from] AddrError),
    /// A job on several nodes was given no rendezvous address; nothing was started.
    #[error("a job on several nodes needs --master-addr HOST:PORT (the host of node 0)")]
    NeedsMasterAddr,
    /// No free local port for a single-node rendezvous; nothing was started.
    #[error("cannot find a free local port: {0}")]
    NoFreePort(std::io::Error),
    /// The job secret's file cannot be used (the message names it); nothing was started.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// A job on several nodes was given no shared secret; nothing was started.
    #[error(
        "a job on several nodes needs --secret-file F (the same file on every node) or BONFIRE_SECRET"
    )]
    NeedsSecret,
    /// `--cpu-bind cores` with fewer CPUs than ranks on this node; nothing was started.
    #[error(
        "--cpu-bind cores gives each rank a CPU of its own, but this node starts {ranks} ranks and the launcher may run on {count} CPUs ({cpus}): start fewer ranks per node or bind nothing (--cpu-bind none, BONFIRE_CPU_BIND=none)"
    )]
    TooFewCpus {
        /// Ranks on this node.
        ranks: usize,
        /// The CPUs the launcher may run on.
        cpus: String,
        /// How many.
        count: usize,
    },
    /// `BONFIRE_COMM_CPUS` names a CPU outside a bound rank's block; nothing was started.
    #[error(
        "BONFIRE_COMM_CPUS={setting:?} names CPU {cpu}, outside rank {rank}'s block ({block}) under --cpu-bind cores: leave BONFIRE_COMM_CPUS unset (a block of 3 CPUs or more keeps its last one for communication) or bind nothing (--cpu-bind none, BONFIRE_CPU_BIND=none) to give every rank one list"
    )]
    CommCpusOutsideBlocks {
        /// The setting.
        setting: String,
        /// The first CPU outside a block.
        cpu: usize,
        /// The rank whose block it is outside.
        rank: usize,
        /// That block.
        block: String,
    },
    /// `BONFIRE_CPU_BIND` is neither `none` nor `cores`; nothing was started.
    #[error("BONFIRE_CPU_BIND={0:?}: expected none or cores")]
    CpuBindVar(String),
    /// The CPUs the launcher may run on cannot be read; nothing was started.
    #[error("--cpu-bind cores: cannot read the CPUs this launcher may run on: {0}")]
    Cpus(std::io::Error),
    /// A rank could not be started.
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A rank failed; the others were stopped.
    #[error("rank {rank} (pid {pid}) {status}{restarts}")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// How it ended, in words.
        status: String,
        /// Restarts used, in words (empty when none were allowed).
        restarts: String,
    },
    /// Another node's launcher was lost (killed, or its host unreachable) and no restart was
    /// left, or it did not come back.
    #[error("node {node}'s launcher was lost ({why}){restarts}")]
    NodeLost {
        /// The node.
        node: usize,
        /// How it was lost.
        why: String,
        /// Restarts used, in words.
        restarts: String,
    },
    /// Not every node joined within the join timeout.
    #[error(
        "{} did not join within {waited:.0?} (--join-timeout); is `bonfire launch` running there, with the same --master-addr and secret?",
        name_nodes(missing)
    )]
    NodesMissing {
        /// The nodes that did not join.
        missing: Vec<usize>,
        /// How long the launcher waited.
        waited: Duration,
    },
    /// This node could not join node 0's launcher.
    #[error("cannot join the launcher of node 0 at {master}: {why}")]
    CannotJoin {
        /// Where node 0's launcher was dialled.
        master: String,
        /// Why not.
        why: String,
    },
    /// Node 0's launcher ended the job because of a failure elsewhere.
    #[error("the job ended: {why}")]
    JobEnded {
        /// The failed rank, when a rank failed.
        rank: Option<usize>,
        /// What node 0's launcher said.
        why: String,
    },
    /// Node 0's launcher cannot listen for the others.
    #[error("cannot listen for the other nodes' launchers on TCP {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// The cause.
        source: std::io::Error,
    },
}

pub(crate) fn name_nodes(nodes: &[usize]) -> String {
    let list: Vec<String> = nodes.iter().map(|n| n.to_string()).collect();
    match nodes.len() {
        1 => format!("node {}", list[0]),
        _ => format!("nodes {}", list.join(", ")),
    }
}

/// Why a `HOST:PORT` rendezvous address (`--master-addr`) cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    /// There is no `:PORT`.
    #[error("--master-addr {given:?}: expected HOST:PORT")]
    NoPort {
        /// The address given.
        given: String,
    },
    /// The port is not a number from 0 to 65535.
    #[error("--master-addr {given:?}: {port:?} is not a port number")]
    BadPort {
        /// The address given.
        given: String,
        /// Its port part.
        port: String,
    },
    /// Nothing before the `:PORT`.
    #[error("--master-addr {given:?}: the host is empty")]
    EmptyHost {
        /// The address given.
        given: String,
    },
}

impl LaunchError {
    /// The first failed rank, if a rank failed.
    pub fn failed_rank(&self) -> Option<usize> {
        match self {
            LaunchError::RankFailed { rank, .. } => Some(*rank),
            LaunchError::JobEnded { rank, .. } => *rank,
            _ => None,
        }
    }

    /// Whether the request itself was refused, before any rank was started.
    pub fn is_bad_request(&self) -> bool {
        matches!(
            self,
            LaunchError::NoRanks
                | LaunchError::NoNodes
                | LaunchError::NodeRankOutOfRange { .. }
                | LaunchError::MasterAddr(_)
                | LaunchError::NeedsMasterAddr
                | LaunchError::NoFreePort(_)
                | LaunchError::Secret(_)
                | LaunchError::NeedsSecret
        )
    }
}

/// A port on the loopback interface free for both UDP (the ranks' rendezvous) and TCP (the
/// launchers of a job on several nodes).
pub fn free_local_port() -> std::io::Result<u16> {
    let mut last = None;
    for _ in 0..32 {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0")?;
        let port = udp.local_addr()?.port();
        match std::net::TcpListener::bind(("127.0.0.1", port)) {
            Ok(_) => return Ok(port),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("tried at least once"))
}

/// Splits `HOST:PORT` (IPv6 hosts in brackets).
pub fn split_host_port(s: &str) -> Result<(String, u16), AddrError> {
    let (host, port) = s.rsplit_once(':').ok_or_else(|| AddrError::NoPort {
        given: s.to_string(),
    })?;
    let port: u16 = port.parse().map_err(|_| AddrError::BadPort {
        given: s.to_string(),
        port: port.to_string(),
    })?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(AddrError::EmptyHost {
            given: s.to_string(),
        });
    }
    Ok((host.to_string(), port))
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        let name = match sig {
            libc::SIGKILL => " (SIGKILL)",
            libc::SIGTERM => " (SIGTERM)",
            libc::SIGSEGV => " (SIGSEGV)",
            libc::SIGABRT => " (SIGABRT)",
            libc::SIGINT => " (SIGINT)",
            _ => "",
        };
        format!("was killed by signal {sig}{name}")
    } else {
        format!("exited with status {}", status.code().unwrap_or(-1))
    }
}

/// Signals a rank's whole process group (the rank and anything it started).
fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on the process group of a child we spawned as its group leader; no memory
    // is touched.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), sig);
    }
}

/// Copies a rank's output to ours, line by line, with its prefix.
fn pump<R: Read + Send + 'static>(from: R, prefix: String, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let mut out: Box<dyn Write> = if to_stderr {
                        Box::new(std::io::stderr().lock())
                    } else {
                        Box::new(std::io::stdout().lock())
                    };
                    let _ = out.write_all(prefix.as_bytes());
                    let _ = out.write_all(&line);
                    let _ = out.flush();
                }
            }
        }
    })
}

struct Running {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// A local rank that failed: the first of its round.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    pub(crate) rank: usize,
    pub(crate) pid: u32,
    pub(crate) status: String,
}

/// Whether rank `rank`'s failure, ending with `status`, lets the job go on: it is one of the
/// `expendable` ranks, and under `deaths_only` a signal ended it.
fn forgives(expendable: &[usize], deaths_only: bool, rank: usize, status: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    expendable.contains(&rank) && (!deaths_only || status.signal().is_some())
}

/// The ranks of this node in one round: started together, watched, stopped together.
pub(crate) struct LocalRanks {
    running: Vec<Running>,
    pumps: Vec<JoinHandle<()>>,
    failure: Option<Failure>,
    /// Ranks whose failure does not stop the job.
    expendable: Vec<usize>,
    /// Only when a signal ended them.
    deaths_only: bool,
    /// How the expendable ranks that failed ended (before the round was stopped: one that
    /// ends when the launcher stops it is not lost).
    pub(crate) lost: Vec<String>,
    /// The round is being stopped.
    stopping: bool,
}

impl LocalRanks {
    /// Starts this node's ranks for restart round `round`.
    pub(crate) fn start(
        c: &LaunchConfig,
        env: &[(OsString, OsString)],
        round: u32,
    ) -> Result<LocalRanks, LaunchError> {
        let world = c.nproc_per_node * c.nnodes;
        let width = (world.max(1) - 1).to_string().len();
        let mut ranks = LocalRanks {
            running: Vec::new(),
            pumps: Vec::new(),
            failure: None,
            expendable: c.expendable.clone(),
            deaths_only: c.expendable_deaths_only,
            lost: Vec::new(),
            stopping: false,
        };
        let blocks = c.cpu_blocks()?;
        for local in 0..c.nproc_per_node {
            let rank = c.node_rank * c.nproc_per_node + local;
            let mut cmd = Command::new(&c.program);
            let block = blocks.as_ref().map(|b| &b[local]);
            match block {
                Some(block) => cmd.env(placement::CPUS_VAR, placement::format_cpu_list(block)),
                // Not bound: a block this launcher was given itself is not the rank's.
                None => cmd.env_remove(placement::CPUS_VAR),
            };
            cmd.args(&c.args)
                .envs(env.iter().map(|(k, v)| (k, v)))
                .env(vars::RANK, rank.to_string())
                .env(vars::LOCAL_RANK, local.to_string())
                .env(vars::RESTART_ROUND, round.to_string())
                .stdin(Stdio::null());
            if c.prefix_output {
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
                // The launcher prefixes every line; the rank's log lines need not.
                cmd.env(vars::OUTPUT_PREFIXED, "1");
            }
            #[cfg(target_os = "linux")]
            {
                use std::os::unix::process::CommandExt;
                let mask = match block.map(|b| placement::CpuMask::of(b)).transpose() {
                    Ok(mask) => mask,
                    Err(e) => {
                        ranks.stop(Duration::ZERO);
                        return Err(LaunchError::Cpus(e));
                    }
                };
                // Each rank leads its own process group, so tearing it down reaches whatever it
                // started; and the kernel kills it if this launcher dies, so no rank outlives
                // it (a stopped rank would not act on a gentler signal).
                // SAFETY: setpgid and prctl are async-signal-safe and touch no memory of ours.
                unsafe {
                    cmd.pre_exec(move || {
                        libc::setpgid(0, 0);
                        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                        // The rank's block, before it starts any thread (a system call only).
                        if let Some(mask) = &mask {
                            placement::bind_with(mask)?;
                        }
                        Ok(())
                    });
                }
            }
            let mut child = match cmd.spawn() {
                Ok(child) => child,
                Err(source) => {
                    ranks.stop(Duration::ZERO);
                    return Err(LaunchError::Spawn {
                        rank,
                        program: c.program.to_string_lossy().into_owned(),
                        source,
                    });
                }
            };
            let prefix = format!("[rank {rank:>width$}] ");
            if let Some(out) = child.stdout.take() {
                ranks.pumps.push(pump(out, prefix.clone(), false));
            }
            if let Some(err) = child.stderr.take() {
                ranks.pumps.push(pump(err, prefix, true));
            }
            ranks.running.push(Running {
                rank,
                child,
                status: None,
            });
        }
        Ok(ranks)
    }

    /// Reaps the ranks that exited. Returns the round's first failure when it happens now
    /// (once), and whether every rank has exited.
    pub(crate) fn poll(&mut self) -> (Option<Failure>, bool) {
        let mut new = None;
        for r in self.running.iter_mut().filter(|r| r.status.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.status = Some(status);
                if !status.success() && forgives(&self.expendable, self.deaths_only, r.rank, status)
                {
                    let how = format!(
                        "rank {} (pid {}) {}",
                        r.rank,
                        r.child.id(),
                        describe(status)
                    );
                    if !self.stopping {
                        tracing::warn!("bonfire launch: expendable {how}; the job goes on");
                        self.lost.push(how);
                    }
                    continue;
                }
                if !status.success() && self.failure.is_none() {
                    let failure = Failure {
                        rank: r.rank,
                        pid: r.child.id(),
                        status: describe(status),
                    };
                    self.failure = Some(failure.clone());
                    new = Some(failure);
                }
            }
        }
        (new, self.running.iter().all(|r| r.status.is_some()))
    }

    /// Every rank exited with success (an expendable one: exited, or died under
    /// `expendable_deaths_only`).
    pub(crate) fn succeeded(&self) -> bool {
        self.running.iter().all(|r| {
            r.status.is_some_and(|s| {
                s.success() || forgives(&self.expendable, self.deaths_only, r.rank, s)
            })
        })
    }

    /// Stops the round: the ranks still running get `grace` to end by themselves (to notice a
    /// failure and report it), then SIGTERM (and SIGCONT, for a stopped one), then after 3 s
    /// SIGKILL. Returns when every rank has exited and its output is copied; says how each rank
    /// that failed after the first one ended.
    pub(crate) fn stop(&mut self, grace: Duration) {
        // A rank that exits from now on was stopped (or failed while the round ends).
        self.poll();
        self.stopping = true;
        let since = Instant::now();
        let mut terminated_at: Option<Instant> = None;
        loop {
            let (_, all) = self.poll();
            if all {
                break;
            }
            match terminated_at {
                None if since.elapsed() >= grace => {
                    for r in self.running.iter().filter(|r| r.status.is_none()) {
                        signal(&r.child, libc::SIGTERM);
                        signal(&r.child, libc::SIGCONT);
                    }
                    terminated_at = Some(Instant::now());
                }
                Some(t) if t.elapsed() >= Duration::from_secs(3) => {
                    for r in self.running.iter().filter(|r| r.status.is_none()) {
                        signal(&r.child, libc::SIGKILL);
                    }
                }
                _ => {}
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for p in self.pumps.drain(..) {
            let _ = p.join();
        }
        if let Some(first) = &self.failure {
            for r in &self.running {
                if r.rank != first.rank
                    && let Some(s) = r.status
                    && !s.success()
                {
                    tracing::warn!(
                        "bonfire launch: rank {} (pid {}) {} after rank {} failed",
                        r.rank,
                        r.child.id(),
                        describe(s),
                        first.rank
                    );
                }
            }
        }
    }
}

/// Runs the rounds of a job that is this node alone: a failed round is restarted while restarts
/// are left.
fn run_alone(
    c: &LaunchConfig,
    env: &[(OsString, OsString)],
    grace: Duration,
    cleanup: &dyn Fn(),
) -> Result<Launched, LaunchError> {
    let mut round = 0u32;
    let mut launched = Launched::default();
    loop {
        let mut ranks = LocalRanks::start(c, env, round)?;
        let failure = loop {
            let (failure, all) = ranks.poll();
            if let Some(f) = failure {
                break f;
            }
            if all {
                ranks.stop(Duration::ZERO);
                cleanup();
                launched.lost.append(&mut ranks.lost);
                return Ok(launched);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let restart = round < c.max_restarts;
        // A restart stops the survivors at once; the last failure gives them time to report.
        ranks.stop(if restart { Duration::ZERO } else { grace });
        launched.lost.append(&mut ranks.lost);
        cleanup();
        let Failure { rank, pid, status } = failure;
        if !restart {
            return Err(LaunchError::RankFailed {
                rank,
                pid,
                status,
                restarts: restarts_used(round, c.max_restarts),
            });
        }
        round += 1;
        launched
            .restarts
            .push(format!("rank {rank} (pid {pid}) {status}"));
        tracing::info!(
            "bonfire launch: rank {rank} (pid {pid}) {status}; restarting the job (restart {round} of {}): its ranks resume from their newest checkpoint",
            c.max_restarts
        );
    }
}

/// `" (after R of N restarts)"`, or nothing when none were allowed.
pub(crate) fn restarts_used(used: u32, max: u32) -> String {
    if max > 0 {
        format!(" (after {used} of {max} restarts)")
    } else {
        String::new()
    }
}

/// Runs the job's local ranks to completion. Returns when every local rank exited; the error
/// names the first rank that failed.
pub fn launch(config: &LaunchConfig) -> Result<Launched, LaunchError> {
    let c = config;
    if c.nproc_per_node == 0 {
        return Err(LaunchError::NoRanks);
    }
    if c.nnodes == 0 {
        return Err(LaunchError::NoNodes);
    }
    if c.node_rank >= c.nnodes {
        return Err(LaunchError::NodeRankOutOfRange {
            node_rank: c.node_rank,
            nnodes: c.nnodes,
        });
    }
    c.cpu_blocks()?;
    let (host, port) = match &c.master {
        Some(m) => split_host_port(m)?,
        None if c.nnodes == 1 => (
            "127.0.0.1".to_string(),
            free_local_port().map_err(LaunchError::NoFreePort)?,
        ),
        None => return Err(LaunchError::NeedsMasterAddr),
    };
    let mut env: Vec<(OsString, OsString)> = Vec::new();
    let mut set = |k: &str, v: String| env.push((k.into(), v.into()));
    match &c.secret_file {
        Some(path) => {
            Secret::from_file(path)?;
            let abs = std::path::absolute(path).unwrap_or_else(|_| path.clone());
            set(vars::SECRET_FILE, abs.display().to_string());
        }
        None if std::env::var_os(vars::SECRET).is_some()
            || std::env::var_os(vars::SECRET_FILE).is_some() => {}
        None if c.nnodes == 1 => set(vars::SECRET, Secret::generate().expose_text()),
        None => return Err(LaunchError::NeedsSecret),
    }
    let world = c.nproc_per_node * c.nnodes;
    set(vars::WORLD_SIZE, world.to_string());
    set(vars::LOCAL_WORLD_SIZE, c.nproc_per_node.to_string());
    set(vars::GROUP_RANK, c.node_rank.to_string());
    let host_for_control = host.clone();
    set(vars::MASTER_ADDR, host);
    set(vars::MASTER_PORT, port.to_string());
    if c.nnodes == 1 && std::env::var_os(vars::BIND_ADDR).is_none() {
        // A single-node job needs no other interface.
        set(vars::BIND_ADDR, "127.0.0.1:0".into());
    }
    if let Some(t) = c.timeout {
        set(vars::TIMEOUT, t.as_secs_f64().to_string());
    }
    if let Some(t) = c.peer_timeout {
        set(vars::PEER_TIMEOUT, t.as_secs_f64().to_string());
    }
    env.extend(c.extra_env.iter().cloned());
    // Shared-memory segments carry the job's tag in their names, so that whatever a killed rank
    // left behind can be removed once the round is over.
    let setting = |var: &str| -> Option<String> {
        env.iter()
            .rev()
            .find(|(k, _)| k == var)
            .map(|(_, v)| v.to_string_lossy().into_owned())
            .or_else(|| std::env::var(var).ok())
            .filter(|v| !v.trim().is_empty())
    };
    let shm_dir = PathBuf::from(setting(shm_vars::SHM_DIR).unwrap_or_else(|| "/dev/shm".into()));
    let shm_tag = match setting(shm_vars::SHM_TAG) {
        Some(tag) => tag,
        None => {
            let tag = shm::new_tag();
            env.push((shm_vars::SHM_TAG.into(), tag.clone().into()));
            tag
        }
    };
    // Time the surviving ranks get to notice a failure and report it themselves.
    let grace = c.peer_timeout.unwrap_or(Duration::from_secs(6)) + Duration::from_secs(4);

    let cleanup = || {
        shm::remove_segments(&shm_dir, &shm_tag);
    };
    if c.nnodes > 1 {
        let secret = match &c.secret_file {
            Some(path) => Secret::from_file(path)?,
            None => crate::control::secret_from_env()?,
        };
        return crate::control::run(c, &env, (&host_for_control, port), secret, grace, &cleanup);
    }
    run_alone(c, &env, grace, &cleanup)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port() {
        assert_eq!(
            split_host_port("10.0.0.1:29500"),
            Ok(("10.0.0.1".into(), 29500))
        );
        assert_eq!(split_host_port("[::1]:7"), Ok(("::1".into(), 7)));
        assert!(split_host_port("node01").is_err());
        assert!(split_host_port("node01:http").is_err());
        assert!(split_host_port(":80").is_err());
    }

    fn sh(nproc: usize, script: &str) -> LaunchConfig {
        let mut c = LaunchConfig::local(nproc, "sh");
        c.args = vec!["-c".into(), script.into()];
        c.peer_timeout = Some(Duration::from_millis(200));
        c
    }

    #[test]
    fn every_rank_gets_the_torchrun_variables() {
        let dir = std::env::temp_dir().join(format!("bonfire-launch-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!(
            "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR ${{#BONFIRE_SECRET}} > {}/$RANK",
            dir.display()
        );
        launch(&sh(3, &script)).unwrap();
        for rank in 0..3 {
            let line = std::fs::read_to_string(dir.join(rank.to_string())).unwrap();
            assert_eq!(line.trim(), format!("{rank} 3 {rank} 3 127.0.0.1 64"));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_rank_stops_the_others_and_is_named() {
        let started = Instant::now();
        let err = launch(&sh(3, "if [ $RANK = 1 ]; then exit 3; fi; sleep 30")).unwrap_err();
        assert_eq!(err.failed_rank(), Some(1));
        assert!(err.to_string().contains("exited with status 3"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "survivors were not stopped"
        );
    }

    #[test]
    fn an_expendable_rank_that_fails_does_not_stop_the_job() {
        // Rank 1 fails at once; rank 0 outlives it and succeeds.
        let mut c = sh(3, "if [ $RANK = 1 ]; then exit 3; fi; sleep 0.5");
        c.expendable = vec![1];
        let launched = launch(&c).unwrap();
        assert_eq!(launched.lost.len(), 1, "{launched:?}");
        assert!(launched.lost[0].starts_with("rank 1 (pid "), "{launched:?}");
        let summary = launched.summary().unwrap();
        assert!(
            summary.contains("without the expendable rank that failed (rank 1")
                && summary.contains("exited with status 3"),
            "{summary}"
        );
        // Another rank's failure still stops the job.
        let mut c = sh(3, "if [ $RANK = 2 ]; then exit 4; fi; sleep 30");
        c.expendable = vec![1];
        assert_eq!(launch(&c).unwrap_err().failed_rank(), Some(2));
    }

    #[test]
    fn deaths_only_forgives_a_killed_rank_but_not_an_error() {
        // Rank 1 kills itself: it died, and the job goes on.
        let mut c = sh(3, "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 0.5");
        c.expendable = vec![1];
        c.expendable_deaths_only = true;
        let launched = launch(&c).unwrap();
        assert_eq!(launched.lost.len(), 1, "{launched:?}");
        assert!(launched.lost[0].contains("SIGKILL"), "{launched:?}");
        // Rank 1 exits with an error of its own: the job fails, naming it.
        let mut c = sh(3, "if [ $RANK = 1 ]; then exit 3; fi; sleep 30");
        c.expendable = vec![1];
        c.expendable_deaths_only = true;
        assert_eq!(launch(&c).unwrap_err().failed_rank(), Some(1));
    }

    #[test]
    fn an_expendable_rank_the_launcher_stops_is_not_lost() {
        // Rank 2 fails; expendable rank 1 is still running and is stopped with the others.
        let mut c = sh(3, "if [ $RANK = 2 ]; then exit 4; fi; sleep 30");
        c.expendable = vec![1];
        c.peer_timeout = Some(Duration::from_millis(100));
        let mut ranks = LocalRanks::start(&c, &[], 0).unwrap();
        let failure = loop {
            if let (Some(f), _) = ranks.poll() {
                break f;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(failure.rank, 2);
        ranks.stop(Duration::ZERO);
        assert!(ranks.lost.is_empty(), "{:?}", ranks.lost);
    }

    #[test]
    fn restarts_run_the_ranks_again() {
        // Rank 0 fails in round 0 (alone, so that no other failure races it to be first);
        // every rank succeeds in round 1.
        let mut c = sh(2, "test $BONFIRE_RESTART_ROUND = 1 || test $RANK != 0");
        c.max_restarts = 1;
        launch(&c).unwrap();
        c.max_restarts = 0;
        let err = launch(&c).unwrap_err();
        assert_eq!(err.failed_rank(), Some(0));
    }

    #[test]
    fn bad_requests_start_nothing() {
        let mut c = sh(2, "true");
        c.nnodes = 2;
        let e = launch(&c).unwrap_err();
        assert!(
            e.is_bad_request() && e.to_string().contains("--master-addr"),
            "{e}"
        );
        c.node_rank = 2;
        let e = launch(&c).unwrap_err();
        assert!(
            e.is_bad_request() && e.to_string().contains("--node-rank 2"),
            "{e}"
        );
    }
}
