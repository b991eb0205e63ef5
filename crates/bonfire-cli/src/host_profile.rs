//! A sampling profile of this process's own threads, for machines without `perf` (the GPU
//! machines bonfire is measured on have none): built with `--features host-profile`, run with
//! `BONFIRE_HOST_PROFILE=PREFIX`, and the process writes `PREFIX.PID.folded` when the command ends,
//! one line per distinct stack, `thread;outermost;...;innermost COUNT`, the format flame-graph
//! tools read and `benches/gpu/host_profile.py` sums per thread and per function.
//!
//! Samples come from `setitimer(ITIMER_PROF)` (pprof-rs): the kernel interrupts whichever thread
//! is using the CPU, so a thread's share of the samples is its share of the process's CPU time,
//! and a thread that waits is not sampled. `BONFIRE_HOST_PROFILE_HZ` asks for a rate (default 499
//! a second), but the kernel checks a process's CPU timer at its tick, so on the machines measured
//! about 250 samples a second arrive in all; the file's counts are what arrived.
//! `BONFIRE_HOST_PROFILE_AFTER=SECONDS` starts sampling that long after the process starts, so
//! that a job's kernel compilation and loading can be left out of the window. Samples inside
//! libc, libgcc, pthread and the vDSO are left out unless `BONFIRE_HOST_PROFILE_ALL=1` (see
//! `sample`).

// Only `folded` (and its test) is compiled without the feature, so that CI's ordinary test run
// checks the file format; the sampler needs pprof.
#![cfg_attr(not(feature = "host-profile"), allow(dead_code))]

#[cfg(feature = "host-profile")]
use std::io::Write;
#[cfg(feature = "host-profile")]
use std::sync::mpsc;
#[cfg(feature = "host-profile")]
use std::thread::JoinHandle;
#[cfg(feature = "host-profile")]
use std::time::Duration;

#[cfg(feature = "host-profile")]
/// The sampler's thread; [`HostProfile::finish`] stops it and writes the file.
pub(crate) struct HostProfile {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

#[cfg(feature = "host-profile")]
/// Starts sampling when `BONFIRE_HOST_PROFILE` is set; `None` otherwise. A bad rate or delay is
/// reported and sampling is skipped: the command itself runs either way.
pub(crate) fn start() -> Option<HostProfile> {
    let prefix = std::env::var_os("BONFIRE_HOST_PROFILE")?;
    let settings = || -> Result<(i32, Duration), String> {
        let hz = number("BONFIRE_HOST_PROFILE_HZ", 499.0)?;
        if !(1.0..=10_000.0).contains(&hz) {
            return Err(format!("BONFIRE_HOST_PROFILE_HZ={hz} is not in 1..=10000"));
        }
        let after = number("BONFIRE_HOST_PROFILE_AFTER", 0.0)?;
        let after = Duration::try_from_secs_f64(after).map_err(|_| {
            format!("BONFIRE_HOST_PROFILE_AFTER={after} is not a number of seconds")
        })?;
        Ok((hz as i32, after))
    };
    let (hz, after) = match settings() {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("host profile: {e}; not sampling");
            return None;
        }
    };
    let path = format!("{}.{}.folded", prefix.to_string_lossy(), std::process::id());
    let (stop, stopped) = mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("host-profile".into())
        .spawn(move || sample(&path, hz, after, &stopped))
        .ok()?;
    Some(HostProfile { stop, thread })
}

#[cfg(feature = "host-profile")]
impl HostProfile {
    /// Stops sampling and writes the folded stacks.
    pub(crate) fn finish(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

#[cfg(feature = "host-profile")]
fn number(name: &str, default: f64) -> Result<f64, String> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .map_err(|_| format!("{name}={v:?} is not a number")),
    }
}

#[cfg(feature = "host-profile")]
fn sample(path: &str, hz: i32, after: Duration, stopped: &mpsc::Receiver<()>) {
    if !after.is_zero() && stopped.recv_timeout(after) != Err(mpsc::RecvTimeoutError::Timeout) {
        eprintln!("host profile: the command ended before BONFIRE_HOST_PROFILE_AFTER; no samples");
        return;
    }
    // A sample that lands in these libraries is dropped and the stack is cut where it enters
    // them: unwinding there from the signal handler can deadlock (pprof-rs's advice), at the cost
    // of not seeing time in `malloc`, `free` or locks. BONFIRE_HOST_PROFILE_ALL=1 samples them too.
    let all = std::env::var_os("BONFIRE_HOST_PROFILE_ALL").is_some_and(|v| v == "1");
    let blocked: &[&str] = if all {
        &[]
    } else {
        &["libc", "libgcc", "pthread", "vdso"]
    };
    let builder = pprof::ProfilerGuardBuilder::default()
        .frequency(hz)
        .blocklist(blocked);
    let guard = match builder.build() {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("host profile: cannot start sampling: {e}");
            return;
        }
    };
    let started = std::time::Instant::now();
    let _ = stopped.recv();
    let report = match guard.report().build() {
        Ok(report) => report,
        Err(e) => {
            eprintln!("host profile: cannot build the report: {e}");
            return;
        }
    };
    drop(guard);
    let stacks = report.data.iter().map(|(frames, &count)| {
        let names = frames
            .frames
            .iter()
            .rev()
            .flat_map(|inlined| inlined.iter().rev().map(|symbol| symbol.name()));
        (frames.thread_name_or_id(), names.collect::<Vec<_>>(), count)
    });
    let text = folded(stacks);
    let written = std::fs::File::create(path).and_then(|mut f| f.write_all(text.as_bytes()));
    match written {
        Ok(()) => {
            let samples = report.data.values().sum::<isize>();
            let seconds = started.elapsed().as_secs_f64();
            eprintln!(
                "host profile: {samples} samples over {seconds:.1} s ({:.0} a second; {hz} asked) in {path}",
                samples as f64 / seconds.max(1e-9)
            )
        }
        Err(e) => eprintln!("host profile: cannot write {path}: {e}"),
    }
}

/// The folded-stack text: one line per stack, `thread;outermost;...;innermost COUNT`, sorted.
/// A `;` or a line break inside a name would split it, so each becomes a `:` or a space.
fn folded(stacks: impl Iterator<Item = (String, Vec<String>, isize)>) -> String {
    let clean = |s: &str| s.replace(';', ":").replace(['\n', '\r'], " ");
    let mut lines: Vec<String> = stacks
        .map(|(thread, frames, count)| {
            let mut line = clean(&thread).replace(' ', "_");
            for frame in &frames {
                line.push(';');
                line.push_str(&clean(frame));
            }
            format!("{line} {count}")
        })
        .collect();
    lines.sort();
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::folded;

    #[test]
    fn folded_stacks_name_the_thread_first_and_keep_separators_out_of_names() {
        let text = folded(
            vec![
                (
                    "DSD-0-0".to_string(),
                    vec!["main".into(), "launch<T; U>".into()],
                    7,
                ),
                ("train thread".to_string(), vec!["step".into()], 3),
            ]
            .into_iter(),
        );
        assert_eq!(text, "DSD-0-0;main;launch<T: U> 7\ntrain_thread;step 3\n");
    }
}
