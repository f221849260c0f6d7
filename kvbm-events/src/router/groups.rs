//! A hybrid worker's KV cache groups (vLLM 0.33's hybrid KV cache manager): which group is of
//! which kind, and which blocks its sliding-window and Mamba groups hold, so that a match is cut
//! where vLLM's coordinator would cut the hit.
//!
//! The rule (vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`,
//! vllm/v1/core/kv_cache_coordinator.py, over the managers' `find_longest_cache_hit` in
//! vllm/v1/core/single_type_kv_cache_manager.py): a hit of `L` blocks is one every group accepts.
//! - A prefix group (full, MLA, sink-full attention) accepts `L` when it holds blocks `0..L`.
//!   These groups' blocks are the index's claims ([`crate::router::index`]).
//! - A sliding-window group of window `W` tokens accepts `L` when it holds the
//!   `k = ceil((W - 1) / block_size)` blocks before `L` (`SlidingWindowManager`), or, for `L < k`,
//!   all of `0..L`.
//! - A Mamba group (state at block boundaries, `align` mode) accepts `L` when it holds block
//!   `L - 1`, the state at `L` (`MambaManager`).
//! - Every group's answer is the longest length it accepts up to a bound; the coordinator lowers
//!   the bound to each answer until all agree. Each acceptance is a property of `L` alone, so the
//!   fixed point is the longest `L` every group accepts (vLLM's per-spec batching of groups, which
//!   needs a block in all groups of one spec, gives the same `L`).
//! - A worker without a prefix group starts from the whole request.
//! - Chunked local attention (its chunk size is not on the wire), encoder-only and cross attention
//!   and unknown kinds are counted, never modelled: they do not cut a match.
//!
//! Invariants:
//! - A group's kind is learned from its stores (`kv_cache_spec_kind`); removals carry only the
//!   group index. A group never described is taken as a prefix group (streams before groups).
//! - Only GPU-tier blocks of sliding-window and Mamba groups are kept, reference-counted like the
//!   index's holdings, at most `blocks_max` per worker.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use foldhash::quality::RandomState;

use crate::router::index::{GroupEntry, GroupHolding};
use crate::{GroupKind, GroupRole};

/// Group indices a worker may describe; events of higher ones are ignored.
pub const GROUPS_MAX: u32 = 64;

/// One sliding-window or Mamba group's GPU blocks.
#[derive(Debug, Clone, Default)]
struct Held {
    blocks: HashMap<u64, u32, RandomState>,
}

/// A worker's groups.
#[derive(Debug, Clone, Default)]
pub(crate) struct WorkerGroups {
    /// Per group index, its kind and window, once a store described it.
    specs: Vec<Option<(GroupKind, Option<u32>)>>,
    /// Per group index, its blocks (sliding-window and Mamba groups only).
    held: Vec<Held>,
    /// Blocks held over all groups, pending ones included.
    total: usize,
    /// Stores of engine hashes not yet named (by group): vLLM 0.33 sends a sparse group's
    /// stores without the tokens of each stored block (`BlockPool.cache_full_blocks` skips null
    /// and masked blocks in `block_hashes` but not in `token_ids`), so a block is placed when a
    /// prefix group's store of the same hash names it (the same batch, just after).
    pending: HashMap<(u64, u32), u32, RandomState>,
    /// Whether a group cuts matches (a sliding-window one with a window, or a Mamba one).
    cuts: bool,
    /// Whether a prefix group was described.
    has_prefix: bool,
}

impl WorkerGroups {
    pub fn clear(&mut self) {
        *self = WorkerGroups::default();
    }

    /// Records what a store says of group `g`.
    pub fn learn(&mut self, g: u32, kind: GroupKind, window: Option<u32>) {
        if g >= GROUPS_MAX {
            return;
        }
        let g = g as usize;
        if self.specs.len() <= g {
            self.specs.resize(g + 1, None);
        }
        self.specs[g] = Some((kind, window));
        match kind.role() {
            GroupRole::Prefix => self.has_prefix = true,
            GroupRole::Window => self.cuts |= window.is_some(),
            GroupRole::State => self.cuts = true,
            GroupRole::Ignored => {}
        }
    }

    /// How group `g`'s events are taken: `None` for the index's claims (no group, or a group
    /// never described), else the role and window.
    pub fn role(&self, g: Option<u32>) -> Option<(GroupRole, Option<u32>)> {
        let g = g?;
        if g >= GROUPS_MAX {
            return Some((GroupRole::Ignored, None));
        }
        let (kind, window) = (*self.specs.get(g as usize)?)?;
        match kind.role() {
            GroupRole::Prefix => None,
            // A window group without a window cannot be modelled.
            GroupRole::Window if window.is_none() => Some((GroupRole::Ignored, None)),
            role => Some((role, window)),
        }
    }

    /// The kind group `g` was described with.
    pub fn kind(&self, g: u32) -> Option<GroupKind> {
        self.specs
            .get(g as usize)
            .copied()
            .flatten()
            .map(|(k, _)| k)
    }

    /// Group `g` stored `blocks` on GPU; false when the worker's limit refused some.
    pub fn store(&mut self, g: u32, blocks: &[u64], blocks_max: usize) -> bool {
        self.store_n(g, blocks, 1, blocks_max)
    }

    /// [`Self::store`], `n` times over.
    pub fn store_n(&mut self, g: u32, blocks: &[u64], n: u32, blocks_max: usize) -> bool {
        if g >= GROUPS_MAX {
            return false;
        }
        let g = g as usize;
        if self.held.len() <= g {
            self.held.resize_with(g + 1, Held::default);
        }
        let held = &mut self.held[g].blocks;
        let mut all = true;
        for &b in blocks {
            match held.entry(b) {
                Entry::Occupied(mut o) => *o.get_mut() = o.get().saturating_add(n),
                Entry::Vacant(_) if self.total >= blocks_max => all = false,
                Entry::Vacant(v) => {
                    v.insert(n);
                    self.total += 1;
                }
            }
        }
        all
    }

    /// Group `g` stored engine hash `engine`, not yet named; false when the worker's limit
    /// refused it.
    pub fn pend(&mut self, engine: u64, g: u32, blocks_max: usize) -> bool {
        self.pend_n(engine, g, 1, blocks_max)
    }

    /// [`Self::pend`], `n` times over.
    pub fn pend_n(&mut self, engine: u64, g: u32, n: u32, blocks_max: usize) -> bool {
        if g >= GROUPS_MAX {
            return false;
        }
        match self.pending.entry((engine, g)) {
            Entry::Occupied(mut o) => *o.get_mut() = o.get().saturating_add(n),
            Entry::Vacant(_) if self.total >= blocks_max => return false,
            Entry::Vacant(v) => {
                v.insert(n);
                self.total += 1;
            }
        }
        true
    }

    /// The groups described, for a snapshot.
    pub fn specs(&self) -> impl Iterator<Item = GroupEntry> + '_ {
        self.specs.iter().enumerate().filter_map(|(g, spec)| {
            spec.map(|(kind, window)| GroupEntry {
                group: g as u32,
                kind,
                window,
            })
        })
    }

    /// The blocks held and the stores pending, for a snapshot.
    pub fn holdings(&self) -> impl Iterator<Item = GroupHolding> + '_ {
        let held = self.held.iter().enumerate().flat_map(|(g, h)| {
            h.blocks.iter().map(move |(&hash, &count)| GroupHolding {
                group: g as u32,
                hash,
                count,
                pending: false,
            })
        });
        let pending = self
            .pending
            .iter()
            .map(|(&(hash, group), &count)| GroupHolding {
                group,
                hash,
                count,
                pending: true,
            });
        held.chain(pending)
    }

    /// Takes one pending store of `engine` by `g` back (its removal); false when there is none.
    pub fn unpend(&mut self, engine: u64, g: u32) -> bool {
        match self.pending.entry((engine, g)) {
            Entry::Occupied(mut o) => {
                *o.get_mut() -= 1;
                if *o.get() == 0 {
                    o.remove();
                    self.total -= 1;
                }
                true
            }
            Entry::Vacant(_) => false,
        }
    }

    /// Whether stores wait for their engine hash to be named.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The pending stores of `engine`, taken: (group, count) each.
    pub fn take_pending(&mut self, engine: u64) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for g in 0..self.specs.len() as u32 {
            if let Some(n) = self.pending.remove(&(engine, g)) {
                self.total -= 1;
                out.push((g, n));
            }
        }
        out
    }

    /// Group `g` removed `blocks` from GPU; returns how many it did not hold.
    pub fn remove(&mut self, g: u32, blocks: &[u64]) -> usize {
        let Some(held) = self.held.get_mut(g as usize) else {
            return blocks.len();
        };
        let mut unknown = 0;
        for b in blocks {
            match held.blocks.entry(*b) {
                Entry::Occupied(mut o) => {
                    *o.get_mut() -= 1;
                    if *o.get() == 0 {
                        o.remove();
                        self.total -= 1;
                    }
                }
                Entry::Vacant(_) => unknown += 1,
            }
        }
        unknown
    }

    /// Whether group `g` holds block `id`.
    pub fn holds(&self, g: u32, id: u64) -> bool {
        self.held
            .get(g as usize)
            .is_some_and(|h| h.blocks.contains_key(&id))
    }

    /// Whether any group cuts matches.
    pub fn cuts(&self) -> bool {
        self.cuts
    }

    /// Whether the worker has no prefix group, so matches start from its other groups.
    pub fn without_prefix(&self) -> bool {
        self.cuts && !self.has_prefix
    }

    /// Blocks held over all groups.
    pub fn len(&self) -> usize {
        self.total
    }

    /// The longest hit of at most `bound` blocks of `hashes` every cutting group accepts (the
    /// coordinator's fixed point; see the module's rule).
    pub fn hit(&self, hashes: &[u64], bound: usize, block_size: u32) -> usize {
        let mut bound = bound.min(hashes.len());
        loop {
            let mut l = bound;
            for (g, spec) in self.specs.iter().enumerate() {
                let Some((kind, window)) = *spec else {
                    continue;
                };
                let held = self.held.get(g).map(|h| &h.blocks);
                let has = |i: usize| held.is_some_and(|h| h.contains_key(&hashes[i]));
                l = match (kind.role(), window) {
                    (GroupRole::Window, Some(w)) => {
                        let k = (w.saturating_sub(1).div_ceil(block_size.max(1)) as usize).max(1);
                        window_hit(l, k, has)
                    }
                    (GroupRole::State, _) => (0..l).rev().find(|&i| has(i)).map_or(0, |i| i + 1),
                    _ => l,
                };
                if l == 0 {
                    return 0;
                }
            }
            if l == bound {
                return l;
            }
            bound = l;
        }
    }
}

/// `SlidingWindowManager.find_longest_cache_hit`: the end of the last run of `k` held blocks
/// before `bound`, or the run from block 0 when there is none.
fn window_hit(bound: usize, k: usize, has: impl Fn(usize) -> bool) -> usize {
    let mut run = 0;
    for i in (0..bound).rev() {
        if has(i) {
            run += 1;
            if run >= k {
                return i + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_hit_needs_the_blocks_before_it() {
        let held = [true, true, false, true, true, true, false, true];
        let has = |i: usize| held[i];
        assert_eq!(window_hit(8, 3, has), 6);
        assert_eq!(window_hit(8, 1, has), 8);
        assert_eq!(
            window_hit(5, 3, has),
            2,
            "no run of 3 before 5: the run from 0"
        );
        assert_eq!(window_hit(8, 4, has), 2);
    }

    #[test]
    fn the_fixed_point_is_the_longest_length_every_group_accepts() {
        let hashes: Vec<u64> = (0..10).collect();
        let mut g = WorkerGroups::default();
        g.learn(0, GroupKind::SlidingWindow, Some(33)); // 2 blocks of 16
        g.learn(1, GroupKind::Mamba, None);
        g.learn(2, GroupKind::FullAttention, None);
        assert!(g.store(0, &[0, 1, 2, 3, 5, 6, 7], 100));
        assert!(g.store(1, &[3, 7], 100));
        // Window accepts 8 (6, 7), Mamba accepts 8 (7): 8.
        assert_eq!(g.hit(&hashes, 10, 16), 8);
        // Without state 7: Mamba says 4, window accepts 4 (2, 3).
        assert_eq!(g.remove(1, &[7]), 0);
        assert_eq!(g.hit(&hashes, 10, 16), 4);
        // Window loses 2: at 4 it needs 2 and 3; run from 0 is 2; Mamba at 2 needs block 1: 0.
        assert_eq!(g.remove(0, &[2]), 0);
        assert_eq!(g.hit(&hashes, 10, 16), 0);
        assert_eq!(g.remove(1, &[9]), 1);
    }
}
