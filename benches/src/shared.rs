//! `kvbm-bench shared`: the shared tier's client (`kvbm_core::shared::SharedStore`) writing and
//! reading blocks on a Redis / Valkey server, against `redis-benchmark` doing SET and GET of the
//! same value size at the same pipeline depth on the same server, interleaved in the same run.
//!
//! kvbm's side is the tier's real path: a write encodes each block's value (header, identity,
//! payload, XXH3 checksum: one copy of the block) and sends `SET key value PX ttl` for `--depth`
//! blocks at once on one multiplexed connection, then waits for every reply
//! (`SharedStore::write` then `flush`); a read asks `--depth` blocks at once
//! (`SharedStore::read`) and checks each value whole (header, lengths, checksum). Every byte read
//! is compared with what was written, outside the timing. `redis-benchmark` runs one client
//! (`-c 1`) with `-P DEPTH` (depth commands sent, then every reply awaited) and `-d` the size of
//! kvbm's value (block plus header and identity), over `-r` keys, all written beforehand so that
//! its GETs hit as kvbm's do; its figure is its own requests per second. Each side writes then reads; which goes first alternates per iteration.
//! Figures: medians over the iterations with the range (min-max).
//!
//! Without `--url` it starts `redis-server` on a free loopback port (no persistence) and stops
//! it at the end.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use kvbm_core::shared::store::SharedPut;
use kvbm_core::shared::{SharedOptions, SharedStore};
use kvbm_core::{BlockIdentity, SequenceHash};

use crate::stats::{fill_block, median};

/// One Qwen3-0.6B block of 16 tokens: 28 layers x K and V x 8 KV heads x 128 x 2 bytes x 16.
pub const QWEN3_06B_BLOCK_BYTES: usize = 28 * 2 * 8 * 128 * 2 * 16;

#[derive(Args, Debug)]
pub struct SharedArgs {
    /// The server (`redis://HOST:PORT`); default: a redis-server started on loopback.
    #[arg(long)]
    pub url: Option<String>,
    /// Bytes of one block (default: Qwen3-0.6B, 16 tokens, bfloat16).
    #[arg(long, default_value_t = QWEN3_06B_BLOCK_BYTES)]
    pub block_bytes: usize,
    /// Blocks written and read per pass.
    #[arg(long, default_value_t = 256)]
    pub blocks: usize,
    /// Commands in flight: kvbm's blocks per write batch and per read, redis-benchmark's -P.
    #[arg(long, default_value_t = 16)]
    pub depth: usize,
    /// Passes of each side.
    #[arg(long, default_value_t = 3)]
    pub iterations: usize,
    /// The redis-benchmark binary.
    #[arg(long, default_value = "redis-benchmark")]
    pub redis_benchmark: String,
    /// Write the results as JSON here.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// A redis-server this benchmark started.
struct Server {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server() -> anyhow::Result<(Server, String, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let dir = tempfile::tempdir()?;
    let child = Command::new("redis-server")
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting redis-server (apt-get install redis-server, or give --url)")?;
    let server = Server { child, _dir: dir };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        if Instant::now() > deadline {
            bail!("redis-server on port {port} did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((server, format!("redis://127.0.0.1:{port}"), port))
}

/// One side's figures for one pass (operations per second).
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Pass {
    set_per_s: f64,
    get_per_s: f64,
}

fn identity(i: usize) -> BlockIdentity {
    BlockIdentity {
        sequence_hash: SequenceHash(0x5eed_0000 + i as u64),
        parent: (i > 0).then(|| SequenceHash(0x5eed_0000 + i as u64 - 1)),
        tokens: (0..16u32)
            .map(|t| t + 16 * i as u32)
            .collect::<Vec<_>>()
            .into(),
        lora_name: None,
        group: None,
    }
}

fn kvbm_pass(store: &SharedStore, blocks: &[SharedPut], depth: usize) -> anyhow::Result<Pass> {
    let started = Instant::now();
    for chunk in blocks.chunks(depth) {
        let queued = store.write(0, chunk);
        if queued != chunk.len() {
            bail!(
                "kvbm: {} of {} blocks queued: {:?}",
                queued,
                chunk.len(),
                store.counts()
            );
        }
        if !store.flush(Duration::from_secs(60)) {
            bail!("kvbm: writes did not finish: {:?}", store.counts());
        }
    }
    let set_s = started.elapsed().as_secs_f64();
    let hashes: Vec<SequenceHash> = blocks.iter().map(|b| b.identity.sequence_hash).collect();
    // Each chunk is checked against what was written (outside the timing) and dropped, as the
    // tier copies a read block into host memory and lets the value go.
    let mut get_s = 0.0;
    for (c, chunk) in hashes.chunks(depth).enumerate() {
        let started = Instant::now();
        let read = store.read(0, chunk);
        get_s += started.elapsed().as_secs_f64();
        for (j, got) in read.iter().enumerate() {
            let i = c * depth + j;
            let want = &blocks[i];
            let got = got
                .as_ref()
                .with_context(|| format!("kvbm: block {i} not read back: {:?}", store.counts()))?;
            if got.payload() != &want.payload[..] || got.identity != want.identity {
                bail!("kvbm: block {i} read back differs");
            }
        }
    }
    Ok(Pass {
        set_per_s: blocks.len() as f64 / set_s,
        get_per_s: blocks.len() as f64 / get_s,
    })
}

fn redis_benchmark_pass(
    binary: &str,
    host: &str,
    port: u16,
    value_bytes: usize,
    blocks: usize,
    depth: usize,
) -> anyhow::Result<Pass> {
    let out = Command::new(binary)
        .args(["-h", host, "-p", &port.to_string()])
        .args(["-t", "set,get", "-c", "1", "--csv"])
        .args(["-n", &blocks.to_string()])
        .args(["-r", &blocks.to_string()])
        .args(["-d", &value_bytes.to_string()])
        .args(["-P", &depth.to_string()])
        .output()
        .with_context(|| format!("running {binary} (apt-get install redis-tools)"))?;
    if !out.status.success() {
        bail!(
            "{binary} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = |test: &str| -> anyhow::Result<f64> {
        text.lines()
            .find_map(|l| {
                let mut f = l.split(',').map(|c| c.trim_matches('"'));
                (f.next() == Some(test)).then(|| f.next().and_then(|v| v.parse::<f64>().ok()))?
            })
            .with_context(|| format!("{binary} printed no {test} figure: {text}"))
    };
    Ok(Pass {
        set_per_s: rps("SET")?,
        get_per_s: rps("GET")?,
    })
}

/// Writes redis-benchmark's `-r` key range (`key:` and 12 digits) with values of `value_bytes`.
fn prefill_benchmark_keys(url: &str, blocks: usize, value_bytes: usize) -> anyhow::Result<()> {
    let mut con = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .with_context(|| format!("connecting to {url} to fill redis-benchmark's keys"))?;
    let value = vec![b'x'; value_bytes];
    for chunk in (0..blocks).collect::<Vec<_>>().chunks(16) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.cmd("SET")
                .arg(format!("key:{i:012}"))
                .arg(&value)
                .ignore();
        }
        pipe.query::<()>(&mut con)
            .with_context(|| format!("filling redis-benchmark's keys on {url}"))?;
    }
    Ok(())
}

pub fn run(args: SharedArgs) -> anyhow::Result<bool> {
    if args.blocks == 0 || args.block_bytes == 0 || args.depth == 0 || args.iterations == 0 {
        bail!("--blocks, --block-bytes, --depth and --iterations must be at least 1");
    }
    let (_server, url) = match &args.url {
        Some(u) => (None, u.clone()),
        None => {
            let (s, u, _) = start_server()?;
            (Some(s), u)
        }
    };
    let (host, port) = match redis::IntoConnectionInfo::into_connection_info(url.as_str())
        .map(|i| i.addr().clone())
    {
        Ok(redis::ConnectionAddr::Tcp(h, p)) => (h, p),
        _ => bail!("--url {url}: expected redis://HOST:PORT (redis-benchmark needs TCP)"),
    };
    let mut options = SharedOptions::new(vec![url.clone()]);
    options.write_batch_blocks = args.depth;
    options.writes_in_flight = 1;
    options.read_timeout = Duration::from_secs(60);
    options.write_timeout = Duration::from_secs(60);
    options.lookup_timeout = Duration::from_secs(5);
    let store = SharedStore::open(options, 0x0062_656e_6368, args.block_bytes)?;
    let blocks: Vec<SharedPut> = (0..args.blocks)
        .map(|i| {
            let mut payload = vec![0u8; args.block_bytes];
            fill_block(i as u64 + 1, &mut payload);
            SharedPut {
                identity: identity(i),
                payload: Arc::from(payload),
            }
        })
        .collect();
    let value_bytes =
        kvbm_core::shared::encode_value(0, 0, &blocks[0].identity, &blocks[0].payload).len();
    // redis-benchmark's keys (`-r`: key:NNNNNNNNNNNN) all exist before it runs, so that its GETs,
    // like kvbm's, all hit.
    prefill_benchmark_keys(&url, args.blocks, value_bytes)?;
    println!(
        "shared tier on {url}: {} blocks of {} bytes (values {} bytes), depth {}, {} iterations",
        args.blocks, args.block_bytes, value_bytes, args.depth, args.iterations
    );
    let mut kvbm = Vec::new();
    let mut yardstick = Vec::new();
    for it in 0..args.iterations {
        let ours_first = it % 2 == 0;
        for side in 0..2 {
            if (side == 0) == ours_first {
                kvbm.push(kvbm_pass(&store, &blocks, args.depth)?);
            } else {
                yardstick.push(redis_benchmark_pass(
                    &args.redis_benchmark,
                    &host,
                    port,
                    value_bytes,
                    args.blocks,
                    args.depth,
                )?);
            }
        }
    }
    let med = |v: &[Pass], f: fn(&Pass) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
    let range = |v: &[Pass], f: fn(&Pass) -> f64| {
        let x: Vec<f64> = v.iter().map(f).collect();
        (
            x.iter().copied().fold(f64::INFINITY, f64::min),
            x.iter().copied().fold(0.0, f64::max),
        )
    };
    let gbs = |ops: f64| ops * value_bytes as f64 / 1e9;
    println!("| op | kvbm ops/s (min-max) | kvbm GB/s | redis-benchmark ops/s (min-max) | redis-benchmark GB/s | kvbm / redis-benchmark |");
    println!("|---|--:|--:|--:|--:|--:|");
    let mut rows = Vec::new();
    for (name, f) in [
        ("SET", (|p: &Pass| p.set_per_s) as fn(&Pass) -> f64),
        ("GET", |p: &Pass| p.get_per_s),
    ] {
        let (k, y) = (med(&kvbm, f), med(&yardstick, f));
        let (kr, yr) = (range(&kvbm, f), range(&yardstick, f));
        println!(
            "| {name} | {k:.0} ({:.0}-{:.0}) | {:.2} | {y:.0} ({:.0}-{:.0}) | {:.2} | {:.2} |",
            kr.0,
            kr.1,
            gbs(k),
            yr.0,
            yr.1,
            gbs(y),
            k / y
        );
        rows.push(serde_json::json!({
            "op": name, "kvbm_ops_per_s": k, "redis_benchmark_ops_per_s": y, "ratio": k / y,
        }));
    }
    let c = store.counts();
    if c.bad_values.iter().sum::<u64>() > 0 || c.timeouts > 0 {
        bail!("the shared tier counted bad values or timeouts: {c:?}");
    }
    if let Some(path) = &args.out {
        let json = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "block_bytes": args.block_bytes,
            "value_bytes": value_bytes,
            "blocks": args.blocks,
            "depth": args.depth,
            "iterations": args.iterations,
            "summary": rows,
            "kvbm": kvbm,
            "redis_benchmark": yardstick,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(true)
}
