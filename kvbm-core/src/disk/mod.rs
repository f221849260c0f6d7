//! The disk tier: which host blocks go to disk (admission), writing them there on a worker
//! thread, onboarding them back into host blocks, and announcing what a restart recovered.
//!
//! Invariants:
//! - A disk block becomes findable (and `BlockStored{tier: Disk}` is published) only after its
//!   write completed; a failed write frees its slot and announces nothing.
//! - A host block stays held (not evictable) from the moment it is admitted until its disk write
//!   finished.
//! - The engine's progress thread never waits on the disk: admission hands batches to the
//!   writer through a bounded queue, and a full queue skips (and counts) the batch.
//! - An onboard that misses (a corrupt or vanished disk block) discards that disk block from the
//!   registry (`BlockRemoved`) and ends the onboarded prefix there.

pub(crate) mod handoff;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, TrySendError};
use kvbm_cuda::HostRegion;
use kvbm_disk::{CacheFileOptions, DiskStore, EngineChoice, Lookup, StoreOptions, WriteOutcome};
use kvbm_events::{SequenceHash, Tier};
use parking_lot::{Condvar, Mutex};

use crate::layout::{BlockLayout, KvLayout};
use crate::metrics::{add, Metrics};
use crate::pool::{BlockId, BlockIdentity, BlockPool, RegisteredBlock};
use crate::CoreError;

/// A block is admitted to disk when its decayed sighting count reaches this: a second sighting
/// within about one half-life of the first.
pub const ADMIT_THRESHOLD: f64 = 1.5;
/// Half-life of sighting counts.
pub const ADMISSION_HALF_LIFE: Duration = Duration::from_secs(600);
/// Hashes the admission filter remembers at most.
pub const ADMISSION_ENTRIES_MAX: usize = 1 << 20;
/// Write batches queued for the disk writer at most.
pub const DISK_QUEUE_MAX: usize = 256;

/// Bytes one block of `kv` takes on disk: its contiguous stride plus the block header.
pub fn slot_bytes(kv: &KvLayout) -> usize {
    kv.contiguous_stride_bytes() + kvbm_disk::format::HEADER_BYTES
}

/// Fingerprint of a KV layout and of the canonical order of a block's bytes (the GPU layout's
/// [`BlockLayout::geometry_id`]), stored with the disk cache: a file written for another layout
/// is discarded on open.
pub fn layout_fingerprint(kv: &KvLayout, geometry_id: u64) -> u64 {
    let fields = [
        kv.num_layers as u64,
        kv.outer_dim as u64,
        kv.block_size_tokens as u64,
        kv.inner_dim as u64,
        kv.dtype_bytes as u64,
        geometry_id,
    ];
    let bytes: Vec<u8> = fields.iter().flat_map(|f| f.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// The disk admission policy: "seen at least twice, counts decaying over time" (as Dynamo's
/// disk offload filter), or everything when disabled.
#[derive(Debug)]
pub struct Admission {
    disabled: bool,
    half_life: Duration,
    entries: HashMap<SequenceHash, (f64, Instant)>,
}

impl Admission {
    /// A filter; `disabled` admits every block on first sight.
    pub fn new(disabled: bool, half_life: Duration) -> Self {
        Self {
            disabled,
            half_life,
            entries: HashMap::new(),
        }
    }

    /// Records a sighting of `hash` at `now`; true when the block should go to disk.
    pub fn observe(&mut self, hash: SequenceHash, now: Instant) -> bool {
        if self.disabled {
            return true;
        }
        if self.entries.len() >= ADMISSION_ENTRIES_MAX && !self.entries.contains_key(&hash) {
            self.shrink(now);
        }
        let half_life = self.half_life.as_secs_f64().max(f64::MIN_POSITIVE);
        let entry = self.entries.entry(hash).or_insert((0.0, now));
        let age = now.saturating_duration_since(entry.1).as_secs_f64();
        entry.0 = entry.0 * 0.5f64.powf(age / half_life) + 1.0;
        entry.1 = now;
        entry.0 >= ADMIT_THRESHOLD
    }

    /// Forgets the weakest half of the entries (bounded memory).
    fn shrink(&mut self, now: Instant) {
        let half_life = self.half_life.as_secs_f64().max(f64::MIN_POSITIVE);
        let mut scored: Vec<(f64, SequenceHash)> = self
            .entries
            .iter()
            .map(|(h, (count, at))| {
                (
                    count
                        * 0.5f64.powf(now.saturating_duration_since(*at).as_secs_f64() / half_life),
                    *h,
                )
            })
            .collect();
        scored.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, h) in scored.iter().take(scored.len() / 2 + 1) {
            self.entries.remove(h);
        }
    }

    /// Hashes remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The metadata kvbm keeps with a disk block: enough to announce it after a restart.
/// `version 1 u8 | flags u8 (1 = parent, 2 = lora) | parent u64 | tokens u32 count, u32 each |
/// lora length u16, bytes`, little-endian.
pub fn encode_identity(identity: &BlockIdentity) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + identity.tokens.len() * 4);
    out.push(1);
    let flags = u8::from(identity.parent.is_some()) | (u8::from(identity.lora_name.is_some()) << 1);
    out.push(flags);
    out.extend_from_slice(&identity.parent.map_or(0, |p| p.0).to_le_bytes());
    out.extend_from_slice(&(identity.tokens.len() as u32).to_le_bytes());
    for t in identity.tokens.iter() {
        out.extend_from_slice(&t.to_le_bytes());
    }
    let lora = identity.lora_name.as_deref().unwrap_or("").as_bytes();
    out.extend_from_slice(&(lora.len().min(u16::MAX as usize) as u16).to_le_bytes());
    out.extend_from_slice(&lora[..lora.len().min(u16::MAX as usize)]);
    out
}

/// Reads what [`encode_identity`] wrote for the block with `hash`; `None` for anything else.
pub fn decode_identity(hash: SequenceHash, bytes: &[u8]) -> Option<BlockIdentity> {
    let (&version, rest) = bytes.split_first()?;
    let (&flags, rest) = rest.split_first()?;
    if version != 1 || flags & !3 != 0 {
        return None;
    }
    let parent = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
    let count = u32::from_le_bytes(rest.get(8..12)?.try_into().ok()?) as usize;
    let tokens_end = 12usize.checked_add(count.checked_mul(4)?)?;
    let tokens: Vec<u32> = rest
        .get(12..tokens_end)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let lora_len =
        u16::from_le_bytes(rest.get(tokens_end..tokens_end + 2)?.try_into().ok()?) as usize;
    let lora = rest.get(tokens_end + 2..tokens_end + 2 + lora_len)?;
    if rest.len() != tokens_end + 2 + lora_len {
        return None;
    }
    Some(BlockIdentity {
        sequence_hash: hash,
        parent: (flags & 1 != 0).then_some(SequenceHash(parent)),
        tokens: tokens.into(),
        lora_name: if flags & 2 != 0 {
            Some(std::str::from_utf8(lora).ok()?.into())
        } else {
            None
        },
    })
}

/// Starts the thread that takes `receiver`'s jobs one at a time until every sender is gone.
pub(crate) fn spawn_writer<T: Send + 'static>(
    name: &str,
    receiver: crossbeam_channel::Receiver<T>,
    mut run: impl FnMut(T) + Send + 'static,
) -> Result<JoinHandle<()>, CoreError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            for job in receiver {
                run(job);
            }
        })
        .map_err(|e| CoreError::Disk(format!("cannot start {name}: {e}")))
}

/// The store options of a disk tier for blocks of `kv` in the order `geometry_id` names.
pub(crate) fn store_options(options: &DiskOptions, kv: KvLayout, geometry_id: u64) -> StoreOptions {
    StoreOptions {
        layout_fingerprint: layout_fingerprint(&kv, geometry_id),
        payload_bytes: kv.bytes_per_block(),
        slots: options.blocks,
        queue_depth: options.queue_depth,
        engine: options.engine,
        file: CacheFileOptions {
            disable_o_direct: options.disable_o_direct,
            ..Default::default()
        },
        write_failures_max: 8,
    }
}

/// Where and how the disk tier lives.
#[derive(Debug, Clone)]
pub struct DiskOptions {
    /// Directory of the cache file (`DYN_KVBM_DISK_CACHE_DIR`).
    pub dir: PathBuf,
    /// The cache file's name (one per worker).
    pub file_name: String,
    /// Blocks on disk.
    pub blocks: usize,
    /// Buffered I/O (`DYN_KVBM_DISK_DISABLE_O_DIRECT`).
    pub disable_o_direct: bool,
    /// Admit every host block (`DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER`).
    pub filter_disabled: bool,
    /// Disk operations in flight.
    pub queue_depth: usize,
    /// io_uring, psync, or auto.
    pub engine: EngineChoice,
}

/// Declares `store` before `host_region`: the store (and its registration of the region) drops
/// first.
struct DiskShared {
    store: DiskStore,
    pool: BlockPool,
    host_pool: BlockPool,
    host_layout: BlockLayout,
    host_region: HostRegion,
    admission: Mutex<Admission>,
    /// Hashes admitted and queued or being written.
    writing: Mutex<HashSet<SequenceHash>>,
    /// Batches queued or being written, for `wait_idle`.
    busy: Mutex<usize>,
    idle_cv: Condvar,
    metrics: Arc<Metrics>,
    /// Whether the host region got registered for fixed-buffer I/O, once decided.
    registered: Mutex<Option<bool>>,
    registered_cv: Condvar,
}

/// The disk tier and its writer thread.
pub struct DiskTier {
    shared: Arc<DiskShared>,
    sender: Option<Sender<Vec<RegisteredBlock>>>,
    writer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("store", &self.shared.store)
            .field("pool", &self.shared.pool.counts())
            .finish()
    }
}

impl DiskTier {
    /// Opens the disk cache for `kv` and announces what it recovered (`BlockStored{tier: Disk}`
    /// through `pool`'s publisher). `pool` must have `options.blocks` blocks; `geometry_id` is
    /// the GPU layout's ([`BlockLayout::geometry_id`]), the order of a block's bytes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn open(
        options: &DiskOptions,
        kv: KvLayout,
        geometry_id: u64,
        pool: BlockPool,
        host_pool: BlockPool,
        host_layout: BlockLayout,
        host_region: HostRegion,
        metrics: Arc<Metrics>,
    ) -> Result<Self, CoreError> {
        let store_options = store_options(options, kv, geometry_id);
        let (store, recovered) = DiskStore::open(&options.dir, &options.file_name, store_options)
            .map_err(|e| CoreError::Disk(e.to_string()))?;
        // Announce what survived: claim each recovered slot and register it under its identity.
        let found: Vec<(BlockId, BlockIdentity)> = recovered
            .blocks
            .iter()
            .filter_map(|b| {
                Some((
                    BlockId(b.slot),
                    decode_identity(SequenceHash(b.key), &b.metadata)?,
                ))
            })
            .collect();
        if found.len() < recovered.blocks.len() {
            tracing::warn!(
                unreadable = recovered.blocks.len() - found.len(),
                "recovered disk blocks without a readable identity were dropped"
            );
        }
        let ids: Vec<BlockId> = found.iter().map(|(id, _)| *id).collect();
        let claimed = pool.claim(&ids)?;
        let complete = claimed
            .into_iter()
            .zip(found)
            .map(|(b, (_, identity))| b.complete(identity))
            .collect();
        let announced = pool
            .register_all(complete)
            .map_err(|r| CoreError::InvalidArgument(r.reason.into()))?;
        tracing::info!(
            blocks = announced.len(),
            from_checkpoint = recovered.from_checkpoint,
            initialised = recovered.initialised,
            "disk tier opened"
        );
        drop(announced);

        let shared = Arc::new(DiskShared {
            store,
            pool,
            host_pool,
            host_layout,
            host_region,
            admission: Mutex::new(Admission::new(options.filter_disabled, ADMISSION_HALF_LIFE)),
            writing: Mutex::new(HashSet::new()),
            busy: Mutex::new(0),
            idle_cv: Condvar::new(),
            metrics,
            registered: Mutex::new(None),
            registered_cv: Condvar::new(),
        });
        // Register the host region with io_uring once it is fully pinned, in the background: the
        // first writes go without fixed buffers rather than wait for the whole pool.
        let region = shared.host_region.clone();
        handoff::register_in_background(Arc::downgrade(&shared), region, "kvbm-disk-register")
            .map_err(|e| CoreError::Disk(format!("cannot start the disk registration: {e}")))?;
        let (sender, receiver) = crossbeam_channel::bounded::<Vec<RegisteredBlock>>(DISK_QUEUE_MAX);
        let worker_shared = shared.clone();
        let writer = spawn_writer("kvbm-disk-writer", receiver, move |batch| {
            worker_shared.write_batch(batch)
        })?;
        Ok(Self {
            shared,
            sender: Some(sender),
            writer: Some(writer),
        })
    }

    /// The disk tier's pool.
    pub fn pool(&self) -> &BlockPool {
        &self.shared.pool
    }

    /// The disk store (its stats, engine and file).
    pub fn store(&self) -> &DiskStore {
        &self.shared.store
    }

    /// Sightings of host blocks: each admitted one that is not on disk yet is held and queued for
    /// writing. Never blocks: a full queue skips the batch (counted).
    pub fn consider(&self, host_blocks: &[RegisteredBlock], now: Instant) {
        let mut admitted = Vec::new();
        {
            let mut admission = self.shared.admission.lock();
            let mut writing = self.shared.writing.lock();
            for block in host_blocks {
                let hash = block.sequence_hash();
                if admission.observe(hash, now)
                    && !writing.contains(&hash)
                    && !self.shared.pool.contains(hash)
                {
                    writing.insert(hash);
                    admitted.push(block.clone());
                }
            }
        }
        if admitted.is_empty() {
            return;
        }
        let Some(sender) = &self.sender else { return };
        *self.shared.busy.lock() += 1;
        match sender.try_send(admitted) {
            Ok(()) => {}
            Err(TrySendError::Full(batch) | TrySendError::Disconnected(batch)) => {
                add(
                    &self.shared.metrics.offload_skipped_blocks,
                    batch.len() as u64,
                );
                self.shared.finish(batch);
            }
        }
    }

    /// Waits up to `timeout` for the host region's registration with the disk engine (done in
    /// the background once the region is pinned); `Some(true)` when registered, `Some(false)`
    /// when it failed, `None` when not decided yet.
    pub fn wait_registered(&self, timeout: Duration) -> Option<bool> {
        let mut registered = self.shared.registered.lock();
        if registered.is_none() {
            let _ = self.shared.registered_cv.wait_for(&mut registered, timeout);
        }
        *registered
    }

    /// Waits until every admitted block has been written (or failed).
    pub fn wait_idle(&self) {
        let mut busy = self.shared.busy.lock();
        while *busy > 0 {
            self.shared.idle_cv.wait(&mut busy);
        }
    }

    /// Reads disk blocks (a matched prefix, in order) into new host blocks and registers them
    /// there; returns the held host blocks for the prefix that onboarded. A block that misses is
    /// discarded from the disk tier and ends the prefix.
    pub fn onboard_to_host(
        &self,
        disk_blocks: Vec<RegisteredBlock>,
    ) -> Result<Vec<RegisteredBlock>, CoreError> {
        let shared = &self.shared;
        if let Some(b) = disk_blocks.iter().find(|b| b.tier() != Tier::Disk) {
            return Err(CoreError::InvalidArgument(format!(
                "{b:?} is not a disk block"
            )));
        }
        let targets = shared.host_pool.allocate_up_to(disk_blocks.len());
        let n = targets.len();
        let items: Vec<(u32, u64, &crate::pool::FillingBlock)> = disk_blocks
            .iter()
            .zip(&targets)
            .map(|(d, t)| (d.id().0, d.sequence_hash().0, t))
            .collect();
        let lookups = handoff::read_into_host_blocks(
            &shared.store,
            &shared.host_layout,
            &shared.host_region,
            &items,
        )
        .map_err(|e| CoreError::Disk(e.to_string()))?;
        add(&shared.metrics.disk_lookup_blocks, n as u64);
        let mut complete = Vec::with_capacity(n);
        let mut disk_blocks = disk_blocks.into_iter();
        for (target, lookup) in targets.into_iter().zip(lookups) {
            let source = disk_blocks.next().expect("one source per target");
            match lookup {
                Lookup::Hit => complete.push(target.complete(source.identity())),
                Lookup::Miss(miss) => {
                    tracing::warn!(hash = ?source.sequence_hash(), ?miss, "disk block unreadable; dropped");
                    shared.pool.discard(source);
                    break;
                }
            }
        }
        add(&shared.metrics.disk_hit_blocks, complete.len() as u64);
        add(&shared.metrics.onboard_blocks_d2d, complete.len() as u64);
        shared
            .host_pool
            .register_all(complete)
            .map_err(|r| CoreError::InvalidArgument(r.reason.into()))
    }
}

impl DiskShared {
    /// Writes admitted host blocks to free (or evicted) disk slots and registers them there.
    fn write_batch(&self, host_blocks: Vec<RegisteredBlock>) {
        let slots = self.pool.allocate_up_to(host_blocks.len());
        let skipped = host_blocks.len() - slots.len();
        add(&self.metrics.offload_skipped_blocks, skipped as u64);
        let identities: Vec<BlockIdentity> = host_blocks
            .iter()
            .take(slots.len())
            .map(RegisteredBlock::identity)
            .collect();
        let items: Vec<(&RegisteredBlock, u32, Vec<u8>)> = host_blocks
            .iter()
            .zip(&slots)
            .zip(&identities)
            .map(|((h, s), identity)| (h, s.id().0, encode_identity(identity)))
            .collect();
        let outcomes =
            handoff::write_host_blocks(&self.store, &self.host_layout, &self.host_region, &items);
        drop(items);
        let mut complete = Vec::new();
        for ((slot, identity), outcome) in slots.into_iter().zip(identities).zip(outcomes) {
            match outcome {
                WriteOutcome::Stored => complete.push(slot.complete(identity)),
                WriteOutcome::Refused | WriteOutcome::Failed(_) => {
                    add(&self.metrics.offload_skipped_blocks, 1)
                }
            }
        }
        add(&self.metrics.offload_blocks_h2d, complete.len() as u64);
        if let Err(rejected) = self.pool.register_all(complete) {
            unreachable!("slots come from the disk pool: {}", rejected.reason);
        }
        self.finish(host_blocks);
    }

    /// The batch is done (written, failed or skipped): its host blocks are released *before*
    /// anyone waiting for idleness is told, and its hashes may be admitted again.
    fn finish(&self, host_blocks: Vec<RegisteredBlock>) {
        let hashes: Vec<SequenceHash> = host_blocks
            .iter()
            .map(RegisteredBlock::sequence_hash)
            .collect();
        drop(host_blocks);
        {
            let mut writing = self.writing.lock();
            for hash in &hashes {
                writing.remove(hash);
            }
        }
        let mut busy = self.busy.lock();
        *busy -= 1;
        if *busy == 0 {
            self.idle_cv.notify_all();
        }
    }
}

impl handoff::PinnedPool for DiskShared {
    fn parts(&self) -> (&DiskStore, &BlockLayout, &HostRegion) {
        (&self.store, &self.host_layout, &self.host_region)
    }

    fn registered(&self, ok: bool) {
        *self.registered.lock() = Some(ok);
        self.registered_cv.notify_all();
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // Finish queued writes, then leave a checkpoint so that the next start need not scan.
        drop(self.sender.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
        if let Err(err) = self.shared.store.checkpoint() {
            tracing::warn!(error = %err, "could not write the disk checkpoint; the next start scans");
        }
    }
}
