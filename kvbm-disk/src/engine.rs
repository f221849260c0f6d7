//! I/O engines: io_uring (registered file and buffers, batched submission, a bounded queue depth,
//! completions reaped on the engine's own thread) or psync (worker threads doing pread/pwrite),
//! behind one interface and chosen once.
//!
//! Invariants:
//! - Every op is validated before it is queued: offset, length and address aligned to
//!   [`ALIGN_BYTES`], inside the file, and (for owned buffers) inside its buffer.
//! - A job owns its buffers (or a keep-alive of the caller's memory) until every one of its ops has
//!   completed in the kernel; only then is the ticket signalled and the buffers released.
//! - At most `queue_depth` ops are in the kernel at once; further ops wait in the engine's queue;
//!   at most [`JOBS_QUEUED_MAX`] jobs wait to enter it (`submit` then blocks: backpressure).

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use io_uring::{opcode, types, IoUring};
use parking_lot::{Condvar, Mutex};

use crate::{AlignedBuf, CacheFile, DiskError, ALIGN_BYTES};

/// Environment variable choosing the engine: `auto` (default), `io_uring` or `psync`.
pub const ENGINE_ENV: &str = "KVBM_DISK_ENGINE";
/// Largest accepted queue depth.
pub const QUEUE_DEPTH_MAX: usize = 1024;
/// Largest buffer registered with io_uring in one piece.
pub const REGISTERED_BUFFER_BYTES_MAX: usize = 1 << 30;
/// Jobs waiting to enter an engine before `submit` blocks.
pub const JOBS_QUEUED_MAX: usize = 1024;

/// Which engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineChoice {
    /// io_uring when the kernel allows it, else psync (announced once).
    #[default]
    Auto,
    /// io_uring or an error.
    IoUring,
    /// psync.
    Psync,
}

impl std::str::FromStr for EngineChoice {
    type Err = DiskError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(EngineChoice::Auto),
            "io_uring" | "iouring" | "uring" => Ok(EngineChoice::IoUring),
            "psync" | "sync" => Ok(EngineChoice::Psync),
            _ => Err(DiskError::Invalid(format!(
                "{ENGINE_ENV}={s:?}: expected auto, io_uring or psync"
            ))),
        }
    }
}

/// The engine in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// io_uring.
    IoUring,
    /// pread/pwrite worker threads.
    Psync,
}

impl EngineKind {
    /// "io_uring" or "psync".
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::IoUring => "io_uring",
            EngineKind::Psync => "psync",
        }
    }
}

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// File to memory.
    Read,
    /// Memory to file.
    Write,
}

impl OpKind {
    fn as_str(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
        }
    }
}

/// One aligned transfer between the file and memory: `[addr, addr + len)` at `offset`, or, with
/// a `lead` segment `(address, length)`, that segment at `offset` followed by `[addr, addr + len)`
/// at `offset + lead length`, as one vectored I/O (a block's header and payload in one request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoOp {
    /// Direction.
    pub kind: OpKind,
    /// File offset.
    pub offset: u64,
    /// Memory address.
    pub addr: u64,
    /// Bytes.
    pub len: usize,
    /// A segment moved just before `[addr, addr + len)`, in the same I/O.
    pub lead: Option<(u64, usize)>,
}

impl IoOp {
    /// File bytes the op covers.
    pub fn file_len(&self) -> usize {
        self.len + self.lead.map_or(0, |(_, len)| len)
    }
}

/// One aligned transfer between the file and one of a job's owned buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufOp {
    /// Direction.
    pub kind: OpKind,
    /// File offset.
    pub offset: u64,
    /// Index of the buffer in the job's buffers.
    pub buf: usize,
    /// Offset within that buffer.
    pub at: usize,
    /// Bytes.
    pub len: usize,
}

struct Job {
    /// Instead of I/O: register these buffers once nothing is in flight (io_uring only).
    register: Option<Vec<(u64, usize)>>,
    ops: Vec<IoOp>,
    owned: Vec<AlignedBuf>,
    _keep: Option<Box<dyn Any + Send>>,
    signal: Arc<Signal>,
}

/// A finished job: its first failure, if any, and the buffers it owned.
type Finished = (Result<(), DiskError>, Vec<AlignedBuf>);

#[derive(Default)]
struct Signal {
    state: Mutex<Option<Finished>>,
    cv: Condvar,
}

impl Signal {
    fn set(&self, result: Result<(), DiskError>, owned: Vec<AlignedBuf>) {
        *self.state.lock() = Some((result, owned));
        self.cv.notify_all();
    }
}

/// The end of one submitted job.
pub struct IoTicket {
    signal: Arc<Signal>,
}

impl std::fmt::Debug for IoTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoTicket")
            .field("done", &self.is_done())
            .finish()
    }
}

impl IoTicket {
    /// True when every op of the job completed (or failed).
    pub fn is_done(&self) -> bool {
        self.signal.state.lock().is_some()
    }

    /// Waits for the job; returns the first failure (if any) and the owned buffers.
    pub fn wait(self) -> Finished {
        let mut state = self.signal.state.lock();
        loop {
            if let Some(done) = state.take() {
                return done;
            }
            self.signal.cv.wait(&mut state);
        }
    }
}

enum Backend {
    Uring(UringEngine),
    Psync(PsyncEngine),
}

/// A disk I/O engine over one cache file: io_uring or psync behind one interface.
pub struct IoEngine {
    /// Declared first so that it drops first: its threads finish every queued op (using the
    /// file's descriptor) before the file can close.
    backend: Backend,
    file: Arc<CacheFile>,
    queue_depth: usize,
}

impl std::fmt::Debug for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoEngine")
            .field("kind", &self.kind())
            .field("queue_depth", &self.queue_depth)
            .field("file", &self.file.path())
            .finish()
    }
}

impl IoEngine {
    /// Which engine this is.
    pub fn kind(&self) -> EngineKind {
        match self.backend {
            Backend::Uring(_) => EngineKind::IoUring,
            Backend::Psync(_) => EngineKind::Psync,
        }
    }

    /// Ops in the kernel at most.
    pub fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    /// The file this engine reads and writes.
    pub fn file(&self) -> &CacheFile {
        &self.file
    }

    /// Queues a job whose ops read or write the owned buffers, which come back from
    /// [`IoTicket::wait`].
    pub fn submit(&self, ops: &[BufOp], bufs: Vec<AlignedBuf>) -> Result<IoTicket, DiskError> {
        let mut resolved = Vec::with_capacity(ops.len());
        for &BufOp {
            kind,
            offset,
            buf,
            at,
            len,
        } in ops
        {
            let b = bufs
                .get(buf)
                .ok_or_else(|| DiskError::Invalid(format!("buffer {buf} of {}", bufs.len())))?;
            if at.checked_add(len).is_none_or(|end| end > b.len()) {
                return Err(DiskError::Invalid(format!(
                    "{at}+{len} outside a buffer of {} bytes",
                    b.len()
                )));
            }
            resolved.push(IoOp {
                kind,
                offset,
                addr: b.addr() + at as u64,
                len,
                lead: None,
            });
        }
        self.validate(&resolved)?;
        self.enqueue(Job {
            register: None,
            ops: resolved,
            owned: bufs,
            _keep: None,
            signal: Arc::default(),
        })
    }

    /// Queues ops on memory the caller owns; `keep` is dropped only after every op completed.
    ///
    /// # Safety
    /// Each op's `[addr, addr + len)` must stay valid (readable for writes, writable for reads,
    /// and not otherwise written during a write's I/O) until the ticket is done; `keep` should be
    /// what guarantees that.
    pub unsafe fn submit_raw(
        &self,
        ops: Vec<IoOp>,
        keep: Box<dyn Any + Send>,
    ) -> Result<IoTicket, DiskError> {
        self.validate(&ops)?;
        self.enqueue(Job {
            register: None,
            ops,
            owned: Vec::new(),
            _keep: Some(keep),
            signal: Arc::default(),
        })
    }

    /// Checks alignment and bounds of every op.
    fn validate(&self, ops: &[IoOp]) -> Result<(), DiskError> {
        let file_len = self.file.len();
        for op in ops {
            let lead_aligned = op.lead.is_none_or(|(addr, len)| {
                addr % ALIGN_BYTES as u64 == 0 && len % ALIGN_BYTES == 0 && len > 0
            });
            let aligned = op.offset % ALIGN_BYTES as u64 == 0
                && op.len % ALIGN_BYTES == 0
                && op.addr % ALIGN_BYTES as u64 == 0
                && op.len > 0
                && lead_aligned;
            if !aligned {
                return Err(DiskError::Invalid(format!(
                    "{} of {} bytes at offset {} from {:#x}: offset, length and address must be non-zero multiples of {ALIGN_BYTES}",
                    op.kind.as_str(), op.len, op.offset, op.addr
                )));
            }
            if op
                .offset
                .checked_add(op.file_len() as u64)
                .is_none_or(|end| end > file_len)
            {
                return Err(DiskError::Invalid(format!(
                    "{} of {} bytes at offset {} past the end of a {file_len}-byte file",
                    op.kind.as_str(),
                    op.len,
                    op.offset
                )));
            }
        }
        Ok(())
    }

    /// Registers `buffers` (address, length; each at most [`REGISTERED_BUFFER_BYTES_MAX`]) with
    /// io_uring, replacing any registered before, once the I/O in flight has drained; ops inside
    /// them then use fixed-buffer I/O. A no-op on psync.
    ///
    /// # Safety
    /// Every range must stay valid memory for as long as the engine lives.
    pub unsafe fn register_buffers(&self, buffers: &[(u64, usize)]) -> Result<(), DiskError> {
        if let Some(&(addr, len)) = buffers
            .iter()
            .find(|(_, len)| *len == 0 || *len > REGISTERED_BUFFER_BYTES_MAX)
        {
            return Err(DiskError::Invalid(format!(
                "registered buffer {addr:#x} of {len} bytes"
            )));
        }
        let Backend::Uring(engine) = &self.backend else {
            return Ok(());
        };
        let signal: Arc<Signal> = Arc::default();
        engine.enqueue(Job {
            register: Some(buffers.to_vec()),
            ops: Vec::new(),
            owned: Vec::new(),
            _keep: None,
            signal: signal.clone(),
        })?;
        IoTicket { signal }.wait().0
    }

    /// Ops issued with fixed (registered) buffers so far.
    pub fn fixed_ops(&self) -> u64 {
        match &self.backend {
            Backend::Uring(e) => e.fixed_ops.load(std::sync::atomic::Ordering::Relaxed),
            Backend::Psync(_) => 0,
        }
    }

    fn enqueue(&self, job: Job) -> Result<IoTicket, DiskError> {
        let signal = job.signal.clone();
        if job.ops.is_empty() {
            job.signal.set(Ok(()), job.owned);
            return Ok(IoTicket { signal });
        }
        match &self.backend {
            Backend::Uring(e) => e.enqueue(job)?,
            Backend::Psync(e) => e.enqueue(job)?,
        }
        Ok(IoTicket { signal })
    }
}

/// Opens the chosen engine over `file` with `queue_depth` ops in flight (1 ..= [`QUEUE_DEPTH_MAX`]).
/// `Auto` falls back to psync, with one log line, where io_uring cannot be set up.
pub fn open_engine(
    choice: EngineChoice,
    file: Arc<CacheFile>,
    queue_depth: usize,
) -> Result<IoEngine, DiskError> {
    // SAFETY: no memory is registered.
    unsafe { open_engine_with_buffers(choice, file, queue_depth, &[]) }
}

/// As [`open_engine`], registering `buffers` (address, length; each at most
/// [`REGISTERED_BUFFER_BYTES_MAX`]) with io_uring so that ops inside them use fixed-buffer I/O.
///
/// # Safety
/// Every registered range must stay valid memory for as long as the engine lives.
pub unsafe fn open_engine_with_buffers(
    choice: EngineChoice,
    file: Arc<CacheFile>,
    queue_depth: usize,
    buffers: &[(u64, usize)],
) -> Result<IoEngine, DiskError> {
    if !(1..=QUEUE_DEPTH_MAX).contains(&queue_depth) {
        return Err(DiskError::Invalid(format!(
            "queue depth {queue_depth} outside 1..={QUEUE_DEPTH_MAX}"
        )));
    }
    if let Some(&(addr, len)) = buffers
        .iter()
        .find(|(_, len)| *len == 0 || *len > REGISTERED_BUFFER_BYTES_MAX)
    {
        return Err(DiskError::Invalid(format!(
            "registered buffer {addr:#x} of {len} bytes"
        )));
    }
    let uring = || {
        // SAFETY: the caller guarantees the registered ranges outlive the engine.
        unsafe { UringEngine::new(&file, queue_depth, buffers) }
    };
    let backend = match choice {
        EngineChoice::Psync => Backend::Psync(PsyncEngine::new(&file, queue_depth)?),
        EngineChoice::IoUring => Backend::Uring(uring()?),
        EngineChoice::Auto => match uring() {
            Ok(engine) => Backend::Uring(engine),
            Err(err) => {
                tracing::warn!(error = %err, "io_uring is unavailable; using the psync disk engine");
                Backend::Psync(PsyncEngine::new(&file, queue_depth)?)
            }
        },
    };
    Ok(IoEngine {
        backend,
        file,
        queue_depth,
    })
}

fn io_error(op: &IoOp, errno: i32) -> DiskError {
    DiskError::Io {
        op: op.kind.as_str(),
        offset: op.offset,
        len: op.len,
        source: std::io::Error::from_raw_os_error(errno),
    }
}

fn short_error(op: &IoOp, done: usize) -> DiskError {
    DiskError::Short {
        op: op.kind.as_str(),
        offset: op.offset,
        len: op.len,
        done,
    }
}

// ----------------------------------------------------------------------------------------------
// io_uring

struct UringEngine {
    fixed_ops: Arc<std::sync::atomic::AtomicU64>,
    sender: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl UringEngine {
    /// # Safety
    /// As [`open_engine_with_buffers`] for `buffers`.
    unsafe fn new(
        file: &CacheFile,
        queue_depth: usize,
        buffers: &[(u64, usize)],
    ) -> Result<Self, DiskError> {
        let setup_error = |call, source| DiskError::File {
            path: file.path().to_owned(),
            call,
            source,
        };
        let ring = IoUring::new(queue_depth.next_power_of_two() as u32)
            .map_err(|e| setup_error("io_uring_setup", e))?;
        ring.submitter()
            .register_files(&[file.raw_fd()])
            .map_err(|e| setup_error("io_uring_register(files)", e))?;
        if !buffers.is_empty() {
            let iovecs: Vec<libc::iovec> = buffers
                .iter()
                .map(|&(addr, len)| libc::iovec {
                    iov_base: addr as *mut libc::c_void,
                    iov_len: len,
                })
                .collect();
            // SAFETY: the caller guarantees each range stays valid while the engine (and so the
            // ring, which unregisters on drop) lives.
            unsafe { ring.submitter().register_buffers(&iovecs) }
                .map_err(|e| setup_error("io_uring_register(buffers)", e))?;
        }
        let (sender, receiver) = crossbeam_channel::bounded(JOBS_QUEUED_MAX);
        let registered = buffers.to_vec();
        let fixed_ops = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = fixed_ops.clone();
        let thread = std::thread::Builder::new()
            .name("kvbm-uring".into())
            .spawn(move || uring_loop(ring, receiver, queue_depth, registered, &counter))
            .map_err(|e| setup_error("spawn", e))?;
        Ok(Self {
            fixed_ops,
            sender: Some(sender),
            thread: Some(thread),
        })
    }

    fn enqueue(&self, job: Job) -> Result<(), DiskError> {
        self.sender
            .as_ref()
            .ok_or(DiskError::EngineStopped)?
            .send(job)
            .map_err(|_| DiskError::EngineStopped)
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // The thread finishes every queued and in-flight op, then exits; only then can the ring
        // (and the file) go away.
        drop(self.sender.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct RunningJob {
    job: Job,
    remaining: usize,
    error: Option<DiskError>,
    /// The iovec pairs of vectored ops, built on the engine thread, alive until completion.
    iovecs: Vec<[libc::iovec; 2]>,
}

fn uring_loop(
    mut ring: IoUring,
    receiver: Receiver<Job>,
    queue_depth: usize,
    mut registered: Vec<(u64, usize)>,
    fixed_ops: &std::sync::atomic::AtomicU64,
) {
    let mut jobs: Vec<Option<RunningJob>> = Vec::new();
    let mut free_slots: Vec<usize> = Vec::new();
    let mut pending: VecDeque<(usize, usize)> = VecDeque::new();
    let mut inflight = 0usize;
    // A registration waits here, with no new job taken, until nothing is in flight.
    let mut registration: Option<Job> = None;
    loop {
        let idle = inflight == 0 && pending.is_empty();
        if let (true, Some(job)) = (idle, registration.take()) {
            let ranges = job.register.clone().unwrap_or_default();
            let iovecs: Vec<libc::iovec> = ranges
                .iter()
                .map(|&(addr, len)| libc::iovec {
                    iov_base: addr as *mut libc::c_void,
                    iov_len: len,
                })
                .collect();
            let submitter = ring.submitter();
            let _ = submitter.unregister_buffers();
            // SAFETY: the caller of `IoEngine::register_buffers` guarantees each range outlives
            // the engine; nothing is in flight, so no op refers to the old registration.
            let result = unsafe { submitter.register_buffers(&iovecs) };
            registered = if result.is_ok() { ranges } else { Vec::new() };
            let result = result.map_err(|source| DiskError::Io {
                op: "register",
                offset: 0,
                len: 0,
                source,
            });
            job.signal.set(result, job.owned);
            continue;
        }
        // While a registration waits, take nothing new: what is in flight drains first.
        if registration.is_none() {
            // Take new jobs; block only when nothing is queued or in flight. `recv` fails only once
            // the engine is dropped and every job sent before has been taken: then stop.
            let first = if idle {
                match receiver.recv() {
                    Ok(job) => Some(job),
                    Err(_) => return,
                }
            } else {
                None
            };
            for job in first
                .into_iter()
                .chain(std::iter::from_fn(|| receiver.try_recv().ok()))
            {
                if job.register.is_some() {
                    registration = Some(job);
                    break;
                }
                let slot = free_slots.pop().unwrap_or_else(|| {
                    jobs.push(None);
                    jobs.len() - 1
                });
                pending.extend((0..job.ops.len()).map(|op| (slot, op)));
                let remaining = job.ops.len();
                let iovecs = job
                    .ops
                    .iter()
                    .map(|op| {
                        let (lead_addr, lead_len) = op.lead.unwrap_or((op.addr, 0));
                        [
                            libc::iovec {
                                iov_base: lead_addr as *mut libc::c_void,
                                iov_len: lead_len,
                            },
                            libc::iovec {
                                iov_base: op.addr as *mut libc::c_void,
                                iov_len: op.len,
                            },
                        ]
                    })
                    .collect();
                jobs[slot] = Some(RunningJob {
                    job,
                    remaining,
                    error: None,
                    iovecs,
                });
            }
        }
        if inflight == 0 && pending.is_empty() {
            // Only a registration arrived: perform it at the top of the loop.
            continue;
        }
        // Fill the submission queue up to the depth, then submit the batch at once.
        {
            let mut sq = ring.submission();
            while inflight < queue_depth {
                let Some((slot, index)) = pending.pop_front() else {
                    break;
                };
                let running = jobs[slot].as_ref().expect("running job");
                let op = running.job.ops[index];
                let (entry, fixed) = sqe_for(&op, &running.iovecs[index], &registered);
                let entry = entry.user_data(((slot as u64) << 32) | index as u64);
                // SAFETY: the op's memory is owned by (or kept alive by) the job, which stays in
                // `jobs` until this op's completion is reaped below.
                if unsafe { sq.push(&entry) }.is_err() {
                    pending.push_front((slot, index));
                    break;
                }
                inflight += 1;
                if fixed {
                    fixed_ops.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // The ring itself failed: fail everything queued, then stop.
            tracing::error!(error = %e, "io_uring_enter failed; the disk engine stops");
            for job in jobs.iter_mut().filter_map(Option::take) {
                job.job
                    .signal
                    .set(Err(DiskError::EngineStopped), job.job.owned);
            }
            return;
        }
        let completions: Vec<(u64, i32)> = ring
            .completion()
            .map(|cqe| (cqe.user_data(), cqe.result()))
            .collect();
        for (user_data, result) in completions {
            inflight -= 1;
            let slot = (user_data >> 32) as usize;
            let index = (user_data & 0xffff_ffff) as usize;
            let running = jobs[slot].as_mut().expect("completion of a running job");
            let op = running.job.ops[index];
            if running.error.is_none() {
                if result < 0 {
                    running.error = Some(io_error(&op, -result));
                } else if (result as usize) < op.file_len() {
                    running.error = Some(short_error(&op, result as usize));
                }
            }
            running.remaining -= 1;
            if running.remaining == 0 {
                let done = jobs[slot].take().expect("running job");
                let result = done.error.map_or(Ok(()), Err);
                done.job.signal.set(result, done.job.owned);
                free_slots.push(slot);
            }
        }
    }
}

/// The submission entry for one op, and whether it uses a registered (fixed) buffer.
fn sqe_for(
    op: &IoOp,
    iovecs: &[libc::iovec; 2],
    registered: &[(u64, usize)],
) -> (io_uring::squeue::Entry, bool) {
    let fd = types::Fixed(0);
    if op.lead.is_some() {
        // A header and its payload: two memory segments, one contiguous file range.
        let entry = match op.kind {
            OpKind::Write => opcode::Writev::new(fd, iovecs.as_ptr(), 2)
                .offset(op.offset)
                .build(),
            OpKind::Read => opcode::Readv::new(fd, iovecs.as_ptr(), 2)
                .offset(op.offset)
                .build(),
        };
        return (entry, false);
    }
    let fixed = registered
        .iter()
        .position(|&(addr, len)| op.addr >= addr && op.addr + op.len as u64 <= addr + len as u64);
    let len = op.len as u32;
    let entry = match (op.kind, fixed) {
        (OpKind::Write, Some(i)) => {
            opcode::WriteFixed::new(fd, op.addr as *const u8, len, i as u16)
                .offset(op.offset)
                .build()
        }
        (OpKind::Read, Some(i)) => opcode::ReadFixed::new(fd, op.addr as *mut u8, len, i as u16)
            .offset(op.offset)
            .build(),
        (OpKind::Write, None) => opcode::Write::new(fd, op.addr as *const u8, len)
            .offset(op.offset)
            .build(),
        (OpKind::Read, None) => opcode::Read::new(fd, op.addr as *mut u8, len)
            .offset(op.offset)
            .build(),
    };
    (entry, fixed.is_some())
}

// ----------------------------------------------------------------------------------------------
// psync

/// A job shared by the psync workers (no iovecs: psync moves segments one by one).
struct PsyncJob {
    job: Job,
    remaining: usize,
    error: Option<DiskError>,
}

struct PsyncShared {
    job: Mutex<Option<PsyncJob>>,
}

struct PsyncEngine {
    sender: Option<Sender<(Arc<PsyncShared>, usize)>>,
    workers: Vec<JoinHandle<()>>,
}

impl PsyncEngine {
    /// The workers use the file's descriptor; the `IoEngine` owning this keeps the file open and
    /// drops this (joining the workers) first.
    fn new(file: &CacheFile, queue_depth: usize) -> Result<Self, DiskError> {
        let (sender, receiver) =
            crossbeam_channel::bounded::<(Arc<PsyncShared>, usize)>(JOBS_QUEUED_MAX);
        let mut workers = Vec::new();
        for i in 0..queue_depth.min(64) {
            let receiver = receiver.clone();
            let fd = file.raw_fd();
            let worker = std::thread::Builder::new()
                .name(format!("kvbm-psync-{i}"))
                .spawn(move || psync_worker(fd, receiver))
                .map_err(|source| DiskError::File {
                    path: file.path().to_owned(),
                    call: "spawn",
                    source,
                })?;
            workers.push(worker);
        }
        Ok(Self {
            sender: Some(sender),
            workers,
        })
    }

    fn enqueue(&self, job: Job) -> Result<(), DiskError> {
        let n = job.ops.len();
        let shared = Arc::new(PsyncShared {
            job: Mutex::new(Some(PsyncJob {
                job,
                remaining: n,
                error: None,
            })),
        });
        let sender = self.sender.as_ref().ok_or(DiskError::EngineStopped)?;
        for index in 0..n {
            sender
                .send((shared.clone(), index))
                .map_err(|_| DiskError::EngineStopped)?;
        }
        Ok(())
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        drop(self.sender.take());
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn psync_worker(fd: i32, receiver: Receiver<(Arc<PsyncShared>, usize)>) {
    for (shared, index) in receiver {
        let op = shared
            .job
            .lock()
            .as_ref()
            .expect("job runs until its last op")
            .job
            .ops[index];
        let result = psync_op(fd, &op);
        let mut guard = shared.job.lock();
        let running = guard.as_mut().expect("job runs until its last op");
        if running.error.is_none() {
            running.error = result.err();
        }
        running.remaining -= 1;
        if running.remaining == 0 {
            let done = guard.take().expect("running job");
            drop(guard);
            let result = done.error.map_or(Ok(()), Err);
            done.job.signal.set(result, done.job.owned);
        }
    }
}

/// One op with pread/pwrite: its lead segment (if any), then its main segment.
fn psync_op(fd: i32, op: &IoOp) -> Result<(), DiskError> {
    if let Some((addr, len)) = op.lead {
        let lead = IoOp {
            kind: op.kind,
            offset: op.offset,
            addr,
            len,
            lead: None,
        };
        psync_segment(fd, &lead)?;
        let main = IoOp {
            offset: op.offset + len as u64,
            lead: None,
            ..*op
        };
        return psync_segment(fd, &main);
    }
    psync_segment(fd, op)
}

/// One contiguous segment with pread/pwrite, resuming after short transfers and EINTR.
fn psync_segment(fd: i32, op: &IoOp) -> Result<(), DiskError> {
    let mut done = 0usize;
    while done < op.len {
        let addr = op.addr + done as u64;
        let offset = (op.offset + done as u64) as libc::off_t;
        let remaining = op.len - done;
        // SAFETY: validated and kept alive by the job (see `IoEngine::submit_raw`); the range
        // `[addr, addr + remaining)` lies inside the op's memory.
        let n = unsafe {
            match op.kind {
                OpKind::Write => libc::pwrite(fd, addr as *const libc::c_void, remaining, offset),
                OpKind::Read => libc::pread(fd, addr as *mut libc::c_void, remaining, offset),
            }
        };
        if n < 0 {
            let errno = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if errno == libc::EINTR {
                continue;
            }
            return Err(io_error(op, errno));
        }
        if n == 0 {
            return Err(short_error(op, done));
        }
        done += n as usize;
    }
    Ok(())
}
