//! One worker's HTTP server: vLLM 0.33's OpenAI API as far as a router sees it.
//!
//! Shapes follow vLLM 0.33's `vllm/entrypoints/openai/completion/protocol.py`
//! (`CompletionResponse`, `CompletionStreamResponse`), `chat_completion/protocol.py`
//! (`ChatCompletionResponse`, `ChatCompletionStreamResponse`) and
//! `vllm/entrypoints/serve/engine/protocol.py` (`UsageInfo`, `ErrorResponse`): SSE events
//! `data: {json}\n\n`, a final `data: [DONE]\n\n`, a usage chunk with empty `choices` when
//! `stream_options.include_usage`, errors as `{"error": {"message", "type", "param", "code"}}`.
//!
//! Streams are coalesced: a chunk carries every token produced since the previous one, and at
//! most one chunk is written per `stream_interval` of wall time; each chunk's text holds one
//! word (`" tok"`) per token, so token counts are exact. A client that goes away drops the
//! request's receiver; the engine sees it and aborts the request (its blocks are released).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvbm_router::tokenize::{ChatRequest, ModelTokenizer};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{Output, Request, Usage};
use crate::metrics::WorkerMetrics;

/// The text of one generated token.
pub const TOKEN_TEXT: &str = " tok";

/// Largest request body accepted.
pub const BODY_BYTES_MAX: usize = 32 << 20;

/// What a worker's HTTP handlers share.
#[derive(Debug)]
pub struct WorkerHttp {
    /// Worker id (1-based).
    pub id: u64,
    /// Served model id.
    pub model: String,
    /// The model directory as given.
    pub root: String,
    /// The tokenizer.
    pub tokenizer: Arc<ModelTokenizer>,
    /// The engine's intake.
    pub requests: crossbeam_channel::Sender<Request>,
    /// The worker's metrics.
    pub metrics: Arc<WorkerMetrics>,
    /// GET /v1/kvbm/mocker's body.
    pub info: Value,
    /// The id of the token every decode produces.
    pub output_token: u32,
    /// max_tokens when a request sets none.
    pub default_max_tokens: u32,
    /// At most one chunk per this much wall time per stream.
    pub stream_interval: Duration,
    /// Context length (tokens) for /v1/models.
    pub max_model_len: usize,
    next_id: AtomicU64,
}

impl WorkerHttp {
    /// Handler state for a worker.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: u64,
        model: String,
        root: String,
        tokenizer: Arc<ModelTokenizer>,
        requests: crossbeam_channel::Sender<Request>,
        metrics: Arc<WorkerMetrics>,
        info: Value,
        default_max_tokens: u32,
        stream_interval: Duration,
        max_model_len: usize,
    ) -> Self {
        let output_token = match tokenizer.encode_prompt(TOKEN_TEXT, false) {
            Ok(ids) if ids.len() == 1 => ids[0],
            _ => 0,
        };
        Self {
            id,
            model,
            root,
            tokenizer,
            requests,
            metrics,
            info,
            output_token,
            default_max_tokens,
            stream_interval,
            max_model_len,
            next_id: AtomicU64::new(0),
        }
    }
}

/// The worker's routes.
pub fn routes(state: Arc<WorkerHttp>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/kvbm/mocker", get(info))
        .layer(DefaultBodyLimit::max(BODY_BYTES_MAX))
        .with_state(state)
}

/// vLLM's error body.
pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::NOT_FOUND => "NotFoundError",
        _ => "InternalServerError",
    };
    let body = json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

/// A refused request: its status and vLLM's message.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error(self.status, self.message)
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        message: message.into(),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn models(State(w): State<Arc<WorkerHttp>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": w.model, "object": "model", "created": unix_now(), "owned_by": "vllm",
            "root": w.root, "parent": null, "max_model_len": w.max_model_len,
            "permission": [{"id": format!("modelperm-{}", w.id), "object": "model_permission",
                "created": unix_now(), "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false}]
        }]
    }))
    .into_response()
}

async fn metrics(State(w): State<Arc<WorkerHttp>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        w.metrics.render(),
    )
        .into_response()
}

async fn info(State(w): State<Arc<WorkerHttp>>) -> Response {
    let mut v = w.info.clone();
    v["sim_seconds"] = json!(w.metrics.sim_seconds.get());
    v["lag_max_seconds"] = json!(w.metrics.lag_max_seconds.get());
    v["steps"] = json!(w.metrics.steps.get());
    axum::Json(v).into_response()
}

/// A request as read from its body.
struct Parsed {
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
}

fn parse(w: &WorkerHttp, body: &[u8], chat: bool) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("the request body is not valid JSON: {e}")))?;
    let Some(obj) = value.as_object() else {
        return Err(bad("the request body must be a JSON object"));
    };
    match obj.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if *m == w.model => {}
        Some(Value::String(m)) => {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("The model `{m}` does not exist."),
            })
        }
        Some(_) => return Err(bad("'model' must be a string")),
    }
    let flag = |name: &str| -> Result<Option<bool>, ApiError> {
        match obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(bad(format!("'{name}' must be a boolean"))),
        }
    };
    let int = |name: &str| -> Result<Option<u64>, ApiError> {
        match obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| bad(format!("'{name}' must be a non-negative integer"))),
        }
    };
    let stream = flag("stream")?.unwrap_or(false);
    flag("ignore_eos")?;
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(bad(
                    "Stream options can only be defined when `stream=True`.",
                ));
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(bad("'stream_options.include_usage' must be a boolean")),
            }
        }
        Some(_) => return Err(bad("'stream_options' must be an object")),
    };
    if let Some(n) = int("n")? {
        if n != 1 {
            return Err(bad("the mocker serves n=1 only"));
        }
    }
    let mut max_tokens = int("max_tokens")?;
    if chat {
        if let Some(m) = int("max_completion_tokens")? {
            max_tokens = Some(m);
        }
    }
    let max_tokens = match max_tokens {
        None => w.default_max_tokens,
        Some(0) => return Err(bad("max_tokens must be at least 1, got 0.")),
        Some(m) => u32::try_from(m).map_err(|_| bad(format!("max_tokens {m} is too large")))?,
    };
    if let Some(min) = int("min_tokens")? {
        if min > u64::from(max_tokens) {
            return Err(bad(format!(
                "min_tokens must be less than or equal to max_tokens={max_tokens}, got {min}."
            )));
        }
    }
    let prompt = if chat {
        let request = ChatRequest::from_body(&value).map_err(|e| bad(e.to_string()))?;
        w.tokenizer
            .encode_chat(&request)
            .map_err(|e| bad(e.to_string()))?
    } else {
        let add = flag("add_special_tokens")?.unwrap_or(true);
        completion_prompt(w, obj.get("prompt"), add)?
    };
    if prompt.is_empty() {
        return Err(bad("the prompt is empty"));
    }
    Ok(Parsed {
        prompt,
        max_tokens,
        stream,
        include_usage,
    })
}

fn ids_of(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect()
}

fn completion_prompt(
    w: &WorkerHttp,
    prompt: Option<&Value>,
    add: bool,
) -> Result<Vec<u32>, ApiError> {
    let encode = |s: &str| {
        w.tokenizer
            .encode_prompt(s, add)
            .map_err(|e| bad(e.to_string()))
    };
    match prompt {
        Some(Value::String(s)) => encode(s),
        Some(Value::Array(items)) if items.is_empty() => Err(bad("'prompt' is empty")),
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            ids_of(items).ok_or_else(|| bad("'prompt' token ids must be integers in 0..2^32"))
        }
        Some(Value::Array(items)) if items.len() == 1 => match &items[0] {
            Value::String(s) => encode(s),
            Value::Array(ids) if !ids.is_empty() => {
                ids_of(ids).ok_or_else(|| bad("'prompt' token ids must be integers in 0..2^32"))
            }
            _ => Err(bad(
                "'prompt' must be a string, a list of token ids, or a list of one of those",
            )),
        },
        Some(Value::Array(_)) => Err(bad("the mocker serves one prompt per request")),
        None => Err(bad("'prompt' is required")),
        Some(_) => Err(bad("'prompt' must be a string or a list of token ids")),
    }
}

async fn completions(State(w): State<Arc<WorkerHttp>>, body: Bytes) -> Response {
    serve(w, &body, false).await
}

async fn chat_completions(State(w): State<Arc<WorkerHttp>>, body: Bytes) -> Response {
    serve(w, &body, true).await
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "completion_tokens": u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn text_of(n: u32) -> String {
    TOKEN_TEXT.repeat(n as usize)
}

async fn serve(w: Arc<WorkerHttp>, body: &[u8], chat: bool) -> Response {
    let p = match parse(&w, body, chat) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // bounded: one request's outputs, at most one per engine step it decodes in (max_tokens)
    // plus its end; the engine thread must never block on a slow client.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel(); // bounded: at most max_tokens + 1 messages
    let req = Request {
        prompt: p.prompt,
        max_tokens: p.max_tokens,
        output_token: w.output_token,
        stream: p.stream,
        out: tx,
    };
    if w.requests.send(req).is_err() {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "the engine has stopped");
    }
    let n = w.next_id.fetch_add(1, Ordering::Relaxed);
    let id = if chat {
        format!("chatcmpl-{:x}{n:012x}", w.id)
    } else {
        format!("cmpl-{:x}{n:012x}", w.id)
    };
    let meta = Meta {
        id,
        created: unix_now(),
        model: w.model.clone(),
        chat,
    };
    if p.stream {
        stream_response(w, rx, meta, p.include_usage).await
    } else {
        whole_response(rx, meta).await
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    chat: bool,
}

async fn whole_response(mut rx: UnboundedReceiver<Output>, meta: Meta) -> Response {
    loop {
        match rx.recv().await {
            Some(Output::Tokens(_)) => {}
            Some(Output::Rejected(msg)) => return bad(msg).into_response(),
            Some(Output::Finished(u)) => {
                let text = text_of(u.completion_tokens);
                let body = if meta.chat {
                    json!({
                        "id": meta.id, "object": "chat.completion", "created": meta.created,
                        "model": meta.model,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                            "refusal": null, "annotations": null, "audio": null, "function_call": null,
                            "tool_calls": [], "reasoning": null},
                            "logprobs": null, "finish_reason": "length", "stop_reason": null}],
                        "service_tier": null, "system_fingerprint": null, "usage": usage_json(&u),
                        "prompt_logprobs": null, "prompt_token_ids": null, "kv_transfer_params": null,
                    })
                } else {
                    json!({
                        "id": meta.id, "object": "text_completion", "created": meta.created,
                        "model": meta.model,
                        "choices": [{"index": 0, "text": text, "logprobs": null,
                            "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null}],
                        "service_tier": null, "system_fingerprint": null, "usage": usage_json(&u),
                        "kv_transfer_params": null,
                    })
                };
                return axum::Json(body).into_response();
            }
            None => return error(StatusCode::INTERNAL_SERVER_ERROR, "the engine has stopped"),
        }
    }
}

struct StreamState {
    rx: UnboundedReceiver<Output>,
    /// An output read before the stream began.
    first: Option<Output>,
    meta: Meta,
    interval: Duration,
    include_usage: bool,
    last_write: Option<Instant>,
    sent_role: bool,
    done: bool,
}

fn sse(out: &mut Vec<u8>, v: &Value) {
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut *out, v).expect("JSON into memory");
    out.extend_from_slice(b"\n\n");
}

impl StreamState {
    fn chunk(&self, out: &mut Vec<u8>, n: u32, finish: Option<&str>) {
        let choice = if self.meta.chat {
            json!({"index": 0, "delta": {"content": text_of(n)}, "logprobs": null,
                "finish_reason": finish, "stop_reason": null})
        } else {
            json!({"index": 0, "text": text_of(n), "logprobs": null,
                "finish_reason": finish, "stop_reason": null})
        };
        sse(out, &self.envelope(json!([choice])));
    }

    fn envelope(&self, choices: Value) -> Value {
        let object = if self.meta.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({"id": self.meta.id, "object": object, "created": self.meta.created,
            "model": self.meta.model, "choices": choices})
    }

    /// The next write: every output since the last one, no sooner than the interval allows.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut n = 0u32;
        let mut end: Option<Output> = None;
        let absorb = |o: Output, n: &mut u32, end: &mut Option<Output>| match o {
            Output::Tokens(k) => *n += k,
            other => *end = Some(other),
        };
        let got = match self.first.take() {
            Some(o) => Some(o),
            None => self.rx.recv().await,
        };
        match got {
            Some(o) => absorb(o, &mut n, &mut end),
            None => end = Some(Output::Rejected("the engine has stopped".into())),
        }
        if end.is_none() {
            if let Some(last) = self.last_write {
                // Wait out the interval without listening: the engine's sends stay cheap (no
                // task to wake) and whatever came meanwhile is taken below.
                tokio::time::sleep_until((last + self.interval).into()).await;
            }
        }
        while end.is_none() {
            match self.rx.try_recv() {
                Ok(o) => absorb(o, &mut n, &mut end),
                Err(_) => break,
            }
        }
        let mut out = Vec::new();
        if self.meta.chat && !self.sent_role {
            self.sent_role = true;
            let choice = json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null});
            sse(&mut out, &self.envelope(json!([choice])));
        }
        match end {
            None => self.chunk(&mut out, n, None),
            Some(Output::Finished(u)) => {
                self.chunk(&mut out, n, Some("length"));
                if self.include_usage {
                    let mut v = self.envelope(json!([]));
                    v["usage"] = usage_json(&u);
                    sse(&mut out, &v);
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            Some(Output::Rejected(msg)) => {
                if n > 0 {
                    self.chunk(&mut out, n, None);
                }
                sse(
                    &mut out,
                    &json!({"error": {"message": msg, "type": "BadRequestError", "param": null, "code": 400}}),
                );
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            Some(Output::Tokens(_)) => unreachable!("absorbed"),
        }
        self.last_write = Some(Instant::now());
        Some(Bytes::from(out))
    }
}

async fn stream_response(
    w: Arc<WorkerHttp>,
    mut rx: UnboundedReceiver<Output>,
    meta: Meta,
    include_usage: bool,
) -> Response {
    // A request the engine refuses outright gets a plain 400, as vLLM's validation gives.
    let first = match rx.recv().await {
        Some(Output::Rejected(msg)) => return bad(msg).into_response(),
        None => return error(StatusCode::INTERNAL_SERVER_ERROR, "the engine has stopped"),
        Some(o) => o,
    };
    let state = StreamState {
        rx,
        first: Some(first),
        meta,
        interval: w.stream_interval,
        include_usage,
        last_write: None,
        sent_role: false,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        st.next()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), st))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("valid response")
}
