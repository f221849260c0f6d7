//! The router's index: which worker holds which block in which tier, fed from decoded events.
//!
//! Invariants:
//! - A (worker, tier, block) holding is reference-counted: engines store and remove one hash
//!   several times; the holding exists while its count is above zero.
//! - Removing a worker (or a `Cleared` event from it) drops all its holdings.
//! - Each worker holds at most `blocks_per_worker_max` (block, tier) holdings; stores beyond that
//!   are refused and counted, never grown without bound.
//! - `find_matches` follows DESIGN.md: per worker, the contiguous GPU prefix of the request,
//!   then the blocks that continue it in host memory, then on disk, tier by tier.
//!
//! Layout: one hash map from block hash to its holders, with the first holder stored inline
//! (most blocks belong to one worker) and the rest in a small vector.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::router::selector::{Overlap, WorkerKey};
use crate::wire::{Location, WireEvent};
use crate::{PassThroughBuildHasher, Tier};

/// Default limit of (block, tier) holdings per worker.
pub const BLOCKS_PER_WORKER_MAX_DEFAULT: usize = 1 << 24;

/// What applying an event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyStatus {
    /// Applied.
    Ok,
    /// About a shared or remote pool: not indexed.
    NotLocal,
    /// A removal of blocks the worker did not hold (counted; the rest was applied).
    BlockNotFound,
    /// Stores beyond the worker's limit were refused.
    WorkerFull,
}

impl ApplyStatus {
    /// The `status` label of `kv_cache_events_applied`.
    pub fn label(self) -> &'static str {
        match self {
            ApplyStatus::Ok => "ok",
            ApplyStatus::NotLocal => "not_local",
            ApplyStatus::BlockNotFound => "block_not_found",
            ApplyStatus::WorkerFull => "worker_full",
        }
    }
}

/// One worker's references to one block, per tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holding {
    worker: u32,
    counts: [u16; 3],
}

impl Holding {
    /// One reference in tier `t`.
    fn new(worker: u32, t: usize) -> Self {
        let mut counts = [0; 3];
        counts[t] = 1;
        Self { worker, counts }
    }

    fn is_empty(&self) -> bool {
        self.counts == [0; 3]
    }
}

#[derive(Debug, Clone)]
enum Holders {
    One(Holding),
    Many(Vec<Holding>),
}

impl Holders {
    fn as_slice(&self) -> &[Holding] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(v) => v,
        }
    }

    fn find_mut(&mut self, worker: u32) -> Option<&mut Holding> {
        match self {
            Holders::One(h) => (h.worker == worker).then_some(h),
            Holders::Many(v) => v.iter_mut().find(|h| h.worker == worker),
        }
    }

    fn push(&mut self, holding: Holding) {
        match self {
            Holders::One(first) => *self = Holders::Many(vec![*first, holding]),
            Holders::Many(v) => v.push(holding),
        }
    }

    /// Drops empty holdings; false when none is left.
    fn compact(&mut self) -> bool {
        match self {
            Holders::One(h) => !h.is_empty(),
            Holders::Many(v) => {
                v.retain(|h| !h.is_empty());
                match v.len() {
                    0 => false,
                    1 => {
                        *self = Holders::One(v[0]);
                        true
                    }
                    _ => true,
                }
            }
        }
    }
}

#[derive(Debug, Clone, Default)]
struct WorkerState {
    key: WorkerKey,
    /// Holdings per tier.
    blocks: [usize; 3],
    live: bool,
}

/// The index of every worker's blocks per tier.
pub struct KvIndex {
    blocks: HashMap<u64, Holders, PassThroughBuildHasher>,
    workers: Vec<WorkerState>,
    by_key: HashMap<WorkerKey, u32>,
    blocks_per_worker_max: usize,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("blocks", &self.blocks.len())
            .field("workers", &self.by_key.len())
            .finish()
    }
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(BLOCKS_PER_WORKER_MAX_DEFAULT)
    }
}

impl KvIndex {
    /// An empty index allowing each worker `blocks_per_worker_max` holdings.
    pub fn new(blocks_per_worker_max: usize) -> Self {
        Self {
            blocks: HashMap::default(),
            workers: Vec::new(),
            by_key: HashMap::new(),
            blocks_per_worker_max,
        }
    }

    fn worker_index(&mut self, key: WorkerKey) -> u32 {
        if let Some(&i) = self.by_key.get(&key) {
            return i;
        }
        let i = match self.workers.iter().position(|w| !w.live) {
            Some(free) => free,
            None => {
                self.workers.push(WorkerState::default());
                self.workers.len() - 1
            }
        };
        self.workers[i] = WorkerState {
            key,
            blocks: [0; 3],
            live: true,
        };
        self.by_key.insert(key, i as u32);
        i as u32
    }

    /// Applies one decoded event from `worker`.
    pub fn apply(&mut self, worker: WorkerKey, event: &WireEvent) -> ApplyStatus {
        match event {
            WireEvent::Cleared => {
                self.remove_worker(worker);
                ApplyStatus::Ok
            }
            WireEvent::Stored {
                location: Location::Local(tier),
                block_hashes,
                ..
            } => self.store(worker, *tier, block_hashes),
            WireEvent::Removed {
                location: Location::Local(tier),
                block_hashes,
            } => self.remove(worker, *tier, block_hashes),
            WireEvent::Stored { .. } | WireEvent::Removed { .. } => ApplyStatus::NotLocal,
        }
    }

    /// Records that `worker` stored `hashes` in `tier`.
    pub fn store(&mut self, worker: WorkerKey, tier: Tier, hashes: &[u64]) -> ApplyStatus {
        let w = self.worker_index(worker);
        let t = tier.index();
        let mut status = ApplyStatus::Ok;
        for &hash in hashes {
            let total: usize = self.workers[w as usize].blocks.iter().sum();
            let full = total >= self.blocks_per_worker_max;
            // One lookup; `added` when the worker starts holding the block in this tier.
            let added = match self.blocks.entry(hash) {
                Entry::Occupied(mut e) => match e.get_mut().find_mut(w) {
                    Some(h) if h.counts[t] > 0 => {
                        h.counts[t] = h.counts[t].saturating_add(1);
                        false
                    }
                    Some(h) if !full => {
                        h.counts[t] = 1;
                        true
                    }
                    None if !full => {
                        e.get_mut().push(Holding::new(w, t));
                        true
                    }
                    _ => {
                        status = ApplyStatus::WorkerFull;
                        false
                    }
                },
                Entry::Vacant(e) if !full => {
                    e.insert(Holders::One(Holding::new(w, t)));
                    true
                }
                Entry::Vacant(_) => {
                    status = ApplyStatus::WorkerFull;
                    false
                }
            };
            if added {
                self.workers[w as usize].blocks[t] += 1;
            }
        }
        status
    }

    /// Records that `worker` removed `hashes` from `tier` (one reference each).
    pub fn remove(&mut self, worker: WorkerKey, tier: Tier, hashes: &[u64]) -> ApplyStatus {
        let Some(&w) = self.by_key.get(&worker) else {
            return if hashes.is_empty() {
                ApplyStatus::Ok
            } else {
                ApplyStatus::BlockNotFound
            };
        };
        let t = tier.index();
        let mut status = ApplyStatus::Ok;
        for hash in hashes {
            let Some(holders) = self.blocks.get_mut(hash) else {
                status = ApplyStatus::BlockNotFound;
                continue;
            };
            match holders.find_mut(w) {
                Some(h) if h.counts[t] > 0 => {
                    h.counts[t] -= 1;
                    if h.counts[t] == 0 {
                        self.workers[w as usize].blocks[t] -= 1;
                    }
                }
                _ => {
                    status = ApplyStatus::BlockNotFound;
                    continue;
                }
            }
            if !holders.compact() {
                self.blocks.remove(hash);
            }
        }
        status
    }

    /// Drops everything `worker` holds.
    pub fn remove_worker(&mut self, worker: WorkerKey) {
        let Some(w) = self.by_key.remove(&worker) else {
            return;
        };
        self.blocks.retain(|_, holders| {
            if let Some(h) = holders.find_mut(w) {
                h.counts = [0; 3];
            }
            holders.compact()
        });
        self.workers[w as usize] = WorkerState::default();
    }

    /// Blocks `worker` holds in `tier`.
    pub fn blocks_in(&self, worker: WorkerKey, tier: Tier) -> usize {
        self.by_key
            .get(&worker)
            .map_or(0, |&w| self.workers[w as usize].blocks[tier.index()])
    }

    /// Workers indexed.
    pub fn workers(&self) -> Vec<WorkerKey> {
        let mut keys: Vec<WorkerKey> = self.by_key.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Distinct blocks indexed.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Per worker holding any of the prefix: its GPU prefix, then host and disk continuations.
    pub fn find_matches(&self, hashes: &[u64]) -> Vec<(WorkerKey, Overlap)> {
        #[derive(Clone, Copy)]
        struct Progress {
            /// 0 GPU, 1 host, 2 disk.
            phase: usize,
            /// The last request position matched.
            last: usize,
            overlap: Overlap,
        }
        let mut progress: Vec<Option<Progress>> = vec![None; self.workers.len()];
        let mut touched: Vec<u32> = Vec::new();
        for (i, hash) in hashes.iter().enumerate() {
            let Some(holders) = self.blocks.get(hash) else {
                break;
            };
            let mut active = 0usize;
            for h in holders.as_slice() {
                let slot = &mut progress[h.worker as usize];
                // The first tier, from the worker's current phase on, that holds this block.
                let start_phase = match slot {
                    None if i == 0 => 0,
                    Some(p) if p.last + 1 == i => p.phase,
                    _ => continue, // not contiguous: this worker's match ended earlier
                };
                let Some(phase) = (start_phase..3).find(|&t| h.counts[t] > 0) else {
                    continue;
                };
                let p = slot.get_or_insert_with(|| {
                    touched.push(h.worker);
                    Progress {
                        phase,
                        last: i,
                        overlap: Overlap::default(),
                    }
                });
                p.phase = phase;
                p.last = i;
                match phase {
                    0 => p.overlap.gpu += 1,
                    1 => p.overlap.host += 1,
                    _ => p.overlap.disk += 1,
                }
                active += 1;
            }
            if active == 0 {
                break;
            }
        }
        touched
            .into_iter()
            .map(|w| {
                (
                    self.workers[w as usize].key,
                    progress[w as usize].expect("touched").overlap,
                )
            })
            .collect()
    }
}
