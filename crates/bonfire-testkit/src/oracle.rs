//! Sequential references for every collective, and inputs that make them exact.
//!
//! The arithmetic here is written independently of `bonfire_collectives::HostReducer`: floats
//! are combined in `f64` and rounded once to the element type, integers with wrapping `i64` /
//! `u64` arithmetic. For inputs from [`exact_inputs`] every partial result of every combination
//! order is exactly representable, so a correct collective matches these references bit for bit
//! whatever its algorithm.

use std::fmt::Debug;

use bonfire_collectives::{Collective, Element};
use bonfire_topology::{Partition, ReduceOp};
use half::{bf16, f16};
use rand::Rng;

/// An element type the oracles can compute with.
pub trait OracleElement: Element + PartialEq + Debug {
    /// Combines `values` (one per rank, in rank order) with `op`.
    fn reduce(op: ReduceOp, values: &[Self]) -> Self;
    /// A random value for which combining up to 8 of them with `op`, in any order, is exact.
    fn exact(op: ReduceOp, rng: &mut impl Rng) -> Self;
    /// The value as `f64` (for tolerance comparisons).
    fn to_f64(self) -> f64;
    /// Bitwise equality (distinguishes `+0` and `-0`; NaN equals a NaN with the same bits).
    fn same_bits(&self, other: &Self) -> bool {
        bytemuck_eq(self, other)
    }
}

fn bytemuck_eq<T: Element>(a: &T, b: &T) -> bool {
    bytemuck::bytes_of(a) == bytemuck::bytes_of(b)
}

fn float_reduce(op: ReduceOp, values: &[f64]) -> f64 {
    let n = values.len() as f64;
    match op {
        ReduceOp::Sum => values.iter().sum(),
        ReduceOp::Mean => values.iter().sum::<f64>() / n,
        ReduceOp::Product => values.iter().product(),
        ReduceOp::Max => values.iter().copied().fold(f64::NEG_INFINITY, |a, b| {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.max(b)
            }
        }),
        ReduceOp::Min => values.iter().copied().fold(f64::INFINITY, |a, b| {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.min(b)
            }
        }),
    }
}

fn exact_float(op: ReduceOp, rng: &mut impl Rng) -> f64 {
    match op {
        // Sums of 8 values in [-16, 16] stay within 128: exact even in bf16 (8 significant bits).
        ReduceOp::Sum | ReduceOp::Mean => f64::from(rng.random_range(-16i32..=16)),
        // Products of 8 values in {±1, ±2} are ± powers of two up to 256.
        ReduceOp::Product => [-2.0, -1.0, 1.0, 2.0][rng.random_range(0..4)],
        // Integers up to 256 are exact in every float type here.
        ReduceOp::Max | ReduceOp::Min => f64::from(rng.random_range(-256i32..=256)),
    }
}

macro_rules! float_oracle {
    ($t:ty, $from:expr, $to:expr) => {
        impl OracleElement for $t {
            fn reduce(op: ReduceOp, values: &[Self]) -> Self {
                let wide: Vec<f64> = values.iter().map(|&v| $to(v)).collect();
                $from(float_reduce(op, &wide))
            }
            fn exact(op: ReduceOp, rng: &mut impl Rng) -> Self {
                $from(exact_float(op, rng))
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
        }
    };
}

float_oracle!(f32, |x: f64| x as f32, f64::from);
float_oracle!(f64, |x: f64| x, |x: f64| x);
float_oracle!(f16, f16::from_f64, f16::to_f64);
float_oracle!(bf16, bf16::from_f64, bf16::to_f64);

macro_rules! int_oracle {
    ($t:ty, $wide:ty) => {
        impl OracleElement for $t {
            fn reduce(op: ReduceOp, values: &[Self]) -> Self {
                let wide = values.iter().map(|&v| v as $wide);
                match op {
                    ReduceOp::Sum => wide.fold(0, <$wide>::wrapping_add) as $t,
                    ReduceOp::Mean => {
                        let sum = wide.fold(0, <$wide>::wrapping_add) as $t;
                        sum / values.len() as $t
                    }
                    ReduceOp::Product => wide.fold(1, <$wide>::wrapping_mul) as $t,
                    ReduceOp::Max => values.iter().copied().max().expect("at least one rank"),
                    ReduceOp::Min => values.iter().copied().min().expect("at least one rank"),
                }
            }
            fn exact(_op: ReduceOp, rng: &mut impl Rng) -> Self {
                // Wrapping integer arithmetic is exact in any order.
                rng.random()
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}

int_oracle!(i32, i64);
int_oracle!(i64, i64);
int_oracle!(u8, u64);

/// `n` random buffers of `len` elements for which `op` is exact in any order.
pub fn exact_inputs<T: OracleElement>(
    op: ReduceOp,
    n: usize,
    len: usize,
    rng: &mut impl Rng,
) -> Vec<Vec<T>> {
    (0..n)
        .map(|_| (0..len).map(|_| T::exact(op, rng)).collect())
        .collect()
}

/// The elementwise reduction of `inputs` over ranks.
pub fn reduce_all<T: OracleElement>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let len = inputs[0].len();
    (0..len)
        .map(|i| {
            let column: Vec<T> = inputs.iter().map(|v| v[i]).collect();
            T::reduce(op, &column)
        })
        .collect()
}

/// What each rank must get back from `collective` with `inputs[r]` as rank `r`'s buffer;
/// `None` where the result is unspecified (reduce, off the root).
pub fn expected<T: OracleElement>(
    collective: &Collective,
    inputs: &[Vec<T>],
) -> Vec<Option<Vec<T>>> {
    let n = inputs.len();
    match collective {
        Collective::AllReduce(op) => vec![Some(reduce_all(inputs, *op)); n],
        Collective::ReduceScatter { op, counts } => {
            let total = reduce_all(inputs, *op);
            let parts = match counts {
                Some(c) => Partition::from_counts(c),
                None => Partition::balanced(total.len(), n),
            };
            (0..n)
                .map(|r| Some(total[parts.segment(r)].to_vec()))
                .collect()
        }
        Collective::AllGather { .. } => {
            let all: Vec<T> = inputs.iter().flatten().copied().collect();
            vec![Some(all); n]
        }
        Collective::Broadcast { root } => vec![Some(inputs[*root].clone()); n],
        Collective::Reduce { op, root } => (0..n)
            .map(|r| (r == *root).then(|| reduce_all(inputs, *op)))
            .collect(),
        Collective::Barrier => vec![Some(Vec::new()); n],
    }
}

/// Asserts that `got[r]` equals `want[r]` bit for bit wherever `want[r]` is specified.
///
/// # Panics
/// With the rank and the first differing element.
pub fn assert_bitwise<T: OracleElement>(got: &[Vec<T>], want: &[Option<Vec<T>>], context: &str) {
    assert_eq!(got.len(), want.len(), "{context}: number of ranks");
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        let Some(w) = w else { continue };
        assert_eq!(g.len(), w.len(), "{context}: rank {r} result length");
        if let Some(i) = (0..g.len()).find(|&i| !g[i].same_bits(&w[i])) {
            panic!(
                "{context}: rank {r} element {i}: got {:?}, want {:?}",
                g[i], w[i]
            );
        }
    }
}

/// Asserts that every rank's result has the same bits as rank 0's (for ranks with a specified
/// result).
pub fn assert_ranks_agree<T: OracleElement>(got: &[Vec<T>], context: &str) {
    for (r, g) in got.iter().enumerate().skip(1) {
        assert_eq!(g.len(), got[0].len(), "{context}: rank {r} length");
        if let Some(i) = (0..g.len()).find(|&i| !g[i].same_bits(&got[0][i])) {
            panic!(
                "{context}: rank {r} element {i} is {:?}, rank 0 has {:?}",
                g[i], got[0][i]
            );
        }
    }
}
