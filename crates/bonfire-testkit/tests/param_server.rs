//! `bonfire::param_server` against references: ranks as threads of this process, the same
//! model and batches.
//!
//! - Synchronous servers are data parallelism: two workers with one or two servers end within
//!   1e-6 of two all-reducing ranks after 20 Adam steps (the mean is summed on the server).
//! - One asynchronous worker is single-device training, bit for bit up to the same rounding.
//! - Asynchronous servers apply every push, report the staleness of each (the histogram counts
//!   every push) and keep every worker within the bound.
//! - An asynchronous job goes on when a worker dies; the server names it.
//! - A worker that starts from other parameters is named.

use std::time::Duration;

use bonfire::{ParamServer, PsReport, PsRole};
use bonfire_testkit::nets::{
    Batch, DpFlex, Net, SmallCnn, loss, max_abs_diff, parameters, random_batches, seeded,
};
use bonfire_testkit::{RankModels, bind_rank, in_process_ranks, run_ranks};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};

type Device = burn::backend::flex::FlexDevice;
type Net2 = SmallCnn<DpFlex>;
type Params = Vec<Vec<f32>>;
type Adam = burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Net2, DpFlex>;

const LR: f64 = 1e-2;

fn batches(seed: u64, steps: usize, rows: usize) -> Vec<Batch> {
    random_batches(seed, steps, rows, Net2::FEATURES, Net2::CLASSES)
}

fn adam() -> Adam {
    AdamConfig::new().init::<DpFlex, Net2>()
}

/// One step of `optim` on worker `w`'s slice of `batch` (of `workers`).
fn step<O: Optimizer<Net2, DpFlex>>(
    model: Net2,
    optim: &mut O,
    batch: &Batch,
    w: usize,
    workers: usize,
) -> Net2 {
    let n = batch.rows() / workers;
    let l = loss(&model, &batch.slice(w * n, n), 1.0, &Device::default());
    let grads = GradientsParams::from_grads(l.backward(), &model);
    optim.step(LR, model, grads)
}

/// What a rank ends with: a worker's parameters and pushes, or a server's report.
enum End {
    Worker(Params, u64),
    Server(PsReport),
}

/// How each worker trains in [`run`]: steps it takes, whether it dies after them instead of
/// finishing, and a pause before each step.
#[derive(Clone, Copy)]
struct Workers {
    steps: fn(usize) -> usize,
    dies: fn(usize) -> bool,
    pause: fn(usize) -> Duration,
}

const PLAIN: Workers = Workers {
    steps: all,
    dies: never,
    pause: no_pause,
};

/// Trains `world` ranks (`servers` of them serving) from the same seeded model: each worker
/// trains on its slice of `batches` as `how` says, with the optimizer `make` gives; a rank's
/// communicator times out after `timeout`.
fn run<F>(world: usize, batches: &[Batch], timeout: Duration, make: F, how: Workers) -> Vec<End>
where
    F: Fn() -> ParamServer<Adam> + Send + Sync + 'static,
{
    let device = Device::default();
    let models = RankModels::new(
        (0..world)
            .map(|_| seeded::<DpFlex, _>(7, &device, SmallCnn::new))
            .collect(),
    );
    let batches = batches.to_vec();
    let comms = in_process_ranks(world, timeout);
    run_ranks(comms, Duration::from_secs(300), move |comm| {
        let r = comm.rank();
        let mut model = models.take(r);
        let _bind = bind_rank(comm);
        let mut optim = make();
        match optim.role(&Device::default()) {
            PsRole::Server { .. } => End::Server(optim.serve(model).1),
            PsRole::Worker { index, workers } => {
                for b in batches.iter().take((how.steps)(index)) {
                    std::thread::sleep((how.pause)(index));
                    model = step(model, &mut optim, b, index, workers);
                }
                if !(how.dies)(index) {
                    model = optim.finish(model);
                }
                End::Worker(parameters(&model), optim.stats().pushes)
            }
        }
    })
}

/// Every rank's parameters after all-reducing data parallelism over `world` ranks.
fn ddp(world: usize, batches: &[Batch]) -> Vec<Params> {
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
        let model = models.take(r);
        let _bind = bind_rank(comm);
        let mut model = bonfire::replicate(model);
        let mut optim = adam();
        for b in &batches {
            model = step(model, &mut optim, b, r, world);
        }
        parameters(&model)
    })
}

fn workers(ends: &[End]) -> Vec<(&Params, u64)> {
    ends.iter()
        .filter_map(|e| match e {
            End::Worker(p, n) => Some((p, *n)),
            End::Server(_) => None,
        })
        .collect()
}

fn servers(ends: &[End]) -> Vec<&PsReport> {
    ends.iter()
        .filter_map(|e| match e {
            End::Server(r) => Some(r),
            End::Worker(..) => None,
        })
        .collect()
}

fn all(_: usize) -> usize {
    usize::MAX
}

fn never(_: usize) -> bool {
    false
}

fn no_pause(_: usize) -> Duration {
    Duration::ZERO
}

#[test]
fn synchronous_servers_equal_all_reduce_within_1e6_after_20_steps() {
    let b = batches(31, 20, 8);
    let reference = ddp(2, &b);
    for servers_n in [1, 2] {
        let ends = run(
            2 + servers_n,
            &b,
            Duration::from_secs(20),
            move || bonfire::param_server(adam(), servers_n),
            PLAIN,
        );
        let w = workers(&ends);
        assert_eq!(w.len(), 2);
        assert!(w[0].0 == w[1].0, "the workers pulled the same parameters");
        let diff = max_abs_diff(w[0].0, &reference[0]);
        assert!(
            diff <= 1e-6,
            "{servers_n} synchronous server(s) end {diff:e} from all-reduce after 20 Adam steps"
        );
        let start = parameters(&seeded::<DpFlex, _>(7, &Device::default(), SmallCnn::new));
        assert!(max_abs_diff(&start, w[0].0) > 1e-3, "training moved them");
        assert_eq!(w[0].1, 20);
        let reports = servers(&ends);
        assert_eq!(reports.len(), servers_n);
        for r in &reports {
            assert_eq!(r.versions, 20, "{}", r.line());
            assert_eq!(r.staleness, vec![40], "two pushes a step, none stale");
            assert_eq!(r.finished, vec![0, 1]);
            assert!(r.departed.is_empty());
        }
        let owned: usize = reports.iter().map(|r| r.elements).sum();
        let trained: usize = start.iter().map(Vec::len).sum::<usize>();
        assert!(
            owned <= trained && owned > 0,
            "the servers own the trained parameters once: {owned} of {trained} elements"
        );
        if servers_n == 2 {
            assert!(
                reports.iter().all(|r| r.elements > 0),
                "both servers own a share: {:?}",
                reports.iter().map(|r| r.elements).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn one_asynchronous_worker_is_single_device_training() {
    let b = batches(32, 8, 4);
    let single = ddp(1, &b);
    let ends = run(
        2,
        &b,
        Duration::from_secs(20),
        || bonfire::param_server(adam(), 1).asynchronous(0),
        PLAIN,
    );
    let w = workers(&ends);
    let diff = max_abs_diff(w[0].0, &single[0]);
    assert!(
        diff <= 1e-6,
        "one asynchronous worker is {diff:e} from one device"
    );
    let r = servers(&ends)[0];
    assert_eq!(
        (r.versions, r.staleness.clone()),
        (8, vec![8]),
        "{}",
        r.line()
    );
}

#[test]
fn asynchronous_servers_apply_every_push_within_the_staleness_bound() {
    let b = batches(33, 6, 9);
    // Worker 2 pauses before each step: the others run ahead until the bound holds them.
    let ends = run(
        4,
        &b,
        Duration::from_secs(20),
        || bonfire::param_server(adam(), 1).asynchronous(1),
        Workers {
            pause: |w| Duration::from_millis(if w == 2 { 150 } else { 0 }),
            ..PLAIN
        },
    );
    let r = servers(&ends)[0];
    assert_eq!(r.versions, 18, "one step per push: {}", r.line());
    assert_eq!(r.staleness.iter().sum::<u64>(), 18, "{}", r.line());
    // The three first pushes are computed on the start: the second and third to be applied
    // are stale by 1 and 2 at least.
    assert!(r.staleness.len() >= 3, "{}", r.line());
    // Between a worker's pull and its next push, each of the 2 others pushes at most 2s + 1
    // = 3 times under bound s = 1 (it was at most s behind at the pull, and at most s ahead at
    // the push): no push is staler than 6.
    assert!(r.staleness.len() <= 7, "{}", r.line());
    assert!(
        r.held > 0,
        "the slow worker held the others back: {}",
        r.line()
    );
    assert!(r.max_lead <= 1, "{}", r.line());
    let mut finished = r.finished.clone();
    finished.sort();
    assert_eq!(finished, vec![0, 1, 2]);
    let w = workers(&ends);
    for (p, n) in &w {
        assert_eq!(*n, 6);
        assert!(p.iter().flatten().all(|v| v.is_finite()));
        assert!(
            *p == w[0].0,
            "finish gives every worker the servers' final parameters"
        );
    }
}

#[test]
fn an_asynchronous_job_goes_on_when_a_worker_dies() {
    let b = batches(34, 8, 9);
    fn steps(w: usize) -> usize {
        if w == 2 { 3 } else { 8 }
    }
    let ends = run(
        4,
        &b,
        Duration::from_secs(5),
        || bonfire::param_server(adam(), 1).asynchronous(2),
        Workers {
            steps,
            dies: |w| w == 2,
            pause: no_pause,
        },
    );
    let r = servers(&ends)[0];
    assert_eq!(r.departed.len(), 1, "{}", r.line());
    let gone = &r.departed[0];
    assert_eq!((gone.worker, gone.pushes), (2, 3), "{}", r.line());
    assert!(!gone.reason.is_empty());
    let mut finished = r.finished.clone();
    finished.sort();
    assert_eq!(finished, vec![0, 1], "the others trained on: {}", r.line());
    assert_eq!(r.versions, 3 + 8 + 8);
    assert!(r.line().contains("dropped worker 2 after 3 pushes"));
}

#[test]
fn a_worker_that_starts_from_other_parameters_is_named() {
    let device = Device::default();
    let models = RankModels::new(
        (0..3u64)
            .map(|r| seeded::<DpFlex, _>(if r == 1 { 8 } else { 7 }, &device, SmallCnn::new))
            .collect(),
    );
    let b = batches(35, 1, 4);
    let comms = in_process_ranks(3, Duration::from_secs(5));
    let errors = run_ranks(comms, Duration::from_secs(120), move |comm| {
        let r = comm.rank();
        let model = models.take(r);
        let _bind = bind_rank(comm);
        let mut optim = bonfire::param_server(adam(), 1);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match optim.role(&Device::default()) {
                PsRole::Server { .. } => drop(optim.serve(model)),
                PsRole::Worker { index, workers } => {
                    let m = step(model, &mut optim, &b[0], index, workers);
                    drop(optim.finish(m));
                }
            }
        }))
        .err()
        .and_then(|p| p.downcast_ref::<String>().cloned())
    });
    let server = errors[2].as_deref().expect("the server fails");
    assert!(
        server.contains("worker 1 starts from other parameters than server 0"),
        "{server}"
    );
    for (r, e) in errors.iter().enumerate().take(2) {
        assert!(e.is_some(), "worker {r} fails too (its pull is aborted)");
    }
}

/// Three processes under the launcher (two workers, one server) in `mode`: each worker's
/// parameters, and the server's report line.
fn three_processes(mode: &str, steps: usize, rows: usize) -> (Vec<f32>, Vec<f32>, String) {
    let (launched, out) = processes(3, mode, steps, rows, None);
    assert!(launched.lost.is_empty(), "{launched:?}");
    out
}

/// `n` processes under the launcher (the last one serves) in `mode`, worker `die.0` exiting
/// after `die.1` steps when given (an expendable rank): how the launch went, workers 0 and 1's
/// parameters and the server's report line.
fn processes(
    n: usize,
    mode: &str,
    steps: usize,
    rows: usize,
    die: Option<(usize, usize)>,
) -> (bonfire_launch::Launched, (Vec<f32>, Vec<f32>, String)) {
    let dir = std::env::temp_dir().join(format!("bonfire-ps-{mode}-{n}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = bonfire_launch::LaunchConfig::local(n, env!("CARGO_BIN_EXE_bonfire-ps-check"));
    c.args = vec![
        mode.into(),
        steps.to_string().into(),
        rows.to_string().into(),
        dir.clone().into(),
    ];
    if let Some((w, k)) = die {
        c.args.push(format!("{w}:{k}").into());
        c.expendable = vec![w];
    }
    c.timeout = Some(Duration::from_secs(60));
    c.peer_timeout = Some(Duration::from_secs(4));
    let launched = bonfire_launch::launch(&c).expect("the job succeeds");
    let out = (
        bonfire_testkit::nets::read_params(&dir.join("rank0.bin")),
        bonfire_testkit::nets::read_params(&dir.join("rank1.bin")),
        std::fs::read_to_string(dir.join("server.txt")).unwrap(),
    );
    let _ = std::fs::remove_dir_all(&dir);
    (launched, out)
}

#[test]
fn an_asynchronous_job_goes_on_when_a_worker_process_dies() {
    // Four processes: workers 0 to 2, rank 3 serves; worker 2 exits after 2 of 6 steps.
    let (launched, (w0, w1, line)) = processes(4, "async", 6, 3, Some((2, 2)));
    assert_eq!(launched.lost.len(), 1, "{launched:?}");
    assert!(launched.lost[0].starts_with("rank 2 "), "{launched:?}");
    assert!(line.contains("14 steps from 14 pushes"), "{line}");
    assert!(line.contains("dropped worker 2 after 2 pushes"), "{line}");
    assert!(w0.iter().chain(&w1).all(|v| v.is_finite()));
    assert_eq!(
        w0, w1,
        "finish gives both workers the server's final parameters"
    );
}

#[test]
fn across_processes_synchronous_servers_equal_one_device_and_asynchronous_ones_finish() {
    const STEPS: usize = 4;
    const ROWS: usize = 4;
    // One device on the whole batches: the same model, seed and Adam steps.
    let whole = {
        let comms = in_process_ranks(1, Duration::from_secs(20));
        run_ranks(comms, Duration::from_secs(120), |comm| {
            let _bind = bind_rank(comm);
            let device = Device::default();
            let mut model = seeded::<DpFlex, _>(1, &device, SmallCnn::new);
            let mut optim = adam();
            let b = random_batches(21, STEPS, 2 * ROWS, Net2::FEATURES, Net2::CLASSES);
            for batch in &b {
                model = step(model, &mut optim, batch, 0, 1);
            }
            parameters(&model).concat()
        })
        .remove(0)
    };
    let (w0, w1, line) = three_processes("sync", STEPS, ROWS);
    assert_eq!(w0, w1, "the workers pulled the same parameters");
    let d = max_abs_diff(std::slice::from_ref(&w0), &[whole]);
    assert!(
        d <= 1e-5,
        "2 workers x {ROWS} rows are {d:e} from one device x {}",
        2 * ROWS
    );
    assert!(line.contains("4 steps from 8 pushes"), "{line}");
    let (a0, a1, line) = three_processes("async", STEPS, ROWS);
    assert!(line.contains("8 steps from 8 pushes"), "{line}");
    assert!(a0.iter().chain(&a1).all(|v| v.is_finite()));
    assert_eq!(
        a0, a1,
        "finish gives both workers the server's final parameters"
    );
}

/// A server's two reports, and the departed workers a rank learned at each round's end.
type DroppedRounds = (Option<(PsReport, PsReport)>, Vec<Vec<usize>>);

/// Workers 0 to 2 and `servers` servers, asynchronous: worker 2 trains 2 steps of the first
/// round and is gone; the others train two rounds. What each rank saw.
fn dropped_in_the_first_round(servers: usize) -> Vec<DroppedRounds> {
    let device = Device::default();
    let n = 3 + servers;
    let models = RankModels::new(
        (0..n)
            .map(|_| seeded::<DpFlex, _>(7, &device, SmallCnn::new))
            .collect(),
    );
    let b = batches(36, 4, 9);
    let comms = in_process_ranks(n, Duration::from_secs(5));
    run_ranks(comms, Duration::from_secs(120), move |comm| {
        let r = comm.rank();
        let mut model = models.take(r);
        let _bind = bind_rank(comm);
        let mut optim = bonfire::param_server(adam(), servers).asynchronous(1);
        match optim.role(&Device::default()) {
            PsRole::Server { .. } => {
                let (m, first) = optim.serve(model);
                let after_first = optim.departed().to_vec();
                let (_, second) = optim.serve(m);
                let after_second = optim.departed().to_vec();
                (Some((first, second)), vec![after_first, after_second])
            }
            PsRole::Worker { index, workers } => {
                let steps = if index == 2 { 2 } else { 4 };
                for batch in b.iter().take(steps) {
                    model = step(model, &mut optim, batch, index, workers);
                }
                if index == 2 {
                    return (None, Vec::new());
                }
                assert!(optim.departed().is_empty(), "no round ended yet");
                model = optim.finish(model);
                let after_first = optim.departed().to_vec();
                for batch in b.iter().take(3) {
                    model = step(model, &mut optim, batch, index, workers);
                }
                drop(optim.finish(model));
                (None, vec![after_first, optim.departed().to_vec()])
            }
        }
    })
}

#[test]
fn a_worker_dropped_in_one_round_is_not_waited_for_in_the_next() {
    let ends = dropped_in_the_first_round(1);
    let (first, second) = ends[3].0.clone().expect("the server's reports");
    assert_eq!(first.departed.len(), 1, "{}", first.line());
    assert_eq!(first.departed[0].worker, 2);
    assert_eq!(first.versions, 2 + 4 + 4);
    assert!(
        second.departed.is_empty(),
        "round 2 does not wait for worker 2 again: {}",
        second.line()
    );
    let mut finished = second.finished.clone();
    finished.sort();
    assert_eq!(
        (second.versions, finished),
        (6, vec![0, 1]),
        "{}",
        second.line()
    );
    // Every rank left learned who is gone, at both rounds' ends.
    for r in [0, 1, 3] {
        assert_eq!(ends[r].1, vec![vec![2], vec![2]], "rank {r}");
    }
}

/// With two servers each drops the dead worker, and every rank left, servers and workers,
/// ends each round with the same list of who is gone.
#[test]
fn every_rank_left_learns_which_workers_the_servers_dropped() {
    let ends = dropped_in_the_first_round(2);
    for r in [0, 1, 3, 4] {
        assert_eq!(ends[r].1, vec![vec![2], vec![2]], "rank {r}");
    }
    for r in [3, 4] {
        let (first, second) = ends[r].0.clone().expect("a server's reports");
        assert_eq!(first.departed.len(), 1, "{}", first.line());
        assert!(second.departed.is_empty(), "{}", second.line());
    }
}
