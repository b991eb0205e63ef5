//! Recursive halving and doubling: `log2 n` rounds of pairwise exchanges, for small and medium
//! buffers where the ring's `n - 1` rounds of latency dominate.
//!
//! Group sizes that are not a power of two are *folded* first (as in MPICH): with `p` the largest
//! power of two not above `n` and `rem = n - p`, the first `2 * rem` positions pair up, the even
//! one of each pair hands its data to the odd one and sits out, and the `p` remaining positions
//! (the *virtual* ranks) run the power-of-two schedule. Virtual rank `v` stands for a run of
//! consecutive positions, so the elements it owns are contiguous. The pairs are *unfolded* at the
//! end.

use std::ops::Range;

use bonfire_topology::Partition;

use super::{Apply, Builder, Team, lower_first};
use crate::reducer::Order;

/// The fold of a team of `n` onto a power of two.
struct Fold {
    p: usize,
    rem: usize,
}

impl Fold {
    fn new(n: usize) -> Fold {
        let p = 1 << (usize::BITS - 1 - n.leading_zeros());
        Fold { p, rem: n - p }
    }

    /// The virtual rank of team position `pos`, or `None` if it sits out.
    fn virt(&self, pos: usize) -> Option<usize> {
        if pos < 2 * self.rem {
            (pos % 2 == 1).then_some(pos / 2)
        } else {
            Some(pos - self.rem)
        }
    }

    /// The team position that acts as virtual rank `v`.
    fn active(&self, v: usize) -> usize {
        if v < self.rem {
            2 * v + 1
        } else {
            v + self.rem
        }
    }

    /// The team positions virtual ranks `vs` stand for.
    fn positions(&self, vs: Range<usize>) -> Range<usize> {
        let first = if vs.start < self.rem {
            2 * vs.start
        } else {
            vs.start + self.rem
        };
        first..self.active(vs.end - 1) + 1
    }

    /// The paired position that sits out, if `pos` is the active half of a pair.
    fn partner_out(&self, pos: usize) -> Option<usize> {
        (pos < 2 * self.rem && pos % 2 == 1).then(|| pos - 1)
    }
}

/// Fold by reduction: each sitting-out position sends all of `full` to its partner, which
/// combines it (lower position first).
fn fold_reduce(b: &mut Builder, team: &Team, fold: &Fold, full: Range<usize>, phase: u8) {
    let pos = team.me();
    if pos >= 2 * fold.rem {
        return;
    }
    if pos.is_multiple_of(2) {
        b.send_all(team, pos + 1, full, phase, 0);
    } else {
        b.recv_all(
            team,
            pos - 1,
            full,
            Apply::Reduce(Order::IncomingFirst),
            phase,
            0,
        );
    }
}

/// Recursive halving among the virtual ranks: afterwards virtual rank `v` holds the reduction of
/// the elements of the positions it stands for.
fn halving(b: &mut Builder, team: &Team, fold: &Fold, parts: &Partition, phase: u8) {
    let Some(v) = fold.virt(team.me()) else {
        return;
    };
    let stride = b.pieces(parts.total());
    let elems = |vs: Range<usize>| parts.span(fold.positions(vs));
    let (mut lo, mut hi) = (0, fold.p);
    let mut mask = fold.p / 2;
    let mut round = 0;
    while mask >= 1 {
        let partner = v ^ mask;
        let mid = lo + mask;
        let (keep, give) = if v < mid {
            (lo..mid, mid..hi)
        } else {
            (mid..hi, lo..mid)
        };
        let peer = fold.active(partner);
        b.send_all(team, peer, elems(give), phase, round * stride);
        b.recv_all(
            team,
            peer,
            elems(keep.clone()),
            Apply::Reduce(lower_first(partner < v)),
            phase,
            round * stride,
        );
        (lo, hi) = (keep.start, keep.end);
        mask /= 2;
        round += 1;
    }
}

/// Recursive doubling all-gather among the virtual ranks: virtual rank `v` starts with the
/// elements of its own positions and ends with everything.
fn doubling_gather(b: &mut Builder, team: &Team, fold: &Fold, parts: &Partition, phase: u8) {
    let Some(v) = fold.virt(team.me()) else {
        return;
    };
    let stride = b.pieces(parts.total());
    let block = |x: usize, mask: usize| {
        let start = x / mask * mask;
        parts.span(fold.positions(start..start + mask))
    };
    let mut mask = 1;
    let mut round = 0;
    while mask < fold.p {
        let partner = v ^ mask;
        let peer = fold.active(partner);
        b.send_all(team, peer, block(v, mask), phase, round * stride);
        b.recv_all(
            team,
            peer,
            block(partner, mask),
            Apply::Copy,
            phase,
            round * stride,
        );
        mask *= 2;
        round += 1;
    }
}

/// Unfold by copying all of `full` back to the sitting-out partner.
fn unfold_full(b: &mut Builder, team: &Team, fold: &Fold, full: Range<usize>, phase: u8) {
    let pos = team.me();
    if let Some(out) = fold.partner_out(pos) {
        b.send_all(team, out, full, phase, 0);
    } else if pos < 2 * fold.rem {
        b.recv_all(team, pos + 1, full, Apply::Copy, phase, 0);
    }
}

/// Reduce-scatter by recursive halving. Phases `base..base + 3`.
pub(crate) fn reduce_scatter_halving(
    b: &mut Builder,
    team: &Team,
    parts: &Partition,
    base: u8,
    finalize: bool,
) {
    let fold = Fold::new(team.size());
    let pos = team.me();
    fold_reduce(b, team, &fold, 0..parts.total(), base);
    halving(b, team, &fold, parts, base + 1);
    if let Some(v) = fold.virt(pos) {
        if finalize {
            b.finalize(parts.span(fold.positions(v..v + 1)));
        }
        if let Some(out) = fold.partner_out(pos) {
            b.send_all(team, out, parts.segment(out), base + 2, 0);
        }
    } else {
        b.recv_all(team, pos + 1, parts.segment(pos), Apply::Copy, base + 2, 0);
    }
}

/// All-gather by recursive doubling (segments may be uneven). Phases `base..base + 3`.
pub(crate) fn all_gather_doubling(b: &mut Builder, team: &Team, parts: &Partition, base: u8) {
    let fold = Fold::new(team.size());
    let pos = team.me();
    let total = parts.total();
    // Fold: the sitting-out position lends its segment to its partner.
    if pos < 2 * fold.rem {
        if pos.is_multiple_of(2) {
            b.send_all(team, pos + 1, parts.segment(pos), base, 0);
        } else {
            b.recv_all(team, pos - 1, parts.segment(pos - 1), Apply::Copy, base, 0);
        }
    }
    doubling_gather(b, team, &fold, parts, base + 1);
    // Unfold: everything but the partner's own segment, in two ranges.
    let stride = b.pieces(total);
    if let Some(out) = fold.partner_out(pos) {
        let own = parts.segment(out);
        b.send_all(team, out, 0..own.start, base + 2, 0);
        b.send_all(team, out, own.end..total, base + 2, stride);
    } else if pos < 2 * fold.rem {
        let own = parts.segment(pos);
        b.recv_all(team, pos + 1, 0..own.start, Apply::Copy, base + 2, 0);
        b.recv_all(team, pos + 1, own.end..total, Apply::Copy, base + 2, stride);
    }
}

/// All-reduce by recursive doubling: every round exchanges the whole buffer, `log2 n` rounds.
/// Latency-optimal. Both partners combine the same two values with the lower block first, so they
/// hold the same bits. Phases `base..base + 3`.
pub(crate) fn all_reduce_doubling(
    b: &mut Builder,
    team: &Team,
    count: usize,
    base: u8,
    finalize: bool,
) {
    let fold = Fold::new(team.size());
    let full = 0..count;
    fold_reduce(b, team, &fold, full.clone(), base);
    if let Some(v) = fold.virt(team.me()) {
        let stride = b.pieces(count);
        let mut mask = 1;
        let mut round = 0;
        while mask < fold.p {
            let partner = v ^ mask;
            let peer = fold.active(partner);
            b.send_all(team, peer, full.clone(), base + 1, round * stride);
            b.recv_all(
                team,
                peer,
                full.clone(),
                Apply::Reduce(lower_first(partner < v)),
                base + 1,
                round * stride,
            );
            mask *= 2;
            round += 1;
        }
        if finalize {
            b.finalize(full.clone());
        }
    }
    unfold_full(b, team, &fold, full, base + 2);
}

/// All-reduce by recursive halving then doubling (Rabenseifner): `2 log2 n` rounds moving
/// `2 (n-1)/n` of the data, for medium buffers. Phases `base..base + 4`.
pub(crate) fn all_reduce_halving_doubling(
    b: &mut Builder,
    team: &Team,
    count: usize,
    base: u8,
    finalize: bool,
) {
    let fold = Fold::new(team.size());
    let parts = Partition::balanced(count, team.size());
    fold_reduce(b, team, &fold, 0..count, base);
    halving(b, team, &fold, &parts, base + 1);
    if finalize && let Some(v) = fold.virt(team.me()) {
        b.finalize(parts.span(fold.positions(v..v + 1)));
    }
    doubling_gather(b, team, &fold, &parts, base + 2);
    unfold_full(b, team, &fold, 0..count, base + 3);
}

#[cfg(test)]
mod tests {
    use super::Fold;

    #[test]
    fn fold_of_six() {
        let f = Fold::new(6);
        assert_eq!((f.p, f.rem), (4, 2));
        let virt: Vec<_> = (0..6).map(|p| f.virt(p)).collect();
        assert_eq!(virt, vec![None, Some(0), None, Some(1), Some(2), Some(3)]);
        assert_eq!(f.positions(0..2), 0..4);
        assert_eq!(f.positions(2..4), 4..6);
        assert_eq!(f.active(1), 3);
        assert_eq!(f.partner_out(3), Some(2));
        assert_eq!(f.partner_out(4), None);
        let one = Fold::new(1);
        assert_eq!((one.p, one.rem), (1, 0));
    }
}
