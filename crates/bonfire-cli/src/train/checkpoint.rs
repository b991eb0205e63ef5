//! Checkpoints of `bonfire train vision`: one directory per epoch (`epoch-N/` with the model, the
//! optimizer state and `state.json`), written under a temporary name and renamed into place, then
//! `latest` (the name of the newest one) replaced the same way. A job killed at any moment leaves
//! the previous checkpoint whole and `latest` naming a complete one.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The settings that decide a run's result; a resumed run must have the same ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RunConfig {
    pub(crate) dataset: String,
    pub(crate) ranks: usize,
    pub(crate) batch: usize,
    pub(crate) lr: f64,
    pub(crate) lr_decay: f64,
    pub(crate) width: usize,
    pub(crate) seed: u64,
    pub(crate) bf16: bool,
    pub(crate) train_limit: Option<usize>,
    pub(crate) test_limit: Option<usize>,
}

/// What one epoch measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct EpochRecord {
    pub(crate) epoch: usize,
    pub(crate) train_loss: f64,
    pub(crate) train_accuracy: f64,
    pub(crate) test_loss: f64,
    pub(crate) test_accuracy: f64,
    pub(crate) test_correct: u64,
    pub(crate) test_images: u64,
    pub(crate) images_per_second: f64,
    pub(crate) seconds: f64,
    /// Mean training loss over stretches of the epoch: (epoch as a fraction, loss).
    pub(crate) curve: Vec<(f64, f64)>,
    /// SHA-256 of the parameters after the epoch (see the report's `weights digest`).
    pub(crate) param_digest: String,
}

/// Everything but the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct State {
    pub(crate) config: RunConfig,
    /// Epochs the run was asked for.
    pub(crate) epochs: usize,
    pub(crate) epochs_done: usize,
    pub(crate) history: Vec<EpochRecord>,
}

/// A checkpoint read back.
pub(crate) struct Loaded {
    pub(crate) dir: PathBuf,
    pub(crate) state: State,
    pub(crate) model: Vec<u8>,
    pub(crate) optimizer: Vec<u8>,
}

const LATEST: &str = "latest";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> String + '_ {
    move |e| format!("{}: {e}", path.display())
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let mut f = fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

/// Writes checkpoint `epoch-<epochs_done>` under `root` and points `latest` at it.
pub(crate) fn save(
    root: &Path,
    state: &State,
    model: &[u8],
    optimizer: &[u8],
) -> Result<PathBuf, String> {
    let name = format!("epoch-{}", state.epochs_done);
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    write_synced(&tmp.join("model.bin"), model)?;
    write_synced(&tmp.join("optimizer.bin"), optimizer)?;
    let json = serde_json::to_vec_pretty(state).map_err(|e| e.to_string())?;
    write_synced(&tmp.join("state.json"), &json)?;
    let dir = root.join(&name);
    if dir.exists() {
        // Left by a run that died between this rename and updating `latest`; never the one
        // `latest` names (that one has a lower epoch).
        fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    fs::rename(&tmp, &dir).map_err(io(&dir))?;
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, name.as_bytes())?;
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(io(root))?;
    Ok(dir)
}

/// The newest complete checkpoint under `root`, if `latest` names one.
pub(crate) fn latest(root: &Path) -> Result<Option<PathBuf>, String> {
    let path = root.join(LATEST);
    match fs::read_to_string(&path) {
        Ok(name) => Ok(Some(root.join(name.trim()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Reads the checkpoint `latest` names under `root`.
pub(crate) fn load(root: &Path) -> Result<Loaded, String> {
    let dir = latest(root)?.ok_or_else(|| {
        format!(
            "{} holds no checkpoint to resume from (no `latest` file)",
            root.display()
        )
    })?;
    let read = |name: &str| {
        let p = dir.join(name);
        fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))
    };
    let state_path = dir.join("state.json");
    let state: State = serde_json::from_slice(&read("state.json")?).map_err(|e| {
        format!(
            "{}: not a bonfire checkpoint state ({e})",
            state_path.display()
        )
    })?;
    Ok(Loaded {
        model: read("model.bin")?,
        optimizer: read("optimizer.bin")?,
        state,
        dir,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(epochs_done: usize) -> State {
        State {
            config: RunConfig {
                dataset: "mnist".into(),
                ranks: 2,
                batch: 64,
                lr: 2e-3,
                lr_decay: 0.5,
                width: 8,
                seed: 1,
                bf16: false,
                train_limit: None,
                test_limit: Some(100),
            },
            epochs: 3,
            epochs_done,
            history: Vec::new(),
        }
    }

    #[test]
    fn the_latest_complete_checkpoint_is_read_back() {
        let root = std::env::temp_dir().join(format!("bonfire-ckpt-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        assert!(latest(&root).unwrap().is_none());
        let e = load(&root).err().unwrap();
        assert!(e.contains("no checkpoint to resume from"), "{e}");
        save(&root, &state(1), b"m1", b"o1").unwrap();
        // A half-written epoch 2 (killed before its rename) is ignored.
        fs::create_dir_all(root.join(".epoch-2.tmp")).unwrap();
        fs::write(root.join(".epoch-2.tmp/model.bin"), b"partial").unwrap();
        let l = load(&root).unwrap();
        assert_eq!(
            (l.state, l.model, l.optimizer),
            (state(1), b"m1".to_vec(), b"o1".to_vec())
        );
        save(&root, &state(2), b"m2", b"o2").unwrap();
        let l = load(&root).unwrap();
        assert_eq!((l.state.epochs_done, l.model), (2, b"m2".to_vec()));
        assert!(root.join("epoch-1/model.bin").exists() && !root.join(".epoch-2.tmp").exists());
        fs::remove_dir_all(&root).unwrap();
    }
}
