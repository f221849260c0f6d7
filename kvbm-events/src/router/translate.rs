//! Engine hashes to block identity: per worker, the map from the hashes an engine publishes
//! (vLLM's prefix-cache hashes, SGLang's, another kvbm's) to the sequence hashes the router
//! computes from each stored block's tokens (DESIGN.md, "Block identity").
//!
//! Invariants:
//! - A block's identity comes from its tokens, its event's block size and LoRA name, the cache
//!   salt of its prompt's first block, and its parent's identity; never from the engine's hash.
//! - One entry per engine hash, shared by every tier (an engine's host-tier events reuse its GPU
//!   hashes), counting the stores not yet matched by a removal; it goes when the count does.
//! - What cannot be resolved is refused and counted, never guessed: a parent the map does not
//!   hold, a block size other than the router's (pages that divide the router's block are regrouped
//!   by `router::regroup` instead), tokens that are not whole blocks, keys the
//!   router cannot hash (multimodal inputs, prompt embeddings), an engine hash that already names
//!   another identity. Blocks before the refused one are applied.
//! - The map's hasher is seeded at random per map (foldhash's quality hasher), so a worker cannot
//!   pile its hashes into one probe chain.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use foldhash::quality::RandomState;

use crate::hash::{namespace_term, BlockHasher, SequenceHash};
use crate::router::mapped::prefetch;

/// How many blocks ahead of the one being hashed an event's tokens are prefetched. The tokens of a
/// batch are read once, from memory: without the hint, hashing a block waited for its bytes
/// (measured: 27 ns a 16-token block from a cold buffer, 8 ns with it, 5 ns from cache).
const TOKEN_PREFETCH_BLOCKS: usize = 24;

/// Starts loading the cache lines of `tokens`.
#[inline]
fn prefetch_tokens(tokens: &[u32]) {
    // 16 tokens to a 64-byte line; the last token covers a line the block only starts in.
    for t in tokens.iter().step_by(16).chain(tokens.last()) {
        prefetch(t);
    }
}

/// What an engine hash stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Name {
    /// The block's sequence hash (the index's key).
    pub ours: u64,
    /// The namespace term of its prompt (inherited by the blocks after it).
    pub namespace: u64,
    /// Stores (all tiers) not matched by a removal yet.
    pub refs: u32,
}

/// Why a stored event was (partly) refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The event's block size is not the router's.
    BlockSizeMismatch,
    /// The parent's engine hash is not in the map.
    ParentUnknown,
    /// The tokens are not the event's blocks.
    Malformed,
    /// A block's engine hash covers keys the router cannot hash.
    Unhashable,
    /// An engine hash already names another identity.
    HashConflict,
    /// The worker's map is full.
    WorkerFull,
}

/// One worker's engine hashes.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    map: HashMap<u64, Name, RandomState>,
}

/// A stored event's blocks, as the translation sees them.
pub(crate) struct StoredBlocks<'a> {
    pub engine_hashes: &'a [u64],
    pub parent: Option<u64>,
    pub token_ids: &'a [u32],
    pub block_size: u32,
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    pub unhashable_from: Option<usize>,
}

impl Names {
    pub fn new() -> Self {
        Self {
            map: HashMap::with_hasher(RandomState::default()),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn clear(&mut self) {
        self.map.clear();
        self.map.shrink_to(0);
    }

    /// Every entry (for dumps).
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Name)> {
        self.map.iter().map(|(&k, v)| (k, v))
    }

    /// Puts back an entry read from a dump.
    pub fn restore(&mut self, engine: u64, name: Name) {
        self.map.insert(engine, name);
    }

    /// Takes a stored event's blocks in: computes their identities and counts them under their
    /// engine hashes. Writes the identities of the blocks taken into `out` (a prefix of the
    /// event's blocks) and says why the rest was refused, if it was.
    pub fn store(
        &mut self,
        blocks: &StoredBlocks<'_>,
        router_block_size: u32,
        names_max: usize,
        out: &mut Vec<u64>,
    ) -> Option<Refusal> {
        out.clear();
        if blocks.block_size != router_block_size {
            return Some(Refusal::BlockSizeMismatch);
        }
        let bs = blocks.block_size as usize;
        let n = blocks.engine_hashes.len();
        if bs == 0 || blocks.token_ids.len() != n * bs {
            return Some(Refusal::Malformed);
        }
        let (parent, namespace) = match blocks.parent {
            None => (None, namespace_term(blocks.cache_salt)),
            Some(p) => match self.map.get(&p) {
                Some(name) => (Some(SequenceHash(name.ours)), name.namespace),
                None => return Some(Refusal::ParentUnknown),
            },
        };
        let mut refusal = None;
        let mut hashable = n;
        if let Some(first) = blocks.unhashable_from.filter(|&f| f < n) {
            hashable = first;
            refusal = Some(Refusal::Unhashable);
        }
        if hashable == 0 {
            return refusal;
        }
        let hasher = BlockHasher::with_namespace_term(bs, blocks.lora_name, namespace);
        let token_ids = &blocks.token_ids[..hashable * bs];
        prefetch_tokens(&token_ids[..token_ids.len().min(TOKEN_PREFETCH_BLOCKS * bs)]);
        let mut last = parent;
        for (i, tokens) in token_ids.chunks_exact(bs).enumerate() {
            let ahead = (i + TOKEN_PREFETCH_BLOCKS) * bs;
            if let Some(ahead) = token_ids.get(ahead..ahead + bs) {
                prefetch_tokens(ahead);
            }
            let ours = SequenceHash::chain(last, hasher.block_hash(tokens));
            last = Some(ours);
            let engine = blocks.engine_hashes[i];
            let full = self.map.len() >= names_max;
            match self.map.entry(engine) {
                Entry::Occupied(mut o) => {
                    let name = o.get_mut();
                    if name.ours != ours.0 {
                        return Some(Refusal::HashConflict);
                    }
                    name.refs = name.refs.saturating_add(1);
                }
                Entry::Vacant(_) if full => return Some(Refusal::WorkerFull),
                Entry::Vacant(v) => {
                    v.insert(Name {
                        ours: ours.0,
                        namespace,
                        refs: 1,
                    });
                }
            }
            out.push(ours.0);
        }
        refusal
    }

    /// The identity an engine hash stands for, if the map holds it.
    pub fn ours_of(&self, engine: u64) -> Option<u64> {
        self.map.get(&engine).map(|n| n.ours)
    }

    /// Counts `n` more references to a known engine hash (stores of another KV cache group that
    /// named it without its tokens); its identity, or `None` when the map does not hold it.
    pub fn retain(&mut self, engine: u64, n: u32) -> Option<u64> {
        let name = self.map.get_mut(&engine)?;
        name.refs = name.refs.saturating_add(n);
        Some(name.ours)
    }

    /// Takes a removal in: the identities of the engine hashes it knows (one reference each),
    /// written into `out`; returns how many it did not know.
    pub fn remove(&mut self, engine_hashes: &[u64], out: &mut Vec<u64>) -> usize {
        out.clear();
        let mut unknown = 0;
        for &engine in engine_hashes {
            match self.map.entry(engine) {
                Entry::Occupied(mut o) => {
                    out.push(o.get().ours);
                    o.get_mut().refs -= 1;
                    if o.get().refs == 0 {
                        o.remove();
                    }
                }
                Entry::Vacant(_) => unknown += 1,
            }
        }
        unknown
    }
}
