//! Times training steps of a model on `Autodiff<Flex>` or, with `--features dp`, on a bonfire
//! decorator at world size 1 after `bonfire::init()` and `bonfire::replicate`:
//! `Autodiff<DataParallel<Flex>>` (the default), `Autodiff<TensorParallel<Flex>>` (`STACK=tp`, a
//! group of one) or `Autodiff<Hybrid<Flex>>` (`STACK=hybrid`, dp 1 x tp 1). The model: the
//! mnist-style example's CNN and data (the same source files; SGD with momentum), or the bundled
//! jobs' GPT (`gpt`: the GPT job's default shape, 4 blocks of width 128 over 64 characters, a
//! vocabulary of 67, Adam) or ResNet (`resnet`: the vision job's, width 8, on 28 x 28 images,
//! Adam), both on seeded random data. With `BONFIRE_SYNC_ALONE=1` every backward runs
//! bonfire's whole gradient path (the hook, buckets, a one-rank all-reduce, the write-back);
//! without it, a job of one rank runs no bonfire code.
//!
//!     dp-overhead-bench [steps] [batch] [cnn|gpt|resnet]
//!
//! Prints one line: `<backend> <median step ms> <steps> <last loss> <buckets all-reduced>
//! <exposed ms per step>`, after 10 untimed steps.

#[path = "../../../examples/mnist-style/src/data.rs"]
mod data;
#[path = "../../../examples/mnist-style/src/model.rs"]
mod model;

use std::time::Instant;

use bonfire_models::{GptConfig, ResNetConfig};
use burn::backend::flex::{Flex, FlexDevice};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, ElementConversion, Int, Tensor};

const WARM_UP: usize = 10;

/// The stack the steps run on, by `STACK` in a build with `dp`.
#[cfg(feature = "dp")]
fn main() {
    use burn::backend::Autodiff;
    let _world = bonfire::init().unwrap_or_else(|e| {
        eprintln!("dp-overhead-bench: {e}");
        std::process::exit(2)
    });
    match std::env::var("STACK").as_deref() {
        Ok("tp") => bench::<Autodiff<bonfire::TensorParallel<Flex>>>(),
        Ok("hybrid") => bench::<Autodiff<bonfire::Hybrid<Flex>>>(),
        Ok("dp") | Err(_) => bench::<Autodiff<bonfire::DataParallel<Flex>>>(),
        Ok(other) => {
            eprintln!("dp-overhead-bench: STACK={other:?}: expected dp, tp or hybrid");
            std::process::exit(2)
        }
    }
}

#[cfg(not(feature = "dp"))]
fn main() {
    bench::<burn::backend::Autodiff<Flex>>()
}

fn bench<B: AutodiffBackend<Device = FlexDevice>>() {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(200);
    let batch: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(32);
    let model = args.next().unwrap_or_else(|| "cnn".into());
    let device = FlexDevice;
    B::seed(&device, 42);
    let (mut times, last_loss) = match model.as_str() {
        "cnn" => cnn::<B>(steps, batch, &device),
        "gpt" => gpt::<B>(steps, batch, &device),
        "resnet" => resnet::<B>(steps, batch, &device),
        other => {
            eprintln!("dp-overhead-bench: model {other:?}: expected cnn, gpt or resnet");
            std::process::exit(2)
        }
    };
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

/// Runs `steps + WARM_UP` steps of `step` (which takes the model and returns it after the step,
/// with the loss), timing the last `steps`: each step's milliseconds, and the last loss.
fn timed<M>(
    steps: usize,
    mut model: M,
    mut step: impl FnMut(M, usize, bool) -> (M, f32),
) -> (Vec<f64>, f32) {
    let mut times = Vec::with_capacity(steps);
    let mut last_loss = 0.0;
    for i in 0..steps + WARM_UP {
        let start = Instant::now();
        let loss;
        (model, loss) = step(model, i, i + 1 == steps + WARM_UP);
        if i >= WARM_UP {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        last_loss = loss;
    }
    (times, last_loss)
}

fn cnn<B: AutodiffBackend<Device = FlexDevice>>(
    steps: usize,
    batch: usize,
    device: &FlexDevice,
) -> (Vec<f64>, f32) {
    let model = bonfire_replicate(model::Cnn::<B>::new(device));
    let mut optim = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new()))
        .init();
    let train = data::Digits::generate(batch * 16, 1);
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    timed(steps, model, |model, step, last| {
        let idx: Vec<usize> = (0..batch).map(|i| (step * batch + i) % train.len()).collect();
        let (x, y) = train.batch::<B>(&idx, device);
        let loss = loss_fn.forward(model.forward(x), y);
        let l = if last {
            loss.clone().into_scalar().elem()
        } else {
            0.0
        };
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (optim.step(0.05, model, grads), l)
    })
}

fn gpt<B: AutodiffBackend<Device = FlexDevice>>(
    steps: usize,
    batch: usize,
    device: &FlexDevice,
) -> (Vec<f64>, f32) {
    let (vocab, context) = (67, 64);
    let model = bonfire_replicate(GptConfig::new(vocab).with_context(context).init::<B>(device));
    let mut optim = AdamConfig::new().with_beta_2(0.99).init();
    // 16 batches of random characters, the targets the next character, as the job reads them.
    let text: Tensor<B, 2, Int> = Tensor::<B, 2>::random(
        [16 * batch, context + 1],
        Distribution::Uniform(0.0, vocab as f64),
        device,
    )
    .int();
    timed(steps, model, |model, step, _| {
        let rows = (step % 16) * batch..(step % 16 + 1) * batch;
        let window = text.clone().slice([rows, 0..context + 1]);
        let x = window.clone().slice([0..batch, 0..context]);
        let y = window.slice([0..batch, 1..context + 1]);
        // The job reads every step's loss (its progress line): so does this.
        let loss = model.loss(x, y);
        let l: f32 = loss.clone().into_scalar().elem();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (optim.step(1e-3, model, grads), l)
    })
}

fn resnet<B: AutodiffBackend<Device = FlexDevice>>(
    steps: usize,
    batch: usize,
    device: &FlexDevice,
) -> (Vec<f64>, f32) {
    let model = bonfire_replicate(ResNetConfig::new().init::<B>(device));
    let mut optim = AdamConfig::new().init();
    let images: Tensor<B, 4> =
        Tensor::random([8 * batch, 1, 28, 28], Distribution::Uniform(0.0, 1.0), device);
    let labels: Tensor<B, 1, Int> =
        Tensor::<B, 1>::random([8 * batch], Distribution::Uniform(0.0, 10.0), device).int();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    timed(steps, model, |model, step, _| {
        let rows = (step % 8) * batch..(step % 8 + 1) * batch;
        let x = images.clone().slice([rows.clone()]);
        let y = labels.clone().slice([rows]);
        let loss = loss_fn.forward(model.forward(x), y);
        let l: f32 = loss.clone().into_scalar().elem();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (optim.step(3e-3, model, grads), l)
    })
}

/// `bonfire::replicate` in a build with `dp` (the jobs call it on every stack); nothing without.
fn bonfire_replicate<B: AutodiffBackend, M: burn::module::Module<B>>(module: M) -> M {
    #[cfg(feature = "dp")]
    let module = bonfire::replicate(module);
    module
}
