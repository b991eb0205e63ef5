//! Running a job: as the parent that settles the run and starts its ranks under the launcher,
//! or as one of those ranks ([`Runner`]).

use std::ffi::OsString;
use std::time::Duration;

use bonfire::World;
use bonfire::launch::{CpuBind, LaunchConfig, launch};
use bonfire::transport::placement;
use serde::{Deserialize, Serialize};

use crate::JobError;
use crate::checkpoint::{self, State};
use crate::job::{Job, JobConfig, JobState};
use crate::rank::{RankContext, agree};
use crate::report::{Console, Reporter, Say, Silent};
use crate::settings::{RunOptions, Settings, settle};

/// The variable through which the parent hands the settled run to the ranks it starts.
pub const SETTINGS_VAR: &str = "BONFIRE_JOB_SETTINGS";

/// Whether this process is a rank of a launched job (`RANK` and `WORLD_SIZE` are set, as
/// `bonfire launch`, torchrun-style launchers and the runner itself set them).
pub fn under_launcher() -> bool {
    std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some()
}

/// What this process was in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// It settled the run and started the ranks (or found nothing left to train).
    Parent,
    /// It was rank `rank` of `world` ranks.
    Rank {
        /// This rank.
        rank: usize,
        /// Ranks in the job.
        world: usize,
    },
}

/// How a run ended, for the process that ran [`Runner::run`].
#[derive(Debug)]
pub struct Finished<J: Job> {
    /// What this process was.
    pub role: Role,
    /// The settled run.
    pub settings: Settings<J::Config>,
    /// The run's state: as this rank ended it, or for the parent as the run's latest checkpoint
    /// holds it (its settings and every epoch's record).
    pub state: JobState<J>,
    /// This rank's report; `None` in the parent.
    pub report: Option<J::Report>,
}

/// The settled run, as the parent hands it to its ranks.
#[derive(Serialize, Deserialize)]
struct Handoff<C> {
    job: String,
    settings: Settings<C>,
}

/// Builds the arguments of the ranks' command line from the settled run.
type RankArgs<'a, C> = Box<dyn Fn(&Settings<C>) -> Vec<OsString> + 'a>;

/// Runs a job, in whichever part this process plays:
///
/// - started by hand (no `RANK` in the environment), it is the *parent*: it settles the run
///   (fetching the data set, choosing the run directory, applying the resume rules), then starts
///   the run's ranks on this machine under bonfire's launcher, each running this same program,
///   and waits for them;
/// - started as a rank (by the parent, or by `bonfire launch` directly), it joins the job, takes
///   the settled run (the parent's, or rank 0's decision, or its own with
///   [`Runner::each_rank_settles`]) and trains.
///
/// ```no_run
/// use bonfire_jobs::vision::{Vision, VisionData, VisionRequest};
/// use bonfire_jobs::{RunOptions, Runner};
///
/// let request = VisionRequest {
///     dataset: Some(VisionData::Embedded),
///     ..VisionRequest::default()
/// };
/// let options = RunOptions {
///     epochs: Some(1),
///     ..RunOptions::default()
/// };
/// let finished = Runner::new(&Vision, &request, &options).run()?;
/// let last = finished.state.history.last().expect("one epoch");
/// println!("test accuracy {:.2}%", 100.0 * last.test_accuracy);
/// # Ok::<(), bonfire_jobs::JobError>(())
/// ```
pub struct Runner<'a, J: Job> {
    job: &'a J,
    request: &'a J::Request,
    options: &'a RunOptions,
    reporter: Option<&'a mut dyn Reporter>,
    rank_args: Option<RankArgs<'a, J::Config>>,
    each_rank_settles: bool,
}

impl<'a, J: Job> Runner<'a, J> {
    /// A run of `job` as `request` and `options` ask, reported on the [`Console`].
    pub fn new(job: &'a J, request: &'a J::Request, options: &'a RunOptions) -> Self {
        Runner {
            job,
            request,
            options,
            reporter: None,
            rank_args: None,
            each_rank_settles: false,
        }
    }

    /// Reports to `reporter` instead of the console.
    pub fn reporter(mut self, reporter: &'a mut dyn Reporter) -> Self {
        self.reporter = Some(reporter);
        self
    }

    /// The ranks the parent starts run this program with the arguments `args` builds from the
    /// settled run (by default, with this process's own arguments). Either way the settled run
    /// reaches them through [`SETTINGS_VAR`].
    pub fn rank_args(mut self, args: impl Fn(&Settings<J::Config>) -> Vec<OsString> + 'a) -> Self {
        self.rank_args = Some(Box::new(args));
        self
    }

    /// As a rank given no settled run, settle the request on this rank instead of taking rank
    /// 0's decision: for a request that is already complete (every setting given, the run
    /// directory named), as `bonfire train --resolved` is.
    pub fn each_rank_settles(mut self, yes: bool) -> Self {
        self.each_rank_settles = yes;
        self
    }

    /// Runs the job: as the parent, or as a rank when [`under_launcher`].
    pub fn run(mut self) -> Result<Finished<J>, JobError> {
        let mut console = None;
        let reporter: &mut dyn Reporter = match self.reporter.take() {
            Some(r) => r,
            None => console.insert(Console::new()),
        };
        if under_launcher() {
            self.run_rank(reporter)
        } else {
            self.run_parent(reporter)
        }
    }

    /// Settles the run, starts its ranks and waits for them.
    fn run_parent(&self, reporter: &mut dyn Reporter) -> Result<Finished<J>, JobError> {
        let settings = settle(self.job, self.request, self.options, None, reporter)?;
        if settings.resume {
            let state = checkpoint::load::<J::Config, J::Record>(
                &settings.checkpoint_dir,
                settings.unchecked(),
            )?
            .state;
            if settings.epochs <= state.epochs_done {
                reporter.say(
                    Say::Notice,
                    &format!(
                        "{} already holds all {} {}{}",
                        settings.checkpoint_dir.display(),
                        settings.epochs,
                        J::ROUNDS,
                        J::TRAIN_ON_HINT,
                    ),
                );
                return Ok(self.parent_finished(settings, Some(state)));
            }
            // A fresh run's environment was checked before its directory was made.
            crate::settings::inherited_env(&settings.config)?;
        }
        let launched = launch(&self.launch_config(&settings)?)?;
        if let Some(summary) = launched.summary() {
            reporter.say(Say::Notice, &format!("the run finished {summary}"));
        }
        let state = checkpoint::load_state(&settings.checkpoint_dir, settings.unchecked())?;
        Ok(self.parent_finished(settings, state))
    }

    fn parent_finished(
        &self,
        settings: Settings<J::Config>,
        state: Option<JobState<J>>,
    ) -> Finished<J> {
        let state = state.unwrap_or_else(|| State::new(settings.config.clone(), settings.epochs));
        Finished {
            role: Role::Parent,
            settings,
            state,
            report: None,
        }
    }

    /// The launcher's configuration for the run's ranks on this machine.
    fn launch_config(&self, s: &Settings<J::Config>) -> Result<LaunchConfig, JobError> {
        let exe = std::env::current_exe().map_err(JobError::CurrentExe)?;
        let ranks = s.config.ranks();
        let mut config = LaunchConfig::local(ranks, exe);
        config.args = match &self.rank_args {
            Some(build) => build(s),
            None => std::env::args_os().skip(1).collect(),
        };
        config.prefix_output = false;
        config.max_restarts = self.options.max_restarts;
        // Workers that die are dropped; one that fails with an error of its own fails the run.
        config.expendable = s.config.expendable_ranks();
        config.expendable_deaths_only = true;
        config.timeout = None;
        // How long a rank waits on a silent peer before naming it (a worker that died, which
        // asynchronous parameter servers then drop): a minute, unless the environment sets
        // BONFIRE_PEER_TIMEOUT, which the ranks then inherit and read as any rank does.
        config.peer_timeout = std::env::var_os(bonfire::launch::env::vars::PEER_TIMEOUT)
            .is_none()
            .then_some(Duration::from_secs(60));
        let handoff = Handoff {
            job: J::NAME.to_string(),
            settings: s.clone(),
        };
        let json = serde_json::to_string(&handoff).map_err(JobError::Handoff)?;
        config.extra_env.push((SETTINGS_VAR.into(), json.into()));
        if s.config.bf16_gradients() {
            config
                .extra_env
                .push(("BONFIRE_GRAD_DTYPE".into(), "bf16".into()));
        }
        if s.config.tensor_parallel() > 1 {
            config.extra_env.push((
                "BONFIRE_TP".into(),
                s.config.tensor_parallel().to_string().into(),
            ));
        }
        if s.config.pipeline_stages() > 1 {
            config.extra_env.push((
                "BONFIRE_PP".into(),
                s.config.pipeline_stages().to_string().into(),
            ));
        }
        // Like torchrun's OMP_NUM_THREADS: the ranks share this machine's cores instead of each
        // starting a compute thread per core (with 2 ranks on 2 cores, 2 threads each cost
        // 10-20% of the throughput; see BENCHMARKS.md). An explicit setting is kept.
        // OMP_NUM_THREADS is LibTorch's (and OpenBLAS's, in a build with `openblas`), set the
        // same way.
        // Under BONFIRE_CPU_BIND=cores a rank's block of 3 cores or more keeps one for its
        // communication threads, and computes on the others.
        config.cpu_bind = CpuBind::from_env()?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // The block the launcher will give each rank (all are the same size).
        let block = config.cpu_blocks()?.map(|mut b| b.swap_remove(0));
        let threads = match block {
            Some(block) => placement::compute_threads_in_block(
                &block,
                ranks,
                std::env::var(placement::COMM_CPUS_VAR).ok().as_deref(),
            ),
            None => (cores / ranks).max(1),
        };
        for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
            if std::env::var_os(var).is_none() {
                config
                    .extra_env
                    .push((var.into(), threads.to_string().into()));
            }
        }
        Ok(config)
    }

    /// One rank: join the job, take the settled run, train.
    fn run_rank(&self, reporter: &mut dyn Reporter) -> Result<Finished<J>, JobError> {
        // This thread computes the rank's steps (`RAYON_NUM_THREADS` threads in all).
        let _compute = bonfire::compute_on_this_thread();
        let world = bonfire::init()?;
        let mut silent = Silent;
        let settings = if world.is_main() {
            self.rank_settings(&world, reporter)?
        } else {
            self.rank_settings(&world, &mut silent)?
        };
        if settings.config.bf16_gradients()
            && std::env::var("BONFIRE_GRAD_DTYPE").as_deref() != Ok("bf16")
        {
            return Err(JobError::Bf16NotSet { job: J::NAME });
        }
        let tp = settings.config.tensor_parallel();
        if world.tp_group().size() != tp {
            return Err(JobError::TpNotSet {
                job: J::NAME,
                tp,
                found: world.tp_group().size(),
            });
        }
        let pp = settings.config.pipeline_stages();
        if world.pp_group().size() != pp {
            return Err(JobError::PpNotSet {
                job: J::NAME,
                pp,
                found: world.pp_group().size(),
            });
        }
        // Every rank holds the reporter, and the context lets only its main rank speak: rank 0,
        // or the first rank left once asynchronous parameter servers dropped ranks.
        let mut ctx = RankContext::new(&world, &settings, reporter);
        let (state, report) = self.job.train_rank(&mut ctx)?;
        Ok(Finished {
            role: Role::Rank {
                rank: world.rank().0 as usize,
                world: world.world_size(),
            },
            settings,
            state,
            report: Some(report),
        })
    }

    /// The settled run on this rank: the parent's, or this rank's own settling, or rank 0's.
    fn rank_settings(
        &self,
        world: &World,
        reporter: &mut dyn Reporter,
    ) -> Result<Settings<J::Config>, JobError> {
        let size = world.world_size();
        if let Some(settings) = handed_down::<J>()? {
            let ranks = settings.config.ranks();
            if ranks != size {
                return Err(JobError::RanksMismatch { ranks, world: size });
            }
            return Ok(settings);
        }
        let settle_here = |reporter: &mut dyn Reporter| {
            settle(self.job, self.request, self.options, Some(size), reporter)
        };
        if self.each_rank_settles {
            settle_here(reporter)
        } else {
            agree(world, || settle_here(reporter))
        }
    }
}

/// The settled run the parent handed down, if it did.
fn handed_down<J: Job>() -> Result<Option<Settings<J::Config>>, JobError> {
    let Some(json) = std::env::var_os(SETTINGS_VAR) else {
        return Ok(None);
    };
    let handoff: Handoff<J::Config> =
        serde_json::from_slice(json.as_encoded_bytes()).map_err(JobError::Handoff)?;
    if handoff.job != J::NAME {
        return Err(JobError::WrongJob {
            expected: J::NAME,
            found: handoff.job,
        });
    }
    Ok(Some(handoff.settings))
}
