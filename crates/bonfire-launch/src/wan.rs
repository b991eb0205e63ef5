//! A slow link between two sites on one host, made in user space: relays that carry UDP
//! datagrams across a [`Link`] with a one-way delay, random loss and a bandwidth cap behind a
//! bounded queue (what `tc netem` with a rate does, for machines where qdiscs are not allowed).
//!
//! Each direction of the link is one [`Link`]: every datagram that crosses in that direction,
//! whichever [`UdpRelay`] took it in, is paced by the same cap and counted in the same
//! [`LinkStats`]. A relay listens at a front address and forwards each client's datagrams to one
//! upstream address (one upstream socket per client, so replies find their way back), through
//! the `forward` link, and the replies through the `back` link. [`TcpForward`] carries a TCP
//! port across unchanged (the launchers' control connection: a few small messages, not the
//! traffic under study).
//!
//! `bonfire bench wan` puts two launchers in two network namespaces ([`crate::netns`]) with
//! these relays as the only path between them.

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Bytes of IPv4 and UDP header each datagram carries on a real link, counted against the cap.
pub const HEADER_BYTES: usize = 28;

/// What one direction of a link does to a datagram.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkSpec {
    /// Time from leaving the queue to arriving (half a round trip).
    pub delay: Duration,
    /// Fraction of datagrams dropped at random, in [0, 1).
    pub loss: f64,
    /// The cap, bits per second (datagram plus [`HEADER_BYTES`]); `None` for no cap.
    pub rate: Option<f64>,
    /// The longest a datagram may wait behind others for the cap; one that would wait longer is
    /// dropped (a router's tail drop).
    pub queue: Duration,
    /// Seeds the loss.
    pub seed: u64,
}

impl LinkSpec {
    /// Checks the numbers: loss in [0, 1), a positive finite rate.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..1.0).contains(&self.loss) {
            return Err(format!("loss {} is not in [0, 1)", self.loss));
        }
        if let Some(r) = self.rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err(format!("rate {r} bit/s is not a positive number"));
        }
        Ok(())
    }
}

/// What crossed one direction of a link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Datagrams offered to the link.
    pub datagrams: u64,
    /// Their bytes (payload only).
    pub bytes: u64,
    /// Dropped at random.
    pub lost: u64,
    /// Dropped because the queue behind the cap was full.
    pub overflowed: u64,
    /// Delivered.
    pub delivered: u64,
    /// The longest any delivered datagram waited in the queue, microseconds.
    pub max_wait_us: u64,
}

struct Pending {
    due: Instant,
    bytes: Vec<u8>,
    to: SocketAddr,
    via: Arc<UdpSocket>,
}

struct Pacing {
    next_free: Instant,
    rng: StdRng,
}

/// One direction of a link: a queue with a sender thread that delivers each datagram when it is
/// due.
pub struct Link {
    spec: LinkSpec,
    pacing: Mutex<Pacing>,
    queue: Mutex<VecDeque<Pending>>,
    ready: Condvar,
    stop: AtomicBool,
    datagrams: AtomicU64,
    bytes: AtomicU64,
    lost: AtomicU64,
    overflowed: AtomicU64,
    delivered: AtomicU64,
    max_wait_us: AtomicU64,
}

impl Link {
    /// A link direction, with its sender thread running until [`Link::stop`].
    pub fn start(spec: LinkSpec) -> Result<Arc<Link>, String> {
        spec.validate()?;
        let link = Arc::new(Link {
            spec,
            pacing: Mutex::new(Pacing {
                next_free: Instant::now(),
                rng: StdRng::seed_from_u64(spec.seed),
            }),
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            stop: AtomicBool::new(false),
            datagrams: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            overflowed: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            max_wait_us: AtomicU64::new(0),
        });
        // The thread holds the link weakly: it ends at `stop`, or once the link is dropped.
        let sender = Arc::downgrade(&link);
        std::thread::Builder::new()
            .name("wan-link".into())
            .spawn(move || Self::deliver(sender))
            .map_err(|e| format!("starting the link's sender thread: {e}"))?;
        Ok(link)
    }

    /// The spec it was started with.
    pub fn spec(&self) -> LinkSpec {
        self.spec
    }

    /// What crossed so far.
    pub fn stats(&self) -> LinkStats {
        LinkStats {
            datagrams: self.datagrams.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
            overflowed: self.overflowed.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            max_wait_us: self.max_wait_us.load(Ordering::Relaxed),
        }
    }

    /// Stops the sender thread; datagrams still queued are not delivered.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.ready.notify_all();
    }

    /// Offers one datagram, to be sent to `to` from `via` when the link delivers it.
    pub fn offer(&self, bytes: Vec<u8>, to: SocketAddr, via: Arc<UdpSocket>) {
        self.datagrams.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        // The pacing lock is held until the datagram is queued: due times only grow (one
        // constant delay after a clock that only grows), so the queue stays in delivery order
        // whichever thread offers.
        let mut p = self.pacing.lock().unwrap_or_else(|e| e.into_inner());
        if self.spec.loss > 0.0 && p.rng.random_bool(self.spec.loss) {
            self.lost.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let now = Instant::now();
        let start = p.next_free.max(now);
        let wait = start - now;
        if wait > self.spec.queue {
            self.overflowed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.max_wait_us
            .fetch_max(wait.as_micros() as u64, Ordering::Relaxed);
        let on_wire = match self.spec.rate {
            Some(r) => Duration::from_secs_f64((bytes.len() + HEADER_BYTES) as f64 * 8.0 / r),
            None => Duration::ZERO,
        };
        p.next_free = start + on_wire;
        let due = start + on_wire + self.spec.delay;
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back(Pending {
            due,
            bytes,
            to,
            via,
        });
        drop(p);
        self.ready.notify_one();
    }

    fn deliver(link: std::sync::Weak<Link>) {
        while let Some(link) = link.upgrade() {
            if link.stop.load(Ordering::Relaxed) {
                return;
            }
            let next = {
                let mut q = link.queue.lock().unwrap_or_else(|e| e.into_inner());
                if q.is_empty() {
                    q = link
                        .ready
                        .wait_timeout(q, Duration::from_millis(50))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                q.pop_front()
            };
            if let Some(p) = next {
                std::thread::sleep(p.due.saturating_duration_since(Instant::now()));
                if p.via.send_to(&p.bytes, p.to).is_ok() {
                    link.delivered.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// A relay: datagrams to its front address cross `forward` to the upstream address, and the
/// upstream's replies cross `back` to the client that sent them. Stops when dropped.
pub struct UdpRelay {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl UdpRelay {
    /// Listens at `front` (port 0 picks one) and relays to `upstream`.
    pub fn start(
        front: SocketAddr,
        upstream: SocketAddr,
        forward: Arc<Link>,
        back: Arc<Link>,
    ) -> io::Result<UdpRelay> {
        let socket = Arc::new(UdpSocket::bind(front)?);
        socket.set_read_timeout(Some(Duration::from_millis(50)))?;
        let addr = socket.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("wan-relay".into())
            .spawn(move || {
                let mut clients: Vec<(SocketAddr, Arc<UdpSocket>)> = Vec::new();
                let mut buf = vec![0u8; 65536];
                while !stopped.load(Ordering::Relaxed) {
                    let Ok((n, from)) = socket.recv_from(&mut buf) else {
                        continue;
                    };
                    let out = match clients.iter().find(|(c, _)| *c == from) {
                        Some((_, s)) => s.clone(),
                        None => match Self::client(from, &socket, &back, &stopped) {
                            Ok(s) => {
                                clients.push((from, s.clone()));
                                s
                            }
                            Err(e) => {
                                tracing::warn!("relay {addr}: no socket for client {from}: {e}");
                                continue;
                            }
                        },
                    };
                    forward.offer(buf[..n].to_vec(), upstream, out);
                }
            })?;
        Ok(UdpRelay { addr, stop })
    }

    /// The socket toward the upstream for one client, with a thread carrying its replies back.
    fn client(
        from: SocketAddr,
        front: &Arc<UdpSocket>,
        back: &Arc<Link>,
        stop: &Arc<AtomicBool>,
    ) -> io::Result<Arc<UdpSocket>> {
        let any: SocketAddr = if from.is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        }
        .parse()
        .expect("a constant address");
        let s = Arc::new(UdpSocket::bind(any)?);
        s.set_read_timeout(Some(Duration::from_millis(50)))?;
        let (s2, front, back, stop) = (s.clone(), front.clone(), back.clone(), stop.clone());
        std::thread::Builder::new()
            .name("wan-relay-back".into())
            .spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, _)) = s2.recv_from(&mut buf) {
                        back.offer(buf[..n].to_vec(), from, front.clone());
                    }
                }
            })?;
        Ok(s)
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A TCP port carried to an upstream address as it is (no delay, loss or cap). Stops accepting
/// when dropped; connections already open run until either side closes.
pub struct TcpForward {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl TcpForward {
    /// Listens at `front` and forwards each connection to `upstream`.
    pub fn start(front: SocketAddr, upstream: SocketAddr) -> io::Result<TcpForward> {
        let listener = TcpListener::bind(front)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("wan-tcp".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            // Refused while the upstream is not listening yet: the client
                            // (a launcher joining) tries again.
                            if let Err(e) = Self::join(client, upstream) {
                                tracing::debug!("forward {addr} -> {upstream}: {e}");
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => tracing::warn!("forward {addr}: accepting: {e}"),
                    }
                }
            })?;
        Ok(TcpForward { addr, stop })
    }

    fn join(client: TcpStream, upstream: SocketAddr) -> io::Result<()> {
        client.set_nonblocking(false)?;
        let server = TcpStream::connect_timeout(&upstream, Duration::from_secs(10))?;
        let _ = server.set_nodelay(true);
        let _ = client.set_nodelay(true);
        let pipe = |mut from: TcpStream, mut to: TcpStream| {
            move || {
                let _ = io::copy(&mut from, &mut to);
                let _ = to.shutdown(std::net::Shutdown::Write);
            }
        };
        std::thread::spawn(pipe(client.try_clone()?, server.try_clone()?));
        std::thread::spawn(pipe(server, client));
        Ok(())
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpForward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(delay_ms: u64, loss: f64, rate: Option<f64>) -> LinkSpec {
        LinkSpec {
            delay: Duration::from_millis(delay_ms),
            loss,
            rate,
            queue: Duration::from_secs(5),
            seed: 7,
        }
    }

    /// An echo server on loopback and a relay in front of it; returns the client socket.
    fn echo_through(forward: LinkSpec, back: LinkSpec) -> (UdpSocket, UdpRelay, [Arc<Link>; 2]) {
        let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
        let upstream = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = echo.recv_from(&mut buf) {
                let _ = echo.send_to(&buf[..n], from);
            }
        });
        let links = [Link::start(forward).unwrap(), Link::start(back).unwrap()];
        let relay = UdpRelay::start(
            "127.0.0.1:0".parse().unwrap(),
            upstream,
            links[0].clone(),
            links[1].clone(),
        )
        .unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        (client, relay, links)
    }

    #[test]
    fn a_round_trip_takes_both_delays() {
        let (client, relay, links) = echo_through(spec(30, 0.0, None), spec(20, 0.0, None));
        for i in 0..3u8 {
            let t = Instant::now();
            client.send_to(&[i; 100], relay.addr()).unwrap();
            let mut buf = [0u8; 200];
            let (n, from) = client.recv_from(&mut buf).unwrap();
            let rtt = t.elapsed();
            assert_eq!((&buf[..n], from), (&[i; 100][..], relay.addr()));
            assert!(rtt >= Duration::from_millis(50), "round trip {rtt:?}");
        }
        // The sender thread counts a datagram after handing it over, which may be after the
        // client has it: wait for the count (bounded).
        let deadline = Instant::now() + Duration::from_secs(10);
        while links.iter().any(|l| l.stats().delivered < 3) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (f, b) = (links[0].stats(), links[1].stats());
        assert_eq!((f.datagrams, f.bytes, f.delivered), (3, 300, 3));
        assert_eq!((b.datagrams, b.delivered, b.lost), (3, 3, 0));
    }

    #[test]
    fn the_cap_paces_a_burst() {
        // 50 datagrams of 1,222 bytes (1,250 on the wire) at 1 Mbit/s: 10 ms each, 0.5 s in all.
        let (client, relay, links) = echo_through(spec(0, 0.0, Some(1e6)), spec(0, 0.0, None));
        let t = Instant::now();
        for i in 0..50u8 {
            client.send_to(&[i; 1222], relay.addr()).unwrap();
        }
        let mut buf = [0u8; 2000];
        for i in 0..50u8 {
            let (n, _) = client.recv_from(&mut buf).unwrap();
            assert_eq!(&buf[..n], &[i; 1222][..], "in order");
        }
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(490),
            "50 x 10 ms took {took:?}"
        );
        let f = links[0].stats();
        assert_eq!((f.delivered, f.overflowed), (50, 0));
    }

    /// Offers `n` datagrams of 1,222 bytes (1,250 on the wire) at once to a link of `rate`
    /// and `queue`; returns the link and how long offering took.
    fn burst(n: usize, rate: f64, queue: Duration) -> (Arc<Link>, Duration) {
        let mut s = spec(0, 0.0, Some(rate));
        s.queue = queue;
        let link = Link::start(s).unwrap();
        let sink = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
        let to = sink.local_addr().unwrap();
        let t = Instant::now();
        for _ in 0..n {
            link.offer(vec![0; 1222], to, sink.clone());
        }
        (link, t.elapsed())
    }

    #[test]
    fn a_burst_waits_in_the_queue_behind_the_cap() {
        // 10 ms per datagram: the 50th waits 490 ms, less however long offering took.
        let (link, took) = burst(50, 1e6, Duration::from_secs(5));
        let f = link.stats();
        link.stop();
        assert_eq!(f.overflowed, 0, "{f:?}");
        let least = Duration::from_millis(490).saturating_sub(took + Duration::from_millis(1));
        assert!(
            f.max_wait_us >= least.as_micros() as u64,
            "{f:?} after {took:?}"
        );
    }

    #[test]
    fn a_full_queue_drops_the_tail() {
        // 100 ms per datagram and a 450 ms queue: of a burst offered within 50 ms, the first
        // goes at once, four wait (100 to 400 ms) and the fifth would wait more than 450 ms; no
        // datagram is ever queued for longer than the queue.
        let (link, took) = burst(40, 1e5, Duration::from_millis(450));
        let f = link.stats();
        assert_eq!(f.datagrams, 40);
        assert!(f.max_wait_us <= 450_000, "{f:?}");
        if took < Duration::from_millis(50) {
            assert_eq!(f.overflowed, 35, "{f:?} after {took:?}");
        } else {
            assert!(f.overflowed >= 1, "{f:?} after {took:?}");
        }
        // Every datagram it took is delivered.
        let deadline = Instant::now() + Duration::from_secs(20);
        while link.stats().delivered < 40 - f.overflowed && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(link.stats().delivered, 40 - f.overflowed);
        link.stop();
    }

    #[test]
    fn loss_drops_about_its_share_and_is_seeded() {
        let run = || {
            let link = Link::start(spec(0, 0.25, None)).unwrap();
            let sink = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
            let to = sink.local_addr().unwrap();
            for _ in 0..4000 {
                link.offer(vec![1; 8], to, sink.clone());
            }
            link.stop();
            link.stats().lost
        };
        let lost = run();
        assert!((800..1200).contains(&lost), "lost {lost} of 4000 at 25%");
        assert_eq!(run(), lost, "the same seed drops the same datagrams");
    }

    #[test]
    fn bad_numbers_are_refused() {
        assert!(spec(0, 1.0, None).validate().unwrap_err().contains("loss"));
        assert!(
            spec(0, 0.0, Some(0.0))
                .validate()
                .unwrap_err()
                .contains("rate")
        );
        assert!(spec(0, 0.01, Some(1e8)).validate().is_ok());
    }

    #[test]
    fn tcp_is_carried_both_ways() {
        use std::io::{Read, Write};
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = server.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = server.accept().unwrap();
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf).unwrap();
            s.write_all(&buf.map(|b| b + 1)).unwrap();
        });
        let fwd = TcpForward::start("127.0.0.1:0".parse().unwrap(), upstream).unwrap();
        let mut c = TcpStream::connect(fwd.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c.write_all(&[1, 2, 3, 4, 5]).unwrap();
        let mut back = [0u8; 5];
        c.read_exact(&mut back).unwrap();
        assert_eq!(back, [2, 3, 4, 5, 6]);
    }
}
