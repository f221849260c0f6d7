//! The router index against a naive model: every operation sequence, every query. The index is
//! fed block identities directly here (its `store` and `remove`); `router_translate.rs` covers
//! the translation of engine events.

use std::collections::HashMap;

use kvbm_events::router::{ApplyStatus, KvIndex, Overlap};
use kvbm_events::{Location, Tier, WireEvent};
use proptest::prelude::*;

type Key = (u64, u32);

#[derive(Debug, Clone)]
enum Op {
    Store(Key, Tier, Vec<u64>),
    Remove(Key, Tier, Vec<u64>),
    Clear(Key),
    DropWorker(Key),
    Remote(Key, Vec<u64>),
}

fn key() -> impl Strategy<Value = Key> + Clone {
    (0..4u64, 0..2u32)
}

/// Enough workers that holder sets span several groups of 64.
fn wide_key() -> impl Strategy<Value = Key> + Clone {
    (0..200u64, 0..1u32)
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Gpu), Just(Tier::Host), Just(Tier::Disk)]
}

fn hashes() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(0..12u64, 0..6)
}

fn op_with(key: impl Strategy<Value = Key> + Clone) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (key.clone(), tier(), hashes()).prop_map(|(k, t, h)| Op::Store(k, t, h)),
        4 => (key.clone(), tier(), hashes()).prop_map(|(k, t, h)| Op::Remove(k, t, h)),
        1 => key.clone().prop_map(Op::Clear),
        1 => key.clone().prop_map(Op::DropWorker),
        1 => (key, hashes()).prop_map(|(k, h)| Op::Remote(k, h)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    op_with(key())
}

#[derive(Default)]
struct Model {
    counts: HashMap<(Key, Tier, u64), u32>,
}

impl Model {
    fn held(&self, k: Key, t: Tier, h: u64) -> bool {
        self.counts.get(&(k, t, h)).copied().unwrap_or(0) > 0
    }

    fn workers(&self) -> Vec<Key> {
        let mut keys: Vec<Key> = self
            .counts
            .iter()
            .filter(|(_, c)| **c > 0)
            .map(|((k, _, _), _)| *k)
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    fn find(&self, query: &[u64]) -> Vec<(Key, Overlap)> {
        let mut out = Vec::new();
        for k in self.workers() {
            let mut i = 0;
            let mut o = Overlap::default();
            while i < query.len() && self.held(k, Tier::Gpu, query[i]) {
                o.gpu += 1;
                i += 1;
            }
            while i < query.len() && self.held(k, Tier::Host, query[i]) {
                o.host += 1;
                i += 1;
            }
            while i < query.len() && self.held(k, Tier::Disk, query[i]) {
                o.disk += 1;
                i += 1;
            }
            if o != Overlap::default() {
                out.push((k, o));
            }
        }
        out
    }
}

/// Applies `ops` to `index` and to the model, and after each compares every query (plus each
/// stored run as a query, which follows the index's arena order) and every count.
fn run(mut index: KvIndex, ops: Vec<Op>, mut queries: Vec<Vec<u64>>) {
    let mut model = Model::default();
    for op in &ops {
        if let Op::Store(_, _, h) = op {
            queries.push(h.clone());
        }
    }
    for op in ops {
        match &op {
            Op::Store(k, t, h) => {
                assert_eq!(index.store(*k, *t, h), ApplyStatus::Ok);
                for x in h {
                    *model.counts.entry((*k, *t, *x)).or_default() += 1;
                }
            }
            Op::Remove(k, t, h) => {
                let mut expected = ApplyStatus::Ok;
                for x in h {
                    match model.counts.get_mut(&(*k, *t, *x)) {
                        Some(c) if *c > 0 => *c -= 1,
                        _ => expected = ApplyStatus::BlockNotFound,
                    }
                }
                assert_eq!(index.remove(*k, *t, h), expected, "{op:?}");
            }
            Op::Clear(k) => {
                assert_eq!(index.apply(*k, &WireEvent::Cleared), ApplyStatus::Ok);
                model.counts.retain(|(w, _, _), _| w != k);
            }
            Op::DropWorker(k) => {
                index.remove_worker(*k);
                model.counts.retain(|(w, _, _), _| w != k);
            }
            Op::Remote(k, h) => {
                let event = WireEvent::Stored {
                    location: Location::NotLocal("EXTERNAL".into()),
                    block_hashes: h.clone(),
                    parent: None,
                    token_ids: vec![],
                    block_size: 4,
                    lora_name: None,
                    cache_salt: None,
                    unhashable_from: None,
                    group: None,
                    group_kind: None,
                    sliding_window: None,
                };
                assert_eq!(index.apply(*k, &event), ApplyStatus::NotLocal);
            }
        }
        for q in &queries {
            let mut got = index.find_matches(q);
            got.sort_unstable_by_key(|(k, _)| *k);
            assert_eq!(got, model.find(q), "query {q:?} after {op:?}");
        }
        for k in model.workers() {
            for t in Tier::ALL {
                let n = model
                    .counts
                    .iter()
                    .filter(|((w, tt, _), c)| *w == k && *tt == t && **c > 0)
                    .count();
                assert_eq!(index.blocks_in(k, t), n, "{k:?} {t}");
            }
            // Of each query's blocks, those the worker holds in host memory or on disk.
            for q in &queries {
                let below = q
                    .iter()
                    .filter(|&&x| {
                        [Tier::Host, Tier::Disk]
                            .iter()
                            .any(|&t| model.counts.get(&(k, t, x)).is_some_and(|c| *c > 0))
                    })
                    .count();
                assert_eq!(index.held_below_gpu(k, q), below, "{k:?} {q:?}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn the_index_matches_its_model(ops in proptest::collection::vec(op(), 1..60), queries in proptest::collection::vec(proptest::collection::vec(0..12u64, 0..8), 1..5)) {
        run(KvIndex::default(), ops, queries);
    }

    #[test]
    fn the_index_matches_its_model_when_it_compacts_eagerly(ops in proptest::collection::vec(op(), 1..60), queries in proptest::collection::vec(proptest::collection::vec(0..12u64, 0..8), 1..5)) {
        run(KvIndex::default().with_min_tombstones(0), ops, queries);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn the_index_matches_its_model_with_hundreds_of_workers(ops in proptest::collection::vec(op_with(wide_key()), 1..100), queries in proptest::collection::vec(proptest::collection::vec(0..12u64, 0..8), 1..5)) {
        run(KvIndex::default().with_min_tombstones(4), ops, queries);
    }
}

#[test]
fn a_worker_past_its_limit_is_refused_and_counted() {
    let mut index = KvIndex::new(3, 16);
    let w = (1, 0);
    assert_eq!(index.store(w, Tier::Gpu, &[1, 2]), ApplyStatus::Ok);
    assert_eq!(index.store(w, Tier::Host, &[1, 2]), ApplyStatus::WorkerFull);
    assert_eq!(
        (
            index.blocks_in(w, Tier::Gpu),
            index.blocks_in(w, Tier::Host)
        ),
        (2, 1)
    );
    // A duplicate store of something held costs nothing more.
    assert_eq!(index.store(w, Tier::Gpu, &[1]), ApplyStatus::Ok);
    assert_eq!(ApplyStatus::WorkerFull.label(), "worker_full");
}
