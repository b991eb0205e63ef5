//! The bundled jobs' optimizer: Burn's, with its whole state on every rank, or sharded over the
//! data-parallel replicas with [`bonfire::sharded`] (`--zero 1`, and `--zero 2` for the
//! gradients too); and what the model's state costs each rank, for the end report.
//!
//! Checkpoints hold the whole optimizer state (a sharded run gathers it first), except under
//! ZeRO-3, whose checkpoints are per rank (each rank writes its slices, [`ShardIo`]) and are put
//! together whole by a run that resumes without it; so a run saved with `--zero` resumes
//! without it, at another stage, or the other way round.

use bonfire::{LocalSgd, OuterStats, ParamServer, PsReport, PsRole, Sharded, ZeroStage};
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsParams, LearningRate, Optimizer, SimpleOptimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::JobError;
use crate::job::Job;
use crate::rank::RankContext;
use crate::report::ModelMemory;

/// A Burn optimizer's whole record: its state per parameter.
pub(crate) type OptimRecord<O, M, B> = <OptimizerAdaptor<O, M, B> as Optimizer<M, B>>::Record;

type ShardedOptim<O, M, B> = Sharded<OptimizerAdaptor<O, M, B>>;

/// How a ZeRO-3 run writes and reads per-rank checkpoints: `bonfire::save_sharded_checkpoint`
/// and `bonfire::load_sharded_checkpoint` on its backend (which the jobs' generic code cannot
/// name as a tensor-parallel one), as the branch that picks the backend gives them.
#[allow(clippy::type_complexity)]
pub(crate) struct ShardIo<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    /// Writes this rank's files and the manifest in a directory.
    pub(crate) save: fn(
        &std::path::Path,
        &M,
        &ShardedOptim<O, M, B>,
    ) -> Result<std::path::PathBuf, bonfire::ShardedCheckpointError>,
    /// Loads a save into a laid-out model and a fresh sharded optimizer.
    pub(crate) load: fn(
        &std::path::Path,
        M,
        ShardedOptim<O, M, B>,
    ) -> Result<(M, ShardedOptim<O, M, B>), bonfire::ShardedCheckpointError>,
}

/// A job's optimizer: whole on every rank (DDP), or each rank stepping and keeping state for its
/// share of the parameters (ZeRO stages 1 and 2); and the gradient bytes its last step got.
pub(crate) struct JobOptimizer<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    optim: Kind<O, M, B>,
    /// Bytes of the gradients handed to the last step (under ZeRO-2 this rank's share only).
    gradients: usize,
}

enum Kind<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    Whole(OptimizerAdaptor<O, M, B>),
    Sharded(Sharded<OptimizerAdaptor<O, M, B>>),
    /// Local SGD or DiLoCo (`--strategy`): each replica's own state.
    Local(LocalSgd<OptimizerAdaptor<O, M, B>>),
    /// Parameter servers (`--strategy ps-sync|ps-async`): a server's state for its share.
    Served(ParamServer<OptimizerAdaptor<O, M, B>>),
}

impl<O, M, B> JobOptimizer<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    /// `optim`, sharded over the replicas at `stage` when given.
    pub(crate) fn new(optim: OptimizerAdaptor<O, M, B>, stage: Option<ZeroStage>) -> Self {
        let optim = match stage {
            Some(stage) => Kind::Sharded(bonfire::sharded(optim).stage(stage)),
            None => Kind::Whole(optim),
        };
        JobOptimizer {
            optim,
            gradients: 0,
        }
    }

    /// `optim` stepping on each replica's own gradients and meeting as `local` says.
    pub(crate) fn local(local: LocalSgd<OptimizerAdaptor<O, M, B>>) -> Self {
        JobOptimizer {
            optim: Kind::Local(local),
            gradients: 0,
        }
    }

    /// Parameter servers' `ps` (a worker pushes and pulls in each step; a server serves).
    pub(crate) fn served(ps: ParamServer<OptimizerAdaptor<O, M, B>>) -> Self {
        JobOptimizer {
            optim: Kind::Served(ps),
            gradients: 0,
        }
    }

    /// A server's round: serves the workers until every one is done (or gone), and says what
    /// it saw. `None` (and `module` unchanged) on any other rank.
    pub(crate) fn serve(&mut self, module: M) -> (M, Option<PsReport>) {
        match &mut self.optim {
            Kind::Served(o) => {
                let (module, report) = o.serve(module);
                (module, Some(report))
            }
            _ => (module, None),
        }
    }

    /// The workers asynchronous parameter servers had dropped by the last round's end, the
    /// same on every rank left (`bonfire::ParamServer::departed`); empty under the other
    /// strategies.
    pub(crate) fn departed(&self) -> &[usize] {
        self.as_served().map_or(&[], |o| o.departed())
    }

    /// Parameter servers, when that is the strategy.
    pub(crate) fn as_served(&self) -> Option<&ParamServer<OptimizerAdaptor<O, M, B>>> {
        match &self.optim {
            Kind::Served(o) => Some(o),
            _ => None,
        }
    }

    /// One optimizer step (sharded, or a local strategy's meeting, a collective: every rank
    /// calls it).
    pub(crate) fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        self.gradients = bonfire::gradient_bytes(&module, &grads);
        match &mut self.optim {
            Kind::Whole(o) => o.step(lr, module, grads),
            Kind::Sharded(o) => o.step(lr, module, grads),
            Kind::Local(o) => o.step(lr, module, grads),
            Kind::Served(o) => o.step(lr, module, grads),
        }
    }

    /// Under a local strategy, the replicas meet now if they stepped since they last did (a
    /// collective); a parameter servers' worker says it is done with the round and takes the
    /// servers' final parameters; otherwise `module` unchanged.
    pub(crate) fn meet(&mut self, module: M) -> M {
        match &mut self.optim {
            Kind::Local(o) => o.meet(module),
            Kind::Served(o) if matches!(o.role(&device_of(&module)), PsRole::Worker { .. }) => {
                o.finish(module)
            }
            _ => module,
        }
    }

    /// A local strategy's wrapper; `None` otherwise.
    pub(crate) fn as_local(&self) -> Option<&LocalSgd<OptimizerAdaptor<O, M, B>>> {
        match &self.optim {
            Kind::Local(o) => Some(o),
            _ => None,
        }
    }

    /// Under a local strategy, takes the outer state of a saved run (when it has one);
    /// otherwise unchanged.
    pub(crate) fn load_outer_state(self, state: Option<bonfire::OuterState>) -> Self {
        match (self.optim, state) {
            (Kind::Local(o), Some(state)) => JobOptimizer {
                optim: Kind::Local(o.with_outer_state(state)),
                ..self
            },
            (optim, _) => JobOptimizer { optim, ..self },
        }
    }

    /// A local strategy's communication on this rank.
    pub(crate) fn outer_stats(&self) -> Option<OuterStats> {
        self.as_local().map(LocalSgd::stats)
    }

    /// The whole state, as the unsharded optimizer records it; sharded, gathered from every
    /// rank (a collective: every rank calls it).
    pub(crate) fn whole_record(&self, device: &B::Device) -> OptimRecord<O, M, B> {
        match &self.optim {
            Kind::Whole(o) => o.to_record(),
            Kind::Sharded(o) => o.consolidated_record(device),
            Kind::Local(o) => o.inner().to_record(),
            // A server's share; the job merges the servers' (`served_record`).
            Kind::Served(o) => o.inner().to_record(),
        }
    }

    /// Loads a whole state (from [`JobOptimizer::whole_record`]); sharded, each rank keeps its
    /// share. Every rank calls it, with the model the state belongs to.
    pub(crate) fn load_whole_record(self, record: OptimRecord<O, M, B>, module: &M) -> Self {
        let optim = match self.optim {
            Kind::Whole(o) => Kind::Whole(o.load_record(record)),
            Kind::Sharded(o) => Kind::Sharded(o.load_consolidated_record(record, module)),
            Kind::Local(o) => {
                let inner = o.inner().clone().load_record(record);
                Kind::Local(o.with_inner(inner))
            }
            Kind::Served(mut o) => {
                // Each server keeps the state of the parameters it serves.
                let owned: std::collections::HashSet<_> = o.owned(module).into_iter().collect();
                let mut record = record;
                record.retain(|id, _| owned.contains(id));
                Kind::Served(o.load_record(record))
            }
        };
        JobOptimizer { optim, ..self }
    }

    /// Under ZeRO stage 3, the state (loaded whole before the model was sharded) sharded as
    /// `module`'s parameters now are, each rank keeping its slices; otherwise unchanged.
    pub(crate) fn shard_state(self, module: &M) -> Self {
        match self.optim {
            Kind::Sharded(o) if o.zero_stage() == ZeroStage::Three => {
                let record = o.inner().to_record();
                JobOptimizer {
                    optim: Kind::Sharded(o.load_consolidated_record(record, module)),
                    ..self
                }
            }
            optim => JobOptimizer { optim, ..self },
        }
    }

    /// Writes this rank's files of a per-rank checkpoint of `module` and this state in `dir`
    /// (a collective: every rank calls it). Only a sharded optimizer writes one.
    pub(crate) fn save_shards(
        &self,
        io: &ShardIo<O, M, B>,
        dir: &std::path::Path,
        module: &M,
    ) -> Result<(), JobError> {
        match &self.optim {
            Kind::Sharded(o) => (io.save)(dir, module, o)
                .map(|_| ())
                .map_err(JobError::from),
            _ => {
                unreachable!("only a ZeRO-3 run (a sharded optimizer) writes per-rank checkpoints")
            }
        }
    }

    /// `module` (laid out as it trains) and this (fresh) state loaded from the per-rank
    /// checkpoint in `dir`.
    pub(crate) fn load_shards(
        self,
        io: &ShardIo<O, M, B>,
        dir: &std::path::Path,
        module: M,
    ) -> Result<(M, Self), JobError> {
        match self.optim {
            Kind::Sharded(o) => {
                let (module, o) = (io.load)(dir, module, o)?;
                let optim = Kind::Sharded(o);
                Ok((module, JobOptimizer { optim, ..self }))
            }
            _ => unreachable!("only a ZeRO-3 run (a sharded optimizer) reads per-rank checkpoints"),
        }
    }

    /// The ZeRO stage it shards at; `None` for whole on every rank.
    pub(crate) fn zero_stage(&self) -> Option<ZeroStage> {
        match &self.optim {
            Kind::Whole(_) | Kind::Local(_) | Kind::Served(_) => None,
            Kind::Sharded(o) => Some(o.zero_stage()),
        }
    }

    /// Bytes of the state this rank holds, as Burn records it at full precision.
    fn state_bytes(&self) -> Result<usize, JobError> {
        let record = match &self.optim {
            Kind::Whole(o) => o.to_record(),
            Kind::Sharded(o) => o.to_record(),
            Kind::Local(o) => o.inner().to_record(),
            Kind::Served(o) => o.inner().to_record(),
        };
        // This rank's parts (under ZeRO-3, its slices: nothing is gathered).
        let bytes = bonfire::backend::tensor_parallel::read_parts(|| {
            BinBytesRecorder::<FullPrecisionSettings>::default().record(record, ())
        })
        .map_err(|source| JobError::EncodeRecord {
            what: "optimizer state",
            source,
        })?;
        // A local strategy's outer state: the anchor between meetings, the outer momentum and
        // the rounding error of bf16 or int8 deltas, and the parameters a meeting in flight was
        // sent from, f32 each.
        let outer = self.as_local().map_or(0, |o| {
            let s = o.outer_state();
            let sent = o.in_flight().map_or(0, |f| 4 * f.sent_from.len());
            sent + [&s.anchor, &s.momentum, &s.residual]
                .iter()
                .map(|v| v.as_ref().map_or(0, |v| 4 * v.len()))
                .sum::<usize>()
        });
        Ok(bytes.len() + outer)
    }
}

/// The device of `module`'s first float parameter (the default device without one).
fn device_of<B: Backend, M: burn::module::Module<B>>(module: &M) -> B::Device {
    module.devices().into_iter().next().unwrap_or_default()
}

/// Under parameter servers, every server's share of the optimizer state `mine` (a worker's is
/// empty) gathered over `group` to its rank 0 (a collective: every rank calls it) into the
/// whole state, as the unsharded optimizer records it; the other ranks, which write nothing,
/// get an empty record.
pub(crate) fn served_record<O, M, B>(
    group: &bonfire::collectives::Communicator,
    mine: OptimRecord<O, M, B>,
    device: &B::Device,
) -> Result<OptimRecord<O, M, B>, JobError>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder
        .record(mine, ())
        .map_err(|source| JobError::EncodeRecord {
            what: "optimizer state",
            source,
        })?;
    let Some(all) =
        crate::rank::gather_to_root(group, bytes, "gathering the servers' optimizer states")?
    else {
        // Only rank 0 writes the checkpoint.
        return Ok(OptimRecord::<O, M, B>::default());
    };
    let mut whole = OptimRecord::<O, M, B>::default();
    for part in all {
        let share: OptimRecord<O, M, B> =
            recorder
                .load(part, device)
                .map_err(|source| JobError::EncodeRecord {
                    what: "optimizer state",
                    source,
                })?;
        whole.extend(share);
    }
    Ok(whole)
}

/// Bytes of the float tensors of a model (its parameters and buffers, such as a batch norm's
/// running statistics) this rank holds and whole, and of the trained ones alone (those that get
/// gradients and optimizer state).
#[derive(Default)]
struct ParamBytes {
    held: usize,
    whole: usize,
    trained_held: usize,
    trained_whole: usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ParamBytes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        let (held, whole) = (
            bonfire::held_bytes(&t),
            t.shape().num_elements() * t.dtype().size(),
        );
        self.held += held;
        self.whole += whole;
        if t.is_require_grad() {
            self.trained_held += held;
            self.trained_whole += whole;
        }
    }
}

/// The model state a rank will hold with Adam (f32 moments at the parameters' dtype), in bytes,
/// predicted from the parameters it holds once `model` is laid out (whole, its tensor-parallel
/// parts, or its ZeRO-3 slices): its parameters, its gradients and Adam's state. Under ZeRO-1
/// and 2 the shares of `replicas` are taken as even (the owners are planned at the first step).
pub(crate) fn predicted_state<B, M>(
    model: &M,
    zero: Option<ZeroStage>,
    replicas: usize,
) -> (usize, usize, usize)
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut params = ParamBytes::default();
    model.visit(&mut params);
    let (held, trained, n) = (params.held, params.trained_held, replicas.max(1));
    match zero {
        None | Some(ZeroStage::Three) => (held, trained, 2 * trained),
        Some(ZeroStage::One) => (held, trained, 2 * trained / n),
        Some(ZeroStage::Two) => (held, trained / n, 2 * trained / n),
    }
}

/// What each rank holds of the model's state after training (every rank's gradients, optimizer
/// share and peak resident memory, gathered over the ranks; every rank calls it). For
/// data-parallel runs (the parameters whole on every rank, or sharded alike under ZeRO-3).
pub(crate) fn model_memory<J: Job, O, M, B>(
    ctx: &RankContext<'_, J>,
    model: &M,
    optim: &JobOptimizer<O, M, B>,
) -> Result<ModelMemory, JobError>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    let mut params = ParamBytes::default();
    model.visit(&mut params);
    let (rank, ranks) = (ctx.rank(), ctx.world_size());
    // Each rank fills its own slots; the sum over ranks is every rank's figures.
    let mut mine = vec![0.0; 3 * ranks];
    mine[rank] = optim.gradients as f64;
    mine[ranks + rank] = optim.state_bytes()? as f64;
    mine[2 * ranks + rank] = crate::report::peak_resident_bytes().unwrap_or(0) as f64;
    let all = ctx.sum(mine, "gathering each rank's memory")?;
    let bytes = |part: &[f64]| part.iter().map(|&b| b as usize).collect();
    Ok(ModelMemory {
        parameters: params.held,
        parameters_whole: params.whole,
        trained_whole: params.trained_whole,
        gradients: bytes(&all[..ranks]),
        optimizer: bytes(&all[ranks..2 * ranks]),
        peak_resident: all[2 * ranks..]
            .iter()
            .map(|&b| (b > 0.0).then_some(b as usize))
            .collect(),
        zero: optim.zero_stage(),
    })
}

/// `model` sharded at rest over the data-parallel ranks (ZeRO-3, [`bonfire::fully_shard`]), its
/// gathers started `prefetch` parameters at a time ahead of need where the run says how many
/// ([`bonfire::prefetch_gathers`]; the library's default otherwise).
pub(crate) fn fully_shard<B, M>(model: M, prefetch: Option<usize>) -> Result<M, JobError>
where
    B: AutodiffBackend + bonfire::backend::tensor_parallel::TensorParallelBackend,
    M: burn::module::Module<B>,
{
    let model = bonfire::fully_shard(model)?;
    if let Some(n) = prefetch {
        bonfire::prefetch_gathers(n);
    }
    Ok(model)
}
