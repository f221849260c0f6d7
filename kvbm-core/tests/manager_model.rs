//! Random operation sequences over both tiers, and concurrent stress from several threads.
//! After each, replaying the event stream gives exactly the manager's residency, counts are
//! conserved, and every onboarded block holds the bytes it was offloaded with.

mod common;

use std::collections::HashSet;

use common::*;
use kvbm_core::{BlockManager, LayerShape, RegisteredBlock, TransferLimits};
use kvbm_events::{SequenceHash, Tier};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// Write `len` blocks of prompt `prompt` to the GPU and register them (write-through or not).
    Store {
        prompt: u32,
        len: usize,
        write_through: bool,
    },
    /// Offload every held GPU block.
    OffloadHeld,
    /// Drop held GPU block i.
    DropGpu(usize),
    /// Evict up to n idle blocks of a tier.
    Evict { gpu: bool, n: usize },
    /// Match prompt `prompt` in the host tier and onboard what matched.
    Onboard { prompt: u32, len: usize },
    /// Drop every held block.
    DropAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4u32, 1..5usize, any::<bool>()).prop_map(|(prompt, len, write_through)| Op::Store { prompt, len, write_through }),
        1 => Just(Op::OffloadHeld),
        2 => (0..16usize).prop_map(Op::DropGpu),
        2 => (any::<bool>(), 0..4usize).prop_map(|(gpu, n)| Op::Evict { gpu, n }),
        3 => (0..4u32, 1..5usize).prop_map(|(prompt, len)| Op::Onboard { prompt, len }),
        1 => Just(Op::DropAll),
    ]
}

fn check_onboarded(m: &BlockManager, blocks: &[RegisteredBlock]) {
    let bpb = m.kv().bytes_per_block();
    let mut buf = vec![0u8; bpb];
    for b in blocks {
        m.read_gpu_block(b.id(), &mut buf).unwrap();
        assert!(
            buf == block_bytes(b.sequence_hash(), bpb),
            "onboarded bytes of {:?}",
            b.sequence_hash()
        );
    }
}

fn run(ops: Vec<Op>, shape: LayerShape) {
    let m = manager(
        2,
        shape,
        10,
        6,
        TransferLimits {
            batch_blocks_max: 2,
            inflight_max: 2,
            pending_max: 8,
            ..Default::default()
        },
    );
    let mut sub = m.subscribe(100_000);
    let mut resident: HashSet<(Tier, SequenceHash)> = HashSet::new();
    let mut held: Vec<RegisteredBlock> = Vec::new();
    for op in ops {
        match op {
            Op::Store {
                prompt,
                len,
                write_through,
            } => {
                let ids = identities(&prompt_tokens(prompt, len));
                let Ok(blocks) = m.allocate_gpu(len) else {
                    continue;
                };
                let complete = fill(&m, blocks, &ids);
                if write_through {
                    let (gpu, ticket) = m.register_gpu_write_through(complete).unwrap();
                    let outcome = ticket.wait();
                    assert!(outcome.error.is_none());
                    assert_eq!(
                        outcome.copied + outcome.skipped + outcome.deduplicated,
                        gpu.len()
                    );
                    held.extend(gpu);
                } else {
                    held.extend(m.register_gpu(complete).unwrap());
                }
            }
            Op::OffloadHeld => {
                let gpu: Vec<_> = held
                    .iter()
                    .filter(|b| b.tier() == Tier::Gpu)
                    .cloned()
                    .collect();
                m.offload(&gpu).unwrap().wait();
            }
            Op::DropGpu(i) if i < held.len() => {
                held.swap_remove(i);
            }
            Op::Evict { gpu, n } => {
                let pool = if gpu { m.gpu_pool() } else { m.host_pool() };
                pool.evict_idle(n);
            }
            Op::Onboard { prompt, len } => {
                let hashes: Vec<_> = identities(&prompt_tokens(prompt, len))
                    .iter()
                    .map(|i| i.sequence_hash)
                    .collect();
                let sources = m.match_host(&hashes);
                let Ok(targets) = m.allocate_gpu(sources.len()) else {
                    continue;
                };
                let outcome = m.onboard(sources, targets).unwrap().wait();
                assert!(outcome.error.is_none());
                check_onboarded(&m, &outcome.blocks);
                held.extend(outcome.blocks);
            }
            Op::DropAll => held.clear(),
            _ => {}
        }
        m.wait_idle();
        check_idle_consistency(&m, &[m.gpu_pool(), m.host_pool()], &mut sub, &mut resident);
    }
    drop(held);
    check_all_released(&[m.gpu_pool(), m.host_pool()]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn events_match_residency_after_any_sequence(ops in proptest::collection::vec(op(), 1..40), block_first in any::<bool>()) {
        run(ops, if block_first { LayerShape::BlockFirst } else { LayerShape::OuterFirst });
    }
}

#[test]
fn concurrent_stress_from_several_threads() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let m = manager(
        2,
        LayerShape::OuterFirst,
        64,
        24,
        TransferLimits {
            batch_blocks_max: 3,
            inflight_max: 3,
            pending_max: 16,
            ..Default::default()
        },
    );
    let mut sub = m.subscribe(1_000_000);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let m = &m;
            s.spawn(move || {
                use rand::{Rng, SeedableRng};
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ t);
                let mut held: Vec<RegisteredBlock> = Vec::new();
                for _ in 0..150 {
                    let prompt = rng.gen_range(0..6);
                    let len = rng.gen_range(1..4);
                    let ids = identities(&prompt_tokens(prompt, len));
                    match rng.gen_range(0..3) {
                        0 => {
                            if let Ok(blocks) = m.allocate_gpu(len) {
                                let (gpu, ticket) =
                                    m.register_gpu_write_through(fill(m, blocks, &ids)).unwrap();
                                if rng.gen_bool(0.5) {
                                    assert!(ticket.wait().error.is_none());
                                }
                                held.extend(gpu);
                            }
                        }
                        1 => {
                            let hashes: Vec<_> = ids.iter().map(|i| i.sequence_hash).collect();
                            let sources = m.match_host(&hashes);
                            if let Ok(targets) = m.allocate_gpu(sources.len()) {
                                let outcome = m.onboard(sources, targets).unwrap().wait();
                                assert!(outcome.error.is_none());
                                check_onboarded(m, &outcome.blocks);
                                held.extend(outcome.blocks);
                            }
                        }
                        _ => {
                            let keep = rng.gen_range(0..=held.len());
                            held.truncate(keep);
                        }
                    }
                    if held.len() > 8 {
                        held.drain(..4);
                    }
                }
            });
        }
    });
    m.wait_idle();
    let mut resident = HashSet::new();
    replay(&mut sub, &mut resident);
    assert_eq!(resident, m.residency());
    assert_eq!(m.events().dropped_total(), 0);
    for pool in [m.gpu_pool(), m.host_pool()] {
        let c = pool.counts();
        assert_eq!(c.free + c.registered, c.capacity, "{c:?}");
        assert_eq!(c.idle, c.registered, "a block is still held: {c:?}");
    }
    let snap = m.metrics_snapshot();
    assert!(
        snap.offload_blocks_d2h > 0 && snap.onboard_blocks_h2d > 0,
        "{snap:?}"
    );
}
