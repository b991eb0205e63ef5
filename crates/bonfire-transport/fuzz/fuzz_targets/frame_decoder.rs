//! Feeds arbitrary bytes to the frame decoder: it must never panic, never accept a payload over
//! the limit, and every header it accepts must encode back to the bytes it came from.
//!
//! Run with `cargo +nightly fuzz run frame_decoder` from `crates/bonfire-transport`.
#![no_main]

use bonfire_transport::fuzzing::{FrameHeader, HEADER_LEN, split_frames};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The limit comes from the input too, so small and large limits are both explored.
    let max = data.first().map_or(0, |&b| 1u64 << (b % 40));
    let data = data.get(1..).unwrap_or_default();
    if let Ok(h) = FrameHeader::decode(data, max) {
        assert!(h.len <= max);
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
    }
    if let Ok((frames, used)) = split_frames(data, max) {
        assert!(used <= data.len());
        let mut at = 0;
        for (h, payload) in frames {
            assert_eq!(payload.len() as u64, h.len);
            at += HEADER_LEN + payload.len();
        }
        assert_eq!(at, used);
    }
});
