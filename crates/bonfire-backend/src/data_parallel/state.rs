//! What the synchroniser knows between hooks: the model's parameters in module order, the bucket
//! plan over them, the gradients kept by `no_sync` steps, the bf16 residuals, and the step in
//! flight. Data and bookkeeping only: the hooks that act on it are in `sync.rs`.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bonfire_collectives::{CollectiveError, Communicator, Work, WorkTimes};
use bonfire_topology::{BucketPlan, stable_hash};

use super::config::{DataParallelConfig, GradDType};
use super::scatter::{GradOwners, Scatter};

/// A parameter known to the synchroniser, in module order.
pub(crate) struct ParamInfo {
    pub(crate) id: u64,
    pub(crate) numel: Option<usize>,
    pub(crate) name: String,
}

#[derive(Default)]
pub(crate) struct SyncState {
    pub(crate) params: Vec<ParamInfo>,
    pub(crate) index: HashMap<u64, usize>,
    pub(crate) plan: Option<Arc<BucketPlan>>,
    /// The order (parameter indices) in which rank 0's gradients became final in its first
    /// synchronised backward: the order buckets are planned in. `None` until that backward has
    /// ended; until then no plan is made.
    pub(crate) order: Option<Vec<usize>>,
    /// Fingerprint of the plan all ranks were found to agree on.
    pub(crate) agreed: Option<u64>,
    /// Gradient sums of unsynchronised backward passes, per parameter (empty: none).
    pub(crate) accum: Option<Vec<Vec<f32>>>,
    /// A backward ran under `no_sync` over this many marked parameters, and its gradients have
    /// not been handed to `keep_gradients` yet (`None`: every such backward's were).
    pub(crate) unkept: Option<usize>,
    /// bf16 error feedback: what rounding left out last time, per bucket.
    pub(crate) residual: Vec<Vec<f32>>,
    /// ZeRO stage 2: the rank each gradient goes to, registered by the sharded optimizer on its
    /// first step (`None`: every rank gets every gradient).
    pub(crate) owners: Option<Arc<GradOwners>>,
    pub(crate) step: Option<Step>,
}

pub(crate) struct Step {
    pub(crate) started: Instant,
    /// The plan this step fills; `None` when some parameter's size is not known yet (its first
    /// step): then every gradient is read at the end instead.
    pub(crate) plan: Option<Arc<BucketPlan>>,
    pub(crate) buffers: Vec<Vec<f32>>,
    pub(crate) remaining: Vec<usize>,
    /// Parameter indices in the order their gradients arrived (recorded in a step without a
    /// plan only: the one that makes it).
    pub(crate) arrivals: Vec<usize>,
    /// Per bucket, when its last gradient arrived.
    pub(crate) ready: Vec<Option<Instant>>,
    pub(crate) launched: Vec<Inflight>,
    /// Per bucket, the parameters whose gradients wait on the device to be packed together.
    pub(crate) pending: Vec<Vec<usize>>,
    /// Buckets packed on the device this step.
    pub(crate) packed: u64,
    /// Whether this step's device-packed buckets go through the device lane (decided at its
    /// start, the same on every rank).
    pub(crate) use_lane: bool,
    /// Per bucket, its gradients packed on the device for the lane.
    pub(crate) lane: Vec<Option<super::device_pack::LaneBucket>>,
    pub(crate) agreement: Option<Agreement>,
    /// `Vec<Option<GradRef<B>>>` by parameter index.
    pub(crate) refs: Box<dyn Any + Send>,
    pub(crate) bytes: u64,
    /// Bytes this rank receives reduced (see [`super::stats::StepStats::received`]).
    pub(crate) received: u64,
}

/// A bucket-plan check in flight (see [`SyncState::agree`]).
pub(crate) struct Agreement {
    pub(crate) work: bonfire_collectives::Work<Vec<i64>>,
    pub(crate) params: usize,
    pub(crate) elements: usize,
}

pub(crate) struct Inflight {
    /// When its last gradient was in the bucket (or backward ended, for a bucket some of whose
    /// parameters got no gradient).
    pub(crate) ready: Instant,
    /// When its all-reduce was called (a bucket is called in order: after every earlier one).
    pub(crate) called: Instant,
    /// Bytes its all-reduce moves.
    pub(crate) bytes: u64,
    /// The host collective; `None` for a bucket that goes through the device lane.
    pub(crate) work: Option<Reduction>,
    /// The bucket packed for the device lane (when `work` is `None`).
    pub(crate) lane: Option<super::device_pack::LaneBucket>,
    /// Under ZeRO stage 2 or 3, the layout it was reduce-scattered in (the work returns this
    /// rank's share only); `None` for an all-reduce.
    pub(crate) scatter: Option<Scatter>,
    /// Under ZeRO stage 3, the all-reduce of the bucket's gradients that stay whole
    /// ([`Scatter::whole`]), beside the reduce-scatter; `None` when there are none.
    pub(crate) whole: Option<Reduction>,
}

/// A bucket's all-reduce in flight, in the dtype it travels in.
pub(crate) enum Reduction {
    F32(Work<Vec<f32>>),
    Bf16(Work<Vec<half::bf16>>),
}

impl Reduction {
    /// Runs what has become possible of it on this thread, without blocking.
    pub(crate) fn progress(&self) {
        match self {
            Reduction::F32(w) => {
                w.progress();
            }
            Reduction::Bf16(w) => {
                w.progress();
            }
        }
    }

    /// Waits on this thread (which does the collective's remaining work itself) and returns the
    /// reduced values as f32, with when the all-reduce began to run and when it completed.
    pub(crate) fn wait(self) -> (Result<Vec<f32>, CollectiveError>, WorkTimes) {
        match self {
            Reduction::F32(w) => w.wait_times(),
            Reduction::Bf16(w) => {
                let (r, times) = w.wait_times();
                (
                    r.map(|v| v.into_iter().map(|x| x.to_f32()).collect()),
                    times,
                )
            }
        }
    }
}

impl SyncState {
    /// Replaces the known parameters (module order) with `params`; called by `replicate`.
    pub(crate) fn set_params(&mut self, params: Vec<ParamInfo>) {
        self.index = params.iter().enumerate().map(|(i, p)| (p.id, i)).collect();
        self.params = params;
        self.plan = None;
        self.order = None;
        self.agreed = None;
        self.accum = None;
        self.residual.clear();
    }

    /// The bucket plan, made on first use once every parameter's size and the gradient order are
    /// known (`None` before).
    pub(crate) fn plan(&mut self, config: &DataParallelConfig) -> Option<Arc<BucketPlan>> {
        if self.plan.is_none() {
            let numels: Option<Vec<usize>> = self.params.iter().map(|p| p.numel).collect();
            let order = self.order.as_ref()?;
            let elem = match config.grad_dtype {
                GradDType::F32 => 4,
                GradDType::Bf16 => 2,
            };
            let plan = BucketPlan::in_order(
                &numels?,
                order,
                elem,
                config.bucket_cap_bytes,
                config.first_bucket_cap_bytes,
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
    pub(crate) fn agree(
        &mut self,
        comm: &Communicator,
        config: &DataParallelConfig,
    ) -> Option<Agreement> {
        let mut words = vec![config.bucket_cap_bytes as u64, config.grad_dtype as u64];
        for p in &self.params {
            words.push(p.id);
            words.push(p.numel.unwrap_or(u64::MAX as usize) as u64);
        }
        if let Some(plan) = &self.plan {
            for b in plan.buckets() {
                words.push(b.params.len() as u64);
                words.extend(b.params.iter().map(|&p| p as u64));
            }
        }
        let fp = stable_hash(&words);
        let first = self.agreed != Some(fp);
        self.agreed = Some(fp);
        (first && comm.size() > 1).then(|| Agreement {
            work: comm.all_gather(vec![fp as i64]),
            params: self.params.len(),
            elements: self.params.iter().filter_map(|p| p.numel).sum(),
        })
    }

    /// Forgets the accumulated gradients.
    pub(crate) fn discard_accumulated(&mut self) {
        self.accum = None;
        self.unkept = None;
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
    pub(crate) fn fresh_buffers(&self, plan: &BucketPlan) -> Vec<Vec<f32>> {
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
