//! The CUDA back end: context, allocation, copy streams and events, through cudarc's driver API
//! with the driver library loaded at run time.
//!
//! Invariants:
//! - `CudaBackend::open` is the only way in, and it calls `is_culib_present()` before any other
//!   CUDA function: cudarc panics instead of failing when the library is missing.
//! - `cuMemcpyBatchAsync` is called only when the driver reports 12.8 or later and exports the
//!   symbol (cudarc also panics on a missing symbol).
//! - `open` checks that the driver exports every other entry point this back end calls
//!   ([`REQUIRED_ENTRY_POINTS`]), directly or through cudarc, and refuses a driver that lacks one
//!   with its name: cudarc would panic at the first call, possibly in a background thread (the
//!   pinning thread calls `cuMemHostRegister_v2`).
//! - A stream's in-flight table owns each transfer's regions until its event has completed.

use std::collections::VecDeque;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};
use parking_lot::Mutex;

use crate::region::{GpuRegion, Region};
use crate::stream::{CopyPiece, Direction, STREAM_QUEUE_MAX};
use crate::DeviceError;

/// First driver version (12.8, encoded as CUDA does) with `cuMemcpyBatchAsync`.
pub(crate) const BATCH_COPY_MIN_DRIVER: i32 = 12080;

/// The driver entry points the CUDA back end calls, directly or through cudarc's safe API
/// (context, device queries, allocation, pinning, streams, events, copies, error strings).
pub(crate) const REQUIRED_ENTRY_POINTS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    // cudarc's `new_stream` synchronizes the context first.
    "cuCtxSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyAsync",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// The entry points of [`REQUIRED_ENTRY_POINTS`] that `exported` says are missing.
pub(crate) fn missing_entry_points(exported: impl Fn(&str) -> bool) -> Vec<&'static str> {
    REQUIRED_ENTRY_POINTS
        .iter()
        .copied()
        .filter(|name| !exported(name))
        .collect()
}

/// True when a CUDA driver library can be loaded. Never panics.
pub(crate) fn driver_present() -> bool {
    // SAFETY: only attempts to dlopen the driver library by its usual names.
    unsafe { sys::is_culib_present() }
}

pub(crate) struct CudaBackend {
    ctx: Arc<CudaContext>,
    driver_version: i32,
    name: String,
    batch_copy_available: bool,
}

impl CudaBackend {
    pub(crate) fn open(ordinal: usize) -> Result<Self, DeviceError> {
        if !driver_present() {
            return Err(DeviceError::NoDriver);
        }
        let missing = missing_entry_points(has_symbol);
        if !missing.is_empty() {
            return Err(DeviceError::Driver {
                call: "loading the driver",
                code: format!(
                    "the CUDA driver library lacks {} (too old, or not NVIDIA's)",
                    missing.join(", ")
                ),
            });
        }
        // cudarc panics on a driver that lacks a symbol it needs; keep that out of our callers.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| DeviceError::Driver {
                call: "cuInit/cuDevicePrimaryCtxRetain",
                code: "the driver library is incomplete (cudarc panicked)".into(),
            })?
            .map_err(|e| DeviceError::driver("cuDevicePrimaryCtxRetain", e))?;
        let mut driver_version = 0;
        // SAFETY: the driver library is loaded; the out-pointer is a live local.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| DeviceError::driver("cuDriverGetVersion", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let batch_copy_available =
            driver_version >= BATCH_COPY_MIN_DRIVER && has_symbol("cuMemcpyBatchAsync");
        Ok(Self {
            ctx,
            driver_version,
            name,
            batch_copy_available,
        })
    }

    pub(crate) fn description(&self) -> String {
        format!(
            "{} (GPU {}, driver {}.{})",
            self.name,
            self.ctx.ordinal(),
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }

    pub(crate) fn driver_version(&self) -> i32 {
        self.driver_version
    }

    pub(crate) fn context(&self) -> Arc<CudaContext> {
        self.ctx.clone()
    }

    pub(crate) fn alloc(&self, len: usize) -> Result<GpuRegion, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| DeviceError::driver("cuCtxSetCurrent", e))?;
        // SAFETY: the context is current; the allocation is owned by the region and freed on drop.
        let addr = unsafe { result::malloc_sync(len) }
            .map_err(|e| DeviceError::driver("cuMemAlloc", e))?;
        Ok(GpuRegion::cuda_owned(addr, len, self.ctx.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_lacking_an_entry_point_is_named_not_used() {
        assert!(missing_entry_points(|_| true).is_empty());
        let missing = missing_entry_points(|name| name != "cuMemHostRegister_v2");
        assert_eq!(missing, vec!["cuMemHostRegister_v2"]);
        // Every entry point this crate calls through cudarc's `sys` directly is checked (the
        // batched copy is optional: the stream falls back to per-piece copies without it).
        let sources = [
            include_str!("cuda.rs"),
            include_str!("host.rs"),
            include_str!("region.rs"),
            include_str!("stream.rs"),
            include_str!("device.rs"),
        ];
        let mut direct = 0;
        for source in sources {
            for (at, _) in source.match_indices("sys::cu") {
                let name: String = source[at + 5..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // Driver functions are `cu` then a capital (not `culib`, `cudaError_enum`, ...).
                let function = name.len() > 2 && name.as_bytes()[2].is_ascii_uppercase();
                if !function || name == "cuMemcpyBatchAsync" {
                    continue;
                }
                direct += 1;
                assert!(
                    REQUIRED_ENTRY_POINTS.contains(&name.as_str()),
                    "{name} is called but not checked at open"
                );
            }
        }
        assert!(
            direct >= 5,
            "the source scan found only {direct} direct calls"
        );
    }
}

fn has_symbol(name: &str) -> bool {
    // SAFETY: only looks a symbol up in the already loaded driver library; nothing is called.
    unsafe { sys::culib().get::<*const ()>(name.as_bytes()).is_ok() }
}

/// A CUDA event recorded after a transfer's copies.
#[derive(Clone)]
pub(crate) struct CudaCompletion(Arc<CudaEvent>);

impl CudaCompletion {
    pub(crate) fn poll(&self) -> Result<bool, DeviceError> {
        self.0
            .context()
            .bind_to_thread()
            .map_err(|e| DeviceError::driver("cuCtxSetCurrent", e))?;
        self.0
            .try_is_complete()
            .map_err(|e| DeviceError::driver("cuEventQuery", e))
    }

    pub(crate) fn wait(&self) -> Result<(), DeviceError> {
        self.0
            .synchronize()
            .map_err(|e| DeviceError::driver("cuEventSynchronize", e))
    }
}

pub(crate) struct CudaCopyStream {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    batch_copy: bool,
    /// Set when the driver refused a batched copy: the stream then copies piece by piece.
    batch_refused: std::sync::atomic::AtomicBool,
    inflight: Mutex<VecDeque<(CudaCompletion, Vec<Region>)>>,
}

impl CudaCopyStream {
    pub(crate) fn new(backend: &CudaBackend, batch_copy: bool) -> Result<Self, DeviceError> {
        let stream = backend
            .ctx
            .new_stream()
            .map_err(|e| DeviceError::driver("cuStreamCreate", e))?;
        Ok(Self {
            ctx: backend.ctx.clone(),
            stream,
            batch_copy: batch_copy && backend.batch_copy_available,
            batch_refused: std::sync::atomic::AtomicBool::new(false),
            inflight: Mutex::new(VecDeque::new()),
        })
    }

    pub(crate) fn uses_batch_copy(&self) -> bool {
        self.batch_copy
            && !self
                .batch_refused
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn submit(
        &self,
        _direction: Direction,
        pieces: &[CopyPiece],
        regions: Vec<Region>,
    ) -> Result<CudaCompletion, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| DeviceError::driver("cuCtxSetCurrent", e))?;
        let mut inflight = self.inflight.lock();
        // Release regions of transfers the stream has finished; bound the table.
        while let Some((front, _)) = inflight.front() {
            let done = if inflight.len() >= STREAM_QUEUE_MAX {
                front.wait()?;
                true
            } else {
                front.poll()?
            };
            if !done {
                break;
            }
            inflight.pop_front();
        }
        let batched = self.uses_batch_copy()
            && pieces.len() > 1
            && {
                match self.copy_batched(pieces) {
                    Ok(()) => true,
                    Err(e) => {
                        // Fall back to single copies, for this transfer and the stream's later
                        // ones. Copying every piece again is safe even if the driver queued some:
                        // the same bytes land in the same places, in stream order.
                        tracing::warn!(error = %e, "cuMemcpyBatchAsync refused; copying piece by piece");
                        self.batch_refused
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                        false
                    }
                }
            };
        if !batched {
            for p in pieces {
                // SAFETY: `validate` checked both ranges against regions that the in-flight
                // table keeps alive until this transfer's event completes; with unified
                // addressing cuMemcpyAsync infers the direction from the pointers.
                let queued =
                    unsafe { sys::cuMemcpyAsync(p.dst, p.src, p.len, self.stream.cu_stream()) }
                        .result();
                if let Err(e) = queued {
                    // Pieces queued before this one still use the regions: wait for them before
                    // `regions` can be dropped with the error.
                    let _ = self.stream.synchronize();
                    return Err(DeviceError::driver("cuMemcpyAsync", e));
                }
            }
        }
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| DeviceError::driver("cuEventRecord", e))?;
        let completion = CudaCompletion(Arc::new(event));
        inflight.push_back((completion.clone(), regions));
        Ok(completion)
    }

    /// Orders this stream's later copies after everything queued so far on `foreign` (a
    /// `CUstream` of the same context, e.g. the one the engine runs its forward pass on; 0 for
    /// the legacy default stream): an event recorded there, waited on here, on the device. The
    /// host does not wait.
    pub(crate) fn order_after(&self, foreign: u64) -> Result<(), DeviceError> {
        self.cross_wait(foreign as sys::CUstream, self.stream.cu_stream())
    }

    /// Makes `foreign` (a `CUstream` of the same context; 0 for the legacy default stream)
    /// wait, on the device, for everything queued so far on this stream: an event recorded
    /// here, waited on there. The host does not wait.
    pub(crate) fn make_wait(&self, foreign: u64) -> Result<(), DeviceError> {
        self.cross_wait(self.stream.cu_stream(), foreign as sys::CUstream)
    }

    /// Makes `waiter` wait, on the device, for everything queued so far on `recorded` (one of
    /// them this stream): an event recorded on the one, waited on by the other.
    fn cross_wait(
        &self,
        recorded: sys::CUstream,
        waiter: sys::CUstream,
    ) -> Result<(), DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| DeviceError::driver("cuCtxSetCurrent", e))?;
        // Serialised with `submit`: the event and the wait fall between two transfers, never
        // inside one.
        let _inflight = self.inflight.lock();
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: plain driver calls on handles of this context; the event is destroyed only
        // after the wait on it was queued (the driver keeps what the wait needs).
        unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
            )
            .result()
            .map_err(|e| DeviceError::driver("cuEventCreate", e))?;
            let waited = sys::cuEventRecord(event, recorded)
                .result()
                .map_err(|e| DeviceError::driver("cuEventRecord", e))
                .and_then(|()| {
                    sys::cuStreamWaitEvent(waiter, event, 0)
                        .result()
                        .map_err(|e| DeviceError::driver("cuStreamWaitEvent", e))
                });
            let _ = sys::cuEventDestroy_v2(event).result();
            waited
        }
    }

    fn copy_batched(&self, pieces: &[CopyPiece]) -> Result<(), DeviceError> {
        let mut dsts: Vec<sys::CUdeviceptr> = pieces.iter().map(|p| p.dst).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = pieces.iter().map(|p| p.src).collect();
        let mut sizes: Vec<usize> = pieces.iter().map(|p| p.len).collect();
        // SAFETY: an all-zero CUmemcpyAttributes is a valid value (location hints "invalid",
        // which the driver ignores for non-managed memory); the access order is set next.
        let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut attr_index: usize = 0;
        let mut fail_index: usize = usize::MAX;
        // SAFETY: the driver is 12.8+ and exports the symbol (checked at open); the arrays hold
        // `pieces.len()` entries each and outlive the call; the ranges were validated and are kept
        // alive by the in-flight table until the event recorded after this call completes.
        unsafe {
            sys::cuMemcpyBatchAsync(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                pieces.len(),
                &mut attrs,
                &mut attr_index,
                1,
                &mut fail_index,
                self.stream.cu_stream(),
            )
        }
        .result()
        .map_err(|e| DeviceError::Driver {
            call: "cuMemcpyBatchAsync",
            code: if fail_index == usize::MAX {
                // The driver's "not tied to one copy".
                format!("{:?}", e.0)
            } else {
                format!("{:?} (failed at piece {fail_index})", e.0)
            },
        })
    }
}

impl Drop for CudaCopyStream {
    fn drop(&mut self) {
        // Wait for every queued copy before the regions they use can be released.
        let _ = self.stream.synchronize();
        self.inflight.get_mut().clear();
    }
}
