//! The index's hash table: block hash -> node id, shaped for the router's access pattern.
//!
//! Why not a general-purpose map: a probe of a general map touches its control bytes and its slot
//! array, two cache misses per block at the index's sizes, and it cannot be prefetched. Here a
//! bucket is one cache line of eight `(node, tag)` slots, so a probe is one miss, and the index
//! prefetches the buckets of the next blocks of an event while it applies the current one.
//!
//! - The tag is 32 bits of the block hash mixed with a per-table random seed (block hashes come
//!   from the network; the seed keeps crafted hashes from piling into one bucket). The home bucket
//!   is taken from the tag's high bits, so growth never reads the arena and doubling keeps a
//!   bucket's entries together.
//! - Slots live in a mapping advised for huge pages (see `mapped`).
//! - Linear probing over buckets; entries are never removed one by one (the index keeps dead nodes
//!   as tombstones and rebuilds the table when it compacts its arena), so the first vacant slot
//!   ends every search.
//! - The load is at most 7/8, so a search always meets a vacant slot.

use crate::router::mapped::{prefetch, MappedVec};

/// Slots per bucket: one cache line of `u64` slots, each `tag << 32 | (node + 1)`; zero is vacant.
const SLOTS: usize = 8;

#[inline]
fn slot(tag: u32, node: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(node + 1)
}

#[inline]
fn slot_node(slot: u64) -> u32 {
    (slot as u32).wrapping_sub(1)
}

#[inline]
fn slot_tag(slot: u64) -> u32 {
    (slot >> 32) as u32
}

#[derive(Debug)]
pub(crate) struct BlockTable {
    /// `buckets() * SLOTS` slots; bucket `b` is `slots[b * SLOTS..][..SLOTS]`, cache-line aligned
    /// because the mapping is page aligned.
    slots: MappedVec<u64>,
    len: usize,
    seed: u64,
}

impl BlockTable {
    pub(crate) fn new(seed: u64) -> Self {
        Self::with_capacity(seed, 0)
    }

    /// A table that holds `entries` without growing.
    pub(crate) fn with_capacity(seed: u64, entries: usize) -> Self {
        Self {
            slots: MappedVec::zeroed(Self::buckets_for(entries) * SLOTS),
            len: 0,
            seed,
        }
    }

    /// Bytes [`Self::with_capacity`] maps for `entries` (None when that overflows).
    pub(crate) fn bytes_for(entries: usize) -> Option<usize> {
        entries
            .checked_mul(8)?
            .div_ceil(SLOTS * 7)
            .max(1)
            .checked_next_power_of_two()?
            .checked_mul(SLOTS * std::mem::size_of::<u64>())
    }

    /// Buckets (a power of two) that hold `entries` at most 7/8 full.
    fn buckets_for(entries: usize) -> usize {
        (entries * 8).div_ceil(SLOTS * 7).max(1).next_power_of_two()
    }

    #[inline]
    fn tag(&self, hash: u64) -> u32 {
        let x =
            u128::from(hash ^ self.seed).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        ((x as u64) ^ ((x >> 64) as u64)) as u32
    }

    #[inline]
    fn home(tag: u32, buckets: usize) -> usize {
        ((u64::from(tag) * buckets as u64) >> 32) as usize
    }

    #[inline]
    fn buckets(&self) -> usize {
        self.slots.len() / SLOTS
    }

    /// Entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes mapped.
    pub(crate) fn mapped_bytes(&self) -> usize {
        self.slots.mapped_bytes()
    }

    /// Starts loading the bucket where `hash` would be found.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        let b = Self::home(self.tag(hash), self.buckets());
        prefetch(&self.slots[b * SLOTS]);
    }

    /// The node holding `hash`, where `is(node)` confirms a candidate (it compares the full hash).
    #[inline]
    pub(crate) fn find(&self, hash: u64, is: impl Fn(u32) -> bool) -> Option<u32> {
        let tag = self.tag(hash);
        let n = self.buckets();
        let mut b = Self::home(tag, n);
        loop {
            for &s in &self.slots[b * SLOTS..][..SLOTS] {
                if s == 0 {
                    return None;
                }
                if slot_tag(s) == tag && is(slot_node(s)) {
                    return Some(slot_node(s));
                }
            }
            b = if b + 1 == n { 0 } else { b + 1 };
        }
    }

    /// The node holding `hash`, or the one `add()` returns, entered for it. The bool is true when
    /// the node is new.
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        hash: u64,
        is: impl Fn(u32) -> bool,
        add: impl FnOnce() -> u32,
    ) -> (u32, bool) {
        if (self.len + 1) * 8 > self.slots.len() * 7 {
            self.grow();
        }
        let tag = self.tag(hash);
        let n = self.buckets();
        let mut b = Self::home(tag, n);
        loop {
            for s in &mut self.slots[b * SLOTS..][..SLOTS] {
                if *s == 0 {
                    let node = add();
                    *s = slot(tag, node);
                    self.len += 1;
                    return (node, true);
                }
                if slot_tag(*s) == tag && is(slot_node(*s)) {
                    return (slot_node(*s), false);
                }
            }
            b = if b + 1 == n { 0 } else { b + 1 };
        }
    }

    /// Enters `entry` (a slot), known to be absent.
    fn insert_new(slots: &mut [u64], entry: u64) {
        let n = slots.len() / SLOTS;
        let mut b = Self::home(slot_tag(entry), n);
        loop {
            if let Some(s) = slots[b * SLOTS..][..SLOTS].iter_mut().find(|s| **s == 0) {
                *s = entry;
                return;
            }
            b = if b + 1 == n { 0 } else { b + 1 };
        }
    }

    fn grow(&mut self) {
        let mut slots = MappedVec::zeroed(self.slots.len() * 2);
        for &s in self.slots.iter().filter(|&&s| s != 0) {
            Self::insert_new(&mut slots, s);
        }
        self.slots = slots;
    }

    /// Replaces every entry by `entries` (hash, node), sized for them.
    pub(crate) fn rebuild(&mut self, entries: impl ExactSizeIterator<Item = (u64, u32)>) {
        let mut slots = MappedVec::zeroed(Self::buckets_for(entries.len()) * SLOTS);
        self.len = entries.len();
        for (hash, node) in entries {
            Self::insert_new(&mut slots, slot(self.tag(hash), node));
        }
        self.slots = slots;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_what_was_entered_through_growth_and_rebuild() {
        let mut table = BlockTable::new(7);
        let hashes: Vec<u64> = (0..5000u64)
            .map(|i| i.wrapping_mul(0x1234_5678_9abc))
            .collect();
        for (i, &h) in hashes.iter().enumerate() {
            let (node, new) = table.find_or_insert(h, |n| hashes[n as usize] == h, || i as u32);
            assert_eq!((node, new), (i as u32, true));
        }
        assert_eq!(table.len(), hashes.len());
        for (i, &h) in hashes.iter().enumerate() {
            assert_eq!(table.find(h, |n| hashes[n as usize] == h), Some(i as u32));
            let again = table.find_or_insert(h, |n| hashes[n as usize] == h, || unreachable!());
            assert_eq!(again, (i as u32, false));
        }
        assert_eq!(table.find(1, |n| hashes[n as usize] == 1), None);
        // Keep every other entry, renumbered.
        let kept: Vec<u64> = hashes.iter().copied().step_by(2).collect();
        table.rebuild(kept.iter().enumerate().map(|(i, &h)| (h, i as u32)));
        assert_eq!(table.len(), kept.len());
        for (i, &h) in kept.iter().enumerate() {
            assert_eq!(table.find(h, |n| kept[n as usize] == h), Some(i as u32));
        }
        assert_eq!(
            table.find(hashes[1], |n| kept[n as usize] == hashes[1]),
            None
        );
    }

    #[test]
    fn one_tag_for_many_hashes_still_resolves_by_the_full_hash() {
        // Every entry confirms by the full hash, so a tag shared by two hashes cannot alias them;
        // emulate the worst case with a check that accepts only the exact node.
        let mut table = BlockTable::new(0);
        for node in 0..100u32 {
            table.find_or_insert(42, |n| n == node, || node);
        }
        assert_eq!(table.len(), 100);
        for node in 0..100u32 {
            assert_eq!(table.find(42, |n| n == node), Some(node));
        }
    }
}
