//! The model: a small CNN for 28x28 images, an ordinary Burn module (it does not know it is
//! distributed).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;

#[derive(Module, Debug)]
pub(crate) struct Cnn<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    pool: MaxPool2d,
    head: Linear<B>,
}

impl<B: Backend> Cnn<B> {
    pub(crate) fn new(device: &B::Device) -> Self {
        Cnn {
            conv1: Conv2dConfig::new([1, 8], [3, 3]).init(device),
            conv2: Conv2dConfig::new([8, 16], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            head: LinearConfig::new(16 * 5 * 5, 10).init(device),
        }
    }

    pub(crate) fn forward(&self, images: Tensor<B, 3>) -> Tensor<B, 2> {
        let [n, h, w] = images.dims();
        let x = images.reshape([n, 1, h, w]);
        let x = self.pool.forward(relu(self.conv1.forward(x))); // 28 -> 26 -> 13
        let x = self.pool.forward(relu(self.conv2.forward(x))); // 13 -> 11 -> 5
        self.head.forward(x.reshape([n, 16 * 5 * 5]))
    }
}
