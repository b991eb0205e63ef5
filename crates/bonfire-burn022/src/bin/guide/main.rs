//! Burn's guide classifier on the embedded MNIST sample, trained by burn-train 0.22 with
//! bonfire's data parallelism: `bonfire launch --nproc-per-node 2 -- guide`. Run alone, it trains
//! on one process. The lines that make it distributed are marked `bonfire:`.

mod model;

use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use bonfire_datasets::{ImageSet, Shard, Split};
use burn::data::dataloader::DataLoaderBuilder;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{ExecutionStrategy, Learner, MultiDeviceOptim, SupervisedTraining};

use model::{Indices, MnistBatcher, ModelConfig};

const USAGE: &str =
    "usage: guide [--epochs N] [--batch N] [--train-limit N] [--test-limit N] [--lr X] [--seed N]
             [--dropout P] [--no-shuffle] [--init-from FILE] [--artifacts DIR] [--resume]
             [--burn-multi-device N]

Trains Burn's guide classifier on the embedded MNIST sample (2,000 training and 500 test
images) with burn-train 0.22; under `bonfire launch --nproc-per-node N` every rank trains on
its share and the gradients are averaged. Defaults: --epochs 2 --batch 64 --lr 1e-3 --seed 42
--dropout 0.5 --artifacts <temporary directory>/bonfire-guide-022. --init-from starts from the
parameters of a model file (a burnpack, as ARTIFACTS/model.bpk). Each rank writes its summary
line to ARTIFACTS/summary-rank-N.txt, and rank 0 the trained model to ARTIFACTS/model.bpk.
--resume writes burn-train's checkpoint after every epoch (ARTIFACTS/checkpoint) and starts
from the newest one every rank can load, if any: run it so under bonfire launch --max-restarts.
--burn-multi-device N trains with Burn's own MultiDevice strategy instead, N copies of the
device in this one process (not under bonfire launch), for comparison.";

struct Args {
    epochs: usize,
    batch: usize,
    train_limit: usize,
    test_limit: usize,
    lr: f64,
    seed: u64,
    artifacts: PathBuf,
    burn_multi_device: Option<usize>,
    dropout: f64,
    shuffle: bool,
    init_from: Option<PathBuf>,
    resume: bool,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        epochs: 2,
        batch: 64,
        train_limit: usize::MAX,
        test_limit: usize::MAX,
        lr: 1e-3,
        seed: 42,
        artifacts: std::env::temp_dir().join("bonfire-guide-022"),
        burn_multi_device: None,
        dropout: 0.5,
        shuffle: true,
        init_from: None,
        resume: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--no-shuffle" {
            args.shuffle = false;
            continue;
        }
        if flag == "--resume" {
            args.resume = true;
            continue;
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n\n{USAGE}"))?;
        let bad = |what: &str| format!("{flag} {value:?}: expected {what}\n\n{USAGE}");
        let count = |v: &str| v.parse::<usize>().ok().filter(|n| *n > 0);
        match flag.as_str() {
            "--epochs" => args.epochs = count(&value).ok_or_else(|| bad("a positive number"))?,
            "--batch" => args.batch = count(&value).ok_or_else(|| bad("a positive number"))?,
            "--train-limit" => {
                args.train_limit = count(&value).ok_or_else(|| bad("a positive number"))?
            }
            "--test-limit" => {
                args.test_limit = count(&value).ok_or_else(|| bad("a positive number"))?
            }
            "--lr" => {
                args.lr = value
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| bad("a positive learning rate"))?
            }
            "--seed" => args.seed = value.parse().map_err(|_| bad("a number"))?,
            "--artifacts" => args.artifacts = PathBuf::from(value),
            "--init-from" => args.init_from = Some(PathBuf::from(value)),
            "--dropout" => {
                args.dropout = value
                    .parse::<f64>()
                    .ok()
                    .filter(|p| (0.0..1.0).contains(p))
                    .ok_or_else(|| bad("a probability in [0, 1)"))?
            }
            "--burn-multi-device" => {
                args.burn_multi_device =
                    Some(count(&value).ok_or_else(|| bad("a positive number of devices"))?)
            }
            _ => return Err(format!("unknown flag {flag:?}\n\n{USAGE}")),
        }
    }
    Ok(args)
}

/// A digest of every float parameter's bits, in the model's order: equal on every rank when the
/// replicas are bitwise equal.
#[derive(Default)]
struct Digest(u64);

impl ModuleVisitor for Digest {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let data = param.val().into_data().convert::<f32>();
        for v in data.as_slice::<f32>().expect("f32 after convert") {
            self.0 = (self.0 ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    // ANCHOR: init
    let world = bonfire_burn022::init()?; // bonfire: join the job
    // ANCHOR_END: init
    let device = Device::default();
    device.seed(args.seed);
    let train = Arc::new(ImageSet::embedded(
        Split::Train,
        Shard::whole().limit(args.train_limit),
    )?);
    let test = Arc::new(ImageSet::embedded(
        Split::Test,
        Shard::whole().limit(args.test_limit),
    )?);
    let loader_train = DataLoaderBuilder::new(MnistBatcher(train.clone())).batch_size(args.batch);
    let loader_train = match args.shuffle {
        true => loader_train.shuffle(args.seed),
        false => loader_train,
    }
    .build(Indices(train.len()));
    let loader_test = DataLoaderBuilder::new(MnistBatcher(test.clone()))
        .batch_size(args.batch)
        .build(Indices(test.len()));
    // Drawn on an autodiff device, so that its parameters are trained (burn-train 0.22's rule).
    let model = ModelConfig::new(10, 512)
        .with_dropout(args.dropout)
        .init(&device.clone().autodiff());
    let model = match &args.init_from {
        Some(path) => model
            .try_load_file(path)
            .map_err(|e| format!("--init-from {}: {e}", path.display()))?,
        None => model,
    };
    let resumed = match args.resume {
        true => bonfire_burn022::resume_epoch(&world, &args.artifacts)?,
        false => None,
    };
    if let Some(epoch) = resumed {
        println!("guide: resuming after epoch {epoch}");
    }

    // ANCHOR: training
    let strategy = bonfire_burn022::DataParallel::new(&world, device.clone()); // bonfire
    let training = SupervisedTraining::new(&args.artifacts, loader_train, loader_test)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .num_epochs(args.epochs)
        .with_training_strategy(strategy.clone().into()); // bonfire
    // ANCHOR_END: training
    // bonfire's log subscriber is the process's; burn-train's file logger would not install.
    let training = training.with_application_logger(None);
    let training = match resumed {
        Some(epoch) => training.with_default_checkpointers().checkpoint(epoch),
        None if args.resume => training.with_default_checkpointers(),
        None => training,
    };
    let training = match args.burn_multi_device {
        Some(n) if world.world_size() > 1 => {
            return Err(format!(
                "--burn-multi-device {n} runs Burn's own strategy in one process; run it without bonfire launch"
            )
            .into());
        }
        Some(n) => training.with_training_strategy(
            ExecutionStrategy::multi(vec![device.clone(); n], MultiDeviceOptim::OptimMainDevice)
                .into(),
        ),
        None => training,
    };
    let started = Instant::now();
    let result = training.launch(Learner::new(model, AdamConfig::new().init(), args.lr));
    let seconds = started.elapsed().as_secs_f64();
    if let Some(error) = result.error {
        return Err(format!("training stopped: {error}").into());
    }
    let steps = match args.burn_multi_device {
        // Burn's strategy counts nothing for us: its steps, from the loader's sizes.
        Some(n) => {
            args.epochs.saturating_sub(resumed.unwrap_or(0))
                * (train.len() / n).div_ceil(args.batch)
        }
        None => strategy.steps(),
    };
    let model = result.model;
    let mut digest = Digest::default();
    model.visit(&mut digest);
    let rank = world.rank().0;
    let summary = format!(
        "guide: rank {rank} of {}: {steps} steps of {} images in {seconds:.2} s ({:.1} ms per step), parameters {:016x}",
        world.world_size(),
        args.batch,
        seconds * 1e3 / steps.max(1) as f64,
        digest.0
    );
    println!("{summary}");
    // The same line in a file, for scripts and tests: ARTIFACTS/summary-rank-N.txt.
    std::fs::create_dir_all(&args.artifacts)?;
    std::fs::write(
        args.artifacts.join(format!("summary-rank-{rank}.txt")),
        &summary,
    )?;
    if world.is_main() {
        if args.burn_multi_device.is_none()
            && let Some(line) = strategy.straggler_report()
        {
            println!("guide: {line}");
        }
        let saved = args.artifacts.join("model.bpk");
        model.clone().save_file(&saved)?;
        println!("guide: trained model saved to {}", saved.display());
        let indices: Vec<usize> = (0..test.len()).collect();
        let batch = MnistBatcher(test).batch_of(&indices, &device.clone().inner());
        let predicted = model.forward(batch.images).argmax(1).flatten::<1>(0, 1);
        let correct: i64 = predicted
            .equal(batch.targets)
            .int()
            .sum()
            .into_scalar::<i64>();
        println!(
            "guide: test accuracy {:.2}% ({correct} of {})",
            100.0 * correct as f64 / indices.len() as f64,
            indices.len()
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guide: {e}");
            ExitCode::FAILURE
        }
    }
}
