//! Loads the CUDA driver as cudarc does (by name, through `LD_LIBRARY_PATH`) and makes one
//! asynchronous copy from pageable host memory, a violation on the simulated driver; then prints
//! the simulator's violation count. Run by `tests/kvbm_bench.rs` with the simulator installed.

use cudarc::driver::sys;

fn main() {
    // SAFETY: each call follows the driver API's contract: out-pointers are live locals, the
    // device allocation is freed once after the stream finished with it, and `pageable` outlives
    // the synchronize.
    unsafe {
        assert!(sys::is_culib_present(), "no libcuda on LD_LIBRARY_PATH");
        sys::cuInit(0).result().unwrap();
        let mut dev = 0;
        sys::cuDeviceGet(&mut dev, 0).result().unwrap();
        let mut ctx = std::ptr::null_mut();
        sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
            .result()
            .unwrap();
        sys::cuCtxSetCurrent(ctx).result().unwrap();
        let mut stream = std::ptr::null_mut();
        sys::cuStreamCreate(&mut stream, 1).result().unwrap();
        let mut gpu = 0;
        sys::cuMemAlloc_v2(&mut gpu, 4096).result().unwrap();
        let pageable = vec![1u8; 4096];
        sys::cuMemcpyAsync(gpu, pageable.as_ptr() as u64, 4096, stream)
            .result()
            .unwrap();
        sys::cuStreamSynchronize(stream).result().unwrap();
        sys::cuMemFree_v2(gpu).result().unwrap();
        let count = *sys::culib()
            .get::<unsafe extern "C" fn() -> u64>(b"kvbm_sim_violations")
            .expect("the simulated driver exports kvbm_sim_violations");
        println!("violations {}", count());
    }
}
