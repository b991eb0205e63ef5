//! The guide program under bonfire's launcher: two processes on one node (shared memory), and
//! two launchers acting as two nodes (QUIC). Every rank ends with bitwise the same parameters,
//! and the same as the other layout's: the collectives are deterministic whatever the lane.

use std::path::{Path, PathBuf};
use std::time::Duration;

use std::sync::Arc;

use bonfire_datasets::{ImageSet, Shard, Split};
use bonfire_launch::{LaunchConfig, free_local_port, launch};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;

#[path = "../src/bin/guide/model.rs"]
#[allow(dead_code)]
mod model;

use model::{MnistBatcher, Model, ModelConfig};

const GUIDE: &str = env!("CARGO_BIN_EXE_guide");

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bonfire-burn022-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The guide on `device` (`BURN_DEVICE`: `flex`, `wgpu`), a short run.
fn guide_on(device: &str, nproc: usize, dir: &Path) -> LaunchConfig {
    let mut c = LaunchConfig::local(nproc, GUIDE);
    c.extra_env.push(("BURN_DEVICE".into(), device.into()));
    c.args = [
        "--epochs",
        "1",
        "--train-limit",
        "256",
        "--test-limit",
        "100",
        "--batch",
        "32",
        "--artifacts",
    ]
    .iter()
    .map(Into::into)
    .chain([dir.as_os_str().to_owned()])
    .collect();
    c.timeout = Some(Duration::from_secs(60));
    c
}

fn guide(nproc: usize, dir: &Path) -> LaunchConfig {
    guide_on("flex", nproc, dir)
}

/// Each rank's summary line, and the parameter digest at its end, after `steps` steps.
fn summaries(dir: &Path, ranks: usize, steps: usize) -> Vec<(String, String)> {
    (0..ranks)
        .map(|r| {
            let line = std::fs::read_to_string(dir.join(format!("summary-rank-{r}.txt")))
                .unwrap_or_else(|_| panic!("rank {r} wrote no summary in {}", dir.display()));
            let digest = line.rsplit(' ').next().unwrap().to_string();
            assert!(
                line.starts_with(&format!("guide: rank {r} of {ranks}: {steps} steps")),
                "{line}"
            );
            (line, digest)
        })
        .collect()
}

#[test]
fn the_guide_trains_as_two_processes_and_as_two_nodes_to_the_same_parameters() {
    let one_node = out_dir("one-node");
    launch(&guide(2, &one_node)).unwrap();
    let a = summaries(&one_node, 2, 4);
    assert_eq!(a[0].1, a[1].1, "the replicas differ: {a:?}");

    let two_nodes = out_dir("two-nodes");
    let secret = two_nodes.join("secret");
    std::fs::write(&secret, "guide-two-nodes-secret-0123456789abcdef").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let port = free_local_port().unwrap();
    let launchers: Vec<_> = (0..2)
        .map(|node| {
            let mut c = guide(1, &two_nodes);
            c.nnodes = 2;
            c.node_rank = node;
            c.master = Some(format!("127.0.0.1:{port}"));
            c.secret_file = Some(secret.clone());
            c.extra_env
                .push(("BONFIRE_BIND_ADDR".into(), "127.0.0.1:0".into()));
            std::thread::spawn(move || launch(&c))
        })
        .collect();
    for l in launchers {
        l.join().unwrap().unwrap();
    }
    let b = summaries(&two_nodes, 2, 4);
    assert_eq!(b[0].1, b[1].1, "the replicas differ: {b:?}");
    assert_eq!(a[0].1, b[0].1, "shared memory and QUIC trained differently");
}

/// Every float parameter's values, in the model's order.
#[derive(Default)]
struct Values(Vec<Vec<f32>>);

impl ModuleVisitor for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let data = param.val().into_data().convert::<f32>();
        self.0.push(data.as_slice::<f32>().unwrap().to_vec());
    }
}

fn values(model: &Model) -> Vec<Vec<f32>> {
    let mut v = Values::default();
    model.visit(&mut v);
    v.0
}

/// The guide as two processes (no shuffle, no dropout, 4 steps of 16 images per rank) ends with
/// the parameters of one device trained on the union of the two ranks' batches, from the same
/// starting point (`--init-from`), within 1e-5.
#[test]
fn two_processes_equal_one_device_on_the_union_of_their_batches() {
    let dir = out_dir("union");
    let device = Device::flex().autodiff();
    let start = ModelConfig::new(10, 512).with_dropout(0.0).init(&device);
    let init = dir.join("init.bpk");
    start.clone().save_file(&init).unwrap();
    let started_at = values(&start);

    let mut c = guide(2, &dir);
    c.args = [
        "--epochs",
        "1",
        "--train-limit",
        "128",
        "--test-limit",
        "16",
        "--batch",
        "16",
        "--dropout",
        "0",
        "--no-shuffle",
        "--init-from",
    ]
    .iter()
    .map(Into::into)
    .chain([
        init.as_os_str().to_owned(),
        "--artifacts".into(),
        dir.as_os_str().to_owned(),
    ])
    .collect();
    launch(&c).unwrap();
    summaries(&dir, 2, 4);
    let trained = start
        .clone()
        .try_load_file(dir.join("model.bpk"))
        .expect("rank 0 saves the trained model");

    // Rank r trains on images 64r..64r+64, 16 at a time; one device on both ranks' batches.
    let images = ImageSet::embedded(Split::Train, Shard::whole().limit(128)).unwrap();
    let batcher = MnistBatcher(Arc::new(images));
    let mut single = start;
    let mut optim = AdamConfig::new().init();
    for step in 0..4 {
        let union: Vec<usize> = (16 * step..16 * step + 16)
            .chain(64 + 16 * step..64 + 16 * step + 16)
            .collect();
        let batch = batcher.batch_of(&union, &device);
        let loss = single
            .forward_classification(batch.images, batch.targets)
            .loss;
        let grads = GradientsParams::from_grads(loss.backward(), &single);
        single = optim.step(1e-3, single, grads);
    }
    let (a, b) = (values(&trained), values(&single));
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(&b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-5,
        "two processes differ from one device by {worst}"
    );
    assert_ne!(a, started_at, "the guide did not train");
}

/// A short deterministic run (no shuffle, no dropout) of `epochs` with `--resume`, 2 steps per
/// epoch and rank; its rank-0 summary.
fn resumable(dir: &Path, epochs: &str) -> (String, String) {
    let mut c = guide(2, dir);
    c.args = [
        "--epochs",
        epochs,
        "--train-limit",
        "128",
        "--test-limit",
        "16",
        "--batch",
        "32",
        "--dropout",
        "0",
        "--no-shuffle",
        "--resume",
        "--artifacts",
    ]
    .iter()
    .map(Into::into)
    .chain([dir.as_os_str().to_owned()])
    .collect();
    launch(&c).unwrap();
    let line = std::fs::read_to_string(dir.join("summary-rank-0.txt")).unwrap();
    let digest = line.rsplit(' ').next().unwrap().to_string();
    (line, digest)
}

/// Stopped after its first epoch and started again with `--resume`, a run continues from its
/// checkpoint and ends with bitwise the parameters of the run that was never stopped.
#[test]
fn a_run_resumed_after_its_first_epoch_ends_as_one_never_stopped() {
    let whole = out_dir("resume-whole");
    let (line, uninterrupted) = resumable(&whole, "2");
    assert!(line.contains(": 4 steps"), "{line}");

    let parts = out_dir("resume-parts");
    let (line, _) = resumable(&parts, "1");
    assert!(line.contains(": 2 steps"), "{line}");
    let (line, resumed) = resumable(&parts, "2");
    assert!(
        line.contains(": 2 steps"),
        "the second part trains epoch 2 alone: {line}"
    );
    assert_eq!(resumed, uninterrupted, "the resumed run ended elsewhere");
}

/// On wgpu (Mesa's software Vulkan in CI): two processes, one step each, equal replicas.
#[cfg(feature = "wgpu")]
#[test]
fn the_guide_trains_on_wgpu_as_two_processes() {
    let dir = out_dir("wgpu");
    let mut c = guide_on("wgpu", 2, &dir);
    // One step of 32 images per rank, and a small test set: lavapipe compiles every kernel.
    for (flag, value) in [("--train-limit", "64"), ("--test-limit", "16")] {
        let at = c.args.iter().position(|a| a == flag).unwrap();
        c.args[at + 1] = value.into();
    }
    c.timeout = Some(Duration::from_secs(300));
    launch(&c).unwrap();
    let s = summaries(&dir, 2, 1);
    assert_eq!(s[0].1, s[1].1, "the replicas differ: {s:?}");
}

#[test]
fn a_bad_flag_is_a_clear_message_and_exit_code_2() {
    let out = std::process::Command::new(GUIDE)
        .args(["--epochs", "zero"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--epochs \"zero\": expected a positive number"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_job_without_a_secret_is_refused_with_a_message_naming_the_fix() {
    let out = std::process::Command::new(GUIDE)
        .env_remove("BONFIRE_SECRET")
        .env_remove("BONFIRE_SECRET_FILE")
        .envs([
            ("WORLD_SIZE", "2"),
            ("RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29999"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bonfire_burn022::init: this job of 2 ranks has no secret"),
        "{stderr}"
    );
    assert!(stderr.contains("bonfire launch"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
