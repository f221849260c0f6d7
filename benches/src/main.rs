//! `kvbm-bench`: kvbm's standalone benchmarks.
//!
//! - `offload`: GPU -> host -> GPU through the block manager, every byte verified, next to a plain
//!   memcpy of the same bytes in the same run.
//! - `disk`: blocks written to and read from kvbm-disk's store, verified, next to fio with the same
//!   block size, queue depth and bytes on the same file system.
//! - `router`: the router index on issue 4's generated workload.
//! - `replay`: a request trace (Mooncake's, or multi-turn sessions) through kvbm-router's OpenAI
//!   front end against simulated vLLM workers (`kvbm-mocker`), once per routing mode.
//! - `copy` and `pin`: the device layer alone (copy streams both ways and at once; pinning), for
//!   the GPU checks of `scripts/gpu-check.sh`.

mod copy;
mod disk;
mod offload;
mod replay;
mod router;
mod router_workload;
mod shared;
mod stats;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Heap bytes in use, for `kvbm-bench router`'s bytes per resident pair.
pub(crate) static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting bytes in use.
struct Counting;

// SAFETY: every call is forwarded unchanged to the system allocator; the counter is only
// arithmetic on the sizes it was given.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout, which meets `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from this allocator (hence `System`) with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged; `ptr` and `layout` came from this allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "kvbm-bench", about = "kvbm's standalone benchmarks", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Offload GPU blocks to the pinned host tier and onboard them back, verified, against memcpy.
    Offload(offload::OffloadArgs),
    /// Write and read blocks through kvbm-disk (io_uring, O_DIRECT, registered buffers) against fio.
    Disk(disk::DiskArgs),
    /// The router index on the generated workload: apply rate, find_matches latency, bytes/pair.
    Router(router::RouterArgs),
    /// Replay a request trace through kvbm-router against a simulated fleet (kvbm-mocker), one
    /// fresh fleet and router per routing mode; a table on stdout, everything in a JSON file.
    Replay(Box<replay::ReplayArgs>),
    /// The device layer alone: D2H, H2D and both at once between GPU and pinned host memory,
    /// in vLLM's GPU layouts or a contiguous one, every byte verified, against memcpy.
    Copy(copy::CopyArgs),
    /// Map a pinned host pool and report when its first chunk and all of it are usable.
    Pin(copy::PinArgs),
    /// The shared tier (Redis / Valkey): write and read blocks through kvbm's client against
    /// redis-benchmark's SET and GET of the same size at the same pipeline depth.
    Shared(shared::SharedArgs),
}

fn main() -> std::process::ExitCode {
    let filter = std::env::var("DYN_LOG").unwrap_or_else(|_| "warn".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| {
                eprintln!("DYN_LOG={filter:?} is not a valid log filter; using \"warn\"");
                tracing_subscriber::EnvFilter::new("warn")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Offload(args) => offload::run(args),
        Command::Disk(args) => disk::run(args),
        Command::Router(args) => router::run(args),
        Command::Replay(args) => replay::run(*args),
        Command::Copy(args) => copy::run_copy(args),
        Command::Pin(args) => copy::run_pin(args),
        Command::Shared(args) => shared::run(args),
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(err) => {
            eprintln!("kvbm-bench: {err:#}");
            std::process::ExitCode::from(2)
        }
    }
}
