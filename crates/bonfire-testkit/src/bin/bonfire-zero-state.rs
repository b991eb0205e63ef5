//! What ZeRO stages 1 and 2 save: `bonfire-zero-state [WORLDS] [STEPS]` (default `2,4` and 3)
//! trains the bundled GPT (its default shape, a 65-character vocabulary) with Adam on in-process
//! ranks (threads over the in-process transport), once with the optimizer whole on every rank,
//! once under `bonfire::sharded` (stage 1) and once under `bonfire::sharded(..).stage(Two)`, and
//! prints per rank the model state it holds: parameters (f32, whole on every rank), the
//! gradients it held after its last backward (`bonfire::gradient_bytes`) and the optimizer's
//! state, measured as the bytes of its encoded record (`BinBytesRecorder`, full precision). Then
//! how the sharded runs' parameters compare with DDP's (stage 1: bit for bit; stage 2: bit for
//! bit at 2 ranks, within rounding above) and each run's median step time (the ranks share this
//! process's cores, one compute thread each, so compare the runs with each other only; an
//! untimed run at each world size goes first).

use std::time::{Duration, Instant};

use bonfire::ZeroStage;
use bonfire::models::{Gpt, GptConfig};
use bonfire_testkit::nets::{DpFlex, parameters};
use bonfire_testkit::{RankModels, bind_rank, in_process_ranks, run_ranks};
use burn::backend::flex::FlexDevice;
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const VOCAB: usize = 65;
const BATCH: usize = 4;
const SEQ: usize = 64;

/// One rank's outcome.
struct Outcome {
    params: Vec<Vec<f32>>,
    gradient_bytes: usize,
    optimizer_bytes: usize,
    step_ms: f64,
}

fn encoded<R: burn::record::Record<DpFlex>>(record: R) -> usize {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .record(record, ())
        .map_or(0, |b| b.len())
}

fn run(world: usize, steps: usize, stage: Option<ZeroStage>) -> Vec<Outcome> {
    let device = FlexDevice;
    let models = RankModels::seeded::<DpFlex>(
        world,
        |r| 1 + r as u64,
        &device,
        |d| GptConfig::new(VOCAB).init(d),
    );
    let comms = in_process_ranks(world, Duration::from_secs(120));
    run_ranks(comms, Duration::from_secs(1800), move |comm| {
        let r = comm.rank();
        // Each rank's thread computes its own ops (one thread each), as a launched rank's does.
        let _compute = bonfire::compute_threads(1);
        let model = models.take(r);
        let _bind = bind_rank(comm);
        let mut model = bonfire::replicate(model);
        let adam = AdamConfig::new();
        let mut plain = adam.init::<DpFlex, Gpt<DpFlex>>();
        let mut zero =
            bonfire::sharded(adam.init::<DpFlex, Gpt<DpFlex>>()).stage(stage.unwrap_or_default());
        let mut rng = ChaCha8Rng::seed_from_u64(7 + r as u64);
        let mut times = Vec::new();
        let mut gradient_bytes = 0;
        for _ in 0..steps {
            let tokens: Vec<i64> = (0..BATCH * (SEQ + 1))
                .map(|_| rng.random_range(0..VOCAB as i64))
                .collect();
            let t = Tensor::<DpFlex, 2, Int>::from_data(
                TensorData::new(tokens, [BATCH, SEQ + 1]),
                &device,
            );
            let started = Instant::now();
            let x = t.clone().slice([0..BATCH, 0..SEQ]);
            let y = t.slice([0..BATCH, 1..SEQ + 1]);
            let loss = model.loss(x, y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            gradient_bytes = bonfire::gradient_bytes(&model, &grads);
            model = if stage.is_some() {
                zero.step(1e-3, model, grads)
            } else {
                plain.step(1e-3, model, grads)
            };
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        let optimizer_bytes = if stage.is_some() {
            encoded(zero.inner().to_record())
        } else {
            encoded(plain.to_record())
        };
        Outcome {
            params: parameters(&model),
            gradient_bytes,
            optimizer_bytes,
            step_ms: times[times.len() / 2],
        }
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
        "world  rank  parameters  gradients DDP / ZeRO-2  optimizer DDP / ZeRO-1 / ZeRO-2  \
         model state / DDP: ZeRO-1  ZeRO-2  step ms DDP / ZeRO-1 / ZeRO-2"
    );
    let mut failed = false;
    for world in worlds {
        // Untimed: the first steps of a process pay for allocations and page faults.
        run(world, 2, Some(ZeroStage::Two));
        let ddp = run(world, steps, None);
        let one = run(world, steps, Some(ZeroStage::One));
        let two = run(world, steps, Some(ZeroStage::Two));
        let whole = 4 * elements;
        for (r, ((d, z1), z2)) in ddp.iter().zip(&one).zip(&two).enumerate() {
            let state = |o: &Outcome| whole + o.gradient_bytes + o.optimizer_bytes;
            println!(
                "{world:>5}  {r:>4}  {whole:>10}  {:>11} / {:<10}  {:>13} / {:>8} / {:<8}  \
                 {:>24.3}  {:>6.3}  {:>11.1} / {:.1} / {:.1}",
                d.gradient_bytes,
                z2.gradient_bytes,
                d.optimizer_bytes,
                z1.optimizer_bytes,
                z2.optimizer_bytes,
                state(z1) as f64 / state(d) as f64,
                state(z2) as f64 / state(d) as f64,
                d.step_ms,
                z1.step_ms,
                z2.step_ms,
            );
        }
        let bitwise = |run: &[Outcome]| ddp.iter().zip(run).all(|(d, z)| d.params == z.params);
        let apart = two
            .iter()
            .zip(&ddp)
            .flat_map(|(z, d)| z.params.iter().flatten().zip(d.params.iter().flatten()))
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let ranks_agree = two.iter().all(|z| z.params == two[0].params);
        println!(
            "world {world}: after {steps} steps ZeRO-1 {} DDP; ZeRO-2 {} (largest difference \
             {apart:e}), the same on every rank: {ranks_agree}",
            if bitwise(&one) {
                "bitwise equals"
            } else {
                "DIFFERS from"
            },
            if bitwise(&two) {
                "bitwise equals DDP"
            } else {
                "differs from DDP"
            },
        );
        failed |= !bitwise(&one) || (world == 2 && !bitwise(&two)) || apart > 1e-6 || !ranks_agree;
    }
    if failed {
        std::process::exit(1);
    }
}
