//! The mocker at its interfaces: HTTP on real sockets, KV events through a real ZMQ subscriber,
//! the binary's command line. No timing asserts: large speedups, counts and orderings.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kvbm_events::{
    request_replay, BlockHasher, Location, SequenceHash, SubscriberEvent, Tier, WireEvent,
    WorkerEndpoint, ZmqSubscriber,
};
use kvbm_mocker::config::Args;
use kvbm_mocker::engine::engine_hash;
use kvbm_mocker::Fleet;
use serde_json::{json, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/wordlevel")
}

fn args(extra: &[&str]) -> Args {
    let dir = fixture();
    let mut flags: Vec<(String, String)> = [
        ("--model-path", dir.to_str().unwrap()),
        ("--served-model-name", "mock"),
        ("--block-size", "4"),
        ("--gpu-blocks", "64"),
        ("--speedup", "1000"),
        ("--stream-interval-ms", "0"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for pair in extra.chunks(2) {
        match flags.iter_mut().find(|(k, _)| k == pair[0]) {
            Some(slot) => slot.1 = pair[1].to_owned(),
            None => flags.push((pair[0].to_owned(), pair[1].to_owned())),
        }
    }
    let mut argv = vec!["kvbm-mocker".to_owned()];
    for (k, v) in flags {
        argv.push(k);
        argv.push(v);
    }
    Args::try_parse_from(argv).unwrap()
}

fn words(range: std::ops::Range<u32>) -> String {
    range.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

async fn post(client: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = client.post(url).json_body(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let bytes = r.bytes().await.unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

trait JsonBody {
    fn json_body(self, v: &Value) -> Self;
}

impl JsonBody for reqwest::RequestBuilder {
    fn json_body(self, v: &Value) -> Self {
        self.header("content-type", "application/json")
            .body(serde_json::to_vec(v).unwrap())
    }
}

/// The chunks of a streamed answer to `body`, which must end with `[DONE]`.
async fn streamed(client: &reqwest::Client, url: String, body: &Value) -> Vec<Value> {
    let r = client.post(url).json_body(body).send().await.unwrap();
    let text = r.text().await.unwrap();
    let events = sse_events(&text);
    assert_eq!(events.last().unwrap(), "[DONE]");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

/// The SSE events of a body, without the `data: ` prefix.
fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("an SSE data line")
                .to_owned()
        })
        .collect()
}

async fn metric(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .map(|v| v.parse().unwrap())
        .unwrap_or_else(|| panic!("{name} not in {text}"))
}

/// vLLM's `/v1/completions` and `/v1/chat/completions` (vllm/entrypoints/openai/*/serving.py):
/// whole and streamed responses in `openai`'s shapes, exact token counts, cached tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_whole_and_streamed() {
    let fleet = Fleet::start(&args(&[])).await.unwrap();
    let base = format!("http://{}", fleet.workers[0].http);
    let c = reqwest::Client::new();
    let prompt = words(0..10); // 10 tokens: 2 full blocks of 4 + 2

    let (s, v) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"model": "mock", "prompt": prompt, "max_tokens": 5}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], " tok tok tok tok tok");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 10);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 15);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Default max_tokens 16; the same prompt again hits its 2 full blocks.
    let (_, v) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"prompt": prompt}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
    // Token ids as the prompt.
    let (_, v) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"prompt": [5, 6, 7], "max_tokens": 1}),
    )
    .await;
    assert_eq!(v["usage"]["prompt_tokens"], 3);

    let chat = json!({"model": "mock", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 3});
    let (s, v) = post(&c, format!("{base}/v1/chat/completions"), chat.clone()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], " tok tok tok");
    // <|im_start|> user w1 w2 w3 <|im_end|> <|im_start|> assistant: 8 tokens.
    assert_eq!(v["usage"]["prompt_tokens"], 8);

    // Streamed completion with usage.
    let body = json!({"prompt": prompt, "max_tokens": 7, "stream": true, "stream_options": {"include_usage": true}});
    let chunks = streamed(&c, format!("{base}/v1/completions"), &body).await;
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 7);
    let mut words_seen = 0;
    for ch in &chunks[..chunks.len() - 1] {
        assert_eq!(ch["object"], "text_completion");
        words_seen += ch["choices"][0]["text"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count();
    }
    assert_eq!(words_seen, 7);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );

    // Streamed chat: the role first, then content, no usage chunk unless asked.
    let mut body = chat;
    body["stream"] = json!(true);
    let chunks = streamed(&c, format!("{base}/v1/chat/completions"), &body).await;
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let n: usize = chunks
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .split_whitespace()
                .count()
        })
        .sum();
    assert_eq!(n, 3);
    assert!(chunks
        .iter()
        .all(|c| c.get("usage").is_none_or(Value::is_null)));

    // The other endpoints.
    assert_eq!(
        c.get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let models: Value = serde_json::from_str(
        &c.get(format!("{base}/v1/models"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(models["data"][0]["id"], "mock");
    let info: Value = serde_json::from_str(
        &c.get(format!("{base}/v1/kvbm/mocker"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(info["block_size"], 4);
    assert_eq!(info["speedup"], 1000.0);
    assert!(info["prefill_tokens_per_sec"].as_f64().unwrap() > 1000.0);
    assert_eq!(
        metric(
            &c,
            &base,
            "kvbm_mocker_requests_total{outcome=\"finished\"}"
        )
        .await,
        6.0
    );
    assert_eq!(
        metric(&c, &base, "kvbm_mocker_prompt_tokens_total{source=\"gpu\"}").await,
        8.0 + 8.0 + 4.0
    );
    assert!(metric(&c, &base, "kvbm_mocker_sim_seconds").await > 0.0);
}

/// Malformed bodies get vLLM's error shape (400), never a panic; the worker serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_get_400() {
    let fleet = Fleet::start(&args(&[])).await.unwrap();
    let base = format!("http://{}", fleet.workers[0].http);
    let c = reqwest::Client::new();
    let raw = [
        "{",
        "[]",
        "null",
        "\"x\"",
        "{\"prompt\": 5}",
        "{\"prompt\": [-1]}",
        "{\"prompt\": \"w1\", \"max_tokens\": -3}",
        "{\"prompt\": \"w1\", \"max_tokens\": 0}",
        "{\"prompt\": \"w1\", \"stream\": \"yes\"}",
        "{\"prompt\": []}",
        "{\"prompt\": \"w1\", \"stream_options\": {\"include_usage\": true}}",
        "{\"prompt\": \"w1\", \"min_tokens\": 9, \"max_tokens\": 2}",
    ];
    for body in raw {
        let r = c
            .post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let v: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        assert_eq!(v["error"]["code"], 400, "{body}");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert!(v["error"]["message"].as_str().unwrap().len() > 3);
    }
    for body in [
        "{}",
        "{\"messages\": 3}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"w1\"}], \"max_tokens\": \"many\"}",
    ] {
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
    }
    let (s, v) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"model": "other", "prompt": "w1"}),
    )
    .await;
    assert_eq!((s, v["error"]["code"].clone()), (404, json!(404)));
    // Too large for the GPU pool (64 blocks of 4).
    let (s, _) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"prompt": words(0..300)}),
    )
    .await;
    assert_eq!(s, 400);
    let (s, _) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"prompt": "w1", "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
}

/// A client that drops its stream midway aborts the request (vLLM's `abort` on disconnect):
/// counted as aborted, its blocks released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_stream_aborts_and_releases_blocks() {
    // Slow enough that 200 tokens outlive the two chunks read: speedup 1, 5 ms steps.
    let fleet = Fleet::start(&args(&[
        "--speedup",
        "1",
        "--overhead",
        "0.005",
        "--gpu-blocks",
        "256",
    ]))
    .await
    .unwrap();
    let base = format!("http://{}", fleet.workers[0].http);
    let c = reqwest::Client::new();
    let body = json!({"prompt": words(0..20), "max_tokens": 900, "stream": true});
    let mut r = c
        .post(format!("{base}/v1/completions"))
        .json_body(&body)
        .send()
        .await
        .unwrap();
    let mut got = 0;
    while got < 2 {
        if r.chunk().await.unwrap().is_some() {
            got += 1;
        }
    }
    drop(r);
    let mut aborted = 0.0;
    for _ in 0..200 {
        aborted = metric(&c, &base, "kvbm_mocker_requests_total{outcome=\"aborted\"}").await;
        if aborted > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(aborted, 1.0);
    assert_eq!(
        metric(
            &c,
            &base,
            "kvbm_mocker_requests_total{outcome=\"finished\"}"
        )
        .await,
        0.0
    );
    // The next step after the abort updates the gauges; run one small request to get there.
    let (s, _) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"prompt": "w900", "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(
        metric(&c, &base, "kvbm_mocker_blocks_active{tier=\"gpu\"}").await,
        0.0
    );
}

/// A non-streamed request whose client goes away is aborted too (the handler is dropped with
/// the connection, and with it the request's receiver).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_whole_request_aborts() {
    let fleet = Fleet::start(&args(&["--speedup", "1", "--overhead", "0.005"]))
        .await
        .unwrap();
    let base = format!("http://{}", fleet.workers[0].http);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let body = json!({"prompt": words(0..8), "max_tokens": 200});
    let r = impatient
        .post(format!("{base}/v1/completions"))
        .json_body(&body)
        .send()
        .await;
    assert!(r.is_err(), "a 1 s request outlives a 0.3 s timeout");
    let c = reqwest::Client::new();
    let mut aborted = 0.0;
    for _ in 0..200 {
        aborted = metric(&c, &base, "kvbm_mocker_requests_total{outcome=\"aborted\"}").await;
        if aborted > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(aborted, 1.0);
}

fn collect_events(
    rx: &crossbeam_channel::Receiver<SubscriberEvent>,
    until: impl Fn(&[WireEvent]) -> bool,
) -> Vec<WireEvent> {
    let mut all = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while std::time::Instant::now() < deadline && !until(&all) {
        if let Ok(SubscriberEvent::Batch { batch, .. }) =
            rx.recv_timeout(Duration::from_millis(100))
        {
            all.extend(batch.events);
        }
    }
    all
}

/// The KV events as a router sees them (vLLM's wire form through kvbm-events' subscriber):
/// GPU stores carry engine hashes, not kvbm's, with the blocks' exact tokens; host and disk
/// stores come out with kvbm connector's media names; the replay socket returns past batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_on_the_wire_and_replay() {
    let fleet = Fleet::start(&args(&[
        "--gpu-blocks",
        "12",
        "--host-blocks",
        "4",
        "--disk-blocks",
        "64",
    ]))
    .await
    .unwrap();
    let w = &fleet.workers[0];
    let (tx, rx) = crossbeam_channel::unbounded();
    let _sub = ZmqSubscriber::start(
        vec![WorkerEndpoint {
            worker_id: w.id,
            dp_rank: 0,
            endpoint: w.events.clone(),
            replay: Some(w.replay.clone()),
        }],
        tx,
    )
    .unwrap();
    let base = format!("http://{}", w.http);
    let c = reqwest::Client::new();
    // Three prompts of 40 tokens (10 blocks each) through a 12-block GPU and 4-block host.
    for k in 0..3 {
        let (s, _) = post(
            &c,
            format!("{base}/v1/completions"),
            json!({"prompt": words(k * 100..k * 100 + 40), "max_tokens": 1}),
        )
        .await;
        assert_eq!(s, 200);
    }
    let tier_of = |e: &WireEvent| match e {
        WireEvent::Stored {
            location: Location::Local(t),
            ..
        } => Some(*t),
        _ => None,
    };
    let events = collect_events(&rx, |evs| {
        let tiers: std::collections::HashSet<_> = evs.iter().filter_map(tier_of).collect();
        tiers.len() == 3
    });
    let tiers: std::collections::HashSet<_> = events.iter().filter_map(tier_of).collect();
    assert_eq!(tiers, [Tier::Gpu, Tier::Host, Tier::Disk].into());
    assert!(events.iter().any(|e| matches!(
        e,
        WireEvent::Removed {
            location: Location::Local(Tier::Gpu),
            ..
        }
    )));

    // The first GPU store is prompt 0's 10 blocks: token ids exact, hashes the engine's.
    let (hashes, tokens) = events
        .iter()
        .find_map(|e| match e {
            WireEvent::Stored {
                location: Location::Local(Tier::Gpu),
                block_hashes,
                token_ids,
                ..
            } => Some((block_hashes.clone(), token_ids.clone())),
            _ => None,
        })
        .unwrap();
    let ids: Vec<u32> = (0..40).map(|i| i + 2).collect(); // w_i is id i + 2
    assert_eq!(tokens, ids);
    let kvbm = BlockHasher::new(4, None, None).sequence_hashes(None, &tokens);
    assert_eq!(hashes.len(), 10);
    for (h, k) in hashes.iter().zip(&kvbm) {
        assert_ne!(SequenceHash(*h), *k, "GPU events never carry kvbm's hashes");
        assert_eq!(SequenceHash(*h), engine_hash(*k));
    }

    // Replay from 0 gives the same batches again, from sequence 0.
    let ctx = zmq::Context::new();
    let replayed = request_replay(&ctx, &w.replay, 0, Duration::from_secs(5)).unwrap();
    assert!(!replayed.is_empty());
    assert_eq!(replayed[0].0, 0);
    let first = kvbm_events::decode_batch(&replayed[0].1).unwrap();
    assert!(matches!(
        &first.events[0],
        WireEvent::Stored {
            location: Location::Local(Tier::Gpu),
            ..
        }
    ));
}

/// The binary: `--workers 3` prints 3 lines the router's `--workers` parser accepts, and writes
/// them to `--ready-file`; bad flags are named.
#[test]
fn cli_prints_router_worker_lines_and_names_bad_flags() {
    let bin = env!("CARGO_BIN_EXE_kvbm-mocker");
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = std::process::Command::new(bin)
        .args(["--workers", "3", "--model-path"])
        .arg(fixture())
        .args(["--gpu-blocks", "64", "--ready-file"])
        .arg(&ready)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let _child = KillOnDrop(child);
    let mut lines = Vec::new();
    for _ in 0..3 {
        let mut l = String::new();
        std::io::BufRead::read_line(&mut out, &mut l).unwrap();
        lines.push(l.trim().to_owned());
    }
    let workers = kvbm_router::config::parse_workers(&lines.join(";")).unwrap();
    assert_eq!(workers.len(), 3);
    for (i, w) in workers.iter().enumerate() {
        assert_eq!(w.events.worker_id, i as u64 + 1);
        assert!(w.events.replay.is_some());
        assert!(w.http.as_deref().unwrap().starts_with("http://127.0.0.1:"));
    }
    let file = std::fs::read_to_string(&ready).unwrap();
    assert_eq!(file.lines().collect::<Vec<_>>(), lines);

    for (flags, named) in [
        (vec!["--speedup", "0"], "--speedup 0"),
        (vec!["--preset", "gpt5-tpu"], "--preset gpt5-tpu"),
        (vec!["--block-size", "0"], "--block-size 0"),
        (vec!["--host-gbps=-1"], "--host-gbps -1"),
    ] {
        let out = std::process::Command::new(bin)
            .args(["--model-path"])
            .arg(fixture())
            .args(&flags)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flags:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(named), "{flags:?}: {err}");
    }
    let out = std::process::Command::new(bin)
        .arg("--list-presets")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for p in ["llama3-8b-h100", "qwen3-32b-h100", "llama3-70b-4xh100"] {
        assert!(text.contains(p));
    }
}

/// 16 workers in one process at --speedup 20 under a short load: every request finishes; the
/// lag each worker reports is printed (a number to read, not asserted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_workers_finish_a_short_load() {
    let fleet = Fleet::start(&args(&[
        "--workers",
        "16",
        "--speedup",
        "20",
        "--gpu-blocks",
        "2048",
        "--stream-interval-ms",
        "20",
    ]))
    .await
    .unwrap();
    let c = reqwest::Client::new();
    let mut tasks = Vec::new();
    for (i, w) in fleet.workers.iter().enumerate() {
        for k in 0..4u32 {
            let c = c.clone();
            let url = format!("http://{}/v1/completions", w.http);
            let prompt = words(k * 50..k * 50 + 200 + i as u32);
            tasks.push(tokio::spawn(async move {
                let body = json!({"prompt": prompt, "max_tokens": 32, "stream": k % 2 == 0});
                let r = c.post(url).json_body(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
                r.text().await.unwrap()
            }));
        }
    }
    for t in tasks {
        let text = t.await.unwrap();
        assert!(text.contains("length"));
    }
    let mut lags = Vec::new();
    for w in &fleet.workers {
        assert_eq!(w.metrics.requests.with_label_values(&["finished"]).get(), 4);
        lags.push(w.metrics.lag_max_seconds.get());
    }
    println!("per-worker max lag (simulated s): {lags:?}");
}

/// What the router makes of the events (kvbm-router's own listener and index): a prompt served
/// by worker 2 shows as worker 2's GPU prefix (mapped from the engine hashes through the token
/// ids); once the GPU evicted it, as worker 2's host prefix (kvbm's hashes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_follows_each_workers_prefix() {
    let fleet = Fleet::start(&args(&[
        "--workers",
        "2",
        "--gpu-blocks",
        "12",
        "--host-blocks",
        "64",
    ]))
    .await
    .unwrap();
    let workers = kvbm_router::config::parse_workers(&fleet.lines().join(";")).unwrap();
    let config = kvbm_router::RouterConfig {
        block_size: 4,
        ..Default::default()
    };
    let router = kvbm_router::Router::start(config, workers).unwrap();
    let c = reqwest::Client::new();
    let base = format!("http://{}", fleet.workers[1].http);
    let ids: Vec<u32> = (0..40).map(|i| i + 2).collect();
    let overlap = |router: &kvbm_router::Router| {
        let answer = router.query(&kvbm_router::state::RequestTokens {
            token_ids: &ids,
            untokenized_tokens: 0,
            lora_name: None,
            cache_salt: None,
        });
        answer
            .workers
            .iter()
            .find(|w| w.worker_id == 2)
            .map(|w| (w.overlap.gpu_blocks, w.overlap.host_blocks))
            .unwrap_or((0, 0))
    };
    let wait_for = |want: (usize, usize)| {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let got = overlap(&router);
            if got == want || std::time::Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let (s, _) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"prompt": ids, "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(
        wait_for((10, 0)),
        (10, 0),
        "the prompt's 10 blocks on worker 2's GPU"
    );
    let (s, _) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"prompt": words(500..540), "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    let got = wait_for((0, 10));
    assert_eq!(got, (0, 10), "evicted from the GPU, still on the host");
}

/// The router's front end before two workers: it tokenizes a prompt only as far as some worker
/// holds its blocks (`PrefixProbe`), and still sends a conversation's next turn to the worker
/// holding its history, which then finds all of it cached (the worker counts every token itself).
/// Here with `--tokenize-past-sure-pick`: the whole history is tokenized.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_end_tokenizes_only_as_far_as_a_worker_holds_the_prompt() {
    next_turn_goes_where_its_history_is(true).await;
}

/// As above with the default: the next turn's tokenizing stops inside the history, where the one
/// worker holding it is sure to be picked, and the turn still goes there, all of it cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_end_stops_tokenizing_where_the_pick_is_sure() {
    next_turn_goes_where_its_history_is(false).await;
}

async fn next_turn_goes_where_its_history_is(tokenize_past_sure_pick: bool) {
    use kvbm_router::config::FrontendConfig;
    let fleet = Fleet::start(&args(&["--workers", "2", "--gpu-blocks", "4096"]))
        .await
        .unwrap();
    let workers = kvbm_router::config::parse_workers(&fleet.lines().join(";")).unwrap();
    let config = kvbm_router::RouterConfig {
        block_size: 4,
        frontend: FrontendConfig {
            model_path: Some(fixture()),
            model_name: Some("mock".into()),
            tokenize_past_sure_pick,
            ..FrontendConfig::default()
        },
        ..Default::default()
    };
    let router = std::sync::Arc::new(kvbm_router::Router::start(config, workers).unwrap());
    let frontend = kvbm_router::frontend::Frontend::load(&router).unwrap();
    let listener = kvbm_router::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let r = router.clone();
    tokio::spawn(
        async move { kvbm_router::serve(r, frontend, listener, std::future::pending()).await },
    );
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    let skipped = |c: reqwest::Client, base: String| async move {
        metric(
            &c,
            &base,
            "kv_router_frontend_prompt_bytes_total{how=\"skipped\"}",
        )
        .await
    };

    // A first prompt no worker holds: one window tokenized, the rest skipped.
    let history = words(0..3000);
    let (s, first) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"model": "mock", "prompt": history, "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200, "{first}");
    let skipped_first = skipped(c.clone(), base.clone()).await;
    assert!(
        skipped_first > (history.len() / 2) as f64,
        "{skipped_first} of {} bytes skipped",
        history.len()
    );
    // Its blocks reach the router's index.
    let tok = kvbm_router::tokenize::ModelTokenizer::from_dir(&fixture()).unwrap();
    let ids = tok.encode_prompt(&history, true).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let q = router.query(&kvbm_router::state::RequestTokens {
            token_ids: &ids,
            ..Default::default()
        });
        let most = q.workers.iter().map(|w| w.overlap.gpu_blocks).max();
        if most == Some(ids.len() / 4) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{q:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The next turn: the history is tokenized (a worker holds it), the new question only as
    // far as its first window; the turn goes where the history is, all of it cached there.
    let turn = format!("{history} {}", words(10_000..13_000));
    let (s, second) = post(
        &c,
        format!("{base}/v1/completions"),
        json!({"model": "mock", "prompt": turn, "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200, "{second}");
    let usage = &second["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(
        usage["prompt_tokens"].as_u64().unwrap() as usize,
        tok.encode_prompt(&turn, true).unwrap().len()
    );
    assert!(
        cached as usize >= ids.len() / 4 * 4 - 4,
        "{cached} cached tokens; the history has {}",
        ids.len()
    );
    let skipped_second = skipped(c.clone(), base.clone()).await - skipped_first;
    let question = (turn.len() - history.len()) as f64;
    if tokenize_past_sure_pick {
        assert!(
            skipped_second > 0.0 && skipped_second < question,
            "{skipped_second} bytes of the turn skipped"
        );
    } else {
        assert!(
            skipped_second > question && skipped_second < turn.len() as f64,
            "{skipped_second} bytes of the turn skipped"
        );
        let m = router.render_metrics();
        assert!(
            m.lines()
                .any(|l| l == "kv_router_frontend_probe_answers_total{answer=\"sure_pick\"} 1"),
            "{m}"
        );
    }
}
