//! The selector: Dynamo's default routing cost, reproduced (DESIGN.md, "The router's cost").
//!
//! For each worker, `credit = device + host_weight * host + disk_weight * disk` (blocks of the
//! request's prefix: `device` contiguous on the GPU, `host` and `disk` extending it tier by tier),
//! and `cost = prefill_load_scale * max(0, (active_prefill_tokens + input_tokens) / block_size -
//! credit) + active_decode_blocks + decode_active_request_weight * active_requests`. The lowest
//! cost wins, ties broken at random; with a temperature `T > 0` a worker is drawn with weight
//! `exp(-(c - c_min) / ((c_max - c_min) * T))`.

use rand::Rng;

use crate::router::load::WorkerLoad;

/// A worker: its id and data-parallel rank.
pub type WorkerKey = (u64, u32);

/// The weights and knobs, named as Dynamo's router flags name them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelectorConfig {
    /// `--kv-overlap-score-weight`: weight of the prefill term. Default 1.0.
    pub prefill_load_scale: f64,
    /// `--router-decode-active-request-weight` (`DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT`):
    /// weight of each active request. Default 0.
    pub decode_active_request_weight: f64,
    /// `--router-host-cache-hit-weight`: credit per host block. Default 0.75.
    pub host_weight: f64,
    /// `--router-disk-cache-hit-weight`: credit per disk block. Default 0.25.
    pub disk_weight: f64,
    /// `--router-temperature`: 0 picks the lowest cost. Default 0.
    pub temperature: f64,
}

impl Default for SelectorConfig {
    fn default() -> Self {
        Self {
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            host_weight: 0.75,
            disk_weight: 0.25,
            temperature: 0.0,
        }
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
    /// A candidate's credit, in blocks.
    pub fn credit(&self, overlap: Overlap) -> f64 {
        overlap.gpu as f64
            + self.host_weight * overlap.host as f64
            + self.disk_weight * overlap.disk as f64
    }

    /// A candidate's cost for a request of `input_tokens` with blocks of `block_size` tokens.
    pub fn cost(&self, candidate: &Candidate, input_tokens: usize, block_size: usize) -> f64 {
        let load = candidate.load;
        let prefill_blocks = (load.prefill_tokens + input_tokens) as f64 / block_size.max(1) as f64;
        self.prefill_load_scale * (prefill_blocks - self.credit(candidate.overlap)).max(0.0)
            + load.decode_blocks as f64
            + self.decode_active_request_weight * load.requests as f64
    }
}

/// Picks a worker among `candidates` (at least one) for a request of `input_tokens`.
pub fn select(
    config: &SelectorConfig,
    candidates: &[Candidate],
    input_tokens: usize,
    block_size: usize,
    rng: &mut impl Rng,
) -> Option<Selection> {
    if candidates.is_empty() {
        return None;
    }
    let mut costs: Vec<(WorkerKey, f64)> = candidates
        .iter()
        .map(|c| (c.worker, config.cost(c, input_tokens, block_size)))
        .collect();
    costs.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    let (c_min, c_max) = (costs[0].1, costs[costs.len() - 1].1);
    let chosen = if config.temperature > 0.0 && c_max > c_min {
        let weights: Vec<f64> = costs
            .iter()
            .map(|(_, c)| (-(c - c_min) / ((c_max - c_min) * config.temperature)).exp())
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
        let tied = costs.iter().take_while(|(_, c)| *c == c_min).count();
        costs[rng.gen_range(0..tied)].0
    };
    Some(Selection { chosen, costs })
}
