//! `DataParallel` fails loudly, on every rank, naming what went wrong: a rank with another model,
//! a rank that stops training early, a parameter that has a gradient on some ranks only.

use std::sync::{Arc, Mutex};

use std::time::{Duration, Instant};

use bonfire::backend::{DataParallelConfig, FailurePolicy, bind_thread};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire_testkit::nets::{
    DpFlex, Net, SmallCnn, SmallTransformer, random_batches, seeded, train,
};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::{Tensor, TensorData};

type Device = burn::backend::flex::FlexDevice;

fn config() -> DataParallelConfig {
    DataParallelConfig {
        failure: FailurePolicy::Panic,
        ..DataParallelConfig::default()
    }
}

/// Runs `f` on two rank threads and returns each rank's panic message (None if it finished).
fn two_ranks<F>(timeout: Duration, f: F) -> Vec<Option<String>>
where
    F: Fn(usize) + Send + Sync + 'static,
{
    two_ranks_with(timeout, |_| config(), f)
}

/// As [`two_ranks`], rank `r` bound with `dp(r)`.
fn two_ranks_with<F>(
    timeout: Duration,
    dp: fn(usize) -> DataParallelConfig,
    f: F,
) -> Vec<Option<String>>
where
    F: Fn(usize) + Send + Sync + 'static,
{
    let comms = Communicator::in_process(
        2,
        CommConfig {
            timeout,
            ..CommConfig::default()
        },
    );
    let f = Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let f = f.clone();
            std::thread::spawn(move || {
                let _bind = bind_thread(comm, dp(r));
                f(r)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join().err().map(|p| {
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            })
        })
        .collect()
}

#[test]
fn a_rank_with_another_model_fails_every_rank_naming_the_parameter() {
    let out = two_ranks(Duration::from_secs(10), |r| {
        let device = Device::default();
        if r == 0 {
            let _ = bonfire::replicate(seeded::<DpFlex, _>(1, &device, SmallCnn::new));
        } else {
            let _ = bonfire::replicate(seeded::<DpFlex, _>(2, &device, SmallTransformer::new));
        }
    });
    for (r, msg) in out.iter().enumerate() {
        let msg = msg
            .as_deref()
            .unwrap_or_else(|| panic!("rank {r} did not fail"));
        assert!(msg.contains(&format!("rank {r} of 2")), "{msg}");
        assert!(msg.contains("weight"), "names the parameter: {msg}");
        assert!(msg.contains("elements"), "{msg}");
    }
}

#[test]
fn a_rank_that_stops_early_fails_the_other_within_the_timeout() {
    let device = Device::default();
    let batches = random_batches(3, 3, 4, SmallCnn::<DpFlex>::FEATURES, 10);
    let models = Arc::new(Mutex::new(vec![
        Some(seeded::<DpFlex, _>(1, &device, SmallCnn::new)),
        Some(seeded::<DpFlex, _>(1, &device, SmallCnn::new)),
    ]));
    let start = Instant::now();
    let out = two_ranks(Duration::from_secs(3), move |r| {
        let device = Device::default();
        let model = models.lock().unwrap()[r].take().unwrap();
        let model = bonfire::replicate(model);
        // Rank 1 runs out of data after one step; rank 0 tries three.
        let steps = if r == 1 { 1 } else { 3 };
        let _ = train(model, &batches[..steps], 1, &device);
    });
    assert!(
        out[1].is_none(),
        "rank 1 finished its one step: {:?}",
        out[1]
    );
    let msg = out[0].as_deref().expect("rank 0 must fail");
    assert!(msg.contains("rank 1"), "names the rank that left: {msg}");
    assert!(msg.contains("bucket"), "names the collective: {msg}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn ranks_with_other_bucket_settings_are_named_before_anything_is_averaged() {
    let device = Device::default();
    let batches = random_batches(4, 2, 4, SmallCnn::<DpFlex>::FEATURES, 10);
    let models = Arc::new(Mutex::new(vec![
        Some(seeded::<DpFlex, _>(1, &device, SmallCnn::new)),
        Some(seeded::<DpFlex, _>(1, &device, SmallCnn::new)),
    ]));
    let caps = |r: usize| DataParallelConfig {
        bucket_cap_bytes: if r == 0 { 25 << 20 } else { 1 << 10 },
        ..config()
    };
    let out = two_ranks_with(Duration::from_secs(10), caps, move |r| {
        let device = Device::default();
        let model = models.lock().unwrap()[r].take().unwrap();
        let _ = train(bonfire::replicate(model), &batches, 1, &device);
    });
    for msg in &out {
        let msg = msg.as_deref().expect("both ranks fail");
        assert!(msg.contains("ranks [1]"), "names the rank: {msg}");
        assert!(msg.contains("bucket settings"), "{msg}");
    }
}

/// Burn's own accumulation idiom ported as PyTorch's `no_sync` reads: the first micro-batch's
/// backward under `no_sync`, its gradients summed in a `GradientsAccumulator` with the last
/// one's. Burn's autodiff drops the synchronisation marks in the first backward, so the second
/// is not averaged: the ranks' steps differ. The next backward is refused on every rank, naming
/// the fix, before a second step can be taken.
#[test]
fn no_sync_gradients_summed_outside_bonfire_are_refused_naming_the_fix() {
    use burn::optim::GradientsAccumulator;
    let out = two_ranks(Duration::from_secs(10), |r| {
        let device = Device::default();
        let model = two_heads(&device);
        let mut model = bonfire::replicate(model);
        let mut optim = SgdConfig::new().init();
        for _step in 0..2 {
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..2 {
                let x = Tensor::<DpFlex, 2>::from_data(
                    TensorData::new(vec![0.25 * (1 + r + micro) as f32; 8], [2, 4]),
                    &device,
                );
                let loss = (model.a.forward(x.clone()) + model.b.forward(x)).sum();
                let grads = if micro == 0 {
                    let _local = bonfire::no_sync();
                    loss.backward()
                } else {
                    loss.backward()
                };
                accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
            }
            model = optim.step(0.1, model, accumulator.grads());
        }
    });
    for (r, msg) in out.iter().enumerate() {
        let msg = msg
            .as_deref()
            .unwrap_or_else(|| panic!("rank {r} trained on without an error"));
        assert!(msg.contains(&format!("rank {r} of 2")), "{msg}");
        assert!(msg.contains("over 4 parameters"), "{msg}");
        assert!(msg.contains("no_sync"), "{msg}");
        assert!(
            msg.contains("bonfire::accumulate(model, loss)"),
            "names the fix: {msg}"
        );
    }
}

/// Two heads; which ones a rank uses is up to the test.
#[derive(Module, Debug)]
struct TwoHeads<B: burn::tensor::backend::Backend> {
    a: Linear<B>,
    b: Linear<B>,
}

/// The same [`TwoHeads`] on every rank (4 inputs, 2 outputs each).
fn two_heads(device: &Device) -> TwoHeads<DpFlex> {
    seeded(5, device, |d| TwoHeads {
        a: LinearConfig::new(4, 2).init(d),
        b: LinearConfig::new(4, 2).init(d),
    })
}

#[test]
fn a_parameter_used_on_one_rank_only_is_named() {
    let out = two_ranks(Duration::from_secs(10), |r| {
        let device = Device::default();
        let model = two_heads(&device);
        let model = bonfire::replicate(model);
        let x = Tensor::<DpFlex, 2>::from_data(TensorData::new(vec![0.5f32; 8], [2, 4]), &device);
        let mut y = model.a.forward(x.clone()).sum();
        if r == 0 {
            y = y + model.b.forward(x).sum();
        }
        let grads = GradientsParams::from_grads(y.backward(), &model);
        let _ = SgdConfig::new().init().step(0.1, model, grads);
    });
    for msg in &out {
        let msg = msg.as_deref().expect("both ranks fail");
        assert!(msg.contains("b.weight") || msg.contains("b.bias"), "{msg}");
        assert!(msg.contains("1 of 2 ranks"), "{msg}");
    }
}

/// Two steps of Adam on the [`TwoHeads`] model, sharded at `stage`; head `b` is used on rank 0
/// only when `b_on_rank_0_only`.
fn two_sharded_steps(r: usize, stage: bonfire::ZeroStage, b_on_rank_0_only: bool) {
    let device = Device::default();
    let model = two_heads(&device);
    let mut model = bonfire::replicate(model);
    let mut optim = bonfire::sharded(burn::optim::AdamConfig::new().init()).stage(stage);
    for step in 0..2 {
        let x = Tensor::<DpFlex, 2>::from_data(TensorData::new(vec![0.5f32; 8], [2, 4]), &device);
        let mut y = model.a.forward(x.clone()).sum();
        if r == 0 || !b_on_rank_0_only || step == 0 {
            y = y + model.b.forward(x).sum();
        }
        let grads = GradientsParams::from_grads(y.backward(), &model);
        model = optim.step(0.1, model, grads);
    }
}

#[test]
fn a_rank_at_another_zero_stage_is_named_with_the_reduce_scatter() {
    let out = two_ranks(Duration::from_secs(10), |r| {
        let stage = if r == 0 {
            bonfire::ZeroStage::Two
        } else {
            bonfire::ZeroStage::One
        };
        two_sharded_steps(r, stage, false);
    });
    let msg = out[0].as_deref().expect("rank 0 fails");
    assert!(msg.contains("reduce-scatter of gradient bucket"), "{msg}");
    assert!(msg.contains("ZeRO stage 2"), "{msg}");
    assert!(msg.contains("rank 1"), "names the other rank: {msg}");
    let msg = out[1].as_deref().expect("rank 1 fails");
    assert!(msg.contains("bucket"), "{msg}");
    assert!(msg.contains("rank 0"), "names the other rank: {msg}");
}

#[test]
fn under_zero2_a_parameter_used_on_one_rank_only_is_named() {
    let out = two_ranks(Duration::from_secs(10), |r| {
        two_sharded_steps(r, bonfire::ZeroStage::Two, true)
    });
    // Its owner sees the flags; the other rank learns from the step's all-gather.
    let named = out
        .iter()
        .flatten()
        .filter(|m| (m.contains("b.weight") || m.contains("b.bias")) && m.contains("1 of 2 ranks"))
        .count();
    assert!(named >= 1, "{out:?}");
    assert!(out.iter().all(Option::is_some), "both ranks fail: {out:?}");
}
