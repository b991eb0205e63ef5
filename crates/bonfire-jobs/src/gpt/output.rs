//! What the GPT job shows: its opening line, an evaluation's lines (with the sample), the plot
//! and the end report.

use std::path::Path;
use std::time::Duration;

use bonfire_datasets::text::CharCorpus;

use super::{EvalRecord, GptReport, GptRunConfig, GptState};
use crate::plot::{self, Axes, Series};
use crate::progress::clock;
use crate::report::{checkpoints_line, data_parallel_lines};
use crate::settings::Settings;

/// The plot of a run, in its directory.
pub(super) const PLOTS: [&str; 1] = ["loss.png"];

/// Rank 0's opening line.
pub(super) fn start_line(
    s: &Settings<GptRunConfig>,
    corpus: &CharCorpus,
    params: usize,
    windows_per_replica: usize,
    replicas: usize,
) -> String {
    let c = &s.config;
    let tp = if c.tp > 1 {
        format!(" x {} tensor-parallel", c.tp)
    } else {
        String::new()
    };
    let mesh = if c.pp > 1 {
        format!(
            "{} rank(s): {replicas} data-parallel replica(s){tp} x {} pipeline stages ({}{}, {} \
             micro-batches per step; each stage idles {} = {:.0}% of a step)",
            c.ranks,
            c.pp,
            c.schedule,
            interleaving(c),
            c.grad_accum,
            bubble_formula(c),
            100.0 * bubble(c)
        )
    } else if c.tp > 1 {
        format!(
            "{} rank(s): {replicas} data-parallel replica(s){tp}",
            c.ranks
        )
    } else if let Some(servers) = c.strategy.servers() {
        format!(
            "{} rank(s): {replicas} worker(s) and {servers} parameter server(s) ({})",
            c.ranks,
            c.strategy.describe()
        )
    } else {
        format!("{} rank(s)", c.ranks)
    };
    format!(
        "bonfire train gpt: {} ({} training and {} validation characters, a vocabulary of {}), \
         {mesh} ({windows_per_replica} training windows per replica), backend {} ({} compute \
         thread(s) per rank); GPT of {params} parameters ({} layers, {} heads, width {}, context \
         {}); {} step(s) of {} sequence(s) x {} per replica{}, {} characters per step; Adam lr \
         {} (warmup {}, cosine to {}){}{}",
        c.dataset,
        corpus.train().len(),
        corpus.val().len(),
        c.vocab.chars().count(),
        s.backend,
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into()),
        c.layers,
        c.heads,
        c.embd,
        c.context,
        c.steps,
        c.batch,
        c.context,
        if c.grad_accum > 1 {
            format!(" x {} accumulated", c.grad_accum)
        } else {
            String::new()
        },
        c.tokens_per_step(),
        c.lr,
        c.warmup,
        c.lr / 10.0,
        if c.bf16 { ", bf16 gradients" } else { "" },
        match s.zero_stage() {
            Some(bonfire::ZeroStage::One) => ", its state sharded over the replicas (ZeRO-1)",
            Some(bonfire::ZeroStage::Two) => {
                ", its state and the gradients sharded over the replicas (ZeRO-2)"
            }
            Some(bonfire::ZeroStage::Three) => {
                ", its state, the gradients and the parameters sharded over the replicas (ZeRO-3)"
            }
            None => "",
        },
    )
}

/// Rank 0's lines after an evaluation, once its checkpoint `dir` is written: the losses, then
/// the sample, indented.
pub(super) fn eval_lines(r: &EvalRecord, state: &GptState, dir: &Path) -> Vec<String> {
    let mut lines = vec![format!(
        "eval {}/{} at step {}/{}: train loss {:.4}, validation loss {:.4} nats/char, {:.0} \
         chars/s, {} -> {}",
        r.eval,
        state.epochs,
        r.step,
        state.config.steps,
        r.train_loss,
        r.val_loss,
        r.tokens_per_second,
        clock(Duration::from_secs_f64(r.seconds)),
        dir.display(),
    )];
    lines.push(format!(
        "sample (temperature {}, top-k {}):",
        state.config.temperature, state.config.top_k
    ));
    lines.extend(r.sample.lines().map(|l| format!("  | {l}")));
    lines
}

/// The end report's lines (the first empty), written by `rank` (rank 0, or the first rank
/// left), or none when nothing was trained.
pub(super) fn report_lines(state: &GptState, report: &GptReport, rank: usize) -> Vec<String> {
    let Some(last) = state.history.last() else {
        return Vec::new();
    };
    let best = state
        .history
        .iter()
        .map(|r| r.val_loss)
        .fold(f64::INFINITY, f64::min);
    let mut lines = vec![
        String::new(),
        format!(
            "== result ({} after {} of {} steps) ==",
            state.config.dataset, last.step, state.config.steps
        ),
        format!(
            "validation loss {:.4} nats/char (best {:.4}), train loss {:.4}",
            last.val_loss, best, last.train_loss
        ),
    ];
    lines.extend(report.throughput.line("chars"));
    lines.extend(data_parallel_lines(
        report.stats.as_ref(),
        report.throughput.seconds,
        state.config.dp(),
    ));
    lines.extend(report.split.line(rank));
    lines.extend(report.servers.iter().cloned());
    if let Some((strategy, outer)) = &report.outer {
        lines.push(crate::strategy::report_line(
            strategy,
            outer,
            state.config.dp(),
        ));
    }
    lines.extend(report.memory.as_ref().map(crate::report::ModelMemory::line));
    if let (Some(all), Some(train)) = (&report.tp_stats, &report.train_tp_stats) {
        lines.push(crate::report::fully_sharded_line(
            all,
            train,
            report.throughput.seconds,
            "evaluations and samples",
        ));
    } else if let Some(tp) = &report.tp_stats {
        lines.push(format!(
            "tensor parallel {} rank(s) per replica; on rank 0 this run (evaluations and samples \
             included): {} all-reduces of {:.1} MiB, {} gathers of {:.1} MiB, {} fallback \
             gather(s)",
            state.config.tp,
            tp.all_reduces,
            tp.all_reduce_bytes as f64 / (1 << 20) as f64,
            tp.gathers,
            tp.gather_bytes as f64 / (1 << 20) as f64,
            tp.fallback_total(),
        ));
    }
    for st in report.pipeline.iter().flatten() {
        let c = &state.config;
        lines.push(format!(
            "pipeline stage {} of {}: blocks {}, {} parameters; idle {:.1}% of its pipeline \
             steps (the bubble {} is {:.1}%), {} micro-batch(es) and {:.2} MiB of activations \
             held at most",
            st.stage,
            c.pp,
            st.blocks
                .iter()
                .map(|b| format!("{}..{}", b.start, b.end))
                .collect::<Vec<_>>()
                .join(" and "),
            st.params,
            100.0 * st.idle,
            bubble_formula(c),
            100.0 * bubble(c),
            st.held,
            st.activation_bytes as f64 / (1 << 20) as f64,
        ));
    }
    let servers = state.config.strategy.servers().unwrap_or(0);
    lines.extend(crate::stragglers::workers_line(
        state
            .history
            .iter()
            .map(|r| (r.eval, &r.ranks[..], &r.gone[..])),
        servers,
    ));
    lines.extend(
        report
            .saves
            .as_ref()
            .filter(|s| s.count > 0)
            .map(|s| s.line()),
    );
    lines.push(checkpoints_line(&report.checkpoint_dir, last.eval, &PLOTS));
    lines.push(format!("weights digest  {}", last.param_digest));
    lines
}

/// Draws the loss plot of the run so far into `dir`: rank 0's running training loss, and the
/// training and validation losses at each evaluation, against the step.
pub(super) fn write_plot(dir: &Path, state: &GptState, log_loss: bool) -> std::io::Result<()> {
    let curve: Vec<(f64, f64)> = state
        .history
        .iter()
        .flat_map(|r| r.curve.iter().copied())
        .collect();
    let at_eval = |f: fn(&EvalRecord) -> f64| -> Vec<(f64, f64)> {
        state
            .history
            .iter()
            .map(|r| (r.step as f64, f(r)))
            .collect()
    };
    let train = at_eval(|r| r.train_loss);
    let val = at_eval(|r| r.val_loss);
    plot::line_plot(
        &dir.join(PLOTS[0]),
        &Axes {
            title: "loss",
            x: "step",
            y: "cross-entropy (nats per character)",
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
                name: "train (round mean)",
                colour: [31, 119, 180],
                points: &train,
                dots: true,
            },
            Series {
                name: "validation",
                colour: [230, 110, 20],
                points: &val,
                dots: true,
            },
        ],
    )
}

/// " interleaved over N chunks per rank" under `--chunks` above 1, else nothing.
fn interleaving(c: &GptRunConfig) -> String {
    if c.chunks > 1 {
        format!(" interleaved over {} chunks per rank", c.chunks)
    } else {
        String::new()
    }
}

/// The bubble's formula as the run's pipeline gives it: `(p-1)/(m+p-1)`, or with `v` chunks per
/// rank `(p-1)/(v*m+p-1)`.
fn bubble_formula(c: &GptRunConfig) -> &'static str {
    if c.chunks > 1 {
        "(p-1)/(v*m+p-1)"
    } else {
        "(p-1)/(m+p-1)"
    }
}

/// The part of a step each stage of the run's pipeline idles, by the formula.
fn bubble(c: &GptRunConfig) -> f64 {
    bonfire::pipeline::bubble_interleaved(c.pp, c.grad_accum, c.chunks)
}
