//! kvbm-mocker: a simulated vLLM fleet. Each worker answers vLLM 0.33's OpenAI API over HTTP and
//! publishes vLLM's KV events over ZMQ (PUB + replay ROUTER), driven by a discrete-step engine
//! model instead of a GPU, so that a router cannot tell it from `vllm serve` at its interfaces.
//!
//! Owns: the flags and presets ([`config`]), the engine ([`engine`]: vLLM v1's scheduler in
//! outline over kvbm-core's block pools), the HTTP front ([`http`]), the metrics ([`metrics`])
//! and the fleet that runs N workers in one process ([`Fleet`]). Does not own: tokenizing
//! (`kvbm_router::tokenize::ModelTokenizer`, so the router and the mocker agree on token ids),
//! the event wire form and transport (kvbm-events), block pools and eviction (kvbm-core).
//!
//! Invariants: a worker's simulated clock only moves forward, by modelled step durations or to
//! the wall time when it was idle; a request's blocks are released when it finishes, is
//! aborted or preempted; every GPU event carries engine hashes ([`engine::engine_hash`]), never
//! kvbm's; nothing a client sends can panic a worker (bad bodies get vLLM's 400).

pub mod config;
pub mod engine;
pub mod http;
pub mod metrics;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvbm_events::{EventPublisher, PublisherConfig, ZmqPublisher};
use kvbm_router::tokenize::ModelTokenizer;

use crate::config::{Args, EngineConfig};
use crate::engine::{Engine, Request};
use crate::metrics::WorkerMetrics;

/// The process-wide instant simulated time is measured from.
pub fn process_start() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// One running worker.
#[derive(Debug)]
pub struct WorkerHandle {
    /// Worker id (1-based).
    pub id: u64,
    /// HTTP address.
    pub http: SocketAddr,
    /// KV event PUB endpoint.
    pub events: String,
    /// Replay ROUTER endpoint.
    pub replay: String,
    /// Its metrics.
    pub metrics: Arc<WorkerMetrics>,
    _zmq: ZmqPublisher,
}

impl WorkerHandle {
    /// The worker in the router's `--workers` syntax.
    pub fn line(&self) -> String {
        format!(
            "{}={},replay={},http=http://{}",
            self.id, self.events, self.replay, self.http
        )
    }
}

/// N workers in this process. Dropping it stops their HTTP servers; their engine threads end
/// once their last request is done.
#[derive(Debug)]
pub struct Fleet {
    /// The workers, by id.
    pub workers: Vec<WorkerHandle>,
    /// The engine configuration every worker runs.
    pub config: EngineConfig,
    servers: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for s in &self.servers {
            s.abort();
        }
    }
}

impl Fleet {
    /// Starts every worker (on the current tokio runtime); returns once all listen.
    pub async fn start(args: &Args) -> anyhow::Result<Fleet> {
        let config = args.engine_config()?;
        let dir = args
            .model_path
            .clone()
            .context("--model-path is required (a directory with tokenizer.json)")?;
        let tokenizer = Arc::new(
            ModelTokenizer::from_dir(&dir)
                .map_err(|e| anyhow::anyhow!("--model-path {}: {e}", dir.display()))?,
        );
        let model = args.served_model_name.clone().unwrap_or_else(|| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| dir.display().to_string())
        });
        let start = process_start();
        // One pool for the whole fleet, as one Redis for the whole cluster.
        let shared = (config.shared_blocks > 0).then(|| {
            Arc::new(engine::SharedPool::new(
                &config.shared_pool,
                config.shared_blocks,
                config.block_size,
            ))
        });
        let mut workers = Vec::with_capacity(args.workers);
        let mut servers = Vec::with_capacity(args.workers);
        for i in 0..args.workers {
            let id = i as u64 + 1;
            let port = |base: u16, k: usize| if base == 0 { 0 } else { base as usize + k };
            let bus = EventPublisher::new();
            let zmq = ZmqPublisher::start(
                &bus,
                PublisherConfig::new(
                    format!("tcp://127.0.0.1:{}", port(args.zmq_port, 2 * i)),
                    Some(format!(
                        "tcp://127.0.0.1:{}",
                        port(args.zmq_port, 2 * i + 1)
                    )),
                ),
            )
            .with_context(|| {
                format!(
                    "worker {id}: binding its KV event sockets (--zmq-port {})",
                    args.zmq_port
                )
            })?;
            let addr: SocketAddr = ([127, 0, 0, 1], port(args.http_port, i) as u16).into();
            let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
                format!(
                    "worker {id}: binding {addr} (--http-port {})",
                    args.http_port
                )
            })?;
            let http = listener.local_addr()?;
            let metrics = Arc::new(WorkerMetrics::new());
            let (tx, rx) = crossbeam_channel::unbounded::<Request>();
            let engine =
                Engine::new(config.clone(), bus, metrics.clone()).with_shared(shared.clone());
            std::thread::Builder::new()
                .name(format!("mocker-w{id}"))
                .spawn(move || engine::run_worker(engine, rx, start))
                .context("spawning a worker thread")?;
            let info = serde_json::json!({
                "worker_id": id,
                "model": model,
                "engine": &config,
                "block_size": config.block_size,
                "speedup": config.speedup,
                "prefill_tokens_per_sec": config.cost.prefill_tokens_per_sec(config.max_num_batched_tokens),
                "step_time_model": "overhead + prefill_tokens*t_prefill + decode_seqs*t_decode_seq + decode_kv_tokens*t_attn_decode + prefill_attn_pairs*t_attn_prefill",
            });
            let state = Arc::new(http::WorkerHttp::new(
                id,
                model.clone(),
                dir.display().to_string(),
                tokenizer.clone(),
                tx,
                metrics.clone(),
                info,
                args.default_max_tokens,
                Duration::from_millis(args.stream_interval_ms),
                config.gpu_blocks * config.block_size,
            ));
            let app = http::routes(state);
            servers.push(tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(worker = id, error = %e, "HTTP server stopped");
                }
            }));
            workers.push(WorkerHandle {
                id,
                http,
                events: zmq.endpoint().to_owned(),
                replay: zmq.replay_endpoint().unwrap_or_default().to_owned(),
                metrics,
                _zmq: zmq,
            });
        }
        Ok(Fleet {
            workers,
            config,
            servers,
        })
    }

    /// One line per worker in the router's `--workers` syntax.
    pub fn lines(&self) -> Vec<String> {
        self.workers.iter().map(WorkerHandle::line).collect()
    }
}

/// Writes `lines` to `path` through a temporary name and a rename (a reader never sees half).
pub fn write_ready_file(path: &std::path::Path, lines: &[String]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, lines.join("\n") + "\n")?;
    std::fs::rename(&tmp, path)
}
