//! Stragglers: each rank's time in an epoch's steps, split into input (making batches), compute
//! (forward, backward, optimizer) and wait (communication backward did not hide), gathered on
//! every rank after the epoch; a rank whose input plus compute exceeds the median of the other
//! ranks' by more than [`THRESHOLD`] (and [`MIN_EXCESS_SECS`]) is named, with the part that made
//! it slow.
//!
//! In a synchronous job the others wait for the slowest rank at every all-reduce, so a straggler
//! shows up twice: as its own long compute or input, and as the others' wait.

use serde::{Deserialize, Serialize};

/// How much slower than the median of the other ranks a rank must be to be named: 20%.
pub const THRESHOLD: f64 = 0.20;

/// And by how many seconds at least in the epoch: below that, an epoch is too short for its
/// timing to say anything.
pub const MIN_EXCESS_SECS: f64 = 0.1;

/// One rank's seconds in one epoch's training steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankTimes {
    /// Making batches (reading, decoding, moving to the device).
    pub input: f64,
    /// Forward, backward and the optimizer step, less the wait.
    pub compute: f64,
    /// Communication that backward did not hide: mostly waiting for the slowest rank.
    pub wait: f64,
}

impl RankTimes {
    /// The time the rank itself needed: input and compute.
    pub fn busy(&self) -> f64 {
        self.input + self.compute
    }

    /// Its three times, as a rank contributes them to an all-gather of every rank's.
    pub fn values(&self) -> Vec<f64> {
        vec![self.input, self.compute, self.wait]
    }

    /// Every rank's times from such an all-gather of [`RankTimes::values`], in rank order.
    pub fn from_gathered(all: &[f64]) -> Vec<RankTimes> {
        all.chunks_exact(3)
            .map(|c| RankTimes {
                input: c[0],
                compute: c[1],
                wait: c[2],
            })
            .collect()
    }
}

/// What made a straggler slow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Its forward, backward and optimizer steps.
    Compute,
    /// Its batches.
    Input,
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cause::Compute => "compute",
            Cause::Input => "input",
        })
    }
}

/// A rank slower than the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Straggler {
    /// The rank.
    pub rank: usize,
    /// How much slower than the median of the other ranks, as a fraction (0.38: 38% slower).
    pub slower: f64,
    /// What made it slow: the part where it exceeds the others' median most.
    pub cause: Cause,
    /// Its times.
    pub times: RankTimes,
    /// The median of the other ranks' times, part by part.
    pub others: RankTimes,
}

impl Straggler {
    /// `rank 1 is 38% slower than the median of the other ranks (compute 2.10 s against 1.52 s,
    /// input 0.12 s against 0.11 s); the others waited 0.61 s for it`.
    pub fn describe(&self) -> String {
        let (t, o) = (&self.times, &self.others);
        format!(
            "rank {} is {:.0}% slower than the median of the other ranks ({} {:.2} s against {:.2} s, {} {:.2} s against {:.2} s); the others waited {:.2} s",
            self.rank,
            100.0 * self.slower,
            self.cause,
            part(t, self.cause),
            part(o, self.cause),
            other(self.cause),
            part(t, other(self.cause)),
            part(o, other(self.cause)),
            o.wait,
        )
    }

    /// `rank 1 +38% (compute)`, for the progress line.
    pub fn short(&self) -> String {
        format!(
            "rank {} +{:.0}% ({})",
            self.rank,
            100.0 * self.slower,
            self.cause
        )
    }
}

fn part(t: &RankTimes, c: Cause) -> f64 {
    match c {
        Cause::Compute => t.compute,
        Cause::Input => t.input,
    }
}

fn other(c: Cause) -> Cause {
    match c {
        Cause::Compute => Cause::Input,
        Cause::Input => Cause::Compute,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The ranks of `times` (indexed by rank) slower than the median of the others by more than
/// `threshold`, slowest first.
pub fn stragglers(times: &[RankTimes], threshold: f64) -> Vec<Straggler> {
    let mut found = Vec::new();
    if times.len() < 2 {
        return found;
    }
    for (rank, t) in times.iter().enumerate() {
        let rest = || times.iter().enumerate().filter(move |(r, _)| *r != rank);
        let others = RankTimes {
            input: median(rest().map(|(_, o)| o.input).collect()),
            compute: median(rest().map(|(_, o)| o.compute).collect()),
            wait: median(rest().map(|(_, o)| o.wait).collect()),
        };
        let base = median(rest().map(|(_, o)| o.busy()).collect());
        if base <= 0.0 {
            continue;
        }
        let slower = t.busy() / base - 1.0;
        if slower > threshold && t.busy() - base >= MIN_EXCESS_SECS {
            let cause = if t.input - others.input > t.compute - others.compute {
                Cause::Input
            } else {
                Cause::Compute
            };
            found.push(Straggler {
                rank,
                slower,
                cause,
                times: *t,
                others,
            });
        }
    }
    found.sort_by(|a, b| b.slower.total_cmp(&a.slower));
    found
}

/// The end report's line on stragglers, from each epoch's (number, every rank's times):
/// `stragglers      rank 1 in epochs 2, 3 (compute; up to 41% slower than the median of the
/// others)`, or that there were none; `None` when no epoch timed more than one rank.
pub fn report_line<'a>(
    epochs: impl IntoIterator<Item = (usize, &'a [RankTimes])>,
) -> Option<String> {
    report_line_of(
        epochs
            .into_iter()
            .map(|(e, times)| (e, times, (0..times.len()).collect())),
    )
}

/// [`report_line`] where each epoch's times are those of the ranks its list names, in order (a
/// job that went on without some ranks): stragglers are named by those ranks.
pub fn report_line_of<'a>(
    epochs: impl IntoIterator<Item = (usize, &'a [RankTimes], Vec<usize>)>,
) -> Option<String> {
    let mut timed = false;
    // rank -> (epochs, worst, its cause)
    let mut by_rank: std::collections::BTreeMap<usize, (Vec<usize>, f64, Cause)> =
        std::collections::BTreeMap::new();
    for (epoch, times, ranks) in epochs {
        timed |= times.len() > 1;
        for s in stragglers(times, THRESHOLD) {
            let rank = ranks.get(s.rank).copied().unwrap_or(s.rank);
            let e = by_rank.entry(rank).or_insert((Vec::new(), 0.0, s.cause));
            e.0.push(epoch);
            if s.slower > e.1 {
                (e.1, e.2) = (s.slower, s.cause);
            }
        }
    }
    if !timed {
        return None;
    }
    if by_rank.is_empty() {
        return Some(format!(
            "stragglers      none (every rank within {:.0}% of the median of the others in every epoch)",
            100.0 * THRESHOLD
        ));
    }
    let parts: Vec<String> = by_rank
        .iter()
        .map(|(rank, (epochs, worst, cause))| {
            let list: Vec<String> = epochs.iter().map(|e| e.to_string()).collect();
            format!(
                "rank {rank} in epoch{} {} ({cause}; up to {:.0}% slower than the median of the others)",
                if epochs.len() == 1 { "" } else { "s" },
                list.join(", "),
                100.0 * worst
            )
        })
        .collect();
    Some(format!("stragglers      {}", parts.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(input: f64, compute: f64, wait: f64) -> RankTimes {
        RankTimes {
            input,
            compute,
            wait,
        }
    }

    #[test]
    fn times_round_trip_through_a_gather() {
        let ranks = [t(0.1, 2.0, 0.5), t(0.2, 3.0, 0.0)];
        let all: Vec<f64> = ranks.iter().flat_map(RankTimes::values).collect();
        assert_eq!(RankTimes::from_gathered(&all), ranks);
    }

    #[test]
    fn a_slow_rank_is_named_with_its_cause() {
        let times = [
            t(0.1, 1.0, 0.5),
            t(0.1, 1.6, 0.0),
            t(0.1, 1.05, 0.5),
            t(0.1, 0.95, 0.55),
        ];
        let s = stragglers(&times, THRESHOLD);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!((s[0].rank, s[0].cause), (1, Cause::Compute));
        assert!((s[0].slower - (1.7 / 1.1 - 1.0)).abs() < 1e-9);
        assert!(
            s[0].describe().starts_with(
                "rank 1 is 55% slower than the median of the other ranks (compute 1.60 s against 1.00 s, input 0.10 s against 0.10 s); the others waited 0.50 s"
            ),
            "{}",
            s[0].describe()
        );
        assert_eq!(s[0].short(), "rank 1 +55% (compute)");
        // Slow batches instead.
        let s = stragglers(&[t(0.1, 1.0, 0.4), t(0.9, 1.0, 0.0)], THRESHOLD);
        assert_eq!((s[0].rank, s[0].cause), (1, Cause::Input));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn the_report_names_each_straggler_once_with_its_epochs() {
        let slow = [t(0.1, 1.0, 0.5), t(0.1, 1.5, 0.0)];
        let even = [t(0.1, 1.0, 0.0), t(0.1, 1.0, 0.0)];
        let line = report_line([(1, &even[..]), (2, &slow[..]), (3, &slow[..])]).unwrap();
        assert_eq!(
            line,
            "stragglers      rank 1 in epochs 2, 3 (compute; up to 45% slower than the median of the others)"
        );
        let line = report_line([(1, &even[..])]).unwrap();
        assert!(line.starts_with("stragglers      none"), "{line}");
        assert_eq!(report_line([(1, &even[..1])]), None);
        // Epoch 3's times are ranks 0 and 2's (rank 1 gone): its slow second entry is rank 2.
        let line = report_line_of([(1, &even[..], vec![0, 1]), (3, &slow[..], vec![0, 2])]);
        assert_eq!(
            line.unwrap(),
            "stragglers      rank 2 in epoch 3 (compute; up to 45% slower than the median of the others)"
        );
    }

    #[test]
    fn ranks_within_the_threshold_and_lone_ranks_are_not_named() {
        assert!(stragglers(&[t(0.1, 1.0, 0.1), t(0.1, 1.15, 0.0)], THRESHOLD).is_empty());
        assert!(stragglers(&[t(0.1, 9.0, 0.0)], THRESHOLD).is_empty());
        // 50% slower, but by 0.05 s: too short an epoch to tell.
        assert!(stragglers(&[t(0.0, 0.1, 0.0), t(0.0, 0.15, 0.0)], THRESHOLD).is_empty());
        assert!(stragglers(&[], THRESHOLD).is_empty());
    }
}
