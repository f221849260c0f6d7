//! The OpenAI front end's bounds (issue 23): a small request is served while the large lane is
//! full (`--large-prompt-bytes`), large requests beyond `--max-inflight-prompt-bytes` are refused
//! at once with 503, and a worker's endless server-sent event ends the client's stream with an
//! error event (`--max-sse-event-bytes`) instead of being buffered. Each test runs the real
//! router and front end on 127.0.0.1 against a scripted worker (an axum server in the test);
//! waiting is bounded polling on the router's own metrics, never a fixed sleep.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use futures_util::stream;
use kvbm_events::WorkerEndpoint;
use kvbm_router::config::{FrontendConfig, WorkerSpec};
use kvbm_router::frontend::{Frontend, Lane};
use kvbm_router::tokenize::ModelTokenizer;
use kvbm_router::{Router, RouterConfig};
use serde_json::{json, Value};

const POLL_DEADLINE: Duration = Duration::from_secs(20);

/// A scripted worker: `/v1/completions` answers a small completion, or, for `"stream": true`, one
/// event and then 64 MiB of an event that never ends.
async fn scripted_worker() -> String {
    common::scripted_worker(|_| {
        let first = Bytes::from_static(b"data: {\"choices\": [{\"text\": \"a\"}]}\n\ndata: ");
        Body::from_stream(stream::iter(
            std::iter::once(first)
                .chain(std::iter::repeat_n(Bytes::from(vec![b'x'; 64 << 10]), 1024))
                .map(Ok::<Bytes, std::io::Error>),
        ))
    })
    .await
}

struct Setup {
    base: String,
    frontend: Arc<Frontend>,
    router: Arc<Router>,
    client: reqwest::Client,
}

async fn start(configure: impl FnOnce(&mut RouterConfig)) -> Setup {
    let worker = scripted_worker().await;
    let model_dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/chatml");
    let mut config = RouterConfig {
        frontend: FrontendConfig {
            model_path: Some(model_dir.clone()),
            model_name: Some("m".into()),
            ..FrontendConfig::default()
        },
        ..RouterConfig::default()
    };
    configure(&mut config);
    let spec = WorkerSpec {
        events: WorkerEndpoint {
            worker_id: 1,
            dp_rank: 0,
            // Nothing publishes there: routing falls back to load alone.
            endpoint: "tcp://127.0.0.1:9".into(),
            replay: None,
        },
        http: Some(worker),
    };
    let router = Arc::new(Router::start(config.clone(), vec![spec]).unwrap());
    let tokenizer = Arc::new(ModelTokenizer::from_dir(&model_dir).unwrap());
    let frontend =
        Arc::new(Frontend::new(router.clone(), tokenizer, config.frontend.clone()).unwrap());
    let listener = kvbm_router::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (r, f) = (router.clone(), frontend.clone());
    tokio::spawn(
        async move { kvbm_router::serve(r, Some(f), listener, std::future::pending()).await },
    );
    Setup {
        base,
        frontend,
        router,
        client: reqwest::Client::builder().no_proxy().build().unwrap(),
    }
}

/// One sample of the router's /metrics text (0 when absent).
fn metric(router: &Router, name: &str) -> f64 {
    router
        .metrics()
        .render()
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

async fn wait_for_metric(router: &Router, name: &str, value: f64) {
    let deadline = tokio::time::Instant::now() + POLL_DEADLINE;
    while metric(router, name) != value {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} never reached {value}: {}",
            metric(router, name)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn prompt_of(bytes: usize) -> String {
    "hello world ".repeat(bytes / 12)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_request_is_served_while_the_large_lane_is_full() {
    let s = start(|c| c.frontend.large_prompt_bytes = 4096).await;
    // Every large-lane permit taken: large prompts wait, as behind 8 long tokenizations.
    let held = s.frontend.hold_lane(Lane::Large).await;
    let large = {
        let (client, url) = (s.client.clone(), format!("{}/v1/completions", s.base));
        tokio::spawn(async move {
            client
                .post(url)
                .header("content-type", "application/json")
                .body(
                    json!({"model": "m", "prompt": prompt_of(64 << 10), "max_tokens": 1})
                        .to_string(),
                )
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    wait_for_metric(
        &s.router,
        "kv_router_frontend_tokenize_waiting{lane=\"large\"}",
        1.0,
    )
    .await;
    let small = tokio::time::timeout(
        POLL_DEADLINE,
        s.client
            .post(format!("{}/v1/completions", s.base))
            .header("content-type", "application/json")
            .body(json!({"model": "m", "prompt": "hi", "max_tokens": 2}).to_string())
            .send(),
    )
    .await
    .expect("the small request waited behind the large lane")
    .unwrap();
    assert_eq!(small.status(), 200);
    let answer: Value = serde_json::from_slice(&small.bytes().await.unwrap()).unwrap();
    assert_eq!(answer["choices"][0]["text"], "ok");
    assert!(
        !large.is_finished(),
        "the large request did not wait for its lane"
    );
    drop(held);
    assert_eq!(large.await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_beyond_the_budget_are_refused_with_503() {
    let s = start(|c| {
        c.max_body_bytes = 1 << 20;
        c.frontend.max_inflight_prompt_bytes = 1 << 20;
        c.frontend.large_prompt_bytes = 4096;
    })
    .await;
    let held = s.frontend.hold_lane(Lane::Large).await;
    let body = json!({"model": "m", "prompt": prompt_of(600 << 10)}).to_string();
    let first = {
        let (client, url, body) = (
            s.client.clone(),
            format!("{}/tokenize", s.base),
            body.clone(),
        );
        tokio::spawn(async move {
            let r = client
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (
                r.status(),
                serde_json::from_slice::<Value>(&r.bytes().await.unwrap()).unwrap(),
            )
        })
    };
    wait_for_metric(
        &s.router,
        "kv_router_frontend_tokenize_waiting{lane=\"large\"}",
        1.0,
    )
    .await;
    assert_eq!(
        metric(&s.router, "kv_router_frontend_inflight_prompt_bytes"),
        body.len() as f64
    );
    let refused = s
        .client
        .post(format!("{}/v1/completions", s.base))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    let e: Value = serde_json::from_slice(&refused.bytes().await.unwrap()).unwrap();
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("--max-inflight-prompt-bytes=1048576"),
        "{message}"
    );
    assert_eq!(
        metric(&s.router, "kv_router_frontend_prompt_budget_refusals_total"),
        1.0
    );
    // A small request still passes.
    let small = s
        .client
        .post(format!("{}/tokenize", s.base))
        .header("content-type", "application/json")
        .body(json!({"model": "m", "prompt": "hi"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(small.status(), 200);
    drop(held);
    let (status, answer) = first.await.unwrap();
    assert_eq!(status, 200);
    assert!(answer["count"].as_u64().unwrap() > 1000);
    assert_eq!(
        metric(&s.router, "kv_router_frontend_inflight_prompt_bytes"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_event_ends_the_stream_with_an_error_event() {
    let s = start(|c| c.frontend.max_sse_event_bytes = 4 << 20).await;
    let response = s
        .client
        .post(format!("{}/v1/completions", s.base))
        .header("content-type", "application/json")
        .body(json!({"model": "m", "prompt": "hi", "stream": true}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body = tokio::time::timeout(POLL_DEADLINE, response.bytes())
        .await
        .expect("the stream never ended")
        .unwrap();
    let text = String::from_utf8_lossy(&body);
    // The first event, then the error event: nothing of the endless one, nothing buffered past
    // the cap.
    assert!(text.starts_with("data: {\"choices\""), "{text}");
    assert!(text.contains("--max-sse-event-bytes"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(body.len() < 4096, "{} bytes", body.len());
    assert_eq!(
        metric(&s.router, "kv_router_frontend_sse_events_too_large_total"),
        1.0
    );
    wait_for_metric(
        &s.router,
        "kv_router_frontend_outcomes_total{outcome=\"sse_event_too_large\"}",
        1.0,
    )
    .await;
}
