//! What ZeRO stage 1 saves: `bonfire-zero-state [WORLDS] [STEPS]` (default `2,4` and 3) trains the
//! bundled GPT (its default shape, a 65-character vocabulary) with Adam on in-process ranks
//! (threads over the in-process transport), once with the optimizer whole on every rank and once
//! under `bonfire::sharded`, and prints per rank the model state it holds: parameters and
//! gradients (f32, whole on every rank in both) and the optimizer's state, measured as the bytes
//! of its encoded record (`BinBytesRecorder`, full precision). Then whether the two runs ended
//! with the same parameters (they must: bit for bit) and each run's median step time (the ranks
//! share this process's cores, one compute thread each, so compare the two runs with each other
//! only; an untimed run at each world size goes first).

use std::time::{Duration, Instant};

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
    optimizer_bytes: usize,
    step_ms: f64,
}

fn encoded<R: burn::record::Record<DpFlex>>(record: R) -> usize {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .record(record, ())
        .map_or(0, |b| b.len())
}

fn run(world: usize, steps: usize, sharded: bool) -> Vec<Outcome> {
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
        let mut zero = bonfire::sharded(adam.init::<DpFlex, Gpt<DpFlex>>());
        let mut rng = ChaCha8Rng::seed_from_u64(7 + r as u64);
        let mut times = Vec::new();
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
            model = if sharded {
                zero.step(1e-3, model, grads)
            } else {
                plain.step(1e-3, model, grads)
            };
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        let optimizer_bytes = if sharded {
            encoded(zero.inner().to_record())
        } else {
            encoded(plain.to_record())
        };
        Outcome {
            params: parameters(&model),
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
        "world  rank  parameters  gradients  optimizer (DDP)  optimizer (ZeRO-1)  model state ZeRO-1 / DDP  step ms DDP / ZeRO-1"
    );
    for world in worlds {
        // Untimed: the first steps of a process pay for allocations and page faults.
        run(world, 2, true);
        let ddp = run(world, steps, false);
        let zero = run(world, steps, true);
        let same = ddp.iter().zip(&zero).all(|(d, z)| d.params == z.params);
        let whole = 4 * elements;
        for (r, (d, z)) in ddp.iter().zip(&zero).enumerate() {
            let ddp_state = 2 * whole + d.optimizer_bytes;
            let zero_state = 2 * whole + z.optimizer_bytes;
            println!(
                "{world:>5}  {r:>4}  {whole:>10}  {whole:>9}  {:>15}  {:>18}  {:>24.3}  {:>8.1} / {:.1}",
                d.optimizer_bytes,
                z.optimizer_bytes,
                zero_state as f64 / ddp_state as f64,
                d.step_ms,
                z.step_ms,
            );
        }
        println!(
            "world {world}: parameters after {steps} steps {}",
            if same {
                "bitwise equal (ZeRO-1 and DDP)"
            } else {
                "DIFFER between ZeRO-1 and DDP"
            }
        );
        if !same {
            std::process::exit(1);
        }
    }
}
