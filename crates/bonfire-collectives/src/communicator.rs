use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bonfire_topology::{GroupId, Mesh, NodeId, NodeLayout, Rank, ReduceOp};
use bonfire_transport::{InProcess, Transport};
use tokio::runtime::Handle;

use crate::driven::{Driven, Start};
use crate::driver::{self, Arrived, Exchange};
use crate::exec::Arith;
use crate::fingerprint::{Fingerprint, OpKind};
use crate::reducer::{HostReducer, Reducer};
use crate::schedule::{Builder, Team};
use crate::{Algorithm, Collective, CollectiveError, CommConfig, Element, Work};

/// Words mixed into derived group ids, so that different derivations cannot collide.
const SPLIT: u64 = 0x0053_504c_4954; // "SPLIT"
const P2P: u64 = 0x0050_3250; // "P2P"
const SUBGROUP: u64 = 0x5355_4247_5250; // "SUBGRP"

/// A group of ranks that run collectives together, like an MPI communicator or a PyTorch
/// process group.
///
/// # Contract
/// - Every member must call the same collectives, with matching arguments, in the same order.
///   Each call carries a [`Fingerprint`]; if two members disagree, the call fails on every member
///   with [`CollectiveError::Mismatch`] naming both, within moments, instead of hanging.
/// - Calls return a [`Work`] at once and run in the background, in call order per member;
///   several may be in flight. `wait()` or `.await` it for the result.
/// - Results are deterministic: the same inputs give the same bits on every member and in every
///   run, whatever order the network delivers frames in (see [`crate::schedule`]'s docs in the
///   source: every combination has a fixed place and operand order).
/// - Every wait has the configured timeout ([`CommConfig::timeout`]); a member that never calls,
///   dies or fails makes the call fail on the others with an error that names it.
/// - Buffers are moved in and handed back, so a loop can reuse its allocation.
///
/// Cloning is cheap and shares the group (and its sequence numbers).
#[derive(Clone)]
pub struct Communicator {
    group: Arc<Group>,
    algorithm: Algorithm,
    /// Overrides the group's [`CommConfig::timeout`] for calls through this handle.
    timeout: Option<std::time::Duration>,
    /// Calls through this handle are run only by their caller (see
    /// [`Communicator::caller_driven`]).
    caller_driven: bool,
}

struct Group {
    id: GroupId,
    members: Arc<[Rank]>,
    me: u32,
    nodes: Vec<NodeId>,
    transport: Arc<dyn Transport>,
    config: CommConfig,
    reducer: Arc<dyn Reducer>,
    runtime: Handle,
    seq: AtomicU64,
    sends: Mutex<HashMap<u32, u64>>,
    recvs: Mutex<HashMap<u32, u64>>,
}

/// The two communicators of a rank in a data x tensor-parallel [`Mesh`].
#[derive(Clone)]
pub struct MeshGroups {
    /// The ranks holding the same shard of the model (gradients are averaged over it).
    pub dp: Communicator,
    /// The ranks sharing one replica of the model (tensors are sharded over it).
    pub tp: Communicator,
    /// The ranks holding one replica's stages, one rank per stage in stage order (a group of
    /// one without pipeline parallelism).
    pub pp: Communicator,
}

/// Builds the world communicator of a transport.
pub struct CommunicatorBuilder {
    transport: Arc<dyn Transport>,
    layout: Option<NodeLayout>,
    config: CommConfig,
    reducer: Arc<dyn Reducer>,
    runtime: Option<Handle>,
}

impl CommunicatorBuilder {
    /// Which node each rank runs on (default: all on one node).
    pub fn nodes(mut self, layout: NodeLayout) -> Self {
        self.layout = Some(layout);
        self
    }

    /// The settings (default: [`CommConfig::default`]).
    pub fn config(mut self, config: CommConfig) -> Self {
        self.config = config;
        self
    }

    /// The reducer (default: [`HostReducer`]).
    pub fn reducer(mut self, reducer: Arc<dyn Reducer>) -> Self {
        self.reducer = reducer;
        self
    }

    /// The tokio runtime collectives run on (default: [`crate::runtime()`]).
    pub fn runtime(mut self, runtime: Handle) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// The communicator of all ranks of the transport's world.
    pub fn build(self) -> Result<Communicator, CollectiveError> {
        let world = self.transport.world_size();
        let me = self.transport.rank();
        let layout = self
            .layout
            .unwrap_or_else(|| NodeLayout::single_node(world));
        if layout.world() != world {
            return Err(CollectiveError::InvalidArgument {
                me,
                op: "communicator",
                problem: format!(
                    "the node layout has {} ranks, the transport {world}",
                    layout.world()
                ),
            });
        }
        let members: Arc<[Rank]> = (0..world).map(Rank::from).collect();
        Ok(Communicator {
            group: Arc::new(Group {
                id: GroupId::WORLD,
                nodes: members.iter().map(|&r| layout.node_of(r)).collect(),
                members,
                me: me.0,
                transport: self.transport,
                config: self.config,
                reducer: self.reducer,
                runtime: self
                    .runtime
                    .unwrap_or_else(|| crate::runtime().handle().clone()),
                seq: AtomicU64::new(0),
                sends: Mutex::new(HashMap::new()),
                recvs: Mutex::new(HashMap::new()),
            }),
            algorithm: Algorithm::Auto,
            timeout: None,
            caller_driven: false,
        })
    }
}

impl Communicator {
    /// Starts building the world communicator over `transport`.
    pub fn builder(transport: Arc<dyn Transport>) -> CommunicatorBuilder {
        CommunicatorBuilder {
            transport,
            layout: None,
            config: CommConfig::default(),
            reducer: Arc::new(HostReducer),
            runtime: None,
        }
    }

    /// `n` communicators over an in-process transport, one per rank, for ranks that are threads
    /// of this process. Element `i` is rank `i`.
    pub fn in_process(n: usize, config: CommConfig) -> Vec<Communicator> {
        Communicator::in_process_on(&NodeLayout::single_node(n), config)
    }

    /// `in_process` with the ranks placed on nodes as `layout` says (threads standing in for the
    /// ranks of several hosts, in tests of what a node-aware path does).
    pub fn in_process_on(layout: &NodeLayout, config: CommConfig) -> Vec<Communicator> {
        InProcess::world(layout.world())
            .into_iter()
            .map(|t| {
                Communicator::builder(Arc::new(t))
                    .nodes(layout.clone())
                    .config(config.clone())
                    .build()
                    .expect("the layout has the transport's size")
            })
            .collect()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.me as usize
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.group.members.len()
    }

    /// This rank's rank in the world.
    pub fn world_rank(&self) -> Rank {
        self.group.members[self.rank()]
    }

    /// World ranks of the members, by group index.
    pub fn members(&self) -> &[Rank] {
        &self.group.members
    }

    /// The node of each member, by group index.
    pub fn nodes(&self) -> &[NodeId] {
        &self.group.nodes
    }

    /// The group's id.
    pub fn id(&self) -> GroupId {
        self.group.id
    }

    /// The settings.
    pub fn config(&self) -> &CommConfig {
        &self.group.config
    }

    /// The algorithm this handle asks for.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// A handle to the same group that forces `algorithm` (or [`Algorithm::Auto`]) for the
    /// collectives that implement it; the others fail with
    /// [`CollectiveError::UnsupportedAlgorithm`].
    pub fn with_algorithm(&self, algorithm: Algorithm) -> Communicator {
        Communicator {
            group: self.group.clone(),
            algorithm,
            timeout: self.timeout,
            caller_driven: self.caller_driven,
        }
    }

    /// A handle to the same group whose waits time out after `timeout` instead of the group's
    /// [`CommConfig::timeout`]: for a call that is expected to wait long for a peer (the other
    /// ranks waiting while rank 0 validates and writes a checkpoint), without lengthening every
    /// other wait. The members of one call may use different timeouts.
    pub fn with_timeout(&self, timeout: std::time::Duration) -> Communicator {
        Communicator {
            group: self.group.clone(),
            algorithm: self.algorithm,
            timeout: Some(timeout),
            caller_driven: self.caller_driven,
        }
    }

    /// A handle to the same group whose collectives only the caller runs: the call runs the
    /// first step of each at once whatever its size, [`Work::progress`] runs whatever has
    /// become possible since, and [`Work::wait`] the rest; no communication thread is woken for
    /// them while the `Work` is held (a dropped one is finished in the background as usual).
    ///
    /// For a caller that computes on every core it has and can look in between (the gradient
    /// hook between backward's ops): a communication thread would only take cores from the
    /// compute, and each hand-over costs a context switch.
    pub fn caller_driven(&self) -> Communicator {
        Communicator {
            group: self.group.clone(),
            algorithm: self.algorithm,
            timeout: self.timeout,
            caller_driven: true,
        }
    }

    /// The algorithm a call of `collective` with a buffer of `len` elements of `T` would run
    /// (what [`Algorithm::Auto`] resolves to, or the forced one), or the error the call would
    /// fail with.
    pub fn resolve_algorithm<T: Element>(
        &self,
        collective: &Collective,
        len: usize,
    ) -> Result<Algorithm, CollectiveError> {
        let g = &self.group;
        let op = collective.name();
        let shape = collective
            .shape(self.size(), self.rank(), len)
            .map_err(|problem| CollectiveError::InvalidArgument {
                me: self.world_rank(),
                op,
                problem,
            })?;
        collective
            .resolve(
                self.algorithm,
                shape.count * T::DTYPE.size(),
                &g.nodes,
                &g.config,
            )
            .map_err(|()| CollectiveError::UnsupportedAlgorithm {
                me: self.world_rank(),
                op,
                algorithm: self.algorithm,
                supported: collective.algorithms(),
            })
    }

    /// Runs `collective` on this rank's `buf`. See [`Collective`] for the buffer each one takes
    /// and gives back.
    pub fn run<T: Element>(&self, collective: Collective, buf: Vec<T>) -> Work<Vec<T>> {
        self.launch(collective, buf).1
    }

    /// Sum, mean, max, min or product of every rank's `buf`, on every rank.
    pub fn all_reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.run(Collective::AllReduce(op), buf)
    }

    /// Reduction of segment `rank` of every rank's `buf` (split evenly, the first `len % n`
    /// segments one element longer).
    pub fn reduce_scatter<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.run(Collective::ReduceScatter { op, counts: None }, buf)
    }

    /// Reduce-scatter with segment lengths `counts` (in rank order; they add up to `buf.len()`).
    pub fn reduce_scatter_uneven<T: Element>(
        &self,
        buf: Vec<T>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        let counts = Some(counts.to_vec());
        self.run(Collective::ReduceScatter { op, counts }, buf)
    }

    /// Every rank's `buf` (all of the same length), concatenated in rank order.
    pub fn all_gather<T: Element>(&self, buf: Vec<T>) -> Work<Vec<T>> {
        self.run(Collective::AllGather { counts: None }, buf)
    }

    /// All-gather where rank `i` contributes `counts[i]` elements.
    pub fn all_gather_uneven<T: Element>(&self, buf: Vec<T>, counts: &[usize]) -> Work<Vec<T>> {
        let counts = Some(counts.to_vec());
        self.run(Collective::AllGather { counts }, buf)
    }

    /// The `root`'s `buf`, on every rank (every rank passes a buffer of the same length).
    pub fn broadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        self.run(Collective::Broadcast { root }, buf)
    }

    /// The reduction of every rank's `buf` on `root`; the others get their buffer back with
    /// unspecified contents.
    pub fn reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp, root: usize) -> Work<Vec<T>> {
        self.run(Collective::Reduce { op, root }, buf)
    }

    /// Completes once every rank has called it.
    pub fn barrier(&self) -> Work<()> {
        self.launch_then(Collective::Barrier, Vec::<u8>::new(), drop)
            .1
    }

    /// Sends `buf` to group member `to`, which must call [`Communicator::recv`] with a buffer of
    /// the same length and type. Completes when `to` has taken part (as MPI's synchronous send);
    /// gives the buffer back. Sends from one rank to another are matched in call order.
    pub fn send<T: Element>(&self, buf: Vec<T>, to: usize) -> Work<Vec<T>> {
        self.point_to_point(buf, self.rank(), to)
    }

    /// Receives into `buf` what group member `from` sends with [`Communicator::send`].
    pub fn recv<T: Element>(&self, buf: Vec<T>, from: usize) -> Work<Vec<T>> {
        self.point_to_point(buf, from, self.rank())
    }

    /// Splits the group as `MPI_Comm_split`: the members that pass the same `color` form a new
    /// group, ordered by `key` then by their index here; `None` joins no group. Collective: every
    /// member must call it.
    pub fn split(
        &self,
        color: Option<u32>,
        key: u32,
    ) -> Result<Option<Communicator>, CollectiveError> {
        let mine = [color.map_or(-1, i64::from), i64::from(key)];
        let (seq, work) = self.launch(Collective::AllGather { counts: None }, mine.to_vec());
        let table: Vec<i64> = work.wait()?;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut chosen: Vec<(i64, usize)> = (0..self.size())
            .filter(|&i| table[2 * i] == i64::from(color))
            .map(|i| (table[2 * i + 1], i))
            .collect();
        chosen.sort_unstable();
        let me = chosen
            .iter()
            .position(|&(_, i)| i == self.rank())
            .expect("this rank chose its own color");
        let members: Vec<usize> = chosen.iter().map(|&(_, i)| i).collect();
        let id = self.group.id.derive(&[SPLIT, seq, u64::from(color)]);
        Ok(Some(self.derived(id, &members, me)))
    }

    /// The group of `members` (indices here, in the order given), formed without a collective:
    /// every member must pass the same list, and the others get `None`. It is how ranks that
    /// already agree on who is left go on without a dead member, which a [`split`] cannot do
    /// (every member must call it). The new group's id is derived from this group's and the
    /// list, so each list must be asked for at most once.
    ///
    /// [`split`]: Communicator::split
    pub fn subgroup(&self, members: &[usize]) -> Option<Communicator> {
        let me = members.iter().position(|&i| i == self.rank())?;
        assert!(
            members.iter().all(|&i| i < self.size()),
            "subgroup {members:?} of a group of {}",
            self.size()
        );
        let mut key = vec![SUBGROUP];
        key.extend(members.iter().map(|&i| i as u64));
        Some(self.derived(self.group.id.derive(&key), members, me))
    }

    /// The group `id` of `members` (indices here, in order), this rank at index `me` of it.
    fn derived(&self, id: GroupId, members: &[usize], me: usize) -> Communicator {
        let g = &self.group;
        Communicator {
            group: Arc::new(Group {
                id,
                nodes: members.iter().map(|&i| g.nodes[i]).collect(),
                members: members.iter().map(|&i| g.members[i]).collect(),
                me: me as u32,
                transport: g.transport.clone(),
                config: g.config.clone(),
                reducer: g.reducer.clone(),
                runtime: g.runtime.clone(),
                seq: AtomicU64::new(0),
                sends: Mutex::new(HashMap::new()),
                recvs: Mutex::new(HashMap::new()),
            }),
            algorithm: self.algorithm,
            timeout: self.timeout,
            caller_driven: false,
        }
    }

    /// This rank's data-parallel, tensor-parallel and pipeline groups in `mesh`, by [`split`]s
    /// (group indices are mesh ranks; the pipeline group is split only when the mesh has
    /// several stages). Collective.
    ///
    /// [`split`]: Communicator::split
    pub fn split_mesh(&self, mesh: &Mesh) -> Result<MeshGroups, CollectiveError> {
        if mesh.world() != self.size() {
            return Err(CollectiveError::InvalidArgument {
                me: self.world_rank(),
                op: "split_mesh",
                problem: format!(
                    "the mesh has {} ranks, the group {}",
                    mesh.world(),
                    self.size()
                ),
            });
        }
        let (p, d, t) = mesh.coords3(Rank::from(self.rank()));
        let color =
            |outer: usize, inner: usize, inner_size: usize| (outer * inner_size + inner) as u32;
        let dp = self
            .split(Some(color(p, t, mesh.tp())), d as u32)?
            .expect("a color was given");
        let tp = self
            .split(Some(color(p, d, mesh.dp())), t as u32)?
            .expect("a color was given");
        let pp = if mesh.pp() == 1 {
            Communicator::in_process(1, self.config().clone()).remove(0)
        } else {
            self.split(Some(color(d, t, mesh.tp())), p as u32)?
                .expect("a color was given")
        };
        Ok(MeshGroups { dp, tp, pp })
    }

    /// Starts a collective; returns its sequence number and handle.
    fn launch<T: Element>(&self, collective: Collective, buf: Vec<T>) -> (u64, Work<Vec<T>>) {
        self.launch_then(collective, buf, |v| v)
    }

    /// Starts a collective whose result is `then` of its buffer.
    fn launch_then<T: Element, U: Send + 'static>(
        &self,
        collective: Collective,
        buf: Vec<T>,
        then: impl FnOnce(Vec<T>) -> U + Send + 'static,
    ) -> (u64, Work<U>) {
        let g = &self.group;
        let seq = g.seq.fetch_add(1, Ordering::Relaxed);
        let me = self.rank();
        let world_me = self.world_rank();
        let op = collective.name();
        let fail = |error: CollectiveError| {
            let participants: Vec<u32> = (0..self.size() as u32).collect();
            self.notify_failure(g.id.0, seq, participants, collective.kind(), &error);
            (seq, Work::ready(Err(error)))
        };
        let shape = match collective.shape(self.size(), me, buf.len()) {
            Ok(shape) => shape,
            Err(problem) => {
                return fail(CollectiveError::InvalidArgument {
                    me: world_me,
                    op,
                    problem,
                });
            }
        };
        let Ok(algorithm) = collective.resolve(
            self.algorithm,
            shape.count * T::DTYPE.size(),
            &g.nodes,
            &g.config,
        ) else {
            return fail(CollectiveError::UnsupportedAlgorithm {
                me: world_me,
                op,
                algorithm: self.algorithm,
                supported: collective.algorithms(),
            });
        };
        let program =
            collective.program(algorithm, &shape, me, &g.nodes, T::DTYPE.size(), &g.config);
        let fingerprint = Fingerprint {
            group: g.id,
            seq,
            op: collective.kind(),
            dtype: T::DTYPE,
            count: shape.count as u64,
            root: collective.root(),
            algorithm,
            chunk_bytes: chunk_u32(g.config.chunk_bytes),
            layout: shape.layout,
        };
        tracing::debug!(
            "{op} #{seq} on rank {me} of {} (group {:x}): {} x {:?}, {algorithm:?}",
            self.size(),
            g.id.0,
            shape.count,
            T::DTYPE,
        );
        let exchange = self.exchange(g.id.0, (0..self.size() as u32).collect(), fingerprint);
        let arrived = exchange.arrived.clone();
        let work = collective.prepare(&shape, me, buf);
        let reducer = g.reducer.clone();
        let n = self.size();
        let bytes = shape.count * T::DTYPE.size();
        let job = async move {
            let mut work = work;
            let arith = Arith {
                dtype: T::DTYPE,
                op: collective.reduce_op().unwrap_or(ReduceOp::Sum),
                group_size: n,
                reducer,
            };
            let started = std::time::Instant::now();
            let ran = driver::run(
                &exchange,
                &program,
                bytemuck::cast_slice_mut(&mut work),
                &arith,
            )
            .await;
            match &ran {
                Ok(()) => tracing::trace!("{op} #{seq} done in {:?}", started.elapsed()),
                Err(e) => tracing::debug!("{op} #{seq} failed after {:?}: {e}", started.elapsed()),
            }
            ran?;
            Ok(then(collective.finish(&shape, me, work)))
        };
        (seq, self.start(op, bytes, job, arrived))
    }

    /// Hands a collective to whoever waits for it (see `driven`); a small one is polled once
    /// here first, so that its first frames leave before this returns.
    fn start<U: Send + 'static>(
        &self,
        op: &'static str,
        bytes: usize,
        job: impl Future<Output = Result<U, CollectiveError>> + Send + 'static,
        arrived: Arrived,
    ) -> Work<U> {
        let eager = self.caller_driven || bytes <= self.group.config.small_bytes;
        let driven = Driven::start(
            self.group.runtime.clone(),
            Some(self.group.transport.clone()),
            self.world_rank(),
            op,
            Box::pin(job),
            Start {
                eager,
                held: self.caller_driven,
                arrived: Some(arrived),
            },
        );
        Work::driven(Box::new(driven))
    }

    fn point_to_point<T: Element>(&self, buf: Vec<T>, from: usize, to: usize) -> Work<Vec<T>> {
        let g = &self.group;
        let me = self.rank();
        let (peer, op, counters) = if from == me {
            (to, "send", &g.sends)
        } else {
            (from, "recv", &g.recvs)
        };
        if peer >= self.size() || peer == me {
            return Work::ready(Err(CollectiveError::InvalidArgument {
                me: self.world_rank(),
                op,
                problem: format!(
                    "peer {peer} is not another member of a group of {}",
                    self.size()
                ),
            }));
        }
        let seq = {
            let mut counters = counters.lock().unwrap_or_else(|e| e.into_inner());
            let c = counters.entry(peer as u32).or_insert(0);
            *c += 1;
            *c - 1
        };
        let context = g.id.derive(&[P2P, from as u64, to as u64]).0;
        let fingerprint = Fingerprint {
            group: g.id,
            seq,
            op: OpKind::PointToPoint,
            dtype: T::DTYPE,
            count: buf.len() as u64,
            root: Some(from as u32),
            algorithm: Algorithm::Auto,
            chunk_bytes: chunk_u32(g.config.chunk_bytes),
            layout: 0,
        };
        let team = Team::new(vec![from as u32, to as u32], usize::from(from != me));
        let mut b = Builder::new(g.config.chunk_bytes / T::DTYPE.size());
        if from == me {
            b.send_all(&team, 1, 0..buf.len(), 0, 0);
        } else {
            b.recv_all(&team, 0, 0..buf.len(), crate::schedule::Apply::Copy, 0, 0);
        }
        let program = b.finish();
        let exchange = self.exchange(context, vec![from as u32, to as u32], fingerprint);
        let arrived = exchange.arrived.clone();
        let reducer = g.reducer.clone();
        let bytes = std::mem::size_of_val(buf.as_slice());
        let job = async move {
            let mut buf = buf;
            let arith = Arith {
                dtype: T::DTYPE,
                op: ReduceOp::Sum,
                group_size: 2,
                reducer,
            };
            driver::run(
                &exchange,
                &program,
                bytemuck::cast_slice_mut(&mut buf),
                &arith,
            )
            .await?;
            Ok(buf)
        };
        self.start(op, bytes, job, arrived)
    }

    fn exchange(&self, context: u64, participants: Vec<u32>, fingerprint: Fingerprint) -> Exchange {
        let g = &self.group;
        Exchange {
            transport: g.transport.clone(),
            members: g.members.clone(),
            participants,
            me: g.me,
            context,
            fingerprint,
            timeout: self.timeout.unwrap_or(g.config.timeout),
            arrived: Arc::default(),
        }
    }

    /// Tells the other members that this rank's call `seq` failed before it started, so that
    /// they fail at once instead of waiting for it.
    fn notify_failure(
        &self,
        context: u64,
        seq: u64,
        participants: Vec<u32>,
        op: OpKind,
        error: &CollectiveError,
    ) {
        let fingerprint = Fingerprint {
            group: self.group.id,
            seq,
            op,
            dtype: bonfire_topology::DType::U8,
            count: 0,
            root: None,
            algorithm: Algorithm::Auto,
            chunk_bytes: 0,
            layout: 0,
        };
        let exchange = self.exchange(context, participants, fingerprint);
        let reason = error.to_string();
        self.group
            .runtime
            .spawn(async move { exchange.abort(&reason).await });
    }
}

fn chunk_u32(chunk: usize) -> u32 {
    u32::try_from(chunk).unwrap_or(u32::MAX)
}
