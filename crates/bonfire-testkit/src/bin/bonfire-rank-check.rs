//! One rank of a multi-process test job. Joins its job with `bonfire::init()`, runs a check,
//! and writes what happened to `$BONFIRE_CHECK_OUT/rank-N` (one line), exiting 0 on success.
//!
//! Modes:
//! - `every`: every collective and algorithm on f32, bf16 and i64 against the oracle, then
//!   `digest`, then the lane to the other ranks (`transport=shm` if any pair shares memory);
//! - `digest`: a 256 Ki-element f32 all-reduce, summarised as a hash of its bits;
//! - `die K`: after a barrier, rank K kills itself with SIGKILL while the others wait in an
//!   all-reduce; they report the error and how long it took to arrive;
//! - `threads`: the main thread computes (`bonfire::compute_on_this_thread`, before `init`);
//!   after `digest`, the CPUs the main thread and each communication thread may run on.

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use bonfire_testkit::calls::every_call;
use bonfire_testkit::oracle;
use bonfire_topology::ReduceOp;
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn report(rank: Option<u32>, line: &str) {
    let Some(dir) = std::env::var_os("BONFIRE_CHECK_OUT") else {
        println!("{line}");
        return;
    };
    let name = match rank {
        Some(r) => format!("rank-{r}"),
        None => format!("pid-{}", std::process::id()),
    };
    let mut f = std::fs::File::create(std::path::Path::new(&dir).join(name)).expect("check output");
    writeln!(f, "{line}").expect("check output");
}

fn digest(world: &bonfire::World) -> Result<String, String> {
    let n = world.world_size();
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let inputs = oracle::exact_inputs::<f32>(ReduceOp::Sum, n, 1 << 18, &mut rng);
    let got = world
        .comm()
        .all_reduce(inputs[world.rank().index()].clone(), ReduceOp::Sum)
        .wait()
        .map_err(|e| e.to_string())?;
    let want = oracle::reduce_all(&inputs, ReduceOp::Sum);
    if got
        .iter()
        .zip(&want)
        .any(|(a, b)| a.to_bits() != b.to_bits())
    {
        return Err("the all-reduce result differs from the oracle".into());
    }
    let hash = got.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ x.to_bits() as u64).wrapping_mul(0x0100_0000_01b3)
    });
    Ok(format!("{hash:016x}"))
}

/// `threads main=LIST comm=NAME:LIST,... cpus=BONFIRE_CPUS`: where this process's threads may
/// run, read from `/proc` (the communication threads: `bonfire-comm*`, `bonfire-shm*`).
fn threads() -> Result<String, String> {
    let allowed = |dir: &std::path::Path| -> Result<(String, String), String> {
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).map_err(|e| e.to_string());
        let name = read("comm")?.trim().to_string();
        let list = read("status")?
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(|l| l.trim().to_string())
            .ok_or("no Cpus_allowed_list")?;
        Ok((name, list))
    };
    let (_, main) = allowed(std::path::Path::new("/proc/thread-self"))?;
    let mut comm = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").map_err(|e| e.to_string())? {
        let Ok((name, list)) = allowed(&task.map_err(|e| e.to_string())?.path()) else {
            continue; // a thread that ended meanwhile
        };
        if name.starts_with("bonfire-comm") || name.starts_with("bonfire-shm") {
            comm.push(format!("{name}:{list}"));
        }
    }
    comm.sort();
    let cpus = std::env::var("BONFIRE_CPUS").unwrap_or_else(|_| "-".into());
    Ok(format!(
        "threads main={main} comm={} cpus={cpus}",
        comm.join(",")
    ))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let _compute = match args.first().map(String::as_str) {
        Some("threads") => bonfire::compute_on_this_thread(),
        _ => None,
    };
    let world = match bonfire::init() {
        Ok(w) => w,
        Err(e) => {
            let rank = std::env::var("RANK").ok().and_then(|r| r.parse().ok());
            report(rank, &format!("init error: {e}"));
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let me = world.rank().0;
    let outcome: Result<String, String> = match args.first().map(String::as_str) {
        Some("every") => {
            every_call::<f32>(world.comm(), 1);
            every_call::<bf16>(world.comm(), 2);
            every_call::<i64>(world.comm(), 3);
            let transport = if world
                .lanes()
                .contains(&bonfire::transport::Lane::SharedMemory)
            {
                "shm"
            } else {
                "quic"
            };
            digest(&world).map(|d| format!("every ok digest={d} transport={transport}"))
        }
        Some("digest") => digest(&world).map(|d| format!("digest={d}")),
        // A thread seen between its start and placing itself would read wrong: take the
        // reading once two in a row agree.
        Some("threads") => digest(&world).and_then(|_| {
            let mut last = threads()?;
            for _ in 0..50 {
                std::thread::sleep(std::time::Duration::from_millis(10));
                let now = threads()?;
                if now == last {
                    break;
                }
                last = now;
            }
            Ok(last)
        }),
        Some("die") => {
            let victim: u32 = args.get(1).and_then(|k| k.parse().ok()).unwrap_or(1);
            world
                .comm()
                .barrier()
                .wait()
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    if me == victim {
                        std::thread::sleep(std::time::Duration::from_millis(300));
                        // SAFETY: signals this process; nothing of ours is touched.
                        unsafe {
                            libc::kill(libc::getpid(), libc::SIGKILL);
                        }
                        unreachable!("SIGKILL does not return");
                    }
                    let started = Instant::now();
                    match world
                        .comm()
                        .all_reduce(vec![1.0f32; 1 << 16], ReduceOp::Sum)
                        .wait()
                    {
                        Ok(_) => Err("the all-reduce completed without its dead peer".into()),
                        Err(e) => Ok(format!(
                            "detected after {:.2}s: {e}",
                            started.elapsed().as_secs_f64()
                        )),
                    }
                })
        }
        other => Err(format!(
            "unknown mode {other:?}: use every, digest, threads or die K"
        )),
    };
    match outcome {
        Ok(line) if args.first().map(String::as_str) == Some("die") => {
            report(Some(me), &line);
            ExitCode::from(3)
        }
        Ok(line) => {
            report(Some(me), &line);
            world.shutdown();
            ExitCode::SUCCESS
        }
        Err(e) => {
            report(Some(me), &format!("error: {e}"));
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
