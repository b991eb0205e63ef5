//! Character-level text for next-token training: a corpus encoded by its vocabulary and split by
//! position into training and validation text (the last part validates, as nanoGPT's 90/10
//! split does), and the windows of `context + 1` tokens a model trains on, each rank reading its
//! own shard of them.

use std::ops::Range;

use bonfire_topology::{RankShard, ShardError, Sharding};

use crate::shakespeare::Vocab;

/// Why a text cannot be trained on as asked.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TextError {
    /// The validation fraction is not strictly between 0 and 1.
    #[error("the validation fraction {0} is not between 0 and 1")]
    Fraction(String),
    /// A part of the split is too short for one window.
    #[error(
        "the {part} text has {tokens} tokens, too few for one window of context {context} (it needs {context} + 1)"
    )]
    TooShort {
        /// `training` or `validation`.
        part: &'static str,
        /// Its tokens.
        tokens: usize,
        /// The context asked for.
        context: usize,
    },
    /// A context of zero tokens, or a stride of zero.
    #[error("context and stride must be at least 1 (got context {context}, stride {stride})")]
    Zero {
        /// The context asked for.
        context: usize,
        /// The stride asked for.
        stride: usize,
    },
}

/// A text encoded by its own character vocabulary, split by position.
#[derive(Clone, Debug)]
pub struct CharCorpus {
    vocab: Vocab,
    ids: Vec<u32>,
    split: usize,
}

impl CharCorpus {
    /// `text` encoded by its vocabulary; the last `val_fraction` of its characters validate.
    pub fn new(text: &str, val_fraction: f64) -> Result<CharCorpus, TextError> {
        CharCorpus::with_vocab(Vocab::of(text), text, val_fraction)
    }

    /// `text` encoded by `vocab` (a checkpoint's: characters outside it are dropped), split as
    /// [`CharCorpus::new`] does.
    pub fn with_vocab(
        vocab: Vocab,
        text: &str,
        val_fraction: f64,
    ) -> Result<CharCorpus, TextError> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(TextError::Fraction(val_fraction.to_string()));
        }
        let ids: Vec<u32> = text.chars().filter_map(|c| vocab.id(c)).collect();
        let split = ((ids.len() as f64) * (1.0 - val_fraction)).floor() as usize;
        Ok(CharCorpus { vocab, ids, split })
    }

    /// The vocabulary.
    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    /// The training text's tokens (the first part).
    pub fn train(&self) -> &[u32] {
        &self.ids[..self.split]
    }

    /// The validation text's tokens (the last part).
    pub fn val(&self) -> &[u32] {
        &self.ids[self.split..]
    }

    /// The training windows of `context` tokens, starting every `stride` tokens.
    pub fn train_windows(&self, context: usize, stride: usize) -> Result<Windows<'_>, TextError> {
        Windows::new(self.train(), "training", context, stride)
    }

    /// The validation windows of `context` tokens, starting every `stride` tokens.
    pub fn val_windows(&self, context: usize, stride: usize) -> Result<Windows<'_>, TextError> {
        Windows::new(self.val(), "validation", context, stride)
    }
}

/// The windows of a token sequence: window `i` starts at `i * stride` and holds `context` input
/// tokens and, shifted by one, their `context` next-token targets.
#[derive(Clone, Copy, Debug)]
pub struct Windows<'a> {
    ids: &'a [u32],
    context: usize,
    stride: usize,
}

impl<'a> Windows<'a> {
    fn new(
        ids: &'a [u32],
        part: &'static str,
        context: usize,
        stride: usize,
    ) -> Result<Self, TextError> {
        if context == 0 || stride == 0 {
            return Err(TextError::Zero { context, stride });
        }
        if ids.len() < context + 1 {
            return Err(TextError::TooShort {
                part,
                tokens: ids.len(),
                context,
            });
        }
        Ok(Windows {
            ids,
            context,
            stride,
        })
    }

    /// How many windows there are.
    pub fn len(&self) -> usize {
        (self.ids.len() - self.context - 1) / self.stride + 1
    }

    /// Never: a text too short for one window is refused when the windows are made.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Window `i`'s input tokens and next-token targets.
    ///
    /// # Panics
    /// If `i` is not below [`Windows::len`].
    pub fn get(&self, i: usize) -> (&'a [u32], &'a [u32]) {
        let range = self.span(i);
        (
            &self.ids[range.start..range.end - 1],
            &self.ids[range.start + 1..range.end],
        )
    }

    /// The positions window `i` covers (input and target together: `context + 1` tokens).
    pub fn span(&self, i: usize) -> Range<usize> {
        assert!(i < self.len(), "window {i} of {}", self.len());
        let start = i * self.stride;
        start..start + self.context + 1
    }

    /// Rank `rank`'s share of the windows among `world` ranks: equal consecutive shards, the
    /// remainder dropped, so that every rank runs the same number of steps
    /// ([`Sharding::EqualDrop`]).
    pub fn shard(&self, rank: usize, world: usize) -> Result<RankShard, ShardError> {
        Sharding::EqualDrop.shard(rank, world, self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_is_by_position_and_round_trips() {
        let text = "abcdefghij".repeat(10);
        let c = CharCorpus::new(&text, 0.1).unwrap();
        assert_eq!(c.vocab().len(), 10);
        assert_eq!((c.train().len(), c.val().len()), (90, 10));
        let both: Vec<u32> = c.train().iter().chain(c.val()).copied().collect();
        assert_eq!(c.vocab().decode(&both), text);
        assert_eq!(c.vocab().decode(c.val()), "abcdefghij");
    }

    #[test]
    fn windows_shift_targets_by_one_and_cover_the_text() {
        let c = CharCorpus::new("0123456789", 0.2).unwrap();
        let w = c.train_windows(3, 2).unwrap();
        // train is "01234567": windows start at 0, 2, 4 (4..8 is the last that fits).
        assert_eq!(w.len(), 3);
        let (x, y) = w.get(2);
        assert_eq!(c.vocab().decode(x), "456");
        assert_eq!(c.vocab().decode(y), "567");
        assert_eq!(w.span(2), 4..8);
    }

    #[test]
    fn ranks_read_disjoint_equal_shards() {
        let text: String = (0..1000)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let c = CharCorpus::new(&text, 0.1).unwrap();
        let w = c.train_windows(8, 8).unwrap();
        let shards: Vec<_> = (0..3).map(|r| w.shard(r, 3).unwrap()).collect();
        let mut seen: Vec<usize> = shards.iter().flat_map(|s| s.positions()).collect();
        assert!(shards.iter().all(|s| s.len() == w.len() / 3));
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 3 * (w.len() / 3));
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        assert_eq!(
            CharCorpus::new("abc", 1.5).unwrap_err(),
            TextError::Fraction("1.5".into())
        );
        let c = CharCorpus::new("abcdefghij", 0.5).unwrap();
        assert_eq!(
            c.val_windows(5, 1).unwrap_err(),
            TextError::TooShort {
                part: "validation",
                tokens: 5,
                context: 5
            }
        );
        assert!(matches!(c.train_windows(0, 1), Err(TextError::Zero { .. })));
    }

    #[test]
    fn a_checkpoints_vocabulary_drops_unknown_characters() {
        let vocab = Vocab::of("ab");
        let c = CharCorpus::with_vocab(vocab, "abxab", 0.5).unwrap();
        assert_eq!(c.train().len() + c.val().len(), 4);
    }
}
