//! `kvbm-bench offload`: the standalone offload benchmark.
//!
//! Fills GPU blocks with pseudo-random bytes, offloads them to the host tier (D2H), scribbles over
//! the GPU, onboards them back into other GPU blocks (H2D), and checks every byte. Each direction
//! is timed end to end through the block manager (allocation, piece lists, copies, completion,
//! registration). The yardstick is a single-threaded memcpy of the same bytes, block by block,
//! between two prefaulted buffers, in the same run. Figures are medians over `--iterations`.
//!
//! `--engine split` (the default) runs what the vLLM connector runs: kvbm-core's `Leader` plans
//! each step, the plan crosses as MessagePack bytes, kvbm-core's `Worker` executes it over GPU
//! memory laid out as vLLM lays it out (the timings include planning, encoding and decoding);
//! with a disk tier, blocks come back from disk asynchronously (disk -> staging host -> GPU), as
//! the connector onboards them. `--engine manager` runs the `BlockManager` (GPU, host and disk
//! pools in one process). Both move bytes through the same copy engine and disk hand-off.
//!
//! `--layout` is the GPU tier's layout: vLLM 0.33's one backing buffer viewed per layer in one of
//! its `KVCacheLayout`s (`lbnhc`, the default, `lbhnc`, `lhbnc`, `blhnc`, `blnhc`, `bhlnc`), or
//! the per-layer tensors of older releases (`outer-first`, `block-first`). The pieces per block
//! come from kvbm-core's placement of that layout, as the manager builds it.

use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::stats::{fill_block, median, percentile};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvbm_core::{
    BlockManager, GpuLayout, GpuMemory, KvLayout, LayerShape, ManagerOptions, PhysicalLayout,
    RegisteredBlock, TransferLimits, TransferOutcome,
};
use kvbm_cuda::{BackendChoice, Device};
use kvbm_events::BlockHasher;

/// A GPU layout on the command line: a vLLM 0.33 `KVCacheLayout` name (any case, or vLLM's
/// aliases `nhd`/`hnd`), or an older per-layer shape (`outer-first`, `block-first`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LayoutArg {
    /// vLLM's per-layer tensors before 0.33.
    LayerSeparate(LayerShape),
    /// vLLM 0.33's views of one backing buffer.
    Paged(PhysicalLayout),
}

impl FromStr for LayoutArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "outer-first" => Ok(Self::LayerSeparate(LayerShape::OuterFirst)),
            "block-first" => Ok(Self::LayerSeparate(LayerShape::BlockFirst)),
            _ => PhysicalLayout::from_str(s).map(Self::Paged).map_err(|_| {
                format!(
                    "unknown layout {s:?}: expected one of lbnhc, lbhnc, lhbnc, blhnc, blnhc, \
                         bhlnc (vLLM 0.33), outer-first, block-first (older vLLM)"
                )
            }),
        }
    }
}

impl LayoutArg {
    /// The block manager's GPU layout, with `num_heads` KV heads per layer for a paged one.
    pub fn gpu_layout(self, num_heads: usize) -> GpuLayout {
        match self {
            Self::LayerSeparate(shape) => GpuLayout::LayerSeparate(shape),
            Self::Paged(layout) => GpuLayout::Paged { layout, num_heads },
        }
    }
}

/// The yardstick: `blocks` blocks of `block_bytes` copied with memcpy, block by block, between
/// two prefaulted buffers; the median GB/s over `iterations` passes.
pub fn memcpy_gbps(blocks: usize, block_bytes: usize, iterations: usize) -> f64 {
    let bytes = blocks * block_bytes;
    let mut src = vec![0u8; bytes];
    let mut dst = vec![0u8; bytes];
    src.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    dst.fill(1);
    let mut runs = Vec::new();
    for _ in 0..iterations {
        let start = Instant::now();
        for (d, s) in dst.chunks_mut(block_bytes).zip(src.chunks(block_bytes)) {
            d.copy_from_slice(s);
        }
        runs.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(&dst);
    }
    median(&runs)
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    /// kvbm-core's BlockManager (GPU, host and disk pools in one process).
    Manager,
    /// kvbm-core's Leader and Worker with plans as bytes, as the vLLM connector runs them.
    Split,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Auto,
    Cuda,
    Emulated,
}

/// Model shapes as vLLM 0.33 lays out one KV cache block of them (`--model`).
///
/// A hybrid model's block is one KV cache group's share of the buffer every group overlays
/// (`vllm/v1/core/kv_cache_planning.py`, `_get_kv_cache_groups_uniform_page_size`): as many
/// layers as a group has, whatever the group's kind, since a Mamba group's state pages are
/// padded to the attention page.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModelArg {
    /// Qwen3-0.6B (one group): 28 layers, 8 KV heads of 128, 16-token blocks.
    #[value(name = "qwen3-0.6b")]
    Qwen3_0_6b,
    /// gpt-oss-20b with vLLM's hybrid manager: groups of 12 layers (sliding window 128 and
    /// full attention), 8 KV heads of 64, 16-token blocks.
    #[value(name = "gpt-oss-20b")]
    GptOss20b,
    /// Gemma-3-12B with vLLM's hybrid manager: 6 groups of 8 layers (5 sliding window 1024,
    /// 1 full), 8 KV heads of 256, 16-token blocks.
    #[value(name = "gemma-3-12b")]
    Gemma3_12b,
    /// Qwen3-Next-80B-A3B with vLLM's hybrid manager: groups of 12 layers (3 gated-delta-net
    /// state groups, 1 full attention), 2 KV heads of 256, blocks raised to 544 tokens so that
    /// an attention page holds a state (`Platform._align_hybrid_block_size`).
    #[value(name = "qwen3-next-80b")]
    Qwen3Next80b,
}

impl ModelArg {
    /// (layers per block, KV heads, head size, block size in tokens).
    fn shape(self) -> (usize, usize, usize, usize) {
        match self {
            ModelArg::Qwen3_0_6b => (28, 8, 128, 16),
            ModelArg::GptOss20b => (12, 8, 64, 16),
            ModelArg::Gemma3_12b => (8, 8, 256, 16),
            ModelArg::Qwen3Next80b => (12, 2, 256, 544),
        }
    }
}

/// The default model shape is Qwen3-0.6B: 28 layers, 8 KV heads of 128, bf16, 16-token blocks.
#[derive(Args, Debug)]
pub struct OffloadArgs {
    /// A model's block shape (sets --layers, --kv-heads, --head-size and --block-size, bf16).
    #[arg(long, value_enum)]
    model: Option<ModelArg>,
    /// Blocks moved in each direction.
    #[arg(long, default_value_t = 1024)]
    blocks: usize,
    /// Attention layers.
    #[arg(long, default_value_t = 28)]
    layers: usize,
    /// KV heads per layer (per tensor-parallel rank).
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Head size.
    #[arg(long, default_value_t = 128)]
    head_size: usize,
    /// Bytes per element (2 for bf16).
    #[arg(long, default_value_t = 2)]
    dtype_bytes: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// MLA: one latent per layer instead of K and V.
    #[arg(long)]
    mla: bool,
    /// GPU layout: vLLM 0.33's lbnhc (its default), lbhnc, lhbnc, blhnc, blnhc, bhlnc (one
    /// buffer viewed per layer, --kv-heads heads; 1 with --mla), or the older per-layer tensors
    /// outer-first ([2, n_blocks, ...], FlashAttention) and block-first ([n_blocks, 2, ...]).
    #[arg(long, default_value = "lbnhc")]
    layout: LayoutArg,
    /// Host tier size in GB (10^9 bytes); must hold --blocks.
    #[arg(long, default_value_t = 2.0)]
    host_gb: f64,
    /// Device back end.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    device: DeviceArg,
    /// Which engine: the split engine the vLLM connector runs (the default), or the block
    /// manager.
    #[arg(long, value_enum, default_value_t = EngineArg::Split)]
    engine: EngineArg,
    /// Blocks per transfer batch.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Transfer batches in flight.
    #[arg(long, default_value_t = 4)]
    concurrent: usize,
    /// Offload/onboard cycles; figures are medians.
    #[arg(long, default_value_t = 3)]
    iterations: usize,
    /// End with one JSON line of results.
    #[arg(long)]
    json: bool,
    /// Disk tier size in GB (0: no disk tier). With a disk tier every block goes
    /// Gpu -> Host -> Disk and comes back Disk -> Host -> Gpu before it is verified.
    #[arg(long, default_value_t = 0.0)]
    disk_gb: f64,
    /// Directory of the disk cache file (default: a fresh one in the system temp dir).
    #[arg(long)]
    disk_dir: Option<std::path::PathBuf>,
    /// Publish the run's KV events over ZMQ here (vLLM's wire format), e.g.
    /// tcp://127.0.0.1:5557, so that a router (kvbm's or Dynamo's) can watch the run.
    #[arg(long)]
    kv_events_endpoint: Option<String>,
    /// Serve replays of the run's KV events here (a ROUTER socket), with --kv-events-endpoint.
    #[arg(long)]
    kv_events_replay_endpoint: Option<String>,
}

struct Direction {
    gbps: Vec<f64>,
    block_latency_ms: Vec<f64>,
}

impl Direction {
    fn new() -> Self {
        Self {
            gbps: Vec::new(),
            block_latency_ms: Vec::new(),
        }
    }

    fn record(&mut self, bytes: usize, elapsed: Duration, outcome: &TransferOutcome) {
        self.gbps.push(bytes as f64 / elapsed.as_secs_f64() / 1e9);
        for batch in &outcome.batches {
            for _ in 0..batch.blocks {
                self.block_latency_ms
                    .push(batch.latency.as_secs_f64() * 1e3);
            }
        }
    }
}

fn progress(enabled: bool, len: usize, what: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} blocks {elapsed}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}

/// Waits for a ticket while moving a progress bar with a block counter.
fn wait_with_progress(
    ticket: kvbm_core::TransferTicket,
    bar: &ProgressBar,
    counter: impl Fn() -> u64,
    base: u64,
) -> TransferOutcome {
    // Polled finely: a coarse poll would add up to its period to a copy that takes
    // milliseconds (and a hidden bar is not polled at all).
    while !bar.is_hidden() && !ticket.is_done() {
        bar.set_position(counter().saturating_sub(base));
        std::thread::sleep(Duration::from_micros(200));
    }
    bar.finish_and_clear();
    ticket.wait()
}

pub fn run(mut args: OffloadArgs) -> anyhow::Result<bool> {
    if let Some(model) = args.model {
        let (layers, kv_heads, head_size, block_size) = model.shape();
        (args.layers, args.kv_heads, args.head_size, args.block_size) =
            (layers, kv_heads, head_size, block_size);
        args.dtype_bytes = 2;
        args.mla = false;
        println!(
            "model {}: {layers} layers per block, {kv_heads} KV heads of {head_size}, {block_size}-token blocks",
            model
                .to_possible_value()
                .map_or_else(String::new, |v| v.get_name().to_owned()),
        );
    }
    if args.blocks == 0 || args.iterations == 0 {
        bail!("--blocks and --iterations must be at least 1");
    }
    if !args.host_gb.is_finite() || args.host_gb <= 0.0 {
        bail!("--host-gb {} must be a positive number", args.host_gb);
    }
    let outer = if args.mla { 1 } else { 2 };
    let kv = KvLayout::new(
        args.layers,
        outer,
        args.block_size,
        args.kv_heads * args.head_size,
        args.dtype_bytes,
    )
    .context("model shape")?;
    let bpb = kv.bytes_per_block();
    let host_blocks = (args.host_gb * 1e9) as usize / kv.host_stride_bytes();
    if host_blocks < args.blocks {
        bail!(
            "a host tier of {} GB holds {host_blocks} blocks of {bpb} bytes; --blocks {} needs --host-gb {:.2}",
            args.host_gb,
            args.blocks,
            (args.blocks * kv.host_stride_bytes()) as f64 / 1e9
        );
    }
    let choice = match args.device {
        DeviceArg::Auto => BackendChoice::Auto,
        DeviceArg::Cuda => BackendChoice::Cuda,
        DeviceArg::Emulated => BackendChoice::Emulated,
    };
    let device = Device::open(choice, 0).context("opening the device")?;
    let gpu_layout = args
        .layout
        .gpu_layout(if args.mla { 1 } else { args.kv_heads });
    let show = !args.json || std::io::IsTerminal::is_terminal(&std::io::stderr());
    if !args.disk_gb.is_finite() || args.disk_gb < 0.0 {
        bail!(
            "--disk-gb {} must be a number of GB, 0 or more",
            args.disk_gb
        );
    }
    let disk_dir = args.disk_dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvbm-bench-offload-{}", std::process::id()))
    });
    let disk = if args.disk_gb > 0.0 {
        let slot_bytes = kv.contiguous_stride_bytes() + 4096;
        let disk_blocks = (args.disk_gb * 1e9) as usize / slot_bytes;
        if disk_blocks < args.blocks {
            bail!(
                "a disk tier of {} GB holds {disk_blocks} blocks; --blocks {} needs --disk-gb {:.2}",
                args.disk_gb,
                args.blocks,
                (args.blocks * slot_bytes) as f64 / 1e9
            );
        }
        Some(kvbm_core::DiskOptions {
            dir: disk_dir.clone(),
            file_name: "kvbm-bench.cache".into(),
            blocks: disk_blocks,
            disable_o_direct: false,
            filter_disabled: true,
            queue_depth: 16,
            engine: Default::default(),
            layout_salt: 0,
        })
    } else {
        None
    };
    if args.engine == EngineArg::Split {
        return run_split(&args, kv, device, gpu_layout, host_blocks, disk, &disk_dir);
    }
    let m = BlockManager::new(
        device,
        ManagerOptions {
            kv,
            gpu_blocks: args.blocks,
            gpu_layout,
            host_blocks,
            limits: TransferLimits {
                batch_blocks_max: args.batch_size,
                inflight_max: args.concurrent,
                ..TransferLimits::default()
            },
            pin_threads: kvbm_cuda::HostRegionOptions::default().pin_threads,
            disk,
            kv_events: args.kv_events_endpoint.clone().map(|e| {
                kvbm_events::PublisherConfig::new(e, args.kv_events_replay_endpoint.clone())
            }),
        },
        GpuMemory::Allocate,
    )
    .context("building the block manager")?;

    // Fill GPU blocks while the host tier pins in the background.
    let hasher = BlockHasher::new(args.block_size, None, None);
    let tokens: Vec<u32> = (0..(args.blocks * args.block_size) as u32).collect();
    let hashes = hasher.sequence_hashes(None, &tokens);
    let bar = progress(show, args.blocks, "fill");
    let mut buf = vec![0u8; bpb];
    let mut complete = Vec::with_capacity(args.blocks);
    for (i, block) in m.allocate_gpu(args.blocks)?.into_iter().enumerate() {
        fill_block(hashes[i].0, &mut buf);
        m.write_gpu_block(block.id(), &buf)?;
        complete.push(block.complete(kvbm_core::BlockIdentity {
            sequence_hash: hashes[i],
            parent: i.checked_sub(1).map(|p| hashes[p]),
            tokens: tokens[i * args.block_size..(i + 1) * args.block_size].into(),
            lora_name: None,
            group: None,
        }));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut gpu_blocks: Vec<RegisteredBlock> = m.register_gpu(complete)?;
    let host = m.host_region().clone();
    if !host.wait_ready(host.len(), Duration::from_secs(600)) {
        bail!("the host tier was not pinned within 10 minutes");
    }
    let (first_ready, full_ready) = host.ready_times();
    m.refresh_host_available();

    let mut d2h = Direction::new();
    let mut h2d = Direction::new();
    let mut to_disk_gbps = Vec::new();
    let mut from_disk_gbps = Vec::new();
    let mut verified = true;
    let bytes = args.blocks * bpb;
    let metrics = m.metrics().clone();
    let counter = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    for _ in 0..args.iterations {
        // Offload (the lower tiers start empty each round, so nothing is de-duplicated).
        m.host_pool().evict_idle(usize::MAX);
        if let Some(disk) = m.disk_pool() {
            disk.evict_idle(usize::MAX);
        }
        let bar = progress(show, args.blocks, "offload d2h");
        let base = counter(&metrics.offload_blocks_d2h);
        let start = Instant::now();
        let ticket = m.offload(&gpu_blocks)?;
        let outcome =
            wait_with_progress(ticket, &bar, || counter(&metrics.offload_blocks_d2h), base);
        let elapsed = start.elapsed();
        if let Some(err) = &outcome.error {
            bail!("offload failed: {err}");
        }
        if outcome.copied != args.blocks {
            bail!("offloaded {} of {} blocks", outcome.copied, args.blocks);
        }
        d2h.record(bytes, elapsed, &outcome);
        if m.disk_pool().is_some() {
            // The disk writer started with the first host blocks; wait for the last.
            m.wait_idle();
            to_disk_gbps.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        }

        // Forget the GPU copies and scribble over every GPU block.
        drop(std::mem::take(&mut gpu_blocks));
        m.gpu_pool().evict_idle(usize::MAX);
        let mut targets = m.allocate_gpu(args.blocks)?;
        buf.fill(0x5A);
        for t in &targets {
            m.write_gpu_block(t.id(), &buf)?;
        }
        // Onboard into a different block than each came from.
        targets.reverse();

        let bar = progress(show, args.blocks, "onboard h2d");
        let base = counter(&metrics.onboard_blocks_h2d);
        let sources = if m.disk_pool().is_some() {
            // Only the disk copies are left: bring them up to the host tier first.
            m.host_pool().evict_idle(usize::MAX);
            let matched = m.match_lower(&hashes);
            if matched.count_in(kvbm_events::Tier::Disk) != args.blocks {
                bail!(
                    "matched {} of {} blocks on disk",
                    matched.count_in(kvbm_events::Tier::Disk),
                    args.blocks
                );
            }
            let start = Instant::now();
            let host_blocks = m.onboard_from_disk(matched.blocks)?;
            from_disk_gbps.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
            host_blocks
        } else {
            m.match_host(&hashes)
        };
        let start = Instant::now();
        if sources.len() != args.blocks {
            bail!(
                "matched {} of {} blocks in the host tier",
                sources.len(),
                args.blocks
            );
        }
        let ticket = m.onboard(sources, targets)?;
        let outcome =
            wait_with_progress(ticket, &bar, || counter(&metrics.onboard_blocks_h2d), base);
        let elapsed = start.elapsed();
        if let Some(err) = &outcome.error {
            bail!("onboard failed: {err}");
        }
        h2d.record(bytes, elapsed, &outcome);

        // Every byte, against a fresh computation of what the block held.
        let bar = progress(show, args.blocks, "verify");
        let mut expected = vec![0u8; bpb];
        for block in &outcome.blocks {
            m.read_gpu_block(block.id(), &mut buf)?;
            fill_block(block.sequence_hash().0, &mut expected);
            verified &= buf == expected;
            bar.inc(1);
        }
        verified &= outcome.blocks.len() == args.blocks;
        bar.finish_and_clear();
        gpu_blocks = outcome.blocks;
    }

    // The yardstick: the same bytes, block by block, with memcpy.
    let memcpy_gbps = memcpy_gbps(args.blocks, bpb, args.iterations);

    // The copies one block takes: the runs of the manager's own GPU placement.
    let pieces_per_block = m.gpu_layout().runs_per_block();
    let d2h_gbps = median(&d2h.gbps);
    let h2d_gbps = median(&h2d.gbps);
    let device_kind = m.device_kind().as_str();
    println!(
        "kvbm offload: {} ({}), {} blocks of {:.2} MiB ({} layers, layout {}, {} pieces of {} KiB per block), host tier {:.2} GB pinned in {:.2} s ({:?})",
        device_kind,
        m.device().description(),
        args.blocks,
        bpb as f64 / (1 << 20) as f64,
        args.layers,
        gpu_layout.name(),
        pieces_per_block,
        bpb / pieces_per_block / 1024,
        host.len() as f64 / 1e9,
        full_ready.unwrap_or_default().as_secs_f64(),
        host.pin_status(),
    );
    println!(
        "medians over {} iterations; latency is per block, submit to completion of its batch",
        args.iterations
    );
    println!(
        "{:<10} {:>8} {:>10} {:>10} {:>10}",
        "direction", "GB/s", "x memcpy", "p50 ms", "p99 ms"
    );
    for (name, dir, gbps) in [("d2h", &d2h, d2h_gbps), ("h2d", &h2d, h2d_gbps)] {
        println!(
            "{:<10} {:>8.2} {:>10.2} {:>10.3} {:>10.3}",
            name,
            gbps,
            gbps / memcpy_gbps,
            median(&dir.block_latency_ms),
            percentile(&dir.block_latency_ms, 0.99)
        );
    }
    println!(
        "{:<10} {:>8.2} {:>10.2} {:>10} {:>10}",
        "memcpy", memcpy_gbps, 1.0, "-", "-"
    );
    let disk_summary = m.with_disk_store(|store| {
        (
            store.engine().kind().as_str(),
            format!("{:?}", store.file().io_mode()),
            store.stats(),
        )
    });
    if let Some((engine, io_mode, stats)) = &disk_summary {
        println!(
            "disk tier ({engine}, {io_mode}): gpu->host->disk pipeline {:.2} GB/s, disk->host {:.2} GB/s ({} writes, {} verified reads, {} corrupt)",
            median(&to_disk_gbps),
            median(&from_disk_gbps),
            stats.writes_ok,
            stats.read_hits,
            stats.read_corrupt
        );
    }
    print_verified(verified);
    if args.json {
        let line = serde_json::json!({
            "d2h_gbps": d2h_gbps,
            "h2d_gbps": h2d_gbps,
            "memcpy_gbps": memcpy_gbps,
            "d2h_vs_memcpy": d2h_gbps / memcpy_gbps,
            "h2d_vs_memcpy": h2d_gbps / memcpy_gbps,
            "d2h_block_p50_ms": median(&d2h.block_latency_ms),
            "d2h_block_p99_ms": percentile(&d2h.block_latency_ms, 0.99),
            "h2d_block_p50_ms": median(&h2d.block_latency_ms),
            "h2d_block_p99_ms": percentile(&h2d.block_latency_ms, 0.99),
            "blocks": args.blocks,
            "bytes_per_block": bpb,
            "pieces_per_block": pieces_per_block,
            "layout": gpu_layout.name(),
            "iterations": args.iterations,
            "host_first_ready_s": first_ready.unwrap_or_default().as_secs_f64(),
            "host_full_ready_s": full_ready.unwrap_or_default().as_secs_f64(),
            "verified": verified,
            "device": device_kind,
            "disk_write_pipeline_gbps": disk_summary.as_ref().map(|_| median(&to_disk_gbps)),
            "disk_read_gbps": disk_summary.as_ref().map(|_| median(&from_disk_gbps)),
            "disk_engine": disk_summary.as_ref().map(|d| d.0),
        });
        println!("{line}");
    }
    if m.disk_pool().is_some() {
        drop(gpu_blocks);
        drop(m); // finishes disk writes and leaves a checkpoint
        let _ = std::fs::remove_file(disk_dir.join("kvbm-bench.cache"));
        let _ = std::fs::remove_file(
            disk_dir.join(format!("kvbm-bench.cache{}", kvbm_disk::CHECKPOINT_SUFFIX)),
        );
        if args.disk_dir.is_none() {
            let _ = std::fs::remove_dir(&disk_dir);
        }
    }
    Ok(verified)
}

/// GPU memory laid out as `gpu_layout` places it, with a block's bytes readable and writable in
/// canonical order (what the engine's kernels would write).
struct GpuBlocks {
    regions: Vec<kvbm_cuda::GpuRegion>,
    layout: kvbm_core::BlockLayout,
}

impl GpuBlocks {
    fn runs(
        &self,
        block: u32,
        mut f: impl FnMut(&kvbm_cuda::GpuRegion, usize, std::ops::Range<usize>),
    ) {
        self.layout
            .for_each_run(block as usize, |addr, offset, len, _| {
                let region = self
                    .regions
                    .iter()
                    .find(|r| addr >= r.addr() && addr + len as u64 <= r.addr() + r.len() as u64)
                    .expect("the layout was placed in these regions");
                f(
                    region,
                    (addr - region.addr()) as usize,
                    offset..offset + len,
                );
            });
    }

    fn write(&self, block: u32, bytes: &[u8]) -> anyhow::Result<()> {
        let mut result = Ok(());
        self.runs(block, |r, at, range| {
            if result.is_ok() {
                result = r.write(at, &bytes[range]);
            }
        });
        Ok(result?)
    }

    fn read(&self, block: u32, out: &mut [u8]) -> anyhow::Result<()> {
        let mut result = Ok(());
        self.runs(block, |r, at, range| {
            if result.is_ok() {
                result = r.read(at, &mut out[range]);
            }
        });
        Ok(result?)
    }
}

fn print_verified(verified: bool) {
    let what = if verified {
        "every byte of every block"
    } else {
        "MISMATCH"
    };
    println!("verified: {what}");
}

/// One step of the split engine: the leader's plan through bytes into the worker, in vLLM
/// 0.33's order; returns when its offloads and onboards completed.
fn split_step(
    leader: &mut kvbm_core::Leader,
    worker: &mut kvbm_core::Worker,
) -> anyhow::Result<()> {
    let plan = leader.take_plan(Vec::new())?;
    let plan = kvbm_core::StepPlan::from_bytes(&plan.to_bytes())?;
    worker.bind(plan);
    worker.handle_preemptions();
    worker.start_onboards()?;
    worker.wait_onboards()?;
    worker.start_offloads()?;
    worker.wait_offloads();
    worker.clear();
    Ok(())
}

/// `--engine split`: what the vLLM connector runs, timed end to end per direction (plan,
/// encode, decode, copy, completion).
fn run_split(
    args: &OffloadArgs,
    kv: KvLayout,
    device: Device,
    gpu_layout: GpuLayout,
    host_blocks: usize,
    disk: Option<kvbm_core::DiskOptions>,
    disk_dir: &std::path::Path,
) -> anyhow::Result<bool> {
    let disk_blocks = disk.as_ref().map_or(0, |d| d.blocks);
    let file_name = disk.as_ref().map(|d| d.file_name.clone());
    let n = args.blocks;
    let bpb = kv.bytes_per_block();
    let mut regions = Vec::new();
    for bytes in gpu_layout.allocation_bytes(&kv, n) {
        regions.push(device.alloc_gpu(bytes).context("allocating GPU memory")?);
    }
    let addrs: Vec<u64> = regions.iter().map(|r| r.addr()).collect();
    let layout = gpu_layout.place(kv, n, &addrs)?;
    let gpu = GpuBlocks {
        regions: regions.clone(),
        layout: layout.clone(),
    };
    let device_kind = device.kind().as_str();
    let description = device.description();
    let metrics = std::sync::Arc::new(kvbm_core::Metrics::default());
    let mut worker = kvbm_core::Worker::new(
        device,
        kv,
        layout,
        regions,
        kvbm_core::WorkerOptions {
            host_blocks,
            limits: TransferLimits {
                batch_blocks_max: args.batch_size,
                inflight_max: args.concurrent,
                ..TransferLimits::default()
            },
            disk,
            ..Default::default()
        },
        metrics,
    )?;
    // With a disk tier every host block goes to disk at once (the filter off), as in the
    // manager's cycle.
    let mut leader =
        kvbm_core::Leader::new(args.block_size, host_blocks, disk_blocks, disk_blocks > 0)?;
    let _zmq = match &args.kv_events_endpoint {
        None => None,
        Some(endpoint) => Some(
            kvbm_events::ZmqPublisher::start(
                leader.publisher(),
                kvbm_events::PublisherConfig::new(
                    endpoint.clone(),
                    args.kv_events_replay_endpoint.clone(),
                ),
            )
            .context("publishing KV events over ZMQ")?,
        ),
    };
    let hasher = BlockHasher::new(args.block_size, None, None);
    let tokens: Vec<u32> = (0..(n * args.block_size) as u32).collect();
    let hashes: Vec<u64> = hasher
        .sequence_hashes(None, &tokens)
        .into_iter()
        .map(|h| h.0)
        .collect();
    let show = !args.json || std::io::IsTerminal::is_terminal(&std::io::stderr());
    let bar = progress(show, n, "fill");
    let mut buf = vec![0u8; bpb];
    for (i, &h) in hashes.iter().enumerate() {
        fill_block(h, &mut buf);
        gpu.write(i as u32, &buf)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    if !worker.wait_host_ready(Duration::from_secs(600)) {
        bail!("the host pool was not pinned within 10 minutes");
    }
    let (mut d2h, mut h2d, mut to_disk) = (Vec::new(), Vec::new(), Vec::new());
    let mut verified = true;
    let bytes = n * bpb;
    let ids: Vec<u32> = (0..n as u32).collect();
    for _ in 0..args.iterations {
        // The host tier starts empty each round (holds end after two steps), so nothing is
        // de-duplicated.
        for _ in 0..3 {
            split_step(&mut leader, &mut worker)?;
        }
        leader.reset()?;
        let start = Instant::now();
        let run = kvbm_core::TokenRun {
            tokens: tokens.clone(),
            parent: None,
            lora_name: None,
            salt: None,
        };
        let done = leader.plan_offloads(vec![("bench".into(), run, ids.clone())])?;
        if done[0].1 != n {
            bail!("planned {} of {n} offloads", done[0].1);
        }
        split_step(&mut leader, &mut worker)?;
        d2h.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        if disk_blocks > 0 {
            // The disk writes started with the step; the pipeline ends with the last.
            worker.wait_disk();
            to_disk.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
            // Only the disk copies are left once the host holds end.
            for _ in 0..3 {
                split_step(&mut leader, &mut worker)?;
            }
            leader.evict_idle_host();
            if leader.count_prefix_tiers(&hashes) != (0, n) {
                bail!(
                    "the blocks are not on disk alone: {:?}",
                    leader.count_prefix_tiers(&hashes)
                );
            }
        }
        // Scribble over every GPU block, then onboard each into a different one.
        buf.fill(0x5A);
        for &b in &ids {
            gpu.write(b, &buf)?;
        }
        let targets: Vec<u32> = ids.iter().rev().copied().collect();
        let start = Instant::now();
        // From disk, as the connector does it: asynchronously (disk reads into staging host
        // blocks, then host to GPU), reported when done.
        let asynchronous = disk_blocks > 0;
        let got = leader.plan_onboard("bench-onboard", &hashes, &targets, asynchronous)?;
        if got != n {
            bail!("planned {got} of {n} onboards");
        }
        split_step(&mut leader, &mut worker)?;
        if asynchronous {
            worker.wait_async();
            let report = worker.report(&[]);
            if report.finished_onboarding != ["bench-onboard"] || !report.failed_blocks.is_empty() {
                bail!("the onboard from disk failed: {report:?}");
            }
            leader.release("bench-onboard");
        }
        h2d.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        if !worker.take_failed().is_empty() {
            bail!("onboards failed");
        }
        let mut expected = vec![0u8; bpb];
        for (i, &t) in targets.iter().enumerate() {
            gpu.read(t, &mut buf)?;
            fill_block(hashes[i], &mut expected);
            verified &= buf == expected;
        }
        // Put the blocks back where they came from for the next round.
        for (i, &h) in hashes.iter().enumerate() {
            fill_block(h, &mut buf);
            gpu.write(i as u32, &buf)?;
        }
    }
    let memcpy = memcpy_gbps(n, bpb, args.iterations);
    let (d2h_gbps, h2d_gbps) = (median(&d2h), median(&h2d));
    let runs = gpu.layout.runs_per_block();
    println!(
        "kvbm offload, split engine (leader plans as bytes, worker executes): {device_kind} ({description}), {n} blocks of {:.2} MiB ({} layers, layout {}, {runs} pieces per block)",
        bpb as f64 / (1 << 20) as f64,
        args.layers,
        gpu_layout.name(),
    );
    println!("medians over {} iterations", args.iterations);
    println!("{:<10} {:>8} {:>10}", "direction", "GB/s", "x memcpy");
    let h2d_name = if disk_blocks > 0 { "disk->gpu" } else { "h2d" };
    for (name, gbps) in [("d2h", d2h_gbps), (h2d_name, h2d_gbps), ("memcpy", memcpy)] {
        println!("{:<10} {:>8.2} {:>10.2}", name, gbps, gbps / memcpy);
    }
    if disk_blocks > 0 {
        println!(
            "disk tier: gpu->host->disk pipeline {:.2} GB/s; the onboard above is disk->host->gpu (asynchronous, as the connector onboards from disk)",
            median(&to_disk)
        );
    }
    print_verified(verified);
    if args.json {
        let line = serde_json::json!({
            "engine": "split",
            "disk_write_pipeline_gbps": (disk_blocks > 0).then(|| median(&to_disk)),
            "onboard_from_disk": disk_blocks > 0,
            "d2h_gbps": d2h_gbps,
            "h2d_gbps": h2d_gbps,
            "memcpy_gbps": memcpy,
            "d2h_vs_memcpy": d2h_gbps / memcpy,
            "h2d_vs_memcpy": h2d_gbps / memcpy,
            "blocks": n,
            "bytes_per_block": bpb,
            "pieces_per_block": runs,
            "layout": gpu_layout.name(),
            "iterations": args.iterations,
            "verified": verified,
            "device": device_kind,
        });
        println!("{line}");
    }
    drop(worker); // finishes its disk writes and closes the file
    if let Some(file) = file_name {
        let _ = std::fs::remove_file(disk_dir.join(&file));
        let _ =
            std::fs::remove_file(disk_dir.join(format!("{file}{}", kvbm_disk::CHECKPOINT_SUFFIX)));
        if args.disk_dir.is_none() {
            let _ = std::fs::remove_dir(disk_dir);
        }
    }
    Ok(verified)
}
