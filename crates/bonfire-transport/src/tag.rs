use std::fmt;

/// The routing label of a frame.
///
/// `context` names a conversation (a communication group, a point-to-point channel), `seq` one
/// exchange within it (a collective's sequence number), `step` one frame of that exchange. The
/// transport does not interpret the fields; the mailbox matches on all three.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tag {
    /// The conversation.
    pub context: u64,
    /// The exchange within the conversation.
    pub seq: u64,
    /// The frame within the exchange.
    pub step: u32,
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "context {:016x} seq {} step {:#x}",
            self.context, self.seq, self.step
        )
    }
}
