use std::sync::{Arc, Mutex};
use std::time::Duration;

use bonfire_collectives::{CommConfig, Communicator};
use bonfire_topology::Rank;
use bonfire_transport::{InProcess, Mailbox, SendFuture, Tag, Transport};
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A transport that delivers each frame after a random delay in `0..=max_delay`, so frames
/// overtake each other. Seeded.
pub struct ChaosTransport {
    inner: Arc<dyn Transport>,
    max_delay: Duration,
    rng: Mutex<ChaCha8Rng>,
}

impl ChaosTransport {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Transport>, max_delay: Duration, seed: u64) -> ChaosTransport {
        ChaosTransport {
            inner,
            max_delay,
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(seed)),
        }
    }
}

impl Transport for ChaosTransport {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> SendFuture<'_> {
        let micros = self.max_delay.as_micros() as u64;
        let delay = {
            let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
            Duration::from_micros(rng.random_range(0..=micros))
        };
        let inner = self.inner.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            // A frame to a rank that is gone is lost, as on a network.
            let _ = inner.send(to, tag, payload).await;
        });
        Box::pin(std::future::ready(Ok(())))
    }

    fn mailbox(&self) -> &Arc<Mailbox> {
        self.inner.mailbox()
    }

    fn kind(&self) -> &'static str {
        "chaos"
    }
}

/// `n` communicators over an in-process transport whose frames are delayed by up to
/// `max_delay`, rank `r` seeded with `seed + r`.
pub fn chaos_world(
    n: usize,
    config: CommConfig,
    max_delay: Duration,
    seed: u64,
) -> Vec<Communicator> {
    InProcess::world(n)
        .into_iter()
        .enumerate()
        .map(|(r, t)| {
            let chaos = ChaosTransport::new(Arc::new(t), max_delay, seed.wrapping_add(r as u64));
            Communicator::builder(Arc::new(chaos))
                .config(config.clone())
                .build()
                .expect("a single-node layout always fits")
        })
        .collect()
}
