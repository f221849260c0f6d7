//! Shared pools in the router: a worker's stores and removals with `locality` `REMOTE` and the
//! pool in `ownership` (kvbm's shared tier as vLLM 0.33 writes such a tier's events) are indexed
//! once per pool, and every worker that published into the pool is credited with the pool's
//! blocks beyond its own (`Overlap::shared`), at `--router-shared-cache-hit-weight`. A worker
//! clearing its own tiers keeps the pool; a pool no member reaches any more is dropped.
//! REMOTE without a pool name is still not indexed.

use kvbm_events::router::{
    ApplyStatus, Candidate, KvIndex, Overlap, RouterMode, SelectorConfig, WorkerLoad, POOLS_MAX,
    SHARED_WEIGHT_DEFAULT,
};
use kvbm_events::{BlockHasher, Location, Tier, WireEvent};

const BS: usize = 4;
const A: (u64, u32) = (1, 0);
const B: (u64, u32) = (2, 0);
const C: (u64, u32) = (3, 0);

/// Engine hashes unrelated to the router's (kvbm's own sequence hashes stand in for any).
fn engine_chain(tokens: &[u32]) -> Vec<u64> {
    let mut last = 0xabcdu64;
    tokens
        .chunks_exact(BS)
        .map(|b| {
            let mut bytes = last.to_le_bytes().to_vec();
            bytes.extend(b.iter().flat_map(|t| t.to_le_bytes()));
            last = xxhash_rust::xxh3::xxh3_64(&bytes);
            last
        })
        .collect()
}

fn ours(tokens: &[u32]) -> Vec<u64> {
    BlockHasher::new(BS, None, None)
        .sequence_hashes(None, tokens)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

fn stored(location: Location, tokens: &[u32], blocks: std::ops::Range<usize>) -> WireEvent {
    let chain = engine_chain(tokens);
    WireEvent::Stored {
        location,
        block_hashes: chain[blocks.clone()].to_vec(),
        parent: blocks.start.checked_sub(1).map(|p| chain[p]),
        token_ids: tokens[blocks.start * BS..blocks.end * BS].to_vec(),
        block_size: BS as u32,
        lora_name: None,
        cache_salt: None,
        unhashable_from: None,
        group: None,
        group_kind: None,
        sliding_window: None,
    }
}

fn removed(location: Location, tokens: &[u32], blocks: std::ops::Range<usize>) -> WireEvent {
    WireEvent::Removed {
        location,
        block_hashes: engine_chain(tokens)[blocks].to_vec(),
        group: None,
    }
}

fn pool(name: &str) -> Location {
    Location::Shared(name.into())
}

fn overlaps(index: &KvIndex, hashes: &[u64]) -> Vec<((u64, u32), Overlap)> {
    let mut out = index.find_matches(hashes);
    out.sort_by_key(|(k, _)| *k);
    out
}

fn o(gpu: usize, host: usize, disk: usize, shared: usize) -> Overlap {
    Overlap {
        gpu,
        host,
        disk,
        shared,
    }
}

#[test]
fn members_of_a_pool_are_credited_with_its_blocks_beyond_their_own() {
    let mut index = KvIndex::new(1 << 16, BS as u32);
    let tokens: Vec<u32> = (0..8 * BS as u32).collect();
    let hashes = ours(&tokens);
    // A holds 2 blocks on its GPU and wrote 6 to the pool; B wrote the last 2 of those again
    // (it is a member too); C has its own host blocks and never touched the pool.
    assert_eq!(
        index.apply(A, &stored(Location::Local(Tier::Gpu), &tokens, 0..2)),
        ApplyStatus::Ok
    );
    assert_eq!(
        index.apply(A, &stored(pool("p"), &tokens, 0..6)),
        ApplyStatus::Ok
    );
    assert_eq!(
        index.apply(B, &stored(pool("p"), &tokens, 4..6)),
        ApplyStatus::Ok
    );
    assert_eq!(
        index.apply(C, &stored(Location::Local(Tier::Host), &tokens, 0..3)),
        ApplyStatus::Ok
    );
    assert_eq!(
        overlaps(&index, &hashes),
        vec![(A, o(2, 0, 0, 4)), (B, o(0, 0, 0, 6)), (C, o(0, 3, 0, 0))]
    );
    // The pool is no worker of its own (nor is B, which holds nothing itself).
    assert_eq!(index.workers(), vec![A, C]);
    let pools = index.pools();
    assert_eq!(pools.len(), 1);
    assert_eq!(
        (pools[0].0.as_str(), pools[0].1, pools[0].2.clone()),
        ("p", 6, vec![A, B])
    );
    // A prefix the pool holds less of than a member's own gives that member nothing more.
    assert_eq!(
        index.apply(A, &stored(Location::Local(Tier::Disk), &tokens, 2..7)),
        ApplyStatus::Ok
    );
    assert_eq!(overlaps(&index, &hashes)[0], (A, o(2, 0, 5, 0)));
    // A clearing its own tiers (a restart) leaves the pool's blocks.
    assert_eq!(index.apply(A, &WireEvent::Cleared), ApplyStatus::Ok);
    assert_eq!(overlaps(&index, &hashes)[0], (A, o(0, 0, 0, 6)));
    // Blocks stored by two members leave the pool when both removed them.
    assert_eq!(
        index.apply(A, &removed(pool("p"), &tokens, 4..6)),
        ApplyStatus::Ok
    );
    assert_eq!(overlaps(&index, &hashes)[0], (A, o(0, 0, 0, 6)));
    assert_eq!(
        index.apply(B, &removed(pool("p"), &tokens, 4..6)),
        ApplyStatus::Ok
    );
    assert_eq!(overlaps(&index, &hashes)[0], (A, o(0, 0, 0, 4)));
    // A member that leaves is no longer credited; the last one takes the pool with it.
    index.remove_worker(A);
    index.forget_member(A);
    assert_eq!(
        overlaps(&index, &hashes),
        vec![(B, o(0, 0, 0, 4)), (C, o(0, 3, 0, 0))]
    );
    index.remove_worker(B);
    index.forget_member(B);
    assert_eq!(overlaps(&index, &hashes), vec![(C, o(0, 3, 0, 0))]);
    assert!(
        index.pools().is_empty(),
        "a pool no member reaches is dropped"
    );
}

#[test]
fn a_worker_said_to_reach_a_pool_is_credited_before_it_publishes_into_it() {
    let mut index = KvIndex::new(1 << 16, BS as u32);
    let tokens: Vec<u32> = (0..8 * BS as u32).collect();
    let hashes = ours(&tokens);
    assert_eq!(
        index.apply(A, &stored(pool("p"), &tokens, 0..5)),
        ApplyStatus::Ok
    );
    // C, new to the fleet, has written nothing anywhere: not credited until told.
    assert_eq!(overlaps(&index, &hashes), vec![(A, o(0, 0, 0, 5))]);
    assert_eq!(index.join_pool(C, "p"), Ok(()));
    assert_eq!(
        overlaps(&index, &hashes),
        vec![(A, o(0, 0, 0, 5)), (C, o(0, 0, 0, 5))]
    );
    // Joining again, or publishing afterwards, changes nothing; a pool not seen yet takes a
    // slot and is credited once blocks arrive.
    assert_eq!(index.join_pool(C, "p"), Ok(()));
    assert_eq!(index.join_pool(C, "q"), Ok(()));
    assert_eq!(index.pools().len(), 2);
    assert_eq!(
        index.apply(B, &stored(pool("q"), &tokens, 0..7)),
        ApplyStatus::Ok
    );
    assert_eq!(
        overlaps(&index, &hashes),
        vec![(A, o(0, 0, 0, 5)), (B, o(0, 0, 0, 7)), (C, o(0, 0, 0, 7))]
    );
    // No name, or a pool's own key, is refused.
    assert_eq!(index.join_pool(C, ""), Err(ApplyStatus::Malformed));
    assert_eq!(
        index.join_pool((9, u32::MAX), "p"),
        Err(ApplyStatus::Malformed)
    );
    // Leaving takes the membership with it.
    index.forget_member(C);
    assert_eq!(
        overlaps(&index, &hashes),
        vec![(A, o(0, 0, 0, 5)), (B, o(0, 0, 0, 7))]
    );
}

#[test]
fn pools_are_kept_apart_and_remote_stores_without_a_pool_are_not_indexed() {
    let mut index = KvIndex::new(1 << 16, BS as u32);
    let tokens: Vec<u32> = (100..100 + 4 * BS as u32).collect();
    let hashes = ours(&tokens);
    assert_eq!(
        index.apply(A, &stored(pool("p"), &tokens, 0..4)),
        ApplyStatus::Ok
    );
    assert_eq!(
        index.apply(B, &stored(pool("q"), &tokens, 0..2)),
        ApplyStatus::Ok
    );
    assert_eq!(
        overlaps(&index, &hashes),
        vec![(A, o(0, 0, 0, 4)), (B, o(0, 0, 0, 2))]
    );
    assert_eq!(
        index.apply(
            C,
            &stored(Location::NotLocal("STORAGE".into()), &tokens, 0..4)
        ),
        ApplyStatus::NotLocal
    );
    assert_eq!(overlaps(&index, &hashes).len(), 2);
    // At most POOLS_MAX pools; past them a pool's events are refused, counted apart.
    for i in 2..POOLS_MAX {
        let status = index.apply(C, &stored(pool(&format!("pool-{i}")), &tokens, 0..1));
        assert_eq!(status, ApplyStatus::Ok);
    }
    assert_eq!(
        index.apply(C, &stored(pool("one-too-many"), &tokens, 0..1)),
        ApplyStatus::PoolsFull
    );
    assert_eq!(ApplyStatus::PoolsFull.label(), "pools_full");
    // A pool whose members all left frees its slot for another.
    index.forget_member(B);
    assert_eq!(
        index.apply(C, &stored(pool("one-too-many"), &tokens, 0..1)),
        ApplyStatus::Ok
    );
    assert_eq!(
        overlaps(&index, &hashes),
        vec![(A, o(0, 0, 0, 4)), (C, o(0, 0, 0, 1))]
    );
}

#[test]
fn a_shared_block_is_credited_at_its_weight_below_a_disk_hit() {
    let kv = SelectorConfig::for_mode(RouterMode::Kv);
    assert_eq!(kv.shared_weight, SHARED_WEIGHT_DEFAULT);
    assert!(kv.shared_weight < kv.disk_weight);
    assert_eq!(
        SelectorConfig::for_mode(RouterMode::KvGpu).shared_weight,
        0.0
    );
    let candidate = |overlap| Candidate {
        worker: A,
        overlap,
        load: WorkerLoad::default(),
        excess_work: 0.0,
    };
    let (none, shared, disk) = (o(0, 0, 0, 0), o(0, 0, 0, 10), o(0, 0, 10, 0));
    let cost = |ov| kv.cost(&candidate(ov), 16 * BS, BS);
    assert!(cost(shared) < cost(none), "a shared hit is worth something");
    assert!(cost(disk) < cost(shared), "less than a disk hit");
    assert_eq!(kv.credit(shared), 10.0 * SHARED_WEIGHT_DEFAULT);
}

#[test]
fn blocks_a_member_stores_on_its_gpu_from_its_pool_are_loads_not_work() {
    // A and B publish into pool p; C reaches no pool. Blocks 0..4 are in the pool. A storing
    // 0..6 on its GPU loaded 4 of them (computed 2); C storing the same computed all 6, the pool
    // being out of its reach; a worker the index does not know holds nothing.
    let mut index = KvIndex::new(1 << 16, BS as u32);
    let tokens: Vec<u32> = (0..6 * BS as u32).collect();
    let hashes = ours(&tokens);
    assert_eq!(
        index.apply(B, &stored(pool("p"), &tokens, 0..4)),
        ApplyStatus::Ok
    );
    assert_eq!(
        index.apply(A, &stored(pool("p"), &tokens, 3..4)),
        ApplyStatus::Ok
    );
    for w in [A, C] {
        assert_eq!(
            index.apply(w, &stored(Location::Local(Tier::Gpu), &tokens, 0..6)),
            ApplyStatus::Ok
        );
    }
    assert_eq!(index.held_below_gpu(A, &hashes), 4);
    assert_eq!(index.held_below_gpu(C, &hashes), 0);
    assert_eq!(index.held_below_gpu((9, 0), &hashes), 0);
    // C's own host copies count for C alone.
    assert_eq!(
        index.apply(C, &stored(Location::Local(Tier::Host), &tokens, 0..6)),
        ApplyStatus::Ok
    );
    assert_eq!(index.held_below_gpu(C, &hashes[5..]), 1);
    assert_eq!(index.held_below_gpu(A, &hashes[5..]), 0);
}
