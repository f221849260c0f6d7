//! Pages smaller than the router's blocks, regrouped: SGLang's default page size is 1, and its
//! radix cache publishes one `BlockStored` per page, chained by `parent_block_hash`, and one
//! `BlockRemoved` per page when a leaf node is evicted (python/sglang/srt/mem_cache/radix_cache.py,
//! `RadixCache._record_store_event`, `_record_remove_event`). Such a stream used to be refused as
//! `block_size_mismatch`; it now claims the router's blocks its pages complete.

use kvbm_events::router::{ApplyStatus, KvIndex, WorkerKey};
use kvbm_events::{decode_batch, BlockHasher, WireEvent};
use rmpv::Value as V;

const BLOCK: u32 = 16;
const W: WorkerKey = (3, 0);

/// SGLang's hash of a page, chained over the prefix (any function: the router never computes
/// it), as the signed int64 SGLang sends (`hash_str_to_int64`).
fn page_hash(parent: Option<i64>, tokens: &[u32]) -> i64 {
    let mut x = parent.unwrap_or(0x5151) as u64;
    for &t in tokens {
        x = (x ^ u64::from(t))
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
    }
    x as i64
}

/// A radix-tree node's events as SGLang encodes them: `[ts, [events], nil]`, one event a page.
/// `prefix` is the node's path from the root, `node` its own tokens.
fn node_payload(prefix: &[u32], node: &[u32], page: usize, removal: bool) -> Vec<u8> {
    let mut parent = None;
    for p in prefix.chunks(page) {
        parent = Some(page_hash(parent, p));
    }
    let mut events = Vec::new();
    for p in node.chunks(page) {
        let h = page_hash(parent, p);
        let event = if removal {
            vec![
                ("type", V::from("BlockRemoved")),
                ("block_hashes", V::Array(vec![h.into()])),
                ("medium", "GPU".into()),
            ]
        } else {
            vec![
                ("type", V::from("BlockStored")),
                ("block_hashes", V::Array(vec![h.into()])),
                ("parent_block_hash", parent.map_or(V::Nil, V::from)),
                ("token_ids", V::Array(p.iter().map(|&t| t.into()).collect())),
                ("block_size", (p.len() as u64).into()),
                ("lora_id", V::Nil),
                ("medium", "GPU".into()),
            ]
        };
        events.push(V::Map(
            event.into_iter().map(|(k, v)| (V::from(k), v)).collect(),
        ));
        parent = Some(h);
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &V::Array(vec![1.0.into(), V::Array(events), V::Nil]),
    )
    .unwrap();
    out
}

fn apply(index: &mut KvIndex, payload: &[u8]) -> Vec<ApplyStatus> {
    decode_batch(payload)
        .unwrap()
        .events
        .iter()
        .map(|e| index.apply(W, e))
        .collect()
}

fn gpu(index: &KvIndex, tokens: &[u32]) -> usize {
    let hashes: Vec<u64> = BlockHasher::new(BLOCK as usize, None, None)
        .sequence_hashes(None, tokens)
        .into_iter()
        .map(|h| h.0)
        .collect();
    index
        .find_matches(&hashes)
        .into_iter()
        .find(|(k, _)| *k == W)
        .map_or(0, |(_, o)| o.gpu)
}

#[test]
fn a_page_size_1_stream_is_routed_in_the_routers_blocks() {
    let a: Vec<u32> = (500..540).collect(); // 40 tokens: 2 blocks and 8 more
    let mut b = a[..20].to_vec();
    b.extend(900..925); // 45 tokens, diverging from a at token 20
    let mut index = KvIndex::new(1 << 20, BLOCK);
    // Request a: one node of 40 pages.
    let statuses = apply(&mut index, &node_payload(&[], &a, 1, false));
    assert_eq!(statuses.len(), 40);
    assert!(
        statuses.iter().all(|s| *s == ApplyStatus::Ok),
        "{statuses:?}"
    );
    assert_eq!(gpu(&index, &a), 2);
    // Request b: the tree splits a at 20 (no events) and adds b's 25 tokens under it.
    apply(&mut index, &node_payload(&b[..20], &b[20..], 1, false));
    assert_eq!(
        gpu(&index, &b),
        2,
        "block 1 of b: 4 tokens of a's node, 12 of b's"
    );
    assert_eq!(gpu(&index, &a), 2);
    assert_eq!(index.blocks_in(W, kvbm_events::Tier::Gpu), 3);
    // Eviction of b's leaf: its pages go; b's second block with them, a's stay.
    let statuses = apply(&mut index, &node_payload(&b[..20], &b[20..], 1, true));
    assert!(
        statuses.iter().all(|s| *s == ApplyStatus::Ok),
        "{statuses:?}"
    );
    assert_eq!(gpu(&index, &b), 1);
    assert_eq!(gpu(&index, &a), 2);
    // Then a's leaf after the split point: a's second block goes, the first stays.
    apply(&mut index, &node_payload(&a[..20], &a[20..], 1, true));
    assert_eq!(gpu(&index, &a), 1);
    assert_eq!(index.pages(W), 20);
    // The root node: nothing left.
    apply(&mut index, &node_payload(&[], &a[..20], 1, true));
    assert_eq!(gpu(&index, &a), 0);
    assert_eq!(
        (index.pages(W), index.blocks_in(W, kvbm_events::Tier::Gpu)),
        (0, 0)
    );
}

#[test]
fn pages_that_divide_the_block_are_regrouped_and_others_refused() {
    let a: Vec<u32> = (7..7 + 64).collect();
    let mut index = KvIndex::new(1 << 20, BLOCK);
    let statuses = apply(&mut index, &node_payload(&[], &a, 4, false));
    assert!(statuses.iter().all(|s| *s == ApplyStatus::Ok));
    assert_eq!(gpu(&index, &a), 4);
    let statuses = apply(&mut index, &node_payload(&[], &a[..60], 3, false));
    assert!(statuses
        .iter()
        .all(|s| *s == ApplyStatus::BlockSizeMismatch));
    // A page whose parent the router never saw is refused, not guessed.
    let statuses = apply(&mut index, &node_payload(&[1, 2], &[3, 4], 1, false));
    assert_eq!(statuses[0], ApplyStatus::ParentUnknown);
    // The same engine hash naming other tokens is a conflict.
    let one = decode_batch(&node_payload(&[], &a[..1], 1, false))
        .unwrap()
        .events
        .remove(0);
    let mut other = one.clone();
    if let WireEvent::Stored { token_ids, .. } = &mut other {
        token_ids[0] += 1;
    }
    assert_eq!(index.apply(W, &one), ApplyStatus::Ok);
    assert_eq!(index.apply(W, &other), ApplyStatus::HashConflict);
}

#[test]
fn pages_travel_with_a_snapshot() {
    let a: Vec<u32> = (500..540).collect();
    let mut b = a[..20].to_vec();
    b.extend(900..925);
    let mut first = KvIndex::new(1 << 20, BLOCK);
    apply(&mut first, &node_payload(&[], &a, 1, false));
    let snapshot = first.snapshot(&[]);
    assert_eq!(snapshot[0].pages.len(), 40);
    let mut index = KvIndex::new(1 << 20, BLOCK);
    assert_eq!(index.restore(&snapshot[0]), ApplyStatus::Ok);
    assert_eq!(gpu(&index, &a), 2);
    // The stream goes on from the restored pages: b's pages chain onto a's.
    apply(&mut index, &node_payload(&b[..20], &b[20..], 1, false));
    assert_eq!(gpu(&index, &b), 2);
    apply(&mut index, &node_payload(&a[..20], &a[20..], 1, true));
    assert_eq!(gpu(&index, &a), 1);
}
