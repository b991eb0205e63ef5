//! Distributed training for Burn 0.22: bonfire's launcher, transports, collectives and restarts
//! for the Burn that has no backend type parameter.
//!
//! Burn 0.22 runs every tensor through one dispatch enum, so a backend decorator such as the
//! 0.21 crate's `DataParallel<B>` cannot exist there. This crate reaches the gradients where
//! 0.22 hands them out instead, as [`GradientsParams`](burn::optim::GradientsParams) after
//! `backward`, and averages them over the job's ranks with bonfire's collectives:
//!
//! - in burn-train, as a training strategy ([`DataParallel`]): one process per rank, each
//!   training on its share of the data, rank 0 validating, writing checkpoints and rendering;
//! - in a loop of your own: [`World::average`] between `backward` and the optimizer's step,
//!   [`World::replicate`] for the starting parameters and [`World::shard`] for the data.
//!
//! ```no_run
//! use burn::optim::GradientsParams;
//! # use burn::module::Module;
//! # fn step<M: Module>(model: M, grads: GradientsParams) -> Result<(), Box<dyn std::error::Error>> {
//! let world = bonfire_burn022::init()?; // under `bonfire launch --nproc-per-node 2 -- ./train`
//! let model = world.replicate(model)?; // rank 0's parameters on every rank
//! // ...forward and backward on this rank's batch, then:
//! let grads = world.average(grads, &model)?; // the mean over the ranks, by parameter id
//! # let _ = grads; Ok(()) }
//! ```
//!
//! Run alone, without `bonfire launch`, a program is a job of one rank and trains as it would
//! without this crate. The job itself (its ranks, the QUIC and shared-memory links between them,
//! the secret, restarts) is bonfire's, shared with the Burn 0.21 crate; `bonfire launch` starts
//! programs of either.

mod resume;
mod strategy;
mod sync;
mod world;

/// The straggler rule (bonfire's, shared with the Burn 0.21 jobs).
pub use bonfire_launch::stragglers;
pub use bonfire_launch::stragglers::RankTimes;
pub use resume::resume_epoch;
pub use strategy::{DEFAULT_EPOCH_END_TIMEOUT, DataParallel, EpochTimes};
pub use sync::{DEFAULT_BUCKET_CAP_BYTES, SyncError, average, replicate, shard};
pub use world::{InitError, World, init, init_from};

/// Checkpoints for a loop of your own that survive `bonfire launch --max-restarts` (the same as
/// the Burn 0.21 crate's `bonfire::checkpoint`): rank 0 writes `ROOT/epoch-N` with a
/// `SHA256SUMS`, and every rank agrees on the newest readable one when it starts again.
pub use bonfire_collectives::checkpoint;
pub use bonfire_collectives::checkpoint::{
    CheckpointError, Resume, resume_or_start, save_checkpoint,
};

/// The pieces underneath, for programs that want a collective of their own.
pub use bonfire_collectives::{CommConfig, Communicator};
pub use bonfire_launch::JobEnv;
pub use bonfire_topology::{Rank, ReduceOp};

/// The book's chapter on this crate, its code compiled and run as doctests against Burn 0.22.
#[cfg(doctest)]
pub mod book {
    #[doc = include_str!("../../../book/src/burn-0.22.md")]
    pub struct Burn022;
}
