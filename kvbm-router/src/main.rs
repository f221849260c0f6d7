//! The `kvbm-router` command: see `kvbm-router --help`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use kvbm_router::{parse_workers, Args, Router};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = EnvFilter::try_from_env("DYN_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to stderr; stdout carries only the "listening" line.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let config = args.router_config()?;
    for warning in args.deprecated_flags() {
        tracing::warn!("{warning}");
    }
    tracing::info!(mode = %config.selector.mode, weights = ?config.selector.weights(), "routing mode");
    if !args.http_host.is_loopback() && config.admin_token.is_none() {
        tracing::warn!(host = %args.http_host, "the API is reachable from the network without an admin token: anyone who reaches it can register a worker and receive requests (set KVBM_ROUTER_ADMIN_TOKEN)");
    }
    let workers = parse_workers(&args.workers)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr = SocketAddr::new(args.http_host, args.http_port);
        let listener = kvbm_router::bind(addr)
            .await
            .with_context(|| format!("binding the HTTP API to {addr}"))?;
        let bound = listener.local_addr()?;
        let bootstrap = args.bootstrap_from.clone();
        let router = tokio::task::spawn_blocking(move || -> anyhow::Result<Router> {
            // A dump that cannot be fetched or is over a bound is left out (logged, counted),
            // or stops the start with --bootstrap-required.
            kvbm_router::dump::start(config, workers, bootstrap.as_deref())
                .context("starting the router")
        })
        .await??;
        let router = Arc::new(router);
        let frontend = kvbm_router::frontend::Frontend::load(&router)?;
        if let Some(fe) = &frontend {
            tracing::info!(model = ?fe, "OpenAI front end on");
        }
        let _watcher = match &args.workers_file {
            Some(path) => Some(
                kvbm_router::discovery::watch(
                    &router,
                    path.clone(),
                    std::time::Duration::from_secs(1),
                )
                .context("starting the workers-file watcher")?,
            ),
            None => None,
        };
        // The line tests and scripts wait for.
        println!("kvbm-router listening on http://{bound}");
        tracing::info!(%bound, "serving");
        kvbm_router::serve(router, frontend, listener, shutdown_signal())
            .await
            .context("serving HTTP")
    })
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}
