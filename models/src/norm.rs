//! Batch norm in training mode from fewer tensor operations than `burn::nn::BatchNorm::forward`,
//! with the same module, the same result (to rounding) and the same gradients.
//!
//! Burn's training forward makes the channels leading with a transposed copy for each of its two
//! statistics, and differentiates five broadcast operations against per-channel tensors; under
//! autodiff each of those sums its gradient over the batch and every spatial dimension, one
//! dimension at a time. A step of the bundled ResNet issued 19 reductions and 2 transposed
//! copies for each of its nine batch norms, most of the kernels it launched on a GPU.
//! [`batch_norm`] reads the statistics in place (`[batch, channels, rest]` is a view, not a
//! copy), centres the input on a detached mean (the variance's gradient through the mean is zero,
//! so this changes nothing), and applies the normalisation to the centred input as one scale and
//! one shift per channel: two broadcast operations to differentiate instead of five. On Flex
//! the per-channel operands are also tiled over the batch, the shape Flex's binary operations
//! vectorise (`rows_per_channel`).

use burn::nn::BatchNorm;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// `bn` applied to `x` (`[batch, channels, ...]`). On an autodiff backend (training) this is
/// `bn.forward(x)` computed from fewer operations, updating `bn`'s running mean and variance as
/// Burn does (the batch's biased variance, with `bn.momentum`); otherwise it is `bn.forward(x)`.
/// Half-precision inputs also go to `bn.forward(x)`: the per-channel sums here are kept in the
/// input's dtype, where a sum of squares over a feature map can overflow f16.
///
/// # Panics
///
/// If `x` has fewer than two dimensions, as `BatchNorm::forward` does.
pub fn batch_norm<B: Backend, const D: usize>(bn: &BatchNorm<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    assert!(
        D >= 2,
        "batch norm needs a tensor of shape [batch, channels, ...], got {D} dimension(s)"
    );
    if !B::ad_enabled(&x.device()) || !matches!(x.dtype(), DType::F32 | DType::F64) {
        return bn.forward(x);
    }
    let tiled = rows_per_channel::<B>(&x.device());
    training(bn, x, tiled)
}

/// The training forward; `tiled`: per-channel operands tiled over the batch (`rows_per_channel`).
fn training<B: Backend, const D: usize>(
    bn: &BatchNorm<B>,
    x: Tensor<B, D>,
    tiled: bool,
) -> Tensor<B, D> {
    let dims = x.dims();
    let (n, c) = (dims[0], dims[1]);
    let rest: usize = dims[2..].iter().product();
    let count = (n * rest) as f64;
    // Per-channel sums of a `[batch, channels, rest]` view: the rest (when there is one), then
    // the batch.
    let sum = |t: Tensor<B, 3>| match rest {
        1 => t.sum_dim(0),
        _ => t.sum_dim(2).sum_dim(0),
    };
    let x = x.reshape([n, c, rest]);
    // A per-channel operand `[1, c, 1]` of a `[n, c, rest]` tensor, as the backend applies it
    // fastest (see `rows_per_channel`).
    let tiled = tiled && n > 1;
    let operand = |t: Tensor<B, 3>| if tiled { t.repeat_dim(0, n) } else { t };
    let mean = sum(x.clone()).div_scalar(count);
    let mean_d = mean.clone().detach();
    // Centred on the detached mean: the variance's gradient through the mean is zero.
    let centred = x - operand(mean_d.clone());
    let var = sum(centred.clone().square()).div_scalar(count);
    update_running(bn, mean_d.clone(), var.clone().detach(), c);
    let scale = bn.gamma.val().reshape([1, c, 1]) * var.add_scalar(bn.epsilon).sqrt().recip();
    // `mean - mean_d` is zero: it carries the mean's gradient into the shift, so the output is
    // `(x - mean) * scale + beta` as Burn computes it, without a third broadcast operation.
    let shift = bn.beta.val().reshape([1, c, 1]) - (mean - mean_d) * scale.clone();
    (centred * operand(scale) + operand(shift)).reshape(dims)
}

/// Whether per-channel operands should be tiled over the batch, `[n, c, 1]` instead of the
/// broadcast view `[1, c, 1]`: on Flex. Flex's binary operations take a vectorised path when the
/// smaller operand is shared by every row or holds one value per row of the larger, and walk
/// element by element with a strided iterator otherwise; a `[1, c, 1]` operand of a
/// `[n, c, rest]` tensor is neither, `[n, c, 1]` (contiguous) is the second. The copy is `n * c`
/// values (a few KiB) against the `n * c * rest` each operation reads, and its gradient is one
/// sum over the batch, the reduction the broadcast's gradient made anyway. Elsewhere the view
/// stays: on a GPU each tile is one more kernel launch, what the step there is bound by.
fn rows_per_channel<B: Backend>(device: &B::Device) -> bool {
    // Decorators name their inner backend: `autodiff<data-parallel<flex>>`.
    B::name(device).contains("flex")
}

/// Burn's update of the running statistics: `(1 - momentum) * running + momentum * batch`.
fn update_running<B: Backend>(
    bn: &BatchNorm<B>,
    mean: Tensor<B, 3>,
    var: Tensor<B, 3>,
    channels: usize,
) {
    let device = mean.device();
    let blend = |running: Tensor<B, 1>, batch: Tensor<B, 3>| {
        running
            .to_device(&device)
            .mul_scalar(1.0 - bn.momentum)
            .add(batch.mul_scalar(bn.momentum).reshape([channels]))
            .detach()
    };
    bn.running_mean
        .update(blend(bn.running_mean.value_sync(), mean));
    bn.running_var
        .update(blend(bn.running_var.value_sync(), var));
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Autodiff;
    use burn::backend::flex::{Flex, FlexDevice};
    use burn::module::Param;
    use burn::nn::BatchNormConfig;
    use burn::tensor::{Distribution, TensorData};

    type A = Autodiff<bonfire_backend::DataParallel<Flex>>;

    /// Fails naming `what` unless every value is within 2e-5 (absolute and relative) of Burn's.
    fn close(what: &str, ours: TensorData, burns: TensorData) {
        let (a, b) = (
            ours.to_vec::<f32>().unwrap(),
            burns.to_vec::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 2e-5 * (1.0 + y.abs()),
                "{what}[{i}]: ours {x}, Burn's {y}"
            );
        }
    }

    /// A batch norm over `c` channels with gamma `0.5 + i` and beta `-0.25` (the same each call:
    /// two modules must not share their running statistics, which a clone would).
    fn module(c: usize) -> BatchNorm<A> {
        let device = FlexDevice;
        let mut bn = BatchNormConfig::new(c).init::<A>(&device);
        let gamma: Vec<f32> = (0..c).map(|i| 0.5 + i as f32).collect();
        bn.gamma = Param::from_tensor(Tensor::from_data(TensorData::new(gamma, [c]), &device));
        bn.beta = Param::from_tensor(Tensor::full([c], -0.25, &device));
        bn
    }

    /// Against `BatchNorm::forward` on random inputs whose channels have different means
    /// (offsets up to 12) and spreads, for 4-d, 3-d and 2-d inputs: the output, the gradients of
    /// the input, gamma and beta under a loss that weighs every output differently, at each of
    /// two steps, and the running statistics after both (`value_sync`: `value` would still show
    /// the first step's).
    #[test]
    fn matches_burns_batch_norm_with_its_gradients_and_running_statistics() {
        let device = FlexDevice;
        for shape in [vec![5usize, 3, 4, 6], vec![7, 4, 9], vec![6, 5]] {
            <A as Backend>::seed(&device, 11);
            let c = shape[1];
            let (tiled, broadcast, burns) = (module(c), module(c), module(c));
            let numel: usize = shape.iter().product();
            for step in 0..2 {
                let offsets = Tensor::<A, 1, burn::tensor::Int>::arange(0..c as i64, &device)
                    .float()
                    .mul_scalar(3.0 + step as f64);
                let raw = Tensor::<A, 1>::random([numel], Distribution::Normal(0.0, 2.0), &device);
                let weights =
                    Tensor::<A, 1>::random([numel], Distribution::Uniform(-1.0, 1.0), &device);
                // `Some(tiled)`: ours, with per-channel operands tiled or broadcast; `None`: Burn's.
                let run = |bn: &BatchNorm<A>, mine: Option<bool>| {
                    let x = raw.clone().detach().require_grad();
                    let y = match shape.len() {
                        4 => {
                            let x4 = x.clone().reshape([shape[0], c, shape[2], shape[3]])
                                + offsets.clone().reshape([1, c, 1, 1]);
                            let y = match mine {
                                Some(tiled) => training(bn, x4, tiled),
                                None => bn.forward(x4),
                            };
                            y.reshape([numel])
                        }
                        3 => {
                            let x3 = x.clone().reshape([shape[0], c, shape[2]])
                                + offsets.clone().reshape([1, c, 1]);
                            let y = match mine {
                                Some(tiled) => training(bn, x3, tiled),
                                None => bn.forward(x3),
                            };
                            y.reshape([numel])
                        }
                        _ => {
                            let x2 =
                                x.clone().reshape([shape[0], c]) + offsets.clone().reshape([1, c]);
                            let y = match mine {
                                Some(tiled) => training(bn, x2, tiled),
                                None => bn.forward(x2),
                            };
                            y.reshape([numel])
                        }
                    };
                    let grads = (y.clone() * weights.clone()).sum().backward();
                    [
                        y.into_data(),
                        x.grad(&grads).unwrap().into_data(),
                        bn.gamma.val().grad(&grads).unwrap().into_data(),
                        bn.beta.val().grad(&grads).unwrap().into_data(),
                    ]
                };
                let names = [
                    "output",
                    "input gradient",
                    "gamma gradient",
                    "beta gradient",
                ];
                let reference = run(&burns, None);
                for (bn, how) in [(&tiled, true), (&broadcast, false)] {
                    for ((name, a), b) in names.iter().zip(run(bn, Some(how))).zip(&reference) {
                        close(
                            &format!("{shape:?} step {step}, tiled {how}: {name}"),
                            a,
                            b.clone(),
                        );
                    }
                }
            }
            for ours in [&tiled, &broadcast] {
                close(
                    "running mean",
                    ours.running_mean.value_sync().into_data(),
                    burns.running_mean.value_sync().into_data(),
                );
                close(
                    "running variance",
                    ours.running_var.value_sync().into_data(),
                    burns.running_var.value_sync().into_data(),
                );
                // The statistics moved from their start (0 and 1): the comparison saw an update.
                let moved: f32 = ours.running_mean.value_sync().abs().sum().into_scalar();
                assert!(moved > 0.1, "running mean did not move: {moved}");
            }
        }
    }

    /// Flex under any decorator stack tiles; a backend with its own broadcasting does not.
    #[test]
    fn per_channel_operands_are_tiled_on_flex_only() {
        assert!(rows_per_channel::<A>(&FlexDevice));
        assert!(rows_per_channel::<Flex>(&FlexDevice));
        type N = burn::backend::NdArray;
        assert!(!rows_per_channel::<
            Autodiff<bonfire_backend::DataParallel<N>>,
        >(&Default::default()));
    }

    /// Off autodiff (inference) it is Burn's forward with the running statistics.
    #[test]
    fn inference_is_burns_forward() {
        let device = FlexDevice;
        let bn = BatchNormConfig::new(3).init::<Flex>(&device);
        let x = Tensor::<Flex, 4>::random([2, 3, 4, 4], Distribution::Default, &device);
        batch_norm(&bn, x.clone())
            .into_data()
            .assert_eq(&bn.forward(x).into_data(), true);
    }
}
