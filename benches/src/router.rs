//! `kvbm-bench router`: the router index on the generated workload of issue 4
//! ([`crate::router_workload`]), applied three ways: fed the router's own hashes, as decoded
//! events with the engine's hashes (translated from the tokens), and from the msgpack bytes. With
//! `--offload` every tier is indexed; "pairs" counts (worker, block, tier) holdings. One thread.
//! Memory is the heap counted by the binary's allocator plus the index's own mappings, for the
//! translated path (it includes the engine-hash maps).

use std::time::Instant;

use anyhow::bail;
use clap::Args;
use kvbm_events::router::KvIndex;
use kvbm_events::{
    decode_batch, encode_batch, BlockHasher, BlockRemoved, BlockStored, KvEvent, SequenceHash,
    Tier, WireEvent,
};

use crate::router_workload::{
    generate, EventKind, Workload, BLOCK_SIZE, SEQUENCES_PER_WORKER, SEQUENCE_BLOCKS,
};
use crate::stats::{median, percentile};

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// Worker counts to run, comma-separated.
    #[arg(long, default_value = "16,64,256", value_delimiter = ',')]
    workers: Vec<usize>,
    /// Blocks per store event (0: one store per sequence, holding what the worker lacks).
    #[arg(long, default_value_t = 0)]
    store_blocks: usize,
    /// Evicted GPU blocks move down: each is stored in host memory, and every other one on disk
    /// too (events in all three tiers, as a kvbm worker publishes them).
    #[arg(long)]
    offload: bool,
    /// Give the index the workload's block count as a capacity hint (no growth while applying).
    #[arg(long)]
    presize: bool,
    /// Queries timed per worker count.
    #[arg(long, default_value_t = 2000)]
    queries: usize,
    /// Times the apply phase is repeated (fresh index each time); the median is reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Paths to run, comma-separated (raw, translated, wire); the others show as 0.
    #[arg(long, default_value = "raw,translated,wire", value_delimiter = ',', value_parser = parse_path)]
    paths: Vec<Path>,
    /// End with one JSON line per worker count.
    #[arg(long)]
    json: bool,
}

/// Heap bytes in use, from the binary's counting allocator.
fn heap() -> usize {
    crate::ALLOCATED.load(std::sync::atomic::Ordering::Relaxed)
}

/// How the events reach the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// Fed the router's own hashes (`KvIndex::store`/`remove`).
    Raw,
    /// Decoded events with the engine's hashes, translated (`KvIndex::apply`).
    Translated,
    /// Wire bytes: decoded, then translated and applied.
    Wire,
}

fn parse_path(s: &str) -> Result<Path, String> {
    match s {
        "raw" => Ok(Path::Raw),
        "translated" => Ok(Path::Translated),
        "wire" => Ok(Path::Wire),
        other => Err(format!("unknown path {other:?} (raw, translated, wire)")),
    }
}

/// Each event with the worker that published it.
type ByWorker<T> = Vec<((u64, u32), T)>;

/// The events as decoded `WireEvent`s and as one msgpack payload each.
fn wire_events(w: &Workload) -> (ByWorker<WireEvent>, ByWorker<Vec<u8>>) {
    let mut decoded = Vec::with_capacity(w.events.len());
    let mut payloads = Vec::with_capacity(w.events.len());
    for e in &w.events {
        let key = (e.worker, 0u32);
        let event = match &e.kind {
            EventKind::Store {
                tier,
                parent,
                blocks,
            } => KvEvent::BlockStored(BlockStored {
                tier: *tier,
                block_hashes: blocks.iter().map(|b| SequenceHash(b.engine)).collect(),
                parent_hash: parent.map(SequenceHash),
                token_ids: blocks.iter().flat_map(|b| b.tokens).collect(),
                block_size: BLOCK_SIZE as u32,
                lora_name: None,
            }),
            EventKind::Remove { tier, blocks } => KvEvent::BlockRemoved(BlockRemoved {
                tier: *tier,
                block_hashes: blocks.iter().map(|b| SequenceHash(b.engine)).collect(),
            }),
        };
        let mut bytes = Vec::new();
        encode_batch(0.0, std::slice::from_ref(&event), Some(0), &mut bytes);
        let batch = decode_batch(&bytes).expect("our own encoding decodes");
        decoded.extend(batch.events.into_iter().map(|ev| (key, ev)));
        payloads.push((key, bytes));
    }
    (decoded, payloads)
}

pub fn run(args: RouterArgs) -> anyhow::Result<bool> {
    if args.queries == 0 || args.rounds == 0 || args.workers.is_empty() {
        bail!("--queries, --rounds and --workers must not be zero or empty");
    }
    println!(
        "kvbm router index: {} sequences of {} blocks of {} tokens per worker, stores of {}{}; one thread",
        SEQUENCES_PER_WORKER,
        SEQUENCE_BLOCKS,
        BLOCK_SIZE,
        if args.store_blocks == 0 {
            "missing blocks per sequence".to_owned()
        } else {
            format!("{} blocks", args.store_blocks)
        },
        if args.offload {
            ", evicted blocks offloaded to host and disk first"
        } else {
            ""
        }
    );
    println!(
        "events/s (M): raw = fed the router's hashes; translated = engine hashes, decoded events; \
         wire = engine hashes from msgpack bytes (decode included)"
    );
    println!(
        "{:>8} {:>9} {:>11} {:>9} {:>12} {:>10} {:>10} {:>10} {:>12}",
        "workers",
        "raw",
        "translated",
        "wire",
        "pairs",
        "p50 us",
        "p99 us",
        "hash us",
        "bytes/pair"
    );
    for &workers in &args.workers {
        let workload = generate(workers, args.store_blocks, args.offload, args.queries, 42);
        let (decoded, payloads) = wire_events(&workload);
        let block_events = workload.block_events;

        // Apply the whole stream `--rounds` times into a fresh index, per path; median rates.
        let mut rates: Vec<(Path, Vec<f64>)> = Vec::new();
        let mut index = KvIndex::default();
        let mut heap_delta = 0;
        for &path in &args.paths {
            let mut path_rates = Vec::with_capacity(args.rounds);
            for _ in 0..args.rounds {
                drop(std::mem::take(&mut index));
                let heap_before = heap();
                if args.presize {
                    let stored = workload.block_events;
                    index = KvIndex::default().with_capacity(stored);
                }
                let start = Instant::now();
                match path {
                    Path::Raw => {
                        let mut hashes = Vec::new();
                        for e in &workload.events {
                            let key = (e.worker, 0u32);
                            match &e.kind {
                                EventKind::Store { tier, blocks, .. } => {
                                    hashes.clear();
                                    hashes.extend(blocks.iter().map(|b| b.ours));
                                    index.store(key, *tier, &hashes);
                                }
                                EventKind::Remove { tier, blocks } => {
                                    hashes.clear();
                                    hashes.extend(blocks.iter().map(|b| b.ours));
                                    index.remove(key, *tier, &hashes);
                                }
                            }
                        }
                    }
                    Path::Translated => {
                        for (key, event) in &decoded {
                            index.apply(*key, event);
                        }
                    }
                    Path::Wire => {
                        for (key, bytes) in &payloads {
                            let batch = decode_batch(bytes).expect("decodes");
                            for event in &batch.events {
                                index.apply(*key, event);
                            }
                        }
                    }
                }
                path_rates.push(block_events as f64 / start.elapsed().as_secs_f64());
                if path == Path::Translated {
                    heap_delta = heap().saturating_sub(heap_before) + index.mapped_bytes();
                }
            }
            rates.push((path, path_rates));
        }
        let pairs: usize = (0..workers)
            .flat_map(|w| Tier::ALL.map(|t| index.blocks_in((w as u64, 0), t)))
            .sum();
        let bytes_per_pair = heap_delta as f64 / pairs.max(1) as f64;

        // Queries: hashing the request's tokens, then matching.
        let mut latencies_us = Vec::with_capacity(workload.queries.len());
        let mut hash_us = Vec::with_capacity(workload.queries.len());
        let mut matched = 0usize;
        let hasher = BlockHasher::new(BLOCK_SIZE, None, None);
        for q in &workload.queries {
            let tokens: Vec<u32> = q.iter().flat_map(|b| b.tokens).collect();
            let t = Instant::now();
            let hashes: Vec<u64> = hasher
                .sequence_hashes(None, &tokens)
                .into_iter()
                .map(|h| h.0)
                .collect();
            hash_us.push(t.elapsed().as_secs_f64() * 1e6);
            debug_assert!(hashes.iter().zip(q).all(|(h, b)| *h == b.ours));
            let t = Instant::now();
            let result = index.find_matches(&hashes);
            latencies_us.push(t.elapsed().as_secs_f64() * 1e6);
            matched += result.len();
        }
        std::hint::black_box(matched);
        let rate = |p: Path| {
            rates
                .iter()
                .find(|(q, _)| *q == p)
                .map_or(0.0, |(_, r)| median(r))
        };
        let (p50, p99) = (median(&latencies_us), percentile(&latencies_us, 0.99));
        println!(
            "{:>8} {:>9.2} {:>11.2} {:>9.2} {:>12} {:>10.2} {:>10.2} {:>10.2} {:>12.1}",
            workers,
            rate(Path::Raw) / 1e6,
            rate(Path::Translated) / 1e6,
            rate(Path::Wire) / 1e6,
            pairs,
            p50,
            p99,
            median(&hash_us),
            bytes_per_pair
        );
        if args.json {
            let rounds = |p: Path| {
                rates
                    .iter()
                    .find(|(q, _)| *q == p)
                    .map(|(_, r)| r.clone())
                    .unwrap_or_default()
            };
            println!(
                "{}",
                serde_json::json!({
                    "workers": workers,
                    "store_blocks": args.store_blocks,
                    "offload": args.offload,
                    "presize": args.presize,
                    "block_events": block_events,
                    "events_per_s": rate(Path::Translated),
                    "events_per_s_raw": rate(Path::Raw),
                    "events_per_s_wire": rate(Path::Wire),
                    "events_per_s_rounds": rounds(Path::Translated),
                    "resident_pairs": pairs,
                    "find_matches_p50_us": p50,
                    "find_matches_p99_us": p99,
                    "hash_request_p50_us": median(&hash_us),
                    "bytes_per_pair": bytes_per_pair,
                })
            );
        }
    }
    Ok(true)
}
