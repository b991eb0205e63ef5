//! A small ResNet for 28x28 images: a 3x3 stem, three stages of basic residual blocks (the second
//! and third halve the resolution and double the width), global average pooling and a linear head.

use burn::config::Config;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::Tensor;
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;

use crate::norm::batch_norm;

/// The shape of a [`ResNet`].
#[derive(Config, Debug)]
pub struct ResNetConfig {
    /// Classes the head predicts.
    #[config(default = 10)]
    pub classes: usize,
    /// Input channels (1 for grey-scale images).
    #[config(default = 1)]
    pub in_channels: usize,
    /// Channels of the stem and of the first stage; each later stage doubles them.
    #[config(default = 8)]
    pub width: usize,
    /// Residual blocks in each of the three stages.
    #[config(default = "[1, 1, 1]")]
    pub blocks: [usize; 3],
}

/// A residual block: conv 3x3, batch norm, ReLU, conv 3x3, batch norm, plus the input (through a
/// strided 1x1 conv and batch norm when the shape changes), then ReLU.
#[derive(Module, Debug)]
pub struct BasicBlock<B: Backend> {
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
    conv2: Conv2d<B>,
    bn2: BatchNorm<B>,
    shortcut: Option<(Conv2d<B>, BatchNorm<B>)>,
}

impl<B: Backend> BasicBlock<B> {
    fn new(input: usize, output: usize, stride: usize, device: &B::Device) -> Self {
        let conv3 = |i, o, s| {
            Conv2dConfig::new([i, o], [3, 3])
                .with_stride([s, s])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .with_bias(false)
                .init(device)
        };
        let shortcut = (stride != 1 || input != output).then(|| {
            let conv = Conv2dConfig::new([input, output], [1, 1])
                .with_stride([stride, stride])
                .with_bias(false)
                .init(device);
            (conv, BatchNormConfig::new(output).init(device))
        });
        BasicBlock {
            conv1: conv3(input, output, stride),
            bn1: BatchNormConfig::new(output).init(device),
            conv2: conv3(output, output, 1),
            bn2: BatchNormConfig::new(output).init(device),
            shortcut,
        }
    }

    /// `[n, input, h, w]` to `[n, output, h / stride, w / stride]` (rounded up).
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let identity = match &self.shortcut {
            Some((conv, bn)) => batch_norm(bn, conv.forward(x.clone())),
            None => x.clone(),
        };
        let y = relu(batch_norm(&self.bn1, self.conv1.forward(x)));
        let y = batch_norm(&self.bn2, self.conv2.forward(y));
        relu(y + identity)
    }
}

/// A small ResNet for 28x28 images (19,810 trainable parameters at the default width 8).
#[derive(Module, Debug)]
pub struct ResNet<B: Backend> {
    stem: Conv2d<B>,
    stem_bn: BatchNorm<B>,
    stem_pool: MaxPool2d,
    blocks: Vec<BasicBlock<B>>,
    pool: AdaptiveAvgPool2d,
    head: Linear<B>,
}

impl ResNetConfig {
    /// The network, with Burn's default initialisation (draws from the backend's RNG: seed it
    /// first for a reproducible start).
    pub fn init<B: Backend>(&self, device: &B::Device) -> ResNet<B> {
        assert!(self.width > 0, "ResNet width must be at least 1");
        let w = self.width;
        let mut blocks = Vec::new();
        let mut channels = w;
        for (stage, &count) in self.blocks.iter().enumerate() {
            let out = w << stage;
            for b in 0..count {
                let stride = if stage > 0 && b == 0 { 2 } else { 1 };
                blocks.push(BasicBlock::new(channels, out, stride, device));
                channels = out;
            }
        }
        ResNet {
            stem: Conv2dConfig::new([self.in_channels, w], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .with_bias(false)
                .init(device),
            stem_bn: BatchNormConfig::new(w).init(device),
            stem_pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            blocks,
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(channels, self.classes).init(device),
        }
    }
}

impl<B: Backend> ResNet<B> {
    /// Class scores (logits) `[n, classes]` for images `[n, channels, h, w]`.
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let x = relu(batch_norm(&self.stem_bn, self.stem.forward(images)));
        let mut x = self.stem_pool.forward(x);
        for block in &self.blocks {
            x = block.forward(x);
        }
        let [n, c, _, _] = x.dims();
        self.head.forward(self.pool.forward(x).reshape([n, c]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Autodiff;
    use burn::backend::flex::{Flex, FlexDevice};
    use burn::module::AutodiffModule;
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::optim::{AdamConfig, GradientsParams, Optimizer};
    use burn::tensor::{Distribution, Int, TensorData};

    type A = Autodiff<bonfire_backend::DataParallel<Flex>>;

    #[test]
    fn shapes_and_parameter_count() {
        let device = FlexDevice;
        let model = ResNetConfig::new().init::<Flex>(&device);
        let out = model.forward(Tensor::zeros([3, 1, 28, 28], &device));
        assert_eq!(out.dims(), [3, 10]);
        // stem 72 + bn 16; block 8->8: 2*576 + 2*16; block 8->16/2: 1152 + 2304 + 128 + 3*32;
        // block 16->32/2: 4608 + 9216 + 512 + 3*64; head 32*10+10.
        let expected =
            72 + 16 + (2 * 576 + 32) + (1152 + 2304 + 128 + 96) + (4608 + 9216 + 512 + 192) + 330;
        // Burn counts batch norm's running mean and variance too: 2 x (8 + 16 + 48 + 96).
        assert_eq!(model.num_params(), expected + 336);
        let wide = ResNetConfig::new().with_width(4).with_blocks([2, 1, 1]);
        let out = wide
            .init::<Flex>(&device)
            .forward(Tensor::zeros([2, 1, 28, 28], &device));
        assert_eq!(out.dims(), [2, 10]);
    }

    /// A few Adam steps on one fixed batch drive its loss down (the network can learn), and the
    /// inference copy (running statistics) gives the same classes as training mode once the
    /// statistics have settled on that batch.
    #[test]
    fn learns_a_fixed_batch() {
        let device = FlexDevice;
        <A as Backend>::seed(&device, 7);
        let mut model = ResNetConfig::new().with_width(4).init::<A>(&device);
        let images =
            Tensor::<A, 4>::random([16, 1, 28, 28], Distribution::Normal(0.0, 1.0), &device);
        let labels = Tensor::<A, 1, Int>::from_data(
            TensorData::new((0..16).map(|i| (i % 10) as i64).collect::<Vec<_>>(), [16]),
            &device,
        );
        let loss_fn = CrossEntropyLossConfig::new().init(&device);
        let mut optim = AdamConfig::new().init();
        let mut losses = Vec::new();
        for _ in 0..30 {
            let loss = loss_fn.forward(model.forward(images.clone()), labels.clone());
            losses.push(loss.clone().into_scalar());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(0.01, model, grads);
        }
        let (first, last) = (losses[0], *losses.last().unwrap());
        assert!(last < 0.3 * first, "loss {first} -> {last}");
        let valid = model.valid();
        let out = valid.forward(images.inner());
        assert_eq!(out.dims(), [16, 10]);
        assert!(out.into_data().iter::<f32>().all(f32::is_finite));
    }
}
