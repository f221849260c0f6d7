//! `kvbm-bench copy` and `kvbm-bench pin`: the device layer alone, for GPU checks.
//!
//! `copy` moves blocks between GPU memory and pinned host memory through kvbm-cuda's copy
//! streams: D2H alone, H2D alone, then both directions at once (D2H of one half of the blocks
//! while the other half goes H2D). The GPU side is laid out as vLLM lays it out per layer
//! (`outer-first`: `[2, n_blocks, ...]` per layer; `block-first`: `[n_blocks, 2, ...]`), or fully
//! contiguous; the host side is contiguous per block. Every byte is verified after each pass.
//! `KVBM_COPY_BATCH` and `KVBM_COPY_COALESCE` choose the stream's paths, as everywhere.
//!
//! `pin` maps a host pool and reports when its first chunk and all of it are pinned.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use kvbm_cuda::{
    BackendChoice, Completion, CopyStream, Device, Direction, GpuRegion, HostRegion,
    HostRegionOptions, StreamOptions, Transfer,
};

use crate::stats::{fill_block, median};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum CopyLayout {
    /// Per-layer tensors `[2, n_blocks, block, heads, head]` (vLLM, FlashAttention).
    OuterFirst,
    /// Per-layer tensors `[n_blocks, 2, block, heads, head]` (vLLM, FlashInfer).
    BlockFirst,
    /// Each block one contiguous run.
    Contiguous,
}

impl CopyLayout {
    fn name(self) -> &'static str {
        match self {
            CopyLayout::OuterFirst => "outer-first",
            CopyLayout::BlockFirst => "block-first",
            CopyLayout::Contiguous => "contiguous",
        }
    }
}

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// Device back end: auto, cuda or emulated.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Block size in MiB (all layers, K and V).
    #[arg(long, default_value_t = 2.0)]
    block_mib: f64,
    /// GPU layout of the blocks.
    #[arg(long, value_enum, default_value_t = CopyLayout::OuterFirst)]
    layout: CopyLayout,
    /// Layers (a per-layer block is 2 x layers pieces).
    #[arg(long, default_value_t = 28)]
    layers: usize,
    /// Bytes moved per direction per pass, in GiB.
    #[arg(long, default_value_t = 2.0)]
    gib: f64,
    /// Blocks per transfer.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Transfers in flight per stream.
    #[arg(long, default_value_t = 4)]
    inflight: usize,
    /// Passes; figures are medians.
    #[arg(long, default_value_t = 3)]
    iterations: usize,
    /// End with one JSON line.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct PinArgs {
    /// Device back end: auto, cuda or emulated.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Host pool size in GiB.
    #[arg(long, default_value_t = 16.0)]
    gib: f64,
    /// End with one JSON line.
    #[arg(long)]
    json: bool,
}

fn open(device: &str) -> anyhow::Result<Device> {
    let choice: BackendChoice = device.parse().context("--device")?;
    Device::open(choice, 0).context("opening the device")
}

/// Where the pieces of each block live.
struct Placement {
    layout: CopyLayout,
    blocks: usize,
    chunk: usize,
    chunks: usize,
    layer_bytes: usize,
    host_stride: usize,
}

impl Placement {
    fn gpu_offset(&self, block: usize, chunk: usize) -> usize {
        let (layer, outer) = (chunk / 2, chunk % 2);
        match self.layout {
            CopyLayout::OuterFirst => {
                layer * self.layer_bytes + (outer * self.blocks + block) * self.chunk
            }
            CopyLayout::BlockFirst => layer * self.layer_bytes + (block * 2 + outer) * self.chunk,
            CopyLayout::Contiguous => (block * self.chunks + chunk) * self.chunk,
        }
    }

    fn host_offset(&self, block: usize, chunk: usize) -> usize {
        block * self.host_stride + chunk * self.chunk
    }

    fn block_bytes(&self) -> usize {
        self.chunk * self.chunks
    }
}

struct Pass {
    gbps: f64,
    submit_us_per_block: f64,
}

/// The memory of one run and how it is moved.
struct Bench<'a> {
    p: &'a Placement,
    gpu: &'a GpuRegion,
    host: &'a HostRegion,
    batch: usize,
    inflight: usize,
}

impl Bench<'_> {
    /// Copies `blocks` in `dir` through `stream`, `batch` blocks per transfer, `inflight` at most.
    fn pass(
        &self,
        stream: &CopyStream,
        dir: Direction,
        blocks: std::ops::Range<usize>,
    ) -> anyhow::Result<Pass> {
        let p = self.p;
        let mut pending: std::collections::VecDeque<Completion> = Default::default();
        let mut submit = Duration::ZERO;
        let n = blocks.len();
        let start = Instant::now();
        let list: Vec<usize> = blocks.collect();
        for group in list.chunks(self.batch) {
            if pending.len() >= self.inflight {
                pending.pop_front().expect("non-empty").wait()?;
            }
            let mut t = Transfer::with_capacity(group.len() * p.chunks);
            for &b in group {
                for c in 0..p.chunks {
                    let g = self.gpu.addr() + p.gpu_offset(b, c) as u64;
                    let h = self.host.addr() + p.host_offset(b, c) as u64;
                    match dir {
                        Direction::DeviceToHost => t.push(g, h, p.chunk),
                        _ => t.push(h, g, p.chunk),
                    }
                }
            }
            t.keep(self.gpu.clone());
            t.keep(self.host.clone());
            let s = Instant::now();
            pending.push_back(stream.submit(t)?);
            submit += s.elapsed();
        }
        for c in pending {
            c.wait()?;
        }
        let secs = start.elapsed().as_secs_f64();
        Ok(Pass {
            gbps: (n * p.block_bytes()) as f64 / secs / 1e9,
            submit_us_per_block: submit.as_secs_f64() * 1e6 / n.max(1) as f64,
        })
    }

    /// Writes (`check` false) or checks (`check` true) the seed pattern of `blocks` on one side.
    fn pattern(
        &self,
        check: bool,
        on_host: bool,
        blocks: std::ops::Range<usize>,
        seed_of: impl Fn(usize) -> u64,
    ) -> anyhow::Result<()> {
        let p = self.p;
        let mut data = vec![0u8; p.block_bytes()];
        let mut got = vec![0u8; p.chunk];
        for b in blocks {
            fill_block(seed_of(b), &mut data);
            for c in 0..p.chunks {
                let piece = &data[c * p.chunk..(c + 1) * p.chunk];
                let (host_at, gpu_at) = (p.host_offset(b, c), p.gpu_offset(b, c));
                match (check, on_host) {
                    (false, true) => self.host.write(host_at, piece)?,
                    (false, false) => self.gpu.write(gpu_at, piece)?,
                    (true, true) => self.host.read(host_at, &mut got)?,
                    (true, false) => self.gpu.read(gpu_at, &mut got)?,
                }
                if check && got[..] != *piece {
                    let side = if on_host { "host" } else { "GPU" };
                    bail!("block {b} piece {c} differs on the {side} side");
                }
            }
        }
        Ok(())
    }
}

pub fn run_copy(args: CopyArgs) -> anyhow::Result<bool> {
    if args.batch == 0 || args.inflight == 0 || args.iterations == 0 || args.layers == 0 {
        bail!("--batch, --inflight, --iterations and --layers must be at least 1");
    }
    let device = open(&args.device)?;
    let block_bytes = (args.block_mib * (1 << 20) as f64) as usize;
    let chunks = match args.layout {
        CopyLayout::Contiguous => 1,
        _ => args.layers * 2,
    };
    let chunk = (block_bytes / chunks / 4096).max(1) * 4096;
    let block_bytes = chunk * chunks;
    // Half the blocks go D2H while the other half goes H2D in the "both" pass.
    let half = ((args.gib * (1u64 << 30) as f64) as usize / block_bytes).max(1);
    let blocks = 2 * half;
    let layer_bytes = 2 * blocks * chunk;
    let p = Placement {
        layout: args.layout,
        blocks,
        chunk,
        chunks,
        layer_bytes,
        host_stride: block_bytes.div_ceil(4096) * 4096,
    };
    let gpu = device
        .alloc_gpu(blocks * block_bytes)
        .context("allocating GPU memory")?;
    let host = device
        .alloc_host(blocks * p.host_stride, HostRegionOptions::default())
        .context("mapping host memory")?;
    if !host.wait_ready(host.len(), Duration::from_secs(600)) {
        bail!("host memory not pinned after 600 s");
    }
    let options = StreamOptions::from_env()?;
    let d2h = device.copy_stream_with(Direction::DeviceToHost, options)?;
    let h2d = device.copy_stream_with(Direction::HostToDevice, options)?;
    let (lo, hi) = (0..half, half..blocks);
    let bench = Bench {
        p: &p,
        gpu: &gpu,
        host: &host,
        batch: args.batch,
        inflight: args.inflight,
    };
    let (mut d2h_runs, mut h2d_runs, mut both_d2h, mut both_h2d, mut submit) =
        (vec![], vec![], vec![], vec![], vec![]);
    for it in 0..args.iterations {
        let seed = |b: usize| ((it as u64) << 32) ^ b as u64 ^ 0x5eed;
        // D2H alone: GPU -> host.
        bench.pattern(false, false, lo.clone(), seed)?;
        let pass = bench.pass(&d2h, Direction::DeviceToHost, lo.clone())?;
        bench.pattern(true, true, lo.clone(), seed)?;
        d2h_runs.push(pass.gbps);
        submit.push(pass.submit_us_per_block);
        // H2D alone: host -> GPU (the blocks just offloaded, after the GPU side is scribbled).
        bench.pattern(false, false, lo.clone(), |b| seed(b) ^ 0xdead)?;
        let pass = bench.pass(&h2d, Direction::HostToDevice, lo.clone())?;
        bench.pattern(true, false, lo.clone(), seed)?;
        h2d_runs.push(pass.gbps);
        submit.push(pass.submit_us_per_block);
        // Both at once: the low half goes D2H while the high half comes H2D.
        let seed2 = |b: usize| seed(b) ^ 0xb07;
        bench.pattern(false, false, lo.clone(), seed2)?;
        bench.pattern(false, true, hi.clone(), seed2)?;
        let (down, up) = std::thread::scope(|s| {
            let down = s.spawn(|| bench.pass(&d2h, Direction::DeviceToHost, lo.clone()));
            let up = s.spawn(|| bench.pass(&h2d, Direction::HostToDevice, hi.clone()));
            (down.join(), up.join())
        });
        let down = down.map_err(|_| anyhow::anyhow!("the D2H thread panicked"))??;
        let up = up.map_err(|_| anyhow::anyhow!("the H2D thread panicked"))??;
        bench.pattern(true, true, lo.clone(), seed2)?;
        bench.pattern(true, false, hi.clone(), seed2)?;
        both_d2h.push(down.gbps);
        both_h2d.push(up.gbps);
    }
    let result = serde_json::json!({
        "device": device.kind().as_str(),
        "description": device.description(),
        "driver_version": device.driver_version(),
        "layout": args.layout.name(),
        "block_bytes": block_bytes,
        "pieces_per_block": chunks,
        "blocks_per_pass": half,
        "batch_copy": d2h.uses_batch_copy(),
        "coalesce": options.coalesce,
        "d2h_gbps": median(&d2h_runs),
        "h2d_gbps": median(&h2d_runs),
        "both_d2h_gbps": median(&both_d2h),
        "both_h2d_gbps": median(&both_h2d),
        "submit_us_per_block": median(&submit),
        "verified": true,
    });
    println!(
        "{} {} blocks of {:.2} MiB ({} pieces), batch copy {}, coalesce {}: D2H {:.2} GB/s, H2D {:.2} GB/s, both at once {:.2} + {:.2} GB/s; submit {:.2} us/block; every byte verified",
        device.kind().as_str(),
        args.layout.name(),
        block_bytes as f64 / (1 << 20) as f64,
        chunks,
        d2h.uses_batch_copy(),
        options.coalesce,
        median(&d2h_runs),
        median(&h2d_runs),
        median(&both_d2h),
        median(&both_h2d),
        median(&submit),
    );
    if args.json {
        println!("{result}");
    }
    Ok(true)
}

pub fn run_pin(args: PinArgs) -> anyhow::Result<bool> {
    let device = open(&args.device)?;
    let bytes = (args.gib * (1u64 << 30) as f64) as usize;
    let start = Instant::now();
    let host = device
        .alloc_host(bytes, HostRegionOptions::default())
        .context("mapping host memory")?;
    let mapped = start.elapsed();
    if !host.wait_ready(host.len(), Duration::from_secs(600)) {
        bail!("not fully pinned after 600 s");
    }
    let (first, full) = host.ready_times();
    let result = serde_json::json!({
        "device": device.kind().as_str(),
        "gib": args.gib,
        "map_s": mapped.as_secs_f64(),
        "first_chunk_ready_s": first.map(|d| d.as_secs_f64()),
        "full_ready_s": full.map(|d| d.as_secs_f64()),
        "chunk_bytes": host.chunk_bytes(),
        "pin_status": format!("{:?}", host.pin_status()),
    });
    println!(
        "{} host pool of {} GiB: first chunk usable after {:.2} s, all pinned after {:.2} s ({:?})",
        device.kind().as_str(),
        args.gib,
        first.unwrap_or_default().as_secs_f64(),
        full.unwrap_or_default().as_secs_f64(),
        host.pin_status()
    );
    if args.json {
        println!("{result}");
    }
    Ok(true)
}
