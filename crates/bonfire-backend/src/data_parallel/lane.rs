//! Gradient buckets through the device lane (CUDA): a bucket packed on the device goes into the
//! rank's IPC window, is all-reduced there by the lane's kernel against the other ranks' windows
//! of this host, and comes back into the gradients with the fused unpack kernel. It never
//! crosses to the host; only the presence flags (one f32 per parameter) do.
//!
//! The lane is set up at the first bucket that can take it, by every rank together: f32
//! gradients of a CUDA backend, all-reduced (not reduce-scattered under ZeRO stage 2), not
//! compressed to bf16, in a step without gradients accumulated on the host, with
//! `DataParallelConfig::device_lane` on. Where any rank cannot join (no IPC between the devices,
//! ranks on several hosts), every rank keeps the host lane, and rank 0 says why once.

use std::sync::Mutex;

use bonfire_collectives::Communicator;
use bonfire_kernels::lane::{DeviceLane, LaneOp, NodeLink};

/// The data-parallel group's communicator as the lane's link: the windows' handles cross it
/// (authenticated, as every frame of the job), and its barriers order the lane's collectives.
pub struct CommLink(pub Communicator);

impl NodeLink for CommLink {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
        let lens = self
            .0
            .all_gather(vec![mine.len() as i64])
            .wait()
            .map_err(|e| e.to_string())?;
        let counts: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
        let all = self
            .0
            .all_gather_uneven(mine, &counts)
            .wait()
            .map_err(|e| e.to_string())?;
        let mut at = 0;
        Ok(counts
            .iter()
            .map(|&c| {
                at += c;
                all[at - c..at].to_vec()
            })
            .collect())
    }
    fn barrier(&self) -> Result<(), String> {
        self.0.barrier().wait().map_err(|e| e.to_string())
    }
}

/// A rank's device lane, once its ranks have agreed on it.
#[derive(Default)]
pub(crate) enum Slot {
    /// Not tried yet.
    #[default]
    Untried,
    /// The ranks went without it (the reason was said once).
    Off,
    /// Set up, with a window of its capacity.
    On(Box<DeviceLane<CommLink>>),
}

/// The lane of one rank, behind a lock (the sync path takes it on the training thread).
#[derive(Default)]
pub(crate) struct LaneState(Mutex<Slot>);

impl LaneState {
    /// Whether buckets may be stashed for the lane: on, or not tried yet.
    pub(crate) fn usable(&self) -> bool {
        !matches!(*self.0.lock().unwrap_or_else(|e| e.into_inner()), Slot::Off)
    }

    /// Runs `f` with the lane, setting it up first (every rank together) when it is untried or
    /// its window is smaller than `bytes`. `None` when the ranks go without it.
    pub(crate) fn with<T>(
        &self,
        comm: &Communicator,
        ordinal: usize,
        bytes: usize,
        f: impl FnOnce(&DeviceLane<CommLink>) -> T,
    ) -> Option<T> {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let grow = matches!(&*slot, Slot::On(lane) if lane.capacity() < bytes);
        if matches!(*slot, Slot::Untried) || grow {
            // Every rank gets here at the same bucket (the plan is agreed), so the set-up's
            // collectives line up.
            *slot = Slot::Off;
            match DeviceLane::new(CommLink(comm.clone()), ordinal, bytes) {
                Ok(lane) => *slot = Slot::On(Box::new(lane)),
                Err(declined) => {
                    if comm.rank() == 0 {
                        eprintln!("bonfire: gradients take the host lane: {}", declined.error);
                    }
                }
            }
        }
        match &*slot {
            Slot::On(lane) => Some(f(lane)),
            _ => None,
        }
    }
}

/// The op the lane applies for a replica that averages (`mean`) or sums.
pub(crate) fn op(mean: bool) -> LaneOp {
    if mean { LaneOp::Mean } else { LaneOp::Sum }
}
