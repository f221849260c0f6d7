//! Pages smaller than the router's blocks, regrouped into its blocks: SGLang's default page size
//! is 1 token, and a vLLM may run a smaller block size than the router.
//!
//! What such a stream carries (SGLang, python/sglang/srt/mem_cache/radix_cache.py,
//! `RadixCache._record_store_event` / `_record_remove_event`): one `BlockStored` per page, its
//! `block_hashes` the page's hash chained over the whole prefix, `parent_block_hash` the page
//! before it (the parent node's last page for a node's first page, none under the root),
//! `token_ids` the page's tokens, `block_size` the page's length; one `BlockRemoved` per page when
//! a leaf node is evicted. A leaf goes before its parent, so a prefix loses pages from its tail.
//!
//! Invariants:
//! - Each engine hash names one page: its tokens, the page before it, how many pages of its
//!   router block end with it, and the identity of the router block before that block. A page
//!   that completes a router block also names that block's identity, computed as for any block
//!   (tokens, LoRA name, the prompt's salt, the parent block's identity).
//! - The claim of a router block is made when its last page is stored and taken back when that
//!   page is removed; pages that do not complete a block make no claim.
//! - Refused and counted, never guessed: a parent page the map does not hold, a page size that
//!   does not divide the router's block, tokens that are not the event's pages, keys the router
//!   cannot hash. Pages before the refused one are kept.
//! - At most `pages_max` pages per worker.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use foldhash::quality::RandomState;

use crate::hash::{namespace_term, BlockHasher, SequenceHash};
use crate::router::index::PageEntry;
use crate::router::translate::{Refusal, StoredBlocks};

#[derive(Debug, Clone)]
struct Page {
    /// The engine hash of the page before this one, if any.
    parent: Option<u64>,
    tokens: Box<[u32]>,
    /// Pages of this page's router block up to and including this one (1 ..= pages a block).
    index: u32,
    /// The identity of the router block before this page's block.
    prev_block: Option<u64>,
    /// The identity of the router block this page completes, when it does.
    block: Option<u64>,
    /// The namespace term of its prompt.
    namespace: u64,
    /// Stores not matched by a removal yet.
    refs: u32,
}

/// One worker's pages.
#[derive(Debug, Clone, Default)]
pub(crate) struct Pages {
    map: HashMap<u64, Page, RandomState>,
}

impl Pages {
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn clear(&mut self) {
        self.map.clear();
        self.map.shrink_to(0);
    }

    pub fn contains(&self, engine: u64) -> bool {
        self.map.contains_key(&engine)
    }

    /// Every page, for a snapshot.
    pub fn entries(&self) -> impl Iterator<Item = PageEntry> + '_ {
        self.map.iter().map(|(&engine, p)| PageEntry {
            engine,
            parent: p.parent,
            tokens: p.tokens.to_vec(),
            index: p.index,
            prev_block: p.prev_block,
            block: p.block,
            namespace: p.namespace,
            refs: p.refs,
        })
    }

    /// Puts back a page of a snapshot; false when the worker's limit refused it.
    pub fn restore(&mut self, p: &PageEntry, pages_max: usize) -> bool {
        if self.map.len() >= pages_max && !self.map.contains_key(&p.engine) {
            return false;
        }
        self.map.insert(
            p.engine,
            Page {
                parent: p.parent,
                tokens: p.tokens.as_slice().into(),
                index: p.index,
                prev_block: p.prev_block,
                block: p.block,
                namespace: p.namespace,
                refs: p.refs.max(1),
            },
        );
        true
    }

    /// Whether pages of `page_size` tokens are regrouped into blocks of `block_size`.
    pub fn regroups(page_size: u32, block_size: u32) -> bool {
        page_size > 0 && page_size < block_size && block_size % page_size == 0
    }

    /// Takes a store of pages in. Writes into `out` the identities of the router blocks its
    /// pages completed and says why the rest was refused, if it was.
    pub fn store(
        &mut self,
        pages: &StoredBlocks<'_>,
        block_size: u32,
        pages_max: usize,
        out: &mut Vec<u64>,
    ) -> Option<Refusal> {
        out.clear();
        let p = pages.block_size as usize;
        let n = pages.engine_hashes.len();
        if !Self::regroups(pages.block_size, block_size) {
            return Some(Refusal::BlockSizeMismatch);
        }
        if pages.token_ids.len() != n * p {
            return Some(Refusal::Malformed);
        }
        let per_block = block_size / pages.block_size;
        let (mut prev, mut prev_block, mut index, namespace) = match pages.parent {
            None => (None, None, 0, namespace_term(pages.cache_salt)),
            Some(e) => match self.map.get(&e) {
                Some(page) if page.index == per_block => (Some(e), page.block, 0, page.namespace),
                Some(page) => (Some(e), page.prev_block, page.index, page.namespace),
                None => return Some(Refusal::ParentUnknown),
            },
        };
        let mut refusal = None;
        let mut usable = n;
        if let Some(first) = pages.unhashable_from.filter(|&f| f < n) {
            usable = first;
            refusal = Some(Refusal::Unhashable);
        }
        let hasher =
            BlockHasher::with_namespace_term(block_size as usize, pages.lora_name, namespace);
        let mut block_tokens = Vec::new();
        for (i, tokens) in pages.token_ids.chunks_exact(p).take(usable).enumerate() {
            let engine = pages.engine_hashes[i];
            index += 1;
            let block = if index == per_block {
                match self.block_tokens(prev, per_block - 1, tokens, &mut block_tokens) {
                    true => Some(
                        SequenceHash::chain(
                            prev_block.map(SequenceHash),
                            hasher.block_hash(&block_tokens),
                        )
                        .0,
                    ),
                    false => return Some(Refusal::ParentUnknown),
                }
            } else {
                None
            };
            let full = self.map.len() >= pages_max;
            match self.map.entry(engine) {
                Entry::Occupied(mut o) => {
                    let page = o.get_mut();
                    if page.block != block || *page.tokens != *tokens {
                        return Some(Refusal::HashConflict);
                    }
                    page.refs = page.refs.saturating_add(1);
                }
                Entry::Vacant(_) if full => return Some(Refusal::WorkerFull),
                Entry::Vacant(v) => {
                    v.insert(Page {
                        parent: prev,
                        tokens: tokens.into(),
                        index,
                        prev_block,
                        block,
                        namespace,
                        refs: 1,
                    });
                }
            }
            if let Some(b) = block {
                out.push(b);
                prev_block = Some(b);
                index = 0;
            }
            prev = Some(engine);
        }
        refusal
    }

    /// The tokens of a router block ending with `last`, the `before` pages before it found by
    /// walking back from `prev`, written into `out`; false when a page on the way is not held.
    fn block_tokens(
        &self,
        prev: Option<u64>,
        before: u32,
        last: &[u32],
        out: &mut Vec<u32>,
    ) -> bool {
        out.clear();
        let mut pages: Vec<&[u32]> = Vec::with_capacity(before as usize);
        let mut at = prev;
        for _ in 0..before {
            let Some(page) = at.and_then(|e| self.map.get(&e)) else {
                return false;
            };
            pages.push(&page.tokens);
            at = page.parent;
        }
        for page in pages.iter().rev() {
            out.extend_from_slice(page);
        }
        out.extend_from_slice(last);
        true
    }

    /// Takes a removal of pages in: the identities of the router blocks they completed (one
    /// reference each) written into `out`; returns how many pages it did not hold.
    pub fn remove(&mut self, engine_hashes: &[u64], out: &mut Vec<u64>) -> usize {
        out.clear();
        let mut unknown = 0;
        for &engine in engine_hashes {
            match self.map.entry(engine) {
                Entry::Occupied(mut o) => {
                    if let Some(b) = o.get().block {
                        out.push(b);
                    }
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
