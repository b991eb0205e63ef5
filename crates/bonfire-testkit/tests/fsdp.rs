//! `bonfire::fully_shard` (ZeRO stage 3) against plain data parallelism: ranks as threads of
//! this process, the same model, batches and Adam (unwrapped). After every step the parameters
//! must equal DDP's (within 1e-6, and equal on every rank), and between steps each rank must hold
//! only its shard of every parameter it could split, of its gradient and of Adam's state; the
//! gathers a step makes are counted.

use std::time::Duration;

use bonfire::backend::tensor_parallel::{self, TpStats, fsdp, local_part};
use bonfire::collectives::Communicator;
use bonfire::{Hybrid, InOrder, ZeroStage, fully_shard};
use bonfire_testkit::nets::{
    Batch, DpFlex, Net, SmallCnn, SmallMlp, SmallTransformer, loss, max_abs_diff, parameters,
    random_batches, seeded,
};
use bonfire_testkit::{bind_rank, in_process_ranks, run_ranks};
use burn::backend::Autodiff;
use burn::backend::flex::Flex;
use burn::module::ParamId;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::Adam;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::Tensor;
use std::collections::HashMap;

type Device = burn::backend::flex::FlexDevice;
type FsdpFlex = Autodiff<Hybrid<Flex>>;
type Params = Vec<Vec<f32>>;

const STEPS: usize = 5;
const TOLERANCE: f32 = 1e-6;

/// Ranks over the in-process transport, each collective timing out after 30 s.
fn ranks(world: usize) -> Vec<Communicator> {
    in_process_ranks(world, Duration::from_secs(30))
}

fn adam() -> AdamConfig {
    AdamConfig::new().with_weight_decay(Some(burn::optim::decay::WeightDecayConfig::new(0.01)))
}

/// DDP: each rank's model from its own seed, replicated from rank 0, `STEPS` Adam steps on its
/// share of each batch.
fn ddp<M>(world: usize, make: fn(&Device) -> M, batches: &[Batch]) -> Vec<Params>
where
    M: Net<DpFlex> + AutodiffModule<DpFlex> + 'static,
{
    let batches = batches.to_vec();
    run_ranks(ranks(world), Duration::from_secs(300), move |comm| {
        let (r, device) = (comm.rank(), Device::default());
        let _dp = bind_rank(comm);
        let mut model = bonfire::replicate(seeded::<DpFlex, _>(1 + r as u64, &device, make));
        let mut optim = adam().init::<DpFlex, M>();
        for batch in &batches {
            let l = loss(&model, &batch.share(r, world), 1.0, &device);
            let grads = GradientsParams::from_grads(l.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        parameters(&model)
    })
}

/// What one fully sharded rank ended with.
struct Rank {
    params: Params,
    /// Elements of the model, and of this rank's parts of its parameters.
    elements: usize,
    held: usize,
    /// Bytes of gradient this rank held after each backward.
    grads: Vec<usize>,
    /// Elements of Adam's moments: this rank's parts, and the whole tensors'.
    state: usize,
    whole_state: usize,
    /// Gathers the optimizer's steps made.
    step_gathers: u64,
    /// What the last step communicated over the fully sharded group.
    last_step: TpStats,
    /// What the last backward's gradient synchronisation sent and received.
    sync: bonfire::StepStats,
}

type AdamRecord = HashMap<ParamId, AdaptorRecord<Adam, FsdpFlex>>;

/// Elements of Adam's two moments in `record`, this rank's parts and whole, over `model`'s
/// parameters.
fn adam_elements<M: Module<FsdpFlex>>(
    model: &M,
    record: impl IntoIterator<Item = (ParamId, AdaptorRecord<Adam, FsdpFlex>)>,
) -> (usize, usize) {
    struct Count(AdamRecord, usize, usize);
    impl ModuleVisitor<FsdpFlex> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<FsdpFlex, D>>) {
            let state = self
                .0
                .remove(&param.id)
                .expect("Adam has state for every parameter");
            let m = state.into_state::<D>().momentum;
            for t in [m.moment_1, m.moment_2] {
                self.1 += local_part(t.clone()).shape().num_elements();
                self.2 += t.shape().num_elements();
            }
        }
    }
    let mut count = Count(record.into_iter().collect(), 0, 0);
    model.visit(&mut count);
    (count.1, count.2)
}

/// Elements of `model`'s parameters, whole and this rank's part of them.
fn elements<M: Module<FsdpFlex>>(model: &M) -> (usize, usize) {
    struct Count(usize, usize);
    impl ModuleVisitor<FsdpFlex> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<FsdpFlex, D>>) {
            self.0 += param.val().shape().num_elements();
            self.1 += local_part(param.val()).shape().num_elements();
        }
    }
    let mut count = Count(0, 0);
    model.visit(&mut count);
    (count.0, count.1)
}

/// `world` ranks as threads, each bound to a data-parallel group and a fully sharded group over
/// the same ranks, running `f(rank)`.
fn on_ranks<R, F>(world: usize, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(usize) -> R + Send + Sync + 'static,
{
    run_ranks(ranks(world), Duration::from_secs(300), move |world_comm| {
        // Two communicators over the same ranks: gradient buckets and parameter gathers
        // never share a sequence.
        let dp = world_comm
            .split(Some(0), 0)
            .expect("split")
            .expect("member");
        let shards = world_comm
            .split(Some(0), 0)
            .expect("split")
            .expect("member");
        let _dp = bind_rank(dp);
        let _fsdp = fsdp::bind_thread(shards).expect("bind the fully sharded group");
        f(world_comm.rank())
    })
}

fn fully_sharded<M>(world: usize, make: fn(&Device) -> M, batches: &[Batch]) -> Vec<Rank>
where
    M: Net<FsdpFlex> + AutodiffModule<FsdpFlex> + 'static,
{
    let batches = batches.to_vec();
    on_ranks(world, move |r| {
        let device = Device::default();
        let model = seeded::<FsdpFlex, _>(1 + r as u64, &device, make);
        let mut model = fully_shard(model).expect("fully_shard");
        let mut optim = adam().init::<FsdpFlex, M>();
        let mut grads_held = Vec::new();
        let mut last_step = TpStats::default();
        let mut step_gathers = 0;
        let mut sync = bonfire::StepStats::default();
        for batch in &batches {
            let before = tensor_parallel::stats().expect("stats");
            let l = loss(&model, &batch.share(r, world), 1.0, &device);
            let grads = GradientsParams::from_grads(l.backward(), &model);
            sync = bonfire::last_step_stats().expect("a bound data-parallel rank");
            grads_held.push(bonfire::gradient_bytes(&model, &grads));
            let stepping = tensor_parallel::stats().expect("stats");
            model = optim.step(1e-2, model, grads);
            let after = tensor_parallel::stats().expect("stats");
            step_gathers += after.since(&stepping).gathers;
            last_step = after.since(&before);
        }
        let (elements, held) = elements(&model);
        let (state, whole_state) = adam_elements(&model, optim.to_record());
        Rank {
            params: parameters(&model),
            elements,
            held,
            grads: grads_held,
            state,
            whole_state,
            step_gathers,
            last_step,
            sync,
        }
    })
}

/// `make` and `make_sharded` build the same model on the two backends, which has `linears`
/// linear layers.
fn check<M, S>(
    world: usize,
    make: fn(&Device) -> M,
    make_sharded: fn(&Device) -> S,
    batches: &[Batch],
    (what, linears): (&str, u64),
) where
    M: Net<DpFlex> + AutodiffModule<DpFlex> + 'static,
    S: Net<FsdpFlex> + AutodiffModule<FsdpFlex> + 'static,
{
    let reference = ddp(world, make, batches);
    let sharded = fully_sharded(world, make_sharded, batches);
    let initial = parameters(&seeded::<DpFlex, _>(1, &Device::default(), make));
    assert!(
        reference[0] != initial,
        "{what}: training moved the parameters"
    );
    for (r, rank) in sharded.iter().enumerate() {
        let diff = max_abs_diff(&rank.params, &reference[r]);
        let diff: f32 = diff;
        assert!(
            diff <= TOLERANCE,
            "{what}: rank {r}'s parameters are {diff:e} from DDP's after {STEPS} Adam steps"
        );
        assert!(
            rank.params == sharded[0].params,
            "{what}: rank {r}'s parameters differ from rank 0's"
        );
        // Every parameter the ranks divide is held as a 1/world slice; its gradient too.
        let expected: usize = split_elements(make_sharded, world);
        assert_eq!(rank.held, expected, "{what}: rank {r}'s parameter elements");
        assert!(
            rank.grads.iter().all(|&g| g == 4 * expected),
            "{what}: rank {r} holds {:?} bytes of gradient after backward, not its shards' {}",
            rank.grads,
            4 * expected
        );
        // Adam's two moments are held in slices as their parameters are.
        assert_eq!(
            (rank.state, rank.whole_state),
            (2 * expected, 2 * rank.elements),
            "{what}: rank {r}'s Adam moments (elements held, whole)"
        );
        assert_eq!(
            rank.step_gathers, 0,
            "{what}: rank {r}'s optimizer steps gathered a tensor"
        );
        // Gradients are reduce-scattered: the rank sends every gradient (f32) and one presence
        // flag per parameter, and receives back its slice of each split gradient, the whole of
        // the others and every flag.
        let tensors = float_params(make_sharded);
        assert_eq!(
            (rank.sync.bytes, rank.sync.received),
            (
                4 * (rank.elements + tensors) as u64,
                4 * (expected + tensors) as u64
            ),
            "{what}: rank {r}'s gradient bytes sent and received reduced"
        );
        // Forward gathers every sharded parameter where a layer reads it, and backward gathers
        // each linear layer's weight again for its input's gradient: autodiff kept the shard,
        // not the gathered copy.
        assert!(
            rank.last_step.gathers > 0
                && rank.last_step.fallbacks.get("linear_x_backward") == Some(&linears),
            "{what}: rank {r}'s step gathered {:?} ({linears} linear layers)",
            rank.last_step.fallbacks
        );
        eprintln!(
            "{what}, {world} ranks, rank {r}: {} of {} parameter elements held, gradients held \
             {:?} bytes, last step {} gathers ({} bytes), {} all-reduces, fallbacks {:?}, gradient \
             bytes sent {} and received {}; {} vs DDP",
            rank.held,
            rank.elements,
            rank.grads,
            rank.last_step.gathers,
            rank.last_step.gather_bytes,
            rank.last_step.all_reduces,
            rank.last_step.fallbacks,
            rank.sync.bytes,
            rank.sync.received,
            diff
        );
    }
}

/// Float parameters (tensors) of the model `make` builds.
fn float_params<S: Module<FsdpFlex>>(make: fn(&Device) -> S) -> usize {
    struct Count(usize);
    impl ModuleVisitor<FsdpFlex> for Count {
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<FsdpFlex, D>>) {
            self.0 += 1;
        }
    }
    let mut count = Count(0);
    seeded::<FsdpFlex, _>(0, &Device::default(), make).visit(&mut count);
    count.0
}

/// Elements a rank of `world` holds of the model `make` builds: a 1/world slice of each
/// parameter with a dimension `world` divides, the whole of the others.
fn split_elements<S: Module<FsdpFlex>>(make: fn(&Device) -> S, world: usize) -> usize {
    struct Count(usize, usize);
    impl ModuleVisitor<FsdpFlex> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<FsdpFlex, D>>) {
            let n = param.val().shape().num_elements();
            self.1 += match fsdp::shard_dim(&param.val().dims(), self.0) {
                Some(_) => n / self.0,
                None => n,
            };
        }
    }
    let mut count = Count(world, 0);
    // Seeded: initialising draws from the backend's generator, which the other tests seed.
    seeded::<FsdpFlex, _>(0, &Device::default(), make).visit(&mut count);
    count.1
}

#[test]
fn fully_sharded_transformer_equals_ddp() {
    let batches = random_batches(
        7,
        STEPS,
        4,
        SmallTransformer::<DpFlex>::FEATURES,
        SmallTransformer::<DpFlex>::CLASSES,
    );
    for world in [2, 4] {
        check(
            world,
            SmallTransformer::new,
            SmallTransformer::new,
            &batches,
            ("transformer", 7),
        );
    }
}

#[test]
fn fully_sharded_cnn_equals_ddp() {
    let batches = random_batches(
        8,
        STEPS,
        8,
        SmallCnn::<DpFlex>::FEATURES,
        SmallCnn::<DpFlex>::CLASSES,
    );
    check(2, SmallCnn::new, SmallCnn::new, &batches, ("cnn", 1));
}

/// `steps` of `batches` from `first` on this rank's share, stepping with `optim`.
fn steps<M, O>(
    mut model: M,
    optim: &mut O,
    batches: &[Batch],
    (r, world): (usize, usize),
    device: &Device,
) -> M
where
    M: Net<FsdpFlex> + AutodiffModule<FsdpFlex>,
    O: Optimizer<M, FsdpFlex>,
{
    for batch in batches {
        let l = loss(&model, &batch.share(r, world), 1.0, device);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    model
}

/// A checkpoint of a fully sharded run (the model's record and `Sharded::consolidated_record`
/// in module order, both whole: every rank reads them together) resumes at 2 ranks bit for bit
/// where the uninterrupted run ends, each rank keeping only its slices of the loaded Adam state;
/// and loads on one device, which trains on to within 1e-5 of it.
#[test]
fn a_fully_sharded_checkpoint_resumes_exactly_and_loads_on_one_device() {
    type S = SmallTransformer<FsdpFlex>;
    const WORLD: usize = 2;
    const SAVED_AT: usize = 3;
    let batches = random_batches(9, STEPS, 4, S::FEATURES, S::CLASSES);
    let expected = split_elements(S::new, WORLD);
    let shared = batches.clone();
    let runs = on_ranks(WORLD, move |r| {
        let device = Device::default();
        let rec = BinBytesRecorder::<FullPrecisionSettings>::default();
        let stage3 = || bonfire::sharded(adam().init::<FsdpFlex, S>()).stage(ZeroStage::Three);
        // Uninterrupted.
        let mut optim = stage3();
        let model = fully_shard(seeded::<FsdpFlex, _>(1 + r as u64, &device, S::new)).unwrap();
        let model = steps(model, &mut optim, &shared, (r, WORLD), &device);
        let uninterrupted = parameters(&model);
        // Saved after `SAVED_AT` steps, loaded into a fresh model and optimizer.
        let mut optim = stage3();
        let model = fully_shard(seeded::<FsdpFlex, _>(1 + r as u64, &device, S::new)).unwrap();
        let model = steps(model, &mut optim, &shared[..SAVED_AT], (r, WORLD), &device);
        let saved_params = parameters(&model);
        let model_bytes = rec.record(model.clone().into_record(), ()).unwrap();
        let whole = InOrder::new(optim.consolidated_record(&device), &model);
        // Its tensors are whole: encoding it gathers nothing (one rank could write it alone).
        let gathered = tensor_parallel::stats().unwrap().gathers;
        let optim_bytes = rec.record(whole, ()).unwrap();
        assert_eq!(tensor_parallel::stats().unwrap().gathers, gathered);
        drop((model, optim));
        let fresh = seeded::<FsdpFlex, _>(50 + r as u64, &device, S::new);
        let fresh = fresh.load_record(rec.load(model_bytes.clone(), &device).unwrap());
        let model = fully_shard(fresh).unwrap();
        let state: InOrder<AdaptorRecord<Adam, FsdpFlex>> =
            rec.load(optim_bytes.clone(), &device).unwrap();
        let mut optim = stage3().load_consolidated_record(state.0.into_iter().collect(), &model);
        let (held, whole) = adam_elements(&model, optim.inner().to_record());
        let model = steps(model, &mut optim, &shared[SAVED_AT..], (r, WORLD), &device);
        (
            uninterrupted,
            parameters(&model),
            saved_params,
            (held, whole),
            model_bytes,
            optim_bytes,
        )
    });
    let whole_elements = 2 * split_elements(S::new, 1);
    for (r, (uninterrupted, resumed, _, state, _, _)) in runs.iter().enumerate() {
        assert!(
            resumed == uninterrupted,
            "rank {r}: the resumed run ends {:e} from the uninterrupted one",
            max_abs_diff(resumed, uninterrupted)
        );
        assert_eq!(
            *state,
            (2 * expected, whole_elements),
            "rank {r}: the loaded Adam state's moments (elements held, whole)"
        );
    }
    // One device: the saved model is the sharded run's parameters, whole; its optimizer state
    // loads, and two more steps on the whole batches land within 1e-5 of the sharded run.
    let (uninterrupted, _, saved_params, _, model_bytes, optim_bytes) = &runs[0];
    let device = Device::default();
    let _alone = bind_rank(ranks(1).remove(0));
    let rec = BinBytesRecorder::<FullPrecisionSettings>::default();
    let model = seeded::<DpFlex, _>(99, &device, SmallTransformer::new)
        .load_record(rec.load(model_bytes.clone(), &device).unwrap());
    assert!(
        parameters(&model) == *saved_params,
        "the checkpoint holds the sharded run's parameters, whole"
    );
    let state: InOrder<AdaptorRecord<Adam, DpFlex>> =
        rec.load(optim_bytes.clone(), &device).unwrap();
    let mut optim = adam()
        .init::<DpFlex, SmallTransformer<DpFlex>>()
        .load_record(state.0.into_iter().collect());
    let mut model = model;
    for batch in &batches[SAVED_AT..] {
        let l = loss(&model, batch, 1.0, &device);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    let diff = max_abs_diff(&parameters(&model), uninterrupted);
    assert!(
        diff <= 1e-5,
        "one device resumed from the sharded checkpoint ends {diff:e} from the sharded run"
    );
}

/// A GPT of `layers` layers over a vocabulary of 16, width 16, context 8.
fn tiny_gpt(layers: usize) -> bonfire::models::GptConfig {
    bonfire::models::GptConfig::new(16)
        .with_context(8)
        .with_layers(layers)
        .with_heads(2)
        .with_embd(16)
}

/// Rank `r`'s windows of step `step` for [`tiny_gpt`]: inputs and targets `[2, 8]`.
fn windows<B: burn::tensor::backend::Backend>(
    step: usize,
    r: usize,
    device: &B::Device,
) -> (
    Tensor<B, 2, burn::tensor::Int>,
    Tensor<B, 2, burn::tensor::Int>,
) {
    use burn::tensor::{Int, TensorData};
    let tokens: Vec<i64> = (0..2 * 9)
        .map(|i| ((i * 7 + step * 5 + r * 3) % 16) as i64)
        .collect();
    let t = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [2, 9]), device);
    (t.clone().slice([0..2, 0..8]), t.slice([0..2, 1..9]))
}

/// The bundled GPT (token and position embeddings read by index, the head tied to the token
/// table, a causal mask, layer norms): 3 Adam steps at 2 ranks equal DDP's within 1e-6, every
/// parameter the ranks divide held as a slice.
#[test]
fn the_bundled_gpt_fully_sharded_equals_ddp() {
    use bonfire::models::Gpt;
    const WORLD: usize = 2;
    let reference = run_ranks(ranks(WORLD), Duration::from_secs(300), |comm| {
        let (r, device) = (comm.rank(), Device::default());
        let _dp = bind_rank(comm);
        let mut model: Gpt<DpFlex> =
            bonfire::replicate(seeded(1 + r as u64, &device, |d| tiny_gpt(1).init(d)));
        let mut optim = adam().init::<DpFlex, Gpt<DpFlex>>();
        for step in 0..3 {
            let (x, y) = windows::<DpFlex>(step, r, &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        parameters(&model)
    });
    // Only the data-parallel group is bound: `fully_shard` makes the fully sharded one.
    let sharded = run_ranks(ranks(WORLD), Duration::from_secs(300), |comm| {
        let (r, device) = (comm.rank(), Device::default());
        let _dp = bind_rank(comm);
        let model: Gpt<FsdpFlex> = seeded(1 + r as u64, &device, |d| tiny_gpt(1).init(d));
        let mut model = fully_shard(model).unwrap();
        let mut optim = adam().init::<FsdpFlex, Gpt<FsdpFlex>>();
        for step in 0..3 {
            let (x, y) = windows::<FsdpFlex>(step, r, &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        (parameters(&model), elements(&model))
    });
    let whole = split_elements(|d| tiny_gpt(1).init::<FsdpFlex>(d), 1);
    let expected = split_elements(|d| tiny_gpt(1).init::<FsdpFlex>(d), WORLD);
    assert!(
        expected < whole * 6 / 10,
        "{expected} of {whole} elements split"
    );
    for (r, (params, (elements, held))) in sharded.iter().enumerate() {
        let diff = max_abs_diff(params, &reference[r]);
        assert!(
            diff <= TOLERANCE,
            "rank {r}: {diff:e} from DDP's parameters"
        );
        assert_eq!((*elements, *held), (whole, expected), "rank {r}'s elements");
    }
}

/// ZeRO stage 3's gathers started ahead of need (`bonfire::prefetch_gathers`), on the bundled
/// GPT at 2 ranks with the stage 3 wrapper: 5 Adam steps, and between the second and third an
/// evaluation's forward (a pass with no backward). One and four parameters at a time, the
/// parameters are the same bits as with none; from the second step on every read of a
/// parameter is served by a gather started ahead (four to an all-gather), but the first after
/// the evaluation.
#[test]
fn gathers_started_ahead_change_no_bit_and_serve_every_step_after_the_first() {
    use bonfire::models::Gpt;
    const WORLD: usize = 2;
    const STEPS: usize = 5;
    /// Each rank's parameters, and what each step (its forward, backward and optimizer step)
    /// and the evaluation communicated.
    fn run(n: usize) -> Vec<(Params, Vec<TpStats>, TpStats)> {
        on_ranks(WORLD, move |r| {
            let device = Device::default();
            let model: Gpt<FsdpFlex> = seeded(1 + r as u64, &device, |d| tiny_gpt(2).init(d));
            let mut model = fully_shard(model).unwrap();
            bonfire::prefetch_gathers(n);
            let mut optim =
                bonfire::sharded(adam().init::<FsdpFlex, Gpt<FsdpFlex>>()).stage(ZeroStage::Three);
            let (mut steps, mut eval) = (Vec::new(), TpStats::default());
            for step in 0..STEPS {
                if step == 2 {
                    let before = tensor_parallel::stats().unwrap();
                    let (x, y) = windows::<FsdpFlex>(99, r, &device);
                    let _ = model.loss(x, y).into_scalar();
                    eval = tensor_parallel::stats().unwrap().since(&before);
                }
                let before = tensor_parallel::stats().unwrap();
                let (x, y) = windows::<FsdpFlex>(step, r, &device);
                let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                model = optim.step(1e-2, model, grads);
                steps.push(tensor_parallel::stats().unwrap().since(&before));
            }
            (parameters(&model), steps, eval)
        })
    }
    let none = run(0);
    for n in [1, 4] {
        let ahead = run(n);
        for (r, ((params, steps, eval), (p0, s0, e0))) in ahead.iter().zip(&none).enumerate() {
            let needed: Vec<u64> = s0.iter().map(|s| s.gathers).collect();
            let served: Vec<u64> = steps.iter().map(|s| s.served_ahead).collect();
            let direct: Vec<u64> = steps
                .iter()
                .map(|s| s.gathers - s.gathers_started_ahead)
                .collect();
            let started: Vec<u64> = steps.iter().map(|s| s.gathers_started_ahead).collect();
            let dropped: u64 =
                steps.iter().map(|s| s.dropped_ahead).sum::<u64>() + eval.dropped_ahead;
            eprintln!(
                "{n} at a time, rank {r}: reads per step {needed:?}, served ahead {served:?}, \
                 gathered at need {direct:?}, all-gathers started ahead {started:?}, dropped \
                 {dropped}; evaluation: {} reads, {} served ahead",
                e0.gathers, eval.served_ahead
            );
            assert!(
                params == p0,
                "{n} at a time, rank {r}: the parameters differ from those without prefetch by {:e}",
                max_abs_diff(params, p0)
            );
            assert_eq!(s0.iter().map(|s| s.served_ahead).sum::<u64>(), 0);
            assert!(needed[0] > 20, "{needed:?}");
            assert_eq!(
                (served[0], direct[0]),
                (0, needed[0]),
                "{n}, rank {r}: the first step records"
            );
            for k in [1, 3, 4] {
                assert_eq!(
                    (served[k], direct[k]),
                    (needed[k], 0),
                    "{n} at a time, rank {r}: step {k}'s reads served ahead, and gathered at need"
                );
                // Bundled: one all-gather for every `n` parameters (the next step's first bundles
                // are started at the end of each step).
                let bundles = needed[k].div_ceil(n as u64);
                assert!(
                    started[k] >= bundles - 1 && started[k] <= bundles + 2,
                    "{n} at a time, rank {r}: step {k} started {} all-gathers for {} reads",
                    started[k],
                    needed[k]
                );
            }
            // The evaluation's forward is served as a step's forward is; step 2's forward, which
            // follows it, begins a new pass: its first read waits for a gather of its own, what
            // was started ahead is dropped, and the order is recorded again from there (step 3
            // is served whole).
            assert_eq!(
                (eval.served_ahead, eval.gathers - eval.gathers_started_ahead),
                (e0.gathers, 0),
                "{n} at a time, rank {r}: the evaluation"
            );
            assert_eq!(
                (served[2], direct[2]),
                (needed[2] - 1, 1),
                "{n} at a time, rank {r}: step 2"
            );
            assert!(
                dropped >= 1 && dropped <= 2 * n as u64,
                "{n} at a time, rank {r}: {dropped} parameters gathered ahead were dropped"
            );
        }
    }
}

/// An evaluation inside `bonfire::forward_only` gathers ahead in the order of its own forward
/// pass: on the bundled GPT at 2 ranks, 4 parameters to an all-gather, the first evaluation's
/// first pass records (every read gathered at need), its second is served ahead but for its
/// first read, its third whole; the next evaluation, which knows the pass, is served but for
/// its first read; the steps after each evaluation take training's order back (served but for
/// their first read). Every loss and every parameter is the same bits as without prefetch. Then
/// another model (one block) is evaluated the same way: its first read is not in the kept pass,
/// so its own pass is recorded from there (first pass at need, the second served but for its
/// first read), and nothing is started ahead for the other model's pass.
#[test]
fn forward_only_passes_are_served_ahead_in_their_own_order() {
    use bonfire::models::Gpt;
    const WORLD: usize = 2;
    /// Per rank: the parameters at the end, each evaluation pass's loss and what each pass and
    /// each step communicated.
    type Run = (Params, Vec<f32>, Vec<TpStats>, Vec<TpStats>);
    fn run(n: usize) -> Vec<Run> {
        on_ranks(WORLD, move |r| {
            let device = Device::default();
            let model: Gpt<FsdpFlex> = seeded(1 + r as u64, &device, |d| tiny_gpt(2).init(d));
            let mut model = fully_shard(model).unwrap();
            bonfire::prefetch_gathers(n);
            let mut optim =
                bonfire::sharded(adam().init::<FsdpFlex, Gpt<FsdpFlex>>()).stage(ZeroStage::Three);
            let (mut losses, mut passes, mut steps) = (Vec::new(), Vec::new(), Vec::new());
            for step in 0..4 {
                // Evaluations of 3 passes, then 2, before steps 2 and 3.
                let evaluation = match step {
                    2 => 3,
                    3 => 2,
                    _ => 0,
                };
                let valid = model.valid();
                bonfire::forward_only(|| {
                    for pass in 0..evaluation {
                        let before = tensor_parallel::stats().unwrap();
                        let (x, y) = windows::<Hybrid<Flex>>(50 + pass, r, &device);
                        losses.push(valid.loss(x, y).into_scalar());
                        passes.push(tensor_parallel::stats().unwrap().since(&before));
                    }
                });
                let before = tensor_parallel::stats().unwrap();
                let (x, y) = windows::<FsdpFlex>(step, r, &device);
                let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                model = optim.step(1e-2, model, grads);
                steps.push(tensor_parallel::stats().unwrap().since(&before));
            }
            // Another model, evaluated after the first one's pass was kept.
            let other: Gpt<FsdpFlex> = seeded(9 + r as u64, &device, |d| tiny_gpt(1).init(d));
            let other = fully_shard(other).unwrap().valid();
            bonfire::forward_only(|| {
                for pass in 0..2 {
                    let before = tensor_parallel::stats().unwrap();
                    let (x, y) = windows::<Hybrid<Flex>>(60 + pass, r, &device);
                    losses.push(other.loss(x, y).into_scalar());
                    passes.push(tensor_parallel::stats().unwrap().since(&before));
                }
            });
            (parameters(&model), losses, passes, steps)
        })
    }
    let none = run(0);
    let ahead = run(4);
    for (r, ((params, losses, passes, steps), (p0, l0, q0, _))) in
        ahead.iter().zip(&none).enumerate()
    {
        let at_need = |s: &TpStats| s.gathers - s.gathers_started_ahead;
        let reads = q0[0].gathers;
        let served: Vec<(u64, u64)> = passes
            .iter()
            .map(|s| (s.served_ahead, at_need(s)))
            .collect();
        eprintln!(
            "rank {r}: {reads} reads per pass; (served ahead, gathered at need) per pass {served:?}"
        );
        assert!(
            params == p0,
            "rank {r}: parameters {:e} from those without prefetch",
            max_abs_diff(params, p0)
        );
        assert_eq!(
            losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            l0.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            "rank {r}: the evaluations' losses"
        );
        assert!(
            reads > 10 && q0[..5].iter().all(|q| q.gathers == reads),
            "{q0:?}"
        );
        assert_eq!(
            served[..5],
            [
                (0, reads),
                (reads - 1, 1),
                (reads, 0),
                (reads - 1, 1),
                (reads, 0)
            ],
            "rank {r}: each evaluation pass's reads served ahead and gathered at need"
        );
        let others = q0[5].gathers;
        assert!(others > 5 && others < reads, "{q0:?}");
        assert_eq!(
            served[5..],
            [(0, others), (others - 1, 1)],
            "rank {r}: the other model's passes"
        );
        assert_eq!(
            passes[5].gathers_started_ahead, 0,
            "rank {r}: gathers started ahead for the first model's pass"
        );
        for k in [2, 3] {
            let needed = none[r].3[k].gathers;
            assert_eq!(
                (steps[k].served_ahead, at_need(&steps[k])),
                (needed - 1, 1),
                "rank {r}: step {k}, after an evaluation"
            );
        }
    }
}

/// ZeRO stage 3's wrapper refuses a model that is only replicated (it would step it whole on
/// every rank, sharding nothing), naming the fix.
#[test]
#[should_panic(expected = "shard the model with fully_shard(model) in place of replicate(model)")]
fn stage_three_refuses_a_model_only_replicated() {
    type M = SmallTransformer<DpFlex>;
    let batches = random_batches(3, 1, 4, M::FEATURES, M::CLASSES);
    run_ranks(ranks(2), Duration::from_secs(120), move |comm| {
        let (r, device) = (comm.rank(), Device::default());
        let _dp = bind_rank(comm);
        let model = bonfire::replicate(seeded::<DpFlex, _>(1, &device, M::new));
        let mut optim = bonfire::sharded(adam().init::<DpFlex, M>()).stage(ZeroStage::Three);
        let l = loss(&model, &batches[0].share(r, 2), 1.0, &device);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        optim.step(1e-2, model, grads);
    });
}

/// ZeRO stages 1 and 2 step whole parameters: on a model `fully_shard` sharded they refuse,
/// naming the stage to use.
fn refused_at(stage: ZeroStage) {
    type M = SmallTransformer<FsdpFlex>;
    let batches = random_batches(4, 1, 4, M::FEATURES, M::CLASSES);
    on_ranks(2, move |r| {
        let device = Device::default();
        let model = fully_shard(seeded::<FsdpFlex, _>(1, &device, M::new)).unwrap();
        let mut optim = bonfire::sharded(adam().init::<FsdpFlex, M>()).stage(stage);
        steps(model, &mut optim, &batches, (r, 2), &device);
    });
}

#[test]
#[should_panic(expected = "ZeRO stage 1 steps whole parameters, and this model is sharded")]
fn stage_one_refuses_a_fully_sharded_model() {
    refused_at(ZeroStage::One);
}

#[test]
#[should_panic(expected = "ZeRO stage 2 steps whole parameters, and this model is sharded")]
fn stage_two_refuses_a_fully_sharded_model() {
    refused_at(ZeroStage::Two);
}

/// AMSGrad's running maximum has no rule (a comparison and a masked select), so its update
/// comes out whole: the stage-3 wrapper slices the parameters again after each step. The
/// parameters equal DDP's and stay sharded.
#[test]
fn amsgrad_stays_sharded_and_equals_ddp() {
    type M = SmallMlp<FsdpFlex>;
    const WORLD: usize = 2;
    let batches = random_batches(5, 4, 4, M::FEATURES, M::CLASSES);
    let amsgrad = || AdamConfig::new().with_amsgrad(true);
    let shared = batches.clone();
    let reference = run_ranks(ranks(WORLD), Duration::from_secs(120), move |comm| {
        let (r, device) = (comm.rank(), Device::default());
        let _dp = bind_rank(comm);
        let mut model =
            bonfire::replicate(seeded::<DpFlex, _>(1 + r as u64, &device, SmallMlp::new));
        let mut optim = amsgrad().init::<DpFlex, SmallMlp<DpFlex>>();
        for batch in &shared {
            let l = loss(&model, &batch.share(r, WORLD), 1.0, &device);
            let grads = GradientsParams::from_grads(l.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        parameters(&model)
    });
    let sharded = on_ranks(WORLD, move |r| {
        let device = Device::default();
        let model = fully_shard(seeded::<FsdpFlex, _>(1 + r as u64, &device, M::new)).unwrap();
        let mut optim = bonfire::sharded(amsgrad().init::<FsdpFlex, M>()).stage(ZeroStage::Three);
        let model = steps(model, &mut optim, &batches, (r, WORLD), &device);
        (parameters(&model), elements(&model).1)
    });
    let expected = split_elements(M::new, WORLD);
    for (r, (params, held)) in sharded.iter().enumerate() {
        let diff = max_abs_diff(params, &reference[r]);
        assert!(
            diff <= TOLERANCE,
            "rank {r}: {diff:e} from DDP's parameters"
        );
        assert_eq!(
            *held, expected,
            "rank {r} holds its slices after AMSGrad's steps"
        );
    }
}

/// The tensors and counters of an optimizer state in module order, without the parameters'
/// ids (a fresh model's differ between runs).
fn state_values<T: burn::record::Record<B>, B: burn::tensor::backend::Backend>(
    state: InOrder<T>,
) -> String {
    use burn::record::Record;
    let items: Vec<_> = (state.into_item::<FullPrecisionSettings>().into_iter())
        .map(|(_, item)| item)
        .collect();
    serde_json::to_string(&items).expect("a record item encodes")
}

/// A fresh directory for one test's saves (removed first if a killed run left it).
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("bonfire-fsdp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A per-rank checkpoint (`save_sharded_checkpoint`: each rank writes its slices, no gather)
/// resumes at 2 ranks bit for bit where the uninterrupted run ends; loads at 4 ranks with the
/// state cut again (its consolidated record equals the one put together on one device, bit for
/// bit); converts to a whole model and Adam record on one device (the saved parameters, training
/// on within 1e-5 of the sharded run); and converts back, from that record, to a save for 2
/// ranks that resumes bit for bit too.
#[test]
fn a_per_rank_checkpoint_resumes_exactly_reshards_and_converts_both_ways() {
    type S = SmallTransformer<FsdpFlex>;
    const WORLD: usize = 2;
    const SAVED_AT: usize = 3;
    let batches = random_batches(9, STEPS, 4, S::FEATURES, S::CLASSES);
    let expected = split_elements(S::new, WORLD);
    let dir = scratch("per-rank");
    let back = scratch("per-rank-back");
    let stage3 = || bonfire::sharded(adam().init::<FsdpFlex, S>()).stage(ZeroStage::Three);
    let (shared, at) = (batches.clone(), dir.clone());
    let runs = on_ranks(WORLD, move |r| {
        let device = Device::default();
        let mut optim = stage3();
        let model = fully_shard(seeded::<FsdpFlex, _>(1 + r as u64, &device, S::new)).unwrap();
        let uninterrupted = parameters(&steps(model, &mut optim, &shared, (r, WORLD), &device));
        let mut optim = stage3();
        let model = fully_shard(seeded::<FsdpFlex, _>(1 + r as u64, &device, S::new)).unwrap();
        let model = steps(model, &mut optim, &shared[..SAVED_AT], (r, WORLD), &device);
        let before = tensor_parallel::stats().unwrap();
        let file = bonfire::save_sharded_checkpoint(&at, &model, &optim).unwrap();
        let after = tensor_parallel::stats().unwrap();
        assert_eq!(after.gathers, before.gathers, "rank {r}: saving gathered");
        assert!(
            file.ends_with(format!("zero3-rank{r}-of-2.bin")),
            "{file:?}"
        );
        let saved = parameters(&model);
        drop((model, optim));
        // Resumed into a model laid out from another seed, and a fresh optimizer.
        let fresh = fully_shard(seeded::<FsdpFlex, _>(50 + r as u64, &device, S::new)).unwrap();
        let (model, mut optim) = bonfire::load_sharded_checkpoint(&at, fresh, stage3()).unwrap();
        let loaded = parameters(&model);
        let state = adam_elements(&model, optim.inner().to_record());
        let resumed = parameters(&steps(
            model,
            &mut optim,
            &shared[SAVED_AT..],
            (r, WORLD),
            &device,
        ));
        (uninterrupted, resumed, saved, loaded, state)
    });
    let whole_elements = 2 * split_elements(S::new, 1);
    let (uninterrupted, _, saved, _, _) = &runs[0];
    for (r, (u, resumed, s, loaded, state)) in runs.iter().enumerate() {
        assert!(
            u == uninterrupted && s == saved,
            "rank {r} disagrees with rank 0"
        );
        assert!(
            loaded == saved,
            "rank {r}: the loaded parameters are not the saved ones"
        );
        assert!(
            resumed == uninterrupted,
            "rank {r}: the resumed run ends {:e} from the uninterrupted one",
            max_abs_diff(resumed, uninterrupted)
        );
        assert_eq!(
            *state,
            (2 * expected, whole_elements),
            "rank {r}: the loaded Adam state's moments (elements held, whole)"
        );
    }
    let manifest =
        std::fs::read_to_string(dir.join(bonfire::backend::tensor_parallel::MANIFEST)).unwrap();
    assert!(manifest.contains("\"ranks\": 2") && manifest.contains("zero3-rank1-of-2.bin"));

    // One device: the whole model and Adam's record, which train on with Burn's own Adam.
    let device = Device::default();
    let (consolidated, _) = {
        let _alone = bind_rank(ranks(1).remove(0));
        let model = seeded::<DpFlex, _>(99, &device, SmallTransformer::new);
        let (model, record) =
            bonfire::consolidate_sharded_checkpoint::<DpFlex, _, Adam>(&dir, model).unwrap();
        assert!(
            parameters(&model) == *saved,
            "the consolidated model is the saved one"
        );
        let mut optim = adam()
            .init::<DpFlex, SmallTransformer<DpFlex>>()
            .load_record(record.clone());
        let mut trained = model.clone();
        for batch in &batches[SAVED_AT..] {
            let l = loss(&trained, batch, 1.0, &device);
            let grads = GradientsParams::from_grads(l.backward(), &trained);
            trained = optim.step(1e-2, trained, grads);
        }
        let diff = max_abs_diff(&parameters(&trained), uninterrupted);
        assert!(
            diff <= 1e-5,
            "one device ends {diff:e} from the sharded run"
        );
        bonfire::shard_checkpoint(&back, &model, record.clone(), WORLD).unwrap();
        (InOrder::new(record, &model), model)
    };
    let whole_state = state_values(consolidated);

    // Four ranks load the 2-rank save: the same parameters, Adam's state cut in four (gathered
    // back, it is the one-device record, bit for bit); and the save converted back from the
    // one-device record resumes at 2 ranks bit for bit.
    let at = dir.clone();
    let fours = on_ranks(4, move |r| {
        let device = Device::default();
        let fresh = fully_shard(seeded::<FsdpFlex, _>(70 + r as u64, &device, S::new)).unwrap();
        let (model, optim) = bonfire::load_sharded_checkpoint(&at, fresh, stage3()).unwrap();
        let state = adam_elements(&model, optim.inner().to_record());
        let whole = InOrder::new(optim.consolidated_record(&device), &model);
        (parameters(&model), state, state_values(whole))
    });
    for (r, (params, state, bytes)) in fours.iter().enumerate() {
        assert!(
            params == saved,
            "rank {r} of 4: the loaded parameters are not the saved ones"
        );
        assert_eq!(
            *state,
            (2 * split_elements(S::new, 4), whole_elements),
            "rank {r} of 4: Adam's moments (elements held, whole)"
        );
        assert!(
            *bytes == whole_state,
            "rank {r} of 4: the state gathered back differs"
        );
    }
    let (shared, at) = (batches.clone(), back.clone());
    let again = on_ranks(WORLD, move |r| {
        let device = Device::default();
        let fresh = fully_shard(seeded::<FsdpFlex, _>(80 + r as u64, &device, S::new)).unwrap();
        let (model, mut optim) = bonfire::load_sharded_checkpoint(&at, fresh, stage3()).unwrap();
        parameters(&steps(
            model,
            &mut optim,
            &shared[SAVED_AT..],
            (r, WORLD),
            &device,
        ))
    });
    for (r, resumed) in again.iter().enumerate() {
        assert!(
            resumed == uninterrupted,
            "rank {r}: resumed from the converted save, the run ends {:e} from the uninterrupted one",
            max_abs_diff(resumed, uninterrupted)
        );
    }
    let _ = (
        std::fs::remove_dir_all(&dir),
        std::fs::remove_dir_all(&back),
    );
}

/// A save that is not whole is refused with its reason, never loaded: one already in the
/// directory, no manifest, a rank's file missing or changed (also where a rank reads only its
/// own), another model, another optimizer; and a record that would lose its state is not saved.
#[test]
fn a_damaged_per_rank_checkpoint_is_refused_with_its_reason() {
    use bonfire::ShardedCheckpointError as E;
    type S = SmallTransformer<DpFlex>;
    let device = Device::default();
    let _alone = bind_rank(ranks(1).remove(0));
    let model = seeded::<DpFlex, _>(3, &device, S::new);
    let mut optim = adam().init::<DpFlex, S>();
    let batch = &random_batches(4, 1, 4, S::FEATURES, S::CLASSES)[0];
    let grads = GradientsParams::from_grads(loss(&model, batch, 1.0, &device).backward(), &model);
    let model = optim.step(1e-2, model, grads);
    let dir = scratch("damaged");
    let record = || optim.to_record();
    bonfire::shard_checkpoint(&dir, &model, record(), 2).unwrap();
    let load = || {
        bonfire::consolidate_sharded_checkpoint::<DpFlex, _, Adam>(&dir, model.clone()).map(|_| ())
    };
    let refused = |r: Result<(), E>| match r {
        Ok(_) => panic!("a damaged save loaded"),
        Err(e) => e,
    };
    let (whole, _) =
        bonfire::consolidate_sharded_checkpoint::<DpFlex, _, Adam>(&dir, model.clone()).unwrap();
    assert!(parameters(&whole) == parameters(&model));
    let again = bonfire::shard_checkpoint(&dir, &model, record(), 2).unwrap_err();
    assert!(matches!(again, E::Exists { .. }), "{again}");

    let file = dir.join("zero3-rank1-of-2.bin");
    let bytes = std::fs::read(&file).unwrap();
    let mut changed = bytes.clone();
    changed[bytes.len() / 2] ^= 1;
    std::fs::write(&file, &changed).unwrap();
    let e = refused(load());
    assert!(
        matches!(e, E::Incomplete { .. }) && e.to_string().contains("SHA-256"),
        "{e}"
    );
    std::fs::remove_file(&file).unwrap();
    let e = refused(load());
    assert!(
        e.to_string()
            .contains("rank 1's file zero3-rank1-of-2.bin is missing"),
        "{e}"
    );
    std::fs::write(&file, &bytes).unwrap();
    load().expect("whole again");

    // Another model.
    let other = seeded::<DpFlex, _>(3, &device, SmallMlp::<DpFlex>::new);
    let e = refused(
        bonfire::consolidate_sharded_checkpoint::<DpFlex, _, Adam>(&dir, other).map(|_| ()),
    );
    assert!(
        matches!(e, E::Mismatch { .. }) && e.to_string().contains("no such parameter"),
        "{e}"
    );

    std::fs::remove_file(dir.join(bonfire::backend::tensor_parallel::MANIFEST)).unwrap();
    let e = refused(load());
    assert!(
        matches!(e, E::Incomplete { .. }) && e.to_string().contains("no manifest.json"),
        "{e}"
    );
    // A record keyed by another model's ids would lose the state: refused.
    let stranger = seeded::<DpFlex, _>(4, &device, S::new);
    let e = refused(
        bonfire::shard_checkpoint(&scratch("stranger"), &stranger, record(), 2).map(|_| ()),
    );
    assert!(
        e.to_string()
            .contains("parameter id(s) that `model` does not have"),
        "{e}"
    );

    // The mesh that wrote it (one rank here) reads its own file: changed, it is refused; whole,
    // it loads; into another optimizer, it is refused.
    let one = scratch("damaged-one");
    bonfire::shard_checkpoint(&one, &model, record(), 1).unwrap();
    type F = SmallTransformer<FsdpFlex>;
    let fresh = || seeded::<FsdpFlex, _>(5, &device, F::new);
    let stage3 = || bonfire::sharded(adam().init::<FsdpFlex, F>()).stage(ZeroStage::Three);
    let own = one.join("zero3-rank0-of-1.bin");
    let bytes = std::fs::read(&own).unwrap();
    let mut changed = bytes.clone();
    changed[bytes.len() / 3] ^= 4;
    std::fs::write(&own, &changed).unwrap();
    let e = refused(bonfire::load_sharded_checkpoint(&one, fresh(), stage3()).map(|_| ()));
    assert!(e.to_string().contains("SHA-256"), "{e}");
    std::fs::write(&own, &bytes).unwrap();
    let (loaded, _) = bonfire::load_sharded_checkpoint(&one, fresh(), stage3()).unwrap();
    assert!(parameters(&loaded) == parameters(&model));
    let sgd = bonfire::sharded(burn::optim::SgdConfig::new().init::<FsdpFlex, F>());
    let e = refused(bonfire::load_sharded_checkpoint(&one, fresh(), sgd).map(|_| ()));
    assert!(
        matches!(e, E::Format { .. }) && e.to_string().contains("optimizer state is"),
        "{e}"
    );
    let _ = (std::fs::remove_dir_all(&dir), std::fs::remove_dir_all(&one));
}
