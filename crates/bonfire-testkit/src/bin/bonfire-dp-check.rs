//! One rank of a data-parallel check job: `bonfire-dp-check <cnn|transformer> <steps>
//! <rows-per-rank> <out-dir>`. Joins the job (`bonfire::init`), builds the model from a seed of
//! its own (rank 0 from the single-rank reference's seed), replicates it, trains on its slice of
//! every batch, and writes its parameters (module order, little-endian f32) to
//! `<out-dir>/rank<r>.bin`. The test compares them with one rank trained on the whole batches.

use std::process::ExitCode;

use bonfire_testkit::nets::{
    DpFlex, Net, SmallCnn, SmallTransformer, parameters, random_batches, seeded, train,
    write_params,
};
use burn::backend::flex::FlexDevice;
use burn::module::AutodiffModule;

/// The batches of a check: `steps` batches of `rows` rows, the same for every world size.
pub fn check_batches<M: Net<DpFlex>>(
    seed: u64,
    steps: usize,
    rows: usize,
) -> Vec<bonfire_testkit::nets::Batch> {
    random_batches(seed, steps, rows, M::FEATURES, M::CLASSES)
}

fn run<M>(
    make: fn(&FlexDevice) -> M,
    steps: usize,
    rows: usize,
    rank: usize,
    world: usize,
) -> Vec<Vec<f32>>
where
    M: Net<DpFlex> + AutodiffModule<DpFlex>,
{
    let device = FlexDevice;
    let model = bonfire::replicate(seeded::<DpFlex, _>(1 + 1000 * rank as u64, &device, make));
    let shard: Vec<_> = check_batches::<M>(21, steps, rows * world)
        .iter()
        .map(|b| b.slice(rank * rows, rows))
        .collect();
    parameters(&train(model, &shard, 1, &device).0)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, steps, rows, out] = args.as_slice() else {
        eprintln!("usage: bonfire-dp-check <cnn|transformer> <steps> <rows-per-rank> <out-dir>");
        return ExitCode::from(2);
    };
    let (Ok(steps), Ok(rows)) = (steps.parse::<usize>(), rows.parse::<usize>()) else {
        eprintln!("bonfire-dp-check: steps and rows must be numbers");
        return ExitCode::from(2);
    };
    let world = match bonfire::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, size) = (world.rank().0 as usize, world.world_size());
    let params = match model.as_str() {
        "cnn" => run(SmallCnn::new, steps, rows, rank, size),
        "transformer" => run(SmallTransformer::new, steps, rows, rank, size),
        other => {
            eprintln!("bonfire-dp-check: unknown model {other:?}");
            return ExitCode::from(2);
        }
    };
    let path = std::path::Path::new(out).join(format!("rank{rank}.bin"));
    if let Err(e) = write_params(&path, &params) {
        eprintln!("bonfire-dp-check: cannot write {}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
