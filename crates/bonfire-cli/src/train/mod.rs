//! `bonfire train`: the bundled training jobs.
//!
//! `bonfire train vision` run by hand is the parent: it settles the run (data set fetched, or the
//! embedded slice when MNIST cannot be had; checkpoint directory; on `--resume`, the settings the
//! checkpoint was made with) and starts the ranks under the launcher, each running this same
//! command with the settled flags and `--resolved`. Started by `bonfire launch` instead, rank 0
//! settles the run and the others take its decision.

mod checkpoint;
mod plot;
mod progress;
mod vision;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bonfire::launch::{LaunchConfig, launch};
use bonfire_datasets::{Vision, cache_root};
use serde::{Deserialize, Serialize};

use checkpoint::RunConfig;

/// The bundled training jobs.
#[derive(clap::Subcommand)]
pub(crate) enum Train {
    /// Train the bundled ResNet on MNIST (or Fashion-MNIST), data-parallel over local ranks.
    Vision(VisionArgs),
}

impl Train {
    pub(crate) fn run(self) -> Result<(), String> {
        match self {
            Train::Vision(args) => vision_main(args),
        }
    }
}

const DEFAULT_EPOCHS: usize = 3;

/// `bonfire train vision`: every flag has a default; on `--resume`, flags left out take the
/// checkpoint's values, and flags that would change the result must match them.
#[derive(clap::Args, Clone, Debug)]
#[command(
    after_help = "Examples:\n  bonfire train vision\n  bonfire train vision --dataset fashion-mnist --epochs 5 --bf16\n  bonfire train vision --resume            (continues the newest run in ./runs)"
)]
pub(crate) struct VisionArgs {
    /// mnist, fashion-mnist, or embedded (the 2,000-image MNIST slice compiled into bonfire)
    /// [default: mnist, or embedded when MNIST cannot be fetched]
    #[arg(long)]
    dataset: Option<String>,
    /// Ranks (processes) to start on this machine [default: 2]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    ranks: Option<u32>,
    /// Epochs in all; a resumed run counts the ones already done [default: 3]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100000))]
    epochs: Option<u32>,
    /// Images per rank per step [default: 64]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    batch: Option<u32>,
    /// Adam's learning rate in the first epoch [default: 0.003]
    #[arg(long, value_parser = positive)]
    lr: Option<f64>,
    /// Factor applied to the learning rate after each epoch [default: 0.4]
    #[arg(long, value_parser = positive)]
    lr_decay: Option<f64>,
    /// Send gradients as bf16, with error feedback
    #[arg(long)]
    bf16: bool,
    /// Channels of the ResNet's first stage [default: 8]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    width: Option<u32>,
    /// Seed of the initial weights and of the shuffles [default: 42]
    #[arg(long)]
    seed: Option<u64>,
    /// Where checkpoints, plots and the report go [default: a new ./runs/vision-N]
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Continue from the latest checkpoint of --checkpoint-dir (default: the newest ./runs/vision-N)
    #[arg(long)]
    resume: bool,
    /// flex, ndarray, wgpu or cuda [default: flex]
    #[arg(long)]
    backend: Option<String>,
    /// The data set cache [default: $BONFIRE_DATA_DIR, else $XDG_CACHE_HOME/bonfire/datasets,
    /// else ~/.cache/bonfire/datasets]
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Train on the first N training images only (a quick run)
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    train_limit: Option<u64>,
    /// Evaluate on the first N test images only
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    test_limit: Option<u64>,
    /// Set by the parent command on the ranks it starts: the flags are settled.
    #[arg(long, hide = true)]
    resolved: bool,
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

/// A settled run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Settings {
    pub(crate) config: RunConfig,
    pub(crate) epochs: usize,
    pub(crate) checkpoint_dir: PathBuf,
    pub(crate) resume: bool,
    pub(crate) backend: String,
    pub(crate) data_dir: PathBuf,
}

const BACKENDS: [&str; 4] = ["flex", "ndarray", "wgpu", "cuda"];

/// The newest `runs/vision-N` (highest N), and the next free N.
fn runs(base: &Path) -> (Option<PathBuf>, u64) {
    let mut best: Option<u64> = None;
    if let Ok(entries) = std::fs::read_dir(base) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(n) = name
                .strip_prefix("vision-")
                .and_then(|n| n.parse::<u64>().ok())
            {
                best = Some(best.map_or(n, |b| b.max(n)));
            }
        }
    }
    (
        best.map(|n| base.join(format!("vision-{n}"))),
        best.map_or(1, |n| n + 1),
    )
}

/// Settles the run from the flags (and, on `--resume`, the checkpoint); fetches the data set.
fn settle(a: &VisionArgs, world_size: Option<usize>) -> Result<Settings, String> {
    let backend = a
        .backend
        .clone()
        .unwrap_or_else(|| "flex".into())
        .to_ascii_lowercase();
    if !BACKENDS.contains(&backend.as_str()) {
        return Err(format!(
            "--backend {backend:?}: expected one of {}",
            BACKENDS.join(", ")
        ));
    }
    if let Some(d) = &a.dataset
        && d != "embedded"
        && Vision::from_key(d).is_none()
    {
        return Err(format!(
            "--dataset {d:?}: expected mnist, fashion-mnist or embedded"
        ));
    }
    let data_dir = a.data_dir.clone().unwrap_or_else(cache_root);
    let runs_base = PathBuf::from("runs");
    let mut explicit = RunConfig {
        dataset: a.dataset.clone().unwrap_or_default().to_ascii_lowercase(),
        ranks: a.ranks.map_or(0, |r| r as usize),
        batch: a.batch.map_or(0, |b| b as usize),
        lr: a.lr.unwrap_or(0.0),
        lr_decay: a.lr_decay.unwrap_or(0.0),
        width: a.width.map_or(0, |w| w as usize),
        seed: a.seed.unwrap_or(0),
        bf16: a.bf16,
        train_limit: a.train_limit.map(|n| n as usize),
        test_limit: a.test_limit.map(|n| n as usize),
    };
    if let Some(f) = Vision::from_key(&explicit.dataset) {
        explicit.dataset = f.key().into();
    }
    if let (Some(w), Some(r)) = (world_size, a.ranks)
        && w != r as usize
    {
        return Err(format!("--ranks {r}, but this job has {w} ranks"));
    }
    if a.resume {
        let dir = match &a.checkpoint_dir {
            Some(d) => d.clone(),
            None => runs(&runs_base).0.ok_or(
                "--resume: no run in ./runs to continue (pass --checkpoint-dir to name one)",
            )?,
        };
        let loaded = checkpoint::load(&dir)?;
        let saved = loaded.state.config;
        let mut c = saved.clone();
        let mut clash = Vec::new();
        let mut check = |name: &str, given: bool, same: bool, was: String, now: String| {
            if given && !same {
                clash.push(format!("{name} {now} (the checkpoint has {was})"));
            }
        };
        check(
            "--dataset",
            !explicit.dataset.is_empty(),
            explicit.dataset == saved.dataset,
            saved.dataset.clone(),
            explicit.dataset.clone(),
        );
        check(
            "--ranks",
            a.ranks.is_some(),
            explicit.ranks == saved.ranks,
            saved.ranks.to_string(),
            explicit.ranks.to_string(),
        );
        check(
            "--batch",
            a.batch.is_some(),
            explicit.batch == saved.batch,
            saved.batch.to_string(),
            explicit.batch.to_string(),
        );
        check(
            "--lr",
            a.lr.is_some(),
            explicit.lr == saved.lr,
            saved.lr.to_string(),
            explicit.lr.to_string(),
        );
        check(
            "--lr-decay",
            a.lr_decay.is_some(),
            explicit.lr_decay == saved.lr_decay,
            saved.lr_decay.to_string(),
            explicit.lr_decay.to_string(),
        );
        check(
            "--width",
            a.width.is_some(),
            explicit.width == saved.width,
            saved.width.to_string(),
            explicit.width.to_string(),
        );
        check(
            "--seed",
            a.seed.is_some(),
            explicit.seed == saved.seed,
            saved.seed.to_string(),
            explicit.seed.to_string(),
        );
        check(
            "--bf16",
            a.bf16,
            saved.bf16,
            "f32 gradients".into(),
            "on".into(),
        );
        check(
            "--train-limit",
            a.train_limit.is_some(),
            explicit.train_limit == saved.train_limit,
            format!("{:?}", saved.train_limit),
            format!("{:?}", explicit.train_limit),
        );
        check(
            "--test-limit",
            a.test_limit.is_some(),
            explicit.test_limit == saved.test_limit,
            format!("{:?}", saved.test_limit),
            format!("{:?}", explicit.test_limit),
        );
        if !clash.is_empty() {
            return Err(format!(
                "cannot resume {} with {}: a resumed run must keep the settings that decide its \
                 result (leave these flags out to take the checkpoint's)",
                dir.display(),
                clash.join(", ")
            ));
        }
        c.bf16 = saved.bf16;
        let epochs = a.epochs.map_or(loaded.state.epochs, |e| e as usize);
        if epochs < loaded.state.epochs_done {
            return Err(format!(
                "--epochs {epochs}: {} already holds {} epochs",
                dir.display(),
                loaded.state.epochs_done
            ));
        }
        if c.dataset != "embedded" {
            let set = Vision::from_key(&c.dataset).ok_or("checkpoint names an unknown data set")?;
            set.fetch(&data_dir).map_err(|e| e.to_string())?;
        }
        return Ok(Settings {
            config: c,
            epochs,
            checkpoint_dir: dir,
            resume: true,
            backend,
            data_dir,
        });
    }
    let checkpoint_dir = match &a.checkpoint_dir {
        Some(d) => {
            if let Some(latest) = checkpoint::latest(d)? {
                return Err(format!(
                    "{} already holds checkpoints (latest {}): pass --resume to continue that \
                     run, or choose another --checkpoint-dir",
                    d.display(),
                    latest.display()
                ));
            }
            d.clone()
        }
        None => runs_base.join(format!("vision-{}", runs(&runs_base).1)),
    };
    std::fs::create_dir_all(&checkpoint_dir)
        .map_err(|e| format!("{}: {e}", checkpoint_dir.display()))?;
    let dataset = match explicit.dataset.as_str() {
        "" | "mnist" => match Vision::Mnist.fetch(&data_dir) {
            Ok(_) => "mnist".to_string(),
            Err(e) if explicit.dataset.is_empty() => {
                println!(
                    "MNIST could not be fetched: {e}\n=> training on the EMBEDDED MNIST SLICE \
                     instead (2,000 training and 500 test images compiled into bonfire; expect \
                     lower accuracy than on the full set)"
                );
                "embedded".to_string()
            }
            Err(e) => return Err(e.to_string()),
        },
        "embedded" => "embedded".to_string(),
        other => {
            let set = Vision::from_key(other).expect("checked above");
            set.fetch(&data_dir).map_err(|e| e.to_string())?;
            set.key().to_string()
        }
    };
    Ok(Settings {
        config: RunConfig {
            dataset,
            ranks: world_size.unwrap_or(a.ranks.map_or(2, |r| r as usize)),
            batch: a.batch.map_or(64, |b| b as usize),
            lr: a.lr.unwrap_or(0.003),
            lr_decay: a.lr_decay.unwrap_or(0.4),
            width: a.width.map_or(8, |w| w as usize),
            seed: a.seed.unwrap_or(42),
            bf16: a.bf16,
            train_limit: explicit.train_limit,
            test_limit: explicit.test_limit,
        },
        epochs: a.epochs.map_or(DEFAULT_EPOCHS, |e| e as usize),
        checkpoint_dir,
        resume: false,
        backend,
        data_dir,
    })
}

/// The flags that make a rank run exactly `s`.
fn rank_args(s: &Settings) -> Vec<OsString> {
    let c = &s.config;
    let mut v: Vec<OsString> = vec!["train".into(), "vision".into(), "--resolved".into()];
    let mut flag = |k: &str, val: String| {
        v.push(k.into());
        v.push(val.into());
    };
    flag("--dataset", c.dataset.clone());
    flag("--ranks", c.ranks.to_string());
    flag("--epochs", s.epochs.to_string());
    flag("--batch", c.batch.to_string());
    flag("--lr", c.lr.to_string());
    flag("--lr-decay", c.lr_decay.to_string());
    flag("--width", c.width.to_string());
    flag("--seed", c.seed.to_string());
    flag("--backend", s.backend.clone());
    if let Some(n) = c.train_limit {
        flag("--train-limit", n.to_string());
    }
    if let Some(n) = c.test_limit {
        flag("--test-limit", n.to_string());
    }
    v.push("--checkpoint-dir".into());
    v.push(s.checkpoint_dir.clone().into_os_string());
    v.push("--data-dir".into());
    v.push(s.data_dir.clone().into_os_string());
    if c.bf16 {
        v.push("--bf16".into());
    }
    if s.resume {
        v.push("--resume".into());
    }
    v
}

fn vision_main(a: VisionArgs) -> Result<(), String> {
    let under_launcher =
        std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some();
    if under_launcher {
        return rank_main(a);
    }
    if a.resolved {
        return Err("--resolved is set by `bonfire train` on the ranks it starts".into());
    }
    let s = settle(&a, None)?;
    if s.resume && s.epochs <= checkpoint::load(&s.checkpoint_dir)?.state.epochs_done {
        println!(
            "{} already holds all {} epochs; pass a larger --epochs to train on",
            s.checkpoint_dir.display(),
            s.epochs
        );
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let mut config = LaunchConfig::local(s.config.ranks, exe);
    config.args = rank_args(&s);
    config.prefix_output = false;
    config.timeout = None;
    config.peer_timeout = Some(Duration::from_secs(60));
    if s.config.bf16 {
        config
            .extra_env
            .push(("BONFIRE_GRAD_DTYPE".into(), "bf16".into()));
    }
    // Like torchrun's OMP_NUM_THREADS: the ranks share this machine's cores instead of each
    // starting a compute thread per core (with 2 ranks on 2 cores, 2 threads each cost 10-20% of
    // the throughput; see BENCHMARKS.md). An explicit RAYON_NUM_THREADS is kept.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = (cores / s.config.ranks).max(1);
        config
            .extra_env
            .push(("RAYON_NUM_THREADS".into(), threads.to_string().into()));
    }
    launch(&config).map_err(|e| e.to_string())
}

/// One rank: settle (rank 0 decides when the parent did not), then train.
fn rank_main(a: VisionArgs) -> Result<(), String> {
    let world = bonfire::init().map_err(|e| e.to_string())?;
    let size = world.world_size();
    let s = if a.resolved {
        settle(&a, Some(size))?
    } else {
        // Started by `bonfire launch` directly: rank 0 settles (it may fetch the data set, so
        // the others wait longer than a collective's usual timeout).
        let comm = world.comm().with_timeout(Duration::from_secs(1800));
        let mine = if world.is_main() {
            let s = settle(&a, Some(size));
            serde_json::to_vec(&s.map_err(|e| e.to_string())).map_err(|e| e.to_string())?
        } else {
            Vec::new()
        };
        let len = comm
            .broadcast(vec![mine.len() as i64], 0)
            .wait()
            .map_err(|e| format!("waiting for rank 0 to settle the run: {e}"))?[0];
        let mut buf = mine;
        buf.resize(len as usize, 0);
        let bytes = comm
            .broadcast(buf, 0)
            .wait()
            .map_err(|e| format!("waiting for rank 0 to settle the run: {e}"))?;
        let settled: Result<Settings, String> =
            serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
        settled.map_err(|e| {
            if world.is_main() {
                e
            } else {
                format!("rank 0: {e}")
            }
        })?
    };
    if s.config.bf16 && std::env::var("BONFIRE_GRAD_DTYPE").as_deref() != Ok("bf16") {
        return Err(
            "--bf16 under `bonfire launch`: set BONFIRE_GRAD_DTYPE=bf16 for every rank \
                    (`bonfire train vision --bf16` does it for you)"
                .into(),
        );
    }
    match s.backend.as_str() {
        "flex" => vision::run::<burn::backend::Flex>(&world, &s, burn::backend::flex::FlexDevice),
        "ndarray" => vision::run::<burn::backend::NdArray>(&world, &s, Default::default()),
        "wgpu" => {
            use bonfire_kernels::cubecl::wgpu::{WgpuDevice, WgpuRuntime};
            let device = WgpuDevice::default();
            crate::gpu::open::<WgpuRuntime>(&device, "wgpu", crate::gpu::WGPU_HINT)?;
            vision::run::<burn::backend::Wgpu>(&world, &s, device)
        }
        "cuda" => cuda(&world, &s),
        other => Err(format!("unknown backend {other:?}")),
    }
}

/// Local rank `i` trains on CUDA device `i` of its node; with fewer devices than ranks, ranks
/// share them round-robin (`i % devices`), as several ranks on one GPU do for testing.
#[cfg(feature = "cuda")]
fn cuda(world: &bonfire::World, s: &Settings) -> Result<(), String> {
    use bonfire_kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
    let devices =
        crate::gpu::open::<CudaRuntime>(&CudaDevice::new(0), "CUDA", crate::gpu::CUDA_HINT)?
            .device_count_total()
            .max(1);
    let device = CudaDevice::new(world.local_rank() % devices);
    vision::run::<burn::backend::Cuda>(world, s, device)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &bonfire::World, _: &Settings) -> Result<(), String> {
    Err("this bonfire was built without CUDA: rebuild it with \
         `cargo build --release -p bonfire-cli --features cuda` (needs the CUDA toolkit)"
        .into())
}
