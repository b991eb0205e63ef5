//! Two ranks averaging with `average` train exactly as one device on the union of their batches,
//! on the guide's model and the embedded MNIST sample, on Flex (whatever other backend the build
//! has).

#[path = "../src/bin/guide/model.rs"]
#[allow(dead_code)]
mod model;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bonfire_burn022::{
    CommConfig, Communicator, DEFAULT_BUCKET_CAP_BYTES, DataParallel, World, average, replicate,
};
use bonfire_datasets::{ImageSet, Shard, Split};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn::train::{Learner, SupervisedTraining};

use model::{MnistBatcher, Model, ModelConfig};

const TOLERANCE: f32 = 1e-5;

/// Every float parameter's values (or its gradient's, with `grads`), by id.
struct Values<'a> {
    grads: Option<&'a GradientsParams>,
    out: HashMap<ParamId, Vec<f32>>,
}

impl ModuleVisitor for Values<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = match self.grads {
            Some(grads) => match grads.get::<D>(param.id) {
                Some(g) => g,
                None => return,
            },
            None => param.val(),
        };
        let data = tensor.into_data().convert::<f32>();
        self.out
            .insert(param.id, data.as_slice::<f32>().unwrap().to_vec());
    }
}

fn params(model: &Model) -> HashMap<ParamId, Vec<f32>> {
    let mut v = Values {
        grads: None,
        out: HashMap::new(),
    };
    model.visit(&mut v);
    v.out
}

fn grads_of(model: &Model, grads: &GradientsParams) -> HashMap<ParamId, Vec<f32>> {
    let mut v = Values {
        grads: Some(grads),
        out: HashMap::new(),
    };
    model.visit(&mut v);
    v.out
}

fn max_diff(a: &HashMap<ParamId, Vec<f32>>, b: &HashMap<ParamId, Vec<f32>>) -> f32 {
    assert_eq!(a.len(), b.len(), "different parameter sets");
    let mut worst = 0.0f32;
    for (id, x) in a {
        let y = &b[id];
        assert_eq!(x.len(), y.len());
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

fn setup() -> (Device, Model, MnistBatcher) {
    let device = Device::flex().autodiff();
    device.seed(7);
    // No dropout: the two sides must compute the same function.
    let model = ModelConfig::new(10, 64).with_dropout(0.0).init(&device);
    let images = ImageSet::embedded(Split::Train, Shard::whole().limit(64)).unwrap();
    (device, model, MnistBatcher(Arc::new(images)))
}

/// One step's gradients of `model` on images `indices`.
fn gradients(
    model: &Model,
    batcher: &MnistBatcher,
    indices: &[usize],
    device: &Device,
) -> GradientsParams {
    let batch = batcher.batch_of(indices, device);
    let loss = model
        .forward_classification(batch.images, batch.targets)
        .loss;
    GradientsParams::from_grads(loss.backward(), model)
}

/// Runs `f(rank, comm)` on two in-process ranks and returns what each returned, in rank order.
fn two_ranks<T: Send + 'static>(
    f: impl Fn(usize, Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = Communicator::in_process(2, CommConfig::default())
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let f = f.clone();
            std::thread::spawn(move || f(rank, comm))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn two_ranks_average_to_the_union_batch_gradient() {
    let (device, model, batcher) = setup();
    let union: Vec<usize> = (0..16).collect();
    let expected = grads_of(&model, &gradients(&model, &batcher, &union, &device));
    assert_eq!(expected.len(), 8, "every weight and bias has a gradient");

    // A bucket cap of 64 KiB splits the model (about 70,000 parameters) into several buckets.
    let per_rank = two_ranks(move |rank, comm| {
        let mine: Vec<usize> = (rank * 8..rank * 8 + 8).collect();
        let grads = gradients(&model, &batcher, &mine, &device);
        let grads = average(&comm, grads, &model, 64 * 1024).unwrap();
        grads_of(&model, &grads)
    });
    let diff = max_diff(&per_rank[0], &expected);
    assert!(
        diff <= TOLERANCE,
        "rank 0 differs from the union batch by {diff}"
    );
    assert_eq!(per_rank[0], per_rank[1], "the ranks' averages differ");
}

#[test]
fn ten_adam_steps_on_two_ranks_equal_one_device() {
    let (device, model, batcher) = setup();
    let steps = 10;
    let lr = 1e-3;

    let mut single = model.clone();
    let mut optim = AdamConfig::new().init();
    for step in 0..steps {
        let union: Vec<usize> = (step * 4..step * 4 + 4).collect();
        let grads = gradients(&single, &batcher, &union, &device);
        single = optim.step(lr, single, grads);
    }
    let expected = params(&single);

    let per_rank = two_ranks(move |rank, comm| {
        let mut replica = model.clone();
        let mut optim = AdamConfig::new().init();
        for step in 0..steps {
            let mine: Vec<usize> = (step * 4 + rank * 2..step * 4 + rank * 2 + 2).collect();
            let grads = gradients(&replica, &batcher, &mine, &device);
            let grads = average(&comm, grads, &replica, DEFAULT_BUCKET_CAP_BYTES).unwrap();
            replica = optim.step(lr, replica, grads);
        }
        params(&replica)
    });
    let diff = max_diff(&per_rank[0], &expected);
    assert!(
        diff <= TOLERANCE,
        "after {steps} steps rank 0 differs from one device by {diff}"
    );
    assert_eq!(per_rank[0], per_rank[1], "the replicas drifted apart");
}

#[test]
fn replicate_gives_every_rank_rank_0s_parameters_and_keeps_them_trainable() {
    let per_rank = two_ranks(|rank, comm| {
        let device = Device::flex().autodiff();
        // Each rank draws its own parameters.
        let model = {
            let _guard = SEED.lock().unwrap();
            device.seed(100 + rank as u64);
            ModelConfig::new(10, 32).init(&device)
        };
        let before = params(&model);
        let model = replicate(&comm, model, 16 * 1024).unwrap();
        // Still trainable: a backward pass reaches every parameter.
        let images = ImageSet::embedded(Split::Train, Shard::whole().limit(4)).unwrap();
        let batcher = MnistBatcher(Arc::new(images));
        let grads = gradients(&model, &batcher, &[0, 1, 2, 3], &device);
        (before, params(&model), grads_of(&model, &grads).len())
    });
    let (before0, after0, grads0) = &per_rank[0];
    let (before1, after1, grads1) = &per_rank[1];
    assert_eq!(after0, before0, "rank 0's parameters changed");
    // Ids are each rank's own, values rank 0's.
    assert_ne!(
        sorted(before0),
        sorted(before1),
        "the ranks should start apart"
    );
    assert_eq!(
        sorted(after1),
        sorted(after0),
        "rank 1 did not receive rank 0's values"
    );
    for (grads, after) in [(grads0, after0), (grads1, after1)] {
        assert_eq!(
            *grads,
            after.len(),
            "a replicated parameter no longer gets a gradient"
        );
    }
    let ids = |m: &HashMap<ParamId, Vec<f32>>| {
        let mut v: Vec<ParamId> = m.keys().copied().collect();
        v.sort_by_key(|id| id.val());
        v
    };
    assert_eq!(ids(after1), ids(before1), "rank 1's parameter ids changed");
}

static SEED: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_rank_with_another_model_gets_an_error_naming_it() {
    let per_rank = two_ranks(move |rank, comm| {
        let device = Device::flex().autodiff();
        let hidden = if rank == 0 { 32 } else { 48 };
        let model = ModelConfig::new(10, hidden).with_dropout(0.0).init(&device);
        let images = ImageSet::embedded(Split::Train, Shard::whole().limit(2)).unwrap();
        let grads = gradients(&model, &MnistBatcher(Arc::new(images)), &[0, 1], &device);
        average(&comm, grads, &model, DEFAULT_BUCKET_CAP_BYTES)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    for (rank, result) in per_rank.iter().enumerate() {
        let message = result.as_ref().expect_err("mismatched models must fail");
        assert!(
            message.contains("average: the gradients on rank(s) [1]"),
            "rank {rank}: {message}"
        );
    }
}

/// Two models of the same size but other shapes ([4, 6] against [6, 4]): the all-reduce alone
/// would average them without noticing; the layout check refuses.
#[test]
fn models_of_the_same_size_but_other_shapes_are_refused_too() {
    let per_rank = two_ranks(move |rank, comm| {
        let device = Device::flex().autodiff();
        let (d_in, d_out) = if rank == 0 { (4, 6) } else { (6, 4) };
        let model = burn::nn::LinearConfig::new(d_in, d_out)
            .with_bias(false)
            .init(&device);
        let loss = model.forward(Tensor::<2>::ones([1, d_in], &device)).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        average(&comm, grads, &model, DEFAULT_BUCKET_CAP_BYTES)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    for (rank, result) in per_rank.iter().enumerate() {
        let message = result.as_ref().expect_err("other shapes must fail");
        assert!(message.contains("rank(s) [1]"), "rank {rank}: {message}");
    }
}

/// A data set of indices whose item `fail_at` cannot be read.
struct Failing {
    len: usize,
    fail_at: Option<usize>,
}

impl Dataset<usize> for Failing {
    fn get(&self, index: usize) -> Result<usize, DatasetError> {
        match Some(index) == self.fail_at {
            true => Err(DatasetError::new(std::io::Error::other(format!(
                "item {index} is unreadable"
            )))),
            false => Ok(index),
        }
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A map's values sorted (ids differ from rank to rank).
fn sorted(m: &HashMap<ParamId, Vec<f32>>) -> Vec<Vec<f32>> {
    let mut v: Vec<Vec<f32>> = m.values().cloned().collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v
}

/// What one rank of [`burn_train_on_two_ranks`] ended with.
struct Ended {
    steps: usize,
    stragglers: Option<String>,
    times: Vec<bonfire_burn022::EpochTimes>,
    error: Option<String>,
    reason: Option<String>,
    params: HashMap<ParamId, Vec<f32>>,
}

/// burn-train's `SupervisedTraining` with `DataParallel` on two in-process ranks, from `start`,
/// over the first `items` training images in batches of 8 without shuffling (rank r's share is
/// the r-th half), Adam at 1e-3; `fail[r]` makes rank r's training item, `fail_valid[r]` its
/// validation item, unreadable; rank r takes `slow[r]` longer to make each training batch.
#[allow(clippy::too_many_arguments)]
fn burn_train_on_two_ranks(
    start: &Model,
    items: usize,
    epochs: usize,
    accumulation: Option<usize>,
    fail: [Option<usize>; 2],
    fail_valid: [Option<usize>; 2],
    slow: [Duration; 2],
) -> Vec<Ended> {
    let start = start.clone();
    two_ranks(move |rank, comm| {
        let world = World::from_communicator(comm);
        let device = Device::flex();
        let images = ImageSet::embedded(Split::Train, Shard::whole().limit(items)).unwrap();
        let batcher = MnistBatcher(Arc::new(images));
        let train = DataLoaderBuilder::new(Slow(batcher.clone(), slow[rank]))
            .batch_size(8)
            .build(Failing {
                len: items,
                fail_at: fail[rank],
            });
        let valid = DataLoaderBuilder::new(batcher)
            .batch_size(8)
            .build(Failing {
                len: 16,
                fail_at: fail_valid[rank],
            });
        let dir = std::env::temp_dir().join(format!(
            "bonfire-burn022-train-{}-{rank}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let strategy = DataParallel::new(&world, device);
        let training = SupervisedTraining::new(&dir, train, valid)
            .num_epochs(epochs)
            .with_application_logger(None)
            .with_training_strategy(strategy.clone().into());
        let training = match accumulation {
            Some(n) => training.grads_accumulation(n),
            None => training,
        };
        let result = training.launch(Learner::new(start.clone(), AdamConfig::new().init(), 1e-3));
        std::fs::remove_dir_all(&dir).ok();
        Ended {
            steps: strategy.steps(),
            stragglers: strategy.straggler_report(),
            times: strategy.epoch_times(),
            error: result.error.map(|e| e.to_string()),
            reason: result.interrupted.and_then(|i| i.reason),
            params: params(&result.model),
        }
    })
}

/// A batcher that takes `.1` longer for each batch.
#[derive(Clone)]
struct Slow(MnistBatcher, Duration);

impl Batcher<usize, model::MnistBatch> for Slow {
    fn batch(&self, items: Vec<usize>, device: &Device) -> model::MnistBatch {
        std::thread::sleep(self.1);
        self.0.batch(items, device)
    }
}

const FAST: [Duration; 2] = [Duration::ZERO; 2];

fn start_model() -> Model {
    ModelConfig::new(10, 32)
        .with_dropout(0.0)
        .init(&Device::flex().autodiff())
}

/// Rank 1's third batch fails. Both stop at the same step (neither waits for the other, neither
/// gets a mismatch), with the same parameters; rank 1 reports the data set's error, rank 0 that
/// another rank stopped.
#[test]
fn a_batch_that_fails_on_one_rank_stops_both_at_the_same_step() {
    // Rank 1's share is items 32..64, in batches of 8: its third batch holds item 52.
    let ended = burn_train_on_two_ranks(
        &start_model(),
        64,
        2,
        None,
        [None, Some(52)],
        [None; 2],
        FAST,
    );
    assert_eq!(
        (ended[0].steps, ended[1].steps),
        (2, 2),
        "the two steps before the failure"
    );
    assert_eq!(ended[0].error, None, "rank 0 stops cleanly");
    assert_eq!(
        ended[0].reason.as_deref(),
        Some("another rank of the job stopped its training")
    );
    let error = ended[1].error.as_deref().unwrap_or("no error");
    assert!(error.contains("item 52 is unreadable"), "rank 1: {error}");
    assert_eq!(
        sorted(&ended[0].params),
        sorted(&ended[1].params),
        "the replicas differ"
    );
}

/// Rank 0's validation fails after the first epoch: rank 1, which validates nothing, stops at
/// the same epoch's end and says why.
#[test]
fn a_validation_that_fails_on_rank_0_stops_both_after_that_epoch() {
    let ended = burn_train_on_two_ranks(
        &start_model(),
        64,
        3,
        None,
        [None; 2],
        [Some(3), None],
        FAST,
    );
    assert_eq!(
        (ended[0].steps, ended[1].steps),
        (4, 4),
        "one epoch of 4 steps each"
    );
    let error = ended[0].error.as_deref().unwrap_or("no error");
    assert!(error.contains("item 3 is unreadable"), "rank 0: {error}");
    assert_eq!(ended[1].error, None);
    assert_eq!(
        ended[1].reason.as_deref(),
        Some("another rank of the job stopped its training")
    );
}

/// With `grads_accumulation(3)` over 5 batches per rank (steps after batches 3 and 5), the two
/// ranks end where one device ends that sums the gradients of the same union batches.
#[test]
fn accumulation_on_two_ranks_equals_one_device() {
    let start = start_model();
    let ended = burn_train_on_two_ranks(&start, 80, 1, Some(3), [None; 2], [None; 2], FAST);
    assert_eq!((ended[0].steps, ended[1].steps), (2, 2));

    let device = Device::flex().autodiff();
    let images = ImageSet::embedded(Split::Train, Shard::whole().limit(80)).unwrap();
    let batcher = MnistBatcher(Arc::new(images));
    let mut single = start;
    let mut optim = AdamConfig::new().init();
    for group in [0..3, 3..5] {
        let mut sum = burn::optim::GradientsAccumulator::new();
        for b in group {
            // Batch b of each rank: items 8b.. of the first half and 40 + 8b.. of the second.
            let union: Vec<usize> = (8 * b..8 * b + 8)
                .chain(40 + 8 * b..40 + 8 * b + 8)
                .collect();
            sum.accumulate(&single, gradients(&single, &batcher, &union, &device));
        }
        single = optim.step(1e-3, single, sum.grads());
    }
    let diff = max_diff(&ended[0].params, &params(&single));
    assert!(
        diff <= TOLERANCE,
        "two ranks differ from one device by {diff}"
    );
    assert_eq!(
        sorted(&ended[0].params),
        sorted(&ended[1].params),
        "the replicas differ"
    );
}

/// Rank 1 makes its batches 60 ms slower: every epoch names it on both ranks, as the Burn 0.21
/// jobs would, and rank 0's time went to waiting for it.
#[test]
fn a_rank_with_slow_batches_is_named_a_straggler_on_every_rank() {
    let slow = [Duration::ZERO, Duration::from_millis(60)];
    let ended = burn_train_on_two_ranks(&start_model(), 64, 2, None, [None; 2], [None; 2], slow);
    for (rank, e) in ended.iter().enumerate() {
        let line = e.stragglers.as_deref().unwrap_or("no report");
        assert!(
            line.starts_with("stragglers      rank 1 in epochs 1, 2 (input;"),
            "rank {rank}: {line}"
        );
    }
    // Rank 0 spent the difference waiting: 4 steps of 60 ms each epoch.
    for (epoch, times) in &ended[0].times {
        assert!(times[0].wait > 0.15, "epoch {epoch}: {times:?}");
    }
    // Both slow alike (epochs long enough for the rule to judge): nobody is named.
    let both = [Duration::from_millis(60); 2];
    let ended = burn_train_on_two_ranks(&start_model(), 64, 1, None, [None; 2], [None; 2], both);
    let line = ended[0].stragglers.as_deref().unwrap_or("no report");
    assert!(line.starts_with("stragglers      none"), "{line}");
}
