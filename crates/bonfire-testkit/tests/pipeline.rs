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
    check_chunks(stages, schedule, 1);
}

/// `stages` processes, each holding `chunks` chunks of the model (interleaved 1F1B above 1).
fn check_chunks(stages: usize, schedule: Schedule, chunks: usize) {
    let want = one_device();
    let dir = std::env::temp_dir().join(format!(
        "bonfire-pp-{schedule}-{stages}-{chunks}-{}",
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
        chunks.to_string().into(),
    ];
    c.timeout = Some(Duration::from_secs(60));
    launch(&c).expect("the pipeline job succeeds");
    let ranges = partition(&[1; BLOCKS], stages * chunks);
    let what = format!("{schedule} at pp {stages} with {chunks} chunk(s)");
    for s in 0..stages {
        // A block has two parameters (weight, bias): the stage's chunks' shares of the model's
        // lists, chunk after chunk.
        let params: Vec<usize> = (0..chunks)
            .flat_map(|c| ranges[c * stages + s].clone())
            .flat_map(|b| [2 * b, 2 * b + 1])
            .collect();
        let mut got = read_params(&dir.join(format!("rank{s}.bin"))).into_iter();
        let mut take = |n: usize| got.by_ref().take(n).collect::<Vec<f32>>();
        for (step, (loss, grads, after)) in want.iter().enumerate() {
            let name = format!("{what}, stage {s}, step {step}");
            let stage_loss = take(1)[0];
            if s + 1 == stages {
                assert!(
                    (stage_loss - loss).abs() <= TOLERANCE,
                    "{name}: loss {stage_loss} against {loss}"
                );
            }
            for (kind, want) in [("gradient", grads), ("parameter", after)] {
                for &i in &params {
                    let w = &want[i];
                    let g = take(w.len());
                    let d = max_abs_diff(&[g], std::slice::from_ref(w));
                    assert!(d <= TOLERANCE, "{name}: {kind} {i} differs by {d:e}");
                }
            }
        }
        assert!(got.next().is_none(), "stage {s} wrote more than expected");
        let held: usize = std::fs::read_to_string(dir.join(format!("rank{s}.held")))
            .unwrap()
            .parse()
            .unwrap();
        // Interleaved: Megatron-LM's warm-up of 2 (p - 1 - s) + (v - 1) p forwards, then one
        // more in flight in the steady state.
        let total = MICRO * chunks;
        let expected = match (schedule, chunks) {
            (Schedule::GPipe, _) => MICRO,
            (Schedule::OneFOneB, 1) => (stages - s).min(MICRO),
            (Schedule::OneFOneB, v) => {
                let warmup = ((stages - 1 - s) * 2 + (v - 1) * stages).min(total);
                if warmup < total { warmup + 1 } else { total }
            }
        };
        assert_eq!(
            held, expected,
            "{what}: stage {s} held {held} micro-batches"
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

/// Interleaved 1F1B: the 4 blocks in 4 chunks over 2 processes (rank 0 holds blocks 0 and 2,
/// rank 1 blocks 1 and 3), so each micro-batch passes each rank twice, the activations of
/// block 1 going back to rank 0 and the gradients of block 2 to rank 1.
#[test]
fn interleaved_one_f_one_b_over_two_processes_equals_one_device() {
    check_chunks(2, Schedule::OneFOneB, 2);
}

/// The order interleaving runs in, and what it refuses.
#[test]
fn interleaving_orders_micro_batches_in_groups_and_refuses_what_it_cannot_run() {
    let order = |stage| {
        bonfire::pipeline::tasks(Schedule::OneFOneB, 2, stage, 4, 2)
            .iter()
            .map(|t| {
                format!(
                    "{}{}.{}",
                    if t.forward { 'F' } else { 'B' },
                    t.chunk,
                    t.micro
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    // Rank 0 warms up with 2 + 2 forwards, rank 1 with 2; micro-batches go 2 at a time through
    // chunk 0, then chunk 1 (backwards from chunk 1).
    assert_eq!(
        order(0),
        "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3"
    );
    assert_eq!(
        order(1),
        "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3"
    );
    // One chunk is 1F1B as it was.
    let plain = bonfire::pipeline::tasks(Schedule::OneFOneB, 2, 0, 4, 1);
    let forwards: Vec<bool> = plain.iter().map(|t| t.forward).collect();
    assert_eq!(
        forwards,
        [true, true, false, true, false, true, false, false]
    );
    assert!((bonfire::pipeline::bubble_interleaved(2, 4, 2) - 1.0 / 9.0).abs() < 1e-12);
    assert_eq!(
        bonfire::pipeline::bubble_interleaved(2, 4, 1),
        bonfire::pipeline::bubble(2, 4)
    );
    // Refused before any message: one rank of a group of 2 (or 1) is enough.
    let _serial = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let refused = |stages: usize, schedule, micro, chunks| {
        let comm = Communicator::in_process(stages, comm_config(Duration::from_secs(30))).remove(0);
        match Pipeline::new(comm, schedule, micro).and_then(|p| p.interleaved(chunks)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{stages} stages, {schedule}, {micro} micro-batches, {chunks} chunks"),
        }
    };
    assert_eq!(
        refused(2, Schedule::OneFOneB, 3, 2),
        "2 chunks per stage over 2 stages and 3 micro-batches: the stages must divide the \
         micro-batches"
    );
    assert!(refused(2, Schedule::GPipe, 4, 2).ends_with("interleaving runs the 1f1b schedule"));
    assert!(refused(1, Schedule::OneFOneB, 4, 2).ends_with("needs 2 stages or more"));
    assert!(refused(2, Schedule::OneFOneB, 4, 0).ends_with("a rank holds 1 chunk or more"));
}

/// Every directed pair of ranks sends, on each channel (activations, gradients), in the order
/// its peer receives (point-to-point messages are matched in call order, so anything else would
/// pair two different tensors), and with sends that do not block the orders run to their end:
/// 2, 3 and 4 stages, 1, 2 and 3 chunks, `p`, `2p` and `3p` micro-batches, replayed from
/// [`bonfire::pipeline::tasks`].
#[test]
fn every_pair_sends_in_the_order_its_peer_receives_and_no_order_waits_forever() {
    use std::collections::{BTreeMap, VecDeque};
    // (channel: 0 activations, 1 gradients; from; to) and what a message is: the sender's
    // place in the model (chunk * p + rank) and the micro-batch.
    type Pair = (u8, usize, usize);
    type Message = (usize, usize);
    for p in 2..=4 {
        for v in 1..=3 {
            for m in [p, 2 * p, 3 * p] {
                for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
                    if v > 1 && schedule == Schedule::GPipe {
                        continue;
                    }
                    let what = format!("{schedule}, {p} stages, {v} chunk(s), {m} micro-batches");
                    let last = v * p - 1;
                    // Each rank's sends (true) and receives (false), in its order.
                    let ops: Vec<Vec<(bool, Pair, Message)>> = (0..p)
                        .map(|r| {
                            let mut ops = Vec::new();
                            for t in bonfire::pipeline::tasks(schedule, p, r, m, v) {
                                let at = t.chunk * p + r;
                                let (next, previous) = ((r + 1) % p, (r + p - 1) % p);
                                if t.forward {
                                    if at > 0 {
                                        ops.push((false, (0, previous, r), (at - 1, t.micro)));
                                    }
                                    if at < last {
                                        ops.push((true, (0, r, next), (at, t.micro)));
                                    }
                                } else {
                                    if at < last {
                                        ops.push((false, (1, next, r), (at + 1, t.micro)));
                                    }
                                    if at > 0 {
                                        ops.push((true, (1, r, previous), (at, t.micro)));
                                    }
                                }
                            }
                            ops
                        })
                        .collect();
                    let mut sent: BTreeMap<Pair, Vec<Message>> = BTreeMap::new();
                    let mut taken: BTreeMap<Pair, Vec<Message>> = BTreeMap::new();
                    for &(send, pair, message) in ops.iter().flatten() {
                        let list = if send { &mut sent } else { &mut taken };
                        list.entry(pair).or_default().push(message);
                    }
                    assert_eq!(sent, taken, "{what}");
                    // Run the orders: a send never waits, a receive waits for its message.
                    let mut queues: BTreeMap<Pair, VecDeque<Message>> = BTreeMap::new();
                    let mut at = vec![0; p];
                    while at.iter().zip(&ops).any(|(&i, o)| i < o.len()) {
                        let mut moved = false;
                        for r in 0..p {
                            while let Some(&(send, pair, message)) = ops[r].get(at[r]) {
                                let queue = queues.entry(pair).or_default();
                                if send {
                                    queue.push_back(message);
                                } else if queue.front() == Some(&message) {
                                    queue.pop_front();
                                } else {
                                    break;
                                }
                                at[r] += 1;
                                moved = true;
                            }
                        }
                        assert!(moved, "{what}: every rank waits, at {at:?}");
                    }
                }
            }
        }
    }
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
