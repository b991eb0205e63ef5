//! Where a rank's threads run under the launcher: `--cpu-bind cores` gives each rank a block of
//! its own, and `BONFIRE_COMM_CPUS` puts the communication threads (the collectives' runtime,
//! the shared-memory lane's readers and writers) apart from the compute thread.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bonfire::launch::{CpuBind, LaunchConfig, LaunchError, launch};
use bonfire::transport::placement::{self, format_cpu_list};

const CHECK: &str = env!("CARGO_BIN_EXE_bonfire-rank-check");

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bonfire-place-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Two ranks of `bonfire-rank-check threads` over shared memory, their reports in `dir`.
fn threads_job(dir: &Path, env: &[(&str, &str)]) -> LaunchConfig {
    let mut c = LaunchConfig::local(2, CHECK);
    c.args = vec!["threads".into()];
    c.timeout = Some(Duration::from_secs(60));
    c.extra_env = vec![
        ("BONFIRE_CHECK_OUT".into(), dir.into()),
        ("BONFIRE_TRANSPORT".into(), "shm".into()),
        ("BONFIRE_SHM_DIR".into(), dir.into()),
    ];
    c.extra_env
        .extend(env.iter().map(|(k, v)| (k.into(), v.into())));
    c
}

/// A rank's report: the main thread's CPUs, each communication thread's, and `BONFIRE_CPUS`.
struct Threads {
    main: String,
    comm: Vec<(String, String)>,
    cpus: String,
}

fn threads(dir: &Path, rank: usize) -> Threads {
    let line = std::fs::read_to_string(dir.join(format!("rank-{rank}")))
        .unwrap_or_else(|_| format!("<rank {rank} wrote nothing>"));
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("rank {rank}: no {name} in {line:?}"))
            .to_string()
    };
    let comm = field("comm")
        .split(',')
        .filter(|t| !t.is_empty())
        .map(|t| {
            let (name, list) = t.split_once(':').expect("NAME:LIST");
            (name.to_string(), list.to_string())
        })
        .collect::<Vec<_>>();
    let kinds = ["bonfire-comm", "bonfire-shm"];
    for kind in kinds {
        assert!(
            comm.iter().any(|(n, _)| n.starts_with(kind)),
            "rank {rank}: no {kind} thread in {line:?}"
        );
    }
    Threads {
        main: field("main"),
        comm,
        cpus: field("cpus"),
    }
}

fn cpus_here() -> Option<Vec<usize>> {
    let cpus = placement::thread_cpus().unwrap();
    if cpus.len() < 2 {
        eprintln!("skipped: this process may run on one CPU ({cpus:?})");
        return None;
    }
    Some(cpus)
}

#[test]
fn cpu_bind_cores_gives_each_rank_a_block_of_its_own() {
    let Some(cpus) = cpus_here() else { return };
    let blocks = placement::blocks(&cpus, 2).unwrap();
    let dir = out_dir("bind");
    let mut c = threads_job(&dir, &[]);
    c.cpu_bind = CpuBind::Cores;
    launch(&c).unwrap();
    for (rank, block) in blocks.iter().enumerate() {
        let t = threads(&dir, rank);
        let whole = format_cpu_list(block);
        assert_eq!(t.cpus, whole, "rank {rank}: BONFIRE_CPUS");
        // A block of 3 or more computes on all but its last CPU and communicates on that one;
        // a smaller one is shared.
        let (compute, comm) = if block.len() >= placement::KEEP_FREE_FROM {
            let (last, rest) = block.split_last().unwrap();
            (format_cpu_list(rest), last.to_string())
        } else {
            (whole.clone(), whole.clone())
        };
        assert_eq!(t.main, compute, "rank {rank}: the compute thread");
        for (name, list) in &t.comm {
            assert_eq!(list, &comm, "rank {rank}: {name}");
        }
    }
}

#[test]
fn comm_cpus_keep_a_cpu_for_every_rank_s_communication_threads() {
    let Some(cpus) = cpus_here() else { return };
    let (last, rest) = cpus.split_last().unwrap();
    let dir = out_dir("comm");
    launch(&threads_job(
        &dir,
        &[("BONFIRE_COMM_CPUS", &last.to_string())],
    ))
    .unwrap();
    for rank in 0..2 {
        let t = threads(&dir, rank);
        assert_eq!(t.cpus, "-", "rank {rank}: not bound");
        assert_eq!(
            t.main,
            format_cpu_list(rest),
            "rank {rank}: the compute thread"
        );
        for (name, list) in &t.comm {
            assert_eq!(list, &last.to_string(), "rank {rank}: {name}");
        }
    }
}

#[test]
fn a_bad_comm_cpus_setting_fails_init_naming_it() {
    let dir = out_dir("bad");
    let err = launch(&threads_job(&dir, &[("BONFIRE_COMM_CPUS", "4-2")])).unwrap_err();
    assert!(matches!(err, LaunchError::RankFailed { .. }), "{err}");
    let line = std::fs::read_to_string(dir.join("rank-0")).unwrap();
    assert!(
        line.contains(
            "init error: bonfire::init: BONFIRE_COMM_CPUS=\"4-2\": \"4-2\" is an empty range"
        ),
        "{line}"
    );
}

#[test]
fn cpu_bind_cores_refuses_more_ranks_than_cpus_before_starting_any() {
    let cpus = placement::thread_cpus().unwrap();
    let dir = out_dir("refused");
    let mut c = threads_job(&dir, &[]);
    c.nproc_per_node = cpus.len() + 1;
    c.cpu_bind = CpuBind::Cores;
    let err = launch(&c).unwrap_err();
    assert!(matches!(err, LaunchError::TooFewCpus { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!(
            "starts {} ranks and the launcher may run on {} CPUs ({})",
            cpus.len() + 1,
            cpus.len(),
            format_cpu_list(&cpus)
        )),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a rank ran");
}

#[test]
fn cpu_bind_cores_refuses_a_comm_list_outside_a_rank_s_block() {
    let Some(cpus) = cpus_here() else { return };
    let last = *cpus.iter().max().unwrap();
    let dir = out_dir("outside");
    let mut c = threads_job(&dir, &[("BONFIRE_COMM_CPUS", &last.to_string())]);
    c.cpu_bind = CpuBind::Cores;
    let err = launch(&c).unwrap_err();
    let first = &placement::blocks(&placement::physical_order(&cpus), 2).unwrap()[0];
    assert!(
        matches!(&err, LaunchError::CommCpusOutsideBlocks { cpu, rank: 0, .. } if *cpu == last),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!(
            "names CPU {last}, outside rank 0's block ({})",
            format_cpu_list(first)
        )),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a rank ran");
}
