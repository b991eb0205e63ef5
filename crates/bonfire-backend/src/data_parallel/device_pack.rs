//! Packing on the device: gradients of a CubeCL inner backend (wgpu, CUDA; plain or under Fusion) are
//! packed into their bucket on the device by the fused pack kernel of `bonfire-kernels` and
//! cross to the host in one transfer per bucket; the averaged bucket comes back in one transfer
//! and the fused unpack kernel writes it into fresh gradient tensors.
//!
//! Without device packing every gradient is read on its own (`float_into_data`: one device
//! synchronisation per parameter) and written back on its own (one upload per parameter). Other
//! inner backends (Flex, NdArray) keep that host path, which costs them nothing extra: their
//! memory is the host's.
//!
//! Which backend a tensor belongs to is found by its type at run time (the primitive types are
//! `'static`), so `DataParallel<B>` stays generic over any `B`.
//!
//! Built without the `wgpu` and `cuda` features, no tensor is packed on the device and every bucket takes
//! the host path.
#![cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]

use std::any::Any;

use bonfire_kernels::{DeviceBuffer, KernelError, pack, unpack};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

/// Whether `t` is an f32 tensor of a CubeCL backend of this build (plain or fused), which the
/// packing handles.
pub(crate) fn supports<B: Backend>(t: &FloatTensor<B>) -> bool {
    if burn_backend::TensorMetadata::dtype(t) != DType::F32 {
        return false;
    }
    let t = t as &dyn Any;
    #[cfg(feature = "wgpu")]
    if is_cube::<cubecl::wgpu::WgpuRuntime>(t) {
        return true;
    }
    #[cfg(feature = "cuda")]
    if is_cube::<cubecl::cuda::CudaRuntime>(t) {
        return true;
    }
    let _ = t;
    false
}

fn is_cube<R: CubeRuntime>(t: &dyn Any) -> bool {
    t.is::<CubeTensor<R>>() || t.is::<FusionFloat<R>>()
}

/// Packs `grads` (f32, in this order) into one buffer on their device with one launch of the
/// fused pack kernel and reads it to the host in one transfer. `None` when the tensors do not
/// belong to a CubeCL backend of this build, or are not f32 (the caller takes the host path).
pub(crate) fn pack_read<B: Backend>(
    grads: &[FloatTensor<B>],
) -> Option<Result<Vec<f32>, KernelError>> {
    let any: Vec<&dyn Any> = grads.iter().map(|g| g as &dyn Any).collect();
    #[cfg(feature = "wgpu")]
    if let Some(r) = pack_read_on::<cubecl::wgpu::WgpuRuntime>(&any) {
        return Some(r);
    }
    #[cfg(feature = "cuda")]
    if let Some(r) = pack_read_on::<cubecl::cuda::CudaRuntime>(&any) {
        return Some(r);
    }
    let _ = any;
    None
}

/// Uploads `values` in one transfer and unpacks them with one launch of the fused unpack kernel
/// into new f32 tensors of `shapes` (their sizes add up to `values.len()`), on the device of
/// `like`. `None` when `like` does not belong to a CubeCL backend of this build.
pub(crate) fn upload_unpack<B: Backend>(
    like: &FloatTensor<B>,
    values: &[f32],
    shapes: &[Shape],
) -> Option<Result<Vec<FloatTensor<B>>, KernelError>> {
    let like = like as &dyn Any;
    #[cfg(feature = "wgpu")]
    if let Some(r) = upload_unpack_on::<cubecl::wgpu::WgpuRuntime, B>(like, values, shapes) {
        return Some(r);
    }
    #[cfg(feature = "cuda")]
    if let Some(r) = upload_unpack_on::<cubecl::cuda::CudaRuntime, B>(like, values, shapes) {
        return Some(r);
    }
    let _ = (like, values, shapes);
    None
}

/// The float primitive of `Fusion<CubeBackend<R, ..>>`.
type FusionFloat<R> = burn_fusion::FusionTensor<burn_cubecl::fusion::FusionCubeRuntime<R>>;
/// A `CubeBackend` over `R`, to name `R`'s fusion server (its float primitive is `CubeTensor<R>`
/// whatever the element types).
type Cube<R> = burn_cubecl::CubeBackend<R, f32, i32, u32>;

/// `t` as a contiguous `CubeTensor<R>`, if it is a plain or fused tensor of runtime `R`.
fn as_cube<R: CubeRuntime>(t: &dyn Any) -> Option<CubeTensor<R>> {
    let t = if let Some(c) = t.downcast_ref::<CubeTensor<R>>() {
        c.clone()
    } else {
        let f = t.downcast_ref::<FusionFloat<R>>()?;
        f.client.resolve_tensor_float::<Cube<R>>(f.clone())
    };
    Some(if t.is_contiguous() {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    })
}

/// The buffers of contiguous f32 tensors, for the fused kernels.
fn buffers_of<R: CubeRuntime>(tensors: &[CubeTensor<R>]) -> Vec<DeviceBuffer<R, f32>> {
    tensors
        .iter()
        .map(|t| {
            // SAFETY: a contiguous f32 tensor's handle holds its elements from the start (the
            // callers made them contiguous and checked their dtype).
            unsafe {
                DeviceBuffer::from_raw_handle(t.handle.clone(), t.meta.shape().num_elements())
            }
        })
        .collect()
}

fn pack_read_on<R: CubeRuntime>(grads: &[&dyn Any]) -> Option<Result<Vec<f32>, KernelError>> {
    if !is_cube::<R>(*grads.first()?) {
        return None;
    }
    let tensors: Vec<CubeTensor<R>> = grads
        .iter()
        .map(|g| as_cube::<R>(*g))
        .collect::<Option<_>>()?;
    if tensors.iter().any(|t| t.dtype != DType::F32) {
        return None;
    }
    let client = tensors[0].client.clone();
    let buffers = buffers_of(&tensors);
    let total = buffers.iter().map(|b| b.len()).sum();
    let bucket = DeviceBuffer::<R, f32>::empty(&client, total);
    let inputs: Vec<&DeviceBuffer<R, f32>> = buffers.iter().collect();
    Some(pack(&client, &inputs, &bucket, 1.0).and_then(|()| bucket.download(&client)))
}

fn upload_unpack_on<R: CubeRuntime, B: Backend>(
    like: &dyn Any,
    values: &[f32],
    shapes: &[Shape],
) -> Option<Result<Vec<FloatTensor<B>>, KernelError>> {
    let (client, _, _) = cube_client::<R>(like)?;
    let bucket = DeviceBuffer::<R, f32>::upload(&client, values);
    unpack_tensors::<R, B>(like, &bucket, shapes)
}

/// The client and device of `like` (a plain or fused tensor of runtime `R`), and its fusion
/// client if fused.
#[allow(clippy::type_complexity)]
fn cube_client<R: CubeRuntime>(
    like: &dyn Any,
) -> Option<(
    cubecl::prelude::ComputeClient<R>,
    R::Device,
    Option<burn_fusion::client::GlobalFusionClient<burn_cubecl::fusion::FusionCubeRuntime<R>>>,
)> {
    if let Some(c) = like.downcast_ref::<CubeTensor<R>>() {
        Some((c.client.clone(), c.device.clone(), None))
    } else {
        let f = like.downcast_ref::<FusionFloat<R>>()?;
        let device = f.client.device().clone();
        Some((R::client(&device), device, Some(f.client.clone())))
    }
}

/// Unpacks `bucket` (on the device of `like`) with one launch of the fused unpack kernel into
/// new f32 tensors of `shapes`, plain or fused as `like` is.
fn unpack_tensors<R: CubeRuntime, B: Backend>(
    like: &dyn Any,
    bucket: &DeviceBuffer<R, f32>,
    shapes: &[Shape],
) -> Option<Result<Vec<FloatTensor<B>>, KernelError>> {
    let (client, device, fused) = cube_client::<R>(like)?;
    let outputs: Vec<DeviceBuffer<R, f32>> = shapes
        .iter()
        .map(|s| DeviceBuffer::empty(&client, s.num_elements()))
        .collect();
    let refs: Vec<&DeviceBuffer<R, f32>> = outputs.iter().collect();
    if let Err(e) = unpack(&client, bucket, &refs, 1.0) {
        return Some(Err(e));
    }
    let tensors = outputs.into_iter().zip(shapes).map(|(b, shape)| {
        CubeTensor::new_contiguous(
            client.clone(),
            device.clone(),
            shape.clone(),
            b.handle().clone(),
            DType::F32,
        )
    });
    let out: Vec<Box<dyn Any>> = match fused {
        None => tensors.map(|t| Box::new(t) as Box<dyn Any>).collect(),
        Some(fc) => tensors
            .map(|t| Box::new(register_fused::<R>(&fc, t)) as Box<dyn Any>)
            .collect(),
    };
    out.into_iter()
        .map(|t| t.downcast::<FloatTensor<B>>().ok().map(|t| *t))
        .collect::<Option<Vec<_>>>()
        .map(Ok)
}

/// A bucket's gradients packed on a CUDA device, waiting for the device lane
/// ([`super::lane`]): the packed buffer, where each gradient lies in it and in the bucket, and
/// the bucket's presence flags (filled in when the bucket is launched).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct LaneBucket {
    #[cfg(feature = "cuda")]
    packed: DeviceBuffer<cubecl::cuda::CudaRuntime, f32>,
    #[cfg(feature = "cuda")]
    client: cubecl::prelude::ComputeClient<cubecl::cuda::CudaRuntime>,
    /// The CUDA device the gradients live on.
    pub(crate) ordinal: usize,
    /// (offset in the bucket, offset in the packed buffer, length) of each gradient, in bucket
    /// order.
    segments: Vec<(usize, usize, usize)>,
    /// The presence flags of the bucket's parameters.
    pub(crate) flags: Vec<f32>,
}

/// Packs `grads` (f32 gradients of a CUDA backend, plain or fused; `offsets` their places in
/// their bucket) into one device buffer in bucket order, with one launch of the fused pack
/// kernel, for the device lane. `None` for any other tensors.
pub(crate) fn pack_for_lane<B: Backend>(
    grads: &[FloatTensor<B>],
    offsets: &[usize],
) -> Option<Result<LaneBucket, KernelError>> {
    #[cfg(feature = "cuda")]
    {
        use cubecl::cuda::CudaRuntime;
        let first = grads.first()? as &dyn Any;
        if !is_cube::<CudaRuntime>(first) {
            return None;
        }
        let mut order: Vec<usize> = (0..grads.len()).collect();
        order.sort_by_key(|&k| offsets[k]);
        let tensors: Vec<CubeTensor<CudaRuntime>> = order
            .iter()
            .map(|&k| as_cube::<CudaRuntime>(&grads[k] as &dyn Any))
            .collect::<Option<_>>()?;
        if tensors.iter().any(|t| t.dtype != DType::F32) {
            return None;
        }
        let client = tensors[0].client.clone();
        let ordinal = tensors[0].device.index;
        let buffers = buffers_of(&tensors);
        let mut segments = Vec::with_capacity(buffers.len());
        let mut at = 0;
        for (&k, b) in order.iter().zip(&buffers) {
            segments.push((offsets[k], at, b.len()));
            at += b.len();
        }
        let packed = DeviceBuffer::<CudaRuntime, f32>::empty(&client, at);
        let inputs: Vec<&DeviceBuffer<CudaRuntime, f32>> = buffers.iter().collect();
        Some(pack(&client, &inputs, &packed, 1.0).map(|()| LaneBucket {
            packed,
            client,
            ordinal,
            segments,
            flags: Vec::new(),
        }))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (grads, offsets);
        None
    }
}

/// All-reduces a bucket packed for the lane: its gradients (`len` elements in bucket layout)
/// and its presence flags go into the rank's window, `lane` reduces them with the other ranks',
/// and the result comes back into new tensors of `shapes` (every slot of the bucket, in order;
/// like `like`, plain or fused) with one launch of the fused unpack kernel. Returns the reduced
/// flags and the tensors.
#[cfg(feature = "cuda")]
pub(crate) fn lane_all_reduce<B: Backend>(
    node: &super::lane::NodeLane,
    bucket: LaneBucket,
    len: usize,
    op: bonfire_kernels::lane::LaneOp,
    like: &FloatTensor<B>,
    shapes: &[Shape],
) -> Result<(Vec<f32>, Vec<FloatTensor<B>>), String> {
    use cubecl::cuda::CudaRuntime;
    let LaneBucket {
        packed,
        client,
        segments,
        mut flags,
        ..
    } = bucket;
    let lane = node.lane();
    let lane_err = |e: bonfire_kernels::lane::LaneError| e.to_string();
    // The pack kernel ran on CubeCL's stream: done before the lane's stream reads its output.
    futures::executor::block_on(client.sync()).map_err(|e| format!("{e:?}"))?;
    let src = client
        .get_resource(packed.handle().clone())
        .map_err(|e| format!("{e:?}"))?;
    let src_ptr = src.resource().ptr;
    let contiguous = segments.iter().try_fold(0, |at, &(off, p, n)| {
        (off == at && p == at).then_some(at + n)
    }) == Some(len);
    // SAFETY: `src` keeps the packed buffer alive and CubeCL's stream is idle for it (synced
    // above); the lane's stream is synchronised by the all-reduce below, before `src` drops.
    unsafe {
        if contiguous {
            lane.copy_in(0, src_ptr, len * 4).map_err(lane_err)?;
        } else {
            lane.zero(len * 4).map_err(lane_err)?;
            for &(off, p, n) in &segments {
                lane.copy_in(off * 4, src_ptr + (p * 4) as u64, n * 4)
                    .map_err(lane_err)?;
            }
        }
    }
    lane.write_at(len, &flags).map_err(lane_err)?;
    node.all_reduce(len + flags.len(), op).map_err(lane_err)?;
    drop(src);
    lane.read_at(len, &mut flags).map_err(lane_err)?;
    let out = DeviceBuffer::<CudaRuntime, f32>::empty(&client, len.max(1));
    let dst = client
        .get_resource(out.handle().clone())
        .map_err(|e| format!("{e:?}"))?;
    // SAFETY: a fresh buffer of `len` elements that no kernel has been given yet; the copy is
    // waited for before CubeCL's unpack reads it.
    unsafe { lane.copy_out(0, dst.resource().ptr, len * 4) }.map_err(lane_err)?;
    lane.sync().map_err(lane_err)?;
    drop(dst);
    // SAFETY: `out` holds `len` elements (one more when the bucket is empty).
    let out = unsafe { DeviceBuffer::from_raw_handle(out.handle().clone(), len) };
    let tensors = unpack_tensors::<CudaRuntime, B>(like as &dyn Any, &out, shapes)
        .ok_or("the gradients are not on a CUDA device")?
        .map_err(|e| e.to_string())?;
    Ok((flags, tensors))
}

/// Reads a bucket packed for the lane back to the host in bucket layout (`len` elements), for
/// ranks that went without the lane after all.
#[cfg(feature = "cuda")]
pub(crate) fn lane_bucket_to_host(
    bucket: &LaneBucket,
    len: usize,
) -> Result<Vec<f32>, KernelError> {
    let packed = bucket.packed.download(&bucket.client)?;
    let mut out = vec![0.0; len];
    for &(off, p, n) in &bucket.segments {
        out[off..off + n].copy_from_slice(&packed[p..p + n]);
    }
    Ok(out)
}

/// Hands a computed tensor to the fusion server of its device, as `Fusion::float_from_data`
/// does with uploaded data.
fn register_fused<R: CubeRuntime>(
    client: &burn_fusion::client::GlobalFusionClient<burn_cubecl::fusion::FusionCubeRuntime<R>>,
    t: CubeTensor<R>,
) -> FusionFloat<R> {
    let shape = t.meta.shape().clone();
    let dtype = t.dtype;
    let handle = <Cube<R> as burn_ir::BackendIr>::float_tensor_handle(t);
    let desc =
        burn_ir::InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            burn_fusion::stream::OperationStreams::default(),
            burn_ir::OperationIr::Init(desc),
            burn_fusion::NoOp::<Cube<R>>::new(),
        )
        .remove(0)
}
