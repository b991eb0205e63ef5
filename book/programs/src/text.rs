//! A few lines of text for the GPT programs, as byte tokens.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// Sonnet 18 (public domain).
pub const TEXT: &str = "Shall I compare thee to a summer's day?\n\
Thou art more lovely and more temperate:\n\
Rough winds do shake the darling buds of May,\n\
And summer's lease hath all too short a date;\n\
Sometime too hot the eye of heaven shines,\n\
And often is his gold complexion dimm'd;\n\
And every fair from fair sometime declines,\n\
By chance or nature's changing course untrimm'd;\n\
But thy eternal summer shall not fade,\n\
Nor lose possession of that fair thou ow'st;\n\
Nor shall death brag thou wander'st in his shade,\n\
When in eternal lines to time thou grow'st:\n\
So long as men can breathe or eyes can see,\n\
So long lives this, and this gives life to thee.\n";

/// Tokens: the text's bytes (ASCII, so 128 of them).
pub const VOCAB: usize = 128;

/// Rows `first..first + rows` of step `step`'s batch: windows of `context` tokens and the
/// tokens that follow each. Every rank can build any row, so replicas take different rows of
/// the same global batch.
pub fn batch<B: Backend>(
    step: usize,
    first: usize,
    rows: usize,
    context: usize,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let tokens: Vec<i64> = TEXT.bytes().map(i64::from).collect();
    let starts = tokens.len() - context - 1;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for row in first..first + rows {
        let start = (step * 131 + row * 37) % starts;
        x.extend_from_slice(&tokens[start..start + context]);
        y.extend_from_slice(&tokens[start + 1..start + context + 1]);
    }
    (
        Tensor::from_data(TensorData::new(x, [rows, context]), device),
        Tensor::from_data(TensorData::new(y, [rows, context]), device),
    )
}
