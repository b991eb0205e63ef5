//! Models, plans and loops for checking tensor-parallel training against the unsharded model:
//! a two-layer MLP, Burn's own `TransformerEncoder` (2 layers, 4 heads), and a GPT-style causal
//! block with a vocabulary-parallel embedding tied to its head, and a Llama-style decoder (RMSNorm,
//! Burn's `RotaryEncoding`, SwiGLU). Every model is an ordinary Burn module: the tensor-parallel
//! runs only add a plan.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::attention::{
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, RmsNorm,
    RmsNormConfig, RotaryEncoding, RotaryEncodingConfig,
};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::activation::{gelu, silu, softmax};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, ElementConversion, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use bonfire::TpPlan;

/// `Autodiff<TensorParallel<Flex>>`, the backend of the tensor-parallel checks.
pub type TpFlex = burn::backend::Autodiff<bonfire::TensorParallel<burn::backend::Flex>>;

/// A model of the checks: a batch of inputs to a scalar loss.
pub trait TpNet<B: Backend>: Module<B> + Clone + Send {
    /// The plan that splits it Megatron-style.
    fn plan() -> TpPlan;
    /// The loss on `batch`.
    fn loss(&self, batch: &TpBatch, device: &B::Device) -> Tensor<B, 1>;
    /// A random batch for this model.
    fn batch(seed: u64) -> TpBatch;
}

/// Inputs of a check: float features or token ids, and integer targets.
#[derive(Clone, Debug)]
pub struct TpBatch {
    /// Float inputs, with their shape (empty for token models).
    pub x: Vec<f32>,
    /// The shape of `x`.
    pub x_shape: Vec<usize>,
    /// Token ids `[batch, seq]` (empty for feature models).
    pub tokens: Vec<i64>,
    /// Targets: one class per row, or one next token per position.
    pub y: Vec<i64>,
    /// The shape of `tokens` (and of `y` for token models).
    pub t_shape: Vec<usize>,
}

fn features(seed: u64, shape: &[usize], classes: i64, rows: usize) -> TpBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    TpBatch {
        x: (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
        x_shape: shape.to_vec(),
        tokens: Vec::new(),
        y: (0..rows).map(|_| rng.random_range(0..classes)).collect(),
        t_shape: Vec::new(),
    }
}

fn cross_entropy<B: Backend>(logits: Tensor<B, 2>, y: &[i64], device: &B::Device) -> Tensor<B, 1> {
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(y.to_vec(), [y.len()]), device);
    CrossEntropyLossConfig::new()
        .init(device)
        .forward(logits, targets)
}

/// Column-parallel `fc1`, GELU, row-parallel `fc2`: Megatron's MLP.
#[derive(Module, Debug)]
pub struct TpMlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

impl<B: Backend> TpMlp<B> {
    /// 12 features, 16 hidden, 6 classes.
    pub fn new(device: &B::Device) -> Self {
        TpMlp {
            fc1: LinearConfig::new(12, 16).init(device),
            fc2: LinearConfig::new(16, 6).init(device),
        }
    }
}

impl<B: Backend> TpNet<B> for TpMlp<B> {
    fn plan() -> TpPlan {
        TpPlan::new().column("fc1").row("fc2")
    }

    fn loss(&self, batch: &TpBatch, device: &B::Device) -> Tensor<B, 1> {
        let shape = [batch.x_shape[0], batch.x_shape[1]];
        let x = Tensor::<B, 2>::from_data(TensorData::new(batch.x.clone(), shape), device);
        cross_entropy(
            self.fc2.forward(gelu(self.fc1.forward(x))),
            &batch.y,
            device,
        )
    }

    fn batch(seed: u64) -> TpBatch {
        features(seed, &[8, 12], 6, 8)
    }
}

/// Burn's `TransformerEncoder` (2 layers of width 16, 4 heads, feed-forward 32), mean-pooled,
/// and a linear head to 5 classes.
#[derive(Module, Debug)]
pub struct TpEncoder<B: Backend> {
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

impl<B: Backend> TpEncoder<B> {
    /// Post-norm, as Burn's default.
    pub fn new(device: &B::Device) -> Self {
        TpEncoder {
            encoder: TransformerEncoderConfig::new(16, 32, 4, 2)
                .with_dropout(0.0)
                .init(device),
            head: LinearConfig::new(16, 5).init(device),
        }
    }
}

/// Layers of [`TpEncoder`].
pub const ENCODER_LAYERS: usize = 2;

impl<B: Backend> TpNet<B> for TpEncoder<B> {
    fn plan() -> TpPlan {
        TpPlan::new()
            .column("encoder.layers.*.mha.query")
            .column("encoder.layers.*.mha.key")
            .column("encoder.layers.*.mha.value")
            .row("encoder.layers.*.mha.output")
            .column("encoder.layers.*.pwff.linear_inner")
            .row("encoder.layers.*.pwff.linear_outer")
    }

    fn loss(&self, batch: &TpBatch, device: &B::Device) -> Tensor<B, 1> {
        let [b, s, d] = [batch.x_shape[0], batch.x_shape[1], batch.x_shape[2]];
        let x = Tensor::<B, 3>::from_data(TensorData::new(batch.x.clone(), [b, s, d]), device);
        let y = self.encoder.forward(TransformerEncoderInput::new(x));
        cross_entropy(
            self.head.forward(y.mean_dim(1).reshape([b, d])),
            &batch.y,
            device,
        )
    }

    fn batch(seed: u64) -> TpBatch {
        features(seed, &[4, 6, 16], 5, 4)
    }
}

/// A GPT-style causal block: token embedding (vocabulary 16) and learned positions, a pre-norm
/// causal self-attention (4 heads) and GELU MLP, a final layer norm, and a head tied to the token
/// embedding. Next-token cross-entropy over 8 positions.
#[derive(Module, Debug)]
pub struct TpGpt<B: Backend> {
    embed: Embedding<B>,
    pos: Embedding<B>,
    ln1: LayerNorm<B>,
    attn: MultiHeadAttention<B>,
    ln2: LayerNorm<B>,
    fc1: Linear<B>,
    fc2: Linear<B>,
    ln_f: LayerNorm<B>,
}

/// Vocabulary and context of [`TpGpt`].
pub const GPT_VOCAB: usize = 16;
const GPT_CONTEXT: usize = 8;
const GPT_WIDTH: usize = 16;

impl<B: Backend> TpGpt<B> {
    /// A fresh block.
    pub fn new(device: &B::Device) -> Self {
        TpGpt {
            embed: EmbeddingConfig::new(GPT_VOCAB, GPT_WIDTH).init(device),
            pos: EmbeddingConfig::new(GPT_CONTEXT, GPT_WIDTH).init(device),
            ln1: LayerNormConfig::new(GPT_WIDTH).init(device),
            attn: MultiHeadAttentionConfig::new(GPT_WIDTH, 4)
                .with_dropout(0.0)
                .init(device),
            ln2: LayerNormConfig::new(GPT_WIDTH).init(device),
            fc1: LinearConfig::new(GPT_WIDTH, 4 * GPT_WIDTH).init(device),
            fc2: LinearConfig::new(4 * GPT_WIDTH, GPT_WIDTH).init(device),
            ln_f: LayerNormConfig::new(GPT_WIDTH).init(device),
        }
    }
}

impl<B: Backend> TpNet<B> for TpGpt<B> {
    fn plan() -> TpPlan {
        TpPlan::new()
            .vocab("embed")
            .column("attn.query")
            .column("attn.key")
            .column("attn.value")
            .row("attn.output")
            .column("fc1")
            .row("fc2")
    }

    fn loss(&self, batch: &TpBatch, device: &B::Device) -> Tensor<B, 1> {
        let [b, s] = [batch.t_shape[0], batch.t_shape[1]];
        let tokens = batch.token_ids::<B>(device);
        let positions = Tensor::<B, 1, Int>::arange(0..s as i64, device)
            .reshape([1, s])
            .repeat_dim(0, b);
        let x = self.embed.forward(tokens) + self.pos.forward(positions);
        let mask = generate_autoregressive_mask::<B>(b, s, device);
        let h = self.ln1.forward(x.clone());
        let x = x + self
            .attn
            .forward(MhaInput::self_attn(h).mask_attn(mask))
            .context;
        let h = self.ln2.forward(x.clone());
        let x = x + self.fc2.forward(gelu(self.fc1.forward(h)));
        let x = self.ln_f.forward(x);
        let table = self.embed.weight.val().transpose().unsqueeze::<3>();
        let logits = x.matmul(table).reshape([b * s, GPT_VOCAB]);
        cross_entropy(logits, &batch.y, device)
    }

    fn batch(seed: u64) -> TpBatch {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (b, s) = (4, GPT_CONTEXT);
        let stream: Vec<i64> = (0..b * (s + 1))
            .map(|_| rng.random_range(0..GPT_VOCAB as i64))
            .collect();
        let mut tokens = Vec::new();
        let mut y = Vec::new();
        for row in stream.chunks(s + 1) {
            tokens.extend_from_slice(&row[..s]);
            y.extend_from_slice(&row[1..]);
        }
        TpBatch {
            x: Vec::new(),
            x_shape: Vec::new(),
            tokens,
            y,
            t_shape: vec![b, s],
        }
    }
}

/// One decoder layer of [`TpLlama`]: pre-norm causal self-attention with rotary positions on
/// the queries and keys, then a pre-norm SwiGLU MLP; no biases, as Llama.
#[derive(Module, Debug)]
pub struct LlamaLayer<B: Backend> {
    attn_norm: RmsNorm<B>,
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    mlp_norm: RmsNorm<B>,
    gate: Linear<B>,
    up: Linear<B>,
    down: Linear<B>,
}

/// A Llama-style decoder written as a user would write it with `burn::nn`: token embedding
/// (vocabulary 16), [`LLAMA_LAYERS`] layers of width 16 with 4 heads and a SwiGLU MLP of 32, a
/// final RMSNorm and a head tied to the embedding. Burn's `RotaryEncoding` merges the batch with
/// the (split) heads: `[b, h, s, d] -> [b*h, s, d/2, 2]` and back.
#[derive(Module, Debug)]
pub struct TpLlama<B: Backend> {
    embed: Embedding<B>,
    layers: Vec<LlamaLayer<B>>,
    norm: RmsNorm<B>,
    rope: RotaryEncoding<B>,
}

/// Layers of [`TpLlama`].
pub const LLAMA_LAYERS: usize = 2;
const LLAMA_HEADS: usize = 4;
const LLAMA_HIDDEN: usize = 32;

fn linear<B: Backend>(i: usize, o: usize, device: &B::Device) -> Linear<B> {
    LinearConfig::new(i, o).with_bias(false).init(device)
}

impl<B: Backend> LlamaLayer<B> {
    fn new(device: &B::Device) -> Self {
        let d = GPT_WIDTH;
        LlamaLayer {
            attn_norm: RmsNormConfig::new(d).init(device),
            q: linear(d, d, device),
            k: linear(d, d, device),
            v: linear(d, d, device),
            o: linear(d, d, device),
            mlp_norm: RmsNormConfig::new(d).init(device),
            gate: linear(d, LLAMA_HIDDEN, device),
            up: linear(d, LLAMA_HIDDEN, device),
            down: linear(LLAMA_HIDDEN, d, device),
        }
    }

    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &RotaryEncoding<B>,
        mask: &Tensor<B, 4, Bool>,
    ) -> Tensor<B, 3> {
        let [b, s, d] = x.dims();
        let dh = d / LLAMA_HEADS;
        let heads = |t: Tensor<B, 3>| t.reshape([b, s, LLAMA_HEADS, dh]).swap_dims(1, 2);
        let h = self.attn_norm.forward(x.clone());
        let q = rope.forward(heads(self.q.forward(h.clone())));
        let k = rope.forward(heads(self.k.forward(h.clone())));
        let v = heads(self.v.forward(h));
        let scores = q
            .matmul(k.swap_dims(2, 3))
            .div_scalar((dh as f32).sqrt())
            .mask_fill(mask.clone(), -1.0e4);
        let context = softmax(scores, 3)
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, s, d]);
        let x = x + self.o.forward(context);
        let h = self.mlp_norm.forward(x.clone());
        x + self
            .down
            .forward(silu(self.gate.forward(h.clone())) * self.up.forward(h))
    }
}

impl<B: Backend> TpLlama<B> {
    /// A fresh decoder.
    pub fn new(device: &B::Device) -> Self {
        TpLlama {
            embed: EmbeddingConfig::new(GPT_VOCAB, GPT_WIDTH).init(device),
            layers: (0..LLAMA_LAYERS).map(|_| LlamaLayer::new(device)).collect(),
            norm: RmsNormConfig::new(GPT_WIDTH).init(device),
            rope: RotaryEncodingConfig::new(GPT_CONTEXT, GPT_WIDTH / LLAMA_HEADS).init(device),
        }
    }
}

impl<B: Backend> TpNet<B> for TpLlama<B> {
    /// The standard plan: vocabulary-parallel embedding, column-parallel q, k, v, gate and up,
    /// row-parallel o and down.
    fn plan() -> TpPlan {
        TpPlan::new()
            .vocab("embed")
            .column("layers.*.q")
            .column("layers.*.k")
            .column("layers.*.v")
            .row("layers.*.o")
            .column("layers.*.gate")
            .column("layers.*.up")
            .row("layers.*.down")
    }

    fn loss(&self, batch: &TpBatch, device: &B::Device) -> Tensor<B, 1> {
        let [b, s] = [batch.t_shape[0], batch.t_shape[1]];
        let tokens = batch.token_ids::<B>(device);
        let mask = generate_autoregressive_mask::<B>(b, s, device).reshape([b, 1, s, s]);
        let mut x = self.embed.forward(tokens);
        for layer in &self.layers {
            x = layer.forward(x, &self.rope, &mask);
        }
        let x = self.norm.forward(x);
        let table = self.embed.weight.val().transpose().unsqueeze::<3>();
        let logits = x.matmul(table).reshape([b * s, GPT_VOCAB]);
        cross_entropy(logits, &batch.y, device)
    }

    fn batch(seed: u64) -> TpBatch {
        <TpGpt<B> as TpNet<B>>::batch(seed)
    }
}

/// The loss and every parameter's gradient (module order, whole: a split gradient is gathered).
pub fn loss_and_grads<B, M>(model: &M, batch: &TpBatch, device: &B::Device) -> (f32, Vec<Vec<f32>>)
where
    B: AutodiffBackend,
    M: TpNet<B> + burn::module::AutodiffModule<B>,
{
    let loss = model.loss(batch, device);
    let grads = GradientsParams::from_grads(loss.backward(), model);
    let value = loss.into_scalar().elem::<f32>();
    (value, gradients::<B, M>(model, &grads))
}

/// Every parameter's gradient in `grads` (module order), whole.
pub fn gradients<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<Vec<f32>> {
    struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let g = self
                .0
                .get::<B::InnerBackend, D>(param.id)
                .map(|g| {
                    g.into_data()
                        .convert::<f32>()
                        .into_vec::<f32>()
                        .expect("f32")
                })
                .unwrap_or_default();
            self.1.push(g);
        }
    }
    let mut c = Collect(grads, Vec::new());
    model.visit(&mut c);
    c.1
}

impl TpBatch {
    /// The token ids as a `[batch, seq]` tensor.
    pub fn token_ids<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        let shape = [self.t_shape[0], self.t_shape[1]];
        Tensor::from_data(TensorData::new(self.tokens.clone(), shape), device)
    }

    /// Part `part` of `parts` equal parts of the batch (split along its first dimension), as a
    /// data-parallel rank gets it; the mean loss over the whole batch is the mean of the parts'.
    ///
    /// # Panics
    /// If the batch does not split into `parts` equal parts.
    pub fn part(&self, part: usize, parts: usize) -> TpBatch {
        fn rows<T: Clone>(v: &[T], shape: &[usize], part: usize, parts: usize) -> Vec<T> {
            if v.is_empty() {
                return Vec::new();
            }
            assert!(
                shape[0].is_multiple_of(parts),
                "a batch of {} rows does not split in {parts}",
                shape[0]
            );
            let row = v.len() / shape[0];
            let n = shape[0] / parts * row;
            v[part * n..(part + 1) * n].to_vec()
        }
        let shrink = |shape: &[usize]| {
            let mut s = shape.to_vec();
            if let Some(first) = s.first_mut() {
                *first /= parts;
            }
            s
        };
        let y_shape = if self.t_shape.is_empty() {
            vec![self.y.len()]
        } else {
            self.t_shape.clone()
        };
        TpBatch {
            x: rows(&self.x, &self.x_shape, part, parts),
            x_shape: shrink(&self.x_shape),
            tokens: rows(&self.tokens, &self.t_shape, part, parts),
            y: rows(&self.y, &y_shape, part, parts),
            t_shape: shrink(&self.t_shape),
        }
    }
}

/// `steps` Adam steps (lr 0.001) on batches from seeds `100..100 + steps`; returns the model and
/// each step's loss.
pub fn adam_steps<B, M>(model: M, steps: usize, device: &B::Device) -> (M, Vec<f32>)
where
    B: AutodiffBackend,
    M: TpNet<B> + burn::module::AutodiffModule<B>,
{
    adam_steps_on_part(model, steps, device, 0, 1)
}

/// [`adam_steps`] on part `part` of `parts` of each batch ([`TpBatch::part`]): a data-parallel
/// rank's share of the union batch.
pub fn adam_steps_on_part<B, M>(
    model: M,
    steps: usize,
    device: &B::Device,
    part: usize,
    parts: usize,
) -> (M, Vec<f32>)
where
    B: AutodiffBackend,
    M: TpNet<B> + burn::module::AutodiffModule<B>,
{
    let mut optim = AdamConfig::new().init::<B, M>();
    let (model, losses, _) = steps_on_part(model, &mut optim, steps, device, part, parts);
    (model, losses)
}

/// [`adam_steps_on_part`] with `optim` (a sharded Adam, say): the model, each step's loss, and
/// the bytes of gradient each step handed the optimizer ([`bonfire::gradient_bytes`]).
pub fn steps_on_part<B, M, O>(
    mut model: M,
    optim: &mut O,
    steps: usize,
    device: &B::Device,
    part: usize,
    parts: usize,
) -> (M, Vec<f32>, Vec<usize>)
where
    B: AutodiffBackend,
    M: TpNet<B> + burn::module::AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let mut losses = Vec::new();
    let mut held = Vec::new();
    for step in 0..steps {
        let batch = M::batch(100 + step as u64).part(part, parts);
        let loss = model.loss(&batch, device);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        held.push(bonfire::gradient_bytes(&model, &grads));
        losses.push(loss.into_scalar().elem::<f32>());
        model = optim.step(0.001, model, grads);
    }
    (model, losses, held)
}
