//! The pipeline checks' model: a stack of residual linear blocks, each made from its own seed so
//! that a stage builds only its own blocks with the values one device's model has, and the one
//! batch every check trains on.

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::relu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use crate::nets::{DpFlex, seeded};

/// Blocks of the model.
pub const BLOCKS: usize = 4;
/// Features in and out of every block.
pub const WIDTH: usize = 8;
/// Rows of the batch.
pub const BATCH: usize = 8;

/// One block: a linear layer and a ReLU, with a residual connection (so that every block's
/// input reaches the loss).
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    linear: Linear<B>,
}

impl<B: Backend> Block<B> {
    /// The block's output.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        relu(self.linear.forward(x.clone())) + x
    }
}

/// Consecutive blocks of the model: a stage, or the whole model.
#[derive(Module, Debug)]
pub struct Stage<B: Backend> {
    blocks: Vec<Block<B>>,
}

impl<B: Backend> Stage<B> {
    /// The blocks' output, in order.
    pub fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for b in &self.blocks {
            x = b.forward(x);
        }
        x
    }
}

/// The model's blocks `range`, each made from its own seed.
pub fn stage(range: Range<usize>, device: &burn::backend::flex::FlexDevice) -> Stage<DpFlex> {
    Stage {
        blocks: range
            .map(|i| {
                seeded::<DpFlex, _>(100 + i as u64, device, |d| Block {
                    linear: LinearConfig::new(WIDTH, WIDTH).init(d),
                })
            })
            .collect(),
    }
}

/// The batch: inputs and targets, `[BATCH, WIDTH]` each.
pub fn batch(device: &burn::backend::flex::FlexDevice) -> (Tensor<DpFlex, 2>, Tensor<DpFlex, 2>) {
    let x: Vec<f32> = (0..BATCH * WIDTH)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let y: Vec<f32> = (0..BATCH * WIDTH)
        .map(|i| ((i * 11 % 17) as f32 - 8.0) / 5.0)
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [BATCH, WIDTH]), device),
        Tensor::from_data(TensorData::new(y, [BATCH, WIDTH]), device),
    )
}

/// The mean squared error.
pub fn mse(out: Tensor<DpFlex, 2>, target: Tensor<DpFlex, 2>) -> Tensor<DpFlex, 1> {
    (out - target).powi_scalar(2).mean()
}

/// Every float parameter's gradient in `grads`, in module order; panics naming none if one has
/// none.
pub fn gradients_of(stage: &Stage<DpFlex>, grads: &GradientsParams) -> Vec<Vec<f32>> {
    struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl ModuleVisitor<DpFlex> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<DpFlex, D>>) {
            let g = self
                .0
                .get::<<DpFlex as AutodiffBackend>::InnerBackend, D>(param.id)
                .expect("every parameter has a gradient");
            self.1
                .push(g.into_data().convert::<f32>().into_vec().unwrap());
        }
    }
    let mut c = Collect(grads, Vec::new());
    stage.visit(&mut c);
    c.1
}
