//! `Autodiff<TensorParallel<Flex>>` against the unsharded model, with ranks as threads of this
//! process: for an MLP, Burn's own `TransformerEncoder`, a GPT-style causal block and a
//! Llama-style decoder with Burn's `RotaryEncoding`, at tp = 2
//! and 4, the loss and every parameter's gradient equal the unsharded model's (f32, within
//! 1e-5), and after 5 Adam steps every parameter does. A transformer layer under the standard plan
//! communicates exactly as Megatron does (2 all-reduces forward, 2 backward, nothing gathered).

use std::time::Duration;

use bonfire::backend::tensor_parallel::{TpStats, bind_thread, placements, stats};
use bonfire::backend::{DataParallelConfig, FailurePolicy};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire::{Placement, PlanError, TpPlan, tensor_parallel};
use bonfire_testkit::nets::{DpFlex, max_abs_diff, parameters, seeded};
use bonfire_testkit::run_ranks;
use bonfire_testkit::tp::{
    ENCODER_LAYERS, LLAMA_LAYERS, TpEncoder, TpFlex, TpGpt, TpLlama, TpMlp, TpNet, adam_steps,
    loss_and_grads,
};
use burn::module::AutodiffModule;

type Device = burn::backend::flex::FlexDevice;
type Params = Vec<Vec<f32>>;

const TOLERANCE: f32 = 1e-5;

fn comm_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(30),
        ..CommConfig::default()
    }
}

/// The unsharded reference: one rank, plain data-parallel decorator at world size 1.
fn reference<M>(make: fn(&Device) -> M, f: impl FnOnce(M) -> (f32, Params)) -> (f32, Params)
where
    M: TpNet<DpFlex> + AutodiffModule<DpFlex>,
{
    let device = Device::default();
    let _bind = bonfire::backend::bind_thread(
        Communicator::in_process(1, comm_config()).remove(0),
        DataParallelConfig {
            failure: FailurePolicy::Panic,
            ..DataParallelConfig::default()
        },
    );
    f(seeded::<DpFlex, _>(1, &device, make))
}

/// `tp` ranks as threads, each with the model made from the same seed, split by its plan.
fn split<M, R>(tp: usize, make: fn(&Device) -> M, f: fn(M) -> R) -> Vec<R>
where
    M: TpNet<TpFlex> + 'static,
    R: Send + 'static,
{
    run_ranks(
        Communicator::in_process(tp, comm_config()),
        Duration::from_secs(120),
        move |comm| {
            let device = Device::default();
            // Initialised before the group is bound: from the inner backend's generator, as the
            // reference is (and rank 0's values win anyway).
            let model = seeded::<TpFlex, _>(1, &device, make);
            let _group = bind_thread(comm.clone()).expect("bind the group");
            let model = tensor_parallel(model, &M::plan(), &comm).expect("the plan applies");
            f(model)
        },
    )
}

fn grads_of<M: TpNet<TpFlex> + AutodiffModule<TpFlex>>(model: M) -> (f32, Params) {
    loss_and_grads(&model, &M::batch(7), &Device::default())
}

fn check_gradients<MR, MT>(name: &str, reference_make: fn(&Device) -> MR, make: fn(&Device) -> MT)
where
    MR: TpNet<DpFlex> + AutodiffModule<DpFlex>,
    MT: TpNet<TpFlex> + AutodiffModule<TpFlex> + 'static,
{
    let (want_loss, want) = reference(reference_make, |m| {
        loss_and_grads(&m, &MR::batch(7), &Device::default())
    });
    for tp in [2, 4] {
        for (rank, (loss, grads)) in split(tp, make, grads_of::<MT>).into_iter().enumerate() {
            assert!(
                (loss - want_loss).abs() <= TOLERANCE,
                "{name} tp={tp} rank {rank}: loss {loss} vs {want_loss}"
            );
            let d = max_abs_diff(&grads, &want);
            assert!(
                d <= TOLERANCE,
                "{name} tp={tp} rank {rank}: gradients differ by {d}"
            );
        }
    }
}

#[test]
fn mlp_loss_and_gradients_equal_the_unsharded_model() {
    check_gradients("mlp", TpMlp::new, TpMlp::new);
}

#[test]
fn transformer_encoder_loss_and_gradients_equal_the_unsharded_model() {
    check_gradients("encoder", TpEncoder::new, TpEncoder::new);
}

#[test]
fn gpt_block_loss_and_gradients_equal_the_unsharded_model() {
    check_gradients("gpt", TpGpt::new, TpGpt::new);
}

#[test]
fn llama_decoder_loss_and_gradients_equal_the_unsharded_model() {
    check_gradients("llama", TpLlama::new, TpLlama::new);
}

fn trained<M>(model: M) -> Params
where
    M: TpNet<TpFlex> + AutodiffModule<TpFlex>,
{
    parameters(&adam_steps(model, 5, &Device::default()).0)
}

fn check_training<MR, MT>(name: &str, reference_make: fn(&Device) -> MR, make: fn(&Device) -> MT)
where
    MR: TpNet<DpFlex> + AutodiffModule<DpFlex>,
    MT: TpNet<TpFlex> + AutodiffModule<TpFlex> + 'static,
{
    let (_, want) = reference(reference_make, |m| {
        (0.0, parameters(&adam_steps(m, 5, &Device::default()).0))
    });
    for (rank, got) in split(2, make, trained::<MT>).into_iter().enumerate() {
        let d = max_abs_diff(&got, &want);
        assert!(
            d <= TOLERANCE,
            "{name} rank {rank}: parameters after 5 Adam steps differ by {d}"
        );
    }
}

#[test]
fn five_adam_steps_equal_single_device_training() {
    check_training("mlp", TpMlp::new, TpMlp::new);
    check_training("encoder", TpEncoder::new, TpEncoder::new);
    check_training("gpt", TpGpt::new, TpGpt::new);
}

/// (forward, backward) communication of one step.
fn step_stats<M: TpNet<TpFlex>>(model: M) -> (TpStats, TpStats) {
    let device = Device::default();
    let batch = M::batch(7);
    let start = stats().expect("bound");
    let loss = model.loss(&batch, &device);
    let after_forward = stats().expect("bound");
    let _grads = loss.backward();
    let after_backward = stats().expect("bound");
    (
        after_forward.since(&start),
        after_backward.since(&after_forward),
    )
}

#[test]
fn a_transformer_layer_communicates_exactly_as_megatron() {
    for (rank, (fwd, bwd)) in split(2, TpEncoder::new, step_stats::<TpEncoder<TpFlex>>)
        .into_iter()
        .enumerate()
    {
        let layers = ENCODER_LAYERS as u64;
        // Forward: the attention's and the MLP's row-parallel outputs. Backward: the gradients
        // of the attention's and the MLP's inputs (the column-parallel layers'), except the first
        // layer's input, which is data and needs no gradient (Megatron's `f` would still
        // all-reduce it).
        assert_eq!(fwd.all_reduces, 2 * layers, "rank {rank} forward: {fwd:?}");
        assert_eq!(
            bwd.all_reduces,
            2 * layers - 1,
            "rank {rank} backward: {bwd:?}"
        );
        for s in [&fwd, &bwd] {
            assert_eq!(s.gathers, 0, "rank {rank}: nothing is gathered: {s:?}");
            assert_eq!(s.fallback_total(), 0, "rank {rank}: no fallback: {s:?}");
        }
        // Each all-reduce moves one [batch, seq, d_model] activation: 4 x 6 x 16 floats.
        assert_eq!(
            fwd.all_reduce_bytes,
            2 * layers * 4 * 6 * 16 * 4,
            "rank {rank}"
        );
    }
}

#[test]
fn the_gpt_block_never_gathers_the_logits() {
    for (rank, (fwd, bwd)) in split(2, TpGpt::new, step_stats::<TpGpt<TpFlex>>)
        .into_iter()
        .enumerate()
    {
        for s in [&fwd, &bwd] {
            assert_eq!(s.gathers, 0, "rank {rank}: {s:?}");
            assert_eq!(s.fallback_total(), 0, "rank {rank}: {s:?}");
        }
        // Forward: the embedding's sum, the attention and MLP outputs (one activation each),
        // and the loss's max and sum of exponentials over the split vocabulary (one value per
        // position each: b x s, never b x s x vocab).
        assert_eq!(fwd.all_reduces, 5, "rank {rank}: {fwd:?}");
        let (b, s, width, f32_bytes) = (4, 8, 16, 4);
        let activation = b * s * width * f32_bytes;
        let per_position = b * s * f32_bytes;
        assert_eq!(
            fwd.all_reduce_bytes,
            3 * activation + 2 * per_position,
            "rank {rank}"
        );
    }
}

/// Burn's `RotaryEncoding` merges the batch with the split heads (`[b, h, s, d] -> [b*h, s, d/2,
/// 2]`) and splits them back: the shard stays local through both reshapes, so a Llama-style
/// decoder communicates as Megatron's does.
#[test]
fn a_llama_decoder_with_rotary_positions_never_gathers() {
    for tp in [2, 4] {
        for (rank, (fwd, bwd)) in split(tp, TpLlama::new, step_stats::<TpLlama<TpFlex>>)
            .into_iter()
            .enumerate()
        {
            for s in [&fwd, &bwd] {
                assert_eq!(
                    s.gathers, 0,
                    "tp={tp} rank {rank}: nothing is gathered: {s:?}"
                );
                assert_eq!(
                    s.fallback_total(),
                    0,
                    "tp={tp} rank {rank}: no fallback: {s:?}"
                );
            }
            // Forward: the embedding's sum, each layer's attention and MLP outputs, and the
            // loss's max and sum over the split vocabulary.
            assert_eq!(
                fwd.all_reduces,
                1 + 2 * LLAMA_LAYERS as u64 + 2,
                "tp={tp} rank {rank}: {fwd:?}"
            );
        }
    }
}

#[test]
fn a_plan_splits_parameters_and_each_rank_keeps_its_part() {
    let got = split(2, TpEncoder::new, |model: TpEncoder<TpFlex>| {
        placements(&model)
    });
    let p = &got[0];
    assert_eq!(
        p["encoder.layers.0.mha.query.weight"],
        Placement::shard(1),
        "{p:?}"
    );
    assert_eq!(p["encoder.layers.0.mha.query.bias"], Placement::shard(0));
    assert_eq!(p["encoder.layers.1.mha.output.weight"], Placement::shard(0));
    assert_eq!(p["encoder.layers.1.mha.output.bias"], Placement::Replicate);
    assert_eq!(p["head.weight"], Placement::Replicate);
}

/// The message every rank refuses `plan` with (the same on every rank, before any parameter is
/// communicated).
fn plan_error(plan: TpPlan, tp: usize) -> String {
    let errors = run_ranks(
        Communicator::in_process(tp, comm_config()),
        Duration::from_secs(60),
        move |comm| {
            let model = seeded::<TpFlex, _>(1, &Device::default(), TpEncoder::new);
            let _group = bind_thread(comm.clone()).expect("bind");
            tensor_parallel(model, &plan, &comm)
                .err()
                .map(|e: PlanError| e.to_string())
        },
    );
    let first = errors[0].clone().expect("the plan is refused");
    assert!(errors.iter().all(|e| e.as_deref() == Some(first.as_str())));
    first
}

#[test]
fn bad_plans_are_refused_with_a_message_naming_the_rule_or_parameter() {
    let e = plan_error(
        TpEncoder::<TpFlex>::plan().column("encoder.layers.*.mha.qkv"),
        2,
    );
    assert!(
        e.contains("matches no parameter") && e.contains("encoder.layers.*.mha.qkv"),
        "{e}"
    );
    assert!(
        e.contains("encoder.layers.0.mha.query.weight"),
        "lists the model's paths: {e}"
    );

    let e = plan_error(TpPlan::new().row("head").column("head"), 2);
    assert!(e.contains("head.weight is matched by two rules"), "{e}");

    // The head's 5 classes do not divide among 2 ranks.
    let e = plan_error(TpPlan::new().column("head"), 2);
    assert!(
        e.contains("head.weight") && e.contains("over 2 ranks"),
        "{e}"
    );
}

/// A rank's program seeds its backend and builds its model (lazily: Burn draws a parameter on
/// first use) before or after joining its tensor-parallel group: the same weights either way,
/// run after run. A model built before joining drew its parameters inside the group from a seed
/// the group agreed at random, so two runs of the same program started from different weights.
#[test]
fn a_seed_set_before_joining_the_group_decides_the_weights() {
    fn weights(seed_first: bool) -> Params {
        let ranks = run_ranks(
            Communicator::in_process(2, comm_config()),
            Duration::from_secs(120),
            move |comm| {
                let device = Device::default();
                let seed = || <TpFlex as burn::tensor::backend::Backend>::seed(&device, 9);
                let (model, group) = if seed_first {
                    seed();
                    let model = TpEncoder::<TpFlex>::new(&device);
                    (model, bind_thread(comm.clone()).expect("bind the group"))
                } else {
                    let group = bind_thread(comm.clone()).expect("bind the group");
                    seed();
                    (TpEncoder::<TpFlex>::new(&device), group)
                };
                let model =
                    tensor_parallel(model, &TpEncoder::<TpFlex>::plan(), &comm).expect("plan");
                let whole = parameters(&model);
                drop(group);
                whole
            },
        );
        assert!(
            ranks[0] == ranks[1],
            "the ranks read different whole weights"
        );
        ranks.into_iter().next().unwrap()
    }
    // Counted, not printed: a difference would print every weight.
    let differ = |a: &Params, b: &Params| -> usize {
        let values: usize = a
            .iter()
            .zip(b)
            .map(|(x, y)| x.iter().zip(y).filter(|(p, q)| p != q).count())
            .sum();
        values + a.len().abs_diff(b.len())
    };
    let first = weights(true);
    let again = weights(true);
    let after = weights(false);
    assert_eq!(
        differ(&first, &again),
        0,
        "two runs seeded before joining differ"
    );
    assert_eq!(
        differ(&first, &after),
        0,
        "seeding before and after joining differ"
    );
}

/// A save by a group of 2 loads at 4, a save at 4 back at 2, and either on one device into the
/// unsplit model on the plain backend (`load_whole`): every parameter equal, bit for bit, to the
/// model that was saved (trained 2 Adam steps, so not its initial values), though each load
/// starts from a model of another seed. A save missing a rank's file is refused, saying what the
/// directory holds.
#[test]
fn a_save_loads_at_another_tensor_parallel_size_and_on_one_device() {
    use bonfire::backend::tensor_parallel::{load_shards, load_whole, save_shards};
    let dir = std::env::temp_dir().join(format!("bonfire-reshard-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (at2, at4) = (dir.join("tp2"), dir.join("tp4"));
    /// `tp` ranks: each makes the model from `seed`, splits it, loads `from` (trains 2 steps
    /// instead when there is none), saves to `to`, and returns the whole parameters.
    fn ranks(tp: usize, seed: u64, from: Option<PathBuf>, to: PathBuf) -> Vec<Params> {
        run_ranks(
            Communicator::in_process(tp, comm_config()),
            Duration::from_secs(120),
            move |comm| {
                let device = Device::default();
                let model = seeded::<TpFlex, _>(seed, &device, TpGpt::new);
                let _group = bind_thread(comm.clone()).expect("bind the group");
                let model = tensor_parallel(model, &TpGpt::<TpFlex>::plan(), &comm).expect("plan");
                let model = match &from {
                    Some(dir) => load_shards(model, dir).expect("the save loads"),
                    None => adam_steps(model, 2, &device).0,
                };
                save_shards(&model, &to).expect("save");
                parameters(&model)
            },
        )
    }
    use std::path::PathBuf;
    let want = ranks(2, 1, None, at2.clone()).remove(0);
    for (rank, got) in ranks(4, 2, Some(at2.clone()), at4.clone())
        .iter()
        .enumerate()
    {
        assert!(
            *got == want,
            "rank {rank} of 4 loaded other values from the save at 2"
        );
    }
    for (rank, got) in ranks(2, 3, Some(at4.clone()), dir.join("again"))
        .iter()
        .enumerate()
    {
        assert!(
            *got == want,
            "rank {rank} of 2 loaded other values from the save at 4"
        );
    }
    let device = Device::default();
    for save in [&at2, &at4] {
        let plain = seeded::<burn::backend::Flex, _>(4, &device, TpGpt::new);
        assert!(parameters(&plain) != want);
        let plain = load_whole(plain, save).expect("the save loads on one device");
        assert!(
            parameters(&plain) == want,
            "{}: the whole model differs",
            save.display()
        );
    }
    std::fs::remove_file(at4.join("tp-rank3-of-4.bin")).unwrap();
    let plain = seeded::<burn::backend::Flex, _>(4, &device, TpGpt::new);
    let Err(err) = load_whole(plain, &at4) else {
        panic!("an incomplete save loaded");
    };
    assert!(
        err.to_string()
            .contains("no complete save: it holds 3 of the 4 files of a group of 4"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
