//! The exported driver entry points, each under the name and with the signature of CUDA 12.8's
//! `cuda.h` (the `_v2` names where the header maps the plain name to them), as cudarc 0.19
//! resolves them by name from `libcuda.so`.
//!
//! Invariants:
//! - Nothing but `cuDriverGetVersion` and the error-name functions works before `cuInit(0)`.
//! - Calls that need a context (allocation, registration, streams, events, copies) fail with
//!   `CUDA_ERROR_INVALID_CONTEXT` on a thread without a current one, as on a real driver, and
//!   with the sticky error once a copy failed on its stream (the context is lost).
//! - Every asynchronous copy is checked before it is queued: each side inside one live device
//!   allocation or one registered host range. A side that runs past the end of its allocation or
//!   range is refused (`CUDA_ERROR_INVALID_VALUE`) and is a violation; a side in pageable host
//!   memory is copied (a real driver stages it) but is a violation too.
//! - No exported function panics: a panic cannot unwind through `extern "C"`.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::config::config;
use crate::faults::{self, Kind};
use crate::memory::{self, Place};
use crate::result::*;
use crate::stream::{self, Copy};
use crate::violations;

/// `CUdevice`: a device ordinal.
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CUdeviceptr = u64;
/// `CUcontext`, `CUstream`, `CUevent`: opaque handles.
pub type CUhandle = *mut c_void;

/// Devices the simulated machine has.
pub const DEVICE_COUNT: c_int = 1;
/// The name `cuDeviceGetName` reports.
pub const DEVICE_NAME: &str = "kvbm-cuda-sim simulated GPU";

/// `CU_STREAM_NON_BLOCKING`, the only stream flag besides the default.
const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DEFAULT | BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS`.
const EVENT_FLAGS_ALL: c_uint = 0x1 | 0x2 | 0x4;
/// `CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY`.
const HOST_REGISTER_FLAGS_ALL: c_uint = 0x1 | 0x2 | 0x4 | 0x8;
/// `CU_DEVICE_ATTRIBUTE_*` values this driver answers; every other attribute reads 0.
const ATTRIBUTES: &[(c_int, c_int)] = &[
    (1, 1024), // MAX_THREADS_PER_BLOCK
    (16, 132), // MULTIPROCESSOR_COUNT
    (41, 1),   // UNIFIED_ADDRESSING
    (75, 9),   // COMPUTE_CAPABILITY_MAJOR
    (76, 0),   // COMPUTE_CAPABILITY_MINOR
    (115, 0),  // MEMORY_POOLS_SUPPORTED: no stream-ordered allocator here
];

static INITIALIZED: AtomicBool = AtomicBool::new(false);
/// Retain count of the one primary context.
static PRIMARY_RETAINS: AtomicU32 = AtomicU32::new(0);
/// The primary context's handle: the address of this static.
static PRIMARY_CONTEXT: u8 = 0;

thread_local! {
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn primary_context() -> usize {
    &PRIMARY_CONTEXT as *const u8 as usize
}

fn code(r: Result<(), CUresult>) -> CUresult {
    match r {
        Ok(()) => CUDA_SUCCESS,
        Err(e) => e,
    }
}

fn initialized() -> Result<(), CUresult> {
    if INITIALIZED.load(Ordering::SeqCst) {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_INITIALIZED)
    }
}

/// Ok when the driver is initialised and the calling thread has a current context.
fn with_context() -> Result<(), CUresult> {
    initialized()?;
    if CURRENT.with(|c| c.get()) == 0 {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    not_lost()
}

/// Err(the sticky error) once a copy failed on its stream; also the result of every wait, which
/// reports a fault that happened while it waited (as cuStreamSynchronize does on a GPU).
fn not_lost() -> Result<(), CUresult> {
    match stream::sticky_error() {
        Some(code) => {
            stream::quiesce();
            Err(code)
        }
        None => Ok(()),
    }
}

fn device(ordinal: CUdevice) -> Result<(), CUresult> {
    if (0..DEVICE_COUNT).contains(&ordinal) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_DEVICE)
    }
}

/// Writes `value` through `out`, or fails with `CUDA_ERROR_INVALID_VALUE` for a null pointer.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for a write by the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Checks one side of an asynchronous copy (see the module invariants).
fn check_side(call: &str, side: &str, addr: u64, len: usize) -> Result<(), CUresult> {
    match memory::place(addr, len) {
        Place::Device | Place::Registered => Ok(()),
        Place::Pageable => {
            violations::record(format!(
                "{call}: {side} {addr:#x}+{len} is pageable host memory (neither device memory \
                 nor a registered host range)"
            ));
            Ok(())
        }
        Place::Straddles {
            start,
            len: range_len,
        } => {
            violations::record(format!(
                "{call}: {side} {addr:#x}+{len} runs past the end of the range \
                 {start:#x}+{range_len} it starts in"
            ));
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

fn check_copy(call: &str, c: Copy) -> Result<(), CUresult> {
    check_side(call, "source", c.src, c.len)?;
    check_side(call, "target", c.dst, c.len)
}

// ------------------------------------------------------------------ initialisation and devices

/// `cuInit`.
///
/// # Safety
/// None beyond the C contract; takes no pointers.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let _ = config();
    INITIALIZED.store(true, Ordering::SeqCst);
    CUDA_SUCCESS
}

/// `cuDriverGetVersion`.
///
/// # Safety
/// `version` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // SAFETY: forwarded caller contract.
    code(unsafe { put(version, config().driver_version) })
}

/// `cuDeviceGetCount`.
///
/// # Safety
/// `count` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    // SAFETY: forwarded caller contract.
    code(initialized().and_then(|()| unsafe { put(count, DEVICE_COUNT) }))
}

/// `cuDeviceGet`.
///
/// # Safety
/// `dev` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    // SAFETY: forwarded caller contract.
    code(
        initialized()
            .and_then(|()| device(ordinal))
            .and_then(|()| unsafe { put(dev, ordinal) }),
    )
}

/// `cuDeviceGetName`: writes at most `len` bytes, NUL included.
///
/// # Safety
/// `name` is null or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    let r = initialized().and_then(|()| device(dev)).and_then(|()| {
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let n = DEVICE_NAME.len().min(len as usize - 1);
        // SAFETY: `name` holds `len` bytes and `n < len`, so the copy and the NUL fit.
        unsafe {
            std::ptr::copy_nonoverlapping(DEVICE_NAME.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    });
    code(r)
}

/// `cuDeviceTotalMem` (`_v2`).
///
/// # Safety
/// `bytes` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let r = initialized().and_then(|()| device(dev));
    // SAFETY: forwarded caller contract.
    code(r.and_then(|()| unsafe { put(bytes, config().memory_bytes as usize) }))
}

/// `cuDeviceGetAttribute`.
///
/// # Safety
/// `value` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    dev: CUdevice,
) -> CUresult {
    let r = initialized().and_then(|()| device(dev)).and_then(|()| {
        if attrib <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let v = ATTRIBUTES
            .iter()
            .find(|(a, _)| *a == attrib)
            .map_or(0, |&(_, v)| v);
        // SAFETY: forwarded caller contract.
        unsafe { put(value, v) }
    });
    code(r)
}

// ------------------------------------------------------------------ contexts

/// `cuDevicePrimaryCtxRetain`.
///
/// # Safety
/// `ctx` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUhandle, dev: CUdevice) -> CUresult {
    let r = initialized().and_then(|()| device(dev)).and_then(|()| {
        // SAFETY: forwarded caller contract.
        unsafe { put(ctx, primary_context() as CUhandle) }?;
        PRIMARY_RETAINS.fetch_add(1, Ordering::SeqCst);
        Ok(())
    });
    code(r)
}

/// `cuDevicePrimaryCtxRelease` (`_v2`). Releasing more often than retained is a violation.
///
/// # Safety
/// None; takes no pointers.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let r = initialized().and_then(|()| device(dev)).and_then(|()| {
        PRIMARY_RETAINS
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map(drop)
            .map_err(|_| {
                violations::record(
                    "cuDevicePrimaryCtxRelease: the primary context was not retained".into(),
                );
                CUDA_ERROR_INVALID_CONTEXT
            })
    });
    code(r)
}

/// `cuCtxSetCurrent`: the null context unbinds; any other must be the primary context.
///
/// # Safety
/// None; the handle is compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUhandle) -> CUresult {
    let r = initialized().and_then(|()| {
        let h = ctx as usize;
        if h != 0 && h != primary_context() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(h));
        Ok(())
    });
    code(r)
}

/// `cuCtxGetCurrent`.
///
/// # Safety
/// `ctx` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut CUhandle) -> CUresult {
    let current = CURRENT.with(|c| c.get());
    // SAFETY: forwarded caller contract.
    code(initialized().and_then(|()| unsafe { put(ctx, current as CUhandle) }))
}

/// `cuCtxSynchronize`: waits for every stream.
///
/// # Safety
/// None; takes no pointers.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    let r = with_context()
        .and_then(|()| stream::all_streams())
        .map(|all| {
            for s in all {
                s.synchronize();
            }
        })
        .and_then(|()| not_lost());
    code(r)
}

// ------------------------------------------------------------------ memory

/// `cuMemAlloc` (`_v2`): 256-byte aligned host memory filled with a poison byte.
///
/// # Safety
/// `dptr` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    if dptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let r = with_context()
        .and_then(|()| faults::check(Kind::Alloc))
        .and_then(|()| memory::alloc_device(bytes));
    // SAFETY: forwarded caller contract.
    code(r.and_then(|addr| unsafe { put(dptr, addr) }))
}

/// A violation when a queued, unfinished copy touches `[start, start + len)`, which `call` is
/// about to release.
fn released_while_queued(call: &str, what: &str, start: u64, len: usize) -> bool {
    let Some(c) = stream::pending_touching(start, len) else {
        return false;
    };
    violations::record(format!(
        "{call}: {what} {start:#x}+{len} is released while a queued copy still touches it \
         ({:#x} -> {:#x}, {} bytes); wait for the copy's event first",
        c.src, c.dst, c.len
    ));
    true
}

/// `cuMemFree` (`_v2`). Freeing what is not the start of a live allocation is a violation; so is
/// freeing an allocation a queued copy still touches (the memory is then kept, not reused).
///
/// # Safety
/// `dptr` came from `cuMemAlloc`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    let r = with_context().and_then(|()| {
        if let Some(len) = memory::device_len(dptr) {
            if released_while_queued("cuMemFree", "device allocation", dptr, len) {
                memory::quarantine_device(dptr);
                return Ok(());
            }
        }
        memory::free_device(dptr).inspect_err(|_| {
            violations::record(format!(
                "cuMemFree: {dptr:#x} is not the start of a live device allocation"
            ))
        })
    });
    code(r)
}

/// `cuMemHostRegister` (`_v2`).
///
/// # Safety
/// `p` points to `bytes` bytes of mapped host memory that stay mapped until unregistered.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    p: *mut c_void,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    let r = with_context().and_then(|()| {
        if flags & !HOST_REGISTER_FLAGS_ALL != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        faults::check(Kind::Register)?;
        memory::register_host(p as u64, bytes)
    });
    code(r)
}

/// `cuMemHostUnregister`. Unregistering what is not the start of a registered range is a
/// violation; so is unregistering a range a queued copy still touches.
///
/// # Safety
/// None; the address is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    let r = with_context().and_then(|()| {
        if let Some(len) = memory::host_len(p as u64) {
            released_while_queued("cuMemHostUnregister", "host range", p as u64, len);
        }
        memory::unregister_host(p as u64).inspect_err(|_| {
            violations::record(format!(
                "cuMemHostUnregister: {:#x} is not the start of a registered host range",
                p as u64
            ))
        })
    });
    code(r)
}

// ------------------------------------------------------------------ copies

/// `cuMemcpyHtoD` (`_v2`): synchronous; the target must lie inside one device allocation.
///
/// # Safety
/// `src` is valid for reads of `bytes` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    code(
        with_context()
            .and_then(|()| unsafe { copy_sync("cuMemcpyHtoD", dst, src as u64, bytes, dst) }),
    )
}

/// `cuMemcpyDtoH` (`_v2`): synchronous; the source must lie inside one device allocation.
///
/// # Safety
/// `dst` is valid for writes of `bytes` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    code(
        with_context()
            .and_then(|()| unsafe { copy_sync("cuMemcpyDtoH", dst as u64, src, bytes, src) }),
    )
}

/// A synchronous copy whose device side is `device`; the host side is the caller's business.
///
/// # Safety
/// The host side is valid for the access.
unsafe fn copy_sync(
    call: &str,
    dst: u64,
    src: u64,
    bytes: usize,
    device: u64,
) -> Result<(), CUresult> {
    if bytes == 0 {
        return Ok(());
    }
    if memory::place(device, bytes) != Place::Device {
        violations::record(format!(
            "{call}: device side {device:#x}+{bytes} is not inside one device allocation"
        ));
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the device side lies inside a live allocation (checked above), the host side is
    // valid by the caller's contract; `copy` allows overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
    Ok(())
}

/// `cuMemcpyAsync`: queued on `stream` after both sides are checked.
///
/// # Safety
/// Both ranges stay valid until the stream has run the copy.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    h: CUhandle,
) -> CUresult {
    let r = with_context().and_then(|()| {
        let s = stream::stream(h as usize)?;
        faults::check(Kind::Memcpy)?;
        let c = Copy {
            dst,
            src,
            len: bytes,
        };
        check_copy("cuMemcpyAsync", c)?;
        s.copy(vec![c])
    });
    code(r)
}

/// `CUmemcpyAttributes` of CUDA 12.8 (24 bytes): the source access order, two location hints
/// (type, id) and flags.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemcpyAttributes {
    /// `CUmemcpySrcAccessOrder`: 1 stream, 2 during the call, 3 any; 0 is invalid.
    pub src_access_order: c_uint,
    /// Source location hint (type, id).
    pub src_loc_hint: [c_int; 2],
    /// Target location hint (type, id).
    pub dst_loc_hint: [c_int; 2],
    /// Flags.
    pub flags: c_uint,
}

/// `cuMemcpyBatchAsync` with CUDA 12.8's signature: `count` copies queued on `stream` as one
/// operation. As the real driver: not on the legacy default stream, at least one attribute,
/// `attrs_idxs` strictly increasing from 0, a valid source access order in each attribute. On a
/// failure that concerns one copy, `*fail_idx` is its index, else `usize::MAX`.
///
/// # Safety
/// `dsts`, `srcs`, `sizes` hold `count` entries; `attrs` and `attrs_idxs` hold `num_attrs`;
/// `fail_idx` is null or valid for a write; the ranges stay valid until the stream has run them.
///
/// Built with the `old-driver` feature, the library does not export it, as drivers before CUDA
/// 12.8 do not.
#[cfg_attr(not(feature = "old-driver"), no_mangle)]
pub unsafe extern "C" fn cuMemcpyBatchAsync(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    h: CUhandle,
) -> CUresult {
    let mut failed_at = usize::MAX;
    let r = with_context().and_then(|()| {
        if h as usize == 0 || h as usize == 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = stream::stream(h as usize)?;
        faults::check(Kind::Batch)?;
        let null = dsts.is_null() || srcs.is_null() || sizes.is_null();
        if count == 0
            || null
            || num_attrs == 0
            || num_attrs > count
            || attrs.is_null()
            || attrs_idxs.is_null()
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null, and holding these many entries by the caller's contract.
        let (dsts, srcs, sizes, attrs, idxs) = unsafe {
            (
                std::slice::from_raw_parts(dsts, count),
                std::slice::from_raw_parts(srcs, count),
                std::slice::from_raw_parts(sizes, count),
                std::slice::from_raw_parts(attrs, num_attrs),
                std::slice::from_raw_parts(attrs_idxs, num_attrs),
            )
        };
        let idxs_ok =
            idxs[0] == 0 && idxs.windows(2).all(|w| w[0] < w[1]) && idxs[num_attrs - 1] < count;
        let orders_ok = attrs.iter().all(|a| (1..=3).contains(&a.src_access_order));
        if !idxs_ok || !orders_ok {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut copies = Vec::with_capacity(count);
        for i in 0..count {
            let c = Copy {
                dst: dsts[i],
                src: srcs[i],
                len: sizes[i],
            };
            check_copy("cuMemcpyBatchAsync", c).inspect_err(|_| failed_at = i)?;
            copies.push(c);
        }
        s.copy(copies)
    });
    if r.is_err() && !fail_idx.is_null() {
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { fail_idx.write(failed_at) };
    }
    code(r)
}

// ------------------------------------------------------------------ streams

/// `cuStreamCreate`.
///
/// # Safety
/// `out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut CUhandle, flags: c_uint) -> CUresult {
    let r = with_context().and_then(|()| {
        if out.is_null() || flags & !STREAM_NON_BLOCKING != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = stream::create_stream()?;
        // SAFETY: forwarded caller contract.
        unsafe { put(out, h as CUhandle) }
    });
    code(r)
}

/// `cuStreamDestroy` (`_v2`): returns at once; queued work still runs.
///
/// # Safety
/// None; the handle is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(h: CUhandle) -> CUresult {
    let r = with_context().and_then(|()| {
        stream::destroy_stream(h as usize).inspect_err(|_| {
            violations::record(format!("cuStreamDestroy: {h:?} is not a live stream"))
        })
    });
    code(r)
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// None; the handle is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(h: CUhandle) -> CUresult {
    code(
        with_context()
            .and_then(|()| stream::stream(h as usize))
            .map(|s| s.synchronize())
            .and_then(|()| not_lost()),
    )
}

/// `cuStreamQuery`: `CUDA_SUCCESS` when idle, `CUDA_ERROR_NOT_READY` otherwise.
///
/// # Safety
/// None; the handle is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(h: CUhandle) -> CUresult {
    let r = with_context().and_then(|()| stream::stream(h as usize));
    code(r.and_then(|s| {
        if s.is_idle() {
            not_lost()
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    }))
}

/// `cuStreamWaitEvent`: later work on `h` waits for the event's last recorded work.
///
/// # Safety
/// None; the handles are looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(
    h: CUhandle,
    event: CUhandle,
    flags: c_uint,
) -> CUresult {
    let r = with_context().and_then(|()| {
        if flags & !0x1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let e = stream::event(event as usize)?;
        stream::stream(h as usize)?.wait_event(&e)
    });
    code(r)
}

// ------------------------------------------------------------------ events

/// `cuEventCreate`.
///
/// # Safety
/// `out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut CUhandle, flags: c_uint) -> CUresult {
    let r = with_context().and_then(|()| {
        if out.is_null() || flags & !EVENT_FLAGS_ALL != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: forwarded caller contract.
        unsafe { put(out, stream::create_event() as CUhandle) }
    });
    code(r)
}

/// `cuEventRecord`: the event completes when `h` reaches this point.
///
/// # Safety
/// None; the handles are looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(event: CUhandle, h: CUhandle) -> CUresult {
    let r = with_context().and_then(|()| {
        let e = stream::event(event as usize)?;
        stream::stream(h as usize)?.record(&e)
    });
    code(r)
}

/// `cuEventQuery`: `CUDA_SUCCESS` when complete (or never recorded), else `CUDA_ERROR_NOT_READY`.
///
/// # Safety
/// None; the handle is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(event: CUhandle) -> CUresult {
    let r = with_context().and_then(|()| stream::event(event as usize));
    code(r.and_then(|e| {
        if e.is_complete() {
            not_lost()
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    }))
}

/// `cuEventSynchronize`.
///
/// # Safety
/// None; the handle is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(event: CUhandle) -> CUresult {
    code(
        with_context()
            .and_then(|()| stream::event(event as usize))
            .map(|e| e.synchronize())
            .and_then(|()| not_lost()),
    )
}

/// `cuEventDestroy` (`_v2`): returns at once; a pending record still completes.
///
/// # Safety
/// None; the handle is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: CUhandle) -> CUresult {
    let r = with_context().and_then(|()| {
        stream::destroy_event(event as usize).inspect_err(|_| {
            violations::record(format!("cuEventDestroy: {event:?} is not a live event"))
        })
    });
    code(r)
}

// ------------------------------------------------------------------ errors

/// `cuGetErrorName`.
///
/// # Safety
/// `out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, out: *mut *const c_char) -> CUresult {
    let r = describe(error).map(|(name, _)| name.as_ptr());
    // SAFETY: forwarded caller contract.
    code(unsafe { put_str(out, r) })
}

/// `cuGetErrorString`.
///
/// # Safety
/// `out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, out: *mut *const c_char) -> CUresult {
    let r = describe(error).map(|(_, text)| text.as_ptr());
    // SAFETY: forwarded caller contract.
    code(unsafe { put_str(out, r) })
}

/// Writes a static string (or null for an unknown code, with `CUDA_ERROR_INVALID_VALUE`).
///
/// # Safety
/// `out` is null or valid for a write.
unsafe fn put_str(out: *mut *const c_char, s: Option<*const c_char>) -> Result<(), CUresult> {
    // SAFETY: forwarded caller contract.
    unsafe { put(out, s.unwrap_or(std::ptr::null())) }?;
    s.map(drop).ok_or(CUDA_ERROR_INVALID_VALUE)
}

// ------------------------------------------------------------------ the simulator's own

/// Violations recorded since the library was loaded (see `KVBM_SIM_REPORT`, `KVBM_SIM_STRICT`).
///
/// # Safety
/// None; takes no pointers.
#[no_mangle]
pub unsafe extern "C" fn kvbm_sim_violations() -> u64 {
    violations::count()
}

// ------------------------------------------------------------------ test hooks (not CUDA)

/// Not a CUDA function: holds stream `h` (0: the legacy default stream) at this point of its
/// queue until [`kvbmSimReleaseHold`] is called with the handle written to `out`. For tests in
/// another crate that reach the simulator only as the `libcuda.so` cudarc loaded (they look
/// these two up with `dlsym`; a real driver has neither, and such a test then skips).
///
/// # Safety
/// `out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvbmSimHoldStream(h: CUhandle, out: *mut *mut c_void) -> CUresult {
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match stream::hold_stream(h as usize) {
        Ok(hold) => {
            // SAFETY: `out` is valid for a write (caller contract).
            unsafe { *out = Box::into_raw(Box::new(hold)).cast() };
            CUDA_SUCCESS
        }
        Err(e) => e,
    }
}

/// Not a CUDA function: releases a hold made by [`kvbmSimHoldStream`] (each handle once).
///
/// # Safety
/// `hold` is a handle [`kvbmSimHoldStream`] wrote and not released yet.
#[no_mangle]
pub unsafe extern "C" fn kvbmSimReleaseHold(hold: *mut c_void) -> CUresult {
    if hold.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: made by `Box::into_raw` in kvbmSimHoldStream, released once (caller contract).
    drop(unsafe { Box::from_raw(hold.cast::<stream::StreamHold>()) });
    CUDA_SUCCESS
}
