//! A burn-train workload (an MLP regressor, its data and batcher, `TrainStep`) and one function
//! that trains it with burn-train's `SupervisedTraining` under a choice of strategies, so that
//! data-parallel burn-train runs can be checked against single-rank ones.

use std::path::Path;
use std::sync::Arc;

use burn::backend::flex::FlexDevice;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::constant::ConstantLr;
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::activation::relu;
use burn::tensor::backend::distributed::{DistributedConfig, ReduceOperation};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn::train::metric::LossMetric;
use burn::train::{
    ExecutionStrategy, InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput,
    TrainStep,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::nets::{DpFlex, parameters, seeded};

/// Input features per sample.
pub const FEATURES: usize = 6;

/// A two-layer perceptron regressing one value.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    hidden: Linear<B>,
    out: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// A freshly initialised model (uses the backend's random generator; see [`seeded`]).
    pub fn new(device: &B::Device) -> Self {
        Mlp {
            hidden: LinearConfig::new(FEATURES, 12).init(device),
            out: LinearConfig::new(12, 1).init(device),
        }
    }

    /// Predictions `[batch, 1]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.out.forward(relu(self.hidden.forward(x)))
    }

    fn regress(&self, batch: Rows<B>) -> RegressionOutput<B> {
        let output = self.forward(batch.x);
        let loss = MseLoss::new().forward(output.clone(), batch.y.clone(), Reduction::Mean);
        RegressionOutput::new(loss, output, batch.y)
    }
}

impl<B: AutodiffBackend> TrainStep for Mlp<B> {
    type Input = Rows<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Rows<B>) -> TrainOutput<RegressionOutput<B>> {
        let item = self.regress(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Mlp<B> {
    type Input = Rows<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Rows<B>) -> RegressionOutput<B> {
        self.regress(batch)
    }
}

/// One sample: features and target.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Features.
    pub x: [f32; FEATURES],
    /// Target.
    pub y: f32,
}

/// `n` samples of a fixed nonlinear function with noise, from `seed`.
pub fn samples(n: usize, seed: u64) -> Vec<Sample> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let x: [f32; FEATURES] = std::array::from_fn(|_| rng.random_range(-1.0..1.0));
            let y = x[0] * x[1] - 0.5 * x[2] + (x[3] * 2.0).sin() + 0.1 * rng.random::<f32>();
            Sample { x, y }
        })
        .collect()
}

/// A batch of samples.
#[derive(Clone, Debug)]
pub struct Rows<B: Backend> {
    /// `[batch, FEATURES]`.
    pub x: Tensor<B, 2>,
    /// `[batch, 1]`.
    pub y: Tensor<B, 2>,
}

/// Stacks samples in order.
#[derive(Clone, Copy, Debug, Default)]
pub struct RowBatcher;

impl<B: Backend> Batcher<B, Sample, Rows<B>> for RowBatcher {
    fn batch(&self, items: Vec<Sample>, device: &B::Device) -> Rows<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|s| s.x).collect();
        let y: Vec<f32> = items.iter().map(|s| s.y).collect();
        Rows {
            x: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
        }
    }
}

/// A loader over `samples` in order (no shuffling), `batch` samples per batch.
pub fn loader<B: Backend>(samples: Vec<Sample>, batch: usize) -> Arc<dyn DataLoader<B, Rows<B>>> {
    DataLoaderBuilder::new(RowBatcher)
        .batch_size(batch)
        .build(InMemDataset::new(samples))
}

/// The samples reordered so that one rank with batches of `ranks * batch` sees, at every step,
/// exactly the union of what `ranks` ranks see when each takes its contiguous `1/ranks` of
/// `samples` in batches of `batch` (how burn-train's DDP and [`bonfire::train`] shard a loader).
pub fn interleave(samples: &[Sample], ranks: usize, batch: usize) -> Vec<Sample> {
    let per_rank = samples.len() / ranks;
    let mut out = Vec::with_capacity(per_rank * ranks);
    for start in (0..per_rank).step_by(batch) {
        let end = (start + batch).min(per_rank);
        for r in 0..ranks {
            out.extend_from_slice(&samples[r * per_rank + start..r * per_rank + end]);
        }
    }
    out
}

/// How [`fit`] trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// bonfire's `DataParallelStrategy` (one rank per process or per bound thread; at world
    /// size 1, single-device training).
    Bonfire,
    /// burn-train's own DDP strategy over `FlexDevice` listed this many times.
    BurnDdp(usize),
}

/// A training run of [`fit`].
#[derive(Clone, Debug)]
pub struct Run {
    /// Seed of the initial parameters (each rank may use its own: rank 0's wins).
    pub seed: u64,
    /// Training samples (the whole set; the strategy shards it).
    pub train: Vec<Sample>,
    /// Validation samples.
    pub valid: Vec<Sample>,
    /// Samples per batch per rank.
    pub batch: usize,
    /// Epochs to train to.
    pub epochs: usize,
    /// `grads_accumulation`, if any.
    pub accumulation: Option<usize>,
    /// Resume from this epoch's checkpoint.
    pub resume: Option<usize>,
}

/// The run of the burn-train checks (`bonfire-train-check` and `tests/train.rs`): 48 training
/// samples, 16 validation samples, batches of 4 per rank, initial parameters from seed 7.
pub fn check_run(epochs: usize, accumulation: Option<usize>, resume: Option<usize>) -> Run {
    Run {
        seed: 7,
        train: samples(48, 3),
        valid: samples(16, 4),
        batch: 4,
        epochs,
        accumulation,
        resume,
    }
}

/// Trains [`Mlp`] with burn-train (Adam, constant learning rate 0.01, loss metrics, file
/// checkpoints in `dir`) and returns its parameters in module order.
pub fn fit(run: &Run, how: How, dir: &Path) -> Vec<Vec<f32>> {
    let device = FlexDevice;
    let model = seeded::<DpFlex, _>(run.seed, &device, Mlp::new);
    let train = loader::<DpFlex>(run.train.clone(), run.batch);
    let valid = loader(run.valid.clone(), run.batch);
    let mut training = SupervisedTraining::new(dir, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
        .with_application_logger(None)
        .renderer(bonfire::train::QuietRenderer)
        .num_epochs(run.epochs);
    if let Some(k) = run.accumulation {
        training = training.grads_accumulation(k);
    }
    if let Some(epoch) = run.resume {
        training = training.checkpoint(epoch);
    }
    training = match how {
        How::Bonfire => {
            use bonfire::train::{DataParallelStrategy, DataParallelTraining};
            training.data_parallel(DataParallelStrategy::new(device))
        }
        How::BurnDdp(n) => training.with_training_strategy(
            ExecutionStrategy::ddp(
                vec![device; n],
                DistributedConfig {
                    all_reduce_op: ReduceOperation::Mean,
                },
            )
            .into(),
        ),
    };
    let learner = Learner::new(model, AdamConfig::new().init(), ConstantLr::new(0.01));
    let result = training.launch(learner);
    parameters(&result.model)
}
