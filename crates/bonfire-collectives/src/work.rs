use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bonfire_topology::Rank;

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

/// When a waited-on collective ran: see [`Work::wait_times`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct WorkTimes {
    /// Its first poll began ([`Work::started_at`]).
    pub started: Instant,
    /// This rank had seen every other participant's fingerprint: all of them had called the
    /// collective by then (as late as this rank looked; `started` where it never saw them all,
    /// as when the collective failed). The gap from `started` is waiting for the slowest peer to
    /// call it; the rest, up to `finished`, is moving and combining the data.
    pub arrived: Instant,
    /// The peer whose call this rank saw last: the one `arrived` waited for (`None` without
    /// peers, or when the collective failed before it saw them all).
    pub last_peer: Option<Rank>,
    /// It completed.
    pub finished: Instant,
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
        self.wait_times().0
    }

    /// As [`Work::wait`], with when the collective began to run, when every peer had called it
    /// and when it completed (which is earlier than the return when it completed in the
    /// background before the wait).
    pub fn wait_times(mut self) -> (Result<T, CollectiveError>, WorkTimes) {
        let result = match &mut self.state {
            State::Driven(control) => control.wait(),
            State::Ready(result, _) => result.take().expect("a Work is waited on once"),
        };
        let finished = self.finished_at().unwrap_or_else(Instant::now);
        let started = self.started_at().unwrap_or(finished).min(finished);
        let (arrived, last_peer) = match &self.state {
            State::Driven(control) => control.arrived_at(),
            State::Ready(..) => None,
        }
        .unwrap_or((started, None));
        let arrived = arrived.clamp(started, finished);
        (
            result,
            WorkTimes {
                started,
                arrived,
                last_peer,
                finished,
            },
        )
    }

    /// When the collective began to run on some thread (its first frames left then): the call
    /// itself for a small collective, a poll on the communication runtime or the first wait
    /// otherwise. `None` while nothing has run it yet. The gap from the call to this instant is
    /// the scheduling delay a bucket pays before its first byte moves.
    pub fn started_at(&self) -> Option<Instant> {
        match &self.state {
            State::Ready(_, at) => Some(*at),
            State::Driven(control) => control.started_at(),
        }
    }

    /// Runs, on this thread and without blocking, whatever part of the collective has become
    /// possible since it last ran (frames that arrived are combined and forwarded); returns
    /// whether it has completed. For collectives of a [`crate::Communicator::caller_driven`]
    /// handle, whose caller looks in between its own work; harmless on any other.
    pub fn progress(&self) -> bool {
        match &self.state {
            State::Ready(..) => true,
            State::Driven(control) => control.progress(),
        }
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
