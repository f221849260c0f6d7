//! The HTTP listener's limits, so that idle, slow or many clients cannot exhaust file descriptors
//! and keep `/healthz` from answering:
//!
//! - at most `--max-connections` connections are open. When all are, a new connection makes
//!   room by closing the oldest one that is not being answered (still sending its request's
//!   headers or body, or idle between requests; counted in `kv_router_connections_evicted_total`);
//!   only when every open connection is being answered is the new one closed at once (counted
//!   in `kv_router_connections_refused_total`). A connection is safe from eviction for
//!   [`EVICTION_GRACE`] after it opens (time to send its request and have it read), and
//!   newcomers are let in in turn, each waiting until the oldest candidate is that old. A flood
//!   of slow clients thus cannot hold every slot: each newcomer, a health check included, takes
//!   the slot of the oldest of them within about (newcomers ahead / max) x the grace. A
//!   connection whose request reached its handler is never cut for room, even if picked just
//!   before: the mark is set only outside that phase and acted on only outside it. An evicted
//!   connection still sending the end of an answer (a client reading slowly or not at all) is
//!   cut once that is sent or [`EVICTION_FLUSH`] after the eviction, so it cannot keep the
//!   newcomer out.
//! - a request's headers must arrive within `--http-header-timeout-secs` of the connection (or
//!   of the first byte of a later request on it), and its body within `--http-body-timeout-secs`
//!   of its headers. Traffic does not extend these deadlines: a client trickling a byte at a
//!   time is closed at them (`kv_router_connections_deadline_total{phase}`).
//! - a connection without traffic for `--http-idle-timeout-secs` is closed (counted). A
//!   connection whose request is still being served (an OpenAI request waiting for its worker, a
//!   long generation) is not idle: handlers mark it busy through [`ConnBusy`]. A client that
//!   reads nothing of its answer is closed after the same time, busy or not.
//!
//! Where a request is (headers, body, being answered, done) is told to the connection by
//! [`track_request`], a middleware [`crate::serve_app`] puts around every route.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::connect_info::ConnectInfo;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::task::AtomicWaker;
use http_body::{Frame, SizeHint};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use crate::metrics::RouterMetrics;

/// How long a new connection waits, at most, for the connection it evicted to give its slot
/// back; past it the new one is refused (counted).
pub const EVICTION_WAIT: Duration = Duration::from_secs(1);

/// How long a connection is safe from eviction after it opened, finished an answer, or started
/// sending a request's body: time enough for a health check to send its request and be read.
pub const EVICTION_GRACE: Duration = Duration::from_millis(250);

/// How long an evicted connection may go on sending the end of an answer it had written (a
/// client reading slowly or not at all) before it is cut anyway: less than [`EVICTION_WAIT`], so
/// the newcomer that evicted it gets its slot.
pub const EVICTION_FLUSH: Duration = Duration::from_millis(500);

/// The time limits of each connection.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Without traffic (and not busy) this long, a connection is closed.
    pub idle: Duration,
    /// A request's headers must arrive within this.
    pub header: Duration,
    /// A request's body must arrive within this once its headers did.
    pub body: Duration,
}

/// Open connections by accept order, for eviction.
type Registry = Arc<Mutex<BTreeMap<u64, Arc<ConnShared>>>>;

/// A TCP listener that hands out at most `max` connections at once, each with the deadlines of
/// [`ConnLimits`].
#[derive(Debug)]
pub struct LimitedListener {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    limits: ConnLimits,
    metrics: RouterMetrics,
    open: Registry,
    next_id: u64,
}

impl LimitedListener {
    /// Limits `inner` to `max` open connections, each with `limits`.
    pub fn new(inner: TcpListener, max: usize, limits: ConnLimits, metrics: RouterMetrics) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max)),
            limits,
            metrics,
            open: Arc::default(),
            next_id: 0,
        }
    }

    /// All slots are taken: closes the oldest connection not being answered and waits for its
    /// slot. None if there is none such, or it did not give its slot back in time.
    ///
    /// A connection is not evicted within [`EVICTION_GRACE`] of entering its phase: a newcomer
    /// (a health check) has that long to send its request before a flood's later newcomers may
    /// take its slot. Newcomers are taken in turn, each waiting until the oldest candidate is
    /// that old (or a slot frees), so slots change hands at most `max` per grace period.
    async fn evict_for_room(&self) -> Option<OwnedSemaphorePermit> {
        loop {
            let (since, victim) = self.oldest_evictable()?;
            let ripe = since + EVICTION_GRACE;
            if ripe > Instant::now() {
                tokio::select! {
                    permit = self.permits.clone().acquire_owned() => return permit.ok(),
                    () = tokio::time::sleep_until(ripe) => continue,
                }
            }
            if !victim.evict() {
                // It began being answered meanwhile: look for another.
                continue;
            }
            self.metrics.connections_evicted.inc();
            return match tokio::time::timeout(EVICTION_WAIT, self.permits.clone().acquire_owned())
                .await
            {
                Ok(Ok(permit)) => Some(permit),
                _ => None,
            };
        }
    }

    /// The open connection not being answered that entered its phase first (one still sending
    /// a request's body after all others), and when it did.
    fn oldest_evictable(&self) -> Option<(Instant, Arc<ConnShared>)> {
        let open = self.open.lock();
        open.values()
            .filter(|c| !c.evicted.load(Ordering::Relaxed) && !c.is_busy())
            .filter_map(|c| {
                let state = c.state.lock();
                match state.phase {
                    // Still sending a request's body ranks after the others: it is further along,
                    // and bounded by the body deadline anyway.
                    Phase::Idle | Phase::Headers => Some(((false, state.since), c.clone())),
                    Phase::Body => Some(((true, state.since), c.clone())),
                    Phase::Service => None,
                }
            })
            .min_by_key(|(key, _)| *key)
            .map(|((_, since), c)| (since, c))
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = IdleIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let permit = match self.permits.clone().try_acquire_owned() {
                        Ok(permit) => Some(permit),
                        Err(_) => self.evict_for_room().await,
                    };
                    let Some(permit) = permit else {
                        // Full of connections being answered: close it now rather than let it
                        // wait in the backlog.
                        self.metrics.connections_refused.inc();
                        drop(stream);
                        continue;
                    };
                    self.metrics.connections.inc();
                    let id = self.next_id;
                    self.next_id += 1;
                    let shared = Arc::new(ConnShared::new());
                    self.open.lock().insert(id, shared.clone());
                    let idle = self.limits.idle;
                    return (
                        IdleIo {
                            stream,
                            limits: self.limits,
                            deadline: Box::pin(tokio::time::sleep(idle)),
                            busy: ConnBusy(shared),
                            write_deadline: Box::pin(tokio::time::sleep(idle)),
                            write_stalled: false,
                            phase_deadline: Box::pin(tokio::time::sleep(idle)),
                            phase_seen: u64::MAX,
                            phase_armed: None,
                            _permit: permit,
                            metrics: self.metrics.clone(),
                            unflushed: false,
                            flush_deadline: None,
                            open: self.open.clone(),
                            id,
                        },
                        addr,
                    );
                }
                Err(err) => {
                    // Out of descriptors or a transient error: back off, never spin.
                    tracing::warn!(error = %err, "accepting an HTTP connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// Where a connection's current request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Between requests: nothing of the next one read yet.
    Idle,
    /// Reading a request's headers (the header deadline runs).
    Headers,
    /// Reading a request's body (the body deadline runs).
    Body,
    /// The request is read; it is being answered.
    Service,
}

#[derive(Debug)]
struct PhaseState {
    phase: Phase,
    /// When the phase began.
    since: Instant,
    /// Requests whose answer is not yet sent whole.
    requests: usize,
    /// When the listener evicted the connection, if it did.
    evicted_at: Option<Instant>,
}

/// What a connection shares with its handlers and its listener.
#[derive(Debug)]
struct ConnShared {
    busy: AtomicUsize,
    state: Mutex<PhaseState>,
    /// Bumped at each change of `state`, so the connection looks at it only then.
    generation: AtomicU64,
    /// Set by the listener (under `state`'s lock, never while a request is being answered) to
    /// close the connection for room; acted on only outside [`Phase::Service`].
    evicted: AtomicBool,
    /// The connection's task, woken on eviction.
    waker: AtomicWaker,
}

impl ConnShared {
    fn new() -> Self {
        Self {
            busy: AtomicUsize::new(0),
            // A client connects to send a request: the header deadline runs from the start.
            state: Mutex::new(PhaseState {
                phase: Phase::Headers,
                since: Instant::now(),
                requests: 0,
                evicted_at: None,
            }),
            generation: AtomicU64::new(0),
            evicted: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        }
    }

    fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed) > 0
    }

    /// Marks the connection evicted and wakes it, unless a request on it is being answered (then
    /// false): the phase is looked at and the mark set under one lock, so a request that reaches
    /// [`Phase::Service`] is either seen here or never cut for it.
    fn evict(&self) -> bool {
        {
            let mut state = self.state.lock();
            if state.phase == Phase::Service
                || self.is_busy()
                || self.evicted.load(Ordering::Acquire)
            {
                return false;
            }
            state.evicted_at = Some(Instant::now());
            self.evicted.store(true, Ordering::Release);
        }
        self.waker.wake();
        true
    }

    fn set_phase(&self, state: &mut PhaseState, phase: Phase) {
        state.phase = phase;
        state.since = Instant::now();
        // The connection re-arms its deadline on its next read (a request's body is read when
        // its handler polls it; the next request's headers, right after the answer).
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// The first bytes of a request after an idle spell: its header deadline starts.
    fn bytes_read(&self) {
        let mut state = self.state.lock();
        if state.phase == Phase::Idle {
            self.set_phase(&mut state, Phase::Headers);
        }
    }

    /// A request's headers arrived.
    fn request_started(&self, body_done: bool) {
        let mut state = self.state.lock();
        state.requests += 1;
        let phase = if body_done {
            Phase::Service
        } else {
            Phase::Body
        };
        self.set_phase(&mut state, phase);
    }

    /// A request's body was read whole, or its handler dropped it.
    fn body_done(&self) {
        let mut state = self.state.lock();
        if state.phase == Phase::Body {
            self.set_phase(&mut state, Phase::Service);
        }
    }

    /// A request's answer was sent whole (or dropped).
    fn request_finished(&self) {
        let mut state = self.state.lock();
        state.requests = state.requests.saturating_sub(1);
        if state.requests == 0 {
            self.set_phase(&mut state, Phase::Idle);
        }
    }
}

/// Whether a connection has a request in service: while one [`BusyGuard`] lives, the connection
/// is not closed for idleness. Handlers get it through `ConnectInfo<ConnBusy>`.
#[derive(Debug, Clone)]
pub struct ConnBusy(Arc<ConnShared>);

impl Default for ConnBusy {
    fn default() -> Self {
        Self(Arc::new(ConnShared::new()))
    }
}

impl ConnBusy {
    /// Marks the connection busy until the guard is dropped.
    pub fn hold(&self) -> BusyGuard {
        self.0.busy.fetch_add(1, Ordering::Relaxed);
        BusyGuard(self.0.clone())
    }

    fn is_busy(&self) -> bool {
        self.0.is_busy()
    }
}

/// Keeps a connection from being closed as idle (see [`ConnBusy`]).
#[derive(Debug)]
pub struct BusyGuard(Arc<ConnShared>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, LimitedListener>>
    for ConnBusy
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, LimitedListener>) -> Self {
        stream.io().busy.clone()
    }
}

/// Middleware telling the connection where each request is: its headers are read (the header
/// deadline stops, the body deadline starts), its body is read (the body deadline stops), its
/// answer is sent (the connection is idle until the next request's first byte).
pub async fn track_request(request: Request, next: Next) -> Response {
    let Some(conn) = request
        .extensions()
        .get::<ConnectInfo<ConnBusy>>()
        .map(|c| c.0 .0.clone())
    else {
        return next.run(request).await;
    };
    conn.request_started(http_body::Body::is_end_stream(request.body()));
    let answered = Answered(conn.clone());
    let request = request.map(|body| {
        Body::new(TrackedBody {
            inner: body,
            on_end: Some(conn),
            _answered: None,
        })
    });
    let response = next.run(request).await;
    response.map(|body| {
        Body::new(TrackedBody {
            inner: body,
            on_end: None,
            _answered: Some(answered),
        })
    })
}

/// Tells its connection that a request was answered when dropped.
struct Answered(Arc<ConnShared>);

impl Drop for Answered {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A body that tells its connection when it ends (a request's) or is dropped (an answer's).
struct TrackedBody {
    inner: Body,
    /// Told when the body ends or is dropped, whichever comes first.
    on_end: Option<Arc<ConnShared>>,
    _answered: Option<Answered>,
}

impl TrackedBody {
    fn ended(&mut self) {
        if let Some(conn) = self.on_end.take() {
            conn.body_done();
        }
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        self.ended();
    }
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None | Some(Err(_))) => self.ended(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.ended(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A connection that fails its next read or write once it has been idle too long, once its
/// request's headers or body are late, or once it is evicted.
#[derive(Debug)]
pub struct IdleIo {
    stream: TcpStream,
    limits: ConnLimits,
    deadline: Pin<Box<Sleep>>,
    _permit: OwnedSemaphorePermit,
    metrics: RouterMetrics,
    busy: ConnBusy,
    /// When a write that cannot proceed (the client reads nothing) fails the connection: busy or
    /// not, a client that stops reading does not hold its slot, its worker and its load forever.
    write_deadline: Pin<Box<Sleep>>,
    /// Whether the last write was refused for want of room (the deadline above is running).
    write_stalled: bool,
    /// The deadline of the request's headers or body, when one runs (`phase_armed`).
    phase_deadline: Pin<Box<Sleep>>,
    /// The phase generation `phase_deadline` was set for.
    phase_seen: u64,
    /// The phase whose deadline runs, if any ("headers" or "body").
    phase_armed: Option<&'static str>,
    /// Whether bytes were written and not yet flushed: an evicted connection first sends them,
    /// for at most [`EVICTION_FLUSH`].
    unflushed: bool,
    /// When an evicted connection with unflushed bytes is cut anyway.
    flush_deadline: Option<Pin<Box<Sleep>>>,
    open: Registry,
    id: u64,
}

impl IdleIo {
    fn progress(&mut self) {
        self.deadline
            .as_mut()
            .reset(Instant::now() + self.limits.idle);
    }

    /// Fails the connection (counted).
    fn timed_out<T>(&self, why: &'static str) -> Poll<io::Result<T>> {
        self.metrics.connections_timed_out.inc();
        Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)))
    }

    /// `Pending` from the stream: an error if the deadline passed, else still pending.
    fn check_idle<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        if self.busy.is_busy() && !self.write_stalled {
            // A request is in service: wait another period, then look again.
            self.progress();
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => self.timed_out("HTTP connection idle for too long"),
            Poll::Pending => Poll::Pending,
        }
    }

    /// An error if the connection was evicted and no request on it is being answered: at once,
    /// or once what it wrote is flushed, or [`EVICTION_FLUSH`] after the eviction, whichever is
    /// first.
    fn check_evicted<T>(&mut self, cx: &mut Context<'_>) -> Option<Poll<io::Result<T>>> {
        let shared = &self.busy.0;
        shared.waker.register(cx.waker());
        if !shared.evicted.load(Ordering::Acquire) {
            return None;
        }
        let evicted_at = {
            let state = shared.state.lock();
            if state.phase == Phase::Service {
                // Marked before its request was read whole: it is cut once the answer is sent.
                return None;
            }
            state.evicted_at.unwrap_or_else(Instant::now)
        };
        if self.unflushed {
            let flush = self.flush_deadline.get_or_insert_with(|| {
                Box::pin(tokio::time::sleep_until(evicted_at + EVICTION_FLUSH))
            });
            if flush.as_mut().poll(cx).is_pending() {
                return None;
            }
        }
        Some(Poll::Ready(Err(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "HTTP connection closed to make room for another",
        ))))
    }

    /// An error if the connection was evicted or its request's headers or body are late.
    fn check_cut<T>(&mut self, cx: &mut Context<'_>) -> Option<Poll<io::Result<T>>> {
        if let Some(cut) = self.check_evicted(cx) {
            return Some(cut);
        }
        let shared = &self.busy.0;
        let generation = shared.generation.load(Ordering::Acquire);
        if generation != self.phase_seen {
            self.phase_seen = generation;
            let state = shared.state.lock();
            self.phase_armed = match state.phase {
                Phase::Headers => {
                    let at = state.since + self.limits.header;
                    self.phase_deadline.as_mut().reset(at);
                    Some("headers")
                }
                Phase::Body => {
                    let at = state.since + self.limits.body;
                    self.phase_deadline.as_mut().reset(at);
                    Some("body")
                }
                Phase::Idle | Phase::Service => None,
            };
        }
        let phase = self.phase_armed?;
        match self.phase_deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.metrics
                    .connections_deadline
                    .with_label_values(&[phase])
                    .inc();
                Some(Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    if phase == "headers" {
                        "HTTP request headers not received in time"
                    } else {
                        "HTTP request body not received in time"
                    },
                ))))
            }
            Poll::Pending => None,
        }
    }
}

impl Drop for IdleIo {
    fn drop(&mut self) {
        self.open.lock().remove(&self.id);
        self.metrics.connections.dec();
    }
}

impl AsyncRead for IdleIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(cut) = self.check_cut(cx) {
            return cut;
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if r.is_ok() && buf.filled().len() > before {
                    self.busy.0.bytes_read();
                }
                self.progress();
                Poll::Ready(r)
            }
            Poll::Pending => self.check_idle(cx),
        }
    }
}

impl AsyncWrite for IdleIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        // An evicted connection still sends what it was writing (the end of an answer whose
        // body was done), for a bounded time: it is cut once that is flushed or the time is up.
        self.unflushed = true;
        if let Some(cut) = self.check_evicted(cx) {
            return cut;
        }
        match Pin::new(&mut self.stream).poll_write(cx, buf) {
            Poll::Ready(r) => {
                self.write_stalled = false;
                self.progress();
                Poll::Ready(r)
            }
            Poll::Pending => {
                if !self.write_stalled {
                    self.write_stalled = true;
                    let at = Instant::now() + self.limits.idle;
                    self.write_deadline.as_mut().reset(at);
                }
                match self.write_deadline.as_mut().poll(cx) {
                    Poll::Ready(()) => self.timed_out("HTTP client read nothing for too long"),
                    Poll::Pending => self.check_idle(cx),
                }
            }
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(cut) = self.check_evicted(cx) {
            return cut;
        }
        let flushed = Pin::new(&mut self.stream).poll_flush(cx);
        if flushed.is_ready() {
            self.unflushed = false;
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const IDLE: Duration = Duration::from_millis(200);

    async fn pair() -> (IdleIo, TcpStream) {
        let inner = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = inner.local_addr().unwrap();
        let limits = ConnLimits {
            idle: IDLE,
            header: Duration::from_secs(3600),
            body: Duration::from_secs(3600),
        };
        let mut listener = LimitedListener::new(inner, 4, limits, RouterMetrics::new());
        let client = TcpStream::connect(addr).await.unwrap();
        let (io, _) = listener.accept().await;
        (io, client)
    }

    #[tokio::test]
    async fn an_idle_connection_is_closed_unless_a_request_is_in_service() {
        let (mut idle, _client) = pair().await;
        let mut buf = [0u8; 16];
        let err = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buf))
            .await
            .expect("the idle timeout fired")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);

        let (mut busy, mut client) = pair().await;
        let guard = busy.busy.hold();
        // Five idle periods without traffic: still open while busy.
        let read = tokio::time::timeout(IDLE * 5, busy.read(&mut buf)).await;
        assert!(
            read.is_err(),
            "a busy connection was closed as idle: {read:?}"
        );
        client.write_all(b"ping").await.unwrap();
        assert_eq!(busy.read(&mut buf).await.unwrap(), 4);
        drop(guard);
        let err = tokio::time::timeout(Duration::from_secs(5), busy.read(&mut buf))
            .await
            .expect("the idle timeout fired once the request was done")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn an_eviction_racing_the_end_of_a_request_never_cuts_its_answer() {
        let (mut io, mut client) = pair().await;
        let shared = io.busy.0.clone();
        // Picked while still sending its headers, which arrive just after: being answered.
        assert!(shared.evict());
        shared.request_started(true);
        // Being answered, it is not picked again.
        assert!(!shared.evict());
        // hyper reads on while it answers (pipelined bytes, or the client's EOF): not cut.
        client.write_all(b"more").await.unwrap();
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(5), io.read(&mut buf)).await;
        assert_eq!(read.expect("read").expect("cut while answering"), 4);
        io.write_all(b"answer").await.expect("cut while answering");
        io.flush().await.expect("cut while answering");
        // Answered: now it gives its slot back.
        shared.request_finished();
        let err = tokio::time::timeout(Duration::from_secs(5), io.read(&mut buf))
            .await
            .expect("read")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
        // A connection being answered is never marked.
        let (other, _client) = pair().await;
        other.busy.0.request_started(true);
        assert!(!other.busy.0.evict());
        assert!(!other.busy.0.evicted.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn a_client_that_reads_nothing_is_dropped_even_while_busy() {
        let (mut io, _client) = pair().await;
        let _guard = io.busy.hold();
        let chunk = vec![0u8; 64 << 10];
        // The client never reads: the socket buffers fill, then writes stall and must fail.
        let outcome = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                if let Err(e) = io.write_all(&chunk).await {
                    return e;
                }
            }
        })
        .await
        .expect("a stalled write was not failed");
        assert_eq!(outcome.kind(), io::ErrorKind::TimedOut);
    }
}
