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
//! - The subscriber reports, per worker, every batch, gap (filled by replay or not), restart
//!   (sequence back to 0) and undecodable payload; it never panics on what it receives.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::Sender;

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

impl ZmqPublisher {
    /// Binds the sockets and starts publishing what `bus` publishes from now on.
    pub fn start(bus: &EventPublisher, config: PublisherConfig) -> Result<Self, TransportError> {
        let ctx = zmq::Context::new();
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
    /// The worker's sequence went back to 0: it restarted, its earlier state is gone.
    Restart {
        /// Worker id and dp rank.
        worker: (u64, u32),
    },
}

/// Subscribes to many workers on one thread until dropped, reporting to a channel. Workers can
/// be added and removed while it runs.
///
/// A worker added with a replay endpoint is first synchronised from it: the subscriber asks for
/// every buffered batch from sequence 0, reports them, and then follows the live stream from
/// there (batches it already reported are skipped). If the buffer no longer starts at 0, the
/// batches before it are reported as an unfilled gap.
pub struct ZmqSubscriber {
    stop: Arc<AtomicBool>,
    commands: crossbeam_channel::Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ZmqSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqSubscriber").finish_non_exhaustive()
    }
}

/// Time to wait for a replay before reporting the gap unfilled.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

enum Command {
    Add(
        WorkerEndpoint,
        crossbeam_channel::Sender<Result<(), TransportError>>,
    ),
    Remove((u64, u32)),
}

/// One subscribed worker.
struct Subscribed {
    endpoint: WorkerEndpoint,
    socket: zmq::Socket,
    /// The next sequence number expected; `None` before the first batch.
    next_seq: Option<u64>,
}

/// Worker additions and removals queued for the subscriber thread at most (callers wait).
pub const SUBSCRIBER_COMMANDS_MAX: usize = 256;

impl ZmqSubscriber {
    /// Connects to every worker and starts reporting to `sink`.
    pub fn start(
        workers: Vec<WorkerEndpoint>,
        sink: Sender<SubscriberEvent>,
    ) -> Result<Self, TransportError> {
        let (commands, command_rx) = crossbeam_channel::bounded(SUBSCRIBER_COMMANDS_MAX);
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvbm-zmq-sub".into())
            .spawn(move || subscribe_loop(&command_rx, &sink, &thread_stop))
            .map_err(|e| TransportError::Zmq {
                call: "spawn",
                endpoint: String::new(),
                error: e.to_string(),
            })?;
        let subscriber = Self {
            stop,
            commands,
            thread: Some(thread),
        };
        for w in workers {
            subscriber.add(w)?;
        }
        Ok(subscriber)
    }

    /// Subscribes to one more worker (replacing any subscription of the same id and rank); returns
    /// once its socket is connected and its initial replay, if any, was reported.
    pub fn add(&self, worker: WorkerEndpoint) -> Result<(), TransportError> {
        let (reply, answer) = crossbeam_channel::bounded(1);
        let gone = || TransportError::Zmq {
            call: "add",
            endpoint: worker.endpoint.clone(),
            error: "the subscriber thread has stopped".into(),
        };
        self.commands
            .send(Command::Add(worker.clone(), reply))
            .map_err(|_| gone())?;
        answer.recv().map_err(|_| gone())?
    }

    /// Stops following a worker (its later batches are not reported).
    pub fn remove(&self, worker: (u64, u32)) {
        let _ = self.commands.send(Command::Remove(worker));
    }
}

impl Drop for ZmqSubscriber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn connect(ctx: &zmq::Context, w: &WorkerEndpoint) -> Result<zmq::Socket, TransportError> {
    let socket = ctx
        .socket(zmq::SUB)
        .map_err(|e| zmq_err("socket", &w.endpoint, e))?;
    socket
        .set_linger(0)
        .map_err(|e| zmq_err("linger", &w.endpoint, e))?;
    socket
        .set_subscribe(b"")
        .map_err(|e| zmq_err("subscribe", &w.endpoint, e))?;
    socket
        .connect(&w.endpoint)
        .map_err(|e| zmq_err("connect", &w.endpoint, e))?;
    Ok(socket)
}

fn subscribe_loop(
    commands: &crossbeam_channel::Receiver<Command>,
    sink: &Sender<SubscriberEvent>,
    stop: &AtomicBool,
) {
    let ctx = zmq::Context::new();
    let mut workers: Vec<Subscribed> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        while let Ok(command) = commands.try_recv() {
            match command {
                Command::Add(endpoint, reply) => {
                    let key = (endpoint.worker_id, endpoint.dp_rank);
                    workers.retain(|w| (w.endpoint.worker_id, w.endpoint.dp_rank) != key);
                    match connect(&ctx, &endpoint) {
                        Ok(socket) => {
                            let mut w = Subscribed {
                                endpoint,
                                socket,
                                next_seq: None,
                            };
                            initial_sync(&ctx, &mut w, sink);
                            workers.push(w);
                            let _ = reply.send(Ok(()));
                        }
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                Command::Remove(key) => {
                    workers.retain(|w| (w.endpoint.worker_id, w.endpoint.dp_rank) != key);
                }
            }
        }
        if workers.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let mut items: Vec<zmq::PollItem> = workers
            .iter()
            .map(|w| w.socket.as_poll_item(zmq::POLLIN))
            .collect();
        if zmq::poll(&mut items, 20).unwrap_or(0) == 0 {
            continue;
        }
        let ready: Vec<usize> = items
            .iter()
            .enumerate()
            .filter(|(_, i)| i.is_readable())
            .map(|(k, _)| k)
            .collect();
        drop(items);
        for k in ready {
            while let Ok(frames) = workers[k].socket.recv_multipart(zmq::DONTWAIT) {
                receive(&ctx, &mut workers[k], &frames, sink);
            }
        }
    }
}

/// Reports what a new worker's replay socket still buffers, from sequence 0.
fn initial_sync(ctx: &zmq::Context, w: &mut Subscribed, sink: &Sender<SubscriberEvent>) {
    let Some(replay) = w.endpoint.replay.clone() else {
        return;
    };
    let worker = (w.endpoint.worker_id, w.endpoint.dp_rank);
    let Ok(batches) = request_replay(ctx, &replay, 0, REPLAY_TIMEOUT) else {
        return;
    };
    let Some(&(first, _)) = batches.first() else {
        return;
    };
    if first > 0 {
        let _ = sink.send(SubscriberEvent::Gap {
            worker,
            from: 0,
            to: first,
            filled: false,
        });
    }
    let mut next = first;
    for (seq, payload) in &batches {
        if *seq < next {
            continue;
        }
        if *seq > next {
            let _ = sink.send(SubscriberEvent::Gap {
                worker,
                from: next,
                to: *seq,
                filled: false,
            });
        }
        report(sink, worker, *seq, payload);
        next = seq + 1;
    }
    w.next_seq = Some(next);
}

/// Handles one message from a worker's PUB socket.
fn receive(
    ctx: &zmq::Context,
    w: &mut Subscribed,
    frames: &[Vec<u8>],
    sink: &Sender<SubscriberEvent>,
) {
    let worker = (w.endpoint.worker_id, w.endpoint.dp_rank);
    // [topic, seq, payload]; anything else is counted as undecodable.
    let (seq, payload) = match frames {
        [_, seq, payload] if seq.len() == 8 => (
            u64::from_be_bytes(seq.as_slice().try_into().expect("8 bytes")),
            payload,
        ),
        _ => {
            let error = DecodeError::Shape(format!(
                "{} frames, expected [topic, seq, payload]",
                frames.len()
            ));
            let _ = sink.send(SubscriberEvent::Undecodable {
                worker,
                seq: 0,
                error,
            });
            return;
        }
    };
    match w.next_seq {
        // The first batch seen, not the first sent: what came before is unknown here.
        None if seq > 0 => {
            let _ = sink.send(SubscriberEvent::Gap {
                worker,
                from: 0,
                to: seq,
                filled: false,
            });
        }
        Some(expected) if seq == 0 && expected > 0 => {
            let _ = sink.send(SubscriberEvent::Restart { worker });
        }
        Some(expected) if seq < expected => return, // a duplicate
        Some(expected) if seq > expected => {
            let filled = match &w.endpoint.replay {
                Some(replay) => match request_replay(ctx, replay, expected, REPLAY_TIMEOUT) {
                    Ok(batches) => {
                        let wanted: Vec<_> = batches
                            .into_iter()
                            .filter(|(s, _)| (expected..seq).contains(s))
                            .collect();
                        let complete = wanted.len() as u64 == seq - expected;
                        if complete {
                            for (s, p) in &wanted {
                                report(sink, worker, *s, p);
                            }
                        }
                        complete
                    }
                    Err(_) => false,
                },
                None => false,
            };
            let _ = sink.send(SubscriberEvent::Gap {
                worker,
                from: expected,
                to: seq,
                filled,
            });
        }
        _ => {}
    }
    w.next_seq = Some(seq + 1);
    report(sink, worker, seq, payload);
}

fn report(sink: &Sender<SubscriberEvent>, worker: (u64, u32), seq: u64, payload: &[u8]) {
    let event = match decode_batch(payload) {
        Ok(batch) => SubscriberEvent::Batch { worker, seq, batch },
        Err(error) => SubscriberEvent::Undecodable { worker, seq, error },
    };
    let _ = sink.send(event);
}
