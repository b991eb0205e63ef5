//! One stage of a pipeline check job: `bonfire-pp-check <gpipe|1f1b> <steps> <micro-batches>
//! <out-dir> [chunks]`, started by `bonfire launch`, one stage per rank. Builds its blocks of
//! `bonfire_testkit::pp`'s model (split evenly; with `chunks` above 1, into `chunks` x stages
//! chunks, rank `r` holding chunks `r`, `r + stages`, ..., run by interleaved 1F1B), trains
//! `<steps>` Adam steps on the batch cut into micro-batches, and writes `<out-dir>/rank<r>.bin`:
//! for every step the loss (the last stage's, 0 elsewhere), every gradient of its blocks, then
//! every parameter after the step (its chunks in order, each in module order, f32); and
//! `<out-dir>/rank<r>.held`: the most micro-batches it held.
//!
//! The test compares it with single-device training of the whole model on the whole batch.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bonfire::pipeline::{Pipeline, Schedule, StageOutput, partition};
use bonfire_testkit::nets::{DpFlex, parameters, write_params};
use bonfire_testkit::pp::{BATCH, BLOCKS, Stage, batch, gradients_of, mse, stage};
use burn::backend::flex::FlexDevice;
use burn::optim::{AdamConfig, Optimizer};

fn run(
    schedule: Schedule,
    steps: usize,
    micro: usize,
    out: &Path,
    chunks: usize,
) -> Result<(), String> {
    let world = bonfire::init().map_err(|e| e.to_string())?;
    let device = FlexDevice;
    let pipe = Pipeline::new(world.comm().clone(), schedule, micro)
        .and_then(|p| p.interleaved(chunks))
        .map_err(|e| e.to_string())?;
    let (p, r) = (pipe.stages(), pipe.stage());
    let ranges = partition(&[1; BLOCKS], p * chunks);
    let mut models: Vec<Stage<DpFlex>> = (0..chunks)
        .map(|c| stage(ranges[c * p + r].clone(), &device))
        .collect();
    let mut optims: Vec<_> = (0..chunks).map(|_| AdamConfig::new().init()).collect();
    let (x, y) = batch(&device);
    let rows = BATCH / micro;
    let (mut trace, mut held) = (Vec::new(), 0);
    for _ in 0..steps {
        let last = |c: usize| r + 1 == p && c + 1 == chunks;
        let (grads, report) = pipe
            .step_chunks(&models, &device, |m: &Stage<DpFlex>, c, i, input| {
                let part = i * rows..(i + 1) * rows;
                let out = m.forward(input.unwrap_or_else(|| x.clone().slice(part.clone())));
                if last(c) {
                    StageOutput::Loss(mse(out, y.clone().slice(part)))
                } else {
                    StageOutput::Activation(out)
                }
            })
            .map_err(|e| e.to_string())?;
        held = held.max(report.max_in_flight);
        trace.push(vec![report.loss.unwrap_or(0.0)]);
        for (model, grads) in models.iter().zip(&grads) {
            trace.extend(gradients_of(model, grads));
        }
        models = models
            .into_iter()
            .zip(grads)
            .zip(optims.iter_mut())
            .map(|((model, grads), optim)| optim.step(1e-2, model, grads))
            .collect();
        for model in &models {
            trace.extend(parameters(model));
        }
    }
    write_params(&out.join(format!("rank{r}.bin")), &trace).map_err(|e| e.to_string())?;
    std::fs::write(out.join(format!("rank{r}.held")), held.to_string()).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bonfire-pp-check <gpipe|1f1b> <steps> <micro-batches> <out-dir> [chunks]";
    let (schedule, steps, micro, out, chunks) = match args.as_slice() {
        [s, n, m, o] => (s, n, m, o, "1"),
        [s, n, m, o, c] => (s, n, m, o, c.as_str()),
        _ => {
            eprintln!("{usage}");
            return ExitCode::from(2);
        }
    };
    let (Ok(schedule), Ok(steps), Ok(micro), Ok(chunks)) = (
        schedule.parse::<Schedule>(),
        steps.parse::<usize>(),
        micro.parse::<usize>(),
        chunks.parse::<usize>(),
    ) else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    match run(schedule, steps, micro, &PathBuf::from(out), chunks) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bonfire-pp-check: {e}");
            ExitCode::FAILURE
        }
    }
}
