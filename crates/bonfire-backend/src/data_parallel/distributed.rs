//! `DataParallel<B>`'s `DistributedBackend` impl: Burn's gradient-ready hook, routed to the
//! synchroniser in `sync.rs`. Each hook finds its rank's replica once and hands it on.

use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedConfig, DistributedParams, ReduceOperation,
    TensorRef,
};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DeviceId, DeviceOps, TensorMetadata};

use super::error::SyncError;
use super::{DataParallel, context, local, sync};

impl<B: Backend> DistributedBackend for DataParallel<B> {
    /// burn-train's one-process DDP: every listed device becomes a rank of an in-process group.
    /// Under `bonfire launch` (one process per rank) this is not needed: `bonfire::init` has
    /// installed the job's communicator.
    fn start_communication_server(devices: &[Self::Device], config: DistributedConfig) {
        if devices.len() > 1 {
            let ids: Vec<DeviceId> = devices.iter().map(|d| d.id()).collect();
            context::bind_devices(&ids, config.all_reduce_op == ReduceOperation::Mean);
        }
    }

    fn close_communication_server(device: &Self::Device) {
        context::unbind_device(device.id());
    }

    fn register_sync_parameters(device: &Self::Device, params: Vec<DistributedParams>) {
        sync::begin::<B>(&context::for_device(device), params);
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        // SAFETY: Burn hands us a pointer into its gradient container, valid and not otherwise
        // accessed until backward returns.
        let device = B::float_device(unsafe { &*tensor.0 });
        sync::gradient::<B>(&context::for_device(&device), tensor, params);
    }

    fn submit_sync_collective(device: &Self::Device) {
        sync::finish::<B>(&context::for_device(device), device);
    }

    /// An explicit all-reduce over the calling rank's group (the device ids are not needed: the
    /// group is the job's). It completes before returning.
    fn all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        _device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        let device = B::float_device(&tensor);
        let rep = context::for_device(&device);
        let (shape, dtype) = (local::shape::<B>(&tensor), tensor.dtype());
        let like = tensor.clone();
        let values = sync::to_host::<B>(&rep, tensor, "all_reduce's tensor");
        let n = values.len();
        let op = match op {
            ReduceOperation::Sum => bonfire_topology::ReduceOp::Sum,
            ReduceOperation::Mean => bonfire_topology::ReduceOp::Mean,
        };
        let reduced = match rep.comm.all_reduce(values, op).wait() {
            Ok(v) => v,
            Err(source) => rep.fail(SyncError::ExplicitAllReduce {
                elements: n,
                source,
            }),
        };
        CollectiveTensor::new(sync::from_host::<B>(
            reduced,
            shape,
            dtype,
            &device,
            Some(&like),
            None,
        ))
    }

    /// Nothing to wait for: [`DistributedBackend::all_reduce`] completes before it returns.
    fn sync_collective(_device: &Self::Device) {}
}
