//! The programs of bonfire's book. The chapters include these files (mdBook's `{{#include}}`),
//! and this crate's tests build and run them: the accumulation loop of "Coming from PyTorch DDP"
//! against one rank with the union batch, and the swap-in, tensor-parallel, hybrid and pipeline
//! programs (`src/bin`) as jobs of several processes.

pub mod text;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

/// `module` with every parameter initialised now (Burn initialises a parameter lazily, when it
/// is first used, from whatever the random generator holds then): `bonfire::pipeline`'s.
pub use bonfire::pipeline::materialised;

// ANCHOR: accumulate
/// One optimizer step over `micro_batches`: PyTorch's
/// `with model.no_sync(): loss.backward()` for all but the last, then `loss.backward()` and
/// `optimizer.step()`. The step is the one a single device takes on the union of the
/// micro-batches of every rank.
pub fn accumulation_step<B, M, O, X>(
    mut model: M,
    optim: &mut O,
    lr: f64,
    micro_batches: &[X],
    loss_of: impl Fn(&M, &X) -> Tensor<B, 1>,
) -> M
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let n = micro_batches.len();
    for (i, batch) in micro_batches.iter().enumerate() {
        // Each micro-batch's mean loss, scaled so that the n of them add up to the mean.
        let loss = loss_of(&model, batch) / n as f32;
        if i + 1 < n {
            // Backward without communication; bonfire keeps the gradients on this rank and marks
            // the parameters again for the next backward.
            model = bonfire::accumulate(model, loss);
        } else {
            // The synchronised backward: its gradients are the sum over all n micro-batches,
            // averaged over the ranks. Step on them alone.
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(lr, model, grads);
        }
    }
    model
}
// ANCHOR_END: accumulate
