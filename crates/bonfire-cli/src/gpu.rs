//! Opening a GPU: CubeCL's runtimes panic when there is no driver or no device; the commands
//! turn that into an error that says what is missing.

use bonfire_kernels::cubecl::Runtime;
use bonfire_kernels::cubecl::prelude::ComputeClient;

/// Opens `device`'s client of runtime `R` (`what` names it in messages: "wgpu", "CUDA"), or says
/// why it cannot be opened and what to do (`hint`).
pub(crate) fn open<R: Runtime>(
    device: &R::Device,
    what: &str,
    hint: &str,
) -> Result<ComputeClient<R>, String> {
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
        format!("cannot open the {what} device ({why}); {hint}")
    })
}

/// What to do when wgpu finds no adapter.
pub(crate) const WGPU_HINT: &str = "install a Vulkan driver (`apt-get install -y \
     mesa-vulkan-drivers libvulkan1` gives a software one) or choose another backend";

/// What to do when CUDA cannot start.
#[cfg(feature = "cuda")]
pub(crate) const CUDA_HINT: &str = "this needs an NVIDIA GPU with its driver, and NVRTC from the \
     CUDA toolkit on the library path; or choose another backend";
