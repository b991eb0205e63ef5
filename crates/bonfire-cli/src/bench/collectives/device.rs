//! `bonfire bench collectives --device cuda`: the device lane's collectives (CUDA IPC windows and
//! one fused kernel per rank) between the processes of this host, next to the device's own copy
//! bandwidth measured in the same run.

use std::time::Instant;

use bonfire::backend::NodeLane;
use bonfire::collectives::CommConfig;
use bonfire::kernels::GradElement;
use bonfire::kernels::lane::{self, LaneOp};
use bonfire::topology::{ByNode, DType, ReduceOp};
use half::{bf16, f16};

use super::{Args, Op, significant};
use crate::error::CliError;
use crate::size;

pub(super) fn run(args: &Args) -> Result<(), CliError> {
    match args.op {
        Op::AllReduce | Op::ReduceScatter | Op::AllGather => {}
        Op::Broadcast | Op::Reduce => {
            return Err(CliError::Usage(format!(
                "--device cuda runs all-reduce, reduce-scatter and all-gather, not {}",
                args.op.name()
            )));
        }
    }
    let op = match args.reduce_op {
        ReduceOp::Sum => LaneOp::Sum,
        ReduceOp::Mean => LaneOp::Mean,
        other => {
            return Err(CliError::Usage(format!(
                "--device cuda reduces with sum or mean, not {other}"
            )));
        }
    };
    match args.dtype {
        DType::F32 => bench::<f32>(args, op),
        DType::F16 => bench::<f16>(args, op),
        DType::BF16 => bench::<bf16>(args, op),
        other => Err(CliError::Usage(format!(
            "--device cuda moves f32, f16 or bf16, not {other}"
        ))),
    }
}

/// Rank `rank`'s input for a buffer of `len`: small integers, so every sum is exact in every
/// type and the check below is bitwise.
fn input<T: GradElement>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::narrow(((i * 7 + rank * 3) % 13) as f32 - 6.0))
        .collect()
}

/// Results are checked against the host reference up to this size (the reference is one host
/// thread).
const CHECK_UP_TO: usize = 64 << 20;

fn bench<T: GradElement>(args: &Args, op: LaneOp) -> Result<(), CliError> {
    if std::env::var_os("RANK").is_none() && std::env::var_os("WORLD_SIZE").is_none() {
        return super::launch_self(args);
    }
    let devices =
        lane::devices().map_err(|why| CliError::Usage(format!("--device cuda: {why}")))?;
    let mut shm =
        bonfire::transport::shm::ShmConfig::from_env().map_err(bonfire::InitError::from)?;
    shm.mode = args
        .transport
        .env_value()
        .unwrap_or("auto")
        .parse()
        .expect("the bench's transports are valid modes");
    let world = bonfire::init_with_transport(CommConfig::default(), shm)?;
    let quiet = !world.is_main();
    macro_rules! say {
        ($($t:tt)*) => { if !quiet { println!($($t)*); } };
    }
    let n = world.world_size();
    let ordinal = world.local_rank() % devices;
    let elem = size_of::<T>();
    let largest = args.sizes.iter().copied().max().unwrap_or(0);
    // Refused before any rank sets up a window: every rank has the layout.
    let nodes = ByNode::of(world.comm().nodes()).groups().len();
    if nodes > 1 && (!matches!(args.op, Op::AllReduce) || !matches!(args.dtype, DType::F32)) {
        return Err(CliError::Usage(format!(
            "--device cuda across {nodes} nodes runs the hierarchical all-reduce of f32, not {} of {}",
            args.op.name(),
            args.dtype
        )));
    }
    let node = NodeLane::join(world.comm(), ordinal, largest).map_err(CliError::Lane)?;
    let lane = node.lane();
    say!(
        "# bonfire bench collectives --device cuda: {}{}, {n} ranks{} on {} CUDA device(s) per node, {}, windows of {} mapped through CUDA IPC ({} peers per rank), {}",
        args.op.name(),
        match args.op {
            Op::AllGather => String::new(),
            _ => format!(" ({})", args.reduce_op),
        },
        if nodes > 1 {
            format!(
                " on {nodes} nodes (the node's lane reduce-scatters and all-gathers on the device, each rank's share crosses nodes over the job's link)"
            )
        } else {
            String::new()
        },
        devices.min(lane.size()),
        args.dtype,
        size::format(lane.capacity()),
        lane.ipc_peers(),
        if lane.one_device() {
            "one device: the lane's first rank's kernel reduces for all"
        } else {
            "one kernel per rank"
        },
    );
    say!(
        "# {:>10} {:>11} {:>6} {:>11} {:>11} {:>11} {:>12} {:>11} {:>7}",
        "size",
        "count",
        "iters",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "copy(GB/s)",
        "algbw/copy",
        "check"
    );
    for &requested in &args.sizes {
        let count = match args.op {
            Op::AllGather | Op::ReduceScatter => requested / elem / n * n,
            _ => requested / elem,
        };
        let bytes = count * elem;
        let counts = vec![count / n; n];
        let call = || match args.op {
            // f32 (checked above): the hierarchical schedule reduces f32.
            Op::AllReduce if nodes > 1 => node.all_reduce(count, op),
            Op::AllReduce => lane.all_reduce::<T>(count, op),
            Op::ReduceScatter => lane.reduce_scatter::<T>(&counts, op),
            _ => lane.all_gather::<T>(&counts),
        };
        // One checked call against the host reference.
        let check = if bytes <= CHECK_UP_TO {
            let inputs: Vec<Vec<T>> = (0..n).map(|r| input(r, count)).collect();
            lane.write(&inputs[world.comm().rank()])
                .map_err(lane_error)?;
            call().map_err(lane_error)?;
            let mut got = vec![T::narrow(0.0); count];
            lane.read(&mut got).map_err(lane_error)?;
            let reduced = lane::reference::all_reduce(&inputs, op);
            let per = count / n;
            let at = world.comm().rank() * per;
            let (mine, want): (&[T], Vec<T>) = match args.op {
                Op::AllReduce => (&got, reduced),
                Op::ReduceScatter => (&got[at..at + per], reduced[at..at + per].to_vec()),
                _ => (&got, gathered(&inputs, n)),
            };
            let bad = mine
                .iter()
                .zip(&want)
                .position(|(a, b)| a.widen().to_bits() != b.widen().to_bits());
            if let Some(i) = bad {
                eprintln!(
                    "rank {}: element {i} of {} is {}, the reference says {} (inputs {:?})",
                    world.comm().rank(),
                    mine.len(),
                    mine[i].widen(),
                    want[i].widen(),
                    inputs
                        .iter()
                        .map(|v| v.get(i).map(|x| x.widen()))
                        .collect::<Vec<_>>()
                );
            }
            let ok = bad.is_none();
            let all_ok = world
                .comm()
                .all_reduce(vec![u8::from(!ok)], ReduceOp::Max)
                .wait()?;
            if all_ok[0] != 0 {
                return Err(CliError::Usage(format!(
                    "the device lane's {} of {} differs from the host reference on some rank",
                    args.op.name(),
                    size::format(bytes)
                )));
            }
            "ok"
        } else {
            "-"
        };
        let iters = args
            .iters
            .unwrap_or_else(|| ((4usize << 30) / bytes.max(1)).clamp(5, 2000));
        let warmup = args.warmup.unwrap_or((iters / 10).max(2));
        for _ in 0..warmup {
            call().map_err(lane_error)?;
        }
        world.comm().barrier().wait()?;
        let start = Instant::now();
        for _ in 0..iters {
            call().map_err(lane_error)?;
        }
        let mine = start.elapsed().as_secs_f64() / iters as f64;
        let seconds = world.comm().all_reduce(vec![mine], ReduceOp::Max).wait()?[0];
        // The ceiling: one copy of the same bytes on this rank's device while the others wait.
        let copy = if quiet {
            0.0
        } else {
            let s = lane.time_device_copy(bytes, 10).map_err(lane_error)?;
            bytes as f64 / s / 1e9
        };
        world.comm().barrier().wait()?;
        let algbw = bytes as f64 / seconds / 1e9;
        say!(
            "  {:>10} {:>11} {:>6} {:>11} {:>11} {:>11} {:>12} {:>11} {:>7}",
            size::format(bytes),
            count,
            iters,
            significant(seconds * 1e6),
            significant(algbw),
            significant(algbw * args.op.bus_factor(n)),
            significant(copy),
            significant(if copy > 0.0 { algbw / copy } else { 0.0 }),
            check,
        );
    }
    if nodes > 1 {
        say!(
            "# time: the slowest rank's mean per call (on each node a reduce-scatter and an all-gather, two host barriers and a kernel each, and between them each rank's share copied to the host in chunks of {} and summed across nodes). algbw = size / time, busbw as nccl-tests.",
            size::format(lane::CROSS_CHUNK * 4)
        );
    } else {
        say!(
            "# time: the slowest rank's mean per call (two host barriers and one kernel per rank). algbw = size / time, busbw as nccl-tests."
        );
    }
    say!(
        "# copy: cuMemcpyDtoD of the same bytes on rank 0's device, best of 10 (CUDA events), in the same run; algbw/copy compares the collective with one copy of its buffer."
    );
    say!(
        "# check: one call per size up to {} compared bit for bit with the host reference on every rank.",
        size::format(CHECK_UP_TO)
    );
    drop(node);
    world.shutdown();
    Ok(())
}

fn gathered<T: GradElement>(inputs: &[Vec<T>], n: usize) -> Vec<T> {
    let per = inputs[0].len() / n;
    (0..n)
        .flat_map(|r| inputs[r][r * per..(r + 1) * per].iter().copied())
        .collect()
}

fn lane_error(e: lane::LaneError) -> CliError {
    CliError::Lane(e.to_string())
}
