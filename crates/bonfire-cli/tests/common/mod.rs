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
    wait_for_first_checkpoint(&mut child, dir);
    child.kill().unwrap();
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    std::fs::read_to_string(dir.join("latest"))
        .unwrap()
        .trim()
        .to_string()
}

/// The process id of rank `rank` among the children of process `parent` (the ranks the parent
/// started under the launcher), if it is running.
pub(crate) fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    let children =
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    children
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|&b| b == 0)
                    .any(|kv| kv == format!("RANK={rank}").as_bytes())
            })
        })
}

/// Starts `run` (writing its checkpoints to `dir`), and once its first checkpoint is there
/// kills its rank `rank` with SIGKILL (the run's parent and the other ranks live on); returns
/// the run's output when it ends.
pub(crate) fn kill_a_rank_after_first_checkpoint(
    run: &mut Command,
    dir: &Path,
    rank: usize,
) -> Output {
    let mut child = run
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_first_checkpoint(&mut child, dir);
    let pid = rank_pid(child.id(), rank).expect("the rank is running");
    let killed = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    child.wait_with_output().unwrap()
}

/// Waits until `child`'s run has written its first checkpoint in `dir`; fails if it ends first
/// or takes over 300 s.
fn wait_for_first_checkpoint(child: &mut std::process::Child, dir: &Path) {
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
}
