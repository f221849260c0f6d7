//! Slow clients against the router's listener, over real TCP on 127.0.0.1: a request's headers
//! and body have deadlines that trickling bytes does not extend, a flood of slow clients cannot
//! keep `/healthz` from answering, and a long answer is not cut by those deadlines.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::connect_info::ConnectInfo;
use axum::routing::{get, post};
use kvbm_router::listener::{ConnBusy, ConnLimits};
use kvbm_router::metrics::RouterMetrics;
use kvbm_router::{Router, RouterConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// A router served in-process; stopped (gracefully) when dropped.
struct Served {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Served {
    async fn router(max: usize, header: Duration, body: Duration, idle_secs: u64) -> Self {
        let config = RouterConfig {
            max_connections: max,
            http_idle_timeout: Duration::from_secs(idle_secs),
            http_header_timeout: header,
            http_body_timeout: body,
            ..RouterConfig::default()
        };
        let router = Arc::new(Router::start(config, Vec::new()).unwrap());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        // The server on a runtime of its own, as in the binary: the clients' tasks do not share
        // its threads.
        let (tx, rx) = oneshot::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let served = runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                kvbm_router::serve(router, None, listener, async move {
                    let _ = stopped.await;
                })
                .await
            });
            let _ = tx.send(served);
        });
        let done = tokio::spawn(async move { rx.await.unwrap() });
        Self {
            addr,
            stop: Some(stop),
            done: Some(done),
        }
    }

    /// Stops serving; returns once the server has returned.
    async fn shut_down(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let done = self.done.take().unwrap();
        tokio::time::timeout(Duration::from_secs(10), done)
            .await
            .expect("the server stopped on shutdown")
            .unwrap()
            .unwrap();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Serves `app` in-process on a loopback port with at most `max` connections and `limits`,
/// until `shutdown`; its address, its metrics and the server's task.
async fn serve_app(
    app: axum::Router,
    max: usize,
    limits: ConnLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> (
    SocketAddr,
    RouterMetrics,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let metrics = RouterMetrics::new();
    let listener = kvbm_router::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(kvbm_router::serve_app(
        app,
        listener,
        max,
        limits,
        metrics.clone(),
        shutdown,
    ));
    (addr, metrics, server)
}

/// Sends `request` whole and reads the answer until the server closes; its status code.
async fn call(addr: SocketAddr, request: &str, within: Duration) -> Result<(u16, String), String> {
    tokio::time::timeout(within, async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        s.write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer)
            .await
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&answer).into_owned();
        let code = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| format!("no status line in {text:?}"))?;
        Ok((code, text))
    })
    .await
    .map_err(|_| format!("no answer within {within:?}"))?
}

/// How long a health check may take, retries included: generous for a loaded machine, far below
/// the 20 s a slow client would hold its slot without the listener's limits.
const HEALTHZ_WITHIN: Duration = Duration::from_secs(8);

/// `/healthz` as a prober would ask it, retrying a connection that was cut (a newcomer may be
/// evicted before its request is read, on a loaded machine): the status of the first answer
/// and how many tries were cut before it, or why there was none within [`HEALTHZ_WITHIN`].
async fn healthz(addr: SocketAddr) -> Result<(u16, u32), String> {
    let request = "GET /healthz HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n";
    let started = Instant::now();
    let mut cut = 0;
    loop {
        let left = HEALTHZ_WITHIN.saturating_sub(started.elapsed());
        match call(addr, request, left).await {
            Ok((code, _)) => return Ok((code, cut)),
            Err(why) if started.elapsed() >= HEALTHZ_WITHIN => {
                return Err(format!("{why} after {cut} cut tries"))
            }
            Err(_) => cut += 1,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of one metric line (`name{labels}` as rendered), 0 if absent.
async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let request = "GET /metrics HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n";
    let (code, text) = call(addr, request, Duration::from_secs(5)).await.unwrap();
    assert_eq!(code, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Connects, sends `head` at once, then `trickle` one byte every 100 ms; returns how long the
/// connection lived until the server closed it (None: `trickle` was sent whole, never cut).
async fn trickle(addr: SocketAddr, head: &[u8], trickle: &[u8]) -> Option<Duration> {
    let started = Instant::now();
    let stream = TcpStream::connect(addr).await.ok()?;
    let (mut rx, mut tx) = stream.into_split();
    let send = async {
        if tx.write_all(head).await.is_err() {
            return false;
        }
        for b in trickle {
            if tx.write_all(&[*b]).await.is_err() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        true
    };
    let closed = async {
        // Whatever the server answers (if anything), read until it closes.
        let mut buf = [0u8; 1024];
        while let Ok(n) = rx.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::select! {
        whole = send => if whole { None } else { Some(started.elapsed()) },
        () = closed => Some(started.elapsed()),
    }
}

/// A request whose headers would take 20 s at 10 bytes a second.
fn slow_headers() -> Vec<u8> {
    let mut h = b"GET /healthz HTTP/1.1\r\nHost: router\r\nX-Slow: ".to_vec();
    h.extend(std::iter::repeat_n(b'a', 200));
    h.extend_from_slice(b"\r\n\r\n");
    h
}

const DEADLINE: Duration = Duration::from_secs(1);
/// The idle timeout where it must outlast a header deadline with room to spare.
const IDLE: Duration = Duration::from_secs(3);
/// Margin on every deadline (a loaded machine): still far below the 20 s of a trickle.
const MARGIN: Duration = Duration::from_secs(4);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_hold_no_slot_past_the_header_deadline_and_healthz_answers() {
    // 8 slots, each taken by a client trickling its headers a byte every 100 ms (well inside the
    // 5 s idle timeout, so idleness alone never closes them).
    let served = Served::router(8, DEADLINE, Duration::from_secs(10), 5).await;
    let addr = served.addr;
    let slow: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { trickle(addr, b"", &slow_headers()).await }))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // While they are connected, /healthz answers (it takes the slot of the oldest).
    let (code, retried) = healthz(addr).await.expect("/healthz with every slot taken");
    assert_eq!(code, 200);
    for s in slow {
        let lived = s.await.unwrap().expect("a slow client was never closed");
        assert!(lived < DEADLINE + MARGIN, "a slow client lived {lived:?}");
    }
    let cut = metric(
        addr,
        "kv_router_connections_deadline_total{phase=\"headers\"}",
    )
    .await;
    let evicted = metric(addr, "kv_router_connections_evicted_total").await;
    let refused = metric(addr, "kv_router_connections_refused_total").await;
    assert!(cut >= 1.0, "{cut}");
    // Each slow client closed once, and each cut /healthz try once.
    assert_eq!(
        cut + evicted + refused,
        8.0 + f64::from(retried),
        "cut {cut}, evicted {evicted}, refused {refused}, /healthz retried {retried}"
    );
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_reconnecting_slow_clients_cannot_keep_healthz_from_answering() {
    // Three times as many slow clients as slots, each reconnecting as soon as it is cut: half
    // trickle their headers, half their body (whose 10 s deadline outlasts the test).
    let served = Served::router(8, DEADLINE, Duration::from_secs(10), 5).await;
    let addr = served.addr;
    let flooding = Arc::new(AtomicBool::new(true));
    let body_head = b"POST /query HTTP/1.1\r\nHost: router\r\nContent-Length: 200\r\n\r\n";
    let flood: Vec<_> = (0..24)
        .map(|i| {
            let flooding = flooding.clone();
            tokio::spawn(async move {
                let mut lives = Vec::new();
                while flooding.load(Ordering::Relaxed) {
                    let cut = if i % 2 == 0 {
                        trickle(addr, b"", &slow_headers()).await
                    } else {
                        trickle(addr, body_head, &[b' '; 200]).await
                    };
                    match cut {
                        Some(lived) if i % 2 == 0 => lives.push(lived),
                        Some(_) => {}
                        None => panic!("a slow client sent its 20 s of request uncut"),
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                lives
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..8 {
        let (code, _) = healthz(addr).await.expect("/healthz during the flood");
        assert_eq!(code, 200, "/healthz during the flood");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    flooding.store(false, Ordering::Relaxed);
    for f in flood {
        for lived in f.await.unwrap() {
            assert!(lived < DEADLINE + MARGIN, "a slow client lived {lived:?}");
        }
    }
    assert!(metric(addr, "kv_router_connections_evicted_total").await > 0.0);
    served.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_cut_at_the_body_deadline() {
    let served = Served::router(8, Duration::from_secs(10), DEADLINE, 5).await;
    let addr = served.addr;
    let head = b"POST /query HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
                 Content-Length: 200\r\n\r\n";
    let lived = trickle(addr, head, &[b' '; 200])
        .await
        .expect("a body trickled over 20 s was never cut");
    assert!(
        lived >= DEADLINE - Duration::from_millis(100) && lived < DEADLINE + MARGIN,
        "the trickled body lived {lived:?}"
    );
    assert_eq!(
        metric(addr, "kv_router_connections_deadline_total{phase=\"body\"}").await,
        1.0
    );
    assert_eq!(
        metric(
            addr,
            "kv_router_connections_deadline_total{phase=\"headers\"}"
        )
        .await,
        0.0
    );
    // A body sent at once is served.
    let body = r#"{"token_ids": [1, 2, 3]}"#;
    let request = format!(
        "POST /query HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let (code, text) = call(addr, &request, Duration::from_secs(5)).await.unwrap();
    assert_eq!(code, 200, "{text}");
    served.shut_down().await;
}

/// A handler that answers for 4.5 s: a chunk, 4 s of silence (longer than the idle timeout; the
/// connection held busy, as the OpenAI front end holds it while a worker generates), a chunk,
/// 0.5 s, the last chunk.
async fn long_answer(
    ConnectInfo(conn): ConnectInfo<ConnBusy>,
    body: axum::body::Bytes,
) -> axum::body::Body {
    assert_eq!(&body[..], b"prompt");
    let busy = conn.hold();
    let chunks = async_stream_of(vec![
        (Duration::ZERO, "first;"),
        (Duration::from_millis(4000), "second;"),
        (Duration::from_millis(500), "last"),
    ]);
    axum::body::Body::from_stream(futures_util::StreamExt::map(chunks, move |c| {
        let _held = &busy;
        Ok::<_, std::io::Error>(c)
    }))
}

/// A stream of `chunks`, each after its delay.
fn async_stream_of(
    chunks: Vec<(Duration, &'static str)>,
) -> impl futures_util::Stream<Item = axum::body::Bytes> {
    futures_util::stream::unfold(chunks.into_iter(), |mut rest| async move {
        let (delay, chunk) = rest.next()?;
        tokio::time::sleep(delay).await;
        Some((axum::body::Bytes::from_static(chunk.as_bytes()), rest))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_answer_outlives_the_header_body_and_idle_deadlines() {
    // Header and body deadlines 1 s, idle 3 s; the answer takes 4.5 s, with 4 s of silence.
    let app = axum::Router::new()
        .route("/long", post(long_answer))
        .route("/short", get(|| async { "short" }));
    let limits = ConnLimits {
        idle: IDLE,
        header: DEADLINE,
        body: DEADLINE,
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let (addr, metrics, server) = serve_app(app, 4, limits, async move {
        let _ = stopped.await;
    })
    .await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    s.write_all(b"POST /long HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nprompt")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !answer.ends_with(b"0\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("the answer went on")
            .unwrap();
        assert!(
            n > 0,
            "closed mid-answer after {:?}: {answer:?}",
            started.elapsed()
        );
        answer.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    for part in ["first;", "second;", "last"] {
        assert!(text.contains(part), "{text}");
    }
    assert!(
        started.elapsed() >= Duration::from_millis(4500),
        "{:?}",
        started.elapsed()
    );
    // The connection is kept alive: a next request on it is served, though it comes longer
    // than the header deadline after the answer (and the connection's first byte), within the
    // idle timeout: its header deadline runs from its own first byte.
    tokio::time::sleep(IDLE - DEADLINE).await;
    s.write_all(b"GET /short HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.starts_with("HTTP/1.1 200") && rest.ends_with("short"),
        "{rest}"
    );
    let cut = &metrics.connections_deadline;
    assert_eq!(cut.with_label_values(&["headers"]).get(), 0);
    assert_eq!(cut.with_label_values(&["body"]).get(), 0);
    assert_eq!(metrics.connections_timed_out.get(), 0);
    // Graceful shutdown still ends the server.
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the server stopped on shutdown")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_being_answered_is_never_evicted_a_newcomer_is_refused_instead() {
    let app = axum::Router::new().route(
        "/wait",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            "waited"
        }),
    );
    let limits = ConnLimits {
        idle: Duration::from_secs(5),
        header: DEADLINE,
        body: DEADLINE,
    };
    let (addr, metrics, server) = serve_app(app, 1, limits, std::future::pending()).await;
    let request = "GET /wait HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let answered = tokio::spawn(call(addr, request, Duration::from_secs(10)));
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The only slot is answering: the newcomer is closed, not served and not let in.
    let refused = call(addr, request, Duration::from_secs(10)).await;
    assert!(refused.is_err(), "{refused:?}");
    let (code, text) = answered.await.unwrap().unwrap();
    assert_eq!(code, 200, "{text}");
    assert!(text.ends_with("waited"), "{text}");
    assert_eq!(metrics.connections_refused.get(), 1);
    assert_eq!(metrics.connections_evicted.get(), 0);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_a_long_answer_gives_its_slot_to_a_newcomer() {
    // An answer far larger than the socket buffers, to a client that never reads it.
    let app = axum::Router::new()
        .route(
            "/big",
            get(|| async { axum::body::Bytes::from(vec![b'x'; 64 << 20]) }),
        )
        .route("/short", get(|| async { "short" }));
    // The idle and write deadlines far off: only the eviction can free the slot in time.
    let limits = ConnLimits {
        idle: Duration::from_secs(60),
        header: Duration::from_secs(10),
        body: Duration::from_secs(10),
    };
    let (addr, metrics, server) = serve_app(app, 1, limits, std::future::pending()).await;
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled
        .write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    // Its answer is produced whole and stuck in the buffers; the one slot is taken.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let asked = Instant::now();
    let request = "GET /short HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let (code, text) = call(addr, request, Duration::from_secs(10))
        .await
        .expect("the newcomer was served");
    assert_eq!(code, 200, "{text}");
    assert!(text.ends_with("short"), "{text}");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(metrics.connections_evicted.get(), 1);
    assert_eq!(metrics.connections_refused.get(), 0);
    drop(stalled);
    server.abort();
}
