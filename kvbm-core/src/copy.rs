//! The copy engine: the one place where blocks move between the GPU and the host pool. Its one
//! caller is the worker (block ids from a leader's plan), whether it serves the vLLM connector or
//! the block manager.
//!
//! A job is a list of block pairs in one direction, cut into batches of at most
//! `batch_blocks_max` blocks; at most `inflight_max` batches are on the copy streams at once and
//! at most `pending_max` wait behind them. A progress thread waits on the oldest batch with no
//! lock held, then reports each finished batch to the job's callback (outside the engine's lock)
//! and to its ticket.
//!
//! Invariants:
//! - Batches launch in submission order, each direction on its own stream, so that on one stream
//!   a later batch never overtakes an earlier one (the worker's onboard stages rely on it).
//! - A batch's callback runs before its ticket counts it done: whoever waits on a ticket sees
//!   what the callback did (the block manager registers onboarded blocks there).
//! - Every transfer keeps both sides' regions alive until the stream is done with it.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvbm_cuda::{Completion, CopyStream, Direction, Region, Transfer};
use parking_lot::{Condvar, Mutex};

use crate::layout::BlockLayout;
use crate::metrics::{add, Metrics};
use crate::transfer::TransferLimits;
use crate::CoreError;

/// One side of the copies: where its blocks live and the memory that holds them.
#[derive(Debug, Clone)]
pub struct CopySide {
    /// Where block `i` lives.
    pub layout: BlockLayout,
    /// The memory the layout points into (kept alive by every transfer).
    pub regions: Vec<Region>,
}

/// A finished batch, as its job's callback sees it.
#[derive(Debug)]
pub struct BatchDone {
    /// The batch's positions in the job's pairs.
    pub range: Range<usize>,
    /// The batch's pairs (for the callback; empty on the ticket's copy).
    pub pairs: Vec<(u32, u32)>,
    /// From submission to the stream until its completion was seen.
    pub latency: Duration,
    /// Bytes the batch copied (or was to copy).
    pub bytes: u64,
    /// Whether it failed.
    pub error: Option<CoreError>,
}

/// Called with every finished batch of a job, on the progress thread, with no engine lock held.
pub type OnBatch = Box<dyn Fn(BatchDone) + Send + Sync>;

/// Copies for the engine: block pairs `(source, target)` in `direction` (source blocks are GPU
/// blocks for device-to-host, host blocks for host-to-device).
#[derive(Debug, Clone)]
pub struct CopyJob {
    /// Which way.
    pub direction: Direction,
    /// `(source block, target block)`.
    pub pairs: Vec<(u32, u32)>,
    /// Copy only the runs whose last layer is this one (an onboard stage, see
    /// [`BlockLayout::ready_after`]); `None` copies whole blocks.
    pub stage: Option<u32>,
}

#[derive(Debug, Default)]
struct TicketState {
    remaining: usize,
    failed: Vec<Range<usize>>,
    error: Option<CoreError>,
    bytes: u64,
}

/// A job's handle: poll it, wait for it, or drop it (the copies go on).
#[derive(Debug, Clone)]
pub struct CopyTicket {
    shared: Arc<(Mutex<TicketState>, Condvar)>,
}

/// What a finished job did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CopyOutcome {
    /// Positions (in the job's pairs) of the batches that failed.
    pub failed: Vec<Range<usize>>,
    /// The first failure.
    pub error: Option<CoreError>,
    /// Bytes copied by the batches that succeeded.
    pub bytes: u64,
}

impl CopyOutcome {
    /// True when every batch succeeded.
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }
}

impl CopyTicket {
    fn new(batches: usize) -> Self {
        Self {
            shared: Arc::new((
                Mutex::new(TicketState {
                    remaining: batches,
                    ..Default::default()
                }),
                Condvar::new(),
            )),
        }
    }

    /// A ticket for a job that had nothing to copy.
    pub fn done() -> Self {
        Self::new(0)
    }

    /// True when every batch finished.
    pub fn is_done(&self) -> bool {
        self.shared.0.lock().remaining == 0
    }

    /// Waits for every batch.
    pub fn wait(&self) -> CopyOutcome {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock();
        while s.remaining > 0 {
            cv.wait(&mut s);
        }
        CopyOutcome {
            failed: s.failed.clone(),
            error: s.error.clone(),
            bytes: s.bytes,
        }
    }

    fn finish(&self, done: &BatchDone) {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock();
        match &done.error {
            Some(e) => {
                s.failed.push(done.range.clone());
                if s.error.is_none() {
                    s.error = Some(e.clone());
                }
            }
            None => s.bytes += done.bytes,
        }
        s.remaining -= 1;
        if s.remaining == 0 {
            cv.notify_all();
        }
    }
}

struct Batch {
    direction: Direction,
    pairs: Vec<(u32, u32)>,
    stage: Option<u32>,
    range: Range<usize>,
    ticket: CopyTicket,
    on_batch: Option<Arc<OnBatch>>,
}

struct InFlight {
    batch: Batch,
    completion: Completion,
    bytes: u64,
    started: Instant,
}

/// One direction's queues: each stream is independent, so a stalled stream never holds up the
/// other's completions.
#[derive(Default)]
struct Lane {
    pending: VecDeque<Batch>,
    inflight: VecDeque<InFlight>,
    /// Batches that failed to launch from a submitting thread, for this lane's progress thread
    /// to settle (a submitter may hold locks the callbacks take).
    failed: Vec<(Batch, BatchDone)>,
}

#[derive(Default)]
struct EngineState {
    /// Device-to-host, then host-to-device.
    lanes: [Lane; 2],
    /// Batches failed or finished whose callbacks have not run yet.
    settling: usize,
    shutdown: bool,
}

struct Shared {
    gpu: CopySide,
    host: CopySide,
    d2h: CopyStream,
    h2d: CopyStream,
    limits: TransferLimits,
    metrics: Arc<Metrics>,
    state: Mutex<EngineState>,
    work_cv: Condvar,
    /// Signalled when batches finish (room, idleness).
    done_cv: Condvar,
}

fn lane_of(direction: Direction) -> usize {
    match direction {
        Direction::DeviceToHost => 0,
        Direction::HostToDevice => 1,
    }
}

const DIRECTIONS: [Direction; 2] = [Direction::DeviceToHost, Direction::HostToDevice];

/// Moves blocks between the GPU and the host pool, in bounded batches.
pub struct CopyEngine {
    shared: Arc<Shared>,
    /// One progress thread per direction.
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for CopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (pending, inflight) = self.queue_depths();
        f.debug_struct("CopyEngine")
            .field("limits", &self.shared.limits)
            .field("pending", &pending)
            .field("inflight", &inflight)
            .finish()
    }
}

impl CopyEngine {
    /// An engine between `gpu` and `host` on the two streams; starts its progress thread.
    pub fn new(
        gpu: CopySide,
        host: CopySide,
        d2h: CopyStream,
        h2d: CopyStream,
        limits: TransferLimits,
        metrics: Arc<Metrics>,
    ) -> Result<Self, CoreError> {
        if limits.batch_blocks_max == 0 || limits.inflight_max == 0 || limits.pending_max == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "transfer limits {limits:?}: each must be at least 1"
            )));
        }
        if d2h.direction() != Direction::DeviceToHost || h2d.direction() != Direction::HostToDevice
        {
            return Err(CoreError::InvalidArgument(
                "copy streams given in the wrong directions".into(),
            ));
        }
        let limits = TransferLimits {
            inflight_max: limits.inflight_max.min(kvbm_cuda::STREAM_QUEUE_MAX),
            ..limits
        };
        let shared = Arc::new(Shared {
            gpu,
            host,
            d2h,
            h2d,
            limits,
            metrics,
            state: Mutex::new(EngineState::default()),
            work_cv: Condvar::new(),
            done_cv: Condvar::new(),
        });
        let mut threads = Vec::with_capacity(2);
        for direction in DIRECTIONS {
            let thread_shared = shared.clone();
            let thread = std::thread::Builder::new()
                .name(format!("kvbm-copy-{}", direction.as_str()))
                .spawn(move || progress_loop(&thread_shared, direction))
                .map_err(|e| {
                    CoreError::InvalidArgument(format!("cannot start the copy thread: {e}"))
                });
            match thread {
                Ok(t) => threads.push(t),
                Err(e) => {
                    shared.state.lock().shutdown = true;
                    shared.work_cv.notify_all();
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(Self { shared, threads })
    }

    /// Orders the engine's later copies in `direction` after everything queued so far on the
    /// engine's (vLLM's) CUDA stream `foreign`, on the device: the copies of a step then follow
    /// the forward pass's writes (offloads) and any pending writes to their target blocks
    /// (onboards) without the host waiting. Copies already queued are not affected. Nothing to
    /// do on the emulated device.
    pub fn order_after_stream(&self, direction: Direction, foreign: u64) -> Result<(), CoreError> {
        let stream = match direction {
            Direction::DeviceToHost => &self.shared.d2h,
            Direction::HostToDevice => &self.shared.h2d,
        };
        stream.order_after_stream(foreign).map_err(CoreError::from)
    }

    /// The reverse of [`Self::order_after_stream`]: makes the engine's (vLLM's) CUDA stream
    /// `foreign` wait, on the device, for every copy submitted so far in `direction`
    /// ([`CopyStream::make_stream_wait`]), so that the engine's later work cannot overwrite
    /// blocks those copies still read. Batches still queued behind the in-flight limit are
    /// launched first (the host waits for that, not for the copies). Returns false on the
    /// emulated device, which has no engine stream: the caller waits on the host instead.
    pub fn make_stream_wait(&self, direction: Direction, foreign: u64) -> Result<bool, CoreError> {
        let lane = lane_of(direction);
        let mut state = self.shared.state.lock();
        while !state.lanes[lane].pending.is_empty() && !state.shutdown {
            self.shared.work_cv.notify_all();
            self.shared.done_cv.wait(&mut state);
        }
        // With the lock held no batch launches between the last one and the event.
        self.stream(direction)
            .make_stream_wait(foreign)
            .map_err(CoreError::from)
    }

    /// The engine's limits.
    pub fn limits(&self) -> TransferLimits {
        self.shared.limits
    }

    /// The GPU side.
    pub fn gpu(&self) -> &CopySide {
        &self.shared.gpu
    }

    /// The host side.
    pub fn host(&self) -> &CopySide {
        &self.shared.host
    }

    /// The stream of `direction`.
    pub fn stream(&self, direction: Direction) -> &CopyStream {
        match direction {
            Direction::DeviceToHost => &self.shared.d2h,
            Direction::HostToDevice => &self.shared.h2d,
        }
    }

    /// Batches a job of `pairs` blocks takes.
    pub fn batches_of(&self, pairs: usize) -> usize {
        pairs.div_ceil(self.shared.limits.batch_blocks_max)
    }

    /// Batches that can be queued in `direction` now without waiting.
    pub fn room(&self, direction: Direction) -> usize {
        let state = self.shared.state.lock();
        self.shared
            .limits
            .pending_max
            .saturating_sub(state.lanes[lane_of(direction)].pending.len())
    }

    /// Queues `job`. Every pair is checked against both sides' block counts first (an
    /// `InvalidArgument` queues nothing). With `wait_for_room`, waits (at most `pending_max`
    /// batches queue) for room; without, a job that does not fit is `Busy`.
    pub fn submit(
        &self,
        job: CopyJob,
        on_batch: Option<OnBatch>,
        wait_for_room: bool,
    ) -> Result<CopyTicket, CoreError> {
        let shared = &self.shared;
        let (src, dst) = match job.direction {
            Direction::DeviceToHost => (&shared.gpu, &shared.host),
            Direction::HostToDevice => (&shared.host, &shared.gpu),
        };
        let (ns, nd) = (src.layout.num_blocks(), dst.layout.num_blocks());
        if let Some(&(s, d)) = job
            .pairs
            .iter()
            .find(|&&(s, d)| s as usize >= ns || d as usize >= nd)
        {
            return Err(CoreError::InvalidArgument(format!(
                "{} copy of block {s} into block {d}: outside {ns} source / {nd} target blocks",
                job.direction.as_str()
            )));
        }
        let per = shared.limits.batch_blocks_max;
        let batches = job.pairs.len().div_ceil(per);
        let ticket = CopyTicket::new(batches);
        if batches == 0 {
            return Ok(ticket);
        }
        let lane = lane_of(job.direction);
        let mut state = shared.state.lock();
        loop {
            if state.shutdown {
                return Err(CoreError::EngineClosed);
            }
            let queued = state.lanes[lane].pending.len();
            let room = shared.limits.pending_max.saturating_sub(queued);
            // A job larger than the whole queue goes in once the queue is empty.
            if room >= batches || (queued == 0 && wait_for_room) {
                break;
            }
            if !wait_for_room {
                return Err(CoreError::Busy(format!(
                    "{batches} copy batches queued against room for {room}"
                )));
            }
            shared.done_cv.wait(&mut state);
        }
        let on_batch = on_batch.map(Arc::new);
        for (i, chunk) in job.pairs.chunks(per).enumerate() {
            state.lanes[lane].pending.push_back(Batch {
                direction: job.direction,
                pairs: chunk.to_vec(),
                stage: job.stage,
                range: i * per..i * per + chunk.len(),
                ticket: ticket.clone(),
                on_batch: on_batch.clone(),
            });
        }
        let failed = launch_ready(shared, &mut state, job.direction);
        state.lanes[lane].failed.extend(failed);
        shared.work_cv.notify_all();
        Ok(ticket)
    }

    /// Waits until no batch is queued, in flight or settling.
    pub fn wait_idle(&self) {
        let mut state = self.shared.state.lock();
        while !(state
            .lanes
            .iter()
            .all(|l| l.pending.is_empty() && l.inflight.is_empty() && l.failed.is_empty())
            && state.settling == 0)
        {
            self.shared.done_cv.wait(&mut state);
        }
    }

    /// (queued, in flight) batches now.
    pub fn queue_depths(&self) -> (usize, usize) {
        let state = self.shared.state.lock();
        state.lanes.iter().fold((0, 0), |(p, i), l| {
            (p + l.pending.len(), i + l.inflight.len())
        })
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        // Queued batches still run: their callbacks release what they hold.
        self.wait_idle();
        self.shared.state.lock().shutdown = true;
        self.shared.work_cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The transfer of one batch: its pairs' pieces, keeping both sides' regions alive.
fn build_transfer(src: &CopySide, dst: &CopySide, batch: &Batch) -> Result<Transfer, CoreError> {
    let runs = src.layout.runs_per_block().max(dst.layout.runs_per_block());
    let mut pieces = Vec::with_capacity(batch.pairs.len() * runs);
    for &(s, d) in &batch.pairs {
        match batch.stage {
            None => {
                src.layout
                    .copy_pieces_into(s as usize, &dst.layout, d as usize, &mut pieces)?
            }
            Some(stage) => src.layout.copy_runs_into(
                s as usize,
                &dst.layout,
                d as usize,
                |(_, last)| last == stage,
                &mut pieces,
            )?,
        }
    }
    let mut transfer = Transfer::with_capacity(pieces.len());
    for p in pieces {
        transfer.push(p.src, p.dst, p.len);
    }
    for region in src.regions.iter().chain(&dst.regions) {
        transfer.keep(region.clone());
    }
    Ok(transfer)
}

/// Submits `direction`'s queued batches while its stream slots are free; returns the batches
/// that failed to submit (to settle once the lock is released).
fn launch_ready(
    shared: &Shared,
    state: &mut EngineState,
    direction: Direction,
) -> Vec<(Batch, BatchDone)> {
    let mut failed = Vec::new();
    let lane = &mut state.lanes[lane_of(direction)];
    let (src, dst, stream) = match direction {
        Direction::DeviceToHost => (&shared.gpu, &shared.host, &shared.d2h),
        Direction::HostToDevice => (&shared.host, &shared.gpu, &shared.h2d),
    };
    while lane.inflight.len() < shared.limits.inflight_max {
        let Some(batch) = lane.pending.pop_front() else {
            break;
        };
        let submitted = build_transfer(src, dst, &batch).and_then(|t| {
            let bytes = t.bytes();
            stream
                .submit(t)
                .map(|c| (c, bytes))
                .map_err(CoreError::from)
        });
        match submitted {
            Ok((completion, bytes)) => lane.inflight.push_back(InFlight {
                batch,
                completion,
                bytes,
                started: Instant::now(),
            }),
            Err(err) => {
                let done = BatchDone {
                    range: batch.range.clone(),
                    pairs: Vec::new(),
                    latency: Duration::ZERO,
                    bytes: 0,
                    error: Some(CoreError::TransferFailed(err.to_string())),
                };
                failed.push((batch, done));
            }
        }
    }
    state.settling += failed.len();
    failed
}

/// Reports finished batches (no engine lock held): metrics, callback, then ticket.
fn settle(shared: &Shared, finished: Vec<(Batch, BatchDone)>) {
    if finished.is_empty() {
        return;
    }
    let n = finished.len();
    for (mut batch, done) in finished {
        let m = &shared.metrics;
        match (&done.error, batch.direction) {
            (Some(err), d) => {
                tracing::warn!(direction = d.as_str(), blocks = batch.pairs.len(), error = %err, "copy batch failed");
                add(&m.transfer_errors, 1);
            }
            (None, Direction::DeviceToHost) => {
                m.latency_d2h.observe(done.latency);
                add(&m.bytes_d2h, done.bytes);
            }
            (None, Direction::HostToDevice) => {
                m.latency_h2d.observe(done.latency);
                add(&m.bytes_h2d, done.bytes);
            }
        }
        if let Some(cb) = &batch.on_batch {
            let copy = BatchDone {
                range: done.range.clone(),
                pairs: std::mem::take(&mut batch.pairs),
                latency: done.latency,
                bytes: done.bytes,
                error: done.error.clone(),
            };
            // A callback that panics must not take the progress thread (and every waiter on a
            // ticket) with it: the panic is logged and the batch still counts as done.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(copy)));
            if ran.is_err() {
                tracing::error!("a copy batch's callback panicked; the batch is settled anyway");
            }
        }
        batch.ticket.finish(&done);
    }
    let mut state = shared.state.lock();
    state.settling -= n;
    shared.done_cv.notify_all();
}

/// `direction`'s progress thread: waits on its oldest batch in flight (one stream completes in
/// order) with no lock held, settles what finished, launches what waits. The thread of the
/// lane's thread also settles its batches that failed to launch from a submitter.
fn progress_loop(shared: &Shared, direction: Direction) {
    let lane = lane_of(direction);
    loop {
        let oldest = {
            let mut state = shared.state.lock();
            loop {
                if !state.lanes[lane].failed.is_empty() {
                    let failed = std::mem::take(&mut state.lanes[lane].failed);
                    drop(state);
                    settle(shared, failed);
                    state = shared.state.lock();
                    continue;
                }
                if let Some(front) = state.lanes[lane].inflight.front() {
                    break front.completion.clone();
                }
                if !state.lanes[lane].pending.is_empty() {
                    let failed = launch_ready(shared, &mut state, direction);
                    if !failed.is_empty() {
                        drop(state);
                        settle(shared, failed);
                        state = shared.state.lock();
                    }
                    continue;
                }
                shared.done_cv.notify_all();
                if state.shutdown {
                    return;
                }
                shared.work_cv.wait(&mut state);
            }
        };
        // No lock held while the copy runs.
        let _ = oldest.wait();
        let mut finished = Vec::new();
        {
            let mut state = shared.state.lock();
            let inflight = &mut state.lanes[lane].inflight;
            let mut i = 0;
            while i < inflight.len() {
                let error = match inflight[i].completion.poll() {
                    Ok(false) => {
                        i += 1;
                        continue;
                    }
                    Ok(true) => None,
                    Err(e) => Some(CoreError::TransferFailed(e.to_string())),
                };
                let f = inflight.remove(i).expect("index in range");
                let done = BatchDone {
                    range: f.batch.range.clone(),
                    pairs: Vec::new(),
                    latency: f.started.elapsed(),
                    bytes: f.bytes,
                    error,
                };
                finished.push((f.batch, done));
            }
            state.settling += finished.len();
            let failed = launch_ready(shared, &mut state, direction);
            finished.extend(failed);
        }
        settle(shared, finished);
    }
}
