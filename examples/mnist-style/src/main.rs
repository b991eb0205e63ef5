//! A plain Burn training program for 28x28 digit images, made data-parallel. The lines marked
//! `bonfire:` are the whole change from the single-device program:
//!
//! ```text
//! bonfire launch --nproc-per-node 2 -- target/release/mnist-style
//! ```
//!
//! The images are synthetic (ten noisy, jittered stroke patterns, one per class, generated from a
//! seed) so the example needs no download; the bundled MNIST job is `bonfire train vision`.

mod data;
mod model;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use bonfire::{DataParallel, DistributedSampler};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};

use data::Digits;
use model::Cnn;

type B = Autodiff<DataParallel<Flex>>; // bonfire: was Autodiff<Flex>

struct Args {
    epochs: u64,
    steps: Option<usize>,
    batch: usize,
    lr: f64,
    train_size: usize,
    seed: u64,
    dump: Option<PathBuf>,
    zero: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        epochs: 2,
        steps: None,
        batch: 32,
        lr: 0.05,
        train_size: 6000,
        seed: 42,
        dump: None,
        zero: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let bad = |v: &str| format!("{flag} {v:?}: not a valid value");
        match flag.as_str() {
            "--epochs" => a.epochs = value()?.parse().map_err(|_| bad(&flag))?,
            "--steps" => a.steps = Some(value()?.parse().map_err(|_| bad(&flag))?),
            "--batch" => a.batch = value()?.parse().map_err(|_| bad(&flag))?,
            "--lr" => a.lr = value()?.parse().map_err(|_| bad(&flag))?,
            "--train-size" => a.train_size = value()?.parse().map_err(|_| bad(&flag))?,
            "--seed" => a.seed = value()?.parse().map_err(|_| bad(&flag))?,
            "--dump" => a.dump = Some(value()?.into()),
            "--zero" => a.zero = true,
            "-h" | "--help" => {
                println!(
                    "mnist-style [--epochs N] [--steps N] [--batch PER_RANK] [--lr LR] \
                     [--train-size N] [--seed S] [--dump DIR] [--zero]\n  \
                     --zero: each rank keeps the optimizer's state for its share of the \
                     parameters only (bonfire::sharded, ZeRO stage 1)"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown flag {other:?} (try --help)")),
        }
    }
    if a.batch == 0 {
        return Err("--batch must be at least 1".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("mnist-style: {e}");
            return ExitCode::from(2);
        }
    };
    // bonfire (optional, CPU backends): this thread runs its own parallel ops, one busy thread
    // per rank instead of two
    let _compute = bonfire::compute_on_this_thread();
    let world = match bonfire::init() {
        // bonfire: join the job
        Ok(w) => w,
        Err(e) => {
            eprintln!("mnist-style: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, size) = (world.rank().0 as usize, world.world_size());
    let device = FlexDevice;
    B::seed(&device, args.seed);

    let model = bonfire::replicate(Cnn::<B>::new(&device)); // bonfire: rank 0's weights everywhere
    let sgd = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new()))
        .init();
    let mut optim = if args.zero {
        Optim::Sharded(bonfire::sharded(sgd)) // bonfire (optional): ZeRO stage 1
    } else {
        Optim::Whole(sgd)
    };
    let train = Digits::generate(args.train_size, args.seed);
    let test = Digits::generate(1000, args.seed + 1);
    let sampler = DistributedSampler::new(train.len(), size, rank, args.seed); // bonfire: my shard
    let loss_fn = CrossEntropyLossConfig::new().init(&device);

    let mut model = model;
    let mut steps = 0;
    'epochs: for epoch in 0..args.epochs {
        let start = Instant::now();
        let (mut sum, mut count) = (0.0, 0);
        for batch in sampler.indices(epoch).chunks(args.batch) {
            let (images, labels) = train.batch::<B>(batch, &device);
            let loss = loss_fn.forward(model.forward(images), labels);
            sum += loss.clone().into_scalar().elem::<f32>();
            count += 1;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(args.lr, model, grads);
            steps += 1;
            if args.steps.is_some_and(|s| steps >= s) {
                break 'epochs;
            }
        }
        if world.is_main() {
            let secs = start.elapsed().as_secs_f64();
            let seen = count * args.batch * size;
            let acc = accuracy(&model, &test, &device);
            let s = bonfire::total_stats().unwrap_or_default();
            let per_step = |d: std::time::Duration| d.as_secs_f64() * 1e3 / s.steps.max(1) as f64;
            println!(
                "epoch {}: loss {:.4}, test accuracy {:.2}%, {:.0} images/s over {size} ranks, \
                 communication {:.0}% hidden by backward ({:.2} ms/step backward, {:.2} ms/step \
                 communication, {:.2} ms/step exposed)",
                epoch + 1,
                sum / count.max(1) as f32,
                100.0 * acc,
                seen as f64 / secs,
                100.0 * s.hidden_fraction(),
                per_step(s.backward),
                per_step(s.communication),
                per_step(s.exposed),
            );
        }
    }
    if let Optim::Sharded(o) = &optim
        && let Some((mine, all)) = o.owned_elements()
    {
        eprintln!(
            "rank {rank}: optimizer state for {mine} of the model's {all} parameter elements \
             ({} parameter tensor(s))",
            Optimizer::<Cnn<B>, B>::to_record(o).len()
        );
    }
    if let Some(dir) = &args.dump
        && let Err(e) = dump(&model, dir, rank)
    {
        eprintln!("mnist-style: cannot write {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// SGD with momentum over the CNN, whole on every rank or sharded over the ranks.
enum Optim {
    Whole(Sgd),
    Sharded(bonfire::Sharded<Sgd>),
}

type Sgd = OptimizerAdaptor<burn::optim::Sgd<<B as AutodiffBackend>::InnerBackend>, Cnn<B>, B>;

impl Optim {
    fn step(&mut self, lr: f64, model: Cnn<B>, grads: GradientsParams) -> Cnn<B> {
        match self {
            Optim::Whole(o) => o.step(lr, model, grads),
            Optim::Sharded(o) => o.step(lr, model, grads),
        }
    }
}

fn accuracy(model: &Cnn<B>, test: &Digits, device: &FlexDevice) -> f64 {
    let all: Vec<usize> = (0..test.len()).collect();
    let (images, labels) = test.batch::<B>(&all, device);
    let predicted = model.forward(images).argmax(1).reshape([test.len()]);
    let right: i64 = predicted.equal(labels).int().sum().into_scalar().elem();
    right as f64 / test.len() as f64
}

/// Every parameter, in module order, as little-endian f32, in `dir/rank<r>.bin`.
fn dump(model: &Cnn<B>, dir: &std::path::Path, rank: usize) -> std::io::Result<()> {
    struct Bytes(Vec<u8>);
    impl<B: Backend> ModuleVisitor<B> for Bytes {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let v = p.val().into_data().convert::<f32>();
            for x in v.iter::<f32>() {
                self.0.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
    let mut b = Bytes(Vec::new());
    model.visit(&mut b);
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".rank{rank}.bin.tmp"));
    std::fs::write(&tmp, &b.0)?;
    std::fs::rename(tmp, dir.join(format!("rank{rank}.bin")))
}
