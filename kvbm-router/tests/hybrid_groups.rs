//! The router's index on event streams of vLLM 0.33's own hybrid KV cache manager, against what
//! vLLM's own cache hits.
//!
//! `tests/data/hybrid/<shape>.json` is written by `tests/data/hybrid/generate.py`: vLLM's planner
//! (`get_kv_cache_config_from_groups`) on real spec objects, vLLM's `KVCacheManager` with caching
//! and events on, its batches encoded as `ZmqEventPublisher` sends them, and at checkpoints what
//! `KVCacheManager.get_computed_blocks` (through `HybridKVCacheCoordinator.find_longest_cache_hit`)
//! hits for a set of probe prompts. Three shapes: gpt-oss (sliding window 128 / full attention
//! alternating), Gemma 3 (five sliding-window groups to one full), Qwen3-Next (Mamba groups in
//! `align` mode next to full attention).

use kvbm_events::router::{KvIndex, WorkerKey, BLOCKS_PER_WORKER_MAX_DEFAULT};
use kvbm_events::{decode_batch, BlockHasher, GroupKind, WireBatch, WireEvent};
use serde_json::Value;

const WORKER: WorkerKey = (7, 0);

struct Stream {
    block_size: u32,
    /// The probe prompts' tokens.
    probes: Vec<Vec<u32>>,
    groups: Vec<(String, Option<u64>)>,
    batches: Vec<WireBatch>,
    checkpoints: Vec<Value>,
}

fn load(shape: &str) -> Stream {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hybrid")
        .join(format!("{shape}.json"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let batches = doc["batches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|hex| {
            let hex = hex.as_str().unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            decode_batch(&bytes).unwrap()
        })
        .collect();
    Stream {
        block_size: doc["block_size"].as_u64().unwrap() as u32,
        probes: doc["probes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                p.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect(),
        groups: doc["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                (
                    g["kind"].as_str().unwrap().to_owned(),
                    g["sliding_window"].as_u64(),
                )
            })
            .collect(),
        batches,
        checkpoints: doc["checkpoints"].as_array().unwrap().clone(),
    }
}

/// The stream as a router without groups read it: every event a claim.
fn without_groups(event: &WireEvent) -> WireEvent {
    let mut event = event.clone();
    match &mut event {
        WireEvent::Stored {
            group,
            group_kind,
            sliding_window,
            ..
        } => {
            *group = None;
            *group_kind = None;
            *sliding_window = None;
        }
        WireEvent::Removed { group, .. } => *group = None,
        WireEvent::Cleared => {}
    }
    event
}

/// Per checkpoint and probe: (vLLM's hit, the index's GPU match) in tokens.
fn replay(stream: &Stream, grouped: bool) -> Vec<(usize, usize)> {
    let mut index = KvIndex::new(BLOCKS_PER_WORKER_MAX_DEFAULT, stream.block_size);
    let hasher = BlockHasher::new(stream.block_size as usize, None, None);
    let mut applied = 0;
    let mut out = Vec::new();
    for checkpoint in &stream.checkpoints {
        let upto = checkpoint["batches"].as_u64().unwrap() as usize;
        for batch in &stream.batches[applied..upto] {
            for event in &batch.events {
                let event = if grouped {
                    event.clone()
                } else {
                    without_groups(event)
                };
                let status = index.apply(WORKER, &event);
                if grouped {
                    assert_eq!(status.label(), "ok", "{event:?}");
                }
            }
        }
        applied = upto;
        let hits = checkpoint["vllm_hit_tokens"].as_array().unwrap();
        for (tokens, hit) in stream.probes.iter().zip(hits) {
            let hashes: Vec<u64> = hasher
                .sequence_hashes(None, tokens)
                .into_iter()
                .map(|h| h.0)
                .collect();
            let matched = index
                .find_matches(&hashes)
                .into_iter()
                .find(|(k, _)| *k == WORKER)
                .map_or(0, |(_, o)| o.gpu);
            let vllm = hit.as_u64().unwrap() as usize;
            out.push((vllm, matched * stream.block_size as usize));
        }
    }
    out
}

fn check(shape: &str, kinds: &[&str]) {
    let stream = load(shape);
    let got: Vec<&str> = stream.groups.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(got, kinds, "{shape}: vLLM's groups");
    // Every kind vLLM sent decodes to a known kind, and the stores say it.
    let mut seen = std::collections::BTreeSet::new();
    for batch in &stream.batches {
        for event in &batch.events {
            if let WireEvent::Stored {
                group: Some(g),
                group_kind: Some(kind),
                sliding_window,
                ..
            } = event
            {
                let (name, window) = &stream.groups[*g as usize];
                assert_eq!(kind.name(), name);
                assert_ne!(*kind, GroupKind::Unknown);
                assert_eq!(sliding_window.map(u64::from), *window);
                seen.insert(*g);
            }
        }
    }
    assert_eq!(seen.len(), kinds.len(), "{shape}: every group stored");
    let results = replay(&stream, true);
    assert!(
        results.iter().any(|&(v, _)| v > 0),
        "{shape}: vLLM hits something"
    );
    for (i, (vllm, router)) in results.iter().enumerate() {
        assert_eq!(router, vllm, "{shape}: probe {i}: router vs vLLM's hit");
    }
}

#[test]
fn gpt_oss_matches_are_vllms_hits() {
    check("gpt-oss", &["sliding_window", "full_attention"]);
}

#[test]
fn gemma3_matches_are_vllms_hits() {
    check(
        "gemma3",
        &[
            "sliding_window",
            "sliding_window",
            "sliding_window",
            "sliding_window",
            "sliding_window",
            "full_attention",
        ],
    );
}

#[test]
fn qwen3_next_matches_are_vllms_hits() {
    check("qwen3-next", &["mamba", "mamba", "mamba", "full_attention"]);
}

#[test]
fn without_groups_the_streams_route_prefixes_vllm_does_not_hit() {
    // What the router did before it read groups: the streams tell it apart.
    for shape in ["gpt-oss", "qwen3-next"] {
        let results = replay(&load(shape), false);
        let wrong = results.iter().filter(|(v, r)| v != r).count();
        assert!(wrong > 0, "{shape}: every probe agreed without groups");
    }
}

#[test]
fn a_replica_restored_from_a_dump_mid_stream_answers_as_vllm_hits() {
    // A sibling's dump taken halfway (both forms), restored, then the rest of the stream: the
    // groups, their blocks and the stores still pending travel with the worker.
    for shape in ["gpt-oss", "gemma3", "qwen3-next"] {
        let stream = load(shape);
        let half = stream.checkpoints.len() / 2;
        let split = stream.checkpoints[half]["batches"].as_u64().unwrap() as usize;
        let mut first = KvIndex::new(BLOCKS_PER_WORKER_MAX_DEFAULT, stream.block_size);
        for batch in &stream.batches[..split] {
            for event in &batch.events {
                first.apply(WORKER, event);
            }
        }
        let snapshot = first.snapshot(&[]);
        assert!(!snapshot[0].groups.is_empty() && !snapshot[0].group_holdings.is_empty());
        let dump = kvbm_router::dump::Dump {
            block_size: stream.block_size as usize,
            workers: vec![(
                kvbm_router::dump::DumpWorker {
                    worker_id: WORKER.0,
                    dp_rank: WORKER.1,
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    replay_endpoint: None,
                    last_seq: Some(split as u64 - 1),
                    http_url: None,
                },
                snapshot[0].clone(),
            )],
        };
        let mut ndjson = Vec::new();
        kvbm_router::dump::write(&dump, &mut ndjson).unwrap();
        let mut msgpack = Vec::new();
        kvbm_router::dump::write_msgpack(&dump, &mut msgpack).unwrap();
        let bs = stream.block_size as usize;
        let read = [
            kvbm_router::dump::read(&ndjson[..], bs, 1 << 20).unwrap(),
            kvbm_router::dump::read_msgpack(&msgpack[..], bs, 1 << 20).unwrap(),
        ];
        for back in read {
            let mut index = KvIndex::new(BLOCKS_PER_WORKER_MAX_DEFAULT, stream.block_size);
            assert_eq!(index.restore(&back.workers[0].1).label(), "ok");
            for batch in &stream.batches[split..] {
                for event in &batch.events {
                    assert_eq!(index.apply(WORKER, event).label(), "ok", "{shape}");
                }
            }
            let hasher = BlockHasher::new(bs, None, None);
            let last = stream.checkpoints.last().unwrap();
            let hits = last["vllm_hit_tokens"].as_array().unwrap();
            for (tokens, hit) in stream.probes.iter().zip(hits) {
                let hashes: Vec<u64> = hasher
                    .sequence_hashes(None, tokens)
                    .into_iter()
                    .map(|h| h.0)
                    .collect();
                let gpu = index
                    .find_matches(&hashes)
                    .into_iter()
                    .find(|(k, _)| *k == WORKER)
                    .map_or(0, |(_, o)| o.gpu);
                assert_eq!((gpu * bs) as u64, hit.as_u64().unwrap(), "{shape}");
            }
        }
    }
}
