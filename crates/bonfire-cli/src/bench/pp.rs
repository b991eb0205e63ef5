//! `bonfire bench pp`: training steps of the bundled GPT-style model split into 1, 2, 4 ...
//! pipeline stages (processes on this host under the launcher, `BONFIRE_PP`), under each
//! schedule and number of micro-batches, side by side for the same global batch: step time,
//! tokens per second, each stage's idle time against the bubble's formula, the micro-batches and
//! activation bytes it held, its parameters, and the first step's loss (the same at every split).
//! `--chunks 1,2` runs each 1F1B configuration as it is and interleaved with 2 chunks per rank.

use std::path::{Path, PathBuf};
use std::time::Instant;

use bonfire::DataParallel;
use bonfire::models::{Gpt, GptConfig, GptStage};
use bonfire::pipeline::{
    Pipeline, Schedule, average_gradients, bubble_interleaved, materialised, partition,
};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::module::Module;
use burn::optim::{AdamConfig, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::CliError;

/// A stage trains on the data-parallel backend, unreplicated: its gradients are averaged over
/// its replicas by `average_gradients` after the step.
type B = Autodiff<DataParallel<Flex>>;

/// `bonfire bench pp`.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct Args {
    /// Pipeline stages to run (each run is dp x pp processes on this host).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pp: Vec<usize>,
    /// Schedules to run at each number of stages: 1f1b, gpipe.
    #[arg(long, value_delimiter = ',', default_value = "1f1b,gpipe")]
    schedule: Vec<Schedule>,
    /// Micro-batches per step to run; each must divide the replica's share of --batch.
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    micro_batches: Vec<usize>,
    /// Model chunks per rank to run under 1f1b: above 1, interleaved 1F1B (the model cut into
    /// chunks x stages, each rank holding every stages-th chunk; the stages must divide the
    /// micro-batches and chunks x stages must not exceed --layers).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    chunks: Vec<usize>,
    /// Replicas of the pipeline, each on its 1/dp of the global batch.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 128)]
    embd: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Sequences per step, over all replicas (the global batch).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Vocabulary (a character-level model's size).
    #[arg(long, default_value_t = 64)]
    vocab: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Compute threads per rank [default: this machine's cores / ranks, at least 1].
    #[arg(long)]
    threads: Option<usize>,
    /// Set on the ranks this command starts: the run's stages, schedule, micro-batches and
    /// chunks.
    #[arg(long, hide = true)]
    run: Option<String>,
    /// Set on the ranks this command starts: where rank 0 writes its figures.
    #[arg(long, hide = true)]
    result: Option<PathBuf>,
}

/// What one stage of replica 0 measured.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Stage {
    params: u64,
    idle: f64,
    held: usize,
    activation_bytes: usize,
}

/// What one run measured, written by rank 0.
#[derive(Serialize, Deserialize, Debug)]
struct Figures {
    step_ms: f64,
    tokens_per_s: f64,
    stages: Vec<Stage>,
    first_loss: f32,
}

pub(crate) fn run(args: Args) -> Result<(), CliError> {
    if let (Some(run), Some(result)) = (&args.run, &args.result) {
        return rank(&args, run, result);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "# bonfire bench pp: GPT, {} layers, width {}, {} heads, context {}, global batch {} over {} replica(s), vocabulary {}, Adam, {} timed steps after {}",
        args.layers,
        args.embd,
        args.heads,
        args.context,
        args.batch,
        args.dp,
        args.vocab,
        args.steps,
        args.warmup
    );
    println!(
        "# {:>3} {:>13} {:>5} {:>8} {:>10} {:>10} {:>10}  {:<44} {:<12} {:<22} first loss",
        "pp",
        "schedule",
        "m",
        "threads",
        "step(ms)",
        "tokens/s",
        "bubble",
        "idle per stage",
        "held",
        "params per stage"
    );
    let dir = std::env::temp_dir().join(format!("bonfire-bench-pp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|source| CliError::ResultFile {
        path: dir.clone(),
        source,
    })?;
    let exe = std::env::current_exe().map_err(CliError::CurrentExe)?;
    for &pp in &args.pp {
        let schedules: &[Schedule] = if pp == 1 {
            // One stage has no schedule to choose: the first is run.
            &args.schedule[..args.schedule.len().min(1)]
        } else {
            &args.schedule
        };
        for &schedule in schedules {
            for &m in &args.micro_batches {
                // Interleaving runs 1F1B over 2 stages or more; one chunk is the stage itself.
                let chunks: Vec<usize> = if pp > 1 && schedule == Schedule::OneFOneB {
                    args.chunks.clone()
                } else {
                    vec![1]
                };
                for v in chunks {
                    check(&args, pp, m, v)?;
                    let ranks = args.dp * pp;
                    let threads = args.threads.unwrap_or((cores / ranks).max(1));
                    let result = dir.join(format!("pp{pp}-{schedule}-m{m}-v{v}.json"));
                    let mut config = bonfire::launch::LaunchConfig::local(ranks, exe.clone());
                    config.args = rank_args(&args, &format!("{pp}:{schedule}:{m}:{v}"), &result)
                        .into_iter()
                        .map(Into::into)
                        .collect();
                    config.extra_env = vec![
                        ("BONFIRE_PP".into(), pp.to_string().into()),
                        ("RAYON_NUM_THREADS".into(), threads.to_string().into()),
                    ];
                    bonfire::launch::launch(&config)?;
                    let text = std::fs::read_to_string(&result).map_err(|source| {
                        CliError::ResultFile {
                            path: result.clone(),
                            source,
                        }
                    })?;
                    let f: Figures =
                        serde_json::from_str(&text).map_err(|source| CliError::ResultJson {
                            path: result.clone(),
                            source,
                        })?;
                    let join = |v: Vec<String>| v.join(" / ");
                    let name = match (pp, v) {
                        (1, _) => "-".to_string(),
                        (_, 1) => schedule.name().to_string(),
                        (_, v) => format!("interleaved x{v}"),
                    };
                    println!(
                        "  {:>3} {:>13} {:>5} {:>8} {:>10.1} {:>10.0} {:>9.1}%  {:<44} {:<12} {:<22} {:.5}",
                        pp,
                        name,
                        m,
                        threads,
                        f.step_ms,
                        f.tokens_per_s,
                        100.0 * bubble_interleaved(pp, m, v),
                        join(
                            f.stages
                                .iter()
                                .map(|s| format!("{:.1}%", 100.0 * s.idle))
                                .collect()
                        ),
                        join(f.stages.iter().map(|s| s.held.to_string()).collect()),
                        join(f.stages.iter().map(|s| s.params.to_string()).collect()),
                        f.first_loss
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "# step: the median timed step of rank 0 (the first stage), optimizer included; idle: the part of each stage's pipeline steps it waited for a neighbour (the bubble's formula (p-1)/(m+p-1), (p-1)/(v*m+p-1) with v chunks per rank, counts no transfer); held: the most micro-batches whose graphs a stage held at once (each chunk's counted); params: a stage's parameters (the last counts its copy of the tied embedding); first loss: the first step's mean loss, which every split must give"
    );
    Ok(())
}

/// Refuses a run whose micro-batches do not divide a replica's share of the batch, or whose
/// stages (times its chunks) outnumber the blocks, or whose chunks interleaving cannot run.
fn check(args: &Args, pp: usize, m: usize, chunks: usize) -> Result<(), CliError> {
    let bad = |why: String| Err(CliError::Usage(why));
    if args.dp == 0 || !args.batch.is_multiple_of(args.dp) {
        return bad(format!(
            "--dp {}: must be at least 1 and divide --batch {}",
            args.dp, args.batch
        ));
    }
    if args.batch == 0 || args.vocab == 0 || args.context == 0 {
        return bad("--batch, --vocab and --context must be at least 1".to_string());
    }
    if args.heads == 0 || !args.embd.is_multiple_of(args.heads) {
        return bad(format!(
            "--heads {}: must be at least 1 and divide --embd {}",
            args.heads, args.embd
        ));
    }
    let share = args.batch / args.dp;
    if m == 0 || !share.is_multiple_of(m) {
        return bad(format!(
            "--micro-batches {m}: must divide a replica's {share} sequences (--batch {} over --dp {})",
            args.batch, args.dp
        ));
    }
    if pp == 0 || pp > args.layers {
        return bad(format!(
            "--pp {pp}: must be at least 1 and at most --layers {}",
            args.layers
        ));
    }
    if chunks == 0 || pp * chunks > args.layers {
        return bad(format!(
            "--chunks {chunks}: must be at least 1, and times --pp {pp} at most --layers {}",
            args.layers
        ));
    }
    if chunks > 1 && !m.is_multiple_of(pp) {
        return bad(format!(
            "--chunks {chunks} with --micro-batches {m}: interleaving needs micro-batches that \
             --pp {pp} divides"
        ));
    }
    Ok(())
}

/// The arguments of a rank of run `run` (`pp:schedule:m:chunks`).
fn rank_args(args: &Args, run: &str, result: &Path) -> Vec<String> {
    let mut v = vec!["bench".to_string(), "pp".to_string()];
    for (flag, value) in [
        ("--dp", args.dp),
        ("--layers", args.layers),
        ("--embd", args.embd),
        ("--heads", args.heads),
        ("--context", args.context),
        ("--batch", args.batch),
        ("--vocab", args.vocab),
        ("--steps", args.steps),
        ("--warmup", args.warmup),
    ] {
        v.push(flag.to_string());
        v.push(value.to_string());
    }
    v.extend(["--run".to_string(), run.to_string()]);
    v.extend(["--result".to_string(), result.display().to_string()]);
    v
}

/// Replica `replica`'s micro-batches of the next global batch (every rank draws the whole batch
/// from the same generator).
fn micro_batches(
    rng: &mut rand_chacha::ChaCha8Rng,
    args: &Args,
    replica: usize,
    m: usize,
    device: &FlexDevice,
) -> Vec<(Tensor<B, 2, Int>, Tensor<B, 2, Int>)> {
    let s = args.context;
    let stream: Vec<i64> = (0..args.batch * (s + 1))
        .map(|_| rng.random_range(0..args.vocab as i64))
        .collect();
    let share = args.batch / args.dp;
    let rows: Vec<&[i64]> = stream
        .chunks(s + 1)
        .skip(replica * share)
        .take(share)
        .collect();
    rows.chunks(share / m)
        .map(|part| {
            let x: Vec<i64> = part.iter().flat_map(|r| r[..s].iter().copied()).collect();
            let y: Vec<i64> = part.iter().flat_map(|r| r[1..].iter().copied()).collect();
            (
                Tensor::from_data(TensorData::new(x, [part.len(), s]), device),
                Tensor::from_data(TensorData::new(y, [part.len(), s]), device),
            )
        })
        .collect()
}

/// One rank of a run: trains its stage and, on rank 0, writes the figures to `result`.
fn rank(args: &Args, run: &str, result: &Path) -> Result<(), CliError> {
    let bad_run = || CliError::Usage(format!("--run {run:?}: expected STAGES:SCHEDULE:M:CHUNKS"));
    let mut parts = run.split(':');
    let (Some(_), Some(schedule), Some(m), Some(v), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return Err(bad_run());
    };
    let schedule: Schedule = schedule.parse().map_err(|_| bad_run())?;
    let m: usize = m.parse().map_err(|_| bad_run())?;
    let v: usize = v.parse().map_err(|_| bad_run())?;
    let world = bonfire::init()?;
    let device = FlexDevice;
    let pipe = Pipeline::new(world.pp_group().clone(), schedule, m)?.interleaved(v)?;
    <B as burn::tensor::backend::Backend>::seed(&device, 7);
    let whole: Gpt<B> = GptConfig::new(args.vocab)
        .with_context(args.context)
        .with_layers(args.layers)
        .with_heads(args.heads)
        .with_embd(args.embd)
        .init(&device);
    let whole = materialised(whole);
    // Rank r's chunk c is the model's chunk c * p + r.
    let (p, r) = (pipe.stages(), pipe.stage());
    let ranges = partition(&whole.block_params(), p * v);
    let mut chunks: Vec<GptStage<B>> = (0..v)
        .map(|c| whole.clone().into_stage(ranges[c * p + r].clone()))
        .collect();
    let params: u64 = chunks.iter().map(|c| c.num_params() as u64).sum();
    let mut optims: Vec<_> = (0..v)
        .map(|_| AdamConfig::new().init::<B, GptStage<B>>())
        .collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let dp = world.dp_group().clone();
    let replica = dp.rank();
    let (mut times, mut idle, mut wall, mut held, mut bytes) = (Vec::new(), 0.0, 0.0, 0, 0);
    let mut first_loss = f32::NAN;
    for step in 0..args.warmup + args.steps {
        let micro = micro_batches(&mut rng, args, replica, m, &device);
        let start = Instant::now();
        let (grads, report) =
            pipe.step_chunks(&chunks, &device, |st: &GptStage<B>, _, i, input| {
                bonfire_jobs::gpt::stage_output(st, &micro[i], input)
            })?;
        let mut stepped = Vec::with_capacity(v);
        for ((chunk, grads), optim) in chunks.into_iter().zip(grads).zip(optims.iter_mut()) {
            let mut grads = average_gradients(&dp, &chunk, grads)?;
            // The first chunk (rank 0's first) and the last (rank p - 1's last) share the tied
            // embedding.
            if let Some(tied) = chunk.tied_embedding() {
                pipe.sum_shared::<B, 2>(&mut grads, tied)?;
            }
            stepped.push(optim.step(1e-3, chunk, grads));
        }
        chunks = stepped;
        let elapsed = start.elapsed().as_secs_f64();
        if step == 0 {
            // The last stage has the loss; the mean over the replicas is the batch's.
            let mine = report.loss.unwrap_or(0.0);
            let mean = dp
                .all_reduce(vec![mine], bonfire::topology::ReduceOp::Mean)
                .wait()?;
            first_loss = pipe.group().broadcast(mean, pipe.stages() - 1).wait()?[0];
        }
        if step >= args.warmup {
            times.push(elapsed);
            idle += report.idle.as_secs_f64();
            wall += report.wall.as_secs_f64();
            held = held.max(report.max_in_flight);
            bytes = bytes.max(report.max_activation_bytes);
        }
    }
    times.sort_by(f64::total_cmp);
    let step = times.get(times.len() / 2).copied().unwrap_or(0.0);
    let mine = vec![
        pipe.stage() as f64,
        replica as f64,
        params as f64,
        if wall > 0.0 { idle / wall } else { 0.0 },
        held as f64,
        bytes as f64,
    ];
    let all = world.comm().all_gather(mine).wait()?;
    if world.is_main() {
        let mut stages: Vec<(usize, Stage)> = all
            .chunks(6)
            .filter(|v| v[1] == 0.0)
            .map(|v| {
                (
                    v[0] as usize,
                    Stage {
                        params: v[2] as u64,
                        idle: v[3],
                        held: v[4] as usize,
                        activation_bytes: v[5] as usize,
                    },
                )
            })
            .collect();
        stages.sort_by_key(|(s, _)| *s);
        let f = Figures {
            step_ms: step * 1e3,
            tokens_per_s: (args.batch * args.context) as f64 / step,
            stages: stages.into_iter().map(|(_, s)| s).collect(),
            first_loss,
        };
        let text = serde_json::to_string(&f).map_err(|source| CliError::ResultJson {
            path: result.to_path_buf(),
            source,
        })?;
        std::fs::write(result, text).map_err(|source| CliError::ResultFile {
            path: result.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}
