//! Gradient buckets through the device lane (CUDA): a bucket packed on the device goes into the
//! rank's IPC window, is all-reduced there by the lane's kernel against the other ranks' windows
//! of this host, and comes back into the gradients with the fused unpack kernel. Within one host
//! it never crosses to the host; only the presence flags (one f32 per parameter) do. A job of
//! several nodes runs the hierarchical schedule ([`NodeLane`]): the node's ranks reduce-scatter
//! on the device, each rank's share alone crosses nodes over the job's link, and the node
//! all-gathers the result on the device.
//!
//! The lane is set up at the first bucket that can take it, by every rank together: f32
//! gradients of a CUDA backend, all-reduced (not reduce-scattered under ZeRO stage 2), not
//! compressed to bf16, in a step without gradients accumulated on the host, with
//! `DataParallelConfig::device_lane` on. Where any rank cannot join (no IPC between the devices
//! of a node, nodes of different sizes), every rank keeps the host lane, and rank 0 says why
//! once.

use std::sync::Mutex;

use bonfire_collectives::Communicator;
use bonfire_kernels::lane::{CrossLink, DeviceLane, LaneError, LaneOp, NodeLink};
use bonfire_topology::{ByNode, ReduceOp};

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

/// The job's communicator split by local index as the second level of the hierarchical lane:
/// this rank and the ranks of the other nodes that hold its place on theirs.
pub struct CommCross(pub Communicator);

impl CrossLink for CommCross {
    fn nodes(&self) -> usize {
        self.0.size()
    }
    fn start_sum(&self, chunk: Vec<f32>) -> Box<dyn FnOnce() -> Result<Vec<f32>, String> + '_> {
        let work = self.0.all_reduce(chunk, ReduceOp::Sum);
        Box::new(move || work.wait().map_err(|e| e.to_string()))
    }
}

/// A rank's device lane in a job of one node or several: the lane between the processes of its
/// node, and where the group spans several nodes, the link to the ranks of the same local index
/// on the others (the hierarchical schedule of [`DeviceLane::all_reduce_across`]).
pub struct NodeLane {
    lane: DeviceLane<CommLink>,
    cross: Option<CommCross>,
}

impl NodeLane {
    /// Sets the lane up for `comm`'s ranks on CUDA device `ordinal`, with windows of `bytes`.
    /// Collective over `comm`: every rank calls it, and every rank gets the same verdict. In a
    /// group of several nodes, each node's ranks set up their lane and the nodes agree; every
    /// node must hold as many of the group's ranks. The error says why the ranks go without it,
    /// naming the rank or node that could not join.
    pub fn join(comm: &Communicator, ordinal: usize, bytes: usize) -> Result<NodeLane, String> {
        let by = ByNode::of(comm.nodes());
        if by.groups().len() == 1 {
            return DeviceLane::new(CommLink(comm.clone()), ordinal, bytes)
                .map(|lane| NodeLane { lane, cross: None })
                .map_err(|declined| declined.error.to_string());
        }
        // Decided from the layout alone, which every rank has: the same verdict everywhere, and
        // before any collective.
        if let Err((first, k, n)) = by.per_node() {
            return Err(format!(
                "{} holds {first} of the group's ranks and {} {n}: the device lane across nodes needs as many ranks on every node",
                by.node(0),
                by.node(k)
            ));
        }
        let (node, local) = by.locate(comm.rank());
        let split = |color: usize, key: usize| {
            comm.split(Some(color as u32), key as u32)
                .map_err(|e| format!("splitting the group for the device lane: {e}"))
                .map(|c| c.expect("a color was given"))
        };
        let node_comm = split(node, comm.rank())?;
        let cross = split(local, node)?;
        let lane = DeviceLane::new(CommLink(node_comm), ordinal, bytes);
        // Each node's ranks agreed among themselves; the nodes agree now.
        let ok = comm
            .all_gather(vec![i64::from(lane.is_ok())])
            .wait()
            .map_err(|e| format!("agreeing on the device lane across nodes: {e}"))?;
        match (lane, ok.iter().position(|&o| o == 0)) {
            (Err(declined), _) => Err(format!(
                "{} (on {})",
                declined.error,
                comm.nodes()[comm.rank()]
            )),
            (Ok(_), Some(r)) => Err(format!(
                "the ranks of {} (rank {r} among them) could not set up the lane of their node",
                comm.nodes()[r]
            )),
            (Ok(lane), None) => Ok(NodeLane {
                lane,
                cross: Some(CommCross(cross)),
            }),
        }
    }

    /// The lane between the processes of this rank's node.
    pub fn lane(&self) -> &DeviceLane<CommLink> {
        &self.lane
    }

    /// Bytes per window.
    pub fn capacity(&self) -> usize {
        self.lane.capacity()
    }

    /// All-reduce of f32 in place over the first `count` elements of every rank's window: on the
    /// device within a node, hierarchically across nodes.
    pub fn all_reduce(&self, count: usize, op: LaneOp) -> Result<(), LaneError> {
        match &self.cross {
            None => self.lane.all_reduce::<f32>(count, op),
            Some(cross) => self.lane.all_reduce_across(count, op, cross),
        }
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
    On(Box<NodeLane>),
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
        f: impl FnOnce(&NodeLane) -> T,
    ) -> Option<T> {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let grow = matches!(&*slot, Slot::On(lane) if lane.capacity() < bytes);
        if matches!(*slot, Slot::Untried) || grow {
            // Every rank gets here at the same bucket (the plan is agreed), so the set-up's
            // collectives line up.
            *slot = Slot::Off;
            match NodeLane::join(comm, ordinal, bytes) {
                Ok(lane) => *slot = Slot::On(Box::new(lane)),
                Err(why) => {
                    if comm.rank() == 0 {
                        eprintln!("bonfire: gradients take the host lane: {why}");
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
