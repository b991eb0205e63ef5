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
/// every rank can load, for `.checkpoint(n)`; `None` when the ranks share none, and the run
/// starts from scratch. A checkpoint whose files do not load (a rank killed while writing
/// them) is passed over for the one before, with a warning. Every rank gets the same answer;
/// an error when the ranks' files of that epoch differ (directories that are not one, holding
/// other runs).
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
    // Rounds in lockstep: every decision below comes from gathered values, the same on every
    // rank. Each round offers every rank's newest readable epoch at or below the candidate.
    let mut candidate = i64::MAX;
    loop {
        let mine = readable
            .iter()
            .map(|&n| n as i64)
            .find(|&n| n <= candidate)
            .unwrap_or(-1);
        let offers = comm.all_gather(vec![mine]).wait().map_err(collective)?;
        let epoch = offers.iter().copied().min().unwrap_or(-1);
        if epoch < 0 {
            return Ok(None);
        }
        let has = i64::from(readable.contains(&(epoch as usize)));
        let all = comm.all_gather(vec![has]).wait().map_err(collective)?;
        if all.iter().all(|&h| h == 1) {
            let epoch = epoch as usize;
            // The same epoch, but the same files? (Separate directories may hold other runs.)
            let sums = comm
                .all_gather(vec![digest(&dir, epoch) as i64])
                .wait()
                .map_err(collective)?;
            let differ: Vec<usize> = (0..sums.len()).filter(|&r| sums[r] != sums[0]).collect();
            if !differ.is_empty() {
                return Err(SyncError::Resume { epoch, differ, dir });
            }
            return Ok(Some(epoch));
        }
        candidate = epoch - 1;
    }
}

/// A digest of the three files of epoch `n` (FNV-1a over their bytes).
fn digest(dir: &Path, n: usize) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for path in files(dir, n) {
        for b in std::fs::read(&path).unwrap_or_default() {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}
