//! The router's Prometheus metrics, named as Dynamo's router names them where it has them.
//!
//! - `kv_cache_events_applied{event_type, status}`: events by type (`stored`, `removed`,
//!   `cleared`, plus `batch` for whole payloads and `unknown` for event types not understood) and
//!   outcome (`ok`, `not_local`, `block_not_found`, `worker_full`, `parent_unknown`,
//!   `block_size_mismatch` (neither the router's block size nor a divisor of it), `malformed`,
//!   `unhashable`, `hash_conflict`, `placeholder_skipped`, `unknown_event`, `decode_error`,
//!   `unregistered_worker`).
//! - `kv_router_blocks{worker_id, dp_rank, tier}`: blocks indexed per worker and tier (set at
//!   each scrape).
//! - `kv_router_gaps_total{filled}`, `kv_router_replays_total`, `kv_router_decode_errors_total`,
//!   `kv_router_restarts_total`.
//! - `kv_router_find_matches_seconds`: latency of the index lookup of each query and route.
//! - `kv_router_requests_total{endpoint, code}`, `kv_router_workers`,
//!   `kv_router_active_requests`, `kv_router_distinct_blocks`, `kv_router_engine_hashes`
//!   (engine hashes mapped to block identities, all workers).
//! - `kv_router_predicted_blocks` (predictions alive), `kv_router_predictions_dropped_total`.
//! - Limits: `kv_router_requests_untracked_total` (routed beyond --max-tracked-requests),
//!   `kv_router_connections` (open HTTP connections), `kv_router_connections_refused_total`
//!   (beyond --max-connections), `kv_router_connections_timed_out_total` (idle),
//!   `kv_router_workers_refused_total` (registrations beyond --max-workers),
//!   `kv_router_workers_file_errors_total`, `kv_router_bootstrap_refused_total{why}` (a
//!   --bootstrap-from dump over a bound or otherwise refused), `kv_router_bootstrap_blocks`,
//!   `kv_router_connections_deadline_total{phase}` (headers or body not in time),
//!   `kv_router_connections_evicted_total` (closed to make room at --max-connections),
//!   `kv_router_bootstrap_workers_skipped_total` (workers of a --bootstrap-from dump left out).
//! - `kv_router_subscriber_total{what}`: the ZMQ subscriber's counters (sequence anomalies,
//!   oversized payloads and frames, replays, and `sink_waits`: the overflow policy of the
//!   bounded queue between subscriber and index is to wait, so ZMQ's own buffers fill and drop
//!   at their high water mark, and the gap is replayed; every wait is counted here).
//! - `kv_router_subscriber_sockets`, `kv_router_subscriber_zmq_contexts` (ZMQ resources held
//!   for the registered workers), `kv_router_max_workers` (--max-workers as in force, lowered at
//!   start when the open-files limit cannot hold it), `kv_router_open_files_limit`.
//! - `kv_router_events_by_group_kind_total{kind, event_type}`: events of vLLM's KV cache groups
//!   (`group_idx` given) by the group's kind as vLLM names it (`full_attention`,
//!   `sliding_window`, `mamba`, ...; `unknown` for a group never described) and type.
//! - `kv_router_claim_suspensions_total`, `kv_router_claims_suspended`: workers whose event link
//!   was lost, their blocks not counted until their next batch shows whether they restarted.
//! - OpenAI front end ([`FrontendMetrics`]): Dynamo's `dynamo_frontend_requests_total{model,
//!   endpoint, request_type, status}`, `dynamo_frontend_inflight_requests`,
//!   `dynamo_frontend_time_to_first_token_seconds`, `dynamo_frontend_request_duration_seconds`,
//!   `dynamo_frontend_input_sequence_tokens`; kvbm's `kv_router_frontend_outcomes_total{outcome}`,
//!   `kv_router_frontend_retries_total`, `kv_router_frontend_overlap_blocks{tier}`,
//!   `kv_router_frontend_tokenize_seconds{kind}`, `kv_router_frontend_tokenize_fallbacks_total`,
//!   `kv_router_frontend_prompt_bytes_total{how}` (`tokenized`, `cached`: taken from the
//!   tokenizer's prefix cache, `skipped`: past the last block any worker could match, or past a
//!   sure pick),
//!   `kv_router_frontend_tokenizer_cache_bytes`, `kv_router_frontend_tokenizer_words_total{from}`
//!   (`cache`: ids from the tokenizer's word cache, `model`: tokenized by the model),
//!   `kv_router_frontend_probe_answers_total{answer}`
//!   (before each window it would tokenize, whether the prefix probe stopped it: `no_holder`,
//!   `sure_pick`, `holders_outweighed`, or went on: `several_holders`, `holder_not_picked`,
//!   `pick_uncertain`),
//!   `kv_router_frontend_routing_seconds`, and
//!   `kv_router_worker_failures_total`.
//! - Routing modes and the tuned cost ([`ModeMetrics`]): `kv_router_mode_info{mode}` (1 for the
//!   mode in force), `kv_router_routed_total{mode}`,
//!   `kv_router_worker_prompt_tokens_total{worker_id, dp_rank, part}` (`routed`: whole prompts;
//!   `uncached`: past the chosen worker's overlap in every tier, what it was expected to compute;
//!   a worker's series go when it is unregistered), `kv_router_worker_recent_work_tokens{worker_id,
//!   dp_rank}` (tokens each registered worker computed into its GPU cache lately, by its own KV
//!   events, decayed: the balance term's input), `kv_router_tuned_active` (1 once the learned
//!   cost is in use), `kv_router_tuned_prefill_load_scale`,
//!   `kv_router_tuned_host_cache_hit_weight`, `kv_router_tuned_disk_cache_hit_weight` (the
//!   learned cost in Dynamo's weights), `kv_router_tuned_compute_seconds_per_token{worker_id,
//!   dp_rank}`, `kv_router_tuned_observations{kind}` (ttft, tpot, refused, clipped),
//!   `kv_router_tuned_ttft_abs_error_seconds` (running mean of the absolute TTFT prediction
//!   error), and `kv_router_front_end_cpu_seconds_total` (the process's user and system CPU
//!   time, read at each scrape: the front end's tokenizing, scoring and proxying are most of it),
//!   `kv_router_front_end_stage_cpu_seconds_total{stage}` (`tokenize`, `route`: each stage's
//!   thread CPU time).

use prometheus::{
    exponential_buckets, Counter, CounterVec, Gauge, GaugeVec, Histogram, HistogramOpts,
    HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric the router exports.
#[derive(Debug, Clone)]
pub struct RouterMetrics {
    registry: Registry,
    /// Events applied, by type and status.
    pub events_applied: IntCounterVec,
    /// Blocks indexed per worker and tier.
    pub blocks: IntGaugeVec,
    /// Sequence gaps, by whether replay filled them.
    pub gaps: IntCounterVec,
    /// Gaps filled by replay.
    pub replays: IntCounter,
    /// Payloads that did not decode.
    pub decode_errors: IntCounter,
    /// Engine restarts seen.
    pub restarts: IntCounter,
    /// `find_matches` latency.
    pub find_matches: Histogram,
    /// HTTP requests by endpoint and status code.
    pub requests: IntCounterVec,
    /// Workers registered.
    pub workers: IntGauge,
    /// Engine hashes mapped.
    pub engine_hashes: IntGauge,
    /// Predictions alive.
    pub predicted_blocks: IntGauge,
    /// Predictions dropped at the bound.
    pub predictions_dropped: IntGauge,
    /// Requests routed but not tracked (the tracker was full).
    pub requests_untracked: IntCounter,
    /// Open HTTP connections.
    pub connections: IntGauge,
    /// HTTP connections closed at once because --max-connections were open.
    pub connections_refused: IntCounter,
    /// HTTP connections closed for idleness.
    pub connections_timed_out: IntCounter,
    /// Registrations refused because --max-workers were registered.
    pub workers_refused: IntCounter,
    /// Workers files that could not be read or parsed, and their workers that failed to register.
    pub workers_file_errors: IntCounter,
    /// The subscriber's counters, copied at each scrape: `kv_router_subscriber_total{what}`.
    pub subscriber: IntGaugeVec,
    /// Routed requests still counted as load.
    pub active_requests: IntGauge,
    /// Distinct blocks indexed.
    pub distinct_blocks: IntGauge,
    /// Workers left out of routing after a failed request.
    pub worker_failures: IntCounter,
    /// The OpenAI front end's metrics.
    pub frontend: FrontendMetrics,
    /// `kv_router_bootstrap_refused_total{why}`: --bootstrap-from dumps refused (bytes,
    /// workers, blocks, worker, duplicate, timeout, fetch, malformed).
    pub bootstrap_refused: IntCounterVec,
    /// `kv_router_bootstrap_blocks`: holdings restored from a --bootstrap-from dump.
    pub bootstrap_blocks: IntGauge,
    /// HTTP connections closed because a request's headers or body did not arrive in time:
    /// `kv_router_connections_deadline_total{phase}` (`headers`, `body`).
    pub connections_deadline: IntCounterVec,
    /// HTTP connections closed to make room for a new one while --max-connections were open (the
    /// oldest that was not being answered: still sending its request, or idle between requests).
    pub connections_evicted: IntCounter,
    /// `kv_router_bootstrap_workers_skipped_total`: workers of a --bootstrap-from dump left out
    /// with their holdings (they fail POST /register's checks and --workers does not give them).
    pub bootstrap_workers_skipped: IntCounter,
    /// `kv_router_subscriber_sockets`: ZMQ sockets the event subscriber holds open (three per
    /// registered worker, one more during a replay).
    pub subscriber_sockets: IntGauge,
    /// `kv_router_subscriber_zmq_contexts`: ZMQ contexts open (one per 200 workers).
    pub subscriber_contexts: IntGauge,
    /// `kv_router_events_by_group_kind_total{kind, event_type}`: events of KV cache groups.
    pub events_by_group_kind: IntCounterVec,
    /// `kv_router_claim_suspensions_total`: times a worker's event link was lost and its blocks
    /// stopped counting until its next batch.
    pub claim_suspensions: IntCounter,
    /// `kv_router_claims_suspended`: workers whose blocks do not count now.
    pub claims_suspended: IntGauge,
    /// `kv_router_max_workers`: workers that may be registered (--max-workers, lowered at start
    /// when the open-files limit cannot hold them).
    pub max_workers: IntGauge,
    /// `kv_router_open_files_limit`: the process's open-files limit (RLIMIT_NOFILE, soft).
    pub open_files_limit: IntGauge,
    /// The routing mode's and the tuned cost's metrics.
    pub modes: ModeMetrics,
}

/// The routing mode's and the tuned cost's metrics.
#[derive(Debug, Clone)]
pub struct ModeMetrics {
    /// `kv_router_mode_info{mode}`: 1 for the mode in force.
    pub mode_info: IntGaugeVec,
    /// `kv_router_routed_total{mode}`: routing decisions.
    pub routed: IntCounterVec,
    /// `kv_router_worker_prompt_tokens_total{worker_id, dp_rank, part}`: prompt tokens routed
    /// to each worker, `routed` (whole prompts) and `uncached` (past the worker's overlap in
    /// every tier when it was chosen: what the router expected it to compute).
    pub worker_prompt_tokens: IntCounterVec,
    /// `kv_router_worker_recent_work_tokens{worker_id, dp_rank}`: tokens each worker computed into
    /// its GPU cache lately (its KV events, decayed by --router-balance-half-life-secs), the
    /// balance term's input; refreshed at each scrape.
    pub worker_recent_work: GaugeVec,
    /// `kv_router_tuned_active`: 1 once the learned cost is in use.
    pub tuned_active: IntGauge,
    /// `kv_router_tuned_prefill_load_scale`.
    pub tuned_prefill_load_scale: Gauge,
    /// `kv_router_tuned_host_cache_hit_weight`.
    pub tuned_host_cache_hit_weight: Gauge,
    /// `kv_router_tuned_disk_cache_hit_weight`.
    pub tuned_disk_cache_hit_weight: Gauge,
    /// `kv_router_tuned_compute_seconds_per_token{worker_id, dp_rank}`.
    pub tuned_compute_seconds_per_token: GaugeVec,
    /// `kv_router_tuned_observations{kind}`.
    pub tuned_observations: IntGaugeVec,
    /// `kv_router_tuned_ttft_abs_error_seconds`.
    pub tuned_abs_error: Gauge,
    /// `kv_router_front_end_cpu_seconds_total`.
    pub cpu_seconds: Counter,
    /// `kv_router_front_end_stage_cpu_seconds_total{stage}`: CPU time of the OpenAI front end's
    /// tokenizing (`tokenize`) and routing (`route`: hashing, index lookup, scoring), measured
    /// on the thread that did it; proxying is the process's time less these.
    pub stage_cpu: CounterVec,
}

/// The prefix probe's answers (`kv_router_frontend_probe_answers_total{answer}`): the first three
/// stop tokenizing.
pub const PROBE_ANSWERS: [&str; 6] = [
    "no_holder",
    "sure_pick",
    "holders_outweighed",
    "several_holders",
    "holder_not_picked",
    "pick_uncertain",
];

/// The calling thread's CPU time (user and system), in seconds; None where it cannot be read.
pub fn thread_cpu_seconds() -> Option<f64> {
    #[cfg(target_os = "linux")]
    let who = nix::sys::resource::UsageWho::RUSAGE_THREAD;
    #[cfg(not(target_os = "linux"))]
    let who = nix::sys::resource::UsageWho::RUSAGE_SELF;
    let usage = nix::sys::resource::getrusage(who).ok()?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
    Some(secs(usage.user_time()) + secs(usage.system_time()))
}

/// Adds the calling thread's CPU time since `since` (from [`thread_cpu_seconds`]) to `stage`.
pub fn count_cpu(counter: &CounterVec, stage: &str, since: Option<f64>) {
    if let (Some(before), Some(now)) = (since, thread_cpu_seconds()) {
        if now > before {
            counter.with_label_values(&[stage]).inc_by(now - before);
        }
    }
}

impl ModeMetrics {
    fn new(registry: &Registry) -> Self {
        let m = Self::unlabelled(registry);
        for stage in ["tokenize", "route"] {
            m.stage_cpu.with_label_values(&[stage]);
        }
        m
    }

    fn unlabelled(registry: &Registry) -> Self {
        let gauge = |name: &str, help: &str| {
            register(registry, Gauge::new(name, help).expect("valid metric"))
        };
        Self {
            mode_info: register(
                registry,
                IntGaugeVec::new(
                    Opts::new("kv_router_mode_info", "1 for the routing mode in force"),
                    &["mode"],
                )
                .expect("valid metric"),
            ),
            routed: register(
                registry,
                IntCounterVec::new(
                    Opts::new("kv_router_routed_total", "Routing decisions, by mode"),
                    &["mode"],
                )
                .expect("valid metric"),
            ),
            worker_prompt_tokens: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kv_router_worker_prompt_tokens_total",
                        "Prompt tokens routed to each worker: routed (whole prompts), uncached \
                         (past the worker's cached prefix in every tier when it was chosen)",
                    ),
                    &["worker_id", "dp_rank", "part"],
                )
                .expect("valid metric"),
            ),
            worker_recent_work: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "kv_router_worker_recent_work_tokens",
                        "Tokens each worker computed into its GPU cache lately, by its KV events, \
                         decayed by --router-balance-half-life-secs (the balance term's input)",
                    ),
                    &["worker_id", "dp_rank"],
                )
                .expect("valid metric"),
            ),
            tuned_active: register(
                registry,
                IntGauge::new(
                    "kv_router_tuned_active",
                    "1 once the tuned cost has enough observations to be used (else kv's weights)",
                )
                .expect("valid metric"),
            ),
            tuned_prefill_load_scale: gauge(
                "kv_router_tuned_prefill_load_scale",
                "The learned cost as Dynamo's prefill_load_scale (c_compute * block_size / c_dec)",
            ),
            tuned_host_cache_hit_weight: gauge(
                "kv_router_tuned_host_cache_hit_weight",
                "The learned cost as Dynamo's host_cache_hit_weight (1 - c_host / c_compute)",
            ),
            tuned_disk_cache_hit_weight: gauge(
                "kv_router_tuned_disk_cache_hit_weight",
                "The learned cost as Dynamo's disk_cache_hit_weight (1 - c_disk / c_compute)",
            ),
            tuned_compute_seconds_per_token: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "kv_router_tuned_compute_seconds_per_token",
                        "Learned time to first token per prompt token computed, per worker",
                    ),
                    &["worker_id", "dp_rank"],
                )
                .expect("valid metric"),
            ),
            tuned_observations: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kv_router_tuned_observations",
                        "Observations given to the tuned cost: ttft, tpot, refused (not finite, \
                         negative or too large), clipped (above 10x their prediction)",
                    ),
                    &["kind"],
                )
                .expect("valid metric"),
            ),
            tuned_abs_error: gauge(
                "kv_router_tuned_ttft_abs_error_seconds",
                "Running mean of the absolute error of the learned TTFT prediction",
            ),
            cpu_seconds: register(
                registry,
                Counter::new(
                    "kv_router_front_end_cpu_seconds_total",
                    "CPU time (user and system) of the router process",
                )
                .expect("valid metric"),
            ),
            stage_cpu: register(
                registry,
                CounterVec::new(
                    Opts::new(
                        "kv_router_front_end_stage_cpu_seconds_total",
                        "CPU time of the OpenAI front end's stages, on the thread that ran them: \
                         tokenize, route (hashing, index lookup, scoring)",
                    ),
                    &["stage"],
                )
                .expect("valid metric"),
            ),
        }
    }
}

/// The OpenAI front end's metrics: Dynamo's frontend names (`dynamo_frontend_*`, which users'
/// dashboards already graph) for requests, in-flight, durations and time to first token, and
/// kvbm's own (`kv_router_frontend_*`) for what Dynamo does not export.
#[derive(Debug, Clone)]
pub struct FrontendMetrics {
    /// `dynamo_frontend_requests_total{model, endpoint, request_type, status}`.
    pub requests: IntCounterVec,
    /// `dynamo_frontend_inflight_requests{model}`.
    pub inflight: IntGaugeVec,
    /// `dynamo_frontend_time_to_first_token_seconds{model}`.
    pub ttft: HistogramVec,
    /// `dynamo_frontend_request_duration_seconds{model}`.
    pub duration: HistogramVec,
    /// `dynamo_frontend_input_sequence_tokens{model}`.
    pub input_tokens: HistogramVec,
    /// `kv_router_frontend_outcomes_total{outcome}`: success, cancelled, worker_error, no_worker,
    /// bad_request, model_not_found, tokenize_error, worker_status.
    pub outcomes: IntCounterVec,
    /// `kv_router_frontend_retries_total`: requests sent again to another worker before their
    /// first byte.
    pub retries: IntCounter,
    /// `kv_router_frontend_overlap_blocks{tier}`: the overlap each routed request got.
    pub overlap_blocks: HistogramVec,
    /// `kv_router_frontend_tokenize_seconds{kind}`: prompt or chat.
    pub tokenize: HistogramVec,
    /// `kv_router_frontend_routing_seconds`: hashing, scoring and choosing (tokenizing excluded).
    pub routing: Histogram,
    /// `kv_router_frontend_tokenize_fallbacks_total`: requests the router could not tokenize as
    /// the worker will (a multimodal part, a per-request template), routed by load alone.
    pub tokenize_fallbacks: IntCounter,
    /// `kv_router_frontend_prompt_bytes_total{how}`: prompt text `tokenized`, taken from the
    /// prefix cache (`cached`), or `skipped` (past every worker's overlap; its length estimated).
    pub prompt_bytes: IntCounterVec,
    /// `kv_router_frontend_tokenizer_cache_bytes`: bytes the tokenizer's prefix cache holds.
    pub tokenizer_cache_bytes: IntGauge,
    /// `kv_router_frontend_tokenizer_words_total{from}`: words of the windows tokenized whose ids
    /// came from the tokenizer's word cache (`cache`) or from its model (`model`).
    pub tokenizer_words: IntCounterVec,
    /// `kv_router_frontend_probe_answers_total{answer}`: the prefix probe's answers, before each
    /// window the tokenizer would tokenize ([`crate::state::PrefixProbe::worth_more`]).
    pub probe_answers: IntCounterVec,
    /// `kv_router_frontend_inflight_prompt_bytes`: bytes of large request bodies held while
    /// tokenizing (at most `--max-inflight-prompt-bytes`).
    pub inflight_prompt_bytes: IntGauge,
    /// `kv_router_frontend_prompt_budget_refusals_total`: large requests answered 503 because
    /// `--max-inflight-prompt-bytes` were held.
    pub prompt_budget_refusals: IntCounter,
    /// `kv_router_frontend_tokenize_waiting{lane}`: requests waiting for a tokenizing permit,
    /// `small` or `large` (`--large-prompt-bytes`).
    pub tokenize_waiting: IntGaugeVec,
    /// `kv_router_frontend_sse_events_too_large_total`: streams ended because a worker's event
    /// passed `--max-sse-event-bytes`.
    pub sse_events_too_large: IntCounter,
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

fn register<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique and valid");
    metric
}

impl RouterMetrics {
    /// A fresh set of metrics in its own registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            register(
                &registry,
                IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let events_applied = counter_vec(
            "kv_cache_events_applied",
            "KV cache events applied to the index, by event type and outcome",
            &["event_type", "status"],
        );
        let gaps = counter_vec(
            "kv_router_gaps_total",
            "Gaps in a worker's event sequence, by whether replay filled them",
            &["filled"],
        );
        let requests = counter_vec(
            "kv_router_requests_total",
            "HTTP requests, by endpoint and status code",
            &["endpoint", "code"],
        );
        let blocks = register(
            &registry,
            IntGaugeVec::new(
                Opts::new("kv_router_blocks", "Blocks indexed per worker and tier"),
                &["worker_id", "dp_rank", "tier"],
            )
            .expect("valid metric"),
        );
        let counter = |name: &str, help: &str| {
            register(
                &registry,
                IntCounter::new(name, help).expect("valid metric"),
            )
        };
        let gauge = |name: &str, help: &str| {
            register(&registry, IntGauge::new(name, help).expect("valid metric"))
        };
        let find_matches = register(
            &registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "kv_router_find_matches_seconds",
                    "Latency of the index lookup of a query or a route",
                )
                .buckets(exponential_buckets(1e-6, 2.0, 18).expect("valid buckets")),
            )
            .expect("valid metric"),
        );
        Self {
            events_applied,
            blocks,
            gaps,
            replays: counter(
                "kv_router_replays_total",
                "Gaps filled from a worker's replay socket",
            ),
            decode_errors: counter(
                "kv_router_decode_errors_total",
                "Event payloads that did not decode",
            ),
            restarts: counter(
                "kv_router_restarts_total",
                "Engine restarts seen (sequence back to 0)",
            ),
            find_matches,
            requests,
            workers: gauge("kv_router_workers", "Workers registered"),
            engine_hashes: gauge(
                "kv_router_engine_hashes",
                "Engine hashes mapped to block identities (all workers)",
            ),
            predicted_blocks: gauge(
                "kv_router_predicted_blocks",
                "Blocks predicted on workers by routing decisions, alive",
            ),
            predictions_dropped: gauge(
                "kv_router_predictions_dropped_total",
                "Predictions not kept because the most allowed were alive",
            ),
            requests_untracked: counter(
                "kv_router_requests_untracked_total",
                "Requests routed without tracking their load (--max-tracked-requests reached)",
            ),
            connections: gauge("kv_router_connections", "Open HTTP connections"),
            connections_refused: counter(
                "kv_router_connections_refused_total",
                "HTTP connections closed at once because --max-connections were open",
            ),
            connections_timed_out: counter(
                "kv_router_connections_timed_out_total",
                "HTTP connections closed after --http-idle-timeout-secs without traffic",
            ),
            workers_refused: counter(
                "kv_router_workers_refused_total",
                "Worker registrations refused because --max-workers were registered",
            ),
            subscriber: register(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kv_router_subscriber_total",
                        "The event subscriber's counters: batches, undecodable, oversized, \
                         malformed, duplicates, restarts, gaps_filled, gaps_unfilled, \
                         replay_requests, replay_timeouts, replay_failures, and sink_waits (times \
                         a worker's thread waited because the event queue to the index was full)",
                    ),
                    &["what"],
                )
                .expect("valid metric"),
            ),
            workers_file_errors: counter(
                "kv_router_workers_file_errors_total",
                "Workers-file reads or entries refused (the registered workers stay as they were)",
            ),
            active_requests: gauge(
                "kv_router_active_requests",
                "Routed requests still counted toward a worker's load",
            ),
            distinct_blocks: gauge("kv_router_distinct_blocks", "Distinct blocks indexed"),
            worker_failures: counter(
                "kv_router_worker_failures_total",
                "Requests a worker failed (refused, died, timed out), each leaving it out of \
                 routing for --worker-failure-cooldown-secs",
            ),
            frontend: FrontendMetrics::new(&registry),
            bootstrap_refused: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "kv_router_bootstrap_refused_total",
                        "--bootstrap-from dumps refused or failed (the router started without them), by \
                         why: bytes, workers, blocks, worker, duplicate, timeout, fetch, malformed",
                    ),
                    &["why"],
                )
                .expect("valid metric"),
            ),
            bootstrap_blocks: gauge(
                "kv_router_bootstrap_blocks",
                "Holdings restored from the --bootstrap-from dump at start",
            ),
            connections_deadline: counter_vec(
                "kv_router_connections_deadline_total",
                "HTTP connections closed because a request's headers (--http-header-timeout-secs) \
                 or body (--http-body-timeout-secs) did not arrive in time, by phase",
                &["phase"],
            ),
            connections_evicted: counter(
                "kv_router_connections_evicted_total",
                "HTTP connections closed to make room for a new one while --max-connections were \
                 open (the oldest still sending its request or idle between requests)",
            ),
            bootstrap_workers_skipped: counter(
                "kv_router_bootstrap_workers_skipped_total",
                "Workers of the --bootstrap-from dump left out with their holdings: they fail the \
                 checks of POST /register (tcp:// endpoints only) and --workers does not give them",
            ),
            subscriber_sockets: gauge(
                "kv_router_subscriber_sockets",
                "ZMQ sockets the event subscriber holds open (three per registered worker, one \
                 more during a replay)",
            ),
            subscriber_contexts: gauge(
                "kv_router_subscriber_zmq_contexts",
                "ZMQ contexts the event subscriber holds open (one per 200 workers)",
            ),
            events_by_group_kind: counter_vec(
                "kv_router_events_by_group_kind_total",
                "KV cache events of vLLM's KV cache groups (group_idx given), by the group's kind \
                 (kv_cache_spec_kind as vLLM names it; unknown for a group never described) and \
                 event type. Only full-attention-like groups' blocks are claims; sliding-window \
                 and Mamba groups' blocks cut a worker's match where vLLM would cut its hit",
                &["kind", "event_type"],
            ),
            claim_suspensions: counter(
                "kv_router_claim_suspensions_total",
                "Times a worker's event link was lost and its blocks stopped counting until its \
                 next batch showed whether it restarted",
            ),
            claims_suspended: gauge(
                "kv_router_claims_suspended",
                "Workers whose indexed blocks do not count now (event link lost, state unknown)",
            ),
            max_workers: gauge(
                "kv_router_max_workers",
                "Workers that may be registered (--max-workers, lowered at start when the \
                 open-files limit cannot hold them)",
            ),
            open_files_limit: gauge(
                "kv_router_open_files_limit",
                "The process's open-files limit (RLIMIT_NOFILE, soft), as raised at start",
            ),
            modes: ModeMetrics::new(&registry),
            registry,
        }
    }

    /// The registry (for tests and embedding).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Counts `n` events of `event_type` with `status`.
    pub fn applied(&self, event_type: &str, status: &str, n: u64) {
        if n > 0 {
            self.events_applied
                .with_label_values(&[event_type, status])
                .inc_by(n);
        }
    }

    /// The current `kv_cache_events_applied` count of one event type and status.
    pub fn applied_count(&self, event_type: &str, status: &str) -> u64 {
        self.events_applied
            .get_metric_with_label_values(&[event_type, status])
            .map(|c| c.get())
            .unwrap_or(0)
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# encoding failed: {e}\n"))
    }
}

impl FrontendMetrics {
    fn new(registry: &Registry) -> Self {
        let histogram_vec = |name: &str, help: &str, labels: &[&str], buckets: Vec<f64>| {
            register(
                registry,
                HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
                    .expect("valid metric"),
            )
        };
        // 1 ms to about 17 minutes (the longest generations --worker-response-timeout-secs allows).
        let latency = || exponential_buckets(1e-3, 2.0, 21).expect("valid buckets");
        let small = || exponential_buckets(1e-6, 2.0, 20).expect("valid buckets");
        Self {
            requests: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "dynamo_frontend_requests_total",
                        "OpenAI requests, by model, endpoint, request type (stream or unary) and \
                         status (success or error)",
                    ),
                    &["model", "endpoint", "request_type", "status"],
                )
                .expect("valid metric"),
            ),
            inflight: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "dynamo_frontend_inflight_requests",
                        "OpenAI requests being served",
                    ),
                    &["model"],
                )
                .expect("valid metric"),
            ),
            ttft: histogram_vec(
                "dynamo_frontend_time_to_first_token_seconds",
                "Time from a request's arrival to the first byte of its worker's answer",
                &["model"],
                latency(),
            ),
            duration: histogram_vec(
                "dynamo_frontend_request_duration_seconds",
                "Time from a request's arrival to the end of its answer",
                &["model"],
                latency(),
            ),
            input_tokens: histogram_vec(
                "dynamo_frontend_input_sequence_tokens",
                "Prompt tokens per request",
                &["model"],
                exponential_buckets(16.0, 2.0, 14).expect("valid buckets"),
            ),
            outcomes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kv_router_frontend_outcomes_total",
                        "OpenAI requests by outcome: success, cancelled (client went away), \
                         worker_error (failed after its first byte), no_worker, bad_request, \
                         model_not_found, tokenize_error, worker_status (the worker answered an \
                         error status, passed on)",
                    ),
                    &["outcome"],
                )
                .expect("valid metric"),
            ),
            retries: register(
                registry,
                IntCounter::new(
                    "kv_router_frontend_retries_total",
                    "Requests sent again to another worker because theirs failed before answering",
                )
                .expect("valid metric"),
            ),
            overlap_blocks: histogram_vec(
                "kv_router_frontend_overlap_blocks",
                "Blocks of a routed request's prefix its worker held, by tier",
                &["tier"],
                exponential_buckets(1.0, 2.0, 14).expect("valid buckets"),
            ),
            tokenize: histogram_vec(
                "kv_router_frontend_tokenize_seconds",
                "Time to tokenize a request (prompt, or chat template and prompt)",
                &["kind"],
                small(),
            ),
            tokenize_fallbacks: register(
                registry,
                IntCounter::new(
                    "kv_router_frontend_tokenize_fallbacks_total",
                    "Requests the router could not tokenize as their worker will (routed by load \
                     alone; the worker judges them)",
                )
                .expect("valid metric"),
            ),
            prompt_bytes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kv_router_frontend_prompt_bytes_total",
                        "Prompt text by what tokenizing did with it: tokenized, cached (ids from \
                         the prefix cache), skipped (past the last block any worker held, or past \
                         where one holder was sure to be picked; its tokens estimated)",
                    ),
                    &["how"],
                )
                .expect("valid metric"),
            ),
            probe_answers: {
                let v = register(
                    registry,
                    IntCounterVec::new(
                        Opts::new(
                            "kv_router_frontend_probe_answers_total",
                            "Before each window of a prompt it would tokenize, the prefix \
                             probe's answer: stop (no_holder: no worker holds all blocks so far; \
                             sure_pick: one does and would be picked already; \
                             holders_outweighed: the pick would stay even if those that do held \
                             all of the rest) or go on (several_holders, holder_not_picked, \
                             pick_uncertain)",
                        ),
                        &["answer"],
                    )
                    .expect("valid metric"),
                );
                for a in PROBE_ANSWERS {
                    v.with_label_values(&[a]);
                }
                v
            },
            tokenizer_cache_bytes: register(
                registry,
                IntGauge::new(
                    "kv_router_frontend_tokenizer_cache_bytes",
                    "Bytes of tokenized windows the prefix cache holds (--tokenizer-cache-mb)",
                )
                .expect("valid metric"),
            ),
            tokenizer_words: {
                let v = register(
                    registry,
                    IntCounterVec::new(
                        Opts::new(
                            "kv_router_frontend_tokenizer_words_total",
                            "Words (splits of the pre-tokenizer) of the windows tokenized, by where \
                             their ids came from: the word cache (cache) or the model (model)",
                        ),
                        &["from"],
                    )
                    .expect("valid metric"),
                );
                for from in ["cache", "model"] {
                    v.with_label_values(&[from]);
                }
                v
            },
            routing: register(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "kv_router_frontend_routing_seconds",
                        "Time to hash, score and choose a worker for a request (tokenizing excluded)",
                    )
                    .buckets(small()),
                )
                .expect("valid metric"),
            ),
            inflight_prompt_bytes: register(
                registry,
                IntGauge::new(
                    "kv_router_frontend_inflight_prompt_bytes",
                    "Bytes of large request bodies held while tokenizing (--max-inflight-prompt-bytes)",
                )
                .expect("valid metric"),
            ),
            prompt_budget_refusals: register(
                registry,
                IntCounter::new(
                    "kv_router_frontend_prompt_budget_refusals_total",
                    "Large requests answered 503 because --max-inflight-prompt-bytes were held",
                )
                .expect("valid metric"),
            ),
            tokenize_waiting: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kv_router_frontend_tokenize_waiting",
                        "Requests waiting for a tokenizing permit, by lane (--large-prompt-bytes)",
                    ),
                    &["lane"],
                )
                .expect("valid metric"),
            ),
            sse_events_too_large: register(
                registry,
                IntCounter::new(
                    "kv_router_frontend_sse_events_too_large_total",
                    "Streams ended because a worker's event passed --max-sse-event-bytes",
                )
                .expect("valid metric"),
            ),
        }
    }
}
