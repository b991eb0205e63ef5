//! The classifier of Burn's guide, written for Burn 0.22: two 3x3 convolutions, an adaptive
//! average pool to 8x8, dropout and two linear layers, trained on MNIST's images. The test of
//! the crate builds it too, to check that two ranks equal one device.

use std::sync::Arc;

use bonfire_datasets::ImageSet;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};

/// The guide's model.
#[derive(Module, Debug)]
pub(crate) struct Model {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: AdaptiveAvgPool2d,
    dropout: Dropout,
    linear1: Linear,
    linear2: Linear,
    activation: Relu,
}

/// Its sizes.
#[derive(Config, Debug)]
pub(crate) struct ModelConfig {
    num_classes: usize,
    hidden_size: usize,
    #[config(default = "0.5")]
    dropout: f64,
}

impl ModelConfig {
    /// The model, its parameters drawn on `device`.
    pub(crate) fn init(&self, device: &Device) -> Model {
        Model {
            conv1: Conv2dConfig::new([1, 8], [3, 3]).init(device),
            conv2: Conv2dConfig::new([8, 16], [3, 3]).init(device),
            pool: AdaptiveAvgPool2dConfig::new([8, 8]).init(),
            activation: Relu::new(),
            linear1: LinearConfig::new(16 * 8 * 8, self.hidden_size).init(device),
            linear2: LinearConfig::new(self.hidden_size, self.num_classes).init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }
}

impl Model {
    /// Logits `[batch, classes]` of images `[batch, height, width]`.
    pub(crate) fn forward(&self, images: Tensor<3>) -> Tensor<2> {
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

    /// The logits, the mean cross-entropy and the targets, as burn-train's metrics want them.
    pub(crate) fn forward_classification(
        &self,
        images: Tensor<3>,
        targets: Tensor<1, Int>,
    ) -> ClassificationOutput {
        let output = self.forward(images);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), targets.clone());
        ClassificationOutput::new(loss, output, targets)
    }
}

/// A batch of images and their labels.
#[derive(Clone, Debug)]
pub(crate) struct MnistBatch {
    /// `[batch, 28, 28]`, normalised.
    pub(crate) images: Tensor<3>,
    /// `[batch]`.
    pub(crate) targets: Tensor<1, Int>,
}

impl TrainStep for Model {
    type Input = MnistBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: MnistBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward_classification(batch.images, batch.targets);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Model {
    type Input = MnistBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: MnistBatch) -> ClassificationOutput {
        self.forward_classification(batch.images, batch.targets)
    }
}

/// The indices of an image set, as a Burn dataset; the batcher turns them into tensors.
pub(crate) struct Indices(pub(crate) usize);

impl Dataset<usize> for Indices {
    fn get(&self, index: usize) -> Result<usize, DatasetError> {
        if index < self.0 {
            Ok(index)
        } else {
            Err(DatasetError::new(std::io::Error::other(format!(
                "image {index} of a set of {}",
                self.0
            ))))
        }
    }

    fn len(&self) -> usize {
        self.0
    }
}

/// Batches of an image set's normalised images.
#[derive(Clone)]
pub(crate) struct MnistBatcher(pub(crate) Arc<ImageSet>);

impl MnistBatcher {
    /// Images `indices` as a batch on `device`.
    pub(crate) fn batch_of(&self, indices: &[usize], device: &Device) -> MnistBatch {
        let [height, width] = self.0.image_shape();
        let (pixels, labels) = self.0.normalised(indices);
        let n = indices.len();
        MnistBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, height, width]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

impl Batcher<usize, MnistBatch> for MnistBatcher {
    fn batch(&self, items: Vec<usize>, device: &Device) -> MnistBatch {
        self.batch_of(&items, device)
    }
}
