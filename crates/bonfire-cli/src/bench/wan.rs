//! `bonfire bench wan`: a job split over two "sites" on this host, joined by a slow link.
//!
//! Two network namespaces play the sites (site A on 10.75.0.2, site B on 10.76.0.2), each joined
//! to this one by its own veth pair and to nothing else; one `bonfire launch` runs in each, node
//! 0 in A and node 1 in B. The only path between them is a set of relays here
//! ([`bonfire::launch::wan`]) that carry every datagram across one [`Link`] per direction, with a
//! one-way delay of half the round trip, random loss and a bandwidth cap behind a queue.
//!
//! Addresses: every rank listens on a fixed port (site A's ranks on PORT, PORT+1, ..., site B's
//! on PORT+N, ...). A rank of site A advertises 10.76.0.1:its port: in site A that address is
//! on the loopback (so site A's ranks reach each other directly), in site B it leads here, to
//! the relay for that port, which carries it to 10.75.0.2. Site B's ranks advertise 10.75.0.1
//! the same way. Site A's launcher meets site B's at 10.75.0.2:PORT over TCP, carried as it is
//! (a few small messages).

use std::ffi::OsString;
use std::net::SocketAddr;
use std::process::{Child, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bonfire::launch::netns::Namespaces;
use bonfire::launch::wan::{Link, LinkSpec, LinkStats, TcpForward, UdpRelay};

use crate::error::{ArgError, CliError};

/// Arguments of `bonfire bench wan`.
#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  bonfire bench wan -- bonfire bench collectives --sizes 4K,1M\n  bonfire bench wan --nproc-per-site 2 --rtt-ms 50 --loss-percent 1 --mbit 100 -- bonfire train gpt --strategy diloco"
)]
pub(crate) struct Args {
    /// Round-trip time between the sites, milliseconds (half of it each way).
    #[arg(long, default_value = "50", value_parser = non_negative)]
    rtt_ms: f64,
    /// Datagrams lost at random in each direction, percent (`1` or `1%`).
    #[arg(long, default_value = "1", value_parser = percent)]
    loss_percent: f64,
    /// The link's bandwidth in each direction, Mbit/s (IP and UDP headers counted); 0 for no cap.
    #[arg(long, default_value = "100", value_parser = non_negative)]
    mbit: f64,
    /// The longest a datagram waits behind the cap before the link drops it, milliseconds
    /// [default: one round trip, at least 10].
    #[arg(long, value_parser = non_negative)]
    queue_ms: Option<f64>,
    /// Ranks at each site.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    nproc_per_site: u16,
    /// Site A's first port (rank 0's rendezvous); the ranks take the ports after it.
    #[arg(long, default_value_t = 29500, value_parser = clap::value_parser!(u16).range(1024..=65000))]
    port: u16,
    /// Seeds the loss.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The program every rank runs, and its arguments, as for `bonfire launch`.
    #[arg(last = true, required = true, value_name = "PROGRAM [ARGS]...")]
    command: Vec<OsString>,
}

fn non_negative(s: &str) -> Result<f64, ArgError> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(ArgError::NotNonNegative(s.to_string())),
    }
}

fn percent(s: &str) -> Result<f64, ArgError> {
    match s.trim().trim_end_matches('%').parse::<f64>() {
        Ok(v) if (0.0..100.0).contains(&v) => Ok(v),
        _ => Err(ArgError::NotPercent(s.to_string())),
    }
}

/// Set by SIGINT or SIGTERM: stop both sites and clean up.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

const SITES: [&str; 2] = ["A", "B"];
/// Site A's subnet is 10.75.0.0/24, site B's 10.76.0.0/24.
const FIRST_NET: u8 = 75;

fn addr(net: u8, host: u8, port: u16) -> SocketAddr {
    SocketAddr::from(([10, net, 0, host], port))
}

/// The relays and links between the sites, torn down when dropped.
struct Crossing {
    /// Site A to site B, and B to A.
    links: [Arc<Link>; 2],
    _relays: Vec<UdpRelay>,
    _control: TcpForward,
}

impl Crossing {
    fn start(spec: LinkSpec, port: u16, n: u16) -> Result<Crossing, CliError> {
        let usage = |e: String| CliError::Usage(format!("bonfire bench wan: {e}"));
        let a_to_b = Link::start(spec).map_err(usage)?;
        let b_to_a = Link::start(LinkSpec {
            seed: spec.seed.wrapping_add(1),
            ..spec
        })
        .map_err(usage)?;
        let (a, b) = (FIRST_NET, FIRST_NET + 1);
        let mut relays = Vec::new();
        let bind = |front, upstream, fwd: &Arc<Link>, back: &Arc<Link>| {
            UdpRelay::start(front, upstream, fwd.clone(), back.clone())
                .map_err(CliError::io("starting a relay between the sites"))
        };
        for p in port..port + n {
            // Site A's ranks, reached from site B at 10.76.0.1.
            relays.push(bind(addr(b, 1, p), addr(a, 2, p), &b_to_a, &a_to_b)?);
        }
        for p in port + n..port + 2 * n {
            // Site B's ranks, reached from site A at 10.75.0.1.
            relays.push(bind(addr(a, 1, p), addr(b, 2, p), &a_to_b, &b_to_a)?);
        }
        let control = TcpForward::start(addr(b, 1, port), addr(a, 2, port))
            .map_err(CliError::io("forwarding the launchers' control port"))?;
        Ok(Crossing {
            links: [a_to_b, b_to_a],
            _relays: relays,
            _control: control,
        })
    }
}

impl Drop for Crossing {
    fn drop(&mut self) {
        for l in &self.links {
            l.stop();
        }
    }
}

fn describe(stats: &LinkStats) -> String {
    let pct = |n: u64| 100.0 * n as f64 / stats.datagrams.max(1) as f64;
    format!(
        "{} datagrams, {:.1} MiB; lost {} ({:.2}%), dropped by the full queue {} ({:.2}%); \
         longest wait in the queue {:.1} ms",
        stats.datagrams,
        stats.bytes as f64 / (1u64 << 20) as f64,
        stats.lost,
        pct(stats.lost),
        stats.overflowed,
        pct(stats.overflowed),
        stats.max_wait_us as f64 / 1e3,
    )
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on a child's pid, which stays ours until it is reaped.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

/// The largest round trip or queue taken, milliseconds (an hour).
const MAX_MS: f64 = 3.6e6;

pub(crate) fn run(args: Args) -> Result<(), CliError> {
    let usage = |what: String| Err(CliError::Usage(format!("bonfire bench wan: {what}")));
    if args.rtt_ms > MAX_MS || args.queue_ms.is_some_and(|q| q > MAX_MS) {
        return usage(format!(
            "--rtt-ms and --queue-ms take at most {MAX_MS} (an hour)"
        ));
    }
    if args.mbit > 0.0 && args.mbit < 0.001 {
        return usage(format!(
            "--mbit {} is below 1 kbit/s (0 for no cap)",
            args.mbit
        ));
    }
    let rtt = Duration::from_secs_f64(args.rtt_ms / 1e3);
    let spec = LinkSpec {
        delay: rtt / 2,
        loss: args.loss_percent / 100.0,
        rate: (args.mbit > 0.0).then_some(args.mbit * 1e6),
        queue: args
            .queue_ms
            .map(|q| Duration::from_secs_f64(q / 1e3))
            .unwrap_or(rtt.max(Duration::from_millis(10))),
        seed: args.seed,
    };
    let n = args.nproc_per_site;
    if args.port as u32 + 2 * n as u32 > 65535 {
        return usage(format!(
            "--port {} leaves no room for 2 x {n} ranks' ports",
            args.port
        ));
    }
    // From here on a signal stops the sites and removes the namespaces.
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    // The kernel tears down the namespaces an earlier run deleted in the background: their
    // address can outlive that run by a moment, so a run started right after one waits for it.
    let first = format!("10.{FIRST_NET}.0.1");
    let mut holder = address_holder(&first);
    let settled = Instant::now() + Duration::from_secs(5);
    while holder.is_some() && Instant::now() < settled {
        std::thread::sleep(Duration::from_millis(100));
        holder = address_holder(&first);
    }
    if let Some(holder) = holder {
        return Err(CliError::NoNamespaces(format!(
            "10.{FIRST_NET}.0.1 is already on interface {holder}: another `bonfire bench wan` \
             is running, or one was killed and left its namespaces (`ip netns list`, then \
             `ip netns del` the bf...wa and bf...wb it made)"
        )));
    }
    let ns = Namespaces::star_at(FIRST_NET, 'w').ok_or_else(|| {
        CliError::NoNamespaces("creating two network namespaces and their veth pairs failed".into())
    })?;
    let (a, b) = (FIRST_NET, FIRST_NET + 1);
    // Each site's view of the other's addresses: its own ranks' advertised address is local.
    if !ns.add_local_addr(0, &format!("10.{b}.0.1/32"))
        || !ns.add_local_addr(1, &format!("10.{a}.0.1/32"))
    {
        return Err(CliError::NoNamespaces(
            "adding an address to a namespace's loopback failed".into(),
        ));
    }
    let crossing = Crossing::start(spec, args.port, n)?;
    let exe = std::env::current_exe().map_err(CliError::CurrentExe)?;
    let secret = bonfire::transport::Secret::generate().expose_text();
    eprintln!(
        "bonfire bench wan: site A (node 0, ranks 0-{}) and site B (node 1, ranks {}-{}), \
         {} ms round trip, {}% loss and {} each way, queue {:.0} ms",
        n - 1,
        n,
        2 * n - 1,
        args.rtt_ms,
        args.loss_percent,
        match spec.rate {
            Some(_) => format!("{} Mbit/s", args.mbit),
            None => "no bandwidth cap".into(),
        },
        spec.queue.as_secs_f64() * 1e3,
    );
    if STOP.load(Ordering::Relaxed) {
        return Err(CliError::Usage(
            "bonfire bench wan: stopped by a signal".into(),
        ));
    }
    let started = Instant::now();
    let mut sites: Vec<Child> = Vec::new();
    for (site, (master, advertised, first)) in [
        (addr(a, 2, args.port), addr(b, 1, args.port), args.port),
        (
            addr(b, 1, args.port),
            addr(a, 1, args.port + n),
            args.port + n,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let child = ns
            .command(site, &exe)
            .arg("launch")
            .args(["--nnodes", "2", "--node-rank", &site.to_string()])
            .args(["--nproc-per-node", &n.to_string()])
            .args(["--master-addr", &master.to_string(), "--"])
            .args(&args.command)
            .env("BONFIRE_SECRET", &secret)
            .env("BONFIRE_BIND_ADDR", format!("0.0.0.0:{first}"))
            .env(
                "BONFIRE_ADVERTISE_ADDR",
                SocketAddr::new(advertised.ip(), first).to_string(),
            )
            .spawn();
        match child {
            Ok(c) => sites.push(c),
            Err(e) => {
                for c in &sites {
                    signal(c, libc::SIGTERM);
                }
                return Err(CliError::Io {
                    during: "starting a site's launcher",
                    source: e,
                });
            }
        }
    }
    let (statuses, first_failed) = wait_both(&mut sites)?;
    let took = started.elapsed();
    for (i, l) in crossing.links.iter().enumerate() {
        eprintln!(
            "bonfire bench wan: site {} -> site {}: {}",
            SITES[i],
            SITES[1 - i],
            describe(&l.stats())
        );
    }
    eprintln!("bonfire bench wan: {:.1} s", took.as_secs_f64());
    drop(crossing);
    drop(ns);
    match first_failed {
        Some(i) => Err(CliError::SiteFailed {
            site: SITES[i],
            status: statuses[i],
        }),
        None => Ok(()),
    }
}

/// The interface in this namespace that holds `ip`, if any.
fn address_holder(ip: &str) -> Option<String> {
    let out = std::process::Command::new("ip")
        .args(["-o", "addr", "show", "to", ip])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().next()?;
    line.split_whitespace().nth(1).map(str::to_string)
}

/// Waits for both launchers; returns how each ended and which failed first. When one ends,
/// the other gets a minute to end too (a failure reaches the other site through its peers'
/// timeouts); a signal stops both at once. Stopping is SIGTERM, then SIGKILL 15 s later.
fn wait_both(sites: &mut [Child]) -> Result<(Vec<ExitStatus>, Option<usize>), CliError> {
    let mut done: Vec<Option<ExitStatus>> = vec![None; sites.len()];
    let mut first_failed = None;
    let mut stop_at: Option<Instant> = None;
    let mut terminated = false;
    loop {
        for (i, c) in sites.iter_mut().enumerate() {
            if done[i].is_none() {
                done[i] = c
                    .try_wait()
                    .map_err(CliError::io("waiting for a site's launcher"))?;
                if done[i].is_some_and(|s| !s.success()) && first_failed.is_none() {
                    first_failed = Some(i);
                }
            }
        }
        if done.iter().all(Option::is_some) {
            return Ok((done.into_iter().flatten().collect(), first_failed));
        }
        let now = Instant::now();
        if STOP.load(Ordering::Relaxed) && !terminated {
            stop_at = Some(now);
        } else if stop_at.is_none() && done.iter().any(Option::is_some) {
            stop_at = Some(now + Duration::from_secs(60));
        }
        if let Some(at) = stop_at.filter(|&at| now >= at) {
            for (i, c) in sites.iter_mut().enumerate() {
                if done[i].is_none() {
                    if terminated {
                        let _ = c.kill();
                    } else {
                        signal(c, libc::SIGTERM);
                    }
                }
            }
            if !terminated {
                terminated = true;
                stop_at = Some(at.max(now) + Duration::from_secs(15));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_take_plain_numbers_and_percent_signs() {
        assert_eq!(percent("1"), Ok(1.0));
        assert_eq!(percent(" 2.5% "), Ok(2.5));
        assert_eq!(percent("100"), Err(ArgError::NotPercent("100".into())));
        assert_eq!(percent("-1"), Err(ArgError::NotPercent("-1".into())));
        assert_eq!(non_negative("0"), Ok(0.0));
        assert_eq!(non_negative("50"), Ok(50.0));
        assert_eq!(
            non_negative("-5"),
            Err(ArgError::NotNonNegative("-5".into()))
        );
        assert_eq!(
            non_negative("inf"),
            Err(ArgError::NotNonNegative("inf".into()))
        );
    }
}
