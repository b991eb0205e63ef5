//! `bonfire launch`: start a node's ranks of a job, torchrun-style.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use bonfire::launch::slurm::{self, SlurmPlace};
use bonfire::launch::{CpuBind, LaunchConfig, launch};

use crate::error::{ArgError, CliError};

/// Start the ranks of a job on this node and watch them.
///
/// Every rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
/// `MASTER_PORT` (the torchrun names), `GROUP_RANK` and bonfire's own variables; its output is
/// prefixed with `[rank N]`. When a rank fails the job is restarted on every node while
/// `--max-restarts` allow; after that the others get time to report it, the job is stopped on
/// every node and this command exits non-zero, naming the rank. On several nodes the launchers
/// also talk to each other: node 0's listens on TCP at --master-addr (the ranks' rendezvous uses
/// UDP at the same port). Under Slurm, start one launcher per node with `srun
/// --ntasks-per-node=1`: the node count, this node's index and the rendezvous come from the step.
#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  bonfire launch --nproc-per-node 2 -- ./target/release/mnist-style\n  bonfire launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1:29500 --secret-file job.secret -- ./train"
)]
pub(crate) struct Args {
    /// Ranks to start on this node.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    nproc_per_node: u32,
    /// Nodes in the job [default: 1; under `srun`, the step's nodes].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    nnodes: Option<u32>,
    /// This node's index, 0 to nnodes-1; node 0 hosts rank 0 and the rendezvous [default: 0;
    /// under `srun`, this node's place in the step].
    #[arg(long)]
    node_rank: Option<u32>,
    /// Where rank 0 hosts the rendezvous, HOST:PORT [default on one node: a free port on
    /// 127.0.0.1; under `srun`, the step's first node at MASTER_PORT, else 29500 plus the job
    /// id modulo 2000].
    #[arg(long)]
    master_addr: Option<String>,
    /// A file holding the job secret, the same on every node [default on one node: a fresh
    /// secret handed to the ranks through the environment].
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Seconds any collective may wait before it fails, naming the ranks it waited for.
    #[arg(long, value_parser = positive_seconds)]
    timeout: Option<Duration>,
    /// Seconds of silence after which a peer is declared lost.
    #[arg(long, value_parser = positive_seconds)]
    peer_timeout: Option<Duration>,
    /// How ranks of this node talk to each other: auto (shared memory, or QUIC where it cannot
    /// be set up, said once), shm (shared memory or fail) or quic. Ranks of different nodes
    /// always talk QUIC [default: BONFIRE_TRANSPORT, else auto].
    #[arg(long, value_parser = ["auto", "shm", "quic"])]
    transport: Option<String>,
    /// Times to restart the job after a failure: a failed rank, or on several nodes a lost
    /// node's launcher, stops every node's ranks and starts them again in a new round
    /// (BONFIRE_RESTART_ROUND), which must resume from its newest checkpoint.
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// On several nodes: seconds to wait for every node's launcher to join, at the start and
    /// after each restart, before the job ends naming the nodes missing.
    #[arg(long, value_parser = positive_seconds, default_value = "300")]
    join_timeout: Duration,
    /// Ranks whose failure does not stop the job, comma-separated (the workers of asynchronous
    /// parameter servers): the launcher says how each ended and the others go on. Give every
    /// node's launcher the same list; not every rank.
    #[arg(long, value_delimiter = ',', value_name = "RANKS")]
    expendable_ranks: Vec<u32>,
    /// How this node's ranks are placed on its CPUs: none (every rank may run on every CPU) or
    /// cores (each rank gets a block of its own of equal size, a core's hardware threads
    /// together, named in BONFIRE_CPUS; in a job of several ranks a block of 3 CPUs or more
    /// keeps its last one for the rank's communication threads, see BONFIRE_COMM_CPUS)
    /// [default: BONFIRE_CPU_BIND, else none].
    #[arg(long, value_parser = ["none", "cores"])]
    cpu_bind: Option<String>,
    /// The program every rank runs, and its arguments.
    #[arg(last = true, required = true, value_name = "PROGRAM [ARGS]...")]
    command: Vec<OsString>,
}

fn positive_seconds(s: &str) -> Result<Duration, ArgError> {
    let v: f64 = s.parse().map_err(|_| ArgError::NotSeconds(s.to_string()))?;
    if v > 0.0 && v < 1e9 {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(ArgError::NotPositiveSeconds(s.to_string()))
    }
}

/// The node count, this node's index and the rendezvous: from the flags, or under Slurm from
/// the `srun` step that started one launcher per node. A launcher in a batch script of several
/// nodes is refused: it would start one node's ranks and wait for the others.
fn placement(
    args: &Args,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<(usize, usize, Option<String>), CliError> {
    let place = slurm::place(get).map_err(|e| CliError::Usage(format!("under Slurm: {e}")))?;
    let given = (args.nnodes, args.node_rank, args.master_addr.clone());
    match (place, given) {
        (_, (Some(n), rank, master)) => Ok((n as usize, rank.unwrap_or(0) as usize, master)),
        (SlurmPlace::Step(step), (None, rank, master)) => {
            let nodes = step.hosts.len();
            if step.tasks != nodes {
                return Err(CliError::Usage(format!(
                    "bonfire launch runs once per node, but this srun step has {} tasks on {nodes} \
                     node(s): start it with `srun --ntasks={nodes} --ntasks-per-node=1 bonfire \
                     launch ...` (or give --nnodes and --node-rank)",
                    step.tasks
                )));
            }
            let master = match master {
                Some(m) => m,
                None => step
                    .rendezvous(get)
                    .map_err(|e| CliError::Usage(format!("under Slurm: {e}")))?,
            };
            let node = rank.map_or(step.node, |r| r as usize);
            Ok((nodes, node, Some(master)))
        }
        (SlurmPlace::BatchScript { job, nodes, .. }, (None, _, _)) if nodes > 1 => {
            Err(CliError::Usage(format!(
                "bonfire launch is running in the batch script of Slurm job {job}, which runs on \
                 the first of its {nodes} nodes only: start one launcher per node with `srun \
                 --ntasks={nodes} --ntasks-per-node=1 bonfire launch ...` (or give --nnodes 1 to \
                 run every rank here)"
            )))
        }
        (_, (None, rank, master)) => Ok((1, rank.unwrap_or(0) as usize, master)),
    }
}

pub(crate) fn run(args: Args) -> Result<(), CliError> {
    let (nnodes, node_rank, master) = placement(&args, &|k| std::env::var(k).ok())?;
    let mut command = args.command.into_iter();
    let program = command.next().ok_or(CliError::NoProgram)?;
    let world = args.nproc_per_node as usize * nnodes;
    if let Some(r) = args.expendable_ranks.iter().find(|&&r| r as usize >= world) {
        return Err(CliError::Usage(format!(
            "--expendable-ranks names rank {r}, but the job has {world} ranks (0 to {})",
            world - 1
        )));
    }
    let mut expendable: Vec<usize> = args.expendable_ranks.iter().map(|&r| r as usize).collect();
    expendable.sort_unstable();
    expendable.dedup();
    if !expendable.is_empty() && expendable.len() == world {
        return Err(CliError::Usage(format!(
            "--expendable-ranks names every rank of the job ({world}): at least one rank must \
             succeed for the job to succeed"
        )));
    }
    let cpu_bind = match &args.cpu_bind {
        Some(b) => CpuBind::parse(b).expect("clap checked the value"),
        None => CpuBind::from_env()?,
    };
    let config = LaunchConfig {
        nproc_per_node: args.nproc_per_node as usize,
        nnodes,
        node_rank,
        master,
        secret_file: args.secret_file,
        timeout: args.timeout,
        peer_timeout: args.peer_timeout,
        max_restarts: args.max_restarts,
        join_timeout: args.join_timeout,
        program,
        args: command.collect(),
        extra_env: args
            .transport
            .iter()
            .map(|t| ("BONFIRE_TRANSPORT".into(), t.into()))
            .collect(),
        prefix_output: true,
        expendable,
        expendable_deaths_only: false,
        cpu_bind,
    };
    let launched = launch(&config)?;
    if let Some(summary) = launched.summary() {
        eprintln!("bonfire launch: the job finished {summary}");
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn args() -> Args {
        Args {
            nproc_per_node: 2,
            nnodes: None,
            node_rank: None,
            master_addr: None,
            secret_file: None,
            timeout: None,
            peer_timeout: None,
            transport: None,
            max_restarts: 0,
            join_timeout: Duration::from_secs(300),
            expendable_ranks: Vec::new(),
            cpu_bind: None,
            command: vec!["./train".into()],
        }
    }

    /// Slurm's variables of a two-node job of 4 tasks (as 22.05 sets them), in the batch script
    /// (`step: None`) or in a task of a step of `tasks` tasks on node `node`.
    fn slurm(step: Option<(usize, usize)>) -> impl Fn(&str) -> Option<String> {
        move |k: &str| {
            let v = match (k, step) {
                ("SLURM_JOB_ID", _) => "10".to_string(),
                ("SLURM_JOB_NUM_NODES", _) => "2".into(),
                ("SLURM_NTASKS", _) => "4".into(),
                ("SLURM_PROCID", _) => "0".into(),
                ("SLURM_JOB_NODELIST" | "SLURM_STEP_NODELIST", _) => "n[1-2]".into(),
                ("SLURM_STEP_ID", Some(_)) => "0".into(),
                ("SLURM_STEP_NUM_TASKS", Some((tasks, _))) => tasks.to_string(),
                ("SLURMD_NODENAME", Some((_, node))) => format!("n{}", node + 1),
                ("SLURM_NODEID", Some((_, node))) => node.to_string(),
                _ => return None,
            };
            Some(v)
        }
    }

    /// The messages `bonfire launch` refuses a Slurm batch script and a step of more tasks
    /// than nodes with.
    pub(crate) fn slurm_refusals() -> Vec<CliError> {
        [slurm(None), slurm(Some((4, 0)))]
            .iter()
            .map(|get| placement(&args(), get).expect_err("refused"))
            .collect()
    }

    #[test]
    fn expendable_ranks_must_be_ranks_of_the_job_and_not_all_of_them() {
        let mut a = args();
        a.expendable_ranks = vec![0, 1, 1];
        let e = run(a).unwrap_err().to_string();
        assert!(e.contains("names every rank of the job (2)"), "{e}");
        let mut a = args();
        a.expendable_ranks = vec![2];
        let e = run(a).unwrap_err().to_string();
        assert!(e.contains("names rank 2, but the job has 2 ranks"), "{e}");
    }

    #[test]
    fn under_srun_one_launcher_per_node_takes_its_place_from_the_step() {
        let (nodes, node, master) = placement(&args(), &slurm(Some((2, 1)))).unwrap();
        assert_eq!((nodes, node, master.as_deref()), (2, 1, Some("n1:29510")));
        // Flags win; outside Slurm, one node.
        let mut given = args();
        given.nnodes = Some(3);
        given.node_rank = Some(2);
        assert_eq!(placement(&given, &slurm(None)).unwrap().0, 3);
        assert_eq!(placement(&args(), &|_| None).unwrap(), (1, 0, None));
        let refusals: Vec<String> = slurm_refusals().iter().map(|e| e.to_string()).collect();
        assert!(
            refusals[0].contains("batch script of Slurm job 10"),
            "{refusals:?}"
        );
        assert!(
            refusals[1].contains("has 4 tasks on 2 node(s)"),
            "{refusals:?}"
        );
        assert!(
            slurm_refusals()
                .iter()
                .all(|e| matches!(e, CliError::Usage(_)))
        );
    }
}
