//! Per-step statistics of gradient synchronisation.

use std::collections::BTreeMap;
use std::time::Duration;

/// What one backward's gradient synchronisation cost on this rank (or, from [`total_stats`], the
/// sum over every step so far).
///
/// - `backward`: from the start of backward to the moment its last gradient was final.
/// - `communication`: time during which at least one bucket's all-reduce was in flight.
/// - `exposed`: communication time after backward had finished, which the step waited for (plus
///   writing the averaged gradients back).
/// - [`StepStats::hidden_fraction`] = 1 - exposed / communication: the share of communication
///   that backward hid.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Synchronised steps counted (1 for one step).
    pub steps: u64,
    /// Backward time (see the type docs).
    pub backward: Duration,
    /// Time with an all-reduce in flight.
    pub communication: Duration,
    /// Communication time not hidden by backward.
    pub exposed: Duration,
    /// Gradient bytes this rank's buckets held (in the communicated dtype, with one presence
    /// flag per parameter), all-reduced or reduce-scattered.
    pub bytes: u64,
    /// The bytes this rank received back reduced: every bucket whole when it is all-reduced;
    /// when buckets are reduce-scattered, under ZeRO stage 2 the gradients this rank owns and
    /// under stage 3 its slice of each gradient (and the gradients kept whole), with their
    /// presence flags. Over `n` ranks a ring sends each rank `2 (n - 1) / n` of a bucket for an
    /// all-reduce and `(n - 1) / n` for a reduce-scatter: half.
    pub received: u64,
    /// Buckets all-reduced.
    pub buckets: u64,
    /// Buckets whose gradients were packed on the device by the fused pack kernel (and crossed
    /// to the host in one transfer). 0 on host backends (Flex, NdArray), or with
    /// `BONFIRE_DEVICE_PACK=0`.
    pub device_packed: u64,
    /// Buckets all-reduced through the device lane (CUDA IPC between the processes of one
    /// host): they never crossed to the host. 0 off CUDA, or with `BONFIRE_DEVICE_LANE=0`.
    pub device_lane: u64,
    /// Each bucket's times, in bucket order (the order backward fills them and they are sent).
    /// For one step as measured; in [`total_stats`] summed over the steps that had this bucket
    /// plan (each entry's `steps` says how many: divide by it). Empty for the step that made the
    /// plan (the first synchronised backward, whose gradients are all read at its end).
    ///
    /// [`total_stats`]: crate::total_stats
    pub timeline: Vec<BucketTimes>,
    /// Who this rank waited for once its backward had ended: for each step whose last bucket
    /// was held up by a peer that had not yet called it, that peer (world rank) and how long
    /// past the end of backward this rank saw its call. Summed over steps in
    /// [`total_stats`](crate::total_stats).
    pub late_peers: BTreeMap<usize, LatePeer>,
}

/// A peer this rank waited for after its own backward (see [`StepStats::late_peers`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LatePeer {
    /// Steps in which it was the last to call the final bucket, past this rank's backward.
    pub steps: u64,
    /// The time waited for it in those steps.
    pub waited: Duration,
}

/// When one bucket became ready, was handed to the communicator, began to move and was done,
/// each measured from the start of backward. The gaps say where a bucket's exposed time goes:
/// `called - ready` is waiting behind an earlier bucket (buckets are sent in order), `started -
/// called` is scheduling (no thread ran the all-reduce yet), `peers - started` is waiting for the
/// slowest peer to call the same all-reduce (its backward is behind this rank's), and `finished -
/// peers` is moving and combining the data.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BucketTimes {
    /// Steps summed into this entry (1 for one step).
    pub steps: u64,
    /// Bytes the bucket's all-reduce moved (gradients and presence flags, in the sent dtype).
    pub bytes: u64,
    /// Its last gradient was final (for a bucket some of whose parameters got no gradient in
    /// this backward: backward's end; for one with no parameter in this backward's graph:
    /// backward's start, when it was called).
    pub ready: Duration,
    /// Its all-reduce was called.
    pub called: Duration,
    /// Its all-reduce began to run on some thread: its first frames left.
    pub started: Duration,
    /// This rank had seen that every peer had called the all-reduce.
    pub peers: Duration,
    /// Its all-reduce completed.
    pub finished: Duration,
}

impl BucketTimes {
    fn add(&mut self, other: &BucketTimes) {
        self.steps += other.steps;
        self.bytes += other.bytes;
        self.ready += other.ready;
        self.called += other.called;
        self.started += other.started;
        self.peers += other.peers;
        self.finished += other.finished;
    }
}

impl StepStats {
    /// The share of communication time hidden by backward, in [0, 1] (1 when nothing was sent).
    pub fn hidden_fraction(&self) -> f64 {
        if self.communication.is_zero() {
            return 1.0;
        }
        let exposed = self.exposed.min(self.communication).as_secs_f64();
        1.0 - exposed / self.communication.as_secs_f64()
    }

    pub(crate) fn add(&mut self, other: &StepStats) {
        self.steps += other.steps;
        self.backward += other.backward;
        self.communication += other.communication;
        self.exposed += other.exposed;
        self.bytes += other.bytes;
        self.received += other.received;
        self.buckets += other.buckets;
        self.device_packed += other.device_packed;
        self.device_lane += other.device_lane;
        for (&rank, late) in &other.late_peers {
            let mine = self.late_peers.entry(rank).or_default();
            mine.steps += late.steps;
            mine.waited += late.waited;
        }
        if other.timeline.is_empty() {
            // A step that planned the buckets (or had none): nothing to add.
        } else if self.timeline.len() == other.timeline.len() {
            for (mine, theirs) in self.timeline.iter_mut().zip(&other.timeline) {
                mine.add(theirs);
            }
        } else {
            // A new bucket plan (after `replicate`, or a parameter first seen): times of the
            // old one would not line up with it.
            self.timeline = other.timeline.clone();
        }
    }
}
