//! bonfire's log output: the library crates emit `tracing` events, and [`init_logging`] installs
//! the subscriber that prints them on standard error, each line prefixed with the rank.
//!
//! What is shown is an `EnvFilter` read from `BONFIRE_LOG`, else `RUST_LOG`, else [`DEFAULT`]
//! (bonfire's own messages, warnings from everything else): `BONFIRE_LOG=debug` turns on every
//! crate's debug events, `BONFIRE_LOG=bonfire_transport=trace,bonfire_collectives=debug` the
//! frames of the transport and each collective call, without rebuilding.

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The filter when neither `BONFIRE_LOG` nor `RUST_LOG` is set: bonfire's informational
/// messages (a launcher's nodes joining, a restart) and every crate's warnings and errors, except
/// CubeCL's warning that two processes tuned the same kernel shape: the ranks of a job share one
/// autotune cache (`bonfire_jobs::kernel_cache`), tune a new shape at the same
/// time, and the first verdict written is kept, so each such shape printed a screenful.
pub const DEFAULT: &str = "warn,bonfire=info,bonfire_launch=info,bonfire_transport=info,\
                           bonfire_collectives=info,bonfire_backend=info,bonfire_train=info,\
                           bonfire_jobs=info,bonfire_cli=info,\
                           cubecl_runtime::tune::tune_cache=error";

/// Why the log filter could not be used.
#[derive(Debug, thiserror::Error)]
#[error(
    "{var}={value:?} is not a log filter ({why}); write e.g. {var}=debug or {var}=bonfire_transport=trace"
)]
pub struct LogFilterError {
    /// The variable it came from.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What the parser said.
    pub why: String,
}

/// The filter from `BONFIRE_LOG`, else `RUST_LOG`, else [`DEFAULT`].
pub fn filter_from_env() -> Result<EnvFilter, LogFilterError> {
    for var in ["BONFIRE_LOG", "RUST_LOG"] {
        if let Ok(value) = std::env::var(var)
            && !value.trim().is_empty()
        {
            return EnvFilter::builder()
                .parse(&value)
                .map_err(|e| LogFilterError {
                    var,
                    value,
                    why: e.to_string(),
                });
        }
    }
    Ok(EnvFilter::new(DEFAULT))
}

/// The prefix of this process' lines: `[rank R] ` when `RANK` (or Slurm's `SLURM_PROCID`) names
/// it one rank of several, else nothing (and nothing when `bonfire launch` prefixes the rank's
/// lines itself).
pub fn rank_prefix() -> String {
    if std::env::var(crate::env::vars::OUTPUT_PREFIXED).is_ok_and(|v| v == "1") {
        return String::new();
    }
    let var = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| std::env::var(n).ok()?.trim().parse::<usize>().ok())
    };
    let world = var(&["WORLD_SIZE", "SLURM_NTASKS"]).unwrap_or(1);
    match var(&["RANK", "SLURM_PROCID"]) {
        Some(rank) if world > 1 => format!("[rank {rank}] "),
        _ => String::new(),
    }
}

/// Installs bonfire's subscriber for this process (the filter from the environment, the rank
/// prefix, standard error), unless the program installed one of its own first, and returns
/// whether it did. A bad filter is an error; the program goes on without logs only if it
/// chooses to.
pub fn init_logging() -> Result<bool, LogFilterError> {
    init_logging_with_prefix(rank_prefix())
}

/// [`init_logging`] with a prefix of the caller's for every line (`bonfire launch` has none: it
/// is no rank, even as a task of an `srun` step, where `SLURM_PROCID` is set).
pub fn init_logging_with_prefix(prefix: String) -> Result<bool, LogFilterError> {
    let filter = filter_from_env()?;
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .event_format(RankFormat { prefix })
        .try_init()
        .is_ok();
    Ok(installed)
}

pub use bonfire_transport::fatal;

/// One line per event: the rank prefix, the level (none for information, `warning:` and
/// `error:` as a compiler writes them, the level and the target for debug and trace), the
/// message and its fields.
struct RankFormat {
    prefix: String,
}

impl<S, N> FormatEvent<S, N> for RankFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        write!(writer, "{}", self.prefix)?;
        match *meta.level() {
            Level::INFO => {}
            Level::WARN => write!(writer, "warning: ")?,
            Level::ERROR => write!(writer, "error: ")?,
            level => write!(writer, "{} {}: ", level, meta.target())?,
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_filter_parses_and_a_bad_one_is_named() {
        EnvFilter::builder().parse(DEFAULT).unwrap();
        let e = EnvFilter::builder()
            .parse("bonfire_transport=loud")
            .unwrap_err();
        let err = LogFilterError {
            var: "BONFIRE_LOG",
            value: "bonfire_transport=loud".into(),
            why: e.to_string(),
        };
        assert!(
            err.to_string()
                .starts_with("BONFIRE_LOG=\"bonfire_transport=loud\" is not a log filter")
        );
    }

    #[test]
    fn the_default_filter_drops_cubecl_s_duplicate_tuning_warning_only() {
        use std::sync::{Arc, Mutex};
        let seen = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = seen.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::new(DEFAULT))
            .with_writer(move || WriteTo(sink.clone()))
            .event_format(RankFormat {
                prefix: String::new(),
            })
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "cubecl_runtime::tune::tune_cache", "tuned twice");
            tracing::warn!(target: "cubecl_runtime::tune::tuner", "another warning");
            tracing::info!(target: "cubecl_runtime::tune::tuner", "information");
        });
        let text = String::from_utf8(seen.lock().unwrap().clone()).unwrap();
        assert_eq!(text, "warning: another warning\n");
    }

    struct WriteTo(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for WriteTo {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
