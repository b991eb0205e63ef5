//! The link's own limit on this host, for `bonfire bench link`: raw QUIC streams between two
//! endpoints of this process on 127.0.0.1, with bonfire's TLS and transport settings but no
//! rendezvous, frames or mailbox, so a benchmark can tell the link's cost from bonfire's.

use std::error::Error;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use quinn::VarInt;

use super::auth::Identity;
use super::control::CLOSE_SHUTDOWN;
use super::endpoint::endpoint;
use super::error::SetupError;

/// Why [`loopback_throughput`] could not measure.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// An endpoint could not be set up.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// A step of the transfer failed.
    #[error("{step}: {source}")]
    Transfer {
        /// What was being done, in words.
        step: &'static str,
        /// The cause.
        source: Box<dyn Error + Send + Sync>,
    },
    /// The receiving endpoint closed before the connection arrived.
    #[error("no connection")]
    NoConnection,
    /// Fewer bytes arrived than were written.
    #[error("read {read} bytes, wrote {wrote}")]
    Short {
        /// Bytes read.
        read: usize,
        /// Bytes written.
        wrote: usize,
    },
}

/// The error of one step of the transfer, for `map_err`.
fn failed<E: Error + Send + Sync + 'static>(step: &'static str) -> impl FnOnce(E) -> BenchError {
    move |e| BenchError::Transfer {
        step,
        source: Box::new(e),
    }
}

/// The link's own limit: `bytes` bytes written in 1 MiB chunks over `streams` streams of one
/// connection between two endpoints of this process on 127.0.0.1, with bonfire's TLS and
/// transport settings. Returns GB/s (10^9 bytes per second), measured from the first write to
/// the last byte read. Must run inside a Tokio runtime with I/O and time enabled.
pub async fn loopback_throughput(bytes: usize, streams: usize) -> Result<f64, BenchError> {
    let streams = streams.max(1);
    let local: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let timeout = Duration::from_secs(10);
    let server = endpoint(local, &Identity::generate()?, timeout, streams)?;
    let client = endpoint(local, &Identity::generate()?, timeout, streams)?;
    let addr = server
        .local_addr()
        .map_err(failed("reading the receiver's address"))?;
    let per_stream = bytes / streams / (1 << 20);
    let reader = tokio::spawn(async move {
        let conn = server
            .accept()
            .await
            .ok_or(BenchError::NoConnection)?
            .await
            .map_err(failed("accepting the connection"))?;
        let mut readers = Vec::new();
        for _ in 0..streams {
            let mut s = conn
                .accept_uni()
                .await
                .map_err(failed("accepting a stream"))?;
            readers.push(tokio::spawn(async move {
                let mut n = 0usize;
                while let Ok(Some(chunk)) = s.read_chunk(usize::MAX, true).await {
                    n += chunk.bytes.len();
                }
                n
            }));
        }
        let mut total = 0;
        for r in readers {
            total += r.await.map_err(failed("a reading task"))?;
        }
        Ok::<(usize, Instant), BenchError>((total, Instant::now()))
    });
    let conn = client
        .connect(addr, "bonfire")
        .map_err(failed("connecting"))?
        .await
        .map_err(failed("connecting"))?;
    let chunk = Bytes::from(vec![0x5au8; 1 << 20]);
    let start = Instant::now();
    let mut writers = Vec::new();
    for _ in 0..streams {
        let mut s = conn.open_uni().await.map_err(failed("opening a stream"))?;
        let chunk = chunk.clone();
        writers.push(tokio::spawn(async move {
            for _ in 0..per_stream {
                s.write_chunk(chunk.clone())
                    .await
                    .map_err(failed("writing"))?;
            }
            s.finish().map_err(failed("finishing a stream"))?;
            s.stopped()
                .await
                .map_err(failed("waiting for the reader to finish"))?;
            Ok::<(), BenchError>(())
        }));
    }
    for w in writers {
        w.await.map_err(failed("a writing task"))??;
    }
    let (total, end) = reader.await.map_err(failed("the reading task"))??;
    let wrote = per_stream * streams * (1 << 20);
    if total != wrote {
        return Err(BenchError::Short { read: total, wrote });
    }
    conn.close(VarInt::from_u32(CLOSE_SHUTDOWN), b"done");
    Ok(total as f64 / (end - start).as_secs_f64() / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn loopback_moves_every_byte() {
        let gbps = loopback_throughput(4 << 20, 2).await.unwrap();
        assert!(gbps.is_finite() && gbps > 0.0, "{gbps}");
    }
}
