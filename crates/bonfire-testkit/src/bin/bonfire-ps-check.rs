//! One rank of a parameter-server check job: `bonfire-ps-check <sync|async> <steps>
//! <rows-per-worker> <out-dir> [W:K]` (with `W:K`, worker `W` exits with status 1 after `K`
//! steps, without saying it is done). Joins the job (`bonfire::init`); the last rank serves, the
//! others work. Every rank builds the CNN from one seed and starts from rank 0's parameters
//! (`broadcast_parameters`); each worker trains on its slice of every batch with Adam through
//! `bonfire::param_server` and writes its parameters (module order, little-endian f32) to
//! `<out-dir>/rank<r>.bin`; the server writes its report line to `<out-dir>/server.txt`.

use std::process::ExitCode;

use bonfire::PsRole;
use bonfire_testkit::nets::{
    DpFlex, Net, SmallCnn, loss, parameters, random_batches, seeded, write_params,
};
use burn::backend::flex::FlexDevice;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, steps, rows, out, die) = match args.as_slice() {
        [m, s, r, o] => (m, s, r, o, None),
        [m, s, r, o, d] => (m, s, r, o, Some(d)),
        _ => {
            eprintln!(
                "usage: bonfire-ps-check <sync|async> <steps> <rows-per-worker> <out-dir> [W:K]"
            );
            return ExitCode::from(2);
        }
    };
    let die: Option<(usize, usize)> = match die.map(|d| d.split_once(':')) {
        None => None,
        Some(Some((w, k))) if w.parse::<usize>().is_ok() && k.parse::<usize>().is_ok() => {
            Some((w.parse().unwrap_or(0), k.parse().unwrap_or(0)))
        }
        Some(_) => {
            eprintln!("bonfire-ps-check: the last argument is W:K (worker W dies after K steps)");
            return ExitCode::from(2);
        }
    };
    let (Ok(steps), Ok(rows)) = (steps.parse::<usize>(), rows.parse::<usize>()) else {
        eprintln!("bonfire-ps-check: steps and rows must be numbers");
        return ExitCode::from(2);
    };
    // Held to the end: dropping the world shuts this rank's transport down.
    let _world = match bonfire::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let device = FlexDevice;
    let model = bonfire::broadcast_parameters(seeded::<DpFlex, _>(1, &device, SmallCnn::new));
    let adam = AdamConfig::new().init::<DpFlex, SmallCnn<DpFlex>>();
    let mut optim = match mode.as_str() {
        "sync" => bonfire::param_server(adam, 1),
        "async" => bonfire::param_server(adam, 1).asynchronous(1),
        other => {
            eprintln!("bonfire-ps-check: unknown mode {other:?}");
            return ExitCode::from(2);
        }
    };
    let out = std::path::Path::new(out);
    match optim.role(&device) {
        PsRole::Server { .. } => {
            let (_, report) = optim.serve(model);
            if let Err(e) = std::fs::write(out.join("server.txt"), report.line()) {
                eprintln!("bonfire-ps-check: cannot write the report: {e}");
                return ExitCode::FAILURE;
            }
        }
        PsRole::Worker { index, workers } => {
            let batches = random_batches(
                21,
                steps,
                rows * workers,
                SmallCnn::<DpFlex>::FEATURES,
                SmallCnn::<DpFlex>::CLASSES,
            );
            let mut model = model;
            for (k, b) in batches.iter().enumerate() {
                if die == Some((index, k)) {
                    eprintln!("bonfire-ps-check: worker {index} dies after {k} steps");
                    std::process::exit(1);
                }
                let l = loss(&model, &b.slice(index * rows, rows), 1.0, &device);
                let grads = GradientsParams::from_grads(l.backward(), &model);
                model = optim.step(1e-2, model, grads);
            }
            let model = optim.finish(model);
            let path = out.join(format!("rank{index}.bin"));
            if let Err(e) = write_params(&path, &parameters(&model)) {
                eprintln!("bonfire-ps-check: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
