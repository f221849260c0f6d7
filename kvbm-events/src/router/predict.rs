//! Predicted blocks: a routing decision counts the request's blocks as present on the chosen
//! worker's GPU for a while (Dynamo's `--router-predicted-ttl-secs`), so that a burst of sibling
//! requests (best-of-N, agent fan-out) lands together before the worker's events arrive.
//!
//! Invariants:
//! - A prediction lives until its time-to-live passes or the worker's own store of that block is
//!   applied (the index then knows it, and a later removal must not be masked by a guess).
//! - At most `entries_max` predictions are kept; beyond that new ones are dropped and counted.
//! - A prediction never lowers what the index says: a worker's GPU overlap is the longer of the
//!   indexed and the predicted prefix, and its lower tiers continue from there.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::router::selector::{Overlap, WorkerKey};

/// Predictions kept at most by default.
pub const PREDICTIONS_MAX_DEFAULT: usize = 1 << 20;

/// The predicted blocks of every worker.
#[derive(Debug)]
pub struct Predictions {
    ttl: Duration,
    entries_max: usize,
    /// Per worker, the predicted sequence hashes and when each expires.
    by_worker: HashMap<WorkerKey, HashMap<u64, Instant>>,
    /// Expiries in the order they were set (refreshes leave stale entries, skipped on expiry).
    queue: VecDeque<(Instant, WorkerKey, u64)>,
    len: usize,
    dropped: u64,
}

impl Predictions {
    /// Predictions living `ttl` (zero: off), at most `entries_max`.
    pub fn new(ttl: Duration, entries_max: usize) -> Self {
        Self {
            ttl,
            entries_max,
            by_worker: HashMap::new(),
            queue: VecDeque::new(),
            len: 0,
            dropped: 0,
        }
    }

    /// Whether predictions are made at all.
    pub fn enabled(&self) -> bool {
        !self.ttl.is_zero()
    }

    /// Predictions alive.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when none is alive.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Predictions dropped because `entries_max` were alive.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// `worker` was chosen for a request of `hashes`: they count as on its GPU until `now + ttl`.
    pub fn predict(&mut self, worker: WorkerKey, hashes: &[u64], now: Instant) {
        if !self.enabled() || hashes.is_empty() {
            return;
        }
        self.expire(now);
        let until = now + self.ttl;
        let mine = self.by_worker.entry(worker).or_default();
        for &h in hashes {
            match mine.get_mut(&h) {
                Some(t) => *t = until,
                None if self.len >= self.entries_max => {
                    self.dropped += 1;
                    continue;
                }
                None => {
                    mine.insert(h, until);
                    self.len += 1;
                }
            }
            self.queue.push_back((until, worker, h));
        }
        if self.queue.len() > 2 * self.entries_max.max(1) {
            // Refreshes piled up stale queue entries: rebuild the queue from what is alive.
            let mut live: Vec<(Instant, WorkerKey, u64)> = self
                .by_worker
                .iter()
                .flat_map(|(&w, m)| m.iter().map(move |(&h, &t)| (t, w, h)))
                .collect();
            live.sort_unstable_by_key(|e| e.0);
            self.queue = live.into();
        }
    }

    /// The worker stored these blocks itself: they are no longer predictions.
    pub fn confirm(&mut self, worker: WorkerKey, hashes: &[u64]) {
        let Some(mine) = self.by_worker.get_mut(&worker) else {
            return;
        };
        for h in hashes {
            if mine.remove(h).is_some() {
                self.len -= 1;
            }
        }
        if mine.is_empty() {
            self.by_worker.remove(&worker);
        }
    }

    /// Forgets a worker's predictions (unregistered, restarted, cleared).
    pub fn forget(&mut self, worker: WorkerKey) {
        if let Some(mine) = self.by_worker.remove(&worker) {
            self.len -= mine.len();
        }
    }

    /// Drops what expired by `now`.
    pub fn expire(&mut self, now: Instant) {
        while let Some(&(until, worker, h)) = self.queue.front() {
            if until > now {
                break;
            }
            self.queue.pop_front();
            if let Some(mine) = self.by_worker.get_mut(&worker) {
                if mine.get(&h).is_some_and(|&t| t <= now) {
                    mine.remove(&h);
                    self.len -= 1;
                    if mine.is_empty() {
                        self.by_worker.remove(&worker);
                    }
                }
            }
        }
    }

    /// How many of `hashes`, from the first, are predicted on `worker` and alive at `now`.
    pub fn prefix(&self, worker: WorkerKey, hashes: &[u64], now: Instant) -> usize {
        let Some(mine) = self.by_worker.get(&worker) else {
            return 0;
        };
        hashes
            .iter()
            .take_while(|h| mine.get(h).is_some_and(|&t| t > now))
            .count()
    }

    /// Workers with predictions alive.
    pub fn workers(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.by_worker.keys().copied()
    }
}

/// `indexed` with the first `predicted` blocks counted on the GPU: the GPU overlap is the longer
/// of the two, and the indexed host, disk and shared continuations go on after it.
pub fn with_prediction(indexed: Overlap, predicted: usize) -> Overlap {
    if predicted <= indexed.gpu {
        return indexed;
    }
    let host_end = indexed.gpu + indexed.host;
    let disk_end = host_end + indexed.disk;
    let shared_end = disk_end + indexed.shared;
    Overlap {
        gpu: predicted,
        host: host_end.saturating_sub(predicted),
        disk: disk_end.saturating_sub(predicted.max(host_end)),
        shared: shared_end.saturating_sub(predicted.max(disk_end)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predictions_expire_are_confirmed_and_never_lower_the_index() {
        let w = (1, 0);
        let t0 = Instant::now();
        let mut p = Predictions::new(Duration::from_secs(10), 100);
        p.predict(w, &[1, 2, 3], t0);
        assert_eq!(p.prefix(w, &[1, 2, 3, 4], t0), 3);
        assert_eq!(p.prefix((2, 0), &[1, 2, 3], t0), 0);
        p.confirm(w, &[2]);
        assert_eq!(p.prefix(w, &[1, 2, 3], t0), 1);
        // Refreshed by a later decision, it outlives the first one's expiry.
        p.predict(w, &[1], t0 + Duration::from_secs(5));
        p.expire(t0 + Duration::from_secs(11));
        assert_eq!(p.prefix(w, &[1, 3], t0 + Duration::from_secs(11)), 1);
        assert_eq!(p.len(), 1);
        p.expire(t0 + Duration::from_secs(16));
        assert!(p.is_empty());
        // Bounded.
        let mut small = Predictions::new(Duration::from_secs(10), 2);
        small.predict(w, &[1, 2, 3], t0);
        assert_eq!((small.len(), small.dropped()), (2, 1));
        // Off.
        let mut off = Predictions::new(Duration::ZERO, 10);
        off.predict(w, &[1], t0);
        assert!(off.is_empty());
        // Combining with the index.
        let o = Overlap {
            gpu: 2,
            host: 3,
            disk: 1,
            shared: 2,
        };
        assert_eq!(with_prediction(o, 1), o);
        assert_eq!(
            with_prediction(o, 4),
            Overlap {
                gpu: 4,
                host: 1,
                disk: 1,
                shared: 2,
            }
        );
        assert_eq!(
            with_prediction(o, 7),
            Overlap {
                gpu: 7,
                host: 0,
                disk: 0,
                shared: 1,
            }
        );
        assert_eq!(
            with_prediction(o, 9),
            Overlap {
                gpu: 9,
                ..Overlap::default()
            }
        );
    }
}
