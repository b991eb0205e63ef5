//! `bonfire train`: the bundled training jobs, run by the job library (`bonfire-jobs`).
//!
//! This module only declares the flags and turns them into the library's request and options.
//! `bonfire train vision` run by hand is the parent: the library settles the run (data set
//! fetched, or the embedded slice when MNIST cannot be had; checkpoint directory; on `--resume`,
//! the settings the checkpoint was made with) and starts the ranks under the launcher, each
//! running this same command with the settled flags and `--resolved`. Started by
//! `bonfire launch` instead, rank 0 settles the run and the others take its decision.

use std::ffi::OsString;
use std::path::PathBuf;

use bonfire_jobs::strategy::{Strategy, StrategyRequest};
use bonfire_jobs::vision::{Vision, VisionConfig, VisionRequest};
use bonfire_jobs::{RunOptions, Runner, Settings, under_launcher};

use crate::error::{ArgError, CliError};

mod gpt;

/// The bundled training jobs.
#[derive(clap::Subcommand)]
pub(crate) enum Train {
    /// Train the bundled ResNet on MNIST (or Fashion-MNIST), data-parallel over local ranks.
    Vision(VisionArgs),
    /// Train the bundled GPT-style model on Shakespeare, character by character, data-parallel
    /// (and optionally tensor-parallel) over local ranks; or generate text with a trained one
    /// (--sample).
    Gpt(gpt::GptArgs),
}

impl Train {
    pub(crate) fn run(self) -> Result<(), CliError> {
        match self {
            Train::Vision(args) => vision(args),
            Train::Gpt(args) => gpt::gpt(args),
        }
    }
}

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
    /// Send gradients as bf16, with error feedback (under --strategy local-sgd or diloco, the
    /// replicas' deltas)
    #[arg(long)]
    bf16: bool,
    #[command(flatten)]
    strategy: StrategyArgs,
    /// Channels of the ResNet's first stage [default: 8]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    width: Option<u32>,
    /// Seed of the initial weights and of the shuffles [default: 42]
    #[arg(long)]
    seed: Option<u64>,
    /// Where checkpoints, plots and the report go [default: a new ./runs/vision-N]
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest N checkpoints, deleting older ones as new ones are written
    /// [default: keep all]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    keep_checkpoints: Option<u64>,
    /// Continue from the latest checkpoint of --checkpoint-dir (default: the newest ./runs/vision-N)
    #[arg(long)]
    resume: bool,
    /// Draw loss.png with a logarithmic loss axis
    #[arg(long)]
    log_loss: bool,
    /// Load checkpoints that have no SHA256SUMS (written before bonfire checksummed them)
    /// without checking their files; otherwise they are passed over, as damaged ones are
    #[arg(long)]
    allow_unchecked: bool,
    /// Shard over the data-parallel ranks: 1, Adam's state (each rank keeps and updates its
    /// share of the parameters, then they all-gather the updated ones; the same weights, bit for
    /// bit); 2, the gradients too (reduce-scattered to their owners; the same weights at 2
    /// ranks, within rounding above); 3, the parameters too (each rank holds a slice of every
    /// parameter, of its gradient and of Adam's state, and gathers a parameter where a layer
    /// reads it)
    #[arg(long, value_name = "STAGE", value_parser = clap::value_parser!(u8).range(1..=3))]
    zero: Option<u8>,
    /// With --zero 3: how many parameters each rank gathers ahead of need at a time, in one
    /// all-gather, behind the compute of the layers before (in the order the last step read
    /// them; at most twice as many held whole ahead; 0 for none; the same weights at any)
    /// [default: 8]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=64))]
    prefetch: Option<u8>,
    /// Times to restart the run after a rank fails: every rank is started again and resumes
    /// from the newest checkpoint any rank can read (sent to ranks that lack it) [default: 0]
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1000))]
    max_restarts: Option<u32>,
    /// auto, flex, ndarray, libtorch, wgpu or cuda; auto takes CUDA (in a build with it) or wgpu when
    /// the machine has a GPU, else the fastest CPU backend measured [default: auto]
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
    /// Give each rank a share of the training images sorted by label, so that it sees only a
    /// few classes (a non-IID split, as in federated training; with 2 ranks about digits 0-4
    /// and 5-9)
    #[arg(long)]
    non_iid: bool,
    /// At each epoch's end, replace every rank's batch-norm running statistics by those pooled
    /// over the ranks (the mean of their means; the variance of all their batches together), so
    /// that the model evaluated and saved has statistics of every rank's images (not with
    /// parameter servers)
    #[arg(long)]
    pool_bn_stats: bool,
    /// Set by the parent command on the ranks it starts: the flags are settled.
    #[arg(long, hide = true)]
    resolved: bool,
}

/// How a job's data-parallel replicas stay together (`--strategy` and its settings).
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct StrategyArgs {
    /// How the data-parallel replicas stay together: allreduce (every step's gradients
    /// averaged in backward), local-sgd (each replica steps on its own gradients and the
    /// replicas average their parameters every --sync-every steps), diloco (the same, the
    /// mean change applied by an outer Nesterov SGD), ps-sync or ps-async (the last --servers
    /// ranks hold the parameters and Adam's state; the others push gradients and pull
    /// parameters every step, all together or each as it comes); only allreduce with --tp or
    /// --pp [default: allreduce]
    #[arg(long, value_name = "NAME")]
    strategy: Option<String>,
    /// Steps between the replicas' meetings under local-sgd or diloco; they also meet at each
    /// evaluation (epoch end for vision) [default: 50]
    #[arg(long, value_name = "H", value_parser = clap::value_parser!(u32).range(1..))]
    sync_every: Option<u32>,
    /// diloco's outer learning rate [default: 0.7]
    #[arg(long, value_parser = positive)]
    outer_lr: Option<f64>,
    /// diloco's outer Nesterov momentum, at least 0 and below 1 [default: 0.9]
    #[arg(long)]
    outer_momentum: Option<f64>,
    /// Ranks that serve under ps-sync or ps-async: the last N of the job [default: 1]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    servers: Option<u32>,
    /// ps-async's bound: pushes a worker may run ahead of the slowest worker still training
    /// [default: 2]
    #[arg(long, value_name = "S")]
    staleness: Option<u64>,
    /// Send local-sgd's or diloco's deltas in int8 (blocks of 256 with a scale each, a quarter
    /// of f32's bytes), with error feedback; not with the job's bf16 flag
    #[arg(long)]
    int8_deltas: bool,
    /// Let each local-sgd or diloco meeting's exchange run behind the next D steps (below
    /// --sync-every): the replicas train on while their deltas travel, and D steps later each
    /// applies the agreed change to the last meeting's parameters and keeps what it learnt
    /// since; meetings at an evaluation still wait [default: 0]
    #[arg(long, value_name = "D")]
    overlap_steps: Option<u32>,
}

impl StrategyArgs {
    /// The job's request of a strategy.
    pub(crate) fn request(&self) -> Result<StrategyRequest, CliError> {
        Ok(StrategyRequest {
            kind: self.strategy.as_deref().map(str::parse).transpose()?,
            every: self.sync_every.map(|n| n as usize),
            outer_lr: self.outer_lr,
            outer_momentum: self.outer_momentum,
            servers: self.servers.map(|n| n as usize),
            staleness: self.staleness,
            int8: self.int8_deltas,
            overlap: self.overlap_steps.map(|d| d as usize),
        })
    }
}

/// The flags that give a rank the settled strategy.
pub(crate) fn strategy_flags(v: &mut Vec<OsString>, strategy: &Strategy) {
    let mut flag = |k: &str, val: String| {
        v.push(k.into());
        v.push(val.into());
    };
    match *strategy {
        Strategy::AllReduce => {}
        Strategy::LocalSgd { every, .. } => {
            flag("--strategy", "local-sgd".into());
            flag("--sync-every", every.to_string());
        }
        Strategy::Diloco {
            every,
            outer_lr,
            outer_momentum,
            ..
        } => {
            flag("--strategy", "diloco".into());
            flag("--sync-every", every.to_string());
            flag("--outer-lr", outer_lr.to_string());
            flag("--outer-momentum", outer_momentum.to_string());
        }
        Strategy::PsSync { servers } => {
            flag("--strategy", "ps-sync".into());
            flag("--servers", servers.to_string());
        }
        Strategy::PsAsync { servers, staleness } => {
            flag("--strategy", "ps-async".into());
            flag("--servers", servers.to_string());
            flag("--staleness", staleness.to_string());
        }
    }
    if strategy.int8_deltas() {
        v.push("--int8-deltas".into());
    }
    if strategy.overlap_steps() > 0 {
        v.push("--overlap-steps".into());
        v.push(strategy.overlap_steps().to_string().into());
    }
}

pub(crate) fn positive(s: &str) -> Result<f64, ArgError> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(ArgError::NotPositive(s.to_string())),
    }
}

impl VisionArgs {
    /// The job's request: the flags that decide the result.
    fn request(&self) -> Result<VisionRequest, CliError> {
        Ok(VisionRequest {
            dataset: self.dataset.as_deref().map(str::parse).transpose()?,
            ranks: self.ranks.map(|r| r as usize),
            batch: self.batch.map(|b| b as usize),
            lr: self.lr,
            lr_decay: self.lr_decay,
            bf16: self.bf16,
            strategy: self.strategy.request()?,
            width: self.width.map(|w| w as usize),
            seed: self.seed,
            train_limit: self.train_limit.map(|n| n as usize),
            test_limit: self.test_limit.map(|n| n as usize),
            non_iid: self.non_iid,
            pool_bn_stats: self.pool_bn_stats,
        })
    }

    /// The run's options: the flags any job takes.
    fn options(&self) -> Result<RunOptions, CliError> {
        Ok(RunOptions {
            epochs: self.epochs.map(|e| e as usize),
            checkpoint_dir: self.checkpoint_dir.clone(),
            keep_checkpoints: self.keep_checkpoints.map(|k| k as usize),
            max_restarts: self.max_restarts.unwrap_or(0),
            log_loss: self.log_loss,
            zero: self.zero,
            model_state_limit_mib: None,
            prefetch: self.prefetch.map(usize::from),
            allow_unchecked: self.allow_unchecked,
            resume: self.resume,
            backend: self.backend.as_deref().map(str::parse).transpose()?,
            data_dir: self.data_dir.clone(),
        })
    }
}

/// The flags every job's ranks take from the settled run: the backend, where its checkpoints go
/// and how many stay, the data cache, whether it resumes, and whether the optimizer is sharded.
pub(crate) fn run_flags<C>(v: &mut Vec<OsString>, s: &Settings<C>) {
    v.push("--backend".into());
    v.push(s.backend.to_string().into());
    v.push("--checkpoint-dir".into());
    v.push(s.checkpoint_dir.clone().into_os_string());
    if let Some(k) = s.keep_checkpoints {
        v.push("--keep-checkpoints".into());
        v.push(k.to_string().into());
    }
    v.push("--data-dir".into());
    v.push(s.data_dir.clone().into_os_string());
    if s.resume {
        v.push("--resume".into());
    }
    if s.log_loss {
        v.push("--log-loss".into());
    }
    if s.allow_unchecked {
        v.push("--allow-unchecked".into());
    }
    if let Some(stage) = s.zero {
        v.push("--zero".into());
        v.push(stage.to_string().into());
    }
    if let Some(mib) = s.model_state_limit_mib {
        v.push("--model-state-limit".into());
        v.push(mib.to_string().into());
    }
    if let Some(depth) = s.prefetch {
        v.push("--prefetch".into());
        v.push(depth.to_string().into());
    }
}

/// The flags that make a rank run exactly `s`.
fn rank_args(s: &Settings<VisionConfig>) -> Vec<OsString> {
    let c = &s.config;
    let mut v: Vec<OsString> = vec!["train".into(), "vision".into(), "--resolved".into()];
    let mut flag = |k: &str, val: String| {
        v.push(k.into());
        v.push(val.into());
    };
    flag("--dataset", c.dataset.key().to_string());
    flag("--ranks", c.ranks.to_string());
    flag("--epochs", s.epochs.to_string());
    flag("--batch", c.batch.to_string());
    flag("--lr", c.lr.to_string());
    flag("--lr-decay", c.lr_decay.to_string());
    flag("--width", c.width.to_string());
    flag("--seed", c.seed.to_string());
    if let Some(n) = c.train_limit {
        flag("--train-limit", n.to_string());
    }
    if let Some(n) = c.test_limit {
        flag("--test-limit", n.to_string());
    }
    run_flags(&mut v, s);
    strategy_flags(&mut v, &c.strategy);
    if c.bf16 {
        v.push("--bf16".into());
    }
    if c.non_iid {
        v.push("--non-iid".into());
    }
    if c.pool_bn_stats {
        v.push("--pool-bn-stats".into());
    }
    v
}

fn vision(a: VisionArgs) -> Result<(), CliError> {
    if a.resolved && !under_launcher() {
        return Err(CliError::ResolvedByHand);
    }
    let options = a.options()?;
    let request = a.request()?;
    Runner::new(&Vision, &request, &options)
        .rank_args(rank_args)
        .each_rank_settles(a.resolved)
        .run()?;
    Ok(())
}

/// A fresh run of `config` on Flex, 2 rounds, its data in `data_dir`: what the tests of the
/// flags a parent gives its ranks settle.
#[cfg(test)]
pub(crate) fn fresh_run<C>(config: C, data_dir: PathBuf) -> Settings<C> {
    Settings {
        config,
        epochs: 2,
        checkpoint_dir: PathBuf::from("/tmp/run"),
        resume: false,
        backend: bonfire_jobs::BackendKind::Flex,
        data_dir,
        keep_checkpoints: None,
        log_loss: false,
        zero: None,
        model_state_limit_mib: None,
        prefetch: None,
        allow_unchecked: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bonfire_jobs::vision::VisionData;
    use clap::Parser;

    #[derive(Parser)]
    struct Ranked {
        #[command(flatten)]
        args: VisionArgs,
    }

    /// The flags a launcher hands a vision rank ask for exactly the settled run: int8 deltas and
    /// the non-IID split included.
    #[test]
    fn a_vision_rank_is_handed_every_setting() {
        let config = VisionConfig {
            dataset: VisionData::Mnist,
            ranks: 4,
            batch: 32,
            lr: 0.002,
            lr_decay: 0.5,
            width: 8,
            seed: 7,
            bf16: false,
            strategy: Strategy::LocalSgd {
                every: 5,
                int8: true,
                overlap: 3,
            },
            train_limit: Some(512),
            test_limit: None,
            non_iid: true,
            pool_bn_stats: true,
        };
        let s = fresh_run(config.clone(), PathBuf::from("/tmp/data"));
        let args = rank_args(&s);
        assert_eq!(args[..2], ["train", "vision"]);
        let parsed = Ranked::try_parse_from(
            std::iter::once(OsString::from("vision")).chain(args[2..].iter().cloned()),
        )
        .unwrap_or_else(|e| panic!("{e}: {args:?}"));
        let request = parsed.args.request().unwrap();
        assert!(
            request.non_iid && request.pool_bn_stats && request.strategy.int8,
            "{args:?}"
        );
        assert_eq!(request.strategy.resolve(), config.strategy);
    }
}
