//! Steps a [`Program`] over a working buffer. Sans-IO: the caller moves the frames (the async
//! driver over a transport, or the simulator over a simulated network).

use std::ops::Range;

use bonfire_topology::{DType, ReduceOp};

use crate::reducer::Reducer;
use crate::schedule::{Apply, Instr, Program};

/// The arithmetic of one call.
pub(crate) struct Arith<'a> {
    pub(crate) dtype: DType,
    /// The reduction (any value for collectives that do not reduce).
    pub(crate) op: ReduceOp,
    /// The group size, for means.
    pub(crate) group_size: usize,
    pub(crate) reducer: &'a dyn Reducer,
}

impl Arith<'_> {
    fn bytes(&self, range: &Range<usize>) -> Range<usize> {
        let s = self.dtype.size();
        range.start * s..range.end * s
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
        buf: &mut [u8],
        arith: &Arith<'_>,
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
                        arith
                            .reducer
                            .divide(arith.dtype, &mut buf[range], arith.group_size);
                    }
                }
            }
        }
    }

    /// Applies the frame the program waits for and returns where to forward it. A frame of the
    /// wrong size is refused with a description.
    pub(crate) fn deliver<'p>(
        &mut self,
        program: &'p Program,
        buf: &mut [u8],
        frame: &[u8],
        arith: &Arith<'_>,
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
        match apply {
            Apply::Copy => buf[bytes].copy_from_slice(frame),
            Apply::Reduce(order) => {
                arith
                    .reducer
                    .combine(arith.dtype, arith.op, *order, &mut buf[bytes], frame)
            }
        }
        self.pc += 1;
        Ok(forward)
    }
}
