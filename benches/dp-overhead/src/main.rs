//! Times training steps of the mnist-style example's model and data (the same source files) on
//! `Autodiff<Flex>` or, with `--features dp`, `Autodiff<DataParallel<Flex>>` at world size 1
//! after `bonfire::init()` and `bonfire::replicate`. With `BONFIRE_SYNC_ALONE=1` every backward
//! runs bonfire's whole gradient path (the hook, buckets, a one-rank all-reduce, the write-back);
//! without it, a job of one rank runs no bonfire code. Prints one line:
//! `<backend> <median step ms> <steps> <last loss> <buckets all-reduced> <exposed ms per step>`.

#[path = "../../../examples/mnist-style/src/data.rs"]
mod data;
#[path = "../../../examples/mnist-style/src/model.rs"]
mod model;

use std::time::Instant;

use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::ElementConversion;
use burn::tensor::backend::Backend;

#[cfg(feature = "dp")]
type B = Autodiff<bonfire::DataParallel<Flex>>;
#[cfg(not(feature = "dp"))]
type B = Autodiff<Flex>;

fn main() {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(200);
    let batch: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(32);
    let device = FlexDevice;
    #[cfg(feature = "dp")]
    let _world = bonfire::init().unwrap_or_else(|e| {
        eprintln!("dp-overhead-bench: {e}");
        std::process::exit(2)
    });
    B::seed(&device, 42);
    let model = model::Cnn::<B>::new(&device);
    #[cfg(feature = "dp")]
    let model = bonfire::replicate(model);
    let mut model = model;
    let mut optim = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new()))
        .init();
    let train = data::Digits::generate(batch * 16, 1);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut times = Vec::with_capacity(steps);
    let mut last_loss = 0.0f32;
    for step in 0..steps + 10 {
        let start = Instant::now();
        let idx: Vec<usize> = (0..batch).map(|i| (step * batch + i) % train.len()).collect();
        let (x, y) = train.batch::<B>(&idx, &device);
        let loss = loss_fn.forward(model.forward(x), y);
        if step + 1 == steps + 10 {
            last_loss = loss.clone().into_scalar().elem();
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.05, model, grads);
        if step >= 10 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    // Buckets all-reduced, and the mean exposed synchronisation per synchronised step (ms).
    #[cfg(feature = "dp")]
    let (buckets, exposed) = bonfire::total_stats().map_or((0, 0.0), |s| {
        (s.buckets, s.exposed.as_secs_f64() * 1e3 / s.steps.max(1) as f64)
    });
    #[cfg(not(feature = "dp"))]
    let (buckets, exposed) = (0, 0.0);
    println!(
        "{} {:.4} {} {last_loss:.6} {buckets} {exposed:.4}",
        B::name(&device),
        times[times.len() / 2],
        steps
    );
}
