//! Criterion micro-benchmarks, each next to its yardstick in the same group:
//! - `hash`: chained hashing (block hash + sequence hash) of a 512-block, 8K-token prompt against
//!   raw xxh3 of the same 64-byte blocks;
//! - `registry`: matching a 512-block prompt in a host pool: holding the matched blocks as a set,
//!   as one handle each, and counting them without holding;
//! - `pool`: allocating and freeing a batch of 16 blocks.
//!
//! Run: `cargo bench -p kvbm-bench --bench micro`. Figures for this machine are in the issue note.

use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvbm_core::{BlockIdentity, BlockPool};
use kvbm_events::{BlockHasher, SequenceHash, Tier};

const BLOCKS: usize = 512;
const BLOCK_TOKENS: usize = 16;

fn prompt() -> Vec<u32> {
    (0..(BLOCKS * BLOCK_TOKENS) as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 151_000)
        .collect()
}

fn hashing(c: &mut Criterion) {
    let tokens = prompt();
    let hasher = BlockHasher::new(BLOCK_TOKENS, None, None);
    let mut group = c.benchmark_group("hash");
    group.throughput(Throughput::Elements(BLOCKS as u64));
    group.bench_function("xxh3_64_of_each_block", |b| {
        b.iter(|| {
            let mut acc = 0u64;
            for block in black_box(&tokens).chunks_exact(BLOCK_TOKENS) {
                // The same bytes the block hash reads: token ids as u32 little-endian.
                let bytes: &[u8] = bytemuck::cast_slice(block);
                acc ^= xxhash_rust::xxh3::xxh3_64_with_seed(bytes, 1337);
            }
            acc
        })
    });
    group.bench_function("chained_sequence_hashes", |b| {
        b.iter(|| hasher.sequence_hashes(None, black_box(&tokens)))
    });
    group.finish();
}

fn registry(c: &mut Criterion) {
    let tokens = prompt();
    let hasher = BlockHasher::new(BLOCK_TOKENS, None, None);
    let hashes: Vec<SequenceHash> = hasher.sequence_hashes(None, &tokens);
    let pool = BlockPool::new(Tier::Host, 16_384, BLOCK_TOKENS, None);
    let blocks = pool.allocate(BLOCKS).unwrap();
    let complete = blocks
        .into_iter()
        .zip(&hashes)
        .enumerate()
        .map(|(i, (b, &h))| {
            b.complete(BlockIdentity {
                sequence_hash: h,
                parent: i.checked_sub(1).map(|p| hashes[p]),
                tokens: Arc::from(&tokens[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS]),
                lora_name: None,
                group: None,
            })
        })
        .collect();
    drop(pool.register_all(complete).unwrap()); // idle, findable
    let mut group = c.benchmark_group("registry");
    group.throughput(Throughput::Elements(BLOCKS as u64));
    // Steady state: every block idle before each match; the release is outside the timing.
    group.bench_function("hold_prefix_512_blocks", |b| {
        b.iter_custom(|iterations| {
            let mut total = std::time::Duration::ZERO;
            for _ in 0..iterations {
                let start = std::time::Instant::now();
                let held = pool.hold_prefix(black_box(&hashes));
                total += start.elapsed();
                assert_eq!(held.len(), BLOCKS);
                drop(held);
            }
            total
        })
    });
    group.bench_function("hold_prefix_512_blocks_and_release", |b| {
        b.iter(|| pool.hold_prefix(black_box(&hashes)))
    });
    group.bench_function("match_prefix_512_handles_and_release", |b| {
        b.iter(|| pool.match_prefix(black_box(&hashes)))
    });
    group.bench_function("count_prefix_512_blocks", |b| {
        b.iter(|| pool.count_prefix(black_box(&hashes)))
    });
    group.finish();
}

fn pool_alloc(c: &mut Criterion) {
    let pool = BlockPool::new(Tier::Host, 16_384, BLOCK_TOKENS, None);
    let mut group = c.benchmark_group("pool");
    group.throughput(Throughput::Elements(16));
    group.bench_function("allocate_and_free_16", |b| {
        b.iter_batched(
            || (),
            |()| drop(pool.allocate(16).unwrap()),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, hashing, registry, pool_alloc);
criterion_main!(benches);
