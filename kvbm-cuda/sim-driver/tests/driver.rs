//! The simulated driver called in-process, as Rust functions: what cudarc and kvbm-cuda rely on
//! (streams in order, events, cross-stream waits, batched copies), and what it refuses or
//! records (copies outside allocations, pageable memory, bad handles, no current context).
//!
//! Tests share one process under `cargo test`, so they check their own addresses in the
//! violation log, never its total.

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

use kvbm_cuda_sim::api::*;
use kvbm_cuda_sim::memory::POISON;
use kvbm_cuda_sim::result::*;
use kvbm_cuda_sim::{hold_stream, violations};

/// Initialises the driver and makes the primary context current on this thread.
fn ready() {
    // SAFETY: out-pointers are live locals.
    unsafe {
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        let mut ctx = null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    }
}

fn alloc(len: usize) -> u64 {
    let mut p = 0;
    // SAFETY: the out-pointer is a live local.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut p, len) }, CUDA_SUCCESS);
    p
}

fn new_stream() -> CUhandle {
    let mut s = null_mut();
    // SAFETY: the out-pointer is a live local.
    assert_eq!(unsafe { cuStreamCreate(&mut s, 1) }, CUDA_SUCCESS);
    s
}

fn new_event() -> CUhandle {
    let mut e = null_mut();
    // SAFETY: the out-pointer is a live local.
    assert_eq!(unsafe { cuEventCreate(&mut e, 2) }, CUDA_SUCCESS);
    e
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read_device(addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` holds `len` bytes.
    let rc = unsafe { cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), addr, len) };
    assert_eq!(rc, CUDA_SUCCESS);
    out
}

fn write_device(addr: u64, bytes: &[u8]) {
    // SAFETY: `bytes` is a live slice.
    let rc = unsafe { cuMemcpyHtoD_v2(addr, bytes.as_ptr().cast(), bytes.len()) };
    assert_eq!(rc, CUDA_SUCCESS);
}

fn mentions(addr: u64) -> bool {
    // As a whole address: `0x1000` must not match `0x10001`, another test's address (the tests
    // share the driver's violation list).
    let needle = format!("{addr:#x}");
    violations::messages().iter().any(|m| {
        m.match_indices(&needle)
            .any(|(at, _)| !m[at + needle.len()..].starts_with(|c: char| c.is_ascii_hexdigit()))
    })
}

/// Host memory registered with the driver for the life of the value.
struct Pinned(Vec<u8>);

impl Pinned {
    fn new(bytes: Vec<u8>) -> Self {
        let mut v = Pinned(bytes);
        // SAFETY: the vector stays allocated (never grown) until `Drop` unregisters it.
        let rc = unsafe { cuMemHostRegister_v2(v.0.as_mut_ptr().cast(), v.0.len(), 1) };
        assert_eq!(rc, CUDA_SUCCESS);
        v
    }

    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: registered in `new` at this address.
        let rc = unsafe { cuMemHostUnregister(self.0.as_mut_ptr().cast()) };
        assert_eq!(rc, CUDA_SUCCESS);
    }
}

#[test]
fn result_codes_and_batch_attributes_match_cudarc() {
    use cudarc::driver::sys;
    let theirs = [
        sys::CUresult::CUDA_SUCCESS,
        sys::CUresult::CUDA_ERROR_INVALID_VALUE,
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        sys::CUresult::CUDA_ERROR_NOT_INITIALIZED,
        sys::CUresult::CUDA_ERROR_NO_DEVICE,
        sys::CUresult::CUDA_ERROR_INVALID_DEVICE,
        sys::CUresult::CUDA_ERROR_INVALID_CONTEXT,
        sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
        sys::CUresult::CUDA_ERROR_NOT_READY,
        sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
        sys::CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
        sys::CUresult::CUDA_ERROR_UNKNOWN,
    ];
    let ours: Vec<(CUresult, &str)> = known_codes().collect();
    assert_eq!(ours.len(), theirs.len());
    for code in theirs {
        let name = format!("{code:?}");
        assert!(
            ours.contains(&(code as u32, name.as_str())),
            "{name} = {}",
            code as u32
        );
    }
    assert_eq!(
        std::mem::size_of::<CUmemcpyAttributes>(),
        std::mem::size_of::<sys::CUmemcpyAttributes>()
    );
    assert_eq!(
        sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM as u32,
        1
    );
}

#[test]
fn error_names_and_strings_are_static_c_strings() {
    let mut p = std::ptr::null();
    // SAFETY: out-pointers are live locals; the strings returned are static.
    unsafe {
        assert_eq!(cuGetErrorName(CUDA_ERROR_NOT_READY, &mut p), CUDA_SUCCESS);
        assert_eq!(CStr::from_ptr(p).to_str().unwrap(), "CUDA_ERROR_NOT_READY");
        assert_eq!(
            cuGetErrorString(CUDA_ERROR_INVALID_VALUE, &mut p),
            CUDA_SUCCESS
        );
        assert_eq!(CStr::from_ptr(p).to_str().unwrap(), "invalid argument");
        assert_eq!(cuGetErrorString(123_456, &mut p), CUDA_ERROR_INVALID_VALUE);
        assert!(p.is_null());
    }
}

#[test]
fn device_queries_answer_as_cudarc_expects() {
    ready();
    let mut name = [0 as std::ffi::c_char; 8];
    let mut version = 0;
    let mut count = 0;
    let mut pools = -1;
    let mut dev = -1;
    // SAFETY: out-pointers are live locals; `name` holds 8 bytes.
    unsafe {
        assert_eq!(cuDriverGetVersion(&mut version), CUDA_SUCCESS);
        assert_eq!(cuDeviceGetCount(&mut count), CUDA_SUCCESS);
        assert_eq!(cuDeviceGet(&mut dev, 0), CUDA_SUCCESS);
        assert_eq!(cuDeviceGet(&mut dev, 1), 101);
        assert_eq!(cuDeviceGetName(name.as_mut_ptr(), 8, 0), CUDA_SUCCESS);
        assert_eq!(cuDeviceGetAttribute(&mut pools, 115, 0), CUDA_SUCCESS);
        assert_eq!(
            CStr::from_ptr(name.as_ptr()).to_bytes(),
            &DEVICE_NAME.as_bytes()[..7]
        );
    }
    assert_eq!((version, count, pools), (12080, 1, 0));
}

#[test]
fn calls_that_need_a_context_fail_on_a_thread_without_one() {
    ready();
    std::thread::spawn(|| {
        let mut p = 0;
        let mut s = null_mut();
        // SAFETY: out-pointers are live locals.
        unsafe {
            assert_eq!(cuMemAlloc_v2(&mut p, 64), CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(cuStreamCreate(&mut s, 1), CUDA_ERROR_INVALID_CONTEXT);
            let mut current = 1 as CUhandle;
            assert_eq!(cuCtxGetCurrent(&mut current), CUDA_SUCCESS);
            assert!(current.is_null());
        }
    })
    .join()
    .unwrap();
}

#[test]
fn fresh_device_memory_is_poisoned_and_aligned() {
    ready();
    let p = alloc(1000);
    assert_eq!(p % DEVICE_ALIGN_BYTES, 0);
    assert!(read_device(p, 1000).iter().all(|&b| b == POISON));
    // SAFETY: `p` is a live allocation, freed once.
    assert_eq!(unsafe { cuMemFree_v2(p) }, CUDA_SUCCESS);
}

const DEVICE_ALIGN_BYTES: u64 = kvbm_cuda_sim::memory::DEVICE_ALIGN as u64;

#[test]
fn a_stream_runs_in_order_and_an_event_waits_for_it() {
    ready();
    let len = 1 << 16;
    let (a, b, c) = (alloc(len), alloc(len), alloc(len));
    let original = pattern(len, 7);
    write_device(a, &original);
    let s1 = new_stream();
    let s2 = new_stream();
    let e1 = new_event();
    let e2 = new_event();
    let hold = hold_stream(s1 as usize).unwrap();
    // SAFETY: the allocations are live until freed below, after both streams finished.
    unsafe {
        assert_eq!(cuMemcpyAsync(b, a, len, s1), CUDA_SUCCESS);
        assert_eq!(cuEventRecord(e1, s1), CUDA_SUCCESS);
        assert_eq!(cuStreamWaitEvent(s2, e1, 0), CUDA_SUCCESS);
        assert_eq!(cuMemcpyAsync(c, b, len, s2), CUDA_SUCCESS);
        assert_eq!(cuEventRecord(e2, s2), CUDA_SUCCESS);
        // s1 is held, so nothing after the hold ran, and s2 waits for s1.
        assert_eq!(cuEventQuery(e1), CUDA_ERROR_NOT_READY);
        assert_eq!(cuEventQuery(e2), CUDA_ERROR_NOT_READY);
        assert_eq!(cuStreamQuery(s1), CUDA_ERROR_NOT_READY);
        assert!(read_device(c, len).iter().all(|&x| x == POISON));
        drop(hold);
        assert_eq!(cuEventSynchronize(e2), CUDA_SUCCESS);
        assert_eq!(cuEventQuery(e1), CUDA_SUCCESS);
        assert_eq!(read_device(c, len), original);
        assert_eq!(cuStreamSynchronize(s1), CUDA_SUCCESS);
        assert_eq!(cuStreamQuery(s1), CUDA_SUCCESS);
        for e in [e1, e2] {
            assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
        }
        for s in [s1, s2] {
            assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
        }
        for p in [a, b, c] {
            assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
        }
    }
}

#[test]
fn an_event_never_recorded_is_complete() {
    ready();
    let e = new_event();
    // SAFETY: `e` is a live event.
    unsafe {
        assert_eq!(cuEventQuery(e), CUDA_SUCCESS);
        assert_eq!(cuEventSynchronize(e), CUDA_SUCCESS);
        assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
        // A destroyed handle is refused and recorded.
        assert_eq!(cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
    }
}

#[test]
fn offload_and_onboard_through_pinned_memory_are_byte_exact_and_clean() {
    ready();
    let len = 3 << 12;
    let gpu = alloc(len);
    let original = pattern(len, 3);
    write_device(gpu, &original);
    let host = Pinned::new(vec![0u8; len]);
    let s = new_stream();
    // SAFETY: both ranges stay live until the stream is synchronized below.
    unsafe {
        // Pieces in reverse order, as a scatter would issue them.
        for i in (0..3).rev() {
            let off = (i << 12) as u64;
            assert_eq!(
                cuMemcpyAsync(host.addr() + off, gpu + off, 1 << 12, s),
                CUDA_SUCCESS
            );
        }
        assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    }
    assert_eq!(host.0, original);
    assert!(
        !mentions(host.addr()) && !mentions(gpu),
        "{:#x} {gpu:#x} {:?}",
        host.addr(),
        violations::messages()
    );
    // SAFETY: `gpu` is live and freed once.
    assert_eq!(unsafe { cuMemFree_v2(gpu) }, CUDA_SUCCESS);
}

#[test]
fn a_copy_past_the_end_of_an_allocation_is_refused_and_recorded() {
    ready();
    let gpu = alloc(8192);
    let host = Pinned::new(vec![0u8; 8192]);
    let s = new_stream();
    let before = violations::count();
    // SAFETY: the copy is refused before anything is queued.
    let rc = unsafe { cuMemcpyAsync(host.addr(), gpu + 4097, 4096, s) };
    assert_eq!(rc, CUDA_ERROR_INVALID_VALUE);
    assert!(violations::count() > before);
    assert!(mentions(gpu + 4097), "{:?}", violations::messages());
    // SAFETY: as above; the host side runs past its registered range this time.
    let rc = unsafe { cuMemcpyAsync(host.addr() + 4096, gpu, 4097, s) };
    assert_eq!(rc, CUDA_ERROR_INVALID_VALUE);
    assert!(mentions(host.addr() + 4096));
    // SAFETY: live handles, destroyed once.
    unsafe {
        assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(gpu), CUDA_SUCCESS);
    }
}

#[test]
fn an_async_copy_from_pageable_memory_is_done_but_recorded() {
    ready();
    let gpu = alloc(256);
    let pageable = pattern(256, 9);
    let s = new_stream();
    // SAFETY: `pageable` outlives the synchronize below.
    unsafe {
        assert_eq!(
            cuMemcpyAsync(gpu, pageable.as_ptr() as u64, 256, s),
            CUDA_SUCCESS
        );
        assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    }
    assert_eq!(read_device(gpu, 256), pageable);
    assert!(mentions(pageable.as_ptr() as u64));
    // SAFETY: `gpu` is live and freed once.
    assert_eq!(unsafe { cuMemFree_v2(gpu) }, CUDA_SUCCESS);
}

#[test]
fn host_registration_refuses_overlaps_and_strangers() {
    ready();
    let host = Pinned::new(vec![0u8; 8192]);
    let inside = (host.addr() + 4096) as *mut c_void;
    // SAFETY: registration calls on memory `host` owns; all refused.
    unsafe {
        assert_eq!(
            cuMemHostRegister_v2(inside, 100, 0),
            CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        );
        assert_eq!(
            cuMemHostUnregister(inside),
            CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        );
        assert_eq!(
            cuMemHostRegister_v2(inside, 100, 0x100),
            CUDA_ERROR_INVALID_VALUE
        );
    }
    assert!(mentions(inside as u64));
}

/// (what is wrong with the batch, expected result, expected failIdx)
type BatchCase = (&'static str, fn(&mut Batch), CUresult, usize);

struct Batch {
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    attrs: Vec<CUmemcpyAttributes>,
    idxs: Vec<usize>,
    stream: CUhandle,
}

impl Batch {
    /// # Safety
    /// The ranges are live until the stream is synchronized.
    unsafe fn submit(&mut self) -> (CUresult, usize) {
        let mut fail = 77;
        // SAFETY: every array holds the counts passed; ranges by the caller's contract.
        let rc = unsafe {
            cuMemcpyBatchAsync(
                self.dsts.as_mut_ptr(),
                self.srcs.as_mut_ptr(),
                self.sizes.as_mut_ptr(),
                self.dsts.len(),
                self.attrs.as_mut_ptr(),
                self.idxs.as_mut_ptr(),
                self.attrs.len(),
                &mut fail,
                self.stream,
            )
        };
        (rc, fail)
    }
}

#[test]
fn batched_copies_are_checked_as_the_real_driver_checks_them() {
    ready();
    const PIECE: usize = 512;
    let piece = PIECE;
    let gpu = alloc(4 * piece);
    let original = pattern(4 * piece, 1);
    write_device(gpu, &original);
    let host = Pinned::new(vec![0u8; 4 * piece]);
    let s = new_stream();
    let attr = CUmemcpyAttributes {
        src_access_order: 1,
        src_loc_hint: [0; 2],
        dst_loc_hint: [0; 2],
        flags: 0,
    };
    let fresh = || Batch {
        dsts: (0..4).map(|i| host.addr() + (i * piece) as u64).collect(),
        srcs: (0..4).map(|i| gpu + (i * piece) as u64).collect(),
        sizes: vec![piece; 4],
        attrs: vec![attr],
        idxs: vec![0],
        stream: s,
    };
    let cases: &[BatchCase] = &[
        (
            "on the null stream",
            |b| b.stream = null_mut(),
            CUDA_ERROR_INVALID_VALUE,
            usize::MAX,
        ),
        (
            "first attribute index not 0",
            |b| b.idxs[0] = 1,
            CUDA_ERROR_INVALID_VALUE,
            usize::MAX,
        ),
        (
            "invalid access order",
            |b| b.attrs[0].src_access_order = 0,
            CUDA_ERROR_INVALID_VALUE,
            usize::MAX,
        ),
        (
            "piece 2 past the allocation",
            |b| b.sizes[2] = 3 * PIECE,
            CUDA_ERROR_INVALID_VALUE,
            2,
        ),
    ];
    for (what, spoil, rc, fail) in cases {
        let mut batch = fresh();
        spoil(&mut batch);
        // SAFETY: refused before anything is queued.
        assert_eq!(unsafe { batch.submit() }, (*rc, *fail), "{what}");
    }
    assert_eq!(
        host.0,
        vec![0u8; 4 * piece],
        "a refused batch copied nothing"
    );
    let mut batch = fresh();
    // SAFETY: the ranges are live until the synchronize below.
    unsafe {
        assert_eq!(batch.submit().0, CUDA_SUCCESS);
        assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(gpu), CUDA_SUCCESS);
    }
    assert_eq!(host.0, original);
}

#[test]
fn releasing_memory_a_queued_copy_still_touches_is_recorded_and_survived() {
    ready();
    let len = 4096;
    let gpu = alloc(len);
    let original = pattern(len, 5);
    write_device(gpu, &original);
    let mut host = vec![0u8; len];
    let host_addr = host.as_mut_ptr() as u64;
    // SAFETY: `host` stays allocated until the end of the test.
    let rc = unsafe { cuMemHostRegister_v2(host.as_mut_ptr().cast(), len, 0) };
    assert_eq!(rc, CUDA_SUCCESS);
    let s = new_stream();
    let hold = hold_stream(s as usize).unwrap();
    // SAFETY: the copy is queued behind the hold; freeing the allocation under it is the misuse
    // under test, which the driver survives by keeping the memory.
    unsafe {
        assert_eq!(cuMemcpyAsync(host_addr, gpu, len, s), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(gpu), CUDA_SUCCESS);
        assert_eq!(cuMemHostUnregister(host.as_mut_ptr().cast()), CUDA_SUCCESS);
    }
    let released: Vec<String> = violations::messages()
        .into_iter()
        .filter(|m| m.contains("released while a queued copy"))
        .collect();
    for addr in [gpu, host_addr] {
        let needle = format!("{addr:#x}+{len}");
        assert!(
            released.iter().any(|m| m.contains(&needle)),
            "{needle}: {released:?}"
        );
    }
    drop(hold);
    // SAFETY: a live stream, destroyed once.
    unsafe {
        assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    }
    assert_eq!(
        host, original,
        "the quarantined allocation still held its bytes"
    );
}

#[test]
fn without_a_wait_another_stream_does_not_see_the_copy() {
    // The simulator must not serialise streams, or a missing cuStreamWaitEvent would go unseen.
    ready();
    let len = 4096;
    let (a, b, c) = (alloc(len), alloc(len), alloc(len));
    write_device(a, &pattern(len, 2));
    let s1 = new_stream();
    let s2 = new_stream();
    let hold = hold_stream(s1 as usize).unwrap();
    // SAFETY: the allocations are live until freed below, after both streams finished.
    unsafe {
        assert_eq!(cuMemcpyAsync(b, a, len, s1), CUDA_SUCCESS);
        assert_eq!(cuMemcpyAsync(c, b, len, s2), CUDA_SUCCESS);
        assert_eq!(cuStreamSynchronize(s2), CUDA_SUCCESS);
        assert!(
            read_device(c, len).iter().all(|&x| x == POISON),
            "s2 waited for s1"
        );
        drop(hold);
        for s in [s1, s2] {
            assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
            assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
        }
        for p in [a, b, c] {
            assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
        }
    }
}

#[test]
fn the_default_stream_runs_copies_and_synchronizes() {
    ready();
    let len = 1024;
    let (a, b) = (alloc(len), alloc(len));
    let original = pattern(len, 4);
    write_device(a, &original);
    for default in [null_mut(), 2 as CUhandle] {
        // SAFETY: both allocations are live until freed below, after the synchronize.
        unsafe {
            assert_eq!(cuMemcpyAsync(b, a, len, default), CUDA_SUCCESS);
            assert_eq!(cuStreamSynchronize(default), CUDA_SUCCESS);
        }
        assert_eq!(read_device(b, len), original);
        write_device(b, &[0u8; 1024]);
    }
    // SAFETY: live allocations, freed once.
    unsafe {
        assert_eq!(cuCtxSynchronize(), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(a), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(b), CUDA_SUCCESS);
    }
}

#[test]
fn a_queued_copys_target_reads_as_poison_until_it_completes_unless_another_copy_reads_it() {
    // The missing-wait bug: the host reads a block a still-queued copy is writing. The target is
    // poisoned when the copy is queued, so such a reader sees POISON, never plausible old bytes.
    ready();
    let len = 4096;
    let gpu = alloc(len);
    let original = pattern(len, 9);
    write_device(gpu, &original);
    let mut host = vec![0x11u8; 2 * len];
    let host_addr = host.as_mut_ptr() as u64;
    // SAFETY: `host` stays allocated (and registered) until the end of the test.
    let rc = unsafe { cuMemHostRegister_v2(host.as_mut_ptr().cast(), 2 * len, 0) };
    assert_eq!(rc, CUDA_SUCCESS);
    let (s1, s2) = (new_stream(), new_stream());
    let hold1 = hold_stream(s1 as usize).unwrap();
    let hold2 = hold_stream(s2 as usize).unwrap();
    let second_half = host_addr + len as u64;
    // SAFETY: ranges inside `gpu` and the registered `host`; both outlive the streams' work.
    unsafe {
        // s1 is to read the second half of `host` (an H2D copy queued first) ...
        assert_eq!(cuMemcpyAsync(gpu, second_half, len, s1), CUDA_SUCCESS);
        // ... so a D2H copy into it queued later on s2 must not poison what s1 still reads.
        assert_eq!(cuMemcpyAsync(second_half, gpu, len, s2), CUDA_SUCCESS);
        // The first half is touched by nothing queued: poisoned at once.
        assert_eq!(cuMemcpyAsync(host_addr, gpu, len, s2), CUDA_SUCCESS);
    }
    // A host read without a wait (volatile: the simulator wrote it behind the compiler's back).
    // SAFETY: `at` < 2 * len, inside `host`.
    let peek = |at: usize| unsafe { std::ptr::read_volatile(host.as_ptr().add(at)) };
    assert!(
        (0..len).all(|i| peek(i) == POISON),
        "an unwaited target reads as poison"
    );
    assert!(
        (len..2 * len).all(|i| peek(i) == 0x11),
        "a target another copy reads is kept"
    );
    drop(hold1);
    // SAFETY: live streams, destroyed once after they finished.
    unsafe {
        assert_eq!(cuStreamSynchronize(s1), CUDA_SUCCESS);
        assert!(
            read_device(gpu, len).iter().all(|&b| b == 0x11),
            "s1 read the old bytes"
        );
        write_device(gpu, &original);
        drop(hold2);
        assert_eq!(cuStreamSynchronize(s2), CUDA_SUCCESS);
        for s in [s1, s2] {
            assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
        }
        assert_eq!(cuMemHostUnregister(host.as_mut_ptr().cast()), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(gpu), CUDA_SUCCESS);
    }
    assert_eq!(&host[..len], &original[..], "the copy landed");
    assert_eq!(&host[len..], &original[..], "the copy landed");
}

#[test]
fn a_destroyed_stream_still_running_its_queue_keeps_its_sources_unpoisoned() {
    // CUDA lets a stream be destroyed with work queued; that work still runs, so its sources
    // stay off limits for poisoning by later copies of other streams.
    ready();
    let len = 4096;
    let (gpu, gpu2) = (alloc(len), alloc(len));
    let original = pattern(len, 21);
    let mut host = original.clone();
    // SAFETY: `host` stays allocated (and registered) until the end of the test.
    let rc = unsafe { cuMemHostRegister_v2(host.as_mut_ptr().cast(), len, 0) };
    assert_eq!(rc, CUDA_SUCCESS);
    let host_addr = host.as_mut_ptr() as u64;
    let s1 = new_stream();
    let hold = hold_stream(s1 as usize).unwrap();
    let s2 = new_stream();
    // SAFETY: ranges inside live allocations and the registered `host`, which outlive the work.
    unsafe {
        assert_eq!(cuMemcpyAsync(gpu, host_addr, len, s1), CUDA_SUCCESS);
        let read = new_event();
        assert_eq!(cuEventRecord(read, s1), CUDA_SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s1), CUDA_SUCCESS);
        // Another stream's copy into `host`, queued while s1's copy still has to read it: a
        // race in a real program, but the simulator must not be the one that breaks s1's read.
        let s2_hold = hold_stream(s2 as usize).unwrap();
        assert_eq!(cuMemcpyAsync(host_addr, gpu2, len, s2), CUDA_SUCCESS);
        drop(hold);
        assert_eq!(cuEventSynchronize(read), CUDA_SUCCESS);
        assert_eq!(cuEventDestroy_v2(read), CUDA_SUCCESS);
        assert_eq!(read_device(gpu, len), original, "s1 read what host held");
        drop(s2_hold);
        assert_eq!(cuStreamSynchronize(s2), CUDA_SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s2), CUDA_SUCCESS);
        assert_eq!(cuMemHostUnregister(host.as_mut_ptr().cast()), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(gpu), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(gpu2), CUDA_SUCCESS);
    }
}
