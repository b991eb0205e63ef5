//! `Autodiff<DataParallel<Flex>>` against single-rank training, with ranks as threads of this
//! process over the in-process transport. N ranks with batch b each must end with the same
//! parameters as one rank with batch N x b, after K optimizer steps (f32, max abs difference at
//! most 1e-5), and two runs must agree bit for bit.

use std::time::Duration;

use bonfire::backend::{DataParallelConfig, FailurePolicy, GradDType, Overlap, bind_thread};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire_testkit::nets::{
    Batch, DpFlex, Net, SmallCnn, SmallTransformer, max_abs_diff, parameters, random_batches,
    seeded, train,
};
use bonfire_testkit::{RankModels, run_ranks};
use burn::module::AutodiffModule;

type Device = burn::backend::flex::FlexDevice;
type Params = Vec<Vec<f32>>;

const STEPS: usize = 3;
const TOLERANCE: f32 = 1e-5;

fn config() -> DataParallelConfig {
    DataParallelConfig {
        failure: FailurePolicy::Panic,
        ..DataParallelConfig::default()
    }
}

fn comm_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(20),
        ..CommConfig::default()
    }
}

/// One rank, whole batches, `micro` micro-batches per step.
fn single<M>(make: fn(&Device) -> M, batches: &[Batch], micro: usize) -> Params
where
    M: Net<DpFlex> + AutodiffModule<DpFlex> + 'static,
{
    let device = Device::default();
    // A world of one of this thread's own, so that tests running side by side share nothing.
    let _bind = bind_thread(
        Communicator::in_process(1, comm_config()).remove(0),
        config(),
    );
    let model = seeded::<DpFlex, _>(1, &device, make);
    let model = bonfire::replicate(model);
    parameters(&train(model, batches, micro, &device).0)
}

/// `world` ranks as threads, each on its slice of every batch. Rank 0's model starts from the
/// single-rank run's seed; the others from other seeds (replicate must copy rank 0's).
fn data_parallel<M>(
    world: usize,
    make: fn(&Device) -> M,
    batches: &[Batch],
    micro: usize,
    dp: DataParallelConfig,
) -> Vec<Params>
where
    M: Net<DpFlex> + AutodiffModule<DpFlex> + 'static,
{
    let device = Device::default();
    let models = RankModels::seeded::<DpFlex>(world, |r| 1 + 1000 * r as u64, &device, make);
    let batches = batches.to_vec();
    run_ranks(
        Communicator::in_process(world, comm_config()),
        Duration::from_secs(300),
        move |comm| {
            let r = comm.rank();
            let device = Device::default();
            let model = models.take(r);
            let _bind = bind_thread(comm, dp.clone());
            let model = bonfire::replicate(model);
            let shard: Vec<Batch> = batches.iter().map(|b| b.share(r, world)).collect();
            let (model, _) = train(model, &shard, micro, &device);
            let stats = bonfire::last_step_stats().expect("bound");
            assert_eq!(stats.steps, 1);
            assert!(stats.buckets >= 1 && stats.bytes > 0, "{stats:?}");
            assert!((0.0..=1.0).contains(&stats.hidden_fraction()));
            assert_timeline_adds_up(&stats);
            // The step that planned the buckets is left out of the summed timeline.
            let total = bonfire::total_stats().expect("bound");
            assert!(
                total.timeline.iter().all(|b| b.steps + 1 == total.steps),
                "{total:#?}"
            );
            parameters(&model)
        },
    )
}

/// One timeline entry per bucket, each in the order ready, called, first frame, peers in, done;
/// buckets ready and called in order; their bytes the step's; and the exposed time is how far the last
/// bucket finished past backward's end.
fn assert_timeline_adds_up(stats: &bonfire::StepStats) {
    let t = &stats.timeline;
    assert_eq!(t.len() as u64, stats.buckets, "{stats:#?}");
    assert_eq!(t.iter().map(|b| b.bytes).sum::<u64>(), stats.bytes);
    for b in t {
        assert_eq!(b.steps, 1);
        assert!(
            b.ready <= b.called
                && b.called <= b.started
                && b.started <= b.peers
                && b.peers <= b.finished,
            "{b:?}"
        );
    }
    assert!(t.windows(2).all(|w| w[0].called <= w[1].called), "{t:#?}");
    // Planned in the order gradients become final: no bucket waits behind a later one.
    assert!(t.windows(2).all(|w| w[0].ready <= w[1].ready), "{t:#?}");
    let last = t.iter().map(|b| b.finished).max().unwrap();
    let past = last.saturating_sub(stats.backward);
    let gap = past.abs_diff(stats.exposed);
    assert!(
        gap < Duration::from_micros(1),
        "{past:?} against {stats:#?}"
    );
    // A peer waited for after backward accounts for part of the exposed time, no more.
    assert!(stats.late_peers.len() <= 1, "{stats:#?}");
    for late in stats.late_peers.values() {
        assert_eq!(late.steps, 1);
        assert!(late.waited <= stats.exposed, "{stats:#?}");
    }
}

fn assert_matches(reference: &Params, ranks: &[Params], tolerance: f32, what: &str) {
    for (r, p) in ranks.iter().enumerate() {
        let d = max_abs_diff(reference, p);
        assert!(
            d <= tolerance,
            "{what}: rank {r} differs from one rank by {d:e}"
        );
        // Replicas stay identical to each other, bit for bit.
        assert_eq!(p, &ranks[0], "{what}: rank {r} drifted from rank 0");
    }
    // The run really trained (parameters moved from their initial values).
    assert!(reference.iter().flatten().all(|x| x.is_finite()));
}

#[test]
fn cnn_on_two_ranks_matches_one_rank_with_the_whole_batch() {
    let batches = random_batches(7, STEPS, 8, SmallCnn::<DpFlex>::FEATURES, 10);
    let reference = single(SmallCnn::new, &batches, 1);
    let initial = parameters(&seeded::<DpFlex, _>(1, &Device::default(), SmallCnn::new));
    assert!(
        max_abs_diff(&reference, &initial) > 1e-3,
        "training moved the parameters"
    );
    let ranks = data_parallel(2, SmallCnn::new, &batches, 1, config());
    assert_matches(&reference, &ranks, TOLERANCE, "cnn, 2 ranks");
}

#[test]
fn the_whole_path_at_world_size_one_leaves_training_unchanged() {
    // `sync_alone`: hook, buckets and a one-rank all-reduce at world size 1 (the harness asserts
    // that buckets were all-reduced); the parameters are those of the pass-through, bit for bit.
    let batches = random_batches(9, STEPS, 8, SmallCnn::<DpFlex>::FEATURES, 10);
    let reference = single(SmallCnn::new, &batches, 1);
    let dp = DataParallelConfig {
        sync_alone: true,
        ..config()
    };
    let alone = data_parallel(1, SmallCnn::new, &batches, 1, dp);
    assert_eq!(alone[0], reference, "sync_alone changed the training");
}

#[test]
fn transformer_block_on_two_ranks_matches_one_rank() {
    let batches = random_batches(8, STEPS, 6, SmallTransformer::<DpFlex>::FEATURES, 5);
    let reference = single(SmallTransformer::new, &batches, 1);
    let ranks = data_parallel(2, SmallTransformer::new, &batches, 1, config());
    assert_matches(&reference, &ranks, TOLERANCE, "transformer, 2 ranks");
}

#[test]
fn three_ranks_with_many_small_buckets_match_one_rank() {
    // 256-byte buckets: every parameter in a bucket of its own or nearly, many in flight at once.
    let batches = random_batches(9, STEPS, 12, SmallCnn::<DpFlex>::FEATURES, 10);
    let reference = single(SmallCnn::new, &batches, 1);
    let dp = DataParallelConfig {
        bucket_cap_bytes: 256,
        first_bucket_cap_bytes: 64,
        ..config()
    };
    let ranks = data_parallel(3, SmallCnn::new, &batches, 1, dp);
    assert_matches(&reference, &ranks, TOLERANCE, "cnn, 3 ranks, small buckets");
}

#[test]
fn every_overlap_mode_gives_the_same_bits() {
    // Many buckets in flight, moved by the runtime's threads, by backward's own thread at each
    // hook, or only after backward: who moves the bytes must not change a bit.
    let batches = random_batches(13, STEPS, 12, SmallCnn::<DpFlex>::FEATURES, 10);
    let reference = single(SmallCnn::new, &batches, 1);
    let run = |overlap| {
        let dp = DataParallelConfig {
            bucket_cap_bytes: 256,
            first_bucket_cap_bytes: 64,
            overlap,
            ..config()
        };
        data_parallel(3, SmallCnn::new, &batches, 1, dp)
    };
    let threads = run(Overlap::Threads);
    assert_matches(&reference, &threads, TOLERANCE, "cnn, 3 ranks, threads");
    for overlap in [Overlap::Hooks, Overlap::End] {
        let ranks = run(overlap);
        assert_eq!(ranks, threads, "{overlap:?} against Threads");
    }
}

#[test]
fn two_runs_with_the_same_seed_are_bitwise_identical() {
    let batches = random_batches(10, STEPS, 8, SmallCnn::<DpFlex>::FEATURES, 10);
    let dp = DataParallelConfig {
        bucket_cap_bytes: 512,
        ..config()
    };
    let a = data_parallel(2, SmallCnn::new, &batches, 1, dp.clone());
    let b = data_parallel(2, SmallCnn::new, &batches, 1, dp);
    assert_eq!(a, b);
}

#[test]
fn accumulation_without_sync_matches_the_whole_batch() {
    let batches = random_batches(11, STEPS, 8, SmallCnn::<DpFlex>::FEATURES, 10);
    let reference = single(SmallCnn::new, &batches, 1);
    // Two ranks, each with two micro-batches of 2: one all-reduce per step.
    let ranks = data_parallel(2, SmallCnn::new, &batches, 2, config());
    assert_matches(&reference, &ranks, TOLERANCE, "2 ranks x 2 micro-batches");
    // One rank accumulating alone gives the same (world size 1 keeps no_sync's meaning).
    let alone = single(SmallCnn::new, &batches, 4);
    assert!(max_abs_diff(&reference, &alone) <= TOLERANCE);
}

#[test]
fn bf16_communication_with_error_feedback_stays_close() {
    let batches = random_batches(12, STEPS, 8, SmallCnn::<DpFlex>::FEATURES, 10);
    let reference = single(SmallCnn::new, &batches, 1);
    let dp = DataParallelConfig {
        grad_dtype: GradDType::Bf16,
        ..config()
    };
    let ranks = data_parallel(2, SmallCnn::new, &batches, 1, dp);
    let d = max_abs_diff(&reference, &ranks[0]);
    assert!(d > 0.0, "bf16 rounding must show");
    assert!(d <= 5e-3, "bf16 communication drifted by {d:e}");
    assert_eq!(ranks[0], ranks[1]);
}

/// What burn-train's DDP does to each replica: `fork` (a copy of every parameter on the worker's
/// device, same ids) and `ModuleSharder` (marks every parameter with its own id). No broadcast,
/// no registration with bonfire: sizes are learned in the first backward.
struct Sharder;
impl burn::module::ModuleMapper<DpFlex> for Sharder {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<burn::tensor::Tensor<DpFlex, D>>,
    ) -> burn::module::Param<burn::tensor::Tensor<DpFlex, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor =
            burn::tensor::Tensor::from_data(tensor.into_data(), &Device::default()).require_grad();
        let tensor = tensor.set_distributed(
            burn::tensor::backend::distributed::DistributedParamId::from(id.val()),
        );
        burn::module::Param::from_mapped_value(id, tensor, mapper)
    }
}

#[test]
fn parameters_marked_elsewhere_are_planned_after_their_first_backward() {
    use burn::module::Module;
    let batches = random_batches(13, STEPS, 8, SmallCnn::<DpFlex>::FEATURES, 10);
    let reference = single(SmallCnn::new, &batches, 1);
    // Clones of one model (same ids on every rank, as burn-train's DDP makes them). Clones share
    // their autodiff nodes, so each rank copies its parameters first, as `fork` does.
    let model = seeded::<DpFlex, _>(1, &Device::default(), SmallCnn::new);
    let models = RankModels::new(vec![model.clone(), model]);
    let shards: Vec<Vec<Batch>> = (0..2)
        .map(|r| batches.iter().map(|b| b.slice(r * 4, 4)).collect())
        .collect();
    let ranks = run_ranks(
        Communicator::in_process(2, comm_config()),
        Duration::from_secs(300),
        move |comm| {
            let r = comm.rank();
            let model = models.take(r);
            let _bind = bind_thread(comm, config());
            let model = model.map(&mut Sharder);
            let (model, _) = train(model, &shards[r], 1, &Device::default());
            parameters(&model)
        },
    );
    assert_matches(&reference, &ranks, TOLERANCE, "marked by a sharder");
}
