//! The bundled GPT split over a tensor-parallel group (`BONFIRE_TP` ranks) and trained.
use bonfire::models::{Gpt, GptConfig};
use bonfire::{TensorParallel, TpPlan};
use bonfire_book::text::{VOCAB, batch};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::ElementConversion;

type B = Autodiff<TensorParallel<Flex>>; // or Wgpu, Cuda

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let world = bonfire::init()?; // BONFIRE_TP=2 bonfire launch --nproc-per-node 2 -- ./train
    let device = FlexDevice;
    // Split dimensions (4 heads, MLP width 256, vocabulary 128) divide by 2 and 4.
    let config = GptConfig::new(VOCAB)
        .with_context(32)
        .with_layers(2)
        .with_embd(64);
    let model: Gpt<B> = config.init(&device); // the model, unchanged
    let plan = TpPlan::new()
        .vocab("tok")
        .column("blocks.*.attn.query")
        .column("blocks.*.attn.key")
        .column("blocks.*.attn.value")
        .row("blocks.*.attn.output")
        .column("blocks.*.mlp.fc1")
        .row("blocks.*.mlp.fc2");
    let mut model = bonfire::tensor_parallel(model, &plan, world.tp_group())?;

    // The training loop, unchanged: every rank of the group runs the same batch.
    let mut optim = AdamConfig::new().init();
    for step in 0..30 {
        let (tokens, targets) = batch(step, 0, 8, config.context, &device);
        let loss = model.loss(tokens, targets);
        if step % 5 == 0 {
            // Reading a tensor the group holds split or as a pending sum is collective: every
            // rank of the group reads it, even where only one prints it.
            let value = loss.clone().into_scalar().elem::<f32>();
            if world.is_main() {
                println!("step {step}: loss {value:.4}");
            }
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    Ok(())
}
