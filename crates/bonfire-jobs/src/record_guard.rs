//! A serde layer between bincode and Burn's record types that checks every tensor before Burn
//! sees it: a `TensorData` whose shape claims more elements than its bytes hold is an error
//! here. Burn's deserialiser converts each tensor to the record's precision into a buffer sized
//! by the shape alone, so one damaged shape (with a damaged dtype, which forces the conversion)
//! asked for 63,176,303,915,827,200 bytes and aborted the process (BENCHMARKS.md, "The checkpoint
//! loader under mutation").
//!
//! [`Guard`] forwards every call to the deserializer it wraps and wraps what that hands on
//! (sequences, maps, enums, options, newtypes), so that nested structs come back through it. A
//! struct named `TensorData` is read whole as Burn's own `TensorData` (which allocates only what
//! bincode's limit allows), checked, encoded again and replayed to Burn's visitor.

use std::fmt;

use burn::tensor::TensorData;
use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};

/// The deserializer `D`, with every tensor checked.
pub(crate) struct Guard<D>(pub(crate) D);

/// Whether `data`'s bytes hold what its shape and dtype claim; the error says what does not.
fn check(data: &TensorData) -> Result<(), String> {
    let elements = data
        .shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            format!(
                "a tensor of shape {:?} has more elements than memory",
                data.shape
            )
        })?;
    let bits = data.dtype.size() * 8;
    // Packed (quantized) tensors hold elements in fewer than 8 bits: only an upper bound there.
    let needed = elements
        .checked_mul(bits)
        .map(|b| b.div_ceil(8))
        .ok_or_else(|| {
            format!(
                "a tensor of shape {:?} has more elements than memory",
                data.shape
            )
        })?;
    let packed = matches!(data.dtype, burn::tensor::DType::QFloat(_));
    let fits = if packed {
        needed >= data.bytes.len() / 8
    } else {
        needed == data.bytes.len()
    };
    if !fits {
        return Err(format!(
            "a tensor of shape {:?} and type {:?} with {} bytes",
            data.shape,
            data.dtype,
            data.bytes.len()
        ));
    }
    Ok(())
}

/// Reads a `TensorData` from `inner`, checks it and hands it to `visitor` as `inner` would have.
fn tensor_data<'de, D: Deserializer<'de>, V: Visitor<'de>>(
    inner: D,
    fields: &'static [&'static str],
    visitor: V,
) -> Result<V::Value, D::Error> {
    let data = <TensorData as de::Deserialize>::deserialize(inner)?;
    check(&data).map_err(de::Error::custom)?;
    let bytes = bincode::serde::encode_to_vec(&data, bincode::config::standard())
        .map_err(de::Error::custom)?;
    drop(data);
    let mut replay = bincode::serde::OwnedSerdeDecoder::from_reader(
        bincode::de::read::SliceReader::new(&bytes),
        bincode::config::standard(),
    );
    replay
        .as_deserializer()
        .deserialize_struct("TensorData", fields, visitor)
        .map_err(de::Error::custom)
}

macro_rules! forward {
    ($($method:ident),* $(,)?) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
                self.0.$method(Wrap(visitor))
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Guard<D> {
    type Error = D::Error;

    forward!(
        deserialize_any,
        deserialize_bool,
        deserialize_i8,
        deserialize_i16,
        deserialize_i32,
        deserialize_i64,
        deserialize_i128,
        deserialize_u8,
        deserialize_u16,
        deserialize_u32,
        deserialize_u64,
        deserialize_u128,
        deserialize_f32,
        deserialize_f64,
        deserialize_char,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_option,
        deserialize_unit,
        deserialize_seq,
        deserialize_map,
        deserialize_identifier,
        deserialize_ignored_any,
    );

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_unit_struct(name, Wrap(visitor))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_newtype_struct(name, Wrap(visitor))
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_tuple(len, Wrap(visitor))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_tuple_struct(name, len, Wrap(visitor))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        if name == "TensorData" {
            return tensor_data(self.0, fields, visitor);
        }
        self.0.deserialize_struct(name, fields, Wrap(visitor))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_enum(name, variants, Wrap(visitor))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

/// A visitor whose nested deserializers and accesses come back through [`Guard`].
struct Wrap<V>(V);

macro_rules! visit {
    ($($method:ident($ty:ty)),* $(,)?) => {
        $(
            fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
                self.0.$method(v)
            }
        )*
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }

    visit!(
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
        visit_str(&str),
        visit_borrowed_str(&'de str),
        visit_string(String),
        visit_bytes(&[u8]),
        visit_borrowed_bytes(&'de [u8]),
        visit_byte_buf(Vec<u8>),
    );

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.0.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.0.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.visit_some(Guard(d))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.visit_newtype_struct(Guard(d))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        self.0.visit_seq(Guard(seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        self.0.visit_map(Guard(map))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        self.0.visit_enum(Guard(data))
    }
}

impl<'de, T: DeserializeSeed<'de>> DeserializeSeed<'de> for Guard<T> {
    type Value = T::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(Guard(d))
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Guard<A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        self.0.next_element_seed(Guard(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Guard<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        self.0.next_key_seed(Guard(seed))
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<T::Value, Self::Error> {
        self.0.next_value_seed(Guard(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for Guard<A> {
    type Error = A::Error;
    type Variant = Guard<A::Variant>;

    fn variant_seed<T: DeserializeSeed<'de>>(
        self,
        seed: T,
    ) -> Result<(T::Value, Self::Variant), Self::Error> {
        let (value, variant) = self.0.variant_seed(seed)?;
        Ok((value, Guard(variant)))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Guard<A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), Self::Error> {
        self.0.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(
        self,
        seed: T,
    ) -> Result<T::Value, Self::Error> {
        self.0.newtype_variant_seed(Guard(seed))
    }

    fn tuple_variant<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.tuple_variant(len, Wrap(visitor))
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.struct_variant(fields, Wrap(visitor))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Bytes, DType, Shape};

    use super::*;

    fn through_guard(data: &TensorData) -> Result<TensorData, String> {
        let bytes = bincode::serde::encode_to_vec(data, bincode::config::standard()).unwrap();
        let mut decoder = bincode::serde::OwnedSerdeDecoder::from_reader(
            bincode::de::read::SliceReader::new(&bytes),
            bincode::config::standard(),
        );
        <TensorData as de::Deserialize>::deserialize(Guard(decoder.as_deserializer()))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_tensor_passes_whole_and_a_shape_its_bytes_cannot_fill_is_refused() {
        let good = TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]);
        assert_eq!(through_guard(&good).unwrap(), good);
        // What the campaign found: a damaged dtype (so Burn converts) and a damaged shape (so
        // the conversion's buffer is sized by it), over 16 bytes.
        let damaged = TensorData {
            bytes: Bytes::from_elems(vec![1.0f64, 2.0]),
            shape: Shape::new([1 << 40, 1 << 14]),
            dtype: DType::F64,
        };
        let e = through_guard(&damaged).unwrap_err();
        assert!(
            e.contains("a tensor of shape") && e.contains("with 16 bytes"),
            "{e}"
        );
        let overflowing = TensorData {
            shape: Shape::new([usize::MAX, 3]),
            ..damaged
        };
        let e = through_guard(&overflowing).unwrap_err();
        assert!(e.contains("more elements than memory"), "{e}");
    }
}
