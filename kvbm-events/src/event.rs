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
    /// Every block of every tier of this publisher is gone (its shared pool's blocks stay).
    AllBlocksCleared,
    /// Blocks the publisher wrote to a shared pool that other workers reach (the shared tier,
    /// Dynamo's G4), `pool` naming it. On the wire as vLLM 0.33 writes a store of a tier that is
    /// not the publisher's own: medium `STORAGE`, `locality` `REMOTE`, the pool in `ownership`.
    /// The inner event's `tier` is not used.
    SharedStored {
        /// The pool's name.
        pool: String,
        /// The blocks.
        stored: BlockStored,
    },
    /// Blocks that left a shared pool (as far as the publisher knows: their TTL ran out).
    SharedRemoved {
        /// The pool's name.
        pool: String,
        /// The blocks.
        removed: BlockRemoved,
    },
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

/// The kind of a KV cache group, as vLLM 0.33 names it in `BlockStored.kv_cache_spec_kind`
/// (`KVCacheSpecKind`, set by `get_kv_cache_spec_kind` in vllm/v1/kv_cache_interface.py and
/// stamped on stores by `KVCacheManager.take_events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// `full_attention`.
    FullAttention,
    /// `mla_attention`.
    MlaAttention,
    /// `sink_full_attention`.
    SinkFullAttention,
    /// `sliding_window`.
    SlidingWindow,
    /// `sliding_window_mla`.
    SlidingWindowMla,
    /// `chunked_local_attention`.
    ChunkedLocalAttention,
    /// `mamba` (Mamba and linear-attention state).
    Mamba,
    /// `encoder_only_attention`.
    EncoderOnlyAttention,
    /// `cross_attention`.
    CrossAttention,
    /// `unknown`, or a name this crate does not know.
    Unknown,
}

/// How a group's blocks bear on a prefix hit (vLLM's `find_longest_cache_hit` per manager in
/// vllm/v1/core/single_type_kv_cache_manager.py).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupRole {
    /// Every block of the prefix is needed (`FullAttentionManager`): the group's blocks are the
    /// prefix claims.
    Prefix,
    /// The blocks inside the window before the hit point are needed (`SlidingWindowManager`).
    Window,
    /// The block ending at the hit point is needed (`MambaManager`, state at block boundaries).
    State,
    /// Not modelled: chunked local attention (its chunk size is not on the wire), groups that
    /// are not prefix-cached (encoder-only, cross attention) and unknown kinds.
    Ignored,
}

impl GroupKind {
    /// Every kind, in vLLM's order.
    pub const ALL: [GroupKind; 10] = [
        GroupKind::FullAttention,
        GroupKind::MlaAttention,
        GroupKind::SlidingWindow,
        GroupKind::SlidingWindowMla,
        GroupKind::Mamba,
        GroupKind::ChunkedLocalAttention,
        GroupKind::SinkFullAttention,
        GroupKind::EncoderOnlyAttention,
        GroupKind::CrossAttention,
        GroupKind::Unknown,
    ];

    /// The kind vLLM's name stands for; `Unknown` for any other name.
    pub fn from_name(name: &str) -> GroupKind {
        GroupKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .unwrap_or(GroupKind::Unknown)
    }

    /// vLLM's name of the kind.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::FullAttention => "full_attention",
            GroupKind::MlaAttention => "mla_attention",
            GroupKind::SinkFullAttention => "sink_full_attention",
            GroupKind::SlidingWindow => "sliding_window",
            GroupKind::SlidingWindowMla => "sliding_window_mla",
            GroupKind::ChunkedLocalAttention => "chunked_local_attention",
            GroupKind::Mamba => "mamba",
            GroupKind::EncoderOnlyAttention => "encoder_only_attention",
            GroupKind::CrossAttention => "cross_attention",
            GroupKind::Unknown => "unknown",
        }
    }

    /// How the kind's blocks bear on a hit. vLLM's managers by spec (the `KVCacheSpecRegistry`
    /// registrations at the end of vllm/v1/core/single_type_kv_cache_manager.py): full and MLA
    /// attention use `FullAttentionManager`, sink-full attention its subclass-like manager over
    /// the whole prefix; sliding window (MLA too) `SlidingWindowManager`; Mamba `MambaManager`.
    pub fn role(self) -> GroupRole {
        match self {
            GroupKind::FullAttention | GroupKind::MlaAttention | GroupKind::SinkFullAttention => {
                GroupRole::Prefix
            }
            GroupKind::SlidingWindow | GroupKind::SlidingWindowMla => GroupRole::Window,
            GroupKind::Mamba => GroupRole::State,
            GroupKind::ChunkedLocalAttention
            | GroupKind::EncoderOnlyAttention
            | GroupKind::CrossAttention
            | GroupKind::Unknown => GroupRole::Ignored,
        }
    }
}
