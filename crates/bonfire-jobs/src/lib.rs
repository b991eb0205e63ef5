//! bonfire's training jobs as a library: what `bonfire train` runs, callable from a program of
//! your own, with a config struct in and a typed result out.
//!
//! The job-independent machinery is generic over a [`Job`]:
//!
//! - [`settings`]: settling a run from a request and [`RunOptions`] (on a resume, options left
//!   out take the checkpoint's values, and settings that decide the result must match it; a
//!   fresh run gets `runs/<job>-N`);
//! - [`Runner`]: the parent that settles the run and starts its ranks under bonfire's launcher,
//!   or one of those ranks; ranks agree on the settled run (rank 0 decides, the others take its
//!   decision: [`rank::agree`]);
//! - [`checkpoint`]: atomic checkpoints and exact resume;
//! - [`Reporter`]: where output goes ([`Console`] prints what `bonfire train` prints), with the
//!   progress line ([`StepProgress`]), the PNG [`plot`]s and the end [`report`];
//! - [`data`]: the per-epoch order of a rank's shard, and parameter digests.
//!
//! The jobs themselves are modules: [`vision`] (the bundled ResNet on MNIST) and [`gpt`] (the
//! bundled GPT-style decoder on Shakespeare, character by character, with sampling; and the
//! model's tensor-parallel plan).
//!
//! ```no_run
//! use bonfire_jobs::vision::{Vision, VisionData, VisionRequest};
//! use bonfire_jobs::{RunOptions, Runner, Silent};
//!
//! let request = VisionRequest {
//!     dataset: Some(VisionData::Embedded),
//!     ranks: Some(2),
//!     ..VisionRequest::default()
//! };
//! let options = RunOptions {
//!     epochs: Some(2),
//!     ..RunOptions::default()
//! };
//! // Started by hand this process settles the run and starts two ranks, each running this same
//! // program; in them, `run` trains.
//! let finished = Runner::new(&Vision, &request, &options)
//!     .reporter(&mut Silent)
//!     .run()?;
//! if let Some(last) = finished.state.history.last() {
//!     println!("{} epochs, test accuracy {:.2}%", last.epoch, 100.0 * last.test_accuracy);
//! }
//! # Ok::<(), bonfire_jobs::JobError>(())
//! ```

mod backend;
pub mod checkpoint;
pub mod data;
pub mod devices;
mod error;
pub mod gpt;
mod job;
pub mod kernel_cache;
mod optim;
pub mod plot;
mod progress;
pub mod rank;
mod record_guard;
pub mod report;
mod runner;
pub mod settings;
pub mod stragglers;
pub mod strategy;
pub mod vision;

pub use backend::{BackendKind, CUDA_HINT, WGPU_HINT, open_gpu};
pub use error::{Clash, JobError};
pub use job::{Job, JobCheckpoint, JobConfig, JobState};
pub use progress::{StepProgress, clock};
pub use rank::RankContext;
pub use report::{Console, ModelMemory, Reporter, Say, Silent};
pub use runner::{Finished, Role, Runner, SETTINGS_VAR, under_launcher};
pub use settings::{RunOptions, Settings};
