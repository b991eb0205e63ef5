//! Binomial trees rooted anywhere: `ceil(log2 n)` rounds, latency-optimal for small buffers.
//! Ranks are numbered relative to the root (`v = (r - root) mod n`).

use std::ops::Range;

use super::{Apply, Builder, Team, step};
use crate::reducer::Order;

/// `(parent, children)` of relative rank `v` in a binomial tree of `n`, children in the order
/// the MPICH binomial reduce visits them (smallest subtree first).
fn binomial(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let mut children = Vec::new();
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            return (Some(v - mask), children);
        }
        if v + mask < n {
            children.push(v + mask);
        }
        mask <<= 1;
    }
    (None, children)
}

/// Binomial broadcast of `range` from team position `root`, pipelined piece by piece; each
/// rank passes the frame it received on to its children without copying it.
pub(crate) fn broadcast_binomial(
    b: &mut Builder,
    team: &Team,
    root: usize,
    range: Range<usize>,
    phase: u8,
) {
    let n = team.size();
    if n == 1 {
        return;
    }
    let v = (team.me() + n - root) % n;
    let real = |rel: usize| team.peer((rel + root) % n);
    let (parent, mut children) = binomial(v, n);
    children.reverse(); // largest subtree first: it has the longest way to go
    for p in 0..b.pieces(range.len()) {
        let piece = b.piece(&range, p);
        let to: Vec<(u32, u32)> = children
            .iter()
            .map(|&c| (real(c), step(phase, p)))
            .collect();
        match parent {
            None => b.send(piece, to),
            Some(par) => b.recv(real(par), step(phase, p), piece, Apply::Copy, to),
        }
    }
}

/// Binomial reduce of `range` to team position `root`, pipelined piece by piece. A rank
/// combines its children in a fixed order (its own value first), then sends to its parent.
pub(crate) fn reduce_binomial(
    b: &mut Builder,
    team: &Team,
    root: usize,
    range: Range<usize>,
    phase: u8,
    finalize: bool,
) {
    let n = team.size();
    let v = (team.me() + n - root) % n;
    let real = |rel: usize| team.peer((rel + root) % n);
    let (parent, children) = binomial(v, n);
    for p in 0..b.pieces(range.len()) {
        let piece = b.piece(&range, p);
        for &c in &children {
            b.recv(
                real(c),
                step(phase, p),
                piece.clone(),
                Apply::Reduce(Order::LocalFirst),
                Vec::new(),
            );
        }
        if let Some(par) = parent {
            b.send(piece, vec![(real(par), step(phase, p))]);
        } else if finalize {
            b.finalize(piece);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::binomial;

    #[test]
    fn binomial_tree_of_six() {
        assert_eq!(binomial(0, 6), (None, vec![1, 2, 4]));
        assert_eq!(binomial(1, 6), (Some(0), vec![]));
        assert_eq!(binomial(2, 6), (Some(0), vec![3]));
        assert_eq!(binomial(4, 6), (Some(0), vec![5]));
        assert_eq!(binomial(5, 6), (Some(4), vec![]));
    }
}
