//! kvbm-disk: a disk store of byte blocks under u64 keys. Knows nothing of KV semantics.
//!
//! Layers (bottom up, after foyer's): [`AlignedBuf`] (4 KiB-aligned memory for O_DIRECT),
//! [`format`] (the superblock and per-block headers, pure encode/decode), [`CacheFile`] (one
//! preallocated, locked, 0600 file in a 0700 directory, opened with O_DIRECT or buffered), and the
//! I/O engines ([`IoEngine`]: io_uring with registered buffers and files, or psync), chosen once.
//!
//! Invariants:
//! - Every offset and length that reaches an engine is a multiple of [`ALIGN_BYTES`]; unaligned
//!   requests are refused before any I/O.
//! - An engine keeps each request's buffers alive until the kernel (or the psync worker) has
//!   finished with them (STYLE.md habit 5); dropping a ticket only withdraws interest.
//! - Bytes read from disk are data only after their header and checksum were verified; decoding
//!   never panics on any input.

mod align;
mod engine;
mod error;
mod file;
pub mod format;
mod store;

pub use align::{AlignedBuf, ALIGN_BYTES};
pub use engine::{
    open_engine, open_engine_with_buffers, BufOp, EngineChoice, EngineKind, IoEngine, IoOp,
    IoTicket, OpKind, ENGINE_ENV, JOBS_QUEUED_MAX, QUEUE_DEPTH_MAX, REGISTERED_BUFFER_BYTES_MAX,
};
pub use error::DiskError;
pub use file::{
    check_file_name, CacheFile, CacheFileOptions, IoMode, CACHE_DIR_MODE, CACHE_FILE_MODE,
    LOCK_WAIT_DEFAULT,
};
pub use store::{
    DiskStore, Lookup, Miss, ReadRequest, Recovered, RecoveredBlock, StoreOptions, StoreStats,
    WriteOutcome, WriteRequest, CHECKPOINT_SUFFIX, SCAN_SLOTS_PER_JOB, SLOT_PAYLOAD_BYTES_MAX,
};
