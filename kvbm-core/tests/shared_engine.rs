//! The shared tier through the engine, against real servers: two "nodes", each a leader with its
//! own request bookkeeping and a worker with its own host pool and disk directory, share one
//! Redis (and a three-master Redis Cluster). A prompt the first node computed (in a process of
//! its own) is matched by the second as a shared hit, loaded byte-exact into its GPU blocks
//! through staging host blocks, and kept in its host tier afterwards. A server killed between
//! the match and the load fails exactly that load (vLLM recomputes the blocks), never the step,
//! and the tier serves again once the server is back.
//!
//! Each step goes as vLLM 0.33 drives a connector: `get_num_new_matched_tokens`
//! (`Requests::match_prefix`), `update_state_after_alloc` (`Requests::allocated`),
//! `build_connector_meta` (`schedule`, `offload_spans`, `take_plan`), the plan through bytes to
//! the worker (`start_load_kv`, `wait_for_save`), `get_finished` (`Worker::report`) and
//! `update_connector_output` (`Leader::discard`, `Requests::connector_output`).

mod redis_server;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_core::layout::{GpuLayout, PhysicalLayout};
use kvbm_core::requests::{Requests, Scheduled};
use kvbm_core::shared::{shard_fingerprint, SharedOptions, SharedStore};
use kvbm_core::{
    BlockHasher, DiskOptions, KvEvent, KvLayout, Leader, Metrics, SharedWorkerOptions, StepPlan,
    StepReport, Worker, WorkerOptions,
};
use kvbm_cuda::Device;
use redis_server::{Cluster, Server};

const B: usize = 4;
/// The model's fingerprint both nodes agree on (the connector derives it from vLLM's config).
const MODEL: u64 = 0x6d6f_6465_6c31;
/// The child process's environment: the servers' URLs, comma-separated, and whether they are a
/// cluster.
const URLS_VAR: &str = "KVBM_SHARED_ENGINE_URLS";
const CLUSTER_VAR: &str = "KVBM_SHARED_ENGINE_CLUSTER";

fn kv() -> KvLayout {
    KvLayout::new(3, 2, B, 16, 2).unwrap()
}

fn options_ttl(urls: &[String], cluster: bool, ttl: Duration) -> SharedOptions {
    let mut o = SharedOptions::new(urls.to_vec());
    o.ttl = Some(ttl);
    o.cluster = cluster;
    o.lookup_timeout = Duration::from_millis(500);
    o.read_timeout = Duration::from_secs(2);
    o.write_timeout = Duration::from_secs(2);
    o
}

/// The prompt: `blocks` full blocks and one token more (vLLM never matches the last token's
/// block).
fn prompt(first: u32, blocks: usize) -> Vec<u32> {
    (first..first + (blocks * B) as u32 + 1).collect()
}

fn hashes_of(tokens: &[u32]) -> Vec<u64> {
    let full = tokens.len() / B * B;
    BlockHasher::new(B, None, None)
        .sequence_hashes(None, &tokens[..full])
        .into_iter()
        .map(|h| h.0)
        .collect()
}

/// The bytes the first node computes for the block of sequence hash `hash`.
fn kv_bytes(hash: u64) -> Vec<u8> {
    let mut x = hash | 1;
    (0..kv().bytes_per_block())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

struct Node {
    leader: Leader,
    requests: Requests,
    worker: Worker,
    metrics: Arc<Metrics>,
    _dir: tempfile::TempDir,
}

fn node(urls: &[String], cluster: bool) -> Node {
    node_ttl(urls, cluster, Duration::from_secs(3600))
}

fn node_ttl(urls: &[String], cluster: bool, ttl: Duration) -> Node {
    let device = Device::from_env(0).expect("KVBM_DEVICE names a device this machine has");
    let kv = kv();
    let gpu_blocks = 32;
    let gpu_layout = GpuLayout::Paged {
        layout: "BLNHC".parse::<PhysicalLayout>().unwrap(),
        num_heads: 2,
    };
    let [bytes] = gpu_layout.allocation_bytes(&kv, gpu_blocks)[..] else {
        panic!("one allocation")
    };
    let gpu = device.alloc_gpu(bytes).unwrap();
    gpu.write(0, &vec![0u8; bytes]).unwrap();
    let layout = gpu_layout.place(kv, gpu_blocks, &[gpu.addr()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key_fingerprint = shard_fingerprint(MODEL, 0, 1);
    let metrics = Arc::new(Metrics::default());
    let host_blocks = 16;
    let worker = Worker::new(
        device,
        kv,
        layout,
        vec![gpu],
        WorkerOptions {
            host_blocks,
            disk: Some(DiskOptions {
                dir: dir.path().join("cache"),
                file_name: "kvbm-rank0.cache".into(),
                blocks: 16,
                disable_o_direct: false,
                filter_disabled: false,
                queue_depth: 8,
                engine: Default::default(),
                layout_salt: 0,
            }),
            shared: Some(SharedWorkerOptions {
                options: options_ttl(urls, cluster, ttl),
                key_fingerprint,
            }),
            ..Default::default()
        },
        metrics.clone(),
    )
    .unwrap();
    assert!(worker.wait_host_ready(Duration::from_secs(30)));
    let store = SharedStore::open(options_ttl(urls, cluster, ttl), key_fingerprint, 0).unwrap();
    let leader = Leader::new(B, host_blocks, 16, false)
        .unwrap()
        .with_metrics(metrics.clone())
        .with_shared(store, vec![key_fingerprint]);
    Node {
        leader,
        requests: Requests::new(B),
        worker,
        metrics,
        _dir: dir,
    }
}

impl Node {
    /// `get_num_new_matched_tokens` then `update_state_after_alloc` for a new request in GPU
    /// blocks `gpu`: the tokens found, and whether the load is asynchronous.
    fn admit(&mut self, request: &str, tokens: &[u32], gpu: &[u32]) -> (usize, bool) {
        let full = (tokens.len() - 1) / B * B;
        let (found, asynchronous) = self
            .requests
            .match_prefix(
                &self.leader,
                request,
                &tokens[..full],
                0,
                tokens.len(),
                None,
                None,
            )
            .unwrap();
        self.requests
            .allocated(&mut self.leader, request, vec![gpu.to_vec()], found)
            .unwrap();
        (found, asynchronous)
    }

    /// One step: `scheduled` (new requests with their whole prompt scheduled), the plan through
    /// bytes into the worker, then its report handed back as vLLM does.
    fn step(&mut self, scheduled: &[(&str, &[u32], &[u32])], finished: &[String]) -> StepReport {
        let new = scheduled
            .iter()
            .map(|(r, _, gpu)| Scheduled::New {
                request: (*r).into(),
                block_ids: vec![gpu.to_vec()],
                computed: 0,
                lora: None,
                salt: None,
            })
            .collect();
        let work: Vec<(String, usize, usize)> = scheduled
            .iter()
            .map(|(r, t, _)| ((*r).into(), t.len(), t.len()))
            .collect();
        let spans = self.requests.schedule(new, &work).unwrap();
        let tokens = spans
            .iter()
            .map(|s| scheduled[s.index].1[s.first_token..s.end_token].to_vec())
            .collect();
        self.requests
            .offload_spans(&mut self.leader, tokens)
            .unwrap();
        let plan = self.leader.take_plan(vec![]).unwrap();
        let plan = StepPlan::from_bytes(&plan.to_bytes()).unwrap();
        self.worker.bind(plan);
        self.worker.handle_preemptions();
        self.worker.start_onboards().unwrap();
        for layer in 0..self.worker.num_tensors() {
            self.worker.wait_layer(layer).unwrap();
        }
        self.worker.start_offloads().unwrap();
        self.worker.clear();
        self.worker.wait_async();
        self.worker.wait_offloads();
        let report = self.worker.report(finished);
        self.leader
            .discard(&report.bad_host_blocks, &report.bad_disk_blocks);
        self.requests.connector_output(
            &mut self.leader,
            &report.finished_onboarding,
            &report.finished_offloading,
        );
        report
    }

    /// Computes `tokens` in GPU blocks `gpu` (the engine's forward pass writes their KV) and
    /// offloads them: every block reaches the host tier and is written to the shared tier.
    fn compute(&mut self, request: &str, tokens: &[u32], gpu: &[u32]) {
        let (found, _) = self.admit(request, tokens, gpu);
        assert_eq!(found, 0, "{request} is new here");
        for (g, h) in gpu.iter().zip(hashes_of(tokens)) {
            self.worker.write_gpu_block(*g, &kv_bytes(h)).unwrap();
        }
        self.step(&[(request, tokens, gpu)], &[]);
        self.step(&[], &[request.to_string()]);
        assert!(
            self.worker.wait_shared(Duration::from_secs(10)),
            "writes flushed"
        );
    }

    fn gpu_block(&self, id: u32) -> Vec<u8> {
        let mut out = vec![0u8; kv().bytes_per_block()];
        self.worker.read_gpu_block(id, &mut out).unwrap();
        out
    }
}

/// The first node, in a process of its own: computes the prompt `prompt(7000, 6)`.
#[test]
#[ignore = "the first node of the two-node tests, run by them in a child process"]
fn first_node() {
    let Ok(urls) = std::env::var(URLS_VAR) else {
        return;
    };
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let cluster = std::env::var(CLUSTER_VAR).as_deref() == Ok("1");
    let mut a = node(&urls, cluster);
    let tokens = prompt(7000, 6);
    a.compute("a", &tokens, &[0, 1, 2, 3, 4, 5, 6]);
    let c = a.worker.shared_counts().unwrap();
    assert_eq!(
        (c.writes, c.writes_dropped_down, c.writes_refused),
        (6, 0, 0)
    );
    assert_eq!(a.metrics.snapshot().shared_write_blocks, 6);
}

/// Runs [`first_node`] in a child process against `urls`.
fn first_node_elsewhere(urls: &[String], cluster: bool) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "first_node", "--ignored", "--test-threads=1"])
        .env(URLS_VAR, urls.join(","))
        .env(CLUSTER_VAR, if cluster { "1" } else { "0" })
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "the first node failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The second node loads what the first computed: a shared hit past its empty local tiers,
/// loaded asynchronously, byte-exact, then kept in its host tier.
fn second_node_loads(urls: &[String], cluster: bool) {
    let mut b = node(urls, cluster);
    let tokens = prompt(7000, 6);
    let hashes = hashes_of(&tokens);
    let gpu = [20, 21, 22, 23, 24, 25, 26];
    let (found, asynchronous) = b.admit("b", &tokens, &gpu);
    assert_eq!((found, asynchronous), (6 * B, true), "a shared hit");
    assert_eq!(b.requests.hit_sources("b", found), Some((0, 0, 6 * B)));
    let report = b.step(&[], &[]);
    assert_eq!(report.finished_onboarding, vec!["b".to_string()]);
    assert!(report.failed_blocks.is_empty(), "{report:?}");
    for (g, h) in gpu.iter().zip(&hashes) {
        assert_eq!(b.gpu_block(*g), kv_bytes(*h), "GPU block {g}");
    }
    let m = b.metrics.snapshot();
    assert_eq!((m.shared_read_blocks, m.shared_read_misses), (6, 0));
    assert_eq!(m.shared_cache_hit_rate, 1.0);
    // The blocks read joined this node's host tier: the next request finds them there.
    assert_eq!(b.leader.count_prefix(&hashes), 6);
    let (found, asynchronous) = b.admit("c", &tokens, &[27, 28, 29, 30, 31, 0, 1]);
    assert_eq!((found, asynchronous), (6 * B, false), "a host hit now");
    // Another tenant's request for the same tokens is not served the first tenant's blocks.
    let (found, _) = b
        .requests
        .match_prefix(
            &b.leader,
            "d",
            &tokens[..6 * B],
            0,
            tokens.len(),
            None,
            Some("another-tenant"),
        )
        .unwrap();
    assert_eq!(found, 0);
}

#[test]
fn a_prompt_computed_on_one_node_is_loaded_byte_exact_on_another() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let urls = vec![server.url()];
    first_node_elsewhere(&urls, false);
    second_node_loads(&urls, false);
}

#[test]
fn the_same_through_a_three_master_cluster() {
    if !redis_server::available() {
        return;
    }
    let cluster = Cluster::start();
    // The second node knows one seed only; the first another.
    let urls = cluster.urls();
    first_node_elsewhere(&urls[..1], true);
    second_node_loads(&urls[1..2], true);
}

#[test]
fn a_server_killed_between_match_and_load_fails_that_load_only_and_the_tier_comes_back() {
    if !redis_server::available() {
        return;
    }
    let mut server = Server::start(&[]);
    let urls = vec![server.url()];
    let mut a = node(&urls, false);
    let mut b = node(&urls, false);
    let tokens = prompt(9000, 5);
    a.compute("a", &tokens, &[0, 1, 2, 3, 4, 5]);
    let gpu = [10, 11, 12, 13, 14, 15];
    let (found, asynchronous) = b.admit("b", &tokens, &gpu);
    assert_eq!((found, asynchronous), (5 * B, true));
    server.kill();
    // The load fails as a whole (vLLM recomputes those blocks); the step goes on.
    let report = b.step(&[], &[]);
    assert_eq!(report.finished_onboarding, vec!["b".to_string()]);
    assert_eq!(report.failed_blocks, gpu[..5].to_vec());
    let m = b.metrics.snapshot();
    assert_eq!((m.shared_read_blocks, m.shared_read_misses), (5, 5));
    // Nothing read became a host block, and with the tier out a match is a quick miss.
    assert_eq!(b.leader.count_prefix(&hashes_of(&tokens)), 0);
    let started = Instant::now();
    let (found, _) = b.admit("b2", &tokens, &gpu);
    assert_eq!(found, 0);
    assert!(started.elapsed() < Duration::from_secs(2));
    // vLLM recomputes b from its first failed block: those blocks are offloaded as they fill
    // (not skipped as if they had loaded).
    b.step(&[("b", &tokens, &gpu)], &[]);
    assert_eq!(b.leader.count_prefix(&hashes_of(&tokens)), 5);
    // Local serving went on meanwhile: b computes a prompt of its own and finds it.
    let own = prompt(11_000, 3);
    b.compute_locally("own", &own, &[16, 17, 18, 19]);
    let (found, asynchronous) = b.admit("own2", &own, &[20, 21, 22, 23]);
    assert_eq!((found, asynchronous), (3 * B, false));
    // The server is back (empty): a prompt computed on a from now on is found on b again,
    // once the tier's backoff let a try (each try a new prompt, until one was written whole).
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    let next = a.compute_until_written(13_000, 4, &[6, 7, 8, 9, 10], deadline);
    let (found, asynchronous) = b.admit("n", &next, &[24, 25, 26, 27, 28]);
    assert_eq!(
        (found, asynchronous),
        (4 * B, true),
        "the tier serves again"
    );
    let report = b.step(&[], &[]);
    assert!(report.failed_blocks.is_empty(), "{report:?}");
    for (g, h) in [24u32, 25, 26, 27].iter().zip(hashes_of(&next)) {
        assert_eq!(b.gpu_block(*g), kv_bytes(h), "GPU block {g}");
    }
    assert!(b.leader.shared_counts().unwrap().recoveries >= 1);
}

impl Node {
    /// [`Node::compute`] where the shared writes may be dropped: only the local tiers matter.
    fn compute_locally(&mut self, request: &str, tokens: &[u32], gpu: &[u32]) {
        let (found, _) = self.admit(request, tokens, gpu);
        assert_eq!(found, 0);
        for (g, h) in gpu.iter().zip(hashes_of(tokens)) {
            self.worker.write_gpu_block(*g, &kv_bytes(h)).unwrap();
        }
        self.step(&[(request, tokens, gpu)], &[]);
        self.step(&[], &[request.to_string()]);
    }

    /// Computes new prompts of `blocks` blocks (the first from token `first` on, then others)
    /// until the tier took one's writes whole (it may be in backoff after an outage) or
    /// `deadline` passed; returns that prompt.
    fn compute_until_written(
        &mut self,
        first: u32,
        blocks: usize,
        gpu: &[u32],
        deadline: Instant,
    ) -> Vec<u32> {
        for attempt in 0u32.. {
            let tokens = prompt(first + attempt * 1000, blocks);
            let before = self.worker.shared_counts().unwrap().writes;
            self.compute_locally(&format!("try-{attempt}"), &tokens, gpu);
            assert!(self.worker.wait_shared(Duration::from_secs(10)));
            if self.worker.shared_counts().unwrap().writes == before + blocks as u64 {
                return tokens;
            }
            assert!(Instant::now() < deadline, "the tier never took the writes");
            std::thread::sleep(Duration::from_millis(300));
        }
        unreachable!()
    }
}

#[test]
fn shared_writes_are_announced_in_the_pool_and_removed_once_their_ttl_ran_out() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let urls = vec![server.url()];
    let mut a = node_ttl(&urls, false, Duration::from_millis(300));
    let tokens = prompt(15_000, 3);
    a.compute("a", &tokens, &[0, 1, 2, 3]);
    let hashes: Vec<u64> = hashes_of(&tokens);
    let pool_events = |a: &mut Node| -> (Vec<u64>, Vec<u64>) {
        let (mut stored, mut removed) = (Vec::new(), Vec::new());
        for e in a.leader.take_events() {
            match e {
                KvEvent::SharedStored { stored: s, .. } => {
                    stored.extend(s.block_hashes.iter().map(|h| h.0))
                }
                KvEvent::SharedRemoved { removed: r, .. } => {
                    removed.extend(r.block_hashes.iter().map(|h| h.0))
                }
                _ => {}
            }
        }
        (stored, removed)
    };
    // Announced once; whenever the steps pass its TTL (here perhaps already), once removed.
    let (stored, mut removed) = pool_events(&mut a);
    assert_eq!(stored, hashes);
    std::thread::sleep(Duration::from_millis(400));
    a.leader.end_step();
    let (more, later) = pool_events(&mut a);
    assert!(more.is_empty());
    removed.extend(later);
    assert_eq!(removed, hashes);
    let mut b = node(&urls, false);
    let (found, _) = b.admit("b", &tokens, &[10, 11, 12, 13]);
    assert_eq!(found, 0, "the server expired them too");
}

#[test]
fn a_prefix_hit_past_half_its_ttl_is_written_again_and_stays_in_the_pool() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let urls = vec![server.url()];
    let ttl = Duration::from_secs(3);
    let mut a = node_ttl(&urls, false, ttl);
    let tokens = prompt(17_000, 3);
    a.compute("a", &tokens, &[0, 1, 2, 3]);
    let writes = a.worker.shared_counts().unwrap().writes;
    assert_eq!(writes, 3);
    // Past half the TTL, a request hits the prefix in a's host tier: its blocks are written
    // again (no second announcement).
    std::thread::sleep(ttl / 2 + Duration::from_millis(100));
    let (found, asynchronous) = a.admit("hit", &tokens, &[4, 5, 6, 7]);
    assert_eq!((found, asynchronous), (3 * B, false));
    a.step(&[], &[]);
    assert!(a.worker.wait_shared(Duration::from_secs(10)));
    let counts = a.worker.shared_counts().unwrap();
    assert_eq!(counts.writes, writes + 3, "{counts:?}");
    // Past the first write's TTL: still in the pool, and not announced removed.
    std::thread::sleep(ttl / 2 + Duration::from_millis(100));
    a.leader.end_step();
    let pool: Vec<KvEvent> = a
        .leader
        .take_events()
        .into_iter()
        .filter(|e| {
            matches!(
                e,
                KvEvent::SharedStored { .. } | KvEvent::SharedRemoved { .. }
            )
        })
        .collect();
    assert_eq!(pool.len(), 1, "one announcement, no removal: {pool:?}");
    let mut b = node(&urls, false);
    let (found, _) = b.admit("b", &tokens, &[10, 11, 12, 13]);
    assert_eq!(found, 3 * B, "the server still holds them");
}

/// The server loses a block before its TTL ran out (its memory policy evicted it, or it
/// restarted empty): the next lookup of the node that announced it finds it gone, and the node
/// announces it removed from the pool, once, so that the router stops crediting the pool with
/// a block it no longer holds.
#[test]
fn an_announced_block_a_lookup_finds_gone_is_announced_removed() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let urls = vec![server.url()];
    let mut a = node(&urls, false);
    let tokens = prompt(19_000, 3);
    a.compute("a", &tokens, &[0, 1, 2, 3]);
    let hashes = hashes_of(&tokens);
    let pool_events = |a: &mut Node| -> (Vec<u64>, Vec<u64>) {
        let (mut stored, mut removed) = (Vec::new(), Vec::new());
        for e in a.leader.take_events() {
            match e {
                KvEvent::SharedStored { stored: s, .. } => {
                    stored.extend(s.block_hashes.iter().map(|h| h.0))
                }
                KvEvent::SharedRemoved { removed: r, .. } => {
                    removed.extend(r.block_hashes.iter().map(|h| h.0))
                }
                _ => {}
            }
        }
        (stored, removed)
    };
    assert_eq!(pool_events(&mut a), (hashes.clone(), vec![]));
    // The server loses the second block.
    let key = kvbm_core::shared::block_key(
        "kvbm",
        shard_fingerprint(MODEL, 0, 1),
        0,
        kvbm_core::SequenceHash(hashes[1]),
    );
    let deleted: i64 = redis::cmd("DEL")
        .arg(&key)
        .query(
            &mut redis::Client::open(server.url())
                .unwrap()
                .get_connection()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(deleted, 1, "{key}");
    // The node's own copies go (host memory needed elsewhere; the blocks were seen once, so
    // none went to disk): the prompt is looked up in the pool again.
    assert!(a.leader.evict_idle_host() >= 3);
    let (found, asynchronous) = a.admit("again", &tokens, &[4, 5, 6, 7]);
    assert_eq!(
        (found, asynchronous),
        (B, true),
        "only the first block is left"
    );
    a.step(&[], &[]);
    assert_eq!(pool_events(&mut a), (vec![], vec![hashes[1]]));
    // Found gone again: not announced twice.
    let (found, _) = a.admit("once more", &tokens, &[8, 9, 10, 11]);
    assert_eq!(found, B);
    a.step(&[], &[]);
    assert_eq!(pool_events(&mut a), (vec![], vec![]));
}
