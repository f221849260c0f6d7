//! The router benchmark's workload (issue 4's, with tokens): what each worker's engine publishes,
//! as a vLLM engine would, and the queries. Shared, as source, by `kvbm-bench router` and the
//! Dynamo yardstick (`benches/dynamo-yardstick`), so both index exactly the same stream.
//!
//! Per worker, 32 sequences of 512 blocks of 16 random tokens: a system prompt of 64 to 256
//! blocks drawn from 200 (Zipf popularity), then per-conversation blocks; 30% of sequences branch
//! from an earlier sequence of the same worker. Each block carries the engine's own hash (a
//! function of its parent's engine hash and its tokens, unrelated to the router's, as vLLM's
//! SHA-256 prefix-cache hashes are) and the router's sequence hash. One store event per sequence
//! holds the blocks the worker lacks (or stores of `store_blocks`), chained to its parent by
//! engine hash. Then 10% of each worker's blocks are evicted from the GPU, tail-first; with
//! `offload`, each evicted run is first stored in host memory (and every other run on disk), as
//! an offloading engine publishes it before the GPU eviction. Queries of 512 blocks: half repeat a
//! stored sequence, a third start a new conversation on a known prompt, the rest are cold.

use std::collections::HashSet;

use kvbm_events::{BlockHasher, SequenceHash, Tier};
use rand::{Rng, SeedableRng};

/// Tokens per block.
pub const BLOCK_SIZE: usize = 16;
/// Sequences per worker.
pub const SEQUENCES_PER_WORKER: usize = 32;
/// Blocks per sequence (and per query).
pub const SEQUENCE_BLOCKS: usize = 512;
/// System prompts.
pub const PROMPTS: usize = 200;

/// One block: its tokens, the engine's hash, the router's.
#[derive(Debug, Clone)]
pub struct Block {
    /// Its tokens.
    pub tokens: [u32; BLOCK_SIZE],
    /// The engine's hash.
    pub engine: u64,
    /// The router's sequence hash.
    pub ours: u64,
}

/// What an engine publishes.
#[derive(Debug, Clone)]
pub enum EventKind {
    /// Blocks stored in `tier`, chained to `parent` (the engine hash of the block before them).
    Store {
        /// Where.
        tier: Tier,
        /// The engine hash of the block before the first.
        parent: Option<u64>,
        /// The blocks, in prefix order.
        blocks: Vec<Block>,
    },
    /// Blocks removed from `tier`.
    Remove {
        /// Where.
        tier: Tier,
        /// The blocks.
        blocks: Vec<Block>,
    },
}

/// One event of one worker.
#[derive(Debug, Clone)]
pub struct Event {
    /// The worker's id (dp rank 0).
    pub worker: u64,
    /// What it says.
    pub kind: EventKind,
}

/// The whole workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Every worker's events, worker by worker, in publication order.
    pub events: Vec<Event>,
    /// Block events (blocks stored or removed).
    pub block_events: usize,
    /// Queries: their blocks (tokens and the router's hashes).
    pub queries: Vec<Vec<Block>>,
}

/// The engine's hash of a block: its parent's engine hash and its tokens, through another
/// function than the router's.
fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(8 + 4 * tokens.len());
    bytes.extend_from_slice(&parent.unwrap_or(0x5ca1ab1e).to_be_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_be_bytes());
    }
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 0x00e4_610e)
}

/// `total` blocks: `prefix`, then new random blocks chained onto it.
fn extend(prefix: &[Block], total: usize, rng: &mut impl Rng) -> Vec<Block> {
    let hasher = BlockHasher::new(BLOCK_SIZE, None, None);
    let mut seq = prefix.to_vec();
    while seq.len() < total {
        let mut tokens = [0u32; BLOCK_SIZE];
        for t in &mut tokens {
            *t = rng.gen_range(0..150_000);
        }
        let last = seq.last();
        let ours = SequenceHash::chain(
            last.map(|b| SequenceHash(b.ours)),
            hasher.block_hash(&tokens),
        );
        let engine = engine_hash(last.map(|b| b.engine), &tokens);
        seq.push(Block {
            tokens,
            engine,
            ours: ours.0,
        });
    }
    seq
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

/// The workload for `workers` workers.
pub fn generate(
    workers: usize,
    store_blocks: usize,
    offload: bool,
    queries: usize,
    seed: u64,
) -> Workload {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let prompts: Vec<Vec<Block>> = (0..PROMPTS)
        .map(|_| {
            let len = rng.gen_range(64..=256);
            extend(&[], len, &mut rng)
        })
        .collect();
    let mut events = Vec::new();
    let mut all_sequences: Vec<Vec<Vec<Block>>> = Vec::with_capacity(workers);
    for w in 0..workers as u64 {
        let mut held: HashSet<u64> = HashSet::new();
        let mut mine: Vec<Vec<Block>> = Vec::new();
        for s in 0..SEQUENCES_PER_WORKER {
            let seq = if s > 0 && rng.gen_bool(0.3) {
                let base = &mine[rng.gen_range(0..mine.len())];
                let cut = rng.gen_range(1..base.len());
                extend(&base[..cut], SEQUENCE_BLOCKS, &mut rng)
            } else {
                extend(&prompts[zipf(PROMPTS, &mut rng)], SEQUENCE_BLOCKS, &mut rng)
            };
            // What the worker lacks is a suffix: stored chained to the block before it.
            let first = seq
                .iter()
                .position(|b| !held.contains(&b.ours))
                .unwrap_or(seq.len());
            for b in &seq[first..] {
                held.insert(b.ours);
            }
            let chunk = if store_blocks == 0 {
                usize::MAX
            } else {
                store_blocks
            };
            let mut from = first;
            while from < seq.len() {
                let to = from.saturating_add(chunk).min(seq.len());
                events.push(Event {
                    worker: w,
                    kind: EventKind::Store {
                        tier: Tier::Gpu,
                        parent: from.checked_sub(1).map(|p| seq[p].engine),
                        blocks: seq[from..to].to_vec(),
                    },
                });
                from = to;
            }
            mine.push(seq);
        }
        // 10% of this worker's blocks, tail-first across its sequences, as runs of a sequence.
        let target = held.len() / 10;
        let mut evicted = 0;
        let mut runs: Vec<(Option<u64>, Vec<Block>)> = Vec::new();
        let run = |seq: &[Block], from: usize, to: usize| {
            (
                from.checked_sub(1).map(|p| seq[p].engine),
                seq[from..to].to_vec(),
            )
        };
        let mut s = mine.len();
        while evicted < target && s > 0 {
            s -= 1;
            let seq = &mine[s];
            // The exclusive end of the run being evicted, if any.
            let mut run_end = None;
            let mut i = seq.len();
            while i > 0 && evicted < target {
                i -= 1;
                if held.remove(&seq[i].ours) {
                    evicted += 1;
                    run_end.get_or_insert(i + 1);
                } else if let Some(end) = run_end.take() {
                    runs.push(run(seq, i + 1, end));
                }
            }
            if let Some(end) = run_end {
                runs.push(run(seq, i, end));
            }
        }
        if offload {
            for (k, (parent, run)) in runs.iter().enumerate() {
                events.push(Event {
                    worker: w,
                    kind: EventKind::Store {
                        tier: Tier::Host,
                        parent: *parent,
                        blocks: run.clone(),
                    },
                });
                if k % 2 == 0 {
                    events.push(Event {
                        worker: w,
                        kind: EventKind::Store {
                            tier: Tier::Disk,
                            parent: *parent,
                            blocks: run.clone(),
                        },
                    });
                }
            }
        }
        for (_, run) in runs {
            events.push(Event {
                worker: w,
                kind: EventKind::Remove {
                    tier: Tier::Gpu,
                    blocks: run.into_iter().rev().collect(),
                },
            });
        }
        all_sequences.push(mine);
    }
    let block_events = events
        .iter()
        .map(|e| match &e.kind {
            EventKind::Store { blocks, .. } | EventKind::Remove { blocks, .. } => blocks.len(),
        })
        .sum();
    let queries = (0..queries)
        .map(|q| match q % 6 {
            0..=2 => {
                let w = &all_sequences[rng.gen_range(0..workers)];
                w[rng.gen_range(0..w.len())].clone()
            }
            3 | 4 => extend(&prompts[zipf(PROMPTS, &mut rng)], SEQUENCE_BLOCKS, &mut rng),
            _ => extend(&[], SEQUENCE_BLOCKS, &mut rng),
        })
        .collect();
    Workload {
        events,
        block_events,
        queries,
    }
}
