//! [`DataParallelTraining`]: installing [`DataParallelStrategy`] on a `SupervisedTraining`.

use std::sync::Arc;

use burn::train::logger::InMemoryMetricLogger;
use burn::train::{LearningComponentsTypes, SupervisedTraining, TrainingStrategy};

use crate::{DataParallelStrategy, QuietRenderer};

/// Makes a burn-train `SupervisedTraining` one rank of a data-parallel job.
pub trait DataParallelTraining<LC: LearningComponentsTypes>: Sized {
    /// Trains with `strategy`. On every rank but 0 it also replaces the renderer with
    /// [`QuietRenderer`], keeps metrics in memory instead of files, and installs no application
    /// logger, so that only rank 0 writes to the artifact directory and the terminal. Call it
    /// after the other builder methods (a later `renderer(..)` would undo the quiet one).
    fn data_parallel(self, strategy: DataParallelStrategy<LC>) -> Self;
}

impl<LC> DataParallelTraining<LC> for SupervisedTraining<LC>
where
    LC: LearningComponentsTypes + Send + 'static,
{
    fn data_parallel(self, strategy: DataParallelStrategy<LC>) -> Self {
        let main = strategy.is_main();
        let training = self.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
        if main {
            training
        } else {
            training
                .renderer(QuietRenderer)
                .with_metric_logger(InMemoryMetricLogger::default())
                .with_application_logger(None)
        }
    }
}
