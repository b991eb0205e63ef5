//! Per-step statistics of gradient synchronisation.

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
    /// Gradient bytes all-reduced (in the communicated dtype).
    pub bytes: u64,
    /// Buckets all-reduced.
    pub buckets: u64,
    /// Buckets whose gradients were packed on the device by the fused pack kernel (and crossed
    /// to the host in one transfer). 0 on host backends (Flex, NdArray), or with
    /// `BONFIRE_DEVICE_PACK=0`.
    pub device_packed: u64,
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
        self.buckets += other.buckets;
        self.device_packed += other.device_packed;
    }
}
