//! Control messages of the rendezvous and of peer links: postcard, behind a 4-byte length.
//!
//! Control messages are small and rare, so they use a maintained serde format; tensor payloads
//! never pass through here (see `frame`).

use std::fmt::Display;
use std::net::SocketAddr;
use std::time::Duration;

use quinn::{Connection, RecvStream, SendStream, VarInt};
use serde::{Deserialize, Serialize};

use super::auth::{PROOF_LEN, ROLE_REFUSAL, Secret};
use super::endpoint::exporter;

/// The control protocol's version; a mismatch is refused with both versions named. 2: proofs
/// are keyed by a slow derivation of the secret ([`super::auth::KDF_ROUNDS`]). 3: refusals are
/// sealed ([`seal`]).
pub(crate) const PROTOCOL: u32 = 3;

/// The largest control message accepted (a roster of thousands of ranks fits).
pub(crate) const MAX_CONTROL: usize = 16 << 20;
/// The largest first message of an accepted connection (a hello, before any proof): a stranger
/// cannot make a rank read or decode more.
pub(crate) const MAX_HELLO: usize = 4 << 10;

/// Application close codes.
pub(crate) const CLOSE_SHUTDOWN: u32 = 0;
pub(crate) const CLOSE_REFUSED: u32 = 1;
pub(crate) const CLOSE_BAD_FRAME: u32 = 2;
pub(crate) const CLOSE_DROPPED: u32 = 3;

/// What identifies one launch of one job: ranks of different jobs or of different restart rounds
/// refuse each other.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct JobKey {
    pub(crate) world_size: u32,
    pub(crate) round: u32,
}

#[derive(Serialize, Deserialize, Debug)]
pub(crate) enum Control {
    /// Worker to rendezvous: who I am, where I listen, my proof.
    Hello {
        protocol: u32,
        job: JobKey,
        /// The rank the worker was given, or `None` to be assigned one.
        rank: Option<u32>,
        node: u32,
        /// The port this rank's endpoint listens on.
        port: u16,
        /// An address to advertise instead of the one the rendezvous sees.
        advertise: Option<SocketAddr>,
        proof: [u8; PROOF_LEN],
    },
    /// Rendezvous to worker: the rendezvous' proof and the worker's rank; the roster follows
    /// when everyone has joined.
    Welcome { proof: [u8; PROOF_LEN], rank: u32 },
    /// Either side: refused, and why, sealed by the refusing side ([`seal`]): only a process
    /// holding the job secret can seal a refusal, so one that does not check is a stranger's
    /// word (or another job's), and a worker does not give up on it.
    Reject {
        reason: String,
        seal: [u8; PROOF_LEN],
    },
    /// Rendezvous to worker: every rank's address, node and pinned certificate.
    Roster { peers: Vec<PeerEntry> },
    /// Worker to worker, on a direct link: who I am and my proof.
    PeerHello {
        protocol: u32,
        job: JobKey,
        rank: u32,
        proof: [u8; PROOF_LEN],
    },
    /// Worker to worker: accepted, and my proof.
    PeerWelcome { proof: [u8; PROOF_LEN] },
}

impl Control {
    /// The message's name, for error messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Control::Hello { .. } => "hello",
            Control::Welcome { .. } => "welcome",
            Control::Reject { .. } => "reject",
            Control::Roster { .. } => "roster",
            Control::PeerHello { .. } => "peer-hello",
            Control::PeerWelcome { .. } => "peer-welcome",
        }
    }

    /// The error of receiving this message where another was due.
    pub(crate) fn unexpected(&self) -> Unexpected {
        Unexpected(self.name())
    }
}

/// A control message arrived where another was due.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unexpected {0} message")]
pub(crate) struct Unexpected(pub(crate) &'static str);

/// Why a control message could not be sent or received.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ControlError {
    /// The bytes are not a control message.
    #[error("malformed control message: {0}")]
    Malformed(postcard::Error),
    /// The message could not be written.
    #[error("cannot send {message}: {source}")]
    Send {
        /// The message's name.
        message: &'static str,
        source: quinn::WriteError,
    },
    /// The stream ended (or failed) before a message began.
    #[error("connection ended before a control message: {0}")]
    EndedBefore(quinn::ReadExactError),
    /// The length prefix announces more than a control message may hold.
    #[error("control message of {len} bytes exceeds the limit of {limit} bytes")]
    TooLong { len: usize, limit: usize },
    /// The stream ended (or failed) inside a message.
    #[error("connection ended inside a control message: {0}")]
    EndedInside(quinn::ReadExactError),
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct PeerEntry {
    pub(crate) rank: u32,
    pub(crate) node: u32,
    pub(crate) addr: SocketAddr,
    pub(crate) cert: Vec<u8>,
}

/// Encodes a message with its length prefix.
pub(crate) fn encode(msg: &Control) -> Vec<u8> {
    let body = postcard::to_stdvec(msg).expect("control messages always serialise");
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Decodes one message body (without the length prefix).
pub(crate) fn decode(body: &[u8]) -> Result<Control, ControlError> {
    postcard::from_bytes(body).map_err(ControlError::Malformed)
}

/// Writes one message with its length prefix.
pub(crate) async fn write(stream: &mut SendStream, msg: &Control) -> Result<(), ControlError> {
    stream
        .write_all(&encode(msg))
        .await
        .map_err(|source| ControlError::Send {
            message: msg.name(),
            source,
        })
}

/// Reads one message; a length over [`MAX_CONTROL`] is refused before anything is allocated.
pub(crate) async fn read(stream: &mut RecvStream) -> Result<Control, ControlError> {
    read_at_most(stream, MAX_CONTROL).await
}

/// Reads one control message of at most `limit` bytes (a longer one is refused unread).
pub(crate) async fn read_at_most(
    stream: &mut RecvStream,
    limit: usize,
) -> Result<Control, ControlError> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .await
        .map_err(ControlError::EndedBefore)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > limit {
        return Err(ControlError::TooLong { len, limit });
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .await
        .map_err(ControlError::EndedInside)?;
    decode(&body)
}

/// The seal of a refusal: the job secret's proof over the session (`exporter`) and the
/// refusal's words, so that neither can be replaced or replayed in another session.
pub(crate) fn seal(secret: &Secret, exporter: &[u8], reason: &str) -> [u8; PROOF_LEN] {
    secret.proof(ROLE_REFUSAL, &[exporter, reason.as_bytes()].concat())
}

/// Whether a refusal was sealed by a process holding `secret`, in this session.
pub(crate) fn sealed(secret: &Secret, exporter: &[u8], reason: &str, seal: &[u8]) -> bool {
    secret.verify(ROLE_REFUSAL, &[exporter, reason.as_bytes()].concat(), seal)
}

/// A refusal, sealed with `secret` for the session of `conn` (unsealed, all zeros, in the
/// unlikely case that the session has no keying material: the peer then treats it as a
/// stranger's).
pub(crate) fn reject(conn: &Connection, secret: &Secret, reason: String) -> Control {
    let seal = exporter(conn).map_or([0; PROOF_LEN], |ex| seal(secret, &ex, &reason));
    Control::Reject { reason, seal }
}

/// Refuses the peer at the other end of `conn`: sends `Reject` with the reason in words, sealed
/// with `secret`, gives it a moment to be read, and closes the connection. Returns the reason,
/// for the caller's error.
pub(crate) async fn refuse<R: Display>(
    conn: &Connection,
    secret: &Secret,
    mut send: SendStream,
    reason: R,
) -> R {
    let msg = encode(&reject(conn, secret, reason.to_string()));
    let _ = send.write_all(&msg).await;
    let _ = send.finish();
    let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
    conn.close(VarInt::from_u32(CLOSE_REFUSED), b"refused");
    reason
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seal checks only with the secret, the session and the words it was made for.
    #[test]
    fn a_seal_binds_secret_session_and_words() {
        let s = Secret::new(b"the job secret, 0123456789").unwrap();
        let other = Secret::new(b"another secret, 0123456789").unwrap();
        let (ex, ex2) = ([1u8; 32], [2u8; 32]);
        let sealed_here = seal(&s, &ex, "world size mismatch");
        assert!(sealed(&s, &ex, "world size mismatch", &sealed_here));
        assert!(!sealed(&s, &ex2, "world size mismatch", &sealed_here));
        assert!(!sealed(&s, &ex, "world size mismatch!", &sealed_here));
        assert!(!sealed(&other, &ex, "world size mismatch", &sealed_here));
        assert!(!sealed(&s, &ex, "world size mismatch", &[0; PROOF_LEN]));
    }

    #[test]
    fn round_trips_and_refuses_garbage() {
        let msg = Control::Roster {
            peers: vec![PeerEntry {
                rank: 3,
                node: 1,
                addr: "10.0.0.2:29501".parse().unwrap(),
                cert: vec![1, 2, 3],
            }],
        };
        let wire = encode(&msg);
        let Control::Roster { peers } = decode(&wire[4..]).unwrap() else {
            panic!("wrong variant");
        };
        assert_eq!(peers[0].rank, 3);
        assert_eq!(peers[0].addr.port(), 29501);
        assert!(decode(&[0xff, 0xff, 0xff]).is_err());
        assert!(decode(&[]).is_err());
        assert!(
            decode(&[])
                .unwrap_err()
                .to_string()
                .starts_with("malformed control message: ")
        );
        // A huge length inside a vector must not allocate it: postcard checks against the input.
        assert!(decode(&[3, 0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
    }
}
