//! Collectives driven by whoever waits for them.
//!
//! A collective is a future (the driver's program over a transport). Handing it to the
//! communication runtime costs a thread wake-up to start it and another to report its end, and
//! on a machine with few cores each wake-up is a scheduler decision that can take tens of
//! microseconds: more than a small all-reduce between two ranks of one host takes to move its
//! bytes. So a [`Driven`] collective is polled by the thread that needs it:
//!
//! - **at the call**, once, on the caller's thread for a small collective: its first frames (the
//!   fingerprint and the data) leave before the call returns, with no hand-over;
//! - **while a thread waits** in [`crate::Work::wait`]: that thread polls it whenever a frame
//!   arrives, and for a quarter of a millisecond before it parks it keeps looking (filing frames
//!   that are already in shared memory itself, see [`Transport::progress`], and yielding its
//!   core between looks), so a peer that answers within microseconds is seen within
//!   microseconds;
//! - **by an async task** that `.await`s the [`crate::Work`];
//! - **by the runtime otherwise**: a wake-up that finds nobody waiting schedules one poll on the
//!   communication runtime, so a collective nobody waits for (a gradient bucket in flight while
//!   backward runs, a dropped `Work`) still makes progress in the background, exactly as before.
//!
//! One poll runs at a time; a wake-up that comes during a poll makes the poller poll again.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use bonfire_topology::Rank;
use bonfire_transport::Transport;
use tokio::runtime::Handle;

use crate::CollectiveError;
use crate::driver::Arrived;

/// How long a waiting thread keeps looking (yielding its core between looks) before it parks.
///
/// It yields rather than spins: where the peer rank's thread shares this core (two ranks on a
/// two-core machine under load), a pure spin holds the core the answer has to be computed on
/// for the whole spin, which measured as 35-40 µs per 1 KiB all-reduce against 3 µs; a yield
/// costs a system call when the core is free and hands it over when it is not.
const LOOK: Duration = Duration::from_micros(250);
/// The longest park between looks (a wake-up ends it sooner).
const PARK: Duration = Duration::from_millis(50);

/// How a driven collective starts.
pub(crate) struct Start {
    /// Poll it once on the calling thread now (else the runtime polls it first).
    pub(crate) eager: bool,
    /// Only its holder polls it (see [`crate::Communicator::caller_driven`]).
    pub(crate) held: bool,
    /// Set by the collective when every peer's arrival has been seen.
    pub(crate) arrived: Option<Arrived>,
}

type Job<T> = Pin<Box<dyn Future<Output = Result<T, CollectiveError>> + Send>>;

/// A collective in flight whose future is polled by whoever needs it (see the module docs).
pub(crate) struct Driven<T> {
    runtime: Handle,
    /// The transport the frames come through: a waiting thread asks it to file what has arrived.
    transport: Option<Arc<dyn Transport>>,
    /// This rank and the collective, for the error a panic becomes.
    me: Rank,
    /// When this rank had seen every peer's arrival (set by the collective).
    arrived: Option<Arrived>,
    op: &'static str,
    /// Set by every wake-up; cleared when a poll begins.
    woken: AtomicBool,
    /// Only its holder polls it (`Work::progress`, `wait`): a wake-up with nobody waiting
    /// schedules nothing while the handle lives.
    held: AtomicBool,
    /// Set once the result is in `state`.
    done: AtomicBool,
    state: Mutex<State<T>>,
}

struct State<T> {
    /// The future, while it is neither being polled nor finished.
    job: Option<Job<T>>,
    result: Option<Result<T, CollectiveError>>,
    /// When its first poll began: its first frames left then.
    started: Option<Instant>,
    /// When it completed.
    finished: Option<Instant>,
    /// A poll is under way (`job` is out).
    polling: bool,
    /// A poll on the runtime is scheduled.
    scheduled: bool,
    /// A thread blocked in `wait`.
    caller: Option<Thread>,
    /// An async task awaiting the result.
    waiter: Option<Waker>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T: Send + 'static> Driven<T> {
    /// Takes charge of `job`. With `how.eager`, polls it once on this thread now; otherwise the
    /// runtime polls it first.
    pub(crate) fn start(
        runtime: Handle,
        transport: Option<Arc<dyn Transport>>,
        me: Rank,
        op: &'static str,
        job: Job<T>,
        how: Start,
    ) -> Arc<Driven<T>> {
        let Start {
            eager,
            held,
            arrived,
        } = how;
        let driven = Arc::new(Driven {
            runtime,
            transport,
            me,
            arrived,
            op,
            woken: AtomicBool::new(false),
            held: AtomicBool::new(held),
            done: AtomicBool::new(false),
            state: Mutex::new(State {
                job: Some(job),
                result: None,
                started: None,
                finished: None,
                polling: false,
                scheduled: false,
                caller: None,
                waiter: None,
            }),
        });
        if eager {
            driven.drive();
        } else {
            driven.schedule(lock(&driven.state));
        }
        driven
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Polls the future on this thread until it is pending with no wake-up outstanding, or
    /// done. Returns at once if another thread is polling it (that one polls again if a
    /// wake-up came meanwhile).
    fn drive(self: &Arc<Self>) {
        let waker = Waker::from(self.clone());
        // Timers and sockets inside the collective belong to the communication runtime.
        let _context = self.runtime.enter();
        loop {
            let mut job = {
                let mut st = lock(&self.state);
                if st.polling {
                    return;
                }
                let Some(job) = st.job.take() else {
                    return;
                };
                st.polling = true;
                st.scheduled = false;
                st.started.get_or_insert_with(Instant::now);
                job
            };
            self.woken.store(false, Ordering::SeqCst);
            // A panic inside the collective becomes its error, whichever thread polled it.
            let polled = std::panic::catch_unwind(AssertUnwindSafe(|| {
                job.as_mut().poll(&mut Context::from_waker(&waker))
            }))
            .unwrap_or_else(|panic| {
                Poll::Ready(Err(CollectiveError::Internal {
                    me: self.me,
                    op: self.op,
                    problem: panic_message(panic.as_ref()),
                }))
            });
            let mut st = lock(&self.state);
            st.polling = false;
            match polled {
                Poll::Ready(result) => {
                    st.result = Some(result);
                    st.finished = Some(Instant::now());
                    self.done.store(true, Ordering::Release);
                    let waiter = st.waiter.take();
                    let caller = st.caller.clone();
                    drop(st);
                    drop(job);
                    if let Some(w) = waiter {
                        w.wake();
                    }
                    if let Some(t) = caller {
                        t.unpark();
                    }
                    return;
                }
                Poll::Pending => {
                    st.job = Some(job);
                    // A wake-up during the poll found `polling` set and left the next poll to
                    // this thread.
                    if !self.woken.load(Ordering::SeqCst) {
                        return;
                    }
                }
            }
        }
    }

    /// Schedules one poll on the runtime unless one is scheduled already.
    fn schedule(self: &Arc<Self>, mut st: MutexGuard<'_, State<T>>) {
        if st.scheduled || st.job.is_none() {
            return;
        }
        st.scheduled = true;
        drop(st);
        let me = self.clone();
        self.runtime.spawn(async move { me.drive() });
    }

    /// Blocks this thread until the collective completes, polling it here.
    pub(crate) fn wait(self: &Arc<Self>) -> Result<T, CollectiveError> {
        lock(&self.state).caller = Some(std::thread::current());
        let mut look = true;
        while !self.is_finished() {
            if look {
                self.drive();
            }
            look = self.idle();
        }
        let mut st = lock(&self.state);
        st.caller = None;
        st.result
            .take()
            .expect("a driven collective's result is taken once")
    }

    /// Waits for a wake-up or the end: looks for a while (filing frames that have arrived,
    /// where the transport lets this thread), yielding its core between looks, then parks.
    /// Returns whether it was woken (and should poll).
    fn idle(&self) -> bool {
        let started = Instant::now();
        loop {
            if self.woken.load(Ordering::Acquire) {
                return true;
            }
            if self.is_finished() {
                return false;
            }
            if started.elapsed() >= LOOK {
                std::thread::park_timeout(PARK);
                return self.woken.load(Ordering::Acquire);
            }
            if let Some(t) = &self.transport
                && t.progress()
            {
                continue;
            }
            std::thread::yield_now();
        }
    }

    /// Polls from an async task: drives the collective, then leaves `cx`'s waker to be woken.
    pub(crate) fn poll_result(
        self: &Arc<Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<T, CollectiveError>> {
        self.drive();
        let mut st = lock(&self.state);
        if let Some(result) = st.result.take() {
            return Poll::Ready(result);
        }
        st.waiter = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Polls it on this thread if a wake-up came since the last poll; never blocks (another
    /// thread polling it is left to it). Frames already in shared memory are filed first.
    /// Returns whether it has completed.
    pub(crate) fn progress(self: &Arc<Self>) -> bool {
        if self.is_finished() {
            return true;
        }
        if let Some(t) = &self.transport {
            while t.progress() {}
        }
        if self.woken.load(Ordering::Acquire) {
            self.drive();
        }
        self.is_finished()
    }

    /// The handle is gone: nobody waits any more, so the runtime drives what is left.
    pub(crate) fn release(self: &Arc<Self>) {
        self.held.store(false, Ordering::SeqCst);
        let mut st = lock(&self.state);
        st.caller = None;
        st.waiter = None;
        if self.woken.load(Ordering::SeqCst) && !st.polling {
            self.schedule(st);
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".into()
    }
}

/// What a [`crate::Work`] holds of a driven collective, without naming its bounds.
pub(crate) trait Control<T>: Send + Sync {
    fn wait(&self) -> Result<T, CollectiveError>;
    fn is_finished(&self) -> bool;
    fn started_at(&self) -> Option<Instant>;
    fn progress(&self) -> bool;
    fn arrived_at(&self) -> Option<(Instant, Option<Rank>)>;
    fn finished_at(&self) -> Option<Instant>;
    fn poll_result(&self, cx: &mut Context<'_>) -> Poll<Result<T, CollectiveError>>;
    fn release(&self);
}

impl<T: Send + 'static> Control<T> for Arc<Driven<T>> {
    fn wait(&self) -> Result<T, CollectiveError> {
        Driven::wait(self)
    }

    fn is_finished(&self) -> bool {
        Driven::is_finished(self)
    }

    fn started_at(&self) -> Option<Instant> {
        lock(&self.state).started
    }

    fn progress(&self) -> bool {
        Driven::progress(self)
    }

    fn arrived_at(&self) -> Option<(Instant, Option<Rank>)> {
        self.arrived.as_ref().and_then(|a| a.get().copied())
    }

    fn finished_at(&self) -> Option<Instant> {
        lock(&self.state).finished
    }

    fn poll_result(&self, cx: &mut Context<'_>) -> Poll<Result<T, CollectiveError>> {
        Driven::poll_result(self, cx)
    }

    fn release(&self) {
        Driven::release(self)
    }
}

impl<T: Send + 'static> Wake for Driven<T> {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        let st = lock(&self.state);
        if st.polling || st.job.is_none() {
            // The poller polls again (it sees `woken`), or the collective is over.
            return;
        }
        if let Some(t) = &st.caller {
            t.unpark();
        } else if let Some(w) = &st.waiter {
            w.wake_by_ref();
        } else if !self.held.load(Ordering::SeqCst) {
            self.schedule(st);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A driven collective with no transport, on the communication runtime.
    fn start<T: Send + 'static>(
        job: Job<T>,
        me: Rank,
        op: &'static str,
        eager: bool,
    ) -> Arc<Driven<T>> {
        let runtime = crate::runtime().handle().clone();
        Driven::start(
            runtime,
            None,
            me,
            op,
            job,
            Start {
                eager,
                held: false,
                arrived: None,
            },
        )
    }

    /// A future that is ready after `n` wake-ups delivered by another thread.
    fn after_wakes(n: usize) -> (Job<usize>, Arc<Mutex<Option<Waker>>>, Arc<AtomicUsize>) {
        let slot: Arc<Mutex<Option<Waker>>> = Arc::default();
        let polls = Arc::new(AtomicUsize::new(0));
        let (s, p) = (slot.clone(), polls.clone());
        let job: Job<usize> = Box::pin(std::future::poll_fn(move |cx| {
            let k = p.fetch_add(1, Ordering::SeqCst);
            if k >= n {
                return Poll::Ready(Ok(k));
            }
            *lock(&s) = Some(cx.waker().clone());
            Poll::Pending
        }));
        (job, slot, polls)
    }

    /// Wakes the future's last waker from another thread until it has been polled `polls`
    /// times.
    fn waker_thread(
        slot: Arc<Mutex<Option<Waker>>>,
        polled: Arc<AtomicUsize>,
        polls: usize,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            while polled.load(Ordering::SeqCst) < polls && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
                if let Some(w) = lock(&slot).take() {
                    w.wake();
                }
            }
        })
    }

    #[test]
    fn a_waiting_thread_drives_it_to_the_end() {
        let (job, slot, polls) = after_wakes(3);
        let d = start(job, Rank(0), "test", true);
        assert_eq!(
            polls.load(Ordering::SeqCst),
            1,
            "the eager poll ran on this thread"
        );
        let t = waker_thread(slot, polls, 4);
        assert_eq!(d.wait().unwrap(), 3);
        t.join().unwrap();
    }

    #[test]
    fn nobody_waiting_the_runtime_drives_it() {
        let (job, slot, polls) = after_wakes(3);
        let d = start(job, Rank(0), "test", true);
        waker_thread(slot, polls, 4).join().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !d.is_finished() {
            assert!(Instant::now() < deadline, "the runtime never finished it");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(d.wait().unwrap(), 3);
    }

    #[test]
    fn a_panic_becomes_the_error_of_every_waiter() {
        let job: Job<usize> = Box::pin(async { panic!("boom") });
        let d = start(job, Rank(3), "all-reduce", false);
        let e = d.wait().unwrap_err().to_string();
        assert!(e.contains("boom") && e.contains("all-reduce"), "{e}");
    }

    #[test]
    fn an_async_task_drives_it() {
        let (job, slot, polls) = after_wakes(2);
        let d = start(job, Rank(0), "test", false);
        let t = waker_thread(slot, polls, 3);
        let got = crate::runtime()
            .block_on(std::future::poll_fn(|cx| d.poll_result(cx)))
            .unwrap();
        assert_eq!(got, 2);
        t.join().unwrap();
    }
}
