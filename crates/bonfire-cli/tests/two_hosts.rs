//! Two hosts without a shared directory, played by two network namespaces joined by a veth pair
//! (10.73.0.1 and 10.73.0.2), each node's launcher in its own working directory with its own
//! `ckpt` checkpoint directory. Only rank 0 writes checkpoints, so only host a has them. A rank
//! of host b killed after the first checkpoint: the job restarts, host b's rank receives
//! `epoch-1` from rank 0 (checked against its SHA-256 sums) instead of the job starting afresh,
//! no epoch is trained twice, and the run ends on the weights of an uninterrupted run. Then
//! `--resume` for a fourth epoch: host b's stale directory receives `epoch-3` the same way.
//!
//! Skipped where the machine does not allow network namespaces (root and `ip` needed).

mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use bonfire_testkit::netns::Namespaces;
use common::{rank_pid, scratch, state, text};

const BONFIRE: &str = env!("CARGO_BIN_EXE_bonfire");

/// `bonfire launch` for node `node` of 2 in namespace `node`, in `cwd`, training the vision job
/// on the embedded slice with `extra` arguments.
fn node(ns: &Namespaces, node: usize, cwd: &Path, port: u16, extra: &[&str]) -> Child {
    let master = format!("{}:{port}", ns.addrs[0]);
    ns.command(node, BONFIRE)
        .current_dir(cwd)
        .args(["launch", "--nnodes", "2", "--nproc-per-node", "1"])
        .args(["--node-rank", &node.to_string(), "--master-addr", &master])
        .arg("--secret-file")
        .arg(cwd.join("../job.secret"))
        .args(["--max-restarts", "1", "--join-timeout", "60", "--"])
        .arg(BONFIRE)
        .args([
            "train",
            "vision",
            "--dataset",
            "embedded",
            "--test-limit",
            "100",
        ])
        .args(["--checkpoint-dir", "ckpt"])
        .args(extra)
        .env("BONFIRE_DATA_DIR", cwd.join("data"))
        .env("BONFIRE_TIMEOUT", "60")
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait(child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    let mut child = child;
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!(
                "a node did not finish within {limit:?}: {}",
                text(&child.wait_with_output().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Every file of checkpoint `epoch` is the same on both hosts.
fn same_checkpoint(a: &Path, b: &Path, epoch: usize) {
    for file in ["model.bin", "optimizer.bin", "state.json", "SHA256SUMS"] {
        let (x, y) = (
            a.join(format!("epoch-{epoch}/{file}")),
            b.join(format!("epoch-{epoch}/{file}")),
        );
        assert_eq!(
            std::fs::read(&x).unwrap_or_else(|e| panic!("{x:?}: {e}")),
            std::fs::read(&y).unwrap_or_else(|e| panic!("{y:?}: {e}")),
            "{file}"
        );
    }
}

#[test]
fn a_host_without_the_checkpoint_receives_it_on_restart_and_on_resume() {
    let Some(ns) = Namespaces::pair() else {
        eprintln!("skipped: this machine does not allow network namespaces (needs root and `ip`)");
        return;
    };
    let dir = scratch("two-hosts");
    let (a, b) = (dir.join("a"), dir.join("b"));
    for d in [&a, &b] {
        std::fs::create_dir_all(d).unwrap();
    }
    let secret = dir.join("job.secret");
    std::fs::write(&secret, "two hosts, one secret, 0123456789").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    // The same run uninterrupted on one host: the weights every epoch must end on.
    let reference = dir.join("reference");
    let out = common::bonfire(&dir, &["train", "vision", "--dataset", "embedded"])
        .args(["--test-limit", "100", "--epochs", "3", "--checkpoint-dir"])
        .arg(&reference)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));

    let port = bonfire_launch_port();
    let host_a = node(&ns, 0, &a, port, &["--epochs", "3"]);
    let host_b = node(&ns, 1, &b, port, &["--epochs", "3"]);
    // Once host a holds epoch-1, kill host b's rank (its launcher lives on and restarts it).
    let start = Instant::now();
    while !a.join("ckpt/latest").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint after 120 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let rank = rank_pid(host_b.id(), 1).expect("host b's rank is running");
    assert!(
        Command::new("kill")
            .args(["-KILL", &rank.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let (log_a, log_b) = (
        wait(host_a, Duration::from_secs(180)),
        wait(host_b, Duration::from_secs(60)),
    );
    let (log_a, log_b) = (text(&log_a), text(&log_b));
    assert!(
        log_a.contains("restarting the job on every node (restart 1 of 1"),
        "{log_a}\n{log_b}"
    );
    assert!(
        log_a.contains(
            "rank(s) [1] had no usable epoch-1 in their checkpoint directory; rank 0 sent it"
        ),
        "{log_a}"
    );
    assert!(
        log_a.contains("restart 1: resuming from ckpt/epoch-1"),
        "{log_a}"
    );
    // Epoch 1 was trained before the failure (its summary line may not have been printed when
    // the rank died: the kill follows the checkpoint at once) and not after the restart.
    let (before, after) = log_a
        .split_once("restart 1: resuming from ckpt/epoch-1")
        .expect("the restart resumed");
    assert!(before.contains("epoch 1/3 ["), "{log_a}");
    assert!(
        !after.contains("epoch 1/3"),
        "epoch 1 trained again: {log_a}"
    );
    assert!(!log_a.contains("starts afresh"), "{log_a}");
    same_checkpoint(&a.join("ckpt"), &b.join("ckpt"), 1);
    let (want, got) = (state(&reference, 3), state(&a.join("ckpt"), 3));
    for e in 0..3 {
        assert_eq!(
            want["history"][e]["param_digest"],
            got["history"][e]["param_digest"],
            "epoch {}",
            e + 1
        );
    }

    // --resume for a fourth epoch: host b holds only epoch-1, and receives epoch-3.
    let port = bonfire_launch_port();
    let host_a = node(&ns, 0, &a, port, &["--resume", "--epochs", "4"]);
    let host_b = node(&ns, 1, &b, port, &["--resume", "--epochs", "4"]);
    let (log_a, log_b) = (
        wait(host_a, Duration::from_secs(120)),
        wait(host_b, Duration::from_secs(60)),
    );
    assert!(
        log_a.status.success() && log_b.status.success(),
        "{}\n{}",
        text(&log_a),
        text(&log_b)
    );
    let log_a = text(&log_a);
    assert!(
        log_a.contains(
            "rank(s) [1] had no usable epoch-3 in their checkpoint directory; rank 0 sent it"
        ),
        "{log_a}"
    );
    assert!(log_a.contains("resuming from ckpt/epoch-3"), "{log_a}");
    assert!(log_a.contains("epoch 4/4:"), "{log_a}");
    assert!(!log_a.contains("epoch 3/4"), "{log_a}");
    same_checkpoint(&a.join("ckpt"), &b.join("ckpt"), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A port for node 0's launcher (TCP) and rendezvous (UDP) inside the namespace: any, as the
/// namespace's ports are its own.
fn bonfire_launch_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(29_611);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `bonfire bench wan`: two sites of two ranks each whose only path is the slow link. The
/// benchmark's times cannot beat the link: a 4 KiB all-reduce needs at least one crossing (half
/// the round trip), and a 256 KiB one moves at least its bytes each way across the cap. The
/// link's own counts say what crossed, and the launchers' per-rank ports held (two ranks per
/// site on fixed ports).
#[test]
fn a_job_across_the_slow_link_is_bound_by_its_delay_and_cap() {
    let mut child = Command::new(BONFIRE)
        .args(["bench", "wan", "--rtt-ms", "40", "--loss-percent", "1"])
        .args(["--mbit", "10", "--nproc-per-site", "2", "--port", "29700"])
        .arg("--")
        .arg(BONFIRE)
        .args(["bench", "collectives", "--transport", "auto"])
        .args(["--sizes", "4K,256K", "--iters", "3", "--warmup", "1"])
        .env("BONFIRE_TIMEOUT", "120")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A hang is stopped with SIGTERM, so that `bench wan` still removes its namespaces.
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(300) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let hung = child.try_wait().unwrap().is_none();
    if hung {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    }
    let out = child.wait_with_output().unwrap();
    assert!(!hung, "bench wan did not end within 300 s: {}", text(&out));
    let log = text(&out);
    if log.contains("needs network namespaces") {
        eprintln!("skipped: this machine does not allow network namespaces (needs root and `ip`)");
        return;
    }
    assert!(out.status.success(), "{log}");
    assert!(log.contains("4 ranks"), "{log}");
    // Rows, after the launcher's `[rank 0]`: size (`4 KiB`), count, algorithm, iters, time(us),
    // ...
    let row = |l: &str| -> Vec<String> {
        l.split_whitespace()
            .skip_while(|t| t.starts_with('[') || t.ends_with(']'))
            .map(str::to_string)
            .collect()
    };
    let time_us = |size: &str| -> f64 {
        let cells = log
            .lines()
            .map(row)
            .find(|cells| cells.len() > 5 && cells[..2].join(" ") == size)
            .unwrap_or_else(|| panic!("no {size} row in {log}"));
        cells[5].parse().unwrap()
    };
    assert!(time_us("4 KiB") >= 20_000.0, "one crossing is 20 ms: {log}");
    let at_cap = 256.0 * 1024.0 * 8.0 / 10e6 * 1e6;
    assert!(time_us("256 KiB") >= at_cap, "256 KiB at 10 Mbit/s: {log}");
    for (from, to) in [("A", "B"), ("B", "A")] {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("site {from} -> site {to}:")))
            .unwrap_or_else(|| panic!("no link line in {log}"));
        let mib: f64 = line
            .split(" datagrams, ")
            .nth(1)
            .and_then(|r| r.split(" MiB").next())
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        // Four all-reduces of 256 KiB (warm-up included), each at least its bytes each way.
        assert!(mib >= 1.0, "{line}");
    }
}
