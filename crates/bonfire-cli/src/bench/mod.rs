//! `bonfire bench ...`.

mod collectives;
mod kernels;
mod link;
mod pp;
mod tp;
mod wan;

use clap::Subcommand;

use crate::error::CliError;

/// What to measure.
#[derive(Subcommand)]
pub(crate) enum Bench {
    /// Time a collective per buffer size: latency, algorithm and bus bandwidth (nccl-tests
    /// definitions), next to this machine's memcpy bandwidth for the same bytes.
    Collectives(collectives::Args),
    /// Time the fused gradient kernels against Burn tensor ops and the device's copy bandwidth.
    Kernels(kernels::Args),
    /// Measure the link itself on this host: TCP and raw QUIC (quinn, TLS) throughput over
    /// 127.0.0.1, the ceiling for the QUIC transport.
    Link(link::Args),
    /// Train the bundled GPT split over 1, 2, 4 ... tensor-parallel ranks of this host: step
    /// time, memory per rank, and communication against Megatron-LM's for the same shapes.
    Tp(tp::Args),
    /// Train the bundled GPT split into 1, 2, 4 ... pipeline stages on this host, under each
    /// schedule and number of micro-batches: step time, each stage's idle time against the
    /// bubble's formula, what it held, and the first step's loss.
    Pp(pp::Args),
    /// Run a job over two "sites" on this host, two network namespaces whose only path is a
    /// slow link made here: a round-trip delay, random loss and a bandwidth cap in each
    /// direction. One `bonfire launch` per site; prints what crossed the link. Needs root.
    Wan(wan::Args),
}

impl Bench {
    pub(crate) fn run(self) -> Result<(), CliError> {
        match self {
            Bench::Collectives(args) => collectives::run(args),
            Bench::Link(args) => link::run(args),
            Bench::Kernels(args) => kernels::run(args),
            Bench::Tp(args) => tp::run(args),
            Bench::Pp(args) => pp::run(args),
            Bench::Wan(args) => wan::run(args),
        }
    }
}

/// A bar on standard error over a benchmark's sizes, drawn only when the table on standard
/// output goes to a file or a pipe and standard error is a terminal (on a terminal the rows
/// themselves show the progress; in logs nothing is drawn).
pub(crate) fn sizes_bar(sizes: usize, quiet: bool) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if quiet || std::io::stdout().is_terminal() || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(sizes as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    // A constant template: it parses, so the fallback is never taken.
    let style = indicatif::ProgressStyle::with_template(
        "{spinner} measuring {msg:>9} [{bar:24}] {pos}/{len} sizes  {elapsed}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style.progress_chars("#>-"));
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}
