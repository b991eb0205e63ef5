//! A small ResNet for 28x28 images: a 3x3 stem, three stages of basic residual blocks (the second
//! and third halve the resolution and double the width), global average pooling and a linear head.

use burn::config::Config;
use burn::module::{Module, Param, RunningState};
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

    /// Every batch norm's running statistics, `(mean, variance)`, in module order (the stem's,
    /// then each block's first, second and shortcut's).
    pub fn running_statistics(&self) -> Vec<(Tensor<B, 1>, Tensor<B, 1>)> {
        self.batch_norms()
            .into_iter()
            .map(|bn| {
                let mean = bn.running_mean.clone().into_record().val();
                let var = bn.running_var.clone().into_record().val();
                (mean, var)
            })
            .collect()
    }

    /// The model with its batch norms' running statistics replaced by `stats`, in the order of
    /// [`ResNet::running_statistics`]; each keeps its id.
    ///
    /// # Panics
    /// When `stats` does not have one pair per batch norm.
    pub fn with_running_statistics(mut self, stats: Vec<(Tensor<B, 1>, Tensor<B, 1>)>) -> Self {
        let mut bns = self.batch_norms_mut();
        assert_eq!(
            bns.len(),
            stats.len(),
            "one (mean, variance) per batch norm"
        );
        for (bn, (mean, var)) in bns.iter_mut().zip(stats) {
            let replace = |state: &RunningState<Tensor<B, 1>>, value| {
                let id = state.clone().into_record().id;
                RunningState::from_record(Param::initialized(id, value))
            };
            bn.running_mean = replace(&bn.running_mean, mean);
            bn.running_var = replace(&bn.running_var, var);
        }
        self
    }

    fn batch_norms(&self) -> Vec<&BatchNorm<B>> {
        let mut all = vec![&self.stem_bn];
        for b in &self.blocks {
            all.extend([&b.bn1, &b.bn2]);
            all.extend(b.shortcut.as_ref().map(|(_, bn)| bn));
        }
        all
    }

    fn batch_norms_mut(&mut self) -> Vec<&mut BatchNorm<B>> {
        let mut all = vec![&mut self.stem_bn];
        for b in &mut self.blocks {
            all.extend([&mut b.bn1, &mut b.bn2]);
            all.extend(b.shortcut.as_mut().map(|(_, bn)| bn));
        }
        all
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

    /// The running statistics come out in module order, one pair per batch norm (9 at the
    /// default depth), as forward in training mode left them; replaced, they keep their ids and
    /// read back as given.
    #[test]
    fn running_statistics_read_and_replace() {
        let device = FlexDevice;
        // Training mode (an autodiff backend) updates the statistics.
        let model = ResNetConfig::new().init::<Autodiff<Flex>>(&device);
        let images = Tensor::random([4, 1, 28, 28], Distribution::Default, &device);
        let _ = model.forward(images);
        let stats = model.running_statistics();
        let widths: Vec<usize> = stats.iter().map(|(m, _)| m.dims()[0]).collect();
        assert_eq!(widths, [8, 8, 8, 16, 16, 16, 32, 32, 32]);
        // One forward moved the stem's mean off zero (momentum 0.1 of a positive batch mean).
        let stem: Vec<f32> = stats[0].0.to_data().to_vec().unwrap();
        assert!(stem.iter().any(|&x| x != 0.0), "{stem:?}");
        let ids = |m: &ResNet<Autodiff<Flex>>| {
            let mut ids = Vec::new();
            for bn in m.batch_norms() {
                ids.push(bn.running_mean.clone().into_record().id);
                ids.push(bn.running_var.clone().into_record().id);
            }
            ids
        };
        let before = ids(&model);
        let given: Vec<_> = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let mean = Tensor::<Autodiff<Flex>, 1>::full([w], i as f32, &device);
                let var = Tensor::<Autodiff<Flex>, 1>::full([w], 1.0 + i as f32, &device);
                (mean, var)
            })
            .collect();
        let model = model.with_running_statistics(given);
        assert_eq!(ids(&model), before);
        for (i, (mean, var)) in model.running_statistics().into_iter().enumerate() {
            let m: Vec<f32> = mean.to_data().to_vec().unwrap();
            let v: Vec<f32> = var.to_data().to_vec().unwrap();
            assert!(m.iter().all(|&x| x == i as f32) && v.iter().all(|&x| x == 1.0 + i as f32));
        }
    }
}
