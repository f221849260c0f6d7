//! The router's translation of engine hashes: events as vLLM and SGLang put them on the wire
//! (their own hashes, chained by parent, reused across tiers; map and legacy array forms;
//! unsigned, signed and bytes hashes; LoRA names and cache salts in `extra_keys`), decoded and
//! applied, must give the same answers as an index fed the router's own hashes directly.
//!
//! The engine hashes here come from a function unrelated to the router's (as vLLM's SHA-256
//! prefix-cache hashes are): the router must never rely on them being anything but names.

use std::collections::HashMap;

use kvbm_events::router::{ApplyStatus, KvIndex, Overlap};
use kvbm_events::{decode_batch, BlockHasher, SequenceHash, Tier};
use proptest::prelude::*;
use rmpv::Value;

const BS: usize = 4;
const W: (u64, u32) = (7, 0);

/// An engine's own hash of a block: a function of its parent's engine hash, tokens and salt that
/// has nothing to do with the router's (stands in for vLLM's SHA-256 of the same inputs).
fn engine_hash(parent: Option<u64>, tokens: &[u32], salt: &str) -> u64 {
    let mut bytes = parent.unwrap_or(0xfeed).to_be_bytes().to_vec();
    bytes.extend(tokens.iter().flat_map(|t| t.to_be_bytes()));
    bytes.extend(salt.as_bytes());
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 0x5eed_5eed)
}

/// Engine hashes of every block of a prompt.
fn engine_chain(tokens: &[u32], salt: &str) -> Vec<u64> {
    let mut last = None;
    tokens
        .chunks_exact(BS)
        .map(|b| {
            let h = engine_hash(last, b, salt);
            last = Some(h);
            h
        })
        .collect()
}

/// The router's own hashes of a prompt.
fn ours(tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
    BlockHasher::new(BS, lora, salt)
        .sequence_hashes(None, tokens)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

fn s(x: &str) -> Value {
    Value::from(x)
}

/// How hashes are written on the wire.
#[derive(Debug, Clone, Copy)]
enum HashForm {
    /// uint64 (vLLM's default).
    Unsigned,
    /// int64 (SGLang).
    Signed,
    /// 32 bytes whose last 8 are the hash, big-endian (vLLM with int hashes off).
    Bytes,
}

fn hash_value(h: u64, form: HashForm) -> Value {
    match form {
        HashForm::Unsigned => Value::from(h),
        HashForm::Signed => Value::from(h as i64),
        HashForm::Bytes => {
            let mut b = vec![0xAB; 24];
            b.extend(h.to_be_bytes());
            Value::Binary(b)
        }
    }
}

/// A `BlockStored` map as vLLM 0.33 writes it (`extra_keys`: one entry per block).
#[allow(clippy::too_many_arguments)]
fn stored_map(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    medium: &str,
    lora: Option<&str>,
    extra_keys: Option<Vec<Value>>,
    form: HashForm,
) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array(hashes.iter().map(|&h| hash_value(h, form)).collect()),
        ),
        (
            s("parent_block_hash"),
            parent.map_or(Value::Nil, |p| hash_value(p, form)),
        ),
        (
            s("token_ids"),
            Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        ),
        (s("block_size"), Value::from(BS as u32)),
        (s("lora_id"), lora.map_or(Value::Nil, |_| Value::from(1))),
        (s("medium"), s(medium)),
        (s("lora_name"), lora.map_or(Value::Nil, s)),
        (s("extra_keys"), extra_keys.map_or(Value::Nil, Value::Array)),
    ])
}

fn removed_map(hashes: &[u64], medium: &str, form: HashForm) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (
            s("block_hashes"),
            Value::Array(hashes.iter().map(|&h| hash_value(h, form)).collect()),
        ),
        (s("medium"), s(medium)),
    ])
}

/// Encodes events as one payload and applies what decodes; the statuses.
fn apply(index: &mut KvIndex, events: Vec<Value>) -> Vec<ApplyStatus> {
    let payload = Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::from(0)]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &payload).unwrap();
    let batch = decode_batch(&bytes).unwrap();
    batch.events.iter().map(|e| index.apply(W, e)).collect()
}

fn overlap(index: &KvIndex, hashes: &[u64]) -> Overlap {
    index
        .find_matches(hashes)
        .into_iter()
        .find(|(k, _)| *k == W)
        .map_or(Overlap::default(), |(_, o)| o)
}

fn index() -> KvIndex {
    KvIndex::new(1 << 20, BS as u32)
}

#[test]
fn engine_hashes_in_every_form_resolve_to_the_routers_identity() {
    let tokens: Vec<u32> = (100..100 + 6 * BS as u32).collect();
    let e = engine_chain(&tokens, "");
    let mine = ours(&tokens, None, None);
    for form in [HashForm::Unsigned, HashForm::Signed, HashForm::Bytes] {
        let mut ix = index();
        // A run stored in two events (the second names its parent by engine hash).
        let st = apply(
            &mut ix,
            vec![
                stored_map(&e[..2], None, &tokens[..2 * BS], "GPU", None, None, form),
                stored_map(
                    &e[2..],
                    Some(e[1]),
                    &tokens[2 * BS..],
                    "GPU",
                    None,
                    None,
                    form,
                ),
            ],
        );
        assert_eq!(st, vec![ApplyStatus::Ok; 2], "{form:?}");
        assert_eq!(overlap(&ix, &mine).gpu, 6, "{form:?}");
        assert_eq!(ix.engine_hashes(W), 6);
        // The engine's hashes are not keys of the index.
        assert_eq!(overlap(&ix, &e), Overlap::default());
        // Removal by engine hash.
        let st = apply(&mut ix, vec![removed_map(&e[3..], "GPU", form)]);
        assert_eq!(st, vec![ApplyStatus::Ok]);
        assert_eq!(overlap(&ix, &mine).gpu, 3);
        assert_eq!(ix.engine_hashes(W), 3);
    }
}

#[test]
fn the_legacy_array_form_translates_too() {
    let tokens: Vec<u32> = (0..3 * BS as u32).collect();
    let e = engine_chain(&tokens, "");
    let event = Value::Array(vec![
        s("BlockStored"),
        Value::Array(e.iter().map(|&h| Value::from(h)).collect()),
        Value::Nil,
        Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        Value::from(BS as u32),
        Value::Nil,
        s("GPU"),
    ]);
    let mut ix = index();
    assert_eq!(apply(&mut ix, vec![event]), vec![ApplyStatus::Ok]);
    assert_eq!(overlap(&ix, &ours(&tokens, None, None)).gpu, 3);
}

#[test]
fn a_gpu_eviction_leaves_the_host_copy_routable() {
    // vLLM's CPU offloading publishes the host copies with the GPU blocks' hashes (medium CPU),
    // then evicts the GPU blocks: the prefix must stay routable through the host tier.
    let tokens: Vec<u32> = (0..8 * BS as u32).collect();
    let e = engine_chain(&tokens, "");
    let mine = ours(&tokens, None, None);
    let f = HashForm::Unsigned;
    let mut ix = index();
    apply(
        &mut ix,
        vec![
            stored_map(&e, None, &tokens, "GPU", None, None, f),
            stored_map(&e[..6], None, &tokens[..6 * BS], "CPU", None, None, f),
        ],
    );
    assert_eq!(
        overlap(&ix, &mine),
        Overlap {
            gpu: 8,
            host: 0,
            disk: 0,
            shared: 0
        }
    );
    // The GPU evicts its last 5 blocks (tail first, as vLLM frees), then all of them.
    let tail: Vec<u64> = e[3..].iter().rev().copied().collect();
    assert_eq!(
        apply(&mut ix, vec![removed_map(&tail, "GPU", f)]),
        vec![ApplyStatus::Ok]
    );
    assert_eq!(
        overlap(&ix, &mine),
        Overlap {
            gpu: 3,
            host: 3,
            disk: 0,
            shared: 0
        }
    );
    assert_eq!(
        apply(&mut ix, vec![removed_map(&e[..3], "GPU", f)]),
        vec![ApplyStatus::Ok]
    );
    assert_eq!(
        overlap(&ix, &mine),
        Overlap {
            gpu: 0,
            host: 6,
            disk: 0,
            shared: 0
        }
    );
    // The host copies keep their engine names: a host eviction resolves them.
    assert_eq!(ix.engine_hashes(W), 6);
    assert_eq!(
        apply(&mut ix, vec![removed_map(&e[..6], "CPU", f)]),
        vec![ApplyStatus::Ok]
    );
    assert_eq!(overlap(&ix, &mine), Overlap::default());
    assert_eq!(ix.engine_hashes(W), 0);
}

#[test]
fn lora_names_and_cache_salts_give_their_own_hash_spaces() {
    let tokens: Vec<u32> = (500..500 + 4 * BS as u32).collect();
    let f = HashForm::Unsigned;
    let mut ix = index();
    // A LoRA request: vLLM's extra keys carry the adapter's name on every block.
    let e_lora = engine_chain(&tokens, "lora");
    let keys = (0..4)
        .map(|_| Value::Array(vec![s("sql-adapter")]))
        .collect();
    assert_eq!(
        apply(
            &mut ix,
            vec![stored_map(
                &e_lora,
                None,
                &tokens,
                "GPU",
                Some("sql-adapter"),
                Some(keys),
                f
            )]
        ),
        vec![ApplyStatus::Ok]
    );
    assert_eq!(
        overlap(&ix, &ours(&tokens, Some("sql-adapter"), None)).gpu,
        4
    );
    assert_eq!(overlap(&ix, &ours(&tokens, None, None)).gpu, 0);

    // A salted prompt: the salt is on its first block only; a later event continuing it (by
    // parent) inherits it.
    let e_salt = engine_chain(&tokens, "tenant-a");
    let first_keys = vec![Value::Array(vec![s("tenant-a")]), Value::Nil];
    let st = apply(
        &mut ix,
        vec![
            stored_map(
                &e_salt[..2],
                None,
                &tokens[..2 * BS],
                "GPU",
                None,
                Some(first_keys),
                f,
            ),
            stored_map(
                &e_salt[2..],
                Some(e_salt[1]),
                &tokens[2 * BS..],
                "GPU",
                None,
                None,
                f,
            ),
        ],
    );
    assert_eq!(st, vec![ApplyStatus::Ok; 2]);
    assert_eq!(overlap(&ix, &ours(&tokens, None, Some("tenant-a"))).gpu, 4);
    assert_eq!(overlap(&ix, &ours(&tokens, None, Some("tenant-b"))).gpu, 0);
    assert_eq!(overlap(&ix, &ours(&tokens, None, None)).gpu, 0);
}

#[test]
fn what_cannot_be_resolved_is_refused_and_counted_never_guessed() {
    let tokens: Vec<u32> = (0..4 * BS as u32).collect();
    let e = engine_chain(&tokens, "");
    let mine = ours(&tokens, None, None);
    let f = HashForm::Unsigned;
    let mut ix = index();
    // A parent never stored.
    assert_eq!(
        apply(
            &mut ix,
            vec![stored_map(
                &e[2..],
                Some(e[1]),
                &tokens[2 * BS..],
                "GPU",
                None,
                None,
                f
            )]
        ),
        vec![ApplyStatus::ParentUnknown]
    );
    assert_eq!(ix.engine_hashes(W), 0);
    // Another block size than the router's.
    let mut other = stored_map(&e[..2], None, &tokens[..2 * BS], "GPU", None, None, f);
    if let Value::Map(entries) = &mut other {
        for (k, v) in entries.iter_mut() {
            if k.as_str() == Some("block_size") {
                *v = Value::from(2 * BS as u32);
            }
        }
    }
    let mut ix2 = index();
    assert_eq!(
        apply(&mut ix2, vec![other]),
        vec![ApplyStatus::BlockSizeMismatch]
    );
    // Tokens that are not the blocks.
    assert_eq!(
        apply(
            &mut ix2,
            vec![stored_map(
                &e[..2],
                None,
                &tokens[..BS],
                "GPU",
                None,
                None,
                f
            )]
        ),
        vec![ApplyStatus::Malformed]
    );
    // A multimodal block (an [identifier, offset] key) and everything after it.
    let keys = vec![
        Value::Nil,
        Value::Array(vec![Value::Array(vec![s("img-1"), Value::from(0)])]),
        Value::Nil,
        Value::Nil,
    ];
    assert_eq!(
        apply(
            &mut ix2,
            vec![stored_map(&e, None, &tokens, "GPU", None, Some(keys), f)]
        ),
        vec![ApplyStatus::Unhashable]
    );
    assert_eq!(
        overlap(&ix2, &mine).gpu,
        1,
        "the block before it is applied"
    );
    // A removal of hashes never stored.
    assert_eq!(
        apply(&mut ix2, vec![removed_map(&[1, 2, 3], "GPU", f)]),
        vec![ApplyStatus::BlockNotFound]
    );
    // One engine hash for two different blocks.
    let mut ix3 = index();
    let other_tokens: Vec<u32> = (900..900 + BS as u32).collect();
    apply(
        &mut ix3,
        vec![stored_map(
            &e[..1],
            None,
            &tokens[..BS],
            "GPU",
            None,
            None,
            f,
        )],
    );
    assert_eq!(
        apply(
            &mut ix3,
            vec![stored_map(
                &e[..1],
                None,
                &other_tokens,
                "GPU",
                None,
                None,
                f
            )]
        ),
        vec![ApplyStatus::HashConflict]
    );
    assert_eq!(overlap(&ix3, &ours(&other_tokens, None, None)).gpu, 0);
    for (status, label) in [
        (ApplyStatus::ParentUnknown, "parent_unknown"),
        (ApplyStatus::BlockSizeMismatch, "block_size_mismatch"),
        (ApplyStatus::Malformed, "malformed"),
        (ApplyStatus::Unhashable, "unhashable"),
        (ApplyStatus::HashConflict, "hash_conflict"),
    ] {
        assert_eq!(status.label(), label);
    }
}

#[test]
fn a_clear_or_a_dropped_worker_forgets_its_engine_hashes() {
    let tokens: Vec<u32> = (0..4 * BS as u32).collect();
    let e = engine_chain(&tokens, "");
    let f = HashForm::Unsigned;
    let mut ix = index();
    apply(
        &mut ix,
        vec![stored_map(
            &e[..2],
            None,
            &tokens[..2 * BS],
            "GPU",
            None,
            None,
            f,
        )],
    );
    let clear = Value::Map(vec![(s("type"), s("AllBlocksCleared"))]);
    apply(&mut ix, vec![clear]);
    assert_eq!(ix.engine_hashes(W), 0);
    assert_eq!(
        apply(
            &mut ix,
            vec![stored_map(
                &e[2..],
                Some(e[1]),
                &tokens[2 * BS..],
                "GPU",
                None,
                None,
                f
            )]
        ),
        vec![ApplyStatus::ParentUnknown],
        "the parent went with the clear"
    );
    apply(
        &mut ix,
        vec![stored_map(
            &e[..2],
            None,
            &tokens[..2 * BS],
            "GPU",
            None,
            None,
            f,
        )],
    );
    ix.remove_worker(W);
    assert_eq!(ix.engine_hashes(W), 0);
}

/// One step of an engine's life in the model test.
#[derive(Debug, Clone)]
enum Op {
    /// Store blocks `from..to` of prompt `p` in tier `t` (with their parent).
    Store {
        p: usize,
        from: usize,
        to: usize,
        t: Tier,
    },
    /// Remove blocks `from..to` of prompt `p` from tier `t`.
    Remove {
        p: usize,
        from: usize,
        to: usize,
        t: Tier,
    },
    /// Clear everything.
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let tier = prop_oneof![Just(Tier::Gpu), Just(Tier::Host), Just(Tier::Disk)];
    prop_oneof![
        4 => (0..3usize, 0..6usize, 1..7usize, tier.clone()).prop_map(|(p, a, b, t)| Op::Store { p, from: a.min(b - 1), to: b, t }),
        3 => (0..3usize, 0..6usize, 1..7usize, tier).prop_map(|(p, a, b, t)| Op::Remove { p, from: a.min(b - 1), to: b, t }),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Whatever an engine does, the translated index answers as an index fed the router's own
    /// hashes for the same (accepted) events.
    #[test]
    fn translation_answers_as_the_index_fed_our_hashes(ops in proptest::collection::vec(op(), 1..40), form in 0..3u8) {
        let form = [HashForm::Unsigned, HashForm::Signed, HashForm::Bytes][form as usize];
        // Three prompts sharing their first two blocks.
        let prompts: Vec<Vec<u32>> = (0..3u32)
            .map(|p| (0..6 * BS as u32).map(|i| if i < 2 * BS as u32 { i } else { 1000 * (p + 1) + i }).collect())
            .collect();
        let engine: Vec<Vec<u64>> = prompts.iter().map(|t| engine_chain(t, "")).collect();
        let mine: Vec<Vec<u64>> = prompts.iter().map(|t| ours(t, None, None)).collect();
        let mut translated = index();
        let mut direct = index();
        // Halfway, a sibling router restores a snapshot of `translated`; from then on it takes
        // the same events and must answer the same.
        let half = ops.len() / 2;
        let mut restored: Option<KvIndex> = None;
        // The engine's own view: stores per (engine hash, tier) not removed yet, so that a
        // removal is only sent for what is held and a store only with a parent it holds.
        let mut held: HashMap<(u64, Tier), u32> = HashMap::new();
        let mut names: HashMap<u64, u32> = HashMap::new();
        for (i, op) in ops.into_iter().enumerate() {
            if i == half {
                let mut sibling = index();
                for snap in translated.snapshot(&[]) {
                    prop_assert_eq!(sibling.restore(&snap), ApplyStatus::Ok);
                }
                restored = Some(sibling);
            }
            let mut both = |events: Vec<Value>, tr: &mut KvIndex| {
                let st = apply(tr, events.clone());
                if let Some(r) = restored.as_mut() {
                    assert_eq!(apply(r, events), st, "the restored index answers alike");
                }
                st
            };
            match op {
                Op::Store { p, from, to, t } => {
                    let parent = from.checked_sub(1).map(|i| engine[p][i]);
                    if parent.is_some_and(|ph| !names.contains_key(&ph)) {
                        // An engine only chains onto what it holds.
                        continue;
                    }
                    let medium = t.medium_name();
                    let st = both(vec![stored_map(&engine[p][from..to], parent, &prompts[p][from * BS..to * BS], medium, None, None, form)], &mut translated);
                    prop_assert_eq!(st, vec![ApplyStatus::Ok]);
                    direct.store(W, t, &mine[p][from..to]);
                    for &h in &engine[p][from..to] {
                        *held.entry((h, t)).or_default() += 1;
                        *names.entry(h).or_default() += 1;
                    }
                }
                Op::Remove { p, from, to, t } => {
                    let hs: Vec<u64> = engine[p][from..to].iter().copied().filter(|h| held.get(&(*h, t)).is_some_and(|&c| c > 0)).collect();
                    let idx: Vec<usize> = (from..to).filter(|&i| hs.contains(&engine[p][i])).collect();
                    if hs.is_empty() { continue; }
                    let st = both(vec![removed_map(&hs, t.medium_name(), form)], &mut translated);
                    prop_assert_eq!(st, vec![ApplyStatus::Ok]);
                    let ours_removed: Vec<u64> = idx.iter().map(|&i| mine[p][i]).collect();
                    direct.remove(W, t, &ours_removed);
                    for h in hs {
                        *held.get_mut(&(h, t)).unwrap() -= 1;
                        let n = names.get_mut(&h).unwrap();
                        *n -= 1;
                        if *n == 0 { names.remove(&h); }
                    }
                }
                Op::Clear => {
                    both(vec![Value::Map(vec![(s("type"), s("AllBlocksCleared"))])], &mut translated);
                    direct.remove_worker(W);
                    held.clear();
                    names.clear();
                }
            }
            prop_assert_eq!(translated.engine_hashes(W), names.len());
            for q in mine.iter().chain([&mine[0][..3].to_vec()]) {
                prop_assert_eq!(overlap(&translated, q), overlap(&direct, q));
                if let Some(r) = &restored {
                    prop_assert_eq!(overlap(r, q), overlap(&direct, q));
                }
            }
            for t in Tier::ALL {
                prop_assert_eq!(translated.blocks_in(W, t), direct.blocks_in(W, t));
                if let Some(r) = &restored {
                    prop_assert_eq!(r.blocks_in(W, t), direct.blocks_in(W, t));
                    prop_assert_eq!(r.engine_hashes(W), names.len());
                }
            }
        }
    }
}

#[test]
fn kvbm_events_carrying_our_hashes_translate_to_themselves() {
    // kvbm's publisher already uses the router's hashes: the same path maps each to itself.
    let tokens: Vec<u32> = (0..3 * BS as u32).collect();
    let mine = ours(&tokens, None, None);
    let mut ix = index();
    let st = apply(
        &mut ix,
        vec![stored_map(
            &mine,
            None,
            &tokens,
            "CPU_PINNED",
            None,
            None,
            HashForm::Unsigned,
        )],
    );
    assert_eq!(st, vec![ApplyStatus::Ok]);
    assert_eq!(overlap(&ix, &mine).host, 3);
    let _ = SequenceHash(0);
}
