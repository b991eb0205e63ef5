//! One rank of a run: what the runner hands a job's training ([`RankContext`]), and how ranks
//! agree (rank 0 decides, the others take its decision: [`agree`]).

use std::path::PathBuf;
use std::time::Duration;

use bonfire::World;
use bonfire::collectives::Communicator;
use bonfire::topology::ReduceOp;
use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::Backend;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::JobError;

/// Makes the staging directory of checkpoint `epoch-<epochs_done>` under `root` with a token
/// file in it; returns the token.
fn make_staging(root: &std::path::Path, epochs_done: usize) -> Result<i64, JobError> {
    let tmp = checkpoint::begin(root, epochs_done)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let token = (nanos as i64 ^ i64::from(std::process::id())) & i64::MAX;
    let path = tmp.join(TOKEN);
    std::fs::write(&path, token.to_string()).map_err(JobError::io(&path))?;
    Ok(token)
}

/// The file rank 0 leaves in a per-rank checkpoint's staging directory for the other ranks to
/// find (removed before the checkpoint is complete).
const TOKEN: &str = ".rank0-token";

/// What [`RankContext::save_per_rank`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PerRank {
    /// Every rank wrote its files; rank 0 has the checkpoint's directory, the others `None`.
    Saved(Option<PathBuf>),
    /// These ranks do not see rank 0's checkpoint directory: nothing was written.
    NotShared {
        /// The ranks that do not see it.
        blind: Vec<usize>,
    },
}
use crate::checkpoint::{self, State};
use crate::job::{Job, JobCheckpoint};
use crate::progress::StepProgress;
use crate::report::{Reporter, Say};
use crate::settings::Settings;
use crate::stragglers::{RankTimes, THRESHOLD, stragglers};

/// The launcher's restart round: 0 on a first start, above 0 after a restart
/// (`BONFIRE_RESTART_ROUND`).
pub fn restart_round() -> u32 {
    std::env::var(bonfire::launch::env::vars::RESTART_ROUND)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The file in the run directory where rank 0 notes how far it got.
pub const PROGRESS_FILE: &str = "progress.json";

/// How far rank 0 got: epoch (from 1) and step (from 1) of `steps`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Progress {
    /// The epoch, from 1.
    pub epoch: usize,
    /// Steps done in it.
    pub step: usize,
    /// Steps in an epoch.
    pub steps: usize,
}

impl Progress {
    /// Steps done after the first `epochs_done` epochs.
    pub fn steps_since(&self, epochs_done: usize) -> usize {
        let whole = self.epoch.saturating_sub(1).saturating_sub(epochs_done);
        if self.epoch <= epochs_done {
            0
        } else {
            whole * self.steps + self.step
        }
    }
}

fn note_progress(dir: &std::path::Path, p: &StepProgress) {
    let note = Progress {
        epoch: p.epoch,
        step: p.step,
        steps: p.steps,
    };
    // Written whole and renamed, so that a reader never sees half of it; a failure to note
    // progress costs only the count of steps trained again.
    let tmp = dir.join(".progress.tmp");
    if let Ok(json) = serde_json::to_vec(&note)
        && std::fs::write(&tmp, json).is_ok()
    {
        let _ = std::fs::rename(&tmp, dir.join(PROGRESS_FILE));
    }
}

/// The progress rank 0 noted last in run directory `dir`, if any.
pub fn read_progress(dir: &std::path::Path) -> Option<Progress> {
    serde_json::from_slice(&std::fs::read(dir.join(PROGRESS_FILE)).ok()?).ok()
}

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
    straggler: Option<String>,
    to_say: Vec<String>,
    /// The job's ranks that are left, once asynchronous parameter servers dropped workers
    /// ([`RankContext::go_on_without`]): the job's collectives run over them.
    left: Option<Left>,
}

/// The ranks left in a job after some died, and the group they form.
struct Left {
    /// The job's ranks that are gone, ascending.
    gone: Vec<usize>,
    /// The job's other ranks, in rank order.
    comm: Communicator,
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
            straggler: None,
            to_say: Vec::new(),
            left: None,
        }
    }

    /// The group the job's own collectives run over (sums, gathers, checkpoints): every rank of
    /// the job, or the ranks left once some were dropped ([`RankContext::go_on_without`]).
    pub fn comm(&self) -> &Communicator {
        self.left.as_ref().map_or(self.world.comm(), |l| &l.comm)
    }

    /// The data-parallel group, or the ranks left (parameter servers, the only runs that go on
    /// without ranks, have no tensor or pipeline groups: their data-parallel group is the job).
    pub fn dp_group(&self) -> &Communicator {
        self.left
            .as_ref()
            .map_or(self.world.dp_group(), |l| &l.comm)
    }

    /// The job's ranks that are gone (ascending; empty while every rank trains).
    pub fn gone(&self) -> &[usize] {
        self.left.as_ref().map_or(&[], |l| &l.gone)
    }

    /// Goes on without the job's ranks `gone` (ascending, a list that only grows: the workers
    /// asynchronous parameter servers dropped, `bonfire::ParamServer::departed`, which every
    /// rank left holds alike): from now on the job's collectives run over the other ranks, and
    /// the first of them reports and writes the checkpoints. Says so once per change; returns
    /// whether the ranks changed. A rank that finds itself in `gone` fails.
    pub fn go_on_without(&mut self, gone: &[usize]) -> Result<bool, JobError> {
        if gone == self.gone() {
            return Ok(false);
        }
        let ranks: Vec<usize> = (0..self.world_size())
            .filter(|r| !gone.contains(r))
            .collect();
        let Some(comm) = self.world.comm().subgroup(&ranks) else {
            return Err(JobError::DroppedAlive { rank: self.rank() });
        };
        self.left = Some(Left {
            gone: gone.to_vec(),
            comm,
        });
        let names: Vec<String> = gone.iter().map(|r| r.to_string()).collect();
        let text = format!(
            "going on without rank(s) {} (the parameter servers dropped them): {} of {} ranks \
             left, rank {} reports and writes the checkpoints",
            names.join(", "),
            ranks.len(),
            self.world_size(),
            ranks[0]
        );
        self.say(Say::Notice, &text);
        Ok(true)
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

    /// True on rank 0, which reports and writes the checkpoints (once ranks are gone, on the
    /// first rank left).
    pub fn is_main(&self) -> bool {
        match &self.left {
            Some(l) => l.comm.rank() == 0,
            None => self.world.is_main(),
        }
    }

    /// Rank 0 says `text` (the other ranks say nothing).
    pub fn say(&mut self, kind: Say, text: &str) {
        if self.is_main() {
            self.reporter.say(kind, text);
        }
    }

    /// Every rank's times in the epoch just trained (this rank's are `mine`), gathered on every
    /// rank, and the stragglers among them (see [`crate::stragglers`]): rank 0 names them at
    /// [`say_stragglers`](Self::say_stragglers), and the progress lines of the next epoch carry
    /// the slowest.
    ///
    /// Only the first `trainers` ranks are compared for stragglers (parameter servers, the
    /// last ranks, train nothing). Once ranks are gone, only those left are gathered.
    pub fn epoch_times(
        &mut self,
        mine: RankTimes,
        trainers: usize,
    ) -> Result<Vec<RankTimes>, JobError> {
        let all = self
            .comm()
            .all_gather(mine.values())
            .wait()
            .map_err(JobError::collective("gathering every rank's epoch times"))?;
        let times = RankTimes::from_gathered(&all);
        // The ranks gone were trainers; the others are named by their rank in the job.
        let trainers = trainers.saturating_sub(self.gone().len());
        let mut found = stragglers(&times[..trainers.min(times.len())], THRESHOLD);
        let members = self.comm().members();
        for s in &mut found {
            s.rank = members[s.rank].0 as usize;
        }
        self.straggler = found.first().map(|s| s.short());
        self.to_say = found
            .iter()
            .map(|s| format!("straggler: {}", s.describe()))
            .collect();
        Ok(times)
    }

    /// Rank 0 names the stragglers [`epoch_times`](Self::epoch_times) found (after the epoch's
    /// line).
    pub fn say_stragglers(&mut self) {
        for text in std::mem::take(&mut self.to_say) {
            self.say(Say::Notice, &text);
        }
    }

    /// The straggler named after the last epoch, shortly, for the progress line.
    pub fn straggler(&self) -> Option<String> {
        self.straggler.clone()
    }

    /// Rank 0 reports its progress through an epoch, and notes it in the run directory (so
    /// that a restart can say how many steps it trains again).
    pub fn step(&mut self, progress: &StepProgress) {
        if self.is_main() {
            self.reporter.step(progress);
            note_progress(&self.settings.checkpoint_dir, progress);
        }
    }

    /// On a resumed or restarted run, the checkpoint to continue from, read on every rank:
    /// the newest that some rank can read, sent to the ranks whose directory lacks it (nodes
    /// that do not share the checkpoint directory). `None` on a fresh run, and on a restarted one
    /// that had written no checkpoint yet.
    ///
    /// A newest checkpoint that fails its check is passed over for the newest one that passes;
    /// rank 0 says which and why. Under a restart (`BONFIRE_RESTART_ROUND` above 0, set by the
    /// launcher) rank 0 also says how many steps done since the checkpoint are trained again.
    pub fn resume_checkpoint(&mut self) -> Result<Option<JobCheckpoint<J>>, JobError> {
        let restart = restart_round();
        if !self.settings.resume && restart == 0 {
            return Ok(None);
        }
        let dir = self.settings.checkpoint_dir.clone();
        // A restarted fresh run may fail before its first checkpoint: then it starts afresh.
        let none_yet = !self.settings.resume && checkpoint::latest(&dir)?.is_none();
        let loaded = if none_yet {
            Err(JobError::NoCheckpoint { dir: dir.clone() })
        } else {
            checkpoint::load::<J::Config, J::Record>(&dir, self.settings.unchecked())
        };
        // (A loaded state records one entry per epoch done, so its count fits.)
        let mine = loaded.as_ref().map_or(-1, |l| {
            i64::try_from(l.state.epochs_done).unwrap_or(i64::MAX)
        });
        let all = self
            .comm()
            .all_gather(vec![mine])
            .wait()
            .map_err(JobError::collective(
                "agreeing on the checkpoint to resume from",
            ))?;
        let target = all.iter().copied().max().expect("a job has a rank");
        if target < 0 {
            if !self.settings.resume {
                self.say_restart(restart, 0, None);
                return Ok(None);
            }
            return Err(loaded.err().unwrap_or(JobError::NoCheckpoint { dir }));
        }
        // Ranks whose directory lacks the newest (a node without the others' storage, a damaged
        // copy) receive it from the lowest rank that holds it.
        let holder = loaded.as_ref().ok().filter(|_| mine == target);
        let shared = bonfire::checkpoint::share_newest(
            self.comm(),
            &dir,
            &all,
            holder.map(|l| l.dir.as_path()),
        )
        .map_err(JobError::ShareCheckpoint)?;
        let target = target as usize;
        let loaded = if mine == target as i64 {
            loaded?
        } else {
            checkpoint::load_at_most::<J::Config, J::Record>(
                &dir,
                target,
                self.settings.unchecked(),
            )?
        };
        if loaded.state.epochs_done != target {
            return Err(JobError::CheckpointMismatch {
                rank: all.iter().position(|&e| e == target as i64).unwrap_or(0),
                found: Some(target),
                dir,
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
        if let Some(shared) = shared {
            let text = format!(
                "rank(s) {:?} had no usable epoch-{target} in their checkpoint directory; rank {} \
                 sent it ({} bytes, checked against its SHA-256 sums)",
                shared.to, shared.from, shared.bytes
            );
            self.say(Say::Notice, &text);
        }
        self.say_restart(restart, target, Some(&loaded.dir));
        Ok(Some(loaded))
    }

    /// Under a restart, rank 0 says where the run continues and how many steps are trained
    /// again (from the progress rank 0 noted before the failure).
    fn say_restart(&mut self, restart: u32, epochs_done: usize, from: Option<&std::path::Path>) {
        if restart == 0 || !self.is_main() {
            return;
        }
        let redone = read_progress(&self.settings.checkpoint_dir)
            .map(|p| p.steps_since(epochs_done))
            .unwrap_or(0);
        let from = match from {
            Some(dir) => format!("resuming from {}", dir.display()),
            None => "starting afresh (no checkpoint yet)".to_string(),
        };
        let text = format!(
            "restart {restart}: {from}; {redone} step{} done before the failure {} trained again",
            if redone == 1 { "" } else { "s" },
            if redone == 1 { "is" } else { "are" },
        );
        self.say(Say::Notice, &text);
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

    /// A per-rank checkpoint of `state` (ZeRO-3): rank 0 makes the checkpoint's staging
    /// directory, every rank writes its own files there with `write` (a collective:
    /// `bonfire::save_sharded_checkpoint`), and once every rank is done rank 0 adds the state and
    /// the sums and moves it into place (then deletes all but the newest `keep_checkpoints`).
    /// Collective over the job's ranks.
    ///
    /// It needs a checkpoint directory every rank shares. When some rank does not see rank 0's
    /// staging directory (nodes without shared storage) nothing is written and it returns
    /// [`PerRank::NotShared`]: the caller writes a whole checkpoint instead, as rank 0 alone.
    pub(crate) fn save_per_rank<R: Serialize>(
        &self,
        state: &State<J::Config, R>,
        write: impl FnOnce(&std::path::Path) -> Result<(), JobError>,
    ) -> Result<PerRank, JobError> {
        let root = &self.settings.checkpoint_dir;
        let comm = self.comm();
        let during = "agreeing on a per-rank checkpoint's directory";
        let tmp = checkpoint::staging(root, state.epochs_done);
        // Rank 0's staging directory, with a token no earlier run left: every rank must see it.
        // Rank 0 sends -1 when it could not make it, so that every rank fails at once.
        let made = if self.is_main() {
            Some(make_staging(root, state.epochs_done))
        } else {
            None
        };
        let token = match &made {
            Some(Ok(token)) => *token,
            Some(Err(_)) => -1,
            None => 0,
        };
        let token = comm
            .broadcast(vec![token], 0)
            .wait()
            .map_err(JobError::collective(during))?[0];
        if let Some(Err(e)) = made {
            return Err(e);
        }
        if token < 0 {
            return Err(JobError::ShardedCheckpoint(
                bonfire::ShardedCheckpointError::Incomplete {
                    dir: tmp,
                    problem: "rank 0 could not make it (its own error says why)".into(),
                },
            ));
        }
        let seen =
            std::fs::read_to_string(tmp.join(TOKEN)).is_ok_and(|t| t.trim() == token.to_string());
        let all = comm
            .all_gather(vec![i64::from(seen)])
            .wait()
            .map_err(JobError::collective(during))?;
        if all.contains(&0) {
            if self.is_main() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            return Ok(PerRank::NotShared {
                blind: (0..all.len()).filter(|&r| all[r] == 0).collect(),
            });
        }
        // `write` fails on every rank together where its collective is reached; a failure after
        // it (the manifest) is carried by the barrier, so that rank 0 never completes a
        // checkpoint a rank did not finish.
        let wrote = write(&tmp);
        let done = comm
            .all_gather(vec![i64::from(wrote.is_ok())])
            .wait()
            .map_err(JobError::collective(
                "waiting for every rank's checkpoint file",
            ))?;
        wrote?;
        if let Some(r) = done.iter().position(|&ok| ok == 0) {
            return Err(JobError::ShardedCheckpoint(
                bonfire::ShardedCheckpointError::Incomplete {
                    dir: tmp,
                    problem: format!("rank {r} could not write its part (its own error says why)"),
                },
            ));
        }
        if !self.is_main() {
            return Ok(PerRank::Saved(None));
        }
        let path = tmp.join(TOKEN);
        std::fs::remove_file(&path).map_err(JobError::io(&path))?;
        let dir = checkpoint::save_sharded(root, &tmp, state)?;
        if let Some(keep) = self.settings.keep_checkpoints {
            checkpoint::prune(root, keep)?;
        }
        Ok(PerRank::Saved(Some(dir)))
    }

    /// Rank 0 says, once per process, that ranks `blind` do not see its checkpoint directory
    /// ([`PerRank::NotShared`]), so checkpoints hold the whole model and state.
    pub(crate) fn say_not_shared(&mut self, blind: &[usize]) {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if self.is_main() && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            let line = format!(
                "checkpoints: rank(s) {blind:?} do not see rank 0's checkpoint directory, so \
                 each checkpoint holds the whole model and state, written by rank 0 (per-rank \
                 checkpoints need a directory every rank shares)"
            );
            self.say(Say::Report, &line);
        }
    }

    /// Rank 0's `bytes` on every rank (the others pass anything, e.g. nothing); `during` says
    /// what for, in an error.
    pub fn broadcast_bytes(
        &self,
        bytes: Vec<u8>,
        during: &'static str,
    ) -> Result<Vec<u8>, JobError> {
        let comm = self.comm();
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

    /// Rank 0's `module` on every rank (a collective): rank 0 encodes it and sends it, and every
    /// rank, rank 0 too, loads it into its own (values and ids), as whole tensors. Not for a
    /// module whose tensors are read through a collective (ZeRO-3's gathers), which only rank 0
    /// would run.
    pub fn rank0_module<B: Backend, M: Module<B>>(
        &self,
        module: M,
        device: &B::Device,
        during: &'static str,
    ) -> Result<M, JobError> {
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let mine = if self.is_main() {
            recorder
                .record(module.clone().into_record(), ())
                .map_err(|source| JobError::EncodeRecord {
                    what: "model",
                    source,
                })?
        } else {
            Vec::new()
        };
        let bytes = self.broadcast_bytes(mine, during)?;
        let record = recorder.load(bytes, device).map_err(JobError::Rank0Model)?;
        Ok(module.load_record(record))
    }

    /// The element-wise sum of every rank's `values`; `during` says what for, in an error.
    pub fn sum(&self, values: Vec<f64>, during: &'static str) -> Result<Vec<f64>, JobError> {
        self.comm()
            .all_reduce(values, ReduceOp::Sum)
            .wait()
            .map_err(JobError::collective(during))
    }
}

/// Every member's `mine` on the group's rank 0, in rank order; the others get `None` (a
/// collective: every member calls it). The lengths are all-gathered first, a small collective
/// that fails on every member naming a member that is dead or elsewhere; then each member sends
/// its bytes to rank 0 alone, which receives from all of them at once. The group moves the
/// bytes once, where an all-gather would copy all of them to everyone.
pub(crate) fn gather_to_root(
    group: &Communicator,
    mine: Vec<u8>,
    during: &'static str,
) -> Result<Option<Vec<Vec<u8>>>, JobError> {
    let lens = group
        .all_gather(vec![mine.len() as i64])
        .wait()
        .map_err(JobError::collective(during))?;
    if group.rank() != 0 {
        if !mine.is_empty() {
            group
                .send(mine, 0)
                .wait()
                .map_err(JobError::collective(during))?;
        }
        return Ok(None);
    }
    let recvs: Vec<_> = (1..group.size())
        .map(|r| {
            let n = lens[r].max(0) as usize;
            (n > 0).then(|| group.recv(vec![0u8; n], r))
        })
        .collect();
    let mut parts = Vec::with_capacity(group.size());
    parts.push(mine);
    for work in recvs {
        parts.push(match work {
            Some(w) => w.wait().map_err(JobError::collective(during))?,
            None => Vec::new(),
        });
    }
    Ok(Some(parts))
}

/// Every rank's bytes of `group` (`mine` on this one), in the group's rank order, on every
/// rank of it.
pub(crate) fn gather_bytes(
    group: &Communicator,
    mine: Vec<u8>,
    during: &'static str,
) -> Result<Vec<Vec<u8>>, JobError> {
    let lens = group
        .all_gather(vec![mine.len() as i64])
        .wait()
        .map_err(JobError::collective(during))?;
    let counts: Vec<usize> = lens.iter().map(|&n| n as usize).collect();
    let all = group
        .all_gather_uneven(mine, &counts)
        .wait()
        .map_err(JobError::collective(during))?;
    let mut parts = Vec::with_capacity(counts.len());
    let mut at = 0;
    for n in counts {
        parts.push(all[at..at + n].to_vec());
        at += n;
    }
    Ok(parts)
}
