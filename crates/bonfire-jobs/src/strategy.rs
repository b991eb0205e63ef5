//! How a job's data-parallel replicas stay together (`--strategy`): every step's gradients
//! all-reduced (the default), each replica stepping on its own and meeting every `H` steps
//! ([`bonfire::local_sgd`], [`bonfire::diloco`]), or parameter servers
//! ([`bonfire::param_server`]: the last `--servers` ranks own the parameters and the optimizer
//! state, the others push gradients and pull parameters, synchronously or not).
//!
//! A local strategy's replicas meet at the end of every round too (when they stepped since the
//! last meeting), so that the model evaluated and saved is the one they agreed on. Each
//! replica's inner optimizer state and rounding error (bf16's, or int8's two stages') are its
//! own, so a checkpoint holds every replica's (all-gathered over the replicas,
//! [`LocalOptimizers`]) with the outer state, and a resumed run continues bit for bit at the
//! same `--dp`.

use std::borrow::Cow;
use std::path::Path;

use bonfire::collectives::Communicator;
use bonfire::{DeltaDType, Outer, OuterState, ZeroStage};
use burn::module::{AutodiffModule, Module};
use burn::optim::SimpleOptimizer;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use crate::optim::JobOptimizer;
use crate::{Clash, JobError};

/// The strategy a run trains with (`state.json`'s `config.strategy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Strategy {
    /// Every step's gradients averaged over the replicas in backward (DDP).
    #[default]
    #[serde(rename = "allreduce")]
    AllReduce,
    /// Local SGD: `every` steps each, then the replicas' mean.
    LocalSgd {
        /// Steps between meetings.
        every: usize,
        /// The deltas travel in int8 (`--int8-deltas`; left out of `state.json` when off).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        int8: bool,
        /// Inner steps each meeting's exchange runs behind (`--overlap-steps`; left out of
        /// `state.json` when 0).
        #[serde(default, skip_serializing_if = "is_zero")]
        overlap: usize,
    },
    /// DiLoCo: `every` steps each, then an outer Nesterov step over the mean delta.
    Diloco {
        /// Steps between meetings.
        every: usize,
        /// The outer learning rate.
        outer_lr: f32,
        /// The outer momentum.
        outer_momentum: f32,
        /// The deltas travel in int8 (`--int8-deltas`; left out of `state.json` when off).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        int8: bool,
        /// Inner steps each meeting's exchange runs behind (`--overlap-steps`; left out of
        /// `state.json` when 0).
        #[serde(default, skip_serializing_if = "is_zero")]
        overlap: usize,
    },
    /// Synchronous parameter servers: the last `servers` ranks serve.
    PsSync {
        /// Ranks that serve.
        servers: usize,
    },
    /// Asynchronous parameter servers with a stale-synchronous bound.
    PsAsync {
        /// Ranks that serve.
        servers: usize,
        /// Pushes a worker may run ahead of the slowest.
        staleness: u64,
    },
}

/// The strategies by `--strategy` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrategyKind {
    /// `allreduce`.
    AllReduce,
    /// `local-sgd`.
    LocalSgd,
    /// `diloco`.
    Diloco,
    /// `ps-sync`.
    PsSync,
    /// `ps-async`.
    PsAsync,
}

impl std::str::FromStr for StrategyKind {
    type Err = JobError;

    fn from_str(s: &str) -> Result<Self, JobError> {
        match s {
            "allreduce" => Ok(StrategyKind::AllReduce),
            "local-sgd" => Ok(StrategyKind::LocalSgd),
            "diloco" => Ok(StrategyKind::Diloco),
            "ps-sync" => Ok(StrategyKind::PsSync),
            "ps-async" => Ok(StrategyKind::PsAsync),
            _ => Err(JobError::Invalid {
                flag: "--strategy",
                given: s.to_string(),
                why: "must be allreduce, local-sgd, diloco, ps-sync or ps-async",
            }),
        }
    }
}

/// What a caller asks of the strategy; `None` where left to the default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StrategyRequest {
    /// The strategy (default: allreduce).
    pub kind: Option<StrategyKind>,
    /// Steps between meetings of a local strategy (default: 50).
    pub every: Option<usize>,
    /// DiLoCo's outer learning rate (default: 0.7).
    pub outer_lr: Option<f64>,
    /// DiLoCo's outer momentum (default: 0.9).
    pub outer_momentum: Option<f64>,
    /// Ranks that serve under parameter servers (default: 1).
    pub servers: Option<usize>,
    /// Asynchronous parameter servers' staleness bound (default: 2).
    pub staleness: Option<u64>,
    /// A local strategy's deltas in int8, with error feedback (default: f32, or bf16 with the
    /// job's `--bf16`).
    pub int8: bool,
    /// Inner steps a local strategy's meetings run behind (default: 0).
    pub overlap: Option<usize>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Ranks that serve when `--servers` is left out.
pub const DEFAULT_SERVERS: usize = 1;
/// Asynchronous servers' staleness bound when `--staleness` is left out.
pub const DEFAULT_STALENESS: u64 = 2;

/// Steps between meetings when `--sync-every` is left out.
pub const DEFAULT_EVERY: usize = 50;

impl StrategyRequest {
    /// Checks the values given, and that the flags go with the strategy when it is named (a
    /// fresh run's default and a resumed run's saved one are checked with [`Self::fits`]).
    pub fn check(&self) -> Result<(), JobError> {
        crate::error::positive("--sync-every", self.every)?;
        crate::error::positive("--servers", self.servers)?;
        if let Some(v) = self
            .outer_lr
            .filter(|v| !(*v as f32 > 0.0 && (*v as f32).is_finite()))
        {
            return Err(JobError::Invalid {
                flag: "--outer-lr",
                given: v.to_string(),
                why: "must be a positive number",
            });
        }
        if let Some(v) = self
            .outer_momentum
            .filter(|v| !(*v >= 0.0 && (*v as f32) < 1.0))
        {
            return Err(JobError::Invalid {
                flag: "--outer-momentum",
                given: v.to_string(),
                why: "must be at least 0 and below 1",
            });
        }
        match self.kind {
            Some(kind) => self.fits(kind),
            None => Ok(()),
        }
    }

    /// Checks that the flags given go with strategy `kind`.
    pub fn fits(&self, kind: StrategyKind) -> Result<(), JobError> {
        if !matches!(kind, StrategyKind::LocalSgd | StrategyKind::Diloco) && self.every.is_some() {
            return Err(JobError::Invalid {
                flag: "--sync-every",
                given: format!("with --strategy {}", kind_name(kind)),
                why: "only local-sgd and diloco meet every H steps; the others exchange every step",
            });
        }
        if self.servers.is_some() && !matches!(kind, StrategyKind::PsSync | StrategyKind::PsAsync) {
            return Err(JobError::Invalid {
                flag: "--servers",
                given: format!("with --strategy {}", kind_name(kind)),
                why: "only ps-sync and ps-async have servers",
            });
        }
        if self.staleness.is_some() && kind != StrategyKind::PsAsync {
            return Err(JobError::Invalid {
                flag: "--staleness",
                given: format!("with --strategy {}", kind_name(kind)),
                why: "only ps-async lets workers run ahead of each other",
            });
        }
        if self.overlap.is_some_and(|d| d > 0)
            && !matches!(kind, StrategyKind::LocalSgd | StrategyKind::Diloco)
        {
            return Err(JobError::Invalid {
                flag: "--overlap-steps",
                given: format!("with --strategy {}", kind_name(kind)),
                why: "only local-sgd and diloco meet; the others exchange every step",
            });
        }
        if self.int8 && !matches!(kind, StrategyKind::LocalSgd | StrategyKind::Diloco) {
            return Err(JobError::Invalid {
                flag: "--int8-deltas",
                given: format!("with --strategy {}", kind_name(kind)),
                why: "only local-sgd and diloco send deltas; the others send gradients in f32 or \
                      bf16",
            });
        }
        for (flag, v) in [
            ("--outer-lr", self.outer_lr),
            ("--outer-momentum", self.outer_momentum),
        ] {
            if v.is_some() && kind != StrategyKind::Diloco {
                return Err(JobError::Invalid {
                    flag,
                    given: format!("with --strategy {}", kind_name(kind)),
                    why: "only diloco has an outer optimizer",
                });
            }
        }
        Ok(())
    }

    /// The strategy, defaults filled in.
    pub fn resolve(&self) -> Strategy {
        let (every, int8) = (self.every.unwrap_or(DEFAULT_EVERY), self.int8);
        let overlap = self.overlap.unwrap_or(0);
        match self.kind.unwrap_or(StrategyKind::AllReduce) {
            StrategyKind::AllReduce => Strategy::AllReduce,
            StrategyKind::LocalSgd => Strategy::LocalSgd {
                every,
                int8,
                overlap,
            },
            StrategyKind::Diloco => {
                let (lr, momentum) = match bonfire::DILOCO_OUTER {
                    Outer::Nesterov { lr, momentum } => (lr, momentum),
                    Outer::Average => (1.0, 0.0),
                };
                Strategy::Diloco {
                    every,
                    outer_lr: self.outer_lr.map_or(lr, |v| v as f32),
                    outer_momentum: self.outer_momentum.map_or(momentum, |v| v as f32),
                    int8,
                    overlap,
                }
            }
            StrategyKind::PsSync => Strategy::PsSync {
                servers: self.servers.unwrap_or(DEFAULT_SERVERS),
            },
            StrategyKind::PsAsync => Strategy::PsAsync {
                servers: self.servers.unwrap_or(DEFAULT_SERVERS),
                staleness: self.staleness.unwrap_or(DEFAULT_STALENESS),
            },
        }
    }

    /// The strategy a resumed run asks for: what is given, the rest the checkpoint's `saved`.
    pub fn resolve_over(&self, saved: &Strategy) -> Strategy {
        let (mut servers, mut staleness, mut int8, mut overlap) = (None, None, false, None);
        let (kind, every, lr, momentum) = match *saved {
            Strategy::AllReduce => (StrategyKind::AllReduce, None, None, None),
            Strategy::PsSync { servers: n } => {
                servers = Some(n);
                (StrategyKind::PsSync, None, None, None)
            }
            Strategy::PsAsync {
                servers: n,
                staleness: s,
            } => {
                (servers, staleness) = (Some(n), Some(s));
                (StrategyKind::PsAsync, None, None, None)
            }
            Strategy::LocalSgd {
                every,
                int8: i,
                overlap: o,
            } => {
                (int8, overlap) = (i, Some(o));
                (StrategyKind::LocalSgd, Some(every), None, None)
            }
            Strategy::Diloco {
                every,
                outer_lr,
                outer_momentum,
                int8: i,
                overlap: o,
            } => {
                (int8, overlap) = (i, Some(o));
                (
                    StrategyKind::Diloco,
                    Some(every),
                    Some(f64::from(outer_lr)),
                    Some(f64::from(outer_momentum)),
                )
            }
        };
        // The saved run's int8 deltas carry over to another local strategy (`resolve` drops them
        // for the others).
        StrategyRequest {
            kind: Some(self.kind.unwrap_or(kind)),
            every: self.every.or(every),
            outer_lr: self.outer_lr.or(lr),
            outer_momentum: self.outer_momentum.or(momentum),
            servers: self.servers.or(servers),
            staleness: self.staleness.or(staleness),
            int8: self.int8 || int8,
            overlap: self.overlap.or(overlap),
        }
        .resolve()
    }

    /// What a resumed run's request changes of the checkpoint's strategy `saved`, if anything.
    pub(crate) fn clash(&self, saved: &Strategy) -> Option<Clash> {
        Clash::check(
            "--strategy",
            self.given().then(|| self.resolve_over(saved)).as_ref(),
            saved,
            Strategy::describe,
        )
    }

    /// Whether anything was asked (a resumed run must then ask for what it saved).
    pub fn given(&self) -> bool {
        *self != StrategyRequest::default()
    }
}

pub(crate) fn kind_name(kind: StrategyKind) -> &'static str {
    match kind {
        StrategyKind::AllReduce => "allreduce",
        StrategyKind::LocalSgd => "local-sgd",
        StrategyKind::Diloco => "diloco",
        StrategyKind::PsSync => "ps-sync",
        StrategyKind::PsAsync => "ps-async",
    }
}

impl Strategy {
    /// Its `--strategy` name.
    pub fn kind(&self) -> StrategyKind {
        match self {
            Strategy::AllReduce => StrategyKind::AllReduce,
            Strategy::LocalSgd { .. } => StrategyKind::LocalSgd,
            Strategy::Diloco { .. } => StrategyKind::Diloco,
            Strategy::PsSync { .. } => StrategyKind::PsSync,
            Strategy::PsAsync { .. } => StrategyKind::PsAsync,
        }
    }

    /// Whether the replicas step on their own between meetings.
    pub fn is_local(&self) -> bool {
        matches!(self, Strategy::LocalSgd { .. } | Strategy::Diloco { .. })
    }

    /// Ranks that serve under parameter servers; `None` under the other strategies.
    pub fn servers(&self) -> Option<usize> {
        match *self {
            Strategy::PsSync { servers } | Strategy::PsAsync { servers, .. } => Some(servers),
            _ => None,
        }
    }

    /// Whether every step's gradients are all-reduced (the default).
    pub fn is_all_reduce(&self) -> bool {
        matches!(self, Strategy::AllReduce)
    }

    /// `model` as a rank starts training it: a replica of rank 0's, marked for averaging every
    /// step's gradients (`replicate`), or under the other strategies rank 0's values and ids,
    /// unmarked (`broadcast_parameters`).
    pub(crate) fn start<B: AutodiffBackend, M: Module<B>>(&self, model: M) -> M {
        if !self.is_all_reduce() {
            bonfire::broadcast_parameters(model)
        } else {
            bonfire::replicate(model)
        }
    }

    /// A job's optimizer `optim` for this strategy: wrapped for a local one (deltas in int8
    /// when the strategy says so, else in bf16 when `bf16`), otherwise whole or sharded at
    /// `zero`.
    pub(crate) fn optimizer<O, M, B>(
        &self,
        optim: OptimizerAdaptor<O, M, B>,
        bf16: bool,
        zero: Option<ZeroStage>,
    ) -> JobOptimizer<O, M, B>
    where
        O: SimpleOptimizer<B::InnerBackend>,
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let deltas = if self.int8_deltas() {
            DeltaDType::Int8
        } else if bf16 {
            DeltaDType::Bf16
        } else {
            DeltaDType::F32
        };
        match *self {
            Strategy::PsSync { servers } => {
                return JobOptimizer::served(bonfire::param_server(optim, servers));
            }
            Strategy::PsAsync { servers, staleness } => {
                return JobOptimizer::served(
                    bonfire::param_server(optim, servers).asynchronous(staleness),
                );
            }
            _ => {}
        }
        match self.wrap(optim, deltas) {
            Ok(local) => JobOptimizer::local(local),
            Err(optim) => JobOptimizer::new(optim, zero),
        }
    }

    /// `optim` wrapped for this strategy, deltas in `dtype`; all-reduce hands it back.
    pub(crate) fn wrap<O>(&self, optim: O, dtype: DeltaDType) -> Result<bonfire::LocalSgd<O>, O> {
        let wrapped = match *self {
            Strategy::AllReduce | Strategy::PsSync { .. } | Strategy::PsAsync { .. } => {
                return Err(optim);
            }
            Strategy::LocalSgd { every, .. } => bonfire::local_sgd(optim, every),
            Strategy::Diloco {
                every,
                outer_lr,
                outer_momentum,
                ..
            } => bonfire::diloco(optim, every).outer(Outer::Nesterov {
                lr: outer_lr,
                momentum: outer_momentum,
            }),
        };
        Ok(wrapped.exchange_dtype(dtype).overlap(self.overlap_steps()))
    }

    /// Checks that a local strategy's meetings land before the next is sent (`--overlap-steps`
    /// below `--sync-every`, as given or saved).
    pub fn check_overlap(&self) -> Result<(), JobError> {
        match *self {
            Strategy::LocalSgd { every, overlap, .. } | Strategy::Diloco { every, overlap, .. }
                if overlap >= every =>
            {
                Err(JobError::Invalid {
                    flag: "--overlap-steps",
                    given: format!("{overlap} with meetings every {every} steps"),
                    why: "must be below --sync-every: a meeting lands before the next is sent",
                })
            }
            _ => Ok(()),
        }
    }

    /// Inner steps a local strategy's meetings run behind (0 under the others).
    pub fn overlap_steps(&self) -> usize {
        match *self {
            Strategy::LocalSgd { overlap, .. } | Strategy::Diloco { overlap, .. } => overlap,
            _ => 0,
        }
    }

    /// The ranks of a job of `ranks` whose death it survives: asynchronous parameter servers'
    /// workers (the first ranks; the servers, the last ones, are not expendable). None under
    /// the other strategies, where every rank's part is needed to the end.
    pub fn expendable_ranks(&self, ranks: usize) -> Vec<usize> {
        match *self {
            Strategy::PsAsync { servers, .. } => (0..ranks.saturating_sub(servers)).collect(),
            _ => Vec::new(),
        }
    }

    /// Whether a local strategy's deltas travel in int8.
    pub fn int8_deltas(&self) -> bool {
        matches!(
            self,
            Strategy::LocalSgd { int8: true, .. } | Strategy::Diloco { int8: true, .. }
        )
    }

    /// How the strategy is written on the command line and in the report.
    pub fn describe(&self) -> String {
        let mut int8 = if self.int8_deltas() {
            ", int8 deltas".to_string()
        } else {
            String::new()
        };
        if self.overlap_steps() > 0 {
            int8 += &format!(
                ", each meeting behind the next {} step(s)",
                self.overlap_steps()
            );
        }
        match *self {
            Strategy::AllReduce => "allreduce".into(),
            Strategy::LocalSgd { every, .. } => {
                format!("local-sgd, meeting every {every} steps{int8}")
            }
            Strategy::Diloco {
                every,
                outer_lr,
                outer_momentum,
                ..
            } => format!(
                "diloco, meeting every {every} steps (outer Nesterov lr {outer_lr}, momentum \
                 {outer_momentum}){int8}"
            ),
            Strategy::PsSync { servers } => format!("ps-sync, {servers} server(s)"),
            Strategy::PsAsync { servers, staleness } => {
                format!("ps-async, {servers} server(s), staleness bound {staleness}")
            }
        }
    }
}

/// Refuses int8 deltas together with the job's bf16 flag `bf16_flag` (under a local strategy
/// that flag names the deltas' dtype too).
pub(crate) fn check_deltas(
    strategy: &Strategy,
    bf16: bool,
    bf16_flag: &'static str,
) -> Result<(), JobError> {
    if strategy.int8_deltas() && bf16 {
        return Err(JobError::Invalid {
            flag: "--int8-deltas",
            given: format!("with {bf16_flag}"),
            why: "the deltas travel in one dtype: leave out one of the two",
        });
    }
    Ok(())
}

/// Checks that a job of `ranks` keeps a worker beside `servers` servers.
pub(crate) fn check_servers(servers: usize, ranks: usize) -> Result<(), JobError> {
    if servers >= ranks {
        return Err(JobError::Invalid {
            flag: "--servers",
            given: format!("{servers} in a job of {ranks} ranks"),
            why: "the servers must be fewer than the ranks: the others are the workers",
        });
    }
    Ok(())
}

/// Under parameter servers, checks a fresh run of `ranks` ranks: a worker beside the servers,
/// and f32 gradients (`bf16` given as `flag`, the job's flag for bf16 gradients).
pub(crate) fn check_served(
    strategy: &Strategy,
    ranks: usize,
    bf16: bool,
    flag: &'static str,
) -> Result<(), JobError> {
    let Some(servers) = strategy.servers() else {
        return Ok(());
    };
    check_servers(servers, ranks)?;
    if bf16 {
        return Err(JobError::Invalid {
            flag,
            given: "with --strategy ps-sync or ps-async".into(),
            why: "parameter servers push gradients and pull parameters in f32",
        });
    }
    Ok(())
}

/// A server's report over the rounds so far: `total` with round `r` added.
pub(crate) fn merge_served(
    total: Option<bonfire::PsReport>,
    r: bonfire::PsReport,
) -> bonfire::PsReport {
    let Some(mut t) = total else {
        return r;
    };
    t.versions += r.versions;
    if t.staleness.len() < r.staleness.len() {
        t.staleness.resize(r.staleness.len(), 0);
    }
    for (a, b) in t.staleness.iter_mut().zip(&r.staleness) {
        *a += b;
    }
    t.max_lead = t.max_lead.max(r.max_lead);
    t.held += r.held;
    t.finished = r.finished;
    t.departed.extend(r.departed);
    t.stats = r.stats;
    t
}

/// Under parameter servers (`stats` given, the same on every rank), rank 0's report lines:
/// each server's (`served`, over the run) and each worker's traffic, gathered to rank 0 (a
/// collective: every rank calls it). Empty on the other ranks and under other strategies.
pub(crate) fn served_lines<J: crate::job::Job>(
    ctx: &crate::rank::RankContext<'_, J>,
    serving: bool,
    served: Option<&bonfire::PsReport>,
    stats: Option<bonfire::PsStats>,
) -> Result<Vec<String>, JobError> {
    let Some(st) = stats else {
        return Ok(Vec::new());
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mine = match served {
        Some(r) => format!("parameter {}", r.line()),
        None if serving => String::new(),
        None => format!(
            "parameter worker {}: {} pushes of {:.1} KiB and pulls of {:.1} KiB, and {} round \
             end(s); {:.2} MiB sent and {:.2} MiB received in all, {:.2} s pushing and pulling",
            ctx.rank(),
            st.pushes,
            st.push_bytes as f64 / 1024.0,
            st.pull_bytes as f64 / 1024.0,
            st.rounds,
            mib(st.bytes_sent),
            mib(st.bytes_received),
            st.time.as_secs_f64()
        ),
    };
    // Only rank 0 prints them.
    let Some(all) = crate::rank::gather_to_root(
        ctx.dp_group(),
        mine.into_bytes(),
        "gathering the parameter servers' reports",
    )?
    else {
        return Ok(Vec::new());
    };
    Ok(all
        .into_iter()
        .filter(|b| !b.is_empty())
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .collect())
}

/// A local strategy's report line: its meetings, and what they sent per rank.
pub fn report_line(strategy: &Strategy, st: &bonfire::OuterStats, replicas: usize) -> String {
    let mib = st.bytes as f64 / (1 << 20) as f64;
    // Int8 deltas are summed in two stages of messages (bonfire::DeltaDType::Int8), not in one
    // all-reduce.
    let how = if strategy.int8_deltas() {
        "exchanged"
    } else {
        "all-reduced"
    };
    let behind = if strategy.overlap_steps() > 0 {
        format!(
            " ({:.2} s of exchanges ran behind the steps)",
            st.behind.as_secs_f64()
        )
    } else {
        String::new()
    };
    format!(
        "strategy {} over {replicas} replica(s): {} steps, {} meetings, {mib:.2} MiB {how} per \
         rank this run ({:.1} KiB per step), {:.2} s in meetings{behind}",
        strategy.describe(),
        st.steps,
        st.meetings,
        st.bytes as f64 / 1024.0 / st.steps.max(1) as f64,
        st.time.as_secs_f64()
    )
}

/// A local strategy's optimizer file: the outer state (equal on every rank after the round's
/// meeting, but for the rounding errors of bf16 or int8 deltas) and each replica's own part, by
/// replica.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct LocalOptimizers {
    pub(crate) outer: OuterState,
    pub(crate) replicas: Vec<ReplicaState>,
}

/// What one replica keeps of its own: its inner optimizer's encoded record and the rounding
/// error of its bf16 or int8 deltas.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ReplicaState {
    pub(crate) optimizer: Vec<u8>,
    pub(crate) residual: Option<Vec<f32>>,
}

impl LocalOptimizers {
    pub(crate) fn encode(&self) -> Result<Vec<u8>, JobError> {
        encode(self, "optimizer states")
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<LocalOptimizers, String> {
        decode(bytes)
    }
}

impl ReplicaState {
    pub(crate) fn encode(&self) -> Result<Vec<u8>, JobError> {
        encode(self, "optimizer state")
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<ReplicaState, String> {
        decode(bytes)
    }
}

/// `value`'s bytes; `what` it is, in an error.
fn encode<T: Serialize>(value: &T, what: &'static str) -> Result<Vec<u8>, JobError> {
    bincode::serde::encode_to_vec(value, bincode::config::standard()).map_err(|e| {
        JobError::EncodeRecord {
            what,
            source: burn::record::RecorderError::Unknown(e.to_string()),
        }
    })
}

/// `T` from `bytes`, allocating at most 16 GiB whatever a damaged length says.
fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let config = bincode::config::standard().with_limit::<{ 1 << 34 }>();
    bincode::serde::decode_from_slice(bytes, config)
        .map(|(v, _)| v)
        .map_err(|e| e.to_string())
}

/// What a job writes as its optimizer file: under a local strategy, this replica's encoded
/// inner record `mine` and rounding error gathered with every other replica's over `replicas`
/// to its rank 0 (a collective: every rank calls it) into one [`LocalOptimizers`] with the outer `state`, on
/// the group's rank 0 (the others get nothing to write); otherwise `mine` as it is.
pub(crate) fn optimizer_file(
    replicas: &Communicator,
    state: Option<&OuterState>,
    mine: Vec<u8>,
) -> Result<Vec<u8>, JobError> {
    let Some(outer) = state else {
        return Ok(mine);
    };
    let own = ReplicaState {
        optimizer: mine,
        residual: outer.residual.clone(),
    }
    .encode()?;
    let during = "gathering the replicas' optimizer states";
    let Some(all) = crate::rank::gather_to_root(replicas, own, during)? else {
        // Only the first replica's process writes the checkpoint.
        return Ok(Vec::new());
    };
    let replicas = all
        .iter()
        .map(|b| ReplicaState::decode(b))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|why| JobError::EncodeRecord {
            what: "optimizer states",
            source: burn::record::RecorderError::Unknown(why),
        })?;
    // Each replica's rounding error is in its own part.
    let outer = OuterState {
        residual: None,
        ..outer.clone()
    };
    LocalOptimizers { outer, replicas }.encode()
}

/// The part of optimizer file `file` (of checkpoint `dir`) that replica `replica` of `replicas`
/// loads: under a local strategy its own inner record and the outer state with its own
/// rounding error; otherwise the whole file.
pub(crate) fn optimizer_part<'a>(
    file: &'a [u8],
    local: bool,
    replica: usize,
    replicas: usize,
    dir: &Path,
) -> Result<(Cow<'a, [u8]>, Option<OuterState>), JobError> {
    if !local {
        return Ok((Cow::Borrowed(file), None));
    }
    let bad = |why| JobError::DamagedRecord {
        dir: dir.to_path_buf(),
        what: "optimizer states",
        why,
    };
    let file = LocalOptimizers::decode(file).map_err(bad)?;
    if file.replicas.len() != replicas {
        return Err(bad(format!(
            "it holds {} replicas' optimizer states where the run has {replicas}",
            file.replicas.len()
        )));
    }
    let Some(mine) = file.replicas.into_iter().nth(replica) else {
        return Err(bad(format!(
            "it has no optimizer state for replica {replica}"
        )));
    };
    let outer = OuterState {
        residual: mine.residual,
        ..file.outer
    };
    Ok((Cow::Owned(mine.optimizer), Some(outer)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(kind: Option<StrategyKind>, every: Option<usize>) -> StrategyRequest {
        StrategyRequest {
            kind,
            every,
            ..StrategyRequest::default()
        }
    }

    #[test]
    fn defaults_and_what_a_resume_keeps() {
        assert_eq!(StrategyRequest::default().resolve(), Strategy::AllReduce);
        assert_eq!(
            ask(Some(StrategyKind::Diloco), None).resolve(),
            Strategy::Diloco {
                every: DEFAULT_EVERY,
                outer_lr: 0.7,
                outer_momentum: 0.9,
                int8: false,
                overlap: 0,
            }
        );
        let saved = Strategy::Diloco {
            every: 20,
            outer_lr: 0.5,
            outer_momentum: 0.8,
            int8: true,
            overlap: 0,
        };
        // Left out on resume: the checkpoint's; given: the request's.
        assert_eq!(StrategyRequest::default().resolve_over(&saved), saved);
        assert_eq!(
            ask(None, Some(8)).resolve_over(&saved),
            Strategy::Diloco {
                every: 8,
                outer_lr: 0.5,
                outer_momentum: 0.8,
                int8: true,
                overlap: 0,
            }
        );
        // int8 deltas carry over to the other local strategy, and not to all-reduce.
        assert_eq!(
            ask(Some(StrategyKind::LocalSgd), None).resolve_over(&saved),
            Strategy::LocalSgd {
                every: 20,
                int8: true,
                overlap: 0,
            }
        );
        assert_eq!(
            ask(Some(StrategyKind::AllReduce), None).resolve_over(&saved),
            Strategy::AllReduce
        );
    }

    #[test]
    fn parameter_servers_resolve_and_resume_with_their_settings() {
        let ps = |kind, servers, staleness| StrategyRequest {
            kind,
            servers,
            staleness,
            ..StrategyRequest::default()
        };
        assert_eq!(
            ps(Some(StrategyKind::PsAsync), None, None).resolve(),
            Strategy::PsAsync {
                servers: DEFAULT_SERVERS,
                staleness: DEFAULT_STALENESS
            }
        );
        let saved = Strategy::PsAsync {
            servers: 2,
            staleness: 5,
        };
        assert_eq!(StrategyRequest::default().resolve_over(&saved), saved);
        assert_eq!(
            ps(None, None, Some(1)).resolve_over(&saved),
            Strategy::PsAsync {
                servers: 2,
                staleness: 1
            }
        );
        assert_eq!(saved.servers(), Some(2));
        assert!(!saved.is_local() && !saved.is_all_reduce());
        assert!(
            ps(Some(StrategyKind::PsSync), Some(0), None)
                .check()
                .is_err()
        );
        assert!(
            ps(Some(StrategyKind::PsSync), None, Some(1))
                .check()
                .is_err()
        );
        assert!(
            ps(Some(StrategyKind::Diloco), Some(1), None)
                .check()
                .is_err()
        );
        assert!(check_servers(2, 2).is_err() && check_servers(1, 2).is_ok());
        let r = |v, s: Vec<u64>| bonfire::PsReport {
            versions: v,
            staleness: s,
            ..bonfire::PsReport::default()
        };
        let total = merge_served(Some(r(3, vec![1, 2])), r(4, vec![0, 1, 3]));
        assert_eq!((total.versions, total.staleness), (7, vec![1, 3, 3]));
    }

    #[test]
    fn overlapped_meetings_resolve_resume_and_are_refused_where_they_do_not_fit() {
        let overlap = |kind, every, d| StrategyRequest {
            kind,
            every,
            overlap: Some(d),
            ..StrategyRequest::default()
        };
        let fresh = overlap(Some(StrategyKind::Diloco), Some(10), 4);
        assert!(fresh.check().is_ok());
        let saved = fresh.resolve();
        assert!(saved.check_overlap().is_ok());
        assert_eq!(saved.overlap_steps(), 4);
        assert!(
            saved
                .describe()
                .ends_with(", each meeting behind the next 4 step(s)")
        );
        // Left out on resume: the checkpoint's; carried to the other local strategy.
        assert_eq!(StrategyRequest::default().resolve_over(&saved), saved);
        assert_eq!(
            ask(Some(StrategyKind::LocalSgd), None)
                .resolve_over(&saved)
                .overlap_steps(),
            4
        );
        let text = serde_json::to_string(&saved).unwrap();
        assert!(text.contains(r#""overlap":4"#), "{text}");
        assert_eq!(serde_json::from_str::<Strategy>(&text).unwrap(), saved);
        // Not behind a whole window (as given, or as a resume resolves it over the saved H),
        // nor under the strategies that do not meet.
        let late = overlap(Some(StrategyKind::LocalSgd), Some(10), 10)
            .resolve()
            .check_overlap();
        assert!(
            matches!(
                late,
                Err(JobError::Invalid {
                    flag: "--overlap-steps",
                    ..
                })
            ),
            "{late:?}"
        );
        assert!(
            overlap(Some(StrategyKind::LocalSgd), None, DEFAULT_EVERY)
                .resolve()
                .check_overlap()
                .is_err()
        );
        let long = overlap(Some(StrategyKind::LocalSgd), Some(100), 60).resolve();
        assert!(
            overlap(None, None, 60)
                .resolve_over(&long)
                .check_overlap()
                .is_ok(),
            "a resume that repeats the saved overlap is checked against the saved H"
        );
        assert!(
            overlap(Some(StrategyKind::AllReduce), None, 0)
                .check()
                .is_ok()
        );
        assert!(
            overlap(Some(StrategyKind::AllReduce), None, 1)
                .check()
                .is_err()
        );
        assert!(overlap(None, None, 1).fits(StrategyKind::PsSync).is_err());
    }

    #[test]
    fn flags_that_do_not_go_with_the_strategy_are_refused() {
        assert!(
            ask(None, Some(5)).check().is_ok(),
            "checked against the default later"
        );
        assert!(ask(None, Some(5)).fits(StrategyKind::AllReduce).is_err());
        assert!(ask(Some(StrategyKind::LocalSgd), Some(0)).check().is_err());
        let lr = |v| StrategyRequest {
            kind: Some(StrategyKind::Diloco),
            outer_lr: Some(v),
            ..StrategyRequest::default()
        };
        assert!(lr(0.5).check().is_ok());
        assert!(lr(1e-50).check().is_err(), "0 as f32");
        assert!(lr(1e39).check().is_err(), "infinite as f32");
        let momentum = StrategyRequest {
            kind: Some(StrategyKind::LocalSgd),
            outer_momentum: Some(0.5),
            ..StrategyRequest::default()
        };
        assert!(
            momentum.check().is_err(),
            "local SGD has no outer optimizer"
        );
    }

    #[test]
    fn a_config_saved_before_strategies_trains_with_allreduce() {
        #[derive(Deserialize)]
        struct Saved {
            #[serde(default)]
            strategy: Strategy,
        }
        let old: Saved = serde_json::from_str("{}").unwrap();
        assert_eq!(old.strategy, Strategy::AllReduce);
        // A run saved before int8 deltas existed.
        let old: Saved =
            serde_json::from_str(r#"{"strategy": {"kind": "local-sgd", "every": 3}}"#).unwrap();
        assert_eq!(
            old.strategy,
            Strategy::LocalSgd {
                every: 3,
                int8: false,
                overlap: 0,
            }
        );
        for s in [
            Strategy::AllReduce,
            Strategy::LocalSgd {
                every: 3,
                int8: false,
                overlap: 0,
            },
            Strategy::LocalSgd {
                every: 3,
                int8: true,
                overlap: 0,
            },
            Strategy::Diloco {
                every: 4,
                outer_lr: 0.7,
                outer_momentum: 0.9,
                int8: false,
                overlap: 0,
            },
            Strategy::PsSync { servers: 2 },
            Strategy::PsAsync {
                servers: 1,
                staleness: 3,
            },
        ] {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(
                serde_json::from_str::<Strategy>(&json).unwrap(),
                s,
                "{json}"
            );
        }
        assert_eq!(
            serde_json::to_string(&Strategy::AllReduce).unwrap(),
            r#"{"kind":"allreduce"}"#
        );
    }
}
