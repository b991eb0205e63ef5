//! What a training job provides ([`Job`]) for the runner to settle, start and drive it.

use std::fmt::Debug;
use std::path::Path;

use burn::tensor::backend::Backend;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::checkpoint::{Checkpoint, State};
use crate::rank::RankContext;
use crate::report::Reporter;
use crate::{Clash, JobError};

/// The settings that decide a job's result: stored in every checkpoint (as `state.json`'s
/// `config`), kept by a resumed run, handed from the deciding process to every rank.
pub trait JobConfig: Clone + Debug + PartialEq + Serialize + DeserializeOwned {
    /// Ranks the run trains on.
    fn ranks(&self) -> usize;
    /// Whether gradients travel as bf16 (the ranks' data-parallel backend must be told, through
    /// `BONFIRE_GRAD_DTYPE=bf16`).
    fn bf16_gradients(&self) -> bool;
    /// Tensor-parallel ranks per replica (the ranks are told through `BONFIRE_TP`); 1 for a
    /// purely data-parallel job.
    fn tensor_parallel(&self) -> usize {
        1
    }
    /// Pipeline stages (the ranks are told through `BONFIRE_PP`); 1 without pipeline
    /// parallelism.
    fn pipeline_stages(&self) -> usize {
        1
    }
    /// Whether the strategy is other than all-reduce (`--strategy local-sgd`, `diloco`, or
    /// parameter servers): the optimizer state is not one state all replicas share.
    fn local_strategy(&self) -> bool {
        false
    }
    /// The ranks whose death the job survives (the launcher lets it go on without them): the
    /// workers of asynchronous parameter servers (`--strategy ps-async`), which the servers
    /// drop; none otherwise.
    fn expendable_ranks(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Whether the job can shard its parameters at rest over the replicas (`--zero 3`).
    fn fully_shards(&self) -> bool {
        false
    }
    /// Whether the job checks the model state a rank would hold against
    /// `--model-state-limit` before it trains.
    fn checks_model_state(&self) -> bool {
        false
    }
}

/// The state of a run of job `J`, as its checkpoints hold it.
pub type JobState<J> = State<<J as Job>::Config, <J as Job>::Record>;

/// A checkpoint of a run of job `J`, read back.
pub type JobCheckpoint<J> = Checkpoint<<J as Job>::Config, <J as Job>::Record>;

/// A training job the runner ([`crate::Runner`]) can settle, start on its ranks, resume and
/// drive: the job-specific part, with everything job-independent (settings and resume rules,
/// rank agreement, the launcher, checkpoints, progress, reports) left to the library.
///
/// The runner settles a run in this order: [`Job::check`] the request; on a resume, compare it
/// with the checkpoint's settings ([`Job::clashes`]) and [`Job::prepare`] what the run reads;
/// on a fresh run, [`Job::configure`] it. Then every rank runs [`Job::train`].
pub trait Job {
    /// The job's name: runs go to `runs/<NAME>-N`; messages say `bonfire train <NAME>`.
    const NAME: &'static str;
    /// Epochs of a fresh run whose request names none.
    const DEFAULT_EPOCHS: usize;
    /// Ranks of a fresh run whose request names none, started by the runner.
    const DEFAULT_RANKS: usize = 2;
    /// What the job's rounds (the epochs of the runner, checkpoints and `state.json`) are,
    /// plural, in messages: "epochs"; the GPT job's round is the stretch of steps between two
    /// evaluations.
    const ROUNDS: &'static str = "epochs";
    /// How to train a finished run further, after "already holds all N epochs".
    const TRAIN_ON_HINT: &'static str = "; pass a larger --epochs to train on";

    /// The rounds a run with `config` has, when its settings decide them (the GPT job's steps
    /// and evaluation interval do); `None` takes `--epochs` or [`Job::DEFAULT_EPOCHS`].
    fn rounds(&self, _config: &Self::Config) -> Option<usize> {
        None
    }

    /// What a caller asks of the job: every field a setting, `None` (or `false`) where left to
    /// the default, or on a resume to the checkpoint.
    type Request: Clone + Debug;
    /// The settings that decide the result.
    type Config: JobConfig;
    /// What one epoch measured, as the checkpoints' history keeps it.
    type Record: Clone + Debug + PartialEq + Serialize + DeserializeOwned;
    /// What a rank hands back at the end, besides the state.
    type Report: Debug;

    /// Refuses a request with a value the job cannot take.
    fn check(&self, request: &Self::Request) -> Result<(), JobError>;

    /// The ranks the request names, if it names them.
    fn requested_ranks(&self, request: &Self::Request) -> Option<usize>;

    /// Resuming a run made with `saved`: the settings the request gives that differ from it, in
    /// the order the message lists them. A resume proceeds only when there are none.
    fn clashes(&self, request: &Self::Request, saved: &Self::Config) -> Vec<Clash>;

    /// Resuming a run made with `saved` (after [`Job::clashes`] found none): the settings the
    /// resumed run trains with. The request may change settings that do not decide the result
    /// (how the ranks lay the model out); by default it changes none.
    fn resumed_config(
        &self,
        _request: &Self::Request,
        saved: Self::Config,
    ) -> Result<Self::Config, JobError> {
        Ok(saved)
    }

    /// Makes ready what a run with `config` reads (fetches its data set into `data_dir`).
    fn prepare(&self, config: &Self::Config, data_dir: &Path) -> Result<(), JobError>;

    /// A fresh run's settings: the request's, defaults for what it leaves out, on `ranks` ranks.
    /// Fetches what the run reads into `data_dir`; a fallback it takes is told to `reporter`.
    fn configure(
        &self,
        request: &Self::Request,
        ranks: usize,
        data_dir: &Path,
        reporter: &mut dyn Reporter,
    ) -> Result<Self::Config, JobError>;

    /// Trains as one rank of the run on the backend its settings name: [`Job::train`] on that
    /// backend. The bundled jobs implement it with the same body, non-generic and not inlined,
    /// so that every backend's training loop is compiled once, in this crate, rather than again
    /// in each program that runs a job through [`crate::Runner`] (that doubled the CLI's build).
    fn train_rank(
        &self,
        ctx: &mut RankContext<'_, Self>,
    ) -> Result<(JobState<Self>, Self::Report), JobError>
    where
        Self: Sized,
    {
        crate::backend::train_on_backend(self, ctx)
    }

    /// Trains as one rank of the run on backend `B` (wrapped by the job in bonfire's
    /// data-parallel decorator), on `device`; returns the final state and this rank's report.
    fn train<B: Backend>(
        &self,
        ctx: &mut RankContext<'_, Self>,
        device: B::Device,
    ) -> Result<(JobState<Self>, Self::Report), JobError>
    where
        Self: Sized;
}
