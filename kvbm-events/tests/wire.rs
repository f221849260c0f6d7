//! The wire codec against the engines' own bytes, and against malformed input.

use kvbm_events::{
    decode_batch, encode_batch, BlockRemoved, BlockStored, DecodeError, GroupKind, KvEvent,
    Location, SequenceHash, Tier, WireEvent,
};
use proptest::prelude::*;
use serde_json::Value;

const VECTORS: &str = include_str!("data/kv-events-wire.json");

fn cases() -> Vec<Value> {
    let doc: Value = serde_json::from_str(VECTORS).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

fn bytes_of(case: &Value) -> Vec<u8> {
    let hex = case["payload_hex"].as_str().unwrap();
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

/// A JSON integer (signed or unsigned) as a wire hash.
fn hash(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| v.as_i64().unwrap() as u64)
}

fn location(medium: Option<&str>, locality: Option<&str>, pool: Option<&str>) -> Location {
    let medium = medium.unwrap_or("GPU");
    let remote = locality == Some("REMOTE");
    match (
        Tier::from_medium_name(medium),
        pool.filter(|p| !p.is_empty()),
    ) {
        (_, Some(pool)) if remote => Location::Shared(pool.to_owned()),
        (Ok(tier), _) if !remote => Location::Local(tier),
        _ => Location::NotLocal(medium.to_owned()),
    }
}

/// What the decoder must produce for one JSON event: `None` for a skipped placeholder.
fn expected_event(e: &Value) -> Option<WireEvent> {
    if let Some(items) = e.as_array() {
        // Legacy positional arrays.
        return Some(match items[0].as_str().unwrap() {
            "BlockStored" => WireEvent::Stored {
                location: location(items[6].as_str(), None, None),
                block_hashes: items[1].as_array().unwrap().iter().map(hash).collect(),
                parent: (!items[2].is_null()).then(|| hash(&items[2])),
                token_ids: items[3]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect(),
                block_size: items[4].as_u64().unwrap() as u32,
                lora_name: None,
                cache_salt: None,
                // An adapter named only by its id cannot be hashed.
                unhashable_from: (!items[5].is_null()).then_some(0),
                group: None,
                group_kind: None,
                sliding_window: None,
            },
            "BlockRemoved" => WireEvent::Removed {
                location: location(items[2].as_str(), None, None),
                block_hashes: items[1].as_array().unwrap().iter().map(hash).collect(),
                group: None,
            },
            other => panic!("unexpected legacy type {other}"),
        });
    }
    let loc = location(
        e["medium"].as_str(),
        e["locality"].as_str(),
        e["ownership"].as_str(),
    );
    match e["type"].as_str().unwrap() {
        "BlockStored" => {
            let token_ids: Vec<u32> = e["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let block_size = e["block_size"].as_u64().unwrap() as u32;
            if token_ids.is_empty() && block_size == 0 {
                return None;
            }
            Some(WireEvent::Stored {
                location: loc,
                block_hashes: e["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(hash)
                    .collect(),
                parent: (!e["parent_block_hash"].is_null()).then(|| hash(&e["parent_block_hash"])),
                token_ids,
                block_size,
                lora_name: e["lora_name"].as_str().map(str::to_owned),
                cache_salt: None,
                unhashable_from: (e["lora_name"].is_null() && !e["lora_id"].is_null()).then_some(0),
                group: e["group_idx"].as_u64().map(|g| g as u32),
                group_kind: e["kv_cache_spec_kind"].as_str().map(GroupKind::from_name),
                sliding_window: e["kv_cache_spec_sliding_window"].as_u64().map(|w| w as u32),
            })
        }
        "BlockRemoved" => Some(WireEvent::Removed {
            location: loc,
            block_hashes: e["block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(hash)
                .collect(),
            group: e["group_idx"].as_u64().map(|g| g as u32),
        }),
        "AllBlocksCleared" => Some(WireEvent::Cleared),
        other => panic!("unexpected type {other}"),
    }
}

#[test]
fn every_vector_decodes_to_the_expected_events() {
    let cases = cases();
    assert!(cases.len() >= 8);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let decoded = &case["decoded"];
        let batch = decode_batch(&bytes_of(case)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(batch.ts, decoded[0].as_f64().unwrap(), "{name}: ts");
        assert_eq!(
            batch.dp_rank,
            decoded[2].as_u64().map(|r| r as u32),
            "{name}: rank"
        );
        let raw = decoded[1].as_array().unwrap();
        let expected: Vec<WireEvent> = raw.iter().filter_map(expected_event).collect();
        assert_eq!(batch.events, expected, "{name}: events");
        assert_eq!(
            batch.placeholders_skipped,
            raw.len() - expected.len(),
            "{name}: placeholders"
        );
        assert_eq!(batch.unknown_skipped, 0);
    }
}

#[test]
fn tiers_and_localities_are_read_as_the_medium_table_says() {
    let by_name = |n: &str| cases().into_iter().find(|c| c["name"] == n).unwrap();
    let sglang = decode_batch(&bytes_of(&by_name("sglang-hicache-tiers"))).unwrap();
    let tiers: Vec<Location> = sglang
        .events
        .iter()
        .map(|e| match e {
            WireEvent::Stored { location, .. } | WireEvent::Removed { location, .. } => {
                location.clone()
            }
            WireEvent::Cleared => unreachable!(),
        })
        .collect();
    assert_eq!(
        tiers,
        vec![
            Location::Local(Tier::Gpu),
            Location::Local(Tier::Host),
            Location::Local(Tier::Disk),
            Location::Local(Tier::Host)
        ]
    );
    // A signed SGLang hash is its two's complement.
    let WireEvent::Stored {
        block_hashes,
        parent,
        ..
    } = &sglang.events[1]
    else {
        panic!()
    };
    assert_eq!(
        (block_hashes[0], *parent),
        ((-9_000_000_000_000_000_000i64) as u64, Some(u64::MAX - 1))
    );
    let remote = decode_batch(&bytes_of(&by_name("vllm-remote-locality"))).unwrap();
    assert!(
        matches!(&remote.events[0], WireEvent::Stored { location: Location::NotLocal(m), .. } if m == "STORAGE")
    );
    assert_eq!(
        remote.events[0].to_local(),
        None,
        "remote pools never reach the local tiers"
    );
    let placeholder = decode_batch(&bytes_of(&by_name("vllm-offload-placeholder"))).unwrap();
    assert_eq!(
        (placeholder.events.len(), placeholder.placeholders_skipped),
        (0, 1)
    );
}

#[test]
fn the_encoder_writes_vllms_bytes() {
    let case = cases()
        .into_iter()
        .find(|c| c["name"] == "vllm-two-block-store-with-parent")
        .unwrap();
    let events = vec![KvEvent::BlockStored(BlockStored {
        tier: Tier::Gpu,
        block_hashes: vec![SequenceHash(81985529216486895), SequenceHash(u64::MAX)],
        parent_hash: Some(SequenceHash(16045690984503111693)),
        token_ids: (100..108).collect(),
        block_size: 4,
        lora_name: None,
    })];
    let mut out = Vec::new();
    encode_batch(1700000000.25, &events, Some(3), &mut out);
    assert_eq!(out, bytes_of(&case));
}

/// A shared pool's store and removal as vLLM 0.33's own encoder writes them: msgspec 0.19's
/// `msgpack.encode` of `KVEventBatch` with structs declared as vllm/distributed/kv_events.py
/// declares `BlockStored` and `BlockRemoved` (same fields, order, defaults, `omit_defaults`,
/// `tag=True`), `medium="STORAGE", locality="REMOTE", ownership="kvbm:00000000deadbeef"`.
const VLLM_SHARED_POOL_HEX: &str = "93cb41d954fc4010000092de000aa474797065ab426c6f636b53746f726564\
ac626c6f636b5f68617368657392cf0123456789abcdefcfffffffffffffffffb1706172656e745f626c6f636b5f6861\
7368cfdeadbeefcafef00da9746f6b656e5f696473986465666768696a6baa626c6f636b5f73697a6504a76c6f72615f\
6964c0a66d656469756da753544f52414745a96c6f72615f6e616d65c0a86c6f63616c697479a652454d4f5445a96f77\
6e657273686970b56b76626d3a3030303030303030646561646265656685a474797065ac426c6f636b52656d6f766564\
ac626c6f636b5f68617368657391cfffffffffffffffffa66d656469756da753544f52414745a86c6f63616c697479a6\
52454d4f5445a96f776e657273686970b56b76626d3a3030303030303030646561646265656603";

#[test]
fn a_shared_pools_events_are_written_as_vllm_writes_them_and_read_back_as_the_pool() {
    let pool = "kvbm:00000000deadbeef".to_string();
    let events = vec![
        KvEvent::SharedStored {
            pool: pool.clone(),
            stored: BlockStored {
                tier: Tier::Disk,
                block_hashes: vec![SequenceHash(81985529216486895), SequenceHash(u64::MAX)],
                parent_hash: Some(SequenceHash(16045690984503111693)),
                token_ids: (100..108).collect(),
                block_size: 4,
                lora_name: None,
            },
        },
        KvEvent::SharedRemoved {
            pool: pool.clone(),
            removed: BlockRemoved {
                tier: Tier::Disk,
                block_hashes: vec![SequenceHash(u64::MAX)],
            },
        },
    ];
    let mut out = Vec::new();
    encode_batch(1700000000.25, &events, Some(3), &mut out);
    let want: Vec<u8> = (0..VLLM_SHARED_POOL_HEX.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&VLLM_SHARED_POOL_HEX[i..i + 2], 16).unwrap())
        .collect();
    assert_eq!(out, want);
    let batch = decode_batch(&out).unwrap();
    assert!(matches!(
        &batch.events[0],
        WireEvent::Stored { location: Location::Shared(p), block_hashes, .. }
            if *p == pool && block_hashes.len() == 2
    ));
    assert!(matches!(
        &batch.events[1],
        WireEvent::Removed { location: Location::Shared(p), .. } if *p == pool
    ));
    // Never a local tier's event.
    assert!(batch.events.iter().all(|e| e.to_local().is_none()));
    // REMOTE without a pool name stays apart, as before.
    let remote = cases()
        .into_iter()
        .find(|c| c["name"] == "vllm-remote-locality")
        .unwrap();
    let batch = decode_batch(&bytes_of(&remote)).unwrap();
    assert!(matches!(
        &batch.events[0],
        WireEvent::Stored { location: Location::NotLocal(m), .. } if m == "STORAGE"
    ));
}

fn kv_event() -> impl Strategy<Value = KvEvent> {
    let tier = prop_oneof![Just(Tier::Gpu), Just(Tier::Host), Just(Tier::Disk)];
    prop_oneof![
        (
            tier.clone(),
            proptest::collection::vec(any::<u64>(), 0..5),
            proptest::option::of(any::<u64>()),
            1u32..64,
            proptest::option::of("[a-z-]{1,12}")
        )
            .prop_flat_map(|(tier, hashes, parent, block_size, lora)| {
                let n = hashes.len() * block_size as usize;
                proptest::collection::vec(any::<u32>(), n..=n).prop_map(move |token_ids| {
                    KvEvent::BlockStored(BlockStored {
                        tier,
                        block_hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(),
                        parent_hash: parent.map(SequenceHash),
                        token_ids,
                        block_size,
                        lora_name: lora.clone(),
                    })
                })
            }),
        (tier, proptest::collection::vec(any::<u64>(), 0..5)).prop_map(|(tier, hashes)| {
            KvEvent::BlockRemoved(BlockRemoved {
                tier,
                block_hashes: hashes.into_iter().map(SequenceHash).collect(),
            })
        }),
        Just(KvEvent::AllBlocksCleared),
    ]
}

proptest! {
    #[test]
    fn encoded_events_decode_back_identically(
        events in proptest::collection::vec(kv_event(), 0..6),
        ts in -1e12f64..1e12,
        rank in proptest::option::of(any::<u32>()),
    ) {
        let mut out = Vec::new();
        encode_batch(ts, &events, rank, &mut out);
        let batch = decode_batch(&out).unwrap();
        prop_assert_eq!(batch.ts, ts);
        prop_assert_eq!(batch.dp_rank, rank);
        // A store with no blocks is a placeholder only if it also has block size 0, which kvbm
        // never writes; everything comes back.
        let back: Vec<KvEvent> = batch.events.iter().map(|e| e.to_local().unwrap()).collect();
        prop_assert_eq!(back, events);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn damaged_vectors_never_panic(case in 0usize..8, at in any::<prop::sample::Index>(), flip in 1u8..=255) {
        let mut bytes = bytes_of(&cases()[case]);
        let i = at.index(bytes.len());
        bytes[i] ^= flip;
        let _ = decode_batch(&bytes);
        let _ = decode_batch(&bytes[..i]);
    }
}

#[test]
fn malformed_payloads_are_typed_errors() {
    let shape = |b: &[u8]| matches!(decode_batch(b), Err(DecodeError::Shape(_)));
    // Hand-made msgpack.
    assert!(matches!(decode_batch(&[]), Err(DecodeError::Msgpack(_))));
    assert!(decode_batch(&[0xc1]).is_err(), "a reserved marker");
    assert!(shape(&[0x01]), "not an array");
    assert!(shape(&[0x91, 0x01]), "one element");
    assert!(shape(&[0x93, 0xa1, b'x', 0x90, 0x00]), "a string timestamp");
    assert!(shape(&[0x93, 0x01, 0x01, 0x00]), "events not an array");
    assert!(
        shape(&[0x93, 0x01, 0x91, 0x05, 0x00]),
        "an event that is a number"
    );
    assert!(shape(&[0x93, 0x01, 0x90, 0xa1, b'x']), "a string rank");
    assert!(matches!(
        decode_batch(&[0x93, 0x01, 0x90, 0x00, 0x00]),
        Err(DecodeError::TrailingBytes(1))
    ));
    // An event with a bad field: BlockRemoved whose hashes are strings.
    let mut b = vec![0x93, 0x01, 0x91, 0x82];
    b.extend_from_slice(&[0xa4, b't', b'y', b'p', b'e', 0xac]);
    b.extend_from_slice(b"BlockRemoved");
    b.extend_from_slice(&[0xac]);
    b.extend_from_slice(b"block_hashes");
    b.extend_from_slice(&[0x91, 0xa1, b'x', 0x00]);
    assert!(shape(&b));
    // Nesting deeper than the limit.
    let mut deep = vec![0x93, 0x01];
    deep.extend(std::iter::repeat_n(0x91, 64));
    deep.push(0x00);
    assert!(decode_batch(&deep).is_err());
    // A length claiming 4 billion elements with no data is an error, not an allocation.
    assert!(decode_batch(&[0x93, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
    // An unknown event type is skipped and counted, not an error.
    let mut unknown = vec![0x93, 0x01, 0x91, 0x81, 0xa4, b't', b'y', b'p', b'e', 0xa5];
    unknown.extend_from_slice(b"Other");
    unknown.push(0x00);
    let batch = decode_batch(&unknown).unwrap();
    assert_eq!((batch.events.len(), batch.unknown_skipped), (0, 1));
}

/// One `[ts, [event], nil]` payload whose event is a map of `fields`.
fn one_event(fields: Vec<(&str, rmpv::Value)>) -> Vec<u8> {
    use rmpv::Value as V;
    let event = V::Map(fields.into_iter().map(|(k, v)| (V::from(k), v)).collect());
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &V::Array(vec![V::from(1.0), V::Array(vec![event]), V::Nil]),
    )
    .unwrap();
    out
}

fn removal_in_group(group: rmpv::Value) -> Vec<u8> {
    one_event(vec![
        ("type", "BlockRemoved".into()),
        ("block_hashes", rmpv::Value::Array(vec![7.into()])),
        ("medium", "GPU".into()),
        ("group_idx", group),
    ])
}

fn store_of_kind(kind: rmpv::Value, window: rmpv::Value) -> Vec<u8> {
    one_event(vec![
        ("type", "BlockStored".into()),
        ("block_hashes", rmpv::Value::Array(vec![7.into()])),
        ("parent_block_hash", rmpv::Value::Nil),
        (
            "token_ids",
            rmpv::Value::Array((0..4).map(rmpv::Value::from).collect()),
        ),
        ("block_size", 4.into()),
        ("lora_id", rmpv::Value::Nil),
        ("medium", "GPU".into()),
        ("lora_name", rmpv::Value::Nil),
        ("group_idx", 2.into()),
        ("kv_cache_spec_kind", kind),
        ("kv_cache_spec_sliding_window", window),
    ])
}

#[test]
fn vllm_033_group_fields_are_read_and_bad_ones_are_shape_errors() {
    use rmpv::Value as V;
    let group = |b: &[u8]| match &decode_batch(b).unwrap().events[0] {
        WireEvent::Stored {
            group,
            group_kind,
            sliding_window,
            ..
        } => (*group, *group_kind, *sliding_window),
        WireEvent::Removed { group, .. } => (*group, None, None),
        WireEvent::Cleared => unreachable!(),
    };
    assert_eq!(group(&removal_in_group(3.into())), (Some(3), None, None));
    assert_eq!(group(&removal_in_group(V::Nil)), (None, None, None));
    assert_eq!(
        group(&store_of_kind("sliding_window".into(), 128.into())),
        (Some(2), Some(GroupKind::SlidingWindow), Some(128))
    );
    assert_eq!(
        group(&store_of_kind("mamba".into(), V::Nil)),
        (Some(2), Some(GroupKind::Mamba), None)
    );
    // A kind vLLM may add later is a kind the router does not model, not an error.
    assert_eq!(
        group(&store_of_kind("sparse_attention".into(), V::Nil)),
        (Some(2), Some(GroupKind::Unknown), None)
    );
    let shape = |b: &[u8]| matches!(decode_batch(b), Err(DecodeError::Shape(_)));
    assert!(shape(&removal_in_group((-1).into())), "a negative group");
    assert!(shape(&removal_in_group("0".into())), "a string group");
    assert!(
        shape(&removal_in_group((1u64 << 40).into())),
        "a group past u32"
    );
    assert!(
        shape(&store_of_kind(5.into(), V::Nil)),
        "a kind that is a number"
    );
    assert!(
        shape(&store_of_kind("sliding_window".into(), "128".into())),
        "a window that is a string"
    );
    for kind in GroupKind::ALL {
        assert_eq!(GroupKind::from_name(kind.name()), kind);
    }
}
