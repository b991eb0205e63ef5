//! The example as users run it: two processes under the launcher, over QUIC, against one process
//! with the whole batch (same parameters after K steps within 1e-5), and bit-identical across runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use bonfire_launch::{LaunchConfig, launch};

const BIN: &str = env!("CARGO_BIN_EXE_mnist-style");
const STEPS: &str = "4";

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mnist-style-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn params(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn two_ranks(dump: &Path, extra: &[&str]) -> (Vec<f32>, Vec<f32>) {
    let mut c = LaunchConfig::local(2, BIN);
    c.args = [
        "--steps",
        STEPS,
        "--batch",
        "8",
        "--train-size",
        "256",
        "--dump",
    ]
    .iter()
    .map(Into::into)
    .chain([dump.as_os_str().to_owned()])
    .chain(extra.iter().map(Into::into))
    .collect();
    launch(&c).expect("the two-rank job succeeds");
    (
        params(&dump.join("rank0.bin")),
        params(&dump.join("rank1.bin")),
    )
}

#[test]
fn two_processes_over_quic_match_one_process_with_the_whole_batch() {
    let one = scratch("one");
    let status = Command::new(BIN)
        .args([
            "--steps",
            STEPS,
            "--batch",
            "16",
            "--train-size",
            "256",
            "--dump",
        ])
        .arg(&one)
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .status()
        .unwrap();
    assert!(status.success());
    let reference = params(&one.join("rank0.bin"));

    let two = scratch("two");
    let (r0, r1) = two_ranks(&two, &[]);
    assert_eq!(r0, r1, "the replicas differ");
    assert_eq!(r0.len(), reference.len());
    let diff = r0
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        diff <= 1e-5,
        "2 ranks x 8 differ from 1 rank x 16 by {diff:e}"
    );
    // And training did something.
    let initial = scratch("initial");
    let status = Command::new(BIN)
        .args(["--steps", "0", "--epochs", "0", "--dump"])
        .arg(&initial)
        .status()
        .unwrap();
    assert!(status.success());
    let moved = params(&initial.join("rank0.bin"))
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(moved > 1e-3, "parameters moved by {moved}");

    // Same seed, same bits.
    let again = scratch("again");
    assert_eq!(two_ranks(&again, &[]).0, r0, "a second run differs");

    // The optimizer's state sharded over the two processes (ZeRO stage 1): the same bits.
    let zero = scratch("zero");
    let (z0, z1) = two_ranks(&zero, &["--zero"]);
    assert_eq!(z0, z1, "the replicas differ under --zero");
    assert!(z0 == r0, "--zero changed the parameters");
    for d in [one, two, initial, again, zero] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn a_bad_flag_is_a_clear_error() {
    let out = Command::new(BIN)
        .arg("--batch")
        .arg("zero")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--batch") && !err.contains("panicked"),
        "{err}"
    );
}
