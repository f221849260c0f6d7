//! The index on hybrid workers' events (vLLM 0.33's KV cache groups): only full-attention-like
//! groups make claims; sliding-window and Mamba groups cut a match where vLLM's coordinator would
//! cut the hit (`HybridKVCacheCoordinator.find_longest_cache_hit`,
//! vllm/v1/core/kv_cache_coordinator.py). Streams of vLLM's own manager are replayed in
//! kvbm-router/tests/hybrid_groups.rs; these are the rules one by one.

use kvbm_events::router::{ApplyStatus, KvIndex, Overlap, WorkerKey};
use kvbm_events::{BlockHasher, GroupKind, Location, Tier, WireEvent};

const BS: u32 = 4;
const W: WorkerKey = (1, 0);

fn tokens(blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * BS).map(|t| 1000 + t).collect()
}

/// The engine's hash of block `i` (any function: the router never computes it).
fn engine(i: usize) -> u64 {
    0xe000 + i as u64
}

fn ours(blocks: usize) -> Vec<u64> {
    BlockHasher::new(BS as usize, None, None)
        .sequence_hashes(None, &tokens(blocks))
        .into_iter()
        .map(|h| h.0)
        .collect()
}

/// vLLM's store of blocks `from..to` by group `g` of `kind`, naming only the blocks in `kept`
/// (`BlockPool.cache_full_blocks` leaves skipped blocks out of `block_hashes`, not of
/// `token_ids`).
fn store(
    g: u32,
    kind: GroupKind,
    window: Option<u32>,
    from: usize,
    to: usize,
    kept: &[usize],
) -> WireEvent {
    store_in(Tier::Gpu, g, kind, window, from, to, kept)
}

fn store_in(
    tier: Tier,
    g: u32,
    kind: GroupKind,
    window: Option<u32>,
    from: usize,
    to: usize,
    kept: &[usize],
) -> WireEvent {
    let all = tokens(to);
    WireEvent::Stored {
        location: Location::Local(tier),
        block_hashes: kept.iter().map(|&i| engine(i)).collect(),
        parent: from.checked_sub(1).map(engine),
        token_ids: all[from * BS as usize..].to_vec(),
        block_size: BS,
        lora_name: None,
        cache_salt: None,
        unhashable_from: None,
        group: Some(g),
        group_kind: Some(kind),
        sliding_window: window,
    }
}

fn removed(g: u32, blocks: &[usize]) -> WireEvent {
    WireEvent::Removed {
        location: Location::Local(Tier::Gpu),
        block_hashes: blocks.iter().map(|&i| engine(i)).collect(),
        group: Some(g),
    }
}

fn gpu(index: &KvIndex, blocks: usize) -> usize {
    index
        .find_matches(&ours(blocks))
        .into_iter()
        .find(|(k, _)| *k == W)
        .map_or(0, |(_, o)| o.gpu)
}

fn apply(index: &mut KvIndex, event: &WireEvent) {
    assert_eq!(index.apply(W, event), ApplyStatus::Ok, "{event:?}");
}

const SWA: GroupKind = GroupKind::SlidingWindow;
const FULL: GroupKind = GroupKind::FullAttention;

#[test]
fn a_sliding_window_group_never_adds_or_removes_a_full_attention_claim() {
    // gpt-oss order: group 0 sliding window (9 tokens: 2 blocks of 4 before a hit), group 1 full.
    let mut index = KvIndex::new(1 << 20, BS);
    let all: Vec<usize> = (0..8).collect();
    apply(&mut index, &store(0, SWA, Some(9), 0, 8, &all));
    apply(&mut index, &store(1, FULL, None, 0, 8, &all));
    assert_eq!(gpu(&index, 8), 8);
    assert_eq!(index.blocks_in(W, Tier::Gpu), 8, "claims: the full group's");
    // The window group drops blocks 0..5: a hit at 8 still has 6 and 7.
    apply(&mut index, &removed(0, &[0, 1, 2, 3, 4, 5]));
    assert_eq!(index.blocks_in(W, Tier::Gpu), 8);
    assert_eq!(gpu(&index, 8), 8);
    // A shorter prompt ends where the window group holds nothing: vLLM hits nothing.
    assert_eq!(gpu(&index, 5), 0);
    // The full group drops the tail: its removal takes the claims though the window holds 6, 7.
    apply(&mut index, &removed(1, &[6, 7]));
    assert_eq!(index.blocks_in(W, Tier::Gpu), 6);
    assert_eq!(gpu(&index, 8), 0, "window blocks before 6 are gone");
    assert_eq!(index.group_blocks(W), 2);
    assert_eq!(index.group_kind(W, &removed(0, &[6])), Some(SWA));
    assert_eq!(index.group_kind(W, &removed(1, &[6])), Some(FULL));
    assert_eq!(
        index.group_kind(W, &removed(5, &[6])),
        Some(GroupKind::Unknown)
    );
}

#[test]
fn a_sparse_store_is_placed_by_the_full_groups_store_that_follows() {
    let mut index = KvIndex::new(1 << 20, BS);
    // vLLM's order within a step: the window group first, naming only blocks 2 and 3 of 0..4.
    apply(&mut index, &store(0, SWA, Some(9), 0, 4, &[2, 3]));
    assert_eq!(gpu(&index, 4), 0, "no claim yet");
    apply(&mut index, &store(1, FULL, None, 0, 4, &[0, 1, 2, 3]));
    assert_eq!(gpu(&index, 4), 4);
    assert_eq!(
        gpu(&index, 3),
        0,
        "the window group holds block 2 but not 1"
    );
    // Later sparse stores name blocks the map knows at once.
    apply(&mut index, &store(1, FULL, None, 4, 6, &[4, 5]));
    assert_eq!(gpu(&index, 6), 4);
    apply(&mut index, &store(0, SWA, Some(9), 4, 6, &[5]));
    assert_eq!(gpu(&index, 6), 4, "block 4 is missing from the window");
    apply(&mut index, &store(0, SWA, Some(9), 4, 6, &[4]));
    assert_eq!(gpu(&index, 6), 6);
    // A removal of a store still pending is taken back.
    apply(&mut index, &store(0, SWA, Some(9), 6, 7, &[6]));
    apply(&mut index, &removed(0, &[6]));
    assert_eq!(index.group_blocks(W), 4);
    // A clear forgets groups.
    apply(&mut index, &WireEvent::Cleared);
    assert_eq!(index.group_blocks(W), 0);
    assert_eq!(
        index.group_kind(W, &removed(0, &[6])),
        Some(GroupKind::Unknown)
    );
}

#[test]
fn a_mamba_hit_needs_the_state_at_its_end() {
    let mut index = KvIndex::new(1 << 20, BS);
    let all: Vec<usize> = (0..6).collect();
    apply(&mut index, &store(0, GroupKind::Mamba, None, 0, 6, &[2]));
    apply(&mut index, &store(1, FULL, None, 0, 6, &all));
    assert_eq!(gpu(&index, 6), 3, "the state after block 2");
    assert_eq!(gpu(&index, 2), 0);
    apply(&mut index, &store(0, GroupKind::Mamba, None, 0, 6, &[5]));
    assert_eq!(gpu(&index, 6), 6);
    apply(&mut index, &removed(1, &[4, 5]));
    assert_eq!(
        gpu(&index, 6),
        3,
        "the full group ends at 4; the state at 3 is there"
    );
}

#[test]
fn a_worker_without_full_attention_matches_as_far_as_its_groups_accept() {
    // An all-sliding-window model, its stores naming every block (dense).
    let mut index = KvIndex::new(1 << 20, BS);
    let all: Vec<usize> = (0..6).collect();
    apply(&mut index, &store(0, SWA, Some(9), 0, 6, &all));
    assert_eq!(index.blocks_in(W, Tier::Gpu), 0, "no claims");
    assert_eq!(gpu(&index, 6), 6);
    apply(&mut index, &removed(0, &[0, 1, 2]));
    assert_eq!(gpu(&index, 6), 6, "blocks 4 and 5 before the hit are there");
    assert_eq!(gpu(&index, 4), 0);
    assert!(index.find_matches(&ours(3)).is_empty());
}

#[test]
fn groups_off_the_gpu_and_unmodelled_kinds_are_not_indexed() {
    let mut index = KvIndex::new(1 << 20, BS);
    let all: Vec<usize> = (0..4).collect();
    apply(&mut index, &store(1, FULL, None, 0, 4, &all));
    apply(&mut index, &store(0, SWA, Some(9), 0, 4, &all));
    // A window group's blocks in host memory: counted by the caller, not indexed.
    apply(
        &mut index,
        &store_in(Tier::Host, 0, SWA, Some(9), 0, 4, &all),
    );
    assert_eq!(index.blocks_in(W, Tier::Host), 0);
    // Chunked local attention (no chunk size on the wire) does not cut.
    apply(
        &mut index,
        &store(2, GroupKind::ChunkedLocalAttention, None, 0, 4, &[3]),
    );
    assert_eq!(gpu(&index, 4), 4);
    // kvbm's own host events carry no group: claims of their tier.
    let mut host = store_in(Tier::Host, 0, FULL, None, 0, 4, &all);
    if let WireEvent::Stored {
        group, group_kind, ..
    } = &mut host
    {
        *group = None;
        *group_kind = None;
    }
    apply(&mut index, &host);
    assert_eq!(index.blocks_in(W, Tier::Host), 4);
    // A cut GPU prefix loses its host continuation.
    apply(&mut index, &removed(0, &[2, 3]));
    let o = index
        .find_matches(&ours(4))
        .into_iter()
        .find(|(k, _)| *k == W)
        .map(|(_, o)| o);
    assert_eq!(
        o,
        Some(Overlap {
            gpu: 2,
            host: 0,
            disk: 0,
            shared: 0
        })
    );
}

#[test]
fn a_window_groups_removal_of_a_block_it_never_held_leaves_the_full_groups_name() {
    let mut index = KvIndex::new(1 << 20, BS);
    let all: Vec<usize> = (0..4).collect();
    apply(&mut index, &store(0, SWA, Some(9), 0, 4, &[3]));
    apply(&mut index, &store(1, FULL, None, 0, 4, &all));
    assert_eq!(index.engine_hashes(W), 4);
    assert_eq!(
        index.apply(W, &removed(0, &[2])),
        ApplyStatus::BlockNotFound
    );
    assert_eq!(index.blocks_in(W, Tier::Gpu), 4);
    // The full group's removal still finds its blocks by their engine hashes.
    apply(&mut index, &removed(1, &[2, 3]));
    assert_eq!(index.blocks_in(W, Tier::Gpu), 2);
    apply(&mut index, &removed(0, &[3]));
    assert_eq!(index.engine_hashes(W), 2);
}
