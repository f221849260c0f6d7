//! The service's configuration: its command line (flags named as Dynamo's router names them) and
//! the `--workers` list.

use std::net::IpAddr;
use std::time::Duration;

use clap::Parser;
use kvbm_events::router::{
    KvIndex, RouterMode, SelectorConfig, Weights, BLOCKS_PER_WORKER_MAX_DEFAULT,
    ROUTER_MODE_DEFAULT,
};
use kvbm_events::WorkerEndpoint;

/// Largest request body accepted by default (a 128K-token prompt as JSON is about 1 MB).
pub const MAX_BODY_BYTES_DEFAULT: usize = 4 << 20;
/// Longest time-to-live a flag may give (a week): longer ones are refused, not wrapped.
pub const TTL_SECS_MAX: u64 = 7 * 24 * 3600;
/// Longest request id accepted by default, in bytes.
pub const MAX_REQUEST_ID_BYTES_DEFAULT: usize = 256;
/// Routed requests tracked at most by default.
pub const MAX_TRACKED_REQUESTS_DEFAULT: usize = 100_000;
/// Workers registered at most by default.
pub const MAX_WORKERS_DEFAULT: usize = 1024;
/// Open HTTP connections at most by default.
pub const MAX_CONNECTIONS_DEFAULT: usize = 1024;
/// Longest --bootstrap-timeout-secs accepted (the sibling is a router answering from memory).
pub const BOOTSTRAP_TIMEOUT_SECS_MAX: u64 = 3600;
/// Seconds an HTTP connection may stay idle by default.
pub const HTTP_IDLE_TIMEOUT_SECS_DEFAULT: u64 = 60;
/// Seconds a client has by default to send a request's headers (from its connection, or from the
/// first byte of a later request on it).
pub const HTTP_HEADER_TIMEOUT_SECS_DEFAULT: f64 = 10.0;
/// Seconds a client has by default to send a request's body once its headers arrived.
pub const HTTP_BODY_TIMEOUT_SECS_DEFAULT: f64 = 60.0;

/// kvbm-router: follows workers' KV cache events (vLLM's ZMQ format, with kvbm's host and disk
/// tiers) and sends each request to the worker that holds most of its prefix, weighed against
/// how busy each worker is.
#[derive(Parser, Debug, Clone)]
#[command(name = "kvbm-router", version)]
pub struct Args {
    /// Workers to follow, separated by ';':
    /// "ID[:DP_RANK]=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,http=http://HOST:PORT]".
    /// ID is the worker id (u64), DP_RANK its data-parallel rank (default 0), then the engine's
    /// KV events PUB endpoint and, optionally, its replay (ROUTER) endpoint, used to fill gaps and
    /// to catch up when the router starts, and its OpenAI-compatible HTTP server (`vllm serve`'s
    /// address), to which /v1/completions and /v1/chat/completions are forwarded. More can be
    /// added with POST /register.
    #[arg(long, default_value = "")]
    pub workers: String,

    /// A sibling router's URL (http://HOST:PORT): its index is read from GET /dump at start,
    /// with its workers, and each is followed from the sequence number after the dump's. The dump
    /// is bounded (--bootstrap-max-bytes, --max-workers, --bootstrap-max-blocks,
    /// --bootstrap-timeout-secs); a dump over a bound, or that cannot be fetched, is refused whole:
    /// the router starts without it, logs why and counts it
    /// (kv_router_bootstrap_refused_total{why}), or with --bootstrap-required does not start. Its
    /// workers are checked as POST /register checks them (tcp:// endpoints only) unless --workers
    /// gives them (then followed at the local endpoints); one that fails is left out with its
    /// holdings (kv_router_bootstrap_workers_skipped_total).
    #[arg(long)]
    pub bootstrap_from: Option<String>,

    /// A file of workers, one per line in the --workers syntax ('#' starts a comment), re-read
    /// when it changes: workers that appear are registered, those that disappear unregistered.
    #[arg(long)]
    pub workers_file: Option<std::path::PathBuf>,

    /// Address the HTTP API listens on. Anything other than loopback exposes the API to the
    /// network: set an admin token then, or anyone who reaches it can register a "worker" and
    /// receive users' requests.
    #[arg(long, default_value = "127.0.0.1")]
    pub http_host: IpAddr,

    /// Token that POST /register and /unregister must present (`Authorization: Bearer TOKEN`).
    /// Read from the environment so that it does not show in the process list.
    #[arg(long, env = "KVBM_ROUTER_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

    /// Port of the HTTP API (0 picks a free one; the address is printed on start).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,

    /// Tokens per KV block; must equal the engines' block size, or no hash will match.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,

    /// How workers are picked: `round-robin` (cycles over the eligible workers in id order),
    /// `random` (uniformly), `least-loaded` (lowest `prefill_blocks + decode_blocks`, no cache
    /// credit), `kv-gpu` (`kv`'s cost with GPU overlap only: host and disk weights 0), `kv`
    /// (kvbm's tier-aware weights: Dynamo's cost with the prefill term weighted 10 and host
    /// hits credited as GPU hits), `dynamo` (Dynamo's default cost and weights), `tuned` (a
    /// cost learned online from the front end's observed time to first token and time per
    /// output token; `kv`'s weights until 50 streamed requests were observed, and always when
    /// the router is asked only through /route; see GET /debug/cost). The weight flags below change `kv-gpu`'s, `kv`'s, `dynamo`'s and `tuned`'s
    /// starting weights (`kv-gpu` keeps host and disk at 0).
    #[arg(long, env = "KVBM_ROUTER_MODE", default_value_t = ROUTER_MODE_DEFAULT, value_parser = parse_mode)]
    pub router_mode: RouterMode,

    /// Weight of the prefill term of the cost (Dynamo's `--router-prefill-load-scale`). Default:
    /// the mode's (10 for `kv`, `kv-gpu` and `tuned`'s start, 1.0 for `dynamo`).
    #[arg(long)]
    pub router_prefill_load_scale: Option<f64>,

    /// Deprecated alias of --router-prefill-load-scale (Dynamo's old name; 0 also sets
    /// --router-kv-overlap-score-credit to 0, as Dynamo does).
    #[arg(long)]
    pub kv_overlap_score_weight: Option<f64>,

    /// Credit of a block of the request's prefix found on a worker's GPU (Dynamo's
    /// `--router-kv-overlap-score-credit`). Default: the mode's (1.0).
    #[arg(long)]
    pub router_kv_overlap_score_credit: Option<f64>,

    /// Credit of a block found in a worker's pinned host memory, relative to one on its GPU.
    /// Default: the mode's (1.0 for `kv` and `tuned`'s start, 0.75 for `dynamo`).
    #[arg(long)]
    pub router_host_cache_hit_weight: Option<f64>,

    /// Credit of a block found on a worker's local disk, relative to one on its GPU. Default:
    /// the mode's (0.25).
    #[arg(long)]
    pub router_disk_cache_hit_weight: Option<f64>,

    /// Credit of a block a worker would load from a shared pool it reaches (kvbm's shared tier
    /// on Redis or Valkey; vLLM 0.33's `locality` `REMOTE` stores with the pool in `ownership`),
    /// past the blocks it holds itself, relative to one on its GPU. Default: 0.2 in the modes
    /// that weigh tiers (below a disk hit), 0 in `kv-gpu` and the load-only modes.
    #[arg(long)]
    pub router_shared_cache_hit_weight: Option<f64>,

    /// Shared pools (the `ownership` names in kvbm's shared-tier events, `DYN_KVBM_SHARED_POOL`
    /// on the workers), comma separated, that every registered worker reaches: each worker is
    /// credited with their blocks from its registration on, before it has written to them
    /// itself. Without this, a worker is taken to reach a pool once it has published into it.
    #[arg(long, value_delimiter = ',')]
    pub router_shared_pools: Vec<String>,

    /// 0 always picks the lowest cost; above 0, picks at random with weights
    /// exp(-(cost - min) / ((max - min) * T)), spreading load between near-equal workers.
    #[arg(long, default_value_t = 0.0)]
    pub router_temperature: f64,

    /// Cost of each request a worker is running, added to its decode blocks.
    #[arg(long, default_value_t = 0.0)]
    pub router_decode_active_request_weight: f64,

    /// Fixed-weight cost modes (`kv-gpu`, `kv`, `dynamo`): each token a worker computed into its GPU
    /// cache lately (its own KV events, decayed with --router-balance-half-life-secs) above the
    /// least of the candidates counts as this many tokens of queued prefill, so that new
    /// conversations go where less work was done lately (at most 100; 0 turns it off).
    #[arg(long)]
    pub router_balance_weight: Option<f64>,

    /// Half-life, in seconds, of the recent work the balance term weighs (above 0, at most a
    /// day).
    #[arg(long, default_value_t = kvbm_events::router::BALANCE_HALF_LIFE_DEFAULT.as_secs_f64())]
    pub router_balance_half_life_secs: f64,

    /// `tuned` only: weight of a request's own predicted service time (its computed tokens and
    /// loads) in its cost, for the delay it brings to the requests queued after it on that
    /// worker; 0 minimizes each request's own predicted TTFT (at most 100).
    #[arg(long, default_value_t = kvbm_events::router::tune::EXTERNALITY_DEFAULT)]
    pub router_tuned_externality: f64,

    /// `tuned` only: a worker holding (1 + this) times an even share of the requests in flight
    /// (the new one counted) is not chosen while another worker is; 0 turns the bound off (at
    /// most 100).
    #[arg(long, default_value_t = kvbm_events::router::tune::LOAD_BOUND_DEFAULT)]
    pub router_tuned_load_bound: f64,

    /// Seconds a routed request counts toward its worker's load when the caller never reports its
    /// first token or its end (at most a week).
    #[arg(long, default_value_t = 600)]
    pub router_request_ttl_secs: u64,

    /// Seconds a routing decision counts the request's blocks as present on the chosen worker's
    /// GPU, so that sibling requests sent before its events arrive land on it too; the worker's
    /// own store of a block ends its prediction. 0 (the default) predicts nothing.
    #[arg(long, default_value_t = 0.0)]
    pub router_predicted_ttl_secs: f64,

    /// Longest request id accepted, in bytes (longer ones get 400).
    #[arg(long, default_value_t = MAX_REQUEST_ID_BYTES_DEFAULT)]
    pub max_request_id_bytes: usize,

    /// Routed requests whose load is tracked at most; beyond it a request is routed but its load
    /// is not tracked (counted in kv_router_requests_untracked_total).
    #[arg(long, default_value_t = MAX_TRACKED_REQUESTS_DEFAULT)]
    pub max_tracked_requests: usize,

    /// Workers registered at most (--workers, --workers-file and POST /register together).
    #[arg(long, default_value_t = MAX_WORKERS_DEFAULT)]
    pub max_workers: usize,

    /// Open HTTP connections at most; connections beyond it are closed at once (counted).
    #[arg(long, default_value_t = MAX_CONNECTIONS_DEFAULT)]
    pub max_connections: usize,

    /// Seconds an HTTP connection may stay without traffic before it is closed.
    #[arg(long, default_value_t = HTTP_IDLE_TIMEOUT_SECS_DEFAULT)]
    pub http_idle_timeout_secs: u64,

    /// Most (block, tier) holdings indexed per worker; stores beyond it are refused and counted
    /// (kv_cache_events_applied{status="worker_full"}).
    #[arg(long, default_value_t = BLOCKS_PER_WORKER_MAX_DEFAULT)]
    pub max_blocks_per_worker: usize,

    /// Distinct blocks to make room for in the index at start (0: grow as needed). Growing a large
    /// index pauses event processing while it rehashes; sizing it for the fleet avoids that.
    #[arg(long, default_value_t = 0)]
    pub index_capacity_blocks: usize,

    /// Largest request body accepted, in bytes (larger ones get 413).
    #[arg(long, default_value_t = MAX_BODY_BYTES_DEFAULT)]
    pub max_body_bytes: usize,

    /// The served model's directory: its `tokenizer.json` and `tokenizer_config.json` (with the
    /// chat template, or a `chat_template.jinja` next to them), the same files `vllm serve` loads.
    /// Needed for the OpenAI endpoints (/v1/completions, /v1/chat/completions) and /tokenize.
    #[arg(long)]
    pub model_path: Option<std::path::PathBuf>,

    /// The model name clients send in `model` and /v1/models lists (default: --model-path as
    /// given, as vLLM names it).
    #[arg(long)]
    pub model_name: Option<String>,

    /// LoRA adapters the workers serve (vLLM's `--lora-modules NAME=PATH` names), comma
    /// separated: a request whose `model` is one of them is accepted, listed in /v1/models, and
    /// its blocks are matched under that adapter (vLLM hashes them with it).
    #[arg(long, value_delimiter = ',')]
    pub lora_names: Vec<String>,

    /// Seconds to wait for a TCP connection to a worker's HTTP server.
    #[arg(long, default_value_t = 5.0)]
    pub worker_connect_timeout_secs: f64,

    /// Seconds to wait for a worker's response headers (a non-streaming request sends them when
    /// it is done, so this bounds its whole generation).
    #[arg(long, default_value_t = 600.0)]
    pub worker_response_timeout_secs: f64,

    /// Seconds a worker may stay silent in the middle of a response before the request is failed.
    #[arg(long, default_value_t = 300.0)]
    pub worker_idle_timeout_secs: f64,

    /// Times a request is sent to the next best worker when its worker refuses it or fails before
    /// answering (connection refused or reset, 502/503/504, timeout).
    #[arg(long, default_value_t = 2)]
    pub max_retries: usize,

    /// Seconds a worker that failed a request is not routed to (it still follows events).
    #[arg(long, default_value_t = 10.0)]
    pub worker_failure_cooldown_secs: f64,

    /// Bytes of a --bootstrap-from dump read at most; a longer one is refused (counted in
    /// kv_router_bootstrap_refused_total{why="bytes"}; see --bootstrap-required).
    #[arg(long, default_value_t = crate::dump::BOOTSTRAP_MAX_BYTES_DEFAULT)]
    pub bootstrap_max_bytes: u64,

    /// Holdings (and, separately, engine hashes) of all workers of a --bootstrap-from dump at
    /// most; a dump with more is refused. Default: the largest of 16777216, 4 x
    /// --index-capacity-blocks and one per KiB of this machine's memory (a holding read with its
    /// engine hash and restored takes about 128 bytes, so at most an eighth of memory). Its
    /// workers are bounded by --max-workers less the --workers entries it does not name.
    #[arg(long)]
    pub bootstrap_max_blocks: Option<usize>,

    /// Seconds fetching and reading a --bootstrap-from dump may take; a slower one is refused.
    #[arg(long, default_value_t = crate::dump::BOOTSTRAP_TIMEOUT_SECS_DEFAULT)]
    pub bootstrap_timeout_secs: u64,
    /// Seconds a client has to send a request's headers, counted from its connection (or from
    /// the first byte of a later request on it); traffic does not extend it. Past it the
    /// connection is closed (kv_router_connections_deadline_total{phase="headers"}).
    #[arg(long, default_value_t = HTTP_HEADER_TIMEOUT_SECS_DEFAULT)]
    pub http_header_timeout_secs: f64,

    /// Seconds a client has to send a request's body once its headers arrived; traffic does not
    /// extend it. Past it the connection is closed
    /// (kv_router_connections_deadline_total{phase="body"}).
    #[arg(long, default_value_t = HTTP_BODY_TIMEOUT_SECS_DEFAULT)]
    pub http_body_timeout_secs: f64,

    /// Stop with an error, instead of starting with an empty index, when the --bootstrap-from
    /// dump cannot be fetched (the sibling is down, too slow) or is refused.
    #[arg(long)]
    pub bootstrap_required: bool,

    /// Bytes of large request bodies (above --large-prompt-bytes) the OpenAI front end holds while
    /// they wait for and go through tokenizing; a large request beyond it gets 503 at once
    /// (counted in kv_router_frontend_prompt_budget_refusals_total). The tokenizer's memory is a
    /// small multiple of this. At least --max-body-bytes.
    #[arg(long, default_value_t = MAX_INFLIGHT_PROMPT_BYTES_DEFAULT)]
    pub max_inflight_prompt_bytes: usize,

    /// Request bodies above this many bytes are tokenized in a lane of their own (half the cores,
    /// at least 1, at once), so that small requests never wait behind them.
    #[arg(long, default_value_t = LARGE_PROMPT_BYTES_DEFAULT)]
    pub large_prompt_bytes: usize,

    /// Bytes one server-sent event from a worker may have; a longer one ends the client's stream
    /// with an error event (counted in kv_router_frontend_sse_events_too_large_total).
    #[arg(long, default_value_t = MAX_SSE_EVENT_BYTES_DEFAULT)]
    pub max_sse_event_bytes: usize,

    /// Tokenize every prompt whole. By default the front end stops at the first window of text
    /// (2 KiB) whose blocks no worker holds: no overlap can reach past it, and the rest's length
    /// is estimated from its bytes (kv_router_frontend_prompt_bytes_total{how="skipped"}).
    #[arg(long)]
    pub tokenize_whole_prompts: bool,

    /// Go on tokenizing while some worker holds every block so far, even where the pick is
    /// already sure. By default the front end stops there too (in the fixed-weight cost modes):
    /// where exactly one worker holds every block and would be picked (the rest can only add to
    /// its overlap; kv_router_frontend_probe_answers_total{answer="sure_pick"}), and where the
    /// pick would stay even if every such worker held all of the rest, counted at one token a
    /// byte, more where the model's normalizer may lengthen the text
    /// (answer="holders_outweighed"). The rest counts as uncached in the chosen worker's queued
    /// prefill until its first token.
    #[arg(long)]
    pub tokenize_past_sure_pick: bool,

    /// MiB of tokenized windows the front end keeps, by the text before them, so that a prompt
    /// repeating an earlier one's text (a conversation's history, a shared system prompt) is
    /// tokenized only past it; 0 turns the cache off.
    #[arg(long, default_value_t = TOKENIZER_CACHE_MB_DEFAULT)]
    pub tokenizer_cache_mb: usize,
}

/// `--tokenizer-cache-mb`' default.
pub const TOKENIZER_CACHE_MB_DEFAULT: usize = 256;

/// `--max-inflight-prompt-bytes`' default.
pub const MAX_INFLIGHT_PROMPT_BYTES_DEFAULT: usize = 64 << 20;
/// `--large-prompt-bytes`' default.
pub const LARGE_PROMPT_BYTES_DEFAULT: usize = 256 << 10;
/// `--max-sse-event-bytes`' default.
pub const MAX_SSE_EVENT_BYTES_DEFAULT: usize = 4 << 20;

/// Why the configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A flag's value is out of range.
    #[error("--{flag}={value}: {why}")]
    Flag {
        /// The flag, without dashes.
        flag: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: &'static str,
    },
    /// A flag's value is above the largest accepted, which the message names.
    #[error("--{flag}={value}: is above the largest value accepted ({max})")]
    FlagAbove {
        /// The flag, without dashes.
        flag: &'static str,
        /// Its value.
        value: String,
        /// The largest value accepted.
        max: u64,
    },
    /// A `--workers` entry did not parse.
    #[error("--workers entry {entry:?}: {why}")]
    Worker {
        /// The entry.
        entry: String,
        /// What is wrong.
        why: String,
    },
}

/// The validated configuration of a router.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// The selector's weights.
    pub selector: SelectorConfig,
    /// `tuned`: weight of a request's own service time in its cost.
    pub tuned_externality: f64,
    /// `tuned`: bound on a worker's requests in flight over an even share (0: none).
    pub tuned_load_bound: f64,
    /// Half-life of the recent work the balance term weighs.
    pub balance_half_life: Duration,
    /// How long an unreported request counts toward load.
    pub request_ttl: Duration,
    /// Per-worker index limit.
    pub max_blocks_per_worker: usize,
    /// Distinct blocks the index makes room for at start.
    pub index_capacity_blocks: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Token POST /register and /unregister require, if any.
    pub admin_token: Option<String>,
    /// How long a routing decision predicts the request's blocks on its worker (zero: never).
    pub predicted_ttl: Duration,
    /// Longest request id.
    pub max_request_id_bytes: usize,
    /// Routed requests tracked at most.
    pub max_tracked_requests: usize,
    /// Workers registered at most.
    pub max_workers: usize,
    /// Open HTTP connections at most.
    pub max_connections: usize,
    /// Idle time after which an HTTP connection is closed.
    pub http_idle_timeout: Duration,
    /// The OpenAI front end's settings.
    pub frontend: FrontendConfig,
    /// Bytes of a sibling's dump read at most.
    pub bootstrap_max_bytes: u64,
    /// Holdings (and engine hashes) of all workers of a sibling's dump at most.
    pub bootstrap_max_blocks: usize,
    /// How long fetching a sibling's dump may take.
    pub bootstrap_timeout: Duration,
    /// Time a client has to send a request's headers.
    pub http_header_timeout: Duration,
    /// Time a client has to send a request's body once its headers arrived.
    pub http_body_timeout: Duration,
    /// Whether a --bootstrap-from dump that fails or is refused stops the router from starting.
    pub bootstrap_required: bool,
    /// Shared pools every registered worker reaches (`--router-shared-pools`).
    pub shared_pools: Vec<String>,
}

/// The OpenAI front end's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FrontendConfig {
    /// The model's directory (tokenizer files), if the front end is on.
    pub model_path: Option<std::path::PathBuf>,
    /// The served model's name.
    pub model_name: Option<String>,
    /// LoRA adapters served under their own model names.
    pub lora_names: Vec<String>,
    /// Connecting to a worker.
    pub connect_timeout: Duration,
    /// Waiting for a worker's response headers.
    pub response_timeout: Duration,
    /// Silence in the middle of a response.
    pub idle_timeout: Duration,
    /// Retries on another worker before the first byte.
    pub max_retries: usize,
    /// How long a failed worker is left out of routing.
    pub failure_cooldown: Duration,
    /// Bytes of large request bodies held at once while tokenizing.
    pub max_inflight_prompt_bytes: usize,
    /// Bodies above this are large (their own tokenizing lane, the budget above).
    pub large_prompt_bytes: usize,
    /// Longest server-sent event relayed from a worker.
    pub max_sse_event_bytes: usize,
    /// Tokenize prompts whole, not only as far as an overlap can reach.
    pub tokenize_whole_prompts: bool,
    /// Tokenize on past a window where the pick is sure (`--tokenize-past-sure-pick`).
    pub tokenize_past_sure_pick: bool,
    /// Bytes of the tokenizer's prefix cache (0: none).
    pub tokenizer_cache_bytes: usize,
}

impl Default for FrontendConfig {
    fn default() -> Self {
        Self {
            model_path: None,
            model_name: None,
            lora_names: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(600),
            idle_timeout: Duration::from_secs(300),
            max_retries: 2,
            failure_cooldown: Duration::from_secs(10),
            max_inflight_prompt_bytes: MAX_INFLIGHT_PROMPT_BYTES_DEFAULT,
            large_prompt_bytes: LARGE_PROMPT_BYTES_DEFAULT,
            max_sse_event_bytes: MAX_SSE_EVENT_BYTES_DEFAULT,
            tokenize_whole_prompts: false,
            tokenize_past_sure_pick: false,
            tokenizer_cache_bytes: TOKENIZER_CACHE_MB_DEFAULT << 20,
        }
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            selector: SelectorConfig::default(),
            tuned_externality: kvbm_events::router::tune::EXTERNALITY_DEFAULT,
            tuned_load_bound: kvbm_events::router::tune::LOAD_BOUND_DEFAULT,
            balance_half_life: kvbm_events::router::BALANCE_HALF_LIFE_DEFAULT,
            request_ttl: Duration::from_secs(600),
            max_blocks_per_worker: BLOCKS_PER_WORKER_MAX_DEFAULT,
            index_capacity_blocks: 0,
            max_body_bytes: MAX_BODY_BYTES_DEFAULT,
            admin_token: None,
            predicted_ttl: Duration::ZERO,
            max_request_id_bytes: MAX_REQUEST_ID_BYTES_DEFAULT,
            max_tracked_requests: MAX_TRACKED_REQUESTS_DEFAULT,
            max_workers: MAX_WORKERS_DEFAULT,
            max_connections: MAX_CONNECTIONS_DEFAULT,
            http_idle_timeout: Duration::from_secs(HTTP_IDLE_TIMEOUT_SECS_DEFAULT),
            frontend: FrontendConfig::default(),
            bootstrap_max_bytes: crate::dump::BOOTSTRAP_MAX_BYTES_DEFAULT,
            bootstrap_max_blocks: crate::dump::BOOTSTRAP_MAX_BLOCKS_DEFAULT,
            bootstrap_timeout: Duration::from_secs(crate::dump::BOOTSTRAP_TIMEOUT_SECS_DEFAULT),
            http_header_timeout: Duration::from_secs_f64(HTTP_HEADER_TIMEOUT_SECS_DEFAULT),
            http_body_timeout: Duration::from_secs_f64(HTTP_BODY_TIMEOUT_SECS_DEFAULT),
            bootstrap_required: false,
            shared_pools: Vec::new(),
        }
    }
}

/// A whole number flag of at least 1 and at most `max`.
fn bounded(flag: &'static str, value: u64, max: u64) -> Result<u64, ConfigError> {
    if value == 0 {
        return Err(ConfigError::Flag {
            flag,
            value: value.to_string(),
            why: "must be at least 1",
        });
    }
    if value > max {
        return Err(ConfigError::FlagAbove {
            flag,
            value: value.to_string(),
            max,
        });
    }
    Ok(value)
}

/// A number of seconds above 0 and at most a week.
fn seconds(flag: &'static str, value: f64) -> Result<Duration, ConfigError> {
    if value.is_finite() && value > 0.0 && value <= TTL_SECS_MAX as f64 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(ConfigError::Flag {
            flag,
            value: value.to_string(),
            why: "must be a number of seconds above 0 and at most a week",
        })
    }
}

/// This machine's physical memory in bytes, if known.
fn physical_memory() -> Option<u64> {
    use nix::unistd::{sysconf, SysconfVar};
    let pages = sysconf(SysconfVar::_PHYS_PAGES).ok()??;
    let page = sysconf(SysconfVar::PAGE_SIZE).ok()??;
    let (pages, page) = (u64::try_from(pages).ok()?, u64::try_from(page).ok()?);
    pages.checked_mul(page).filter(|&b| b > 0)
}

/// `--index-capacity-blocks`: what the index can number (u32 node ids) and a machine of `memory`
/// bytes (if known) can map.
fn index_capacity(blocks: usize, memory: Option<u64>) -> Result<usize, ConfigError> {
    let refuse = |why| ConfigError::Flag {
        flag: "index-capacity-blocks",
        value: blocks.to_string(),
        why,
    };
    let bytes = KvIndex::capacity_bytes(blocks)
        .ok_or_else(|| refuse("is above the most blocks the index can number (4294967294)"))?;
    if memory.is_some_and(|m| bytes as u64 > m) {
        return Err(refuse(
            "would reserve more index memory than this machine has (about 30 bytes a block)",
        ));
    }
    Ok(blocks)
}

/// Most --bootstrap-max-blocks accepted.
pub const BOOTSTRAP_MAX_BLOCKS_MAX: usize = 1 << 32;
/// Bytes a holding of a --bootstrap-from dump takes, with its engine hash, while read and once
/// restored (about 16 + 32 in the dump, the index entry and its share of the maps).
pub const BOOTSTRAP_BYTES_PER_BLOCK: u64 = 128;

/// The default --bootstrap-max-blocks for an index of `index_capacity` blocks on a machine of
/// `memory` bytes: the largest of [`crate::dump::BOOTSTRAP_MAX_BLOCKS_DEFAULT`], 4 holdings a
/// block of the index (workers share blocks), and what an eighth of memory holds at
/// [`BOOTSTRAP_BYTES_PER_BLOCK`], at most [`BOOTSTRAP_MAX_BLOCKS_MAX`].
pub fn bootstrap_max_blocks_default(index_capacity: usize, memory: Option<u64>) -> usize {
    let by_memory = memory.map_or(0, |m| m / 8 / BOOTSTRAP_BYTES_PER_BLOCK);
    let by_memory = usize::try_from(by_memory).unwrap_or(usize::MAX);
    crate::dump::BOOTSTRAP_MAX_BLOCKS_DEFAULT
        .max(index_capacity.saturating_mul(4))
        .max(by_memory)
        .min(BOOTSTRAP_MAX_BLOCKS_MAX)
}

/// The largest `--router-balance-weight`.
const BALANCE_WEIGHT_MAX: f64 = 100.0;

/// The longest `--router-balance-half-life-secs` (a day).
const BALANCE_HALF_LIFE_SECS_MAX: f64 = 86_400.0;

fn weight(flag: &'static str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(ConfigError::Flag {
            flag,
            value: value.to_string(),
            why: "must be a finite number, 0 or more",
        })
    }
}

/// A [`weight`] no larger than `max`.
fn weight_at_most(flag: &'static str, value: f64, max: f64) -> Result<f64, ConfigError> {
    let v = weight(flag, value)?;
    if v > max {
        return Err(ConfigError::FlagAbove {
            flag,
            value: v.to_string(),
            max: max as u64,
        });
    }
    Ok(v)
}

fn parse_mode(s: &str) -> Result<RouterMode, String> {
    s.parse()
}

impl Args {
    /// Whether the deprecated `--kv-overlap-score-weight` was given (the caller logs it).
    pub fn deprecated_flags(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.kv_overlap_score_weight.is_some() {
            out.push("--kv-overlap-score-weight is deprecated; use --router-prefill-load-scale");
        }
        out
    }

    /// The mode and its weights: the mode's defaults, changed by the weight flags given.
    pub fn selector_config(&self) -> Result<SelectorConfig, ConfigError> {
        let mode = self.router_mode;
        let mut w: Weights = mode.default_weights();
        if let Some(v) = self.kv_overlap_score_weight {
            w.prefill_load_scale = weight("kv-overlap-score-weight", v)?;
            if v == 0.0 {
                w.overlap_score_credit = 0.0;
            }
        }
        if let Some(v) = self.router_prefill_load_scale {
            w.prefill_load_scale = weight("router-prefill-load-scale", v)?;
        }
        if let Some(v) = self.router_kv_overlap_score_credit {
            w.overlap_score_credit = weight("router-kv-overlap-score-credit", v)?;
        }
        if let Some(v) = self.router_host_cache_hit_weight {
            w.host_weight = weight("router-host-cache-hit-weight", v)?;
        }
        if let Some(v) = self.router_disk_cache_hit_weight {
            w.disk_weight = weight("router-disk-cache-hit-weight", v)?;
        }
        let mut config = SelectorConfig {
            decode_active_request_weight: weight(
                "router-decode-active-request-weight",
                self.router_decode_active_request_weight,
            )?,
            temperature: weight("router-temperature", self.router_temperature)?,
            ..SelectorConfig::for_mode(mode).with_weights(w)
        };
        if let Some(v) = self.router_balance_weight {
            let v = weight_at_most("router-balance-weight", v, BALANCE_WEIGHT_MAX)?;
            // `tuned` has its own cost (and kv's weights, without the term, until it has one).
            if mode.takes_weights() && mode != RouterMode::Tuned {
                config.balance_weight = v;
            }
        }
        if let Some(v) = self.router_shared_cache_hit_weight {
            let v = weight("router-shared-cache-hit-weight", v)?;
            if mode.takes_weights() && mode != RouterMode::KvGpu {
                config.shared_weight = v;
            }
        }
        Ok(config)
    }

    /// The router configuration these flags describe.
    pub fn router_config(&self) -> Result<RouterConfig, ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::Flag {
                flag: "block-size",
                value: "0".into(),
                why: "must be at least 1",
            });
        }
        if self.block_size > u32::MAX as usize {
            return Err(ConfigError::FlagAbove {
                flag: "block-size",
                value: self.block_size.to_string(),
                max: u64::from(u32::MAX),
            });
        }
        if self.max_body_bytes == 0 {
            return Err(ConfigError::Flag {
                flag: "max-body-bytes",
                value: "0".into(),
                why: "must be at least 1",
            });
        }
        let request_ttl = bounded(
            "router-request-ttl-secs",
            self.router_request_ttl_secs,
            TTL_SECS_MAX,
        )?;
        let predicted = self.router_predicted_ttl_secs;
        if !(predicted.is_finite() && (0.0..=TTL_SECS_MAX as f64).contains(&predicted)) {
            return Err(ConfigError::Flag {
                flag: "router-predicted-ttl-secs",
                value: predicted.to_string(),
                why: "must be a number of seconds from 0 to a week",
            });
        }
        let half_life = self.router_balance_half_life_secs;
        if !(half_life.is_finite() && half_life > 0.0 && half_life <= BALANCE_HALF_LIFE_SECS_MAX) {
            return Err(ConfigError::Flag {
                flag: "router-balance-half-life-secs",
                value: half_life.to_string(),
                why: "must be a number of seconds above 0, at most a day",
            });
        }
        let balance_half_life = Duration::from_secs_f64(half_life);
        let idle = bounded(
            "http-idle-timeout-secs",
            self.http_idle_timeout_secs,
            TTL_SECS_MAX,
        )?;
        let max_request_id_bytes = bounded(
            "max-request-id-bytes",
            self.max_request_id_bytes as u64,
            1 << 20,
        )? as usize;
        let max_tracked_requests = bounded(
            "max-tracked-requests",
            self.max_tracked_requests as u64,
            1 << 30,
        )? as usize;
        let max_workers = bounded("max-workers", self.max_workers as u64, 1 << 16)? as usize;
        let max_connections =
            bounded("max-connections", self.max_connections as u64, 1 << 20)? as usize;
        Ok(RouterConfig {
            block_size: self.block_size,
            selector: self.selector_config()?,
            tuned_externality: weight_at_most(
                "router-tuned-externality",
                self.router_tuned_externality,
                kvbm_events::router::tune::EXTERNALITY_MAX,
            )?,
            tuned_load_bound: weight_at_most(
                "router-tuned-load-bound",
                self.router_tuned_load_bound,
                kvbm_events::router::tune::LOAD_BOUND_MAX,
            )?,
            balance_half_life,
            request_ttl: Duration::from_secs(request_ttl),
            max_blocks_per_worker: self.max_blocks_per_worker,
            index_capacity_blocks: index_capacity(self.index_capacity_blocks, physical_memory())?,
            max_body_bytes: self.max_body_bytes,
            admin_token: match &self.admin_token {
                Some(t) if t.len() < 16 || t.contains(char::is_whitespace) => {
                    return Err(ConfigError::Flag {
                        flag: "admin-token",
                        value: "(hidden)".to_owned(),
                        why: "must be at least 16 characters without whitespace",
                    })
                }
                t => t.clone(),
            },
            predicted_ttl: Duration::from_secs_f64(predicted),
            max_request_id_bytes,
            max_tracked_requests,
            max_workers,
            max_connections,
            http_idle_timeout: Duration::from_secs(idle),
            frontend: self.frontend_config()?,
            bootstrap_max_bytes: bounded("bootstrap-max-bytes", self.bootstrap_max_bytes, 1 << 40)?,
            bootstrap_max_blocks: match self.bootstrap_max_blocks {
                Some(blocks) => bounded(
                    "bootstrap-max-blocks",
                    blocks as u64,
                    BOOTSTRAP_MAX_BLOCKS_MAX as u64,
                )? as usize,
                None => bootstrap_max_blocks_default(self.index_capacity_blocks, physical_memory()),
            },
            bootstrap_timeout: Duration::from_secs(bounded(
                "bootstrap-timeout-secs",
                self.bootstrap_timeout_secs,
                BOOTSTRAP_TIMEOUT_SECS_MAX,
            )?),
            http_header_timeout: seconds(
                "http-header-timeout-secs",
                self.http_header_timeout_secs,
            )?,
            http_body_timeout: seconds("http-body-timeout-secs", self.http_body_timeout_secs)?,
            bootstrap_required: self.bootstrap_required,
            shared_pools: self.shared_pools()?,
        })
    }

    fn shared_pools(&self) -> Result<Vec<String>, ConfigError> {
        let mut pools: Vec<String> = Vec::new();
        for name in &self.router_shared_pools {
            // As the workers' DYN_KVBM_SHARED_POOL is checked.
            let ok =
                !name.is_empty() && name.len() <= 128 && name.bytes().all(|b| b.is_ascii_graphic());
            if !ok {
                return Err(ConfigError::Flag {
                    flag: "router-shared-pools",
                    value: name.clone(),
                    why: "each name must be 1 to 128 printable ASCII characters, without spaces",
                });
            }
            if !pools.contains(name) {
                pools.push(name.clone());
            }
        }
        if pools.len() > kvbm_events::router::POOLS_MAX {
            return Err(ConfigError::Flag {
                flag: "router-shared-pools",
                value: pools.join(","),
                why: "names more pools than the index keeps (64)",
            });
        }
        Ok(pools)
    }

    fn frontend_config(&self) -> Result<FrontendConfig, ConfigError> {
        if let Some(name) = &self.model_name {
            if name.trim().is_empty() || name.len() > 1024 {
                return Err(ConfigError::Flag {
                    flag: "model-name",
                    value: name.clone(),
                    why: "must be a non-empty name of at most 1024 bytes",
                });
            }
        }
        for name in &self.lora_names {
            if name.trim().is_empty() || name.len() > 1024 || Some(name) == self.model_name.as_ref()
            {
                return Err(ConfigError::Flag {
                    flag: "lora-names",
                    value: name.clone(),
                    why: "must be non-empty names of at most 1024 bytes, other than --model-name",
                });
            }
        }
        if self.max_retries > 16 {
            return Err(ConfigError::Flag {
                flag: "max-retries",
                value: self.max_retries.to_string(),
                why: "is above the largest value accepted (16)",
            });
        }
        Ok(FrontendConfig {
            model_path: self.model_path.clone(),
            model_name: self.model_name.clone().or_else(|| {
                self.model_path
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned())
            }),
            lora_names: self.lora_names.clone(),
            connect_timeout: seconds(
                "worker-connect-timeout-secs",
                self.worker_connect_timeout_secs,
            )?,
            response_timeout: seconds(
                "worker-response-timeout-secs",
                self.worker_response_timeout_secs,
            )?,
            idle_timeout: seconds("worker-idle-timeout-secs", self.worker_idle_timeout_secs)?,
            max_retries: self.max_retries,
            failure_cooldown: seconds(
                "worker-failure-cooldown-secs",
                self.worker_failure_cooldown_secs,
            )?,
            max_inflight_prompt_bytes: {
                let v = bounded(
                    "max-inflight-prompt-bytes",
                    self.max_inflight_prompt_bytes as u64,
                    1 << 40,
                )? as usize;
                if v < self.max_body_bytes {
                    return Err(ConfigError::Flag {
                        flag: "max-inflight-prompt-bytes",
                        value: v.to_string(),
                        why: "must be at least --max-body-bytes (or no large request could pass)",
                    });
                }
                v
            },
            large_prompt_bytes: bounded(
                "large-prompt-bytes",
                self.large_prompt_bytes as u64,
                1 << 40,
            )? as usize,
            max_sse_event_bytes: bounded(
                "max-sse-event-bytes",
                self.max_sse_event_bytes as u64,
                1 << 34,
            )? as usize,
            tokenize_whole_prompts: self.tokenize_whole_prompts,
            tokenize_past_sure_pick: self.tokenize_past_sure_pick,
            tokenizer_cache_bytes: if self.tokenizer_cache_mb == 0 {
                0
            } else {
                (bounded(
                    "tokenizer-cache-mb",
                    self.tokenizer_cache_mb as u64,
                    1 << 20,
                )? as usize)
                    << 20
            },
        })
    }
}

fn check_endpoint(entry: &str, endpoint: &str) -> Result<(), ConfigError> {
    let ok = ["tcp://", "ipc://", "inproc://"]
        .iter()
        .any(|scheme| endpoint.len() > scheme.len() && endpoint.starts_with(scheme));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Worker {
            entry: entry.to_owned(),
            why: format!("{endpoint:?} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)"),
        })
    }
}

/// One worker as configured: where its KV events come from and, for the OpenAI front end, where
/// its own OpenAI-compatible HTTP server answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// Its event endpoints (what the subscriber follows).
    pub events: WorkerEndpoint,
    /// Base URL of its HTTP server (`http://HOST:PORT`), if requests may be sent to it.
    pub http: Option<String>,
}

impl WorkerSpec {
    /// Its id and rank.
    pub fn key(&self) -> (u64, u32) {
        (self.events.worker_id, self.events.dp_rank)
    }
}

impl From<WorkerEndpoint> for WorkerSpec {
    fn from(events: WorkerEndpoint) -> Self {
        Self { events, http: None }
    }
}

/// Checks a worker's HTTP base URL: `http://HOST:PORT` with an optional path prefix, no query.
/// Returns it without a trailing '/'.
pub fn check_http_url(url: &str) -> Result<String, String> {
    let url = url.trim();
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url:?} is not an http:// URL (https is not supported)"))?;
    let host = rest.split('/').next().unwrap_or("");
    // No query, fragment or user info, and nothing that would end a --workers option (',', ';').
    if host.is_empty()
        || rest.contains(['?', '#', '@', ',', ';'])
        || rest.contains(char::is_whitespace)
    {
        return Err(format!("{url:?} is not an http://HOST:PORT URL"));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

/// One worker: `ID[:DP_RANK]=ENDPOINT[,replay=ENDPOINT][,http=http://HOST:PORT]`.
pub fn parse_worker(entry: &str) -> Result<WorkerSpec, ConfigError> {
    let entry = entry.trim();
    let bad = |why: String| ConfigError::Worker {
        entry: entry.to_owned(),
        why,
    };
    let (key, rest) = entry
        .split_once('=')
        .ok_or_else(|| bad("expected ID[:DP_RANK]=tcp://HOST:PORT".into()))?;
    let (id, rank) = match key.trim().split_once(':') {
        Some((id, rank)) => (id, Some(rank)),
        None => (key.trim(), None),
    };
    let worker_id: u64 = id
        .trim()
        .parse()
        .map_err(|_| bad(format!("worker id {id:?} is not an unsigned integer")))?;
    let dp_rank: u32 = match rank {
        Some(r) => r
            .trim()
            .parse()
            .map_err(|_| bad(format!("dp rank {r:?} is not an unsigned integer")))?,
        None => 0,
    };
    if dp_rank == kvbm_events::router::index::POOL_RANK {
        return Err(bad(format!(
            "dp rank {dp_rank} is reserved for shared pools; use a smaller one"
        )));
    }
    let mut parts = rest.split(',');
    let endpoint = parts.next().unwrap_or_default().trim().to_owned();
    check_endpoint(entry, &endpoint)?;
    let mut replay = None;
    let mut http = None;
    for option in parts {
        match option.trim().split_once('=') {
            Some(("replay", value)) if replay.is_none() => {
                let value = value.trim();
                check_endpoint(entry, value)?;
                replay = Some(value.to_owned());
            }
            Some(("http", value)) if http.is_none() => {
                http = Some(check_http_url(value).map_err(bad)?);
            }
            _ => {
                return Err(bad(format!(
                "unknown or repeated option {option:?} (expected replay=tcp://... or http://...)"
            )))
            }
        }
    }
    Ok(WorkerSpec {
        events: WorkerEndpoint {
            worker_id,
            dp_rank,
            endpoint,
            replay,
        },
        http,
    })
}

/// A worker given over the network in parts (a sibling's dump): checked as `POST /register`
/// checks its body (through [`parse_worker`], each part parsed back unchanged, so that a ',' in
/// one cannot smuggle in an option), and more strictly where the parts came from another host:
/// its endpoints must be `tcp://HOST:PORT` (an `ipc://` path or `inproc://` name would be one
/// of this host's, not the worker's). Returns it with its HTTP URL normalized.
pub fn remote_worker(
    worker_id: u64,
    dp_rank: u32,
    endpoint: &str,
    replay: Option<&str>,
    http_url: Option<&str>,
) -> Result<WorkerSpec, ConfigError> {
    let mut spec = format!("{worker_id}:{dp_rank}={endpoint}");
    if let Some(replay) = replay {
        spec.push_str(",replay=");
        spec.push_str(replay);
    }
    if let Some(url) = http_url {
        spec.push_str(",http=");
        spec.push_str(url);
    }
    let bad = |why: String| ConfigError::Worker {
        entry: spec.clone(),
        why,
    };
    let w = parse_worker(&spec)?;
    if w.events.endpoint != endpoint
        || w.events.replay.as_deref() != replay
        || w.http.is_some() != http_url.is_some()
    {
        return Err(bad("a part holds a ',' or surrounding spaces".into()));
    }
    for e in std::iter::once(endpoint).chain(replay) {
        let tcp = e.strip_prefix("tcp://").and_then(|a| {
            let (host, port) = a.rsplit_once(':')?;
            let ok = !host.is_empty()
                && !host.contains(['/', '@', '?', '#', '=', ';'])
                && !host.contains(char::is_whitespace)
                && port.parse::<u16>().is_ok_and(|p| p > 0);
            ok.then_some(())
        });
        if tcp.is_none() {
            return Err(bad(format!(
                "{e:?} is not a tcp://HOST:PORT endpoint (a worker from another host may not \
                 name an ipc:// or inproc:// one)"
            )));
        }
    }
    Ok(w)
}

/// The `--workers` list; an id and rank may appear once.
pub fn parse_workers(spec: &str) -> Result<Vec<WorkerSpec>, ConfigError> {
    let mut out: Vec<WorkerSpec> = Vec::new();
    for entry in spec.split(';').filter(|e| !e.trim().is_empty()) {
        let w = parse_worker(entry)?;
        if out.iter().any(|o| o.key() == w.key()) {
            let (id, rank) = w.key();
            return Err(ConfigError::Worker {
                entry: entry.trim().to_owned(),
                why: format!("worker {id}:{rank} is listed twice"),
            });
        }
        out.push(w);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_lists_parse_and_bad_entries_are_named() {
        let workers =
            parse_workers("1=tcp://127.0.0.1:5557; 2:3=tcp://h:1,replay=tcp://h:2;").unwrap();
        assert_eq!(workers.len(), 2);
        assert_eq!(
            workers[1].events,
            WorkerEndpoint {
                worker_id: 2,
                dp_rank: 3,
                endpoint: "tcp://h:1".into(),
                replay: Some("tcp://h:2".into()),
            }
        );
        assert_eq!(workers[1].http, None);
        assert_eq!(workers[0].events.dp_rank, 0);
        let w = parse_worker("4=tcp://h:1,http=http://10.0.0.4:8000/,replay=tcp://h:2").unwrap();
        assert_eq!(w.http.as_deref(), Some("http://10.0.0.4:8000"));
        assert_eq!(w.events.replay.as_deref(), Some("tcp://h:2"));
        assert!(parse_workers("").unwrap().is_empty());
        for bad in [
            "x=tcp://h:1",
            "1:y=tcp://h:1",
            "1=http://h:1",
            "1=tcp://h:1,replay=nope",
            "1=tcp://h:1,other=tcp://h:2",
            "tcp://h:1",
            "1=tcp://h:1;1=tcp://h:2",
            "1=tcp://h:1,http=https://h:2",
            "1=tcp://h:1,http=http://",
            "1=tcp://h:1,http=http://h:1?x=1",
            "1=tcp://h:1,http=http://user@h:1",
            "1=tcp://h:1,http=http://h:1,http=http://h:2",
        ] {
            let e = parse_workers(bad).unwrap_err().to_string();
            assert!(e.contains("--workers entry"), "{bad}: {e}");
        }
    }

    /// The mode and Dynamo's weight flags map to the selector's weights: a mode's defaults,
    /// changed only by the flags given; the deprecated alias still sets the prefill scale (and,
    /// at 0, the GPU credit too, as Dynamo's `apply_deprecated_overlap_score_weight_override`).
    #[test]
    fn router_mode_and_dynamos_weight_flags_map_to_the_cost() {
        use kvbm_events::router::{DYNAMO_WEIGHTS, KV_WEIGHTS};
        let parse = |flags: &[&str]| {
            let mut argv = vec!["kvbm-router"];
            argv.extend_from_slice(flags);
            Args::try_parse_from(argv).map(|a| (a.selector_config(), a.deprecated_flags()))
        };
        let (c, warnings) = parse(&[]).unwrap();
        let c = c.unwrap();
        assert_eq!((c.mode, c.weights()), (ROUTER_MODE_DEFAULT, KV_WEIGHTS));
        assert!(warnings.is_empty());
        let c = parse(&["--router-mode", "dynamo"]).unwrap().0.unwrap();
        assert_eq!((c.mode, c.weights()), (RouterMode::Dynamo, DYNAMO_WEIGHTS));
        let c = parse(&[
            "--router-mode",
            "dynamo",
            "--router-prefill-load-scale",
            "10",
            "--router-kv-overlap-score-credit",
            "0.5",
            "--router-host-cache-hit-weight",
            "0.9",
            "--router-disk-cache-hit-weight",
            "0.1",
        ])
        .unwrap()
        .0
        .unwrap();
        assert_eq!(
            c.weights(),
            Weights {
                prefill_load_scale: 10.0,
                overlap_score_credit: 0.5,
                host_weight: 0.9,
                disk_weight: 0.1,
            }
        );
        let c = parse(&[
            "--router-mode",
            "kv-gpu",
            "--router-host-cache-hit-weight",
            "0.9",
        ])
        .unwrap()
        .0
        .unwrap();
        assert_eq!((c.host_weight, c.disk_weight), (0.0, 0.0));
        let c = parse(&[
            "--router-mode",
            "least-loaded",
            "--router-prefill-load-scale",
            "5",
        ])
        .unwrap()
        .0
        .unwrap();
        assert_eq!(
            (c.prefill_load_scale, c.overlap_score_credit, c.host_weight),
            (1.0, 0.0, 0.0)
        );
        let (c, warnings) = parse(&["--kv-overlap-score-weight", "3"]).unwrap();
        assert_eq!(c.unwrap().prefill_load_scale, 3.0);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("--router-prefill-load-scale"));
        let c = parse(&["--kv-overlap-score-weight", "0"])
            .unwrap()
            .0
            .unwrap();
        assert_eq!((c.prefill_load_scale, c.overlap_score_credit), (0.0, 0.0));
        // The new name wins over the old.
        let c = parse(&[
            "--kv-overlap-score-weight",
            "3",
            "--router-prefill-load-scale",
            "4",
        ])
        .unwrap()
        .0
        .unwrap();
        assert_eq!(c.prefill_load_scale, 4.0);
        let e = parse(&["--router-kv-overlap-score-credit=-1"])
            .unwrap()
            .0
            .unwrap_err()
            .to_string();
        assert!(e.contains("--router-kv-overlap-score-credit=-1"), "{e}");
        let e = parse(&["--router-mode", "fastest"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("round-robin"), "{e}");
        for mode in RouterMode::ALL {
            let c = parse(&["--router-mode", mode.name()]).unwrap().0.unwrap();
            assert_eq!(c.mode, mode);
        }
    }

    /// kvbm's shared-pool credit: its default below a disk hit in the modes that weigh tiers,
    /// the flag's value there, 0 in the others whatever the flag; a negative one is refused.
    #[test]
    fn the_shared_pool_weight_flag_sets_the_shared_credit() {
        use kvbm_events::router::SHARED_WEIGHT_DEFAULT;
        let parse = |flags: &[&str]| {
            let mut argv = vec!["kvbm-router"];
            argv.extend_from_slice(flags);
            Args::try_parse_from(argv).unwrap().selector_config()
        };
        assert_eq!(parse(&[]).unwrap().shared_weight, SHARED_WEIGHT_DEFAULT);
        let c = parse(&["--router-shared-cache-hit-weight", "0.5"]).unwrap();
        assert_eq!(c.shared_weight, 0.5);
        let c = parse(&[
            "--router-mode",
            "dynamo",
            "--router-shared-cache-hit-weight",
            "0",
        ]);
        assert_eq!(c.unwrap().shared_weight, 0.0);
        for mode in ["kv-gpu", "least-loaded", "round-robin"] {
            let c = parse(&[
                "--router-mode",
                mode,
                "--router-shared-cache-hit-weight",
                "0.5",
            ]);
            assert_eq!(c.unwrap().shared_weight, 0.0, "{mode}");
        }
        let e = parse(&["--router-shared-cache-hit-weight=-1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--router-shared-cache-hit-weight=-1"), "{e}");
        // The pseudo-workers' rank is no worker's.
        let e = parse_worker("1:4294967295=tcp://h:1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("reserved for shared pools"), "{e}");
    }

    /// `--router-shared-pools`: names checked as the workers' DYN_KVBM_SHARED_POOL is, repeats
    /// folded, none by default.
    #[test]
    fn the_shared_pools_flag_names_pools_every_worker_reaches() {
        let parse = |flags: &[&str]| {
            let mut argv = vec!["kvbm-router"];
            argv.extend_from_slice(flags);
            Args::try_parse_from(argv).unwrap().router_config()
        };
        assert!(parse(&[]).unwrap().shared_pools.is_empty());
        let c = parse(&["--router-shared-pools", "prod,kvbm:00ff,prod"]).unwrap();
        assert_eq!(c.shared_pools, vec!["prod", "kvbm:00ff"]);
        for bad in ["has space", "a,,b"] {
            let e = parse(&["--router-shared-pools", bad])
                .unwrap_err()
                .to_string();
            assert!(e.contains("router-shared-pools"), "{bad}: {e}");
        }
        let many: Vec<String> = (0..65).map(|i| format!("p{i}")).collect();
        let e = parse(&["--router-shared-pools", &many.join(",")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("64"), "{e}");
    }

    #[test]
    fn flags_out_of_range_are_refused_with_their_name() {
        let mut args = Args::parse_from(["kvbm-router"]);
        assert_eq!(args.http_host.to_string(), "127.0.0.1");
        let config = args.router_config().unwrap();
        assert_eq!(config.selector, SelectorConfig::default());
        args.router_host_cache_hit_weight = Some(-1.0);
        let e = args.router_config().unwrap_err().to_string();
        assert!(e.contains("--router-host-cache-hit-weight=-1"), "{e}");
        args.router_host_cache_hit_weight = Some(0.5);
        args.block_size = 0;
        assert!(args
            .router_config()
            .unwrap_err()
            .to_string()
            .contains("--block-size"));
        args.block_size = 16;
        // A time-to-live near u64::MAX would overflow every Instant it is added to.
        args.router_request_ttl_secs = u64::MAX - 1;
        let e = args.router_config().unwrap_err().to_string();
        assert!(
            e.contains("--router-request-ttl-secs=18446744073709551614"),
            "{e}"
        );
        args.router_request_ttl_secs = 600;
        for bad in [f64::NAN, -1.0, 1e30] {
            args.router_predicted_ttl_secs = bad;
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains("--router-predicted-ttl-secs"), "{e}");
        }
        args.router_predicted_ttl_secs = 2.5;
        // The tuned cost's knobs: finite, 0 or more, at most 100.
        for bad in [f64::NAN, -1.0, 101.0] {
            args.router_tuned_externality = bad;
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains("--router-tuned-externality="), "{e}");
            args.router_tuned_externality = 3.0;
            args.router_tuned_load_bound = bad;
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains("--router-tuned-load-bound="), "{e}");
            args.router_tuned_load_bound = 0.0;
        }
        let e = weight_at_most("x", 101.0, 100.0).unwrap_err().to_string();
        assert!(e.contains("(100)"), "{e}");
        args.router_tuned_externality = 100.0;
        args.router_tuned_load_bound = 0.5;
        let c = args.router_config().unwrap();
        assert_eq!((c.tuned_externality, c.tuned_load_bound), (100.0, 0.5));
        args.router_tuned_externality = 3.0;
        assert_eq!(
            args.router_config().unwrap().predicted_ttl,
            Duration::from_millis(2500)
        );
        // The balance term: a weight from 0 to 100 (kept only by the modes with weights), a
        // half-life above 0 and at most a day.
        for bad in [f64::NAN, -0.5, 100.5] {
            args.router_balance_weight = Some(bad);
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains("--router-balance-weight="), "{e}");
        }
        for bad in [f64::NAN, 0.0, -1.0, 86_401.0] {
            args.router_balance_weight = None;
            args.router_balance_half_life_secs = bad;
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains("--router-balance-half-life-secs="), "{e}");
        }
        args.router_balance_half_life_secs = 30.0;
        args.router_balance_weight = Some(0.25);
        let c = args.router_config().unwrap();
        assert_eq!(
            (c.selector.balance_weight, c.balance_half_life),
            (0.25, Duration::from_secs(30))
        );
        for mode in [RouterMode::RoundRobin, RouterMode::Tuned] {
            args.router_mode = mode;
            assert_eq!(args.router_config().unwrap().selector.balance_weight, 0.0);
        }
        args.router_mode = RouterMode::Kv;
        args.router_balance_weight = None;
        assert_eq!(args.router_config().unwrap().selector.balance_weight, 0.0);
        // An index capacity past what the index can number or the machine can map: a flag error,
        // not a panic when the index maps it.
        for bad in [10_000_000_000usize, usize::MAX, (1 << 32) - 1] {
            args.index_capacity_blocks = bad;
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains(&format!("--index-capacity-blocks={bad}")), "{e}");
        }
        // Whatever this machine's memory, the check against it is tested with given sizes.
        let e = index_capacity(1 << 30, Some(1 << 30))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--index-capacity-blocks=1073741824"), "{e}");
        assert!(e.contains("more index memory than this machine has"), "{e}");
        assert_eq!(index_capacity(1 << 30, Some(1 << 40)).unwrap(), 1 << 30);
        assert_eq!(index_capacity(1 << 30, None).unwrap(), 1 << 30);
        assert_eq!(index_capacity(1 << 20, Some(1 << 30)).unwrap(), 1 << 20);
        args.index_capacity_blocks = 1 << 20;
        assert_eq!(args.router_config().unwrap().index_capacity_blocks, 1 << 20);
        args.index_capacity_blocks = 0;
        args.max_workers = 0;
        assert!(args
            .router_config()
            .unwrap_err()
            .to_string()
            .contains("--max-workers=0"));
    }

    #[test]
    fn a_bound_refused_names_the_largest_value_accepted() {
        let mut args = Args::parse_from(["kvbm-router"]);
        args.bootstrap_timeout_secs = 3601;
        let e = args.router_config().unwrap_err().to_string();
        assert_eq!(
            e,
            "--bootstrap-timeout-secs=3601: is above the largest value accepted (3600)"
        );
        args.bootstrap_timeout_secs = 10;
        args.max_workers = 70_000;
        let e = args.router_config().unwrap_err().to_string();
        assert!(e.ends_with("accepted (65536)"), "{e}");
        args.max_workers = 4;
        args.bootstrap_max_blocks = Some((1 << 32) + 1);
        let e = args.router_config().unwrap_err().to_string();
        assert!(e.contains("--bootstrap-max-blocks=4294967297"), "{e}");
        assert!(e.ends_with("(4294967296)"), "{e}");
        args.bootstrap_max_blocks = None;
        args.block_size = 1 << 33;
        let e = args.router_config().unwrap_err().to_string();
        assert!(e.ends_with("(4294967295)"), "{e}");
    }

    #[test]
    fn the_bootstrap_block_bound_follows_the_index_and_memory() {
        // 64 workers of 300K holdings each fit the default of a 32 GiB machine or of an index
        // sized for 5M blocks, and 16M is the floor.
        let fleet = 64 * 300_000;
        assert!(bootstrap_max_blocks_default(0, Some(32 << 30)) >= fleet);
        assert!(bootstrap_max_blocks_default(5_000_000, None) >= fleet);
        assert_eq!(bootstrap_max_blocks_default(0, None), 1 << 24);
        assert_eq!(bootstrap_max_blocks_default(0, Some(1 << 30)), 1 << 24);
        assert_eq!(
            bootstrap_max_blocks_default(usize::MAX, Some(u64::MAX)),
            BOOTSTRAP_MAX_BLOCKS_MAX
        );
        let args = Args::parse_from(["kvbm-router", "--index-capacity-blocks", "8000000"]);
        assert!(args.router_config().unwrap().bootstrap_max_blocks >= 32_000_000);
        let args = Args::parse_from(["kvbm-router", "--bootstrap-max-blocks", "1000"]);
        let config = args.router_config().unwrap();
        assert_eq!(config.bootstrap_max_blocks, 1000);
        assert!(!config.bootstrap_required);
        let args = Args::parse_from(["kvbm-router", "--bootstrap-required"]);
        assert!(args.router_config().unwrap().bootstrap_required);
    }

    #[test]
    fn http_deadlines_are_validated_with_their_flag_named() {
        let mut args = Args::parse_from(["kvbm-router"]);
        let config = args.router_config().unwrap();
        assert_eq!(config.http_header_timeout, Duration::from_secs(10));
        assert_eq!(config.http_body_timeout, Duration::from_secs(60));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e30] {
            args.http_header_timeout_secs = bad;
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains("--http-header-timeout-secs="), "{e}");
            args.http_header_timeout_secs = 10.0;
            args.http_body_timeout_secs = bad;
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains("--http-body-timeout-secs="), "{e}");
            args.http_body_timeout_secs = 60.0;
        }
        let args = Args::parse_from([
            "kvbm-router",
            "--http-header-timeout-secs",
            "0.5",
            "--http-body-timeout-secs",
            "2",
        ]);
        let config = args.router_config().unwrap();
        assert_eq!(config.http_header_timeout, Duration::from_millis(500));
        assert_eq!(config.http_body_timeout, Duration::from_secs(2));
    }
}
