//! Resuming a burn-train 0.22 run after a restart: [`resume_epoch`].

use std::path::{Path, PathBuf};

use burn::optim::OptimizerRecord;
use burn::optim::lr_scheduler::LrSchedulerRecord;
use burn::store::ModuleRecord;

use crate::World;
use crate::sync::SyncError;

/// The three files of burn-train's default checkpoint of epoch `n` under `dir`.
fn files(dir: &Path, n: usize) -> [PathBuf; 3] {
    ["model", "optim", "scheduler"].map(|name| dir.join(format!("{name}-{n}.bpk")))
}

/// Whether all three records of epoch `n` load (a rank killed while writing leaves a file that
/// does not); why not otherwise.
fn loads(dir: &Path, n: usize) -> Result<(), String> {
    let [model, optim, scheduler] = files(dir, n);
    ModuleRecord::load(model.clone()).map_err(|e| format!("{}: {e}", model.display()))?;
    OptimizerRecord::load(optim.clone()).map_err(|e| format!("{}: {e}", optim.display()))?;
    LrSchedulerRecord::load(scheduler.clone())
        .map_err(|e| format!("{}: {e}", scheduler.display()))?;
    Ok(())
}

/// The epochs of the checkpoints under `dir`, newest first.
fn epochs(dir: &Path) -> Vec<usize> {
    let mut found: Vec<usize> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("model-")?
                .strip_suffix(".bpk")?
                .parse()
                .ok()
        })
        .collect();
    found.sort_unstable_by(|a, b| b.cmp(a));
    found
}

/// On every rank, before `SupervisedTraining::launch`: the newest epoch whose burn-train
/// checkpoint (`with_default_checkpointers`: `ARTIFACTS/checkpoint/{model,optim,scheduler}-N.bpk`)
/// every rank can load, for `.checkpoint(n)`; `None` when some rank has none, and the run
/// starts from scratch. A checkpoint whose files do not load (a rank killed while writing
/// them) is passed over for the one before, with a warning. Every rank gets the same answer.
///
/// Under `bonfire launch --max-restarts N`, a program that calls it continues after a failure
/// from the last checkpoint every rank reaches instead of from the first epoch.
///
/// ```no_run
/// # use burn::train::{LearnerModel, SupervisedTraining};
/// # fn f<M: LearnerModel>(training: SupervisedTraining<M>, world: &bonfire_burn022::World) -> Result<(), bonfire_burn022::SyncError> {
/// let training = training.with_default_checkpointers();
/// let training = match bonfire_burn022::resume_epoch(world, "artifacts")? {
///     Some(epoch) => training.checkpoint(epoch),
///     None => training,
/// };
/// # let _ = training; Ok(()) }
/// ```
pub fn resume_epoch(
    world: &World,
    artifacts: impl AsRef<Path>,
) -> Result<Option<usize>, SyncError> {
    let dir = artifacts.as_ref().join("checkpoint");
    let mut readable = Vec::new();
    for n in epochs(&dir) {
        match loads(&dir, n) {
            Ok(()) => readable.push(n),
            Err(why) => tracing::warn!("passing over the checkpoint of epoch {n}: {why}"),
        }
    }
    let comm = world.comm();
    let collective = |source| SyncError::Collective {
        what: "resume_epoch",
        bucket: 0,
        buckets: 1,
        values: 1,
        ranks: comm.size(),
        source: Box::new(source),
    };
    let mine = readable.first().map_or(-1, |&n| n as i64);
    let newest = comm.all_gather(vec![mine]).wait().map_err(collective)?;
    let agreed = newest.iter().copied().min().unwrap_or(-1);
    if agreed < 0 {
        return Ok(None);
    }
    let agreed = agreed as usize;
    // A rank may lack the agreed epoch though it has newer ones: then every rank says so.
    let has = comm
        .all_gather(vec![i64::from(readable.contains(&agreed))])
        .wait()
        .map_err(collective)?;
    let lacking: Vec<usize> = (0..has.len()).filter(|&r| has[r] == 0).collect();
    if !lacking.is_empty() {
        return Err(SyncError::Resume {
            epoch: agreed,
            lacking,
            dir,
        });
    }
    Ok(Some(agreed))
}
