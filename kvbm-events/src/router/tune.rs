//! The self-tuning cost (`--router-mode tuned`): the router learns, per worker, what a request's
//! time to first token (TTFT) and its decodes' time per output token (TPOT) cost there, from what
//! its own front end observes, and routes to the lowest predicted cost.
//!
//! Models, fitted online per worker and fleet-wide:
//! - `ttft ≈ c0 + c_compute · (pending_compute + compute) + c_host · host + c_disk · disk +
//!   c_dec · decode_blocks`, in tokens (`pending_compute`: the worker's prefill load at routing
//!   time, prompt tokens it has to compute; `compute`: this prompt's tokens in no tier of the
//!   worker; `host`/`disk`: its tokens loaded from those tiers; `decode_blocks`: the worker's
//!   decode load);
//! - `tpot ≈ d0 + d1 · decode_blocks`.
//!
//! Fit: recursive least squares with forgetting factor [`FORGETTING`] (features in thousands of
//! tokens or blocks so that the matrix stays well conditioned); its covariance is kept
//! symmetric and its trace bounded (no wind-up in directions never excited, e.g. a fleet without
//! disk hits), and a fit that goes non-finite starts over. A worker's coefficients are its fit
//! pooled with the fleet's, weighted `n / (n + PRIOR_OBSERVATIONS)` by its own observations, then
//! clamped (non-negative; a host or disk token costs at most a computed one; a computed token at
//! least [`C_COMPUTE_MIN`]) and published through an exponential smoothing of rate
//! [`SMOOTHING`] per observation: the weights in use move smoothly, whatever one observation
//! says.
//!
//! Warm-up: until the fleet has [`WARMUP_OBSERVATIONS`] TTFT observations, [`Tuner::ready`] is
//! false and the router uses `kv`'s fixed weights (a learned cost, in seconds, and a weighted
//! cost, in blocks, do not compare, so the switch is fleet-wide; a new worker then takes the
//! fleet's fit until its own observations outweigh it).
//!
//! Robustness: an observation that is not finite, negative, or past [`TTFT_MAX_SECS`] is refused
//! (counted); once warm, one above [`OUTLIER_FACTOR`] × its prediction (at least
//! [`CLIP_FLOOR_SECS`]) is clipped there (counted).
//! A worker that leaves is forgotten ([`Tuner::forget`]).
//!
//! The cost of a worker for a request (seconds): its predicted TTFT there, plus the slowdown the
//! request brings to the worker's running decodes: `d1 · request_blocks · running_requests ·
//! remaining`, where `remaining` is half the mean observed completion length (a running decode
//! is, on average, halfway), capped at [`REMAINING_TOKENS_MAX`], and the whole term capped at
//! [`DECODE_PENALTY_MAX_SECS`] and at [`DECODE_PENALTY_SHARE`] of the predicted TTFT, so that a noisy
//! TPOT fit cannot outweigh the TTFT it is added to.
//!
//! The externality (`--router-tuned-externality`, factor `e`, default
//! [`EXTERNALITY_DEFAULT`]): the predicted TTFT is the request's own; the prefill it adds to the
//! worker delays every request queued there after it. The cost adds `e` times the request's own
//! service time there (`c_compute · compute + c_host · host + c_disk · disk`), so that a choice
//! that saves compute is credited for what it saves the requests behind it, not only itself. At
//! `e = 0` the router minimizes each request's own predicted TTFT (greedy).
//!
//! Bounded loads (`--router-tuned-load-bound`, `b`, default [`LOAD_BOUND_DEFAULT`]; 0: off): a
//! worker holding `ceil((1 + b) · (R + 1) / n)` or more of the `R` routed requests in flight
//! over `n` candidates is not chosen while another is (the bound of consistent hashing with
//! bounded loads). The learned cost sees a worker's queue through its features; past the
//! engine's running-sequence cap, requests wait for a slot, which no linear feature shows, so
//! without a bound a worker whose cached prefixes draw requests can overload before its fit
//! catches up.
//!
//! In Dynamo's terms (fleet fit): `prefill_load_scale = c_compute · block_size / c_dec`,
//! `host_cache_hit_weight = 1 − c_host / c_compute`, `disk_cache_hit_weight = 1 − c_disk /
//! c_compute` (clamped to [0, 1]; `prefill_load_scale` to [0, [`PREFILL_LOAD_SCALE_MAX`]]).

use std::collections::{HashMap, VecDeque};

use crate::router::selector::{Candidate, WorkerKey};

/// Fleet observations before the learned cost is used.
pub const WARMUP_OBSERVATIONS: u64 = 50;
/// RLS forgetting factor: an observation's weight halves after about 140 newer ones.
pub const FORGETTING: f64 = 0.995;
/// Observations of the fleet's fit a worker's own are weighed against.
pub const PRIOR_OBSERVATIONS: f64 = 20.0;
/// Fraction of the way from the published coefficients to the fitted ones taken per observation.
pub const SMOOTHING: f64 = 0.05;
/// An observation above this many times its prediction is clipped there.
pub const OUTLIER_FACTOR: f64 = 10.0;
/// Longest TTFT taken as evidence.
pub const TTFT_MAX_SECS: f64 = 3600.0;
/// Longest TPOT taken as evidence.
pub const TPOT_MAX_SECS: f64 = 60.0;
/// Least cost of a computed token, in seconds (a billion tokens per second: never binding for a
/// real or simulated worker, but keeps the ratios finite).
pub const C_COMPUTE_MIN: f64 = 1e-9;
/// Predictions below this (seconds) do not set the clipping level: a model that still
/// underestimates everything must be able to learn upward.
pub const CLIP_FLOOR_SECS: f64 = 0.01;
/// Bound of the decode slowdown term of the cost, in seconds.
pub const DECODE_PENALTY_MAX_SECS: f64 = 2.0;
/// Bound of the decode slowdown term as a share of the predicted TTFT it is added to. Measured
/// (`kvbm-bench replay`, Mooncake conversation trace, 8 workers): bounded by 2 s alone, the term
/// sat at its bound on every busy worker and steered requests toward decode balance, at the cost
/// of TTFT (p90 2.3× the best fixed setting's); as a tie-breaker it leaves TTFT in charge.
pub const DECODE_PENALTY_SHARE: f64 = 0.1;
/// Bound of a running decode's expected remaining tokens.
pub const REMAINING_TOKENS_MAX: f64 = 512.0;
/// Bound of the Dynamo-equivalent `prefill_load_scale`.
pub const PREFILL_LOAD_SCALE_MAX: f64 = 1000.0;
/// Default weight of a request's own service time in its cost (see the module's text). In a
/// single queue at utilization `ρ`, a unit of service delays the work that queues after it by
/// about `ρ / (1 − ρ)` units in all: 1 at half load, 3 at three quarters. Measured (`kvbm-bench
/// replay`, Mooncake conversation trace, 8 workers at offered load 1.1×, medians of 3 rounds):
/// p90 TTFT 5.1 s at 0, 3.7 s at 1, 3.0 s at 3; `kv`'s fixed weights 4.6 s.
pub const EXTERNALITY_DEFAULT: f64 = 3.0;
/// Largest accepted externality weight.
pub const EXTERNALITY_MAX: f64 = 100.0;
/// Default bound on a worker's requests in flight over an even share (see the module's text):
/// off. Measured at 0.25 (`kvbm-bench replay`, Mooncake conversation trace, medians of 3 rounds):
/// it kept a 16-worker fleet from the overload the unbounded cost fell into once in three runs,
/// but its p90 TTFT was 1.6× `kv`'s at 16 workers and 2.3× at 8.
pub const LOAD_BOUND_DEFAULT: f64 = 0.0;
/// Largest accepted load bound.
pub const LOAD_BOUND_MAX: f64 = 100.0;
/// How much faster than the fleet a worker's own fit may make it look: its per-token and
/// per-block costs are floored at the fleet's divided by this. A worker's fit comes from the
/// requests it was given; one that underestimates its own cost (say, from a run of cache hits)
/// draws more requests than it can serve before its observations catch up, and past the
/// engine's running-sequence cap no feature shows the queue. Measured (`kvbm-bench replay`,
/// Mooncake conversation trace, 16 workers): without a floor, one run in three had one worker
/// draw a sixth of all requests (p90 TTFT 160 s); with it, three runs of three stayed at p90
/// 2.2-2.8 s (`kv`: 1.5 s in the same run). Twice the fleet's speed covers a fleet that mixes
/// GPU generations one apart.
pub const WORKER_SPEEDUP_MAX: f64 = 2.0;
/// Residuals kept per worker for the debug view.
pub const RESIDUALS_KEPT: usize = 16;

/// Features are in thousands of tokens or blocks.
const UNIT: f64 = 1000.0;
/// Initial covariance (and bound of its trace per dimension).
const P_INIT: f64 = 100.0;
/// Bounds of the raw coefficients published, per thousand tokens or blocks (seconds).
const C0_MAX: f64 = 600.0;
const C_PER_K_MAX: f64 = 1000.0;
/// Rate of the running mean of absolute errors and of completion lengths (a plain mean over the
/// first 1 / EMA_RATE observations).
const EMA_RATE: f64 = 0.02;

/// Moves the running mean `mean` of `n` observations (this one included) toward `v`.
fn running_mean(mean: &mut f64, n: u64, v: f64) {
    let rate = (1.0 / n.max(1) as f64).max(EMA_RATE);
    *mean += rate * (v - *mean);
}

/// What the router knew of a request and its worker when it routed it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteFeatures {
    /// The worker's prefill load then: prompt tokens it had to compute.
    pub pending_compute_tokens: usize,
    /// This prompt's tokens in none of the worker's tiers.
    pub compute_tokens: usize,
    /// Its tokens found in the worker's pinned host memory.
    pub host_tokens: usize,
    /// Its tokens found on the worker's disk.
    pub disk_tokens: usize,
    /// The worker's decode load then, in blocks.
    pub decode_blocks: usize,
    /// Requests the worker was running then.
    pub requests: usize,
    /// The request's blocks.
    pub request_blocks: usize,
}

impl RouteFeatures {
    /// The features of routing a request of `input_tokens` to `candidate`.
    pub fn of(candidate: &Candidate, input_tokens: usize, block_size: usize) -> Self {
        let o = candidate.overlap;
        let bs = block_size.max(1);
        let gpu = o.gpu.saturating_mul(bs).min(input_tokens);
        let host = o.host.saturating_mul(bs).min(input_tokens - gpu);
        let disk = o.disk.saturating_mul(bs).min(input_tokens - gpu - host);
        Self {
            pending_compute_tokens: candidate.load.prefill_tokens,
            compute_tokens: input_tokens - gpu - host - disk,
            host_tokens: host,
            disk_tokens: disk,
            decode_blocks: candidate.load.decode_blocks,
            requests: candidate.load.requests,
            request_blocks: input_tokens.div_ceil(bs),
        }
    }

    fn ttft_x(&self) -> [f64; 5] {
        [
            1.0,
            (self.pending_compute_tokens as f64 + self.compute_tokens as f64) / UNIT,
            self.host_tokens as f64 / UNIT,
            self.disk_tokens as f64 / UNIT,
            self.decode_blocks as f64 / UNIT,
        ]
    }
}

/// Recursive least squares with forgetting, in `N` dimensions.
#[derive(Debug, Clone)]
struct Rls<const N: usize> {
    theta: [f64; N],
    p: [[f64; N]; N],
}

impl<const N: usize> Rls<N> {
    fn new() -> Self {
        let mut p = [[0.0; N]; N];
        for (i, row) in p.iter_mut().enumerate() {
            row[i] = P_INIT;
        }
        Self { theta: [0.0; N], p }
    }

    fn predict(&self, x: &[f64; N]) -> f64 {
        self.theta.iter().zip(x).map(|(t, x)| t * x).sum()
    }

    fn update(&mut self, x: &[f64; N], y: f64) {
        let mut px = [0.0; N];
        for (i, v) in px.iter_mut().enumerate() {
            *v = (0..N).map(|j| self.p[i][j] * x[j]).sum();
        }
        let denom = FORGETTING + x.iter().zip(&px).map(|(a, b)| a * b).sum::<f64>();
        if !(denom.is_finite() && denom > 0.0) {
            *self = Self::new();
            return;
        }
        let err = y - self.predict(x);
        for (t, k) in self.theta.iter_mut().zip(&px) {
            *t += k / denom * err;
        }
        for (row, pi) in self.p.iter_mut().zip(&px) {
            for (v, pj) in row.iter_mut().zip(&px) {
                *v = (*v - pi * pj / denom) / FORGETTING;
            }
        }
        // Symmetric, positive on the diagonal, and bounded: directions no observation excites
        // would otherwise grow by 1/FORGETTING at each step.
        let mut trace = 0.0;
        for i in 0..N {
            self.p[i][i] = self.p[i][i].max(1e-9);
            trace += self.p[i][i];
            for j in 0..i {
                let m = 0.5 * (self.p[i][j] + self.p[j][i]);
                self.p[i][j] = m;
                self.p[j][i] = m;
            }
        }
        let cap = P_INIT * N as f64;
        if trace > cap {
            let s = cap / trace;
            self.p.iter_mut().flatten().for_each(|v| *v *= s);
        }
        let finite = self.theta.iter().all(|t| t.is_finite())
            && self.p.iter().flatten().all(|v| v.is_finite());
        if !finite {
            *self = Self::new();
        }
    }
}

/// `v` clamped to `0..=max`, or `default` when it is not finite.
fn finite_in(v: f64, max: f64, default: f64) -> f64 {
    if v.is_finite() {
        v.clamp(0.0, max)
    } else {
        default
    }
}

/// Coefficients in use, per token or block (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Coefficients {
    /// Fixed part of the TTFT.
    pub c0: f64,
    /// Per prompt token computed (the worker's pending ones and the request's).
    pub c_compute: f64,
    /// Per prompt token loaded from pinned host memory.
    pub c_host: f64,
    /// Per prompt token loaded from disk.
    pub c_disk: f64,
    /// Per decode block of the worker's load.
    pub c_dec: f64,
    /// Fixed part of the TPOT.
    pub d0: f64,
    /// TPOT per decode block of the worker's load.
    pub d1: f64,
}

impl Coefficients {
    /// Clamped from raw fits (per thousand).
    fn from_fit(ttft: &[f64; 5], tpot: &[f64; 2]) -> Self {
        let k = |v: f64| v.clamp(0.0, C_PER_K_MAX) / UNIT;
        let c_compute = k(ttft[1]).max(C_COMPUTE_MIN);
        Self {
            c0: ttft[0].clamp(0.0, C0_MAX),
            c_compute,
            c_host: k(ttft[2]).min(c_compute),
            c_disk: k(ttft[3]).min(c_compute),
            c_dec: k(ttft[4]),
            d0: tpot[0].clamp(0.0, TPOT_MAX_SECS),
            d1: k(tpot[1]),
        }
    }

    /// These coefficients with each cost of work (`c0`, `c_compute`, `c_dec`, `d0`, `d1`) at
    /// least `fleet`'s divided by `speedup` (the loads, `c_host` and `c_disk`, stay at most
    /// `c_compute`).
    fn floored(mut self, fleet: &Self, speedup: f64) -> Self {
        let floor = |a: &mut f64, b: f64| *a = a.max(b / speedup);
        floor(&mut self.c0, fleet.c0);
        floor(&mut self.c_compute, fleet.c_compute);
        floor(&mut self.c_dec, fleet.c_dec);
        floor(&mut self.d0, fleet.d0);
        floor(&mut self.d1, fleet.d1);
        self
    }

    fn smooth_toward(&mut self, target: &Self) {
        let step = |a: &mut f64, b: f64| *a += SMOOTHING * (b - *a);
        step(&mut self.c0, target.c0);
        step(&mut self.c_compute, target.c_compute);
        step(&mut self.c_host, target.c_host);
        step(&mut self.c_disk, target.c_disk);
        step(&mut self.c_dec, target.c_dec);
        step(&mut self.d0, target.d0);
        step(&mut self.d1, target.d1);
        // Each is a convex mix of clamped values; the order constraints hold too, but the
        // smoothing of c_compute and c_host separately could cross by rounding.
        self.c_host = self.c_host.min(self.c_compute);
        self.c_disk = self.c_disk.min(self.c_compute);
    }

    /// Predicted TTFT of a request with `f` (seconds).
    pub fn ttft(&self, f: &RouteFeatures) -> f64 {
        self.c0
            + self.c_compute * (f.pending_compute_tokens as f64 + f.compute_tokens as f64)
            + self.c_host * f.host_tokens as f64
            + self.c_disk * f.disk_tokens as f64
            + self.c_dec * f.decode_blocks as f64
    }

    /// Predicted time the request itself occupies the worker's prefill (seconds): its computed
    /// tokens and its loads, without the queue ahead of it.
    pub fn service(&self, f: &RouteFeatures) -> f64 {
        self.c_compute * f.compute_tokens as f64
            + self.c_host * f.host_tokens as f64
            + self.c_disk * f.disk_tokens as f64
    }

    /// Dynamo's weights that rank workers as these coefficients do (see the module's text).
    pub fn dynamo_weights(&self, block_size: usize) -> DynamoEquivalent {
        let c = self.c_compute.max(C_COMPUTE_MIN);
        let scale = if self.c_dec > 0.0 {
            (c * block_size as f64 / self.c_dec).min(PREFILL_LOAD_SCALE_MAX)
        } else {
            PREFILL_LOAD_SCALE_MAX
        };
        DynamoEquivalent {
            prefill_load_scale: scale,
            host_cache_hit_weight: (1.0 - self.c_host / c).clamp(0.0, 1.0),
            disk_cache_hit_weight: (1.0 - self.c_disk / c).clamp(0.0, 1.0),
        }
    }
}

/// The learned cost in Dynamo's weights.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DynamoEquivalent {
    /// `--router-prefill-load-scale`.
    pub prefill_load_scale: f64,
    /// `--router-host-cache-hit-weight`.
    pub host_cache_hit_weight: f64,
    /// `--router-disk-cache-hit-weight`.
    pub disk_cache_hit_weight: f64,
}

#[derive(Debug, Clone)]
struct Model {
    ttft: Rls<5>,
    tpot: Rls<2>,
    ttft_n: u64,
    tpot_n: u64,
    published: Option<Coefficients>,
    abs_error: f64,
    residual_n: u64,
    residuals: VecDeque<f64>,
}

impl Model {
    fn new() -> Self {
        Self {
            ttft: Rls::new(),
            tpot: Rls::new(),
            ttft_n: 0,
            tpot_n: 0,
            published: None,
            abs_error: 0.0,
            residual_n: 0,
            residuals: VecDeque::with_capacity(RESIDUALS_KEPT),
        }
    }

    fn residual(&mut self, r: f64) {
        if self.residuals.len() == RESIDUALS_KEPT {
            self.residuals.pop_front();
        }
        self.residuals.push_back(r);
        self.residual_n += 1;
        running_mean(&mut self.abs_error, self.residual_n, r.abs());
    }

    fn publish(&mut self, target: Coefficients) {
        match &mut self.published {
            Some(p) => p.smooth_toward(&target),
            None => self.published = Some(target),
        }
    }
}

/// Counts of what the tuner was given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TunerCounts {
    /// TTFT observations taken.
    pub ttft: u64,
    /// TPOT observations taken.
    pub tpot: u64,
    /// Observations refused (not finite, negative, too large).
    pub refused: u64,
    /// Observations clipped at [`OUTLIER_FACTOR`] × their prediction.
    pub clipped: u64,
}

/// One worker's state, for the debug view.
#[derive(Debug, Clone)]
pub struct WorkerView {
    /// The worker.
    pub worker: WorkerKey,
    /// Coefficients in use for it (the fleet's when it has none of its own yet).
    pub coefficients: Option<Coefficients>,
    /// Its TTFT observations.
    pub ttft_observations: u64,
    /// Its TPOT observations.
    pub tpot_observations: u64,
    /// Running mean of its absolute TTFT prediction errors (seconds).
    pub mean_abs_error: f64,
    /// Its last residuals (observed − predicted TTFT, seconds), oldest first.
    pub residuals: Vec<f64>,
}

/// The learner: per-worker and fleet fits.
#[derive(Debug, Clone)]
pub struct Tuner {
    block_size: usize,
    fleet: Model,
    workers: HashMap<WorkerKey, Model>,
    counts: TunerCounts,
    /// Running mean of completion lengths (tokens).
    completion_tokens: f64,
    /// Weight of the request's own service time in its cost.
    externality: f64,
    /// Bound on a worker's requests in flight over an even share; 0: none.
    load_bound: f64,
}

impl Tuner {
    /// A learner for blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            fleet: Model::new(),
            workers: HashMap::new(),
            counts: TunerCounts::default(),
            completion_tokens: 0.0,
            externality: EXTERNALITY_DEFAULT,
            load_bound: LOAD_BOUND_DEFAULT,
        }
    }

    /// The same learner with load bound `b` (clamped to 0..=[`LOAD_BOUND_MAX`]; not finite:
    /// the default; 0: none).
    pub fn with_load_bound(mut self, b: f64) -> Self {
        self.load_bound = finite_in(b, LOAD_BOUND_MAX, LOAD_BOUND_DEFAULT);
        self
    }

    /// The load bound.
    pub fn load_bound(&self) -> f64 {
        self.load_bound
    }

    /// The fewest requests in flight that keep a worker among `candidates` from being chosen
    /// (see the module's text); None without a bound or with fewer than two candidates.
    pub fn load_cap(&self, candidates: &[Candidate]) -> Option<usize> {
        if self.load_bound <= 0.0 || candidates.len() < 2 {
            return None;
        }
        let total: usize = candidates.iter().map(|c| c.load.requests).sum();
        let even = (total as f64 + 1.0) / candidates.len() as f64;
        Some(((1.0 + self.load_bound) * even).ceil().max(1.0) as usize)
    }

    /// The same learner with weight `e` on a request's own service time in its cost (clamped to
    /// 0..=[`EXTERNALITY_MAX`]; not finite: the default).
    pub fn with_externality(mut self, e: f64) -> Self {
        self.externality = finite_in(e, EXTERNALITY_MAX, EXTERNALITY_DEFAULT);
        self
    }

    /// Weight of a request's own service time in its cost.
    pub fn externality(&self) -> f64 {
        self.externality
    }

    /// Whether the fleet has enough observations for the learned cost.
    pub fn ready(&self) -> bool {
        self.fleet.ttft_n >= WARMUP_OBSERVATIONS
    }

    /// What it was given.
    pub fn counts(&self) -> TunerCounts {
        self.counts
    }

    /// Forgets a worker that left.
    pub fn forget(&mut self, worker: WorkerKey) {
        self.workers.remove(&worker);
    }

    /// Workers with a model.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    fn pooled_target(&self, worker: Option<&Model>) -> Coefficients {
        let fleet_ttft = self.fleet.ttft.theta;
        let fleet_tpot = self.fleet.tpot.theta;
        let (ttft, tpot) = match worker {
            Some(m) => {
                let w = m.ttft_n as f64 / (m.ttft_n as f64 + PRIOR_OBSERVATIONS);
                let v = m.tpot_n as f64 / (m.tpot_n as f64 + PRIOR_OBSERVATIONS);
                (
                    std::array::from_fn(|i| w * m.ttft.theta[i] + (1.0 - w) * fleet_ttft[i]),
                    std::array::from_fn(|i| v * m.tpot.theta[i] + (1.0 - v) * fleet_tpot[i]),
                )
            }
            None => return Coefficients::from_fit(&fleet_ttft, &fleet_tpot),
        };
        Coefficients::from_fit(&ttft, &tpot).floored(
            &Coefficients::from_fit(&fleet_ttft, &fleet_tpot),
            WORKER_SPEEDUP_MAX,
        )
    }

    /// The coefficients in use for `worker` (its own pooled with the fleet's, or the fleet's).
    pub fn coefficients(&self, worker: WorkerKey) -> Option<Coefficients> {
        self.workers
            .get(&worker)
            .and_then(|m| m.published)
            .or(self.fleet.published)
    }

    /// The fleet's coefficients.
    pub fn fleet_coefficients(&self) -> Option<Coefficients> {
        self.fleet.published
    }

    /// The fleet's coefficients in Dynamo's weights.
    pub fn dynamo_weights(&self) -> Option<DynamoEquivalent> {
        self.fleet
            .published
            .map(|c| c.dynamo_weights(self.block_size))
    }

    /// Running mean of the fleet's absolute TTFT prediction errors (seconds).
    pub fn mean_abs_error(&self) -> f64 {
        self.fleet.abs_error
    }

    /// A streamed request routed with `f` to `worker` had its first token after `ttft_secs`.
    /// False when the observation was refused.
    pub fn observe_ttft(&mut self, worker: WorkerKey, f: &RouteFeatures, ttft_secs: f64) -> bool {
        if !(ttft_secs.is_finite() && (0.0..=TTFT_MAX_SECS).contains(&ttft_secs)) {
            self.counts.refused += 1;
            return false;
        }
        let x = f.ttft_x();
        if !x.iter().all(|v| v.is_finite()) {
            self.counts.refused += 1;
            return false;
        }
        let mut y = ttft_secs;
        let ready = self.ready();
        let predicted = self
            .coefficients(worker)
            .map(|c| c.ttft(f))
            .filter(|p| p.is_finite() && *p > 0.0);
        if let (true, Some(p)) = (ready, predicted) {
            let level = OUTLIER_FACTOR * p.max(CLIP_FLOOR_SECS);
            if y > level {
                y = level;
                self.counts.clipped += 1;
            }
        }
        self.counts.ttft += 1;
        let fleet_residual = y - self.fleet.ttft.predict(&x);
        self.fleet.ttft.update(&x, y);
        self.fleet.ttft_n += 1;
        let model = self.workers.entry(worker).or_insert_with(Model::new);
        let residual = y - predicted.unwrap_or_else(|| model.ttft.predict(&x));
        model.ttft.update(&x, y);
        model.ttft_n += 1;
        model.residual(residual);
        self.fleet.residual(if residual.is_finite() {
            residual
        } else {
            fleet_residual
        });
        self.republish(worker);
        true
    }

    /// A streamed request on `worker`, whose decode load was `decode_blocks` when it was routed,
    /// produced `completion_tokens` tokens at `tpot_secs` each after its first. False when
    /// refused.
    pub fn observe_tpot(
        &mut self,
        worker: WorkerKey,
        decode_blocks: usize,
        completion_tokens: usize,
        tpot_secs: f64,
    ) -> bool {
        if !(tpot_secs.is_finite() && (0.0..=TPOT_MAX_SECS).contains(&tpot_secs))
            || completion_tokens < 2
        {
            self.counts.refused += 1;
            return false;
        }
        let x = [1.0, decode_blocks as f64 / UNIT];
        self.counts.tpot += 1;
        running_mean(
            &mut self.completion_tokens,
            self.counts.tpot,
            (completion_tokens as f64).min(1e6),
        );
        self.fleet.tpot.update(&x, tpot_secs);
        self.fleet.tpot_n += 1;
        let model = self.workers.entry(worker).or_insert_with(Model::new);
        model.tpot.update(&x, tpot_secs);
        model.tpot_n += 1;
        self.republish(worker);
        true
    }

    fn republish(&mut self, worker: WorkerKey) {
        let fleet = self.pooled_target(None);
        self.fleet.publish(fleet);
        let target = self.pooled_target(self.workers.get(&worker));
        if let Some(m) = self.workers.get_mut(&worker) {
            m.publish(target);
        }
    }

    /// The learned cost of routing a request of `input_tokens` to `candidate` (seconds); None
    /// until [`Self::ready`].
    pub fn cost(&self, candidate: &Candidate, input_tokens: usize) -> Option<f64> {
        if !self.ready() {
            return None;
        }
        let c = self.coefficients(candidate.worker)?;
        let f = RouteFeatures::of(candidate, input_tokens, self.block_size);
        let remaining = (self.completion_tokens / 2.0).min(REMAINING_TOKENS_MAX);
        let ttft = c.ttft(&f);
        let penalty = (c.d1 * f.request_blocks as f64 * f.requests as f64 * remaining)
            .min(DECODE_PENALTY_MAX_SECS)
            .min(DECODE_PENALTY_SHARE * ttft.max(0.0));
        let cost = ttft + penalty + self.externality * c.service(&f);
        Some(if cost.is_finite() { cost } else { f64::MAX })
    }

    /// Every worker's state, by key.
    pub fn view(&self) -> Vec<WorkerView> {
        let mut out: Vec<WorkerView> = self
            .workers
            .iter()
            .map(|(k, m)| WorkerView {
                worker: *k,
                coefficients: m.published.or(self.fleet.published),
                ttft_observations: m.ttft_n,
                tpot_observations: m.tpot_n,
                mean_abs_error: m.abs_error,
                residuals: m.residuals.iter().copied().collect(),
            })
            .collect();
        out.sort_by_key(|w| w.worker);
        out
    }
}
