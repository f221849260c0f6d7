//! Eviction policies: which idle registered block leaves a tier first.
//!
//! A pool tells its policy when a block becomes idle (registered, no holder) and when it stops
//! being idle (acquired again, or evicted); the policy names victims. The policy never touches
//! pool state itself.

use crate::pool::BlockId;

/// Chooses victims among idle blocks.
pub trait EvictionPolicy: Send + std::fmt::Debug + 'static {
    /// `id` became idle with eviction priority `priority` (lower leaves first).
    fn insert(&mut self, id: BlockId, priority: u32);
    /// `id` is no longer idle. It was inserted before.
    fn remove(&mut self, id: BlockId);
    /// The next victim, removed from the policy.
    fn pop_victim(&mut self) -> Option<BlockId>;
    /// Idle blocks tracked.
    fn len(&self) -> usize;
    /// True when no block is idle.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const NIL: u32 = u32::MAX;

/// Least recently used first, lower priority first: one intrusive LRU list per priority, O(1)
/// insert and remove plus a binary search over the priorities in use (usually one or two).
#[derive(Debug)]
pub struct LruPriority {
    prev: Vec<u32>,
    next: Vec<u32>,
    priority: Vec<u32>,
    linked: Vec<bool>,
    /// (priority, head = least recent, tail = most recent), sorted by priority.
    lists: Vec<(u32, u32, u32)>,
    len: usize,
}

impl LruPriority {
    /// A policy for block ids `0..capacity_blocks`.
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            prev: vec![NIL; capacity_blocks],
            next: vec![NIL; capacity_blocks],
            priority: vec![0; capacity_blocks],
            linked: vec![false; capacity_blocks],
            lists: Vec::new(),
            len: 0,
        }
    }
}

impl EvictionPolicy for LruPriority {
    fn insert(&mut self, id: BlockId, priority: u32) {
        let i = id.index();
        assert!(!self.linked[i], "block {id:?} is already idle");
        self.linked[i] = true;
        self.priority[i] = priority;
        self.next[i] = NIL;
        match self.lists.binary_search_by_key(&priority, |l| l.0) {
            Ok(at) => {
                let tail = &mut self.lists[at].2;
                self.prev[i] = *tail;
                self.next[*tail as usize] = id.0;
                *tail = id.0;
            }
            Err(at) => {
                self.prev[i] = NIL;
                self.lists.insert(at, (priority, id.0, id.0));
            }
        }
        self.len += 1;
    }

    fn remove(&mut self, id: BlockId) {
        let i = id.index();
        assert!(self.linked[i], "block {id:?} is not idle");
        self.linked[i] = false;
        let (p, n) = (self.prev[i], self.next[i]);
        if p != NIL {
            self.next[p as usize] = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        }
        let priority = self.priority[i];
        let at = self
            .lists
            .binary_search_by_key(&priority, |l| l.0)
            .expect("list of a linked block");
        match (p == NIL, n == NIL) {
            (true, true) => {
                self.lists.remove(at);
            }
            (true, false) => self.lists[at].1 = n,
            (false, true) => self.lists[at].2 = p,
            (false, false) => {}
        }
        self.len -= 1;
    }

    fn pop_victim(&mut self) -> Option<BlockId> {
        let &(_, head, _) = self.lists.first()?;
        let id = BlockId(head);
        self.remove(id);
        Some(id)
    }

    fn len(&self) -> usize {
        self.len
    }
}
