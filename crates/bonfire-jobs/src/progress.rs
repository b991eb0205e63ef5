//! Rank 0's progress through an epoch ([`StepProgress`]) and the line [`crate::Console`] draws
//! from it: an `indicatif` bar on a terminal, a line at each quarter otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

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
        format!(
            "{} {}/{} [{}{}] {:>3}% step {done}/{steps}  {}  eta {}{}",
            self.round,
            self.epoch,
            self.epochs,
            "#".repeat(filled),
            "-".repeat(width - filled),
            100 * done / steps.max(1),
            self.measures(),
            clock(Duration::from_secs_f64(eta)),
            self.straggler_note(),
        )
    }

    /// The figures of the line: `loss 0.5123  accuracy 84.2%  1234 images/s`, and the
    /// straggler after them on a bar (where the eta comes last).
    fn figures(&self) -> String {
        format!("{}{}", self.measures(), self.straggler_note())
    }

    fn measures(&self) -> String {
        let accuracy = match self.accuracy {
            Some(a) => format!("  accuracy {:.1}%", 100.0 * a),
            None => String::new(),
        };
        format!(
            "loss {:.4}{accuracy}  {:.0} {}/s",
            self.loss, self.rate, self.unit
        )
    }

    fn straggler_note(&self) -> String {
        match &self.straggler {
            Some(s) => format!("  straggler {s}"),
            None => String::new(),
        }
    }
}

/// Draws rank 0's progress on standard output: an `indicatif` bar redrawn in place on a terminal
/// (a new bar each epoch, left on screen when the epoch ends), otherwise one plain
/// [`StepProgress::line`] per quarter of the epoch (logs, CI).
#[derive(Debug)]
pub(crate) struct ProgressLine {
    tty: bool,
    epoch: Option<usize>,
    bar: Option<ProgressBar>,
    next_quarter: usize,
}

impl ProgressLine {
    pub(crate) fn new() -> ProgressLine {
        ProgressLine {
            tty: std::io::stdout().is_terminal(),
            epoch: None,
            bar: None,
            next_quarter: 1,
        }
    }

    pub(crate) fn draw(&mut self, p: &StepProgress) {
        if self.epoch != Some(p.epoch) || p.step == 1 {
            self.epoch = Some(p.epoch);
            self.next_quarter = 1;
            if let Some(old) = self.bar.take() {
                old.abandon();
            }
            if self.tty {
                self.bar = Some(new_bar(p));
            }
        }
        if let Some(bar) = &self.bar {
            bar.set_length(p.steps as u64);
            bar.set_position(p.step as u64);
            bar.set_message(p.figures());
            if p.step >= p.steps {
                bar.finish();
                self.bar = None;
            }
        } else if !self.tty && p.step * 4 >= self.next_quarter * p.steps {
            while p.step * 4 >= self.next_quarter * p.steps {
                self.next_quarter += 1;
            }
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", p.line());
        }
    }

    /// Prints `text` on its own line, above the bar if one is drawn.
    pub(crate) fn println(&self, text: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("{text}")),
            None => println!("{text}"),
        }
    }
}

fn new_bar(p: &StepProgress) -> ProgressBar {
    let bar =
        ProgressBar::with_draw_target(Some(p.steps as u64), ProgressDrawTarget::stdout_with_hz(5));
    // A constant template: it parses, so the fallback is never taken.
    let style = ProgressStyle::with_template(
        "{prefix} [{bar:24.cyan/blue}] {percent:>3}% step {pos}/{len}  {msg}  eta {eta}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("#>-");
    bar.set_style(style);
    bar.set_prefix(format!("{} {}/{}", p.round, p.epoch, p.epochs));
    bar
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
