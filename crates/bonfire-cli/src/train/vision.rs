//! One rank of `bonfire train vision`: the bundled ResNet, Adam, cross-entropy, over
//! `Autodiff<DataParallel<B>>`. Each rank reads its own shard of the training images and of the
//! test images; rank 0 draws the progress line, writes the checkpoints, the plots and the report.

use std::path::Path;
use std::time::Instant;

use bonfire::World;
use bonfire::topology::ReduceOp;
use bonfire::{DataParallel, StepStats};
use bonfire_datasets::{ImageSet, Shard, Split, Vision};
use bonfire_models::{ResNet, ResNetConfig};
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor};
use sha2::{Digest, Sha256};

use super::Settings;
use super::checkpoint::{self, EpochRecord, State};
use super::plot::{self, Series};
use super::progress::{Progress, clock};

type Rec = BinBytesRecorder<FullPrecisionSettings>;

/// Points on the training-loss curve per epoch.
const CURVE_POINTS: usize = 20;
/// Test images evaluated at once.
const EVAL_BATCH: usize = 500;

fn comm_err(what: &str) -> impl FnOnce(bonfire::collectives::CollectiveError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// The training and test shards of this rank.
fn load_data(s: &Settings, rank: usize, world: usize) -> Result<(ImageSet, ImageSet), String> {
    let c = &s.config;
    let limit = |shard: Shard, n: Option<usize>| match n {
        Some(n) => shard.limit(n),
        None => shard,
    };
    let train_shard = limit(Shard::equal(rank, world), c.train_limit);
    let test_shard = limit(Shard::balanced(rank, world), c.test_limit);
    let sets = if c.dataset == "embedded" {
        (
            ImageSet::embedded(Split::Train, train_shard),
            ImageSet::embedded(Split::Test, test_shard),
        )
    } else {
        let set = Vision::from_key(&c.dataset)
            .ok_or_else(|| format!("unknown data set {:?}", c.dataset))?;
        (
            ImageSet::load(set, Split::Train, &s.data_dir, train_shard),
            ImageSet::load(set, Split::Test, &s.data_dir, test_shard),
        )
    };
    Ok((
        sets.0.map_err(|e| e.to_string())?,
        sets.1.map_err(|e| e.to_string())?,
    ))
}

/// A permutation of `0..n` from (seed, epoch, rank): every rank shuffles its own shard afresh each
/// epoch, the same way in a resumed run as in an uninterrupted one.
fn shuffled(n: usize, seed: u64, epoch: usize, rank: usize) -> Vec<usize> {
    let mut state = seed
        ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (rank as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    let mut next = move || {
        // SplitMix64.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// SHA-256 of every parameter's values, in module order, as little-endian f32: two runs with the
/// same digest ended with the same weights.
fn digest<B: Backend, M: Module<B>>(model: &M) -> String {
    struct Hash(Sha256);
    impl<B: Backend> ModuleVisitor<B> for Hash {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            for x in p.val().into_data().convert::<f32>().iter::<f32>() {
                self.0.update(x.to_le_bytes());
            }
        }
    }
    let mut h = Hash(Sha256::new());
    model.visit(&mut h);
    h.0.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Broadcasts rank 0's bytes to every rank.
fn broadcast_bytes(world: &World, bytes: Vec<u8>) -> Result<Vec<u8>, String> {
    let len = world
        .comm()
        .broadcast(vec![bytes.len() as i64], 0)
        .wait()
        .map_err(comm_err("sharing rank 0's model for evaluation"))?[0] as usize;
    let mut buf = bytes;
    buf.resize(len, 0);
    world
        .comm()
        .broadcast(buf, 0)
        .wait()
        .map_err(comm_err("sharing rank 0's model for evaluation"))
}

/// Trains on backend `B` (wrapped in `Autodiff<DataParallel<B>>`).
pub(crate) fn run<B: Backend>(
    world: &World,
    s: &Settings,
    device: B::Device,
) -> Result<(), String> {
    type A<B> = Autodiff<DataParallel<B>>;
    let (rank, size) = (world.rank().0 as usize, world.world_size());
    let main = rank == 0;
    let c = s.config.clone();
    let (train, test) = load_data(s, rank, size)?;
    if main {
        println!(
            "bonfire train vision: {} ({} images, {} per rank), {} test images, {size} rank(s), \
             backend {} ({} compute thread(s) per rank), batch {} per rank, Adam lr {} (x{} per \
             epoch){}",
            train.description(),
            train.len() * size,
            train.len(),
            test.split_len().min(c.test_limit.unwrap_or(usize::MAX)),
            s.backend,
            std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into()),
            c.batch,
            c.lr,
            c.lr_decay,
            if c.bf16 { ", bf16 gradients" } else { "" },
        );
    }
    <A<B> as Backend>::seed(&device, c.seed);
    let mut model: ResNet<A<B>> = ResNetConfig::new().with_width(c.width).init(&device);
    let mut optim = AdamConfig::new().init::<A<B>, ResNet<A<B>>>();
    let recorder = Rec::default();
    let mut state = State {
        config: c.clone(),
        epochs: s.epochs,
        epochs_done: 0,
        history: Vec::new(),
    };
    if s.resume {
        // Every rank reads the checkpoint; they must all have found the same one.
        let loaded = checkpoint::load(&s.checkpoint_dir);
        let mine = loaded.as_ref().map_or(-1, |l| l.state.epochs_done as i64);
        let all = world
            .comm()
            .all_gather(vec![mine])
            .wait()
            .map_err(comm_err("agreeing on the checkpoint to resume from"))?;
        let loaded = loaded?;
        if let Some(r) = all.iter().position(|&e| e != mine) {
            return Err(format!(
                "rank {r} found {} in {}, this rank epoch {mine}: every rank must see the same \
                 checkpoint directory",
                if all[r] < 0 {
                    "no readable checkpoint".to_string()
                } else {
                    format!("epoch {}", all[r])
                },
                s.checkpoint_dir.display()
            ));
        }
        let bad = |what: &str| {
            let dir = loaded.dir.display().to_string();
            let what = what.to_string();
            move |e: burn::record::RecorderError| format!("{dir}: cannot read the {what}: {e}")
        };
        model = model.load_record(recorder.load(loaded.model, &device).map_err(bad("model"))?);
        optim = optim.load_record(
            recorder
                .load(loaded.optimizer, &device)
                .map_err(bad("optimizer state"))?,
        );
        state.history = loaded.state.history;
        state.epochs_done = loaded.state.epochs_done;
        if main {
            println!(
                "resuming from {} (epoch {} of {})",
                loaded.dir.display(),
                state.epochs_done,
                s.epochs
            );
        }
    }
    let mut model = bonfire::replicate(model);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let steps = train.len().div_ceil(c.batch);
    let started = Instant::now();
    let mut trained_images = 0usize;
    let mut trained_secs = 0.0;
    for epoch in state.epochs_done..s.epochs {
        let lr = c.lr * c.lr_decay.powi(epoch as i32);
        let order = shuffled(train.len(), c.seed, epoch, rank);
        let mut progress = main.then(|| Progress::new(epoch + 1, s.epochs, steps));
        let t0 = Instant::now();
        let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0u64, 0u64);
        let (mut stretch_sum, mut stretch_n) = (0.0f64, 0usize);
        let mut curve = Vec::new();
        for (i, idx) in order.chunks(c.batch).enumerate() {
            let (x, y) = train.batch::<A<B>>(idx, &device);
            let logits = model.forward(x);
            let hits: i64 = logits
                .clone()
                .detach()
                .argmax(1)
                .flatten::<1>(0, 1)
                .equal(y.clone())
                .int()
                .sum()
                .into_scalar()
                .elem();
            let loss = loss_fn.forward(logits, y);
            let l: f64 = loss.clone().into_scalar().elem();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(lr, model, grads);
            loss_sum += l * idx.len() as f64;
            correct += hits as u64;
            seen += idx.len() as u64;
            stretch_sum += l;
            stretch_n += 1;
            if (i + 1) * CURVE_POINTS / steps != i * CURVE_POINTS / steps || i + 1 == steps {
                curve.push((
                    epoch as f64 + (i + 1) as f64 / steps as f64,
                    stretch_sum / stretch_n as f64,
                ));
                (stretch_sum, stretch_n) = (0.0, 0);
            }
            if let Some(p) = progress.as_mut() {
                let ips = (seen as usize * size) as f64 / t0.elapsed().as_secs_f64();
                p.step(
                    i + 1,
                    loss_sum / seen as f64,
                    correct as f64 / seen as f64,
                    ips,
                );
            }
        }
        let train_secs = t0.elapsed().as_secs_f64();
        trained_images += seen as usize * size;
        trained_secs += train_secs;
        let totals = world
            .comm()
            .all_reduce(vec![loss_sum, correct as f64, seen as f64], ReduceOp::Sum)
            .wait()
            .map_err(comm_err("summing the epoch's training loss"))?;

        // Evaluate rank 0's model (its batch-norm statistics) on every rank's test shard.
        let valid = model.valid();
        let mine = if main {
            recorder
                .record(valid.clone().into_record(), ())
                .map_err(|e| e.to_string())?
        } else {
            Vec::new()
        };
        let bytes = broadcast_bytes(world, mine)?;
        let valid = valid.load_record(
            recorder
                .load(bytes, &device)
                .map_err(|e| format!("rank 0's model: {e}"))?,
        );
        let (mut test_loss, mut test_correct) = (0.0f64, 0.0f64);
        let all: Vec<usize> = (0..test.len()).collect();
        let eval_loss = CrossEntropyLossConfig::new().init(&device);
        for idx in all.chunks(EVAL_BATCH) {
            let (x, y) = test.batch::<DataParallel<B>>(idx, &device);
            let logits = valid.forward(x);
            let hits: i64 = logits
                .clone()
                .argmax(1)
                .flatten::<1>(0, 1)
                .equal(y.clone())
                .int()
                .sum()
                .into_scalar()
                .elem();
            let l: f64 = eval_loss.forward(logits, y).into_scalar().elem();
            test_loss += l * idx.len() as f64;
            test_correct += hits as f64;
        }
        let t = world
            .comm()
            .all_reduce(
                vec![test_loss, test_correct, test.len() as f64],
                ReduceOp::Sum,
            )
            .wait()
            .map_err(comm_err("summing the test results"))?;
        let record = EpochRecord {
            epoch: epoch + 1,
            train_loss: totals[0] / totals[2],
            train_accuracy: totals[1] / totals[2],
            test_loss: t[0] / t[2],
            test_accuracy: t[1] / t[2],
            test_correct: t[1] as u64,
            test_images: t[2] as u64,
            images_per_second: totals[2] / train_secs,
            seconds: t0.elapsed().as_secs_f64(),
            curve,
            param_digest: digest(&model),
        };
        state.history.push(record);
        state.epochs_done = epoch + 1;
        if main {
            let r = state.history.last().expect("just pushed");
            let model_bytes = recorder
                .record(model.clone().into_record(), ())
                .map_err(|e| e.to_string())?;
            let optim_bytes = recorder
                .record(optim.to_record(), ())
                .map_err(|e| e.to_string())?;
            let dir = checkpoint::save(&s.checkpoint_dir, &state, &model_bytes, &optim_bytes)?;
            write_plots(&s.checkpoint_dir, &state).map_err(|e| {
                format!(
                    "{}: cannot write the plots: {e}",
                    s.checkpoint_dir.display()
                )
            })?;
            println!(
                "epoch {}/{}: train loss {:.4}, train accuracy {:.2}%, test loss {:.4}, test \
                 accuracy {:.2}% ({}/{}), {:.0} images/s, {} -> {}",
                r.epoch,
                s.epochs,
                r.train_loss,
                100.0 * r.train_accuracy,
                r.test_loss,
                100.0 * r.test_accuracy,
                r.test_correct,
                r.test_images,
                r.images_per_second,
                clock(std::time::Duration::from_secs_f64(r.seconds)),
                dir.display(),
            );
        }
    }
    if main {
        report(
            s,
            &state,
            size,
            trained_images,
            trained_secs,
            started,
            bonfire::total_stats(),
        );
    }
    Ok(())
}

fn write_plots(dir: &Path, state: &State) -> std::io::Result<()> {
    let curve: Vec<(f64, f64)> = state
        .history
        .iter()
        .flat_map(|r| r.curve.iter().copied())
        .collect();
    let test_loss: Vec<(f64, f64)> = state
        .history
        .iter()
        .map(|r| (r.epoch as f64, r.test_loss))
        .collect();
    let train_loss: Vec<(f64, f64)> = state
        .history
        .iter()
        .map(|r| (r.epoch as f64, r.train_loss))
        .collect();
    let blue = [31, 119, 180];
    let orange = [230, 110, 20];
    let green = [44, 160, 44];
    plot::line_plot(
        &dir.join("loss.png"),
        "Loss",
        "epoch",
        &[
            Series {
                name: "train (rank 0, running)",
                colour: [160, 190, 220],
                points: &curve,
                dots: false,
            },
            Series {
                name: "train (epoch mean)",
                colour: blue,
                points: &train_loss,
                dots: true,
            },
            Series {
                name: "test",
                colour: orange,
                points: &test_loss,
                dots: true,
            },
        ],
        None,
    )?;
    let pct = |f: fn(&EpochRecord) -> f64| -> Vec<(f64, f64)> {
        state
            .history
            .iter()
            .map(|r| (r.epoch as f64, 100.0 * f(r)))
            .collect()
    };
    let train_acc = pct(|r| r.train_accuracy);
    let test_acc = pct(|r| r.test_accuracy);
    let lo = train_acc
        .iter()
        .chain(&test_acc)
        .map(|p| p.1)
        .fold(100.0, f64::min);
    plot::line_plot(
        &dir.join("accuracy.png"),
        "Accuracy (%)",
        "epoch",
        &[
            Series {
                name: "train",
                colour: blue,
                points: &train_acc,
                dots: true,
            },
            Series {
                name: "test",
                colour: green,
                points: &test_acc,
                dots: true,
            },
        ],
        Some(((lo - 1.0).floor().max(0.0), 100.0)),
    )
}

fn report(
    s: &Settings,
    state: &State,
    size: usize,
    images: usize,
    secs: f64,
    started: Instant,
    stats: Option<StepStats>,
) {
    let Some(last) = state.history.last() else {
        return;
    };
    println!();
    println!(
        "== result ({} after {} epochs) ==",
        s.config.dataset, last.epoch
    );
    println!(
        "test accuracy   {:.2}% ({}/{} test images), test loss {:.4}",
        100.0 * last.test_accuracy,
        last.test_correct,
        last.test_images,
        last.test_loss
    );
    if images > 0 {
        println!(
            "throughput      {:.0} images/s over {size} rank(s) ({:.0} per rank); this run trained \
             for {} of {} in all",
            images as f64 / secs,
            images as f64 / secs / size as f64,
            clock(std::time::Duration::from_secs_f64(secs)),
            clock(started.elapsed()),
        );
    }
    if let Some(st) = stats.filter(|st| st.steps > 0) {
        let ms = |d: std::time::Duration| 1e3 * d.as_secs_f64() / st.steps as f64;
        let step_ms = 1e3 * secs / st.steps as f64;
        let exposed = ms(st.exposed);
        println!(
            "data parallel   {:.1} ms per step: backward {:.1} ms, communication {:.2} ms of which \
             {:.0}% hidden by backward, {:.2} ms exposed ({:.1}% of the step); {} KiB of gradients \
             per step in {} bucket(s)",
            step_ms,
            ms(st.backward),
            ms(st.communication),
            100.0 * st.hidden_fraction(),
            exposed,
            100.0 * exposed / step_ms.max(1e-9),
            st.bytes / st.steps / 1024,
            st.buckets / st.steps,
        );
        if size > 1 {
            println!(
                "scaling         compute is {:.1}% of the step (the rest waits on communication): \
                 the upper bound on this run's scaling efficiency",
                100.0 * (1.0 - exposed / step_ms.max(1e-9)).max(0.0)
            );
        }
    }
    let dir = &s.checkpoint_dir;
    println!(
        "checkpoints     {} (latest: epoch-{}); plots {} and {}",
        dir.display(),
        last.epoch,
        dir.join("loss.png").display(),
        dir.join("accuracy.png").display()
    );
    println!("weights digest  {}", last.param_digest);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffles_are_permutations_fixed_by_seed_epoch_and_rank() {
        let a = shuffled(100, 7, 0, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(a, shuffled(100, 7, 0, 0));
        assert_ne!(a, shuffled(100, 7, 1, 0));
        assert_ne!(a, shuffled(100, 7, 0, 1));
        assert_ne!(a, (0..100).collect::<Vec<_>>());
    }
}
