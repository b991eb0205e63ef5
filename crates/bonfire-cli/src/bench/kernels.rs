//! `bonfire bench kernels`: the fused gradient kernels against the same work done with Burn
//! tensor ops, and against the device's own copy bandwidth, in one run.

use std::time::Instant;

use bonfire_kernels::{DeviceBuffer, GradElement, copy, pack, reduce, supports, unpack};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_cubecl::{CubeBackend, CubeRuntime};
use cubecl::prelude::{ComputeClient, Runtime};
use half::f16;

use crate::error::CliError;
use crate::size;

/// Burn's CubeCL backend over runtime `R`, without fusion: what the fused kernels replace.
type Burn<R> = CubeBackend<R, f32, i32, u32>;

/// Arguments of `bonfire bench kernels`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Bucket sizes in bytes of f32 gradients, comma-separated (binary units).
    #[arg(long, value_delimiter = ',', default_value = "1M,4M,25M", value_parser = size::parse)]
    sizes: Vec<usize>,
    /// Gradient buffers per bucket (of different lengths).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256))]
    buffers: u32,
    /// Timed iterations per measurement [default: enough to move about 1 GiB, 3 to 200].
    #[arg(long)]
    iters: Option<usize>,
    /// Vectors per unit of the pack and unpack kernels to measure, comma-separated (1, 2, 4, 8,
    /// 16; 0: chosen per launch, the library's default) [default: 0]
    #[arg(long, value_delimiter = ',')]
    vectors_per_unit: Vec<u32>,
    /// The CubeCL runtime: wgpu (any GPU, or Mesa's software Vulkan) or cuda (a build with
    /// `--features cuda`).
    #[arg(long, default_value = "wgpu", value_parser = ["wgpu", "cuda"])]
    runtime: String,
}

/// Lengths of `buffers` buffers adding up to `total`: uneven, like a model's parameters, and
/// multiples of 4 as most parameter tensors are (so the kernels can move 4 elements per unit).
fn lengths(total: usize, buffers: usize) -> Vec<usize> {
    let weights: Vec<usize> = (0..buffers).map(|i| 1 + (i * 7919) % 13).collect();
    let sum: usize = weights.iter().sum();
    let mut lens: Vec<usize> = weights.iter().map(|w| total * w / sum / 4 * 4).collect();
    let short = total - lens.iter().sum::<usize>();
    lens[0] += short;
    lens
}

/// Mean seconds per call of `f` over `iters` calls after `warmup`, `sync` closing each batch.
fn time(iters: usize, mut f: impl FnMut(), sync: &dyn Fn()) -> f64 {
    for _ in 0..iters.div_ceil(10).max(1) {
        f();
    }
    sync();
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    sync();
    start.elapsed().as_secs_f64() / iters as f64
}

struct Row {
    what: String,
    fused: f64,
    burn: f64,
    bytes_moved: usize,
}

fn print_row(row: &Row, copy_gbps: f64) {
    let gbps = row.bytes_moved as f64 / row.fused / 1e9;
    println!(
        "  {:<30} {:>11.1} {:>11.1} {:>8.2} {:>10.3} {:>9.3}",
        row.what,
        row.fused * 1e6,
        row.burn * 1e6,
        row.burn / row.fused,
        gbps,
        gbps / copy_gbps
    );
}

fn upload_all<R: Runtime, T: GradElement>(
    client: &ComputeClient<R>,
    host: &[Vec<T>],
) -> Vec<DeviceBuffer<R, T>> {
    host.iter()
        .map(|h| DeviceBuffer::upload(client, h))
        .collect()
}

pub(crate) fn run(args: Args) -> Result<(), CliError> {
    // clap admits only `wgpu` and `cuda`.
    match args.runtime.as_str() {
        "wgpu" => {
            use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
            run_on::<WgpuRuntime>(&args, WgpuDevice::default(), bonfire_jobs::WGPU_HINT)
        }
        _ => cuda(&args),
    }
}

#[cfg(feature = "cuda")]
fn cuda(args: &Args) -> Result<(), CliError> {
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    run_on::<CudaRuntime>(args, CudaDevice::default(), bonfire_jobs::CUDA_HINT)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &Args) -> Result<(), CliError> {
    Err(bonfire_jobs::JobError::NoCuda.into())
}

fn run_on<R: CubeRuntime>(
    args: &Args,
    device: R::Device,
    hint: &'static str,
) -> Result<(), CliError> {
    let client = bonfire_jobs::open_gpu::<R>(&device, &args.runtime, hint)?;
    let sync = || {
        let _ = <Burn<R> as Backend>::sync(&device);
        let _ = cubecl::future::block_on(client.sync());
    };
    let half_ok = supports::<R, f16>(&client);
    let settings = if args.vectors_per_unit.is_empty() {
        vec![bonfire_kernels::vectors_per_unit()]
    } else {
        args.vectors_per_unit.clone()
    };
    println!(
        "# bonfire bench kernels: {} default device ({}), {} gradient buffers per bucket; Burn 0.21 tensor ops on the same device (fusion off)",
        args.runtime,
        R::name(&client),
        args.buffers
    );
    println!(
        "# {:<30} {:>11} {:>11} {:>8} {:>10} {:>9}",
        "operation", "fused(us)", "burn(us)", "speedup", "GB/s", "vs copy"
    );
    let bar = super::sizes_bar(args.sizes.len(), false);
    for &bytes in &args.sizes {
        bar.set_message(size::format(bytes));
        let n = (bytes / 16 * 4).max(4);
        let iters = args
            .iters
            .unwrap_or_else(|| ((1usize << 30) / (bytes.max(1) * 2)).clamp(3, 200));
        let lens = lengths(n, args.buffers as usize);
        let host: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(j, &l)| {
                (0..l)
                    .map(|i| ((i * 31 + j) % 1000) as f32 * 1e-3 - 0.5)
                    .collect()
            })
            .collect();
        let grads = upload_all(&client, &host);
        let grad_refs: Vec<&DeviceBuffer<R, f32>> = grads.iter().collect();
        let bucket = DeviceBuffer::<R, f32>::filled(&client, n, 0.0);
        let burn_grads: Vec<Tensor<Burn<R>, 1>> = host
            .iter()
            .map(|h| Tensor::from_data(TensorData::new(h.clone(), [h.len()]), &device))
            .collect();
        println!(
            "  -- {} ({} f32), {iters} iterations",
            size::format(n * 4),
            n
        );

        // The roofline: one kernel copying the bucket (read n, write n).
        let copy_src = DeviceBuffer::<R, f32>::filled(&client, n, 1.0);
        let copy = time(
            iters,
            || copy(&client, &copy_src, &bucket).expect("copy"),
            &sync,
        );
        let copy_gbps = (2 * n * 4) as f64 / copy / 1e9;
        println!(
            "  {:<30} {:>11.1} {:>11} {:>8} {:>10.3} {:>9.3}",
            "device copy (roofline)",
            copy * 1e6,
            "-",
            "-",
            copy_gbps,
            1.0
        );

        let scale = 0.5f32;
        let other = DeviceBuffer::<R, f32>::filled(&client, n, 0.25);
        let out = DeviceBuffer::<R, f32>::filled(&client, n, 0.0);
        let fused = time(
            iters,
            || reduce(&client, &[&bucket, &other], &out, 0.5).expect("reduce"),
            &sync,
        );
        let (ta, tb) = (
            Tensor::<Burn<R>, 1>::from_data(TensorData::new(vec![0.5f32; n], [n]), &device),
            Tensor::<Burn<R>, 1>::from_data(TensorData::new(vec![0.25f32; n], [n]), &device),
        );
        let burn = time(
            iters,
            || {
                let _ = ta.clone().add(tb.clone()).mul_scalar(0.5);
            },
            &sync,
        );
        print_row(
            &Row {
                what: "reduce 2 buckets, mean".into(),
                fused,
                burn,
                bytes_moved: 3 * n * 4,
            },
            copy_gbps,
        );

        // Burn's op chains do the same work whatever the kernels' launch shape: timed once per
        // size, before the settings, so that their large temporary buffers are not allocated
        // between the fused kernels' rows.
        let burn_pack = time(
            iters,
            || {
                let _ = Tensor::cat(burn_grads.clone(), 0).mul_scalar(scale);
            },
            &sync,
        );
        let burn_pack16 = half_ok.then(|| {
            time(
                iters,
                || {
                    let _ = Tensor::cat(burn_grads.clone(), 0)
                        .mul_scalar(scale)
                        .cast(FloatDType::F16);
                },
                &sync,
            )
        });
        let mut starts = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &l in &lens {
            starts.push(at..at + l);
            at += l;
        }
        let burn_unpack = time(
            iters,
            || {
                for r in &starts {
                    let _ = ta.clone().slice([r.clone()]).mul_scalar(0.5);
                }
            },
            &sync,
        );
        let bucket16 = half_ok.then(|| DeviceBuffer::<R, f16>::filled(&client, n, f16::ZERO));
        let outs = upload_all(&client, &host);
        let out_refs: Vec<&DeviceBuffer<R, f32>> = outs.iter().collect();

        for &per_unit in &settings {
            bonfire_kernels::set_vectors_per_unit(per_unit);
            let tag = match bonfire_kernels::vectors_per_unit() {
                0 => " [auto]".to_string(),
                n => format!(" [x{n}]"),
            };
            let fused = time(
                iters,
                || pack(&client, &grad_refs, &bucket, scale).expect("pack"),
                &sync,
            );
            let row = |what: &str, fused, burn, bytes_moved| {
                print_row(
                    &Row {
                        what: format!("{what}{tag}"),
                        fused,
                        burn,
                        bytes_moved,
                    },
                    copy_gbps,
                )
            };
            row("pack + scale (f32)", fused, burn_pack, 2 * n * 4);
            if let (Some(burn), Some(bucket16)) = (burn_pack16, &bucket16) {
                let fused = time(
                    iters,
                    || pack(&client, &grad_refs, bucket16, scale).expect("pack"),
                    &sync,
                );
                row("pack + scale + cast f16", fused, burn, n * 4 + n * 2);
            }
            let fused = time(
                iters,
                || unpack(&client, &bucket, &out_refs, 0.5).expect("unpack"),
                &sync,
            );
            row("unpack + scale", fused, burn_unpack, 2 * n * 4);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!(
        "# fused: one bonfire-kernels launch per operation ([xN]: N vectors per unit; [auto]: chosen per launch); burn: the same result with Burn tensor ops (cat + mul, + cast; add + mul; slice + mul per buffer)."
    );
    println!(
        "# GB/s: bytes read plus bytes written by the fused kernel per second; vs copy: that over the copy kernel's rate (the roofline), same run."
    );
    Ok(())
}
