//! One rank of a run: what the runner hands a job's training ([`RankContext`]), and how ranks
//! agree (rank 0 decides, the others take its decision: [`agree`]).

use std::path::PathBuf;
use std::time::Duration;

use bonfire::World;
use bonfire::topology::ReduceOp;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::JobError;
use crate::checkpoint::{self, State};
use crate::job::{Job, JobCheckpoint};
use crate::progress::StepProgress;
use crate::report::{Reporter, Say};
use crate::settings::Settings;

/// How long the other ranks wait for rank 0 to settle a run (it may be fetching a data set).
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(1800);

/// Rank 0's `decide()`, on every rank: rank 0 runs it and broadcasts the outcome, the others
/// wait for it (up to [`SETTLE_TIMEOUT`]). An error of rank 0's reaches the others as
/// [`JobError::FromRank0`].
pub fn agree<T: Serialize + DeserializeOwned>(
    world: &World,
    decide: impl FnOnce() -> Result<T, JobError>,
) -> Result<T, JobError> {
    const DURING: &str = "waiting for rank 0 to settle the run";
    let comm = world.comm().with_timeout(SETTLE_TIMEOUT);
    let mut own_error = None;
    let mine = if world.is_main() {
        let decided = decide().map_err(|e| {
            let message = e.to_string();
            own_error = Some(e);
            message
        });
        serde_json::to_vec(&decided).map_err(JobError::Handoff)?
    } else {
        Vec::new()
    };
    let len = comm
        .broadcast(vec![mine.len() as i64], 0)
        .wait()
        .map_err(JobError::collective(DURING))?[0];
    let mut buf = mine;
    buf.resize(len as usize, 0);
    let bytes = comm
        .broadcast(buf, 0)
        .wait()
        .map_err(JobError::collective(DURING))?;
    if let Some(e) = own_error {
        return Err(e);
    }
    let decided: Result<T, String> = serde_json::from_slice(&bytes).map_err(JobError::Handoff)?;
    decided.map_err(|message| JobError::FromRank0 { message })
}

/// What the runner hands a job's training on one rank: the job's world, the settled run, and
/// the reporter (rank 0's; the other ranks' is silent).
pub struct RankContext<'a, J: Job> {
    world: &'a World,
    settings: &'a Settings<J::Config>,
    reporter: &'a mut dyn Reporter,
}

impl<'a, J: Job> RankContext<'a, J> {
    /// The context of this rank of `world` for the run `settings`; lines go to `reporter` on
    /// rank 0 only.
    pub fn new(
        world: &'a World,
        settings: &'a Settings<J::Config>,
        reporter: &'a mut dyn Reporter,
    ) -> Self {
        RankContext {
            world,
            settings,
            reporter,
        }
    }

    /// The job this rank belongs to.
    pub fn world(&self) -> &World {
        self.world
    }

    /// The settled run.
    pub fn settings(&self) -> &Settings<J::Config> {
        self.settings
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.world.rank().0 as usize
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world.world_size()
    }

    /// True on rank 0, which reports and writes the checkpoints.
    pub fn is_main(&self) -> bool {
        self.world.is_main()
    }

    /// Rank 0 says `text` (the other ranks say nothing).
    pub fn say(&mut self, kind: Say, text: &str) {
        if self.is_main() {
            self.reporter.say(kind, text);
        }
    }

    /// Rank 0 reports its progress through an epoch.
    pub fn step(&mut self, progress: &StepProgress) {
        if self.is_main() {
            self.reporter.step(progress);
        }
    }

    /// On a resumed run, the checkpoint to continue from, read on every rank; the ranks check
    /// that they all found the same one (every rank must see the checkpoint directory). `None`
    /// on a fresh run.
    ///
    /// A newest checkpoint that fails its check is passed over for the newest one that passes;
    /// rank 0 says which and why.
    pub fn resume_checkpoint(&mut self) -> Result<Option<JobCheckpoint<J>>, JobError> {
        if !self.settings.resume {
            return Ok(None);
        }
        let loaded = checkpoint::load::<J::Config, J::Record>(&self.settings.checkpoint_dir);
        let mine = loaded.as_ref().map_or(-1, |l| l.state.epochs_done as i64);
        let all = self
            .world
            .comm()
            .all_gather(vec![mine])
            .wait()
            .map_err(JobError::collective(
                "agreeing on the checkpoint to resume from",
            ))?;
        let loaded = loaded?;
        if let Some(rank) = all.iter().position(|&e| e != mine) {
            return Err(JobError::CheckpointMismatch {
                rank,
                found: usize::try_from(all[rank]).ok(),
                dir: self.settings.checkpoint_dir.clone(),
                mine: loaded.state.epochs_done,
            });
        }
        for why in &loaded.skipped {
            let text = format!(
                "passed over checkpoint {why}; resuming from {}",
                loaded.dir.display()
            );
            self.say(Say::Notice, &text);
        }
        Ok(Some(loaded))
    }

    /// Rank 0 writes the checkpoint of `state` with the model's and optimizer's records (then
    /// deletes all but the newest `keep_checkpoints`) and returns its directory; `None` on the
    /// other ranks, which write nothing.
    pub fn save_checkpoint<R: Serialize>(
        &self,
        state: &State<J::Config, R>,
        model: impl FnOnce() -> Result<Vec<u8>, JobError>,
        optimizer: impl FnOnce() -> Result<Vec<u8>, JobError>,
    ) -> Result<Option<PathBuf>, JobError> {
        if !self.is_main() {
            return Ok(None);
        }
        let (model, optimizer) = (model()?, optimizer()?);
        let root = &self.settings.checkpoint_dir;
        let dir = checkpoint::save(root, state, &model, &optimizer)?;
        if let Some(keep) = self.settings.keep_checkpoints {
            checkpoint::prune(root, keep)?;
        }
        Ok(Some(dir))
    }

    /// Rank 0's `bytes` on every rank (the others pass anything, e.g. nothing); `during` says
    /// what for, in an error.
    pub fn broadcast_bytes(
        &self,
        bytes: Vec<u8>,
        during: &'static str,
    ) -> Result<Vec<u8>, JobError> {
        let comm = self.world.comm();
        let len = comm
            .broadcast(vec![bytes.len() as i64], 0)
            .wait()
            .map_err(JobError::collective(during))?[0] as usize;
        let mut buf = bytes;
        buf.resize(len, 0);
        comm.broadcast(buf, 0)
            .wait()
            .map_err(JobError::collective(during))
    }

    /// The element-wise sum of every rank's `values`; `during` says what for, in an error.
    pub fn sum(&self, values: Vec<f64>, during: &'static str) -> Result<Vec<f64>, JobError> {
        self.world
            .comm()
            .all_reduce(values, ReduceOp::Sum)
            .wait()
            .map_err(JobError::collective(during))
    }
}
