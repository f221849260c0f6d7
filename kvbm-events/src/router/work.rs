//! Each worker's recent work: the tokens it computed into its GPU cache, as its own KV events
//! report them (each block a `BlockStored` on the GPU tier that the worker did not hold in pinned
//! host memory or on disk, which it would have loaded instead: [`crate::router::KvIndex::held_below_gpu`]),
//! summed with an exponential decay.
//!
//! The router's balance term ([`crate::router::selector::SelectorConfig::balance_weight`]) reads
//! it. Counting what the workers report, and not what the router expected them to compute when
//! it routed, matters: the front end's prefix probe stops tokenizing at a sure pick and counts
//! the rest of the prompt as uncached, so the expected work of a worker whose conversations go
//! on is overcounted (by 3-22% per worker on the Mooncake trace, README), and balancing on it
//! left computed work as uneven as before.
//!
//! Invariant: a worker's value is the sum of what was added for it, each amount halved every
//! `half_life` since it was added.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::router::selector::WorkerKey;

/// The default half-life of recent work (`--router-balance-half-life-secs`).
pub const BALANCE_HALF_LIFE_DEFAULT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy)]
struct Decaying {
    value: f64,
    at: Instant,
}

/// Decayed sums of the tokens each worker computed into its GPU cache.
#[derive(Debug)]
pub struct RecentWork {
    half_life: Duration,
    workers: HashMap<WorkerKey, Decaying>,
}

impl RecentWork {
    /// Sums halved every `half_life` (a zero half-life keeps nothing).
    pub fn new(half_life: Duration) -> Self {
        Self {
            half_life,
            workers: HashMap::new(),
        }
    }

    fn decay(&self, d: Decaying, now: Instant) -> f64 {
        let hl = self.half_life.as_secs_f64();
        if hl <= 0.0 {
            return 0.0;
        }
        // An instant before the last update (callers' clocks read in another order) decays
        // nothing rather than growing the value.
        let dt = now.saturating_duration_since(d.at).as_secs_f64();
        d.value * (-dt / hl * std::f64::consts::LN_2).exp()
    }

    /// `worker` computed `tokens` into its GPU cache at `now`.
    pub fn add(&mut self, worker: WorkerKey, tokens: u64, now: Instant) {
        if tokens == 0 {
            return;
        }
        let value = self
            .workers
            .get(&worker)
            .map_or(0.0, |&d| self.decay(d, now));
        let at = self.workers.get(&worker).map_or(now, |d| d.at.max(now));
        self.workers.insert(
            worker,
            Decaying {
                value: value + tokens as f64,
                at,
            },
        );
    }

    /// `worker`'s recent work at `now`, in tokens (0 for one never seen).
    pub fn value(&self, worker: WorkerKey, now: Instant) -> f64 {
        self.workers
            .get(&worker)
            .map_or(0.0, |&d| self.decay(d, now))
    }

    /// Each of `workers`' recent work above the least of them, in the same order.
    pub fn excess(&self, workers: impl IntoIterator<Item = WorkerKey>, now: Instant) -> Vec<f64> {
        let values: Vec<f64> = workers.into_iter().map(|w| self.value(w, now)).collect();
        let least = values.iter().copied().fold(f64::INFINITY, f64::min);
        values.iter().map(|v| v - least).collect()
    }

    /// Starts `worker`, if not seen yet, level with the least of `others` (0 when none has
    /// any): a worker joining a running fleet would otherwise look idle next to every other and
    /// draw the balance term's new conversations until it caught up.
    pub fn start_level(
        &mut self,
        worker: WorkerKey,
        others: impl Iterator<Item = WorkerKey>,
        now: Instant,
    ) {
        if self.workers.contains_key(&worker) {
            return;
        }
        let least = others
            .filter(|&o| o != worker)
            .map(|o| self.value(o, now))
            .fold(f64::INFINITY, f64::min);
        if least.is_finite() && least > 0.0 {
            self.workers.insert(
                worker,
                Decaying {
                    value: least,
                    at: now,
                },
            );
        }
    }

    /// Forgets `worker` (it was unregistered; a restart or a cleared cache keeps its work, which
    /// it did).
    pub fn drop_worker(&mut self, worker: WorkerKey) {
        self.workers.remove(&worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: WorkerKey = (1, 0);
    const B: WorkerKey = (2, 0);

    #[test]
    fn a_sum_halves_every_half_life() {
        let t0 = Instant::now();
        let mut w = RecentWork::new(Duration::from_secs(10));
        w.add(A, 1000, t0);
        assert_eq!(w.value(A, t0), 1000.0);
        let v = w.value(A, t0 + Duration::from_secs(10));
        assert!((v - 500.0).abs() < 1e-6, "{v}");
        let v = w.value(A, t0 + Duration::from_secs(30));
        assert!((v - 125.0).abs() < 1e-6, "{v}");
        // Reading does not change it.
        assert_eq!(w.value(A, t0), 1000.0);
        assert_eq!(w.value(B, t0), 0.0);
        // An instant before the last addition decays nothing (and does not grow the value).
        let t1 = t0 + Duration::from_secs(10);
        w.add(B, 1000, t1);
        assert_eq!(w.value(B, t0), 1000.0);
    }

    #[test]
    fn excess_is_above_the_least_of_the_workers_asked_about() {
        let t0 = Instant::now();
        let mut w = RecentWork::new(Duration::from_secs(60));
        w.add(A, 300, t0);
        w.add(B, 100, t0);
        assert_eq!(w.excess([A, B], t0), vec![200.0, 0.0]);
        // A worker never seen has done nothing: the others' whole work is excess.
        assert_eq!(w.excess([A, (3, 0)], t0), vec![300.0, 0.0]);
        w.drop_worker(A);
        assert_eq!(w.excess([A, B], t0), vec![0.0, 100.0]);
        assert_eq!((w.value(A, t0), w.value(B, t0)), (0.0, 100.0));
    }

    #[test]
    fn a_worker_joining_starts_level_with_the_least_worked() {
        let t0 = Instant::now();
        let mut w = RecentWork::new(Duration::from_secs(60));
        w.add(A, 300, t0);
        w.add(B, 100, t0);
        let c = (3, 0);
        w.start_level(c, [A, B, c].into_iter(), t0);
        assert_eq!(w.value(c, t0), 100.0);
        assert_eq!(w.excess([A, B, c], t0), vec![200.0, 0.0, 0.0]);
        // One already seen keeps its own; with a worker at 0 among the others, it starts at 0.
        w.start_level(A, [B].into_iter(), t0);
        assert_eq!(w.value(A, t0), 300.0);
        let d = (4, 0);
        w.start_level(d, [A, (5, 0)].into_iter(), t0);
        assert_eq!(w.value(d, t0), 0.0);
        w.start_level((6, 0), std::iter::empty(), t0);
        assert_eq!(w.value((6, 0), t0), 0.0);
    }

    #[test]
    fn a_zero_half_life_keeps_nothing() {
        let t0 = Instant::now();
        let mut w = RecentWork::new(Duration::ZERO);
        w.add(A, 1000, t0);
        assert_eq!(w.value(A, t0), 0.0);
    }

    proptest! {
        /// Against a model that keeps every addition and decays each on its own.
        #[test]
        fn matches_a_model_of_separately_decayed_additions(
            adds in proptest::collection::vec((0u8..3, 0u64..10_000, 0u64..20_000), 0..40),
            read_after_ms in 0u64..100_000,
        ) {
            let t0 = Instant::now();
            let hl = Duration::from_secs(5);
            let mut w = RecentWork::new(hl);
            let mut model: Vec<(WorkerKey, f64, Instant)> = Vec::new();
            let mut at = t0;
            for (worker, tokens, step_ms) in adds {
                at += Duration::from_millis(step_ms);
                let key = (u64::from(worker), 0);
                w.add(key, tokens, at);
                model.push((key, tokens as f64, at));
            }
            let now = at + Duration::from_millis(read_after_ms);
            for worker in 0u8..3 {
                let key = (u64::from(worker), 0);
                let expected: f64 = model
                    .iter()
                    .filter(|(k, _, _)| *k == key)
                    .map(|(_, v, t)| v * 0.5f64.powf((now - *t).as_secs_f64() / hl.as_secs_f64()))
                    .sum();
                let got = w.value(key, now);
                prop_assert!((got - expected).abs() <= 1e-6 * expected.max(1.0), "{got} vs {expected}");
            }
        }
    }
}
