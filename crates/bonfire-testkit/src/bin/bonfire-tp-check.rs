//! One rank of a tensor-parallel check job: `bonfire-tp-check <mlp|encoder|gpt> <steps>
//! <init-record> <out-dir>`, started by `bonfire launch` with `BONFIRE_TP` set. Joins the job,
//! loads the plain (single-device) record `<init-record>` into the model and splits it by the
//! model's plan; when the job has more ranks than `BONFIRE_TP` (data x tensor parallelism), runs
//! on `Autodiff<Hybrid<Flex>>`, replicates the split model over its data-parallel group and
//! trains on its replica's part of every batch. It runs `<steps>` Adam steps, then:
//! - saves its shards to `<out-dir>/shards-dp<replica>` and checks that loading them gives the
//!   same model;
//! - writes its gathered parameters to `<out-dir>/rank<r>.bin` (module order, f32), and rank 0
//!   the gathered model as a plain record `<out-dir>/whole` (Burn's full-precision bin format).
//!
//! The test compares both with single-device training from the same record.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bonfire::backend::tensor_parallel::{
    TensorParallelBackend, gathered, load_shards, save_shards,
};
use bonfire_testkit::nets::{max_abs_diff, parameters, write_params};
use bonfire_testkit::tp::{TpEncoder, TpFlex, TpGpt, TpMlp, TpNet, adam_steps_on_part};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::module::AutodiffModule;
use burn::record::{BinFileRecorder, FullPrecisionSettings};
use burn::tensor::backend::AutodiffBackend;

type HybridFlex = Autodiff<bonfire::Hybrid<Flex>>;

fn run<B, M>(
    make: fn(&FlexDevice) -> M,
    steps: usize,
    init: &Path,
    out: &Path,
    world: &bonfire::World,
) -> Result<(), String>
where
    B: AutodiffBackend<Device = FlexDevice> + TensorParallelBackend,
    M: TpNet<B> + AutodiffModule<B>,
{
    let device = FlexDevice;
    let recorder = BinFileRecorder::<FullPrecisionSettings>::new();
    let model = make(&device)
        .load_file(init, &recorder, &device)
        .map_err(|e| format!("cannot load {}: {e}", init.display()))?;
    let model =
        bonfire::tensor_parallel(model, &M::plan(), world.tp_group()).map_err(|e| e.to_string())?;
    let (replica, replicas) = (world.dp_group().rank(), world.dp_group().size());
    let model = if replicas > 1 {
        bonfire::replicate(model)
    } else {
        model
    };
    let model = adam_steps_on_part(model, steps, &device, replica, replicas).0;

    let shards = out.join(format!("shards-dp{replica}"));
    save_shards(&model, &shards).map_err(|e| e.to_string())?;
    let reloaded = load_shards(make(&device), &shards).map_err(|e| e.to_string())?;
    let d = max_abs_diff(&parameters(&reloaded), &parameters(&model));
    if d != 0.0 {
        return Err(format!("the reloaded shards differ by {d}"));
    }
    // One byte changed on disk: the shard fails its checksum, naming the file.
    let file = std::fs::read_dir(&shards)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| {
                n.to_string_lossy()
                    .starts_with(&format!("tp-rank{}-", world.tp_group().rank()))
            })
        })
        .ok_or("no shard file of this rank")?;
    let mut bytes = std::fs::read(&file).map_err(|e| e.to_string())?;
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    let damaged = shards.with_extension("damaged");
    std::fs::create_dir_all(&damaged).map_err(|e| e.to_string())?;
    std::fs::write(damaged.join(file.file_name().unwrap()), &bytes).map_err(|e| e.to_string())?;
    match load_shards(make(&device), &damaged) {
        Err(e) if e.to_string().contains("does not match its checksum") => {}
        Err(e) => return Err(format!("a damaged shard failed otherwise: {e}")),
        Ok(_) => return Err("a damaged shard loaded".into()),
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
    let hybrid = world.dp_group().size() > 1;
    let result = match (model.as_str(), hybrid) {
        ("mlp", false) => run::<TpFlex, _>(TpMlp::new, steps, &init, &out, &world),
        ("mlp", true) => run::<HybridFlex, _>(TpMlp::new, steps, &init, &out, &world),
        ("encoder", false) => run::<TpFlex, _>(TpEncoder::new, steps, &init, &out, &world),
        ("encoder", true) => run::<HybridFlex, _>(TpEncoder::new, steps, &init, &out, &world),
        ("gpt", false) => run::<TpFlex, _>(TpGpt::new, steps, &init, &out, &world),
        ("gpt", true) => run::<HybridFlex, _>(TpGpt::new, steps, &init, &out, &world),
        (other, _) => Err(format!("unknown model {other:?}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bonfire-tp-check rank {}: {e}", world.rank().0);
            ExitCode::FAILURE
        }
    }
}
