//! `Leader`: the scheduler side's logical state of the host tier.
//!
//! Invariants:
//! - Block ids handed to workers (loads and saves) stay held for two more steps (`end_step`), so
//!   that no block a worker may still be copying is evicted and handed out again meanwhile. The
//!   worker orders its copies (a step's loads wait for the previous steps' saves), so a block may
//!   be findable as soon as its save is scheduled.
//! - Events come from the pool (one `BlockStored` per run of chained blocks, `BlockRemoved` on
//!   eviction) through a bounded subscription; what overflows is counted in `events_lost`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use std::time::Instant;

use kvbm_core::disk::{encode_identity, Admission, ADMISSION_HALF_LIFE};
use kvbm_core::pool::{BlockIdentity, BlockPool, ImmutableBlock, MutableBlock};
use kvbm_events::{BlockHasher, EventPublisher, EventSubscriber, KvEvent, SequenceHash, Tier};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{guard, LayoutError};

/// Events queued for `take_events` at most (beyond it they are dropped and counted).
const EVENT_QUEUE_MAX: usize = 1 << 20;

/// Steps a block handed to workers stays held.
const HOLD_STEPS: u64 = 2;

/// One event as Python sees it: (kind, medium, block hashes, parent, token ids, block size,
/// lora name).
type EventTuple = (
    &'static str,
    &'static str,
    Vec<u64>,
    Option<u64>,
    Vec<u32>,
    u32,
    Option<String>,
);

/// One block to offload: (sequence hash, parent hash, its tokens).
type OffloadBlock = (u64, Option<u64>, Vec<u32>);

/// One request's newly complete blocks: (their tokens, the hash before them, lora, salt).
type TokenRun = (Vec<u32>, Option<u64>, Option<String>, Option<String>);

/// What `offload_tokens` returns per request: (sequence hashes, host block per block or None).
type Offloaded = (Vec<u64>, Vec<Option<u32>>);

/// A block about to be registered in the host tier.
struct Planned {
    hash: u64,
    parent: Option<u64>,
    tokens: Arc<[u32]>,
    lora: Option<Arc<str>>,
}

/// A disk read for a load: (disk block, staging host block, key).
type DiskRead = (u32, u32, u64);

/// A disk write: (host block, disk block, key, identity bytes for the block's header).
type DiskWrite = (u32, u32, u64, Vec<u8>);

/// What a load needs: the host blocks of the host part, then the disk reads of the rest.
type LoadPlan = (Vec<u32>, Vec<DiskRead>);

/// The scheduler side's host tier: a pool of block ids with a registry, LRU eviction and events.
#[pyclass(module = "kvbm._kvbm")]
pub struct Leader {
    block_size: usize,
    host: BlockPool,
    disk: Option<BlockPool>,
    admission: Admission,
    /// Host blocks admitted to disk, waiting for `take_disk_writes`.
    admitted: Vec<ImmutableBlock>,
    /// Staging host blocks of disk loads (never registered), with their step.
    staging: VecDeque<(u64, Vec<MutableBlock>)>,
    /// What an asynchronous load holds, by request, until `release`.
    pinned: HashMap<String, (Vec<ImmutableBlock>, Vec<MutableBlock>)>,
    _publisher: EventPublisher,
    events: EventSubscriber,
    events_lost: u64,
    /// Blocks handed out, with the step they were handed out in.
    held: VecDeque<(u64, Vec<ImmutableBlock>)>,
    step: u64,
}

impl std::fmt::Debug for Leader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leader")
            .field("block_size", &self.block_size)
            .field("host", &self.host.counts())
            .field("step", &self.step)
            .finish()
    }
}

fn hashes(v: &[u64]) -> Vec<SequenceHash> {
    v.iter().copied().map(SequenceHash).collect()
}

#[pymethods]
impl Leader {
    /// A host tier of `host_blocks` blocks of `block_size` tokens, and a disk tier of
    /// `disk_blocks` (0: none). Host blocks go to disk when seen twice (registered, then matched
    /// again) within about ten minutes, or at once with `disk_filter_disabled`.
    #[new]
    #[pyo3(signature = (block_size, host_blocks, disk_blocks=0, disk_filter_disabled=false))]
    fn new(
        block_size: usize,
        host_blocks: usize,
        disk_blocks: usize,
        disk_filter_disabled: bool,
    ) -> PyResult<Self> {
        guard(|| {
            if block_size == 0 {
                return Err(LayoutError::new_err("block_size must be at least 1"));
            }
            if host_blocks.max(disk_blocks) >= u32::MAX as usize {
                return Err(LayoutError::new_err(format!(
                    "{host_blocks} host / {disk_blocks} disk blocks: block ids are 32-bit"
                )));
            }
            let publisher = EventPublisher::new();
            let events = publisher.subscribe(EVENT_QUEUE_MAX);
            let host = BlockPool::new(Tier::Host, host_blocks, block_size, Some(publisher.clone()));
            let disk = (disk_blocks > 0).then(|| {
                BlockPool::new(Tier::Disk, disk_blocks, block_size, Some(publisher.clone()))
            });
            Ok(Self {
                block_size,
                host,
                disk,
                admission: Admission::new(disk_filter_disabled, ADMISSION_HALF_LIFE),
                admitted: Vec::new(),
                staging: VecDeque::new(),
                pinned: HashMap::new(),
                _publisher: publisher,
                events,
                events_lost: 0,
                held: VecDeque::new(),
                step: 0,
            })
        })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// The current step (incremented by `end_step`).
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }

    /// How many of `hashes`, from the first, the host tier holds (no side effects).
    fn count_prefix(&self, hashes_: Vec<u64>) -> PyResult<usize> {
        guard(|| Ok(self.host.count_prefix(&hashes(&hashes_))))
    }

    /// How many of `hashes`, from the first, the host tier holds, then how many more continue
    /// on disk and can be loaded now (each needs a free or evictable host block to stage it).
    /// No side effects.
    fn count_prefix_tiers(&self, hashes_: Vec<u64>) -> PyResult<(usize, usize)> {
        guard(|| {
            let h = hashes(&hashes_);
            let host = self.host.count_prefix(&h);
            let disk = self.disk.as_ref().map_or(0, |d| d.count_prefix(&h[host..]));
            let counts = self.host.counts();
            let staging = counts.free + counts.idle;
            // The host blocks of the host part are idle now but get held for the load.
            let staging = staging.saturating_sub(host.min(counts.idle));
            Ok((host, disk.min(staging)))
        })
    }

    /// Holds what a load of `hashes` needs: the host blocks of the held prefix, then for the
    /// blocks continuing it on disk, the disk block, a staging host block to read it into, and
    /// its key. Shorter than asked when blocks were evicted since they were counted or no
    /// staging block is free. Host hits count as sightings for disk admission.
    ///
    /// The blocks stay held two steps, or, with `request_id` (an asynchronous load, which may
    /// take longer), until `release(request_id)`.
    #[pyo3(signature = (hashes_, request_id=None))]
    fn plan_load(&mut self, hashes_: Vec<u64>, request_id: Option<String>) -> PyResult<LoadPlan> {
        guard(|| {
            let mut held_blocks = Vec::new();
            let mut staged = Vec::new();
            let h = hashes(&hashes_);
            let held = self.host.hold_prefix(&h);
            let host_ids: Vec<u32> = held.blocks().iter().map(|(id, _)| id.0).collect();
            let host_blocks = held.into_blocks();
            let now = Instant::now();
            for b in &host_blocks {
                self.sight(b, now);
            }
            held_blocks.extend(host_blocks);
            let mut reads = Vec::new();
            if let Some(disk) = &self.disk {
                let rest = &h[host_ids.len()..];
                if !rest.is_empty() {
                    let on_disk = disk.hold_prefix(rest);
                    let staging = self.host.allocate_up_to(on_disk.len());
                    for ((id, hash), stage) in on_disk.blocks().iter().zip(&staging) {
                        reads.push((id.0, stage.id().0, hash.0));
                    }
                    held_blocks.extend(on_disk.into_blocks());
                    staged = staging;
                }
            }
            match request_id {
                Some(rid) => {
                    let entry = self.pinned.entry(rid).or_default();
                    entry.0.extend(held_blocks);
                    entry.1.extend(staged);
                }
                None => {
                    self.keep(held_blocks);
                    if !staged.is_empty() {
                        self.staging.push_back((self.step, staged));
                    }
                }
            }
            Ok((host_ids, reads))
        })
    }

    /// Releases what an asynchronous load of `request_id` held (when its load finished).
    fn release(&mut self, request_id: &str) -> PyResult<bool> {
        guard(|| Ok(self.pinned.remove(request_id).is_some()))
    }

    /// The disk writes of the blocks admitted since the last call: each gets a disk block,
    /// registered (and announced) now; the workers write it from its host block.
    fn take_disk_writes(&mut self) -> PyResult<Vec<DiskWrite>> {
        guard(|| {
            let admitted = std::mem::take(&mut self.admitted);
            let Some(disk) = &self.disk else {
                return Ok(Vec::new());
            };
            let fresh = disk.allocate_up_to(admitted.len());
            let mut completed = Vec::with_capacity(fresh.len());
            let mut sources = Vec::with_capacity(fresh.len());
            for (slot, host_block) in fresh.into_iter().zip(admitted) {
                completed.push(slot.complete(host_block.identity()));
                sources.push(host_block);
            }
            let registered = disk
                .register_all(completed)
                .map_err(|r| LayoutError::new_err(r.reason))?;
            let mut writes = Vec::with_capacity(registered.len());
            let mut seen = HashSet::with_capacity(registered.len());
            for (d, h) in registered.iter().zip(&sources) {
                if seen.insert(d.id().0) {
                    writes.push((
                        h.id().0,
                        d.id().0,
                        h.sequence_hash().0,
                        encode_identity(&h.identity()),
                    ));
                }
            }
            // Both ends stay held while the workers copy.
            self.keep(registered);
            self.keep(sources);
            Ok(writes)
        })
    }

    /// Registers the blocks not in the host tier yet and returns, per block, the host block id to
    /// save it into (None when it is there already or the tier has no block to spare).
    #[pyo3(signature = (blocks, lora_name=None))]
    fn offload(
        &mut self,
        blocks: Vec<OffloadBlock>,
        lora_name: Option<String>,
    ) -> PyResult<Vec<Option<u32>>> {
        guard(|| {
            let lora: Option<Arc<str>> = lora_name.map(Arc::from);
            let planned = blocks
                .into_iter()
                .map(|(hash, parent, tokens)| Planned {
                    hash,
                    parent,
                    tokens: Arc::from(tokens),
                    lora: lora.clone(),
                })
                .collect();
            self.register_blocks(planned)
        })
    }

    /// The whole offload of a step in one call: per request, the tokens of its blocks that
    /// became complete (whole blocks), the sequence hash before them, its LoRA name and cache
    /// salt. Hashes the blocks, registers those not in the host tier yet, and returns per request
    /// (the blocks' sequence hashes, the host block id to save each into or None).
    fn offload_tokens(
        &mut self,
        py: Python<'_>,
        requests: Vec<TokenRun>,
    ) -> PyResult<Vec<Offloaded>> {
        guard(|| {
            let b = self.block_size;
            if let Some((tokens, ..)) = requests.iter().find(|r| r.0.len() % b != 0) {
                return Err(LayoutError::new_err(format!(
                    "{} tokens are not whole blocks of {b}",
                    tokens.len()
                )));
            }
            let hashed: Vec<Vec<u64>> = py.allow_threads(|| {
                requests
                    .iter()
                    .map(|(tokens, parent, lora, salt)| {
                        BlockHasher::new(b, lora.as_deref(), salt.as_deref())
                            .sequence_hashes(parent.map(SequenceHash), tokens)
                            .into_iter()
                            .map(|h| h.0)
                            .collect()
                    })
                    .collect()
            });
            let mut planned = Vec::with_capacity(hashed.iter().map(Vec::len).sum());
            for ((tokens, parent, lora, _), hashes) in requests.iter().zip(&hashed) {
                let lora: Option<Arc<str>> = lora.as_deref().map(Arc::from);
                let mut prev = *parent;
                for (hash, block) in hashes.iter().zip(tokens.chunks_exact(b)) {
                    planned.push(Planned {
                        hash: *hash,
                        parent: prev,
                        tokens: Arc::from(block),
                        lora: lora.clone(),
                    });
                    prev = Some(*hash);
                }
            }
            let mut ids = self.register_blocks(planned)?.into_iter();
            Ok(hashed
                .into_iter()
                .map(|hashes| {
                    let host = ids.by_ref().take(hashes.len()).collect();
                    (hashes, host)
                })
                .collect())
        })
    }

    /// Ends a step: blocks handed out `HOLD_STEPS` steps ago become evictable again.
    fn end_step(&mut self) -> PyResult<()> {
        guard(|| {
            self.step += 1;
            while self
                .held
                .front()
                .is_some_and(|(s, _)| s + HOLD_STEPS <= self.step)
            {
                self.held.pop_front();
            }
            while self
                .staging
                .front()
                .is_some_and(|(s, _)| s + HOLD_STEPS <= self.step)
            {
                self.staging.pop_front();
            }
            Ok(())
        })
    }

    /// Drops every held block and clears the host tier's registry (one `AllBlocksCleared`).
    fn reset(&mut self) -> PyResult<()> {
        guard(|| {
            // Asynchronous loads in flight keep their blocks: the reset then refuses (busy).
            self.held.clear();
            self.staging.clear();
            self.admitted.clear();
            let mut pools = vec![&self.host];
            pools.extend(self.disk.as_ref());
            kvbm_core::pool::clear_across(&pools).map_err(|e| LayoutError::new_err(e.to_string()))
        })
    }

    /// The events since the last call, as (kind, medium, hashes, parent, tokens, block size,
    /// lora name) with kind "stored", "removed" or "cleared".
    fn take_events(&mut self) -> PyResult<Vec<EventTuple>> {
        guard(|| {
            let mut out = Vec::new();
            while let Some(d) = self.events.try_recv() {
                self.events_lost += d.missed_before;
                out.push(match &d.record.event {
                    KvEvent::BlockStored(s) => (
                        "stored",
                        s.tier.medium_name(),
                        s.block_hashes.iter().map(|h| h.0).collect(),
                        s.parent_hash.map(|h| h.0),
                        s.token_ids.clone(),
                        s.block_size,
                        s.lora_name.clone(),
                    ),
                    KvEvent::BlockRemoved(r) => (
                        "removed",
                        r.tier.medium_name(),
                        r.block_hashes.iter().map(|h| h.0).collect(),
                        None,
                        Vec::new(),
                        0,
                        None,
                    ),
                    KvEvent::AllBlocksCleared => {
                        ("cleared", "", Vec::new(), None, Vec::new(), 0, None)
                    }
                });
            }
            Ok(out)
        })
    }

    /// The host tier's counts (capacity, free, registered, idle, held, evictions), the disk
    /// tier's (`disk_`-prefixed) and `events_lost`.
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let c = self.host.counts();
            let d = PyDict::new(py);
            if let Some(disk) = &self.disk {
                let k = disk.counts();
                d.set_item("disk_capacity", k.capacity)?;
                d.set_item("disk_registered", k.registered)?;
                d.set_item("disk_held", k.registered - k.idle)?;
                d.set_item("disk_evictions", k.evictions)?;
            }
            d.set_item("capacity", c.capacity)?;
            d.set_item("free", c.free)?;
            d.set_item("registered", c.registered)?;
            d.set_item("idle", c.idle)?;
            d.set_item("held", c.registered - c.idle)?;
            d.set_item("evictions", c.evictions)?;
            d.set_item("deduplicated", c.deduplicated)?;
            d.set_item("events_lost", self.events_lost)?;
            Ok(d)
        })
    }

    /// The hashes a tier ("host" or "disk") holds (for checks).
    #[pyo3(signature = (tier="host"))]
    fn registered_hashes(&self, tier: &str) -> PyResult<Vec<u64>> {
        guard(|| {
            let pool = match tier {
                "host" => Some(&self.host),
                "disk" => self.disk.as_ref(),
                other => {
                    return Err(LayoutError::new_err(format!(
                        "tier {other:?}: expected host or disk"
                    )))
                }
            };
            Ok(pool.map_or(Vec::new(), |p| {
                p.registered_hashes().into_iter().map(|h| h.0).collect()
            }))
        })
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

impl Leader {
    /// Registers the planned blocks not in the host tier yet; per block, the host block to save
    /// it into, or None (already there, a duplicate in the list, or no block to spare).
    fn register_blocks(&mut self, blocks: Vec<Planned>) -> PyResult<Vec<Option<u32>>> {
        if let Some(b) = blocks.iter().find(|b| b.tokens.len() != self.block_size) {
            return Err(LayoutError::new_err(format!(
                "block {:#x} has {} tokens, blocks have {}",
                b.hash,
                b.tokens.len(),
                self.block_size
            )));
        }
        let mut out = vec![None; blocks.len()];
        let missing: Vec<usize> = (0..blocks.len())
            .filter(|&i| !self.host.contains(SequenceHash(blocks[i].hash)))
            .collect();
        let mut completed = Vec::with_capacity(missing.len());
        let mut positions = Vec::with_capacity(missing.len());
        let fresh = self.host.allocate_up_to(missing.len());
        for (block, &i) in fresh.into_iter().zip(&missing) {
            let planned = &blocks[i];
            completed.push(block.complete(BlockIdentity {
                sequence_hash: SequenceHash(planned.hash),
                parent: planned.parent.map(SequenceHash),
                tokens: planned.tokens.clone(),
                lora_name: planned.lora.clone(),
            }));
            positions.push(i);
        }
        let registered = self
            .host
            .register_all(completed)
            .map_err(|r| LayoutError::new_err(r.reason))?;
        let mut kept = Vec::with_capacity(registered.len());
        let mut seen = HashSet::with_capacity(registered.len());
        let now = Instant::now();
        for (block, i) in registered.into_iter().zip(positions) {
            // A duplicate within this list resolves to the block registered first: save once.
            if seen.insert(block.id().0) {
                out[i] = Some(block.id().0);
                self.sight(&block, now);
            }
            kept.push(block);
        }
        self.keep(kept);
        Ok(out)
    }

    /// A sighting of a host block for disk admission; admitted blocks not on disk yet queue for
    /// `take_disk_writes` (held meanwhile).
    fn sight(&mut self, block: &ImmutableBlock, now: Instant) {
        let Some(disk) = &self.disk else {
            return;
        };
        let hash = block.sequence_hash();
        if self.admission.observe(hash, now)
            && !disk.contains(hash)
            && !self.admitted.iter().any(|b| b.sequence_hash() == hash)
        {
            self.admitted.push(block.clone());
        }
    }

    fn keep(&mut self, blocks: Vec<ImmutableBlock>) {
        if blocks.is_empty() {
            return;
        }
        match self.held.back_mut() {
            Some((s, v)) if *s == self.step => v.extend(blocks),
            _ => self.held.push_back((self.step, blocks)),
        }
    }
}
