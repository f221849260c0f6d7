//! The block manager: a GPU tier and a pinned host tier, their registry, and the engine that moves
//! blocks between them, publishing a tier-annotated event for every change.
//!
//! Invariants:
//! - Both tiers share one event publisher, so one subscriber sees every tier's changes in order.
//! - The host tier is fully contiguous with 4 KiB-aligned block strides, and its memory is pinned
//!   in chunks that are whole multiples of the stride, so no block straddles two pinned chunks.
//! - Host blocks become allocatable only once their memory is pinned.

use std::collections::HashSet;
use std::sync::Arc;

use kvbm_cuda::{Device, DeviceKind, Direction, GpuRegion, HostRegion, HostRegionOptions, Region};
use kvbm_events::{EventPublisher, EventSubscriber, SequenceHash, Tier};

use crate::config::KvbmConfig;
use crate::disk::{DiskOptions, DiskTier};
use crate::layout::{BlockLayout, GpuLayout, KvLayout};
use crate::metrics::{add, Metrics, MetricsSnapshot};
use crate::pool::{
    clear_across, match_across, BlockId, BlockPool, CompleteBlock, FillingBlock, RegisteredBlock,
};
use crate::transfer::{
    HostStoredHook, TierStorage, TransferEngine, TransferLimits, TransferTicket,
};
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

/// The block manager over the GPU, host and (optionally) disk tiers.
pub struct BlockManager {
    device: Device,
    kv: KvLayout,
    events: EventPublisher,
    metrics: Arc<Metrics>,
    /// Declared before `disk`: it drops first, so its last offloads reach the disk writer.
    engine: TransferEngine,
    disk: Option<Arc<DiskTier>>,
    /// Declared last: it drops last, after the tiers' final events.
    zmq: Option<kvbm_events::ZmqPublisher>,
}

impl std::fmt::Debug for BlockManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockManager")
            .field("device", &self.device.kind())
            .field("kv", &self.kv)
            .field("gpu", &self.gpu_pool().counts())
            .field("host", &self.host_pool().counts())
            .finish()
    }
}

impl BlockManager {
    /// Builds the tiers on `device`: GPU memory allocated or registered, host memory mapped and
    /// pinned in the background (usable as it becomes ready), and the disk tier if configured
    /// (announcing what it recovered).
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
        let geometry_id = gpu_layout.geometry_id();
        let gpu = TierStorage {
            pool: BlockPool::new(
                Tier::Gpu,
                options.gpu_blocks,
                kv.block_size_tokens,
                Some(events.clone()),
            ),
            layout: gpu_layout,
            regions: gpu_regions.into_iter().map(Region::from).collect(),
            host_region: None,
        };

        let stride = kv.host_stride_bytes();
        let host_bytes = stride
            .checked_mul(options.host_blocks)
            .ok_or_else(|| CoreError::InvalidArgument("host tier size overflows".into()))?;
        let host_region =
            device.alloc_host(host_bytes, host_pin_options(stride, options.pin_threads))?;
        let host = TierStorage {
            pool: BlockPool::with_policy(
                Tier::Host,
                options.host_blocks,
                kv.block_size_tokens,
                Some(events.clone()),
                Box::new(crate::eviction::LruPriority::new(options.host_blocks)),
                0,
            ),
            layout: BlockLayout::host(kv, options.host_blocks, host_region.addr()),
            regions: vec![Region::from(host_region.clone())],
            host_region: Some(host_region),
        };
        host.refresh_available();

        let disk = match &options.disk {
            None => None,
            Some(disk_options) => {
                let pool = BlockPool::new(
                    Tier::Disk,
                    disk_options.blocks,
                    kv.block_size_tokens,
                    Some(events.clone()),
                );
                let host_region = host
                    .host_region
                    .clone()
                    .expect("the host tier has a host region");
                Some(Arc::new(DiskTier::open(
                    disk_options,
                    kv,
                    geometry_id,
                    pool,
                    host.pool.clone(),
                    host.layout.clone(),
                    host_region,
                    metrics.clone(),
                )?))
            }
        };
        let hook: Option<HostStoredHook> = disk.clone().map(|disk| {
            Arc::new(move |blocks: &[RegisteredBlock]| {
                disk.consider(blocks, std::time::Instant::now())
            }) as HostStoredHook
        });
        let d2h = device.copy_stream_with(Direction::DeviceToHost, options.limits.copy)?;
        let h2d = device.copy_stream_with(Direction::HostToDevice, options.limits.copy)?;
        let engine =
            TransferEngine::new(gpu, host, d2h, h2d, options.limits, metrics.clone(), hook)?;
        Ok(Self {
            device,
            kv,
            events,
            metrics,
            engine,
            disk,
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
        &self.engine.gpu().layout
    }

    /// The event publisher of every tier.
    pub fn events(&self) -> &EventPublisher {
        &self.events
    }

    /// A subscription to every tier's events from now on.
    pub fn subscribe(&self, capacity_events: usize) -> EventSubscriber {
        self.events.subscribe(capacity_events)
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The counters now, with the host tier's pinned bytes.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let mut snapshot = self.metrics.snapshot();
        snapshot.host_pinned_bytes_ready = self.host_region().ready_bytes() as u64;
        snapshot
    }

    /// The GPU tier's pool.
    pub fn gpu_pool(&self) -> &BlockPool {
        &self.engine.gpu().pool
    }

    /// The host tier's pool.
    pub fn host_pool(&self) -> &BlockPool {
        &self.engine.host().pool
    }

    /// The ZMQ publisher of this manager's events, if configured.
    pub fn zmq_publisher(&self) -> Option<&kvbm_events::ZmqPublisher> {
        self.zmq.as_ref()
    }

    /// The disk tier, if configured.
    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_deref()
    }

    /// The host tier's memory.
    pub fn host_region(&self) -> &HostRegion {
        self.engine
            .host()
            .host_region
            .as_ref()
            .expect("the host tier has a host region")
    }

    /// The transfer engine's limits.
    pub fn limits(&self) -> TransferLimits {
        self.engine.limits()
    }

    /// Makes the host blocks whose memory is pinned by now allocatable; returns how many are.
    pub fn refresh_host_available(&self) -> usize {
        self.engine.host().refresh_available();
        self.host_pool().available()
    }

    /// Takes `count` GPU blocks for writing (evicting idle ones if needed).
    pub fn allocate_gpu(&self, count: usize) -> Result<Vec<FillingBlock>, CoreError> {
        self.gpu_pool().allocate(count)
    }

    /// Registers complete GPU blocks (publishing `BlockStored` for tier Gpu).
    pub fn register_gpu(
        &self,
        blocks: Vec<CompleteBlock>,
    ) -> Result<Vec<RegisteredBlock>, CoreError> {
        self.gpu_pool()
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

    /// Copies registered GPU blocks to the host tier.
    pub fn offload(&self, blocks: &[RegisteredBlock]) -> Result<TransferTicket, CoreError> {
        self.engine.offload(blocks)
    }

    /// Copies held host blocks into the given GPU blocks; each becomes a registered GPU block.
    pub fn onboard(
        &self,
        sources: Vec<RegisteredBlock>,
        targets: Vec<FillingBlock>,
    ) -> Result<TransferTicket, CoreError> {
        self.engine.onboard(sources, targets)
    }

    /// Matches `hashes` from the first across GPU then host, each block from the fastest tier
    /// that holds it, stopping at the first miss.
    pub fn match_prefix(&self, hashes: &[SequenceHash]) -> PrefixMatch {
        let mut pools = vec![self.gpu_pool(), self.host_pool()];
        pools.extend(self.disk.as_deref().map(DiskTier::pool));
        PrefixMatch {
            blocks: match_across(&pools, hashes),
        }
    }

    /// Matches `hashes` below the GPU: host first, and disk blocks continue the prefix where the
    /// host match stops (what a connector onboards beyond the engine's own GPU prefix cache).
    /// Host hits count as sightings for disk admission.
    pub fn match_lower(&self, hashes: &[SequenceHash]) -> PrefixMatch {
        let mut pools = vec![self.host_pool()];
        pools.extend(self.disk.as_deref().map(DiskTier::pool));
        let blocks = match_across(&pools, hashes);
        let host_hits: Vec<RegisteredBlock> = blocks
            .iter()
            .filter(|b| b.tier() == Tier::Host)
            .cloned()
            .collect();
        add(&self.metrics.host_lookup_blocks, hashes.len() as u64);
        add(&self.metrics.host_hit_blocks, host_hits.len() as u64);
        add(
            &self.metrics.matched_tokens,
            (blocks.len() * self.kv.block_size_tokens) as u64,
        );
        if let Some(disk) = &self.disk {
            disk.consider(&host_hits, std::time::Instant::now());
        }
        PrefixMatch { blocks }
    }

    /// Onboards disk blocks into the host tier (Disk->Host; the host copies then onboard to the GPU
    /// like any host block). Returns the held host blocks of the prefix that onboarded.
    pub fn onboard_from_disk(
        &self,
        disk_blocks: Vec<RegisteredBlock>,
    ) -> Result<Vec<RegisteredBlock>, CoreError> {
        let disk = self
            .disk
            .as_deref()
            .ok_or_else(|| CoreError::InvalidArgument("no disk tier".into()))?;
        self.engine.host().refresh_available();
        disk.onboard_to_host(disk_blocks)
    }

    /// Matches `hashes` in the host tier alone (what a connector onboards beyond the engine's own GPU
    /// prefix cache), counting lookups and hits for the hit-rate metrics.
    pub fn match_host(&self, hashes: &[SequenceHash]) -> Vec<RegisteredBlock> {
        let blocks = self.host_pool().match_prefix(hashes);
        add(&self.metrics.host_lookup_blocks, hashes.len() as u64);
        add(&self.metrics.host_hit_blocks, blocks.len() as u64);
        add(
            &self.metrics.matched_tokens,
            (blocks.len() * self.kv.block_size_tokens) as u64,
        );
        blocks
    }

    /// Waits until no transfer is pending or in flight, and no disk write is queued.
    pub fn wait_idle(&self) {
        self.engine.wait_idle();
        if let Some(disk) = &self.disk {
            disk.wait_idle();
        }
    }

    /// Empties every tier and publishes one `AllBlocksCleared` (what an engine's prefix-cache
    /// reset does). Refused with `Busy`, changing nothing, while any block is held or being copied.
    /// The disk cache file keeps its contents (a restart would announce them again).
    pub fn reset(&self) -> Result<(), CoreError> {
        let mut pools = vec![self.gpu_pool(), self.host_pool()];
        pools.extend(self.disk.as_deref().map(DiskTier::pool));
        clear_across(&pools)
    }

    /// Every (tier, hash) registered now.
    pub fn residency(&self) -> HashSet<(Tier, SequenceHash)> {
        let mut set = HashSet::new();
        let disk = self.disk.as_deref().map(DiskTier::pool);
        for pool in [self.gpu_pool(), self.host_pool()].into_iter().chain(disk) {
            set.extend(
                pool.registered_hashes()
                    .into_iter()
                    .map(|h| (pool.tier(), h)),
            );
        }
        set
    }

    /// Writes one GPU block from `bytes` in canonical order (the GPU layout's memory order, see
    /// [`crate::layout`]; the order its host copy has), for filling blocks in tests and
    /// benchmarks. `bytes` is exactly one block.
    pub fn write_gpu_block(&self, id: BlockId, bytes: &[u8]) -> Result<(), CoreError> {
        self.block_io(
            self.engine.gpu(),
            id,
            bytes.len(),
            |region, offset, range| match region {
                Region::Gpu(g) => g.write(offset, &bytes[range]),
                Region::Host(h) => h.write(offset, &bytes[range]),
            },
        )
    }

    /// Reads one GPU block into `out` in canonical order.
    pub fn read_gpu_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), CoreError> {
        let len = out.len();
        self.block_io(
            self.engine.gpu(),
            id,
            len,
            |region, offset, range| match region {
                Region::Gpu(g) => g.read(offset, &mut out[range]),
                Region::Host(h) => h.read(offset, &mut out[range]),
            },
        )
    }

    /// Reads one host block into `out` in canonical order.
    pub fn read_host_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), CoreError> {
        let len = out.len();
        self.block_io(
            self.engine.host(),
            id,
            len,
            |region, offset, range| match region {
                Region::Gpu(g) => g.read(offset, &mut out[range]),
                Region::Host(h) => h.read(offset, &mut out[range]),
            },
        )
    }

    fn block_io(
        &self,
        tier: &TierStorage,
        id: BlockId,
        len: usize,
        mut io: impl FnMut(&Region, usize, std::ops::Range<usize>) -> Result<(), kvbm_cuda::DeviceError>,
    ) -> Result<(), CoreError> {
        let kv = self.kv;
        if len != kv.bytes_per_block() || id.index() >= tier.layout.num_blocks() {
            return Err(CoreError::InvalidArgument(format!(
                "block {id:?} with {len} bytes; blocks are {} bytes",
                kv.bytes_per_block()
            )));
        }
        let mut result = Ok(());
        tier.layout
            .for_each_run(id.index(), |addr, offset, len, _| {
                if result.is_err() {
                    return;
                }
                let region = tier
                    .regions
                    .iter()
                    .find(|r| r.addr() <= addr && addr + len as u64 <= r.addr() + r.len() as u64);
                result = match region {
                    None => Err(CoreError::InvalidLayout(format!(
                        "run at {addr:#x} outside every region"
                    ))),
                    Some(region) => io(
                        region,
                        (addr - region.addr()) as usize,
                        offset..offset + len,
                    )
                    .map_err(CoreError::from),
                };
            });
        result
    }
}
