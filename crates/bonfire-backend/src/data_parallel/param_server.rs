//! Parameter servers: the data-parallel group's ranks split into workers, which compute
//! gradients, and servers, which own the parameters and the optimizer state.
//!
//! [`ParamServer`] wraps any Burn optimizer. The last `servers` ranks of the group are servers,
//! the others workers. The trained parameters are dealt to the servers by bytes (largest first,
//! each to the server holding the fewest bytes so far; a parameter is never split), so each
//! server keeps the optimizer state of its share only. Every step each worker *pushes* its own
//! gradients (no all-reduce: the wrapper keeps the parameters free of `DataParallel`'s averaging
//! marks) to the servers that own them and *pulls* the parameters back:
//!
//! - **synchronous** ([`param_server`]): a server waits for every worker's push, steps the
//!   wrapped optimizer once on the mean gradient and sends every worker the same parameters.
//!   The result is data parallelism's, within rounding: the mean is summed on the server in
//!   worker order instead of by the all-reduce.
//! - **asynchronous** ([`ParamServer::asynchronous`]): a server steps on each push as it arrives,
//!   on that worker's gradient alone, and answers that worker with the parameters as they are
//!   then. A worker's gradient may be *stale*: computed on parameters that other pushes have
//!   since moved. The staleness bound `s` is the stale-synchronous one: a worker that has pushed
//!   `c` times gets its answer only once every other worker still training has pushed at least
//!   `c - s` times. A worker that stops answering (it died, or waited past the communicator's
//!   timeout) is dropped and the others go on; the server's [`PsReport`] names it.
//!
//! ```ignore
//! let model = bonfire::broadcast_parameters(model);           // every rank, servers too
//! let mut optim = bonfire::param_server(AdamConfig::new().init(), 1);
//! match optim.role(&device) {
//!     PsRole::Server { .. } => { let (_, report) = optim.serve(model); }
//!     PsRole::Worker { index, workers } => {
//!         for batch in my_shard(index, workers) {
//!             let grads = GradientsParams::from_grads(loss(&model, batch).backward(), &model);
//!             model = optim.step(lr, model, grads);             // push, then pull
//!         }
//!         model = optim.finish(model);                          // the servers' final parameters
//!     }
//! }
//! ```

use std::time::{Duration, Instant};

use bonfire_collectives::{CollectiveError, Communicator, Work};
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::context::{self, Replica};
use super::error::SyncError;
use super::local;

/// How servers apply the workers' pushes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PsMode {
    /// Every step waits for every worker; one optimizer step on the mean gradient.
    Sync,
    /// Each push applied as it arrives; a worker's answer waits while it is more than
    /// `staleness` pushes ahead of the slowest worker still training.
    Async {
        /// The stale-synchronous bound, in pushes (0: every worker pushes step `c` before any
        /// gets its answer to it, but each push is still its own optimizer step).
        staleness: u64,
    },
}

/// A rank's part in a parameter-server job ([`ParamServer::role`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PsRole {
    /// Computes gradients on its shard of the data: `index` of `workers`.
    Worker {
        /// Its index among the workers (the group's rank).
        index: usize,
        /// Workers in the group.
        workers: usize,
    },
    /// Owns a share of the parameters and their optimizer state: `index` of `servers`.
    Server {
        /// Its index among the servers (group rank minus the workers).
        index: usize,
        /// Servers in the group.
        servers: usize,
    },
}

/// What one rank of a parameter-server job sent and received.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PsStats {
    /// Pushes: sent by a worker (one per step), or applied by a server.
    pub pushes: u64,
    /// Bytes this rank sent (a worker's gradients, a server's parameters), headers included.
    pub bytes_sent: u64,
    /// Bytes this rank received.
    pub bytes_received: u64,
    /// A worker: time from its push to the last parameters pulled. A server: time serving.
    pub time: Duration,
    /// A worker: bytes of one push to all servers (gradients and headers).
    pub push_bytes: u64,
    /// A worker: bytes of one pull from all servers (parameters and headers).
    pub pull_bytes: u64,
    /// A worker: rounds finished (each sends every server a push-sized "done" frame and pulls
    /// the final parameters, counted in the bytes above).
    pub rounds: u64,
}

/// A worker a server stopped waiting for.
#[derive(Clone, Debug, PartialEq)]
pub struct Departure {
    /// The worker's index.
    pub worker: usize,
    /// Pushes the server had applied from it.
    pub pushes: u64,
    /// Why: the collective's error, which names the rank and the wait.
    pub reason: String,
}

/// What a server saw ([`ParamServer::serve`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PsReport {
    /// This server's index.
    pub server: usize,
    /// Optimizer steps taken (one per step when synchronous, one per push when not).
    pub versions: u64,
    /// Staleness histogram: entry `k` counts the pushes computed on parameters that `k` earlier
    /// steps of this server had since moved (all at 0 when synchronous).
    pub staleness: Vec<u64>,
    /// The largest lead, in pushes, of a worker over the slowest worker still training when it
    /// got its answer (at most the staleness bound).
    pub max_lead: u64,
    /// Answers the staleness bound held back (a worker waiting for the slowest).
    pub held: u64,
    /// Workers that said they were done, in the order they did.
    pub finished: Vec<usize>,
    /// Workers that stopped answering, dropped while the others went on (asynchronous only;
    /// a synchronous server fails instead).
    pub departed: Vec<Departure>,
    /// Elements of the parameters this server owns.
    pub elements: usize,
    /// Parameters (tensors) this server owns.
    pub params: usize,
    /// Traffic.
    pub stats: PsStats,
}

impl PsReport {
    /// The report's one-line summary.
    pub fn line(&self) -> String {
        let pushes: u64 = self.staleness.iter().sum();
        let mean = if pushes == 0 {
            0.0
        } else {
            self.staleness
                .iter()
                .enumerate()
                .map(|(k, n)| k as f64 * *n as f64)
                .sum::<f64>()
                / pushes as f64
        };
        let departed = if self.departed.is_empty() {
            String::new()
        } else {
            let who: Vec<String> = self
                .departed
                .iter()
                .map(|d| format!("worker {} after {} pushes", d.worker, d.pushes))
                .collect();
            format!("; dropped {}", who.join(", "))
        };
        format!(
            "server {}: {} parameters ({} elements), {} steps from {pushes} pushes, staleness \
             mean {mean:.2} max {} (histogram {:?}), largest lead {}, {} answers held{departed}",
            self.server,
            self.params,
            self.elements,
            self.versions,
            self.staleness.len().saturating_sub(1),
            self.staleness,
            self.max_lead,
            self.held
        )
    }
}

/// Wraps `optimizer` for synchronous parameter servers: the last `servers` ranks of the
/// data-parallel group serve, the others train. See [`ParamServer`].
pub fn param_server<O>(optimizer: O, servers: usize) -> ParamServer<O> {
    ParamServer {
        inner: optimizer,
        servers: servers.max(1),
        mode: PsMode::Sync,
        plan: None,
        clock: 0,
        versions: Vec::new(),
        checked: false,
        gone: Vec::new(),
        departed: Vec::new(),
        stats: PsStats::default(),
    }
}

/// A Burn optimizer run by parameter servers: on a worker, [`Optimizer::step`] pushes the
/// gradients and pulls the parameters; on a server, [`ParamServer::serve`] steps the wrapped
/// optimizer on them until every worker is done. See the module documentation of
/// `param_server` and the book's "Choosing a strategy".
///
/// Every worker must start from the servers' parameters ([`crate::broadcast_parameters`] on
/// every rank, or the same seed); the first push checks, and names a worker that does not.
/// Do not [`crate::replicate`] the model: a backward of marked parameters would all-reduce over
/// the servers too, which never run one.
///
/// The record of a server ([`Optimizer::to_record`]) is the wrapped optimizer's state of the
/// parameters it owns; a worker's is empty.
#[derive(Clone)]
pub struct ParamServer<O> {
    inner: O,
    servers: usize,
    mode: PsMode,
    plan: Option<Plan>,
    /// A worker: pushes sent. A server: its version (optimizer steps taken).
    clock: u64,
    /// A worker: the version of each server's parameters it last pulled.
    versions: Vec<u64>,
    /// A worker: whether its first push carried its parameters' digest already.
    checked: bool,
    /// An asynchronous server: the workers it dropped (not waited for in later rounds).
    gone: Vec<bool>,
    /// The workers the servers had dropped when the last round ended, as its final frames said.
    departed: Vec<usize>,
    stats: PsStats,
}

impl<O> ParamServer<O> {
    /// Asynchronous servers with stale-synchronous bound `staleness` (pushes).
    pub fn asynchronous(self, staleness: u64) -> Self {
        ParamServer {
            mode: PsMode::Async { staleness },
            ..self
        }
    }

    /// How the servers apply pushes.
    pub fn mode(&self) -> PsMode {
        self.mode
    }

    /// Servers in the group.
    pub fn servers(&self) -> usize {
        self.servers
    }

    /// What this rank sent and received so far.
    pub fn stats(&self) -> PsStats {
        self.stats
    }

    /// The workers (indices, ascending) the servers had dropped by the end of the last round
    /// ([`ParamServer::serve`] on a server, [`ParamServer::finish`] on a worker): the union of
    /// every server's, sent with the final parameters and between the servers, so every rank that
    /// ended the round holds the same list. Empty before the first round ends, and always under
    /// synchronous servers (which fail instead of dropping). The ranks left can go on together
    /// without them, for instance in [`Communicator::subgroup`] of every other rank.
    pub fn departed(&self) -> &[usize] {
        &self.departed
    }

    /// The wrapped optimizer (on a server, its state for the parameters it owns).
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The role of the rank that trains on `device`: the last [`ParamServer::servers`] ranks
    /// of its data-parallel group serve. Fails the rank when the group has no worker left.
    pub fn role<D: burn_backend::DeviceOps>(&self, device: &D) -> PsRole {
        role(&context::for_device(device), self.servers)
    }

    /// A worker's last call of a round: tells every server that this worker is done, and
    /// returns `module` with the parameters the servers hold once every worker is done (or,
    /// asynchronous, gone): the same on every worker that finished, the model to evaluate or
    /// save. A synchronous server's [`ParamServer::serve`] returns once every worker finished;
    /// call `serve` and `finish` again for another round.
    pub fn finish<M, B>(&mut self, module: M) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let t0 = Instant::now();
        let rep = replica_of(&module);
        if let PsRole::Server { index, .. } = role(&rep, self.servers) {
            rep.fail(SyncError::ParamServer {
                what: format!(
                    "finish() called on server {index} (rank {}): servers call serve(), only \
                     workers finish",
                    rep.comm.rank()
                ),
                source: None,
            });
        }
        let workers = worker_count(&rep, self.servers);
        let plan = self.plan_for(&module, &rep);
        let pull = self.pull_comm(&rep);
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for s in 0..self.servers {
            let mut frame = vec![0.0f32; plan.push_len(s)];
            put_word(&mut frame, KIND, DONE);
            put_u64(&mut frame, CLOCK, self.clock);
            self.stats.bytes_sent += 4 * frame.len() as u64;
            sends.push(rep.comm.send(frame, workers + s));
            // A final frame ends with its server's dropped workers, a word each.
            recvs.push(pull.recv(vec![0.0f32; plan.pull_len(s) + workers], workers + s));
        }
        let what = |s: usize, dir: &str| {
            format!(
                "worker {} {dir} server {s} (rank {}) after {} pushes",
                rep.comm.rank(),
                workers + s,
                self.clock
            )
        };
        for (s, work) in sends.into_iter().enumerate() {
            if let Err(source) = work.wait() {
                rep.fail(SyncError::ParamServer {
                    what: what(s, "telling it is done:"),
                    source: Some(source),
                });
            }
        }
        let mut pulled = Vec::with_capacity(self.servers);
        for (s, work) in recvs.into_iter().enumerate() {
            match work.wait() {
                Ok(frame) => {
                    self.stats.bytes_received += 4 * frame.len() as u64;
                    self.versions[s] = get_u64(&frame, 0);
                    pulled.push(frame);
                }
                Err(source) => rep.fail(SyncError::ParamServer {
                    what: what(s, "pulling the final parameters from"),
                    source: Some(source),
                }),
            }
        }
        self.departed = (0..workers)
            .filter(|&w| pulled.iter().any(|f| f[f.len() - workers + w] != 0.0))
            .collect();
        let module = module.map(&mut Writer {
            plan: &plan,
            frames: &pulled,
            at: 0,
            offsets: vec![0; self.servers],
        });
        self.stats.rounds += 1;
        self.stats.time += t0.elapsed();
        module
    }

    /// The parameters this rank serves (none on a worker), by the plan for `module`.
    pub fn owned<M, B>(&mut self, module: &M) -> Vec<ParamId>
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let rep = replica_of(module);
        let plan = self.plan_for(module, &rep);
        match role(&rep, self.servers) {
            PsRole::Worker { .. } => Vec::new(),
            PsRole::Server { index, .. } => plan
                .params
                .iter()
                .zip(&plan.owner)
                .filter(|(_, o)| **o == index)
                .map(|((id, _), _)| *id)
                .collect(),
        }
    }

    /// The handle a worker pulls through: an asynchronous answer may wait for the slowest
    /// worker, or for its server to give up on a worker that died (one timeout), so it waits
    /// twice as long before giving up.
    fn pull_comm(&mut self, rep: &Replica) -> Communicator {
        if self.versions.len() != self.servers {
            self.versions = vec![0; self.servers];
        }
        match self.mode {
            PsMode::Sync => rep.comm.clone(),
            PsMode::Async { .. } => rep.comm.with_timeout(2 * rep.comm.config().timeout),
        }
    }

    /// The plan for `module` (made on first use; the same on every rank of the same model).
    fn plan_for<M, B>(&mut self, module: &M, rep: &Replica) -> Plan
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        if let Some(plan) = &self.plan {
            return plan.clone();
        }
        let mut lister = Lister::<B>::default();
        module.visit(&mut lister);
        let plan = Plan::new(lister.params, self.servers);
        if plan.params.is_empty() {
            rep.fail(SyncError::ParamServer {
                what: "the model has no trained parameters to serve".into(),
                source: None,
            });
        }
        self.plan = Some(plan.clone());
        plan
    }

    /// A worker's step: pushes `grads`, pulls the parameters, writes them into `module`.
    fn exchange<M, B>(&mut self, lr: LearningRate, module: M, grads: &GradientsParams) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let t0 = Instant::now();
        let rep = replica_of(&module);
        let servers = self.servers;
        let workers = match role(&rep, servers) {
            PsRole::Worker { workers, .. } => workers,
            PsRole::Server { index, .. } => rep.fail(SyncError::ParamServer {
                what: format!(
                    "optimizer step called on server {index} (rank {}): servers call serve(), \
                     only workers step",
                    rep.comm.rank()
                ),
                source: None,
            }),
        };
        let plan = self.plan_for(&module, &rep);
        let pull = self.pull_comm(&rep);
        let mut reader = GradReader::<B> {
            rep: &rep,
            grads,
            plan: &plan,
            at: 0,
            frames: (0..servers)
                .map(|s| {
                    let mut f = Vec::with_capacity(plan.push_len(s));
                    f.resize(plan.head_len(s), 0.0);
                    f
                })
                .collect(),
            present: vec![0; servers],
            _b: std::marker::PhantomData,
        };
        module.visit(&mut reader);
        let mut frames = reader.frames;
        let check = !self.checked;
        let digests = check.then(|| shard_digests(&plan, &read_values(&module, &rep, &plan)));
        for (s, frame) in frames.iter_mut().enumerate() {
            put_word(frame, KIND, PUSH);
            put_u64(frame, CLOCK, self.clock + 1);
            put_u64(frame, BASE, self.versions[s]);
            put_u64(frame, LR, lr.to_bits());
            if let Some(d) = &digests {
                put_word(frame, CHECK, 1);
                put_u64(frame, DIGEST, d[s]);
            }
        }
        let mut sends = Vec::with_capacity(servers);
        let mut recvs = Vec::with_capacity(servers);
        self.stats.push_bytes = frames.iter().map(|f| 4 * f.len() as u64).sum();
        self.stats.pull_bytes = (0..servers).map(|s| 4 * plan.pull_len(s) as u64).sum();
        for (s, frame) in frames.into_iter().enumerate() {
            self.stats.bytes_sent += 4 * frame.len() as u64;
            sends.push(rep.comm.send(frame, workers + s));
            recvs.push(pull.recv(vec![0.0f32; plan.pull_len(s)], workers + s));
        }
        let what = |s: usize, dir: &str| {
            format!(
                "worker {} {dir} server {s} (rank {}) at push {} ({} gradient elements of {} \
                 parameters)",
                rep.comm.rank(),
                workers + s,
                self.clock + 1,
                plan.shard_len[s],
                plan.shard_params[s]
            )
        };
        for (s, work) in sends.into_iter().enumerate() {
            if let Err(source) = work.wait() {
                rep.fail(SyncError::ParamServer {
                    what: what(s, "pushing to"),
                    source: Some(source),
                });
            }
        }
        let mut pulled = Vec::with_capacity(servers);
        for (s, work) in recvs.into_iter().enumerate() {
            match work.wait() {
                Ok(frame) => {
                    self.stats.bytes_received += 4 * frame.len() as u64;
                    self.versions[s] = get_u64(&frame, 0);
                    pulled.push(frame);
                }
                Err(source) => rep.fail(SyncError::ParamServer {
                    what: what(s, "pulling from"),
                    source: Some(source),
                }),
            }
        }
        self.checked = true;
        self.clock += 1;
        self.stats.pushes += 1;
        let module = module.map(&mut Writer {
            plan: &plan,
            frames: &pulled,
            at: 0,
            offsets: vec![0; servers],
        });
        self.stats.time += t0.elapsed();
        module
    }
}

impl<O> ParamServer<O> {
    /// A server's loop: takes the workers' pushes and steps the wrapped optimizer on them until
    /// every worker is done (or, asynchronous, gone). Returns the module with the parameters
    /// this server owns as trained (the others as they started) and what the server saw.
    ///
    /// A synchronous server fails the rank when a worker fails, stops early, or pushes another
    /// step or learning rate than the others; an asynchronous one drops the worker and goes on.
    pub fn serve<M, B>(&mut self, module: M) -> (M, PsReport)
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
        O: Optimizer<M, B>,
    {
        let t0 = Instant::now();
        let rep = replica_of(&module);
        let index = match role(&rep, self.servers) {
            PsRole::Server { index, .. } => index,
            PsRole::Worker { index, .. } => rep.fail(SyncError::ParamServer {
                what: format!(
                    "serve() called on worker {index}: the last {} ranks serve, the others step",
                    self.servers
                ),
                source: None,
            }),
        };
        let plan = self.plan_for(&module, &rep);
        let mut report = PsReport {
            server: index,
            elements: plan.shard_len[index],
            params: plan.shard_params[index],
            ..PsReport::default()
        };
        let start = self.clock;
        let digest = shard_digests(&plan, &read_values(&module, &rep, &plan))[index];
        let mut server = Server {
            rep: &rep,
            plan: &plan,
            index,
            workers: worker_count(&rep, self.servers),
            start,
            digest,
            report: &mut report,
            taken: Vec::new(),
            counted: Vec::new(),
        };
        let module = match self.mode {
            PsMode::Sync => server.run_sync(self, module),
            PsMode::Async { staleness } => server.run_async(self, module, staleness),
        };
        server.send_final(self, &module);
        report.versions = self.clock - start;
        self.stats.time += t0.elapsed();
        report.stats = self.stats;
        (module, report)
    }
}

impl<O, M, B> Optimizer<M, B> for ParamServer<O>
where
    O: Optimizer<M, B>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    type Record = O::Record;

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        self.exchange(lr, module, &grads)
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        // Gradients spread over devices: gathered per parameter on the module's device.
        let mut single = GradientsParams::new();
        let mut gather = Gather::<B> {
            from: grads,
            into: &mut single,
            _b: std::marker::PhantomData,
        };
        module.visit(&mut gather);
        self.exchange(lr, module, &single)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        ParamServer {
            inner: self.inner.load_record(record),
            ..self
        }
    }
}

// ---- frames -------------------------------------------------------------------------------
//
// Everything travels as f32 words (header words carry integers as bit patterns). A push to
// server s: KIND, CHECK, CLOCK (2 words), BASE (2), LR (2), DIGEST (2), one presence bit per
// parameter of the shard, then the shard's gradients in module order. A pull: the server's
// version (2 words), then the shard's parameters.

const KIND: usize = 0;
const CHECK: usize = 1;
const CLOCK: usize = 2;
const BASE: usize = 4;
const LR: usize = 6;
const DIGEST: usize = 8;
const HEAD: usize = 10;
const PULL_HEAD: usize = 2;
const PUSH: u32 = 1;
const DONE: u32 = 2;

fn put_word(frame: &mut [f32], at: usize, v: u32) {
    frame[at] = f32::from_bits(v);
}

fn word(frame: &[f32], at: usize) -> u32 {
    frame[at].to_bits()
}

fn put_u64(frame: &mut [f32], at: usize, v: u64) {
    put_word(frame, at, v as u32);
    put_word(frame, at + 1, (v >> 32) as u32);
}

fn get_u64(frame: &[f32], at: usize) -> u64 {
    u64::from(word(frame, at)) | (u64::from(word(frame, at + 1)) << 32)
}

/// Which server owns each trained parameter, and the shards' sizes.
#[derive(Clone, Debug)]
struct Plan {
    /// Trained parameters in module order: id and elements.
    params: Vec<(ParamId, usize)>,
    /// Each parameter's server.
    owner: Vec<usize>,
    /// Elements each server owns.
    shard_len: Vec<usize>,
    /// Parameters each server owns.
    shard_params: Vec<usize>,
}

impl Plan {
    /// Deals `params` to `servers` by bytes: largest first, each to the least loaded server
    /// (ties to the lower index), so every rank makes the same plan from the same model.
    fn new(params: Vec<(ParamId, usize)>, servers: usize) -> Plan {
        let mut order: Vec<usize> = (0..params.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(params[i].1));
        let mut owner = vec![0; params.len()];
        let mut shard_len = vec![0usize; servers];
        let mut shard_params = vec![0usize; servers];
        for i in order {
            let s = (0..servers)
                .min_by_key(|&s| shard_len[s])
                .expect("at least one server");
            owner[i] = s;
            shard_len[s] += params[i].1;
            shard_params[s] += 1;
        }
        Plan {
            params,
            owner,
            shard_len,
            shard_params,
        }
    }

    fn bitmap_len(&self, s: usize) -> usize {
        self.shard_params[s].div_ceil(32)
    }

    fn head_len(&self, s: usize) -> usize {
        HEAD + self.bitmap_len(s)
    }

    fn push_len(&self, s: usize) -> usize {
        self.head_len(s) + self.shard_len[s]
    }

    fn pull_len(&self, s: usize) -> usize {
        PULL_HEAD + self.shard_len[s]
    }
}

/// FNV-1a over each shard's parameter bits: the first push compares the worker's with the
/// server's.
fn shard_digests(plan: &Plan, values: &[Vec<f32>]) -> Vec<u64> {
    let mut d = vec![0xcbf2_9ce4_8422_2325u64; plan.shard_len.len()];
    for (i, v) in values.iter().enumerate() {
        let h = &mut d[plan.owner[i]];
        for x in v {
            *h = (*h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3);
        }
    }
    d
}

fn replica_of<M, B>(module: &M) -> std::sync::Arc<Replica>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    let device = module.devices().into_iter().next().unwrap_or_else(|| {
        panic!("bonfire::param_server: the model has no float parameters to serve")
    });
    context::for_device(&device)
}

fn worker_count(rep: &Replica, servers: usize) -> usize {
    rep.comm.size().saturating_sub(servers)
}

fn role(rep: &Replica, servers: usize) -> PsRole {
    let size = rep.comm.size();
    if servers >= size {
        rep.fail(SyncError::ParamServer {
            what: format!(
                "{servers} server(s) in a group of {size} ranks leaves no worker: servers must \
                 be fewer than the ranks"
            ),
            source: None,
        });
    }
    let workers = size - servers;
    let r = rep.comm.rank();
    if r < workers {
        PsRole::Worker { index: r, workers }
    } else {
        PsRole::Server {
            index: r - workers,
            servers,
        }
    }
}

/// Lists the trained float parameters (those that require gradients).
struct Lister<B> {
    params: Vec<(ParamId, usize)>,
    _b: std::marker::PhantomData<B>,
}

impl<B> Default for Lister<B> {
    fn default() -> Self {
        Lister {
            params: Vec::new(),
            _b: std::marker::PhantomData,
        }
    }
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Lister<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if t.is_require_grad() {
            self.params.push((param.id, local::param_len(&t)));
        }
    }
}

/// Each trained parameter's values, in module order.
fn read_values<M, B>(module: &M, rep: &std::sync::Arc<Replica>, plan: &Plan) -> Vec<Vec<f32>>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    let mut r = ValueReader::<B> {
        rep: rep.clone(),
        values: Vec::with_capacity(plan.params.len()),
        _b: std::marker::PhantomData,
    };
    module.visit(&mut r);
    r.values
}

struct ValueReader<B> {
    rep: std::sync::Arc<Replica>,
    values: Vec<Vec<f32>>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ValueReader<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if t.is_require_grad() {
            self.values
                .push(local::param_values(&self.rep, param.id, t));
        }
    }
}

/// Appends each trained parameter's gradient to its server's push frame.
struct GradReader<'a, B> {
    rep: &'a Replica,
    grads: &'a GradientsParams,
    plan: &'a Plan,
    /// Index of the next trained parameter.
    at: usize,
    frames: Vec<Vec<f32>>,
    /// Parameters of each shard seen so far.
    present: Vec<usize>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradReader<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if !t.is_require_grad() {
            return;
        }
        let i = self.at;
        self.at += 1;
        let Some(&(id, len)) = self.plan.params.get(i) else {
            self.rep.fail(SyncError::ParamServer {
                what: format!(
                    "the model has more than the {} trained parameters it had at the first step: \
                     the model changed",
                    self.plan.params.len()
                ),
                source: None,
            });
        };
        if id != param.id {
            self.rep.fail(SyncError::ParamServer {
                what: format!(
                    "parameter {i} of the model is {} where the first step had {id}: the \
                     model changed",
                    param.id
                ),
                source: None,
            });
        }
        let s = self.plan.owner[i];
        let slot = self.present[s];
        self.present[s] += 1;
        let frame = &mut self.frames[s];
        match self.grads.get::<B::InnerBackend, D>(id) {
            Some(g) => {
                let data = local::read::<B::InnerBackend>(g.into_primitive().tensor())
                    .unwrap_or_else(|e| {
                        self.rep.fail(SyncError::Read {
                            what: format!("the gradient of parameter {id}"),
                            reason: e.to_string(),
                        })
                    });
                let values = data.convert::<f32>().into_vec::<f32>().unwrap_or_else(|e| {
                    self.rep.fail(SyncError::Read {
                        what: format!("the gradient of parameter {id} as f32"),
                        reason: format!("{e:?}"),
                    })
                });
                if values.len() != len {
                    self.rep.fail(SyncError::SizeChanged {
                        param: format!("the gradient of parameter {id}"),
                        from: len,
                        to: values.len(),
                    });
                }
                let bit = HEAD + slot / 32;
                let w = word(frame, bit) | (1 << (slot % 32));
                put_word(frame, bit, w);
                frame.extend_from_slice(&values);
            }
            None => frame.resize(frame.len() + len, 0.0),
        }
    }
}

/// Writes the pulled parameters into the module's trained parameters, unmarked.
struct Writer<'a> {
    plan: &'a Plan,
    frames: &'a [Vec<f32>],
    at: usize,
    /// Elements of each pulled frame used so far.
    offsets: Vec<usize>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Writer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let i = self.at;
        self.at += 1;
        let (_, len) = self.plan.params[i];
        let s = self.plan.owner[i];
        let from = PULL_HEAD + self.offsets[s];
        self.offsets[s] += len;
        let fresh = local::with_values(tensor, &self.frames[s][from..from + len], id, false);
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Builds a server's gradients: the mean (or one worker's) gradient of each owned parameter
/// that had one, on the parameter's device.
struct GradWriter<'a, B> {
    plan: &'a Plan,
    index: usize,
    /// The owned parameters' gradients, in module order (`None`: no worker had one).
    values: &'a [Option<Vec<f32>>],
    at: usize,
    owned: usize,
    grads: GradientsParams,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradWriter<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if !t.is_require_grad() {
            return;
        }
        let i = self.at;
        self.at += 1;
        if self.plan.owner[i] != self.index {
            return;
        }
        let k = self.owned;
        self.owned += 1;
        let Some(values) = &self.values[k] else {
            return;
        };
        let inner = t.inner().into_primitive().tensor();
        let shape = local::shape::<B::InnerBackend>(&inner);
        let dtype = burn_backend::TensorMetadata::dtype(&inner);
        let data = TensorData::new(values.clone(), shape).convert_dtype(dtype);
        let placed = local::write::<B::InnerBackend>(
            Some(&inner),
            data,
            &param.val().device(),
            Some(param.id.val()),
        );
        let grad: Tensor<B::InnerBackend, D> =
            Tensor::from_primitive(TensorPrimitive::Float(placed));
        self.grads.register::<B::InnerBackend, D>(param.id, grad);
    }
}

/// Gathers a multi-device step's gradients onto each parameter's device.
struct Gather<'a, B> {
    from: MultiGradientsParams,
    into: &'a mut GradientsParams,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some((g, _)) = self.from.remove::<B::InnerBackend, D>(param.id) {
            let device = param.val().device();
            self.into
                .register::<B::InnerBackend, D>(param.id, g.to_device(&device));
        }
    }
}

// ---- the server ---------------------------------------------------------------------------

/// One push as the server reads it.
struct Push {
    done: bool,
    clock: u64,
    base: u64,
    lr: f64,
    digest: Option<u64>,
    /// Each owned parameter's gradient (module order), `None` where the worker had none.
    grads: Vec<Option<Vec<f32>>>,
}

impl Push {
    fn parse(frame: &[f32], plan: &Plan, s: usize) -> Push {
        let done = word(frame, KIND) == DONE;
        let mut grads = Vec::with_capacity(plan.shard_params[s]);
        if !done {
            let mut at = plan.head_len(s);
            let mut slot = 0;
            for (i, &(_, len)) in plan.params.iter().enumerate() {
                if plan.owner[i] != s {
                    continue;
                }
                let present = word(frame, HEAD + slot / 32) & (1 << (slot % 32)) != 0;
                grads.push(present.then(|| frame[at..at + len].to_vec()));
                at += len;
                slot += 1;
            }
        }
        Push {
            done,
            clock: get_u64(frame, CLOCK),
            base: get_u64(frame, BASE),
            lr: f64::from_bits(get_u64(frame, LR)),
            digest: (word(frame, CHECK) == 1).then(|| get_u64(frame, DIGEST)),
            grads,
        }
    }
}

struct Server<'a> {
    rep: &'a Replica,
    plan: &'a Plan,
    index: usize,
    workers: usize,
    /// The version serve() began at, and the digest of this shard then.
    start: u64,
    digest: u64,
    report: &'a mut PsReport,
    /// Pushes taken from each worker this round (asynchronous).
    taken: Vec<u64>,
    /// The workers whose answers are held now (each hold counted once in the report).
    counted: Vec<usize>,
}

impl Server<'_> {
    fn rank(&self) -> usize {
        self.workers + self.index
    }

    fn fail(&self, what: String, source: Option<CollectiveError>) -> ! {
        self.rep.fail(SyncError::ParamServer { what, source })
    }

    /// A worker's first push must be computed on this server's parameters.
    fn check_start(&self, worker: usize, push: &Push) {
        if let Some(d) = push.digest
            && push.base == self.start
            && d != self.digest
        {
            self.fail(
                format!(
                    "worker {worker} starts from other parameters than server {} (rank {}) \
                     holds for its {} parameters ({} elements). Build every rank's model from \
                     the same seed or checkpoint, or call bonfire::broadcast_parameters(model) \
                     on every rank",
                    self.index,
                    self.rank(),
                    self.plan.shard_params[self.index],
                    self.plan.shard_len[self.index]
                ),
                None,
            );
        }
    }

    /// Steps the optimizer on `grads` (owned parameters, module order) at `lr`.
    fn apply<O, M, B>(
        &self,
        optim: &mut ParamServer<O>,
        module: M,
        lr: f64,
        grads: &[Option<Vec<f32>>],
    ) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
        O: Optimizer<M, B>,
    {
        let mut writer = GradWriter::<B> {
            plan: self.plan,
            index: self.index,
            values: grads,
            at: 0,
            owned: 0,
            grads: GradientsParams::new(),
            _b: std::marker::PhantomData,
        };
        module.visit(&mut writer);
        let grads = writer.grads;
        let module = optim.inner.step(lr, module, grads);
        optim.clock += 1;
        optim.stats.pushes += 1;
        // Burn's optimizers mark what they step for averaging; a server averages nothing.
        module.map(&mut super::outer::Unmark)
    }

    /// The pull frame: this server's version and its parameters.
    fn pull_frame<M, B>(&self, module: &M, version: u64) -> Vec<f32>
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let mut frame = Vec::with_capacity(self.plan.pull_len(self.index));
        frame.resize(PULL_HEAD, 0.0);
        put_u64(&mut frame, 0, version);
        let mut r = OwnedReader::<B> {
            rep: self.rep,
            plan: self.plan,
            index: self.index,
            at: 0,
            out: &mut frame,
            _b: std::marker::PhantomData,
        };
        module.visit(&mut r);
        frame
    }

    fn run_sync<O, M, B>(&mut self, optim: &mut ParamServer<O>, mut module: M) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
        O: Optimizer<M, B>,
    {
        let s = self.index;
        let len = self.plan.push_len(s);
        loop {
            let recvs: Vec<Work<Vec<f32>>> = (0..self.workers)
                .map(|w| self.rep.comm.recv(vec![0.0f32; len], w))
                .collect();
            let mut pushes = Vec::with_capacity(self.workers);
            for (w, work) in recvs.into_iter().enumerate() {
                match work.wait() {
                    Ok(frame) => {
                        optim.stats.bytes_received += 4 * frame.len() as u64;
                        pushes.push(Push::parse(&frame, self.plan, s));
                    }
                    Err(source) => self.fail(
                        format!(
                            "server {s} (rank {}) waiting for worker {w}'s push of step {} \
                             ({} gradient elements)",
                            self.rank(),
                            optim.clock + 1,
                            self.plan.shard_len[s]
                        ),
                        Some(source),
                    ),
                }
            }
            let done: Vec<usize> = (0..self.workers).filter(|&w| pushes[w].done).collect();
            if done.len() == self.workers {
                self.report.finished = done;
                return module;
            }
            if !done.is_empty() {
                let clocks: Vec<u64> = pushes.iter().map(|p| p.clock).collect();
                self.fail(
                    format!(
                        "workers {done:?} finished while the others pushed another step \
                         (pushes per worker: {clocks:?}): under synchronous servers every worker \
                         must take the same number of steps"
                    ),
                    None,
                );
            }
            let first = &pushes[0];
            let odd: Vec<usize> = (0..self.workers)
                .filter(|&w| pushes[w].clock != first.clock || pushes[w].lr != first.lr)
                .collect();
            if !odd.is_empty() {
                let seen: Vec<(u64, f64)> = pushes.iter().map(|p| (p.clock, p.lr)).collect();
                self.fail(
                    format!(
                        "workers {odd:?} pushed another step or learning rate than worker 0 \
                         ((push, lr) per worker: {seen:?})"
                    ),
                    None,
                );
            }
            for (w, p) in pushes.iter().enumerate() {
                self.check_start(w, p);
            }
            let mean = self.mean(&pushes);
            let lr = pushes[0].lr;
            module = self.apply(optim, module, lr, &mean);
            *bucket(&mut self.report.staleness, 0) += self.workers as u64;
            let frame = self.pull_frame(&module, optim.clock);
            let sends: Vec<Work<Vec<f32>>> = (0..self.workers)
                .map(|w| {
                    optim.stats.bytes_sent += 4 * frame.len() as u64;
                    self.rep.comm.send(frame.clone(), w)
                })
                .collect();
            for (w, work) in sends.into_iter().enumerate() {
                if let Err(source) = work.wait() {
                    self.fail(
                        format!(
                            "server {s} (rank {}) answering worker {w}'s push of step {} ({} \
                             parameter elements)",
                            self.rank(),
                            optim.clock,
                            self.plan.shard_len[s]
                        ),
                        Some(source),
                    );
                }
            }
        }
    }

    /// Answers every worker that finished with the parameters as they end the round. A
    /// synchronous server fails when one cannot be answered; an asynchronous one counts it gone.
    fn send_final<O, M, B>(&mut self, optim: &mut ParamServer<O>, module: &M)
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let mut frame = self.pull_frame(module, optim.clock);
        // The workers dropped so far, a word each after the parameters: every worker that
        // finishes learns them, and the servers tell each other below.
        let gone: Vec<f32> = (0..self.workers)
            .map(|w| f32::from(u8::from(optim.gone.get(w).copied().unwrap_or(false))))
            .collect();
        frame.extend_from_slice(&gone);
        let sends: Vec<(usize, Work<Vec<f32>>)> = self
            .report
            .finished
            .iter()
            .map(|&w| {
                optim.stats.bytes_sent += 4 * frame.len() as u64;
                (w, self.rep.comm.send(frame.clone(), w))
            })
            .collect();
        for (w, work) in sends {
            if let Err(source) = work.wait() {
                match optim.mode {
                    PsMode::Sync => self.fail(
                        format!(
                            "server {} (rank {}) sending worker {w} the final parameters ({} \
                             elements)",
                            self.index,
                            self.rank(),
                            self.plan.shard_len[self.index]
                        ),
                        Some(source),
                    ),
                    PsMode::Async { .. } => {
                        if let Some(g) = optim.gone.get_mut(w) {
                            *g = true;
                        }
                        self.report.finished.retain(|&f| f != w);
                        self.report.departed.push(Departure {
                            worker: w,
                            pushes: self.taken.get(w).copied().unwrap_or(0),
                            reason: format!("after it said it was done: {source}"),
                        });
                    }
                }
            }
        }
        self.agree_on_departed(optim, gone);
    }

    /// Tells the other servers which workers this one had dropped (`gone`, a word each) and
    /// takes the union of every server's as the round's [`ParamServer::departed`], the list the
    /// workers took from the final frames; a worker one server dropped is not waited for by any
    /// in later rounds.
    fn agree_on_departed<O>(&mut self, optim: &mut ParamServer<O>, gone: Vec<f32>) {
        let comm = &self.rep.comm;
        let others: Vec<usize> = (0..optim.servers).filter(|&t| t != self.index).collect();
        let sends: Vec<_> = others
            .iter()
            .map(|&t| comm.send(gone.clone(), self.workers + t))
            .collect();
        let recvs: Vec<_> = others
            .iter()
            .map(|&t| (t, comm.recv(vec![0.0f32; self.workers], self.workers + t)))
            .collect();
        let mut union: Vec<bool> = gone.iter().map(|&g| g != 0.0).collect();
        for work in sends {
            if let Err(source) = work.wait() {
                self.fail(
                    format!(
                        "server {} (rank {}) telling the other servers which workers it dropped",
                        self.index,
                        self.rank()
                    ),
                    Some(source),
                );
            }
        }
        for (t, work) in recvs {
            match work.wait() {
                Ok(theirs) => {
                    for (u, g) in union.iter_mut().zip(theirs) {
                        *u |= g != 0.0;
                    }
                }
                Err(source) => self.fail(
                    format!(
                        "server {} (rank {}) learning which workers server {t} dropped",
                        self.index,
                        self.rank()
                    ),
                    Some(source),
                ),
            }
        }
        optim.gone.resize(self.workers, false);
        for (g, &u) in optim.gone.iter_mut().zip(&union) {
            *g |= u;
        }
        optim.departed = (0..self.workers).filter(|&w| union[w]).collect();
    }

    /// The workers' mean gradient of each owned parameter, summed in worker order; every
    /// worker must have one for it, or none.
    fn mean(&self, pushes: &[Push]) -> Vec<Option<Vec<f32>>> {
        let scale = 1.0 / pushes.len() as f32;
        let owned = self.plan.shard_params[self.index];
        (0..owned)
            .map(|k| {
                let with = pushes.iter().filter(|p| p.grads[k].is_some()).count();
                if with == 0 {
                    return None;
                }
                if with != pushes.len() {
                    self.fail(
                        format!(
                            "parameter {k} of server {}'s share has a gradient on {with} of {} \
                             workers in this step: every worker must use every parameter it \
                             trains in every step",
                            self.index,
                            pushes.len()
                        ),
                        None,
                    );
                }
                let mut sum = pushes[0].grads[k].clone().expect("counted");
                for p in &pushes[1..] {
                    for (s, g) in sum.iter_mut().zip(p.grads[k].as_ref().expect("counted")) {
                        *s += g;
                    }
                }
                for s in &mut sum {
                    *s *= scale;
                }
                Some(sum)
            })
            .collect()
    }

    fn run_async<O, M, B>(&mut self, optim: &mut ParamServer<O>, mut module: M, bound: u64) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
        O: Optimizer<M, B>,
    {
        let s = self.index;
        let len = self.plan.push_len(s);
        let comm = self.rep.comm.clone();
        if optim.gone.len() != self.workers {
            optim.gone = vec![false; self.workers];
        }
        let mut a = Round {
            // Workers dropped in an earlier round are not waited for again.
            clocks: optim
                .gone
                .iter()
                .map(|&g| if g { None } else { Some(0) })
                .collect(),
            taken: vec![0; self.workers],
            posted: Vec::new(),
            held: Vec::new(),
            sending: Vec::new(),
        };
        // A worker's next push is awaited once its answer is sent, never while its answer is
        // held: a held worker cannot push, and its wait would time out while the server waits
        // for the slowest.
        for w in 0..self.workers {
            if a.clocks[w].is_some() {
                a.posted.push((w, comm.recv(vec![0.0f32; len], w)));
            }
        }
        while !a.posted.is_empty() || !a.held.is_empty() {
            if a.posted.is_empty() {
                // Every worker still training is held: cannot happen while the slowest one's
                // answer goes out at once, but never wait on nothing.
                self.release(optim, &module, &mut a, &comm, u64::MAX);
                continue;
            }
            let (ids, works): (Vec<usize>, Vec<Work<Vec<f32>>>) =
                std::mem::take(&mut a.posted).into_iter().unzip();
            let (result, i, rest) = futures::executor::block_on(futures::future::select_all(works));
            let mut ids = ids;
            let w = ids.swap_remove(i);
            a.posted = ids.into_iter().zip(rest).collect();
            match result {
                Ok(frame) => {
                    optim.stats.bytes_received += 4 * frame.len() as u64;
                    let push = Push::parse(&frame, self.plan, s);
                    if push.done {
                        a.clocks[w] = None;
                        self.report.finished.push(w);
                    } else {
                        self.check_start(w, &push);
                        let stale = optim.clock.saturating_sub(push.base);
                        *bucket(&mut self.report.staleness, stale as usize) += 1;
                        module = self.apply(optim, module, push.lr, &push.grads);
                        a.taken[w] += 1;
                        a.clocks[w] = Some(a.taken[w]);
                        a.held.push((w, a.taken[w]));
                    }
                }
                Err(e) => self.depart(optim, &mut a, w, e.to_string()),
            }
            self.release(optim, &module, &mut a, &comm, bound);
            // A failed answer drops its worker, which may free the others: release again.
            if self.reap(optim, &mut a, false) {
                self.release(optim, &module, &mut a, &comm, bound);
            }
        }
        self.reap(optim, &mut a, true);
        self.taken = a.taken;
        if self.report.finished.is_empty() {
            let why: Vec<String> = self
                .report
                .departed
                .iter()
                .map(|d| format!("worker {}: {}", d.worker, d.reason))
                .collect();
            self.fail(
                format!(
                    "every worker of server {s} (rank {}) is gone and none finished: {}",
                    self.rank(),
                    why.join("; ")
                ),
                None,
            );
        }
        module
    }

    /// Answers every held push the bound now allows, with the parameters as they are, and
    /// awaits those workers' next pushes.
    fn release<O, M, B>(
        &mut self,
        optim: &mut ParamServer<O>,
        module: &M,
        a: &mut Round,
        comm: &Communicator,
        bound: u64,
    ) where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let slowest = a.clocks.iter().flatten().min().copied();
        let (go, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut a.held)
            .into_iter()
            .partition(|&(_, c)| slowest.is_none_or(|m| c.saturating_sub(m) <= bound));
        a.held = wait;
        self.report.held += a
            .held
            .iter()
            .filter(|(w, _)| !self.counted.contains(w))
            .count() as u64;
        self.counted = a.held.iter().map(|(w, _)| *w).collect();
        if go.is_empty() {
            return;
        }
        let frame = self.pull_frame(module, optim.clock);
        let len = self.plan.push_len(self.index);
        for (w, c) in go {
            let lead = slowest.map_or(0, |m| c.saturating_sub(m));
            self.report.max_lead = self.report.max_lead.max(lead);
            optim.stats.bytes_sent += 4 * frame.len() as u64;
            a.sending.push((w, comm.send(frame.clone(), w)));
            a.posted.push((w, comm.recv(vec![0.0f32; len], w)));
        }
    }

    /// Drops worker `w` (its receive failed, or its answer) for this round and the next ones.
    fn depart<O>(&mut self, optim: &mut ParamServer<O>, a: &mut Round, w: usize, reason: String) {
        if a.clocks[w].is_none() {
            return;
        }
        a.clocks[w] = None;
        a.held.retain(|&(h, _)| h != w);
        // Its posted receive would fail too; stop waiting for it.
        a.posted.retain(|(p, _)| *p != w);
        optim.gone[w] = true;
        self.report.departed.push(Departure {
            worker: w,
            pushes: a.taken[w],
            reason,
        });
    }

    /// Collects the answers sent (all of them when `all`); a worker whose answer failed is
    /// gone. Returns whether one was.
    fn reap<O>(&mut self, optim: &mut ParamServer<O>, a: &mut Round, all: bool) -> bool {
        let mut dropped = false;
        let mut i = 0;
        while i < a.sending.len() {
            if !all && !a.sending[i].1.is_finished() {
                i += 1;
                continue;
            }
            let (w, work) = a.sending.swap_remove(i);
            if let Err(e) = work.wait()
                && a.clocks[w].is_some()
            {
                self.depart(optim, a, w, e.to_string());
                dropped = true;
            }
        }
        dropped
    }
}

/// An asynchronous round's bookkeeping.
struct Round {
    /// Pushes taken from each worker in this round; `None` once it is done or gone. The bound
    /// compares these (a round's counts, whatever the workers did in earlier rounds).
    clocks: Vec<Option<u64>>,
    taken: Vec<u64>,
    /// Receives awaiting each worker's next push.
    posted: Vec<(usize, Work<Vec<f32>>)>,
    /// Answers held back by the staleness bound: (worker, its count).
    held: Vec<(usize, u64)>,
    /// Answers on their way.
    sending: Vec<(usize, Work<Vec<f32>>)>,
}

/// Staleness beyond this is counted in the last bucket (a worker whose versions restarted).
const MAX_BUCKET: usize = 4096;

fn bucket(histogram: &mut Vec<u64>, k: usize) -> &mut u64 {
    let k = k.min(MAX_BUCKET);
    if histogram.len() <= k {
        histogram.resize(k + 1, 0);
    }
    &mut histogram[k]
}

/// Appends the values of the parameters server `index` owns, in module order.
struct OwnedReader<'a, B> {
    rep: &'a Replica,
    plan: &'a Plan,
    index: usize,
    at: usize,
    out: &'a mut Vec<f32>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for OwnedReader<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if !t.is_require_grad() {
            return;
        }
        let i = self.at;
        self.at += 1;
        if self.plan.owner[i] == self.index {
            let v = local::param_values(self.rep, param.id, t);
            self.out.extend_from_slice(&v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(lens: &[usize], servers: usize) -> Plan {
        Plan::new(
            lens.iter()
                .enumerate()
                .map(|(i, &l)| (ParamId::from(i as u64), l))
                .collect(),
            servers,
        )
    }

    #[test]
    fn parameters_are_dealt_by_bytes_largest_first() {
        let p = plan(&[10, 400, 30, 300, 20, 100], 2);
        // 400 -> 0, 300 -> 1, 100 -> 1 (300 < 400), 30 -> 0 (400 = 400, lower index),
        // 20 -> 1 (400 < 430), 10 -> 1 (420 < 430).
        assert_eq!(p.owner, vec![1, 0, 0, 1, 1, 1]);
        assert_eq!(p.shard_len, vec![430, 430]);
        assert_eq!(p.shard_params, vec![2, 4]);
        let one = plan(&[5, 6], 1);
        assert_eq!(one.owner, vec![0, 0]);
        assert_eq!(one.shard_len, vec![11]);
    }

    #[test]
    fn a_push_frame_round_trips() {
        let p = plan(&[3, 2, 4], 2);
        // 4 -> 0, 3 -> 1, 2 -> 1.
        assert_eq!(p.owner, vec![1, 1, 0]);
        let s = 1;
        let mut frame = vec![0.0f32; p.head_len(s)];
        put_word(&mut frame, KIND, PUSH);
        put_u64(&mut frame, CLOCK, (7u64 << 32) | 3);
        put_u64(&mut frame, BASE, 5);
        put_u64(&mut frame, LR, 1e-3f64.to_bits());
        // Parameter 0 present, parameter 1 absent.
        put_word(&mut frame, HEAD, 1);
        frame.extend_from_slice(&[1.0, f32::NAN, -0.0, 0.0, 0.0]);
        assert_eq!(frame.len(), p.push_len(s));
        let push = Push::parse(&frame, &p, s);
        assert!(!push.done);
        assert_eq!((push.clock, push.base, push.lr), ((7 << 32) | 3, 5, 1e-3));
        assert_eq!(push.digest, None);
        let g0 = push.grads[0].as_ref().expect("present");
        assert_eq!(g0[0], 1.0);
        assert!(g0[1].is_nan());
        assert_eq!(g0[2].to_bits(), (-0.0f32).to_bits());
        assert_eq!(push.grads[1], None);
    }

    #[test]
    fn the_staleness_histogram_line() {
        let r = PsReport {
            server: 1,
            versions: 6,
            staleness: vec![2, 3, 1],
            max_lead: 1,
            params: 2,
            elements: 10,
            departed: vec![Departure {
                worker: 2,
                pushes: 3,
                reason: "timed out".into(),
            }],
            ..PsReport::default()
        };
        let line = r.line();
        assert!(line.contains("6 steps from 6 pushes"), "{line}");
        assert!(line.contains("staleness mean 0.83 max 2"), "{line}");
        assert!(line.contains("dropped worker 2 after 3 pushes"), "{line}");
    }
}
