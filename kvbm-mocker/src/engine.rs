//! One simulated vLLM worker: a discrete-step engine in vLLM v1's scheduler's outline, with
//! prefix caching over kvbm-core's [`BlockPool`]s and the KV events they publish.
//!
//! Scheduling (vLLM `vllm/v1/core/sched/scheduler.py` `Scheduler.schedule`, in outline): a step
//! has a token budget (`max_num_batched_tokens`). Running requests go first, in order: each asks
//! for its remaining tokens (1 for a decode, the rest of the prompt for a prefill in progress),
//! capped by the budget left (chunked prefill). When the GPU pool cannot give a running request
//! the blocks it needs, the newest running request is preempted (its blocks released, it goes
//! back to the front of the waiting queue and is recomputed when it resumes), until the request
//! fits or is itself the one preempted. Then, if nothing was preempted, waiting requests are
//! admitted in order while the budget and `max_num_seqs` allow: a prefix-cache lookup (GPU first,
//! then the host tier, then disk, as `KVCacheManager.get_computed_blocks` and the connector's
//! `get_num_new_matched_tokens`; at most `len - 1` tokens are taken from cache so one is always
//! computed), then blocks for the first chunk. A request whose blocks do not fit stops admission
//! (FCFS). A hit in the host or disk tier is loaded asynchronously (vLLM's
//! `WAITING_FOR_REMOTE_KVS`): GPU blocks are allocated, the request waits
//! `bytes / bandwidth` simulated seconds while others step, then the loaded blocks are registered
//! on the GPU (GPU events) and the request is admitted like any other.
//!
//! Blocks: a GPU block is registered (BlockStored) when every one of its tokens' KV has been
//! computed, and written through to the host tier at once (kvbm's connector offloads every full
//! block). Host evictions go on to the disk tier when there is one. Pools evict idle registered
//! blocks LRU first (kvbm-core's `LruPriority`), publishing BlockRemoved.
//!
//! Shared pool (kvbm's shared tier on Redis / Valkey, modelled; `--shared-blocks`): one pool
//! every worker of the process reaches. What a worker writes through to its host tier it also
//! writes there (kvbm writes what reaches the host tier); a lookup continues past the worker's own
//! tiers into it, loaded at the network's bandwidth (`--shared-gbps`). Its stores and evictions
//! go out as kvbm publishes them (medium `STORAGE`, `locality` `REMOTE`, the pool in
//! `ownership`), through the worker whose step drained them.
//!
//! Events: the pools publish to an internal bus; after each step the engine rewrites the GPU
//! tier's events with engine block hashes ([`engine_hash`]: vLLM's hashes are its own, not
//! kvbm's) and republishes everything on the worker's outgoing bus, which the ZMQ publisher
//! sends in vLLM's wire form. Host and disk events keep kvbm's sequence hashes, as kvbm's
//! connector publishes them.
//!
//! Outputs: every decode step produces one fixed token (`output_token`); requests always run to
//! `max_tokens` (the mocker never samples EOS), and `min_tokens`/`ignore_eos` are thus honoured
//! trivially.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvbm_core::pool::{BlockIdentity, BlockPool, FillingBlock, RegisteredBlock};
use kvbm_events::{
    BlockHasher, BlockRemoved, BlockStored, EventPublisher, EventSubscriber, KvEvent, SequenceHash,
    Tier,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::{EngineConfig, StepShape};
use crate::metrics::WorkerMetrics;

/// Seed of the engine block hashes the GPU tier's events carry.
pub const ENGINE_HASH_SEED: u64 = 0x6d6f_636b_6572; // "mocker"

/// The engine's own hash of a block kvbm knows by `h`: deterministic, and unlike kvbm's.
pub fn engine_hash(h: SequenceHash) -> SequenceHash {
    SequenceHash(xxhash_rust::xxh3::xxh3_64_with_seed(
        &h.0.to_le_bytes(),
        ENGINE_HASH_SEED,
    ))
}

/// What a request hears from the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Tokens generated in one step.
    Tokens(u32),
    /// The request finished.
    Finished(Usage),
    /// The request can never run here (too large for the GPU pool).
    Rejected(String),
}

/// A finished request's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens taken from a cache (any tier).
    pub cached_tokens: u32,
}

/// A request handed to the engine.
#[derive(Debug)]
pub struct Request {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate (at least 1).
    pub max_tokens: u32,
    /// The token every decode produces.
    pub output_token: u32,
    /// Whether each step's tokens are sent (a stream) or only the end.
    pub stream: bool,
    /// Where outputs go; the request is aborted once its receiver is gone.
    pub out: UnboundedSender<Output>,
}

enum GpuBlock {
    Filling(FillingBlock),
    /// Held (never read): holding keeps the block from eviction.
    #[allow(dead_code)]
    Done(RegisteredBlock),
    Taken,
}

struct Load {
    ready_at: f64,
    /// Host or disk blocks held while they are read.
    _held: Vec<RegisteredBlock>,
    /// First block being loaded, and how many.
    first: usize,
    count: usize,
}

struct Seq {
    out: UnboundedSender<Output>,
    stream: bool,
    max_tokens: u32,
    output_token: u32,
    tokens: Vec<u32>,
    prompt_len: usize,
    hashes: Vec<SequenceHash>,
    blocks: Vec<GpuBlock>,
    /// Blocks `0..registered` are `Done`.
    registered: usize,
    computed: usize,
    generated: u32,
    prefilled: bool,
    looked_up: bool,
    /// Prompt tokens from the GPU, host and disk tiers at admission.
    cached: [usize; 4],
    load: Option<Load>,
}

impl Seq {
    /// A request not yet looked up, nothing computed.
    fn new(req: Request) -> Self {
        Self {
            out: req.out,
            stream: req.stream,
            max_tokens: req.max_tokens,
            output_token: req.output_token,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            hashes: Vec::new(),
            blocks: Vec::new(),
            registered: 0,
            computed: 0,
            generated: 0,
            prefilled: false,
            looked_up: false,
            cached: [0; 4],
            load: None,
        }
    }
}

impl Seq {
    fn release(&mut self) {
        self.blocks.clear();
        self.registered = 0;
        self.computed = 0;
        self.looked_up = false;
        self.load = None;
    }
}

/// What a step did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// Its shape for the cost model.
    pub shape: StepShape,
    /// Simulated seconds it took.
    pub duration: f64,
    /// Tokens scheduled per request index of the running list, in order (decodes and prefill
    /// chunks).
    pub scheduled: Vec<usize>,
    /// Requests preempted.
    pub preempted: usize,
}

/// The fleet's shared pool: blocks every worker of the process reaches.
pub struct SharedPool {
    name: String,
    pool: BlockPool,
    /// The pool's own events, turned into the shared tier's by whichever worker drains them.
    events: Mutex<EventSubscriber>,
}

impl std::fmt::Debug for SharedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPool")
            .field("name", &self.name)
            .field("counts", &self.pool.counts())
            .finish()
    }
}

impl SharedPool {
    /// A pool of `blocks` blocks of `block_size` tokens, named `name` in events.
    pub fn new(name: &str, blocks: usize, block_size: usize) -> Self {
        let bus = EventPublisher::new();
        let events = bus.subscribe(kvbm_events::SUBSCRIBER_CAPACITY_MAX);
        Self {
            name: name.to_owned(),
            pool: BlockPool::new(Tier::Disk, blocks, block_size, Some(bus)),
            events: Mutex::new(events),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
}

/// One worker's engine. Single-threaded; [`run_worker`] drives it against wall time.
pub struct Engine {
    cfg: EngineConfig,
    hasher: BlockHasher,
    gpu: BlockPool,
    host: Option<BlockPool>,
    disk: Option<BlockPool>,
    shared: Option<Arc<SharedPool>>,
    internal: EventSubscriber,
    out_bus: EventPublisher,
    host_identities: HashMap<SequenceHash, BlockIdentity>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    offload: Vec<BlockIdentity>,
    /// The simulated clock, seconds.
    pub clock: f64,
    metrics: Arc<WorkerMetrics>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("clock", &self.clock)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

enum Lookup {
    Ready,
    Loading,
    NoFit,
}

impl Engine {
    /// An engine whose KV events go out on `out_bus`.
    pub fn new(cfg: EngineConfig, out_bus: EventPublisher, metrics: Arc<WorkerMetrics>) -> Self {
        let internal_bus = EventPublisher::new();
        let internal = internal_bus.subscribe(kvbm_events::SUBSCRIBER_CAPACITY_MAX);
        let pool = |tier, n: usize| {
            (n > 0).then(|| BlockPool::new(tier, n, cfg.block_size, Some(internal_bus.clone())))
        };
        let gpu = pool(Tier::Gpu, cfg.gpu_blocks).expect("at least one GPU block");
        let host = pool(Tier::Host, cfg.host_blocks);
        let disk = pool(Tier::Disk, cfg.disk_blocks);
        Self {
            hasher: BlockHasher::new(cfg.block_size, None, None),
            cfg,
            gpu,
            host,
            disk,
            shared: None,
            internal,
            out_bus,
            host_identities: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            offload: Vec::new(),
            clock: 0.0,
            metrics,
        }
    }

    /// The same engine reaching the fleet's shared pool.
    pub fn with_shared(mut self, shared: Option<Arc<SharedPool>>) -> Self {
        self.shared = shared;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The GPU pool (tests look at its counts).
    pub fn gpu(&self) -> &BlockPool {
        &self.gpu
    }

    /// Requests running / waiting.
    pub fn queue_lengths(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// Nothing to do.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Queues a request (or rejects it at once if it could never fit the GPU pool).
    pub fn add(&mut self, req: Request) {
        let total = req.prompt.len() + req.max_tokens as usize;
        if req.prompt.is_empty() || req.max_tokens == 0 {
            let _ = req.out.send(Output::Rejected(
                "the prompt must not be empty and max_tokens must be at least 1".into(),
            ));
            return;
        }
        if self.blocks_for(total) > self.cfg.gpu_blocks {
            let _ = req.out.send(Output::Rejected(format!(
                "this model's maximum context length is {} tokens ({} GPU blocks of {}); the request needs {total}",
                self.cfg.gpu_blocks * self.cfg.block_size,
                self.cfg.gpu_blocks,
                self.cfg.block_size
            )));
            return;
        }
        let mut seq = Seq::new(req);
        self.extend_hashes(&mut seq);
        self.waiting.push_back(seq);
    }

    fn extend_hashes(&self, seq: &mut Seq) {
        let bs = self.cfg.block_size;
        while (seq.hashes.len() + 1) * bs <= seq.tokens.len() {
            let b = seq.hashes.len();
            let h = SequenceHash::chain(
                seq.hashes.last().copied(),
                self.hasher.block_hash(&seq.tokens[b * bs..(b + 1) * bs]),
            );
            seq.hashes.push(h);
        }
    }

    fn identity(&self, seq: &Seq, b: usize) -> BlockIdentity {
        let bs = self.cfg.block_size;
        BlockIdentity {
            sequence_hash: seq.hashes[b],
            parent: b.checked_sub(1).map(|p| seq.hashes[p]),
            tokens: seq.tokens[b * bs..(b + 1) * bs].into(),
            lora_name: None,
            group: None,
        }
    }

    /// The earliest simulated time a load finishes, if any request is loading.
    pub fn next_load_ready(&self) -> Option<f64> {
        self.waiting
            .iter()
            .filter_map(|s| s.load.as_ref().map(|l| l.ready_at))
            .min_by(f64::total_cmp)
    }

    /// Whether a step now could schedule anything.
    pub fn can_step(&self) -> bool {
        !self.running.is_empty()
            || self
                .waiting
                .iter()
                .any(|s| s.load.as_ref().is_none_or(|l| l.ready_at <= self.clock))
    }

    /// Registers blocks `registered..upto` of a request (they are computed or loaded); computed
    /// ones (`offload`) are queued for the write-through to the host tier.
    fn register_upto(&mut self, seq: &mut Seq, upto: usize, offload: bool) {
        if upto <= seq.registered {
            return;
        }
        let mut complete = Vec::with_capacity(upto - seq.registered);
        for b in seq.registered..upto {
            let identity = self.identity(seq, b);
            match std::mem::replace(&mut seq.blocks[b], GpuBlock::Taken) {
                GpuBlock::Filling(f) => {
                    if offload && (self.host.is_some() || self.shared.is_some()) {
                        self.offload.push(identity.clone());
                    }
                    complete.push(f.complete(identity));
                }
                _ => unreachable!("block {b} past the registered ones is not filling"),
            }
        }
        let registered = self
            .gpu
            .register_all(complete)
            .unwrap_or_else(|_| unreachable!("the blocks are this pool's"));
        for (i, r) in registered.into_iter().enumerate() {
            seq.blocks[seq.registered + i] = GpuBlock::Done(r);
        }
        seq.registered = upto;
    }

    fn lookup(&mut self, seq: &mut Seq) -> Lookup {
        let bs = self.cfg.block_size;
        let max_blocks = ((seq.tokens.len() - 1) / bs).min(seq.hashes.len());
        let hashes = &seq.hashes[..max_blocks];
        let mut blocks = Vec::new();
        for &h in hashes {
            match self.gpu.lookup(h) {
                Some(b) => blocks.push(GpuBlock::Done(b)),
                None => break,
            }
        }
        let g = blocks.len();
        let mut held = Vec::new();
        let mut from = [0usize; 2];
        for (i, pool) in [&self.host, &self.disk].into_iter().enumerate() {
            let Some(pool) = pool else { continue };
            for &h in &hashes[g + held.len()..] {
                match pool.lookup(h) {
                    Some(b) => {
                        held.push(b);
                        from[i] += 1;
                    }
                    None => break,
                }
            }
        }
        // Then the shared pool, past the worker's own tiers.
        let mut from_shared = 0;
        if let Some(shared) = &self.shared {
            for &h in &hashes[g + held.len()..] {
                match shared.pool.lookup(h) {
                    Some(b) => {
                        held.push(b);
                        from_shared += 1;
                    }
                    None => break,
                }
            }
        }
        if !seq.prefilled {
            // vLLM reports the first admission's hit (`num_cached_tokens` is set once).
            seq.cached = [g * bs, from[0] * bs, from[1] * bs, from_shared * bs];
        }
        seq.registered = g;
        seq.computed = g * bs;
        seq.looked_up = true;
        seq.blocks = blocks;
        if held.is_empty() {
            return Lookup::Ready;
        }
        let Ok(filling) = self.gpu.allocate(held.len()) else {
            seq.release();
            return Lookup::NoFit;
        };
        seq.blocks
            .extend(filling.into_iter().map(GpuBlock::Filling));
        let bytes = |n: usize| (n * bs) as f64 * self.cfg.cost.kv_bytes_per_token;
        let seconds = bytes(from[0]) / self.cfg.host_bytes_per_s
            + bytes(from[1]) / self.cfg.disk_bytes_per_s
            + bytes(from_shared) / self.cfg.shared_bytes_per_s;
        seq.load = Some(Load {
            ready_at: self.clock + seconds,
            first: g,
            count: held.len(),
            _held: held,
        });
        Lookup::Loading
    }

    fn finish_loads(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            let ready = self.waiting[i]
                .load
                .as_ref()
                .is_some_and(|l| l.ready_at <= self.clock);
            if ready {
                let mut seq = self.waiting.remove(i).expect("in range");
                let load = seq.load.take().expect("loading");
                // Loaded blocks are not offloaded again: they came from there.
                self.register_upto(&mut seq, load.first + load.count, false);
                seq.computed = seq.registered * self.cfg.block_size;
                self.waiting.insert(i, seq);
            }
            i += 1;
        }
    }

    fn reap_aborted(&mut self) {
        let before = self.running.len() + self.waiting.len();
        self.running.retain(|s| !s.out.is_closed());
        self.waiting.retain(|s| !s.out.is_closed());
        let gone = before - self.running.len() - self.waiting.len();
        if gone > 0 {
            self.metrics
                .requests
                .with_label_values(&["aborted"])
                .inc_by(gone as u64);
        }
    }

    fn preempt(&mut self, mut seq: Seq) {
        seq.release();
        self.metrics.preemptions.inc();
        self.waiting.push_front(seq);
    }

    /// Runs one step: schedules, advances the clock by the step's modelled duration, applies the
    /// outputs and publishes the step's KV events.
    pub fn step(&mut self) -> StepReport {
        self.finish_loads();
        self.reap_aborted();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut sched: Vec<usize> = Vec::new();
        let mut preempted = 0;

        // Running requests first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (computed, len, have) = {
                let s = &self.running[i];
                (s.computed, s.tokens.len(), s.blocks.len())
            };
            let n = (len - computed).min(budget);
            let need = self.blocks_for(computed + n).saturating_sub(have);
            let mut fits = true;
            loop {
                match self.gpu.allocate(need) {
                    Ok(blocks) => {
                        self.running[i]
                            .blocks
                            .extend(blocks.into_iter().map(GpuBlock::Filling));
                        break;
                    }
                    Err(_) => {
                        let victim = self.running.pop().expect("non-empty");
                        preempted += 1;
                        let is_self = self.running.len() == i;
                        self.preempt(victim);
                        if is_self {
                            fits = false;
                            break;
                        }
                    }
                }
            }
            if !fits {
                break;
            }
            sched.push(n);
            budget -= n;
            i += 1;
        }

        // Then waiting requests, unless this step preempted.
        if preempted == 0 {
            let mut k = 0;
            while k < self.waiting.len() && budget > 0 && self.running.len() < self.cfg.max_num_seqs
            {
                if self.waiting[k].load.is_some() {
                    k += 1;
                    continue;
                }
                let mut seq = self.waiting.remove(k).expect("in range");
                if !seq.looked_up {
                    match self.lookup(&mut seq) {
                        Lookup::Ready => {}
                        Lookup::Loading => {
                            self.waiting.insert(k, seq);
                            k += 1;
                            continue;
                        }
                        Lookup::NoFit => {
                            self.waiting.insert(k, seq);
                            break;
                        }
                    }
                }
                let n = (seq.tokens.len() - seq.computed).min(budget);
                let need = self
                    .blocks_for(seq.computed + n)
                    .saturating_sub(seq.blocks.len());
                match self.gpu.allocate(need) {
                    Ok(blocks) => {
                        seq.blocks.extend(blocks.into_iter().map(GpuBlock::Filling));
                        self.running.push(seq);
                        sched.push(n);
                        budget -= n;
                    }
                    Err(_) => {
                        seq.release();
                        self.waiting.insert(k, seq);
                        break;
                    }
                }
            }
        }

        let mut shape = StepShape::default();
        for (s, &n) in self.running.iter().zip(&sched) {
            if n == 1 && s.generated > 0 && s.computed + 1 == s.tokens.len() {
                shape.decode_seqs += 1;
                shape.decode_kv_tokens += s.tokens.len() as u64;
            } else {
                shape.prefill_tokens += n as u64;
                shape.prefill_attn_pairs += n as f64 * (s.computed as f64 + n as f64 / 2.0);
            }
        }
        self.metrics.prefill_tokens.inc_by(shape.prefill_tokens);
        let duration = if sched.is_empty() {
            0.0
        } else {
            self.cost_of(&shape)
        };
        self.clock += duration;
        if !sched.is_empty() {
            self.metrics.steps.inc();
        }

        // Apply the step's outputs.
        let bs = self.cfg.block_size;
        let mut running = std::mem::take(&mut self.running);
        let mut keep = vec![true; running.len()];
        for (idx, &n) in sched.iter().enumerate() {
            let mut seq = std::mem::replace(&mut running[idx], placeholder());
            seq.computed += n;
            let full = seq.computed / bs;
            self.register_upto(&mut seq, full, true);
            if seq.computed == seq.tokens.len() {
                if !seq.prefilled {
                    seq.prefilled = true;
                    let cached: usize = seq.cached.iter().sum();
                    let m = &self.metrics.prompt_tokens;
                    m.with_label_values(&["computed"])
                        .inc_by((seq.prompt_len - cached) as u64);
                    for (tier, t) in ["gpu", "host", "disk", "shared"].iter().zip(seq.cached) {
                        m.with_label_values(&[tier]).inc_by(t as u64);
                    }
                }
                seq.generated += 1;
                seq.tokens.push(seq.output_token);
                self.extend_hashes(&mut seq);
                self.metrics.generation_tokens.inc();
                let alive = if seq.stream {
                    seq.out.send(Output::Tokens(1)).is_ok()
                } else {
                    !seq.out.is_closed()
                };
                if !alive {
                    keep[idx] = false;
                    self.metrics.requests.with_label_values(&["aborted"]).inc();
                } else if seq.generated >= seq.max_tokens {
                    keep[idx] = false;
                    // Counted before the answer goes, so that a client that has its answer
                    // reads the count with it.
                    self.metrics.requests.with_label_values(&["finished"]).inc();
                    let _ = seq.out.send(Output::Finished(Usage {
                        prompt_tokens: seq.prompt_len as u32,
                        completion_tokens: seq.generated,
                        cached_tokens: seq.cached.iter().sum::<usize>() as u32,
                    }));
                }
            }
            running[idx] = seq;
        }
        let mut k = 0;
        running.retain(|_| {
            k += 1;
            keep[k - 1]
        });
        self.running = running;

        self.write_through();
        self.pump_events();
        self.update_gauges();
        StepReport {
            shape,
            duration,
            scheduled: sched,
            preempted,
        }
    }

    /// The modelled duration of a step of this shape.
    pub fn cost_of(&self, shape: &StepShape) -> f64 {
        self.cfg.cost.step_seconds(shape)
    }

    fn write_through(&mut self) {
        if let Some(shared) = &self.shared {
            // What reaches the host tier is written to the shared pool too (kvbm's shared writes).
            let mut todo: Vec<BlockIdentity> = self
                .offload
                .iter()
                .filter(|id| !shared.pool.contains(id.sequence_hash))
                .cloned()
                .collect();
            todo.dedup_by_key(|id| id.sequence_hash);
            let filling = shared.pool.allocate_up_to(todo.len());
            let complete: Vec<_> = filling
                .into_iter()
                .zip(todo)
                .map(|(f, id)| f.complete(id))
                .collect();
            // Dropped at once: idle, evictable (the server's LRU), findable by every worker.
            let _ = shared.pool.register_all(complete);
            self.pump_shared();
        }
        let Some(host) = &self.host else {
            self.offload.clear();
            return;
        };
        let mut todo: Vec<BlockIdentity> = std::mem::take(&mut self.offload);
        todo.retain(|id| !host.contains(id.sequence_hash));
        todo.dedup_by_key(|id| id.sequence_hash);
        if todo.is_empty() {
            return;
        }
        let filling = host.allocate_up_to(todo.len());
        let n = filling.len();
        let complete: Vec<_> = filling
            .into_iter()
            .zip(&todo)
            .map(|(f, id)| f.complete(id.clone()))
            .collect();
        // Dropped at once: idle, evictable, findable.
        let _ = host.register_all(complete);
        for id in todo.into_iter().take(n) {
            self.host_identities.insert(id.sequence_hash, id);
        }
        self.pump_events();
    }

    /// Moves the shared pool's events out as the shared tier's (stores and evictions).
    fn pump_shared(&mut self) {
        let Some(shared) = &self.shared else {
            return;
        };
        let batch = match shared.events.lock() {
            Ok(mut events) => events.drain(),
            Err(_) => return,
        };
        for d in batch {
            let event = match &d.record.event {
                KvEvent::BlockStored(stored) => KvEvent::SharedStored {
                    pool: shared.name.clone(),
                    stored: stored.clone(),
                },
                KvEvent::BlockRemoved(removed) => KvEvent::SharedRemoved {
                    pool: shared.name.clone(),
                    removed: removed.clone(),
                },
                _ => continue,
            };
            self.out_bus.publish(event);
        }
    }

    /// Moves the internal events out (GPU hashes rewritten), spilling host evictions to disk.
    fn pump_events(&mut self) {
        loop {
            let batch = self.internal.drain();
            if batch.is_empty() {
                return;
            }
            let mut spill = Vec::new();
            for d in batch {
                let event = &d.record.event;
                if let KvEvent::BlockRemoved(r) = event {
                    if r.tier == Tier::Host {
                        for h in &r.block_hashes {
                            if let Some(id) = self.host_identities.remove(h) {
                                spill.push(id);
                            }
                        }
                    }
                }
                self.out_bus.publish(rewrite(event));
            }
            if let Some(disk) = &self.disk {
                spill.retain(|id| !disk.contains(id.sequence_hash));
                if !spill.is_empty() {
                    let filling = disk.allocate_up_to(spill.len());
                    let complete: Vec<_> = filling
                        .into_iter()
                        .zip(spill)
                        .map(|(f, id)| f.complete(id))
                        .collect();
                    let _ = disk.register_all(complete);
                }
            }
        }
    }

    fn update_gauges(&self) {
        let m = &self.metrics;
        m.sim_seconds.set(self.clock);
        m.running.set(self.running.len() as i64);
        m.waiting.set(self.waiting.len() as i64);
        m.loading
            .set(self.waiting.iter().filter(|s| s.load.is_some()).count() as i64);
        for pool in [Some(&self.gpu), self.host.as_ref(), self.disk.as_ref()]
            .into_iter()
            .flatten()
        {
            let c = pool.counts();
            let tier = pool.tier().to_string();
            m.blocks_active
                .with_label_values(&[tier.as_str()])
                .set((c.capacity - c.free - c.idle) as i64);
            m.blocks_resident
                .with_label_values(&[tier.as_str()])
                .set(c.registered as i64);
        }
    }
}

fn placeholder() -> Seq {
    let (out, _) = tokio::sync::mpsc::unbounded_channel(); // bounded: never sent to (a placeholder)
    Seq::new(Request {
        prompt: Vec::new(),
        max_tokens: 0,
        output_token: 0,
        stream: false,
        out,
    })
}

/// A GPU event with kvbm's hashes replaced by the engine's; other tiers' events unchanged.
pub fn rewrite(event: &KvEvent) -> KvEvent {
    match event {
        KvEvent::BlockStored(s) if s.tier == Tier::Gpu => KvEvent::BlockStored(BlockStored {
            block_hashes: s.block_hashes.iter().map(|&h| engine_hash(h)).collect(),
            parent_hash: s.parent_hash.map(engine_hash),
            ..s.clone()
        }),
        KvEvent::BlockRemoved(r) if r.tier == Tier::Gpu => KvEvent::BlockRemoved(BlockRemoved {
            tier: r.tier,
            block_hashes: r.block_hashes.iter().map(|&h| engine_hash(h)).collect(),
        }),
        other => other.clone(),
    }
}

/// Drives `engine` against wall time until `requests` is closed and the engine is idle: a step
/// of simulated duration `d` ends `d / speedup` wall seconds after it began (the simulated
/// clock maps to wall time from `start`); a worker that falls behind runs on without sleeping
/// and the lag is reported in its metrics.
pub fn run_worker(
    mut engine: Engine,
    requests: crossbeam_channel::Receiver<Request>,
    start: Instant,
) {
    let metrics = engine.metrics.clone();
    let speedup = engine.cfg.speedup;
    let now_sim = || start.elapsed().as_secs_f64() * speedup;
    let wall_of = |t: f64| start + Duration::from_secs_f64(t.max(0.0) / speedup);
    loop {
        if engine.is_idle() {
            match requests.recv() {
                Ok(r) => {
                    engine.clock = engine.clock.max(now_sim());
                    engine.add(r);
                }
                Err(_) => return,
            }
        }
        while let Ok(r) = requests.try_recv() {
            engine.add(r);
        }
        if engine.can_step() {
            let report = engine.step();
            if !report.scheduled.is_empty() {
                let deadline = wall_of(engine.clock);
                let now = Instant::now();
                if deadline > now {
                    std::thread::sleep(deadline - now);
                    metrics.lag_seconds.set(0.0);
                } else {
                    let lag = now_sim() - engine.clock;
                    metrics.late_steps.inc();
                    metrics.lag_seconds.set(lag);
                    if lag > metrics.lag_max_seconds.get() {
                        metrics.lag_max_seconds.set(lag);
                    }
                }
                continue;
            }
        }
        // Nothing ran (only loads in flight, or nothing admissible until one ends): wait for
        // the next load or arrival.
        let until = engine
            .next_load_ready()
            .map(wall_of)
            .unwrap_or_else(|| Instant::now() + Duration::from_millis(5));
        match requests.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(r) => {
                engine.clock = engine.clock.max(now_sim());
                engine.add(r);
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if let Some(t) = engine.next_load_ready() {
                    engine.clock = engine.clock.max(t);
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                match engine.next_load_ready() {
                    Some(t) => {
                        std::thread::sleep(wall_of(t).saturating_duration_since(Instant::now()));
                        engine.clock = engine.clock.max(t);
                    }
                    None => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }
        // Requests whose client left while nothing could step.
        engine.reap_aborted();
        engine.update_gauges();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StepCost;
    use kvbm_events::EventSubscriber;
    use tokio::sync::mpsc::UnboundedReceiver;

    const COST: StepCost = StepCost {
        overhead: 0.01,
        t_prefill: 1e-4,
        t_decode_seq: 1e-3,
        t_attn_decode: 1e-6,
        t_attn_prefill: 1e-8,
        kv_bytes_per_token: 1000.0,
    };

    fn config(
        block_size: usize,
        gpu: usize,
        host: usize,
        disk: usize,
        budget: usize,
    ) -> EngineConfig {
        EngineConfig {
            preset: "test".into(),
            block_size,
            gpu_blocks: gpu,
            host_blocks: host,
            disk_blocks: disk,
            shared_blocks: 0,
            shared_pool: "pool".into(),
            max_num_batched_tokens: budget,
            max_num_seqs: 256,
            speedup: 1.0,
            host_bytes_per_s: 1e6,
            disk_bytes_per_s: 1e5,
            shared_bytes_per_s: 1e4,
            cost: COST,
        }
    }

    fn engine(cfg: EngineConfig) -> (Engine, EventSubscriber, Arc<WorkerMetrics>) {
        let bus = EventPublisher::new();
        let sub = bus.subscribe(1 << 16);
        let m = Arc::new(WorkerMetrics::new());
        (Engine::new(cfg, bus, m.clone()), sub, m)
    }

    fn request(prompt: Vec<u32>, max_tokens: u32) -> (Request, UnboundedReceiver<Output>) {
        let (out, rx) = tokio::sync::mpsc::unbounded_channel(); // bounded: a test's one request
        let req = Request {
            prompt,
            max_tokens,
            output_token: 1,
            stream: true,
            out,
        };
        (req, rx)
    }

    fn prompt(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| seed * 100_000 + i + 2).collect()
    }

    /// Steps until `rx` hears its request finish; returns its usage.
    fn run_to_end(e: &mut Engine, rx: &mut UnboundedReceiver<Output>) -> Usage {
        for _ in 0..10_000 {
            while let Ok(o) = rx.try_recv() {
                match o {
                    Output::Finished(u) => return u,
                    Output::Rejected(m) => panic!("rejected: {m}"),
                    Output::Tokens(_) => {}
                }
            }
            if !e.can_step() {
                e.clock = e.next_load_ready().expect("something to wait for");
            }
            e.step();
        }
        panic!("the request never finished");
    }

    fn events(sub: &mut EventSubscriber) -> Vec<KvEvent> {
        sub.drain()
            .into_iter()
            .map(|d| d.record.event.clone())
            .collect()
    }

    /// vLLM's `Scheduler.schedule`: running requests (decodes) take the budget first, prefills
    /// are chunked into what is left; the step time follows the stated formula.
    #[test]
    fn budget_chunked_prefill_and_decode_first() {
        let (mut e, _sub, _) = engine(config(4, 1000, 0, 0, 100));
        let (a, _ra) = request(prompt(1, 250), 3);
        e.add(a);
        let r1 = e.step();
        assert_eq!(r1.scheduled, vec![100]);
        assert_eq!(r1.shape.prefill_attn_pairs, 100.0 * 50.0);
        let r2 = e.step();
        assert_eq!(r2.scheduled, vec![100]);
        assert_eq!(r2.shape.prefill_attn_pairs, 100.0 * (100.0 + 50.0));
        let r3 = e.step();
        assert_eq!(r3.scheduled, vec![50], "the long prompt's last chunk");
        let (b, _rb) = request(prompt(2, 120), 2);
        e.add(b);
        let before = e.clock;
        let r4 = e.step();
        assert_eq!(
            r4.scheduled,
            vec![1, 99],
            "decode first, then a 99-token chunk"
        );
        assert_eq!(r4.shape.decode_seqs, 1);
        assert_eq!(r4.shape.decode_kv_tokens, 251);
        assert_eq!(r4.shape.prefill_tokens, 99);
        let expected = 0.01 + 99.0 * 1e-4 + 1e-3 + 251.0 * 1e-6 + 99.0 * 49.5 * 1e-8;
        assert!(
            (r4.duration - expected).abs() < 1e-12,
            "{} vs {expected}",
            r4.duration
        );
        assert!((e.clock - before - expected).abs() < 1e-12);
        for r in [&r1, &r2, &r3, &r4] {
            assert!(r.scheduled.iter().sum::<usize>() <= 100, "budget respected");
        }
    }

    /// vLLM's prefix caching: a repeated prompt computes only what is past its full cached
    /// blocks (at most len - 1 tokens come from cache); LRU eviction publishes BlockRemoved with
    /// the engine's hashes and a later request misses.
    #[test]
    fn prefix_hit_then_lru_eviction_misses() {
        let (mut e, mut sub, m) = engine(config(4, 8, 0, 0, 1000));
        let p = prompt(1, 13);
        let (a, mut ra) = request(p.clone(), 1);
        e.add(a);
        assert_eq!(run_to_end(&mut e, &mut ra).cached_tokens, 0);
        let stored = events(&mut sub);
        let hasher = BlockHasher::new(4, None, None);
        let kvbm = hasher.sequence_hashes(None, &p);
        let KvEvent::BlockStored(s) = &stored[0] else {
            panic!("a store first: {stored:?}")
        };
        assert_eq!(s.tier, Tier::Gpu);
        assert_eq!(s.token_ids, p[..12].to_vec());
        let engine_hashes: Vec<_> = kvbm.iter().map(|&h| engine_hash(h)).collect();
        assert_eq!(s.block_hashes, engine_hashes);
        assert!(s.block_hashes.iter().all(|h| !kvbm.contains(h)));

        let (b, mut rb) = request(p.clone(), 1);
        e.add(b);
        let r = e.step();
        assert_eq!(
            r.scheduled,
            vec![1],
            "only the partial block's last token is computed"
        );
        assert_eq!(run_to_end(&mut e, &mut rb).cached_tokens, 12);
        assert_eq!(
            m.prompt_tokens.with_label_values(&["gpu"]).get(),
            12,
            "cached prompt tokens counted by source"
        );

        // 8 blocks' worth of another prompt evicts everything idle.
        let (c, mut rc) = request(prompt(2, 29), 1);
        e.add(c);
        run_to_end(&mut e, &mut rc);
        let removed: Vec<_> = events(&mut sub)
            .into_iter()
            .filter_map(|ev| match ev {
                KvEvent::BlockRemoved(r) => Some(r),
                _ => None,
            })
            .flat_map(|r| r.block_hashes)
            .collect();
        assert!(removed.contains(&engine_hash(kvbm[0])), "{removed:?}");
        let (d, mut rd) = request(p, 1);
        e.add(d);
        assert_eq!(run_to_end(&mut e, &mut rd).cached_tokens, 0);
    }

    /// Runs prompt `p` (3 blocks of 4), then a 29-token prompt that fills the 8-block GPU, then
    /// `p` again; returns the engine, its events, its metrics, the clock when `p`'s load began and
    /// when it is ready, and `p`'s second usage.
    fn evict_then_reload(
        host: usize,
        disk: usize,
    ) -> (Vec<KvEvent>, Arc<WorkerMetrics>, f64, f64, Usage) {
        let (mut e, mut sub, m) = engine(config(4, 8, host, disk, 1000));
        let p = prompt(1, 13);
        let (a, mut ra) = request(p.clone(), 1);
        e.add(a);
        run_to_end(&mut e, &mut ra);
        let (c, mut rc) = request(prompt(2, 29), 1);
        e.add(c);
        run_to_end(&mut e, &mut rc);
        let (d, mut rd) = request(p, 1);
        e.add(d);
        let start = e.clock;
        let r = e.step();
        assert!(r.scheduled.is_empty(), "loading, not scheduled");
        assert!(!e.can_step());
        let ready = e.next_load_ready().expect("a load");
        let usage = run_to_end(&mut e, &mut rd);
        (events(&mut sub), m, start, ready, usage)
    }

    /// Two workers reach one shared pool: what the first computed (and wrote through, with no
    /// host tier of its own) the second finds there past its empty GPU, loads at the shared
    /// bandwidth, and counts as `shared`; the first announces the pool's blocks as the shared
    /// tier's events, named by the pool.
    #[test]
    fn a_prefix_one_worker_computed_is_loaded_from_the_shared_pool_by_another() {
        let shared = Arc::new(SharedPool::new("pool", 16, 4));
        let (a, mut sub_a, _) = engine(config(4, 8, 0, 0, 1000));
        let mut a = a.with_shared(Some(shared.clone()));
        let (b, _, mb) = engine(config(4, 8, 0, 0, 1000));
        let mut b = b.with_shared(Some(shared.clone()));
        let p = prompt(1, 13);
        let (ra, mut rxa) = request(p.clone(), 1);
        a.add(ra);
        run_to_end(&mut a, &mut rxa);
        assert_eq!(shared.pool().counts().registered, 3);
        let pool_events: Vec<KvEvent> = events(&mut sub_a)
            .into_iter()
            .filter(|e| matches!(e, KvEvent::SharedStored { .. }))
            .collect();
        let stored: usize = pool_events
            .iter()
            .map(|e| match e {
                KvEvent::SharedStored { pool, stored } => {
                    assert_eq!(pool, "pool");
                    stored.block_hashes.len()
                }
                _ => 0,
            })
            .sum();
        assert_eq!(stored, 3);
        let (rb, mut rxb) = request(p, 1);
        b.add(rb);
        let start = b.clock;
        assert!(b.step().scheduled.is_empty(), "loading, not scheduled");
        let ready = b.next_load_ready().expect("a load");
        // 3 blocks of 4 tokens at the preset's KV bytes per token, at 1e4 bytes/s.
        let want = 12.0 * COST.kv_bytes_per_token / 1e4;
        assert!(
            (ready - start - want).abs() < 1e-9,
            "{} vs {want}",
            ready - start
        );
        assert_eq!(run_to_end(&mut b, &mut rxb).cached_tokens, 12);
        assert_eq!(mb.prompt_tokens.with_label_values(&["shared"]).get(), 12);
    }

    fn stored_tiers(events: &[KvEvent]) -> std::collections::BTreeSet<Tier> {
        events
            .iter()
            .filter_map(|ev| match ev {
                KvEvent::BlockStored(s) => Some(s.tier),
                _ => None,
            })
            .collect()
    }

    /// kvbm's connector: full GPU blocks are written through to host; a prefix evicted from the
    /// GPU is found on the host and loaded at the host bandwidth (the simulated clock moves by
    /// bytes / bandwidth), and the loaded blocks are announced on the GPU again.
    #[test]
    fn host_tier_hit_loads_at_host_bandwidth() {
        let (events, m, start, ready, usage) = evict_then_reload(16, 0);
        let expected = 12.0 * 1000.0 / 1e6; // 3 blocks of 4 tokens x 1000 B at 1e6 B/s
        assert!((ready - start - expected).abs() < 1e-12, "{ready} {start}");
        assert_eq!(usage.cached_tokens, 12);
        assert_eq!(m.prompt_tokens.with_label_values(&["host"]).get(), 12);
        assert_eq!(
            m.prompt_tokens.with_label_values(&["computed"]).get(),
            13 + 29 + 1
        );
        assert_eq!(stored_tiers(&events), [Tier::Gpu, Tier::Host].into());
        // Host events keep kvbm's hashes (kvbm's connector publishes them so).
        let kvbm = BlockHasher::new(4, None, None).sequence_hashes(None, &prompt(1, 13));
        let host_stored: Vec<_> = events
            .iter()
            .filter_map(|ev| match ev {
                KvEvent::BlockStored(s) if s.tier == Tier::Host => Some(s.block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(kvbm.iter().all(|h| host_stored.contains(h)));
    }

    /// Host evictions spill to disk; a prefix found only there loads at the disk bandwidth.
    #[test]
    fn host_evictions_spill_to_disk_and_load_from_there() {
        let (events, m, start, ready, usage) = evict_then_reload(4, 64);
        let expected = 12.0 * 1000.0 / 1e5;
        assert!((ready - start - expected).abs() < 1e-12, "{ready} {start}");
        assert_eq!(usage.cached_tokens, 12);
        assert_eq!(m.prompt_tokens.with_label_values(&["disk"]).get(), 12);
        assert_eq!(
            stored_tiers(&events),
            [Tier::Gpu, Tier::Host, Tier::Disk].into()
        );
    }

    /// vLLM preempts the newest running request when a decode cannot get a block; it is
    /// recomputed on resume and still finishes with every token.
    #[test]
    fn preemption_recomputes_and_finishes() {
        let (mut e, _sub, m) = engine(config(4, 6, 0, 0, 1000));
        let (a, mut ra) = request(prompt(1, 8), 8);
        let (b, mut rb) = request(prompt(2, 8), 8);
        e.add(a);
        e.add(b);
        let ua = run_to_end(&mut e, &mut ra);
        let ub = run_to_end(&mut e, &mut rb);
        assert_eq!((ua.completion_tokens, ub.completion_tokens), (8, 8));
        assert!(m.preemptions.get() >= 1);
        // Each prompt counts once as computed; the prefill counter also counts what the
        // preempted request computed again on resuming.
        let computed = m.prompt_tokens.with_label_values(&["computed"]).get();
        assert_eq!(computed, 16);
        assert!(
            m.prefill_tokens.get() > computed,
            "{}",
            m.prefill_tokens.get()
        );
        let c = e.gpu().counts();
        assert_eq!(c.capacity - c.free - c.idle, 0, "every block released");
    }

    /// vLLM's `--max-num-seqs`: no more requests run at once; the rest wait their turn (FCFS).
    #[test]
    fn max_num_seqs_bounds_the_batch() {
        let mut cfg = config(4, 1000, 0, 0, 1000);
        cfg.max_num_seqs = 2;
        let (mut e, _sub, _) = engine(cfg);
        let mut rxs = Vec::new();
        for k in 0..3 {
            let (r, rx) = request(prompt(k, 8), 2);
            e.add(r);
            rxs.push(rx);
        }
        assert_eq!(e.step().scheduled, vec![8, 8]);
        assert_eq!(e.queue_lengths(), (2, 1));
        assert_eq!(
            e.step().scheduled,
            vec![1, 1],
            "two decodes; the third still waits"
        );
        assert_eq!(
            e.step().scheduled,
            vec![8],
            "admitted once the first two finished"
        );
    }

    /// A request larger than the GPU pool is refused, never queued forever.
    #[test]
    fn too_large_is_rejected() {
        let (mut e, _sub, _) = engine(config(4, 2, 0, 0, 1000));
        let (a, mut ra) = request(prompt(1, 9), 1);
        e.add(a);
        assert!(matches!(ra.try_recv(), Ok(Output::Rejected(_))));
        assert!(e.is_idle());
    }
}
