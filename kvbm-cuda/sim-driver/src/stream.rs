//! Streams and events. Each stream is a worker thread running its operations in FIFO order,
//! asynchronously to the caller; an event completes when the stream it was recorded on reaches
//! it; a stream waiting on an event runs nothing after the wait until that event completes.
//!
//! Invariants:
//! - `enqueued` counts operations handed to the worker, `done` those it finished; a stream is
//!   idle exactly when they are equal, and `done` never passes `enqueued`.
//! - An event's `completed` generation never passes its `recorded` generation; an event never
//!   recorded counts as complete (as CUDA's does).
//! - A copy is handed to a worker only after both of its ranges were checked (see `api`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Duration;

use crate::config::config;
use crate::faults::{self, Kind};
use crate::memory::POISON;
use crate::result::*;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One contiguous copy, already checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Copy {
    pub dst: u64,
    pub src: u64,
    pub len: usize,
}

enum Op {
    Copies(Vec<Copy>),
    Record(Arc<Event>, u64),
    Wait(Arc<Event>, u64),
    Hold(Arc<Gate>),
}

/// A gate a held stream waits at until the [`StreamHold`] holding it drops.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

/// Keeps a stream from running anything queued after [`hold_stream`] until dropped, so that a
/// test can observe work in flight deterministically.
pub struct StreamHold {
    gate: Arc<Gate>,
}

impl std::fmt::Debug for StreamHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamHold").finish_non_exhaustive()
    }
}

impl Drop for StreamHold {
    fn drop(&mut self) {
        *lock(&self.gate.open) = true;
        self.gate.cv.notify_all();
    }
}

/// Holds the stream `h` (a `CUstream` handle; 0 for the default stream) at this point of its
/// queue until the returned guard drops. Not a CUDA function: for the simulator's own tests.
pub fn hold_stream(h: usize) -> Result<StreamHold, CUresult> {
    let gate = Arc::new(Gate::default());
    stream(h)?.enqueue(Op::Hold(gate.clone()))?;
    Ok(StreamHold { gate })
}

/// Waits until the stream `h` has run (or, on a lost context, skipped) everything queued on it,
/// whatever the context's state. Not a CUDA function: for the simulator's own tests, since every
/// CUDA call returns at once on a lost context.
pub fn drain_stream(h: usize) -> Result<(), CUresult> {
    stream(h)?.synchronize();
    Ok(())
}

#[derive(Default)]
struct Progress {
    enqueued: u64,
    done: u64,
    /// The copies of queued operations not yet finished, oldest first.
    pending: std::collections::VecDeque<Vec<Copy>>,
}

pub(crate) struct Stream {
    tx: Mutex<Option<Sender<Op>>>,
    progress: Mutex<Progress>,
    progress_cv: Condvar,
}

#[derive(Default)]
struct EventState {
    recorded: u64,
    completed: u64,
}

#[derive(Default)]
pub(crate) struct Event {
    state: Mutex<EventState>,
    cv: Condvar,
}

impl Event {
    /// True when every recorded generation has completed.
    pub fn is_complete(&self) -> bool {
        let state = lock(&self.state);
        state.completed >= state.recorded
    }

    /// Blocks until every generation recorded so far has completed.
    pub fn synchronize(&self) {
        let mut state = lock(&self.state);
        let target = state.recorded;
        while state.completed < target {
            state = self.cv.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn complete(&self, generation: u64) {
        let mut state = lock(&self.state);
        state.completed = state.completed.max(generation);
        self.cv.notify_all();
    }

    fn wait_for(&self, generation: u64) {
        let mut state = lock(&self.state);
        while state.completed < generation {
            state = self.cv.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Stream {
    fn spawn(id: u64) -> Result<Arc<Stream>, CUresult> {
        let (tx, rx) = channel::<Op>();
        let stream = Arc::new(Stream {
            tx: Mutex::new(Some(tx)),
            progress: Mutex::new(Progress::default()),
            progress_cv: Condvar::new(),
        });
        let worker = stream.clone();
        std::thread::Builder::new()
            .name(format!("cuda-sim-stream-{id}"))
            .spawn(move || {
                let mut jitter = config()
                    .jitter
                    .map(|(seed, us_max)| Jitter::new(seed, id, us_max));
                // The worker owns an Arc of the stream but only the sender ends the loop: it is
                // dropped by `destroy` once the caller lets go of the stream.
                while let Ok(op) = rx.recv() {
                    let copies = matches!(op, Op::Copies(_));
                    // Copies touch caller memory only under a read guard of TOUCHING, and not
                    // at all once the context is lost (see `quiesce`).
                    let touching =
                        copies.then(|| TOUCHING.read().unwrap_or_else(|e| e.into_inner()));
                    if let Some(j) = &mut jitter {
                        // A copy in progress leaves its target undefined: poison it for the
                        // pause, so that a reader who did not wait sees wrong bytes.
                        if let Op::Copies(copies) = &op {
                            if sticky_error().is_none() {
                                poison_targets(copies);
                            }
                        }
                        j.pause();
                    }
                    worker.run(op);
                    drop(touching);
                    let mut progress = lock(&worker.progress);
                    if copies {
                        progress.pending.pop_front();
                    }
                    progress.done += 1;
                    worker.progress_cv.notify_all();
                }
            })
            .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        Ok(stream)
    }

    fn run(&self, op: Op) {
        match op {
            Op::Copies(copies) => {
                if let Err(code) = faults::check(Kind::Async) {
                    let _ = STICKY.compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
                }
                if sticky_error().is_some() {
                    return; // the context is lost: nothing runs any more
                }
                for c in copies {
                    // SAFETY: the ranges were checked at enqueue to lie inside live device
                    // allocations or host memory the caller vouched for; the caller must keep
                    // them alive until the stream passes this copy (as on a real GPU).
                    unsafe { std::ptr::copy(c.src as *const u8, c.dst as *mut u8, c.len) };
                }
            }
            Op::Record(event, generation) => event.complete(generation),
            Op::Wait(event, generation) => event.wait_for(generation),
            Op::Hold(gate) => {
                let mut open = lock(&gate.open);
                while !*open {
                    open = gate.cv.wait(open).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }

    fn enqueue(&self, op: Op) -> Result<(), CUresult> {
        let tx = lock(&self.tx);
        let Some(tx) = tx.as_ref() else {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        };
        // Counted and sent under one lock, so `pending` is in the worker's order.
        let mut progress = lock(&self.progress);
        if let Op::Copies(copies) = &op {
            progress.pending.push_back(copies.clone());
        }
        progress.enqueued += 1;
        tx.send(op).map_err(|_| CUDA_ERROR_INVALID_HANDLE)
    }

    pub fn copy(&self, copies: Vec<Copy>) -> Result<(), CUresult> {
        if lock(&self.tx).is_none() {
            return Err(CUDA_ERROR_INVALID_HANDLE); // refused before anything is touched
        }
        poison_queued_targets(&copies);
        self.enqueue(Op::Copies(copies))
    }

    /// Appends the ranges (both sides) of this stream's unfinished copies to `out`.
    fn pending_ranges(&self, out: &mut Vec<(u64, u64)>) {
        for c in lock(&self.progress).pending.iter().flatten() {
            out.push((c.src, c.src + c.len as u64));
            out.push((c.dst, c.dst + c.len as u64));
        }
    }

    pub fn record(&self, event: &Arc<Event>) -> Result<(), CUresult> {
        let generation = {
            let mut state = lock(&event.state);
            state.recorded += 1;
            state.recorded
        };
        self.enqueue(Op::Record(event.clone(), generation))
    }

    pub fn wait_event(&self, event: &Arc<Event>) -> Result<(), CUresult> {
        let generation = lock(&event.state).recorded;
        self.enqueue(Op::Wait(event.clone(), generation))
    }

    /// A queued, unfinished copy with a side overlapping `[start, start + len)`, if any.
    fn pending_touching(&self, start: u64, len: usize) -> Option<Copy> {
        let end = start + len as u64;
        let overlaps = |addr: u64, n: usize| addr < end && start < addr + n as u64;
        lock(&self.progress)
            .pending
            .iter()
            .flatten()
            .find(|c| overlaps(c.src, c.len) || overlaps(c.dst, c.len))
            .copied()
    }

    /// True when every operation enqueued so far has run.
    pub fn is_idle(&self) -> bool {
        let progress = lock(&self.progress);
        progress.done >= progress.enqueued
    }

    /// Blocks until every operation enqueued so far has run.
    pub fn synchronize(&self) {
        let mut progress = lock(&self.progress);
        let target = progress.enqueued;
        while progress.done < target {
            progress = self
                .progress_cv
                .wait(progress)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Stops accepting work; the worker finishes what is queued and exits.
    fn close(&self) {
        lock(&self.tx).take();
    }
}

/// The sticky error of a copy that failed on its stream (0: none).
static STICKY: AtomicU32 = AtomicU32::new(0);

/// The error that lost the context, if a copy failed on its stream.
pub(crate) fn sticky_error() -> Option<CUresult> {
    match STICKY.load(Ordering::SeqCst) {
        0 => None,
        code => Some(code),
    }
}

/// Held for reading by a worker while it poisons or copies caller memory.
static TOUCHING: RwLock<()> = RwLock::new(());

/// Once the context is lost, waits until no worker is in the middle of a copy; none starts one
/// afterwards. Every call that needs the context does this before it returns the sticky error,
/// so that a caller releasing memory after a failure (as kvbm-cuda does) never has a worker
/// write into memory it already unmapped: on a GPU nothing runs on a lost context either.
pub(crate) fn quiesce() {
    if sticky_error().is_some() {
        drop(TOUCHING.write().unwrap_or_else(|e| e.into_inner()));
    }
}

/// At enqueue: a queued copy's target is undefined until the copy completes, so it is poisoned
/// now, and a host that reads it without waiting (the classic missing wait) sees [`POISON`]
/// rather than plausible old bytes. Not where an unfinished copy of any stream still touches the
/// range (an earlier copy may legitimately still read it), nor where the copy's own sources lie.
fn poison_queued_targets(copies: &[Copy]) {
    if sticky_error().is_some() {
        return; // the copy will never run
    }
    // Everything a target must not overlap: both sides of every unfinished copy of every
    // stream, and this operation's sources.
    let mut busy: Vec<(u64, u64)> = sources(copies);
    if let Ok(streams) = all_streams() {
        for stream in streams {
            stream.pending_ranges(&mut busy);
        }
    }
    poison_clear_of(copies, busy);
}

/// The source ranges of `copies`.
fn sources(copies: &[Copy]) -> Vec<(u64, u64)> {
    copies
        .iter()
        .map(|c| (c.src, c.src + c.len as u64))
        .collect()
}

/// Fills with [`POISON`] each target of `copies` that overlaps none of the `busy` ranges.
/// O((copies + busy) log busy).
fn poison_clear_of(copies: &[Copy], mut busy: Vec<(u64, u64)>) {
    busy.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(busy.len());
    for (start, end) in busy {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    for c in copies {
        let (start, end) = (c.dst, c.dst + c.len as u64);
        // The first busy range ending after `start` (ends increase along disjoint ranges).
        let i = merged.partition_point(|r| r.1 <= start);
        if merged.get(i).is_some_and(|r| r.0 < end) {
            continue;
        }
        // SAFETY: the target was checked by the caller (`api`) to lie inside a live allocation
        // or a host range the caller vouched for (and kept alive until the copy completes), and
        // no busy range (a source of this operation, or memory an unfinished copy touches) lies
        // in it.
        unsafe { std::ptr::write_bytes(c.dst as *mut u8, POISON, c.len) };
    }
}

/// Fills each copy's target with [`POISON`], unless it overlaps a source of the same operation.
fn poison_targets(copies: &[Copy]) {
    poison_clear_of(copies, sources(copies));
}

/// A per-stream delay before each operation, from a seeded xorshift generator, so that a missing
/// wait shows up as wrong bytes on some seeds, reproducibly for the same schedule.
struct Jitter {
    state: u64,
    us_max: u64,
}

impl Jitter {
    fn new(seed: u64, stream_id: u64, us_max: u64) -> Self {
        let state = (seed ^ stream_id.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        Self { state, us_max }
    }

    fn pause(&mut self) {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        if self.us_max > 0 {
            std::thread::sleep(Duration::from_micros(self.state % (self.us_max + 1)));
        }
    }
}

/// Handle tables: a handle is an id shifted away from 0, 1 and 2 (the null, legacy and
/// per-thread default streams), so a destroyed or made-up handle is recognised as such.
struct Tables {
    next_id: u64,
    streams: HashMap<usize, Arc<Stream>>,
    /// Destroyed streams whose workers may still run queued work (as CUDA lets them).
    closing: Vec<Arc<Stream>>,
    events: HashMap<usize, Arc<Event>>,
}

fn tables() -> MutexGuard<'static, Tables> {
    static TABLES: OnceLock<Mutex<Tables>> = OnceLock::new();
    lock(TABLES.get_or_init(|| {
        Mutex::new(Tables {
            next_id: 1,
            streams: HashMap::new(),
            closing: Vec::new(),
            events: HashMap::new(),
        })
    }))
}

const STREAM_TAG: usize = 0x5;
const EVENT_TAG: usize = 0xE;

fn handle(id: u64, tag: usize) -> usize {
    ((id as usize) << 4) | tag
}

/// The stream behind the null, legacy (1) or per-thread (2) default stream handle.
fn default_stream() -> Result<Arc<Stream>, CUresult> {
    // Spawned once, under the lock: a second worker would block forever on its own channel.
    static DEFAULT: OnceLock<Result<Arc<Stream>, CUresult>> = OnceLock::new();
    DEFAULT.get_or_init(|| Stream::spawn(0)).clone()
}

/// True for the null, legacy and per-thread default stream handles.
pub(crate) fn is_default_handle(h: usize) -> bool {
    h <= 2
}

pub(crate) fn create_stream() -> Result<usize, CUresult> {
    let mut tables = tables();
    let id = tables.next_id;
    tables.next_id += 1;
    let stream = Stream::spawn(id)?;
    let h = handle(id, STREAM_TAG);
    tables.streams.insert(h, stream);
    Ok(h)
}

pub(crate) fn stream(h: usize) -> Result<Arc<Stream>, CUresult> {
    if is_default_handle(h) {
        return default_stream();
    }
    tables()
        .streams
        .get(&h)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

pub(crate) fn destroy_stream(h: usize) -> Result<(), CUresult> {
    let stream = tables()
        .streams
        .remove(&h)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    stream.close();
    tables().closing.push(stream);
    Ok(())
}

/// A queued, unfinished copy on any live stream that touches `[start, start + len)`.
pub(crate) fn pending_touching(start: u64, len: usize) -> Option<Copy> {
    all_streams()
        .ok()?
        .iter()
        .find_map(|s| s.pending_touching(start, len))
}

/// Every stream with work, the default one and destroyed ones still draining included.
pub(crate) fn all_streams() -> Result<Vec<Arc<Stream>>, CUresult> {
    let (mut all, closing) = {
        let mut tables = tables();
        let live: Vec<Arc<Stream>> = tables.streams.values().cloned().collect();
        (live, std::mem::take(&mut tables.closing))
    };
    // Idle destroyed streams are forgotten (checked without the tables lock held).
    let draining: Vec<Arc<Stream>> = closing.into_iter().filter(|s| !s.is_idle()).collect();
    tables().closing.extend(draining.iter().cloned());
    all.extend(draining);
    all.push(default_stream()?);
    Ok(all)
}

pub(crate) fn create_event() -> usize {
    let mut tables = tables();
    let id = tables.next_id;
    tables.next_id += 1;
    let h = handle(id, EVENT_TAG);
    tables.events.insert(h, Arc::new(Event::default()));
    h
}

pub(crate) fn event(h: usize) -> Result<Arc<Event>, CUresult> {
    tables()
        .events
        .get(&h)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

pub(crate) fn destroy_event(h: usize) -> Result<(), CUresult> {
    tables()
        .events
        .remove(&h)
        .map(drop)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}
