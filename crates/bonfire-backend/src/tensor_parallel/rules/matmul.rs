//! Matrix products: the rules that make Megatron's column- and row-parallel layers.
//!
//! For `lhs [.., m, k] x rhs [.., k, p]`:
//!
//! ```text
//!   R        x S(p)      -> S(p)     column-parallel: each rank computes its columns
//!   S(m)     x R         -> S(m)
//!   S(k)     x S(k)      -> P        row-parallel: each rank a term of the sum over k
//!   R        x S(k)      -> P        (lhs sliced along k: no communication)
//!   S(k)     x R         -> P        (rhs sliced along k)
//!   S(b)     x S(b) / R  -> S(b)     a split batch dimension (attention heads) stays split
//! ```
//!
//! A `Partial` operand is summed first; any other pair gathers the right-hand side and tries
//! again (a fallback).

use burn_backend::{Backend, Shape};

use super::settled;
use crate::tensor_parallel::placement::Placement;
use crate::tensor_parallel::redistribute::{Why, local_of, part, whole};
use crate::tensor_parallel::tensor::TpTensor;

/// The shape of `lhs x rhs` (batch dimensions broadcast).
fn product_shape(lhs: &Shape, rhs: &Shape) -> Shape {
    let n = lhs.num_dims();
    let mut dims: Vec<usize> = (0..n - 2)
        .map(|d| if lhs[d] == 1 { rhs[d] } else { lhs[d] })
        .collect();
    dims.push(lhs[n - 2]);
    dims.push(rhs[n - 1]);
    Shape::from(dims)
}

/// What to do for a pair of placements: the parts to multiply and the output's placement.
enum Plan {
    /// Multiply `lhs`'s part under the first placement by `rhs`'s under the second; the output
    /// is placed as the third.
    Parts(Placement, Placement, Placement),
    /// No rule: gather `rhs` and try again.
    GatherRhs,
}

fn plan(lhs: Placement, rhs: Placement, lshape: &Shape, rshape: &Shape) -> Plan {
    use Placement::{Partial, Replicate, Shard};
    let n = lshape.num_dims();
    let (m, k_l, k_r, p) = (n - 2, n - 1, n - 2, n - 1);
    match (lhs, rhs) {
        (Replicate, Replicate) => Plan::Parts(Replicate, Replicate, Replicate),
        (Replicate, Shard { dim, blocks }) if dim == p => {
            Plan::Parts(Replicate, rhs, Shard { dim: p, blocks })
        }
        (Shard { dim, blocks }, Replicate) if dim == m => {
            Plan::Parts(lhs, Replicate, Shard { dim: m, blocks })
        }
        (Shard { dim: a, blocks: x }, Shard { dim: b, blocks: y })
            if a == k_l && b == k_r && x == y =>
        {
            Plan::Parts(lhs, rhs, Partial)
        }
        (Replicate, Shard { dim, blocks }) if dim == k_r => {
            Plan::Parts(Shard { dim: k_l, blocks }, rhs, Partial)
        }
        (Shard { dim, blocks }, Replicate) if dim == k_l => {
            Plan::Parts(lhs, Shard { dim: k_r, blocks }, Partial)
        }
        (Shard { dim: a, .. }, other) if a < m && (other == lhs || other == Replicate) => {
            // A split batch dimension: the other side's matching part (or all of it, where
            // it broadcasts).
            let r = if rshape[a] == 1 { Replicate } else { lhs };
            Plan::Parts(lhs, r, lhs)
        }
        (Replicate, Shard { dim: b, .. }) if b < m => {
            let l = if lshape[b] == 1 { Replicate } else { rhs };
            Plan::Parts(l, rhs, rhs)
        }
        _ => Plan::GatherRhs,
    }
}

pub(crate) fn float_matmul<I: Backend>(lhs: TpTensor<I>, rhs: TpTensor<I>) -> TpTensor<I> {
    let shape = product_shape(&lhs.shape, &rhs.shape);
    let (lhs, mut rhs) = (
        settled::<I>(lhs, "float_matmul"),
        settled::<I>(rhs, "float_matmul"),
    );
    loop {
        match plan(lhs.placement(), rhs.placement(), &lhs.shape, &rhs.shape) {
            Plan::Parts(l, r, out) => {
                let l = part::<I>(lhs, l, Why::Rule("float_matmul"));
                let r = part::<I>(rhs, r, Why::Rule("float_matmul"));
                let product = I::float_matmul(l, r);
                return match out {
                    Placement::Partial => TpTensor::partial(product),
                    Placement::Replicate => TpTensor::replicated(product),
                    split => TpTensor::local(product, split, Some(shape)),
                };
            }
            Plan::GatherRhs => {
                if rhs.placement() == Placement::Replicate {
                    // Nothing left to gather on the right: gather the left too.
                    let l = whole::<I>(lhs, Why::Fallback("float_matmul"));
                    let r = local_of::<I>(rhs);
                    return TpTensor::replicated(I::float_matmul(l, r));
                }
                rhs = TpTensor::replicated(whole::<I>(rhs, Why::Fallback("float_matmul")));
            }
        }
    }
}
