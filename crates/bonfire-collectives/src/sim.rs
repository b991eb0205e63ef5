//! Runs collective schedules on a simulated network that delivers frames in a random order
//! (seeded, so every failure replays), without threads, sockets or clocks.
//!
//! This is how bonfire tests that its schedules are correct and deterministic whatever the
//! network does; it is public so that a configuration (group size, chunk size, algorithm) can be
//! checked the same way before a job runs.
//!
//! ```
//! use bonfire_collectives::{Algorithm, Collective, sim};
//! use bonfire_topology::ReduceOp;
//!
//! let inputs: Vec<Vec<f32>> = (0..5).map(|r| vec![r as f32; 7]).collect();
//! let config = sim::SimConfig { algorithm: Algorithm::Ring, ..sim::SimConfig::default() };
//! let outputs = sim::run(&Collective::AllReduce(ReduceOp::Sum), inputs, &config).unwrap();
//! assert!(outputs.iter().all(|o| o == &vec![10.0; 7]));
//! ```

use std::collections::{HashMap, VecDeque};

use bonfire_topology::{NodeId, NodeLayout, Rank, ReduceOp};
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::exec::{Action, Arith, Executor, Span};
use crate::reducer::HostReducer;
use crate::schedule::{Instr, Program};
use crate::{Algorithm, Collective, CommConfig, Element};

/// How to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Seed of the delivery order.
    pub seed: u64,
    /// The algorithm to force, or [`Algorithm::Auto`].
    pub algorithm: Algorithm,
    /// Chunk size and size thresholds, as a communicator would use them.
    pub comm: CommConfig,
    /// Which node each rank is on (for hierarchical schedules); `None` puts all on one node.
    pub nodes: Option<NodeLayout>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 0,
            algorithm: Algorithm::Auto,
            comm: CommConfig::default(),
            nodes: None,
        }
    }
}

/// A schedule that misbehaved in simulation, or a call that was invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// A rank's call was invalid.
    #[error("rank {rank}: {problem}")]
    Invalid {
        /// The rank.
        rank: usize,
        /// What is wrong.
        problem: String,
    },
    /// The collective does not implement the forced algorithm.
    #[error("{op} has no {algorithm} schedule")]
    Unsupported {
        /// The collective.
        op: &'static str,
        /// The algorithm.
        algorithm: Algorithm,
    },
    /// No rank can move and no frame is in flight, but some ranks are not done.
    #[error("deadlock: {waiting:?} (rank, waiting for (from, step))")]
    Deadlock {
        /// Each stuck rank and the frame it waits for.
        waiting: Vec<(usize, Option<(u32, u32)>)>,
    },
    /// A frame was sent that no rank received.
    #[error("rank {to} never took the frame from {from} for step {step:#x}")]
    Leftover {
        /// The addressee.
        to: usize,
        /// The sender.
        from: u32,
        /// The step.
        step: u32,
    },
    /// A rank received a frame of the wrong size.
    #[error("rank {rank}: bad frame from {from} for step {step:#x}: {problem}")]
    BadFrame {
        /// The receiving rank.
        rank: usize,
        /// The sender.
        from: u32,
        /// The step.
        step: u32,
        /// What is wrong.
        problem: String,
    },
}

struct RankState<T> {
    exec: Executor,
    work: Vec<T>,
    done: bool,
    inbox: HashMap<(u32, u32), VecDeque<Bytes>>,
}

/// Runs `collective` with `inputs[r]` as rank `r`'s buffer and returns every rank's result.
pub fn run<T: Element>(
    collective: &Collective,
    inputs: Vec<Vec<T>>,
    config: &SimConfig,
) -> Result<Vec<Vec<T>>, SimError> {
    let n = inputs.len();
    let nodes: Vec<_> = match &config.nodes {
        Some(layout) => (0..n).map(|r| layout.node_of(Rank::from(r))).collect(),
        None => vec![NodeId(0); n],
    };
    let arith = Arith {
        dtype: T::DTYPE,
        op: collective.reduce_op().unwrap_or(ReduceOp::Sum),
        group_size: n,
        reducer: std::sync::Arc::new(HostReducer),
    };

    let mut shapes = Vec::with_capacity(n);
    let mut programs = Vec::with_capacity(n);
    let mut states = Vec::with_capacity(n);
    for (rank, input) in inputs.into_iter().enumerate() {
        let shape = collective
            .shape(n, rank, input.len())
            .map_err(|problem| SimError::Invalid { rank, problem })?;
        let bytes = shape.count * T::DTYPE.size();
        let algorithm = collective
            .resolve(config.algorithm, bytes, &nodes, &config.comm)
            .map_err(|()| SimError::Unsupported {
                op: collective.name(),
                algorithm: config.algorithm,
            })?;
        programs.push(collective.program(
            algorithm,
            &shape,
            rank,
            &nodes,
            T::DTYPE.size(),
            &config.comm,
        ));
        states.push(RankState {
            exec: Executor::default(),
            work: collective.prepare(&shape, rank, input),
            done: false,
            inbox: HashMap::new(),
        });
        shapes.push(shape);
    }

    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    // (to, from, step, frame)
    let mut in_flight: Vec<(usize, u32, u32, Bytes)> = Vec::new();
    loop {
        let runnable: Vec<usize> = (0..n)
            .filter(|&r| !states[r].done && can_run(&states[r], &programs[r]))
            .collect();
        let events = runnable.len() + in_flight.len();
        if events == 0 {
            if states.iter().all(|s| s.done) {
                break;
            }
            let waiting = (0..n)
                .filter(|&r| !states[r].done)
                .map(|r| (r, awaited(&states[r].exec, &programs[r])))
                .collect();
            return Err(SimError::Deadlock { waiting });
        }
        let pick = rng.random_range(0..events);
        if pick < runnable.len() {
            let r = runnable[pick];
            step_rank(&mut states[r], &programs[r], r, &arith, &mut in_flight)?;
        } else {
            let (to, from, step, frame) = in_flight.swap_remove(pick - runnable.len());
            states[to]
                .inbox
                .entry((from, step))
                .or_default()
                .push_back(frame);
        }
    }

    for (to, state) in states.iter().enumerate() {
        if let Some((&(from, step), _)) = state.inbox.iter().find(|(_, q)| !q.is_empty()) {
            return Err(SimError::Leftover { to, from, step });
        }
    }
    Ok(states
        .into_iter()
        .enumerate()
        .map(|(r, s)| collective.finish(&shapes[r], r, s.work))
        .collect())
}

/// The frame a rank's next instruction waits for, if it waits.
fn awaited(exec: &Executor, program: &Program) -> Option<(u32, u32)> {
    match program.instrs.get(exec.position()) {
        Some(Instr::Recv { from, step, .. }) => Some((*from, *step)),
        _ => None,
    }
}

/// Whether a rank can take its next action now.
fn can_run<T: Element>(state: &RankState<T>, program: &Program) -> bool {
    match awaited(&state.exec, program) {
        Some(key) => state.inbox.get(&key).is_some_and(|q| !q.is_empty()),
        None => true,
    }
}

/// Performs one action of rank `r`.
fn step_rank<T: Element>(
    state: &mut RankState<T>,
    program: &Program,
    r: usize,
    arith: &Arith,
    in_flight: &mut Vec<(usize, u32, u32, Bytes)>,
) -> Result<(), SimError> {
    let buf = Span::new(bytemuck::cast_slice_mut(&mut state.work));
    match state.exec.next(program, &buf, arith) {
        Action::Done => state.done = true,
        Action::Send { bytes, to } => {
            // SAFETY: the simulator writes no frame in place: this thread is the only user.
            let payload = bonfire_transport::pool::frame(unsafe { buf.get(bytes) });
            in_flight.extend(
                to.iter()
                    .map(|&(p, s)| (p as usize, r as u32, s, payload.clone())),
            );
        }
        Action::Await { from, step } => {
            // The rank may have run a local instruction first and now wait for a frame that
            // has not come yet: then it is simply blocked.
            let Some(frame) = state
                .inbox
                .get_mut(&(from, step))
                .and_then(VecDeque::pop_front)
            else {
                return Ok(());
            };
            let forward = state
                .exec
                .deliver(program, &buf, &frame, arith)
                .map_err(|problem| SimError::BadFrame {
                    rank: r,
                    from,
                    step,
                    problem,
                })?;
            in_flight.extend(
                forward
                    .iter()
                    .map(|&(p, s)| (p as usize, r as u32, s, frame.clone())),
            );
        }
    }
    Ok(())
}
