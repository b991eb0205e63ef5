//! Time one training step of the bundled ResNet on the CPU backend (Flex, or NdArray with
//! `BACKEND=ndarray`), through `DataParallel` at world size 1 as `bonfire train vision --ranks 1`:
//! `cargo run --release -p bonfire-models --example resnet_step -- [width] [batch] [steps]`.

use std::time::Instant;

use bonfire_backend::DataParallel;
use bonfire_models::ResNetConfig;
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};

fn main() {
    if std::env::var("BACKEND").as_deref() == Ok("ndarray") {
        run::<Autodiff<DataParallel<burn::backend::NdArray>>>(Default::default())
    } else {
        run::<Autodiff<DataParallel<Flex>>>(FlexDevice)
    }
}

fn run<A: burn::tensor::backend::AutodiffBackend>(device: A::Device) {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().expect("a number"));
    let width = args.next().unwrap_or(8);
    let batch = args.next().unwrap_or(64);
    let steps = args.next().unwrap_or(20);
    <A as Backend>::seed(&device, 1);
    let mut model = ResNetConfig::new().with_width(width).init::<A>(&device);
    let images =
        Tensor::<A, 4>::random([batch, 1, 28, 28], Distribution::Normal(0.0, 1.0), &device);
    let labels = Tensor::<A, 1, Int>::from_data(
        TensorData::new(
            (0..batch).map(|i| (i % 10) as i64).collect::<Vec<_>>(),
            [batch],
        ),
        &device,
    );
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut optim = AdamConfig::new().init();
    let mut start = Instant::now();
    for step in 0..steps + 3 {
        if step == 3 {
            start = Instant::now();
        }
        let loss = loss_fn.forward(model.forward(images.clone()), labels.clone());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-3, model, grads);
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "width {width}, batch {batch}: {:.1} ms/step, {:.0} images/s",
        1e3 * secs / steps as f64,
        (steps * batch) as f64 / secs
    );
}
