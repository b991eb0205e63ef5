//! Checkpoints for your own training loop that survive restarts: [`save_checkpoint`] on every
//! rank after an epoch (rank 0 writes), [`resume_or_start`] on every rank at the start.
//!
//! A checkpoint is a directory `ROOT/epoch-N` holding whatever files your closure writes (Burn
//! records, say) and a `SHA256SUMS` of them, in the format `sha256sum -c` reads. It is written in
//! a temporary directory and renamed into place, and `ROOT/latest` names the newest one, so a
//! rank killed while writing leaves the previous checkpoint as the newest. On the way back every
//! rank checks the sums of the checkpoints it sees, and the ranks agree on the newest one that
//! some rank can read: the one [`resume_or_start`] returns, after sending it to the ranks that
//! lack it (nodes that do not share the checkpoint directory).
//!
//! Nothing here depends on Burn (the files are whatever the closure writes; ranks agree and send
//! them with this crate's collectives): the Burn 0.21 crate re-exports it as
//! `bonfire::checkpoint`, and the Burn 0.22 crate as `bonfire_burn022::checkpoint`.
//!
//! Under `bonfire launch --max-restarts N`, a failure starts every rank again; a program that
//! calls [`resume_or_start`] first continues from the newest checkpoint instead of from scratch.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::Digest;

use crate::{CollectiveError, Communicator};

/// The file naming the newest checkpoint under a root.
pub const LATEST: &str = "latest";
/// The checksum file in each checkpoint.
pub const SUMS: &str = "SHA256SUMS";

/// Why a checkpoint could not be written or agreed on.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Your closure failed to write the checkpoint's files.
    #[error("writing checkpoint {dir}: {source}")]
    Write {
        /// The temporary directory it wrote into.
        dir: PathBuf,
        /// Your closure's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The ranks could not agree (a collective failed; the message names the ranks).
    #[error("agreeing on the checkpoint to resume from: {0}")]
    Agree(#[from] CollectiveError),
    /// Sending the newest checkpoint to the ranks that lack it failed (a collective failed; the
    /// message names the ranks).
    #[error("sending checkpoint epoch-{epoch} from rank {from} to ranks {to:?}: {source}")]
    Share {
        /// Its epoch.
        epoch: usize,
        /// The rank that sent it.
        from: usize,
        /// The ranks that lacked it.
        to: Vec<usize>,
        /// The collective's error.
        source: Box<CollectiveError>,
    },
    /// The checkpoint a rank received is not what its sender holds.
    #[error("checkpoint epoch-{epoch} as received from rank {from} into {dir}: {why}")]
    Received {
        /// Its epoch.
        epoch: usize,
        /// The rank that sent it.
        from: usize,
        /// Where it was written.
        dir: PathBuf,
        /// What is wrong (a file name outside the checkpoint, a checksum that fails).
        why: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The checkpoint every rank resumes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    /// The epoch it was saved after: start the loop at this epoch.
    pub epoch: usize,
    /// Its directory: read your files from here.
    pub dir: PathBuf,
    /// Newer checkpoints passed over on this rank, and why (a failed checksum, a file missing).
    pub skipped: Vec<String>,
}

/// The SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The `SHA256SUMS` text of `files` (name and contents), sorted by name.
pub fn sums_text<'a>(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> String {
    let mut lines: Vec<String> = files
        .into_iter()
        .map(|(name, bytes)| format!("{}  {name}\n", sha256_hex(bytes)))
        .collect();
    lines.sort_by(|a, b| a[66..].cmp(&b[66..]));
    lines.concat()
}

/// The hash `sums` records for file `name`, if it has a line for it.
pub fn recorded_sum<'a>(sums: &'a str, name: &str) -> Option<&'a str> {
    sums.lines()
        .find_map(|l| l.strip_suffix(name)?.strip_suffix("  "))
}

/// Writes `bytes` to `path` and flushes them to the disk.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

/// On every rank of `comm` (the job's: `world.comm()`), after epoch `epoch` (from 1): rank 0 runs `write` with a fresh directory to
/// write the checkpoint's files into, adds their checksums and moves it into place as
/// `root/epoch-<epoch>`; the other ranks do nothing. Returns the checkpoint's directory on rank
/// 0, `None` elsewhere.
pub fn save_checkpoint<E>(
    comm: &Communicator,
    root: impl AsRef<Path>,
    epoch: usize,
    write: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<Option<PathBuf>, CheckpointError>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if comm.rank() != 0 {
        return Ok(None);
    }
    let root = root.as_ref();
    fs::create_dir_all(root).map_err(io(root))?;
    let name = format!("epoch-{epoch}");
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    write(&tmp).map_err(|e| CheckpointError::Write {
        dir: tmp.clone(),
        source: e.into(),
    })?;
    let mut files = Vec::new();
    for entry in fs::read_dir(&tmp).map_err(io(&tmp))? {
        let path = entry.map_err(io(&tmp))?.path();
        if path.is_file() {
            let bytes = fs::read(&path).map_err(io(&path))?;
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            files.push((name, bytes));
        }
    }
    let sums = sums_text(files.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    write_synced(&tmp.join(SUMS), sums.as_bytes())?;
    let dir = root.join(&name);
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&tmp, &dir).map_err(io(&dir))?;
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, name.as_bytes())?;
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(io(root))?;
    Ok(Some(dir))
}

/// How a checkpoint reached the ranks that lacked it ([`share_newest`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shared {
    /// Its epoch.
    pub epoch: usize,
    /// The rank that sent it: the lowest that holds it.
    pub from: usize,
    /// The ranks that lacked it (none newer, or a damaged copy) and received it.
    pub to: Vec<usize>,
    /// Its files' bytes.
    pub bytes: u64,
}

/// Collective on `comm`, for ranks that do not share one checkpoint directory (nodes without
/// shared storage). `claims[r]` is rank `r`'s newest usable checkpoint epoch (`-1`: none), the
/// same slice on every rank (an all-gather of each rank's claim); `mine` is this rank's copy of
/// the newest one, if it holds it. When some rank's claim is below the newest, the lowest rank
/// that holds the newest sends its files to every rank, and each rank that lacked it writes them
/// as `root/epoch-N` (a damaged copy there is moved aside to `root/epoch-N.damaged-rank-R`),
/// checks them against the `SHA256SUMS` that came with them, and points `root/latest` at it.
/// Ranks of one node that share `root` may both receive it: the first to move it into place
/// wins, and the other checks that copy.
///
/// Returns `None` when every rank claimed the same epoch (nothing moved) or none holds one.
pub fn share_newest(
    comm: &Communicator,
    root: &Path,
    claims: &[i64],
    mine: Option<&Path>,
) -> Result<Option<Shared>, CheckpointError> {
    let target = claims.iter().copied().max().unwrap_or(-1);
    if target < 0 || claims.iter().all(|&c| c == target) {
        return Ok(None);
    }
    let epoch = target as usize;
    let from = claims.iter().position(|&c| c == target).unwrap_or(0);
    let to: Vec<usize> = (0..claims.len()).filter(|&r| claims[r] < target).collect();
    let me = comm.rank();
    let failed = |source| CheckpointError::Share {
        epoch,
        from,
        to: to.clone(),
        source: Box::new(source),
    };
    // The sender's files, flat and sorted by name.
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    if me == from {
        let dir = mine.ok_or_else(|| CheckpointError::Io {
            path: root.join(format!("epoch-{epoch}")),
            source: std::io::Error::other("this rank claimed the checkpoint but has no copy"),
        })?;
        let mut entries: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        entries.sort();
        for path in entries {
            let bytes = fs::read(&path).map_err(io(&path))?;
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            files.push((name.into_owned(), bytes));
        }
    }
    // Sizes first (so that every rank posts buffers of the same length), then names, then the
    // contents.
    let totals: Vec<i64> = vec![
        files.len() as i64,
        files.iter().map(|(n, _)| n.len() as i64).sum(),
        files.iter().map(|(_, b)| b.len() as i64).sum(),
    ];
    let totals = comm.broadcast(totals, from).wait().map_err(failed)?;
    let (count, name_bytes, data_bytes) = (
        totals[0].max(0) as usize,
        totals[1].max(0) as usize,
        totals[2].max(0) as usize,
    );
    let sizes: Vec<i64> = if me == from {
        files
            .iter()
            .flat_map(|(n, b)| [n.len() as i64, b.len() as i64])
            .collect()
    } else {
        vec![0; 2 * count]
    };
    let sizes = comm.broadcast(sizes, from).wait().map_err(failed)?;
    let names: Vec<u8> = if me == from {
        files.iter().flat_map(|(n, _)| n.bytes()).collect()
    } else {
        vec![0; name_bytes]
    };
    let names = comm.broadcast(names, from).wait().map_err(failed)?;
    let data: Vec<u8> = if me == from {
        files.iter().flat_map(|(_, b)| b.iter().copied()).collect()
    } else {
        vec![0; data_bytes]
    };
    let data = comm.broadcast(data, from).wait().map_err(failed)?;
    let shared = Shared {
        epoch,
        from,
        to: to.clone(),
        bytes: data_bytes as u64,
    };
    if claims[me] >= target {
        return Ok(Some(shared));
    }

    let name = format!("epoch-{epoch}");
    let dir = root.join(&name);
    let bad = |why: String| CheckpointError::Received {
        epoch,
        from,
        dir: dir.clone(),
        why,
    };
    fs::create_dir_all(root).map_err(io(root))?;
    let tmp = root.join(format!(".{name}.from-rank-{from}.rank-{me}"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let (mut at_name, mut at_data) = (0usize, 0usize);
    for pair in sizes.chunks_exact(2) {
        let (n, b) = (pair[0].max(0) as usize, pair[1].max(0) as usize);
        let file = names
            .get(at_name..at_name + n)
            .and_then(|s| std::str::from_utf8(s).ok())
            .ok_or_else(|| bad("a file name is cut short or not UTF-8".into()))?;
        if file.is_empty() || file.starts_with('.') || file.contains(['/', '\\']) {
            return Err(bad(format!(
                "a file name is not one of a checkpoint: {file:?}"
            )));
        }
        let bytes = data
            .get(at_data..at_data + b)
            .ok_or_else(|| bad(format!("{file} is cut short")))?;
        write_synced(&tmp.join(file), bytes)?;
        at_name += n;
        at_data += b;
    }
    if let Err(why) = check(&tmp) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(bad(why));
    }
    if dir.exists() && check(&dir).is_err() {
        // A damaged copy of this epoch: kept aside, not deleted.
        let aside = root.join(format!("{name}.damaged-rank-{me}"));
        let _ = fs::remove_dir_all(&aside);
        let _ = fs::rename(&dir, &aside);
    }
    if fs::rename(&tmp, &dir).is_err() {
        // Another rank sharing this directory moved its copy into place first.
        let _ = fs::remove_dir_all(&tmp);
        check(&dir).map_err(bad)?;
    }
    let latest_tmp = root.join(format!(".latest.rank-{me}.tmp"));
    write_synced(&latest_tmp, name.as_bytes())?;
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(io(root))?;
    Ok(Some(shared))
}

/// Checks every file `SHA256SUMS` in `dir` lists (at least one); the error says what is wrong.
fn check(dir: &Path) -> Result<(), String> {
    let sums = fs::read_to_string(dir.join(SUMS)).map_err(|e| format!("{SUMS}: {e}"))?;
    let mut checked = 0;
    for line in sums.lines().filter(|l| !l.trim().is_empty()) {
        let (recorded, name) = line
            .split_once("  ")
            .ok_or_else(|| format!("{SUMS} has a malformed line: {line:?}"))?;
        if name.contains('/') || name.contains("..") {
            return Err(format!(
                "{SUMS} names a file outside the checkpoint: {name:?}"
            ));
        }
        let bytes = fs::read(dir.join(name)).map_err(|e| format!("{name}: {e}"))?;
        let found = sha256_hex(&bytes);
        if found != recorded {
            return Err(format!(
                "{name} does not match its checksum ({} bytes, SHA-256 {}..., recorded {}...)",
                bytes.len(),
                &found[..12],
                recorded.get(..12).unwrap_or(recorded)
            ));
        }
        checked += 1;
    }
    if checked == 0 {
        return Err(format!("{SUMS} lists no file"));
    }
    Ok(())
}

/// The epoch of a checkpoint directory named `name`: `epoch-N` with N written as bonfire writes
/// it (decimal digits, no sign, no leading zero), so that no two names mean the same epoch
/// (`epoch-05` and `epoch-+5` are not epoch 5) and a name is never a path elsewhere.
pub fn epoch_of(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("epoch-")?;
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if !canonical {
        return None;
    }
    digits.parse().ok()
}

/// The `epoch-N` directories under `root`, newest first: `(N, dir)` (none when `root` cannot be
/// read; names that are not [`epoch_of`] an epoch are left out).
pub fn epochs(root: &Path) -> Vec<(usize, PathBuf)> {
    let mut found: Vec<(usize, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| Some((epoch_of(e.file_name().to_str()?)?, e.path())))
        .collect();
    found.sort_by_key(|(n, _)| std::cmp::Reverse(*n));
    found
}

/// This rank's newest checkpoint under `root` that passes its check, of at most `at_most`
/// epochs, with the newer ones passed over and why.
fn newest_usable(root: &Path, at_most: usize) -> (Option<(usize, PathBuf)>, Vec<String>) {
    let mut skipped = Vec::new();
    for (n, dir) in epochs(root).into_iter().filter(|(n, _)| *n <= at_most) {
        match check(&dir) {
            Ok(()) => return (Some((n, dir)), skipped),
            Err(why) => skipped.push(format!("epoch-{n}: {why}")),
        }
    }
    (None, skipped)
}

/// On every rank of `comm` (the job's: `world.comm()`), before training: the newest checkpoint
/// under `root` that any rank can read (its checksums pass), or `None` when no rank has one and
/// the run starts from scratch. Every rank gets the same answer. Ranks that lack it (a node
/// without the others' storage, a damaged copy) receive it from the lowest rank that holds it
/// first ([`share_newest`]), checked against its `SHA256SUMS`.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let comm = bonfire_collectives::Communicator::in_process(1, Default::default()).remove(0);
/// use bonfire_collectives::checkpoint::{resume_or_start, save_checkpoint};
///
/// // comm: the job's communicator, `bonfire::init()?.comm()` (or bonfire_burn022's).
/// let first_epoch = match resume_or_start(&comm, "checkpoints")? {
///     Some(resume) => {
///         // model = model.load_file(resume.dir.join("model"), &recorder, &device)?; ...
///         resume.epoch
///     }
///     None => 0,
/// };
/// for epoch in first_epoch..10 {
///     // ...train one epoch...
///     save_checkpoint(&comm, "checkpoints", epoch + 1, |dir| {
///         std::fs::write(dir.join("notes.txt"), format!("epoch {}", epoch + 1))
///         // model.clone().save_file(dir.join("model"), &recorder)
///     })?;
/// }
/// # Ok(())
/// # }
/// ```
pub fn resume_or_start(
    comm: &Communicator,
    root: impl AsRef<Path>,
) -> Result<Option<Resume>, CheckpointError> {
    let root = root.as_ref();
    let (mine, skipped) = newest_usable(root, usize::MAX);
    let claim = mine.as_ref().map_or(-1, |(n, _)| *n as i64);
    let all = comm.all_gather(vec![claim]).wait()?;
    let agreed = all.iter().copied().max().unwrap_or(-1);
    if agreed < 0 {
        return Ok(None);
    }
    share_newest(comm, root, &all, mine.as_ref().map(|(_, d)| d.as_path()))?;
    let (found, more) = if agreed == claim {
        (mine, Vec::new())
    } else {
        newest_usable(root, agreed as usize)
    };
    let skipped = skipped.into_iter().chain(more).collect();
    // Every rank saw `agreed` pass its check (it is the newest usable one of some rank, and at
    // most every rank's newest usable one), so this rank finds it too unless it changed since.
    match found {
        Some((n, dir)) if n == agreed as usize => Ok(Some(Resume {
            epoch: n,
            dir,
            skipped,
        })),
        _ => Err(CheckpointError::Io {
            path: root.join(format!("epoch-{agreed}")),
            source: std::io::Error::other(
                "the checkpoint the ranks agreed on no longer passes its check on this rank",
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommConfig;

    fn worlds(n: usize) -> Vec<Communicator> {
        Communicator::in_process(n, CommConfig::default())
    }

    #[test]
    fn saved_checkpoints_are_found_again_and_damaged_ones_passed_over() {
        let root = std::env::temp_dir().join(format!("bonfire-resume-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let world = worlds(1).pop().unwrap();
        assert_eq!(resume_or_start(&world, &root).unwrap(), None);
        for epoch in 1..=3 {
            let dir = save_checkpoint(&world, &root, epoch, |d| {
                fs::write(d.join("model.bin"), vec![epoch as u8; 100])
            })
            .unwrap()
            .unwrap();
            assert_eq!(dir, root.join(format!("epoch-{epoch}")));
        }
        let r = resume_or_start(&world, &root).unwrap().unwrap();
        assert_eq!((r.epoch, r.dir.clone()), (3, root.join("epoch-3")));
        assert!(r.skipped.is_empty());
        // One byte changed in the newest: the one before is used, and the reason given.
        fs::write(root.join("epoch-3/model.bin"), vec![9u8; 100]).unwrap();
        let r = resume_or_start(&world, &root).unwrap().unwrap();
        assert_eq!(r.epoch, 2);
        assert!(
            r.skipped[0].starts_with("epoch-3: model.bin does not match its checksum"),
            "{:?}",
            r.skipped
        );
        // A half-written one (no sums) is passed over too.
        fs::remove_file(root.join("epoch-2").join(SUMS)).unwrap();
        let r = resume_or_start(&world, &root).unwrap().unwrap();
        assert_eq!(r.epoch, 1);
        // Names that only look like an epoch are not checkpoints: `epoch-05` and `epoch-+5`
        // would both have read as epoch 5.
        for name in ["epoch-05", "epoch-+5", "epoch--1", "epoch-", "epoch-5x"] {
            fs::rename(root.join("epoch-1"), root.join(name)).unwrap();
            assert_eq!(resume_or_start(&world, &root).unwrap(), None, "{name}");
            fs::rename(root.join(name), root.join("epoch-1")).unwrap();
        }
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn only_names_bonfire_writes_are_epochs() {
        assert_eq!(epoch_of("epoch-0"), Some(0));
        assert_eq!(epoch_of("epoch-17"), Some(17));
        for bad in [
            "epoch-05",
            "epoch-+5",
            "epoch- 5",
            "epoch-5/../x",
            "../epoch-5",
            "epoch-99999999999999999999999",
            "Epoch-5",
        ] {
            assert_eq!(epoch_of(bad), None, "{bad}");
        }
    }

    /// Rank 0 saves epochs 1 to 3 into its own directory; `copies(r)` is rank `r`'s directory
    /// (ranks may share one), `damage(r)` whether its epoch 3 is damaged. Returns each rank's
    /// resumed epoch, with the directories' root.
    fn resume_apart(
        name: &str,
        world: usize,
        dir_of: fn(usize) -> usize,
        prepare: fn(usize, &Path),
    ) -> (Vec<Option<usize>>, PathBuf) {
        let base = std::env::temp_dir().join(format!("bonfire-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let handles: Vec<_> = worlds(world)
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let root = base.join(format!("node-{}", dir_of(r)));
                std::thread::spawn(move || {
                    prepare(r, &root);
                    resume_or_start(&comm, &root).unwrap().map(|x| x.epoch)
                })
            })
            .collect();
        let epochs = handles.into_iter().map(|h| h.join().unwrap()).collect();
        (epochs, base)
    }

    fn three_epochs(root: &Path) {
        let single = worlds(1).pop().unwrap();
        for epoch in 1..=3 {
            save_checkpoint(&single, root, epoch, |d| {
                fs::write(d.join("w"), vec![epoch as u8; 1000])?;
                fs::write(d.join("notes.txt"), format!("epoch {epoch}"))
            })
            .unwrap();
        }
    }

    #[test]
    fn a_rank_with_a_damaged_newest_checkpoint_receives_it_and_keeps_its_copy_aside() {
        let (epochs, base) = resume_apart(
            "damaged",
            2,
            |r| r,
            |r, root| {
                three_epochs(root);
                if r == 1 {
                    fs::write(root.join("epoch-3/w"), [0u8]).unwrap();
                }
            },
        );
        assert_eq!(epochs, [Some(3), Some(3)]);
        let node1 = base.join("node-1");
        assert_eq!(fs::read(node1.join("epoch-3/w")).unwrap(), vec![3u8; 1000]);
        assert_eq!(
            fs::read(node1.join("epoch-3.damaged-rank-1/w")).unwrap(),
            [0u8]
        );
        assert_eq!(fs::read_to_string(node1.join(LATEST)).unwrap(), "epoch-3");
        let _ = fs::remove_dir_all(&base);
    }

    /// Two nodes without shared storage: rank 0 alone wrote checkpoints; ranks 1 and 2 share the
    /// other node's empty directory. Both receive the newest (one of them moves it into place),
    /// checked, and every rank resumes from it.
    #[test]
    fn ranks_without_the_checkpoint_receive_the_newest_from_a_rank_that_has_it() {
        let (epochs, base) = resume_apart(
            "apart",
            3,
            |r| r.min(1),
            |r, root| {
                if r == 0 {
                    three_epochs(root);
                } else {
                    fs::create_dir_all(root).unwrap();
                }
            },
        );
        assert_eq!(epochs, [Some(3), Some(3), Some(3)]);
        let (node0, node1) = (base.join("node-0"), base.join("node-1"));
        for file in ["w", "notes.txt", SUMS] {
            assert_eq!(
                fs::read(node0.join("epoch-3").join(file)).unwrap(),
                fs::read(node1.join("epoch-3").join(file)).unwrap(),
                "{file}"
            );
        }
        // Only the newest travels, and nothing is left half-written.
        let left: Vec<String> = fs::read_dir(&node1)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let mut left = left;
        left.sort();
        assert_eq!(left, ["epoch-3", LATEST]);
        let _ = fs::remove_dir_all(&base);
    }

    #[test]
    fn no_checkpoint_anywhere_starts_afresh_on_every_rank() {
        let (epochs, base) = resume_apart("none", 2, |r| r, |_, _| {});
        assert_eq!(epochs, [None, None]);
        let _ = fs::remove_dir_all(&base);
    }
}
