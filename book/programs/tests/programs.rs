//! The book's training programs as users run them: several processes started with the variables
//! a launcher (torchrun, Slurm, `bonfire launch`) gives each rank, on this host. Each job must
//! finish on every rank and its loss must fall.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `program` as a job of `ranks` processes (with `env` added) and returns each rank's output
/// once all have exited; a rank still running after two minutes fails the test.
fn job(program: &str, ranks: usize, env: &[(&str, &str)]) -> Vec<Output> {
    let port = bonfire_launch::free_local_port()
        .expect("a free port")
        .to_string();
    let children: Vec<_> = (0..ranks)
        .map(|r| {
            let mut cmd = Command::new(program);
            if ranks > 1 {
                cmd.env("RANK", r.to_string())
                    .env("WORLD_SIZE", ranks.to_string())
                    .env("LOCAL_RANK", r.to_string())
                    .env("LOCAL_WORLD_SIZE", ranks.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", &port)
                    .env("BONFIRE_SECRET", "the book's programs");
            }
            cmd.envs(env.iter().copied())
                .env("RAYON_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("{program}: {e}"))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut children = children;
    while !children
        .iter_mut()
        .all(|c| c.try_wait().expect("wait").is_some())
    {
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("{program}: a rank of {ranks} was still running after two minutes");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("output"))
        .collect();
    for (r, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "{program} rank {r} of {ranks}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    outputs
}

/// The losses rank 0 printed (`... loss X`), in order.
fn losses(out: &Output) -> Vec<f32> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split("loss ").nth(1)?.trim().parse().ok())
        .collect()
}

/// Rank 0 printed `lines` losses, and the last is below `fraction` of the first.
fn assert_learns(out: &Output, lines: usize, fraction: f32, what: &str) {
    let l = losses(out);
    assert_eq!(
        l.len(),
        lines,
        "{what}: {l:?}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(l.iter().all(|x| x.is_finite()), "{what}: {l:?}");
    assert!(
        l[lines - 1] < fraction * l[0],
        "{what} did not learn: {l:?}"
    );
}

#[test]
fn the_swap_in_program_trains_alone_and_as_two_processes() {
    let bin = env!("CARGO_BIN_EXE_swap-in");
    let alone = job(bin, 1, &[]);
    assert_learns(&alone[0], 5, 0.5, "one process");
    let two = job(bin, 2, &[]);
    assert_learns(&two[0], 5, 0.5, "two processes");
    let report = String::from_utf8_lossy(&two[0].stdout);
    assert!(
        report.contains("done; last step: Some(StepStats { steps: 1"),
        "{report}"
    );
    assert!(two[1].stdout.is_empty(), "only rank 0 prints");
}

#[test]
fn the_tensor_parallel_program_trains_on_two_ranks() {
    let out = job(
        env!("CARGO_BIN_EXE_tensor-parallel"),
        2,
        &[("BONFIRE_TP", "2")],
    );
    assert_learns(&out[0], 6, 0.8, "tp 2");
}

#[test]
fn the_hybrid_program_trains_on_two_replicas_of_two_ranks() {
    let out = job(env!("CARGO_BIN_EXE_hybrid"), 4, &[("BONFIRE_TP", "2")]);
    assert_learns(&out[0], 6, 0.8, "dp 2 x tp 2");
}

/// Burn's `TransformerEncoder` split into pipeline stages: as one process (one stage), two and
/// four stages, under 1F1B and GPipe, two replicas of two stages (`BONFIRE_PP=2` of 4 ranks),
/// and two stages of two chunks each (interleaved 1F1B), the last rank prints the losses one
/// process prints (the same arithmetic, micro-batch
/// by micro-batch, with activations and gradients moved between processes and averaged between
/// replicas), and they fall.
#[test]
fn the_pipeline_program_trains_over_two_and_four_stages_as_on_one() {
    let bin = env!("CARGO_BIN_EXE_pipeline");
    let alone = job(bin, 1, &[("BOOK_MICRO_BATCHES", "4")]);
    assert_learns(&alone[0], 6, 0.8, "one stage");
    let want = losses(&alone[0]);
    for (ranks, stages, schedule, chunks) in [
        (2, "2", "1f1b", "1"),
        (4, "4", "1f1b", "1"),
        (2, "2", "gpipe", "1"),
        (4, "2", "1f1b", "1"),
        (2, "2", "1f1b", "2"),
    ] {
        let env = [
            ("BOOK_SCHEDULE", schedule),
            ("BONFIRE_PP", stages),
            ("BOOK_MICRO_BATCHES", "4"),
            ("BOOK_CHUNKS", chunks),
        ];
        let out = job(bin, ranks, &env);
        let got = losses(&out[ranks - 1]);
        let what = format!("{ranks} ranks, {stages} stages, {schedule}, {chunks} chunk(s)");
        assert_eq!(got.len(), want.len(), "{what}: {got:?}");
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-4 * w.abs(),
                "{what}: {got:?} against {want:?}"
            );
        }
        for early in &out[..ranks - 1] {
            assert!(early.stdout.is_empty(), "{what}: only the last rank prints");
        }
    }
}
