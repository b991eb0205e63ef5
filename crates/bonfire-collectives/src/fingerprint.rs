//! What every rank says about a collective before taking part, so that ranks that called
//! different things find out at once instead of exchanging garbage or hanging.

use std::fmt;

use bonfire_topology::{DType, GroupId, ReduceOp};

use crate::Algorithm;

/// The kind of collective, with its reduce operation where it has one.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// All-reduce.
    AllReduce(ReduceOp),
    /// Reduce-scatter.
    ReduceScatter(ReduceOp),
    /// All-gather.
    AllGather,
    /// Broadcast.
    Broadcast,
    /// Reduce to a root.
    Reduce(ReduceOp),
    /// Barrier.
    Barrier,
    /// A matched send and receive.
    PointToPoint,
}

impl OpKind {
    fn codes(self) -> (u8, u8) {
        match self {
            OpKind::AllReduce(op) => (0, op.code()),
            OpKind::ReduceScatter(op) => (1, op.code()),
            OpKind::AllGather => (2, 0),
            OpKind::Broadcast => (3, 0),
            OpKind::Reduce(op) => (4, op.code()),
            OpKind::Barrier => (5, 0),
            OpKind::PointToPoint => (6, 0),
        }
    }

    fn from_codes(kind: u8, op: u8) -> Option<OpKind> {
        let op = ReduceOp::from_code(op);
        Some(match kind {
            0 => OpKind::AllReduce(op?),
            1 => OpKind::ReduceScatter(op?),
            2 => OpKind::AllGather,
            3 => OpKind::Broadcast,
            4 => OpKind::Reduce(op?),
            5 => OpKind::Barrier,
            6 => OpKind::PointToPoint,
            _ => return None,
        })
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpKind::AllReduce(op) => write!(f, "all_reduce({op})"),
            OpKind::ReduceScatter(op) => write!(f, "reduce_scatter({op})"),
            OpKind::AllGather => f.write_str("all_gather"),
            OpKind::Broadcast => f.write_str("broadcast"),
            OpKind::Reduce(op) => write!(f, "reduce({op})"),
            OpKind::Barrier => f.write_str("barrier"),
            OpKind::PointToPoint => f.write_str("send/recv"),
        }
    }
}

/// Identity of one collective call: two ranks take part in the same exchange only if their
/// fingerprints are equal.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    /// The group.
    pub group: GroupId,
    /// The call's sequence number in the group (for send/recv: in the ordered pair).
    pub seq: u64,
    /// What was called.
    pub op: OpKind,
    /// The element type.
    pub dtype: DType,
    /// Elements in the working buffer (all-gather: the gathered total; reduce-scatter: the input).
    pub count: u64,
    /// The root's index in the group (broadcast, reduce; the sender for send/recv).
    pub root: Option<u32>,
    /// The algorithm that runs, after [`Algorithm::Auto`] was resolved.
    pub algorithm: Algorithm,
    /// The communicator's chunk size.
    pub chunk_bytes: u32,
    /// A hash of the per-rank element counts (uneven all-gather and reduce-scatter), else 0.
    pub layout: u64,
}

const MAGIC: [u8; 4] = *b"BFP1";
/// Encoded length of a fingerprint.
pub(crate) const ENCODED_LEN: usize = 48;

impl Fingerprint {
    /// Little-endian, fixed-length encoding.
    pub(crate) fn encode(&self) -> [u8; ENCODED_LEN] {
        let mut out = [0u8; ENCODED_LEN];
        let (kind, op) = self.op.codes();
        out[0..4].copy_from_slice(&MAGIC);
        out[4..12].copy_from_slice(&self.group.0.to_le_bytes());
        out[12..20].copy_from_slice(&self.seq.to_le_bytes());
        out[20] = kind;
        out[21] = op;
        out[22] = self.dtype.code();
        out[23] = self.algorithm.code();
        out[24..28].copy_from_slice(&self.root.unwrap_or(u32::MAX).to_le_bytes());
        out[28..36].copy_from_slice(&self.count.to_le_bytes());
        out[36..40].copy_from_slice(&self.chunk_bytes.to_le_bytes());
        out[40..48].copy_from_slice(&self.layout.to_le_bytes());
        out
    }

    /// Decodes [`Fingerprint::encode`]'s output; says what is wrong with anything else.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Fingerprint, String> {
        if bytes.len() != ENCODED_LEN {
            return Err(format!(
                "a fingerprint is {ENCODED_LEN} bytes, this one {}",
                bytes.len()
            ));
        }
        if bytes[0..4] != MAGIC {
            return Err("the fingerprint has a bad magic number".into());
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let op = OpKind::from_codes(bytes[20], bytes[21])
            .ok_or_else(|| format!("unknown operation code {}/{}", bytes[20], bytes[21]))?;
        let dtype = DType::from_code(bytes[22])
            .ok_or_else(|| format!("unknown dtype code {}", bytes[22]))?;
        let algorithm = Algorithm::from_code(bytes[23])
            .ok_or_else(|| format!("unknown algorithm code {}", bytes[23]))?;
        let root = match u32_at(24) {
            u32::MAX => None,
            r => Some(r),
        };
        Ok(Fingerprint {
            group: GroupId(u64_at(4)),
            seq: u64_at(12),
            op,
            dtype,
            algorithm,
            root,
            count: u64_at(28),
            chunk_bytes: u32_at(36),
            layout: u64_at(40),
        })
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} #{} of {} x {}",
            self.op, self.seq, self.count, self.dtype
        )?;
        if let Some(root) = self.root {
            write!(f, " root {root}")?;
        }
        write!(f, " [{}", self.algorithm)?;
        if self.layout != 0 {
            write!(f, ", counts {:08x}", self.layout as u32)?;
        }
        write!(f, ", chunk {} B] on {}", self.chunk_bytes, self.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_garbage() {
        let fp = Fingerprint {
            group: GroupId::WORLD,
            seq: 42,
            op: OpKind::Reduce(ReduceOp::Max),
            dtype: DType::BF16,
            count: 1 << 33,
            root: Some(3),
            algorithm: Algorithm::Tree,
            chunk_bytes: 1 << 20,
            layout: 0xdead_beef,
        };
        assert_eq!(Fingerprint::decode(&fp.encode()), Ok(fp));
        let none = Fingerprint { root: None, ..fp };
        assert_eq!(Fingerprint::decode(&none.encode()), Ok(none));
        assert!(Fingerprint::decode(&fp.encode()[..47]).is_err());
        let mut bad = fp.encode();
        bad[22] = 99;
        assert!(Fingerprint::decode(&bad).unwrap_err().contains("dtype"));
        bad = fp.encode();
        bad[0] = b'X';
        assert!(Fingerprint::decode(&bad).is_err());
        assert_eq!(
            fp.to_string(),
            "reduce(max) #42 of 8589934592 x bf16 root 3 [tree, counts deadbeef, chunk 1048576 B] on world"
        );
    }
}
