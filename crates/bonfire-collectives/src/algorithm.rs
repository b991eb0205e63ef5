use std::fmt;
use std::time::Duration;

/// How a collective moves data. [`Algorithm::Auto`] picks by message size (see [`CommConfig`]);
/// any other value forces that algorithm, and a collective that does not implement it fails with
/// [`crate::CollectiveError::UnsupportedAlgorithm`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Pick by size: latency-optimal schedules for small buffers, bandwidth-optimal for large.
    #[default]
    Auto,
    /// Chunked, pipelined ring: `2(n-1)` steps, each link carries `(n-1)/n` of the data per phase.
    /// Bandwidth-optimal. All-reduce, reduce-scatter, all-gather, broadcast (a pipelined chain)
    /// and reduce.
    Ring,
    /// Recursive doubling: `log2 n` rounds exchanging the whole buffer. Latency-optimal for
    /// all-reduce; for all-gather, each round doubles the gathered block.
    RecursiveDoubling,
    /// Recursive halving then doubling (Rabenseifner): `2 log2 n` rounds moving `2(n-1)/n` of
    /// the data. All-reduce and reduce-scatter.
    HalvingDoubling,
    /// Binomial tree: `ceil(log2 n)` rounds. Broadcast and reduce.
    Tree,
    /// Two levels, for jobs on several nodes. With as many ranks on every node: reduce-scatter
    /// within each node, all-reduce of each segment across nodes (every rank crosses the network
    /// with `1/ranks-per-node` of the buffer), all-gather within each node. Otherwise: reduce to
    /// one leader per node, all-reduce among the leaders, broadcast within each node. All-reduce.
    Hierarchical,
}

impl Algorithm {
    /// Every algorithm, in code order.
    pub const ALL: [Algorithm; 6] = [
        Algorithm::Auto,
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::HalvingDoubling,
        Algorithm::Tree,
        Algorithm::Hierarchical,
    ];

    /// The one-byte code used in fingerprints.
    pub const fn code(self) -> u8 {
        match self {
            Algorithm::Auto => 0,
            Algorithm::Ring => 1,
            Algorithm::RecursiveDoubling => 2,
            Algorithm::HalvingDoubling => 3,
            Algorithm::Tree => 4,
            Algorithm::Hierarchical => 5,
        }
    }

    /// The algorithm of a code.
    pub fn from_code(code: u8) -> Option<Algorithm> {
        Algorithm::ALL.get(code as usize).copied()
    }

    /// The kebab-case name (`ring`, `halving-doubling`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "recursive-doubling",
            Algorithm::HalvingDoubling => "halving-doubling",
            Algorithm::Tree => "tree",
            Algorithm::Hierarchical => "hierarchical",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Algorithm::ALL.iter().map(|a| a.name()).collect();
                format!(
                    "unknown algorithm `{s}` (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Settings of a communicator. Every rank of a group must use the same values for
/// `chunk_bytes`, `small_bytes` and `large_bytes` (they shape the schedule; a difference is
/// reported as a fingerprint mismatch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommConfig {
    /// How long any single wait (for a frame, for a peer to arrive) may take before the
    /// collective fails with [`crate::CollectiveError::Timeout`]. Default 300 s; the environment
    /// variable `BONFIRE_TIMEOUT` (seconds) overrides the default.
    pub timeout: Duration,
    /// The largest frame, in bytes; larger transfers are cut into pieces and pipelined.
    /// Default 1 MiB.
    pub chunk_bytes: usize,
    /// With [`Algorithm::Auto`], all-reduces up to this many bytes use recursive doubling; and
    /// a collective of at most this many bytes sends its first frames from the calling thread
    /// before the call returns (larger ones start on the communication runtime). Default 32 KiB.
    pub small_bytes: usize,
    /// With [`Algorithm::Auto`], buffers of at least this many bytes use the ring.
    /// Default 1 MiB.
    pub large_bytes: usize,
}

impl Default for CommConfig {
    fn default() -> Self {
        let timeout = std::env::var("BONFIRE_TIMEOUT")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(Duration::from_secs(300));
        CommConfig {
            timeout,
            chunk_bytes: 1 << 20,
            small_bytes: 32 << 10,
            large_bytes: 1 << 20,
        }
    }
}
