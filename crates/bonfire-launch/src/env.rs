//! The job environment a rank is started in.
//!
//! Three sources, tried in order:
//! 1. `bonfire launch` or torchrun-style variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!    `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (and `GROUP_RANK` for the node);
//! 2. Slurm, in a task of an `srun` step: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`,
//!    `SLURM_LOCALID`, the node's place in `SLURM_STEP_NODELIST`, the first host of that list
//!    with `MASTER_PORT` or a port derived from `SLURM_JOB_ID` (see [`crate::slurm`]); a job's
//!    batch script, which Slurm gives `SLURM_PROCID=0` without a step, is refused;
//! 3. nothing: a single rank.
//!
//! bonfire's own variables refine any of them: `BONFIRE_SECRET` / `BONFIRE_SECRET_FILE`,
//! `BONFIRE_TIMEOUT` (collective timeout, seconds), `BONFIRE_PEER_TIMEOUT` (seconds of silence
//! before a peer is declared lost), `BONFIRE_CONNECT_TIMEOUT` (seconds to bring the job up),
//! `BONFIRE_BIND_ADDR`, `BONFIRE_ADVERTISE_ADDR` (a port other than 0 is the node's first: local
//! rank `i` takes port + `i`; rank 0 always listens on the master port, so on node 0 give that
//! port), `BONFIRE_QUIC_CONGESTION` (`cubic`, `newreno` or `bbr`),
//! `BONFIRE_RESTART_ROUND`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bonfire_topology::Rank;
use bonfire_transport::quic::Congestion;

use crate::slurm::{self, SlurmError, SlurmPlace};

/// Variable names, shared by the launcher (which sets them) and [`JobEnv`] (which reads them).
pub mod vars {
    /// This rank, 0-based (torchrun name).
    pub const RANK: &str = "RANK";
    /// Ranks in the job (torchrun name).
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    /// This rank's index on its node (torchrun name).
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    /// Ranks on this node (torchrun name).
    pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    /// The rendezvous host (torchrun name).
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    /// The rendezvous port (torchrun name).
    pub const MASTER_PORT: &str = "MASTER_PORT";
    /// This node's index (torchrun name).
    pub const GROUP_RANK: &str = "GROUP_RANK";
    /// The job secret itself.
    pub const SECRET: &str = "BONFIRE_SECRET";
    /// A file holding the job secret.
    pub const SECRET_FILE: &str = "BONFIRE_SECRET_FILE";
    /// Collective timeout, seconds.
    pub const TIMEOUT: &str = "BONFIRE_TIMEOUT";
    /// Peer silence before it is declared lost, seconds.
    pub const PEER_TIMEOUT: &str = "BONFIRE_PEER_TIMEOUT";
    /// Time allowed to bring the job up, seconds.
    pub const CONNECT_TIMEOUT: &str = "BONFIRE_CONNECT_TIMEOUT";
    /// Local address to listen on; a port other than 0 is local rank 0's, and local rank `i`
    /// listens on port + `i`.
    pub const BIND_ADDR: &str = "BONFIRE_BIND_ADDR";
    /// Address other ranks should dial to reach this one; a port other than 0 is local rank
    /// 0's, and local rank `i` gives port + `i`.
    pub const ADVERTISE_ADDR: &str = "BONFIRE_ADVERTISE_ADDR";
    /// QUIC's congestion controller: `cubic` (the default), `newreno` or `bbr`.
    pub const QUIC_CONGESTION: &str = "BONFIRE_QUIC_CONGESTION";
    /// The launcher's restart round.
    pub const RESTART_ROUND: &str = "BONFIRE_RESTART_ROUND";
    /// Set to `1` by `bonfire launch` when it prefixes the rank's output lines itself, so the
    /// rank's log lines carry no prefix of their own.
    pub const OUTPUT_PREFIXED: &str = "BONFIRE_OUTPUT_PREFIXED";
}

/// Where the job description came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum EnvSource {
    /// `bonfire launch` or torchrun-style variables.
    Launcher,
    /// Slurm's variables.
    Slurm,
    /// No job description: one rank.
    Single,
}

/// Where the job secret comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretSource {
    /// `BONFIRE_SECRET`.
    Env,
    /// `BONFIRE_SECRET_FILE`.
    File(PathBuf),
    /// Not given.
    Missing,
}

/// Everything a rank needs to join its job.
#[derive(Clone, Debug)]
pub struct JobEnv {
    /// Where this came from.
    pub source: EnvSource,
    /// This rank; `None` when `WORLD_SIZE` is set without `RANK`, and the rendezvous assigns
    /// one.
    pub rank: Option<Rank>,
    /// Ranks in the job.
    pub world_size: usize,
    /// This rank's index on its node.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// This node's index.
    pub node_rank: u32,
    /// The rendezvous, `host:port`.
    pub master: String,
    /// The job secret's source.
    pub secret: SecretSource,
    /// Collective timeout, if set.
    pub timeout: Option<Duration>,
    /// Peer timeout, if set.
    pub peer_timeout: Option<Duration>,
    /// Time to bring the job up, if set.
    pub connect_timeout: Option<Duration>,
    /// Local listen address, if set.
    pub bind: Option<SocketAddr>,
    /// Address to advertise, if set.
    pub advertise: Option<SocketAddr>,
    /// QUIC's congestion controller, if set.
    pub congestion: Option<Congestion>,
    /// Restart round.
    pub round: u32,
}

/// A job environment that does not make sense.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A variable has a value that cannot be used.
    #[error("{var}={value:?} is invalid: {why}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// Slurm's variables cannot be read.
    #[error(transparent)]
    Slurm(#[from] SlurmError),
    /// The process is a Slurm job's batch script, which looks like rank 0 without being one.
    #[error(
        "this process is the batch script of Slurm job {job} (SLURM_PROCID is set, SLURM_STEP_ID \
         is not), not one of its {tasks} ranks: start the ranks with `srun ./train`, or one \
         launcher per node with `srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 bonfire launch \
         --nproc-per-node N -- ./train`"
    )]
    SlurmBatchScript {
        /// The job.
        job: u32,
        /// Tasks in the job.
        tasks: usize,
    },
    /// A variable needed with the others is missing.
    #[error("{var} is not set, but {because} is: set it too (or run under `bonfire launch`)")]
    Missing {
        /// The missing variable.
        var: &'static str,
        /// The one that implies it.
        because: &'static str,
    },
}

fn parse<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
    why: &str,
) -> Result<Option<T>, EnvError> {
    match get(var) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|_| EnvError::Invalid {
            var,
            value: v,
            why: why.into(),
        }),
    }
}

fn seconds(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<Duration>, EnvError> {
    let v: Option<f64> = parse(get, var, "expected a number of seconds")?;
    match v {
        Some(s) if !(s > 0.0 && s < 1e9) => Err(EnvError::Invalid {
            var,
            value: s.to_string(),
            why: "expected a positive number of seconds".into(),
        }),
        Some(s) => Ok(Some(Duration::from_secs_f64(s))),
        None => Ok(None),
    }
}

fn addr(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<SocketAddr>, EnvError> {
    parse(get, var, "expected IP:PORT")
}

/// `var`'s address for local rank `local`: a fixed port is the node's first, and local rank `i`
/// takes port + `i`, so that the ranks of one node can share one setting (a firewall or relay
/// opened for a range of ports); port 0 stays 0 (the system picks one per rank).
fn local_addr(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
    local: usize,
) -> Result<Option<SocketAddr>, EnvError> {
    let Some(mut a) = addr(get, var)? else {
        return Ok(None);
    };
    if a.port() != 0 {
        let port = u16::try_from(a.port() as usize + local).map_err(|_| EnvError::Invalid {
            var,
            value: a.to_string(),
            why: format!(
                "local rank {local} would listen on port {} + {local}, past 65535",
                a.port()
            ),
        })?;
        a.set_port(port);
    }
    Ok(Some(a))
}

impl JobEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<JobEnv, EnvError> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// Reads a job description from `get` (tests pass a map).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<JobEnv, EnvError> {
        use vars::*;
        let rank: Option<u32> = parse(get, RANK, "expected a rank, 0 or more")?;
        let world: Option<usize> = parse(get, WORLD_SIZE, "expected a number of ranks")?;
        let slurm_rank: Option<u32> = parse(get, "SLURM_PROCID", "expected a number")?;
        let (source, rank, world_size, local_rank, local_world_size, node_rank, master) = if rank
            .is_some()
            || world.is_some()
        {
            let world = world.ok_or(EnvError::Missing {
                var: WORLD_SIZE,
                because: RANK,
            })?;
            let local: usize = parse(get, LOCAL_RANK, "expected a number")?.unwrap_or(0);
            let local_world: usize =
                parse(get, LOCAL_WORLD_SIZE, "expected a number")?.unwrap_or(world);
            let node: u32 = parse(get, GROUP_RANK, "expected a number")?.unwrap_or(0);
            let host = get(MASTER_ADDR).filter(|h| !h.trim().is_empty());
            let port: Option<u16> = parse(get, MASTER_PORT, "expected a port number")?;
            let master = match (host, port) {
                (Some(h), Some(p)) => format!("{}:{p}", h.trim()),
                (None, _) if world == 1 => String::new(),
                (None, _) => {
                    return Err(EnvError::Missing {
                        var: MASTER_ADDR,
                        because: WORLD_SIZE,
                    });
                }
                (Some(_), None) => {
                    return Err(EnvError::Missing {
                        var: MASTER_PORT,
                        because: MASTER_ADDR,
                    });
                }
            };
            (
                EnvSource::Launcher,
                rank,
                world,
                local,
                local_world,
                node,
                master,
            )
        } else {
            match slurm::place(get)? {
                SlurmPlace::Step(step) => (
                    EnvSource::Slurm,
                    Some(step.task as u32),
                    step.tasks,
                    step.local_task,
                    step.local_tasks,
                    step.node as u32,
                    step.rendezvous(get)?,
                ),
                SlurmPlace::BatchScript { job, tasks, .. } if slurm_rank.is_some() && tasks > 1 => {
                    return Err(EnvError::SlurmBatchScript { job, tasks });
                }
                _ => (EnvSource::Single, Some(0), 1, 0, 1, 0, String::new()),
            }
        };
        if world_size == 0 || rank.is_some_and(|r| r as usize >= world_size) {
            return Err(EnvError::Invalid {
                var: if source == EnvSource::Slurm {
                    "SLURM_PROCID"
                } else {
                    RANK
                },
                value: rank.map_or(String::new(), |r| r.to_string()),
                why: format!("outside a job of {world_size} ranks"),
            });
        }
        if local_rank >= local_world_size.max(1) {
            return Err(EnvError::Invalid {
                var: LOCAL_RANK,
                value: local_rank.to_string(),
                why: format!("outside a node of {local_world_size} ranks"),
            });
        }
        let secret = if get(SECRET).is_some_and(|s| !s.is_empty()) {
            SecretSource::Env
        } else if let Some(f) = get(SECRET_FILE).filter(|f| !f.is_empty()) {
            SecretSource::File(PathBuf::from(f))
        } else {
            SecretSource::Missing
        };
        Ok(JobEnv {
            source,
            rank: rank.map(Rank),
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            master,
            secret,
            timeout: seconds(get, TIMEOUT)?,
            peer_timeout: seconds(get, PEER_TIMEOUT)?,
            connect_timeout: seconds(get, CONNECT_TIMEOUT)?,
            bind: local_addr(get, BIND_ADDR, local_rank)?,
            advertise: local_addr(get, ADVERTISE_ADDR, local_rank)?,
            congestion: parse(get, QUIC_CONGESTION, "expected cubic, newreno or bbr")?,
            round: parse(get, RESTART_ROUND, "expected a number")?.unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<JobEnv, EnvError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        JobEnv::from_vars(&move |k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_names() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("BONFIRE_SECRET_FILE", "/run/secret"),
            ("BONFIRE_PEER_TIMEOUT", "2.5"),
        ])
        .unwrap();
        assert_eq!(e.source, EnvSource::Launcher);
        assert_eq!((e.rank, e.world_size, e.local_rank), (Some(Rank(3)), 4, 1));
        assert_eq!((e.local_world_size, e.node_rank), (2, 1));
        assert_eq!(e.master, "10.0.0.1:29500");
        assert_eq!(e.secret, SecretSource::File("/run/secret".into()));
        assert_eq!(e.peer_timeout, Some(Duration::from_millis(2500)));
    }

    #[test]
    fn a_fixed_port_is_the_nodes_first_and_each_local_rank_takes_the_next() {
        let at = |local: &str, bind: &str, advertise: &str| {
            env(&[
                ("RANK", local),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", local),
                ("LOCAL_WORLD_SIZE", "4"),
                ("MASTER_ADDR", "10.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("BONFIRE_BIND_ADDR", bind),
                ("BONFIRE_ADVERTISE_ADDR", advertise),
            ])
        };
        let e = at("3", "0.0.0.0:29600", "192.0.2.7:40000").unwrap();
        assert_eq!(e.bind, Some("0.0.0.0:29603".parse().unwrap()));
        assert_eq!(e.advertise, Some("192.0.2.7:40003".parse().unwrap()));
        let e = at("0", "0.0.0.0:29600", "192.0.2.7:40000").unwrap();
        assert_eq!(e.bind, Some("0.0.0.0:29600".parse().unwrap()));
        // Port 0 lets the system pick, for every rank.
        let e = at("2", "127.0.0.1:0", "").unwrap();
        assert_eq!(e.bind, Some("127.0.0.1:0".parse().unwrap()));
        assert_eq!(e.advertise, None);
        assert_eq!(e.congestion, None);
        let err = at("3", "0.0.0.0:65534", "").unwrap_err().to_string();
        let with = |c: &str| {
            env(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "1"),
                ("BONFIRE_QUIC_CONGESTION", c),
            ])
        };
        assert_eq!(with("BBR").unwrap().congestion, Some(Congestion::Bbr));
        assert_eq!(with("cubic").unwrap().congestion, Some(Congestion::Cubic));
        let bad = with("vegas").unwrap_err().to_string();
        assert!(
            bad.contains("BONFIRE_QUIC_CONGESTION") && bad.contains("bbr"),
            "{bad}"
        );
        assert!(
            err.contains("BONFIRE_BIND_ADDR")
                && err.contains("local rank 3")
                && err.contains("65535"),
            "{err}"
        );
    }

    #[test]
    fn slurm_names() {
        let e = env(&[
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08,11]"),
            ("SLURM_JOB_ID", "123456"),
        ])
        .unwrap();
        assert_eq!(e.source, EnvSource::Slurm);
        assert_eq!((e.rank, e.world_size, e.local_rank), (Some(Rank(5)), 8, 1));
        assert_eq!((e.local_world_size, e.node_rank), (4, 2));
        assert_eq!(e.master, format!("gpu07:{}", 29500 + 123456 % 2000));
        // The batch script of the same job is not rank 0.
        let err = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_JOB_NODELIST", "gpu[07-08,11]"),
            ("SLURM_JOB_ID", "123456"),
        ])
        .unwrap_err();
        assert_eq!(
            err,
            EnvError::SlurmBatchScript {
                job: 123456,
                tasks: 8
            }
        );
        assert!(err.to_string().contains("srun ./train"), "{err}");
    }

    #[test]
    fn nothing_means_one_rank() {
        let e = env(&[]).unwrap();
        assert_eq!(e.source, EnvSource::Single);
        assert_eq!((e.rank, e.world_size), (Some(Rank(0)), 1));
    }

    #[test]
    fn world_size_without_rank_asks_the_rendezvous() {
        let e = env(&[
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(
            (e.source, e.rank, e.world_size),
            (EnvSource::Launcher, None, 3)
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = env(&[("RANK", "two"), ("WORLD_SIZE", "4")]).unwrap_err();
        assert!(
            err.to_string().starts_with("RANK=\"two\" is invalid"),
            "{err}"
        );
        let err = env(&[
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("outside a job of 4 ranks"),
            "{err}"
        );
        let err = env(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(
            err.to_string().starts_with("MASTER_ADDR is not set"),
            "{err}"
        );
        let err = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("BONFIRE_TIMEOUT", "-3"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("BONFIRE_TIMEOUT"), "{err}");
    }
}
