//! Pipeline parallelism against one device: `bonfire_testkit::pp`'s stack of blocks split over 2
//! and 4 stages, one process per stage under the launcher, 4 micro-batches, GPipe and 1F1B. The
//! last stage's loss, every gradient of every stage's blocks, and its parameters after each of 3
//! Adam steps equal one device's on the whole batch (f32, within 1e-5); a stage holds as many
//! micro-batches' graphs as its schedule says (all of them under GPipe, `p - stage` under 1F1B).
//! A silent neighbour, a stage returning the wrong kind and a second stage in one process are
//! errors that name them.

use std::time::Duration;

use bonfire::backend::{DataParallelConfig, FailurePolicy, bind_thread};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire::pipeline::{Pipeline, PipelineError, Schedule, StageOutput, partition};
use bonfire_launch::{LaunchConfig, launch};
use bonfire_testkit::nets::{DpFlex, max_abs_diff, parameters, read_params};
use bonfire_testkit::pp::{BLOCKS, Stage, batch, gradients_of, mse, stage};
use bonfire_testkit::run_ranks;
use burn::backend::flex::FlexDevice;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};

const CHECK: &str = env!("CARGO_BIN_EXE_bonfire-pp-check");
const MICRO: usize = 4;
const STEPS: usize = 3;
const TOLERANCE: f32 = 1e-5;

/// Held by the tests that run a stage in this process: a process runs one stage at a time.
static IN_PROCESS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn comm_config(timeout: Duration) -> CommConfig {
    CommConfig {
        timeout,
        ..CommConfig::default()
    }
}

fn bind_one() -> bonfire::backend::BindGuard {
    bind_thread(
        Communicator::in_process(1, comm_config(Duration::from_secs(30))).remove(0),
        DataParallelConfig {
            failure: FailurePolicy::Panic,
            ..DataParallelConfig::default()
        },
    )
}

/// A step of a run: the loss, every gradient, and every parameter after the step.
type Step = (f32, Vec<Vec<f32>>, Vec<Vec<f32>>);

/// One device, the whole batch, every block, `STEPS` Adam steps.
fn one_device() -> Vec<Step> {
    let device = FlexDevice;
    let _bind = bind_one();
    let mut model = stage(0..BLOCKS, &device);
    let mut optim = AdamConfig::new().init();
    let (x, y) = batch(&device);
    (0..STEPS)
        .map(|_| {
            let loss = mse(model.forward(x.clone()), y.clone());
            let value = loss.clone().into_scalar();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let g = gradients_of(&model, &grads);
            model = optim.step(1e-2, model.clone(), grads);
            (value, g, parameters(&model))
        })
        .collect()
}

fn check(stages: usize, schedule: Schedule) {
    let want = one_device();
    let dir = std::env::temp_dir().join(format!(
        "bonfire-pp-{schedule}-{stages}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = LaunchConfig::local(stages, CHECK);
    c.args = vec![
        schedule.name().into(),
        STEPS.to_string().into(),
        MICRO.to_string().into(),
        dir.clone().into(),
    ];
    c.timeout = Some(Duration::from_secs(60));
    launch(&c).expect("the pipeline job succeeds");
    let ranges = partition(&[1; BLOCKS], stages);
    for (s, range) in ranges.iter().enumerate() {
        // A block has two parameters (weight, bias): the stage's share of the model's lists.
        let params = range.start * 2..range.end * 2;
        let mut got = read_params(&dir.join(format!("rank{s}.bin"))).into_iter();
        let mut take = |n: usize| got.by_ref().take(n).collect::<Vec<f32>>();
        for (step, (loss, grads, after)) in want.iter().enumerate() {
            let name = format!("{schedule} at pp {stages}, stage {s}, step {step}");
            let stage_loss = take(1)[0];
            if s + 1 == stages {
                assert!(
                    (stage_loss - loss).abs() <= TOLERANCE,
                    "{name}: loss {stage_loss} against {loss}"
                );
            }
            for (what, want) in [("gradient", grads), ("parameter", after)] {
                for (i, w) in want[params.clone()].iter().enumerate() {
                    let g = take(w.len());
                    let d = max_abs_diff(&[g], std::slice::from_ref(w));
                    assert!(d <= TOLERANCE, "{name}: {what} {i} differs by {d:e}");
                }
            }
        }
        assert!(got.next().is_none(), "stage {s} wrote more than expected");
        let held: usize = std::fs::read_to_string(dir.join(format!("rank{s}.held")))
            .unwrap()
            .parse()
            .unwrap();
        let expected = match schedule {
            Schedule::GPipe => MICRO,
            Schedule::OneFOneB => (stages - s).min(MICRO),
        };
        assert_eq!(
            held, expected,
            "{schedule} at pp {stages}: stage {s} held {held} micro-batches"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpipe_over_two_and_four_processes_equals_one_device() {
    check(2, Schedule::GPipe);
    check(4, Schedule::GPipe);
}

#[test]
fn one_f_one_b_over_two_and_four_processes_equals_one_device() {
    check(2, Schedule::OneFOneB);
    check(4, Schedule::OneFOneB);
}

/// A stage that returns what its place does not give is an error naming the stage and the
/// micro-batch; a pipeline of no micro-batches is refused, and so is a second stage in a process
/// that runs one.
#[test]
fn a_stage_returning_the_wrong_kind_and_a_second_stage_are_refused() {
    let _serial = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let one = || Communicator::in_process(1, comm_config(Duration::from_secs(30))).remove(0);
    assert!(matches!(
        Pipeline::new(one(), Schedule::GPipe, 0),
        Err(PipelineError::NoMicroBatches)
    ));
    let device = FlexDevice;
    let _bind = bind_one();
    let pipe = Pipeline::new(one(), Schedule::GPipe, 2).unwrap();
    assert!(matches!(
        Pipeline::new(one(), Schedule::GPipe, 2),
        Err(PipelineError::SecondStage)
    ));
    let model = stage(0..1, &device);
    let (x, _) = batch(&device);
    let step = pipe.step(&model, &device, |m: &Stage<DpFlex>, _, _| {
        StageOutput::Activation(m.forward(x.clone()))
    });
    let Err(err) = step else {
        panic!("the last stage must give a loss");
    };
    assert_eq!(
        err.to_string(),
        "pipeline stage 0 of 1: micro-batch 0: the last stage returned an activation, not a loss"
    );
    // The place is free again once the stage (every clone of it) is gone.
    let clone = pipe.clone();
    drop(pipe);
    assert!(Pipeline::new(one(), Schedule::GPipe, 2).is_err());
    drop(clone);
    assert!(Pipeline::new(one(), Schedule::GPipe, 2).is_ok());
}

/// A stage whose neighbour never takes part ends its step within the collective timeout, with an
/// error naming the stage, the micro-batch, what was moving and the silent peer.
#[test]
fn a_silent_neighbour_is_named_within_the_timeout() {
    let _serial = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let errors = run_ranks(
        Communicator::in_process(2, comm_config(Duration::from_secs(2))),
        Duration::from_secs(60),
        |comm| {
            if comm.rank() == 1 {
                // Stage 1 never runs its step.
                std::thread::sleep(Duration::from_secs(4));
                return String::new();
            }
            let device = FlexDevice;
            let _bind = bind_one();
            let pipe = Pipeline::new(comm, Schedule::GPipe, 2).unwrap();
            let model = stage(0..1, &device);
            let (x, _) = batch(&device);
            let started = std::time::Instant::now();
            let step = pipe.step(&model, &device, |m: &Stage<DpFlex>, _, _| {
                StageOutput::Activation(m.forward(x.clone()))
            });
            let Err(err) = step else {
                panic!("a step without its neighbour fails");
            };
            assert!(started.elapsed() < Duration::from_secs(4));
            err.to_string()
        },
    );
    let err = &errors[0];
    assert!(
        err.starts_with("pipeline stage 0 of 2: receiving the gradient of micro-batch 0: ")
            && err.contains("rank 1"),
        "{err}"
    );
}
