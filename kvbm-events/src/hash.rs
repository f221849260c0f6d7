//! Block identity: `BlockHash` (one block's tokens) and `SequenceHash` (a block with its prefix).
//!
//! Exactly DESIGN.md's "Block identity", which is Dynamo's KV-router hash:
//! - bytes of a block = its token ids as u32 little-endian, concatenated;
//! - `block_hash = XXH3_64(bytes, seed)` with seed 1337, plus `XXH3_64(lora_name, 0)` with a LoRA
//!   adapter, plus `XXH3_64(namespace, 1)` with a cache namespace (wrapping adds, empty = absent);
//! - `sequence_hash[0] = block_hash[0]`,
//!   `sequence_hash[i] = XXH3_64(sequence_hash[i-1] LE || block_hash[i] LE, 1337)`.
//!
//! The sequence-hash chain always uses seed 1337: LoRA and namespace enter through the block hashes.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every block hash without LoRA or namespace, and of the sequence-hash chain.
pub const BLOCK_HASH_SEED: u64 = 1337;
/// Seed used to hash a LoRA adapter's name into the block-hash seed.
pub const LORA_NAME_SEED: u64 = 0;
/// Seed used to hash a cache namespace (salt) into the block-hash seed.
pub const NAMESPACE_SEED: u64 = 1;

/// Hash of one full block's token ids (Dynamo's "local block hash").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// Identifies a block together with its whole prefix; the key of the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

impl SequenceHash {
    /// Chains `block` onto `parent`: the sequence hash of a block whose prefix ends in `parent`.
    /// With no parent, a block's sequence hash is its block hash.
    #[inline]
    pub fn chain(parent: Option<SequenceHash>, block: BlockHash) -> SequenceHash {
        match parent {
            None => SequenceHash(block.0),
            Some(parent) => {
                let mut bytes = [0u8; 16];
                bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
                bytes[8..].copy_from_slice(&block.0.to_le_bytes());
                SequenceHash(xxh3_64_with_seed(&bytes, BLOCK_HASH_SEED))
            }
        }
    }
}

/// Computes block and sequence hashes for one block size and one (LoRA, namespace) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    block_size_tokens: usize,
    seed: u64,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size_tokens` tokens (must be at least 1), with optional
    /// LoRA adapter name and cache namespace (empty strings count as absent).
    pub fn new(block_size_tokens: usize, lora_name: Option<&str>, namespace: Option<&str>) -> Self {
        Self::with_namespace_term(block_size_tokens, lora_name, namespace_term(namespace))
    }

    /// As [`Self::new`], with the namespace given by its term ([`namespace_term`]): what a
    /// block inherits from the first block of its prompt, where the salt was given.
    pub fn with_namespace_term(
        block_size_tokens: usize,
        lora_name: Option<&str>,
        namespace_term: u64,
    ) -> Self {
        assert!(
            block_size_tokens > 0,
            "block size must be at least one token"
        );
        let mut seed = BLOCK_HASH_SEED.wrapping_add(namespace_term);
        if let Some(name) = lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(name.as_bytes(), LORA_NAME_SEED));
        }
        Self {
            block_size_tokens,
            seed,
        }
    }

    /// Tokens per block.
    pub fn block_size_tokens(&self) -> usize {
        self.block_size_tokens
    }

    /// The seed of this hasher's block hashes (1337 plus the LoRA and namespace terms).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Hash of one block's tokens. The caller passes exactly one full block.
    #[inline]
    pub fn block_hash(&self, block_tokens: &[u32]) -> BlockHash {
        debug_assert_eq!(block_tokens.len(), self.block_size_tokens);
        BlockHash(hash_u32_le(block_tokens, self.seed))
    }

    /// Block hashes of every full block of `tokens`; a partial tail is ignored.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        tokens
            .chunks_exact(self.block_size_tokens)
            .map(|block| self.block_hash(block))
            .collect()
    }

    /// Sequence hashes of every full block of `tokens`, continuing from `parent` (the sequence
    /// hash of the block before `tokens[0]`, if any); a partial tail is ignored.
    pub fn sequence_hashes(
        &self,
        parent: Option<SequenceHash>,
        tokens: &[u32],
    ) -> Vec<SequenceHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size_tokens);
        let mut last = parent;
        for block in tokens.chunks_exact(self.block_size_tokens) {
            let seq = SequenceHash::chain(last, self.block_hash(block));
            out.push(seq);
            last = Some(seq);
        }
        out
    }
}

/// The term a cache namespace (salt) adds to the block-hash seed: `XXH3_64(namespace, 1)`, or 0
/// without one (an empty string counts as none).
pub fn namespace_term(namespace: Option<&str>) -> u64 {
    namespace
        .filter(|s| !s.is_empty())
        .map_or(0, |ns| xxh3_64_with_seed(ns.as_bytes(), NAMESPACE_SEED))
}

#[cfg(target_endian = "little")]
#[inline]
fn hash_u32_le(tokens: &[u32], seed: u64) -> u64 {
    // On little-endian targets the in-memory bytes already are the wire bytes.
    xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
}

#[cfg(target_endian = "big")]
#[inline]
fn hash_u32_le(tokens: &[u32], seed: u64) -> u64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, seed)
}

/// A `Hasher` for maps keyed by block or sequence hashes: the key already is a uniformly
/// distributed 64-bit hash, so it is used as is (other input is folded byte by byte).
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughHasher(u64);

impl std::hash::Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// Builds [`PassThroughHasher`]s: `HashMap<SequenceHash, V, PassThroughBuildHasher>`.
pub type PassThroughBuildHasher = std::hash::BuildHasherDefault<PassThroughHasher>;
