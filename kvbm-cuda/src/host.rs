//! Pinned host regions: mapped at once, faulted in and pinned by background threads, usable as
//! soon as a prefix is ready.
//!
//! Invariants:
//! - `ready_bytes()` only grows, and covers a prefix of whole chunks that are faulted in and
//!   pinned (or that failed to pin and are usable unpinned; `pin_status` says so).
//! - Pin chunks are at most [`PIN_CHUNK_BYTES_MAX`] (the 64 GiB `cuMemHostRegister` limit) and a
//!   multiple of the page size; a block of a fully contiguous layout never straddles two chunks
//!   when the chunk size is a multiple of the block stride (kvbm-core chooses it so).
//! - Background threads hold only a weak reference: dropping the last handle stops them after
//!   the chunk in hand, then unregisters and unmaps.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};
use parking_lot::{Condvar, Mutex};

use crate::mapping::{round_up, Mapping, PAGE_BYTES};
use crate::DeviceError;

/// Largest range registered with the driver in one call.
pub const PIN_CHUNK_BYTES_MAX: usize = 64 << 30;

/// How a host region is prepared.
#[derive(Debug, Clone)]
pub struct HostRegionOptions {
    /// Bytes faulted in and pinned as one unit (rounded up to whole pages, at most
    /// [`PIN_CHUNK_BYTES_MAX`]). Default 256 MiB.
    pub chunk_bytes: usize,
    /// Threads faulting in and pinning chunks. Default: up to 4, one per core.
    pub pin_threads: usize,
    /// Ask for transparent huge pages. Default true.
    pub huge_pages: bool,
}

impl Default for HostRegionOptions {
    fn default() -> Self {
        Self {
            chunk_bytes: 256 << 20,
            pin_threads: std::thread::available_parallelism()
                .map(|n| n.get().min(4))
                .unwrap_or(1),
            huge_pages: true,
        }
    }
}

/// How the region's memory ended up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinStatus {
    /// Still being pinned.
    InProgress,
    /// Registered with the CUDA driver (`cuMemHostRegister`).
    Registered,
    /// Locked in memory (`mlock`), on the emulated device.
    Locked,
    /// Usable but not pinned: the reason is the first failure seen.
    Unpinned(String),
}

/// Host memory for the host tier. Cheap to clone; clones share the memory.
#[derive(Clone)]
pub struct HostRegion {
    inner: Arc<HostInner>,
}

struct HostInner {
    mapping: Mapping,
    len: usize,
    chunk_bytes: usize,
    chunk_count: usize,
    next_chunk: AtomicUsize,
    ready_bytes: AtomicUsize,
    progress: Mutex<Progress>,
    progress_cv: Condvar,
    ctx: Option<Arc<CudaContext>>,
    started: Instant,
}

struct Progress {
    done: Vec<bool>,
    prefix_chunks: usize,
    registered: Vec<u64>,
    unpinned_reason: Option<String>,
    first_ready_after: Option<Duration>,
    fully_ready_after: Option<Duration>,
}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("ready_bytes", &self.ready_bytes())
            .finish()
    }
}

impl HostRegion {
    pub(crate) fn new(
        len: usize,
        options: HostRegionOptions,
        ctx: Option<Arc<CudaContext>>,
    ) -> Result<Self, DeviceError> {
        if len == 0 {
            return Err(DeviceError::InvalidArgument(
                "host region of 0 bytes".into(),
            ));
        }
        let chunk_bytes = round_up(options.chunk_bytes.max(1), PAGE_BYTES).min(PIN_CHUNK_BYTES_MAX);
        let mapping = Mapping::new(len)?;
        if options.huge_pages {
            mapping.advise_huge_pages();
        }
        let chunk_count = mapping.len().div_ceil(chunk_bytes);
        let inner = Arc::new(HostInner {
            mapping,
            len,
            chunk_bytes,
            chunk_count,
            next_chunk: AtomicUsize::new(0),
            ready_bytes: AtomicUsize::new(0),
            progress: Mutex::new(Progress {
                done: vec![false; chunk_count],
                prefix_chunks: 0,
                registered: Vec::new(),
                unpinned_reason: None,
                first_ready_after: None,
                fully_ready_after: None,
            }),
            progress_cv: Condvar::new(),
            ctx,
            started: Instant::now(),
        });
        let threads = options.pin_threads.clamp(1, chunk_count.max(1));
        for i in 0..threads {
            let weak = Arc::downgrade(&inner);
            std::thread::Builder::new()
                .name(format!("kvbm-pin-{i}"))
                .spawn(move || pin_worker(weak))
                .map_err(|e| DeviceError::Os {
                    call: "spawn",
                    errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
                })?;
        }
        Ok(Self { inner })
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.inner.mapping.addr()
    }

    /// Length in bytes, as asked for.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The pin chunk size in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.inner.chunk_bytes
    }

    /// Bytes from the start that are faulted in and pinned (never more than `len()`).
    pub fn ready_bytes(&self) -> usize {
        self.inner.ready_bytes.load(Ordering::Acquire)
    }

    /// True once every chunk is ready.
    pub fn is_fully_ready(&self) -> bool {
        self.ready_bytes() >= self.inner.len
    }

    /// Waits until at least `bytes` are ready or `timeout` passes; returns whether they are.
    pub fn wait_ready(&self, bytes: usize, timeout: Duration) -> bool {
        let bytes = bytes.min(self.inner.len);
        let deadline = Instant::now() + timeout;
        let mut progress = self.inner.progress.lock();
        while self.ready_bytes() < bytes {
            if self
                .inner
                .progress_cv
                .wait_until(&mut progress, deadline)
                .timed_out()
            {
                return self.ready_bytes() >= bytes;
            }
        }
        true
    }

    /// How the memory is pinned.
    pub fn pin_status(&self) -> PinStatus {
        let progress = self.inner.progress.lock();
        if let Some(reason) = &progress.unpinned_reason {
            return PinStatus::Unpinned(reason.clone());
        }
        if progress.prefix_chunks < self.inner.chunk_count {
            PinStatus::InProgress
        } else if self.inner.ctx.is_some() {
            PinStatus::Registered
        } else {
            PinStatus::Locked
        }
    }

    /// Time from creation until the first chunk was ready, and until all were.
    pub fn ready_times(&self) -> (Option<Duration>, Option<Duration>) {
        let progress = self.inner.progress.lock();
        (progress.first_ready_after, progress.fully_ready_after)
    }

    /// Copies `bytes` into the region at `offset` (see `GpuRegion::write` on racing copies).
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), DeviceError> {
        self.check_range(offset, bytes.len())?;
        // SAFETY: the range lies inside the live mapping and `bytes` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                (self.addr() + offset as u64) as *mut u8,
                bytes.len(),
            )
        };
        Ok(())
    }

    /// Copies bytes at `offset` into `out` (see `GpuRegion::write` on racing copies).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check_range(offset, out.len())?;
        // SAFETY: the range lies inside the live mapping and `out` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.addr() + offset as u64) as *const u8,
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), DeviceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.len => Ok(()),
            _ => Err(DeviceError::InvalidArgument(format!(
                "range {offset}+{len} outside a host region of {} bytes",
                self.inner.len
            ))),
        }
    }
}

fn pin_worker(weak: Weak<HostInner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let index = inner.next_chunk.fetch_add(1, Ordering::Relaxed);
        if index >= inner.chunk_count {
            return;
        }
        inner.prepare_chunk(index);
    }
}

impl HostInner {
    fn chunk_range(&self, index: usize) -> (u64, usize) {
        let start = index * self.chunk_bytes;
        let len = self.chunk_bytes.min(self.mapping.len() - start);
        (self.mapping.addr() + start as u64, len)
    }

    /// Faults in and pins one chunk, then advances the ready prefix.
    fn prepare_chunk(&self, index: usize) {
        let (addr, len) = self.chunk_range(index);
        for page in (0..len).step_by(PAGE_BYTES) {
            // SAFETY: the page lies inside the live mapping; writing a zero to fresh anonymous
            // memory changes nothing it holds, and no transfer uses bytes past the ready prefix.
            unsafe { std::ptr::write_volatile((addr + page as u64) as *mut u8, 0) };
        }
        let pinned = self.pin(addr, len);
        let mut progress = self.progress.lock();
        match pinned {
            Ok(true) => progress.registered.push(addr),
            Ok(false) => {}
            Err(reason) => {
                if progress.unpinned_reason.is_none() {
                    tracing::warn!(%reason, "host memory could not be pinned; serving it unpinned");
                    progress.unpinned_reason = Some(reason);
                }
            }
        }
        progress.done[index] = true;
        let before = progress.prefix_chunks;
        while progress.prefix_chunks < self.chunk_count && progress.done[progress.prefix_chunks] {
            progress.prefix_chunks += 1;
        }
        if progress.prefix_chunks > before {
            let elapsed = self.started.elapsed();
            progress.first_ready_after.get_or_insert(elapsed);
            if progress.prefix_chunks == self.chunk_count {
                progress.fully_ready_after = Some(elapsed);
            }
            let ready = (progress.prefix_chunks * self.chunk_bytes).min(self.len);
            self.ready_bytes.store(ready, Ordering::Release);
            self.progress_cv.notify_all();
        }
    }

    /// Pins one chunk. `Ok(true)` when registered with CUDA (to unregister later), `Ok(false)`
    /// when locked, `Err` with a reason when it stays unpinned.
    fn pin(&self, addr: u64, len: usize) -> Result<bool, String> {
        match &self.ctx {
            Some(ctx) => {
                ctx.bind_to_thread()
                    .map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
                // SAFETY: the range is a live part of our mapping, registered once and
                // unregistered in `Drop` before the mapping goes away.
                let rc = unsafe {
                    sys::cuMemHostRegister_v2(
                        addr as *mut std::ffi::c_void,
                        len,
                        sys::CU_MEMHOSTREGISTER_PORTABLE,
                    )
                };
                match rc {
                    sys::CUresult::CUDA_SUCCESS => Ok(true),
                    other => Err(format!("cuMemHostRegister: {other:?}")),
                }
            }
            None => {
                let ptr = std::ptr::NonNull::new(addr as *mut std::ffi::c_void)
                    .expect("mapping address is never null");
                // SAFETY: the range is a live part of our mapping; mlock only pins it.
                unsafe { nix::sys::mman::mlock(ptr, len) }
                    .map(|()| false)
                    .map_err(|errno| format!("mlock: {errno}"))
            }
        }
    }
}

impl Drop for HostInner {
    fn drop(&mut self) {
        let progress = self.progress.get_mut();
        if let Some(ctx) = &self.ctx {
            if ctx.bind_to_thread().is_ok() {
                for &addr in &progress.registered {
                    // SAFETY: each address was registered by `pin` and is unregistered once,
                    // while the mapping is still alive (it is dropped after this).
                    let _ = unsafe { sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) };
                }
            }
        }
    }
}
