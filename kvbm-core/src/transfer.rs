//! The offload/onboard engine: moves blocks between the GPU and host tiers in bounded batches.
//!
//! Invariants:
//! - A target block stays a `MutableBlock` (not findable) until its copy's completion was seen;
//!   only then is it registered (and `BlockStored` published). A failed copy returns its targets
//!   to `Free` and publishes nothing.
//! - Source blocks are held (`ImmutableBlock`) until the copy completed, so they are never evicted
//!   or reused under a copy; target blocks are `MutableBlock`s, so they are never handed out twice.
//! - At most `inflight_max` batches are on the streams, at most `pending_max` wait behind them;
//!   offloads beyond that are skipped and counted (`Throttled`), never queued without bound.
//! - The engine lock is never held while waiting for a copy; the progress thread waits on the
//!   oldest completion with no lock held. Lock order: engine, then pools (gpu before host).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvbm_cuda::{Completion, CopyStream, Direction, HostRegion, Region, Transfer};
use kvbm_events::{SequenceHash, Tier};
use parking_lot::{Condvar, Mutex};

use crate::layout::BlockLayout;
use crate::metrics::{add, Metrics};
use crate::pool::{BlockPool, ImmutableBlock, MutableBlock};
use crate::CoreError;

/// Limits of the engine (DESIGN.md's `DYN_KVBM_MAX_TRANSFER_BATCH_SIZE` and
/// `DYN_KVBM_MAX_CONCURRENT_TRANSFERS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferLimits {
    /// Blocks per batch. Default 16.
    pub batch_blocks_max: usize,
    /// Batches on the copy streams at once. Default 4.
    pub inflight_max: usize,
    /// Batches waiting for a stream slot before further offloads are skipped. Default 1024.
    pub pending_max: usize,
}

impl Default for TransferLimits {
    fn default() -> Self {
        Self {
            batch_blocks_max: 16,
            inflight_max: 4,
            pending_max: 1024,
        }
    }
}

/// One tier's pool, where its blocks live, and the regions that hold them.
#[derive(Debug)]
pub struct TierStorage {
    /// The tier's blocks.
    pub pool: BlockPool,
    /// Where block `i` of the pool lives.
    pub layout: BlockLayout,
    /// The memory the layout points into.
    pub regions: Vec<Region>,
    /// The host region, when this tier grows as it gets pinned.
    pub host_region: Option<HostRegion>,
}

impl TierStorage {
    /// Makes the blocks whose memory is ready available in the pool.
    pub fn refresh_available(&self) {
        if let Some(host) = &self.host_region {
            let blocks = if host.is_fully_ready() {
                self.layout.num_blocks()
            } else {
                host.ready_bytes()
                    / self
                        .layout
                        .block_stride_bytes()
                        .expect("a host tier is fully contiguous")
            };
            self.pool.grow_available(blocks);
        }
    }
}

/// Called with the host blocks the engine has just registered, or found already resident when
/// asked to offload them again (each is a sighting). Must not block: it runs on the engine's
/// progress thread or an offloading caller, under the engine lock.
pub type HostStoredHook = Arc<dyn Fn(&[ImmutableBlock]) + Send + Sync>;

/// Per-batch timing, for latency figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLatency {
    /// Blocks in the batch.
    pub blocks: usize,
    /// From submission to the stream until the completion was seen.
    pub latency: Duration,
}

/// What a finished request did.
#[derive(Debug, Default)]
pub struct TransferOutcome {
    /// Onboard: the registered target blocks, in request order (held). Offload: empty (the host
    /// copies are registered and idle, findable by hash).
    pub blocks: Vec<ImmutableBlock>,
    /// Blocks copied and registered.
    pub copied: usize,
    /// Blocks not copied because the target tier already held them or they were already queued.
    pub deduplicated: usize,
    /// Blocks not copied for lack of space or queue room.
    pub skipped: usize,
    /// Timing of each batch.
    pub batches: Vec<BatchLatency>,
    /// The first failure, if any batch failed (its blocks were not registered).
    pub error: Option<CoreError>,
}

#[derive(Debug)]
struct TicketState {
    remaining_batches: usize,
    outcome: TransferOutcome,
    slots: Vec<Option<ImmutableBlock>>,
}

#[derive(Debug)]
struct TicketShared {
    /// Onboard keeps the registered blocks for the caller; offload lets them go idle.
    keep_blocks: bool,
    state: Mutex<TicketState>,
    cv: Condvar,
}

/// A request's handle: wait for it, or drop it (the copies go on).
#[derive(Debug)]
pub struct TransferTicket {
    shared: Arc<TicketShared>,
}

impl TransferTicket {
    fn new(
        batches: usize,
        keep_blocks: bool,
        blocks: usize,
        deduplicated: usize,
        skipped: usize,
    ) -> Self {
        let slots = if keep_blocks { blocks } else { 0 };
        Self {
            shared: Arc::new(TicketShared {
                keep_blocks,
                state: Mutex::new(TicketState {
                    remaining_batches: batches,
                    outcome: TransferOutcome {
                        deduplicated,
                        skipped,
                        ..Default::default()
                    },
                    slots: (0..slots).map(|_| None).collect(),
                }),
                cv: Condvar::new(),
            }),
        }
    }

    /// True when every batch finished (or there was nothing to do).
    pub fn is_done(&self) -> bool {
        self.shared.state.lock().remaining_batches == 0
    }

    /// Waits for every batch and returns the outcome.
    pub fn wait(self) -> TransferOutcome {
        let mut state = self.shared.state.lock();
        while state.remaining_batches > 0 {
            self.shared.cv.wait(&mut state);
        }
        let mut outcome = std::mem::take(&mut state.outcome);
        outcome.blocks = state.slots.drain(..).flatten().collect();
        outcome
    }

    fn finish_batch(
        &self,
        first_slot: usize,
        blocks: Vec<ImmutableBlock>,
        latency: BatchLatency,
        error: Option<CoreError>,
    ) {
        let copied = blocks.len();
        // Release what the caller does not keep before anyone can see the batch finished: a
        // waiter must find offloaded host blocks idle, not still held by this function.
        let kept = if self.shared.keep_blocks {
            blocks
        } else {
            drop(blocks);
            Vec::new()
        };
        let mut state = self.shared.state.lock();
        state.outcome.copied += copied;
        state.outcome.batches.push(latency);
        if state.outcome.error.is_none() {
            state.outcome.error = error;
        }
        for (i, block) in kept.into_iter().enumerate() {
            state.slots[first_slot + i] = Some(block);
        }
        state.remaining_batches -= 1;
        if state.remaining_batches == 0 {
            self.shared.cv.notify_all();
        }
    }
}

struct Batch {
    direction: Direction,
    sources: Vec<ImmutableBlock>,
    targets: Vec<MutableBlock>,
    ticket: TransferTicket,
    first_slot: usize,
}

struct InFlight {
    batch: Batch,
    completion: Completion,
    started: Instant,
}

#[derive(Default)]
struct EngineState {
    pending: VecDeque<Batch>,
    inflight: VecDeque<InFlight>,
    /// Hashes on their way to the host tier (offload de-duplication).
    offloading: HashSet<SequenceHash>,
    shutdown: bool,
}

struct EngineShared {
    gpu: TierStorage,
    host: TierStorage,
    d2h: CopyStream,
    h2d: CopyStream,
    limits: TransferLimits,
    metrics: Arc<Metrics>,
    host_stored: Option<HostStoredHook>,
    state: Mutex<EngineState>,
    work_cv: Condvar,
    idle_cv: Condvar,
}

/// Moves blocks between the GPU and host tiers.
pub struct TransferEngine {
    shared: Arc<EngineShared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.state.lock();
        f.debug_struct("TransferEngine")
            .field("pending", &state.pending.len())
            .field("inflight", &state.inflight.len())
            .finish()
    }
}

impl TransferEngine {
    /// An engine over the two tiers and their streams; starts its progress thread.
    pub fn new(
        gpu: TierStorage,
        host: TierStorage,
        d2h: CopyStream,
        h2d: CopyStream,
        limits: TransferLimits,
        metrics: Arc<Metrics>,
        host_stored: Option<HostStoredHook>,
    ) -> Result<Self, CoreError> {
        if limits.batch_blocks_max == 0 || limits.inflight_max == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "transfer limits {limits:?}"
            )));
        }
        let limits = TransferLimits {
            inflight_max: limits.inflight_max.min(kvbm_cuda::STREAM_QUEUE_MAX),
            ..limits
        };
        let shared = Arc::new(EngineShared {
            gpu,
            host,
            d2h,
            h2d,
            limits,
            metrics,
            host_stored,
            state: Mutex::new(EngineState::default()),
            work_cv: Condvar::new(),
            idle_cv: Condvar::new(),
        });
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("kvbm-transfer".into())
            .spawn(move || progress_loop(&worker_shared))
            .map_err(|e| {
                CoreError::InvalidArgument(format!("cannot start the transfer thread: {e}"))
            })?;
        Ok(Self {
            shared,
            worker: Some(worker),
        })
    }

    /// The GPU tier.
    pub fn gpu(&self) -> &TierStorage {
        &self.shared.gpu
    }

    /// The host tier.
    pub fn host(&self) -> &TierStorage {
        &self.shared.host
    }

    /// The engine's limits.
    pub fn limits(&self) -> TransferLimits {
        self.shared.limits
    }

    /// Copies registered GPU blocks to the host tier (write-through). Blocks the host tier holds
    /// or that are already on their way are no-ops; blocks without room are skipped and counted.
    pub fn offload(&self, blocks: &[ImmutableBlock]) -> Result<TransferTicket, CoreError> {
        if let Some(b) = blocks.iter().find(|b| b.tier() != Tier::Gpu) {
            return Err(CoreError::InvalidArgument(format!(
                "offload source {b:?} is not a GPU block"
            )));
        }
        let shared = &self.shared;
        shared.host.refresh_available();
        let mut state = self.lock_open()?;
        let mut sources = Vec::with_capacity(blocks.len());
        let mut deduplicated = 0;
        let mut resident = Vec::new();
        for block in blocks {
            let hash = block.sequence_hash();
            if state.offloading.contains(&hash) {
                deduplicated += 1;
            } else if let Some(host_block) = shared.host.pool.lookup(hash) {
                deduplicated += 1;
                resident.push(host_block);
            } else {
                state.offloading.insert(hash);
                sources.push(block.clone());
            }
        }
        let room_batches = shared
            .limits
            .pending_max
            .saturating_sub(state.pending.len());
        let room_blocks = room_batches.saturating_mul(shared.limits.batch_blocks_max);
        let targets = shared
            .host
            .pool
            .allocate_up_to(sources.len().min(room_blocks));
        let skipped = sources.len() - targets.len();
        for dropped in sources.drain(targets.len()..) {
            state.offloading.remove(&dropped.sequence_hash());
        }
        add(
            &shared.metrics.offload_deduplicated_blocks,
            deduplicated as u64,
        );
        add(&shared.metrics.offload_skipped_blocks, skipped as u64);
        if let (Some(hook), false) = (&shared.host_stored, resident.is_empty()) {
            hook(&resident);
        }
        drop(resident);
        let request = Request {
            direction: Direction::DeviceToHost,
            sources,
            targets,
            deduplicated,
            skipped,
        };
        Ok(start(shared, &mut state, request))
    }

    /// Copies held host blocks into GPU blocks allocated for them (one target per source, in
    /// order); each target is registered under its source's identity once its copy completed.
    pub fn onboard(
        &self,
        sources: Vec<ImmutableBlock>,
        targets: Vec<MutableBlock>,
    ) -> Result<TransferTicket, CoreError> {
        if sources.len() != targets.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} sources for {} targets",
                sources.len(),
                targets.len()
            )));
        }
        if sources.iter().any(|b| b.tier() != Tier::Host)
            || targets.iter().any(|b| b.tier() != Tier::Gpu)
        {
            return Err(CoreError::InvalidArgument(
                "onboard copies host blocks into GPU blocks".into(),
            ));
        }
        let mut state = self.lock_open()?;
        let request = Request {
            direction: Direction::HostToDevice,
            sources,
            targets,
            deduplicated: 0,
            skipped: 0,
        };
        Ok(start(&self.shared, &mut state, request))
    }

    /// The engine state, unless the engine has shut down.
    fn lock_open(&self) -> Result<parking_lot::MutexGuard<'_, EngineState>, CoreError> {
        let state = self.shared.state.lock();
        if state.shutdown {
            return Err(CoreError::EngineClosed);
        }
        Ok(state)
    }

    /// Waits until no batch is pending or in flight.
    pub fn wait_idle(&self) {
        let mut state = self.shared.state.lock();
        while !(state.pending.is_empty() && state.inflight.is_empty()) {
            self.shared.idle_cv.wait(&mut state);
        }
    }

    /// (pending, in flight) batches now.
    pub fn queue_depths(&self) -> (usize, usize) {
        let state = self.shared.state.lock();
        (state.pending.len(), state.inflight.len())
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.shared.work_cv.notify_all();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// One offload or onboard request, before it is split into batches.
struct Request {
    direction: Direction,
    sources: Vec<ImmutableBlock>,
    targets: Vec<MutableBlock>,
    deduplicated: usize,
    skipped: usize,
}

/// Splits a request into batches, queues them, starts what the limits allow, and wakes the
/// progress thread. Onboards keep their registered blocks for the caller; offloads let the host
/// copies go idle.
fn start(shared: &EngineShared, state: &mut EngineState, request: Request) -> TransferTicket {
    let Request {
        direction,
        mut sources,
        mut targets,
        deduplicated,
        skipped,
    } = request;
    let keep_blocks = direction == Direction::HostToDevice;
    let per_batch = shared.limits.batch_blocks_max;
    let total = sources.len();
    let ticket = TransferTicket::new(
        total.div_ceil(per_batch),
        keep_blocks,
        total,
        deduplicated,
        skipped,
    );
    let mut first_slot = 0;
    while !sources.is_empty() {
        let n = per_batch.min(sources.len());
        let rest_sources = sources.split_off(n);
        let rest_targets = targets.split_off(n);
        state.pending.push_back(Batch {
            direction,
            sources: std::mem::replace(&mut sources, rest_sources),
            targets: std::mem::replace(&mut targets, rest_targets),
            ticket: TransferTicket {
                shared: ticket.shared.clone(),
            },
            first_slot,
        });
        first_slot += n;
    }
    launch_ready(shared, state);
    shared.work_cv.notify_one();
    ticket
}

/// Submits pending batches while stream slots are free.
fn launch_ready(shared: &EngineShared, state: &mut EngineState) {
    while state.inflight.len() < shared.limits.inflight_max {
        let Some(batch) = state.pending.pop_front() else {
            break;
        };
        let (src, dst, stream) = match batch.direction {
            Direction::DeviceToHost => (&shared.gpu, &shared.host, &shared.d2h),
            Direction::HostToDevice => (&shared.host, &shared.gpu, &shared.h2d),
        };
        let submitted = build_transfer(src, dst, &batch)
            .and_then(|t| stream.submit(t).map_err(CoreError::from));
        match submitted {
            Ok(completion) => state.inflight.push_back(InFlight {
                batch,
                completion,
                started: Instant::now(),
            }),
            Err(err) => fail_batch(shared, state, batch, Duration::ZERO, err),
        }
    }
}

fn build_transfer(
    src: &TierStorage,
    dst: &TierStorage,
    batch: &Batch,
) -> Result<Transfer, CoreError> {
    let chunks = src.layout.runs_per_block().max(dst.layout.runs_per_block());
    let mut transfer = Transfer::with_capacity(batch.sources.len() * chunks);
    let mut pieces = Vec::with_capacity(batch.sources.len() * chunks);
    for (s, t) in batch.sources.iter().zip(&batch.targets) {
        src.layout
            .copy_pieces_into(s.id().index(), &dst.layout, t.id().index(), &mut pieces)?;
    }
    for p in pieces {
        transfer.push(p.src, p.dst, p.len);
    }
    for region in src.regions.iter().chain(&dst.regions) {
        transfer.keep(region.clone());
    }
    Ok(transfer)
}

fn fail_batch(
    shared: &EngineShared,
    state: &mut EngineState,
    batch: Batch,
    latency: Duration,
    err: CoreError,
) {
    tracing::warn!(direction = batch.direction.as_str(), blocks = batch.sources.len(), error = %err, "transfer failed");
    add(&shared.metrics.transfer_errors, 1);
    if batch.direction == Direction::DeviceToHost {
        for s in &batch.sources {
            state.offloading.remove(&s.sequence_hash());
        }
    }
    let Batch {
        sources,
        targets,
        ticket,
        first_slot,
        ..
    } = batch;
    let blocks = sources.len();
    drop(targets); // back to Free, never registered
    drop(sources);
    ticket.finish_batch(
        first_slot,
        Vec::new(),
        BatchLatency { blocks, latency },
        Some(CoreError::TransferFailed(err.to_string())),
    );
}

/// Registers the targets of a finished batch under their sources' identities.
fn finish_batch(
    shared: &EngineShared,
    state: &mut EngineState,
    done: InFlight,
    result: Result<(), CoreError>,
) {
    let latency = done.started.elapsed();
    let batch = done.batch;
    if let Err(err) = result {
        return fail_batch(shared, state, batch, latency, err);
    }
    let (dst, histogram, blocks_counter, bytes_counter) = match batch.direction {
        Direction::DeviceToHost => (
            &shared.host,
            &shared.metrics.latency_d2h,
            &shared.metrics.offload_blocks_d2h,
            &shared.metrics.bytes_d2h,
        ),
        Direction::HostToDevice => (
            &shared.gpu,
            &shared.metrics.latency_h2d,
            &shared.metrics.onboard_blocks_h2d,
            &shared.metrics.bytes_h2d,
        ),
    };
    let n = batch.sources.len();
    histogram.observe(latency);
    add(blocks_counter, n as u64);
    add(
        bytes_counter,
        (n * dst.layout.kv().bytes_per_block()) as u64,
    );
    let Batch {
        direction,
        sources,
        targets,
        ticket,
        first_slot,
    } = batch;
    let complete: Vec<_> = sources
        .iter()
        .zip(targets)
        .map(|(s, t)| t.complete(s.identity()))
        .collect();
    if direction == Direction::DeviceToHost {
        for s in &sources {
            state.offloading.remove(&s.sequence_hash());
        }
    }
    drop(sources);
    let registered = dst.pool.register_all(complete).unwrap_or_else(|rejected| {
        panic!(
            "targets come from the destination pool: {}",
            rejected.reason
        )
    });
    if let (Some(hook), Direction::DeviceToHost) = (&shared.host_stored, direction) {
        hook(&registered);
    }
    ticket.finish_batch(
        first_slot,
        registered,
        BatchLatency { blocks: n, latency },
        None,
    );
}

fn progress_loop(shared: &EngineShared) {
    loop {
        let oldest = {
            let mut state = shared.state.lock();
            loop {
                if let Some(front) = state.inflight.front() {
                    break front.completion.clone();
                }
                if !state.pending.is_empty() {
                    launch_ready(shared, &mut state);
                    continue;
                }
                shared.idle_cv.notify_all();
                if state.shutdown {
                    return;
                }
                shared.work_cv.wait(&mut state);
            }
        };
        // No lock held while the copy runs.
        let _ = oldest.wait();
        let mut state = shared.state.lock();
        let mut i = 0;
        while i < state.inflight.len() {
            let result = match state.inflight[i].completion.poll() {
                Ok(false) => {
                    i += 1;
                    continue;
                }
                Ok(true) => Ok(()),
                Err(e) => Err(CoreError::from(e)),
            };
            let done = state.inflight.remove(i).expect("index in range");
            finish_batch(shared, &mut state, done, result);
        }
        launch_ready(shared, &mut state);
        if state.pending.is_empty() && state.inflight.is_empty() {
            shared.idle_cv.notify_all();
        }
    }
}
