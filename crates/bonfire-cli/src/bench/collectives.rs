//! `bonfire bench collectives`: the nccl-tests table for bonfire's collectives.

use std::hint::black_box;
use std::time::Instant;

use bonfire::collectives::{Algorithm, Collective, CommConfig, Communicator, Element};
use bonfire::topology::{DType, ReduceOp};
use clap::ValueEnum;
use half::{bf16, f16};

use crate::error::CliError;
use crate::size;

#[cfg(feature = "cuda")]
mod device;

/// How the ranks of the benchmark talk.
#[derive(Copy, Clone, Debug, ValueEnum)]
pub(crate) enum TransportKind {
    /// Ranks are threads of this process; frames move as shared buffers.
    Inproc,
    /// Ranks are processes, as `bonfire launch` runs them: shared memory between the ranks of
    /// one host, authenticated QUIC between hosts (and where shared memory cannot be set up,
    /// which is said once). Under `bonfire launch` this process is one rank of the launched job
    /// (on one host or several); otherwise it launches `--nproc` copies of itself on this host.
    Auto,
    /// As `auto`, but every pair talks QUIC, also on one host.
    Quic,
    /// As `auto`, but ranks of one host must share memory (the job fails where they cannot).
    Shm,
}

impl TransportKind {
    /// The `BONFIRE_TRANSPORT` value of a multi-process kind.
    fn env_value(self) -> Option<&'static str> {
        match self {
            TransportKind::Inproc => None,
            TransportKind::Auto => Some("auto"),
            TransportKind::Quic => Some("quic"),
            TransportKind::Shm => Some("shm"),
        }
    }
}

/// Where the buffers live.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Device {
    /// Host memory, through the transport (`--transport`).
    Host,
    /// CUDA device memory, through the device lane: each rank's window is mapped into the
    /// other processes of this host with CUDA IPC and one fused kernel per rank reduces it;
    /// under a launcher of several nodes, the hierarchical all-reduce of f32 (each node's lane,
    /// each rank's share across nodes). Ranks are always processes here (`inproc` is taken as
    /// `auto`). Needs a build with `--features cuda`.
    Cuda,
}

/// The collective to time.
#[derive(Copy, Clone, Debug, ValueEnum)]
pub(crate) enum Op {
    /// All-reduce (busbw = algbw x 2(n-1)/n).
    AllReduce,
    /// Reduce-scatter; the size is the input (busbw = algbw x (n-1)/n).
    ReduceScatter,
    /// All-gather; the size is the output (busbw = algbw x (n-1)/n).
    AllGather,
    /// Broadcast from rank 0 (busbw = algbw).
    Broadcast,
    /// Reduce to rank 0 (busbw = algbw).
    Reduce,
}

impl Op {
    fn collective(self, reduce: ReduceOp) -> Collective {
        match self {
            Op::AllReduce => Collective::AllReduce(reduce),
            Op::ReduceScatter => Collective::ReduceScatter {
                op: reduce,
                counts: None,
            },
            Op::AllGather => Collective::AllGather { counts: None },
            Op::Broadcast => Collective::Broadcast { root: 0 },
            Op::Reduce => Collective::Reduce {
                op: reduce,
                root: 0,
            },
        }
    }

    /// nccl-tests' bus-bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::ReduceScatter | Op::AllGather => (n - 1.0) / n,
            Op::Broadcast | Op::Reduce => 1.0,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all-reduce",
            Op::ReduceScatter => "reduce-scatter",
            Op::AllGather => "all-gather",
            Op::Broadcast => "broadcast",
            Op::Reduce => "reduce",
        }
    }
}

/// Arguments of `bonfire bench collectives`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// How ranks talk.
    #[arg(long, value_enum, default_value_t = TransportKind::Inproc)]
    transport: TransportKind,
    /// Where the buffers live: host memory, or CUDA device memory through the device lane.
    #[arg(long, value_enum, default_value_t = Device::Host)]
    device: Device,
    /// Number of ranks (ignored under `bonfire launch`, where the job decides).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    nproc: u16,
    /// The collective.
    #[arg(long, value_enum, default_value_t = Op::AllReduce)]
    op: Op,
    /// The reduction, for reducing collectives.
    #[arg(long, default_value = "sum")]
    reduce_op: ReduceOp,
    /// Buffer sizes, comma-separated (binary units: 64K, 4M, 1G). All-gather: the output;
    /// reduce-scatter: the input; otherwise the buffer.
    #[arg(long, value_delimiter = ',', default_value = "1K,16K,256K,4M,64M", value_parser = size::parse)]
    sizes: Vec<usize>,
    /// Force an algorithm (auto, ring, recursive-doubling, halving-doubling, tree, hierarchical).
    #[arg(long, default_value = "auto")]
    algorithm: Algorithm,
    /// Element type (f32, f64, f16, bf16, i32, i64, u8).
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Timed iterations per size [default: enough to move about 256 MiB, from 5 to 2000].
    #[arg(long)]
    iters: Option<usize>,
    /// Untimed iterations before timing [default: a tenth of the timed ones, at least 2].
    #[arg(long)]
    warmup: Option<usize>,
    /// The largest frame; larger transfers are pipelined in frames of this size.
    #[arg(long, value_parser = size::parse)]
    chunk: Option<usize>,
}

pub(crate) fn run(args: Args) -> Result<(), CliError> {
    if args.device == Device::Cuda {
        #[cfg(feature = "cuda")]
        return device::run(&args);
        #[cfg(not(feature = "cuda"))]
        return Err(CliError::Usage(
            "--device cuda needs a build with CUDA: cargo build --release -p bonfire-cli --features cuda".into(),
        ));
    }
    match args.dtype {
        DType::F32 => bench::<f32>(&args),
        DType::F64 => bench::<f64>(&args),
        DType::F16 => bench::<f16>(&args),
        DType::BF16 => bench::<bf16>(&args),
        DType::I32 => bench::<i32>(&args),
        DType::I64 => bench::<i64>(&args),
        DType::U8 => bench::<u8>(&args),
    }
}

/// One row of the table.
struct Row {
    bytes: usize,
    count: usize,
    algorithm: Algorithm,
    seconds: f64,
    memcpy_gbps: f64,
}

fn bench<T: Element>(args: &Args) -> Result<(), CliError> {
    let mut config = CommConfig::default();
    if let Some(chunk) = args.chunk {
        config.chunk_bytes = chunk.max(1);
    }
    // Under QUIC this process holds one rank; `world` keeps its links open until the end.
    let mut world = None;
    let (comms, n) = match args.transport {
        TransportKind::Inproc => {
            let n = usize::from(args.nproc);
            (Communicator::in_process(n, config.clone()), n)
        }
        TransportKind::Auto | TransportKind::Quic | TransportKind::Shm => {
            if std::env::var_os("RANK").is_none() && std::env::var_os("WORLD_SIZE").is_none() {
                return launch_self(args);
            }
            // Launched from outside: `--transport` chooses the lanes, unless the launcher
            // already did (`bonfire launch --transport`); say so if the two differ.
            let asked = args.transport.env_value().unwrap_or("auto");
            let mut shm =
                bonfire::transport::shm::ShmConfig::from_env().map_err(bonfire::InitError::from)?;
            if let Ok(launched) = std::env::var(bonfire::transport::shm::vars::TRANSPORT)
                && !launched.trim().is_empty()
                && launched.trim() != asked
            {
                return Err(CliError::TransportMismatch { asked, launched });
            }
            shm.mode = asked
                .parse()
                .expect("the bench's transports are valid modes");
            let w = bonfire::init_with_transport(config.clone(), shm)?;
            let comm = w.comm().clone();
            let n = w.world_size();
            world = Some(w);
            (vec![comm], n)
        }
    };
    // Only rank 0 of a launched job prints.
    let quiet = world.as_ref().is_some_and(|w| !w.is_main());
    macro_rules! say {
        ($($t:tt)*) => { if !quiet { println!($($t)*); } };
    }
    let comms: Vec<Communicator> = comms
        .into_iter()
        .map(|c| c.with_algorithm(args.algorithm))
        .collect();
    let collective = args.op.collective(args.reduce_op);
    let elem = T::DTYPE.size();

    let reduction = match args.op {
        Op::AllReduce | Op::ReduceScatter | Op::Reduce => format!(" ({})", args.reduce_op),
        Op::AllGather | Op::Broadcast => String::new(),
    };
    say!(
        "# bonfire bench collectives: {}{reduction}, {n} ranks, {} transport, {}, algorithm {}, chunk {}",
        args.op.name(),
        transport_name(args.transport),
        T::DTYPE,
        args.algorithm,
        size::format(config.chunk_bytes),
    );
    if let Some(w) = &world {
        let lanes = lane_table(w)?;
        say!("# lanes: {lanes}");
    }
    say!(
        "# {:>10} {:>11} {:>19} {:>6} {:>11} {:>11} {:>11} {:>12} {:>13}",
        "size",
        "count",
        "algorithm",
        "iters",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "memcpy(GB/s)",
        "busbw/memcpy"
    );
    let bar = super::sizes_bar(args.sizes.len(), quiet);
    for &requested in &args.sizes {
        bar.set_message(size::format(requested));
        // Per-rank element count; the size is the whole (gathered / scattered) buffer.
        let count = match args.op {
            Op::AllGather => requested / (elem * n),
            _ => requested / elem,
        };
        let bytes = match args.op {
            Op::AllGather => count * elem * n,
            _ => count * elem,
        };
        let algorithm = comms[0].resolve_algorithm::<T>(&collective, count)?;
        let iters = args
            .iters
            .unwrap_or_else(|| ((256usize << 20) / bytes.max(1)).clamp(5, 2000));
        let warmup = args.warmup.unwrap_or((iters / 10).max(2));
        let memcpy_gbps = if quiet { 0.0 } else { memcpy_bandwidth(bytes) };
        let seconds = time_collective::<T>(&comms, &collective, count, iters, warmup)?;
        if !quiet {
            print_row(
                args.op,
                n,
                iters,
                &Row {
                    bytes,
                    count,
                    algorithm,
                    seconds,
                    memcpy_gbps,
                },
            );
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    say!(
        "# time: the slowest rank's mean over the timed iterations. algbw = size / time; busbw = algbw x {:.3} ({}, as nccl-tests);",
        args.op.bus_factor(n),
        match args.op {
            Op::AllReduce => "2(n-1)/n",
            Op::ReduceScatter | Op::AllGather => "(n-1)/n",
            Op::Broadcast | Op::Reduce => "1",
        }
    );
    say!(
        "# memcpy: one thread copying the same number of bytes between two buffers of this process, best of 5, in the same run."
    );
    if let Some(w) = &world
        && w.lanes().contains(&bonfire::transport::Lane::SharedMemory)
    {
        say!(
            "# in place: {:.1} MiB of the frames this rank received went straight into the collectives' buffers (frames of 64 KiB or more that were expected before they came)",
            w.received_in_place() as f64 / f64::from(1 << 20)
        );
    }
    drop(comms);
    if let Some(w) = world {
        w.shutdown();
    }
    Ok(())
}

/// Runs this very command as `--nproc` ranks under the launcher.
fn launch_self(args: &Args) -> Result<(), CliError> {
    let exe = std::env::current_exe().map_err(CliError::CurrentExe)?;
    let mut config = bonfire::launch::LaunchConfig::local(usize::from(args.nproc), exe);
    config.args = std::env::args_os().skip(1).collect();
    if let Some(mode) = args.transport.env_value() {
        config
            .extra_env
            .push((bonfire::transport::shm::vars::TRANSPORT.into(), mode.into()));
    }
    // The table comes from rank 0 alone, so it reads as the in-process one does.
    config.prefix_output = false;
    bonfire::launch::launch(&config)?;
    Ok(())
}

fn transport_name(t: TransportKind) -> &'static str {
    match t {
        TransportKind::Inproc => "in-process",
        TransportKind::Auto => "auto (shared memory on one host, QUIC between hosts)",
        TransportKind::Quic => "QUIC",
        TransportKind::Shm => "shared memory on one host, QUIC between hosts",
    }
}

/// Which lane each pair of ranks used, gathered from every rank: `0-1 shm, 0-2 quic, ...`.
fn lane_table(world: &bonfire::World) -> Result<String, CliError> {
    let n = world.world_size();
    let mine: Vec<u8> = world.lanes().iter().map(|l| l.code()).collect();
    let all = world.comm().all_gather(mine).wait()?;
    let mut pairs = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            let ab = bonfire::transport::Lane::from_code(all[a * n + b]);
            let ba = bonfire::transport::Lane::from_code(all[b * n + a]);
            let name = |l: Option<bonfire::transport::Lane>| l.map_or("?", |l| l.name());
            if ab == ba {
                pairs.push(format!("{a}-{b} {}", name(ab)));
            } else {
                pairs.push(format!("{a}->{b} {}, {b}->{a} {}", name(ab), name(ba)));
            }
        }
    }
    Ok(pairs.join(", "))
}

fn print_row(op: Op, n: usize, iters: usize, row: &Row) {
    let algbw = row.bytes as f64 / row.seconds / 1e9;
    let busbw = algbw * op.bus_factor(n);
    println!(
        "  {:>10} {:>11} {:>19} {:>6} {:>11} {:>11} {:>11} {:>12} {:>13}",
        size::format(row.bytes),
        row.count,
        row.algorithm.name(),
        iters,
        significant(row.seconds * 1e6),
        significant(algbw),
        significant(busbw),
        significant(row.memcpy_gbps),
        significant(if row.memcpy_gbps > 0.0 {
            busbw / row.memcpy_gbps
        } else {
            0.0
        }),
    );
}

/// `x` with four significant digits (at most six decimals), so small bandwidths keep their
/// ratios.
fn significant(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let decimals = (3 - x.abs().log10().floor() as i32).clamp(0, 6) as usize;
    format!("{x:.decimals$}")
}

/// Runs `warmup + iters` calls on every rank and returns the slowest rank's mean time per call.
fn time_collective<T: Element>(
    comms: &[Communicator],
    collective: &Collective,
    count: usize,
    iters: usize,
    warmup: usize,
) -> Result<f64, CliError> {
    let threads: Vec<_> = comms
        .iter()
        .cloned()
        .map(|comm| {
            let collective = collective.clone();
            std::thread::spawn(move || -> Result<f64, CliError> {
                let mut buf = vec![T::zeroed(); count];
                let call = |buf: Vec<T>| comm.run(collective.clone(), buf).wait();
                for _ in 0..warmup {
                    buf = refill(call(buf)?, count);
                }
                comm.barrier().wait()?;
                let start = Instant::now();
                for _ in 0..iters {
                    buf = refill(call(buf)?, count);
                }
                let mine = start.elapsed().as_secs_f64();
                let slowest = comm.all_reduce(vec![mine], ReduceOp::Max).wait()?;
                Ok(slowest[0] / iters as f64)
            })
        })
        .collect();
    let mut seconds = 0.0;
    for t in threads {
        seconds = t
            .join()
            .map_err(|_| CliError::Panicked("a benchmark rank"))??;
    }
    Ok(seconds)
}

/// The buffer for the next call: reduce-scatter returns a segment, all-gather the whole.
fn refill<T: Element>(mut buf: Vec<T>, count: usize) -> Vec<T> {
    buf.resize(count, T::zeroed());
    buf
}

/// This machine's single-thread copy bandwidth for `bytes`, in GB/s: the best of five trials,
/// since a shared machine only ever slows a trial down.
fn memcpy_bandwidth(bytes: usize) -> f64 {
    if bytes == 0 {
        return 0.0;
    }
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let reps = ((64usize << 20) / bytes).clamp(3, 20_000);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..reps {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    (bytes * reps) as f64 / best / 1e9
}
