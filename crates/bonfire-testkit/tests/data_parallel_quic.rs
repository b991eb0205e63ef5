//! `Autodiff<DataParallel<Flex>>` across processes: 2 ranks under the launcher, over QUIC, each
//! with batch b, against one rank with batch 2b trained in this process (same parameters after
//! K steps, max abs difference at most 1e-5), for the CNN and the transformer block.

use std::time::Duration;

use bonfire::backend::{DataParallelConfig, FailurePolicy, bind_thread};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire_launch::{LaunchConfig, launch};
use bonfire_testkit::nets::{
    DpFlex, Net, SmallCnn, SmallTransformer, max_abs_diff, parameters, random_batches, read_params,
    seeded, train,
};
use burn::backend::flex::FlexDevice;
use burn::module::AutodiffModule;

const CHECK: &str = env!("CARGO_BIN_EXE_bonfire-dp-check");
const STEPS: usize = 3;
const ROWS: usize = 4;

/// One rank in this process, whole batches (the same batches `bonfire-dp-check` slices).
fn single<M>(make: fn(&FlexDevice) -> M) -> Vec<Vec<f32>>
where
    M: Net<DpFlex> + AutodiffModule<DpFlex>,
{
    let _bind = bind_thread(
        Communicator::in_process(1, CommConfig::default()).remove(0),
        DataParallelConfig {
            failure: FailurePolicy::Panic,
            ..DataParallelConfig::default()
        },
    );
    let device = FlexDevice;
    let model = bonfire::replicate(seeded::<DpFlex, _>(1, &device, make));
    let batches = random_batches(21, STEPS, 2 * ROWS, M::FEATURES, M::CLASSES);
    parameters(&train(model, &batches, 1, &device).0)
}

fn flat(p: &[Vec<f32>]) -> Vec<f32> {
    p.iter().flatten().copied().collect()
}

fn two_processes(model: &str) -> (Vec<f32>, Vec<f32>) {
    let dir = std::env::temp_dir().join(format!("bonfire-dp-{model}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = LaunchConfig::local(2, CHECK);
    c.args = vec![
        model.into(),
        STEPS.to_string().into(),
        ROWS.to_string().into(),
        dir.clone().into(),
    ];
    c.timeout = Some(Duration::from_secs(60));
    launch(&c).expect("the two-process job succeeds");
    let out = (
        read_params(&dir.join("rank0.bin")),
        read_params(&dir.join("rank1.bin")),
    );
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn check<M>(name: &str, make: fn(&FlexDevice) -> M)
where
    M: Net<DpFlex> + AutodiffModule<DpFlex>,
{
    let reference = flat(&single(make));
    let (r0, r1) = two_processes(name);
    assert_eq!(r0, r1, "{name}: the two processes' replicas differ");
    let d = max_abs_diff(&[reference], &[r0]);
    assert!(
        d <= 1e-5,
        "{name}: 2 processes x {ROWS} differ from 1 x {} by {d:e}",
        2 * ROWS
    );
}

#[test]
fn cnn_over_quic_matches_one_rank_with_the_whole_batch() {
    check("cnn", SmallCnn::new);
}

#[test]
fn transformer_block_over_quic_matches_one_rank_with_the_whole_batch() {
    check("transformer", SmallTransformer::new);
}
