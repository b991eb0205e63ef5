//! One rank of the GPT job: its replica's shard of the training windows, the training loop
//! (micro-batches, gradient accumulation, the learning-rate schedule), the validation loss over
//! every replica's part of the validation windows, and rank 0's sample, checkpoint, plot and
//! lines after each round.
//!
//! Data-parallel only, a rank trains on `Autodiff<DataParallel<B>>`. With `tp` > 1 it trains on
//! `Autodiff<Hybrid<B>>`: the model is split by the GPT plan over the rank's tensor-parallel
//! group, whose ranks train on the same batches (their replica's), and replicas average
//! gradients shard by shard. Whatever reads a whole tensor (a loss, a sample, a digest, a
//! checkpoint) then gathers over the group, so every rank runs it.

use std::path::PathBuf;
use std::time::Instant;

use bonfire::{DataParallel, Hybrid, InOrder, ZeroStage};
use bonfire_datasets::text::{CharCorpus, Windows};
use bonfire_datasets::{RankShard, Sharding};
use bonfire_models::{Gpt, GptStage, Sampling};
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::optim::{Adam, AdamConfig, GradientsAccumulator, GradientsParams};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use super::{EvalRecord, GptJob, GptReport, GptRunConfig, GptState, VAL_FRACTION, output};
use crate::JobError;
use crate::checkpoint::{self, State};
use crate::data::{mix64, param_digest};
use crate::optim::{JobOptimizer, ShardIo, model_memory, served_record};
use crate::progress::StepProgress;
use crate::rank::PerRank;
use crate::rank::RankContext;
use crate::report::{Say, Throughput};
use crate::stragglers::{EpochTimer, RankTimes, StepSplit};
use crate::strategy::{merge_served, optimizer_file, optimizer_part, served_lines};

pub(super) type Rec = BinBytesRecorder<FullPrecisionSettings>;
/// The job's optimizer: Adam over the GPT, whole on every rank or sharded (`--zero 1`).
type Optim<A> = JobOptimizer<Adam, Gpt<A>, A>;

/// Points on the training-loss curve per round.
const CURVE_POINTS: usize = 10;
/// Validation windows evaluated at once.
const EVAL_BATCH: usize = 64;

/// Trains on backend `B`: under `DataParallel`, or with `tp` > 1 or ZeRO stage 3 under
/// `Hybrid`.
pub(super) fn run<B: Backend>(
    ctx: &mut RankContext<'_, GptJob>,
    device: B::Device,
) -> Result<(GptState, GptReport), JobError> {
    let strategy = ctx.settings().config.strategy;
    if ctx.settings().config.pp > 1 && ctx.settings().config.tp > 1 {
        // Each stage split over its tensor-parallel group by the model's plan.
        let group = ctx.world().tp_group().clone();
        let layout = move |stage: GptStage<_>| {
            let embedding = stage.is_first() || stage.tied_embedding().is_some();
            let plan = super::plan::stage_plan(embedding);
            Ok(bonfire::tensor_parallel(stage, &plan, &group)?)
        };
        super::pipeline::run::<Autodiff<Hybrid<B>>>(ctx, device, &layout)
    } else if ctx.settings().config.pp > 1 {
        super::pipeline::run::<Autodiff<DataParallel<B>>>(ctx, device, &|stage| Ok(stage))
    } else if ctx.settings().config.tp > 1 {
        let group = ctx.world().tp_group().clone();
        let layout = move |model| {
            let split = bonfire::tensor_parallel(model, &super::plan(), &group)?;
            Ok(strategy.start(split))
        };
        run_on::<Autodiff<Hybrid<B>>>(ctx, device, &layout, None)
    } else if ctx.settings().zero_stage() == Some(ZeroStage::Three) {
        // Sharded over the replicas, through a communicator of its own that `fully_shard` makes;
        // checkpoints per rank.
        type H<X> = Autodiff<Hybrid<X>>;
        let io = ShardIo {
            save: bonfire::save_sharded_checkpoint::<H<B>, Gpt<H<B>>, Adam>,
            load: bonfire::load_sharded_checkpoint::<H<B>, Gpt<H<B>>, Adam>,
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
/// local strategy or parameter servers, started from rank 0's parameters), split by the plan,
/// or sharded (ZeRO-3).
type Layout<'a, A> = dyn Fn(Gpt<A>) -> Result<Gpt<A>, JobError> + 'a;

/// Trains on autodiff backend `A`, with the model laid out by `layout`; a ZeRO-3 run writes
/// and reads per-rank checkpoints through `shards`.
fn run_on<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    device: A::Device,
    layout: &Layout<'_, A>,
    shards: Option<&ShardIo<Adam, Gpt<A>, A>>,
) -> Result<(GptState, GptReport), JobError> {
    let s = ctx.settings().clone();
    let c = &s.config;
    // Under parameter servers the last ranks serve and train on nothing (a server takes the
    // first worker's shard, which it never reads).
    let (replica, replicas) = (ctx.world().dp_group().rank(), c.workers());
    let serving = replica >= replicas;
    let text = c.dataset.text(&s.data_dir)?;
    let corpus = CharCorpus::with_vocab(c.vocab(), &text, VAL_FRACTION)?;
    drop(text);
    let train = corpus.train_windows(c.context, 1)?;
    let shard = train.shard(if serving { 0 } else { replica }, replicas)?;
    let val = corpus.val_windows(c.context, c.context)?;
    A::seed(&device, c.seed);
    let model: Gpt<A> = c.model().init(&device);
    if ctx.is_main() {
        let params = model.num_params();
        ctx.say(
            Say::Start,
            &output::start_line(&s, &corpus, params, shard.len(), replicas),
        );
    }
    let optim = c.strategy.optimizer(
        AdamConfig::new().with_beta_2(0.99).init::<A, Gpt<A>>(),
        c.bf16,
        s.zero_stage(),
    );
    let mut state = State::new(c.clone(), s.epochs);
    let (model, optim, per_rank) = resume(ctx, model, optim, &mut state, &device, shards)?;
    // A local strategy's replicas and parameter servers' ranks start from rank 0's parameters,
    // with its parameter ids (the keys of the optimizer state in the checkpoint), and average
    // nothing in backward. Under ZeRO-3 a resumed whole state is then sharded as the parameters
    // are, and a per-rank checkpoint is read into the sharded model, each rank its slices.
    let mut model = layout(model)?;
    let mut optim = optim.shard_state(&model);
    if let (Some(dir), Some(io)) = (per_rank, shards) {
        (model, optim) = optim.load_shards(io, &dir, model)?;
    }
    check_state_before(&s, &model, replicas)?;
    let started = Instant::now();
    let mut split = StepSplit::default();
    let mut throughput = Throughput {
        ranks: ctx.world_size() - c.strategy.servers().unwrap_or(0),
        ..Throughput::default()
    };
    // What the tensor-parallel decorator communicated while training (not evaluating).
    let mut train_tp = bonfire::backend::tensor_parallel::TpStats::default();
    let mut served: Option<bonfire::PsReport> = None;
    let mut saves = crate::report::Saves {
        ranks: ctx.world_size(),
        ..Default::default()
    };
    for round in state.epochs_done..s.epochs {
        let t0 = Instant::now();
        let tp_before = bonfire::backend::tensor_parallel::stats();
        let trained;
        (model, trained) = if serving {
            serve_round(ctx, model, &mut optim, &mut served, round)
        } else {
            train_round(
                ctx,
                model,
                &mut optim,
                &train,
                &shard,
                round,
                split.batches,
                &device,
            )?
        };
        if let (Some(before), Some(after)) = (tp_before, bonfire::backend::tensor_parallel::stats())
        {
            train_tp.add(&after.since(&before));
        }
        // A local strategy's replicas agree on one model before it is evaluated and saved; a
        // parameter servers' worker takes the servers' final parameters.
        model = optim.meet(model);
        // Workers asynchronous parameter servers dropped are gone for good: the ranks left go on
        // without them (and share the validation windows among themselves).
        ctx.go_on_without(optim.departed())?;
        // A server holds only its share up to date: it takes rank 0's parameters (the ids are
        // every rank's since the job began from rank 0's) before the model is evaluated, saved
        // and served again.
        if c.strategy.servers().is_some() {
            let during = "sharing the workers' parameters with the servers";
            model = ctx.rank0_module(model, &device, during)?;
        }
        let train_secs = t0.elapsed().as_secs_f64();
        let mut account = Account {
            throughput: &mut throughput,
            split: &mut split,
            t0,
            train_secs,
        };
        let record = evaluate(ctx, &mut account, &model, &val, round, trained, &device)?;
        state.history.push(record);
        state.epochs_done = round + 1;
        let saving = Instant::now();
        record_round(ctx, &state, &model, &optim, &device, shards)?;
        saves.count += 1;
        saves.secs += saving.elapsed().as_secs_f64();
        saves.rank = ctx.rank();
        ctx.say_stragglers();
    }
    throughput.wall = started.elapsed();
    // Under tensor parallelism a rank's parameters are parts, and the optimizer's state is
    // split as they are: data-parallel runs only (ZeRO-3 included: its shards are counted).
    let memory = if c.tp == 1 {
        Some(model_memory(ctx, &model, &optim)?)
    } else {
        None
    };
    let servers = served_lines(
        ctx,
        serving,
        served.as_ref(),
        optim.as_served().map(|o| o.stats()),
    )?;
    if let Ok(Some(dir)) = checkpoint::latest(&s.checkpoint_dir) {
        (saves.per_rank, saves.bytes) = crate::report::Saves::bytes_in(&dir);
    }
    let report = GptReport {
        memory,
        split,
        throughput,
        stats: bonfire::total_stats(),
        tp_stats: (c.tp > 1 || s.zero_stage() == Some(ZeroStage::Three))
            .then(bonfire::backend::tensor_parallel::stats)
            .flatten(),
        train_tp_stats: (s.zero_stage() == Some(ZeroStage::Three)).then_some(train_tp),
        pipeline: None,
        outer: optim.outer_stats().map(|stats| (c.strategy, stats)),
        servers,
        checkpoint_dir: s.checkpoint_dir.clone(),
        saves: Some(saves),
    };
    if ctx.is_main() {
        for line in output::report_lines(&state, &report, ctx.rank()) {
            ctx.say(Say::Report, &line);
        }
    }
    say_state_after(ctx, report.memory.as_ref());
    Ok((state, report))
}

const MIB: f64 = (1 << 20) as f64;

/// Under `--model-state-limit`, refuses to train a model of which a rank would hold more (every
/// rank decides alike, from the sizes it holds once the model is laid out).
fn check_state_before<A: AutodiffBackend>(
    s: &crate::settings::Settings<GptRunConfig>,
    model: &Gpt<A>,
    replicas: usize,
) -> Result<(), JobError> {
    let Some(limit) = s.model_state_limit_mib else {
        return Ok(());
    };
    let (p, g, o) = crate::optim::predicted_state(model, s.zero_stage(), replicas);
    let held = (p + g + o) as f64 / MIB;
    if held <= limit {
        return Ok(());
    }
    Err(JobError::ModelStateLimit {
        limit_mib: limit,
        what: "each rank would hold",
        held_mib: held,
        parts: format!(
            "parameters {:.2}, gradients {:.2}, Adam's state {:.2} MiB",
            p as f64 / MIB,
            g as f64 / MIB,
            o as f64 / MIB
        ),
    })
}

/// Under `--model-state-limit`, rank 0 says how much model state the rank with the most held
/// after training (as the report's `model state` line measures it: Adam's state as its encoded
/// record, a little over its tensors' bytes) against the limit.
fn say_state_after(ctx: &mut RankContext<'_, GptJob>, memory: Option<&crate::report::ModelMemory>) {
    let (Some(limit), Some(m)) = (ctx.settings().model_state_limit_mib, memory) else {
        return;
    };
    if ctx.is_main() {
        let held = m.per_rank() as f64 / MIB;
        let verdict = if held <= limit { "within" } else { "over" };
        let line = format!(
            "model state limit {limit} MiB per rank (checked before training): the rank with the \
             most held {held:.2} MiB after it, {verdict} the limit"
        );
        ctx.say(Say::Report, &line);
    }
}

/// A resumed model, its optimizer, and the per-rank checkpoint left to read once the model is
/// sharded (ZeRO-3).
type Resumed<A> = (Gpt<A>, Optim<A>, Option<PathBuf>);

/// On a resumed run, the checkpoint's model, optimizer state and history; otherwise the fresh
/// ones unchanged. A per-rank checkpoint is put together whole on each rank, or, for a ZeRO-3
/// run (`shards`), left to be read once the model is sharded: its directory is returned.
fn resume<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    model: Gpt<A>,
    optim: Optim<A>,
    state: &mut GptState,
    device: &A::Device,
    shards: Option<&ShardIo<Adam, Gpt<A>, A>>,
) -> Result<Resumed<A>, JobError> {
    let Some(loaded) = ctx.resume_checkpoint()? else {
        return Ok((model, optim, None));
    };
    if let Some(dir) = loaded.shards.clone() {
        if shards.is_some() {
            take_history(ctx, state, loaded);
            return Ok((model, optim, Some(dir)));
        }
        let (model, record) =
            bonfire::consolidate_sharded_checkpoint::<A, Gpt<A>, Adam>(&dir, model)?;
        let optim = optim.load_whole_record(record, &model);
        take_history(ctx, state, loaded);
        return Ok((model, optim, None));
    }
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
        ctx.settings().config.dp(),
        &loaded.dir,
    )?;
    let optim = optim
        .load_whole_record(
            checkpoint::decode::<A, InOrder<_>>(&bytes, device)
                .map_err(bad("optimizer state"))?
                .0
                .into_iter()
                .collect(),
            &model,
        )
        .load_outer_state(outer);
    take_history(ctx, state, loaded);
    Ok((model, optim, None))
}

/// A resumed run takes the checkpoint's history; rank 0 says where it resumes.
pub(super) fn take_history(
    ctx: &mut RankContext<'_, GptJob>,
    state: &mut GptState,
    loaded: crate::job::JobCheckpoint<GptJob>,
) {
    state.history = loaded.state.history;
    state.epochs_done = loaded.state.epochs_done;
    let step = state.history.last().map_or(0, |r| r.step);
    let line = format!(
        "resuming from {} (step {step} of {}, evaluation {} of {})",
        loaded.dir.display(),
        state.config.steps,
        state.epochs_done,
        state.epochs
    );
    ctx.say(Say::Resume, &line);
}

/// What one rank's training in a round measured.
pub(super) struct Trained {
    /// The sum of the round's micro-batch losses this rank counts, and their number.
    pub(super) loss_sum: f64,
    pub(super) batches: usize,
    /// Characters this replica trained on in the round.
    pub(super) tokens: usize,
    /// Optimizer steps done at the round's end.
    pub(super) last_step: usize,
    pub(super) curve: Vec<(f64, f64)>,
    pub(super) times: RankTimes,
    pub(super) split: StepSplit,
}

/// The run's running totals a round adds to, and the round's clock.
pub(super) struct Account<'a> {
    pub(super) throughput: &'a mut Throughput,
    pub(super) split: &'a mut StepSplit,
    /// When the round began, and its training's seconds.
    pub(super) t0: Instant,
    pub(super) train_secs: f64,
}

/// The record of round `round` once trained: every rank's times gathered, the throughput and
/// step split added to the run's, the training loss summed over the ranks that count it, the
/// validation loss, the sample and the digest of `model` (the whole model, on every rank; under
/// tensor parallelism its parts, which these gather). Every rank calls it.
pub(super) fn evaluate<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    account: &mut Account<'_>,
    model: &Gpt<A>,
    val: &Windows<'_>,
    round: usize,
    trained: Trained,
    device: &A::Device,
) -> Result<EvalRecord, JobError> {
    let c = ctx.settings().config.clone();
    // Parameter servers (the last ranks) train nothing: only the workers are compared, and
    // only those left count (the workers asynchronous servers dropped train no more).
    let replicas = c.workers() - ctx.gone().len();
    let trainers = ctx.world_size() - c.strategy.servers().unwrap_or(0);
    let ranks = ctx.epoch_times(trained.times, trainers)?;
    let ranks_left = account.throughput.ranks - ctx.gone().len();
    account
        .throughput
        .trained(trained.tokens * replicas, account.train_secs, ranks_left);
    account.throughput.add_steady(&trained.split, replicas);
    *account.split += trained.split;
    // The ranks of a tensor-parallel group count the same batches: the sums over all ranks are
    // `tp` times the replicas', which the means cancel. Of a pipeline, only the last stages
    // count them.
    let totals = ctx.sum(
        vec![trained.loss_sum, trained.batches as f64],
        "summing the round's training loss",
    )?;
    let v = validate(ctx, model, val, c.eval_windows, device)?;
    // Every rank draws the same sample (same seed, same gathered logits); rank 0 keeps it.
    // Under tensor parallelism the forward passes need every rank of the group.
    let sampling = Sampling {
        temperature: c.temperature,
        top_k: Some(c.top_k),
        seed: c.seed.wrapping_add(round as u64),
    };
    // Under ZeRO-3 each token's forward gathers ahead in the order of the validation's pass.
    let sample = bonfire::forward_only(|| generate(&model.valid(), &c, &sampling));
    Ok(EvalRecord {
        eval: round + 1,
        step: trained.last_step,
        train_loss: totals[0] / totals[1],
        val_loss: v[0] / v[1],
        tokens_per_second: (trained.tokens * replicas) as f64 / account.train_secs,
        seconds: account.t0.elapsed().as_secs_f64(),
        curve: trained.curve,
        sample,
        param_digest: param_digest(model),
        ranks,
        gone: ctx.gone().to_vec(),
    })
}

/// Micro-batch `micro` of step `step` of replica `replica`: windows of its `shard` of `train`
/// at the positions [`draw`] fixes.
#[allow(clippy::too_many_arguments)]
pub(super) fn micro_batch<B: Backend>(
    c: &GptRunConfig,
    train: &Windows<'_>,
    shard: &RankShard,
    step: usize,
    micro: usize,
    replica: usize,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let rows = (0..c.batch).map(|row| {
        let k = draw(c.seed, step, micro, replica, row) % shard.len() as u64;
        shard.position(k as usize)
    });
    batch::<B>(train, rows, device)
}

/// A draw fixed by (seed, step, micro-batch, rank, row): the windows a rank trains on are the
/// same in a resumed run as in an uninterrupted one.
fn draw(seed: u64, step: usize, micro: usize, rank: usize, row: usize) -> u64 {
    mix64(
        seed ^ (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ (micro as u64).wrapping_mul(0xd6e8_feb8_6659_fd93)
            ^ (rank as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
            ^ (row as u64).wrapping_mul(0x1656_67b1_9e37_79f9),
    )
}

/// Windows `idx` of `windows` as input and target tensors `[rows, context]`.
fn batch<B: Backend>(
    windows: &Windows<'_>,
    idx: impl Iterator<Item = usize>,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let (mut xs, mut ys, mut rows) = (Vec::new(), Vec::new(), 0);
    let mut context = 0;
    for i in idx {
        let (x, y) = windows.get(i);
        context = x.len();
        xs.extend(x.iter().map(|&t| i64::from(t)));
        ys.extend(y.iter().map(|&t| i64::from(t)));
        rows += 1;
    }
    let make =
        |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [rows, context]), device);
    (make(xs), make(ys))
}

/// Trains one round's steps, each on `grad_accum` micro-batches of windows drawn from this
/// rank's shard, after `before` micro-batches trained by this process.
#[allow(clippy::too_many_arguments)]
fn train_round<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    mut model: Gpt<A>,
    optim: &mut Optim<A>,
    train: &Windows<'_>,
    shard: &RankShard,
    round: usize,
    before: u64,
    device: &A::Device,
) -> Result<(Gpt<A>, Trained), JobError> {
    let c = ctx.settings().config.clone();
    // This replica's draws are its own as the job began, whoever is gone since.
    let (replica, rounds) = (ctx.world().dp_group().rank(), ctx.settings().epochs);
    let replicas = c.workers() - ctx.gone().len();
    let first = round * c.eval_every;
    let end = ((round + 1) * c.eval_every).min(c.steps);
    let steps = end - first;
    let mut log = RoundLog::new(round, rounds, steps, replicas);
    let (mut loss_sum, mut batches, mut tokens) = (0.0f64, 0usize, 0usize);
    let mut timer = EpochTimer::start_after(before);
    // Local strategies and parameter servers step on each replica's own gradients.
    let local = !c.strategy.is_all_reduce();
    let mut accumulated = GradientsAccumulator::new();
    for (i, step) in (first..end).enumerate() {
        let lr = c.lr_at(step);
        for micro in 0..c.grad_accum {
            let (x, y) = micro_batch::<A>(&c, train, shard, step, micro, replica, device);
            timer.input_done();
            let loss = model.loss(x, y);
            let l: f64 = loss.clone().into_scalar().elem();
            timer.forward_done();
            let loss = loss / c.grad_accum as f32;
            if local {
                // Each replica's own gradients, summed over its micro-batches.
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                timer.backward_done();
                accumulated.accumulate(&model, grads);
                if micro + 1 == c.grad_accum {
                    model = optim.step(lr, model, accumulated.grads());
                }
            } else if micro + 1 < c.grad_accum {
                model = bonfire::accumulate(model, loss);
                timer.backward_done();
            } else {
                let grads = loss.backward();
                timer.backward_done();
                let grads = GradientsParams::from_grads(grads, &model);
                model = optim.step(lr, model, grads);
            }
            timer.step_done((c.batch * c.context) as u64);
            loss_sum += l;
            batches += 1;
            tokens += c.batch * c.context;
            log.add(l);
        }
        log.step_done(ctx, i, step, tokens);
    }
    let trained = Trained {
        loss_sum,
        batches,
        tokens,
        last_step: end,
        curve: log.curve,
        times: timer.times(),
        split: timer.split(),
    };
    Ok((model, trained))
}

/// A parameter server's round: serves the workers until every one is done with the round (or,
/// asynchronous, gone), adding what it saw to `served`. It trains on nothing.
fn serve_round<A: AutodiffBackend>(
    ctx: &RankContext<'_, GptJob>,
    model: Gpt<A>,
    optim: &mut Optim<A>,
    served: &mut Option<bonfire::PsReport>,
    round: usize,
) -> (Gpt<A>, Trained) {
    let t0 = Instant::now();
    let (model, report) = optim.serve(model);
    if let Some(r) = report {
        *served = Some(merge_served(served.take(), r));
    }
    let c = &ctx.settings().config;
    let trained = Trained {
        loss_sum: 0.0,
        batches: 0,
        tokens: 0,
        last_step: ((round + 1) * c.eval_every).min(c.steps),
        curve: Vec::new(),
        times: crate::stragglers::serving_times(t0),
        split: StepSplit::default(),
    };
    (model, trained)
}

/// A round's running account for rank 0's progress line and the training-loss curve: the mean
/// of the losses added so far, and a point of the curve at each tenth of the round.
pub(super) struct RoundLog {
    t0: Instant,
    round: usize,
    rounds: usize,
    steps: usize,
    replicas: usize,
    sum: f64,
    n: usize,
    stretch_sum: f64,
    stretch_n: usize,
    /// (step, mean loss) over each stretch of the round.
    pub(super) curve: Vec<(f64, f64)>,
}

impl RoundLog {
    /// The account of round `round` (from 0) of `rounds`, of `steps` steps, over `replicas`.
    pub(super) fn new(round: usize, rounds: usize, steps: usize, replicas: usize) -> RoundLog {
        RoundLog {
            t0: Instant::now(),
            round,
            rounds,
            steps,
            replicas,
            sum: 0.0,
            n: 0,
            stretch_sum: 0.0,
            stretch_n: 0,
            curve: Vec::new(),
        }
    }

    /// A loss of the round (a micro-batch's, or a step's mean over equal micro-batches).
    pub(super) fn add(&mut self, loss: f64) {
        self.sum += loss;
        self.n += 1;
        self.stretch_sum += loss;
        self.stretch_n += 1;
    }

    /// Step `i` of the round (global step `step`) is done, `tokens` trained by this replica in
    /// the round so far: the curve's point when a stretch ends, and rank 0's progress line.
    pub(super) fn step_done(
        &mut self,
        ctx: &mut RankContext<'_, GptJob>,
        i: usize,
        step: usize,
        tokens: usize,
    ) {
        let steps = self.steps;
        if (i + 1) * CURVE_POINTS / steps != i * CURVE_POINTS / steps || i + 1 == steps {
            let mean = self.stretch_sum / self.stretch_n.max(1) as f64;
            self.curve.push(((step + 1) as f64, mean));
            (self.stretch_sum, self.stretch_n) = (0.0, 0);
        }
        if ctx.is_main() {
            let elapsed = self.t0.elapsed();
            ctx.step(&StepProgress {
                round: "eval",
                epoch: self.round + 1,
                epochs: self.rounds,
                step: i + 1,
                steps,
                loss: self.sum / self.n.max(1) as f64,
                accuracy: None,
                rate: (tokens * self.replicas) as f64 / elapsed.as_secs_f64(),
                unit: "chars",
                elapsed,
                straggler: ctx.straggler(),
            });
        }
    }
}

/// The validation loss over the first `n` validation windows, each replica evaluating its share
/// (the replicas are equal; the ranks of a tensor-parallel group evaluate theirs together):
/// summed loss and windows, over all ranks.
fn validate<A: AutodiffBackend>(
    ctx: &RankContext<'_, GptJob>,
    model: &Gpt<A>,
    val: &Windows<'_>,
    n: usize,
    device: &A::Device,
) -> Result<Vec<f64>, JobError> {
    let n = n.min(val.len());
    let dp = ctx.dp_group();
    let mine = Sharding::Balanced.shard(dp.rank(), dp.size(), n)?;
    let valid = model.valid();
    let idx: Vec<usize> = mine.positions().collect();
    let mut sum = 0.0f64;
    if ctx.settings().zero_stage() == Some(bonfire::ZeroStage::Three) {
        // Every forward gathers the parameters over the replicas, so every rank runs as many:
        // the largest shard's count of batches, each rank's windows spread over them (a rank
        // with none left runs one window and does not count it). The gathers ahead follow the
        // validation's own forward pass, not training's (whose backward it does not run).
        let passes = n.div_ceil(dp.size()).div_ceil(EVAL_BATCH).max(1);
        let size = idx.len().div_ceil(passes).max(1);
        bonfire::forward_only(|| {
            for p in 0..passes {
                let chunk = idx
                    .get(p * size..idx.len().min((p + 1) * size))
                    .unwrap_or(&[]);
                let counted = !chunk.is_empty();
                let windows = if counted { chunk } else { &[0][..] };
                let (x, y) = batch::<A::InnerBackend>(val, windows.iter().copied(), device);
                let l: f64 = valid.loss(x, y).into_scalar().elem();
                if counted {
                    sum += l * chunk.len() as f64;
                }
            }
        });
    } else {
        for chunk in idx.chunks(EVAL_BATCH) {
            let (x, y) = batch::<A::InnerBackend>(val, chunk.iter().copied(), device);
            let l: f64 = valid.loss(x, y).into_scalar().elem();
            sum += l * chunk.len() as f64;
        }
    }
    ctx.sum(vec![sum, idx.len() as f64], "summing the validation loss")
}

/// `c.sample_chars` characters generated after a newline (or the vocabulary's first character).
fn generate<B: Backend>(model: &Gpt<B>, c: &GptRunConfig, sampling: &Sampling) -> String {
    let vocab = c.vocab();
    let start = vocab.id('\n').unwrap_or(0);
    let ids = model.generate_within(&[start], c.sample_chars, sampling, vocab.len());
    vocab.decode(&ids[1..])
}

/// Every rank encodes the round's records (under tensor parallelism that gathers the whole
/// tensors over the group; a sharded optimizer gathers its state from every rank); rank 0
/// writes the checkpoint and the plot and says its lines.
fn record_round<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    state: &GptState,
    model: &Gpt<A>,
    optim: &Optim<A>,
    device: &A::Device,
    shards: Option<&ShardIo<Adam, Gpt<A>, A>>,
) -> Result<(), JobError> {
    if let Some(io) = shards {
        match ctx.save_per_rank(state, |dir| optim.save_shards(io, dir, model))? {
            PerRank::Saved(dir) => return after_save(ctx, state, dir),
            PerRank::NotShared { blind } => ctx.say_not_shared(&blind),
        }
    }
    let recorder = Rec::default();
    let encode = |what: &'static str| move |source| JobError::EncodeRecord { what, source };
    let model_bytes = recorder
        .record(model.clone().into_record(), ())
        .map_err(encode("model"))?;
    // Under parameter servers the servers' shares, gathered to rank 0.
    let whole = optim.whole_record(device);
    let whole = match optim.as_served() {
        Some(_) => served_record::<Adam, Gpt<A>, A>(ctx.dp_group(), whole, device)?,
        None => whole,
    };
    let optim_bytes = recorder
        .record(InOrder::new(whole, model), ())
        .map_err(encode("optimizer state"))?;
    // A local strategy's replicas each add their own inner state and rounding error.
    let outer = optim.as_local().map(|o| o.outer_state());
    let optim_bytes = optimizer_file(ctx.dp_group(), outer, optim_bytes)?;
    write_round(ctx, state, model_bytes, optim_bytes)
}

/// Rank 0 writes the round's checkpoint of the model's and the optimizer's encoded records
/// and the plot, and says the round's lines.
pub(super) fn write_round(
    ctx: &mut RankContext<'_, GptJob>,
    state: &GptState,
    model_bytes: Vec<u8>,
    optim_bytes: Vec<u8>,
) -> Result<(), JobError> {
    let saved = ctx.save_checkpoint(state, || Ok(model_bytes), || Ok(optim_bytes))?;
    after_save(ctx, state, saved)
}

/// After a checkpoint is saved (`dir` on rank 0), rank 0 writes the plot and says the round's
/// lines.
fn after_save(
    ctx: &mut RankContext<'_, GptJob>,
    state: &GptState,
    dir: Option<PathBuf>,
) -> Result<(), JobError> {
    let Some(dir) = dir else {
        return Ok(());
    };
    let root = &ctx.settings().checkpoint_dir;
    output::write_plot(root, state, ctx.settings().log_loss).map_err(|source| JobError::Plots {
        dir: root.clone(),
        source,
    })?;
    let r = state.history.last().expect("just recorded");
    for line in output::eval_lines(r, state, &dir) {
        ctx.say(Say::Epoch, &line);
    }
    Ok(())
}
