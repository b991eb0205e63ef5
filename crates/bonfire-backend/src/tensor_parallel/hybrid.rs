//! What `DataParallel` needs to average a split model's gradients shard by shard, in the hybrid
//! `DataParallel<TensorParallel<B>>`: each rank reads and writes only its own part of a tensor,
//! so a gradient is averaged over the data-parallel axis among the ranks that hold the same shard,
//! and never gathered over the tensor-parallel one. A pending sum (the gradient of a replicated
//! parameter, as each rank's term) is summed over the tensor-parallel group first, as the
//! optimizer step would have summed it.

use std::any::Any;
use std::marker::PhantomData;

use burn_backend::{Backend, ExecutionError, Shape, TensorData};

use crate::data_parallel::{LocalParts, register_local_parts};

use super::placement::{Placement, local_shape};
use super::redistribute::{Why, local_of, ranks, whole};
use super::tensor::TpTensor;

/// Registers `TensorParallel<B>`'s parts with `DataParallel` (once; later calls do nothing).
pub(crate) fn register<B: Backend>() {
    register_local_parts::<TpTensor<B>>(Parts::<B>(PhantomData));
}

struct Parts<B>(PhantomData<fn() -> B>);

fn tp<B: Backend>(t: &dyn Any) -> &TpTensor<B> {
    t.downcast_ref::<TpTensor<B>>()
        .expect("registered for TpTensor<B> only")
}

impl<B: Backend> LocalParts for Parts<B> {
    fn shape(&self, tensor: &dyn Any) -> Shape {
        let t = tp::<B>(tensor);
        match t.placement() {
            shard @ Placement::Shard { .. } => local_shape(&t.shape, shard, ranks()),
            Placement::Replicate | Placement::Partial => t.shape.clone(),
        }
    }

    fn read(&self, tensor: &dyn Any) -> Result<TensorData, ExecutionError> {
        let t = tp::<B>(tensor).clone();
        let local = match t.placement() {
            Placement::Partial => whole::<B>(t, Why::Rule("a data-parallel gradient average")),
            _ => local_of::<B>(t),
        };
        futures::executor::block_on(B::float_into_data(local))
    }

    fn write(&self, like: &dyn Any, data: TensorData) -> Box<dyn Any> {
        let like = tp::<B>(like);
        let local = B::float_from_data(data, &like.device());
        let placed: TpTensor<B> = match like.placement() {
            shard @ Placement::Shard { .. } => {
                TpTensor::local(local, shard, Some(like.shape.clone()))
            }
            // A pending sum was summed when it was read: every rank now holds the whole.
            Placement::Replicate | Placement::Partial => TpTensor::replicated(local),
        };
        Box::new(placed)
    }
}
