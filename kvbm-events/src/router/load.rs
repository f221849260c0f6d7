//! The load of routed requests per worker: prefill tokens until the first token is reported,
//! decode blocks until the request finishes, and a time-to-live for callers that never report.
//!
//! Invariants: each worker's load is the sum over its tracked requests; a request is tracked
//! once (routing an id again replaces it); an expired or finished request leaves no load.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::router::selector::WorkerKey;

/// How long a routed request counts when its caller never reports it finished.
pub const REQUEST_TTL_DEFAULT: Duration = Duration::from_secs(600);

/// A caller's request id.
pub type RequestId = String;

/// One worker's current load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerLoad {
    /// Prompt tokens of requests still in prefill.
    pub prefill_tokens: usize,
    /// KV blocks of requests in decode.
    pub decode_blocks: usize,
    /// Requests routed and not finished.
    pub requests: usize,
}

#[derive(Debug, Clone)]
struct Tracked {
    worker: WorkerKey,
    input_tokens: usize,
    /// The part of the prompt the worker computes (not found in its cache).
    prefill_tokens: usize,
    block_size: usize,
    decoding: bool,
    expires: Instant,
}

impl Tracked {
    fn load(&self) -> WorkerLoad {
        if self.decoding {
            WorkerLoad {
                prefill_tokens: 0,
                decode_blocks: self.input_tokens.div_ceil(self.block_size.max(1)),
                requests: 1,
            }
        } else {
            WorkerLoad {
                prefill_tokens: self.prefill_tokens,
                decode_blocks: 0,
                requests: 1,
            }
        }
    }
}

/// Tracks routed requests and each worker's load.
#[derive(Debug)]
pub struct LoadTracker {
    ttl: Duration,
    requests: HashMap<RequestId, Tracked>,
    loads: HashMap<WorkerKey, WorkerLoad>,
}

impl LoadTracker {
    /// A tracker whose requests expire `ttl` after their last report.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            requests: HashMap::new(),
            loads: HashMap::new(),
        }
    }

    fn add(&mut self, worker: WorkerKey, load: WorkerLoad) {
        let l = self.loads.entry(worker).or_default();
        l.prefill_tokens += load.prefill_tokens;
        l.decode_blocks += load.decode_blocks;
        l.requests += load.requests;
    }

    fn sub(&mut self, worker: WorkerKey, load: WorkerLoad) {
        if let Some(l) = self.loads.get_mut(&worker) {
            l.prefill_tokens -= load.prefill_tokens;
            l.decode_blocks -= load.decode_blocks;
            l.requests -= load.requests;
            if l.requests == 0 {
                self.loads.remove(&worker);
            }
        }
    }

    /// A request of `input_tokens` was routed to `worker`: its whole prompt counts as prefill
    /// load.
    pub fn routed(
        &mut self,
        id: RequestId,
        worker: WorkerKey,
        input_tokens: usize,
        block_size: usize,
        now: Instant,
    ) {
        self.routed_uncached(id, worker, input_tokens, input_tokens, block_size, now);
    }

    /// A request of `input_tokens` was routed to `worker`, which holds all of its prompt but
    /// `prefill_tokens` (at most `input_tokens`): those count as prefill load (as Dynamo counts
    /// a routed request's `initial_effective_prefill_tokens`), the whole prompt as decode load
    /// once its first token is out.
    pub fn routed_uncached(
        &mut self,
        id: RequestId,
        worker: WorkerKey,
        input_tokens: usize,
        prefill_tokens: usize,
        block_size: usize,
        now: Instant,
    ) {
        self.finished(&id);
        let tracked = Tracked {
            worker,
            input_tokens,
            prefill_tokens: prefill_tokens.min(input_tokens),
            block_size,
            decoding: false,
            expires: now + self.ttl,
        };
        self.add(worker, tracked.load());
        self.requests.insert(id, tracked);
    }

    /// The request produced its first token: its load moves from prefill to decode. False for an
    /// unknown id.
    pub fn first_token(&mut self, id: &str, now: Instant) -> bool {
        let Some(tracked) = self.requests.get(id).cloned() else {
            return false;
        };
        if !tracked.decoding {
            self.sub(tracked.worker, tracked.load());
            let decoding = Tracked {
                decoding: true,
                expires: now + self.ttl,
                ..tracked
            };
            self.add(decoding.worker, decoding.load());
            self.requests.insert(id.to_owned(), decoding);
        }
        true
    }

    /// The request finished: it leaves no load. False for an unknown id.
    pub fn finished(&mut self, id: &str) -> bool {
        let Some(tracked) = self.requests.remove(id) else {
            return false;
        };
        self.sub(tracked.worker, tracked.load());
        true
    }

    /// Forgets requests not reported within the time-to-live; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let stale: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, t)| t.expires <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            self.finished(id);
        }
        stale.len()
    }

    /// Forgets every request routed to `worker` (it left or restarted).
    pub fn drop_worker(&mut self, worker: WorkerKey) {
        self.requests.retain(|_, t| t.worker != worker);
        self.loads.remove(&worker);
    }

    /// A worker's load now.
    pub fn load(&self, worker: WorkerKey) -> WorkerLoad {
        self.loads.get(&worker).copied().unwrap_or_default()
    }

    /// Requests tracked.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// True when no request is tracked.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
}
