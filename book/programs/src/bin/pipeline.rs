//! Burn's own `TransformerEncoder`, its layers split into pipeline stages over the job's ranks,
//! trained as a character model on the book's text: the embedding on the first stage, the head
//! on the last, micro-batches flowing through under 1F1B (or GPipe with `BOOK_SCHEDULE=gpipe`;
//! `BOOK_MICRO_BATCHES` sets their number, 8 by default, and `BOOK_REPORT=1` makes every stage
//! say at the end how long it idled, against the bubble's formula, and what it held;
//! `BOOK_CHUNKS=2` runs interleaved 1F1B, each rank holding 2 chunks of the encoder).
//!
//! The stages are `BONFIRE_PP` ranks (`bonfire::init`'s pipeline group); with more ranks than
//! stages, the job is several replicas of the pipeline, each on its share of the batch, every
//! stage averaging its gradients with the same stage of the other replicas.
use bonfire::DataParallel;
use bonfire::pipeline::{Pipeline, Schedule, StageOutput, average_gradients, partition};
use bonfire::topology::ReduceOp;
use bonfire_book::materialised;
use bonfire_book::text::{VOCAB, batch};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, Optimizer};
use burn::tensor::backend::Backend;

type B = Autodiff<DataParallel<Flex>>;

const LAYERS: usize = 4;
const WIDTH: usize = 64;
const CONTEXT: usize = 32;
const BATCH: usize = 16;

// ANCHOR: stage
/// One stage: some of the encoder's layers, with the embedding on the first stage and the
/// head on the last.
#[derive(Module, Debug)]
struct Stage<B: Backend> {
    embed: Option<Embedding<B>>,
    layers: Vec<TransformerEncoderLayer<B>>,
    head: Option<Linear<B>>,
}

/// Layer `i` of the encoder, the same on whichever stage builds it (its own seed).
fn layer(i: usize, device: &FlexDevice) -> TransformerEncoderLayer<B> {
    B::seed(device, 1000 + i as u64);
    let mut encoder = TransformerEncoderConfig::new(WIDTH, 4 * WIDTH, 4, 1)
        .with_dropout(0.0)
        .init(device);
    materialised(encoder.layers.remove(0))
}
// ANCHOR_END: stage

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let world = bonfire::init()?;
    let device = FlexDevice;
    let schedule: Schedule = std::env::var("BOOK_SCHEDULE")
        .unwrap_or_else(|_| "1f1b".into())
        .parse()?;
    let micro_batches: usize = std::env::var("BOOK_MICRO_BATCHES")
        .unwrap_or_else(|_| "8".into())
        .parse()?;
    let chunks: usize = std::env::var("BOOK_CHUNKS")
        .unwrap_or_else(|_| "1".into())
        .parse()?;
    // ANCHOR: split
    // One stage per rank of the pipeline group (BONFIRE_PP ranks), each holding `chunks` chunks
    // of the encoder (1: its stage; more: interleaved 1F1B, rank r holding the model's chunks r,
    // r + p, ...); the layers split evenly (by parameter count, as they are all alike); each
    // rank builds only its own. With more ranks than stages, each replica of the pipeline takes
    // its share of the batch.
    let (dp, replica) = (world.dp_group().size(), world.dp_group().rank());
    let pipe =
        Pipeline::new(world.pp_group().clone(), schedule, micro_batches)?.interleaved(chunks)?;
    let (p, r) = (pipe.stages(), pipe.stage());
    if p * chunks > LAYERS {
        return Err(format!(
            "{p} stages of {chunks} chunk(s): more chunks than the {LAYERS} layers"
        )
        .into());
    }
    let ranges = partition(&[1; LAYERS], p * chunks);
    let mut model: Vec<Stage<B>> = (0..chunks)
        .map(|c| {
            let range = ranges[c * p + r].clone();
            let (first, last) = (range.start == 0, range.end == LAYERS);
            Stage {
                embed: first.then(|| {
                    B::seed(&device, 1);
                    materialised(EmbeddingConfig::new(VOCAB, WIDTH).init(&device))
                }),
                layers: range.map(|i| layer(i, &device)).collect(),
                head: last.then(|| {
                    B::seed(&device, 2);
                    materialised(LinearConfig::new(WIDTH, VOCAB).init(&device))
                }),
            }
        })
        .collect();
    // ANCHOR_END: split
    let share = BATCH / dp;
    if micro_batches == 0 || !BATCH.is_multiple_of(dp) || !share.is_multiple_of(micro_batches) {
        return Err(format!(
            "BOOK_MICRO_BATCHES={micro_batches}: expected a divisor of {share} (a batch of \
             {BATCH} over {dp} replica(s))"
        )
        .into());
    }
    let mut optims: Vec<_> = model.iter().map(|_| AdamConfig::new().init()).collect();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let rows = share / micro_batches;
    let mask = generate_autoregressive_mask::<B>(rows, CONTEXT, &device);
    // After 5 steps of warm-up: the time waited, the pipeline's time, the whole step's (the
    // optimizer's too), the most held.
    let (mut idle, mut wall, mut total, mut held, mut bytes) = (0.0, 0.0, 0.0, 0, 0);
    for step in 0..30 {
        // Every stage builds the step's batch: the first reads its tokens, the last its targets.
        let (tokens, targets) = batch::<B>(step, replica * share, share, CONTEXT, &device);
        let started = std::time::Instant::now();
        // ANCHOR: step
        let (grads, report) =
            pipe.step_chunks(&model, &device, |stage: &Stage<B>, _, i, input| {
                let part = i * rows..(i + 1) * rows;
                let mut x = match (input, &stage.embed) {
                    (Some(x), _) => x,
                    (None, Some(embed)) => embed.forward(tokens.clone().slice(part.clone())),
                    (None, None) => unreachable!("the first chunk has the embedding"),
                };
                for layer in &stage.layers {
                    x = layer.forward(x, None, Some(mask.clone()));
                }
                match &stage.head {
                    None => StageOutput::Activation(x),
                    Some(head) => {
                        let logits = head.forward(x).reshape([rows * CONTEXT, VOCAB]);
                        let targets = targets.clone().slice(part).reshape([rows * CONTEXT]);
                        StageOutput::Loss(loss_fn.forward(logits, targets))
                    }
                }
            })?;
        // Each chunk: the same chunk of every replica averages its gradients (one all-reduce),
        // then its optimizer steps.
        let mut stepped = Vec::with_capacity(model.len());
        for ((chunk, grads), optim) in model.into_iter().zip(grads).zip(&mut optims) {
            let grads = average_gradients(world.dp_group(), &chunk, grads)?;
            stepped.push(optim.step(3e-3, chunk, grads));
        }
        model = stepped;
        // ANCHOR_END: step
        // The last stages hold their replica's loss; the mean over the replicas is the batch's.
        let loss = match report.loss {
            Some(l) => Some(
                world
                    .dp_group()
                    .all_reduce(vec![l], ReduceOp::Mean)
                    .wait()?[0],
            ),
            None => None,
        };
        if step >= 5 {
            total += started.elapsed().as_secs_f64();
            idle += report.idle.as_secs_f64();
            wall += report.wall.as_secs_f64();
            held = held.max(report.max_in_flight);
            bytes = bytes.max(report.max_activation_bytes);
        }
        // The last rank of the job is the last stage of the last replica.
        if let Some(loss) = loss
            && step % 5 == 0
            && world.rank().0 as usize + 1 == world.world_size()
        {
            println!(
                "step {step} (stage {} of {}: idle {:.0}% of the step, {} micro-batches held at most): loss {loss:.5}",
                pipe.stage(),
                pipe.stages(),
                100.0 * report.idle_fraction(),
                report.max_in_flight
            );
        }
    }
    if std::env::var_os("BOOK_REPORT").is_some() {
        println!(
            "stage {} of {}, {schedule}, {micro_batches} micro-batches, {chunks} chunk(s): idle {:.1}% of steps 5-29 \
             (bubble (p-1)/(v*m+p-1) = {:.1}%), step {:.1} ms with the optimizer's, held {held} micro-batches, {bytes} \
             activation bytes at most",
            pipe.stage(),
            pipe.stages(),
            100.0 * idle / wall,
            100.0 * pipe.bubble(),
            1000.0 * total / 25.0,
        );
    }
    Ok(())
}
