//! The offload/onboard engine of the block manager: the logical side of moving blocks between
//! the GPU and host tiers (which blocks, de-duplication, allocation of targets, registration once
//! copied). The bytes move through the [`CopyEngine`] (batches, stream slots, bounded queue),
//! the same engine the split engine's worker uses.
//!
//! Invariants:
//! - A target block stays a `FillingBlock` (not findable) until its copy's completion was seen;
//!   only then is it registered (and `BlockStored` published). A failed copy returns its targets
//!   to `Free` and publishes nothing.
//! - Source blocks are held (`RegisteredBlock`) until the copy completed, so they are never evicted
//!   or reused under a copy; target blocks are `FillingBlock`s, so they are never handed out twice.
//! - At most `inflight_max` batches are on the streams, at most `pending_max` wait behind them;
//!   offloads beyond that are skipped and counted, never queued without bound.
//! - The engine lock is never held while waiting for a copy; batches are registered by the copy
//!   engine's callbacks, which run with no copy-engine lock held. Lock order: engine, then pools
//!   (gpu before host).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kvbm_cuda::{CopyStream, Direction, HostRegion, Region};
use kvbm_events::{SequenceHash, Tier};
use parking_lot::{Condvar, Mutex};

use crate::copy::{BatchDone, CopyEngine, CopyJob, CopySide};
use crate::layout::BlockLayout;
use crate::metrics::{add, Metrics};
use crate::pool::{BlockPool, FillingBlock, RegisteredBlock};
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
    /// How the copy streams copy (`KVBM_COPY_COALESCE`, `KVBM_COPY_BATCH`).
    pub copy: kvbm_cuda::StreamOptions,
}

impl Default for TransferLimits {
    fn default() -> Self {
        Self {
            batch_blocks_max: 16,
            inflight_max: 4,
            pending_max: 1024,
            copy: kvbm_cuda::StreamOptions::default(),
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
pub type HostStoredHook = Arc<dyn Fn(&[RegisteredBlock]) + Send + Sync>;

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
    pub blocks: Vec<RegisteredBlock>,
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
    slots: Vec<Option<RegisteredBlock>>,
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
        blocks: Vec<RegisteredBlock>,
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

#[derive(Default)]
struct EngineState {
    /// Hashes on their way to the host tier (offload de-duplication).
    offloading: HashSet<SequenceHash>,
    shutdown: bool,
}

struct EngineShared {
    gpu: TierStorage,
    host: TierStorage,
    metrics: Arc<Metrics>,
    host_stored: Option<HostStoredHook>,
    state: Mutex<EngineState>,
}

/// Moves blocks between the GPU and host tiers.
pub struct TransferEngine {
    shared: Arc<EngineShared>,
    copies: CopyEngine,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("copies", &self.copies)
            .finish()
    }
}

impl TransferEngine {
    /// An engine over the two tiers and their streams.
    pub fn new(
        gpu: TierStorage,
        host: TierStorage,
        d2h: CopyStream,
        h2d: CopyStream,
        limits: TransferLimits,
        metrics: Arc<Metrics>,
        host_stored: Option<HostStoredHook>,
    ) -> Result<Self, CoreError> {
        let side = |t: &TierStorage| CopySide {
            layout: t.layout.clone(),
            regions: t.regions.clone(),
        };
        let copies = CopyEngine::new(side(&gpu), side(&host), d2h, h2d, limits, metrics.clone())?;
        Ok(Self {
            shared: Arc::new(EngineShared {
                gpu,
                host,
                metrics,
                host_stored,
                state: Mutex::new(EngineState::default()),
            }),
            copies,
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
        self.copies.limits()
    }

    /// The copy engine underneath.
    pub fn copies(&self) -> &CopyEngine {
        &self.copies
    }

    /// Copies registered GPU blocks to the host tier (write-through). Blocks the host tier holds
    /// or that are already on their way are no-ops; blocks without room are skipped and counted.
    pub fn offload(&self, blocks: &[RegisteredBlock]) -> Result<TransferTicket, CoreError> {
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
        // Only this engine submits to its copy engine, under this lock: the room seen here can
        // only grow before the submission below.
        let room_blocks = self
            .copies
            .room(Direction::DeviceToHost)
            .saturating_mul(self.copies.limits().batch_blocks_max);
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
        self.start(
            &mut state,
            Direction::DeviceToHost,
            sources,
            targets,
            deduplicated,
            skipped,
        )
    }

    /// Copies held host blocks into GPU blocks allocated for them (one target per source, in
    /// order); each target is registered under its source's identity once its copy completed.
    pub fn onboard(
        &self,
        sources: Vec<RegisteredBlock>,
        targets: Vec<FillingBlock>,
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
        self.start(&mut state, Direction::HostToDevice, sources, targets, 0, 0)
    }

    /// The engine state, unless the engine has shut down.
    fn lock_open(&self) -> Result<parking_lot::MutexGuard<'_, EngineState>, CoreError> {
        let state = self.shared.state.lock();
        if state.shutdown {
            return Err(CoreError::EngineClosed);
        }
        Ok(state)
    }

    /// Waits until no batch is queued or in flight.
    pub fn wait_idle(&self) {
        self.copies.wait_idle();
    }

    /// (queued, in flight) batches now.
    pub fn queue_depths(&self) -> (usize, usize) {
        self.copies.queue_depths()
    }

    /// Hands `sources` -> `targets` to the copy engine; each finished batch registers its
    /// targets (or frees them, if it failed) before the ticket counts it.
    fn start(
        &self,
        state: &mut EngineState,
        direction: Direction,
        sources: Vec<RegisteredBlock>,
        targets: Vec<FillingBlock>,
        deduplicated: usize,
        skipped: usize,
    ) -> Result<TransferTicket, CoreError> {
        let keep_blocks = direction == Direction::HostToDevice;
        let total = sources.len();
        let ticket = TransferTicket::new(
            self.copies.batches_of(total),
            keep_blocks,
            total,
            deduplicated,
            skipped,
        );
        if total == 0 {
            return Ok(ticket);
        }
        let hashes: Vec<SequenceHash> = match direction {
            Direction::DeviceToHost => sources.iter().map(RegisteredBlock::sequence_hash).collect(),
            Direction::HostToDevice => Vec::new(),
        };
        let pairs = sources
            .iter()
            .zip(&targets)
            .map(|(s, t)| (s.id().0, t.id().0))
            .collect();
        let slots: Vec<Mutex<Option<(RegisteredBlock, FillingBlock)>>> = sources
            .into_iter()
            .zip(targets)
            .map(|p| Mutex::new(Some(p)))
            .collect();
        let job = CopyJob {
            direction,
            pairs,
            stage: None,
        };
        let shared = self.shared.clone();
        let batch_ticket = TransferTicket {
            shared: ticket.shared.clone(),
        };
        let on_batch = Box::new(move |done: BatchDone| {
            let taken: Vec<(RegisteredBlock, FillingBlock)> = slots[done.range.clone()]
                .iter()
                .filter_map(|s| s.lock().take())
                .collect();
            finish_batch(&shared, direction, done, taken, &batch_ticket);
        });
        match self.copies.submit(job, Some(on_batch), false) {
            Ok(_) => Ok(ticket),
            Err(err) => {
                // Nothing was queued: the blocks return to their pools (dropped with the
                // callback), the hashes may be offloaded again.
                for hash in &hashes {
                    state.offloading.remove(hash);
                }
                Err(err)
            }
        }
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.copies.wait_idle();
    }
}

/// Registers the targets of a finished batch under their sources' identities (or returns them
/// to `Free` if the batch failed), then counts the batch on its ticket.
fn finish_batch(
    shared: &EngineShared,
    direction: Direction,
    done: BatchDone,
    pairs: Vec<(RegisteredBlock, FillingBlock)>,
    ticket: &TransferTicket,
) {
    let n = pairs.len();
    let latency = BatchLatency {
        blocks: n,
        latency: done.latency,
    };
    let first_slot = done.range.start;
    let (sources, targets): (Vec<RegisteredBlock>, Vec<FillingBlock>) = pairs.into_iter().unzip();
    if direction == Direction::DeviceToHost {
        let mut state = shared.state.lock();
        for s in &sources {
            state.offloading.remove(&s.sequence_hash());
        }
    }
    if let Some(err) = done.error {
        drop(targets); // back to Free, never registered
        drop(sources);
        ticket.finish_batch(first_slot, Vec::new(), latency, Some(err));
        return;
    }
    let (dst, blocks_counter) = match direction {
        Direction::DeviceToHost => (&shared.host, &shared.metrics.offload_blocks_d2h),
        Direction::HostToDevice => (&shared.gpu, &shared.metrics.onboard_blocks_h2d),
    };
    add(blocks_counter, n as u64);
    let complete: Vec<_> = sources
        .iter()
        .zip(targets)
        .map(|(s, t)| t.complete(s.identity()))
        .collect();
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
    ticket.finish_batch(first_slot, registered, latency, None);
}
