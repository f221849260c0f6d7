//! Per-tier block pools: block ids, their lifecycle, and the tier's registry.
//!
//! Lifecycle (DESIGN.md): `Free` -> `Filling` ([`FillingBlock`]) -> `Complete` ([`CompleteBlock`])
//! -> `Registered` ([`RegisteredBlock`], findable by sequence hash). A registered block with no
//! holder is *idle*: it stays findable and may be evicted, which returns it to `Free` and
//! publishes `BlockRemoved`. Registering publishes `BlockStored`.
//!
//! Invariants:
//! - Each block is in exactly one state; `free + filling + complete + registered + reserved ==
//!   capacity`, where reserved blocks are those not yet made available (a host pool grows as its
//!   memory gets pinned; ids below `available` are usable, and `available` only grows).
//! - Only a `FillingBlock` may be written; a registered block cannot be (no handle gives access).
//! - A block with a holder (a handle, or a transfer in flight) is never evicted or reused; the
//!   eviction policy holds exactly the idle blocks.
//! - A sequence hash maps to at most one block per tier; registering a hash the tier already holds
//!   hands back the existing block and frees the new one (de-duplication, no event).
//! - Dropping an unconsumed `FillingBlock` or `CompleteBlock` returns it to `Free`.
//! - Events are published under the pool lock, so their order is the order of the state changes.
//! - This is the one place that mutates pool state; callers hold the lock only inside methods.

use std::collections::HashMap;
use std::sync::Arc;

use kvbm_events::{
    BlockRemoved, BlockStored, EventPublisher, KvEvent, PassThroughBuildHasher, SequenceHash, Tier,
};
use parking_lot::Mutex;

use crate::eviction::{EvictionPolicy, LruPriority};
use crate::CoreError;

/// Index of a block within its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The id as an index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What makes a block findable and announceable: its hash, its parent, its tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockIdentity {
    /// The block's sequence hash (its registry key).
    pub sequence_hash: SequenceHash,
    /// The sequence hash of the block before it, if any.
    pub parent: Option<SequenceHash>,
    /// The block's token ids (exactly one block of them).
    pub tokens: Arc<[u32]>,
    /// The LoRA adapter the block was computed with.
    pub lora_name: Option<Arc<str>>,
    /// The KV cache group of a hybrid model's block outside its primary group (see
    /// [`crate::groups`]): such blocks are kept like any other but never announced (a prefix
    /// is routable while the primary group holds it). None: the primary group's, announced.
    pub group: Option<u16>,
}

/// A block's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// Unused; may be allocated.
    Free,
    /// Allocated and being written.
    Filling,
    /// Written in full; not yet findable.
    Complete,
    /// Findable by sequence hash.
    Registered,
}

/// A snapshot of a pool's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolCounts {
    /// Blocks in the pool.
    pub capacity: usize,
    /// Free blocks.
    pub free: usize,
    /// Blocks being written.
    pub filling: usize,
    /// Complete, unregistered blocks.
    pub complete: usize,
    /// Registered blocks (idle or held).
    pub registered: usize,
    /// Blocks discarded (out of the registry) whose holders have not let go yet.
    pub discarded: usize,
    /// Registered blocks without a holder (evictable).
    pub idle: usize,
    /// Blocks evicted since creation.
    pub evictions: u64,
    /// Registrations that found the hash already present.
    pub deduplicated: u64,
    /// Blocks not available yet (their memory is still being prepared).
    pub reserved: usize,
}

/// A handle given back unchanged because the operation refused it.
#[derive(Debug)]
pub struct Rejected<T> {
    /// What was handed in.
    pub value: T,
    /// Why.
    pub reason: &'static str,
}

type HashIndex = HashMap<SequenceHash, BlockId, PassThroughBuildHasher>;

#[derive(Debug)]
struct Slot {
    state: BlockState,
    holders: u32,
    priority: u32,
    identity: Option<Arc<BlockIdentity>>,
    /// Remove (not idle) when the last holder lets go: the contents are known bad.
    discard: bool,
}

struct PoolState {
    slots: Vec<Slot>,
    free: Vec<BlockId>,
    index: HashIndex,
    policy: Box<dyn EvictionPolicy>,
    filling: usize,
    complete: usize,
    available: usize,
    evictions: u64,
    deduplicated: u64,
    /// Discarded blocks still held (out of the index, not free yet).
    discarded: usize,
}

impl PoolState {
    /// Returns a registered block nobody holds to `Free` and drops it from the registry (an
    /// eviction); returns its hash for the `BlockRemoved` event (None: a block never announced).
    fn free_registered(&mut self, id: BlockId) -> Option<SequenceHash> {
        let slot = &mut self.slots[id.index()];
        debug_assert!(slot.state == BlockState::Registered && slot.holders == 0);
        let identity = slot
            .identity
            .take()
            .expect("registered blocks have an identity");
        slot.state = BlockState::Free;
        slot.priority = 0;
        slot.discard = false;
        // A discarded block left the index already (and its hash may name a newer block now).
        if self.index.get(&identity.sequence_hash) == Some(&id) {
            self.index.remove(&identity.sequence_hash);
        }
        self.free.push(id);
        self.evictions += 1;
        identity.group.is_none().then_some(identity.sequence_hash)
    }

    /// Evicts up to `max_blocks` idle blocks by policy; returns how many, and the hashes of
    /// those announced.
    fn evict(&mut self, max_blocks: usize) -> (usize, Vec<SequenceHash>) {
        let mut removed = Vec::new();
        let mut n = 0;
        while n < max_blocks {
            let Some(id) = self.policy.pop_victim() else {
                break;
            };
            n += 1;
            removed.extend(self.free_registered(id));
        }
        (n, removed)
    }

    /// Returns a block that is being written, or complete but unregistered, to `Free`.
    fn free_unregistered(&mut self, id: BlockId) {
        let slot = &mut self.slots[id.index()];
        match slot.state {
            BlockState::Filling => self.filling -= 1,
            BlockState::Complete => self.complete -= 1,
            other => unreachable!("block {id:?} is {other:?}, not being written"),
        }
        slot.state = BlockState::Free;
        self.free.push(id);
    }
}

struct PoolShared {
    tier: Tier,
    capacity: usize,
    block_size_tokens: u32,
    events: Option<EventPublisher>,
    state: Mutex<PoolState>,
}

/// The blocks of one tier. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct BlockPool {
    shared: Arc<PoolShared>,
}

impl std::fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockPool")
            .field("tier", &self.shared.tier)
            .field("counts", &self.counts())
            .finish()
    }
}

impl BlockPool {
    /// A pool of `capacity_blocks` free blocks with LRU-with-priority eviction, publishing to
    /// `events` if given.
    pub fn new(
        tier: Tier,
        capacity_blocks: usize,
        block_size_tokens: usize,
        events: Option<EventPublisher>,
    ) -> Self {
        Self::with_policy(
            tier,
            capacity_blocks,
            block_size_tokens,
            events,
            Box::new(LruPriority::new(capacity_blocks)),
            capacity_blocks,
        )
    }

    /// A pool with another eviction policy, of which only ids below `available_blocks` are
    /// usable until [`Self::grow_available`] makes more so.
    pub fn with_policy(
        tier: Tier,
        capacity_blocks: usize,
        block_size_tokens: usize,
        events: Option<EventPublisher>,
        policy: Box<dyn EvictionPolicy>,
        available_blocks: usize,
    ) -> Self {
        let available_blocks = available_blocks.min(capacity_blocks);
        assert!(capacity_blocks < u32::MAX as usize, "block ids are u32");
        let slots = (0..capacity_blocks)
            .map(|_| Slot {
                state: BlockState::Free,
                holders: 0,
                priority: 0,
                identity: None,
                discard: false,
            })
            .collect();
        // Pop from the end: hand out low ids first.
        let free = (0..available_blocks as u32).rev().map(BlockId).collect();
        Self {
            shared: Arc::new(PoolShared {
                tier,
                capacity: capacity_blocks,
                block_size_tokens: block_size_tokens as u32,
                events,
                state: Mutex::new(PoolState {
                    slots,
                    free,
                    index: HashIndex::with_capacity_and_hasher(capacity_blocks, Default::default()),
                    policy,
                    filling: 0,
                    complete: 0,
                    available: available_blocks,
                    evictions: 0,
                    deduplicated: 0,
                    discarded: 0,
                }),
            }),
        }
    }

    /// The tier this pool holds.
    pub fn tier(&self) -> Tier {
        self.shared.tier
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// Makes ids below `available_blocks` usable (never shrinks); returns how many are now.
    pub fn grow_available(&self, available_blocks: usize) -> usize {
        let mut state = self.shared.state.lock();
        let target = available_blocks.min(self.shared.capacity);
        if target > state.available {
            let old = state.available;
            // Keep low ids on top of the free stack: new ids go underneath.
            let mut grown: Vec<BlockId> = (old as u32..target as u32).rev().map(BlockId).collect();
            grown.extend_from_slice(&state.free);
            state.free = grown;
            state.available = target;
        }
        state.available
    }

    /// Whether `block` is one of this pool's (a handle from another pool, even with an id in
    /// range here, is not).
    pub fn owns(&self, block: &RegisteredBlock) -> bool {
        self.is(&block.pool)
    }

    /// Whether `block` is being filled in this pool.
    pub fn owns_filling(&self, block: &FillingBlock) -> bool {
        block.pool.as_ref().is_some_and(|p| self.is(p))
    }

    /// Blocks usable now (free or not).
    pub fn available(&self) -> usize {
        self.shared.state.lock().available
    }

    /// Takes the given free blocks for writing (to refill blocks whose contents survived a
    /// restart). All or nothing: `InvalidArgument` if any is not free and available.
    pub fn claim(&self, ids: &[BlockId]) -> Result<Vec<FillingBlock>, CoreError> {
        let mut state = self.shared.state.lock();
        let mut wanted = std::collections::HashSet::with_capacity(ids.len());
        for &id in ids {
            let free =
                id.index() < state.available && state.slots[id.index()].state == BlockState::Free;
            if !free || !wanted.insert(id) {
                return Err(CoreError::InvalidArgument(format!(
                    "block {id:?} is not free to claim"
                )));
            }
        }
        state.free.retain(|id| !wanted.contains(id));
        for &id in ids {
            state.slots[id.index()].state = BlockState::Filling;
        }
        state.filling += ids.len();
        Ok(ids
            .iter()
            .map(|&id| FillingBlock {
                pool: Some(self.shared.clone()),
                id,
            })
            .collect())
    }

    /// Takes up to `count` blocks for writing, as many as are free or evictable.
    pub fn allocate_up_to(&self, count: usize) -> Vec<FillingBlock> {
        let available = {
            let state = self.shared.state.lock();
            state.free.len() + state.policy.len()
        };
        // Another thread may take blocks in between: retry with what is left.
        let mut want = count.min(available);
        loop {
            match self.allocate(want) {
                Ok(blocks) => return blocks,
                Err(CoreError::Exhausted { available, .. }) => want = want.min(available),
                Err(other) => unreachable!("allocate only fails with Exhausted: {other}"),
            }
        }
    }

    fn is(&self, other: &Arc<PoolShared>) -> bool {
        Arc::ptr_eq(&self.shared, other)
    }

    /// Takes `count` blocks for writing, evicting idle blocks (by policy) when too few are free.
    /// All or nothing: on `Exhausted` nothing changed.
    pub fn allocate(&self, count: usize) -> Result<Vec<FillingBlock>, CoreError> {
        let mut state = self.shared.state.lock();
        let available = state.free.len() + state.policy.len();
        if count > available {
            return Err(CoreError::Exhausted {
                tier: self.shared.tier,
                requested: count,
                available,
            });
        }
        let shortfall = count.saturating_sub(state.free.len());
        if shortfall > 0 {
            let (n, removed) = state.evict(shortfall);
            debug_assert_eq!(n, shortfall, "counted as evictable");
            self.publish_removed(removed);
        }
        let mut blocks = Vec::with_capacity(count);
        for _ in 0..count {
            let id = state.free.pop().expect("counted as free");
            state.slots[id.index()].state = BlockState::Filling;
            blocks.push(FillingBlock {
                pool: Some(self.shared.clone()),
                id,
            });
        }
        state.filling += count;
        Ok(blocks)
    }

    /// Makes `block` findable by its sequence hash. If the tier already holds that hash, the
    /// existing block is returned and `block` goes back to `Free` (no event).
    pub fn register(
        &self,
        block: CompleteBlock,
    ) -> Result<RegisteredBlock, Rejected<CompleteBlock>> {
        self.register_all(vec![block])
            .map(|mut v| v.pop().expect("one in, one out"))
            .map_err(|mut r| Rejected {
                value: r.value.pop().expect("one in, one out"),
                reason: r.reason,
            })
    }

    /// Registers blocks in order, publishing one `BlockStored` per run of blocks that chain onto
    /// each other. Refuses the whole list, unchanged, if any block belongs to another pool.
    pub fn register_all(
        &self,
        blocks: Vec<CompleteBlock>,
    ) -> Result<Vec<RegisteredBlock>, Rejected<Vec<CompleteBlock>>> {
        if blocks
            .iter()
            .any(|b| !self.is(b.pool.as_ref().expect("armed")))
        {
            return Err(Rejected {
                value: blocks,
                reason: "a block belongs to another pool",
            });
        }
        let mut out = Vec::with_capacity(blocks.len());
        let mut state = self.shared.state.lock();
        let mut run: Option<BlockStored> = None;
        for mut block in blocks {
            let pool = block.pool.take().expect("armed");
            let identity = block.identity.clone();
            let hash = identity.sequence_hash;
            if let Some(&existing) = state.index.get(&hash) {
                // Already resident: hand back the existing block, free the newcomer.
                Self::acquire_locked(&mut state, existing);
                state.free_unregistered(block.id);
                state.deduplicated += 1;
                out.push(RegisteredBlock {
                    pool,
                    id: existing,
                    hash,
                });
                continue;
            }
            let slot = &mut state.slots[block.id.index()];
            slot.state = BlockState::Registered;
            slot.holders = 1;
            slot.identity = Some(identity.clone());
            state.complete -= 1;
            state.index.insert(hash, block.id);
            run = self.extend_run(run, &identity);
            out.push(RegisteredBlock {
                pool,
                id: block.id,
                hash,
            });
        }
        if let Some(stored) = run {
            self.publish(KvEvent::BlockStored(stored));
        }
        Ok(out)
    }

    /// Adds `identity` to the current `BlockStored` run, or publishes the run and starts another.
    fn extend_run(
        &self,
        run: Option<BlockStored>,
        identity: &BlockIdentity,
    ) -> Option<BlockStored> {
        self.shared.events.as_ref()?;
        if identity.group.is_some() {
            // Never announced: close the run so that no announced block chains onto it.
            if let Some(stored) = run {
                self.publish(KvEvent::BlockStored(stored));
            }
            return None;
        }
        match run {
            Some(mut stored)
                if stored.block_hashes.last().copied() == identity.parent
                    && stored.lora_name.as_deref() == identity.lora_name.as_deref() =>
            {
                stored.block_hashes.push(identity.sequence_hash);
                stored.token_ids.extend_from_slice(&identity.tokens);
                Some(stored)
            }
            previous => {
                if let Some(stored) = previous {
                    self.publish(KvEvent::BlockStored(stored));
                }
                Some(BlockStored {
                    tier: self.shared.tier,
                    block_hashes: vec![identity.sequence_hash],
                    parent_hash: identity.parent,
                    token_ids: identity.tokens.to_vec(),
                    block_size: self.shared.block_size_tokens,
                    lora_name: identity.lora_name.as_deref().map(str::to_owned),
                })
            }
        }
    }

    /// Publishes one `BlockRemoved` for `hashes` (nothing when empty), with the pool lock held.
    fn publish_removed(&self, hashes: Vec<SequenceHash>) {
        publish_removed(&self.shared, hashes);
    }

    fn publish(&self, event: KvEvent) {
        if let Some(events) = &self.shared.events {
            events.publish(event);
        }
    }

    fn acquire_locked(state: &mut PoolState, id: BlockId) {
        let slot = &mut state.slots[id.index()];
        debug_assert_eq!(slot.state, BlockState::Registered);
        if slot.holders == 0 {
            state.policy.remove(id);
            state.slots[id.index()].holders = 1;
        } else {
            slot.holders += 1;
        }
    }

    /// The block registered under `hash`, now held.
    pub fn lookup(&self, hash: SequenceHash) -> Option<RegisteredBlock> {
        let mut state = self.shared.state.lock();
        let id = *state.index.get(&hash)?;
        Self::acquire_locked(&mut state, id);
        Some(RegisteredBlock {
            pool: self.shared.clone(),
            id,
            hash,
        })
    }

    /// Block `id`, now held, if it is registered (for callers that know blocks by id, such as a
    /// leader told by its workers which of its blocks went bad).
    pub fn lookup_id(&self, id: BlockId) -> Option<RegisteredBlock> {
        let mut state = self.shared.state.lock();
        let slot = state.slots.get(id.index())?;
        if slot.state != BlockState::Registered || slot.discard {
            return None;
        }
        let hash = slot.identity.as_ref()?.sequence_hash;
        Self::acquire_locked(&mut state, id);
        Some(RegisteredBlock {
            pool: self.shared.clone(),
            id,
            hash,
        })
    }

    /// The registered blocks for `hashes[0..k]`, held together, where `k` is the first miss.
    /// One pool reference for the whole set; dropping it releases every block under one lock.
    pub fn hold_prefix(&self, hashes: &[SequenceHash]) -> HeldBlocks {
        let mut blocks = Vec::with_capacity(hashes.len());
        let mut state = self.shared.state.lock();
        // Two passes: independent lookups first (their cache misses overlap), then the holds.
        for &hash in hashes {
            let Some(&id) = state.index.get(&hash) else {
                break;
            };
            blocks.push((id, hash));
        }
        for &(id, _) in &blocks {
            Self::acquire_locked(&mut state, id);
        }
        drop(state);
        HeldBlocks {
            pool: self.shared.clone(),
            blocks,
        }
    }

    /// The registered blocks for `hashes[0..k]`, each held by its own handle, where `k` is the
    /// first miss.
    pub fn match_prefix(&self, hashes: &[SequenceHash]) -> Vec<RegisteredBlock> {
        self.hold_prefix(hashes).into_blocks()
    }

    /// How many of `hashes`, from the first, are registered here (nothing is held).
    pub fn count_prefix(&self, hashes: &[SequenceHash]) -> usize {
        let state = self.shared.state.lock();
        hashes
            .iter()
            .take_while(|h| state.index.contains_key(h))
            .count()
    }

    /// True when `hash` is registered here.
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.shared.state.lock().index.contains_key(&hash)
    }

    /// Sets the eviction priority of a registered block (lower leaves first; default 0).
    pub fn set_priority(&self, block: &RegisteredBlock, priority: u32) {
        assert!(self.is(&block.pool), "block of another pool");
        self.shared.state.lock().slots[block.id.index()].priority = priority;
    }

    /// Gives up a block whose contents turned out to be bad: it leaves the registry now
    /// (`BlockRemoved`; no match finds it again), and its slot is freed when its last holder
    /// lets go (now, if `block` is the only one) instead of going idle.
    pub fn discard(&self, block: RegisteredBlock) {
        assert!(self.is(&block.pool), "block of another pool");
        let mut state = self.shared.state.lock();
        let id = block.id;
        let slot = &mut state.slots[id.index()];
        if !slot.discard {
            slot.discard = true;
            if state.index.get(&block.hash) == Some(&id) {
                state.index.remove(&block.hash);
                state.discarded += 1;
                let announced = slot_announced(&state, id);
                // Published under the lock, like every pool event.
                if announced {
                    publish_removed(&self.shared, vec![block.hash]);
                }
            }
        }
        drop(state);
        drop(block);
    }

    /// Evicts up to `max_blocks` idle blocks by policy; returns how many left.
    pub fn evict_idle(&self, max_blocks: usize) -> usize {
        let mut state = self.shared.state.lock();
        let (n, removed) = state.evict(max_blocks);
        // Published under the lock, like every pool event.
        self.publish_removed(removed);
        drop(state);
        n
    }

    /// Counts of blocks per state.
    pub fn counts(&self) -> PoolCounts {
        let state = self.shared.state.lock();
        PoolCounts {
            capacity: self.shared.capacity,
            free: state.free.len(),
            filling: state.filling,
            complete: state.complete,
            registered: state.index.len(),
            discarded: state.discarded,
            idle: state.policy.len(),
            evictions: state.evictions,
            deduplicated: state.deduplicated,
            reserved: self.shared.capacity - state.available,
        }
    }

    /// Every registered hash (idle or held).
    pub fn registered_hashes(&self) -> Vec<SequenceHash> {
        self.shared.state.lock().index.keys().copied().collect()
    }

    /// The state of block `id` (for checks and diagnostics).
    pub fn state_of(&self, id: BlockId) -> BlockState {
        self.shared.state.lock().slots[id.index()].state
    }

    /// Holders of block `id` (for checks and diagnostics).
    pub fn holders_of(&self, id: BlockId) -> u32 {
        self.shared.state.lock().slots[id.index()].holders
    }
}

/// Matches `hashes` from the first across `pools` (fastest tier first): each block is taken, held,
/// from the first pool that has it; the match stops at the first hash no pool has. Locks the
/// pools in the order given, so callers pass them in tier order.
pub fn match_across(pools: &[&BlockPool], hashes: &[SequenceHash]) -> Vec<RegisteredBlock> {
    let mut states: Vec<_> = pools.iter().map(|p| p.shared.state.lock()).collect();
    let mut out = Vec::with_capacity(hashes.len());
    'hashes: for hash in hashes {
        for (pool, state) in pools.iter().zip(states.iter_mut()) {
            if let Some(&id) = state.index.get(hash) {
                BlockPool::acquire_locked(state, id);
                out.push(RegisteredBlock {
                    pool: pool.shared.clone(),
                    id,
                    hash: *hash,
                });
                continue 'hashes;
            }
        }
        break;
    }
    drop(states);
    out
}

/// Empties every pool of `pools` and publishes one `AllBlocksCleared` (through the first pool's
/// publisher), all under every pool's lock, so no event can fall between the check, the clearing
/// and the announcement. Refused, changing nothing, while any block of any pool is being written
/// or held (a transfer in flight always holds its blocks). Pools are locked in the order given.
pub fn clear_across(pools: &[&BlockPool]) -> Result<(), CoreError> {
    let mut states: Vec<_> = pools.iter().map(|p| p.shared.state.lock()).collect();
    for (pool, state) in pools.iter().zip(&states) {
        // Discarded blocks left the index but may still be held.
        let held = state.index.len() - state.policy.len() + state.discarded;
        if state.filling + state.complete + held > 0 {
            return Err(CoreError::Busy(format!(
                "{} tier: {} blocks being written, {held} held",
                pool.shared.tier,
                state.filling + state.complete
            )));
        }
    }
    for state in states.iter_mut() {
        state.evict(usize::MAX);
        debug_assert!(
            state.index.is_empty(),
            "nothing held, so every block was idle"
        );
    }
    if let Some(events) = pools.first().and_then(|p| p.shared.events.as_ref()) {
        events.publish(KvEvent::AllBlocksCleared);
    }
    drop(states);
    Ok(())
}

/// Registered blocks of one pool held as a set (see [`BlockPool::hold_prefix`]).
pub struct HeldBlocks {
    pool: Arc<PoolShared>,
    blocks: Vec<(BlockId, SequenceHash)>,
}

impl std::fmt::Debug for HeldBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldBlocks")
            .field("tier", &self.pool.tier)
            .field("blocks", &self.blocks.len())
            .finish()
    }
}

impl HeldBlocks {
    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The tier of the blocks.
    pub fn tier(&self) -> Tier {
        self.pool.tier
    }

    /// (block id, sequence hash) of each held block, in match order.
    pub fn blocks(&self) -> &[(BlockId, SequenceHash)] {
        &self.blocks
    }

    /// Keeps the first `len` blocks and releases the rest.
    pub fn truncate(&mut self, len: usize) {
        if len < self.blocks.len() {
            let released = self.blocks.split_off(len);
            release_all(&self.pool, &released);
        }
    }

    /// One handle per block; the holds move to the handles.
    pub fn into_blocks(mut self) -> Vec<RegisteredBlock> {
        let blocks = std::mem::take(&mut self.blocks);
        blocks
            .into_iter()
            .map(|(id, hash)| RegisteredBlock {
                pool: self.pool.clone(),
                id,
                hash,
            })
            .collect()
    }
}

impl Drop for HeldBlocks {
    fn drop(&mut self) {
        release_all(&self.pool, &self.blocks);
    }
}

fn release_all(pool: &PoolShared, blocks: &[(BlockId, SequenceHash)]) {
    if blocks.is_empty() {
        return;
    }
    let mut state = pool.state.lock();
    for &(id, _) in blocks {
        release_locked(&mut state, id);
    }
}

/// Drops one hold; the last one makes the block idle, or removes it if it was discarded.
fn release_locked(state: &mut PoolState, id: BlockId) {
    let slot = &mut state.slots[id.index()];
    slot.holders -= 1;
    if slot.holders > 0 {
        return;
    }
    if !slot.discard {
        let priority = slot.priority;
        state.policy.insert(id, priority);
        return;
    }
    // Its removal was announced when it was discarded.
    state.discarded -= 1;
    state.free_registered(id);
}

/// Whether the registered block `id` is announced (not a non-primary group's).
fn slot_announced(state: &PoolState, id: BlockId) -> bool {
    state.slots[id.index()]
        .identity
        .as_ref()
        .is_none_or(|i| i.group.is_none())
}

fn publish_removed(pool: &PoolShared, hashes: Vec<SequenceHash>) {
    if let (Some(events), false) = (&pool.events, hashes.is_empty()) {
        events.publish(KvEvent::BlockRemoved(BlockRemoved {
            tier: pool.tier,
            block_hashes: hashes,
        }));
    }
}

/// A block being written. Dropping it returns the block to `Free`.
#[derive(Debug)]
pub struct FillingBlock {
    pool: Option<Arc<PoolShared>>,
    id: BlockId,
}

impl std::fmt::Debug for PoolShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} pool", self.tier)
    }
}

impl FillingBlock {
    /// The block's id in its pool.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// The tier of the block's pool.
    pub fn tier(&self) -> Tier {
        self.pool.as_ref().expect("armed").tier
    }

    /// Marks the block written in full, with the identity it will be registered under.
    pub fn complete(mut self, identity: BlockIdentity) -> CompleteBlock {
        let pool = self.pool.take().expect("armed");
        {
            let mut state = pool.state.lock();
            state.slots[self.id.index()].state = BlockState::Complete;
            state.filling -= 1;
            state.complete += 1;
        }
        CompleteBlock {
            pool: Some(pool),
            id: self.id,
            identity: Arc::new(identity),
        }
    }
}

impl Drop for FillingBlock {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.state.lock().free_unregistered(self.id);
        }
    }
}

/// A block written in full, not yet findable. Dropping it returns the block to `Free`.
#[derive(Debug)]
pub struct CompleteBlock {
    pool: Option<Arc<PoolShared>>,
    id: BlockId,
    identity: Arc<BlockIdentity>,
}

impl CompleteBlock {
    /// The block's id in its pool.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// The identity it will be registered under.
    pub fn identity(&self) -> &BlockIdentity {
        &self.identity
    }
}

impl Drop for CompleteBlock {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.state.lock().free_unregistered(self.id);
        }
    }
}

/// A held registered block: findable, readable by copies, never written, never evicted while
/// any clone lives. Dropping the last clone makes it idle.
pub struct RegisteredBlock {
    pool: Arc<PoolShared>,
    id: BlockId,
    hash: SequenceHash,
}

impl std::fmt::Debug for RegisteredBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBlock")
            .field("tier", &self.pool.tier)
            .field("id", &self.id)
            .field("sequence_hash", &self.hash)
            .finish()
    }
}

impl RegisteredBlock {
    /// The block's id in its pool.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// The tier it is registered in.
    pub fn tier(&self) -> Tier {
        self.pool.tier
    }

    /// Its sequence hash.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// Its identity (hash, parent, tokens), read from the pool.
    pub fn identity(&self) -> BlockIdentity {
        let state = self.pool.state.lock();
        BlockIdentity::clone(
            state.slots[self.id.index()]
                .identity
                .as_ref()
                .expect("registered blocks have an identity"),
        )
    }
}

impl Clone for RegisteredBlock {
    fn clone(&self) -> Self {
        self.pool.state.lock().slots[self.id.index()].holders += 1;
        Self {
            pool: self.pool.clone(),
            id: self.id,
            hash: self.hash,
        }
    }
}

impl Drop for RegisteredBlock {
    fn drop(&mut self) {
        release_locked(&mut self.pool.state.lock(), self.id);
    }
}
