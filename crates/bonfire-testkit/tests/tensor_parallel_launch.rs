//! `Autodiff<TensorParallel<Flex>>` across processes: 2 ranks under the launcher with
//! `BONFIRE_TP=2`, over QUIC; and `Autodiff<Hybrid<Flex>>`: 4 ranks with `BONFIRE_TP=2` (2
//! replicas of 2 tensor-parallel ranks, each replica on half of every batch). Each starts from a
//! plain single-device record, splits it by the plan, trains 5 Adam steps; the gathered
//! parameters (and the plain record rank 0 saves from them) equal single-device training on the
//! whole batch from the same record (within 1e-5).

use std::time::Duration;

use bonfire::backend::tensor_parallel::load_whole;
use bonfire::backend::{DataParallelConfig, FailurePolicy, bind_thread};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire_launch::{LaunchConfig, launch};
use bonfire_testkit::nets::{DpFlex, max_abs_diff, parameters, read_params, seeded};
use bonfire_testkit::tp::{TpEncoder, TpGpt, TpNet, adam_steps};
use burn::backend::flex::FlexDevice;
use burn::module::AutodiffModule;
use burn::record::{BinFileRecorder, FullPrecisionSettings};

const CHECK: &str = env!("CARGO_BIN_EXE_bonfire-tp-check");
const STEPS: usize = 5;

fn check<M>(name: &str, make: fn(&FlexDevice) -> M, ranks: usize)
where
    M: TpNet<DpFlex> + AutodiffModule<DpFlex>,
{
    let dir = std::env::temp_dir().join(format!("bonfire-tp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let _bind = bind_thread(
        Communicator::in_process(1, CommConfig::default()).remove(0),
        DataParallelConfig {
            failure: FailurePolicy::Panic,
            ..DataParallelConfig::default()
        },
    );
    let device = FlexDevice;
    let recorder = BinFileRecorder::<FullPrecisionSettings>::new();
    let start = seeded::<DpFlex, _>(1, &device, make);
    start
        .clone()
        .save_file(dir.join("init"), &recorder)
        .expect("save the initial record");
    let want = parameters(&adam_steps(start, STEPS, &device).0);

    let mut c = LaunchConfig::local(ranks, CHECK);
    c.args = vec![
        name.split('-').next().unwrap_or(name).into(),
        STEPS.to_string().into(),
        dir.join("init.bin").into(),
        dir.clone().into(),
    ];
    c.extra_env = vec![("BONFIRE_TP".into(), "2".into())];
    c.timeout = Some(Duration::from_secs(60));
    launch(&c).expect("the job succeeds");

    let flat: Vec<f32> = want.iter().flatten().copied().collect();
    for r in 0..ranks {
        let got = read_params(&dir.join(format!("rank{r}.bin")));
        let d = max_abs_diff(&[got], std::slice::from_ref(&flat));
        assert!(
            d <= 1e-5,
            "{name}: rank {r}'s gathered parameters differ by {d:e}"
        );
    }
    let whole = make(&device)
        .load_file(dir.join("whole"), &recorder, &device)
        .expect("rank 0's plain record loads on one device");
    let d = max_abs_diff(&parameters(&whole), &want);
    assert!(d <= 1e-5, "{name}: the plain record differs by {d:e}");
    // The replicas' shards, loaded whole on one device, are that same record.
    let unsplit =
        load_whole(make(&device), &dir.join("shards-dp0")).expect("the shards load on one device");
    assert!(
        parameters(&unsplit) == parameters(&whole),
        "{name}: the shards loaded whole differ from the gathered record"
    );
    for replica in 0..ranks / 2 {
        assert!(
            dir.join(format!("shards-dp{replica}/tp-rank1-of-2.bin"))
                .exists()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn transformer_encoder_over_two_processes_matches_one_device() {
    check("encoder", TpEncoder::new, 2);
}

#[test]
fn gpt_block_over_two_processes_matches_one_device() {
    check("gpt", TpGpt::new, 2);
}

#[test]
fn gpt_block_over_dp2_x_tp2_processes_matches_one_device_on_the_union_batch() {
    check("gpt-hybrid", TpGpt::new, 4);
}
