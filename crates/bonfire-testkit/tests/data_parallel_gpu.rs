//! `DataParallel` over the GPU backends: wgpu (Mesa's software Vulkan in CI) and CUDA (feature
//! `cuda`, on a machine with an NVIDIA GPU). Buckets are packed on the device by the fused pack
//! kernel, cross to the host in one transfer each way, and the averages are written back by the
//! fused unpack kernel. Checked against one rank with the whole batch (f32, max abs difference at
//! most 1e-5) and against the host path (every gradient read on its own), which must give the
//! same bits. On CUDA the buckets also go through the device lane (the ranks' device windows,
//! reduced by the lane's kernel, never crossing to the host), which must give those bits too,
//! and with four ranks placed on two nodes through the lane's hierarchical schedule. Ranks are
//! threads of this process over the in-process transport, sharing one device (the way
//! burn-train's DDP runs when a device is listed twice); the lane between processes (CUDA IPC)
//! is tested in `bonfire-kernels`' `device_lane` tests and by `bonfire train --backend cuda`.

use std::time::Duration;

use bonfire::backend::{DataParallelConfig, FailurePolicy, StepStats, bind_thread};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire_testkit::nets::{
    Batch, Net, SmallMlp, max_abs_diff, parameters, random_batches, seeded, train,
};
use bonfire_testkit::{RankModels, run_ranks};
use burn::backend::Autodiff;
use burn::backend::wgpu::{CubeBackend, Wgpu, WgpuDevice, WgpuRuntime};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn_fusion::Fusion;

type Params = Vec<Vec<f32>>;
/// The CubeCL wgpu backend under Fusion: what `Wgpu` is with Burn's default features.
type DpFused = Autodiff<bonfire::DataParallel<Fusion<CubeBackend<WgpuRuntime, f32, i32, u32>>>>;
/// The CubeCL wgpu backend without Fusion: what `Wgpu` is in this workspace's build.
type DpCube = Autodiff<bonfire::DataParallel<Wgpu>>;

const STEPS: usize = 3;
const TOLERANCE: f32 = 1e-5;

/// Which way buckets travel.
#[derive(Copy, Clone, Debug, PartialEq)]
enum Path {
    /// Packed on the device, all-reduced through the device lane where there is one (CUDA).
    Lane,
    /// Packed on the device, all-reduced on the host.
    Packed,
    /// Every gradient read and written on its own, all-reduced on the host.
    Host,
}

fn config(path: Path) -> DataParallelConfig {
    DataParallelConfig {
        failure: FailurePolicy::Panic,
        // 64 bytes: the head's bias (3 floats) and weight (24) and the hidden layer's bias (8)
        // and weight (96) fall into several buckets, some of them holding two parameters.
        bucket_cap_bytes: 64,
        first_bucket_cap_bytes: 64,
        device_pack: path != Path::Host,
        device_lane: path == Path::Lane,
        ..DataParallelConfig::default()
    }
}

fn comm_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(120),
        ..CommConfig::default()
    }
}

/// One rank, whole batches.
fn single<B>(model: SmallMlp<B>, batches: &[Batch], device: &B::Device) -> Params
where
    B: AutodiffBackend,
    SmallMlp<B>: AutodiffModule<B>,
{
    let _bind = bind_thread(
        Communicator::in_process(1, comm_config()).remove(0),
        config(Path::Packed),
    );
    let model = bonfire::replicate(model);
    parameters(&train(model, batches, 1, device).0)
}

/// One rank per communicator, as threads, each on its share of every batch; the ranks after
/// the first start from other parameters (replicate must copy rank 0's). Returns each rank's
/// parameters and last-step statistics.
fn ranks<B>(
    comms: Vec<Communicator>,
    rank0: SmallMlp<B>,
    batches: &[Batch],
    path: Path,
    device: &B::Device,
) -> Vec<(Params, StepStats)>
where
    B: AutodiffBackend,
    SmallMlp<B>: AutodiffModule<B> + 'static,
{
    let n = comms.len();
    let device = device.clone();
    let mut models = vec![rank0];
    models.extend((1..n).map(|r| seeded::<B, _>(1000 + r as u64, &device, SmallMlp::new)));
    let models = RankModels::new(models);
    let batches = batches.to_vec();
    run_ranks(comms, Duration::from_secs(600), move |comm| {
        let r = comm.rank();
        let model = models.take(r);
        let _bind = bind_thread(comm, config(path));
        let model = bonfire::replicate(model);
        let shard: Vec<Batch> = batches.iter().map(|b| b.share(r, n)).collect();
        let (model, _) = train(model, &shard, 1, &device);
        let stats = bonfire::last_step_stats().expect("bound");
        (parameters(&model), stats)
    })
}

/// `lane`: whether this backend has the device lane (CUDA).
fn check<B>(what: &str, device: B::Device, lane: bool)
where
    B: AutodiffBackend,
    SmallMlp<B>: AutodiffModule<B> + 'static,
{
    let batches = random_batches(21, STEPS, 8, SmallMlp::<B>::FEATURES, 3);
    let base = seeded::<B, _>(1, &device, SmallMlp::new);
    let initial = parameters(&base);
    let reference = single(base.clone(), &batches, &device);
    assert!(
        max_abs_diff(&initial, &reference) > 1e-3,
        "{what}: the reference run did not train"
    );

    let two = || Communicator::in_process(2, comm_config());
    let through_lane = ranks(two(), base.clone(), &batches, Path::Lane, &device);
    let on_device = ranks(two(), base.clone(), &batches, Path::Packed, &device);
    let host = ranks(two(), base, &batches, Path::Host, &device);
    for (r, ((ln, ln_stats), (dev, dev_stats))) in through_lane.iter().zip(&on_device).enumerate() {
        // The device lane sums in rank order and scales once, as the host's all-reduce of two.
        assert_eq!(ln, dev, "{what}: rank {r}, device lane against host lane");
        let expected = if lane { ln_stats.buckets } else { 0 };
        assert_eq!(
            ln_stats.device_lane, expected,
            "{what}: buckets through the device lane: {ln_stats:?}"
        );
        assert_eq!(dev_stats.device_lane, 0, "{what}: lane off: {dev_stats:?}");
    }
    for (r, ((dev, dev_stats), (hst, hst_stats))) in on_device.iter().zip(&host).enumerate() {
        let d = max_abs_diff(&reference, dev);
        assert!(
            d <= TOLERANCE,
            "{what}: rank {r} differs from one rank by {d:e}"
        );
        assert_eq!(dev, &on_device[0].0, "{what}: rank {r} drifted from rank 0");
        // Packing on the device moves the same numbers as reading them one by one.
        assert_eq!(
            dev, hst,
            "{what}: rank {r}, device packing against host path"
        );
        assert!(dev_stats.buckets >= 3, "{what}: {dev_stats:?}");
        assert_eq!(
            dev_stats.device_packed, dev_stats.buckets,
            "{what}: every bucket packed on the device: {dev_stats:?}"
        );
        assert_eq!(hst_stats.device_packed, 0, "{what}: {hst_stats:?}");
        assert_eq!(dev_stats.bytes, hst_stats.bytes, "{what}");
    }
}

#[test]
fn fused_wgpu_buckets_are_packed_on_the_device_and_match_one_rank() {
    check::<DpFused>(
        "Autodiff<DataParallel<Fusion<CubeBackend<WgpuRuntime>>>>",
        WgpuDevice::default(),
        false,
    );
}

#[test]
fn plain_cubecl_buckets_are_packed_on_the_device_and_match_one_rank() {
    check::<DpCube>("Autodiff<DataParallel<Wgpu>>", WgpuDevice::default(), false);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_buckets_are_packed_on_the_device_and_match_one_rank() {
    use bonfire::kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
    type Cube = CubeBackend<CudaRuntime, f32, i32, u32>;
    check::<Autodiff<bonfire::DataParallel<Cube>>>(
        "Autodiff<DataParallel<CubeBackend<CudaRuntime>>>",
        CudaDevice::default(),
        true,
    );
    check::<Autodiff<bonfire::DataParallel<Fusion<Cube>>>>(
        "Autodiff<DataParallel<Fusion<CubeBackend<CudaRuntime>>>>",
        CudaDevice::default(),
        true,
    );
}

/// Four ranks on two nodes (threads standing in for two hosts of two GPUs): each node's ranks
/// reduce-scatter through their lane, each share crosses to the other node's rank of the same
/// local index over the job's link, and the node all-gathers on the device. Checked against the
/// host lane over the same layout and against one rank with the whole batch.
#[cfg(feature = "cuda")]
#[test]
fn cuda_buckets_cross_nodes_through_the_hierarchical_lane() {
    use bonfire::kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
    use bonfire::topology::NodeLayout;
    type B = Autodiff<bonfire::DataParallel<CubeBackend<CudaRuntime, f32, i32, u32>>>;
    if let Err(why) = bonfire::kernels::lane::devices() {
        eprintln!("skipped: {why}");
        return;
    }
    let device = CudaDevice::default();
    let layout = NodeLayout::uniform(4, 2);
    let batches = random_batches(23, STEPS, 8, SmallMlp::<B>::FEATURES, 3);
    let base = seeded::<B, _>(1, &device, SmallMlp::new);
    let reference = single(base.clone(), &batches, &device);
    let comms = || Communicator::in_process_on(&layout, comm_config());
    let lane = ranks(comms(), base.clone(), &batches, Path::Lane, &device);
    let host = ranks(comms(), base, &batches, Path::Packed, &device);
    for (r, ((ln, ln_stats), (hst, hst_stats))) in lane.iter().zip(&host).enumerate() {
        assert_eq!(
            ln_stats.device_lane, ln_stats.buckets,
            "rank {r}: every bucket through the lane: {ln_stats:?}"
        );
        assert!(ln_stats.buckets >= 3, "{ln_stats:?}");
        assert_eq!(hst_stats.device_lane, 0, "{hst_stats:?}");
        // The node all-gathers one result: the same bits on every rank.
        assert_eq!(ln, &lane[0].0, "rank {r} drifted from rank 0");
        let d = max_abs_diff(ln, hst);
        assert!(
            d <= 1e-6,
            "rank {r}: the lane across nodes differs from the host lane by {d:e}"
        );
        let d = max_abs_diff(ln, &reference);
        assert!(d <= TOLERANCE, "rank {r} differs from one rank by {d:e}");
    }
}
