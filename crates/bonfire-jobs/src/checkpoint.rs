//! Atomic checkpoints: one directory per epoch (`epoch-N/` with the model, the optimizer state
//! and `state.json`), written under a temporary name and renamed into place, then `latest` (the
//! name of the newest one) replaced the same way. A job killed at any moment leaves the previous
//! checkpoint whole and `latest` naming a complete one.

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
}

const LATEST: &str = "latest";
const STATE: &str = "state.json";

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
    write_synced(&tmp.join("model.bin"), model)?;
    write_synced(&tmp.join("optimizer.bin"), optimizer)?;
    let json = serde_json::to_vec_pretty(state).map_err(JobError::EncodeState)?;
    write_synced(&tmp.join(STATE), &json)?;
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

fn latest_dir(root: &Path) -> Result<PathBuf, JobError> {
    latest(root)?.ok_or_else(|| JobError::NoCheckpoint {
        dir: root.to_path_buf(),
    })
}

fn read(dir: &Path, name: &str) -> Result<Vec<u8>, JobError> {
    let p = dir.join(name);
    fs::read(&p).map_err(JobError::io(p))
}

fn read_state<C: DeserializeOwned, R: DeserializeOwned>(
    dir: &Path,
) -> Result<State<C, R>, JobError> {
    let bytes = read(dir, STATE)?;
    serde_json::from_slice(&bytes).map_err(|source| JobError::BadState {
        path: dir.join(STATE),
        source,
    })
}

/// Reads the checkpoint `latest` names under `root`.
pub fn load<C: DeserializeOwned, R: DeserializeOwned>(
    root: &Path,
) -> Result<Checkpoint<C, R>, JobError> {
    let dir = latest_dir(root)?;
    let state = read_state(&dir)?;
    Ok(Checkpoint {
        model: read(&dir, "model.bin")?,
        optimizer: read(&dir, "optimizer.bin")?,
        state,
        dir,
    })
}

/// Reads only the state of the checkpoint `latest` names under `root`, or `None` when there is
/// no checkpoint.
pub fn load_state<C: DeserializeOwned, R: DeserializeOwned>(
    root: &Path,
) -> Result<Option<State<C, R>>, JobError> {
    match latest(root)? {
        Some(dir) => read_state(&dir).map(Some),
        None => Ok(None),
    }
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
        fs::write(root.join("epoch-2/state.json"), b"{").unwrap();
        let e = load::<String, u32>(&root).err().unwrap().to_string();
        assert!(e.contains("not a bonfire checkpoint state"), "{e}");
        fs::remove_dir_all(&root).unwrap();
    }
}
