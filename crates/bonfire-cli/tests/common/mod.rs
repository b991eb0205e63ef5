//! What the `bonfire train` tests share: a scratch directory, the command run in it, its output,
//! a checkpoint's `state.json`, and a run killed after its first checkpoint.

#![allow(dead_code)] // each test file uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A fresh directory under the system's temporary one, for this test process.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bonfire-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `bonfire ARGS` run in `cwd`, its data sets cached in `cwd/data`.
pub(crate) fn bonfire(cwd: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_bonfire"));
    c.current_dir(cwd)
        .args(args)
        .env("BONFIRE_DATA_DIR", cwd.join("data"))
        .env("RUST_BACKTRACE", "1")
        .env("BONFIRE_TIMEOUT", "120");
    c
}

/// Standard output and standard error, as text.
pub(crate) fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The `state.json` of checkpoint `epoch-N` in `dir`.
pub(crate) fn state(dir: &Path, n: usize) -> serde_json::Value {
    let path = dir.join(format!("epoch-{n}/state.json"));
    serde_json::from_slice(&std::fs::read(&path).unwrap_or_else(|e| panic!("{path:?}: {e}")))
        .unwrap()
}

pub(crate) fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap()
}

/// Starts `run` (writing its checkpoints to `dir`), kills it with SIGKILL as soon as its first
/// checkpoint is there (its ranks die with it), and returns the checkpoint `latest` then names.
/// The run must not have ended first.
pub(crate) fn kill_after_first_checkpoint(run: &mut Command, dir: &Path) -> String {
    let mut child = run
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !dir.join("latest").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "no checkpoint after 300 s"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the job ended before its first checkpoint"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    std::fs::read_to_string(dir.join("latest"))
        .unwrap()
        .trim()
        .to_string()
}
