//! Ring schedules: bandwidth-optimal (every rank sends and receives `(n-1)/n` of the data per
//! phase), chunked into pieces so that a rank passes piece `p` on while piece `p+1` is still in
//! flight.

use std::ops::Range;

use bonfire_topology::Partition;

use super::{Apply, Builder, Team, step};
use crate::reducer::Order;

/// The largest number of pieces any part of `parts` is sent in: the stride between ring steps in
/// a phase's step space.
fn stride(b: &Builder, parts: &Partition) -> usize {
    (0..parts.parts())
        .map(|i| b.pieces(parts.segment(i).len()))
        .max()
        .unwrap_or(1)
}

/// Ring reduce-scatter: afterwards team position `i` holds the reduction of `parts` segment `i`.
///
/// At ring step `s` position `r` sends segment `r-s-1` to `r+1` and receives segment `r-s-2`
/// from `r-1`, combining it in (received partial sum first). Segment `c` is therefore summed in
/// the fixed order `c+1, c+2, ..., c`.
pub(crate) fn reduce_scatter_ring(b: &mut Builder, team: &Team, parts: &Partition, phase: u8) {
    let n = team.size();
    if n == 1 {
        return;
    }
    let r = team.me();
    let next = team.peer((r + 1) % n);
    let prev = team.peer((r + n - 1) % n);
    let seg = |back: usize| parts.segment((r + 2 * n - back) % n);
    let stride = stride(b, parts);

    let first = seg(1);
    for p in 0..b.pieces(first.len()) {
        let piece = b.piece(&first, p);
        b.send(piece, vec![(next, step(phase, p))]);
    }
    for s in 0..n - 1 {
        let c = seg(s + 2);
        for p in 0..b.pieces(c.len()) {
            let piece = b.piece(&c, p);
            b.recv(
                prev,
                step(phase, s * stride + p),
                piece.clone(),
                Apply::Reduce(Order::IncomingFirst),
                Vec::new(),
            );
            if s + 1 < n - 1 {
                b.send(piece, vec![(next, step(phase, (s + 1) * stride + p))]);
            }
        }
    }
}

/// Ring all-gather: position `i` starts with `parts` segment `i` and ends with all of them. Each
/// received piece is passed on as the same frame, without a copy.
pub(crate) fn all_gather_ring(b: &mut Builder, team: &Team, parts: &Partition, phase: u8) {
    let n = team.size();
    if n == 1 {
        return;
    }
    let r = team.me();
    let next = team.peer((r + 1) % n);
    let prev = team.peer((r + n - 1) % n);
    let stride = stride(b, parts);

    let own = parts.segment(r);
    for p in 0..b.pieces(own.len()) {
        let piece = b.piece(&own, p);
        b.send(piece, vec![(next, step(phase, p))]);
    }
    for s in 0..n - 1 {
        let c = parts.segment((r + n - s - 1) % n);
        for p in 0..b.pieces(c.len()) {
            let piece = b.piece(&c, p);
            let forward = if s + 1 < n - 1 {
                vec![(next, step(phase, (s + 1) * stride + p))]
            } else {
                Vec::new()
            };
            b.recv(
                prev,
                step(phase, s * stride + p),
                piece,
                Apply::Copy,
                forward,
            );
        }
    }
}

/// Ring all-reduce: reduce-scatter then all-gather over a balanced split, with the mean's
/// division done once per element by the segment's owner. Uses phases `phase` and `phase + 1`.
pub(crate) fn all_reduce_ring(
    b: &mut Builder,
    team: &Team,
    count: usize,
    phase: u8,
    finalize: bool,
) {
    let parts = Partition::balanced(count, team.size());
    reduce_scatter_ring(b, team, &parts, phase);
    if finalize {
        b.finalize(parts.segment(team.me()));
    }
    all_gather_ring(b, team, &parts, phase + 1);
}

/// Pipelined chain broadcast from team position `root`: `root → root+1 → ...`, piece by piece.
/// Bandwidth-optimal for large buffers: every link carries the data once.
pub(crate) fn broadcast_chain(
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
    let r = team.me();
    let v = (r + n - root) % n;
    let next = (v + 1 < n).then(|| team.peer((r + 1) % n));
    let prev = team.peer((r + n - 1) % n);
    for p in 0..b.pieces(range.len()) {
        let piece = b.piece(&range, p);
        let forward: Vec<(u32, u32)> = next.iter().map(|&nx| (nx, step(phase, p))).collect();
        if v == 0 {
            b.send(piece, forward);
        } else {
            b.recv(prev, step(phase, p), piece, Apply::Copy, forward);
        }
    }
}

/// Ring reduce: a ring reduce-scatter, then every segment to `root`. Uses phases `phase` and
/// `phase + 1`.
pub(crate) fn reduce_ring(
    b: &mut Builder,
    team: &Team,
    root: usize,
    count: usize,
    phase: u8,
    finalize: bool,
) {
    let n = team.size();
    let parts = Partition::balanced(count, n);
    reduce_scatter_ring(b, team, &parts, phase);
    let r = team.me();
    if finalize {
        b.finalize(parts.segment(r));
    }
    if r == root {
        for from in (0..n).filter(|&m| m != root) {
            b.recv_all(team, from, parts.segment(from), Apply::Copy, phase + 1, 0);
        }
    } else {
        b.send_all(team, root, parts.segment(r), phase + 1, 0);
    }
}
