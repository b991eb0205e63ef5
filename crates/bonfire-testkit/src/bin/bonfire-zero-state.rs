//! What ZeRO stages 1 to 3 save: `bonfire-zero-state [WORLDS] [STEPS]` (default `2,4` and 3)
//! trains the bundled GPT (its default shape, a 65-character vocabulary) with Adam on in-process
//! ranks (threads over the in-process transport), once with the optimizer whole on every rank,
//! once under `bonfire::sharded` (stage 1), once under `bonfire::sharded(..).stage(Two)` and once
//! sharded at rest by `bonfire::fully_shard` (stage 3), and prints per rank the model state it
//! holds: parameters (f32; whole on every rank below stage 3, `bonfire::held_bytes`), the
//! gradients it held after its last backward (`bonfire::gradient_bytes`) and the optimizer's
//! state, measured as the bytes of its encoded record (`BinBytesRecorder`, full precision, this
//! rank's parts). Then how the sharded runs' parameters compare with DDP's (stage 1: bit for
//! bit; stages 2 and 3 within 1e-6) and each run's median step time (the ranks share this
//! process's cores, one compute thread each, so compare the runs with each other only; an
//! untimed run at each world size goes first).

use std::time::{Duration, Instant};

use bonfire::models::{Gpt, GptConfig};
use bonfire::{Hybrid, ZeroStage};
use bonfire_testkit::nets::{DpFlex, parameters};
use bonfire_testkit::{RankModels, bind_rank, in_process_ranks, run_ranks};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const VOCAB: usize = 65;
const BATCH: usize = 4;
const SEQ: usize = 64;

/// One rank's outcome.
struct Outcome {
    params: Vec<Vec<f32>>,
    /// Bytes of the parameters this rank holds (whole, except under ZeRO-3).
    param_bytes: usize,
    gradient_bytes: usize,
    optimizer_bytes: usize,
    step_ms: f64,
}

/// `Autodiff<Hybrid<Flex>>`: ZeRO-3's backend (its parameters sharded over the replicas).
type FsdpFlex = Autodiff<Hybrid<Flex>>;

/// Bytes of `record` encoded at full precision: this rank's parts (under ZeRO-3, its slices).
fn encoded<A: AutodiffBackend, R: burn::record::Record<A>>(record: R) -> usize {
    bonfire::backend::tensor_parallel::read_parts(|| {
        BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(record, ())
            .map_or(0, |b| b.len())
    })
}

/// Bytes of the parameters `model` holds on this rank.
fn held<A: AutodiffBackend, M: Module<A>>(model: &M) -> usize {
    struct Held(usize);
    impl<A: AutodiffBackend> ModuleVisitor<A> for Held {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
            self.0 += bonfire::held_bytes(&param.val());
        }
    }
    let mut h = Held(0);
    model.visit(&mut h);
    h.0
}

/// `steps` Adam steps of rank `r` on its own random windows, stepping with `optim`.
fn train<A, O>(mut model: Gpt<A>, optim: &mut O, steps: usize, r: usize) -> Outcome
where
    A: AutodiffBackend,
    O: Optimizer<Gpt<A>, A>,
{
    let device = model.devices()[0].clone();
    let mut rng = ChaCha8Rng::seed_from_u64(7 + r as u64);
    let mut times = Vec::new();
    let mut gradient_bytes = 0;
    for _ in 0..steps {
        let tokens: Vec<i64> = (0..BATCH * (SEQ + 1))
            .map(|_| rng.random_range(0..VOCAB as i64))
            .collect();
        let t = Tensor::<A, 2, Int>::from_data(TensorData::new(tokens, [BATCH, SEQ + 1]), &device);
        let started = Instant::now();
        let x = t.clone().slice([0..BATCH, 0..SEQ]);
        let y = t.slice([0..BATCH, 1..SEQ + 1]);
        let loss = model.loss(x, y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        gradient_bytes = bonfire::gradient_bytes(&model, &grads);
        model = optim.step(1e-3, model, grads);
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Outcome {
        optimizer_bytes: encoded(optim.to_record()),
        param_bytes: held(&model),
        params: parameters(&model),
        gradient_bytes,
        step_ms: times[times.len() / 2],
    }
}

/// `world` ranks as threads (one compute thread each, as a launched rank's), bound to their
/// data-parallel group, each running `f(model, rank)` on its own GPT (rank `r` seeded `1 + r`).
fn on_ranks<A, F>(world: usize, f: F) -> Vec<Outcome>
where
    A: AutodiffBackend<Device = FlexDevice>,
    F: Fn(Gpt<A>, usize) -> Outcome + Send + Sync + 'static,
{
    let models = RankModels::seeded::<A>(
        world,
        |r| 1 + r as u64,
        &FlexDevice,
        |d| GptConfig::new(VOCAB).init(d),
    );
    let comms = in_process_ranks(world, Duration::from_secs(120));
    run_ranks(comms, Duration::from_secs(1800), move |comm| {
        let r = comm.rank();
        let _compute = bonfire::compute_threads(1);
        let model = models.take(r);
        let _bind = bind_rank(comm);
        f(model, r)
    })
}

/// DDP (`stage` `None`), ZeRO-1 or ZeRO-2 on `Autodiff<DataParallel<Flex>>`.
fn run(world: usize, steps: usize, stage: Option<ZeroStage>) -> Vec<Outcome> {
    on_ranks::<DpFlex, _>(world, move |model, r| {
        let model = bonfire::replicate(model);
        let adam = AdamConfig::new();
        match stage {
            Some(stage) => train(
                model,
                &mut bonfire::sharded(adam.init::<DpFlex, Gpt<DpFlex>>()).stage(stage),
                steps,
                r,
            ),
            None => train(model, &mut adam.init::<DpFlex, Gpt<DpFlex>>(), steps, r),
        }
    })
}

/// ZeRO-3 on `Autodiff<Hybrid<Flex>>`: the parameters sharded at rest by `bonfire::fully_shard`
/// (which makes the fully sharded group from the data-parallel one).
fn run_fully_sharded(world: usize, steps: usize) -> Vec<Outcome> {
    on_ranks::<FsdpFlex, _>(world, move |model, r| {
        let model = bonfire::fully_shard(model).expect("fully_shard");
        let adam = AdamConfig::new().init::<FsdpFlex, Gpt<FsdpFlex>>();
        train(
            model,
            &mut bonfire::sharded(adam).stage(ZeroStage::Three),
            steps,
            r,
        )
    })
}

fn main() {
    let mut args = std::env::args().skip(1);
    let worlds: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "2,4".into())
        .split(',')
        .map(|w| match w.trim().parse() {
            Ok(n) if n >= 2 => n,
            _ => {
                eprintln!(
                    "bonfire-zero-state: world size {w:?}: give sizes of 2 or more, e.g. 2,4"
                );
                std::process::exit(2)
            }
        })
        .collect();
    let steps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(3).max(1);
    let elements = GptConfig::new(VOCAB)
        .init::<burn::backend::Flex>(&FlexDevice)
        .num_params();
    println!(
        "bundled GPT (vocab {VOCAB}, default shape): {elements} parameters; Adam; {steps} steps of \
         {BATCH} x {SEQ} tokens per rank"
    );
    println!(
        "world  rank  parameters DDP / ZeRO-3  gradients DDP / ZeRO-2 / ZeRO-3  optimizer DDP / \
         ZeRO-1 / ZeRO-2 / ZeRO-3  model state / DDP: ZeRO-1  ZeRO-2  ZeRO-3  step ms DDP / \
         ZeRO-1 / ZeRO-2 / ZeRO-3"
    );
    let mut failed = false;
    for world in worlds {
        // Untimed: the first steps of a process pay for allocations and page faults.
        run(world, 2, Some(ZeroStage::Two));
        let ddp = run(world, steps, None);
        let one = run(world, steps, Some(ZeroStage::One));
        let two = run(world, steps, Some(ZeroStage::Two));
        let three = run_fully_sharded(world, steps);
        let rows = ddp.iter().zip(&one).zip(&two).zip(&three).enumerate();
        for (r, (((d, z1), z2), z3)) in rows {
            let state = |o: &Outcome| o.param_bytes + o.gradient_bytes + o.optimizer_bytes;
            println!(
                "{world:>5}  {r:>4}  {:>10} / {:<7}  {:>13} / {:>6} / {:<6}  {:>13} / {:>6} / \
                 {:>6} / {:<6}  {:>24.3}  {:>6.3}  {:>6.3}  {:>11.1} / {:.1} / {:.1} / {:.1}",
                d.param_bytes,
                z3.param_bytes,
                d.gradient_bytes,
                z2.gradient_bytes,
                z3.gradient_bytes,
                d.optimizer_bytes,
                z1.optimizer_bytes,
                z2.optimizer_bytes,
                z3.optimizer_bytes,
                state(z1) as f64 / state(d) as f64,
                state(z2) as f64 / state(d) as f64,
                state(z3) as f64 / state(d) as f64,
                d.step_ms,
                z1.step_ms,
                z2.step_ms,
                z3.step_ms,
            );
        }
        let bitwise = |run: &[Outcome]| ddp.iter().zip(run).all(|(d, z)| d.params == z.params);
        let apart = |run: &[Outcome]| {
            run.iter()
                .zip(&ddp)
                .flat_map(|(z, d)| z.params.iter().flatten().zip(d.params.iter().flatten()))
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max)
        };
        let agree = |run: &[Outcome]| run.iter().all(|z| z.params == run[0].params);
        let said = |run: &[Outcome]| {
            if bitwise(run) {
                "bitwise equals DDP".to_string()
            } else {
                format!("differs from DDP by {:e} at most", apart(run))
            }
        };
        println!(
            "world {world}: after {steps} steps ZeRO-1 {}; ZeRO-2 {}; ZeRO-3 {}; the same on \
             every rank: {}",
            said(&one),
            said(&two),
            said(&three),
            agree(&two) && agree(&three),
        );
        failed |= !bitwise(&one)
            || (world == 2 && !bitwise(&two))
            || apart(&two) > 1e-6
            || apart(&three) > 1e-6
            || !agree(&two)
            || !agree(&three);
    }
    if failed {
        std::process::exit(1);
    }
}
