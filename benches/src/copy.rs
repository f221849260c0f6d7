//! `kvbm-bench copy` and `kvbm-bench pin`: the device layer alone, for GPU checks.
//!
//! `copy` moves blocks between GPU memory and pinned host memory through kvbm-cuda's copy
//! streams: D2H alone, H2D alone, then both directions at once (D2H of one half of the blocks
//! while the other half goes H2D). Blocks have a model's shape (`--layers`, `--kv-heads`,
//! `--head-size`, `--block-size` tokens, `--dtype-bytes`; Qwen3-0.6B's by default: 1.75 MiB).
//! The GPU side is placed by kvbm-core in one of vLLM 0.33's `KVCacheLayout`s (one buffer viewed
//! per layer: `lbnhc`, the default, `lbhnc`, `lhbnc`, `blhnc`, `blnhc`, `bhlnc`), in an older
//! per-layer shape (`outer-first`: `[2, n_blocks, ...]` per layer; `block-first`:
//! `[n_blocks, 2, ...]`), or fully contiguous; the host side is the host tier's layout (one
//! contiguous run per block behind its header room). Each block's pieces come from kvbm-core's
//! `copy_pieces_into`, as in the block manager; the patterns are written and checked through the
//! same pieces, and every byte is verified after each pass. The yardstick is a memcpy of the same
//! bytes, block by block, between two prefaulted buffers, in the same run.
//! `KVBM_COPY_BATCH` and `KVBM_COPY_COALESCE` choose the stream's paths, as everywhere.
//!
//! `pin` maps a host pool and reports when its first chunk and all of it are pinned.

use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use kvbm_core::{BlockLayout, KvLayout};
use kvbm_cuda::{
    BackendChoice, Completion, CopyPiece, CopyStream, Device, Direction, GpuRegion, HostRegion,
    HostRegionOptions, StreamOptions, Transfer,
};

use crate::offload::{memcpy_gbps, LayoutArg};
use crate::stats::{fill_block, median};

/// The GPU side's layout: one of the block manager's, or each block one contiguous run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CopyLayout {
    /// As the block manager places a GPU tier (vLLM 0.33's views, or older per-layer tensors).
    Gpu(LayoutArg),
    /// Each block one contiguous run.
    Contiguous,
}

impl FromStr for CopyLayout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("contiguous") {
            return Ok(Self::Contiguous);
        }
        LayoutArg::from_str(s)
            .map(Self::Gpu)
            .map_err(|e| format!("{e}, contiguous"))
    }
}

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// Device back end: auto, cuda or emulated.
    #[arg(long, default_value = "auto")]
    device: String,
    /// GPU layout of the blocks: vLLM 0.33's lbnhc (its default), lbhnc, lhbnc, blhnc, blnhc,
    /// bhlnc; the older per-layer outer-first ([2, n_blocks, ...]) or block-first
    /// ([n_blocks, 2, ...]); or contiguous (one run per block).
    #[arg(long, default_value = "lbnhc")]
    layout: CopyLayout,
    /// Attention layers.
    #[arg(long, default_value_t = 28)]
    layers: usize,
    /// KV heads per layer.
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Head size.
    #[arg(long, default_value_t = 128)]
    head_size: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Bytes per element (2 for bf16).
    #[arg(long, default_value_t = 2)]
    dtype_bytes: usize,
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

struct Pass {
    gbps: f64,
    submit_us_per_block: f64,
}

/// The memory of one run, its placements, and how it is moved.
struct Bench<'a> {
    gpu: &'a GpuRegion,
    host: &'a HostRegion,
    /// The GPU side's blocks.
    gpu_layout: &'a BlockLayout,
    /// The host side's blocks.
    host_layout: &'a BlockLayout,
    batch: usize,
    inflight: usize,
}

impl Bench<'_> {
    fn block_bytes(&self) -> usize {
        self.gpu_layout.kv().bytes_per_block()
    }

    /// Appends the pieces moving `block` in `dir` (the GPU side's block to the host side's same
    /// block, or back).
    fn pieces(&self, dir: Direction, block: usize, out: &mut Vec<CopyPiece>) -> anyhow::Result<()> {
        match dir {
            Direction::DeviceToHost => {
                self.gpu_layout
                    .copy_pieces_into(block, self.host_layout, block, out)
            }
            _ => self
                .host_layout
                .copy_pieces_into(block, self.gpu_layout, block, out),
        }
        .context("copy pieces")
    }

    /// Copies `blocks` in `dir` through `stream`, `batch` blocks per transfer, `inflight` at most.
    fn pass(
        &self,
        stream: &CopyStream,
        dir: Direction,
        blocks: std::ops::Range<usize>,
    ) -> anyhow::Result<Pass> {
        let mut pending: std::collections::VecDeque<Completion> = Default::default();
        let mut submit = Duration::ZERO;
        let n = blocks.len();
        let mut pieces = Vec::new();
        let start = Instant::now();
        let list: Vec<usize> = blocks.collect();
        for group in list.chunks(self.batch) {
            if pending.len() >= self.inflight {
                pending.pop_front().expect("non-empty").wait()?;
            }
            pieces.clear();
            for &b in group {
                self.pieces(dir, b, &mut pieces)?;
            }
            let mut t = Transfer::with_capacity(pieces.len());
            for p in &pieces {
                t.push(p.src, p.dst, p.len);
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
            gbps: (n * self.block_bytes()) as f64 / secs / 1e9,
            submit_us_per_block: submit.as_secs_f64() * 1e6 / n.max(1) as f64,
        })
    }

    /// Writes (`check` false) or checks (`check` true) the seed pattern of `blocks` on one side:
    /// each block's bytes in canonical order, through the block's D2H pieces (GPU address, host
    /// address, and the canonical offset the host address gives), which must cover the block.
    fn pattern(
        &self,
        check: bool,
        on_host: bool,
        blocks: std::ops::Range<usize>,
        seed_of: impl Fn(usize) -> u64,
    ) -> anyhow::Result<()> {
        let block_bytes = self.block_bytes();
        let mut data = vec![0u8; block_bytes];
        let mut got = Vec::new();
        let mut pieces = Vec::new();
        let side = if on_host { "host" } else { "GPU" };
        for b in blocks {
            fill_block(seed_of(b), &mut data);
            pieces.clear();
            self.pieces(Direction::DeviceToHost, b, &mut pieces)?;
            let host_start = self.host_layout.block_start(b);
            let mut covered = 0usize;
            for (i, p) in pieces.iter().enumerate() {
                let offset = (p.dst - host_start) as usize;
                if offset != covered {
                    bail!(
                        "block {b} piece {i} starts at byte {offset} of the block, not {covered}"
                    );
                }
                covered += p.len;
                let piece = &data[offset..offset + p.len];
                let (host_at, gpu_at) = (
                    (p.dst - self.host.addr()) as usize,
                    (p.src - self.gpu.addr()) as usize,
                );
                got.resize(p.len, 0);
                match (check, on_host) {
                    (false, true) => self.host.write(host_at, piece)?,
                    (false, false) => self.gpu.write(gpu_at, piece)?,
                    (true, true) => self.host.read(host_at, &mut got)?,
                    (true, false) => self.gpu.read(gpu_at, &mut got)?,
                }
                if check && got[..] != *piece {
                    bail!("block {b} piece {i} differs on the {side} side");
                }
            }
            if covered != block_bytes {
                bail!("block {b}'s pieces cover {covered} of its {block_bytes} bytes");
            }
        }
        Ok(())
    }
}

pub fn run_copy(args: CopyArgs) -> anyhow::Result<bool> {
    if args.batch == 0 || args.inflight == 0 || args.iterations == 0 {
        bail!("--batch, --inflight and --iterations must be at least 1");
    }
    if !args.gib.is_finite() || args.gib <= 0.0 {
        bail!("--gib {} must be a positive number", args.gib);
    }
    let kv = KvLayout::new(
        args.layers,
        2,
        args.block_size,
        args.kv_heads * args.head_size,
        args.dtype_bytes,
    )
    .context("model shape")?;
    let block_bytes = kv.bytes_per_block();
    let device = open(&args.device)?;
    // Half the blocks go D2H while the other half goes H2D in the "both" pass.
    let half = ((args.gib * (1u64 << 30) as f64) as usize / block_bytes).max(1);
    let blocks = 2 * half;
    // The GPU side: one allocation holding the layout's allocations back to back.
    let (gpu_layout, name, gpu) = match args.layout {
        CopyLayout::Gpu(arg) => {
            let layout = arg.gpu_layout(args.kv_heads);
            let sizes = layout.allocation_bytes(&kv, blocks);
            let gpu = device
                .alloc_gpu(sizes.iter().sum())
                .context("allocating GPU memory")?;
            let addrs: Vec<u64> = sizes
                .iter()
                .scan(gpu.addr(), |at, &bytes| {
                    let this = *at;
                    *at += bytes as u64;
                    Some(this)
                })
                .collect();
            let placed = layout
                .place(kv, blocks, &addrs)
                .context("placing the GPU layout")?;
            (placed, layout.name(), gpu)
        }
        CopyLayout::Contiguous => {
            let gpu = device
                .alloc_gpu(blocks * kv.contiguous_stride_bytes())
                .context("allocating GPU memory")?;
            let placed = BlockLayout::fully_contiguous(kv, blocks, gpu.addr());
            (placed, "contiguous".to_owned(), gpu)
        }
    };
    let host = device
        .alloc_host(
            blocks * kv.host_stride_bytes(),
            // Pinned in chunks of whole blocks, as the engine pins its host tier: no block may
            // straddle two registrations.
            HostRegionOptions {
                chunk_bytes: kvbm_core::manager::host_pin_options(kv.host_stride_bytes(), 1)
                    .chunk_bytes,
                ..HostRegionOptions::default()
            },
        )
        .context("mapping host memory")?;
    let host_layout = BlockLayout::host(kv, blocks, host.addr());
    let pieces_per_block = {
        let mut pieces = Vec::new();
        gpu_layout.copy_pieces_into(0, &host_layout, 0, &mut pieces)?;
        pieces.len()
    };
    if !host.wait_ready(host.len(), Duration::from_secs(600)) {
        bail!("host memory not pinned after 600 s");
    }
    let options = StreamOptions::from_env()?;
    let d2h = device.copy_stream_with(Direction::DeviceToHost, options)?;
    let h2d = device.copy_stream_with(Direction::HostToDevice, options)?;
    let (lo, hi) = (0..half, half..blocks);
    let bench = Bench {
        gpu: &gpu,
        host: &host,
        gpu_layout: &gpu_layout,
        host_layout: &host_layout,
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
    let batch_copy = d2h.uses_batch_copy();
    // Free the copy's memory before the yardstick's.
    drop((d2h, h2d, gpu, host));
    // The yardstick, in the same run: the bytes of one pass, block by block, with memcpy.
    let memcpy = memcpy_gbps(half, block_bytes, args.iterations);
    let (d2h_gbps, h2d_gbps) = (median(&d2h_runs), median(&h2d_runs));
    let result = serde_json::json!({
        "device": device.kind().as_str(),
        "description": device.description(),
        "driver_version": device.driver_version(),
        "layout": name,
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_size": args.head_size,
        "block_size_tokens": args.block_size,
        "dtype_bytes": args.dtype_bytes,
        "block_bytes": block_bytes,
        "pieces_per_block": pieces_per_block,
        "blocks_per_pass": half,
        "batch_copy": batch_copy,
        "coalesce": options.coalesce,
        "d2h_gbps": d2h_gbps,
        "h2d_gbps": h2d_gbps,
        "both_d2h_gbps": median(&both_d2h),
        "both_h2d_gbps": median(&both_h2d),
        "memcpy_gbps": memcpy,
        "d2h_vs_memcpy": d2h_gbps / memcpy,
        "h2d_vs_memcpy": h2d_gbps / memcpy,
        "submit_us_per_block": median(&submit),
        "verified": true,
    });
    println!(
        "{} {} {} blocks of {:.2} MiB ({} pieces), batch copy {}, coalesce {}: D2H {:.2} GB/s ({:.2}x memcpy), H2D {:.2} GB/s ({:.2}x memcpy), both at once {:.2} + {:.2} GB/s; memcpy {:.2} GB/s; submit {:.2} us/block; every byte verified",
        device.kind().as_str(),
        name,
        half,
        block_bytes as f64 / (1 << 20) as f64,
        pieces_per_block,
        batch_copy,
        options.coalesce,
        d2h_gbps,
        d2h_gbps / memcpy,
        h2d_gbps,
        h2d_gbps / memcpy,
        median(&both_d2h),
        median(&both_h2d),
        memcpy,
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
