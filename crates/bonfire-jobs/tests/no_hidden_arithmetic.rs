//! bonfire's decorators compute nothing of their own. A counting backend at the bottom of each
//! stack records every op call the inner backend receives, by name and number, during a whole
//! training step (forward, backward, Adam) of each bundled model; under
//! `Autodiff<DataParallel<_>>` (what both jobs train on, at every size),
//! `Autodiff<TensorParallel<_>>` with a group of one and `Autodiff<Hybrid<_>>` at dp 1 x tp 1,
//! the calls are exactly those of plain `Autodiff<_>`.
//!
//! A decorator that recomputes part of the forward pass, loses a fused kernel to a default
//! composition (`TensorParallel`'s rules compose a linear layer from a matmul and a broadcast add,
//! which a group of one must not pay), or copies tensors on the way shows here as a count that
//! differs.

use std::collections::BTreeMap;
use std::time::Duration;

use bonfire::backend::tensor_parallel::TensorParallelBackend;
use bonfire::backend::{DataParallelConfig, FailurePolicy};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire::{DataParallel, Hybrid, TensorParallel};
use bonfire_models::{Gpt, GptConfig, ResNet, ResNetConfig};
use bonfire_testkit::counting::{self, Counting};
use burn::backend::Autodiff;
use burn::backend::flex::Flex;
use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};

type Inner = Counting<Flex>;
type Calls = BTreeMap<&'static str, u64>;

/// A group of one rank, as a job at one rank has.
fn one() -> Communicator {
    Communicator::in_process(
        1,
        CommConfig {
            timeout: Duration::from_secs(60),
            ..CommConfig::default()
        },
    )
    .remove(0)
}

/// The calls of the second of two training steps (forward, backward, Adam) of `model`: the
/// second step also shows what the first one left behind (a graph kept alive, a parameter left
/// marked or unmarked).
fn second_step<B, M>(model: M, loss: impl Fn(&M) -> Tensor<B, 1>) -> Calls
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut model = bonfire::replicate(model);
    let mut optim = AdamConfig::new().init::<B, M>();
    let mut calls = Calls::new();
    for _ in 0..2 {
        counting::take();
        let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
        model = optim.step(1e-3, model, grads);
        calls = counting::take();
    }
    calls
}

/// A small GPT (2 blocks, as the job's but narrower), after `prepare` (the job's split).
fn gpt<B: AutodiffBackend>(prepare: impl FnOnce(Gpt<B>) -> Gpt<B>) -> Calls {
    let device = Default::default();
    B::seed(&device, 7);
    let model = GptConfig::new(16)
        .with_context(8)
        .with_layers(2)
        .with_heads(2)
        .with_embd(16)
        .init::<B>(&device);
    let tokens: Vec<i64> = (0..32).map(|i| (i * 5 + 3) % 16).collect();
    let targets: Vec<i64> = (0..32).map(|i| (i * 7 + 1) % 16).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [4, 8]), &device);
    let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [4, 8]), &device);
    second_step(prepare(model), |m: &Gpt<B>| {
        m.loss(tokens.clone(), targets.clone())
    })
}

/// The ResNet of the vision job (narrower).
fn resnet<B: AutodiffBackend>() -> Calls {
    let device = Default::default();
    B::seed(&device, 7);
    let model = ResNetConfig::new().with_width(4).init::<B>(&device);
    let images = Tensor::<B, 4>::random([4, 1, 28, 28], Distribution::Default, &device);
    let labels = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![1i64, 3, 5, 7], [4]), &device);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    second_step(model, |m: &ResNet<B>| {
        loss_fn.forward(m.forward(images.clone()), labels.clone())
    })
}

/// Runs `f` with this thread bound to a data-parallel group of one (as `bonfire::init` at world
/// size 1 leaves a rank).
fn alone<T>(f: impl FnOnce() -> T) -> T {
    let _bind = bonfire::backend::bind_thread(
        one(),
        DataParallelConfig {
            failure: FailurePolicy::Panic,
            ..DataParallelConfig::default()
        },
    );
    f()
}

/// Every op whose count differs, as `op: reference -> decorated`.
fn differences(reference: &Calls, decorated: &Calls) -> Vec<String> {
    let ops: std::collections::BTreeSet<_> = reference.keys().chain(decorated.keys()).collect();
    ops.into_iter()
        .filter_map(|op| {
            let (r, d) = (
                reference.get(op).copied().unwrap_or(0),
                decorated.get(op).copied().unwrap_or(0),
            );
            (r != d).then(|| format!("{op}: {r} -> {d}"))
        })
        .collect()
}

/// Fails naming every stack (and every op) whose calls differ from plain `Autodiff`'s.
fn assert_same(model: &str, reference: &Calls, stacks: &[(&str, Calls)]) {
    let failures: Vec<String> = stacks
        .iter()
        .filter_map(|(stack, calls)| {
            let diff = differences(reference, calls);
            (!diff.is_empty()).then(|| format!("{stack}:\n    {}", diff.join("\n    ")))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{model}: the inner backend is called differently from under plain Autodiff (plain -> \
         decorated) under\n  {}",
        failures.join("\n  ")
    );
}

/// The job's tensor-parallel split, over a group of one.
fn split<B: TensorParallelBackend>(model: Gpt<B>) -> Gpt<B> {
    bonfire::tensor_parallel(model, &bonfire_jobs::gpt::plan(), &one()).expect("plan")
}

#[test]
fn gpt_training_step_runs_exactly_the_inner_ops_under_every_decorator() {
    let plain = gpt::<Autodiff<Inner>>(|m| m);
    // The reference did the real work: attention, MLP, their backward passes and Adam.
    for op in [
        "linear",
        "linear_weight_backward",
        "gelu_backward",
        "float_sqrt",
    ] {
        assert!(plain.contains_key(op), "no {op} in {plain:?}");
    }
    let stacks = [
        (
            "Autodiff<DataParallel<_>>",
            alone(|| gpt::<Autodiff<DataParallel<Inner>>>(|m| m)),
        ),
        (
            "Autodiff<TensorParallel<_>> (a group of one)",
            gpt::<Autodiff<TensorParallel<Inner>>>(split),
        ),
        (
            "Autodiff<Hybrid<_>> (dp 1 x tp 1)",
            alone(|| gpt::<Autodiff<Hybrid<Inner>>>(split)),
        ),
    ];
    assert_same("the GPT", &plain, &stacks);
}

#[test]
fn resnet_training_step_runs_exactly_the_inner_ops_under_every_decorator() {
    let plain = resnet::<Autodiff<Inner>>();
    for op in ["conv2d", "max_pool2d_with_indices", "float_sqrt"] {
        assert!(plain.contains_key(op), "no {op} in {plain:?}");
    }
    let stacks = [
        (
            "Autodiff<DataParallel<_>>",
            alone(resnet::<Autodiff<DataParallel<Inner>>>),
        ),
        (
            "Autodiff<TensorParallel<_>> (a group of one)",
            resnet::<Autodiff<TensorParallel<Inner>>>(),
        ),
        (
            "Autodiff<Hybrid<_>> (dp 1 x tp 1)",
            alone(resnet::<Autodiff<Hybrid<Inner>>>),
        ),
    ];
    assert_same("the ResNet", &plain, &stacks);
}

/// The reductions (and transposes) of a ResNet training step, counted under plain `Autodiff`.
/// Each of the model's nine batch norms goes through `bonfire_models::batch_norm`: 12 reductions
/// each (4 in forward, 8 in backward, 4 of those over a dimension of one) and no transposed copy.
/// Through `burn::nn::BatchNorm::forward` the step made 176 reductions (19 per batch norm, 15 of
/// them autodiff summing broadcast gradients one dimension at a time) and 36 `swap_dims`; on a
/// GPU, where the step is bound by kernel launches, each is a launch.
#[test]
fn resnet_training_step_reduces_as_few_times_as_its_batch_norms_need() {
    let calls = resnet::<Autodiff<Inner>>();
    let reductions: u64 = [
        "float_sum",
        "float_sum_dim",
        "float_mean",
        "float_mean_dim",
        "float_max_dim",
        "float_max",
        "float_prod_dim",
        "float_argmax",
    ]
    .iter()
    .map(|op| calls.get(op).copied().unwrap_or(0))
    .sum();
    let batch_norms = 9;
    // 12 per batch norm, then cross-entropy's log-softmax (a max, a sum, the sum's gradient and
    // the gradient of its broadcast subtraction) and the loss's mean.
    let budget = 12 * batch_norms + 5;
    assert!(
        reductions <= budget,
        "a ResNet step made {reductions} reductions, over the budget of {budget}: {calls:?}"
    );
    assert_eq!(
        calls.get("float_swap_dims"),
        None,
        "a ResNet step transposed tensors: {calls:?}"
    );
}
