//! The HTTP listener's limits: at most `--max-connections` connections open (one more is closed
//! at once, counted), and a connection without traffic for `--http-idle-timeout-secs` is closed
//! (counted), so that idle or slow clients cannot exhaust file descriptors and keep `/healthz`
//! from answering. A connection whose request is still being served (an OpenAI request waiting
//! for its worker, a long generation) is not idle: handlers mark it busy through [`ConnBusy`].

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use crate::metrics::RouterMetrics;

/// A TCP listener that hands out at most `max` connections at once, each closed when idle.
#[derive(Debug)]
pub struct LimitedListener {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    idle: Duration,
    metrics: RouterMetrics,
}

impl LimitedListener {
    /// Limits `inner` to `max` open connections, each closed after `idle` without traffic.
    pub fn new(inner: TcpListener, max: usize, idle: Duration, metrics: RouterMetrics) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max)),
            idle,
            metrics,
        }
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = IdleIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => match self.permits.clone().try_acquire_owned() {
                    Ok(permit) => {
                        self.metrics.connections.inc();
                        return (
                            IdleIo {
                                stream,
                                idle: self.idle,
                                deadline: Box::pin(tokio::time::sleep(self.idle)),
                                busy: ConnBusy::default(),
                                write_deadline: Box::pin(tokio::time::sleep(self.idle)),
                                write_stalled: false,
                                _permit: permit,
                                metrics: self.metrics.clone(),
                            },
                            addr,
                        );
                    }
                    Err(_) => {
                        // Full: close it now rather than let it wait in the backlog.
                        self.metrics.connections_refused.inc();
                        drop(stream);
                    }
                },
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

/// A connection that fails its next read or write once it has been idle too long.
#[derive(Debug)]
pub struct IdleIo {
    stream: TcpStream,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    _permit: OwnedSemaphorePermit,
    metrics: RouterMetrics,
    busy: ConnBusy,
    /// When a write that cannot proceed (the client reads nothing) fails the connection: busy or
    /// not, a client that stops reading does not hold its slot, its worker and its load forever.
    write_deadline: Pin<Box<Sleep>>,
    /// Whether the last write was refused for want of room (the deadline above is running).
    write_stalled: bool,
}

/// Whether a connection has a request in service: while one [`BusyGuard`] lives, the connection
/// is not closed for idleness. Handlers get it through `ConnectInfo<ConnBusy>`.
#[derive(Debug, Clone, Default)]
pub struct ConnBusy(Arc<AtomicUsize>);

impl ConnBusy {
    /// Marks the connection busy until the guard is dropped.
    pub fn hold(&self) -> BusyGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        BusyGuard(self.0.clone())
    }

    fn is_busy(&self) -> bool {
        self.0.load(Ordering::Relaxed) > 0
    }
}

/// Keeps a connection from being closed as idle (see [`ConnBusy`]).
#[derive(Debug)]
pub struct BusyGuard(Arc<AtomicUsize>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, LimitedListener>>
    for ConnBusy
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, LimitedListener>) -> Self {
        stream.io().busy.clone()
    }
}

impl IdleIo {
    fn progress(&mut self) {
        self.deadline.as_mut().reset(Instant::now() + self.idle);
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
}

impl Drop for IdleIo {
    fn drop(&mut self) {
        self.metrics.connections.dec();
    }
}

impl AsyncRead for IdleIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(r) => {
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
        match Pin::new(&mut self.stream).poll_write(cx, buf) {
            Poll::Ready(r) => {
                self.write_stalled = false;
                self.progress();
                Poll::Ready(r)
            }
            Poll::Pending => {
                if !self.write_stalled {
                    self.write_stalled = true;
                    let at = Instant::now() + self.idle;
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
        Pin::new(&mut self.stream).poll_flush(cx)
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
        let mut listener = LimitedListener::new(inner, 4, IDLE, RouterMetrics::new());
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
