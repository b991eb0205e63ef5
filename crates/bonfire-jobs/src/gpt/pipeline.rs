//! One rank of a pipeline-parallel GPT run (`--pp`): the model's blocks split into `pp`
//! contiguous stages balanced by the blocks' parameter counts ([`bonfire::pipeline::partition`]), this rank
//! holding only its stage (the embeddings on the first, the final norm and the head on the last,
//! a tied head's embedding on both), and each step's `grad_accum` micro-batches flowing through
//! the stages under the run's schedule ([`Pipeline::step_chunks`]). With `--chunks v` above 1
//! the blocks are cut into `v x pp` chunks instead and rank `r` of a pipeline holds chunks `r`,
//! `r + pp`, ... (interleaved 1F1B, [`Pipeline::interleaved`]): each chunk is then what a stage is
//! below, with its own optimizer. Under `--tp` each stage (each chunk) is then split
//! over its tensor-parallel group by the GPT's plan (the pipeline group joins the ranks of the
//! same place in their groups), and each rank averages and sums its own shard of the stage's
//! gradients below.
//!
//! After a step's last backward each stage averages its gradients over its data-parallel group
//! (the ranks of its stage in the other replicas: [`average_gradients`], one all-reduce, not
//! overlapped with backward), then the first and the last stage sum the tied embedding's
//! averaged gradients ([`Pipeline::sum_shared`]), before Adam steps. The step is then the same as a
//! data-parallel step with `grad_accum` micro-batches: the same batches, the same mean loss.
//!
//! At each evaluation the stages gather the whole model on every rank (as a checkpoint
//! gathers a tensor-parallel one) to measure the validation loss, draw the sample, take the
//! digest and write one whole checkpoint, which any mesh can resume; between evaluations a rank
//! holds its stage only.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Instant;

use bonfire::InOrder;
use bonfire::collectives::Communicator;
use bonfire::pipeline::{Pipeline, StageOutput, average_gradients, materialised, partition};
use bonfire_datasets::RankShard;
use bonfire_datasets::text::{CharCorpus, Windows};
use bonfire_models::{Gpt, GptStage, GptStageRecord};
use burn::module::{Module, ParamId};
use burn::optim::{Adam, AdamConfig};
use burn::record::Recorder;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor};

use super::train::{
    Account, Rec, RoundLog, Trained, evaluate, micro_batch, take_history, write_round,
};
use super::{GptJob, GptReport, GptRunConfig, GptState, VAL_FRACTION, output};
use crate::JobError;
use crate::checkpoint::{self, State};
use crate::optim::{JobOptimizer, OptimRecord};
use crate::rank::RankContext;
use crate::rank::gather_bytes;
use crate::report::{Say, Throughput};
use crate::stragglers::{EpochTimer, StepSplit};

/// A stage's optimizer: Adam over its blocks.
type Optim<A> = JobOptimizer<Adam, GptStage<A>, A>;

/// A rank's chunks (one, its stage, unless the run interleaves) and their optimizers.
type Held<A> = (Vec<GptStage<A>>, Vec<Optim<A>>);

/// How a rank lays out its stage over its tensor-parallel group: split by the GPT's plan under
/// `--tp`, as it is otherwise.
pub(super) type StageLayout<'a, A> = dyn Fn(GptStage<A>) -> Result<GptStage<A>, JobError> + 'a;

/// What one stage of replica 0 measured over the run, for the end report.
#[derive(Clone, Debug, PartialEq)]
pub struct StageSummary {
    /// The stage, from 0.
    pub stage: usize,
    /// The blocks it held, as indices of the whole model's: one range, or one per chunk under
    /// `--chunks`.
    pub blocks: Vec<Range<usize>>,
    /// Its parameters.
    pub params: usize,
    /// The part of its pipeline steps it waited for a neighbour (idle over wall, summed).
    pub idle: f64,
    /// The most micro-batches whose graphs it held at once.
    pub held: usize,
    /// The most activation bytes it held at once.
    pub activation_bytes: usize,
}

/// Trains this rank's stage of the GPT on autodiff backend `A`.
pub(super) fn run<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    device: A::Device,
    layout: &StageLayout<'_, A>,
) -> Result<(GptState, GptReport), JobError> {
    let s = ctx.settings().clone();
    let c = &s.config;
    let pp_group = ctx.world().pp_group().clone();
    let dp_group = ctx.dp_group().clone();
    let (replica, replicas) = (dp_group.rank(), c.dp());
    let pipe = Pipeline::new(pp_group, c.schedule, c.grad_accum)?.interleaved(c.chunks)?;
    let text = c.dataset.text(&s.data_dir)?;
    let corpus = CharCorpus::with_vocab(c.vocab(), &text, VAL_FRACTION)?;
    drop(text);
    let train = corpus.train_windows(c.context, 1)?;
    let shard = train.shard(replica, replicas)?;
    let val = corpus.val_windows(c.context, c.context)?;
    A::seed(&device, c.seed);
    // Burn draws a parameter's values when it is first used: every parameter is drawn now, in
    // module order as one device's run draws them, before this stage keeps its own.
    let whole: Gpt<A> = materialised(c.model().init(&device));
    // The model cut into chunks x stages; rank r's chunk k is the model's chunk k * p + r.
    let (p, v) = (pipe.stages(), pipe.chunks());
    let ranges = partition(&whole.block_params(), p * v);
    let mine: Vec<Range<usize>> = (0..v)
        .map(|k| ranges[k * p + pipe.stage()].clone())
        .collect();
    if ctx.is_main() {
        let params = whole.num_params();
        ctx.say(
            Say::Start,
            &output::start_line(&s, &corpus, params, shard.len(), replicas),
        );
    }
    let optims: Vec<Optim<A>> = (0..v)
        .map(|_| {
            JobOptimizer::new(
                AdamConfig::new().with_beta_2(0.99).init::<A, GptStage<A>>(),
                None,
            )
        })
        .collect();
    let mut state = State::new(c.clone(), s.epochs);
    let (chunks, mut optims) = resume(ctx, whole, &mine, optims, &mut state, &device)?;
    let mut chunks = chunks
        .into_iter()
        .map(layout)
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let mut split = StepSplit::default();
    let mut throughput = Throughput {
        ranks: ctx.world_size(),
        ..Throughput::default()
    };
    let mut measured = Measured::default();
    for round in state.epochs_done..s.epochs {
        let t0 = Instant::now();
        let trained;
        (chunks, trained) = train_round(
            ctx,
            &pipe,
            &dp_group,
            chunks,
            &mut optims,
            (&train, &shard),
            round,
            split.batches,
            &mut measured,
            &device,
        )?;
        let train_secs = t0.elapsed().as_secs_f64();
        let model = whole_model(pipe.group(), &chunks, c, &device)?;
        let mut account = Account {
            throughput: &mut throughput,
            split: &mut split,
            t0,
            train_secs,
        };
        let record = evaluate(ctx, &mut account, &model, &val, round, trained, &device)?;
        state.history.push(record);
        state.epochs_done = round + 1;
        let optim_bytes = whole_optimizer(pipe.group(), &chunks, &optims, &model, &device)?;
        record_round(ctx, &state, &model, optim_bytes)?;
        ctx.say_stragglers();
    }
    throughput.wall = started.elapsed();
    let pipeline = Some(summaries(ctx, &pipe, &chunks, &measured)?);
    let report = GptReport {
        memory: None,
        split,
        throughput,
        stats: bonfire::total_stats(),
        tp_stats: (c.tp > 1)
            .then(bonfire::backend::tensor_parallel::stats)
            .flatten(),
        train_tp_stats: None,
        pipeline,
        outer: None,
        servers: Vec::new(),
        checkpoint_dir: s.checkpoint_dir.clone(),
        saves: None,
    };
    if ctx.is_main() {
        for line in output::report_lines(&state, &report, ctx.rank()) {
            ctx.say(Say::Report, &line);
        }
    }
    Ok((state, report))
}

/// The chunks of `whole` this rank holds (blocks `ranges`: one range, its stage, unless the run
/// interleaves) and their optimizers: from the checkpoint on a resumed run (the whole model and
/// the whole optimizer state it holds, each chunk's part kept), otherwise as they are.
fn resume<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    whole: Gpt<A>,
    ranges: &[Range<usize>],
    optims: Vec<Optim<A>>,
    state: &mut GptState,
    device: &A::Device,
) -> Result<Held<A>, JobError> {
    let cut = |whole: Gpt<A>| -> Vec<GptStage<A>> {
        ranges
            .iter()
            .map(|r| whole.clone().into_stage(r.clone()))
            .collect()
    };
    let Some(loaded) = ctx.resume_checkpoint()? else {
        return Ok((cut(whole), optims));
    };
    // A per-rank checkpoint (a ZeRO-3 run's) is put together whole, keyed by this model's ids.
    let (whole, record) = match &loaded.shards {
        Some(dir) => {
            let (whole, record) =
                bonfire::consolidate_sharded_checkpoint::<A, Gpt<A>, Adam>(dir, whole)?;
            (whole, record.into_iter().collect::<Vec<_>>())
        }
        None => {
            let whole = checkpoint::load_model(whole, &loaded.model, device, &loaded.dir)?;
            let record: InOrder<_> = checkpoint::decode::<A, InOrder<_>>(&loaded.optimizer, device)
                .map_err(|why| JobError::DamagedRecord {
                    dir: loaded.dir.clone(),
                    what: "optimizer state",
                    why,
                })?;
            (whole, record.0)
        }
    };
    let chunks = cut(whole);
    // Each chunk's optimizer takes the state of the parameters it holds (no parameter is in
    // two chunks of one rank: a tied embedding's copies are on the first and the last rank).
    let mut record: HashMap<ParamId, _> = record.into_iter().collect();
    let optims = chunks
        .iter()
        .zip(optims)
        .map(|(chunk, optim)| {
            let mine: OptimRecord<Adam, GptStage<A>, A> = param_ids(chunk)
                .into_iter()
                .filter_map(|id| record.remove(&id).map(|state| (id, state)))
                .collect();
            optim.load_whole_record(mine, chunk)
        })
        .collect();
    take_history(ctx, state, loaded);
    Ok((chunks, optims))
}

/// A module's parameter ids.
fn param_ids<B: burn::tensor::backend::Backend, M: Module<B>>(module: &M) -> HashSet<ParamId> {
    struct Ids<B>(Vec<ParamId>, std::marker::PhantomData<B>);
    impl<B: burn::tensor::backend::Backend> burn::module::ModuleVisitor<B> for Ids<B> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<B, D>>) {
            self.0.push(p.id);
        }
    }
    let mut ids = Ids::<B>(Vec::new(), std::marker::PhantomData);
    module.visit(&mut ids);
    ids.0.into_iter().collect()
}

/// What a stage's pipeline steps measured over the run.
#[derive(Default)]
struct Measured {
    idle: f64,
    wall: f64,
    held: usize,
    bytes: usize,
}

/// Trains one round's steps through the pipeline, after `before` steps trained by this
/// process. Every stage of a replica draws the same micro-batches (the first reads their
/// tokens, the last their targets).
#[allow(clippy::too_many_arguments)]
fn train_round<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    pipe: &Pipeline,
    dp_group: &Communicator,
    mut chunks: Vec<GptStage<A>>,
    optims: &mut [Optim<A>],
    (train, shard): (&Windows<'_>, &RankShard),
    round: usize,
    before: u64,
    measured: &mut Measured,
    device: &A::Device,
) -> Result<(Vec<GptStage<A>>, Trained), JobError> {
    let c = ctx.settings().config.clone();
    let (replica, replicas, rounds) = (dp_group.rank(), c.dp(), ctx.settings().epochs);
    let first = round * c.eval_every;
    let end = ((round + 1) * c.eval_every).min(c.steps);
    let steps = end - first;
    let last_stage = pipe.stages() - 1;
    let mut log = RoundLog::new(round, rounds, steps, replicas);
    let (mut loss_sum, mut batches, mut tokens) = (0.0f64, 0usize, 0usize);
    let mut timer = EpochTimer::start_after(before);
    let step_tokens = c.grad_accum * c.batch * c.context;
    for (i, step) in (first..end).enumerate() {
        let lr = c.lr_at(step);
        let micro: Vec<(Tensor<A, 2, Int>, Tensor<A, 2, Int>)> = (0..c.grad_accum)
            .map(|m| micro_batch::<A>(&c, train, shard, step, m, replica, device))
            .collect();
        timer.input_done();
        timer.forward_done();
        let (grads, report) =
            pipe.step_chunks(&chunks, device, |st: &GptStage<A>, _, m, input| {
                stage_output(st, &micro[m], input)
            })?;
        // Averaged over the replicas first (chunk by chunk, in the same order on every
        // replica), then the tied embedding's two copies summed (the model's first chunk on the
        // first stage, its last on the last): both add the same two averaged tensors in the
        // same order, whatever the all-reduce.
        let mut grads = chunks
            .iter()
            .zip(grads)
            .map(|(chunk, grads)| average_gradients(dp_group, chunk, grads))
            .collect::<Result<Vec<_>, _>>()
            .map_err(crate::JobError::collective("averaging a stage's gradients"))?;
        for (chunk, grads) in chunks.iter().zip(&mut grads) {
            if let Some(tied) = chunk.tied_embedding() {
                pipe.sum_shared::<A, 2>(grads, tied)?;
            }
        }
        timer.backward_done();
        chunks = chunks
            .into_iter()
            .zip(grads)
            .zip(optims.iter_mut())
            .map(|((chunk, grads), optim)| optim.step(lr, chunk, grads))
            .collect();
        timer.steps_done(c.grad_accum as u64, step_tokens as u64);
        measured.idle += report.idle.as_secs_f64();
        measured.wall += report.wall.as_secs_f64();
        measured.held = measured.held.max(report.max_in_flight);
        measured.bytes = measured.bytes.max(report.max_activation_bytes);
        // Every stage learns the step's loss from the last, for rank 0's progress line.
        let loss = pipe
            .group()
            .broadcast(vec![report.loss.unwrap_or(0.0)], last_stage)
            .wait()
            .map_err(crate::JobError::collective(
                "sending the step's loss to every stage",
            ))?[0];
        let l = f64::from(loss.elem::<f32>());
        if pipe.is_last() {
            loss_sum += l * c.grad_accum as f64;
            batches += c.grad_accum;
        }
        tokens += step_tokens;
        log.add(l);
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
    Ok((chunks, trained))
}

/// A GPT stage's forward of one micro-batch `(tokens, targets)` in a pipeline step: from the
/// tokens on the first stage, else from the previous stage's `input`, through the stage's
/// blocks; the loss against the targets on the last stage, the activation elsewhere. The
/// closure [`Pipeline::step`] takes, for `bonfire train gpt --pp` and `bonfire bench pp`.
pub fn stage_output<A: AutodiffBackend>(
    stage: &GptStage<A>,
    (tokens, targets): &(Tensor<A, 2, Int>, Tensor<A, 2, Int>),
    input: Option<Tensor<A, 3>>,
) -> StageOutput<A, 3> {
    let out = stage.forward(stage.is_first().then(|| tokens.clone()), input);
    if stage.is_last() {
        StageOutput::Loss(stage.loss(out, targets.clone()))
    } else {
        StageOutput::Activation(out)
    }
}

/// The whole model on every rank of the pipeline: each chunk's record gathered (chunk `k` of
/// every stage at once, the model's chunks `k * p ..`), put together in the model's order,
/// loaded into a model of the run's shape.
fn whole_model<A: AutodiffBackend>(
    group: &Communicator,
    chunks: &[GptStage<A>],
    c: &GptRunConfig,
    device: &A::Device,
) -> Result<Gpt<A>, JobError> {
    let during = "gathering the stages into the whole model";
    let rec = Rec::default();
    let mut records: Vec<GptStageRecord<A>> = Vec::new();
    for chunk in chunks {
        let mine = rec
            .record(chunk.clone().into_record(), ())
            .map_err(|source| JobError::EncodeRecord {
                what: "model",
                source,
            })?;
        records.extend(gather_decoded::<A, GptStageRecord<A>>(
            group, mine, during, "record", device,
        )?);
    }
    Ok(c.model()
        .init::<A>(device)
        .load_record(GptStage::assemble(records)))
}

/// The whole optimizer state as one device's run records it, encoded in `whole`'s parameter
/// order: every chunk's state gathered, chunk by chunk as [`whole_model`] gathers them (the last
/// stage's copy of a tied embedding, whose state is the first stage's, left out: on a fresh run
/// its id is not the whole model's, on a resumed one it is, and the first stage's entry is
/// kept). Every rank of the pipeline calls it.
fn whole_optimizer<A: AutodiffBackend>(
    group: &Communicator,
    chunks: &[GptStage<A>],
    optims: &[Optim<A>],
    whole: &Gpt<A>,
    device: &A::Device,
) -> Result<Vec<u8>, JobError> {
    let during = "gathering the stages' optimizer state";
    let rec = Rec::default();
    let encode = |source| JobError::EncodeRecord {
        what: "optimizer state",
        source,
    };
    let ids = param_ids(whole);
    let mut merged: Vec<(ParamId, _)> = Vec::new();
    for (chunk, optim) in chunks.iter().zip(optims) {
        let mine = rec
            .record(InOrder::new(optim.whole_record(device), chunk), ())
            .map_err(encode)?;
        let parts =
            gather_decoded::<A, InOrder<_>>(group, mine, during, "optimizer state", device)?;
        for InOrder(entries) in parts {
            // A tied embedding's copy on the last stage has the first stage's id after a resume
            // (and its state, bit for bit): the first stage's entry is kept.
            for (id, state) in entries {
                if ids.contains(&id) && !merged.iter().any(|(seen, _)| *seen == id) {
                    merged.push((id, state));
                }
            }
        }
    }
    let record: OptimRecord<Adam, Gpt<A>, A> = merged.into_iter().collect();
    rec.record(InOrder::new(record, whole), ()).map_err(encode)
}

/// Every stage's `T`, gathered over the pipeline group in stage order (this rank's encoded as
/// `mine`) and decoded; a part that cannot be read is an error naming its stage and `what` it is.
fn gather_decoded<A: AutodiffBackend, T: burn::record::Record<A>>(
    group: &Communicator,
    mine: Vec<u8>,
    during: &'static str,
    what: &str,
    device: &A::Device,
) -> Result<Vec<T>, JobError> {
    gather_bytes(group, mine, during)?
        .iter()
        .enumerate()
        .map(|(stage, part)| {
            checkpoint::decode::<A, T>(part, device).map_err(|why| {
                JobError::Pipeline(bonfire::pipeline::PipelineError::Stage {
                    stage,
                    stages: group.size(),
                    micro: 0,
                    problem: format!("its {what} could not be read: {why}"),
                })
            })
        })
        .collect()
}

/// The round's checkpoint: the whole model's record and the whole optimizer state (every rank
/// has both), written by rank 0 with the plot and the round's lines.
fn record_round<A: AutodiffBackend>(
    ctx: &mut RankContext<'_, GptJob>,
    state: &GptState,
    model: &Gpt<A>,
    optim_bytes: Vec<u8>,
) -> Result<(), JobError> {
    let model_bytes = Rec::default()
        .record(model.clone().into_record(), ())
        .map_err(|source| JobError::EncodeRecord {
            what: "model",
            source,
        })?;
    write_round(ctx, state, model_bytes, optim_bytes)
}

/// Every stage's figures, gathered over the world (every rank calls it); replica 0's stages
/// are reported.
fn summaries<A: AutodiffBackend>(
    ctx: &RankContext<'_, GptJob>,
    pipe: &Pipeline,
    chunks: &[GptStage<A>],
    m: &Measured,
) -> Result<Vec<StageSummary>, JobError> {
    let mut mine = vec![
        pipe.stage() as f64,
        chunks.iter().map(|c| c.num_params()).sum::<usize>() as f64,
        if m.wall > 0.0 { m.idle / m.wall } else { 0.0 },
        m.held as f64,
        m.bytes as f64,
    ];
    for chunk in chunks {
        let blocks = chunk.blocks();
        mine.extend([blocks.start as f64, blocks.end as f64]);
    }
    // Every rank holds as many chunks.
    let width = mine.len();
    let all = ctx
        .world()
        .comm()
        .all_gather(mine)
        .wait()
        .map_err(JobError::collective("gathering the stages' figures"))?;
    let replica0 = ctx.world().mesh();
    Ok(all
        .chunks(width)
        .enumerate()
        .filter(|(rank, _)| replica0.coords(bonfire::topology::Rank::from(*rank)) == (0, 0))
        .map(|(_, v)| StageSummary {
            stage: v[0] as usize,
            blocks: v[5..]
                .chunks(2)
                .map(|b| b[0] as usize..b[1] as usize)
                .collect(),
            params: v[1] as usize,
            idle: v[2],
            held: v[3] as usize,
            activation_bytes: v[4] as usize,
        })
        .collect())
}
