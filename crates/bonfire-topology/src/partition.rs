use std::ops::Range;

/// A split of a buffer of `total` elements into one contiguous segment per rank, in rank order.
///
/// Reduce-scatter gives rank `i` the reduction of segment `i`; all-gather assembles the segments
/// in rank order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    offsets: Vec<usize>,
}

impl Partition {
    /// The balanced split of `total` elements among `parts` ranks: every segment has
    /// `total / parts` elements and the first `total % parts` segments one more.
    ///
    /// # Panics
    /// If `parts` is zero.
    pub fn balanced(total: usize, parts: usize) -> Partition {
        assert!(parts > 0, "a partition needs at least one part");
        let base = total / parts;
        let extra = total % parts;
        let mut offsets = Vec::with_capacity(parts + 1);
        let mut at = 0;
        offsets.push(0);
        for i in 0..parts {
            at += base + usize::from(i < extra);
            offsets.push(at);
        }
        Partition { offsets }
    }

    /// The split with the given segment lengths, in rank order.
    pub fn from_counts(counts: &[usize]) -> Partition {
        let mut offsets = Vec::with_capacity(counts.len() + 1);
        let mut at = 0usize;
        offsets.push(0);
        for &c in counts {
            at = at.checked_add(c).expect("partition overflows usize");
            offsets.push(at);
        }
        Partition { offsets }
    }

    /// Number of segments.
    pub fn parts(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Total number of elements.
    pub fn total(&self) -> usize {
        *self.offsets.last().expect("offsets are never empty")
    }

    /// The elements of segment `i`.
    pub fn segment(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// The elements of segments `first..end`, which are contiguous.
    pub fn span(&self, parts: Range<usize>) -> Range<usize> {
        self.offsets[parts.start]..self.offsets[parts.end]
    }

    /// Segment lengths in rank order.
    pub fn counts(&self) -> Vec<usize> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_spreads_the_remainder_first() {
        let p = Partition::balanced(10, 4);
        assert_eq!(p.counts(), vec![3, 3, 2, 2]);
        assert_eq!(p.segment(2), 6..8);
        assert_eq!(p.span(1..3), 3..8);
        assert_eq!(p.total(), 10);
        let empty = Partition::balanced(2, 5);
        assert_eq!(empty.counts(), vec![1, 1, 0, 0, 0]);
        assert_eq!(Partition::balanced(0, 3).counts(), vec![0, 0, 0]);
    }

    #[test]
    fn from_counts_keeps_order() {
        let p = Partition::from_counts(&[2, 0, 5]);
        assert_eq!(p.segment(0), 0..2);
        assert_eq!(p.segment(1), 2..2);
        assert_eq!(p.segment(2), 2..7);
        assert_eq!(p.parts(), 3);
    }
}
