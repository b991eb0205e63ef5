//! The device lane (CUDA): collectives between the processes of one node that never leave device
//! memory.
//!
//! Each rank allocates one *window* in device memory (`cuMemAlloc`, so that CUDA IPC can export
//! it), sends its IPC handle to the other ranks over the job's authenticated link, and maps
//! theirs once. A collective is then one kernel per rank: the rank that owns a chunk reads that
//! chunk from every window, sums in f32 in rank order, scales, rounds to the element type and
//! writes the result into every window that needs it (all of them for an all-reduce, its own
//! for a reduce-scatter). Nothing is staged through the host and no peer's chunk is copied
//! before it is reduced: the kernel reads the peers' memory where it lies, through NVLink or
//! PCIe peer access between GPUs, or directly when the ranks share one GPU. When every window
//! is on one device, rank 0's kernel reduces every chunk and the others launch nothing: their
//! processes take turns on the GPU, and one kernel per collective saves the switches between
//! them (on an H200, 23 us per small all-reduce instead of 230).
//!
//! Ordering between ranks is two host barriers on the link per collective (inputs written; all
//! chunks written). The ranks wait on the host, not in a kernel: two processes on one GPU
//! without MPS take turns on it, so a kernel spinning on a peer's flag would hold the GPU until
//! its time slice ended while the peer it waits for could not run. The barriers carry the
//! link's timeouts, so a dead rank is named by the link's error, never waited on forever.
//!
//! Across nodes, [`DeviceLane::all_reduce_across`] runs the hierarchical schedule: the node's
//! ranks reduce-scatter on the device, each rank's share crosses nodes over a [`CrossLink`] (the
//! job's communicator split by local index, in bonfire), and the node all-gathers the result.
//!
//! The reduction kernel is CUDA C compiled at run time with NVRTC (the compiler CubeCL uses),
//! not a CubeCL kernel: CubeCL 0.10 binds only memory it allocated itself, and a peer's mapped
//! window is not such memory. [`reference`] computes the same results on the host, in the same
//! order of operations, so the tests compare bit for bit.

use std::ffi::{CString, c_void};
use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::GradElement;

/// The most ranks one lane joins (the kernel takes the windows' addresses by value).
pub const MAX_RANKS: usize = 16;

/// The link a lane's ranks set up and order their collectives over: the job's authenticated
/// communicator in bonfire, any all-gather and barrier in a test.
pub trait NodeLink {
    /// This rank's index in the link, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks on the link.
    fn size(&self) -> usize;
    /// Every rank's `mine`, in rank order. The error says which rank failed, if one did.
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String>;
    /// Returns once every rank has called it. The error says which rank failed, if one did.
    fn barrier(&self) -> Result<(), String>;
}

/// The second level of [`DeviceLane::all_reduce_across`]: this rank and the ranks of the other
/// nodes that hold the same local index (the job's communicator split by local index in bonfire,
/// any sum in a test).
pub trait CrossLink {
    /// Number of nodes, this one included.
    fn nodes(&self) -> usize;
    /// Starts summing `chunk` with the same chunk of every other node's rank; the call returned
    /// waits for the sum (the same bits on every node). The error names the failed rank.
    #[allow(clippy::type_complexity)]
    fn start_sum(&self, chunk: Vec<f32>) -> Box<dyn FnOnce() -> Result<Vec<f32>, String> + '_>;
}

/// Elements per chunk of a share crossing nodes in [`DeviceLane::all_reduce_across`] (4 MiB of
/// f32): a chunk's transfer overlaps the next one's read from the device.
pub const CROSS_CHUNK: usize = 1 << 20;

/// What went wrong in the device lane.
#[derive(Debug, thiserror::Error)]
pub enum LaneError {
    /// A CUDA driver or NVRTC call failed.
    #[error("device lane: {call} failed: {detail}")]
    Cuda {
        /// The call.
        call: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// The link failed during a collective or the setup.
    #[error("device lane: {collective} of {bytes} bytes on rank {rank} of {size}: {detail}")]
    Link {
        /// The collective or setup step.
        collective: &'static str,
        /// The bytes each rank contributed.
        bytes: usize,
        /// This rank.
        rank: usize,
        /// The link's size.
        size: usize,
        /// The link's error (it names the failed rank).
        detail: String,
    },
    /// The ranks disagree on the lane's set-up.
    #[error("device lane: rank {rank} {detail}")]
    Mismatch {
        /// The rank that differs.
        rank: usize,
        /// What differs.
        detail: String,
    },
    /// A collective asked for more than the window holds.
    #[error(
        "device lane: {collective} needs {needed} bytes of window, the lane holds {capacity} per rank"
    )]
    Capacity {
        /// The collective.
        collective: &'static str,
        /// Bytes it needs.
        needed: usize,
        /// Bytes per window.
        capacity: usize,
    },
    /// The lane cannot join this many ranks.
    #[error("device lane: {size} ranks, at most {MAX_RANKS} share one lane")]
    TooManyRanks {
        /// The link's size.
        size: usize,
    },
}

fn cuda<T>(call: &'static str, r: Result<T, result::DriverError>) -> Result<T, LaneError> {
    r.map_err(|e| LaneError::Cuda {
        call,
        detail: format!("{e:?}"),
    })
}

/// The number of CUDA devices this process can use, or why none: the driver library is loaded
/// at run time, so a machine without one says so here instead of failing later.
pub fn devices() -> Result<usize, String> {
    let probe = std::panic::catch_unwind(|| {
        result::init()?;
        result::device::get_count()
    });
    match probe {
        Ok(Ok(n)) if n > 0 => Ok(n as usize),
        Ok(Ok(_)) => Err("the CUDA driver reports no device".into()),
        Ok(Err(e)) => Err(format!("the CUDA driver did not start: {e:?}")),
        Err(_) => Err("no CUDA driver library (libcuda) could be loaded".into()),
    }
}

/// How a reducing collective combines the ranks' values.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LaneOp {
    /// The sum.
    Sum,
    /// The sum times 1/n (one f32 multiply after the sum).
    Mean,
}

impl LaneOp {
    fn scale(self, n: usize) -> f32 {
        match self {
            LaneOp::Sum => 1.0,
            LaneOp::Mean => 1.0 / n as f32,
        }
    }
}

/// The CUDA C of the lane's kernels: one per element type, each a grid-stride loop over the
/// owner's range that moves 16 bytes per load and store where the range allows.
const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef unsigned short u16;
struct Ptrs { u64 p[16]; };

__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float b2f(u16 b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ u16 f2b(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// Each element type: its storage type, and its value from and to raw bits.
struct F32 { typedef float T;
    static __device__ __forceinline__ float load(unsigned x) { return __uint_as_float(x); }
    static __device__ __forceinline__ unsigned store(float x) { return __float_as_uint(x); } };
struct F16 { typedef u16 T;
    static __device__ __forceinline__ float load(unsigned x) { return h2f((u16)x); }
    static __device__ __forceinline__ unsigned store(float x) { return f2h(x); } };
struct BF16 { typedef u16 T;
    static __device__ __forceinline__ float load(unsigned x) { return b2f((u16)x); }
    static __device__ __forceinline__ unsigned store(float x) { return f2b(x); } };

__device__ __forceinline__ unsigned word(const uint4& w, int i) {
    return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}
__device__ __forceinline__ void set_word(uint4& w, int i, unsigned v) {
    if (i == 0) w.x = v; else if (i == 1) w.y = v; else if (i == 2) w.z = v; else w.w = v;
}
// Element j of a 16-byte word (in registers: no address is taken).
template <class E> __device__ __forceinline__ float get(const uint4& w, int j) {
    if (sizeof(typename E::T) == 4) return E::load(word(w, j));
    unsigned x = word(w, j >> 1);
    return E::load((j & 1) ? (x >> 16) : (x & 0xffffu));
}
template <class E> __device__ __forceinline__ void put(uint4& w, int j, float v) {
    unsigned b = E::store(v);
    if (sizeof(typename E::T) == 4) { set_word(w, j, b); return; }
    unsigned x = word(w, j >> 1);
    set_word(w, j >> 1, (j & 1) ? ((x & 0xffffu) | (b << 16)) : ((x & 0xffff0000u) | b));
}

template <class E> __device__ __forceinline__ float load1(u64 base, u64 i) {
    if (sizeof(typename E::T) == 4) return E::load(((const unsigned*)base)[i]);
    return E::load(((const u16*)base)[i]);
}
template <class E> __device__ __forceinline__ void store1(u64 base, u64 i, float v) {
    if (sizeof(typename E::T) == 4) ((unsigned*)base)[i] = E::store(v);
    else ((u16*)base)[i] = (u16)E::store(v);
}

// The loops over ranks are unrolled to the most a lane has (16), so every window's address is
// read from the kernel's parameters, not from a copy in local memory.

// One element: the sum over the sources in rank order, times the scale, to every destination.
template <class E>
__device__ __forceinline__ void one(const Ptrs& src, int nsrc, const Ptrs& dst, int ndst, u64 i, float scale) {
    float acc = load1<E>(src.p[0], i);
    #pragma unroll
    for (int k = 1; k < 16; ++k) if (k < nsrc) acc += load1<E>(src.p[k], i);
    const float out = acc * scale;
    #pragma unroll
    for (int k = 0; k < 16; ++k) if (k < ndst) store1<E>(dst.p[k], i, out);
}

template <class E>
__device__ __forceinline__ void run(const Ptrs& src, int nsrc, const Ptrs& dst, int ndst, u64 lo, u64 hi, float scale) {
    const int V = 16 / sizeof(typename E::T);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 a = (lo + V - 1) / V * V; if (a > hi) a = hi;
    u64 b = hi / V * V; if (b < a) b = a;
    for (u64 i = lo + tid; i < a; i += stride) one<E>(src, nsrc, dst, ndst, i, scale);
    for (u64 i = b + tid; i < hi; i += stride) one<E>(src, nsrc, dst, ndst, i, scale);
    for (u64 v = a / V + tid; v < b / V; v += stride) {
        float acc[V];
        const uint4 w = ((const uint4*)src.p[0])[v];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = get<E>(w, j);
        #pragma unroll
        for (int k = 1; k < 16; ++k) {
            if (k >= nsrc) break;
            const uint4 x = ((const uint4*)src.p[k])[v];
            #pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += get<E>(x, j);
        }
        uint4 o = make_uint4(0u, 0u, 0u, 0u);
        #pragma unroll
        for (int j = 0; j < V; ++j) put<E>(o, j, acc[j] * scale);
        #pragma unroll
        for (int k = 0; k < 16; ++k) if (k < ndst) ((uint4*)dst.p[k])[v] = o;
    }
}

extern "C" __global__ void bonfire_lane_f32(Ptrs src, int nsrc, Ptrs dst, int ndst, u64 lo, u64 hi, float scale) { run<F32>(src, nsrc, dst, ndst, lo, hi, scale); }
extern "C" __global__ void bonfire_lane_f16(Ptrs src, int nsrc, Ptrs dst, int ndst, u64 lo, u64 hi, float scale) { run<F16>(src, nsrc, dst, ndst, lo, hi, scale); }
extern "C" __global__ void bonfire_lane_bf16(Ptrs src, int nsrc, Ptrs dst, int ndst, u64 lo, u64 hi, float scale) { run<BF16>(src, nsrc, dst, ndst, lo, hi, scale); }
"#;

/// The kernels' PTX, compiled once per process. `--fmad=false`: the sum and the scale round as
/// the host reference does.
fn ptx() -> Result<&'static CString, LaneError> {
    static PTX: OnceLock<Result<CString, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        let opts = cudarc::nvrtc::CompileOptions {
            fmad: Some(false),
            ..Default::default()
        };
        let ptx =
            cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| format!("{e:?}"))?;
        CString::new(ptx.to_src()).map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|detail| LaneError::Cuda {
        call: "NVRTC compile of the lane's kernels",
        detail: detail.clone(),
    })
}

/// Which of the three kernels reduces `T`.
fn kernel_of<T: GradElement>() -> usize {
    use std::any::TypeId;
    let t = TypeId::of::<T>();
    if t == TypeId::of::<f32>() {
        0
    } else if t == TypeId::of::<half::f16>() {
        1
    } else {
        2
    }
}

#[repr(C)]
#[derive(Copy, Clone)]
struct Ptrs([u64; MAX_RANKS]);

impl Ptrs {
    fn of(ptrs: &[sys::CUdeviceptr]) -> Ptrs {
        let mut p = [0u64; MAX_RANKS];
        p[..ptrs.len()].copy_from_slice(ptrs);
        Ptrs(p)
    }
}

/// A lane that was not set up: why, and the link, to go on without the lane. Every rank of the
/// link gets the same verdict.
pub struct Declined<L> {
    /// The link the lane was to use.
    pub link: L,
    /// Why the ranks went without the lane.
    pub error: LaneError,
}

impl<L> std::fmt::Debug for Declined<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.error, f)
    }
}

impl<L> std::fmt::Display for Declined<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

/// Checks every rank's set-up message: a window of rank 0's capacity, in the lane's format. The
/// same messages reach every rank, so every rank comes to the same verdict.
fn check_announces(all: &[Vec<u8>], capacity: usize) -> Result<(), LaneError> {
    let capacity_of = |msg: &[u8]| u64::from_le_bytes(msg[12..20].try_into().expect("8 bytes"));
    for (r, msg) in all.iter().enumerate() {
        if let Some(why) = msg.strip_prefix(FAILED) {
            return Err(LaneError::Mismatch {
                rank: r,
                detail: format!(
                    "could not set up its window: {}",
                    String::from_utf8_lossy(why)
                ),
            });
        }
        if msg.len() != ANNOUNCE || &msg[..8] != TAG {
            return Err(LaneError::Mismatch {
                rank: r,
                detail: format!(
                    "sent a {}-byte set-up message, not the lane's {ANNOUNCE} bytes",
                    msg.len()
                ),
            });
        }
    }
    let first = capacity_of(&all[0]);
    if let Some(r) = all.iter().position(|m| capacity_of(m) != first) {
        return Err(LaneError::Mismatch {
            rank: r,
            detail: format!(
                "has a window of {} bytes, rank 0 of {first} (this rank: {capacity}): every rank sets the lane up with the same capacity",
                capacity_of(&all[r])
            ),
        });
    }
    Ok(())
}

/// What each rank sends the others at set-up: a format tag, its process id, its window's size
/// and address, the window's IPC handle and its device's UUID; or `FAILED` and why it has no
/// window.
const TAG: &[u8; 8] = b"BFLANE02";
const FAILED: &[u8; 8] = b"BFLANE!!";
const ANNOUNCE: usize = 8 + 4 + 8 + 8 + 64 + 16;

impl<T: NodeLink + ?Sized> NodeLink for &T {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
        (**self).all_gather(mine)
    }
    fn barrier(&self) -> Result<(), String> {
        (**self).barrier()
    }
}

/// One rank's end of the device lane: its window, the peers' mapped windows, a stream and the
/// kernels. Dropping it unmaps the peers' windows and frees its own.
pub struct DeviceLane<L: NodeLink> {
    link: L,
    rank: usize,
    size: usize,
    capacity: usize,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    module: sys::CUmodule,
    kernels: [sys::CUfunction; 3],
    sms: u32,
    /// Every rank's window, this rank's own included, as addresses in this process.
    windows: Vec<sys::CUdeviceptr>,
    /// Which windows this rank mapped through IPC (and unmaps on drop).
    mapped: Vec<bool>,
    ipc_peers: usize,
    /// This rank's device's UUID.
    uuid: [u8; 16],
    /// Whether every rank's window is on one device: then rank 0's kernel reduces the whole
    /// buffer and the others launch nothing (two processes on one GPU take turns on it, so one
    /// kernel instead of one per rank saves a switch between them).
    one_device: bool,
}

// SAFETY: the lane's CUDA objects belong to the device's primary context, which any thread may
// make current; every method makes it current before it calls the driver.
unsafe impl<L: NodeLink + Send> Send for DeviceLane<L> {}

/// This rank's half of the set-up, before any peer is known.
fn prepare<L: NodeLink>(
    link: L,
    ordinal: usize,
    capacity: usize,
) -> Result<(DeviceLane<L>, sys::CUipcMemHandle), (L, LaneError)> {
    let (rank, size) = (link.rank(), link.size());
    let mut lane = DeviceLane {
        link,
        rank,
        size,
        capacity,
        ctx: std::ptr::null_mut(),
        stream: std::ptr::null_mut(),
        module: std::ptr::null_mut(),
        kernels: [std::ptr::null_mut(); 3],
        sms: 1,
        windows: vec![0; size],
        mapped: vec![false; size],
        ipc_peers: 0,
        uuid: [0; 16],
        one_device: false,
    };
    let handle = (|| -> Result<sys::CUipcMemHandle, LaneError> {
        cuda("cuInit", result::init())?;
        let device = cuda("cuDeviceGet", result::device::get(ordinal as i32))?;
        // SAFETY: `device` is valid; the primary context is CubeCL's too.
        lane.ctx = cuda("cuDevicePrimaryCtxRetain", unsafe {
            result::primary_ctx::retain(device)
        })?;
        lane.current()?;
        // SAFETY: a plain query of a valid device.
        let sms = unsafe {
            result::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        };
        lane.sms = cuda("cuDeviceGetAttribute", sms)?.max(1) as u32;
        let uuid = cuda("cuDeviceGetUuid", result::device::get_uuid(device))?;
        for (d, s) in lane.uuid.iter_mut().zip(uuid.bytes) {
            *d = s as u8;
        }
        lane.stream = cuda(
            "cuStreamCreate",
            result::stream::create(result::stream::StreamKind::NonBlocking),
        )?;
        // SAFETY: an allocation in the current context, zeroed, then exported.
        let own = cuda("cuMemAlloc", unsafe { result::malloc_sync(capacity) })?;
        lane.windows[rank] = own;
        // Zeroed on the lane's stream and waited for (the legacy stream's memset is not
        // ordered with the lane's non-blocking stream).
        // SAFETY: the allocation just made.
        unsafe {
            cuda(
                "cuMemsetD8Async",
                result::memset_d8_async(own, 0, capacity, lane.stream),
            )?;
            cuda(
                "cuStreamSynchronize",
                result::stream::synchronize(lane.stream),
            )?;
        }
        let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: `own` is the base of an allocation made by cuMemAlloc.
        cuda("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(handle.as_mut_ptr(), own).result()
        })?;
        let image = ptx()?;
        // SAFETY: a NUL-terminated PTX image.
        lane.module = cuda("cuModuleLoadData", unsafe {
            result::module::load_data(image.as_ptr().cast())
        })?;
        for (k, name) in ["bonfire_lane_f32", "bonfire_lane_f16", "bonfire_lane_bf16"]
            .iter()
            .enumerate()
        {
            let name = CString::new(*name).expect("no NUL");
            // SAFETY: the module was just loaded and holds these functions.
            lane.kernels[k] = cuda("cuModuleGetFunction", unsafe {
                result::module::get_function(lane.module, name)
            })?;
        }
        // SAFETY: initialised by the successful call above.
        Ok(unsafe { handle.assume_init() })
    })();
    match handle {
        Ok(h) => Ok((lane, h)),
        Err(e) => {
            let link = lane.release();
            Err((link, e))
        }
    }
}

impl<L: NodeLink> DeviceLane<L> {
    /// Sets up the lane on CUDA device `ordinal` with a window of `capacity` bytes per rank:
    /// allocates and exports this rank's window, exchanges the handles over `link`, and maps the
    /// peers' windows. Every rank of `link` calls it. The ranks agree on the outcome: where any
    /// rank cannot take part (no device, no IPC between the devices, another capacity), every
    /// rank gets an error naming that rank, and the link back to go on without the lane. Ranks
    /// of one process (threads, in tests) use each other's windows directly.
    pub fn new(link: L, ordinal: usize, capacity: usize) -> Result<Self, Declined<L>> {
        let (rank, size) = (link.rank(), link.size());
        if size > MAX_RANKS {
            return Err(Declined {
                link,
                error: LaneError::TooManyRanks { size },
            });
        }
        let capacity = capacity.max(16).next_multiple_of(256);
        let (prepared, mine) = match prepare(link, ordinal, capacity) {
            Ok((lane, handle)) => {
                let mut mine = Vec::with_capacity(ANNOUNCE);
                mine.extend_from_slice(TAG);
                mine.extend_from_slice(&std::process::id().to_le_bytes());
                mine.extend_from_slice(&(capacity as u64).to_le_bytes());
                mine.extend_from_slice(&lane.windows[rank].to_le_bytes());
                mine.extend(handle.reserved.iter().map(|&c| c as u8));
                mine.extend_from_slice(&lane.uuid);
                (Ok(lane), mine)
            }
            Err((link, e)) => {
                let mut mine = FAILED.to_vec();
                mine.extend_from_slice(e.to_string().as_bytes());
                (Err(link), mine)
            }
        };
        let link_error = |detail| LaneError::Link {
            collective: "set-up: the windows' handles",
            bytes: ANNOUNCE,
            rank,
            size,
            detail,
        };
        let gathered = match &prepared {
            Ok(lane) => lane.link.all_gather(mine),
            Err(link) => link.all_gather(mine),
        };
        let agreed = gathered
            .map_err(link_error)
            .and_then(|all| check_announces(&all, capacity).map(|()| all));
        let (mut l, all) = match (prepared, agreed) {
            (Ok(lane), Ok(all)) => (lane, all),
            (Ok(lane), Err(error)) => {
                return Err(Declined {
                    link: lane.release(),
                    error,
                });
            }
            (Err(_), Ok(_)) => unreachable!("a rank without a window fails the agreement"),
            (Err(link), Err(error)) => return Err(Declined { link, error }),
        };
        l.one_device = all.iter().all(|m| m[92..108] == l.uuid);
        // Map the peers' windows, then agree again: every rank mapped every window, or none
        // goes on.
        let mut failure = Vec::new();
        for (r, msg) in all.iter().enumerate() {
            if r == rank {
                continue;
            }
            let word = |at: usize| u64::from_le_bytes(msg[at..at + 8].try_into().expect("8 bytes"));
            let pid = u32::from_le_bytes(msg[8..12].try_into().expect("4 bytes"));
            if pid == std::process::id() {
                l.windows[r] = word(20);
                continue;
            }
            let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
            for (d, s) in h.reserved.iter_mut().zip(&msg[28..92]) {
                *d = *s as _;
            }
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: `h` is a handle another process exported; the driver validates it.
            let opened = unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
                .result()
            };
            match opened {
                Ok(()) => {
                    l.windows[r] = ptr;
                    l.mapped[r] = true;
                    l.ipc_peers += 1;
                }
                Err(e) => {
                    failure = format!(
                        "could not map rank {r}'s window ({e:?}): the device lane needs its ranks on one host, with CUDA IPC between their devices"
                    )
                    .into_bytes();
                    break;
                }
            }
        }
        let lane = l;
        match lane.link.all_gather(failure) {
            Err(detail) => Err(Declined {
                error: link_error(detail),
                link: lane.release(),
            }),
            Ok(all) => match all.iter().position(|f| !f.is_empty()) {
                Some(r) => {
                    let detail = String::from_utf8_lossy(&all[r]).into_owned();
                    Err(Declined {
                        error: LaneError::Mismatch { rank: r, detail },
                        link: lane.release(),
                    })
                }
                None => Ok(lane),
            },
        }
    }

    /// Frees what this rank set up and hands the link back.
    fn release(mut self) -> L {
        self.free();
        // SAFETY: `self` is forgotten below, so the link is read out exactly once and `Drop`
        // (which would free again) does not run.
        let link = unsafe { std::ptr::read(&self.link) };
        let windows = std::mem::take(&mut self.windows);
        let mapped = std::mem::take(&mut self.mapped);
        drop((windows, mapped));
        std::mem::forget(self);
        link
    }

    fn free(&mut self) {
        if self.ctx.is_null() {
            return;
        }
        // SAFETY: every object below was created in `prepare` or `new` and is released once,
        // here (null ones were never made); the windows mapped through IPC are unmapped before
        // this rank's own is freed.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            if !self.stream.is_null() {
                let _ = result::stream::synchronize(self.stream);
            }
            for (r, &ptr) in self.windows.iter().enumerate() {
                if self.mapped[r] {
                    let _ = sys::cuIpcCloseMemHandle(ptr);
                }
            }
            if !self.module.is_null() {
                let _ = result::module::unload(self.module);
            }
            if self.windows[self.rank] != 0 {
                let _ = result::free_sync(self.windows[self.rank]);
            }
            if !self.stream.is_null() {
                let _ = result::stream::destroy(self.stream);
            }
        }
        self.ctx = std::ptr::null_mut();
    }

    /// This rank's index on the lane.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks on the lane.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes per window: the largest buffer one collective can take.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many peers' windows this rank mapped through CUDA IPC (the others live in this
    /// process).
    pub fn ipc_peers(&self) -> usize {
        self.ipc_peers
    }

    /// This rank's window: the device address collectives read this rank's input from and
    /// write its result to.
    pub fn window(&self) -> sys::CUdeviceptr {
        self.windows[self.rank]
    }

    /// The lane's stream. Work that fills or drains the window on another stream must be
    /// complete before a collective starts.
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    fn current(&self) -> Result<(), LaneError> {
        // SAFETY: the context was retained in `new` and is released only on drop.
        cuda("cuCtxSetCurrent", unsafe {
            result::ctx::set_current(self.ctx)
        })
    }

    fn link_step<T>(
        &self,
        collective: &'static str,
        bytes: usize,
        f: impl FnOnce(&L) -> Result<T, String>,
    ) -> Result<T, LaneError> {
        f(&self.link).map_err(|detail| LaneError::Link {
            collective,
            bytes,
            rank: self.rank,
            size: self.size,
            detail,
        })
    }

    fn fits(&self, collective: &'static str, needed: usize) -> Result<(), LaneError> {
        if needed > self.capacity {
            return Err(LaneError::Capacity {
                collective,
                needed,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Writes `values` at the start of this rank's window (one host-to-device copy).
    pub fn write<T: GradElement>(&self, values: &[T]) -> Result<(), LaneError> {
        self.write_at(0, values)
    }

    /// Writes `values` into this rank's window from element `at` on (elements of `T`).
    pub fn write_at<T: GradElement>(&self, at: usize, values: &[T]) -> Result<(), LaneError> {
        let start = at * size_of::<T>();
        self.fits("write", start + std::mem::size_of_val(values))?;
        self.current()?;
        // On the lane's stream, and waited for: the synchronous `cuMemcpyHtoD` runs on the
        // legacy stream, which the lane's non-blocking stream does not wait for, and from
        // pageable memory it may return before the device has the bytes (the GPU tests caught a
        // collective reading a window the copy had not finished).
        // SAFETY: the window holds the range (checked above); `values` outlives the wait.
        unsafe {
            cuda(
                "cuMemcpyHtoDAsync",
                result::memcpy_htod_async(self.window() + start as u64, values, self.stream),
            )?;
            cuda(
                "cuStreamSynchronize",
                result::stream::synchronize(self.stream),
            )
        }
    }

    /// Reads the first `out.len()` elements of this rank's window.
    pub fn read<T: GradElement>(&self, out: &mut [T]) -> Result<(), LaneError> {
        self.read_at(0, out)
    }

    /// Reads `out.len()` elements of this rank's window from element `at` on.
    pub fn read_at<T: GradElement>(&self, at: usize, out: &mut [T]) -> Result<(), LaneError> {
        let start = at * size_of::<T>();
        self.fits("read", start + std::mem::size_of_val(out))?;
        self.current()?;
        // On the lane's stream, after whatever it was asked before, and waited for.
        // SAFETY: the window holds the range (checked above); `out` outlives the wait.
        unsafe {
            cuda(
                "cuMemcpyDtoHAsync",
                result::memcpy_dtoh_async(out, self.window() + start as u64, self.stream),
            )?;
            cuda(
                "cuStreamSynchronize",
                result::stream::synchronize(self.stream),
            )
        }
    }

    /// Zeroes the first `bytes` of this rank's window, on the lane's stream (ordered before the
    /// next copy or collective).
    pub fn zero(&self, bytes: usize) -> Result<(), LaneError> {
        self.fits("zero", bytes)?;
        self.current()?;
        // SAFETY: the window holds `bytes` (checked above).
        cuda("cuMemsetD8Async", unsafe {
            result::memset_d8_async(self.window(), 0, bytes, self.stream)
        })
    }

    /// Copies `bytes` from device address `src` (any allocation of this context: a CubeCL
    /// buffer's resource, say) into this rank's window at byte `at`, on the lane's stream.
    /// Collectives wait for it; [`DeviceLane::sync`] does too.
    ///
    /// # Safety
    /// `src` must hold `bytes` readable bytes of this device that no other stream writes until
    /// the lane's stream has passed the copy.
    pub unsafe fn copy_in(
        &self,
        at: usize,
        src: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<(), LaneError> {
        self.fits("copy into the window", at + bytes)?;
        self.current()?;
        // SAFETY: the caller vouches for `src`; the window holds the range (checked above).
        cuda("cuMemcpyDtoDAsync", unsafe {
            result::memcpy_dtod_async(self.window() + at as u64, src, bytes, self.stream)
        })
    }

    /// Copies `bytes` of this rank's window from byte `at` to device address `dst`, on the
    /// lane's stream. [`DeviceLane::sync`] waits for it.
    ///
    /// # Safety
    /// `dst` must hold `bytes` writable bytes of this device that no other stream touches until
    /// the lane's stream has passed the copy.
    pub unsafe fn copy_out(
        &self,
        at: usize,
        dst: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<(), LaneError> {
        self.fits("copy out of the window", at + bytes)?;
        self.current()?;
        // SAFETY: as for `copy_in`.
        cuda("cuMemcpyDtoDAsync", unsafe {
            result::memcpy_dtod_async(dst, self.window() + at as u64, bytes, self.stream)
        })
    }

    /// Waits until the lane's stream has done everything asked of it.
    pub fn sync(&self) -> Result<(), LaneError> {
        self.current()?;
        // SAFETY: the lane's own stream.
        cuda("cuStreamSynchronize", unsafe {
            result::stream::synchronize(self.stream)
        })
    }

    /// The range of elements rank `r` reduces in an all-reduce of `count`: equal shares,
    /// rounded to 64 elements so that each starts on a 16-byte boundary.
    pub fn share(&self, count: usize, r: usize) -> std::ops::Range<usize> {
        share(count, self.size, r)
    }

    /// Whether every rank's window is on one device (then rank 0 runs every collective's kernel).
    pub fn one_device(&self) -> bool {
        self.one_device
    }

    /// Makes each rank reduce its own share with its own kernel even on one device, as on
    /// several (for tests of that schedule on one GPU). Every rank must make the same call.
    pub fn split_kernels(&mut self) {
        self.one_device = false;
    }

    /// All-reduce in place over the first `count` elements of every rank's window: afterwards
    /// each window holds `op` of all of them, the same bits on every rank.
    pub fn all_reduce<T: GradElement>(&self, count: usize, op: LaneOp) -> Result<(), LaneError> {
        let bytes = count * size_of::<T>();
        self.fits("all-reduce", bytes)?;
        let all = &self.windows;
        let launches = if !self.one_device {
            vec![(all.clone(), all.clone(), self.share(count, self.rank))]
        } else if self.rank == 0 {
            vec![(all.clone(), all.clone(), 0..count)]
        } else {
            Vec::new()
        };
        self.collective::<T>("all-reduce", bytes, &launches, op.scale(self.size))
    }

    /// Reduce-scatter in place: rank r's result covers elements `offset(r)..offset(r) +
    /// counts[r]` of the windows (the counts in rank order) and lands at the same place in rank
    /// r's own window.
    pub fn reduce_scatter<T: GradElement>(
        &self,
        counts: &[usize],
        op: LaneOp,
    ) -> Result<(), LaneError> {
        let bytes = self.segments::<T>("reduce-scatter", counts)?;
        let launches: Vec<_> = self
            .mine(counts)
            .map(|(r, range)| (self.windows.clone(), vec![self.windows[r]], range))
            .collect();
        self.collective::<T>("reduce-scatter", bytes, &launches, op.scale(self.size))
    }

    /// All-gather in place: rank r's segment (elements `offset(r)..offset(r) + counts[r]` of its
    /// own window) is copied to the same place in every other window.
    pub fn all_gather<T: GradElement>(&self, counts: &[usize]) -> Result<(), LaneError> {
        let bytes = self.segments::<T>("all-gather", counts)?;
        let launches: Vec<_> = self
            .mine(counts)
            .map(|(r, range)| {
                let others = (0..self.size)
                    .filter(|&o| o != r)
                    .map(|o| self.windows[o])
                    .collect();
                (vec![self.windows[r]], others, range)
            })
            .collect();
        self.collective::<T>("all-gather", bytes, &launches, 1.0)
    }

    /// All-reduce of f32 over the first `count` elements of every window of this lane *and* of
    /// the lanes of the other nodes: the hierarchical schedule. The ranks of this node
    /// reduce-scatter (sum) on the device; each rank's share crosses to the host in chunks of
    /// [`CROSS_CHUNK`] elements and is summed over `cross` (the ranks of the other nodes with
    /// this rank's local index, all with the same shares), each chunk's sum started as soon as
    /// it is read, so the reads overlap the transfers; the sums are scaled (a mean divides by
    /// every rank of every node), written back, and all-gathered on the device. Only one share
    /// per rank leaves the device. Every node's lane must have the same size.
    pub fn all_reduce_across<C: CrossLink + ?Sized>(
        &self,
        count: usize,
        op: LaneOp,
        cross: &C,
    ) -> Result<(), LaneError> {
        let bytes = count * 4;
        self.fits("all-reduce across nodes", bytes)?;
        let counts: Vec<usize> = (0..self.size).map(|r| self.share(count, r).len()).collect();
        self.reduce_scatter::<f32>(&counts, LaneOp::Sum)?;
        let mine = self.share(count, self.rank);
        let scale = op.scale(self.size * cross.nodes());
        let mut pending = Vec::new();
        for at in (mine.start..mine.end).step_by(CROSS_CHUNK) {
            let mut chunk = vec![0.0f32; CROSS_CHUNK.min(mine.end - at)];
            self.read_at(at, &mut chunk)?;
            pending.push((at, cross.start_sum(chunk)));
        }
        let cross_err = |detail: String| LaneError::Link {
            collective: "all-reduce across nodes",
            bytes,
            rank: self.rank,
            size: self.size,
            detail,
        };
        for (at, sum) in pending {
            let mut chunk = sum().map_err(cross_err)?;
            if scale != 1.0 {
                for v in &mut chunk {
                    *v *= scale;
                }
            }
            self.write_at(at, &chunk)?;
        }
        self.all_gather::<f32>(&counts)
    }

    /// Checks a collective's counts (one per rank) and returns its bytes.
    fn segments<T: GradElement>(
        &self,
        collective: &'static str,
        counts: &[usize],
    ) -> Result<usize, LaneError> {
        if counts.len() != self.size {
            return Err(LaneError::Mismatch {
                rank: self.rank,
                detail: format!(
                    "called {collective} with {} counts on a lane of {} ranks",
                    counts.len(),
                    self.size
                ),
            });
        }
        let bytes = counts.iter().sum::<usize>() * size_of::<T>();
        self.fits(collective, bytes)?;
        Ok(bytes)
    }

    /// The segments this rank's kernels handle, with their owners: its own, or on one device,
    /// every rank's on rank 0.
    fn mine<'a>(
        &'a self,
        counts: &'a [usize],
    ) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + 'a {
        let starts = counts.iter().scan(0, |at, &c| {
            *at += c;
            Some(*at - c)
        });
        starts
            .zip(counts)
            .enumerate()
            .map(|(r, (start, &c))| (r, start..start + c))
            .filter(move |(r, _)| {
                if self.one_device {
                    self.rank == 0
                } else {
                    *r == self.rank
                }
            })
    }

    /// The common body: inputs in place (barrier), this rank's kernels, all kernels done
    /// (barrier).
    #[allow(clippy::type_complexity)]
    fn collective<T: GradElement>(
        &self,
        name: &'static str,
        bytes: usize,
        launches: &[(
            Vec<sys::CUdeviceptr>,
            Vec<sys::CUdeviceptr>,
            std::ops::Range<usize>,
        )],
        scale: f32,
    ) -> Result<(), LaneError> {
        self.current()?;
        // SAFETY: the lane's own stream.
        cuda("cuStreamSynchronize", unsafe {
            result::stream::synchronize(self.stream)
        })?;
        self.link_step(name, bytes, |l| l.barrier())?;
        let mut launched = false;
        for (src, dst, range) in launches {
            if !range.is_empty() && !dst.is_empty() {
                self.launch::<T>(src, dst, range.clone(), scale)?;
                launched = true;
            }
        }
        if launched {
            // SAFETY: the lane's own stream.
            cuda("cuStreamSynchronize", unsafe {
                result::stream::synchronize(self.stream)
            })?;
        }
        self.link_step(name, bytes, |l| l.barrier())
    }

    fn launch<T: GradElement>(
        &self,
        src: &[sys::CUdeviceptr],
        dst: &[sys::CUdeviceptr],
        range: std::ops::Range<usize>,
        scale: f32,
    ) -> Result<(), LaneError> {
        let per_thread = 16 / size_of::<T>();
        let threads = 256u32;
        let units = range.len().div_ceil(per_thread).max(1);
        let blocks = (units.div_ceil(threads as usize) as u32).clamp(1, self.sms * 8);
        let mut src_p = Ptrs::of(src);
        let mut dst_p = Ptrs::of(dst);
        let mut nsrc = src.len() as i32;
        let mut ndst = dst.len() as i32;
        let mut lo = range.start as u64;
        let mut hi = range.end as u64;
        let mut scale = scale;
        let mut params: [*mut c_void; 7] = [
            (&mut src_p as *mut Ptrs).cast(),
            (&mut nsrc as *mut i32).cast(),
            (&mut dst_p as *mut Ptrs).cast(),
            (&mut ndst as *mut i32).cast(),
            (&mut lo as *mut u64).cast(),
            (&mut hi as *mut u64).cast(),
            (&mut scale as *mut f32).cast(),
        ];
        // SAFETY: the parameters match the kernel's signature; every address points into a
        // window of at least `hi` elements (the callers check the capacity).
        cuda("cuLaunchKernel", unsafe {
            result::launch_kernel(
                self.kernels[kernel_of::<T>()],
                (blocks, 1, 1),
                (threads, 1, 1),
                0,
                self.stream,
                &mut params,
            )
        })
    }

    /// The device's copy bandwidth, the lane's ceiling: `cuMemcpyDtoD` of `bytes` between two
    /// fresh buffers, timed with CUDA events, best of `reps` after a warm-up. Returns seconds
    /// per copy.
    pub fn time_device_copy(&self, bytes: usize, reps: usize) -> Result<f64, LaneError> {
        self.current()?;
        let bytes = bytes.max(4);
        // SAFETY: fresh allocations, freed below; copies and events on the lane's stream.
        unsafe {
            let a = cuda("cuMemAlloc", result::malloc_sync(bytes))?;
            let b = cuda("cuMemAlloc", result::malloc_sync(bytes))?;
            let start = cuda(
                "cuEventCreate",
                result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT),
            )?;
            let stop = cuda(
                "cuEventCreate",
                result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT),
            )?;
            let mut best = f64::INFINITY;
            let timed = (|| -> Result<(), LaneError> {
                cuda(
                    "cuMemcpyDtoDAsync",
                    result::memcpy_dtod_async(b, a, bytes, self.stream),
                )?;
                for _ in 0..reps.max(1) {
                    cuda("cuEventRecord", result::event::record(start, self.stream))?;
                    cuda(
                        "cuMemcpyDtoDAsync",
                        result::memcpy_dtod_async(b, a, bytes, self.stream),
                    )?;
                    cuda("cuEventRecord", result::event::record(stop, self.stream))?;
                    cuda("cuEventSynchronize", result::event::synchronize(stop))?;
                    let ms = cuda("cuEventElapsedTime", result::event::elapsed(start, stop))?;
                    best = best.min(f64::from(ms) / 1e3);
                }
                Ok(())
            })();
            let _ = result::event::destroy(start);
            let _ = result::event::destroy(stop);
            let _ = result::free_sync(a);
            let _ = result::free_sync(b);
            timed?;
            Ok(best)
        }
    }
}

impl<L: NodeLink> Drop for DeviceLane<L> {
    fn drop(&mut self) {
        self.free();
    }
}

/// Rank `r`'s range of an all-reduce of `count` elements over `size` ranks: equal shares rounded
/// up to 64 elements (so each starts on a 16-byte boundary), the last ones shorter or empty.
fn share(count: usize, size: usize, r: usize) -> std::ops::Range<usize> {
    let per = count.div_ceil(size.max(1)).next_multiple_of(64);
    (r * per).min(count)..((r + 1) * per).min(count)
}

/// The lane's collectives computed on the host, in the kernel's order of operations: f32 sum in
/// rank order from the first rank's value, one multiply by the scale, one rounding to `T`.
pub mod reference {
    use super::LaneOp;
    use crate::GradElement;

    /// Every rank's result of an all-reduce of `inputs` (one per rank, equal lengths).
    pub fn all_reduce<T: GradElement>(inputs: &[Vec<T>], op: LaneOp) -> Vec<T> {
        let n = inputs.len();
        let scale = op.scale(n);
        (0..inputs.first().map_or(0, Vec::len))
            .map(|i| {
                let mut acc = inputs[0][i].widen();
                for input in &inputs[1..] {
                    acc += input[i].widen();
                }
                T::narrow(acc * scale)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shares_cover_every_element_once_on_aligned_starts() {
        for size in 1..=MAX_RANKS {
            for count in [0, 1, 63, 64, 65, 1000, 4097, (1 << 20) + 3] {
                let mut next = 0;
                for r in 0..size {
                    let s = share(count, size, r);
                    assert_eq!(s.start, next, "count {count}, {size} ranks, rank {r}");
                    assert!(s.start.is_multiple_of(64) || s.is_empty());
                    next = s.end;
                }
                assert_eq!(next, count, "count {count}, {size} ranks");
            }
        }
    }

    fn announce(capacity: u64) -> Vec<u8> {
        let mut m = TAG.to_vec();
        m.extend_from_slice(&7u32.to_le_bytes());
        m.extend_from_slice(&capacity.to_le_bytes());
        m.extend_from_slice(&0u64.to_le_bytes());
        m.extend_from_slice(&[0; 64]);
        m.extend_from_slice(&[0; 16]);
        m
    }

    #[test]
    fn every_rank_reaches_the_same_verdict_on_the_set_up_messages() {
        assert!(check_announces(&[announce(256), announce(256)], 256).is_ok());
        // Judged against rank 0's capacity, whatever this rank asked for.
        let e = check_announces(&[announce(256), announce(512)], 256).unwrap_err();
        assert!(matches!(e, LaneError::Mismatch { rank: 1, .. }), "{e}");
        let e = check_announces(&[announce(256), announce(512)], 512).unwrap_err();
        assert!(matches!(e, LaneError::Mismatch { rank: 1, .. }), "{e}");
        let mut failed = FAILED.to_vec();
        failed.extend_from_slice(b"cuMemAlloc failed: out of memory");
        let e = check_announces(&[announce(256), failed], 256).unwrap_err();
        assert!(
            e.to_string()
                .contains("rank 1 could not set up its window: cuMemAlloc"),
            "{e}"
        );
        let e = check_announces(&[b"garbage".to_vec(), announce(256)], 256).unwrap_err();
        assert!(matches!(e, LaneError::Mismatch { rank: 0, .. }), "{e}");
    }

    #[test]
    fn the_reference_sums_in_rank_order_and_scales_once() {
        let inputs = vec![vec![1.0f32, 1e8], vec![2.0, 1.0], vec![4.0, -1e8]];
        assert_eq!(reference::all_reduce(&inputs, LaneOp::Sum), vec![7.0, 0.0]);
        let mean = reference::all_reduce(&inputs, LaneOp::Mean);
        assert_eq!(mean[0], 7.0f32 * (1.0 / 3.0));
    }
}
