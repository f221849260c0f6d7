//! kvbm-core: the block manager. Policy lives here; mechanisms live in the leaf crates.
//!
//! Owns: KV layouts and the copy pieces between them ([`layout`]), per-tier pools with the block
//! lifecycle and the registry ([`pool`]), eviction policies ([`eviction`]), the split engine (the
//! [`leader`] decides, the [`worker`] moves bytes through the [`copy`] engine and the disk
//! hand-off, executing a [`plan`]), the block manager that is one leader and one worker in one
//! process ([`manager`]), the connector's per-request bookkeeping ([`requests`]),
//! configuration from Dynamo's environment variables ([`config`]) and counters ([`metrics`]).
//! Does not own: moving bytes (kvbm-cuda), hashing and events (kvbm-events).
//!
//! Invariant: no `unsafe` in this crate but `disk::handoff`, which hands host blocks' memory to
//! kvbm-disk (see its header for why that is sound), and `Worker::register_spans`, which
//! registers the engine's GPU memory under its caller's contract.
#![deny(unsafe_code)]

pub mod config;
pub mod copy;
pub mod disk;
mod error;
pub mod eviction;
pub mod groups;
pub mod layout;
pub mod leader;
pub mod manager;
pub mod metrics;
pub mod plan;
pub mod pool;
pub mod requests;
pub mod shared;
pub mod transfer;
pub mod worker;

pub use config::{ConfigError, KvbmConfig, TierSize};
pub use disk::{
    decode_identity, encode_identity, layout_fingerprint, Admission, DiskOptions, ADMIT_THRESHOLD,
};
pub use error::CoreError;
pub use eviction::{EvictionPolicy, LruPriority};
pub use groups::{GroupKind, Groups, NULL_BLOCK};
pub use layout::{
    BlockLayout, GpuLayout, KvLayout, LayerShape, LayoutKind, PagedShape, PhysicalLayout, Run,
    TensorView, ViewsLayout, BLOCK_ALIGN_BYTES, HEADER_ROOM_BYTES, RUNS_PER_BLOCK_MAX,
};
pub use leader::{
    DiskRead, DiskWrite, Leader, LeaderCounts, LeaderOptions, OffloadBlock, Offloaded,
    OnboardHolds, Placed, SharedHit, SharedRead, SharedWrite, TokenRun, HOLD_STEPS,
};
pub use manager::{BlockManager, GpuMemory, ManagerOptions, PrefixMatch, HOST_PIN_CHUNK_BYTES};
pub use metrics::{LatencyHistogram, Metrics, MetricsSnapshot};
pub use plan::{AsyncOnboard, Offload, Onboard, StepPlan, StepReport};
pub use pool::{
    clear_across, match_across, BlockId, BlockIdentity, BlockPool, BlockState, CompleteBlock,
    FillingBlock, HeldBlocks, PoolCounts, RegisteredBlock, Rejected,
};
pub use worker::{
    check_view_within, default_device_kind, first_unwritable_range, host_range_writable,
    open_device, SharedWorkerOptions, Worker, WorkerOptions, WorkerStats,
};
// What the bindings need of the leaves, through core (they depend on kvbm-core alone).
pub use kvbm_cuda::{DeviceKind, Direction, StreamHold};
pub use kvbm_disk::EngineChoice;
pub use kvbm_events::{
    BlockHasher, BlockRemoved as BlockRemovedEvent, BlockStored as BlockStoredEvent, KvEvent,
    SequenceHash, Tier,
};
pub use transfer::{BatchLatency, TransferLimits, TransferOutcome, TransferTicket};
