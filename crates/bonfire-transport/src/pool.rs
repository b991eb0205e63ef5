//! Recycled frame buffers.
//!
//! Every frame a rank sends is a fresh copy of part of its working buffer, and every frame the
//! shared-memory lane receives a fresh copy out of its ring. Allocating those copies afresh costs
//! more than the copies: allocations of a megabyte come straight from the kernel, zeroed page by
//! page, and go back to it on free, so a 64 MiB all-reduce spent most of its time in page
//! faults. Frames of 4 KiB and more are therefore cut from buffers kept in power-of-two size
//! classes and returned to their class when the last reference to the frame drops. Each class
//! keeps at most [`CLASS_BYTES`] bytes of idle buffers.

use std::sync::Mutex;

use bytes::Bytes;

/// Frames smaller than this are plain allocations (the allocator serves them well).
const MIN_POOLED: usize = 4 << 10;
/// Largest class: 1 GiB.
const CLASSES: usize = 31;
/// Idle bytes kept per class.
const CLASS_BYTES: usize = 64 << 20;

static POOL: [Mutex<Vec<Vec<u8>>>; CLASSES] = [const { Mutex::new(Vec::new()) }; CLASSES];

fn class(len: usize) -> Option<usize> {
    let class = len.next_power_of_two().trailing_zeros() as usize;
    (len >= MIN_POOLED && class < CLASSES).then_some(class)
}

/// A frame holding a copy of `src`.
pub fn frame(src: &[u8]) -> Bytes {
    filled(src.len(), |buf| buf.extend_from_slice(src))
}

/// A frame of about `len` bytes written by `fill`, which appends them to an empty buffer with
/// room for at least `len`.
pub fn filled(len: usize, fill: impl FnOnce(&mut Vec<u8>)) -> Bytes {
    let Some(class) = class(len) else {
        let mut buf = Vec::with_capacity(len);
        fill(&mut buf);
        return Bytes::from(buf);
    };
    let recycled = crate::lock(&POOL[class]).pop();
    let mut buf = recycled.unwrap_or_else(|| Vec::with_capacity(1 << class));
    buf.clear();
    fill(&mut buf);
    Bytes::from_owner(Pooled { buf, class })
}

struct Pooled {
    buf: Vec<u8>,
    class: usize,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut idle = crate::lock(&POOL[self.class]);
        if (idle.len() + 1) * buf.capacity() <= CLASS_BYTES.max(buf.capacity()) {
            idle.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_copies_and_buffers_come_back() {
        let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let a = frame(&src);
        assert_eq!(&a[..], &src[..]);
        let ptr = a.as_ptr();
        drop(a);
        let b = frame(&src[..9000]);
        assert_eq!(&b[..], &src[..9000]);
        assert_eq!(b.as_ptr(), ptr, "the buffer of a dropped frame is reused");
        let small = frame(&src[..100]);
        assert_eq!(&small[..], &src[..100]);
        assert_eq!(class(4096), Some(12));
        assert_eq!(class(4097), Some(13));
        assert_eq!(class(100), None);
    }
}
