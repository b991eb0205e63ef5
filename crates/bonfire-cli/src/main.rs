//! The `bonfire` command: `launch`, `train`, `bench` and `doctor`.

mod bench;
mod doctor;
mod error;
#[cfg(test)]
mod errors_quoted;
mod host_profile;
mod launch;
mod size;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Distributed training for Burn.
#[derive(Parser)]
#[command(name = "bonfire", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start this node's ranks of a job (torchrun-style) and watch them.
    Launch(launch::Args),
    /// Train a bundled model (`bonfire train vision`, `bonfire train gpt`).
    #[command(subcommand)]
    Train(Box<train::Train>),
    /// Measure bonfire against the machine it runs on.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Check what this machine has for bonfire, with a fix for each missing piece.
    Doctor(doctor::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let logging = match cli.command {
        // The launcher is no rank, even where Slurm's SLURM_PROCID says it is a task.
        Command::Launch(_) => bonfire::launch::logging::init_logging_with_prefix(String::new()),
        _ => bonfire::init_logging(),
    };
    if let Err(e) = logging {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    #[cfg(feature = "host-profile")]
    let profile = host_profile::start();
    let result = match cli.command {
        Command::Launch(args) => launch::run(args),
        Command::Train(train) => train.run(),
        Command::Bench(bench) => bench.run(),
        Command::Doctor(args) => doctor::run(args),
    };
    #[cfg(feature = "host-profile")]
    if let Some(profile) = profile {
        profile.finish();
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}
