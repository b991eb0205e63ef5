//! Rank 0's progress through an epoch ([`StepProgress`]) and the line [`crate::Console`] draws
//! from it: redrawn in place on a terminal, a line at each quarter otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Where rank 0 stands after a step of an epoch.
#[derive(Clone, Debug, PartialEq)]
pub struct StepProgress {
    /// What the job's round is called on the line: `epoch` (the GPT job: `eval`, the stretch
    /// of steps up to an evaluation).
    pub round: &'static str,
    /// The epoch, from 1.
    pub epoch: usize,
    /// Epochs in the run.
    pub epochs: usize,
    /// Steps done in this epoch, from 1.
    pub step: usize,
    /// Steps in the epoch.
    pub steps: usize,
    /// The running mean loss on this rank's batches.
    pub loss: f64,
    /// The running accuracy on this rank's batches, for jobs that measure one.
    pub accuracy: Option<f64>,
    /// Items per second over all ranks since the epoch began.
    pub rate: f64,
    /// What an item is, plural (`images`, `tokens`).
    pub unit: &'static str,
    /// Time since the epoch began.
    pub elapsed: Duration,
    /// The straggler named after the last epoch, shortly (`rank 1 +38% (compute)`), if any.
    pub straggler: Option<String>,
}

impl StepProgress {
    /// The progress line: `epoch 1/3 [######------------------]  25% step 4/16  loss 0.5123
    /// accuracy 84.2%  1234 images/s  eta 0:12`.
    pub fn line(&self) -> String {
        let (done, steps) = (self.step, self.steps);
        let width = 24;
        let filled = width * done / steps.max(1);
        let eta =
            self.elapsed.as_secs_f64() / done.max(1) as f64 * steps.saturating_sub(done) as f64;
        let accuracy = match self.accuracy {
            Some(a) => format!("  accuracy {:.1}%", 100.0 * a),
            None => String::new(),
        };
        let straggler = match &self.straggler {
            Some(s) => format!("  straggler {s}"),
            None => String::new(),
        };
        format!(
            "{} {}/{} [{}{}] {:>3}% step {done}/{steps}  loss {:.4}{accuracy}  {:.0} {}/s  eta {}{straggler}",
            self.round,
            self.epoch,
            self.epochs,
            "#".repeat(filled),
            "-".repeat(width - filled),
            100 * done / steps.max(1),
            self.loss,
            self.rate,
            self.unit,
            clock(Duration::from_secs_f64(eta)),
        )
    }
}

/// Draws [`StepProgress`] lines on standard output: in place on a terminal (at most five times
/// a second, and at the end of the epoch), otherwise one line per quarter of the epoch.
#[derive(Debug)]
pub(crate) struct ProgressLine {
    tty: bool,
    epoch: Option<usize>,
    last_draw: Option<Instant>,
    next_quarter: usize,
}

impl ProgressLine {
    pub(crate) fn new() -> ProgressLine {
        ProgressLine {
            tty: std::io::stdout().is_terminal(),
            epoch: None,
            last_draw: None,
            next_quarter: 1,
        }
    }

    pub(crate) fn draw(&mut self, p: &StepProgress) {
        if self.epoch != Some(p.epoch) || p.step == 1 {
            self.epoch = Some(p.epoch);
            self.last_draw = None;
            self.next_quarter = 1;
        }
        let now = Instant::now();
        let finished = p.step == p.steps;
        let mut out = std::io::stdout().lock();
        if self.tty {
            if finished
                || self
                    .last_draw
                    .is_none_or(|t| now - t > Duration::from_millis(200))
            {
                let _ = write!(out, "\r{}\x1b[K", p.line());
                if finished {
                    let _ = writeln!(out);
                }
                let _ = out.flush();
                self.last_draw = Some(now);
            }
        } else if p.step * 4 >= self.next_quarter * p.steps {
            while p.step * 4 >= self.next_quarter * p.steps {
                self.next_quarter += 1;
            }
            let _ = writeln!(out, "{}", p.line());
        }
    }
}

/// `m:ss`, or `h:mm:ss` from an hour.
pub fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_reads_as_before() {
        let p = StepProgress {
            round: "epoch",
            epoch: 1,
            epochs: 3,
            step: 4,
            steps: 16,
            loss: 0.51234,
            accuracy: Some(0.8421),
            rate: 1234.4,
            unit: "images",
            elapsed: Duration::from_secs(4),
            straggler: None,
        };
        assert_eq!(
            p.line(),
            "epoch 1/3 [######------------------]  25% step 4/16  loss 0.5123  accuracy 84.2%  \
             1234 images/s  eta 0:12"
        );
        let q = StepProgress {
            accuracy: None,
            unit: "tokens",
            ..p
        };
        assert!(
            q.line().contains("loss 0.5123  1234 tokens/s"),
            "{}",
            q.line()
        );
        assert_eq!(clock(Duration::from_secs(3725)), "1:02:05");
    }
}
