//! One rank of a burn-train check job: `bonfire-train-check <dir> <epochs> [accumulation]
//! [resume-epoch]`. Joins the job (`bonfire::init`), trains `learn::Mlp` with burn-train's
//! `SupervisedTraining` under `bonfire::train::DataParallelStrategy` (artifacts in `<dir>/run`,
//! initial parameters from a seed of the rank's own: rank 0's must win), and writes its final
//! parameters (module order, little-endian f32) to `<dir>/rank<r>.bin`.

use std::path::PathBuf;
use std::process::ExitCode;

use bonfire_testkit::learn::{How, check_run, fit};
use bonfire_testkit::nets::write_params;

fn number(s: Option<&String>, what: &str) -> Result<Option<usize>, String> {
    match s.map(|s| s.as_str()) {
        None | Some("-") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| format!("bonfire-train-check: {what} must be a number, not {s:?}")),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        eprintln!("usage: bonfire-train-check <dir> <epochs> [accumulation|-] [resume-epoch]");
        return ExitCode::from(2);
    }
    let dir = PathBuf::from(&args[0]);
    let parsed = (
        number(args.get(1), "epochs"),
        number(args.get(2), "accumulation"),
        number(args.get(3), "resume-epoch"),
    );
    let (Ok(Some(epochs)), Ok(accumulation), Ok(resume)) = parsed else {
        eprintln!("bonfire-train-check: epochs, accumulation and resume-epoch must be numbers");
        return ExitCode::from(2);
    };
    let world = match bonfire::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let rank = world.rank().0 as usize;
    let mut run = check_run(epochs, accumulation, resume);
    // Each rank starts from parameters of its own; the strategy must replace them with rank 0's.
    run.seed += 1000 * rank as u64;
    let params = fit(&run, How::Bonfire, &dir.join("run"));
    if let Err(e) = write_params(&dir.join(format!("rank{rank}.bin")), &params) {
        eprintln!("bonfire-train-check: writing rank {rank}'s parameters: {e}");
        return ExitCode::FAILURE;
    }
    world.shutdown();
    ExitCode::SUCCESS
}
