//! Copy streams: ordered queues of transfers in one direction, each finished by a [`Completion`].
//!
//! Invariants:
//! - Transfers on one stream complete in submission order (CUDA stream semantics; the emulated
//!   stream has one worker per stream).
//! - The stream, not the caller, holds a transfer's regions until the stream has seen the
//!   transfer complete (STYLE.md habit 5).
//! - A submit is validated before anything is queued: every piece inside the transfer's regions
//!   of the right kind, host bytes inside the ready prefix, nothing of length 0.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::cuda::{CudaBackend, CudaCompletion, CudaCopyStream};
use crate::emulated::EmulatedStream;
use crate::region::Region;
use crate::DeviceError;

/// Most transfers queued on one stream before `submit` waits for the oldest.
pub const STREAM_QUEUE_MAX: usize = 256;
/// Environment variable: `0` turns coalescing of adjacent pieces off (default on).
pub const COALESCE_ENV: &str = "KVBM_COPY_COALESCE";
/// Environment variable: `0` turns `cuMemcpyBatchAsync` off (default: on where the driver has it).
pub const BATCH_COPY_ENV: &str = "KVBM_COPY_BATCH";

/// The two directions kvbm copies in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// GPU to pinned host (offload).
    DeviceToHost,
    /// Pinned host to GPU (onboard).
    HostToDevice,
}

impl Direction {
    /// "d2h" or "h2d".
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::DeviceToHost => "d2h",
            Direction::HostToDevice => "h2d",
        }
    }
}

/// One contiguous copy: `len` bytes from address `src` to address `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPiece {
    /// Source address.
    pub src: u64,
    /// Target address.
    pub dst: u64,
    /// Bytes.
    pub len: usize,
}

/// A batch of copies in one direction, with the regions they read and write.
#[derive(Debug, Default)]
pub struct Transfer {
    pieces: Vec<CopyPiece>,
    regions: Vec<Region>,
}

impl Transfer {
    /// An empty transfer with room for `pieces` pieces.
    pub fn with_capacity(pieces: usize) -> Self {
        Self {
            pieces: Vec::with_capacity(pieces),
            regions: Vec::new(),
        }
    }

    /// Adds a piece.
    pub fn push(&mut self, src: u64, dst: u64, len: usize) {
        self.pieces.push(CopyPiece { src, dst, len });
    }

    /// Adds a region the pieces may read or write; the stream keeps it alive until completion.
    pub fn keep(&mut self, region: impl Into<Region>) {
        self.regions.push(region.into());
    }

    /// The pieces, in submission order.
    pub fn pieces(&self) -> &[CopyPiece] {
        &self.pieces
    }

    /// Total bytes copied.
    pub fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len as u64).sum()
    }
}

/// Merges consecutive pieces that continue each other on both sides; returns the new count.
pub fn coalesce(pieces: &mut Vec<CopyPiece>) -> usize {
    let mut out = 0usize;
    for i in 0..pieces.len() {
        let p = pieces[i];
        if out > 0 {
            let last = &mut pieces[out - 1];
            if last.src + last.len as u64 == p.src && last.dst + last.len as u64 == p.dst {
                last.len += p.len;
                continue;
            }
        }
        pieces[out] = p;
        out += 1;
    }
    pieces.truncate(out);
    out
}

/// How a stream copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamOptions {
    /// Merge adjacent pieces before copying. Default true.
    pub coalesce: bool,
    /// Use `cuMemcpyBatchAsync` where the driver has it (CUDA 12.8+). Default true.
    pub batch_copy: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            coalesce: true,
            batch_copy: true,
        }
    }
}

impl StreamOptions {
    /// Defaults, overridden by [`COALESCE_ENV`] and [`BATCH_COPY_ENV`] (`0`/`1`/`false`/`true`).
    pub fn from_env() -> Result<Self, DeviceError> {
        let mut options = Self::default();
        if let Some(v) = env_flag(COALESCE_ENV)? {
            options.coalesce = v;
        }
        if let Some(v) = env_flag(BATCH_COPY_ENV)? {
            options.batch_copy = v;
        }
        Ok(options)
    }
}

fn env_flag(name: &str) -> Result<Option<bool>, DeviceError> {
    let Ok(value) = std::env::var(name) else {
        return Ok(None);
    };
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(Some(true)),
        "0" | "false" | "off" | "no" => Ok(Some(false)),
        _ => Err(DeviceError::InvalidArgument(format!(
            "{name}={value:?}: expected 0 or 1"
        ))),
    }
}

/// Counters of one stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Transfers submitted.
    pub transfers: u64,
    /// Pieces as submitted.
    pub pieces_submitted: u64,
    /// Copies issued after coalescing.
    pub copies_issued: u64,
    /// Bytes submitted.
    pub bytes: u64,
}

#[derive(Default)]
struct StatCounters {
    transfers: AtomicU64,
    pieces_submitted: AtomicU64,
    copies_issued: AtomicU64,
    bytes: AtomicU64,
}

enum Backend {
    Emulated(EmulatedStream),
    Cuda(CudaCopyStream),
}

/// An ordered queue of transfers in one direction.
pub struct CopyStream {
    direction: Direction,
    options: StreamOptions,
    backend: Backend,
    stats: StatCounters,
}

impl std::fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyStream")
            .field("direction", &self.direction)
            .field("options", &self.options)
            .field("stats", &self.stats())
            .finish()
    }
}

impl CopyStream {
    pub(crate) fn emulated(
        direction: Direction,
        options: StreamOptions,
    ) -> Result<Self, DeviceError> {
        let backend = Backend::Emulated(EmulatedStream::new(direction)?);
        Ok(Self::with_backend(direction, options, backend))
    }

    pub(crate) fn cuda(
        cuda: &CudaBackend,
        direction: Direction,
        options: StreamOptions,
    ) -> Result<Self, DeviceError> {
        let backend = Backend::Cuda(CudaCopyStream::new(cuda, options.batch_copy)?);
        Ok(Self::with_backend(direction, options, backend))
    }

    fn with_backend(direction: Direction, options: StreamOptions, backend: Backend) -> Self {
        Self {
            direction,
            options,
            backend,
            stats: StatCounters::default(),
        }
    }

    /// The direction of every transfer on this stream.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// Whether this stream issues batched copies (`cuMemcpyBatchAsync`).
    pub fn uses_batch_copy(&self) -> bool {
        match &self.backend {
            Backend::Emulated(_) => false,
            Backend::Cuda(s) => s.uses_batch_copy(),
        }
    }

    /// Validates and queues `transfer`. The returned completion can be polled or waited on;
    /// dropping it does not cancel the copy.
    pub fn submit(&self, transfer: Transfer) -> Result<Completion, DeviceError> {
        let Transfer {
            mut pieces,
            regions,
        } = transfer;
        let sides = Sides::of(self.direction, &regions);
        validate(&sides, &pieces)?;
        let submitted = pieces.len() as u64;
        let bytes: u64 = pieces.iter().map(|p| p.len as u64).sum();
        fit_to_segments(&sides, &mut pieces, self.options.coalesce);
        self.stats.transfers.fetch_add(1, Ordering::Relaxed);
        self.stats
            .pieces_submitted
            .fetch_add(submitted, Ordering::Relaxed);
        self.stats
            .copies_issued
            .fetch_add(pieces.len() as u64, Ordering::Relaxed);
        self.stats.bytes.fetch_add(bytes, Ordering::Relaxed);
        match &self.backend {
            Backend::Emulated(s) => s.submit(pieces, regions).map(Completion::signal),
            Backend::Cuda(s) => s
                .submit(self.direction, &pieces, regions)
                .map(Completion::cuda),
        }
    }

    /// Orders this stream's later transfers after everything queued so far on the engine's
    /// CUDA stream `foreign` (a `CUstream` handle of the same context; 0 for the legacy default
    /// stream), on the device, without the host waiting. The emulated device has no such
    /// stream (the engine's writes are done when its host call returns): nothing to do.
    pub fn order_after_stream(&self, foreign: u64) -> Result<(), DeviceError> {
        match &self.backend {
            Backend::Emulated(_) => Ok(()),
            Backend::Cuda(s) => s.order_after(foreign),
        }
    }

    /// The reverse of [`Self::order_after_stream`]: makes the engine's CUDA stream `foreign`
    /// wait, on the device, for every transfer queued so far on this stream (an event recorded
    /// here, waited on there), so that the engine's later work (vLLM zeroing and overwriting
    /// blocks it freed) cannot run before these copies read them. The host does not wait.
    /// Returns false on the emulated device, which has no engine stream: the caller must wait
    /// for the transfers on the host instead.
    pub fn make_stream_wait(&self, foreign: u64) -> Result<bool, DeviceError> {
        match &self.backend {
            Backend::Emulated(_) => Ok(false),
            Backend::Cuda(s) => s.make_wait(foreign).map(|()| true),
        }
    }

    /// Holds the stream before its next transfer until the returned guard drops, so that a
    /// test can keep copies queued (in flight, for everything above) as long as it needs.
    /// Only the emulated device can: on CUDA this is `InvalidArgument`.
    pub fn hold(&self) -> Result<crate::emulated::StreamHold, DeviceError> {
        match &self.backend {
            Backend::Emulated(s) => Ok(s.hold()),
            Backend::Cuda(_) => Err(DeviceError::InvalidArgument(
                "only an emulated copy stream can be held".into(),
            )),
        }
    }

    /// Fails the next `n` transfers this stream starts, as a DMA fault would (nothing copied,
    /// the completion reports a driver error), for tests of every failure path above. Only the
    /// emulated device can: on CUDA this is `InvalidArgument`.
    pub fn fail_next(&self, n: usize) -> Result<(), DeviceError> {
        match &self.backend {
            Backend::Emulated(s) => {
                s.fail_next(n);
                Ok(())
            }
            Backend::Cuda(_) => Err(DeviceError::InvalidArgument(
                "only an emulated copy stream can inject faults".into(),
            )),
        }
    }

    /// Counters since the stream was created.
    pub fn stats(&self) -> StreamStats {
        StreamStats {
            transfers: self.stats.transfers.load(Ordering::Relaxed),
            pieces_submitted: self.stats.pieces_submitted.load(Ordering::Relaxed),
            copies_issued: self.stats.copies_issued.load(Ordering::Relaxed),
            bytes: self.stats.bytes.load(Ordering::Relaxed),
        }
    }
}

/// One region a transfer touches, as its pieces are checked and fitted against it.
#[derive(Clone, Copy)]
struct Span {
    start: u64,
    end: u64,
    /// The end of the ready (pinned) prefix; `end` for GPU memory.
    ready_end: u64,
    /// The segment size: a single driver copy stays inside one segment. A GPU region is one
    /// segment; a host region is one per pinning chunk (each chunk is its own
    /// `cuMemHostRegister` range, and a real driver handles a copy reaching past its range as
    /// pageable memory, or refuses it).
    chunk: u64,
}

impl Span {
    /// The end of the segment holding `addr`, which lies in this span.
    fn segment_end(&self, addr: u64) -> u64 {
        let chunk_end = ((addr - self.start) / self.chunk)
            .checked_add(1)
            .and_then(|n| n.checked_mul(self.chunk))
            .and_then(|off| self.start.checked_add(off))
            .unwrap_or(u64::MAX);
        chunk_end.min(self.end)
    }
}

/// The spans of a transfer's source and target sides, each sorted by start; built once per
/// submission, for [`validate`] and then [`fit_to_segments`].
struct Sides {
    src: Vec<Span>,
    dst: Vec<Span>,
}

impl Sides {
    fn of(direction: Direction, regions: &[Region]) -> Self {
        let side = |want_gpu: bool| {
            let mut spans: Vec<Span> = regions
                .iter()
                .filter_map(|r| match (r, want_gpu) {
                    (Region::Gpu(g), true) => Some(Span {
                        start: g.addr(),
                        end: g.addr() + g.len() as u64,
                        ready_end: g.addr() + g.len() as u64,
                        chunk: u64::MAX,
                    }),
                    (Region::Host(h), false) => Some(Span {
                        start: h.addr(),
                        end: h.addr() + h.len() as u64,
                        ready_end: h.addr() + h.ready_bytes() as u64,
                        chunk: h.chunk_bytes() as u64,
                    }),
                    _ => None,
                })
                .collect();
            spans.sort_unstable_by_key(|s| (s.start, s.end));
            spans
        };
        let (gpu, host) = (side(true), side(false));
        match direction {
            Direction::DeviceToHost => Self {
                src: gpu,
                dst: host,
            },
            Direction::HostToDevice => Self {
                src: host,
                dst: gpu,
            },
        }
    }
}

/// The span whose start is the last at or before `addr`, if any.
fn holding(spans: &[Span], addr: u64) -> Option<&Span> {
    let i = spans.partition_point(|s| s.start <= addr);
    i.checked_sub(1).map(|i| &spans[i])
}

/// Ok when `[addr, addr+len)` is inside one span and inside its ready prefix; `Err(Some(ready))`
/// when inside but not ready yet; `Err(None)` when outside every span.
fn find_span(spans: &[Span], addr: u64, len: usize) -> Result<(), Option<u64>> {
    let span = holding(spans, addr).ok_or(None)?;
    let piece_end = addr.checked_add(len as u64).ok_or(None)?;
    if piece_end > span.end {
        return Err(None);
    }
    if piece_end > span.ready_end {
        return Err(Some(span.ready_end - span.start));
    }
    Ok(())
}

fn validate(sides: &Sides, pieces: &[CopyPiece]) -> Result<(), DeviceError> {
    for (index, p) in pieces.iter().enumerate() {
        if p.len == 0 {
            return Err(DeviceError::InvalidArgument(format!(
                "copy piece {index} has length 0"
            )));
        }
        for (side, spans, addr) in [("source", &sides.src, p.src), ("target", &sides.dst, p.dst)] {
            match find_span(spans, addr, p.len) {
                Ok(()) => {}
                Err(None) => {
                    return Err(DeviceError::OutOfBounds {
                        index,
                        src: p.src,
                        dst: p.dst,
                        len: p.len,
                        side,
                    })
                }
                Err(Some(ready_bytes)) => {
                    return Err(DeviceError::NotReady {
                        index,
                        ready_bytes: ready_bytes as usize,
                    })
                }
            }
        }
    }
    Ok(())
}

/// Makes each piece lie inside one segment on both sides (see [`Span::chunk`]): a piece
/// crossing a boundary is split there, and with `merge`, consecutive pieces that continue each
/// other on both sides are merged as [`coalesce`] does, but never across a boundary. For pieces
/// [`validate`] accepted.
fn fit_to_segments(sides: &Sides, pieces: &mut Vec<CopyPiece>, merge: bool) {
    // How far the piece starting at (s, d) may reach.
    let limit = |s: u64, d: u64| {
        let end = |spans: &[Span], a: u64| holding(spans, a).map_or(u64::MAX, |x| x.segment_end(a));
        (end(&sides.src, s) - s).min(end(&sides.dst, d) - d)
    };
    if !merge && pieces.iter().all(|p| p.len as u64 <= limit(p.src, p.dst)) {
        return;
    }
    let mut out: Vec<CopyPiece> = Vec::with_capacity(pieces.len());
    // How far the last piece of `out` may reach, from its start.
    let mut last_room = 0u64;
    for &p in pieces.iter() {
        let mut p = p;
        loop {
            let room = limit(p.src, p.dst);
            let len = (p.len as u64).min(room) as usize;
            let merged = merge
                && out.last_mut().is_some_and(|last| {
                    let continues =
                        last.src + last.len as u64 == p.src && last.dst + last.len as u64 == p.dst;
                    let fits = (last.len + len) as u64 <= last_room;
                    if continues && fits {
                        last.len += len;
                    }
                    continues && fits
                });
            if !merged {
                out.push(CopyPiece {
                    src: p.src,
                    dst: p.dst,
                    len,
                });
                last_room = room;
            }
            if len == p.len {
                break;
            }
            p = CopyPiece {
                src: p.src + len as u64,
                dst: p.dst + len as u64,
                len: p.len - len,
            };
        }
    }
    *pieces = out;
}

/// A one-shot completion signal set by an emulated stream's worker.
#[derive(Default)]
pub(crate) struct Signal {
    state: Mutex<Option<Result<(), DeviceError>>>,
    cv: Condvar,
}

impl Signal {
    pub(crate) fn set(&self, result: Result<(), DeviceError>) {
        *self.state.lock() = Some(result);
        self.cv.notify_all();
    }
}

#[derive(Clone)]
enum CompletionInner {
    Signal(Arc<Signal>),
    Cuda(CudaCompletion),
}

/// The end of one transfer: poll it or wait on it. Cloning shares it.
#[derive(Clone)]
pub struct Completion {
    inner: CompletionInner,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion").finish_non_exhaustive()
    }
}

impl Completion {
    fn signal(signal: Arc<Signal>) -> Self {
        Self {
            inner: CompletionInner::Signal(signal),
        }
    }

    fn cuda(event: CudaCompletion) -> Self {
        Self {
            inner: CompletionInner::Cuda(event),
        }
    }

    /// `Ok(true)` when the transfer finished, `Ok(false)` while it runs, `Err` if it failed.
    pub fn poll(&self) -> Result<bool, DeviceError> {
        match &self.inner {
            CompletionInner::Signal(s) => match &*s.state.lock() {
                None => Ok(false),
                Some(result) => result.clone().map(|()| true),
            },
            CompletionInner::Cuda(e) => e.poll(),
        }
    }

    /// Waits until the transfer finished.
    pub fn wait(&self) -> Result<(), DeviceError> {
        match &self.inner {
            CompletionInner::Signal(s) => {
                let mut state = s.state.lock();
                loop {
                    if let Some(result) = &*state {
                        return result.clone();
                    }
                    s.cv.wait(&mut state);
                }
            }
            CompletionInner::Cuda(e) => e.wait(),
        }
    }

    /// Waits at most `timeout`; `Ok(true)` when finished.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool, DeviceError> {
        match &self.inner {
            CompletionInner::Signal(s) => {
                let mut state = s.state.lock();
                if state.is_none() {
                    let _ = s.cv.wait_for(&mut state, timeout);
                }
                match &*state {
                    None => Ok(false),
                    Some(result) => result.clone().map(|()| true),
                }
            }
            CompletionInner::Cuda(e) => {
                let deadline = std::time::Instant::now() + timeout;
                loop {
                    if e.poll()? {
                        return Ok(true);
                    }
                    if std::time::Instant::now() >= deadline {
                        return Ok(false);
                    }
                    std::thread::yield_now();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{find_span, Span};

    /// Where a piece lands: inside a ready span, inside but past the ready prefix (with the
    /// ready length), or outside every span.
    type Found = Result<(), Option<u64>>;

    /// A host-like span pinned up to 1500, and a GPU-like one, as `Sides::of` builds them.
    const SPANS: &[Span] = &[
        Span {
            start: 1000,
            end: 2000,
            ready_end: 1500,
            chunk: 4096,
        },
        Span {
            start: 5000,
            end: 6000,
            ready_end: 6000,
            chunk: u64::MAX,
        },
    ];

    #[test]
    fn a_piece_must_lie_inside_one_span_and_its_ready_prefix() {
        let cases: &[(u64, usize, Found)] = &[
            (1000, 500, Ok(())),           // exactly the ready prefix
            (1200, 301, Err(Some(500))),   // one byte past the ready prefix
            (1900, 100, Err(Some(500))),   // inside, not ready yet
            (1900, 101, Err(None)),        // past the region's end
            (999, 1, Err(None)),           // before the first region
            (2000, 1, Err(None)),          // in the gap
            (5000, 1000, Ok(())),          // a GPU-like span, always ready
            (5500, 600, Err(None)),        // past the end of the last span
            (u64::MAX - 1, 10, Err(None)), // address overflow
        ];
        for &(addr, len, expected) in cases {
            assert_eq!(
                find_span(SPANS, addr, len),
                expected,
                "piece at {addr} of {len} bytes"
            );
        }
    }
}
