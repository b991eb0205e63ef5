//! The gradient synchroniser behind `DataParallel`'s `DistributedBackend` impl: buckets filled as
//! backward produces gradients, all-reduced in order in the background (under ZeRO stage 2,
//! reduce-scattered to the gradients' owners; under stage 3, reduce-scattered so that each rank
//! receives its slice of every gradient: [`super::scatter`]), written back before backward
//! returns.
//!
//! On CubeCL inner backends (wgpu, CUDA, plain or fused) a bucket's gradients are packed on the
//! device by the fused pack kernel once the last of them is final, and cross to the host in one
//! transfer; the averaged bucket comes back in one transfer and the fused unpack kernel writes it
//! into the gradients ([`super::device_pack`]). Other inner backends read each gradient to the host
//! (`float_into_data`), the path every backend supports. Each bucket carries one presence flag per
//! parameter after its data, so a parameter that has a gradient on some ranks but not others is
//! caught (and named) instead of silently averaged with nothing.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bonfire_collectives::{Communicator, Element, Work};
use bonfire_kernels::reference::pack_with_feedback_reference;
use bonfire_topology::{Bucket, BucketPlan, ReduceOp};
use burn_backend::distributed::{DistributedParams, TensorRef};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape, TensorData};
use half::bf16;

use super::DataParallel;
use super::config::{GradDType, Overlap};
use super::context::Replica;
use super::device_pack;
use super::error::SyncError;
use super::local;
use super::scatter::{GradOwners, Scatter, slot_len};
use super::state::{Agreement, Inflight, ParamInfo, Reduction, Step, SyncState};
use super::stats::{BucketTimes, LatePeer, StepStats};

thread_local! {
    static NO_SYNC: Cell<u32> = const { Cell::new(0) };
}

/// While the guard lives, backward passes on this thread leave their gradients alone: no buckets,
/// no communication, as inside PyTorch DDP's `no_sync()`. The gradients backward returns are
/// this rank's only; hand them to [`crate::keep_gradients`] so that the next synchronised
/// backward includes them ([`crate::accumulate`] does both, and marks the parameters again).
/// Gradients of a `no_sync` backward that were not kept stop every rank at its next backward
/// ([`SyncError::GradientsNotKept`](crate::SyncError::GradientsNotKept)): summed outside
/// bonfire, they would make the replicas differ.
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

struct GradRef<B: Backend> {
    tensor: TensorRef<DataParallel<B>>,
    shape: Shape,
    dtype: DType,
}

/// Waits for every rank's plan fingerprint; fails naming the ranks that differ from rank 0.
fn check_agreement(agreement: Agreement, rep: &Replica) {
    let all = match agreement.work.wait() {
        Ok(all) => all,
        Err(e) => rep.fail(SyncError::PlanCheck(e)),
    };
    let ranks: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
    if !ranks.is_empty() {
        rep.fail(SyncError::PlanMismatch {
            ranks,
            params: agreement.params,
            elements: agreement.elements,
            cap_bytes: rep.config.bucket_cap_bytes,
            dtype: rep.config.grad_dtype,
        });
    }
}

/// `register_sync_parameters`: backward is starting over these parameters.
pub(crate) fn begin<B: Backend>(rep: &Replica, params: Vec<DistributedParams>) {
    let mut st = rep.state();
    if let Some(marked) = st.unkept.take() {
        // The backward after an unkept `no_sync` one was not marked (Burn's autodiff drops the
        // marks in every backward), so it averaged nothing: the last optimizer step took this
        // rank's gradients alone. Refuse before the replicas drift further apart.
        drop(st);
        rep.fail(SyncError::GradientsNotKept {
            params: marked,
            world: rep.comm.size(),
        });
    }
    if quiet() || (!rep.synchronises() && st.accum.is_none()) {
        // `accumulate`'s own backward, or a pass-through: nothing to average, nothing
        // accumulated. A `no_sync` backward's gradients count only once kept.
        if quiet() && rep.synchronises() {
            st.unkept = Some(params.len());
        }
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
    let plan = st.plan(&rep.config);
    let n = st.params.len();
    // The same on every rank: the configuration, the ZeRO stage and whether gradients were
    // accumulated are the job's, and a lane some rank could not join is off on all of them.
    #[cfg(feature = "cuda")]
    let use_lane = rep.config.device_lane
        && rep.config.device_pack
        && rep.config.grad_dtype == GradDType::F32
        && rep.comm.size() > 1
        && st.owners.is_none()
        && st.accum.is_none()
        && rep.lane.usable();
    #[cfg(not(feature = "cuda"))]
    let use_lane = false;
    let mut step = Step {
        started: Instant::now(),
        plan: plan.clone(),
        buffers: Vec::new(),
        remaining: Vec::new(),
        arrivals: Vec::new(),
        ready: Vec::new(),
        launched: Vec::new(),
        pending: Vec::new(),
        packed: 0,
        use_lane,
        lane: Vec::new(),
        agreement: None,
        refs: Box::new((0..n).map(|_| None).collect::<Vec<Option<GradRef<B>>>>()),
        bytes: 0,
        received: 0,
    };
    if let Some(plan) = &plan {
        step.agreement = st.agree(&rep.comm, &rep.config);
        step.buffers = st.fresh_buffers(plan);
        step.remaining = vec![0; plan.buckets().len()];
        step.ready = vec![None; plan.buckets().len()];
        step.pending = vec![Vec::new(); plan.buckets().len()];
        step.lane = (0..plan.buckets().len()).map(|_| None).collect();
        for p in &params {
            let i = st.index[&id_of(p.param_id)];
            step.remaining[plan.place(i).0] += 1;
        }
        let SyncState {
            residual,
            owners,
            params,
            ..
        } = &mut *st;
        launch_ready::<B>(rep, residual, owners.as_deref(), params, &mut step, false);
    }
    st.step = Some(step);
}

/// `submit_gradient_sync`: one parameter's gradient is final.
pub(crate) fn gradient<B: Backend>(
    rep: &Replica,
    tensor: TensorRef<DataParallel<B>>,
    param: DistributedParams,
) {
    let mut st = rep.state();
    let SyncState {
        index,
        params,
        residual,
        owners,
        step,
        ..
    } = &mut *st;
    let owners = owners.as_deref();
    let Some(step) = step.as_mut() else {
        return;
    };
    let id = id_of(param.param_id);
    let Some(&i) = index.get(&id) else {
        rep.fail(SyncError::UnknownParameter { id });
    };
    if step.plan.is_none() {
        // The planning step: the order gradients come in is the plan's.
        step.arrivals.push(i);
    }
    let shape = local::shape::<B>(unsafe { &*tensor.0 });
    let dtype = unsafe { burn_backend::TensorMetadata::dtype(&*tensor.0) };
    // With a plan, a device gradient waits for the rest of its bucket to be packed with it.
    let on_device = step.plan.is_some()
        && rep.config.device_pack
        && device_pack::supports::<B>(unsafe { &*tensor.0 });
    // Without a plan (the first synchronised backward) every gradient is read at the end.
    let grad = (step.plan.is_some() && !on_device).then(|| read::<B>(rep, &tensor));
    let n = shape.num_elements();
    match params[i].numel {
        Some(known) if known != n => rep.fail(SyncError::SizeChanged {
            param: params[i].name.clone(),
            from: known,
            to: n,
        }),
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
            Some(grad) => {
                let b = add_to_bucket(&plan, &mut step.buffers, i, &grad);
                release_unowned(owners, params, refs, i);
                b
            }
            None => {
                let b = plan.place(i).0;
                step.pending[b].push(i);
                b
            }
        };
        step.remaining[b] = step.remaining[b].saturating_sub(1);
        if step.remaining[b] == 0 {
            step.ready[b] = Some(Instant::now());
            flush::<B>(rep, &plan, step, b, owners, params);
        }
        launch_ready::<B>(rep, residual, owners, params, step, false);
        if rep.config.overlap == Overlap::Hooks {
            for inflight in &step.launched {
                for work in [&inflight.work, &inflight.whole].into_iter().flatten() {
                    work.progress();
                }
            }
        }
    }
}

/// Adds bucket `b`'s gradients that wait on the device to its host buffer: one launch of the
/// fused pack kernel and one transfer (the host path, gradient by gradient, if packing turns
/// them down). Under ZeRO stage 2 the gradients other ranks own are freed once read.
fn flush<B: Backend>(
    rep: &Replica,
    plan: &BucketPlan,
    step: &mut Step,
    b: usize,
    owners: Option<&GradOwners>,
    params: &[ParamInfo],
) {
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
    if step.use_lane {
        let offsets: Vec<usize> = pending.iter().map(|&i| plan.place(i).1).collect();
        match device_pack::pack_for_lane::<B>(&grads, &offsets) {
            Some(Ok(packed)) => {
                // The gradients stay on the device; the host buffer carries the flags.
                for &i in &pending {
                    raise_flag(plan, &mut step.buffers, i);
                }
                step.lane[b] = Some(packed);
                step.packed += 1;
                return;
            }
            Some(Err(source)) => rep.fail(SyncError::DevicePack {
                bucket: b,
                buckets: plan.buckets().len(),
                stage: "packing",
                source,
            }),
            None => {}
        }
    }
    match device_pack::pack_read::<B>(&grads) {
        Some(Ok(values)) => {
            let mut at = 0;
            for (&i, g) in pending.iter().zip(&grads) {
                let n = burn_backend::TensorMetadata::shape(g).num_elements();
                add_to_bucket(plan, &mut step.buffers, i, &values[at..at + n]);
                at += n;
            }
            step.packed += 1;
        }
        Some(Err(source)) => rep.fail(SyncError::DevicePack {
            bucket: b,
            buckets: plan.buckets().len(),
            stage: "packing",
            source,
        }),
        None => {
            for (&i, t) in pending.iter().zip(tensors) {
                let grad = read::<B>(rep, t);
                add_to_bucket(plan, &mut step.buffers, i, &grad);
            }
        }
    }
    let refs = step
        .refs
        .downcast_mut::<Vec<Option<GradRef<B>>>>()
        .expect("one backend per rank");
    for &i in &pending {
        release_unowned(owners, params, refs, i);
    }
}

/// Under ZeRO stage 2 ([`GradOwners`]), frees parameter `i`'s gradient when another rank owns
/// it: its values are in the bucket, which goes to the owner, and nothing on this rank reads it
/// again.
fn release_unowned<B: Backend>(
    owners: Option<&GradOwners>,
    params: &[ParamInfo],
    refs: &mut [Option<GradRef<B>>],
    i: usize,
) {
    if let Some(owners) = owners
        && !owners.owns(params[i].id)
        && let Some(r) = refs[i].take()
    {
        release(r);
    }
}

/// Replaces a gradient with an empty tensor of its rank and dtype (its first dimension 0): what
/// a rank holds of a gradient another rank owns under ZeRO stage 2. The sharded optimizer drops
/// it before its step.
fn release<B: Backend>(r: GradRef<B>) {
    // SAFETY: as in `gradient`; backward has not returned yet.
    let device = B::float_device(unsafe { &*r.tensor.0 });
    let mut shape = r.shape;
    if let Some(first) = shape.first_mut() {
        *first = 0;
    }
    let empty = from_host::<B>(Vec::new(), shape, r.dtype, &device, None, None);
    // SAFETY: as above.
    unsafe { *r.tensor.0 = empty };
}

/// `submit_sync_collective`: backward is done; finish every bucket and write the averages back.
pub(crate) fn finish<B: Backend>(rep: &Replica, device: &B::Device) {
    let mut st = rep.state();
    let Some(mut step) = st.step.take() else {
        return;
    };
    let backward_end = Instant::now();
    let owners = st.owners.clone();
    if let Some(plan) = step.plan.clone() {
        // Buckets some of whose parameters got no gradient in this backward.
        for b in 0..plan.buckets().len() {
            flush::<B>(rep, &plan, &mut step, b, owners.as_deref(), &st.params);
        }
    }
    let mut refs = *std::mem::replace(&mut step.refs, Box::new(()))
        .downcast::<Vec<Option<GradRef<B>>>>()
        .expect("one backend per rank");

    let planning = step.plan.is_none();
    if planning {
        // First sight of some parameters, or the first synchronised backward: their sizes and
        // the order their gradients come in are known now. Plan, agree, and read every gradient
        // into the new layout.
        if st.order.is_none() {
            // Every rank's parameters first, so that a rank with another model is named (the
            // order's broadcast would only say its size differs).
            if let Some(agreement) = st.agree(&rep.comm, &rep.config) {
                check_agreement(agreement, rep);
            }
            let n = st.params.len();
            st.order = Some(agree_order(rep, n, &step.arrivals));
        }
        let Some(plan) = st.plan(&rep.config) else {
            let params = st
                .params
                .iter()
                .filter(|p| p.numel.is_none())
                .map(|p| p.name.clone())
                .collect();
            rep.fail(SyncError::NoGradient { params });
        };
        step.agreement = st.agree(&rep.comm, &rep.config);
        step.buffers = st.fresh_buffers(&plan);
        step.remaining = vec![0; plan.buckets().len()];
        step.ready = vec![None; plan.buckets().len()];
        for (i, r) in refs.iter().enumerate() {
            if let Some(r) = r {
                let grad = read::<B>(rep, &r.tensor);
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
    for r in step.ready.iter_mut() {
        r.get_or_insert(backward_end);
    }
    let SyncState {
        residual, params, ..
    } = &mut *st;
    launch_ready::<B>(rep, residual, owners.as_deref(), params, &mut step, true);

    // Outside Burn's graph lock now: safe to wait on peers.
    if let Some(agreement) = step.agreement.take() {
        check_agreement(agreement, rep);
    }
    let mut intervals = Vec::with_capacity(step.launched.len());
    let mut timeline = Vec::with_capacity(step.launched.len());
    let mut late_peers = BTreeMap::new();
    let mut lanes = 0;
    let last_bucket = step.launched.len().saturating_sub(1);
    let since = |at: Instant| at.saturating_duration_since(step.started);
    for (b, inflight) in step.launched.drain(..).enumerate() {
        let Inflight {
            ready,
            called,
            bytes,
            work,
            lane,
            scatter,
            whole,
        } = inflight;
        let work = match (work, lane) {
            (Some(work), _) => work,
            (None, Some(packed)) => {
                let started = Instant::now();
                match through_lane::<B>(rep, &plan, b, packed, params, &mut refs) {
                    None => {
                        lanes += 1;
                        let done = Instant::now();
                        intervals.push((called, done));
                        timeline.push(BucketTimes {
                            steps: 1,
                            bytes,
                            ready: since(ready),
                            called: since(called),
                            started: since(started),
                            peers: since(started),
                            finished: since(done),
                        });
                        continue;
                    }
                    // The ranks went without the lane: the bucket takes the host lane.
                    Some(work) => Reduction::F32(work),
                }
            }
            (None, None) => unreachable!("a launched bucket has host work or a lane bucket"),
        };
        let (result, times) = work.wait();
        let reduced = match (result, &scatter) {
            (Ok(v), _) => v,
            (Err(source), None) => rep.fail(SyncError::AllReduce {
                bucket: b,
                buckets: plan.buckets().len(),
                elements: plan.buckets()[b].len,
                source,
            }),
            (Err(source), Some(scatter)) => rep.fail(SyncError::ReduceScatter {
                bucket: b,
                buckets: plan.buckets().len(),
                elements: plan.buckets()[b].len,
                counts: scatter.counts().to_vec(),
                stage: if owners.is_some() { 2 } else { 3 },
                source,
            }),
        };
        // Under ZeRO stage 3, the gradients kept whole, all-reduced beside the reduce-scatter
        // (and waited on after it: a lost peer is reported by the reduce-scatter first).
        let whole = whole.map(|w| {
            let (result, times) = w.wait();
            let values = result.unwrap_or_else(|source| {
                rep.fail(SyncError::AllReduce {
                    bucket: b,
                    buckets: plan.buckets().len(),
                    elements: scatter
                        .as_ref()
                        .map_or(0, |s| s.whole_elements(&plan.buckets()[b])),
                    source,
                })
            });
            (values, times.finished)
        });
        let done = match &whole {
            Some((_, finished)) => times.finished.max(*finished),
            None => times.finished,
        };
        intervals.push((called, done));
        let own_end = backward_end.max(times.started);
        if b == last_bucket
            && let Some(peer) = times.last_peer
            && times.arrived > own_end
        {
            late_peers.insert(
                peer.index(),
                LatePeer {
                    steps: 1,
                    waited: times.arrived - own_end,
                },
            );
        }
        timeline.push(BucketTimes {
            steps: 1,
            bytes,
            ready: since(ready),
            called: since(called),
            started: since(times.started.max(called)),
            peers: since(times.arrived.max(called)),
            finished: since(done),
        });
        if let Some(scatter) = &scatter {
            let whole = whole.map(|(values, _)| values);
            let share = Share {
                scatter,
                reduced: &reduced,
                whole: whole.as_deref(),
            };
            write_back_share::<B>(rep, &plan, b, share, params, &mut refs, device);
            continue;
        }
        let bucket = &plan.buckets()[b];
        for (k, &p) in bucket.params.iter().enumerate() {
            check_presence(rep, &params[p], reduced[bucket.len + k]);
        }
        let slots: Vec<usize> = (0..bucket.params.len()).collect();
        if rep.config.device_pack
            && write_back_on_device::<B>(rep, &plan, b, &slots, &reduced[..bucket.len], &mut refs)
        {
            continue;
        }
        for (&p, &off) in bucket.params.iter().zip(&bucket.offsets) {
            if let Some(r) = refs[p].take() {
                let n = r.shape.num_elements();
                write_gradient::<B>(r, reduced[off..off + n].to_vec(), params[p].id, device);
            }
        }
    }
    if planning {
        // Every bucket of the planning step was read at the end: its times would say nothing
        // about the plan (and would skew the means in `total_stats`).
        timeline.clear();
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
        received: step.received,
        buckets: intervals.len() as u64,
        device_packed: step.packed,
        device_lane: lanes,
        timeline,
        late_peers,
    };
    drop(st);
    rep.record(stats);
}

/// Bucket `b`, packed on the device, through the device lane: set up at the first such bucket
/// (every rank together), then the bucket all-reduced in the ranks' windows and unpacked into
/// fresh gradients; its flags checked (`None`). Where the ranks went without the lane, the
/// bucket is read back and its host all-reduce started and returned instead.
fn through_lane<B: Backend>(
    rep: &Replica,
    plan: &BucketPlan,
    b: usize,
    packed: device_pack::LaneBucket,
    params: &[ParamInfo],
    refs: &mut [Option<GradRef<B>>],
) -> Option<bonfire_collectives::Work<Vec<f32>>> {
    let bucket = &plan.buckets()[b];
    let len = bucket.len;
    let op = if rep.mean {
        ReduceOp::Mean
    } else {
        ReduceOp::Sum
    };
    #[cfg(feature = "cuda")]
    {
        let slots: Vec<usize> = (0..bucket.params.len()).collect();
        let shapes = slot_shapes(bucket, &slots, refs);
        let first = bucket
            .params
            .iter()
            .find_map(|&p| refs[p].as_ref())
            .expect("a packed bucket has a gradient");
        // SAFETY: as in `gradient`; backward has not returned yet.
        let like = unsafe { &*first.tensor.0 };
        // The window holds the plan's largest bucket, so the lane is set up once per plan.
        let bytes = plan
            .buckets()
            .iter()
            .map(|bk| (bk.len + bk.params.len()) * 4)
            .max()
            .unwrap_or(0);
        let ordinal = packed.ordinal;
        let mut packed = Some(packed);
        let outcome = rep.lane.with(&rep.comm, ordinal, bytes, |lane| {
            let packed = packed.take().expect("taken once");
            device_pack::lane_all_reduce::<B>(
                lane,
                packed,
                len,
                super::lane::op(rep.mean),
                like,
                &shapes,
            )
        });
        match outcome {
            Some(Ok((flags, tensors))) => {
                for (k, &p) in bucket.params.iter().enumerate() {
                    check_presence(rep, &params[p], flags[k]);
                }
                for (&p, t) in bucket.params.iter().zip(tensors) {
                    if let Some(r) = refs[p].take() {
                        // SAFETY: as in `gradient`; backward has not returned yet.
                        unsafe { *r.tensor.0 = t };
                    }
                }
                None
            }
            Some(Err(detail)) => rep.fail(SyncError::DeviceLane {
                bucket: b,
                buckets: plan.buckets().len(),
                elements: len,
                detail,
            }),
            None => {
                let packed = packed.expect("the lane declined before taking it");
                let mut buf = match device_pack::lane_bucket_to_host(&packed, len) {
                    Ok(v) => v,
                    Err(source) => rep.fail(SyncError::DevicePack {
                        bucket: b,
                        buckets: plan.buckets().len(),
                        stage: "packing",
                        source,
                    }),
                };
                buf.extend_from_slice(&packed.flags);
                Some(rep.comm.all_reduce(buf, op))
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (rep, packed, params, refs, op, len);
        unreachable!("buckets are packed for the device lane in CUDA builds only")
    }
}

/// The order every rank plans its buckets in: the order in which rank 0's gradients became final
/// in this backward (PyTorch DDP likewise rebuilds its buckets in rank 0's observed order after
/// the first iteration). Parameters without a gradient on rank 0 are left out: the plan puts
/// them last.
fn agree_order(rep: &Replica, n: usize, arrivals: &[usize]) -> Vec<usize> {
    // Each parameter's position in the order, so that every rank sends a buffer of one size.
    let mut key = vec![i64::MAX; n];
    for (pos, &p) in arrivals.iter().enumerate() {
        if p < n && key[p] == i64::MAX {
            key[p] = pos as i64;
        }
    }
    if rep.comm.size() > 1 {
        key = match rep.comm.broadcast(key, 0).wait() {
            Ok(key) => key,
            Err(e) => rep.fail(SyncError::PlanCheck(e)),
        };
    }
    let mut order: Vec<usize> = (0..n).filter(|&p| key[p] != i64::MAX).collect();
    order.sort_by_key(|&p| key[p]);
    order
}

/// Fails naming `param` when its summed presence `flag` says that some ranks had a gradient for
/// it in this step and others had none.
fn check_presence(rep: &Replica, param: &ParamInfo, flag: f32) {
    let world = rep.comm.size();
    let share = if rep.mean { flag } else { flag / world as f32 };
    if share > 0.5 / world as f32 && share < 1.0 - 0.5 / world as f32 {
        rep.fail(SyncError::PartialGradient {
            param: param.name.clone(),
            elements: param.numel.unwrap_or(0),
            with: share * world as f32,
            world,
        });
    }
}

/// What a rank got back for a reduce-scattered bucket.
struct Share<'a> {
    /// The layout it was sent in.
    scatter: &'a Scatter,
    /// This rank's share: its values in the order of [`Scatter::mine`], then the presence flags
    /// of [`Scatter::my_flags`].
    reduced: &'a [f32],
    /// Under ZeRO stage 3, the all-reduced values of the gradients kept whole
    /// ([`Scatter::whole`]), one after another.
    whole: Option<&'a [f32]>,
}

/// Writes bucket `b`'s reduced `share` into this rank's gradients: under ZeRO stage 2 its own
/// gradients whole, and the gradients other ranks own that are still held (those read at the
/// end) are freed; under stage 3 its slice of every sharded gradient, placed as the parameter
/// is, and the gradients kept whole.
fn write_back_share<B: Backend>(
    rep: &Replica,
    plan: &BucketPlan,
    b: usize,
    share: Share<'_>,
    params: &[ParamInfo],
    refs: &mut [Option<GradRef<B>>],
    device: &B::Device,
) {
    let Share {
        scatter,
        reduced,
        whole,
    } = share;
    let bucket = &plan.buckets()[b];
    let mine = scatter.mine();
    let elements = scatter.my_elements();
    for (j, &k) in scatter.my_flags().iter().enumerate() {
        check_presence(rep, &params[bucket.params[k]], reduced[elements + j]);
    }
    let slots: Vec<usize> = mine.iter().map(|m| m.slot).collect();
    let whole_slots = mine.iter().all(|m| m.slice.is_none());
    if !(whole_slots
        && rep.config.device_pack
        && write_back_on_device::<B>(rep, plan, b, &slots, &reduced[..elements], refs))
    {
        let mut at = 0;
        for m in mine {
            let p = bucket.params[m.slot];
            let values = &reduced[at..at + m.elements];
            at += m.elements;
            let Some(r) = refs[p].take() else {
                continue;
            };
            let Some(split) = &m.slice else {
                write_gradient::<B>(r, values.to_vec(), params[p].id, device);
                continue;
            };
            let mut data = TensorData::new(values.to_vec(), split.local_shape());
            if r.dtype != DType::F32 {
                data = data.convert_dtype(r.dtype);
            }
            // SAFETY: as in `gradient`; backward has not returned yet.
            let t = local::write_slice::<B>(unsafe { &*r.tensor.0 }, data, split);
            // SAFETY: as above.
            unsafe { *r.tensor.0 = t };
        }
    }
    if let Some(whole) = whole {
        let mut at = 0;
        for &k in scatter.whole() {
            let p = bucket.params[k];
            let n = slot_len(bucket, k);
            if let Some(r) = refs[p].take() {
                write_gradient::<B>(r, whole[at..at + n].to_vec(), params[p].id, device);
            }
            at += n;
        }
    }
    for &p in &bucket.params {
        if let Some(r) = refs[p].take() {
            release(r);
        }
    }
}

/// Replaces the gradient `r` of parameter `param` (its id's number) with the averaged `values`
/// of the whole tensor, placed as the gradient was (see `local`).
fn write_gradient<B: Backend>(r: GradRef<B>, values: Vec<f32>, param: u64, device: &B::Device) {
    // SAFETY: as in `gradient`; backward has not returned yet.
    let like = unsafe { &*r.tensor.0 };
    let t = from_host::<B>(values, r.shape, r.dtype, device, Some(like), Some(param));
    // SAFETY: as above.
    unsafe { *r.tensor.0 = t };
}

/// Writes averages into the gradients of bucket `b`'s parameters at `slots` (positions among
/// the bucket's parameters; their values follow each other in `values`) with one upload and one
/// launch of the fused unpack kernel, when they live on a CubeCL device in f32. False (nothing
/// written) otherwise.
fn write_back_on_device<B: Backend>(
    rep: &Replica,
    plan: &BucketPlan,
    b: usize,
    slots: &[usize],
    values: &[f32],
    refs: &mut [Option<GradRef<B>>],
) -> bool {
    let bucket = &plan.buckets()[b];
    let present: Vec<usize> = slots
        .iter()
        .map(|&k| bucket.params[k])
        .filter(|&p| refs[p].is_some())
        .collect();
    let Some(&first) = present.first() else {
        return false;
    };
    // SAFETY: as in `gradient`; backward has not returned yet.
    let like = unsafe { &*refs[first].as_ref().expect("present").tensor.0 };
    if !device_pack::supports::<B>(like)
        || present
            .iter()
            .any(|&p| refs[p].as_ref().is_some_and(|r| r.dtype != DType::F32))
    {
        return false;
    }
    // One output per slot (the unpack fills all of `values`); those without a gradient in this
    // step are dropped.
    let shapes = slot_shapes(bucket, slots, refs);
    let tensors = match device_pack::upload_unpack::<B>(like, values, &shapes) {
        None => return false,
        Some(Ok(t)) => t,
        Some(Err(source)) => rep.fail(SyncError::DevicePack {
            bucket: b,
            buckets: plan.buckets().len(),
            stage: "unpacking",
            source,
        }),
    };
    for (&k, t) in slots.iter().zip(tensors) {
        if let Some(r) = refs[bucket.params[k]].take() {
            // SAFETY: as in `gradient`; backward has not returned yet.
            unsafe { *r.tensor.0 = t };
        }
    }
    true
}

/// The shapes to unpack a bucket's `slots` into: each gradient's own, or a flat slot for a
/// parameter without one in this step (its output is dropped).
fn slot_shapes<B: Backend>(
    bucket: &Bucket,
    slots: &[usize],
    refs: &[Option<GradRef<B>>],
) -> Vec<Shape> {
    slots
        .iter()
        .map(|&k| match &refs[bucket.params[k]] {
            Some(r) => r.shape.clone(),
            None => Shape::new([slot_len(bucket, k)]),
        })
        .collect()
}

/// Raises parameter `i`'s presence flag in its bucket's buffer (after the bucket's values).
fn raise_flag(plan: &BucketPlan, buffers: &mut [Vec<f32>], i: usize) {
    let (b, _) = plan.place(i);
    let len = plan.buckets()[b].len;
    buffers[b][len + plan.slot(i)] = 1.0;
}

/// Adds parameter `i`'s gradient into its place in its bucket and raises its presence flag.
/// Returns the bucket.
fn add_to_bucket(plan: &BucketPlan, buffers: &mut [Vec<f32>], i: usize, grad: &[f32]) -> usize {
    let (b, off) = plan.place(i);
    for (dst, g) in buffers[b][off..off + grad.len()].iter_mut().zip(grad) {
        *dst += g;
    }
    raise_flag(plan, buffers, i);
    b
}

/// Starts, in bucket order, every bucket whose gradients have all arrived (with
/// [`Overlap::End`], only once backward is `finishing`): an all-reduce, or under ZeRO stage 2
/// (`owners`) a reduce-scatter that sends each gradient to its owner, or under stage 3 (the
/// inner backend reports parameters sharded at rest over these ranks) a reduce-scatter that
/// sends each rank its slices, with an all-reduce of the gradients kept whole.
fn launch_ready<B: Backend>(
    rep: &Replica,
    residual: &mut [Vec<f32>],
    owners: Option<&GradOwners>,
    params: &[ParamInfo],
    step: &mut Step,
    finishing: bool,
) {
    let Some(plan) = step.plan.clone() else {
        return;
    };
    if rep.config.overlap == Overlap::End && !finishing {
        return;
    }
    let caller_driven;
    let comm = if rep.config.overlap == Overlap::Hooks {
        caller_driven = rep.comm.caller_driven();
        &caller_driven
    } else {
        &rep.comm
    };
    while step.launched.len() < plan.buckets().len() && step.remaining[step.launched.len()] == 0 {
        let b = step.launched.len();
        let buf = std::mem::take(&mut step.buffers[b]);
        let op = if rep.mean {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        let called = Instant::now();
        let ready = step.ready.get(b).copied().flatten().unwrap_or(called);
        let bytes_before = step.bytes;
        let bucket = &plan.buckets()[b];
        if let Some(mut packed) = step.lane.get_mut(b).and_then(Option::take) {
            // Through the device lane, once backward is done (`finish`): only the flags are
            // here.
            packed.flags = buf[bucket.len..].to_vec();
            step.bytes += (buf.len() * 4) as u64;
            step.received += (buf.len() * 4) as u64;
            step.launched.push(Inflight {
                ready,
                called,
                bytes: step.bytes - bytes_before,
                work: None,
                lane: Some(packed),
                scatter: None,
                whole: None,
            });
            continue;
        }
        let scatter = match owners {
            Some(owners) => Some(Scatter::owners(bucket, |p| params[p].id, owners)),
            None => Scatter::shards(
                bucket,
                |k| {
                    let param = &params[bucket.params[k]];
                    let split = local::shard_at_rest::<B>(param.id)?;
                    let (rank, ranks) = (rep.comm.rank(), rep.comm.size());
                    if (split.rank, split.ranks) != (rank, ranks) {
                        // Every rank must lay the bucket out alike: say so rather than send a
                        // reduce-scatter of another shape than the peers'.
                        rep.fail(SyncError::Sharded {
                            what: format!(
                                "{} is sharded at rest over a group in which this rank is {} of \
                                 {}, but its gradients are averaged over one in which it is \
                                 {rank} of {ranks}: fully_shard's group must be the \
                                 data-parallel group's ranks, in their order",
                                param.name, split.rank, split.ranks
                            ),
                            source: None,
                        });
                    }
                    Some(split)
                },
                rep.comm.rank(),
                rep.comm.size(),
            ),
        };
        let (work, whole) = match rep.config.grad_dtype {
            GradDType::F32 => {
                step.bytes += (buf.len() * 4) as u64;
                step.received += (received(&scatter, bucket, buf.len()) * 4) as u64;
                let (work, whole) = start(comm, bucket, scatter.as_ref(), buf, op);
                (Reduction::F32(work), whole.map(Reduction::F32))
            }
            GradDType::Bf16 => {
                // The gradients with error feedback (the arithmetic of the device kernel
                // `pack_with_feedback`, on the host), then the presence flags (0 or 1: exact).
                let len = bucket.len;
                let mut send: Vec<bf16> =
                    pack_with_feedback_reference(&[&buf[..len]], &mut residual[b], 1.0);
                send.extend(buf[len..].iter().map(|&x| bf16::from_f32(x)));
                step.bytes += (send.len() * 2) as u64;
                step.received += (received(&scatter, bucket, send.len()) * 2) as u64;
                let (work, whole) = start(comm, bucket, scatter.as_ref(), send, op);
                (Reduction::Bf16(work), whole.map(Reduction::Bf16))
            }
        };
        step.launched.push(Inflight {
            ready,
            called,
            bytes: step.bytes - bytes_before,
            work: Some(work),
            lane: None,
            scatter,
            whole,
        });
    }
}

/// Starts the reduction of bucket `buf` (its values in the bucket's layout, then its flags): an
/// all-reduce, or the reduce-scatter `scatter` lays out, with the all-reduce of the gradients it
/// keeps whole (ZeRO stage 3) when there are any.
fn start<T: Element>(
    comm: &Communicator,
    bucket: &Bucket,
    scatter: Option<&Scatter>,
    buf: Vec<T>,
    op: ReduceOp,
) -> (Work<Vec<T>>, Option<Work<Vec<T>>>) {
    let Some(s) = scatter else {
        return (comm.all_reduce(buf, op), None);
    };
    let work = comm.reduce_scatter_uneven(s.permute(bucket, &buf), s.counts(), op);
    let whole = s.whole_values(bucket, &buf).map(|w| comm.all_reduce(w, op));
    (work, whole)
}

/// Elements this rank receives reduced of a bucket of `len` elements (flags included), sent as
/// `scatter` lays it out (`None`: all-reduced).
fn received(scatter: &Option<Scatter>, bucket: &Bucket, len: usize) -> usize {
    match scatter {
        None => len,
        Some(s) => s.counts()[s.rank()] + s.whole_elements(bucket),
    }
}

/// Reads a gradient to host memory as f32.
fn read<B: Backend>(rep: &Replica, tensor: &TensorRef<DataParallel<B>>) -> Vec<f32> {
    // SAFETY: see `gradient`.
    to_host::<B>(rep, unsafe { (*tensor.0).clone() }, "a gradient")
}

/// A float tensor's values in host memory, as f32 (`what` names it in errors): this rank's part
/// of it (see `local`).
pub(crate) fn to_host<B: Backend>(rep: &Replica, t: FloatTensor<B>, what: &str) -> Vec<f32> {
    let data = match local::read::<B>(t) {
        Ok(d) => d,
        Err(e) => rep.fail(SyncError::Read {
            what: format!("{what} from the device"),
            reason: e.to_string(),
        }),
    };
    let data = if data.dtype == DType::F32 {
        data
    } else {
        data.convert::<f32>()
    };
    match data.into_vec::<f32>() {
        Ok(v) => v,
        Err(e) => rep.fail(SyncError::Read {
            what: format!("{what} as f32"),
            reason: format!("{e:?}"),
        }),
    }
}

/// A float tensor of `shape` and `dtype` on `device`, from f32 values: this rank's part of a
/// tensor placed as `like` (when given), or as parameter `param` (its id's number: the tensor is
/// its gradient) is placed (see `local`).
pub(crate) fn from_host<B: Backend>(
    values: Vec<f32>,
    shape: Shape,
    dtype: DType,
    device: &B::Device,
    like: Option<&FloatTensor<B>>,
    param: Option<u64>,
) -> FloatTensor<B> {
    let mut data = TensorData::new(values, shape);
    if dtype != DType::F32 {
        data = data.convert_dtype(dtype);
    }
    local::write::<B>(like, data, device, param)
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
