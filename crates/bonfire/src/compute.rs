//! Where a rank's CPU compute runs.
//!
//! Burn's CPU backends (Flex, NdArray) run their parallel ops on rayon. Called from a thread that
//! is not one of rayon's workers, such an op is handed to a thread of rayon's global pool while
//! the caller sleeps; between ops that pool thread spins before it sleeps. Under
//! `bonfire launch` every rank of a 2-core node has one compute thread (`RAYON_NUM_THREADS=1`),
//! so each rank keeps two threads busy: the spinning one takes the core another rank needs, and
//! that rank comes late to the gradient all-reduce (BENCHMARKS.md, issue 30, "Who is late").

/// The calling thread as worker 0 of a rayon pool of its own; keep it alive while training.
///
/// Returned by [`compute_on_this_thread`]. Dropping it ends the pool's other workers; the
/// calling thread stays the pool's worker (rayon cannot undo that) and runs any later parallel
/// op alone.
#[must_use = "the pool's other workers end when this is dropped"]
pub struct ComputeThread {
    _pool: rayon::ThreadPool,
}

impl std::fmt::Debug for ComputeThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputeThread")
            .field("threads", &self._pool.current_num_threads())
            .finish()
    }
}

impl ComputeThread {
    /// Threads in the pool, the calling thread included.
    pub fn threads(&self) -> usize {
        self._pool.current_num_threads()
    }
}

/// Makes the calling thread worker 0 of a rayon pool of its own (`RAYON_NUM_THREADS` threads in
/// all, which `bonfire train` sets to the node's cores over its ranks; else one per compute CPU
/// of the rank's placement, else one per core), so
/// that the parallel ops of Burn's CPU backends called on it run on it instead of on a thread of
/// rayon's global pool. With one thread per rank, a rank then keeps one core busy, not two: on
/// a 2-core machine this made the bundled vision job 6.5% faster at 2 ranks and the mnist-style
/// example's weak scaling steadier (BENCHMARKS.md, issue 30).
///
/// Call it first on the thread that trains, and keep the guard while it trains:
///
/// ```
/// let _compute = bonfire::compute_on_this_thread(); // before bonfire::init() and the model
/// // ...bonfire::init(), the model, the training loop on this thread...
/// ```
///
/// Only this thread changes: every other thread keeps rayon's global pool, so no other thread
/// can wait on a worker that is busy training. One caveat: a job given to `rayon::spawn` on this
/// thread goes to this pool, whose worker 0 (this thread) runs it only inside a parallel op; with
/// one thread in the pool, spawn such jobs from another thread. `None` (nothing changes) when
/// this thread already is a rayon worker or the pool cannot be made.
pub fn compute_on_this_thread() -> Option<ComputeThread> {
    compute_threads(0)
}

/// [`compute_on_this_thread`] with `threads` threads in all (0: `RAYON_NUM_THREADS`, else one
/// per compute CPU of the rank's placement, else one per core).
///
/// The pool's threads, the calling one included, run on the rank's compute CPUs when its
/// placement has any ([`crate::transport::placement`]: under `bonfire launch --cpu-bind cores`
/// a block of 3 CPUs or more keeps its last one for communication).
pub fn compute_threads(threads: usize) -> Option<ComputeThread> {
    use crate::transport::placement::{self, Role};
    let placed = placement::current().map_or(0, |p| p.compute.len());
    let threads = match threads {
        0 if std::env::var_os("RAYON_NUM_THREADS").is_none() => placed,
        n => n,
    };
    if rayon::current_thread_index().is_some() {
        return None;
    }
    placement::enter(Role::Compute);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("bonfire-compute-{i}"))
        .start_handler(|_| placement::enter(Role::Compute))
        .use_current_thread()
        .build()
        .ok()
        .map(|pool| ComputeThread { _pool: pool })
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    use super::*;

    /// The thread that made the pool runs one-thread parallel work itself; without the pool it
    /// goes to a thread of rayon's global pool.
    #[test]
    fn a_rank_thread_runs_its_parallel_ops_itself() {
        std::thread::spawn(|| {
            let me = std::thread::current().id();
            let compute = compute_threads(1).expect("a pool");
            assert_eq!(compute.threads(), 1);
            let ran_on: Vec<_> = (0..64)
                .into_par_iter()
                .map(|_| std::thread::current().id())
                .collect();
            assert!(ran_on.iter().all(|&t| t == me), "{ran_on:?}");
            // A second pool cannot take a thread that already is a worker.
            assert!(compute_on_this_thread().is_none());
            drop(compute);
            // After the guard is gone the thread still runs its parallel work alone.
            let after: Vec<_> = (0..64)
                .into_par_iter()
                .map(|_| std::thread::current().id())
                .collect();
            assert!(after.iter().all(|&t| t == me), "{after:?}");
        })
        .join()
        .unwrap();
        // Any other thread still has the global pool.
        let other: Vec<_> = (0..4)
            .into_par_iter()
            .map(|_| rayon::current_thread_index())
            .collect();
        assert!(other.iter().all(Option::is_some), "{other:?}");
    }
}

/// The largest block glibc's `malloc` hands out from its heaps instead of its own `mmap` (the
/// most glibc accepts on 64-bit targets).
pub const HEAP_BLOCK_MAX: usize = 32 << 20;
/// Free memory at the top of a heap that glibc keeps instead of handing it back to the system.
pub const HEAP_KEEP: usize = 256 << 20;

/// What [`steady_heap`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeapSetting {
    /// glibc's thresholds are fixed at [`HEAP_BLOCK_MAX`] and [`HEAP_KEEP`].
    Fixed,
    /// Left as they were: `BONFIRE_MALLOC=system`, or the process set glibc's malloc tunables
    /// itself (`GLIBC_TUNABLES` with `glibc.malloc`, or a `MALLOC_*_` variable).
    LeftAlone,
    /// Not a glibc target.
    NotGlibc,
}

/// Fixes glibc's `malloc` thresholds for a training process: blocks up to [`HEAP_BLOCK_MAX`]
/// come from its heaps, and freed memory stays there (up to [`HEAP_KEEP`] at the top of a
/// heap) for the next step, instead of going back to the system and being faulted in, zeroed,
/// again. [`crate::init`] calls it, so every rank of a job runs with it.
///
/// glibc adjusts both thresholds as a program runs, and where a heap's top happens to be free
/// when it checks depends on which thread freed what first. Measured on the mnist-style example
/// at 2 ranks on 2 cores (BENCHMARKS.md, "Page faults decided which rank was late"), one rank
/// in some runs took 0.84-1.37 million page faults where the other took 0.08-0.54 million,
/// spent 1.3-1.9 s in the kernel, and computed its backward about 1 ms slower per step; the
/// other rank waited for it every step. With the thresholds fixed every rank takes 33-59
/// thousand, run after run.
///
/// The cost is memory that stays with the process: its heaps keep their peak size (plus
/// [`HEAP_KEEP`]) until it exits, as PyTorch's caching allocators keep theirs.
/// `BONFIRE_MALLOC=system` leaves glibc's behaviour alone, and so does setting glibc's own
/// tunables.
pub fn steady_heap() -> HeapSetting {
    let env = |k: &str| std::env::var_os(k);
    if env("BONFIRE_MALLOC").is_some_and(|v| v == "system")
        || env("GLIBC_TUNABLES").is_some_and(|v| v.to_string_lossy().contains("glibc.malloc"))
        || std::env::vars_os().any(|(k, _)| k.to_string_lossy().starts_with("MALLOC_"))
    {
        return HeapSetting::LeftAlone;
    }
    fix_thresholds()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn fix_thresholds() -> HeapSetting {
    // SAFETY: mallopt only sets glibc's allocator parameters; it takes its own lock.
    let set = |param, value: usize| unsafe { libc::mallopt(param, value as libc::c_int) == 1 };
    // Either call turns glibc's adjusting of both thresholds off.
    if set(libc::M_MMAP_THRESHOLD, HEAP_BLOCK_MAX) && set(libc::M_TRIM_THRESHOLD, HEAP_KEEP) {
        HeapSetting::Fixed
    } else {
        HeapSetting::LeftAlone
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn fix_thresholds() -> HeapSetting {
    HeapSetting::NotGlibc
}
