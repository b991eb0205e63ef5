//! `Counting<B>`: a backend decorator that changes no op and counts every call it receives, by
//! the op method's name, on the calling thread. Put it at the bottom of a stack
//! (`Autodiff<DataParallel<Counting<Flex>>>`) and compare with `Autodiff<Counting<Flex>>`: a
//! decorator that computes more than its inner backend shows up as more calls of some op.
//!
//! Counts are per thread (Burn runs a backend's ops, autodiff's backward included, on the thread
//! that calls them), so tests running in parallel do not see each other's ops.

mod ops;

use core::marker::PhantomData;
use std::cell::RefCell;
use std::collections::BTreeMap;

use burn_backend::Backend;
use burn_backend::distributed::DistributedBackend;

thread_local! {
    static COUNTS: RefCell<BTreeMap<&'static str, u64>> = const { RefCell::new(BTreeMap::new()) };
}

/// Counts one call of `op` on this thread (called by the generated ops).
pub(crate) fn count(op: &'static str) {
    COUNTS.with(|c| *c.borrow_mut().entry(op).or_default() += 1);
}

/// The calls counted on this thread since the last `take`, by op method, and starts afresh.
pub fn take() -> BTreeMap<&'static str, u64> {
    COUNTS.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

/// Counts every op call, then runs it on `B` (see the module docs).
#[derive(Clone, Default, Debug)]
pub struct Counting<B> {
    _inner: PhantomData<B>,
}

bonfire_backend::same_primitives_backend!(Counting, "counting");

/// Burn's defaults (no communication): enough for `Autodiff<Counting<B>>` to be an autodiff
/// backend in a build with Burn's `distributed` feature, as the single-device reference. Its
/// hooks are never called there: nothing marks a parameter distributed without bonfire.
impl<B: Backend> DistributedBackend for Counting<B> {}
