//! KV cache groups of a hybrid model, as vLLM's hybrid KV cache manager (HMA) runs them: one
//! group per layer type (full attention, sliding window, Mamba state), each with its own block
//! table, all drawing from one pool of GPU blocks.
//!
//! What this module decides, and nothing else: under which key each group's copy of a block
//! lives in kvbm's tiers, and which blocks of which group a hit of `n` blocks needs, following
//! vLLM 0.33's own hit rules (`vllm/v1/core/single_type_kv_cache_manager.py`,
//! `find_longest_cache_hit` of `FullAttentionManager`, `SlidingWindowManager` and
//! `MambaManager`; `vllm/v1/core/kv_cache_coordinator.py`, `HybridKVCacheCoordinator`).
//!
//! Why the worker needs no group: vLLM plans hybrid models with one physical page size for every
//! group and one `BlockPool` for all of them (`vllm/v1/core/kv_cache_planning.py`,
//! `_get_kv_cache_groups_uniform_page_size`), and gives the i-th layer of every group the same
//! tensor (`vllm/v1/worker/utils.py`, `allocate_kv_cache`). So GPU block id `N` names the same
//! bytes in every layer tensor, whichever group holds it, and the worker copies it the same way
//! for every group; the bytes are those of the group that holds the block.
//!
//! Invariants:
//! - The primary group (the first full-attention group, else group 0) keys a block by its
//!   sequence hash, so a model with one group keeps the keys, events and disk files it had
//!   before groups existed. Every other group's key is derived from the hash, the group's index
//!   and its kind ([`Groups::key`]), so no two groups' blocks share a key on any tier, and a
//!   changed group layout never reads another layout's blocks as its own.
//! - A hit of `n` blocks after `start` is reported only when every group holds what vLLM needs
//!   for it ([`Groups::needed`]): a full-attention group every block of `start..n`, a
//!   sliding-window group the blocks of its window before `n`, a Mamba group (vLLM's `align`
//!   mode) the block whose state ends at `n`.
//! - GPU block id 0 is vLLM's null block (`vllm/v1/core/block_pool.py`, `BlockPool.__init__`
//!   takes the first free block as `null_block`): it stands for a block a group skipped and is
//!   never copied to or from.

use std::fmt;
use std::ops::Range;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::CoreError;

/// vLLM's null block: the placeholder of a block a group does not keep.
pub const NULL_BLOCK: u32 = 0;

/// Seed of the derivation of a non-primary group's block keys.
const GROUP_KEY_SEED: u64 = 0x6b76_626d_6772_7570; // "kvbmgrup"

/// What a group needs of the blocks before a hit point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Every block of the prefix (vLLM's `FullAttentionSpec`, MLA).
    Full,
    /// The blocks of its window before the hit point: `cdiv(window_tokens - 1, block_size)`
    /// of them (vLLM's `SlidingWindowSpec`; `SlidingWindowManager._contiguous_blocks_for_hit`).
    SlidingWindow {
        /// The window, in tokens.
        window_tokens: usize,
    },
    /// The blocks of the hit point's attention chunk before it: from `floor(n / chunk) * chunk`
    /// tokens on (vLLM's `ChunkedLocalAttentionSpec`;
    /// `ChunkedLocalAttentionManager.find_longest_cache_hit`).
    ChunkedLocal {
        /// The attention chunk, in tokens.
        chunk_tokens: usize,
    },
    /// The state at the hit point, which vLLM's `align` mode keeps in the last block before it
    /// (`MambaSpec`; `MambaManager.find_longest_cache_hit`).
    MambaAlign,
}

impl GroupKind {
    /// The stable name of the kind (in errors, metrics and key derivation).
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Full => "full_attention",
            GroupKind::SlidingWindow { .. } => "sliding_window",
            GroupKind::ChunkedLocal { .. } => "chunked_local_attention",
            GroupKind::MambaAlign => "mamba",
        }
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupKind::SlidingWindow { window_tokens } => {
                write!(f, "sliding_window({window_tokens})")
            }
            GroupKind::ChunkedLocal { chunk_tokens } => {
                write!(f, "chunked_local_attention({chunk_tokens})")
            }
            other => f.write_str(other.name()),
        }
    }
}

/// The KV cache groups of one model, in vLLM's order (`kv_cache_config.kv_cache_groups`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups {
    kinds: Vec<GroupKind>,
    primary: usize,
    block_size: usize,
}

impl Groups {
    /// One full-attention group: every model before hybrid support, and every non-hybrid one.
    pub fn single(block_size: usize) -> Self {
        Self {
            kinds: vec![GroupKind::Full],
            primary: 0,
            block_size,
        }
    }

    /// The groups of a model with blocks of `block_size` tokens; refuses an empty list and a
    /// sliding window of no tokens.
    pub fn new(kinds: Vec<GroupKind>, block_size: usize) -> Result<Self, CoreError> {
        if kinds.is_empty() {
            return Err(CoreError::InvalidArgument("no KV cache group".into()));
        }
        if block_size == 0 {
            return Err(CoreError::InvalidArgument("block size 0".into()));
        }
        if let Some((g, k)) = kinds.iter().enumerate().find(|(_, k)| {
            matches!(
                k,
                GroupKind::SlidingWindow { window_tokens: 0 }
                    | GroupKind::ChunkedLocal { chunk_tokens: 0 }
            )
        }) {
            return Err(CoreError::InvalidArgument(format!(
                "KV cache group {g} ({k}): a window of 0 tokens"
            )));
        }
        let primary = kinds
            .iter()
            .position(|k| *k == GroupKind::Full)
            .unwrap_or(0);
        Ok(Self {
            kinds,
            primary,
            block_size,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The groups' kinds, in vLLM's order.
    pub fn kinds(&self) -> &[GroupKind] {
        &self.kinds
    }

    /// How many groups.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Never true ([`Self::new`] refuses no groups); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// The group whose keys are the blocks' sequence hashes, and whose blocks the tiers'
    /// events announce.
    pub fn primary(&self) -> usize {
        self.primary
    }

    /// True for one full-attention group (the plain path).
    pub fn is_single_full(&self) -> bool {
        self.kinds == [GroupKind::Full]
    }

    /// The key under which `group`'s copy of the block with sequence hash `hash` lives.
    pub fn key(&self, group: usize, hash: u64) -> u64 {
        if group == self.primary {
            return hash;
        }
        let kind = self.kinds[group];
        let window = match kind {
            GroupKind::SlidingWindow { window_tokens } => window_tokens as u64,
            GroupKind::ChunkedLocal { chunk_tokens } => chunk_tokens as u64,
            _ => 0,
        };
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&hash.to_le_bytes());
        bytes[8..16].copy_from_slice(&(group as u64).to_le_bytes());
        bytes[16..24].copy_from_slice(&window.to_le_bytes());
        bytes[24..].copy_from_slice(&kind_code(kind).to_le_bytes());
        xxh3_64_with_seed(&bytes, GROUP_KEY_SEED)
    }

    /// The blocks of `group` (indices into the request's blocks) that a hit ending at block
    /// `end` needs loaded, when vLLM holds the blocks before `start` on the GPU: empty when
    /// `end <= start`.
    pub fn needed(&self, group: usize, start: usize, end: usize) -> Range<usize> {
        if end <= start {
            return start..start;
        }
        match self.kinds[group] {
            GroupKind::Full => start..end,
            GroupKind::SlidingWindow { window_tokens } => {
                let blocks = (window_tokens - 1).div_ceil(self.block_size);
                end.saturating_sub(blocks).max(start)..end
            }
            GroupKind::ChunkedLocal { chunk_tokens } => {
                let chunk_start = end * self.block_size / chunk_tokens * chunk_tokens;
                (chunk_start / self.block_size).max(start)..end
            }
            GroupKind::MambaAlign => end - 1..end,
        }
    }

    /// The longest hit after `start`, up to `limit` blocks: the largest `n` in `start..=limit`
    /// such that every group holds every block [`Self::needed`] names for it, where
    /// `present(group, block)` says whether the tiers hold `group`'s copy of `block`. Returns
    /// `start` when there is none.
    pub fn longest_hit(
        &self,
        start: usize,
        limit: usize,
        mut present: impl FnMut(usize, usize) -> bool,
    ) -> usize {
        if limit <= start {
            return start;
        }
        // The full-attention groups bound the hit to their common prefix.
        let mut end = limit;
        for (g, _) in self.full_groups() {
            let run = (start..end).take_while(|&i| present(g, i)).count();
            end = start + run;
        }
        if end == start {
            return start;
        }
        // The other groups, by prefix sums of what they hold in start..end.
        let others: Vec<(usize, Vec<usize>)> = (0..self.kinds.len())
            .filter(|&g| self.kinds[g] != GroupKind::Full)
            .map(|g| {
                let mut sums = Vec::with_capacity(end - start + 1);
                sums.push(0);
                for i in start..end {
                    let last = *sums.last().expect("one at least");
                    sums.push(last + usize::from(present(g, i)));
                }
                (g, sums)
            })
            .collect();
        (start + 1..=end)
            .rev()
            .find(|&n| {
                others.iter().all(|(g, sums)| {
                    let r = self.needed(*g, start, n);
                    sums[r.end - start] - sums[r.start - start] == r.len()
                })
            })
            .unwrap_or(start)
    }

    fn full_groups(&self) -> impl Iterator<Item = (usize, GroupKind)> + '_ {
        self.kinds
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, k)| *k == GroupKind::Full)
    }
}

fn kind_code(kind: GroupKind) -> u64 {
    match kind {
        GroupKind::Full => 1,
        GroupKind::SlidingWindow { .. } => 2,
        GroupKind::MambaAlign => 3,
        GroupKind::ChunkedLocal { .. } => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn gpt_oss_like() -> Groups {
        // vLLM orders groups by first layer; gpt-oss starts with a sliding-window layer.
        Groups::new(
            vec![
                GroupKind::SlidingWindow { window_tokens: 128 },
                GroupKind::Full,
            ],
            16,
        )
        .unwrap()
    }

    #[test]
    fn the_primary_group_keys_blocks_by_their_hash_and_the_others_never_collide() {
        let g = gpt_oss_like();
        assert_eq!(g.primary(), 1);
        assert_eq!(g.key(1, 42), 42);
        assert_ne!(g.key(0, 42), 42);
        assert_ne!(g.key(0, 42), g.key(0, 43));
        // Another window (another model layout) keys the same block elsewhere.
        let other = Groups::new(
            vec![
                GroupKind::SlidingWindow { window_tokens: 64 },
                GroupKind::Full,
            ],
            16,
        )
        .unwrap();
        assert_ne!(other.key(0, 42), g.key(0, 42));
        assert_eq!(Groups::single(16).key(0, 7), 7);
    }

    #[test]
    fn a_sliding_window_group_needs_the_blocks_of_its_window_before_the_hit() {
        let g = gpt_oss_like();
        // cdiv(128 - 1, 16) = 8 blocks (vLLM's _contiguous_blocks_for_hit).
        assert_eq!(g.needed(0, 0, 20), 12..20);
        assert_eq!(g.needed(0, 15, 20), 15..20);
        assert_eq!(g.needed(1, 3, 20), 3..20);
        assert_eq!(g.needed(0, 5, 5), 5..5);
        let mamba = Groups::new(vec![GroupKind::MambaAlign, GroupKind::Full], 16).unwrap();
        assert_eq!(mamba.needed(0, 2, 9), 8..9);
        // Llama 4's chunks of 8192 tokens, blocks of 16: a hit at 8200 tokens needs only the
        // blocks from 8192 on; a hit at a chunk boundary needs none.
        let local = Groups::new(
            vec![
                GroupKind::ChunkedLocal { chunk_tokens: 8192 },
                GroupKind::Full,
            ],
            16,
        )
        .unwrap();
        assert_eq!(local.needed(0, 0, 513), 512..513);
        assert_eq!(local.needed(0, 0, 512), 512..512);
        assert_eq!(local.needed(0, 0, 100), 0..100);
    }

    #[test]
    fn a_hit_stops_where_a_window_has_a_hole() {
        let g = gpt_oss_like();
        // Full attention holds 0..30; the window group lost block 25.
        let hit = g.longest_hit(0, 30, |group, i| group == 1 || i != 25);
        // n = 30 needs 22..30 (has 25): no. The largest n whose window misses 25: n <= 25.
        assert_eq!(hit, 25);
        // The window group holds nothing: no hit at all.
        assert_eq!(g.longest_hit(0, 30, |group, _| group == 1), 0);
    }

    #[test]
    fn refuses_no_group_and_an_empty_window() {
        assert!(Groups::new(vec![], 16).is_err());
        let e = Groups::new(vec![GroupKind::SlidingWindow { window_tokens: 0 }], 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("group 0") && e.contains("sliding_window"), "{e}");
    }

    fn kind() -> impl Strategy<Value = GroupKind> {
        prop_oneof![
            Just(GroupKind::Full),
            (1usize..80).prop_map(|w| GroupKind::SlidingWindow { window_tokens: w }),
            (1usize..80).prop_map(|c| GroupKind::ChunkedLocal { chunk_tokens: c }),
            Just(GroupKind::MambaAlign),
        ]
    }

    proptest! {
        /// Against the rule written out: n is a hit when every group holds every block it
        /// needs; the answer is the largest such n.
        #[test]
        fn longest_hit_is_the_largest_n_every_group_accepts(
            kinds in proptest::collection::vec(kind(), 1..4),
            held in proptest::collection::vec(proptest::collection::vec(any::<bool>(), 24), 4),
            start in 0usize..8,
            limit in 0usize..24,
        ) {
            let g = Groups::new(kinds.clone(), 8).unwrap();
            let present = |group: usize, i: usize| held[group][i];
            let want = (start + 1..=limit)
                .rev()
                .find(|&n| (0..kinds.len()).all(|group| g.needed(group, start, n).all(|i| held[group][i])))
                .unwrap_or(start);
            prop_assert_eq!(g.longest_hit(start, limit, present), want.max(start));
        }
    }
}
