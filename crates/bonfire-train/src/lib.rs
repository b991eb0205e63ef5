//! burn-train integration for bonfire.
//!
//! Two ways to train a burn-train `Learner` data-parallel over `Autodiff<DataParallel<B>>`:
//!
//! - **One process per rank** (`bonfire launch`, one machine or many): install
//!   [`DataParallelStrategy`] with [`DataParallelTraining::data_parallel`]. Every rank trains on
//!   its shard; rank 0 alone validates, reports metrics and writes checkpoints.
//!
//!   ```ignore
//!   let world = bonfire::init()?;
//!   let result = SupervisedTraining::new(artifact_dir, loader_train, loader_valid)
//!       .metrics((AccuracyMetric::new(), LossMetric::new()))
//!       .with_file_checkpointer(CompactRecorder::new())
//!       .num_epochs(3)
//!       .data_parallel(DataParallelStrategy::new(device))   // last: it sets the renderer
//!       .launch(Learner::new(model, optim, lr));
//!   ```
//!
//! - **One process, several local devices** (burn-train's own DDP strategy, threads):
//!   `ExecutionStrategy::ddp(devices, DistributedConfig { all_reduce_op: ReduceOperation::Mean })`
//!   works unchanged over `DataParallel<B>`: each device becomes a rank of an in-process group,
//!   and a device may be listed several times (`vec![FlexDevice; 2]`: two replicas trained by
//!   two threads on one CPU backend).

mod quiet;
mod strategy;
mod training;

pub use quiet::{QuietRenderer, quietly};
pub use strategy::{DEFAULT_EPOCH_END_TIMEOUT, DataParallelStrategy};
pub use training::DataParallelTraining;
