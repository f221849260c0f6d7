//! A bounded, never-blocking, in-process event bus (one publisher, many subscribers).
//!
//! Invariants:
//! - `publish` never blocks on a subscriber: each subscriber has a bounded queue, and an event that
//!   does not fit is dropped for that subscriber and counted (per subscriber and in total).
//! - Sequence numbers are assigned under the same lock that enqueues, so every subscriber receives
//!   its events in increasing sequence order, and a lost event shows as a gap.
//! - A subscriber that was dropped is forgotten at the next publish.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError, TrySendError};
use parking_lot::Mutex;

use crate::{EventRecord, KvEvent};

/// Largest queue a subscriber may ask for, in events.
pub const SUBSCRIBER_CAPACITY_MAX: usize = 1 << 20;

struct SubscriberSlot {
    sender: Sender<Arc<EventRecord>>,
    dropped: Arc<AtomicU64>,
}

struct BusState {
    next_seq: u64,
    subscribers: Vec<SubscriberSlot>,
}

struct BusShared {
    state: Mutex<BusState>,
    dropped_total: AtomicU64,
}

/// The publishing side. Cloning gives another handle to the same publisher (one sequence).
#[derive(Clone)]
pub struct EventPublisher {
    shared: Arc<BusShared>,
}

impl std::fmt::Debug for EventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventPublisher")
            .field("next_seq", &self.next_seq())
            .field("dropped_total", &self.dropped_total())
            .finish()
    }
}

impl Default for EventPublisher {
    fn default() -> Self {
        Self::new()
    }
}

impl EventPublisher {
    /// A publisher with no subscribers; its first event gets sequence number 0.
    pub fn new() -> Self {
        Self {
            shared: Arc::new(BusShared {
                state: Mutex::new(BusState {
                    next_seq: 0,
                    subscribers: Vec::new(),
                }),
                dropped_total: AtomicU64::new(0),
            }),
        }
    }

    /// Adds a subscriber with a queue of `capacity_events` (1 ..= [`SUBSCRIBER_CAPACITY_MAX`]).
    /// It receives every event published from now on that fits in its queue.
    pub fn subscribe(&self, capacity_events: usize) -> EventSubscriber {
        let capacity = capacity_events.clamp(1, SUBSCRIBER_CAPACITY_MAX);
        let (sender, receiver) = crossbeam_channel::bounded(capacity);
        let dropped = Arc::new(AtomicU64::new(0));
        let mut state = self.shared.state.lock();
        state.subscribers.push(SubscriberSlot {
            sender,
            dropped: dropped.clone(),
        });
        EventSubscriber {
            receiver,
            expected_seq: state.next_seq,
            dropped,
            gaps_seen_events: 0,
        }
    }

    /// Publishes one event and returns its sequence number. Never blocks.
    pub fn publish(&self, event: KvEvent) -> u64 {
        let mut state = self.shared.state.lock();
        let seq = state.next_seq;
        state.next_seq += 1;
        if state.subscribers.is_empty() {
            return seq;
        }
        let record = Arc::new(EventRecord { seq, event });
        state
            .subscribers
            .retain(|slot| match slot.sender.try_send(record.clone()) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => {
                    slot.dropped.fetch_add(1, Ordering::Relaxed);
                    self.shared.dropped_total.fetch_add(1, Ordering::Relaxed);
                    true
                }
                Err(TrySendError::Disconnected(_)) => false,
            });
        seq
    }

    /// The sequence number the next event will get (= events published so far).
    pub fn next_seq(&self) -> u64 {
        self.shared.state.lock().next_seq
    }

    /// Events dropped across all subscribers because their queues were full.
    pub fn dropped_total(&self) -> u64 {
        self.shared.dropped_total.load(Ordering::Relaxed)
    }

    /// Subscribers still attached (as of the last publish).
    pub fn subscriber_count(&self) -> usize {
        self.shared.state.lock().subscribers.len()
    }
}

/// One received event and how many events this subscriber missed just before it.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The event.
    pub record: Arc<EventRecord>,
    /// Events lost between the previous delivery (or the subscription) and this one.
    pub missed_before: u64,
}

/// The receiving side of a subscription. Dropping it detaches from the publisher.
#[derive(Debug)]
pub struct EventSubscriber {
    receiver: Receiver<Arc<EventRecord>>,
    expected_seq: u64,
    dropped: Arc<AtomicU64>,
    gaps_seen_events: u64,
}

impl EventSubscriber {
    /// The next event if one is queued.
    pub fn try_recv(&mut self) -> Option<Delivery> {
        match self.receiver.try_recv() {
            Ok(record) => Some(self.deliver(record)),
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => None,
        }
    }

    /// The next event, waiting at most `timeout`. `None` on timeout or when the publisher is gone
    /// and the queue is empty.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Option<Delivery> {
        match self.receiver.recv_timeout(timeout) {
            Ok(record) => Some(self.deliver(record)),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Every event queued now.
    pub fn drain(&mut self) -> Vec<Delivery> {
        std::iter::from_fn(|| self.try_recv()).collect()
    }

    /// Events the publisher dropped for this subscriber because its queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Events missed as seen from the sequence numbers received so far.
    pub fn missed_seen(&self) -> u64 {
        self.gaps_seen_events
    }

    fn deliver(&mut self, record: Arc<EventRecord>) -> Delivery {
        debug_assert!(
            record.seq >= self.expected_seq,
            "sequence numbers went backwards"
        );
        let missed_before = record.seq - self.expected_seq;
        self.gaps_seen_events += missed_before;
        self.expected_seq = record.seq + 1;
        Delivery {
            record,
            missed_before,
        }
    }
}
