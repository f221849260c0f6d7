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

    /// `Pending` from the stream: an error if the deadline passed, else still pending.
    fn check_idle<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        if self.busy.is_busy() {
            // A request is in service: wait another period, then look again.
            self.progress();
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.metrics.connections_timed_out.inc();
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "HTTP connection idle for too long",
                )))
            }
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
                self.progress();
                Poll::Ready(r)
            }
            Poll::Pending => self.check_idle(cx),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
