use bonfire_topology::{NodeId, Partition, ReduceOp, stable_hash};

use crate::fingerprint::OpKind;
use crate::schedule::{self, Builder, Program, Team};
use crate::{Algorithm, CommConfig, Element};

/// A collective operation with its parameters; the buffer and its element type come with the
/// call ([`crate::Communicator::run`], [`crate::sim::run`]).
///
/// Buffer lengths: all-reduce, broadcast and reduce take equal lengths on every rank and return
/// the same length. Reduce-scatter takes the whole buffer and returns the caller's segment.
/// All-gather takes the caller's segment and returns the whole buffer in rank order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's buffer.
    AllReduce(ReduceOp),
    /// Rank `i` ends with the reduction of segment `i` of every rank's buffer.
    ReduceScatter {
        /// The reduction.
        op: ReduceOp,
        /// Segment lengths in rank order; `None` splits the buffer evenly (the first
        /// `len % n` segments one element longer).
        counts: Option<Vec<usize>>,
    },
    /// Every rank ends with every rank's segment, concatenated in rank order.
    AllGather {
        /// Segment lengths in rank order, for uneven segments; `None` when every rank
        /// contributes as many elements as the caller.
        counts: Option<Vec<usize>>,
    },
    /// Every rank ends with the root's buffer.
    Broadcast {
        /// The index in the group of the rank whose buffer is sent.
        root: usize,
    },
    /// The root ends with the reduction of every rank's buffer; the other ranks' buffers come back
    /// with unspecified contents.
    Reduce {
        /// The reduction.
        op: ReduceOp,
        /// The index in the group of the rank that receives the result.
        root: usize,
    },
    /// No rank returns before every rank has called it. Takes an empty buffer.
    Barrier,
}

/// The working buffer of one rank for one call.
#[derive(Clone, Debug)]
pub(crate) struct Shape {
    /// Elements in the working buffer.
    pub(crate) count: usize,
    /// The per-rank segments (reduce-scatter, all-gather).
    pub(crate) parts: Option<Partition>,
    /// Hash of explicit per-rank counts, else 0.
    pub(crate) layout: u64,
}

impl Collective {
    /// The operation's name as it appears in errors (`all_reduce`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce(_) => "all_reduce",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::AllGather { .. } => "all_gather",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::Barrier => "barrier",
        }
    }

    /// The algorithms that can be forced for this collective.
    pub fn algorithms(&self) -> &'static [Algorithm] {
        use Algorithm::*;
        match self {
            Collective::AllReduce(_) => &[Ring, RecursiveDoubling, HalvingDoubling, Hierarchical],
            Collective::ReduceScatter { .. } => &[Ring, HalvingDoubling],
            Collective::AllGather { .. } => &[Ring, RecursiveDoubling],
            Collective::Broadcast { .. } | Collective::Reduce { .. } => &[Ring, Tree],
            Collective::Barrier => &[],
        }
    }

    pub(crate) fn kind(&self) -> OpKind {
        match self {
            Collective::AllReduce(op) => OpKind::AllReduce(*op),
            Collective::ReduceScatter { op, .. } => OpKind::ReduceScatter(*op),
            Collective::AllGather { .. } => OpKind::AllGather,
            Collective::Broadcast { .. } => OpKind::Broadcast,
            Collective::Reduce { op, .. } => OpKind::Reduce(*op),
            Collective::Barrier => OpKind::Barrier,
        }
    }

    pub(crate) fn root(&self) -> Option<u32> {
        match self {
            Collective::Broadcast { root } | Collective::Reduce { root, .. } => Some(*root as u32),
            _ => None,
        }
    }

    /// The reduction, if the collective reduces.
    pub(crate) fn reduce_op(&self) -> Option<ReduceOp> {
        match self {
            Collective::AllReduce(op)
            | Collective::ReduceScatter { op, .. }
            | Collective::Reduce { op, .. } => Some(*op),
            _ => None,
        }
    }

    /// Checks the call of group member `me` of `n` with a buffer of `len` elements.
    pub(crate) fn shape(&self, n: usize, me: usize, len: usize) -> Result<Shape, String> {
        let plain = |count| Shape {
            count,
            parts: None,
            layout: 0,
        };
        let layout = |counts: &[usize]| {
            let words: Vec<u64> = counts.iter().map(|&c| c as u64).collect();
            stable_hash(&words) | 1
        };
        let check_counts = |counts: &[usize]| {
            if counts.len() != n {
                Err(format!("{} counts given for a group of {n}", counts.len()))
            } else {
                Ok(())
            }
        };
        match self {
            Collective::AllReduce(_) => Ok(plain(len)),
            Collective::Broadcast { root } | Collective::Reduce { root, .. } => {
                if *root >= n {
                    Err(format!("root {root} is outside a group of {n}"))
                } else {
                    Ok(plain(len))
                }
            }
            Collective::Barrier => {
                if len != 0 {
                    Err("a barrier takes an empty buffer".into())
                } else {
                    Ok(plain(0))
                }
            }
            Collective::ReduceScatter { counts, .. } => match counts {
                None => Ok(Shape {
                    count: len,
                    parts: Some(Partition::balanced(len, n)),
                    layout: 0,
                }),
                Some(counts) => {
                    check_counts(counts)?;
                    let parts = Partition::from_counts(counts);
                    if parts.total() != len {
                        return Err(format!(
                            "the counts add up to {} elements but the buffer holds {len}",
                            parts.total()
                        ));
                    }
                    Ok(Shape {
                        count: len,
                        parts: Some(parts),
                        layout: layout(counts),
                    })
                }
            },
            Collective::AllGather { counts } => match counts {
                None => Ok(Shape {
                    count: len * n,
                    parts: Some(Partition::from_counts(&vec![len; n])),
                    layout: 0,
                }),
                Some(counts) => {
                    check_counts(counts)?;
                    if counts[me] != len {
                        return Err(format!(
                            "counts[{me}] is {} but this rank's buffer holds {len} elements",
                            counts[me]
                        ));
                    }
                    let parts = Partition::from_counts(counts);
                    Ok(Shape {
                        count: parts.total(),
                        parts: Some(parts),
                        layout: layout(counts),
                    })
                }
            },
        }
    }

    /// The algorithm that runs: `requested` if this collective implements it, a size-based pick
    /// for [`Algorithm::Auto`], `Err` for anything else. The same on every rank, since it depends
    /// only on values the fingerprint covers.
    pub(crate) fn resolve(
        &self,
        requested: Algorithm,
        bytes: usize,
        nodes: &[NodeId],
        config: &CommConfig,
    ) -> Result<Algorithm, ()> {
        use Algorithm::*;
        if matches!(self, Collective::Barrier) {
            return Ok(Auto);
        }
        if requested != Auto {
            return if self.algorithms().contains(&requested) {
                Ok(requested)
            } else {
                Err(())
            };
        }
        let large = bytes >= config.large_bytes;
        Ok(match self {
            Collective::AllReduce(_) if worth_hierarchy(nodes) && bytes > config.small_bytes => {
                Hierarchical
            }
            Collective::AllReduce(_) if bytes <= config.small_bytes => RecursiveDoubling,
            Collective::AllReduce(_) | Collective::ReduceScatter { .. } if !large => {
                HalvingDoubling
            }
            Collective::AllGather { .. } if !large => RecursiveDoubling,
            Collective::Broadcast { .. } | Collective::Reduce { .. } if !large => Tree,
            _ => Ring,
        })
    }

    /// Member `me`'s program for `algorithm` (already resolved).
    pub(crate) fn program(
        &self,
        algorithm: Algorithm,
        shape: &Shape,
        me: usize,
        nodes: &[NodeId],
        elem_size: usize,
        config: &CommConfig,
    ) -> Program {
        let n = nodes.len();
        let team = Team::whole(n, me);
        let mut b = Builder::new(config.chunk_bytes / elem_size);
        let count = shape.count;
        let mean = self.reduce_op() == Some(ReduceOp::Mean);
        let parts = || {
            shape
                .parts
                .as_ref()
                .expect("segmented collectives have parts")
        };
        match (self, algorithm) {
            (Collective::Barrier, _) => {}
            (Collective::AllReduce(_), Algorithm::Ring) => {
                schedule::all_reduce_ring(&mut b, &team, count, 0, mean)
            }
            (Collective::AllReduce(_), Algorithm::RecursiveDoubling) => {
                schedule::all_reduce_doubling(&mut b, &team, count, 0, mean)
            }
            (Collective::AllReduce(_), Algorithm::HalvingDoubling) => {
                schedule::all_reduce_halving_doubling(&mut b, &team, count, 0, mean)
            }
            (Collective::AllReduce(_), Algorithm::Hierarchical) => {
                // The two-level schedule needs as many ranks on every node; otherwise leaders.
                let per_node = (n / count_nodes(nodes)).max(1);
                let inner = flat_all_reduce(count / per_node * elem_size, config);
                if !schedule::all_reduce_two_level(&mut b, &team, nodes, count, inner, mean) {
                    let inner = flat_all_reduce(count * elem_size, config);
                    schedule::all_reduce_hierarchical(&mut b, &team, nodes, count, inner, mean)
                }
            }
            (Collective::ReduceScatter { .. }, Algorithm::Ring) => {
                schedule::reduce_scatter_ring(&mut b, &team, parts(), 0);
                if mean {
                    b.finalize(parts().segment(me));
                }
            }
            (Collective::ReduceScatter { .. }, Algorithm::HalvingDoubling) => {
                schedule::reduce_scatter_halving(&mut b, &team, parts(), 0, mean)
            }
            (Collective::AllGather { .. }, Algorithm::Ring) => {
                schedule::all_gather_ring(&mut b, &team, parts(), 0)
            }
            (Collective::AllGather { .. }, Algorithm::RecursiveDoubling) => {
                schedule::all_gather_doubling(&mut b, &team, parts(), 0)
            }
            (Collective::Broadcast { root }, Algorithm::Ring) => {
                schedule::broadcast_chain(&mut b, &team, *root, 0..count, 0)
            }
            (Collective::Broadcast { root }, Algorithm::Tree) => {
                schedule::broadcast_binomial(&mut b, &team, *root, 0..count, 0)
            }
            (Collective::Reduce { root, .. }, Algorithm::Ring) => {
                schedule::reduce_ring(&mut b, &team, *root, count, 0, mean)
            }
            (Collective::Reduce { root, .. }, Algorithm::Tree) => {
                schedule::reduce_binomial(&mut b, &team, *root, 0..count, 0, mean)
            }
            (c, a) => unreachable!("{} has no {a} schedule; resolve() rejects it", c.name()),
        }
        b.finish()
    }

    /// The working buffer of member `me` from its input.
    pub(crate) fn prepare<T: Element>(&self, shape: &Shape, me: usize, input: Vec<T>) -> Vec<T> {
        match self {
            Collective::AllGather { .. } => {
                // Grow the caller's allocation (reused across calls when it is large enough)
                // and move its segment into place.
                let seg = shape
                    .parts
                    .as_ref()
                    .expect("all-gather has parts")
                    .segment(me);
                let mut work = input;
                work.resize(shape.count, T::zeroed());
                work.copy_within(0..seg.len(), seg.start);
                work
            }
            _ => input,
        }
    }

    /// Member `me`'s result from its working buffer.
    pub(crate) fn finish<T: Element>(&self, shape: &Shape, me: usize, mut work: Vec<T>) -> Vec<T> {
        match self {
            Collective::ReduceScatter { .. } => {
                let seg = shape
                    .parts
                    .as_ref()
                    .expect("reduce-scatter has parts")
                    .segment(me);
                work.truncate(seg.end);
                work.drain(..seg.start);
                work
            }
            _ => work,
        }
    }
}

fn count_nodes(nodes: &[NodeId]) -> usize {
    let mut distinct = nodes.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    distinct.len()
}

/// Hierarchy pays when there are several nodes and some node holds several ranks.
fn worth_hierarchy(nodes: &[NodeId]) -> bool {
    let distinct = count_nodes(nodes);
    distinct > 1 && distinct < nodes.len()
}

/// The flat all-reduce for `bytes`, by the same size rule as [`Collective::resolve`].
fn flat_all_reduce(bytes: usize, config: &CommConfig) -> schedule::FlatAllReduce {
    if bytes <= config.small_bytes {
        schedule::all_reduce_doubling
    } else if bytes < config.large_bytes {
        schedule::all_reduce_halving_doubling
    } else {
        schedule::all_reduce_ring
    }
}
