//! The bundled jobs' optimizer: Burn's, with its whole state on every rank, or sharded over the
//! data-parallel replicas with [`bonfire::sharded`] (`--zero 1`); and what the model's state
//! costs each rank, for the end report.
//!
//! Checkpoints hold the whole optimizer state either way (a sharded run gathers it first), so a
//! run saved with `--zero 1` resumes without it, and the other way round, at the same bits.

use bonfire::Sharded;
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

/// A job's optimizer: whole on every rank (DDP), or each rank stepping and keeping state for its
/// share of the parameters (ZeRO stage 1).
pub(crate) enum JobOptimizer<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    Whole(OptimizerAdaptor<O, M, B>),
    Sharded(Sharded<OptimizerAdaptor<O, M, B>>),
}

impl<O, M, B> JobOptimizer<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    /// `optim`, sharded over the replicas when `sharded`.
    pub(crate) fn new(optim: OptimizerAdaptor<O, M, B>, sharded: bool) -> Self {
        if sharded {
            JobOptimizer::Sharded(bonfire::sharded(optim))
        } else {
            JobOptimizer::Whole(optim)
        }
    }

    /// One optimizer step (under ZeRO-1 a collective: every rank calls it).
    pub(crate) fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        match self {
            JobOptimizer::Whole(o) => o.step(lr, module, grads),
            JobOptimizer::Sharded(o) => o.step(lr, module, grads),
        }
    }

    /// The whole state, as the unsharded optimizer records it; sharded, gathered from every
    /// rank (a collective: every rank calls it).
    pub(crate) fn whole_record(&self, device: &B::Device) -> OptimRecord<O, M, B> {
        match self {
            JobOptimizer::Whole(o) => o.to_record(),
            JobOptimizer::Sharded(o) => o.consolidated_record(device),
        }
    }

    /// Loads a whole state (from [`JobOptimizer::whole_record`]); sharded, each rank keeps its
    /// share. Every rank calls it, with the model the state belongs to.
    pub(crate) fn load_whole_record(self, record: OptimRecord<O, M, B>, module: &M) -> Self {
        match self {
            JobOptimizer::Whole(o) => JobOptimizer::Whole(o.load_record(record)),
            JobOptimizer::Sharded(o) => {
                JobOptimizer::Sharded(o.load_consolidated_record(record, module))
            }
        }
    }

    /// Whether each rank keeps only its share of the state.
    pub(crate) fn is_sharded(&self) -> bool {
        matches!(self, JobOptimizer::Sharded(_))
    }

    /// Bytes of the state this rank holds, as Burn records it at full precision.
    fn state_bytes(&self) -> Result<usize, JobError> {
        let record = match self {
            JobOptimizer::Whole(o) => o.to_record(),
            JobOptimizer::Sharded(o) => o.to_record(),
        };
        let bytes = BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(record, ())
            .map_err(|source| JobError::EncodeRecord {
                what: "optimizer state",
                source,
            })?;
        Ok(bytes.len())
    }
}

/// Bytes of a module's float parameters, and of those that take a gradient.
#[derive(Default)]
struct ParamBytes {
    all: usize,
    trained: usize,
}

impl<B: Backend> ModuleVisitor<B> for ParamBytes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        let bytes = t.shape().num_elements() * t.dtype().size();
        self.all += bytes;
        if t.is_require_grad() {
            self.trained += bytes;
        }
    }
}

/// What each rank holds of the model's state after training (every rank's optimizer share and
/// peak resident memory, gathered over the ranks; every rank calls it). For data-parallel runs
/// (the parameters are whole on every rank).
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
    let mut mine = vec![0.0; 2 * ranks];
    mine[rank] = optim.state_bytes()? as f64;
    mine[ranks + rank] = crate::report::peak_resident_bytes().unwrap_or(0) as f64;
    let all = ctx.sum(mine, "gathering each rank's memory")?;
    Ok(ModelMemory {
        parameters: params.all,
        gradients: params.trained,
        optimizer: all[..ranks].iter().map(|&b| b as usize).collect(),
        peak_resident: all[ranks..]
            .iter()
            .map(|&b| (b > 0.0).then_some(b as usize))
            .collect(),
        sharded: optim.is_sharded(),
    })
}
