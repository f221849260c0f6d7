//! kvbm-cuda-sim: a simulated CUDA driver. Built as a `cdylib`, it is the `libcuda.so` cudarc
//! loads (put it on `LD_LIBRARY_PATH` as `libcuda.so` / `libcuda.so.1`; [`install`] does it),
//! so that kvbm-cuda's CUDA back end runs where no GPU exists, and stricter than a GPU would.
//!
//! Owns: the driver entry points cudarc 0.19 and kvbm-cuda call (`api`), "device memory" and
//! registered host ranges (`memory`), streams as FIFO worker threads and events (`stream`), the
//! violation log (`violations`), settings from the environment (`config`).
//! Does not: run kernels, model timing, or know anything of kvbm (it depends on no kvbm crate).
//!
//! Semantics, as on a GPU: device memory is host memory handed out as `CUdeviceptr`s; each stream
//! runs its operations in order, asynchronously to the caller; an event completes when its stream
//! reaches it; `cuStreamWaitEvent` holds a stream until another stream's event completes;
//! `cuStreamSynchronize`, `cuEventSynchronize` and `cuCtxSynchronize` block until done.
//! Stricter than a GPU: every asynchronous copy must lie inside a live device allocation or a
//! registered host range, and no memory a queued copy touches may be freed or unregistered.
//! `KVBM_SIM_STRICT=1` aborts on the first violation and `KVBM_SIM_REPORT` names a file that
//! lists them; `KVBM_SIM_JITTER_SEED` delays each stream operation by a seeded random amount so
//! that a missing wait shows up as wrong bytes; `KVBM_SIM_FAIL` fails chosen calls with chosen
//! results (see `faults`).
//!
//! Invariants:
//! - The library has one device (ordinal 0) with one primary context.
//! - Exported functions never unwind: failures are `CUresult`s, misuse is a violation.

pub mod api;
mod config;
pub mod faults;
pub mod memory;
pub mod result;
mod stream;
pub mod violations;

pub use config::{
    DRIVER_VERSION_ENV, JITTER_SEED_ENV, JITTER_US_ENV, MEMORY_BYTES_ENV, REPORT_ENV, STRICT_ENV,
};
pub use stream::{drain_stream, hold_stream, StreamHold};

/// The file names cudarc 0.19 tries first for the driver on Linux (`libcuda.so`, then
/// `libcuda.so.1` among others).
pub const DRIVER_FILE_NAMES: &[&str] = &["libcuda.so", "libcuda.so.1"];

/// Links (or, across file systems, copies) the built library `cdylib` into `dir` under each of
/// [`DRIVER_FILE_NAMES`], so that a process started with `LD_LIBRARY_PATH=dir` loads it as the
/// CUDA driver.
pub fn install(cdylib: &std::path::Path, dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for name in DRIVER_FILE_NAMES {
        let target = dir.join(name);
        let _ = std::fs::remove_file(&target);
        if std::fs::hard_link(cdylib, &target).is_err() {
            std::fs::copy(cdylib, &target)?;
        }
    }
    Ok(())
}
