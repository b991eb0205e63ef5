//! Data parallelism as a burn-train 0.22 training strategy: [`DataParallel`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bonfire_launch::stragglers::{RankTimes, THRESHOLD, report_line, stragglers};

use bonfire_collectives::Communicator;

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Device;
use burn::train::train::WorkerFailure;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents,
    TrainingError, TrainingItem, TrainingStrategy, ValidLoader,
};

use crate::world::World;

/// Data parallelism for burn-train 0.22's `SupervisedTraining`: every rank of the job runs the
/// same program, trains on its share of the training loader ([`World::shard`]) from rank 0's
/// parameters ([`World::replicate`]), and averages its gradients with the other ranks' before
/// each optimizer step ([`World::average`]; with `grads_accumulation(n)`, once every `n`
/// batches). Rank 0 alone validates, feeds the metrics and the renderer, writes checkpoints and
/// decides early stopping. The ranks agree before every optimizer step whether any of them
/// wants to stop (its interrupter, a batch its loader failed to make), and after each epoch
/// whether to go on (rank 0's early stopping), so a stop on any rank stops them all at the same
/// step or epoch.
///
/// The device is made an autodiff device here; burn-train's `gradient_checkpointing()` applies
/// to its own strategies only, so with this one pass
/// `device.autodiff().gradient_checkpointing()` to [`DataParallel::new`] instead.
///
/// ```no_run
/// # use burn::train::{LearnerModel, SupervisedTraining, TrainingStrategy};
/// # fn f<M: LearnerModel>(training: SupervisedTraining<M>) -> Result<(), bonfire_burn022::InitError> {
/// let world = bonfire_burn022::init()?;
/// let device = burn::tensor::Device::default();
/// let training = training.with_training_strategy(
///     bonfire_burn022::DataParallel::new(&world, device).into(),
/// );
/// # let _ = training; Ok(()) }
/// ```
///
/// A collective that fails (a peer died or timed out) stops this rank's training with the
/// error in the [`LearningResult`](burn::train::LearningResult)'s `error`, naming the rank, the
/// collective and the sizes. With `.checkpoint(epoch)`, every rank loads the checkpoint from its
/// own directory before training, so the directory must be reachable from every rank (one host,
/// or a shared file system); rank 0's parameters are then copied to the others.
#[derive(Clone, Debug)]
pub struct DataParallel {
    world: World,
    device: Device,
    epoch_end_timeout: Duration,
    /// Optimizer steps taken, shared by the clones.
    steps: Arc<AtomicUsize>,
    /// Every rank's times in each epoch trained, shared by the clones.
    times: Arc<Mutex<Vec<EpochTimes>>>,
}

/// How long the other ranks wait at the end of an epoch for rank 0's validation and checkpoint,
/// unless [`DataParallel::with_epoch_end_timeout`] says otherwise: one hour.
pub const DEFAULT_EPOCH_END_TIMEOUT: Duration = Duration::from_secs(3600);

impl DataParallel {
    /// Trains on `device` (made an autodiff device if it is not one, keeping its gradient
    /// checkpointing when it is) as this rank of `world`.
    pub fn new(world: &World, device: Device) -> Self {
        Self {
            world: world.clone(),
            device,
            epoch_end_timeout: DEFAULT_EPOCH_END_TIMEOUT,
            steps: Arc::new(AtomicUsize::new(0)),
            times: Arc::default(),
        }
    }

    /// The straggler line of the epochs trained so far, the same on every rank (bonfire's rule,
    /// as the Burn 0.21 jobs report it): `stragglers      rank 1 in epochs 2, 3 (compute; up to
    /// 41% slower than the median of the others)`, that there were none, or `None` for a job of
    /// one rank or before any epoch (an epoch whose times could not be gathered is left out).
    /// Each epoch's stragglers are also in rank 0's log as the epoch ends.
    pub fn straggler_report(&self) -> Option<String> {
        let epochs = self.times.lock().unwrap_or_else(|e| e.into_inner());
        report_line(epochs.iter().map(|(e, t)| (*e, t.as_slice())))
    }

    /// Every rank's seconds in each epoch trained so far (making batches, computing, waiting),
    /// by epoch and rank.
    pub fn epoch_times(&self) -> Vec<EpochTimes> {
        self.times.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Optimizer steps this rank has taken under this strategy and its clones (keep a clone,
    /// hand the other to `with_training_strategy`, read it after `launch`).
    pub fn steps(&self) -> usize {
        self.steps.load(Ordering::Relaxed)
    }

    /// How long the other ranks wait at the end of each epoch while rank 0 validates and writes
    /// its checkpoint ([`DEFAULT_EPOCH_END_TIMEOUT`] unless set). Every other wait keeps the
    /// job's collective timeout (`BONFIRE_TIMEOUT`).
    pub fn with_epoch_end_timeout(mut self, timeout: Duration) -> Self {
        self.epoch_end_timeout = timeout;
        self
    }
}

impl<M: LearnerModel> From<DataParallel> for TrainingStrategy<M> {
    fn from(strategy: DataParallel) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

/// An epoch's number and every rank's seconds in it (making batches, computing, waiting), by
/// rank.
pub type EpochTimes = (usize, Vec<RankTimes>);

/// Verdicts of the ranks' agreements: go on; finish cleanly (rank 0's early stopping); stop
/// (an interrupter, a failure), which the ranks that did not ask record as their reason.
const GO_ON: f32 = 0.0;
const FINISH: f32 = 1.0;
const STOP: f32 = 2.0;

/// The reason a rank records when another rank stopped the training.
const STOPPED_BY_ANOTHER: &str = "another rank of the job stopped its training";

/// A failed collective as burn-train reports a failed worker: this rank, and the error.
fn failure(world: &World, error: impl std::fmt::Display) -> TrainingError {
    TrainingError::Workers(vec![WorkerFailure {
        device_id: world.comm().rank(),
        message: format!("bonfire rank {}: {error}", world.rank().0),
    }])
}

impl DataParallel {
    /// An agreement among the ranks on whether to go on: the maximum of each rank's verdict
    /// ([`GO_ON`], [`FINISH`], [`STOP`]), sent `width` times. Per-step agreements send one value
    /// and the two at each epoch's end two, so that a rank out of step with the others (a
    /// loader of another length) fails at once with a mismatch instead of pairing one with the
    /// other. A rank that cannot agree (a peer is gone) stops and records why. A rank that did
    /// not ask to stop but is stopped by another's [`STOP`] records that as its reason.
    fn agree(
        &self,
        mine: f32,
        width: usize,
        comm: &Communicator,
        interrupter: &Interrupter,
    ) -> f32 {
        let verdict = match comm
            .all_reduce(vec![mine; width], bonfire_topology::ReduceOp::Max)
            .wait()
        {
            Ok(v) => v[0],
            Err(e) => {
                interrupter.fail(failure(
                    &self.world,
                    format!("agreeing whether to stop: {e}"),
                ));
                STOP
            }
        };
        if verdict >= STOP && mine < STOP && !interrupter.should_stop() {
            interrupter.stop(Some(STOPPED_BY_ANOTHER));
        }
        verdict
    }

    /// One epoch of training on this rank's share. Before each optimizer step the ranks agree
    /// whether any of them wants to stop (its interrupter, a failed batch): then all of them
    /// stop at that step, and the ones that did not ask are stopped with a reason.
    fn train_epoch<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        grad_accumulation: Option<usize>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
        device: &Device,
    ) -> RankTimes {
        let main = self.world.is_main();
        let comm = self.world.comm();
        // Seconds making batches, waiting for the others (agreements and averages, after the
        // device has finished the step's work, so that a GPU's queued forward and backward
        // count as compute), and the rest of the epoch's steps (forward, backward, optimizer);
        // rank 0's metrics and renderer count in none of them.
        let mut times = RankTimes::default();
        let mut elsewhere = 0.0;
        let began = Instant::now();
        let mut mark = began;
        let since = |mark: &mut Instant| {
            let now = Instant::now();
            let secs = now.duration_since(*mark).as_secs_f64();
            *mark = now;
            secs
        };
        let mut iterator = loader.iter();
        times.input += since(&mut mark);
        let mut iteration = 0;
        let mut accumulator = GradientsAccumulator::new();
        let mut accumulated = 0;
        loop {
            let item = iterator.next();
            times.input += since(&mut mark);
            let Some(item) = item else { break };
            let item = match item {
                Ok(item) => item,
                Err(err) => {
                    interrupter.fail(err);
                    // Meet the others at their next step's agreement, so they stop too.
                    self.agree(STOP, 1, comm, interrupter);
                    times.wait += since(&mut mark);
                    break;
                }
            };
            iteration += 1;
            let progress = iterator.progress();
            let output = learner.train_step(item);
            let grads: Option<GradientsParams> = match grad_accumulation {
                Some(n) => {
                    accumulator.accumulate(&learner.model(), output.grads);
                    accumulated += 1;
                    if n <= accumulated || progress.is_completed() {
                        accumulated = 0;
                        Some(accumulator.grads())
                    } else {
                        None
                    }
                }
                None => Some(output.grads),
            };
            if let Some(grads) = grads {
                let mine = if interrupter.should_stop() {
                    STOP
                } else {
                    GO_ON
                };
                // The step's work done, the rest is waiting (an error here shows again below).
                device.sync().ok();
                let _ = since(&mut mark);
                let verdict = self.agree(mine, 1, comm, interrupter);
                let averaged =
                    (verdict == GO_ON).then(|| self.world.average(grads, &learner.model()));
                times.wait += since(&mut mark);
                match averaged {
                    None => break,
                    Some(Ok(grads)) => {
                        learner.lr_step();
                        learner.optimizer_step(grads);
                        self.steps.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(Err(e)) => {
                        interrupter.fail(failure(&self.world, e));
                        break;
                    }
                }
            }
            if main {
                let _ = since(&mut mark);
                let item = TrainingItem::new(
                    output.item,
                    progress,
                    Some(iteration),
                    Some(learner.lr_current()),
                );
                interrupter
                    .fail_on_error(processor.process_train(LearnerEvent::ProcessedItem(item)));
                elsewhere += since(&mut mark);
            }
        }
        let total = began.elapsed().as_secs_f64();
        times.compute = (total - times.input - times.wait - elsewhere).max(0.0);
        times
    }

    /// Every rank's times of the epoch, gathered on every rank (3 values each); rank 0 names
    /// the stragglers in its log, and every rank keeps the epoch for [`Self::straggler_report`].
    fn gather_times(&self, epoch: usize, mine: RankTimes, interrupter: &Interrupter) {
        let gathered = self.world.comm().all_gather(mine.values()).wait();
        let all = match gathered {
            Ok(all) => all,
            Err(e) => {
                interrupter.fail(failure(
                    &self.world,
                    format!("gathering the epoch's times: {e}"),
                ));
                return;
            }
        };
        let times = RankTimes::from_gathered(&all);
        if self.world.is_main() {
            for s in stragglers(&times, THRESHOLD) {
                tracing::warn!("epoch {epoch}: straggler: {}", s.describe());
            }
        }
        self.times
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((epoch, times));
    }

    /// Rank 0's validation epoch.
    fn valid_epoch<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        loader: &ValidLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) {
        let model = learner.model().valid();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        while let Some(item) = iterator.next() {
            let item = match item {
                Ok(item) => item,
                Err(err) => {
                    interrupter.fail(err);
                    break;
                }
            };
            iteration += 1;
            let progress = iterator.progress();
            let item = InferenceStep::step(&model, item);
            let item = TrainingItem::new(item, progress, Some(iteration), None);
            interrupter.fail_on_error(processor.process_valid(LearnerEvent::ProcessedItem(item)));
            if interrupter.should_stop() {
                break;
            }
        }
    }
}

impl<M: LearnerModel> SupervisedLearningStrategy<M> for DataParallel {
    fn fit(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let main = self.world.is_main();
        let device = if self.device.is_autodiff() {
            self.device.clone()
        } else {
            self.device.clone().autodiff()
        };
        let train = self.world.shard(dataloader_train).to_device(&device);
        let train_items = train.num_items();
        let valid = dataloader_valid.to_device(&device.clone().inner());
        let valid_items = valid.num_items();
        let interrupter = components.interrupter;
        let mut processor = components.event_processor;
        let mut checkpointer = components.checkpointer;
        let mut early_stopping = components.early_stopping;
        // Rank 0 validates while the others wait for its decision.
        let epoch_end = self.world.comm().with_timeout(self.epoch_end_timeout);

        learner.fork(&device);
        match self.world.replicate(learner.model()) {
            Ok(model) => {
                learner.load_model(model.into_record());
                learner.fork(&device);
            }
            Err(e) => {
                interrupter.fail(failure(&self.world, e));
                return (learner.model(), processor);
            }
        }

        for epoch in starting_epoch..=components.num_epochs {
            if main {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: train_items,
                }));
            }
            tracing::debug!(epoch, "training epoch");
            let times = self.train_epoch(
                &mut learner,
                &train,
                components.grad_accumulation,
                &mut processor,
                &interrupter,
                &device,
            );
            self.gather_times(epoch, times, &interrupter);
            if main {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
            }
            let mine = if interrupter.should_stop() {
                STOP
            } else {
                GO_ON
            };
            if self.agree(mine, 2, self.world.comm(), &interrupter) > GO_ON {
                break;
            }

            let mut finish = false;
            if main {
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: valid_items,
                }));
                self.valid_epoch(&learner, &valid, &mut processor, &interrupter);
                interrupter.fail_on_error(processor.process_valid(LearnerEvent::EndSplit(epoch)));
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndEpoch(epoch)));
                if checkpointer.is_some() || early_stopping.is_some() {
                    interrupter.fail_on_error(processor.flush());
                }
                if !interrupter.should_stop() {
                    if let Some(checkpointer) = &mut checkpointer {
                        checkpointer.checkpoint(&learner, epoch, &components.event_store);
                    }
                    if let Some(early_stopping) = &mut early_stopping {
                        finish = early_stopping.should_stop(epoch, &components.event_store);
                    }
                }
            }
            let mine = match (interrupter.should_stop(), finish) {
                (true, _) => STOP,
                (false, true) => FINISH,
                (false, false) => GO_ON,
            };
            if self.agree(mine, 2, &epoch_end, &interrupter) > GO_ON {
                break;
            }
        }
        (learner.model(), processor)
    }
}
