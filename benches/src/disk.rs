//! `kvbm-bench disk`: kvbm-disk's store against fio doing the same I/O on the same file system,
//! interleaved in the same run.
//!
//! kvbm's side is the real store path: each block sits in the buffer behind 4 KiB of header room
//! (as blocks do in kvbm's host tier), so a block and its header move as one contiguous op from
//! the registered buffer (`WRITE_FIXED` / `READ_FIXED`), with the payload checksum computed before
//! the write and verified after the read; all of that is inside the timing, which ends when the
//! last completion is reaped. The bytes are checked again (outside the timing) after every read.
//!
//! fio's side (`--fio-profile matched`, the default) does the I/O kvbm does: one op per block of
//! header plus payload area (`--bs`), starting after the 4 KiB superblock (`--offset`), so every
//! op has kvbm's size and file offset; the file is preallocated the same way (created with
//! kvbm-disk's `CacheFile`, same length, `fallocate`d); `--iodepth` is the queue depth, and every
//! reaped batch of completions is refilled in one submission (`--iodepth_batch_submit`,
//! `--iodepth_batch_complete_min=1`), as kvbm's engine does; io_uring, O_DIRECT, registered
//! buffers in an anonymous mapping (`--iomem=mmap`, as kvbm's buffer is) and a registered file,
//! one job run as a thread (so that its buffers can be inspected). fio's figure is its own: bytes
//! over its runtime, which leaves out its start-up. `legacy` is the yardstick this bench used
//! before: `--bs` of the payload alone from offset 0, one op per submission.
//!
//! Fairness: before the timed iterations each side writes and reads its whole file once
//! (`--warmup`), so that no timed write converts unwritten extents; every pass starts after the
//! same idle time (`--settle-ms`); each side writes then reads, and which side goes first
//! alternates between iterations (use an even count for a balanced order). Each pass records what
//! the block device under `--dir` counted (`/sys/dev/block/MAJ:MIN/stat`): the bytes and requests
//! it really received, so a pass served from a cache, or moving fewer bytes, shows. It also
//! records the physical layout of the memory the pass moved (runs of physically consecutive pages
//! per MiB, from `/proc/PID/pagemap`, readable as root): a request carries one scatter-gather
//! segment per run, and a device that takes a ring entry per segment (virtio-blk without indirect
//! descriptors) holds fewer requests at once the more scattered the memory, which moves the
//! throughput as much as anything the two sides do differently. Figures are medians with the
//! range (min-max) over the iterations, since a shared virtual disk varies from pass to pass.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::stats::{fill_block, median};
use clap::{Args, ValueEnum};
use kvbm_disk::{
    AlignedBuf, CacheFile, DiskStore, EngineChoice, Lookup, ReadRequest, StoreOptions,
    WriteOutcome, WriteRequest, REGISTERED_BUFFER_BYTES_MAX,
};

/// Bytes of a block's header, and of the superblock before slot 0.
const HEADER: usize = 4096;
const GIB: f64 = (1u64 << 30) as f64;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    Auto,
    IoUring,
    Psync,
}

/// How fio is configured.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum FioProfile {
    /// kvbm's I/O: op size (header + payload area), offsets, preallocated file of the same size,
    /// queue depth and batched submission.
    Matched,
    /// The former yardstick: payload-sized ops from offset 0, one op per submission.
    Legacy,
}

#[derive(Args, Debug)]
pub struct DiskArgs {
    /// Blocks written and read per pass.
    #[arg(long, default_value_t = 512)]
    blocks: usize,
    /// Payload GiB per pass (sets --blocks to this many GiB of --block-bytes blocks).
    #[arg(long, conflicts_with = "blocks")]
    gib: Option<f64>,
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
    /// Timed write/read rounds per side (who goes first alternates); figures are medians.
    #[arg(long, default_value_t = 6)]
    iterations: usize,
    /// Untimed write/read rounds per side first (the first write of a preallocated file
    /// converts its unwritten extents; later ones overwrite).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Idle milliseconds before every pass, timed or not.
    #[arg(long, default_value_t = 1000)]
    settle_ms: u64,
    /// What fio does.
    #[arg(long, value_enum, default_value_t = FioProfile::Matched)]
    fio_profile: FioProfile,
    /// fio's `--iomem` for its buffers with the matched profile (`mmap`: an anonymous mapping,
    /// as kvbm's buffer is; `mmaphuge` needs reserved huge pages).
    #[arg(long, default_value = "mmap")]
    fio_iomem: String,
    /// Do not run fio.
    #[arg(long)]
    no_fio: bool,
    /// End with one JSON line of results.
    #[arg(long)]
    json: bool,
}

/// Sizes of one pass.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    blocks: usize,
    payload: usize,
    /// One op: header plus payload area (kvbm's slot).
    op: usize,
    /// The cache file: superblock plus the slots.
    file: u64,
}

impl Geometry {
    /// Bytes one pass moves (headers included).
    fn moved(&self) -> u64 {
        (self.blocks * self.op) as u64
    }
}

/// A block device's cumulative counters (`Documentation/block/stat.rst`).
#[derive(Debug, Clone, Copy, Default)]
struct DevCounters {
    read_ios: u64,
    read_merges: u64,
    read_bytes: u64,
    write_ios: u64,
    write_merges: u64,
    write_bytes: u64,
}

impl DevCounters {
    fn read(path: &Path) -> Option<Self> {
        let text = std::fs::read_to_string(path).ok()?;
        let f: Vec<u64> = text
            .split_whitespace()
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        (f.len() >= 7).then(|| Self {
            read_ios: f[0],
            read_merges: f[1],
            read_bytes: f[2] * 512,
            write_ios: f[4],
            write_merges: f[5],
            write_bytes: f[6] * 512,
        })
    }

    fn since(&self, before: &Self) -> Self {
        Self {
            read_ios: self.read_ios.saturating_sub(before.read_ios),
            read_merges: self.read_merges.saturating_sub(before.read_merges),
            read_bytes: self.read_bytes.saturating_sub(before.read_bytes),
            write_ios: self.write_ios.saturating_sub(before.write_ios),
            write_merges: self.write_merges.saturating_sub(before.write_merges),
            write_bytes: self.write_bytes.saturating_sub(before.write_bytes),
        }
    }

    /// (requests, merges, bytes) in one direction.
    fn direction(&self, write: bool) -> (u64, u64, u64) {
        if write {
            (self.write_ios, self.write_merges, self.write_bytes)
        } else {
            (self.read_ios, self.read_merges, self.read_bytes)
        }
    }
}

/// The stat file of the block device holding `dir`, where it has one (not on tmpfs or overlays).
fn device_stat_path(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(dir).ok()?.dev();
    // glibc's gnu_dev_major / gnu_dev_minor.
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0fff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    let path = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
    DevCounters::read(&path).map(|_| path)
}

/// Runs of physically consecutive pages per MiB of the pages present in `[addr, addr + len)` of
/// process `pid`, from `/proc/PID/pagemap`: about the scatter-gather entries each MiB of a
/// request from that memory needs (the block layer merges physically adjacent pages into one).
/// `None` where the page frame numbers cannot be read (they read as 0 without CAP_SYS_ADMIN) or
/// fewer than `need` bytes of pages are present.
fn phys_runs_per_mib(pid: &str, addr: u64, len: u64, need: u64) -> Option<f64> {
    use std::io::{Read, Seek, SeekFrom};
    const PAGE: u64 = 4096;
    let mut file = std::fs::File::open(format!("/proc/{pid}/pagemap")).ok()?;
    file.seek(SeekFrom::Start(addr / PAGE * 8)).ok()?;
    let mut raw = vec![0u8; (len / PAGE) as usize * 8];
    file.read_exact(&mut raw).ok()?;
    let (mut runs, mut present) = (0u64, 0u64);
    let mut previous: Option<u64> = None;
    for entry in raw.chunks_exact(8) {
        let entry = u64::from_le_bytes(entry.try_into().ok()?);
        let pfn = entry & ((1 << 55) - 1);
        if entry >> 63 == 0 {
            previous = None;
            continue;
        }
        if pfn == 0 {
            return None;
        }
        present += 1;
        if previous.is_none_or(|p| pfn != p + 1) {
            runs += 1;
        }
        previous = Some(pfn);
    }
    (present > 0 && present * PAGE >= need)
        .then(|| runs as f64 * (1 << 20) as f64 / (present * PAGE) as f64)
}

/// fio's I/O buffers (one anonymous mapping of `bytes`, rounded up to pages, in the process
/// `pid`, which runs the job as a thread), once every page of them is present: their
/// [`phys_runs_per_mib`].
fn fio_buffer_runs(pid: u32, bytes: u64) -> Option<f64> {
    let pid = pid.to_string();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let want = bytes.div_ceil(4096) * 4096;
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        let anonymous = fields.nth(4).is_none();
        let size = end - start;
        (anonymous && (want..=want + (1 << 20)).contains(&size))
            .then(|| phys_runs_per_mib(&pid, start, size, want))
            .flatten()
    })
}

/// The request limits of the block device whose stat file is `stat` (a partition's are its
/// disk's): what bounds a request's size and its scatter-gather list.
fn device_limits(stat: &Path) -> Option<String> {
    let dev = stat.parent()?;
    let queue = [dev.join("queue"), dev.join("../queue")]
        .into_iter()
        .find(|q| q.join("max_segments").exists())?;
    let read = |name: &str| {
        std::fs::read_to_string(queue.join(name))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|_| "?".to_owned())
    };
    Some(format!(
        "max_segments {}, max_sectors_kb {}, nr_requests {}, scheduler {}",
        read("max_segments"),
        read("max_sectors_kb"),
        read("nr_requests"),
        read("scheduler")
    ))
}

/// One timed (or warm-up) pass.
#[derive(Debug, Clone)]
struct Pass {
    side: &'static str,
    write: bool,
    /// GB/s over the bytes the pass moved (headers included).
    gbps: f64,
    secs: f64,
    /// What the block device counted around the pass.
    dev: Option<DevCounters>,
    /// Physical runs per MiB of the memory the pass moved data from or to.
    runs: Option<f64>,
    /// fio's own figures: mean submission and completion latency (ms), and how many ops its
    /// submissions carried (percent of submissions per bucket, as fio reports them).
    fio_note: Option<String>,
}

impl Pass {
    fn print(&self, label: &str, moved: u64) {
        let dir = if self.write { "write" } else { "read" };
        let dev = match self.dev {
            Some(d) => {
                let (ios, merges, bytes) = d.direction(self.write);
                format!(
                    "{:>7.1}% {:>7} {:>8.0} {:>6}",
                    bytes as f64 * 100.0 / moved as f64,
                    ios,
                    if ios > 0 {
                        bytes as f64 / ios as f64 / 1024.0
                    } else {
                        0.0
                    },
                    merges
                )
            }
            None => format!("{:>7} {:>7} {:>8} {:>6}", "-", "-", "-", "-"),
        };
        let runs = self
            .runs
            .map_or_else(|| "-".to_owned(), |r| format!("{r:.0}"));
        println!(
            "{label:<6} {:<5} {dir:<5} {:>7.2} {:>7.3} {dev} {runs:>8}  {}",
            self.side,
            self.gbps,
            self.secs,
            self.fio_note.as_deref().unwrap_or("")
        );
    }
}

/// fio's command line for one pass.
fn fio_command(file: &Path, write: bool, g: &Geometry, args: &DiskArgs) -> Vec<String> {
    let rw = if write { "write" } else { "read" };
    let qd = args.queue_depth;
    let mut cmd = vec![
        "fio".to_owned(),
        "--name=kvbm-yardstick".to_owned(),
        format!("--filename={}", file.display()),
        format!("--rw={rw}"),
    ];
    match args.fio_profile {
        FioProfile::Matched => cmd.extend([
            format!("--bs={}", g.op),
            format!("--offset={HEADER}"),
            format!("--size={}", g.moved()),
            format!("--iodepth={qd}"),
            format!("--iodepth_batch_submit={qd}"),
            "--iodepth_batch_complete_min=1".to_owned(),
            format!("--iodepth_batch_complete_max={qd}"),
            format!("--iomem={}", args.fio_iomem),
            "--fallocate=none".to_owned(),
        ]),
        FioProfile::Legacy => cmd.extend([
            format!("--bs={}", g.payload),
            format!("--size={}", g.blocks * g.payload),
            format!("--iodepth={qd}"),
        ]),
    }
    cmd.extend(
        [
            "--ioengine=io_uring",
            "--direct=1",
            "--fixedbufs",
            "--registerfiles",
            "--numjobs=1",
            "--thread",
            "--output-format=json",
        ]
        .map(str::to_owned),
    );
    cmd
}

/// What one fio pass reported.
#[derive(Debug)]
struct FioRun {
    gbps: f64,
    secs: f64,
    /// Physical runs per MiB of its I/O buffers, sampled while it ran.
    runs: Option<f64>,
    note: String,
}

/// One fio pass: its bandwidth from its own JSON (bytes over its runtime, which excludes its
/// start-up: buffer allocation and fill, file open, registration), the physical layout of its
/// buffers (sampled while it runs), and a note of its batching, latencies and whole run time.
fn fio_pass(cmd: &[String], write: bool, buffer_bytes: u64) -> anyhow::Result<FioRun> {
    use std::io::Read;
    use std::process::Stdio;
    let started = Instant::now();
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running fio")?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        }
    };
    let stdout = child
        .stdout
        .take()
        .map(|p| Box::new(p) as Box<dyn Read + Send>);
    let stderr = child
        .stderr
        .take()
        .map(|p| Box::new(p) as Box<dyn Read + Send>);
    let (status, out, err, runs) = std::thread::scope(|scope| -> anyhow::Result<_> {
        let out = scope.spawn(drain(stdout));
        let err = scope.spawn(drain(stderr));
        // Sample the buffers' layout once they are all present (fio fills write buffers and
        // registration pins read buffers before the first I/O); then just wait.
        let mut runs = None;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            runs = fio_buffer_runs(child.id(), buffer_bytes);
            if runs.is_some() {
                break child.wait()?;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let join = |h: std::thread::ScopedJoinHandle<'_, Vec<u8>>| h.join().unwrap_or_default();
        Ok((status, join(out), join(err), runs))
    })?;
    let wall = started.elapsed().as_secs_f64();
    if !status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&err));
    }
    let json: serde_json::Value = serde_json::from_slice(&out).context("fio's JSON")?;
    let job = &json["jobs"][0];
    let side = &job[if write { "write" } else { "read" }];
    let bytes = side["io_bytes"].as_f64().context("fio's JSON: io_bytes")?;
    let runtime_ms = side["runtime"].as_f64().context("fio's JSON: runtime")?;
    if runtime_ms <= 0.0 {
        bail!("fio reported a runtime of {runtime_ms} ms");
    }
    let ms = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN) / 1e6;
    let submit: Vec<String> = job["iodepth_submit"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(_, pct)| pct.as_f64().unwrap_or(0.0) >= 1.0)
                .map(|(k, pct)| format!("{k}:{:.0}%", pct.as_f64().unwrap_or(0.0)))
                .collect()
        })
        .unwrap_or_default();
    let note = format!(
        "fio: slat {:.2} ms, clat {:.1} ms, ops per submit (bucket:share) {}, process {:.2} s",
        ms(&side["slat_ns"]["mean"]),
        ms(&side["clat_ns"]["mean"]),
        submit.join(" "),
        wall
    );
    let secs = runtime_ms / 1e3;
    Ok(FioRun {
        gbps: bytes / secs / 1e9,
        secs,
        runs,
        note,
    })
}

/// The system's transparent huge page mode (the bracketed word of its setting), or "unknown".
fn thp_mode() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|s| {
            let (_, rest) = s.split_once('[')?;
            Some(rest.split_once(']')?.0.to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn fio_installed() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Removes the bench's files (and the directory it made) however the run ends.
#[derive(Debug)]
struct Cleanup {
    files: Vec<PathBuf>,
    dir: Option<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for file in &self.files {
            let _ = std::fs::remove_file(file);
        }
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// `median [min-max]` of `values`.
fn spread(values: &[f64]) -> (f64, f64, f64) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (median(values), min, max)
}

fn fmt_spread(values: &[f64]) -> String {
    if values.is_empty() {
        return "-".to_owned();
    }
    let (m, lo, hi) = spread(values);
    format!("{m:.2} [{lo:.2}-{hi:.2}]")
}

fn json_spread(values: &[f64]) -> serde_json::Value {
    if values.is_empty() {
        return serde_json::Value::Null;
    }
    let (m, lo, hi) = spread(values);
    serde_json::json!({ "median": m, "min": lo, "max": hi, "runs": values })
}

/// A finite number, or JSON null.
fn num(x: f64) -> serde_json::Value {
    if x.is_finite() {
        serde_json::json!(x)
    } else {
        serde_json::Value::Null
    }
}

pub fn run(args: DiskArgs) -> anyhow::Result<bool> {
    let blocks = match args.gib {
        Some(gib) if gib > 0.0 && args.block_bytes > 0 => {
            (gib * GIB / args.block_bytes as f64).round() as usize
        }
        Some(gib) => bail!("--gib {gib}: must be positive"),
        None => args.blocks,
    };
    if blocks == 0 || args.block_bytes == 0 || args.iterations == 0 {
        bail!("--blocks (or --gib), --block-bytes and --iterations must come to at least 1");
    }
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvbm-bench-disk-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Declared before the store and the buffer, so dropped after them, on every return.
    let _cleanup = Cleanup {
        files: vec![dir.join("bench.kvbm"), dir.join("fio.dat")],
        dir: args.dir.is_none().then(|| dir.clone()),
    };
    let engine = match args.engine {
        EngineArg::Auto => EngineChoice::Auto,
        EngineArg::IoUring => EngineChoice::IoUring,
        EngineArg::Psync => EngineChoice::Psync,
    };
    let area = args.block_bytes.div_ceil(HEADER) * HEADER;
    // Each block: 4 KiB of header room, then its payload area; on disk, a slot of the same size.
    let stride = HEADER + area;
    let g = Geometry {
        blocks,
        payload: args.block_bytes,
        op: stride,
        file: (HEADER + blocks * stride) as u64,
    };
    let mut buffer = AlignedBuf::new(blocks * stride).context("allocating the block buffer")?;
    for (i, block) in buffer.as_mut_slice().chunks_mut(stride).enumerate() {
        fill_block(i as u64, &mut block[HEADER..HEADER + args.block_bytes]);
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
        slots: blocks,
        queue_depth: args.queue_depth,
        engine,
        file: Default::default(),
        write_failures_max: 8,
    };
    // SAFETY: `buffer` outlives the store (the store is dropped before the buffer, below).
    let (store, _) = unsafe { DiskStore::open_with_buffers(&dir, "bench.kvbm", options, &pieces) }
        .context("opening the store")?;
    if store.file().len() != g.file {
        bail!(
            "the cache file is {} bytes, expected {}",
            store.file().len(),
            g.file
        );
    }
    let io_mode = store.file().io_mode();
    let engine_kind = store.engine().kind();
    let base = buffer.addr();
    let addr = |i: usize| base + (i * stride + HEADER) as u64;

    let run_fio = !args.no_fio && fio_installed();
    let fio_file = dir.join("fio.dat");
    if run_fio {
        // Created, sized and preallocated exactly as the cache file is, then released for fio.
        CacheFile::open(&dir, "fio.dat", g.file, Default::default())
            .context("preallocating fio's file")?;
    }
    let fio_note = if args.no_fio {
        "fio skipped (--no-fio)".to_owned()
    } else if !run_fio {
        "fio is not installed (apt-get install fio): no yardstick this run".to_owned()
    } else {
        format!(
            "fio ({:?}): {} (and --rw=read)",
            args.fio_profile,
            fio_command(&fio_file, true, &g, &args).join(" ")
        )
    };
    let dev_path = device_stat_path(&dir);
    // The buffer is faulted in (filled) and pinned (registered): its layout stays as it is now.
    let kvbm_runs = phys_runs_per_mib("self", buffer.addr(), buffer.len() as u64, 0);
    let fio_buffer_bytes = (args.queue_depth
        * match args.fio_profile {
            FioProfile::Matched => g.op,
            FioProfile::Legacy => g.payload,
        }) as u64;
    let settle = Duration::from_millis(args.settle_ms);
    let moved = g.moved();

    println!(
        "kvbm disk: {} blocks of {:.2} MiB ({:.2} GiB payload per pass, {} bytes per op with the \
         header), queue depth {}, engine {}, {:?} I/O, in {}",
        blocks,
        args.block_bytes as f64 / (1 << 20) as f64,
        (blocks * args.block_bytes) as f64 / GIB,
        stride,
        args.queue_depth,
        engine_kind.as_str(),
        io_mode,
        dir.display()
    );
    println!("{fio_note}");
    println!(
        "{} warm-up round(s), then {} timed; {} ms idle before each pass; device counters: {}",
        args.warmup,
        args.iterations,
        args.settle_ms,
        dev_path
            .as_ref()
            .map_or("none for this directory".to_owned(), |p| p
                .display()
                .to_string())
    );
    if let Some(limits) = dev_path.as_deref().and_then(device_limits) {
        println!("device limits: {limits}");
    }
    println!(
        "dev/pass: bytes the device counted over the bytes the pass moved; runs/MiB: runs of \
         physically consecutive pages per MiB of the pass's buffer (about the scatter-gather \
         entries per MiB of a request: on a device with a small ring this bounds the requests in \
         flight)"
    );
    println!(
        "{:<6} {:<5} {:<5} {:>7} {:>7} {:>8} {:>7} {:>8} {:>6} {:>8}",
        "round", "side", "dir", "GB/s", "s", "dev/pass", "dev req", "KiB/req", "merges", "runs/MiB"
    );

    let mut passes: Vec<(usize, Pass)> = Vec::new();
    let mut verified = true;
    let mut key_base = 0u64;
    let devnow = || dev_path.as_deref().and_then(DevCounters::read);
    for round in 0..args.warmup + args.iterations {
        let timed = round >= args.warmup;
        let label = if timed {
            format!("{}", round - args.warmup + 1)
        } else {
            "warm".to_owned()
        };
        // Who goes first alternates over the timed rounds.
        let fio_first = run_fio && timed && (round - args.warmup) % 2 == 1;
        let mut sides = vec!["kvbm"];
        if run_fio {
            if fio_first {
                sides.insert(0, "fio");
            } else {
                sides.push("fio");
            }
        }
        for side in sides {
            for write in [true, false] {
                let pass = if side == "fio" {
                    let cmd = fio_command(&fio_file, write, &g, &args);
                    std::thread::sleep(settle);
                    let before = devnow();
                    let run = fio_pass(&cmd, write, fio_buffer_bytes)?;
                    let dev = before.zip(devnow()).map(|(b, a)| a.since(&b));
                    Pass {
                        side,
                        write,
                        gbps: run.gbps,
                        secs: run.secs,
                        dev,
                        runs: run.runs,
                        fio_note: Some(run.note),
                    }
                } else {
                    let (secs, dev) = if write {
                        let writes: Vec<WriteRequest> = (0..blocks)
                            .map(|i| WriteRequest {
                                slot: i as u32,
                                key: key_base + i as u64,
                                addr: addr(i),
                                metadata: &[],
                                framed: true,
                            })
                            .collect();
                        std::thread::sleep(settle);
                        let before = devnow();
                        let start = Instant::now();
                        // SAFETY: the payloads lie in `buffer`, which is neither written nor
                        // freed during the call.
                        let outcomes = unsafe { store.write_raw(&writes, Box::new(())) }?;
                        let secs = start.elapsed().as_secs_f64();
                        let dev = before.zip(devnow()).map(|(b, a)| a.since(&b));
                        if let Some(bad) = outcomes.iter().find(|o| **o != WriteOutcome::Stored) {
                            bail!("a block was not stored: {bad:?}");
                        }
                        (secs, dev)
                    } else {
                        let reads: Vec<ReadRequest> = (0..blocks)
                            .map(|i| ReadRequest {
                                slot: i as u32,
                                key: key_base + i as u64,
                                addr: addr(i),
                                framed: true,
                            })
                            .collect();
                        buffer.as_mut_slice().fill(0);
                        std::thread::sleep(settle);
                        let before = devnow();
                        let start = Instant::now();
                        // SAFETY: the destinations lie in `buffer`, used by nothing else during
                        // the call.
                        let lookups = unsafe { store.read_raw(&reads, Box::new(())) }?;
                        let secs = start.elapsed().as_secs_f64();
                        let dev = before.zip(devnow()).map(|(b, a)| a.since(&b));
                        verified &= lookups.iter().all(|l| *l == Lookup::Hit);
                        let mut expected = vec![0u8; args.block_bytes];
                        for (i, block) in buffer.as_slice().chunks(stride).enumerate() {
                            fill_block(i as u64, &mut expected);
                            verified &= block[HEADER..HEADER + args.block_bytes] == expected[..];
                        }
                        key_base += blocks as u64;
                        (secs, dev)
                    };
                    Pass {
                        side,
                        write,
                        gbps: moved as f64 / secs / 1e9,
                        secs,
                        dev,
                        runs: kvbm_runs,
                        fio_note: None,
                    }
                };
                let pass_moved = if side == "fio" && args.fio_profile == FioProfile::Legacy {
                    (g.blocks * g.payload) as u64
                } else {
                    moved
                };
                pass.print(&label, pass_moved);
                if timed {
                    passes.push((round - args.warmup, pass));
                }
            }
        }
    }
    let stats = store.stats();
    let fixed_ops = store.engine().fixed_ops();
    drop(store);
    drop(buffer);

    let series = |side: &str, write: bool| -> Vec<f64> {
        passes
            .iter()
            .filter(|(_, p)| p.side == side && p.write == write)
            .map(|(_, p)| p.gbps)
            .collect()
    };
    // kvbm over fio within each round, where both ran.
    let paired = |write: bool| -> Vec<f64> {
        let (k, f) = (series("kvbm", write), series("fio", write));
        k.iter().zip(&f).map(|(k, f)| k / f).collect()
    };
    let (kw, kr, fw, fr) = (
        series("kvbm", true),
        series("kvbm", false),
        series("fio", true),
        series("fio", false),
    );
    println!(
        "GB/s over the bytes each pass moved ({:.3} GB, headers included; kvbm's payload is {:.2}% \
         of it); median [min-max] over {} rounds",
        moved as f64 / 1e9,
        (blocks * args.block_bytes) as f64 * 100.0 / moved as f64,
        args.iterations
    );
    println!(
        "{:<10} {:>20} {:>20} {:>10} {:>20}",
        "direction", "kvbm GB/s", "fio GB/s", "kvbm/fio", "kvbm/fio per round"
    );
    for (name, k, f, write) in [("write", &kw, &fw, true), ("read", &kr, &fr, false)] {
        println!(
            "{:<10} {:>20} {:>20} {:>10.2} {:>20}",
            name,
            fmt_spread(k),
            fmt_spread(f),
            median(k) / median(f),
            fmt_spread(&paired(write))
        );
    }
    let runs = |side: &str, write: bool| -> Vec<f64> {
        passes
            .iter()
            .filter(|(_, p)| p.side == side && p.write == write)
            .filter_map(|(_, p)| p.runs)
            .collect()
    };
    let (krw, frw, frr) = (runs("kvbm", true), runs("fio", true), runs("fio", false));
    println!(
        "buffers, runs/MiB median [min-max]: kvbm {}, fio write {}, fio read {} (transparent huge \
         pages: {})",
        fmt_spread(&krw),
        fmt_spread(&frw),
        fmt_spread(&frr),
        thp_mode()
    );
    // Worth a note when one side is scattered (over 32 runs/MiB: 8 MiB of requests would fill a
    // 256-entry ring) and the two differ by over 2x.
    let apart = |a: &[f64], b: &[f64]| {
        if a.is_empty() || b.is_empty() {
            return false;
        }
        let (a, b) = (median(a).max(1.0), median(b).max(1.0));
        a.max(b) > 32.0 && a.max(b) / a.min(b) > 2.0
    };
    if apart(&krw, &frw) || apart(&krw, &frr) {
        println!(
            "note: kvbm's and fio's buffers differ in physical layout: where the device takes one \
             ring entry per scatter-gather segment (virtio-blk without indirect descriptors), the \
             side with fewer runs/MiB keeps more requests in flight, and that alone moves these \
             ratios; for a like-for-like run give both huge pages (transparent_hugepage enabled \
             = always during the run)"
        );
    }
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
        let payload_share = (blocks * args.block_bytes) as f64 / moved as f64;
        println!(
            "{}",
            serde_json::json!({
                "write_gbps": median(&kw) * payload_share,
                "read_gbps": median(&kr) * payload_share,
                "kvbm_write_moved_gbps": json_spread(&kw),
                "kvbm_read_moved_gbps": json_spread(&kr),
                "fio_write_gbps": num(median(&fw)),
                "fio_read_gbps": num(median(&fr)),
                "fio_write": json_spread(&fw),
                "fio_read": json_spread(&fr),
                "write_vs_fio": num(median(&kw) / median(&fw)),
                "read_vs_fio": num(median(&kr) / median(&fr)),
                "write_vs_fio_per_round": json_spread(&paired(true)),
                "read_vs_fio_per_round": json_spread(&paired(false)),
                "fio_command": if run_fio {
                    serde_json::json!(fio_command(&fio_file, true, &g, &args).join(" "))
                } else {
                    serde_json::Value::Null
                },
                "block_bytes": args.block_bytes,
                "blocks": blocks,
                "bytes_moved_per_pass": moved,
                "queue_depth": args.queue_depth,
                "engine": engine_kind.as_str(),
                "io_mode": format!("{io_mode:?}"),
                "iterations": args.iterations,
                "warmup": args.warmup,
                "settle_ms": args.settle_ms,
                "verified": verified,
                "fixed_buffer_ops": fixed_ops,
                "kvbm_buffer_runs_per_mib": json_spread(&krw),
                "fio_write_buffer_runs_per_mib": json_spread(&frw),
                "fio_read_buffer_runs_per_mib": json_spread(&frr),
                "transparent_hugepage": thp_mode(),
            })
        );
    }
    Ok(verified)
}
