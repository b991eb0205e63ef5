//! The models bonfire bundles, written as ordinary Burn modules generic over the backend. They do
//! not know they are distributed: the same module trains on `Autodiff<Flex>` and on
//! `Autodiff<DataParallel<Flex>>`.
//!
//! - [`ResNet`]: a small residual network with batch norm for 28x28 single-channel images
//!   (MNIST, Fashion-MNIST), built from a [`ResNetConfig`].
//! - [`Gpt`]: a GPT-style decoder (causal self-attention, GELU MLP, tied head), built from a
//!   [`GptConfig`], with [`Gpt::generate`] drawing text as [`Sampling`] (temperature, top-k)
//!   says.
//! - [`batch_norm`]: a `burn::nn::BatchNorm` applied in training from fewer operations than its
//!   own forward (the ResNet's batch norms use it).

mod gpt;
mod norm;
mod resnet;

pub use gpt::{Block, Gpt, GptConfig, GptRecord, GptStage, GptStageRecord, Mlp, Sampling};
pub use norm::batch_norm;
pub use resnet::{BasicBlock, ResNet, ResNetConfig};
