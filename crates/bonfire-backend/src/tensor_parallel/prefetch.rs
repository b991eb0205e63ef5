//! ZeRO stage 3's parameter gathers started ahead of need (PyTorch FSDP's forward and backward
//! prefetch).
//!
//! A fully sharded step gathers the same parameters in the same order every time: forward reads
//! each layer's weights in turn, backward reads them again in reverse. So each rank records,
//! during one optimizer step, which parameter each gather was for and for which op; during the
//! next, the parameters are gathered `n` at a time in one all-gather (a *bundle*), the next
//! bundle started as soon as the one before the current one is used up (so at most `2n`
//! parameters are ahead), so that it runs on the communication runtime behind the compute of
//! the ops before it, and `n` small gathers wait for one round trip instead of `n`. PyTorch records FSDP's order the same way, from the first
//! iteration, and gathers a wrapped module's parameters in one all-gather.
//!
//! What makes a gather one of a parameter: the parameter's shard at rest is *registered* (by
//! `fully_shard`, and by `bonfire::sharded(..).stage(ZeroStage::Three)` after each step) and
//! carries a tag with the parameter's number and a serial for this value; layout ops (a
//! transpose, an unsqueeze, a reshape that keeps the split) pass the tag on with the op, so the
//! view an op gathers (a linear layer's weight unsqueezed, transposed in backward) is made from
//! each rank's gathered slice by the same ops and put together as a gather of the view would
//! be. An arithmetic op's result carries no tag.
//!
//! A read served ahead is the same bits, laid out alike, as the op would have gathered, so a
//! run's numbers do not change. Every rank takes the same decisions at the same points of its
//! program (the recorded order, the registered values and the position in it are alike on every
//! rank, as the gathers themselves are), so the collectives started ahead match. Where the
//! program leaves the recorded order (an evaluation's forward, which has no backward, or a new
//! value the step did not register), what was started ahead is dropped (it completes in the
//! background), the needed parameter is gathered as before, and the rank finds its place in the
//! order again.
//!
//! An evaluation run inside `bonfire::forward_only` has an order of its own instead: training's
//! is set aside, the evaluation's first forward pass is recorded (it ends where its first read
//! comes again), and from then on the gathers are started ahead round that pass, each pass's
//! last reads followed by the next one's first, with no backward gathered for nothing. The pass
//! is kept for the next evaluation, and training's order and place are taken back at the
//! first read or step after it.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bonfire_collectives::Work;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape, TensorMetadata};

use super::context::TpRank;
use super::placement::Placement;
use super::redistribute::{Why, all_gather, assemble_parts, from_host, to_host};
use super::tensor::{ParamTag, Repr, TpTensor};

/// The most reads a step's order records (a program that never steps, or whose step reads
/// parameters more often than this, is prefetched for its first reads only).
const MAX_RECORDED: usize = 1 << 18;

/// Serials of registered values, unique in the process.
static SERIAL: AtomicU64 = AtomicU64::new(1);

/// One rank's prefetch state, for the group's inner backend `B` (held type-erased by
/// [`TpRank`]).
pub(crate) struct Prefetch<B: Backend> {
    /// Each registered parameter's current shard at rest.
    bases: HashMap<u64, Base<B>>,
    /// The gathers of parameters since the last step ended, in order.
    recording: Vec<Need>,
    /// The order recorded during the last step: what the next gathers are expected to be.
    order: Vec<Need>,
    /// The index in `order` the next gather is expected at.
    at: usize,
    /// The next index of `order` to start a gather for.
    next: usize,
    /// Gathers started ahead, in `order`'s order.
    ahead: VecDeque<Ahead<B>>,
    /// Whether `order` is an evaluation's forward pass, read over and over
    /// (`bonfire::forward_only`): its indices then run on past its end, index `i` reading
    /// `order[i % len]`.
    cyclic: bool,
    /// Training's order and place, set aside while an evaluation's are in use.
    training: Option<Place>,
    /// The last evaluation's forward pass, for the next one.
    forward_pass: Vec<Need>,
}

/// An order set aside: the order, what was being recorded, and the index reached.
struct Place {
    order: Vec<Need>,
    recording: Vec<Need>,
    at: usize,
}

/// A gather of a parameter: its number, and the op that needed it (so that a parameter read by
/// two ops, as a token table tied to the output layer is, is told apart in the order).
type Need = (u64, &'static str);

struct Base<B: Backend> {
    serial: u64,
    local: FloatTensor<B>,
}

/// A parameter's gather started ahead: its part of a bundle.
struct Ahead<B: Backend> {
    index: usize,
    serial: u64,
    bundle: Arc<Bundle>,
    /// Where its values start in each rank's share of the bundle.
    offset: usize,
    lshape: Shape,
    dtype: DType,
    device: B::Device,
}

/// Gathers started together: one all-gather of the next parameters' shards, each rank giving
/// its shards' values one after another (so several small gathers wait for one round trip).
struct Bundle {
    state: Mutex<Gathered>,
    /// Elements each rank gives.
    per_rank: usize,
}

enum Gathered {
    /// Started (`None` once a wait for it has begun: a failed wait fails the rank).
    Running(Option<Work<Vec<f32>>>),
    Done(Arc<Vec<f32>>),
}

impl Bundle {
    /// Every rank's share, in rank order, once the all-gather has completed.
    fn values(&self, g: &TpRank, op: &str) -> Arc<Vec<f32>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let work = match &mut *state {
            Gathered::Done(values) => return values.clone(),
            Gathered::Running(work) => work.take(),
        };
        let Some(work) = work else {
            // Only after a failed wait that a caller caught (ranks that are threads).
            panic!("bonfire: this parameter gather started ahead failed earlier on this rank");
        };
        let values = Arc::new(work.wait().unwrap_or_else(|e| g.fail(op, e)));
        *state = Gathered::Done(values.clone());
        values
    }
}

impl<B: Backend> Default for Prefetch<B> {
    fn default() -> Self {
        Prefetch {
            bases: HashMap::new(),
            recording: Vec::new(),
            order: Vec::new(),
            at: 0,
            next: 0,
            ahead: VecDeque::new(),
            cyclic: false,
            training: None,
            forward_pass: Vec::new(),
        }
    }
}

/// Runs `f` on `g`'s prefetch state for backend `B` (made on first use).
fn with_state<B: Backend, R>(g: &TpRank, f: impl FnOnce(&mut Prefetch<B>) -> R) -> R {
    let mut slot = g.prefetch_slot();
    let fresh = !slot.as_ref().is_some_and(|s| s.is::<Prefetch<B>>());
    if fresh {
        *slot = Some(Box::new(Prefetch::<B>::default()) as Box<dyn Any + Send>);
    }
    let state = slot
        .as_mut()
        .and_then(|s| s.downcast_mut::<Prefetch<B>>())
        .expect("made above");
    f(state)
}

/// `t`, parameter `param`'s shard at rest in `g` (its value now), registered as that
/// parameter's current value and tagged so that its gathers can be served ahead. Anything but a
/// shard is returned as it is.
pub(crate) fn register<B: Backend>(g: &TpRank, param: u64, t: TpTensor<B>) -> TpTensor<B> {
    let Repr::Local {
        tensor,
        placement: Placement::Shard { .. },
    } = &t.repr
    else {
        return t;
    };
    let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
    let base = Base {
        serial,
        local: tensor.clone(),
    };
    with_state::<B, _>(g, |s| s.bases.insert(param, base));
    t.tagged(Some(Arc::new(ParamTag {
        param,
        serial,
        views: Vec::new(),
    })))
}

/// The whole of a shard (`Shard { dim, blocks }`, this rank's part `local`, tagged `tag`) in
/// `g`: from a gather started ahead where it is the parameter view the recorded order expects
/// next, else gathered now.
pub(crate) fn gather<B: Backend>(
    g: &TpRank,
    local: FloatTensor<B>,
    tag: Option<Arc<ParamTag<B>>>,
    dim: usize,
    blocks: usize,
    why: Why,
) -> FloatTensor<B> {
    let depth = g.prefetch_depth();
    let Some(tag) = tag.filter(|_| depth > 0) else {
        return all_gather::<B>(g, local, dim, blocks, why);
    };
    // The gather started ahead for this one, if there is one and it is of this value.
    let need = (tag.param, why.op());
    let ready = with_state::<B, _>(g, |s| {
        s.follow_mode(g);
        if !s.cyclic {
            if s.recording.len() < MAX_RECORDED {
                s.recording.push(need);
            }
        } else if s.order.is_empty() {
            // An evaluation's first pass is recorded until its first read comes again: the
            // second pass begins, and the order is known from here.
            if s.recording.first() == Some(&need) {
                s.order = std::mem::take(&mut s.recording);
                s.at = 0;
                s.next = 0;
            } else if s.recording.len() < MAX_RECORDED {
                s.recording.push(need);
            }
        }
        let expected = s.expected(s.at) == Some(need);
        if !expected {
            // Off the recorded order: what was started ahead is not needed.
            s.drop_ahead(g, usize::MAX);
            if s.cyclic && !s.order.is_empty() && s.find(need).is_none() {
                // A read the evaluation's pass does not have (another model, or a pass cut
                // short): its pass is recorded again from here.
                s.order.clear();
                s.recording = vec![need];
                s.at = 0;
            } else if !s.cyclic && s.order.first() == Some(&need) {
                // A new pass began before the recorded one ended (as after an evaluation's
                // forward, which has no backward): the order is recorded again from here.
                s.recording = vec![need];
                s.at = 1;
            } else if let Some(j) = s.find(need) {
                // The next reads are those after it (a read the order does not have leaves
                // the rank where it was).
                s.at = j + 1;
            }
            s.next = s.at;
            s.start(g, depth);
            return None;
        }
        let index = s.at;
        s.at += 1;
        s.next = s.next.max(s.at);
        s.drop_ahead(g, index);
        let found = match s.ahead.front() {
            Some(a) if a.index == index => s.ahead.pop_front(),
            _ => None,
        };
        s.start(g, depth);
        // Started for another value of the parameter (one the step did not register): dropped.
        let stale = found.as_ref().is_some_and(|a| a.serial != tag.serial);
        if stale {
            g.stats().dropped_ahead += 1;
        }
        found.filter(|_| !stale)
    });
    let Some(ahead) = ready else {
        return all_gather::<B>(g, local, dim, blocks, why);
    };
    drop(local);
    let began = Instant::now();
    let all = ahead.bundle.values(g, why.op());
    g.stats().gather_time += began.elapsed();
    let per = ahead.lshape.num_elements();
    // Each rank's part of the view, as each rank would have given it, put together as a
    // gather of the view puts them: the same bits, laid out alike.
    let ranks = all.len() / ahead.bundle.per_rank.max(1);
    let parts = (0..ranks)
        .map(|r| {
            let from = r * ahead.bundle.per_rank + ahead.offset;
            let part = from_host::<B>(
                all[from..from + per].to_vec(),
                ahead.lshape.clone(),
                ahead.dtype,
                &ahead.device,
            );
            tag.views.iter().fold(part, |t, view| view(t))
        })
        .collect();
    let whole = assemble_parts::<B>(parts, dim, blocks);
    g.stats().served_ahead += 1;
    whole
}

/// Begins an optimizer step in `g`: the parameters' values registered so far are let go (the
/// step replaces each; holding them would keep a second copy of every shard alive while it
/// runs), and so is whatever was started ahead.
pub(crate) fn step_begins<B: Backend>(g: &TpRank) {
    with_state::<B, _>(g, |s| {
        s.follow_mode(g);
        s.bases.clear();
        s.drop_ahead(g, usize::MAX);
    });
}

/// Ends an optimizer step in `g` (after its parameters' new values are registered): what was
/// gathered since the last step becomes the order the next step's gathers are started ahead
/// by, and the first of them start now, behind what the program does until its next forward.
pub(crate) fn step_ended<B: Backend>(g: &TpRank) {
    let depth = g.prefetch_depth();
    // Nothing was started ahead since the step began (`step_begins` dropped it all).
    with_state::<B, _>(g, |s| {
        s.follow_mode(g);
        if !s.recording.is_empty() {
            s.order = std::mem::take(&mut s.recording);
        }
        s.at = 0;
        s.next = 0;
        if depth > 0 {
            s.start(g, depth);
        }
    });
}

impl<B: Backend> Prefetch<B> {
    /// The read expected at index `index` of the order (round and round an evaluation's pass).
    fn expected(&self, index: usize) -> Option<Need> {
        match self.order.len() {
            0 => None,
            n if self.cyclic => Some(self.order[index % n]),
            _ => self.order.get(index).copied(),
        }
    }

    /// Takes up the order the rank's mode asks for, where it changed since the last read or
    /// step: an evaluation's forward pass inside `bonfire::forward_only` (training's set aside),
    /// training's after it (the evaluation's pass kept for the next). What was started ahead
    /// for the other is dropped.
    fn follow_mode(&mut self, g: &TpRank) {
        let forward_only = g.forward_only();
        if forward_only == self.training.is_some() {
            return;
        }
        self.drop_ahead(g, usize::MAX);
        if forward_only {
            self.training = Some(Place {
                order: std::mem::take(&mut self.order),
                recording: std::mem::take(&mut self.recording),
                at: self.at,
            });
            self.order = self.forward_pass.clone();
            self.cyclic = true;
            self.at = 0;
        } else {
            let place = self
                .training
                .take()
                .expect("set aside when the evaluation began");
            let pass = std::mem::take(&mut self.order);
            let recorded = std::mem::take(&mut self.recording);
            // A pass that never came round again (an evaluation of one batch) is kept as it was
            // recorded.
            self.forward_pass = if pass.is_empty() { recorded } else { pass };
            self.order = place.order;
            self.recording = place.recording;
            self.at = place.at;
            self.cyclic = false;
        }
        self.next = self.at;
    }

    /// The first index of `order` from `at` on (then from its start) that is `need`.
    fn find(&self, need: Need) -> Option<usize> {
        let n = self.order.len();
        (0..n)
            .map(|k| (self.at + k) % n)
            .find(|&j| self.order[j] == need)
    }

    /// Drops the parameters gathered ahead for indices of `order` before `before`: their bundles
    /// complete in the background, unread where no other part of them is read.
    fn drop_ahead(&mut self, g: &TpRank, before: usize) {
        let mut dropped = 0;
        while self.ahead.front().is_some_and(|a| a.index < before) {
            self.ahead.pop_front();
            dropped += 1;
        }
        if dropped > 0 {
            g.stats().dropped_ahead += dropped;
        }
    }

    /// Starts gathers of the next parameters of `order`, `n` at a time in one all-gather: one
    /// whenever no more than `n` are ahead, so that the next bundle is in flight while the
    /// current one is read (at most `2n` parameters ahead).
    fn start(&mut self, g: &TpRank, n: usize) {
        // Round an evaluation's pass, at most one pass ahead (a pass shorter than `n` is not
        // gathered twice over).
        let end = if self.cyclic {
            self.at + self.order.len()
        } else {
            usize::MAX
        };
        while self.ahead.len() <= n && self.next < end && self.expected(self.next).is_some() {
            let mut members = Vec::with_capacity(n);
            while members.len() < n && self.next < end {
                let Some((param, _)) = self.expected(self.next) else {
                    break;
                };
                let index = self.next;
                self.next += 1;
                if let Some(base) = self.bases.get(&param) {
                    members.push((index, base.serial, base.local.clone()));
                }
            }
            if members.is_empty() {
                break;
            }
            let began = Instant::now();
            let mut values = Vec::new();
            let mut placed = Vec::with_capacity(members.len());
            for (index, serial, local) in members {
                let (lshape, dtype, device) =
                    (local.shape(), local.dtype(), B::float_device(&local));
                placed.push((index, serial, values.len(), lshape, dtype, device));
                values.extend(to_host::<B>(local));
            }
            let per_rank = values.len();
            let bundle = Arc::new(Bundle {
                state: Mutex::new(Gathered::Running(Some(g.comm.all_gather(values)))),
                per_rank,
            });
            {
                let mut s = g.stats();
                s.gathers += 1;
                s.gathers_started_ahead += 1;
                s.gather_bytes += 4 * per_rank as u64;
                s.gather_time += began.elapsed();
            }
            for (index, serial, offset, lshape, dtype, device) in placed {
                self.ahead.push_back(Ahead {
                    index,
                    serial,
                    bundle: bundle.clone(),
                    offset,
                    lshape,
                    dtype,
                    device,
                });
            }
        }
    }
}
