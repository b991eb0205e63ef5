//! The decorator type and its `Backend` impl (every method forwarded, as every decorator that
//! keeps its inner backend's primitives writes it). The op traits are forwarded in `ops/`
//! (generated); the gradient hook is in `distributed.rs`.

use core::marker::PhantomData;

/// Data-parallel training as a Burn backend: `Autodiff<DataParallel<B>>` trains like
/// `Autodiff<B>` on every rank, and averages gradients across the ranks during backward.
///
/// # Contract
///
/// - **What it changes.** No op: every tensor operation runs on `B`, with `B`'s tensors
///   (`DataParallel<B>` reuses `B`'s primitives and devices). Only the gradients of parameters
///   marked distributed ([`crate::replicate`] marks them) are changed: when `backward` returns,
///   each holds the **mean over all ranks** of that parameter's gradient.
/// - **When it synchronises.** Gradients are copied into buckets (default cap 25 MiB) as backward
///   produces them; a bucket's all-reduce starts, asynchronously, as soon as it is full and every
///   bucket before it has started, so communication overlaps the rest of backward. `backward`
///   returns once every bucket is reduced and written back.
/// - **What order it assumes.** Every rank runs the same model and calls `backward` the same
///   number of times, in the same order. Buckets are planned from the module's parameter order
///   (the same on every rank), never from the order gradients arrive in.
/// - **World size 1** is a pass-through: the hook returns at once and `Autodiff<DataParallel<B>>`
///   computes exactly what `Autodiff<B>` computes.
/// - **Failures.** A rank that dies, leaves early or calls with a different bucket layout makes
///   every other rank's `backward` fail with a message naming it (see [`crate::FailurePolicy`]).
#[derive(Clone, Default, Debug)]
pub struct DataParallel<B> {
    _inner: PhantomData<B>,
}

crate::same_primitives_backend!(DataParallel, "data-parallel");
