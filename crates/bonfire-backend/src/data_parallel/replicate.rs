//! Start every rank from the same parameters, and tell the synchroniser the model's parameters.

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_backend::distributed::DistributedParamId;

use std::sync::Arc;

use super::context::{self, Replica};
use super::error::SyncError;
use super::state::ParamInfo;
use super::{local, sync};

/// Makes `module` a replica of rank 0's, as the constructor of PyTorch's
/// `DistributedDataParallel` does: every float parameter (values and id) is broadcast from rank 0,
/// marked for gradient synchronisation, and registered with `DataParallel` in module order. The
/// first synchronised backward after it observes the order gradients become final, and buckets
/// are planned in rank 0's order from then on. Call it on every rank, after [`bonfire::init`] and before
/// the first forward pass; call it again after loading a checkpoint on rank 0 only.
///
/// At world size 1 it only registers the parameters, and leaves them unmarked: `DataParallel`
/// is then a pure pass-through, with no hook in backward (unless
/// [`DataParallelConfig::sync_alone`](crate::DataParallelConfig::sync_alone) asks for the whole
/// path).
///
/// A rank whose model differs (another architecture, other shapes) fails with an error naming
/// it, on every rank (see [`crate::FailurePolicy`]).
///
/// [`bonfire::init`]: https://docs.rs/bonfire
pub fn replicate<B, M>(module: M) -> M
where
    B: AutodiffBackend,
    M: Module<B>,
{
    let mut mapper = Replicator {
        rep: None,
        params: Vec::new(),
        path: Vec::new(),
        broadcast: true,
        mark: true,
    };
    let module = module.map(&mut mapper);
    if let Some(rep) = mapper.rep {
        rep.state().set_params(mapper.params);
    }
    module
}

/// Makes `module` a copy of rank 0's, as Horovod's `broadcast_parameters`: every float
/// parameter's values and id are broadcast from rank 0, and nothing is marked for gradient
/// averaging, so backward keeps each rank's own gradients. For replicas that average something
/// other than every step's gradients ([`crate::local_sgd`], [`crate::diloco`]): they then start
/// from the same parameters, and each parameter has the same id on every rank (the key of an
/// optimizer's state in its record). Call it on every rank, after `bonfire::init`.
pub fn broadcast_parameters<B, M>(module: M) -> M
where
    B: AutodiffBackend,
    M: Module<B>,
{
    module.map(&mut Replicator {
        rep: None,
        params: Vec::new(),
        path: Vec::new(),
        broadcast: true,
        mark: false,
    })
}

/// Gradient accumulation without synchronisation, as PyTorch DDP's `no_sync()`: runs
/// `loss.backward()` and keeps the gradients on this rank, adding them to those of earlier
/// `accumulate` calls, without communicating. The next ordinary `loss.backward()` all-reduces the
/// **sum** of its own gradients and every accumulated one, so one all-reduce serves `n`
/// micro-batches:
///
/// ```ignore
/// for (i, batch) in micro_batches.iter().enumerate() {
///     let loss = model.forward(batch) / n as f32;           // scaled as for one big batch
///     if i + 1 < n {
///         model = bonfire::accumulate(model, loss);       // no communication
///     } else {
///         let grads = loss.backward();                    // sum of all n, averaged over ranks
///         model = optim.step(lr, model, GradientsParams::from_grads(grads, &model));
///     }
/// }
/// ```
///
/// Returns the model with its parameters marked again for synchronisation (Burn's autodiff
/// consumes the marks in every backward; optimizers renew them, `accumulate` does for the steps
/// in between). Calling `loss.backward()` twice between optimizer steps without it would leave
/// the second backward unsynchronised.
pub fn accumulate<B, M>(module: M, loss: Tensor<B, 1>) -> M
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let grads = {
        let _quiet = super::sync::no_sync();
        loss.backward()
    };
    keep_gradients(&module, GradientsParams::from_grads(grads, &module));
    let mut mapper = Replicator {
        rep: None,
        params: Vec::new(),
        path: Vec::new(),
        broadcast: false,
        mark: true,
    };
    module.map(&mut mapper)
}

/// Adds `grads` (from a backward run under [`crate::no_sync`]) to this rank's accumulated
/// gradients: the next synchronised backward all-reduces the sum of its own gradients and the
/// kept ones. [`accumulate`] is `no_sync` + `backward` + `keep_gradients` + marking the
/// parameters again; use this piece when something else runs backward for you (a burn-train
/// `TrainStep`), and mark the parameters again yourself (burn-train's `Learner::grad_sharded`).
pub fn keep_gradients<B, M>(module: &M, grads: GradientsParams)
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut harvest = Harvest::<B> {
        grads,
        rep: None,
        path: Vec::new(),
        _backend: std::marker::PhantomData,
    };
    module.visit(&mut harvest);
    if let Some(rep) = harvest.rep {
        rep.state().unkept = None;
    }
}

/// Drops the gradients kept on this rank by [`accumulate`] or [`keep_gradients`] since the last
/// synchronised backward (an epoch that ends in the middle of an accumulation window).
pub fn discard_kept_gradients<D: burn_backend::DeviceOps>(device: &D) {
    context::for_device(device).state().discard_accumulated();
}

/// Adds each parameter's gradient to the rank's accumulated gradients.
struct Harvest<B: AutodiffBackend> {
    grads: GradientsParams,
    rep: Option<Arc<Replica>>,
    path: Vec<String>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Harvest<B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let rep = self
            .rep
            .get_or_insert_with(|| context::for_device(&param.val().device()))
            .clone();
        let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let values =
            sync::to_host::<B::InnerBackend>(&rep, grad.into_primitive().tensor(), "a gradient");
        let name = self.path.join(".");
        rep.state().accumulate(param.id.val(), || name, &values);
    }
}

struct Replicator {
    rep: Option<Arc<Replica>>,
    params: Vec<ParamInfo>,
    path: Vec<String>,
    /// Broadcast rank 0's values and ids (`replicate`), or only mark again (`accumulate`).
    broadcast: bool,
    /// Mark the parameters for gradient averaging (not `broadcast_parameters`).
    mark: bool,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Replicator {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !self.broadcast {
            let tensor = tensor.set_distributed(DistributedParamId::from(id.val()));
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let device = tensor.device();
        let rep = self
            .rep
            .get_or_insert_with(|| context::for_device(&device))
            .clone();
        let require_grad = tensor.is_require_grad();
        let name = self.path.join(".");
        // This rank's part of the parameter (all of it, but for a tensor-parallel shard).
        let inner = tensor.clone().inner().into_primitive().tensor();
        let numel = local::shape::<B::InnerBackend>(&inner).num_elements();
        let (id, tensor) = if rep.comm.size() > 1 {
            let data = local::read::<B::InnerBackend>(inner.clone()).unwrap_or_else(|e| {
                rep.fail(SyncError::Read {
                    what: format!("parameter {name}"),
                    reason: e.to_string(),
                })
            });
            let (shape, dtype) = (data.shape.clone(), data.dtype);
            let ids = rep
                .comm
                .broadcast(vec![id.val() as i64], 0)
                .wait()
                .unwrap_or_else(|source| {
                    rep.fail(SyncError::Broadcast {
                        param: name.clone(),
                        what: "its id".into(),
                        source,
                    })
                });
            let bytes = rep
                .comm
                .broadcast(data.into_bytes().to_vec(), 0)
                .wait()
                .unwrap_or_else(|source| {
                    rep.fail(SyncError::Broadcast {
                        param: name.clone(),
                        what: format!("{numel} elements, shape {shape:?}"),
                        source,
                    })
                });
            let data = TensorData::from_bytes_vec(bytes, shape, dtype);
            let placed =
                local::write::<B::InnerBackend>(Some(&inner), data, &device, Some(ids[0] as u64));
            (
                ParamId::from(ids[0] as u64),
                Tensor::from_inner(Tensor::from_primitive(TensorPrimitive::Float(placed))),
            )
        } else {
            (id, tensor.detach())
        };
        let tensor = if require_grad {
            tensor.require_grad()
        } else {
            tensor
        };
        // At world size 1 the parameters stay unmarked: Burn's hook machinery costs time in
        // every backward, and there is nothing to average (`accumulate` marks them if needed),
        // unless the configuration asks for the whole path (`sync_alone`, to measure it).
        let tensor = if self.mark && rep.synchronises() {
            tensor.set_distributed(DistributedParamId::from(id.val()))
        } else {
            tensor
        };
        self.params.push(ParamInfo {
            id: id.val(),
            numel: Some(numel),
            name,
        });
        Param::from_mapped_value(id, tensor, mapper)
    }
}
