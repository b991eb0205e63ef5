//! `bonfire train gpt` as a user runs it: two ranks as two processes under the launcher, on the
//! plays compiled into bonfire (no download), with a tiny model: it learns, a run killed and
//! resumed ends bit for bit where an uninterrupted one does, `--sample` continues a prompt from a
//! checkpoint, and bad input exits 2 with a message.

mod common;

use std::path::Path;
use std::process::Output;

use common::{
    bonfire, f, kill_a_rank_after_first_checkpoint, kill_after_first_checkpoint, scratch, state,
    text,
};

/// A tiny GPT: one block of width 32 over 16 characters, 8 windows per rank per step.
const TINY: [&str; 22] = [
    "train",
    "gpt",
    "--dataset",
    "embedded",
    "--layers",
    "1",
    "--heads",
    "2",
    "--embd",
    "32",
    "--context",
    "16",
    "--batch",
    "8",
    "--lr",
    "0.01",
    "--eval-windows",
    "64",
    "--sample-chars",
    "40",
    "--eval-every",
    "10",
];

fn assert_clean_failure(out: &Output, needle: &str) {
    let log = text(out);
    assert_eq!(out.status.code(), Some(2), "{log}");
    assert!(log.contains(needle), "expected `{needle}` in: {log}");
    assert!(
        !log.contains("panicked") && !log.contains("stack backtrace"),
        "{log}"
    );
}

/// `bonfire train gpt` on the tiny model for `steps` steps into `run`, with `extra` flags; it
/// must succeed. Its output.
fn train_tiny(dir: &Path, steps: &str, run: &Path, extra: &[&str]) -> String {
    let out = bonfire(dir, &TINY)
        .args(["--steps", steps, "--checkpoint-dir"])
        .arg(run)
        .args(extra)
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    log
}

/// The same run killed after its first checkpoint; the name of that checkpoint.
fn kill_tiny(dir: &Path, steps: &str, run: &Path, extra: &[&str]) -> String {
    let mut cmd = bonfire(dir, &TINY);
    cmd.args(["--steps", steps, "--checkpoint-dir"])
        .arg(run)
        .args(extra);
    kill_after_first_checkpoint(&mut cmd, run)
}

/// Two processes: the validation loss falls well below a uniform guess over the vocabulary
/// (ln 67 = 4.2 nats) and below the first evaluation's; every evaluation prints a sample; the
/// plot is a PNG; `--sample` continues a prompt with the latest checkpoint.
#[test]
fn two_processes_learn_and_sample() {
    let dir = scratch("gpt-learn");
    let out = bonfire(&dir, &TINY)
        .args(["--steps", "40"])
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let run = dir.join("runs/gpt-1");
    let s = state(&run, 4);
    assert_eq!(s["config"]["ranks"], 2);
    assert_eq!(s["epochs"], 4);
    let h = s["history"].as_array().unwrap();
    assert_eq!(h.len(), 4);
    let (first, last) = (f(&h[0]["val_loss"]), f(&h[3]["val_loss"]));
    assert!(
        last < 3.2 && last < first - 0.2,
        "validation loss {first} -> {last}"
    );
    assert_eq!(h[3]["step"], 40);
    for r in h {
        assert_eq!(r["sample"].as_str().unwrap().chars().count(), 40);
    }
    assert_eq!(
        log.matches("sample (temperature 0.8, top-k 20):").count(),
        4,
        "{log}"
    );
    assert!(
        log.contains("== result") && log.contains("data parallel"),
        "{log}"
    );
    let png = std::fs::read(run.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");

    let out = bonfire(
        &dir,
        &["train", "gpt", "--sample", "KING", "--sample-chars", "30"],
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", text(&out));
    let sampled = stdout.trim_end_matches('\n');
    assert!(sampled.starts_with("KING"), "{sampled:?}");
    assert_eq!(sampled.chars().count(), 4 + 30, "{sampled:?}");
    // The same seed draws the same text; another seed, other text.
    let again = bonfire(
        &dir,
        &["train", "gpt", "--sample", "KING", "--sample-chars", "30"],
    )
    .output()
    .unwrap();
    assert_eq!(again.stdout, out.stdout);
    assert_clean_failure(
        &bonfire(&dir, &["train", "gpt", "--sample", "KING\u{20ac}"])
            .output()
            .unwrap(),
        "outside the model's vocabulary",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run killed after its first checkpoint and resumed ends with the same weights (digest of
/// every parameter) and the same losses as an uninterrupted run.
#[test]
fn resume_after_a_kill_equals_the_uninterrupted_run() {
    let dir = scratch("gpt-resume");
    let straight = dir.join("straight");
    train_tiny(&dir, "60", &straight, &[]);

    let killed = dir.join("killed");
    let done = kill_tiny(&dir, "60", &killed, &[]);
    assert_ne!(
        done, "epoch-6",
        "the job finished before it was killed: nothing resumed"
    );

    // Settings that would change the result are refused, with exit code 2; the checkpoint
    // stays.
    let mut resume = vec!["train", "gpt", "--resume", "--checkpoint-dir"];
    let killed_s = killed.to_str().unwrap();
    resume.push(killed_s);
    let mut changed = resume.clone();
    changed.extend(["--lr", "0.5"]);
    assert_clean_failure(
        &bonfire(&dir, &changed).output().unwrap(),
        "--lr 0.5 (the checkpoint has 0.01)",
    );
    let out = bonfire(&dir, &resume).output().unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("resuming from"), "{log}");
    let (a, b) = (state(&straight, 6), state(&killed, 6));
    let (ha, hb) = (
        a["history"].as_array().unwrap(),
        b["history"].as_array().unwrap(),
    );
    assert_eq!(ha.len(), 6);
    for (x, y) in ha.iter().zip(hb) {
        assert_eq!(
            x["param_digest"], y["param_digest"],
            "evaluation {}",
            x["eval"]
        );
        assert_eq!(x["val_loss"], y["val_loss"]);
        assert_eq!(x["train_loss"], y["train_loss"]);
        assert_eq!(x["sample"], y["sample"]);
    }

    // A checkpoint whose vocabulary is not the text's: refused before any rank starts. (Edited
    // by hand, so its checksums go too: a checkpoint without them loads, unchecked, only with
    // --allow-unchecked; without it, it is passed over for epoch 5.)
    let latest = killed.join("epoch-6/state.json");
    let mut st: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&latest).unwrap()).unwrap();
    st["config"]["vocab"] = "abc".into();
    st["epochs"] = 7.into();
    std::fs::write(&latest, serde_json::to_vec(&st).unwrap()).unwrap();
    std::fs::remove_file(killed.join("epoch-6/SHA256SUMS")).unwrap();
    let mut unchecked = resume.clone();
    unchecked.push("--allow-unchecked");
    assert_clean_failure(
        &bonfire(&dir, &unchecked).output().unwrap(),
        "is not the vocabulary of the embedded text here",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// dp 2 x tp 2, four processes: the model split by its plan within each replica (the vocabulary
/// padded from 67 to 68 for the split), gradients averaged shard by shard between replicas. It
/// learns, reports both axes, and a run killed after its first checkpoint and resumed ends bit
/// for bit where the uninterrupted one does (the optimizer state is gathered whole for the
/// checkpoint and split again on resume), also when it resumes with the optimizer's state and
/// the gradients sharded over the replicas (`--zero 2`; each tensor-parallel rank's share of
/// it, gathered over the group for the checkpoints it writes).
#[test]
fn hybrid_runs_learn_and_resume_exactly() {
    let dir = scratch("gpt-hybrid");
    let hybrid = [
        "--dp",
        "2",
        "--tp",
        "2",
        "--steps",
        "40",
        "--checkpoint-dir",
    ];
    let straight = dir.join("straight");
    let out = bonfire(&dir, &TINY)
        .args(hybrid)
        .arg(&straight)
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("4 rank(s): 2 data-parallel replica(s) x 2 tensor-parallel"),
        "{log}"
    );
    assert!(
        log.contains("tensor parallel 2 rank(s) per replica"),
        "{log}"
    );
    assert!(log.contains("data parallel"), "{log}");
    let s = state(&straight, 4);
    assert_eq!(
        (s["config"]["ranks"].as_u64(), s["config"]["tp"].as_u64()),
        (Some(4), Some(2))
    );
    let h = s["history"].as_array().unwrap();
    let (first, last) = (f(&h[0]["val_loss"]), f(&h[3]["val_loss"]));
    assert!(
        last < 3.4 && last < first - 0.1,
        "validation loss {first} -> {last}"
    );

    let killed = dir.join("killed");
    let done = kill_after_first_checkpoint(bonfire(&dir, &TINY).args(hybrid).arg(&killed), &killed);
    assert_ne!(done, "epoch-4", "the job finished before it was killed");
    let out = bonfire(
        &dir,
        &[
            "train",
            "gpt",
            "--resume",
            "--zero",
            "2",
            "--checkpoint-dir",
        ],
    )
    .arg(&killed)
    .output()
    .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("(ZeRO-2)"), "{log}");
    let r = state(&killed, 4);
    for (x, y) in h.iter().zip(r["history"].as_array().unwrap()) {
        assert_eq!(
            x["param_digest"], y["param_digest"],
            "evaluation {}",
            x["eval"]
        );
        assert_eq!(x["val_loss"], y["val_loss"]);
        assert_eq!(x["sample"], y["sample"]);
    }
    // --sample reads the whole model the hybrid run saved, on one process.
    let out = bonfire(
        &dir,
        &[
            "train",
            "gpt",
            "--sample",
            "KING",
            "--sample-chars",
            "20",
            "--checkpoint-dir",
        ],
    )
    .arg(&straight)
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .trim_end_matches('\n')
            .chars()
            .count(),
        24
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Gradient accumulation (`bonfire::accumulate` on all but the last micro-batch) and bf16
/// gradients with error feedback: the run trains and the settings reach the checkpoint; two
/// micro-batches of 4 per step learn about as fast as one batch of 8 in f32 (the windows drawn
/// differ, so the losses are compared with a bound, not for equality).
#[test]
fn accumulation_and_bf16_gradients_train() {
    let dir = scratch("gpt-accum");
    let mut tiny: Vec<&str> = TINY.to_vec();
    let batch = tiny.iter().position(|a| *a == "--batch").unwrap();
    tiny[batch + 1] = "4";
    let out = bonfire(&dir, &tiny)
        .args(["--steps", "20", "--grad-accum", "2", "--bf16-comm"])
        .args(["--checkpoint-dir", "accum"])
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("x 2 accumulated") && log.contains("bf16 gradients"),
        "{log}"
    );
    let s = state(&dir.join("accum"), 2);
    assert_eq!(
        (
            s["config"]["grad_accum"].as_u64(),
            s["config"]["bf16"].as_bool()
        ),
        (Some(2), Some(true))
    );
    let out = bonfire(&dir, &TINY)
        .args(["--steps", "20", "--checkpoint-dir", "whole"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let whole = state(&dir.join("whole"), 2);
    let (a, b) = (
        f(&s["history"][1]["val_loss"]),
        f(&whole["history"][1]["val_loss"]),
    );
    // The same on the hybrid mesh: accumulation and bf16 run through the per-shard path.
    let out = bonfire(&dir, &tiny)
        .args([
            "--steps",
            "20",
            "--grad-accum",
            "2",
            "--bf16-comm",
            "--tp",
            "2",
        ])
        .args(["--checkpoint-dir", "hybrid"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let h = f(&state(&dir.join("hybrid"), 2)["history"][1]["val_loss"]);
    assert!(h < 3.6, "validation loss {h} (hybrid, accumulated, bf16)");
    // 4.2 nats is a uniform guess; 20 steps of this tiny model reach about 3.4 either way.
    assert!(
        a < 3.6 && b < 3.6 && (a - b).abs() < 0.25,
        "validation loss {a} (accumulated, bf16), {b}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_exits_2_with_a_message() {
    let dir = scratch("gpt-bad");
    let cases: [(&[&str], &str); 11] = [
        (
            &["--tp", "3"],
            "--tp 3 with --heads 4: the tensor-parallel size must divide the heads",
        ),
        (
            &["--heads", "3"],
            "--heads 3 with --embd 128: the heads must divide the model width",
        ),
        (
            &["--dataset", "tolstoy"],
            "expected shakespeare or embedded",
        ),
        (&["--steps", "0"], "--steps"),
        (
            &["--warmup", "100", "--steps", "100"],
            "the warmup must be shorter than the run",
        ),
        (&["--resume", "--checkpoint-dir", "nowhere"], "nowhere"),
        (&["--sample", "x", "--checkpoint-dir", "nowhere"], "nowhere"),
        (&["--zero", "4"], "4 is not in 1..=3"),
        (
            &["--zero", "3", "--tp", "2"],
            "--zero 3 with --tp 2: ZeRO-3 shards the parameters over the data-parallel replicas",
        ),
        (
            &["--model-state-limit", "NaN"],
            "--model-state-limit NaN: must be a positive number of MiB",
        ),
        (
            &["--model-state-limit", "1", "--pp", "2"],
            "--model-state-limit 1: a pipeline's stages hold their own blocks",
        ),
    ];
    for (args, needle) in cases {
        let out = bonfire(&dir, &[&["train", "gpt"], args].concat())
            .output()
            .unwrap();
        assert_clean_failure(&out, needle);
    }
    assert_clean_failure(
        &bonfire(&dir, &["train", "gpt", "--sample", "x"])
            .output()
            .unwrap(),
        "no run in ./runs to sample from",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The digest of every evaluation's weights in the run of `dir`, which has `evals` of them.
fn digests(dir: &std::path::Path, evals: usize) -> Vec<String> {
    let s = state(dir, evals);
    let h = s["history"].as_array().unwrap();
    assert_eq!(h.len(), evals);
    h.iter()
        .map(|r| r["param_digest"].as_str().unwrap().to_string())
        .collect()
}

/// `--zero 1`: each rank keeps Adam's state for its share of the parameters (the report shows
/// the share), and every evaluation's weights are the bits of the run without it. Checkpoints
/// hold the whole state, so a run killed without `--zero` resumes with it, and the other way
/// round, and both end where the uninterrupted run does. With gradient accumulation and bf16
/// gradients too. `--zero 2` also shards the gradients (the report shows each rank holds its
/// share) and, at 2 ranks, changes no bit either; nor does `--zero 3`, which shards the
/// parameters too, and resumes after a kill.
#[test]
fn zero_shards_the_optimizer_and_changes_no_bit() {
    let dir = scratch("gpt-zero");
    let run = |name: &str, zero: bool| {
        let flags: &[&str] = if zero { &["--zero", "1"] } else { &[] };
        train_tiny(&dir, "60", &dir.join(name), flags)
    };
    let log = run("plain", false);
    assert!(
        log.contains("optimizer state") && log.contains("(whole on every rank)"),
        "{log}"
    );
    let plain = digests(&dir.join("plain"), 6);
    let log = run("sharded", true);
    assert!(
        log.contains("its state sharded over the replicas (ZeRO-1)"),
        "{log}"
    );
    // `optimizer state 0.07 MiB on the rank with most (ZeRO-1: 52% of the whole 0.13 MiB)`.
    let share: f64 = log
        .split("(ZeRO-1: ")
        .nth(1)
        .and_then(|rest| rest.split('%').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no ZeRO-1 share in: {log}"));
    assert!(
        (50.0..65.0).contains(&share),
        "{share}% of the state on one of 2 ranks: {log}"
    );
    assert_eq!(digests(&dir.join("sharded"), 6), plain);
    let log = train_tiny(&dir, "60", &dir.join("zero2"), &["--zero", "2"]);
    assert!(
        log.contains("its state and the gradients sharded over the replicas (ZeRO-2)"),
        "{log}"
    );
    // `gradients 0.07 MiB on the rank with most (ZeRO-2: 52% of the whole 0.13 MiB)`.
    let share: f64 = log
        .split("on the rank with most (ZeRO-2: ")
        .nth(1)
        .and_then(|rest| rest.split('%').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no ZeRO-2 gradient share in: {log}"));
    assert!(
        (50.0..65.0).contains(&share),
        "{share}% of the gradients on one of 2 ranks: {log}"
    );
    assert_eq!(digests(&dir.join("zero2"), 6), plain);
    // `--zero 3` shards the parameters too: each rank holds half of them, of their gradients and
    // of Adam's state (the report shows each share), gathering a parameter where a layer reads
    // it; at 2 ranks the weights are the bits of the run without it. A run killed with it
    // resumes with it to the same bits.
    let log = train_tiny(&dir, "60", &dir.join("zero3"), &["--zero", "3"]);
    let shares: Vec<f64> = log
        .split("(ZeRO-3: ")
        .skip(1)
        .filter_map(|rest| rest.split('%').next()?.parse().ok())
        .collect();
    assert_eq!(shares.len(), 3, "parameters, gradients, state: {log}");
    assert!(
        shares.iter().all(|s| (49.0..56.0).contains(s)),
        "{shares:?}% on one of 2 ranks: {log}"
    );
    // After the first step, which records the order, the reads of the parameters find their
    // gathers started ahead (eight parameters to an all-gather by default).
    let reads: Vec<u64> = log
        .split("fully sharded   on rank 0, training: ")
        .nth(1)
        .and_then(|rest| rest.split(" served by gathers started ahead").next())
        .map(|counts| {
            counts
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        matches!(reads[..], [all, served] if served > 0 && served < all && served * 10 > all * 8),
        "reads, served ahead {reads:?}: {log}"
    );
    // Each rank receives its slices of the averaged gradients only (a reduce-scatter), and the
    // two ranks add alike in either order: still the plain run's bits.
    assert!(log.contains(", reduce-scattered ("), "{log}");
    assert_eq!(digests(&dir.join("zero3"), 6), plain);
    // Its checkpoints are per rank: a manifest and each rank's slices, no whole model.
    let epoch = dir.join("zero3/epoch-6");
    assert!(
        epoch.join("manifest.json").exists()
            && epoch.join("zero3-rank0-of-2.bin").exists()
            && epoch.join("zero3-rank1-of-2.bin").exists()
            && !epoch.join("model.bin").exists(),
        "{epoch:?}"
    );
    let killed = dir.join("zero3-killed");
    let done = kill_tiny(&dir, "60", &killed, &["--zero", "3"]);
    assert_ne!(done, "epoch-6", "the job finished before it was killed");
    let mut resume = bonfire(&dir, &["train", "gpt", "--resume", "--checkpoint-dir"]);
    let out = resume.arg(&killed).args(["--zero", "3"]).output().unwrap();
    let log = text(&out);
    assert!(
        out.status.success() && log.contains("resuming from"),
        "{log}"
    );
    assert_eq!(digests(&killed, 6), plain, "resumed with --zero 3");

    // A run resumes at another stage, or without sharding, from either kind of checkpoint
    // (a per-rank one of `--zero 3` is put together whole on each rank).
    let (none, one, three): (&[&str], &[&str], &[&str]) = (&[], &["--zero", "1"], &["--zero", "3"]);
    for (name, first, then) in [
        ("to-zero", none, one),
        ("from-zero", one, none),
        ("from-zero3", three, none),
    ] {
        let killed = dir.join(name);
        let done = kill_tiny(&dir, "60", &killed, first);
        assert_ne!(done, "epoch-6", "the job finished before it was killed");
        let mut resume = bonfire(&dir, &["train", "gpt", "--resume", "--checkpoint-dir"]);
        resume.arg(&killed).args(then);
        let out = resume.output().unwrap();
        let log = text(&out);
        assert!(out.status.success(), "{log}");
        assert!(log.contains("resuming from"), "{log}");
        assert_eq!(digests(&killed, 6), plain, "{name}");
    }
    // With accumulated micro-batches and bf16 gradients (error feedback in the data-parallel
    // sync, before the sharded step sees the averages): the same bits with and without.
    let composed = ["--grad-accum", "2", "--bf16-comm"];
    train_tiny(&dir, "20", &dir.join("composed"), &composed);
    let log = train_tiny(
        &dir,
        "20",
        &dir.join("composed-zero"),
        &[&composed[..], &["--zero", "1"]].concat(),
    );
    assert!(log.contains("(ZeRO-1: "), "{log}");
    assert_eq!(
        digests(&dir.join("composed-zero"), 2),
        digests(&dir.join("composed"), 2)
    );
    let log = train_tiny(
        &dir,
        "20",
        &dir.join("composed-zero2"),
        &[&composed[..], &["--zero", "2"]].concat(),
    );
    assert!(log.contains("(ZeRO-2: "), "{log}");
    assert_eq!(
        digests(&dir.join("composed-zero2"), 2),
        digests(&dir.join("composed"), 2)
    );
    let log = train_tiny(
        &dir,
        "20",
        &dir.join("composed-zero3"),
        &[&composed[..], &["--zero", "3"]].concat(),
    );
    assert!(
        log.contains("(ZeRO-3: ") && log.contains(", reduce-scattered ("),
        "{log}"
    );
    assert_eq!(
        digests(&dir.join("composed-zero3"), 2),
        digests(&dir.join("composed"), 2)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model whose state does not fit a rank's limit whole (`--model-state-limit`, checked from
/// the sizes a rank holds once the model is laid out) trains at 4 ranks with `--zero 3`, where
/// each rank holds a quarter of it; without sharding, or with `--zero 2`, it is refused before
/// training with a message (every rank exits 2). The sharded run's checkpoint then samples on
/// one device.
#[test]
fn a_model_over_a_ranks_limit_trains_fully_sharded_and_samples_on_one_device() {
    let dir = scratch("gpt-limit");
    // The tiny GPT's whole state is about 0.24 MiB; a quarter of it fits 0.1 MiB, and ZeRO-2's
    // parameters whole with a quarter of the rest (0.10 MiB) do not.
    let limit = ["--dp", "4", "--model-state-limit", "0.1"];
    for (name, zero) in [("ddp", None), ("zero2", Some("2"))] {
        let mut cmd = bonfire(&dir, &TINY);
        cmd.args(["--steps", "10", "--checkpoint-dir"])
            .arg(dir.join(name))
            .args(limit);
        if let Some(z) = zero {
            cmd.args(["--zero", z]);
        }
        // Refused by the ranks once they laid the model out (each exits 2, the command 1).
        let out = cmd.output().unwrap();
        let log = text(&out);
        assert!(!out.status.success(), "{name}: {log}");
        assert!(
            log.contains("--model-state-limit 0.1 MiB: each rank would hold")
                && !log.contains("panicked"),
            "{name}: {log}"
        );
        assert!(
            !dir.join(name).join("latest").exists(),
            "{name}: refused before any checkpoint"
        );
    }
    let run = dir.join("zero3");
    let log = train_tiny(&dir, "20", &run, &[&limit[..], &["--zero", "3"]].concat());
    // Each rank wrote its quarter; sampling puts the model together on one device.
    assert!(run.join("epoch-2/zero3-rank3-of-4.bin").exists());
    assert!(
        log.contains("model state limit 0.1 MiB per rank")
            && log.contains("within the limit")
            && log.contains("(ZeRO-3: 25% of the whole"),
        "{log}"
    );
    let out = bonfire(
        &dir,
        &["train", "gpt", "--sample", "KING", "--sample-chars", "20"],
    )
    .arg("--checkpoint-dir")
    .arg(&run)
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let sampled = String::from_utf8_lossy(&out.stdout);
    assert!(sampled.starts_with("KING"), "{sampled:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Damaged checkpoints never panic a rank. A `latest` naming a path outside the run and a newest
/// checkpoint without SHA256SUMS (its model cut in half) are passed over, with a notice each,
/// and the run trains the lost round again to the uninterrupted run's bits. Loaded anyway
/// (`--allow-unchecked`), the cut model is an error naming the file, not a backtrace.
#[test]
fn damaged_checkpoints_are_passed_over_or_refused_without_a_panic() {
    let dir = scratch("gpt-damaged");
    let run = dir.join("run");
    train_tiny(&dir, "30", &run, &[]);
    let want = digests(&run, 3);
    let cut = |epoch: &std::path::Path| {
        let model = epoch.join("model.bin");
        let bytes = std::fs::read(&model).unwrap();
        std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
        std::fs::remove_file(epoch.join("SHA256SUMS")).unwrap();
    };
    cut(&run.join("epoch-3"));
    std::fs::write(run.join("latest"), "../../../etc").unwrap();
    let out = bonfire(&dir, &["train", "gpt", "--resume", "--checkpoint-dir"])
        .arg(&run)
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("passed over checkpoint latest names \"../../../etc\"")
            && log.contains("passed over checkpoint epoch-3: no SHA256SUMS")
            && log.contains("resuming from"),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(digests(&run, 3), want);

    // A run killed after its first checkpoint, whose model is then cut and its sums removed.
    let killed = dir.join("killed");
    let done = kill_tiny(&dir, "60", &killed, &[]);
    assert_ne!(done, "epoch-6", "the job finished before it was killed");
    cut(&killed.join(&done));
    let out = bonfire(&dir, &["train", "gpt", "--resume", "--allow-unchecked"])
        .arg("--checkpoint-dir")
        .arg(&killed)
        .output()
        .unwrap();
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("model") && log.contains("not a Burn 0.21 binary record"),
        "{log}"
    );
    assert!(
        !log.contains("panicked") && !log.contains("stack backtrace"),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every parameter of the model in checkpoint `epoch-N` of the run in `dir`, in module order.
fn weights(dir: &Path, n: usize) -> Vec<f32> {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    type B = burn::backend::Flex;
    struct Values(Vec<f32>);
    impl ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0
                .extend(p.val().into_data().to_vec::<f32>().expect("f32 parameters"));
        }
    }
    let config: bonfire_jobs::gpt::GptRunConfig =
        serde_json::from_value(state(dir, n)["config"].clone()).unwrap();
    let epoch = dir.join(format!("epoch-{n}"));
    let bytes = std::fs::read(epoch.join("model.bin")).unwrap();
    let device = Default::default();
    let model = bonfire_jobs::checkpoint::load_model(
        config.model().init::<B>(&device),
        &bytes,
        &device,
        &epoch,
    )
    .unwrap();
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    values.0
}

/// The pipeline tests' model and run: `TINY` with 3 blocks, batches of 2 and an evaluation every
/// 4 steps.
fn pipeline_tiny() -> Vec<&'static str> {
    let mut tiny: Vec<&str> = TINY.to_vec();
    let at = |t: &Vec<&str>, flag: &str| t.iter().position(|a| *a == flag).unwrap() + 1;
    let (layers, batch, every) = (
        at(&tiny, "--layers"),
        at(&tiny, "--batch"),
        at(&tiny, "--eval-every"),
    );
    tiny[layers] = "3";
    tiny[batch] = "2";
    tiny[every] = "4";
    tiny
}

/// Fails unless runs `a` and `b` under `dir` had two evaluations each with training and
/// validation losses within 1e-5, and every parameter within 1e-5 after each.
fn runs_close(dir: &Path, a: &str, b: &str) {
    let (sa, sb) = (state(&dir.join(a), 2), state(&dir.join(b), 2));
    let (ha, hb) = (
        sa["history"].as_array().unwrap(),
        sb["history"].as_array().unwrap(),
    );
    assert_eq!(ha.len(), 2, "{a}");
    assert_eq!(hb.len(), 2, "{b}");
    for (x, y) in ha.iter().zip(hb) {
        for loss in ["train_loss", "val_loss"] {
            let (p, q) = (f(&x[loss]), f(&y[loss]));
            assert!((p - q).abs() < 1e-5, "{a} against {b}: {loss} {p} and {q}");
        }
    }
    for n in [1, 2] {
        let d = max_difference(&dir.join(a), &dir.join(b), n);
        assert!(
            d < 1e-5,
            "{a} against {b}: parameters {d} apart after evaluation {n}"
        );
    }
}

/// The pipeline tests' run `name` under `dir` (`tiny`, 8 steps of 4 micro-batches, over `mesh`)
/// killed after its first checkpoint, then resumed with `extra`: its output. Fails unless the kill
/// came before the run ended and the resumed run succeeded from the checkpoint.
fn killed_and_resumed(
    dir: &Path,
    tiny: &[&str],
    mesh: &[&str],
    name: &str,
    extra: &[&str],
) -> String {
    let run = dir.join(name);
    let mut cmd = bonfire(dir, tiny);
    cmd.args(["--steps", "8", "--micro-batches", "4"])
        .args(mesh)
        .arg("--checkpoint-dir")
        .arg(&run);
    let done = kill_after_first_checkpoint(&mut cmd, &run);
    assert_eq!(done, "epoch-1", "the job finished before it was killed");
    let out = bonfire(dir, &["train", "gpt", "--resume", "--checkpoint-dir"])
        .arg(&run)
        .args(extra)
        .output()
        .unwrap();
    let log = text(&out);
    assert!(
        out.status.success() && log.contains("resuming from"),
        "{log}"
    );
    log
}

/// The largest difference between two runs' parameters after checkpoint `n`.
fn max_difference(a: &Path, b: &Path, n: usize) -> f32 {
    let (x, y) = (weights(a, n), weights(b, n));
    assert_eq!(x.len(), y.len());
    x.iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0, f32::max)
}

/// A pipeline whose stages are split over tensor-parallel ranks (`--tp 2 --pp 2`, four
/// processes; `--tp 2 --pp 3`, six; `--dp 2 --tp 2 --pp 2`, eight) trains as the same mesh
/// without the pipeline (`--tp 2`, `--dp 2 --tp 2`) with the same micro-batches: every evaluation's losses and every
/// parameter within 1e-5 after 8 Adam steps (the tensor-parallel runs pad the vocabulary to the
/// group, so one device is not their reference). The report names both stages. Killed after its
/// first checkpoint, the `--tp 2 --pp 2` run resumes bit for bit, and it resumes without the
/// pipeline (`--pp 1`) within 1e-5.
#[test]
fn pipeline_stages_split_over_tensor_parallel_ranks_train_as_tensor_parallelism() {
    let dir = scratch("gpt-pipeline-tp");
    let tiny = pipeline_tiny();
    let common = ["--steps", "8", "--micro-batches", "4"];
    let run = |name: &str, extra: &[&str]| -> String {
        let out = bonfire(&dir, &tiny)
            .args(common)
            .args(["--checkpoint-dir", name])
            .args(extra)
            .output()
            .unwrap();
        let log = text(&out);
        assert!(out.status.success(), "{name}: {log}");
        log
    };
    run("tp", &["--dp", "1", "--tp", "2"]);
    let log = run("tp-pp", &["--dp", "1", "--tp", "2", "--pp", "2"]);
    assert!(
        log.contains(
            "4 rank(s): 1 data-parallel replica(s) x 2 tensor-parallel x 2 pipeline stages (1f1b, 4 \
             micro-batches per step; each stage idles (p-1)/(m+p-1) = 20% of a step)"
        ),
        "{log}"
    );
    for line in [
        "pipeline stage 0 of 2: blocks 0..2",
        "pipeline stage 1 of 2: blocks 2..3",
        "tensor parallel 2 rank(s) per replica",
        " 0 fallback gather(s)",
    ] {
        assert!(log.contains(line), "{log}");
    }
    run("dp-tp", &["--dp", "2", "--tp", "2"]);
    let replicated = run("dp-tp-pp", &["--dp", "2", "--tp", "2", "--pp", "2"]);
    // Each rank averages its own shard of a gradient over the replicas and sums its shard of the
    // tied embedding with the other end's: a second replica adds no tensor-parallel traffic
    // (reading the gradients whole gathered each split one every step).
    let tp_line = |log: &str| {
        log.lines()
            .find(|l| l.starts_with("tensor parallel"))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no tensor-parallel line in: {log}"))
    };
    assert_eq!(tp_line(&replicated), tp_line(&log));
    let close = |a: &str, b: &str| runs_close(&dir, a, b);
    close("tp-pp", "tp");
    close("dp-tp-pp", "dp-tp");
    // Three stages (six processes): the middle one holds no embedding, so its plan has blocks
    // only.
    let log = run("tp-pp3", &["--dp", "1", "--tp", "2", "--pp", "3"]);
    assert!(log.contains("pipeline stage 1 of 3: blocks 1..2"), "{log}");
    close("tp-pp3", "tp");

    let mesh = ["--dp", "1", "--tp", "2", "--pp", "2"];
    let kill_and_resume =
        |name: &str, extra: &[&str]| killed_and_resumed(&dir, &tiny, &mesh, name, extra);
    kill_and_resume("killed", &[]);
    assert_eq!(
        digests(&dir.join("killed"), 2),
        digests(&dir.join("tp-pp"), 2)
    );
    kill_and_resume("moved", &["--pp", "1"]);
    assert_eq!(state(&dir.join("moved"), 2)["config"]["pp"], 1);
    close("moved", "tp-pp");
}

/// Pipeline parallelism in the bundled job: `--pp 2` (1F1B and GPipe) against one device with
/// the same micro-batches (`--micro-batches 4` is the same step), and `--dp 2 --pp 2` (four
/// processes) against `--dp 2`: every evaluation's losses within 1e-5, every parameter within
/// 1e-5 after 8 Adam steps (the tied embedding's gradient is summed per step across the first
/// and the last stage, not per micro-batch, so the bits may differ). The report names the
/// stages against the bubble. A run killed after its first checkpoint resumes bit for bit; its
/// checkpoint is the whole model (`--sample` reads it); `--pp` more than the blocks and `--zero`
/// with `--pp` are refused with exit code 2. A run resumes at another `--pp`. Interleaved 1F1B
/// (`--chunks 2`: 4 blocks in 4 chunks, 2 per stage) gives the plain pipeline's bits, and a run
/// killed with or without chunks resumes with them, bit for bit.
#[test]
fn pipeline_stages_train_as_one_device() {
    let dir = scratch("gpt-pipeline");
    let tiny = pipeline_tiny();
    let run = |name: &str, extra: &[&str]| -> String {
        let out = bonfire(&dir, &tiny)
            .args([
                "--steps",
                "8",
                "--micro-batches",
                "4",
                "--checkpoint-dir",
                name,
            ])
            .args(extra)
            .output()
            .unwrap();
        let log = text(&out);
        assert!(out.status.success(), "{name}: {log}");
        log
    };
    run("one", &["--dp", "1"]);
    let log = run("pp", &["--dp", "1", "--pp", "2"]);
    assert!(
        log.contains("1 data-parallel replica(s) x 2 pipeline stages (1f1b, 4 micro-batches"),
        "{log}"
    );
    for stage in [
        "pipeline stage 0 of 2: blocks 0..2",
        "pipeline stage 1 of 2: blocks 2..3",
    ] {
        assert!(log.contains(stage), "{log}");
    }
    assert!(log.contains("(the bubble (p-1)/(m+p-1) is 20.0%)"), "{log}");
    run("gpipe", &["--dp", "1", "--pp", "2", "--schedule", "gpipe"]);
    run("dp", &["--dp", "2"]);
    run("dp-pp", &["--dp", "2", "--pp", "2"]);
    let close = |a: &str, b: &str| runs_close(&dir, a, b);
    close("pp", "one");
    close("gpipe", "one");
    close("dp-pp", "dp");
    // The schedule changes the order of the work, not the arithmetic.
    assert_eq!(digests(&dir.join("pp"), 2), digests(&dir.join("gpipe"), 2));

    // `--pp 2` killed after its first checkpoint, then resumed with `extra`: its output.
    let kill_and_resume = |name: &str, extra: &[&str]| {
        killed_and_resumed(&dir, &tiny, &["--dp", "1", "--pp", "2"], name, extra)
    };
    // Resumed: the same bits as the uninterrupted run.
    kill_and_resume("killed", &[]);
    assert_eq!(digests(&dir.join("killed"), 2), digests(&dir.join("pp"), 2));
    // The checkpoint is the whole model: the same run resumes on one rank (`--pp 1`) and ends
    // where the pipeline does, within rounding.
    let log = kill_and_resume("moved", &["--pp", "1"]);
    assert!(log.contains("1 rank(s)"), "{log}");
    assert_eq!(state(&dir.join("moved"), 2)["config"]["pp"], 1);
    close("moved", "pp");
    let sample = bonfire(
        &dir,
        &["train", "gpt", "--sample", "ROMEO:", "--checkpoint-dir"],
    )
    .arg(dir.join("pp"))
    .output()
    .unwrap();
    assert!(sample.status.success(), "{}", text(&sample));
    assert!(String::from_utf8_lossy(&sample.stdout).starts_with("ROMEO:"));

    // Interleaving: the same blocks, the same arithmetic in another order.
    let mut four = tiny.clone();
    let layers = four.iter().position(|a| *a == "--layers").unwrap() + 1;
    four[layers] = "4";
    let run4 = |name: &str, extra: &[&str]| {
        let out = bonfire(&dir, &four)
            .args([
                "--steps",
                "8",
                "--micro-batches",
                "4",
                "--dp",
                "1",
                "--pp",
                "2",
            ])
            .args(extra)
            .arg("--checkpoint-dir")
            .arg(dir.join(name))
            .output()
            .unwrap();
        let log = text(&out);
        assert!(out.status.success(), "{name}: {log}");
        log
    };
    run4("pp4", &[]);
    let log = run4("chunks", &["--chunks", "2"]);
    assert!(
        log.contains(
            "2 pipeline stages (1f1b interleaved over 2 chunks per rank, 4 micro-batches per \
             step; each stage idles (p-1)/(v*m+p-1) = 11% of a step)"
        ),
        "{log}"
    );
    for stage in [
        "pipeline stage 0 of 2: blocks 0..1 and 2..3",
        "pipeline stage 1 of 2: blocks 1..2 and 3..4",
    ] {
        assert!(log.contains(stage), "{log}");
    }
    assert!(
        log.contains("(the bubble (p-1)/(v*m+p-1) is 11.1%)"),
        "{log}"
    );
    assert_eq!(
        digests(&dir.join("chunks"), 2),
        digests(&dir.join("pp4"), 2)
    );
    let mesh = ["--dp", "1", "--pp", "2", "--chunks", "2"];
    killed_and_resumed(&dir, &four, &mesh, "chunks-killed", &[]);
    assert_eq!(
        digests(&dir.join("chunks-killed"), 2),
        digests(&dir.join("chunks"), 2)
    );
    let log = killed_and_resumed(&dir, &four, &mesh[..4], "chunks-later", &["--chunks", "2"]);
    assert!(log.contains("interleaved over 2 chunks per rank"), "{log}");
    assert_eq!(state(&dir.join("chunks-later"), 2)["config"]["chunks"], 2);
    assert_eq!(
        digests(&dir.join("chunks-later"), 2),
        digests(&dir.join("pp4"), 2)
    );

    for (extra, says) in [
        (
            &["--pp", "4"][..],
            "each pipeline stage holds at least one block",
        ),
        (
            &["--pp", "2", "--zero", "1"][..],
            "a pipeline's stages keep their own optimizer state",
        ),
        (
            &["--pp", "2", "--schedule", "zigzag"][..],
            "expected gpipe or 1f1b",
        ),
        (
            &["--schedule", "gpipe"][..],
            "--schedule gpipe without --pp: a schedule orders a pipeline's micro-batches: it \
             needs --pp 2 or more",
        ),
        (
            &["--chunks", "2"][..],
            "--chunks 2 without --pp: chunks interleave a pipeline's stages",
        ),
        (
            &["--pp", "2", "--chunks", "2"][..],
            "--chunks 2 with --pp 2 and --layers 3: each chunk holds at least one block",
        ),
    ] {
        let out = bonfire(&dir, &tiny)
            .args(["--steps", "8", "--checkpoint-dir", "refused"])
            .args(extra)
            .output()
            .unwrap();
        assert_clean_failure(&out, says);
        assert!(
            !dir.join("refused").exists(),
            "{extra:?} left a run directory"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--strategy diloco` and `local-sgd`: the replicas step on their own gradients and meet every
/// `--sync-every` steps and at each evaluation; the report counts the meetings and the bytes
/// they sent. DiLoCo learns (with accumulation, deltas in int8, each meeting's exchange behind
/// the next step); a run killed after its first
/// checkpoint and resumed ends bit for bit where the uninterrupted one does (the checkpoint holds
/// every replica's Adam state and int8 rounding errors, and the outer momentum); bf16 deltas send
/// half the bytes, int8 a quarter; flags that do not go together are refused with exit code 2,
/// and a resume that changes the strategy too.
#[test]
fn local_strategies_meet_learn_and_resume_exactly() {
    let dir = scratch("gpt-strategy");
    let diloco = [
        "--strategy",
        "diloco",
        "--sync-every",
        "4",
        "--grad-accum",
        "2",
        "--int8-deltas",
        "--overlap-steps",
        "1",
    ];
    let straight = dir.join("straight");
    let log = train_tiny(&dir, "60", &straight, &diloco);
    // 60 steps: in each round of 10, meetings sent after 4 and 8 steps (applied a step later)
    // and one at the evaluation (H is counted again from each meeting).
    assert!(
        log.contains("strategy diloco, meeting every 4 steps (outer Nesterov lr 0.7, momentum 0.9), int8 deltas, each meeting behind the next 1 step(s) over 2 replica(s): 60 steps, 18 meetings"),
        "{log}"
    );
    assert!(log.contains("of exchanges ran behind the steps)"), "{log}");
    let s = state(&straight, 6);
    let h = s["history"].as_array().unwrap();
    let (first, last) = (f(&h[0]["val_loss"]), f(&h[5]["val_loss"]));
    assert!(
        last < 3.6 && last < first,
        "validation loss {first} then {last} (4.2 is a uniform guess)"
    );
    assert_eq!(s["config"]["strategy"]["kind"], "diloco");
    assert_eq!(s["config"]["strategy"]["int8"], true);
    assert_eq!(s["config"]["strategy"]["overlap"], 1);

    let killed = dir.join("killed");
    let done = kill_tiny(&dir, "60", &killed, &diloco);
    assert_ne!(done, "epoch-6", "the job finished before it was killed");
    let k = killed.to_str().unwrap();
    assert_clean_failure(
        &bonfire(
            &dir,
            &[
                "train",
                "gpt",
                "--resume",
                "--checkpoint-dir",
                k,
                "--sync-every",
                "8",
            ],
        )
        .output()
        .unwrap(),
        "--strategy diloco, meeting every 8 steps (outer Nesterov lr 0.7, momentum 0.9), int8 deltas, each meeting behind the next 1 step(s)",
    );
    let out = bonfire(&dir, &["train", "gpt", "--resume", "--checkpoint-dir", k])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(digests(&straight, 6), digests(&killed, 6));

    // Local SGD, deltas in f32, bf16 and int8, meeting at every 2nd step: 10 meetings, bf16
    // sending half the bytes, int8 a quarter (and a scale per 256 values).
    let mut mib = Vec::new();
    for (name, extra, meetings) in [
        ("f32", &[][..], "20 steps, 10 meetings"),
        ("bf16", &["--bf16-comm"][..], "20 steps, 10 meetings"),
        ("int8", &["--int8-deltas"][..], "20 steps, 10 meetings"),
    ] {
        let args = [&["--strategy", "local-sgd", "--sync-every", "2"][..], extra].concat();
        let log = train_tiny(&dir, "20", &dir.join(name), &args);
        let line = log
            .lines()
            .find(|l| l.starts_with("strategy local-sgd"))
            .unwrap_or_else(|| panic!("{log}"));
        assert!(line.contains(meetings), "{line}");
        let kib: f64 = line
            .split(" KiB per step")
            .next()
            .and_then(|l| l.rsplit('(').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        mib.push(kib);
    }
    let (bf16, int8) = (mib[1] / mib[0], mib[2] / mib[0]);
    assert!(
        (bf16 - 0.5).abs() < 0.02 && (int8 - 0.254).abs() < 0.01,
        "KiB per step: f32 {}, bf16 {}, int8 {}",
        mib[0],
        mib[1],
        mib[2]
    );

    for (args, needle) in [
        (
            &["--sync-every", "5"][..],
            "--sync-every with --strategy allreduce: only local-sgd and diloco meet",
        ),
        (
            &["--strategy", "gossip"][..],
            "must be allreduce, local-sgd, diloco, ps-sync or ps-async",
        ),
        (
            &["--strategy", "local-sgd", "--outer-lr", "0.5"][..],
            "--outer-lr with --strategy local-sgd: only diloco has an outer optimizer",
        ),
        (
            &["--strategy", "diloco", "--outer-momentum", "1"][..],
            "--outer-momentum 1: must be at least 0 and below 1",
        ),
        (
            &["--strategy", "diloco", "--tp", "2"][..],
            "local-sgd, diloco and parameter servers run over data-parallel replicas of the whole \
             model",
        ),
        (
            &["--strategy", "diloco", "--zero", "1"][..],
            "local-sgd and diloco keep each replica's optimizer state",
        ),
        (
            &[
                "--strategy",
                "local-sgd",
                "--sync-every",
                "4",
                "--overlap-steps",
                "4",
            ][..],
            "--overlap-steps 4 with meetings every 4 steps: must be below --sync-every",
        ),
        (
            &["--overlap-steps", "1"][..],
            "--overlap-steps with --strategy allreduce: only local-sgd and diloco meet",
        ),
        (
            &["--int8-deltas"][..],
            "--int8-deltas with --strategy allreduce: only local-sgd and diloco send deltas",
        ),
        (
            &["--strategy", "local-sgd", "--int8-deltas", "--bf16-comm"][..],
            "--int8-deltas with --bf16-comm: the deltas travel in one dtype",
        ),
    ] {
        let out = bonfire(&dir, &[&TINY[..], args].concat()).output().unwrap();
        assert_clean_failure(&out, needle);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--strategy ps-async` trains on without a worker that dies: 4 ranks (workers 0 to 2, rank 3
/// serving), worker 1's process killed with SIGKILL once the first checkpoint is written. The
/// run succeeds with no restart: the server drops the worker, the ranks left say they go on
/// without it and evaluate, save and report among themselves, every round is recorded, and the
/// model still learns.
#[test]
fn asynchronous_parameter_servers_train_on_without_a_dead_worker() {
    let dir = scratch("gpt-ps-dead");
    let run = dir.join("run");
    let mut cmd = bonfire(&dir, &TINY);
    cmd.args(["--steps", "60", "--dp", "4", "--strategy", "ps-async"])
        .arg("--checkpoint-dir")
        .arg(&run);
    let out = kill_a_rank_after_first_checkpoint(&mut cmd, &run, 1);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert!(log.contains("dropped worker 1 after"), "{log}");
    assert!(
        log.contains("going on without rank(s) 1 (the parameter servers dropped them): 3 of 4"),
        "{log}"
    );
    assert!(
        log.contains("the run finished without the expendable rank that failed (rank 1"),
        "{log}"
    );
    assert!(!log.contains("restart"), "{log}");
    // Workers 0 and 2 pushed every step of theirs; worker 1 at least its first round's.
    let pushes: u64 = log
        .split("steps from ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no server line in: {log}"));
    assert!(
        (2 * 60 + 10..3 * 60).contains(&pushes),
        "{pushes} pushes: {log}"
    );
    let s = state(&run, 6);
    let h = s["history"].as_array().unwrap();
    assert_eq!(h.len(), 6);
    assert_eq!(h[5]["step"], 60);
    // Asynchronous steps depend on timing: the bound is loose (a uniform guess is 4.2).
    let (first, last) = (f(&h[0]["val_loss"]), f(&h[5]["val_loss"]));
    assert!(
        last.is_finite() && last < 3.6 && last < first - 0.05,
        "validation loss {first} -> {last}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--strategy ps-sync` on the GPT job: at 3 ranks (2 workers, the last rank serving) every
/// evaluation's weights are the bits of allreduce at 2 ranks (a server's mean of two gradients
/// is the all-reduce's); at 4 ranks with 2 servers, killed after its first checkpoint and
/// resumed (the checkpoint holds both servers' Adam states, each server takes back its share),
/// it ends there too. `ps-async` trains and reports the staleness it saw; flags that do not go
/// with parameter servers are refused with exit code 2.
#[test]
fn parameter_servers_train_the_gpt_as_allreduce_does() {
    let dir = scratch("gpt-ps");
    train_tiny(&dir, "60", &dir.join("allreduce"), &[]);
    let plain = digests(&dir.join("allreduce"), 6);
    let log = train_tiny(
        &dir,
        "60",
        &dir.join("served"),
        &["--dp", "3", "--strategy", "ps-sync"],
    );
    // 60 steps of 2 workers: 120 pushes, 60 optimizer steps.
    assert!(
        log.contains("3 rank(s): 2 worker(s) and 1 parameter server(s) (ps-sync")
            && log.contains("60 steps from 120 pushes")
            && log.contains("parameter worker 1: 60 pushes"),
        "{log}"
    );
    assert_eq!(digests(&dir.join("served"), 6), plain, "ps-sync at 3 ranks");

    let killed = dir.join("killed");
    let two = ["--dp", "4", "--strategy", "ps-sync", "--servers", "2"];
    let done = kill_tiny(&dir, "60", &killed, &two);
    assert_ne!(done, "epoch-6", "the job finished before it was killed");
    let mut resume = bonfire(&dir, &["train", "gpt", "--resume", "--checkpoint-dir"]);
    let out = resume.arg(&killed).output().unwrap();
    let log = text(&out);
    assert!(
        out.status.success()
            && log.contains("resuming from")
            && log.contains("parameter server 1:"),
        "{log}"
    );
    assert_eq!(
        digests(&killed, 6),
        plain,
        "ps-sync with 2 servers, resumed"
    );

    let log = train_tiny(
        &dir,
        "60",
        &dir.join("async"),
        &["--dp", "3", "--strategy", "ps-async", "--staleness", "1"],
    );
    assert!(
        log.contains("ps-async, 1 server(s), staleness bound 1")
            && log.contains("120 steps from 120 pushes")
            && log.contains("histogram ["),
        "{log}"
    );
    let s = state(&dir.join("async"), 6);
    let val = f(&s["history"][5]["val_loss"]);
    assert!(val.is_finite() && val < 4.2, "validation loss {val}");

    for (args, needle) in [
        (
            &["--dp", "3", "--strategy", "ps-sync", "--bf16-comm"][..],
            "parameter servers push gradients and pull parameters in f32",
        ),
        (
            &["--dp", "3", "--strategy", "ps-sync", "--zero", "1"][..],
            "parameter servers keep it on the servers",
        ),
        (
            &["--dp", "2", "--strategy", "ps-sync", "--servers", "2"][..],
            "the servers must be fewer than the ranks",
        ),
    ] {
        let out = bonfire(&dir, &[&TINY[..], args].concat()).output().unwrap();
        assert_clean_failure(&out, needle);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
