//! What accelerators this machine has, asked without starting a backend: CUDA devices through
//! the driver library (loaded at run time, as CubeCL's CUDA runtime loads it) and Vulkan adapters
//! through wgpu. `bonfire doctor` lists them; [`crate::BackendKind::Auto`] chooses by them.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

/// Every Vulkan adapter wgpu finds (Mesa's software one included, as a `Cpu` device type);
/// `None` when the list did not come back at once.
pub fn vulkan_adapters() -> Option<Vec<wgpu::AdapterInfo>> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    ready(instance.enumerate_adapters(wgpu::Backends::VULKAN))
        .map(|adapters| adapters.iter().map(|a| a.get_info()).collect())
}

/// Whether this (Linux) machine has a device node a GPU driver serves: a DRM render node
/// (`/dev/dri/renderD*`) or NVIDIA's `/dev/nvidiactl`. Without one no Vulkan adapter can be a GPU,
/// and [`vulkan_adapters`] need not start the Vulkan loader (whose software driver complains on
/// standard error when XDG_RUNTIME_DIR is unset).
pub fn gpu_device_nodes() -> bool {
    let render = std::fs::read_dir("/dev/dri").is_ok_and(|dir| {
        dir.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("renderD"))
    });
    render || std::path::Path::new("/dev/nvidiactl").exists()
}

/// Whether `adapter` is a GPU (not a software rasteriser on the CPU).
pub fn is_gpu(adapter: &wgpu::AdapterInfo) -> bool {
    matches!(
        adapter.device_type,
        wgpu::DeviceType::DiscreteGpu
            | wgpu::DeviceType::IntegratedGpu
            | wgpu::DeviceType::VirtualGpu
    )
}

/// The future's value if it is ready on the first poll (native wgpu answers at once).
pub(crate) fn ready<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

/// The driver's version and each device's name and memory, through the driver library itself
/// (loaded at run time, as CubeCL's CUDA runtime loads it).
pub fn cuda_devices() -> Result<(i32, Vec<String>), String> {
    type Init = unsafe extern "C" fn(u32) -> c_int;
    type Count = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Version = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Name = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    type Mem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
    let lib = CString::new("libcuda.so.1").expect("no NUL");
    // SAFETY: dlopen with a valid C string; the handle is checked and closed below.
    let handle = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err("libcuda.so.1 is not installed".into());
    }
    let sym = |name: &str| -> Result<*mut c_void, String> {
        let c = CString::new(name).expect("no NUL");
        // SAFETY: a valid handle and C string.
        let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
        if p.is_null() {
            Err(format!("libcuda.so.1 has no {name}"))
        } else {
            Ok(p)
        }
    };
    let result = (|| {
        // SAFETY: each symbol is the driver API function of that name, whose C signature the
        // type above spells; every out-pointer is valid for the call.
        unsafe {
            let init: Init = std::mem::transmute(sym("cuInit")?);
            let count: Count = std::mem::transmute(sym("cuDeviceGetCount")?);
            let version: Version = std::mem::transmute(sym("cuDriverGetVersion")?);
            let name: Name = std::mem::transmute(sym("cuDeviceGetName")?);
            let mem: Mem = std::mem::transmute(sym("cuDeviceTotalMem_v2")?);
            let rc = init(0);
            if rc != 0 {
                return Err(format!("cuInit failed with CUDA error {rc}"));
            }
            let mut v = 0;
            version(&mut v);
            let mut n = 0;
            let rc = count(&mut n);
            if rc != 0 {
                return Err(format!("cuDeviceGetCount failed with CUDA error {rc}"));
            }
            let mut devices = Vec::new();
            for d in 0..n {
                let mut buf = [0 as c_char; 128];
                name(buf.as_mut_ptr(), buf.len() as c_int, d);
                let mut bytes = 0usize;
                mem(&mut bytes, d);
                let label = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
                devices.push(format!(
                    "{d}: {label} ({:.0} GiB)",
                    bytes as f64 / (1u64 << 30) as f64
                ));
            }
            Ok((v, devices))
        }
    })();
    // SAFETY: the handle came from dlopen and nothing from it is used after this.
    unsafe { libc::dlclose(handle) };
    result
}
