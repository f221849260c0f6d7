//! `kvbm-bench`: kvbm's standalone benchmarks.
//!
//! - `offload`: GPU -> host -> GPU through the block manager, every byte verified, next to a plain
//!   memcpy of the same bytes in the same run.
//! - `disk`: blocks written to and read from kvbm-disk's store, verified, next to fio with the same
//!   block size, queue depth and bytes on the same file system.

mod disk;
mod offload;
mod stats;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "kvbm-bench", about = "kvbm's standalone benchmarks", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Offload GPU blocks to the pinned host tier and onboard them back, verified, against memcpy.
    Offload(offload::OffloadArgs),
    /// Write and read blocks through kvbm-disk (io_uring, O_DIRECT, registered buffers) against fio.
    Disk(disk::DiskArgs),
}

fn main() -> std::process::ExitCode {
    let filter = std::env::var("DYN_LOG").unwrap_or_else(|_| "warn".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| {
                eprintln!("DYN_LOG={filter:?} is not a valid log filter; using \"warn\"");
                tracing_subscriber::EnvFilter::new("warn")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Offload(args) => offload::run(args),
        Command::Disk(args) => disk::run(args),
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(err) => {
            eprintln!("kvbm-bench: {err:#}");
            std::process::ExitCode::from(2)
        }
    }
}
