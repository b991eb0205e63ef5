//! nexar all-reduce benchmark: the peer figure for `bonfire bench collectives`.
//!
//! Forms a 2-rank nexar cluster on 127.0.0.1 with `NexarClient::bootstrap_local` (a seed plus
//! both ranks as tokio tasks of this one process, the arrangement of nexar's own `allreduce`
//! example) and times its in-place f32 sum all-reduce on host buffers. Data moves over nexar's
//! QUIC transport: its TCP bulk sidecar, which nexar enables by default and which then carries
//! every collective payload, is switched off unless `--tcp-sidecar` is given.
//!
//! Per size: `max(2, iters / 10)` warm-up calls, one checked call (rank r fills with r + 1, so
//! every element must equal 1 + 2 = 3), a barrier, then `iters` timed calls. The figure is the
//! slowest rank's mean time per call; algbw = bytes / time, busbw = algbw * 2(n-1)/n
//! (nccl-tests).
//!
//! ```text
//! cargo run --release --manifest-path benches/nexar/Cargo.toml -- [--sizes 1K,4M] [--iters N] [--tcp-sidecar]
//! ```

use nexar::{BufferRef, CpuAdapter, DataType, Host, NexarClient, NexarConfig, ReduceOp};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Number of ranks.
const WORLD: u32 = 2;
/// Sizes timed when `--sizes` is not given.
const DEFAULT_SIZES: &str = "1K,16K,256K,4M,64M,256M";
/// Without `--iters`, each size runs enough calls to move about this many bytes.
const TARGET_BYTES: usize = 256 << 20;

const USAGE: &str =
    "usage: nexar-allreduce-bench [--sizes 1K,16K,256K,4M,64M,256M] [--iters N] [--tcp-sidecar]";

/// Command-line options.
struct Args {
    /// Buffer sizes in bytes (multiples of 4: f32 elements).
    sizes: Vec<usize>,
    /// Timed calls per size; `None` picks them from [`TARGET_BYTES`].
    iters: Option<usize>,
    /// Keep nexar's TCP bulk sidecar (its default) instead of QUIC only.
    tcp_sidecar: bool,
}

fn parse_args() -> Result<Args, BoxError> {
    let mut args = Args {
        sizes: parse_sizes(DEFAULT_SIZES)?,
        iters: None,
        tcp_sidecar: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (arg, None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or(format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--sizes" => args.sizes = parse_sizes(&value()?)?,
            "--iters" => args.iters = Some(value()?.parse().map_err(|e| format!("--iters: {e}"))?),
            "--tcp-sidecar" => args.tcp_sidecar = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {flag}\n{USAGE}").into()),
        }
    }
    if args.iters == Some(0) {
        return Err("--iters must be at least 1".into());
    }
    Ok(args)
}

/// Parses a comma list of sizes such as `1K,16K,4M` (K/M/G are powers of 1024; `KiB`, `MB`... too).
fn parse_sizes(list: &str) -> Result<Vec<usize>, BoxError> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(parse_size)
        .collect()
}

fn parse_size(text: &str) -> Result<usize, BoxError> {
    let upper = text.trim().to_ascii_uppercase();
    let digits = upper.trim_end_matches("IB").trim_end_matches('B');
    let (number, scale) = match digits.char_indices().last() {
        Some((i, 'K')) => (&digits[..i], 1 << 10),
        Some((i, 'M')) => (&digits[..i], 1 << 20),
        Some((i, 'G')) => (&digits[..i], 1 << 30),
        _ => (digits, 1),
    };
    let bytes = number
        .parse::<usize>()
        .map_err(|e| format!("size {text:?}: {e}"))?
        * scale;
    if bytes < 4 || !bytes.is_multiple_of(4) {
        return Err(format!("size {text:?}: must be a positive multiple of 4 bytes (f32)").into());
    }
    Ok(bytes)
}

/// `1024` -> `1 KiB`; sizes that are not a whole unit stay in bytes.
fn format_size(bytes: usize) -> String {
    for (unit, scale) in [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= scale && bytes.is_multiple_of(scale) {
            return format!("{} {unit}", bytes / scale);
        }
    }
    format!("{bytes} B")
}

/// In-place f32 sum all-reduce of `data` across all ranks.
async fn all_reduce_sum(client: &NexarClient, data: &mut [f32]) -> nexar::Result<()> {
    // SAFETY: the buffer is exactly `data`, which stays exclusively borrowed until the call returns.
    let mut buf = unsafe { BufferRef::<Host>::new(data.as_mut_ptr() as u64, size_of_val(data)) };
    client
        .all_reduce_host(&mut buf, data.len(), DataType::F32, ReduceOp::Sum)
        .await
}

/// One rank's share of one size: warm up, check the result, then time `iters` calls.
/// Returns this rank's mean seconds per call.
async fn run_rank(client: Arc<NexarClient>, count: usize, iters: usize) -> Result<f64, BoxError> {
    let fill = (client.rank() + 1) as f32;
    let mut data = vec![fill; count];
    for _ in 0..(iters / 10).max(2) {
        all_reduce_sum(&client, &mut data).await?;
    }

    data.fill(fill);
    all_reduce_sum(&client, &mut data).await?;
    let expected = (WORLD * (WORLD + 1) / 2) as f32;
    if let Some(i) = data.iter().position(|&x| x != expected) {
        let rank = client.rank();
        return Err(format!(
            "rank {rank}: element {i} is {}, expected {expected}",
            data[i]
        )
        .into());
    }

    // The values keep doubling during the timed calls; they stay finite or saturate to inf,
    // neither of which slows the reduction.
    client.barrier().await?;
    let start = Instant::now();
    for _ in 0..iters {
        all_reduce_sum(&client, &mut data).await?;
    }
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let args = parse_args()?;
    let mut config = NexarConfig::from_env();
    config.enable_tcp_bulk_sidecar = args.tcp_sidecar;
    let adapter = Arc::new(CpuAdapter::new());
    let clients: Vec<Arc<NexarClient>> =
        NexarClient::bootstrap_local_with_config(WORLD, adapter, config)
            .await?
            .into_iter()
            .map(Arc::new)
            .collect();

    let n = WORLD as f64;
    println!(
        "# nexar {} all_reduce (sum), {WORLD} ranks, f32",
        env!("NEXAR_VERSION")
    );
    println!("#       size   time(us)  algbw(GB/s)  busbw(GB/s)");
    for &bytes in &args.sizes {
        let iters = args.iters.unwrap_or((TARGET_BYTES / bytes).clamp(5, 2000));
        let ranks: Vec<_> = clients
            .iter()
            .map(|c| tokio::spawn(run_rank(Arc::clone(c), bytes / 4, iters)))
            .collect();
        let mut secs = 0f64;
        for rank in ranks {
            secs = secs.max(rank.await??);
        }
        let algbw = bytes as f64 / secs / 1e9;
        let busbw = algbw * 2.0 * (n - 1.0) / n;
        println!(
            "{:>12} {:>10.1} {algbw:>12.4} {busbw:>12.4}",
            format_size(bytes),
            secs * 1e6
        );
    }
    let transport = match args.tcp_sidecar {
        true => "TCP bulk sidecar (TLS) for payloads, QUIC for control",
        false => "QUIC only (TCP bulk sidecar off)",
    };
    println!(
        "# ranks: {WORLD} tokio tasks in one process (bootstrap_local), 127.0.0.1, {transport}"
    );
    println!("# time: the slowest rank's mean per call; busbw = algbw x 2(n-1)/n (nccl-tests)");

    // Every rank shuts down together, so the last collective's messages are flushed.
    let shutdowns: Vec<_> = clients
        .into_iter()
        .map(|c| Arc::into_inner(c).expect("rank tasks have finished"))
        .map(|c| tokio::spawn(c.shutdown()))
        .collect();
    for s in shutdowns {
        s.await??;
    }
    Ok(())
}
