//! The KV cache event model: what a publisher says about a tier's contents.
//!
//! Events speak sequence hashes (the registry's key). A `BlockStored` carries the stored blocks'
//! token ids so that a reader can recompute and check the hashes; a `BlockRemoved` carries only
//! hashes. Each event leaves its publisher as an [`EventRecord`] stamped with a sequence number.

use crate::{SequenceHash, Tier};

/// Blocks became resident (findable) in `tier`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// The tier the blocks now live in.
    pub tier: Tier,
    /// Sequence hashes of the stored blocks, in prefix order.
    pub block_hashes: Vec<SequenceHash>,
    /// Sequence hash of the block before the first stored block, if any.
    pub parent_hash: Option<SequenceHash>,
    /// Token ids of the stored blocks, `block_size` per block, concatenated; may be empty when the
    /// publisher does not know them (kvbm always does).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// LoRA adapter the blocks were computed with.
    pub lora_name: Option<String>,
}

/// Blocks left `tier`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    /// The tier the blocks left.
    pub tier: Tier,
    /// Sequence hashes of the removed blocks.
    pub block_hashes: Vec<SequenceHash>,
}

/// One change to a publisher's cache contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks became resident in a tier.
    BlockStored(BlockStored),
    /// Blocks left a tier.
    BlockRemoved(BlockRemoved),
    /// Every block of every tier of this publisher is gone.
    AllBlocksCleared,
}

/// An event as delivered: stamped with its publisher's sequence number (from 0, no holes at the
/// publisher; a hole seen by a subscriber means that subscriber lost events).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRecord {
    /// Per-publisher sequence number.
    pub seq: u64,
    /// The event.
    pub event: KvEvent,
}
