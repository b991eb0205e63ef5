//! Synthetic 28x28 digit-like images: one stroke pattern per class, drawn with a random shift,
//! thickness and noise per sample, all from a seed.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub(crate) struct Digits {
    images: Vec<f32>,
    labels: Vec<i64>,
}

/// Each class is a few line segments on a 20x20 canvas (seven-segment style).
const SEGMENTS: [&[(f32, f32, f32, f32)]; 10] = [
    &[
        (0., 0., 1., 0.),
        (1., 0., 1., 1.),
        (1., 1., 0., 1.),
        (0., 1., 0., 0.),
    ],
    &[(0.5, 0., 0.5, 1.)],
    &[
        (0., 0., 1., 0.),
        (1., 0., 1., 0.5),
        (1., 0.5, 0., 0.5),
        (0., 0.5, 0., 1.),
        (0., 1., 1., 1.),
    ],
    &[
        (0., 0., 1., 0.),
        (1., 0., 1., 1.),
        (0., 0.5, 1., 0.5),
        (0., 1., 1., 1.),
    ],
    &[(0., 0., 0., 0.5), (0., 0.5, 1., 0.5), (1., 0., 1., 1.)],
    &[
        (1., 0., 0., 0.),
        (0., 0., 0., 0.5),
        (0., 0.5, 1., 0.5),
        (1., 0.5, 1., 1.),
        (1., 1., 0., 1.),
    ],
    &[
        (1., 0., 0., 0.),
        (0., 0., 0., 1.),
        (0., 1., 1., 1.),
        (1., 1., 1., 0.5),
        (1., 0.5, 0., 0.5),
    ],
    &[(0., 0., 1., 0.), (1., 0., 0.3, 1.)],
    &[
        (0., 0., 1., 0.),
        (1., 0., 1., 1.),
        (1., 1., 0., 1.),
        (0., 1., 0., 0.),
        (0., 0.5, 1., 0.5),
    ],
    &[
        (0., 0.5, 0., 0.),
        (0., 0., 1., 0.),
        (1., 0., 1., 1.),
        (0., 0.5, 1., 0.5),
    ],
];

impl Digits {
    pub(crate) fn generate(n: usize, seed: u64) -> Digits {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut images = vec![0.0f32; n * 28 * 28];
        let mut labels = Vec::with_capacity(n);
        for i in 0..n {
            let class = rng.random_range(0..10usize);
            labels.push(class as i64);
            let (dx, dy) = (rng.random_range(2.0..6.0f32), rng.random_range(2.0..6.0f32));
            let (sx, sy) = (
                rng.random_range(14.0..18.0f32),
                rng.random_range(16.0..20.0f32),
            );
            let width = rng.random_range(1.0..1.8f32);
            let img = &mut images[i * 784..(i + 1) * 784];
            for &(x0, y0, x1, y1) in SEGMENTS[class] {
                let (ax, ay, bx, by) = (dx + x0 * sx, dy + y0 * sy, dx + x1 * sx, dy + y1 * sy);
                for (p, px) in img.iter_mut().enumerate() {
                    let (x, y) = ((p % 28) as f32, (p / 28) as f32);
                    let d = segment_distance(x, y, ax, ay, bx, by);
                    *px = px.max((1.0 - (d / width).powi(2)).max(0.0));
                }
            }
            for px in img.iter_mut() {
                *px = (*px + rng.random_range(-0.2..0.2f32)).clamp(0.0, 1.0);
            }
        }
        Digits { images, labels }
    }

    pub(crate) fn len(&self) -> usize {
        self.labels.len()
    }

    /// The images `[n, 28, 28]` and labels of the samples at `indices`.
    pub(crate) fn batch<B: Backend>(
        &self,
        indices: &[usize],
        device: &B::Device,
    ) -> (Tensor<B, 3>, Tensor<B, 1, Int>) {
        let mut x = Vec::with_capacity(indices.len() * 784);
        let mut y = Vec::with_capacity(indices.len());
        for &i in indices {
            x.extend_from_slice(&self.images[i * 784..(i + 1) * 784]);
            y.push(self.labels[i]);
        }
        let n = indices.len();
        (
            Tensor::from_data(TensorData::new(x, [n, 28, 28]), device),
            Tensor::from_data(TensorData::new(y, [n]), device),
        )
    }
}

fn segment_distance(x: f32, y: f32, ax: f32, ay: f32, bx: f32, by: f32) -> f32 {
    let (vx, vy) = (bx - ax, by - ay);
    let len2 = vx * vx + vy * vy;
    let t = if len2 == 0.0 {
        0.0
    } else {
        (((x - ax) * vx + (y - ay) * vy) / len2).clamp(0.0, 1.0)
    };
    let (px, py) = (ax + t * vx - x, ay + t * vy - y);
    (px * px + py * py).sqrt()
}
