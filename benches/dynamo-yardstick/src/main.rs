//! Dynamo's KV router index (`dynamo-kv-router` 1.6.1) on `kvbm-bench router`'s workload
//! (`benches/src/router_workload.rs`, shared as source, seed 42).
//!
//! Each engine event goes through Dynamo's own conversion, as its ZMQ listener does it:
//! a vLLM-shaped `RawKvEvent` (engine block hashes, parent hash, tokens, medium) is turned into
//! a `PlacementEvent` by `ZmqEventNormalizer::normalize` (which calls `convert_event`, hashing
//! each stored block's tokens with `compute_block_hash_for_seq` into its `LocalBlockHash`), then
//! into a `RouterEvent`. Device events go to the primary index, host/disk events to Dynamo's
//! lower-tier indexes (`LowerTierIndexers`, one `LowerTierIndexer` per tier), as
//! `Indexer::apply_event_routed` does (`RouterEvent::targets_primary`).
//!
//! Three configurations:
//! - `radix`: the single-threaded `RadixTree`, applied inline on this thread (what `KvIndexer`
//!   wraps: Dynamo's primary when `router_event_threads` is 1), lower tiers with 1 thread;
//! - `crtc-1`: `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with 1 event thread, lower
//!   tiers with 1 thread; the primary pass and the lower-tier pass run one after the other and
//!   events are converted before either, so one core works at a time;
//! - `crtc-4`: Dynamo's default router (`router_event_threads` = 4): the same with 4 event
//!   threads for the primary and for each lower tier, events routed in publication order and
//!   (with hashing) converted on this thread while the pools apply.
//!
//! Rates are block events per second (stores + removals, counting blocks, as `kvbm-bench
//! router`'s `block_events`), median of `--rounds` fresh indexes. "+hash" includes Dynamo's
//! conversion (token hashing); "apply" is the index alone (events already converted).
//! find_matches: the query's `LocalBlockHash`es (hashing timed apart), `early_exit` false as
//! `ThreadPoolIndexer::find_matches` passes; "tiered" is the device match details plus
//! `query_lower_tiers_with_options`, as the router's tiered lookup does.

#[path = "../../src/router_workload.rs"]
#[allow(dead_code)]
mod router_workload;

use std::collections::HashSet;
use std::time::Instant;

use dynamo_kv_router::indexer::{
    KvIndexerInterface, LowerTierIndexers, LowerTierQueryOptions, SyncIndexer,
    ThreadPoolIndexer, query_lower_tiers_with_options,
};
use dynamo_kv_router::protocols::{
    BlockHashOptions, LocalBlockHash, RouterEvent, WorkerWithDpRank, compute_block_hash_for_seq,
};
use dynamo_kv_router::zmq_wire::{BlockHashValue, RawKvEvent, ZmqEventNormalizer};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use kvbm_events::Tier;

use router_workload::{EventKind, Workload, BLOCK_SIZE, generate};

const KV_BLOCK_SIZE: u32 = BLOCK_SIZE as u32;

struct Args {
    workers: Vec<usize>,
    store_blocks: usize,
    offload: bool,
    queries: usize,
    rounds: usize,
    pool_threads: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        workers: vec![16, 64, 256],
        store_blocks: 0,
        offload: false,
        queries: 2000,
        rounds: 5,
        pool_threads: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--workers" => {
                args.workers = val().split(',').map(|w| w.parse().expect("worker count")).collect()
            }
            "--store-blocks" => args.store_blocks = val().parse().expect("--store-blocks"),
            "--offload" => args.offload = true,
            "--queries" => args.queries = val().parse().expect("--queries"),
            "--rounds" => args.rounds = val().parse().expect("--rounds"),
            "--pool-threads" => args.pool_threads = val().parse().expect("--pool-threads"),
            other => panic!(
                "unknown argument {other}; usage: dynamo-yardstick [--workers 16,64,256] \
                 [--offload] [--store-blocks N] [--queries N] [--rounds N] [--pool-threads N]"
            ),
        }
    }
    assert!(args.rounds > 0 && args.queries > 0 && args.pool_threads > 0);
    args
}

fn median(values: &[f64]) -> f64 {
    percentile(values, 0.5)
}

/// Nearest rank, as benches/src/stats.rs.
fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The medium string a vLLM-style publisher puts on the wire for a tier.
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Host => "CPU",
        Tier::Disk => "DISK",
    }
}

/// The workload's events as Dynamo's ZMQ listener decodes them (`RawKvEvent`), per worker.
fn raw_events(w: &Workload) -> Vec<(u64, RawKvEvent)> {
    w.events
        .iter()
        .map(|e| {
            let raw = match &e.kind {
                EventKind::Store {
                    tier,
                    parent,
                    blocks,
                } => RawKvEvent::BlockStored {
                    block_hashes: blocks.iter().map(|b| BlockHashValue::Unsigned(b.engine)).collect(),
                    parent_block_hash: parent.map(BlockHashValue::Unsigned),
                    token_ids: blocks.iter().flat_map(|b| b.tokens).collect(),
                    block_size: BLOCK_SIZE,
                    medium: Some(medium(*tier).to_owned()),
                    lora_name: None,
                    cache_namespace: None,
                    block_mm_infos: None,
                    is_eagle: None,
                    group_idx: None,
                    kv_cache_spec_kind: None,
                    kv_cache_spec_sliding_window: None,
                    locality: None,
                    ownership: None,
                    session_id: None,
                },
                EventKind::Remove { tier, blocks } => RawKvEvent::BlockRemoved {
                    block_hashes: blocks.iter().map(|b| BlockHashValue::Unsigned(b.engine)).collect(),
                    medium: Some(medium(*tier).to_owned()),
                    group_idx: None,
                    kv_cache_spec_kind: None,
                    kv_cache_spec_sliding_window: None,
                    locality: None,
                    ownership: None,
                },
            };
            (e.worker, raw)
        })
        .collect()
}

/// One normalizer per worker (one ZMQ listener each), with its event ids.
struct Converter {
    normalizers: Vec<ZmqEventNormalizer>,
    next_id: Vec<u64>,
    dropped: usize,
}

impl Converter {
    fn new(workers: usize) -> Self {
        Self {
            normalizers: (0..workers).map(|_| ZmqEventNormalizer::new(KV_BLOCK_SIZE)).collect(),
            next_id: vec![0; workers],
            dropped: 0,
        }
    }

    /// Dynamo's conversion of one engine event (token hashing included).
    #[inline]
    fn convert(&mut self, worker: u64, raw: RawKvEvent) -> Option<RouterEvent> {
        let w = worker as usize;
        let id = self.next_id[w];
        self.next_id[w] += 1;
        let out = self.normalizers[w]
            .normalize(raw, id, WorkerWithDpRank::new(worker, 0))
            .and_then(|p| p.into_router_event());
        if out.is_none() {
            self.dropped += 1;
        }
        out
    }
}

/// Whether an event goes to the primary (device) index, as `apply_event_routed` decides.
fn primary(e: &RouterEvent) -> bool {
    e.targets_primary().expect("worker-domain events resolve")
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Config {
    Radix,
    Crtc1,
    CrtcPool,
}

impl Config {
    fn label(self, pool: usize) -> String {
        match self {
            Config::Radix => "radix".into(),
            Config::Crtc1 => "crtc-1".into(),
            Config::CrtcPool => format!("crtc-{pool}"),
        }
    }
}

enum Primary {
    Radix(RadixTree),
    Crtc(ThreadPoolIndexer<ConcurrentRadixTreeCompressed>),
}

struct Built {
    primary: Primary,
    lower: LowerTierIndexers,
    refused: usize,
}

/// Applies converted events (already in `events`, or converted here from `raw` when given).
/// Returns the index and the seconds spent converting (when not interleaved) and applying.
fn apply(
    config: Config,
    pool: usize,
    rt: &tokio::runtime::Runtime,
    mut events: Vec<RouterEvent>,
    raw: Option<(Vec<(u64, RawKvEvent)>, &mut Converter)>,
) -> (Built, f64, f64) {
    let mut convert_s = 0.0;
    match config {
        Config::Radix | Config::Crtc1 => {
            // One core at a time: convert everything, then the primary pass, then lower tiers.
            if let Some((raw, conv)) = raw {
                let t = Instant::now();
                events = raw
                    .into_iter()
                    .filter_map(|(w, r)| conv.convert(w, r))
                    .collect();
                convert_s = t.elapsed().as_secs_f64();
            }
            let lower = LowerTierIndexers::new(1, KV_BLOCK_SIZE);
            let mut refused = 0;
            let t = Instant::now();
            let mut lower_events = Vec::new();
            let primary = if config == Config::Radix {
                let mut tree = RadixTree::new();
                for e in events {
                    if primary(&e) {
                        if tree.apply_event(e).is_err() {
                            refused += 1;
                        }
                    } else {
                        lower_events.push(e);
                    }
                }
                Primary::Radix(tree)
            } else {
                let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, KV_BLOCK_SIZE);
                for e in events {
                    if primary(&e) {
                        pool.enqueue_event(e).expect("enqueue");
                    } else {
                        lower_events.push(e);
                    }
                }
                rt.block_on(pool.flush_and_wait()).expect("flush");
                Primary::Crtc(pool)
            };
            for e in lower_events {
                lower.get_or_create(e.storage_tier).enqueue_event(e).expect("enqueue");
            }
            for (_, idx) in lower.entries() {
                rt.block_on(idx.flush_and_wait()).expect("flush");
            }
            let apply_s = t.elapsed().as_secs_f64();
            (
                Built {
                    primary,
                    lower,
                    refused,
                },
                convert_s,
                apply_s,
            )
        }
        Config::CrtcPool => {
            let lower = LowerTierIndexers::new(pool, KV_BLOCK_SIZE);
            let primary_pool =
                ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), pool, KV_BLOCK_SIZE);
            let route = |e: RouterEvent| {
                if primary(&e) {
                    primary_pool.enqueue_event(e).expect("enqueue");
                } else {
                    lower.get_or_create(e.storage_tier).enqueue_event(e).expect("enqueue");
                }
            };
            let t = Instant::now();
            if let Some((raw, conv)) = raw {
                // Converted on this thread while the pools apply.
                for (w, r) in raw {
                    if let Some(e) = conv.convert(w, r) {
                        route(e);
                    }
                }
            } else {
                for e in events {
                    route(e);
                }
            }
            rt.block_on(primary_pool.flush_and_wait()).expect("flush");
            for (_, idx) in lower.entries() {
                rt.block_on(idx.flush_and_wait()).expect("flush");
            }
            let apply_s = t.elapsed().as_secs_f64();
            (
                Built {
                    primary: Primary::Crtc(primary_pool),
                    lower,
                    refused: 0,
                },
                0.0,
                apply_s,
            )
        }
    }
}

/// (worker, block, tier) holdings the workload leaves, by tier.
fn expected_pairs(w: &Workload) -> [usize; 3] {
    let mut held: HashSet<(u64, u64, u8)> = HashSet::new();
    let idx = |t: Tier| match t {
        Tier::Gpu => 0u8,
        Tier::Host => 1,
        Tier::Disk => 2,
    };
    for e in &w.events {
        match &e.kind {
            EventKind::Store { tier, blocks, .. } => {
                for b in blocks {
                    held.insert((e.worker, b.engine, idx(*tier)));
                }
            }
            EventKind::Remove { tier, blocks } => {
                for b in blocks {
                    held.remove(&(e.worker, b.engine, idx(*tier)));
                }
            }
        }
    }
    let mut out = [0; 3];
    for (_, _, t) in held {
        out[t as usize] += 1;
    }
    out
}

fn block_counts(rt: &tokio::runtime::Runtime, built: &Built) -> (usize, usize) {
    let device = match &built.primary {
        Primary::Radix(tree) => tree.current_size(),
        Primary::Crtc(pool) => rt
            .block_on(pool.shard_sizes())
            .iter()
            .map(|s| s.block_count)
            .sum(),
    };
    let lower = built
        .lower
        .all()
        .iter()
        .map(|idx| {
            rt.block_on(idx.shard_sizes())
                .iter()
                .map(|s| s.block_count)
                .sum::<usize>()
        })
        .sum();
    (device, lower)
}

struct QueryStats {
    device: Vec<f64>,
    tiered: Vec<f64>,
    /// Sum over queries of the best device overlap, and of lower-tier hits (a cross-check).
    matched_device: u64,
    matched_lower: u64,
}

fn run_queries(built: &Built, sequences: &[Vec<LocalBlockHash>], tiered: bool) -> QueryStats {
    let mut s = QueryStats {
        device: Vec::with_capacity(sequences.len()),
        tiered: Vec::with_capacity(sequences.len()),
        matched_device: 0,
        matched_lower: 0,
    };
    let options = LowerTierQueryOptions::default();
    for seq in sequences {
        let scores = match &built.primary {
            Primary::Radix(tree) => {
                let owned = seq.clone();
                let t = Instant::now();
                let r = tree.find_matches(owned, false);
                s.device.push(t.elapsed().as_secs_f64() * 1e6);
                r
            }
            Primary::Crtc(pool) => {
                let t = Instant::now();
                let r = pool.backend().find_matches(seq, false);
                s.device.push(t.elapsed().as_secs_f64() * 1e6);
                r
            }
        };
        s.matched_device += scores.scores.values().copied().max().unwrap_or(0) as u64;
        std::hint::black_box(&scores);
        if tiered {
            let (details, lower) = match &built.primary {
                Primary::Radix(tree) => {
                    let owned = seq.clone();
                    let t = Instant::now();
                    let d = tree.find_match_details(owned, false);
                    let l = query_lower_tiers_with_options(&built.lower, seq, &d, options);
                    s.tiered.push(t.elapsed().as_secs_f64() * 1e6);
                    (d, l)
                }
                Primary::Crtc(pool) => {
                    let t = Instant::now();
                    let d = pool.backend().find_match_details_impl(seq, false);
                    let l = query_lower_tiers_with_options(&built.lower, seq, &d, options);
                    s.tiered.push(t.elapsed().as_secs_f64() * 1e6);
                    (d, l)
                }
            };
            s.matched_lower += lower
                .values()
                .map(|l| l.hits.values().copied().sum::<usize>() as u64)
                .sum::<u64>();
            std::hint::black_box(&details);
        }
    }
    s
}

fn main() {
    let args = parse_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let _guard = rt.enter();
    println!(
        "Dynamo dynamo-kv-router 1.6.1 on kvbm-bench router's workload (seed 42), stores of {}{}; \
         {} queries, {} rounds (median)",
        if args.store_blocks == 0 {
            "missing blocks per sequence".to_owned()
        } else {
            format!("{} blocks", args.store_blocks)
        },
        if args.offload {
            ", evicted blocks offloaded to host and disk first"
        } else {
            ""
        },
        args.queries,
        args.rounds
    );
    println!(
        "M block events/s: +hash = Dynamo's conversion (ZmqEventNormalizer::normalize, token \
         hashing) + apply; apply = index alone. find_matches in us; hash us = \
         compute_block_hash_for_seq of the query's tokens"
    );
    println!(
        "{:>7} {:>8} {:>12} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>7}",
        "workers",
        "config",
        "block_events",
        "+hash",
        "apply",
        "p50 us",
        "p99 us",
        "tier p50",
        "tier p99",
        "hash us",
        "gpu pairs",
        "low pairs",
        "refused"
    );
    for &workers in &args.workers {
        let workload = generate(workers, args.store_blocks, args.offload, args.queries, 42);
        let block_events = workload.block_events;
        let raw = raw_events(&workload);
        let expected = expected_pairs(&workload);

        // Converted once, untimed, for the apply-only rounds.
        let mut conv = Converter::new(workers);
        let converted: Vec<RouterEvent> = raw
            .iter()
            .cloned()
            .filter_map(|(w, r)| conv.convert(w, r))
            .collect();
        let dropped = conv.dropped;

        // Queries: hashing the request's tokens, timed apart.
        let mut hash_us = Vec::with_capacity(workload.queries.len());
        let sequences: Vec<Vec<LocalBlockHash>> = workload
            .queries
            .iter()
            .map(|q| {
                let tokens: Vec<u32> = q.iter().flat_map(|b| b.tokens).collect();
                let t = Instant::now();
                let seq = compute_block_hash_for_seq(&tokens, KV_BLOCK_SIZE, BlockHashOptions::default());
                hash_us.push(t.elapsed().as_secs_f64() * 1e6);
                seq
            })
            .collect();
        let hash_p50 = median(&hash_us);

        for config in [Config::Radix, Config::Crtc1, Config::CrtcPool] {
            let mut with_hash = Vec::with_capacity(args.rounds);
            let mut apply_only = Vec::with_capacity(args.rounds);
            let mut last: Option<Built> = None;
            for _ in 0..args.rounds {
                drop(last.take());
                // With conversion (token hashing).
                let raw_round = raw.clone();
                let mut conv = Converter::new(workers);
                let (built, convert_s, apply_s) =
                    apply(config, args.pool_threads, &rt, Vec::new(), Some((raw_round, &mut conv)));
                with_hash.push(block_events as f64 / (convert_s + apply_s));
                if config == Config::CrtcPool {
                    // The pools overlap conversion and applying: the index alone is another run.
                    drop(built);
                    let (built, _, apply_s) =
                        apply(config, args.pool_threads, &rt, converted.clone(), None);
                    apply_only.push(block_events as f64 / apply_s);
                    last = Some(built);
                } else {
                    // Same round: conversion and applying were timed apart.
                    apply_only.push(block_events as f64 / apply_s);
                    last = Some(built);
                }
            }
            let built = last.expect("rounds > 0");
            let (gpu_pairs, low_pairs) = block_counts(&rt, &built);
            let q = run_queries(&built, &sequences, args.offload);
            println!(
                "{:>7} {:>8} {:>12} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>9} {:>9} {:>8.2} {:>9} {:>9} {:>7}",
                workers,
                config.label(args.pool_threads),
                block_events,
                median(&with_hash) / 1e6,
                median(&apply_only) / 1e6,
                median(&q.device),
                percentile(&q.device, 0.99),
                if args.offload { format!("{:.2}", median(&q.tiered)) } else { "-".into() },
                if args.offload { format!("{:.2}", percentile(&q.tiered, 0.99)) } else { "-".into() },
                hash_p50,
                gpu_pairs,
                low_pairs,
                built.refused + dropped,
            );
            eprintln!(
                "  [{} w={workers}] expected pairs gpu/host/disk {:?}; matched blocks: best device {} lower-tier hits {}; \
                 +hash rounds {:?}",
                config.label(args.pool_threads),
                expected,
                q.matched_device,
                q.matched_lower,
                with_hash.iter().map(|r| (r / 1e4).round() / 100.0).collect::<Vec<_>>()
            );
            drop(built);
        }
    }
}
