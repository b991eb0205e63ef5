//! `Autodiff<Hybrid<Flex>>` (data x tensor parallelism) against one device: 4 ranks as threads,
//! dp = 2 replicas of tp = 2 ranks each, every replica training on its half of the union batch.
//! After 5 Adam steps every parameter equals single-device training on the union batch (f32,
//! within 1e-5), for an MLP, Burn's `TransformerEncoder` and a GPT-style block; the data-parallel
//! all-reduce carries each rank's shard only, and the tensor-parallel collectives are counted
//! apart from it.

use std::time::Duration;

use bonfire::backend::tensor_parallel::{self, local_part};
use bonfire::backend::{DataParallelConfig, FailurePolicy, StepStats, total_stats};
use bonfire::collectives::{CommConfig, Communicator, MeshGroups};
use bonfire::topology::Mesh;
use bonfire::{Hybrid, ZeroStage, replicate};
use bonfire_testkit::nets::{DpFlex, max_abs_diff, parameters, seeded};
use bonfire_testkit::run_ranks;
use bonfire_testkit::tp::{
    TpEncoder, TpGpt, TpMlp, TpNet, adam_steps, adam_steps_on_part, gradients, loss_and_grads,
    steps_on_part,
};
use burn::backend::Autodiff;
use burn::backend::flex::Flex;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

type Device = burn::backend::flex::FlexDevice;
type HybridFlex = Autodiff<Hybrid<Flex>>;
type Params = Vec<Vec<f32>>;

const TOLERANCE: f32 = 1e-5;
const DP: usize = 2;
const TP: usize = 2;
const STEPS: usize = 5;

fn comm_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(30),
        ..CommConfig::default()
    }
}

fn dp_config() -> DataParallelConfig {
    DataParallelConfig {
        failure: FailurePolicy::Panic,
        ..DataParallelConfig::default()
    }
}

/// One device, the whole batch of every step.
fn reference<M>(make: fn(&Device) -> M) -> Params
where
    M: TpNet<DpFlex> + AutodiffModule<DpFlex>,
{
    let device = Device::default();
    let _bind = bonfire::backend::bind_thread(
        Communicator::in_process(1, comm_config()).remove(0),
        dp_config(),
    );
    let model = seeded::<DpFlex, _>(1, &device, make);
    parameters(&adam_steps(model, STEPS, &device).0)
}

/// The elements of this rank's parts of `model`'s parameters.
fn local_elements<B: tensor_parallel::TensorParallelBackend, M: Module<B>>(model: &M) -> usize {
    struct Count(usize);
    impl<B: tensor_parallel::TensorParallelBackend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0 += local_part(param.val()).shape().num_elements();
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    count.0
}

struct Rank {
    params: Params,
    dp: StepStats,
    tp: tensor_parallel::TpStats,
    local_elements: usize,
    tensors: usize,
}

/// dp x tp ranks as threads: each splits the model over its tensor-parallel group, replicates it
/// over its data-parallel group (both groups bound to its thread), and hands it to `train` with
/// the groups.
fn on_the_mesh<M, R, F>(make: fn(&Device) -> M, train: F) -> Vec<R>
where
    M: TpNet<HybridFlex> + AutodiffModule<HybridFlex> + 'static,
    R: Send + 'static,
    F: Fn(M, &MeshGroups, &Device) -> R + Send + Sync + 'static,
{
    split_on_the_mesh(make, true, train)
}

/// [`on_the_mesh`], the model replicated over the data-parallel group (its gradients averaged
/// in backward) only when `replicated`; otherwise only the tensor-parallel group is bound.
fn split_on_the_mesh<M, R, F>(make: fn(&Device) -> M, replicated: bool, train: F) -> Vec<R>
where
    M: TpNet<HybridFlex> + AutodiffModule<HybridFlex> + 'static,
    R: Send + 'static,
    F: Fn(M, &MeshGroups, &Device) -> R + Send + Sync + 'static,
{
    run_ranks(
        Communicator::in_process(DP * TP, comm_config()),
        Duration::from_secs(180),
        move |world| {
            let device = Device::default();
            let groups = world
                .split_mesh(&Mesh::new(DP * TP, TP).expect("mesh"))
                .expect("split the mesh");
            let model = seeded::<HybridFlex, _>(1, &device, make);
            let _dp =
                replicated.then(|| bonfire::backend::bind_thread(groups.dp.clone(), dp_config()));
            let _tp = tensor_parallel::bind_thread(groups.tp.clone()).expect("bind the tp group");
            let model =
                bonfire::tensor_parallel(model, &M::plan(), &groups.tp).expect("the plan applies");
            let model = if replicated { replicate(model) } else { model };
            train(model, &groups, &device)
        },
    )
}

/// [`on_the_mesh`], each rank training on its replica's part of every batch.
fn hybrid<M>(make: fn(&Device) -> M) -> Vec<Rank>
where
    M: TpNet<HybridFlex> + AutodiffModule<HybridFlex> + 'static,
{
    on_the_mesh(make, |model: M, groups, device| {
        let device = *device;
        let (replica, replicas) = (groups.dp.rank(), groups.dp.size());
        let tp_before = tensor_parallel::stats().expect("tp stats");
        let (model, _) = adam_steps_on_part(model, STEPS, &device, replica, replicas);
        let tp = tensor_parallel::stats()
            .expect("tp stats")
            .since(&tp_before);
        let mut tensors = 0;
        model.visit(&mut CountTensors(&mut tensors));
        Rank {
            local_elements: local_elements(&model),
            params: parameters(&model),
            dp: total_stats().expect("dp stats"),
            tp,
            tensors,
        }
    })
}

struct CountTensors<'a>(&'a mut usize);
impl<B: Backend> ModuleVisitor<B> for CountTensors<'_> {
    fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<B, D>>) {
        *self.0 += 1;
    }
}

fn check<MR, MH>(name: &str, reference_make: fn(&Device) -> MR, make: fn(&Device) -> MH)
where
    MR: TpNet<DpFlex> + AutodiffModule<DpFlex>,
    MH: TpNet<HybridFlex> + AutodiffModule<HybridFlex> + 'static,
{
    let want = reference(reference_make);
    let whole: usize = want.iter().map(Vec::len).sum();
    for (rank, got) in hybrid(make).into_iter().enumerate() {
        let d = max_abs_diff(&got.params, &want);
        assert!(
            d <= TOLERANCE,
            "{name} rank {rank} (dp {DP} x tp {TP}): parameters after {STEPS} Adam steps differ \
             by {d} from one device on the union batch"
        );
        // The data-parallel all-reduce carries this rank's shards (and one presence flag per
        // parameter), never the whole model.
        assert_eq!(
            got.dp.steps, STEPS as u64,
            "{name} rank {rank}: {:?}",
            got.dp
        );
        assert_eq!(
            got.dp.bytes,
            (STEPS * 4 * (got.local_elements + got.tensors)) as u64,
            "{name} rank {rank}: data-parallel bytes"
        );
        assert!(
            got.local_elements < whole,
            "{name} rank {rank}: nothing is split"
        );
        // The tensor-parallel collectives are counted apart, and the plan does not leak.
        assert!(got.tp.all_reduces > 0, "{name} rank {rank}: {:?}", got.tp);
        assert_eq!(
            got.tp.fallback_total(),
            0,
            "{name} rank {rank}: {:?}",
            got.tp
        );
    }
}

#[test]
fn mlp_dp2_tp2_trains_as_one_device_on_the_union_batch() {
    check("mlp", TpMlp::new, TpMlp::new);
}

#[test]
fn transformer_encoder_dp2_tp2_trains_as_one_device_on_the_union_batch() {
    check("encoder", TpEncoder::new, TpEncoder::new);
}

#[test]
fn gpt_block_dp2_tp2_trains_as_one_device_on_the_union_batch() {
    check("gpt", TpGpt::new, TpGpt::new);
}

/// What a rank of [`hybrid_zero`] ended with.
struct ZeroRank {
    params: Params,
    /// Bytes of gradient each step's optimizer got.
    held: Vec<usize>,
    /// Parameters this rank keeps optimizer state for.
    states: usize,
    /// Entries of the consolidated record (every parameter's state, gathered).
    consolidated: usize,
    local_elements: usize,
    /// Its tensor-parallel rank.
    tp_rank: usize,
}

/// As [`hybrid`], with Adam sharded over each data-parallel group at `stage` (`None`: whole).
fn hybrid_zero<M>(make: fn(&Device) -> M, stage: Option<ZeroStage>) -> Vec<ZeroRank>
where
    M: TpNet<HybridFlex> + AutodiffModule<HybridFlex> + 'static,
{
    on_the_mesh(make, move |model: M, groups, device| {
        let device = *device;
        let (replica, replicas) = (groups.dp.rank(), groups.dp.size());
        let adam = AdamConfig::new().init::<HybridFlex, M>();
        let (model, held, states, consolidated) = match stage {
            None => {
                let mut optim = adam;
                let (model, _, held) =
                    steps_on_part(model, &mut optim, STEPS, &device, replica, replicas);
                let n = optim.to_record().len();
                (model, held, n, n)
            }
            Some(stage) => {
                let mut optim = bonfire::sharded(adam).stage(stage);
                let (model, _, held) =
                    steps_on_part(model, &mut optim, STEPS, &device, replica, replicas);
                // Gathered over the replicas, each tensor over the tensor-parallel group:
                // every rank of a group must encode its entries in one order.
                let consolidated = optim.consolidated_record(&device).len();
                (model, held, optim.inner().to_record().len(), consolidated)
            }
        };
        ZeroRank {
            tp_rank: groups.tp.rank(),
            local_elements: local_elements(&model),
            params: parameters(&model),
            held,
            states,
            consolidated,
        }
    })
}

/// ZeRO over the dp x tp mesh: Adam's state (stage 1), and the gradients too (stage 2), sharded
/// over each data-parallel group, every tensor-parallel rank of a replica with the same owners
/// (planned on the whole tensors' sizes). At dp 2 the parameters after every step are the
/// unsharded hybrid run's, bit for bit; each rank keeps state for its share only, and at stage 2
/// gets only its share of the gradients (after the first step, which makes the plan).
#[test]
fn zero_over_the_hybrid_mesh_changes_no_bit() {
    let plain = hybrid_zero(TpGpt::new, None);
    let tensors = plain[0].states;
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let zero = hybrid_zero(TpGpt::new, Some(stage));
        for (rank, (p, z)) in plain.iter().zip(&zero).enumerate() {
            assert!(
                p.params == z.params,
                "{stage:?} rank {rank}: parameters after {STEPS} steps differ from the unsharded \
                 hybrid run's by {}",
                max_abs_diff(&p.params, &z.params)
            );
            assert_eq!(z.consolidated, tensors, "{stage:?} rank {rank}");
            assert!(
                z.states > 0 && z.states < tensors,
                "{stage:?} rank {rank}: state for {} of {tensors}",
                z.states
            );
            assert!(
                p.held.iter().all(|&h| h == 4 * p.local_elements),
                "rank {rank}: {:?}",
                p.held
            );
            let later = &z.held[1..];
            match stage {
                ZeroStage::One => assert_eq!(z.held, p.held, "rank {rank}"),
                _ => assert!(
                    later.iter().all(|&h| h > 0 && h < 4 * z.local_elements),
                    "{stage:?} rank {rank}: {:?} of {} bytes",
                    z.held,
                    4 * z.local_elements
                ),
            }
        }
        // The two replicas' owners split every tensor-parallel rank's state between them.
        for tp_rank in 0..TP {
            let of_column = zero.iter().filter(|z| z.tp_rank == tp_rank);
            let states: usize = of_column.map(|z| z.states).sum();
            assert_eq!(states, tensors, "{stage:?} tp rank {tp_rank}");
        }
    }
}

/// What a rank of a pipeline stage's average ended with.
struct StageAverage {
    /// Gradient bytes the rank held before the average and after it.
    held: (usize, usize),
    /// The elements of its parameters' parts.
    local_elements: usize,
    /// The tensor-parallel collectives the average made.
    tp: tensor_parallel::TpStats,
    /// Every averaged gradient, whole (gathered after the counting).
    grads: Params,
}

/// `bonfire::pipeline::average_gradients`, a pipeline stage's average over its data-parallel
/// group, on a stage split over its tensor-parallel group (as `bonfire train gpt --dp 2 --tp 2
/// --pp 2` splits each stage, on `Autodiff<Hybrid<_>>` with the model not `replicate`d, so no
/// data-parallel hook averages in backward): every
/// gradient stays split (each rank holds its shard's bytes after the average as before it),
/// nothing is gathered over the tensor-parallel group, and the averaged gradients equal one
/// device's on the union batch.
#[test]
fn a_split_pipeline_stage_averages_its_gradients_shard_by_shard() {
    let batch = <TpGpt<DpFlex> as TpNet<DpFlex>>::batch(7);
    let want = {
        let device = Device::default();
        let _bind = bonfire::backend::bind_thread(
            Communicator::in_process(1, comm_config()).remove(0),
            dp_config(),
        );
        let model = seeded::<DpFlex, _>(1, &device, TpGpt::new);
        loss_and_grads(&model, &batch, &device).1
    };
    let whole: usize = want.iter().map(Vec::len).sum();
    let ranks = split_on_the_mesh(
        TpGpt::new,
        false,
        move |model: TpGpt<HybridFlex>, groups, device| {
            let part = batch.part(groups.dp.rank(), DP);
            let loss = model.loss(&part, device);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let before = bonfire::gradient_bytes(&model, &grads);
            let tp_before = tensor_parallel::stats().expect("tp stats");
            let grads = bonfire::pipeline::average_gradients(&groups.dp, &model, grads)
                .expect("the average");
            let tp = tensor_parallel::stats()
                .expect("tp stats")
                .since(&tp_before);
            StageAverage {
                held: (before, bonfire::gradient_bytes(&model, &grads)),
                local_elements: local_elements(&model),
                tp,
                grads: gradients(&model, &grads),
            }
        },
    );
    for (rank, got) in ranks.iter().enumerate() {
        assert_eq!(
            got.held,
            (4 * got.local_elements, 4 * got.local_elements),
            "rank {rank}: gradient bytes before and after the average"
        );
        assert!(got.local_elements < whole, "rank {rank}: nothing is split");
        assert_eq!(got.tp.gathers, 0, "rank {rank}: {:?}", got.tp);
        let d = max_abs_diff(&got.grads, &want);
        assert!(
            d <= TOLERANCE,
            "rank {rank}: averaged gradients differ by {d} from one device's on the union batch"
        );
    }
}
