//! One rank of a multi-process test job. Joins its job with `bonfire::init()`, runs a check,
//! and writes what happened to `$BONFIRE_CHECK_OUT/rank-N` (one line), exiting 0 on success.
//!
//! Modes:
//! - `every`: every collective and algorithm on f32, bf16 and i64 against the oracle, then
//!   `digest`, then the lane to the other ranks (`transport=shm` if any pair shares memory);
//! - `digest`: a 256 Ki-element f32 all-reduce, summarised as a hash of its bits;
//! - `die K`: after a barrier, rank K kills itself with SIGKILL while the others wait in an
//!   all-reduce; they report the error and how long it took to arrive.

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

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
            "unknown mode {other:?}: use every, digest or die K"
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
