//! Property test: random operation sequences on a pool against a small reference model.
//!
//! After every step: no block in two states, counts conserved, exactly the registered hashes are
//! findable, holders match, eviction picks the victim the model predicts (lowest priority, then
//! least recently idle), and replaying the event stream gives the registered set.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use kvbm_core::{
    BlockIdentity, BlockPool, BlockState, CompleteBlock, FillingBlock, HeldBlocks, RegisteredBlock,
};
use kvbm_events::{EventPublisher, EventSubscriber, KvEvent, SequenceHash, Tier};
use proptest::prelude::*;

const CAPACITY: usize = 6;
const HASHES: u64 = 10;

#[derive(Debug, Clone)]
enum Op {
    Allocate(usize),
    Complete(usize, u64),
    Register(usize),
    Lookup(u64),
    Match(Vec<u64>),
    Hold(Vec<u64>),
    TruncateHeld(usize, usize),
    DropHeld(usize),
    DropMutable(usize),
    DropComplete(usize),
    DropImmutable(usize),
    CloneImmutable(usize),
    SetPriority(usize, u32),
    EvictIdle(usize),
    Discard(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..4usize).prop_map(Op::Allocate),
        3 => (0..8usize, 0..HASHES).prop_map(|(i, h)| Op::Complete(i, h)),
        3 => (0..8usize).prop_map(Op::Register),
        1 => (0..HASHES).prop_map(Op::Lookup),
        1 => proptest::collection::vec(0..HASHES, 0..5).prop_map(Op::Match),
        1 => proptest::collection::vec(0..HASHES, 0..5).prop_map(Op::Hold),
        1 => (0..4usize, 0..4usize).prop_map(|(i, n)| Op::TruncateHeld(i, n)),
        1 => (0..4usize).prop_map(Op::DropHeld),
        1 => (0..8usize).prop_map(Op::DropMutable),
        1 => (0..8usize).prop_map(Op::DropComplete),
        3 => (0..8usize).prop_map(Op::DropImmutable),
        1 => (0..8usize).prop_map(Op::CloneImmutable),
        1 => (0..8usize, 0..3u32).prop_map(|(i, p)| Op::SetPriority(i, p)),
        1 => (0..3usize).prop_map(Op::EvictIdle),
        1 => (0..8usize).prop_map(Op::Discard),
        1 => Just(Op::Reset),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelState {
    Free,
    Filling,
    Complete,
    Registered {
        hash: u64,
        holders: u32,
    },
    /// Out of the registry, freed when its last holder lets go.
    Discarded {
        holders: u32,
    },
}

#[derive(Default)]
struct Model {
    states: Vec<Option<ModelState>>,
    priority: Vec<u32>,
    /// Idle blocks, oldest first, with the priority they went idle with.
    idle: Vec<(u32, u32)>,
    registered: BTreeMap<u64, u32>,
}

impl Model {
    fn new() -> Self {
        Self {
            states: vec![Some(ModelState::Free); CAPACITY],
            priority: vec![0; CAPACITY],
            ..Default::default()
        }
    }
    fn state(&self, id: u32) -> ModelState {
        self.states[id as usize].expect("known")
    }
    fn set(&mut self, id: u32, s: ModelState) {
        self.states[id as usize] = Some(s);
    }
    fn count(&self, f: impl Fn(ModelState) -> bool) -> usize {
        self.states.iter().filter(|s| f(s.unwrap())).count()
    }
    fn free(&self) -> usize {
        self.count(|s| s == ModelState::Free)
    }
    /// The next victim: lowest priority, then oldest idle.
    fn next_victim(&self) -> Option<usize> {
        let min = self.idle.iter().map(|&(_, p)| p).min()?;
        self.idle.iter().position(|&(_, p)| p == min)
    }
    fn evict_one(&mut self) -> u64 {
        let pos = self.next_victim().expect("an idle block");
        let (id, _) = self.idle.remove(pos);
        let ModelState::Registered { hash, holders: 0 } = self.state(id) else {
            panic!("victim not idle")
        };
        self.registered.remove(&hash);
        self.set(id, ModelState::Free);
        self.priority[id as usize] = 0;
        hash
    }
    fn acquire(&mut self, id: u32) {
        if let ModelState::Discarded { holders } = self.state(id) {
            self.set(
                id,
                ModelState::Discarded {
                    holders: holders + 1,
                },
            );
            return;
        }
        let ModelState::Registered { hash, holders } = self.state(id) else {
            panic!("not registered")
        };
        if holders == 0 {
            self.idle.retain(|&(i, _)| i != id);
        }
        self.set(
            id,
            ModelState::Registered {
                hash,
                holders: holders + 1,
            },
        );
    }
    fn release(&mut self, id: u32) {
        if let ModelState::Discarded { holders } = self.state(id) {
            let s = if holders == 1 {
                ModelState::Free
            } else {
                ModelState::Discarded {
                    holders: holders - 1,
                }
            };
            self.set(id, s);
            if holders == 1 {
                self.priority[id as usize] = 0;
            }
            return;
        }
        let ModelState::Registered { hash, holders } = self.state(id) else {
            panic!("not registered")
        };
        self.set(
            id,
            ModelState::Registered {
                hash,
                holders: holders - 1,
            },
        );
        if holders == 1 {
            self.idle.push((id, self.priority[id as usize]));
        }
    }
}

fn identity(h: u64) -> BlockIdentity {
    BlockIdentity {
        sequence_hash: SequenceHash(h),
        parent: None,
        tokens: Arc::from(vec![h as u32; 4]),
        lora_name: None,
        group: None,
    }
}

fn replay(sub: &mut EventSubscriber, set: &mut HashSet<u64>) -> Vec<u64> {
    let mut removed_now = Vec::new();
    for d in sub.drain() {
        assert_eq!(
            d.missed_before, 0,
            "the test subscriber must not lose events"
        );
        match &d.record.event {
            KvEvent::BlockStored(s) => {
                assert_eq!(s.tier, Tier::Host);
                assert_eq!(s.token_ids.len(), 4 * s.block_hashes.len());
                for h in &s.block_hashes {
                    assert!(set.insert(h.0), "stored twice without removal: {h:?}");
                }
            }
            KvEvent::BlockRemoved(r) => {
                for h in &r.block_hashes {
                    assert!(set.remove(&h.0), "removed without being stored: {h:?}");
                    removed_now.push(h.0);
                }
            }
            KvEvent::AllBlocksCleared => set.clear(),
            KvEvent::SharedStored { .. } | KvEvent::SharedRemoved { .. } => {}
        }
    }
    removed_now
}

/// Holders per block agree with the model (used mid-step, before the model is updated for drops).
fn continue_check(pool: &BlockPool, model: &Model) {
    for id in 0..CAPACITY as u32 {
        if let ModelState::Registered { holders, .. } = model.state(id) {
            assert_eq!(
                pool.holders_of(kvbm_core::BlockId(id)),
                holders,
                "block {id}"
            );
        }
    }
}

fn run(ops: Vec<Op>) {
    let events = EventPublisher::new();
    let mut sub = events.subscribe(100_000);
    let pool = BlockPool::new(Tier::Host, CAPACITY, 4, Some(events));
    let mut model = Model::new();
    let mut mutables: Vec<FillingBlock> = Vec::new();
    let mut completes: Vec<(CompleteBlock, u64)> = Vec::new();
    let mut immutables: Vec<RegisteredBlock> = Vec::new();
    let mut held_sets: Vec<HeldBlocks> = Vec::new();
    let mut resident: HashSet<u64> = HashSet::new();

    for op in ops {
        let mut expected_evictions: Vec<u64> = Vec::new();
        match op.clone() {
            Op::Allocate(n) => {
                let possible = model.free() + model.idle.len();
                match pool.allocate(n) {
                    Ok(blocks) => {
                        assert!(n <= possible);
                        for _ in 0..n.saturating_sub(model.free()) {
                            expected_evictions.push(model.evict_one());
                        }
                        for b in &blocks {
                            assert_eq!(
                                model.state(b.id().0),
                                ModelState::Free,
                                "allocated a non-free block"
                            );
                            model.set(b.id().0, ModelState::Filling);
                        }
                        mutables.extend(blocks);
                    }
                    Err(_) => assert!(n > possible, "refused {n} with {possible} possible"),
                }
            }
            Op::Complete(i, h) if i < mutables.len() => {
                let b = mutables.swap_remove(i);
                model.set(b.id().0, ModelState::Complete);
                completes.push((b.complete(identity(h)), h));
            }
            Op::Register(i) if i < completes.len() => {
                let (b, h) = completes.swap_remove(i);
                let new_id = b.id().0;
                let got = pool.register(b).expect("own pool");
                match model.registered.get(&h).copied() {
                    Some(existing) => {
                        assert_eq!(got.id().0, existing, "dedup must return the resident block");
                        model.set(new_id, ModelState::Free);
                        model.acquire(existing);
                    }
                    None => {
                        assert_eq!(got.id().0, new_id);
                        model.registered.insert(h, new_id);
                        model.set(
                            new_id,
                            ModelState::Registered {
                                hash: h,
                                holders: 1,
                            },
                        );
                    }
                }
                assert_eq!(got.sequence_hash(), SequenceHash(h));
                immutables.push(got);
            }
            Op::Lookup(h) => {
                let got = pool.lookup(SequenceHash(h));
                assert_eq!(
                    got.as_ref().map(|b| b.id().0),
                    model.registered.get(&h).copied()
                );
                if let Some(b) = got {
                    model.acquire(b.id().0);
                    immutables.push(b);
                }
            }
            Op::Match(hashes) => {
                let keys: Vec<SequenceHash> = hashes.iter().map(|&h| SequenceHash(h)).collect();
                let expected: Vec<u32> = hashes
                    .iter()
                    .map_while(|h| model.registered.get(h).copied())
                    .collect();
                assert_eq!(pool.count_prefix(&keys), expected.len());
                let got = pool.match_prefix(&keys);
                assert_eq!(got.iter().map(|b| b.id().0).collect::<Vec<_>>(), expected);
                for b in got {
                    model.acquire(b.id().0);
                    immutables.push(b);
                }
            }
            Op::Hold(hashes) => {
                let keys: Vec<SequenceHash> = hashes.iter().map(|&h| SequenceHash(h)).collect();
                let expected: Vec<u32> = hashes
                    .iter()
                    .map_while(|h| model.registered.get(h).copied())
                    .collect();
                let held = pool.hold_prefix(&keys);
                assert_eq!(
                    held.blocks().iter().map(|b| b.0 .0).collect::<Vec<_>>(),
                    expected
                );
                for &id in &expected {
                    model.acquire(id);
                }
                held_sets.push(held);
            }
            Op::TruncateHeld(i, n) if i < held_sets.len() => {
                let released: Vec<u32> = held_sets[i]
                    .blocks()
                    .iter()
                    .skip(n)
                    .map(|b| b.0 .0)
                    .collect();
                held_sets[i].truncate(n);
                for id in released {
                    model.release(id);
                }
            }
            Op::DropHeld(i) if i < held_sets.len() => {
                let held = held_sets.swap_remove(i);
                let ids: Vec<u32> = held.blocks().iter().map(|b| b.0 .0).collect();
                if ids.len() % 2 == 0 {
                    drop(held);
                } else {
                    // Half the time, turn the set into handles first: holds move, nothing changes.
                    immutables.extend(held.into_blocks());
                    continue_check(&pool, &model);
                    for _ in 0..ids.len() {
                        drop(immutables.pop());
                    }
                }
                for id in ids {
                    model.release(id);
                }
            }
            Op::DropMutable(i) if i < mutables.len() => {
                model.set(mutables.swap_remove(i).id().0, ModelState::Free);
            }
            Op::DropComplete(i) if i < completes.len() => {
                model.set(completes.swap_remove(i).0.id().0, ModelState::Free);
            }
            Op::DropImmutable(i) if i < immutables.len() => {
                let b = immutables.swap_remove(i);
                let id = b.id().0;
                drop(b);
                model.release(id);
            }
            Op::CloneImmutable(i) if i < immutables.len() => {
                let b = immutables[i].clone();
                model.acquire(b.id().0);
                immutables.push(b);
            }
            Op::SetPriority(i, p) if i < immutables.len() => {
                pool.set_priority(&immutables[i], p);
                model.priority[immutables[i].id().0 as usize] = p;
            }
            Op::Discard(i) if i < immutables.len() => {
                let b = immutables.swap_remove(i);
                let id = b.id().0;
                pool.discard(b);
                if let ModelState::Registered { hash, holders } = model.state(id) {
                    // The first discard takes it out of the registry, announced at once.
                    model.registered.remove(&hash);
                    expected_evictions.push(hash);
                    model.set(id, ModelState::Discarded { holders });
                }
                model.release(id);
            }
            Op::Reset => {
                let busy = model.count(|s| {
                    matches!(
                        s,
                        ModelState::Filling
                            | ModelState::Complete
                            | ModelState::Registered { holders: 1.., .. }
                            | ModelState::Discarded { .. }
                    )
                });
                match kvbm_core::clear_across(&[&pool]) {
                    Ok(()) => {
                        assert_eq!(busy, 0, "reset while blocks were in use");
                        for id in 0..CAPACITY as u32 {
                            model.set(id, ModelState::Free);
                            model.priority[id as usize] = 0;
                        }
                        model.idle.clear();
                        model.registered.clear();
                    }
                    Err(_) => assert!(busy > 0, "reset refused with nothing in use"),
                }
            }
            Op::EvictIdle(k) => {
                let n = pool.evict_idle(k);
                assert_eq!(n, k.min(model.idle.len()));
                for _ in 0..n {
                    expected_evictions.push(model.evict_one());
                }
            }
            _ => {}
        }

        // Victims, exactly as the model predicts, and events consistent with residency.
        let removed = replay(&mut sub, &mut resident);
        assert_eq!(removed, expected_evictions, "eviction order after {op:?}");
        let registered: HashSet<u64> = model.registered.keys().copied().collect();
        assert_eq!(resident, registered, "events vs residency after {op:?}");
        let real: HashSet<u64> = pool.registered_hashes().iter().map(|h| h.0).collect();
        assert_eq!(real, registered);

        // Counts conserved and per-block states agree.
        let c = pool.counts();
        assert_eq!(
            c.free + c.filling + c.complete + c.registered + c.discarded + c.reserved,
            CAPACITY
        );
        assert_eq!(
            c.discarded,
            model.count(|s| matches!(s, ModelState::Discarded { .. }))
        );
        assert_eq!(c.free, model.free());
        assert_eq!(c.filling, model.count(|s| s == ModelState::Filling));
        assert_eq!(c.complete, model.count(|s| s == ModelState::Complete));
        assert_eq!(c.registered, model.registered.len());
        assert_eq!(c.idle, model.idle.len());
        for id in 0..CAPACITY as u32 {
            let (state, holders) = match model.state(id) {
                ModelState::Free => (BlockState::Free, 0),
                ModelState::Filling => (BlockState::Filling, 0),
                ModelState::Complete => (BlockState::Complete, 0),
                ModelState::Registered { holders, .. } | ModelState::Discarded { holders } => {
                    (BlockState::Registered, holders)
                }
            };
            assert_eq!(pool.state_of(kvbm_core::BlockId(id)), state, "block {id}");
            assert_eq!(
                pool.holders_of(kvbm_core::BlockId(id)),
                holders,
                "block {id}"
            );
        }
    }

    // Dropping every handle returns everything to free or idle.
    drop(mutables);
    drop(completes);
    drop(immutables);
    drop(held_sets);
    let c = pool.counts();
    assert_eq!(c.free + c.idle, CAPACITY);
    assert_eq!(c.registered, c.idle);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn pool_matches_its_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops);
    }
}

#[test]
fn chained_registrations_publish_one_stored_event_per_run() {
    let events = EventPublisher::new();
    let mut sub = events.subscribe(64);
    let pool = BlockPool::new(Tier::Gpu, 8, 4, Some(events));
    let ids = |h: u64, parent: Option<u64>| BlockIdentity {
        sequence_hash: SequenceHash(h),
        parent: parent.map(SequenceHash),
        tokens: Arc::from(vec![h as u32; 4]),
        lora_name: None,
        group: None,
    };
    let blocks = pool.allocate(4).unwrap();
    let complete: Vec<_> = blocks
        .into_iter()
        .zip([(1, None), (2, Some(1)), (3, Some(2)), (9, Some(7))])
        .map(|(b, (h, p))| b.complete(ids(h, p)))
        .collect();
    let held = pool.register_all(complete).unwrap();
    assert_eq!(held.len(), 4);
    let got: Vec<_> = sub
        .drain()
        .into_iter()
        .map(|d| d.record.event.clone())
        .collect();
    assert_eq!(got.len(), 2, "{got:?}");
    let KvEvent::BlockStored(first) = &got[0] else {
        panic!()
    };
    assert_eq!(
        first.block_hashes,
        vec![SequenceHash(1), SequenceHash(2), SequenceHash(3)]
    );
    assert_eq!(first.parent_hash, None);
    assert_eq!(first.token_ids, vec![1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
    assert_eq!(first.block_size, 4);
    let KvEvent::BlockStored(second) = &got[1] else {
        panic!()
    };
    assert_eq!(
        (second.block_hashes.clone(), second.parent_hash),
        (vec![SequenceHash(9)], Some(SequenceHash(7)))
    );
}

#[test]
fn a_block_of_another_pool_is_handed_back() {
    let a = BlockPool::new(Tier::Host, 2, 4, None);
    let b = BlockPool::new(Tier::Host, 2, 4, None);
    let block = a.allocate(1).unwrap().pop().unwrap().complete(identity(1));
    let rejected = b.register(block).unwrap_err();
    assert_eq!(rejected.value.identity().sequence_hash, SequenceHash(1));
    assert_eq!(a.counts().complete, 1);
    drop(rejected);
    assert_eq!(a.counts().free, 2);
}

#[test]
fn a_growing_pool_hands_out_only_available_blocks() {
    let pool = BlockPool::with_policy(
        Tier::Host,
        8,
        4,
        None,
        Box::new(kvbm_core::LruPriority::new(8)),
        2,
    );
    assert_eq!(pool.counts().reserved, 6);
    assert!(pool.allocate(3).is_err());
    let two = pool.allocate(2).unwrap();
    assert_eq!(pool.grow_available(5), 5);
    assert_eq!(pool.grow_available(1), 5, "never shrinks");
    let three = pool.allocate_up_to(10);
    assert_eq!(three.len(), 3);
    let mut ids: Vec<u32> = two.iter().chain(&three).map(|b| b.id().0).collect();
    ids.sort();
    assert_eq!(ids, vec![0, 1, 2, 3, 4]);
}

#[test]
fn claiming_specific_blocks_is_all_or_nothing() {
    let pool = BlockPool::with_policy(
        Tier::Disk,
        6,
        4,
        None,
        Box::new(kvbm_core::LruPriority::new(6)),
        4,
    );
    let id = kvbm_core::BlockId;
    let taken = pool.allocate(1).unwrap(); // block 0
    assert_eq!(taken[0].id(), id(0));
    for bad in [&[id(1), id(0)][..], &[id(2), id(2)][..], &[id(5)][..]] {
        assert!(pool.claim(bad).is_err(), "{bad:?}");
        assert_eq!(pool.counts().free, 3, "a refused claim changes nothing");
    }
    let claimed = pool.claim(&[id(3), id(1)]).unwrap();
    assert_eq!(
        claimed.iter().map(|b| b.id()).collect::<Vec<_>>(),
        vec![id(3), id(1)]
    );
    let c = pool.counts();
    assert_eq!((c.free, c.filling), (1, 3));
    assert_eq!(
        pool.allocate(1).unwrap()[0].id(),
        id(2),
        "claimed ids are no longer handed out"
    );
}
