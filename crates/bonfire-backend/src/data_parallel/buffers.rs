//! Making every rank's buffers (batch norm's running mean and variance: a module's float tensors
//! that are not trained) the same.

use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

use super::context::{self, Replica};
use super::error::SyncError;
use super::local;

/// How [`sync_buffers`] makes the ranks' buffers equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferSync {
    /// Every rank takes the mean over the ranks: each running statistic then reflects every
    /// rank's batches, not one rank's.
    Average,
    /// Every rank takes rank 0's, as PyTorch DDP's `broadcast_buffers` does before each forward.
    FromRank0,
}

/// Makes every rank's buffers the same: a module's float tensors that take no gradient, such as
/// batch norm's running mean and variance. Gradient averaging keeps the parameters equal, but
/// each rank updates its running statistics from its own batches only, so they drift apart;
/// call this on every rank (after an epoch, or before evaluating or saving) to average them, or
/// to take rank 0's. Trained parameters are left as they are. At world size 1 it returns the
/// module unchanged.
///
/// A failed collective (a dead rank, a rank whose model has other buffers) stops the rank by
/// the [`crate::FailurePolicy`], naming the buffer.
pub fn sync_buffers<B, M>(module: M, how: BufferSync) -> M
where
    B: AutodiffBackend,
    M: Module<B>,
{
    let mut mapper = Buffers {
        how,
        rep: None,
        path: Vec::new(),
    };
    module.map(&mut mapper)
}

struct Buffers {
    how: BufferSync,
    rep: Option<Arc<Replica>>,
    path: Vec<String>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Buffers {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let device = tensor.device();
        let rep = self
            .rep
            .get_or_insert_with(|| context::for_device(&device))
            .clone();
        let size = rep.comm.size();
        if size == 1 {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let name = self.path.join(".");
        let inner = tensor.inner().into_primitive().tensor();
        let data = local::read::<B::InnerBackend>(inner.clone()).unwrap_or_else(|e| {
            rep.fail(SyncError::Read {
                what: format!("buffer {name}"),
                reason: e.to_string(),
            })
        });
        let (shape, dtype) = (data.shape.clone(), data.dtype);
        let fail = |source| SyncError::Buffer {
            buffer: name.clone(),
            how: self.how,
            elements: shape.num_elements(),
            source,
        };
        let data = match self.how {
            BufferSync::FromRank0 => {
                let bytes = rep
                    .comm
                    .broadcast(data.into_bytes().to_vec(), 0)
                    .wait()
                    .unwrap_or_else(|e| rep.fail(fail(e)));
                TensorData::from_bytes_vec(bytes, shape, dtype)
            }
            BufferSync::Average => {
                let values: Vec<f32> =
                    data.convert_dtype(DType::F32)
                        .into_vec()
                        .unwrap_or_else(|e| {
                            rep.fail(SyncError::Read {
                                what: format!("buffer {name}"),
                                reason: format!("{e:?}"),
                            })
                        });
                let summed = rep
                    .comm
                    .all_reduce(values, bonfire_topology::ReduceOp::Sum)
                    .wait()
                    .unwrap_or_else(|e| rep.fail(fail(e)));
                let mean: Vec<f32> = summed.into_iter().map(|v| v / size as f32).collect();
                TensorData::new(mean, shape).convert_dtype(dtype)
            }
        };
        let placed = local::write::<B::InnerBackend>(Some(&inner), data, &device, Some(id.val()));
        let tensor = Tensor::from_inner(Tensor::from_primitive(TensorPrimitive::Float(placed)));
        Param::from_mapped_value(id, tensor, mapper)
    }
}
