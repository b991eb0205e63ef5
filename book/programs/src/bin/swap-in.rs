//! A plain Burn training loop made data-parallel: the four changes are marked.
use bonfire::{DataParallel, DistributedSampler};
use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

type B = Autodiff<DataParallel<Flex>>; // 1. was Autodiff<Flex>

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let world = bonfire::init()?; // 2. join the job (a job of one without a launcher)
    let device = FlexDevice;
    B::seed(&device, 42); // the same start in every run

    let model: Linear<B> = LinearConfig::new(4, 3).init(&device);
    let mut model = bonfire::replicate(model); // 3. rank 0's parameters on every rank
    let mut optim = SgdConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);

    let (xs, ys) = data(64);
    // 4. each rank takes its own shard of the data set, reshuffled every epoch
    let sampler = DistributedSampler::new(ys.len(), world.world_size(), world.rank().0 as usize, 7);
    for epoch in 0..5 {
        let (mut sum, mut batches) = (0.0, 0);
        for batch in sampler.indices(epoch).chunks(8) {
            let x: Vec<f32> = batch
                .iter()
                .flat_map(|&i| xs[i * 4..i * 4 + 4].to_vec())
                .collect();
            let y: Vec<i64> = batch.iter().map(|&i| ys[i]).collect();
            let x = Tensor::<B, 2>::from_data(TensorData::new(x, [batch.len(), 4]), &device);
            let y = Tensor::<B, 1, Int>::from_data(TensorData::new(y, [batch.len()]), &device);

            let loss = loss_fn.forward(model.forward(x), y);
            sum += loss.clone().into_scalar().elem::<f32>();
            batches += 1;
            let grads = GradientsParams::from_grads(loss.backward(), &model); // averaged here
            model = optim.step(0.5, model, grads);
        }
        if world.is_main() {
            println!("epoch {epoch}: loss {:.4}", sum / batches as f32); // rank 0's batches
        }
    }
    if world.is_main() {
        println!("done; last step: {:?}", bonfire::last_step_stats());
    }
    Ok(())
}

/// `n` samples of 4 features; sample `i` is of class `i % 3`, which its feature of that index
/// shows above a deterministic noise.
fn data(n: usize) -> (Vec<f32>, Vec<i64>) {
    let noise = |i: usize| ((i * 37 % 11) as f32) / 22.0;
    let xs = (0..n * 4)
        .map(|j| noise(j) + f32::from(j % 4 == (j / 4) % 3))
        .collect();
    let ys = (0..n).map(|i| (i % 3) as i64).collect();
    (xs, ys)
}
