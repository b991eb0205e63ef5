//! The job secret, per-job certificates, and the proofs peers exchange inside TLS.
//!
//! Every rank makes a fresh self-signed certificate when it starts. TLS (1.3, mutual) proves that
//! each end holds the private key of the certificate it shows; the rendezvous then pins those
//! certificates: rank 0 records the one each worker presented and hands the list to every worker,
//! and peer links refuse a certificate other than the pinned one. Who may join at all is decided
//! by the job secret: both ends send `HMAC-SHA256(key, role || exporter)`, where `exporter` is
//! keying material exported from the TLS session, so a proof cannot be replayed on another
//! connection and a man in the middle (two TLS sessions) cannot relay it.
//!
//! The `key` is not the secret itself but PBKDF2-HMAC-SHA256 of it ([`KDF_ROUNDS`] rounds): the
//! launcher's control channel is plaintext, so whoever records a proof there can test guesses of
//! the secret offline, and each guess then costs a whole derivation instead of one HMAC. A
//! random secret of 128 bits or more is out of reach either way; the derivation is for secrets
//! people chose.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use hmac::{Hmac, Mac};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use sha2::Sha256;

use super::error::SetupError;

/// Bytes in a proof.
pub(crate) const PROOF_LEN: usize = 32;

/// The role a dialling side proves in (a worker to rank 0, a higher rank to a lower one).
pub(crate) const ROLE_CLIENT: &[u8] = b"bonfire client proof";
/// The role an accepting side proves in.
pub(crate) const ROLE_SERVER: &[u8] = b"bonfire server proof";
/// The role a refusal is sealed in (over the session and the refusal's words).
pub(crate) const ROLE_REFUSAL: &[u8] = b"bonfire refusal seal";

/// PBKDF2 rounds from a job secret to the key proofs are made with. Every rank process and
/// launcher derives the key once when it starts, so this is start-up time (about 0.3 s on one
/// core of the 2-core machine of BENCHMARKS.md): a sixth of OWASP's 600,000 for
/// PBKDF2-HMAC-SHA256, which cost 1.6 s there. Changing it changes every proof: raise the
/// protocol versions with it.
pub const KDF_ROUNDS: u32 = 100_000;

/// The derivation's salt: fixed, so that every process of a job derives the same key without
/// exchanging anything first.
const KDF_SALT: &[u8] = b"bonfire job secret key v1";

/// A job's shared secret, and the key derived from it. Its `Debug` form never shows either.
#[derive(Clone)]
pub struct Secret {
    /// The secret as given, for child processes (which derive the key again).
    text: Arc<[u8]>,
    /// PBKDF2-HMAC-SHA256 of `text`: what proofs are made with.
    key: Arc<[u8; 32]>,
}

/// PBKDF2-HMAC-SHA256 of `secret` over `rounds` rounds, 32 bytes.
fn derive(secret: &[u8], rounds: u32) -> [u8; 32] {
    let mut key = [0u8; 32];
    pbkdf2::pbkdf2::<Hmac<Sha256>>(secret, KDF_SALT, rounds, &mut key);
    key
}

/// The key of `secret`, derived once per process (tests and the launcher make the same secret
/// many times). The cache is keyed by the secret's SHA-256.
fn key_of(secret: &[u8]) -> Arc<[u8; 32]> {
    use sha2::Digest;
    type Keys = Mutex<HashMap<[u8; 32], Arc<[u8; 32]>>>;
    static KEYS: OnceLock<Keys> = OnceLock::new();
    let id: [u8; 32] = Sha256::digest(secret).into();
    let keys = KEYS.get_or_init(Default::default);
    if let Some(key) = keys.lock().unwrap_or_else(|e| e.into_inner()).get(&id) {
        return key.clone();
    }
    let key = Arc::new(derive(secret, KDF_ROUNDS));
    keys.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, key.clone());
    key
}

/// Why a secret could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The secret file could not be read.
    #[error("cannot read the secret file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The secret is too short to be a secret.
    #[error(
        "the job secret{from} has {len} bytes; use at least 16 (for example `head -c 32 /dev/urandom | base64 > secret`)"
    )]
    TooShort {
        /// Where it came from, with a leading space, or empty.
        from: String,
        /// Its length.
        len: usize,
    },
}

impl Secret {
    /// Minimum length accepted.
    pub const MIN_LEN: usize = 16;

    /// A secret from bytes; surrounding ASCII whitespace (a trailing newline in a file) is
    /// ignored.
    pub fn new(bytes: &[u8]) -> Result<Secret, SecretError> {
        Self::from_source(bytes, String::new())
    }

    fn from_source(bytes: &[u8], from: String) -> Result<Secret, SecretError> {
        let trimmed = bytes.trim_ascii();
        if trimmed.len() < Self::MIN_LEN {
            return Err(SecretError::TooShort {
                from,
                len: trimmed.len(),
            });
        }
        Ok(Secret::of(trimmed))
    }

    /// Reads a secret file (its whole contents, whitespace-trimmed). A file other users may read
    /// is used, with a warning naming its mode: anyone who reads it can join the job.
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        let bytes = std::fs::read(path).map_err(|source| SecretError::Read {
            path: path.display().to_string(),
            source,
        })?;
        if let Some(warning) = exposed(path) {
            tracing::warn!("{warning}");
        }
        Self::from_source(&bytes, format!(" in {}", path.display()))
    }

    /// 32 random bytes, hex-encoded (so the secret can travel in an environment variable).
    pub fn generate() -> Secret {
        let bytes: [u8; 32] = rand::random();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Secret::of(hex.as_bytes())
    }

    fn of(text: &[u8]) -> Secret {
        Secret {
            key: key_of(text),
            text: text.into(),
        }
    }

    /// The secret as text, for handing to child processes through the environment. Only
    /// meaningful for secrets that are text (generated ones are).
    pub fn expose_text(&self) -> String {
        String::from_utf8_lossy(&self.text).into_owned()
    }

    /// `HMAC-SHA256(key, role || exporter)`: proof that the sender holds the secret, bound to
    /// `role` (who proves) and `exporter` (material unique to one session, so that a recorded
    /// proof cannot be replayed in another).
    pub fn proof(&self, role: &[u8], exporter: &[u8]) -> [u8; PROOF_LEN] {
        let mut mac = self.mac();
        mac.update(role);
        mac.update(exporter);
        mac.finalize().into_bytes().into()
    }

    /// Checks a [`proof`](Secret::proof) in constant time.
    pub fn verify(&self, role: &[u8], exporter: &[u8], proof: &[u8]) -> bool {
        let mut mac = self.mac();
        mac.update(role);
        mac.update(exporter);
        mac.verify_slice(proof).is_ok()
    }

    fn mac(&self) -> Hmac<Sha256> {
        <Hmac<Sha256> as Mac>::new_from_slice(&self.key[..]).expect("HMAC takes keys of any length")
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes, redacted)", self.text.len())
    }
}

/// This rank's certificate and key, made fresh for the job.
pub(crate) struct Identity {
    pub(crate) cert: CertificateDer<'static>,
    pub(crate) key: PrivateKeyDer<'static>,
}

impl Identity {
    pub(crate) fn generate() -> Result<Identity, SetupError> {
        let certified =
            rcgen::generate_simple_self_signed(vec!["bonfire".to_string()]).map_err(|e| {
                SetupError::Certificate {
                    source: Arc::new(e),
                }
            })?;
        Ok(Identity {
            cert: certified.cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into()),
        })
    }
}

/// Accepts any certificate whose holder proves possession of its key; which certificate is
/// acceptable is decided after the handshake, against the rendezvous' pins and the secret.
#[derive(Debug)]
pub(crate) struct PinAfterHandshake(pub(crate) Arc<CryptoProvider>);

impl ServerCertVerifier for PinAfterHandshake {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("bonfire speaks TLS 1.3 only".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

impl ClientCertVerifier for PinAfterHandshake {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        ServerCertVerifier::verify_tls12_signature(self, message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        ServerCertVerifier::verify_tls13_signature(self, message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Why the secret file at `path` is readable by more than its owner, if it is: group or others
/// may read it (a volume of secrets mounted with its default mode, a file written without
/// `umask 077`). Not an error: the book's recipes say how to make it private.
pub(crate) fn exposed(path: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then(|| {
        format!(
            "the job secret file {} can be read by other users (mode {mode:03o}): anyone who \
             reads it can join this job; `chmod 600` it",
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The derivation is PBKDF2-HMAC-SHA256 (the published vectors for "password" and "salt"),
    /// and proofs are made with its key: a proof keyed with the secret itself, as before the
    /// derivation, or with a derivation of fewer rounds, is refused. So checking one guess of the
    /// secret against a recorded proof costs `KDF_ROUNDS` rounds.
    #[test]
    fn proofs_are_keyed_by_a_slow_derivation_of_the_secret() {
        let vector = |rounds| {
            let mut out = [0u8; 32];
            pbkdf2::pbkdf2::<Hmac<Sha256>>(b"password", b"salt", rounds, &mut out);
            hex(&out)
        };
        assert_eq!(
            vector(1),
            "120fb6cffcf8b32c43e7225256c4f837a86548c92ccc35480805987cb70be17b"
        );
        assert_eq!(
            vector(4096),
            "c5e478d59288c841aa530db6845c4c8d962893a001ce4e11a4963873aa98134a"
        );
        let text = b"0123456789abcdef-a-chosen-secret";
        let started = std::time::Instant::now();
        let secret = Secret::new(text).unwrap();
        let cost = started.elapsed();
        assert_eq!(*secret.key, derive(text, KDF_ROUNDS));
        let (role, exporter) = (ROLE_CLIENT, b"exported keying material");
        assert!(secret.verify(role, exporter, &secret.proof(role, exporter)));
        let keyed = |key: &[u8]| {
            let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
            mac.update(role);
            mac.update(exporter);
            mac.finalize().into_bytes()
        };
        assert!(!secret.verify(role, exporter, &keyed(text)));
        assert!(!secret.verify(role, exporter, &keyed(&derive(text, KDF_ROUNDS / 2))));
        assert!(secret.verify(role, exporter, &keyed(&derive(text, KDF_ROUNDS))));
        // Made again, the key comes from the process's cache.
        let again = std::time::Instant::now();
        let same = Secret::new(text).unwrap();
        assert_eq!(same.key, secret.key);
        eprintln!(
            "one derivation ({KDF_ROUNDS} rounds): {cost:?}; from the cache: {:?}",
            again.elapsed()
        );
        assert_eq!(format!("{secret:?}"), "Secret(32 bytes, redacted)");
    }

    #[test]
    fn a_secret_file_others_can_read_is_named() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("bonfire-secret-{}", std::process::id()));
        std::fs::write(&path, b"0123456789abcdef-job-secret\n").unwrap();
        for (mode, warned) in [(0o600, false), (0o400, false), (0o640, true), (0o644, true)] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let w = exposed(&path);
            assert_eq!(w.is_some(), warned, "mode {mode:o}: {w:?}");
            if let Some(w) = w {
                assert!(
                    w.contains(&format!("mode {mode:03o}")) && w.contains("chmod 600"),
                    "{w}"
                );
            }
            assert!(Secret::from_file(&path).is_ok(), "mode {mode:o}");
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn proofs_bind_secret_role_and_session() {
        let a = Secret::new(b"0123456789abcdef-job-a").unwrap();
        let b = Secret::new(b"0123456789abcdef-job-b").unwrap();
        let p = a.proof(b"client", b"session-1");
        assert!(a.verify(b"client", b"session-1", &p));
        assert!(!b.verify(b"client", b"session-1", &p), "another secret");
        assert!(!a.verify(b"server", b"session-1", &p), "another role");
        assert!(!a.verify(b"client", b"session-2", &p), "another session");
        assert!(!a.verify(b"client", b"session-1", &p[..31]), "truncated");
    }

    #[test]
    fn secrets_are_trimmed_checked_and_redacted() {
        assert!(matches!(
            Secret::new(b"short\n"),
            Err(SecretError::TooShort { len: 5, .. })
        ));
        let s = Secret::new(b"  0123456789abcdef\n").unwrap();
        assert_eq!(s.expose_text(), "0123456789abcdef");
        assert!(!format!("{s:?}").contains("0123"));
        let g = Secret::generate();
        assert_eq!(g.expose_text().len(), 64);
        assert_ne!(g.expose_text(), Secret::generate().expose_text());
    }
}
