//! Copies between the devices of one node, and a ring all-reduce across them built from those
//! copies and the `add_into` kernel.
//!
//! The copy is CubeCL's `ComputeClient::to_client`: on CUDA it moves device to device (through
//! NCCL, which uses NVLink or PCIe peer access where the devices have it) with no host
//! round-trip; on wgpu, which has no device-to-device path, it is staged through the host. Burn
//! 0.21's `Tensor::to_device` between two wgpu devices panics, so bonfire never relies on it.
//! Two clients of one device copy with the copy kernel instead.

use cubecl::prelude::*;

use crate::{DeviceBuffer, GradElement, KernelError};

/// Copies `buf`, which lives on `from`, to the device of `to`.
pub fn copy_to_device<R: Runtime, T: GradElement>(
    from: &ComputeClient<R>,
    buf: &DeviceBuffer<R, T>,
    to: &ComputeClient<R>,
) -> DeviceBuffer<R, T> {
    copy_range(from, buf, 0, buf.len(), to)
}

/// Copies elements `start..start + len` of `buf` (on `from`) to the device of `to`.
fn copy_range<R: Runtime, T: GradElement>(
    from: &ComputeClient<R>,
    buf: &DeviceBuffer<R, T>,
    start: usize,
    len: usize,
    to: &ComputeClient<R>,
) -> DeviceBuffer<R, T> {
    if len == 0 {
        return DeviceBuffer::filled(to, 0, T::narrow(0.0));
    }
    if crate::device_of(from) == crate::device_of(to) {
        // A copy within one device is a kernel: CUDA's client-to-client transfer (NCCL) to the
        // device it starts from never completes.
        let out = DeviceBuffer::empty(to, len);
        crate::copy_between(from, buf, start, &out, 0, len)
            .expect("the range lies within the buffer");
        return out;
    }
    let size = std::mem::size_of::<T>() as u64;
    // Offsets add to the view the handle already is (allocations may be padded).
    let total = buf.handle().size_in_used();
    let view = buf
        .handle()
        .clone()
        .offset_start(start as u64 * size)
        .offset_end(total - (start + len) as u64 * size);
    let dtype = T::as_type_native_unchecked().elem_type();
    let handle = from.clone().to_client(view, to, dtype);
    DeviceBuffer::from_handle(handle, len)
}

/// The devices of one node, in ring order.
pub struct LocalRing<R: Runtime> {
    clients: Vec<ComputeClient<R>>,
}

/// Segment boundaries are multiples of this many elements, so that every copy starts at an
/// offset any device can address (wgpu wants 4-byte aligned copies; 64 elements cover 256-byte
/// alignments).
const ALIGN: usize = 64;

impl<R: Runtime> LocalRing<R> {
    /// A ring over `clients`, one per device.
    pub fn new(clients: Vec<ComputeClient<R>>) -> Self {
        LocalRing { clients }
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    /// True when the ring has no device.
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The segment `s` (start, length) of a buffer of `n` elements cut in `parts`: boundaries
    /// at multiples of 64 elements, as even as that allows.
    pub fn segment(n: usize, parts: usize, s: usize) -> (usize, usize) {
        let blocks = n.div_ceil(ALIGN);
        let at = |k: usize| ((blocks * k / parts) * ALIGN).min(n);
        (at(s), at(s + 1) - at(s))
    }

    /// All-reduces `buffers` in place (`buffers[d]` lives on device `d`): afterwards every
    /// buffer holds `scale * (sum over devices)`, the same bits on every device.
    ///
    /// A ring: n - 1 reduce-scatter steps in which each device sends one segment to the next
    /// and the next accumulates it, then n - 1 all-gather steps that pass the finished segments
    /// on. Each segment is summed in ring order starting at the device after its owner, which
    /// [`crate::reference::ring_all_reduce_reference`] reproduces.
    pub fn all_reduce<T: GradElement>(
        &self,
        buffers: &[DeviceBuffer<R, T>],
        scale: f32,
    ) -> Result<(), KernelError> {
        let n = self.clients.len();
        if buffers.len() != n {
            return Err(KernelError::Shape(format!(
                "local all-reduce: {} buffers for {n} devices",
                buffers.len()
            )));
        }
        let len = buffers.first().map_or(0, DeviceBuffer::len);
        if let Some(b) = buffers.iter().find(|b| b.len() != len) {
            return Err(KernelError::Shape(format!(
                "local all-reduce: buffers of {} and {len} elements",
                b.len()
            )));
        }
        if n == 0 || len == 0 {
            return Ok(());
        }
        if n == 1 {
            if scale != 1.0 {
                let c = &self.clients[0];
                let zero = DeviceBuffer::filled(c, len, T::narrow(0.0));
                crate::add_into(c, &buffers[0], &zero, scale)?;
            }
            return Ok(());
        }
        // Reduce-scatter: at step k device d sends segment (d - k) mod n to d + 1, which adds it
        // to its own (and scales at the last step).
        self.ring_pass(
            buffers,
            |d, step| (d + n - step) % n,
            |step, to, chunk, start| {
                let k = if step == n - 2 { scale } else { 1.0 };
                crate::add_into_at(&self.clients[to], &buffers[to], chunk, start, k)
            },
        )?;
        // Device d now owns segment (d + 1) mod n. All-gather: at step k device d passes segment
        // (d + 1 - k) mod n to d + 1, which keeps it.
        self.ring_pass(
            buffers,
            |d, step| (d + 1 + n - step) % n,
            |_, to, chunk, start| crate::copy_at(&self.clients[to], chunk, &buffers[to], start),
        )?;
        Ok(())
    }

    /// n - 1 steps in which every device d copies segment `segment(d, step)` of its buffer to
    /// device d + 1, where `land(step, d + 1, chunk, start)` puts it into that device's buffer.
    fn ring_pass<T: GradElement>(
        &self,
        buffers: &[DeviceBuffer<R, T>],
        segment: impl Fn(usize, usize) -> usize,
        land: impl Fn(usize, usize, &DeviceBuffer<R, T>, usize) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        let n = self.clients.len();
        let len = buffers[0].len();
        for step in 0..n - 1 {
            for (d, (client, buf)) in self.clients.iter().zip(buffers).enumerate() {
                let to = (d + 1) % n;
                let (start, count) = Self::segment(len, n, segment(d, step));
                if count == 0 {
                    continue;
                }
                let chunk = copy_range(client, buf, start, count, &self.clients[to]);
                land(step, to, &chunk, start)?;
            }
        }
        Ok(())
    }
}
