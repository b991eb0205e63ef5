//! ZeRO stages 1 and 2: the optimizer's state, and then the gradients, sharded over the
//! data-parallel replicas.
//!
//! Every rank still holds the whole model. Under [`Sharded`] each rank's optimizer keeps state
//! for, and updates, only the parameters it owns, and the updated parameters are then gathered
//! from their owners in one all-gather. With Adam (two moments of 4 bytes per element) this cuts
//! the optimizer's state per rank to about 1/N of DDP's. At stage 1 backward averages whole
//! gradients on every rank (`DataParallel`'s all-reduce); at stage 2 ([`ZeroStage::Two`]) each
//! bucket is reduce-scattered so that a gradient reaches only its owner, and a rank frees the
//! gradients it does not own as soon as their values are in a bucket, so it ends backward
//! holding about 1/N of the gradients.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::LearningRate;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer, SimpleOptimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, PrecisionSettings, Record, Recorder};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::context::{self, Replica};
use super::error::SyncError;
use super::local;
use super::scatter::GradOwners;

/// Wraps any Burn optimizer so that each data-parallel rank keeps optimizer state for, and
/// steps, only the parameters it owns (ZeRO stage 1, as PyTorch's `ZeroRedundancyOptimizer`).
///
/// ```ignore
/// let mut optim = bonfire::sharded(AdamConfig::new().init()); // was: AdamConfig::new().init()
/// // ...the same loop: loss.backward(), then
/// model = optim.step(lr, model, GradientsParams::from_grads(grads, &model));
/// ```
///
/// On its first step it gives every parameter an owner: largest first, each goes to the rank
/// that owns the fewest elements so far, so every rank computes the same balanced plan. Then every
/// step drops the gradients of parameters this rank does not own, lets the wrapped optimizer step
/// the rest (so it creates state only for them), and all-gathers the updated values from their
/// owners. The parameters after each step are bitwise those of the unwrapped optimizer: the
/// owner computes exactly the update every rank would have.
///
/// With [`Sharded::stage`]`(`[`ZeroStage::Two`]`)` the gradients are sharded too (ZeRO stage 2,
/// DeepSpeed's `stage: 2`): from the second backward on, each gradient bucket is
/// reduce-scattered to the owners of its gradients instead of all-reduced, and the gradients a
/// rank does not own come out of backward empty (their first dimension 0; this wrapper drops
/// them before the step). The parameters after each step are those of stage 1 up to the order
/// the reduce-scatter sums the ranks' gradients in: bitwise at 2 ranks, within rounding above.
/// Read only the gradients of the parameters this rank owns (a norm over all gradients, for
/// clipping, needs a sum over the ranks). The owners stay registered with the rank's
/// data-parallel state until the last clone of this optimizer is dropped.
///
/// Under `Hybrid<B>` (data x tensor parallelism) it shards over the rank's data-parallel group,
/// the replicas that hold the same part of the model: every tensor-parallel rank of a replica
/// plans the same owners (from the whole tensors' sizes) and steps and gathers its own parts.
///
/// The optimizer's record ([`Optimizer::to_record`]) is this rank's share: save it per rank and
/// load it on the same number of ranks, or, for Burn's optimizers (`OptimizerAdaptor`), gather
/// the whole state with [`Sharded::consolidated_record`] and load it at any world size with
/// [`Sharded::load_consolidated_record`]. At world size 1 the wrapper steps everything itself
/// and [`Sharded::owned_elements`] stays `None`.
#[derive(Clone)]
pub struct Sharded<O> {
    inner: O,
    stage: ZeroStage,
    plan: Option<Arc<Ownership>>,
}

/// What [`Sharded`] splits over the data-parallel replicas (ZeRO's stages).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ZeroStage {
    /// The optimizer's state (ZeRO-1); gradients are all-reduced whole.
    #[default]
    One,
    /// The optimizer's state and the gradients (ZeRO-2): gradients are reduce-scattered to their
    /// owners and freed elsewhere.
    Two,
    /// The parameters too (ZeRO-3, FSDP): the model is sharded at rest by
    /// [`crate::fully_shard`], each rank holding a slice of every parameter, of its gradient
    /// (reduce-scattered to it in backward) and of the optimizer's state. The wrapper then steps each rank's slices with the wrapped
    /// optimizer as it is (every rank owns a slice of everything; nothing is gathered after the
    /// step).
    Three,
}

impl ZeroStage {
    /// The stage numbered `n` (1 to 3), as `--zero N` or DeepSpeed's `stage` writes it.
    pub fn from_number(n: u8) -> Option<ZeroStage> {
        match n {
            1 => Some(ZeroStage::One),
            2 => Some(ZeroStage::Two),
            3 => Some(ZeroStage::Three),
            _ => None,
        }
    }

    /// The stage's number.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }
}

/// Wraps `optimizer` for ZeRO stage 1 ([`Sharded::stage`] picks stage 2); see [`Sharded`].
pub fn sharded<O>(optimizer: O) -> Sharded<O> {
    Sharded {
        inner: optimizer,
        stage: ZeroStage::One,
        plan: None,
    }
}

/// Who owns what, planned on the first step.
struct Ownership {
    rank: usize,
    ranks: usize,
    /// Each parameter's owner.
    owner: HashMap<ParamId, usize>,
    /// Elements each rank owns (the all-gather's counts).
    counts: Vec<usize>,
    /// Elements of the whole model (of this rank's parts of it).
    elements: usize,
    /// The parameters in module order: the order a rank's state is encoded in.
    order: Vec<ParamId>,
    /// At stage 2, the owners as the replica's gradient sync knows them.
    _gradients: Option<Registration>,
}

/// Gradient owners registered with a replica (ZeRO stage 2), unregistered when dropped.
struct Registration {
    rep: Arc<Replica>,
    owners: Arc<GradOwners>,
}

impl Registration {
    fn new(rep: &Arc<Replica>, owners: GradOwners) -> Registration {
        let owners = Arc::new(owners);
        rep.state().owners = Some(owners.clone());
        Registration {
            rep: rep.clone(),
            owners,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut st = self.rep.state();
        if st
            .owners
            .as_ref()
            .is_some_and(|o| Arc::ptr_eq(o, &self.owners))
        {
            st.owners = None;
        }
    }
}

impl<O> Sharded<O> {
    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The same sharded optimizer around `f` of the wrapped one (a state loaded into it).
    pub(crate) fn map_inner(self, f: impl FnOnce(O) -> O) -> Self {
        Sharded {
            inner: f(self.inner),
            stage: self.stage,
            plan: self.plan,
        }
    }

    /// Shards at `stage` (the default is [`ZeroStage::One`]). Set it before the first step; a
    /// change later plans the owners again on the next step (the same plan).
    pub fn stage(mut self, stage: ZeroStage) -> Self {
        if stage != self.stage {
            self.plan = None;
        }
        self.stage = stage;
        self
    }

    /// The stage it shards at.
    pub fn zero_stage(&self) -> ZeroStage {
        self.stage
    }

    /// Elements of the parameters this rank owns, and of the whole model; `None` before the
    /// first step.
    pub fn owned_elements(&self) -> Option<(usize, usize)> {
        self.plan.as_ref().map(|p| (p.counts[p.rank], p.elements))
    }
}

impl<O, M, B> Optimizer<M, B> for Sharded<O>
where
    O: Optimizer<M, B>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    type Record = O::Record;

    fn step(&mut self, lr: LearningRate, module: M, mut grads: GradientsParams) -> M {
        if self.stage == ZeroStage::Three {
            check_fully_sharded::<M, B>(&module);
            local::step_begins::<B>();
            let module = self.inner.step(lr, module, grads).map(&mut Reshard);
            local::step_ended::<B>();
            return module;
        }
        let Some((rep, plan)) = self.plan_for::<M, B>(&module) else {
            return self.inner.step(lr, module, grads);
        };
        module.visit(&mut Unowned::<B> {
            plan: &plan,
            grads: vec![&mut grads],
            _backend: std::marker::PhantomData,
        });
        let module = self.inner.step(lr, module, grads);
        gather(&rep, &plan, module)
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, mut grads: MultiGradientsParams) -> M {
        if self.stage == ZeroStage::Three {
            check_fully_sharded::<M, B>(&module);
            local::step_begins::<B>();
            let module = self.inner.step_multi(lr, module, grads).map(&mut Reshard);
            local::step_ended::<B>();
            return module;
        }
        let Some((rep, plan)) = self.plan_for::<M, B>(&module) else {
            return self.inner.step_multi(lr, module, grads);
        };
        module.visit(&mut Unowned::<B> {
            plan: &plan,
            grads: grads.grads.iter_mut().map(|(g, _)| g).collect(),
            _backend: std::marker::PhantomData,
        });
        let module = self.inner.step_multi(lr, module, grads);
        gather(&rep, &plan, module)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        Sharded {
            inner: self.inner.load_record(record),
            stage: self.stage,
            plan: self.plan,
        }
    }
}

/// Places again, as the backend keeps them at rest, the parameters a step left whole (ZeRO stage
/// 3: an op without a rule, such as AMSGrad's maximum, makes its result whole), and marks each
/// new value so that the next step's gathers of it can start ahead of need.
struct Reshard;

impl<B: AutodiffBackend> ModuleMapper<B> for Reshard {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, local::resharded(tensor, id), mapper)
    }
}

/// At ZeRO stage 3, fails the rank unless `module`'s ranks run in a fully sharded group (a
/// model only replicated would be stepped whole on every rank, sharding nothing).
fn check_fully_sharded<M, B>(module: &M)
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    let mut sizes = Sizes::<B> {
        params: None,
        device: None,
    };
    module.visit(&mut sizes);
    let Some(device) = sizes.device else {
        return;
    };
    let rep = context::for_device(&device);
    if rep.comm.size() > 1 && !crate::tensor_parallel::fsdp::active() {
        rep.fail(SyncError::Sharded {
            what: "ZeRO stage 3 steps a model sharded by bonfire::fully_shard, and this rank has \
                   no fully sharded group (shard the model with fully_shard(model) in place of \
                   replicate(model))"
                .into(),
            source: None,
        });
    }
}

impl<O> Sharded<O> {
    /// The rank's replica and the ownership plan, made on the first call; `None` for a job of
    /// one (nothing to shard).
    fn plan_for<M, B>(&mut self, module: &M) -> Option<(Arc<Replica>, Arc<Ownership>)>
    where
        M: AutodiffModule<B>,
        B: AutodiffBackend,
    {
        // Sizes are read only to plan; after that only the device is looked up.
        let mut sizes = Sizes::<B> {
            params: self.plan.is_none().then(Vec::new),
            device: None,
        };
        module.visit(&mut sizes);
        let rep = context::for_device(&sizes.device?);
        let ranks = rep.comm.size();
        if ranks < 2 {
            return None;
        }
        if crate::tensor_parallel::fsdp::active() {
            // Its owners would read (gather) different parameters on different ranks.
            rep.fail(SyncError::Sharded {
                what: format!(
                    "ZeRO stage {} steps whole parameters, and this model is sharded by \
                     bonfire::fully_shard: wrap its optimizer at ZeroStage::Three",
                    self.stage.number()
                ),
                source: None,
            });
        }
        let stage = self.stage;
        let plan = self.plan.get_or_insert_with(|| {
            let sizes = sizes.params.unwrap_or_default();
            let (owner, counts) = assign(&sizes, ranks);
            let rank = rep.comm.rank();
            let gradients = (stage == ZeroStage::Two).then(|| {
                Registration::new(
                    &rep,
                    GradOwners {
                        rank,
                        ranks,
                        owner: owner.iter().map(|(id, &r)| (id.val(), r)).collect(),
                    },
                )
            });
            Arc::new(Ownership {
                rank,
                ranks,
                owner,
                counts,
                elements: sizes.iter().map(|&(_, _, n)| n).sum(),
                order: sizes.iter().map(|&(id, _, _)| id).collect(),
                _gradients: gradients,
            })
        });
        Some((rep, plan.clone()))
    }
}

/// Each parameter's owner, and the elements (of this rank's parts) each rank owns, for
/// parameters in module order as [`Sizes`] lists them. Largest first, each to the least loaded
/// rank (the lowest on ties): the same plan on every rank, and within the largest tensor of an
/// even split. Planned on the whole tensors' sizes, so that under tensor parallelism every rank
/// of a replica makes the same plan whatever its parts' sizes (and a model makes the same plan
/// before it is split as after).
fn assign(
    sizes: &[(ParamId, usize, usize)],
    ranks: usize,
) -> (HashMap<ParamId, usize>, Vec<usize>) {
    let mut by_size: Vec<usize> = (0..sizes.len()).collect();
    by_size.sort_by_key(|&i| (std::cmp::Reverse(sizes[i].1), i));
    let mut load = vec![0usize; ranks];
    let mut counts = vec![0usize; ranks];
    let mut owner = HashMap::with_capacity(sizes.len());
    for i in by_size {
        let (id, whole, local) = sizes[i];
        let r = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r] += whole;
        counts[r] += local;
        owner.insert(id, r);
    }
    (owner, counts)
}

/// The device of the parameters, and (when `params` is given) the trained float parameters in
/// module order: each one's id, elements, and elements of this rank's part (fewer under tensor
/// parallelism).
struct Sizes<B: AutodiffBackend> {
    params: Option<Vec<(ParamId, usize, usize)>>,
    device: Option<B::Device>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Sizes<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.device.is_some() && self.params.is_none() {
            return;
        }
        let tensor = param.val();
        if self.device.is_none() {
            self.device = Some(tensor.device());
        }
        // Buffers (a batch norm's running statistics) are not trained: no owner, no state, no
        // gather; each rank keeps its own, as under DDP. Their ids may also differ between
        // processes (Burn's `RunningState` keeps its own id when a module is mapped), so an
        // owner planned by id would differ between ranks.
        if let Some(params) = self.params.as_mut().filter(|_| tensor.is_require_grad()) {
            let whole = tensor.shape().num_elements();
            let inner = tensor.inner().into_primitive().tensor();
            let local = local::shape::<B::InnerBackend>(&inner).num_elements();
            params.push((param.id, whole, local));
        }
    }
}

/// Drops the gradients of the parameters another rank owns.
struct Unowned<'a, B> {
    plan: &'a Ownership,
    grads: Vec<&'a mut GradientsParams>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Unowned<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.plan.owner.get(&param.id) != Some(&self.plan.rank) {
            for grads in &mut self.grads {
                grads.remove::<B::InnerBackend, D>(param.id);
            }
        }
    }
}

/// Every rank's updated parameters, from their owners, in one all-gather.
fn gather<B: AutodiffBackend, M: AutodiffModule<B>>(
    rep: &Arc<Replica>,
    plan: &Ownership,
    module: M,
) -> M {
    let mut mine = Mine::<B> {
        plan,
        rep,
        values: Vec::with_capacity(plan.counts[plan.rank]),
        _backend: std::marker::PhantomData,
    };
    module.visit(&mut mine);
    let values = mine.values;
    if values.len() != plan.counts[plan.rank] {
        rep.fail(SyncError::Sharded {
            what: format!(
                "this rank's parameters have {} elements where the plan of the first step \
                 gave it {}",
                values.len(),
                plan.counts[plan.rank]
            ),
            source: None,
        });
    }
    let all = rep
        .comm
        .all_gather_uneven(values, &plan.counts)
        .wait()
        .unwrap_or_else(|source| {
            rep.fail(SyncError::Sharded {
                what: format!(
                    "all-gather of the updated parameters ({} elements over {} ranks, {:?} each)",
                    plan.elements, plan.ranks, plan.counts
                ),
                source: Some(source),
            })
        });
    let mut at = Vec::with_capacity(plan.ranks);
    let mut offset = 0;
    for &n in &plan.counts {
        at.push(offset);
        offset += n;
    }
    module.map(&mut Theirs { plan, rep, all, at })
}

/// This rank's owned parameters, as f32, in module order.
struct Mine<'a, B> {
    plan: &'a Ownership,
    rep: &'a Arc<Replica>,
    values: Vec<f32>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Mine<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.plan.owner.get(&param.id) == Some(&self.plan.rank) {
            let values = local::param_values(self.rep, param.id, param.val());
            self.values.extend_from_slice(&values);
        }
    }
}

/// Writes the parameters other ranks own from the gathered values.
struct Theirs<'a> {
    plan: &'a Ownership,
    rep: &'a Arc<Replica>,
    all: Vec<f32>,
    /// Where each rank's next parameter starts in `all`.
    at: Vec<usize>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Theirs<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(&owner) = self.plan.owner.get(&param.id) else {
            if !param.val().is_require_grad() {
                // A buffer: this rank's own (see `Sizes`).
                return param;
            }
            self.rep.fail(SyncError::Sharded {
                what: format!(
                    "parameter {} was not in the model at the first sharded step",
                    param.id
                ),
                source: None,
            })
        };
        let (id, tensor, mapper) = param.consume();
        let numel = local::param_len(&tensor);
        let from = self.at[owner];
        self.at[owner] += numel;
        if owner == self.plan.rank {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let mark = tensor.is_distributed();
        let fresh = local::with_values(tensor, &self.all[from..from + numel], id, mark);
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// The state of a [`Sharded`] Burn optimizer (any `SimpleOptimizer` behind Burn's
/// `OptimizerAdaptor`: Adam, AdamW, SGD, ...) as one record, as PyTorch's
/// `ZeroRedundancyOptimizer.consolidate_state_dict`.
impl<O, M, B> Sharded<OptimizerAdaptor<O, M, B>>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    /// The whole optimizer state, every rank's share, on every rank: what the unwrapped
    /// optimizer's `to_record` returns, for a checkpoint written by one rank that loads at any
    /// world size. A collective: call it on every rank. At stage 3 every tensor of the state is
    /// gathered from its slices (its record holds whole tensors). Before the first step, or
    /// alone, it is this rank's own record.
    pub fn consolidated_record(
        &self,
        device: &B::Device,
    ) -> <OptimizerAdaptor<O, M, B> as Optimizer<M, B>>::Record {
        let mine = self.inner.to_record();
        if self.stage == ZeroStage::Three && crate::tensor_parallel::fsdp::active() {
            // Each rank holds slices: every tensor is gathered now, in the ids' order (the same
            // on every rank: `fully_shard` gave every rank rank 0's ids), so that the record
            // holds whole tensors that one rank can encode alone.
            let mut entries: Vec<_> = mine.into_iter().collect();
            entries.sort_by_key(|(id, _)| id.val());
            return entries
                .into_iter()
                .map(|(id, state)| {
                    let item = state.into_item::<FullPrecisionSettings>();
                    (id, AdaptorRecord::from_item(item, device))
                })
                .collect();
        }
        let Some(plan) = self.plan.as_ref() else {
            return mine;
        };
        let rep = context::for_device(device);
        let fail = |what: String, source| -> ! {
            rep.fail(SyncError::Sharded {
                what,
                source: Some(source),
            })
        };
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let mine = InOrder::ordered(mine, &plan.order);
        let bytes = recorder.record(mine, ()).unwrap_or_else(|e| {
            rep.fail(SyncError::Sharded {
                what: format!("encoding this rank's optimizer state: {e}"),
                source: None,
            })
        });
        let sizes = rep
            .comm
            .all_gather(vec![bytes.len() as i64])
            .wait()
            .unwrap_or_else(|e| fail("all-gather of the optimizer states' sizes".into(), e));
        let counts: Vec<usize> = sizes.iter().map(|&n| n as usize).collect();
        let all = rep
            .comm
            .all_gather_uneven(bytes, &counts)
            .wait()
            .unwrap_or_else(|e| {
                fail(
                    format!("all-gather of the optimizer states ({counts:?} bytes per rank)"),
                    e,
                )
            });
        let mut whole = <OptimizerAdaptor<O, M, B> as Optimizer<M, B>>::Record::default();
        let mut at = 0;
        for (r, &n) in counts.iter().enumerate() {
            let part: InOrder<_> = recorder
                .load(all[at..at + n].to_vec(), device)
                .unwrap_or_else(|e| {
                    rep.fail(SyncError::Sharded {
                        what: format!("decoding rank {r}'s optimizer state ({n} bytes): {e}"),
                        source: None,
                    })
                });
            whole.extend(part.0);
            at += n;
        }
        debug_assert_eq!(plan.ranks, counts.len());
        whole
    }

    /// Loads a whole optimizer state (from [`Sharded::consolidated_record`], or from the
    /// unwrapped optimizer's checkpoint) and keeps only the state of the parameters this rank
    /// owns. Call it on every rank, with the model the state belongs to: whole, or already split
    /// by tensor parallelism (the owners are the same either way; the step plans again on the
    /// model it steps).
    pub fn load_consolidated_record(
        self,
        mut record: <OptimizerAdaptor<O, M, B> as Optimizer<M, B>>::Record,
        module: &M,
    ) -> Self {
        if self.stage == ZeroStage::Three {
            // Every rank keeps its slices of every parameter's state, placed as the parameter.
            let device = device_of::<M, B>(module);
            let mut shards = StateShards::<O, B> {
                record: record.into_iter().collect(),
                device,
                out: Default::default(),
            };
            module.visit(&mut shards);
            return Sharded {
                inner: self.inner.load_record(shards.out.into_iter().collect()),
                stage: self.stage,
                plan: self.plan,
            };
        }
        let mut sizes = Sizes::<B> {
            params: Some(Vec::new()),
            device: None,
        };
        module.visit(&mut sizes);
        if let Some(device) = &sizes.device {
            let rep = context::for_device(device);
            let (rank, ranks) = (rep.comm.rank(), rep.comm.size());
            if ranks >= 2 {
                let (owner, _) = assign(&sizes.params.unwrap_or_default(), ranks);
                record.retain(|id, _| owner.get(id) == Some(&rank));
            }
        }
        Sharded {
            inner: self.inner.load_record(record),
            stage: self.stage,
            plan: self.plan,
        }
    }
}

/// The device of `module`'s first float parameter (the default device without one).
fn device_of<M: AutodiffModule<B>, B: AutodiffBackend>(module: &M) -> B::Device {
    let mut sizes = Sizes::<B> {
        params: None,
        device: None,
    };
    module.visit(&mut sizes);
    sizes.device.unwrap_or_default()
}

/// A whole optimizer state, each parameter's placed as the parameter is (ZeRO stage 3).
struct StateShards<O, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    B: AutodiffBackend,
{
    record: HashMap<ParamId, AdaptorRecord<O, B>>,
    device: B::Device,
    out: HashMap<ParamId, AdaptorRecord<O, B>>,
}

impl<O, B> ModuleVisitor<B> for StateShards<O, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    B: AutodiffBackend,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(state) = self.record.remove(&param.id) else {
            return;
        };
        let state = state.into_state::<D>();
        let placed = crate::tensor_parallel::fsdp::place_state(param.id.val(), || {
            O::to_device(state, &self.device)
        });
        self.out.insert(param.id, AdaptorRecord::from_state(placed));
    }
}

/// Bytes this rank holds of `tensor` (a parameter's value, at its dtype): the whole tensor, or
/// this rank's part where the backend splits it (under tensor parallelism, or sharded at rest
/// by [`crate::fully_shard`]).
pub fn held_bytes<B: AutodiffBackend, const D: usize>(tensor: &Tensor<B, D>) -> usize {
    let size = tensor.dtype().size();
    let part = local::held::<B::InnerBackend>(&tensor.clone().inner().into_primitive().tensor());
    part.num_elements() * size
}

/// Bytes of the gradients `grads` holds for `module`'s float parameters (at their dtype; of this
/// rank's part of each under tensor parallelism). Under [`ZeroStage::Two`] a rank holds only the
/// gradients of the parameters it owns; the others come out of backward empty.
pub fn gradient_bytes<B, M>(module: &M, grads: &GradientsParams) -> usize
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut held = HeldGradients::<B> {
        grads,
        bytes: 0,
        _backend: std::marker::PhantomData,
    };
    module.visit(&mut held);
    held.bytes
}

struct HeldGradients<'a, B> {
    grads: &'a GradientsParams,
    bytes: usize,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for HeldGradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let size = g.dtype().size();
            let part = local::held::<B::InnerBackend>(&g.into_primitive().tensor());
            self.bytes += part.num_elements() * size;
        }
    }
}

/// An optimizer's state (a map from parameter to state, as Burn's optimizers record it) in the
/// module's parameter order, as a [`Record`]. Burn encodes a map in its iteration order, which
/// differs between processes; under tensor parallelism encoding or decoding a tensor gathers it
/// over the tensor-parallel group, so every rank of a group must take the entries in one order
/// (not the ids' order either: a fresh model's ids differ between processes). Used for
/// [`Sharded::consolidated_record`]'s exchange and the bundled jobs' checkpoints.
pub struct InOrder<T>(pub Vec<(ParamId, T)>);

impl<T> InOrder<T> {
    /// `state`'s entries in the order of `module`'s float parameters (entries of parameters it
    /// does not have go last).
    pub fn new<B, M>(state: impl IntoIterator<Item = (ParamId, T)>, module: &M) -> Self
    where
        B: burn::tensor::backend::Backend,
        M: burn::module::Module<B>,
    {
        struct Order<B>(Vec<ParamId>, std::marker::PhantomData<B>);
        impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Order<B> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                self.0.push(p.id);
            }
        }
        let mut order = Order::<B>(Vec::new(), std::marker::PhantomData);
        module.visit(&mut order);
        Self::ordered(state, &order.0)
    }

    /// `state`'s entries in `order`.
    fn ordered(state: impl IntoIterator<Item = (ParamId, T)>, order: &[ParamId]) -> Self {
        let at: HashMap<ParamId, usize> =
            order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let mut entries: Vec<(ParamId, T)> = state.into_iter().collect();
        entries.sort_by_key(|(id, _)| at.get(id).copied().unwrap_or(usize::MAX));
        InOrder(entries)
    }
}

impl<B: burn::tensor::backend::Backend, T: Record<B>> Record<B> for InOrder<T> {
    type Item<S: PrecisionSettings> = Vec<(String, T::Item<S>)>;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        self.0
            .into_iter()
            .map(|(id, record)| (id.serialize(), record.into_item()))
            .collect()
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, device: &B::Device) -> Self {
        InOrder(
            item.into_iter()
                .map(|(id, item)| (ParamId::deserialize(&id), T::from_item(item, device)))
                .collect(),
        )
    }
}
