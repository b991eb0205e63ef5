use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bonfire_collectives::Communicator;

/// Runs `f` once per communicator, each on its own thread named `rank-<i>`, and returns the
/// results in rank order.
///
/// # Panics
/// If a rank panics (the message names it) or if some ranks have not finished after `deadline`
/// (the message lists them; their threads are left behind).
pub fn run_ranks<R, F>(comms: Vec<Communicator>, deadline: Duration, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(Communicator) -> R + Send + Sync + 'static,
{
    let n = comms.len();
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for (i, comm) in comms.into_iter().enumerate() {
        let f = f.clone();
        let tx = tx.clone();
        std::thread::Builder::new()
            .name(format!("rank-{i}"))
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                let _ = tx.send((i, result.map_err(panic_text)));
            })
            .expect("cannot spawn a rank thread");
    }
    drop(tx);
    let start = Instant::now();
    let mut results: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok((i, Ok(r))) => results[i] = Some(r),
            Ok((i, Err(msg))) => panic!("rank {i} panicked: {msg}"),
            Err(_) => {
                let missing: Vec<usize> = (0..n).filter(|&i| results[i].is_none()).collect();
                panic!("ranks {missing:?} did not finish within {deadline:?}");
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every rank reported"))
        .collect()
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic".into()
    }
}

/// `world` ranks over the in-process transport, each collective timing out after `timeout`.
pub fn in_process_ranks(world: usize, timeout: Duration) -> Vec<Communicator> {
    Communicator::in_process(
        world,
        bonfire_collectives::CommConfig {
            timeout,
            ..bonfire_collectives::CommConfig::default()
        },
    )
}

/// Binds the calling thread, a rank of a check, to `comm` for `DataParallel`, with failures as
/// panics (so the check names them) instead of exits.
pub fn bind_rank(comm: Communicator) -> bonfire_backend::BindGuard {
    bonfire_backend::bind_thread(
        comm,
        bonfire_backend::DataParallelConfig {
            failure: bonfire_backend::FailurePolicy::Panic,
            ..bonfire_backend::DataParallelConfig::default()
        },
    )
}

/// One model per rank, made before the rank threads start and taken by each rank's thread: made
/// up front, so that no rank reseeds the process's random generator while another draws from it.
pub struct RankModels<M>(std::sync::Arc<std::sync::Mutex<Vec<Option<M>>>>);

impl<M> Clone for RankModels<M> {
    fn clone(&self) -> Self {
        RankModels(self.0.clone())
    }
}

impl<M> RankModels<M> {
    /// These models, rank by rank.
    pub fn new(models: Vec<M>) -> Self {
        RankModels(std::sync::Arc::new(std::sync::Mutex::new(
            models.into_iter().map(Some).collect(),
        )))
    }

    /// `world` models, rank `r`'s made by `make` from seed `seed(r)` (see
    /// [`crate::nets::seeded`]): different ones, so that a check sees `replicate` copy rank 0's.
    pub fn seeded<B: burn::tensor::backend::Backend>(
        world: usize,
        seed: impl Fn(usize) -> u64,
        device: &B::Device,
        make: impl Fn(&B::Device) -> M,
    ) -> Self
    where
        M: burn::module::Module<B>,
    {
        Self::new(
            (0..world)
                .map(|r| crate::nets::seeded::<B, _>(seed(r), device, &make))
                .collect(),
        )
    }

    /// Rank `rank`'s model (once).
    pub fn take(&self, rank: usize) -> M {
        self.0.lock().unwrap_or_else(|e| e.into_inner())[rank]
            .take()
            .expect("one model per rank")
    }
}
