//! The disk tier in the block manager: the full Gpu->Host->Disk->Host->Gpu cycle, admission,
//! restart announcements, and damaged blocks.

mod common;

use std::collections::HashSet;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use kvbm_core::{
    decode_identity, encode_identity, Admission, BlockIdentity, BlockManager, DiskOptions,
    GpuMemory, LayerShape, ManagerOptions, RegisteredBlock, TransferLimits,
};
use kvbm_events::{EventPublisher, KvEvent, SequenceHash, Tier};
use proptest::prelude::*;

const FILE: &str = "kvbm-test.cache";

fn disk_manager(dir: &Path, filter_disabled: bool, events: EventPublisher) -> BlockManager {
    salted_disk_manager(dir, filter_disabled, events, 0)
}

fn salted_disk_manager(
    dir: &Path,
    filter_disabled: bool,
    events: EventPublisher,
    layout_salt: u64,
) -> BlockManager {
    let m = BlockManager::with_publisher(
        device(),
        ManagerOptions {
            kv: kv(2),
            gpu_blocks: 12,
            gpu_layout: LayerShape::OuterFirst.into(),
            host_blocks: 12,
            limits: TransferLimits {
                batch_blocks_max: 4,
                ..Default::default()
            },
            pin_threads: 1,
            disk: Some(DiskOptions {
                dir: dir.to_owned(),
                file_name: FILE.into(),
                blocks: 8,
                disable_o_direct: false,
                filter_disabled,
                queue_depth: 8,
                engine: Default::default(),
                layout_salt,
            }),
            kv_events: None,
        },
        GpuMemory::Allocate,
        events,
    )
    .unwrap();
    assert!(m
        .host_region()
        .wait_ready(usize::MAX, Duration::from_secs(60)));
    m.refresh_host_available();
    m
}

fn store_on_gpu(m: &BlockManager, tokens: &[u32]) -> (Vec<BlockIdentity>, Vec<RegisteredBlock>) {
    let ids = identities(tokens);
    let blocks = fill(m, m.allocate_gpu(ids.len()).unwrap(), &ids);
    let (gpu, ticket) = m.register_gpu_write_through(blocks).unwrap();
    assert!(ticket.wait().error.is_none());
    m.wait_idle();
    (ids, gpu)
}

fn hashes(ids: &[BlockIdentity]) -> Vec<SequenceHash> {
    ids.iter().map(|i| i.sequence_hash).collect()
}

fn check_host_bytes(m: &BlockManager, blocks: &[RegisteredBlock]) {
    let bpb = m.kv().bytes_per_block();
    let mut buf = vec![0u8; bpb];
    for b in blocks {
        assert_eq!(b.tier(), Tier::Host);
        m.read_host_block(b.id(), &mut buf).unwrap();
        assert!(
            buf == block_bytes(b.sequence_hash(), bpb),
            "host bytes of {:?}",
            b.sequence_hash()
        );
    }
}

#[test]
fn a_full_gpu_host_disk_host_gpu_cycle_is_byte_exact_and_announced() {
    let dir = tempfile::tempdir().unwrap();
    let events = EventPublisher::new();
    let mut sub = events.subscribe(10_000);
    let m = disk_manager(dir.path(), true, events);
    // The host region is pinned (disk_manager waited): its registration follows.
    assert_eq!(m.wait_disk_registered(Duration::from_secs(60)), Some(true));
    let (ids, gpu) = store_on_gpu(&m, &(0..20).collect::<Vec<u32>>());
    assert_eq!(
        m.disk_pool().unwrap().counts().registered,
        5,
        "every block written through to disk"
    );

    // Only the disk copies remain.
    drop(gpu);
    m.gpu_pool().evict_idle(usize::MAX);
    m.host_pool().evict_idle(usize::MAX);
    let matched = m.match_lower(&hashes(&ids));
    assert_eq!(matched.count_in(Tier::Disk), 5);

    // Disk -> Host, then Host -> GPU into other blocks.
    let host = m.onboard_from_disk(matched.blocks).unwrap();
    assert_eq!(host.len(), 5);
    check_host_bytes(&m, &host);
    for b in m.allocate_gpu(12).unwrap() {
        m.write_gpu_block(b.id(), &vec![0xEE; m.kv().bytes_per_block()])
            .unwrap();
    }
    let mut targets = m.allocate_gpu(5).unwrap();
    targets.reverse();
    let outcome = m.onboard(host, targets).unwrap().wait();
    assert!(outcome.error.is_none());
    let mut buf = vec![0u8; m.kv().bytes_per_block()];
    for (b, id) in outcome.blocks.iter().zip(&ids) {
        m.read_gpu_block(b.id(), &mut buf).unwrap();
        assert!(
            buf == block_bytes(id.sequence_hash, buf.len()),
            "GPU bytes after the full cycle"
        );
    }
    m.wait_idle();

    let mut resident = HashSet::new();
    replay(&mut sub, &mut resident);
    assert_eq!(resident, m.residency());
    assert!(resident.iter().any(|(t, _)| *t == Tier::Disk));
    let snap = m.metrics_snapshot();
    assert_eq!((snap.offload_blocks_h2d, snap.onboard_blocks_d2d), (5, 5));
    let (kind, fixed_ops) = m
        .with_disk_store(|store| (store.engine().kind(), store.engine().fixed_ops()))
        .unwrap();
    if kind == kvbm_disk::EngineKind::IoUring {
        assert_eq!(
            fixed_ops, 10,
            "5 writes and 5 reads, each one fixed-buffer op"
        );
    }
    assert_eq!(snap.disk_cache_hit_rate, 1.0);
}

#[test]
fn admission_writes_blocks_on_their_second_sighting() {
    let dir = tempfile::tempdir().unwrap();
    let m = disk_manager(dir.path(), false, EventPublisher::new());
    let disk = m.disk_pool().unwrap();
    // First sighting: offloaded to host only.
    let (ids, gpu) = store_on_gpu(&m, &(0..12).collect::<Vec<u32>>());
    assert_eq!(disk.counts().registered, 0);
    // Asked to offload again while resident: a second sighting, so they go to disk.
    m.offload(&gpu).unwrap().wait();
    m.wait_idle();
    assert_eq!(disk.counts().registered, 3);
    assert!(hashes(&ids).iter().all(|&h| disk.contains(h)));
    // A host match hit is a sighting too.
    let (ids2, _gpu2) = store_on_gpu(&m, &(100..108).collect::<Vec<u32>>());
    assert!(!disk.contains(ids2[0].sequence_hash));
    drop(m.match_lower(&hashes(&ids2)));
    m.wait_idle();
    assert!(hashes(&ids2).iter().all(|&h| disk.contains(h)));
}

#[test]
fn admission_counts_decay_over_time() {
    let t0 = Instant::now();
    let half = Duration::from_secs(100);
    let mut a = Admission::new(false, half);
    let (x, y, z) = (SequenceHash(1), SequenceHash(2), SequenceHash(3));
    assert!(!a.observe(x, t0), "first sighting");
    assert!(
        a.observe(x, t0 + Duration::from_secs(10)),
        "second sighting soon after"
    );
    assert!(!a.observe(y, t0));
    assert!(
        !a.observe(y, t0 + 10 * half),
        "the first sighting has decayed away"
    );
    assert!(a.observe(y, t0 + 10 * half + Duration::from_secs(1)));
    assert!(!a.observe(z, t0));
    assert_eq!(a.len(), 3);
    let mut all = Admission::new(true, half);
    assert!(
        all.observe(z, t0),
        "the filter disabled admits on first sight"
    );
}

#[test]
fn a_restart_recovers_disk_blocks_and_announces_them() {
    let dir = tempfile::tempdir().unwrap();
    let (ids, expected_tokens) = {
        let m = disk_manager(dir.path(), true, EventPublisher::new());
        let tokens: Vec<u32> = (500..516).collect();
        let (ids, _gpu) = store_on_gpu(&m, &tokens);
        assert_eq!(m.disk_pool().unwrap().counts().registered, 4);
        (ids, tokens)
    }; // dropped: writes finish, a checkpoint is left

    let events = EventPublisher::new();
    let mut sub = events.subscribe(1000);
    let m = disk_manager(dir.path(), true, events);
    let stored: Vec<_> = sub
        .drain()
        .into_iter()
        .filter_map(|d| match &d.record.event {
            KvEvent::BlockStored(s) if s.tier == Tier::Disk => Some(s.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 1, "one chained announcement: {stored:?}");
    assert_eq!(stored[0].block_hashes, hashes(&ids));
    assert_eq!(stored[0].parent_hash, None);
    assert_eq!(stored[0].token_ids, expected_tokens);
    assert_eq!(stored[0].block_size, BLOCK_TOKENS as u32);

    // And the bytes come back.
    let matched = m.match_lower(&hashes(&ids));
    assert_eq!(matched.count_in(Tier::Disk), 4);
    let host = m.onboard_from_disk(matched.blocks).unwrap();
    check_host_bytes(&m, &host);
}

#[test]
fn a_file_written_under_another_group_layout_is_discarded_on_open() {
    // A hybrid model's layers are assigned to KV cache groups by vLLM's planner; the worker
    // folds that assignment into the file's fingerprint (`layout_salt`), so a file written
    // under another one never reads blocks into other layers.
    let dir = tempfile::tempdir().unwrap();
    {
        let m = salted_disk_manager(dir.path(), true, EventPublisher::new(), 0x5a17);
        store_on_gpu(&m, &(700..716).collect::<Vec<u32>>());
        assert_eq!(m.disk_pool().unwrap().counts().registered, 4);
    }
    let other = salted_disk_manager(dir.path(), true, EventPublisher::new(), 0x5a18);
    assert_eq!(other.disk_pool().unwrap().counts().registered, 0);
    drop(other);
    // The same grouping finds its blocks (the file above was discarded: write them again).
    {
        let m = salted_disk_manager(dir.path(), true, EventPublisher::new(), 0x5a17);
        store_on_gpu(&m, &(700..716).collect::<Vec<u32>>());
    }
    let same = salted_disk_manager(dir.path(), true, EventPublisher::new(), 0x5a17);
    assert_eq!(same.disk_pool().unwrap().counts().registered, 4);
}

#[test]
fn a_corrupt_disk_block_is_a_miss_that_leaves_the_tier() {
    let dir = tempfile::tempdir().unwrap();
    let events = EventPublisher::new();
    let mut sub = events.subscribe(1000);
    let m = disk_manager(dir.path(), true, events);
    let (ids, gpu) = store_on_gpu(&m, &(0..12).collect::<Vec<u32>>());
    drop(gpu);
    m.host_pool().evict_idle(usize::MAX);
    let disk = m.disk_pool().unwrap();
    let victim = disk.lookup(ids[1].sequence_hash).unwrap();
    // Flip a byte of that block's payload in the file.
    let area = m.with_disk_store(|s| s.payload_area_bytes()).unwrap() as u64;
    let offset = 4096 + u64::from(victim.id().0) * (4096 + area) + 4096 + 100;
    drop(victim);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(FILE))
        .unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&[0xFF, 0x00, 0xFF]).unwrap();
    f.sync_all().unwrap();

    let matched = m.match_lower(&hashes(&ids));
    assert_eq!(matched.count_in(Tier::Disk), 3);
    let host = m.onboard_from_disk(matched.blocks).unwrap();
    assert_eq!(host.len(), 1, "the loaded prefix ends at the damaged block");
    check_host_bytes(&m, &host);
    assert!(
        !disk.contains(ids[1].sequence_hash),
        "the damaged block left the disk tier"
    );
    assert_eq!(m.with_disk_store(|s| s.stats().read_corrupt).unwrap(), 1);
    let mut resident = HashSet::new();
    replay(&mut sub, &mut resident);
    assert_eq!(resident, m.residency());
}

#[test]
fn identities_round_trip_through_disk_metadata() {
    let with_all = BlockIdentity {
        sequence_hash: SequenceHash(9),
        parent: Some(SequenceHash(8)),
        tokens: vec![1, 2, 3, u32::MAX].into(),
        lora_name: Some("adapter-α".into()),
        group: None,
    };
    let bare = BlockIdentity {
        parent: None,
        lora_name: None,
        group: None,
        ..with_all.clone()
    };
    // A hybrid model's non-primary group block keeps its group across a restart (so it stays
    // unannounced).
    let grouped = BlockIdentity {
        group: Some(3),
        ..with_all.clone()
    };
    let grouped_bare = BlockIdentity {
        group: Some(0),
        ..bare.clone()
    };
    for id in [with_all, bare, grouped, grouped_bare] {
        assert_eq!(
            decode_identity(id.sequence_hash, &encode_identity(&id)),
            Some(id.clone())
        );
        let bytes = encode_identity(&id);
        for cut in 0..bytes.len() {
            assert_eq!(
                decode_identity(id.sequence_hash, &bytes[..cut]),
                None,
                "truncated at {cut}"
            );
        }
    }
}

proptest! {
    #[test]
    fn any_metadata_bytes_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = decode_identity(SequenceHash(1), &bytes);
    }
}

#[test]
fn a_full_disk_tier_evicts_its_least_recently_used_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let events = EventPublisher::new();
    let mut sub = events.subscribe(10_000);
    let m = disk_manager(dir.path(), true, events);
    let disk = m.disk_pool().unwrap();
    // 8 disk blocks; write 6, then 4 more: the 2 oldest must go.
    let (first, gpu1) = store_on_gpu(&m, &(0..24).collect::<Vec<u32>>());
    drop(gpu1);
    m.gpu_pool().evict_idle(usize::MAX);
    let (second, _gpu2) = store_on_gpu(&m, &(1000..1016).collect::<Vec<u32>>());
    assert_eq!(disk.counts().registered, 8);
    let gone: Vec<bool> = first
        .iter()
        .map(|i| !disk.contains(i.sequence_hash))
        .collect();
    assert_eq!(
        gone,
        vec![true, true, false, false, false, false],
        "LRU: the oldest two left"
    );
    assert!(second.iter().all(|i| disk.contains(i.sequence_hash)));
    let removed: Vec<SequenceHash> = sub
        .drain()
        .into_iter()
        .filter_map(|d| match &d.record.event {
            KvEvent::BlockRemoved(r) if r.tier == Tier::Disk => Some(r.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(
        removed,
        vec![first[0].sequence_hash, first[1].sequence_hash]
    );
}

#[test]
fn the_disk_tier_is_sized_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let dir_text = dir.path().to_str().unwrap().to_owned();
    let config = kvbm_core::KvbmConfig::from_lookup(
        |name| match name {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS" => Some("8".into()),
            "DYN_KVBM_DISK_CACHE_GB" => Some("0.0001".into()),
            "DYN_KVBM_DISK_CACHE_DIR" => Some(dir_text.clone()),
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER" => Some("1".into()),
            _ => None,
        },
        u64::MAX,
    )
    .unwrap();
    let options = ManagerOptions::from_config(&config, kv(2), 8, LayerShape::OuterFirst, 1)
        .with_disk_from_config(&config, 1, 3);
    let disk = options.disk.clone().expect("a disk tier");
    // 100_000 bytes of (4096-byte host stride + 4096-byte header) slots: 12 blocks.
    assert_eq!(disk.blocks, 12);
    assert_eq!(disk.dir, dir.path());
    assert_eq!(disk.file_name, "kvbm-rank3.cache");
    assert!(disk.filter_disabled && !disk.disable_o_direct);
    let m = BlockManager::new(device(), options, GpuMemory::Allocate).unwrap();
    assert_eq!(m.disk_pool().unwrap().capacity(), 12);
    assert!(dir.path().join("kvbm-rank3.cache").exists());
    let no_disk = kvbm_core::KvbmConfig::from_lookup(
        |n| (n == "DYN_KVBM_CPU_CACHE_GB").then(|| "1".into()),
        u64::MAX,
    )
    .unwrap();
    assert!(
        ManagerOptions::from_config(&no_disk, kv(2), 8, LayerShape::OuterFirst, 1)
            .with_disk_from_config(&no_disk, 1, 0)
            .disk
            .is_none()
    );
}
