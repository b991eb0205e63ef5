//! Sans-IO collective schedules.
//!
//! A schedule is a [`Program`]: the list of what one rank does, in order: send this range of the
//! working buffer to those peers, wait for that frame and combine it into this range (then pass
//! it on unchanged), divide this range for a mean. Programs are pure data computed from the
//! collective's shape (group size, element count, algorithm, chunk size), so every rank derives
//! its own without talking, tests can check them against a simulated network, and the async
//! driver only moves bytes.
//!
//! # Determinism
//! Every combination of two values happens at a fixed instruction, with a fixed operand
//! [`Order`]; a rank waits for the exact frame (sender, step) its next instruction names, and
//! frames that arrive early wait in the mailbox. So the arithmetic, and hence the result, is
//! the same whatever order the network delivers frames in. Each element's final value is either
//! computed by one rank and copied to the others (ring, halving-doubling, trees), or computed by
//! several ranks from the same operands in the same order (recursive doubling, which orders the
//! operands by rank block), so all ranks hold the same bits.

mod halving;
mod hierarchical;
mod ring;
mod tree;

use std::ops::Range;

use bonfire_topology::Partition;

use crate::reducer::Order;

pub(crate) use halving::{
    all_gather_doubling, all_reduce_doubling, all_reduce_halving_doubling, reduce_scatter_halving,
};
pub(crate) use hierarchical::{FlatAllReduce, all_reduce_hierarchical, all_reduce_two_level};
pub(crate) use ring::{
    all_gather_ring, all_reduce_ring, broadcast_chain, reduce_ring, reduce_scatter_ring,
};
pub(crate) use tree::{broadcast_binomial, reduce_binomial};

/// Steps are `phase << 24 | index`: each phase of a composed schedule has its own step space, so
/// sub-schedules cannot collide, whatever the sizes of the teams they run on.
const INDEX_BITS: u32 = 24;
/// The largest index within a phase.
pub(crate) const MAX_INDEX: usize = (1 << INDEX_BITS) - 1;
/// Phase 0xFF is reserved for control frames (arrival, abort).
pub(crate) const CONTROL_PHASE: u8 = 0xFF;

/// The step id of frame `index` of `phase`.
pub(crate) fn step(phase: u8, index: usize) -> u32 {
    assert!(
        phase != CONTROL_PHASE,
        "phase 0xFF is reserved for control frames"
    );
    assert!(index <= MAX_INDEX, "step index {index} overflows a phase");
    (u32::from(phase) << INDEX_BITS) | index as u32
}

/// What to do with a received frame.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Apply {
    /// Overwrite the range with it.
    Copy,
    /// Combine it into the range with the collective's operation.
    Reduce(Order),
}

/// One instruction of a [`Program`]. Ranges are in elements of the working buffer; peers are
/// indices in the group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Instr {
    /// Copy `range` into one frame and send it to every `(peer, step)`.
    Send {
        range: Range<usize>,
        to: Vec<(u32, u32)>,
    },
    /// Wait for frame `step` from `from`, which must hold exactly `range`'s elements, apply it to
    /// `range`, then pass the received frame on, unchanged and uncopied, to every `forward`.
    Recv {
        from: u32,
        step: u32,
        range: Range<usize>,
        apply: Apply,
        forward: Vec<(u32, u32)>,
    },
    /// Divide `range` by the group size (the end of a mean).
    Finalize { range: Range<usize> },
}

/// One rank's part of a collective.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Program {
    pub(crate) instrs: Vec<Instr>,
}

impl Program {
    /// Every frame this program sends, as `(to, step, elements)`; for schedule tests.
    #[cfg(test)]
    pub(crate) fn sends(&self) -> Vec<(u32, u32, usize)> {
        let mut out = Vec::new();
        for i in &self.instrs {
            match i {
                Instr::Send { range, to } => {
                    out.extend(to.iter().map(|&(p, s)| (p, s, range.len())));
                }
                Instr::Recv { range, forward, .. } => {
                    out.extend(forward.iter().map(|&(p, s)| (p, s, range.len())));
                }
                Instr::Finalize { .. } => {}
            }
        }
        out
    }
}

/// The ranks that run a (sub-)schedule: `members[i]` is the group index of team position `i`.
#[derive(Clone, Debug)]
pub(crate) struct Team {
    members: Vec<u32>,
    me: usize,
}

impl Team {
    /// A team; `me` is this rank's position in it.
    pub(crate) fn new(members: Vec<u32>, me: usize) -> Team {
        assert!(me < members.len());
        Team { members, me }
    }

    /// The team of a whole group of `n`, as group index `me`.
    pub(crate) fn whole(n: usize, me: usize) -> Team {
        Team::new((0..n as u32).collect(), me)
    }

    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    pub(crate) fn me(&self) -> usize {
        self.me
    }

    /// The group index of team position `pos`.
    pub(crate) fn peer(&self, pos: usize) -> u32 {
        self.members[pos]
    }
}

/// Accumulates a program; drops empty transfers (both ends compute the same ranges, so both
/// drop the same ones) and splits transfers into pieces of at most `piece_elems` elements so
/// that large transfers are pipelined.
pub(crate) struct Builder {
    instrs: Vec<Instr>,
    piece_elems: usize,
}

impl Builder {
    pub(crate) fn new(piece_elems: usize) -> Builder {
        Builder {
            instrs: Vec::new(),
            piece_elems: piece_elems.max(1),
        }
    }

    pub(crate) fn finish(self) -> Program {
        Program {
            instrs: self.instrs,
        }
    }

    /// An empty builder with the same piece size, for a sub-schedule to be shifted in.
    pub(crate) fn sub(&self) -> Builder {
        Builder::new(self.piece_elems)
    }

    /// Appends `sub`'s instructions with every range moved `offset` elements on: runs a
    /// schedule written for a buffer of its own on one segment of this one.
    pub(crate) fn append_shifted(&mut self, sub: Builder, offset: usize) {
        let shift = |r: Range<usize>| r.start + offset..r.end + offset;
        for i in sub.instrs {
            self.instrs.push(match i {
                Instr::Send { range, to } => Instr::Send {
                    range: shift(range),
                    to,
                },
                Instr::Recv {
                    from,
                    step,
                    range,
                    apply,
                    forward,
                } => Instr::Recv {
                    from,
                    step,
                    range: shift(range),
                    apply,
                    forward,
                },
                Instr::Finalize { range } => Instr::Finalize {
                    range: shift(range),
                },
            });
        }
    }

    /// Number of pieces `range` is sent in. Depends only on the range's length, so sender and
    /// receiver agree.
    pub(crate) fn pieces(&self, len: usize) -> usize {
        len.div_ceil(self.piece_elems).max(1)
    }

    /// Piece `i` of `range` when it is sent in `pieces(range.len())` pieces.
    pub(crate) fn piece(&self, range: &Range<usize>, i: usize) -> Range<usize> {
        let p = Partition::balanced(range.len(), self.pieces(range.len())).segment(i);
        range.start + p.start..range.start + p.end
    }

    pub(crate) fn send(&mut self, range: Range<usize>, to: Vec<(u32, u32)>) {
        if !range.is_empty() && !to.is_empty() {
            self.instrs.push(Instr::Send { range, to });
        }
    }

    pub(crate) fn recv(
        &mut self,
        from: u32,
        step: u32,
        range: Range<usize>,
        apply: Apply,
        forward: Vec<(u32, u32)>,
    ) {
        if !range.is_empty() {
            self.instrs.push(Instr::Recv {
                from,
                step,
                range,
                apply,
                forward,
            });
        }
    }

    pub(crate) fn finalize(&mut self, range: Range<usize>) {
        if !range.is_empty() {
            self.instrs.push(Instr::Finalize { range });
        }
    }

    /// Sends all of `range`, piece by piece, to team position `to` as steps
    /// `step(phase, base + piece)`.
    pub(crate) fn send_all(
        &mut self,
        team: &Team,
        to: usize,
        range: Range<usize>,
        phase: u8,
        base: usize,
    ) {
        for p in 0..self.pieces(range.len()) {
            let piece = self.piece(&range, p);
            self.send(piece, vec![(team.peer(to), step(phase, base + p))]);
        }
    }

    /// Receives all of `range`, piece by piece, from team position `from`: the counterpart of
    /// [`Builder::send_all`].
    pub(crate) fn recv_all(
        &mut self,
        team: &Team,
        from: usize,
        range: Range<usize>,
        apply: Apply,
        phase: u8,
        base: usize,
    ) {
        for p in 0..self.pieces(range.len()) {
            let piece = self.piece(&range, p);
            self.recv(
                team.peer(from),
                step(phase, base + p),
                piece,
                apply,
                Vec::new(),
            );
        }
    }
}

/// The ordering that puts the lower rank block's value first, given whether the peer's block
/// is the lower one.
pub(crate) fn lower_first(peer_is_lower: bool) -> Order {
    if peer_is_lower {
        Order::IncomingFirst
    } else {
        Order::LocalFirst
    }
}

#[cfg(test)]
mod tests;
