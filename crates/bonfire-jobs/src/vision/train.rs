//! One rank of the vision job: data loading, the training loop, evaluation, and rank 0's
//! checkpoint, plots and lines after each epoch.

use std::path::PathBuf;
use std::time::Instant;

use bonfire::{DataParallel, Hybrid, ZeroStage};
use bonfire_datasets::{ImageSet, Shard, Split};
use bonfire_models::{ResNet, ResNetConfig};
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{Adam, AdamConfig, GradientsParams};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use super::{EpochRecord, Vision, VisionReport, VisionState, output};
use crate::JobError;
use crate::checkpoint::{self, State};
use crate::data::{param_digest, shuffled};
use crate::optim::{JobOptimizer, ShardIo, model_memory, served_record};
use crate::progress::StepProgress;
use crate::rank::PerRank;
use crate::rank::RankContext;
use crate::report::{Say, Throughput};
use crate::settings::Settings;
use crate::stragglers::{EpochTimer, RankTimes, StepSplit};
use crate::strategy::{merge_served, served_lines};
use crate::strategy::{optimizer_file, optimizer_part};

use super::VisionConfig;

type Rec = BinBytesRecorder<FullPrecisionSettings>;
/// The job's optimizer: Adam over the ResNet, whole on every rank or sharded (`--zero`).
type Optim<A> = JobOptimizer<Adam, ResNet<A>, A>;

/// Points on the training-loss curve per epoch.
const CURVE_POINTS: usize = 20;
/// Test images evaluated at once.
const EVAL_BATCH: usize = 500;

/// Trains on backend `B`: under `DataParallel`, or with ZeRO stage 3 under `Hybrid` (the
/// parameters sharded over the replicas, through a communicator of its own that
/// `fully_shard` makes).
pub(super) fn run<B: Backend>(
    ctx: &mut RankContext<'_, Vision>,
    device: B::Device,
) -> Result<(VisionState, VisionReport), JobError> {
    let strategy = ctx.settings().config.strategy;
    if ctx.settings().zero_stage() == Some(ZeroStage::Three) {
        // Checkpoints per rank.
        type H<X> = Autodiff<Hybrid<X>>;
        let io = ShardIo {
            save: bonfire::save_sharded_checkpoint::<H<B>, ResNet<H<B>>, Adam>,
            load: bonfire::load_sharded_checkpoint::<H<B>, ResNet<H<B>>, Adam>,
        };
        let prefetch = ctx.settings().prefetch;
        let layout = |model| crate::optim::fully_shard(model, prefetch);
        run_on::<H<B>>(ctx, device, &layout, Some(&io))
    } else {
        let layout = |model| Ok(strategy.start(model));
        run_on::<Autodiff<DataParallel<B>>>(ctx, device, &layout, None)
    }
}

/// How a rank lays out the whole model it built or loaded over the job: replicated (or, for a
/// local strategy or parameter servers, started from rank 0's parameters and ids, unmarked),
/// or sharded (ZeRO-3).
type Layout<'a, A> = dyn Fn(ResNet<A>) -> Result<ResNet<A>, JobError> + 'a;

/// Trains on autodiff backend `A`, with the model laid out by `layout`; a ZeRO-3 run writes
/// and reads per-rank checkpoints through `shards`.
fn run_on<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, Vision>,
    device: A::Device,
    layout: &Layout<'_, A>,
    shards: Option<&ShardIo<Adam, ResNet<A>, A>>,
) -> Result<(VisionState, VisionReport), JobError> {
    let s = ctx.settings().clone();
    let c = &s.config;
    let (rank, size) = (ctx.rank(), ctx.world_size());
    // Under parameter servers the last ranks serve and train on nothing.
    let workers = size - c.strategy.servers().unwrap_or(0);
    let serving = rank >= workers;
    let (train, mut test) = load_data(&s, rank, size, workers)?;
    if ctx.is_main() {
        ctx.say(Say::Start, &output::start_line(&s, &train, &test, workers));
    }
    A::seed(&device, c.seed);
    let model: ResNet<A> = ResNetConfig::new().with_width(c.width).init(&device);
    let optim = c.strategy.optimizer(
        AdamConfig::new().init::<A, ResNet<A>>(),
        c.bf16,
        s.zero_stage(),
    );
    let mut state = State::new(c.clone(), s.epochs);
    let (model, optim, per_rank) = resume(ctx, model, optim, &mut state, &device, shards)?;
    // Under ZeRO-3 a resumed whole state is then sharded as the parameters are, and a per-rank
    // checkpoint is read into the sharded model, each rank its slices.
    let mut model = layout(model)?;
    let mut optim = optim.shard_state(&model);
    if let (Some(dir), Some(io)) = (per_rank, shards) {
        (model, optim) = optim.load_shards(io, &dir, model)?;
    }
    // What the fully sharded group gathered while training (not evaluating).
    let mut train_gathers = bonfire::backend::tensor_parallel::TpStats::default();
    let started = Instant::now();
    let mut split = StepSplit::default();
    let mut throughput = Throughput {
        ranks: workers,
        ..Throughput::default()
    };
    let mut served: Option<bonfire::PsReport> = None;
    for epoch in state.epochs_done..s.epochs {
        let t0 = Instant::now();
        let gathers_before = bonfire::backend::tensor_parallel::stats();
        let trained;
        (model, trained) = if serving {
            // A server's epoch: the workers' pushes until every worker is done with it.
            let (m, report) = optim.serve(model);
            if let Some(r) = report {
                served = Some(merge_served(served.take(), r));
            }
            let trained = Trained {
                loss_sum: 0.0,
                correct: 0,
                seen: 0,
                curve: Vec::new(),
                times: crate::stragglers::serving_times(t0),
                split: StepSplit::default(),
            };
            (m, trained)
        } else {
            train_epoch(
                ctx,
                model,
                &mut optim,
                &train,
                epoch,
                split.batches,
                &device,
            )?
        };
        if let (Some(before), Some(after)) =
            (gathers_before, bonfire::backend::tensor_parallel::stats())
        {
            train_gathers.add(&after.since(&before));
        }
        // A local strategy's replicas agree on one model before it is tested and saved; a
        // parameter servers' worker takes the servers' final parameters.
        model = optim.meet(model);
        // Workers asynchronous parameter servers dropped are gone for good: the ranks left go on
        // without them, and share the test set among themselves.
        if ctx.go_on_without(optim.departed())? {
            let left = ctx.comm();
            test = load_test(&s, left.rank(), left.size())?;
        }
        if c.pool_bn_stats {
            model = pool_running_statistics(ctx, model, &device)?;
        }
        let train_secs = t0.elapsed().as_secs_f64();
        let ranks = ctx.epoch_times(trained.times, workers)?;
        // The steady rate of the workers left (those the servers dropped train no more).
        throughput.add_steady(&trained.split, workers - ctx.gone().len());
        split += trained.split;
        let totals = ctx.sum(
            vec![
                trained.loss_sum,
                trained.correct as f64,
                trained.seen as f64,
            ],
            "summing the epoch's training loss",
        )?;
        throughput.trained(totals[2] as usize, train_secs, workers - ctx.gone().len());
        let t = evaluate(ctx, &model, &test, &device)?;
        state.history.push(EpochRecord {
            epoch: epoch + 1,
            train_loss: totals[0] / totals[2],
            train_accuracy: totals[1] / totals[2],
            test_loss: t[0] / t[2],
            test_accuracy: t[1] / t[2],
            test_correct: t[1] as u64,
            test_images: t[2] as u64,
            images_per_second: totals[2] / train_secs,
            seconds: t0.elapsed().as_secs_f64(),
            curve: trained.curve,
            param_digest: param_digest(&model),
            ranks,
            gone: ctx.gone().to_vec(),
        });
        state.epochs_done = epoch + 1;
        record_epoch(ctx, &state, &model, &optim, &device, shards)?;
        ctx.say_stragglers();
    }
    throughput.wall = started.elapsed();
    let memory = model_memory(ctx, &model, &optim)?;
    let servers = served_lines(
        ctx,
        serving,
        served.as_ref(),
        optim.as_served().map(|o| o.stats()),
    )?;
    let fully_sharded = (s.zero_stage() == Some(ZeroStage::Three))
        .then(bonfire::backend::tensor_parallel::stats)
        .flatten()
        .map(|all| (all, train_gathers));
    let report = VisionReport {
        memory,
        split,
        throughput,
        stats: bonfire::total_stats(),
        fully_sharded,
        outer: optim.outer_stats().map(|stats| (c.strategy, stats)),
        servers,
        checkpoint_dir: s.checkpoint_dir.clone(),
    };
    if ctx.is_main() {
        for line in output::report_lines(&state, &report, ctx.rank()) {
            ctx.say(Say::Report, &line);
        }
    }
    Ok((state, report))
}

/// `model` with every batch norm's running statistics pooled over the ranks (a collective): the
/// mean of the ranks' means, and the variance of the union of their images as the ranks'
/// statistics describe it, `mean(var_r + mean_r^2) - mean^2`, computed in f64. Every rank ends
/// with the same statistics.
fn pool_running_statistics<A: AutodiffBackend>(
    ctx: &RankContext<'_, Vision>,
    model: ResNet<A>,
    device: &A::Device,
) -> Result<ResNet<A>, JobError> {
    let stats = model.running_statistics();
    let values = |t: &Tensor<A, 1>| -> Vec<f64> {
        t.to_data()
            .convert::<f32>()
            .iter::<f32>()
            .map(f64::from)
            .collect()
    };
    let moments: Vec<f64> = stats
        .iter()
        .flat_map(|(mean, var)| moments(&values(mean), &values(var)))
        .collect();
    let all = ctx.sum(moments, "pooling the batch norms' running statistics")?;
    let mut at = 0;
    let mut pooled = Vec::with_capacity(stats.len());
    for (mean, _) in &stats {
        let n = mean.dims()[0];
        let (m, v) = pooled_statistics(&all[at..at + 2 * n], ctx.comm().size());
        pooled.push((
            Tensor::from_data(TensorData::new(m, [n]), device),
            Tensor::from_data(TensorData::new(v, [n]), device),
        ));
        at += 2 * n;
    }
    Ok(model.with_running_statistics(pooled))
}

/// One batch norm's statistics on one rank as the moments the ranks sum: its means, then its
/// second moments `var + mean^2`.
fn moments(mean: &[f64], var: &[f64]) -> Vec<f64> {
    let second = mean.iter().zip(var).map(|(m, v)| v + m * m);
    mean.iter().copied().chain(second).collect()
}

/// The mean and variance of the union of `ranks` ranks' data from the sum of their
/// [`moments`] (n means, then n second moments).
fn pooled_statistics(sums: &[f64], ranks: usize) -> (Vec<f32>, Vec<f32>) {
    let (first, second) = sums.split_at(sums.len() / 2);
    let r = ranks as f64;
    let mean: Vec<f64> = first.iter().map(|s| s / r).collect();
    let var = mean
        .iter()
        .zip(second)
        .map(|(m, s)| (s / r - m * m).max(0.0) as f32)
        .collect();
    (mean.iter().map(|&m| m as f32).collect(), var)
}

/// The training and test shards of this rank: equal shards of the training images (every rank
/// runs the same number of steps; under `--non-iid` of the images sorted by label), balanced
/// shards of the test images (every one counts once).
///
/// Under parameter servers only the first `workers` ranks train (a server loads one training
/// image and trains on none); every rank evaluates its test shard.
fn load_data(
    s: &Settings<VisionConfig>,
    rank: usize,
    world: usize,
    workers: usize,
) -> Result<(ImageSet, ImageSet), JobError> {
    let c = &s.config;
    let limit = |shard: Shard, n: Option<usize>| match n {
        Some(n) => shard.limit(n),
        None => shard,
    };
    let train_shard = if rank < workers {
        let shard = limit(Shard::equal(rank, workers), c.train_limit);
        if c.non_iid { shard.by_label() } else { shard }
    } else {
        // A server trains on nothing; it loads one image (a shard cannot be empty).
        Shard::whole().limit(1)
    };
    let train = match c.dataset.fetched() {
        None => ImageSet::embedded(Split::Train, train_shard),
        Some(set) => ImageSet::load(set, Split::Train, &s.data_dir, train_shard),
    };
    Ok((train?, load_test(s, rank, world)?))
}

/// Share `at` of `of` of the test set (within `--test-limit`).
fn load_test(s: &Settings<VisionConfig>, at: usize, of: usize) -> Result<ImageSet, JobError> {
    let c = &s.config;
    let mut shard = Shard::balanced(at, of);
    if let Some(n) = c.test_limit {
        shard = shard.limit(n);
    }
    Ok(match c.dataset.fetched() {
        None => ImageSet::embedded(Split::Test, shard),
        Some(set) => ImageSet::load(set, Split::Test, &s.data_dir, shard),
    }?)
}

/// A resumed model, its optimizer, and the per-rank checkpoint left to read once the model is
/// sharded (ZeRO-3).
type Resumed<A> = (ResNet<A>, Optim<A>, Option<PathBuf>);

/// On a resumed run, the checkpoint's model, optimizer state and history; otherwise the fresh
/// ones unchanged.
fn resume<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, Vision>,
    model: ResNet<A>,
    optim: Optim<A>,
    state: &mut VisionState,
    device: &A::Device,
    shards: Option<&ShardIo<Adam, ResNet<A>, A>>,
) -> Result<Resumed<A>, JobError> {
    let Some(loaded) = ctx.resume_checkpoint()? else {
        return Ok((model, optim, None));
    };
    // A per-rank checkpoint (ZeRO-3): read once the model is sharded by a ZeRO-3 run, otherwise
    // put together whole here.
    let (model, optim, per_rank) = match loaded.shards.clone() {
        Some(dir) if shards.is_some() => (model, optim, Some(dir)),
        Some(dir) => {
            let (model, record) =
                bonfire::consolidate_sharded_checkpoint::<A, ResNet<A>, Adam>(&dir, model)?;
            let optim = optim.load_whole_record(record, &model);
            (model, optim, None)
        }
        None => {
            let (model, optim) = load_whole(ctx, model, optim, &loaded, device)?;
            (model, optim, None)
        }
    };
    state.history = loaded.state.history;
    state.epochs_done = loaded.state.epochs_done;
    let line = format!(
        "resuming from {} (epoch {} of {})",
        loaded.dir.display(),
        state.epochs_done,
        state.epochs
    );
    ctx.say(Say::Resume, &line);
    Ok((model, optim, per_rank))
}

/// The model and optimizer state of a checkpoint that holds them whole.
fn load_whole<A: AutodiffBackend>(
    ctx: &RankContext<'_, Vision>,
    model: ResNet<A>,
    optim: Optim<A>,
    loaded: &crate::job::JobCheckpoint<Vision>,
    device: &A::Device,
) -> Result<(ResNet<A>, Optim<A>), JobError> {
    let bad = |what: &'static str| {
        let dir = loaded.dir.clone();
        move |why| JobError::DamagedRecord { dir, what, why }
    };
    let model = checkpoint::load_model(model, &loaded.model, device, &loaded.dir)?;
    // Under a local strategy, this replica's own inner state and the outer state.
    let (bytes, outer) = optimizer_part(
        &loaded.optimizer,
        ctx.settings().config.strategy.is_local(),
        ctx.dp_group().rank(),
        ctx.dp_group().size(),
        &loaded.dir,
    )?;
    let optim = optim
        .load_whole_record(
            checkpoint::decode::<A, _>(&bytes, device).map_err(bad("optimizer state"))?,
            &model,
        )
        .load_outer_state(outer);
    Ok((model, optim))
}

/// What one rank's training in an epoch measured.
struct Trained {
    loss_sum: f64,
    correct: u64,
    seen: u64,
    curve: Vec<(f64, f64)>,
    times: RankTimes,
    split: StepSplit,
}

/// Trains one epoch on this rank's shard, in the epoch's order for this rank, after `before`
/// batches trained by this process.
fn train_epoch<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, Vision>,
    mut model: ResNet<A>,
    optim: &mut Optim<A>,
    train: &ImageSet,
    epoch: usize,
    before: u64,
    device: &A::Device,
) -> Result<(ResNet<A>, Trained), JobError> {
    let c = ctx.settings().config.clone();
    let (rank, epochs) = (ctx.rank(), ctx.settings().epochs);
    // The ranks that train: all but the parameter servers, and the workers they dropped.
    let size = ctx.world_size() - c.strategy.servers().unwrap_or(0) - ctx.gone().len();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let steps = train.len().div_ceil(c.batch);
    let lr = c.lr * c.lr_decay.powi(epoch as i32);
    let order = shuffled(train.len(), c.seed, epoch, rank);
    let t0 = Instant::now();
    let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0u64, 0u64);
    let (mut stretch_sum, mut stretch_n) = (0.0f64, 0usize);
    let mut curve = Vec::new();
    let mut timer = EpochTimer::start_after(before);
    for (i, idx) in order.chunks(c.batch).enumerate() {
        let (x, y) = train.batch::<A>(idx, device);
        timer.input_done();
        let logits = model.forward(x);
        let hits = hits(logits.clone().detach(), y.clone());
        let loss = loss_fn.forward(logits, y);
        let l: f64 = loss.clone().into_scalar().elem();
        timer.forward_done();
        let grads = loss.backward();
        timer.backward_done();
        let grads = GradientsParams::from_grads(grads, &model);
        model = optim.step(lr, model, grads);
        timer.step_done(idx.len() as u64);
        loss_sum += l * idx.len() as f64;
        correct += hits as u64;
        seen += idx.len() as u64;
        stretch_sum += l;
        stretch_n += 1;
        if (i + 1) * CURVE_POINTS / steps != i * CURVE_POINTS / steps || i + 1 == steps {
            curve.push((
                epoch as f64 + (i + 1) as f64 / steps as f64,
                stretch_sum / stretch_n as f64,
            ));
            (stretch_sum, stretch_n) = (0.0, 0);
        }
        if ctx.is_main() {
            let elapsed = t0.elapsed();
            ctx.step(&StepProgress {
                round: "epoch",
                epoch: epoch + 1,
                epochs,
                step: i + 1,
                steps,
                loss: loss_sum / seen as f64,
                accuracy: Some(correct as f64 / seen as f64),
                rate: (seen as usize * size) as f64 / elapsed.as_secs_f64(),
                unit: "images",
                elapsed,
                straggler: ctx.straggler(),
            });
        }
    }
    let trained = Trained {
        loss_sum,
        correct,
        seen,
        curve,
        times: timer.times(),
        split: timer.split(),
    };
    Ok((model, trained))
}

/// Images of a batch classified right.
fn hits<B: Backend>(logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> i64 {
    logits
        .argmax(1)
        .flatten::<1>(0, 1)
        .equal(labels)
        .int()
        .sum()
        .into_scalar()
        .elem()
}

/// Rank 0's model (its batch-norm statistics) evaluated on every rank's test shard: the summed
/// test loss, images right and images, over all ranks.
///
/// Under ZeRO-3 no rank holds the whole model: each takes rank 0's running statistics only (the
/// parameters are the same on every rank) and evaluates its own sharded model, which gathers each
/// parameter where a layer reads it and frees it after (gathered ahead in the evaluation's own
/// order, `bonfire::forward_only`). Those gathers
/// are collectives, so every rank runs as many forwards as the rank with the most batches; a
/// rank with fewer runs one image for each it lacks and does not count it.
fn evaluate<A: AutodiffBackend>(
    ctx: &RankContext<'_, Vision>,
    model: &ResNet<A>,
    test: &ImageSet,
    device: &A::Device,
) -> Result<Vec<f64>, JobError> {
    let all: Vec<usize> = (0..test.len()).collect();
    let mut batches: Vec<Option<&[usize]>> = all.chunks(EVAL_BATCH).map(Some).collect();
    let valid = if sharded_at_rest(ctx) {
        let passes = most_of_any_rank(ctx, batches.len())?;
        batches.resize(passes, None);
        rank0_statistics(ctx, model.clone(), device)?.valid()
    } else {
        let during = "sharing rank 0's model for evaluation";
        ctx.rank0_module(model.valid(), device, during)?
    };
    let (mut test_loss, mut test_correct) = (0.0f64, 0.0f64);
    let eval_loss = CrossEntropyLossConfig::new().init(device);
    // A ZeRO-3 run's gathers ahead follow the evaluation's own forward pass, not training's
    // (whose backward an evaluation does not run).
    bonfire::forward_only(|| {
        for batch in batches {
            let Some(idx) = batch else {
                let (x, _) = test.batch::<A::InnerBackend>(&[0], device);
                let _ = valid.forward(x);
                continue;
            };
            let (x, y) = test.batch::<A::InnerBackend>(idx, device);
            let logits = valid.forward(x);
            let hits = hits(logits.clone(), y.clone());
            let l: f64 = eval_loss.forward(logits, y).into_scalar().elem();
            test_loss += l * idx.len() as f64;
            test_correct += hits as f64;
        }
    });
    ctx.sum(
        vec![test_loss, test_correct, test.len() as f64],
        "summing the test results",
    )
}

/// The largest of the ranks' `count`s (a collective).
fn most_of_any_rank(ctx: &RankContext<'_, Vision>, count: usize) -> Result<usize, JobError> {
    let most = ctx
        .comm()
        .all_reduce(vec![count as i64], bonfire::topology::ReduceOp::Max)
        .wait()
        .map_err(JobError::collective("agreeing on the evaluation's batches"))?;
    Ok(most[0] as usize)
}

/// `model` with rank 0's batch-norm running statistics (a broadcast of those alone).
fn rank0_statistics<A: AutodiffBackend>(
    ctx: &RankContext<'_, Vision>,
    model: ResNet<A>,
    device: &A::Device,
) -> Result<ResNet<A>, JobError> {
    let stats = model.running_statistics();
    let values: Vec<f32> = stats
        .iter()
        .flat_map(|(mean, var)| [mean, var])
        .flat_map(|t| {
            t.to_data()
                .convert::<f32>()
                .iter::<f32>()
                .collect::<Vec<_>>()
        })
        .collect();
    let values = ctx
        .comm()
        .broadcast(values, 0)
        .wait()
        .map_err(JobError::collective(
            "sharing rank 0's batch-norm statistics",
        ))?;
    let mut at = 0;
    let mut next = |n: usize| {
        let t = Tensor::from_data(TensorData::new(values[at..at + n].to_vec(), [n]), device);
        at += n;
        t
    };
    let rank0 = stats
        .iter()
        .map(|(mean, _)| {
            let n = mean.dims()[0];
            (next(n), next(n))
        })
        .collect();
    Ok(model.with_running_statistics(rank0))
}

/// Whether the parameters are sharded at rest (ZeRO-3): reading one whole, as encoding the model
/// does, is then a collective every rank runs.
fn sharded_at_rest(ctx: &RankContext<'_, Vision>) -> bool {
    ctx.settings().zero_stage() == Some(ZeroStage::Three)
}

/// Rank 0 writes the epoch's checkpoint and plots and says its line (a sharded optimizer first
/// gathers its state from every rank, and under ZeRO-3 the model its parameters).
fn record_epoch<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, Vision>,
    state: &VisionState,
    model: &ResNet<A>,
    optim: &Optim<A>,
    device: &A::Device,
    shards: Option<&ShardIo<Adam, ResNet<A>, A>>,
) -> Result<(), JobError> {
    if let Some(io) = shards {
        match ctx.save_per_rank(state, |dir| optim.save_shards(io, dir, model))? {
            PerRank::Saved(dir) => return after_save(ctx, state, dir),
            PerRank::NotShared { blind } => ctx.say_not_shared(&blind),
        }
    }
    let recorder = Rec::default();
    let encode = |what: &'static str| move |source| JobError::EncodeRecord { what, source };
    let model_bytes = || {
        recorder
            .record(model.clone().into_record(), ())
            .map_err(encode("model"))
    };
    let gathered = match sharded_at_rest(ctx) {
        true => Some(model_bytes()?),
        false => None,
    };
    // Gathering a sharded optimizer's state is a collective; encoding it is rank 0's work,
    // but under a local strategy every replica encodes and sends its own, and under parameter
    // servers every server its share.
    let whole = optim.whole_record(device);
    let whole = match optim.as_served() {
        Some(_) => served_record::<Adam, ResNet<A>, A>(ctx.dp_group(), whole, device)?,
        None => whole,
    };
    let local = match optim.as_local() {
        Some(o) => {
            let mine = recorder
                .record(whole, ())
                .map_err(encode("optimizer state"))?;
            let file = optimizer_file(ctx.dp_group(), Some(o.outer_state()), mine)?;
            Err(file)
        }
        None => Ok(whole),
    };
    let saved = ctx.save_checkpoint(
        state,
        || match gathered {
            Some(bytes) => Ok(bytes),
            None => model_bytes(),
        },
        || match local {
            Ok(whole) => recorder
                .record(whole, ())
                .map_err(encode("optimizer state")),
            Err(file) => Ok(file),
        },
    )?;
    after_save(ctx, state, saved)
}

/// After a checkpoint is saved (`dir` on rank 0), rank 0 writes the plots and says the epoch's
/// line.
fn after_save(
    ctx: &mut RankContext<'_, Vision>,
    state: &VisionState,
    dir: Option<PathBuf>,
) -> Result<(), JobError> {
    let Some(dir) = dir else {
        return Ok(());
    };
    let root = &ctx.settings().checkpoint_dir;
    output::write_plots(root, state, ctx.settings().log_loss).map_err(|source| {
        JobError::Plots {
            dir: root.clone(),
            source,
        }
    })?;
    let r = state.history.last().expect("just recorded");
    let line = output::epoch_line(r, ctx.settings().epochs, &dir);
    ctx.say(Say::Epoch, &line);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{moments, pooled_statistics};

    /// Two ranks' statistics of two halves of a data set pool into the whole set's.
    #[test]
    fn pooled_statistics_are_the_unions() {
        let stats = |xs: &[f64]| {
            let n = xs.len() as f64;
            let mean = xs.iter().sum::<f64>() / n;
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
            (mean, var)
        };
        let (a, b) = ([1.0, 2.0, 3.0, 6.0], [10.0, 12.0, 8.0, 14.0]);
        let whole: Vec<f64> = a.iter().chain(&b).copied().collect();
        let ((ma, va), (mb, vb), (m, v)) = (stats(&a), stats(&b), stats(&whole));
        let sums: Vec<f64> = moments(&[ma, 0.5], &[va, 2.0])
            .iter()
            .zip(moments(&[mb, 1.5], &[vb, 4.0]))
            .map(|(x, y)| x + y)
            .collect();
        let (mean, var) = pooled_statistics(&sums, 2);
        assert!((f64::from(mean[0]) - m).abs() < 1e-5 && (f64::from(var[0]) - v).abs() < 1e-4);
        // Means 0.5 and 1.5, variances 2 and 4: their mean, 3, plus the means' spread, 0.25.
        assert_eq!((mean[1], var[1]), (1.0, 3.25));
    }
}
