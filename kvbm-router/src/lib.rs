//! `kvbm-router`: a KV-aware router service. It follows workers' KV cache events over ZMQ (vLLM's
//! wire format, kvbm's host and disk tiers included), keeps the per-worker, per-tier block index
//! of `kvbm-events`, and answers over HTTP which worker should serve a request: the one holding
//! most of its prefix, weighed against how busy each worker is (Dynamo's default cost).
//!
//! With `--model-path`, it is also an OpenAI-compatible front end ([`frontend`]): it tokenizes each
//! request as the worker will ([`tokenize`]), routes it, and forwards it to the chosen worker's
//! own HTTP server.
//!
//! Modules: [`config`] (command line, `--workers`), [`discovery`] (`--workers-file`), [`dump`] (`GET /dump`,
//! `--bootstrap-from`), [`state`] (the router: index, load, workers,
//! the event pump), [`http`] (the JSON API), [`listener`] (connection limits), [`metrics`]
//! (Prometheus).

pub mod config;
pub mod discovery;
pub mod dump;
pub mod frontend;
pub mod http;
pub mod listener;
pub mod metrics;
pub mod state;
pub mod tokenize;

use std::net::SocketAddr;
use std::sync::Arc;

pub use config::{parse_worker, parse_workers, Args, ConfigError, RouterConfig};
pub use state::{QueryAnswer, RouteAnswer, Router};

/// Serves the API of `router` (and the OpenAI front end, if on) on `listener` until `shutdown`
/// completes, with the connection limits of its configuration (`--max-connections`,
/// `--http-idle-timeout-secs`, `--http-header-timeout-secs`, `--http-body-timeout-secs`).
pub async fn serve(
    router: Arc<Router>,
    frontend: Option<Arc<frontend::Frontend>>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let config = router.config();
    let max = config.max_connections;
    let limits = listener::ConnLimits {
        idle: config.http_idle_timeout,
        header: config.http_header_timeout,
        body: config.http_body_timeout,
    };
    let metrics = router.metrics().clone();
    serve_app(
        http::app(router, frontend),
        listener,
        max,
        limits,
        metrics,
        shutdown,
    )
    .await
}

/// Serves `app` on `listener` until `shutdown` completes, at most `max` connections at once, each
/// with `limits` (see [`listener`]), counted in `metrics`. Handlers find the connection's
/// [`listener::ConnBusy`] in `ConnectInfo`.
pub async fn serve_app(
    app: axum::Router,
    listener: tokio::net::TcpListener,
    max: usize,
    limits: listener::ConnLimits,
    metrics: metrics::RouterMetrics,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limited = listener::LimitedListener::new(listener, max, limits, metrics);
    let app = app.layer(axum::middleware::from_fn(listener::track_request));
    axum::serve(
        limited,
        app.into_make_service_with_connect_info::<listener::ConnBusy>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// Binds the API's listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
