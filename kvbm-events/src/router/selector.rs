//! The selector: the routing modes and their costs (DESIGN.md, "The router's cost").
//!
//! The cost modes share Dynamo's default cost (ai-dynamo/dynamo,
//! `lib/kv-router/src/scheduling/selector/default.rs`, `worker_logit`): for each worker,
//! `credit = overlap_score_credit * device + host_weight * host + disk_weight * disk` (blocks of
//! the request's prefix: `device` contiguous on the GPU, `host` and `disk` extending it tier by
//! tier), and `cost = prefill_load_scale * max(0, (active_prefill_tokens + input_tokens) /
//! block_size - credit) + active_decode_blocks + decode_active_request_weight *
//! active_requests`. Dynamo counts the new request's whole prompt in `raw_prefill_blocks` (its
//! cached part is taken off by the credit) and, for requests already routed, only the part of
//! their prompt not cached (`PrefillLoadHint::initial_effective_prefill_tokens`, from
//! `prefill_load::effective_prefill_tokens(isl, cached)` in `lib/kv-router/src/scheduling`);
//! [`crate::router::load::LoadTracker::routed_uncached`] counts the same. kvbm adds a balance
//! term, off by default: `prefill_load_scale * balance_weight * excess_work / block_size`, a
//! worker's recent work above the least of the candidates' ([`crate::router::work`]) counted as
//! queued prefill. The lowest cost wins,
//! ties broken at random; with a temperature `T > 0` a worker is drawn with weight
//! `exp(-(c - c_min) / ((c_max - c_min) * T))`.
//!
//! The modes ([`RouterMode`]) differ only in their weights, except round robin and random
//! (no cost) and `tuned` (a learned cost, [`crate::router::tune`]):
//! - `least-loaded`: every credit 0, `prefill_load_scale` 1: `prefill_blocks + decode_blocks`;
//! - `kv-gpu`: kvbm's fixed weights with the host and disk weights 0 (GPU overlap only);
//! - `kv`: kvbm's own fixed weights, [`KV_WEIGHTS`];
//! - `dynamo`: Dynamo's default weights, [`DYNAMO_WEIGHTS`].

use rand::Rng;

use crate::router::load::WorkerLoad;

/// A worker: its id and data-parallel rank.
pub type WorkerKey = (u64, u32);

/// How the router picks a worker (`--router-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RouterMode {
    /// Cycles over the eligible workers in key order.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// Lowest load, no cache credit.
    LeastLoaded,
    /// Dynamo's cost with GPU overlap only (host and disk weights 0).
    KvGpu,
    /// kvbm's fixed tier-aware weights ([`KV_WEIGHTS`]).
    Kv,
    /// Dynamo's default cost and weights ([`DYNAMO_WEIGHTS`]).
    Dynamo,
    /// The self-tuning cost ([`crate::router::tune`]); `kv`'s weights until it has evidence.
    Tuned,
}

/// The router's mode when `--router-mode` is not given: `kv`, the best fixed setting
/// `kvbm-bench replay` measured. `tuned` beat it at 8 workers (README, "Routing policies,
/// measured") but not at 16, where one run in three let a worker overload (its learned decode
/// cost caught up too late), so it is not the default.
pub const ROUTER_MODE_DEFAULT: RouterMode = RouterMode::Kv;

impl RouterMode {
    /// Every mode, in the order a comparison lists them.
    pub const ALL: [RouterMode; 7] = [
        RouterMode::RoundRobin,
        RouterMode::Random,
        RouterMode::LeastLoaded,
        RouterMode::KvGpu,
        RouterMode::Kv,
        RouterMode::Dynamo,
        RouterMode::Tuned,
    ];

    /// Its name on the command line and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            RouterMode::RoundRobin => "round-robin",
            RouterMode::Random => "random",
            RouterMode::LeastLoaded => "least-loaded",
            RouterMode::KvGpu => "kv-gpu",
            RouterMode::Kv => "kv",
            RouterMode::Dynamo => "dynamo",
            RouterMode::Tuned => "tuned",
        }
    }

    /// The weights the mode starts from when no weight flag is given.
    pub fn default_weights(self) -> Weights {
        match self {
            RouterMode::Kv | RouterMode::Tuned => KV_WEIGHTS,
            RouterMode::Dynamo => DYNAMO_WEIGHTS,
            RouterMode::KvGpu => Weights {
                host_weight: 0.0,
                disk_weight: 0.0,
                ..KV_WEIGHTS
            },
            RouterMode::LeastLoaded | RouterMode::RoundRobin | RouterMode::Random => Weights {
                prefill_load_scale: 1.0,
                overlap_score_credit: 0.0,
                host_weight: 0.0,
                disk_weight: 0.0,
            },
        }
    }

    /// Whether the mode's weights may be changed by the weight flags (round robin, random and
    /// least loaded have none; `kv-gpu` keeps host and disk at 0).
    pub fn takes_weights(self) -> bool {
        !matches!(
            self,
            RouterMode::RoundRobin | RouterMode::Random | RouterMode::LeastLoaded
        )
    }
}

impl std::fmt::Display for RouterMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for RouterMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RouterMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = RouterMode::ALL.iter().map(|m| m.name()).collect();
                format!("unknown router mode {s:?}; one of {}", names.join(", "))
            })
    }
}

/// The weights of the cost, named as Dynamo's router flags name them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// `--router-prefill-load-scale`: weight of the prefill term.
    pub prefill_load_scale: f64,
    /// `--router-kv-overlap-score-credit`: credit per block found on the GPU.
    pub overlap_score_credit: f64,
    /// `--router-host-cache-hit-weight`: credit per block found in pinned host memory.
    pub host_weight: f64,
    /// `--router-disk-cache-hit-weight`: credit per block found on disk.
    pub disk_weight: f64,
}

/// Dynamo's default weights (ai-dynamo/dynamo `lib/kv-router/src/scheduling/config.rs`:
/// `default_prefill_load_scale` 1.0, `overlap_score_credit` 1.0, `default_host_cache_hit_weight`
/// 0.75, `default_disk_cache_hit_weight` 0.25).
pub const DYNAMO_WEIGHTS: Weights = Weights {
    prefill_load_scale: 1.0,
    overlap_score_credit: 1.0,
    host_weight: 0.75,
    disk_weight: 0.25,
};

/// kvbm's own fixed weights (mode `kv`, and `tuned` until it has evidence): Dynamo's, with the
/// prefill term weighted 10 and a host hit worth a GPU hit, the best of the fixed settings
/// `kvbm-bench replay` measured on the Mooncake conversation trace (README, "Routing policies,
/// measured"): with Dynamo's 1.0 the decode term outweighs queued prefill and TTFT suffers, and
/// loading a block from pinned host memory costs a small fraction of computing it.
pub const KV_WEIGHTS: Weights = Weights {
    prefill_load_scale: 10.0,
    overlap_score_credit: 1.0,
    host_weight: 1.0,
    disk_weight: 0.25,
};

/// The default `--router-shared-cache-hit-weight`: a block a worker would load from a shared
/// pool over the network is worth less than one from its own disk (0.25).
pub const SHARED_WEIGHT_DEFAULT: f64 = 0.2;

/// The mode, weights and knobs, named as Dynamo's router flags name them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelectorConfig {
    /// `--router-mode`. Default [`ROUTER_MODE_DEFAULT`].
    pub mode: RouterMode,
    /// `--router-prefill-load-scale` (deprecated alias `--kv-overlap-score-weight`): weight of
    /// the prefill term. Default 1.0.
    pub prefill_load_scale: f64,
    /// `--router-kv-overlap-score-credit`: credit per GPU block. Default 1.0.
    pub overlap_score_credit: f64,
    /// `--router-decode-active-request-weight` (`DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT`):
    /// weight of each active request. Default 0.
    pub decode_active_request_weight: f64,
    /// `--router-host-cache-hit-weight`: credit per host block. Default 0.75.
    pub host_weight: f64,
    /// `--router-disk-cache-hit-weight`: credit per disk block. Default 0.25.
    pub disk_weight: f64,
    /// `--router-shared-cache-hit-weight`: credit per block of a shared pool the worker reaches,
    /// past its own tiers (kvbm's; Dynamo has no such flag). Default
    /// [`SHARED_WEIGHT_DEFAULT`] in the modes that weigh tiers, 0 in the others.
    pub shared_weight: f64,
    /// `--router-temperature`: 0 picks the lowest cost. Default 0.
    pub temperature: f64,
    /// `--router-balance-weight` (kvbm's; Dynamo has no such term): each token of a worker's
    /// recent work ([`crate::router::work`]) above the least of the candidates' counts as this
    /// many tokens of queued prefill, so that new conversations go where less work has been
    /// done lately and computed work evens out over a run. The cost adds whatever
    /// [`Candidate::excess_work`] the caller gives; kvbm-router gives none for a prompt one
    /// worker holds a quarter more of than another, so that a conversation stays with its
    /// cache. 0 leaves the term out.
    pub balance_weight: f64,
}

impl Default for SelectorConfig {
    fn default() -> Self {
        Self::for_mode(ROUTER_MODE_DEFAULT)
    }
}

/// How much of a request's prefix a worker holds, in blocks, tier by tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overlap {
    /// Contiguous prefix on the GPU.
    pub gpu: usize,
    /// Continuation in pinned host memory.
    pub host: usize,
    /// Continuation on disk.
    pub disk: usize,
    /// Continuation in a shared pool the worker reaches (beyond its own tiers).
    pub shared: usize,
}

/// One worker up for selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerKey,
    /// Its overlap with the request.
    pub overlap: Overlap,
    /// Its current load.
    pub load: WorkerLoad,
    /// Its recent work above the least of the candidates', in tokens (the balance term's input;
    /// 0 when the term is off).
    pub excess_work: f64,
}

/// The outcome: the chosen worker and every candidate's cost, lowest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The chosen worker.
    pub chosen: WorkerKey,
    /// (worker, cost), sorted by cost.
    pub costs: Vec<(WorkerKey, f64)>,
}

impl SelectorConfig {
    /// The mode with its default weights.
    pub fn for_mode(mode: RouterMode) -> Self {
        Self {
            mode,
            decode_active_request_weight: 0.0,
            temperature: 0.0,
            balance_weight: 0.0,
            ..Self::default_weights(mode)
        }
    }

    fn default_weights(mode: RouterMode) -> Self {
        let w = mode.default_weights();
        Self {
            mode,
            prefill_load_scale: w.prefill_load_scale,
            overlap_score_credit: w.overlap_score_credit,
            decode_active_request_weight: 0.0,
            host_weight: w.host_weight,
            disk_weight: w.disk_weight,
            shared_weight: if mode.takes_weights() && mode != RouterMode::KvGpu {
                SHARED_WEIGHT_DEFAULT
            } else {
                0.0
            },
            temperature: 0.0,
            balance_weight: 0.0,
        }
    }

    /// The mode with `weights`, as far as the mode takes them (`kv-gpu` keeps host and disk at
    /// 0; round robin, random and least loaded keep theirs).
    pub fn with_weights(mut self, weights: Weights) -> Self {
        if !self.mode.takes_weights() {
            return self;
        }
        self.prefill_load_scale = weights.prefill_load_scale;
        self.overlap_score_credit = weights.overlap_score_credit;
        if self.mode != RouterMode::KvGpu {
            self.host_weight = weights.host_weight;
            self.disk_weight = weights.disk_weight;
        }
        self
    }

    /// The weights in force.
    pub fn weights(&self) -> Weights {
        Weights {
            prefill_load_scale: self.prefill_load_scale,
            overlap_score_credit: self.overlap_score_credit,
            host_weight: self.host_weight,
            disk_weight: self.disk_weight,
        }
    }

    /// A candidate's credit, in blocks.
    pub fn credit(&self, overlap: Overlap) -> f64 {
        self.overlap_score_credit * overlap.gpu as f64
            + self.host_weight * overlap.host as f64
            + self.disk_weight * overlap.disk as f64
            + self.shared_weight * overlap.shared as f64
    }

    /// The prompt tokens of a request a worker would not find cached, as the load tracker
    /// counts them (Dynamo's `effective_prefill_tokens`: the prompt less its weighted credit).
    pub fn uncached_tokens(
        &self,
        overlap: Overlap,
        input_tokens: usize,
        block_size: usize,
    ) -> usize {
        let cached = (self.credit(overlap) * block_size as f64).max(0.0);
        input_tokens.saturating_sub((cached as usize).min(input_tokens))
    }

    /// A candidate's cost for a request of `input_tokens` with blocks of `block_size` tokens.
    pub fn cost(&self, candidate: &Candidate, input_tokens: usize, block_size: usize) -> f64 {
        let load = candidate.load;
        let bs = block_size.max(1) as f64;
        let prefill_blocks = (load.prefill_tokens + input_tokens) as f64 / bs;
        let balance = if self.balance_weight > 0.0 {
            self.prefill_load_scale * self.balance_weight * candidate.excess_work.max(0.0) / bs
        } else {
            0.0
        };
        self.prefill_load_scale * (prefill_blocks - self.credit(candidate.overlap)).max(0.0)
            + load.decode_blocks as f64
            + self.decode_active_request_weight * load.requests as f64
            + balance
    }
}

/// Round robin's place: the worker it picked last.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundRobin {
    last: Option<WorkerKey>,
}

impl RoundRobin {
    /// The next candidate after the last one picked, in key order (wrapping); None when there
    /// is no candidate.
    pub fn next(&mut self, candidates: &[Candidate]) -> Option<WorkerKey> {
        let after = |k: &WorkerKey| self.last.is_none_or(|l| *k > l);
        let next = candidates
            .iter()
            .map(|c| c.worker)
            .filter(after)
            .min()
            .or_else(|| candidates.iter().map(|c| c.worker).min())?;
        self.last = Some(next);
        Some(next)
    }
}

/// Picks a worker among `candidates` (at least one) for a request of `input_tokens`, by the
/// cost of `config`'s weights (whatever its mode).
pub fn select(
    config: &SelectorConfig,
    candidates: &[Candidate],
    input_tokens: usize,
    block_size: usize,
    rng: &mut impl Rng,
) -> Option<Selection> {
    let costs = candidates
        .iter()
        .map(|c| (c.worker, config.cost(c, input_tokens, block_size)))
        .collect();
    pick(costs, config.temperature, rng)
}

/// Picks a worker as `config.mode` says: round robin from `round_robin`'s place, random
/// uniformly, `tuned` by `tuned_cost` when the learner has one (else by `config`'s weights), the
/// others by [`select`]. Round robin's and random's costs are reported as 0.
pub fn select_mode(
    config: &SelectorConfig,
    candidates: &[Candidate],
    input_tokens: usize,
    block_size: usize,
    rng: &mut impl Rng,
    round_robin: &mut RoundRobin,
    tuned_cost: Option<&dyn Fn(&Candidate) -> f64>,
) -> Option<Selection> {
    match config.mode {
        RouterMode::RoundRobin => {
            let chosen = round_robin.next(candidates)?;
            let mut costs: Vec<(WorkerKey, f64)> =
                candidates.iter().map(|c| (c.worker, 0.0)).collect();
            costs.sort_by_key(|(w, _)| (*w != chosen, *w));
            Some(Selection { chosen, costs })
        }
        RouterMode::Random => pick(
            candidates.iter().map(|c| (c.worker, 0.0)).collect(),
            0.0,
            rng,
        ),
        RouterMode::Tuned if tuned_cost.is_some() => {
            let cost = tuned_cost.expect("checked");
            let costs = candidates.iter().map(|c| (c.worker, cost(c))).collect();
            pick(costs, config.temperature, rng)
        }
        _ => select(config, candidates, input_tokens, block_size, rng),
    }
}

/// Picks the lowest of `costs` (ties at random), or draws by temperature.
pub fn pick(
    mut costs: Vec<(WorkerKey, f64)>,
    temperature: f64,
    rng: &mut impl Rng,
) -> Option<Selection> {
    if costs.is_empty() {
        return None;
    }
    costs.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    let (c_min, c_max) = (costs[0].1, costs[costs.len() - 1].1);
    let chosen = if temperature > 0.0 && c_max > c_min && (c_max - c_min).is_finite() {
        let weights: Vec<f64> = costs
            .iter()
            .map(|(_, c)| (-(c - c_min) / ((c_max - c_min) * temperature)).exp())
            .collect();
        let mut draw = rng.gen::<f64>() * weights.iter().sum::<f64>();
        let mut pick = costs.len() - 1;
        for (i, w) in weights.iter().enumerate() {
            if draw < *w {
                pick = i;
                break;
            }
            draw -= w;
        }
        costs[pick].0
    } else {
        let tied = costs.iter().take_while(|(_, c)| *c == c_min).count().max(1);
        costs[rng.gen_range(0..tied)].0
    };
    Some(Selection { chosen, costs })
}
