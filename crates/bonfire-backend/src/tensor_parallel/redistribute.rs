//! Moving a tensor from one placement to another: the only place tensor-parallel ops
//! communicate. `Partial` to whole is an all-reduce, `Shard` to whole an all-gather, whole to
//! `Shard` a local slice (no communication). Collectives run over the group's communicator on
//! host copies of the tensors (f32), like the data-parallel host path.

use std::sync::Arc;
use std::time::Instant;

use bonfire_topology::ReduceOp;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape, Slice, TensorData, TensorMetadata};

use super::context::{self, TpRank};
use super::placement::{Placement, local_shape, owned_ranges};
use super::tensor::{Origin, PartialCell, Recipe, Repr, TpTensor};

/// Why a tensor is being made whole, for the counters.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Why {
    /// An op with a rule that needs it whole (a `Partial` before a nonlinear op).
    Rule(&'static str),
    /// An op without a rule for its inputs' placements: counted as that op's fallback.
    Fallback(&'static str),
    /// The user reads it (`into_data`) or saves it.
    Read,
}

impl Why {
    pub(crate) fn op(self) -> &'static str {
        match self {
            Why::Rule(op) | Why::Fallback(op) => op,
            Why::Read => "a read of the tensor",
        }
    }
}

/// The calling thread's group; `None` for a group of one (or none bound).
pub(crate) fn group() -> Option<Arc<TpRank>> {
    context::current().filter(|g| g.size() > 1)
}

/// Ranks in the calling thread's group (1 without one).
pub(crate) fn ranks() -> usize {
    group().map_or(1, |g| g.size())
}

pub(crate) fn to_host<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    let data = futures::executor::block_on(B::float_into_data(t))
        .expect("a tensor of the inner backend can be read to the host");
    if data.dtype == DType::F32 {
        data.into_vec::<f32>().expect("f32 data")
    } else {
        data.convert::<f32>()
            .into_vec::<f32>()
            .expect("converted to f32")
    }
}

pub(crate) fn from_host<B: Backend>(
    values: Vec<f32>,
    shape: Shape,
    dtype: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    let mut data = TensorData::new(values, shape);
    if dtype != DType::F32 {
        data = data.convert_dtype(dtype);
    }
    B::float_from_data(data, device)
}

/// The sum over the group of every rank's `local` (all of one shape).
pub(crate) fn all_reduce<B: Backend>(
    g: &TpRank,
    local: FloatTensor<B>,
    op: &'static str,
    how: ReduceOp,
) -> FloatTensor<B> {
    let began = Instant::now();
    let (shape, dtype, device) = (local.shape(), local.dtype(), B::float_device(&local));
    let values = to_host::<B>(local);
    let bytes = 4 * values.len() as u64;
    let (summed, times) = g.comm.all_reduce(values, how).wait_times();
    let summed = summed.unwrap_or_else(|e| g.fail(op, e));
    let out = from_host::<B>(summed, shape, dtype, &device);
    let mut s = g.stats();
    s.all_reduces += 1;
    s.all_reduce_bytes += bytes;
    s.all_reduce_time += began.elapsed();
    s.all_reduce_peer_wait += times.arrived - times.started;
    drop(s);
    out
}

/// The whole tensor from every rank's part under `Shard { dim, blocks }`.
pub(crate) fn all_gather<B: Backend>(
    g: &TpRank,
    local: FloatTensor<B>,
    dim: usize,
    blocks: usize,
    why: Why,
) -> FloatTensor<B> {
    let began = Instant::now();
    let (lshape, dtype, device) = (local.shape(), local.dtype(), B::float_device(&local));
    let values = to_host::<B>(local);
    let per = values.len();
    {
        let mut s = g.stats();
        s.gathers += 1;
        s.gather_bytes += 4 * per as u64;
    }
    let all = g
        .comm
        .all_gather(values)
        .wait()
        .unwrap_or_else(|e| g.fail(why.op(), e));
    g.stats().gather_time += began.elapsed();
    assemble::<B>(all, &lshape, dim, blocks, dtype, &device)
}

/// The whole tensor from `all`, every rank's part (of shape `lshape`, under
/// `Shard { dim, blocks }`) in rank order, as an all-gather returns them.
pub(crate) fn assemble<B: Backend>(
    all: Vec<f32>,
    lshape: &Shape,
    dim: usize,
    blocks: usize,
    dtype: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    assemble_parts::<B>(split_parts::<B>(all, lshape, dtype, device), dim, blocks)
}

/// Every rank's part (of shape `lshape`) from `all`, their values in rank order.
fn split_parts<B: Backend>(
    all: Vec<f32>,
    lshape: &Shape,
    dtype: DType,
    device: &B::Device,
) -> Vec<FloatTensor<B>> {
    let per = lshape.num_elements();
    let n = all.len() / per.max(1);
    (0..n)
        .map(|i| {
            from_host::<B>(
                all[i * per..(i + 1) * per].to_vec(),
                lshape.clone(),
                dtype,
                device,
            )
        })
        .collect()
}

/// The whole tensor from every rank's part under `Shard { dim, blocks }`, in rank order.
pub(crate) fn assemble_parts<B: Backend>(
    parts: Vec<FloatTensor<B>>,
    dim: usize,
    blocks: usize,
) -> FloatTensor<B> {
    let n = parts.len();
    let lshape = parts[0].shape();
    if blocks == 1 {
        return B::float_cat(parts, dim);
    }
    // Each part holds one chunk of every block; the whole is block 0's chunks, block 1's...
    let chunk = lshape[dim] / blocks;
    let mut pieces = Vec::with_capacity(n * blocks);
    for b in 0..blocks {
        for part in &parts {
            pieces.push(narrow::<B>(part.clone(), dim, b * chunk..(b + 1) * chunk));
        }
    }
    B::float_cat(pieces, dim)
}

/// `t` restricted to `range` along `dim`.
pub(crate) fn narrow<B: Backend>(
    t: FloatTensor<B>,
    dim: usize,
    range: std::ops::Range<usize>,
) -> FloatTensor<B> {
    let shape = t.shape();
    if range.start == 0 && range.end == shape[dim] {
        return t;
    }
    let slices: Vec<Slice> = (0..shape.num_dims())
        .map(|d| {
            if d == dim {
                Slice::from(range.clone())
            } else {
                Slice::from(0..shape[d])
            }
        })
        .collect();
    B::float_slice(t, &slices)
}

/// Rank `r`'s part, under `Shard { dim, blocks }`, of the whole tensor `full`.
pub(crate) fn shard_of<B: Backend>(
    full: FloatTensor<B>,
    dim: usize,
    blocks: usize,
    n: usize,
    r: usize,
) -> FloatTensor<B> {
    let ranges = owned_ranges(full.shape()[dim], blocks, n, r);
    if ranges.len() == 1 {
        return narrow::<B>(full, dim, ranges[0].clone());
    }
    let pieces = ranges
        .into_iter()
        .map(|range| narrow::<B>(full.clone(), dim, range))
        .collect();
    B::float_cat(pieces, dim)
}

/// The summed value of a `Partial`, communicating only if it is not known locally: its one
/// pending source is summed instead when that source is no larger (then the cell and every other
/// value derived from the source are computed locally), otherwise the cell itself.
pub(crate) fn sum_of<B: Backend>(cell: &Arc<PartialCell<B>>, why: Why) -> FloatTensor<B> {
    if let Some(sum) = cell.known_sum() {
        return sum;
    }
    let mut roots = Vec::new();
    cell.pending_roots(&mut roots);
    if let [root] = roots.as_slice()
        && !Arc::ptr_eq(root, cell)
        && root.numel() <= cell.numel()
    {
        reduce_cell::<B>(root, why);
        if let Some(sum) = cell.known_sum() {
            return sum;
        }
    }
    reduce_cell::<B>(cell, why)
}

/// Sums `cell`'s terms over the group (one all-reduce) and adds its addend.
fn reduce_cell<B: Backend>(cell: &PartialCell<B>, why: Why) -> FloatTensor<B> {
    let (local, addend, summed) = cell.term();
    if summed {
        return local;
    }
    let sum = match group() {
        Some(g) => all_reduce::<B>(&g, local, why.op(), ReduceOp::Sum),
        None => local,
    };
    let sum = match addend {
        Some(a) => B::float_add(sum, a),
        None => sum,
    };
    cell.set_sum(sum.clone());
    sum
}

/// The whole tensor on this rank: gathered, summed, or made, as its placement needs.
pub(crate) fn whole<B: Backend>(t: TpTensor<B>, why: Why) -> FloatTensor<B> {
    match t.repr {
        Repr::Local {
            tensor,
            placement: Placement::Replicate | Placement::Partial,
        } => tensor,
        Repr::Local {
            tensor,
            placement: Placement::Shard { dim, blocks },
        } => match group() {
            None => tensor,
            Some(g) => {
                if let Why::Fallback(op) = why {
                    g.fallback(op, || {
                        format!("a Shard({dim}) input of shape {:?}", t.shape.to_vec())
                    });
                }
                super::prefetch::gather::<B>(&g, tensor, t.tag, dim, blocks, why)
            }
        },
        Repr::Fill { value, device } => {
            B::float_full(t.shape, value.into(), &device, t.dtype.into())
        }
        Repr::Partial(cell) => sum_of::<B>(&cell, why),
    }
}

/// This rank's part of `t` under `target` (a `Shard` or `Replicate`): a slice of the whole when
/// `t` is whole, `t`'s own part when it already has that placement, otherwise made whole first.
pub(crate) fn part<B: Backend>(t: TpTensor<B>, target: Placement, why: Why) -> FloatTensor<B> {
    let Placement::Shard { dim, blocks } = target else {
        return whole::<B>(t, why);
    };
    if t.placement() == target {
        return local_of::<B>(t);
    }
    let n = ranks();
    if let Repr::Fill { value, device } = &t.repr {
        let shape = local_shape(&t.shape, target, n);
        return B::float_full(shape, (*value).into(), device, t.dtype.into());
    }
    let r = group().map_or(0, |g| g.rank());
    let full = whole::<B>(t, why);
    shard_of::<B>(full, dim, blocks, n, r)
}

/// This rank's tensor as it is held (a `Partial`'s term, a `Shard`'s part, a constant made
/// whole): no communication.
pub(crate) fn local_of<B: Backend>(t: TpTensor<B>) -> FloatTensor<B> {
    match t.repr {
        Repr::Local { tensor, .. } => tensor,
        Repr::Fill { value, device } => {
            B::float_full(t.shape, value.into(), &device, t.dtype.into())
        }
        Repr::Partial(cell) => cell.term().0,
    }
}

/// A `Partial` derived from `t` (a `Partial`) by the linear `f` (a reshape, a scale, a sum over
/// a dimension): each rank's term and the addend go through `f`; summed later with no
/// communication if `t` is summed first.
pub(crate) fn derive_partial<B: Backend>(
    t: &TpTensor<B>,
    f: Arc<dyn Fn(FloatTensor<B>) -> FloatTensor<B> + Send + Sync>,
) -> TpTensor<B> {
    let Repr::Partial(cell) = &t.repr else {
        unreachable!("derive_partial takes a Partial");
    };
    if let Some(sum) = cell.known_sum() {
        return TpTensor::replicated(f(sum));
    }
    let (local, addend, _) = cell.term();
    let local = f(local);
    let addend = addend.map(|a| f(a));
    let recipe: Recipe<B> = Arc::new(move |sums: &[FloatTensor<B>]| f(sums[0].clone()));
    TpTensor::from_cell(PartialCell::new(
        local,
        addend,
        Some(Origin {
            sources: vec![cell.clone()],
            recipe,
        }),
    ))
}

/// `a + b` (`sub`: `a - b`) where each is a `Partial` or whole, at least one `Partial`, of the
/// same shape: a `Partial` whose terms are the `Partial`s' terms and whose addend takes the
/// whole operand, so nothing is communicated.
pub(crate) fn add_partial<B: Backend>(a: TpTensor<B>, b: TpTensor<B>, sub: bool) -> TpTensor<B> {
    // Each side as (cell, or its whole value).
    let side = |t: TpTensor<B>| match t.repr {
        Repr::Partial(cell) => match cell.known_sum() {
            Some(sum) => Err(sum),
            None => Ok(cell),
        },
        _ => Err(whole::<B>(t, Why::Rule("float_add"))),
    };
    let (a, b) = (side(a), side(b));
    let op = move |x: FloatTensor<B>, y: FloatTensor<B>| {
        if sub {
            B::float_sub(x, y)
        } else {
            B::float_add(x, y)
        }
    };
    let neg_if_sub = move |y: FloatTensor<B>| if sub { B::float_neg(y) } else { y };
    let add_opt = move |x: Option<FloatTensor<B>>, y: Option<FloatTensor<B>>| match (x, y) {
        (Some(x), Some(y)) => Some(op(x, y)),
        (Some(x), None) => Some(x),
        (None, Some(y)) => Some(neg_if_sub(y)),
        (None, None) => None,
    };
    match (a, b) {
        (Ok(ca), Ok(cb)) => {
            let (la, aa, _) = ca.term();
            let (lb, ab, _) = cb.term();
            let recipe: Recipe<B> =
                Arc::new(move |s: &[FloatTensor<B>]| op(s[0].clone(), s[1].clone()));
            TpTensor::from_cell(PartialCell::new(
                op(la, lb),
                add_opt(aa, ab),
                Some(Origin {
                    sources: vec![ca, cb],
                    recipe,
                }),
            ))
        }
        (Ok(ca), Err(wb)) => {
            let (la, aa, _) = ca.term();
            let w = wb.clone();
            let recipe: Recipe<B> =
                Arc::new(move |s: &[FloatTensor<B>]| op(s[0].clone(), w.clone()));
            TpTensor::from_cell(PartialCell::new(
                la,
                add_opt(aa, Some(wb)),
                Some(Origin {
                    sources: vec![ca],
                    recipe,
                }),
            ))
        }
        (Err(wa), Ok(cb)) => {
            let (lb, ab, _) = cb.term();
            let w = wa.clone();
            let recipe: Recipe<B> =
                Arc::new(move |s: &[FloatTensor<B>]| op(w.clone(), s[0].clone()));
            let addend = match ab {
                Some(ab) => op(wa, ab),
                None => wa,
            };
            TpTensor::from_cell(PartialCell::new(
                neg_if_sub(lb),
                Some(addend),
                Some(Origin {
                    sources: vec![cb],
                    recipe,
                }),
            ))
        }
        (Err(wa), Err(wb)) => TpTensor::replicated(op(wa, wb)),
    }
}

/// The concatenation along `dim` of `Partial`s: each rank's terms concatenated, and the addends
/// (zeros where a part has none). Summed later from the parts' sums if they are summed first.
pub(crate) fn cat_partials<B: Backend>(parts: Vec<TpTensor<B>>, dim: usize) -> TpTensor<B> {
    let cells: Vec<Arc<PartialCell<B>>> = parts
        .into_iter()
        .map(|t| match t.repr {
            Repr::Partial(cell) => cell,
            _ => unreachable!("cat_partials takes Partials"),
        })
        .collect();
    if let Some(sums) = cells
        .iter()
        .map(|c| c.known_sum())
        .collect::<Option<Vec<_>>>()
    {
        return TpTensor::replicated(B::float_cat(sums, dim));
    }
    let terms: Vec<_> = cells.iter().map(|c| c.term()).collect();
    let any_addend = terms.iter().any(|(_, a, _)| a.is_some());
    let addend = any_addend.then(|| {
        let addends = terms
            .iter()
            .map(|(local, a, _)| {
                a.clone()
                    .unwrap_or_else(|| B::float_mul_scalar(local.clone(), 0f32.into()))
            })
            .collect();
        B::float_cat(addends, dim)
    });
    let locals = terms.into_iter().map(|(local, _, _)| local).collect();
    let recipe: Recipe<B> =
        Arc::new(move |sums: &[FloatTensor<B>]| B::float_cat(sums.to_vec(), dim));
    TpTensor::from_cell(PartialCell::new(
        B::float_cat(locals, dim),
        addend,
        Some(Origin {
            sources: cells,
            recipe,
        }),
    ))
}
