//! One worker's Prometheus metrics (its own registry: /metrics of a worker speaks for it alone).

use prometheus::{
    Encoder, Gauge, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// A worker's metrics. The engine thread writes them, the HTTP side reads them.
#[derive(Debug)]
pub struct WorkerMetrics {
    registry: Registry,
    /// Prompt tokens of finished prefills by where they came from
    /// (`computed`, `gpu`, `host`, `disk`).
    pub prompt_tokens: IntCounterVec,
    /// Tokens run through prefill, every time: a preempted request's tokens computed again on
    /// resuming count again (`prompt_tokens{source="computed"}` counts each prompt once, at its
    /// first admission, as vLLM reports `num_cached_tokens`).
    pub prefill_tokens: IntCounter,
    /// Tokens generated.
    pub generation_tokens: IntCounter,
    /// Requests by outcome (`finished`, `aborted`).
    pub requests: IntCounterVec,
    /// The worker's simulated clock, seconds.
    pub sim_seconds: Gauge,
    /// Requests running.
    pub running: IntGauge,
    /// Requests waiting (loading from a lower tier included).
    pub waiting: IntGauge,
    /// Requests waiting for a load from the host or disk tier.
    pub loading: IntGauge,
    /// Blocks held by requests, per tier.
    pub blocks_active: IntGaugeVec,
    /// Blocks registered (findable), per tier.
    pub blocks_resident: IntGaugeVec,
    /// Engine steps run.
    pub steps: IntCounter,
    /// Preemptions (a running request's blocks freed, recomputed later).
    pub preemptions: IntCounter,
    /// How far the simulated clock is behind wall time x speedup after the last step, simulated
    /// seconds (0 when on time).
    pub lag_seconds: Gauge,
    /// The largest lag seen.
    pub lag_max_seconds: Gauge,
    /// Steps that finished after their wall deadline.
    pub late_steps: IntCounter,
}

fn reg<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, m: M) -> M {
    registry
        .register(Box::new(m.clone()))
        .expect("metric names are unique");
    m
}

impl WorkerMetrics {
    /// Fresh metrics.
    pub fn new() -> Self {
        let r = Registry::new();
        let counter_vec = |name: &str, help: &str, label: &str| {
            reg(
                &r,
                IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric"),
            )
        };
        let gauge_vec = |name: &str, help: &str| {
            reg(
                &r,
                IntGaugeVec::new(Opts::new(name, help), &["tier"]).expect("valid metric"),
            )
        };
        let m = Self {
            prompt_tokens: counter_vec(
                "kvbm_mocker_prompt_tokens_total",
                "Prompt tokens of finished prefills, by where they came from",
                "source",
            ),
            prefill_tokens: reg(
                &r,
                IntCounter::new(
                    "kvbm_mocker_prefill_tokens_total",
                    "Tokens run through prefill, recomputed ones (after a preemption) included",
                )
                .expect("valid metric"),
            ),
            generation_tokens: reg(
                &r,
                IntCounter::new("kvbm_mocker_generation_tokens_total", "Tokens generated")
                    .expect("valid metric"),
            ),
            requests: counter_vec(
                "kvbm_mocker_requests_total",
                "Requests by outcome",
                "outcome",
            ),
            sim_seconds: reg(
                &r,
                Gauge::new("kvbm_mocker_sim_seconds", "The worker's simulated clock")
                    .expect("valid metric"),
            ),
            running: reg(
                &r,
                IntGauge::new("kvbm_mocker_num_requests_running", "Requests running")
                    .expect("valid metric"),
            ),
            waiting: reg(
                &r,
                IntGauge::new("kvbm_mocker_num_requests_waiting", "Requests waiting")
                    .expect("valid metric"),
            ),
            loading: reg(
                &r,
                IntGauge::new(
                    "kvbm_mocker_num_requests_loading",
                    "Requests waiting for KV from the host or disk tier",
                )
                .expect("valid metric"),
            ),
            blocks_active: gauge_vec("kvbm_mocker_blocks_active", "Blocks held by requests"),
            blocks_resident: gauge_vec(
                "kvbm_mocker_blocks_resident",
                "Blocks registered (prefix-cache hits possible)",
            ),
            steps: reg(
                &r,
                IntCounter::new("kvbm_mocker_steps_total", "Engine steps").expect("valid metric"),
            ),
            preemptions: reg(
                &r,
                IntCounter::new("kvbm_mocker_preemptions_total", "Requests preempted")
                    .expect("valid metric"),
            ),
            lag_seconds: reg(
                &r,
                Gauge::new(
                    "kvbm_mocker_lag_seconds",
                    "Simulated seconds the clock is behind wall time x speedup after the last step",
                )
                .expect("valid metric"),
            ),
            lag_max_seconds: reg(
                &r,
                Gauge::new("kvbm_mocker_lag_max_seconds", "Largest lag seen")
                    .expect("valid metric"),
            ),
            late_steps: reg(
                &r,
                IntCounter::new(
                    "kvbm_mocker_late_steps_total",
                    "Steps that ended after their wall deadline",
                )
                .expect("valid metric"),
            ),
            registry: r,
        };
        for s in ["computed", "gpu", "host", "disk", "shared"] {
            m.prompt_tokens.with_label_values(&[s]);
        }
        for o in ["finished", "aborted"] {
            m.requests.with_label_values(&[o]);
        }
        m
    }

    /// The Prometheus text of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("encoding into memory");
        String::from_utf8(out).expect("Prometheus text is UTF-8")
    }
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}
