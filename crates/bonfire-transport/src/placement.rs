//! Where a rank's threads run: its compute threads, and the threads that move its bytes.
//!
//! `bonfire launch --cpu-bind cores` gives each rank of a node a block of its own of the CPUs
//! the launcher may use ([`blocks`] of [`physical_order`]: a core's hardware threads together),
//! sets the rank's affinity to it before the program starts,
//! and names the block in `BONFIRE_CPUS`. Inside the rank the threads divide the block
//! ([`Placement::plan`]): a block of [`KEEP_FREE_FROM`] CPUs or more keeps its last CPU for
//! communication (the shared-memory lane's reader and writer threads, the collectives' runtime),
//! and the compute threads run on the others, so a bucket that is ready early goes out at once
//! instead of waiting for a compute thread to give up a core. A smaller block is shared: taking
//! one of two CPUs away from compute costs more than the wait it saves.
//!
//! `BONFIRE_COMM_CPUS` overrides the choice: `auto` (the above), `none` (no thread is placed),
//! or a list such as `7` or `6-7,15` (the communication threads run there, the compute threads
//! on the rest of what the rank may use). A list works without `--cpu-bind` too: given to every
//! rank of a node, it keeps one core of the machine free of compute for all their
//! communication threads.
//!
//! The plan is made once per process, from the affinity of the first thread that asks (before
//! any thread is placed): [`current`]. Threads then place themselves as they start ([`enter`]).
//! Off Linux nothing is placed.

use std::sync::OnceLock;

/// The rank's block of CPUs, set by `bonfire launch --cpu-bind cores` (for example `0-3`).
pub const CPUS_VAR: &str = "BONFIRE_CPUS";
/// Where the rank's communication threads run: `auto`, `none`, or a CPU list.
pub const COMM_CPUS_VAR: &str = "BONFIRE_COMM_CPUS";
/// The smallest block of CPUs that keeps one for communication under `auto`.
pub const KEEP_FREE_FROM: usize = 3;

/// Which of a rank's threads is asking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A thread that computes the rank's steps (Burn's ops on the CPU).
    Compute,
    /// A thread that moves or reduces the rank's bytes.
    Communication,
}

/// CPUs for each role; an empty list leaves that role's threads where the process may run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// CPUs the compute threads run on.
    pub compute: Vec<usize>,
    /// CPUs the communication threads run on.
    pub communication: Vec<usize>,
}

/// A malformed placement setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: {why}")]
pub struct PlacementError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub why: String,
}

impl Placement {
    /// The plan for a process that may run on `allowed`, bound to a block by the launcher or
    /// not (`bound`), in a job of `world` ranks, with `BONFIRE_COMM_CPUS` = `setting`.
    pub fn plan(
        allowed: &[usize],
        bound: bool,
        world: usize,
        setting: Option<&str>,
    ) -> Result<Placement, PlacementError> {
        let setting = setting.map(str::trim).unwrap_or("auto");
        let error = |why: String| PlacementError {
            var: COMM_CPUS_VAR,
            value: setting.to_string(),
            why,
        };
        let communication = match setting {
            "none" => return Ok(Placement::default()),
            "auto" | "" if bound && world > 1 && allowed.len() >= KEEP_FREE_FROM => {
                vec![*allowed.iter().max().expect("at least 3 CPUs")]
            }
            "auto" | "" => return Ok(Placement::default()),
            list => {
                let cpus = parse_cpu_list(list).map_err(|why| {
                    error(format!(
                        "{why}; expected auto, none or CPUs such as 7 or 6-7,15"
                    ))
                })?;
                if let Some(c) = cpus.iter().find(|c| !allowed.contains(c)) {
                    return Err(error(format!(
                        "CPU {c} is not one this process may run on ({})",
                        format_cpu_list(allowed)
                    )));
                }
                cpus
            }
        };
        let rest: Vec<usize> = allowed
            .iter()
            .copied()
            .filter(|c| !communication.contains(c))
            .collect();
        Ok(Placement {
            // Communication on every CPU leaves compute where it was.
            compute: if rest.is_empty() { Vec::new() } else { rest },
            communication,
        })
    }

    /// This role's CPUs; empty: not placed.
    pub fn cpus(&self, role: Role) -> &[usize] {
        match role {
            Role::Compute => &self.compute,
            Role::Communication => &self.communication,
        }
    }
}

/// This process's plan, made on the first call from the calling thread's affinity,
/// `BONFIRE_CPUS`, `WORLD_SIZE` and `BONFIRE_COMM_CPUS`.
pub fn current() -> Result<&'static Placement, &'static PlacementError> {
    static PLAN: OnceLock<Result<Placement, PlacementError>> = OnceLock::new();
    PLAN.get_or_init(|| {
        // The launcher's block when it bound this process (a thread placed before this call,
        // or a process started by one, would otherwise give a smaller set); else this thread's.
        let block = std::env::var(CPUS_VAR)
            .ok()
            .and_then(|v| parse_cpu_list(&v).ok())
            .filter(|b| !b.is_empty());
        let bound = block.is_some();
        let allowed = match block {
            Some(b) => b,
            None => thread_cpus().unwrap_or_default(),
        };
        let world = std::env::var("WORLD_SIZE")
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or(1);
        let setting = std::env::var(COMM_CPUS_VAR).ok();
        if allowed.is_empty() {
            // No affinity to read (not Linux): nothing to place.
            return Ok(Placement::default());
        }
        Placement::plan(&allowed, bound, world, setting.as_deref())
    })
    .as_ref()
}

/// Places the calling thread as `role`: binds it to that role's CPUs when the plan has any. A
/// malformed setting places nothing here; `bonfire::init` reports it.
pub fn enter(role: Role) {
    let Ok(plan) = current() else { return };
    let cpus = plan.cpus(role);
    if cpus.is_empty() {
        return;
    }
    if let Err(e) = bind_thread(cpus) {
        tracing::warn!(?role, cpus = %format_cpu_list(cpus), "cannot place a thread: {e}");
    }
}

/// Splits `cpus` into `ranks` blocks of equal size, in the order given (what `--cpu-bind cores`
/// gives each local rank, from [`physical_order`]); CPUs left over after equal blocks are given
/// to no rank. `None` when there are fewer CPUs than ranks.
pub fn blocks(cpus: &[usize], ranks: usize) -> Option<Vec<Vec<usize>>> {
    let mut seen = Vec::with_capacity(cpus.len());
    for &c in cpus {
        if !seen.contains(&c) {
            seen.push(c);
        }
    }
    let per = seen.len().checked_div(ranks)?;
    if per == 0 {
        return None;
    }
    Some(
        seen.chunks(per)
            .take(ranks)
            .map(<[usize]>::to_vec)
            .collect(),
    )
}

/// `cpus` ordered so that the hardware threads of one physical core are neighbours (by package,
/// then core, as Linux's `/sys/devices/system/cpu/cpuN/topology` gives them; by number where
/// it cannot be read), so that blocks of an even size cut from it hold whole cores on a host with
/// two threads per core, instead of sharing every core between two ranks.
pub fn physical_order(cpus: &[usize]) -> Vec<usize> {
    let read = |c: usize, f: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{c}/topology/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let keyed: Option<Vec<((u64, u64), usize)>> = cpus
        .iter()
        .map(|&c| Some(((read(c, "physical_package_id")?, read(c, "core_id")?), c)))
        .collect();
    match keyed {
        Some(mut k) => {
            k.sort_unstable();
            k.into_iter().map(|(_, c)| c).collect()
        }
        None => {
            let mut v = cpus.to_vec();
            v.sort_unstable();
            v
        }
    }
}

/// The compute threads a rank bound to `block` runs under `BONFIRE_COMM_CPUS` = `setting`
/// (`auto` when `None`): the block less the CPUs kept for communication.
pub fn compute_threads_in_block(block: &[usize], world: usize, setting: Option<&str>) -> usize {
    match Placement::plan(block, true, world, setting) {
        Ok(p) if !p.compute.is_empty() => p.compute.len(),
        _ => block.len(),
    }
    .max(1)
}

/// `0-3,6` as `[0, 1, 2, 3, 6]` (sorted, without repeats).
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in text.split(',').map(str::trim) {
        let number = |s: &str| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|&c| c < MAX_CPUS)
                .ok_or_else(|| format!("{s:?} is not a CPU number below {MAX_CPUS}"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (number(a)?, number(b)?);
                if a > b {
                    return Err(format!("{part:?} is an empty range"));
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(number(part)?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// `[0, 1, 2, 3, 6]` as `0-3,6`.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
            i += 1;
        }
        out.push(if sorted[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", sorted[i])
        });
        i += 1;
    }
    out.join(",")
}

/// The most CPUs an affinity mask here can name.
pub const MAX_CPUS: usize = 1024;

/// The CPUs the calling thread may run on (empty off Linux).
pub fn thread_cpus() -> std::io::Result<Vec<usize>> {
    imp::thread_cpus()
}

/// Binds the calling thread to `cpus`.
pub fn bind_thread(cpus: &[usize]) -> std::io::Result<()> {
    imp::bind(cpus)
}

/// An affinity mask for `cpus`, to bind a process about to start (`pre_exec`) with
/// [`bind_with`]: building it there would allocate after `fork`.
#[cfg(target_os = "linux")]
pub struct CpuMask(libc::cpu_set_t);

#[cfg(target_os = "linux")]
impl CpuMask {
    /// The mask of `cpus`.
    pub fn of(cpus: &[usize]) -> std::io::Result<CpuMask> {
        imp::mask(cpus).map(CpuMask)
    }
}

/// Binds the calling thread (the whole process, before it starts others) to `mask`. Only a
/// system call: safe between `fork` and `exec`.
#[cfg(target_os = "linux")]
pub fn bind_with(mask: &CpuMask) -> std::io::Result<()> {
    // SAFETY: the mask is a valid cpu_set_t of the size given.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mask.0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use super::MAX_CPUS;

    pub(super) fn mask(cpus: &[usize]) -> std::io::Result<libc::cpu_set_t> {
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let limit = (8 * std::mem::size_of::<libc::cpu_set_t>()).min(MAX_CPUS);
        for &c in cpus {
            if c >= limit {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("CPU {c} is past the {limit} an affinity mask holds"),
                ));
            }
            // SAFETY: c is below the set's size in bits.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
        Ok(set)
    }

    pub(super) fn bind(cpus: &[usize]) -> std::io::Result<()> {
        super::bind_with(&super::CpuMask(mask(cpus)?))
    }

    pub(super) fn thread_cpus() -> std::io::Result<Vec<usize>> {
        // SAFETY: as in `mask`; the kernel fills at most size_of::<cpu_set_t>() bytes.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let r =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let limit = (8 * std::mem::size_of::<libc::cpu_set_t>()).min(MAX_CPUS);
        // SAFETY: every c is below the set's size in bits.
        Ok((0..limit)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect())
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub(super) fn bind(_: &[usize]) -> std::io::Result<()> {
        Ok(())
    }

    pub(super) fn thread_cpus() -> std::io::Result<Vec<usize>> {
        Ok(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(allowed: &[usize], bound: bool, world: usize, setting: Option<&str>) -> Placement {
        Placement::plan(allowed, bound, world, setting).unwrap()
    }

    #[test]
    fn a_bound_block_of_three_or_more_keeps_its_last_cpu_for_communication() {
        let p = plan(&[4, 5, 6, 7], true, 2, None);
        assert_eq!(p.compute, vec![4, 5, 6]);
        assert_eq!(p.communication, vec![7]);
        assert_eq!(
            plan(&[0, 1, 2], true, 8, Some("auto")).communication,
            vec![2]
        );
        // Two CPUs are shared; so is a block of a job of one rank, and an unbound process.
        assert_eq!(plan(&[0, 1], true, 2, None), Placement::default());
        assert_eq!(plan(&[0, 1, 2, 3], true, 1, None), Placement::default());
        assert_eq!(plan(&[0, 1, 2, 3], false, 2, None), Placement::default());
        assert_eq!(
            plan(&[0, 1, 2, 3], true, 2, Some("none")),
            Placement::default()
        );
    }

    #[test]
    fn a_list_places_communication_there_and_compute_on_the_rest() {
        let p = plan(&[0, 1, 2, 3], false, 2, Some("3"));
        assert_eq!((p.compute, p.communication), (vec![0, 1, 2], vec![3]));
        let p = plan(&[0, 1, 2, 3], true, 1, Some(" 0,2-3 "));
        assert_eq!((p.compute, p.communication), (vec![1], vec![0, 2, 3]));
        // Communication on every CPU the process has leaves compute unplaced.
        let p = plan(&[0, 1], false, 2, Some("0-1"));
        assert_eq!((p.compute, p.communication), (vec![], vec![0, 1]));
    }

    #[test]
    fn a_bad_setting_is_named_with_what_is_wrong() {
        let e = Placement::plan(&[0, 1], false, 2, Some("5")).unwrap_err();
        assert_eq!(e.var, COMM_CPUS_VAR);
        assert!(
            e.to_string()
                .contains("CPU 5 is not one this process may run on (0-1)"),
            "{e}"
        );
        for bad in ["x", "3-1", "1,,2", "99999"] {
            let e = Placement::plan(&[0, 1], false, 2, Some(bad)).unwrap_err();
            assert!(
                e.to_string().contains("expected auto, none or CPUs"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn blocks_are_equal_and_in_order() {
        let cpus: Vec<usize> = (0..16).collect();
        let b = blocks(&cpus, 2).unwrap();
        assert_eq!(b, vec![(0..8).collect::<Vec<_>>(), (8..16).collect()]);
        let b = blocks(&[0, 1, 2, 3, 5], 2).unwrap();
        assert_eq!(b, vec![vec![0, 1], vec![2, 3]], "5 is left over");
        // The order given is kept: two threads of one core (0 and 8) stay in one block.
        let b = blocks(&[0, 8, 1, 9, 1], 2).unwrap();
        assert_eq!(b, vec![vec![0, 8], vec![1, 9]]);
        assert_eq!(blocks(&[0, 1], 2).unwrap(), vec![vec![0], vec![1]]);
        assert_eq!(blocks(&[0, 1], 3), None);
        assert_eq!(blocks(&[0, 1], 0), None);
    }

    #[test]
    fn physical_order_is_the_same_cpus_with_a_core_s_threads_together() {
        let here = thread_cpus().unwrap();
        let mut ordered = physical_order(&here);
        ordered.sort_unstable();
        assert_eq!(ordered, here);
        // CPUs the kernel does not know are put in number order.
        assert_eq!(physical_order(&[1001, 1000]), vec![1000, 1001]);
    }

    #[test]
    fn compute_threads_in_a_block_leave_out_the_communication_cpu() {
        let block: Vec<usize> = (8..16).collect();
        assert_eq!(compute_threads_in_block(&block, 2, None), 7);
        assert_eq!(compute_threads_in_block(&[0, 1], 2, None), 2);
        assert_eq!(compute_threads_in_block(&block, 1, None), 8);
        assert_eq!(compute_threads_in_block(&block, 2, Some("none")), 8);
        assert_eq!(compute_threads_in_block(&block, 2, Some("14-15")), 6);
        let bad = compute_threads_in_block(&[0], 2, Some("5"));
        assert_eq!(bad, 1, "a bad list changes nothing");
    }

    #[test]
    fn cpu_lists_read_and_write_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0-3,6").unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_cpu_list("6,0-1,1").unwrap(), vec![0, 1, 6]);
        assert_eq!(format_cpu_list(&[6, 0, 1, 2, 3]), "0-3,6");
        assert_eq!(format_cpu_list(&[1, 3, 5]), "1,3,5");
        assert_eq!(format_cpu_list(&[]), "");
    }

    /// Binding a thread changes what it may run on, and only that thread.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_bound_thread_runs_only_where_it_was_bound() {
        let mine = thread_cpus().unwrap();
        assert!(!mine.is_empty());
        let first = mine[0];
        let inner = std::thread::spawn(move || {
            bind_thread(&[first]).unwrap();
            thread_cpus().unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(inner, vec![first]);
        assert_eq!(
            thread_cpus().unwrap(),
            mine,
            "the spawning thread is unchanged"
        );
        assert!(bind_thread(&[MAX_CPUS + 1]).is_err());
    }
}
