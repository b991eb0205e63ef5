//! Small models and a plain Burn training loop, the same for one rank and for many, so that
//! data-parallel training can be checked against single-rank training of the same model.

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The backend of the checks: Burn's CPU backend under the data-parallel decorator.
pub type Flex = burn::backend::Flex;
/// `Autodiff<DataParallel<Flex>>`.
pub type DpFlex = burn::backend::Autodiff<bonfire::DataParallel<Flex>>;

/// A model that maps a batch of flat feature rows to class logits.
pub trait Net<B: Backend>: Module<B> + Clone + Send {
    /// Features per sample.
    const FEATURES: usize;
    /// Classes.
    const CLASSES: usize;
    /// Logits `[batch, CLASSES]` for inputs `[batch, FEATURES]`.
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2>;
}

/// Two convolutions and a linear head over 8x8 single-channel images.
#[derive(Module, Debug)]
pub struct SmallCnn<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    head: Linear<B>,
}

impl<B: Backend> SmallCnn<B> {
    /// A freshly initialised model (uses the backend's random generator).
    pub fn new(device: &B::Device) -> Self {
        SmallCnn {
            conv1: Conv2dConfig::new([1, 4], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            conv2: Conv2dConfig::new([4, 8], [3, 3])
                .with_stride([2, 2])
                .init(device),
            head: LinearConfig::new(8 * 3 * 3, 10).init(device),
        }
    }
}

impl<B: Backend> Net<B> for SmallCnn<B> {
    const FEATURES: usize = 64;
    const CLASSES: usize = 10;

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let [batch, _] = x.dims();
        let x = x.reshape([batch, 1, 8, 8]);
        let x = relu(self.conv1.forward(x));
        let x = relu(self.conv2.forward(x));
        self.head.forward(x.reshape([batch, 8 * 3 * 3]))
    }
}

/// Two linear layers with a ReLU between: the cheapest model with several parameters of
/// different sizes, for checks on backends whose kernels are slow to compile (wgpu on a software
/// GPU).
#[derive(Module, Debug)]
pub struct SmallMlp<B: Backend> {
    hidden: Linear<B>,
    head: Linear<B>,
}

impl<B: Backend> SmallMlp<B> {
    /// A freshly initialised model (uses the backend's random generator).
    pub fn new(device: &B::Device) -> Self {
        SmallMlp {
            hidden: LinearConfig::new(12, 8).init(device),
            head: LinearConfig::new(8, 3).init(device),
        }
    }
}

impl<B: Backend> Net<B> for SmallMlp<B> {
    const FEATURES: usize = 12;
    const CLASSES: usize = 3;

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.head.forward(relu(self.hidden.forward(x)))
    }
}

/// One pre-norm transformer encoder layer over 6 tokens of width 16, mean-pooled, and a head.
#[derive(Module, Debug)]
pub struct SmallTransformer<B: Backend> {
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

impl<B: Backend> SmallTransformer<B> {
    /// A freshly initialised model (uses the backend's random generator).
    pub fn new(device: &B::Device) -> Self {
        SmallTransformer {
            encoder: TransformerEncoderConfig::new(16, 32, 2, 1)
                .with_dropout(0.0)
                .with_norm_first(true)
                .init(device),
            head: LinearConfig::new(16, 5).init(device),
        }
    }
}

impl<B: Backend> Net<B> for SmallTransformer<B> {
    const FEATURES: usize = 6 * 16;
    const CLASSES: usize = 5;

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let [batch, _] = x.dims();
        let x = x.reshape([batch, 6, 16]);
        let y = self.encoder.forward(TransformerEncoderInput::new(x));
        self.head.forward(y.mean_dim(1).reshape([batch, 16]))
    }
}

/// A labelled batch as plain numbers.
#[derive(Clone, Debug)]
pub struct Batch {
    /// `[rows, features]`, row-major.
    pub x: Vec<f32>,
    /// One class per row.
    pub y: Vec<i64>,
    /// Features per row.
    pub features: usize,
}

impl Batch {
    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.y.len()
    }

    /// Rows `[start, start + n)`.
    pub fn slice(&self, start: usize, n: usize) -> Batch {
        Batch {
            x: self.x[start * self.features..(start + n) * self.features].to_vec(),
            y: self.y[start..start + n].to_vec(),
            features: self.features,
        }
    }

    /// Rank `rank`'s equal share of the batch over `world` ranks (the rows past the last whole
    /// share are no rank's).
    pub fn share(&self, rank: usize, world: usize) -> Batch {
        let n = self.rows() / world;
        self.slice(rank * n, n)
    }
}

/// `steps` random batches of `rows` rows, from `seed`.
pub fn random_batches(
    seed: u64,
    steps: usize,
    rows: usize,
    features: usize,
    classes: usize,
) -> Vec<Batch> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..steps)
        .map(|_| Batch {
            x: (0..rows * features)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect(),
            y: (0..rows)
                .map(|_| rng.random_range(0..classes as i64))
                .collect(),
            features,
        })
        .collect()
}

/// A model from `make`, created with the backend seeded by `seed`, its parameters materialised
/// (Burn initialises parameters lazily; this keeps initialisation on the calling thread). CPU
/// backends seed one generator per process, so seeding and initialising hold a lock: tests
/// running side by side would otherwise draw from each other's sequence.
pub fn seeded<B: Backend, M: Module<B>>(
    seed: u64,
    device: &B::Device,
    make: impl FnOnce(&B::Device) -> M,
) -> M {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = RNG.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, seed);
    make(device).map(&mut Materialise)
}

struct Materialise;
impl<B: Backend> ModuleMapper<B> for Materialise {}

/// Cross-entropy loss of `model` on `batch`, scaled by `scale`.
pub fn loss<B: AutodiffBackend, M: Net<B>>(
    model: &M,
    batch: &Batch,
    scale: f32,
    device: &B::Device,
) -> Tensor<B, 1> {
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(batch.x.clone(), [batch.rows(), batch.features]),
        device,
    );
    let y =
        Tensor::<B, 1, Int>::from_data(TensorData::new(batch.y.clone(), [batch.rows()]), device);
    let logits = model.forward(x);
    CrossEntropyLossConfig::new()
        .init(device)
        .forward(logits, y)
        * scale
}

/// The plain loop: per batch, forward, backward, one SGD step (lr 0.1, momentum 0.9). With
/// `micro > 1`, each batch is split into `micro` micro-batches whose gradients are accumulated
/// with [`bonfire::accumulate`] and stepped once. Returns the model and each step's loss.
pub fn train<B, M>(
    mut model: M,
    batches: &[Batch],
    micro: usize,
    device: &B::Device,
) -> (M, Vec<f32>)
where
    B: AutodiffBackend,
    M: Net<B> + AutodiffModule<B>,
{
    let mut optim = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new()))
        .init::<B, M>();
    let mut losses = Vec::new();
    for batch in batches {
        let rows = batch.rows() / micro;
        let mut step_loss = 0.0;
        for m in 0..micro {
            let l = loss(
                &model,
                &batch.slice(m * rows, rows),
                1.0 / micro as f32,
                device,
            );
            step_loss += l.clone().into_scalar().elem::<f32>();
            if m + 1 < micro {
                model = bonfire::accumulate(model, l);
            } else {
                let grads = GradientsParams::from_grads(l.backward(), &model);
                model = optim.step(0.1, model, grads);
            }
        }
        losses.push(step_loss);
    }
    (model, losses)
}

/// Every float parameter's values, in module order.
pub fn parameters<B: Backend, M: Module<B>>(model: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.push(data.into_vec::<f32>().expect("f32 values"));
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

/// The largest absolute difference between two models' parameters (same architecture).
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "different numbers of parameters");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "a parameter differs in size");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

use burn::tensor::ElementConversion;

/// Writes parameters (module order, little-endian f32) to `path`, creating its directory: how the
/// multi-process checks hand a rank's result to the test.
pub fn write_params(path: &std::path::Path, params: &[Vec<f32>]) -> std::io::Result<()> {
    let bytes: Vec<u8> = params
        .iter()
        .flatten()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, bytes)
}

/// Reads what [`write_params`] wrote, flattened. Panics naming the file if it cannot.
pub fn read_params(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
