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

/// One block's links, packed so that an insert or remove touches one cache line per block.
#[derive(Debug, Clone, Copy)]
struct Node {
    prev: u32,
    next: u32,
    priority: u32,
    linked: bool,
}

/// Least recently used first, lower priority first: one intrusive LRU list per priority, O(1)
/// insert and remove plus a binary search over the priorities in use (usually one or two).
#[derive(Debug)]
pub struct LruPriority {
    nodes: Vec<Node>,
    /// (priority, head = least recent, tail = most recent), sorted by priority.
    lists: Vec<(u32, u32, u32)>,
    len: usize,
}

impl LruPriority {
    /// A policy for block ids `0..capacity_blocks`.
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            nodes: vec![
                Node {
                    prev: NIL,
                    next: NIL,
                    priority: 0,
                    linked: false,
                };
                capacity_blocks
            ],
            lists: Vec::new(),
            len: 0,
        }
    }
}

impl EvictionPolicy for LruPriority {
    fn insert(&mut self, id: BlockId, priority: u32) {
        let node = &mut self.nodes[id.index()];
        assert!(!node.linked, "block {id:?} is already idle");
        node.linked = true;
        node.priority = priority;
        node.next = NIL;
        match self.lists.binary_search_by_key(&priority, |l| l.0) {
            Ok(at) => {
                let tail = self.lists[at].2;
                self.nodes[id.index()].prev = tail;
                self.nodes[tail as usize].next = id.0;
                self.lists[at].2 = id.0;
            }
            Err(at) => {
                node.prev = NIL;
                self.lists.insert(at, (priority, id.0, id.0));
            }
        }
        self.len += 1;
    }

    fn remove(&mut self, id: BlockId) {
        let node = &mut self.nodes[id.index()];
        assert!(node.linked, "block {id:?} is not idle");
        node.linked = false;
        let Node {
            prev,
            next,
            priority,
            ..
        } = *node;
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        }
        let at = self
            .lists
            .binary_search_by_key(&priority, |l| l.0)
            .expect("list of a linked block");
        match (prev == NIL, next == NIL) {
            (true, true) => {
                self.lists.remove(at);
            }
            (true, false) => self.lists[at].1 = next,
            (false, true) => self.lists[at].2 = prev,
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
