//! `bonfire bench ...`.

mod collectives;

use clap::Subcommand;

/// What to measure.
#[derive(Subcommand)]
pub(crate) enum Bench {
    /// Time a collective per buffer size: latency, algorithm and bus bandwidth (nccl-tests
    /// definitions), next to this machine's memcpy bandwidth for the same bytes.
    Collectives(collectives::Args),
}

impl Bench {
    pub(crate) fn run(self) -> Result<(), String> {
        match self {
            Bench::Collectives(args) => collectives::run(args),
        }
    }
}
