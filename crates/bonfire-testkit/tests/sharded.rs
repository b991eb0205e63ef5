//! `bonfire::sharded` (ZeRO stages 1 and 2) against plain data parallelism: ranks as threads of
//! this process, the same model, batches and Adam. At stage 1 the parameters after every step
//! must be bitwise DDP's on every rank (the owner computes exactly the update every rank would);
//! at stage 2 too at 2 ranks, and within rounding above (the reduce-scatter adds the ranks'
//! gradients in another order than the all-reduce), bitwise equal across ranks. Each rank's
//! optimizer must hold state only for its share of the parameters, and at stage 2 each rank must
//! come out of backward holding only its share of the gradients.

use std::collections::BTreeMap;
use std::time::Duration;

use bonfire::ZeroStage;
use bonfire_testkit::nets::{
    Batch, DpFlex, Net, SmallCnn, SmallTransformer, loss, parameters, random_batches, seeded,
};
use bonfire_testkit::{RankModels, bind_rank, in_process_ranks, run_ranks};
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};

type Device = burn::backend::flex::FlexDevice;
type Params = Vec<Vec<f32>>;

const STEPS: usize = 4;

/// What one rank ended with.
struct Rank {
    params: Params,
    /// Parameters the optimizer holds state for.
    states: usize,
    /// Elements this rank owns, of the model's (sharded runs only).
    owned: Option<(usize, usize)>,
    /// Bytes of gradient held after each backward.
    held: Vec<usize>,
}

fn train<M>(
    world: usize,
    make: fn(&Device) -> M,
    batches: &[Batch],
    stage: Option<ZeroStage>,
) -> Vec<Rank>
where
    M: Net<DpFlex> + AutodiffModule<DpFlex> + 'static,
{
    let device = Device::default();
    let models = RankModels::seeded::<DpFlex>(world, |r| 1 + 1000 * r as u64, &device, make);
    let batches = batches.to_vec();
    let comms = in_process_ranks(world, Duration::from_secs(20));
    run_ranks(comms, Duration::from_secs(300), move |comm| {
        let r = comm.rank();
        let device = Device::default();
        let model = models.take(r);
        let _bind = bind_rank(comm);
        let mut model = bonfire::replicate(model);
        let adam = AdamConfig::new()
            .with_weight_decay(Some(burn::optim::decay::WeightDecayConfig::new(0.01)));
        let mut plain = adam.init::<DpFlex, M>();
        let mut zero = bonfire::sharded(adam.init::<DpFlex, M>()).stage(stage.unwrap_or_default());
        let mut held = Vec::new();
        for batch in &batches {
            let n = batch.rows() / world;
            let l = loss(&model, &batch.slice(r * n, n), 1.0, &device);
            let grads = GradientsParams::from_grads(l.backward(), &model);
            held.push(bonfire::gradient_bytes(&model, &grads));
            model = if stage.is_some() {
                zero.step(1e-2, model, grads)
            } else {
                plain.step(1e-2, model, grads)
            };
        }
        let (states, owned) = if stage.is_some() {
            (
                Optimizer::<M, DpFlex>::to_record(&zero).len(),
                zero.owned_elements(),
            )
        } else {
            (Optimizer::<M, DpFlex>::to_record(&plain).len(), None)
        };
        Rank {
            params: parameters(&model),
            states,
            owned,
            held,
        }
    })
}

/// The largest difference between two models' parameters.
fn max_difference(a: &Params, b: &Params) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

fn check<M>(world: usize, make: fn(&Device) -> M, batches: &[Batch], what: &str, stage: ZeroStage)
where
    M: Net<DpFlex> + AutodiffModule<DpFlex> + 'static,
{
    let ddp = train(world, make, batches, None);
    let zero = train(world, make, batches, Some(stage));
    let tensors = ddp[0].params.len();
    let elements: usize = ddp[0].params.iter().map(Vec::len).sum();
    for (r, (d, z)) in ddp.iter().zip(&zero).enumerate() {
        if stage == ZeroStage::One || world == 2 {
            assert!(
                d.params == z.params,
                "{what}: rank {r}'s parameters differ from DDP's after {STEPS} Adam steps"
            );
        } else {
            let diff = max_difference(&d.params, &z.params);
            assert!(
                diff <= 1e-6,
                "{what}: rank {r}'s parameters are {diff:e} from DDP's after {STEPS} Adam steps"
            );
            assert!(
                z.params == zero[0].params,
                "{what}: rank {r}'s parameters differ from rank 0's"
            );
        }
        assert_eq!(
            d.states, tensors,
            "{what}: DDP's Adam keeps state for every parameter"
        );
        assert!(
            d.held.iter().all(|&h| h == 4 * elements),
            "{what}: DDP's rank {r} holds every gradient ({:?} bytes)",
            d.held
        );
    }
    let initial = parameters(&seeded::<DpFlex, _>(1, &Device::default(), make));
    assert!(
        ddp[0].params != initial,
        "{what}: training moved the parameters"
    );
    // Every parameter has exactly one owner, which alone keeps its Adam state.
    let states: usize = zero.iter().map(|z| z.states).sum();
    assert_eq!(states, tensors, "{what}: optimizer states over the ranks");
    eprintln!(
        "{what}: states per rank {:?}, elements {elements}, tensors {tensors}",
        zero.iter().map(|z| (z.states, z.owned)).collect::<Vec<_>>()
    );
    let owned: Vec<usize> = zero
        .iter()
        .map(|z| {
            let (mine, all) = z.owned.expect("planned");
            assert_eq!(all, elements, "{what}");
            mine
        })
        .collect();
    assert_eq!(owned.iter().sum::<usize>(), elements, "{what}: {owned:?}");
    // Gradients: whole at stage 1; at stage 2 whole in the first backward (before the first
    // step gives owners), then exactly the owned ones.
    for (r, z) in zero.iter().enumerate() {
        let expect: Vec<usize> = (0..STEPS)
            .map(|s| match stage {
                ZeroStage::Two if s > 0 => 4 * owned[r],
                _ => 4 * elements,
            })
            .collect();
        assert_eq!(z.held, expect, "{what}: rank {r}'s gradient bytes per step");
    }
    // Balanced: no rank owns more than its share plus the largest tensor.
    let largest = ddp[0].params.iter().map(Vec::len).max().unwrap_or(0);
    for (r, &n) in owned.iter().enumerate() {
        assert!(
            n <= elements / world + largest,
            "{what}: rank {r} owns {n} of {elements} elements ({owned:?})"
        );
        assert!(
            zero[r].states > 0,
            "{what}: rank {r} owns nothing ({owned:?})"
        );
    }
}

/// [`check`] on the CNN at 2 ranks, batches drawn from `seed`.
fn cnn(seed: u64, what: &str, stage: ZeroStage) {
    let (features, classes) = (SmallCnn::<DpFlex>::FEATURES, SmallCnn::<DpFlex>::CLASSES);
    let batches = random_batches(seed, STEPS, 8, features, classes);
    check(2, SmallCnn::new, &batches, what, stage);
}

/// [`check`] on the transformer at 3 ranks, batches drawn from `seed`.
fn transformer(seed: u64, what: &str, stage: ZeroStage) {
    let (features, classes) = (
        SmallTransformer::<DpFlex>::FEATURES,
        SmallTransformer::<DpFlex>::CLASSES,
    );
    let batches = random_batches(seed, STEPS, 6, features, classes);
    check(3, SmallTransformer::new, &batches, what, stage);
}

#[test]
fn sharded_adam_on_two_ranks_equals_ddp_bit_for_bit() {
    cnn(11, "cnn, 2 ranks", ZeroStage::One);
}

#[test]
fn sharded_adam_on_three_ranks_equals_ddp_for_a_transformer() {
    transformer(12, "transformer, 3 ranks", ZeroStage::One);
}

#[test]
fn zero2_on_two_ranks_equals_ddp_bit_for_bit_and_holds_half_the_gradients() {
    cnn(14, "cnn, 2 ranks, ZeRO-2", ZeroStage::Two);
}

#[test]
fn zero2_on_three_ranks_matches_ddp_for_a_transformer() {
    transformer(15, "transformer, 3 ranks, ZeRO-2", ZeroStage::Two);
}

/// One data-parallel step of `optim` on this rank's slice of `batch`.
fn step<M, O>(model: M, optim: &mut O, batch: &Batch, rank: usize, world: usize) -> M
where
    M: Net<DpFlex> + AutodiffModule<DpFlex>,
    O: Optimizer<M, DpFlex>,
{
    let n = batch.rows() / world;
    let l = loss(&model, &batch.slice(rank * n, n), 1.0, &Device::default());
    let grads = GradientsParams::from_grads(l.backward(), &model);
    optim.step(1e-2, model, grads)
}

/// Each parameter's optimizer state, encoded, by parameter id.
fn encoded<T: Record<DpFlex>>(
    record: impl IntoIterator<Item = (burn::module::ParamId, T)>,
) -> BTreeMap<String, Vec<u8>> {
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    record
        .into_iter()
        .map(|(id, r)| (id.serialize(), recorder.record(r, ()).unwrap()))
        .collect()
}

/// The consolidated record of a sharded Adam is the unwrapped Adam's, entry for entry; loaded
/// into a fresh sharded optimizer it keeps this rank's share and trains on bit for bit as the
/// uninterrupted run.
#[test]
fn a_consolidated_record_is_ddps_and_resumes_bit_for_bit() {
    const WORLD: usize = 2;
    let batches = random_batches(
        13,
        STEPS,
        8,
        SmallCnn::<DpFlex>::FEATURES,
        SmallCnn::<DpFlex>::CLASSES,
    );
    let comms = in_process_ranks(WORLD, Duration::from_secs(20));
    let shares = run_ranks(comms, Duration::from_secs(300), move |comm| {
        let r = comm.rank();
        let device = Device::default();
        let model = seeded::<DpFlex, _>(1 + 1000 * r as u64, &device, SmallCnn::new);
        let _bind = bind_rank(comm);
        let start = bonfire::replicate(model);
        let adam = AdamConfig::new();
        let half = STEPS / 2;

        let mut plain = adam.init::<DpFlex, SmallCnn<DpFlex>>();
        let mut model = start.clone();
        let mut plain_half = BTreeMap::new();
        for (i, b) in batches.iter().enumerate() {
            model = step(model, &mut plain, b, r, WORLD);
            if i + 1 == half {
                plain_half = encoded(plain.to_record());
            }
        }
        let uninterrupted = parameters(&model);

        let mut zero = bonfire::sharded(adam.init::<DpFlex, SmallCnn<DpFlex>>());
        // Replicated again: `start` shares its tensors with the model the first run trained,
        // whose first backward consumed their marks for gradient averaging.
        let mut model = bonfire::replicate(start);
        for b in &batches[..half] {
            model = step(model, &mut zero, b, r, WORLD);
        }
        let own = zero.inner().to_record().len();
        assert!(own < plain_half.len(), "rank {r} holds every state");
        let got = encoded(zero.consolidated_record(&device));
        assert!(
            got == plain_half,
            "rank {r}: the consolidated record differs from the unwrapped Adam's"
        );
        let mut resumed = bonfire::sharded(adam.init::<DpFlex, SmallCnn<DpFlex>>())
            .load_consolidated_record(zero.consolidated_record(&device), &model);
        assert_eq!(
            resumed.inner().to_record().len(),
            own,
            "rank {r} kept another share"
        );
        for b in &batches[half..] {
            model = step(model, &mut resumed, b, r, WORLD);
        }
        assert!(
            parameters(&model) == uninterrupted,
            "rank {r}: resumed from the consolidated record, training differs"
        );
        own
    });
    assert_eq!(
        shares.iter().sum::<usize>(),
        6,
        "every parameter's state on one rank: {shares:?}"
    );
}
