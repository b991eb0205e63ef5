use std::fmt;

/// How a reducing collective combines the contributions of the ranks.
///
/// Sums and products of integer types wrap. `Mean` is the sum divided by the number of ranks,
/// computed once after the sum: in the element type for floats (f16 and bf16 through f32), and
/// as truncating integer division for integers (as NCCL's `ncclAvg`). `Max` and `Min` propagate
/// NaN: a NaN anywhere gives NaN.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise sum divided by the number of ranks.
    Mean,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
    /// Elementwise product.
    Product,
}

impl ReduceOp {
    /// Every operation, in code order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
    ];

    /// The one-byte code used on the wire.
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Mean => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Product => 4,
        }
    }

    /// The operation of a wire code, or `None` for an unknown code.
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.get(code as usize).copied()
    }

    /// The lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReduceOp::ALL
            .into_iter()
            .find(|op| op.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                format!("unknown reduce op `{s}` (expected sum, mean, max, min or product)")
            })
    }
}
