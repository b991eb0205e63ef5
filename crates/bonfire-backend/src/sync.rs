//! The gradient synchroniser behind `DataParallel`'s `DistributedBackend` impl: buckets filled as
//! backward produces gradients, all-reduced in order in the background, written back before
//! backward returns.
//!
//! On CubeCL inner backends (wgpu, CUDA, plain or fused) a bucket's gradients are packed on the
//! device by the fused pack kernel once the last of them is final, and cross to the host in one
//! transfer; the averaged bucket comes back in one transfer and the fused unpack kernel writes it
//! into the gradients ([`crate::lane`]). Other inner backends read each gradient to the host
//! (`float_into_data`), the path every backend supports. Each bucket carries one presence flag per
//! parameter after its data, so a parameter that has a gradient on some ranks but not others is
//! caught (and named) instead of silently averaged with nothing.

use std::any::Any;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bonfire_collectives::{CollectiveError, runtime};
use bonfire_topology::{BucketPlan, ReduceOp, stable_hash};
use burn_backend::distributed::{DistributedParams, TensorRef};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape, TensorData};
use half::bf16;
use tokio::task::JoinHandle;

use crate::backend::DataParallel;
use crate::context::{self, GradDType, Replica};
use crate::lane;
use crate::stats::StepStats;

thread_local! {
    static NO_SYNC: Cell<u32> = const { Cell::new(0) };
}

/// While the guard lives, backward passes on this thread leave their gradients alone: no buckets,
/// no communication, as inside PyTorch DDP's `no_sync()`. The gradients backward returns are
/// this rank's only; hand them to [`crate::keep_gradients`] so that the next synchronised
/// backward includes them ([`crate::accumulate`] does both).
pub fn no_sync() -> NoSyncGuard {
    NO_SYNC.with(|c| c.set(c.get() + 1));
    NoSyncGuard {
        _not_send: std::marker::PhantomData,
    }
}

/// Ends a [`no_sync`] region when dropped.
pub struct NoSyncGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for NoSyncGuard {
    fn drop(&mut self) {
        NO_SYNC.with(|c| c.set(c.get().saturating_sub(1)));
    }
}

fn quiet() -> bool {
    NO_SYNC.with(|c| c.get() > 0)
}

/// A parameter known to the synchroniser, in module order.
pub(crate) struct ParamInfo {
    pub(crate) id: u64,
    pub(crate) numel: Option<usize>,
    pub(crate) name: String,
}

#[derive(Default)]
pub(crate) struct SyncState {
    params: Vec<ParamInfo>,
    index: HashMap<u64, usize>,
    plan: Option<Arc<BucketPlan>>,
    /// Fingerprint of the plan all ranks were found to agree on.
    agreed: Option<u64>,
    /// Gradient sums of unsynchronised backward passes, per parameter (empty: none).
    accum: Option<Vec<Vec<f32>>>,
    /// bf16 error feedback: what rounding left out last time, per bucket.
    residual: Vec<Vec<f32>>,
    step: Option<Step>,
}

struct Step {
    started: Instant,
    /// The plan this step fills; `None` when some parameter's size is not known yet (its first
    /// step): then every gradient is read at the end instead.
    plan: Option<Arc<BucketPlan>>,
    buffers: Vec<Vec<f32>>,
    remaining: Vec<usize>,
    launched: Vec<Inflight>,
    /// Per bucket, the parameters whose gradients wait on the device to be packed together.
    pending: Vec<Vec<usize>>,
    /// Buckets packed on the device this step.
    packed: u64,
    agreement: Option<Agreement>,
    /// `Vec<Option<GradRef<B>>>` by parameter index.
    refs: Box<dyn Any + Send>,
    bytes: u64,
}

/// A bucket-plan check in flight (see [`SyncState::agree`]).
struct Agreement {
    work: bonfire_collectives::Work<Vec<i64>>,
    params: usize,
    elements: usize,
}

impl Agreement {
    /// Waits for every rank's plan fingerprint; fails naming the ranks that differ from rank 0.
    fn check(self, rep: &Replica) {
        let all = match self.work.wait() {
            Ok(all) => all,
            Err(e) => rep.fail(format!("while checking the bucket plan: {e}")),
        };
        let differ: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
        if !differ.is_empty() {
            rep.fail(format!(
                "ranks {differ:?} have different parameters or bucket settings than rank 0 \
                 ({} parameters, {} elements, bucket cap {} bytes, {:?} here). Every rank must \
                 build the same model and call bonfire::replicate(model) before training, with \
                 the same BONFIRE_BUCKET_CAP_MB and BONFIRE_GRAD_DTYPE",
                self.params, self.elements, rep.config.bucket_cap_bytes, rep.config.grad_dtype,
            ));
        }
    }
}

struct Inflight {
    started: Instant,
    handle: JoinHandle<(Result<Vec<f32>, CollectiveError>, Instant)>,
}

struct GradRef<B: Backend> {
    tensor: TensorRef<DataParallel<B>>,
    shape: Shape,
    dtype: DType,
}

impl SyncState {
    /// Replaces the known parameters (module order) with `params`; called by `replicate`.
    pub(crate) fn set_params(&mut self, params: Vec<ParamInfo>) {
        self.index = params.iter().enumerate().map(|(i, p)| (p.id, i)).collect();
        self.params = params;
        self.plan = None;
        self.agreed = None;
        self.accum = None;
        self.residual.clear();
    }

    fn plan(&mut self, rep: &Replica) -> Option<Arc<BucketPlan>> {
        if self.plan.is_none() {
            let numels: Option<Vec<usize>> = self.params.iter().map(|p| p.numel).collect();
            let elem = match rep.config.grad_dtype {
                GradDType::F32 => 4,
                GradDType::Bf16 => 2,
            };
            let plan = BucketPlan::new(
                &numels?,
                elem,
                rep.config.bucket_cap_bytes,
                rep.config.first_bucket_cap_bytes,
            );
            self.residual = plan.buckets().iter().map(|b| vec![0.0; b.len]).collect();
            self.plan = Some(Arc::new(plan));
        }
        self.plan.clone()
    }

    /// Starts, once per plan, the check that every rank planned the same buckets over the same
    /// parameters: an all-gather of the plan's fingerprint, finished by [`Agreement::check`].
    /// It does not wait: Burn runs the first two hooks under its autodiff graph lock, which other
    /// ranks of the same process take after every backward, so waiting here on a peer could
    /// deadlock ranks run as threads.
    fn agree(&mut self, rep: &Replica) -> Option<Agreement> {
        let mut words = vec![
            rep.config.bucket_cap_bytes as u64,
            rep.config.grad_dtype as u64,
        ];
        for p in &self.params {
            words.push(p.id);
            words.push(p.numel.unwrap_or(u64::MAX as usize) as u64);
        }
        let fp = stable_hash(&words);
        let first = self.agreed != Some(fp);
        self.agreed = Some(fp);
        (first && rep.comm.size() > 1).then(|| Agreement {
            work: rep.comm.all_gather(vec![fp as i64]),
            params: self.params.len(),
            elements: self.params.iter().filter_map(|p| p.numel).sum(),
        })
    }

    /// Forgets the accumulated gradients.
    pub(crate) fn discard_accumulated(&mut self) {
        self.accum = None;
    }

    /// Adds `grad` to the accumulated gradient of parameter `id` (registering it if new).
    pub(crate) fn accumulate(&mut self, id: u64, name: impl FnOnce() -> String, grad: &[f32]) {
        let i = match self.index.get(&id) {
            Some(&i) => i,
            None => {
                let i = self.params.len();
                self.index.insert(id, i);
                self.params.push(ParamInfo {
                    id,
                    numel: Some(grad.len()),
                    name: name(),
                });
                self.plan = None;
                i
            }
        };
        self.params[i].numel.get_or_insert(grad.len());
        let n = self.params.len();
        let accum = self.accum.get_or_insert_with(Vec::new);
        accum.resize_with(n, Vec::new);
        let a = &mut accum[i];
        if a.is_empty() {
            a.extend_from_slice(grad);
        } else {
            for (x, g) in a.iter_mut().zip(grad) {
                *x += g;
            }
        }
    }

    /// The pre-filled buffers of a step over `plan`: accumulated sums (or zeros), flags zero.
    fn fresh_buffers(&self, plan: &BucketPlan) -> Vec<Vec<f32>> {
        plan.buckets()
            .iter()
            .map(|b| {
                let mut buf = vec![0.0f32; b.len + b.params.len()];
                if let Some(accum) = &self.accum {
                    for (&p, &off) in b.params.iter().zip(&b.offsets) {
                        if let Some(a) = accum.get(p) {
                            buf[off..off + a.len()].copy_from_slice(a);
                        }
                    }
                }
                buf
            })
            .collect()
    }
}

/// `register_sync_parameters`: backward is starting over these parameters.
pub(crate) fn begin<B: Backend>(device: &B::Device, params: Vec<DistributedParams>) {
    let rep = context::for_device(device);
    let mut st = rep.state();
    if quiet() || (rep.comm.size() == 1 && st.accum.is_none()) {
        // `accumulate`'s own backward, or a pass-through: nothing to average, nothing
        // accumulated.
        st.step = None;
        return;
    }
    let mut new: Vec<u64> = params
        .iter()
        .map(|p| id_of(p.param_id))
        .filter(|id| !st.index.contains_key(id))
        .collect();
    if !new.is_empty() {
        // Parameters `replicate` did not register (burn-train's sharder marks them itself):
        // ordered by id, which clones of one module share.
        new.sort_unstable();
        new.dedup();
        for id in new {
            let i = st.params.len();
            st.index.insert(id, i);
            st.params.push(ParamInfo {
                id,
                numel: None,
                name: format!("parameter {id:#018x}"),
            });
        }
        st.plan = None;
        let n = st.params.len();
        if let Some(accum) = &mut st.accum {
            accum.resize_with(n, Vec::new);
        }
    }
    let plan = st.plan(&rep);
    let n = st.params.len();
    let mut step = Step {
        started: Instant::now(),
        plan: plan.clone(),
        buffers: Vec::new(),
        remaining: Vec::new(),
        launched: Vec::new(),
        pending: Vec::new(),
        packed: 0,
        agreement: None,
        refs: Box::new((0..n).map(|_| None).collect::<Vec<Option<GradRef<B>>>>()),
        bytes: 0,
    };
    if let Some(plan) = &plan {
        step.agreement = st.agree(&rep);
        step.buffers = st.fresh_buffers(plan);
        step.remaining = vec![0; plan.buckets().len()];
        step.pending = vec![Vec::new(); plan.buckets().len()];
        for p in &params {
            let i = st.index[&id_of(p.param_id)];
            step.remaining[plan.place(i).0] += 1;
        }
        launch_ready(&rep, &mut st.residual, &mut step);
    }
    st.step = Some(step);
}

/// `submit_gradient_sync`: one parameter's gradient is final.
pub(crate) fn gradient<B: Backend>(tensor: TensorRef<DataParallel<B>>, param: DistributedParams) {
    // SAFETY: Burn hands us a pointer into its gradient container, valid and not otherwise
    // accessed until backward returns.
    let device = B::float_device(unsafe { &*tensor.0 });
    let rep = context::for_device(&device);
    let mut st = rep.state();
    let SyncState {
        index,
        params,
        residual,
        step,
        ..
    } = &mut *st;
    let Some(step) = step.as_mut() else {
        return;
    };
    let id = id_of(param.param_id);
    let Some(&i) = index.get(&id) else {
        rep.fail(format!(
            "a gradient arrived for parameter {id:#018x}, which was not registered when backward started"
        ));
    };
    let shape = unsafe { burn_backend::TensorMetadata::shape(&*tensor.0) };
    let dtype = unsafe { burn_backend::TensorMetadata::dtype(&*tensor.0) };
    // With a plan, a device gradient waits for the rest of its bucket to be packed with it.
    let on_device =
        step.plan.is_some() && rep.config.device_pack && lane::supports::<B>(unsafe { &*tensor.0 });
    let grad = (!on_device).then(|| read::<B>(&rep, &tensor));
    let n = shape.num_elements();
    match params[i].numel {
        Some(known) if known != n => rep.fail(format!(
            "{} changed size from {known} to {n} elements",
            params[i].name
        )),
        _ => params[i].numel = Some(n),
    }
    let refs = step
        .refs
        .downcast_mut::<Vec<Option<GradRef<B>>>>()
        .expect("one backend per rank");
    refs[i] = Some(GradRef {
        tensor,
        shape,
        dtype,
    });
    if let Some(plan) = step.plan.clone() {
        let b = match grad {
            Some(grad) => add_to_bucket(&plan, &mut step.buffers, i, &grad),
            None => {
                let b = plan.place(i).0;
                step.pending[b].push(i);
                b
            }
        };
        step.remaining[b] = step.remaining[b].saturating_sub(1);
        if step.remaining[b] == 0 {
            flush::<B>(&rep, &plan, step, b);
        }
        launch_ready(&rep, residual, step);
    }
}

/// Adds bucket `b`'s gradients that wait on the device to its host buffer: one launch of the
/// fused pack kernel and one transfer (the host path, gradient by gradient, if the lane turns
/// them down).
fn flush<B: Backend>(rep: &Replica, plan: &BucketPlan, step: &mut Step, b: usize) {
    let Some(pending) = step.pending.get_mut(b).map(std::mem::take) else {
        return;
    };
    if pending.is_empty() {
        return;
    }
    let refs = step
        .refs
        .downcast_ref::<Vec<Option<GradRef<B>>>>()
        .expect("one backend per rank");
    let tensors: Vec<&TensorRef<DataParallel<B>>> = pending
        .iter()
        .map(|&i| {
            &refs[i]
                .as_ref()
                .expect("a pending gradient has arrived")
                .tensor
        })
        .collect();
    // SAFETY: as in `gradient`.
    let grads: Vec<FloatTensor<B>> = tensors.iter().map(|t| unsafe { (*t.0).clone() }).collect();
    match lane::pack_read::<B>(&grads) {
        Some(Ok(values)) => {
            let mut at = 0;
            for (&i, g) in pending.iter().zip(&grads) {
                let n = burn_backend::TensorMetadata::shape(g).num_elements();
                add_to_bucket(plan, &mut step.buffers, i, &values[at..at + n]);
                at += n;
            }
            step.packed += 1;
        }
        Some(Err(e)) => rep.fail(format!("bucket {b} of {}: {e}", plan.buckets().len())),
        None => {
            for (&i, t) in pending.iter().zip(tensors) {
                let grad = read::<B>(rep, t);
                add_to_bucket(plan, &mut step.buffers, i, &grad);
            }
        }
    }
}

/// `submit_sync_collective`: backward is done; finish every bucket and write the averages back.
pub(crate) fn finish<B: Backend>(device: &B::Device) {
    let rep = context::for_device(device);
    let mut st = rep.state();
    let Some(mut step) = st.step.take() else {
        return;
    };
    let backward_end = Instant::now();
    if let Some(plan) = step.plan.clone() {
        // Buckets some of whose parameters got no gradient in this backward.
        for b in 0..plan.buckets().len() {
            flush::<B>(&rep, &plan, &mut step, b);
        }
    }
    let mut refs = *std::mem::replace(&mut step.refs, Box::new(()))
        .downcast::<Vec<Option<GradRef<B>>>>()
        .expect("one backend per rank");

    if step.plan.is_none() {
        // First sight of some parameters: their sizes are known now. Plan, agree, and read
        // every gradient into the new layout.
        let Some(plan) = st.plan(&rep) else {
            let missing: Vec<&str> = st
                .params
                .iter()
                .filter(|p| p.numel.is_none())
                .map(|p| p.name.as_str())
                .collect();
            rep.fail(format!(
                "no gradient arrived for {missing:?} in its first backward; call \
                 bonfire::replicate(model) before training so sizes are known up front"
            ));
        };
        step.agreement = st.agree(&rep);
        step.buffers = st.fresh_buffers(&plan);
        step.remaining = vec![0; plan.buckets().len()];
        for (i, r) in refs.iter().enumerate() {
            if let Some(r) = r {
                let grad = read::<B>(&rep, &r.tensor);
                add_to_bucket(&plan, &mut step.buffers, i, &grad);
            }
        }
        step.plan = Some(plan);
    }
    let plan = step.plan.clone().expect("planned above");

    st.accum = None;

    for r in step.remaining.iter_mut() {
        *r = 0;
    }
    let SyncState {
        residual, params, ..
    } = &mut *st;
    launch_ready(&rep, residual, &mut step);

    // Outside Burn's graph lock now: safe to wait on peers.
    if let Some(agreement) = step.agreement.take() {
        agreement.check(&rep);
    }
    let world = rep.comm.size();
    let mut intervals = Vec::with_capacity(step.launched.len());
    for (b, inflight) in step.launched.drain(..).enumerate() {
        let (result, done) = match runtime().block_on(inflight.handle) {
            Ok(r) => r,
            Err(e) => rep.fail(format!("bucket {b}'s all-reduce task failed: {e}")),
        };
        intervals.push((inflight.started, done));
        let reduced = match result {
            Ok(v) => v,
            Err(e) => rep.fail(format!(
                "all-reduce of gradient bucket {b} of {} ({} elements): {e}",
                plan.buckets().len(),
                plan.buckets()[b].len
            )),
        };
        let bucket = &plan.buckets()[b];
        for (k, &p) in bucket.params.iter().enumerate() {
            let share = if rep.mean {
                reduced[bucket.len + k]
            } else {
                reduced[bucket.len + k] / world as f32
            };
            if share > 0.5 / world as f32 && share < 1.0 - 0.5 / world as f32 {
                rep.fail(format!(
                    "{} ({} elements) has a gradient on {:.0} of {world} ranks in this step: \
                     every rank must use every parameter it trains in every step",
                    params[p].name,
                    params[p].numel.unwrap_or(0),
                    share * world as f32
                ));
            }
        }
        if rep.config.device_pack && write_back_on_device::<B>(&rep, &plan, b, &reduced, &mut refs)
        {
            continue;
        }
        for (&p, &off) in bucket.params.iter().zip(&bucket.offsets) {
            if let Some(r) = refs[p].take() {
                let n = r.shape.num_elements();
                let t = from_host::<B>(reduced[off..off + n].to_vec(), r.shape, r.dtype, device);
                // SAFETY: as in `gradient`; backward has not returned yet.
                unsafe { *r.tensor.0 = t };
            }
        }
    }
    let stats = StepStats {
        steps: 1,
        backward: backward_end - step.started,
        communication: union(&intervals),
        exposed: intervals
            .iter()
            .map(|&(_, done)| done.saturating_duration_since(backward_end))
            .max()
            .unwrap_or_default(),
        bytes: step.bytes,
        buckets: intervals.len() as u64,
        device_packed: step.packed,
    };
    drop(st);
    rep.record(stats);
}

/// Writes bucket `b`'s averages into its gradients with one upload and one launch of the fused
/// unpack kernel, when they live on a CubeCL device in f32. False (nothing written) otherwise.
fn write_back_on_device<B: Backend>(
    rep: &Replica,
    plan: &BucketPlan,
    b: usize,
    reduced: &[f32],
    refs: &mut [Option<GradRef<B>>],
) -> bool {
    let bucket = &plan.buckets()[b];
    let present: Vec<usize> = bucket
        .params
        .iter()
        .copied()
        .filter(|&p| refs[p].is_some())
        .collect();
    let Some(&first) = present.first() else {
        return false;
    };
    // SAFETY: as in `gradient`; backward has not returned yet.
    let like = unsafe { &*refs[first].as_ref().expect("present").tensor.0 };
    if !lane::supports::<B>(like)
        || present
            .iter()
            .any(|&p| refs[p].as_ref().is_some_and(|r| r.dtype != DType::F32))
    {
        return false;
    }
    // One output per parameter of the bucket (the unpack fills the whole bucket); those without
    // a gradient in this step are dropped.
    let shapes: Vec<Shape> = (0..bucket.params.len())
        .map(|k| match &refs[bucket.params[k]] {
            Some(r) => r.shape.clone(),
            None => {
                let end = bucket.offsets.get(k + 1).copied().unwrap_or(bucket.len);
                Shape::new([end - bucket.offsets[k]])
            }
        })
        .collect();
    let tensors = match lane::upload_unpack::<B>(like, &reduced[..bucket.len], &shapes) {
        None => return false,
        Some(Ok(t)) => t,
        Some(Err(e)) => rep.fail(format!("bucket {b} of {}: {e}", plan.buckets().len())),
    };
    for (&p, t) in bucket.params.iter().zip(tensors) {
        if let Some(r) = refs[p].take() {
            // SAFETY: as in `gradient`; backward has not returned yet.
            unsafe { *r.tensor.0 = t };
        }
    }
    true
}

/// Adds parameter `i`'s gradient into its place in its bucket and raises its presence flag.
/// Returns the bucket.
fn add_to_bucket(plan: &BucketPlan, buffers: &mut [Vec<f32>], i: usize, grad: &[f32]) -> usize {
    let (b, off) = plan.place(i);
    let bucket = &plan.buckets()[b];
    let buf = &mut buffers[b];
    for (dst, g) in buf[off..off + grad.len()].iter_mut().zip(grad) {
        *dst += g;
    }
    buf[bucket.len + plan.slot(i)] = 1.0;
    b
}

/// Starts, in bucket order, every bucket whose gradients have all arrived.
fn launch_ready(rep: &Replica, residual: &mut [Vec<f32>], step: &mut Step) {
    let Some(plan) = step.plan.clone() else {
        return;
    };
    while step.launched.len() < plan.buckets().len() && step.remaining[step.launched.len()] == 0 {
        let b = step.launched.len();
        let buf = std::mem::take(&mut step.buffers[b]);
        let op = if rep.mean {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        let comm = rep.comm.clone();
        let handle = match rep.config.grad_dtype {
            GradDType::F32 => {
                step.bytes += (buf.len() * 4) as u64;
                let work = comm.all_reduce(buf, op);
                runtime().spawn(async move {
                    let r = work.await;
                    (r, Instant::now())
                })
            }
            GradDType::Bf16 => {
                let len = plan.buckets()[b].len;
                let res = &mut residual[b];
                let mut send = Vec::with_capacity(buf.len());
                for (i, &x) in buf.iter().enumerate() {
                    if i < len {
                        let want = x + res[i];
                        let sent = bf16::from_f32(want);
                        res[i] = want - sent.to_f32();
                        send.push(sent);
                    } else {
                        send.push(bf16::from_f32(x));
                    }
                }
                step.bytes += (send.len() * 2) as u64;
                let work = comm.all_reduce(send, op);
                runtime().spawn(async move {
                    let r = work
                        .await
                        .map(|v| v.into_iter().map(|x| x.to_f32()).collect::<Vec<f32>>());
                    (r, Instant::now())
                })
            }
        };
        step.launched.push(Inflight {
            started: Instant::now(),
            handle,
        });
    }
}

/// Reads a gradient to host memory as f32.
fn read<B: Backend>(rep: &Replica, tensor: &TensorRef<DataParallel<B>>) -> Vec<f32> {
    // SAFETY: see `gradient`.
    to_host::<B>(rep, unsafe { (*tensor.0).clone() }, "a gradient")
}

/// A float tensor's values in host memory, as f32 (`what` names it in errors).
pub(crate) fn to_host<B: Backend>(rep: &Replica, t: FloatTensor<B>, what: &str) -> Vec<f32> {
    let data = match futures::executor::block_on(B::float_into_data(t)) {
        Ok(d) => d,
        Err(e) => rep.fail(format!("cannot read {what} from the device: {e}")),
    };
    let data = if data.dtype == DType::F32 {
        data
    } else {
        data.convert::<f32>()
    };
    match data.into_vec::<f32>() {
        Ok(v) => v,
        Err(e) => rep.fail(format!("cannot read {what} as f32: {e:?}")),
    }
}

/// A float tensor of `shape` and `dtype` on `device`, from f32 values.
pub(crate) fn from_host<B: Backend>(
    values: Vec<f32>,
    shape: Shape,
    dtype: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    let mut data = TensorData::new(values, shape);
    if dtype != DType::F32 {
        data = data.convert_dtype(dtype);
    }
    B::float_from_data(data, device)
}

/// The number inside a parameter id (Burn keeps it private; it is serialised as the bare number).
pub(crate) fn id_of(id: burn_backend::distributed::DistributedParamId) -> u64 {
    postcard::to_stdvec(&id)
        .ok()
        .and_then(|bytes| postcard::from_bytes::<u64>(&bytes).ok())
        .expect("a DistributedParamId serialises as its u64")
}

/// Total length of the union of time intervals.
fn union(intervals: &[(Instant, Instant)]) -> Duration {
    let mut v: Vec<(Instant, Instant)> = intervals.to_vec();
    v.sort();
    let mut total = Duration::ZERO;
    let mut cur: Option<(Instant, Instant)> = None;
    for (s, e) in v {
        match cur {
            Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                cur = Some((s, e));
            }
            None => cur = Some((s, e)),
        }
    }
    if let Some((cs, ce)) = cur {
        total += ce - cs;
    }
    total
}
