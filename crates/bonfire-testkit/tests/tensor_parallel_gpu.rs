//! `TensorParallel` over wgpu (Mesa's software Vulkan in CI; CUDA with the `cuda` feature on a
//! machine with an NVIDIA GPU): the Megatron MLP split over 2 ranks (threads of this process,
//! sharing the device) gives the loss and gradients of the unsharded model, within 1e-5.

use std::time::Duration;

use bonfire::backend::tensor_parallel::bind_thread;
use bonfire::backend::{DataParallelConfig, FailurePolicy};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire_testkit::nets::{max_abs_diff, seeded};
use bonfire_testkit::run_ranks;
use bonfire_testkit::tp::{TpMlp, TpNet, loss_and_grads};
use burn::backend::Autodiff;

fn comm_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(300),
        ..CommConfig::default()
    }
}

/// The check for one GPU backend `$g` and device `$device`.
macro_rules! check {
    ($name:expr, $g:ty, $device:expr) => {{
        type Dp = Autodiff<bonfire::DataParallel<$g>>;
        type Tp = Autodiff<bonfire::TensorParallel<$g>>;
        let device = $device;
        let (want_loss, want) = {
            let _bind = bonfire::backend::bind_thread(
                Communicator::in_process(1, comm_config()).remove(0),
                DataParallelConfig {
                    failure: FailurePolicy::Panic,
                    ..DataParallelConfig::default()
                },
            );
            let model = seeded::<Dp, _>(1, &device, TpMlp::new);
            loss_and_grads(&model, &TpMlp::<Dp>::batch(7), &device)
        };
        let got = run_ranks(
            Communicator::in_process(2, comm_config()),
            Duration::from_secs(600),
            move |comm| {
                let model = seeded::<Tp, _>(1, &device, TpMlp::new);
                let _group = bind_thread(comm.clone()).expect("bind");
                let model =
                    bonfire::tensor_parallel(model, &TpMlp::<Tp>::plan(), &comm).expect("plan");
                loss_and_grads(&model, &TpMlp::<Tp>::batch(7), &device)
            },
        );
        for (rank, (loss, grads)) in got.into_iter().enumerate() {
            assert!(
                (loss - want_loss).abs() <= 1e-5,
                "{} rank {rank}: loss {loss} vs {want_loss}",
                $name
            );
            let d = max_abs_diff(&grads, &want);
            assert!(d <= 1e-5, "{} rank {rank}: gradients differ by {d}", $name);
        }
    }};
}

#[test]
fn megatron_mlp_on_wgpu_matches_one_device() {
    check!(
        "wgpu",
        burn::backend::Wgpu,
        burn::backend::wgpu::WgpuDevice::default()
    );
}

#[cfg(feature = "cuda")]
#[test]
fn megatron_mlp_on_cuda_matches_one_device() {
    check!(
        "cuda",
        burn::backend::Cuda,
        burn::backend::cuda::CudaDevice::default()
    );
}
