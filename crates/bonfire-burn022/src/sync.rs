//! Gradients averaged, parameters replicated and data sharded over a job's ranks, with Burn
//! 0.22's `Module` visitors and bonfire's collectives.
//!
//! Both [`average`] and [`replicate`] walk the model's float parameters in its own order (the
//! same on every rank of the same model), flatten consecutive tensors that share a device and a
//! dtype into buckets of at most the cap on that device, read each bucket back once, and start its
//! collective at once, so that one bucket travels while the next is read. What comes back is
//! written into new tensors of the original device, dtype and shape.

use std::collections::HashMap;
use std::sync::Arc;

use bonfire_collectives::{CollectiveError, Communicator, Work};
use bonfire_topology::ReduceOp;
use burn::data::dataloader::DataLoader;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorData};

/// The most gradient bytes averaged in one all-reduce when `BONFIRE_BUCKET_CAP_MB` is unset:
/// 25 MiB, PyTorch DDP's default.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// Why gradients could not be averaged or parameters replicated. Every rank of the job gets an
/// error, never a hang and never a silent reduction of mismatched data: a rank that fails
/// before one of its collectives leaves its peers a mismatch at that collective or a timeout,
/// and the cause in its own log and error.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// A bucket of tensors could not be read back from its device.
    #[error(
        "{what}: cannot read {tensors} tensors ({values} values) back from {device:?}: {reason}"
    )]
    Read {
        /// `average` or `replicate`.
        what: &'static str,
        /// Tensors in the bucket.
        tensors: usize,
        /// Values in the bucket.
        values: usize,
        /// Where they live.
        device: Device,
        /// Burn's error.
        reason: String,
    },
    /// The collective failed: a peer died, timed out, or holds a different model (the
    /// collective's error names the rank, the collective and both sizes).
    #[error("{what}: bucket {bucket} of {buckets} ({values} values over {ranks} ranks): {source}")]
    Collective {
        /// `average` or `replicate`.
        what: &'static str,
        /// Which bucket, from 0.
        bucket: usize,
        /// Buckets in the call.
        buckets: usize,
        /// Values in the bucket.
        values: usize,
        /// Ranks in the group.
        ranks: usize,
        /// The collective's error.
        #[source]
        source: Box<CollectiveError>,
    },
    /// The ranks hold gradients of different parameters (other shapes, dtypes or order), even
    /// where their total size agrees.
    #[error(
        "average: the gradients on rank(s) {differ:?} are not of the parameters rank 0 holds gradients for (shapes, dtypes or order in the model differ), or their bucket cap (BONFIRE_BUCKET_CAP_MB) differs from rank 0's; every rank must run the same model, and every parameter must get a gradient on every rank or on none"
    )]
    Layout {
        /// The ranks whose layout differs from rank 0's.
        differ: Vec<usize>,
    },
    /// The ranks' files of their newest common checkpoint differ.
    #[error(
        "resume_epoch: the checkpoint of epoch {epoch} on rank(s) {differ:?} differs from rank 0's (this rank looked in {dir}); every rank must reach the same checkpoint directory"
    )]
    Resume {
        /// The epoch agreed on.
        epoch: usize,
        /// The ranks whose files differ from rank 0's.
        differ: Vec<usize>,
        /// Where this rank looked.
        dir: std::path::PathBuf,
    },
}

/// Where one parameter's values sit in the buckets.
struct Slot {
    bucket: usize,
    offset: usize,
    len: usize,
}

/// Tensors flattened and grouped into buckets, each bucket sent as soon as it is full.
struct Buckets<'a> {
    what: &'static str,
    comm: &'a Communicator,
    cap_values: usize,
    /// The bucket being filled: its tensors, their total length, device and dtype.
    open: Vec<Tensor<1>>,
    open_len: usize,
    open_kind: Option<(Device, DType)>,
    /// Buckets sent: the collective in flight, its length, device and dtype.
    sent: Vec<(Work<Vec<f32>>, usize, Device, DType)>,
    slots: HashMap<ParamId, Slot>,
    start: fn(&Communicator, Vec<f32>) -> Work<Vec<f32>>,
    error: Option<SyncError>,
}

impl<'a> Buckets<'a> {
    fn new(
        what: &'static str,
        comm: &'a Communicator,
        cap_bytes: usize,
        start: fn(&Communicator, Vec<f32>) -> Work<Vec<f32>>,
    ) -> Self {
        Self {
            what,
            comm,
            cap_values: (cap_bytes / 4).max(1),
            open: Vec::new(),
            open_len: 0,
            open_kind: None,
            sent: Vec::new(),
            slots: HashMap::new(),
            start,
            error: None,
        }
    }

    /// Adds one tensor under `id`.
    fn push<const D: usize>(&mut self, id: ParamId, tensor: Tensor<D>) {
        if self.error.is_some() || self.slots.contains_key(&id) {
            return;
        }
        let len = tensor.shape().num_elements();
        let kind = (tensor.device(), tensor.dtype());
        let fits = self.open_len + len <= self.cap_values || self.open.is_empty();
        if !fits || self.open_kind.as_ref().is_some_and(|k| *k != kind) {
            self.flush();
            if self.error.is_some() {
                return;
            }
        }
        self.slots.insert(
            id,
            Slot {
                bucket: self.sent.len(),
                offset: self.open_len,
                len,
            },
        );
        self.open.push(tensor.reshape([len]));
        self.open_len += len;
        self.open_kind = Some(kind);
    }

    /// Reads the open bucket back and starts its collective; after a failed read, starts no
    /// collective any more (the peers then fail at that bucket, with a mismatch or a timeout,
    /// rather than reduce a bucket that is not the one they expect).
    fn flush(&mut self) {
        let Some((device, dtype)) = self.open_kind.take() else {
            return;
        };
        if self.error.is_some() {
            self.open.clear();
            self.open_len = 0;
            return;
        }
        let tensors = std::mem::take(&mut self.open);
        let values = std::mem::take(&mut self.open_len);
        let count = tensors.len();
        let flat = if count == 1 {
            tensors.into_iter().next().expect("one tensor")
        } else {
            Tensor::cat(tensors, 0)
        };
        let read = flat
            .try_into_data_dtype(DType::F32)
            .map_err(|e| e.to_string())
            .and_then(|data| data.try_into_vec::<f32>().map_err(|e| format!("{e:?}")));
        match read {
            Ok(buf) => self
                .sent
                .push(((self.start)(self.comm, buf), values, device, dtype)),
            Err(reason) => {
                self.error.get_or_insert(SyncError::Read {
                    what: self.what,
                    tensors: count,
                    values,
                    device,
                    reason,
                });
            }
        }
    }

    /// Waits for every bucket, in order, and returns each as a tensor on its device.
    fn finish(mut self) -> Result<(Vec<Tensor<1>>, HashMap<ParamId, Slot>), SyncError> {
        self.flush();
        let buckets = self.sent.len();
        let ranks = self.comm.size();
        let mut out = Vec::with_capacity(buckets);
        let mut failed = self.error.take();
        for (bucket, (work, values, device, dtype)) in self.sent.into_iter().enumerate() {
            // Every bucket is waited for, even after a failure, so none is left in flight.
            match work.wait() {
                Ok(buf) if failed.is_none() => {
                    out.push(Tensor::<1>::from_data(
                        TensorData::new(buf, [values]),
                        (&device, dtype),
                    ));
                }
                Ok(_) => {}
                Err(source) => {
                    failed.get_or_insert(SyncError::Collective {
                        what: self.what,
                        bucket,
                        buckets,
                        values,
                        ranks,
                        source: Box::new(source),
                    });
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok((out, self.slots)),
        }
    }
}

/// One parameter's values out of the buckets, in `shape`.
fn take_slot<const D: usize>(
    buckets: &[Tensor<1>],
    slot: &Slot,
    shape: burn::tensor::Shape,
) -> Tensor<D> {
    buckets[slot.bucket]
        .clone()
        .narrow(0, slot.offset, slot.len)
        .reshape(shape)
}

/// A fingerprint of which parameters have gradients, with their shapes and dtypes, in the
/// model's order (ids differ from rank to rank; the order does not).
struct Layout<'g> {
    grads: &'g GradientsParams,
    hash: u64,
}

impl Layout<'_> {
    fn mix(&mut self, v: u64) {
        self.hash = (self.hash ^ v).wrapping_mul(0x0100_0000_01b3);
    }
}

impl ModuleVisitor for Layout<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        match self.grads.get::<D>(param.id) {
            Some(grad) => {
                self.mix(D as u64 + 1);
                for d in grad.shape().iter() {
                    self.mix(*d as u64);
                }
                for b in format!("{:?}", grad.dtype()).bytes() {
                    self.mix(u64::from(b));
                }
            }
            None => self.mix(0),
        }
    }
}

/// Every rank's layout fingerprint equals rank 0's.
fn check_layout<M: Module>(
    comm: &Communicator,
    grads: &GradientsParams,
    model: &M,
    bucket_cap_bytes: usize,
) -> Result<(), SyncError> {
    let mut layout = Layout {
        grads,
        hash: 0xcbf2_9ce4_8422_2325,
    };
    // The buckets follow from the layout and the cap: both must agree.
    layout.mix(bucket_cap_bytes as u64);
    model.visit(&mut layout);
    let all = comm
        .all_gather(vec![layout.hash as i64])
        .wait()
        .map_err(|source| SyncError::Collective {
            what: "average (the gradients' layout)",
            bucket: 0,
            buckets: 1,
            values: 1,
            ranks: comm.size(),
            source: Box::new(source),
        })?;
    let differ: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
    match differ.is_empty() {
        true => Ok(()),
        false => Err(SyncError::Layout { differ }),
    }
}

struct TakeGrads<'g, 'c> {
    grads: &'g mut GradientsParams,
    buckets: Buckets<'c>,
    shapes: HashMap<ParamId, burn::tensor::Shape>,
}

impl ModuleVisitor for TakeGrads<'_, '_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            self.shapes.insert(param.id, grad.shape());
            self.buckets.push(param.id, grad);
        }
    }
}

struct PutGrads<'a> {
    grads: &'a mut GradientsParams,
    buckets: &'a [Tensor<1>],
    slots: HashMap<ParamId, Slot>,
    shapes: HashMap<ParamId, burn::tensor::Shape>,
}

impl ModuleVisitor for PutGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let (Some(slot), Some(shape)) =
            (self.slots.remove(&param.id), self.shapes.remove(&param.id))
        {
            let grad = take_slot::<D>(self.buckets, &slot, shape);
            self.grads.register::<D>(param.id, grad);
        }
    }
}

/// The mean over `comm`'s ranks of every gradient in `grads`, by parameter id: call it between
/// `backward` (`GradientsParams::from_grads`) and the optimizer's step, on every rank, with the
/// same model. Gradients are bucketed by at most `bucket_cap_bytes` of f32 and averaged by
/// deterministic all-reduces, so every rank gets bitwise the same result and the same as every
/// earlier run. Gradients of parameters that are not in `model` are left as they are.
///
/// Before any bucket, the ranks compare which parameters have gradients, with their shapes and
/// dtypes, and the bucket cap (one 8-byte all-gather): a rank whose model or set of gradients differs from rank 0's
/// makes every rank return an error naming it. Values travel as f32: f16 and bf16 gradients
/// exactly, f64 ones rounded to f32.
pub fn average<M: Module>(
    comm: &Communicator,
    mut grads: GradientsParams,
    model: &M,
    bucket_cap_bytes: usize,
) -> Result<GradientsParams, SyncError> {
    if comm.size() == 1 {
        return Ok(grads);
    }
    check_layout(comm, &grads, model, bucket_cap_bytes)?;
    let mut take = TakeGrads {
        grads: &mut grads,
        buckets: Buckets::new("average", comm, bucket_cap_bytes, |comm, buf| {
            comm.all_reduce(buf, ReduceOp::Mean)
        }),
        shapes: HashMap::new(),
    };
    model.visit(&mut take);
    let shapes = take.shapes;
    let (buckets, slots) = take.buckets.finish()?;
    let mut put = PutGrads {
        grads: &mut grads,
        buckets: &buckets,
        slots,
        shapes,
    };
    model.visit(&mut put);
    Ok(grads)
}

struct TakeParams<'c> {
    buckets: Buckets<'c>,
}

impl ModuleVisitor for TakeParams<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.buckets.push(param.id, param.val());
    }
}

struct PutParams<'a> {
    buckets: &'a [Tensor<1>],
    slots: &'a HashMap<ParamId, Slot>,
}

impl ModuleMapper for PutParams<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(slot) = self.slots.get(&param.id) else {
            return param;
        };
        let buckets = self.buckets;
        param.map(|tensor| {
            let require_grad = tensor.is_require_grad();
            take_slot::<D>(buckets, slot, tensor.shape()).set_require_grad(require_grad)
        })
    }
}

/// `model` with rank 0's float parameters (and buffers, such as batch-norm statistics) on every
/// rank of `comm`, each on the device and in the dtype it had here (values travel as f32, so
/// f64 parameters are rounded to f32): call it once after building
/// the model (or loading a checkpoint) so that every replica starts from the same point.
/// Parameter ids and whether each requires a gradient are kept.
pub fn replicate<M: Module>(
    comm: &Communicator,
    model: M,
    bucket_cap_bytes: usize,
) -> Result<M, SyncError> {
    if comm.size() == 1 {
        return Ok(model);
    }
    let mut take = TakeParams {
        buckets: Buckets::new("replicate", comm, bucket_cap_bytes, |comm, buf| {
            comm.broadcast(buf, 0)
        }),
    };
    model.visit(&mut take);
    let (buckets, slots) = take.buckets.finish()?;
    Ok(model.map(&mut PutParams {
        buckets: &buckets,
        slots: &slots,
    }))
}

/// Rank `rank`'s share of `loader`'s items among `world_size` ranks: the `rank`-th of
/// `world_size` equal contiguous slices, the last `items % world_size` items left out, so that
/// every rank takes the same number of batches. Unlike PyTorch's `DistributedSampler`, which
/// deals a new permutation of the whole set every epoch, each rank keeps its slice; a loader
/// that shuffles shuffles within it.
pub fn shard<O: 'static>(
    loader: Arc<dyn DataLoader<O>>,
    rank: usize,
    world_size: usize,
) -> Arc<dyn DataLoader<O>> {
    if world_size <= 1 {
        return loader;
    }
    let per_rank = loader.num_items() / world_size;
    loader.slice(rank * per_rank, (rank + 1) * per_rank)
}
