//! Test support for bonfire.
//!
//! - [`calls`]: calls of every kind from a few numbers, and [`calls::every_call`], which runs
//!   them all on a communicator and checks each rank's result against the oracle.
//! - [`oracle`]: what each collective must return, computed sequentially with arithmetic written
//!   independently of the reducer under test, and inputs for which every order of combination
//!   is exact (so results can be compared bit for bit).
//! - [`run_ranks`]: runs one closure per rank on its own thread, with a deadline, and names the
//!   rank that panicked or did not finish.
//! - [`nets`]: small models (a CNN, a transformer block) and a plain training loop, for checking
//!   data-parallel training against single-rank training.
//! - [`learn`]: a burn-train workload (MLP regressor, data, `TrainStep`) trained under bonfire's
//!   strategy or burn-train's DDP, for checking them against single-rank training.
//! - [`tp`]: models with tensor-parallel plans (an MLP, Burn's transformer encoder, a GPT-style
//!   block) and loops, for checking tensor-parallel training against the unsharded model.
//! - [`netns`]: network namespaces that play separate hosts (bonfire-launch's, re-exported).
//! - [`ChaosTransport`]: wraps a transport and delays every frame by a random time, so frames
//!   arrive out of order.

pub mod calls;
mod chaos;
pub mod counting;
pub mod learn;
pub mod nets;
pub mod oracle;
pub mod pp;
mod ranks;
pub mod tp;

pub use bonfire_launch::netns;

pub use chaos::{ChaosTransport, chaos_world};
pub use ranks::{RankModels, bind_rank, in_process_ranks, run_ranks};
