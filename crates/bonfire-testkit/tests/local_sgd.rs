//! `bonfire::local_sgd` and `bonfire::diloco` against references: ranks as threads of this
//! process, the same model and batches.
//!
//! - Local SGD that meets after every step, over plain SGD, is data parallelism: the mean of the
//!   replicas' steps is the step on the mean gradient (within rounding, 1e-6 after 20 steps).
//! - DiLoCo over Adam equals a sequential oracle: the replicas trained one after the other in one
//!   thread, their deltas averaged and the Nesterov step taken by hand.
//! - DiLoCo with outer lr 1 and momentum 0 is local SGD, bit for bit; bf16 deltas halve the bytes,
//!   int8 deltas quarter them, every replica ending with the same bits.
//! - A record saved between meetings resumes bit for bit; replicas that start apart are named.
//! - Meetings overlapped with the next inner steps equal a sequential oracle of the same
//!   algorithm (the agreed change applied late, each replica's progress since sending kept), and
//!   a record saved with a meeting in flight resumes bit for bit.

use std::time::Duration;

use bonfire::{DeltaDType, GradDType, LocalSgd, Outer};
use bonfire_testkit::nets::{
    Batch, DpFlex, Net, SmallCnn, loss, parameters, random_batches, seeded,
};
use bonfire_testkit::{RankModels, bind_rank, in_process_ranks, run_ranks};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer, SgdConfig};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

type Device = burn::backend::flex::FlexDevice;
type Net2 = SmallCnn<DpFlex>;
type Params = Vec<Vec<f32>>;
type AdamOf = burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Net2, DpFlex>;

const LR: f64 = 1e-2;

fn batches(seed: u64, steps: usize, rows: usize) -> Vec<Batch> {
    random_batches(seed, steps, rows, Net2::FEATURES, Net2::CLASSES)
}

/// One step of `optim` on this rank's slice of `batch` (its own gradients unless the model is
/// replicated).
fn step<O: Optimizer<Net2, DpFlex>>(
    model: Net2,
    optim: &mut O,
    batch: &Batch,
    rank: usize,
    world: usize,
) -> Net2 {
    let n = batch.rows() / world;
    let l = loss(&model, &batch.slice(rank * n, n), 1.0, &Device::default());
    let grads = GradientsParams::from_grads(l.backward(), &model);
    optim.step(LR, model, grads)
}

/// Every rank's parameters after training on `batches` with the optimizer `make` gives, from
/// the same seeded model (replicated first when `replicate`).
fn run<O, F>(world: usize, batches: &[Batch], replicate: bool, make: F) -> Vec<(Params, O)>
where
    O: Optimizer<Net2, DpFlex> + 'static,
    F: Fn() -> O + Send + Sync + 'static,
{
    let device = Device::default();
    let models = RankModels::new(
        (0..world)
            .map(|_| seeded::<DpFlex, _>(7, &device, SmallCnn::new))
            .collect(),
    );
    let batches = batches.to_vec();
    let comms = in_process_ranks(world, Duration::from_secs(20));
    run_ranks(comms, Duration::from_secs(300), move |comm| {
        let (r, world) = (comm.rank(), comm.size());
        let mut model = models.take(r);
        let _bind = bind_rank(comm);
        if replicate {
            model = bonfire::replicate(model);
        }
        let mut optim = make();
        for b in &batches {
            model = step(model, &mut optim, b, r, world);
        }
        (parameters(&model), optim)
    })
}

fn max_difference(a: &Params, b: &Params) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

fn assert_replicas_equal<O>(ranks: &[(Params, O)], what: &str) {
    for (r, (p, _)) in ranks.iter().enumerate() {
        assert!(
            *p == ranks[0].0,
            "{what}: rank {r}'s parameters differ from rank 0's"
        );
    }
}

#[test]
fn local_sgd_meeting_every_step_over_sgd_is_data_parallelism() {
    let b = batches(21, 20, 8);
    let ddp = run(2, &b, true, || SgdConfig::new().init::<DpFlex, Net2>());
    let local = run(2, &b, false, || {
        bonfire::local_sgd(SgdConfig::new().init::<DpFlex, Net2>(), 1)
    });
    assert_replicas_equal(&local, "local SGD");
    let diff = max_difference(&ddp[0].0, &local[0].0);
    assert!(
        diff <= 1e-6,
        "local SGD with H = 1 is {diff:e} from DDP after 20 SGD steps"
    );
    let start = parameters(&seeded::<DpFlex, _>(7, &Device::default(), SmallCnn::new));
    assert!(
        max_difference(&start, &local[0].0) > 1e-3,
        "training moved the parameters"
    );
    let stats = local[0].1.stats();
    let elements: usize = start.iter().map(Vec::len).sum();
    assert_eq!((stats.steps, stats.meetings), (20, 20));
    assert_eq!(
        stats.bytes,
        20 * 4 * elements as u64,
        "f32 deltas, 20 meetings"
    );
}

/// Writes `values` (module order) into a model's parameters.
struct Put<'a>(&'a [f32], usize);

impl<B: AutodiffBackend> ModuleMapper<B> for Put<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, t, mapper) = param.consume();
        let shape = t.shape();
        let n = shape.num_elements();
        let fresh = Tensor::from_data(
            TensorData::new(self.0[self.1..self.1 + n].to_vec(), shape),
            &t.device(),
        )
        .require_grad();
        self.1 += n;
        Param::from_mapped_value(id, fresh, mapper)
    }
}

fn flat(p: &Params) -> Vec<f32> {
    p.concat()
}

/// The largest difference between two flat parameter lists.
fn flat_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

/// DiLoCo by hand: `world` replicas, each with its own Adam, trained one after the other on this
/// thread (a group of one: `DataParallel` passes through), meeting every `h` steps with the
/// mean delta and an outer Nesterov step done here.
fn diloco_oracle(world: usize, h: usize, batches: &[Batch], lr: f32, momentum: f32) -> Vec<f32> {
    let device = Device::default();
    let comms = in_process_ranks(1, Duration::from_secs(20));
    let batches = batches.to_vec();
    let out = run_ranks(comms, Duration::from_secs(300), move |comm| {
        let _bind = bind_rank(comm);
        let start = seeded::<DpFlex, _>(7, &device, SmallCnn::new);
        let mut anchor = flat(&parameters(&start));
        let mut m = vec![0.0f32; anchor.len()];
        let mut replicas: Vec<(Net2, _)> = (0..world)
            .map(|_| (start.clone(), AdamConfig::new().init::<DpFlex, Net2>()))
            .collect();
        for window in batches.chunks(h) {
            let mut mean = vec![0.0f32; anchor.len()];
            for (r, (model, adam)) in replicas.iter_mut().enumerate() {
                let mut mdl = model.clone().map(&mut Put(&anchor, 0));
                for b in window {
                    mdl = step(mdl, adam, b, r, world);
                }
                for (s, (a, p)) in mean
                    .iter_mut()
                    .zip(anchor.iter().zip(flat(&parameters(&mdl))))
                {
                    *s += (a - p) * (1.0 / world as f32);
                }
                *model = mdl;
            }
            for ((a, d), m) in anchor.iter_mut().zip(&mean).zip(&mut m) {
                *m = momentum * *m + d;
                *a -= lr * (d + momentum * *m);
            }
        }
        anchor
    });
    out.into_iter().next().expect("one rank")
}

#[test]
fn diloco_over_adam_equals_the_sequential_oracle() {
    let b = batches(22, 9, 8);
    let diloco = run(2, &b, false, || {
        bonfire::diloco(AdamConfig::new().init::<DpFlex, Net2>(), 3)
    });
    assert_replicas_equal(&diloco, "DiLoCo");
    let oracle = diloco_oracle(2, 3, &b, 0.7, 0.9);
    let got = flat(&diloco[0].0);
    let diff = flat_difference(&got, &oracle);
    assert!(
        diff <= 1e-6,
        "DiLoCo is {diff:e} from the oracle after 3 meetings"
    );
    assert_eq!(diloco[0].1.stats().meetings, 3);
    let momentum = diloco[0]
        .1
        .outer_state()
        .momentum
        .as_ref()
        .expect("momentum");
    assert!(
        momentum.iter().any(|&m| m != 0.0),
        "the outer momentum moved"
    );
}

#[test]
fn diloco_with_lr_1_and_no_momentum_is_local_sgd_and_bf16_halves_the_bytes() {
    let b = batches(23, 6, 8);
    let adam = || AdamConfig::new().init::<DpFlex, Net2>();
    let local = run(2, &b, false, move || bonfire::local_sgd(adam(), 3));
    let plain = run(2, &b, false, move || {
        bonfire::diloco(adam(), 3).outer(Outer::Nesterov {
            lr: 1.0,
            momentum: 0.0,
        })
    });
    assert!(
        local[0].0 == plain[0].0,
        "DiLoCo (lr 1, momentum 0) differs from local SGD"
    );
    let bf16 = run(2, &b, false, move || {
        bonfire::local_sgd(adam(), 3).exchange_dtype(GradDType::Bf16)
    });
    assert_replicas_equal(&bf16, "bf16 deltas");
    let diff = max_difference(&local[0].0, &bf16[0].0);
    assert!(
        diff > 0.0 && diff < 1e-3,
        "bf16 deltas are {diff:e} from f32's"
    );
    assert_eq!(2 * bf16[0].1.stats().bytes, local[0].1.stats().bytes);
    let residual = bf16[0].1.outer_state().residual.as_ref().expect("residual");
    assert!(
        residual.iter().any(|&r| r != 0.0),
        "the rounding error is kept"
    );
}

#[test]
fn int8_deltas_send_a_quarter_of_the_bytes_and_stay_close_to_f32() {
    // Plain SGD inside, so that a parameter's difference is the rounding's, not Adam's
    // normalisation of a near-zero gradient.
    let b = batches(24, 6, 8);
    let sgd = || SgdConfig::new().init::<DpFlex, Net2>();
    let f32s = run(2, &b, false, move || bonfire::diloco(sgd(), 3));
    let int8 = run(2, &b, false, move || {
        bonfire::diloco(sgd(), 3).exchange_dtype(DeltaDType::Int8)
    });
    let bf16 = run(2, &b, false, move || {
        bonfire::diloco(sgd(), 3).exchange_dtype(DeltaDType::Bf16)
    });
    assert_replicas_equal(&int8, "int8 deltas");
    let diff = max_difference(&f32s[0].0, &int8[0].0);
    let bf16_diff = max_difference(&f32s[0].0, &bf16[0].0);
    assert!(
        diff > 0.0 && diff < 1e-4,
        "int8 deltas are {diff:e} from f32's after 2 meetings (bf16's: {bf16_diff:e})"
    );
    // n elements: n bytes and one f32 scale per 256 of each rank's half, per meeting.
    let (full, stats) = (f32s[0].1.stats(), int8[0].1.stats());
    assert_eq!(stats.meetings, 2);
    let n = (full.elements / full.meetings) as usize;
    let (first, second) = (n.div_ceil(2), n / 2);
    let per_meeting = n + 4 * (first.div_ceil(256) + second.div_ceil(256));
    assert_eq!(stats.bytes, 2 * per_meeting as u64);
    // A quarter, and the scales (4 bytes per 256 values; 2.3% at this model's 1,066 elements).
    assert!(
        4 * stats.bytes < full.bytes * 103 / 100,
        "{stats:?} against {full:?}"
    );
    // Both stages keep what they rounded away: rank 0's own delta, then the half it summed.
    let residual = int8[0].1.outer_state().residual.as_ref().expect("residual");
    assert_eq!(residual.len(), n + first);
    assert!(residual[..n].iter().any(|&r| r != 0.0));
    assert!(residual[n..].iter().any(|&r| r != 0.0));
}

/// Trains 2 ranks on `steps` batches with `make`'s optimizer, saving its record after step
/// `save_after` (0-based), checked there by `at_save`; then resumes from the record and the
/// model of that step, and asserts that the resumed run ends (after meeting) bit for bit where
/// the uninterrupted one does.
fn assert_resumes_bit_for_bit(
    seed: u64,
    steps: usize,
    save_after: usize,
    make: fn() -> LocalSgd<AdamOf>,
    at_save: fn(&LocalSgd<AdamOf>),
) {
    const WORLD: usize = 2;
    let b = batches(seed, steps, 8);
    let device = Device::default();
    let models = RankModels::new(
        (0..WORLD)
            .map(|_| seeded::<DpFlex, _>(7, &device, SmallCnn::new))
            .collect(),
    );
    let comms = in_process_ranks(WORLD, Duration::from_secs(20));
    run_ranks(comms, Duration::from_secs(300), move |comm| {
        let r = comm.rank();
        let _bind = bind_rank(comm);
        let mut optim = make();
        let mut model = models.take(r);
        let (mut saved, mut model_at_save) = (None, None);
        for (i, batch) in b.iter().enumerate() {
            model = step(model, &mut optim, batch, r, WORLD);
            if i == save_after {
                at_save(&optim);
                let rec = BinBytesRecorder::<FullPrecisionSettings>::default();
                saved = Some(
                    rec.record(Optimizer::<Net2, DpFlex>::to_record(&optim), ())
                        .unwrap(),
                );
                model_at_save = Some(model.clone());
            }
        }
        let uninterrupted = parameters(&optim.meet(model));
        let record = BinBytesRecorder::<FullPrecisionSettings>::default()
            .load::<<LocalSgd<AdamOf> as Optimizer<Net2, DpFlex>>::Record>(
                saved.expect("saved"),
                &device,
            )
            .unwrap();
        let mut resumed: LocalSgd<AdamOf> = Optimizer::<Net2, DpFlex>::load_record(make(), record);
        at_save(&resumed);
        let mut model = model_at_save.expect("saved");
        for batch in &b[save_after + 1..] {
            model = step(model, &mut resumed, batch, r, WORLD);
        }
        assert!(
            parameters(&resumed.meet(model)) == uninterrupted,
            "rank {r}: resumed after step {}, training differs",
            save_after + 1
        );
    });
}

#[test]
fn a_record_saved_between_meetings_resumes_bit_for_bit() {
    assert_resumes_bit_for_bit(
        24,
        8,
        4,
        || bonfire::diloco(AdamConfig::new().init::<DpFlex, Net2>(), 3),
        // Mid-window: two steps since the meeting after step 3.
        |optim| assert_eq!(optim.outer_state().since, 2, "steps since the last meeting"),
    );
}

/// Two ranks, rank `r` starting from the model seeded with `seed(r)`, each taking one step of
/// the optimizer `make(r)` gives: every rank must fail with a message containing `needle`.
fn both_fail<O, F>(seed: fn(u64) -> u64, make: F, needle: &'static str)
where
    O: Optimizer<Net2, DpFlex>,
    F: Fn(usize) -> O + Send + Sync + 'static,
{
    both_fail_within(1, seed, make, needle);
}

/// [`both_fail`] over `steps` steps.
fn both_fail_within<O, F>(steps: usize, seed: fn(u64) -> u64, make: F, needle: &'static str)
where
    O: Optimizer<Net2, DpFlex>,
    F: Fn(usize) -> O + Send + Sync + 'static,
{
    let device = Device::default();
    let models = RankModels::new(
        (0..2u64)
            .map(|r| seeded::<DpFlex, _>(seed(r), &device, SmallCnn::new))
            .collect(),
    );
    let b = batches(25, steps, 8);
    let comms = in_process_ranks(2, Duration::from_secs(20));
    let errors = run_ranks(comms, Duration::from_secs(120), move |comm| {
        let r = comm.rank();
        let mut model = models.take(r);
        let _bind = bind_rank(comm);
        let mut optim = make(r);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for batch in &b {
                model = step(model.clone(), &mut optim, batch, r, 2);
            }
        }))
        .err()
        .and_then(|p| p.downcast_ref::<String>().cloned())
    });
    for (r, e) in errors.iter().enumerate() {
        let e = e
            .as_deref()
            .unwrap_or_else(|| panic!("rank {r} did not fail"));
        assert!(e.contains(needle), "rank {r}: {e}");
    }
}

#[test]
fn replicas_that_start_apart_are_named() {
    both_fail(
        |r| 7 + r,
        |_| bonfire::local_sgd(AdamConfig::new().init::<DpFlex, Net2>(), 4),
        "ranks [1] start from other parameters than rank 0",
    );
}

/// The wrapper keeps the parameters free of `replicate`'s averaging marks: after it, backward
/// gives each replica its own gradients (they differ between ranks on different batches).
#[test]
fn after_a_step_backward_keeps_each_replicas_own_gradients() {
    let b = batches(26, 2, 8);
    let comms = in_process_ranks(2, Duration::from_secs(20));
    let device = Device::default();
    let models = RankModels::new(
        (0..2)
            .map(|_| seeded::<DpFlex, _>(7, &device, SmallCnn::new))
            .collect(),
    );
    let grads = run_ranks(comms, Duration::from_secs(120), move |comm| {
        let r = comm.rank();
        let _bind = bind_rank(comm);
        let model = bonfire::replicate(models.take(r));
        let mut optim = bonfire::local_sgd(AdamConfig::new().init::<DpFlex, Net2>(), 10);
        let model = step(model, &mut optim, &b[0], r, 2);
        let l = loss(&model, &b[1].slice(r * 4, 4), 1.0, &Device::default());
        let g = GradientsParams::from_grads(l.backward(), &model);
        let mut values = Grads(&g, Vec::new());
        model.visit(&mut values);
        values.1
    });
    assert!(
        grads[0] != grads[1],
        "the second backward averaged the gradients"
    );
}

/// Every parameter's gradient in `.0`, in module order.
struct Grads<'a>(&'a GradientsParams, Vec<f32>);

impl ModuleVisitor<DpFlex> for Grads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<DpFlex, D>>) {
        if let Some(g) = self
            .0
            .get::<<DpFlex as AutodiffBackend>::InnerBackend, D>(param.id)
        {
            self.1
                .extend(g.into_data().convert::<f32>().to_vec::<f32>().unwrap());
        }
    }
}

/// `broadcast_parameters` gives every rank rank 0's values and ids, and marks nothing for
/// gradient averaging (a backward after it keeps each rank's own gradients).
#[test]
fn broadcast_parameters_copies_rank_0_and_marks_nothing() {
    let device = Device::default();
    let models = RankModels::new(
        (0..2u64)
            .map(|r| seeded::<DpFlex, _>(30 + r, &device, SmallCnn::new))
            .collect(),
    );
    let b = batches(27, 1, 8);
    let comms = in_process_ranks(2, Duration::from_secs(20));
    let out = run_ranks(comms, Duration::from_secs(120), move |comm| {
        let r = comm.rank();
        let _bind = bind_rank(comm);
        let model = bonfire::broadcast_parameters(models.take(r));
        struct Ids(Vec<String>, bool);
        impl ModuleVisitor<DpFlex> for Ids {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<DpFlex, D>>) {
                self.0.push(p.id.serialize());
                self.1 |= p.val().is_distributed();
            }
        }
        let mut ids = Ids(Vec::new(), false);
        model.visit(&mut ids);
        let l = loss(&model, &b[0].slice(r * 4, 4), 1.0, &Device::default());
        let g = GradientsParams::from_grads(l.backward(), &model);
        let mut grads = Grads(&g, Vec::new());
        model.visit(&mut grads);
        (parameters(&model), ids.0, ids.1, grads.1)
    });
    let rank0 = parameters(&seeded::<DpFlex, _>(30, &device, SmallCnn::new));
    assert!(
        out[0].0 == rank0 && out[1].0 == rank0,
        "rank 0's values on both"
    );
    assert_eq!(out[0].1, out[1].1, "rank 0's ids on both");
    assert!(
        !out[0].2 && !out[1].2,
        "no parameter is marked for averaging"
    );
    assert!(out[0].3 != out[1].3, "each rank keeps its own gradients");
}

/// A rank that loaded outer state of another model's size fails every rank at the first
/// meeting, naming it, instead of leaving the others in the all-reduce until the timeout.
#[test]
fn outer_state_of_another_size_is_named_on_every_rank() {
    both_fail(
        |_| 7,
        |r| {
            let optim = bonfire::diloco(AdamConfig::new().init::<DpFlex, Net2>(), 1);
            if r == 0 {
                return optim;
            }
            optim.with_outer_state(bonfire::OuterState {
                momentum: Some(vec![0.0; 3]),
                ..bonfire::OuterState::default()
            })
        },
        "ranks [1] hold models or outer state of other sizes than rank 0's model",
    );
}

#[test]
fn deltas_in_another_dtype_are_named_on_every_rank() {
    both_fail(
        |_| 7,
        |r| {
            let dtype = if r == 0 {
                DeltaDType::Int8
            } else {
                DeltaDType::Bf16
            };
            bonfire::local_sgd(AdamConfig::new().init::<DpFlex, Net2>(), 1).exchange_dtype(dtype)
        },
        "ranks [1] send their deltas in another dtype than rank 0 at meeting 1 (by rank: \
         [\"int8\", \"bf16\"])",
    );
}

/// The outer step from the last meeting's parameters by the mean delta.
type OuterStep<'a> = dyn FnMut(&[f32], &[f32]) -> Vec<f32> + 'a;

/// Overlapped DiLoCo by hand, as [`diloco_oracle`]: every `h` steps each replica's delta is
/// taken and it trains on; `d` steps later the outer step lands on the last meeting's
/// parameters and each replica keeps what it learnt since. At the end the replicas meet (the
/// meeting in flight lands, then the steps since it are exchanged at once).
fn overlapped_oracle(h: usize, d: usize, batches: &[Batch], lr: f32, momentum: f32) -> Vec<f32> {
    const WORLD: usize = 2;
    let device = Device::default();
    let comms = in_process_ranks(1, Duration::from_secs(20));
    let batches = batches.to_vec();
    let out = run_ranks(comms, Duration::from_secs(300), move |comm| {
        let _bind = bind_rank(comm);
        let start = seeded::<DpFlex, _>(7, &device, SmallCnn::new);
        let mut anchor = flat(&parameters(&start));
        let mut m = vec![0.0f32; anchor.len()];
        let mut outer = |anchor: &[f32], mean: &[f32]| -> Vec<f32> {
            anchor
                .iter()
                .zip(mean)
                .zip(m.iter_mut())
                .map(|((a, d), m)| {
                    *m = momentum * *m + d;
                    a - lr * (d + momentum * *m)
                })
                .collect()
        };
        let mean_of = |anchor: &[f32], sent: &[Vec<f32>]| -> Vec<f32> {
            let mut mean = vec![0.0f32; anchor.len()];
            for s in sent {
                for (x, (a, p)) in mean.iter_mut().zip(anchor.iter().zip(s)) {
                    *x += (a - p) * (1.0 / WORLD as f32);
                }
            }
            mean
        };
        let mut replicas: Vec<(Net2, _)> = (0..WORLD)
            .map(|_| (start.clone(), AdamConfig::new().init::<DpFlex, Net2>()))
            .collect();
        // (parameters when sent, by replica; steps since)
        let mut flight: Option<(Vec<Vec<f32>>, usize)> = None;
        let mut since = 0;
        let land = |anchor: &mut Vec<f32>,
                    replicas: &mut Vec<(Net2, _)>,
                    sent: Vec<Vec<f32>>,
                    outer: &mut OuterStep| {
            let agreed = outer(anchor, &mean_of(anchor, &sent));
            for ((model, _), s) in replicas.iter_mut().zip(&sent) {
                let now = flat(&parameters(model));
                let fresh: Vec<f32> = agreed
                    .iter()
                    .zip(now.iter().zip(s))
                    .map(|(a, (p, s))| a + (p - s))
                    .collect();
                *model = model.clone().map(&mut Put(&fresh, 0));
            }
            *anchor = agreed;
        };
        for b in &batches {
            for (r, (model, adam)) in replicas.iter_mut().enumerate() {
                *model = step(model.clone(), adam, b, r, WORLD);
            }
            since += 1;
            if let Some((sent, after)) = &mut flight {
                *after += 1;
                if *after == d {
                    let sent = std::mem::take(sent);
                    flight = None;
                    land(&mut anchor, &mut replicas, sent, &mut outer);
                }
            }
            if since == h {
                let sent = replicas.iter().map(|(m, _)| flat(&parameters(m))).collect();
                flight = Some((sent, 0));
                since = 0;
            }
        }
        if let Some((sent, _)) = flight.take() {
            land(&mut anchor, &mut replicas, sent, &mut outer);
        }
        if since > 0 {
            let sent: Vec<Vec<f32>> = replicas.iter().map(|(m, _)| flat(&parameters(m))).collect();
            anchor = outer(&anchor, &mean_of(&anchor, &sent));
        }
        anchor
    });
    out.into_iter().next().expect("one rank")
}

/// Every rank's parameters and optimizer after training on `batches` with `make`'s optimizer
/// and meeting at the end.
fn run_and_meet<F>(batches: &[Batch], make: F) -> Vec<(Params, LocalSgd<AdamOf>)>
where
    F: Fn() -> LocalSgd<AdamOf> + Send + Sync + 'static,
{
    const WORLD: usize = 2;
    let device = Device::default();
    let models = RankModels::new(
        (0..WORLD)
            .map(|_| seeded::<DpFlex, _>(7, &device, SmallCnn::new))
            .collect(),
    );
    let batches = batches.to_vec();
    let comms = in_process_ranks(WORLD, Duration::from_secs(20));
    run_ranks(comms, Duration::from_secs(300), move |comm| {
        let r = comm.rank();
        let mut model = models.take(r);
        let _bind = bind_rank(comm);
        let mut optim = make();
        for b in &batches {
            model = step(model, &mut optim, b, r, WORLD);
        }
        model = optim.meet(model);
        (parameters(&model), optim)
    })
}

#[test]
fn overlapped_diloco_equals_the_sequential_oracle_of_late_meetings() {
    // Meetings sent after steps 3, 6 and 9 land 2 steps later (the third at the final meeting,
    // which then exchanges step 10's change at once).
    let b = batches(27, 10, 8);
    let overlapped = run_and_meet(&b, || {
        bonfire::diloco(AdamConfig::new().init::<DpFlex, Net2>(), 3).overlap(2)
    });
    assert_replicas_equal(&overlapped, "overlapped DiLoCo after meeting");
    let oracle = overlapped_oracle(3, 2, &b, 0.7, 0.9);
    let got = flat(&overlapped[0].0);
    let diff = flat_difference(&got, &oracle);
    assert!(
        diff <= 1e-6,
        "overlapped DiLoCo is {diff:e} from the oracle of late meetings"
    );
    let stats = overlapped[0].1.stats();
    assert_eq!(
        stats.meetings, 4,
        "three overlapped meetings and the final one"
    );
    assert!(
        stats.behind > Duration::ZERO,
        "exchanges ran behind the steps"
    );
    // Late meetings are another algorithm than meetings on time: the oracle of meetings on
    // time differs by more than rounding, so the comparison above can fail.
    let on_time = diloco_oracle(2, 3, &b, 0.7, 0.9);
    let apart = flat_difference(&got, &on_time);
    assert!(
        apart > 1e-4,
        "late meetings differ from meetings on time ({apart:e})"
    );
}

#[test]
fn overlap_of_int8_local_sgd_keeps_every_replica_equal_after_meeting() {
    let b = batches(28, 7, 8);
    let out = run_and_meet(&b, || {
        bonfire::local_sgd(AdamConfig::new().init::<DpFlex, Net2>(), 3)
            .exchange_dtype(DeltaDType::Int8)
            .overlap(1)
    });
    assert_replicas_equal(&out, "overlapped int8 local SGD after meeting");
    let stats = out[0].1.stats();
    assert_eq!(stats.meetings, 3);
    assert!(
        out[0].1.in_flight().is_none(),
        "meet lands the meeting in flight"
    );
}

#[test]
fn a_record_saved_with_a_meeting_in_flight_resumes_bit_for_bit() {
    assert_resumes_bit_for_bit(
        29,
        12,
        6,
        || {
            bonfire::diloco(AdamConfig::new().init::<DpFlex, Net2>(), 3)
                .exchange_dtype(DeltaDType::Bf16)
                .overlap(2)
        },
        // The second meeting, sent after step 6, is one step behind; the first one's rounding
        // error and momentum are held.
        |optim| {
            assert_eq!(optim.in_flight().map(|f| f.after), Some(1));
            let s = optim.outer_state();
            assert!(
                s.residual.is_some() && s.momentum.is_some(),
                "{:?}",
                s.meetings
            );
            assert_eq!(s.meetings, 1);
        },
    );
}

#[test]
fn meetings_overlapped_by_other_steps_are_named_on_every_rank() {
    both_fail_within(
        2,
        |_| 7,
        |r| bonfire::local_sgd(AdamConfig::new().init::<DpFlex, Net2>(), 2).overlap(r),
        "ranks [1] overlap their meetings with another number of steps than rank 0 at meeting 1 \
         (by rank: [0, 1])",
    );
}
