//! Where a rank's tensor-parallel state lives: its group's communicator, the random generator
//! every rank of the group draws the same numbers from, and the communication counters.
//!
//! `TensorParallel<B>` is a zero-sized type with static methods, so this state is found, in this
//! order, through a binding of the calling thread ([`bind_thread`], for ranks run as threads of
//! one process) or the process's group ([`install`], which `bonfire::init` calls when the job has
//! a tensor-parallel axis, and which [`crate::tensor_parallel()`] calls when nothing is bound).
//! With neither, the rank is a group of one: every op runs on the inner backend unchanged.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use bonfire_collectives::{CollectiveError, Communicator};
use rand_burn::SeedableRng;
use rand_burn::rngs::StdRng;

use crate::FailurePolicy;

/// What one rank's tensor-parallel ops have communicated (from [`stats`]: since the group was
/// bound).
///
/// - `all_reduces`: `Partial` tensors summed over the group (Megatron's communication: a
///   row-parallel output, a column-parallel input's gradient), and reductions over a split
///   dimension (a max for a vocabulary-parallel softmax).
/// - `gathers`: `Shard` tensors assembled whole. Each comes from an op without a rule for its
///   inputs' placements (a *fallback*, counted in `fallbacks` under the op's name: a place where
///   the plan leaks) or from an explicit read of a sharded tensor (`into_data`, a checkpoint).
/// - Bytes are each rank's contribution (its buffer's size in f32).
/// - `all_reduce_time`: the time the all-reduces held up this rank's thread, host staging
///   included; `all_reduce_peer_wait` is the part spent before every peer had called the same
///   all-reduce (the group's ranks drifting apart, not the transfer). What is left of
///   `all_reduce_time` is the most that overlapping the transfer with compute could save.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TpStats {
    /// All-reduces run.
    pub all_reduces: u64,
    /// Bytes this rank contributed to them.
    pub all_reduce_bytes: u64,
    /// Time the all-reduces took on this rank's thread, from reading the partial tensor to the
    /// summed one written back.
    pub all_reduce_time: Duration,
    /// Part of `all_reduce_time` spent before every peer had called the all-reduce.
    pub all_reduce_peer_wait: Duration,
    /// Gathers run (all-gathers, those started ahead included).
    pub gathers: u64,
    /// Of `gathers`, those started ahead of need (ZeRO stage 3's prefetch, see
    /// `bonfire::prefetch_gathers`), each of one or more parameters.
    pub gathers_started_ahead: u64,
    /// Reads of a sharded parameter that a gather started ahead served (the others waited
    /// for a gather of their own: `gathers - gathers_started_ahead`).
    pub served_ahead: u64,
    /// Parameters gathered ahead that nothing read (the program left the recorded order, as an
    /// evaluation's forward does), dropped.
    pub dropped_ahead: u64,
    /// Bytes this rank contributed to them.
    pub gather_bytes: u64,
    /// Time the gathers held up this rank's thread: from reading its part to the whole tensor
    /// received for one gathered at need; for one started ahead, reading its part when it was
    /// started and waiting for it when it was needed (under ZeRO stage 3 this is the time its
    /// parameter gathers cost the step).
    pub gather_time: Duration,
    /// Broadcasts run (a plan's parameters from rank 0).
    pub broadcasts: u64,
    /// Gathers made by ops without a rule for their inputs, by op name.
    pub fallbacks: BTreeMap<&'static str, u64>,
}

impl TpStats {
    /// Fallback gathers over every op.
    pub fn fallback_total(&self) -> u64 {
        self.fallbacks.values().sum()
    }

    /// Adds what `other` counted (a total over several stretches of a run).
    pub fn add(&mut self, other: &TpStats) {
        self.all_reduces += other.all_reduces;
        self.all_reduce_bytes += other.all_reduce_bytes;
        self.all_reduce_time += other.all_reduce_time;
        self.all_reduce_peer_wait += other.all_reduce_peer_wait;
        self.gathers += other.gathers;
        self.gathers_started_ahead += other.gathers_started_ahead;
        self.served_ahead += other.served_ahead;
        self.dropped_ahead += other.dropped_ahead;
        self.gather_bytes += other.gather_bytes;
        self.gather_time += other.gather_time;
        self.broadcasts += other.broadcasts;
        for (op, n) in &other.fallbacks {
            *self.fallbacks.entry(op).or_default() += n;
        }
    }

    /// What happened between `earlier` (an earlier reading) and `self`.
    pub fn since(&self, earlier: &TpStats) -> TpStats {
        TpStats {
            all_reduces: self.all_reduces - earlier.all_reduces,
            all_reduce_bytes: self.all_reduce_bytes - earlier.all_reduce_bytes,
            all_reduce_time: self.all_reduce_time.saturating_sub(earlier.all_reduce_time),
            all_reduce_peer_wait: self
                .all_reduce_peer_wait
                .saturating_sub(earlier.all_reduce_peer_wait),
            gathers: self.gathers - earlier.gathers,
            gathers_started_ahead: self.gathers_started_ahead - earlier.gathers_started_ahead,
            served_ahead: self.served_ahead - earlier.served_ahead,
            dropped_ahead: self.dropped_ahead - earlier.dropped_ahead,
            gather_bytes: self.gather_bytes - earlier.gather_bytes,
            gather_time: self.gather_time.saturating_sub(earlier.gather_time),
            broadcasts: self.broadcasts - earlier.broadcasts,
            fallbacks: self
                .fallbacks
                .iter()
                .filter_map(|(op, &n)| {
                    let d = n - earlier.fallbacks.get(op).copied().unwrap_or(0);
                    (d > 0).then_some((*op, d))
                })
                .collect(),
        }
    }
}

/// How many parameters a fully sharded group gathers ahead of need at a time unless told
/// otherwise: across a link of a 2 ms round trip the bundled GPT's gathers held a rank 38-40% of
/// its training time with none, 23% one at a time, 14-16% eight at a time (BENCHMARKS.md);
/// about a transformer block's parameters, the unit PyTorch FSDP gathers together.
pub(crate) const DEFAULT_PREFETCH: usize = 8;

/// One rank's tensor-parallel state.
pub(crate) struct TpRank {
    pub(crate) comm: Communicator,
    pub(crate) failure: FailurePolicy,
    rng: Mutex<StdRng>,
    stats: Mutex<TpStats>,
    /// The group is a data-parallel one sharding parameters at rest (ZeRO stage 3, see
    /// `fsdp`): its ranks' activations differ, so only tensors every rank agrees on (parameters,
    /// their gradients and optimizer state, constants) may follow the rules; an op that reads
    /// anything else gathers its sharded inputs and runs locally.
    pub(crate) fully_sharded: bool,
    /// In a fully sharded group: each sharded parameter's placement and whole shape, by the
    /// number of its id (this rank's: ranks that are threads of one process share ids).
    placed: Mutex<std::collections::HashMap<u64, (crate::Placement, Vec<usize>)>>,
    /// How many parameters ZeRO stage 3 gathers ahead of need at a time (see `prefetch`).
    prefetch_depth: std::sync::atomic::AtomicUsize,
    /// Inside `bonfire::forward_only`: the gathers ahead follow an evaluation's forward order,
    /// not training's.
    forward_only: std::sync::atomic::AtomicBool,
    /// The prefetch state (`prefetch::Prefetch` of the inner backend).
    prefetch: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Log the first fallback of each op at info level (`BONFIRE_TP_LOG=1`; at debug level
    /// otherwise).
    log: bool,
}

impl TpRank {
    fn new(
        comm: Communicator,
        failure: FailurePolicy,
        seed: u64,
        fully_sharded: bool,
    ) -> Arc<TpRank> {
        let log = std::env::var("BONFIRE_TP_LOG").is_ok_and(|v| !matches!(v.trim(), "" | "0"));
        Arc::new(TpRank {
            comm,
            failure,
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            stats: Mutex::new(TpStats::default()),
            fully_sharded,
            placed: Mutex::new(std::collections::HashMap::new()),
            prefetch_depth: std::sync::atomic::AtomicUsize::new(DEFAULT_PREFETCH),
            forward_only: std::sync::atomic::AtomicBool::new(false),
            prefetch: Mutex::new(None),
            log,
        })
    }

    /// Ranks in the group.
    pub(crate) fn size(&self) -> usize {
        self.comm.size()
    }

    /// This rank's index in the group.
    pub(crate) fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub(crate) fn rng(&self) -> MutexGuard<'_, StdRng> {
        self.rng.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn reseed(&self, seed: u64) {
        *self.rng() = StdRng::seed_from_u64(seed);
    }

    pub(crate) fn stats(&self) -> MutexGuard<'_, TpStats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many parameters are gathered ahead of need at a time (0: none).
    pub(crate) fn prefetch_depth(&self) -> usize {
        self.prefetch_depth
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_prefetch_depth(&self, depth: usize) {
        self.prefetch_depth
            .store(depth, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the rank runs forward-only passes (`bonfire::forward_only`).
    pub(crate) fn forward_only(&self) -> bool {
        self.forward_only.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_forward_only(&self, on: bool) {
        self.forward_only
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn prefetch_slot(&self) -> MutexGuard<'_, Option<Box<dyn std::any::Any + Send>>> {
        self.prefetch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where parameter `param` (its id's number) is sharded, if it is.
    pub(crate) fn placed(&self, param: u64) -> Option<crate::Placement> {
        self.placed_whole(param).map(|(placement, _)| placement)
    }

    /// Where parameter `param` is sharded, with its whole shape, if it is.
    pub(crate) fn placed_whole(&self, param: u64) -> Option<(crate::Placement, Vec<usize>)> {
        let placed = self.placed.lock().unwrap_or_else(|e| e.into_inner());
        placed.get(&param).cloned()
    }

    /// Records that parameter `param`, of whole shape `shape`, is sharded as `placement`.
    pub(crate) fn place(&self, param: u64, placement: crate::Placement, shape: Vec<usize>) {
        let mut placed = self.placed.lock().unwrap_or_else(|e| e.into_inner());
        placed.insert(param, (placement, shape));
    }

    /// Counts a fallback gather for `op` (and says so once per op, when logging is on).
    pub(crate) fn fallback(&self, op: &'static str, what: impl FnOnce() -> String) {
        let first = {
            let mut s = self.stats();
            let n = s.fallbacks.entry(op).or_default();
            *n += 1;
            *n == 1
        };
        let shown = if self.log {
            tracing::enabled!(tracing::Level::INFO)
        } else {
            tracing::enabled!(tracing::Level::DEBUG)
        };
        if first && shown {
            let line = format!(
                "tensor-parallel rank {} of {}: {op} has no rule for {}; gathered it \
                 (counted in TpStats::fallbacks; later ones are not logged)",
                self.rank(),
                self.size(),
                what()
            );
            if self.log {
                tracing::info!("{line}");
            } else {
                tracing::debug!("{line}");
            }
        }
    }

    /// Stops this rank after a failed collective, by the failure policy. Never returns.
    pub(crate) fn fail(&self, op: &str, error: CollectiveError) -> ! {
        let message = format!(
            "bonfire: tensor-parallel {op} failed on rank {} of the group of {} (world rank {}): \
             {error}",
            self.rank(),
            self.size(),
            self.comm.world_rank().0
        );
        match self.failure {
            FailurePolicy::Exit => {
                bonfire_collectives::fatal(&message);
                std::process::exit(1);
            }
            FailurePolicy::Panic => panic!("{message}"),
        }
    }
}

static PROCESS: RwLock<Option<Arc<TpRank>>> = RwLock::new(None);

thread_local! {
    static THREAD: RefCell<Option<Arc<TpRank>>> = const { RefCell::new(None) };
}

/// The seed the program last gave `B::seed` while no group was bound, on this thread (a rank
/// that is a thread) and in this process (a rank that is a process).
static SEEDED: Mutex<Option<u64>> = Mutex::new(None);

thread_local! {
    static THREAD_SEEDED: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Remembers `seed`, given to `B::seed` outside any group, for the group this thread or process
/// joins next: a model built before its rank joins draws its parameters (lazily, on first use,
/// inside the group) from the program's seed, as one built after joining does.
pub(crate) fn seed_before_joining(seed: u64) {
    THREAD_SEEDED.with(|s| s.set(Some(seed)));
    *SEEDED.lock().unwrap_or_else(|e| e.into_inner()) = Some(seed);
}

/// The seed every rank of `comm`'s group starts its random generator from: rank 0's, broadcast.
/// Rank 0's is the one its program gave `B::seed` before joining, if it did (see
/// [`seed_before_joining`]); else a random one.
fn agreed_seed(comm: &Communicator) -> Result<u64, CollectiveError> {
    let mine = if comm.rank() == 0 {
        THREAD_SEEDED
            .with(std::cell::Cell::get)
            .or_else(|| *SEEDED.lock().unwrap_or_else(|e| e.into_inner()))
            .unwrap_or_else(rand::random::<u64>)
    } else {
        0
    };
    if comm.size() == 1 {
        return Ok(mine);
    }
    let seed = comm.broadcast(vec![mine as i64], 0).wait()?;
    Ok(seed[0] as u64)
}

/// Makes `comm` the group `TensorParallel` shards tensors over in this process (one process per
/// rank, as under `bonfire launch`), failing as `failure` says. Collective: every member calls
/// it (they agree on a random seed). Replaces an earlier group.
pub fn install(comm: Communicator, failure: FailurePolicy) -> Result<(), CollectiveError> {
    install_group(comm, failure, false)
}

pub(crate) fn install_group(
    comm: Communicator,
    failure: FailurePolicy,
    fully_sharded: bool,
) -> Result<(), CollectiveError> {
    let seed = agreed_seed(&comm)?;
    *PROCESS.write().unwrap_or_else(|e| e.into_inner()) =
        Some(TpRank::new(comm, failure, seed, fully_sharded));
    Ok(())
}

/// Binds the calling thread to the group `comm` until the guard drops: `TensorParallel` ops on
/// this thread shard over it, and a failed collective panics (ranks run as threads: the thread's
/// join reports it). A thread's binding wins over [`install`]'s. Collective.
pub fn bind_thread(comm: Communicator) -> Result<TpBindGuard, CollectiveError> {
    bind_group(comm, false)
}

pub(crate) fn bind_group(
    comm: Communicator,
    fully_sharded: bool,
) -> Result<TpBindGuard, CollectiveError> {
    let seed = agreed_seed(&comm)?;
    let rank = TpRank::new(comm, FailurePolicy::Panic, seed, fully_sharded);
    let previous = THREAD.with(|t| t.replace(Some(rank)));
    Ok(TpBindGuard {
        previous,
        _not_send: PhantomData,
    })
}

/// Restores the thread's previous tensor-parallel binding when dropped.
pub struct TpBindGuard {
    previous: Option<Arc<TpRank>>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for TpBindGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        THREAD.with(|t| *t.borrow_mut() = previous);
    }
}

/// The group bound to the calling thread, if any.
pub(crate) fn thread_group() -> Option<Arc<TpRank>> {
    THREAD.with(|t| t.borrow().clone())
}

/// The group installed for the process, if any.
pub(crate) fn process_group() -> Option<Arc<TpRank>> {
    PROCESS.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The calling thread's group: its binding, or the process's.
pub(crate) fn current() -> Option<Arc<TpRank>> {
    if let Some(r) = THREAD.with(|t| t.borrow().clone()) {
        return Some(r);
    }
    PROCESS.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Whether the calling thread's group has one rank, or there is none: every placement then holds
/// the whole tensor, and the ops call the inner backend's own methods (see `gen/passthrough.py`).
pub(crate) fn alone() -> bool {
    if let Some(size) = THREAD.with(|t| t.borrow().as_ref().map(|r| r.size())) {
        return size == 1;
    }
    PROCESS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_none_or(|r| r.size() == 1)
}

/// Whether the calling thread's group shards parameters at rest over data-parallel ranks (see
/// `fsdp`): then an op whose inputs include a tensor the ranks do not agree on falls back.
pub(crate) fn fully_sharded() -> bool {
    if let Some(f) = THREAD.with(|t| t.borrow().as_ref().map(|r| r.fully_sharded)) {
        return f;
    }
    PROCESS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|r| r.fully_sharded)
}

thread_local! {
    static READING_PARTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static PLACING: std::cell::Cell<Option<(u64, Placing)>> = const { std::cell::Cell::new(None) };
}

/// What `to_device` does on a thread inside [`placing`] to a tensor held whole on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placing {
    /// The tensor is a whole value: this rank keeps its slice of it.
    Cut,
    /// The tensor is already this rank's slice (read back from a per-rank checkpoint): it is
    /// marked as that slice of the whole; a tensor of the whole shape is left whole.
    Adopt,
}

/// Runs `f` with every tensor held whole that is moved to a device on this thread
/// (`to_device`) placed as parameter `param` (its id's number) is sharded in the fully sharded
/// group, as `how` says: how a loaded optimizer state is sharded like its parameter (see
/// `fsdp::place_state`).
pub(crate) fn placing<R>(param: u64, how: Placing, f: impl FnOnce() -> R) -> R {
    struct Reset(Option<(u64, Placing)>);
    impl Drop for Reset {
        fn drop(&mut self) {
            PLACING.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(PLACING.with(|c| c.replace(Some((param, how)))));
    f()
}

/// The parameter whose placement `to_device` gives tensors held whole on this thread, and
/// how, if any.
pub(crate) fn placing_param() -> Option<(u64, Placing)> {
    PLACING.with(std::cell::Cell::get)
}

/// Runs `f` with every read of a tensor on this thread (`into_data`, and so every record Burn
/// encodes) giving this rank's part of it (a shard's slice, a pending sum's term) instead of
/// gathering it: what a rank holds in memory, as a per-rank checkpoint saves it. No
/// communication.
pub fn read_parts<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            READING_PARTS.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(READING_PARTS.with(|c| c.replace(true)));
    f()
}

/// Whether reads on this thread give this rank's part (see [`read_parts`]).
pub(crate) fn reading_parts() -> bool {
    READING_PARTS.with(std::cell::Cell::get)
}

/// The communicator of the calling thread's group, if one is bound or installed.
pub fn group() -> Option<Communicator> {
    current().map(|r| r.comm.clone())
}

/// What this rank's tensor-parallel ops have communicated since its group was bound; `None`
/// with no group.
pub fn stats() -> Option<TpStats> {
    current().map(|r| r.stats().clone())
}
