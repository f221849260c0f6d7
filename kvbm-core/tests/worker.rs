//! The split engine end to end in one process: the leader plans each step, the plan crosses as
//! MessagePack bytes, the worker executes it on the emulated device (copy engine, zero-copy
//! disk hand-off) and every byte is checked. Also: malformed plans, ids outside the pools,
//! corrupt disk blocks, failed copies, several asynchronous onboards at once.

use std::sync::Arc;

use kvbm_core::layout::{GpuLayout, PhysicalLayout};
use kvbm_core::{
    BlockLayout, DiskOptions, KvLayout, Leader, Metrics, StepPlan, TokenRun, Worker, WorkerOptions,
};
use kvbm_cuda::{Device, Direction, GpuRegion};
use rand::{RngCore, SeedableRng};

const B: usize = 4;

struct Rig {
    leader: Leader,
    worker: Worker,
    gpu: GpuRegion,
    layout: BlockLayout,
    metrics: Arc<Metrics>,
    _dir: tempfile::TempDir,
}

fn kv() -> KvLayout {
    KvLayout::new(3, 2, B, 16, 2).unwrap()
}

/// The device under test: the one `KVBM_DEVICE` names (`auto`: CUDA when a driver and a GPU
/// exist, else emulated). `scripts/test.sh` runs these tests again with `KVBM_DEVICE=cuda` on
/// the simulated driver.
fn device() -> Device {
    Device::from_env(0).expect("KVBM_DEVICE names a device this machine has")
}

fn rig(layout: &str, gpu_blocks: usize, host_blocks: usize, disk_blocks: usize) -> Rig {
    rig_on(device(), layout, gpu_blocks, host_blocks, disk_blocks)
}

/// [`rig`] on a given device: the emulated one for tests that hold a stream, which only it can.
fn rig_on(
    device: Device,
    layout: &str,
    gpu_blocks: usize,
    host_blocks: usize,
    disk_blocks: usize,
) -> Rig {
    let kv = kv();
    let gpu_layout = GpuLayout::Paged {
        layout: layout.parse::<PhysicalLayout>().unwrap(),
        num_heads: 2,
    };
    let [bytes] = gpu_layout.allocation_bytes(&kv, gpu_blocks)[..] else {
        panic!("one allocation")
    };
    let gpu = device.alloc_gpu(bytes).unwrap();
    let mut noise = vec![0u8; bytes];
    rand::rngs::SmallRng::seed_from_u64(7).fill_bytes(&mut noise);
    gpu.write(0, &noise).unwrap();
    let layout = gpu_layout.place(kv, gpu_blocks, &[gpu.addr()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::default());
    let options = WorkerOptions {
        host_blocks,
        disk: (disk_blocks > 0).then(|| DiskOptions {
            dir: dir.path().join("cache"),
            file_name: "kvbm-rank0.cache".into(),
            blocks: disk_blocks,
            disable_o_direct: false,
            filter_disabled: true,
            queue_depth: 8,
            engine: Default::default(),
            layout_salt: 0,
        }),
        ..Default::default()
    };
    let worker = Worker::new(
        device,
        kv,
        layout.clone(),
        vec![gpu.clone()],
        options,
        metrics.clone(),
    )
    .unwrap();
    assert!(worker.wait_host_ready(std::time::Duration::from_secs(30)));
    Rig {
        leader: Leader::new(B, host_blocks, disk_blocks, true).unwrap(),
        worker,
        gpu,
        layout,
        metrics,
        _dir: dir,
    }
}

impl Rig {
    /// The bytes of GPU block `b`, in canonical order.
    fn block(&self, b: u32) -> Vec<u8> {
        let mut out = vec![0u8; kv().bytes_per_block()];
        self.layout
            .for_each_run(b as usize, |addr, offset, len, _| {
                self.gpu
                    .read(
                        (addr - self.gpu.addr()) as usize,
                        &mut out[offset..offset + len],
                    )
                    .unwrap();
            });
        out
    }

    /// Runs one step: the leader's plan through bytes into the worker, in vLLM 0.33's order.
    fn step(&mut self, preempted: Vec<String>) -> StepPlan {
        let plan = self.leader.take_plan(preempted).unwrap();
        let plan = StepPlan::from_bytes(&plan.to_bytes()).unwrap();
        self.worker.bind(plan.clone());
        self.worker.handle_preemptions();
        self.worker.start_onboards().unwrap();
        for layer in 0..self.worker.num_tensors() {
            self.worker.wait_layer(layer).unwrap();
        }
        self.worker.start_offloads().unwrap();
        self.worker.clear();
        plan
    }
}

fn tokens(first: u32, blocks: usize) -> TokenRun {
    TokenRun {
        tokens: (first..first + (blocks * B) as u32).collect(),
        parent: None,
        lora_name: None,
        salt: None,
    }
}

#[test]
fn offload_then_onboard_moves_every_byte_in_each_layout() {
    for layout in ["BLNHC", "LBNHC", "LHBNC", "BHLNC"] {
        let mut r = rig(layout, 16, 8, 0);
        let before: Vec<Vec<u8>> = (0..3).map(|b| r.block(b)).collect();
        let done = r
            .leader
            .plan_offloads(vec![("a".into(), tokens(0, 3), vec![0, 1, 2])])
            .unwrap();
        assert_eq!(done[0].1, 3);
        let hashes = done[0].0.clone();
        let plan = r.step(vec![]);
        assert_eq!(plan.offloads[0].pairs.len(), 3);
        r.worker.wait_offloads();
        // Finished after its offloads: reported in finished_sending.
        let report = r.worker.report(&["a".to_string()]);
        assert_eq!(
            report.finished_offloading,
            vec!["a".to_string()],
            "{layout}"
        );
        // Another request with the same prefix gets it onboarded into its own GPU blocks.
        let got = r
            .leader
            .plan_onboard("b", &hashes, &[9, 10, 11], false)
            .unwrap();
        assert_eq!(got, 3);
        r.step(vec![]);
        for (i, g) in [9u32, 10, 11].iter().enumerate() {
            assert_eq!(r.block(*g), before[i], "{layout}: block {i}");
        }
        assert!(r.worker.take_failed().is_empty());
        let m = r.metrics.snapshot();
        assert_eq!((m.offload_blocks_d2h, m.onboard_blocks_h2d), (3, 3));
        assert_eq!(m.bytes_d2h, 3 * kv().bytes_per_block() as u64);
    }
}

#[test]
fn disk_round_trip_is_zero_copy_and_byte_exact_and_async_onboards_overlap() {
    let mut r = rig("BLNHC", 32, 6, 16);
    let before: Vec<Vec<u8>> = (0..4).map(|b| r.block(b)).collect();
    let done = r
        .leader
        .plan_offloads(vec![("a".into(), tokens(0, 4), vec![0, 1, 2, 3])])
        .unwrap();
    let hashes = done[0].0.clone();
    // With the filter off every host block is admitted to disk at once.
    let plan = r.step(vec![]);
    assert_eq!(plan.disk_writes.len(), 4);
    r.worker.wait_disk();
    assert_eq!(r.metrics.snapshot().offload_blocks_h2d, 4);
    // Push the blocks out of the host tier with other blocks (once their holds ended), so the
    // onboard comes from disk.
    for _ in 0..3 {
        r.step(vec![]);
    }
    r.leader
        .plan_offloads(vec![("x".into(), tokens(1000, 6), (20..26).collect())])
        .unwrap();
    r.step(vec![]);
    r.worker.wait_offloads();
    r.worker.wait_disk();
    for _ in 0..3 {
        r.step(vec![]);
    }
    let (on_host, on_disk) = r.leader.count_prefix_tiers(&hashes);
    assert_eq!(on_host, 0);
    assert!(on_disk >= 2, "{on_disk} blocks left on disk");
    // Two asynchronous onboards of the same prefix into different GPU blocks, at once.
    let n = on_disk.min(3);
    r.leader
        .plan_onboard("b", &hashes[..n], &[10, 11, 12][..n], true)
        .unwrap();
    r.step(vec![]);
    r.worker.wait_async();
    let report = r.worker.report(&[]);
    assert_eq!(report.finished_onboarding, vec!["b".to_string()]);
    assert!(report.failed_blocks.is_empty());
    for (i, want) in before.iter().enumerate().take(n) {
        assert_eq!(&r.block(10 + i as u32), want, "block {i} from disk");
    }
    assert!(r.metrics.snapshot().onboard_blocks_d2d >= n as u64);
    let m = r.metrics.snapshot();
    assert_eq!((m.disk_read_blocks, m.disk_read_misses), (n as u64, 0));
}

#[test]
fn a_corrupt_disk_block_is_a_failed_block_never_data() {
    let mut r = rig("LBNHC", 16, 4, 8);
    let done = r
        .leader
        .plan_offloads(vec![("a".into(), tokens(0, 2), vec![0, 1])])
        .unwrap();
    let hashes = done[0].0.clone();
    r.step(vec![]);
    r.worker.wait_offloads();
    r.worker.wait_disk();
    // Evict the host copies (once their holds ended), then plan the onboard from disk.
    for _ in 0..3 {
        r.step(vec![]);
    }
    r.leader
        .plan_offloads(vec![("x".into(), tokens(500, 4), vec![4, 5, 6, 7])])
        .unwrap();
    for _ in 0..4 {
        r.step(vec![]);
    }
    r.worker.wait_offloads();
    r.worker.wait_disk();
    assert_eq!(r.leader.count_prefix_tiers(&hashes), (0, 2));
    let before_target = r.block(12);
    let before_source = r.block(1);
    let got = r
        .leader
        .plan_onboard("b", &hashes, &[12, 13], false)
        .unwrap();
    assert_eq!(got, 2);
    let plan = r.leader.take_plan(vec![]).unwrap();
    assert_eq!(plan.disk_reads.len(), 2);
    // The cache file: a 4 KiB superblock, then slots of (4 KiB header + payload area). Flip a
    // payload byte of the slot block 0 is read from.
    let path = r._dir.path().join("cache").join("kvbm-rank0.cache");
    let slots = r.worker.disk_blocks() as u64;
    let slot_bytes = (std::fs::metadata(&path).unwrap().len() - 4096) / slots;
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let at = 4096 + u64::from(plan.disk_reads[0].disk) * slot_bytes + 4096 + 123;
        let mut byte = [0u8];
        f.read_exact_at(&mut byte, at).unwrap();
        f.write_all_at(&[byte[0] ^ 0xFF], at).unwrap();
    }
    r.worker.bind(plan);
    r.worker.start_onboards().unwrap();
    r.worker.wait_onboards().unwrap();
    assert_eq!(
        r.worker.take_failed(),
        vec![12],
        "exactly the corrupt block fails"
    );
    assert_eq!(
        r.block(12),
        before_target,
        "nothing copied into the failed block"
    );
    assert_eq!(r.block(13), before_source, "the other block is served");
}

#[test]
fn malformed_plans_and_ids_outside_the_pools_are_refused_and_lose_nothing() {
    let mut r = rig("BLNHC", 8, 4, 0);
    assert!(StepPlan::from_bytes(b"\x93\x01").is_err());
    let before = r.block(1);
    let bad = StepPlan {
        offloads: vec![kvbm_core::Offload {
            request: "a".into(),
            pairs: vec![(1, 4)],
        }],
        ..Default::default()
    };
    r.worker.bind(bad);
    assert!(r.worker.start_offloads().is_err());
    let bad = StepPlan {
        onboards: vec![kvbm_core::Onboard {
            request: "a".into(),
            pairs: vec![(0, 8)],
        }],
        ..Default::default()
    };
    r.worker.bind(bad);
    assert!(r.worker.start_onboards().is_err());
    let disk = StepPlan {
        disk_writes: vec![kvbm_core::DiskWrite {
            host: 0,
            disk: 0,
            key: 1,
            identity: vec![],
        }],
        ..Default::default()
    };
    r.worker.bind(disk);
    assert!(r.worker.start_offloads().is_err(), "no disk tier");
    assert_eq!(r.block(1), before);
    assert_eq!(r.worker.stats().offloads_in_flight, 0);
}

#[test]
fn preemption_waits_for_the_offloads_reading_the_preempted_blocks() {
    // Emulated: the test holds a stream, which only it can.
    let mut r = rig_on(Device::emulated(), "BLNHC", 8, 4, 0);
    let before = r.block(2);
    r.leader
        .plan_offloads(vec![("p".into(), tokens(0, 1), vec![2])])
        .unwrap();
    let hold = r.worker.hold_stream(Direction::DeviceToHost).unwrap();
    r.step(vec![]);
    assert_eq!(r.worker.stats().offloads_in_flight, 1);
    drop(hold);
    // The next step preempts "p": handle_preemptions returns only once its offload is done, so
    // vLLM may overwrite GPU block 2 right after.
    let plan = r.leader.take_plan(vec!["p".into()]).unwrap();
    r.worker.bind(plan);
    assert_eq!(r.worker.handle_preemptions(), 1);
    assert_eq!(r.worker.stats().offloads_in_flight, 0);
    r.gpu.write(0, &[0u8; 64]).unwrap(); // vLLM reuses the blocks
    let hashes = Leader::hash_runs(B, &[tokens(0, 1)]).unwrap().remove(0);
    r.worker.clear();
    r.leader.plan_onboard("q", &hashes, &[5], false).unwrap();
    r.step(vec![]);
    assert_eq!(r.block(5), before);
}

#[test]
fn asynchronous_onboards_run_side_by_side() {
    // Two disk onboards; the host-to-device stream is held, so the first one's copy cannot
    // finish. With one loader the second one's disk reads would wait behind it; with several,
    // they run meanwhile.
    // Emulated: the test holds a stream, which only it can.
    let mut r = rig_on(Device::emulated(), "BLNHC", 32, 8, 16);
    let mut hashes = Vec::new();
    for (i, first) in [0u32, 1000].into_iter().enumerate() {
        let gpu: Vec<u32> = (0..2).map(|b| i as u32 * 2 + b).collect();
        let done = r
            .leader
            .plan_offloads(vec![(format!("w{i}"), tokens(first, 2), gpu)])
            .unwrap();
        hashes.push(done[0].0.clone());
    }
    r.step(vec![]);
    r.worker.wait_offloads();
    r.worker.wait_disk();
    // Evict the host copies (once their holds ended).
    for _ in 0..3 {
        r.step(vec![]);
    }
    r.leader
        .plan_offloads(vec![("x".into(), tokens(5000, 8), (16..24).collect())])
        .unwrap();
    for _ in 0..3 {
        r.step(vec![]);
    }
    r.worker.wait_offloads();
    r.worker.wait_disk();
    assert_eq!(r.leader.count_prefix_tiers(&hashes[0]), (0, 2));
    let reads_before = r.metrics.snapshot().disk_read_blocks;
    let hold = r.worker.hold_stream(Direction::HostToDevice).unwrap();
    r.leader
        .plan_onboard("a", &hashes[0], &[8, 9], true)
        .unwrap();
    r.leader
        .plan_onboard("b", &hashes[1], &[10, 11], true)
        .unwrap();
    let plan = r.leader.take_plan(vec![]).unwrap();
    r.worker.bind(plan);
    r.worker.start_onboards().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while r.metrics.snapshot().disk_read_blocks < reads_before + 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "the second onboard's disk reads waited for the first onboard's copy"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(r.worker.report(&[]).finished_onboarding.is_empty());
    drop(hold);
    r.worker.wait_async();
    let mut done = r.worker.report(&[]).finished_onboarding;
    done.sort();
    assert_eq!(done, vec!["a".to_string(), "b".to_string()]);
}

#[test]
fn a_request_is_finished_offloading_only_when_no_offload_of_it_is_in_flight() {
    // Emulated: the test holds a stream, which only it can.
    let mut r = rig_on(Device::emulated(), "BLNHC", 16, 8, 0);
    let (p, q) = ("p".to_string(), "q".to_string());
    // One job for both requests; a preemption of p settles it (and so q's part of it).
    r.worker
        .offload(&[(0, 0), (1, 1)], &[p.clone(), q.clone()])
        .unwrap();
    assert_eq!(r.worker.wait_offloads_of(std::slice::from_ref(&p)), 1);
    // q's next offload is still queued when vLLM says q finished.
    let hold = r.worker.hold_stream(Direction::DeviceToHost).unwrap();
    r.worker
        .offload(&[(2, 2)], std::slice::from_ref(&q))
        .unwrap();
    let report = r.worker.report(std::slice::from_ref(&q));
    assert!(
        report.finished_offloading.is_empty(),
        "q reported done while its offload still reads its GPU block"
    );
    drop(hold);
    r.worker.wait_offloads();
    assert_eq!(r.worker.report(&[]).finished_offloading, vec![q]);
}

#[test]
fn a_failed_copy_fails_exactly_its_blocks_and_is_never_served() {
    // The worker is handed only the first half of the engine's KV cache (BLNHC: blocks 0..4),
    // so every copy touching a block of the second half is refused by the stream, as a real DMA
    // fault fails its batch; one block a batch here, so exactly those blocks fail.
    let device = device();
    let kv = kv();
    let gpu_layout = GpuLayout::Paged {
        layout: "BLNHC".parse::<PhysicalLayout>().unwrap(),
        num_heads: 2,
    };
    let blocks = 8;
    let [bytes] = gpu_layout.allocation_bytes(&kv, blocks)[..] else {
        panic!("one allocation")
    };
    let gpu = device.alloc_gpu(bytes).unwrap();
    let layout = gpu_layout.place(kv, blocks, &[gpu.addr()]).unwrap();
    #[allow(unsafe_code)]
    // SAFETY: the span is the first half of `gpu`, which outlives the worker (dropped last).
    let half = unsafe { Worker::register_spans(&device, &[(gpu.addr(), bytes / 2)], 0) }.unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut worker = Worker::new(
        device,
        kv,
        layout,
        half,
        WorkerOptions {
            host_blocks: 4,
            limits: kvbm_core::TransferLimits {
                batch_blocks_max: 1,
                ..Default::default()
            },
            ..Default::default()
        },
        metrics.clone(),
    )
    .unwrap();
    assert!(worker.wait_host_ready(std::time::Duration::from_secs(30)));
    let mut noise = vec![0u8; bytes];
    rand::rngs::SmallRng::seed_from_u64(3).fill_bytes(&mut noise);
    gpu.write(0, &noise).unwrap();
    let block_bytes = bytes / blocks;
    let block = |b: usize| {
        let mut out = vec![0u8; block_bytes];
        gpu.read(b * block_bytes, &mut out).unwrap();
        out
    };
    // Block 1 offloads; block 6's offload fails: its host block is bad and reported.
    worker
        .offload(&[(1, 0), (6, 1)], &["r".to_string()])
        .unwrap();
    worker.wait_offloads();
    let report = worker.report(&["r".to_string()]);
    assert_eq!(report.finished_offloading, vec!["r".to_string()]);
    assert_eq!(report.bad_host_blocks, vec![1]);
    // Onboards: host 0 -> GPU 2 works; host 0 -> GPU 7 fails its copy; host 1 (bad) -> GPU 3 is
    // never copied. Exactly GPU 3 and 7 are reported, and GPU 3 keeps what it held.
    let (one, three) = (block(1), block(3));
    worker.onboard(&[(0, 2), (0, 7), (1, 3)]).unwrap();
    worker.wait_onboards().unwrap();
    assert_eq!(worker.take_failed(), vec![3, 7]);
    assert_eq!(block(2), one, "the good copy is served");
    assert_eq!(block(3), three, "nothing is copied from a bad host block");
    assert_eq!(metrics.snapshot().transfer_errors, 2);
    drop(worker);
}

#[test]
fn the_host_pool_is_pinned_in_whole_blocks() {
    // Qwen3-0.6B blocks (1.75 MiB, a host stride that does not divide 256 MiB): a chunk of the
    // pool pinned (CUDA-registered) at once holds whole blocks, so no block straddles two.
    let device = device();
    let kv = KvLayout::new(28, 2, 16, 1024, 2).unwrap();
    let gpu_layout = GpuLayout::Paged {
        layout: "BLNHC".parse::<PhysicalLayout>().unwrap(),
        num_heads: 8,
    };
    let [bytes] = gpu_layout.allocation_bytes(&kv, 2)[..] else {
        panic!("one allocation")
    };
    let gpu = device.alloc_gpu(bytes).unwrap();
    let layout = gpu_layout.place(kv, 2, &[gpu.addr()]).unwrap();
    let worker = Worker::new(
        device,
        kv,
        layout,
        vec![gpu],
        WorkerOptions {
            host_blocks: 2,
            ..Default::default()
        },
        Arc::new(Metrics::default()),
    )
    .unwrap();
    let stride = kv.host_stride_bytes();
    assert_ne!(
        (256 << 20) % stride,
        0,
        "the test needs a stride that does not divide 256 MiB"
    );
    assert_eq!(worker.host_region().chunk_bytes() % stride, 0);
}

/// Runs the leader's next plan (one offload) with its `fence_offloads` set to `fence`, and
/// `fence_offloads` on another thread while that offload is held on the emulated device's copy
/// stream. Returns whether the fence returned before the hold was released (as far as 300 ms
/// tell), and, seen by the fencing thread right at its return: the fence, the offloads still in
/// flight and whether the host block already held GPU block `gpu`'s bytes `before`.
fn fence_while_held(
    r: &mut Rig,
    fence: bool,
    before: &[u8],
) -> (bool, kvbm_core::worker::OffloadFence, usize, bool) {
    let mut plan = r.leader.take_plan(vec![]).unwrap();
    assert_eq!(plan.offloads.len(), 1);
    let host = plan.offloads[0].pairs[0].1;
    plan.fence_offloads = fence;
    let hold = r.worker.hold_stream(Direction::DeviceToHost).unwrap();
    r.worker.bind(plan);
    r.worker.start_onboards().unwrap();
    r.worker.start_offloads().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = &mut r.worker;
    let (early, outcome) = std::thread::scope(|s| {
        s.spawn(move || {
            let fenced = worker.fence_offloads(None);
            let in_flight = worker.stats().offloads_in_flight;
            // The host block's memory as it is (read_host_block would wait for the offload).
            let mut copy = vec![0u8; before.len()];
            let region = worker.host_region();
            let start = worker.host_layout().block_start(host as usize) - region.addr();
            region.read(start as usize, &mut copy).unwrap();
            tx.send((fenced, in_flight, copy == before)).unwrap();
        });
        let early = rx.recv_timeout(std::time::Duration::from_millis(300));
        drop(hold);
        let outcome = match &early {
            Ok(outcome) => *outcome,
            Err(_) => rx.recv().unwrap(),
        };
        (early.is_ok(), outcome)
    });
    r.worker.wait_offloads();
    r.worker.clear();
    (early, outcome.0, outcome.1, outcome.2)
}

#[test]
fn a_fenced_step_returns_from_wait_for_save_only_after_its_offloads() {
    // vLLM frees sliding-window and Mamba blocks mid-request (`remove_skipped_blocks` in
    // `allocate_slots`) and may overwrite them in the next step: a step whose plan asks for the
    // fence must not let the engine go on before its offloads read them. The emulated device
    // has no engine stream: the host waits.
    use kvbm_core::worker::OffloadFence;
    let mut r = rig_on(Device::emulated(), "BLNHC", 8, 4, 0);
    let before = r.block(2);
    r.leader
        .plan_offloads(vec![("p".into(), tokens(0, 1), vec![2])])
        .unwrap();
    let (early, fence, in_flight, copied) = fence_while_held(&mut r, true, &before);
    assert!(!early, "the fence returned while its offload was held");
    assert_eq!(fence, OffloadFence::Host);
    assert_eq!(
        in_flight, 0,
        "the fence returned with the offload in flight"
    );
    assert!(copied, "the fence returned before the block was copied");

    // Without the fence the step returns at once, its offload still held.
    let before = r.block(3);
    r.leader
        .plan_offloads(vec![("q".into(), tokens(100, 1), vec![3])])
        .unwrap();
    let (early, fence, in_flight, copied) = fence_while_held(&mut r, false, &before);
    assert!(early, "an unfenced step waited for its offloads");
    assert_eq!(fence, OffloadFence::None);
    assert_eq!(in_flight, 1);
    assert!(!copied);
}

#[test]
fn a_fenced_step_on_cuda_makes_the_engines_stream_wait_and_the_host_not() {
    // On the device under test (the simulated driver under `KVBM_DEVICE=cuda`): with vLLM's
    // stream known, the fence is a wait of that stream on the device; without, the host waits.
    use kvbm_core::worker::OffloadFence;
    let mut r = rig("LBNHC", 8, 4, 0);
    let cuda = r.worker.device().kind() == kvbm_core::DeviceKind::Cuda;
    for (i, foreign) in [Some(0u64), None].into_iter().enumerate() {
        let before = r.block(2 + i as u32);
        r.leader
            .plan_offloads(vec![(
                format!("r{i}"),
                tokens(10 * i as u32, 1),
                vec![2 + i as u32],
            )])
            .unwrap();
        let mut plan = r.leader.take_plan(vec![]).unwrap();
        let host = plan.offloads[0].pairs[0].1;
        plan.fence_offloads = true;
        r.worker.bind(plan);
        r.worker.start_onboards().unwrap();
        r.worker.start_offloads().unwrap();
        let fence = r.worker.fence_offloads(foreign);
        let expected = if cuda && foreign.is_some() {
            OffloadFence::Device
        } else {
            OffloadFence::Host
        };
        assert_eq!(fence, expected);
        let mut copy = vec![0u8; before.len()];
        r.worker.read_host_block(host, &mut copy).unwrap();
        assert_eq!(copy, before);
        r.worker.clear();
    }
}
