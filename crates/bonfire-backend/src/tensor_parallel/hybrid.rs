//! What `DataParallel` needs to average a split model's gradients shard by shard, in the hybrid
//! `DataParallel<TensorParallel<B>>`: each rank reads and writes only its own part of a tensor,
//! so a gradient is averaged over the data-parallel axis among the ranks that hold the same shard,
//! and never gathered over the tensor-parallel one. A pending sum (the gradient of a replicated
//! parameter, as each rank's term) is summed over the tensor-parallel group first, as the
//! optimizer step would have summed it.

use std::any::Any;
use std::marker::PhantomData;

use burn_backend::{Backend, ExecutionError, Shape, TensorData};

use crate::data_parallel::{LocalParts, ShardAtRest, register_local_parts};

use super::placement::{Placement, local_shape};
use super::redistribute::{Why, local_of, ranks, whole};
use super::tensor::TpTensor;
use super::{context, fsdp};

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
    // In a fully sharded group (ZeRO stage 3, `fsdp`) the data-parallel ranks are the group's
    // ranks, so a shard is averaged whole (each rank's shard is another part of the tensor), and
    // a parameter's value or gradient is written back as the parameter is sharded.
    fn shape(&self, tensor: &dyn Any) -> Shape {
        let t = tp::<B>(tensor);
        if context::fully_sharded() {
            return t.shape.clone();
        }
        self.held(tensor)
    }

    fn held(&self, tensor: &dyn Any) -> Shape {
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
            Placement::Shard { .. } if context::fully_sharded() => {
                whole::<B>(t, Why::Rule("a fully sharded gradient average"))
            }
            _ => local_of::<B>(t),
        };
        futures::executor::block_on(B::float_into_data(local))
    }

    fn write(&self, like: &dyn Any, data: TensorData) -> Box<dyn Any> {
        let like = tp::<B>(like);
        let local = B::float_from_data(data, &like.device());
        let placed: TpTensor<B> = match like.placement() {
            shard @ Placement::Shard { .. } if !context::fully_sharded() => {
                TpTensor::local(local, shard, Some(like.shape.clone()))
            }
            // A pending sum was summed when it was read: every rank now holds the whole (and in
            // a fully sharded group a shard was read whole).
            _ => TpTensor::replicated(local),
        };
        Box::new(placed)
    }

    fn reshard(&self, tensor: &dyn Any, param: u64) -> Option<Box<dyn Any>> {
        let t = tp::<B>(tensor);
        if !context::fully_sharded() || matches!(t.placement(), Placement::Shard { .. }) {
            return None;
        }
        let placed = fsdp::place_as_param::<B>(t.clone(), param);
        matches!(placed.placement(), Placement::Shard { .. })
            .then(|| Box::new(placed) as Box<dyn Any>)
    }

    fn at_rest(&self, tensor: &dyn Any, param: u64) -> Option<Box<dyn Any>> {
        let g = sharding_group()?;
        let t = tp::<B>(tensor);
        matches!(t.placement(), Placement::Shard { .. })
            .then(|| Box::new(super::prefetch::register::<B>(&g, param, t.clone())) as Box<dyn Any>)
    }

    fn step_begins(&self) {
        if let Some(g) = sharding_group() {
            super::prefetch::step_begins::<B>(&g);
        }
    }

    fn step_ended(&self) {
        if let Some(g) = sharding_group() {
            super::prefetch::step_ended::<B>(&g);
        }
    }

    fn shard_at_rest(&self, param: u64) -> Option<ShardAtRest> {
        if !context::fully_sharded() {
            return None;
        }
        let g = context::current().filter(|g| g.size() > 1)?;
        match g.placed_whole(param)? {
            (Placement::Shard { dim, blocks }, shape) => Some(ShardAtRest {
                shape,
                dim,
                blocks,
                ranks: g.size(),
                rank: g.rank(),
            }),
            _ => None,
        }
    }

    fn write_slice(&self, like: &dyn Any, data: TensorData, split: &ShardAtRest) -> Box<dyn Any> {
        let like = tp::<B>(like);
        let local = B::float_from_data(data, &like.device());
        let placement = Placement::Shard {
            dim: split.dim,
            blocks: split.blocks,
        };
        Box::new(TpTensor::<B>::local(
            local,
            placement,
            Some(Shape::from(split.shape.clone())),
        ))
    }

    fn write_param(&self, like: &dyn Any, data: TensorData, param: u64) -> Box<dyn Any> {
        let placed = self.write(like, data);
        if !context::fully_sharded() {
            return placed;
        }
        let placed = *placed
            .downcast::<TpTensor<B>>()
            .expect("write returns TpTensor<B>");
        Box::new(fsdp::place_as_param::<B>(placed, param))
    }
}

/// The calling thread's group where it shards parameters at rest (ZeRO stage 3) over several
/// ranks.
fn sharding_group() -> Option<std::sync::Arc<context::TpRank>> {
    context::current().filter(|g| g.fully_sharded && g.size() > 1)
}
