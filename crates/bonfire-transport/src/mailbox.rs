use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use bonfire_topology::Rank;
use bytes::Bytes;
use tokio::sync::Notify;

use crate::{Tag, lock};

/// How many closed exchanges a mailbox remembers, so that a late frame for one of them (an abort
/// notice sent after this rank finished) is dropped instead of opening a new inbox that nobody
/// would ever close.
const CLOSED_MEMORY: usize = 4096;

/// Files incoming frames by `(context, seq)` exchange, then by sender and step, until a consumer
/// takes them.
///
/// A transport calls [`Mailbox::deliver`] for every frame and [`Mailbox::peer_lost`] when a peer
/// becomes unreachable. A consumer opens an [`Inbox`] for the exchange it runs, takes frames from
/// it in whatever order it needs, and waits on [`Inbox::changed`] when the frame it needs has not
/// come yet. Frames that arrive before the inbox is opened are kept.
#[derive(Default)]
pub struct Mailbox {
    state: Mutex<MailboxState>,
}

#[derive(Default)]
struct MailboxState {
    inboxes: HashMap<(u64, u64), Slot>,
    lost: HashMap<Rank, Arc<str>>,
    closed: HashSet<(u64, u64)>,
    closed_order: VecDeque<(u64, u64)>,
}

struct Slot {
    shared: Arc<InboxShared>,
    open: bool,
}

impl MailboxState {
    /// The slot of an exchange, created (knowing the peers lost so far) on first use.
    fn slot(&mut self, key: (u64, u64)) -> &mut Slot {
        let lost = &self.lost;
        self.inboxes.entry(key).or_insert_with(|| Slot {
            shared: Arc::new(InboxShared {
                state: Mutex::new(InboxState {
                    frames: HashMap::new(),
                    lost: lost.clone(),
                }),
                notify: Notify::new(),
            }),
            open: false,
        })
    }
}

#[derive(Default)]
struct InboxShared {
    state: Mutex<InboxState>,
    notify: Notify,
}

#[derive(Default)]
struct InboxState {
    frames: HashMap<(Rank, u32), VecDeque<Bytes>>,
    lost: HashMap<Rank, Arc<str>>,
}

/// An exchange was opened twice.
#[derive(Debug, Clone, thiserror::Error)]
#[error("exchange context {context:016x} seq {seq} is already open in this process")]
pub struct OpenError {
    /// The exchange's context.
    pub context: u64,
    /// The exchange's sequence number.
    pub seq: u64,
}

impl Mailbox {
    /// An empty mailbox.
    pub fn new() -> Mailbox {
        Mailbox::default()
    }

    /// Files a frame from `from`. Called by transports.
    pub fn deliver(&self, from: Rank, tag: Tag, payload: Bytes) {
        let key = (tag.context, tag.seq);
        let shared = {
            let mut state = lock(&self.state);
            if state.closed.contains(&key) {
                return;
            }
            state.slot(key).shared.clone()
        };
        lock(&shared.state)
            .frames
            .entry((from, tag.step))
            .or_default()
            .push_back(payload);
        shared.notify.notify_one();
    }

    /// Records that `peer` is unreachable and wakes every consumer. Called by transports.
    pub fn peer_lost(&self, peer: Rank, reason: impl Into<Arc<str>>) {
        let reason = reason.into();
        let inboxes: Vec<Arc<InboxShared>> = {
            let mut state = lock(&self.state);
            state.lost.entry(peer).or_insert_with(|| reason.clone());
            state.inboxes.values().map(|s| s.shared.clone()).collect()
        };
        for inbox in inboxes {
            lock(&inbox.state)
                .lost
                .entry(peer)
                .or_insert_with(|| reason.clone());
            inbox.notify.notify_one();
        }
    }

    /// Why `peer` is unreachable, if it is.
    pub fn lost_reason(&self, peer: Rank) -> Option<Arc<str>> {
        lock(&self.state).lost.get(&peer).cloned()
    }

    /// Opens the inbox of exchange `(context, seq)`. It stays open until the [`Inbox`] is dropped;
    /// frames for the exchange that arrive after that are discarded.
    pub fn open(self: &Arc<Self>, context: u64, seq: u64) -> Result<Inbox, OpenError> {
        let key = (context, seq);
        let mut state = lock(&self.state);
        if state.closed.contains(&key) {
            return Err(OpenError { context, seq });
        }
        let slot = state.slot(key);
        if slot.open {
            return Err(OpenError { context, seq });
        }
        slot.open = true;
        Ok(Inbox {
            mailbox: self.clone(),
            key,
            shared: slot.shared.clone(),
        })
    }

    /// Number of exchanges holding frames or open; for leak tests.
    pub fn pending_exchanges(&self) -> usize {
        lock(&self.state).inboxes.len()
    }

    fn close(&self, key: (u64, u64)) {
        let mut state = lock(&self.state);
        state.inboxes.remove(&key);
        if state.closed.insert(key) {
            state.closed_order.push_back(key);
            if state.closed_order.len() > CLOSED_MEMORY
                && let Some(old) = state.closed_order.pop_front()
            {
                state.closed.remove(&old);
            }
        }
    }
}

/// The frames of one exchange, as they arrive. Dropping it closes the exchange.
pub struct Inbox {
    mailbox: Arc<Mailbox>,
    key: (u64, u64),
    shared: Arc<InboxShared>,
}

impl Inbox {
    /// Takes the oldest frame `from` sent with `step`, if one has arrived.
    pub fn take(&self, from: Rank, step: u32) -> Option<Bytes> {
        let mut state = lock(&self.shared.state);
        let queue = state.frames.get_mut(&(from, step))?;
        let frame = queue.pop_front();
        if queue.is_empty() {
            state.frames.remove(&(from, step));
        }
        frame
    }

    /// Why `peer` is unreachable, if it is.
    pub fn lost(&self, peer: Rank) -> Option<Arc<str>> {
        lock(&self.shared.state).lost.get(&peer).cloned()
    }

    /// Completes after a frame was filed in this inbox or a peer was lost, counting events since
    /// the previous call. May complete spuriously; callers re-check what they wait for.
    pub async fn changed(&self) {
        self.shared.notify.notified().await;
    }

    /// Number of frames filed and not taken.
    pub fn pending(&self) -> usize {
        lock(&self.shared.state)
            .frames
            .values()
            .map(VecDeque::len)
            .sum()
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.mailbox.close(self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn tag(step: u32) -> Tag {
        Tag {
            context: 7,
            seq: 1,
            step,
        }
    }

    #[test]
    fn frames_before_open_are_kept_and_matched_by_sender_and_step() {
        let mb = Arc::new(Mailbox::new());
        mb.deliver(Rank(2), tag(1), Bytes::from_static(b"b"));
        mb.deliver(Rank(1), tag(1), Bytes::from_static(b"a"));
        mb.deliver(Rank(1), tag(1), Bytes::from_static(b"c"));
        let inbox = mb.open(7, 1).unwrap();
        assert_eq!(inbox.take(Rank(1), 0), None);
        assert_eq!(inbox.take(Rank(1), 1).as_deref(), Some(&b"a"[..]));
        assert_eq!(inbox.take(Rank(1), 1).as_deref(), Some(&b"c"[..]));
        assert_eq!(inbox.take(Rank(2), 1).as_deref(), Some(&b"b"[..]));
        assert_eq!(inbox.pending(), 0);
        assert!(mb.open(7, 1).is_err(), "an exchange opens once");
    }

    #[test]
    fn closed_exchanges_drop_late_frames() {
        let mb = Arc::new(Mailbox::new());
        drop(mb.open(7, 1).unwrap());
        mb.deliver(Rank(0), tag(0), Bytes::new());
        assert_eq!(mb.pending_exchanges(), 0);
        assert!(mb.open(7, 1).is_err());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn loss_wakes_waiters() {
        let mb = Arc::new(Mailbox::new());
        let inbox = mb.open(7, 1).unwrap();
        let mb2 = mb.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            mb2.peer_lost(Rank(3), "killed");
        });
        tokio::time::timeout(Duration::from_secs(5), inbox.changed())
            .await
            .expect("peer loss must wake the inbox");
        assert_eq!(inbox.lost(Rank(3)).as_deref(), Some("killed"));
        assert_eq!(inbox.lost(Rank(1)), None);
        // An inbox opened after the loss knows about it too.
        let later = mb.open(7, 2).unwrap();
        assert!(later.lost(Rank(3)).is_some());
    }
}
