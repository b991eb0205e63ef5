//! `TensorParallel<B>`: tensor-model parallelism as a backend decorator. Each float tensor carries
//! a placement over the tensor-parallel group (`Replicate`, `Shard`, `Partial`, as PyTorch's
//! DTensor and GSPMD), each op a rule over placements, and a plan splits an unchanged Burn model's
//! parameters as Megatron-LM's column- and row-parallel layers do.
//!
//! How the files depend on each other (no loop): `placement` is the pure layout arithmetic;
//! `tensor` the primitive; `context` each rank's group, random generator and counters;
//! `redistribute` moves a tensor between placements (the only code that communicates); `rules/`
//! hold one function per op with a rule, `fallback` what every other op does, and `ops/` (generated)
//! wires Burn's op traits to them; `plan` splits a model's parameters; `checkpoint` saves and
//! loads them; `fsdp` shards parameters at rest over data-parallel ranks (ZeRO-3), `prefetch`
//! starts their gathers ahead of need and `fsdp_checkpoint` saves such a model and its
//! optimizer's state per rank; `hybrid` lets
//! `DataParallel` average a split model's gradients shard by shard.

mod backend;
mod checkpoint;
mod context;
mod distribute;
mod fallback;
pub mod fsdp;
mod fsdp_checkpoint;
mod hybrid;
mod ops;
mod placement;
mod plan;
mod prefetch;
mod redistribute;
mod rules;
mod tensor;

pub use backend::{TensorParallel, TensorParallelBackend};
pub use checkpoint::{CheckpointError, gathered, load_shards, load_whole, save_shards, shard_file};
pub use context::{TpBindGuard, TpStats, bind_thread, group, install, read_parts, stats};
pub use distribute::{distribute, from_terms, local_part, placement};
pub use fsdp_checkpoint::{
    MANIFEST, ShardedCheckpointError, StateRecord, check_sharded_checkpoint,
    consolidate_sharded_checkpoint, consolidate_sharded_model, load_sharded_checkpoint,
    rank_file_name, save_sharded_checkpoint, shard_checkpoint,
};
pub use placement::Placement;
pub use plan::{PlanError, Split, TpPlan, placements, tensor_parallel};
pub use tensor::TpTensor;
