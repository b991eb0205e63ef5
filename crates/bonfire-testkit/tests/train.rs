//! burn-train over `Autodiff<DataParallel<Flex>>`, against single-rank burn-train training of
//! the same model on the same samples (Adam, max abs difference of the parameters at most 1e-5):
//! bonfire's `DataParallelStrategy` with ranks as threads and as processes under the launcher
//! (accumulation, resume from a checkpoint, bad resume), and burn-train's own DDP strategy over
//! one CPU device listed twice.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bonfire::backend::{DataParallelConfig, FailurePolicy, bind_thread};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire_launch::{LaunchConfig, launch};
use bonfire_testkit::learn::{How, Run, check_run, fit, interleave};
use bonfire_testkit::nets::{max_abs_diff, read_params};
use bonfire_testkit::run_ranks;

const CHECK: &str = env!("CARGO_BIN_EXE_bonfire-train-check");

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("bonfire-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn panic_on_failure() -> DataParallelConfig {
    DataParallelConfig {
        failure: FailurePolicy::Panic,
        ..DataParallelConfig::default()
    }
}

/// One rank with batches of `ranks * run.batch`, on the samples in the order `ranks` shards see them.
fn single(run: &Run, ranks: usize, dir: &Path) -> Vec<f32> {
    let _one = bind_thread(
        Communicator::in_process(1, CommConfig::default()).remove(0),
        panic_on_failure(),
    );
    let mut whole = run.clone();
    whole.train = interleave(&run.train, ranks, run.batch);
    whole.batch = ranks * run.batch;
    fit(&whole, How::Bonfire, dir).concat()
}

fn close(name: &str, reference: &[f32], got: &[f32]) {
    assert_eq!(
        reference.len(),
        got.len(),
        "{name}: parameter counts differ"
    );
    let d = max_abs_diff(&[reference.to_vec()], &[got.to_vec()]);
    assert!(d <= 1e-5, "{name}: differs from one rank by {d:e}");
}

#[test]
fn strategy_with_ranks_as_threads_matches_one_rank() {
    for accumulation in [None, Some(2)] {
        let run = check_run(2, accumulation, None);
        let base = dir(&format!("threads-{accumulation:?}"));
        let reference = single(&run, 2, &base.join("single"));
        let comms = Communicator::in_process(2, CommConfig::default());
        let (r, b) = (run.clone(), base.clone());
        let results = run_ranks(comms, Duration::from_secs(120), move |comm| {
            let rank = comm.rank();
            let _bind = bind_thread(comm, panic_on_failure());
            let mut mine = r.clone();
            mine.seed += 1000 * rank as u64; // rank 0's parameters must win
            fit(&mine, How::Bonfire, &b.join(format!("rank{rank}"))).concat()
        });
        assert_eq!(results[0], results[1], "the replicas differ");
        close(
            &format!("threads, accumulation {accumulation:?}"),
            &reference,
            &results[0],
        );
        // Only rank 0 writes checkpoints and metrics.
        assert!(base.join("rank0/checkpoint").read_dir().unwrap().count() > 0);
        assert!(base.join("rank0/train").exists() && base.join("rank0/valid").exists());
        assert!(!base.join("rank1/train").exists() && !base.join("rank1/valid").exists());
        let rank1_checkpoints = base
            .join("rank1/checkpoint")
            .read_dir()
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(rank1_checkpoints, 0, "rank 1 wrote checkpoints");
        let _ = std::fs::remove_dir_all(&base);
    }
}

#[test]
fn burn_train_ddp_over_one_cpu_device_twice_matches_one_rank() {
    let run = check_run(2, None, None);
    let base = dir("burn-ddp");
    let reference = single(&run, 2, &base.join("single"));
    let got = fit(&run, How::BurnDdp(2), &base.join("ddp")).concat();
    close("burn-train DDP", &reference, &got);
    let _ = std::fs::remove_dir_all(&base);
}

fn two_processes(dir: &Path, args: &[&str]) -> Result<(Vec<f32>, Vec<f32>), String> {
    let mut c = LaunchConfig::local(2, CHECK);
    c.args = std::iter::once(dir.as_os_str().to_owned())
        .chain(args.iter().map(|a| a.into()))
        .collect();
    c.timeout = Some(Duration::from_secs(60));
    launch(&c).map_err(|e| e.to_string())?;
    Ok((
        read_params(&dir.join("rank0.bin")),
        read_params(&dir.join("rank1.bin")),
    ))
}

#[test]
fn strategy_across_processes_matches_one_rank_and_resumes() {
    let base = dir("processes");
    let reference = single(&check_run(2, None, None), 2, &base.join("single"));

    // Two epochs straight through.
    let straight = base.join("straight");
    std::fs::create_dir_all(&straight).unwrap();
    let (r0, r1) = two_processes(&straight, &["2"]).unwrap();
    assert_eq!(r0, r1, "the two processes' replicas differ");
    close("2 processes", &reference, &r0);

    // One epoch, then a new job that resumes from its checkpoint (Adam's state included).
    let resumed = base.join("resumed");
    std::fs::create_dir_all(&resumed).unwrap();
    two_processes(&resumed, &["1"]).unwrap();
    let (q0, q1) = two_processes(&resumed, &["2", "-", "1"]).unwrap();
    assert_eq!(q0, q1, "the resumed replicas differ");
    close("resumed after epoch 1", &reference, &q0);

    // A checkpoint that does not exist: the job fails, it does not hang.
    let err = two_processes(&resumed, &["3", "-", "7"]).unwrap_err();
    assert!(err.contains("rank"), "{err}");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_missing_checkpoint_is_a_clean_error() {
    let base = dir("missing");
    let out = std::process::Command::new(CHECK)
        .args([base.as_os_str(), "2".as_ref(), "-".as_ref(), "5".as_ref()])
        .env_remove("BONFIRE_RANK")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot resume from checkpoint 5"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let _ = std::fs::remove_dir_all(&base);
}
