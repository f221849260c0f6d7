//! `kvbm-bench replay`: a request trace replayed through kvbm-router's OpenAI front end against a
//! fleet of simulated vLLM workers (`kvbm-mocker`), once per routing mode, each mode on a fresh
//! fleet and router, with the same arrivals.
//!
//! Time: the mocker simulates an engine at `--speedup` times wall-clock speed. The trace's clock
//! is stretched so that its prompt tokens arrive at `--load` × workers × one worker's no-cache
//! throughput on the trace's mix (`capacity`: the mocker's own step-time model, prefill,
//! attention and decodes of every request with nothing cached, in simulated time), then divided by
//! `--speedup` for wall time; every latency is reported in simulated seconds (wall × speedup).
//! Arrivals are open loop: a request is sent at its time whatever is still running, up to
//! `--max-inflight` requests at once (beyond that it is dropped and counted). Turns of a session
//! wait for the previous answer (see `trace`).
//!
//! Prompts go as text to `/v1/completions` (`tokens`), so the router tokenizes them as it does any
//! user's; answers are streamed, `max_tokens` = the trace's output length (at least 1),
//! `ignore_eos`, with usage.

pub mod capacity;
pub mod client;
pub mod fleet;
pub mod report;
pub mod tokens;
pub mod trace;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value as Json;

use fleet::Process;
use report::{Record, RunResult, RunSpec};
use tokens::TokenMap;
use trace::{Format, Part, Session};

/// The name the model is served under, by the mocker and the router alike.
const MODEL_NAME: &str = "replay";

/// Arguments of `kvbm-bench replay`.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// The trace (JSON lines).
    #[arg(long)]
    pub trace: PathBuf,
    /// Its format: Mooncake FAST'25 requests, or this crate's multi-turn sessions.
    #[arg(long, value_enum, default_value = "mooncake")]
    pub format: Format,
    /// Replay only the first N requests (sessions, for the sessions format).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Tokens each Mooncake hash id stands for (512 as traced; fewer shrinks the prompts for
    /// quick functional runs, keeping which requests share which blocks).
    #[arg(long, default_value_t = trace::MOONCAKE_BLOCK_TOKENS)]
    pub block_tokens: usize,
    /// Cut every answer to at most this many tokens (quick functional runs).
    #[arg(long)]
    pub max_output_tokens: Option<usize>,
    /// Simulated workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Routing modes, one run each (the router's --router-mode).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,random,least-loaded,kv-gpu,kv,dynamo,tuned"
    )]
    pub modes: Vec<String>,
    /// Extra runs: KEY=V1,V2,... with KEY one of `kv`'s weights (prefill_load_scale,
    /// kv_overlap_score_credit, host_cache_hit_weight, disk_cache_hit_weight, balance_weight,
    /// balance_half_life_secs) or `tuned`'s (tuned_externality, tuned_load_bound) (repeatable).
    #[arg(long)]
    pub sweep: Vec<String>,
    /// Offered prompt tokens as a fraction of the fleet's no-cache prefill throughput.
    #[arg(long, default_value_t = 1.1)]
    pub load: f64,
    /// Simulated seconds per wall second (the mocker's --speedup).
    #[arg(long, default_value_t = 10.0)]
    pub speedup: f64,
    /// The mocker's engine preset.
    #[arg(long, default_value = "llama3-8b-h100")]
    pub preset: String,
    /// GPU blocks per worker (the preset's when not given).
    #[arg(long)]
    pub gpu_blocks: Option<u64>,
    /// Host blocks per worker (the preset's when not given).
    #[arg(long)]
    pub host_blocks: Option<u64>,
    /// Disk blocks per worker (the preset's when not given).
    #[arg(long)]
    pub disk_blocks: Option<u64>,
    /// Where the results go (JSON).
    #[arg(long, default_value = "replay-results.json")]
    pub out: PathBuf,
    /// The mocker binary (default: kvbm-mocker next to this executable).
    #[arg(long)]
    pub mocker_bin: Option<PathBuf>,
    /// The router binary (default: kvbm-router next to this executable).
    #[arg(long)]
    pub router_bin: Option<PathBuf>,
    /// Seed of the token mapping (and passed to the mocker and the router's random mode).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Requests in flight at most; one that would exceed it is dropped (and reported).
    #[arg(long, default_value_t = 4096)]
    pub max_inflight: usize,
    /// Words in the replay tokenizer's vocabulary.
    #[arg(long, default_value_t = tokens::VOCAB_DEFAULT)]
    pub vocab: u32,
    /// Functional checks (every request answered whole, no errors, no drops, the mocker counted
    /// every prompt token, the JSON complete): exit 1 with what failed.
    #[arg(long)]
    pub check: bool,
    /// An extra argument for every mocker (repeatable; e.g. calibration flags).
    #[arg(long = "mocker-arg", allow_hyphen_values = true)]
    pub mocker_args: Vec<String>,
    /// An extra argument for every router (repeatable).
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    pub router_args: Vec<String>,
    /// Run every setting this many times, in rounds (each round runs every setting once, so drift
    /// on the machine spreads over all of them); the table adds each setting's medians.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Seconds the fleet and the router have to come up.
    #[arg(long, default_value_t = 120.0)]
    pub start_timeout_s: f64,
}

/// The routing mode and router flag of a sweep key (Dynamo's names for `kv`'s weights, see
/// kvbm-router's config; `tuned_externality` for `tuned`).
fn sweep_flag(key: &str) -> anyhow::Result<(&'static str, &'static str)> {
    Ok(match key {
        "prefill_load_scale" => ("kv", "--router-prefill-load-scale"),
        "kv_overlap_score_credit" => ("kv", "--router-kv-overlap-score-credit"),
        "host_cache_hit_weight" => ("kv", "--router-host-cache-hit-weight"),
        "disk_cache_hit_weight" => ("kv", "--router-disk-cache-hit-weight"),
        "balance_weight" => ("kv", "--router-balance-weight"),
        "balance_half_life_secs" => ("kv", "--router-balance-half-life-secs"),
        "tuned_externality" => ("tuned", "--router-tuned-externality"),
        "tuned_load_bound" => ("tuned", "--router-tuned-load-bound"),
        _ => bail!(
            "--sweep {key:?}: not one of prefill_load_scale, kv_overlap_score_credit, host_cache_hit_weight, disk_cache_hit_weight, balance_weight, balance_half_life_secs, tuned_externality, tuned_load_bound"
        ),
    })
}

/// The runs the arguments ask for, in order: the modes, then the sweep's runs (`kv`'s, or
/// `tuned`'s for its key).
pub fn run_specs(modes: &[String], sweeps: &[String]) -> anyhow::Result<Vec<RunSpec>> {
    let mut specs: Vec<RunSpec> = modes
        .iter()
        .map(|m| m.trim())
        .filter(|m| !m.is_empty())
        .map(|m| RunSpec {
            label: m.to_owned(),
            mode: m.to_owned(),
            router_flags: Vec::new(),
        })
        .collect();
    for sweep in sweeps {
        let (key, values) = sweep
            .split_once('=')
            .with_context(|| format!("--sweep {sweep:?}: expected KEY=V1,V2,..."))?;
        let (mode, flag) = sweep_flag(key.trim())?;
        for v in values.split(',').map(str::trim).filter(|v| !v.is_empty()) {
            let x: f64 = v
                .parse()
                .with_context(|| format!("--sweep {sweep:?}: {v:?} is not a number"))?;
            specs.push(RunSpec {
                label: format!("{mode} {}={v}", key.trim()),
                mode: mode.into(),
                router_flags: vec![flag.into(), x.to_string()],
            });
        }
    }
    if specs.is_empty() {
        bail!("no routing mode to run");
    }
    Ok(specs)
}

fn binary(given: &Option<PathBuf>, name: &str) -> anyhow::Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p.clone());
    }
    let me = std::env::current_exe().context("locating kvbm-bench")?;
    let p = me.with_file_name(name);
    if !p.exists() {
        bail!(
            "{} does not exist: build it (cargo build -p {name}) or pass --{}-bin",
            p.display(),
            name.trim_start_matches("kvbm-")
        );
    }
    Ok(p)
}

/// Runs the whole comparison; `Ok(false)` when `--check` found a functional failure.
pub fn run(args: ReplayArgs) -> anyhow::Result<bool> {
    let wall = Instant::now();
    if args.workers == 0
        || args.speedup <= 0.0
        || args.load <= 0.0
        || args.max_inflight == 0
        || args.repeat == 0
    {
        bail!("--workers, --speedup, --load, --max-inflight and --repeat must be positive");
    }
    let specs = run_specs(&args.modes, &args.sweep)?;
    let mut sessions = trace::read(&args.trace, args.format, args.requests)?;
    if args.block_tokens == 0 {
        bail!("--block-tokens must be positive");
    }
    trace::shrink(&mut sessions, args.block_tokens, args.max_output_tokens);
    let mocker_bin = binary(&args.mocker_bin, "kvbm-mocker")?;
    let router_bin = binary(&args.router_bin, "kvbm-router")?;
    let map = TokenMap {
        seed: args.seed,
        vocab: args.vocab,
    };
    let tmp = tempfile::Builder::new().prefix("kvbm-replay-").tempdir()?;
    let model_dir = tmp.path().join("model");
    std::fs::create_dir(&model_dir)?;
    tokens::write_model_dir(&model_dir, args.vocab)?;
    // The first prompt must come back from the router's tokenizer as its ids.
    let mut first = Vec::new();
    if let Some(p) = &sessions[0].prefix {
        map.extend(p, &mut first);
    }
    map.extend(&sessions[0].turns[0].user, &mut first);
    tokens::check_round_trip(&model_dir, &first)?;

    let turns: usize = sessions.iter().map(|s| s.turns.len()).sum();
    eprintln!(
        "replay: {} sessions, {turns} requests, {} runs{}: {}",
        sessions.len(),
        specs.len() * args.repeat,
        if args.repeat > 1 {
            format!(" ({} rounds)", args.repeat)
        } else {
            String::new()
        },
        specs
            .iter()
            .map(|s| s.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let sessions = Arc::new(sessions);
    let mut results = Vec::new();
    let rounds = (0..args.repeat).flat_map(|round| specs.iter().map(move |s| (round, s)));
    for (i, (round, spec)) in rounds.enumerate() {
        let dir = tmp.path().join(format!("run{i}"));
        std::fs::create_dir(&dir)?;
        let started = Instant::now();
        let result = runtime.block_on(run_one(
            &args,
            spec,
            &sessions,
            map,
            &model_dir,
            &dir,
            &mocker_bin,
            &router_bin,
        ));
        let mut result = match result {
            Ok(mut r) => {
                r.wall_s = started.elapsed().as_secs_f64();
                r
            }
            Err(e) => {
                eprintln!("replay: {}: {e:#}", spec.label);
                RunResult::failed(spec, format!("{e:#}"))
            }
        };
        result.repeat = round;
        results.push(result);
    }
    if results
        .iter()
        .any(|r| r.failed.is_some() || r.errors > 0 || !r.metrics_errors.is_empty())
    {
        let kept = tmp.keep();
        eprintln!(
            "replay: some run went wrong; the mocker and router logs are kept in {}",
            kept.display()
        );
    }
    let output = report::output(&args, &sessions, results, wall.elapsed().as_secs_f64());
    let text = serde_json::to_string_pretty(&output)?;
    std::fs::write(&args.out, &text).with_context(|| format!("writing {}", args.out.display()))?;
    println!("{}", report::table(&output));
    println!(
        "results: {} ({:.0} s wall)",
        args.out.display(),
        wall.elapsed().as_secs_f64()
    );
    if args.check {
        let reread: Json = serde_json::from_str(&std::fs::read_to_string(&args.out)?)?;
        let failures = report::check(&reread);
        if !failures.is_empty() {
            for f in &failures {
                eprintln!("replay --check: {f}");
            }
            return Ok(false);
        }
        eprintln!("replay --check: every run answered every request whole");
    }
    Ok(true)
}

async fn get_json(client: &reqwest::Client, url: &str) -> anyhow::Result<Json> {
    let r = client.get(url).send().await?;
    let status = r.status();
    let text = r.text().await?;
    if !status.is_success() {
        bail!("GET {url}: HTTP {status}: {text}");
    }
    serde_json::from_str(&text).with_context(|| format!("GET {url}: not JSON"))
}

async fn get_text(client: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    let r = client.get(url).send().await?;
    let status = r.status();
    if !status.is_success() {
        bail!("GET {url}: HTTP {status}");
    }
    Ok(r.text().await?)
}

/// Waits until the router answers, follows every worker (links connected) and is healthy.
async fn wait_router(
    client: &reqwest::Client,
    router: &mut Process,
    base: &str,
    workers: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let until = Instant::now() + timeout;
    loop {
        router.check_alive()?;
        let ready = async {
            let w = get_json(client, &format!("{base}/workers")).await?;
            let list = w["workers"].as_array().cloned().unwrap_or_default();
            let connected = list
                .iter()
                .filter(|w| w.pointer("/link/state").and_then(Json::as_str) == Some("connected"))
                .count();
            if connected < workers {
                bail!("{connected} of {workers} workers connected");
            }
            let r = client.get(format!("{base}/health")).send().await?;
            if !r.status().is_success() {
                bail!("/health: {}", r.status());
            }
            anyhow::Ok(())
        }
        .await;
        match ready {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() > until => bail!(
                "the router was not ready within {timeout:?} ({e:#}); {}",
                router.log_tail()
            ),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The router's threads that follow the workers' KV events (its ZMQ subscribers, libzmq's I/O
/// threads, the pump that writes the index): their CPU is the index's, not the front end's.
const ROUTER_EVENT_THREADS: &[&str] = &["kvbm-sub-", "kvbm-router-pum", "ZMQbg"];

#[allow(clippy::too_many_arguments)]
async fn run_one(
    args: &ReplayArgs,
    spec: &RunSpec,
    sessions: &Arc<Vec<Session>>,
    map: TokenMap,
    model_dir: &std::path::Path,
    dir: &std::path::Path,
    mocker_bin: &std::path::Path,
    router_bin: &std::path::Path,
) -> anyhow::Result<RunResult> {
    let timeout = Duration::from_secs_f64(args.start_timeout_s);
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(args.max_inflight.min(1024))
        .build()?;

    let ready_file = dir.join("workers.ready");
    let mut cmd = Command::new(mocker_bin);
    cmd.arg("--workers")
        .arg(args.workers.to_string())
        .args(["--http-port", "0", "--zmq-port", "0"])
        .arg("--model-path")
        .arg(model_dir)
        .args(["--served-model-name", MODEL_NAME])
        .args(["--preset", &args.preset])
        .args(["--block-size", "16"])
        .arg("--speedup")
        .arg(args.speedup.to_string())
        .arg("--ready-file")
        .arg(&ready_file);
    for (flag, v) in [
        ("--gpu-blocks", args.gpu_blocks),
        ("--host-blocks", args.host_blocks),
        ("--disk-blocks", args.disk_blocks),
    ] {
        if let Some(v) = v {
            cmd.arg(flag).arg(v.to_string());
        }
    }
    cmd.args(&args.mocker_args);
    let mut mocker = Process::spawn("kvbm-mocker", cmd, dir.join("mocker.log"))?;
    let lines = fleet::wait_ready_file(&mut mocker, &ready_file, args.workers, timeout).await?;
    let https = lines
        .iter()
        .map(|l| fleet::worker_http(l))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let engine = get_json(&client, &format!("{}/v1/kvbm/mocker", https[0])).await?;
    // One worker's no-cache throughput on this trace's mix, attention and decodes included
    // (capacity.rs): prefill alone would offer far more than `--load` says.
    let capacity = capacity::WorkModel::from_info(&engine)?
        .no_cache_tokens_per_s(sessions, args.max_output_tokens);
    anyhow::ensure!(
        capacity > 0.0,
        "the mocker's cost model gives no capacity: {engine}"
    );
    let scale = trace::scale_for(sessions, args.load * args.workers as f64 * capacity);

    let port = fleet::free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let mut cmd = Command::new(router_bin);
    cmd.args(["--router-mode", &spec.mode])
        .arg("--model-path")
        .arg(model_dir)
        .args(["--model-name", MODEL_NAME])
        .args(["--block-size", "16"])
        .args(["--http-port", &port.to_string()])
        .args(["--workers", &lines.join(";")])
        // Every request in flight holds a connection to the router (its default is 1024).
        .args([
            "--max-connections",
            &(args.max_inflight + 256).max(1024).to_string(),
        ])
        .args(&spec.router_flags)
        .args(&args.router_args);
    let mut router = Process::spawn("kvbm-router", cmd, dir.join("router.log"))?;
    wait_router(&client, &mut router, &base, args.workers, timeout).await?;

    let cpu_before = (
        router.cpu_split_s(),
        mocker.cpu_s(),
        fleet::cpu_seconds("/proc/self/stat"),
        router.threads_cpu_split_s(ROUTER_EVENT_THREADS),
    );
    let records = drive(
        &client,
        &format!("{base}/v1/completions"),
        sessions,
        scale,
        args,
        map,
        &spec.label,
    )
    .await;
    let cpu_after = (
        router.cpu_split_s(),
        mocker.cpu_s(),
        fleet::cpu_seconds("/proc/self/stat"),
        router.threads_cpu_split_s(ROUTER_EVENT_THREADS),
    );
    let delta = |a: Option<f64>, b: Option<f64>| Some(b? - a?);

    // A worker that cannot be scraped leaves the run's latencies standing; the check fails it.
    let mut workers = Vec::new();
    let mut metrics_errors = Vec::new();
    for http in &https {
        match get_text(&client, &format!("{http}/metrics")).await {
            Ok(text) => workers.push(report::WorkerCounts::from_metrics(&text)),
            Err(e) => metrics_errors.push(format!("{http}/metrics: {e:#}")),
        }
    }
    let mut lag_max: Option<f64> = None;
    for http in &https {
        if let Ok(info) = get_json(&client, &format!("{http}/v1/kvbm/mocker")).await {
            if let Some(lag) = info["lag_max_seconds"].as_f64() {
                lag_max = Some(lag_max.map_or(lag, |m: f64| m.max(lag)));
            }
        }
    }
    if let Err(e) = mocker.check_alive() {
        metrics_errors.push(format!("{e:#}"));
    }
    // What the front end's tokenizer did with the prompt text (tokenized, cached, skipped), and
    // the work it expected each worker to compute.
    let router_metrics = get_text(&client, &format!("{base}/metrics")).await.ok();
    let prompt_bytes = router_metrics
        .as_deref()
        .map(report::PromptBytes::from_metrics);
    if let (Some(text), true) = (&router_metrics, workers.len() == lines.len()) {
        for (w, line) in workers.iter_mut().zip(&lines) {
            let id = line.split_once('=').map_or("", |(id, _)| id);
            w.router_uncached = report::router_uncached(text, id);
            w.router_recent_work = report::router_recent_work(text, id);
        }
    }
    let debug_cost = if spec.mode == "tuned" {
        match get_json(&client, &format!("{base}/debug/cost")).await {
            Ok(j) => Some(j),
            Err(e) => {
                eprintln!("replay: {}: /debug/cost: {e:#}", spec.label);
                None
            }
        }
    } else {
        None
    };
    router.stop(Duration::from_secs(5));
    mocker.stop(Duration::from_secs(5));

    let mut result = RunResult::from_records(spec, &records, args.speedup, workers);
    result.engine = Some(engine);
    result.scale = Some(scale);
    result.debug_cost = debug_cost;
    result.prompt_bytes = prompt_bytes;
    result.metrics_errors = metrics_errors;
    result.mocker_lag_max_s = lag_max;
    let total = |c: Option<fleet::CpuSplit>| c.map(|c| c.total());
    let system = |c: Option<fleet::CpuSplit>| c.map(|c| c.system);
    result.set_cpu(
        delta(total(cpu_before.0), total(cpu_after.0)),
        delta(cpu_before.1, cpu_after.1),
        delta(cpu_before.2, cpu_after.2),
    );
    result.set_router_events_cpu(
        delta(total(cpu_before.3), total(cpu_after.3)),
        delta(system(cpu_before.0), system(cpu_after.0))
            .zip(delta(system(cpu_before.3), system(cpu_after.3))),
    );
    Ok(result)
}

/// Sends every session's turns at their times; returns one record per turn.
async fn drive(
    client: &reqwest::Client,
    url: &str,
    sessions: &Arc<Vec<Session>>,
    scale: trace::Scale,
    args: &ReplayArgs,
    map: TokenMap,
    label: &str,
) -> Vec<Record> {
    let turns: usize = sessions.iter().map(|s| s.turns.len()).sum();
    let bar = ProgressBar::new(turns as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>24} {bar:40} {pos}/{len} {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(label.to_owned());
    let speedup = args.speedup;
    let keep_text = args.format == Format::Sessions;
    let permits = Arc::new(tokio::sync::Semaphore::new(args.max_inflight));
    // A little time to spawn every task before the first send.
    let t0 = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..sessions.len() {
        let sessions = Arc::clone(sessions);
        let client = client.clone();
        let url = url.to_owned();
        let permits = Arc::clone(&permits);
        let bar = bar.clone();
        let vocab = args.vocab;
        tasks.spawn(async move {
            let session = &sessions[index];
            let mut records = Vec::with_capacity(session.turns.len());
            let mut at = t0 + Duration::from_secs_f64(scale.sim(session.start).max(0.0) / speedup);
            let mut ids = Vec::new();
            if let Some(p) = &session.prefix {
                map.extend(p, &mut ids);
            }
            let mut prompt = String::new();
            tokens::write_words(&ids, &mut prompt);
            let mut dropped = false;
            for (t, turn) in session.turns.iter().enumerate() {
                if t > 0 {
                    at += Duration::from_secs_f64(scale.sim_duration(turn.think_s) / speedup);
                }
                let max_tokens = turn.output_tokens.max(1);
                ids.clear();
                map.extend(&turn.user, &mut ids);
                tokens::write_words(&ids, &mut prompt);
                let mut record = Record {
                    session: index,
                    turn: t,
                    sent_s: 0.0,
                    nominal_prompt_tokens: session.prompt_lengths()[t],
                    answer: None,
                };
                tokio::time::sleep_until(at).await;
                record.sent_s = (tokio::time::Instant::now() - t0).as_secs_f64() * speedup;
                let permit = if dropped {
                    None
                } else {
                    Arc::clone(&permits).try_acquire_owned().ok()
                };
                let Some(permit) = permit else {
                    // Over the in-flight bound: this turn and the session's later ones drop.
                    dropped = true;
                    bar.inc(1);
                    records.push(record);
                    continue;
                };
                let answer = client::complete(
                    &client,
                    &url,
                    MODEL_NAME,
                    prompt.clone(),
                    max_tokens,
                    keep_text,
                )
                .await;
                drop(permit);
                at = tokio::time::Instant::now();
                bar.inc(1);
                if keep_text && t + 1 < session.turns.len() {
                    append_answer(&answer.text, vocab, map, index, t, max_tokens, &mut prompt);
                }
                record.answer = Some(answer);
                records.push(record);
            }
            records
        });
    }
    let mut records = Vec::with_capacity(turns);
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(r) => records.extend(r),
            Err(e) => eprintln!("replay: a session task failed: {e}"),
        }
    }
    bar.finish_with_message("done");
    records.sort_by_key(|r| (r.session, r.turn));
    records
}

/// Appends a turn's answer to the conversation: the words the worker streamed when they are all
/// in the vocabulary (so the router tokenizes them back to the ids the worker generated), else
/// deterministic tokens of the answer's length.
fn append_answer(
    text: &str,
    vocab: u32,
    map: TokenMap,
    session: usize,
    turn: usize,
    max_tokens: usize,
    prompt: &mut String,
) {
    let words: Vec<&str> = text.split_whitespace().collect();
    if !words.is_empty() && words.iter().all(|w| tokens::word_id(w, vocab).is_some()) {
        for w in words {
            prompt.push(' ');
            prompt.push_str(w);
        }
    } else {
        let mut ids = Vec::new();
        map.extend(
            &Part::Stream {
                key: trace::stream_key(trace::KEY_ANSWER, session as u64, turn as u64),
                len: max_tokens,
            },
            &mut ids,
        );
        tokens::write_words(&ids, prompt);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_add_runs_of_their_mode_with_the_router_flag() {
        let specs = run_specs(
            &["round-robin".into(), " tuned".into(), "".into()],
            &[
                "prefill_load_scale=1,2.5".into(),
                "host_cache_hit_weight=0.5".into(),
                "tuned_externality=0".into(),
                "balance_weight=0.2".into(),
            ],
        )
        .unwrap();
        let labels: Vec<_> = specs.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "round-robin",
                "tuned",
                "kv prefill_load_scale=1",
                "kv prefill_load_scale=2.5",
                "kv host_cache_hit_weight=0.5",
                "tuned tuned_externality=0",
                "kv balance_weight=0.2"
            ]
        );
        assert_eq!(specs[6].router_flags, ["--router-balance-weight", "0.2"]);
        assert_eq!(specs[5].mode, "tuned");
        assert_eq!(specs[5].router_flags, ["--router-tuned-externality", "0"]);
        assert_eq!(specs[3].mode, "kv");
        assert_eq!(
            specs[3].router_flags,
            ["--router-prefill-load-scale", "2.5"]
        );
        assert_eq!(
            specs[4].router_flags,
            ["--router-host-cache-hit-weight", "0.5"]
        );
        assert!(run_specs(&[], &["nope=1".into()]).is_err());
        assert!(run_specs(&[], &["prefill_load_scale=x".into()]).is_err());
        assert!(run_specs(&[], &[]).is_err());
    }

    #[test]
    fn answers_join_the_conversation_as_streamed_or_as_placeholders() {
        let map = TokenMap {
            seed: 0,
            vocab: 100,
        };
        let mut prompt = "w1 w2".to_owned();
        append_answer(" w7 w8\nw9", 100, map, 0, 0, 3, &mut prompt);
        assert_eq!(prompt, "w1 w2 w7 w8 w9");
        // Words the vocabulary lacks: the answer's length in placeholder tokens.
        let mut prompt = "w1".to_owned();
        append_answer("hello there", 100, map, 0, 0, 4, &mut prompt);
        let words: Vec<_> = prompt.split(' ').collect();
        assert_eq!(words.len(), 5);
        assert!(words.iter().all(|w| tokens::word_id(w, 100).is_some()));
    }
}
