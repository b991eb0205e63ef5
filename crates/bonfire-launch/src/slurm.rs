//! Where Slurm started this process: nowhere, in a job's batch script, or as a task of an
//! `srun` step. Ranks take their place from it ([`crate::JobEnv`]); `bonfire launch` takes its
//! node count, node index and rendezvous from it when started once per node by `srun`.
//!
//! Slurm's traps, as met on a real cluster (22.05): the batch script has `SLURM_PROCID=0` and the
//! job's `SLURM_NTASKS`, but no `SLURM_STEP_ID`, so it looks like rank 0 of the job without
//! being one; inside the allocation the step's own variables (`SLURM_STEP_NUM_TASKS`,
//! `SLURM_STEP_NODELIST`, `SLURM_STEP_TASKS_PER_NODE`) describe the ranks, which may be fewer than
//! the job's; node lists and counts are compressed (`n[1-2,7]`, `2(x3),1`).

/// What Slurm says about this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlurmPlace {
    /// Not in a Slurm job.
    None,
    /// The batch script of a job (or another process of its allocation that no `srun` started).
    BatchScript {
        /// The job.
        job: u32,
        /// Nodes in the allocation.
        nodes: usize,
        /// Tasks in the allocation.
        tasks: usize,
    },
    /// A task of an `srun` step.
    Step(SlurmStep),
}

/// A task of an `srun` step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlurmStep {
    /// The job.
    pub job: u32,
    /// This task among the step's.
    pub task: usize,
    /// Tasks in the step.
    pub tasks: usize,
    /// This task among its node's tasks.
    pub local_task: usize,
    /// Tasks of the step on this node.
    pub local_tasks: usize,
    /// The step's nodes, in order.
    pub hosts: Vec<String>,
    /// This node's index among them.
    pub node: usize,
}

impl SlurmStep {
    /// The rendezvous, `HOST:PORT`: `MASTER_ADDR` if set, else the step's first host; at
    /// `MASTER_PORT` if set, else at 29500 plus the job id modulo 2000 (two jobs sharing a node
    /// do not collide). Ranks started by `srun` and launchers started by `srun` agree on it.
    pub fn rendezvous(&self, get: &dyn Fn(&str) -> Option<String>) -> Result<String, SlurmError> {
        let host = get("MASTER_ADDR")
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| self.hosts[0].clone());
        let port = match get("MASTER_PORT").filter(|p| !p.trim().is_empty()) {
            Some(p) => p.trim().parse::<u16>().map_err(|_| SlurmError {
                var: "MASTER_PORT",
                value: p,
                why: "expected a port number",
            })?,
            None => 29500 + (self.job % 2000) as u16,
        };
        Ok(format!("{host}:{port}"))
    }
}

/// Slurm's variables could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is invalid: {why}")]
pub struct SlurmError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong.
    pub why: &'static str,
}

fn number(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<usize>, SlurmError> {
    match get(var).filter(|v| !v.trim().is_empty()) {
        None => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|_| SlurmError {
            var,
            value: v,
            why: "expected a number",
        }),
    }
}

/// Reads Slurm's variables through `get`.
pub fn place(get: &dyn Fn(&str) -> Option<String>) -> Result<SlurmPlace, SlurmError> {
    let Some(job) = number(get, "SLURM_JOB_ID")?.or(number(get, "SLURM_JOBID")?) else {
        return Ok(SlurmPlace::None);
    };
    let job = job as u32;
    let nodes = number(get, "SLURM_JOB_NUM_NODES")?
        .or(number(get, "SLURM_NNODES")?)
        .unwrap_or(1);
    let job_tasks = number(get, "SLURM_NTASKS")?.unwrap_or(1);
    if get("SLURM_STEP_ID").is_none_or(|s| s.trim().is_empty()) {
        return Ok(SlurmPlace::BatchScript {
            job,
            nodes,
            tasks: job_tasks,
        });
    }
    let task = number(get, "SLURM_PROCID")?.unwrap_or(0);
    let tasks = number(get, "SLURM_STEP_NUM_TASKS")?.unwrap_or(job_tasks);
    let local_task = number(get, "SLURM_LOCALID")?.unwrap_or(0);
    let list_var = if get("SLURM_STEP_NODELIST").is_some() {
        "SLURM_STEP_NODELIST"
    } else {
        "SLURM_JOB_NODELIST"
    };
    let list = get(list_var).unwrap_or_default();
    let hosts = expand_hosts(&list).ok_or_else(|| SlurmError {
        var: list_var,
        value: list.clone(),
        why: "not a node list such as n[1-2,7],gpu5",
    })?;
    // This node's place in the step: by its name, else the job's node index.
    let node = get("SLURMD_NODENAME")
        .and_then(|name| hosts.iter().position(|h| *h == name))
        .or(number(get, "SLURM_NODEID")?)
        .unwrap_or(0);
    let counts_var = [
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "SLURM_NTASKS_PER_NODE",
    ]
    .into_iter()
    .find(|v| get(v).is_some());
    let local_tasks = match counts_var.and_then(|var| Some((var, get(var)?))) {
        None => tasks,
        Some((counts_var, v)) => {
            let counts = expand_counts(&v).ok_or_else(|| SlurmError {
                var: counts_var,
                value: v.clone(),
                why: "not a task count list such as 2(x3),1",
            })?;
            counts
                .get(node)
                .or(counts.first())
                .copied()
                .unwrap_or(tasks)
        }
    };
    if task >= tasks || local_task >= local_tasks.max(1) || node >= hosts.len() {
        return Err(SlurmError {
            var: "SLURM_PROCID",
            value: task.to_string(),
            why: "outside the step that Slurm's other variables describe",
        });
    }
    Ok(SlurmPlace::Step(SlurmStep {
        job,
        task,
        tasks,
        local_task,
        local_tasks,
        hosts,
        node,
    }))
}

/// The hosts of a Slurm node list, in order: `n[1-2,07],gpu5` gives `n1 n2 n07 gpu5` (a range
/// keeps the width of its first number: `n[08-10]` gives `n08 n09 n10`).
pub fn expand_hosts(list: &str) -> Option<Vec<String>> {
    let mut hosts = Vec::new();
    let mut rest = list.trim();
    while !rest.is_empty() {
        let end = rest.find([',', '[']).unwrap_or(rest.len());
        let prefix = &rest[..end];
        rest = &rest[end..];
        if let Some(inner) = rest.strip_prefix('[') {
            let close = inner.find(']')?;
            for part in inner[..close].split(',') {
                let (a, b) = part.split_once('-').unwrap_or((part, part));
                let (lo, hi): (u64, u64) = (a.parse().ok()?, b.parse().ok()?);
                if hi < lo || hi - lo > 100_000 {
                    return None;
                }
                for n in lo..=hi {
                    hosts.push(format!("{prefix}{n:0width$}", width = a.len()));
                }
            }
            rest = &inner[close + 1..];
            // What follows a bracket is a suffix of the name (rare) or the next item.
            let next = rest.find(',').unwrap_or(rest.len());
            if next > 0 {
                return None;
            }
        } else if prefix.is_empty() {
            return None;
        } else {
            hosts.push(prefix.to_string());
        }
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    (!hosts.is_empty()).then_some(hosts)
}

/// A Slurm task count list, one count per node: `2(x3),1` gives `2 2 2 1`.
pub fn expand_counts(list: &str) -> Option<Vec<usize>> {
    let mut counts = Vec::new();
    for part in list.trim().split(',') {
        let (n, times) = match part.split_once("(x") {
            Some((n, t)) => (n, t.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part, 1),
        };
        let n: usize = n.trim().parse().ok()?;
        if times > 100_000 {
            return None;
        }
        counts.extend(std::iter::repeat_n(n, times));
    }
    Some(counts)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn place_of(pairs: &[(&str, &str)]) -> Result<SlurmPlace, SlurmError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        place(&move |k| map.get(k).cloned())
    }

    #[test]
    fn node_lists_expand_in_order() {
        assert_eq!(
            expand_hosts("n[1-2,07],gpu5").unwrap(),
            ["n1", "n2", "n07", "gpu5"]
        );
        assert_eq!(expand_hosts("n[08-10]").unwrap(), ["n08", "n09", "n10"]);
        assert_eq!(expand_hosts("a,b[3]").unwrap(), ["a", "b3"]);
        assert_eq!(expand_hosts(""), None);
        assert_eq!(expand_hosts("n[2-1]"), None);
        assert_eq!(expand_hosts("n[1-2"), None);
        assert_eq!(expand_counts("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_counts("4").unwrap(), [4]);
        assert_eq!(expand_counts("x"), None);
    }

    /// The variables of a batch script and of an srun task, as Slurm 22.05 sets them (recorded
    /// on the CI's two-node cluster).
    #[test]
    fn the_batch_script_is_not_a_rank_and_a_step_is() {
        let batch = [
            ("SLURM_JOB_ID", "2"),
            ("SLURM_JOB_NUM_NODES", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ];
        assert_eq!(
            place_of(&batch).unwrap(),
            SlurmPlace::BatchScript {
                job: 2,
                nodes: 2,
                tasks: 4
            }
        );
        let mut step = batch.to_vec();
        step.extend([
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "3"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURMD_NODENAME", "n2"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
        ]);
        let SlurmPlace::Step(s) = place_of(&step).unwrap() else {
            panic!("a step")
        };
        assert_eq!((s.task, s.tasks, s.local_task, s.local_tasks), (3, 4, 1, 2));
        assert_eq!((s.node, s.hosts.len()), (1, 2));
        assert_eq!(s.rendezvous(&|_| None).unwrap(), "n1:29502");
        let given = |k: &str| match k {
            "MASTER_ADDR" => Some("10.0.0.1".to_string()),
            "MASTER_PORT" => Some("7000".to_string()),
            _ => None,
        };
        assert_eq!(s.rendezvous(&given).unwrap(), "10.0.0.1:7000");
        let bad = |k: &str| (k == "MASTER_PORT").then(|| "http".to_string());
        assert_eq!(s.rendezvous(&bad).unwrap_err().var, "MASTER_PORT");
        // A step of one task per node within the same allocation.
        let mut launchers = step.clone();
        launchers.extend([
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
        ]);
        let SlurmPlace::Step(s) = place_of(&launchers).unwrap() else {
            panic!("a step")
        };
        assert_eq!((s.task, s.tasks, s.local_tasks, s.node), (1, 2, 1, 1));
        assert_eq!(place_of(&[]).unwrap(), SlurmPlace::None);
        let mut bad = step.clone();
        bad.push(("SLURM_STEP_NODELIST", "n[1-"));
        assert_eq!(place_of(&bad).unwrap_err().var, "SLURM_STEP_NODELIST");
    }
}
