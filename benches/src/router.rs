//! `kvbm-bench router`: the router index on the generated workload of issue 4.
//!
//! Per worker, 32 sequences of 512 blocks (block size 16): a system prompt of 64 to 256 blocks drawn
//! from 200 (Zipf popularity), then per-conversation blocks; 30% of sequences branch from an
//! earlier sequence of the same worker. One store event per sequence holds the blocks the worker
//! lacks (or stores of `--store-blocks`), then 10% of each worker's blocks are evicted tail-first.
//! Queries of 512 hashes: half repeat a stored sequence, a third start a new conversation on a
//! known prompt, the rest are cold. With `--offload`, evicted blocks are also stored in host
//! memory (and every other one on disk), so that every tier is indexed; "pairs" then counts
//! (worker, block, tier) holdings. One thread. Memory is the heap counted by the binary's allocator plus the index's own
//! mappings.

use std::collections::HashSet;
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use kvbm_events::router::KvIndex;
use kvbm_events::{BlockHash, SequenceHash, Tier};
use rand::{Rng, SeedableRng};

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
    /// End with one JSON line per worker count.
    #[arg(long)]
    json: bool,
}

const SEQUENCES_PER_WORKER: usize = 32;
const SEQUENCE_BLOCKS: usize = 512;
const PROMPTS: usize = 200;

fn chain(parent: Option<SequenceHash>, rng: &mut impl Rng) -> SequenceHash {
    SequenceHash::chain(parent, BlockHash(rng.gen()))
}

/// The 200 system prompts: chains of 64 to 256 blocks.
fn prompts(rng: &mut impl Rng) -> Vec<Vec<u64>> {
    (0..PROMPTS)
        .map(|_| {
            let len = rng.gen_range(64..=256);
            let mut last = None;
            (0..len)
                .map(|_| {
                    let h = chain(last, rng);
                    last = Some(h);
                    h.0
                })
                .collect()
        })
        .collect()
}

/// A Zipf-ish draw over `n` items (weight 1/rank).
fn zipf(n: usize, rng: &mut impl Rng) -> usize {
    let harmonic: f64 = (1..=n).map(|k| 1.0 / k as f64).sum();
    let mut x = rng.gen::<f64>() * harmonic;
    for k in 1..=n {
        x -= 1.0 / k as f64;
        if x <= 0.0 {
            return k - 1;
        }
    }
    n - 1
}

fn extend(prefix: &[u64], total: usize, rng: &mut impl Rng) -> Vec<u64> {
    let mut seq = prefix.to_vec();
    let mut last = seq.last().map(|&h| SequenceHash(h));
    while seq.len() < total {
        let h = chain(last, rng);
        seq.push(h.0);
        last = Some(h);
    }
    seq
}

/// Heap bytes in use, from the binary's counting allocator.
fn heap() -> usize {
    crate::ALLOCATED.load(std::sync::atomic::Ordering::Relaxed)
}

pub fn run(args: RouterArgs) -> anyhow::Result<bool> {
    if args.queries == 0 || args.rounds == 0 || args.workers.is_empty() {
        bail!("--queries, --rounds and --workers must not be zero or empty");
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let prompts = prompts(&mut rng);
    println!(
        "kvbm router index: {} sequences of {} blocks per worker, stores of {}{}; one thread",
        SEQUENCES_PER_WORKER,
        SEQUENCE_BLOCKS,
        if args.store_blocks == 0 {
            "missing blocks per sequence".to_owned()
        } else {
            format!("{} blocks", args.store_blocks)
        },
        if args.offload {
            ", evicted blocks offloaded to host and disk"
        } else {
            ""
        }
    );
    println!(
        "{:>8} {:>14} {:>10} {:>12} {:>10} {:>10} {:>12}",
        "workers", "events/s (M)", "best (M)", "pairs", "p50 us", "p99 us", "bytes/pair"
    );
    for &workers in &args.workers {
        // Generate every worker's sequences and its store and eviction events.
        let mut sequences: Vec<Vec<Vec<u64>>> = Vec::with_capacity(workers);
        let mut stores: Vec<((u64, u32), Vec<u64>)> = Vec::new();
        let mut evictions: Vec<((u64, u32), Vec<u64>)> = Vec::new();
        let mut offloads: Vec<((u64, u32), Tier, Vec<u64>)> = Vec::new();
        for w in 0..workers {
            let key = (w as u64, 0u32);
            let mut held: HashSet<u64> = HashSet::new();
            let mut mine: Vec<Vec<u64>> = Vec::new();
            for s in 0..SEQUENCES_PER_WORKER {
                let seq = if s > 0 && rng.gen_bool(0.3) {
                    let base = &mine[rng.gen_range(0..mine.len())];
                    let cut = rng.gen_range(1..base.len());
                    extend(&base[..cut], SEQUENCE_BLOCKS, &mut rng)
                } else {
                    extend(&prompts[zipf(PROMPTS, &mut rng)], SEQUENCE_BLOCKS, &mut rng)
                };
                let missing: Vec<u64> = seq.iter().copied().filter(|h| held.insert(*h)).collect();
                if args.store_blocks == 0 {
                    stores.push((key, missing));
                } else {
                    stores.extend(missing.chunks(args.store_blocks).map(|c| (key, c.to_vec())));
                }
                mine.push(seq);
            }
            // 10% of this worker's blocks, tail-first across its sequences.
            let mut evict = Vec::new();
            let target = held.len() / 10;
            let mut s = mine.len();
            while evict.len() < target && s > 0 {
                s -= 1;
                for &h in mine[s].iter().rev() {
                    if evict.len() >= target {
                        break;
                    }
                    if held.remove(&h) {
                        evict.push(h);
                    }
                }
            }
            if args.offload {
                offloads.push((key, Tier::Host, evict.clone()));
                offloads.push((key, Tier::Disk, evict.iter().copied().step_by(2).collect()));
            }
            evictions.push((key, evict));
            sequences.push(mine);
        }
        let block_events: usize = stores.iter().map(|(_, h)| h.len()).sum::<usize>()
            + evictions.iter().map(|(_, h)| h.len()).sum::<usize>()
            + offloads.iter().map(|(_, _, h)| h.len()).sum::<usize>();

        // Apply the whole stream `--rounds` times into a fresh index; report the median rate.
        let mut rates = Vec::with_capacity(args.rounds);
        let mut index = KvIndex::default();
        let mut heap_delta = 0;
        for _ in 0..args.rounds {
            drop(std::mem::take(&mut index));
            let heap_before = heap();
            if args.presize {
                let stored: usize = stores.iter().map(|(_, h)| h.len()).sum();
                index = KvIndex::default().with_capacity(stored);
            }
            let start = Instant::now();
            for (key, hashes) in &stores {
                index.store(*key, Tier::Gpu, hashes);
            }
            for (key, hashes) in &evictions {
                index.remove(*key, Tier::Gpu, hashes);
            }
            for (key, tier, hashes) in &offloads {
                index.store(*key, *tier, hashes);
            }
            rates.push(block_events as f64 / start.elapsed().as_secs_f64());
            heap_delta = heap().saturating_sub(heap_before) + index.mapped_bytes();
        }
        let pairs: usize = (0..workers)
            .flat_map(|w| Tier::ALL.map(|t| index.blocks_in((w as u64, 0), t)))
            .sum();
        let bytes_per_pair = heap_delta as f64 / pairs.max(1) as f64;

        // Queries.
        let queries: Vec<Vec<u64>> = (0..args.queries)
            .map(|q| match q % 6 {
                0..=2 => {
                    let w = &sequences[rng.gen_range(0..workers)];
                    w[rng.gen_range(0..w.len())].clone()
                }
                3 | 4 => extend(&prompts[zipf(PROMPTS, &mut rng)], SEQUENCE_BLOCKS, &mut rng),
                _ => extend(&[], SEQUENCE_BLOCKS, &mut rng),
            })
            .collect();
        let mut latencies_us = Vec::with_capacity(queries.len());
        let mut matched = 0usize;
        for q in &queries {
            let t = Instant::now();
            let result = index.find_matches(q);
            latencies_us.push(t.elapsed().as_secs_f64() * 1e6);
            matched += result.len();
        }
        std::hint::black_box(matched);
        let rate_m = median(&rates) / 1e6;
        let (p50, p99) = (median(&latencies_us), percentile(&latencies_us, 0.99));
        println!(
            "{:>8} {:>14.2} {:>10.2} {:>12} {:>10.2} {:>10.2} {:>12.1}",
            workers,
            rate_m,
            rates.iter().copied().fold(0.0, f64::max) / 1e6,
            pairs,
            p50,
            p99,
            bytes_per_pair
        );
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "workers": workers,
                    "store_blocks": args.store_blocks,
                    "offload": args.offload,
                    "presize": args.presize,
                    "block_events": block_events,
                    "events_per_s": median(&rates),
                    "events_per_s_rounds": rates,
                    "resident_pairs": pairs,
                    "find_matches_p50_us": p50,
                    "find_matches_p99_us": p99,
                    "bytes_per_pair": bytes_per_pair,
                })
            );
        }
    }
    Ok(true)
}
