//! The routing mode and the tuned cost seen from outside (issue 25): the OpenAI front end feeds
//! the learner from streamed answers only (time to first token; time per output token when the
//! client asked for usage), never from whole answers or retried requests, and GET /debug/cost
//! and /metrics carry the mode, the observation counts and the learned numbers. The real router
//! and front end run on 127.0.0.1 against scripted workers (axum servers in the test); nothing
//! here asserts a duration.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use futures_util::StreamExt;
use kvbm_events::router::{RouterMode, SelectorConfig};
use kvbm_events::WorkerEndpoint;
use kvbm_router::config::{FrontendConfig, WorkerSpec};
use kvbm_router::frontend::Frontend;
use kvbm_router::tokenize::ModelTokenizer;
use kvbm_router::{Router, RouterConfig};
use serde_json::{json, Value};

/// A scripted vLLM worker: a stream of three one-token chunks (each `"usage": null`), then, when
/// the client asked for it, vLLM's usage chunk (`choices: []`), then `[DONE]`; a whole answer
/// otherwise.
async fn scripted_worker() -> String {
    common::scripted_worker(|req| {
        let usage = req["stream_options"]["include_usage"] == json!(true);
        let mut events: Vec<String> = (0..3)
            .map(|_| "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n".to_owned())
            .collect();
        if usage {
            events.push(
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\": 3,\"total_tokens\":7}}\n\n"
                    .to_owned(),
            );
        }
        events.push("data: [DONE]\n\n".to_owned());
        Body::from_stream(futures_util::stream::iter(events).then(|e| async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Ok::<Bytes, std::io::Error>(Bytes::from(e))
        }))
    })
    .await
}

/// A port nobody listens on (bound, then released).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Setup {
    base: String,
    router: Arc<Router>,
    client: reqwest::Client,
}

/// The router in `mode` with two scripted workers and a third whose HTTP server is gone.
async fn start(mode: RouterMode) -> Setup {
    let model_dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/chatml");
    let config = RouterConfig {
        selector: SelectorConfig::for_mode(mode),
        frontend: FrontendConfig {
            model_path: Some(model_dir.clone()),
            model_name: Some("m".into()),
            // The dead worker, once failed, stays out for the whole test.
            failure_cooldown: Duration::from_secs(600),
            ..FrontendConfig::default()
        },
        ..RouterConfig::default()
    };
    let mut specs = Vec::new();
    for id in 1..=3u64 {
        let http = if id == 3 {
            format!("http://127.0.0.1:{}", closed_port())
        } else {
            scripted_worker().await
        };
        specs.push(WorkerSpec {
            events: WorkerEndpoint {
                worker_id: id,
                dp_rank: 0,
                // Nothing publishes there: routing goes by load.
                endpoint: format!("tcp://127.0.0.1:{}", closed_port()),
                replay: None,
            },
            http: Some(http),
        });
    }
    let router = Arc::new(Router::start(config.clone(), specs).unwrap());
    let tokenizer = Arc::new(ModelTokenizer::from_dir(&model_dir).unwrap());
    let frontend =
        Arc::new(Frontend::new(router.clone(), tokenizer, config.frontend.clone()).unwrap());
    let listener = kvbm_router::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let r = router.clone();
    tokio::spawn(async move {
        kvbm_router::serve(r, Some(frontend), listener, std::future::pending()).await
    });
    Setup {
        base,
        router,
        client: reqwest::Client::builder().no_proxy().build().unwrap(),
    }
}

impl Setup {
    async fn complete(&self, body: Value) -> String {
        let response = self
            .client
            .post(format!("{}/v1/completions", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        tokio::time::timeout(Duration::from_secs(20), response.text())
            .await
            .expect("the answer never ended")
            .unwrap()
    }

    async fn get(&self, path: &str) -> String {
        self.client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn metric(&self, name: &str) -> Option<f64> {
        self.get("/metrics")
            .await
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    async fn cost(&self) -> Value {
        serde_json::from_str(&self.get("/debug/cost").await).unwrap()
    }

    /// Waits until the learner saw `ttft` observations (an answer's end reaches it as the
    /// client's stream closes, a moment after the client read `[DONE]`).
    async fn wait_observations(&self, ttft: u64) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let cost = self.cost().await;
            if cost["tuned"]["observations"]["ttft"] == json!(ttft) {
                return cost;
            }
            assert!(tokio::time::Instant::now() < deadline, "{cost}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_answers_teach_the_tuned_cost_and_it_shows_in_debug_cost_and_metrics() {
    let s = start(RouterMode::Tuned).await;
    let cost = s.cost().await;
    assert_eq!(cost["mode"], "tuned");
    assert_eq!(cost["tuned"]["active"], false);
    assert_eq!(cost["tuned"]["observations"]["ttft"], 0);
    assert_eq!(
        cost["weights_in_force"]["router_host_cache_hit_weight"],
        kvbm_events::router::KV_WEIGHTS.host_weight
    );
    // Streamed, with usage: TTFT and TPOT. Until one meets the dead worker first (a tie among
    // idle workers is broken at random) and is retried elsewhere: its times are no evidence.
    let stream = |i: usize| {
        json!({
            "model": "m",
            "prompt": format!("hello world {}", "x ".repeat(i)),
            "max_tokens": 3,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    };
    let mut sent = 0u64;
    while s
        .metric("kv_router_frontend_retries_total")
        .await
        .unwrap_or(0.0)
        < 1.0
    {
        assert!(sent < 200, "the dead worker was never tried");
        let text = s.complete(stream(sent as usize)).await;
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        sent += 1;
    }
    let cost = s.wait_observations(sent - 1).await;
    assert_eq!(
        cost["tuned"]["observations"]["tpot"],
        json!(sent - 1),
        "{cost}"
    );
    // Whole answers are no evidence.
    for _ in 0..3 {
        let text = s
            .complete(json!({"model": "m", "prompt": "hello world", "max_tokens": 3}))
            .await;
        assert!(text.contains("text_completion"), "{text}");
    }
    // The dead worker is out now (--worker-failure-cooldown-secs): no more retries.
    let n = 60u64;
    for i in 0..n {
        s.complete(stream(i as usize)).await;
    }
    let cost = s.wait_observations(sent - 1 + n).await;
    assert_eq!(
        cost["tuned"]["observations"]["tpot"],
        json!(sent - 1 + n),
        "{cost}"
    );
    // Streamed without usage: a TTFT, no TPOT.
    s.complete(json!({"model": "m", "prompt": "hi", "stream": true}))
        .await;
    let learned = sent + n;
    let cost = s.wait_observations(learned).await;
    assert_eq!(
        cost["tuned"]["observations"]["tpot"],
        json!(learned - 1),
        "{cost}"
    );
    assert_eq!(
        s.metric("kv_router_frontend_retries_total").await,
        Some(1.0)
    );
    assert_eq!(cost["tuned"]["active"], true, "{cost}");
    let workers = cost["tuned"]["workers"].as_array().unwrap();
    let per_worker: u64 = workers
        .iter()
        .map(|w| w["ttft_observations"].as_u64().unwrap())
        .sum();
    assert_eq!(per_worker, learned);
    assert!(workers.iter().all(|w| w["worker_id"] != 3), "{cost}");
    for w in workers {
        let c = &w["coefficients"];
        let compute = c["compute_seconds_per_token"].as_f64().unwrap();
        assert!(compute.is_finite() && compute > 0.0, "{w}");
        assert!(
            c["host_seconds_per_token"].as_f64().unwrap() <= compute,
            "{w}"
        );
        assert!(!w["recent_residuals_seconds"].as_array().unwrap().is_empty());
    }
    let dynamo = &cost["tuned"]["dynamo_weights"];
    for key in [
        "router_prefill_load_scale",
        "router_host_cache_hit_weight",
        "router_disk_cache_hit_weight",
    ] {
        assert!(dynamo[key].as_f64().unwrap().is_finite(), "{cost}");
    }

    // The same numbers in /metrics.
    assert_eq!(
        s.metric("kv_router_mode_info{mode=\"tuned\"}").await,
        Some(1.0)
    );
    assert_eq!(
        s.metric("kv_router_routed_total{mode=\"tuned\"}").await,
        Some((sent + 1 + 3 + n + 1) as f64)
    );
    assert_eq!(
        s.metric("kv_router_tuned_observations{kind=\"ttft\"}")
            .await,
        Some(learned as f64)
    );
    assert_eq!(s.metric("kv_router_tuned_active").await, Some(1.0));
    let scale = s
        .metric("kv_router_tuned_prefill_load_scale")
        .await
        .unwrap();
    assert_eq!(scale, dynamo["router_prefill_load_scale"].as_f64().unwrap());
    let w1 = s
        .metric("kv_router_tuned_compute_seconds_per_token{dp_rank=\"0\",worker_id=\"1\"}")
        .await;
    assert!(w1.is_some_and(|v| v > 0.0), "{w1:?}");
    assert!(s
        .metric("kv_router_tuned_ttft_abs_error_seconds")
        .await
        .is_some_and(f64::is_finite));
    assert!(s
        .metric("kv_router_front_end_cpu_seconds_total")
        .await
        .is_some_and(|v| v > 0.0));
    let total = s
        .metric("kv_router_front_end_cpu_seconds_total")
        .await
        .unwrap();
    for stage in ["tokenize", "route"] {
        let v = s
            .metric(&format!(
                "kv_router_front_end_stage_cpu_seconds_total{{stage=\"{stage}\"}}"
            ))
            .await;
        assert!(v.is_some_and(|v| v >= 0.0 && v <= total), "{stage}: {v:?}");
    }

    // A worker that leaves is forgotten.
    assert!(s.router.unregister((1, 0)));
    let cost = s.cost().await;
    assert!(
        cost["tuned"]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["worker_id"] != 1),
        "{cost}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_through_the_front_end_alternates_and_is_counted_by_mode() {
    let s = start(RouterMode::RoundRobin).await;
    let mut workers = Vec::new();
    for _ in 0..6 {
        let response = s
            .client
            .post(format!("{}/v1/completions", s.base))
            .header("content-type", "application/json")
            .body(json!({"model": "m", "prompt": "hello"}).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let worker = response
            .headers()
            .get("x-kvbm-worker")
            .map(|v| v.to_str().unwrap().to_owned());
        workers.push(worker.unwrap_or_default());
        response.bytes().await.unwrap();
    }
    // Worker 3 is dead: tried once in its turn, then cooled down; the live two alternate.
    let live: Vec<&str> = workers.iter().map(String::as_str).collect();
    for pair in live.windows(2) {
        assert_ne!(pair[0], pair[1], "{live:?}");
    }
    assert!(live.iter().all(|w| *w == "1:0" || *w == "2:0"), "{live:?}");
    assert_eq!(
        s.metric("kv_router_mode_info{mode=\"round-robin\"}").await,
        Some(1.0)
    );
    assert_eq!(s.metric("kv_router_mode_info{mode=\"kv\"}").await, None);
    assert!(s
        .metric("kv_router_routed_total{mode=\"round-robin\"}")
        .await
        .is_some_and(|v| v >= 6.0));
    let cost = s.cost().await;
    assert_eq!(cost["mode"], "round-robin");
}
