//! The data-stream frame: a fixed 36-byte header, then the payload as raw bytes.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "BNFR"
//!      4     1  version (1)
//!      5     1  kind (1 = data, 2 = goodbye)
//!      6     2  reserved, zero
//!      8     4  step     (little-endian)
//!     12     8  context  (little-endian)
//!     20     8  seq      (little-endian)
//!     28     8  payload length in bytes (little-endian)
//! ```
//!
//! Nothing in the header is trusted before [`FrameHeader::decode`] has checked it: the magic, the
//! version, the kind, the reserved bytes and the length against the receiver's limit, so that a
//! hostile or corrupted stream is an error, never a panic or an allocation of its choosing.

use crate::Tag;

/// Bytes in an encoded [`FrameHeader`].
pub const HEADER_LEN: usize = 36;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"BNFR";

/// The frame-format version this build speaks.
pub const VERSION: u8 = 1;

/// What a frame carries.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A payload for the mailbox, filed under the header's tag.
    Data,
    /// The sender is shutting down cleanly; no payload, no frames follow on this stream.
    Goodbye,
}

impl FrameKind {
    fn code(self) -> u8 {
        match self {
            FrameKind::Data => 1,
            FrameKind::Goodbye => 2,
        }
    }
}

/// A decoded, validated frame header.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Where the payload is filed.
    pub tag: Tag,
    /// Payload bytes that follow the header.
    pub len: u64,
}

/// Why a frame header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer bytes than a header.
    #[error("truncated frame header: {got} of {HEADER_LEN} bytes")]
    Truncated {
        /// Bytes available.
        got: usize,
    },
    /// The stream is not a bonfire frame stream.
    #[error(
        "bad frame magic {found:02x?} (expected {MAGIC:02x?}): the peer is not speaking bonfire's frame format"
    )]
    Magic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// A frame format this build does not speak.
    #[error(
        "frame format version {found}, this build speaks version {VERSION}: run the same bonfire version on every rank"
    )]
    Version {
        /// The version found.
        found: u8,
    },
    /// An unknown frame kind.
    #[error("unknown frame kind {found}")]
    Kind {
        /// The kind byte found.
        found: u8,
    },
    /// Reserved bytes were not zero.
    #[error("reserved frame header bytes are not zero ({found:#06x})")]
    Reserved {
        /// The reserved field found.
        found: u16,
    },
    /// The payload is longer than the receiver accepts.
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    TooLong {
        /// The announced length.
        len: u64,
        /// The receiver's limit.
        max: u64,
    },
    /// A goodbye frame announced a payload.
    #[error("goodbye frame announces a payload of {len} bytes")]
    GoodbyePayload {
        /// The announced length.
        len: u64,
    },
}

impl FrameHeader {
    /// A data frame header.
    pub fn data(tag: Tag, len: u64) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            tag,
            len,
        }
    }

    /// The goodbye frame header.
    pub fn goodbye() -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Goodbye,
            tag: Tag {
                context: 0,
                seq: 0,
                step: 0,
            },
            len: 0,
        }
    }

    /// The header's wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.kind.code();
        out[8..12].copy_from_slice(&self.tag.step.to_le_bytes());
        out[12..20].copy_from_slice(&self.tag.context.to_le_bytes());
        out[20..28].copy_from_slice(&self.tag.seq.to_le_bytes());
        out[28..36].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes and validates the header at the start of `bytes`; payloads longer than
    /// `max_len` are refused.
    pub fn decode(bytes: &[u8], max_len: u64) -> Result<FrameHeader, FrameError> {
        let Some(h) = bytes.first_chunk::<HEADER_LEN>() else {
            return Err(FrameError::Truncated { got: bytes.len() });
        };
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != MAGIC {
            return Err(FrameError::Magic { found: magic });
        }
        if h[4] != VERSION {
            return Err(FrameError::Version { found: h[4] });
        }
        let kind = match h[5] {
            1 => FrameKind::Data,
            2 => FrameKind::Goodbye,
            found => return Err(FrameError::Kind { found }),
        };
        let reserved = u16::from_le_bytes([h[6], h[7]]);
        if reserved != 0 {
            return Err(FrameError::Reserved { found: reserved });
        }
        let len = u64_at(28);
        if kind == FrameKind::Goodbye && len != 0 {
            return Err(FrameError::GoodbyePayload { len });
        }
        if len > max_len {
            return Err(FrameError::TooLong { len, max: max_len });
        }
        Ok(FrameHeader {
            kind,
            tag: Tag {
                context: u64_at(12),
                seq: u64_at(20),
                step: u32_at(8),
            },
            len,
        })
    }
}

/// The frames [`split_frames`] found (headers and payload slices), and the bytes they used.
#[cfg(any(test, feature = "fuzzing"))]
pub type SplitFrames<'a> = (Vec<(FrameHeader, &'a [u8])>, usize);

/// Splits a byte stream into validated frames; used by the fuzz target and tests to check the
/// decoder on whole streams. Returns the frames and the number of bytes consumed; a trailing
/// partial frame is left unconsumed.
#[cfg(any(test, feature = "fuzzing"))]
pub fn split_frames(mut bytes: &[u8], max_len: u64) -> Result<SplitFrames<'_>, FrameError> {
    let total = bytes.len();
    let mut frames = Vec::new();
    while bytes.len() >= HEADER_LEN {
        let header = FrameHeader::decode(bytes, max_len)?;
        let rest = &bytes[HEADER_LEN..];
        // `len <= max_len`, but on 32-bit targets it may still not fit a usize.
        let Ok(len) = usize::try_from(header.len) else {
            return Err(FrameError::TooLong {
                len: header.len,
                max: usize::MAX as u64,
            });
        };
        if rest.len() < len {
            break;
        }
        frames.push((header, &rest[..len]));
        bytes = &rest[len..];
    }
    Ok((frames, total - bytes.len()))
}

#[cfg(test)]
mod tests {
    use rand::Rng;

    use super::*;

    fn tag() -> Tag {
        Tag {
            context: 0x0123_4567_89ab_cdef,
            seq: 42,
            step: 0xff00_0001,
        }
    }

    #[test]
    fn round_trips() {
        let h = FrameHeader::data(tag(), 1 << 20);
        assert_eq!(FrameHeader::decode(&h.encode(), 1 << 20), Ok(h));
        let g = FrameHeader::goodbye();
        assert_eq!(FrameHeader::decode(&g.encode(), 0), Ok(g));
    }

    #[test]
    fn refuses_what_it_does_not_know() {
        let good = FrameHeader::data(tag(), 8).encode();
        let with = |i: usize, v: u8| {
            let mut b = good;
            b[i] = v;
            FrameHeader::decode(&b, 1 << 20)
        };
        assert!(matches!(with(0, b'X'), Err(FrameError::Magic { .. })));
        assert_eq!(with(4, 2), Err(FrameError::Version { found: 2 }));
        assert_eq!(with(5, 9), Err(FrameError::Kind { found: 9 }));
        assert_eq!(with(7, 1), Err(FrameError::Reserved { found: 0x100 }));
        assert_eq!(
            FrameHeader::decode(&good[..20], 1 << 20),
            Err(FrameError::Truncated { got: 20 })
        );
        assert_eq!(
            FrameHeader::decode(&good, 7),
            Err(FrameError::TooLong { len: 8, max: 7 })
        );
        let mut bye = FrameHeader::goodbye().encode();
        bye[28] = 1;
        assert_eq!(
            FrameHeader::decode(&bye, 100),
            Err(FrameError::GoodbyePayload { len: 1 })
        );
    }

    #[test]
    fn splits_streams_and_keeps_partial_tails() {
        let mut stream = Vec::new();
        stream.extend_from_slice(&FrameHeader::data(tag(), 3).encode());
        stream.extend_from_slice(b"abc");
        stream.extend_from_slice(&FrameHeader::data(tag(), 0).encode());
        stream.extend_from_slice(&FrameHeader::data(tag(), 5).encode());
        stream.extend_from_slice(b"xy");
        let (frames, used) = split_frames(&stream, 16).unwrap();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].1, b"abc");
        assert_eq!(frames[1].1, b"");
        assert_eq!(used, 2 * HEADER_LEN + 3);
    }

    /// A stream of valid frames: random tags, payload lengths around the limit and zero, a
    /// goodbye now and then.
    fn valid_stream(rng: &mut impl rand::Rng, max: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rng.random_range(0..6) {
            if rng.random_ratio(1, 8) {
                out.extend_from_slice(&FrameHeader::goodbye().encode());
                continue;
            }
            let len = match rng.random_range(0..4) {
                0 => 0,
                1 => max,
                _ => rng.random_range(0..=max),
            };
            let tag = Tag {
                context: rng.random(),
                seq: rng.random(),
                step: rng.random(),
            };
            out.extend_from_slice(&FrameHeader::data(tag, len).encode());
            out.extend((0..len).map(|_| rng.random::<u8>()));
        }
        out
    }

    /// One random mutation of `data`, biased toward the header's fields.
    fn mutate(rng: &mut impl rand::Rng, data: &mut Vec<u8>, max: u64) {
        const INTERESTING: [u8; 8] = [0, 1, 2, 3, 0x7f, 0x80, 0xff, VERSION];
        let at = |rng: &mut dyn rand::RngCore, len: usize| rng.random_range(0..len.max(1));
        match rng.random_range(0..7) {
            0 if !data.is_empty() => {
                let i = at(rng, data.len());
                data[i] ^= 1 << rng.random_range(0..8);
            }
            1 if !data.is_empty() => {
                let i = at(rng, data.len());
                data[i] = INTERESTING[rng.random_range(0..INTERESTING.len())];
            }
            2 if data.len() >= HEADER_LEN => {
                // A header's length field, anywhere a header may start.
                let i = at(rng, data.len() - 7);
                let v: u64 = match rng.random_range(0..6) {
                    0 => 0,
                    1 => max,
                    2 => max + 1,
                    3 => u64::MAX,
                    4 => 1 << 63,
                    _ => rng.random(),
                };
                data[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            3 => data.truncate(at(rng, data.len() + 1)),
            4 if !data.is_empty() => {
                // Repeat a slice of the stream (a replayed or duplicated frame).
                let a = at(rng, data.len());
                let b = rng.random_range(a..=data.len());
                let copy = data[a..b].to_vec();
                let i = at(rng, data.len() + 1);
                data.splice(i..i, copy);
            }
            5 => {
                let i = at(rng, data.len() + 1);
                let junk: Vec<u8> = (0..rng.random_range(1..16)).map(|_| rng.random()).collect();
                data.splice(i..i, junk);
            }
            _ if !data.is_empty() => {
                let a = at(rng, data.len());
                let b = rng.random_range(a..=data.len());
                data.drain(a..b);
            }
            _ => data.extend_from_slice(&FrameHeader::goodbye().encode()),
        }
    }

    /// What the decoder must hold on any input: no panic, no payload over the limit, accepted
    /// headers re-encode to their bytes, and a split accounts for exactly the bytes it used.
    /// Returns how the split ended, for the campaign's tally: 0 for frames accepted to the end
    /// (or to a partial tail), else which refusal (in [`FrameError`]'s order, from 1).
    fn check(data: &[u8], max: u64) -> usize {
        if let Ok(h) = FrameHeader::decode(data, max) {
            assert!(h.len <= max);
            assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
        }
        match split_frames(data, max) {
            Ok((frames, used)) => {
                assert!(used <= data.len());
                let mut at = 0;
                for (h, payload) in frames {
                    assert_eq!(payload.len() as u64, h.len);
                    assert!(h.kind == FrameKind::Data || h.len == 0);
                    at += HEADER_LEN + payload.len();
                }
                assert_eq!(at, used);
                0
            }
            Err(e @ FrameError::Truncated { .. }) => {
                panic!("a split leaves a short tail unconsumed, it never refuses it: {e}")
            }
            Err(FrameError::Magic { .. }) => 1,
            Err(FrameError::Version { .. }) => 2,
            Err(FrameError::Kind { .. }) => 3,
            Err(FrameError::Reserved { .. }) => 4,
            Err(FrameError::TooLong { .. }) => 5,
            Err(FrameError::GoodbyePayload { .. }) => 6,
        }
    }

    /// A mutation campaign over frame streams, on the stable toolchain (cargo-fuzz needs
    /// nightly, which this project cannot fetch): valid streams, mutated one to eight times
    /// (bit flips, interesting bytes, length fields set to the limit's edges, truncation,
    /// replayed slices, junk), checked with the fuzz target's properties. Unmutated streams must
    /// split into exactly the frames that were written. CI runs 50,000 inputs; a campaign runs
    /// for `BONFIRE_FUZZ_SECS` seconds from seed `BONFIRE_FUZZ_SEED` and prints what it ran:
    ///
    /// `BONFIRE_FUZZ_SECS=600 cargo test --release -p bonfire-transport frame_campaign -- --nocapture`
    #[test]
    fn frame_campaign() {
        use rand::SeedableRng;
        let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let seed = env("BONFIRE_FUZZ_SEED").unwrap_or(17);
        let budget = env("BONFIRE_FUZZ_SECS").map(std::time::Duration::from_secs);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let started = std::time::Instant::now();
        let (mut inputs, mut accepted) = (0u64, 0u64);
        let mut outcomes = [0u64; 7];
        loop {
            let done = match budget {
                Some(b) => inputs % 1024 == 0 && started.elapsed() >= b,
                None => inputs >= 50_000,
            };
            if done {
                break;
            }
            let max = 1u64 << rng.random_range(0..12);
            let mut data = valid_stream(&mut rng, max);
            if inputs % 16 == 0 {
                let (frames, used) = split_frames(&data, max).expect("a valid stream splits");
                assert_eq!(used, data.len(), "seed {seed}, input {inputs}");
                accepted += frames.len() as u64;
            }
            for _ in 0..rng.random_range(1..=8) {
                mutate(&mut rng, &mut data, max);
            }
            outcomes[check(&data, max)] += 1;
            inputs += 1;
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "frame_campaign: seed {seed}, {inputs} mutated inputs in {secs:.1} s \
             ({:.0}/s), {accepted} frames of unmutated streams checked, no failure",
            inputs as f64 / secs
        );
        let names = [
            "accepted",
            "magic",
            "version",
            "kind",
            "reserved",
            "too long",
            "goodbye payload",
        ];
        for (name, n) in names.iter().zip(outcomes) {
            println!("  {name}: {n}");
        }
        // Every way a stream can end was reached, or the mutator has gone blind somewhere.
        if inputs >= 50_000 {
            assert!(outcomes.iter().all(|&n| n > 0), "{outcomes:?}");
        }
    }

    proptest::proptest! {
        /// The fuzz target's properties, on stable and in CI: arbitrary bytes never panic the
        /// decoder, never pass a payload over the limit, and accepted headers re-encode exactly.
        #[test]
        fn arbitrary_bytes_are_decoded_or_refused(
            data in proptest::collection::vec(proptest::num::u8::ANY, 0..200),
            seeded_header in proptest::bool::ANY,
            limit_shift in 0u32..40,
        ) {
            let mut data = data;
            if seeded_header && data.len() >= HEADER_LEN {
                // Start from a valid header so the later checks are reached, then let the
                // random tail corrupt what follows.
                let len = u64::from(data[HEADER_LEN - 1] % 64);
                data[..HEADER_LEN].copy_from_slice(&FrameHeader::data(tag(), len).encode());
            }
            let max = 1u64 << limit_shift;
            if let Ok(h) = FrameHeader::decode(&data, max) {
                proptest::prop_assert!(h.len <= max);
                proptest::prop_assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
            }
            if let Ok((frames, used)) = split_frames(&data, max) {
                let mut at = 0;
                for (h, payload) in frames {
                    proptest::prop_assert_eq!(payload.len() as u64, h.len);
                    at += HEADER_LEN + payload.len();
                }
                proptest::prop_assert_eq!(at, used);
            }
        }
    }
}
