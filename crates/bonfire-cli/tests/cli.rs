//! The `bonfire` command as a user runs it: the bench table, and clean failures on bad input.

use std::process::{Command, Output};

fn bonfire(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bonfire"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("the bonfire binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The data rows of a bench table, split into columns.
fn rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            // "1 KiB" is one column: join the number and its unit.
            let words: Vec<&str> = l.split_whitespace().collect();
            let mut cols = vec![format!("{} {}", words[0], words[1])];
            cols.extend(words[2..].iter().map(|w| w.to_string()));
            cols
        })
        .collect()
}

#[test]
fn bench_prints_one_row_per_size_with_consistent_bandwidths() {
    let out = bonfire(&[
        "bench",
        "collectives",
        "--nproc",
        "3",
        "--sizes",
        "1K,96K",
        "--iters",
        "4",
        "--warmup",
        "1",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("all-reduce (sum), 3 ranks, in-process transport, f32"),
        "{stdout}"
    );
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 2, "{stdout}");
    assert_eq!(rows[0][0], "1 KiB");
    assert_eq!(rows[1][1], (96 * 1024 / 4).to_string());
    for r in &rows {
        let time_us: f64 = r[4].parse().unwrap();
        let algbw: f64 = r[5].parse().unwrap();
        let busbw: f64 = r[6].parse().unwrap();
        assert!(time_us > 0.0 && algbw > 0.0, "{r:?}");
        // nccl-tests: all-reduce busbw = algbw x 2(n-1)/n = algbw x 4/3 for 3 ranks.
        assert!((busbw / algbw - 4.0 / 3.0).abs() < 0.01, "{r:?}");
    }
}

#[test]
fn bench_takes_every_option() {
    let out = bonfire(&[
        "bench",
        "collectives",
        "--nproc",
        "4",
        "--op",
        "all-gather",
        "--algorithm",
        "recursive-doubling",
        "--dtype",
        "bf16",
        "--sizes",
        "64K",
        "--iters",
        "3",
        "--chunk",
        "4K",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let rows = rows(&stdout);
    assert_eq!(rows[0][0], "64 KiB");
    assert_eq!(
        rows[0][1],
        (64 * 1024 / 2 / 4).to_string(),
        "all-gather counts per rank"
    );
    assert_eq!(rows[0][2], "recursive-doubling");
    let (algbw, busbw): (f64, f64) = (rows[0][5].parse().unwrap(), rows[0][6].parse().unwrap());
    assert!(
        (busbw / algbw - 0.75).abs() < 0.01,
        "all-gather busbw = algbw x (n-1)/n"
    );
}

fn assert_clean_failure(out: &Output, code: i32, needle: &str) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(stderr.contains(needle), "expected `{needle}` in: {stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("stack backtrace"),
        "{stderr}"
    );
}

#[test]
fn bad_input_gets_a_message_not_a_backtrace() {
    assert_clean_failure(
        &bonfire(&["bench", "collectives", "--sizes", "12X"]),
        2,
        "unknown unit",
    );
    assert_clean_failure(
        &bonfire(&["bench", "collectives", "--nproc", "0"]),
        2,
        "--nproc",
    );
    assert_clean_failure(
        &bonfire(&["bench", "collectives", "--transport", "carrier-pigeon"]),
        2,
        "inproc",
    );
    assert_clean_failure(
        &bonfire(&["bench", "collectives", "--dtype", "f8"]),
        2,
        "unknown dtype",
    );
    assert_clean_failure(
        &bonfire(&["bench", "collectives", "--frobnicate"]),
        2,
        "--frobnicate",
    );
    assert_clean_failure(
        &bonfire(&[
            "bench",
            "collectives",
            "--op",
            "broadcast",
            "--algorithm",
            "halving-doubling",
            "--sizes",
            "1K",
        ]),
        1,
        "error: broadcast on rank 0 has no halving-doubling schedule; it implements ring, tree",
    );
}

#[test]
fn the_quic_bench_launches_itself_and_prints_rank_zeros_table() {
    let out = bonfire(&[
        "bench",
        "collectives",
        "--transport",
        "quic",
        "--nproc",
        "2",
        "--sizes",
        "1K,256K",
        "--iters",
        "3",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("2 ranks, QUIC transport"), "{stdout}");
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 2, "one table, from rank 0 alone: {stdout}");
    assert_eq!(rows[1][0], "256 KiB");
}

#[test]
fn bonfire_log_turns_on_each_ranks_collective_traces_and_a_bad_filter_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_bonfire"))
        .args([
            "bench",
            "collectives",
            "--transport",
            "quic",
            "--nproc",
            "2",
            "--sizes",
            "1K",
            "--iters",
            "2",
        ])
        .env(
            "BONFIRE_LOG",
            "bonfire_collectives=debug,bonfire_transport=debug",
        )
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for rank in 0..2 {
        // One prefix per line (the launcher's), then the level and where the event comes from.
        assert!(
            stderr.contains(&format!(
                "[rank {rank}] DEBUG bonfire_collectives::communicator: all_reduce #"
            )),
            "rank {rank}'s collective traces: {stderr}"
        );
        assert!(
            !stderr.contains(&format!("[rank {rank}] [rank {rank}]")),
            "{stderr}"
        );
    }
    assert!(
        stderr.contains("DEBUG bonfire_transport::job: rank 0: job transport up"),
        "{stderr}"
    );
    // Without BONFIRE_LOG none of this is shown.
    let quiet = bonfire(&[
        "bench",
        "collectives",
        "--nproc",
        "2",
        "--sizes",
        "1K",
        "--iters",
        "2",
    ]);
    assert!(
        !text(&quiet.stderr).contains("DEBUG"),
        "{}",
        text(&quiet.stderr)
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_bonfire"))
        .args(["doctor"])
        .env("BONFIRE_LOG", "bonfire=loudly")
        .output()
        .unwrap();
    assert_clean_failure(
        &bad,
        2,
        "BONFIRE_LOG=\"bonfire=loudly\" is not a log filter",
    );
}

#[test]
fn doctor_lists_the_machine_and_fails_on_an_unreachable_master() {
    let out = bonfire(&["doctor"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    for check in [
        "cpu", "vulkan", "cuda", "/dev/shm", "port", "datasets", "npm", "pip",
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.split_whitespace().nth(1) == Some(check)),
            "no {check} line: {stdout}"
        );
    }
    assert!(stdout.contains("nothing essential is missing"), "{stdout}");
    let free = bonfire::launch::free_local_port().unwrap();
    let out = bonfire(&["doctor", "--master", &format!("127.0.0.1:{free}")]);
    assert_clean_failure(&out, 1, "bonfire doctor: master failed");
    assert!(text(&out.stdout).contains("FAIL  master    cannot connect to 127.0.0.1:"));
}

#[test]
fn launch_runs_ranks_with_prefixed_output_and_names_a_failed_rank() {
    let bin = env!("CARGO_BIN_EXE_bonfire");
    let out = bonfire(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        bin,
        "bench",
        "collectives",
        "--transport",
        "quic",
        "--sizes",
        "4K",
        "--iters",
        "2",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("[rank 0] # bonfire bench collectives")),
        "{stdout}"
    );

    let out = bonfire(&[
        "launch",
        "--nproc-per-node",
        "3",
        "--peer-timeout",
        "1",
        "--",
        "sh",
        "-c",
        "echo hello from $RANK; [ $RANK != 2 ] || exit 7; sleep 20",
    ]);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("[rank 2] hello from 2"), "{stdout}");
    assert_clean_failure(&out, 1, "rank 2 (pid ");
    assert!(text(&out.stderr).contains("exited with status 7"));
}

#[test]
fn launch_refuses_bad_requests_clearly() {
    let out = bonfire(&["launch", "--nnodes", "2", "--", "true"]);
    assert_clean_failure(&out, 1, "needs --master-addr");
    let out = bonfire(&[
        "launch",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1:29500",
        "--",
        "true",
    ]);
    assert_clean_failure(&out, 1, "--secret-file");
    let out = bonfire(&["launch", "--master-addr", "nohost", "--", "true"]);
    assert_clean_failure(&out, 1, "expected HOST:PORT");
    let out = bonfire(&[
        "launch",
        "--secret-file",
        "/nonexistent/secret",
        "--",
        "true",
    ]);
    assert_clean_failure(&out, 1, "cannot read the secret file");
    let out = bonfire(&["launch", "--timeout", "0", "--", "true"]);
    assert_clean_failure(&out, 2, "positive number of seconds");
    let out = bonfire(&["launch", "--", "/nonexistent/program"]);
    assert_clean_failure(&out, 1, "cannot start rank 0");
}

/// `bonfire bench collectives --transport quic` as rank 1 of a job whose master is not there.
fn orphan_rank(secret: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bonfire"));
    cmd.args([
        "bench",
        "collectives",
        "--transport",
        "quic",
        "--sizes",
        "1K",
    ])
    .env("RANK", "1")
    .env("WORLD_SIZE", "2")
    .env("MASTER_ADDR", "127.0.0.1")
    .env("MASTER_PORT", "9")
    .env("BONFIRE_CONNECT_TIMEOUT", "2")
    .env("RUST_BACKTRACE", "1")
    .env_remove("BONFIRE_SECRET")
    .env_remove("BONFIRE_SECRET_FILE");
    if let Some(secret) = secret {
        cmd.env("BONFIRE_SECRET", secret);
    }
    cmd.output().expect("the bonfire binary runs")
}

#[test]
fn a_rank_that_cannot_reach_its_master_fails_with_a_message() {
    let out = orphan_rank(Some("a-secret-of-enough-length"));
    assert_clean_failure(&out, 1, "did not answer within");
    let out = orphan_rank(None);
    assert_clean_failure(&out, 1, "has no secret");
}

#[test]
fn the_kernel_bench_compares_fused_kernels_with_burn_ops() {
    let out = bonfire(&[
        "bench",
        "kernels",
        "--sizes",
        "64K",
        "--iters",
        "2",
        "--buffers",
        "3",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    for op in [
        "device copy (roofline)",
        "pack + scale (f32)",
        "reduce 2 buckets, mean",
        "unpack + scale",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(op))
            .unwrap_or_else(|| panic!("no `{op}` row: {stdout}"));
        let speed: f64 = line
            .split_whitespace()
            .rev()
            .nth(1)
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("no GB/s in `{line}`"));
        assert!(speed > 0.0, "{line}");
    }
}

/// `bonfire bench pp` on a tiny model: one row per (stages, schedule, micro-batches), the first
/// step's loss the same in every row (one process and two stages compute the same step), each
/// stage's idle time and what it held (1F1B: 2 and 1 micro-batches over 2 stages; GPipe: all
/// of them); a micro-batch count that does not divide the batch exits 2 with a message.
#[test]
fn bench_pp_splits_the_gpt_into_stages_with_the_same_loss() {
    let tiny = [
        "bench",
        "pp",
        "--layers",
        "2",
        "--embd",
        "32",
        "--heads",
        "2",
        "--context",
        "16",
        "--batch",
        "8",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--pp",
        "1,2",
        "--micro-batches",
        "4",
    ];
    let out = bonfire(&tiny);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    // pp 1 (one schedule), pp 2 under 1F1B and GPipe.
    assert_eq!(rows.len(), 3, "{stdout}");
    assert_eq!((rows[0][0], rows[1][1], rows[2][1]), ("1", "1f1b", "gpipe"));
    let loss = |r: &Vec<&str>| r.last().unwrap().parse::<f32>().unwrap();
    for r in &rows {
        assert_eq!(loss(r), loss(&rows[0]), "{stdout}");
        assert!(loss(r) > 3.5 && loss(r) < 5.0, "{stdout}");
    }
    // held: "2 / 1" under 1F1B, "4 / 4" under GPipe.
    assert!(rows[1].join(" ").contains("2 / 1"), "{stdout}");
    assert!(rows[2].join(" ").contains("4 / 4"), "{stdout}");
    let bad = bonfire(&[
        "bench",
        "pp",
        "--layers",
        "2",
        "--batch",
        "8",
        "--micro-batches",
        "3",
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad.stderr).contains("--micro-batches 3: must divide a replica's 8 sequences"),
        "{}",
        text(&bad.stderr)
    );
}
