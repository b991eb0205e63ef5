//! Steps a [`Program`] over a working buffer. Sans-IO: the caller moves the frames (the async
//! driver over a transport, or the simulator over a simulated network).

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use bonfire_topology::{DType, ReduceOp};

use crate::reducer::Reducer;
use crate::schedule::{Apply, Instr, Program};

/// The arithmetic of one call.
pub(crate) struct Arith {
    pub(crate) dtype: DType,
    /// The reduction (any value for collectives that do not reduce).
    pub(crate) op: ReduceOp,
    /// The group size, for means.
    pub(crate) group_size: usize,
    pub(crate) reducer: Arc<dyn Reducer>,
}

impl Arith {
    /// The bytes of an element range.
    pub(crate) fn bytes(&self, range: &Range<usize>) -> Range<usize> {
        let s = self.dtype.size();
        range.start * s..range.end * s
    }
}

/// The working buffer of one call. The thread running the program and the lanes that write
/// expected frames straight into it (see `driver`) share it, each touching only its own ranges:
/// a lane writes the range of a receive that no instruction before that receive reads or writes,
/// and the program does not touch that range until the lane is done with it. So it is held as a
/// pointer, and every access names its range.
pub(crate) struct Span<'a> {
    ptr: *mut u8,
    len: usize,
    _buf: PhantomData<&'a mut [u8]>,
}

// SAFETY: a Span is a `&mut [u8]` split by range; every access to a range is unsafe and
// documents why nothing else touches that range meanwhile.
unsafe impl Send for Span<'_> {}
// SAFETY: as above.
unsafe impl Sync for Span<'_> {}

impl<'a> Span<'a> {
    pub(crate) fn new(buf: &'a mut [u8]) -> Span<'a> {
        Span {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _buf: PhantomData,
        }
    }

    /// The start of `range`, for a writer that other threads use.
    pub(crate) fn at(&self, range: &Range<usize>) -> *mut u8 {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: in bounds, checked above.
        unsafe { self.ptr.add(range.start) }
    }

    /// Reads `range`.
    ///
    /// # Safety
    /// Nothing may write `range` while the slice lives.
    pub(crate) unsafe fn get(&self, range: Range<usize>) -> &[u8] {
        // SAFETY: in bounds (`at` checks); nothing writes it, by the caller's promise.
        unsafe { std::slice::from_raw_parts(self.at(&range), range.len()) }
    }

    /// Writes `range`.
    ///
    /// # Safety
    /// Nothing else may read or write `range` while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn get_mut(&self, range: Range<usize>) -> &mut [u8] {
        // SAFETY: in bounds (`at` checks); exclusive, by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.at(&range), range.len()) }
    }
}

/// What the program needs next.
pub(crate) enum Action<'p> {
    /// Send a copy of the working buffer's `bytes` to every `(peer, step)`.
    Send {
        bytes: Range<usize>,
        to: &'p [(u32, u32)],
    },
    /// Wait for frame `step` from group member `from`, then call [`Executor::deliver`].
    Await { from: u32, step: u32 },
    /// The program is complete.
    Done,
}

/// A position in a program.
#[derive(Default)]
pub(crate) struct Executor {
    pc: usize,
}

impl Executor {
    /// Index of the next instruction.
    pub(crate) fn position(&self) -> usize {
        self.pc
    }

    /// Runs local instructions until the program sends, waits or ends.
    pub(crate) fn next<'p>(
        &mut self,
        program: &'p Program,
        buf: &Span<'_>,
        arith: &Arith,
    ) -> Action<'p> {
        loop {
            let Some(instr) = program.instrs.get(self.pc) else {
                return Action::Done;
            };
            match instr {
                Instr::Send { range, to } => {
                    self.pc += 1;
                    return Action::Send {
                        bytes: arith.bytes(range),
                        to,
                    };
                }
                Instr::Recv { from, step, .. } => {
                    return Action::Await {
                        from: *from,
                        step: *step,
                    };
                }
                Instr::Finalize { range } => {
                    self.pc += 1;
                    if arith.op == ReduceOp::Mean {
                        let range = arith.bytes(range);
                        // SAFETY: no lane writes a range an instruction before its receive
                        // touches, and this instruction comes before every receive not yet run.
                        let acc = unsafe { buf.get_mut(range) };
                        arith.reducer.divide(arith.dtype, acc, arith.group_size);
                    }
                }
            }
        }
    }

    /// Moves past the receive the program waits at, whose frame a lane already wrote into the
    /// buffer; returns the receive's range in bytes and where to forward the frame.
    pub(crate) fn received_in_place<'p>(
        &mut self,
        program: &'p Program,
        arith: &Arith,
    ) -> (Range<usize>, &'p [(u32, u32)]) {
        let Some(Instr::Recv { range, forward, .. }) = program.instrs.get(self.pc) else {
            panic!("the program does not wait for a frame");
        };
        self.pc += 1;
        (arith.bytes(range), forward)
    }

    /// Applies the frame the program waits for and returns where to forward it. A frame of the
    /// wrong size is refused with a description.
    pub(crate) fn deliver<'p>(
        &mut self,
        program: &'p Program,
        buf: &Span<'_>,
        frame: &[u8],
        arith: &Arith,
    ) -> Result<&'p [(u32, u32)], String> {
        let Some(Instr::Recv {
            range,
            apply,
            forward,
            ..
        }) = program.instrs.get(self.pc)
        else {
            panic!("deliver() called while the program does not wait for a frame");
        };
        let bytes = arith.bytes(range);
        if frame.len() != bytes.len() {
            return Err(format!(
                "{} bytes where {} ({} x {}) were expected",
                frame.len(),
                bytes.len(),
                range.len(),
                arith.dtype
            ));
        }
        // SAFETY: this receive's range is the lane's only until the driver withdrew the sink
        // expecting it, which it does before delivering a frame that did not go there.
        let acc = unsafe { buf.get_mut(bytes) };
        match apply {
            Apply::Copy => acc.copy_from_slice(frame),
            Apply::Reduce(order) => {
                arith
                    .reducer
                    .combine(arith.dtype, arith.op, *order, acc, frame)
            }
        }
        self.pc += 1;
        Ok(forward)
    }
}
