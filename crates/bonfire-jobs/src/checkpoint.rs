//! Atomic, checked checkpoints: one directory per epoch (`epoch-N/` with the model, the optimizer
//! state, `state.json` and `SHA256SUMS`, the SHA-256 of each of the three), written under a
//! temporary name and renamed into place, then `latest` (the name of the newest one) replaced the
//! same way. A job killed at any moment leaves the previous checkpoint whole and `latest` naming
//! a complete one.
//!
//! Loading checks every file against `SHA256SUMS`. A checkpoint that fails (a file missing,
//! truncated or changed on disk) is skipped, with the reason kept for the caller to report, and
//! the next older one is tried; only when none is usable does loading fail, naming each
//! problem. Checkpoints written before checksums existed (no `SHA256SUMS`) load unchecked.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::JobError;

/// Everything a checkpoint holds but the tensors: the settings that decide the result (`C`),
/// and what each epoch measured (`R`). Written as `state.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State<C, R> {
    /// The settings that decide the run's result; a resumed run keeps them.
    pub config: C,
    /// Epochs the run was asked for.
    pub epochs: usize,
    /// Epochs trained so far.
    pub epochs_done: usize,
    /// One record per epoch trained.
    pub history: Vec<R>,
}

impl<C, R> State<C, R> {
    /// A run of `epochs` epochs with nothing trained yet.
    pub fn new(config: C, epochs: usize) -> Self {
        State {
            config,
            epochs,
            epochs_done: 0,
            history: Vec::new(),
        }
    }
}

/// A checkpoint read back.
#[derive(Clone, Debug)]
pub struct Checkpoint<C, R> {
    /// Its directory (`<root>/epoch-N`).
    pub dir: PathBuf,
    /// Its state.
    pub state: State<C, R>,
    /// The model's record, as the job wrote it.
    pub model: Vec<u8>,
    /// The optimizer's record, as the job wrote it.
    pub optimizer: Vec<u8>,
    /// The newer checkpoints that failed their check and were passed over, newest first, each
    /// as `epoch-N: what is wrong`; empty when the newest one was used.
    pub skipped: Vec<String>,
}

use bonfire::checkpoint::{LATEST, SUMS, epochs, recorded_sum, sha256_hex as sha256, sums_text};

const STATE: &str = "state.json";
const MODEL: &str = "model.bin";
const OPTIMIZER: &str = "optimizer.bin";

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), JobError> {
    let mut f = fs::File::create(path).map_err(JobError::io(path))?;
    f.write_all(bytes).map_err(JobError::io(path))?;
    f.sync_all().map_err(JobError::io(path))
}

/// Writes checkpoint `epoch-<epochs_done>` under `root` and points `latest` at it; returns its
/// directory.
pub fn save<C: Serialize, R: Serialize>(
    root: &Path,
    state: &State<C, R>,
    model: &[u8],
    optimizer: &[u8],
) -> Result<PathBuf, JobError> {
    let name = format!("epoch-{}", state.epochs_done);
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(JobError::io(&tmp))?;
    let json = serde_json::to_vec_pretty(state).map_err(JobError::EncodeState)?;
    let files = [(MODEL, model), (OPTIMIZER, optimizer), (STATE, &json[..])];
    for (name, bytes) in files {
        write_synced(&tmp.join(name), bytes)?;
    }
    let sums = sums_text(files);
    write_synced(&tmp.join(SUMS), sums.as_bytes())?;
    let dir = root.join(&name);
    if dir.exists() {
        // Left by a run that died between this rename and updating `latest`; never the one
        // `latest` names (that one has a lower epoch).
        fs::remove_dir_all(&dir).map_err(JobError::io(&dir))?;
    }
    fs::rename(&tmp, &dir).map_err(JobError::io(&dir))?;
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, name.as_bytes())?;
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(JobError::io(root))?;
    Ok(dir)
}

/// The newest complete checkpoint under `root`, if `latest` names one.
pub fn latest(root: &Path) -> Result<Option<PathBuf>, JobError> {
    let path = root.join(LATEST);
    match fs::read_to_string(&path) {
        Ok(name) => Ok(Some(root.join(name.trim()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(JobError::Io { path, source: e }),
    }
}

/// Where to look for a checkpoint, in order: the one `latest` names, then every other
/// `epoch-N` directory, newest first. Fails when there is no `latest`.
fn candidates(root: &Path) -> Result<Vec<PathBuf>, JobError> {
    let newest = latest(root)?.ok_or_else(|| JobError::NoCheckpoint {
        dir: root.to_path_buf(),
    })?;
    let older = epochs(root).into_iter().map(|(_, p)| p);
    Ok(std::iter::once(newest.clone())
        .chain(older.filter(|p| *p != newest))
        .collect())
}

/// Deletes every `epoch-N` checkpoint under `root` but the newest `keep` (at least one: the one
/// `latest` names is never deleted).
pub fn prune(root: &Path, keep: usize) -> Result<(), JobError> {
    let all = candidates(root)?;
    for dir in all.into_iter().skip(keep.max(1)) {
        fs::remove_dir_all(&dir).map_err(JobError::io(&dir))?;
    }
    Ok(())
}

/// Reads and checks the checkpoint in `dir`; the error says what is wrong with it.
fn read_checked<C: DeserializeOwned, R: DeserializeOwned>(
    dir: &Path,
) -> Result<Checkpoint<C, R>, String> {
    let read = |name: &str| fs::read(dir.join(name)).map_err(|e| format!("{name}: {e}"));
    let (model, optimizer, state) = (read(MODEL)?, read(OPTIMIZER)?, read(STATE)?);
    match fs::read_to_string(dir.join(SUMS)) {
        Ok(sums) => {
            for (name, bytes) in [(MODEL, &model), (OPTIMIZER, &optimizer), (STATE, &state)] {
                let recorded = recorded_sum(&sums, name)
                    .ok_or_else(|| format!("{SUMS} has no line for {name}"))?;
                let found = sha256(bytes);
                if found != recorded {
                    return Err(format!(
                        "{name} does not match its checksum ({} bytes, SHA-256 {}..., \
                         recorded {}...)",
                        bytes.len(),
                        &found[..12],
                        recorded.get(..12).unwrap_or(recorded)
                    ));
                }
            }
        }
        // Written before checkpoints carried checksums: nothing to check against.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{SUMS}: {e}")),
    }
    let state = serde_json::from_slice(&state)
        .map_err(|e| format!("{STATE}: not a bonfire checkpoint state ({e})"))?;
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        state,
        model,
        optimizer,
        skipped: Vec::new(),
    })
}

/// Reads the newest usable checkpoint under `root`: the one `latest` names if it passes its
/// check, else the newest older one that does (the ones passed over are in
/// [`Checkpoint::skipped`]).
pub fn load<C: DeserializeOwned, R: DeserializeOwned>(
    root: &Path,
) -> Result<Checkpoint<C, R>, JobError> {
    load_at_most(root, usize::MAX)
}

/// As [`load`], among the checkpoints of at most `epochs_done` epochs: the newest usable one
/// that every rank of a job can read, when another rank's newest is older than this one's.
pub fn load_at_most<C: DeserializeOwned, R: DeserializeOwned>(
    root: &Path,
    epochs_done: usize,
) -> Result<Checkpoint<C, R>, JobError> {
    let mut skipped = Vec::new();
    for dir in candidates(root)? {
        match read_checked::<C, R>(&dir) {
            Ok(checkpoint) if checkpoint.state.epochs_done > epochs_done => {}
            Ok(checkpoint) => {
                return Ok(Checkpoint {
                    skipped,
                    ..checkpoint
                });
            }
            Err(why) => {
                let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
                skipped.push(format!("{}: {why}", name.unwrap_or_default()));
            }
        }
    }
    Err(JobError::NoUsableCheckpoint {
        dir: root.to_path_buf(),
        problems: skipped,
    })
}

/// Reads only the state of the checkpoint [`load`] would use, or `None` when there is no
/// checkpoint.
pub fn load_state<C: DeserializeOwned, R: DeserializeOwned>(
    root: &Path,
) -> Result<Option<State<C, R>>, JobError> {
    if latest(root)?.is_none() {
        return Ok(None);
    }
    load(root).map(|c| Some(c.state))
}

#[cfg(test)]
mod tests {
    use super::*;

    type S = State<String, u32>;

    fn state(epochs_done: usize) -> S {
        State {
            config: "mnist".into(),
            epochs: 3,
            epochs_done,
            history: vec![7; epochs_done],
        }
    }

    #[test]
    fn the_latest_complete_checkpoint_is_read_back() {
        let root = std::env::temp_dir().join(format!("bonfire-ckpt-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        assert!(latest(&root).unwrap().is_none());
        assert!(load_state::<String, u32>(&root).unwrap().is_none());
        let e = load::<String, u32>(&root).err().unwrap().to_string();
        assert!(e.contains("no checkpoint to resume from"), "{e}");
        save(&root, &state(1), b"m1", b"o1").unwrap();
        // A half-written epoch 2 (killed before its rename) is ignored.
        fs::create_dir_all(root.join(".epoch-2.tmp")).unwrap();
        fs::write(root.join(".epoch-2.tmp/model.bin"), b"partial").unwrap();
        let l = load::<String, u32>(&root).unwrap();
        assert_eq!(
            (l.state, l.model, l.optimizer),
            (state(1), b"m1".to_vec(), b"o1".to_vec())
        );
        save(&root, &state(2), b"m2", b"o2").unwrap();
        let l = load::<String, u32>(&root).unwrap();
        assert_eq!((l.state.epochs_done, l.model), (2, b"m2".to_vec()));
        assert_eq!(load_state(&root).unwrap(), Some(state(2)));
        assert!(root.join("epoch-1/model.bin").exists() && !root.join(".epoch-2.tmp").exists());
        fs::remove_dir_all(&root).unwrap();
    }

    fn fresh_root(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("bonfire-ckpt-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        root
    }

    #[test]
    fn a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one() {
        let root = fresh_root("damaged");
        for e in 1..=3 {
            let m = format!("model {e}");
            save(&root, &state(e), m.as_bytes(), b"optimizer").unwrap();
        }
        assert!(root.join("epoch-3/SHA256SUMS").exists());
        // Epoch 3's model changes on disk (one byte), epoch 2's state is torn.
        let model = root.join("epoch-3/model.bin");
        let mut bytes = fs::read(&model).unwrap();
        bytes[0] ^= 1;
        fs::write(&model, &bytes).unwrap();
        let json = root.join("epoch-2/state.json");
        let len = fs::metadata(&json).unwrap().len();
        fs::OpenOptions::new()
            .write(true)
            .open(&json)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let l = load::<String, u32>(&root).unwrap();
        assert_eq!((l.state.epochs_done, l.model), (1, b"model 1".to_vec()));
        assert_eq!(l.dir, root.join("epoch-1"));
        assert_eq!(l.skipped.len(), 2, "{:?}", l.skipped);
        assert!(
            l.skipped[0].starts_with("epoch-3: model.bin does not match its checksum (7 bytes"),
            "{}",
            l.skipped[0]
        );
        assert!(
            l.skipped[1].starts_with("epoch-2: state.json does not match its checksum"),
            "{}",
            l.skipped[1]
        );
        assert_eq!(load_state(&root).unwrap(), Some(state(1)));
        // With every checkpoint damaged, loading fails and names each problem.
        fs::remove_file(root.join("epoch-1/optimizer.bin")).unwrap();
        let e = load::<String, u32>(&root).err().unwrap();
        assert!(
            matches!(e, JobError::NoUsableCheckpoint { ref problems, .. } if problems.len() == 3)
        );
        let e = e.to_string();
        assert!(
            e.contains("holds no usable checkpoint") && e.contains("epoch-1: optimizer.bin"),
            "{e}"
        );
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn pruning_keeps_the_newest_checkpoints() {
        let root = fresh_root("prune");
        for e in 1..=4 {
            save(&root, &state(e), b"m", b"o").unwrap();
        }
        prune(&root, 2).unwrap();
        let mut left: Vec<String> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["epoch-3", "epoch-4", "latest"]);
        prune(&root, 0).unwrap();
        assert!(root.join("epoch-4").exists() && !root.join("epoch-3").exists());
        assert_eq!(load::<String, u32>(&root).unwrap().state.epochs_done, 4);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn checkpoints_without_checksums_still_load_and_garbage_state_is_refused() {
        let root = fresh_root("legacy");
        save(&root, &state(1), b"m1", b"o1").unwrap();
        // As written before checkpoints carried checksums.
        fs::remove_file(root.join("epoch-1/SHA256SUMS")).unwrap();
        assert_eq!(load::<String, u32>(&root).unwrap().model, b"m1".to_vec());
        fs::write(root.join("epoch-1/state.json"), b"{").unwrap();
        let e = load::<String, u32>(&root).err().unwrap().to_string();
        assert!(
            e.contains("epoch-1: state.json: not a bonfire checkpoint state"),
            "{e}"
        );
        fs::remove_dir_all(&root).unwrap();
    }
}
