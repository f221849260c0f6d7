//! The router's state: the index fed by the workers' event streams, the load of routed requests,
//! and the registered workers; queries and routing decisions over them.
//!
//! Threads: the ZMQ subscriber (kvbm-events) receives and decodes; one pump thread applies what it
//! reports to the index (the only writer); HTTP handlers read the index under a read lock.
//!
//! Invariants:
//! - Only registered workers are indexed: events still in flight from an unregistered worker are
//!   counted (`unregistered_worker`) and dropped.
//! - An engine restart (sequence back to 0) drops everything the index held for that worker
//!   before the new stream is applied.
//! - A gap that replay could not fill leaves the worker's state as it was (stale stores and
//!   removals may be missing) and marks it `resync_needed` in `/workers`, until it restarts.
//! - A lost event link suspends the worker's claims (`claims_suspended` in `/workers`): its
//!   indexed blocks count as no overlap in queries and routing, and its predictions are
//!   forgotten, until the first batch over the new connection shows a continuation of its
//!   sequence (`LinkResumed`: claims restored) or a restart (blocks dropped); batches the lost
//!   connection left queued settle nothing. A process restarted on the same endpoint is thus never credited
//!   with its predecessor's blocks, whether or not the link was seen down for long.
//! - Registrations hold no ZMQ socket or file descriptor beyond their lifetime; `--max-workers`
//!   is lowered at start (logged) when the open-files limit, raised to its hard limit if need
//!   be, cannot hold that many workers.
//! - Events speak engine hashes; the index translates them to block identities from the tokens
//!   (see `kvbm_events::router::translate`), so vLLM's, SGLang's and kvbm's workers all match
//!   the router's hash of a request.
//! - With `--router-predicted-ttl-secs`, a routing decision predicts the request's blocks on
//!   the chosen worker's GPU until the time-to-live passes or the worker's own store of the block
//!   is applied; restarts, clears and unregistering forget a worker's predictions.
//! - Bounded by flags: workers registered, routed requests tracked (beyond it a request is
//!   routed untracked, counted), request id length, predictions.
//! - Every routing mode (`--router-mode`) goes through [`Router::route_among`]: eligibility,
//!   cool-down, load tracking, predictions and metrics are the same whatever picks the worker.
//!   The tuned cost's learner is fed in every mode (its evidence shows in GET /debug/cost before
//!   an operator switches to it); it is used only in `tuned`, once warm.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use kvbm_events::router::{
    select_mode, with_prediction, Candidate, KvIndex, LoadTracker, Overlap, Predictions,
    RecentWork, RoundRobin, RouteFeatures, RouterMode, Tuner, WorkerKey, WorkerLoad,
    PREDICTIONS_MAX_DEFAULT,
};
use kvbm_events::{
    BlockHasher, LinkState, LinkStatus, SubscriberEvent, Tier, TransportError, WireEvent,
    WorkerEndpoint, ZmqSubscriber,
};
use parking_lot::{Mutex, RwLock};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use crate::config::{RouterConfig, WorkerSpec};
use crate::dump::{Dump, DumpWorker};
use crate::metrics::RouterMetrics;

/// Threads subscribing to the workers of a sibling's dump at start, at most.
pub const RESTORE_THREADS: usize = 32;

/// Subscriber reports (event batches, gaps, restarts) queued for the pump at most.
pub const ROUTER_EVENT_QUEUE_MAX: usize = 1 << 16;

/// File descriptors one registered worker may take at most: its ZMQ sockets' mailboxes and TCP
/// connection, a replay's, its thread's wake-up pair, and the front end's HTTP connections to
/// it (with room to spare).
pub const FDS_PER_WORKER: u64 = 16;
/// File descriptors kept for everything but workers and HTTP clients (runtime, ZMQ contexts,
/// listener, logs, files read).
pub const FDS_RESERVED: u64 = 256;

/// The open-files limit (soft, hard); None where it cannot be read.
fn open_files_limit() -> Option<(u64, u64)> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).ok()
}

/// Raises the open-files limit (soft, up to hard) to what `--max-workers` workers and
/// `--max-connections` HTTP connections need, and returns the workers that fit in the limit then
/// (`max_workers`, or fewer, logged with the flag named) and the limit.
pub fn fit_open_files(max_workers: usize, max_connections: usize) -> (usize, Option<u64>) {
    let needed = FDS_RESERVED
        .saturating_add(max_connections as u64)
        .saturating_add((max_workers as u64).saturating_mul(FDS_PER_WORKER));
    let Some((soft, hard)) = open_files_limit() else {
        return (max_workers, None);
    };
    let mut limit = soft;
    if soft < needed {
        let target = needed.min(hard);
        if nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, target, hard)
            .is_ok()
        {
            tracing::info!(
                from = soft,
                to = target,
                "open-files limit (RLIMIT_NOFILE) raised for --max-workers and --max-connections"
            );
            limit = target;
        }
    }
    if limit >= needed {
        return (max_workers, Some(limit));
    }
    let room = limit.saturating_sub(FDS_RESERVED + max_connections as u64) / FDS_PER_WORKER;
    let fit = usize::try_from(room)
        .unwrap_or(usize::MAX)
        .clamp(1, max_workers);
    tracing::warn!(
        "--max-workers={max_workers} lowered to {fit}: the open-files limit (RLIMIT_NOFILE) is \
         {limit} (hard limit {hard}), and each worker may take {FDS_PER_WORKER} files besides \
         {FDS_RESERVED} reserved and --max-connections={max_connections}; raise the limit \
         (ulimit -n) or lower --max-workers"
    );
    (fit, Some(limit))
}

/// What is known of one registered worker.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerInfo {
    /// Worker id.
    pub worker_id: u64,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Its KV events endpoint.
    pub endpoint: String,
    /// Its replay endpoint.
    pub replay_endpoint: Option<String>,
    /// Its OpenAI-compatible HTTP server, if requests are forwarded to it.
    pub http_url: Option<String>,
    /// Seconds it is still left out of routing after a failed request (0 when it is not).
    pub cooldown_secs: f64,
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// Batches applied.
    pub batches: u64,
    /// Events applied (all statuses).
    pub events: u64,
    /// Gaps replay could not fill since the last restart.
    pub unfilled_gaps: u64,
    /// True after an unfilled gap: the index may miss some of this worker's changes.
    pub resync_needed: bool,
    /// True from a lost event link until the worker's next batch says whether it restarted:
    /// meanwhile its indexed blocks count as no overlap (it is still routed to by load).
    pub claims_suspended: bool,
}

/// A worker's share of a request's prefix, in blocks and tokens, tier by tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TierOverlap {
    /// Blocks of the contiguous prefix on the GPU.
    pub gpu_blocks: usize,
    /// Blocks continuing it in pinned host memory.
    pub host_blocks: usize,
    /// Blocks continuing it on disk.
    pub disk_blocks: usize,
    /// Blocks continuing it in a shared pool the worker reaches.
    pub shared_blocks: usize,
    /// `gpu_blocks` in tokens.
    pub gpu_tokens: usize,
    /// `host_blocks` in tokens.
    pub host_tokens: usize,
    /// `disk_blocks` in tokens.
    pub disk_tokens: usize,
    /// `shared_blocks` in tokens.
    pub shared_tokens: usize,
}

impl TierOverlap {
    fn new(o: Overlap, block_size: usize) -> Self {
        Self {
            gpu_blocks: o.gpu,
            host_blocks: o.host,
            disk_blocks: o.disk,
            shared_blocks: o.shared,
            gpu_tokens: o.gpu * block_size,
            host_tokens: o.host * block_size,
            disk_tokens: o.disk * block_size,
            shared_tokens: o.shared * block_size,
        }
    }
}

/// One worker in a query's answer.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerOverlap {
    /// Worker id.
    pub worker_id: u64,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Its overlap.
    pub overlap: TierOverlap,
}

/// The answer to a query.
#[derive(Debug, Clone, Serialize)]
pub struct QueryAnswer {
    /// Full blocks in the request.
    pub request_blocks: usize,
    /// Every registered worker, best GPU overlap first.
    pub workers: Vec<WorkerOverlap>,
}

/// A worker's cost in a routing decision.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerCost {
    /// Worker id.
    pub worker_id: u64,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Its cost (lower is better).
    pub cost: f64,
}

/// The answer to a route.
#[derive(Debug, Clone, Serialize)]
pub struct RouteAnswer {
    /// The request's id (the caller's, or one made up), for reporting its progress.
    pub request_id: String,
    /// The chosen worker.
    pub worker_id: u64,
    /// Its data-parallel rank.
    pub dp_rank: u32,
    /// Its overlap with the request.
    pub overlap: TierOverlap,
    /// Its cost.
    pub cost: f64,
    /// The other workers' costs, lowest first.
    pub runner_ups: Vec<WorkerCost>,
    /// Full blocks in the request.
    pub request_blocks: usize,
    /// The routing mode that chose.
    pub mode: &'static str,
    /// What the decision knew of the request and its worker (for the tuned cost's learning).
    #[serde(skip)]
    pub features: RouteFeatures,
    /// When it was decided.
    #[serde(skip)]
    pub routed_at: Option<Instant>,
}

/// What a request is about: its tokens and what seeds their hashes.
#[derive(Debug, Clone, Default)]
pub struct RequestTokens<'a> {
    /// Prompt token ids: all of them, or its first ones when the front end stopped tokenizing
    /// where no worker's overlap could reach (see [`PrefixProbe`]).
    pub token_ids: &'a [u32],
    /// Tokens of the prompt past `token_ids`, estimated from their bytes (0 when it was all
    /// tokenized): they count in the request's length and load, never in an overlap.
    pub untokenized_tokens: usize,
    /// The LoRA adapter, if any.
    pub lora_name: Option<&'a str>,
    /// The cache salt (namespace), if any.
    pub cache_salt: Option<&'a str>,
}

/// Tells the front end when tokenizing a prompt further cannot change its overlap with any worker
/// ([`Router::prefix_probe`]).
#[derive(Debug)]
pub struct PrefixProbe<'r> {
    router: &'r Router,
    hasher: BlockHasher,
    hashes: Vec<u64>,
    parent: Option<kvbm_events::SequenceHash>,
}

impl PrefixProbe<'_> {
    /// Whether some worker holds (indexed in any tier, or predicted) every full block of `ids`,
    /// a prompt's first tokens, so that its overlap may go on past them. False when none does:
    /// overlaps are prefixes, so none can then reach further, and the rest of the prompt only
    /// adds to its length. Each call hashes only the blocks the last one did not see.
    pub fn holds_all(&mut self, ids: &[u32]) -> bool {
        self.hash(ids);
        let n = self.hashes.len();
        n == 0 || Self::any_holds(&self.router.overlaps(&self.hashes), n)
    }

    /// Hashes the full blocks of `ids` not hashed yet.
    fn hash(&mut self, ids: &[u32]) {
        let bs = self.hasher.block_size_tokens();
        let full = ids.len() / bs * bs;
        let seen = self.hashes.len() * bs;
        if full > seen {
            let new = self.hasher.sequence_hashes(self.parent, &ids[seen..full]);
            self.parent = new.last().copied().or(self.parent);
            self.hashes.extend(new.into_iter().map(|h| h.0));
        }
    }

    fn any_holds(overlaps: &[(WorkerKey, Overlap)], n: usize) -> bool {
        overlaps.iter().any(|(_, o)| o.gpu + o.host + o.disk >= n)
    }

    /// Whether tokenizing past `ids` could still change where the front end routes the prompt,
    /// when at most `rest_tokens` tokens follow them (the tokenizer's bound for the text not
    /// tokenized yet, [`crate::tokenize::ModelTokenizer::rest_tokens_max`]; `ids` only grow from
    /// one call to the next). False where [`Self::holds_all`] is. False too where a routing now
    /// would pick a worker that no growth of the overlaps can overtake ([`Router::sure_pick`]):
    /// only a worker holding every full block of `ids` can reach further (the others' overlaps
    /// are prefixes that stopped short), by at most the blocks of `rest_tokens`, and in the
    /// fixed-weight cost modes more overlap never raises a worker's cost. Two cases stop: exactly
    /// one worker holds every block and would be picked already (`sure_pick`: the rest can only
    /// add to its overlap), or the pick would stay the same even if each worker holding every
    /// block so far held the whole rest in its best tier (`holders_outweighed`: a holder too
    /// loaded to win with all of it, or one that cannot be routed to now). The full prompt goes
    /// to the same worker (given the loads now: requests routed before this one's routing may
    /// still change them). The untokenized rest then counts, as with `holds_all`, in the
    /// request's length and not in its overlap: the chosen worker's queued prefill is
    /// over-counted until its first token, never under.
    pub fn worth_more(&mut self, ids: &[u32], rest_tokens: usize) -> bool {
        self.hash(ids);
        let n = self.hashes.len();
        if n == 0 {
            return true;
        }
        let overlaps = self.router.overlaps(&self.hashes);
        let (answer, more) = if !Self::any_holds(&overlaps, n) {
            ("no_holder", false)
        } else {
            let mut holders: Vec<WorkerKey> = overlaps
                .iter()
                .filter(|(_, o)| o.gpu + o.host + o.disk + o.shared >= n)
                .map(|(k, _)| *k)
                .collect();
            holders.sort_unstable();
            // Blocks the rest can add to a holder's overlap: the tokens past the last full
            // block and the rest's, in whole blocks.
            let bs = self.hasher.block_size_tokens();
            let growth = ids.len().saturating_sub(n * bs).saturating_add(rest_tokens) / bs;
            match self
                .router
                .sure_pick(&overlaps, ids.len(), &holders, growth)
            {
                Pick::Sure(pick) if holders == [pick] => ("sure_pick", false),
                Pick::Sure(_) => ("holders_outweighed", false),
                Pick::Unsure(_) if holders.len() > 1 => ("several_holders", true),
                Pick::Unsure(Some(pick)) if pick != holders[0] => ("holder_not_picked", true),
                Pick::Unsure(_) => ("pick_uncertain", true),
            }
        };
        self.router
            .shared
            .metrics
            .frontend
            .probe_answers
            .with_label_values(&[answer])
            .inc();
        more
    }
}

/// What [`Router::sure_pick`] says of a routing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pick {
    /// This worker, whatever the rest of the prompt holds.
    Sure(WorkerKey),
    /// The pick now, if one worker costs least (else None), which the rest may change.
    Unsure(Option<WorkerKey>),
}

/// Why a routing call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No worker is registered.
    #[error("no worker is registered")]
    NoWorkers,
    /// Every registered worker's endpoint is down.
    #[error("no registered worker is reachable")]
    NoneReachable,
    /// No registered worker passes the caller's filter (none serves HTTP, or all were tried).
    #[error("no worker can take the request (none has an HTTP server, or all were tried)")]
    NoneEligible,
    /// The caller's request id is longer than `--max-request-id-bytes`.
    #[error("request_id of {len} bytes; at most {max} are accepted")]
    RequestIdTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Why a registration failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// `--max-workers` are registered already.
    #[error("{max} workers are registered, the most allowed (--max-workers)")]
    TooManyWorkers {
        /// The limit.
        max: usize,
    },
    /// Subscribing failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

struct Shared {
    config: RouterConfig,
    /// Whether a dump is being taken or sent (one at a time).
    dumping: Arc<std::sync::atomic::AtomicBool>,
    index: RwLock<KvIndex>,
    predictions: Mutex<Predictions>,
    load: Mutex<LoadTrack>,
    /// Each worker's recent work, the blocks it computed into its GPU cache (the balance term's
    /// input).
    work: Mutex<RecentWork>,
    workers: Mutex<BTreeMap<WorkerKey, WorkerInfo>>,
    /// Workers left out of routing until the instant, after a failed request.
    cooldown: Mutex<BTreeMap<WorkerKey, Instant>>,
    metrics: RouterMetrics,
    rng: Mutex<StdRng>,
    /// Round robin's place.
    round_robin: Mutex<RoundRobin>,
    /// The tuned cost's learner (fed in every mode; used in `tuned`).
    tuner: Mutex<Tuner>,
    /// Process CPU seconds as of the last scrape.
    cpu_seen: Mutex<f64>,
}

struct LoadTrack {
    tracker: LoadTracker,
    last_expiry: Instant,
}

/// What the pump is asked to do besides applying events (in order with the events, so that the
/// pump stays the index's one writer), then say so on `done`.
enum PumpRequest {
    /// Drop a worker's blocks and its pool memberships (unregistering).
    Forget { worker: WorkerKey, done: Sender<()> },
    /// Record that a newly registered worker reaches the `--router-shared-pools`.
    JoinPools { worker: WorkerKey, done: Sender<()> },
}

/// Requests queued for the pump at most (registering and unregistering callers wait their turn).
const PUMP_REQUEST_QUEUE_MAX: usize = 64;

/// The router: owns the subscriber and the pump thread; cheap to share through an `Arc`.
pub struct Router {
    shared: Arc<Shared>,
    /// Requests to the pump: drop a worker's blocks, join it to the shared pools.
    requests: Sender<PumpRequest>,
    /// `Some` until dropped.
    subscriber: Option<ZmqSubscriber>,
    pump: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("workers", &self.shared.workers.lock().len())
            .finish_non_exhaustive()
    }
}

/// The claim of the one dump in progress; released when dropped.
#[derive(Debug)]
pub struct DumpGuard(Arc<std::sync::atomic::AtomicBool>);

impl Drop for DumpGuard {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Release);
    }
}

/// The balance term weighs in only while no candidate holds more of the prompt than another by
/// 1/this of it ([`Router::balance_applies`]).
const BALANCE_SPREAD_DIVISOR: usize = 4;

/// How often, at most, routed requests past their time-to-live are expired.
const EXPIRY_INTERVAL: Duration = Duration::from_secs(1);

impl Router {
    /// Starts following `workers` (more can be registered later).
    pub fn start(config: RouterConfig, workers: Vec<WorkerSpec>) -> Result<Self, TransportError> {
        Self::start_from(config, workers, None)
    }

    /// As [`Self::start`], first restoring a sibling's `dump` (its workers too, each followed
    /// from the sequence number after the one the dump was taken at); `workers` named in the dump
    /// keep its state, with their endpoints from `workers`.
    pub fn start_from(
        mut config: RouterConfig,
        workers: Vec<WorkerSpec>,
        dump: Option<Dump>,
    ) -> Result<Self, TransportError> {
        let (max_workers, open_files) = fit_open_files(config.max_workers, config.max_connections);
        config.max_workers = max_workers;
        let mut index = KvIndex::new(config.max_blocks_per_worker, config.block_size as u32)
            .with_capacity(config.index_capacity_blocks);
        let mut resumed: Vec<(WorkerSpec, Option<u64>)> = Vec::new();
        for (w, snapshot) in dump.map(|d| d.workers).unwrap_or_default() {
            index.restore(&snapshot);
            let key = (w.worker_id, w.dp_rank);
            let endpoint = workers
                .iter()
                .find(|e| e.key() == key)
                .cloned()
                .unwrap_or(WorkerSpec {
                    events: WorkerEndpoint {
                        worker_id: w.worker_id,
                        dp_rank: w.dp_rank,
                        endpoint: w.endpoint,
                        replay: w.replay_endpoint,
                    },
                    http: w.http_url,
                });
            resumed.push((endpoint, w.last_seq));
        }
        let shared = Arc::new(Shared {
            dumping: Arc::default(),
            index: RwLock::new(index),
            predictions: Mutex::new(Predictions::new(
                config.predicted_ttl,
                PREDICTIONS_MAX_DEFAULT,
            )),
            load: Mutex::new(LoadTrack {
                tracker: LoadTracker::new(config.request_ttl),
                last_expiry: Instant::now(),
            }),
            work: Mutex::new(RecentWork::new(config.balance_half_life)),
            workers: Mutex::new(BTreeMap::new()),
            cooldown: Mutex::new(BTreeMap::new()),
            metrics: RouterMetrics::new(),
            rng: Mutex::new(StdRng::from_entropy()),
            round_robin: Mutex::new(RoundRobin::default()),
            tuner: Mutex::new(
                Tuner::new(config.block_size)
                    .with_externality(config.tuned_externality)
                    .with_load_bound(config.tuned_load_bound),
            ),
            cpu_seen: Mutex::new(0.0),
            config,
        });
        shared
            .metrics
            .modes
            .mode_info
            .with_label_values(&[shared.config.selector.mode.name()])
            .set(1);
        shared.metrics.max_workers.set(max_workers as i64);
        if let Some(limit) = open_files {
            shared
                .metrics
                .open_files_limit
                .set(i64::try_from(limit).unwrap_or(i64::MAX));
        }
        // Bounded: when the pump lags, the subscriber waits and ZMQ's own buffers fill; batches
        // they drop show up as sequence gaps, filled by replay.
        let (sink, events) = crossbeam_channel::bounded(ROUTER_EVENT_QUEUE_MAX);
        let subscriber = ZmqSubscriber::start(Vec::new(), sink)?;
        let (requests, pump_requests) = crossbeam_channel::bounded(PUMP_REQUEST_QUEUE_MAX);
        let pump_shared = shared.clone();
        let pump = std::thread::Builder::new()
            .name("kvbm-router-pump".into())
            .spawn(move || pump_loop(&pump_shared, &events, &pump_requests))
            .map_err(|e| TransportError::Zmq {
                call: "spawn",
                endpoint: String::new(),
                error: e.to_string(),
            })?;
        let router = Self {
            shared,
            requests,
            subscriber: Some(subscriber),
            pump: Some(pump),
        };
        let transport = |e: RegisterError| match e {
            RegisterError::Transport(t) => t,
            other => TransportError::Zmq {
                call: "register",
                endpoint: String::new(),
                error: other.to_string(),
            },
        };
        // Local workers first, so that they always have room.
        for w in workers {
            let key = w.key();
            if !resumed.iter().any(|(r, _)| r.key() == key) {
                router.register(w).map_err(transport)?;
            }
        }
        router.follow_all(&resumed).map_err(transport)?;
        Ok(router)
    }

    fn subscriber(&self) -> &ZmqSubscriber {
        self.subscriber.as_ref().expect("present until dropped")
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.shared.config
    }

    /// The metrics (with the per-worker gauges as of the last [`Router::render_metrics`]).
    pub fn metrics(&self) -> &RouterMetrics {
        &self.shared.metrics
    }

    /// Follows a worker (replacing an earlier registration of the same id and rank, whose state
    /// is dropped). Returns once its events are being received and its replay buffer, if any,
    /// was read.
    pub fn register(&self, worker: WorkerSpec) -> Result<(), RegisterError> {
        let key = worker.key();
        self.check_room(key)?;
        self.unregister(key);
        self.subscribe(worker, None)?;
        tracing::info!(worker = ?key, "worker registered");
        Ok(())
    }

    /// Follows a worker restored from a dump: keeps its index state and subscribes from the
    /// sequence number after `last_seq` (from the start when none was applied).
    fn follow(&self, worker: WorkerSpec, last_seq: Option<u64>) -> Result<(), RegisterError> {
        let key = worker.key();
        self.check_room(key)?;
        self.subscribe(worker, last_seq)?;
        tracing::info!(worker = ?key, ?last_seq, "worker restored from a dump");
        Ok(())
    }

    /// Follows the workers restored from a dump, [`RESTORE_THREADS`] at a time: each may wait
    /// for its replay endpoint up to the subscriber's replay timeout, and a dump's thousand
    /// workers must not wait one after another. A worker there is no room for (`--max-workers`)
    /// is left out, its restored blocks dropped; a transport error fails the whole start.
    fn follow_all(&self, resumed: &[(WorkerSpec, Option<u64>)]) -> Result<(), RegisterError> {
        if resumed.is_empty() {
            return Ok(());
        }
        let per_thread = resumed.len().div_ceil(RESTORE_THREADS);
        std::thread::scope(|scope| {
            let threads: Vec<_> = resumed
                .chunks(per_thread)
                .map(|chunk| {
                    scope.spawn(move || -> Result<(), RegisterError> {
                        for (w, last_seq) in chunk {
                            match self.follow(w.clone(), *last_seq) {
                                Ok(()) => {}
                                Err(RegisterError::TooManyWorkers { max }) => {
                                    tracing::warn!(worker = ?w.key(), max, "no room for a worker of the dump (--max-workers); left out");
                                    self.unregister(w.key());
                                }
                                Err(e) => return Err(e),
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| {
                    // A thread that panicked may have left workers out: the start fails.
                    t.join().unwrap_or_else(|_| {
                        Err(RegisterError::Transport(TransportError::Zmq {
                            call: "restore",
                            endpoint: String::new(),
                            error: "a thread following the dump's workers panicked".into(),
                        }))
                    })
                })
                .collect::<Result<Vec<()>, _>>()
                .map(|_| ())
        })
    }

    /// Refuses a worker not registered yet when `--max-workers` are (a quick check; the one
    /// that counts is made again as the worker is recorded, under the same lock).
    fn check_room(&self, key: WorkerKey) -> Result<(), RegisterError> {
        self.room(&self.shared.workers.lock(), key)
    }

    /// Refuses a worker not in `workers` when `--max-workers` are there (counted).
    fn room(
        &self,
        workers: &BTreeMap<WorkerKey, WorkerInfo>,
        key: WorkerKey,
    ) -> Result<(), RegisterError> {
        let max = self.shared.config.max_workers;
        if !workers.contains_key(&key) && workers.len() >= max {
            self.shared.metrics.workers_refused.inc();
            return Err(RegisterError::TooManyWorkers { max });
        }
        Ok(())
    }

    /// Records the worker and subscribes to it, from the sequence number after `last_seq`
    /// (from the start when None); forgets it again if that fails. Refused when `--max-workers`
    /// are recorded: the room is checked and taken under one lock, so that registrations
    /// running at once never overshoot.
    fn subscribe(&self, worker: WorkerSpec, last_seq: Option<u64>) -> Result<(), RegisterError> {
        let key = worker.key();
        let WorkerSpec {
            events: worker,
            http,
        } = worker;
        let count = |workers: &BTreeMap<WorkerKey, WorkerInfo>| {
            self.shared.metrics.workers.set(workers.len() as i64);
        };
        let others: Vec<WorkerKey> = {
            let mut workers = self.shared.workers.lock();
            self.room(&workers, key)?;
            let others = if workers.contains_key(&key) {
                None
            } else {
                Some(workers.keys().copied().collect())
            };
            workers.insert(
                key,
                WorkerInfo {
                    worker_id: worker.worker_id,
                    dp_rank: worker.dp_rank,
                    endpoint: worker.endpoint.clone(),
                    replay_endpoint: worker.replay.clone(),
                    http_url: http,
                    cooldown_secs: 0.0,
                    last_seq,
                    batches: 0,
                    events: 0,
                    unfilled_gaps: 0,
                    resync_needed: false,
                    claims_suspended: false,
                },
            );
            count(&workers);
            others.unwrap_or_default()
        };
        if !others.is_empty() {
            // A worker that joins a running fleet starts level with the least worked, not at 0:
            // the balance term would otherwise send it every new conversation for a half-life.
            self.shared
                .work
                .lock()
                .start_level(key, others.into_iter(), Instant::now());
        }
        let subscribed = match last_seq {
            Some(seq) => self.subscriber().add_from(worker, seq + 1),
            None => self.subscriber().add(worker),
        };
        if let Err(e) = subscribed {
            let mut workers = self.shared.workers.lock();
            workers.remove(&key);
            count(&workers);
            return Err(e.into());
        }
        // The pools every worker reaches (--router-shared-pools): credited from now on, until
        // it is unregistered (which forgets its memberships).
        if !self.shared.config.shared_pools.is_empty() {
            let (done, joined) = crossbeam_channel::bounded(1);
            if self
                .requests
                .send(PumpRequest::JoinPools { worker: key, done })
                .is_ok()
            {
                let _ = joined.recv();
            }
        }
        Ok(())
    }

    /// Claims the one dump allowed at a time; None while another is being sent. The claim ends
    /// when the returned guard drops.
    pub fn try_dump(&self) -> Option<DumpGuard> {
        use std::sync::atomic::Ordering;
        self.shared
            .dumping
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| DumpGuard(self.shared.dumping.clone()))
    }

    /// The index and every worker's last applied sequence number, consistent per worker (taken
    /// under the lock the pump applies batches under), for a sibling to start from.
    pub fn dump(&self) -> Dump {
        let workers = self.shared.workers.lock();
        let index = self.shared.index.read();
        let keys: Vec<WorkerKey> = workers.keys().copied().collect();
        let mut snapshots = index.snapshot(&keys);
        drop(index);
        let out = workers
            .values()
            .map(|info| {
                let key = (info.worker_id, info.dp_rank);
                let found = snapshots
                    .iter()
                    .position(|s| s.worker == key)
                    .map(|i| snapshots.swap_remove(i));
                // A worker whose claims are suspended may be a new process: its sibling gets
                // none of its blocks and follows it from the start.
                let suspended = info.claims_suspended;
                let snapshot =
                    found
                        .filter(|_| !suspended)
                        .unwrap_or(kvbm_events::router::WorkerSnapshot {
                            worker: key,
                            ..Default::default()
                        });
                (
                    DumpWorker {
                        worker_id: info.worker_id,
                        dp_rank: info.dp_rank,
                        endpoint: info.endpoint.clone(),
                        replay_endpoint: info.replay_endpoint.clone(),
                        last_seq: info.last_seq.filter(|_| !suspended),
                        http_url: info.http_url.clone(),
                    },
                    snapshot,
                )
            })
            .collect();
        Dump {
            block_size: self.shared.config.block_size,
            workers: out,
        }
    }

    /// Stops following a worker and forgets its blocks and load. False if it was not registered.
    /// Returns once the pump (the index's one writer) dropped the worker's blocks.
    pub fn unregister(&self, key: WorkerKey) -> bool {
        self.subscriber().remove(key);
        let known = self.shared.workers.lock().remove(&key).is_some();
        let (done, dropped) = crossbeam_channel::bounded(1);
        if self
            .requests
            .send(PumpRequest::Forget { worker: key, done })
            .is_ok()
        {
            let _ = dropped.recv();
        }
        self.shared.load.lock().tracker.drop_worker(key);
        self.shared.work.lock().drop_worker(key);
        self.shared.predictions.lock().forget(key);
        self.shared.cooldown.lock().remove(&key);
        self.shared.tuner.lock().forget(key);
        let (id, rank) = (key.0.to_string(), key.1.to_string());
        for part in ["routed", "uncached"] {
            let _ = self
                .shared
                .metrics
                .modes
                .worker_prompt_tokens
                .remove_label_values(&[id.as_str(), rank.as_str(), part]);
        }
        self.shared
            .metrics
            .workers
            .set(self.shared.workers.lock().len() as i64);
        if known {
            tracing::info!(worker = ?key, "worker unregistered");
        }
        known
    }

    /// The registered workers: what is known of each, its blocks per tier, its load, its link.
    pub fn workers(&self) -> Vec<(WorkerInfo, [usize; 3], WorkerLoad, Option<LinkStatus>)> {
        let mut infos: Vec<WorkerInfo> = self.shared.workers.lock().values().cloned().collect();
        {
            let now = Instant::now();
            let cooldown = self.shared.cooldown.lock();
            for info in &mut infos {
                if let Some(until) = cooldown.get(&(info.worker_id, info.dp_rank)) {
                    info.cooldown_secs = until.saturating_duration_since(now).as_secs_f64();
                }
            }
        }
        let links = self.subscriber().links();
        let index = self.shared.index.read();
        let load = self.shared.load.lock();
        infos
            .into_iter()
            .map(|info| {
                let key = (info.worker_id, info.dp_rank);
                let blocks = Tier::ALL.map(|t| index.blocks_in(key, t));
                let l = load.tracker.load(key);
                let link = links
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, l)| l.clone());
                (info, blocks, l, link)
            })
            .collect()
    }

    /// Workers whose link is known to be down (their endpoint does not answer): not routed to.
    fn unreachable(&self) -> Vec<WorkerKey> {
        self.subscriber()
            .links()
            .into_iter()
            .filter(|(_, l)| l.state == LinkState::Retrying)
            .map(|(k, _)| k)
            .collect()
    }

    fn hashes(&self, request: &RequestTokens<'_>) -> Vec<u64> {
        BlockHasher::new(
            self.shared.config.block_size,
            request.lora_name,
            request.cache_salt,
        )
        .sequence_hashes(None, request.token_ids)
        .into_iter()
        .map(|h| h.0)
        .collect()
    }

    /// A probe for a prompt of `lora_name` and `cache_salt` being tokenized (see [`PrefixProbe`]).
    pub fn prefix_probe(
        &self,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PrefixProbe<'_> {
        PrefixProbe {
            router: self,
            hasher: BlockHasher::new(self.shared.config.block_size, lora_name, cache_salt),
            hashes: Vec::new(),
            parent: None,
        }
    }

    /// Every registered worker's overlap with `hashes` (with its predicted blocks, if any).
    fn overlaps(&self, hashes: &[u64]) -> Vec<(WorkerKey, Overlap)> {
        let start = Instant::now();
        let mut found = self.shared.index.read().find_matches(hashes);
        self.shared
            .metrics
            .find_matches
            .observe(start.elapsed().as_secs_f64());
        // By worker, for a binary search per registered worker (not a scan: 256 workers).
        found.sort_unstable_by_key(|(w, _)| *w);
        let keys: Vec<(WorkerKey, bool)> = self
            .shared
            .workers
            .lock()
            .iter()
            .map(|(k, info)| (*k, info.claims_suspended))
            .collect();
        let now = Instant::now();
        let predictions = self.shared.predictions.lock();
        keys.into_iter()
            .map(|(k, suspended)| {
                // A worker whose claims are suspended may be a new process: its indexed blocks
                // are not counted (its predictions since then are).
                let o = if suspended {
                    Overlap::default()
                } else {
                    found
                        .binary_search_by_key(&k, |(w, _)| *w)
                        .map_or(Overlap::default(), |i| found[i].1)
                };
                let predicted = if predictions.is_empty() {
                    0
                } else {
                    predictions.prefix(k, hashes, now)
                };
                (k, with_prediction(o, predicted))
            })
            .collect()
    }

    /// Every registered worker's overlap with the request, best GPU overlap first.
    pub fn query(&self, request: &RequestTokens<'_>) -> QueryAnswer {
        let hashes = self.hashes(request);
        let bs = self.shared.config.block_size;
        let mut workers: Vec<WorkerOverlap> = self
            .overlaps(&hashes)
            .into_iter()
            .map(|((worker_id, dp_rank), o)| WorkerOverlap {
                worker_id,
                dp_rank,
                overlap: TierOverlap::new(o, bs),
            })
            .collect();
        workers.sort_by(|a, b| {
            (
                b.overlap.gpu_blocks,
                b.overlap.host_blocks,
                b.overlap.disk_blocks,
                b.overlap.shared_blocks,
            )
                .cmp(&(
                    a.overlap.gpu_blocks,
                    a.overlap.host_blocks,
                    a.overlap.disk_blocks,
                    a.overlap.shared_blocks,
                ))
                .then((a.worker_id, a.dp_rank).cmp(&(b.worker_id, b.dp_rank)))
        });
        QueryAnswer {
            request_blocks: hashes.len(),
            workers,
        }
    }

    /// Picks the worker for a request and counts the request toward its load.
    pub fn route(
        &self,
        request: &RequestTokens<'_>,
        request_id: Option<String>,
    ) -> Result<RouteAnswer, RouteError> {
        self.route_among(request, request_id, |_| true, false)
    }

    /// The worker the OpenAI front end's routing would pick now among `overlaps` (every
    /// registered worker's) for a prompt of `input_tokens`, without routing anything, and whether
    /// that pick is sure when each of `growable` (sorted) may yet add `growth` blocks to its
    /// overlap (the rest of the prompt, untokenized) and no other worker's overlap can change:
    /// the pick must cost less than every other worker even with the growth credited at the
    /// highest weight.
    /// Never sure outside a fixed-weight cost mode (`kv-gpu`, `kv`, `dynamo`) without a
    /// temperature, or with a credit weight above 1 (so that an overlap never credits more than
    /// the prompt's length and the rest's length cancels out between workers), or without one
    /// lowest cost, or (when the balance term has a weight) unless it is the same worker with
    /// and without the term. The workers are filtered as the front end's first attempt filters
    /// them.
    fn sure_pick(
        &self,
        overlaps: &[(WorkerKey, Overlap)],
        input_tokens: usize,
        growable: &[WorkerKey],
        growth: usize,
    ) -> Pick {
        let config = &self.shared.config;
        let s = &config.selector;
        let fixed = matches!(
            s.mode,
            RouterMode::KvGpu | RouterMode::Kv | RouterMode::Dynamo
        );
        let weights = [
            s.overlap_score_credit,
            s.host_weight,
            s.disk_weight,
            s.shared_weight,
        ];
        if !fixed || s.temperature > 0.0 || weights.iter().any(|w| !(0.0..=1.0).contains(w)) {
            return Pick::Unsure(None);
        }
        // What `growth` blocks take off a holder's cost at most.
        let weight_max = weights.iter().copied().fold(0.0, f64::max);
        let growth_credit = s.prefill_load_scale * weight_max * growth as f64;
        let urls = self.http_urls();
        let mut eligible: Vec<(WorkerKey, Overlap)> = overlaps
            .iter()
            .filter(|(k, _)| urls.contains_key(k))
            .copied()
            .collect();
        self.pass_over_down_and_cooling(&mut eligible, true);
        // The balance term weighs in or not depending on how far the holder's overlap and the
        // prompt reach, which the rest of the prompt may change: the pick is sure only if the
        // same worker wins either way.
        let excess: Vec<f64> = if s.balance_weight > 0.0 {
            let work = self.shared.work.lock();
            work.excess(eligible.iter().map(|(k, _)| *k), Instant::now())
        } else {
            vec![0.0; eligible.len()]
        };
        let load = self.shared.load.lock();
        let best = |with_balance: bool| {
            let costs: Vec<(WorkerKey, f64)> = eligible
                .iter()
                .zip(&excess)
                .map(|(&(worker, overlap), &excess_work)| {
                    let c = Candidate {
                        worker,
                        overlap,
                        load: load.tracker.load(worker),
                        excess_work: if with_balance { excess_work } else { 0.0 },
                    };
                    (worker, s.cost(&c, input_tokens, config.block_size))
                })
                .collect();
            let Some(&(pick, least)) = costs.iter().min_by(|a, b| a.1.total_cmp(&b.1)) else {
                return Pick::Unsure(None);
            };
            if costs.iter().any(|&(w, c)| w != pick && c <= least) {
                return Pick::Unsure(None);
            }
            // The others at the least they could cost once the whole prompt is known (the
            // rest's length, the same for every worker, cancels out).
            let overtaken = costs.iter().any(|&(w, c)| {
                w != pick && growable.binary_search(&w).is_ok() && c - growth_credit <= least
            });
            if overtaken {
                Pick::Unsure(Some(pick))
            } else {
                Pick::Sure(pick)
            }
        };
        let without = best(false);
        if s.balance_weight > 0.0 {
            let with = best(true);
            let pick = |p: Pick| match p {
                Pick::Sure(w) | Pick::Unsure(Some(w)) => Some(w),
                Pick::Unsure(None) => None,
            };
            if pick(with) != pick(without) {
                return Pick::Unsure(None);
            }
            if with != without {
                return Pick::Unsure(pick(without));
            }
        }
        without
    }

    /// Whether the balance term weighs in for a prompt of `input_tokens` with `overlaps`: its
    /// weight is above 0 and no candidate holds more of the prompt than another by a quarter of
    /// it or more (a new conversation, or one whose cache is gone everywhere). Where one does,
    /// the conversation stays with its cache: moving it would compute its history again, and
    /// the load terms alone decide whether that pays.
    fn balance_applies(&self, overlaps: &[(WorkerKey, Overlap)], input_tokens: usize) -> bool {
        if self.shared.config.selector.balance_weight <= 0.0 {
            return false;
        }
        let held = |o: &Overlap| o.gpu + o.host + o.disk + o.shared;
        let most = overlaps.iter().map(|(_, o)| held(o)).max().unwrap_or(0);
        let least = overlaps.iter().map(|(_, o)| held(o)).min().unwrap_or(0);
        let spread_tokens = (most - least).saturating_mul(self.shared.config.block_size);
        spread_tokens.saturating_mul(BALANCE_SPREAD_DIVISOR) < input_tokens
    }

    /// Each of `overlaps`' workers' recent work above the least of them, in tokens; all 0 where
    /// the balance term does not weigh in ([`Self::balance_applies`]; the lock is not taken).
    fn excess_work(&self, overlaps: &[(WorkerKey, Overlap)], input_tokens: usize) -> Vec<f64> {
        if self.balance_applies(overlaps, input_tokens) {
            self.shared
                .work
                .lock()
                .excess(overlaps.iter().map(|(k, _)| *k), Instant::now())
        } else {
            vec![0.0; overlaps.len()]
        }
    }

    /// Leaves out of `overlaps` the workers whose event stream is down (unless
    /// `unreachable_as_last_resort` and no other is left) and those cooling down after a failure
    /// (while any other can take the request; when none can, they are tried rather than nothing).
    /// Empty only if no worker is reachable.
    fn pass_over_down_and_cooling(
        &self,
        overlaps: &mut Vec<(WorkerKey, Overlap)>,
        unreachable_as_last_resort: bool,
    ) {
        let down = self.unreachable();
        if !(unreachable_as_last_resort && overlaps.iter().all(|(k, _)| down.contains(k))) {
            overlaps.retain(|(k, _)| !down.contains(k));
        }
        let cooling = self.cooling(Instant::now());
        if overlaps.iter().any(|(k, _)| !cooling.contains(k)) {
            overlaps.retain(|(k, _)| !cooling.contains(k));
        }
    }

    /// The HTTP server of a registered worker, if it named one.
    pub fn http_url(&self, key: WorkerKey) -> Option<String> {
        self.shared.workers.lock().get(&key)?.http_url.clone()
    }

    /// The registered workers that named an HTTP server, with it.
    pub fn http_urls(&self) -> BTreeMap<WorkerKey, String> {
        self.shared
            .workers
            .lock()
            .iter()
            .filter_map(|(k, w)| Some((*k, w.http_url.clone()?)))
            .collect()
    }

    /// Changes where a registered worker's HTTP server answers, keeping its index state. False
    /// when it is not registered.
    pub fn set_http_url(&self, key: WorkerKey, http_url: Option<String>) -> bool {
        match self.shared.workers.lock().get_mut(&key) {
            Some(w) => {
                w.http_url = http_url;
                true
            }
            None => false,
        }
    }

    /// Leaves a worker out of routing for `for_how_long` (a request to it failed).
    pub fn cool_down(&self, key: WorkerKey, for_how_long: Duration) {
        if self.shared.workers.lock().contains_key(&key) {
            self.shared
                .cooldown
                .lock()
                .insert(key, Instant::now() + for_how_long);
            self.shared.metrics.worker_failures.inc();
            tracing::warn!(worker = ?key, secs = for_how_long.as_secs_f64(), "worker failed a request; left out of routing for a while");
        }
    }

    /// Workers cooling down after a failure.
    fn cooling(&self, now: Instant) -> Vec<WorkerKey> {
        let mut cooldown = self.shared.cooldown.lock();
        cooldown.retain(|_, until| *until > now);
        cooldown.keys().copied().collect()
    }

    /// As [`Self::route`], among the workers `eligible` accepts, passing over those cooling down
    /// after a failure unless no other is left. With `unreachable_as_last_resort`, workers whose
    /// event stream is down are passed over too, rather than excluded, when none is up (the
    /// OpenAI front end: a worker whose events cannot be read may still answer requests; its
    /// overlap is then unknown, and load decides).
    pub fn route_among(
        &self,
        request: &RequestTokens<'_>,
        request_id: Option<String>,
        eligible: impl Fn(WorkerKey) -> bool,
        unreachable_as_last_resort: bool,
    ) -> Result<RouteAnswer, RouteError> {
        if let Some(id) = &request_id {
            let max = self.shared.config.max_request_id_bytes;
            if id.len() > max {
                return Err(RouteError::RequestIdTooLong { len: id.len(), max });
            }
        }
        let hashes = self.hashes(request);
        let mut overlaps = self.overlaps(&hashes);
        if overlaps.is_empty() {
            return Err(RouteError::NoWorkers);
        }
        overlaps.retain(|(k, _)| eligible(*k));
        if overlaps.is_empty() {
            return Err(RouteError::NoneEligible);
        }
        self.pass_over_down_and_cooling(&mut overlaps, unreachable_as_last_resort);
        if overlaps.is_empty() {
            return Err(RouteError::NoneReachable);
        }
        let config = &self.shared.config;
        let input_tokens = request.token_ids.len() + request.untokenized_tokens;
        let now = Instant::now();
        let excess = self.excess_work(&overlaps, input_tokens);
        let mut load = self.shared.load.lock();
        if now.duration_since(load.last_expiry) >= EXPIRY_INTERVAL {
            load.tracker.expire(now);
            load.last_expiry = now;
        }
        let candidates: Vec<Candidate> = overlaps
            .iter()
            .zip(excess)
            .map(|(&(worker, overlap), excess_work)| Candidate {
                worker,
                overlap,
                load: load.tracker.load(worker),
                excess_work,
            })
            .collect();
        let selector = &config.selector;
        let block_size = config.block_size;
        let selection = {
            let mut rng = self.shared.rng.lock();
            let mut round_robin = self.shared.round_robin.lock();
            // The learned cost, in the tuned mode once the learner is warm.
            let tuner = (selector.mode == RouterMode::Tuned).then(|| self.shared.tuner.lock());
            let cap = tuner.as_ref().and_then(|t| t.load_cap(&candidates));
            let cost = |c: &Candidate| {
                if cap.is_some_and(|cap| c.load.requests >= cap) {
                    return f64::MAX;
                }
                tuner
                    .as_ref()
                    .and_then(|t| t.cost(c, input_tokens))
                    .unwrap_or(f64::MAX)
            };
            let learned: Option<&dyn Fn(&Candidate) -> f64> =
                if tuner.as_ref().is_some_and(|t| t.ready()) {
                    Some(&cost)
                } else {
                    None
                };
            select_mode(
                selector,
                &candidates,
                input_tokens,
                block_size,
                &mut *rng,
                &mut round_robin,
                learned,
            )
        }
        .ok_or(RouteError::NoWorkers)?;
        let features = candidates
            .iter()
            .find(|c| c.worker == selection.chosen)
            .map_or_else(RouteFeatures::default, |c| {
                RouteFeatures::of(c, input_tokens, block_size)
            });
        let request_id = request_id.unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
        if load.tracker.len() < config.max_tracked_requests {
            // Prefill load: the prompt less the credit the mode's cost gives its overlap, as
            // Dynamo counts a routed request (`initial_effective_prefill_tokens`): all of it for
            // the modes without credit, the tokens to compute or load for the others.
            let overlap = candidates
                .iter()
                .find(|c| c.worker == selection.chosen)
                .map_or(Overlap::default(), |c| c.overlap);
            load.tracker.routed_uncached(
                request_id.clone(),
                selection.chosen,
                input_tokens,
                selector.uncached_tokens(overlap, input_tokens, block_size),
                block_size,
                now,
            );
        } else {
            self.shared.metrics.requests_untracked.inc();
        }
        self.shared
            .metrics
            .active_requests
            .set(load.tracker.len() as i64);
        drop(load);
        self.shared
            .metrics
            .modes
            .routed
            .with_label_values(&[selector.mode.name()])
            .inc();
        let chosen = selection.chosen;
        let overlap = overlaps
            .iter()
            .find(|(w, _)| *w == chosen)
            .map_or(Overlap::default(), |(_, o)| *o);
        {
            let cached = (overlap.gpu + overlap.host + overlap.disk + overlap.shared)
                .saturating_mul(block_size);
            let (id, rank) = (chosen.0.to_string(), chosen.1.to_string());
            let tokens = &self.shared.metrics.modes.worker_prompt_tokens;
            tokens
                .with_label_values(&[id.as_str(), rank.as_str(), "routed"])
                .inc_by(input_tokens as u64);
            tokens
                .with_label_values(&[id.as_str(), rank.as_str(), "uncached"])
                .inc_by(input_tokens.saturating_sub(cached) as u64);
        }
        {
            let mut predictions = self.shared.predictions.lock();
            if predictions.enabled() {
                predictions.predict(chosen, &hashes, now);
            }
        }
        let cost = selection
            .costs
            .iter()
            .find(|(w, _)| *w == chosen)
            .map_or(0.0, |(_, c)| *c);
        Ok(RouteAnswer {
            request_id,
            worker_id: chosen.0,
            dp_rank: chosen.1,
            overlap: TierOverlap::new(overlap, config.block_size),
            cost,
            runner_ups: selection
                .costs
                .iter()
                .filter(|(w, _)| *w != chosen)
                .map(|&((worker_id, dp_rank), cost)| WorkerCost {
                    worker_id,
                    dp_rank,
                    cost,
                })
                .collect(),
            request_blocks: hashes.len(),
            mode: selector.mode.name(),
            features,
            routed_at: Some(now),
        })
    }

    /// A streamed request routed by `answer` had its first token `ttft_secs` after it was
    /// routed (the tuned cost learns from it). False when the learner refused it.
    pub fn observe_ttft(
        &self,
        worker: WorkerKey,
        features: &RouteFeatures,
        ttft_secs: f64,
    ) -> bool {
        self.shared
            .tuner
            .lock()
            .observe_ttft(worker, features, ttft_secs)
    }

    /// A streamed request on `worker`, whose worker had `decode_blocks` of decode load when it was
    /// routed, produced `completion_tokens` at `tpot_secs` each after the first.
    pub fn observe_tpot(
        &self,
        worker: WorkerKey,
        decode_blocks: usize,
        completion_tokens: usize,
        tpot_secs: f64,
    ) -> bool {
        self.shared
            .tuner
            .lock()
            .observe_tpot(worker, decode_blocks, completion_tokens, tpot_secs)
    }

    /// A copy of the tuned cost's learner (for the debug view and tests).
    pub fn tuner(&self) -> Tuner {
        self.shared.tuner.lock().clone()
    }

    /// The tuned cost's state as GET /debug/cost shows it.
    pub fn cost_view(&self) -> serde_json::Value {
        let tuner = self.tuner();
        let block_size = self.shared.config.block_size;
        let selector = &self.shared.config.selector;
        let coefficients = |c: Option<kvbm_events::router::Coefficients>| {
            c.map(|c| {
                serde_json::json!({
                    "c0_seconds": c.c0,
                    "compute_seconds_per_token": c.c_compute,
                    "host_seconds_per_token": c.c_host,
                    "disk_seconds_per_token": c.c_disk,
                    "decode_seconds_per_block": c.c_dec,
                    "tpot_seconds": c.d0,
                    "tpot_seconds_per_decode_block": c.d1,
                    "dynamo_weights": dynamo(c.dynamo_weights(block_size)),
                })
            })
        };
        fn dynamo(d: kvbm_events::router::DynamoEquivalent) -> serde_json::Value {
            serde_json::json!({
                "router_prefill_load_scale": d.prefill_load_scale,
                "router_host_cache_hit_weight": d.host_cache_hit_weight,
                "router_disk_cache_hit_weight": d.disk_cache_hit_weight,
            })
        }
        let counts = tuner.counts();
        let workers: Vec<serde_json::Value> = tuner
            .view()
            .into_iter()
            .map(|w| {
                serde_json::json!({
                    "worker_id": w.worker.0,
                    "dp_rank": w.worker.1,
                    "ttft_observations": w.ttft_observations,
                    "tpot_observations": w.tpot_observations,
                    "mean_abs_error_seconds": w.mean_abs_error,
                    "recent_residuals_seconds": w.residuals,
                    "coefficients": coefficients(w.coefficients),
                })
            })
            .collect();
        serde_json::json!({
            "mode": selector.mode.name(),
            "block_size": block_size,
            "weights_in_force": {
                "router_prefill_load_scale": selector.prefill_load_scale,
                "router_kv_overlap_score_credit": selector.overlap_score_credit,
                "router_host_cache_hit_weight": selector.host_weight,
                "router_disk_cache_hit_weight": selector.disk_weight,
                "router_shared_cache_hit_weight": selector.shared_weight,
                "router_decode_active_request_weight": selector.decode_active_request_weight,
            },
            "tuned": {
                "active": tuner.ready(),
                "externality": tuner.externality(),
                "load_bound": tuner.load_bound(),
                "warmup_observations": kvbm_events::router::tune::WARMUP_OBSERVATIONS,
                "observations": {
                    "ttft": counts.ttft,
                    "tpot": counts.tpot,
                    "refused": counts.refused,
                    "clipped": counts.clipped,
                },
                "mean_abs_error_seconds": tuner.mean_abs_error(),
                "fleet": coefficients(tuner.fleet_coefficients()),
                "dynamo_weights": tuner.dynamo_weights().map(dynamo),
                "workers": workers,
            },
        })
    }

    /// A routed request produced its first token. False for an unknown (or expired) id.
    pub fn first_token(&self, request_id: &str) -> bool {
        self.shared
            .load
            .lock()
            .tracker
            .first_token(request_id, Instant::now())
    }

    /// A routed request finished. False for an unknown (or expired) id.
    pub fn finished(&self, request_id: &str) -> bool {
        let mut load = self.shared.load.lock();
        let known = load.tracker.finished(request_id);
        self.shared
            .metrics
            .active_requests
            .set(load.tracker.len() as i64);
        known
    }

    /// Refreshes the gauges and renders every metric as Prometheus text.
    pub fn render_metrics(&self) -> String {
        let m = &self.shared.metrics;
        m.blocks.reset();
        for (info, blocks, _, _) in self.workers() {
            let (id, rank) = (info.worker_id.to_string(), info.dp_rank.to_string());
            for t in Tier::ALL {
                m.blocks
                    .with_label_values(&[id.as_str(), rank.as_str(), t.medium_name()])
                    .set(blocks[t.index()] as i64);
            }
        }
        {
            let index = self.shared.index.read();
            m.distinct_blocks.set(index.distinct_blocks() as i64);
            let keys: Vec<WorkerKey> = self.shared.workers.lock().keys().copied().collect();
            m.engine_hashes
                .set(keys.iter().map(|&k| index.engine_hashes(k)).sum::<usize>() as i64);
        }
        {
            use std::sync::atomic::Ordering::Relaxed;
            let st = self.subscriber().stats();
            for (what, c) in [
                ("batches", &st.batches),
                ("undecodable", &st.undecodable),
                ("oversized", &st.oversized),
                ("malformed", &st.malformed),
                ("duplicates", &st.duplicates),
                ("restarts", &st.restarts),
                ("gaps_filled", &st.gaps_filled),
                ("gaps_unfilled", &st.gaps_unfilled),
                ("replay_requests", &st.replay_requests),
                ("replay_timeouts", &st.replay_timeouts),
                ("replay_failures", &st.replay_failures),
                ("sink_waits", &st.sink_waits),
            ] {
                m.subscriber
                    .with_label_values(&[what])
                    .set(c.load(Relaxed) as i64);
            }
        }
        {
            let mut predictions = self.shared.predictions.lock();
            predictions.expire(Instant::now());
            m.predicted_blocks.set(predictions.len() as i64);
            m.predictions_dropped.set(predictions.dropped() as i64);
        }
        m.active_requests
            .set(self.shared.load.lock().tracker.len() as i64);
        {
            use std::sync::atomic::Ordering::Relaxed;
            let st = self.subscriber().stats();
            m.subscriber_sockets
                .set(st.sockets_open.load(Relaxed) as i64);
            m.subscriber_contexts
                .set(st.contexts_open.load(Relaxed) as i64);
            let suspended = self
                .shared
                .workers
                .lock()
                .values()
                .filter(|w| w.claims_suspended)
                .count();
            m.claims_suspended.set(suspended as i64);
            m.max_workers.set(self.shared.config.max_workers as i64);
        }
        self.refresh_mode_metrics();
        m.render()
    }
}

impl Router {
    /// Copies the tuned cost's state and the process CPU time into the metrics.
    fn refresh_mode_metrics(&self) {
        let mm = &self.shared.metrics.modes;
        {
            let tuner = self.shared.tuner.lock();
            mm.tuned_active.set(i64::from(tuner.ready()));
            if let Some(d) = tuner.dynamo_weights() {
                mm.tuned_prefill_load_scale.set(d.prefill_load_scale);
                mm.tuned_host_cache_hit_weight.set(d.host_cache_hit_weight);
                mm.tuned_disk_cache_hit_weight.set(d.disk_cache_hit_weight);
            }
            let counts = tuner.counts();
            for (kind, n) in [
                ("ttft", counts.ttft),
                ("tpot", counts.tpot),
                ("refused", counts.refused),
                ("clipped", counts.clipped),
            ] {
                mm.tuned_observations
                    .with_label_values(&[kind])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            mm.tuned_abs_error.set(tuner.mean_abs_error());
            mm.tuned_compute_seconds_per_token.reset();
            for w in tuner.view() {
                if let Some(c) = w.coefficients {
                    mm.tuned_compute_seconds_per_token
                        .with_label_values(&[&w.worker.0.to_string(), &w.worker.1.to_string()])
                        .set(c.c_compute);
                }
            }
        }
        mm.worker_recent_work.reset();
        let registered: Vec<WorkerKey> = self.shared.workers.lock().keys().copied().collect();
        let work = self.shared.work.lock();
        let now = Instant::now();
        for k in registered {
            mm.worker_recent_work
                .with_label_values(&[&k.0.to_string(), &k.1.to_string()])
                .set(work.value(k, now));
        }
        drop(work);
        if let Some(cpu) = process_cpu_seconds() {
            let mut seen = self.shared.cpu_seen.lock();
            if cpu > *seen {
                mm.cpu_seconds.inc_by(cpu - *seen);
                *seen = cpu;
            }
        }
    }
}

/// The process's user and system CPU time, in seconds.
pub fn process_cpu_seconds() -> Option<f64> {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).ok()?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
    Some(secs(usage.user_time()) + secs(usage.system_time()))
}

impl Drop for Router {
    fn drop(&mut self) {
        // Dropping the subscriber closes the pump's channel; the pump then ends.
        drop(self.subscriber.take());
        if let Some(pump) = self.pump.take() {
            let _ = pump.join();
        }
    }
}

fn event_type(event: &WireEvent) -> &'static str {
    match event {
        WireEvent::Stored { .. } => "stored",
        WireEvent::Removed { .. } => "removed",
        WireEvent::Cleared => "cleared",
    }
}

/// The one writer of the index: applies the subscriber's events and the forget requests of
/// `unregister` and the pool joins of registrations, in the order they arrive; ends when the
/// subscriber is gone.
fn pump_loop(
    shared: &Shared,
    events: &Receiver<SubscriberEvent>,
    requests: &Receiver<PumpRequest>,
) {
    let m = &shared.metrics;
    loop {
        let event = crossbeam_channel::select! {
            recv(events) -> event => match event {
                Ok(event) => event,
                Err(_) => return,
            },
            recv(requests) -> request => match request {
                Ok(PumpRequest::Forget { worker, done }) => {
                    {
                        let mut index = shared.index.write();
                        index.remove_worker(worker);
                        // It no longer reaches its shared pools for this router.
                        index.forget_member(worker);
                    }
                    let _ = done.send(());
                    continue;
                }
                Ok(PumpRequest::JoinPools { worker, done }) => {
                    {
                        let mut index = shared.index.write();
                        for pool in &shared.config.shared_pools {
                            if let Err(why) = index.join_pool(worker, pool) {
                                tracing::warn!(?worker, pool, ?why, "cannot record that a worker reaches a shared pool");
                            }
                        }
                    }
                    let _ = done.send(());
                    continue;
                }
                // The router is going: only events are left to drain.
                Err(_) => match events.recv() {
                    Ok(event) => event,
                    Err(_) => return,
                },
            },
        };
        let worker = match &event {
            SubscriberEvent::Batch { worker, .. }
            | SubscriberEvent::Undecodable { worker, .. }
            | SubscriberEvent::Gap { worker, .. }
            | SubscriberEvent::Restart { worker }
            | SubscriberEvent::LinkLost { worker }
            | SubscriberEvent::LinkResumed { worker } => *worker,
        };
        let mut workers = shared.workers.lock();
        let Some(info) = workers.get_mut(&worker) else {
            if let SubscriberEvent::Batch { batch, .. } = &event {
                for e in &batch.events {
                    m.applied(event_type(e), "unregistered_worker", 1);
                }
            }
            continue;
        };
        match event {
            SubscriberEvent::Batch { seq, batch, .. } => {
                // Blocks newly stored in the worker's GPU cache that it computed (not loaded
                // from its host or disk tier): the work it reports.
                let mut computed = 0usize;
                {
                    let mut index = shared.index.write();
                    let mut predictions = shared.predictions.lock();
                    let predicting = !predictions.is_empty();
                    let mut gpu_stored: Vec<u64> = Vec::new();
                    for e in &batch.events {
                        gpu_stored.clear();
                        let status = index.apply_and(worker, e, |tier, ours| {
                            if tier == Tier::Gpu {
                                gpu_stored.extend_from_slice(ours);
                                if predicting {
                                    predictions.confirm(worker, ours);
                                }
                            }
                        });
                        if !gpu_stored.is_empty() {
                            computed +=
                                gpu_stored.len() - index.held_below_gpu(worker, &gpu_stored);
                        }
                        if matches!(e, WireEvent::Cleared) {
                            predictions.forget(worker);
                        }
                        m.applied(event_type(e), status.label(), 1);
                        if let Some(kind) = index.group_kind(worker, e) {
                            m.events_by_group_kind
                                .with_label_values(&[kind.name(), event_type(e)])
                                .inc();
                        }
                    }
                }
                if computed > 0 {
                    let tokens = computed.saturating_mul(shared.config.block_size) as u64;
                    shared.work.lock().add(worker, tokens, Instant::now());
                }
                m.applied(
                    "stored",
                    "placeholder_skipped",
                    batch.placeholders_skipped as u64,
                );
                m.applied("unknown", "unknown_event", batch.unknown_skipped as u64);
                info.last_seq = Some(seq);
                info.batches += 1;
                info.events += batch.events.len() as u64;
            }
            SubscriberEvent::Undecodable { seq, error, .. } => {
                m.applied("batch", "decode_error", 1);
                m.decode_errors.inc();
                tracing::warn!(?worker, seq, %error, "undecodable KV event payload skipped");
            }
            SubscriberEvent::Gap {
                from, to, filled, ..
            } => {
                m.gaps
                    .with_label_values(&[if filled { "true" } else { "false" }])
                    .inc();
                if filled {
                    m.replays.inc();
                } else {
                    info.unfilled_gaps += 1;
                    info.resync_needed = true;
                    tracing::warn!(
                        ?worker,
                        from,
                        to,
                        "KV events lost; the index may be stale for this worker"
                    );
                }
            }
            SubscriberEvent::Restart { .. } => {
                m.restarts.inc();
                shared.index.write().remove_worker(worker);
                shared.predictions.lock().forget(worker);
                info.last_seq = None;
                info.unfilled_gaps = 0;
                info.resync_needed = false;
                info.claims_suspended = false;
                tracing::info!(?worker, "engine restarted; its blocks were dropped");
            }
            SubscriberEvent::LinkLost { .. } => {
                shared.predictions.lock().forget(worker);
                if !info.claims_suspended {
                    info.claims_suspended = true;
                    m.claim_suspensions.inc();
                    tracing::warn!(?worker, "event link lost; the worker's blocks do not count until its next batch shows whether it restarted");
                }
            }
            SubscriberEvent::LinkResumed { .. } => {
                // The first batch over the new connection continues the sequence: the same
                // process, its blocks are its own. (Batches the lost connection left queued
                // settle nothing.)
                if info.claims_suspended {
                    info.claims_suspended = false;
                    tracing::info!(
                        ?worker,
                        "event link back on the same sequence; the worker's blocks count again"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Registrations of distinct workers running at once never leave more than `--max-workers`
    /// registered (each used to check for room before any of them was recorded).
    #[test]
    fn concurrent_registrations_never_overshoot_max_workers() {
        let max = 4;
        let config = RouterConfig {
            max_workers: max,
            ..RouterConfig::default()
        };
        let router = Router::start(config, Vec::new()).unwrap();
        // A port nobody listens on: connecting is asynchronous, registering does not wait.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let threads = 32;
        let barrier = std::sync::Barrier::new(threads);
        let registered = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads as u64)
                .map(|id| {
                    let (router, barrier) = (&router, &barrier);
                    scope.spawn(move || {
                        barrier.wait();
                        router.register(WorkerSpec {
                            events: WorkerEndpoint {
                                worker_id: id,
                                dp_rank: 0,
                                endpoint: format!("tcp://127.0.0.1:{port}"),
                                replay: None,
                            },
                            http: None,
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|r| {
                    if let Err(e) = r {
                        assert!(matches!(e, RegisterError::TooManyWorkers { max: 4 }), "{e}");
                    }
                    r.is_ok()
                })
                .count()
        });
        assert_eq!(registered, max);
        assert_eq!(router.workers().len(), max);
        assert_eq!(
            router.metrics().workers_refused.get(),
            (threads - max) as u64
        );
    }
}
