//! `kvbm-bench disk`: kvbm-disk's store against fio, same file system, block size, queue depth
//! and total bytes, in the same run.
//!
//! kvbm's side is the real store path: each block sits in the buffer behind 4 KiB of header room
//! (as blocks do in kvbm's host tier), so a block and its header move as one contiguous op from
//! the registered buffer (`WRITE_FIXED` / `READ_FIXED`), with the payload checksum computed before
//! the write and verified after the read; all of that is inside the timing. fio's side is `--ioengine=io_uring --direct=1
//! --fixedbufs --registerfiles`, sequential, one job. Figures are medians over `--iterations`.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};

use crate::stats::{fill_block, median};
use clap::{Args, ValueEnum};
use kvbm_disk::{
    AlignedBuf, DiskStore, EngineChoice, Lookup, ReadRequest, StoreOptions, WriteOutcome,
    WriteRequest, REGISTERED_BUFFER_BYTES_MAX,
};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    Auto,
    IoUring,
    Psync,
}

#[derive(Args, Debug)]
pub struct DiskArgs {
    /// Blocks written and read.
    #[arg(long, default_value_t = 512)]
    blocks: usize,
    /// Bytes per block.
    #[arg(long, default_value_t = 2 << 20)]
    block_bytes: usize,
    /// Operations in flight.
    #[arg(long, default_value_t = 16)]
    queue_depth: usize,
    /// kvbm-disk's engine.
    #[arg(long, value_enum, default_value_t = EngineArg::Auto)]
    engine: EngineArg,
    /// Directory for the cache file and fio's file (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Write/read rounds (kvbm and fio alternate who goes first); figures are medians.
    #[arg(long, default_value_t = 5)]
    iterations: usize,
    /// Do not run fio.
    #[arg(long)]
    no_fio: bool,
    /// End with one JSON line of results.
    #[arg(long)]
    json: bool,
}

/// fio's bandwidth in GB/s for one sequential pass, or the reason it could not run.
fn fio(file: &std::path::Path, rw: &str, args: &DiskArgs) -> anyhow::Result<f64> {
    let total = args.blocks * args.block_bytes;
    let output = Command::new("fio")
        .args([
            "--name=kvbm-yardstick",
            &format!("--filename={}", file.display()),
            &format!("--rw={rw}"),
            &format!("--bs={}", args.block_bytes),
            &format!("--size={total}"),
            &format!("--iodepth={}", args.queue_depth),
            "--ioengine=io_uring",
            "--direct=1",
            "--fixedbufs",
            "--registerfiles",
            "--numjobs=1",
            "--output-format=json",
        ])
        .output()
        .context("running fio")?;
    if !output.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).context("fio's JSON")?;
    let side = if rw == "write" { "write" } else { "read" };
    let bytes_per_s = json["jobs"][0][side]["bw_bytes"]
        .as_f64()
        .context("fio's JSON has no bw_bytes")?;
    Ok(bytes_per_s / 1e9)
}

fn fio_installed() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

pub fn run(args: DiskArgs) -> anyhow::Result<bool> {
    if args.blocks == 0 || args.block_bytes == 0 || args.iterations == 0 {
        bail!("--blocks, --block-bytes and --iterations must be at least 1");
    }
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvbm-bench-disk-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let engine = match args.engine {
        EngineArg::Auto => EngineChoice::Auto,
        EngineArg::IoUring => EngineChoice::IoUring,
        EngineArg::Psync => EngineChoice::Psync,
    };
    let area = args.block_bytes.div_ceil(4096) * 4096;
    // Each block: 4 KiB of header room, then its payload area.
    let stride = 4096 + area;
    let mut buffer =
        AlignedBuf::new(args.blocks * stride).context("allocating the block buffer")?;
    for (i, block) in buffer.as_mut_slice().chunks_mut(stride).enumerate() {
        fill_block(i as u64, &mut block[4096..4096 + args.block_bytes]);
    }
    // Registered pieces of at most 1 GiB, cut at block boundaries.
    let piece = (REGISTERED_BUFFER_BYTES_MAX / stride).max(1) * stride;
    let pieces: Vec<(u64, usize)> = (0..buffer.len())
        .step_by(piece)
        .map(|at| (buffer.addr() + at as u64, piece.min(buffer.len() - at)))
        .collect();
    let options = StoreOptions {
        layout_fingerprint: 0xB0B,
        payload_bytes: args.block_bytes,
        slots: args.blocks,
        queue_depth: args.queue_depth,
        engine,
        file: Default::default(),
        write_failures_max: 8,
    };
    // SAFETY: `buffer` outlives the store (the store is dropped before the buffer, below).
    let (store, _) = unsafe { DiskStore::open_with_buffers(&dir, "bench.kvbm", options, &pieces) }
        .context("opening the store")?;
    let io_mode = store.file().io_mode();
    let engine_kind = store.engine().kind();
    let base = buffer.addr();
    let addr = |i: usize| base + (i * stride + 4096) as u64;

    let fio_file = dir.join("fio.dat");
    let fio_note = if args.no_fio {
        "fio skipped (--no-fio)"
    } else if !fio_installed() {
        "fio is not installed (apt-get install fio): no yardstick this run"
    } else {
        "fio: io_uring, O_DIRECT, fixed buffers, registered file; interleaved with kvbm, alternating who goes first"
    };
    let run_fio = !args.no_fio && fio_installed();
    let (mut fio_write, mut fio_read) = (Vec::new(), Vec::new());
    let mut write_gbps = Vec::new();
    let mut read_gbps = Vec::new();
    let mut verified = true;
    let bytes = (args.blocks * args.block_bytes) as f64;
    for round in 0..args.iterations {
        let writes: Vec<WriteRequest> = (0..args.blocks)
            .map(|i| WriteRequest {
                slot: i as u32,
                key: (round * args.blocks + i) as u64,
                addr: addr(i),
                metadata: &[],
                framed: true,
            })
            .collect();
        let reads: Vec<ReadRequest> = writes
            .iter()
            .map(|w| ReadRequest {
                slot: w.slot,
                key: w.key,
                addr: w.addr,
                framed: true,
            })
            .collect();
        // A rate-limited disk favours whoever runs first after a pause: alternate who goes first.
        let fio_first = run_fio && round % 2 == 1;
        if fio_first {
            fio_write.push(fio(&fio_file, "write", &args)?);
        }
        let start = Instant::now();
        // SAFETY: the payloads lie in `buffer`, which is neither written nor freed during the call.
        let outcomes = unsafe { store.write_raw(&writes, Box::new(())) }?;
        let elapsed = start.elapsed();
        if let Some(bad) = outcomes.iter().find(|o| **o != WriteOutcome::Stored) {
            bail!("a block was not stored: {bad:?}");
        }
        write_gbps.push(bytes / elapsed.as_secs_f64() / 1e9);
        if run_fio && !fio_first {
            fio_write.push(fio(&fio_file, "write", &args)?);
        }

        buffer.as_mut_slice().fill(0);
        if fio_first {
            fio_read.push(fio(&fio_file, "read", &args)?);
        }
        let start = Instant::now();
        // SAFETY: the destinations lie in `buffer`, used by nothing else during the call.
        let lookups = unsafe { store.read_raw(&reads, Box::new(())) }?;
        let elapsed = start.elapsed();
        read_gbps.push(bytes / elapsed.as_secs_f64() / 1e9);
        if run_fio && !fio_first {
            fio_read.push(fio(&fio_file, "read", &args)?);
        }
        verified &= lookups.iter().all(|l| *l == Lookup::Hit);
        let mut expected = vec![0u8; args.block_bytes];
        for (i, block) in buffer.as_slice().chunks(stride).enumerate() {
            fill_block(i as u64, &mut expected);
            verified &= block[4096..4096 + args.block_bytes] == expected[..];
        }
    }
    let stats = store.stats();
    let fixed_ops = store.engine().fixed_ops();
    drop(store);
    drop(buffer);
    let _ = std::fs::remove_file(dir.join("bench.kvbm"));

    let _ = std::fs::remove_file(&fio_file);
    if args.dir.is_none() {
        let _ = std::fs::remove_dir(&dir);
    }

    let (w, r) = (median(&write_gbps), median(&read_gbps));
    let (fw, fr) = (median(&fio_write), median(&fio_read));
    println!(
        "kvbm disk: {} blocks of {:.2} MiB, queue depth {}, engine {}, {:?} I/O, in {}",
        args.blocks,
        args.block_bytes as f64 / (1 << 20) as f64,
        args.queue_depth,
        engine_kind.as_str(),
        io_mode,
        dir.display()
    );
    println!("medians over {} iterations; {fio_note}", args.iterations);
    println!(
        "{:<10} {:>10} {:>10} {:>10}",
        "direction", "kvbm GB/s", "fio GB/s", "kvbm/fio"
    );
    println!("{:<10} {:>10.2} {:>10.2} {:>10.2}", "write", w, fw, w / fw);
    println!("{:<10} {:>10.2} {:>10.2} {:>10.2}", "read", r, fr, r / fr);
    println!(
        "verified: {} (hits {}, corrupt {}, write failures {}, fixed-buffer ops {})",
        if verified {
            "every byte of every block"
        } else {
            "MISMATCH"
        },
        stats.read_hits,
        stats.read_corrupt,
        stats.write_failures,
        fixed_ops
    );
    if args.json {
        let num = |x: f64| {
            if x.is_finite() {
                serde_json::json!(x)
            } else {
                serde_json::Value::Null
            }
        };
        println!(
            "{}",
            serde_json::json!({
                "write_gbps": w,
                "read_gbps": r,
                "fio_write_gbps": num(fw),
                "fio_read_gbps": num(fr),
                "write_vs_fio": num(w / fw),
                "read_vs_fio": num(r / fr),
                "block_bytes": args.block_bytes,
                "blocks": args.blocks,
                "queue_depth": args.queue_depth,
                "engine": engine_kind.as_str(),
                "io_mode": format!("{io_mode:?}"),
                "iterations": args.iterations,
                "verified": verified,
                "fixed_buffer_ops": fixed_ops,
            })
        );
    }
    Ok(verified)
}
