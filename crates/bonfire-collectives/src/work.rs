use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bonfire_topology::Rank;
use tokio::task::JoinHandle;

use crate::CollectiveError;

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
    Ready(Option<Result<T, CollectiveError>>),
    Running {
        handle: JoinHandle<Result<T, CollectiveError>>,
        me: Rank,
        op: &'static str,
    },
}

// The result is only ever moved out, never pinned in place.
impl<T> Unpin for Work<T> {}

impl<T> Work<T> {
    pub(crate) fn ready(result: Result<T, CollectiveError>) -> Work<T> {
        Work {
            state: State::Ready(Some(result)),
        }
    }

    pub(crate) fn running(
        handle: JoinHandle<Result<T, CollectiveError>>,
        me: Rank,
        op: &'static str,
    ) -> Work<T> {
        Work {
            state: State::Running { handle, me, op },
        }
    }

    /// Blocks until the collective completes and returns its result. Call it from a thread,
    /// not from inside async code (there, `.await` the `Work`).
    pub fn wait(self) -> Result<T, CollectiveError> {
        futures::executor::block_on(self)
    }

    /// Whether the collective has completed (successfully or not).
    pub fn is_finished(&self) -> bool {
        match &self.state {
            State::Ready(_) => true,
            State::Running { handle, .. } => handle.is_finished(),
        }
    }
}

impl<T> Future for Work<T> {
    type Output = Result<T, CollectiveError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            State::Ready(result) => {
                Poll::Ready(result.take().expect("a Work is polled after completion"))
            }
            State::Running { handle, me, op } => match Pin::new(handle).poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Ok(result)) => Poll::Ready(result),
                Poll::Ready(Err(join)) => Poll::Ready(Err(CollectiveError::Internal {
                    me: *me,
                    op,
                    problem: panic_message(join),
                })),
            },
        }
    }
}

fn panic_message(err: tokio::task::JoinError) -> String {
    if err.is_cancelled() {
        return "the runtime shut down while the collective ran".into();
    }
    let payload = err.into_panic();
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".into()
    }
}
