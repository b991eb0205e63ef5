//! Collective communication for bonfire: all-reduce, reduce-scatter, all-gather, broadcast,
//! reduce, barrier, send and receive, over any [`bonfire_transport::Transport`].
//!
//! ```
//! use bonfire_collectives::{CommConfig, Communicator};
//! use bonfire_topology::ReduceOp;
//!
//! // Four ranks as threads of this process.
//! let ranks = Communicator::in_process(4, CommConfig::default());
//! let threads: Vec<_> = ranks
//!     .into_iter()
//!     .map(|comm| {
//!         std::thread::spawn(move || {
//!             let mine = vec![comm.rank() as f32; 3];
//!             comm.all_reduce(mine, ReduceOp::Sum).wait().unwrap()
//!         })
//!     })
//!     .collect();
//! for t in threads {
//!     assert_eq!(t.join().unwrap(), vec![6.0; 3]); // 0 + 1 + 2 + 3
//! }
//! ```
//!
//! # How it is built
//! - *Schedules* are sans-IO: for each collective and algorithm, a pure function computes one
//!   rank's program (which range goes to which peer as which step, what to combine, in which
//!   operand order). [`sim`] runs programs on a simulated network that reorders frames.
//! - The *driver* runs a program over a transport, with an arrival exchange that compares every
//!   rank's [`Fingerprint`], a timeout on every wait, and abort notices on failure.
//! - Reductions go through the [`Reducer`] trait; [`HostReducer`] is the CPU implementation.
//! - [`checkpoint`]: a program's checkpoint directories with checksums, and the ranks' agreement
//!   on the newest readable one after a restart (its files sent to the ranks that lack it).
//!
//! # Determinism
//! A collective gives the same bits on every rank and in every run, whatever the arrival order of
//! frames: each element is combined at a fixed point of a fixed schedule with a fixed operand
//! order, and frames that arrive early wait in the mailbox until the schedule asks for them.
//! Different algorithms may round differently; [`Algorithm::Auto`] picks the same algorithm on
//! every rank for the same call.

mod algorithm;
pub mod checkpoint;
mod collective;
mod communicator;
mod driven;
mod driver;
mod element;
mod error;
mod exec;
mod fingerprint;
mod reducer;
mod runtime;
mod schedule;
pub mod sim;
mod work;

pub use algorithm::{Algorithm, CommConfig};
pub use bonfire_transport::fatal;
pub use collective::Collective;
pub use communicator::{Communicator, CommunicatorBuilder, MeshGroups};
pub use element::Element;
pub use error::CollectiveError;
pub use fingerprint::{Fingerprint, OpKind};
pub use reducer::{HostReducer, Order, Reducer};
pub use runtime::runtime;
pub use work::{Work, WorkTimes};

#[cfg(test)]
mod send_sync {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}

    #[test]
    fn user_facing_types_cross_threads() {
        assert_send_sync::<Communicator>();
        assert_send_sync::<CollectiveError>();
        assert_send_sync::<Collective>();
        assert_send::<Work<Vec<f32>>>();
    }
}
