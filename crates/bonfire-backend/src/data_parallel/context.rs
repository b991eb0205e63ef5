//! Where a rank's data-parallel state lives. `DataParallel<B>` is a zero-sized type with static
//! methods, so its state cannot live in `self`: it is found, in this order, through a binding of
//! the calling thread ([`bind_thread`], for ranks run as threads of one process), a binding of
//! the device (burn-train's one-process DDP, one rank per device), or the process's communicator
//! ([`install`], which `bonfire::init` calls).

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use bonfire_collectives::{CommConfig, Communicator};
use burn_backend::DeviceId;

use super::config::{DataParallelConfig, FailurePolicy};
use super::error::SyncError;
use super::state::SyncState;
use super::stats::StepStats;

/// One rank's data-parallel state: its communicator and its gradient buckets.
pub(crate) struct Replica {
    pub(crate) comm: Communicator,
    pub(crate) config: DataParallelConfig,
    /// Average (true, the default) or sum the gradients over the ranks.
    pub(crate) mean: bool,
    state: Mutex<SyncState>,
    stats: Mutex<(StepStats, StepStats)>,
    /// The device lane, once the ranks have agreed on it (CUDA builds).
    #[cfg(feature = "cuda")]
    pub(crate) lane: super::lane::LaneState,
}

impl Replica {
    fn new(comm: Communicator, config: DataParallelConfig, mean: bool) -> Arc<Replica> {
        Arc::new(Replica {
            comm,
            config,
            mean,
            state: Mutex::new(SyncState::default()),
            stats: Mutex::new((StepStats::default(), StepStats::default())),
            #[cfg(feature = "cuda")]
            lane: Default::default(),
        })
    }

    /// Whether every backward runs the gradient path (hook, buckets, all-reduce): with peers, or
    /// alone when the configuration asks for it (`sync_alone`). Otherwise a pass-through.
    pub(crate) fn synchronises(&self) -> bool {
        self.comm.size() > 1 || self.config.sync_alone
    }

    /// The state, even after a panic on another thread left the lock poisoned.
    pub(crate) fn state(&self) -> MutexGuard<'_, SyncState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn record(&self, step: StepStats) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.1.add(&step);
        s.0 = step;
    }

    pub(crate) fn stats(&self) -> (StepStats, StepStats) {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reports a synchronisation failure according to the policy: the one place a data-parallel
    /// failure is turned into an exit or a panic. Never returns.
    pub(crate) fn fail(&self, error: SyncError) -> ! {
        let (world, rank, size) = (
            self.comm.world_rank().0 as usize,
            self.comm.rank(),
            self.comm.size(),
        );
        // Under a data x tensor mesh the group's ranks are not the world's.
        let who = if world == rank {
            format!("rank {rank} of {size}")
        } else {
            format!("rank {world} (data-parallel rank {rank} of {size})")
        };
        self.stop(format!(
            "bonfire: data-parallel gradient sync failed on {who}: {error}"
        ))
    }

    fn stop(&self, message: String) -> ! {
        match self.config.failure {
            FailurePolicy::Exit => {
                bonfire_collectives::fatal(&message);
                std::process::exit(1);
            }
            FailurePolicy::Panic => panic!("{message}"),
        }
    }
}

/// Stops this rank's part of the job with `message` (prefixed with the rank), as a failed
/// gradient synchronisation would: by the [`FailurePolicy`] of the communicator
/// [`communicator`] returns for `device` (under `bonfire launch`: the message on standard error
/// and exit status 1, which makes the launcher stop the other ranks). For training loops that
/// find the ranks disagree (different data set sizes, a checkpoint one rank cannot read).
pub fn abort<D: burn_backend::DeviceOps>(device: &D, message: impl std::fmt::Display) -> ! {
    let rep = for_device(device);
    rep.stop(format!(
        "bonfire: rank {} of {}: {message}",
        rep.comm.world_rank().0,
        rep.comm.size()
    ))
}

static PROCESS: RwLock<Option<Arc<Replica>>> = RwLock::new(None);

thread_local! {
    static THREAD: RefCell<Option<Arc<Replica>>> = const { RefCell::new(None) };
    /// The ranks this thread claimed from shared device pools, by device.
    static CLAIMS: RefCell<Vec<(DeviceId, Arc<Replica>)>> = const { RefCell::new(Vec::new()) };
}

/// The ranks bound to each device of a one-process job, and which of them threads have claimed.
/// Several ranks may share one device (`vec![FlexDevice; 2]`: two replicas trained by two
/// threads on the same CPU backend); each thread that trains on the device claims one of them.
#[derive(Default)]
struct DevicePool {
    replicas: Vec<Arc<Replica>>,
    claimed: usize,
}

fn devices() -> &'static Mutex<HashMap<DeviceId, DevicePool>> {
    static DEVICES: std::sync::OnceLock<Mutex<HashMap<DeviceId, DevicePool>>> =
        std::sync::OnceLock::new();
    DEVICES.get_or_init(Default::default)
}

/// Makes `comm` the communicator `DataParallel` reduces gradients over in this process (one
/// process per rank, as under `bonfire launch`). `bonfire::init` calls it; call it yourself only
/// with a communicator of your own. Replaces an earlier one, with its buckets.
pub fn install(comm: Communicator, config: DataParallelConfig) {
    *PROCESS.write().unwrap_or_else(|e| e.into_inner()) = Some(Replica::new(comm, config, true));
}

/// Binds the calling thread to `comm` until the guard drops: `DataParallel` on this thread
/// reduces gradients over it. For ranks run as threads of one process (tests, examples);
/// a binding of the thread wins over [`install`]'s.
pub fn bind_thread(comm: Communicator, config: DataParallelConfig) -> BindGuard {
    let previous = THREAD.with(|t| t.replace(Some(Replica::new(comm, config, true))));
    BindGuard {
        previous,
        _not_send: PhantomData,
    }
}

/// Restores the thread's previous binding when dropped.
pub struct BindGuard {
    previous: Option<Arc<Replica>>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for BindGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        THREAD.with(|t| *t.borrow_mut() = previous);
    }
}

/// Gives each device of a one-process job its own rank, over an in-process group (burn-train's
/// DDP strategy calls this through `DistributedBackend::start_communication_server`). A device
/// listed `k` times gets `k` ranks; each thread that trains on it claims one (see [`current`]).
pub(crate) fn bind_devices(ids: &[DeviceId], mean: bool) {
    let comms = Communicator::in_process(ids.len(), CommConfig::default());
    let mut config = DataParallelConfig::from_env().unwrap_or_else(|e| {
        tracing::warn!("bonfire: {e}; using the default data-parallel settings");
        DataParallelConfig::default()
    });
    // One process: a panic in a worker thread is reported by burn-train.
    config.failure = FailurePolicy::Panic;
    let mut map = devices().lock().unwrap_or_else(|e| e.into_inner());
    for id in ids {
        map.remove(id);
    }
    for (id, comm) in ids.iter().zip(comms) {
        map.entry(*id)
            .or_default()
            .replicas
            .push(Replica::new(comm, config.clone(), mean));
    }
}

pub(crate) fn unbind_device(id: DeviceId) {
    devices()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id);
}

/// The replica for a call on `device`: the thread's, the device's, or the process's.
///
/// A device gives each thread the rank it claimed on its first call, or the next unclaimed one;
/// a thread that finds them all claimed by others gets the first (it is not one of the job's
/// training threads).
pub(crate) fn current(device: Option<DeviceId>) -> Option<Arc<Replica>> {
    if let Some(r) = THREAD.with(|t| t.borrow().clone()) {
        return Some(r);
    }
    if let Some(id) = device
        && let Some(r) = from_pool(id)
    {
        return Some(r);
    }
    PROCESS.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Whether a call on `device` from this thread finds the process's replica (one process per
/// rank, as under `bonfire launch`), not one bound to this thread or claimed for its device
/// (ranks that are threads of one process).
pub(crate) fn process_wide<D: burn_backend::DeviceOps>(device: &D) -> bool {
    THREAD.with(|t| t.borrow().is_none()) && from_pool(device.id()).is_none()
}

fn from_pool(id: DeviceId) -> Option<Arc<Replica>> {
    let mut map = devices().lock().unwrap_or_else(|e| e.into_inner());
    CLAIMS.with(|claims| {
        let mut claims = claims.borrow_mut();
        if let Some(k) = claims.iter().position(|(d, _)| *d == id) {
            // A claim outlives its pool's removal: burn-train closes the communication server
            // as soon as the other workers have joined, possibly while this worker is still
            // finishing its last backward. It ends when a new job binds the device.
            let mine = &claims[k].1;
            if map
                .get(&id)
                .is_none_or(|p| p.replicas.iter().any(|r| Arc::ptr_eq(r, mine)))
            {
                return Some(mine.clone());
            }
            claims.swap_remove(k);
        }
        let pool = map.get_mut(&id)?;
        if pool.claimed < pool.replicas.len() {
            let r = pool.replicas[pool.claimed].clone();
            pool.claimed += 1;
            claims.push((id, r.clone()));
            Some(r)
        } else {
            Some(pool.replicas[0].clone())
        }
    })
}

/// The communicator `DataParallel` reduces gradients over for a call on `device` from this
/// thread: the thread's binding, the device's rank, the job's (installed by `bonfire::init`), or
/// a world of one when the process joined no job. Training loops use it to learn their rank and
/// to agree with the other ranks (burn-train's data-parallel strategy does).
pub fn communicator<D: burn_backend::DeviceOps>(device: &D) -> Communicator {
    for_device(device).comm.clone()
}

/// The failure policy of the replica for a call on `device`.
pub(crate) fn failure_policy<D: burn_backend::DeviceOps>(device: &D) -> crate::FailurePolicy {
    for_device(device).config.failure
}

/// The replica for a call on `device`: [`current`]'s, or a world of one.
pub(crate) fn for_device<D: burn_backend::DeviceOps>(device: &D) -> Arc<Replica> {
    current(Some(device.id())).unwrap_or_else(solo)
}

/// The statistics of this rank's last synchronised step (this thread's rank, or the process's).
/// `None` before `bonfire::init` (or a thread binding).
pub fn last_step_stats() -> Option<StepStats> {
    current(None).map(|r| r.stats().0)
}

/// The sum of every synchronised step's statistics on this rank.
pub fn total_stats() -> Option<StepStats> {
    current(None).map(|r| r.stats().1)
}

/// The replica of a process that joined no job: a world of one, so that `DataParallel` is a
/// pass-through and [`crate::no_sync`] still accumulates.
fn solo() -> Arc<Replica> {
    static SOLO: std::sync::OnceLock<Arc<Replica>> = std::sync::OnceLock::new();
    if let Some(message) = forgot_init(|name| std::env::var(name).ok()) {
        panic!("{message}");
    }
    SOLO.get_or_init(|| {
        let comm = Communicator::in_process(1, CommConfig::default()).remove(0);
        Replica::new(comm, DataParallelConfig::default(), true)
    })
    .clone()
}

/// Why a process that joined no job must not train as a world of one: the environment (a
/// launcher's `RANK` and `WORLD_SIZE`, or Slurm's `SLURM_PROCID` and `SLURM_NTASKS`) says it is
/// one rank of several, so `bonfire::init()` was forgotten and each rank would train alone.
fn forgot_init(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    let num = |name: &str| var(name)?.trim().parse::<usize>().ok();
    let (rank, world, from) = match (num("RANK"), num("WORLD_SIZE")) {
        (Some(r), Some(w)) => (r, w, "RANK/WORLD_SIZE"),
        _ => (
            num("SLURM_PROCID")?,
            num("SLURM_NTASKS")?,
            "SLURM_PROCID/SLURM_NTASKS",
        ),
    };
    (world > 1).then(|| forgot_init_message(rank, world, from))
}

/// What a rank of `world` that never called `bonfire::init()` is told (`from` names the
/// variables that said it is rank `rank`).
pub fn forgot_init_message(rank: usize, world: usize, from: &str) -> String {
    format!(
        "bonfire: this process is rank {rank} of {world} (from {from}) but bonfire::init() \
         was not called, so DataParallel has no job to average gradients over and each rank \
         would train alone; call bonfire::init() before building the model (or unset \
         {from} to train as one process)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_of_several_that_did_not_join_is_told() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let m = forgot_init(env(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
        assert!(
            m.starts_with("bonfire: this process is rank 1 of 2 (from RANK/WORLD_SIZE) but bonfire::init() was not called"),
            "{m}"
        );
        let m = forgot_init(env(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")])).unwrap();
        assert!(
            m.contains("rank 3 of 4 (from SLURM_PROCID/SLURM_NTASKS)"),
            "{m}"
        );
        assert_eq!(
            forgot_init(env(&[("RANK", "0"), ("WORLD_SIZE", "1")])),
            None
        );
        assert_eq!(forgot_init(env(&[])), None);
    }

    #[test]
    fn each_bound_device_is_its_own_rank_and_threads_win() {
        let ids = [
            DeviceId {
                type_id: 90,
                index_id: 0,
            },
            DeviceId {
                type_id: 90,
                index_id: 1,
            },
        ];
        bind_devices(&ids, true);
        let r0 = current(Some(ids[0])).expect("bound");
        let r1 = current(Some(ids[1])).expect("bound");
        assert_eq!((r0.comm.rank(), r1.comm.rank()), (0, 1));
        assert_eq!(r0.comm.size(), 2);
        assert!(r0.mean && r0.config.failure == FailurePolicy::Panic);
        {
            let _t = bind_thread(
                Communicator::in_process(1, CommConfig::default()).remove(0),
                DataParallelConfig::default(),
            );
            assert_eq!(current(Some(ids[1])).unwrap().comm.size(), 1);
        }
        assert_eq!(current(Some(ids[1])).unwrap().comm.rank(), 1);
        unbind_device(ids[0]);
        unbind_device(ids[1]);
        // A thread that trained on a device keeps its rank after the server closes (it may
        // still be finishing its last backward); other threads fall back to the process's.
        assert_eq!(current(Some(ids[0])).unwrap().comm.rank(), 0);
        let other = std::thread::spawn(move || current(Some(ids[0])).map(|r| r.comm.size()));
        assert!(
            other.join().unwrap().is_none_or(|n| n != 2),
            "unbound devices fall back to the process's communicator"
        );
        // A new job on the device replaces the old claims.
        bind_devices(&ids[..1], true);
        assert!(!Arc::ptr_eq(&current(Some(ids[0])).unwrap(), &r0));
        unbind_device(ids[0]);
    }

    #[test]
    fn a_device_listed_twice_gives_each_thread_its_own_rank() {
        let id = DeviceId {
            type_id: 91,
            index_id: 0,
        };
        bind_devices(&[id, id], true);
        let ranks: Vec<(usize, usize)> = (0..2)
            .map(|_| {
                std::thread::spawn(move || {
                    let first = current(Some(id)).expect("bound").comm.rank();
                    let again = current(Some(id)).expect("bound").comm.rank();
                    (first, again)
                })
            })
            .map(|h| h.join().unwrap())
            .collect();
        let mut firsts: Vec<usize> = ranks.iter().map(|r| r.0).collect();
        firsts.sort();
        assert_eq!(firsts, vec![0, 1], "each thread claims its own rank");
        assert!(ranks.iter().all(|(a, b)| a == b), "and keeps it: {ranks:?}");
        // A third thread finds every rank claimed and is not a training thread.
        let third = std::thread::spawn(move || current(Some(id)).unwrap().comm.rank());
        assert_eq!(third.join().unwrap(), 0);
        unbind_device(id);
    }
}
