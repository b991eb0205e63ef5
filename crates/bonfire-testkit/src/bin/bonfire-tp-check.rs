//! One rank of a tensor-parallel check job: `bonfire-tp-check <mlp|encoder|gpt> <steps>
//! <init-record> <out-dir>`, started by `bonfire launch` with `BONFIRE_TP` set. Joins the job,
//! loads the plain (single-device) record `<init-record>` into the model and splits it by the
//! model's plan, runs `<steps>` Adam steps, then:
//! - saves its shards to `<out-dir>/shards` and checks that loading them gives the same model;
//! - writes its gathered parameters to `<out-dir>/rank<r>.bin` (module order, f32), and rank 0
//!   the gathered model as a plain record `<out-dir>/whole` (Burn's full-precision bin format).
//!
//! The test compares both with single-device training from the same record.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bonfire::backend::tensor_parallel::{gathered, load_shards, save_shards};
use bonfire_testkit::nets::{max_abs_diff, parameters, write_params};
use bonfire_testkit::tp::{TpEncoder, TpFlex, TpGpt, TpMlp, TpNet, adam_steps};
use burn::backend::flex::FlexDevice;
use burn::module::AutodiffModule;
use burn::record::{BinFileRecorder, FullPrecisionSettings};

fn run<M>(
    make: fn(&FlexDevice) -> M,
    steps: usize,
    init: &Path,
    out: &Path,
    world: &bonfire::World,
) -> Result<(), String>
where
    M: TpNet<TpFlex> + AutodiffModule<TpFlex>,
{
    let device = FlexDevice;
    let recorder = BinFileRecorder::<FullPrecisionSettings>::new();
    let model = make(&device)
        .load_file(init, &recorder, &device)
        .map_err(|e| format!("cannot load {}: {e}", init.display()))?;
    let model =
        bonfire::tensor_parallel(model, &M::plan(), world.tp_group()).map_err(|e| e.to_string())?;
    let model = adam_steps(model, steps, &device).0;

    let shards = out.join("shards");
    save_shards(&model, &shards).map_err(|e| e.to_string())?;
    let reloaded = load_shards(make(&device), &shards).map_err(|e| e.to_string())?;
    let d = max_abs_diff(&parameters(&reloaded), &parameters(&model));
    if d != 0.0 {
        return Err(format!("the reloaded shards differ by {d}"));
    }

    let whole = gathered(model);
    let rank = world.rank().0;
    write_params(&out.join(format!("rank{rank}.bin")), &parameters(&whole))
        .map_err(|e| e.to_string())?;
    if world.is_main() {
        whole
            .save_file(out.join("whole"), &recorder)
            .map_err(|e| format!("cannot save the whole model: {e}"))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, steps, init, out] = args.as_slice() else {
        eprintln!("usage: bonfire-tp-check <mlp|encoder|gpt> <steps> <init-record> <out-dir>");
        return ExitCode::from(2);
    };
    let Ok(steps) = steps.parse::<usize>() else {
        eprintln!("bonfire-tp-check: steps must be a number");
        return ExitCode::from(2);
    };
    let world = match bonfire::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let (init, out) = (PathBuf::from(init), PathBuf::from(out));
    let result = match model.as_str() {
        "mlp" => run(TpMlp::new, steps, &init, &out, &world),
        "encoder" => run(TpEncoder::new, steps, &init, &out, &world),
        "gpt" => run(TpGpt::new, steps, &init, &out, &world),
        other => Err(format!("unknown model {other:?}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bonfire-tp-check rank {}: {e}", world.rank().0);
            ExitCode::FAILURE
        }
    }
}
