//! What the vision job shows: its opening line, an epoch's line, the plots and the end report.

use std::path::Path;
use std::time::Duration;

use bonfire_datasets::ImageSet;

use super::{EpochRecord, VisionReport, VisionState};
use crate::plot::{self, Axes, Series};
use crate::progress::clock;
use crate::report::{checkpoints_line, data_parallel_lines};
use crate::settings::Settings;

use super::VisionConfig;

/// The plots of a run, in its directory.
pub(super) const PLOTS: [&str; 2] = ["loss.png", "accuracy.png"];

/// Rank 0's opening line.
pub(super) fn start_line(
    s: &Settings<VisionConfig>,
    train: &ImageSet,
    test: &ImageSet,
    size: usize,
) -> String {
    let c = &s.config;
    let who = if c.strategy.servers().is_some() {
        "worker"
    } else {
        "rank"
    };
    format!(
        "bonfire train vision: {} ({} images, {} per {who}), {} test images, {size} {}, \
         backend {} ({} compute thread(s) per rank), batch {} per {who}, Adam lr {} (x{} per \
         epoch){}{}{}",
        train.description(),
        train.len() * size,
        train.len(),
        test.split_len().min(c.test_limit.unwrap_or(usize::MAX)),
        match c.strategy.servers() {
            Some(n) => format!(
                "worker(s) and {n} parameter server(s) ({})",
                c.strategy.describe()
            ),
            None => "rank(s)".into(),
        },
        s.backend,
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into()),
        c.batch,
        c.lr,
        c.lr_decay,
        if c.bf16 { ", bf16 gradients" } else { "" },
        if c.pool_bn_stats {
            ", batch-norm statistics pooled over the ranks each epoch"
        } else {
            ""
        },
        match s.zero_stage() {
            Some(bonfire::ZeroStage::One) => ", its state sharded over the ranks (ZeRO-1)",
            Some(bonfire::ZeroStage::Two) => {
                ", its state and the gradients sharded over the ranks (ZeRO-2)"
            }
            Some(bonfire::ZeroStage::Three) => {
                ", its state, the gradients and the parameters sharded over the ranks (ZeRO-3)"
            }
            None => "",
        },
    )
}

/// Rank 0's line at the end of an epoch, once its checkpoint `dir` is written.
pub(super) fn epoch_line(r: &EpochRecord, epochs: usize, dir: &Path) -> String {
    format!(
        "epoch {}/{}: train loss {:.4}, train accuracy {:.2}%, test loss {:.4}, test accuracy \
         {:.2}% ({}/{}), {:.0} images/s, {} -> {}",
        r.epoch,
        epochs,
        r.train_loss,
        100.0 * r.train_accuracy,
        r.test_loss,
        100.0 * r.test_accuracy,
        r.test_correct,
        r.test_images,
        r.images_per_second,
        clock(Duration::from_secs_f64(r.seconds)),
        dir.display(),
    )
}

/// The end report's lines (the first empty), written by `rank` (rank 0, or the first rank
/// left), or none when no epoch was trained.
pub(super) fn report_lines(state: &VisionState, report: &VisionReport, rank: usize) -> Vec<String> {
    let Some(last) = state.history.last() else {
        return Vec::new();
    };
    let mut lines = vec![
        String::new(),
        format!(
            "== result ({} after {} epochs) ==",
            state.config.dataset, last.epoch
        ),
        format!(
            "test accuracy   {:.2}% ({}/{} test images), test loss {:.4}",
            100.0 * last.test_accuracy,
            last.test_correct,
            last.test_images,
            last.test_loss
        ),
    ];
    lines.extend(report.throughput.line("images"));
    lines.extend(data_parallel_lines(
        report.stats.as_ref(),
        report.throughput.seconds,
        report.throughput.ranks,
    ));
    lines.extend(report.split.line(rank));
    lines.extend(report.servers.iter().cloned());
    if let Some((strategy, outer)) = &report.outer {
        lines.push(crate::strategy::report_line(
            strategy,
            outer,
            state.config.ranks,
        ));
    }
    lines.push(report.memory.line());
    if let Some((all, train)) = &report.fully_sharded {
        lines.push(crate::report::fully_sharded_line(
            all,
            train,
            report.throughput.seconds,
            "evaluations and checkpoints",
        ));
    }
    let servers = state.config.strategy.servers().unwrap_or(0);
    lines.extend(crate::stragglers::workers_line(
        state
            .history
            .iter()
            .map(|r| (r.epoch, &r.ranks[..], &r.gone[..])),
        servers,
    ));
    lines.push(checkpoints_line(&report.checkpoint_dir, last.epoch, &PLOTS));
    lines.push(format!("weights digest  {}", last.param_digest));
    lines
}

/// Draws the loss and accuracy plots of the run so far into `dir`.
pub(super) fn write_plots(dir: &Path, state: &VisionState, log_loss: bool) -> std::io::Result<()> {
    let curve: Vec<(f64, f64)> = state
        .history
        .iter()
        .flat_map(|r| r.curve.iter().copied())
        .collect();
    let per_epoch = |f: fn(&EpochRecord) -> f64| -> Vec<(f64, f64)> {
        state
            .history
            .iter()
            .map(|r| (r.epoch as f64, f(r)))
            .collect()
    };
    let test_loss = per_epoch(|r| r.test_loss);
    let train_loss = per_epoch(|r| r.train_loss);
    let blue = [31, 119, 180];
    let orange = [230, 110, 20];
    let green = [44, 160, 44];
    plot::line_plot(
        &dir.join(PLOTS[0]),
        &Axes {
            title: "loss",
            x: "epoch",
            y: "cross-entropy (nats)",
            y_range: None,
            log_y: log_loss,
        },
        &[
            Series {
                name: "train (rank 0, running)",
                colour: [160, 190, 220],
                points: &curve,
                dots: false,
            },
            Series {
                name: "train (epoch mean)",
                colour: blue,
                points: &train_loss,
                dots: true,
            },
            Series {
                name: "test",
                colour: orange,
                points: &test_loss,
                dots: true,
            },
        ],
    )?;
    let train_acc = per_epoch(|r| 100.0 * r.train_accuracy);
    let test_acc = per_epoch(|r| 100.0 * r.test_accuracy);
    let lo = train_acc
        .iter()
        .chain(&test_acc)
        .map(|p| p.1)
        .fold(100.0, f64::min);
    plot::line_plot(
        &dir.join(PLOTS[1]),
        &Axes {
            title: "accuracy",
            x: "epoch",
            y: "accuracy (%)",
            y_range: Some(((lo - 1.0).floor().max(0.0), 100.0)),
            log_y: false,
        },
        &[
            Series {
                name: "train",
                colour: blue,
                points: &train_acc,
                dots: true,
            },
            Series {
                name: "test",
                colour: green,
                points: &test_acc,
                dots: true,
            },
        ],
    )
}
