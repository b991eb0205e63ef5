//! `bonfire bench tp`: training steps of the bundled GPT-style model split over 1, 2, 4 ...
//! tensor-parallel ranks, and over a data x tensor mesh with `--dp` (processes on this host under
//! the launcher), side by side for the same global batch: step time, tokens per second, each
//! rank's parameter and Adam-state memory, and the communication of a step (tensor-parallel
//! against Megatron-LM's for the same shapes; data-parallel gradient bytes apart).

use std::path::{Path, PathBuf};
use std::time::Instant;

use bonfire::Hybrid;
use bonfire::backend::tensor_parallel::{TpStats, local_part, stats};
use bonfire::models::{Gpt, GptConfig};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};

use crate::error::CliError;
use serde::{Deserialize, Serialize};

/// The hybrid backend at every mesh: at dp = 1 its data-parallel layer is a pass-through.
type B = Autodiff<Hybrid<Flex>>;

/// `bonfire bench tp`.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct Args {
    /// Tensor-parallel sizes to run.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    tp: Vec<usize>,
    /// Data-parallel sizes to run: each (dp, tp) pair runs as dp x tp processes on this host,
    /// every replica on its 1/dp of the global batch.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    dp: Vec<usize>,
    /// Blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 256)]
    embd: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Sequences per step, over all replicas (the global batch).
    #[arg(long, default_value_t = 8)]
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
    /// Set on the ranks this command starts: where rank 0 writes its figures.
    #[arg(long, hide = true)]
    result: Option<PathBuf>,
}

/// What rank 0 of one run measured.
#[derive(Serialize, Deserialize, Debug)]
struct Figures {
    dp: usize,
    tp: usize,
    threads: usize,
    step_ms: f64,
    tokens_per_s: f64,
    param_bytes: u64,
    adam_bytes: u64,
    all_reduces: f64,
    all_reduce_bytes: f64,
    gathers: f64,
    fallbacks: u64,
    dp_bytes: f64,
    /// Mean per step: time the tensor-parallel all-reduces held the thread, and the part of it
    /// spent waiting for a peer to call them.
    all_reduce_ms: f64,
    peer_wait_ms: f64,
    loss: f32,
}

pub(crate) fn run(args: Args) -> Result<(), CliError> {
    if let Some(result) = &args.result {
        return rank(&args, result);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "# bonfire bench tp: GPT, {} layers, width {}, {} heads, context {}, batch {}, vocabulary {}, Adam, {} timed steps after {}",
        args.layers,
        args.embd,
        args.heads,
        args.context,
        args.batch,
        args.vocab,
        args.steps,
        args.warmup
    );
    println!(
        "# {:>3} {:>3} {:>8} {:>10} {:>10} {:>13} {:>13} {:>10} {:>16} {:>16} {:>8} {:>9} {:>12} {:>10} {:>10}",
        "dp",
        "tp",
        "threads",
        "step(ms)",
        "tokens/s",
        "params/rank",
        "adam/rank",
        "allreds",
        "allred bytes",
        "megatron bytes",
        "gathers",
        "fallbacks",
        "dp bytes",
        "allred ms",
        "peer wait"
    );
    let dir = std::env::temp_dir().join(format!("bonfire-bench-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|source| CliError::ResultFile {
        path: dir.clone(),
        source,
    })?;
    let exe = std::env::current_exe().map_err(CliError::CurrentExe)?;
    let mesh = args
        .dp
        .iter()
        .flat_map(|&dp| args.tp.iter().map(move |&tp| (dp, tp)));
    for (dp, tp) in mesh {
        if dp == 0 || tp == 0 || !args.batch.is_multiple_of(dp) {
            return Err(CliError::Mesh {
                dp,
                tp,
                batch: args.batch,
            });
        }
        let ranks = dp * tp;
        let threads = args.threads.unwrap_or((cores / ranks).max(1));
        let result = dir.join(format!("dp{dp}-tp{tp}.json"));
        let mut config = bonfire::launch::LaunchConfig::local(ranks, exe.clone());
        config.args = vec![
            "bench".into(),
            "tp".into(),
            "--layers".into(),
            args.layers.to_string().into(),
            "--embd".into(),
            args.embd.to_string().into(),
            "--heads".into(),
            args.heads.to_string().into(),
            "--context".into(),
            args.context.to_string().into(),
            "--batch".into(),
            args.batch.to_string().into(),
            "--vocab".into(),
            args.vocab.to_string().into(),
            "--steps".into(),
            args.steps.to_string().into(),
            "--warmup".into(),
            args.warmup.to_string().into(),
            "--threads".into(),
            threads.to_string().into(),
            "--result".into(),
            result.clone().into(),
        ];
        config.extra_env = vec![
            ("BONFIRE_TP".into(), tp.to_string().into()),
            ("RAYON_NUM_THREADS".into(), threads.to_string().into()),
        ];
        bonfire::launch::launch(&config)?;
        let text = std::fs::read_to_string(&result).map_err(|source| CliError::ResultFile {
            path: result.clone(),
            source,
        })?;
        let f: Figures = serde_json::from_str(&text).map_err(|source| CliError::ResultJson {
            path: result.clone(),
            source,
        })?;
        let megatron = megatron_bytes(&args, dp, tp);
        println!(
            "  {:>3} {:>3} {:>8} {:>10.1} {:>10.0} {:>13} {:>13} {:>10.0} {:>16.0} {:>16} {:>8.0} {:>9} {:>12.0} {:>10.2} {:>10.2}",
            f.dp,
            f.tp,
            f.threads,
            f.step_ms,
            f.tokens_per_s,
            f.param_bytes,
            f.adam_bytes,
            f.all_reduces,
            f.all_reduce_bytes,
            megatron,
            f.gathers,
            f.fallbacks,
            f.dp_bytes,
            f.all_reduce_ms,
            f.peer_wait_ms
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "# bytes are each rank's all-reduce buffers per step (f32); megatron: (4 x layers + 2) x batch x context x width + 3 x batch x context, x 4 bytes, with batch the replica's (0 at tp = 1); dp bytes: each rank's data-parallel gradient all-reduce per step (its shards, f32, one flag per parameter); allred ms: per step, the time the tensor-parallel all-reduces held rank 0's thread (host staging included: the most that overlapping them with compute could save), peer wait: the part of it before every peer had called the all-reduce"
    );
    Ok(())
}

/// Each rank's all-reduce buffer bytes in one step of Megatron-LM's tensor parallelism for the
/// same model (f32, no sequence parallelism): per layer two activations forward (attention and
/// MLP outputs) and two backward (their inputs' gradients); the vocabulary-parallel embedding's
/// output and the tied head's input gradient; the vocabulary-parallel cross-entropy's max, sum of
/// exponentials and target logit per token.
fn megatron_bytes(args: &Args, dp: usize, tp: usize) -> u64 {
    if tp == 1 {
        return 0;
    }
    let tokens = (args.batch / dp * args.context) as u64;
    let activation = tokens * args.embd as u64;
    4 * ((4 * args.layers as u64 + 2) * activation + 3 * tokens)
}

/// Elements of this rank's part of every parameter.
fn local_elements<M: Module<B>>(model: &M) -> u64 {
    struct Count(u64);
    impl ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0 += local_part(param.val()).shape().num_elements() as u64;
        }
    }
    let mut c = Count(0);
    model.visit(&mut c);
    c.0
}

/// Elements of this rank's part of every gradient (what Adam keeps two of per parameter).
fn local_gradient_elements<M: Module<B>>(model: &M, grads: &GradientsParams) -> u64 {
    struct Count<'a>(&'a GradientsParams, u64);
    impl ModuleVisitor<B> for Count<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self
                .0
                .get::<<B as AutodiffBackend>::InnerBackend, D>(param.id)
            {
                self.1 += local_part(g).shape().num_elements() as u64;
            }
        }
    }
    let mut c = Count(grads, 0);
    model.visit(&mut c);
    c.1
}

/// Replica `replica` of `replicas`' rows of the next global batch (every rank draws the whole
/// batch from the same generator, so the replicas' parts are disjoint and make it up).
fn batch(
    rng: &mut rand_chacha::ChaCha8Rng,
    args: &Args,
    (replica, replicas): (usize, usize),
    device: &FlexDevice,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let (b, s) = (args.batch / replicas, args.context);
    let stream: Vec<i64> = (0..args.batch * (s + 1))
        .map(|_| rng.random_range(0..args.vocab as i64))
        .collect();
    let mut x = Vec::with_capacity(b * s);
    let mut y = Vec::with_capacity(b * s);
    for row in stream.chunks(s + 1).skip(replica * b).take(b) {
        x.extend_from_slice(&row[..s]);
        y.extend_from_slice(&row[1..]);
    }
    (
        Tensor::from_data(TensorData::new(x, [b, s]), device),
        Tensor::from_data(TensorData::new(y, [b, s]), device),
    )
}

/// One rank of a run: trains and, on rank 0, writes the figures to `result`.
fn rank(args: &Args, result: &Path) -> Result<(), CliError> {
    let world = bonfire::init()?;
    let device = FlexDevice;
    let model: Gpt<B> = GptConfig::new(args.vocab)
        .with_context(args.context)
        .with_layers(args.layers)
        .with_heads(args.heads)
        .with_embd(args.embd)
        .init(&device);
    let model = bonfire::tensor_parallel(model, &bonfire_jobs::gpt::plan(), world.tp_group())?;
    let mut model = bonfire::replicate(model);
    let replica = (world.dp_group().rank(), world.dp_group().size());
    let mut optim = AdamConfig::new().init::<B, Gpt<B>>();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut times = Vec::new();
    let mut comm = TpStats::default();
    let mut adam = 0;
    let mut loss = 0.0;
    for step in 0..args.warmup + args.steps {
        let (x, y) = batch(&mut rng, args, replica, &device);
        let before = stats().unwrap_or_default();
        let start = Instant::now();
        let l = model.loss(x, y);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        let after = stats().unwrap_or_default();
        adam = 2 * local_gradient_elements(&model, &grads);
        model = optim.step(1e-3, model, grads);
        let _ = <B as burn::tensor::backend::Backend>::sync(&device);
        let elapsed = start.elapsed().as_secs_f64();
        loss = l.into_scalar().elem::<f32>();
        if step >= args.warmup {
            times.push(elapsed);
            let d = after.since(&before);
            comm.all_reduces += d.all_reduces;
            comm.all_reduce_bytes += d.all_reduce_bytes;
            comm.all_reduce_time += d.all_reduce_time;
            comm.all_reduce_peer_wait += d.all_reduce_peer_wait;
            comm.gathers += d.gathers;
            for (op, n) in d.fallbacks {
                *comm.fallbacks.entry(op).or_default() += n;
            }
        }
    }
    times.sort_by(f64::total_cmp);
    let step = times.get(times.len() / 2).copied().unwrap_or(0.0);
    let steps = args.steps.max(1) as f64;
    // Every synchronised step counted so far (warm-up included); the gradient bytes are the
    // same every step.
    let dp_bytes = bonfire::total_stats()
        .filter(|t| t.steps > 0)
        .map_or(0.0, |t| t.bytes as f64 / t.steps as f64);
    if world.is_main() {
        let f = Figures {
            dp: world.mesh().dp(),
            tp: world.mesh().tp(),
            threads: args.threads.unwrap_or(1),
            step_ms: step * 1e3,
            tokens_per_s: (args.batch * args.context) as f64 / step,
            param_bytes: 4 * local_elements(&model),
            adam_bytes: 4 * adam,
            all_reduces: comm.all_reduces as f64 / steps,
            all_reduce_bytes: comm.all_reduce_bytes as f64 / steps,
            gathers: comm.gathers as f64 / steps,
            fallbacks: comm.fallback_total(),
            dp_bytes,
            all_reduce_ms: 1e3 * comm.all_reduce_time.as_secs_f64() / steps,
            peer_wait_ms: 1e3 * comm.all_reduce_peer_wait.as_secs_f64() / steps,
            loss,
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
