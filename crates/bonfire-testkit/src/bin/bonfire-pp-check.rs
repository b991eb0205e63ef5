//! One stage of a pipeline check job: `bonfire-pp-check <gpipe|1f1b> <steps> <micro-batches>
//! <out-dir>`, started by `bonfire launch`, one stage per rank. Builds its blocks of
//! `bonfire_testkit::pp`'s model (split evenly), trains `<steps>` Adam steps on the batch cut into
//! micro-batches, and writes `<out-dir>/rank<r>.bin`: for every step the loss (the last stage's,
//! 0 elsewhere), every gradient of its blocks, then every parameter after the step (module
//! order, f32); and `<out-dir>/rank<r>.held`: the most micro-batches it held.
//!
//! The test compares it with single-device training of the whole model on the whole batch.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bonfire::pipeline::{Pipeline, Schedule, StageOutput, partition};
use bonfire_testkit::nets::{DpFlex, parameters, write_params};
use bonfire_testkit::pp::{BATCH, BLOCKS, Stage, batch, gradients_of, mse, stage};
use burn::backend::flex::FlexDevice;
use burn::optim::{AdamConfig, Optimizer};

fn run(schedule: Schedule, steps: usize, micro: usize, out: &Path) -> Result<(), String> {
    let world = bonfire::init().map_err(|e| e.to_string())?;
    let device = FlexDevice;
    let pipe = Pipeline::new(world.comm().clone(), schedule, micro).map_err(|e| e.to_string())?;
    let ranges = partition(&[1; BLOCKS], pipe.stages());
    let mut model = stage(ranges[pipe.stage()].clone(), &device);
    let mut optim = AdamConfig::new().init();
    let (x, y) = batch(&device);
    let rows = BATCH / micro;
    let (mut trace, mut held) = (Vec::new(), 0);
    for _ in 0..steps {
        let last = pipe.is_last();
        let (grads, report) = pipe
            .step(&model, &device, |m: &Stage<DpFlex>, i, input| {
                let part = i * rows..(i + 1) * rows;
                let out = m.forward(input.unwrap_or_else(|| x.clone().slice(part.clone())));
                if last {
                    StageOutput::Loss(mse(out, y.clone().slice(part)))
                } else {
                    StageOutput::Activation(out)
                }
            })
            .map_err(|e| e.to_string())?;
        held = held.max(report.max_in_flight);
        trace.push(vec![report.loss.unwrap_or(0.0)]);
        trace.extend(gradients_of(&model, &grads));
        model = optim.step(1e-2, model, grads);
        trace.extend(parameters(&model));
    }
    let r = pipe.stage();
    write_params(&out.join(format!("rank{r}.bin")), &trace).map_err(|e| e.to_string())?;
    std::fs::write(out.join(format!("rank{r}.held")), held.to_string()).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bonfire-pp-check <gpipe|1f1b> <steps> <micro-batches> <out-dir>";
    let [schedule, steps, micro, out] = args.as_slice() else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    let (Ok(schedule), Ok(steps), Ok(micro)) = (
        schedule.parse::<Schedule>(),
        steps.parse::<usize>(),
        micro.parse::<usize>(),
    ) else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    match run(schedule, steps, micro, &PathBuf::from(out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bonfire-pp-check: {e}");
            ExitCode::FAILURE
        }
    }
}
