//! The vocabulary every bonfire layer shares: ranks, groups, nodes, the 2-D data x tensor-parallel
//! mesh, reduce operations, element types, partitions of a buffer among ranks, and the one rule
//! for which items of a data set each rank reads ([`Sharding`]).
//!
//! This crate is pure: no I/O, no threads, no dependencies. Everything here is a value that every
//! rank computes identically from the same inputs, which is what lets ranks agree on schedules
//! without talking.

mod buckets;
mod dtype;
mod ids;
mod layout;
mod mesh;
mod partition;
mod reduce;
mod shard;

pub use buckets::{Bucket, BucketPlan};
pub use dtype::DType;
pub use ids::{GroupId, NodeId, Rank, stable_hash};
pub use layout::{ByNode, NodeLayout};
pub use mesh::{Mesh, MeshError};
pub use partition::Partition;
pub use reduce::ReduceOp;
pub use shard::{RankShard, ShardError, Sharding};
