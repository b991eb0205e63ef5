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
use burn::nn::{Initializer, Linear, LinearConfig};
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
        // Small embeddings (GPT-2's 0.02): the head is tied to the token embedding, and Burn's
        // default N(0, 1) would start the logits at a standard deviation of about sqrt(embd)
        // (an initial loss near 50 nats instead of ln(vocab)).
        let embedding = |n: usize| {
            EmbeddingConfig::new(n, self.embd)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device)
        };
        Gpt {
            tok: embedding(self.vocab),
            pos: embedding(self.context),
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
        let x = run_blocks(&self.blocks, embed(&self.tok, &self.pos, tokens));
        logits(&self.ln_f, self.head.as_ref(), Some(&self.tok), x)
    }

    /// Mean next-token cross-entropy (nats per token) of `tokens` predicting `targets` (both
    /// `[batch, seq]`).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        cross_entropy(self.forward(tokens), targets)
    }

    /// Blocks `blocks` (of `0..layers`) of the model as one pipeline stage: the embeddings come
    /// along when the range starts at block 0, the final norm and the head when it ends at the
    /// last block, and a tied head keeps the token embedding on the last stage too (its
    /// gradient is then the sum of the two stages', see [`GptStage::tied_embedding`]). Every
    /// parameter keeps its id, so the stages of one model put together
    /// ([`GptStage::assemble`]) are that model.
    ///
    /// # Panics
    /// If `blocks` is empty or reaches past the last block.
    pub fn into_stage(self, blocks: std::ops::Range<usize>) -> GptStage<B> {
        let layers = self.blocks.len();
        assert!(
            blocks.start < blocks.end && blocks.end <= layers,
            "blocks {blocks:?} of a model of {layers}"
        );
        let (first, last) = (blocks.start == 0, blocks.end == layers);
        let tied = self.head.is_none();
        GptStage {
            tok: (first || (last && tied)).then_some(self.tok),
            pos: first.then_some(self.pos),
            blocks: self
                .blocks
                .into_iter()
                .skip(blocks.start)
                .take(blocks.len())
                .collect(),
            ln_f: last.then_some(self.ln_f),
            head: if last { self.head } else { None },
            first_block: blocks.start,
            tied,
        }
    }

    /// Parameters per block, in block order: what a pipeline's stages are balanced by.
    pub fn block_params(&self) -> Vec<u64> {
        self.blocks.iter().map(|b| b.num_params() as u64).collect()
    }
}

/// Token and position embeddings of `tokens` `[batch, seq]`.
fn embed<B: Backend>(
    tok: &Embedding<B>,
    pos: &Embedding<B>,
    tokens: Tensor<B, 2, Int>,
) -> Tensor<B, 3> {
    let [b, s] = tokens.dims();
    let device = tokens.device();
    let positions = Tensor::<B, 1, Int>::arange(0..s as i64, &device)
        .reshape([1, s])
        .repeat_dim(0, b);
    tok.forward(tokens) + pos.forward(positions)
}

/// `blocks` over the residual stream `x` `[batch, seq, width]`, causally masked.
fn run_blocks<B: Backend>(blocks: &[Block<B>], mut x: Tensor<B, 3>) -> Tensor<B, 3> {
    if blocks.is_empty() {
        return x;
    }
    let [b, s, _] = x.dims();
    let mask = generate_autoregressive_mask::<B>(b, s, &x.device());
    for block in blocks {
        x = block.forward(x, mask.clone());
    }
    x
}

/// The final norm and the head (or the tied embedding's transpose) over `x`: logits.
fn logits<B: Backend>(
    ln_f: &LayerNorm<B>,
    head: Option<&Linear<B>>,
    tok: Option<&Embedding<B>>,
    x: Tensor<B, 3>,
) -> Tensor<B, 3> {
    let x = ln_f.forward(x);
    match (head, tok) {
        (Some(head), _) => head.forward(x),
        (None, Some(tok)) => x.matmul(tok.weight.val().transpose().unsqueeze::<3>()),
        (None, None) => unreachable!("a tied head keeps the token embedding on its stage"),
    }
}

/// Mean cross-entropy of `logits` `[batch, seq, vocab]` against `targets` `[batch, seq]`.
fn cross_entropy<B: Backend>(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [b, s, vocab] = logits.dims();
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([b * s, vocab]), targets.reshape([b * s]))
}

/// One pipeline stage of a [`Gpt`] ([`Gpt::into_stage`]): some of its blocks, with the
/// embeddings on the first stage and the final norm and head on the last.
#[derive(Module, Debug)]
pub struct GptStage<B: Backend> {
    tok: Option<Embedding<B>>,
    pos: Option<Embedding<B>>,
    blocks: Vec<Block<B>>,
    ln_f: Option<LayerNorm<B>>,
    head: Option<Linear<B>>,
    first_block: usize,
    tied: bool,
}

impl<B: Backend> GptStage<B> {
    /// Whether this stage reads the tokens (it holds the embeddings).
    pub fn is_first(&self) -> bool {
        self.pos.is_some()
    }

    /// Whether this stage computes the loss (it holds the head).
    pub fn is_last(&self) -> bool {
        self.ln_f.is_some()
    }

    /// The blocks this stage holds, as indices of the whole model's.
    pub fn blocks(&self) -> std::ops::Range<usize> {
        self.first_block..self.first_block + self.blocks.len()
    }

    /// The token embedding's weight when it is tied to the head and this stage uses it but not
    /// alone: on the first and the last stage of a pipeline of several. Its gradient is the sum
    /// of both stages' (the input's part and the head's), which the two must exchange before
    /// their optimizers step, as Megatron-LM's embedding group does.
    pub fn tied_embedding(&self) -> Option<&burn::module::Param<Tensor<B, 2>>> {
        let shared = self.tied && (self.is_first() != self.is_last());
        self.tok.as_ref().filter(|_| shared).map(|t| &t.weight)
    }

    /// The stage's forward: the embeddings of `tokens` on the first stage, else `input` (the
    /// previous stage's activation), through the stage's blocks.
    ///
    /// # Panics
    /// On the first stage without tokens, or another stage without an input.
    pub fn forward(
        &self,
        tokens: Option<Tensor<B, 2, Int>>,
        input: Option<Tensor<B, 3>>,
    ) -> Tensor<B, 3> {
        let x = match (&self.tok, &self.pos, tokens, input) {
            (Some(tok), Some(pos), Some(tokens), _) => embed(tok, pos, tokens),
            (_, None, _, Some(x)) => x,
            _ => panic!(
                "stage of blocks {:?}: the first stage takes tokens, the others an input",
                self.blocks()
            ),
        };
        run_blocks(&self.blocks, x)
    }

    /// The last stage's loss: the final norm and the head over its blocks' output `x`, mean
    /// cross-entropy against `targets` `[batch, seq]`.
    ///
    /// # Panics
    /// On any stage but the last.
    pub fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let Some(ln_f) = &self.ln_f else {
            panic!("stage of blocks {:?} is not the last", self.blocks());
        };
        let logits = logits(ln_f, self.head.as_ref(), self.tok.as_ref(), x);
        cross_entropy(logits, targets)
    }

    /// The whole model from the records of its stages, in stage order: the blocks of each, the
    /// embeddings of the first, the final norm and the head of the last.
    ///
    /// # Panics
    /// If the stages are not those of one model (a part missing).
    pub fn assemble(stages: Vec<GptStageRecord<B>>) -> GptRecord<B> {
        let count = stages.len();
        let mut blocks = Vec::new();
        let (mut tok, mut pos, mut ln_f, mut head) = (None, None, None, None);
        for (i, stage) in stages.into_iter().enumerate() {
            if i == 0 {
                tok = stage.tok;
                pos = stage.pos;
            }
            if i + 1 == count {
                ln_f = stage.ln_f;
                head = stage.head;
            }
            blocks.extend(stage.blocks);
        }
        GptRecord {
            tok: tok.expect("the first stage holds the token embedding"),
            pos: pos.expect("the first stage holds the position embedding"),
            blocks,
            ln_f: ln_f.expect("the last stage holds the final norm"),
            head,
        }
    }
}

impl<B: Backend> Gpt<B> {
    /// Tokens in the vocabulary.
    pub fn vocab(&self) -> usize {
        self.tok.weight.dims()[0]
    }

    /// The longest sequence.
    pub fn context(&self) -> usize {
        self.pos.weight.dims()[0]
    }

    /// `prompt` (token ids, at least one) followed by `new_tokens` tokens drawn one at a time
    /// from the model's next-token distribution as `sampling` shapes it. The model sees at most
    /// its last [`Gpt::context`] tokens. Deterministic for a given seed.
    ///
    /// # Panics
    /// If `prompt` is empty.
    pub fn generate(&self, prompt: &[u32], new_tokens: usize, sampling: &Sampling) -> Vec<u32> {
        self.generate_within(prompt, new_tokens, sampling, self.vocab())
    }

    /// [`Gpt::generate`], drawing only among the first `vocab` token ids: for a model whose
    /// vocabulary was padded (to divide by a tensor-parallel size) past the ids the text uses.
    ///
    /// # Panics
    /// If `prompt` is empty, or `vocab` is 0 or above [`Gpt::vocab`].
    pub fn generate_within(
        &self,
        prompt: &[u32],
        new_tokens: usize,
        sampling: &Sampling,
        vocab: usize,
    ) -> Vec<u32> {
        assert!(
            !prompt.is_empty(),
            "generation needs at least one prompt token"
        );
        assert!(
            vocab > 0 && vocab <= self.vocab(),
            "vocab {vocab} of {}",
            self.vocab()
        );
        let device = self.tok.weight.device();
        let context = self.context();
        let mut rng = SplitMix64(sampling.seed);
        let mut out = prompt.to_vec();
        for _ in 0..new_tokens {
            let window = &out[out.len().saturating_sub(context)..];
            let ids: Vec<i64> = window.iter().map(|&t| i64::from(t)).collect();
            let tokens =
                Tensor::<B, 1, Int>::from_ints(ids.as_slice(), &device).reshape([1, window.len()]);
            let logits = self.forward(tokens);
            let last = logits
                .slice([0..1, window.len() - 1..window.len(), 0..vocab])
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("f32 logits");
            out.push(sampling.pick(&last, rng.next_f64()));
        }
        out
    }
}

/// How [`Gpt::generate`] draws each token from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it before the softmax: below 1 sharpens, above 1 flattens; 0
    /// always takes the most likely token.
    pub temperature: f64,
    /// Draw among the `top_k` most likely tokens only (`None` or 0: among all).
    pub top_k: Option<usize>,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for Sampling {
    /// Temperature 0.8, the 20 most likely tokens, seed 0.
    fn default() -> Self {
        Sampling {
            temperature: 0.8,
            top_k: Some(20),
            seed: 0,
        }
    }
}

impl Sampling {
    /// The token `logits` give for a uniform draw `u` in `[0, 1)`: the candidates (the `top_k`
    /// most likely, ties to the lower id) weighted by `softmax(logits / temperature)`.
    pub fn pick(&self, logits: &[f32], u: f64) -> u32 {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.temperature <= 0.0 {
            return order[0] as u32;
        }
        let k = match self.top_k {
            Some(k) if k > 0 => k.min(order.len()),
            _ => order.len(),
        };
        let top = &order[..k];
        let max = f64::from(logits[top[0]]);
        let weights: Vec<f64> = top
            .iter()
            .map(|&i| ((f64::from(logits[i]) - max) / self.temperature).exp())
            .collect();
        let mut target = u * weights.iter().sum::<f64>();
        for (&i, w) in top.iter().zip(&weights) {
            if target < *w {
                return i as u32;
            }
            target -= w;
        }
        top[k - 1] as u32
    }
}

/// The draws of [`Gpt::generate`].
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod sampling_tests {
    use super::*;

    #[test]
    fn temperature_zero_and_top_one_take_the_most_likely_token() {
        let logits = [0.1, 2.0, -1.0, 2.0, 0.5];
        let greedy = Sampling {
            temperature: 0.0,
            top_k: None,
            seed: 0,
        };
        // Ties go to the lower id.
        assert_eq!(greedy.pick(&logits, 0.99), 1);
        let top1 = Sampling {
            temperature: 1.0,
            top_k: Some(1),
            seed: 0,
        };
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(top1.pick(&logits, u), 1);
        }
    }

    #[test]
    fn draws_follow_the_tempered_softmax_of_the_top_k() {
        // ln 1, ln 3, ln 6 and a token top-k 3 leaves out: probabilities 0.1, 0.3, 0.6.
        let logits = [1f32.ln(), 3f32.ln(), 6f32.ln(), -1.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: Some(3),
            seed: 0,
        };
        let n = 10_000;
        let mut counts = [0usize; 4];
        for i in 0..n {
            counts[s.pick(&logits, (i as f64 + 0.5) / n as f64) as usize] += 1;
        }
        // Candidates in order of likelihood: 2 (0.6), 1 (0.3), 0 (0.1); never 3.
        for (got, want) in counts.iter().zip([1000usize, 3000, 6000, 0]) {
            assert!(got.abs_diff(want) <= 2, "{counts:?}");
        }
        // Temperature 2 takes square roots of the weights: sqrt 6 : sqrt 3 : 1.
        let hot = Sampling {
            temperature: 2.0,
            ..s
        };
        let mut c2 = 0usize;
        for i in 0..n {
            if hot.pick(&logits, (i as f64 + 0.5) / n as f64) == 2 {
                c2 += 1;
            }
        }
        let expect = 6f64.sqrt() / (6f64.sqrt() + 3f64.sqrt() + 1.0);
        assert!((c2 as f64 / n as f64 - expect).abs() < 1e-3, "{c2}");
    }
}

#[cfg(test)]
mod stage_tests {
    use super::*;
    use burn::backend::Flex;
    use burn::module::Module;

    type B = Flex;

    fn model(tied: bool) -> Gpt<B> {
        let device = Default::default();
        B::seed(&device, 7);
        GptConfig::new(11)
            .with_context(8)
            .with_layers(4)
            .with_heads(2)
            .with_embd(16)
            .with_tied(tied)
            .init(&device)
    }

    /// The stages of a model, run one after another, give the whole model's loss bit for bit;
    /// their records put together are the model's (same ids, same values); the tied embedding
    /// is named on the first and the last stage only.
    #[test]
    fn stages_chained_are_the_model() {
        let device = Default::default();
        let tokens = Tensor::<B, 2, Int>::from_ints([[1, 2, 3, 4], [5, 6, 7, 8]], &device);
        let targets = Tensor::<B, 2, Int>::from_ints([[2, 3, 4, 5], [6, 7, 8, 9]], &device);
        for tied in [true, false] {
            let whole = model(tied);
            let want = whole.loss(tokens.clone(), targets.clone()).into_scalar();
            let ranges = [0..1, 1..3, 3..4];
            let stages: Vec<GptStage<B>> = ranges
                .iter()
                .map(|r| whole.clone().into_stage(r.clone()))
                .collect();
            assert!(stages[0].is_first() && !stages[0].is_last());
            assert!(!stages[1].is_first() && !stages[1].is_last());
            assert!(stages[2].is_last() && !stages[2].is_first());
            assert_eq!(stages[1].blocks(), 1..3);
            let tied_ids: Vec<bool> = stages
                .iter()
                .map(|s| s.tied_embedding().is_some())
                .collect();
            assert_eq!(tied_ids, vec![tied, false, tied]);
            let mut x = stages[0].forward(Some(tokens.clone()), None);
            x = stages[1].forward(None, Some(x));
            let x = stages[2].forward(None, Some(x));
            let got = stages[2].loss(x, targets.clone()).into_scalar();
            assert_eq!(got.to_bits(), want.to_bits(), "tied {tied}");
            let records = stages.into_iter().map(|s| s.into_record()).collect();
            let rebuilt = GptConfig::new(11)
                .with_context(8)
                .with_layers(4)
                .with_heads(2)
                .with_embd(16)
                .with_tied(tied)
                .init::<B>(&device)
                .load_record(GptStage::assemble(records));
            let ids = |m: &Gpt<B>| {
                let mut v = Vec::new();
                struct Ids<'a>(&'a mut Vec<(String, Vec<f32>)>);
                impl<B: Backend> burn::module::ModuleVisitor<B> for Ids<'_> {
                    fn visit_float<const D: usize>(
                        &mut self,
                        p: &burn::module::Param<Tensor<B, D>>,
                    ) {
                        let values = p.val().into_data().to_vec::<f32>().unwrap();
                        self.0.push((p.id.to_string(), values));
                    }
                }
                m.visit(&mut Ids(&mut v));
                v
            };
            assert_eq!(ids(&rebuilt), ids(&whole), "tied {tied}");
        }
        // A single stage is the whole model.
        let one = model(true).into_stage(0..4);
        assert!(one.is_first() && one.is_last() && one.tied_embedding().is_none());
    }
}
