//! The troubleshooting chapter quotes every error as the code writes it. Both directions are
//! checked here: every quote of `book/src/troubleshooting.md` (each line of its `text` blocks,
//! `...` standing for the parts that vary) matches a message these error types render, and every
//! variant of the user-facing error types below renders a message that some quote matches. The
//! variants come from exhaustive matches, so a new variant does not compile until it has an
//! example here, and does not pass until the chapter quotes it.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bonfire::InitError;
use bonfire::LogFilterError;
use bonfire::backend::{BufferSync, ConfigError, GradDType, SyncError};
use bonfire::checkpoint::CheckpointError;
use bonfire::collectives::{Algorithm, CollectiveError, Fingerprint, OpKind};
use bonfire::launch::slurm::SlurmError;
use bonfire::launch::{AddrError, EnvError, LaunchError};
use bonfire::topology::{DType, GroupId, Rank, ReduceOp};
use bonfire::transport::JobTransportError;
use bonfire::transport::quic::Who;
use bonfire::transport::shm::ShmConfigError;
use bonfire::transport::{QuicError, SecretError, TransportError};

const CHAPTER: &str = include_str!("../../../book/src/troubleshooting.md");

/// The quotes: each line of the chapter's `text` blocks.
fn quotes() -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in CHAPTER.lines() {
        if line.starts_with("```") {
            inside = !inside && line.trim() == "```text";
            continue;
        }
        if inside && !line.trim().is_empty() {
            out.push(line.trim());
        }
    }
    out
}

/// A quote as a pattern: its text literally, each `...` any text, after whatever a wrapper puts
/// before it (`error: `, `bonfire::init: `, a failing rank's line, an outer error's context:
/// anything that ends in `: `).
fn pattern(quote: &str) -> regex::Regex {
    let parts: Vec<String> = quote.split("...").map(regex::escape).collect();
    regex::Regex::new(&format!("^(?s)(?:.*: )?{}$", parts.join(".*"))).expect("a pattern")
}

/// Declares the variants of an error type by exhaustive match: `$name(e)` is the pattern `e`
/// matches, `$all()` every pattern.
macro_rules! variants {
    ($name:ident, $all:ident, $t:ty, [$($(#[$m:meta])* $p:pat),+ $(,)?]) => {
        fn $name(e: &$t) -> &'static str {
            match e {
                $($(#[$m])* $p => stringify!($p)),+
            }
        }
        fn $all() -> Vec<&'static str> {
            let mut v = Vec::new();
            $($(#[$m])* v.push(stringify!($p));)+
            v
        }
    };
}

fn fp(op: OpKind, count: u64, root: Option<u32>) -> Fingerprint {
    Fingerprint {
        group: GroupId(0x755115aead12dd31),
        seq: 7,
        op,
        dtype: DType::F32,
        count,
        root,
        algorithm: Algorithm::Ring,
        chunk_bytes: 1 << 20,
        layout: 0,
    }
}

fn all_reduce() -> Fingerprint {
    fp(OpKind::AllReduce(ReduceOp::Sum), 1024, None)
}

fn io_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        "Permission denied (os error 13)",
    )
}

fn peer_lost() -> CollectiveError {
    CollectiveError::PeerLost {
        me: Rank(0),
        collective: all_reduce(),
        peer: Rank(1),
        reason: Arc::from("connection lost"),
    }
}

variants!(
    collective_variant,
    collective_all,
    CollectiveError,
    [
        CollectiveError::Mismatch { .. },
        CollectiveError::Timeout { .. },
        CollectiveError::PeerLost { .. },
        CollectiveError::PeerAborted { .. },
        CollectiveError::BadFrame { .. },
        CollectiveError::Transport { .. },
        CollectiveError::InvalidArgument { .. },
        CollectiveError::UnsupportedAlgorithm { .. },
        CollectiveError::Internal { .. },
    ]
);

fn collective_examples() -> Vec<CollectiveError> {
    vec![
        CollectiveError::Mismatch {
            me: Rank(1),
            mine: all_reduce(),
            peer: Rank(0),
            theirs: fp(OpKind::Broadcast, 1024, Some(0)),
        },
        CollectiveError::Timeout {
            me: Rank(0),
            collective: all_reduce(),
            waited: Duration::from_secs(300),
            missing: vec![Rank(1)],
            waiting_for: None,
        },
        peer_lost(),
        CollectiveError::PeerAborted {
            me: Rank(0),
            collective: all_reduce(),
            peer: Rank(1),
            reason: "out of memory".into(),
        },
        CollectiveError::BadFrame {
            me: Rank(0),
            collective: all_reduce(),
            peer: Rank(1),
            step: 3,
            problem: "4096 bytes, expected 2048".into(),
        },
        CollectiveError::Transport {
            me: Rank(0),
            collective: all_reduce(),
            source: TransportError::Send {
                peer: Rank(1),
                reason: "the link is closed".into(),
            },
        },
        CollectiveError::InvalidArgument {
            me: Rank(0),
            op: "broadcast",
            problem: "root 4 is outside a group of 2".into(),
        },
        CollectiveError::UnsupportedAlgorithm {
            me: Rank(0),
            op: "broadcast",
            algorithm: Algorithm::RecursiveDoubling,
            supported: &[Algorithm::Auto, Algorithm::Ring],
        },
        CollectiveError::Internal {
            me: Rank(0),
            op: "all_reduce",
            problem: "a task panicked".into(),
        },
    ]
}

variants!(
    transport_variant,
    transport_all,
    TransportError,
    [
        TransportError::PeerLost { .. },
        TransportError::NoSuchPeer { .. },
        TransportError::Send { .. },
    ]
);

fn transport_examples() -> Vec<TransportError> {
    vec![
        TransportError::PeerLost {
            peer: Rank(1),
            reason: Arc::from("connection lost"),
        },
        TransportError::NoSuchPeer {
            peer: Rank(5),
            world: 4,
        },
        TransportError::Send {
            peer: Rank(1),
            reason: "the link is closed".into(),
        },
    ]
}

variants!(
    sync_variant,
    sync_all,
    SyncError,
    [
        SyncError::PlanCheck(..),
        SyncError::PlanMismatch { .. },
        SyncError::GradientsNotKept { .. },
        SyncError::UnknownParameter { .. },
        SyncError::SizeChanged { .. },
        SyncError::NoGradient { .. },
        SyncError::AllReduce { .. },
        SyncError::ReduceScatter { .. },
        SyncError::PartialGradient { .. },
        SyncError::DevicePack { .. },
        SyncError::DeviceLane { .. },
        SyncError::Read { .. },
        SyncError::ExplicitAllReduce { .. },
        SyncError::Buffer { .. },
        SyncError::Sharded { .. },
        SyncError::Broadcast { .. },
    ]
);

fn sync_examples() -> Vec<SyncError> {
    vec![
        SyncError::PlanCheck(peer_lost()),
        SyncError::PlanMismatch {
            ranks: vec![1],
            params: 8,
            elements: 20_000,
            cap_bytes: 25 << 20,
            dtype: GradDType::F32,
        },
        SyncError::GradientsNotKept {
            params: 8,
            world: 2,
        },
        SyncError::UnknownParameter { id: 0x1234 },
        SyncError::SizeChanged {
            param: "fc.weight".into(),
            from: 100,
            to: 120,
        },
        SyncError::NoGradient {
            params: vec!["head.weight".into()],
        },
        SyncError::AllReduce {
            bucket: 0,
            buckets: 2,
            elements: 20_000,
            source: peer_lost(),
        },
        SyncError::ReduceScatter {
            bucket: 0,
            buckets: 2,
            elements: 20_000,
            counts: vec![10_000, 10_000],
            source: peer_lost(),
        },
        SyncError::PartialGradient {
            param: "b.weight".into(),
            elements: 8,
            with: 1.0,
            world: 2,
        },
        SyncError::DevicePack {
            bucket: 0,
            buckets: 1,
            stage: "packing",
            source: bonfire_kernels::KernelError::Device("out of memory".into()),
        },
        SyncError::DeviceLane {
            bucket: 0,
            buckets: 1,
            elements: 1024,
            detail: "all_reduce of 1024 x f32: rank 1 did not arrive within 300s".into(),
        },
        SyncError::Read {
            what: "a gradient".into(),
            reason: "the device was lost".into(),
        },
        SyncError::ExplicitAllReduce {
            elements: 16,
            source: peer_lost(),
        },
        SyncError::Buffer {
            buffer: "norm.running_mean".into(),
            how: BufferSync::Average,
            elements: 8,
            source: peer_lost(),
        },
        SyncError::Sharded {
            what: "all-gather of 2 parameters (1024 elements)".into(),
            source: Some(peer_lost()),
        },
        SyncError::Broadcast {
            param: "fc.weight".into(),
            what: "its values, shape [4, 3]".into(),
            source: peer_lost(),
        },
    ]
}

variants!(
    config_variant,
    config_all,
    ConfigError,
    [
        ConfigError::BucketCap { .. },
        ConfigError::GradDType { .. },
        ConfigError::DevicePack { .. },
        ConfigError::DeviceLane { .. },
        ConfigError::SyncAlone { .. },
        ConfigError::Overlap { .. },
    ]
);

fn config_examples() -> Vec<ConfigError> {
    let value = || "maybe".to_string();
    vec![
        ConfigError::BucketCap { value: value() },
        ConfigError::GradDType { value: value() },
        ConfigError::DevicePack { value: value() },
        ConfigError::DeviceLane { value: value() },
        ConfigError::SyncAlone { value: value() },
        ConfigError::Overlap { value: value() },
    ]
}

variants!(
    env_variant,
    env_all,
    EnvError,
    [
        EnvError::Invalid { .. },
        EnvError::Slurm(..),
        EnvError::SlurmBatchScript { .. },
        EnvError::Missing { .. },
    ]
);

fn slurm_error() -> SlurmError {
    SlurmError {
        var: "SLURM_STEP_NODELIST",
        value: "n[1-".into(),
        why: "not a node list such as n[1-2,7],gpu5",
    }
}

fn env_examples() -> Vec<EnvError> {
    vec![
        EnvError::Invalid {
            var: "RANK",
            value: "two".into(),
            why: "expected a rank, 0 or more".into(),
        },
        EnvError::Slurm(slurm_error()),
        EnvError::SlurmBatchScript { job: 10, tasks: 4 },
        EnvError::Missing {
            var: "MASTER_ADDR",
            because: "WORLD_SIZE",
        },
    ]
}

variants!(
    secret_variant,
    secret_all,
    SecretError,
    [SecretError::Read { .. }, SecretError::TooShort { .. },]
);

fn secret_examples() -> Vec<SecretError> {
    vec![
        SecretError::Read {
            path: "job.secret".into(),
            source: io_error(),
        },
        SecretError::TooShort {
            from: " in job.secret".into(),
            len: 5,
        },
    ]
}

variants!(
    init_variant,
    init_all,
    InitError,
    [
        InitError::Env(..),
        InitError::SecretVar(..),
        InitError::SecretFile(..),
        InitError::NoSecret { .. },
        InitError::Connect(..),
        InitError::Log(..),
        InitError::Transport(..),
        InitError::Communicator(..),
        InitError::TensorParallelSize { .. },
        InitError::Groups { .. },
        InitError::Config(..),
    ]
);

fn log_error() -> LogFilterError {
    LogFilterError {
        var: "BONFIRE_LOG",
        value: "bonfire=loudly".into(),
        why: "invalid filter directive".into(),
    }
}

fn init_examples() -> Vec<InitError> {
    vec![
        InitError::Env(EnvError::SlurmBatchScript { job: 10, tasks: 4 }),
        InitError::SecretVar(SecretError::TooShort {
            from: String::new(),
            len: 5,
        }),
        InitError::SecretFile(SecretError::Read {
            path: "job.secret".into(),
            source: io_error(),
        }),
        InitError::NoSecret {
            world_size: 2,
            hint: "set BONFIRE_SECRET_FILE to a file on a shared file system",
        },
        InitError::Connect(JobTransportError::Quic(QuicError::Unreachable {
            master: "10.0.0.1:29500".into(),
            waited: Duration::from_secs(120),
            detail: "no answer".into(),
        })),
        InitError::Log(log_error()),
        InitError::Transport(ShmConfigError {
            var: "BONFIRE_TRANSPORT",
            value: "carrier-pigeon".into(),
            why: "expected auto, shm or quic".into(),
        }),
        InitError::Communicator(peer_lost()),
        InitError::TensorParallelSize {
            value: "3".into(),
            world_size: 4,
        },
        InitError::Groups {
            what: "tensor-parallel",
            source: Box::new(peer_lost()),
        },
        InitError::Config(ConfigError::GradDType { value: "f8".into() }),
    ]
}

variants!(
    addr_variant,
    addr_all,
    AddrError,
    [
        AddrError::NoPort { .. },
        AddrError::BadPort { .. },
        AddrError::EmptyHost { .. },
    ]
);

fn addr_examples() -> Vec<AddrError> {
    vec![
        AddrError::NoPort {
            given: "10.0.0.1".into(),
        },
        AddrError::BadPort {
            given: "10.0.0.1:http".into(),
            port: "http".into(),
        },
        AddrError::EmptyHost {
            given: ":29500".into(),
        },
    ]
}

variants!(
    launch_variant,
    launch_all,
    LaunchError,
    [
        LaunchError::NoRanks,
        LaunchError::NoNodes,
        LaunchError::NodeRankOutOfRange { .. },
        LaunchError::MasterAddr(..),
        LaunchError::NeedsMasterAddr,
        LaunchError::NoFreePort(..),
        LaunchError::Secret(..),
        LaunchError::NeedsSecret,
        LaunchError::Spawn { .. },
        LaunchError::RankFailed { .. },
        LaunchError::NodeLost { .. },
        LaunchError::NodesMissing { .. },
        LaunchError::CannotJoin { .. },
        LaunchError::JobEnded { .. },
        LaunchError::Listen { .. },
    ]
);

fn launch_examples() -> Vec<LaunchError> {
    vec![
        LaunchError::NoRanks,
        LaunchError::NoNodes,
        LaunchError::NodeRankOutOfRange {
            node_rank: 2,
            nnodes: 2,
        },
        LaunchError::MasterAddr(AddrError::NoPort {
            given: "10.0.0.1".into(),
        }),
        LaunchError::NeedsMasterAddr,
        LaunchError::NoFreePort(io_error()),
        LaunchError::Secret(SecretError::TooShort {
            from: " in job.secret".into(),
            len: 5,
        }),
        LaunchError::NeedsSecret,
        LaunchError::Spawn {
            rank: 0,
            program: "./train".into(),
            source: io::Error::new(io::ErrorKind::NotFound, "No such file or directory"),
        },
        LaunchError::RankFailed {
            rank: 1,
            pid: 4242,
            status: "was killed by signal 9 (SIGKILL)".into(),
            restarts: " (after 0 of 0 restarts)".into(),
        },
        LaunchError::NodeLost {
            node: 1,
            why: "the connection was closed".into(),
            restarts: " (after 2 of 2 restarts)".into(),
        },
        LaunchError::NodesMissing {
            missing: vec![2],
            waited: Duration::from_secs(300),
        },
        LaunchError::CannotJoin {
            master: "10.0.0.1:29500".into(),
            why: "connection refused".into(),
        },
        LaunchError::JobEnded {
            rank: Some(3),
            why: "rank 3 (pid 77, node 1) exited with status 1".into(),
        },
        LaunchError::Listen {
            addr: "10.0.0.1:29500".into(),
            source: io::Error::new(io::ErrorKind::AddrInUse, "Address in use (os error 98)"),
        },
    ]
}

variants!(
    checkpoint_variant,
    checkpoint_all,
    CheckpointError,
    [
        CheckpointError::Io { .. },
        CheckpointError::Write { .. },
        CheckpointError::Agree(..),
        CheckpointError::Share { .. },
        CheckpointError::Received { .. },
    ]
);

fn checkpoint_examples() -> Vec<CheckpointError> {
    vec![
        CheckpointError::Io {
            path: PathBuf::from("checkpoints/epoch-3"),
            source: io_error(),
        },
        CheckpointError::Write {
            dir: PathBuf::from("checkpoints/.epoch-3.tmp"),
            source: "the disk is full".into(),
        },
        CheckpointError::Agree(peer_lost()),
        CheckpointError::Share {
            epoch: 3,
            from: 0,
            to: vec![4, 5],
            source: Box::new(peer_lost()),
        },
        CheckpointError::Received {
            epoch: 3,
            from: 0,
            dir: PathBuf::from("checkpoints/epoch-3"),
            why: "model.bin does not match its checksum".into(),
        },
    ]
}

/// Messages the chapter quotes from types not checked variant by variant above (the bundled
/// jobs', the QUIC join's) and from places that are not error types.
fn other_messages() -> Vec<String> {
    vec![
        QuicError::Unauthenticated {
            me: Who(Some(Rank(0))),
            peer: "rank 1".into(),
            reason: "it does not hold this job's secret (is another job using this port?)".into(),
        }
        .to_string(),
        bonfire_jobs::JobError::Gpu {
            device: "wgpu".into(),
            why: "no adapter".into(),
            hint: bonfire_jobs::WGPU_HINT,
        }
        .to_string(),
        bonfire_jobs::JobError::NoCuda.to_string(),
        bonfire::backend::forgot_init_message(1, 2, "RANK/WORLD_SIZE"),
    ]
}

/// The message only a CUDA build prints when its ranks cannot all join the device lane, put
/// together from its format strings (each must be in the sources as written) with example
/// values: this build may not compile them.
fn cuda_only_messages() -> Vec<String> {
    let sources = concat!(
        include_str!("../../bonfire-backend/src/data_parallel/lane.rs"),
        include_str!("../../bonfire-kernels/src/lane.rs")
    );
    let parts = [
        "bonfire: gradients take the host lane: {}",
        "device lane: rank {rank} {detail}",
        "could not map rank {r}'s window ({e:?}): the device lane needs its ranks on one host, \
         with CUDA IPC between their devices",
    ];
    for part in parts {
        assert!(sources.contains(part), "no CUDA source writes {part:?}");
    }
    vec![
        "bonfire: gradients take the host lane: device lane: rank 1 could not map rank 0's \
         window (CUDA_ERROR_INVALID_VALUE): the device lane needs its ranks on one host, with \
         CUDA IPC between their devices"
            .into(),
    ]
}

/// One user-facing type: its name, its variants, and the messages of its examples with the
/// variant each one is.
struct Checked {
    name: &'static str,
    all: Vec<&'static str>,
    examples: Vec<(&'static str, String)>,
}

fn checked<E: std::fmt::Display>(
    name: &'static str,
    all: Vec<&'static str>,
    variant: fn(&E) -> &'static str,
    examples: Vec<E>,
) -> Checked {
    Checked {
        name,
        all,
        examples: examples
            .iter()
            .map(|e| (variant(e), e.to_string()))
            .collect(),
    }
}

fn every_type() -> Vec<Checked> {
    vec![
        checked("InitError", init_all(), init_variant, init_examples()),
        checked("EnvError", env_all(), env_variant, env_examples()),
        checked(
            "SecretError",
            secret_all(),
            secret_variant,
            secret_examples(),
        ),
        checked(
            "ConfigError",
            config_all(),
            config_variant,
            config_examples(),
        ),
        checked(
            "LaunchError",
            launch_all(),
            launch_variant,
            launch_examples(),
        ),
        checked("AddrError", addr_all(), addr_variant, addr_examples()),
        checked("SyncError", sync_all(), sync_variant, sync_examples()),
        checked(
            "CollectiveError",
            collective_all(),
            collective_variant,
            collective_examples(),
        ),
        // Met inside a collective's error only.
        Checked {
            name: "TransportError",
            all: transport_all(),
            examples: transport_examples()
                .into_iter()
                .map(|source| {
                    let variant = transport_variant(&source);
                    let outer = CollectiveError::Transport {
                        me: Rank(0),
                        collective: all_reduce(),
                        source,
                    };
                    (variant, outer.to_string())
                })
                .collect(),
        },
        checked(
            "CheckpointError",
            checkpoint_all(),
            checkpoint_variant,
            checkpoint_examples(),
        ),
        Checked {
            name: "SlurmError",
            all: vec!["SlurmError"],
            examples: vec![("SlurmError", slurm_error().to_string())],
        },
        Checked {
            name: "LogFilterError",
            all: vec!["LogFilterError"],
            examples: vec![("LogFilterError", log_error().to_string())],
        },
    ]
}

#[test]
fn every_quoted_error_is_one_the_code_writes_and_every_error_is_quoted() {
    let quotes = quotes();
    assert!(quotes.len() >= 10, "{quotes:?}");
    let patterns: Vec<regex::Regex> = quotes.iter().map(|q| pattern(q)).collect();
    let types = every_type();
    let mut problems = Vec::new();
    for t in &types {
        for variant in &t.all {
            if !t.examples.iter().any(|(v, _)| v == variant) {
                problems.push(format!("{}: no example of {variant} here", t.name));
            }
        }
        for (variant, message) in &t.examples {
            let quoted = patterns.iter().any(|p| p.is_match(message));
            if !quoted {
                problems.push(format!(
                    "{} {variant} is not quoted in troubleshooting.md: {message}",
                    t.name
                ));
            }
        }
    }
    let messages: Vec<String> = types
        .iter()
        .flat_map(|t| t.examples.iter().map(|(_, m)| m.clone()))
        .chain(other_messages())
        .chain(cuda_only_messages())
        .collect();
    for (quote, p) in quotes.iter().zip(&patterns) {
        let literal: usize = quote.split("...").map(str::len).sum();
        if literal < 16 {
            problems.push(format!("a quote says too little to check: {quote}"));
        }
        if !messages.iter().any(|m| p.is_match(m)) {
            problems.push(format!("no error renders this quote: {quote}"));
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
