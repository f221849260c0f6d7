//! End to end: scripted workers publish KV events over real ZMQ sockets on loopback (vLLM's
//! framing, kvbm's GPU/host/disk media), the `kvbm-router` binary follows them, and its HTTP
//! answers are checked against an index fed directly with the same stream. Covers the initial
//! replay, registration over HTTP, a gap filled by replay, a gap without replay, an engine
//! restart, malformed payloads, unregistration and the API's error answers.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvbm_events::router::KvIndex;
use kvbm_events::{
    decode_batch, encode_batch, BlockHasher, BlockRemoved, BlockStored, GroupKind, KvEvent,
    SequenceHash, Tier, WireEvent,
};
use kvbm_router::dump;
use serde_json::{json, Value};

const BLOCK: usize = 4;
const WAIT: Duration = Duration::from_secs(20);

type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A worker whose event stream the test scripts: an XPUB socket (so the test knows when the
/// router has subscribed) and, optionally, a replay socket served from a thread.
struct Worker {
    id: u64,
    rank: u32,
    xpub: zmq::Socket,
    endpoint: String,
    replay: Option<String>,
    buffer: Buffer,
    stop: Arc<AtomicBool>,
    server: Option<JoinHandle<()>>,
    seq: u64,
}

impl Worker {
    fn new(ctx: &zmq::Context, id: u64, rank: u32, with_replay: bool) -> Self {
        let xpub = ctx.socket(zmq::XPUB).unwrap();
        xpub.set_linger(0).unwrap();
        xpub.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = xpub.get_last_endpoint().unwrap().unwrap();
        let buffer: Buffer = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (replay, server) = if with_replay {
            let router = ctx.socket(zmq::ROUTER).unwrap();
            router.set_linger(0).unwrap();
            router.bind("tcp://127.0.0.1:*").unwrap();
            let replay = router.get_last_endpoint().unwrap().unwrap();
            let (buffer, stop) = (buffer.clone(), stop.clone());
            let server = std::thread::spawn(move || serve_replays(&router, &buffer, &stop));
            (Some(replay), Some(server))
        } else {
            (None, None)
        };
        Self {
            id,
            rank,
            xpub,
            endpoint,
            replay,
            buffer,
            stop,
            server,
            seq: 0,
        }
    }

    fn spec(&self) -> String {
        match &self.replay {
            Some(r) => format!("{}:{}={},replay={}", self.id, self.rank, self.endpoint, r),
            None => format!("{}:{}={}", self.id, self.rank, self.endpoint),
        }
    }

    /// Waits until a subscriber has subscribed.
    fn wait_for_subscriber(&self) {
        assert!(
            self.xpub
                .poll(zmq::POLLIN, WAIT.as_millis() as i64)
                .unwrap()
                > 0,
            "the router never subscribed to worker {}",
            self.id
        );
        let subscription = self.xpub.recv_bytes(0).unwrap();
        assert_eq!(subscription.first(), Some(&1u8));
    }

    /// Encodes `events` as the next batch, keeps it for replay, and sends it unless `lose`.
    fn batch(&mut self, events: &[KvEvent], lose: bool, expected: &mut KvIndex) -> u64 {
        let mut payload = Vec::new();
        encode_batch(1.0, events, Some(self.rank), &mut payload);
        // The direct computation: the same bytes, decoded and applied.
        for e in &decode_batch(&payload).unwrap().events {
            expected.apply((self.id, self.rank), e);
        }
        let seq = self.seq;
        self.seq += 1;
        self.buffer.lock().unwrap().push((seq, payload.clone()));
        if !lose {
            self.send(seq, &payload);
        }
        seq
    }

    fn send(&self, seq: u64, payload: &[u8]) {
        let frames: [&[u8]; 3] = [b"", &seq.to_be_bytes(), payload];
        self.xpub.send_multipart(frames, 0).unwrap();
    }

    /// The engine restarted: sequence numbers and the replay buffer start again.
    fn restart(&mut self, expected: &mut KvIndex) {
        self.seq = 0;
        self.buffer.lock().unwrap().clear();
        expected.remove_worker((self.id, self.rank));
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

/// Answers replay requests `[identity, "", start]` from the buffer, as vLLM's publisher does.
fn serve_replays(router: &zmq::Socket, buffer: &Buffer, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        if router.poll(zmq::POLLIN, 20).unwrap_or(0) == 0 {
            continue;
        }
        let Ok(frames) = router.recv_multipart(0) else {
            continue;
        };
        let start = u64::from_be_bytes(frames[2].as_slice().try_into().unwrap());
        for (seq, payload) in buffer.lock().unwrap().iter().filter(|(s, _)| *s >= start) {
            let out: [&[u8]; 5] = [&frames[0], b"", b"", &seq.to_be_bytes(), payload];
            router.send_multipart(out, 0).unwrap();
        }
        let end: [&[u8]; 5] = [&frames[0], b"", b"", &u64::MAX.to_be_bytes(), b""];
        router.send_multipart(end, 0).unwrap();
    }
}

fn hashes(tokens: &[u32]) -> Vec<SequenceHash> {
    BlockHasher::new(BLOCK, None, None).sequence_hashes(None, tokens)
}

/// Stores blocks `from..to` of `tokens` in `tier`, with their parent and tokens.
fn stored(tokens: &[u32], from: usize, to: usize, tier: Tier) -> KvEvent {
    let h = hashes(tokens);
    KvEvent::BlockStored(BlockStored {
        tier,
        block_hashes: h[from..to].to_vec(),
        parent_hash: from.checked_sub(1).map(|p| h[p]),
        token_ids: tokens[from * BLOCK..to * BLOCK].to_vec(),
        block_size: BLOCK as u32,
        lora_name: None,
    })
}

fn removed(tokens: &[u32], from: usize, to: usize, tier: Tier) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        tier,
        block_hashes: hashes(tokens)[from..to].to_vec(),
    })
}

/// The `kvbm-router` binary, killed when dropped.
struct RouterProcess {
    child: Child,
    base: String,
}

impl RouterProcess {
    fn start(workers: &str) -> Self {
        Self::start_with(workers, &[])
    }

    fn start_with(workers: &str, extra: &[&str]) -> Self {
        Self::start_sized(workers, BLOCK, extra)
    }

    fn start_sized(workers: &str, block_size: usize, extra: &[&str]) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_kvbm-router"))
            .args([
                "--workers",
                workers,
                "--http-port",
                "0",
                "--block-size",
                &block_size.to_string(),
                "--max-body-bytes",
                "65536",
            ])
            .args(extra)
            .env("DYN_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let router = Self::listening(child);
        assert!(
            router.base.starts_with("http://127.0.0.1:"),
            "{}",
            router.base
        );
        router
    }

    /// A started router (stdout piped), once it printed the line that says where it listens.
    fn listening(mut child: Child) -> Self {
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let base = line
            .trim()
            .strip_prefix("kvbm-router listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        Self { child, base }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let request = ureq::request(method, &format!("{}{path}", self.base));
        let response = match body {
            Some(b) => request.send_json(b),
            None => request.call(),
        };
        let response = match response {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        let status = response.status();
        let text = response.into_string().unwrap();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, value)
    }

    fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, value) = self.call(method, path, body);
        assert_eq!(status, 200, "{method} {path}: {value}");
        value
    }

    fn worker(&self, id: u64, rank: u32) -> Option<Value> {
        let all = self.ok("GET", "/workers", None);
        all["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == id && w["dp_rank"] == rank)
            .cloned()
    }

    /// Waits until the router has applied batch `seq` of a worker.
    fn wait_applied(&self, w: &Worker, seq: u64) {
        wait_until(&format!("worker {} batch {seq}", w.id), || {
            self.worker(w.id, w.rank)
                .is_some_and(|v| v["last_seq"].as_u64() == Some(seq))
        });
    }

    /// `kv_router_worker_prompt_tokens_total` of worker `id` (rank 0) for `part`; None when the
    /// series is not on the page.
    fn worker_tokens(&self, id: u64, part: &str) -> Option<f64> {
        let (status, text) = self.call("GET", "/metrics", None);
        assert_eq!(status, 200);
        let (worker, part) = (format!("worker_id=\"{id}\""), format!("part=\"{part}\""));
        text.as_str()
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("kv_router_worker_prompt_tokens_total{"))
            .find(|l| l.contains(&worker) && l.contains(&part) && l.contains("dp_rank=\"0\""))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    fn metric(&self, name_and_labels: &str) -> f64 {
        let (status, text) = self.call("GET", "/metrics", None);
        assert_eq!(status, 200);
        let text = text.as_str().unwrap().to_owned();
        text.lines()
            .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Checks `/query` for `tokens` against the directly fed index, for every registered worker.
fn check_query(router: &RouterProcess, expected: &KvIndex, tokens: &[u32]) -> Value {
    let answer = router.ok("POST", "/query", Some(json!({ "token_ids": tokens })));
    let h: Vec<u64> = hashes(tokens).iter().map(|h| h.0).collect();
    assert_eq!(answer["request_blocks"], h.len());
    let direct = expected.find_matches(&h);
    for w in answer["workers"].as_array().unwrap() {
        let key = (
            w["worker_id"].as_u64().unwrap(),
            w["dp_rank"].as_u64().unwrap() as u32,
        );
        let want = direct
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, o)| *o)
            .unwrap_or_default();
        let o = &w["overlap"];
        assert_eq!(
            (
                o["gpu_blocks"].as_u64(),
                o["host_blocks"].as_u64(),
                o["disk_blocks"].as_u64()
            ),
            (
                Some(want.gpu as u64),
                Some(want.host as u64),
                Some(want.disk as u64)
            ),
            "worker {key:?} for {} tokens: {answer}",
            tokens.len()
        );
        assert_eq!(o["host_tokens"].as_u64(), Some((want.host * BLOCK) as u64));
    }
    answer
}

fn overlap_of(answer: &Value, id: u64) -> (u64, u64, u64) {
    let w = answer["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == id)
        .unwrap_or_else(|| panic!("worker {id} missing from {answer}"));
    let o = &w["overlap"];
    (
        o["gpu_blocks"].as_u64().unwrap(),
        o["host_blocks"].as_u64().unwrap(),
        o["disk_blocks"].as_u64().unwrap(),
    )
}

#[test]
fn the_router_follows_workers_over_zmq_and_answers_over_http() {
    let ctx = zmq::Context::new();
    let mut expected = KvIndex::new(
        kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
        BLOCK as u32,
    );
    // Prompt A: 8 full blocks plus 2 tokens; prompt B: 8 blocks.
    let a: Vec<u32> = (0..34).collect();
    let b: Vec<u32> = (1000..1032).collect();

    // Workers 1 and 2 publish before the router starts: it catches up from their replay sockets.
    let mut w1 = Worker::new(&ctx, 1, 0, true);
    let mut w2 = Worker::new(&ctx, 2, 0, true);
    let mut w3 = Worker::new(&ctx, 3, 1, false);
    w1.batch(
        &[
            stored(&a, 0, 4, Tier::Gpu),
            stored(&a, 4, 6, Tier::Host),
            stored(&a, 6, 8, Tier::Disk),
        ],
        false,
        &mut expected,
    );
    w2.batch(&[stored(&a, 0, 2, Tier::Gpu)], false, &mut expected);
    w2.batch(&[stored(&a, 2, 8, Tier::Host)], false, &mut expected);

    // Dynamo's cost and weights, so the costs below can be computed by hand as Dynamo's
    // `worker_logit` computes them (kvbm's default `kv` weighs the prefill term 10).
    let router = RouterProcess::start_with(
        &format!("{};{}", w1.spec(), w2.spec()),
        &["--router-mode", "dynamo"],
    );
    router.wait_applied(&w1, 0);
    router.wait_applied(&w2, 1);
    w1.wait_for_subscriber();
    w2.wait_for_subscriber();

    // Worker 3 (rank 1, no replay socket) registers over HTTP.
    let registered = router.ok(
        "POST",
        "/register",
        Some(json!({ "worker_id": 3, "dp_rank": 1, "endpoint": w3.endpoint })),
    );
    assert_eq!(registered["worker_id"], 3);
    w3.wait_for_subscriber();
    let seq = w3.batch(&[stored(&b, 0, 8, Tier::Gpu)], false, &mut expected);
    router.wait_applied(&w3, seq);

    // Queries: every tier, against the direct computation.
    let answer = check_query(&router, &expected, &a);
    assert_eq!(overlap_of(&answer, 1), (4, 2, 2));
    assert_eq!(overlap_of(&answer, 2), (2, 6, 0));
    assert_eq!(overlap_of(&answer, 3), (0, 0, 0));
    assert_eq!(
        answer["workers"][0]["worker_id"], 1,
        "best GPU overlap first"
    );
    check_query(&router, &expected, &b);
    check_query(&router, &expected, &a[..12]);
    check_query(&router, &expected, &[7, 7, 7, 7, 7]);
    // A different cache salt is a different hash space.
    let salted = router.ok(
        "POST",
        "/query",
        Some(json!({ "token_ids": a, "cache_salt": "tenant-b" })),
    );
    assert_eq!(overlap_of(&salted, 1), (0, 0, 0));

    // Routing: 34 tokens = 8.5 blocks; credit w1 = 4 + 0.75*2 + 0.25*2 = 6, w2 = 2 + 0.75*6 = 6.5.
    let first = router.ok(
        "POST",
        "/route",
        Some(json!({ "token_ids": a, "request_id": "r1" })),
    );
    assert_eq!(
        (first["worker_id"].as_u64(), first["dp_rank"].as_u64()),
        (Some(2), Some(0))
    );
    assert_eq!(first["request_id"], "r1");
    assert!(
        (first["cost"].as_f64().unwrap() - 2.0).abs() < 1e-9,
        "{first}"
    );
    let runner_ups: Vec<(u64, f64)> = first["runner_ups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["worker_id"].as_u64().unwrap(),
                c["cost"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(runner_ups.len(), 2);
    assert_eq!(runner_ups[0].0, 1);
    assert!((runner_ups[0].1 - 2.5).abs() < 1e-9);
    assert!((runner_ups[1].1 - 8.5).abs() < 1e-9);
    assert_eq!(first["overlap"]["host_tokens"], 24);
    // Worker 2 now carries r1's prefill, the prompt less its credit (as Dynamo counts a routed
    // request's `initial_effective_prefill_tokens`): 34 - 6.5 * 4 = 8 tokens; then
    // (8 + 34) / 4 - 6.5 = 4 > 2.5, so worker 1 wins.
    let second = router.ok("POST", "/route", Some(json!({ "token_ids": a })));
    assert_eq!(second["worker_id"], 1);
    assert_eq!(second["request_id"].as_str().unwrap().len(), 32);
    let w2_load = router.worker(2, 0).unwrap()["load"].clone();
    assert_eq!(
        (
            w2_load["prefill_tokens"].as_u64(),
            w2_load["requests"].as_u64()
        ),
        (Some(8), Some(1))
    );
    router.ok("POST", "/first_token", Some(json!({ "request_id": "r1" })));
    let w2_load = router.worker(2, 0).unwrap()["load"].clone();
    assert_eq!(
        (
            w2_load["prefill_tokens"].as_u64(),
            w2_load["decode_blocks"].as_u64()
        ),
        (Some(0), Some(9))
    );
    router.ok("POST", "/finished", Some(json!({ "request_id": "r1" })));
    let (status, error) = router.call("POST", "/finished", Some(json!({ "request_id": "r1" })));
    assert_eq!(status, 404);
    assert!(error["error"].as_str().unwrap().contains("r1"));

    // A forced gap, filled by replay: batch k (removing w1's disk blocks) never goes out live.
    let lost = w1.batch(&[removed(&a, 6, 8, Tier::Disk)], true, &mut expected);
    let next = w1.batch(&[stored(&b, 0, 2, Tier::Host)], false, &mut expected);
    router.wait_applied(&w1, next);
    assert_eq!(lost + 1, next);
    let answer = check_query(&router, &expected, &a);
    assert_eq!(overlap_of(&answer, 1), (4, 2, 0));
    check_query(&router, &expected, &b);
    assert_eq!(router.metric("kv_router_gaps_total{filled=\"true\"}"), 1.0);
    assert_eq!(router.metric("kv_router_replays_total"), 1.0);
    assert_eq!(router.worker(1, 0).unwrap()["resync_needed"], false);

    // A gap without a replay socket: counted, and the worker is marked for a resync.
    w3.batch(&[removed(&b, 7, 8, Tier::Gpu)], true, &mut expected);
    let seq = w3.batch(&[stored(&a, 0, 1, Tier::Disk)], false, &mut expected);
    router.wait_applied(&w3, seq);
    let w3_view = router.worker(3, 1).unwrap();
    assert_eq!(w3_view["resync_needed"], true);
    assert_eq!(w3_view["unfilled_gaps"], 1);
    assert_eq!(router.metric("kv_router_gaps_total{filled=\"false\"}"), 1.0);
    // The lost removal is not known to the router: it still counts block 7 of B.
    assert_eq!(w3_view["blocks"]["gpu"], 8);
    expected.store((3, 1), Tier::Gpu, &[hashes(&b)[7].0]);

    // An engine restart: worker 2's sequence starts again at 0 and its old blocks are dropped.
    w2.restart(&mut expected);
    let seq = w2.batch(&[stored(&a, 0, 1, Tier::Gpu)], false, &mut expected);
    assert_eq!(seq, 0);
    wait_until("worker 2's restart", || {
        router.worker(2, 0).unwrap()["blocks"]["host"] == 0
    });
    router.wait_applied(&w2, 0);
    let answer = check_query(&router, &expected, &a);
    assert_eq!(overlap_of(&answer, 2), (1, 0, 0));
    assert_eq!(router.metric("kv_router_restarts_total"), 1.0);

    // Malformed input: a payload that is not msgpack, a message with two frames, and a removal of
    // blocks never stored. Each is counted; the router keeps serving.
    let garbage = w1.seq;
    w1.seq += 1;
    w1.send(garbage, b"\xc1 this is not msgpack");
    w1.xpub
        .send_multipart([&b"two"[..], &b"frames"[..]], 0)
        .unwrap();
    let seq = w1.batch(&[removed(&b, 5, 7, Tier::Gpu)], false, &mut expected);
    router.wait_applied(&w1, seq);
    assert_eq!(
        router.metric("kv_cache_events_applied{event_type=\"batch\",status=\"decode_error\"}"),
        2.0
    );
    assert_eq!(
        router.metric("kv_cache_events_applied{event_type=\"removed\",status=\"block_not_found\"}"),
        1.0
    );
    assert_eq!(router.metric("kv_router_decode_errors_total"), 2.0);
    assert!(router.metric("kv_cache_events_applied{event_type=\"stored\",status=\"ok\"}") >= 9.0);
    assert_eq!(
        router.metric("kv_router_blocks{dp_rank=\"0\",tier=\"CPU_PINNED\",worker_id=\"1\"}"),
        4.0
    );
    assert_eq!(router.ok("GET", "/healthz", None)["status"], "ok");
    check_query(&router, &expected, &a);
    check_query(&router, &expected, &b);

    // Unregistering forgets the worker.
    router.ok(
        "POST",
        "/unregister",
        Some(json!({ "worker_id": 3, "dp_rank": 1 })),
    );
    assert!(router.worker(3, 1).is_none());
    let answer = router.ok("POST", "/query", Some(json!({ "token_ids": b })));
    assert_eq!(answer["workers"].as_array().unwrap().len(), 2);
    let (status, _) = router.call(
        "POST",
        "/unregister",
        Some(json!({ "worker_id": 3, "dp_rank": 1 })),
    );
    assert_eq!(status, 404);
    assert!(router.metric("kv_router_find_matches_seconds_count") >= 8.0);
}

fn shared_of(answer: &Value, id: u64) -> u64 {
    answer["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == id)
        .unwrap_or_else(|| panic!("worker {id} missing from {answer}"))["overlap"]["shared_blocks"]
        .as_u64()
        .unwrap()
}

/// `--router-shared-pools`: a worker registered over HTTP that has published nothing yet is
/// credited with the blocks another worker wrote to the pool; one of a pool not named is not.
#[test]
fn workers_the_operator_says_reach_a_pool_are_credited_before_they_write_to_it() {
    let ctx = zmq::Context::new();
    let mut expected = KvIndex::new(
        kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
        BLOCK as u32,
    );
    let a: Vec<u32> = (0..32).collect();
    let mut w1 = Worker::new(&ctx, 1, 0, true);
    let w2 = Worker::new(&ctx, 2, 0, false);
    let pooled = |pool: &str, from: usize, to: usize| KvEvent::SharedStored {
        pool: pool.to_owned(),
        stored: match stored(&a, from, to, Tier::Disk) {
            KvEvent::BlockStored(s) => s,
            _ => unreachable!(),
        },
    };
    w1.batch(&[pooled("fleet", 0, 6)], false, &mut expected);
    let router = RouterProcess::start_with(&w1.spec(), &["--router-shared-pools", "fleet"]);
    router.wait_applied(&w1, 0);
    w1.wait_for_subscriber();
    router.ok(
        "POST",
        "/register",
        Some(json!({ "worker_id": 2, "dp_rank": 0, "endpoint": w2.endpoint })),
    );
    w2.wait_for_subscriber();
    let answer = router.ok("POST", "/query", Some(json!({ "token_ids": a })));
    assert_eq!(shared_of(&answer, 1), 6, "{answer}");
    assert_eq!(shared_of(&answer, 2), 6, "{answer}");
    // Blocks in a pool the flag does not name reach only those that wrote to it.
    let seq = w1.batch(&[pooled("other", 0, 8)], false, &mut expected);
    router.wait_applied(&w1, seq);
    let answer = router.ok("POST", "/query", Some(json!({ "token_ids": a })));
    assert_eq!(shared_of(&answer, 1), 8, "{answer}");
    assert_eq!(shared_of(&answer, 2), 6, "{answer}");
    // Unregistered, the worker leaves the pool.
    router.ok(
        "POST",
        "/unregister",
        Some(json!({ "worker_id": 2, "dp_rank": 0 })),
    );
    let answer = router.ok("POST", "/query", Some(json!({ "token_ids": a })));
    assert_eq!(answer["workers"].as_array().unwrap().len(), 1, "{answer}");
}

#[test]
fn bad_requests_get_json_errors_and_the_router_keeps_serving() {
    let router = RouterProcess::start("");
    let post_raw = |path: &str, body: &str| {
        let r = ureq::post(&format!("{}{path}", router.base))
            .set("Content-Type", "application/json")
            .send_string(body);
        let r = match r {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{e}"),
        };
        let status = r.status();
        let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
        assert!(v["error"].is_string(), "{status}: {v}");
        status
    };
    assert_eq!(post_raw("/query", "{not json"), 400);
    assert_eq!(post_raw("/query", r#"{"token_ids": [-1]}"#), 400);
    assert_eq!(post_raw("/query", r#"{"tokens": [1]}"#), 400);
    assert_eq!(post_raw("/first_token", r#"{}"#), 400);
    let huge = format!("{{\"token_ids\": [{}1]}}", "1,".repeat(40_000));
    assert_eq!(post_raw("/query", &huge), 413);
    // No worker yet: nothing to route to.
    assert_eq!(post_raw("/route", r#"{"token_ids": [1, 2, 3, 4]}"#), 503);
    assert_eq!(
        post_raw("/register", r#"{"worker_id": 1, "endpoint": "http://x"}"#),
        400
    );
    assert_eq!(post_raw("/nope", "{}"), 404);
    let (status, v) = router.call("GET", "/route", None);
    assert_eq!((status, v["error"].is_string()), (405, true));
    let empty = router.ok("POST", "/query", Some(json!({ "token_ids": [] })));
    assert_eq!(empty["request_blocks"], 0);
    assert_eq!(router.ok("GET", "/healthz", None)["workers"], 0);
    assert!(router.metric("kv_router_requests_total{code=\"400\",endpoint=\"query\"}") >= 3.0);
}

#[test]
fn a_bad_command_line_is_refused_with_the_flag_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbm-router"))
        .args(["--workers", "1=http://nope", "--http-port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--workers entry"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_kvbm-router"))
        .args(["--router-temperature=-2", "--http-port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--router-temperature=-2"));
    let help = Command::new(env!("CARGO_BIN_EXE_kvbm-router"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--workers",
        "--http-host",
        "--block-size",
        "--router-host-cache-hit-weight",
        "--router-disk-cache-hit-weight",
        "--router-temperature",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn idle_connections_cannot_exhaust_the_router() {
    // 20 connections at most, each closed after 1 s without traffic: 300 idle clients neither
    // exhaust descriptors nor keep /healthz from answering.
    let router = RouterProcess::start_with(
        "",
        &["--max-connections", "20", "--http-idle-timeout-secs", "1"],
    );
    let addr = router.base.trim_start_matches("http://").to_owned();
    let idle: Vec<std::net::TcpStream> = (0..300)
        .filter_map(|_| std::net::TcpStream::connect(&addr).ok())
        .collect();
    assert!(idle.len() > 20);
    let healthy = |r: &RouterProcess| {
        ureq::get(&format!("{}/healthz", r.base))
            .timeout(Duration::from_secs(2))
            .call()
            .is_ok()
    };
    wait_until("/healthz answering beside 300 idle connections", || {
        healthy(&router)
    });
    // The idle ones were closed: by the limit (refused, or evicted for a newcomer), or by the
    // idle timeout.
    wait_until("idle connections closed", || {
        router.metric("kv_router_connections_refused_total")
            + router.metric("kv_router_connections_evicted_total")
            > 0.0
            && router.metric("kv_router_connections_timed_out_total") > 0.0
    });
    drop(idle);
}

#[test]
fn hostile_requests_and_registrations_are_bounded() {
    let ctx = zmq::Context::new();
    let w1 = Worker::new(&ctx, 1, 0, false);
    let router = RouterProcess::start_with(
        &w1.spec(),
        &["--max-workers", "1", "--max-request-id-bytes", "64"],
    );
    // A request id of megabytes is refused (the body limit is 64 KiB here; 1 KiB passes it).
    let long_id = "x".repeat(1024);
    let (status, v) = router.call(
        "POST",
        "/route",
        Some(json!({ "token_ids": [1, 2, 3, 4], "request_id": long_id })),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("request_id"), "{v}");
    // A second worker is one too many.
    let (status, v) = router.call(
        "POST",
        "/register",
        Some(json!({ "worker_id": 2, "endpoint": "tcp://127.0.0.1:1" })),
    );
    assert_eq!(status, 429, "{v}");
    assert_eq!(router.metric("kv_router_workers_refused_total"), 1.0);
    // Re-registering the same worker is not one more.
    router.ok(
        "POST",
        "/register",
        Some(json!({ "worker_id": 1, "endpoint": w1.endpoint })),
    );
}

#[test]
fn a_routing_decision_predicts_its_blocks_until_events_confirm_them() {
    // Two idle workers holding nothing. A first request is routed and finishes (its load is
    // released) before any KV event of it arrives; a sibling sharing its prompt follows. With
    // prediction, the first decision's blocks count as on the chosen worker: the sibling goes
    // there with that overlap (cost 0 against 16). Without, nothing is predicted.
    let ctx = zmq::Context::new();
    let prompt: Vec<u32> = (0..64).collect();
    for (ttl, together) in [("0", false), ("30", true)] {
        let w1 = Worker::new(&ctx, 1, 0, false);
        let w2 = Worker::new(&ctx, 2, 0, false);
        let router = RouterProcess::start_with(
            &format!("{};{}", w1.spec(), w2.spec()),
            &["--router-predicted-ttl-secs", ttl],
        );
        let first = router.ok(
            "POST",
            "/route",
            Some(json!({ "token_ids": prompt, "request_id": "first" })),
        );
        router.ok("POST", "/finished", Some(json!({ "request_id": "first" })));
        let second = router.ok("POST", "/route", Some(json!({ "token_ids": prompt })));
        if !together {
            assert_eq!(second["overlap"]["gpu_blocks"], 0, "{second}");
            assert_eq!(router.metric("kv_router_predicted_blocks"), 0.0);
            continue;
        }
        assert_eq!(
            first["worker_id"], second["worker_id"],
            "{first} / {second}"
        );
        if together {
            assert_eq!(second["overlap"]["gpu_blocks"], 16, "{second}");
            assert!(router.metric("kv_router_predicted_blocks") >= 16.0);
            // Both prompts were routed to it; only the first was expected to be computed.
            let id = first["worker_id"].as_u64().unwrap();
            assert_eq!(router.worker_tokens(id, "routed"), Some(128.0));
            assert_eq!(router.worker_tokens(id, "uncached"), Some(64.0));
            // The chosen worker's own store confirms the blocks (the prediction ends there), so
            // its later eviction is not masked by a guess.
            let mut chosen = if first["worker_id"] == 1 { w1 } else { w2 };
            chosen.wait_for_subscriber();
            let mut expected = KvIndex::new(
                kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
                BLOCK as u32,
            );
            chosen.batch(&[stored(&prompt, 0, 16, Tier::Gpu)], false, &mut expected);
            let seq = chosen.batch(&[removed(&prompt, 0, 16, Tier::Gpu)], false, &mut expected);
            router.wait_applied(&chosen, seq);
            let answer = router.ok("POST", "/query", Some(json!({ "token_ids": prompt })));
            assert_eq!(overlap_of(&answer, chosen.id), (0, 0, 0), "{answer}");
            assert_eq!(router.metric("kv_router_predicted_blocks"), 0.0);
        }
    }
}

#[test]
fn workers_come_and_go_with_the_workers_file() {
    let ctx = zmq::Context::new();
    let w1 = Worker::new(&ctx, 1, 0, false);
    let w2 = Worker::new(&ctx, 2, 0, true);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("workers");
    std::fs::write(&file, format!("# the fleet\n{}\n", w1.spec())).unwrap();
    let router = RouterProcess::start_with("", &["--workers-file", file.to_str().unwrap()]);
    let ids = |r: &RouterProcess| -> Vec<u64> {
        r.ok("GET", "/workers", None)["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["worker_id"].as_u64().unwrap())
            .collect()
    };
    wait_until("worker 1 from the file", || ids(&router) == vec![1]);
    let prompt: Vec<u32> = (0..8).collect();
    router.ok("POST", "/route", Some(json!({ "token_ids": prompt })));
    assert_eq!(router.worker_tokens(1, "routed"), Some(8.0));
    assert_eq!(router.worker_tokens(1, "uncached"), Some(8.0));
    // Edited: worker 2 in, worker 1 out, and its series with it.
    std::fs::write(&file, format!("{}\n", w2.spec().replace(';', "\n"))).unwrap();
    wait_until("worker 2 instead of 1", || ids(&router) == vec![2]);
    assert_eq!(router.worker_tokens(1, "routed"), None);
    assert_eq!(router.worker_tokens(1, "uncached"), None);
    // Its HTTP server named: the same registration, now with a URL for the OpenAI front end.
    std::fs::write(
        &file,
        format!(
            "{},http=http://127.0.0.1:9/\n",
            w2.spec().replace(';', "\n")
        ),
    )
    .unwrap();
    wait_until("worker 2's HTTP server", || {
        router.ok("GET", "/workers", None)["workers"][0]["http_url"] == "http://127.0.0.1:9"
    });
    // A half-edited file changes nothing and is counted.
    std::fs::write(&file, "2=tcp://127.0.0.1:1\nnot a worker\n").unwrap();
    wait_until("the bad file counted", || {
        router.metric("kv_router_workers_file_errors_total") >= 1.0
    });
    assert_eq!(ids(&router), vec![2]);
}

impl Worker {
    /// Every subscription reaches the test, even a second router's to the same topic.
    fn verbose(&self) {
        self.xpub.set_xpub_verbose(true).unwrap();
    }

    /// Drops subscription messages already received.
    fn drain_subscriptions(&self) {
        while self.xpub.poll(zmq::POLLIN, 0).unwrap() > 0 {
            let _ = self.xpub.recv_bytes(0);
        }
    }

    /// The replay buffer forgets batches before `seq`, as an engine's bounded buffer does.
    fn forget_before(&self, seq: u64) {
        self.buffer.lock().unwrap().retain(|(s, _)| *s >= seq);
    }
}

#[test]
fn a_restarted_replica_recovers_from_its_sibling_and_answers_alike() {
    // Two router replicas follow the same two workers, each subscribed directly (no broker).
    // One is killed mid-stream; the workers' replay buffers then forget their first batches, so
    // replay from 0 cannot rebuild it. Restarted with --bootstrap-from its sibling, it takes the
    // sibling's dump, follows each worker from the dump's sequence number, and after catching up
    // answers every query as the sibling does.
    let ctx = zmq::Context::new();
    let mut expected = KvIndex::new(
        kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
        BLOCK as u32,
    );
    let a: Vec<u32> = (0..40).collect();
    let b: Vec<u32> = (5000..5040).collect();
    let c: Vec<u32> = (0..16).chain(9000..9024).collect();
    let mut w1 = Worker::new(&ctx, 1, 0, true);
    let mut w2 = Worker::new(&ctx, 2, 0, true);
    w1.verbose();
    w2.verbose();
    let spec = format!("{};{}", w1.spec(), w2.spec());
    let r1 = RouterProcess::start(&spec);
    let r2 = RouterProcess::start(&spec);
    for w in [&w1, &w2] {
        w.wait_for_subscriber();
        w.wait_for_subscriber();
    }
    w1.batch(&[stored(&a, 0, 10, Tier::Gpu)], false, &mut expected);
    w1.batch(&[stored(&a, 0, 6, Tier::Host)], false, &mut expected);
    let s2 = w2.batch(&[stored(&b, 0, 10, Tier::Gpu)], false, &mut expected);
    r2.wait_applied(&w2, s2);
    drop(r2);
    // Meanwhile, without the killed replica.
    w1.batch(&[removed(&a, 6, 10, Tier::Gpu)], false, &mut expected);
    let s1 = w1.batch(
        &[stored(&c, 0, 4, Tier::Gpu), stored(&c, 4, 10, Tier::Disk)],
        false,
        &mut expected,
    );
    let s2 = w2.batch(&[removed(&b, 8, 10, Tier::Gpu)], false, &mut expected);
    r1.wait_applied(&w1, s1);
    r1.wait_applied(&w2, s2);
    w1.forget_before(s1);
    w2.forget_before(s2);
    for w in [&w1, &w2] {
        w.drain_subscriptions();
    }
    let r2 = RouterProcess::start_with("", &["--bootstrap-from", &r1.base]);
    for w in [&w1, &w2] {
        w.wait_for_subscriber();
    }
    // The stream goes on; both replicas take it.
    let s1 = w1.batch(
        &[removed(&a, 0, 3, Tier::Host), stored(&c, 4, 6, Tier::Gpu)],
        false,
        &mut expected,
    );
    let s2 = w2.batch(&[stored(&b, 0, 10, Tier::Host)], false, &mut expected);
    for r in [&r1, &r2] {
        r.wait_applied(&w1, s1);
        r.wait_applied(&w2, s2);
    }
    for prompt in [&a[..], &b[..], &c[..], &a[..12], &c[..20]] {
        let one = check_query(&r1, &expected, prompt);
        let two = check_query(&r2, &expected, prompt);
        assert_eq!(
            one["workers"], two["workers"],
            "the replicas disagree on {prompt:?}"
        );
    }
    for w in r2.ok("GET", "/workers", None)["workers"]
        .as_array()
        .unwrap()
    {
        assert_eq!(w["resync_needed"], false, "{w}");
        assert_eq!(w["link"]["state"], "connected", "{w}");
    }
    // Both replicas dump the same index, in either form (the restart above read the msgpack one,
    // which `--bootstrap-from` asks for).
    let get_dump = |r: &RouterProcess, accept: Option<&str>, query: &str| {
        let mut request = ureq::get(&format!("{}/dump{query}", r.base));
        if let Some(a) = accept {
            request = request.set("Accept", a);
        }
        let response = request.call().unwrap();
        let media = response.content_type().to_owned();
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut response.into_reader(), &mut bytes).unwrap();
        let parsed = if media == dump::MSGPACK_MEDIA_TYPE {
            dump::read_msgpack(&bytes[..], BLOCK, 1 << 20)
        } else {
            assert_eq!(media, dump::NDJSON_MEDIA_TYPE);
            dump::read(&bytes[..], BLOCK, 1 << 20)
        };
        let mut parsed = parsed.unwrap();
        // Compare what the index holds, in one order.
        parsed
            .workers
            .sort_by_key(|(w, _)| (w.worker_id, w.dp_rank));
        for (w, snap) in &mut parsed.workers {
            w.last_seq = None;
            snap.names.sort_by_key(|n| n.engine);
            snap.holdings.sort_by_key(|h| (h.tier.index(), h.hash));
        }
        (media, parsed)
    };
    let (media, reference) = get_dump(&r1, None, "");
    assert_eq!(media, dump::NDJSON_MEDIA_TYPE);
    assert_eq!(reference.workers.len(), 2);
    for (r, accept, query) in [
        (&r1, Some("application/msgpack"), ""),
        (&r2, Some("text/html, application/msgpack;q=0.9"), ""),
        (&r2, None, "?format=msgpack"),
        (&r2, Some("application/msgpack"), "?format=ndjson"),
    ] {
        let (media, parsed) = get_dump(r, accept, query);
        let want = if query == "?format=ndjson" {
            dump::NDJSON_MEDIA_TYPE
        } else {
            dump::MSGPACK_MEDIA_TYPE
        };
        assert_eq!(media, want, "{accept:?} {query}");
        assert_eq!(parsed, reference, "{accept:?} {query}");
    }
    assert_eq!(r1.call("GET", "/dump?format=xml", None).0, 400);
}

#[test]
fn an_unreachable_worker_shows_as_such_and_is_not_routed_to() {
    let ctx = zmq::Context::new();
    let live = Worker::new(&ctx, 1, 0, false);
    // A port nobody listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let router = RouterProcess::start(&format!("{};2=tcp://127.0.0.1:{dead}", live.spec()));
    let state = |id: u64| router.worker(id, 0).unwrap()["link"]["state"].clone();
    wait_until("the dead worker's link retrying", || state(2) == "retrying");
    wait_until("the live worker's link connected", || {
        state(1) == "connected"
    });
    for _ in 0..20 {
        let r = router.ok(
            "POST",
            "/route",
            Some(json!({ "token_ids": [1, 2, 3, 4, 5] })),
        );
        assert_eq!(r["worker_id"], 1, "{r}");
    }
}

#[test]
fn a_vllm_worker_publishing_its_own_hashes_is_routed_to() {
    // A vLLM worker's events carry its prefix-cache hashes (SHA-256 based by default), never the
    // router's: here a chain from another function, on the GPU and, after CPU offloading, the
    // same hashes in host memory; then the GPU copies are evicted. /query must answer as an index
    // fed the router's own hashes for the same blocks.
    let ctx = zmq::Context::new();
    let mut w = Worker::new(&ctx, 5, 0, true);
    let tokens: Vec<u32> = (300..340).collect(); // 10 blocks
    let engine: Vec<SequenceHash> = {
        let mut last = 0u64;
        tokens
            .chunks(BLOCK)
            .map(|b| {
                let mut bytes = last.to_be_bytes().to_vec();
                bytes.extend(b.iter().flat_map(|t| t.to_be_bytes()));
                last = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 0xabcdef);
                SequenceHash(last)
            })
            .collect()
    };
    let stored_engine = |from: usize, to: usize, tier: Tier| {
        KvEvent::BlockStored(BlockStored {
            tier,
            block_hashes: engine[from..to].to_vec(),
            parent_hash: from.checked_sub(1).map(|p| engine[p]),
            token_ids: tokens[from * BLOCK..to * BLOCK].to_vec(),
            block_size: BLOCK as u32,
            lora_name: None,
        })
    };
    let router = RouterProcess::start(&w.spec());
    w.wait_for_subscriber();
    let mut translated = KvIndex::new(
        kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
        BLOCK as u32,
    );
    w.batch(
        &[
            stored_engine(0, 6, Tier::Gpu),
            stored_engine(6, 10, Tier::Gpu),
        ],
        false,
        &mut translated,
    );
    w.batch(&[stored_engine(0, 8, Tier::Host)], false, &mut translated);
    let seq = w.batch(
        &[KvEvent::BlockRemoved(BlockRemoved {
            tier: Tier::Gpu,
            block_hashes: engine[3..].iter().rev().copied().collect(),
        })],
        false,
        &mut translated,
    );
    router.wait_applied(&w, seq);
    // The direct index: the router's own hashes of the same blocks, same operations.
    let ours: Vec<u64> = hashes(&tokens).iter().map(|h| h.0).collect();
    let mut direct = KvIndex::new(
        kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
        BLOCK as u32,
    );
    direct.store((5, 0), Tier::Gpu, &ours);
    direct.store((5, 0), Tier::Host, &ours[..8]);
    direct.remove((5, 0), Tier::Gpu, &ours[3..]);
    let answer = check_query(&router, &direct, &tokens);
    assert_eq!(overlap_of(&answer, 5), (3, 5, 0));
    assert_eq!(
        router.metric("kv_cache_events_applied{event_type=\"stored\",status=\"ok\"}"),
        3.0
    );
}

#[test]
fn a_hybrid_vllm_worker_is_routed_as_its_cache_would_hit() {
    // vLLM 0.33's own KVCacheManager with its hybrid KV cache manager (gpt-oss shape: group 0
    // sliding window 128, group 1 full attention), its batches as its publisher sent them
    // (tests/data/hybrid/generate.py). After the whole stream, /query answers each probe with
    // the blocks vLLM's own cache hits, and the groups' events are counted by kind.
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hybrid/gpt-oss.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let block = doc["block_size"].as_u64().unwrap() as usize;
    let payloads: Vec<Vec<u8>> = doc["batches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            let h = h.as_str().unwrap();
            (0..h.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
                .collect()
        })
        .collect();
    let ctx = zmq::Context::new();
    let w = Worker::new(&ctx, 11, 0, false);
    let router = RouterProcess::start_sized(&w.spec(), block, &[]);
    w.wait_for_subscriber();
    let mut by_kind = std::collections::BTreeMap::new();
    for (seq, payload) in payloads.iter().enumerate() {
        w.send(seq as u64, payload);
        for e in decode_batch(payload).unwrap().events {
            let (kind, ty) = match e {
                WireEvent::Stored { group_kind, .. } => (group_kind.unwrap(), "stored"),
                WireEvent::Removed { group, .. } => (
                    doc["groups"][group.unwrap() as usize]["kind"]
                        .as_str()
                        .map(GroupKind::from_name)
                        .unwrap(),
                    "removed",
                ),
                WireEvent::Cleared => unreachable!(),
            };
            *by_kind.entry((kind.name(), ty)).or_insert(0u64) += 1;
        }
    }
    router.wait_applied(&w, payloads.len() as u64 - 1);
    let last = doc["checkpoints"].as_array().unwrap().last().unwrap();
    assert_eq!(last["batches"].as_u64(), Some(payloads.len() as u64));
    let mut hits = 0;
    let probes = doc["probes"].as_array().unwrap();
    let vllm_hits = last["vllm_hit_tokens"].as_array().unwrap();
    for (tokens, vllm) in probes.iter().zip(vllm_hits) {
        let answer = router.ok("POST", "/query", Some(json!({ "token_ids": tokens })));
        let gpu = answer["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == 11)
            .map_or(0, |w| w["overlap"]["gpu_blocks"].as_u64().unwrap());
        let vllm = vllm.as_u64().unwrap();
        assert_eq!(gpu * block as u64, vllm, "{answer}");
        hits += u64::from(vllm > 0);
    }
    assert!(hits > 0);
    let metrics = router.call("GET", "/metrics", None).1;
    let counted = |kind: &str, ty: &str| -> f64 {
        metrics
            .as_str()
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("kv_router_events_by_group_kind_total{"))
            .filter(|l| l.contains(&format!("kind=\"{kind}\"")))
            .find(|l| l.contains(&format!("event_type=\"{ty}\"")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    assert!(by_kind.len() >= 4, "{by_kind:?}");
    for ((kind, ty), n) in by_kind {
        assert_eq!(counted(kind, ty), n as f64, "{kind} {ty}");
    }
    for status in ["malformed", "block_not_found", "parent_unknown"] {
        assert_eq!(
            router.metric(&format!(
                "kv_cache_events_applied{{event_type=\"stored\",status=\"{status}\"}}"
            )),
            0.0
        );
    }
}

/// The hard open-files limit (RLIMIT_NOFILE) of this process, which the router started from it
/// inherits; None where it cannot be read.
fn hard_open_files_limit() -> Option<u64> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(_, hard)| hard)
}

/// Whether the hard open-files limit allows `needed` files; if not, says why the test (or its
/// part) is skipped.
fn open_files_allow(test: &str, needed: u64) -> bool {
    match hard_open_files_limit() {
        Some(hard) if hard >= needed => true,
        hard => {
            eprintln!(
                "skipping {test}: it needs a hard open-files limit (ulimit -Hn) of at least \
                 {needed}, this machine's is {hard:?}"
            );
            false
        }
    }
}

/// Open file descriptors of a process.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Registering, re-registering and unregistering workers many times over (far beyond the 341
/// registrations after which every ZMQ socket of the context used to be taken, since
/// unregistering never freed a worker's sockets) leaves the router's open files and sockets as
/// they were; then as many workers as the default --max-workers allows can be registered at once.
#[test]
fn registrations_release_their_sockets_and_max_workers_is_reachable() {
    let ctx = zmq::Context::new();
    let w = Worker::new(&ctx, 1, 0, false);
    let router = RouterProcess::start(&w.spec());
    w.wait_for_subscriber();
    let pid = router.child.id();
    let register = |id: u64| {
        router.ok(
            "POST",
            "/register",
            Some(json!({ "worker_id": id, "endpoint": w.endpoint })),
        )
    };
    let unregister = |id: u64| {
        router.ok(
            "POST",
            "/unregister",
            Some(json!({ "worker_id": id, "dp_rank": 0 })),
        )
    };
    let sockets = || router.metric("kv_router_subscriber_sockets ");
    let (fds_before, sockets_before) = (open_fds(pid), sockets());
    for round in 0..400 {
        let id = 100 + round % 7;
        register(id);
        // The same worker again: its old sockets are freed, not kept.
        register(id);
        unregister(id);
        // Re-registering the first worker replaces its subscription too.
        if round % 2 == 0 {
            register(1);
        }
    }
    // 1,000 registrations. ZMQ frees closed sockets asynchronously: wait for it.
    wait_until("the open files to come back", || {
        open_fds(pid) <= fds_before + 8
    });
    assert_eq!(
        sockets_before, 3.0,
        "one worker: its SUB socket and its monitor's two"
    );
    assert_eq!(sockets(), sockets_before);
    register(2);
    unregister(2);
    // The default --max-workers, all at once: the router raises its soft limit up to the hard
    // one for them, which a machine with a tight hard limit does not allow.
    let max = kvbm_router::config::MAX_WORKERS_DEFAULT;
    let needed = kvbm_router::state::FDS_RESERVED
        + kvbm_router::config::MAX_CONNECTIONS_DEFAULT as u64
        + max as u64 * kvbm_router::state::FDS_PER_WORKER;
    if !open_files_allow("the default --max-workers part", needed) {
        return;
    }
    assert_eq!(router.metric("kv_router_max_workers "), max as f64);
    let fleet: Vec<u64> = (1000..1000 + max as u64 - 1).collect();
    // Four clients at a time, to keep the test short.
    let each = |f: &(dyn Fn(u64) -> Value + Sync)| {
        std::thread::scope(|scope| {
            for part in fleet.chunks(fleet.len().div_ceil(4)) {
                scope.spawn(move || part.iter().for_each(|&id| drop(f(id))));
            }
        });
    };
    each(&register);
    assert_eq!(router.metric("kv_router_workers "), max as f64);
    let (status, v) = router.call(
        "POST",
        "/register",
        Some(json!({ "worker_id": 5000, "endpoint": w.endpoint })),
    );
    assert_eq!(status, 429, "{v}");
    assert_eq!(sockets(), 3.0 * max as f64);
    each(&unregister);
    wait_until("the open files to come back after the fleet", || {
        open_fds(pid) <= fds_before + 8
    });
    assert_eq!(sockets(), sockets_before);
}

impl Worker {
    /// A new process of the same worker on the same endpoint (no replay socket), its sequence
    /// starting at `seq`.
    fn rebound(ctx: &zmq::Context, id: u64, endpoint: &str, seq: u64) -> Self {
        let xpub = ctx.socket(zmq::XPUB).unwrap();
        xpub.set_linger(0).unwrap();
        let deadline = Instant::now() + WAIT;
        // The old process's port is free once its socket is closed (ZMQ closes asynchronously).
        while let Err(e) = xpub.bind(endpoint) {
            assert!(Instant::now() < deadline, "rebinding {endpoint}: {e}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self {
            id,
            rank: 0,
            xpub,
            endpoint: endpoint.to_owned(),
            replay: None,
            buffer: Arc::default(),
            stop: Arc::new(AtomicBool::new(false)),
            server: None,
            seq,
        }
    }
}

/// A worker whose event link went down and up again (its process may have been replaced on the
/// same endpoint) is not credited with its blocks until its first batch over the new link says
/// whether it is the same process (sequence continues: blocks count again) or a new one
/// (sequence below the expected number, even within the duplicate window: blocks dropped). It
/// stays routable by load meanwhile.
#[test]
fn a_worker_back_on_its_endpoint_is_not_credited_until_its_sequence_says_who_it_is() {
    let ctx = zmq::Context::new();
    let mut w = Worker::new(&ctx, 1, 0, false);
    let other = Worker::new(&ctx, 2, 0, false);
    let router = RouterProcess::start(&format!("{};{}", w.spec(), other.spec()));
    w.wait_for_subscriber();
    other.wait_for_subscriber();
    let tokens: Vec<u32> = (0..(4 * BLOCK) as u32).collect();
    let mut expected = KvIndex::new(1 << 20, BLOCK as u32);
    w.batch(&[stored(&tokens, 0, 3, Tier::Gpu)], false, &mut expected);
    w.batch(&[stored(&tokens, 3, 4, Tier::Host)], false, &mut expected);
    router.wait_applied(&w, 1);
    let query = || router.ok("POST", "/query", Some(json!({ "token_ids": tokens })));
    assert_eq!(overlap_of(&query(), 1), (3, 1, 0));
    let suspended = |r: &RouterProcess| {
        r.worker(1, 0)
            .is_some_and(|v| v["claims_suspended"] == true && v["link"]["state"] == "connected")
    };

    // The link goes down and comes back; the publisher continues its sequence (the same
    // process, as after a network cut).
    let endpoint = w.endpoint.clone();
    let seq = w.seq;
    drop(w);
    let mut w = Worker::rebound(&ctx, 1, &endpoint, seq);
    w.wait_for_subscriber();
    wait_until("worker 1's claims suspended while its link is up", || {
        suspended(&router)
    });
    assert_eq!(overlap_of(&query(), 1), (0, 0, 0));
    assert_eq!(router.metric("kv_router_claims_suspended "), 1.0);
    assert_eq!(router.metric("kv_router_claim_suspensions_total "), 1.0);
    // A sibling bootstrapping now would get none of its blocks, and follow it from the start.
    let response = ureq::get(&format!("{}/dump", router.base)).call().unwrap();
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut response.into_reader(), &mut bytes).unwrap();
    let dumped = dump::read(&bytes[..], BLOCK, 1 << 20).unwrap();
    let (info, snapshot) = dumped
        .workers
        .iter()
        .find(|(w, _)| w.worker_id == 1)
        .unwrap();
    assert_eq!((info.last_seq, snapshot.holdings.len()), (None, 0));
    // Routable by load: with no blocks to go by, it may be chosen.
    let (status, _) = router.call("POST", "/route", Some(json!({ "token_ids": tokens })));
    assert_eq!(status, 200);
    w.batch(&[removed(&tokens, 3, 4, Tier::Host)], false, &mut expected);
    router.wait_applied(&w, 2);
    let v = router.worker(1, 0).unwrap();
    assert_eq!(v["claims_suspended"], false, "{v}");
    assert_eq!(
        overlap_of(&check_query(&router, &expected, &tokens), 1),
        (3, 0, 0)
    );
    assert_eq!(router.metric("kv_router_claims_suspended "), 0.0);

    // Now a new process on the endpoint: its first batch seen is numbered 1 (its batch 0 went
    // before the router was connected), below the expected 3 but within the duplicate window.
    drop(w);
    let mut w = Worker::rebound(&ctx, 1, &endpoint, 1);
    w.wait_for_subscriber();
    wait_until("worker 1's claims suspended again", || suspended(&router));
    assert_eq!(overlap_of(&query(), 1), (0, 0, 0));
    assert_eq!(router.metric("kv_router_claim_suspensions_total "), 2.0);
    w.restart(&mut expected);
    w.seq = 1;
    w.batch(&[stored(&tokens, 0, 1, Tier::Gpu)], false, &mut expected);
    router.wait_applied(&w, 1);
    let v = router.worker(1, 0).unwrap();
    assert_eq!(v["claims_suspended"], false, "{v}");
    // The old process's blocks are gone; the new one's single block counts.
    assert_eq!(
        overlap_of(&check_query(&router, &expected, &tokens), 1),
        (1, 0, 0)
    );
    assert!(router.metric("kv_router_restarts_total ") >= 1.0);
    assert_eq!(overlap_of(&query(), 2), (0, 0, 0));
}

/// A frame over ZMQ's size bound (the subscriber's `ZMQ_MAXMSGSIZE`: twice the 16 MiB payload
/// limit plus 64 KiB) makes ZMQ drop the connection without saying why; it is counted as
/// oversized, the router connects again, and the worker's later batches apply.
#[test]
fn a_frame_over_zmqs_bound_is_counted_as_oversized_and_later_batches_apply() {
    let ctx = zmq::Context::new();
    let mut w = Worker::new(&ctx, 1, 0, false);
    w.xpub.set_xpub_verbose(true).unwrap();
    let router = RouterProcess::start(&w.spec());
    w.wait_for_subscriber();
    let tokens: Vec<u32> = (0..(4 * BLOCK) as u32).collect();
    let mut expected = KvIndex::new(1 << 20, BLOCK as u32);
    w.batch(&[stored(&tokens, 0, 2, Tier::Gpu)], false, &mut expected);
    router.wait_applied(&w, 0);
    let oversized = r#"kv_router_subscriber_total{what="oversized"} "#;
    assert_eq!(router.metric(oversized), 0.0);
    let bound = kvbm_events::SubscriberOptions::default().zmq_max_message_bytes() as usize;
    let seq = w.seq;
    w.seq += 1;
    w.send(seq, &vec![0u8; bound + 1]);
    wait_until("the refused frame to be counted", || {
        router.metric(oversized) >= 1.0
    });
    // Connected again (the verbose XPUB passes the new connection's subscription on even if
    // the old one's is not gone yet): the next batch applies (the refused one shows as a gap).
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            w.xpub.poll(zmq::POLLIN, left.as_millis() as i64).unwrap() > 0,
            "the router never subscribed again"
        );
        if w.xpub.recv_bytes(0).unwrap().first() == Some(&1) {
            break;
        }
    }
    w.batch(&[stored(&tokens, 2, 3, Tier::Gpu)], false, &mut expected);
    router.wait_applied(&w, seq + 1);
    assert_eq!(
        overlap_of(&check_query(&router, &expected, &tokens), 1),
        (3, 0, 0)
    );
    assert_eq!(router.metric(oversized), 1.0);
    assert_eq!(
        router.metric(r#"kv_router_gaps_total{filled="false"} "#),
        1.0
    );
}

/// Under an open-files limit too low for --max-workers (hard limit 2,048 here), the router
/// lowers --max-workers to what fits, says so in /metrics, and refuses registrations beyond it.
#[test]
fn max_workers_is_lowered_to_what_the_open_files_limit_holds() {
    // `ulimit -n 2048` sets the hard limit too: only possible below the current hard limit.
    if !open_files_allow(
        "max_workers_is_lowered_to_what_the_open_files_limit_holds",
        2048,
    ) {
        return;
    }
    let child = Command::new("sh")
        .args([
            "-c",
            "ulimit -n 2048 && exec \"$0\" \"$@\"",
            env!("CARGO_BIN_EXE_kvbm-router"),
            "--http-port",
            "0",
            "--max-connections",
            "64",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let router = RouterProcess::listening(child);
    // (2048 - 256 reserved - 64 connections) / 16 files per worker.
    let fit = (2048 - 256 - 64) / 16;
    assert_eq!(router.metric("kv_router_max_workers "), fit as f64);
    assert_eq!(router.metric("kv_router_open_files_limit "), 2048.0);
    for id in 0..fit {
        router.ok(
            "POST",
            "/register",
            Some(json!({ "worker_id": id, "endpoint": "tcp://127.0.0.1:1" })),
        );
    }
    let (status, v) = router.call(
        "POST",
        "/register",
        Some(json!({ "worker_id": fit, "endpoint": "tcp://127.0.0.1:1" })),
    );
    assert_eq!(status, 429, "{v}");
    assert!(v.to_string().contains("--max-workers"), "{v}");
}

/// The OpenAI front end's prefix probe (issue 25, the front end's CPU per request), on a router
/// following two workers over ZMQ: tokenizing stops where no worker holds every block so far,
/// and also where exactly one does and the fixed-weight cost would pick it already (the rest of
/// the prompt can only add to its overlap); it goes on while two hold the blocks, while the one
/// that does is loaded enough to lose at the overlap seen so far, and in a mode whose pick is
/// not a cost (round robin).
/// An in-process router following `workers` (rank 0) with `selector`, for prefix-probe tests.
fn probe_router(
    selector: kvbm_events::router::SelectorConfig,
    workers: &[&Worker],
) -> kvbm_router::Router {
    let specs = workers
        .iter()
        .map(|w| kvbm_router::config::WorkerSpec {
            events: kvbm_events::WorkerEndpoint {
                worker_id: w.id,
                dp_rank: 0,
                endpoint: w.endpoint.clone(),
                replay: None,
            },
            // Never called: the probe only asks which worker has one.
            http: Some("http://127.0.0.1:9".into()),
        })
        .collect();
    let config = kvbm_router::RouterConfig {
        block_size: BLOCK,
        selector,
        ..kvbm_router::RouterConfig::default()
    };
    kvbm_router::Router::start(config, specs).unwrap()
}

#[test]
fn the_prefix_probe_stops_where_the_pick_is_already_sure() {
    use kvbm_events::router::{RouterMode, SelectorConfig};
    use kvbm_router::state::RequestTokens;
    use kvbm_router::Router;

    let ctx = zmq::Context::new();
    let mut expected = KvIndex::new(
        kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
        BLOCK as u32,
    );
    let a: Vec<u32> = (0..16 * BLOCK as u32).collect();
    let start = |mode: RouterMode, workers: &[&Worker]| {
        probe_router(SelectorConfig::for_mode(mode), workers)
    };
    let mut w1 = Worker::new(&ctx, 1, 0, false);
    let mut w2 = Worker::new(&ctx, 2, 0, false);
    let router = start(RouterMode::Kv, &[&w1, &w2]);
    w1.wait_for_subscriber();
    w2.wait_for_subscriber();
    // Worker 1 holds all 16 blocks of `a`, worker 2 its first 4.
    w1.batch(&[stored(&a, 0, 16, Tier::Gpu)], false, &mut expected);
    w2.batch(&[stored(&a, 0, 4, Tier::Gpu)], false, &mut expected);
    let applied = |router: &Router| {
        let q = router.query(&RequestTokens {
            token_ids: &a,
            untokenized_tokens: 0,
            lora_name: None,
            cache_salt: None,
        });
        let gpu = |id: u64| {
            q.workers
                .iter()
                .find(|w| w.worker_id == id)
                .map_or(0, |w| w.overlap.gpu_blocks)
        };
        (gpu(1), gpu(2))
    };
    let deadline = Instant::now() + WAIT;
    while applied(&router) != (16, 4) {
        assert!(Instant::now() < deadline, "events not applied");
        std::thread::sleep(Duration::from_millis(10));
    }
    // At most this many tokens follow the probed ones (the tokenizer's bound for the rest).
    let rest = 8 * BLOCK;
    let mut probe = router.prefix_probe(None, None);
    // Both hold the first 4 blocks, idle: a tie, tokenizing goes on.
    assert!(probe.worth_more(&a[..4 * BLOCK], rest));
    // Past them only worker 1 does, idle: it would be picked, tokenizing stops.
    assert!(!probe.worth_more(&a[..8 * BLOCK], rest));
    // Where only the overlap's reach counts, it would have gone on.
    assert!(router.prefix_probe(None, None).holds_all(&a[..8 * BLOCK]));
    // Blocks nobody holds: stop.
    let b: Vec<u32> = (1000..1000 + 8 * BLOCK as u32).collect();
    assert!(!router.prefix_probe(None, None).worth_more(&b, rest));
    // Worker 1 queued with a long prefill (over 100,000 tokens): at 8 blocks of overlap it
    // loses to worker 2. If up to 200,000 tokens may follow, its overlap could make up for it,
    // so the rest must be tokenized; if at most 8 blocks do, it cannot, and tokenizing stops.
    // Where both hold every block so far (4), worker 2 wins and worker 1 cannot catch up with
    // the rest either: stop.
    let long: Vec<u32> = (5000..5000 + 4 * BLOCK as u32).collect();
    router
        .route_among(
            &RequestTokens {
                token_ids: &long,
                untokenized_tokens: 100_000,
                lora_name: None,
                cache_salt: None,
            },
            None,
            |k| k == (1, 0),
            false,
        )
        .unwrap();
    assert!(router
        .prefix_probe(None, None)
        .worth_more(&a[..8 * BLOCK], 200_000));
    assert!(!router
        .prefix_probe(None, None)
        .worth_more(&a[..8 * BLOCK], rest));
    assert!(!router
        .prefix_probe(None, None)
        .worth_more(&a[..4 * BLOCK], rest));
    let metrics = router.render_metrics();
    for (answer, n) in [
        ("several_holders", 1),
        ("sure_pick", 1),
        ("no_holder", 1),
        ("holder_not_picked", 1),
        ("holders_outweighed", 2),
        ("pick_uncertain", 0),
    ] {
        let line = format!("kv_router_frontend_probe_answers_total{{answer=\"{answer}\"}} {n}");
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    drop(router);

    // Round robin's pick is not a cost: the probe never stops at a sole holder.
    let (mut w1, mut w2) = (
        Worker::new(&ctx, 1, 0, false),
        Worker::new(&ctx, 2, 0, false),
    );
    let router = start(RouterMode::RoundRobin, &[&w1, &w2]);
    w1.wait_for_subscriber();
    w2.wait_for_subscriber();
    w1.batch(&[stored(&a, 0, 16, Tier::Gpu)], false, &mut expected);
    w2.batch(&[stored(&a, 0, 4, Tier::Gpu)], false, &mut expected);
    let deadline = Instant::now() + WAIT;
    while applied(&router) != (16, 4) {
        assert!(Instant::now() < deadline, "events not applied");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(router
        .prefix_probe(None, None)
        .worth_more(&a[..8 * BLOCK], 8 * BLOCK));
}

#[test]
fn the_balance_term_sends_new_prompts_where_less_work_was_stored_lately() {
    // Worker 1 reports 16 blocks (64 tokens) stored on its GPU, 8 in pinned host memory (not
    // work the GPU did), then those 8 on its GPU (loaded from host, not computed); worker 2
    // reports nothing. Its recent work, 64 tokens, shows on the metrics page.
    // With --router-balance-weight 0.5, each token of it above worker 2's counts as half a
    // queued prefill token: 10 * 0.5 * 64 / 4 = 80 on worker 1's cost, for prompts no worker
    // holds a quarter of the prompt more of than the other. A 16-block prompt no worker holds
    // goes to worker 2 (160 against 160 + 80); one sharing 2 blocks with worker 1's too
    // (160 against 140 + 80); one sharing 4 blocks, a quarter, stays with its cache (120 against
    // 160: the term is left out) as does the prompt worker 1 holds whole (0 against 160).
    // Without the term, worker 1 gets both shared prompts and the new ones' ties are broken at
    // random, both workers getting some.
    let ctx = zmq::Context::new();
    let held: Vec<u32> = (0..64).collect();
    let other: Vec<u32> = (1000..1032).collect();
    let sharing = |blocks: usize| -> Vec<u32> {
        let mut p = held[..blocks * BLOCK].to_vec();
        p.extend((0..(64 - blocks * BLOCK) as u32).map(|t| 50_000 + t));
        p
    };
    for weight in ["0.5", "0"] {
        let mut w1 = Worker::new(&ctx, 1, 0, false);
        let w2 = Worker::new(&ctx, 2, 0, false);
        let router = RouterProcess::start_with(
            &format!("{};{}", w1.spec(), w2.spec()),
            &["--router-balance-weight", weight],
        );
        w1.wait_for_subscriber();
        let mut expected = KvIndex::new(
            kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
            BLOCK as u32,
        );
        w1.batch(&[stored(&held, 0, 16, Tier::Gpu)], false, &mut expected);
        w1.batch(&[stored(&other, 0, 8, Tier::Host)], false, &mut expected);
        let seq = w1.batch(&[stored(&other, 0, 8, Tier::Gpu)], false, &mut expected);
        router.wait_applied(&w1, seq);
        // 64 tokens, decayed for well under a half-life (60 s).
        let work =
            router.metric("kv_router_worker_recent_work_tokens{dp_rank=\"0\",worker_id=\"1\"}");
        assert!(work > 32.0 && work <= 64.0, "{work}");
        assert_eq!(
            router.metric("kv_router_worker_recent_work_tokens{dp_rank=\"0\",worker_id=\"2\"}"),
            0.0
        );
        // Routes a prompt and reports it finished, so that every prompt meets the same loads.
        let route = |prompt: &[u32]| -> u64 {
            let answer = router.ok("POST", "/route", Some(json!({ "token_ids": prompt })));
            router.ok(
                "POST",
                "/finished",
                Some(json!({ "request_id": answer["request_id"] })),
            );
            answer["worker_id"].as_u64().unwrap()
        };
        let new_prompts_to: std::collections::BTreeSet<u64> = (0..20u32)
            .map(|i| route(&(0..64).map(|t| 10_000 + i * 100 + t).collect::<Vec<u32>>()))
            .collect();
        let balanced = weight != "0";
        assert_eq!(
            route(&sharing(2)),
            if balanced { 2 } else { 1 },
            "2 blocks shared"
        );
        assert_eq!(route(&sharing(4)), 1, "4 blocks shared");
        assert_eq!(route(&held), 1);
        if balanced {
            assert_eq!(new_prompts_to, [2].into(), "{new_prompts_to:?}");
        } else {
            // Two workers chosen at random 20 times: one alone is a 1 in 500,000 chance.
            assert_eq!(new_prompts_to.len(), 2, "{new_prompts_to:?}");
        }
    }
}

#[test]
fn with_the_balance_term_a_pick_is_sure_only_if_it_wins_with_and_without_it() {
    use kvbm_events::router::{RouterMode, SelectorConfig};
    use kvbm_router::state::RequestTokens;

    // Worker 1 holds all 16 blocks of `a` and computed 64 blocks of another prompt (320 tokens
    // of work in all); worker 2 holds the first 4 blocks of `a` (16 tokens). Probing 8 blocks:
    // without the term worker 1 wins (0 against 10 * 4 = 40); with weight 0.5 it would lose
    // (10 * 0.5 * 304 / 4 = 380 against 40), and whether the term weighs in depends on how far
    // the rest of the prompt reaches, so the pick is not sure and tokenizing goes on. Without
    // the weight it stops there.
    let ctx = zmq::Context::new();
    let a: Vec<u32> = (0..16 * BLOCK as u32).collect();
    let c: Vec<u32> = (7000..7000 + 64 * BLOCK as u32).collect();
    for weight in [0.5, 0.0] {
        let mut expected = KvIndex::new(
            kvbm_events::router::BLOCKS_PER_WORKER_MAX_DEFAULT,
            BLOCK as u32,
        );
        let mut w1 = Worker::new(&ctx, 1, 0, false);
        let mut w2 = Worker::new(&ctx, 2, 0, false);
        let selector = SelectorConfig {
            balance_weight: weight,
            ..SelectorConfig::for_mode(RouterMode::Kv)
        };
        let router = probe_router(selector, &[&w1, &w2]);
        w1.wait_for_subscriber();
        w2.wait_for_subscriber();
        w1.batch(&[stored(&a, 0, 16, Tier::Gpu)], false, &mut expected);
        w1.batch(&[stored(&c, 0, 64, Tier::Gpu)], false, &mut expected);
        w2.batch(&[stored(&a, 0, 4, Tier::Gpu)], false, &mut expected);
        let gpu = |tokens: &[u32], id: u64| {
            router
                .query(&RequestTokens {
                    token_ids: tokens,
                    untokenized_tokens: 0,
                    lora_name: None,
                    cache_salt: None,
                })
                .workers
                .iter()
                .find(|w| w.worker_id == id)
                .map_or(0, |w| w.overlap.gpu_blocks)
        };
        let deadline = Instant::now() + WAIT;
        while (gpu(&a, 1), gpu(&a, 2), gpu(&c, 1)) != (16, 4, 64) {
            assert!(Instant::now() < deadline, "events not applied");
            std::thread::sleep(Duration::from_millis(10));
        }
        let more = router
            .prefix_probe(None, None)
            .worth_more(&a[..8 * BLOCK], 8 * BLOCK);
        let answers = |answer: &str| {
            let line = format!("kv_router_frontend_probe_answers_total{{answer=\"{answer}\"}} ");
            router
                .render_metrics()
                .lines()
                .find_map(|l| l.strip_prefix(line.as_str())?.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        if weight > 0.0 {
            assert!(more);
            assert_eq!(answers("pick_uncertain"), 1);
        } else {
            assert!(!more);
            assert_eq!(answers("sure_pick"), 1);
        }
    }
}
