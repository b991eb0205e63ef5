//! The per-epoch progress line of rank 0: redrawn in place on a terminal, a line at each quarter
//! otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

pub(crate) struct Progress {
    epoch: usize,
    epochs: usize,
    steps: usize,
    start: Instant,
    last_draw: Option<Instant>,
    tty: bool,
    next_quarter: usize,
}

impl Progress {
    pub(crate) fn new(epoch: usize, epochs: usize, steps: usize) -> Progress {
        Progress {
            epoch,
            epochs,
            steps,
            start: Instant::now(),
            last_draw: None,
            tty: std::io::stdout().is_terminal(),
            next_quarter: 1,
        }
    }

    /// After step `done` (1-based): the running loss and accuracy on this rank's batches, and
    /// images per second over all ranks.
    pub(crate) fn step(&mut self, done: usize, loss: f64, accuracy: f64, images_per_second: f64) {
        let now = Instant::now();
        let finished = done == self.steps;
        let line = || {
            let width = 24;
            let filled = width * done / self.steps.max(1);
            let elapsed = self.start.elapsed().as_secs_f64();
            let eta = elapsed / done.max(1) as f64 * (self.steps - done) as f64;
            format!(
                "epoch {}/{} [{}{}] {:>3}% step {done}/{}  loss {loss:.4}  accuracy {:.1}%  \
                 {images_per_second:.0} images/s  eta {}",
                self.epoch,
                self.epochs,
                "#".repeat(filled),
                "-".repeat(width - filled),
                100 * done / self.steps.max(1),
                self.steps,
                100.0 * accuracy,
                clock(Duration::from_secs_f64(eta)),
            )
        };
        let mut out = std::io::stdout().lock();
        if self.tty {
            if finished
                || self
                    .last_draw
                    .is_none_or(|t| now - t > Duration::from_millis(200))
            {
                let _ = write!(out, "\r{}\x1b[K", line());
                if finished {
                    let _ = writeln!(out);
                }
                let _ = out.flush();
                self.last_draw = Some(now);
            }
        } else if done * 4 >= self.next_quarter * self.steps {
            while done * 4 >= self.next_quarter * self.steps {
                self.next_quarter += 1;
            }
            let _ = writeln!(out, "{}", line());
        }
    }
}

/// `m:ss`, or `h:mm:ss` from an hour.
pub(crate) fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}
