use bonfire_topology::DType;
use bytemuck::Pod;
use half::{bf16, f16};

/// A Rust type that collectives can move and reduce: one per [`DType`].
///
/// Sealed: the reducer implements arithmetic for exactly these types.
pub trait Element: Pod + Send + Sync + 'static + sealed::Sealed {
    /// The dtype of this type.
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i32 => I32, i64 => I64, u8 => U8);
