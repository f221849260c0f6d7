//! KV events over ZMQ, as vLLM publishes them: a PUB socket sending three frames
//! `[topic, seq (u64 big-endian), payload]` and a ROUTER socket replaying buffered batches.
//!
//! Replay protocol (the wire vectors' `about`): a DEALER sends `[b"", start_seq (8 bytes BE)]`
//! and receives `[b"", topic, seq, payload]` for every buffered batch with `seq >= start_seq`,
//! then `[b"", topic, ff x 8, b""]`.
//!
//! Invariants:
//! - The engine never waits on ZMQ: the publisher reads the in-process bus through a bounded
//!   subscription on its own thread, and PUB sends never block (a slow subscriber loses
//!   messages; sequence numbers let it notice).
//! - Wire sequence numbers count batches from 0 per publisher. Events the in-process bus dropped
//!   before they reached the publisher leave a hole in the wire sequence, so that downstream sees
//!   the loss as a gap that no replay can fill, instead of missing it silently.
//! - The replay buffer holds at most `replay_batches_max` batches.
//! - The subscriber follows each worker on a thread of its own (its SUB socket, its socket
//!   monitor, its replay requests): a worker that is slow, silent or hostile, or whose replay
//!   never answers, delays only its own events (the shared sink aside). A worker's events reach
//!   the sink in the order its thread decided them; different workers' events interleave.
//!   Every wait of a worker thread (socket, replay, full sink) looks at its stop flag at least
//!   every 50 ms: removing a worker (or dropping the subscriber) stops and joins its thread, and
//!   nothing of it is reported afterwards.
//! - The subscriber reports, per worker, every batch, gap (filled by replay or not), restart
//!   and undecodable payload, and never drops a batch silently: a batch at most
//!   [`DUPLICATE_WINDOW`] below the expected sequence number is a duplicate (dropped, counted);
//!   one further below, or sequence 0, is a reset ([`SubscriberEvent::Restart`], then the new
//!   sequence is followed from there, its unseen beginning reported as a gap); one above is a
//!   gap, replayed if possible. Every anomaly is counted in [`SubscriberStats`].
//! - It never panics on what it receives, and bounds what a peer can make it hold: a payload
//!   over [`SubscriberOptions::max_message_bytes`] is reported undecodable without being
//!   decoded; ZMQ (`ZMQ_MAXMSGSIZE` on SUB and replay DEALER sockets) refuses a frame over
//!   [`SubscriberOptions::zmq_max_message_bytes`] from its header, before allocating it, by
//!   dropping the connection as a protocol error, which ZMQ does not retry: the worker's thread
//!   re-creates its SUB socket after [`RESUBSCRIBE_DELAY`] (a replay in flight times out). Only
//!   the first frames of a message are kept (a message of the wrong shape is reported
//!   undecodable); a replay is read one batch at a time and ends at its timeout whatever the
//!   peer sends.
//! - Backpressure: the sink is the caller's channel. When it is bounded and full, a worker
//!   thread waits for room (counted in [`SubscriberStats::sink_waits`]); meanwhile that
//!   worker's messages queue in ZMQ up to the SUB socket's receive high-water mark (and the
//!   publisher's send high-water mark), beyond which ZMQ drops them; the thread then sees the
//!   sequence gap and replays it (or reports it unfilled).
//! - Each worker's connection state (connected, retrying, time of the last message) comes from
//!   its SUB socket's monitor and is queryable with [`ZmqSubscriber::links`].
//! - A worker holds three ZMQ sockets (SUB, libzmq's monitor socket, the PAIR reading it), a
//!   fourth during a replay, and a wake-up socket pair; all are freed when it is removed or
//!   replaced (the monitor is stopped before the SUB socket closes: libzmq frees neither
//!   otherwise). Workers share ZMQ contexts [`WORKERS_PER_CONTEXT`] at a time, well within
//!   libzmq's 1023 sockets per context; a context left empty is closed (the first aside).
//!   [`SubscriberStats::sockets_open`] and [`SubscriberStats::contexts_open`] count them.
//! - A lost connection (the SUB socket's monitor saw an established connection go) is reported
//!   as [`SubscriberEvent::LinkLost`] before anything received over a new connection; the first
//!   batch over the new connection is a restart when numbered below the expected one (a
//!   publisher never resends what a lost connection missed), never a duplicate.
//! - A connection ZMQ dropped without retrying it after its handshake (a frame over
//!   `ZMQ_MAXMSGSIZE`; libzmq gives no reason) is counted in [`SubscriberStats::oversized`].

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{SendTimeoutError, Sender, TrySendError};
use parking_lot::Mutex;

use crate::wire::{decode_batch, encode_batch, DecodeError, WireBatch};
use crate::{EventPublisher, KvEvent};

/// The sequence number ending a replay.
pub const REPLAY_END_SEQ: u64 = u64::MAX;
/// Events per published batch at most.
pub const BATCH_EVENTS_MAX: usize = 1024;
/// Bus queue of the publisher's subscription, in events.
pub const PUBLISHER_QUEUE_EVENTS: usize = 1 << 16;

/// Why a transport could not start or run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// A ZMQ call failed.
    #[error("zmq {call} {endpoint}: {error}")]
    Zmq {
        /// What was attempted.
        call: &'static str,
        /// The endpoint.
        endpoint: String,
        /// ZMQ's message.
        error: String,
    },
    /// A replay did not answer in time.
    #[error("replay from {endpoint} timed out")]
    ReplayTimeout {
        /// The replay endpoint.
        endpoint: String,
    },
}

fn zmq_err(call: &'static str, endpoint: &str, error: zmq::Error) -> TransportError {
    TransportError::Zmq {
        call,
        endpoint: endpoint.to_owned(),
        error: error.to_string(),
    }
}

/// How to publish.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Where the PUB socket binds (`tcp://127.0.0.1:5557`; port 0 or `*` picks one).
    pub endpoint: String,
    /// Where the ROUTER replay socket binds, if any.
    pub replay_endpoint: Option<String>,
    /// The topic frame (vLLM sends an empty topic by default).
    pub topic: Vec<u8>,
    /// The data-parallel rank written into each batch.
    pub dp_rank: Option<u32>,
    /// Batches kept for replay.
    pub replay_batches_max: usize,
}

impl PublisherConfig {
    /// Publishing on `endpoint` with a replay socket on `replay`, an empty topic, rank 0, and a
    /// replay buffer of 10,000 batches.
    pub fn new(endpoint: impl Into<String>, replay: Option<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: replay,
            topic: Vec::new(),
            dp_rank: Some(0),
            replay_batches_max: 10_000,
        }
    }
}

/// Counters of a publisher.
#[derive(Debug, Default)]
pub struct PublisherStats {
    /// Batches sent.
    pub batches: AtomicU64,
    /// Events sent.
    pub events: AtomicU64,
    /// Events lost before reaching the publisher (the bus queue was full).
    pub events_lost: AtomicU64,
    /// Replay requests served.
    pub replays: AtomicU64,
}

/// Publishes an in-process event bus over ZMQ until dropped.
pub struct ZmqPublisher {
    endpoint: String,
    replay_endpoint: Option<String>,
    stats: Arc<PublisherStats>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ZmqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqPublisher")
            .field("endpoint", &self.endpoint)
            .field("replay", &self.replay_endpoint)
            .finish()
    }
}

/// The name libzmq's own threads (one I/O thread and the reaper per context) carry here.
/// libzmq as built by the `zmq` crate does not name them (no `pthread_setname_np` in its
/// build), so they inherit the name of the thread that made the context's first socket: a
/// caller on an async runtime made them look like the runtime's workers in `top -H`, and made
/// the event path's CPU count as the front end's (kvbm-bench replay splits a router's CPU by
/// thread name).
pub const ZMQ_THREAD_NAME: &str = "ZMQbg/kvbm";

/// A ZMQ context whose background threads are already running under [`ZMQ_THREAD_NAME`]:
/// libzmq starts them with a context's first socket, from the thread making it, so a throwaway
/// socket is made (and closed) on a thread of that name.
pub fn named_context() -> zmq::Context {
    let ctx = zmq::Context::new();
    let starter = ctx.clone();
    // On failure (no thread, no socket) the threads start with the first real socket instead,
    // under its thread's name: a name is all that is lost.
    let _ = std::thread::Builder::new()
        .name(ZMQ_THREAD_NAME.into())
        .spawn(move || drop(starter.socket(zmq::PAIR)))
        .map(|t| t.join());
    ctx
}

impl ZmqPublisher {
    /// Binds the sockets and starts publishing what `bus` publishes from now on.
    pub fn start(bus: &EventPublisher, config: PublisherConfig) -> Result<Self, TransportError> {
        let ctx = named_context();
        let publisher = ctx
            .socket(zmq::PUB)
            .map_err(|e| zmq_err("socket", &config.endpoint, e))?;
        publisher
            .set_linger(0)
            .map_err(|e| zmq_err("linger", &config.endpoint, e))?;
        publisher
            .bind(&config.endpoint)
            .map_err(|e| zmq_err("bind", &config.endpoint, e))?;
        let endpoint = last_endpoint(&publisher).unwrap_or_else(|| config.endpoint.clone());
        let (router, replay_endpoint) = match &config.replay_endpoint {
            None => (None, None),
            Some(replay) => {
                let router = ctx
                    .socket(zmq::ROUTER)
                    .map_err(|e| zmq_err("socket", replay, e))?;
                router
                    .set_linger(0)
                    .map_err(|e| zmq_err("linger", replay, e))?;
                router
                    .bind(replay)
                    .map_err(|e| zmq_err("bind", replay, e))?;
                let bound = last_endpoint(&router).unwrap_or_else(|| replay.clone());
                (Some(router), Some(bound))
            }
        };
        let subscription = bus.subscribe(PUBLISHER_QUEUE_EVENTS);
        let stats = Arc::new(PublisherStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_stats, thread_stop) = (stats.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("kvbm-zmq-pub".into())
            .spawn(move || {
                publish_loop(
                    publisher,
                    router,
                    subscription,
                    config,
                    &thread_stats,
                    &thread_stop,
                )
            })
            .map_err(|e| TransportError::Zmq {
                call: "spawn",
                endpoint: endpoint.clone(),
                error: e.to_string(),
            })?;
        Ok(Self {
            endpoint,
            replay_endpoint,
            stats,
            stop,
            thread: Some(thread),
        })
    }

    /// The PUB endpoint as bound (with the port chosen, if it was 0 or `*`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint as bound.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Counters.
    pub fn stats(&self) -> &PublisherStats {
        &self.stats
    }
}

impl Drop for ZmqPublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn last_endpoint(socket: &zmq::Socket) -> Option<String> {
    socket.get_last_endpoint().ok().and_then(Result::ok)
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

fn publish_loop(
    publisher: zmq::Socket,
    router: Option<zmq::Socket>,
    mut subscription: crate::EventSubscriber,
    config: PublisherConfig,
    stats: &PublisherStats,
    stop: &AtomicBool,
) {
    let mut seq: u64 = 0;
    let mut replay: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    let mut events: Vec<KvEvent> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        if let Some(first) = subscription.recv_timeout(Duration::from_millis(5)) {
            let mut lost = first.missed_before;
            events.push(first.record.event.clone());
            while events.len() < BATCH_EVENTS_MAX {
                let Some(next) = subscription.try_recv() else {
                    break;
                };
                lost += next.missed_before;
                events.push(next.record.event.clone());
            }
            if lost > 0 {
                // Leave a hole: downstream must see that events are missing.
                stats.events_lost.fetch_add(lost, Ordering::Relaxed);
                seq += 1;
            }
            let mut payload = Vec::with_capacity(64 * events.len());
            encode_batch(now_seconds(), &events, config.dp_rank, &mut payload);
            let frames: [&[u8]; 3] = [&config.topic, &seq.to_be_bytes(), &payload];
            // A full send queue drops the message; the subscriber sees the gap.
            let _ = publisher.send_multipart(frames, zmq::DONTWAIT);
            stats.batches.fetch_add(1, Ordering::Relaxed);
            stats
                .events
                .fetch_add(events.len() as u64, Ordering::Relaxed);
            events.clear();
            if router.is_some() {
                replay.push_back((seq, payload));
                while replay.len() > config.replay_batches_max {
                    replay.pop_front();
                }
            }
            seq += 1;
        }
        if let Some(router) = &router {
            serve_replays(router, &replay, &config.topic, stats);
        }
    }
}

/// Answers every pending replay request without blocking.
fn serve_replays(
    router: &zmq::Socket,
    buffer: &VecDeque<(u64, Vec<u8>)>,
    topic: &[u8],
    stats: &PublisherStats,
) {
    while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
        // [identity, b"", start_seq]; anything else is ignored.
        let [identity, empty, start] = frames.as_slice() else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
            continue;
        };
        if !empty.is_empty() {
            continue;
        }
        let start = u64::from_be_bytes(start);
        stats.replays.fetch_add(1, Ordering::Relaxed);
        for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
            let frames: [&[u8]; 5] = [identity, b"", topic, &seq.to_be_bytes(), payload];
            let _ = router.send_multipart(frames, zmq::DONTWAIT);
        }
        let end: [&[u8]; 5] = [identity, b"", topic, &REPLAY_END_SEQ.to_be_bytes(), b""];
        let _ = router.send_multipart(end, zmq::DONTWAIT);
    }
}

/// Asks a replay socket for every buffered batch from `start_seq` on: `(seq, payload)` in order.
pub fn request_replay(
    ctx: &zmq::Context,
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Vec<u8>)>, TransportError> {
    let dealer = ctx
        .socket(zmq::DEALER)
        .map_err(|e| zmq_err("socket", endpoint, e))?;
    dealer
        .set_linger(0)
        .map_err(|e| zmq_err("linger", endpoint, e))?;
    dealer
        .connect(endpoint)
        .map_err(|e| zmq_err("connect", endpoint, e))?;
    let request: [&[u8]; 2] = [b"", &start_seq.to_be_bytes()];
    dealer
        .send_multipart(request, 0)
        .map_err(|e| zmq_err("send", endpoint, e))?;
    let deadline = Instant::now() + timeout;
    let mut batches = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero()
            || dealer
                .poll(zmq::POLLIN, left.as_millis().max(1) as i64)
                .map_err(|e| zmq_err("poll", endpoint, e))?
                == 0
        {
            return Err(TransportError::ReplayTimeout {
                endpoint: endpoint.to_owned(),
            });
        }
        let frames = dealer
            .recv_multipart(0)
            .map_err(|e| zmq_err("recv", endpoint, e))?;
        // [b"", topic, seq, payload]
        let [_, _, seq, payload] = frames.as_slice() else {
            continue;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()) else {
            continue;
        };
        let seq = u64::from_be_bytes(seq);
        if seq == REPLAY_END_SEQ {
            return Ok(batches);
        }
        batches.push((seq, payload.clone()));
    }
}

/// A worker to subscribe to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEndpoint {
    /// The worker's id.
    pub worker_id: u64,
    /// Its data-parallel rank.
    pub dp_rank: u32,
    /// Its PUB endpoint.
    pub endpoint: String,
    /// Its replay endpoint, if any.
    pub replay: Option<String>,
}

/// What the subscriber saw from one worker.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscriberEvent {
    /// A batch, in sequence order (replayed batches included).
    Batch {
        /// Worker id and dp rank.
        worker: (u64, u32),
        /// The batch's sequence number.
        seq: u64,
        /// The decoded batch.
        batch: WireBatch,
    },
    /// A payload that did not decode; the worker's other batches go on.
    Undecodable {
        /// Worker id and dp rank.
        worker: (u64, u32),
        /// Its sequence number.
        seq: u64,
        /// Why.
        error: DecodeError,
    },
    /// Batches `from..to` were missing. `filled`: they came from the replay socket (and were
    /// reported as `Batch` before this); otherwise the worker's state may be stale (resync).
    Gap {
        /// Worker id and dp rank.
        worker: (u64, u32),
        /// First missing sequence number.
        from: u64,
        /// First sequence number after the gap.
        to: u64,
        /// Whether replay filled it.
        filled: bool,
    },
    /// The worker's sequence went back to 0, or further back than [`DUPLICATE_WINDOW`]: it
    /// restarted (or its sequence is not to be trusted), its earlier state is gone. The batches
    /// that follow are the new sequence's (a gap if its beginning was not seen). After a lost
    /// connection, any batch below the expected number is a restart (see
    /// [`SubscriberEvent::LinkLost`]).
    Restart {
        /// Worker id and dp rank.
        worker: (u64, u32),
    },
    /// The connection to the worker was lost (its process may have died). Until the next
    /// [`SubscriberEvent::LinkResumed`] or [`SubscriberEvent::Restart`] of this worker, whether
    /// its earlier state still stands is unknown. Batches still queued from the lost connection
    /// may follow this event (as `Batch`, settling nothing). The first batch known to have come
    /// over the new connection says it: a continuation of the sequence (or a gap above it) is
    /// reported as `LinkResumed` before it; a restart as `Restart`. Until the socket's queue has
    /// been seen empty after the reconnection, any batch below the expected number is taken for
    /// a restart, never for a duplicate.
    LinkLost {
        /// Worker id and dp rank.
        worker: (u64, u32),
    },
    /// After [`SubscriberEvent::LinkLost`]: the first batch over the new connection continues
    /// the sequence, so the worker is the same process and its earlier state stands. Reported
    /// just before that batch (and the gap before it, if any).
    LinkResumed {
        /// Worker id and dp rank.
        worker: (u64, u32),
    },
}

/// Time to wait for a replay before reporting the gap unfilled (the default of
/// [`SubscriberOptions::replay_timeout`]).
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// Worker additions and removals queued at most. Unused since every worker has its own thread
/// (additions and removals are direct calls); kept for compatibility.
pub const SUBSCRIBER_COMMANDS_MAX: usize = 256;

/// How far below the expected sequence number a batch still counts as a duplicate (dropped and
/// counted); further below, the publisher's sequence was reset ([`SubscriberEvent::Restart`]).
pub const DUPLICATE_WINDOW: u64 = 1024;

/// The default of [`SubscriberOptions::max_message_bytes`]: 16 MiB.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// The default of [`SubscriberOptions::heartbeat_interval`].
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);

/// How long a worker thread waits at most (on its sockets, a replay, the sink) before it looks at
/// its stop flag again: the bound on how long `remove` and dropping the subscriber take.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Messages a worker thread takes from its SUB socket before it looks at its stop flag and its
/// socket monitor again.
const RECV_BURST: usize = 256;

/// How long after a lost connection a worker thread waits for ZMQ to retry it before it
/// re-creates the SUB socket itself (ZMQ does not retry after a protocol error, such as a frame
/// over `ZMQ_MAXMSGSIZE` or a failed handshake).
pub const RESUBSCRIBE_DELAY: Duration = Duration::from_secs(1);

/// Workers followed per ZMQ context at most. Each worker holds three ZMQ sockets (its SUB
/// socket, the SUB socket's monitor and the PAIR reading it) and a fourth during a replay, and a
/// closed socket is freed asynchronously; libzmq allows 1023 sockets per context by default
/// (`ZMQ_MAX_SOCKETS`, which the zmq crate cannot set), so the subscriber opens one more context
/// for every this many workers, each with room to spare.
pub const WORKERS_PER_CONTEXT: usize = 200;

/// How the subscriber treats its peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberOptions {
    /// Time a replay (the initial one or a gap's) may take in all before what it did not bring
    /// is reported as an unfilled gap.
    pub replay_timeout: Duration,
    /// Largest payload decoded; a larger one is reported as [`SubscriberEvent::Undecodable`]
    /// with [`DecodeError::TooLarge`], and the stream goes on. ZMQ itself refuses any frame over
    /// [`SubscriberOptions::zmq_max_message_bytes`] (it drops the connection, and the subscriber
    /// connects again after [`RESUBSCRIBE_DELAY`]).
    pub max_message_bytes: usize,
    /// ZMTP heartbeat on each SUB socket (`ZMQ_HEARTBEAT_IVL`; the peer has three intervals
    /// to answer before the connection is dropped and retried), so that a silent dead peer shows
    /// in [`ZmqSubscriber::links`]. Zero: none.
    pub heartbeat_interval: Duration,
}

impl Default for SubscriberOptions {
    fn default() -> Self {
        Self {
            replay_timeout: REPLAY_TIMEOUT,
            max_message_bytes: MAX_MESSAGE_BYTES,
            heartbeat_interval: HEARTBEAT_INTERVAL,
        }
    }
}

impl SubscriberOptions {
    /// The bound given to ZMQ as `ZMQ_MAXMSGSIZE` on every SUB and replay DEALER socket: twice
    /// `max_message_bytes` plus 64 KiB, so that a payload somewhat over the limit is still
    /// received and reported, while a frame over this bound is never allocated: ZMQ reads its
    /// size from the frame header, treats it as a protocol error and drops the connection (the
    /// link shows a disconnect) without retrying it; the subscriber re-creates the socket after
    /// [`RESUBSCRIBE_DELAY`], and the batches lost meanwhile show as a sequence gap.
    pub fn zmq_max_message_bytes(&self) -> i64 {
        let bound = self
            .max_message_bytes
            .saturating_mul(2)
            .saturating_add(64 << 10);
        i64::try_from(bound).unwrap_or(i64::MAX)
    }
}

/// Counters of a subscriber, over all its workers.
#[derive(Debug, Default)]
pub struct SubscriberStats {
    /// Batches reported as [`SubscriberEvent::Batch`] (replayed ones included).
    pub batches: AtomicU64,
    /// Payloads that did not decode.
    pub undecodable: AtomicU64,
    /// Payloads over [`SubscriberOptions::max_message_bytes`], reported without being decoded,
    /// and frames over [`SubscriberOptions::zmq_max_message_bytes`], which ZMQ refuses by
    /// dropping the connection (counted when the subscriber connects again).
    pub oversized: AtomicU64,
    /// Messages of the wrong shape (frames), on the live stream or in a replay.
    pub malformed: AtomicU64,
    /// Batches dropped as duplicates (at most [`DUPLICATE_WINDOW`] below the expected one).
    pub duplicates: AtomicU64,
    /// Sequence resets reported as [`SubscriberEvent::Restart`].
    pub restarts: AtomicU64,
    /// Gaps reported filled by replay.
    pub gaps_filled: AtomicU64,
    /// Gaps reported unfilled.
    pub gaps_unfilled: AtomicU64,
    /// Replay requests sent.
    pub replay_requests: AtomicU64,
    /// Replays that did not end in time.
    pub replay_timeouts: AtomicU64,
    /// Replays that failed otherwise (a ZMQ error).
    pub replay_failures: AtomicU64,
    /// Times a worker thread found the sink full and waited.
    pub sink_waits: AtomicU64,
    /// A gauge, not a counter: ZMQ sockets open now for the workers (each worker's SUB socket,
    /// its monitor and the monitor's reader, and replay sockets in use).
    pub sockets_open: AtomicU64,
    /// A gauge: ZMQ contexts open now (one per [`WORKERS_PER_CONTEXT`] workers).
    pub contexts_open: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// A worker's connection, as the SUB socket's monitor reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkState {
    /// The first connection attempt is under way.
    Connecting,
    /// Connected (the ZMTP handshake succeeded, or a message arrived).
    Connected,
    /// Not connected: an attempt failed (nobody listens, the handshake failed) or the connection
    /// was lost (peer gone, heartbeat timeout, an oversized frame); ZMQ retries.
    Retrying,
}

/// One worker's link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkStatus {
    /// The PUB endpoint.
    pub endpoint: String,
    /// Connected or not.
    pub state: LinkState,
    /// When `state` last changed.
    pub since: SystemTime,
    /// When the last message arrived, if any did.
    pub last_message: Option<SystemTime>,
    /// Connections made (handshakes that succeeded).
    pub connects: u64,
    /// Connections lost.
    pub disconnects: u64,
    /// Connection attempts that failed and were retried.
    pub connect_retries: u64,
    /// Times the subscriber re-created the SUB socket because ZMQ gave up on the connection (a
    /// protocol error: an oversized frame, a failed handshake).
    pub resubscribes: u64,
    /// The sequence number expected next.
    pub next_seq: u64,
}

impl LinkStatus {
    fn new(endpoint: &str, next_seq: u64) -> Self {
        Self {
            endpoint: endpoint.to_owned(),
            state: LinkState::Connecting,
            since: SystemTime::now(),
            last_message: None,
            connects: 0,
            disconnects: 0,
            connect_retries: 0,
            resubscribes: 0,
            next_seq,
        }
    }

    /// Whether the worker is connected now.
    pub fn is_connected(&self) -> bool {
        self.state == LinkState::Connected
    }

    fn set_state(&mut self, state: LinkState) {
        if self.state != state {
            self.state = state;
            self.since = SystemTime::now();
        }
    }
}

/// Subscribes to many workers until dropped, each on its own thread (its SUB socket, its socket
/// monitor, its replay requests), all reporting to one channel. Workers can be added and removed
/// while it runs.
///
/// A worker added with a replay endpoint is first synchronised from it: the subscriber asks for
/// every buffered batch from the starting sequence number (0, or the one given to
/// [`ZmqSubscriber::add_from`]), reports them, and then follows the live stream from there
/// (batches it already reported are skipped). If the buffer no longer reaches back to the
/// starting number, the batches before it are reported as an unfilled gap. Any later batch above
/// the expected number (the first live one included, when the initial replay brought nothing)
/// makes the subscriber ask the replay socket for what is missing before reporting the gap.
pub struct ZmqSubscriber {
    shared: Arc<Shared>,
    workers: Mutex<HashMap<(u64, u32), WorkerThread>>,
    /// Serialises additions and removals, so that a replaced worker's thread has stopped before
    /// its successor reports anything.
    changes: Mutex<()>,
}

impl std::fmt::Debug for ZmqSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqSubscriber")
            .field("workers", &self.workers.lock().len())
            .field("options", &self.shared.options)
            .finish_non_exhaustive()
    }
}

/// What every worker thread shares.
struct Shared {
    /// ZMQ contexts, each with the number of workers using it; one left empty is closed (the
    /// first one aside), its slot reused.
    contexts: Mutex<Vec<Option<(zmq::Context, usize)>>>,
    sink: Sender<SubscriberEvent>,
    options: SubscriberOptions,
    stats: SubscriberStats,
    /// Numbers the monitors' inproc endpoints.
    monitors: AtomicU64,
}

impl Shared {
    /// A context with room for one more worker (a new one if every context is full).
    fn lease_context(self: &Arc<Self>) -> ContextLease {
        let mut contexts = self.contexts.lock();
        let room = contexts
            .iter()
            .position(|c| c.as_ref().is_some_and(|(_, n)| *n < WORKERS_PER_CONTEXT));
        let slot = room.unwrap_or_else(|| {
            bump(&self.stats.contexts_open);
            let fresh = Some((named_context(), 0));
            match contexts.iter().position(Option::is_none) {
                Some(free) => {
                    contexts[free] = fresh;
                    free
                }
                None => {
                    contexts.push(fresh);
                    contexts.len() - 1
                }
            }
        });
        let (ctx, n) = contexts[slot].as_mut().expect("a context in the slot");
        *n += 1;
        ContextLease {
            ctx: ctx.clone(),
            slot,
            shared: self.clone(),
        }
    }
}

/// One worker's share of a ZMQ context; given back when dropped.
struct ContextLease {
    ctx: zmq::Context,
    slot: usize,
    shared: Arc<Shared>,
}

impl Drop for ContextLease {
    fn drop(&mut self) {
        let closed = {
            let mut contexts = self.shared.contexts.lock();
            match contexts.get_mut(self.slot) {
                Some(Some((_, n))) => {
                    *n = n.saturating_sub(1);
                    if *n == 0 && self.slot > 0 {
                        contexts[self.slot].take()
                    } else {
                        None
                    }
                }
                _ => None,
            }
        };
        if closed.is_some() {
            let _ = self.shared.stats.contexts_open.fetch_update(
                Ordering::Relaxed,
                Ordering::Relaxed,
                |v| Some(v.saturating_sub(1)),
            );
        }
        // The context itself closes (waiting for libzmq to free its closed sockets) when its
        // last handle, `self.ctx`, drops, outside the lock.
        drop(closed);
    }
}

/// A running worker thread.
struct WorkerThread {
    stop: Arc<AtomicBool>,
    /// Closed (or written to) to wake the thread at once when it is to stop.
    wake: Option<UnixStream>,
    link: Arc<Mutex<LinkStatus>>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerThread {
    /// Tells the thread to stop and wakes it, without waiting.
    fn signal_stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(mut wake) = self.wake.take() {
            // The thread polls the other end: a byte (or the end of the stream) wakes it.
            let _ = wake.write(&[1]);
        }
    }

    /// Stops the thread and waits for it: nothing of this worker is reported afterwards.
    fn stop_and_join(mut self) {
        self.signal_stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl ZmqSubscriber {
    /// Connects to every worker and starts reporting to `sink`, with the default options.
    pub fn start(
        workers: Vec<WorkerEndpoint>,
        sink: Sender<SubscriberEvent>,
    ) -> Result<Self, TransportError> {
        Self::start_with(workers, sink, SubscriberOptions::default())
    }

    /// Connects to every worker and starts reporting to `sink`.
    pub fn start_with(
        workers: Vec<WorkerEndpoint>,
        sink: Sender<SubscriberEvent>,
        options: SubscriberOptions,
    ) -> Result<Self, TransportError> {
        let subscriber = Self {
            shared: Arc::new(Shared {
                contexts: Mutex::new(Vec::new()),
                sink,
                options,
                stats: SubscriberStats::default(),
                monitors: AtomicU64::new(0),
            }),
            workers: Mutex::new(HashMap::new()),
            changes: Mutex::new(()),
        };
        for w in workers {
            subscriber.add(w)?;
        }
        Ok(subscriber)
    }

    /// Subscribes to one more worker from sequence number 0 (replacing any subscription of the
    /// same id and rank); returns once its socket is connecting and its initial replay, if any,
    /// was reported.
    pub fn add(&self, worker: WorkerEndpoint) -> Result<(), TransportError> {
        self.add_from(worker, 0)
    }

    /// Subscribes to one more worker whose batches before `next_seq` are already known (a router
    /// that bootstrapped from a sibling's dump): with a replay endpoint, the initial replay asks
    /// from `next_seq` and an unfilled gap is reported if the buffer no longer reaches back to
    /// it; without one, the first live batch above `next_seq` is reported as an unfilled gap.
    /// Batches up to [`DUPLICATE_WINDOW`] below `next_seq` are skipped as duplicates; a batch
    /// further below (or sequence 0) is a [`SubscriberEvent::Restart`]. Returns as
    /// [`ZmqSubscriber::add`] does.
    pub fn add_from(&self, worker: WorkerEndpoint, next_seq: u64) -> Result<(), TransportError> {
        let key = (worker.worker_id, worker.dp_rank);
        let (ready, synced) = crossbeam_channel::bounded(1);
        {
            let _changes = self.changes.lock();
            let old = self.workers.lock().remove(&key);
            if let Some(old) = old {
                old.stop_and_join();
            }
            let stop = Arc::new(AtomicBool::new(false));
            let link = Arc::new(Mutex::new(LinkStatus::new(&worker.endpoint, next_seq)));
            let lease = self.shared.lease_context();
            let (wake_tx, wake) = UnixStream::pair().map_err(|e| TransportError::Zmq {
                call: "socketpair",
                endpoint: worker.endpoint.clone(),
                error: e.to_string(),
            })?;
            let conn = connect(&self.shared, &lease.ctx, &worker)?;
            let follower = Follower {
                key,
                endpoint: worker.clone(),
                conn,
                lease,
                wake,
                shared: self.shared.clone(),
                stop: stop.clone(),
                link: link.clone(),
                expected: next_seq,
                sink_open: true,
                resubscribe_at: Cell::new(None),
                loss: Cell::new(Loss::None),
                loss_unreported: Cell::new(false),
                handshake_failed: Cell::new(false),
            };
            let thread = std::thread::Builder::new()
                .name(format!("kvbm-sub-{}-{}", key.0, key.1))
                .spawn(move || follower.run(next_seq, &ready))
                .map_err(|e| TransportError::Zmq {
                    call: "spawn",
                    endpoint: worker.endpoint.clone(),
                    error: e.to_string(),
                })?;
            self.workers.lock().insert(
                key,
                WorkerThread {
                    stop,
                    wake: Some(wake_tx),
                    link,
                    thread: Some(thread),
                },
            );
        }
        // The thread says when its initial replay is reported (or it was stopped first).
        synced.recv().map_err(|_| TransportError::Zmq {
            call: "add",
            endpoint: worker.endpoint.clone(),
            error: "the worker's thread stopped".into(),
        })
    }

    /// Stops following a worker: returns once its thread has ended, so that none of its later
    /// batches is reported.
    pub fn remove(&self, worker: (u64, u32)) {
        let _changes = self.changes.lock();
        let old = self.workers.lock().remove(&worker);
        if let Some(old) = old {
            old.stop_and_join();
        }
    }

    /// Every subscribed worker's link, in key order.
    pub fn links(&self) -> Vec<((u64, u32), LinkStatus)> {
        let mut links: Vec<_> = self
            .workers
            .lock()
            .iter()
            .map(|(key, w)| (*key, w.link.lock().clone()))
            .collect();
        links.sort_by_key(|(key, _)| *key);
        links
    }

    /// Counters, over all workers.
    pub fn stats(&self) -> &SubscriberStats {
        &self.shared.stats
    }

    /// The options it runs with.
    pub fn options(&self) -> &SubscriberOptions {
        &self.shared.options
    }
}

impl Drop for ZmqSubscriber {
    fn drop(&mut self) {
        let mut workers: Vec<WorkerThread> = self.workers.lock().drain().map(|(_, w)| w).collect();
        // Stop them all first, so that they wind down together.
        for w in &mut workers {
            w.signal_stop();
        }
        for w in workers {
            w.stop_and_join();
        }
    }
}

/// A worker's SUB socket with its monitor. Dropping it frees both: the monitor is stopped first
/// (libzmq never frees a socket whose monitor is still running, nor the monitor's sockets).
struct Conn {
    sub: zmq::Socket,
    monitor: Option<zmq::Socket>,
    shared: Arc<Shared>,
}

impl Conn {
    /// ZMQ sockets it holds: the SUB socket, and with a monitor, libzmq's monitor socket and
    /// the PAIR reading it.
    fn sockets(&self) -> u64 {
        if self.monitor.is_some() {
            3
        } else {
            1
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let n = self.sockets();
        if let Some(monitor) = &self.monitor {
            // What the monitor still holds, so that stopping it does not wait for room.
            while let Ok(Some(_)) = recv_frames(monitor, 1) {}
        }
        let sub = self.sub.as_mut_ptr();
        // SAFETY: `sub` is the live socket this Conn owns, used only by the thread dropping it;
        // a null endpoint with no events is libzmq's way to stop a socket's monitor (a no-op
        // when there is none); it closes libzmq's side of the monitor.
        unsafe {
            zmq_sys::zmq_socket_monitor(sub, std::ptr::null(), 0);
        }
        // Then the reader, then (as the fields drop) the SUB socket.
        drop(self.monitor.take());
        let _ = self.shared.stats.sockets_open.fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |v| Some(v.saturating_sub(n)),
        );
    }
}

/// The worker's SUB socket, connecting, with its monitor (if the monitor could be set up).
fn connect(
    shared: &Arc<Shared>,
    ctx: &zmq::Context,
    w: &WorkerEndpoint,
) -> Result<Conn, TransportError> {
    let options = &shared.options;
    let socket = ctx
        .socket(zmq::SUB)
        .map_err(|e| zmq_err("socket", &w.endpoint, e))?;
    socket
        .set_linger(0)
        .map_err(|e| zmq_err("linger", &w.endpoint, e))?;
    socket
        .set_maxmsgsize(options.zmq_max_message_bytes())
        .map_err(|e| zmq_err("maxmsgsize", &w.endpoint, e))?;
    if !options.heartbeat_interval.is_zero() {
        let ivl = i32::try_from(options.heartbeat_interval.as_millis())
            .unwrap_or(i32::MAX / 3)
            .max(1);
        socket
            .set_heartbeat_ivl(ivl)
            .map_err(|e| zmq_err("heartbeat", &w.endpoint, e))?;
        socket
            .set_heartbeat_timeout(ivl.saturating_mul(3))
            .map_err(|e| zmq_err("heartbeat", &w.endpoint, e))?;
    }
    socket
        .set_subscribe(b"")
        .map_err(|e| zmq_err("subscribe", &w.endpoint, e))?;
    // The monitor before the connection, so that it sees the first attempt. Its reader is
    // made and connected first (inproc allows connecting before the bind): libzmq sends monitor
    // events with a blocking send, so a monitor must never run without a peer. Nor does it
    // report its own stop (MONITOR_STOPPED), which is sent as the monitor is stopped and could
    // otherwise wait on a full queue.
    let name = format!(
        "inproc://kvbm-sub-monitor-{}",
        shared.monitors.fetch_add(1, Ordering::Relaxed)
    );
    let events = zmq::SocketEvent::ALL.to_raw() & !zmq::SocketEvent::MONITOR_STOPPED.to_raw();
    let monitor = ctx
        .socket(zmq::PAIR)
        .and_then(|pair| {
            pair.set_linger(0)?;
            pair.connect(&name)?;
            Ok(pair)
        })
        .and_then(|pair| {
            socket.monitor(&name, i32::from(events))?;
            Ok(pair)
        })
        .ok();
    let conn = Conn {
        sub: socket,
        monitor,
        shared: shared.clone(),
    };
    shared
        .stats
        .sockets_open
        .fetch_add(conn.sockets(), Ordering::Relaxed);
    // On failure, dropping `conn` frees what was made.
    conn.sub
        .connect(&w.endpoint)
        .map_err(|e| zmq_err("connect", &w.endpoint, e))?;
    Ok(conn)
}

/// A message read frame by frame, keeping at most the first few frames.
struct Received {
    frames: Vec<zmq::Message>,
    /// Frames in the message, kept or not.
    total: usize,
}

/// Reads one whole message without blocking (`None` if there is none), keeping at most `keep`
/// frames, so that a peer sending many frames cannot make this side hold them all.
fn recv_frames(socket: &zmq::Socket, keep: usize) -> Result<Option<Received>, zmq::Error> {
    let mut first = zmq::Message::new();
    match socket.recv(&mut first, zmq::DONTWAIT) {
        Ok(()) => {}
        Err(zmq::Error::EAGAIN) => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut more = first.get_more();
    let mut received = Received {
        frames: vec![first],
        total: 1,
    };
    while more {
        // The rest of a multipart message is there already.
        let mut part = zmq::Message::new();
        socket.recv(&mut part, 0)?;
        more = part.get_more();
        received.total += 1;
        if received.frames.len() < keep {
            received.frames.push(part);
        }
    }
    Ok(Some(received))
}

/// Where a batch stands against the expected sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The expected one.
    Next,
    /// Already seen (within [`DUPLICATE_WINDOW`] below).
    Duplicate,
    /// The sequence went back to 0 or further back than the window: the publisher restarted.
    Restart,
    /// Batches `from..to` were skipped.
    Gap { from: u64, to: u64 },
}

fn classify(expected: u64, seq: u64) -> Step {
    if seq == expected {
        Step::Next
    } else if seq > expected {
        Step::Gap {
            from: expected,
            to: seq,
        }
    } else if seq == 0 || expected - seq > DUPLICATE_WINDOW {
        Step::Restart
    } else {
        Step::Duplicate
    }
}

/// How a lost connection changes a message's step: below the expected number after a
/// reconnection is a restart (a publisher does not send again what a lost connection missed);
/// the new connection's first message, if not a restart, resumes the link (the `bool`).
fn settle(loss: Loss, step: Step) -> (Step, bool) {
    let below = matches!(step, Step::Duplicate | Step::Restart);
    match loss {
        Loss::None | Loss::Lost => (step, false),
        Loss::Reconnected if below => (Step::Restart, false),
        Loss::Reconnected => (step, false),
        Loss::Drained if below => (Step::Restart, false),
        Loss::Drained => (step, true),
    }
}

/// What a replay brought next.
enum ReplayItem {
    Batch(u64, zmq::Message),
    End,
    TimedOut,
    Failed,
    Stopped,
}

/// A replay request in flight: a DEALER with the subscriber's size bound.
struct ReplayStream {
    dealer: zmq::Socket,
    deadline: Instant,
    shared: Arc<Shared>,
}

impl Drop for ReplayStream {
    fn drop(&mut self) {
        let _ = self.shared.stats.sockets_open.fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |v| Some(v.saturating_sub(1)),
        );
    }
}

impl ReplayStream {
    fn open(
        shared: &Arc<Shared>,
        ctx: &zmq::Context,
        endpoint: &str,
        start_seq: u64,
    ) -> Result<Self, zmq::Error> {
        let dealer = ctx.socket(zmq::DEALER)?;
        bump(&shared.stats.sockets_open);
        let stream = Self {
            dealer,
            deadline: Instant::now() + shared.options.replay_timeout,
            shared: shared.clone(),
        };
        let dealer = &stream.dealer;
        dealer.set_linger(0)?;
        dealer.set_maxmsgsize(shared.options.zmq_max_message_bytes())?;
        dealer.connect(endpoint)?;
        let request: [&[u8]; 2] = [b"", &start_seq.to_be_bytes()];
        // Queued until connected; the deadline covers the wait.
        dealer.send_multipart(request, zmq::DONTWAIT)?;
        Ok(stream)
    }

    /// The next batch, the end, or why there is none; keeps the worker's monitor read and its
    /// stop flag honoured while it waits.
    fn next(&mut self, f: &Follower) -> ReplayItem {
        loop {
            if f.stopping() {
                return ReplayItem::Stopped;
            }
            match recv_frames(&self.dealer, 4) {
                Ok(Some(msg)) => {
                    // [b"", topic, seq, payload]
                    let seq = match msg.frames.get(2) {
                        Some(seq) if msg.total == 4 => <[u8; 8]>::try_from(&seq[..]).ok(),
                        _ => None,
                    };
                    let Some(seq) = seq.map(u64::from_be_bytes) else {
                        bump(&f.shared.stats.malformed);
                        continue;
                    };
                    if seq == REPLAY_END_SEQ {
                        return ReplayItem::End;
                    }
                    let payload = msg.frames.into_iter().nth(3).expect("4 frames");
                    return ReplayItem::Batch(seq, payload);
                }
                Ok(None) => {}
                Err(_) => return ReplayItem::Failed,
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return ReplayItem::TimedOut;
            }
            let wait = left.min(STOP_POLL).as_millis().max(1) as i64;
            let monitor_ready = {
                let mut items = vec![self.dealer.as_poll_item(zmq::POLLIN), f.wake_item()];
                if let Some(m) = &f.conn.monitor {
                    items.push(m.as_poll_item(zmq::POLLIN));
                }
                if zmq::poll(&mut items, wait).is_err() {
                    continue;
                }
                items.get(2).is_some_and(zmq::PollItem::is_readable)
            };
            if monitor_ready {
                f.read_monitor();
            }
        }
    }
}

/// One worker's thread: follows its SUB socket, replays its gaps, reports to the sink.
struct Follower {
    key: (u64, u32),
    endpoint: WorkerEndpoint,
    /// Declared before `lease`: the sockets go before the share of their context.
    conn: Conn,
    lease: ContextLease,
    /// Readable when the thread is to stop.
    wake: UnixStream,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    link: Arc<Mutex<LinkStatus>>,
    /// The sequence number expected next.
    expected: u64,
    /// False once the sink's receiver is gone (the thread then ends).
    sink_open: bool,
    /// When to re-create the SUB socket, if the connection was lost and ZMQ has not (yet) said
    /// that it retries.
    resubscribe_at: Cell<Option<Instant>>,
    /// Where the worker stands after a lost connection.
    loss: Cell<Loss>,
    /// A lost connection not reported yet as [`SubscriberEvent::LinkLost`].
    loss_unreported: Cell<bool>,
    /// Whether the connection ZMQ last lost failed in its handshake (rather than being dropped
    /// afterwards, which ZMQ does without retrying only on a protocol error: a frame over
    /// `ZMQ_MAXMSGSIZE`).
    handshake_failed: Cell<bool>,
}

/// A worker's connection history as far as its sequence is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loss {
    /// Nothing lost since the last message.
    None,
    /// The connection was lost and is not made again yet (messages still queued are the old
    /// connection's).
    Lost,
    /// Connected again, but messages of the old connection may still be queued ahead of the
    /// new one's: a message below the expected number is a restart; one above it settles
    /// nothing.
    Reconnected,
    /// Connected again and the socket's queue seen empty since: the next message is the new
    /// connection's first, and says whether the worker restarted.
    Drained,
}

impl Follower {
    fn run(mut self, start_seq: u64, ready: &Sender<()>) {
        if let Some(replay) = self.endpoint.replay.clone() {
            self.initial_sync(&replay, start_seq);
        }
        let _ = ready.send(());
        while !self.stopping() {
            let (sub_ready, monitor_ready) = {
                let mut items = vec![self.conn.sub.as_poll_item(zmq::POLLIN), self.wake_item()];
                if let Some(m) = &self.conn.monitor {
                    items.push(m.as_poll_item(zmq::POLLIN));
                }
                if zmq::poll(&mut items, STOP_POLL.as_millis() as i64).is_err() {
                    continue;
                }
                (
                    items[0].is_readable(),
                    items.get(2).is_some_and(zmq::PollItem::is_readable),
                )
            };
            if monitor_ready {
                self.read_monitor();
            }
            self.report_loss();
            if self
                .resubscribe_at
                .get()
                .is_some_and(|at| Instant::now() >= at)
            {
                self.resubscribe();
                continue;
            }
            // Just reconnected: reads on, to see whether the old connection left anything
            // queued (the new connection's first message is known only once it did not).
            if sub_ready || self.loss.get() == Loss::Reconnected {
                for _ in 0..RECV_BURST {
                    if self.stopping() {
                        break;
                    }
                    match recv_frames(&self.conn.sub, 3) {
                        Ok(Some(msg)) => self.receive(msg),
                        Ok(None) => {
                            // Known reconnected before this read: what the old connection
                            // left queued is all read.
                            if self.loss.get() == Loss::Reconnected {
                                self.loss.set(Loss::Drained);
                            }
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
        }
    }

    fn stopping(&self) -> bool {
        !self.sink_open || self.stop.load(Ordering::Relaxed)
    }

    /// Reports a lost connection not reported yet.
    fn report_loss(&mut self) {
        if self.loss_unreported.replace(false) {
            let worker = self.key;
            self.emit(SubscriberEvent::LinkLost { worker });
        }
    }

    /// The wake-up socket, to poll with the ZMQ sockets.
    fn wake_item(&self) -> zmq::PollItem<'static> {
        zmq::PollItem::from_fd(self.wake.as_raw_fd(), zmq::POLLIN)
    }

    /// A new SUB socket (and monitor) in place of one ZMQ gave up on.
    fn resubscribe(&mut self) {
        if !self.handshake_failed.get() {
            // ZMQ dropped an established connection without retrying it: a protocol error,
            // which a well-formed publisher causes only with a frame over ZMQ_MAXMSGSIZE.
            bump(&self.shared.stats.oversized);
        }
        self.handshake_failed.set(false);
        match connect(&self.shared, &self.lease.ctx, &self.endpoint) {
            Ok(conn) => {
                // The old sockets (and their monitor) are freed as `conn` replaces them.
                self.conn = conn;
                self.resubscribe_at.set(None);
                self.link.lock().resubscribes += 1;
            }
            Err(_) => self
                .resubscribe_at
                .set(Some(Instant::now() + RESUBSCRIBE_DELAY)),
        }
    }

    /// Applies what the socket monitor reported to the link.
    fn read_monitor(&self) {
        let Some(monitor) = &self.conn.monitor else {
            return;
        };
        let connected = zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw();
        let retried = zmq::SocketEvent::CONNECT_RETRIED.to_raw();
        // ZMQ is (re)connecting by itself.
        let trying = [
            retried,
            connected,
            zmq::SocketEvent::CONNECT_DELAYED.to_raw(),
            zmq::SocketEvent::CONNECTED.to_raw(),
        ];
        let lost = [
            zmq::SocketEvent::DISCONNECTED.to_raw(),
            zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL.to_raw(),
            zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL.to_raw(),
            zmq::SocketEvent::HANDSHAKE_FAILED_AUTH.to_raw(),
        ];
        // [event u16 LE, value u32 LE], endpoint.
        while let Ok(Some(msg)) = recv_frames(monitor, 1) {
            let Some(event) = msg.frames[0].get(..2) else {
                continue;
            };
            let event = u16::from_le_bytes([event[0], event[1]]);
            if trying.contains(&event) {
                self.resubscribe_at.set(None);
                self.handshake_failed.set(false);
            } else if lost.contains(&event) {
                self.resubscribe_at
                    .set(Some(Instant::now() + RESUBSCRIBE_DELAY));
                if event != lost[0] {
                    self.handshake_failed.set(true);
                }
            }
            if event == lost[0] && !self.handshake_failed.get() {
                // An established connection is gone: until a message over a new one says
                // otherwise, the worker may have restarted.
                self.loss.set(Loss::Lost);
                self.loss_unreported.set(true);
            } else if event == connected && self.loss.get() == Loss::Lost {
                self.loss.set(Loss::Reconnected);
            }
            let mut link = self.link.lock();
            if event == connected {
                link.connects += 1;
                link.set_state(LinkState::Connected);
            } else if event == retried {
                link.connect_retries += 1;
                link.set_state(LinkState::Retrying);
            } else if lost.contains(&event) {
                if event == lost[0] {
                    link.disconnects += 1;
                }
                link.set_state(LinkState::Retrying);
            }
        }
    }

    /// Asks the replay socket for its batches from `from` on; None (counted) when it cannot.
    fn open_replay(&self, replay: &str, from: u64) -> Option<ReplayStream> {
        bump(&self.shared.stats.replay_requests);
        let stream = ReplayStream::open(&self.shared, &self.lease.ctx, replay, from).ok();
        if stream.is_none() {
            bump(&self.shared.stats.replay_failures);
        }
        stream
    }

    /// Reports the replayed batches from `next` on (before `to`, if given), as they arrive, each
    /// hole before one as an unfilled gap. With `advance`, the live stream's expectation follows
    /// each batch. Returns the first sequence number not reported and whether there were holes;
    /// None when the subscriber is stopping.
    fn replay_batches(
        &mut self,
        stream: &mut ReplayStream,
        mut next: u64,
        to: Option<u64>,
        advance: bool,
    ) -> Option<(u64, bool)> {
        let mut holes = false;
        while to.is_none_or(|to| next < to) {
            match stream.next(self) {
                ReplayItem::Batch(seq, payload) => {
                    if seq < next {
                        continue;
                    }
                    if to.is_some_and(|to| seq >= to) {
                        // The live stream has the rest.
                        break;
                    }
                    if seq > next {
                        self.unfilled(next, seq);
                        holes = true;
                    }
                    next = seq.saturating_add(1);
                    if advance {
                        self.expected = next;
                        self.link.lock().next_seq = next;
                    }
                    self.report(seq, &payload);
                }
                ReplayItem::End => break,
                ReplayItem::TimedOut => {
                    bump(&self.shared.stats.replay_timeouts);
                    break;
                }
                ReplayItem::Failed => {
                    bump(&self.shared.stats.replay_failures);
                    break;
                }
                ReplayItem::Stopped => return None,
            }
        }
        Some((next, holes))
    }

    /// Reports what the replay socket still buffers from `start_seq` on, as it arrives.
    fn initial_sync(&mut self, replay: &str, start_seq: u64) {
        if let Some(mut stream) = self.open_replay(replay, start_seq) {
            self.replay_batches(&mut stream, start_seq, None, true);
        }
    }

    /// Batches `from..to` are missing: reports what the replay socket has of them as it arrives,
    /// each hole as an unfilled gap, and, if there was none, the gap as filled.
    fn fill_gap(&mut self, from: u64, to: u64) {
        let Some(replay) = self.endpoint.replay.clone() else {
            self.unfilled(from, to);
            return;
        };
        let Some(mut stream) = self.open_replay(&replay, from) else {
            self.unfilled(from, to);
            return;
        };
        let Some((next, mut holes)) = self.replay_batches(&mut stream, from, Some(to), false)
        else {
            return;
        };
        if next < to {
            self.unfilled(next, to);
            holes = true;
        }
        if !holes {
            bump(&self.shared.stats.gaps_filled);
            self.emit(SubscriberEvent::Gap {
                worker: self.key,
                from,
                to,
                filled: true,
            });
        }
    }

    fn unfilled(&mut self, from: u64, to: u64) {
        bump(&self.shared.stats.gaps_unfilled);
        self.emit(SubscriberEvent::Gap {
            worker: self.key,
            from,
            to,
            filled: false,
        });
    }

    /// Handles one message from the worker's PUB socket.
    fn receive(&mut self, msg: Received) {
        let worker = self.key;
        // [topic, seq, payload]; anything else is reported as undecodable.
        let seq = match msg.frames.get(1) {
            Some(seq) if msg.total == 3 => <[u8; 8]>::try_from(&seq[..]).ok(),
            _ => None,
        };
        let Some(seq) = seq.map(u64::from_be_bytes) else {
            bump(&self.shared.stats.malformed);
            self.note_message();
            let error = DecodeError::Shape(format!(
                "{} frames, expected [topic, seq (8 bytes), payload]",
                msg.total
            ));
            self.emit(SubscriberEvent::Undecodable {
                worker,
                seq: 0,
                error,
            });
            return;
        };
        let step = classify(self.expected, seq);
        if step != Step::Next || self.loss.get() != Loss::None {
            // The monitor (read without waiting) says whether the connection was lost or made
            // again, before anything out of sequence is judged.
            self.read_monitor();
            self.report_loss();
        }
        let (step, resumed) = settle(self.loss.get(), step);
        // A message of the new connection: nothing of the old one is left before it.
        if (resumed || step == Step::Restart) && self.loss.get() != Loss::Lost {
            self.loss.set(Loss::None);
        }
        if resumed {
            self.emit(SubscriberEvent::LinkResumed { worker });
        }
        match step {
            Step::Next => {}
            Step::Duplicate => {
                bump(&self.shared.stats.duplicates);
                self.note_message();
                return;
            }
            Step::Restart => {
                bump(&self.shared.stats.restarts);
                self.emit(SubscriberEvent::Restart { worker });
                // The new incarnation's batches before this one were not seen.
                if seq > 0 {
                    self.fill_gap(0, seq);
                }
            }
            Step::Gap { from, to } => self.fill_gap(from, to),
        }
        self.expected = seq.saturating_add(1);
        // The link first: whoever sees the batch sees the link that brought it.
        self.note_message();
        self.report(seq, &msg.frames[2]);
    }

    /// A message arrived: the link is up, and when.
    fn note_message(&self) {
        let mut link = self.link.lock();
        link.last_message = Some(SystemTime::now());
        link.next_seq = self.expected;
        if link.state != LinkState::Connected {
            link.set_state(LinkState::Connected);
        }
    }

    /// Reports a payload: decoded, or why not (without decoding it if it is over the limit).
    fn report(&mut self, seq: u64, payload: &[u8]) {
        let worker = self.key;
        let stats = &self.shared.stats;
        let max = self.shared.options.max_message_bytes;
        let event = if payload.len() > max {
            bump(&stats.oversized);
            SubscriberEvent::Undecodable {
                worker,
                seq,
                error: DecodeError::TooLarge {
                    bytes: payload.len(),
                    max,
                },
            }
        } else {
            match decode_batch(payload) {
                Ok(batch) => {
                    bump(&stats.batches);
                    SubscriberEvent::Batch { worker, seq, batch }
                }
                Err(error) => {
                    bump(&stats.undecodable);
                    SubscriberEvent::Undecodable { worker, seq, error }
                }
            }
        };
        self.emit(event);
    }

    /// Sends to the sink; while it is full, waits (counted), looking at the stop flag.
    fn emit(&mut self, event: SubscriberEvent) {
        if self.stopping() {
            return;
        }
        let mut event = match self.shared.sink.try_send(event) {
            Ok(()) => return,
            Err(TrySendError::Disconnected(_)) => {
                self.sink_open = false;
                return;
            }
            Err(TrySendError::Full(event)) => event,
        };
        bump(&self.shared.stats.sink_waits);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            match self.shared.sink.send_timeout(event, STOP_POLL) {
                Ok(()) => return,
                Err(SendTimeoutError::Timeout(back)) => event = back,
                Err(SendTimeoutError::Disconnected(_)) => {
                    self.sink_open = false;
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a lost connection: below the expected number is a restart once reconnected, queue
    /// drained or not; only the first message after the drain resumes the link; queued ones of
    /// the old connection (before the reconnection, or before the drain) settle nothing.
    #[test]
    fn a_lost_connection_settles_only_on_the_new_connections_first_message() {
        let gap = Step::Gap { from: 3, to: 7 };
        for loss in [Loss::None, Loss::Lost] {
            assert_eq!(settle(loss, Step::Next), (Step::Next, false));
            assert_eq!(settle(loss, Step::Duplicate), (Step::Duplicate, false));
            assert_eq!(settle(loss, gap), (gap, false));
        }
        assert_eq!(settle(Loss::Reconnected, Step::Next), (Step::Next, false));
        assert_eq!(settle(Loss::Reconnected, gap), (gap, false));
        assert_eq!(
            settle(Loss::Reconnected, Step::Duplicate),
            (Step::Restart, false)
        );
        assert_eq!(settle(Loss::Drained, Step::Next), (Step::Next, true));
        assert_eq!(settle(Loss::Drained, gap), (gap, true));
        assert_eq!(
            settle(Loss::Drained, Step::Duplicate),
            (Step::Restart, false)
        );
        assert_eq!(settle(Loss::Drained, Step::Restart), (Step::Restart, false));
    }
}
