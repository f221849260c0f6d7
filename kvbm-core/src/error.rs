//! kvbm-core's error type. Expected outcomes (a miss, a throttled offload) are values elsewhere;
//! these are operational failures and bad arguments.

use kvbm_cuda::DeviceError;

use crate::config::ConfigError;

/// Why a block manager operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoreError {
    /// The configuration is invalid (names the variable and the value).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The device layer failed.
    #[error("device: {0}")]
    Device(#[from] DeviceError),
    /// A layout that cannot exist, or two layouts that do not fit together.
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),
    /// A pool has too few free or evictable blocks.
    #[error("{tier} tier exhausted: {requested} blocks requested, {available} free or evictable")]
    Exhausted {
        /// The tier.
        tier: kvbm_events::Tier,
        /// Blocks asked for.
        requested: usize,
        /// Blocks that could have been given.
        available: usize,
    },
    /// A block handle was given to a pool it does not belong to, or a list of the wrong length.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A transfer failed on the device; its target blocks were returned to their pool.
    #[error("transfer failed: {0}")]
    TransferFailed(String),
    /// Blocks are held or being copied, so the operation cannot run now.
    #[error("busy: {0}")]
    Busy(String),
    /// The disk tier failed to open or to run.
    #[error("disk tier: {0}")]
    Disk(String),
    /// The shared tier cannot be set up as configured.
    #[error("shared tier: {0}")]
    Shared(String),
    /// The copy engine has shut down.
    #[error("the copy engine has shut down")]
    EngineClosed,
}
