//! The backends a job trains on ([`BackendKind`]), opening a GPU with a message instead of a
//! panic ([`open_gpu`]), and running a job's rank on the chosen one.

use std::fmt;
use std::str::FromStr;

use bonfire::kernels::cubecl::Runtime;
use bonfire::kernels::cubecl::prelude::ComputeClient;
use serde::{Deserialize, Serialize};

use crate::JobError;
use crate::job::{Job, JobState};
use crate::rank::RankContext;
use crate::report::Say;

/// The Burn backend a job trains on (inside bonfire's data-parallel decorator).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The fastest backend for the device this machine has ([`BackendKind::resolve`]): CUDA in a
    /// build with it and a CUDA device, else wgpu on a GPU, else [`BackendKind::FASTEST_CPU`].
    #[default]
    Auto,
    /// Burn's Flex CPU backend.
    Flex,
    /// Burn's ndarray CPU backend.
    Ndarray,
    /// LibTorch (PyTorch's C++ library, on the CPU) through burn-tch, in a build with the
    /// `libtorch` feature.
    Libtorch,
    /// wgpu: any GPU with a Vulkan, Metal or DX12 driver (or Mesa's software Vulkan).
    Wgpu,
    /// CUDA, in a build with the `cuda` feature; local rank `i` uses GPU `i % GPUs`.
    Cuda,
}

impl BackendKind {
    /// Every backend, in the order messages list them.
    pub const ALL: [BackendKind; 6] = [
        BackendKind::Auto,
        BackendKind::Flex,
        BackendKind::Ndarray,
        BackendKind::Libtorch,
        BackendKind::Wgpu,
        BackendKind::Cuda,
    ];

    /// Every backend's name, in the order of [`BackendKind::ALL`]: `auto, flex, ...`.
    pub fn names() -> String {
        BackendKind::ALL.map(BackendKind::name).join(", ")
    }

    /// The CPU backend that trained both bundled jobs fastest on this project's CPU machine
    /// (BENCHMARKS.md, "Which Burn backend on a CPU"): LibTorch in a build with it, else Flex.
    pub const FASTEST_CPU: BackendKind = if cfg!(feature = "libtorch") {
        BackendKind::Libtorch
    } else {
        BackendKind::Flex
    };

    /// A concrete backend: this one, or for [`BackendKind::Auto`] the one for the device found
    /// (asked without starting a backend, see [`crate::devices`]).
    pub fn resolve(self) -> BackendKind {
        if self != BackendKind::Auto {
            return self;
        }
        let cuda = cfg!(feature = "cuda")
            && crate::devices::cuda_devices().is_ok_and(|(_, devices)| !devices.is_empty());
        let gpu = || {
            crate::devices::gpu_device_nodes()
                && crate::devices::vulkan_adapters()
                    .is_some_and(|adapters| adapters.iter().any(crate::devices::is_gpu))
        };
        BackendKind::pick(cuda, cuda || gpu())
    }

    /// [`resolve`](Self::resolve)'s choice for a machine with (or without) a usable CUDA
    /// device and a GPU that wgpu can drive.
    pub fn pick(cuda: bool, gpu: bool) -> BackendKind {
        match (cuda, gpu) {
            (true, _) => BackendKind::Cuda,
            (false, true) => BackendKind::Wgpu,
            (false, false) => BackendKind::FASTEST_CPU,
        }
    }

    /// Its name on the command line: `auto`, `flex`, `ndarray`, `libtorch`, `wgpu`, `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Flex => "flex",
            BackendKind::Ndarray => "ndarray",
            BackendKind::Libtorch => "libtorch",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendKind {
    type Err = JobError;

    /// A backend by its name, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let given = s.to_ascii_lowercase();
        BackendKind::ALL
            .into_iter()
            .find(|b| b.name() == given)
            .ok_or(JobError::UnknownBackend { given })
    }
}

/// What to do when wgpu finds no adapter.
pub const WGPU_HINT: &str = "install a Vulkan driver (`apt-get install -y \
     mesa-vulkan-drivers libvulkan1` gives a software one) or choose another backend";

/// What to do when CUDA cannot start.
pub const CUDA_HINT: &str = "this needs an NVIDIA GPU with its driver, and NVRTC from the \
     CUDA toolkit on the library path; or choose another backend";

/// Opens `device`'s client of runtime `R` (`what` names it in messages: "wgpu", "CUDA"), or
/// says why it cannot be opened and what to do (`hint`). CubeCL's runtimes panic when there is
/// no driver or no device; this turns that into [`JobError::Gpu`].
pub fn open_gpu<R: Runtime>(
    device: &R::Device,
    what: &str,
    hint: &'static str,
) -> Result<ComputeClient<R>, JobError> {
    // The runtime may panic on a thread of its own (the device's server) and then again on
    // this one when that thread is gone: the first message is the cause.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let hook = std::panic::take_hook();
    let record = seen.clone();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("the runtime gave no reason");
        if let Ok(mut seen) = record.lock() {
            seen.push(message.lines().next().unwrap_or_default().to_string());
        }
    }));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| R::client(device)));
    std::panic::set_hook(hook);
    result.map_err(|_| {
        let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
        let why = seen
            .first()
            .map(String::as_str)
            .unwrap_or("the runtime gave no reason");
        JobError::Gpu {
            device: what.to_string(),
            why: why.to_string(),
            hint,
        }
    })
}

/// Runs `job` as this rank on the backend the settings name.
pub(crate) fn train_on_backend<J: Job>(
    job: &J,
    ctx: &mut RankContext<'_, J>,
) -> Result<(JobState<J>, J::Report), JobError> {
    match ctx.settings().backend.resolve() {
        BackendKind::Auto => unreachable!("resolve gives a concrete backend"),
        BackendKind::Flex => job.train::<burn::backend::Flex>(ctx, burn::backend::flex::FlexDevice),
        BackendKind::Ndarray => job.train::<burn::backend::NdArray>(ctx, Default::default()),
        BackendKind::Libtorch => libtorch(job, ctx),
        BackendKind::Wgpu => {
            use bonfire::kernels::cubecl::wgpu::{WgpuDevice, WgpuRuntime};
            let device = WgpuDevice::default();
            gpu_kernel_caches(ctx);
            open_gpu::<WgpuRuntime>(&device, "wgpu", WGPU_HINT)?;
            job.train::<burn::backend::Wgpu>(ctx, device)
        }
        BackendKind::Cuda => cuda(job, ctx),
    }
}

/// Keeps CubeCL's compiled kernels and autotune verdicts in bonfire's kernel cache
/// ([`crate::kernel_cache`]); in a build with Burn's autotune (the `fusion` feature), rank 0 says
/// when that cache holds no verdicts yet, since the first steps then tune every new shape.
fn gpu_kernel_caches<J: Job>(ctx: &mut RankContext<'_, J>) {
    let caches = crate::kernel_cache::place_kernel_caches();
    if let crate::kernel_cache::KernelCaches::In(dir) = &caches
        && cfg!(feature = "fusion")
        && caches.no_verdicts_yet()
    {
        let dir = dir.display();
        ctx.say(
            Say::Notice,
            &format!(
                "no autotune verdicts in {dir} yet: this build (Burn's fusion and autotune) \
                 times the candidate kernels of each new matmul and convolution shape before \
                 its first use, which takes minutes in a job's first run on a machine; later \
                 runs read the verdicts and compiled kernels kept there"
            ),
        );
    }
}

/// Local rank `i` trains on CUDA device `i` of its node; with fewer devices than ranks, ranks
/// share them round-robin (`i % devices`), as several ranks on one GPU do for testing.
#[cfg(feature = "cuda")]
fn cuda<J: Job>(
    job: &J,
    ctx: &mut RankContext<'_, J>,
) -> Result<(JobState<J>, J::Report), JobError> {
    use bonfire::kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
    gpu_kernel_caches(ctx);
    let devices = open_gpu::<CudaRuntime>(&CudaDevice::new(0), "CUDA", CUDA_HINT)?
        .device_count_total()
        .max(1);
    let device = CudaDevice::new(ctx.world().local_rank() % devices);
    job.train::<burn::backend::Cuda>(ctx, device)
}

#[cfg(not(feature = "cuda"))]
fn cuda<J: Job>(_: &J, _: &mut RankContext<'_, J>) -> Result<(JobState<J>, J::Report), JobError> {
    Err(JobError::NoCuda)
}

/// LibTorch on the CPU; its compute threads follow OMP_NUM_THREADS, which the runner sets per
/// rank as it sets RAYON_NUM_THREADS.
#[cfg(feature = "libtorch")]
fn libtorch<J: Job>(
    job: &J,
    ctx: &mut RankContext<'_, J>,
) -> Result<(JobState<J>, J::Report), JobError> {
    job.train::<burn::backend::LibTorch>(ctx, burn::backend::libtorch::LibTorchDevice::Cpu)
}

#[cfg(not(feature = "libtorch"))]
fn libtorch<J: Job>(
    _: &J,
    _: &mut RankContext<'_, J>,
) -> Result<(JobState<J>, J::Report), JobError> {
    Err(JobError::NoLibtorch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_cuda_then_a_gpu_then_the_fastest_cpu_backend() {
        assert_eq!(BackendKind::pick(true, true), BackendKind::Cuda);
        assert_eq!(BackendKind::pick(false, true), BackendKind::Wgpu);
        assert_eq!(BackendKind::pick(false, false), BackendKind::FASTEST_CPU);
        assert!(matches!(
            BackendKind::FASTEST_CPU,
            BackendKind::Flex | BackendKind::Libtorch
        ));
    }

    #[test]
    fn backends_by_name() {
        assert_eq!("WGPU".parse::<BackendKind>().unwrap(), BackendKind::Wgpu);
        assert_eq!(
            "tpu".parse::<BackendKind>().unwrap_err().to_string(),
            "--backend \"tpu\": expected one of auto, flex, ndarray, libtorch, wgpu, cuda"
        );
        assert_eq!(BackendKind::default(), BackendKind::Auto);
        assert_ne!(BackendKind::Auto.resolve(), BackendKind::Auto);
        assert_eq!(BackendKind::Ndarray.resolve(), BackendKind::Ndarray);
        assert_eq!(
            serde_json::to_string(&BackendKind::Ndarray).unwrap(),
            "\"ndarray\""
        );
    }
}
