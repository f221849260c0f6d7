//! `kvbm-mocker`: runs a simulated vLLM fleet until interrupted (see the crate docs and README).

use clap::Parser;
use kvbm_mocker::config::{presets_text, Args};
use kvbm_mocker::{write_ready_file, Fleet};

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if args.list_presets {
        print!("{}", presets_text(args.block_size));
        return;
    }
    if let Err(e) = args.engine_config() {
        eprintln!("kvbm-mocker: {e}");
        std::process::exit(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.http_threads)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvbm-mocker: starting the runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = runtime.block_on(async {
        let fleet = match Fleet::start(&args).await {
            Ok(f) => f,
            Err(e) => {
                eprintln!("kvbm-mocker: {e:#}");
                return 1;
            }
        };
        let lines = fleet.lines();
        // The file first: whoever reads the lines on stdout finds the file written.
        if let Some(path) = &args.ready_file {
            if let Err(e) = write_ready_file(path, &lines) {
                eprintln!("kvbm-mocker: --ready-file {}: {e}", path.display());
                return 1;
            }
        }
        println!("{}", lines.join("\n"));
        wait_for_signal().await;
        drop(fleet);
        0
    });
    std::process::exit(code);
}

async fn wait_for_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
