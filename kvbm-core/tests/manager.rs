//! The block manager end to end on the emulated device.

mod common;

use std::collections::HashSet;

use common::*;
use kvbm_core::{CoreError, LayerShape, TransferLimits};
use kvbm_cuda::{Device, Direction};
use kvbm_events::Tier;

fn round_trip(outer: usize, shape: LayerShape) {
    let m = manager(
        outer,
        shape,
        8,
        6,
        TransferLimits {
            batch_blocks_max: 3,
            ..Default::default()
        },
    );
    let mut sub = m.subscribe(1024);
    let mut resident = HashSet::new();
    let tokens: Vec<u32> = (100..100 + 5 * BLOCK_TOKENS as u32).collect();
    let ids = identities(&tokens);
    let bpb = m.kv().bytes_per_block();

    // Offload: GPU blocks 0..5 written, registered, copied to the host tier.
    let blocks = m.allocate_gpu(5).unwrap();
    let complete = fill(&m, blocks, &ids);
    let (gpu_blocks, ticket) = m.register_gpu_write_through(complete).unwrap();
    let outcome = ticket.wait();
    assert_eq!(
        (outcome.copied, outcome.skipped, outcome.deduplicated),
        (5, 0, 0)
    );
    assert_eq!(outcome.batches.len(), 2, "5 blocks in batches of 3");
    assert!(outcome.error.is_none());
    let mut host_bytes = vec![0u8; bpb];
    for id in &ids {
        let held = m
            .host_pool()
            .lookup(id.sequence_hash)
            .expect("offloaded block is findable");
        m.read_host_block(held.id(), &mut host_bytes).unwrap();
        assert!(
            host_bytes == block_bytes(id.sequence_hash, bpb),
            "host copy of {:?}",
            id.sequence_hash
        );
    }

    // Forget the GPU copies and scribble over GPU memory.
    drop(gpu_blocks);
    assert_eq!(m.gpu_pool().evict_idle(usize::MAX), 5);
    for b in m.allocate_gpu(8).unwrap() {
        m.write_gpu_block(b.id(), &vec![0xEE; bpb]).unwrap();
    }

    // Onboard into other GPU blocks, in reverse order of ids.
    let hashes: Vec<_> = ids.iter().map(|i| i.sequence_hash).collect();
    let matched = m.match_prefix(&hashes);
    assert_eq!(matched.count_in(Tier::Host), 5);
    let mut targets = m.allocate_gpu(8).unwrap();
    targets.reverse();
    targets.truncate(5);
    let target_ids: Vec<_> = targets.iter().map(|t| t.id()).collect();
    let outcome = m.onboard(matched.blocks, targets).unwrap().wait();
    assert!(outcome.error.is_none());
    assert_eq!(
        outcome.blocks.iter().map(|b| b.id()).collect::<Vec<_>>(),
        target_ids
    );
    let mut gpu_bytes = vec![0u8; bpb];
    for (block, id) in outcome.blocks.iter().zip(&ids) {
        assert_eq!(block.tier(), Tier::Gpu);
        assert_eq!(block.sequence_hash(), id.sequence_hash);
        m.read_gpu_block(block.id(), &mut gpu_bytes).unwrap();
        assert!(
            gpu_bytes == block_bytes(id.sequence_hash, bpb),
            "onboarded {:?}",
            id.sequence_hash
        );
    }
    // Now every block matches on the GPU first.
    assert_eq!(m.match_prefix(&hashes).count_in(Tier::Gpu), 5);

    let metrics = m.metrics_snapshot();
    assert_eq!(
        (metrics.offload_blocks_d2h, metrics.onboard_blocks_h2d),
        (5, 5)
    );
    assert_eq!(metrics.bytes_d2h, 5 * bpb as u64);
    // 6 host blocks of 768 bytes: 4 KiB strides plus 4 KiB of header room each.
    assert_eq!(metrics.host_pinned_bytes_ready, 6 * 8192);
    replay(&mut sub, &mut resident);
    assert_eq!(resident, m.residency());
}

#[test]
fn round_trip_outer_first() {
    round_trip(2, LayerShape::OuterFirst);
}

#[test]
fn round_trip_block_first() {
    round_trip(2, LayerShape::BlockFirst);
}

#[test]
fn round_trip_mla() {
    round_trip(1, LayerShape::OuterFirst);
}

#[test]
fn offloading_what_the_host_holds_is_a_no_op() {
    let m = manager(2, LayerShape::OuterFirst, 8, 8, TransferLimits::default());
    let ids = identities(&(0..16).collect::<Vec<u32>>());
    let blocks = fill(&m, m.allocate_gpu(4).unwrap(), &ids);
    let (gpu, ticket) = m.register_gpu_write_through(blocks).unwrap();
    assert_eq!(ticket.wait().copied, 4);
    let again = m.offload(&gpu).unwrap().wait();
    assert_eq!((again.copied, again.deduplicated), (0, 4));
    assert_eq!(m.host_pool().counts().registered, 4);
    assert_eq!(m.metrics_snapshot().offload_deduplicated_blocks, 4);
}

#[test]
fn a_host_tier_full_of_held_blocks_skips_offloads_and_counts_them() {
    let m = manager(2, LayerShape::OuterFirst, 8, 2, TransferLimits::default());
    let ids = identities(&(0..24).collect::<Vec<u32>>());
    let blocks = fill(&m, m.allocate_gpu(6).unwrap(), &ids);
    let gpu = m.register_gpu(blocks).unwrap();
    m.offload(&gpu[..2]).unwrap().wait();
    let hashes: Vec<_> = ids.iter().map(|i| i.sequence_hash).collect();
    let held = m.match_host(&hashes[..2]);
    assert_eq!(held.len(), 2);
    let outcome = m.offload(&gpu[2..]).unwrap().wait();
    assert_eq!((outcome.copied, outcome.skipped), (0, 4));
    assert_eq!(m.metrics_snapshot().offload_skipped_blocks, 4);
    drop(held);
    // Idle host blocks are evicted for new offloads (LRU).
    let outcome = m.offload(&gpu[2..4]).unwrap().wait();
    assert_eq!(outcome.copied, 2);
    assert!(!m.host_pool().contains(hashes[0]) && m.host_pool().contains(hashes[3]));
    let snap = m.metrics_snapshot();
    assert_eq!(snap.host_cache_hit_rate, 1.0);
    assert_eq!(snap.matched_tokens, 2 * BLOCK_TOKENS as u64);
}

#[test]
fn wrong_arguments_are_refused_and_lose_nothing() {
    let m = manager(2, LayerShape::OuterFirst, 4, 4, TransferLimits::default());
    let ids = identities(&(0..8).collect::<Vec<u32>>());
    let gpu = m
        .register_gpu(fill(&m, m.allocate_gpu(2).unwrap(), &ids))
        .unwrap();
    m.offload(&gpu).unwrap().wait();
    let host = m.match_host(&[ids[0].sequence_hash, ids[1].sequence_hash]);
    let targets = m.allocate_gpu(1).unwrap();
    assert!(matches!(
        m.onboard(host.clone(), targets),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        m.offload(&host),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        m.allocate_gpu(5),
        Err(CoreError::Exhausted { requested: 5, .. })
    ));
    assert!(m.write_gpu_block(kvbm_core::BlockId(0), &[0u8; 3]).is_err());
    drop(host);
    let c = m.gpu_pool().counts();
    assert_eq!(
        c.free + c.registered,
        4,
        "refused targets went back to free: {c:?}"
    );
}

#[test]
fn an_offloaded_block_is_findable_at_once_and_an_onboard_from_it_waits_for_its_copy() {
    // The manager's leader registers (and announces) a host block when its copy is queued, as
    // the connector's does; the worker must then order the onboard after that copy.
    // Emulated: the test holds a stream, which only it can.
    let m = manager_on(
        Device::emulated(),
        2,
        LayerShape::OuterFirst,
        8,
        4,
        TransferLimits::default(),
    );
    let mut sub = m.subscribe(64);
    let ids = identities(&(0..8).collect::<Vec<u32>>());
    let gpu = m
        .register_gpu(fill(&m, m.allocate_gpu(2).unwrap(), &ids))
        .unwrap();
    let hold = m.hold_stream(Direction::DeviceToHost).unwrap();
    let ticket = m.offload(&gpu).unwrap();
    assert!(!ticket.is_done(), "the copy is held");
    let hashes: Vec<_> = ids.iter().map(|i| i.sequence_hash).collect();
    let sources = m.match_host(&hashes);
    assert_eq!(sources.len(), 2, "findable while its copy is queued");
    let stored_host = sub
        .drain()
        .iter()
        .filter(|d| matches!(&d.record.event, kvbm_events::KvEvent::BlockStored(s) if s.tier == Tier::Host))
        .count();
    assert_eq!(stored_host, 1, "announced with the plan");
    // The GPU sources stay held until copied: a reset is refused.
    assert!(matches!(m.reset(), Err(CoreError::Busy(_))));
    // The GPU copies leave the GPU index (their memory stays, held by the offload), so that the
    // onboard below registers its own targets rather than finding these.
    for b in gpu {
        m.gpu_pool().discard(b);
    }
    let targets = m.allocate_gpu(2).unwrap();
    let target_ids: Vec<_> = targets.iter().map(|t| t.id()).collect();
    let bpb = m.kv().bytes_per_block();
    for t in &targets {
        m.write_gpu_block(t.id(), &vec![0xEE; bpb]).unwrap();
    }
    std::thread::scope(|s| {
        let onboard = s.spawn(|| m.onboard(sources, targets).unwrap().wait());
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!ticket.is_done());
        drop(hold);
        let outcome = onboard.join().unwrap();
        assert!(outcome.error.is_none());
        assert_eq!(
            outcome.blocks.iter().map(|b| b.id()).collect::<Vec<_>>(),
            target_ids,
            "the onboard's own targets"
        );
        let mut buf = vec![0u8; bpb];
        for (b, id) in outcome.blocks.iter().zip(&ids) {
            m.read_gpu_block(b.id(), &mut buf).unwrap();
            assert!(
                buf == block_bytes(id.sequence_hash, bpb),
                "the onboard read the host block after its offload landed"
            );
        }
    });
    assert_eq!(ticket.wait().copied, 2);
}

#[test]
fn reset_is_refused_while_blocks_are_held_then_clears_every_tier_with_one_event() {
    let m = manager(2, LayerShape::OuterFirst, 6, 6, TransferLimits::default());
    let mut sub = m.subscribe(256);
    let mut resident = HashSet::new();
    let ids = identities(&(0..16).collect::<Vec<u32>>());
    let (gpu, ticket) = m
        .register_gpu_write_through(fill(&m, m.allocate_gpu(4).unwrap(), &ids))
        .unwrap();
    ticket.wait();
    let writing = m.allocate_gpu(1).unwrap();
    assert!(matches!(m.reset(), Err(CoreError::Busy(_))));
    drop(writing);
    assert!(
        matches!(m.reset(), Err(CoreError::Busy(_))),
        "GPU blocks are still held"
    );
    assert_eq!(m.residency().len(), 8, "a refused reset changes nothing");
    drop(gpu);
    m.reset().unwrap();
    assert!(m.residency().is_empty());
    for pool in [m.gpu_pool(), m.host_pool()] {
        assert_eq!(pool.counts().free, 6);
    }
    replay(&mut sub, &mut resident);
    assert!(resident.is_empty());
    let last = sub.drain();
    assert!(last.is_empty());
    assert_eq!(m.events().next_seq(), 3, "stored gpu, stored host, cleared");
}

#[test]
fn options_from_config_split_the_host_tier_across_ranks() {
    let config = kvbm_core::KvbmConfig::from_lookup(
        |name| match name {
            "DYN_KVBM_CPU_CACHE_GB" => Some("0.0016384".into()),
            "DYN_KVBM_MAX_TRANSFER_BATCH_SIZE" => Some("8".into()),
            _ => None,
        },
        u64::MAX,
    )
    .unwrap();
    // 1_638_400 bytes over 2 ranks, host blocks of 8192 bytes (4 KiB stride + 4 KiB header
    // room): 100 blocks each.
    let options =
        kvbm_core::ManagerOptions::from_config(&config, kv(2), 16, LayerShape::BlockFirst, 2);
    assert_eq!(options.host_blocks, 100);
    assert_eq!(options.limits.batch_blocks_max, 8);
    assert_eq!(options.limits.inflight_max, 4);
}

#[test]
fn a_managers_events_go_out_over_zmq_in_vllms_format() {
    use kvbm_events::{SubscriberEvent, WireEvent, WorkerEndpoint, ZmqSubscriber};
    let options = kvbm_core::ManagerOptions {
        kv: kv(2),
        gpu_blocks: 64,
        gpu_layout: LayerShape::OuterFirst.into(),
        host_blocks: 64,
        limits: TransferLimits::default(),
        pin_threads: 1,
        disk: None,
        kv_events: Some(kvbm_events::PublisherConfig::new("tcp://127.0.0.1:*", None)),
    };
    let m =
        kvbm_core::BlockManager::new(device(), options, kvbm_core::GpuMemory::Allocate).unwrap();
    assert!(m
        .host_region()
        .wait_ready(usize::MAX, std::time::Duration::from_secs(60)));
    let endpoint = m.zmq_publisher().unwrap().endpoint().to_owned();
    let (tx, rx) = crossbeam_channel::unbounded();
    let _sub = ZmqSubscriber::start(
        vec![WorkerEndpoint {
            worker_id: 1,
            dp_rank: 0,
            endpoint,
            replay: None,
        }],
        tx,
    )
    .unwrap();
    // Until the subscription is up, events are lost (ZMQ's slow joiner): store warm-up blocks.
    let mut prompt = 0u32;
    let mut store = |m: &kvbm_core::BlockManager| {
        prompt += 1;
        let ids = identities(&(prompt * 1000..prompt * 1000 + 4).collect::<Vec<u32>>());
        let (gpu, ticket) = m
            .register_gpu_write_through(fill(m, m.allocate_gpu(1).unwrap(), &ids))
            .unwrap();
        ticket.wait();
        drop(gpu);
        ids[0].sequence_hash
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        store(&m);
        if rx
            .recv_timeout(std::time::Duration::from_millis(50))
            .is_ok()
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no subscription");
    }
    while rx
        .recv_timeout(std::time::Duration::from_millis(100))
        .is_ok()
    {}
    // Now one block: stored on the GPU, then (after the write-through) on the host.
    let hash = store(&m);
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("events")
        {
            SubscriberEvent::Batch { batch, .. } => seen.extend(batch.events),
            other => panic!("unexpected {other:?}"),
        }
    }
    let stored: Vec<_> = seen
        .iter()
        .map(|e| match e {
            WireEvent::Stored {
                location,
                block_hashes,
                token_ids,
                ..
            } => (location.clone(), block_hashes.clone(), token_ids.len()),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(
        stored,
        vec![
            (kvbm_events::Location::Local(Tier::Gpu), vec![hash.0], 4),
            (kvbm_events::Location::Local(Tier::Host), vec![hash.0], 4),
        ]
    );
}

#[test]
fn a_failed_offload_batch_leaves_the_host_tier_at_once_and_the_rest_is_served() {
    // One block a batch: the first batch's DMA fails (an injected fault), the second lands.
    // Emulated: only it injects faults per stream (on CUDA, KVBM_SIM_FAIL does, per process).
    let m = manager_on(
        Device::emulated(),
        2,
        LayerShape::OuterFirst,
        8,
        4,
        TransferLimits {
            batch_blocks_max: 1,
            ..Default::default()
        },
    );
    let mut sub = m.subscribe(64);
    let ids = identities(&(0..8).collect::<Vec<u32>>());
    let hashes: Vec<_> = ids.iter().map(|i| i.sequence_hash).collect();
    let gpu = m
        .register_gpu(fill(&m, m.allocate_gpu(2).unwrap(), &ids))
        .unwrap();
    m.fail_next_copies(Direction::DeviceToHost, 1).unwrap();
    let outcome = m.offload(&gpu).unwrap().wait();
    assert!(
        matches!(outcome.error, Some(CoreError::TransferFailed(_))),
        "{:?}",
        outcome.error
    );
    assert_eq!(outcome.copied, 1);
    // The failed block is gone by the time the ticket says so; the other is served, exact.
    assert!(!m.host_pool().contains(hashes[0]));
    let held = m
        .host_pool()
        .lookup(hashes[1])
        .expect("the good copy stays");
    let bpb = m.kv().bytes_per_block();
    let mut buf = vec![0u8; bpb];
    m.read_host_block(held.id(), &mut buf).unwrap();
    assert!(buf == block_bytes(hashes[1], bpb));
    drop(held);
    // Announced, then removed: replaying the events gives the residency.
    let mut resident = HashSet::new();
    replay(&mut sub, &mut resident);
    assert_eq!(resident, m.residency());
    assert_eq!(m.metrics_snapshot().transfer_errors, 1);
    // Offloading it again works (the failure left nothing stuck).
    assert_eq!(m.offload(&gpu).unwrap().wait().copied, 1);
    assert!(m.host_pool().contains(hashes[0]));
}

#[test]
fn a_failed_onboard_batch_returns_its_targets_and_registers_the_rest() {
    // Emulated: only it injects faults per stream.
    let m = manager_on(
        Device::emulated(),
        2,
        LayerShape::BlockFirst,
        8,
        4,
        TransferLimits {
            batch_blocks_max: 1,
            ..Default::default()
        },
    );
    let ids = identities(&(0..12).collect::<Vec<u32>>());
    let hashes: Vec<_> = ids.iter().map(|i| i.sequence_hash).collect();
    let (gpu, ticket) = m
        .register_gpu_write_through(fill(&m, m.allocate_gpu(3).unwrap(), &ids))
        .unwrap();
    assert!(ticket.wait().error.is_none());
    drop(gpu);
    m.gpu_pool().evict_idle(usize::MAX);
    let sources = m.match_host(&hashes);
    let targets = m.allocate_gpu(3).unwrap();
    m.fail_next_copies(Direction::HostToDevice, 1).unwrap();
    let outcome = m.onboard(sources, targets).unwrap().wait();
    assert!(outcome.error.is_some());
    assert_eq!((outcome.copied, outcome.blocks.len()), (2, 2));
    let bpb = m.kv().bytes_per_block();
    let mut buf = vec![0u8; bpb];
    for b in &outcome.blocks {
        m.read_gpu_block(b.id(), &mut buf).unwrap();
        assert!(
            buf == block_bytes(b.sequence_hash(), bpb),
            "a registered target holds its bytes"
        );
    }
    assert!(
        !outcome
            .blocks
            .iter()
            .any(|b| b.sequence_hash() == hashes[0]),
        "the failed one is not registered"
    );
    let c = m.gpu_pool().counts();
    assert_eq!((c.registered, c.filling), (2, 0), "{c:?}");
}

#[test]
fn handles_of_another_manager_are_refused() {
    let a = manager(2, LayerShape::OuterFirst, 4, 4, TransferLimits::default());
    let b = manager(2, LayerShape::OuterFirst, 4, 4, TransferLimits::default());
    let ids = identities(&(0..8).collect::<Vec<u32>>());
    let gpu_b = b
        .register_gpu(fill(&b, b.allocate_gpu(2).unwrap(), &ids))
        .unwrap();
    assert!(matches!(
        a.offload(&gpu_b),
        Err(CoreError::InvalidArgument(_))
    ));
    b.offload(&gpu_b).unwrap().wait();
    let host_b = b.match_host(&[ids[0].sequence_hash]);
    let targets_a = a.allocate_gpu(1).unwrap();
    assert!(matches!(
        a.onboard(host_b, targets_a),
        Err(CoreError::InvalidArgument(_))
    ));
    assert_eq!(a.host_pool().counts().registered, 0, "nothing was planned");
}

#[test]
fn read_host_block_waits_for_the_offload_into_it() {
    // Emulated: the test holds a stream, which only it can.
    let m = manager_on(
        Device::emulated(),
        2,
        LayerShape::OuterFirst,
        8,
        4,
        TransferLimits::default(),
    );
    let ids = identities(&(0..8).collect::<Vec<u32>>());
    let gpu = m
        .register_gpu(fill(&m, m.allocate_gpu(2).unwrap(), &ids))
        .unwrap();
    let hold = m.hold_stream(Direction::DeviceToHost).unwrap();
    let ticket = m.offload(&gpu).unwrap();
    let found = m.match_host(&[ids[0].sequence_hash]);
    let bpb = m.kv().bytes_per_block();
    std::thread::scope(|s| {
        let read = s.spawn(|| {
            let mut buf = vec![0u8; bpb];
            m.read_host_block(found[0].id(), &mut buf).unwrap();
            buf
        });
        std::thread::sleep(std::time::Duration::from_millis(30));
        drop(hold);
        assert!(read.join().unwrap() == block_bytes(ids[0].sequence_hash, bpb));
    });
    ticket.wait();
}
