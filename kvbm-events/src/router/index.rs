//! The router's index: which worker holds which block in which tier, fed from decoded events.
//!
//! Events speak the engine's hashes; the index is keyed by the block identity the router computes
//! from each stored block's tokens ([`crate::router::translate`]): [`KvIndex::apply`] translates,
//! [`KvIndex::store`] and [`KvIndex::remove`] take identities directly.
//!
//! Invariants:
//! - A (worker, tier, block) holding is reference-counted: engines store and remove one hash
//!   several times; the holding exists while its count is above zero.
//! - Removing a worker (or a `Cleared` event from it) drops all its holdings.
//! - Each worker holds at most `blocks_per_worker_max` (block, tier) holdings; stores beyond that
//!   are refused and counted, never grown without bound.
//! - `find_matches` follows DESIGN.md: per worker, the contiguous GPU prefix of the request,
//!   then the blocks that continue it in host memory, then on disk, tier by tier.
//! - Hybrid workers (vLLM 0.33's KV cache groups, `router::groups`): only events
//!   without a group, or of a prefix group (full attention), make claims. Sliding-window and
//!   Mamba groups' GPU blocks are kept per group and cut the GPU prefix where vLLM's coordinator
//!   would cut the hit; a cut prefix loses its host and disk continuation (it no longer ends
//!   where they start). Their events never add or remove a claim. Group-tagged events of those
//!   groups off the GPU tier, and of groups not modelled, are counted and not indexed. kvbm's
//!   own host and disk events carry no group: they are claims of their tier, as before.
//! - Pages that divide the router's block (SGLang's default page size 1) are regrouped into its
//!   blocks (`router::regroup`): a block is claimed when its last page is stored.
//!
//! Layout, chosen for the two hot paths (applying a store, matching a 512-block prompt):
//! - Every distinct block is a node in an arena of parallel arrays (its hash, its holder set).
//!   Blocks that arrive in one store event are appended next to each other, so a match that
//!   follows a stored run reads the arena sequentially and looks the hash table up only where a
//!   run ends.
//! - Holder sets (per worker, a mask of tiers) are interned: a node holds a 4-byte set id, and
//!   nodes along a stored prefix usually share one set. `find_matches` re-examines its workers only
//!   where the set id changes; elsewhere every active worker advances in its current tier.
//! - The hash table holds node ids only (4 bytes a slot), keyed by the block hash mixed with a
//!   per-index random seed, so crafted hashes from a worker cannot pile into one probe chain.
//! - A second reference to a holding (rare) lives in a side table, not in every node.
//! - Dead nodes are tombstones until more than half of the arena is dead; then the arena is
//!   compacted in order, keeping stored runs contiguous.

use std::collections::HashMap;

use crate::router::groups::WorkerGroups;
use crate::router::mapped::MappedVec;
use crate::router::regroup::Pages;
use crate::router::selector::{Overlap, WorkerKey};
use crate::router::table::BlockTable;
use crate::router::translate::{Names, Refusal, StoredBlocks};
use crate::wire::{Location, WireEvent};
use crate::{GroupKind, GroupRole, Tier};

/// Default limit of (block, tier) holdings per worker.
pub const BLOCKS_PER_WORKER_MAX_DEFAULT: usize = 1 << 24;

/// Most distinct blocks an index can make room for: its node ids are u32, u32::MAX kept as a
/// marker.
pub const INDEX_CAPACITY_BLOCKS_MAX: usize = u32::MAX as usize - 1;

/// How many blocks ahead an event's table buckets are prefetched.
const PREFETCH_DISTANCE: usize = 16;

/// Default number of tombstones tolerated before a compaction is considered.
pub const MIN_TOMBSTONES_DEFAULT: usize = 1 << 16;

/// Shared pools indexed at most (each a pseudo-worker; membership is a 64-bit mask).
pub const POOLS_MAX: usize = 64;
/// The data-parallel rank of a shared pool's pseudo-worker key ([`pool_key`]), which no real
/// worker may use.
pub const POOL_RANK: u32 = u32::MAX;

/// The key of the `i`-th shared pool's pseudo-worker.
pub fn pool_key(i: usize) -> WorkerKey {
    (u64::MAX - i as u64, POOL_RANK)
}

/// Whether `key` is a shared pool's pseudo-worker.
pub fn is_pool_key(key: WorkerKey) -> bool {
    key.1 == POOL_RANK
}

/// What applying an event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyStatus {
    /// Applied.
    Ok,
    /// About a remote store without a pool name, or a medium no tier answers to: not indexed.
    NotLocal,
    /// About a shared pool beyond [`POOLS_MAX`]: not indexed.
    PoolsFull,
    /// A removal of blocks the worker did not hold (counted; the rest was applied).
    BlockNotFound,
    /// Stores beyond the worker's limit were refused.
    WorkerFull,
    /// A store whose parent's engine hash the worker never stored (or removed since): refused.
    ParentUnknown,
    /// A store with a block size that is neither the router's nor a divisor of it (pages that
    /// divide it, such as SGLang's page size 1, are regrouped): refused.
    BlockSizeMismatch,
    /// A store whose tokens are not its blocks: refused.
    Malformed,
    /// A store of blocks the router cannot identify (multimodal inputs, prompt embeddings, a LoRA
    /// known only by id): the blocks before the first such one were applied.
    Unhashable,
    /// A store naming an engine hash the worker uses for another block: the blocks before it
    /// were applied.
    HashConflict,
}

impl From<Refusal> for ApplyStatus {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::BlockSizeMismatch => ApplyStatus::BlockSizeMismatch,
            Refusal::ParentUnknown => ApplyStatus::ParentUnknown,
            Refusal::Malformed => ApplyStatus::Malformed,
            Refusal::Unhashable => ApplyStatus::Unhashable,
            Refusal::HashConflict => ApplyStatus::HashConflict,
            Refusal::WorkerFull => ApplyStatus::WorkerFull,
        }
    }
}

impl ApplyStatus {
    /// The `status` label of `kv_cache_events_applied`.
    pub fn label(self) -> &'static str {
        match self {
            ApplyStatus::Ok => "ok",
            ApplyStatus::NotLocal => "not_local",
            ApplyStatus::PoolsFull => "pools_full",
            ApplyStatus::BlockNotFound => "block_not_found",
            ApplyStatus::WorkerFull => "worker_full",
            ApplyStatus::ParentUnknown => "parent_unknown",
            ApplyStatus::BlockSizeMismatch => "block_size_mismatch",
            ApplyStatus::Malformed => "malformed",
            ApplyStatus::Unhashable => "unhashable",
            ApplyStatus::HashConflict => "hash_conflict",
        }
    }
}

/// One engine hash of a worker, as a snapshot keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameEntry {
    /// The engine's hash.
    pub engine: u64,
    /// The block identity it stands for.
    pub ours: u64,
    /// The namespace term of its prompt.
    pub namespace: u64,
    /// Stores not matched by a removal yet.
    pub refs: u32,
}

/// One holding of a worker, as a snapshot keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// The tier.
    pub tier: Tier,
    /// The block identity.
    pub hash: u64,
    /// References (stores not matched by a removal).
    pub count: u32,
}

/// A KV cache group of a worker, as its stores described it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupEntry {
    /// The group's index (vLLM's `group_idx`).
    pub group: u32,
    /// Its kind.
    pub kind: GroupKind,
    /// Its sliding window in tokens, when it has one.
    pub window: Option<u32>,
}

/// A block a sliding-window or Mamba group of a worker holds on GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupHolding {
    /// The group's index.
    pub group: u32,
    /// The block identity; the engine hash when `pending`.
    pub hash: u64,
    /// References.
    pub count: u32,
    /// A store waiting for a prefix group's store to name its engine hash.
    pub pending: bool,
}

/// A page smaller than the router's block (SGLang's page size 1) of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageEntry {
    /// The page's engine hash.
    pub engine: u64,
    /// The engine hash of the page before it.
    pub parent: Option<u64>,
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// Pages of its router block up to and including it.
    pub index: u32,
    /// The identity of the router block before its block.
    pub prev_block: Option<u64>,
    /// The identity of the router block it completes, when it does.
    pub block: Option<u64>,
    /// The namespace term of its prompt.
    pub namespace: u64,
    /// Stores not matched by a removal yet.
    pub refs: u32,
}

/// Everything the index knows of one worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerSnapshot {
    /// The worker.
    pub worker: WorkerKey,
    /// Its engine hashes.
    pub names: Vec<NameEntry>,
    /// Its holdings.
    pub holdings: Vec<Holding>,
    /// Its KV cache groups (hybrid models).
    pub groups: Vec<GroupEntry>,
    /// Its sliding-window and Mamba groups' blocks.
    pub group_holdings: Vec<GroupHolding>,
    /// Its pages smaller than a block.
    pub pages: Vec<PageEntry>,
}

/// The empty set; a node whose set is empty is dead.
const EMPTY: u32 = 0;

/// A holder set as bits: for each group of 64 workers (by worker index), three words (GPU, host,
/// disk) with bit `w % 64` set when worker `w` holds the block in that tier. Trailing all-zero
/// groups are trimmed, so that equal sets have equal bits.
type Bits = Box<[u64]>;

#[derive(Debug, Default)]
struct HolderSet {
    bits: Bits,
    /// Nodes pointing at this set.
    refs: u32,
}

/// The tiers (bit `t` for tier `t`) worker `w` holds in `bits`.
#[inline]
fn mask_of(bits: &[u64], w: u32) -> u8 {
    let k = (w / 64) as usize * 3;
    if k >= bits.len() {
        return 0;
    }
    let b = w % 64;
    (((bits[k] >> b) & 1) | (((bits[k + 1] >> b) & 1) << 1) | (((bits[k + 2] >> b) & 1) << 2)) as u8
}

/// The workers of group `k` (any tier).
#[inline]
fn group(bits: &[u64], k: usize) -> u64 {
    match bits.get(3 * k..3 * k + 3) {
        Some(g) => g[0] | g[1] | g[2],
        None => 0,
    }
}

/// Interned holder sets.
#[derive(Debug)]
struct Sets {
    sets: Vec<HolderSet>,
    free: Vec<u32>,
    by_bits: HashMap<Bits, u32>,
    /// Sets whose count reached zero during the current operation; freed at its end, so that a
    /// memoised id cannot be reused for another set mid-operation.
    unreferenced: Vec<u32>,
}

impl Sets {
    fn new() -> Self {
        let mut by_bits = HashMap::new();
        by_bits.insert(Bits::default(), EMPTY);
        Self {
            sets: vec![HolderSet::default()],
            free: Vec::new(),
            by_bits,
            unreferenced: Vec::new(),
        }
    }

    #[inline]
    fn bits(&self, id: u32) -> &[u64] {
        &self.sets[id as usize].bits
    }

    /// The tiers `worker` holds in set `id`.
    #[inline]
    fn mask(&self, id: u32, worker: u32) -> u8 {
        mask_of(self.bits(id), worker)
    }

    /// The id of the set with exactly `bits` (trimmed).
    fn intern(&mut self, bits: Vec<u64>) -> u32 {
        if let Some(&id) = self.by_bits.get(bits.as_slice()) {
            return id;
        }
        let boxed: Bits = bits.into_boxed_slice();
        let set = HolderSet {
            bits: boxed.clone(),
            refs: 0,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.sets[id as usize] = set;
                id
            }
            None => {
                self.sets.push(set);
                (self.sets.len() - 1) as u32
            }
        };
        self.by_bits.insert(boxed, id);
        // Unreferenced until a node points at it; a set created but never used is collected.
        self.unreferenced.push(id);
        id
    }

    /// Set `id` with `worker`'s tiers changed by `f`.
    fn with(&mut self, id: u32, worker: u32, f: impl Fn(u8) -> u8) -> u32 {
        let mut bits = self.bits(id).to_vec();
        let k = (worker / 64) as usize * 3;
        if bits.len() < k + 3 {
            bits.resize(k + 3, 0);
        }
        let mask = f(mask_of(&bits, worker));
        let bit = 1u64 << (worker % 64);
        for t in 0..3 {
            if mask & (1 << t) != 0 {
                bits[k + t] |= bit;
            } else {
                bits[k + t] &= !bit;
            }
        }
        while bits.len() >= 3 && bits[bits.len() - 3..].iter().all(|&x| x == 0) {
            bits.truncate(bits.len() - 3);
        }
        self.intern(bits)
    }

    #[inline(always)]
    fn incref(&mut self, id: u32) {
        if id != EMPTY {
            self.sets[id as usize].refs += 1;
        }
    }

    #[inline(always)]
    fn decref(&mut self, id: u32) {
        if id != EMPTY {
            let set = &mut self.sets[id as usize];
            set.refs -= 1;
            if set.refs == 0 {
                self.unreferenced.push(id);
            }
        }
    }

    /// Frees the sets left without nodes by the operation that just ended.
    fn collect(&mut self) {
        while let Some(id) = self.unreferenced.pop() {
            let set = &mut self.sets[id as usize];
            if set.refs == 0 && !set.bits.is_empty() {
                let bits = std::mem::take(&mut set.bits);
                self.by_bits.remove(&bits);
                self.free.push(id);
            }
        }
    }

    fn live(&self) -> usize {
        self.sets.len() - self.free.len()
    }
}

/// A few (old set -> new set) transitions of the operation in progress: consecutive blocks of one
/// event usually share their set, so each distinct transition is computed once.
#[derive(Debug, Default)]
struct Memo {
    entries: [(u32, u32); 4],
    len: usize,
    next: usize,
}

impl Memo {
    /// The transition of `old`, computed by `compute` the first time.
    #[inline]
    fn get_or(&mut self, old: u32, compute: impl FnOnce() -> u32) -> u32 {
        if let Some(&(_, new)) = self.entries[..self.len].iter().find(|(o, _)| *o == old) {
            return new;
        }
        let new = compute();
        self.entries[self.next] = (old, new);
        self.next = (self.next + 1) % self.entries.len();
        self.len = (self.len + 1).min(self.entries.len());
        new
    }
}

#[derive(Debug, Clone, Default)]
struct WorkerState {
    key: WorkerKey,
    /// Holdings per tier.
    blocks: [usize; 3],
    live: bool,
}

impl WorkerState {
    fn total(&self) -> usize {
        self.blocks.iter().sum()
    }
}

/// The index of every worker's blocks per tier.
pub struct KvIndex {
    /// Node arena: the block hash and the holder set of each node (`EMPTY`: a tombstone).
    hashes: MappedVec<u64>,
    node_sets: MappedVec<u32>,
    dead: usize,
    /// Nodes (live, and tombstones until the next compaction) by block hash.
    table: BlockTable,
    sets: Sets,
    /// References beyond the first, per (node, worker, tier).
    extra: HashMap<(u32, u32, u8), u32>,
    workers: Vec<WorkerState>,
    /// Per worker (same index), its engine hashes.
    names: Vec<Names>,
    /// Per worker (same index), its KV cache groups.
    groups: Vec<WorkerGroups>,
    /// Per worker (same index), its pages smaller than the router's blocks.
    pages: Vec<Pages>,
    /// Tokens per block of the router: stores of another size are refused.
    block_size: u32,
    /// Scratch for translated hashes.
    scratch: Vec<u64>,
    by_key: HashMap<WorkerKey, u32>,
    last_worker: Option<(WorkerKey, u32)>,
    blocks_per_worker_max: usize,
    min_tombstones: usize,
    /// Shared pools by name, in the order first seen (the `i`-th is [`pool_key`]`(i)`).
    pools: Vec<String>,
    /// Per worker, the pools it published into (bit `i`: `pools[i]`): it reaches them.
    members: HashMap<WorkerKey, u64>,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("blocks", &self.distinct_blocks())
            .field("holder_sets", &self.sets.live())
            .field("table_entries", &self.table.len())
            .field("workers", &self.by_key.len())
            .finish()
    }
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(BLOCKS_PER_WORKER_MAX_DEFAULT, BLOCK_SIZE_DEFAULT)
    }
}

/// The block size of [`KvIndex::default`] (vLLM's default).
pub const BLOCK_SIZE_DEFAULT: u32 = 16;

impl KvIndex {
    /// An empty index of blocks of `block_size` tokens, allowing each worker
    /// `blocks_per_worker_max` holdings (and as many engine hashes).
    pub fn new(blocks_per_worker_max: usize, block_size: u32) -> Self {
        Self {
            names: Vec::new(),
            groups: Vec::new(),
            pages: Vec::new(),
            block_size,
            scratch: Vec::new(),
            hashes: MappedVec::new(),
            node_sets: MappedVec::new(),
            dead: 0,
            table: BlockTable::new(rand::random()),
            sets: Sets::new(),
            extra: HashMap::new(),
            workers: Vec::new(),
            by_key: HashMap::new(),
            last_worker: None,
            blocks_per_worker_max,
            min_tombstones: MIN_TOMBSTONES_DEFAULT,
            pools: Vec::new(),
            members: HashMap::new(),
        }
    }

    /// Where an event of `worker` at `location` is indexed: a local tier of the worker's own,
    /// or a shared pool's pseudo-worker (its blocks kept as a disk tier; `worker` becomes one of
    /// its members).
    fn place(
        &mut self,
        worker: WorkerKey,
        location: &Location,
    ) -> Result<(WorkerKey, Tier), ApplyStatus> {
        match location {
            Location::Local(tier) => Ok((worker, *tier)),
            Location::NotLocal(_) => Err(ApplyStatus::NotLocal),
            Location::Shared(name) => {
                let i = self.join(worker, name)?;
                Ok((pool_key(i), Tier::Disk))
            }
        }
    }

    /// Makes `worker` a member of the pool `name` (taking a slot for a pool not seen yet);
    /// returns the pool's slot.
    fn join(&mut self, worker: WorkerKey, name: &str) -> Result<usize, ApplyStatus> {
        let i = match self.pools.iter().position(|p| p == name) {
            Some(i) => i,
            // A slot a dropped pool left (its name cleared), else a new one.
            None => match self.pools.iter().position(String::is_empty) {
                Some(free) => {
                    self.pools[free] = name.to_owned();
                    free
                }
                None if self.pools.len() < POOLS_MAX => {
                    self.pools.push(name.to_owned());
                    self.pools.len() - 1
                }
                None => return Err(ApplyStatus::PoolsFull),
            },
        };
        *self.members.entry(worker).or_insert(0) |= 1 << i;
        Ok(i)
    }

    /// Records that `worker` reaches the shared pool `name` before it has published into it
    /// (an operator said so: every worker of the fleet is configured with the same store), so
    /// that a worker that has not yet written to the pool, a new one above all, is credited with
    /// the blocks the other members put there. Publishing into a pool makes a worker a member
    /// anyway. An empty name is refused (`Malformed`), as is a pool past [`POOLS_MAX`].
    pub fn join_pool(&mut self, worker: WorkerKey, name: &str) -> Result<(), ApplyStatus> {
        if name.is_empty() {
            return Err(ApplyStatus::Malformed);
        }
        if is_pool_key(worker) {
            return Err(ApplyStatus::Malformed);
        }
        self.join(worker, name).map(|_| ())
    }

    /// Forgets that `worker` reaches any shared pool (it left the fleet); a pool no member
    /// reaches any more is dropped with its blocks.
    pub fn forget_member(&mut self, worker: WorkerKey) {
        if self.members.remove(&worker).is_none() {
            return;
        }
        let reached = self.members.values().fold(0u64, |a, m| a | m);
        for i in 0..self.pools.len() {
            if reached & (1 << i) == 0 && !self.pools[i].is_empty() {
                self.remove_worker(pool_key(i));
                // Its slot is free for another pool.
                self.pools[i].clear();
            }
        }
    }

    /// The shared pools: name, blocks indexed, and the workers that reach it.
    pub fn pools(&self) -> Vec<(String, usize, Vec<WorkerKey>)> {
        self.pools
            .iter()
            .enumerate()
            .filter(|(_, name)| !name.is_empty())
            .map(|(i, name)| {
                let blocks = self
                    .by_key
                    .get(&pool_key(i))
                    .map_or(0, |&w| self.workers[w as usize].total());
                let mut members: Vec<WorkerKey> = self
                    .members
                    .iter()
                    .filter(|(_, m)| *m & (1 << i) != 0)
                    .map(|(k, _)| *k)
                    .collect();
                members.sort_unstable();
                (name.clone(), blocks, members)
            })
            .collect()
    }

    /// Credits each member of a shared pool with the pool's blocks beyond its own overlap
    /// (`Overlap::shared`), and drops the pools' pseudo-workers from `out`.
    fn credit_pools(&self, out: &mut Vec<(WorkerKey, Overlap)>) {
        if self.pools.is_empty() {
            return;
        }
        let mut reach = [0usize; POOLS_MAX];
        out.retain(|(key, o)| {
            if !is_pool_key(*key) {
                return true;
            }
            let i = (u64::MAX - key.0) as usize;
            if i < POOLS_MAX {
                reach[i] = o.gpu + o.host + o.disk;
            }
            false
        });
        if reach.iter().all(|&r| r == 0) {
            return;
        }
        for (&worker, &mask) in &self.members {
            let pool = (0..self.pools.len())
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| reach[i])
                .max()
                .unwrap_or(0);
            if pool == 0 {
                continue;
            }
            match out.iter_mut().find(|(k, _)| *k == worker) {
                Some((_, o)) => o.shared = pool.saturating_sub(o.gpu + o.host + o.disk),
                None => out.push((
                    worker,
                    Overlap {
                        shared: pool,
                        ..Overlap::default()
                    },
                )),
            }
        }
    }

    /// Reserves room for `blocks` distinct blocks, so that the index does not grow (and does not
    /// pause to rehash) until it holds more. Memory is mapped now and touched as it fills. Meant
    /// for a new index; on one already holding blocks it does nothing.
    pub fn with_capacity(mut self, blocks: usize) -> Self {
        if !self.hashes.is_empty() {
            return self;
        }
        self.table = BlockTable::with_capacity(rand::random(), blocks);
        self.hashes = MappedVec::with_capacity(blocks);
        self.node_sets = MappedVec::with_capacity(blocks);
        self
    }

    /// Bytes [`Self::with_capacity`] maps for `blocks`; None beyond
    /// [`INDEX_CAPACITY_BLOCKS_MAX`] (node ids are u32) or when the size overflows. A caller
    /// taking the capacity from its user checks it here first: a mapping the system refuses
    /// panics.
    pub fn capacity_bytes(blocks: usize) -> Option<usize> {
        if blocks > INDEX_CAPACITY_BLOCKS_MAX {
            return None;
        }
        let per_block = std::mem::size_of::<u64>() + std::mem::size_of::<u32>();
        blocks
            .checked_mul(per_block)?
            .checked_add(BlockTable::bytes_for(blocks)?)
    }

    /// Sets how many tombstones (nodes of blocks no worker holds any more) are tolerated before
    /// the arena is compacted; compaction also waits until half of the arena is tombstones.
    pub fn with_min_tombstones(mut self, min_tombstones: usize) -> Self {
        self.min_tombstones = min_tombstones;
        self
    }

    #[inline]
    fn lookup(&self, hash: u64) -> Option<u32> {
        let hashes = &self.hashes;
        self.table
            .find(hash, |n| hashes[n as usize] == hash)
            .filter(|&n| self.node_sets[n as usize] != EMPTY)
    }

    /// The node of `hash`, created (without holders) when there is none, revived (no longer
    /// counted as a tombstone) when it is one.
    #[inline]
    fn lookup_or_add(&mut self, hash: u64) -> u32 {
        let (node, new) = self.table.find_or_insert(
            hash,
            |n| self.hashes[n as usize] == hash,
            || self.hashes.len() as u32,
        );
        if new {
            self.hashes.push(hash);
            self.node_sets.push(EMPTY);
        } else if self.node_sets[node as usize] == EMPTY {
            self.dead -= 1;
        }
        node
    }

    /// The index of a known worker; consecutive events usually come from one worker, so the
    /// last answer is kept.
    fn known_worker(&mut self, key: WorkerKey) -> Option<u32> {
        if let Some((k, i)) = self.last_worker {
            if k == key {
                return Some(i);
            }
        }
        let i = *self.by_key.get(&key)?;
        self.last_worker = Some((key, i));
        Some(i)
    }

    fn worker_index(&mut self, key: WorkerKey) -> u32 {
        if let Some(i) = self.known_worker(key) {
            return i;
        }
        let i = match self.workers.iter().position(|w| !w.live) {
            Some(free) => free,
            None => {
                self.workers.push(WorkerState::default());
                self.names.push(Names::new());
                self.groups.push(WorkerGroups::default());
                self.pages.push(Pages::default());
                self.workers.len() - 1
            }
        };
        self.workers[i] = WorkerState {
            key,
            blocks: [0; 3],
            live: true,
        };
        self.names[i].clear();
        self.groups[i].clear();
        self.pages[i].clear();
        self.by_key.insert(key, i as u32);
        i as u32
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Applies one decoded event from `worker`, translating its engine hashes (see
    /// [`crate::router::translate`]).
    pub fn apply(&mut self, worker: WorkerKey, event: &WireEvent) -> ApplyStatus {
        self.apply_and(worker, event, |_, _| {})
    }

    /// As [`Self::apply`], calling `stored` with the tier and the router's hashes of the blocks
    /// a store added (after translation).
    pub fn apply_and(
        &mut self,
        worker: WorkerKey,
        event: &WireEvent,
        mut stored: impl FnMut(Tier, &[u64]),
    ) -> ApplyStatus {
        match event {
            WireEvent::Cleared => {
                self.remove_worker(worker);
                ApplyStatus::Ok
            }
            WireEvent::Stored {
                location,
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
                unhashable_from,
                group,
                group_kind,
                sliding_window,
            } => {
                let (worker, tier) = match self.place(worker, location) {
                    Ok(at) => at,
                    Err(status) => return status,
                };
                let tier = &tier;
                let w = self.worker_index(worker) as usize;
                if let (Some(g), Some(kind)) = (group, group_kind) {
                    self.groups[w].learn(*g, *kind, *sliding_window);
                }
                let cut_group = match self.groups[w].role(*group) {
                    None => None,
                    Some((GroupRole::Window | GroupRole::State, _)) if *tier == Tier::Gpu => *group,
                    Some(_) => return ApplyStatus::Ok,
                };
                let sparse = token_ids.len() != block_hashes.len() * *block_size as usize;
                if let Some(g) = cut_group.filter(|_| sparse && *block_size == self.block_size) {
                    return self.store_sparse(w, g, block_hashes);
                }
                let mut ours = std::mem::take(&mut self.scratch);
                let blocks = StoredBlocks {
                    engine_hashes: block_hashes,
                    parent: *parent,
                    token_ids,
                    block_size: *block_size,
                    lora_name: lora_name.as_deref(),
                    cache_salt: cache_salt.as_deref(),
                    unhashable_from: *unhashable_from,
                };
                let refusal =
                    if cut_group.is_none() && Pages::regroups(*block_size, self.block_size) {
                        // Pages (SGLang's page size 1): the blocks they complete.
                        self.pages[w].store(
                            &blocks,
                            self.block_size,
                            self.blocks_per_worker_max,
                            &mut ours,
                        )
                    } else {
                        self.names[w].store(
                            &blocks,
                            self.block_size,
                            self.blocks_per_worker_max,
                            &mut ours,
                        )
                    };
                let status = if ours.is_empty() {
                    ApplyStatus::Ok
                } else if let Some(g) = cut_group {
                    if self.groups[w].store(g, &ours, self.blocks_per_worker_max) {
                        ApplyStatus::Ok
                    } else {
                        ApplyStatus::WorkerFull
                    }
                } else {
                    let status = self.store(worker, *tier, &ours);
                    stored(*tier, &ours);
                    if self.groups[w].has_pending() {
                        self.place_pending(w, &block_hashes[..ours.len()], &ours);
                    }
                    status
                };
                self.scratch = ours;
                refusal.map_or(status, ApplyStatus::from)
            }
            WireEvent::Removed {
                location,
                block_hashes,
                group,
            } => {
                let (worker, tier) = match self.place(worker, location) {
                    Ok(at) => at,
                    Err(status) => return status,
                };
                let tier = &tier;
                let Some(w) = self.known_worker(worker) else {
                    return if block_hashes.is_empty() {
                        ApplyStatus::Ok
                    } else {
                        ApplyStatus::BlockNotFound
                    };
                };
                let w = w as usize;
                let cut_group = match self.groups[w].role(*group) {
                    None => None,
                    Some((GroupRole::Window | GroupRole::State, _)) if *tier == Tier::Gpu => *group,
                    Some(_) => return ApplyStatus::Ok,
                };
                let mut ours = std::mem::take(&mut self.scratch);
                let status = match cut_group {
                    Some(g) => {
                        let mut unknown = 0;
                        for &engine in block_hashes {
                            if self.groups[w].unpend(engine, g) {
                                continue;
                            }
                            // The name's reference is the group's only while the group holds it.
                            let held = self.names[w]
                                .ours_of(engine)
                                .filter(|&id| self.groups[w].holds(g, id));
                            match held {
                                Some(id) => {
                                    self.names[w].remove(&[engine], &mut ours);
                                    self.groups[w].remove(g, &[id]);
                                }
                                None => unknown += 1,
                            }
                        }
                        if unknown > 0 {
                            ApplyStatus::BlockNotFound
                        } else {
                            ApplyStatus::Ok
                        }
                    }
                    None if !self.pages[w].is_empty() => {
                        // Pages and blocks of one worker: each hash by the map that holds it.
                        let mut unknown = 0;
                        let mut status = ApplyStatus::Ok;
                        for &engine in block_hashes {
                            unknown += if self.pages[w].contains(engine) {
                                self.pages[w].remove(&[engine], &mut ours)
                            } else {
                                self.names[w].remove(&[engine], &mut ours)
                            };
                            if !ours.is_empty()
                                && self.remove(worker, *tier, &ours) != ApplyStatus::Ok
                            {
                                status = ApplyStatus::BlockNotFound;
                            }
                        }
                        if unknown > 0 {
                            ApplyStatus::BlockNotFound
                        } else {
                            status
                        }
                    }
                    None => {
                        let unknown = self.names[w].remove(block_hashes, &mut ours);
                        let status = self.remove(worker, *tier, &ours);
                        if unknown > 0 {
                            ApplyStatus::BlockNotFound
                        } else {
                            status
                        }
                    }
                };
                self.scratch = ours;
                status
            }
        }
    }

    /// A sliding-window or Mamba group's store whose blocks the event's tokens do not place
    /// (vLLM 0.33 leaves skipped blocks out of `block_hashes` only): each engine hash already
    /// named is taken at once; the others wait for a prefix group's store to name them.
    fn store_sparse(&mut self, w: usize, g: u32, engine_hashes: &[u64]) -> ApplyStatus {
        let max = self.blocks_per_worker_max;
        let mut status = ApplyStatus::Ok;
        for &engine in engine_hashes {
            let kept = match self.names[w].retain(engine, 1) {
                Some(ours) => {
                    let kept = self.groups[w].store(g, &[ours], max);
                    if !kept {
                        let mut undo = std::mem::take(&mut self.scratch);
                        self.names[w].remove(&[engine], &mut undo);
                        self.scratch = undo;
                    }
                    kept
                }
                None => self.groups[w].pend(engine, g, max),
            };
            if !kept {
                status = ApplyStatus::WorkerFull;
            }
        }
        status
    }

    /// Places the pending group stores of the engine hashes a prefix group's store just named.
    fn place_pending(&mut self, w: usize, engine_hashes: &[u64], ours: &[u64]) {
        for (&engine, &id) in engine_hashes.iter().zip(ours) {
            for (g, n) in self.groups[w].take_pending(engine) {
                if self.groups[w].store_n(g, &[id], n, self.blocks_per_worker_max) {
                    self.names[w].retain(engine, n);
                }
            }
        }
    }

    /// The kind of the KV cache group an event of `worker` concerns: the event's own, else the
    /// one its group was described with; `None` for an event without a group.
    pub fn group_kind(&self, worker: WorkerKey, event: &WireEvent) -> Option<GroupKind> {
        let (group, kind) = match event {
            WireEvent::Stored {
                group, group_kind, ..
            } => (*group, *group_kind),
            WireEvent::Removed { group, .. } => (*group, None),
            WireEvent::Cleared => (None, None),
        };
        let g = group?;
        kind.or_else(|| {
            let &w = self.by_key.get(&worker)?;
            self.groups[w as usize].kind(g)
        })
        .or(Some(GroupKind::Unknown))
    }

    /// Blocks `worker`'s sliding-window and Mamba groups hold on GPU (all groups together).
    pub fn group_blocks(&self, worker: WorkerKey) -> usize {
        self.by_key
            .get(&worker)
            .map_or(0, |&w| self.groups[w as usize].len())
    }

    /// Pages smaller than a block `worker` has stored and not removed (SGLang's page size 1).
    pub fn pages(&self, worker: WorkerKey) -> usize {
        self.by_key
            .get(&worker)
            .map_or(0, |&w| self.pages[w as usize].len())
    }

    /// Engine hashes `worker` has stored and not removed.
    pub fn engine_hashes(&self, worker: WorkerKey) -> usize {
        self.by_key
            .get(&worker)
            .map_or(0, |&w| self.names[w as usize].len())
    }

    /// Points node `n` at set `new`.
    #[inline(always)]
    fn set_node(&mut self, n: u32, new: u32) {
        let old = std::mem::replace(&mut self.node_sets[n as usize], new);
        self.sets.incref(new);
        self.sets.decref(old);
    }

    /// Records that `worker` stored `hashes` in `tier`.
    pub fn store(&mut self, worker: WorkerKey, tier: Tier, hashes: &[u64]) -> ApplyStatus {
        let w = self.worker_index(worker);
        let t = tier.index();
        let bit = 1u8 << t;
        let mut status = ApplyStatus::Ok;
        let mut memo = Memo::default();
        let mut prev: Option<u32> = None;
        self.prefetch_first(hashes);
        for (i, &hash) in hashes.iter().enumerate() {
            self.prefetch_ahead(hashes, i);
            // Blocks stored together earlier sit next to each other: try the previous block's
            // successor before the table.
            let n = match prev {
                Some(p) if self.is_live_successor(p, hash) => p + 1,
                _ => self.lookup_or_add(hash),
            };
            prev = Some(n);
            let old = self.node_sets[n as usize];
            if old != EMPTY && self.sets.mask(old, w) & bit != 0 {
                *self.extra.entry((n, w, t as u8)).or_insert(0) += 1;
                continue;
            }
            if self.workers[w as usize].total() >= self.blocks_per_worker_max {
                status = ApplyStatus::WorkerFull;
                if old == EMPTY {
                    self.kill(n);
                }
                continue;
            }
            let new = memo.get_or(old, || self.sets.with(old, w, |m| m | bit));
            self.set_node(n, new);
            self.workers[w as usize].blocks[t] += 1;
        }
        self.sets.collect();
        status
    }

    /// Records that `worker` removed `hashes` from `tier` (one reference each).
    pub fn remove(&mut self, worker: WorkerKey, tier: Tier, hashes: &[u64]) -> ApplyStatus {
        let Some(w) = self.known_worker(worker) else {
            return if hashes.is_empty() {
                ApplyStatus::Ok
            } else {
                ApplyStatus::BlockNotFound
            };
        };
        let t = tier.index();
        let bit = 1u8 << t;
        let mut status = ApplyStatus::Ok;
        let mut memo = Memo::default();
        let mut prev: Option<u32> = None;
        self.prefetch_first(hashes);
        for (i, &hash) in hashes.iter().enumerate() {
            self.prefetch_ahead(hashes, i);
            // Engines remove a run head-first or tail-first: try both neighbours first.
            let found = match prev {
                Some(p) if self.is_live_successor(p, hash) => Some(p + 1),
                Some(p) if p > 0 && self.is_live_at(p - 1, hash) => Some(p - 1),
                _ => self.lookup(hash),
            };
            let Some(n) = found else {
                status = ApplyStatus::BlockNotFound;
                continue;
            };
            prev = Some(n);
            let old = self.node_sets[n as usize];
            if self.sets.mask(old, w) & bit == 0 {
                status = ApplyStatus::BlockNotFound;
                continue;
            }
            if !self.extra.is_empty() {
                if let Some(more) = self.extra.get_mut(&(n, w, t as u8)) {
                    *more -= 1;
                    if *more == 0 {
                        self.extra.remove(&(n, w, t as u8));
                    }
                    continue;
                }
            }
            let new = memo.get_or(old, || self.sets.with(old, w, |m| m & !bit));
            self.set_node(n, new);
            self.workers[w as usize].blocks[t] -= 1;
            if new == EMPTY {
                self.kill(n);
            }
        }
        self.sets.collect();
        self.maybe_compact();
        status
    }

    /// Prefetches the table buckets of an event's first blocks.
    #[inline]
    fn prefetch_first(&self, hashes: &[u64]) {
        for &h in hashes.iter().take(PREFETCH_DISTANCE) {
            self.table.prefetch(h);
        }
    }

    /// Prefetches the table bucket of the block `PREFETCH_DISTANCE` ahead of `i` in an event.
    #[inline]
    fn prefetch_ahead(&self, hashes: &[u64], i: usize) {
        if let Some(&ahead) = hashes.get(i + PREFETCH_DISTANCE) {
            self.table.prefetch(ahead);
        }
    }

    /// Whether node `n` exists, is live and holds `hash`.
    #[inline(always)]
    fn is_live_at(&self, n: u32, hash: u64) -> bool {
        let n = n as usize;
        n < self.hashes.len() && self.hashes[n] == hash && self.node_sets[n] != EMPTY
    }

    /// Whether the node after `p` is live and holds `hash`.
    #[inline]
    fn is_live_successor(&self, p: u32, hash: u64) -> bool {
        self.is_live_at(p + 1, hash)
    }

    /// Counts node `n` (now without holders) as a tombstone. It stays in the arena and the table
    /// until the next compaction (a later store of its hash revives it); lookups skip it.
    fn kill(&mut self, n: u32) {
        debug_assert_eq!(self.node_sets[n as usize], EMPTY);
        self.dead += 1;
    }

    /// Compacts the arena, in order, once more than half of it is tombstones.
    fn maybe_compact(&mut self) {
        if self.dead < self.min_tombstones || self.dead * 2 < self.hashes.len() {
            return;
        }
        let mut moved = vec![u32::MAX; self.hashes.len()];
        let mut live = 0usize;
        for (n, to) in moved.iter_mut().enumerate() {
            if self.node_sets[n] != EMPTY {
                // Nodes only move down, so this never overwrites one not yet visited.
                self.hashes[live] = self.hashes[n];
                self.node_sets[live] = self.node_sets[n];
                *to = live as u32;
                live += 1;
            }
        }
        self.hashes.truncate(live);
        self.node_sets.truncate(live);
        self.hashes.shrink();
        self.node_sets.shrink();
        self.dead = 0;
        self.table
            .rebuild(self.hashes.iter().enumerate().map(|(n, &h)| (h, n as u32)));
        self.extra = std::mem::take(&mut self.extra)
            .into_iter()
            .map(|((n, w, t), c)| ((moved[n as usize], w, t), c))
            .collect();
    }

    /// Drops everything `worker` holds.
    pub fn remove_worker(&mut self, worker: WorkerKey) {
        self.last_worker = None;
        let Some(w) = self.by_key.remove(&worker) else {
            return;
        };
        // Every set containing the worker maps to the same set without it.
        let known = self.sets.sets.len();
        let mut without: Vec<u32> = (0..known as u32).collect();
        for id in 1..known as u32 {
            if self.sets.mask(id, w) != 0 {
                without[id as usize] = self.sets.with(id, w, |_| 0);
            }
        }
        for n in 0..self.node_sets.len() as u32 {
            let old = self.node_sets[n as usize];
            let new = without[old as usize];
            if new != old {
                self.set_node(n, new);
                if new == EMPTY {
                    self.kill(n);
                }
            }
        }
        self.extra.retain(|&(_, holder, _), _| holder != w);
        self.sets.collect();
        self.maybe_compact();
        self.workers[w as usize] = WorkerState::default();
        self.names[w as usize].clear();
        self.groups[w as usize].clear();
        self.pages[w as usize].clear();
    }

    /// How many of `hashes` (the router's) `worker` holds in pinned host memory or on disk, or
    /// a shared pool it reaches holds: for blocks it has just stored on its GPU, those it loaded
    /// rather than computed (a worker loads a block its lower tiers or its pools hold instead of
    /// computing it again).
    pub fn held_below_gpu(&self, worker: WorkerKey, hashes: &[u64]) -> usize {
        let Some(&w) = self.by_key.get(&worker) else {
            return 0;
        };
        let below = (1u8 << Tier::Host.index()) | (1u8 << Tier::Disk.index());
        let mask = self.members.get(&worker).copied().unwrap_or(0);
        let pools: Vec<u32> = (0..self.pools.len())
            .filter(|i| mask & (1 << i) != 0)
            .filter_map(|i| self.by_key.get(&pool_key(i)).copied())
            .collect();
        hashes
            .iter()
            .filter(|&&h| {
                self.lookup(h).is_some_and(|n| {
                    let set = self.node_sets[n as usize];
                    self.sets.mask(set, w) & below != 0
                        || pools.iter().any(|&p| self.sets.mask(set, p) != 0)
                })
            })
            .count()
    }

    /// Blocks `worker` holds in `tier`.
    pub fn blocks_in(&self, worker: WorkerKey, tier: Tier) -> usize {
        self.by_key
            .get(&worker)
            .map_or(0, |&w| self.workers[w as usize].blocks[tier.index()])
    }

    /// Everything the index knows of `workers` (all of them when empty): per worker its engine
    /// hashes and its holdings with their reference counts, for a sibling router to restore
    /// ([`Self::restore`]). One pass over the arena.
    pub fn snapshot(&self, workers: &[WorkerKey]) -> Vec<WorkerSnapshot> {
        let mut out: Vec<WorkerSnapshot> = Vec::new();
        let mut slot_of: HashMap<u32, usize> = HashMap::new();
        for (&key, &w) in &self.by_key {
            if !workers.is_empty() && !workers.contains(&key) {
                continue;
            }
            slot_of.insert(w, out.len());
            out.push(WorkerSnapshot {
                worker: key,
                names: self.names[w as usize]
                    .iter()
                    .map(|(engine, n)| NameEntry {
                        engine,
                        ours: n.ours,
                        namespace: n.namespace,
                        refs: n.refs,
                    })
                    .collect(),
                holdings: Vec::with_capacity(self.workers[w as usize].total()),
                groups: self.groups[w as usize].specs().collect(),
                group_holdings: self.groups[w as usize].holdings().collect(),
                pages: self.pages[w as usize].entries().collect(),
            });
        }
        if out.is_empty() {
            return out;
        }
        for n in 0..self.node_sets.len() as u32 {
            let set = self.node_sets[n as usize];
            if set == EMPTY {
                continue;
            }
            let bits = self.sets.bits(set);
            for (k, _) in bits.chunks(3).enumerate() {
                for_each_bit(&[group(bits, k)], |b| {
                    let w = k as u32 * 64 + b;
                    let Some(&slot) = slot_of.get(&w) else { return };
                    let mask = mask_of(bits, w);
                    for t in Tier::ALL {
                        let ti = t.index();
                        if mask & (1 << ti) != 0 {
                            let extra = self.extra.get(&(n, w, ti as u8)).copied().unwrap_or(0);
                            out[slot].holdings.push(Holding {
                                tier: t,
                                hash: self.hashes[n as usize],
                                count: extra + 1,
                            });
                        }
                    }
                });
            }
        }
        out
    }

    /// Puts back what [`Self::snapshot`] took of one worker (replacing what the index held of
    /// it). Holdings beyond the worker's limit are refused (counted in the returned status).
    pub fn restore(&mut self, snapshot: &WorkerSnapshot) -> ApplyStatus {
        let key = snapshot.worker;
        self.remove_worker(key);
        let w = self.worker_index(key) as usize;
        for n in &snapshot.names {
            self.names[w].restore(
                n.engine,
                crate::router::translate::Name {
                    ours: n.ours,
                    namespace: n.namespace,
                    refs: n.refs.max(1),
                },
            );
        }
        let mut status = ApplyStatus::Ok;
        for h in &snapshot.holdings {
            for _ in 0..h.count.max(1) {
                if self.store(key, h.tier, &[h.hash]) != ApplyStatus::Ok {
                    status = ApplyStatus::WorkerFull;
                }
            }
        }
        let max = self.blocks_per_worker_max;
        let groups = &mut self.groups[w];
        for g in &snapshot.groups {
            groups.learn(g.group, g.kind, g.window);
        }
        for h in &snapshot.group_holdings {
            let n = h.count.max(1);
            let kept = if h.pending {
                groups.pend_n(h.hash, h.group, n, max)
            } else {
                groups.store_n(h.group, &[h.hash], n, max)
            };
            if !kept {
                status = ApplyStatus::WorkerFull;
            }
        }
        for p in &snapshot.pages {
            if !self.pages[w].restore(p, max) {
                status = ApplyStatus::WorkerFull;
            }
        }
        status
    }

    /// Workers indexed.
    pub fn workers(&self) -> Vec<WorkerKey> {
        let mut keys: Vec<WorkerKey> = self
            .by_key
            .keys()
            .copied()
            .filter(|k| !is_pool_key(*k))
            .collect();
        keys.sort_unstable();
        keys
    }

    /// Bytes of the index's own mappings (arena and table), which a heap profiler does not see.
    pub fn mapped_bytes(&self) -> usize {
        self.hashes.mapped_bytes() + self.node_sets.mapped_bytes() + self.table.mapped_bytes()
    }

    /// Distinct blocks indexed.
    pub fn distinct_blocks(&self) -> usize {
        self.hashes.len() - self.dead
    }

    /// Per worker holding any of the prefix: its GPU prefix, then host and disk continuations.
    ///
    /// Walks the request's blocks (sequentially through stored runs, through the table where a
    /// run ends). The workers still matching are kept as bitsets per tier they are matching in;
    /// where the holder set changes, only workers that lost their current tier are moved on (to
    /// a lower tier that holds the block, or out), with a few word operations per 64 workers.
    ///
    /// A hybrid worker's GPU prefix is then cut where its sliding-window and Mamba groups would
    /// cut vLLM's hit (`router::groups`); a worker without a full-attention group
    /// matches as far as its groups accept.
    ///
    /// A worker that reaches a shared pool is credited with the pool's blocks beyond its own
    /// (`Overlap::shared`); the pools themselves are not in the answer.
    pub fn find_matches(&self, hashes: &[u64]) -> Vec<(WorkerKey, Overlap)> {
        let mut out = self.find_prefix_matches(hashes);
        if !self.groups.iter().any(WorkerGroups::cuts) {
            self.credit_pools(&mut out);
            return out;
        }
        out.retain_mut(|(key, o)| {
            let Some(&w) = self.by_key.get(key) else {
                return true;
            };
            let groups = &self.groups[w as usize];
            if groups.cuts() {
                let hit = groups.hit(hashes, o.gpu, self.block_size);
                if hit < o.gpu {
                    *o = Overlap {
                        gpu: hit,
                        ..Overlap::default()
                    };
                }
            }
            o.gpu + o.host + o.disk > 0
        });
        for (w, groups) in self.groups.iter().enumerate() {
            let state = &self.workers[w];
            if !state.live || !groups.without_prefix() || out.iter().any(|(k, _)| *k == state.key) {
                continue;
            }
            let hit = groups.hit(hashes, hashes.len(), self.block_size);
            if hit > 0 {
                out.push((
                    state.key,
                    Overlap {
                        gpu: hit,
                        ..Overlap::default()
                    },
                ));
            }
        }
        self.credit_pools(&mut out);
        out
    }

    /// [`Self::find_matches`] over the claims alone.
    fn find_prefix_matches(&self, hashes: &[u64]) -> Vec<(WorkerKey, Overlap)> {
        let Some((&first, rest)) = hashes.split_first() else {
            return Vec::new();
        };
        let Some(mut node) = self.lookup(first) else {
            return Vec::new();
        };
        let mut set = self.node_sets[node as usize];
        let first_bits = self.sets.bits(set);
        let groups = first_bits.len() / 3;
        // Per group of 64 workers, the workers matching in each tier: each starts in the first
        // tier that holds the first block.
        let mut active: Vec<[u64; 3]> = (0..groups)
            .map(|k| {
                let (g, h, d) = (
                    first_bits[3 * k],
                    first_bits[3 * k + 1],
                    first_bits[3 * k + 2],
                );
                [g, h & !g, d & !g & !h]
            })
            .collect();
        let started: Vec<u64> = (0..groups).map(|k| group(first_bits, k)).collect();
        let n = groups * 64;
        // Per worker: where its current tier's stretch began, and blocks per tier so far.
        let mut since = vec![0u32; n];
        let mut counts = vec![[0u32; 3]; n];
        let mut end = hashes.len() as u32;
        for (i, &hash) in rest.iter().enumerate() {
            let i = i as u32 + 1;
            node = if self.is_live_successor(node, hash) {
                node + 1
            } else {
                match self.lookup(hash) {
                    Some(n) => n,
                    None => {
                        end = i;
                        break;
                    }
                }
            };
            let s = self.node_sets[node as usize];
            if s == set {
                continue;
            }
            set = s;
            let bits = self.sets.bits(s);
            let mut any = 0u64;
            for (k, [ag, ah, ad]) in active.iter_mut().enumerate() {
                if *ag | *ah | *ad == 0 {
                    continue;
                }
                let word = |t: usize| bits.get(3 * k + t).copied().unwrap_or(0);
                let (g, h, d) = (word(0), word(1), word(2));
                // Workers whose current tier does not hold this block.
                let (lost_g, lost_h, lost_d) = (*ag & !g, *ah & !h, *ad & !d);
                let moved = lost_g | lost_h | lost_d;
                if moved != 0 {
                    for (t, lost) in [lost_g, lost_h, lost_d].into_iter().enumerate() {
                        for_each_bit(&[lost], |b| {
                            let w = k * 64 + b as usize;
                            counts[w][t] += i - since[w];
                            since[w] = i;
                        });
                    }
                    // They go on in the next tier down that holds the block, or stop.
                    *ag &= !lost_g;
                    *ah = (*ah & !lost_h) | (lost_g & h);
                    *ad = (*ad & !lost_d) | (lost_g & !h & d) | (lost_h & d);
                }
                any |= *ag | *ah | *ad;
            }
            if any == 0 {
                end = i;
                break;
            }
        }
        for (k, tiers) in active.iter().enumerate() {
            for (t, &bits) in tiers.iter().enumerate() {
                for_each_bit(&[bits], |b| {
                    let w = k * 64 + b as usize;
                    counts[w][t] += end - since[w];
                });
            }
        }
        let mut out = Vec::new();
        for_each_bit(&started, |w| {
            let c = counts[w as usize];
            out.push((
                self.workers[w as usize].key,
                Overlap {
                    gpu: c[0] as usize,
                    host: c[1] as usize,
                    disk: c[2] as usize,
                    shared: 0,
                },
            ));
        });
        out
    }
}

/// Calls `f` with the index of every bit set in `words`.
fn for_each_bit(words: &[u64], mut f: impl FnMut(u32)) {
    for (k, &word) in words.iter().enumerate() {
        let mut x = word;
        while x != 0 {
            f(k as u32 * 64 + x.trailing_zeros());
            x &= x - 1;
        }
    }
}
