//! Plain Rust versions of every kernel: the same arithmetic (f32, the same order of operations)
//! on host slices. The tests hold the kernels to these.

use crate::GradElement;

/// What [`crate::pack`] writes.
pub fn pack_reference<F: GradElement, O: GradElement>(inputs: &[&[F]], scale: f32) -> Vec<O> {
    inputs
        .iter()
        .flat_map(|b| b.iter().map(|&x| O::narrow(x.widen() * scale)))
        .collect()
}

/// What [`crate::pack_with_feedback`] writes: the bucket, and the residual updated in place.
pub fn pack_with_feedback_reference<F: GradElement, O: GradElement>(
    inputs: &[&[F]],
    residual: &mut [f32],
    scale: f32,
) -> Vec<O> {
    let mut out = Vec::with_capacity(residual.len());
    for (x, r) in inputs
        .iter()
        .flat_map(|b| b.iter())
        .zip(residual.iter_mut())
    {
        let v = x.widen() * scale + *r;
        let q = O::narrow(v);
        *r = v - q.widen();
        out.push(q);
    }
    out
}

/// What [`crate::unpack`] writes: the bucket cut at `lens`, scaled and cast.
pub fn unpack_reference<F: GradElement, O: GradElement>(
    bucket: &[F],
    lens: &[usize],
    scale: f32,
) -> Vec<Vec<O>> {
    let mut at = 0;
    lens.iter()
        .map(|&n| {
            let part = bucket[at..at + n]
                .iter()
                .map(|&x| O::narrow(x.widen() * scale))
                .collect();
            at += n;
            part
        })
        .collect()
}

/// What [`crate::reduce`] writes.
pub fn reduce_reference<F: GradElement, O: GradElement>(inputs: &[&[F]], scale: f32) -> Vec<O> {
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = 0.0f32;
            for input in inputs {
                acc += input[i].widen();
            }
            O::narrow(acc * scale)
        })
        .collect()
}

/// What [`crate::add_into`] leaves in `acc`.
pub fn add_into_reference<A: GradElement, F: GradElement>(acc: &mut [A], chunk: &[F], scale: f32) {
    for (a, &c) in acc.iter_mut().zip(chunk) {
        *a = A::narrow((a.widen() + c.widen()) * scale);
    }
}

/// What [`crate::LocalRing::all_reduce`] leaves on every device: segment by segment, the sum in
/// ring order starting after the segment's first holder, scaled at the last step.
pub fn ring_all_reduce_reference<T: GradElement>(
    buffers: &[&[T]],
    segments: &[(usize, usize)],
    scale: f32,
) -> Vec<T> {
    let n = buffers.len();
    if n == 1 {
        return buffers[0]
            .iter()
            .map(|x| T::narrow(x.widen() * scale))
            .collect();
    }
    let mut out: Vec<T> = buffers[0].to_vec();
    for (s, &(start, count)) in segments.iter().enumerate() {
        for i in start..start + count {
            // Device s sends first; each next device adds its own value to what arrived.
            let mut acc = buffers[s][i];
            for step in 0..n - 1 {
                let d = (s + 1 + step) % n;
                let k = if step == n - 2 { scale } else { 1.0 };
                acc = T::narrow((buffers[d][i].widen() + acc.widen()) * k);
            }
            out[i] = acc;
        }
    }
    out
}
