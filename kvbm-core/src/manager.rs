//! The block manager: one [`Leader`] and one [`Worker`] in one process, with a GPU tier of its own
//! (the pool an engine would keep). The leader decides (host and disk block ids, the registry,
//! holds, admission, events), the worker moves the bytes (copy streams, the pinned host pool, the
//! disk file), exactly as they do for the vLLM connector; this type only hands one to the other
//! and turns block handles into ids and back.
//!
//! Invariants:
//! - Every tier shares one event publisher, so one subscriber sees every tier's changes in order.
//! - An offloaded block is findable (and announced) in the host tier as soon as its copy is
//!   queued, as with the connector: the worker orders every copy and disk I/O touching a host
//!   block after the offload into it, and a failed offload's block leaves the tier (never
//!   served). An onboarded GPU block is registered only once its copy completed.
//! - Planning and submitting happen under one lock (leader, then worker). Matching takes no lock
//!   and may find a host block whose copy is not queued yet; everything that reads a host
//!   block's bytes (onboard, disk write, `read_host_block`) takes the lock, and so runs after
//!   the queueing, and the worker orders it after the copy.
//! - An offload's GPU sources and host targets, and an onboard's host sources, stay held until
//!   their batch completed; a failed offload batch takes its host blocks out of the tier in its
//!   callback (never served, never written to disk). No callback takes the lock.
//! - The lock is held across waits for copy room, for pinning and for disk I/O the step needs:
//!   a slow disk slows every caller, it never deadlocks them (no callback or disk thread takes
//!   it).
//! - Handles are checked to belong to this manager's pools.
//! - The host pool is pinned in the background in chunks of whole blocks; a copy waits for the
//!   blocks it touches.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kvbm_cuda::{Device, DeviceKind, GpuRegion, HostRegion, HostRegionOptions};
use kvbm_disk::DiskStore;
use kvbm_events::{EventPublisher, EventSubscriber, SequenceHash, Tier};
use parking_lot::Mutex;

use crate::config::KvbmConfig;
use crate::copy::{BatchDone, OnBatch};
use crate::disk::DiskOptions;
use crate::layout::{BlockLayout, GpuLayout, KvLayout};
use crate::leader::{Leader, LeaderOptions};
use crate::metrics::{add, Metrics, MetricsSnapshot};
use crate::pool::{match_across, BlockId, BlockPool, CompleteBlock, FillingBlock, RegisteredBlock};
use crate::transfer::{BatchLatency, TicketShared, TransferLimits, TransferTicket};
use crate::worker::{Worker, WorkerOptions};
use crate::CoreError;

/// Target size of one pinning chunk; rounded to whole host blocks.
pub const HOST_PIN_CHUNK_BYTES: usize = 256 << 20;

/// How a host pool of blocks `stride` bytes apart is pinned: in chunks of whole blocks (about
/// [`HOST_PIN_CHUNK_BYTES`]), so that no block straddles two pinned (CUDA-registered) chunks and
/// every block moves as one DMA, on `pin_threads` threads, with huge pages.
pub fn host_pin_options(stride: usize, pin_threads: usize) -> HostRegionOptions {
    HostRegionOptions {
        chunk_bytes: HOST_PIN_CHUNK_BYTES.div_ceil(stride).max(1) * stride,
        pin_threads: pin_threads.max(1),
        huge_pages: true,
    }
}

/// Where the GPU tier's memory comes from.
#[derive(Debug)]
pub enum GpuMemory {
    /// Allocate on the device as the GPU layout says (one tensor per layer, or one buffer).
    Allocate,
    /// The engine's memory, as many regions as the GPU layout allocates
    /// ([`GpuLayout::allocation_bytes`]), each at least that large.
    External(Vec<GpuRegion>),
}

/// What a block manager manages.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// The KV shape of one block.
    pub kv: KvLayout,
    /// Blocks in the GPU tier.
    pub gpu_blocks: usize,
    /// How the GPU memory is laid out.
    pub gpu_layout: GpuLayout,
    /// Blocks in the host tier (at least 1).
    pub host_blocks: usize,
    /// Transfer batching and concurrency.
    pub limits: TransferLimits,
    /// Threads pinning host memory.
    pub pin_threads: usize,
    /// The disk tier, if any.
    pub disk: Option<DiskOptions>,
    /// Publish every event over ZMQ (vLLM's wire format), if set.
    pub kv_events: Option<kvbm_events::PublisherConfig>,
}

impl ManagerOptions {
    /// Options for `kv` and `gpu_blocks` with the host tier and limits taken from `config`
    /// (sizes split across `world_size` tensor-parallel ranks).
    pub fn from_config(
        config: &KvbmConfig,
        kv: KvLayout,
        gpu_blocks: usize,
        gpu_layout: impl Into<GpuLayout>,
        world_size: usize,
    ) -> Self {
        Self {
            kv,
            gpu_blocks,
            gpu_layout: gpu_layout.into(),
            host_blocks: config.host.blocks(kv.host_stride_bytes(), world_size),
            limits: TransferLimits {
                batch_blocks_max: config.transfer_batch_blocks_max.get(),
                inflight_max: config.transfers_inflight_max.get(),
                copy: config.copy,
                ..TransferLimits::default()
            },
            pin_threads: HostRegionOptions::default().pin_threads,
            disk: None,
            kv_events: config.kv_events_endpoint.clone().map(|endpoint| {
                kvbm_events::PublisherConfig::new(
                    endpoint,
                    config.kv_events_replay_endpoint.clone(),
                )
            }),
        }
    }

    /// Adds the disk tier from `config` (when it has any blocks), with one cache file per rank.
    pub fn with_disk_from_config(
        mut self,
        config: &KvbmConfig,
        world_size: usize,
        rank: usize,
    ) -> Self {
        let slot_bytes = crate::disk::slot_bytes(&self.kv);
        let blocks = config.disk.blocks(slot_bytes, world_size);
        self.disk = (blocks > 0).then(|| DiskOptions {
            dir: config.disk_dir.clone(),
            file_name: format!("kvbm-rank{rank}.cache"),
            blocks,
            disable_o_direct: config.disk_disable_o_direct,
            filter_disabled: config.disk_offload_filter_disabled,
            queue_depth: 16,
            engine: config.disk_engine,
            layout_salt: 0,
        });
        self
    }
}

/// Blocks matched for a request, fastest tier first per block, contiguous from the first hash.
#[derive(Debug, Default)]
pub struct PrefixMatch {
    /// The matched blocks, held.
    pub blocks: Vec<RegisteredBlock>,
}

impl PrefixMatch {
    /// Matched blocks in `tier`.
    pub fn count_in(&self, tier: Tier) -> usize {
        self.blocks.iter().filter(|b| b.tier() == tier).count()
    }
}

/// The two halves, behind one lock (leader first, then worker).
struct Halves {
    leader: Leader,
    worker: Worker,
}

impl Halves {
    /// Takes in what the worker learnt since: offloads settled, disk blocks gone bad (which
    /// leave their tier). Host blocks whose offload failed left already, by handle, in their
    /// batch's callback: their ids may hold other blocks by now, so the worker's host reports
    /// are not applied again.
    fn settle(&mut self) {
        self.worker.poll_offloads();
        let (_host, disk) = self.worker.take_bad();
        if !disk.is_empty() {
            self.leader.discard(&[], &disk);
        }
    }

    /// Hands the disk writes the leader admitted to the worker (each after the offload into its
    /// host block); a write that cannot be queued leaves the disk tier at once.
    fn queue_disk_writes(&mut self) -> Result<(), CoreError> {
        let writes = self.leader.take_disk_writes()?;
        if writes.is_empty() {
            return Ok(());
        }
        let disk: Vec<u32> = writes.iter().map(|w| w.disk).collect();
        self.worker.disk_write(writes).inspect_err(|_| {
            self.leader.discard(&[], &disk);
        })
    }
}

/// The block manager over the GPU, host and (optionally) disk tiers.
pub struct BlockManager {
    device: Device,
    kv: KvLayout,
    events: EventPublisher,
    metrics: Arc<Metrics>,
    gpu: BlockPool,
    /// The leader's pools, shared for matching (pools are thread-safe).
    host: BlockPool,
    disk: Option<BlockPool>,
    gpu_layout: BlockLayout,
    host_region: HostRegion,
    limits: TransferLimits,
    halves: Mutex<Halves>,
    /// Declared last: it drops last, after the tiers' final events.
    zmq: Option<kvbm_events::ZmqPublisher>,
}

impl std::fmt::Debug for BlockManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockManager")
            .field("device", &self.device.kind())
            .field("kv", &self.kv)
            .field("gpu", &self.gpu.counts())
            .field("host", &self.host.counts())
            .finish()
    }
}

impl BlockManager {
    /// Builds the tiers on `device`: GPU memory allocated or registered, host memory mapped and
    /// pinned in the background (copies wait for the blocks they touch), and the disk tier if
    /// configured (announcing what it recovered).
    pub fn new(
        device: Device,
        options: ManagerOptions,
        gpu_memory: GpuMemory,
    ) -> Result<Self, CoreError> {
        Self::with_publisher(device, options, gpu_memory, EventPublisher::new())
    }

    /// As [`Self::new`], publishing through `events`: subscribe first to see every event,
    /// including the `BlockStored{tier: Disk}` announcements of blocks a restart recovered.
    pub fn with_publisher(
        device: Device,
        options: ManagerOptions,
        gpu_memory: GpuMemory,
        events: EventPublisher,
    ) -> Result<Self, CoreError> {
        let kv = options.kv;
        if options.gpu_blocks == 0 || options.host_blocks == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "both tiers need blocks: gpu {} host {}",
                options.gpu_blocks, options.host_blocks
            )));
        }
        let metrics = Arc::new(Metrics::default());
        // Subscribe the ZMQ publisher before any tier exists, so it sees every event (the disk
        // tier announces what it recovered while it opens).
        let zmq = match &options.kv_events {
            None => None,
            Some(config) => Some(
                kvbm_events::ZmqPublisher::start(&events, config.clone())
                    .map_err(|e| CoreError::InvalidArgument(format!("KV events over ZMQ: {e}")))?,
            ),
        };

        let sizes = options.gpu_layout.allocation_bytes(&kv, options.gpu_blocks);
        let gpu_regions = match gpu_memory {
            GpuMemory::Allocate => sizes
                .iter()
                .map(|&bytes| device.alloc_gpu(bytes))
                .collect::<Result<Vec<_>, _>>()?,
            GpuMemory::External(regions) => {
                if regions.len() != sizes.len()
                    || regions.iter().zip(&sizes).any(|(r, &s)| r.len() < s)
                {
                    return Err(CoreError::InvalidLayout(format!(
                        "{} GPU regions for a {} layout of {} allocations of {} bytes",
                        regions.len(),
                        options.gpu_layout.name(),
                        sizes.len(),
                        sizes[0]
                    )));
                }
                regions
            }
        };
        let addrs: Vec<u64> = gpu_regions.iter().map(GpuRegion::addr).collect();
        let gpu_layout = options.gpu_layout.place(kv, options.gpu_blocks, &addrs)?;
        let gpu = BlockPool::new(
            Tier::Gpu,
            options.gpu_blocks,
            kv.block_size_tokens,
            Some(events.clone()),
        );
        let disk_blocks = options.disk.as_ref().map_or(0, |d| d.blocks);
        let mut worker = Worker::new(
            device.clone(),
            kv,
            gpu_layout.clone(),
            gpu_regions,
            WorkerOptions {
                host_blocks: options.host_blocks,
                limits: options.limits,
                disk: options.disk.clone(),
                pin_threads: options.pin_threads,
                ..WorkerOptions::default()
            },
            metrics.clone(),
        )?;
        // The worker is in this process and orders its copies itself: nothing is held for
        // steps (see the leader's invariants).
        let mut leader = Leader::with_publisher(
            LeaderOptions {
                block_size: kv.block_size_tokens,
                host_blocks: options.host_blocks,
                disk_blocks,
                disk_filter_disabled: options.disk.as_ref().is_some_and(|d| d.filter_disabled),
                hold_steps: 0,
            },
            events.clone(),
        )?
        .with_metrics(metrics.clone());
        let recovered = worker.take_recovered_disk();
        if !recovered.is_empty() {
            let adopted = leader.adopt_disk(recovered)?;
            tracing::info!(blocks = adopted, "disk tier recovered");
        }
        let host = leader.host_pool().clone();
        let disk = leader.disk_pool().cloned();
        let host_region = worker.host_region().clone();
        Ok(Self {
            device,
            kv,
            events,
            metrics,
            gpu,
            host,
            disk,
            gpu_layout,
            host_region,
            limits: options.limits,
            halves: Mutex::new(Halves { leader, worker }),
            zmq,
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// "cuda" or "emulated".
    pub fn device_kind(&self) -> DeviceKind {
        self.device.kind()
    }

    /// The KV shape.
    pub fn kv(&self) -> &KvLayout {
        &self.kv
    }

    /// Where the GPU tier's blocks live (its runs per block are the copies one block takes).
    pub fn gpu_layout(&self) -> &BlockLayout {
        &self.gpu_layout
    }

    /// The event publisher of every tier.
    pub fn events(&self) -> &EventPublisher {
        &self.events
    }

    /// A subscription to every tier's events from now on.
    pub fn subscribe(&self, capacity_events: usize) -> EventSubscriber {
        self.events.subscribe(capacity_events)
    }

    /// The counters (the leader's and the worker's).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The counters now, with the host tier's pinned bytes.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let mut snapshot = self.metrics.snapshot();
        snapshot.host_pinned_bytes_ready = self.host_region.ready_bytes() as u64;
        snapshot
    }

    /// The GPU tier's pool.
    pub fn gpu_pool(&self) -> &BlockPool {
        &self.gpu
    }

    /// The host tier's pool (the leader's).
    pub fn host_pool(&self) -> &BlockPool {
        &self.host
    }

    /// The disk tier's pool (the leader's), if any.
    pub fn disk_pool(&self) -> Option<&BlockPool> {
        self.disk.as_ref()
    }

    /// Runs `f` on the disk store (its stats, engine and file), if any.
    pub fn with_disk_store<T>(&self, f: impl FnOnce(&DiskStore) -> T) -> Option<T> {
        self.halves.lock().worker.disk_store().map(f)
    }

    /// Waits up to `timeout` for the host pool's registration for fixed-buffer disk I/O (done
    /// in the background once the pool is pinned); `Some(true)` when registered, `Some(false)`
    /// when it failed, `None` when not decided yet or without a disk tier.
    pub fn wait_disk_registered(&self, timeout: Duration) -> Option<bool> {
        self.halves.lock().worker.wait_disk_registered(timeout)
    }

    /// The ZMQ publisher of this manager's events, if configured.
    pub fn zmq_publisher(&self) -> Option<&kvbm_events::ZmqPublisher> {
        self.zmq.as_ref()
    }

    /// The host tier's memory.
    pub fn host_region(&self) -> &HostRegion {
        &self.host_region
    }

    /// The copy limits.
    pub fn limits(&self) -> TransferLimits {
        self.limits
    }

    /// Host blocks usable now (all of them: a copy waits for its blocks' memory to be pinned).
    pub fn refresh_host_available(&self) -> usize {
        self.host.available()
    }

    /// Takes `count` GPU blocks for writing (evicting idle ones if needed).
    pub fn allocate_gpu(&self, count: usize) -> Result<Vec<FillingBlock>, CoreError> {
        self.gpu.allocate(count)
    }

    /// Registers complete GPU blocks (publishing `BlockStored` for tier Gpu).
    pub fn register_gpu(
        &self,
        blocks: Vec<CompleteBlock>,
    ) -> Result<Vec<RegisteredBlock>, CoreError> {
        self.gpu
            .register_all(blocks)
            .map_err(|r| CoreError::InvalidArgument(r.reason.into()))
    }

    /// Registers complete GPU blocks and offloads them to the host tier (write-through).
    pub fn register_gpu_write_through(
        &self,
        blocks: Vec<CompleteBlock>,
    ) -> Result<(Vec<RegisteredBlock>, TransferTicket), CoreError> {
        let registered = self.register_gpu(blocks)?;
        let ticket = self.offload(&registered)?;
        Ok((registered, ticket))
    }

    /// Copies registered GPU blocks to the host tier: the leader places them (blocks the host
    /// tier holds are no-ops and count as sightings for disk admission; blocks without room are
    /// skipped and counted), the worker copies them, and the blocks admitted to disk are written
    /// there after their copy.
    pub fn offload(&self, blocks: &[RegisteredBlock]) -> Result<TransferTicket, CoreError> {
        if let Some(b) = blocks.iter().find(|b| !self.gpu.owns(b)) {
            return Err(CoreError::InvalidArgument(format!(
                "offload source {b:?} is not a block of this manager's GPU tier"
            )));
        }
        let mut halves = self.halves.lock();
        let h = &mut *halves;
        h.settle();
        let placed = h
            .leader
            .offload_identities(blocks.iter().map(RegisteredBlock::identity).collect())?;
        let mut pairs = Vec::with_capacity(blocks.len());
        let mut held = HashMap::with_capacity(blocks.len());
        for (block, host) in blocks.iter().zip(&placed.host) {
            if let Some(host) = *host {
                // Just registered by the leader, under this lock: the id names that block.
                let target = self
                    .host
                    .lookup_id(BlockId(host))
                    .expect("the leader registered it");
                pairs.push((block.id().0, host));
                held.insert(block.id().0, (block.clone(), target));
            }
        }
        let record = TicketShared::new(0, placed.deduplicated, placed.skipped);
        let on_batch = offload_callback(self.host.clone(), held, record.clone());
        let copy = match h.worker.offload_with(&pairs, &[], Some(on_batch)) {
            Ok(copy) => copy,
            Err(err) => {
                // Nothing will fill the host blocks the leader registered: they are bad for the
                // worker and leave the tier (and the disk queue).
                let hosts: Vec<u32> = pairs.iter().map(|&(_, host)| host).collect();
                h.worker.offload_refused(&hosts);
                h.leader.discard(&hosts, &[]);
                h.leader.end_step();
                return Err(err);
            }
        };
        // The copies are queued: a disk write that cannot be is logged (its blocks left the
        // disk tier), the offload's ticket stands.
        if let Err(err) = h.queue_disk_writes() {
            tracing::warn!(error = %err, "disk writes not queued");
        }
        h.leader.end_step();
        Ok(TransferTicket::new(record, copy))
    }

    /// Copies held host blocks into the given GPU blocks (one target per source, in order);
    /// each target is registered under its source's identity once its copy completed, and
    /// returns to `Free` if it failed (or its host block is bad).
    pub fn onboard(
        &self,
        sources: Vec<RegisteredBlock>,
        targets: Vec<FillingBlock>,
    ) -> Result<TransferTicket, CoreError> {
        if sources.len() != targets.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} sources for {} targets",
                sources.len(),
                targets.len()
            )));
        }
        if sources.iter().any(|b| !self.host.owns(b))
            || targets.iter().any(|b| !self.gpu.owns_filling(b))
        {
            return Err(CoreError::InvalidArgument(
                "onboard copies this manager's host blocks into its GPU blocks".into(),
            ));
        }
        let pairs: Vec<(u32, u32)> = sources
            .iter()
            .zip(&targets)
            .map(|(s, t)| (s.id().0, t.id().0))
            .collect();
        let record = TicketShared::new(pairs.len(), 0, 0);
        let slots: HashMap<u32, OnboardSlot> = sources
            .into_iter()
            .zip(targets)
            .enumerate()
            .map(|(i, (source, target))| (target.id().0, (i, source, target)))
            .collect();
        let slots = Arc::new(Mutex::new(slots));
        let on_batch = onboard_callback(self.gpu.clone(), slots.clone(), record.clone());
        let mut halves = self.halves.lock();
        halves.settle();
        let (copy, refused) = halves.worker.onboard_with(&pairs, Some(on_batch))?;
        drop(halves);
        if !refused.is_empty() {
            // Never copied: their targets go back to Free.
            let mut slots = slots.lock();
            for g in &refused {
                slots.remove(g);
            }
            record.refused(CoreError::TransferFailed(format!(
                "{} host blocks hold no valid copy",
                refused.len()
            )));
        }
        Ok(TransferTicket::new(record, copy))
    }

    /// Matches `hashes` from the first across GPU then host (then disk), each block from the
    /// fastest tier that holds it, stopping at the first miss.
    pub fn match_prefix(&self, hashes: &[SequenceHash]) -> PrefixMatch {
        let mut pools = vec![&self.gpu, &self.host];
        pools.extend(self.disk.as_ref());
        PrefixMatch {
            blocks: match_across(&pools, hashes),
        }
    }

    /// Matches `hashes` below the GPU: host first, and disk blocks continue the prefix where the
    /// host match stops (what a connector onboards beyond the engine's own GPU prefix cache).
    /// Host hits count as sightings for disk admission (admitted blocks are written to disk).
    pub fn match_lower(&self, hashes: &[SequenceHash]) -> PrefixMatch {
        let mut pools = vec![&self.host];
        pools.extend(self.disk.as_ref());
        let blocks = match_across(&pools, hashes);
        let host_hits = blocks.iter().filter(|b| b.tier() == Tier::Host).count();
        add(&self.metrics.host_lookup_blocks, hashes.len() as u64);
        add(&self.metrics.host_hit_blocks, host_hits as u64);
        add(
            &self.metrics.matched_tokens,
            (blocks.len() * self.kv.block_size_tokens) as u64,
        );
        if self.disk.is_some() && host_hits > 0 {
            let mut halves = self.halves.lock();
            halves.settle();
            halves.leader.sight_host(&blocks);
            if let Err(err) = halves.queue_disk_writes() {
                tracing::warn!(error = %err, "disk writes not queued");
            }
            halves.leader.end_step();
        }
        PrefixMatch { blocks }
    }

    /// Onboards disk blocks into the host tier (Disk->Host; the host copies then onboard to the GPU
    /// like any host block). Returns the held host blocks of the prefix that onboarded: a block
    /// that misses (corrupt, or another key) ends it, and a corrupt one leaves the disk tier.
    pub fn onboard_from_disk(
        &self,
        disk_blocks: Vec<RegisteredBlock>,
    ) -> Result<Vec<RegisteredBlock>, CoreError> {
        let Some(disk) = &self.disk else {
            return Err(CoreError::InvalidArgument("no disk tier".into()));
        };
        if disk_blocks.iter().any(|b| !disk.owns(b)) {
            return Err(CoreError::InvalidArgument(
                "onboard_from_disk reads this manager's disk blocks".into(),
            ));
        }
        let mut halves = self.halves.lock();
        let h = &mut *halves;
        h.settle();
        let (reads, staging) = h.leader.stage_disk_reads(&disk_blocks)?;
        let n = reads.len();
        let missed: HashSet<u32> = h.worker.disk_read(&reads)?.into_iter().collect();
        let staged: Vec<(FillingBlock, crate::pool::BlockIdentity)> = staging
            .into_iter()
            .zip(&disk_blocks)
            .take_while(|(stage, _)| !missed.contains(&stage.id().0))
            .map(|(stage, source)| (stage, source.identity()))
            .collect();
        // A host block already registered under one of these identities is returned instead of
        // its staged copy: wait for the offloads still filling such blocks first (a failed
        // one's callback takes its block out of the tier, so the staged copy joins instead).
        let filling: HashSet<u32> = staged
            .iter()
            .filter_map(|(_, identity)| self.host.lookup(identity.sequence_hash))
            .map(|b| b.id().0)
            .collect();
        if !filling.is_empty() {
            h.worker.wait_offloads_touching(&filling);
        }
        let onboarded = h.leader.register_staged(staged);
        // A block that failed verification leaves the disk tier now.
        h.settle();
        h.leader.end_step();
        drop(halves);
        let onboarded = onboarded?;
        add(&self.metrics.disk_lookup_blocks, n as u64);
        add(&self.metrics.disk_hit_blocks, onboarded.len() as u64);
        add(&self.metrics.onboard_blocks_d2d, onboarded.len() as u64);
        Ok(onboarded)
    }

    /// Matches `hashes` in the host tier alone (what a connector onboards beyond the engine's own GPU
    /// prefix cache), counting lookups and hits for the hit-rate metrics.
    pub fn match_host(&self, hashes: &[SequenceHash]) -> Vec<RegisteredBlock> {
        let blocks = self.host.match_prefix(hashes);
        add(&self.metrics.host_lookup_blocks, hashes.len() as u64);
        add(&self.metrics.host_hit_blocks, blocks.len() as u64);
        add(
            &self.metrics.matched_tokens,
            (blocks.len() * self.kv.block_size_tokens) as u64,
        );
        blocks
    }

    /// Waits until no copy is queued or in flight and no disk write is queued, then takes in
    /// what went bad meanwhile (those blocks leave their tiers).
    pub fn wait_idle(&self) {
        let mut halves = self.halves.lock();
        halves.worker.wait_offloads();
        halves.worker.copies().wait_idle();
        halves.worker.wait_disk();
        halves.settle();
    }

    /// Empties every tier and publishes one `AllBlocksCleared` (what an engine's prefix-cache
    /// reset does). Refused with `Busy`, changing nothing, while any block is held (an offload's
    /// GPU sources and an onboard's host sources are held until copied). The disk cache file
    /// keeps its contents (a restart would announce them again).
    pub fn reset(&self) -> Result<(), CoreError> {
        let mut halves = self.halves.lock();
        halves.settle();
        halves.leader.reset_with(&[&self.gpu])
    }

    /// Every (tier, hash) registered now.
    pub fn residency(&self) -> HashSet<(Tier, SequenceHash)> {
        let mut set = HashSet::new();
        for pool in [&self.gpu, &self.host]
            .into_iter()
            .chain(self.disk.as_ref())
        {
            set.extend(
                pool.registered_hashes()
                    .into_iter()
                    .map(|h| (pool.tier(), h)),
            );
        }
        set
    }

    /// Keeps the copy stream of `direction` from starting further copies until the returned hold
    /// drops (emulated device only; for tests that need a copy in flight).
    pub fn hold_stream(
        &self,
        direction: kvbm_cuda::Direction,
    ) -> Result<kvbm_cuda::StreamHold, CoreError> {
        self.halves.lock().worker.hold_stream(direction)
    }

    /// Fails the next `n` copy batches of `direction`, as DMA faults would (emulated device
    /// only; for tests of the failure paths).
    pub fn fail_next_copies(
        &self,
        direction: kvbm_cuda::Direction,
        n: usize,
    ) -> Result<(), CoreError> {
        self.halves.lock().worker.fail_next_copies(direction, n)
    }

    /// Writes one GPU block from `bytes` in canonical order (the GPU layout's memory order, see
    /// [`crate::layout`]; the order its host copy has), for filling blocks in tests and
    /// benchmarks. `bytes` is exactly one block.
    pub fn write_gpu_block(&self, id: BlockId, bytes: &[u8]) -> Result<(), CoreError> {
        self.halves.lock().worker.write_gpu_block(id.0, bytes)
    }

    /// Reads one GPU block into `out` in canonical order.
    pub fn read_gpu_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), CoreError> {
        self.halves.lock().worker.read_gpu_block(id.0, out)
    }

    /// Reads one host block into `out` in canonical order (after the offloads into it).
    pub fn read_host_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), CoreError> {
        self.halves.lock().worker.read_host_block(id.0, out)
    }
}

impl Drop for BlockManager {
    fn drop(&mut self) {
        // Finish what is in flight; the worker then closes its disk file with a checkpoint.
        self.wait_idle();
    }
}

/// An onboard's target: its position in the request, its source (held), the target.
type OnboardSlot = (usize, RegisteredBlock, FillingBlock);

fn latency_of(done: &BatchDone) -> BatchLatency {
    BatchLatency {
        blocks: done.pairs.len(),
        latency: done.latency,
    }
}

/// An offload's GPU source and host target, held until copied.
type OffloadPair = (RegisteredBlock, RegisteredBlock);

/// Releases each finished batch's blocks and records it; a failed batch's host blocks leave the
/// host tier (by handle: exactly the blocks that did not get their bytes).
fn offload_callback(
    host: BlockPool,
    held: HashMap<u32, OffloadPair>,
    record: Arc<TicketShared>,
) -> OnBatch {
    let held = Mutex::new(held);
    Box::new(move |done: BatchDone| {
        let released: Vec<OffloadPair> = {
            let mut held = held.lock();
            done.pairs
                .iter()
                .filter_map(|(g, _)| held.remove(g))
                .collect()
        };
        let copied = if done.error.is_none() {
            done.pairs.len()
        } else {
            for (_, target) in released {
                host.discard(target);
            }
            0
        };
        record.batch_done(copied, Vec::new(), latency_of(&done), done.error);
    })
}

/// Registers each finished batch's targets under their sources' identities (or returns them to
/// `Free` if it failed), then records it.
fn onboard_callback(
    gpu: BlockPool,
    slots: Arc<Mutex<HashMap<u32, OnboardSlot>>>,
    record: Arc<TicketShared>,
) -> OnBatch {
    Box::new(move |done: BatchDone| {
        let taken: Vec<OnboardSlot> = {
            let mut slots = slots.lock();
            done.pairs
                .iter()
                .filter_map(|(_, g)| slots.remove(g))
                .collect()
        };
        let latency = latency_of(&done);
        if done.error.is_some() {
            drop(taken); // targets back to Free, never registered
            record.batch_done(0, Vec::new(), latency, done.error);
            return;
        }
        let mut positions = Vec::with_capacity(taken.len());
        let mut complete = Vec::with_capacity(taken.len());
        for (i, source, target) in taken {
            complete.push(target.complete(source.identity()));
            positions.push(i);
        }
        match gpu.register_all(complete) {
            Ok(registered) => {
                let n = registered.len();
                record.batch_done(
                    n,
                    positions.into_iter().zip(registered).collect(),
                    latency,
                    None,
                )
            }
            Err(rejected) => record.batch_done(
                0,
                Vec::new(),
                latency,
                Some(CoreError::InvalidArgument(rejected.reason.into())),
            ),
        }
    })
}
