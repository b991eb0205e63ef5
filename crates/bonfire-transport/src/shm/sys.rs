//! The few system calls the shared-memory lane needs: futex waits and wakes on a shared word,
//! and watching another process for its exit.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` holds `expected`, at most `timeout`. Returns early on a wake, a change of
/// the word or a signal; callers re-check what they wait for. The word lives in memory shared
/// between processes, so the futex is not the process-private kind.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: `word` is a valid, aligned 32-bit word for the duration of the call; the kernel
    // only reads it and `ts`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

#[cfg(test)]
thread_local! {
    /// Wake-up system calls this thread has made (tests only).
    pub(crate) static WAKES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Wakes every thread (of any process) sleeping on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    #[cfg(test)]
    WAKES.with(|w| w.set(w.get() + 1));
    // SAFETY: as in `futex_wait`; FUTEX_WAKE does not read the word.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Another process of this host, watched for its exit: a pidfd where the kernel has them (it
/// cannot be fooled by a reused pid), else the pid.
pub(crate) struct Process {
    pid: u32,
    pidfd: Option<std::os::fd::OwnedFd>,
}

impl Process {
    /// Watches `pid`; `None` if no such process is visible from here (another host, another pid
    /// namespace, or it has already exited).
    pub(crate) fn watch(pid: u32) -> Option<Process> {
        use std::os::fd::FromRawFd;
        let Ok(raw) = libc::pid_t::try_from(pid) else {
            return None;
        };
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
        if fd >= 0 {
            // SAFETY: the descriptor was just created and is owned by nobody else.
            let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
            return Some(Process {
                pid,
                pidfd: Some(pidfd),
            });
        }
        let p = Process { pid, pidfd: None };
        p.alive().then_some(p)
    }

    /// The watched pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process is still running (a zombie counts as exited).
    pub(crate) fn alive(&self) -> bool {
        use std::os::fd::AsRawFd;
        match &self.pidfd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, no wait.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                !(n > 0 && p.revents & libc::POLLIN != 0)
            }
            None => {
                // SAFETY: signal 0 only checks that the process exists.
                let r = unsafe { libc::kill(self.pid as libc::pid_t, 0) };
                r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
            }
        }
    }
}

/// This boot of this host: ranks that report different ones cannot share memory.
pub(crate) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_seen_to_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let p = Process::watch(child.id()).expect("a child is visible");
        assert!(p.alive());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!p.alive(), "a reaped child is gone");
        assert!(
            Process::watch(child.id()).is_none() || !Process::watch(child.id()).unwrap().alive()
        );
        assert!(Process::watch(std::process::id()).unwrap().alive());
    }

    #[test]
    fn a_futex_wait_ends_on_timeout_or_change() {
        let w = AtomicU32::new(1);
        let t = std::time::Instant::now();
        futex_wait(&w, 1, Duration::from_millis(20));
        assert!(t.elapsed() >= Duration::from_millis(15));
        let t = std::time::Instant::now();
        futex_wait(&w, 2, Duration::from_secs(5));
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "a changed word does not sleep"
        );
        futex_wake(&w);
    }
}
