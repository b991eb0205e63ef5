//! Atomic, checked checkpoints: one directory per epoch (`epoch-N/` with the model, the optimizer
//! state, `state.json` and `SHA256SUMS`, the SHA-256 of each of the three), written under a
//! temporary name and renamed into place, then `latest` (the name of the newest one) replaced the
//! same way. A job killed at any moment leaves the previous checkpoint whole and `latest` naming
//! a complete one.
//!
//! Loading checks every file against `SHA256SUMS`. A checkpoint that fails (a file missing,
//! truncated or changed on disk, no `SHA256SUMS` at all, a state whose epochs and records
//! disagree) is skipped, with the reason kept for the caller to report, and the next older one is
//! tried; only when none is usable does loading fail, naming each problem. Checkpoints without
//! `SHA256SUMS` (written before checksums existed) load only when asked ([`Unchecked::Allow`],
//! `--allow-unchecked`). `latest` is a hint: a name in it that is not an `epoch-N` of the
//! directory is passed over too. The model's and optimizer's bytes are decoded by [`decode`],
//! which fails with a message where Burn's own recorder would panic.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use bonfire::train::quietly;

use crate::JobError;

/// Whether a checkpoint without `SHA256SUMS` loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Unchecked {
    /// It is passed over, as a damaged one is (the default).
    #[default]
    Refuse,
    /// It loads unchecked (`--allow-unchecked`): for checkpoints written before bonfire
    /// checksummed them.
    Allow,
}

impl Unchecked {
    /// [`Unchecked::Allow`] when `allow` (the `--allow-unchecked` flag), else the default.
    pub fn allowed(allow: bool) -> Self {
        if allow {
            Unchecked::Allow
        } else {
            Unchecked::Refuse
        }
    }
}

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
    /// The model's record, as the job wrote it (empty in a per-rank checkpoint).
    pub model: Vec<u8>,
    /// The optimizer's record, as the job wrote it (empty in a per-rank checkpoint).
    pub optimizer: Vec<u8>,
    /// A per-rank checkpoint of a ZeRO-3 run (`manifest.json` and each rank's file, which
    /// `bonfire::load_sharded_checkpoint` reads): its directory, this one; `None` when the
    /// checkpoint holds the whole model and state.
    pub shards: Option<PathBuf>,
    /// The newer checkpoints that failed their check and were passed over, newest first, each
    /// as `epoch-N: what is wrong`; empty when the newest one was used.
    pub skipped: Vec<String>,
}

use bonfire::checkpoint::{
    LATEST, SUMS, epoch_of, epochs, recorded_sum, sha256_hex as sha256, sums_text,
};

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
    let tmp = begin(root, state.epochs_done)?;
    let json = serde_json::to_vec_pretty(state).map_err(JobError::EncodeState)?;
    let files = [(MODEL, model), (OPTIMIZER, optimizer), (STATE, &json[..])];
    for (name, bytes) in files {
        write_synced(&tmp.join(name), bytes)?;
    }
    finish(root, &tmp, state.epochs_done, &sums_text(files))
}

/// The temporary directory checkpoint `epoch-<epochs_done>` is written in under `root`, made
/// empty.
pub(crate) fn staging(root: &Path, epochs_done: usize) -> PathBuf {
    root.join(format!(".epoch-{epochs_done}.tmp"))
}

/// Makes [`staging`]'s directory, empty, and returns it.
pub(crate) fn begin(root: &Path, epochs_done: usize) -> Result<PathBuf, JobError> {
    let tmp = staging(root, epochs_done);
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(JobError::io(&tmp))?;
    Ok(tmp)
}

/// Completes a per-rank checkpoint whose ranks have written their files and its manifest
/// (`bonfire::save_sharded_checkpoint`) in `tmp` ([`begin`]): writes the state and the sums of
/// the state and the manifest (which holds every rank file's), then moves it into place as
/// [`save`] does.
pub(crate) fn save_sharded<C: Serialize, R: Serialize>(
    root: &Path,
    tmp: &Path,
    state: &State<C, R>,
) -> Result<PathBuf, JobError> {
    let json = serde_json::to_vec_pretty(state).map_err(JobError::EncodeState)?;
    write_synced(&tmp.join(STATE), &json)?;
    let path = tmp.join(bonfire::backend::tensor_parallel::MANIFEST);
    let manifest = fs::read(&path).map_err(JobError::io(&path))?;
    let files = [
        (bonfire::backend::tensor_parallel::MANIFEST, &manifest[..]),
        (STATE, &json[..]),
    ];
    finish(root, tmp, state.epochs_done, &sums_text(files))
}

/// Writes `sums` in `tmp`, renames it to `epoch-<epochs_done>` and points `latest` at it.
fn finish(root: &Path, tmp: &Path, epochs_done: usize, sums: &str) -> Result<PathBuf, JobError> {
    let name = format!("epoch-{epochs_done}");
    write_synced(&tmp.join(SUMS), sums.as_bytes())?;
    let dir = root.join(&name);
    if dir.exists() {
        // Left by a run that died between this rename and updating `latest`; never the one
        // `latest` names (that one has a lower epoch).
        fs::remove_dir_all(&dir).map_err(JobError::io(&dir))?;
    }
    fs::rename(tmp, &dir).map_err(JobError::io(&dir))?;
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, name.as_bytes())?;
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(JobError::io(root))?;
    Ok(dir)
}

/// What `latest` under `root` says: `None` when there is no `latest`; the directory it names
/// when that is an `epoch-N` of `root`, else why not (a damaged or hostile `latest` never
/// points elsewhere: `../x`, an absolute path, `epoch-05`).
fn named_latest(root: &Path) -> Result<Option<Result<PathBuf, String>>, JobError> {
    let path = root.join(LATEST);
    match fs::read_to_string(&path) {
        Ok(name) => {
            let name = name.trim();
            Ok(Some(match epoch_of(name) {
                Some(_) => Ok(root.join(name)),
                None => Err(format!(
                    "{LATEST} names {:?}, not an epoch-N checkpoint of this directory",
                    name.chars().take(80).collect::<String>()
                )),
            }))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(JobError::Io { path, source: e }),
    }
}

/// The newest complete checkpoint under `root`, if it has a `latest`: the one `latest` names,
/// or the newest `epoch-N` when `latest` names none.
pub fn latest(root: &Path) -> Result<Option<PathBuf>, JobError> {
    Ok(match named_latest(root)? {
        None => None,
        Some(Ok(dir)) => Some(dir),
        Some(Err(_)) => epochs(root).into_iter().next().map(|(_, dir)| dir),
    })
}

/// Where to look for a checkpoint, in order: the one `latest` names, then every other
/// `epoch-N` directory, newest first; with why `latest` was passed over, if it was. Fails when
/// there is no `latest`.
fn candidates(root: &Path) -> Result<(Vec<PathBuf>, Vec<String>), JobError> {
    let (newest, notes) = match named_latest(root)? {
        None => {
            return Err(JobError::NoCheckpoint {
                dir: root.to_path_buf(),
            });
        }
        Some(Ok(dir)) => (Some(dir), Vec::new()),
        Some(Err(why)) => (None, vec![why]),
    };
    let older: Vec<PathBuf> = epochs(root)
        .into_iter()
        .map(|(_, p)| p)
        .filter(|p| Some(p) != newest.as_ref())
        .collect();
    Ok((newest.into_iter().chain(older).collect(), notes))
}

/// Deletes every `epoch-N` checkpoint under `root` but the newest `keep` (at least one: the one
/// `latest` names is never deleted).
pub fn prune(root: &Path, keep: usize) -> Result<(), JobError> {
    let (all, _) = candidates(root)?;
    for dir in all.into_iter().skip(keep.max(1)) {
        fs::remove_dir_all(&dir).map_err(JobError::io(&dir))?;
    }
    Ok(())
}

/// Reads and checks the checkpoint in `dir`; the error says what is wrong with it.
fn read_checked<C: DeserializeOwned, R: DeserializeOwned>(
    dir: &Path,
    unchecked: Unchecked,
) -> Result<Checkpoint<C, R>, String> {
    let read = |name: &str| fs::read(dir.join(name)).map_err(|e| format!("{name}: {e}"));
    // A per-rank checkpoint (ZeRO-3) holds a manifest and each rank's file instead of the
    // model's and the optimizer's records; the manifest holds the sum of every rank's file,
    // which the rank that reads one checks.
    let manifest = bonfire::backend::tensor_parallel::MANIFEST;
    let sharded = dir.join(manifest).exists();
    let (model, optimizer, state) = if sharded {
        (read(manifest)?, Vec::new(), read(STATE)?)
    } else {
        (read(MODEL)?, read(OPTIMIZER)?, read(STATE)?)
    };
    let checked: Vec<(&str, &Vec<u8>)> = if sharded {
        vec![(manifest, &model), (STATE, &state)]
    } else {
        vec![(MODEL, &model), (OPTIMIZER, &optimizer), (STATE, &state)]
    };
    match fs::read_to_string(dir.join(SUMS)) {
        Ok(sums) => {
            for (name, bytes) in checked {
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
        // Written before checkpoints carried checksums, or damaged: nothing to check against.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if unchecked == Unchecked::Refuse {
                return Err(format!(
                    "no {SUMS} to check its files against (written before bonfire checksummed \
                     checkpoints, or damaged); --allow-unchecked loads it unchecked"
                ));
            }
        }
        Err(e) => return Err(format!("{SUMS}: {e}")),
    }
    if sharded {
        // Every rank's file there with its size (their sums are checked as each is read).
        bonfire::check_sharded_checkpoint(dir).map_err(|e| e.to_string())?;
    }
    let state: State<C, R> = serde_json::from_slice(&state)
        .map_err(|e| format!("{STATE}: not a bonfire checkpoint state ({e})"))?;
    if state.history.len() != state.epochs_done {
        return Err(format!(
            "{STATE} says {} epoch(s) done but records {}",
            state.epochs_done,
            state.history.len()
        ));
    }
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        state,
        model: if sharded { Vec::new() } else { model },
        optimizer,
        shards: sharded.then(|| dir.to_path_buf()),
        skipped: Vec::new(),
    })
}

/// Reads the newest usable checkpoint under `root`: the one `latest` names if it passes its
/// check, else the newest older one that does (the ones passed over are in
/// [`Checkpoint::skipped`]).
pub fn load<C: DeserializeOwned, R: DeserializeOwned>(
    root: &Path,
    unchecked: Unchecked,
) -> Result<Checkpoint<C, R>, JobError> {
    load_at_most(root, usize::MAX, unchecked)
}

/// As [`load`], among the checkpoints of at most `epochs_done` epochs: the newest usable one
/// that every rank of a job can read, when another rank's newest is older than this one's.
pub fn load_at_most<C: DeserializeOwned, R: DeserializeOwned>(
    root: &Path,
    epochs_done: usize,
    unchecked: Unchecked,
) -> Result<Checkpoint<C, R>, JobError> {
    let (candidates, mut skipped) = candidates(root)?;
    for dir in candidates {
        match read_checked::<C, R>(&dir, unchecked) {
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
    unchecked: Unchecked,
) -> Result<Option<State<C, R>>, JobError> {
    if latest(root)?.is_none() {
        return Ok(None);
    }
    load(root, unchecked).map(|c| Some(c.state))
}

/// Records under this many bytes decode with a limit of 8x it on what they claim (256 MiB).
const LIMIT_SMALL: usize = 32 << 20;
/// Records under this many bytes decode with a limit of 8x it (16 GiB); larger ones with 16 TiB.
const LIMIT_LARGE: usize = 2 << 30;

/// A record of Burn's binary format at full precision (what `BinBytesRecorder` writes and the
/// jobs' checkpoints hold), decoded without Burn's `unwrap`: bytes that are not such a record
/// (truncated, changed, another format) are an error saying so, not a panic or an abort; so is
/// a record with a tensor whose bytes do not hold its shape (checked before Burn converts it).
pub fn decode<B: burn::tensor::backend::Backend, R: burn::record::Record<B>>(
    bytes: &[u8],
    device: &B::Device,
) -> Result<R, String> {
    use burn::record::{BurnRecord, FullPrecisionSettings};
    type Item<B, R> = BurnRecord<<R as burn::record::Record<B>>::Item<FullPrecisionSettings>, B>;
    // The first line of an error: Burn's deserialisers append advice about its old formats.
    let first = |e: String| e.lines().next().unwrap_or_default().to_string();
    // Burn's deserialisers assert too (a shape whose element count overflows), so the decoding
    // runs where a panic is caught.
    let record = quietly(|| {
        // A damaged length must not allocate what no file of this size could hold: bincode
        // checks every claim against the configured limit (by tiers: it is a type parameter),
        // and the guard checks every tensor's shape against its bytes before Burn converts it.
        let standard = bincode::config::standard();
        match bytes.len() {
            0..LIMIT_SMALL => {
                guarded::<Item<B, R>, _>(bytes, standard.with_limit::<{ 8 * LIMIT_SMALL }>())
            }
            LIMIT_SMALL..LIMIT_LARGE => {
                guarded::<Item<B, R>, _>(bytes, standard.with_limit::<{ 8 * LIMIT_LARGE }>())
            }
            _ => guarded::<Item<B, R>, _>(bytes, standard.with_limit::<{ 1 << 44 }>()),
        }
    })
    .and_then(|decoded| decoded)
    .map_err(|why| {
        format!(
            "{} bytes that are not a Burn 0.21 binary record of this job ({})",
            bytes.len(),
            first(why)
        )
    })?;
    quietly(|| R::from_item(record.item, device)).map_err(|why| {
        format!(
            "{} bytes whose tensors do not hold their shapes ({})",
            bytes.len(),
            first(why)
        )
    })
}

/// `T` from bincode's serde encoding in `bytes`, through [`Guard`](crate::record_guard::Guard).
fn guarded<T: DeserializeOwned, C: bincode::config::Config>(
    bytes: &[u8],
    config: C,
) -> Result<T, String> {
    let mut decoder = bincode::serde::OwnedSerdeDecoder::from_reader(
        bincode::de::read::SliceReader::new(bytes),
        config,
    );
    T::deserialize(crate::record_guard::Guard(decoder.as_deserializer())).map_err(|e| e.to_string())
}

/// `model` with the parameters of the model record `bytes` (a checkpoint's `model.bin`, from
/// the checkpoint in `dir`): [`decode`], then Burn's `load_record`, whose shape checks are
/// errors here instead of panics.
pub fn load_model<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(
    model: M,
    bytes: &[u8],
    device: &B::Device,
    dir: &Path,
) -> Result<M, JobError> {
    let bad = |why| JobError::DamagedRecord {
        dir: dir.to_path_buf(),
        what: "model",
        why,
    };
    let record = decode::<B, M::Record>(bytes, device).map_err(bad)?;
    let expected = Shapes::of(&model);
    let loaded = quietly(|| model.load_record(record))
        .map_err(|why| bad(format!("it does not fit this model: {why}")))?;
    // Burn loads a parameter of any shape in place of another; the model's first op would then
    // panic.
    let found = Shapes::of(&loaded);
    if let Some(i) =
        (0..expected.0.len().max(found.0.len())).find(|&i| expected.0.get(i) != found.0.get(i))
    {
        return Err(bad(format!(
            "it does not fit this model: float parameter {i} has shape {:?} where the model has \
             {:?}",
            found.0.get(i).map(|s| s.as_slice()),
            expected.0.get(i).map(|s| s.as_slice()),
        )));
    }
    Ok(loaded)
}

/// The shapes of a module's float parameters, in module order (read without initialising a lazy
/// parameter, which would draw from the random generator).
struct Shapes(Vec<burn::tensor::Shape>);

impl Shapes {
    fn of<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(module: &M) -> Self {
        let mut shapes = Shapes(Vec::new());
        module.visit(&mut shapes);
        shapes
    }
}

impl<B: burn::tensor::backend::Backend> burn::module::ModuleVisitor<B> for Shapes {
    fn visit_float<const D: usize>(
        &mut self,
        param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
    ) {
        self.0.push(param.lazy_shape());
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
        assert!(
            load_state::<String, u32>(&root, Unchecked::Refuse)
                .unwrap()
                .is_none()
        );
        let e = load::<String, u32>(&root, Unchecked::Refuse)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("no checkpoint to resume from"), "{e}");
        save(&root, &state(1), b"m1", b"o1").unwrap();
        // A half-written epoch 2 (killed before its rename) is ignored.
        fs::create_dir_all(root.join(".epoch-2.tmp")).unwrap();
        fs::write(root.join(".epoch-2.tmp/model.bin"), b"partial").unwrap();
        let l = load::<String, u32>(&root, Unchecked::Refuse).unwrap();
        assert_eq!(
            (l.state, l.model, l.optimizer),
            (state(1), b"m1".to_vec(), b"o1".to_vec())
        );
        save(&root, &state(2), b"m2", b"o2").unwrap();
        let l = load::<String, u32>(&root, Unchecked::Refuse).unwrap();
        assert_eq!((l.state.epochs_done, l.model), (2, b"m2".to_vec()));
        assert_eq!(
            load_state(&root, Unchecked::Refuse).unwrap(),
            Some(state(2))
        );
        assert!(root.join("epoch-1/model.bin").exists() && !root.join(".epoch-2.tmp").exists());
        fs::remove_dir_all(&root).unwrap();
    }

    fn fresh_root(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("bonfire-ckpt-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        root
    }

    /// A per-rank checkpoint (ZeRO-3's) is read as one (its directory, no records), and one
    /// whose rank file is cut short is passed over for the previous checkpoint.
    #[test]
    fn a_per_rank_checkpoint_with_a_cut_rank_file_is_passed_over() {
        use burn::backend::Autodiff;
        use burn::backend::flex::{Flex, FlexDevice};
        use burn::nn::LinearConfig;
        type A = Autodiff<bonfire::DataParallel<Flex>>;
        let root = fresh_root("per-rank");
        save(&root, &state(1), b"model 1", b"optimizer").unwrap();
        let model = LinearConfig::new(4, 2).init::<A>(&FlexDevice);
        let tmp = begin(&root, 2).unwrap();
        bonfire::shard_checkpoint::<A, _, burn::optim::Adam>(&tmp, &model, Default::default(), 2)
            .unwrap();
        let dir = save_sharded(&root, &tmp, &state(2)).unwrap();
        let l = load::<String, u32>(&root, Unchecked::Refuse).unwrap();
        assert_eq!((l.state, l.shards), (state(2), Some(dir.clone())));
        assert!(l.model.is_empty() && l.optimizer.is_empty());
        let file = dir.join("zero3-rank1-of-2.bin");
        let len = fs::metadata(&file).unwrap().len();
        fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(len - 1)
            .unwrap();
        let l = load::<String, u32>(&root, Unchecked::Refuse).unwrap();
        assert_eq!((l.state.epochs_done, l.shards), (1, None));
        assert!(
            l.skipped[0].starts_with("epoch-2: ") && l.skipped[0].contains("zero3-rank1-of-2.bin"),
            "{:?}",
            l.skipped
        );
        fs::remove_dir_all(&root).unwrap();
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
        let l = load::<String, u32>(&root, Unchecked::Refuse).unwrap();
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
        assert_eq!(
            load_state(&root, Unchecked::Refuse).unwrap(),
            Some(state(1))
        );
        // With every checkpoint damaged, loading fails and names each problem.
        fs::remove_file(root.join("epoch-1/optimizer.bin")).unwrap();
        let e = load::<String, u32>(&root, Unchecked::Refuse).err().unwrap();
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
        assert_eq!(
            load::<String, u32>(&root, Unchecked::Refuse)
                .unwrap()
                .state
                .epochs_done,
            4
        );
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn checkpoints_without_checksums_load_only_when_allowed_and_garbage_state_is_refused() {
        let root = fresh_root("legacy");
        save(&root, &state(1), b"m1", b"o1").unwrap();
        save(&root, &state(2), b"m2", b"o2").unwrap();
        // As written before checkpoints carried checksums, or with the sums lost.
        fs::remove_file(root.join("epoch-2/SHA256SUMS")).unwrap();
        let l = load::<String, u32>(&root, Unchecked::Refuse).unwrap();
        assert_eq!(l.model, b"m1".to_vec());
        assert!(
            l.skipped[0].starts_with("epoch-2: no SHA256SUMS to check its files against")
                && l.skipped[0].contains("--allow-unchecked"),
            "{:?}",
            l.skipped
        );
        let l = load::<String, u32>(&root, Unchecked::Allow).unwrap();
        assert_eq!((l.model, l.skipped.len()), (b"m2".to_vec(), 0));
        fs::write(root.join("epoch-2/state.json"), b"{").unwrap();
        let l = load::<String, u32>(&root, Unchecked::Allow).unwrap();
        assert!(
            l.skipped[0].starts_with("epoch-2: state.json: not a bonfire checkpoint state"),
            "{:?}",
            l.skipped
        );
        // A state whose epoch count is not its records' (a count past i64 read as "no
        // checkpoint" where ranks agree on one): passed over.
        let mut bad = state(1);
        bad.epochs_done = usize::MAX;
        fs::write(
            root.join("epoch-2/state.json"),
            serde_json::to_vec(&bad).unwrap(),
        )
        .unwrap();
        let l = load::<String, u32>(&root, Unchecked::Allow).unwrap();
        assert_eq!(l.state, state(1));
        assert_eq!(
            l.skipped,
            [format!(
                "epoch-2: state.json says {} epoch(s) done but records 1",
                usize::MAX
            )]
        );
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_latest_that_names_no_checkpoint_here_is_passed_over() {
        let root = fresh_root("latest");
        let outside = fresh_root("latest-outside");
        save(&outside, &state(9), b"elsewhere", b"o").unwrap();
        for e in 1..=2 {
            save(&root, &state(e), format!("m{e}").as_bytes(), b"o").unwrap();
        }
        let elsewhere = outside.join("epoch-9");
        for name in [
            "../".to_string() + &outside.file_name().unwrap().to_string_lossy() + "/epoch-9",
            elsewhere.to_string_lossy().into_owned(),
            "epoch-02".into(),
            "epoch-+2".into(),
            "".into(),
        ] {
            fs::write(root.join(LATEST), &name).unwrap();
            let l = load::<String, u32>(&root, Unchecked::Refuse).unwrap();
            assert_eq!(
                (l.model, l.dir.clone()),
                (b"m2".to_vec(), root.join("epoch-2"))
            );
            assert_eq!(
                l.skipped,
                [format!(
                    "latest names {name:?}, not an epoch-N checkpoint of this directory"
                )]
            );
            assert_eq!(latest(&root).unwrap(), Some(root.join("epoch-2")));
        }
        // Pruning with a bad `latest` keeps the newest listed one.
        prune(&root, 1).unwrap();
        assert!(root.join("epoch-2").exists() && !root.join("epoch-1").exists());
        assert!(elsewhere.exists());
        fs::remove_dir_all(&root).unwrap();
        fs::remove_dir_all(&outside).unwrap();
    }

    #[test]
    fn a_damaged_record_is_an_error_not_a_panic() {
        use burn::backend::Flex;
        use burn::module::Module;
        use burn::nn::{Linear, LinearConfig};
        use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
        let device = Default::default();
        let model: Linear<Flex> = LinearConfig::new(3, 2).init(&device);
        // (Burn draws a parameter on its first read: read it before the record clones it.)
        let weight = model.weight.val().into_data();
        let bytes = BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(model.clone().into_record(), ())
            .unwrap();
        let dir = Path::new("epoch-1");
        let fresh = || LinearConfig::new(3, 2).init::<Flex>(&device);
        let back = load_model(fresh(), &bytes, &device, dir).unwrap();
        assert_eq!(back.weight.val().into_data(), weight);
        // Truncated, or with a byte changed in every position of the header: an error (Burn's
        // recorder unwraps, and the rank died with a backtrace).
        let half = load_model(fresh(), &bytes[..bytes.len() / 2], &device, dir)
            .err()
            .unwrap()
            .to_string();
        assert!(
            half.starts_with("epoch-1: the model cannot be read: ")
                && half.contains("bytes that are not a Burn 0.21 binary record of this job"),
            "{half}"
        );
        for at in 0..bytes.len().min(96) {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut damaged = bytes.clone();
                damaged[at] ^= flip;
                let _ = load_model(fresh(), &damaged, &device, dir);
            }
        }
        // A record of another shape does not fit the model: an error naming the model.
        let other = BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(
                LinearConfig::new(5, 2).init::<Flex>(&device).into_record(),
                (),
            )
            .unwrap();
        let e = load_model(fresh(), &other, &device, dir)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(
                "does not fit this model: float parameter 0 has shape Some([5, 2]) where \
                 the model has Some([3, 2])"
            ),
            "{e}"
        );
    }

    /// The checkpoint loader under mutation, as `frame_campaign` is for the frame decoder: a real
    /// checkpoint (a small model's record, Adam's state after a step) damaged in 1 to 8 places
    /// per input (bit flips, interesting bytes, cuts, deletions, repeated slices, junk, a file
    /// removed; `latest` rewritten), its sums dropped half the time so that the damaged bytes
    /// reach the decoders. Every input must end in a loaded checkpoint whose model and optimizer
    /// state decode, or in a message: never a panic, an abort or an allocation the size of a
    /// damaged length (it found three such; BENCHMARKS.md, "The checkpoint loader under
    /// mutation"). CI runs 1,500 inputs; the campaign:
    /// `BONFIRE_FUZZ_SECS=300 cargo test --release -p bonfire-jobs --lib checkpoint_campaign -- --nocapture`
    #[test]
    fn checkpoint_campaign() {
        use std::collections::BTreeMap;

        use burn::backend::{Autodiff, Flex};
        use burn::module::Module;
        use burn::nn::{Linear, LinearConfig};
        use burn::optim::{AdamConfig, GradientsParams, Optimizer};
        use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
        use burn::tensor::Tensor;

        type A = Autodiff<bonfire::DataParallel<Flex>>;
        type Optim = burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Linear<A>, A>;
        type OptimRecord = <Optim as Optimizer<Linear<A>, A>>::Record;

        let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let seed = env("BONFIRE_FUZZ_SEED").unwrap_or(29);
        let budget = env("BONFIRE_FUZZ_SECS").map(std::time::Duration::from_secs);
        let device = Default::default();
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let mut model: Linear<A> = LinearConfig::new(6, 4).init(&device);
        let mut optim: Optim = AdamConfig::new().init();
        let x = Tensor::<A, 2>::ones([3, 6], &device);
        let grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
        model = optim.step(1e-2, model, grads);
        let model_bytes = recorder.record(model.clone().into_record(), ()).unwrap();
        let optim_bytes = recorder.record(optim.to_record(), ()).unwrap();

        let root = fresh_root("campaign");
        save(&root, &state(1), &model_bytes, &optim_bytes).unwrap();
        save(&root, &state(2), &model_bytes, &optim_bytes).unwrap();
        let newest = root.join("epoch-2");
        let pristine: Vec<(&str, Vec<u8>)> = [MODEL, OPTIMIZER, STATE, SUMS]
            .into_iter()
            .map(|name| (name, fs::read(newest.join(name)).unwrap()))
            .collect();

        let mut rng = seed | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut tally: BTreeMap<&str, u64> = BTreeMap::new();
        let started = std::time::Instant::now();
        let mut inputs = 0u64;
        loop {
            let done = match budget {
                Some(b) => started.elapsed() >= b,
                None => inputs >= 1_500,
            };
            if done {
                break;
            }
            inputs += 1;
            for (name, bytes) in &pristine {
                fs::write(newest.join(name), bytes).unwrap();
            }
            fs::write(root.join(LATEST), "epoch-2").unwrap();
            let target = match next() % 10 {
                0..=3 => MODEL,
                4..=6 => OPTIMIZER,
                7 => STATE,
                8 => SUMS,
                _ => LATEST,
            };
            let path = if target == LATEST {
                root.join(LATEST)
            } else {
                newest.join(target)
            };
            let mut bytes = fs::read(&path).unwrap();
            let mut removed = false;
            for _ in 0..1 + next() % 8 {
                let len = bytes.len().max(1) as u64;
                let at = (next() % len) as usize;
                match next() % 8 {
                    0 if !bytes.is_empty() => bytes[at] ^= 1 << (next() % 8),
                    1 if !bytes.is_empty() => {
                        bytes[at] = [0, 1, 0x7f, 0x80, 0xfe, 0xff][(next() % 6) as usize]
                    }
                    2 => bytes.truncate(at),
                    3 if !bytes.is_empty() => {
                        let n = (1 + next() % 16) as usize;
                        bytes.drain(at..(at + n).min(bytes.len()));
                    }
                    4 if !bytes.is_empty() => {
                        let end = (at + 1 + (next() % 64) as usize).min(bytes.len());
                        let slice = bytes[at..end].to_vec();
                        bytes.splice(at..at, slice);
                    }
                    5 => {
                        let junk: Vec<u8> = (0..1 + next() % 32).map(|_| next() as u8).collect();
                        bytes.splice(at.min(bytes.len())..at.min(bytes.len()), junk);
                    }
                    6 if at + 8 <= bytes.len() => {
                        // A length prefix (bincode's varint for u64) made huge.
                        bytes[at] = 0xfd;
                        for b in &mut bytes[at + 1..at + 8] {
                            *b = 0xff;
                        }
                    }
                    7 if next() % 8 == 0 => removed = true,
                    _ => {}
                }
            }
            if removed {
                fs::remove_file(&path).unwrap();
            } else {
                fs::write(&path, &bytes).unwrap();
            }
            let unchecked = next() % 2 == 0;
            if unchecked && target != SUMS {
                let _ = fs::remove_file(newest.join(SUMS));
            }
            let mode = Unchecked::allowed(unchecked);
            let outcome = std::panic::catch_unwind(|| {
                let loaded = match load::<String, u32>(&root, mode) {
                    Err(_) => return "no usable checkpoint",
                    Ok(l) => l,
                };
                if loaded.dir != newest {
                    return "passed over for the older one";
                }
                let fresh = LinearConfig::new(6, 4).init::<A>(&device);
                if load_model(fresh, &loaded.model, &device, &loaded.dir).is_err() {
                    return "loaded; the model refused";
                }
                match decode::<A, OptimRecord>(&loaded.optimizer, &device) {
                    Ok(_) => "loaded, model and optimizer decoded",
                    Err(_) => "loaded; the optimizer state refused",
                }
            });
            let outcome = outcome.unwrap_or_else(|_| {
                panic!(
                    "input {inputs} (seed {seed}) panicked: target {target}, unchecked {unchecked}"
                )
            });
            *tally.entry(outcome).or_default() += 1;
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "checkpoint campaign: seed {seed}, {inputs} inputs in {secs:.1} s ({:.0}/s), no \
             failure: {tally:?}",
            inputs as f64 / secs
        );
        // Every path is reached, so the campaign is not refusing everything at the first check.
        assert_eq!(tally.len(), 5, "{tally:?}");
        fs::remove_dir_all(&root).unwrap();
    }
}
