//! Bounds on what the router reads from outside at start and while it runs: a sibling's dump
//! (`--bootstrap-from`) and the workers file (`--workers-file`).

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvbm_events::router::{Holding, NameEntry, WorkerSnapshot};
use kvbm_events::Tier;
use kvbm_router::dump::{self, Dump, DumpLimits, DumpWorker};
use kvbm_router::{Router, RouterConfig};

const BLOCK: usize = 16;

/// A sibling that answers one `GET /dump` with `head`, then `line(i)` for i = 0, 1, ... (with
/// `pause` between them) until the reader hangs up, a line is empty, or 30 s have passed.
struct Sibling {
    url: String,
    sent: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Sibling {
    fn start(head: String, pause: Duration, line: impl Fn(u64) -> String + Send + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let sent = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (sent.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let Ok((stream, _)) = listener.accept() else {
                return;
            };
            serve(stream, &head, pause, &line, &s, &st);
        });
        Self {
            url,
            sent,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Sibling {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Unblocks an accept that never came.
        let _ = TcpStream::connect(self.url.trim_start_matches("http://"));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    stream: TcpStream,
    head: &str,
    pause: Duration,
    line: &dyn Fn(u64) -> String,
    sent: &AtomicU64,
    stop: &AtomicBool,
) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request = String::new();
    while reader.read_line(&mut request).is_ok_and(|n| n > 0) {
        if request.ends_with("\r\n\r\n") {
            break;
        }
    }
    let mut out = std::io::BufWriter::new(stream);
    let preamble = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {}\r\nConnection: close\r\n\r\n{head}",
        dump::NDJSON_MEDIA_TYPE
    );
    if out.write_all(preamble.as_bytes()).is_err() {
        return;
    }
    let started = Instant::now();
    for i in 0.. {
        if stop.load(Ordering::Relaxed) || started.elapsed() > Duration::from_secs(30) {
            return;
        }
        let l = line(i);
        if l.is_empty() {
            // The whole dump sent: closing ends the body.
            let _ = out.flush();
            return;
        }
        if out.write_all(l.as_bytes()).is_err() {
            return;
        }
        sent.fetch_add(l.len() as u64, Ordering::Relaxed);
        if !pause.is_zero() {
            if out.flush().is_err() {
                return;
            }
            std::thread::sleep(pause);
        }
    }
}

fn header() -> String {
    format!("{{\"kind\":\"header\",\"format\":\"kvbm-router-dump\",\"version\":1,\"block_size\":{BLOCK}}}\n")
}

fn worker_line(id: u64) -> String {
    format!(
        "{{\"kind\":\"worker\",\"worker_id\":{id},\"dp_rank\":0,\"endpoint\":\"tcp://127.0.0.1:1\",\
         \"replay_endpoint\":null,\"last_seq\":7,\"http_url\":null}}\n"
    )
}

fn hold_line(hash: u64) -> String {
    format!("{{\"kind\":\"hold\",\"tier\":\"GPU\",\"hash\":{hash},\"count\":1}}\n")
}

fn limits() -> DumpLimits {
    DumpLimits {
        holdings_per_worker: 1 << 30,
        workers: 1 << 16,
        blocks: 1 << 30,
        bytes: 1 << 40,
        deadline: Some(Instant::now() + Duration::from_secs(20)),
        check_workers: true,
        local: HashSet::new(),
    }
}

fn config() -> RouterConfig {
    RouterConfig {
        block_size: BLOCK,
        ..RouterConfig::default()
    }
}

fn metric(router: &Router, line_start: &str) -> f64 {
    router
        .render_metrics()
        .lines()
        .find_map(|l| l.strip_prefix(line_start))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// A dump of `workers` workers with `holds` holdings and engine hashes each.
fn sample(workers: u64, holds: u64) -> Dump {
    Dump {
        block_size: BLOCK,
        workers: (0..workers)
            .map(|id| {
                (
                    DumpWorker {
                        worker_id: id,
                        dp_rank: (id % 3) as u32,
                        endpoint: format!("tcp://10.0.{}.{}:5557", id / 250, id % 250),
                        replay_endpoint: Some("tcp://h:5558".into()),
                        last_seq: Some(id),
                        http_url: Some(format!("http://10.0.0.{}:8000/", id % 250)),
                    },
                    WorkerSnapshot {
                        worker: (id, (id % 3) as u32),
                        names: (0..holds)
                            .map(|h| NameEntry {
                                engine: h,
                                ours: h * 7,
                                namespace: 0,
                                refs: 1,
                            })
                            .collect(),
                        holdings: (0..holds)
                            .map(|h| Holding {
                                tier: Tier::Gpu,
                                hash: h * 7,
                                count: 1,
                            })
                            .collect(),
                        ..Default::default()
                    },
                )
            })
            .collect(),
    }
}

/// `dump` in both forms.
fn both_forms(dump: &Dump) -> [(bool, Vec<u8>); 2] {
    let mut ndjson = Vec::new();
    dump::write(dump, &mut ndjson).unwrap();
    let mut msgpack = Vec::new();
    dump::write_msgpack(dump, &mut msgpack).unwrap();
    [(false, ndjson), (true, msgpack)]
}

fn read_counted(
    msgpack: bool,
    bytes: &[u8],
    limits: &DumpLimits,
) -> Result<dump::Bootstrap, dump::DumpError> {
    if msgpack {
        dump::read_msgpack_with(bytes, BLOCK, limits)
    } else {
        dump::read_with(bytes, BLOCK, limits)
    }
}

fn read(msgpack: bool, bytes: &[u8], limits: &DumpLimits) -> Result<Dump, dump::DumpError> {
    read_counted(msgpack, bytes, limits).map(|b| b.dump)
}

#[test]
fn an_endless_dump_is_cut_at_the_byte_bound_and_the_router_starts_without_it() {
    // One worker holding ever more blocks: under every bound but the bytes.
    let sibling = Sibling::start(
        format!("{}{}", header(), worker_line(1)),
        Duration::ZERO,
        hold_line,
    );
    let mut config = config();
    config.bootstrap_max_bytes = 4 << 20;
    config.max_blocks_per_worker = 1 << 30;
    config.bootstrap_max_blocks = 1 << 30;
    let started = Instant::now();
    let router = dump::start(config, Vec::new(), Some(&sibling.url)).unwrap();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "took {took:?}");
    // It read no more than the bound (plus what was in flight) and holds nothing of it.
    assert!(router.workers().is_empty());
    assert_eq!(
        metric(&router, "kv_router_bootstrap_refused_total{why=\"bytes\"}"),
        1.0
    );
    assert_eq!(metric(&router, "kv_router_bootstrap_blocks"), 0.0);
    drop(router);
    drop(sibling);

    // The same through fetch: the error names the bound.
    let sibling = Sibling::start(
        format!("{}{}", header(), worker_line(1)),
        Duration::ZERO,
        hold_line,
    );
    let mut l = limits();
    l.bytes = 1 << 20;
    let e = dump::fetch(&sibling.url, BLOCK, &l).unwrap_err();
    assert_eq!(e.why, "bytes", "{e}");
    assert!(e.to_string().contains("--bootstrap-max-bytes"), "{e}");
    drop(sibling);
}

#[test]
fn endless_workers_or_blocks_are_refused_as_they_stream_in() {
    // Ever more workers, each with one holding.
    let sibling = Sibling::start(header(), Duration::ZERO, |i| {
        format!("{}{}", worker_line(i), hold_line(i))
    });
    let mut l = limits();
    l.workers = 100;
    let e = dump::fetch(&sibling.url, BLOCK, &l).unwrap_err();
    assert_eq!(e.why, "workers", "{e}");
    assert!(e.to_string().contains("--max-workers"), "{e}");
    let sent = sibling.sent.load(Ordering::Relaxed);
    drop(sibling);
    // Cut while streaming: far less than the sibling would have sent in its 30 s.
    assert!(sent < 64 << 20, "{sent} bytes sent");

    // Ever more workers of 1000 holdings each, under the per-worker bound, over the total.
    let sibling = Sibling::start(header(), Duration::ZERO, |i| {
        let mut s = worker_line(i);
        for h in 0..1000 {
            s.push_str(&hold_line(h));
        }
        s
    });
    let mut l = limits();
    l.holdings_per_worker = 1000;
    l.blocks = 5500;
    let e = dump::fetch(&sibling.url, BLOCK, &l).unwrap_err();
    assert_eq!(e.why, "blocks", "{e}");
    assert!(e.to_string().contains("--bootstrap-max-blocks"), "{e}");
    drop(sibling);

    // The same bounds on whole dumps in either form; at the bounds they are read.
    for (msgpack, bytes) in both_forms(&sample(6, 1000)) {
        let mut l = limits();
        l.workers = 5;
        assert_eq!(read(msgpack, &bytes, &l).unwrap_err().why, "workers");
        l.workers = 6;
        l.blocks = 5999;
        assert_eq!(read(msgpack, &bytes, &l).unwrap_err().why, "blocks");
        l.blocks = 6000;
        l.bytes = bytes.len() as u64 - 1;
        assert_eq!(read(msgpack, &bytes, &l).unwrap_err().why, "bytes");
        l.bytes = bytes.len() as u64;
        let d = read(msgpack, &bytes, &l).unwrap();
        assert_eq!(d.workers.len(), 6);
        assert_eq!(
            d.workers[0].0.http_url.as_deref(),
            Some("http://10.0.0.0:8000")
        );
    }
}

#[test]
fn a_sibling_that_dribbles_its_dump_is_given_up_at_the_deadline() {
    let sibling = Sibling::start(
        format!("{}{}", header(), worker_line(1)),
        Duration::from_millis(100),
        hold_line,
    );
    let mut l = limits();
    l.deadline = Some(Instant::now() + Duration::from_secs(1));
    let started = Instant::now();
    let e = dump::fetch(&sibling.url, BLOCK, &l).unwrap_err();
    assert_eq!(e.why, "timeout", "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(sibling);
}

/// `dump` as a sibling serves it (NDJSON, once).
fn serving(dump: &Dump) -> Sibling {
    let mut text = Vec::new();
    dump::write(dump, &mut text).unwrap();
    Sibling::start(String::from_utf8(text).unwrap(), Duration::ZERO, |_| {
        String::new()
    })
}

/// A dump of `workers` workers at loopback ports nothing listens on, without replay endpoints,
/// with `holds` holdings and engine hashes each.
fn reachable(workers: u64, holds: u64) -> Dump {
    let mut d = sample(workers, holds);
    for (w, _) in &mut d.workers {
        w.endpoint = format!("tcp://127.0.0.1:{}", 1 + w.worker_id);
        w.replay_endpoint = None;
        w.http_url = None;
    }
    d
}

fn keys(router: &Router) -> Vec<(u64, u32)> {
    let mut k: Vec<_> = router
        .workers()
        .iter()
        .map(|(w, ..)| (w.worker_id, w.dp_rank))
        .collect();
    k.sort_unstable();
    k
}

#[test]
fn a_dump_worker_register_would_refuse_is_left_out_with_its_holdings() {
    let bad: [(&str, Option<&str>, Option<&str>); 9] = [
        ("ipc:///tmp/router.sock", None, None),
        ("inproc://router-internal", None, None),
        ("tcp://h:1", Some("ipc:///tmp/replay"), None),
        ("tcp://h:1", None, Some("file:///etc/passwd")),
        ("tcp://h:1", None, Some("https://h:1")),
        ("tcp://h", None, None),
        ("tcp://", None, None),
        ("tcp://h:1,http=http://elsewhere:1", None, None),
        ("tcp://h:notaport", None, None),
    ];
    for (endpoint, replay, http) in bad {
        let mut d = sample(3, 3);
        d.workers[1].0.endpoint = endpoint.into();
        d.workers[1].0.replay_endpoint = replay.map(Into::into);
        d.workers[1].0.http_url = http.map(Into::into);
        for (msgpack, bytes) in both_forms(&d) {
            let b = read_counted(msgpack, &bytes, &limits()).unwrap();
            assert_eq!(b.skipped, 1, "{endpoint} {replay:?} {http:?}");
            let kept: Vec<_> = b.dump.workers.iter().map(|(w, _)| w.worker_id).collect();
            assert_eq!(kept, [0, 2], "{endpoint} {replay:?} {http:?}");
            assert!(b
                .dump
                .workers
                .iter()
                .all(|(w, s)| s.worker.0 == w.worker_id));
            // Given locally, it is kept unchecked (followed at the local endpoints).
            let mut l = limits();
            l.local.insert((1, 1));
            let b = read_counted(msgpack, &bytes, &l).unwrap();
            assert_eq!((b.skipped, b.dump.workers.len()), (0, 3));
            // Without the checks (a dump read for inspection) it reads whole.
            let mut l = limits();
            l.check_workers = false;
            assert_eq!(read(msgpack, &bytes, &l).unwrap().workers.len(), 3);
        }
    }
    // Workers left out are bounded too (by --max-workers again).
    let mut d = sample(4, 1);
    for (w, _) in &mut d.workers {
        w.endpoint = "ipc:///tmp/x".into();
    }
    for (msgpack, bytes) in both_forms(&d) {
        let mut l = limits();
        l.workers = 3;
        assert_eq!(read(msgpack, &bytes, &l).unwrap_err().why, "workers");
    }

    // Served by a sibling: the router starts with the others, and counts the one left out.
    let mut d = reachable(2, 3);
    d.workers[1].0.endpoint = "ipc:///tmp/kvbm-router-test-none.sock".into();
    let sibling = serving(&d);
    let router = dump::start(config(), Vec::new(), Some(&sibling.url)).unwrap();
    assert_eq!(keys(&router), [(0, 0)]);
    assert_eq!(metric(&router, "kv_router_bootstrap_blocks"), 3.0);
    assert_eq!(
        metric(&router, "kv_router_bootstrap_workers_skipped_total"),
        1.0
    );
    assert_eq!(
        metric(&router, "kv_router_bootstrap_refused_total{why=\"worker\"}"),
        0.0
    );
    drop(router);
    drop(sibling);

    // A single-node setup: the ipc:// worker is given locally too, and restored.
    let mut d = reachable(1, 3);
    d.workers[0].0.endpoint = "ipc:///tmp/kvbm-router-test-none.sock".into();
    let sibling = serving(&d);
    let local = kvbm_router::parse_workers("0=ipc:///tmp/kvbm-router-test-none.sock").unwrap();
    let router = dump::start(config(), local, Some(&sibling.url)).unwrap();
    assert_eq!(keys(&router), [(0, 0)]);
    assert_eq!(metric(&router, "kv_router_bootstrap_blocks"), 3.0);
    assert_eq!(
        metric(&router, "kv_router_bootstrap_workers_skipped_total"),
        0.0
    );
}

#[test]
fn local_workers_keep_their_room_beside_a_dump_at_max_workers() {
    let mut config = config();
    config.max_workers = 4;
    // Four workers in the dump and a fifth given locally: the dump no longer fits.
    let sibling = serving(&reachable(4, 2));
    let local = kvbm_router::parse_workers("9=tcp://127.0.0.1:2").unwrap();
    let router = dump::start(config.clone(), local, Some(&sibling.url)).unwrap();
    assert_eq!(keys(&router), [(9, 0)]);
    assert_eq!(
        metric(
            &router,
            "kv_router_bootstrap_refused_total{why=\"workers\"}"
        ),
        1.0
    );
    drop(router);
    drop(sibling);
    // A local worker the dump names takes no more room.
    let sibling = serving(&reachable(4, 2));
    let local = kvbm_router::parse_workers("3=tcp://127.0.0.1:2").unwrap();
    let router = dump::start(config.clone(), local, Some(&sibling.url)).unwrap();
    assert_eq!(keys(&router), [(0, 0), (1, 1), (2, 2), (3, 0)]);
    assert_eq!(metric(&router, "kv_router_bootstrap_blocks"), 8.0);
    drop(router);
    drop(sibling);
    // Three in the dump and one given locally: all four.
    let sibling = serving(&reachable(3, 2));
    let local = kvbm_router::parse_workers("9=tcp://127.0.0.1:2").unwrap();
    let router = dump::start(config, local, Some(&sibling.url)).unwrap();
    assert_eq!(keys(&router), [(0, 0), (1, 1), (2, 2), (9, 0)]);
    // The bound as the reader applies it, and its message.
    for (msgpack, bytes) in both_forms(&reachable(4, 1)) {
        let mut l = limits();
        l.workers = 4;
        l.local.insert((9, 0));
        let e = read(msgpack, &bytes, &l).unwrap_err();
        assert_eq!(e.why, "workers", "{e}");
        assert!(e.to_string().contains("--max-workers=4"), "{e}");
        // Only the one it names: fits.
        l.local = HashSet::from([(3, 0)]);
        assert_eq!(read(msgpack, &bytes, &l).unwrap().workers.len(), 4);
    }
}

/// A loopback URL where nothing listens.
fn nobody() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", listener.local_addr().unwrap())
}

#[test]
fn a_required_bootstrap_that_fails_or_is_refused_stops_the_start() {
    let mut required = config();
    required.bootstrap_required = true;
    // The sibling is down.
    let url = nobody();
    let e = dump::start(required.clone(), Vec::new(), Some(&url))
        .map(|_| "started")
        .unwrap_err();
    let e = e.to_string();
    assert!(
        e.contains("--bootstrap-required") && e.contains(&url),
        "{e}"
    );
    // Without the flag: started empty, counted.
    let router = dump::start(config(), Vec::new(), Some(&url)).unwrap();
    assert!(router.workers().is_empty());
    assert_eq!(
        metric(&router, "kv_router_bootstrap_refused_total{why=\"fetch\"}"),
        1.0
    );
    drop(router);
    // The dump is over a bound.
    let sibling = serving(&reachable(3, 2));
    required.bootstrap_max_blocks = 5;
    let e = dump::start(required.clone(), Vec::new(), Some(&sibling.url))
        .map(|_| "started")
        .unwrap_err()
        .to_string();
    assert!(e.contains("--bootstrap-max-blocks"), "{e}");
    drop(sibling);
    // A good dump starts.
    let sibling = serving(&reachable(3, 2));
    required.bootstrap_max_blocks = 6;
    let router = dump::start(required, Vec::new(), Some(&sibling.url)).unwrap();
    assert_eq!(keys(&router).len(), 3);
}

#[test]
fn a_sibling_that_accepts_and_never_answers_is_a_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let holder = std::thread::spawn(move || {
        let Ok((mut stream, _)) = listener.accept() else {
            return;
        };
        // Reads the request and whatever follows, answering nothing, until the reader hangs up.
        stream
            .set_read_timeout(Some(Duration::from_secs(15)))
            .unwrap();
        let _ = std::io::copy(&mut stream, &mut std::io::sink());
    });
    let mut l = limits();
    l.deadline = Some(Instant::now() + Duration::from_secs(1));
    let started = Instant::now();
    let e = dump::fetch(&url, BLOCK, &l).unwrap_err();
    assert_eq!(e.why, "timeout", "{e}");
    assert!(e.to_string().contains("--bootstrap-timeout-secs"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
    holder.join().unwrap();
}

/// CPU time this thread has used (unlike the wall clock, the same on a busy machine).
fn thread_cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `t` is, and keeps no pointer to it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[test]
fn repeated_workers_are_found_in_a_large_dump_quickly() {
    // 100k workers: a search through those before each one takes minutes, a set a second or so
    // (unoptimized).
    let n = 100_000;
    let d = sample(n, 0);
    let mut bytes = Vec::new();
    dump::write_msgpack(&d, &mut bytes).unwrap();
    let mut l = limits();
    l.workers = n as usize + 1;
    // The search alone (checking each worker's parts costs the same either way).
    l.check_workers = false;
    let started = thread_cpu_time();
    assert_eq!(read(true, &bytes, &l).unwrap().workers.len(), n as usize);
    let took = thread_cpu_time() - started;
    assert!(took < Duration::from_secs(6), "took {took:?} of CPU");
    // The same worker twice, the second time at the end.
    let mut twice = d.clone();
    twice.workers.push(d.workers[0].clone());
    bytes.clear();
    dump::write_msgpack(&twice, &mut bytes).unwrap();
    let e = read(true, &bytes, &l).unwrap_err();
    assert_eq!(e.why, "duplicate", "{e}");
}

fn replace_with(path: &Path, make: impl FnOnce(&Path)) {
    let _ = std::fs::remove_file(path);
    make(path);
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_workers_file_that_is_a_device_a_fifo_or_too_long_keeps_the_workers_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("workers");
    std::fs::write(&path, "1=tcp://127.0.0.1:1\n").unwrap();
    let router = Arc::new(Router::start(config(), Vec::new()).unwrap());
    let _watcher =
        kvbm_router::discovery::watch(&router, path.clone(), Duration::from_millis(50)).unwrap();
    let ids = |r: &Router| -> Vec<u64> { r.workers().iter().map(|w| w.0.worker_id).collect() };
    wait_until("worker 1", || ids(&router) == vec![1]);
    let errors = |r: &Router| r.metrics().workers_file_errors.get();
    let started = Instant::now();
    replace_with(&path, |p| {
        std::os::unix::fs::symlink("/dev/zero", p).unwrap()
    });
    wait_until("the link to /dev/zero counted", || errors(&router) >= 1);
    assert_eq!(ids(&router), vec![1]);
    replace_with(&path, |p| {
        assert!(std::process::Command::new("mkfifo")
            .arg(p)
            .status()
            .unwrap()
            .success());
    });
    let before = errors(&router);
    wait_until("the FIFO counted", || errors(&router) > before);
    assert_eq!(ids(&router), vec![1]);
    replace_with(&path, |p| {
        let mut text = "1=tcp://127.0.0.1:1\n".to_owned();
        text.push_str(&"#".repeat(kvbm_router::discovery::WORKERS_FILE_BYTES_MAX as usize));
        std::fs::write(p, text).unwrap();
    });
    let before = errors(&router);
    wait_until("the long file counted", || errors(&router) > before);
    assert_eq!(ids(&router), vec![1]);
    assert!(started.elapsed() < Duration::from_secs(10));
    // The watcher still follows the file.
    replace_with(&path, |p| {
        std::fs::write(p, "1=tcp://127.0.0.1:1\n2=tcp://127.0.0.1:2\n").unwrap()
    });
    wait_until("workers 1 and 2", || ids(&router) == vec![1, 2]);
}

/// Review finding: a dump's workers were subscribed one after another, each waiting up to the
/// replay timeout (2 s) for a replay endpoint that does not answer, so a thousand of them held the
/// start for over half an hour, outside `--bootstrap-timeout-secs`. They are now subscribed
/// `RESTORE_THREADS` at a time: 96 silent replay endpoints take a few replay timeouts, not 96.
#[test]
fn a_dumps_silent_replay_endpoints_are_waited_for_together() {
    const WORKERS: u64 = 96;
    let mut d = reachable(WORKERS, 2);
    // Bound but never accepting: a listener nobody accepts on still completes TCP handshakes, so
    // use ports that refuse instead; ZMQ keeps retrying and the replay waits its full timeout.
    for (w, _) in &mut d.workers {
        w.replay_endpoint = Some(format!("tcp://127.0.0.1:{}", 2 + w.worker_id));
    }
    let started = Instant::now();
    let router = Router::start_from(config(), Vec::new(), Some(d)).unwrap();
    let took = started.elapsed();
    assert_eq!(keys(&router).len(), WORKERS as usize);
    let sequential = kvbm_events::transport::REPLAY_TIMEOUT * WORKERS as u32;
    assert!(
        took < sequential / 3,
        "96 silent replay endpoints took {took:?} (one after another: {sequential:?})"
    );
}
