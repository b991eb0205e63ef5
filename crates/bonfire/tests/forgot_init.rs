//! A rank of several that forgot `bonfire::init()` is told so before it trains alone: this test
//! runs itself again as "rank 1 of 2" (RANK and WORLD_SIZE set, no launcher, no init) and
//! expects that child to fail with the message, not to finish a step.

use std::process::Command;

use bonfire::DataParallel;
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::Tensor;

type B = Autodiff<DataParallel<Flex>>;

const CHILD: &str = "BONFIRE_TEST_FORGOT_INIT_CHILD";

/// What the user's program does, minus `bonfire::init()`.
fn train_without_init() {
    let device = FlexDevice;
    let model: Linear<B> = LinearConfig::new(4, 2).init(&device);
    let mut model = bonfire::replicate(model);
    let mut optim = SgdConfig::new().init();
    let x = Tensor::<B, 2>::ones([3, 4], &device);
    let loss = model.forward(x).sum();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    model = optim.step(0.1, model, grads);
    drop(model);
    println!("trained a step alone");
}

#[test]
fn a_rank_that_did_not_call_init_fails_before_training_alone() {
    if std::env::var_os(CHILD).is_some() {
        train_without_init();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_rank_that_did_not_call_init_fails_before_training_alone",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the child succeeded:\n{stdout}\n{stderr}"
    );
    assert!(!stdout.contains("trained a step alone"), "{stdout}");
    assert!(
        stderr.contains(
            "bonfire: this process is rank 1 of 2 (from RANK/WORLD_SIZE) but bonfire::init() was not called"
        ),
        "{stderr}"
    );
}

#[test]
fn a_process_alone_trains_without_init() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_rank_that_did_not_call_init_fails_before_training_alone",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("SLURM_PROCID")
        .env_remove("SLURM_NTASKS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("trained a step alone"), "{stdout}");
}
