//! Helpers shared by the manager tests.
#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kvbm_core::{
    BlockIdentity, BlockManager, BlockPool, CompleteBlock, FillingBlock, GpuMemory, KvLayout,
    LayerShape, ManagerOptions, TransferLimits,
};
use kvbm_cuda::Device;
use kvbm_events::{BlockHasher, EventSubscriber, KvEvent, SequenceHash, Tier};

pub const BLOCK_TOKENS: usize = 4;

/// 3 layers of 128-byte chunks: 768-byte blocks (MLA: 384).
pub fn kv(outer: usize) -> KvLayout {
    KvLayout::new(3, outer, BLOCK_TOKENS, 16, 2).unwrap()
}

/// The device under test: the one `KVBM_DEVICE` names (`auto`: CUDA when a driver and a GPU
/// exist, else emulated). `scripts/test.sh` runs the tests again with `KVBM_DEVICE=cuda` on the
/// simulated driver.
pub fn device() -> Device {
    Device::from_env(0).expect("KVBM_DEVICE names a device this machine has")
}

pub fn manager(
    outer: usize,
    shape: LayerShape,
    gpu_blocks: usize,
    host_blocks: usize,
    limits: TransferLimits,
) -> BlockManager {
    manager_on(device(), outer, shape, gpu_blocks, host_blocks, limits)
}

/// [`manager`] on a given device: the emulated one for tests that inject copy faults
/// (`fail_next_copies`), which only it can.
pub fn manager_on(
    device: Device,
    outer: usize,
    shape: LayerShape,
    gpu_blocks: usize,
    host_blocks: usize,
    limits: TransferLimits,
) -> BlockManager {
    let m = BlockManager::new(
        device,
        ManagerOptions {
            kv: kv(outer),
            gpu_blocks,
            gpu_layout: shape.into(),
            host_blocks,
            limits,
            pin_threads: 1,
            disk: None,
            kv_events: None,
        },
        GpuMemory::Allocate,
    )
    .unwrap();
    assert!(m
        .host_region()
        .wait_ready(usize::MAX, Duration::from_secs(60)));
    assert_eq!(m.refresh_host_available(), host_blocks);
    m
}

/// Identities of the full blocks of `tokens`, chained from the first.
pub fn identities(tokens: &[u32]) -> Vec<BlockIdentity> {
    let hasher = BlockHasher::new(BLOCK_TOKENS, None, None);
    let hashes = hasher.sequence_hashes(None, tokens);
    hashes
        .iter()
        .enumerate()
        .map(|(i, &h)| BlockIdentity {
            sequence_hash: h,
            parent: i.checked_sub(1).map(|p| hashes[p]),
            tokens: Arc::from(&tokens[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS]),
            lora_name: None,
            group: None,
        })
        .collect()
}

/// The bytes a block with this hash holds in these tests.
pub fn block_bytes(hash: SequenceHash, len: usize) -> Vec<u8> {
    let mut x = hash.0 | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Writes each block's bytes and completes it.
pub fn fill(
    m: &BlockManager,
    blocks: Vec<FillingBlock>,
    ids: &[BlockIdentity],
) -> Vec<CompleteBlock> {
    blocks
        .into_iter()
        .zip(ids)
        .map(|(b, id)| {
            m.write_gpu_block(
                b.id(),
                &block_bytes(id.sequence_hash, m.kv().bytes_per_block()),
            )
            .unwrap();
            b.complete(id.clone())
        })
        .collect()
}

/// Applies every queued event to `set`; asserts none was lost.
pub fn replay(sub: &mut EventSubscriber, set: &mut HashSet<(Tier, SequenceHash)>) {
    for d in sub.drain() {
        assert_eq!(d.missed_before, 0, "the test subscriber lost events");
        match &d.record.event {
            KvEvent::BlockStored(s) => {
                assert_eq!(s.token_ids.len(), s.block_hashes.len() * BLOCK_TOKENS);
                for &h in &s.block_hashes {
                    assert!(
                        set.insert((s.tier, h)),
                        "{:?} stored twice in {}",
                        h,
                        s.tier
                    );
                }
            }
            KvEvent::BlockRemoved(r) => {
                for &h in &r.block_hashes {
                    assert!(
                        set.remove(&(r.tier, h)),
                        "{:?} removed from {} but not stored",
                        h,
                        r.tier
                    );
                }
            }
            KvEvent::AllBlocksCleared => set.clear(),
            KvEvent::SharedStored { .. } | KvEvent::SharedRemoved { .. } => {}
        }
    }
}

/// Prompt `prompt`'s tokens for `blocks` blocks: every prompt shares its first block, so
/// prefixes overlap across prompts.
pub fn prompt_tokens(prompt: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK_TOKENS) as u32)
        .map(|i| {
            if (i as usize) < BLOCK_TOKENS {
                i
            } else {
                prompt * 1000 + i
            }
        })
        .collect()
}

/// After the manager went idle: replaying the events gives its residency, and every pool has
/// conserved its blocks with nothing half-done.
pub fn check_idle_consistency(
    m: &BlockManager,
    pools: &[&BlockPool],
    sub: &mut EventSubscriber,
    resident: &mut HashSet<(Tier, SequenceHash)>,
) {
    replay(sub, resident);
    assert_eq!(*resident, m.residency());
    for pool in pools {
        let c = pool.counts();
        assert_eq!(
            c.free + c.filling + c.complete + c.registered + c.reserved,
            c.capacity,
            "{c:?}"
        );
        assert_eq!(
            (c.filling, c.complete),
            (0, 0),
            "nothing half-done once idle: {c:?}"
        );
    }
}

/// Once every handle is dropped: every registered block of every pool is idle.
pub fn check_all_released(pools: &[&BlockPool]) {
    for pool in pools {
        let c = pool.counts();
        assert_eq!(c.idle, c.registered, "every block released: {c:?}");
    }
}
