//! The OpenAI-compatible front end: what a user puts in front of `vllm serve` workers.
//!
//! | method and path | what it does |
//! | --- | --- |
//! | `GET /v1/models` | the served model (`--model-name`), in vLLM's `ModelList` shape |
//! | `POST /v1/completions` | tokenized, routed by KV overlap and load, forwarded to the chosen worker |
//! | `POST /v1/chat/completions` | the same, tokenized through the model's chat template |
//! | `POST /tokenize` | vLLM's `/tokenize`: `{"prompt"}` or `{"messages"}` in, `{"count", "max_model_len", "tokens"}` out |
//!
//! A request's body goes to its worker unchanged (with its `Authorization`); the answer comes back
//! unchanged, chunk by chunk as the worker sends it (SSE for `"stream": true`), with an
//! `x-kvbm-worker: ID:RANK` header naming the worker. The router tokenizes the prompt as the worker
//! will ([`crate::tokenize`]), so its block hashes are the ones the worker's KV events announce.
//!
//! Load: a forwarded request counts as prefill on its worker until the first chunk of the answer,
//! as decode until the last, and not at all once the answer ends or the client goes away. A client
//! that goes away drops the connection to the worker, which is how vLLM learns to abort it.
//!
//! Failures: a worker that refuses the connection, resets it, times out or answers 502, 503 or
//! 504 before its first byte is left out of routing for `--worker-failure-cooldown-secs` and the
//! request goes to the next best worker, up to `--max-retries` times. After the first byte, a
//! streamed answer ends with an SSE error event (`data: {"error": ...}` then `data: [DONE]`); a
//! whole answer is cut short. Errors the router answers itself have vLLM's shape,
//! `{"error": {"message", "type", "param", "code"}}`: 404 for a `model` it does not serve, 400 for
//! a body that is not a JSON object, 413 above `--max-body-bytes`, 503 when no worker can take the
//! request, or when a large body (above `--large-prompt-bytes`) would pass
//! `--max-inflight-prompt-bytes`.
//!
//! Bounds: tokenizing runs in two lanes of permits, small bodies (twice the cores) and large ones
//! (half the cores, at least 1), so that small requests never queue behind large prompts; large
//! bodies also hold their bytes of `--max-inflight-prompt-bytes` from arrival to the end of their
//! tokenizing (the tokenizer's memory is a few times that, see [`crate::tokenize`]), and memory
//! freed by a large tokenizing is handed back to the system (`malloc_trim`). A worker's stream is
//! framed in linear time, and an event longer than `--max-sse-event-bytes` ends the client's
//! stream with an error event. A request whose prompt the router cannot tokenize exactly (a multimodal part, a
//! per-request chat template) is still served: it is routed by load alone, and counted.
//!
//! Evidence for the tuned cost (`kvbm_events::router::tune`): a streamed answer that ends well on
//! its first attempt reports its time to first token (from the routing decision to the first
//! chunk) with what the decision knew of the worker, and, when the client asked for
//! `stream_options.include_usage`, its time per output token (first to last chunk over the usage
//! chunk's `completion_tokens` − 1). Whole answers, failed and retried requests teach nothing.

use std::collections::BTreeMap;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::connect_info::ConnectInfo;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};

use crate::config::FrontendConfig;
use crate::listener::{BusyGuard, ConnBusy};
use crate::state::{RequestTokens, RouteAnswer, Router};
use crate::tokenize::{ChatRequest, Encoded, ModelTokenizer, TokenizeError};

type WorkerKey = (u64, u32);

/// The response header naming the worker that served a request.
pub const WORKER_HEADER: &str = "x-kvbm-worker";

/// Request headers passed on to the worker (besides the JSON content type).
const FORWARDED_REQUEST_HEADERS: [HeaderName; 3] = [
    header::AUTHORIZATION,
    header::ACCEPT,
    HeaderName::from_static("x-request-id"),
];

/// Response headers passed back to the client.
const FORWARDED_RESPONSE_HEADERS: [HeaderName; 3] = [
    header::CONTENT_TYPE,
    header::CACHE_CONTROL,
    HeaderName::from_static("x-request-id"),
];

/// An error answered by the front end itself, in vLLM's shape.
#[derive(Debug)]
pub struct OpenAiError {
    status: StatusCode,
    message: String,
}

impl OpenAiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// vLLM's error type names (`create_error_response`).
    fn kind(status: StatusCode) -> &'static str {
        match status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::PAYLOAD_TOO_LARGE => "PayloadTooLargeError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => "BadGatewayError",
            _ => "InternalServerError",
        }
    }

    fn body(status: StatusCode, message: &str) -> Value {
        json!({ "error": {
            "message": message,
            "type": Self::kind(status),
            "param": null,
            "code": status.as_u16(),
        }})
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        (self.status, Json(Self::body(self.status, &self.message))).into_response()
    }
}

impl From<TokenizeError> for OpenAiError {
    fn from(e: TokenizeError) -> Self {
        match e {
            TokenizeError::Encode(_) | TokenizeError::Load(_) => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
            }
            _ => Self::bad_request(e.to_string()),
        }
    }
}

/// Which OpenAI endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }

    /// The `endpoint` label of Dynamo's frontend metrics.
    fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::ChatCompletions => "chat_completions",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Endpoint::Completions => "prompt",
            Endpoint::ChatCompletions => "chat",
        }
    }
}

/// The front end: the model's tokenizer, the router, and a client to the workers.
pub struct Frontend {
    router: Arc<Router>,
    tokenizer: Arc<ModelTokenizer>,
    model: String,
    created: u64,
    client: reqwest::Client,
    config: FrontendConfig,
    /// Tokenizations of small requests running at once: twice the cores, so that a burst queues
    /// here instead of filling the blocking pool (its threads, their memory).
    tokenizing: Arc<tokio::sync::Semaphore>,
    /// Tokenizations of large requests (bodies above `--large-prompt-bytes`) running at once:
    /// half the cores, at least 1. A lane of their own, so that small requests never queue
    /// behind them, and the cores are never all theirs.
    tokenizing_large: Arc<tokio::sync::Semaphore>,
    /// `--max-inflight-prompt-bytes`, in KiB: what large requests hold from their body's arrival
    /// to the end of their tokenizing.
    prompt_budget: Arc<tokio::sync::Semaphore>,
}

/// Which tokenizing lane a request takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Bodies up to `--large-prompt-bytes`.
    Small,
    /// Bodies above it.
    Large,
}

impl Lane {
    fn label(self) -> &'static str {
        match self {
            Lane::Small => "small",
            Lane::Large => "large",
        }
    }
}

/// A request admitted to tokenizing: its share of `--max-inflight-prompt-bytes` (large requests),
/// given back when it is dropped.
#[derive(Debug)]
pub struct Admission {
    lane: Lane,
    fe: Fe,
    _budget: Option<tokio::sync::OwnedSemaphorePermit>,
    bytes: usize,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if self.lane == Lane::Large {
            self.fe
                .router
                .metrics()
                .frontend
                .inflight_prompt_bytes
                .sub(self.bytes as i64);
        }
    }
}

/// Hands the memory glibc keeps in its arenas after a large tokenizing back to the system (the
/// blocking threads each have an arena, and freed memory would otherwise stay resident).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl std::fmt::Debug for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontend")
            .field("model", &self.model)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Frontend {
    /// The front end of `router` as its configuration asks (`--model-path`): None when it is off.
    pub fn load(router: &Arc<Router>) -> anyhow::Result<Option<Arc<Self>>> {
        let config = router.config().frontend.clone();
        let Some(path) = &config.model_path else {
            return Ok(None);
        };
        let tokenizer = ModelTokenizer::from_dir(path)
            .map_err(|e| anyhow::anyhow!("--model-path {}: {e}", path.display()))?
            .with_prefix_cache(config.tokenizer_cache_bytes);
        Ok(Some(Arc::new(Self::new(
            router.clone(),
            Arc::new(tokenizer),
            config,
        )?)))
    }

    /// A front end over `router` serving `tokenizer`'s model.
    pub fn new(
        router: Arc<Router>,
        tokenizer: Arc<ModelTokenizer>,
        config: FrontendConfig,
    ) -> anyhow::Result<Self> {
        let model = config
            .model_name
            .clone()
            .or_else(|| {
                config
                    .model_path
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "model".to_owned());
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            // Workers are addressed directly: no proxy from the environment, no redirects.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            // Below uvicorn's keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so that a
            // request is never written onto a connection the worker is closing.
            .pool_idle_timeout(Duration::from_secs(4))
            .build()
            .map_err(|e| anyhow::anyhow!("building the HTTP client to the workers: {e}"))?;
        Ok(Self {
            router,
            tokenizer,
            model,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            client,
            tokenizing: Arc::new(tokio::sync::Semaphore::new(2 * cores)),
            tokenizing_large: Arc::new(tokio::sync::Semaphore::new((cores / 2).max(1))),
            prompt_budget: Arc::new(tokio::sync::Semaphore::new(
                config.max_inflight_prompt_bytes.div_ceil(1024),
            )),
            config,
        })
    }

    /// Admits a request of `bytes` (its body) to tokenizing: a small one always, a large one if
    /// `--max-inflight-prompt-bytes` has room for it (else 503, counted).
    pub fn admit(self: &Arc<Self>, bytes: usize) -> Result<Admission, OpenAiError> {
        if bytes <= self.config.large_prompt_bytes {
            return Ok(Admission {
                lane: Lane::Small,
                fe: self.clone(),
                _budget: None,
                bytes,
            });
        }
        let m = &self.router.metrics().frontend;
        let kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX);
        match self.prompt_budget.clone().try_acquire_many_owned(kib) {
            Ok(permit) => {
                m.inflight_prompt_bytes.add(bytes as i64);
                Ok(Admission {
                    lane: Lane::Large,
                    fe: self.clone(),
                    _budget: Some(permit),
                    bytes,
                })
            }
            Err(_) => {
                m.prompt_budget_refusals.inc();
                Err(OpenAiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "the router is tokenizing {} bytes of large requests already; a request \
                         of {bytes} bytes would pass --max-inflight-prompt-bytes={}: retry later",
                        m.inflight_prompt_bytes.get(),
                        self.config.max_inflight_prompt_bytes
                    ),
                ))
            }
        }
    }

    /// Waits for a tokenizing permit in `admission`'s lane.
    pub async fn tokenize_permit(
        &self,
        admission: &Admission,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let lane = match admission.lane {
            Lane::Small => &self.tokenizing,
            Lane::Large => &self.tokenizing_large,
        };
        let waiting = self
            .router
            .metrics()
            .frontend
            .tokenize_waiting
            .with_label_values(&[admission.lane.label()]);
        waiting.inc();
        let permit = lane.clone().acquire_owned().await.ok();
        waiting.dec();
        permit
    }

    /// Takes every permit of `lane` (a test's way to show the other lane still serves).
    pub async fn hold_lane(&self, lane: Lane) -> tokio::sync::OwnedSemaphorePermit {
        let sem = match lane {
            Lane::Small => &self.tokenizing,
            Lane::Large => &self.tokenizing_large,
        };
        let n = u32::try_from(sem.available_permits()).unwrap_or(u32::MAX);
        sem.clone()
            .acquire_many_owned(n)
            .await
            .expect("the lane's semaphore is never closed")
    }

    /// Checks the request's `model` (absent, null or empty means the served one, as in vLLM);
    /// answers the LoRA adapter it names, if it names one (`--lora-names`).
    fn check_model(
        &self,
        body: &serde_json::Map<String, Value>,
    ) -> Result<Option<String>, OpenAiError> {
        match body.get("model") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(m)) if m.is_empty() || *m == self.model => Ok(None),
            Some(Value::String(m)) if self.config.lora_names.contains(m) => Ok(Some(m.clone())),
            Some(Value::String(m)) => Err(OpenAiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "The model `{m}` does not exist. Valid model names: {:?}",
                    std::iter::once(&self.model)
                        .chain(&self.config.lora_names)
                        .collect::<Vec<_>>()
                ),
            )),
            Some(_) => Err(OpenAiError::bad_request("'model' must be a string")),
        }
    }
}

/// The routes of the front end; when it is off, `/v1/...` and `/tokenize` say how to turn it on.
pub fn routes(frontend: Option<Arc<Frontend>>) -> axum::Router {
    match frontend {
        Some(fe) => axum::Router::new()
            .route("/v1/models", get(models))
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/tokenize", post(tokenize))
            .route("/health", get(health))
            .route(
                "/v1/{*rest}",
                axum::routing::any(|| async {
                    OpenAiError::new(
                        StatusCode::NOT_FOUND,
                        "the router serves /v1/models, /v1/completions and /v1/chat/completions",
                    )
                }),
            )
            .with_state(fe),
        None => {
            let off = || async {
                OpenAiError::new(
                    StatusCode::NOT_FOUND,
                    "the OpenAI front end is off: start kvbm-router with --model-path DIR (the \
                     model's tokenizer files)",
                )
            };
            axum::Router::new()
                .route("/v1/{*rest}", axum::routing::any(off))
                .route("/tokenize", axum::routing::any(off))
        }
    }
}

type Fe = Arc<Frontend>;

/// vLLM's `GET /health`: 200 while the router can route (some worker is followed), else 503, so
/// that probes written for `vllm serve` work unchanged.
async fn health(State(fe): State<Fe>) -> Response {
    if fe.router.http_urls().is_empty() {
        OpenAiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no worker with an HTTP server is registered",
        )
        .into_response()
    } else {
        StatusCode::OK.into_response()
    }
}

/// vLLM's `ModelList`: the model, then each LoRA adapter with the model as its parent.
async fn models(State(fe): State<Fe>) -> Json<Value> {
    let root = fe
        .config
        .model_path
        .as_ref()
        .map(|p| p.to_string_lossy().into_owned());
    let card = |id: &str, root: Option<&str>, parent: Option<&str>| {
        json!({
            "id": id,
            "object": "model",
            "created": fe.created,
            "owned_by": "kvbm",
            "root": root,
            "parent": parent,
            "max_model_len": null,
            "permission": [],
        })
    };
    let mut data = vec![card(&fe.model, root.as_deref(), None)];
    for lora in &fe.config.lora_names {
        data.push(card(lora, None, Some(&fe.model)));
    }
    Json(json!({ "object": "list", "data": data }))
}

/// Reads a request's body as a JSON object, within the body limit.
async fn json_body(
    fe: &Frontend,
    request: Request,
) -> Result<
    (
        HeaderMap,
        Option<ConnBusy>,
        Bytes,
        serde_json::Map<String, Value>,
    ),
    OpenAiError,
> {
    let (parts, body) = request.into_parts();
    let busy = parts
        .extensions
        .get::<ConnectInfo<ConnBusy>>()
        .map(|c| c.0.clone());
    let limit = fe.router.config().max_body_bytes;
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large =
            std::iter::successors(Some(&e as &(dyn std::error::Error + 'static)), |e| {
                e.source()
            })
            .any(|e| e.is::<http_body_util::LengthLimitError>());
        if too_large {
            OpenAiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is larger than {limit} bytes (--max-body-bytes)"),
            )
        } else {
            OpenAiError::bad_request(format!("reading the request body: {e}"))
        }
    })?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| OpenAiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(OpenAiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    Ok((parts.headers, busy, bytes, map))
}

/// `/tokenize`'s answer, serialized straight from the ids (not through a JSON tree).
#[derive(serde::Serialize)]
struct TokenizeAnswer {
    count: usize,
    max_model_len: usize,
    tokens: Vec<u32>,
}

async fn tokenize(
    State(fe): State<Fe>,
    request: Request,
) -> Result<Json<TokenizeAnswer>, OpenAiError> {
    let (_, busy, raw, body) = json_body(&fe, request).await?;
    // Not idle while its prompt waits and is tokenized (`--http-idle-timeout-secs`).
    let _busy = busy.as_ref().map(ConnBusy::hold);
    let admission = fe.admit(raw.len())?;
    drop(raw);
    fe.check_model(&body)?;
    let tokenizer = fe.tokenizer.clone();
    let body = Value::Object(body);
    let _permit = fe.tokenize_permit(&admission).await;
    let large = admission.lane == Lane::Large;
    let tokens = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, TokenizeError> {
        let tokens = tokenize_body(&tokenizer, &body);
        drop(body);
        if large {
            release_freed_memory();
        }
        tokens
    })
    .await
    .map_err(|e| OpenAiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    drop(admission);
    // max_model_len is the worker's setting, which the router does not know: 0.
    Ok(Json(TokenizeAnswer {
        count: tokens.len(),
        max_model_len: 0,
        tokens,
    }))
}

/// The ids of a `/tokenize` body.
fn tokenize_body(tokenizer: &ModelTokenizer, body: &Value) -> Result<Vec<u32>, TokenizeError> {
    if body.get("messages").is_some() {
        tokenizer.encode_chat(&ChatRequest::from_body(body)?)
    } else {
        let Some(Value::String(prompt)) = body.get("prompt") else {
            return Err(TokenizeError::BadRequest(
                "/tokenize takes 'prompt' (a string) or 'messages'".to_owned(),
            ));
        };
        let add = match body.get("add_special_tokens") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(TokenizeError::BadRequest(
                    "'add_special_tokens' must be a boolean".to_owned(),
                ))
            }
        };
        tokenizer.encode_prompt(prompt, add)
    }
}

async fn completions(State(fe): State<Fe>, request: Request) -> Response {
    serve_openai(fe, Endpoint::Completions, request).await
}

async fn chat_completions(State(fe): State<Fe>, request: Request) -> Response {
    serve_openai(fe, Endpoint::ChatCompletions, request).await
}

/// The prompt of a completions request as the worker will see it: a string to encode, or ids.
enum Prompt<'a> {
    Text(&'a str),
    Ids(Vec<u32>),
}

fn ids(values: &[Value]) -> Option<Vec<u32>> {
    values
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// `prompt` as vLLM reads it: a string, a list of ids, or a batch of either (routed by its first
/// prompt, which the worker runs first).
fn completion_prompt(body: &serde_json::Map<String, Value>) -> Result<Prompt<'_>, TokenizeError> {
    let bad = |why: &str| TokenizeError::BadRequest(why.to_owned());
    match body.get("prompt") {
        Some(Value::String(s)) => Ok(Prompt::Text(s)),
        Some(Value::Array(items)) => match items.first() {
            None => Err(bad("'prompt' is an empty list")),
            Some(Value::String(s)) => Ok(Prompt::Text(s)),
            Some(Value::Array(first)) => ids(first)
                .map(Prompt::Ids)
                .ok_or_else(|| bad("'prompt' token ids must be integers below 2^32")),
            Some(_) => ids(items)
                .map(Prompt::Ids)
                .ok_or_else(|| bad("'prompt' token ids must be integers below 2^32")),
        },
        _ => Err(bad(
            "'prompt' must be a string, a list of token ids, or a list of either",
        )),
    }
}

/// The token ids the worker will compute for `body`, as far as `more` lets the tokenizer go
/// (see [`ModelTokenizer::encode_prompt_until`]).
fn request_tokens(
    tokenizer: &ModelTokenizer,
    endpoint: Endpoint,
    body: &Value,
    more: &mut dyn FnMut(&[u32], usize) -> bool,
) -> Result<Encoded, TokenizeError> {
    match endpoint {
        Endpoint::Completions => {
            let obj = body.as_object().expect("checked: an object");
            match completion_prompt(obj)? {
                Prompt::Ids(ids) => Ok(Encoded {
                    ids,
                    ..Encoded::default()
                }),
                Prompt::Text(text) => {
                    let add = obj
                        .get("add_special_tokens")
                        .and_then(Value::as_bool)
                        .unwrap_or(true);
                    tokenizer.encode_prompt_until(text, add, more)
                }
            }
        }
        Endpoint::ChatCompletions => {
            tokenizer.encode_chat_until(&ChatRequest::from_body(body)?, more)
        }
    }
}

/// Why a forwarding attempt failed before the answer's first byte (then the next worker is tried).
fn attempt_error(e: &reqwest::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Counts an in-flight request in `dynamo_frontend_inflight_requests` while it lives.
struct Inflight(prometheus::IntGauge);

impl Inflight {
    fn new(gauge: prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What is known of a request from its arrival: ends it in the metrics exactly once, when it is
/// dropped (with `outcome`, or as cancelled if none was set: the client went away, and hyper
/// dropped the handler or the answer's stream).
struct Ledger {
    fe: Fe,
    endpoint: Endpoint,
    stream: bool,
    arrived: Instant,
    outcome: Option<&'static str>,
    _inflight: Inflight,
    _busy: Option<BusyGuard>,
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.end(self.outcome.unwrap_or("cancelled"));
    }
}

impl Ledger {
    fn end(&self, outcome: &'static str) {
        let m = &self.fe.router.metrics().frontend;
        let status = if outcome == "success" {
            "success"
        } else {
            "error"
        };
        let request_type = if self.stream { "stream" } else { "unary" };
        m.requests
            .with_label_values(&[
                self.fe.model.as_str(),
                self.endpoint.label(),
                request_type,
                status,
            ])
            .inc();
        m.outcomes.with_label_values(&[outcome]).inc();
        m.duration
            .with_label_values(&[self.fe.model.as_str()])
            .observe(self.arrived.elapsed().as_secs_f64());
    }

    fn fail(mut self, outcome: &'static str, error: OpenAiError) -> Response {
        self.outcome = Some(outcome);
        error.into_response()
    }
}

/// A routed request's load on its worker: released when dropped, whatever path the request takes
/// (failed attempt, answer ended, client gone while the worker had not answered yet).
struct Routed {
    fe: Fe,
    request_id: String,
}

impl Drop for Routed {
    fn drop(&mut self) {
        self.fe.router.finished(&self.request_id);
    }
}

async fn serve_openai(fe: Fe, endpoint: Endpoint, request: Request) -> Response {
    let arrived = Instant::now();
    let inflight = Inflight::new(
        fe.router
            .metrics()
            .frontend
            .inflight
            .with_label_values(&[fe.model.as_str()]),
    );
    let read = json_body(&fe, request).await;
    let stream_flag = |b: &serde_json::Map<String, Value>| {
        b.get("stream").and_then(Value::as_bool).unwrap_or(false)
    };
    let (headers, busy, raw, body) = match read {
        Ok(r) => r,
        Err(e) => {
            let ledger = Ledger {
                fe: fe.clone(),
                endpoint,
                stream: false,
                arrived,
                outcome: None,
                _inflight: inflight,
                _busy: None,
            };
            return ledger.fail("bad_request", e);
        }
    };
    let ledger = Ledger {
        fe: fe.clone(),
        endpoint,
        stream: stream_flag(&body),
        arrived,
        outcome: None,
        _inflight: inflight,
        _busy: busy.as_ref().map(ConnBusy::hold),
    };
    let lora_name = match fe.check_model(&body) {
        Ok(lora) => lora,
        Err(e) => {
            let outcome = if e.status == StatusCode::NOT_FOUND {
                "model_not_found"
            } else {
                "bad_request"
            };
            return ledger.fail(outcome, e);
        }
    };
    // The client asked for a usage chunk at the end of the stream: its completion_tokens give
    // the time per output token the tuned cost learns from.
    let usage_asked = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let cache_salt = body
        .get("cache_salt")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let admission = match fe.admit(raw.len()) {
        Ok(a) => a,
        Err(e) => return ledger.fail("prompt_budget", e),
    };

    // Tokenize as the worker will, off the async workers (an 8K-token prompt takes milliseconds),
    // as far as any worker's overlap can reach, and no further than where the pick is sure,
    // unless --tokenize-whole-prompts (or --tokenize-past-sure-pick).
    let tokenizer = fe.tokenizer.clone();
    let router = fe.router.clone();
    let whole = fe.config.tokenize_whole_prompts;
    let past_sure_pick = fe.config.tokenize_past_sure_pick;
    let probe_lora = lora_name.clone();
    let probe_salt = cache_salt.clone();
    let body_value = Value::Object(body);
    let started = Instant::now();
    let permit = fe.tokenize_permit(&admission).await;
    let large = admission.lane == Lane::Large;
    let stage_cpu = fe.router.metrics().modes.stage_cpu.clone();
    let tokens = tokio::task::spawn_blocking(move || {
        let cpu = crate::metrics::thread_cpu_seconds();
        let mut probe = router.prefix_probe(probe_lora.as_deref(), probe_salt.as_deref());
        let mut more = |ids: &[u32], rest_tokens: usize| {
            whole
                || if past_sure_pick {
                    probe.holds_all(ids)
                } else {
                    probe.worth_more(ids, rest_tokens)
                }
        };
        let tokens = request_tokens(&tokenizer, endpoint, &body_value, &mut more);
        drop(body_value);
        if large {
            release_freed_memory();
        }
        crate::metrics::count_cpu(&stage_cpu, "tokenize", cpu);
        tokens
    })
    .await;
    drop(permit);
    drop(admission);
    let m = &fe.router.metrics().frontend;
    m.tokenize
        .with_label_values(&[endpoint.kind()])
        .observe(started.elapsed().as_secs_f64());
    let encoded = match tokens {
        Ok(Ok(encoded)) => {
            let e = &encoded;
            let bytes = &m.prompt_bytes;
            let skipped = e.untokenized_bytes;
            bytes
                .with_label_values(&["cached"])
                .inc_by(e.cached_bytes as u64);
            bytes.with_label_values(&["skipped"]).inc_by(skipped as u64);
            bytes
                .with_label_values(&["tokenized"])
                .inc_by((e.text_bytes - skipped - e.cached_bytes) as u64);
            m.tokenizer_cache_bytes
                .set(fe.tokenizer.prefix_cache_usage().0 as i64);
            let words = &m.tokenizer_words;
            words
                .with_label_values(&["cache"])
                .inc_by(e.words_from_cache as u64);
            words
                .with_label_values(&["model"])
                .inc_by(e.words_from_model as u64);
            m.input_tokens
                .with_label_values(&[fe.model.as_str()])
                .observe(e.estimated_tokens() as f64);
            encoded
        }
        Ok(Err(e)) => {
            // The worker is the judge of its own input: route by load alone and let it answer.
            m.tokenize_fallbacks.inc();
            tracing::debug!(error = %e, "prompt not tokenized; routing by load alone");
            Encoded::default()
        }
        Err(e) => {
            return ledger.fail(
                "tokenize_error",
                OpenAiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            )
        }
    };
    let tokens = RequestTokens {
        token_ids: &encoded.ids,
        untokenized_tokens: encoded.estimated_tokens() - encoded.ids.len(),
        lora_name: lora_name.as_deref(),
        cache_salt: cache_salt.as_deref(),
    };
    forward(
        fe.clone(),
        ledger,
        endpoint,
        &headers,
        raw,
        &tokens,
        usage_asked,
    )
    .await
}

/// What became of one attempt to hand a request to a worker.
enum Attempt {
    /// The worker answered (its first SSE event, or its whole status and headers otherwise).
    Answered(Box<Upstream>),
    /// It refused, dropped the connection, or said it cannot take requests (502/503/504), before
    /// anything reached the client: the next best worker is tried.
    Failed(String),
    /// It took the request but sent nothing within `--worker-response-timeout-secs`: not retried
    /// (a slow worker would be given the same work again), answered 504.
    TimedOut(String),
}

/// A worker's answer as far as it was read before committing to it.
struct Upstream {
    status: reqwest::StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    /// The first chunk of a streamed answer, read before committing (see [`send_to`]).
    first: Option<Bytes>,
    sse: bool,
}

/// Sends the request to `url` and waits for its answer's headers and, for a streamed answer, its
/// first chunk: vLLM sends a stream's 200 headers before it queues and computes the prompt, so a
/// worker that dies during prefill fails here, where the next worker can still be tried.
async fn send_to(fe: &Frontend, request: reqwest::RequestBuilder, url: &str) -> Attempt {
    let timeout = fe.config.response_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    let timed_out = || {
        Attempt::TimedOut(format!(
            "{url} sent no answer within {timeout:?} (--worker-response-timeout-secs)"
        ))
    };
    let response = match tokio::time::timeout_at(deadline, request.send()).await {
        Err(_) => return timed_out(),
        Ok(Err(e)) => return Attempt::Failed(format!("{url}: {}", attempt_error(&e))),
        Ok(Ok(r)) => r,
    };
    let status = response.status();
    if matches!(status.as_u16(), 502..=504) {
        return Attempt::Failed(format!("{url} answered {status}"));
    }
    let headers = response.headers().clone();
    let sse = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut body: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>> =
        Box::pin(response.bytes_stream());
    let mut first = None;
    if sse && status.is_success() {
        loop {
            match tokio::time::timeout_at(deadline, body.next()).await {
                Err(_) => return timed_out(),
                Ok(Some(Ok(chunk))) if chunk.is_empty() => continue,
                Ok(Some(Ok(chunk))) => {
                    first = Some(chunk);
                    break;
                }
                Ok(Some(Err(e))) => {
                    return Attempt::Failed(format!(
                        "{url} dropped the stream before its first event: {}",
                        attempt_error(&e)
                    ))
                }
                Ok(None) => {
                    return Attempt::Failed(format!("{url} ended the stream without an event"))
                }
            }
        }
    }
    Attempt::Answered(Box::new(Upstream {
        status,
        headers,
        body,
        first,
        sse,
    }))
}

/// Routes the request and sends it to the chosen worker, trying the next best on failure.
async fn forward(
    fe: Fe,
    ledger: Ledger,
    endpoint: Endpoint,
    headers: &HeaderMap,
    raw: Bytes,
    tokens: &RequestTokens<'_>,
    usage_asked: bool,
) -> Response {
    let m = &fe.router.metrics().frontend;
    let mut tried: Vec<WorkerKey> = Vec::new();
    let mut last_failure: Option<String> = None;
    for attempt in 0..=fe.config.max_retries {
        let urls: BTreeMap<WorkerKey, String> = fe.router.http_urls();
        let started = Instant::now();
        let cpu = crate::metrics::thread_cpu_seconds();
        let routed = fe.router.route_among(
            tokens,
            None,
            |k| urls.contains_key(&k) && !tried.contains(&k),
            true,
        );
        crate::metrics::count_cpu(&fe.router.metrics().modes.stage_cpu, "route", cpu);
        m.routing.observe(started.elapsed().as_secs_f64());
        let answer = match routed {
            Ok(a) => a,
            Err(e) => {
                let why = match &last_failure {
                    Some(f) => format!("no worker could take the request (last failure: {f})"),
                    None => e.to_string(),
                };
                return ledger.fail(
                    "no_worker",
                    OpenAiError::new(StatusCode::SERVICE_UNAVAILABLE, why),
                );
            }
        };
        if attempt > 0 {
            m.retries.inc();
        }
        let key = (answer.worker_id, answer.dp_rank);
        let routed = Routed {
            fe: fe.clone(),
            request_id: answer.request_id.clone(),
        };
        log_decision(&answer, attempt);
        let base = &urls[&key];
        let url = format!("{base}{}", endpoint.path());
        let mut request = fe
            .client
            .post(&url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(raw.clone());
        for name in &FORWARDED_REQUEST_HEADERS {
            for value in headers.get_all(name) {
                request = request.header(name, value);
            }
        }
        if !headers.contains_key("x-request-id") {
            // vLLM takes it as its request id with --enable-request-id-headers: the router's
            // decision line and the worker's log then name the same request.
            request = request.header("x-request-id", answer.request_id.as_str());
        }
        if urls.values().filter(|u| *u == base).count() > 1 {
            // Several ranks behind one server (vLLM's internal data-parallel balancer): name the
            // rank chosen (vLLM reads it in `_get_data_parallel_rank`).
            request = request.header("x-data-parallel-rank", answer.dp_rank.to_string());
        }
        let failure = match send_to(&fe, request, &url).await {
            Attempt::Answered(upstream) => {
                observe_overlap(&fe, &answer);
                // Only a stream's first attempt is evidence of the worker's speed: a whole
                // answer has no first token, a retried request's time includes the failure.
                let learning = (ledger.stream && attempt == 0)
                    .then_some(answer.routed_at)
                    .flatten()
                    .map(|routed_at| Learning {
                        features: answer.features,
                        routed_at,
                        first_at: None,
                        last_at: None,
                        usage_asked,
                        completion_tokens: None,
                    });
                return relay(fe.clone(), ledger, routed, key, *upstream, learning);
            }
            Attempt::TimedOut(why) => {
                tracing::warn!(worker = ?key, failure = %why, "worker took the request but did not answer");
                fe.router.cool_down(key, fe.config.failure_cooldown);
                return ledger.fail(
                    "worker_timeout",
                    OpenAiError::new(StatusCode::GATEWAY_TIMEOUT, why),
                );
            }
            Attempt::Failed(why) => why,
        };
        tracing::warn!(worker = ?key, attempt, failure = %failure, "worker failed a request before answering; trying the next best");
        drop(routed);
        fe.router.cool_down(key, fe.config.failure_cooldown);
        tried.push(key);
        last_failure = Some(failure);
    }
    let why = last_failure.unwrap_or_default();
    ledger.fail(
        "no_worker",
        OpenAiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "no worker could take the request after {} attempts (last failure: {why})",
                fe.config.max_retries + 1
            ),
        ),
    )
}

/// The `DYN_LOG=debug` line of a routing decision.
fn log_decision(answer: &RouteAnswer, attempt: usize) {
    let best_other = answer
        .runner_ups
        .first()
        .map(|c| format!("{}:{} at {:.3}", c.worker_id, c.dp_rank, c.cost));
    tracing::debug!(
        request_id = %answer.request_id,
        worker = %format_args!("{}:{}", answer.worker_id, answer.dp_rank),
        overlap_gpu_blocks = answer.overlap.gpu_blocks,
        overlap_host_blocks = answer.overlap.host_blocks,
        overlap_disk_blocks = answer.overlap.disk_blocks,
        overlap_shared_blocks = answer.overlap.shared_blocks,
        request_blocks = answer.request_blocks,
        cost = answer.cost,
        runner_up = best_other.as_deref().unwrap_or("none"),
        attempt,
        "routing decision"
    );
}

fn observe_overlap(fe: &Frontend, answer: &RouteAnswer) {
    let h = &fe.router.metrics().frontend.overlap_blocks;
    for (tier, n) in [
        ("gpu", answer.overlap.gpu_blocks),
        ("host", answer.overlap.host_blocks),
        ("disk", answer.overlap.disk_blocks),
        ("shared", answer.overlap.shared_blocks),
    ] {
        h.with_label_values(&[tier]).observe(n as f64);
    }
}

/// What a streamed answer teaches the tuned cost: its time to first token against what the
/// routing decision knew, and its time per output token when the client asked for usage.
struct Learning {
    features: kvbm_events::router::RouteFeatures,
    routed_at: Instant,
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    usage_asked: bool,
    /// The last `completion_tokens` seen in the stream (its usage chunk).
    completion_tokens: Option<usize>,
}

const COMPLETION_TOKENS_KEY: &[u8] = b"\"completion_tokens\":";

/// The number after the last `"completion_tokens":` in `bytes`, if any.
fn completion_tokens(bytes: &[u8]) -> Option<usize> {
    let at = bytes
        .windows(COMPLETION_TOKENS_KEY.len())
        .rposition(|w| w == COMPLETION_TOKENS_KEY)?;
    let rest = &bytes[at + COMPLETION_TOKENS_KEY.len()..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits = rest[start..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    std::str::from_utf8(&rest[start..start + digits])
        .ok()?
        .parse()
        .ok()
}

impl Learning {
    fn chunk(&mut self, bytes: &[u8]) {
        let now = Instant::now();
        self.first_at.get_or_insert(now);
        self.last_at = Some(now);
        if self.usage_asked {
            if let Some(n) = completion_tokens(bytes) {
                self.completion_tokens = Some(n);
            }
        }
    }

    /// The answer ended well: its times go to the learner.
    fn teach(&self, fe: &Frontend, worker: WorkerKey) {
        let Some(first) = self.first_at else {
            return;
        };
        let ttft = first
            .saturating_duration_since(self.routed_at)
            .as_secs_f64();
        fe.router.observe_ttft(worker, &self.features, ttft);
        if let (Some(n), Some(last)) = (self.completion_tokens, self.last_at) {
            if n >= 2 {
                let tpot = last.saturating_duration_since(first).as_secs_f64() / (n - 1) as f64;
                fe.router
                    .observe_tpot(worker, self.features.decode_blocks, n, tpot);
            }
        }
    }
}

/// A request being answered: releases its load and ends it in the metrics exactly once, when the
/// answer ends, fails, or is dropped because the client went away.
struct Answering {
    ledger: Ledger,
    routed: Routed,
    worker: WorkerKey,
    first_seen: bool,
    outcome: Option<&'static str>,
    learning: Option<Learning>,
}

impl Answering {
    /// A chunk of the answer went by.
    fn chunk(&mut self, bytes: &[u8]) {
        self.first_chunk();
        if let Some(l) = &mut self.learning {
            l.chunk(bytes);
        }
    }

    fn first_chunk(&mut self) {
        if !self.first_seen {
            self.first_seen = true;
            let fe = &self.ledger.fe;
            fe.router.first_token(&self.routed.request_id);
            // A whole answer's first chunk is all of it: no time to first token to report.
            if self.ledger.stream {
                fe.router
                    .metrics()
                    .frontend
                    .ttft
                    .with_label_values(&[fe.model.as_str()])
                    .observe(self.ledger.arrived.elapsed().as_secs_f64());
            }
        }
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        if self.outcome == Some("success") {
            if let Some(l) = &self.learning {
                l.teach(&self.ledger.fe, self.worker);
            }
        }
        // The load is released by `routed`, the metrics ended by `ledger`, both dropped next.
        if self.outcome.is_none() {
            tracing::debug!(request_id = %self.routed.request_id, worker = ?self.worker, "client went away; the worker's request is dropped");
        }
        self.ledger.outcome = Some(self.outcome.unwrap_or("cancelled"));
    }
}

struct RelayState {
    upstream: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    answering: Answering,
    idle: Duration,
    framer: Framer,
    done: bool,
}

/// Passes a worker's answer on: a stream in whole SSE events only, so that an error event the
/// router adds after them always parses. Each byte is copied and scanned once: only the bytes
/// that arrived since the last look (and the 3 before them, where a delimiter may begin) are
/// searched for an event's end. An event held back past `max_event` bytes
/// (`--max-sse-event-bytes`) is dropped and the stream marked `overflow`.
#[derive(Debug, Default)]
struct Framer {
    sse: bool,
    /// A stream's bytes after its last complete event (`\n\n`), held back.
    partial: Vec<u8>,
    /// The most bytes `partial` may hold.
    max_event: usize,
    /// An event passed `max_event`: the stream must end with an error.
    overflow: bool,
}

/// Where the last complete SSE event of `bytes` ends (after its blank line), if any, looking only
/// at delimiters that end after `from`.
fn last_event_end(bytes: &[u8], from: usize) -> Option<usize> {
    let tail = &bytes[from.saturating_sub(3).min(bytes.len())..];
    let base = bytes.len() - tail.len();
    let lf = tail.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = tail
        .windows(4)
        .rposition(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    lf.max(crlf).map(|end| base + end)
}

impl Framer {
    fn new(sse: bool, max_event: usize) -> Self {
        Self {
            sse,
            partial: Vec::new(),
            max_event,
            overflow: false,
        }
    }

    /// What of `chunk` can go to the client now: all of it for a whole answer; up to the last
    /// complete event for a stream.
    fn pass(&mut self, chunk: Bytes) -> Bytes {
        if !self.sse || self.overflow {
            return if self.overflow { Bytes::new() } else { chunk };
        }
        let out = if self.partial.is_empty() {
            match last_event_end(&chunk, 0) {
                Some(end) if end == chunk.len() => return chunk,
                Some(end) => {
                    self.partial.extend_from_slice(&chunk[end..]);
                    chunk.slice(..end)
                }
                None => {
                    self.partial.extend_from_slice(&chunk);
                    Bytes::new()
                }
            }
        } else {
            let seen = self.partial.len();
            self.partial.extend_from_slice(&chunk);
            match last_event_end(&self.partial, seen) {
                Some(end) => {
                    let rest = self.partial[end..].to_vec();
                    self.partial.truncate(end);
                    Bytes::from(std::mem::replace(&mut self.partial, rest))
                }
                None => Bytes::new(),
            }
        };
        if self.partial.len() > self.max_event {
            self.partial = Vec::new();
            self.overflow = true;
        }
        out
    }
}

/// The client's response: the worker's status and body, passed on as the worker sends it.
fn relay(
    fe: Fe,
    ledger: Ledger,
    routed: Routed,
    worker: WorkerKey,
    upstream: Upstream,
    learning: Option<Learning>,
) -> Response {
    let status = upstream.status;
    let mut out = Response::builder().status(status.as_u16());
    for name in &FORWARDED_RESPONSE_HEADERS {
        for value in upstream.headers.get_all(name) {
            out = out.header(name, value);
        }
    }
    if let Ok(v) = HeaderValue::from_str(&format!("{}:{}", worker.0, worker.1)) {
        out = out.header(WORKER_HEADER, v);
    }
    let first = upstream.first;
    let mut state = RelayState {
        upstream: upstream.body,
        answering: Answering {
            ledger,
            routed,
            worker,
            first_seen: false,
            outcome: None,
            learning,
        },
        idle: fe.config.idle_timeout,
        framer: Framer::new(upstream.sse, fe.config.max_sse_event_bytes),
        done: false,
    };
    let first = first.map(|chunk| {
        state.answering.chunk(&chunk);
        state.framer.pass(chunk)
    });
    // A worker's own error answer (4xx, 500) is passed on as it wrote it, not retried.
    let worker_status_ok = status.is_success();
    let rest = futures_util::stream::unfold(state, move |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            if st.framer.overflow {
                return Some(event_too_large(st));
            }
            match tokio::time::timeout(st.idle, st.upstream.next()).await {
                Ok(Some(Ok(chunk))) => {
                    st.answering.chunk(&chunk);
                    let out = st.framer.pass(chunk);
                    if out.is_empty() {
                        continue;
                    }
                    return Some((Ok::<Bytes, io::Error>(out), st));
                }
                Ok(None) => {
                    st.answering.outcome = Some(if worker_status_ok {
                        "success"
                    } else {
                        "worker_status"
                    });
                    st.done = true;
                    let tail = std::mem::take(&mut st.framer.partial);
                    if tail.is_empty() {
                        // Ends the request (load, metrics) now, not when hyper drops the stream.
                        drop(st);
                        return None;
                    }
                    return Some((Ok(Bytes::from(tail)), st));
                }
                Ok(Some(Err(e))) => return Some(mid_answer_failure(st, attempt_error(&e))),
                Err(_) => {
                    let why = format!(
                        "the worker sent nothing for {:?} (--worker-idle-timeout-secs)",
                        st.idle
                    );
                    return Some(mid_answer_failure(st, why));
                }
            }
        }
    });
    let body = futures_util::stream::iter(first.filter(|b| !b.is_empty()).map(Ok)).chain(rest);
    out.body(Body::from_stream(body)).unwrap_or_else(|e| {
        OpenAiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
    })
}

/// A worker's event passed `--max-sse-event-bytes`: the stream ends with an error event (the
/// worker is not marked: it answered, but not in a shape the router relays).
fn event_too_large(mut st: RelayState) -> (Result<Bytes, io::Error>, RelayState) {
    let fe = st.answering.ledger.fe.clone();
    fe.router.metrics().frontend.sse_events_too_large.inc();
    let limit = fe.config.max_sse_event_bytes;
    tracing::warn!(worker = ?st.answering.worker, limit, "a worker's server-sent event passed --max-sse-event-bytes; the stream is ended");
    st.answering.outcome = Some("sse_event_too_large");
    st.done = true;
    let message = format!(
        "the worker sent an event longer than {limit} bytes (--max-sse-event-bytes); the stream \
         is ended"
    );
    let event = OpenAiError::body(StatusCode::BAD_GATEWAY, &message);
    (
        Ok(Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n"))),
        st,
    )
}

/// The worker failed after the answer's first byte: the worker is marked, and a streamed answer
/// ends with an SSE error event after its last whole event (a whole answer is cut short: its
/// JSON cannot be mended).
fn mid_answer_failure(mut st: RelayState, why: String) -> (Result<Bytes, io::Error>, RelayState) {
    let fe = st.answering.ledger.fe.clone();
    let worker = st.answering.worker;
    tracing::warn!(worker = ?worker, error = %why, "worker failed in the middle of an answer");
    fe.router.cool_down(worker, fe.config.failure_cooldown);
    st.answering.outcome = Some("worker_error");
    st.done = true;
    st.framer.partial.clear();
    if st.framer.sse {
        let message = format!("the worker failed in the middle of the answer: {why}");
        let event = OpenAiError::body(StatusCode::BAD_GATEWAY, &message);
        let text = format!("data: {event}\n\ndata: [DONE]\n\n");
        (Ok(Bytes::from(text)), st)
    } else {
        (Err(io::Error::other(why)), st)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn completion_prompts_are_read_as_vllm_reads_them() {
        let text = |v: Value| match completion_prompt(&obj(v)).unwrap() {
            Prompt::Text(t) => t.to_owned(),
            Prompt::Ids(i) => panic!("ids {i:?}"),
        };
        let idsof = |v: Value| match completion_prompt(&obj(v)).unwrap() {
            Prompt::Ids(i) => i,
            Prompt::Text(t) => panic!("text {t:?}"),
        };
        assert_eq!(text(json!({"prompt": "hello"})), "hello");
        assert_eq!(text(json!({"prompt": ["first", "second"]})), "first");
        assert_eq!(idsof(json!({"prompt": [1, 2, 3]})), vec![1, 2, 3]);
        assert_eq!(idsof(json!({"prompt": [[4, 5], [6]]})), vec![4, 5]);
        for bad in [
            json!({}),
            json!({"prompt": []}),
            json!({"prompt": 3}),
            json!({"prompt": [1, -2]}),
            json!({"prompt": [1, 4294967296u64]}),
            json!({"prompt": [[1, "x"]]}),
            json!({"prompt": [null]}),
        ] {
            assert!(completion_prompt(&obj(bad.clone())).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_stream_reaches_the_client_in_whole_events() {
        assert_eq!(last_event_end(b"data: a\n\ndata: b", 0), Some(9));
        assert_eq!(last_event_end(b"data: a\r\n\r\n", 0), Some(11));
        assert_eq!(last_event_end(b"data: a\n", 0), None);
        // Only delimiters ending after `from` count (one may start up to 3 bytes before it).
        assert_eq!(last_event_end(b"a\n\nbbbbbb", 6), None);
        assert_eq!(last_event_end(b"aaaa\n\n", 5), Some(6));
        let mut st = Framer::new(true, 1 << 20);
        let mut out = Vec::new();
        // Events cut anywhere by the network come out whole, in order, nothing lost or doubled.
        for piece in [
            &b"data: {\"a\": 1}\n\nda"[..],
            b"ta: {\"b\"",
            b": 2}\n",
            b"\n",
            b"data: [DONE]\n\n",
        ] {
            let passed = st.pass(Bytes::copy_from_slice(piece));
            assert!(passed.is_empty() || passed.ends_with(b"\n\n"), "{passed:?}");
            out.extend_from_slice(&passed);
        }
        assert_eq!(
            out,
            b"data: {\"a\": 1}\n\ndata: {\"b\": 2}\n\ndata: [DONE]\n\n"
        );
        assert!(st.partial.is_empty());
        // A delimiter split across chunks is found.
        for piece in [&b"data: x\r\n"[..], b"\r", b"\n"] {
            out.extend_from_slice(&st.pass(Bytes::copy_from_slice(piece)));
        }
        assert!(out.ends_with(b"data: x\r\n\r\n"));
        assert!(st.partial.is_empty());
        // A whole answer passes untouched.
        st.sse = false;
        assert_eq!(&st.pass(Bytes::from_static(b"{\"x\"")), &b"{\"x\""[..]);
    }

    #[test]
    fn an_endless_event_is_cut_at_the_cap_in_linear_time() {
        let mut st = Framer::new(true, 4 << 20);
        assert_eq!(
            &st.pass(Bytes::from_static(b"data: 1\n\ndata: ")),
            &b"data: 1\n\n"[..]
        );
        // 64 MiB without a blank line, in 16 KiB chunks: nothing passes, at most the cap is held,
        // and the stream is marked once the cap is passed. Scanning only new bytes keeps this
        // linear (the whole buffer rescanned per chunk would be about 500 GB of scanning).
        let chunk = Bytes::from(vec![b'x'; 16 << 10]);
        let mut held_max = 0;
        for _ in 0..4096 {
            assert!(st.pass(chunk.clone()).is_empty());
            held_max = held_max.max(st.partial.capacity());
        }
        assert!(st.overflow);
        assert!(held_max <= 8 << 20, "{held_max}");
        assert!(st.partial.is_empty());
    }

    #[test]
    fn errors_have_vllms_shape() {
        let body = OpenAiError::body(StatusCode::NOT_FOUND, "The model `x` does not exist.");
        assert_eq!(
            body,
            json!({"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                             "param": null, "code": 404}})
        );
        assert_eq!(
            OpenAiError::body(StatusCode::SERVICE_UNAVAILABLE, "m")["error"]["type"],
            "ServiceUnavailableError"
        );
    }
}
