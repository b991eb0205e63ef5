//! Burn's guide classifier on the embedded MNIST sample, with Burn 0.21 and bonfire's decorator:
//! the program the chapter "Burn 0.22" sets beside its 0.22 twin (`crates/bonfire-burn022`,
//! `src/bin/guide`), same model, data, optimizer and summary line, so their step times compare.
//!
//! ```text
//! bonfire launch --nproc-per-node 2 -- target/release/guide-021 --epochs 2
//! ```

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use bonfire::DataParallel;
use bonfire::datasets::{ImageSet, Shard, Split};
use bonfire::train::{DataParallelStrategy, DataParallelTraining};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::lr_scheduler::constant::ConstantLr;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};

type B = Autodiff<DataParallel<Flex>>; // bonfire: was Autodiff<Flex>

#[derive(Module, Debug)]
struct Model<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    pool: AdaptiveAvgPool2d,
    dropout: Dropout,
    linear1: Linear<B>,
    linear2: Linear<B>,
    activation: Relu,
}

fn model<B: Backend>(hidden: usize, device: &B::Device) -> Model<B> {
    Model {
        conv1: Conv2dConfig::new([1, 8], [3, 3]).init(device),
        conv2: Conv2dConfig::new([8, 16], [3, 3]).init(device),
        pool: AdaptiveAvgPool2dConfig::new([8, 8]).init(),
        activation: Relu::new(),
        linear1: LinearConfig::new(16 * 8 * 8, hidden).init(device),
        linear2: LinearConfig::new(hidden, 10).init(device),
        dropout: DropoutConfig::new(0.5).init(),
    }
}

impl<B: Backend> Model<B> {
    fn forward(&self, images: Tensor<B, 3>) -> Tensor<B, 2> {
        let [batch, height, width] = images.dims();
        let x = images.reshape([batch, 1, height, width]);
        let x = self.dropout.forward(self.conv1.forward(x));
        let x = self
            .activation
            .forward(self.dropout.forward(self.conv2.forward(x)));
        let x = self.pool.forward(x).reshape([batch, 16 * 8 * 8]);
        let x = self
            .activation
            .forward(self.dropout.forward(self.linear1.forward(x)));
        self.linear2.forward(x)
    }

    fn classify(&self, batch: MnistBatch<B>) -> ClassificationOutput<B> {
        let output = self.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, output, batch.targets)
    }
}

#[derive(Clone, Debug)]
struct MnistBatch<B: Backend> {
    images: Tensor<B, 3>,
    targets: Tensor<B, 1, Int>,
}

impl<B: AutodiffBackend> TrainStep for Model<B> {
    type Input = MnistBatch<B>;
    type Output = ClassificationOutput<B>;
    fn step(&self, batch: MnistBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.classify(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Model<B> {
    type Input = MnistBatch<B>;
    type Output = ClassificationOutput<B>;
    fn step(&self, batch: MnistBatch<B>) -> ClassificationOutput<B> {
        self.classify(batch)
    }
}

/// An image set's indices; the batcher turns them into tensors.
struct Indices(usize);

impl Dataset<usize> for Indices {
    fn get(&self, index: usize) -> Option<usize> {
        (index < self.0).then_some(index)
    }
    fn len(&self) -> usize {
        self.0
    }
}

#[derive(Clone)]
struct MnistBatcher(Arc<ImageSet>);

impl<B: Backend> Batcher<B, usize, MnistBatch<B>> for MnistBatcher {
    fn batch(&self, items: Vec<usize>, device: &B::Device) -> MnistBatch<B> {
        let (images, targets) = self.0.batch::<B>(&items, device);
        MnistBatch {
            images: images.squeeze_dim(1),
            targets,
        }
    }
}

/// A digest of every float parameter's bits, as the 0.22 guide prints it.
#[derive(Default)]
struct Digest(u64);

impl<B: Backend> ModuleVisitor<B> for Digest {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let data = param.val().into_data().convert::<f32>();
        for v in data.as_slice::<f32>().expect("f32 after convert") {
            self.0 = (self.0 ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn flag(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{name}: expected a positive number")),
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let world = bonfire::init()?; // bonfire: join the job
    let epochs = flag("--epochs", 2)?;
    let batch = flag("--batch", 64)?;
    let train_limit = flag("--train-limit", usize::MAX)?;
    let device = FlexDevice;
    B::seed(&device, 42);
    let train = Arc::new(ImageSet::embedded(
        Split::Train,
        Shard::whole().limit(train_limit),
    )?);
    let test = Arc::new(ImageSet::embedded(Split::Test, Shard::whole())?);
    let loader_train = DataLoaderBuilder::new(MnistBatcher(train.clone()))
        .batch_size(batch)
        .shuffle(42)
        .build(Indices(train.len()));
    let loader_test = DataLoaderBuilder::new(MnistBatcher(test.clone()))
        .batch_size(batch)
        .build(Indices(test.len()));
    let artifacts: PathBuf = std::env::temp_dir().join("bonfire-guide-021");
    let steps = epochs * (train.len() / world.world_size()).div_ceil(batch);

    let started = Instant::now();
    let result = SupervisedTraining::new(&artifacts, loader_train, loader_test)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .num_epochs(epochs)
        .data_parallel(DataParallelStrategy::new(device)) // bonfire
        .launch(Learner::new(
            model::<B>(512, &device),
            AdamConfig::new().init(),
            ConstantLr::new(1e-3),
        ));
    let seconds = started.elapsed().as_secs_f64();
    let mut digest = Digest::default();
    result.model.visit(&mut digest);
    println!(
        "guide-021: rank {} of {}: {steps} steps of {batch} images in {seconds:.2} s ({:.1} ms per step), parameters {:016x}",
        world.rank().0,
        world.world_size(),
        seconds * 1e3 / steps.max(1) as f64,
        digest.0
    );
    Ok(())
}
