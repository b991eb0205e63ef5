//! ZeRO stage 3 (PyTorch's FSDP): every parameter sharded at rest over the data-parallel ranks,
//! gathered whole only while an op reads it.
//!
//! It is `TensorParallel`'s machinery with one difference of meaning. In a tensor-parallel group
//! every rank computes on the same activations, so an op's rule may combine a rank's slice of a
//! weight with its slice of an activation. In a fully sharded group the ranks are data-parallel
//! replicas: their activations differ. So there (the generated ops check
//! [`super::context::fully_sharded`]) a rule runs only when every input is a tensor all ranks
//! agree on: a shard of a parameter, of its gradient or of the optimizer's state, a pending sum,
//! a constant. Any op that reads a whole tensor of the rank's own, or an index or mask, gathers
//! its sharded inputs, runs on the inner backend and leaves a whole result. What follows:
//!
//! - **Forward** gathers each parameter where a layer reads it (a linear layer's weight and bias,
//!   an embedding's table, a norm's scale) and frees the whole copy when the op returns. Shape ops
//!   on a parameter (a reshape, a transpose, an unsqueeze) stay sharded, so autodiff's saved
//!   state holds the shard, not the gathered copy.
//! - **Backward** gathers again where a gradient op reads a parameter, and produces each
//!   parameter's whole gradient on each rank; `DataParallel`'s hook collects them in buckets, as
//!   in DDP, and reduce-scatters each bucket so that each rank receives only its slice of every
//!   gradient, averaged (half an all-reduce's bytes; `LocalParts::shard_at_rest` tells it the
//!   splits), which becomes the gradient (the whole one is freed as each bucket is written back).
//! - **The optimizer step** reads only shards (parameter, gradient, state), so its rules keep
//!   everything sharded: Burn's Adam, AdamW and SGD, unwrapped, keep state for 1/N of each
//!   parameter, and the parameters stay sharded. An op without a rule (AMSGrad's running
//!   maximum) leaves its result whole: under `bonfire::sharded(..).stage(ZeroStage::Three)` the
//!   parameters are sliced again after each step.
//!
//! A parameter is split along its largest dimension that the ranks divide; one with no such
//! dimension (a bias of odd length) stays whole on every rank, averaged as in DDP.

use bonfire_collectives::{CollectiveError, Communicator};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::Backend;

use super::backend::TensorParallelBackend;
use super::context::{self, TpBindGuard};
use super::placement::Placement;
use super::redistribute::{Why, shard_of, whole};
use super::tensor::TpTensor;
use crate::FailurePolicy;

/// Binds the calling thread to `comm` as a fully sharded data-parallel group until the guard
/// drops (ranks run as threads; a failed collective panics). Bind the same ranks' data-parallel
/// group too (`bonfire::backend::bind_thread`), with a communicator of its own (two `split`s of
/// one world), so that gathers and gradient buckets never share a sequence. Collective.
pub fn bind_thread(comm: Communicator) -> Result<TpBindGuard, CollectiveError> {
    context::bind_group(comm, true)
}

/// Makes `comm` this process's fully sharded data-parallel group (one process per rank, as
/// under `bonfire launch`), failing as `failure` says; it replaces an earlier group, of either
/// kind. [`fully_shard`] makes and installs one itself when none over its data-parallel ranks
/// is bound or installed. Collective.
pub fn install(comm: Communicator, failure: FailurePolicy) -> Result<(), CollectiveError> {
    context::install_group(comm, failure, true)
}

/// Replicates `model` over the data-parallel group (rank 0's values, as
/// [`crate::replicate`]) and shards each of its trainable parameters over the calling thread's
/// fully sharded group: ZeRO stage 3 in one line, in place of `bonfire::replicate(model)`.
///
/// ```ignore
/// type B = Autodiff<Hybrid<Flex>>;                 // DataParallel<TensorParallel<Flex>>
/// let model = bonfire::fully_shard(model)?;       // was: bonfire::replicate(model)
/// // ...the same loop; wrap the optimizer as bonfire::sharded(optim).stage(ZeroStage::Three).
/// ```
///
/// The fully sharded group is the one bound to this thread ([`bind_thread`]) or installed for
/// the process ([`install`]) when it has this rank's data-parallel ranks; otherwise it is made
/// here from the data-parallel group (a communicator of its own over the same ranks, by
/// `split`) and installed for the process, or, where groups are bound to this thread (ranks
/// that are threads), bound to this thread for the rest of its life.
///
/// Collective over the data-parallel group. In a group of one (or none) it is
/// [`crate::replicate`]. Errors: a tensor-parallel group (one that is not fully sharded) is
/// bound to this thread; making the group failed (a peer is gone).
pub fn fully_shard<B, M>(model: M) -> Result<M, super::PlanError>
where
    B: AutodiffBackend + TensorParallelBackend,
    M: Module<B>,
{
    super::hybrid::register::<B::Inner>();
    let device = model.devices().into_iter().next().unwrap_or_default();
    let dp = crate::data_parallel::communicator(&device);
    let group = match context::current() {
        // A fully sharded group over this rank's data-parallel ranks (one bound or installed,
        // or made by an earlier call): the parameters are sharded over it.
        Some(g) if g.fully_sharded && g.comm.members() == dp.members() => {
            Some(g).filter(|g| g.size() > 1)
        }
        Some(g) if !g.fully_sharded && g.size() > 1 => {
            return Err(super::PlanError::NotFullySharded { ranks: g.size() });
        }
        _ => join(&device, &dp).map_err(|e| super::PlanError::Group(Box::new(e)))?,
    };
    let model = crate::replicate(model);
    let Some(g) = group else {
        return Ok(model);
    };
    Ok(model.map(&mut Sharder { group: g }))
}

/// A fully sharded group over the ranks of `dp`, the data-parallel group of `device`, made and
/// joined (see [`fully_shard`]); `None` for a data-parallel group of one.
fn join<D: burn_backend::DeviceOps>(
    device: &D,
    dp: &Communicator,
) -> Result<Option<std::sync::Arc<context::TpRank>>, CollectiveError> {
    if dp.size() < 2 {
        return Ok(None);
    }
    let failure = crate::data_parallel::failure_policy(device);
    let shards = dp
        .split(Some(0), 0)?
        .expect("every rank of the group chose the same color");
    if crate::data_parallel::process_wide(device) && context::thread_group().is_none() {
        context::install_group(shards, failure, true)?;
        Ok(context::process_group())
    } else {
        // Ranks that are threads: bound until the thread ends (a later call over other ranks
        // binds another in its place).
        std::mem::forget(context::bind_group(shards, true)?);
        Ok(context::thread_group())
    }
}

/// Sets how many parameters the calling thread's fully sharded group (the one [`fully_shard`]
/// sharded the model over: call it after) gathers ahead of need at a time, in one all-gather,
/// as PyTorch FSDP's forward and backward prefetch gathers a wrapped module's parameters
/// together: 8 unless set, 0 for none. Without such a group, does nothing.
///
/// Each rank records, during an optimizer step, which parameter each of its gathers was for;
/// during the next, the parameters are gathered `n` at a time, the next `n` started when the
/// first of the current `n` is read, so the gathers run on the communication runtime behind the
/// compute before them (at most `2n` whole parameters held ahead). Needs the optimizer wrapped
/// as `bonfire::sharded(optim).stage(ZeroStage::Three)`, which registers each step's new values
/// (with Burn's optimizer unwrapped, every gather after the first step waits as before). The
/// results are the same bits at any `n`. Set it alike on every rank (the gathers started ahead
/// are collectives).
pub fn prefetch_gathers(n: usize) {
    if let Some(g) = context::current().filter(|g| g.fully_sharded) {
        g.set_prefetch_depth(n);
    }
}

/// Runs `f` with the calling thread's fully sharded group gathering nothing ahead of need, then
/// sets its depth back: for an evaluation, whose forward reads the parameters in training's
/// order and would otherwise have the gathers for training's backward started behind it, and
/// dropped (each a whole parameter gathered for nothing). Without such a group, runs `f`. Call
/// it alike on every rank.
pub fn without_prefetch<R>(f: impl FnOnce() -> R) -> R {
    let Some(g) = context::current().filter(|g| g.fully_sharded) else {
        return f();
    };
    let depth = g.prefetch_depth();
    g.set_prefetch_depth(0);
    let out = f();
    g.set_prefetch_depth(depth);
    out
}

/// Runs `f`, an evaluation's forward passes (no backward, no optimizer step), with the calling
/// thread's fully sharded group gathering ahead in the order of those passes rather than
/// training's: training's order is set aside, the first pass is recorded (up to its first read
/// coming again), and from the second on each read is served by a gather started ahead, the
/// next pass's first parameters behind the current one's last layers. The pass is kept for the
/// next call, whose first pass is then served too; training's order comes back after `f`.
/// Without it, an evaluation's forward follows training's order and has the gathers for
/// training's backward started behind it, and dropped (a model's `valid()` copy read outside
/// both this and [`without_prefetch`] follows training's order too). The same bits as without
/// prefetch. Run no optimizer step inside it. Without such a group, runs `f`. Call it alike on
/// every rank, with passes that read the parameters alike (the gathers started ahead are
/// collectives).
pub fn forward_only<R>(f: impl FnOnce() -> R) -> R {
    let Some(g) = context::current().filter(|g| g.fully_sharded) else {
        return f();
    };
    /// Sets the flag back when `f` returns or unwinds (ranks that are threads may catch a
    /// panic and go on training).
    struct Back(std::sync::Arc<super::context::TpRank>, bool);
    impl Drop for Back {
        fn drop(&mut self) {
            self.0.set_forward_only(self.1);
        }
    }
    let _back = Back(g.clone(), g.forward_only());
    g.set_forward_only(true);
    f()
}

/// The dimension a fully sharded group of `ranks` splits a tensor of `shape` along: its largest
/// that `ranks` divides (the first of equal ones), or none.
pub fn shard_dim(shape: &[usize], ranks: usize) -> Option<usize> {
    shape
        .iter()
        .enumerate()
        .filter(|&(_, &s)| s >= ranks && s % ranks == 0)
        .fold(None, |best: Option<(usize, usize)>, (d, &s)| match best {
            Some((_, b)) if b >= s => best,
            _ => Some((d, s)),
        })
        .map(|(d, _)| d)
}

struct Sharder {
    group: std::sync::Arc<context::TpRank>,
}

impl<B: AutodiffBackend + TensorParallelBackend> ModuleMapper<B> for Sharder {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        // Buffers (a norm's running statistics) are rewritten whole by forward: left whole.
        let ranks = self.group.size();
        let dim = shard_dim(&tensor.dims(), ranks).filter(|_| tensor.is_require_grad());
        let Some(dim) = dim else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let placement = Placement::shard(dim);
        self.group
            .place(id.val(), placement, tensor.dims().to_vec());
        let tp = B::tp_part(tensor.into_primitive().tensor());
        let shape = tp.shape.clone();
        let full = whole::<B::Inner>(tp, Why::Read);
        let local = shard_of::<B::Inner>(full, dim, 1, ranks, self.group.rank());
        let split = TpTensor::local(local, placement, Some(shape));
        let split = super::prefetch::register::<B::Inner>(&self.group, id.val(), split);
        // A leaf again, its gradients averaged by `DataParallel`.
        let t: Tensor<B, D> = Tensor::from_primitive(TensorPrimitive::Float(B::from_tp(split)))
            .require_grad()
            .set_distributed(burn_backend::distributed::DistributedParamId::from(
                id.val(),
            ));
        Param::from_mapped_value(id, t, mapper)
    }
}

/// `t`, a whole value or gradient of parameter `param` (its id's number), placed as the
/// parameter is: this rank's slice where it is sharded, whole otherwise.
pub(crate) fn place_as_param<B: Backend>(t: TpTensor<B>, param: u64) -> TpTensor<B> {
    let Some(g) = context::current().filter(|g| g.size() > 1) else {
        return t;
    };
    let Some(placement @ Placement::Shard { dim, blocks }) = g.placed(param) else {
        return t;
    };
    let shape = t.shape.clone();
    let full = whole::<B>(t, Why::Read);
    let local = shard_of::<B>(full, dim, blocks, g.size(), g.rank());
    TpTensor::local(local, placement, Some(shape))
}

/// `t`, this rank's slice of a value placed as parameter `param` (its id's number) is, held
/// as a whole tensor of the slice's shape (read back from a per-rank checkpoint), marked as that
/// slice of the whole value; unchanged where the parameter is not sharded or `t` does not have
/// the slice's shape (a tensor of the state kept whole).
pub(crate) fn adopt_as_param<B: Backend>(t: TpTensor<B>, param: u64) -> TpTensor<B> {
    let Some(g) = context::current().filter(|g| g.size() > 1) else {
        return t;
    };
    let Some((placement @ Placement::Shard { .. }, shape)) = g.placed_whole(param) else {
        return t;
    };
    let whole = burn_backend::Shape::from(shape);
    if t.shape != super::placement::local_shape(&whole, placement, g.size()) {
        return t;
    }
    let local = super::redistribute::local_of::<B>(t);
    TpTensor::local(local, placement, Some(whole))
}

/// Whether the calling thread's group is a fully sharded one of several ranks.
pub(crate) fn active() -> bool {
    context::fully_sharded() && context::current().is_some_and(|g| g.size() > 1)
}

/// Runs `f`, which moves an optimizer's state for parameter `param` (its id's number) to its
/// device (`SimpleOptimizer::to_device`), so that each whole tensor of the state is placed as
/// the parameter is sharded: a state loaded whole keeps only this rank's slices.
pub(crate) fn place_state<R>(param: u64, f: impl FnOnce() -> R) -> R {
    context::placing(param, context::Placing::Cut, f)
}

/// Runs `f`, which moves an optimizer's state for parameter `param` to its device, so that each
/// tensor of the state that has the shape of this rank's slice of the parameter is taken as
/// that slice (a state read back from this rank's own checkpoint file).
pub(crate) fn adopt_state<R>(param: u64, f: impl FnOnce() -> R) -> R {
    context::placing(param, context::Placing::Adopt, f)
}

#[cfg(test)]
mod tests {
    use super::shard_dim;

    #[test]
    fn the_largest_dimension_the_ranks_divide() {
        assert_eq!(shard_dim(&[64, 256], 4), Some(1));
        assert_eq!(shard_dim(&[65, 128], 2), Some(1));
        assert_eq!(shard_dim(&[128, 128], 2), Some(0));
        assert_eq!(shard_dim(&[65], 2), None);
        assert_eq!(shard_dim(&[2], 4), None);
        assert_eq!(shard_dim(&[16, 3, 3, 3], 4), Some(0));
        assert_eq!(shard_dim(&[], 2), None);
    }
}
