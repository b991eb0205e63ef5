//! The placement rules: for each op that has one, a function of the op's name and signature
//! that decides the output's placement from the inputs' and runs the op on this rank's parts.
//! `gen/passthrough.py` finds them by name (`pub(crate) fn <op>` in the files of this folder) and
//! calls them from the generated op impls; every other op falls back (`fallback.rs`).
//!
//! The rules, in short (`R` replicate, `S(d)` shard of dimension d, `P` partial):
//! - Elementwise ops keep `R` and `S(d)` (a whole operand is sliced to the other's shard, or
//!   broadcast when its dimension d is 1). `P + P` and `P - P` stay `P`; a scale, a negation, a
//!   reshape or a sum of a `P` stays `P`; any other op needs a `P` whole (an all-reduce).
//! - `matmul`: `R x S(last) -> S(last)`, `S(rows) x R -> S(rows)`, `S(k) x S(k) -> P` (the
//!   row-parallel split; a whole operand is sliced to match), a split batch dimension stays split.
//! - Reductions over a split dimension give `P` (`sum`, `mean`) or reduce over the group (`max`,
//!   `min`); over another dimension they keep the split.
//! - Layout ops move the split with the dimension (`swap_dims`, `permute`, a `reshape` that
//!   keeps the split dimension's blocks whole).
//! - `gather`/`select`/`embedding` on a table split along the looked-up dimension give `P` (each
//!   rank looks up the rows it holds), as Megatron's vocabulary-parallel embedding and
//!   cross-entropy do.

mod activation;
mod create;
mod elementwise;
mod index;
mod layout;
mod matmul;
mod module;
mod reduce;

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Shape, TensorMetadata};

use super::placement::{Placement, broadcast};
use super::redistribute::{Why, add_partial, derive_partial, local_of, part, whole};
use super::tensor::{Repr, TpTensor};

pub(crate) use activation::*;
pub(crate) use create::*;
pub(crate) use elementwise::*;
pub(crate) use index::*;
pub(crate) use layout::*;
pub(crate) use matmul::*;
pub(crate) use module::*;
pub(crate) use reduce::*;

/// `t` with any `Partial` summed (an all-reduce, unless its sum is known), for `op`.
fn settled<I: Backend>(t: TpTensor<I>, op: &'static str) -> TpTensor<I> {
    match t.repr {
        Repr::Partial(_) => TpTensor::replicated(whole::<I>(t, Why::Rule(op))),
        _ => t,
    }
}

/// An elementwise op of one tensor that keeps its placement (a `Partial` is summed first).
fn unary<I: Backend>(
    t: TpTensor<I>,
    op: &'static str,
    f: impl FnOnce(FloatTensor<I>) -> FloatTensor<I>,
) -> TpTensor<I> {
    let t = settled::<I>(t, op);
    map_local::<I>(t, f)
}

/// `f` applied to this rank's part, keeping the placement and the global shape as `f` changes
/// it (for `R`; for `S` the split dimension is unchanged by `f`).
fn map_local<I: Backend>(
    t: TpTensor<I>,
    f: impl FnOnce(FloatTensor<I>) -> FloatTensor<I>,
) -> TpTensor<I> {
    let placement = t.placement();
    let shape = t.shape.clone();
    let out = f(local_of::<I>(t));
    match placement {
        Placement::Shard { .. } => {
            let mut global = out.shape();
            if let Placement::Shard { dim, .. } = placement {
                global[dim] = shape[dim];
            }
            TpTensor::local(out, placement, Some(global))
        }
        _ => TpTensor::replicated(out),
    }
}

/// A linear op of one tensor (a reshape, a scale, a sum): a `Partial` stays `Partial` (and is
/// summed later without communication if its source is summed first); `R` and `S` as `local`
/// says.
fn keep_partial<I: Backend, F>(
    t: TpTensor<I>,
    f: F,
    local: impl FnOnce(TpTensor<I>, F) -> TpTensor<I>,
) -> TpTensor<I>
where
    F: Fn(FloatTensor<I>) -> FloatTensor<I> + Send + Sync + 'static,
{
    match t.repr {
        Repr::Partial(_) => derive_partial::<I>(&t, std::sync::Arc::new(f)),
        _ => local(t, f),
    }
}

/// Whether `add`/`sub` keeps a `Partial`: one operand is `Partial`, the other `Partial` or
/// whole, both of the output's shape.
fn stays_partial<I: Backend>(lhs: &TpTensor<I>, rhs: &TpTensor<I>) -> bool {
    let partial = |t: &TpTensor<I>| matches!(t.repr, Repr::Partial(_));
    let fits = |t: &TpTensor<I>| partial(t) || t.placement() == Placement::Replicate;
    (partial(lhs) || partial(rhs)) && fits(lhs) && fits(rhs) && lhs.shape == rhs.shape
}

/// A binary elementwise op with broadcasting. `additive` (add, sub): a `Partial` plus a
/// `Partial` or a whole tensor stays `Partial` (see [`add_partial`]).
fn binary<I: Backend>(
    lhs: TpTensor<I>,
    rhs: TpTensor<I>,
    op: &'static str,
    additive: Option<bool>,
    f: impl FnOnce(FloatTensor<I>, FloatTensor<I>) -> FloatTensor<I>,
) -> TpTensor<I> {
    let shape = broadcast(&lhs.shape, &rhs.shape);
    if let Some(sub) = additive
        && stays_partial::<I>(&lhs, &rhs)
    {
        return add_partial::<I>(lhs, rhs, sub);
    }
    let (lhs, rhs) = (settled::<I>(lhs, op), settled::<I>(rhs, op));
    let target = match (lhs.placement(), rhs.placement()) {
        (p @ Placement::Shard { .. }, _) | (_, p @ Placement::Shard { .. }) => p,
        _ => Placement::Replicate,
    };
    let (l, r) = (operand::<I>(lhs, target, op), operand::<I>(rhs, target, op));
    TpTensor::local(f(l, r), target, Some(shape))
}

/// This rank's part of an elementwise operand for an output placed `target`: broadcast as it is
/// when its split dimension is 1, otherwise its part of the split (gathering it first, as a
/// fallback of `op`, if it is split along another dimension).
fn operand<I: Backend>(t: TpTensor<I>, target: Placement, op: &'static str) -> FloatTensor<I> {
    match target {
        Placement::Shard { dim, .. } if t.shape[dim] == 1 => whole::<I>(t, Why::Fallback(op)),
        Placement::Shard { .. }
            if t.placement() != target && t.placement() != Placement::Replicate =>
        {
            part::<I>(t, target, Why::Fallback(op))
        }
        _ => part::<I>(t, target, Why::Rule(op)),
    }
}

/// `shape` with `dim` replaced by `size`.
fn with_dim(shape: &Shape, dim: usize, size: usize) -> Shape {
    let mut dims = shape.to_vec();
    dims[dim] = size;
    Shape::from(dims)
}

/// This rank's index in its group, and the group's size (0 of 1 without a group).
fn rank_and_size() -> (usize, usize) {
    super::redistribute::group().map_or((0, 1), |g| (g.rank(), g.size()))
}
