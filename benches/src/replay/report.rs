//! What a replay measures per run, its JSON, its markdown table and its functional checks.
//!
//! Times are simulated seconds (wall × speedup). Per run: TTFT, ITL (per request over its whole
//! answer, see `client`) and end-to-end latency (mean, p50, p90, p99, nearest rank); requests and
//! output tokens per simulated second over the makespan (first send to last answer); errors and
//! drops; prefix reuse per tier from the workers' `kvbm_mocker_prompt_tokens_total{source}`
//! (fractions of prompt tokens); imbalance = max / mean over workers of computed prompt tokens and
//! of requests; the router's CPU seconds (utime + stime) per routed request and per 1K prompt
//! tokens; the tuned cost's `/debug/cost` at the end of a `tuned` run.

use serde::Serialize;
use serde_json::{json, Value as Json};

use super::client::Answer;
use super::fleet::prom_sum;
use super::trace::{Scale, Session};
use super::ReplayArgs;
use crate::stats::percentile;

/// One run: a routing mode and its extra router flags.
#[derive(Debug, Clone, Serialize)]
pub struct RunSpec {
    pub label: String,
    pub mode: String,
    pub router_flags: Vec<String>,
}

/// One turn as it went (times in simulated seconds from the run's origin).
#[derive(Debug)]
pub struct Record {
    pub session: usize,
    pub turn: usize,
    pub sent_s: f64,
    /// The prompt's length by the trace (for sessions, answers at their nominal length).
    pub nominal_prompt_tokens: usize,
    /// `None`: dropped (over the in-flight bound).
    pub answer: Option<Answer>,
}

/// Mean and nearest-rank percentiles.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Summary {
    pub fn of(values: &[f64]) -> Self {
        let mean = if values.is_empty() {
            f64::NAN
        } else {
            values.iter().sum::<f64>() / values.len() as f64
        };
        Self {
            n: values.len(),
            mean,
            p50: percentile(values, 0.5),
            p90: percentile(values, 0.9),
            p99: percentile(values, 0.99),
        }
    }
}

/// The prompt tokens the router's metrics say it expected worker `worker_id` (rank 0) to
/// compute; None when it has no such series.
pub fn router_uncached(router_metrics: &str, worker_id: &str) -> Option<f64> {
    let label = format!("worker_id=\"{worker_id}\"");
    let name = "kv_router_worker_prompt_tokens_total";
    let lines: String = router_metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(&label) && l.contains("dp_rank=\"0\""))
        .map(|l| format!("{l}\n"))
        .collect();
    (!lines.is_empty()).then(|| prom_sum(&lines, name, Some(("part", "uncached"))))
}

/// The tokens worker `worker_id` (rank 0) computed into its GPU cache lately, as the router's
/// metrics say at the end of a run (`kv_router_worker_recent_work_tokens`, the balance term's
/// input); None when it has no such series.
pub fn router_recent_work(router_metrics: &str, worker_id: &str) -> Option<f64> {
    let label = format!("worker_id=\"{worker_id}\"");
    let name = "kv_router_worker_recent_work_tokens{";
    router_metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(&label) && l.contains("dp_rank=\"0\""))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Prompt text by what the router's tokenizer did with it (bytes).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct PromptBytes {
    pub tokenized: f64,
    /// Ids taken from its prefix cache.
    pub cached: f64,
    /// Past the last block any worker held: not tokenized.
    pub skipped: f64,
}

impl PromptBytes {
    /// From the router's Prometheus text.
    pub fn from_metrics(text: &str) -> Self {
        let get = |how: &str| {
            let name = format!("kv_router_frontend_prompt_bytes_total{{how=\"{how}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&name))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        };
        Self {
            tokenized: get("tokenized"),
            cached: get("cached"),
            skipped: get("skipped"),
        }
    }
}

/// One worker's counters after a run.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct WorkerCounts {
    pub computed: f64,
    pub gpu: f64,
    pub host: f64,
    pub disk: f64,
    /// From the fleet's shared pool (the mocker's `--shared-blocks`).
    pub shared: f64,
    pub requests: f64,
    /// Tokens it ran through prefill, recomputed ones included.
    pub prefill_tokens: f64,
    pub generation_tokens: f64,
    /// Requests the worker preempted (their computed tokens are computed again on resuming).
    pub preemptions: f64,
    /// Prompt tokens the router expected it to compute: past its cached prefix in every tier
    /// when the router chose it (`kv_router_worker_prompt_tokens_total{part="uncached"}`).
    pub router_uncached: Option<f64>,
    /// Tokens it computed into its GPU cache lately by the router's count at the end of the run
    /// (`kv_router_worker_recent_work_tokens`, decayed by the router's half-life).
    pub router_recent_work: Option<f64>,
    pub sim_seconds: f64,
}

impl WorkerCounts {
    pub fn from_metrics(text: &str) -> Self {
        let p = "kvbm_mocker_prompt_tokens_total";
        Self {
            computed: prom_sum(text, p, Some(("source", "computed"))),
            gpu: prom_sum(text, p, Some(("source", "gpu"))),
            host: prom_sum(text, p, Some(("source", "host"))),
            disk: prom_sum(text, p, Some(("source", "disk"))),
            shared: prom_sum(text, p, Some(("source", "shared"))),
            requests: prom_sum(text, "kvbm_mocker_requests_total", None),
            prefill_tokens: prom_sum(text, "kvbm_mocker_prefill_tokens_total", None),
            generation_tokens: prom_sum(text, "kvbm_mocker_generation_tokens_total", None),
            preemptions: prom_sum(text, "kvbm_mocker_preemptions_total", None),
            router_uncached: None,
            router_recent_work: None,
            sim_seconds: prom_sum(text, "kvbm_mocker_sim_seconds", None),
        }
    }
    fn prompt_tokens(&self) -> f64 {
        self.computed + self.gpu + self.host + self.disk + self.shared
    }
}

/// Fractions of prompt tokens by where the workers found them.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Reuse {
    pub computed: f64,
    pub gpu: f64,
    pub host: f64,
    pub disk: f64,
    /// From the fleet's shared pool.
    pub shared: f64,
    /// Prompt tokens the workers counted (all tiers).
    pub prompt_tokens: f64,
}

/// max / mean over workers.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Imbalance {
    /// Of each prompt's tokens computed at its first admission (vLLM's count).
    pub computed_prompt_tokens: f64,
    /// Of the tokens each worker ran through prefill, recomputed ones (after a preemption)
    /// included: the prefill work it did.
    pub prefill_tokens: f64,
    pub requests: f64,
}

/// CPU seconds spent during the trace.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Cpu {
    pub router_s: Option<f64>,
    pub router_ms_per_request: Option<f64>,
    pub router_ms_per_1k_prompt_tokens: Option<f64>,
    /// Of `router_s`, the threads following the workers' events (subscribers, pump).
    pub router_events_s: Option<f64>,
    /// The rest (tokenizing, scoring, proxying) per request: the front end's own cost.
    pub front_end_ms_per_request: Option<f64>,
    /// Of `front_end_ms_per_request`, the part spent in the kernel (socket reads and writes,
    /// polling, wake-ups): a floor for relaying that grows with the events a stream carries.
    pub front_end_kernel_ms_per_request: Option<f64>,
    pub mocker_s: Option<f64>,
    pub client_s: Option<f64>,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub label: String,
    pub mode: String,
    pub router_flags: Vec<String>,
    /// Why the run did not complete (the fleet or router did not start...), if it did not.
    pub failed: Option<String>,
    pub requests: usize,
    pub answered: usize,
    pub errors: usize,
    pub error_samples: Vec<String>,
    pub dropped: usize,
    pub ttft_s: Summary,
    pub itl_s: Summary,
    pub e2e_s: Summary,
    pub makespan_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub prompt_tokens: u64,
    /// The answered prompts' lengths by the trace: equal to `prompt_tokens` when the router's
    /// tokenizer gave back exactly the replay's tokens.
    pub trace_prompt_tokens: u64,
    pub cached_tokens: u64,
    pub mean_prompt_tokens: f64,
    pub output_tokens: u64,
    /// Server-sent events a streamed answer carried, on average (each one relayed by the
    /// router's front end).
    pub stream_events_per_request: f64,
    pub reuse: Reuse,
    pub imbalance: Imbalance,
    pub workers: Vec<WorkerCounts>,
    /// Workers whose metrics could not be read after the run (or a mocker that had exited).
    pub metrics_errors: Vec<String>,
    /// The largest lag behind wall time any worker's simulated clock had (simulated seconds,
    /// read after the run): how far the mocker fell short of `--speedup`.
    pub mocker_lag_max_s: Option<f64>,
    pub cpu: Cpu,
    pub engine: Option<Json>,
    pub scale: Option<Scale>,
    pub debug_cost: Option<Json>,
    /// The router's `kv_router_frontend_prompt_bytes_total{how}` after the run.
    pub prompt_bytes: Option<PromptBytes>,
    pub wall_s: f64,
    /// Which of `--repeat` rounds this run was (0 for the first).
    pub repeat: usize,
}

fn max_over_mean(values: impl Iterator<Item = f64> + Clone) -> f64 {
    let n = values.clone().count();
    let sum: f64 = values.clone().sum();
    if n == 0 || sum <= 0.0 {
        return f64::NAN;
    }
    values.fold(0.0, f64::max) / (sum / n as f64)
}

impl RunResult {
    pub fn failed(spec: &RunSpec, why: String) -> Self {
        let mut r = Self::from_records(spec, &[], 1.0, Vec::new());
        r.failed = Some(why);
        r
    }

    pub fn from_records(
        spec: &RunSpec,
        records: &[Record],
        speedup: f64,
        workers: Vec<WorkerCounts>,
    ) -> Self {
        let mut ttft = Vec::new();
        let mut itl = Vec::new();
        let mut e2e = Vec::new();
        let (mut errors, mut dropped, mut answered) = (0, 0, 0);
        let mut samples: Vec<String> = Vec::new();
        let (mut prompt_tokens, mut cached_tokens, mut output_tokens) = (0u64, 0u64, 0u64);
        let (mut trace_prompt_tokens, mut stream_events) = (0u64, 0u64);
        let (mut first, mut last) = (f64::INFINITY, 0.0f64);
        for r in records {
            let Some(a) = &r.answer else {
                dropped += 1;
                continue;
            };
            first = first.min(r.sent_s);
            last = last.max(r.sent_s + a.done_s * speedup);
            if let Some(e) = &a.error {
                errors += 1;
                if samples.len() < 5 && !samples.contains(e) {
                    samples.push(e.clone());
                }
                continue;
            }
            answered += 1;
            if let Some(t) = a.first_token_s {
                ttft.push(t * speedup);
            }
            if let Some(t) = a.itl_s() {
                itl.push(t * speedup);
            }
            e2e.push(a.done_s * speedup);
            prompt_tokens += a.prompt_tokens.unwrap_or(0);
            trace_prompt_tokens += r.nominal_prompt_tokens as u64;
            cached_tokens += a.cached_tokens.unwrap_or(0);
            output_tokens += a.completion_tokens.unwrap_or(0);
            stream_events += a.chunks as u64;
        }
        let makespan = if last > first { last - first } else { f64::NAN };
        let total: f64 = workers.iter().map(WorkerCounts::prompt_tokens).sum();
        let frac = |f: fn(&WorkerCounts) -> f64| {
            if total > 0.0 {
                workers.iter().map(f).sum::<f64>() / total
            } else {
                f64::NAN
            }
        };
        let reuse = Reuse {
            computed: frac(|w| w.computed),
            gpu: frac(|w| w.gpu),
            host: frac(|w| w.host),
            disk: frac(|w| w.disk),
            shared: frac(|w| w.shared),
            prompt_tokens: total,
        };
        let imbalance = Imbalance {
            computed_prompt_tokens: max_over_mean(workers.iter().map(|w| w.computed)),
            prefill_tokens: max_over_mean(workers.iter().map(|w| w.prefill_tokens)),
            requests: max_over_mean(workers.iter().map(|w| w.requests)),
        };
        Self {
            label: spec.label.clone(),
            mode: spec.mode.clone(),
            router_flags: spec.router_flags.clone(),
            failed: None,
            requests: records.len(),
            answered,
            errors,
            error_samples: samples,
            dropped,
            ttft_s: Summary::of(&ttft),
            itl_s: Summary::of(&itl),
            e2e_s: Summary::of(&e2e),
            makespan_s: makespan,
            requests_per_s: answered as f64 / makespan,
            output_tokens_per_s: output_tokens as f64 / makespan,
            prompt_tokens,
            trace_prompt_tokens,
            cached_tokens,
            mean_prompt_tokens: if answered > 0 {
                prompt_tokens as f64 / answered as f64
            } else {
                f64::NAN
            },
            output_tokens,
            stream_events_per_request: if answered > 0 {
                stream_events as f64 / answered as f64
            } else {
                f64::NAN
            },
            reuse,
            imbalance,
            workers,
            metrics_errors: Vec::new(),
            mocker_lag_max_s: None,
            cpu: Cpu::default(),
            engine: None,
            scale: None,
            debug_cost: None,
            prompt_bytes: None,
            wall_s: 0.0,
            repeat: 0,
        }
    }

    pub fn set_cpu(&mut self, router: Option<f64>, mocker: Option<f64>, client: Option<f64>) {
        let routed = self.answered + self.errors;
        self.cpu = Cpu {
            router_s: router,
            router_ms_per_request: router
                .filter(|_| routed > 0)
                .map(|s| s * 1e3 / routed as f64),
            router_ms_per_1k_prompt_tokens: router
                .filter(|_| self.prompt_tokens > 0)
                .map(|s| s * 1e3 / (self.prompt_tokens as f64 / 1e3)),
            router_events_s: None,
            front_end_ms_per_request: None,
            front_end_kernel_ms_per_request: None,
            mocker_s: mocker,
            client_s: client,
        };
    }

    /// Splits the router's CPU: `events` seconds were its event threads'; of the router's
    /// and the event threads' time, `system` seconds were in the kernel.
    pub fn set_router_events_cpu(&mut self, events: Option<f64>, system: Option<(f64, f64)>) {
        let routed = self.answered + self.errors;
        let per_request = |s: f64| (routed > 0).then(|| s.max(0.0) * 1e3 / routed as f64);
        self.cpu.router_events_s = events;
        self.cpu.front_end_ms_per_request = match (self.cpu.router_s, events) {
            (Some(all), Some(ev)) => per_request(all - ev),
            _ => None,
        };
        self.cpu.front_end_kernel_ms_per_request =
            system.and_then(|(all, ev)| per_request(all - ev));
    }
}

fn git_commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The label of the best run with fixed weights (not `tuned`): the lowest mean TTFT.
/// One setting over its `--repeat` runs: medians, and the spread of p90.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Medians {
    pub label: String,
    pub mode: String,
    /// Completed runs.
    pub runs: usize,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub ttft_mean_s: f64,
    pub ttft_p90_min_s: f64,
    pub ttft_p90_max_s: f64,
    pub imbalance: f64,
    /// Of the prefill work, recomputed tokens included.
    pub imbalance_prefill: f64,
    pub front_end_ms_per_request: f64,
    pub front_end_kernel_ms_per_request: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Each setting's medians over its completed runs, in the order the settings first ran.
pub fn medians(runs: &[RunResult]) -> Vec<Medians> {
    let mut labels: Vec<&str> = Vec::new();
    for r in runs {
        if !labels.contains(&r.label.as_str()) {
            labels.push(&r.label);
        }
    }
    labels
        .into_iter()
        .map(|label| {
            let done: Vec<&RunResult> = runs
                .iter()
                .filter(|r| r.label == label && r.failed.is_none())
                .collect();
            let of = |f: &dyn Fn(&RunResult) -> f64| median(done.iter().map(|r| f(r)).collect());
            let p90s = done.iter().map(|r| r.ttft_s.p90).filter(|x| x.is_finite());
            Medians {
                label: label.to_owned(),
                mode: runs
                    .iter()
                    .find(|r| r.label == label)
                    .map_or_else(String::new, |r| r.mode.clone()),
                runs: done.len(),
                ttft_p50_s: of(&|r| r.ttft_s.p50),
                ttft_p90_s: of(&|r| r.ttft_s.p90),
                ttft_p99_s: of(&|r| r.ttft_s.p99),
                ttft_mean_s: of(&|r| r.ttft_s.mean),
                ttft_p90_min_s: p90s.clone().fold(f64::NAN, f64::min),
                ttft_p90_max_s: p90s.fold(f64::NAN, f64::max),
                imbalance: of(&|r| r.imbalance.computed_prompt_tokens),
                imbalance_prefill: of(&|r| r.imbalance.prefill_tokens),
                front_end_ms_per_request: of(&|r| {
                    r.cpu.front_end_ms_per_request.unwrap_or(f64::NAN)
                }),
                front_end_kernel_ms_per_request: of(&|r| {
                    r.cpu.front_end_kernel_ms_per_request.unwrap_or(f64::NAN)
                }),
            }
        })
        .collect()
}

/// The fixed setting (any mode but `tuned`) with the lowest median mean TTFT.
fn best_fixed(medians: &[Medians]) -> Option<&Medians> {
    medians
        .iter()
        .filter(|m| m.mode != "tuned" && m.runs > 0 && m.ttft_mean_s.is_finite())
        .min_by(|a, b| a.ttft_mean_s.total_cmp(&b.ttft_mean_s))
}

/// The whole output document.
pub fn output(args: &ReplayArgs, sessions: &[Session], runs: Vec<RunResult>, wall_s: f64) -> Json {
    let medians = medians(&runs);
    let best = best_fixed(&medians).map(|m| m.label.clone());
    json!({
        "command": std::env::args().collect::<Vec<_>>(),
        "git_commit": git_commit(),
        "trace": {
            "path": args.trace.display().to_string(),
            "format": args.format,
            "sessions": sessions.len(),
            "requests": sessions.iter().map(|s| s.turns.len()).sum::<usize>(),
        },
        "workers": args.workers,
        "load": args.load,
        "speedup": args.speedup,
        "preset": args.preset,
        "gpu_blocks": args.gpu_blocks,
        "host_blocks": args.host_blocks,
        "disk_blocks": args.disk_blocks,
        "seed": args.seed,
        "block_tokens": args.block_tokens,
        "max_output_tokens": args.max_output_tokens,
        "max_inflight": args.max_inflight,
        "vocab": args.vocab,
        "best_fixed": best,
        "repeat": args.repeat,
        "medians": medians,
        "wall_s": wall_s,
        "runs": runs,
    })
}

fn num(v: &Json, path: &str) -> f64 {
    v.pointer(path).and_then(Json::as_f64).unwrap_or(f64::NAN)
}

fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b > 0.0 {
        format!("{:.2}", a / b)
    } else {
        "-".into()
    }
}

fn fmt(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "-".into()
    }
}

/// The markdown table of an output document.
pub fn table(doc: &Json) -> String {
    let runs = doc["runs"].as_array().cloned().unwrap_or_default();
    let find = |label: &str| runs.iter().find(|r| r["label"] == label);
    let rr = find("round-robin");
    let best = doc["best_fixed"].as_str().and_then(find);
    let mut out = String::from(
        "| run | TTFT p50 | TTFT p90 | TTFT p99 | TTFT mean | ITL p50 (ms) | ITL p90 (ms) | E2E p50 | req/s | out tok/s | GPU hit | host hit | disk hit | shared hit | imbalance (tok) | imbalance (prefill) | router ms/req | front end ms/req | of which kernel | events/req | err | drop | p50 vs RR | p90 vs RR | p50 vs best fixed | p90 vs best fixed |\n\
         |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
    );
    for r in &runs {
        let label = r["label"].as_str().unwrap_or("?");
        if let Some(why) = r["failed"].as_str() {
            out.push_str(&format!(
                "| {label} | failed: {} |\n",
                why.lines().next().unwrap_or("")
            ));
            continue;
        }
        let pct = |p: &str| fmt(num(r, p) * 100.0, 1) + "%";
        let vs = |other: Option<&Json>, p: &str| {
            other.map_or("-".into(), |o| ratio(num(r, p), num(o, p)))
        };
        out.push_str(&format!(
            "| {label} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            fmt(num(r, "/ttft_s/p50"), 3),
            fmt(num(r, "/ttft_s/p90"), 3),
            fmt(num(r, "/ttft_s/p99"), 3),
            fmt(num(r, "/ttft_s/mean"), 3),
            fmt(num(r, "/itl_s/p50") * 1e3, 1),
            fmt(num(r, "/itl_s/p90") * 1e3, 1),
            fmt(num(r, "/e2e_s/p50"), 2),
            fmt(num(r, "/requests_per_s"), 2),
            fmt(num(r, "/output_tokens_per_s"), 0),
            pct("/reuse/gpu"),
            pct("/reuse/host"),
            pct("/reuse/disk"),
            pct("/reuse/shared"),
            fmt(num(r, "/imbalance/computed_prompt_tokens"), 2),
            fmt(num(r, "/imbalance/prefill_tokens"), 2),
            fmt(num(r, "/cpu/router_ms_per_request"), 3),
            fmt(num(r, "/cpu/front_end_ms_per_request"), 3),
            fmt(num(r, "/cpu/front_end_kernel_ms_per_request"), 3),
            fmt(num(r, "/stream_events_per_request"), 0),
            r["errors"],
            r["dropped"],
            vs(rr, "/ttft_s/p50"),
            vs(rr, "/ttft_s/p90"),
            vs(best, "/ttft_s/p50"),
            vs(best, "/ttft_s/p90"),
        ));
    }
    let medians = doc["medians"].as_array().cloned().unwrap_or_default();
    if medians.iter().any(|m| m["runs"].as_u64().unwrap_or(0) > 1) {
        let find = |label: &str| medians.iter().find(|m| m["label"] == label);
        let rr = find("round-robin");
        let best = doc["best_fixed"].as_str().and_then(find);
        out.push_str(
            "\nMedians over the repeated runs:\n\n\
             | setting | runs | TTFT p50 | TTFT p90 | p90 min-max | TTFT p99 | TTFT mean | imbalance (tok) | imbalance (prefill) | front end ms/req | of which kernel | p90 vs RR | p90 vs best fixed |\n\
             |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
        );
        for m in &medians {
            let vs = |other: Option<&Json>| {
                other.map_or("-".into(), |o| {
                    ratio(num(m, "/ttft_p90_s"), num(o, "/ttft_p90_s"))
                })
            };
            out.push_str(&format!(
                "| {} | {} | {} | {} | {}-{} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                m["label"].as_str().unwrap_or("?"),
                m["runs"],
                fmt(num(m, "/ttft_p50_s"), 3),
                fmt(num(m, "/ttft_p90_s"), 3),
                fmt(num(m, "/ttft_p90_min_s"), 2),
                fmt(num(m, "/ttft_p90_max_s"), 2),
                fmt(num(m, "/ttft_p99_s"), 3),
                fmt(num(m, "/ttft_mean_s"), 3),
                fmt(num(m, "/imbalance"), 2),
                fmt(num(m, "/imbalance_prefill"), 2),
                fmt(num(m, "/front_end_ms_per_request"), 3),
                fmt(num(m, "/front_end_kernel_ms_per_request"), 3),
                vs(rr),
                vs(best),
            ));
        }
    }
    out.push_str(&format!(
        "\nTimes in simulated seconds; best fixed setting (lowest median mean TTFT, not tuned): {}\n",
        doc["best_fixed"].as_str().unwrap_or("-")
    ));
    out
}

/// Fields every run of the output carries.
const RUN_FIELDS: &[&str] = &[
    "/label",
    "/requests",
    "/answered",
    "/errors",
    "/dropped",
    "/ttft_s/p50",
    "/itl_s/p50",
    "/e2e_s/p50",
    "/makespan_s",
    "/requests_per_s",
    "/output_tokens_per_s",
    "/reuse/gpu",
    "/reuse/host",
    "/reuse/disk",
    "/reuse/shared",
    "/imbalance/computed_prompt_tokens",
    "/imbalance/prefill_tokens",
    "/imbalance/requests",
    "/cpu/router_ms_per_request",
    "/cpu/front_end_ms_per_request",
    "/cpu/front_end_kernel_ms_per_request",
    "/stream_events_per_request",
    "/mean_prompt_tokens",
    "/engine/prefill_tokens_per_sec",
    "/scale/factor",
];

/// The functional failures of an output document (empty: all well).
pub fn check(doc: &Json) -> Vec<String> {
    let mut failures = Vec::new();
    for key in ["command", "trace", "runs", "workers", "speedup", "load"] {
        if doc.get(key).is_none() {
            failures.push(format!("the output has no {key:?}"));
        }
    }
    let runs = doc["runs"].as_array().cloned().unwrap_or_default();
    if runs.is_empty() {
        failures.push("no runs".into());
    }
    let expected = doc.pointer("/trace/requests").and_then(Json::as_u64);
    for r in &runs {
        let label = r["label"].as_str().unwrap_or("?");
        if let Some(why) = r["failed"].as_str() {
            failures.push(format!("{label}: the run failed: {why}"));
            continue;
        }
        for field in RUN_FIELDS {
            match r.pointer(field) {
                None => failures.push(format!("{label}: the output has no {field}")),
                Some(Json::Null) => failures.push(format!("{label}: {field} is null")),
                Some(_) => {}
            }
        }
        let answered = r["answered"].as_u64();
        if answered != expected {
            failures.push(format!(
                "{label}: {answered:?} requests answered whole of {expected:?}"
            ));
        }
        if r["errors"].as_u64() != Some(0) {
            failures.push(format!(
                "{label}: {} errors, e.g. {}",
                r["errors"], r["error_samples"]
            ));
        }
        if r["dropped"].as_u64() != Some(0) {
            failures.push(format!("{label}: {} requests dropped", r["dropped"]));
        }
        let counted = num(r, "/reuse/prompt_tokens");
        let sent = num(r, "/prompt_tokens");
        if counted != sent {
            failures.push(format!(
                "{label}: the workers counted {counted} prompt tokens, the answers' usage {sent}"
            ));
        }
        if doc.pointer("/trace/format") == Some(&json!("mooncake"))
            && r["trace_prompt_tokens"] != r["prompt_tokens"]
        {
            failures.push(format!(
                "{label}: the router counted {} prompt tokens, the trace says {}",
                r["prompt_tokens"], r["trace_prompt_tokens"]
            ));
        }
        if let Some(errors) = r["metrics_errors"].as_array().filter(|e| !e.is_empty()) {
            failures.push(format!("{label}: {}", errors[0]));
        }
        let workers = r["workers"].as_array().map_or(0, Vec::len) as u64;
        if doc["workers"].as_u64() != Some(workers) {
            failures.push(format!("{label}: metrics of {workers} workers"));
        }
        if r["mode"] == "tuned" && r["debug_cost"].is_null() {
            failures.push(format!("{label}: no /debug/cost from the tuned router"));
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(first: f64, last: f64, done: f64, tokens: u64, prompt: u64) -> Answer {
        Answer {
            first_token_s: Some(first),
            last_token_s: Some(last),
            done_s: done,
            streamed_tokens: tokens as usize,
            chunks: 1,
            prompt_tokens: Some(prompt),
            completion_tokens: Some(tokens),
            cached_tokens: Some(0),
            text: String::new(),
            done: true,
            error: None,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank_and_summaries_skip_nothing() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v);
        assert_eq!((s.n, s.mean), (100, 50.5));
        // Nearest rank on (n - 1) q: index 49.5 rounds to 50 -> 51; 89.1 -> 89 -> 90; 98.01 -> 99.
        assert_eq!((s.p50, s.p90, s.p99), (51.0, 90.0, 99.0));
        let one = Summary::of(&[3.0]);
        assert_eq!((one.p50, one.p99, one.mean), (3.0, 3.0, 3.0));
        assert!(Summary::of(&[]).p50.is_nan());
        // Order does not matter.
        let mut r = v.clone();
        r.reverse();
        assert_eq!(Summary::of(&r), s);
    }

    #[test]
    fn runs_report_simulated_times_reuse_and_imbalance() {
        let spec = RunSpec {
            label: "kv".into(),
            mode: "kv".into(),
            router_flags: vec![],
        };
        let mut bad = answer(0.1, 0.1, 0.2, 1, 10);
        bad.error = Some("HTTP 500".into());
        let records = vec![
            Record {
                session: 0,
                turn: 0,
                sent_s: 0.0,
                nominal_prompt_tokens: 100,
                answer: Some(answer(0.1, 0.5, 0.6, 5, 100)),
            },
            Record {
                session: 1,
                turn: 0,
                sent_s: 2.0,
                nominal_prompt_tokens: 300,
                answer: Some(answer(0.2, 0.2, 0.4, 1, 300)),
            },
            Record {
                session: 2,
                turn: 0,
                sent_s: 3.0,
                nominal_prompt_tokens: 10,
                answer: Some(bad),
            },
            Record {
                session: 3,
                turn: 0,
                sent_s: 3.0,
                nominal_prompt_tokens: 10,
                answer: None,
            },
        ];
        let workers = vec![
            WorkerCounts {
                computed: 300.0,
                gpu: 100.0,
                requests: 1.0,
                // A preempted request's 100 tokens computed again.
                prefill_tokens: 400.0,
                ..Default::default()
            },
            WorkerCounts {
                computed: 100.0,
                prefill_tokens: 100.0,
                host: 100.0,
                disk: 0.0,
                requests: 3.0,
                ..Default::default()
            },
        ];
        let mut r = RunResult::from_records(&spec, &records, 10.0, workers);
        assert_eq!((r.answered, r.errors, r.dropped, r.requests), (2, 1, 1, 4));
        assert_eq!(r.error_samples, vec!["HTTP 500".to_owned()]);
        // One chunk each; the error's not counted.
        assert_eq!(r.stream_events_per_request, 1.0);
        // Simulated: wall × 10.
        // Nearest rank of two: index round(0.5) = 1.
        assert_eq!(r.ttft_s.p50, 2.0);
        assert_eq!(r.ttft_s.mean, 1.5);
        assert_eq!(r.itl_s.n, 1);
        assert!((r.itl_s.p50 - 1.0).abs() < 1e-12); // (0.5 - 0.1) / 4 × 10
                                                    // First send at 0, last answer end at 0 + 6.0 (the error's ends at 3.0 + 2.0).
        assert_eq!(r.makespan_s, 6.0);
        assert!((r.requests_per_s - 2.0 / 6.0).abs() < 1e-12);
        assert!((r.output_tokens_per_s - 1.0).abs() < 1e-12);
        assert_eq!(r.mean_prompt_tokens, 200.0);
        assert_eq!(r.reuse.prompt_tokens, 600.0);
        assert!((r.reuse.computed - 400.0 / 600.0).abs() < 1e-12);
        assert!((r.reuse.gpu - 100.0 / 600.0).abs() < 1e-12);
        assert_eq!(r.reuse.disk, 0.0);
        assert_eq!(r.imbalance.computed_prompt_tokens, 1.5); // 300 / 200
        assert_eq!(r.imbalance.prefill_tokens, 1.6); // 400 / 250
        assert_eq!(r.imbalance.requests, 1.5); // 3 / 2
        r.set_cpu(Some(0.3), None, None);
        assert_eq!(r.cpu.router_ms_per_request, Some(100.0)); // 0.3 s over 3 routed
        assert_eq!(r.cpu.router_ms_per_1k_prompt_tokens, Some(750.0)); // 0.3 s / 0.4K

        // 0.1 s of the router's in the kernel, 0.04 s of it its event threads'.
        r.set_router_events_cpu(Some(0.12), Some((0.1, 0.04)));
        // 0.18 s / 3
        assert!((r.cpu.front_end_ms_per_request.unwrap() - 60.0).abs() < 1e-9);
        // (0.1 - 0.04) s / 3
        assert!((r.cpu.front_end_kernel_ms_per_request.unwrap() - 20.0).abs() < 1e-9);
    }

    #[test]
    fn the_work_the_router_expected_is_read_per_worker() {
        let text = "# TYPE kv_router_worker_prompt_tokens_total counter\n\
                    kv_router_worker_prompt_tokens_total{worker_id=\"1\",dp_rank=\"0\",part=\"routed\"} 900\n\
                    kv_router_worker_prompt_tokens_total{worker_id=\"1\",dp_rank=\"0\",part=\"uncached\"} 400\n\
                    kv_router_worker_prompt_tokens_total{worker_id=\"12\",dp_rank=\"0\",part=\"uncached\"} 70\n\
                    kv_router_worker_prompt_tokens_total{worker_id=\"1\",dp_rank=\"1\",part=\"uncached\"} 5\n";
        assert_eq!(router_uncached(text, "1"), Some(400.0));
        let work = "kv_router_worker_recent_work_tokens{dp_rank=\"0\",worker_id=\"1\"} 1234.5\n\
                    kv_router_worker_recent_work_tokens{dp_rank=\"0\",worker_id=\"12\"} 9\n";
        assert_eq!(router_recent_work(work, "1"), Some(1234.5));
        assert_eq!(router_recent_work(work, "12"), Some(9.0));
        assert_eq!(router_recent_work(work, "2"), None);
        assert_eq!(router_uncached(text, "12"), Some(70.0));
        assert_eq!(router_uncached(text, "2"), None);
    }

    #[test]
    fn the_routers_prompt_bytes_are_read_by_how() {
        let text = "# TYPE kv_router_frontend_prompt_bytes_total counter\n\
                    kv_router_frontend_prompt_bytes_total{how=\"cached\"} 2048\n\
                    kv_router_frontend_prompt_bytes_total{how=\"skipped\"} 1e6\n\
                    kv_router_frontend_prompt_bytes_total{how=\"tokenized\"} 512\n\
                    kv_router_frontend_prompt_bytes_totalx{how=\"tokenized\"} 7\n";
        let b = PromptBytes::from_metrics(text);
        assert_eq!((b.tokenized, b.cached, b.skipped), (512.0, 2048.0, 1e6));
        assert_eq!(PromptBytes::from_metrics(""), PromptBytes::default());
    }

    #[test]
    fn repeated_runs_give_each_setting_its_medians_and_the_best_by_them() {
        let run = |label: &str, mode: &str, p90: f64, mean: f64, failed: bool| {
            let spec = RunSpec {
                label: label.into(),
                mode: mode.into(),
                router_flags: vec![],
            };
            let mut r = RunResult::from_records(&spec, &[], 1.0, Vec::new());
            r.ttft_s = Summary {
                n: 1,
                mean,
                p50: mean,
                p90,
                p99: p90,
            };
            if failed {
                r.failed = Some("down".into());
            }
            r
        };
        let runs = vec![
            run("kv", "kv", 4.0, 1.0, false),
            run("tuned", "tuned", 1.0, 0.1, false),
            run("round-robin", "round-robin", 40.0, 9.0, false),
            run("kv", "kv", 6.0, 3.0, false),
            run("tuned", "tuned", 1.0, 0.1, false),
            run("round-robin", "round-robin", 30.0, 8.0, false),
            run("kv", "kv", 5.0, 2.0, false),
            run("kv", "kv", 99.0, 99.0, true),
        ];
        let m = medians(&runs);
        let labels: Vec<&str> = m.iter().map(|m| m.label.as_str()).collect();
        assert_eq!(labels, ["kv", "tuned", "round-robin"], "first-run order");
        let kv = &m[0];
        // The failed run is left out: the median of three, and their spread.
        assert_eq!(kv.runs, 3);
        assert_eq!((kv.ttft_p90_s, kv.ttft_mean_s), (5.0, 2.0));
        assert_eq!((kv.ttft_p90_min_s, kv.ttft_p90_max_s), (4.0, 6.0));
        // An even count: the mean of the middle two.
        assert_eq!(m[2].ttft_p90_s, 35.0);
        // Tuned is never the best fixed setting, however good.
        assert_eq!(best_fixed(&m).map(|m| m.label.as_str()), Some("kv"));
    }

    #[test]
    fn the_check_names_what_failed_and_passes_a_clean_run() {
        let spec = RunSpec {
            label: "round-robin".into(),
            mode: "round-robin".into(),
            router_flags: vec![],
        };
        let records = vec![Record {
            session: 0,
            turn: 0,
            sent_s: 0.0,
            nominal_prompt_tokens: 10,
            answer: Some(answer(0.1, 0.2, 0.3, 2, 10)),
        }];
        let workers = vec![WorkerCounts {
            computed: 10.0,
            prefill_tokens: 10.0,
            requests: 1.0,
            ..Default::default()
        }];
        let mut r = RunResult::from_records(&spec, &records, 1.0, workers);
        r.engine = Some(json!({"prefill_tokens_per_sec": 1000.0}));
        r.scale = Some(Scale {
            origin: 0.0,
            factor: 1.0,
            trace_span_s: 0.0,
            prompt_tokens: 10,
            offered_prompt_tokens_per_s: 0.0,
        });
        r.set_cpu(Some(0.01), Some(0.1), Some(0.1));
        r.set_router_events_cpu(Some(0.004), Some((0.003, 0.001)));
        let doc = |runs: Vec<RunResult>| {
            json!({"command": [], "trace": {"requests": 1}, "workers": 1, "speedup": 1.0,
                   "load": 1.0, "runs": runs, "best_fixed": "round-robin"})
        };
        let clean = doc(vec![r.clone()]);
        assert_eq!(check(&clean), Vec::<String>::new());
        assert!(table(&clean).contains("| round-robin | 0.100 |"));

        let mut tuned = r.clone();
        tuned.label = "tuned".into();
        tuned.mode = "tuned".into();
        tuned.errors = 1;
        tuned.reuse.prompt_tokens = 9.0;
        let failures = check(&doc(vec![r.clone(), tuned]));
        assert_eq!(failures.len(), 3, "{failures:?}");
        assert!(failures.iter().any(|f| f.contains("tuned: 1 errors")));
        assert!(failures.iter().any(|f| f.contains("counted 9")));
        assert!(failures.iter().any(|f| f.contains("/debug/cost")));

        let failed = RunResult::failed(&spec, "the mocker exited".into());
        let failures = check(&doc(vec![failed]));
        assert!(failures[0].contains("the mocker exited"), "{failures:?}");
    }
}
