//! The leader: the logical half of a split engine (vLLM's scheduler side). It owns the pools of
//! block *ids* of the host and disk tiers, their registry, holds, LRU eviction, disk admission
//! and the tiers' events; the bytes live with the workers, which the leader tells what to copy.
//!
//! The block manager is one leader and one worker in one process; the vLLM connector runs the
//! leader in the scheduler process and a worker per GPU.
//!
//! Invariants:
//! - Block ids handed to workers (onboards and offloads) stay held for `hold_steps` more steps
//!   ([`Leader::end_step`]; [`HOLD_STEPS`] across processes, where the leader does not see when
//!   a worker is done), so that no block a worker may still be copying is evicted and handed
//!   out again meanwhile; an asynchronous onboard's blocks stay held until [`Leader::release`].
//!   A worker in the same process orders its copies itself (see `crate::worker`), so the block
//!   manager holds for 0 steps.
//! - A block is findable (and announced) as soon as its offload is planned: workers order their
//!   copies so that nothing reads a host block before the offload into it completed, and an offload that
//!   could not run leaves its host block unreadable (never served).
//! - Events come from the pools (one `BlockStored` per run of chained blocks, `BlockRemoved` on
//!   eviction) through a bounded subscription ([`EVENT_QUEUE_MAX`]); what overflows is counted.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvbm_events::{BlockHasher, EventPublisher, EventSubscriber, KvEvent, SequenceHash, Tier};

use crate::disk::{encode_identity, Admission, ADMISSION_HALF_LIFE};
use crate::groups::{GroupKind, Groups, NULL_BLOCK};
use crate::metrics::{add, Metrics};
use crate::plan::{AsyncOnboard, Offload, Onboard, StepPlan};
pub use crate::plan::{DiskRead, DiskWrite, SharedRead, SharedWrite};
use crate::pool::{
    clear_across, BlockIdentity, BlockPool, FillingBlock, PoolCounts, RegisteredBlock,
};
use crate::shared::{tenant_id, SharedCounts, SharedStore};
use crate::CoreError;

/// Events queued for [`Leader::take_events`] at most (beyond it they are dropped and counted).
pub const EVENT_QUEUE_MAX: usize = 1 << 20;

/// Steps a block handed to workers in other processes stays held.
pub const HOLD_STEPS: u64 = 2;

/// What a leader manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaderOptions {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks of the host tier (at least 1).
    pub host_blocks: usize,
    /// Blocks of the disk tier (0: none).
    pub disk_blocks: usize,
    /// Admit every host block to disk on first sight.
    pub disk_filter_disabled: bool,
    /// Steps a block handed to workers stays held ([`HOLD_STEPS`] for workers in other
    /// processes).
    pub hold_steps: u64,
}

/// One block to offload: its sequence hash, its parent's, and its tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadBlock {
    /// Sequence hash.
    pub hash: u64,
    /// The previous block's sequence hash.
    pub parent: Option<u64>,
    /// The block's tokens (exactly one block).
    pub tokens: Vec<u32>,
}

/// One request's newly complete blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRun {
    /// Their tokens (whole blocks).
    pub tokens: Vec<u32>,
    /// The sequence hash of the block before them.
    pub parent: Option<u64>,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
    /// Cache salt.
    pub salt: Option<String>,
}

/// What [`Leader::offload_tokens`] decided for one request's run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offloaded {
    /// The blocks' sequence hashes.
    pub hashes: Vec<u64>,
    /// Per block, the host block to offload it into, or None (there already, a duplicate, or no
    /// block to spare).
    pub host: Vec<Option<u32>>,
}

/// A staging host block a disk read lands in, with the identity it joins the host tier under.
type StagedRead = (FillingBlock, BlockIdentity);

/// What an asynchronous onboard holds until [`Leader::release`].
#[derive(Default)]
struct Pinned {
    /// Its host and disk blocks.
    held: Vec<RegisteredBlock>,
    /// Staging host blocks that join the host tier once the onboard finished.
    staged: Vec<StagedRead>,
    /// Staging host blocks of shared reads whose identities the leader does not know, with
    /// their keys: freed once the onboard finished.
    scratch: Vec<(FillingBlock, u64)>,
    /// Keys of the staged blocks a worker reported it could not fill.
    failed: Vec<u64>,
}

/// Shared-tier blocks announced at most while their TTL runs: past it the oldest are
/// announced removed early (the router then credits a pool less, never more, than it holds).
pub const SHARED_ANNOUNCED_MAX: usize = 1 << 22;

/// The shared tier as the leader sees it: prefix lookups over every rank's shard, and what it
/// announced written.
struct SharedLookup {
    store: SharedStore,
    /// Each rank's key fingerprint ([`crate::shared::shard_fingerprint`]).
    fingerprints: Vec<u64>,
    /// The pool's name in events.
    pool: String,
    /// Announced blocks with the time their TTL runs out, oldest first (none without a TTL).
    announced: VecDeque<(Instant, Vec<SequenceHash>)>,
    announced_blocks: usize,
    /// Per announced block, when its last write's TTL runs out and its tenant: a block hit
    /// past half its TTL is written again ([`Leader::refresh_shared`]), so that a hot prefix
    /// never expires from the pool.
    written: HashMap<SequenceHash, (Instant, u64)>,
    /// Announced blocks a lookup found gone from the server before their TTL ran out (the
    /// server's memory policy evicted them, or it restarted): announced removed at the end of
    /// the step, so that the router stops crediting the pool with them.
    gone: parking_lot::Mutex<Vec<SequenceHash>>,
}

/// A request's hit in the shared tier: the blocks continuing its hit in the local tiers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedHit {
    /// How many blocks.
    pub blocks: usize,
    /// The request's tenant ([`tenant_id`]).
    pub tenant: u64,
    /// The blocks' identities when the leader knows them (one per block), to keep the blocks
    /// read in the host tier once the onboard finished; empty otherwise (the staging blocks
    /// are then freed, and a later hit reads the shared tier again).
    pub identities: Vec<BlockIdentity>,
}

/// What an onboard needs: the host blocks of its host part, then the disk reads of the rest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OnboardHolds {
    /// Host blocks holding the first blocks, in order.
    pub host: Vec<u32>,
    /// Disk reads for the blocks after them, in order.
    pub disk_reads: Vec<DiskRead>,
}

/// Where an offload's blocks go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placed {
    /// Per block, the host block to offload it into, or None.
    pub host: Vec<Option<u32>>,
    /// Blocks the host tier held already (or named twice).
    pub deduplicated: usize,
    /// Blocks with no host block to spare.
    pub skipped: usize,
}

/// The counts of both tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaderCounts {
    /// The host tier's.
    pub host: PoolCounts,
    /// The disk tier's, if any.
    pub disk: Option<PoolCounts>,
    /// Events dropped because nobody took them in time.
    pub events_lost: u64,
}

/// The logical host and disk tiers of a split engine.
pub struct Leader {
    block_size: usize,
    host: BlockPool,
    disk: Option<BlockPool>,
    admission: Admission,
    /// Host blocks admitted to disk, waiting for `take_disk_writes`.
    admitted: Vec<RegisteredBlock>,
    /// Staging host blocks of disk onboards (never registered), with their step.
    staging: VecDeque<(u64, Vec<FillingBlock>)>,
    /// What an asynchronous onboard holds, by request, until `release`: its host and disk
    /// blocks, and the staging host blocks its disk reads land in, each with the identity it
    /// is registered under once the onboard finished.
    pinned: HashMap<String, Pinned>,
    /// The shared tier, if any.
    shared: Option<SharedLookup>,
    publisher: EventPublisher,
    /// The leader's own subscription ([`Self::take_events`]), when it made its publisher.
    events: Option<EventSubscriber>,
    events_lost: u64,
    hold_steps: u64,
    /// Blocks handed out, with the step they were handed out in.
    held: VecDeque<(u64, Vec<RegisteredBlock>)>,
    step: u64,
    /// The plan being built for the current step ([`Self::take_plan`]).
    plan: StepPlan,
    /// Lookups and hits of prefix matches (the hit rates), matched tokens.
    metrics: Arc<Metrics>,
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

/// Most tokens per block a leader takes (events carry the block size in 32 bits; vLLM's blocks
/// are far smaller).
pub const BLOCK_SIZE_MAX: usize = 1 << 20;
/// Bytes the leader spends per block of a tier on bookkeeping (its slot, eviction node, free
/// list and index entries), rounded up: what [`check_sizes`] charges against the memory.
pub const BOOKKEEPING_BYTES_PER_BLOCK: u64 = 128;

/// Refuses a leader whose sizes do not fit before anything is allocated: `block_size` above
/// [`BLOCK_SIZE_MAX`], or tiers whose bookkeeping ([`BOOKKEEPING_BYTES_PER_BLOCK`] per block)
/// would take more than half of `memory_bytes`. The error names the argument and its value.
pub fn check_sizes(
    block_size: usize,
    host_blocks: usize,
    disk_blocks: usize,
    memory_bytes: u64,
) -> Result<(), CoreError> {
    if block_size == 0 || block_size > BLOCK_SIZE_MAX {
        return Err(CoreError::InvalidArgument(format!(
            "block_size={block_size}: must be between 1 and {BLOCK_SIZE_MAX} tokens"
        )));
    }
    let budget = memory_bytes / 2;
    let cost = |blocks: usize| (blocks as u64).saturating_mul(BOOKKEEPING_BYTES_PER_BLOCK);
    for (name, blocks) in [("host_blocks", host_blocks), ("disk_blocks", disk_blocks)] {
        if blocks >= u32::MAX as usize {
            return Err(CoreError::InvalidArgument(format!(
                "{name}={blocks}: at most {} blocks (block ids are 32-bit)",
                u32::MAX - 1
            )));
        }
        if cost(blocks) > budget {
            return Err(CoreError::InvalidArgument(format!(
                "{name}={blocks}: the leader's bookkeeping of {BOOKKEEPING_BYTES_PER_BLOCK} bytes \
                 per block would take more than half of this machine's memory ({memory_bytes} \
                 bytes)"
            )));
        }
    }
    if cost(host_blocks).saturating_add(cost(disk_blocks)) > budget {
        return Err(CoreError::InvalidArgument(format!(
            "host_blocks={host_blocks} and disk_blocks={disk_blocks}: the leader's bookkeeping \
             would take more than half of this machine's memory ({memory_bytes} bytes)"
        )));
    }
    Ok(())
}

impl Leader {
    /// A host tier of `host_blocks` blocks of `block_size` tokens, and a disk tier of
    /// `disk_blocks` (0: none). Host blocks go to disk when seen twice (registered, then matched
    /// again) within about ten minutes, or at once with `disk_filter_disabled`.
    pub fn new(
        block_size: usize,
        host_blocks: usize,
        disk_blocks: usize,
        disk_filter_disabled: bool,
    ) -> Result<Self, CoreError> {
        let publisher = EventPublisher::new();
        let events = publisher.subscribe(EVENT_QUEUE_MAX);
        let mut leader = Self::with_publisher(
            LeaderOptions {
                block_size,
                host_blocks,
                disk_blocks,
                disk_filter_disabled,
                hold_steps: HOLD_STEPS,
            },
            publisher,
        )?;
        leader.events = Some(events);
        Ok(leader)
    }

    /// A leader publishing its tiers' events through `publisher` (the caller subscribes;
    /// [`Self::take_events`] returns nothing).
    pub fn with_publisher(
        options: LeaderOptions,
        publisher: EventPublisher,
    ) -> Result<Self, CoreError> {
        let LeaderOptions {
            block_size,
            host_blocks,
            disk_blocks,
            disk_filter_disabled,
            hold_steps,
        } = options;
        if block_size == 0 || host_blocks == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "block_size {block_size} and host_blocks {host_blocks} must be at least 1"
            )));
        }
        check_sizes(
            block_size,
            host_blocks,
            disk_blocks,
            crate::config::machine_memory_bytes(),
        )?;
        let host = BlockPool::new(Tier::Host, host_blocks, block_size, Some(publisher.clone()));
        let disk = (disk_blocks > 0)
            .then(|| BlockPool::new(Tier::Disk, disk_blocks, block_size, Some(publisher.clone())));
        Ok(Self {
            block_size,
            host,
            disk,
            admission: Admission::new(disk_filter_disabled, ADMISSION_HALF_LIFE),
            admitted: Vec::new(),
            staging: VecDeque::new(),
            pinned: HashMap::new(),
            shared: None,
            publisher,
            events: None,
            events_lost: 0,
            hold_steps,
            held: VecDeque::new(),
            step: 0,
            plan: StepPlan::default(),
            metrics: Arc::default(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The current step (incremented by [`Self::end_step`]).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// How many of `hashes`, from the first, the host tier holds (no side effects).
    pub fn count_prefix(&self, hashes_: &[u64]) -> usize {
        self.host.count_prefix(&hashes(hashes_))
    }

    /// The leader's counters: prefix lookups and hits per tier (in blocks), matched tokens.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// How many of `hashes`, from the first, the host tier holds, then how many more continue
    /// on disk and can be onboarded now (each needs a free or evictable host block to stage it).
    /// Changes nothing but the lookup counters.
    pub fn count_prefix_tiers(&self, hashes_: &[u64]) -> (usize, usize) {
        let (host, disk) = self.count_prefix_tiers_quietly(hashes_);
        let m = &self.metrics;
        add(&m.host_lookup_blocks, hashes_.len() as u64);
        add(&m.host_hit_blocks, host as u64);
        if self.disk.is_some() {
            add(&m.disk_lookup_blocks, (hashes_.len() - host) as u64);
            add(&m.disk_hit_blocks, disk as u64);
        }
        add(&m.matched_tokens, ((host + disk) * self.block_size) as u64);
        (host, disk)
    }

    fn count_prefix_tiers_quietly(&self, hashes_: &[u64]) -> (usize, usize) {
        let h = hashes(hashes_);
        let host = self.host.count_prefix(&h);
        let disk = self.disk.as_ref().map_or(0, |d| d.count_prefix(&h[host..]));
        let counts = self.host.counts();
        let staging = counts.free + counts.idle;
        // The host blocks of the host part are idle now but get held for the onboard.
        let staging = staging.saturating_sub(host.min(counts.idle));
        (host, disk.min(staging))
    }

    /// Adds the shared tier: `store` (opened with any one rank's fingerprint; the leader only
    /// looks up) and every rank's key fingerprint, `fingerprints` (a block is a hit when each
    /// rank's shard of it is there). From now on the blocks offloaded into the host tier are
    /// written to the shared tier too ([`StepPlan::shared_writes`]).
    ///
    /// What it plans to write is announced as stored in the pool (`KvEvent::SharedStored`,
    /// while the tier is up), and as removed when its TTL ran out: the server's own evictions
    /// are not seen, so a router takes these as hints.
    pub fn with_shared(mut self, store: SharedStore, fingerprints: Vec<u64>) -> Self {
        let pool = store.options().pool.clone().unwrap_or_else(|| {
            format!(
                "{}:{:016x}",
                store.options().key_prefix,
                fingerprints.first().copied().unwrap_or(0)
            )
        });
        self.shared = Some(SharedLookup {
            store,
            fingerprints,
            pool,
            announced: VecDeque::new(),
            announced_blocks: 0,
            written: HashMap::new(),
            gone: parking_lot::Mutex::new(Vec::new()),
        });
        self
    }

    /// The shared pool's name in events, if the leader has a shared tier.
    pub fn shared_pool(&self) -> Option<&str> {
        self.shared.as_ref().map(|s| s.pool.as_str())
    }

    /// Announces shared blocks whose TTL ran out by `now` (or past [`SHARED_ANNOUNCED_MAX`])
    /// as removed from the pool.
    fn expire_shared(&mut self, now: Instant) {
        let Some(s) = &mut self.shared else {
            return;
        };
        // Blocks a lookup found gone early: removed now. Their entries in `announced` are
        // skipped when they come up (no longer in `written`), unless written again meanwhile.
        let found_gone: Vec<SequenceHash> = std::mem::take(&mut *s.gone.lock())
            .into_iter()
            .filter(|h| s.written.remove(h).is_some())
            .collect();
        if !found_gone.is_empty() {
            self.publisher.publish(KvEvent::SharedRemoved {
                pool: s.pool.clone(),
                removed: kvbm_events::BlockRemoved {
                    tier: Tier::Disk,
                    block_hashes: found_gone,
                },
            });
        }
        while let Some((at, _)) = s.announced.front() {
            if *at > now && s.announced_blocks <= SHARED_ANNOUNCED_MAX {
                break;
            }
            let (_, hashes) = s.announced.pop_front().expect("a front");
            s.announced_blocks -= hashes.len();
            let over = s.announced_blocks > SHARED_ANNOUNCED_MAX;
            // Blocks written again since stay announced until their new TTL ran out.
            // A block no longer in `written` was announced removed already.
            let (gone, rewritten): (Vec<SequenceHash>, Vec<SequenceHash>) = hashes
                .into_iter()
                .filter(|h| s.written.contains_key(h))
                .partition(|h| over || s.written.get(h).is_none_or(|(expires, _)| *expires <= now));
            for h in &gone {
                s.written.remove(h);
            }
            let later = rewritten
                .iter()
                .filter_map(|h| s.written.get(h))
                .map(|w| w.0)
                .max();
            if let Some(later) = later {
                s.announced_blocks += rewritten.len();
                s.announced.push_back((later, rewritten));
            }
            if !gone.is_empty() {
                self.publisher.publish(KvEvent::SharedRemoved {
                    pool: s.pool.clone(),
                    removed: kvbm_events::BlockRemoved {
                        tier: Tier::Disk,
                        block_hashes: gone,
                    },
                });
            }
        }
    }

    /// A host block hit (or offloaded again) that this leader wrote to the shared tier, past
    /// half its TTL: written again (from its host block, held for the write), so that a hot
    /// prefix stays in the pool while it is used.
    fn refresh_shared(&mut self, block: &RegisteredBlock, now: Instant) {
        let Some(s) = &mut self.shared else {
            return;
        };
        let Some(ttl) = s.store.options().ttl else {
            return;
        };
        let hash = block.sequence_hash();
        let Some((expires, tenant)) = s.written.get_mut(&hash) else {
            return;
        };
        if expires.saturating_duration_since(now) > ttl / 2 || !s.store.usable() {
            return;
        }
        *expires = now + ttl;
        let tenant = *tenant;
        self.plan.shared_writes.push(SharedWrite {
            host: block.id().0,
            key: hash.0,
            tenant,
            identity: encode_identity(&block.identity()),
        });
        self.keep(vec![block.clone()]);
    }

    /// Announces a run of blocks planned for the shared tier as stored in its pool (each run
    /// of consecutive blocks one event), while the tier is up.
    fn announce_shared(&mut self, runs: Vec<(Option<SequenceHash>, Vec<BlockIdentity>, u64)>) {
        let block_size = self.block_size as u32;
        let Some(s) = &mut self.shared else {
            return;
        };
        if runs.is_empty() || !s.store.usable() {
            return;
        }
        let expires = s.store.options().ttl.map(|t| Instant::now() + t);
        for (parent, mut blocks, tenant) in runs {
            if let Some(at) = expires {
                // A block announced before is written again, not announced twice: its removal
                // waits for the new TTL.
                blocks.retain(|b| match s.written.get_mut(&b.sequence_hash) {
                    Some(w) => {
                        w.0 = at;
                        false
                    }
                    None => {
                        s.written.insert(b.sequence_hash, (at, tenant));
                        true
                    }
                });
            }
            let parent = match blocks.first() {
                Some(b) => b.parent.or(parent),
                None => continue,
            };
            let hashes: Vec<SequenceHash> = blocks.iter().map(|b| b.sequence_hash).collect();
            let token_ids = blocks
                .iter()
                .flat_map(|b| b.tokens.iter().copied())
                .collect();
            self.publisher.publish(KvEvent::SharedStored {
                pool: s.pool.clone(),
                stored: kvbm_events::BlockStored {
                    tier: Tier::Disk,
                    block_hashes: hashes.clone(),
                    parent_hash: parent,
                    token_ids,
                    block_size,
                    lora_name: blocks[0].lora_name.as_deref().map(str::to_owned),
                },
            });
            if let Some(at) = expires {
                s.announced_blocks += hashes.len();
                s.announced.push_back((at, hashes));
            }
        }
        self.expire_shared(Instant::now());
    }

    /// Whether the leader has a shared tier.
    pub fn has_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// The shared tier's counters as the leader's lookups moved them, if it has one.
    pub fn shared_counts(&self) -> Option<SharedCounts> {
        self.shared.as_ref().map(|s| s.store.counts())
    }

    /// [`Self::count_prefix_tiers`], then how many blocks continue the local hit in the shared
    /// tier for `tenant` (one bounded round trip; a slow or dead server is a miss). Disk and
    /// shared blocks each need a staging host block: together they are at most the room there
    /// is. The shared tier is asked only when the local hit was not cut short by that room.
    pub fn count_prefix_shared(&self, hashes_: &[u64], tenant: u64) -> (usize, usize, usize) {
        let h = hashes(hashes_);
        let host = self.host.count_prefix(&h);
        let disk_all = self.disk.as_ref().map_or(0, |d| d.count_prefix(&h[host..]));
        let room = self.staging_room(host);
        let disk = disk_all.min(room);
        let mut shared = 0;
        let rest = &h[host + disk..];
        let m = &self.metrics;
        if let Some(s) = self.shared.as_ref().filter(|_| disk == disk_all) {
            if !rest.is_empty() && room > disk {
                let found = s.store.lookup_prefix(tenant, rest, &s.fingerprints);
                shared = found.found.min(room - disk);
                // A block this leader announced in the pool, for this tenant, that the server
                // no longer has: its removal is announced at the end of the step.
                if let Some(h) = found.missing.map(|i| rest[i]) {
                    if s.written.get(&h).is_some_and(|w| w.1 == tenant) {
                        s.gone.lock().push(h);
                    }
                }
                add(&m.shared_lookup_blocks, rest.len() as u64);
                add(&m.shared_hit_blocks, shared as u64);
            }
        }
        add(&m.host_lookup_blocks, hashes_.len() as u64);
        add(&m.host_hit_blocks, host as u64);
        if self.disk.is_some() {
            add(&m.disk_lookup_blocks, (hashes_.len() - host) as u64);
            add(&m.disk_hit_blocks, disk as u64);
        }
        add(
            &m.matched_tokens,
            ((host + disk + shared) * self.block_size) as u64,
        );
        (host, disk, shared)
    }

    /// The tier that holds `key` (the host tier first), if any; changes nothing.
    pub fn locate(&self, key: u64) -> Option<Tier> {
        let key = SequenceHash(key);
        if self.host.contains(key) {
            Some(Tier::Host)
        } else if self.disk.as_ref().is_some_and(|d| d.contains(key)) {
            Some(Tier::Disk)
        } else {
            None
        }
    }

    /// Host blocks an onboard could stage disk reads into now, when it also holds `host_hits`
    /// host blocks (idle ones among them stop being evictable).
    pub fn staging_room(&self, host_hits: usize) -> usize {
        let counts = self.host.counts();
        (counts.free + counts.idle).saturating_sub(host_hits.min(counts.idle))
    }

    /// Counts a lookup of `looked` blocks that found `host` in the host tier and `disk` more on
    /// disk, and `matched_tokens` tokens matched.
    pub fn count_lookup(&self, looked: usize, host: usize, disk: usize, matched_tokens: usize) {
        let m = &self.metrics;
        add(&m.host_lookup_blocks, looked as u64);
        add(&m.host_hit_blocks, host as u64);
        if self.disk.is_some() {
            add(&m.disk_lookup_blocks, looked.saturating_sub(host) as u64);
            add(&m.disk_hit_blocks, disk as u64);
        }
        add(&m.matched_tokens, matched_tokens as u64);
    }

    /// Plans the onboard of blocks by key, each into its GPU block (`gpu`, one per key), in any
    /// order of tiers (a hybrid model's groups need blocks that are not one prefix): a key the
    /// host tier holds is copied from its host block; one only on disk is read into a staging
    /// host block first. Holds as [`Self::plan_onboard`] does. A block that cannot be backed
    /// (gone since it was counted, or no staging block to spare) goes to the plan's load errors,
    /// or for an asynchronous onboard to the job's `unbacked` blocks (failing with the request).
    /// Returns, per key, whether it is backed.
    pub fn plan_onboard_keys(
        &mut self,
        request: &str,
        keys: &[u64],
        gpu: &[u32],
        asynchronous: bool,
    ) -> Result<Vec<bool>, CoreError> {
        if gpu.len() != keys.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} GPU blocks for {} keys",
                gpu.len(),
                keys.len()
            )));
        }
        let now = Instant::now();
        // Two passes: every block the tiers hold is held first, and only then are staging host
        // blocks taken for the disk reads, so that a staging block never evicts a host block a
        // later key of the same onboard needs (what `hold_onboard` does for one prefix).
        enum Source {
            Host(RegisteredBlock),
            Disk(RegisteredBlock),
            Missing,
        }
        let mut sources = Vec::with_capacity(keys.len());
        for &key in keys {
            let key = SequenceHash(key);
            if let Some(block) = self.host.lookup(key) {
                self.sight(&block, now);
                sources.push(Source::Host(block));
            } else if let Some(d) = self.disk.as_ref().and_then(|d| d.lookup(key)) {
                sources.push(Source::Disk(d));
            } else {
                sources.push(Source::Missing);
            }
        }
        let on_disk = sources
            .iter()
            .filter(|s| matches!(s, Source::Disk(_)))
            .count();
        let mut stages = self.host.allocate_up_to(on_disk).into_iter();
        let mut held_blocks = Vec::new();
        let mut staged: Vec<StagedRead> = Vec::new();
        let mut reads = Vec::new();
        let mut pairs = Vec::with_capacity(keys.len());
        let mut backed = Vec::with_capacity(keys.len());
        let mut unbacked = Vec::new();
        for ((source, &key), &g) in sources.into_iter().zip(keys).zip(gpu) {
            match source {
                Source::Host(block) => {
                    pairs.push((block.id().0, g));
                    held_blocks.push(block);
                    backed.push(true);
                }
                Source::Disk(d) => match stages.next() {
                    Some(stage) => {
                        reads.push(DiskRead {
                            disk: d.id().0,
                            host: stage.id().0,
                            key,
                        });
                        pairs.push((stage.id().0, g));
                        staged.push((stage, d.identity()));
                        held_blocks.push(d);
                        backed.push(true);
                    }
                    None => {
                        unbacked.push(g);
                        backed.push(false);
                    }
                },
                Source::Missing => {
                    unbacked.push(g);
                    backed.push(false);
                }
            }
        }
        if asynchronous {
            let entry = self.pinned.entry(request.to_owned()).or_default();
            entry.held.extend(held_blocks);
            entry.staged.extend(staged);
            self.plan.async_onboards.push(AsyncOnboard {
                request: request.to_owned(),
                disk_reads: reads,
                pairs,
                unbacked,
                shared_reads: Vec::new(),
                tenant: 0,
            });
        } else {
            self.plan.load_errors.extend(unbacked);
            self.keep(held_blocks);
            if !staged.is_empty() {
                self.staging
                    .push_back((self.step, staged.into_iter().map(|(b, _)| b).collect()));
            }
            if !pairs.is_empty() {
                self.plan.disk_reads.extend(reads);
                self.plan.onboards.push(Onboard {
                    request: request.to_owned(),
                    pairs,
                });
            }
        }
        Ok(backed)
    }

    /// An asynchronous onboard of `request` that fails as a whole: its GPU blocks `gpu` are
    /// reported failed with the request (nothing is read or copied).
    pub fn fail_onboard(&mut self, request: &str, gpu: Vec<u32>) {
        self.plan.async_onboards.push(AsyncOnboard {
            request: request.to_owned(),
            disk_reads: Vec::new(),
            pairs: Vec::new(),
            unbacked: gpu,
            shared_reads: Vec::new(),
            tenant: 0,
        });
    }

    /// Holds what an onboard of `hashes` needs: the host blocks of the held prefix, then for the
    /// blocks continuing it on disk, the disk block, a staging host block to read it into, and
    /// its key. Shorter than asked when blocks were evicted since they were counted or no
    /// staging block is free. Host hits count as sightings for disk admission.
    ///
    /// The blocks stay held `hold_steps` steps, or, with `request_id` (an asynchronous onboard,
    /// which may take longer), until [`Self::release`].
    pub fn hold_onboard(&mut self, hashes_: &[u64], request_id: Option<&str>) -> OnboardHolds {
        let mut held_blocks = Vec::new();
        let mut staged = Vec::new();
        let h = hashes(hashes_);
        let held = self.host.hold_prefix(&h);
        let host_ids: Vec<u32> = held.blocks().iter().map(|(id, _)| id.0).collect();
        let host_blocks = held.into_blocks();
        let now = Instant::now();
        for b in &host_blocks {
            self.sight(b, now);
            self.refresh_shared(b, now);
        }
        held_blocks.extend(host_blocks);
        let mut reads = Vec::new();
        let mut identities = Vec::new();
        if let Some(disk) = &self.disk {
            let rest = &h[host_ids.len()..];
            if !rest.is_empty() {
                let on_disk = disk.hold_prefix(rest);
                let staging = self.host.allocate_up_to(on_disk.len());
                for ((id, hash), stage) in on_disk.blocks().iter().zip(&staging) {
                    reads.push(DiskRead {
                        disk: id.0,
                        host: stage.id().0,
                        key: hash.0,
                    });
                }
                let disk_blocks = on_disk.into_blocks();
                identities = disk_blocks.iter().map(|b| b.identity()).collect();
                held_blocks.extend(disk_blocks);
                staged = staging;
            }
        }
        match request_id {
            Some(rid) => {
                let entry = self.pinned.entry(rid.to_owned()).or_default();
                entry.held.extend(held_blocks);
                entry.staged.extend(staged.into_iter().zip(identities));
            }
            None => {
                self.keep(held_blocks);
                if !staged.is_empty() {
                    self.staging.push_back((self.step, staged));
                }
            }
        }
        OnboardHolds {
            host: host_ids,
            disk_reads: reads,
        }
    }

    /// Drops blocks a worker reported bad (an offload into a host block or a disk write into a
    /// disk block failed): each leaves its tier (`BlockRemoved`) once nothing holds it, so it
    /// is never matched again, and a bad host block is no longer queued for disk. Ids not
    /// registered (already gone) are ignored.
    /// Returns how many were registered.
    pub fn discard(&mut self, host: &[u32], disk: &[u32]) -> usize {
        if !host.is_empty() && !self.admitted.is_empty() {
            // A bad host block is never written to disk.
            self.admitted.retain(|b| !host.contains(&b.id().0));
        }
        if !host.is_empty() {
            // A staging block whose disk read failed never joins the host tier.
            for pinned in self.pinned.values_mut() {
                let Pinned {
                    staged,
                    scratch,
                    failed,
                    ..
                } = pinned;
                staged.retain(|(b, identity)| {
                    let bad = host.contains(&b.id().0);
                    if bad {
                        failed.push(identity.sequence_hash.0);
                    }
                    !bad
                });
                scratch.retain(|(b, key)| {
                    let bad = host.contains(&b.id().0);
                    if bad {
                        failed.push(*key);
                    }
                    !bad
                });
            }
        }
        let mut n = 0;
        let pools = [(Some(&self.host), host), (self.disk.as_ref(), disk)];
        for (pool, ids) in pools {
            let Some(pool) = pool else { continue };
            for &id in ids {
                if let Some(block) = pool.lookup_id(crate::pool::BlockId(id)) {
                    pool.discard(block);
                    n += 1;
                }
            }
        }
        n
    }

    /// The offload of blocks a GPU tier holds (the block manager's): registers those not in the
    /// host tier yet and returns, per block, the host block to offload it into, or None (see
    /// [`Self::offload`]).
    pub fn offload_identities(&mut self, blocks: Vec<BlockIdentity>) -> Result<Placed, CoreError> {
        self.register_blocks(blocks)
    }

    /// Counts into `metrics` (shared with whoever exports them) from now on.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Sightings of host blocks (prefix hits) for disk admission.
    pub fn sight_host(&mut self, blocks: &[RegisteredBlock]) {
        let now = Instant::now();
        for b in blocks.iter().filter(|b| b.tier() == Tier::Host) {
            self.sight(b, now);
        }
    }

    /// Staging host blocks for reading held disk blocks (in order; fewer when the host tier
    /// has no block to spare): the reads, and the blocks to register once they landed
    /// ([`Self::register_staged`]).
    pub fn stage_disk_reads(
        &mut self,
        disk_blocks: &[RegisteredBlock],
    ) -> Result<(Vec<DiskRead>, Vec<FillingBlock>), CoreError> {
        if let Some(b) = disk_blocks.iter().find(|b| b.tier() != Tier::Disk) {
            return Err(CoreError::InvalidArgument(format!(
                "{b:?} is not a disk block"
            )));
        }
        let staging = self.host.allocate_up_to(disk_blocks.len());
        let reads = disk_blocks
            .iter()
            .zip(&staging)
            .map(|(d, h)| DiskRead {
                disk: d.id().0,
                host: h.id().0,
                key: d.sequence_hash().0,
            })
            .collect();
        Ok((reads, staging))
    }

    /// Registers staging host blocks whose disk reads landed, under their disk blocks'
    /// identities; returns them held.
    pub fn register_staged(
        &mut self,
        staged: Vec<(FillingBlock, BlockIdentity)>,
    ) -> Result<Vec<RegisteredBlock>, CoreError> {
        self.host
            .register_all(staged.into_iter().map(|(b, id)| b.complete(id)).collect())
            .map_err(|r| CoreError::InvalidArgument(r.reason.into()))
    }

    /// Adopts what a worker's disk file held when it opened (`(disk block, key, metadata)`):
    /// each block with a readable identity is registered in the disk tier and announced
    /// (`BlockStored{tier: Disk}`). Only for a leader whose disk tier is empty and one worker
    /// (another rank's file may hold other blocks). Returns how many were adopted.
    pub fn adopt_disk(&mut self, found: Vec<(u32, u64, Vec<u8>)>) -> Result<usize, CoreError> {
        let Some(disk) = &self.disk else {
            return Ok(0);
        };
        let total = found.len();
        let found: Vec<(crate::pool::BlockId, BlockIdentity)> = found
            .into_iter()
            .filter_map(|(slot, key, metadata)| {
                Some((
                    crate::pool::BlockId(slot),
                    crate::disk::decode_identity(SequenceHash(key), &metadata)?,
                ))
            })
            .collect();
        if found.len() < total {
            tracing::warn!(
                unreadable = total - found.len(),
                "recovered disk blocks without a readable identity were dropped"
            );
        }
        let ids: Vec<crate::pool::BlockId> = found.iter().map(|(id, _)| *id).collect();
        let claimed = disk.claim(&ids)?;
        let complete = claimed
            .into_iter()
            .zip(found)
            .map(|(b, (_, identity))| b.complete(identity))
            .collect();
        let adopted = disk
            .register_all(complete)
            .map_err(|r| CoreError::InvalidArgument(r.reason.into()))?;
        Ok(adopted.len())
    }

    /// The host tier's pool.
    pub fn host_pool(&self) -> &BlockPool {
        &self.host
    }

    /// The disk tier's pool, if any.
    pub fn disk_pool(&self) -> Option<&BlockPool> {
        self.disk.as_ref()
    }

    /// The tiers' event publisher (subscribe to follow the host and disk tiers' events, e.g. with
    /// a ZMQ publisher).
    pub fn publisher(&self) -> &EventPublisher {
        &self.publisher
    }

    /// Evicts every idle host block (a benchmark's way to leave only the disk copies); returns
    /// how many left.
    pub fn evict_idle_host(&self) -> usize {
        self.host.evict_idle(usize::MAX)
    }

    /// The keys of `request_id`'s asynchronous onboard a worker reported it could not fill
    /// (taken; [`Self::discard`] records them): its blocks from the first of them on are
    /// recomputed by the engine, and must be offloaded again as they fill.
    pub fn take_failed_loads(&mut self, request_id: &str) -> Vec<u64> {
        self.pinned
            .get_mut(request_id)
            .map(|p| std::mem::take(&mut p.failed))
            .unwrap_or_default()
    }

    /// Releases what an asynchronous onboard of `request_id` held (when its onboard finished); false
    /// for a request that holds nothing. Its staging host blocks, which now hold the blocks read
    /// from disk, join the host tier under those blocks' identities (announced as host blocks):
    /// a disk hit becomes a host block, and is not offloaded from the GPU again. Staging blocks
    /// a worker reported bad were dropped by [`Self::discard`] before.
    pub fn release(&mut self, request_id: &str) -> bool {
        let Some(Pinned { staged, .. }) = self.pinned.remove(request_id) else {
            return false;
        };
        if !staged.is_empty() {
            // Unlike `BlockManager::onboard_from_disk`, nothing reads the registered blocks
            // returned here (the GPU already loaded from the staging blocks): where one of these
            // identities is already registered on a host block an offload is still filling, the
            // staged copy is dropped for it, and if that offload fails its callback takes the
            // block out of the tier. A cache entry lost, never wrong bytes served, so no wait.
            let complete = staged.into_iter().map(|(b, id)| b.complete(id)).collect();
            if let Err(r) = self.host.register_all(complete) {
                tracing::warn!(
                    reason = r.reason,
                    "staged disk reads not kept in the host tier"
                );
            }
        }
        true
    }

    /// The disk writes of the blocks admitted since the last call: each gets a disk block,
    /// registered (and announced) now; the workers write it from its host block.
    pub fn take_disk_writes(&mut self) -> Result<Vec<DiskWrite>, CoreError> {
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
            .map_err(|r| CoreError::InvalidArgument(r.reason.into()))?;
        let mut writes = Vec::with_capacity(registered.len());
        let mut seen = HashSet::with_capacity(registered.len());
        for (d, h) in registered.iter().zip(&sources) {
            if seen.insert(d.id().0) {
                writes.push(DiskWrite {
                    host: h.id().0,
                    disk: d.id().0,
                    key: h.sequence_hash().0,
                    identity: encode_identity(&h.identity()),
                });
            }
        }
        // Both ends stay held while the workers copy.
        self.keep(registered);
        self.keep(sources);
        Ok(writes)
    }

    /// Registers the blocks not in the host tier yet and returns, per block, the host block id to
    /// offload it into (None when it is there already or the tier has no block to spare).
    pub fn offload(
        &mut self,
        blocks: Vec<OffloadBlock>,
        lora_name: Option<&str>,
    ) -> Result<Vec<Option<u32>>, CoreError> {
        let lora: Option<Arc<str>> = lora_name.map(Arc::from);
        let planned = blocks
            .into_iter()
            .map(|b| BlockIdentity {
                sequence_hash: SequenceHash(b.hash),
                parent: b.parent.map(SequenceHash),
                tokens: Arc::from(b.tokens),
                lora_name: lora.clone(),
                group: None,
            })
            .collect();
        Ok(self.register_blocks(planned)?.host)
    }

    /// The sequence hashes of each run's blocks (no side effects; for callers that hash without
    /// holding the leader).
    pub fn hash_runs(block_size: usize, runs: &[TokenRun]) -> Result<Vec<Vec<u64>>, CoreError> {
        if let Some(run) = runs.iter().find(|r| r.tokens.len() % block_size != 0) {
            return Err(CoreError::InvalidArgument(format!(
                "{} tokens are not whole blocks of {block_size}",
                run.tokens.len()
            )));
        }
        Ok(runs
            .iter()
            .map(|run| {
                BlockHasher::new(block_size, run.lora_name.as_deref(), run.salt.as_deref())
                    .sequence_hashes(run.parent.map(SequenceHash), &run.tokens)
                    .into_iter()
                    .map(|h| h.0)
                    .collect()
            })
            .collect())
    }

    /// The whole offload of a step in one call: per request, the run of its blocks that became
    /// complete, with `hashed` its blocks' sequence hashes ([`Self::hash_runs`]). Registers the
    /// blocks not in the host tier yet and returns per request the hashes and, per block, the host
    /// block to offload it into or None.
    pub fn offload_runs(
        &mut self,
        runs: &[TokenRun],
        hashed: Vec<Vec<u64>>,
    ) -> Result<Vec<Offloaded>, CoreError> {
        let b = self.block_size;
        if runs.len() != hashed.len()
            || runs
                .iter()
                .zip(&hashed)
                .any(|(r, h)| r.tokens.len() != h.len() * b)
        {
            return Err(CoreError::InvalidArgument(
                "one sequence hash per block of each run".into(),
            ));
        }
        let mut planned = Vec::with_capacity(hashed.iter().map(Vec::len).sum());
        // Per planned block, its tenant (for its shared write).
        let mut tenants = Vec::new();
        for (run, hashes) in runs.iter().zip(&hashed) {
            let lora: Option<Arc<str>> = run.lora_name.as_deref().map(Arc::from);
            let tenant = tenant_id(run.lora_name.as_deref(), run.salt.as_deref());
            let mut prev = run.parent;
            for (hash, block) in hashes.iter().zip(run.tokens.chunks_exact(b)) {
                planned.push(BlockIdentity {
                    sequence_hash: SequenceHash(*hash),
                    parent: prev.map(SequenceHash),
                    tokens: Arc::from(block),
                    lora_name: lora.clone(),
                    group: None,
                });
                tenants.push(tenant);
                prev = Some(*hash);
            }
        }
        // What reaches the host tier is written to the shared tier too: the identities are
        // kept for the writes of the blocks that get a host block.
        let identities = self.shared.is_some().then(|| planned.clone());
        let placed = self.register_blocks(planned)?.host;
        if let Some(identities) = identities {
            // Runs of consecutive blocks written, for their events.
            let mut runs: Vec<(Option<SequenceHash>, Vec<BlockIdentity>, u64)> = Vec::new();
            let mut extends = false;
            for ((host, identity), tenant) in placed.iter().zip(identities).zip(&tenants) {
                let Some(host) = host else {
                    extends = false;
                    continue;
                };
                self.plan.shared_writes.push(SharedWrite {
                    host: *host,
                    key: identity.sequence_hash.0,
                    tenant: *tenant,
                    identity: encode_identity(&identity),
                });
                match runs.last_mut() {
                    Some((_, blocks, _))
                        if extends && blocks.last().map(|b| b.sequence_hash) == identity.parent =>
                    {
                        blocks.push(identity)
                    }
                    _ => runs.push((identity.parent, vec![identity], *tenant)),
                }
                extends = true;
            }
            self.announce_shared(runs);
        }
        let mut ids = placed.into_iter();
        Ok(hashed
            .into_iter()
            .map(|hashes| {
                let host = ids.by_ref().take(hashes.len()).collect();
                Offloaded { hashes, host }
            })
            .collect())
    }

    /// Plans the onboard of a request's matched blocks into the GPU blocks vLLM allocated for
    /// them (`gpu`, one per hash): holds what [`Self::hold_onboard`] holds, pairs host blocks (and
    /// staging blocks of disk reads) with GPU blocks, and adds it to the step's plan, as an
    /// asynchronous onboard when `asynchronous` (reported in `finished_recving` even when
    /// nothing could be held). GPU blocks that could not be backed (evicted since matched) go to
    /// the plan's load errors. Returns how many blocks, from the first, are backed.
    pub fn plan_onboard(
        &mut self,
        request: &str,
        hashes_: &[u64],
        gpu: &[u32],
        asynchronous: bool,
    ) -> Result<usize, CoreError> {
        self.plan_onboard_with(request, hashes_, gpu, asynchronous, SharedHit::default())
    }

    /// [`Self::plan_onboard`] of a hit whose last `shared.blocks` blocks come from the shared
    /// tier (an asynchronous onboard only): each is read into a staging host block, held until
    /// [`Self::release`], which keeps it in the host tier when its identity is known.
    pub fn plan_onboard_with(
        &mut self,
        request: &str,
        hashes_: &[u64],
        gpu: &[u32],
        asynchronous: bool,
        shared: SharedHit,
    ) -> Result<usize, CoreError> {
        if gpu.len() != hashes_.len() || shared.blocks > hashes_.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} GPU blocks for {} hashes, {} of them shared",
                gpu.len(),
                hashes_.len(),
                shared.blocks
            )));
        }
        let local = hashes_.len() - shared.blocks;
        let plan = self.hold_onboard(&hashes_[..local], asynchronous.then_some(request));
        let mut got = plan.host.len() + plan.disk_reads.len();
        let mut shared_reads = Vec::new();
        if asynchronous && got == local && shared.blocks > 0 && self.shared.is_some() {
            let stages = self.host.allocate_up_to(shared.blocks);
            for (stage, &key) in stages.iter().zip(&hashes_[local..]) {
                shared_reads.push(SharedRead {
                    host: stage.id().0,
                    key,
                });
            }
            let entry = self.pinned.entry(request.to_owned()).or_default();
            if shared.identities.len() == shared.blocks {
                entry
                    .staged
                    .extend(stages.into_iter().zip(shared.identities));
            } else {
                entry
                    .scratch
                    .extend(stages.into_iter().zip(hashes_[local..].iter().copied()));
            }
            got += shared_reads.len();
        }
        let pairs: Vec<(u32, u32)> = plan
            .host
            .iter()
            .copied()
            .chain(plan.disk_reads.iter().map(|r| r.host))
            .chain(shared_reads.iter().map(|r| r.host))
            .zip(gpu.iter().copied())
            .collect();
        self.plan.load_errors.extend_from_slice(&gpu[got..]);
        if asynchronous {
            self.plan.async_onboards.push(AsyncOnboard {
                request: request.to_owned(),
                disk_reads: plan.disk_reads,
                pairs,
                unbacked: Vec::new(),
                shared_reads,
                tenant: shared.tenant,
            });
        } else if !pairs.is_empty() {
            self.plan.disk_reads.extend(plan.disk_reads);
            self.plan.onboards.push(Onboard {
                request: request.to_owned(),
                pairs,
            });
        }
        Ok(got)
    }

    /// The whole offload of a step: per request, the run of its blocks that became complete and
    /// the GPU blocks holding them (one per block). Hashes the runs, registers the blocks not in
    /// the host tier yet and adds their offloads to the step's plan; returns per run its blocks'
    /// sequence hashes and how many blocks the plan offloads.
    pub fn plan_offloads(
        &mut self,
        runs: Vec<(String, TokenRun, Vec<u32>)>,
    ) -> Result<Vec<(Vec<u64>, usize)>, CoreError> {
        let b = self.block_size;
        if let Some((r, run, gpu)) = runs
            .iter()
            .find(|(_, run, gpu)| run.tokens.len() != gpu.len() * b)
        {
            return Err(CoreError::InvalidArgument(format!(
                "request {r}: {} tokens for {} GPU blocks of {b}",
                run.tokens.len(),
                gpu.len()
            )));
        }
        let mut requests = Vec::with_capacity(runs.len());
        let mut token_runs = Vec::with_capacity(runs.len());
        let mut gpus = Vec::with_capacity(runs.len());
        for (request, run, gpu) in runs {
            requests.push(request);
            token_runs.push(run);
            gpus.push(gpu);
        }
        let hashed = Self::hash_runs(b, &token_runs)?;
        let offloaded = self.offload_runs(&token_runs, hashed)?;
        let mut out = Vec::with_capacity(requests.len());
        for ((request, gpu), o) in requests.into_iter().zip(gpus).zip(offloaded) {
            let pairs: Vec<(u32, u32)> = gpu
                .iter()
                .zip(&o.host)
                .filter_map(|(&g, h)| h.map(|h| (g, h)))
                .collect();
            let n = pairs.len();
            if n > 0 {
                self.plan.offloads.push(Offload { request, pairs });
            }
            out.push((o.hashes, n));
        }
        Ok(out)
    }

    /// [`Self::plan_offloads`] for a hybrid model: per request, the run of its blocks that
    /// became complete and, per KV cache group, the GPU blocks holding them (one per block,
    /// vLLM's null block where the group keeps none). Each group's copy of a block is
    /// registered under its group's key ([`Groups::key`]); only the primary group's are
    /// announced. Returns per run its blocks' sequence hashes and how many copies the plan
    /// offloads.
    pub fn plan_offloads_grouped(
        &mut self,
        groups: &Groups,
        runs: Vec<(String, TokenRun, Vec<Vec<u32>>)>,
    ) -> Result<Vec<(Vec<u64>, usize)>, CoreError> {
        let b = self.block_size;
        if let Some((r, _, ids)) = runs.iter().find(|(_, run, ids)| {
            ids.len() != groups.len() || ids.iter().any(|g| run.tokens.len() != g.len() * b)
        }) {
            return Err(CoreError::InvalidArgument(format!(
                "request {r}: GPU blocks of {} groups for a model of {} groups, or not one per \
                 block of {b} tokens",
                ids.len(),
                groups.len()
            )));
        }
        let token_runs: Vec<TokenRun> = runs.iter().map(|(_, run, _)| run.clone()).collect();
        let hashed = Self::hash_runs(b, &token_runs)?;
        let mut planned = Vec::new();
        // (request index, GPU block) per planned copy, in order.
        let mut targets = Vec::new();
        for (ri, ((_, run, ids), hashes)) in runs.iter().zip(&hashed).enumerate() {
            let lora: Option<Arc<str>> = run.lora_name.as_deref().map(Arc::from);
            for (g, group_ids) in ids.iter().enumerate() {
                let group = (g != groups.primary()).then_some(g as u16);
                let mut prev = run.parent;
                for ((hash, block), &gpu) in
                    hashes.iter().zip(run.tokens.chunks_exact(b)).zip(group_ids)
                {
                    if gpu != NULL_BLOCK {
                        planned.push(BlockIdentity {
                            sequence_hash: SequenceHash(groups.key(g, *hash)),
                            parent: prev.map(|p| SequenceHash(groups.key(g, p))),
                            tokens: Arc::from(block),
                            lora_name: lora.clone(),
                            group,
                        });
                        targets.push((ri, gpu, g));
                    }
                    prev = Some(*hash);
                }
            }
        }
        let host = self.register_blocks(planned)?.host;
        let mut pairs: Vec<Vec<(u32, u32)>> = vec![Vec::new(); runs.len()];
        for ((ri, gpu, group), h) in targets.into_iter().zip(host) {
            if let Some(h) = h {
                pairs[ri].push((gpu, h));
                // vLLM frees such a group's blocks mid-request, unannounced.
                self.plan.fence_offloads |= groups.kinds()[group] != GroupKind::Full;
            }
        }
        let mut out = Vec::with_capacity(runs.len());
        for (((request, _, _), hashes), pairs) in runs.into_iter().zip(hashed).zip(pairs) {
            let n = pairs.len();
            if n > 0 {
                self.plan.offloads.push(Offload { request, pairs });
            }
            out.push((hashes, n));
        }
        Ok(out)
    }

    /// Closes the step: its plan (with the disk writes of the blocks admitted meanwhile and the
    /// requests vLLM preempted), then [`Self::end_step`].
    pub fn take_plan(&mut self, preempted: Vec<String>) -> Result<StepPlan, CoreError> {
        let disk_writes = self.take_disk_writes()?;
        let mut plan = std::mem::take(&mut self.plan);
        plan.step = self.step;
        plan.disk_writes = disk_writes;
        plan.preempted = preempted;
        self.end_step();
        Ok(plan)
    }

    /// Ends a step: blocks handed out `hold_steps` steps ago become evictable again.
    pub fn end_step(&mut self) {
        self.step += 1;
        if self.shared.is_some() {
            self.expire_shared(Instant::now());
        }
        while self
            .held
            .front()
            .is_some_and(|(s, _)| s + self.hold_steps <= self.step)
        {
            self.held.pop_front();
        }
        while self
            .staging
            .front()
            .is_some_and(|(s, _)| s + self.hold_steps <= self.step)
        {
            self.staging.pop_front();
        }
    }

    /// Drops every held block and clears the tiers' registries (one `AllBlocksCleared`).
    /// Asynchronous onboards in flight keep their blocks: the reset is then refused (busy).
    pub fn reset(&mut self) -> Result<(), CoreError> {
        self.reset_with(&[])
    }

    /// As [`Self::reset`], clearing `others` too in the same event (the block manager's GPU
    /// tier): all or nothing.
    pub fn reset_with(&mut self, others: &[&BlockPool]) -> Result<(), CoreError> {
        self.held.clear();
        self.staging.clear();
        self.admitted.clear();
        let mut pools = others.to_vec();
        pools.push(&self.host);
        pools.extend(self.disk.as_ref());
        clear_across(&pools)
    }

    /// The events since the last call (host and disk tiers, in order).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        let Some(events) = &mut self.events else {
            return out;
        };
        while let Some(d) = events.try_recv() {
            self.events_lost += d.missed_before;
            out.push(d.record.event.clone());
        }
        out
    }

    /// Both tiers' counts.
    pub fn counts(&self) -> LeaderCounts {
        LeaderCounts {
            host: self.host.counts(),
            disk: self.disk.as_ref().map(BlockPool::counts),
            events_lost: self.events_lost,
        }
    }

    /// The hashes a tier holds (for checks); empty for a tier the leader does not have.
    pub fn registered_hashes(&self, tier: Tier) -> Vec<u64> {
        let pool = match tier {
            Tier::Host => Some(&self.host),
            Tier::Disk => self.disk.as_ref(),
            Tier::Gpu => None,
        };
        pool.map_or(Vec::new(), |p| {
            p.registered_hashes().into_iter().map(|h| h.0).collect()
        })
    }

    /// Registers the blocks not in the host tier yet; per block, the host block to offload it
    /// into, or None: already there (a sighting for disk admission, counted as de-duplicated),
    /// a duplicate in the list (de-duplicated), or no block to spare (skipped).
    fn register_blocks(&mut self, blocks: Vec<BlockIdentity>) -> Result<Placed, CoreError> {
        if let Some(b) = blocks.iter().find(|b| b.tokens.len() != self.block_size) {
            return Err(CoreError::InvalidArgument(format!(
                "block {:#x} has {} tokens, blocks have {}",
                b.sequence_hash.0,
                b.tokens.len(),
                self.block_size
            )));
        }
        let now = Instant::now();
        let mut out = vec![None; blocks.len()];
        let mut missing = Vec::with_capacity(blocks.len());
        let mut present = 0usize;
        for (i, b) in blocks.iter().enumerate() {
            match self.host.lookup(b.sequence_hash) {
                Some(resident) => {
                    present += 1;
                    self.sight(&resident, now);
                    self.refresh_shared(&resident, now);
                }
                None => missing.push(i),
            }
        }
        let fresh = self.host.allocate_up_to(missing.len());
        let skipped = missing.len() - fresh.len();
        let mut completed = Vec::with_capacity(fresh.len());
        let mut positions = Vec::with_capacity(fresh.len());
        let mut blocks: Vec<Option<BlockIdentity>> = blocks.into_iter().map(Some).collect();
        for (block, &i) in fresh.into_iter().zip(&missing) {
            let identity = blocks[i].take().expect("each position once");
            completed.push(block.complete(identity));
            positions.push(i);
        }
        let registered = self
            .host
            .register_all(completed)
            .map_err(|r| CoreError::InvalidArgument(r.reason.into()))?;
        let mut kept = Vec::with_capacity(registered.len());
        let mut seen = HashSet::with_capacity(registered.len());
        for (block, i) in registered.into_iter().zip(positions) {
            // A duplicate within this list resolves to the block registered first: offload once.
            if seen.insert(block.id().0) {
                out[i] = Some(block.id().0);
                self.sight(&block, now);
            } else {
                present += 1;
            }
            kept.push(block);
        }
        add(&self.metrics.offload_deduplicated_blocks, present as u64);
        add(&self.metrics.offload_skipped_blocks, skipped as u64);
        self.keep(kept);
        Ok(Placed {
            host: out,
            deduplicated: present,
            skipped,
        })
    }

    /// A sighting of a host block for disk admission; admitted blocks not on disk yet queue for
    /// `take_disk_writes` (held meanwhile).
    fn sight(&mut self, block: &RegisteredBlock, now: Instant) {
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

    fn keep(&mut self, blocks: Vec<RegisteredBlock>) {
        if blocks.is_empty() {
            return;
        }
        match self.held.back_mut() {
            Some((s, v)) if *s == self.step => v.extend(blocks),
            _ => self.held.push_back((self.step, blocks)),
        }
    }
}
