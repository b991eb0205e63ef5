//! Local SGD and DiLoCo: replicas that take `H` optimizer steps each on their own gradients, then
//! meet once and agree on one set of parameters.
//!
//! [`LocalSgd`] wraps any Burn optimizer. Between meetings backward averages nothing (the wrapper
//! keeps the parameters free of `DataParallel`'s averaging marks), so a step costs no
//! communication. Every `H`-th step, every replica sends how far it moved since the last meeting
//! (its delta, `anchor - parameters`) in one all-reduce over the data-parallel group (under int8
//! deltas, two stages of messages: [`super::int8`]), and the
//! replicas take the mean delta as an outer gradient: local SGD applies it as it is (the new
//! parameters are the replicas' mean); DiLoCo (Douillard et al., 2023) applies it with an outer
//! SGD with Nesterov momentum. One exchange every `H` steps sends `1/H` of the bytes that
//! all-reducing every step's gradients does.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bonfire_collectives::{CollectiveError, Communicator};
use bonfire_kernels::reference::pack_with_feedback_reference;
use bonfire_topology::ReduceOp;
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::record::{PrecisionSettings, Record};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use half::bf16;
use serde::{Deserialize, Serialize};

use super::config::GradDType;
use super::context::{self, Replica};
use super::error::SyncError;
use super::{int8, local};

/// How the replicas apply their mean delta when they meet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outer {
    /// Local SGD (model averaging): the new parameters are the replicas' mean.
    Average,
    /// DiLoCo's outer optimizer: SGD with Nesterov momentum over the mean delta, as PyTorch's
    /// `SGD(lr, momentum, nesterov=True)` steps (`m = momentum * m + delta`,
    /// `anchor -= lr * (delta + momentum * m)`). With `lr` 1 and `momentum` 0 it is
    /// [`Outer::Average`], bit for bit, over two or more replicas.
    Nesterov {
        /// The outer learning rate (DiLoCo: 0.7).
        lr: f32,
        /// The outer momentum (DiLoCo: 0.9).
        momentum: f32,
    },
}

/// The dtype the replicas' deltas travel in when they meet ([`LocalSgd::exchange_dtype`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeltaDType {
    /// Full precision (the default): one all-reduce of f32.
    #[default]
    F32,
    /// bfloat16, half the bytes: one all-reduce, with error feedback (each rank keeps its
    /// rounding error and adds it to its next delta).
    Bf16,
    /// int8 in blocks of 256 values with an f32 scale each, a quarter of f32's bytes (plus 1.6%
    /// for the scales): each rank sends each other rank its share of the elements, the owner sums
    /// them in f32, rounds the sum to int8 again and all-gathers it. Both roundings keep their
    /// error for the next meeting (each rank its own delta's, each owner its sum's).
    Int8,
}

impl From<GradDType> for DeltaDType {
    fn from(dtype: GradDType) -> DeltaDType {
        match dtype {
            GradDType::F32 => DeltaDType::F32,
            GradDType::Bf16 => DeltaDType::Bf16,
        }
    }
}

impl DeltaDType {
    /// How it is written in messages and on the command line: `f32`, `bf16`, `int8`.
    pub fn name(self) -> &'static str {
        match self {
            DeltaDType::F32 => "f32",
            DeltaDType::Bf16 => "bf16",
            DeltaDType::Int8 => "int8",
        }
    }
}

/// DiLoCo's outer learning rate and momentum (the paper's 0.7 and 0.9).
pub const DILOCO_OUTER: Outer = Outer::Nesterov {
    lr: 0.7,
    momentum: 0.9,
};

/// Wraps any Burn optimizer so that each data-parallel replica trains on its own gradients for
/// `H` steps, and the replicas then meet: local SGD ([`local_sgd`]) or DiLoCo ([`diloco`]).
///
/// ```ignore
/// let mut model = bonfire::broadcast_parameters(model);          // not bonfire::replicate
/// let mut optim = bonfire::diloco(AdamConfig::new().init(), 50); // was: AdamConfig::new().init()
/// let grads = loss.backward();                                    // this replica's own
/// model = optim.step(lr, model, GradientsParams::from_grads(grads, &model));
/// ```
///
/// [`crate::broadcast_parameters`] starts every replica from rank 0's parameters, unmarked for
/// gradient averaging; replicas built from the same seed may skip it (the first step checks
/// that every replica starts from the same values, and names the ranks that do not). After
/// [`crate::replicate`] instead, the first backward still averages its gradients; the wrapper
/// drops the marks in its first step.
///
/// Every rank must call [`Optimizer::step`] the same number of times: the meeting every `H`-th
/// step is a collective. [`LocalSgd::meet`] makes the replicas meet now (before evaluating or
/// saving the model, so that every replica holds the same parameters). The wrapped optimizer's
/// state (Adam's moments) stays each replica's own, as in DiLoCo.
///
/// Between meetings the replicas differ, and so do their records. After a meeting the
/// parameters and the outer state are equal on every rank, but for the rounding error of bf16
/// or int8 deltas; the wrapped optimizer's state is each replica's own. Save the record on every rank and load
/// each rank its own (the bundled GPT job gathers every replica's into its checkpoint).
///
/// With [`LocalSgd::exchange_dtype`]`(`[`DeltaDType::Bf16`]`)` deltas travel in bfloat16 with
/// error feedback (each rank keeps its rounding error and adds it to its next delta); with
/// [`DeltaDType::Int8`] in int8, a quarter of the bytes, in two stages with error feedback at both.
#[derive(Clone)]
pub struct LocalSgd<O> {
    inner: O,
    every: usize,
    outer: Outer,
    dtype: DeltaDType,
    /// Inner steps a meeting's exchange runs behind ([`LocalSgd::overlap`]); 0: none.
    overlap: usize,
    state: OuterState,
    /// The meeting sent and not yet applied ([`LocalSgd::overlap`]).
    in_flight: Option<MeetingInFlight>,
    stats: OuterStats,
    /// The exchange of the meeting in flight, where this process sent it.
    pending: Option<Pending>,
    /// The communicator overlapped meetings run on (split from the replica's, so that their
    /// messages never interleave with the collectives the program calls meanwhile), and the
    /// replica it was split from.
    meetings_comm: Option<(Arc<Replica>, Communicator)>,
}

/// The part of [`LocalSgd`]'s state that is not the wrapped optimizer's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OuterState {
    /// Steps since the replicas last met (under [`LocalSgd::overlap`], since the last meeting
    /// was sent).
    pub since: usize,
    /// The parameters at the last meeting, in module order (kept only between meetings: right
    /// after a meeting on time they are the module's parameters; after an overlapped one lands,
    /// the module holds them plus what the replica learnt since sending).
    pub anchor: Option<Vec<f32>>,
    /// The outer optimizer's momentum ([`Outer::Nesterov`]), equal on every rank.
    pub momentum: Option<Vec<f32>>,
    /// This rank's rounding error, added at its next meeting: under bfloat16 deltas one value
    /// per element; under int8 deltas one per element, then one per element of the chunk this
    /// rank sums (the error of the sum it rounded).
    pub residual: Option<Vec<f32>>,
    /// Meetings so far.
    pub meetings: u64,
}

/// A meeting sent and not yet applied ([`LocalSgd::overlap`]). A record saved meanwhile holds
/// it, and the run it resumes sends the same deltas again.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MeetingInFlight {
    /// This rank's parameters when it sent (its delta: [`OuterState::anchor`] minus these), in
    /// module order.
    pub sent_from: Vec<f32>,
    /// Inner steps taken since.
    pub after: usize,
}

/// What [`LocalSgd`] communicated on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OuterStats {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Meetings (one all-reduce each; two stages of messages under int8 deltas).
    pub meetings: u64,
    /// Elements exchanged, over all meetings.
    pub elements: u64,
    /// Bytes exchanged (the buffer of the exchanged dtype: 4 bytes an element in f32, 2 in bf16,
    /// 1 and a scale per 256 in int8), over all meetings.
    pub bytes: u64,
    /// Time spent meeting on the training thread: reading the parameters, the exchange (for
    /// an overlapped meeting, waiting for what is left of it), writing them back.
    pub time: Duration,
    /// Time overlapped meetings' exchanges ran behind the inner steps ([`LocalSgd::overlap`]),
    /// from sending to arriving, whether or not the training thread then waited.
    pub behind: Duration,
}

/// Local SGD over the data-parallel replicas: `every` steps of `optimizer` each, then the mean
/// of the replicas' parameters. See [`LocalSgd`].
pub fn local_sgd<O>(optimizer: O, every: usize) -> LocalSgd<O> {
    LocalSgd {
        inner: optimizer,
        every: every.max(1),
        outer: Outer::Average,
        dtype: DeltaDType::F32,
        overlap: 0,
        state: OuterState::default(),
        in_flight: None,
        stats: OuterStats::default(),
        pending: None,
        meetings_comm: None,
    }
}

/// DiLoCo over the data-parallel replicas: `every` steps of `optimizer` each, then an outer SGD
/// step with Nesterov momentum ([`DILOCO_OUTER`]) over the mean delta. See [`LocalSgd`].
pub fn diloco<O>(optimizer: O, every: usize) -> LocalSgd<O> {
    local_sgd(optimizer, every).outer(DILOCO_OUTER)
}

impl<O> LocalSgd<O> {
    /// How the replicas apply their mean delta.
    pub fn outer(self, outer: Outer) -> Self {
        LocalSgd { outer, ..self }
    }

    /// The dtype deltas travel in ([`DeltaDType::Bf16`]: half the bytes, [`DeltaDType::Int8`]: a
    /// quarter, both with error feedback). A [`GradDType`] names the same dtype.
    pub fn exchange_dtype(self, dtype: impl Into<DeltaDType>) -> Self {
        LocalSgd {
            dtype: dtype.into(),
            ..self
        }
    }

    /// Lets each meeting's exchange run behind the next `steps` inner steps (0, the default:
    /// none). At the `H`-th step every replica sends its delta and goes on training from its
    /// own parameters; `steps` steps later it applies the agreed change (the mean delta, or
    /// DiLoCo's outer step) to the parameters of the last meeting and adds what it learnt since
    /// it sent: `new = agreed + (now - at sending)`. Every step's change counts in exactly one
    /// meeting. The result does not depend on when the exchange arrives (a replica that
    /// reaches step `steps` first waits), so runs stay bit for bit reproducible.
    ///
    /// [`LocalSgd::meet`] waits for a meeting in flight and then meets as usual, so the model
    /// evaluated and saved is one every replica agrees on. The exchange runs on a communicator
    /// split from the replicas' at the first overlapped meeting (a collective), on a thread of
    /// its own.
    ///
    /// # Panics
    /// If `steps` is not below the steps between meetings: a meeting lands before the next is
    /// sent.
    pub fn overlap(self, steps: usize) -> Self {
        assert!(
            steps < self.every,
            "LocalSgd::overlap({steps}) with meetings every {} steps: a meeting must land before \
             the next one is sent (at most {} steps)",
            self.every,
            self.every - 1
        );
        LocalSgd {
            overlap: steps,
            ..self
        }
    }

    /// Inner steps a meeting's exchange runs behind ([`LocalSgd::overlap`]).
    pub fn overlap_steps(&self) -> usize {
        self.overlap
    }

    /// Steps between meetings.
    pub fn every(&self) -> usize {
        self.every
    }

    /// What this rank communicated so far.
    pub fn stats(&self) -> OuterStats {
        self.stats
    }

    /// The outer state (steps since the last meeting, anchor, momentum, residual).
    pub fn outer_state(&self) -> &OuterState {
        &self.state
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// Replaces the wrapped optimizer (to load its state), keeping the outer state.
    pub fn with_inner(self, inner: O) -> Self {
        LocalSgd { inner, ..self }
    }

    /// Replaces the outer state (from [`LocalSgd::outer_state`] of a saved run).
    ///
    /// A meeting in flight is dropped (its exchange, if this process sent it, is left to finish
    /// on its own communicator, which is not used again); give the saved one with
    /// [`LocalSgd::with_in_flight`].
    pub fn with_outer_state(self, state: OuterState) -> Self {
        LocalSgd {
            state,
            ..self.without_pending()
        }
    }

    /// Replaces the meeting in flight (from [`LocalSgd::in_flight`] of a saved run, after
    /// [`LocalSgd::with_outer_state`]): the next step sends its deltas again.
    pub fn with_in_flight(self, in_flight: Option<MeetingInFlight>) -> Self {
        LocalSgd {
            in_flight,
            ..self.without_pending()
        }
    }

    /// Forgets the meeting in flight and this process's exchange of it. A next exchange runs
    /// on a communicator split anew, so that the old one's messages cannot meet it.
    fn without_pending(self) -> Self {
        let fresh = self.pending.is_some();
        LocalSgd {
            in_flight: None,
            pending: None,
            meetings_comm: if fresh { None } else { self.meetings_comm },
            ..self
        }
    }

    /// The meeting sent and not yet applied ([`LocalSgd::overlap`]), if any.
    pub fn in_flight(&self) -> Option<&MeetingInFlight> {
        self.in_flight.as_ref()
    }

    /// Makes the replicas meet now if they stepped since the last meeting (a collective: every
    /// rank calls it at the same point), before evaluating or saving the model; a meeting in
    /// flight ([`LocalSgd::overlap`]) is waited for and applied first. Returns the module with
    /// the agreed parameters. Under bf16 or int8 deltas each rank still holds its own rounding
    /// error afterwards ([`OuterState::residual`]): save it per rank.
    pub fn meet<M, B>(&mut self, module: M) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let module = if self.in_flight.is_some() {
            self.land(module)
        } else {
            module
        };
        if self.state.since == 0 {
            return module;
        }
        self.exchange(module)
    }

    /// Counts a step; lands the meeting in flight when it has run behind `overlap` steps, and
    /// meets (or sends the meeting) when the step is the `every`-th.
    fn after_step<M, B>(&mut self, module: M) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let mut module = module.map(&mut Unmark);
        self.stats.steps += 1;
        self.state.since += 1;
        if let Some(flight) = &mut self.in_flight {
            flight.after += 1;
            if flight.after >= self.overlap {
                module = self.land(module);
            }
        }
        if self.state.since < self.every {
            module
        } else if self.overlap == 0 {
            self.exchange(module)
        } else {
            self.send(module)
        }
    }

    /// Takes the anchor from the module before the first step after a meeting; on the first
    /// step of all, checks that every replica starts from the same parameters. A meeting in
    /// flight that this process did not send (a loaded record's) is sent again.
    fn before_step<M, B>(&mut self, module: &M)
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        if self.in_flight.is_some()
            && self.pending.is_none()
            && let (Some(rep), values) = read(module)
        {
            self.resend(&rep, values.len());
        }
        if self.state.anchor.is_some() {
            return;
        }
        let (rep, values) = read(module);
        if self.state.meetings == 0
            && self.stats.steps == 0
            && let Some(rep) = &rep
        {
            check_same_start(rep, &values);
        }
        self.state.anchor = Some(values);
    }

    /// Checks what this rank holds against the model's `n` elements, and on every rank together
    /// at this process's first meeting, that every rank holds the same and meets alike.
    fn check_held(&mut self, rep: &Replica, n: usize) {
        let ranks = rep.comm.size();
        let dtype = self.dtype;
        let anchor = self
            .state
            .anchor
            .as_ref()
            .expect("an anchor is taken before each step");
        let residual_len = residual_len(dtype, n, ranks, rep.comm.rank());
        // What this rank holds must all have the model's size: checked on every rank together
        // at this process's first meeting (a fresh start or a resume), so that a rank that
        // holds something else fails every rank instead of leaving them in the all-reduce.
        let rounding = format!("{} rounding error", dtype.name());
        let held = [
            ("parameters at the last meeting", Some(anchor.len()), n),
            (
                "outer momentum",
                self.state.momentum.as_ref().map(Vec::len),
                n,
            ),
            (
                rounding.as_str(),
                self.state.residual.as_ref().map(Vec::len),
                residual_len,
            ),
            (
                "parameters when the meeting in flight was sent",
                self.in_flight.as_ref().map(|f| f.sent_from.len()),
                n,
            ),
        ];
        let wrong: Vec<String> = held
            .iter()
            .filter_map(|(what, len, want)| {
                len.filter(|l| l != want)
                    .map(|l| format!("{what}: {l} (not {want})"))
            })
            .collect();
        if self.stats.meetings == 0 && self.pending.is_none() && ranks > 1 {
            let flight = self.in_flight.as_ref().map_or(-1, |f| f.after as i64);
            agree_on_sizes(
                rep,
                n,
                &wrong,
                dtype,
                [self.overlap as i64, flight],
                self.state.meetings + 1,
            );
        }
        if !wrong.is_empty() {
            rep.fail(SyncError::Outer {
                what: format!(
                    "the model has {n} elements where this rank holds {} (a record of another \
                     model, of deltas in another dtype, or a model that changed)",
                    wrong.join(", ")
                ),
                source: None,
            });
        }
    }

    /// What a meeting's exchange is, for its errors.
    fn describe(&self, n: usize, steps: usize) -> String {
        let how = match self.dtype {
            DeltaDType::Int8 => "exchange (two stages of messages)",
            _ => "all-reduce",
        };
        format!(
            "{how} of the parameter deltas at meeting {} ({n} elements in {}, after {steps} local \
             steps)",
            self.state.meetings + 1,
            self.dtype.name(),
        )
    }

    /// One meeting: the mean delta all-reduced, the outer step, the parameters written back.
    fn exchange<M, B>(&mut self, module: M) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let t0 = Instant::now();
        let (rep, params) = read(&module);
        let Some(rep) = rep else {
            return module;
        };
        let ranks = rep.comm.size();
        let n = params.len();
        self.check_held(&rep, n);
        let anchor = self
            .state
            .anchor
            .take()
            .expect("an anchor is taken before each step");
        let steps = std::mem::take(&mut self.state.since);
        if ranks == 1 && self.outer == Outer::Average {
            // The mean of one replica is itself.
            self.count(ranks, n, 0);
            self.stats.time += t0.elapsed();
            return module;
        }
        let delta: Vec<f32> = anchor.iter().zip(&params).map(|(a, p)| a - p).collect();
        let residual = self.state.residual.take();
        let what = self.describe(n, steps);
        let exchanged = match reduce(&rep.comm, self.dtype, delta, residual) {
            Ok(exchanged) => exchanged,
            Err(source) => rep.fail(SyncError::Outer {
                what,
                source: Some(source),
            }),
        };
        let params = self.outer_step(&anchor, &exchanged.mean);
        let module = module.map(&mut Write {
            values: &params,
            at: 0,
        });
        self.state.residual = exchanged.residual;
        self.count(ranks, n, exchanged.sent);
        self.stats.time += t0.elapsed();
        module
    }

    /// Sends an overlapped meeting: this rank's delta goes to the exchange thread, and the
    /// replica trains on from its own parameters until [`Self::land`].
    fn send<M, B>(&mut self, module: M) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let t0 = Instant::now();
        let (rep, params) = read(&module);
        let Some(rep) = rep else {
            return module;
        };
        if rep.comm.size() == 1 && self.outer == Outer::Average {
            // The mean of one replica is itself: nothing to wait for.
            return self.exchange(module);
        }
        let n = params.len();
        self.in_flight = Some(MeetingInFlight {
            sent_from: params,
            after: 0,
        });
        self.state.since = 0;
        self.resend(&rep, n);
        self.stats.time += t0.elapsed();
        module
    }

    /// Starts the exchange of the meeting in flight ([`LocalSgd::in_flight`]) on its thread,
    /// for a model of `n` elements.
    fn resend(&mut self, rep: &Arc<Replica>, n: usize) {
        self.check_held(rep, n);
        let comm = match &self.meetings_comm {
            Some((of, comm)) if Arc::ptr_eq(of, rep) => comm.clone(),
            _ => {
                let comm = match rep.comm.split(Some(0), rep.comm.rank() as u32) {
                    Ok(comm) => comm.expect("every rank joins"),
                    Err(source) => rep.fail(SyncError::Outer {
                        what: format!(
                            "setting up the communicator for overlapped meetings (at meeting {})",
                            self.state.meetings + 1
                        ),
                        source: Some(source),
                    }),
                };
                self.meetings_comm = Some((rep.clone(), comm.clone()));
                comm
            }
        };
        let anchor = self
            .state
            .anchor
            .as_ref()
            .expect("an anchor while in flight");
        let flight = self.in_flight.as_ref().expect("a meeting in flight");
        let delta: Vec<f32> = anchor
            .iter()
            .zip(&flight.sent_from)
            .map(|(a, p)| a - p)
            .collect();
        let residual = self.state.residual.clone();
        let dtype = self.dtype;
        let pending = Pending::default();
        let slot = pending.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("bonfire-meeting-{}", self.state.meetings + 1))
            .spawn(move || {
                let t0 = Instant::now();
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    reduce(&comm, dtype, delta, residual).map_err(Failed::Collective)
                }))
                .unwrap_or_else(|panic| {
                    let why = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "a panic".into());
                    Err(Failed::Panicked(why))
                });
                slot.put(result.map(|e| Exchanged {
                    took: t0.elapsed(),
                    ..e
                }));
            });
        if let Err(e) = spawned {
            rep.fail(SyncError::Outer {
                what: format!(
                    "starting the thread of meeting {} ({e})",
                    self.state.meetings + 1
                ),
                source: None,
            });
        }
        self.pending = Some(pending);
    }

    /// Applies the meeting in flight: waits for its exchange, takes the outer step from the
    /// last meeting's parameters, and adds what this replica learnt since it sent.
    fn land<M, B>(&mut self, module: M) -> M
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        let t0 = Instant::now();
        let (rep, now) = read(&module);
        let Some(rep) = rep else {
            return module;
        };
        if self.pending.is_none() {
            self.resend(&rep, now.len());
        }
        let flight = self.in_flight.take().expect("a meeting in flight");
        let n = flight.sent_from.len();
        let what = self.describe(n, self.every);
        let pending = self.pending.take().expect("sent");
        // Every wait of the exchange's collectives has the communicator's timeout, and the
        // thread leaves a result however it ends: this wait ends when the thread does.
        let exchanged = match pending.take() {
            Ok(exchanged) => exchanged,
            Err(Failed::Collective(source)) => rep.fail(SyncError::Outer {
                what,
                source: Some(source),
            }),
            Err(Failed::Panicked(why)) => rep.fail(SyncError::Outer {
                what: format!("{what}: its exchange's thread panicked: {why}"),
                source: None,
            }),
        };
        if now.len() != n {
            rep.fail(SyncError::Outer {
                what: format!(
                    "{what}: the model has {} elements where this rank sent {n} (a model that \
                     changed while the meeting was in flight)",
                    now.len()
                ),
                source: None,
            });
        }
        let anchor = self.state.anchor.take().expect("an anchor while in flight");
        let agreed = self.outer_step(&anchor, &exchanged.mean);
        let params: Vec<f32> = agreed
            .iter()
            .zip(now.iter().zip(&flight.sent_from))
            .map(|(a, (p, s))| a + (p - s))
            .collect();
        let module = module.map(&mut Write {
            values: &params,
            at: 0,
        });
        self.state.anchor = Some(agreed);
        self.state.residual = exchanged.residual;
        // The steps taken since sending (`since`) belong to the next meeting.
        self.count(rep.comm.size(), n, exchanged.sent);
        self.stats.behind += exchanged.took;
        self.stats.time += t0.elapsed();
        module
    }

    /// The parameters after the outer step from `anchor` by the mean delta `mean`.
    fn outer_step(&mut self, anchor: &[f32], mean: &[f32]) -> Vec<f32> {
        let n = anchor.len();
        match self.outer {
            Outer::Average => anchor.iter().zip(mean).map(|(a, d)| a - d).collect(),
            Outer::Nesterov { lr, momentum } => {
                let m = self.state.momentum.get_or_insert_with(|| vec![0.0; n]);
                anchor
                    .iter()
                    .zip(mean)
                    .zip(m)
                    .map(|((a, d), m)| {
                        *m = momentum * *m + d;
                        a - lr * (d + momentum * *m)
                    })
                    .collect()
            }
        }
    }

    /// Counts a finished meeting of `n` elements that sent `sent` bytes.
    fn count(&mut self, ranks: usize, n: usize, sent: usize) {
        if ranks > 1 {
            self.stats.elements += n as u64;
            self.stats.bytes += sent as u64;
        }
        self.stats.meetings += 1;
        self.state.meetings += 1;
    }
}

/// Elements of a rank's rounding error under `dtype` for a model of `n` elements.
fn residual_len(dtype: DeltaDType, n: usize, ranks: usize, rank: usize) -> usize {
    match dtype {
        DeltaDType::Int8 => n + int8::chunk(n, ranks, rank).len(),
        _ => n,
    }
}

/// What a meeting's exchange gives back.
#[derive(Clone)]
struct Exchanged {
    /// The replicas' mean delta.
    mean: Vec<f32>,
    /// The bytes of this rank's buffer (as [`OuterStats::bytes`] counts them).
    sent: usize,
    /// This rank's rounding error after it.
    residual: Option<Vec<f32>>,
    /// From sending to arriving.
    took: Duration,
}

/// The mean of every rank's `delta` over `comm` in `dtype` (from `residual`, this rank's kept
/// rounding error, where the dtype keeps one): a pure function of the ranks' inputs, run on the
/// training thread or on an overlapped meeting's.
fn reduce(
    comm: &Communicator,
    dtype: DeltaDType,
    delta: Vec<f32>,
    residual: Option<Vec<f32>>,
) -> Result<Exchanged, CollectiveError> {
    let (n, ranks) = (delta.len(), comm.size());
    let scale = 1.0 / ranks as f32;
    let done = |mean, sent, residual| {
        Ok(Exchanged {
            mean,
            sent,
            residual,
            took: Duration::ZERO,
        })
    };
    if ranks == 1 {
        return done(delta, n * 4, residual);
    }
    match dtype {
        DeltaDType::F32 => {
            let scaled: Vec<f32> = delta.iter().map(|d| d * scale).collect();
            let mean = comm.all_reduce(scaled, ReduceOp::Sum).wait()?;
            done(mean, n * 4, residual)
        }
        DeltaDType::Int8 => {
            let mut residual =
                residual.unwrap_or_else(|| vec![0.0; residual_len(dtype, n, ranks, comm.rank())]);
            let scaled: Vec<f32> = delta.iter().map(|d| d * scale).collect();
            let (mean, bytes) = int8::mean(comm, &scaled, &mut residual)?;
            done(mean, bytes, Some(residual))
        }
        DeltaDType::Bf16 => {
            let mut residual = residual.unwrap_or_else(|| vec![0.0; n]);
            let packed: Vec<bf16> =
                pack_with_feedback_reference::<f32, bf16>(&[&delta], &mut residual, scale);
            let sum = comm.all_reduce(packed, ReduceOp::Sum).wait()?;
            done(
                sum.into_iter().map(f32::from).collect(),
                n * 2,
                Some(residual),
            )
        }
    }
}

/// Where an overlapped meeting's exchange leaves its result.
#[derive(Clone, Default)]
struct Pending(Arc<(Mutex<Option<Arrived>>, Condvar)>);

/// An exchange's result, as its thread leaves it.
type Arrived = Result<Exchanged, Failed>;

/// How an overlapped meeting's exchange failed.
#[derive(Clone)]
enum Failed {
    /// One of its collectives failed (naming the peer).
    Collective(CollectiveError),
    /// Its thread panicked, saying this.
    Panicked(String),
}

impl Pending {
    fn put(&self, result: Arrived) {
        let (slot, arrived) = &*self.0;
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        arrived.notify_all();
    }

    /// The result, once its thread has left it (cloned: a clone of the optimizer shares it).
    fn take(&self) -> Arrived {
        let (slot, arrived) = &*self.0;
        let guard = slot.lock().unwrap_or_else(|e| e.into_inner());
        let guard = arrived
            .wait_while(guard, |r| r.is_none())
            .unwrap_or_else(|e| e.into_inner());
        guard.clone().expect("waited until it arrived")
    }
}

impl<O, M, B> Optimizer<M, B> for LocalSgd<O>
where
    O: Optimizer<M, B>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    type Record = LocalSgdRecord<O::Record>;

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        self.before_step(&module);
        let module = self.inner.step(lr, module, grads);
        self.after_step(module)
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        self.before_step(&module);
        let module = self.inner.step_multi(lr, module, grads);
        self.after_step(module)
    }

    fn to_record(&self) -> Self::Record {
        LocalSgdRecord {
            inner: self.inner.to_record(),
            outer: self.state.clone(),
            in_flight: self.in_flight.clone(),
        }
    }

    fn load_record(self, record: Self::Record) -> Self {
        let this = self.without_pending();
        LocalSgd {
            inner: this.inner.load_record(record.inner),
            state: record.outer,
            in_flight: record.in_flight,
            ..this
        }
    }
}

/// [`LocalSgd`]'s record: the wrapped optimizer's and the outer state.
#[derive(Clone, Debug)]
pub struct LocalSgdRecord<R> {
    /// The wrapped optimizer's record.
    pub inner: R,
    /// Steps since the last meeting, anchor, momentum and residual.
    pub outer: OuterState,
    /// The meeting sent and not yet applied ([`LocalSgd::overlap`]).
    pub in_flight: Option<MeetingInFlight>,
}

impl<B: burn::tensor::backend::Backend, R: Record<B>> Record<B> for LocalSgdRecord<R> {
    type Item<S: PrecisionSettings> = (R::Item<S>, OuterState, Option<MeetingInFlight>);

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        (self.inner.into_item(), self.outer, self.in_flight)
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, device: &B::Device) -> Self {
        LocalSgdRecord {
            inner: R::from_item(item.0, device),
            outer: item.1,
            in_flight: item.2,
        }
    }
}

/// The module's trained float parameters (those that require gradients: not batch-norm
/// statistics, whose running updates each replica keeps, nor frozen ones) as f32 in module
/// order (this rank's parts of them), and the rank's replica (`None` for a module without
/// any).
fn read<M, B>(module: &M) -> (Option<std::sync::Arc<Replica>>, Vec<f32>)
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    let mut reader = Read::<B> {
        rep: None,
        values: Vec::new(),
        _backend: std::marker::PhantomData,
    };
    module.visit(&mut reader);
    (reader.rep, reader.values)
}

struct Read<B> {
    rep: Option<std::sync::Arc<Replica>>,
    values: Vec<f32>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Read<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if !t.is_require_grad() {
            // Batch-norm statistics and frozen parameters: no optimizer moves them.
            return;
        }
        let rep = self
            .rep
            .get_or_insert_with(|| context::for_device(&t.device()))
            .clone();
        self.values
            .extend_from_slice(&local::param_values(&rep, param.id, t));
    }
}

/// Writes `values` (module order) into the module's trained float parameters, unmarked.
struct Write<'a> {
    values: &'a [f32],
    at: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Write<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let n = local::param_len(&tensor);
        let fresh = local::with_values(tensor, &self.values[self.at..self.at + n], id, false);
        self.at += n;
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Drops `DataParallel`'s averaging marks (set by `replicate`, renewed by Burn's optimizers), so
/// that the next backward keeps this replica's gradients.
pub(crate) struct Unmark;

impl<B: AutodiffBackend> ModuleMapper<B> for Unmark {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !tensor.is_distributed() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let require_grad = tensor.is_require_grad();
        let mut fresh = Tensor::from_inner(tensor.inner());
        if require_grad {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Fails on every rank, naming the ranks, when some rank's model is not rank 0's size, holds
/// outer state of another size (`wrong`, this rank's), sends deltas in another dtype, or
/// overlaps its meetings by another number of steps or holds another meeting in flight
/// (`overlap`: the steps, and the steps since the meeting in flight was sent or -1), at meeting
/// `meeting`.
fn agree_on_sizes(
    rep: &Replica,
    elements: usize,
    wrong: &[String],
    dtype: DeltaDType,
    overlap: [i64; 2],
    meeting: u64,
) {
    const FIELDS: usize = 5;
    let code = |d: DeltaDType| d as i64;
    let all = rep
        .comm
        .all_gather(vec![
            elements as i64,
            wrong.len() as i64,
            code(dtype),
            overlap[0],
            overlap[1],
        ])
        .wait()
        .unwrap_or_else(|source| {
            rep.fail(SyncError::Outer {
                what: format!(
                    "checking the replicas' sizes at meeting {meeting} ({elements} elements \
                     here)"
                ),
                source: Some(source),
            })
        });
    let field = |f: usize| -> Vec<i64> { all.iter().skip(f).step_by(FIELDS).copied().collect() };
    let sizes = field(0);
    let dtypes: Vec<&str> = field(2)
        .into_iter()
        .map(|c| {
            [DeltaDType::F32, DeltaDType::Bf16, DeltaDType::Int8]
                .into_iter()
                .find(|&d| code(d) == c)
                .map_or("?", DeltaDType::name)
        })
        .collect();
    let other: Vec<usize> = (0..dtypes.len())
        .filter(|&r| dtypes[r] != dtypes[0])
        .collect();
    if !other.is_empty() {
        rep.fail(SyncError::Outer {
            what: format!(
                "ranks {other:?} send their deltas in another dtype than rank 0 at meeting \
                 {meeting} (by rank: {dtypes:?}): every rank must call exchange_dtype with the \
                 same dtype"
            ),
            source: None,
        });
    }
    let overlaps = field(3);
    let other: Vec<usize> = (0..overlaps.len())
        .filter(|&r| overlaps[r] != overlaps[0])
        .collect();
    if !other.is_empty() {
        rep.fail(SyncError::Outer {
            what: format!(
                "ranks {other:?} overlap their meetings with another number of steps than rank 0 \
                 at meeting {meeting} (by rank: {overlaps:?}): every rank must call overlap with \
                 the same steps"
            ),
            source: None,
        });
    }
    let flights = field(4);
    let other: Vec<usize> = (0..flights.len())
        .filter(|&r| flights[r] != flights[0])
        .collect();
    if !other.is_empty() {
        let by_rank: Vec<String> = flights
            .iter()
            .map(|&f| match f {
                -1 => "none".to_string(),
                f => format!("sent {f} step(s) ago"),
            })
            .collect();
        rep.fail(SyncError::Outer {
            what: format!(
                "ranks {other:?} hold another meeting in flight than rank 0 at meeting {meeting} \
                 (by rank: {by_rank:?}): every rank must load its record of the same step"
            ),
            source: None,
        });
    }
    let wrongs = field(1);
    let ranks: Vec<usize> = (0..sizes.len())
        .filter(|&r| sizes[r] != sizes[0] || wrongs[r] != 0)
        .collect();
    if !ranks.is_empty() {
        rep.fail(SyncError::Outer {
            what: format!(
                "ranks {ranks:?} hold models or outer state of other sizes than rank 0's model at \
                 meeting {meeting} (model elements per rank: {sizes:?})"
            ),
            source: None,
        });
    }
}

/// Fails on every rank, naming the ranks, when the replicas do not start from rank 0's
/// parameters.
fn check_same_start(rep: &Replica, values: &[f32]) {
    if rep.comm.size() == 1 {
        return;
    }
    let digest = values.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
    });
    let all = rep
        .comm
        .all_gather(vec![digest as i64, values.len() as i64])
        .wait()
        .unwrap_or_else(|source| {
            rep.fail(SyncError::Outer {
                what: format!(
                    "checking that every replica starts from the same parameters ({} elements \
                     here)",
                    values.len()
                ),
                source: Some(source),
            })
        });
    let ranks: Vec<usize> = (0..all.len() / 2)
        .filter(|&r| all[2 * r..2 * r + 2] != all[..2])
        .collect();
    if !ranks.is_empty() {
        let sizes: Vec<i64> = all.iter().skip(1).step_by(2).copied().collect();
        rep.fail(SyncError::Outer {
            what: format!(
                "ranks {ranks:?} start from other parameters than rank 0 (elements per rank: \
                 {sizes:?}). Build every replica's model from the same seed or checkpoint"
            ),
            source: None,
        });
    }
}
