//! The HTTP API (JSON), served on 127.0.0.1 unless told otherwise.
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `POST /query` | `{"token_ids": [..], "lora_name"?, "cache_salt"?}` | every worker's per-tier overlap |
//! | `POST /route` | the same, plus `"request_id"?` | the chosen worker, its overlap and cost, the runner-ups' costs; the request counts toward that worker's load |
//! | `POST /first_token` | `{"request_id"}` | the request's load moves from prefill to decode |
//! | `POST /finished` | `{"request_id"}` | the request no longer counts |
//! | `POST /register` | `{"worker_id", "dp_rank"?, "endpoint", "replay_endpoint"?, "http_url"?}` | follows the worker (and sends it OpenAI requests if `http_url` is given) |
//! | `POST /unregister` | `{"worker_id", "dp_rank"?}` | forgets it |
//! | `GET /workers` | | registered workers: endpoints, blocks per tier, load, stream health |
//! | `GET /metrics` | | Prometheus text |
//! | `GET /debug/cost` | | the routing mode, the weights in force, and the tuned cost's learned coefficients per worker and fleet-wide, observation counts, recent residuals and Dynamo-equivalent weights (open as `/workers` and `/dump` are) |
//! | `GET /healthz` | | `{"status": "ok", "workers": N}` |
//!
//! Every error is a 4xx or 5xx with `{"error": "..."}`; bodies over `--max-body-bytes` get 413.
//! With `--admin-token` (or `KVBM_ROUTER_ADMIN_TOKEN`), `/register` and `/unregister` answer 401
//! without `Authorization: Bearer TOKEN`.
//! The OpenAI front end's routes (`/v1/...`, `/tokenize`) are [`crate::frontend`]'s, with
//! OpenAI-shaped errors.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::{parse_worker, WorkerSpec};
use crate::state::{RegisterError, RequestTokens, RouteError, Router};

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let status = rejection.status();
        // Body-shape errors are the client's: 400 rather than axum's 422.
        let status = if status == StatusCode::UNPROCESSABLE_ENTITY {
            StatusCode::BAD_REQUEST
        } else {
            status
        };
        Self::new(status, rejection.body_text())
    }
}

type ApiResult<T> = Result<Json<T>, ApiError>;

/// The body of `/query` and `/route`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokensBody {
    /// Prompt token ids.
    pub token_ids: Vec<u32>,
    /// LoRA adapter name.
    #[serde(default)]
    pub lora_name: Option<String>,
    /// Cache salt.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// The caller's request id (route only).
    #[serde(default)]
    pub request_id: Option<String>,
}

impl TokensBody {
    fn tokens(&self) -> RequestTokens<'_> {
        RequestTokens {
            token_ids: &self.token_ids,
            untokenized_tokens: 0,
            lora_name: self.lora_name.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
        }
    }
}

/// The body of `/first_token` and `/finished`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestIdBody {
    /// The id `/route` answered with.
    pub request_id: String,
}

/// The body of `/register`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterBody {
    /// Worker id.
    pub worker_id: u64,
    /// Data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
    /// Its KV events PUB endpoint.
    pub endpoint: String,
    /// Its replay endpoint.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Its OpenAI-compatible HTTP server (`http://HOST:PORT`).
    #[serde(default)]
    pub http_url: Option<String>,
}

/// The body of `/unregister`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnregisterBody {
    /// Worker id.
    pub worker_id: u64,
    /// Data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
}

#[derive(Debug, Serialize)]
struct WorkerView {
    #[serde(flatten)]
    info: crate::state::WorkerInfo,
    blocks: TierBlocks,
    load: LoadView,
    link: Option<LinkView>,
}

/// A worker's connection as `/workers` shows it.
#[derive(Debug, Serialize)]
struct LinkView {
    /// "connecting", "connected" or "retrying" (its endpoint does not answer: not routed to).
    state: &'static str,
    /// Seconds since the state last changed.
    since_secs: f64,
    /// Seconds since the last message, if any came.
    last_message_secs: Option<f64>,
    connects: u64,
    disconnects: u64,
    connect_retries: u64,
    next_seq: u64,
}

fn link_view(l: &kvbm_events::LinkStatus) -> LinkView {
    let age = |t: std::time::SystemTime| t.elapsed().map_or(0.0, |d| d.as_secs_f64());
    LinkView {
        state: match l.state {
            kvbm_events::LinkState::Connecting => "connecting",
            kvbm_events::LinkState::Connected => "connected",
            kvbm_events::LinkState::Retrying => "retrying",
        },
        since_secs: age(l.since),
        last_message_secs: l.last_message.map(age),
        connects: l.connects,
        disconnects: l.disconnects,
        connect_retries: l.connect_retries,
        next_seq: l.next_seq,
    }
}

#[derive(Debug, Serialize)]
struct TierBlocks {
    gpu: usize,
    host: usize,
    disk: usize,
}

#[derive(Debug, Serialize)]
struct LoadView {
    prefill_tokens: usize,
    decode_blocks: usize,
    requests: usize,
}

type Shared = Arc<Router>;

async fn query(
    State(router): State<Shared>,
    body: Result<Json<TokensBody>, JsonRejection>,
) -> ApiResult<crate::state::QueryAnswer> {
    let Json(body) = body?;
    if body.request_id.is_some() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "request_id is for /route; /query does not track requests",
        ));
    }
    Ok(Json(router.query(&body.tokens())))
}

async fn route(
    State(router): State<Shared>,
    body: Result<Json<TokensBody>, JsonRejection>,
) -> ApiResult<crate::state::RouteAnswer> {
    let Json(body) = body?;
    match router.route(&body.tokens(), body.request_id.clone()) {
        Ok(answer) => Ok(Json(answer)),
        Err(e @ (RouteError::NoWorkers | RouteError::NoneReachable | RouteError::NoneEligible)) => {
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                e.to_string(),
            ))
        }
        Err(e @ RouteError::RequestIdTooLong { .. }) => {
            Err(ApiError::new(StatusCode::BAD_REQUEST, e.to_string()))
        }
    }
}

fn known(known: bool, id: &str) -> ApiResult<serde_json::Value> {
    if known {
        Ok(Json(json!({ "request_id": id })))
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("request {id:?} is not tracked (never routed, finished, or expired)"),
        ))
    }
}

async fn first_token(
    State(router): State<Shared>,
    body: Result<Json<RequestIdBody>, JsonRejection>,
) -> ApiResult<serde_json::Value> {
    let Json(body) = body?;
    known(router.first_token(&body.request_id), &body.request_id)
}

async fn finished(
    State(router): State<Shared>,
    body: Result<Json<RequestIdBody>, JsonRejection>,
) -> ApiResult<serde_json::Value> {
    let Json(body) = body?;
    known(router.finished(&body.request_id), &body.request_id)
}

/// With `--admin-token`, the registration endpoints need `Authorization: Bearer TOKEN`.
fn check_admin(router: &Router, headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &router.config().admin_token else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Compared in time independent of where they differ.
    let same = given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if same {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "this endpoint needs the router's admin token (Authorization: Bearer ...)",
        ))
    }
}

async fn register(
    State(router): State<Shared>,
    headers: axum::http::HeaderMap,
    body: Result<Json<RegisterBody>, JsonRejection>,
) -> ApiResult<serde_json::Value> {
    check_admin(&router, &headers)?;
    let Json(body) = body?;
    // Validate through the same parser as --workers.
    let mut spec = format!("{}:{}={}", body.worker_id, body.dp_rank, body.endpoint);
    if let Some(replay) = &body.replay_endpoint {
        spec.push_str(",replay=");
        spec.push_str(replay);
    }
    if let Some(url) = &body.http_url {
        spec.push_str(",http=");
        spec.push_str(url);
    }
    let worker: WorkerSpec =
        parse_worker(&spec).map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()))?;
    // Connecting and reading the replay buffer block: off the async workers.
    let r = router.clone();
    tokio::task::spawn_blocking(move || r.register(worker))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| match e {
            RegisterError::TooManyWorkers { .. } => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            }
            RegisterError::Transport(_) => ApiError::new(StatusCode::BAD_REQUEST, e.to_string()),
        })?;
    Ok(Json(
        json!({ "worker_id": body.worker_id, "dp_rank": body.dp_rank }),
    ))
}

async fn unregister(
    State(router): State<Shared>,
    headers: axum::http::HeaderMap,
    body: Result<Json<UnregisterBody>, JsonRejection>,
) -> ApiResult<serde_json::Value> {
    check_admin(&router, &headers)?;
    let Json(body) = body?;
    if router.unregister((body.worker_id, body.dp_rank)) {
        Ok(Json(
            json!({ "worker_id": body.worker_id, "dp_rank": body.dp_rank }),
        ))
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "worker {}:{} is not registered",
                body.worker_id, body.dp_rank
            ),
        ))
    }
}

async fn workers(State(router): State<Shared>) -> Json<serde_json::Value> {
    let workers: Vec<WorkerView> = router
        .workers()
        .into_iter()
        .map(|(info, blocks, load, link)| WorkerView {
            info,
            blocks: TierBlocks {
                gpu: blocks[0],
                host: blocks[1],
                disk: blocks[2],
            },
            load: LoadView {
                prefill_tokens: load.prefill_tokens,
                decode_blocks: load.decode_blocks,
                requests: load.requests,
            },
            link: link.as_ref().map(link_view),
        })
        .collect();
    Json(json!({ "workers": workers }))
}

/// Chunks of a dump in flight to a client at most (the writer waits for the client beyond).
const DUMP_CHUNKS_QUEUED_MAX: usize = 8;
/// Bytes per chunk of a dump.
const DUMP_CHUNK_BYTES: usize = 256 << 10;

/// Sends what is written to it as body chunks.
struct ChunkWriter {
    buf: Vec<u8>,
    tx: tokio::sync::mpsc::Sender<Result<axum::body::Bytes, std::io::Error>>,
}

impl std::io::Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= DUMP_CHUNK_BYTES {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = axum::body::Bytes::from(std::mem::take(&mut self.buf));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client gone"))
    }
}

/// Whether a `/dump` request asks for the msgpack form: `?format=msgpack`, or an `Accept` header
/// naming `application/msgpack` (NDJSON otherwise; `?format=ndjson` forces it).
fn wants_msgpack(request: &Request) -> Result<bool, ApiError> {
    match request.uri().query().unwrap_or("") {
        "" => {}
        "format=msgpack" => return Ok(true),
        "format=ndjson" => return Ok(false),
        _ => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "the only query /dump takes is format=msgpack or format=ndjson",
            ))
        }
    }
    Ok(request
        .headers()
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|m| m.split(';').next().unwrap_or("").trim() == crate::dump::MSGPACK_MEDIA_TYPE))
}

/// `GET /dump`: the index as NDJSON or msgpack (see [`crate::dump`]), one dump at a time. The
/// snapshot is taken at once (the event pump waits only for that); it is then streamed at the
/// client's pace.
async fn dump(State(router): State<Shared>, request: Request) -> Result<Response, ApiError> {
    let msgpack = wants_msgpack(&request)?;
    let Some(permit) = router.try_dump() else {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "a dump is being sent; try again when it is done",
        ));
    };
    let (tx, rx) = tokio::sync::mpsc::channel(DUMP_CHUNKS_QUEUED_MAX);
    let r = router.clone();
    tokio::task::spawn_blocking(move || {
        let snapshot = r.dump();
        let mut w = ChunkWriter {
            buf: Vec::with_capacity(DUMP_CHUNK_BYTES),
            tx,
        };
        let written = if msgpack {
            crate::dump::write_msgpack(&snapshot, &mut w)
        } else {
            crate::dump::write(&snapshot, &mut w)
        };
        if let Err(err) = written.and_then(|()| {
            use std::io::Write;
            w.flush()
        }) {
            tracing::info!(error = %err, "dump not sent whole");
        }
        // The slot is free before the client sees the body end (when `w`'s sender drops), so a
        // client that asks again at once is served rather than refused; the snapshot is dropped
        // after both.
        drop(permit);
        drop(w);
    });
    let body = axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let media = if msgpack {
        crate::dump::MSGPACK_MEDIA_TYPE
    } else {
        crate::dump::NDJSON_MEDIA_TYPE
    };
    Ok(([(header::CONTENT_TYPE, media)], body).into_response())
}

async fn metrics(State(router): State<Shared>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        router.render_metrics(),
    )
        .into_response()
}

async fn debug_cost(State(router): State<Shared>) -> Json<serde_json::Value> {
    Json(router.cost_view())
}

async fn healthz(State(router): State<Shared>) -> Json<serde_json::Value> {
    Json(json!({ "status": "ok", "workers": router.workers().len() }))
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed here")
}

/// Counts every answer in `kv_router_requests_total{endpoint, code}`.
async fn count(State(router): State<Shared>, request: Request, next: Next) -> Response {
    let endpoint = match request.uri().path() {
        p @ ("/query"
        | "/route"
        | "/first_token"
        | "/finished"
        | "/register"
        | "/unregister"
        | "/workers"
        | "/metrics"
        | "/healthz"
        | "/dump"
        | "/debug/cost"
        | "/tokenize"
        | "/v1/models"
        | "/v1/completions"
        | "/v1/chat/completions") => p.trim_start_matches('/').to_owned(),
        _ => "other".to_owned(),
    };
    let response = next.run(request).await;
    router
        .metrics()
        .requests
        .with_label_values(&[endpoint.as_str(), response.status().as_str()])
        .inc();
    response
}

/// The API over `router`, with the OpenAI front end's routes.
pub fn app(router: Arc<Router>, frontend: Option<Arc<crate::frontend::Frontend>>) -> axum::Router {
    let limit = router.config().max_body_bytes;
    let api = axum::Router::new()
        .route("/query", post(query))
        .route("/route", post(route))
        .route("/first_token", post(first_token))
        .route("/finished", post(finished))
        .route("/register", post(register))
        .route("/unregister", post(unregister))
        .route("/workers", get(workers))
        .route("/dump", get(dump))
        .route("/metrics", get(metrics))
        .route("/debug/cost", get(debug_cost))
        .route("/healthz", get(healthz))
        .with_state(router.clone());
    api.merge(crate::frontend::routes(frontend))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(router, count))
}
