//! The bundled GPT on a data x tensor mesh: split over each group, replicated over the groups.
use bonfire::models::{Gpt, GptConfig};
use bonfire::{Hybrid, TpPlan};
use bonfire_book::text::{VOCAB, batch};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::ElementConversion;

type B = Autodiff<Hybrid<Flex>>; // or Hybrid<Wgpu>, Hybrid<Cuda>

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let world = bonfire::init()?; // BONFIRE_TP=2 bonfire launch --nproc-per-node 4 -- ./train
    let device = FlexDevice;
    let config = GptConfig::new(VOCAB)
        .with_context(32)
        .with_layers(2)
        .with_embd(64);
    let model: Gpt<B> = config.init(&device);
    let plan = TpPlan::new()
        .vocab("tok")
        .column("blocks.*.attn.query")
        .column("blocks.*.attn.key")
        .column("blocks.*.attn.value")
        .row("blocks.*.attn.output")
        .column("blocks.*.mlp.fc1")
        .row("blocks.*.mlp.fc2");
    let model = bonfire::tensor_parallel(model, &plan, world.tp_group())?;
    let mut model = bonfire::replicate(model);
    // Each replica reads its part of the data: the data-parallel group's rank and size.
    let (replica, replicas) = (world.dp_group().rank(), world.dp_group().size());

    let rows = 8 / replicas; // a global batch of 8 rows
    let mut optim = AdamConfig::new().init();
    for step in 0..30 {
        let (tokens, targets) = batch(step, replica * rows, rows, config.context, &device);
        let loss = model.loss(tokens, targets);
        if step % 5 == 0 {
            // Reading a tensor the group holds split or as a pending sum is collective: every
            // rank of the group reads it, even where only one prints it.
            let value = loss.clone().into_scalar().elem::<f32>();
            if world.is_main() {
                println!("step {step}: loss {value:.4}");
            }
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model); // averaged over replicas
        model = optim.step(3e-3, model, grads);
    }
    Ok(())
}
