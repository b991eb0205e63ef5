//! Fused gradient-reduction kernels, written once in CubeCL and generic over the runtime, so
//! the same code runs on CUDA and on wgpu (Vulkan, Metal, DX12, and Mesa's software Vulkan in CI).
//!
//! Data-parallel training spends its communication phase moving gradients between buffers:
//! copy every parameter's gradient into a flat bucket (scaled by 1/world, maybe cast to bf16 for
//! the wire), add the buckets of several ranks, copy the result back. Written as Burn tensor ops
//! that is a chain of `cat`, `mul`, `cast`, `add` and `slice` launches, each reading and writing
//! the whole bucket. Here each step is **one launch that reads its inputs once and writes its
//! output once**:
//!
//! - [`pack`]: many gradient buffers of different lengths into one bucket, with a scale and a cast;
//!   [`pack_with_feedback`] also keeps what the cast lost in a residual and adds it back next
//!   time, so bf16 or f16 communication does not bias training;
//! - [`reduce`]: `out = scale * (a_1 + ... + a_k)` over k equal buffers, accumulated in f32;
//!   [`add_into`]: the in-place `acc = scale * (acc + chunk)` of the ring's reduce step;
//! - [`unpack`]: the bucket back into the gradient buffers, with the cast back;
//! - [`copy_to_device`] and [`LocalRing`]: copies between the devices of one node and a ring
//!   all-reduce across them.
//! - `lane` (CUDA builds): the device lane, collectives between the *processes* of one host
//!   over device windows mapped with CUDA IPC, one fused kernel per rank (sum in rank order,
//!   scale, round to f32/f16/bf16) and never a byte through the host.
//!
//! Every kernel has a plain Rust `*_reference` computing the same thing in the same order of
//! operations; the tests compare the two on fresh random inputs.
//!
//! No network and no Burn types here: buffers are CubeCL handles with a length
//! ([`DeviceBuffer`]).

mod kernels;
#[cfg(feature = "cuda")]
pub mod lane;
mod local;
pub mod reference;

use std::any::TypeId;
use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, Ordering};

use cubecl::prelude::*;
use cubecl::server::Handle;

pub use cubecl;
pub use local::{LocalRing, copy_to_device};

/// The element types gradients travel in: f32, f16 and bf16.
pub trait GradElement: Float + CubeElement + Copy + Send + Sync + 'static {
    /// This value as f32 (exact).
    fn widen(self) -> f32;
    /// The value of this type nearest to `x` (round to nearest, ties to even).
    fn narrow(x: f32) -> Self;
}

impl GradElement for f32 {
    fn widen(self) -> f32 {
        self
    }
    fn narrow(x: f32) -> Self {
        x
    }
}

impl GradElement for half::f16 {
    fn widen(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn narrow(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

impl GradElement for half::bf16 {
    fn widen(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn narrow(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

/// Whether the device of `client` can store and compute with `T` (f32 always; f16 and bf16
/// depend on the device: most GPUs have f16, bf16 needs recent hardware and drivers).
pub fn supports<R: Runtime, T: GradElement>(client: &ComputeClient<R>) -> bool {
    use cubecl::ir::features::TypeUsage;
    let uses = T::supported_uses(client);
    uses.contains(TypeUsage::Buffer) && uses.contains(TypeUsage::Conversion)
}

/// A buffer of `len` elements of `T` on the device of a CubeCL client.
pub struct DeviceBuffer<R: Runtime, T> {
    handle: Handle,
    len: usize,
    _runtime: PhantomData<(R, T)>,
}

impl<R: Runtime, T> Clone for DeviceBuffer<R, T> {
    fn clone(&self) -> Self {
        DeviceBuffer {
            handle: self.handle.clone(),
            len: self.len,
            _runtime: PhantomData,
        }
    }
}

impl<R: Runtime, T: CubeElement> DeviceBuffer<R, T> {
    /// Copies `data` to the device.
    pub fn upload(client: &ComputeClient<R>, data: &[T]) -> Self {
        // A zero-sized allocation is not portable; empty buffers hold one unused element.
        let handle = if data.is_empty() {
            client.create_from_slice(&vec![0u8; std::mem::size_of::<T>()])
        } else {
            client.create_from_slice(T::as_bytes(data))
        };
        Self::from_handle(handle, data.len())
    }

    /// Copies the buffer back to the host (waits for the work queued on it).
    pub fn download(&self, client: &ComputeClient<R>) -> Result<Vec<T>, KernelError> {
        let bytes = client
            .read_one(self.handle.clone())
            .map_err(|e| KernelError::Device(format!("{e:?}")))?;
        Ok(T::from_bytes(&bytes)[..self.len].to_vec())
    }

    /// An uninitialised buffer of `len` elements (for kernels to write every element of).
    pub fn empty(client: &ComputeClient<R>, len: usize) -> Self {
        Self::from_handle(client.empty(len.max(1) * std::mem::size_of::<T>()), len)
    }

    /// A buffer over memory the caller already holds: a tensor's handle, for example.
    ///
    /// # Safety
    ///
    /// `handle` must hold at least `len` contiguous elements of `T` from its start, and live on
    /// the device of the client the buffer is used with.
    pub unsafe fn from_raw_handle(handle: Handle, len: usize) -> Self {
        Self::from_handle(handle, len)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The CubeCL handle, for launching other kernels on it.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    pub(crate) fn from_handle(handle: Handle, len: usize) -> Self {
        DeviceBuffer {
            handle,
            len,
            _runtime: PhantomData,
        }
    }

    pub(crate) fn arg(&self) -> ArrayArg<R> {
        // SAFETY: the handle holds at least `len` elements of `T` (it was made by `upload`,
        // `filled` or a copy of that length).
        unsafe { ArrayArg::from_raw_parts(self.handle.clone(), self.len) }
    }
}

impl<R: Runtime, T: GradElement> DeviceBuffer<R, T> {
    /// A buffer of `len` elements, every one set to `fill`.
    pub fn filled(client: &ComputeClient<R>, len: usize, fill: T) -> Self {
        let mut b = Self::upload(client, &vec![fill; len.max(1)]);
        b.len = len;
        b
    }
}

/// A request the kernels cannot carry out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// Buffer lengths do not fit together.
    #[error("{0}")]
    Shape(String),
    /// The device failed.
    #[error("device error: {0}")]
    Device(String),
}

/// Units per cube in the tiled kernels (pack, unpack).
const TILE: usize = 256;

/// Vectors each unit of the tiled kernels moves; 0: chosen per launch (see
/// [`set_vectors_per_unit`]).
static VECTORS_PER_UNIT: AtomicU32 = AtomicU32::new(0);

/// Tiles (cubes) a launch should have at least before its units take more vectors each: about
/// four cubes per streaming multiprocessor of a large GPU.
const MIN_TILES: usize = 512;

/// Sets how many vectors each unit of the pack and unpack kernels moves, for every later launch
/// in this process: 1, 2, 4, 8 or 16 (other values are rounded down to one of these), or 0 (the
/// default) to choose per launch: the most, up to 8, that still leaves the launch 512 cubes.
/// More vectors per unit keep more loads in flight, which a GPU's memory needs to reach its
/// bandwidth; fewer give more cubes to spread over the device. `bonfire bench kernels
/// --vectors-per-unit 0,1,2,4,8` compares them (BENCHMARKS.md has an H100's figures).
pub fn set_vectors_per_unit(n: u32) {
    let n = match n {
        0 => 0,
        1 => 1,
        2 | 3 => 2,
        4..=7 => 4,
        8..=15 => 8,
        _ => 16,
    };
    VECTORS_PER_UNIT.store(n, Ordering::Relaxed);
}

/// The setting of [`set_vectors_per_unit`] (0: chosen per launch).
pub fn vectors_per_unit() -> u32 {
    VECTORS_PER_UNIT.load(Ordering::Relaxed)
}

/// Vectors per unit for a launch over `vectors` vectors.
fn per_unit_for(vectors: usize) -> usize {
    match vectors_per_unit() {
        0 => [8, 4, 2]
            .into_iter()
            .find(|&p| vectors >= MIN_TILES * TILE * p)
            .unwrap_or(1),
        n => n as usize,
    }
}

/// The widest vector (4, 2 or 1 elements) that divides every length.
fn vector_size(lens: impl IntoIterator<Item = usize>) -> usize {
    let all: Vec<usize> = lens.into_iter().collect();
    [4, 2, 1]
        .into_iter()
        .find(|v| all.iter().all(|l| l % v == 0))
        .unwrap_or(1)
}

/// The tile table of buffers of `lens` laid end to end in a bucket of `total` elements, in
/// vectors of `v`, at most `per_tile` vectors a tile: four u32 per tile (buffer, first vector in the buffer, first vector in the
/// bucket, vectors in the tile). Checks that the lengths add up to the bucket.
fn tile_table(
    lens: &[usize],
    total: usize,
    v: usize,
    per_tile: usize,
    what: &str,
) -> Result<Vec<u32>, KernelError> {
    let sum: usize = lens.iter().sum();
    if sum != total {
        return Err(KernelError::Shape(format!(
            "{what}: the buffers hold {sum} elements, the bucket {total}"
        )));
    }
    let too_big = || KernelError::Shape(format!("{what}: buckets are limited to 2^32 - 1 vectors"));
    let mut table = Vec::new();
    let mut base = 0usize;
    for (j, &len) in lens.iter().enumerate() {
        let vectors = len / v;
        for start in (0..vectors).step_by(per_tile) {
            for field in [j, start, base + start, per_tile.min(vectors - start)] {
                table.push(u32::try_from(field).map_err(|_| too_big())?);
            }
        }
        base += vectors;
    }
    Ok(table)
}

pub(crate) fn launch_shape<R: Runtime>(
    client: &ComputeClient<R>,
    n: usize,
) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(client, n);
    (cubecl::calculate_cube_count_elemwise(client, n, dim), dim)
}

/// Cubes for a tile table: one per tile (the kernels skip any extra).
fn tile_shape<R: Runtime>(client: &ComputeClient<R>, tiles: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(TILE as u32);
    (
        cubecl::calculate_cube_count_elemwise(client, tiles * TILE, dim),
        dim,
    )
}

fn count_u32(n: usize, what: &str) -> Result<u32, KernelError> {
    u32::try_from(n).map_err(|_| KernelError::Shape(format!("{what}: more than 2^32 - 1 vectors")))
}

/// Which device a client drives: clients of one device share its server's state, so the address
/// of that state names the device for as long as the process runs.
pub(crate) fn device_of<R: Runtime>(client: &ComputeClient<R>) -> usize {
    client.info() as *const _ as usize
}

/// What a tile table depends on: the device (its client's shared state, by address), the
/// runtime, the buffers' lengths and the bucket's, the vector width and the vectors per tile.
#[derive(PartialEq, Eq, Hash)]
struct TableKey {
    device: usize,
    runtime: TypeId,
    lens: Vec<usize>,
    /// The bucket's length: a layout is only cached after `tile_table` found that the lengths
    /// add up to it.
    total: usize,
    vector: usize,
    per_tile: usize,
}

/// Tile tables most recently uploaded on this thread; emptied when full.
const TABLE_CACHE: usize = 64;

thread_local! {
    /// Tile tables already on the device, by layout: a gradient bucket has the same layout at
    /// every step, so its table is uploaded once instead of before every launch. Per thread,
    /// because CubeCL gives each thread its own stream, and a table is then only ever read on
    /// the stream that wrote it.
    static TABLES: RefCell<HashMap<TableKey, (Handle, usize)>> = RefCell::new(HashMap::new());
}

/// A launch over buffers laid end to end in a bucket: the buffers that hold anything, their
/// vector width, the tile table on the device and the launch shape.
struct Tiled<'a, R: Runtime, T> {
    buffers: Vec<&'a DeviceBuffer<R, T>>,
    vector: usize,
    table: DeviceBuffer<R, u32>,
    tiles: u32,
    count: CubeCount,
    dim: CubeDim,
    per_unit: usize,
}

impl<'a, R: Runtime, T: GradElement> Tiled<'a, R, T> {
    /// `None` when the bucket is empty (nothing to launch); an error when the lengths do not
    /// add up to the bucket.
    fn new(
        client: &ComputeClient<R>,
        buffers: &[&'a DeviceBuffer<R, T>],
        total: usize,
        what: &str,
    ) -> Result<Option<Self>, KernelError> {
        let buffers: Vec<&DeviceBuffer<R, T>> =
            buffers.iter().copied().filter(|b| !b.is_empty()).collect();
        let lens: Vec<usize> = buffers.iter().map(|b| b.len).collect();
        let vector = vector_size(lens.iter().copied());
        let per_unit = per_unit_for(total / vector);
        let key = TableKey {
            device: device_of(client),
            runtime: TypeId::of::<R>(),
            lens: lens.clone(),
            total,
            vector,
            per_tile: TILE * per_unit,
        };
        let cached = TABLES.with(|t| t.borrow().get(&key).cloned());
        let (handle, fields) = match cached {
            Some(hit) => hit,
            None => {
                let table = tile_table(&lens, total, vector, TILE * per_unit, what)?;
                if total == 0 {
                    return Ok(None);
                }
                let buffer = DeviceBuffer::<R, u32>::upload(client, &table);
                let entry = (buffer.handle().clone(), table.len());
                TABLES.with(|t| {
                    let mut t = t.borrow_mut();
                    if t.len() >= TABLE_CACHE {
                        t.clear();
                    }
                    t.insert(key, entry.clone());
                });
                entry
            }
        };
        let tiles = fields / kernels::TILE_FIELDS;
        let (count, dim) = tile_shape(client, tiles);
        Ok(Some(Tiled {
            buffers,
            vector,
            table: DeviceBuffer::<R, u32>::from_handle(handle, fields),
            tiles: count_u32(tiles, what)?,
            count,
            dim,
            per_unit,
        }))
    }

    fn sequence<A: LaunchArg<RuntimeArg<R> = ArrayArg<R>>>(&self) -> SequenceArg<R, A> {
        self.buffers.iter().map(|b| b.arg()).collect()
    }
}

/// Copies `inputs` one after another into `bucket`, each element scaled by `scale` and cast to
/// the bucket's type, in one launch.
pub fn pack<R: Runtime, F: GradElement, O: GradElement>(
    client: &ComputeClient<R>,
    inputs: &[&DeviceBuffer<R, F>],
    bucket: &DeviceBuffer<R, O>,
    scale: f32,
) -> Result<(), KernelError> {
    let Some(t) = Tiled::new(client, inputs, bucket.len, "pack")? else {
        return Ok(());
    };
    // SAFETY: every index the kernel touches is bounded by the tile table, built from the
    // buffers' own lengths, which add up to the bucket's (checked by `Tiled::new`).
    unsafe {
        kernels::pack_kernel::launch_unchecked::<F, O, R>(
            client,
            t.count.clone(),
            t.dim,
            t.vector,
            t.sequence(),
            t.table.arg(),
            bucket.arg(),
            t.tiles,
            scale,
            TILE,
            t.per_unit,
        );
    }
    Ok(())
}

/// [`pack`] with error feedback: adds `residual` (f32, the bucket's length) before the cast
/// and stores back what the cast lost.
pub fn pack_with_feedback<R: Runtime, F: GradElement, O: GradElement>(
    client: &ComputeClient<R>,
    inputs: &[&DeviceBuffer<R, F>],
    bucket: &DeviceBuffer<R, O>,
    residual: &DeviceBuffer<R, f32>,
    scale: f32,
) -> Result<(), KernelError> {
    if residual.len != bucket.len {
        return Err(KernelError::Shape(format!(
            "pack_with_feedback: the residual holds {} elements, the bucket {}",
            residual.len, bucket.len
        )));
    }
    let Some(t) = Tiled::new(client, inputs, bucket.len, "pack_with_feedback")? else {
        return Ok(());
    };
    // SAFETY: every index the kernel touches is bounded by the tile table, built from the
    // buffers' own lengths, which add up to the bucket's (checked by `Tiled::new`).
    unsafe {
        kernels::pack_feedback_kernel::launch_unchecked::<F, O, R>(
            client,
            t.count.clone(),
            t.dim,
            t.vector,
            t.sequence(),
            t.table.arg(),
            bucket.arg(),
            residual.arg(),
            t.tiles,
            scale,
            TILE,
            t.per_unit,
        );
    }
    Ok(())
}

/// Copies `bucket` back into `outputs` (their lengths, in order), each element scaled and cast
/// to the outputs' type, in one launch.
pub fn unpack<R: Runtime, F: GradElement, O: GradElement>(
    client: &ComputeClient<R>,
    bucket: &DeviceBuffer<R, F>,
    outputs: &[&DeviceBuffer<R, O>],
    scale: f32,
) -> Result<(), KernelError> {
    let Some(t) = Tiled::new(client, outputs, bucket.len, "unpack")? else {
        return Ok(());
    };
    // SAFETY: every index the kernel touches is bounded by the tile table, built from the
    // buffers' own lengths, which add up to the bucket's (checked by `Tiled::new`).
    unsafe {
        kernels::unpack_kernel::launch_unchecked::<F, O, R>(
            client,
            t.count.clone(),
            t.dim,
            t.vector,
            bucket.arg(),
            t.table.arg(),
            t.sequence(),
            t.tiles,
            scale,
            TILE,
            t.per_unit,
        );
    }
    Ok(())
}

/// `out = scale * (inputs[0] + inputs[1] + ...)` elementwise, summed in f32 in that order, in
/// one launch.
pub fn reduce<R: Runtime, F: GradElement, O: GradElement>(
    client: &ComputeClient<R>,
    inputs: &[&DeviceBuffer<R, F>],
    out: &DeviceBuffer<R, O>,
    scale: f32,
) -> Result<(), KernelError> {
    if inputs.is_empty() {
        return Err(KernelError::Shape("reduce: no inputs".into()));
    }
    if let Some(b) = inputs.iter().find(|b| b.len != out.len) {
        return Err(KernelError::Shape(format!(
            "reduce: an input holds {} elements, the output {}",
            b.len, out.len
        )));
    }
    if out.is_empty() {
        return Ok(());
    }
    let v = vector_size([out.len]);
    let vectors = out.len / v;
    let seq = inputs.iter().map(|b| b.arg()).collect();
    let (count, dim) = launch_shape(client, vectors);
    kernels::reduce_kernel::launch::<F, O, R>(
        client,
        count,
        dim,
        v,
        seq,
        out.arg(),
        count_u32(vectors, "reduce")?,
        scale,
    );
    Ok(())
}

/// `dst = src` on one device: the plain copy every other kernel is measured against.
pub fn copy<R: Runtime, T: GradElement>(
    client: &ComputeClient<R>,
    src: &DeviceBuffer<R, T>,
    dst: &DeviceBuffer<R, T>,
) -> Result<(), KernelError> {
    if src.len != dst.len {
        return Err(KernelError::Shape(format!(
            "copy: the source holds {} elements, the destination {}",
            src.len, dst.len
        )));
    }
    copy_at(client, src, dst, 0)
}

/// `dst[offset..offset + src.len()] = src`.
pub(crate) fn copy_at<R: Runtime, T: GradElement>(
    client: &ComputeClient<R>,
    src: &DeviceBuffer<R, T>,
    dst: &DeviceBuffer<R, T>,
    offset: usize,
) -> Result<(), KernelError> {
    copy_between(client, src, 0, dst, offset, src.len)
}

/// `dst[dst_offset..dst_offset + len] = src[src_offset..src_offset + len]`, on one device.
pub(crate) fn copy_between<R: Runtime, T: GradElement>(
    client: &ComputeClient<R>,
    src: &DeviceBuffer<R, T>,
    src_offset: usize,
    dst: &DeviceBuffer<R, T>,
    dst_offset: usize,
    len: usize,
) -> Result<(), KernelError> {
    if src_offset + len > src.len || dst_offset + len > dst.len {
        return Err(KernelError::Shape(format!(
            "copy: {len} elements from {src_offset} of {} into {dst_offset} of {}",
            src.len, dst.len
        )));
    }
    if len == 0 {
        return Ok(());
    }
    let v = vector_size([len, src_offset, dst_offset]);
    let vectors = len / v;
    let (count, dim) = launch_shape(client, vectors);
    kernels::copy_kernel::launch::<T, R>(
        client,
        count,
        dim,
        v,
        dst.arg(),
        src.arg(),
        count_u32(dst_offset / v, "copy")?,
        count_u32(src_offset / v, "copy")?,
        count_u32(vectors, "copy")?,
    );
    Ok(())
}

/// In place: `acc = scale * (acc + chunk)`, computed in f32 (the ring's reduce step).
pub fn add_into<R: Runtime, A: GradElement, F: GradElement>(
    client: &ComputeClient<R>,
    acc: &DeviceBuffer<R, A>,
    chunk: &DeviceBuffer<R, F>,
    scale: f32,
) -> Result<(), KernelError> {
    if acc.len != chunk.len {
        return Err(KernelError::Shape(format!(
            "add_into: the accumulator holds {} elements, the chunk {}",
            acc.len, chunk.len
        )));
    }
    add_into_at(client, acc, chunk, 0, scale)
}

/// `acc[offset..offset + chunk.len()] = scale * (that + chunk)`.
pub(crate) fn add_into_at<R: Runtime, A: GradElement, F: GradElement>(
    client: &ComputeClient<R>,
    acc: &DeviceBuffer<R, A>,
    chunk: &DeviceBuffer<R, F>,
    offset: usize,
    scale: f32,
) -> Result<(), KernelError> {
    if chunk.is_empty() {
        return Ok(());
    }
    let v = vector_size([chunk.len, offset]);
    let vectors = chunk.len / v;
    let (count, dim) = launch_shape(client, vectors);
    kernels::add_into_kernel::launch::<A, F, R>(
        client,
        count,
        dim,
        v,
        acc.arg(),
        chunk.arg(),
        count_u32(offset / v, "add_into")?,
        count_u32(vectors, "add_into")?,
        scale,
    );
    Ok(())
}
