//! Jobs of several processes on 127.0.0.1 over QUIC: every collective against the oracle under
//! the launcher, a wrong secret, a rank killed with SIGKILL, and a lossy, slow link.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bonfire_launch::wan::{Link, LinkSpec, UdpRelay};
use bonfire_launch::{LaunchConfig, free_local_port, launch};
use bonfire_testkit::netns::Namespaces;

const CHECK: &str = env!("CARGO_BIN_EXE_bonfire-rank-check");

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bonfire-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn result(dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(dir.join(format!("rank-{rank}")))
        .unwrap_or_else(|_| format!("<rank {rank} wrote nothing>"))
        .trim()
        .to_string()
}

fn launched(nproc: usize, args: &[&str], dir: &Path) -> LaunchConfig {
    let mut c = LaunchConfig::local(nproc, CHECK);
    c.args = args.iter().map(Into::into).collect();
    c.extra_env = vec![("BONFIRE_CHECK_OUT".into(), dir.into())];
    c.timeout = Some(Duration::from_secs(60));
    c
}

/// A launcher config whose ranks talk `transport` (`quic`, `shm`), making segments in `shm_dir`.
fn over(mut c: LaunchConfig, transport: &str, shm_dir: &Path) -> LaunchConfig {
    c.extra_env
        .push(("BONFIRE_TRANSPORT".into(), transport.into()));
    c.extra_env.push(("BONFIRE_SHM_DIR".into(), shm_dir.into()));
    c
}

/// Every collective under the launcher, its ranks talking `transport`; the digests agree, and
/// no segment is left in the shared-memory directory.
fn every_collective_over(transport: &str) {
    let dir = out_dir(&format!("every-{transport}"));
    let shm_dir = out_dir(&format!("every-{transport}-shm"));
    launch(&over(launched(3, &["every"], &dir), transport, &shm_dir)).unwrap();
    let digests: Vec<String> = (0..3).map(|r| result(&dir, r)).collect();
    for (r, d) in digests.iter().enumerate() {
        assert!(d.starts_with("every ok digest="), "rank {r}: {d}");
        assert!(
            d.contains(&format!("transport={transport}")),
            "rank {r}: {d}"
        );
    }
    let digest = |d: &String| d.split(' ').nth(2).map(str::to_string);
    assert!(
        digests.iter().all(|d| digest(d) == digest(&digests[0])),
        "{digests:?}"
    );
    assert_eq!(std::fs::read_dir(&shm_dir).unwrap().count(), 0);
}

#[test]
fn every_collective_over_quic_under_the_launcher() {
    every_collective_over("quic");
}

#[test]
fn every_collective_over_shared_memory_under_the_launcher() {
    every_collective_over("shm");
}

/// Two "nodes" of two ranks on this host (two launchers with different node ranks): shared
/// memory inside each, QUIC between them, every collective (the hierarchical all-reduce among
/// them) against the oracle.
#[test]
fn every_collective_on_two_nodes_of_two_ranks_mixing_both_lanes() {
    let dir = out_dir("mixed");
    let shm_dir = out_dir("mixed-shm");
    let secret = dir.join("secret");
    std::fs::write(&secret, "mixed-layout-secret-0123456789abcdef").unwrap();
    let port = free_local_port().unwrap();
    let launchers: Vec<_> = (0..2)
        .map(|node| {
            let mut c = over(launched(2, &["every"], &dir), "shm", &shm_dir);
            c.nnodes = 2;
            c.node_rank = node;
            c.master = Some(format!("127.0.0.1:{port}"));
            c.secret_file = Some(secret.clone());
            c.extra_env
                .push(("BONFIRE_BIND_ADDR".into(), "127.0.0.1:0".into()));
            std::thread::spawn(move || launch(&c))
        })
        .collect();
    for l in launchers {
        l.join().unwrap().unwrap();
    }
    let digests: Vec<String> = (0..4).map(|r| result(&dir, r)).collect();
    for (r, d) in digests.iter().enumerate() {
        assert!(d.starts_with("every ok digest="), "rank {r}: {d}");
        assert!(d.contains("transport=shm"), "rank {r}: {d}");
    }
    assert_eq!(std::fs::read_dir(&shm_dir).unwrap().count(), 0);
}

#[test]
fn the_launcher_removes_the_segments_a_killed_rank_left() {
    let dir = out_dir("leftover");
    let shm_dir = out_dir("leftover-shm");
    // What a rank killed between making a segment and unlinking it leaves behind.
    let left = shm_dir.join("bonfire-leftovertest-0123456789abcdef");
    std::fs::write(&left, b"").unwrap();
    let other = shm_dir.join("another-program");
    std::fs::write(&other, b"").unwrap();
    let mut c = over(launched(2, &["digest"], &dir), "shm", &shm_dir);
    c.extra_env
        .push(("BONFIRE_SHM_TAG".into(), "leftovertest".into()));
    launch(&c).unwrap();
    assert!(!left.exists(), "the launcher removes its job's segments");
    assert!(other.exists(), "and nothing else");
}

/// A rank killed with SIGKILL mid-collective, its peers talking `transport`: each survivor
/// names it within `limit` seconds, and no segment is left behind.
fn a_killed_rank_is_named(transport: &str, limit: f64) {
    let dir = out_dir(&format!("die-{transport}"));
    let shm_dir = out_dir(&format!("die-{transport}-shm"));
    let mut c = over(launched(3, &["die", "1"], &dir), transport, &shm_dir);
    c.peer_timeout = Some(Duration::from_secs(3));
    let started = Instant::now();
    let err = launch(&c).unwrap_err();
    assert_eq!(err.failed_rank(), Some(1), "{err}");
    assert!(err.to_string().contains("signal 9 (SIGKILL)"), "{err}");
    assert_eq!(std::fs::read_dir(&shm_dir).unwrap().count(), 0);
    for r in [0, 2] {
        let line = result(&dir, r);
        let secs: f64 = line
            .strip_prefix("detected after ")
            .and_then(|l| l.split('s').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("rank {r}: {line}"));
        assert!(secs < limit, "rank {r} took {secs}s: {line}");
        assert!(line.contains("rank 1"), "rank {r} must name rank 1: {line}");
    }
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_rank_killed_mid_collective_is_named_by_the_others_within_ten_seconds() {
    a_killed_rank_is_named("quic", 10.0);
}

#[test]
fn a_rank_killed_mid_collective_on_shared_memory_is_named_before_the_peer_timeout() {
    // The peer timeout is 3 s; the lane watches the process, so it takes a tick or two (0.25 s
    // after the kill when measured; the bound leaves room for a loaded machine).
    a_killed_rank_is_named("shm", 2.0);
}

fn spawn_rank(rank: usize, world: usize, port: u16, secret: &str, dir: &Path, mode: &str) -> Child {
    spawn(Some(rank), world, port, secret, dir, mode)
}

/// A rank process; without a rank it asks the rendezvous for one.
fn spawn(
    rank: Option<usize>,
    world: usize,
    port: u16,
    secret: &str,
    dir: &Path,
    mode: &str,
) -> Child {
    spawn_at(None, "127.0.0.1", rank, world, port, secret, dir, mode)
}

/// A rank process in network namespace `netns` (if any), reaching rank 0 at `host:port`; it
/// listens on 127.0.0.1, or on every interface of its namespace.
#[allow(clippy::too_many_arguments)]
fn spawn_at(
    netns: Option<&str>,
    host: &str,
    rank: Option<usize>,
    world: usize,
    port: u16,
    secret: &str,
    dir: &Path,
    mode: &str,
) -> Child {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, CHECK]);
            c
        }
        None => Command::new(CHECK),
    };
    if let Some(rank) = rank {
        cmd.env("RANK", rank.to_string());
    }
    let bind = if netns.is_some() {
        "0.0.0.0:0"
    } else {
        "127.0.0.1:0"
    };
    cmd.arg(mode)
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", host)
        .env("MASTER_PORT", port.to_string())
        .env("BONFIRE_BIND_ADDR", bind)
        .env("BONFIRE_SECRET", secret)
        .env("BONFIRE_CONNECT_TIMEOUT", "5")
        .env("BONFIRE_CHECK_OUT", dir)
        // These ranks share a host, but the tests that start them by hand are about QUIC (the
        // relay sits on its path): keep shared memory out of it.
        .env("BONFIRE_TRANSPORT", "quic")
        .spawn()
        .unwrap()
}

fn wait(mut child: Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("a rank did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for every child (child `r` is rank `r`) and asserts that it succeeded, showing what it
/// reported otherwise.
fn assert_all_succeed(children: Vec<Child>, dir: &Path, limit: Duration) {
    for (r, child) in children.into_iter().enumerate() {
        assert!(wait(child, limit).success(), "rank {r}: {}", result(dir, r));
    }
}

/// A clean 2-rank `digest` run on loopback; returns the folder with its results.
fn clean_digest_run(name: &str, secret: &str) -> PathBuf {
    let clean = out_dir(name);
    let port = free_local_port().unwrap();
    let ranks = vec![
        spawn_rank(0, 2, port, secret, &clean, "digest"),
        spawn_rank(1, 2, port, secret, &clean, "digest"),
    ];
    assert_all_succeed(ranks, &clean, Duration::from_secs(60));
    clean
}

#[test]
fn processes_without_a_rank_are_given_one_by_the_rendezvous() {
    let dir = out_dir("assigned");
    let port = free_local_port().unwrap();
    let secret = "assigned-ranks-secret-0123456789";
    let children = vec![
        spawn(Some(0), 3, port, secret, &dir, "digest"),
        spawn(None, 3, port, secret, &dir, "digest"),
        spawn(None, 3, port, secret, &dir, "digest"),
    ];
    for c in children {
        assert!(wait(c, Duration::from_secs(60)).success());
    }
    let digests: Vec<String> = (0..3).map(|r| result(&dir, r)).collect();
    assert!(digests[0].starts_with("digest="), "{digests:?}");
    assert!(digests.iter().all(|d| d == &digests[0]), "{digests:?}");
}

#[test]
fn a_rank_without_the_secret_is_refused_on_both_sides() {
    let dir = out_dir("secret");
    let port = free_local_port().unwrap();
    let host = spawn_rank(0, 2, port, "the-right-secret-0123456789", &dir, "digest");
    let guest = spawn_rank(1, 2, port, "a-wrong-secret-0123456789ab", &dir, "digest");
    assert_eq!(wait(guest, Duration::from_secs(30)).code(), Some(2));
    assert_eq!(wait(host, Duration::from_secs(30)).code(), Some(2));
    let guest = result(&dir, 1);
    assert!(
        guest.contains("refused rank 1") && guest.contains("wrong job secret"),
        "{guest}"
    );
    let host = result(&dir, 0);
    assert!(host.contains("missing: ranks 1"), "{host}");
}

/// bonfire-launch's user-space relay in front of `upstream`: drops `loss` of the datagrams and
/// delays the rest by `delay`, in both directions (no bandwidth cap).
struct Relay {
    addr: SocketAddr,
    links: [Arc<Link>; 2],
    _relay: UdpRelay,
}

impl Relay {
    fn start(upstream: SocketAddr, loss: f64, delay: Duration, seed: u64) -> Relay {
        Self::start_on("127.0.0.1".parse().unwrap(), upstream, loss, delay, seed)
    }

    /// A relay listening on `front_ip`.
    fn start_on(
        front_ip: std::net::IpAddr,
        upstream: SocketAddr,
        loss: f64,
        delay: Duration,
        seed: u64,
    ) -> Relay {
        let spec = LinkSpec {
            delay,
            loss,
            rate: None,
            queue: Duration::from_secs(1),
            seed,
        };
        let links = [
            Link::start(spec).unwrap(),
            Link::start(LinkSpec {
                seed: seed + 1,
                ..spec
            })
            .unwrap(),
        ];
        let relay = UdpRelay::start(
            SocketAddr::new(front_ip, 0),
            upstream,
            links[0].clone(),
            links[1].clone(),
        )
        .unwrap();
        Relay {
            addr: relay.addr(),
            links,
            _relay: relay,
        }
    }

    /// Datagrams dropped, and offered, in both directions.
    fn dropped(&self) -> (u64, u64) {
        self.links
            .iter()
            .map(|l| l.stats())
            .fold((0, 0), |(d, t), s| (d + s.lost, t + s.datagrams))
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for l in &self.links {
            l.stop();
        }
    }
}

#[test]
fn a_lossy_slow_link_gives_the_same_results_as_a_clean_one() {
    let secret = "relay-test-secret-0123456789";
    let clean = clean_digest_run("clean", secret);
    // Rank 1 reaches rank 0 only through a relay that drops 1% and delays 20 ms each way.
    let lossy = out_dir("lossy");
    let port = free_local_port().unwrap();
    let relay = Relay::start(
        SocketAddr::from(([127, 0, 0, 1], port)),
        0.01,
        Duration::from_millis(20),
        5,
    );
    let ranks = vec![
        spawn_rank(0, 2, port, secret, &lossy, "digest"),
        spawn_rank(1, 2, relay.addr.port(), secret, &lossy, "digest"),
    ];
    assert_all_succeed(ranks, &lossy, Duration::from_secs(120));
    let (dropped, total) = relay.dropped();
    assert!(
        dropped > 0,
        "the relay dropped nothing of {total} datagrams"
    );
    for r in 0..2 {
        assert_eq!(result(&lossy, r), result(&clean, r), "rank {r}");
        assert!(result(&clean, r).starts_with("digest="));
    }
}

#[test]
fn across_two_network_namespaces_through_a_lossy_relay() {
    let Some(ns) = Namespaces::star() else {
        eprintln!("skipped: this machine does not allow network namespaces (needs root and `ip`)");
        return;
    };
    // Rank 0 lives in namespace a (10.71.0.2), rank 1 in namespace b (10.72.0.2); the only path
    // between them is the relay here, which drops 1% and delays 20 ms each way.
    let secret = "netns-relay-secret-0123456789";
    let dir = out_dir("netns");
    let port = free_local_port().unwrap();
    let relay = Relay::start_on(
        "10.72.0.1".parse().unwrap(),
        SocketAddr::from(([10, 71, 0, 2], port)),
        0.01,
        Duration::from_millis(20),
        9,
    );
    let a = spawn_at(
        Some(&ns.names[0]),
        "10.71.0.2",
        Some(0),
        2,
        port,
        secret,
        &dir,
        "digest",
    );
    let b = spawn_at(
        Some(&ns.names[1]),
        "10.72.0.1",
        Some(1),
        2,
        relay.addr.port(),
        secret,
        &dir,
        "digest",
    );
    assert_all_succeed(vec![a, b], &dir, Duration::from_secs(120));
    let (dropped, total) = relay.dropped();
    assert!(
        dropped > 0,
        "the relay dropped nothing of {total} datagrams"
    );
    // The same bits as a clean run on loopback (same inputs).
    let clean = clean_digest_run("netns-clean", secret);
    for r in 0..2 {
        assert_eq!(result(&dir, r), result(&clean, r), "rank {r}");
    }
}
