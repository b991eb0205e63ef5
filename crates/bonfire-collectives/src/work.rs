use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::CollectiveError;
use crate::driven::Control;

/// A collective in flight: a handle to wait on, as PyTorch's `Work`.
///
/// The collective runs in the background from the moment it is called. [`Work::wait`] blocks the
/// calling thread until it completes; in async code, `.await` the `Work` instead. Dropping a
/// `Work` does not cancel the collective (the other ranks would be left waiting): it completes in
/// the background and its result is discarded.
///
/// Every wait inside a collective has a timeout, so a `Work` always completes.
#[must_use = "a collective runs in the background: wait() or .await its Work to get the result"]
pub struct Work<T> {
    state: State<T>,
}

enum State<T> {
    Ready(Option<Result<T, CollectiveError>>, Instant),
    /// Polled by whoever waits for it (see `driven`).
    Driven(Box<dyn Control<T>>),
}

// The result is only ever moved out, never pinned in place.
impl<T> Unpin for Work<T> {}

impl<T> Work<T> {
    pub(crate) fn ready(result: Result<T, CollectiveError>) -> Work<T> {
        Work {
            state: State::Ready(Some(result), Instant::now()),
        }
    }

    pub(crate) fn driven(control: Box<dyn Control<T>>) -> Work<T> {
        Work {
            state: State::Driven(control),
        }
    }

    /// Blocks until the collective completes and returns its result. Call it from a thread,
    /// not from inside async code (there, `.await` the `Work`).
    ///
    /// The waiting thread does the collective's work itself as frames arrive (it keeps looking
    /// for a quarter of a millisecond, yielding its core between looks, before it parks), so a
    /// small collective completes without any thread hand-over.
    pub fn wait(self) -> Result<T, CollectiveError> {
        self.wait_timed().0
    }

    /// As [`Work::wait`], and also when the collective completed (which is earlier than the
    /// return when it completed in the background before the wait).
    pub fn wait_timed(mut self) -> (Result<T, CollectiveError>, Instant) {
        let result = match &mut self.state {
            State::Driven(control) => control.wait(),
            State::Ready(result, _) => result.take().expect("a Work is waited on once"),
        };
        let at = self.finished_at().unwrap_or_else(Instant::now);
        (result, at)
    }

    /// When the collective completed (successfully or not); `None` while it runs.
    pub fn finished_at(&self) -> Option<Instant> {
        match &self.state {
            State::Ready(_, at) => Some(*at),
            State::Driven(control) => control.finished_at(),
        }
    }

    /// Whether the collective has completed (successfully or not).
    pub fn is_finished(&self) -> bool {
        match &self.state {
            State::Ready(..) => true,
            State::Driven(control) => control.is_finished(),
        }
    }
}

impl<T> Future for Work<T> {
    type Output = Result<T, CollectiveError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            State::Ready(result, _) => {
                Poll::Ready(result.take().expect("a Work is polled after completion"))
            }
            State::Driven(control) => control.poll_result(cx),
        }
    }
}

impl<T> Drop for Work<T> {
    fn drop(&mut self) {
        if let State::Driven(control) = &self.state {
            control.release();
        }
    }
}
