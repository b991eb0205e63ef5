//! Every kernel against its plain Rust reference, on fresh random inputs (never zeros), on
//! lengths that are odd, prime, or not a multiple of any vector width, with outputs poisoned
//! first so that an element the kernel forgets to write shows up.
//!
//! The bodies are generic over the runtime; `wgpu` runs them everywhere (CI uses Mesa's software
//! Vulkan), `cuda` (feature `cuda`) wherever an NVIDIA GPU is present.

use bonfire_kernels::cubecl::prelude::{ComputeClient, Runtime};
use bonfire_kernels::reference::*;
use bonfire_kernels::{
    DeviceBuffer, GradElement, KernelError, LocalRing, add_into, copy_to_device, pack,
    pack_with_feedback, reduce, supports, unpack,
};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Bucket layouts: single elements, primes, an empty buffer, odd sizes around a power of two.
/// The last two take vectors of 2 and of 4 elements.
const LAYOUTS: &[&[usize]] = &[
    &[1],
    &[3, 5, 7],
    &[13, 0, 1021, 2],
    &[257, 31, 4099],
    &[6, 2, 1030],
    &[4, 64, 0, 1024, 2048, 12],
];

fn random<T: GradElement>(rng: &mut ChaCha8Rng, n: usize) -> Vec<T> {
    // Magnitudes from 1e-3 to 1e3 and both signs, never zero.
    (0..n)
        .map(|_| {
            let m: f32 = rng.random_range(-3.0f32..3.0);
            let s = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
            T::narrow(s * 10f32.powf(m))
        })
        .collect()
}

fn poison<R: Runtime, T: GradElement>(client: &ComputeClient<R>, n: usize) -> DeviceBuffer<R, T> {
    DeviceBuffer::filled(client, n, T::narrow(f32::NAN))
}

/// Units in the last place of `T` between `a` and `b` (0 when both are the same value).
fn ulps<T: GradElement>(a: T, b: T) -> f32 {
    let (a, b) = (a.widen(), b.widen());
    if a == b {
        return 0.0;
    }
    if a.is_nan() || b.is_nan() {
        return f32::INFINITY;
    }
    // One ulp of T at this magnitude: the gap to the next representable value.
    let m = a.abs().max(b.abs());
    let next = T::narrow(m);
    let mut up = next.widen();
    let mut step = m * 2f32.powi(-30);
    while up <= m {
        up = T::narrow(m + step).widen();
        step *= 2.0;
    }
    (a - b).abs() / (up - next.widen()).max(f32::MIN_POSITIVE)
}

fn assert_close<T: GradElement>(got: &[T], want: &[T], max_ulps: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = ulps(*g, *w);
        assert!(
            d <= max_ulps,
            "{what}: element {i} is {} where the reference has {} ({d} ulps)",
            g.widen(),
            w.widen()
        );
    }
}

fn skip<R: Runtime, T: GradElement>(client: &ComputeClient<R>, name: &str) -> bool {
    if supports::<R, T>(client) {
        return false;
    }
    eprintln!("skipped on this device: it has no {name} buffers");
    true
}

fn check_pack<R: Runtime, F: GradElement, O: GradElement>(client: &ComputeClient<R>, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for layout in LAYOUTS {
        let host: Vec<Vec<F>> = layout.iter().map(|&n| random(&mut rng, n)).collect();
        let dev: Vec<DeviceBuffer<R, F>> = host
            .iter()
            .map(|h| DeviceBuffer::upload(client, h))
            .collect();
        let total = layout.iter().sum();
        let bucket = poison::<R, O>(client, total);
        let scale = 1.0 / 3.0;
        pack(client, &dev.iter().collect::<Vec<_>>(), &bucket, scale).unwrap();
        let slices: Vec<&[F]> = host.iter().map(Vec::as_slice).collect();
        let want = pack_reference::<F, O>(&slices, scale);
        // A product rounded once in f32, then one cast: at most one ulp of the cast's
        // rounding where the device rounds ties differently.
        assert_close(
            &bucket.download(client).unwrap(),
            &want,
            1.0,
            &format!("pack {layout:?}"),
        );

        // And back: unpack (with the inverse scale) into poisoned buffers of the input type.
        let outs: Vec<DeviceBuffer<R, F>> = layout.iter().map(|&n| poison(client, n)).collect();
        unpack(client, &bucket, &outs.iter().collect::<Vec<_>>(), 3.0).unwrap();
        let want = unpack_reference::<O, F>(&bucket.download(client).unwrap(), layout, 3.0);
        for (j, (o, w)) in outs.iter().zip(&want).enumerate() {
            assert_close(
                &o.download(client).unwrap(),
                w,
                1.0,
                &format!("unpack {layout:?} part {j}"),
            );
        }
    }
}

fn check_reduce<R: Runtime, F: GradElement, O: GradElement>(client: &ComputeClient<R>, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for k in 1..=4 {
        for n in [1usize, 7, 1000, 4099] {
            let host: Vec<Vec<F>> = (0..k).map(|_| random(&mut rng, n)).collect();
            let dev: Vec<DeviceBuffer<R, F>> = host
                .iter()
                .map(|h| DeviceBuffer::upload(client, h))
                .collect();
            let out = poison::<R, O>(client, n);
            let scale = 1.0 / k as f32;
            reduce(client, &dev.iter().collect::<Vec<_>>(), &out, scale).unwrap();
            let slices: Vec<&[F]> = host.iter().map(Vec::as_slice).collect();
            let want = reduce_reference::<F, O>(&slices, scale);
            assert_close(
                &out.download(client).unwrap(),
                &want,
                1.0,
                &format!("reduce k={k} n={n}"),
            );
        }
    }
    // In place, the ring's step.
    let n = 3001;
    let acc_host: Vec<O> = random(&mut rng, n);
    let chunk_host: Vec<F> = random(&mut rng, n);
    let acc = DeviceBuffer::upload(client, &acc_host);
    let chunk = DeviceBuffer::upload(client, &chunk_host);
    add_into(client, &acc, &chunk, 0.5).unwrap();
    let mut want = acc_host;
    add_into_reference(&mut want, &chunk_host, 0.5);
    assert_close(&acc.download(client).unwrap(), &want, 1.0, "add_into");
}

fn check_feedback<R: Runtime, O: GradElement>(client: &ComputeClient<R>, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let layout = [5usize, 1021, 3];
    let total: usize = layout.iter().sum();
    let host: Vec<Vec<f32>> = layout.iter().map(|&n| random(&mut rng, n)).collect();
    let dev: Vec<DeviceBuffer<R, f32>> = host
        .iter()
        .map(|h| DeviceBuffer::upload(client, h))
        .collect();
    let inputs: Vec<&DeviceBuffer<R, f32>> = dev.iter().collect();
    let slices: Vec<&[f32]> = host.iter().map(Vec::as_slice).collect();
    let residual = DeviceBuffer::<R, f32>::filled(client, total, 0.0);
    let bucket = poison::<R, O>(client, total);
    let mut residual_ref = vec![0.0f32; total];
    // The same gradient 16 times: what error feedback transmits adds up to 16 x the gradient
    // within one quantum of O, where plain casting would add up 16 rounding errors.
    let steps = 16;
    let mut sent = vec![0.0f64; total];
    for step in 0..steps {
        pack_with_feedback(client, &inputs, &bucket, &residual, 1.0).unwrap();
        let got = bucket.download(client).unwrap();
        let want = pack_with_feedback_reference::<f32, O>(&slices, &mut residual_ref, 1.0);
        // The device may fuse the multiply-add, so allow one ulp per step's cast.
        assert_close(&got, &want, 1.0, &format!("pack_with_feedback step {step}"));
        for (s, g) in sent.iter_mut().zip(&got) {
            *s += f64::from(g.widen());
        }
    }
    let flat: Vec<f32> = slices.iter().flat_map(|s| s.iter().copied()).collect();
    for (i, (s, g)) in sent.iter().zip(&flat).enumerate() {
        let target = f64::from(*g) * f64::from(steps);
        let quantum = f64::from(ulps_quantum::<O>(*g));
        assert!(
            (s - target).abs() <= 2.0 * quantum,
            "element {i}: sent {s} over {steps} steps, want {target} (quantum {quantum})"
        );
    }
}

/// The spacing of `O` around `x`.
fn ulps_quantum<O: GradElement>(x: f32) -> f32 {
    let a = O::narrow(x.abs()).widen();
    let mut step = a.max(f32::MIN_POSITIVE) * 2f32.powi(-30);
    loop {
        let b = O::narrow(a + step).widen();
        if b > a {
            return b - a;
        }
        step *= 2.0;
    }
}

fn check_errors<R: Runtime>(client: &ComputeClient<R>) {
    let a = DeviceBuffer::<R, f32>::upload(client, &[1.0, 2.0, 3.0]);
    let b = DeviceBuffer::<R, f32>::upload(client, &[1.0, 2.0]);
    let bucket = DeviceBuffer::<R, f32>::filled(client, 4, 0.0);
    let err = pack(client, &[&a, &b], &bucket, 1.0).unwrap_err();
    assert_eq!(
        err,
        KernelError::Shape("pack: the buffers hold 5 elements, the bucket 4".into())
    );
    // The same layout into a bucket that fits (its tile table is then kept for reuse), and then
    // into the short bucket again: still refused.
    let fits = DeviceBuffer::<R, f32>::filled(client, 5, 0.0);
    pack(client, &[&a, &b], &fits, 1.0).unwrap();
    assert_eq!(fits.download(client).unwrap(), [1.0, 2.0, 3.0, 1.0, 2.0]);
    assert!(pack(client, &[&a, &b], &bucket, 1.0).is_err());
    assert!(unpack(client, &bucket, &[&a, &b], 1.0).is_err());
    assert!(reduce::<R, f32, f32>(client, &[&a, &b], &a, 1.0).is_err());
    assert!(add_into(client, &a, &b, 1.0).is_err());
    assert!(reduce::<R, f32, f32>(client, &[], &a, 1.0).is_err());
}

/// The ring all-reduce over `clients` (a client may appear more than once: the schedule is the
/// same), against the reference, on lengths below, at and above the segment alignment.
fn check_ring<R: Runtime, T: GradElement>(clients: &[ComputeClient<R>], seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = clients.len();
    eprintln!("  ring over {n} device(s)");
    for len in [1usize, 63, 64, 1000, 4099] {
        let host: Vec<Vec<T>> = (0..n).map(|_| random(&mut rng, len)).collect();
        let bufs: Vec<DeviceBuffer<R, T>> = host
            .iter()
            .zip(clients)
            .map(|(h, c)| DeviceBuffer::upload(c, h))
            .collect();
        let scale = 1.0 / n as f32;
        LocalRing::new(clients.to_vec())
            .all_reduce(&bufs, scale)
            .unwrap();
        let slices: Vec<&[T]> = host.iter().map(Vec::as_slice).collect();
        let segments: Vec<(usize, usize)> =
            (0..n).map(|s| LocalRing::<R>::segment(len, n, s)).collect();
        let want = ring_all_reduce_reference(&slices, &segments, scale);
        for (d, (b, c)) in bufs.iter().zip(clients).enumerate() {
            assert_close(
                &b.download(c).unwrap(),
                &want,
                0.0,
                &format!("ring n={n} len={len} device {d}"),
            );
        }
    }
    // A copy there and back gives the same bits.
    let data: Vec<T> = random(&mut rng, 777);
    let there = copy_to_device(
        &clients[0],
        &DeviceBuffer::upload(&clients[0], &data),
        &clients[n - 1],
    );
    let back = copy_to_device(&clients[n - 1], &there, &clients[0]);
    assert_close(
        &back.download(&clients[0]).unwrap(),
        &data,
        0.0,
        "copy there and back",
    );
}

fn all<R: Runtime>(client: &ComputeClient<R>) {
    // Each kernel variant is compiled on first use (seconds each on some devices): say where
    // the run is, so a slow device is not mistaken for a hung one.
    let started = std::time::Instant::now();
    let done = |what: &str| eprintln!("  {what}: ok ({:.1} s)", started.elapsed().as_secs_f64());
    check_errors(client);
    done("errors");
    for per_unit in [1, 4, 16, 0] {
        bonfire_kernels::set_vectors_per_unit(per_unit);
        check_pack::<R, f32, f32>(client, 1);
        done(&format!(
            "pack/unpack f32, vectors per unit {per_unit} (0: chosen)"
        ));
    }
    check_reduce::<R, f32, f32>(client, 2);
    done("reduce f32");
    if !skip::<R, f16>(client, "f16") {
        check_pack::<R, f32, f16>(client, 3);
        check_reduce::<R, f16, f32>(client, 4);
        check_feedback::<R, f16>(client, 5);
        done("f16");
    }
    if !skip::<R, bf16>(client, "bf16") {
        check_pack::<R, f32, bf16>(client, 6);
        check_reduce::<R, bf16, f32>(client, 7);
        check_feedback::<R, bf16>(client, 8);
        done("bf16");
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn every_kernel_matches_its_reference_on_wgpu() {
    use bonfire_kernels::cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    let client = WgpuRuntime::client(&WgpuDevice::default());
    all(&client);
    // Two wgpu devices (on a machine with one adapter, two clients of it: separate queues and
    // memory pools, which is what the host-staged copy has to bridge).
    let other = WgpuRuntime::client(&WgpuDevice::Cpu);
    check_ring::<WgpuRuntime, f32>(std::slice::from_ref(&client), 10);
    check_ring::<WgpuRuntime, f32>(&[client.clone(), other.clone()], 11);
    check_ring::<WgpuRuntime, f32>(&[client.clone(), other.clone(), client.clone(), other], 12);
    if supports::<WgpuRuntime, f16>(&client) {
        check_ring::<WgpuRuntime, f16>(&[client.clone(), client.clone(), client], 13);
    }
}

#[cfg(feature = "cuda")]
#[test]
fn every_kernel_matches_its_reference_on_cuda() {
    use bonfire_kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
    let client = CudaRuntime::client(&CudaDevice::default());
    all(&client);
    let count = client.device_count_total();
    let clients: Vec<_> = (0..count.max(1))
        .map(|i| CudaRuntime::client(&CudaDevice::new(i)))
        .collect();
    check_ring::<CudaRuntime, f32>(&clients, 11);
}
