//! What kvbm-cuda does after a copy faults on its stream, replayed on the simulator in-process:
//! a copy into a pinned host range waits in one stream's queue while a copy on another stream
//! faults (`KVBM_SIM_FAIL=async:1:CODE`); the caller sees the error, unregisters the range
//! (refused: the context is lost) and unmaps it, as a dropped host region does; then the held
//! stream goes on. On a GPU nothing more runs on a lost context; a simulator whose worker still
//! touched the range (poisoning it under jitter, or copying) would crash here. Prints
//! `survived` and exits 0 when nothing touched the unmapped range. Run by `tests/kvbm_bench.rs`
//! with jitter on.

use kvbm_cuda_sim::api::*;
use kvbm_cuda_sim::result::*;
use kvbm_cuda_sim::{drain_stream, hold_stream};

fn main() {
    let len = 1 << 16;
    // SAFETY: each call follows the driver API's contract: out-pointers are live locals; the
    // mapping is unmapped once, after its registration was released (or refused), and only the
    // simulator's lost context stands between the queued copy and the unmapped range, which is
    // what this program checks.
    unsafe {
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
        let host = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(host, libc::MAP_FAILED);
        assert_eq!(cuMemHostRegister_v2(host, len, 0), CUDA_SUCCESS);
        let mut gpu = 0;
        assert_eq!(cuMemAlloc_v2(&mut gpu, len), CUDA_SUCCESS);
        let (mut held, mut faulting) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(cuStreamCreate(&mut held, 1), CUDA_SUCCESS);
        assert_eq!(cuStreamCreate(&mut faulting, 1), CUDA_SUCCESS);
        let hold = hold_stream(held as usize).unwrap();
        assert_eq!(cuMemcpyAsync(host as u64, gpu, len, held), CUDA_SUCCESS);
        // The fault: the first copy a stream runs (the held one has not run yet).
        let half = len / 2;
        assert_eq!(
            cuMemcpyAsync(gpu + half as u64, gpu, half, faulting),
            CUDA_SUCCESS
        );
        let lost = cuStreamSynchronize(faulting);
        assert_ne!(lost, CUDA_SUCCESS, "set KVBM_SIM_FAIL=async:1:CODE");
        assert_eq!(cuMemHostUnregister(host), lost);
        assert_eq!(libc::munmap(host, len), 0);
        drop(hold);
        assert_eq!(cuStreamSynchronize(held), lost);
        // CUDA calls return at once on a lost context: wait for the worker itself.
        drain_stream(held as usize).unwrap();
        println!("survived");
    }
}
