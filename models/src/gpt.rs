//! A GPT-style decoder: token and learned position embeddings, pre-norm blocks of causal
//! multi-head self-attention and a GELU MLP, a final layer norm, and a head tied to the token
//! embedding (or a linear head of its own).
//!
//! Parameter paths (what a tensor-parallel plan names): `tok`, `pos`, `blocks.<i>.ln1`,
//! `blocks.<i>.attn.{query,key,value,output}`, `blocks.<i>.ln2`, `blocks.<i>.mlp.{fc1,fc2}`,
//! `ln_f`, and `head` when untied.

use burn::config::Config;
use burn::module::Module;
use burn::nn::attention::{
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

/// The shape of a [`Gpt`].
#[derive(Config, Debug)]
pub struct GptConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// The longest sequence (positions learned).
    #[config(default = 128)]
    pub context: usize,
    /// Blocks.
    #[config(default = 4)]
    pub layers: usize,
    /// Attention heads per block.
    #[config(default = 4)]
    pub heads: usize,
    /// Width of the residual stream.
    #[config(default = 128)]
    pub embd: usize,
    /// Dropout after the attention and the MLP, and on the attention weights.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// The head shares the token embedding's weights (its transpose).
    #[config(default = true)]
    pub tied: bool,
}

/// The MLP of a block: `fc1` (width to 4 x width), GELU, `fc2` back.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

/// A pre-norm block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    ln1: LayerNorm<B>,
    attn: MultiHeadAttention<B>,
    ln2: LayerNorm<B>,
    mlp: Mlp<B>,
    dropout: Dropout,
}

/// A GPT-style decoder (see the module docs).
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    tok: Embedding<B>,
    pos: Embedding<B>,
    blocks: Vec<Block<B>>,
    ln_f: LayerNorm<B>,
    head: Option<Linear<B>>,
}

impl GptConfig {
    /// A freshly initialised model.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Gpt<B> {
        let block = || Block {
            ln1: LayerNormConfig::new(self.embd).init(device),
            attn: MultiHeadAttentionConfig::new(self.embd, self.heads)
                .with_dropout(self.dropout)
                .init(device),
            ln2: LayerNormConfig::new(self.embd).init(device),
            mlp: Mlp {
                fc1: LinearConfig::new(self.embd, 4 * self.embd).init(device),
                fc2: LinearConfig::new(4 * self.embd, self.embd).init(device),
            },
            dropout: DropoutConfig::new(self.dropout).init(),
        };
        Gpt {
            tok: EmbeddingConfig::new(self.vocab, self.embd).init(device),
            pos: EmbeddingConfig::new(self.context, self.embd).init(device),
            blocks: (0..self.layers).map(|_| block()).collect(),
            ln_f: LayerNormConfig::new(self.embd).init(device),
            head: (!self.tied).then(|| LinearConfig::new(self.embd, self.vocab).init(device)),
        }
    }
}

impl<B: Backend> Block<B> {
    fn forward(&self, x: Tensor<B, 3>, mask: Tensor<B, 3, burn::tensor::Bool>) -> Tensor<B, 3> {
        let a = self
            .attn
            .forward(MhaInput::self_attn(self.ln1.forward(x.clone())).mask_attn(mask))
            .context;
        let x = x + self.dropout.forward(a);
        let h = self
            .mlp
            .fc2
            .forward(gelu(self.mlp.fc1.forward(self.ln2.forward(x.clone()))));
        x + self.dropout.forward(h)
    }
}

impl<B: Backend> Gpt<B> {
    /// Logits `[batch, seq, vocab]` for tokens `[batch, seq]` (seq at most the context).
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, s] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<B, 1, Int>::arange(0..s as i64, &device)
            .reshape([1, s])
            .repeat_dim(0, b);
        let mut x = self.tok.forward(tokens) + self.pos.forward(positions);
        let mask = generate_autoregressive_mask::<B>(b, s, &device);
        for block in &self.blocks {
            x = block.forward(x, mask.clone());
        }
        let x = self.ln_f.forward(x);
        match &self.head {
            Some(head) => head.forward(x),
            None => x.matmul(self.tok.weight.val().transpose().unsqueeze::<3>()),
        }
    }

    /// Mean next-token cross-entropy (nats per token) of `tokens` predicting `targets` (both
    /// `[batch, seq]`).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [b, s] = tokens.dims();
        let device = tokens.device();
        let logits = self.forward(tokens);
        let vocab = logits.dims()[2];
        CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits.reshape([b * s, vocab]), targets.reshape([b * s]))
    }

    /// Tokens in the vocabulary.
    pub fn vocab(&self) -> usize {
        self.tok.weight.dims()[0]
    }

    /// The longest sequence.
    pub fn context(&self) -> usize {
        self.pos.weight.dims()[0]
    }
}
