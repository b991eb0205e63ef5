//! [`DataParallelStrategy`]: burn-train's supervised loop, one process per rank.

use std::time::Duration;

use bonfire_collectives::Communicator;
use bonfire_topology::{ShardError, Sharding};
use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::tensor::Device;
use burn::tensor::backend::DeviceOps;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent,
    LearningCheckpointer, LearningComponentsTypes, LearningResult, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainOutput, TrainingBackend,
    TrainingComponents, TrainingItem, TrainingModel, ValidLoader,
};

use crate::quiet::quietly;

/// How long the other ranks wait, by default, for rank 0 to validate and write its checkpoint at
/// the end of an epoch.
pub const DEFAULT_EPOCH_END_TIMEOUT: Duration = Duration::from_secs(3600);

/// burn-train's supervised training loop for a job of one process per rank (as started by
/// `bonfire launch`), over `Autodiff<DataParallel<B>>`:
///
/// - every rank trains on its own shard of the training set (the data loader is cut into equal
///   contiguous slices, one per rank, by [`bonfire_topology::Sharding::EqualDrop`], as
///   burn-train's DDP cuts it per device; each rank's loader still shuffles its slice every
///   epoch if it was built to), from rank 0's initial parameters;
///   gradients are averaged by `DataParallel` during backward, so every rank takes the same
///   optimizer step;
/// - rank 0 alone reports metrics, renders progress, validates, writes checkpoints and decides
///   early stopping; the other ranks wait for its decision at the end of every epoch (for at most
///   [`DataParallelStrategy::with_epoch_end_timeout`]);
/// - gradient accumulation (`SupervisedTraining::grads_accumulation(k)`) communicates once per
///   `k` micro-batches: the first `k - 1` backward passes run under [`bonfire_backend::no_sync`];
/// - resuming (`SupervisedTraining::checkpoint(epoch)`) loads the checkpoint on every rank (the
///   artifact directory must be readable by all of them: one machine or a shared file system),
///   then broadcasts rank 0's parameters; a rank that cannot read it stops the job, named.
///
/// At world size 1 (a plain `cargo run`, no launcher) it is burn-train's single-device loop.
/// Install it with [`crate::DataParallelTraining::data_parallel`], which also keeps the other
/// ranks from writing metric files and logs into rank 0's artifact directory.
pub struct DataParallelStrategy<LC: LearningComponentsTypes> {
    device: Device<TrainingBackend<LC>>,
    comm: Communicator,
    shard: bool,
    epoch_end_timeout: Duration,
}

impl<LC: LearningComponentsTypes> DataParallelStrategy<LC> {
    /// This rank's strategy, training on `device`. Call it after `bonfire::init()`: the rank and
    /// world size are those of the job `DataParallel` reduces over on `device`.
    pub fn new(device: Device<TrainingBackend<LC>>) -> Self {
        let comm = bonfire_backend::communicator(&device);
        Self {
            device,
            comm,
            shard: true,
            epoch_end_timeout: DEFAULT_EPOCH_END_TIMEOUT,
        }
    }

    /// Each rank's training loader already holds only its own shard (built with
    /// `bonfire::DistributedSampler`, say): do not cut it. Every rank must still have the same
    /// number of items, or the job stops before the first step with an error naming the sizes.
    pub fn presharded(mut self) -> Self {
        self.shard = false;
        self
    }

    /// How long the other ranks wait for rank 0's validation and checkpoint at the end of each
    /// epoch (default [`DEFAULT_EPOCH_END_TIMEOUT`]). Every other wait keeps the job's timeout.
    pub fn with_epoch_end_timeout(mut self, timeout: Duration) -> Self {
        self.epoch_end_timeout = timeout;
        self
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.comm.size()
    }

    /// True on rank 0, which reports, validates and writes checkpoints.
    pub fn is_main(&self) -> bool {
        self.comm.rank() == 0
    }

    fn abort(&self, message: impl std::fmt::Display) -> ! {
        bonfire_backend::abort(&self.device, message)
    }

    /// Every rank's `value`, in rank order.
    fn gather(&self, value: u64, what: &str) -> Vec<u64> {
        self.comm
            .all_gather(vec![value as i64])
            .wait()
            .unwrap_or_else(|e| self.abort(format!("exchanging {what}: {e}")))
            .into_iter()
            .map(|v| v as u64)
            .collect()
    }

    /// This rank's training loader: its slice of the whole, or its own (presharded) loader, after
    /// checking that every rank will run the same number of steps.
    fn shard(&self, loader: TrainLoader<LC>) -> TrainLoader<LC> {
        let loader = loader.to_device(&self.device);
        let (rank, world) = (self.comm.rank(), self.comm.size());
        if world == 1 {
            return loader;
        }
        let n = loader.num_items();
        let all = self.gather(n as u64, "the training set sizes");
        if let Some(other) = all.iter().position(|&m| m != n as u64) {
            let (what, fix) = if self.shard {
                ("training set", "every rank must load the same data set")
            } else {
                (
                    "training shard",
                    "presharded loaders must hold the same number of items on every rank",
                )
            };
            self.abort(format!(
                "the {what} has {n} items on rank {rank} but {} on rank {other} ({fix})",
                all[other]
            ));
        }
        if !self.shard {
            return loader;
        }
        // Equal slices, so that every rank runs the same number of steps; the last `n % world`
        // items are left out of training, as by PyTorch's DistributedSampler(drop_last=True).
        let slice = match Sharding::EqualDrop.shard(rank, world, n) {
            Ok(shard) => shard.range().expect("equal shards are consecutive"),
            Err(ShardError::TooFewItems { .. }) => self.abort(format!(
                "the training set has {n} items, fewer than the {world} ranks"
            )),
            Err(e) => self.abort(e),
        };
        loader.slice(slice.start, slice.end)
    }

    /// Loads checkpoint `epoch` on every rank; if any rank cannot, every rank stops, naming it.
    fn resume(
        &self,
        checkpointer: &LearningCheckpointer<LC>,
        learner: Learner<LC>,
        epoch: usize,
    ) -> Learner<LC> {
        let loaded = quietly(|| checkpointer.load_checkpoint(learner, &self.device, epoch));
        let ok = self.gather(
            loaded.is_ok() as u64,
            &format!("whether checkpoint {epoch} loaded"),
        );
        match loaded {
            Ok(learner) if ok.iter().all(|&f| f == 1) => learner,
            Ok(_) => {
                let failed: Vec<usize> = (0..ok.len()).filter(|&r| ok[r] == 0).collect();
                self.abort(format!(
                    "cannot resume from checkpoint {epoch}: rank(s) {failed:?} could not load it \
                     (every rank reads the artifact directory: one machine or a shared file system)"
                ))
            }
            Err(why) => self.abort(format!(
                "cannot resume from checkpoint {epoch}: {why} (every rank reads the artifact \
                 directory: one machine or a shared file system)"
            )),
        }
    }

    /// Rank 0's decision, at the end of an epoch, whether to stop; the other ranks wait for it.
    fn agree_to_stop(&self, stop: bool, epoch: usize) -> bool {
        if self.comm.size() == 1 {
            return stop;
        }
        let decision = self
            .comm
            .with_timeout(self.epoch_end_timeout)
            .broadcast(vec![u8::from(stop)], 0)
            .wait()
            .unwrap_or_else(|e| {
                self.abort(format!(
                    "waiting at the end of epoch {epoch} for rank 0's validation, checkpoint and \
                     decision to go on (timeout {:?}): {e}",
                    self.epoch_end_timeout
                ))
            });
        decision[0] == 1
    }

    #[allow(clippy::too_many_arguments)]
    fn train_epoch(
        &self,
        learner: &mut Learner<LC>,
        loader: &TrainLoader<LC>,
        global: &Progress,
        accumulation: Option<usize>,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &Interrupter,
    ) {
        let world = self.comm.size();
        let main = self.is_main();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        let mut pending = 0;
        while let Some(item) = iterator.next() {
            iteration += 1;
            learner.lr_step();
            let mut progress = iterator.progress();
            progress.items_processed *= world;
            progress.items_total *= world;

            let last = accumulation.is_none_or(|k| pending + 1 >= k);
            let TrainOutput { grads, item } = if last {
                learner.train_step(item)
            } else {
                let _local = bonfire_backend::no_sync();
                learner.train_step(item)
            };
            if last {
                learner.optimizer_step(grads);
                pending = 0;
            } else {
                bonfire_backend::keep_gradients(&learner.model(), grads);
                // Autodiff consumed the marks; the next backward must synchronise again.
                learner.grad_sharded();
                pending += 1;
            }

            if main {
                processor.process_train(LearnerEvent::ProcessedItem(TrainingItem::new(
                    item,
                    progress,
                    global.clone(),
                    Some(iteration),
                    Some(learner.lr_current()),
                )));
            }
            // Rank 0's interrupter is read at the end of the epoch, where the ranks agree; a rank
            // leaving the epoch alone would leave the others waiting in an all-reduce.
            if world == 1 && interrupter.should_stop() {
                break;
            }
        }
        if pending > 0 {
            // An epoch ending inside an accumulation window drops the partial window, as
            // burn-train's own loops do.
            bonfire_backend::discard_kept_gradients(&self.device);
        }
        if main {
            processor.process_train(LearnerEvent::EndEpoch(global.items_processed));
        }
    }

    fn validate(
        &self,
        learner: &Learner<LC>,
        loader: &ValidLoader<LC>,
        global: &Progress,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &Interrupter,
    ) {
        let model = learner.model().valid();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        while let Some(item) = iterator.next() {
            let progress = iterator.progress();
            iteration += 1;
            let item = model.step(item);
            processor.process_valid(LearnerEvent::ProcessedItem(TrainingItem::new(
                item,
                progress,
                global.clone(),
                Some(iteration),
                None,
            )));
            if interrupter.should_stop() {
                break;
            }
        }
        processor.process_valid(LearnerEvent::EndEpoch(global.items_processed));
    }
}

impl<LC: LearningComponentsTypes> SupervisedLearningStrategy<LC> for DataParallelStrategy<LC> {
    fn train(
        &self,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        mut components: TrainingComponents<LC>,
    ) -> LearningResult<LC::InferenceModel> {
        let main = self.is_main();
        let starting_epoch = match components.checkpoint {
            Some(epoch) => {
                if let Some(checkpointer) = &components.checkpointer {
                    learner = self.resume(checkpointer, learner, epoch);
                }
                epoch + 1
            }
            None => 1,
        };
        let summary = components.summary.clone();
        if main {
            components
                .event_processor
                .process_train(LearnerEvent::Start);
        }
        let (model, mut processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        if main {
            // (burn-train's own loops add the model's description; that setter is private.)
            let summary = summary.and_then(|s| s.init().ok());
            processor.process_train(LearnerEvent::End(summary));
        }
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let TrainingComponents {
            num_epochs,
            mut checkpointer,
            grad_accumulation,
            interrupter,
            mut early_stopping,
            mut event_processor,
            event_store,
            ..
        } = components;
        let main = self.is_main();
        if grad_accumulation == Some(0) {
            self.abort("grads_accumulation(0): accumulate over at least 1 micro-batch");
        }
        let train = self.shard(dataloader_train);
        let valid = dataloader_valid.to_device(self.device.inner());

        // Rank 0's parameters (and parameter ids, which the optimizer state is keyed by) on every
        // rank, registered with DataParallel in module order.
        learner.fork(&self.device);
        let model = bonfire_backend::replicate(learner.model());
        learner.load_model(model.into_record());
        if self.comm.size() > 1 {
            learner.grad_sharded();
        }

        for epoch in starting_epoch..=num_epochs {
            let global = Progress {
                items_processed: epoch,
                items_total: num_epochs,
            };
            self.train_epoch(
                &mut learner,
                &train,
                &global,
                grad_accumulation,
                &mut event_processor,
                &interrupter,
            );
            let mut stop = false;
            if main {
                if interrupter.should_stop() {
                    let reason = interrupter
                        .get_message()
                        .unwrap_or_else(|| "reason unknown".to_string());
                    tracing::warn!("bonfire: training interrupted after epoch {epoch}: {reason}");
                    stop = true;
                } else {
                    self.validate(
                        &learner,
                        &valid,
                        &global,
                        &mut event_processor,
                        &interrupter,
                    );
                    if let Some(checkpointer) = &mut checkpointer {
                        checkpointer.checkpoint(&learner, epoch, &event_store);
                    }
                    stop = early_stopping
                        .as_mut()
                        .is_some_and(|s| s.should_stop(epoch, &event_store));
                }
            }
            if self.agree_to_stop(stop, epoch) {
                break;
            }
        }
        (learner.model(), event_processor)
    }
}
