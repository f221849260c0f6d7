//! The index as a sibling router reads it: `GET /dump` streams it as NDJSON, or as msgpack when
//! asked (`Accept: application/msgpack` or `?format=msgpack`), and `--bootstrap-from URL` reads
//! it at start (asking for msgpack, reading either), so that a new or restarted replica recovers
//! without a broker and then catches up on each worker's stream from the sequence number after
//! the one the dump was taken at.
//!
//! Lines, in order (every number is exact: JSON integers up to u64):
//! `{"kind":"header","format":"kvbm-router-dump","version":1,"block_size":N}`, then per worker
//! `{"kind":"worker","worker_id","dp_rank","endpoint","replay_endpoint","last_seq","http_url"}` followed by
//! its engine hashes `{"kind":"name","engine","ours","namespace","refs"}` and holdings
//! `{"kind":"hold","tier":"GPU"|"CPU_PINNED"|"DISK","hash","count"}`, then, for a worker of a
//! hybrid model (vLLM's KV cache groups) or with pages smaller than a block (SGLang's page size
//! 1), its groups `{"kind":"group","group","spec","window"}` (`spec` as vLLM names the kind),
//! its sliding-window and Mamba groups' blocks `{"kind":"group_hold","group","hash","count",
//! "pending"}` and its pages `{"kind":"page","engine","parent","tokens","index","prev_block",
//! "block","namespace","refs"}` (workers without them write none, so their dumps read as
//! before), and a final `{"kind":"end","workers":N}`. A dump without its end line is incomplete
//! and refused.
//!
//! The msgpack form carries the same records, one msgpack value after another, compact: each is
//! a one-entry map from the record's name to its fields as an array (`Header`, `Worker`,
//! `Names`, `Holds`, `Groups`, `GroupHolds` and `Pages` with up to
//! [`MSGPACK_ENTRIES_PER_RECORD`] entries each, `Pages` also up to [`MSGPACK_PAGE_TOKENS`] tokens,
//! `End`); a holding
//! is `[tier, hash, count]` with the tier as 0 (GPU), 1 (host) or 2 (disk). Several times smaller
//! than the NDJSON (a random 64-bit hash takes 9 bytes instead of about 20 digits), and no number
//! printed or parsed.
//!
//! Invariants: a worker's part is consistent with its `last_seq` (taken under the lock the event
//! pump applies batches under); reading never trusts the input's sizes (lines are bounded, every
//! worker's holdings are bounded by the reader's `--max-blocks-per-worker`), and a dump of another
//! block size is refused.
//!
//! A sibling is not trusted either ([`DumpLimits`]): while the dump streams in, its bytes
//! (`--bootstrap-max-bytes`), workers (`--max-workers`), holdings and engine hashes over all
//! workers (`--bootstrap-max-blocks`) and the time taken (`--bootstrap-timeout-secs`) are
//! bounded, a repeated worker is found in constant time, and every worker must pass the checks
//! of a worker given to `POST /register` ([`crate::config::remote_worker`]), tcp:// only, unless
//! `--workers` gives it (it is then followed at the local endpoints). A worker failing the checks
//! is left out with its holdings and engine hashes, logged and counted
//! (`kv_router_bootstrap_workers_skipped_total`). The workers kept and the `--workers` entries
//! the dump does not name fit `--max-workers` together. A dump over any bound, or one that cannot
//! be fetched, is refused whole: with `--bootstrap-required` the router does not start ([`start`]);
//! without it, it starts without the dump, logs why and counts it in
//! `kv_router_bootstrap_refused_total{why}`.

use std::collections::HashSet;
use std::io::{BufRead, Read, Write};
use std::time::{Duration, Instant};

use kvbm_events::router::{
    GroupEntry, GroupHolding, Holding, NameEntry, PageEntry, WorkerSnapshot,
};
use kvbm_events::{GroupKind, Tier};
use serde::{Deserialize, Serialize};

/// The format's name and version.
pub const FORMAT: &str = "kvbm-router-dump";
/// The version written and read.
pub const VERSION: u32 = 1;
/// Longest line read.
pub const LINE_BYTES_MAX: usize = 64 << 10;

/// Engine hashes or holdings per msgpack record.
pub const MSGPACK_ENTRIES_PER_RECORD: usize = 4096;
/// Tokens of the pages of one msgpack `Pages` record at most.
pub const MSGPACK_PAGE_TOKENS: usize = 1 << 16;
/// Longest msgpack record read (a full `Names` record takes about 140 KiB).
pub const MSGPACK_RECORD_BYTES_MAX: usize = 1 << 20;
/// The media type of the msgpack form.
pub const MSGPACK_MEDIA_TYPE: &str = "application/msgpack";
/// The media type of the NDJSON form.
pub const NDJSON_MEDIA_TYPE: &str = "application/x-ndjson";

/// Bytes of a dump read at most by default (`--bootstrap-max-bytes`).
pub const BOOTSTRAP_MAX_BYTES_DEFAULT: u64 = 1 << 30;
/// Holdings, and engine hashes, of all workers of a dump read at most by default
/// (`--bootstrap-max-blocks`).
pub const BOOTSTRAP_MAX_BLOCKS_DEFAULT: usize = 1 << 24;
/// Seconds a bootstrap may take by default (`--bootstrap-timeout-secs`).
pub const BOOTSTRAP_TIMEOUT_SECS_DEFAULT: u64 = 120;

/// What a dump read from elsewhere may hold and take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpLimits {
    /// Holdings (and engine hashes) of one worker (`--max-blocks-per-worker`).
    pub holdings_per_worker: usize,
    /// Workers (`--max-workers`), counting those of [`DumpLimits::local`] whether the dump names
    /// them or not, so that each has room; as many more may be left out ([`Bootstrap::skipped`]).
    pub workers: usize,
    /// Holdings, and engine hashes, of all workers together (`--bootstrap-max-blocks`).
    pub blocks: usize,
    /// Bytes read (`--bootstrap-max-bytes`).
    pub bytes: u64,
    /// When reading gives up (`--bootstrap-timeout-secs` after the start).
    pub deadline: Option<Instant>,
    /// Whether each worker must pass the checks of `POST /register` (tcp:// endpoints only); one
    /// that fails is left out with its holdings and engine hashes.
    pub check_workers: bool,
    /// Workers given locally (`--workers`): followed at their local endpoints, so the dump's are
    /// not checked.
    pub local: HashSet<(u64, u32)>,
}

impl DumpLimits {
    /// Only a per-worker bound (what [`read`] and [`read_msgpack`] apply).
    pub fn per_worker(holdings_per_worker: usize) -> Self {
        Self {
            holdings_per_worker,
            workers: usize::MAX,
            blocks: usize::MAX,
            bytes: u64::MAX,
            deadline: None,
            check_workers: false,
            local: HashSet::new(),
        }
    }

    /// The limits a router of `config` following `local` reads a sibling's dump with, the
    /// deadline from now.
    pub fn from_config(
        config: &crate::config::RouterConfig,
        local: &[crate::config::WorkerSpec],
    ) -> Self {
        Self {
            holdings_per_worker: config.max_blocks_per_worker,
            workers: config.max_workers,
            blocks: config.bootstrap_max_blocks,
            bytes: config.bootstrap_max_bytes,
            deadline: Instant::now().checked_add(config.bootstrap_timeout),
            check_workers: true,
            local: local.iter().map(|w| w.key()).collect(),
        }
    }
}

/// Why a dump was refused: `why` is the metric's label (`bytes`, `workers`, `blocks`,
/// `worker`, `duplicate`, `timeout`, `fetch`, `malformed`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DumpError {
    /// The kind of refusal.
    pub why: &'static str,
    /// What happened.
    pub message: String,
}

impl DumpError {
    fn new(why: &'static str, message: impl Into<String>) -> Self {
        Self {
            why,
            message: message.into(),
        }
    }

    fn malformed(message: impl Into<String>) -> Self {
        Self::new("malformed", message)
    }

    /// From an error of reading `what`: a bound the reader tripped, or a failed read.
    fn io(what: &str, e: &std::io::Error) -> Self {
        match e.get_ref().and_then(|e| e.downcast_ref::<Tripped>()) {
            Some(t) => Self::new(t.why, format!("reading {what}: {t}")),
            None if e.kind() == std::io::ErrorKind::TimedOut => {
                Self::new("timeout", format!("reading {what}: {e}"))
            }
            None => Self::new("fetch", format!("reading {what}: {e}")),
        }
    }
}

/// A bound [`Bounded`] tripped.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct Tripped {
    why: &'static str,
    message: String,
}

/// A reader that fails once more than `max` bytes were read or past `deadline`.
struct Bounded<R> {
    inner: R,
    read: u64,
    max: u64,
    deadline: Option<Instant>,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(std::io::Error::other(Tripped {
                why: "timeout",
                message: "the dump took longer than --bootstrap-timeout-secs".into(),
            }));
        }
        // One byte past the bound is enough to know it is exceeded.
        let room = self.max.saturating_sub(self.read).saturating_add(1);
        let n = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..n])?;
        self.read += n as u64;
        if self.read > self.max {
            return Err(std::io::Error::other(Tripped {
                why: "bytes",
                message: format!(
                    "the dump is longer than {} bytes (--bootstrap-max-bytes)",
                    self.max
                ),
            }));
        }
        Ok(n)
    }
}

/// The running totals of a dump being read, checked against its limits as each record arrives.
struct Totals<'a> {
    limits: &'a DumpLimits,
    /// Every worker read.
    keys: HashSet<(u64, u32)>,
    /// Workers kept that are not given locally.
    remote: usize,
    /// Workers left out (failing the checks of `POST /register`).
    dropped: HashSet<(u64, u32)>,
    names: usize,
    holdings: usize,
}

impl<'a> Totals<'a> {
    fn new(limits: &'a DumpLimits) -> Self {
        Self {
            limits,
            keys: HashSet::new(),
            remote: 0,
            dropped: HashSet::new(),
            names: 0,
            holdings: 0,
        }
    }

    /// Checks a worker record and returns it as it is kept (its URL normalized).
    fn worker(
        &mut self,
        mut w: DumpWorker,
        at: impl Fn() -> String,
    ) -> Result<DumpWorker, DumpError> {
        let key = (w.worker_id, w.dp_rank);
        if self.keys.contains(&key) {
            return Err(DumpError::new(
                "duplicate",
                format!("{}: worker {}:{} appears twice", at(), key.0, key.1),
            ));
        }
        // Given locally: followed at the local endpoints, and its room is counted already.
        if self.limits.local.contains(&key) {
            self.keys.insert(key);
            return Ok(w);
        }
        if self.limits.check_workers {
            match crate::config::remote_worker(
                w.worker_id,
                w.dp_rank,
                &w.endpoint,
                w.replay_endpoint.as_deref(),
                w.http_url.as_deref(),
            ) {
                Ok(spec) => w.http_url = spec.http,
                Err(e) => {
                    if self.dropped.len() >= self.limits.workers {
                        return Err(DumpError::new(
                            "workers",
                            format!(
                                "{}: more than {} workers left out (--max-workers)",
                                at(),
                                self.limits.workers
                            ),
                        ));
                    }
                    tracing::warn!(worker = ?key, error = %e, "--bootstrap-from: a worker of the dump is left out with its holdings (POST /register would refuse it; give it in --workers to follow it at a local endpoint)");
                    self.keys.insert(key);
                    self.dropped.insert(key);
                    return Ok(w);
                }
            }
        }
        let room = self.limits.workers.saturating_sub(self.limits.local.len());
        if self.remote >= room {
            return Err(DumpError::new(
                "workers",
                format!(
                    "{}: more than {room} workers besides the {} of --workers (--max-workers={})",
                    at(),
                    self.limits.local.len(),
                    self.limits.workers
                ),
            ));
        }
        self.keys.insert(key);
        self.remote += 1;
        Ok(w)
    }

    /// The dump read, less the workers left out.
    fn finish(self, mut dump: Dump) -> Bootstrap {
        if !self.dropped.is_empty() {
            dump.workers
                .retain(|(w, _)| !self.dropped.contains(&(w.worker_id, w.dp_rank)));
        }
        Bootstrap {
            dump,
            skipped: self.dropped.len(),
        }
    }

    /// Counts `n` more engine hashes (`names`) or holdings of the current worker, which has
    /// `has` of them already.
    fn add(
        &mut self,
        names: bool,
        has: usize,
        n: usize,
        at: impl Fn() -> String,
    ) -> Result<(), DumpError> {
        let what = if names { "engine hashes" } else { "holdings" };
        if has.saturating_add(n) > self.limits.holdings_per_worker {
            return Err(DumpError::new(
                "blocks",
                format!(
                    "{}: more than {} {what} for one worker (--max-blocks-per-worker)",
                    at(),
                    self.limits.holdings_per_worker
                ),
            ));
        }
        let total = if names {
            &mut self.names
        } else {
            &mut self.holdings
        };
        *total = total.saturating_add(n);
        if *total > self.limits.blocks {
            return Err(DumpError::new(
                "blocks",
                format!(
                    "{}: more than {} {what} over all workers (--bootstrap-max-blocks)",
                    at(),
                    self.limits.blocks
                ),
            ));
        }
        Ok(())
    }
}

/// A worker as a dump records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpWorker {
    /// Worker id.
    pub worker_id: u64,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Its KV events endpoint.
    pub endpoint: String,
    /// Its replay endpoint.
    pub replay_endpoint: Option<String>,
    /// The last sequence number applied, if any.
    pub last_seq: Option<u64>,
    /// Its OpenAI-compatible HTTP server (absent from dumps of older routers).
    #[serde(default)]
    pub http_url: Option<String>,
}

/// A dump read from a sibling, and how many of its workers were left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bootstrap {
    /// The workers kept with their index state.
    pub dump: Dump,
    /// Workers left out with their holdings and engine hashes (failing the checks of
    /// `POST /register` without being given locally).
    pub skipped: usize,
}

/// The snapshot of the last worker read, for a line or record (`what`, numbered `number`) that
/// belongs to it; malformed before any worker.
fn last_worker<'a>(
    workers: &'a mut [(DumpWorker, WorkerSnapshot)],
    unit: &str,
    number: usize,
    what: &str,
) -> Result<&'a mut WorkerSnapshot, DumpError> {
    workers
        .last_mut()
        .map(|(_, snap)| snap)
        .ok_or_else(|| DumpError::malformed(format!("{unit} {number}: {what} before any worker")))
}

/// A whole dump.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dump {
    /// Tokens per block of the router that wrote it.
    pub block_size: usize,
    /// Every worker with its index state.
    pub workers: Vec<(DumpWorker, WorkerSnapshot)>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Line {
    Header {
        format: String,
        version: u32,
        block_size: usize,
    },
    Worker(DumpWorker),
    Name {
        engine: u64,
        ours: u64,
        namespace: u64,
        refs: u32,
    },
    Hold {
        tier: String,
        hash: u64,
        count: u32,
    },
    Group {
        group: u32,
        spec: String,
        window: Option<u32>,
    },
    #[serde(rename = "group_hold")]
    GroupHold {
        group: u32,
        hash: u64,
        count: u32,
        pending: bool,
    },
    Page {
        engine: u64,
        parent: Option<u64>,
        tokens: Vec<u32>,
        index: u32,
        prev_block: Option<u64>,
        block: Option<u64>,
        namespace: u64,
        refs: u32,
    },
    End {
        workers: usize,
    },
}

/// The page of a `page` line or a `Pages` record.
#[allow(clippy::type_complexity)]
type PageTuple = (
    u64,
    Option<u64>,
    Vec<u32>,
    u32,
    Option<u64>,
    Option<u64>,
    u64,
    u32,
);

fn page_tuple(p: &PageEntry) -> PageTuple {
    (
        p.engine,
        p.parent,
        p.tokens.clone(),
        p.index,
        p.prev_block,
        p.block,
        p.namespace,
        p.refs,
    )
}

fn page_entry(t: PageTuple) -> PageEntry {
    let (engine, parent, tokens, index, prev_block, block, namespace, refs) = t;
    PageEntry {
        engine,
        parent,
        tokens,
        index,
        prev_block,
        block,
        namespace,
        refs,
    }
}

/// A group's kind by vLLM's name; a name this router does not know is `unknown` (not modelled).
fn group_entry(group: u32, spec: &str, window: Option<u32>) -> GroupEntry {
    GroupEntry {
        group,
        kind: GroupKind::from_name(spec),
        window,
    }
}

fn line(out: &mut impl Write, l: &Line) -> std::io::Result<()> {
    serde_json::to_writer(&mut *out, l)?;
    out.write_all(b"\n")
}

/// Writes `dump` as NDJSON.
pub fn write(dump: &Dump, out: &mut impl Write) -> std::io::Result<()> {
    line(
        out,
        &Line::Header {
            format: FORMAT.into(),
            version: VERSION,
            block_size: dump.block_size,
        },
    )?;
    for (w, snap) in &dump.workers {
        line(out, &Line::Worker(w.clone()))?;
        for n in &snap.names {
            line(
                out,
                &Line::Name {
                    engine: n.engine,
                    ours: n.ours,
                    namespace: n.namespace,
                    refs: n.refs,
                },
            )?;
        }
        for h in &snap.holdings {
            line(
                out,
                &Line::Hold {
                    tier: h.tier.medium_name().into(),
                    hash: h.hash,
                    count: h.count,
                },
            )?;
        }
        for g in &snap.groups {
            line(
                out,
                &Line::Group {
                    group: g.group,
                    spec: g.kind.name().into(),
                    window: g.window,
                },
            )?;
        }
        for h in &snap.group_holdings {
            line(
                out,
                &Line::GroupHold {
                    group: h.group,
                    hash: h.hash,
                    count: h.count,
                    pending: h.pending,
                },
            )?;
        }
        for p in &snap.pages {
            let (engine, parent, tokens, index, prev_block, block, namespace, refs) = page_tuple(p);
            line(
                out,
                &Line::Page {
                    engine,
                    parent,
                    tokens,
                    index,
                    prev_block,
                    block,
                    namespace,
                    refs,
                },
            )?;
        }
    }
    line(
        out,
        &Line::End {
            workers: dump.workers.len(),
        },
    )
}

/// Reads a dump written by [`write`] for a router of `block_size`, allowing each worker at most
/// `holdings_max` holdings and as many engine hashes.
pub fn read(input: impl BufRead, block_size: usize, holdings_max: usize) -> Result<Dump, String> {
    read_with(input, block_size, &DumpLimits::per_worker(holdings_max))
        .map(|b| b.dump)
        .map_err(|e| e.message)
}

/// Reads a dump written by [`write`] for a router of `block_size` within `limits`, each checked
/// as the dump streams in.
pub fn read_with(
    input: impl Read,
    block_size: usize,
    limits: &DumpLimits,
) -> Result<Bootstrap, DumpError> {
    let mut dump = Dump::default();
    let mut totals = Totals::new(limits);
    let mut header = false;
    let mut ended = false;
    let mut buf = Vec::new();
    let mut input = std::io::BufReader::new(Bounded {
        inner: input,
        read: 0,
        max: limits.bytes,
        deadline: limits.deadline,
    });
    for number in 1.. {
        buf.clear();
        // Bounded read of one line.
        let n = Read::take(&mut input, LINE_BYTES_MAX as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| DumpError::io(&format!("line {number}"), &e))?;
        if n == 0 {
            break;
        }
        if buf.len() > LINE_BYTES_MAX {
            return Err(DumpError::malformed(format!(
                "line {number} is longer than {LINE_BYTES_MAX} bytes"
            )));
        }
        if ended {
            return Err(DumpError::malformed(format!(
                "line {number} follows the end line"
            )));
        }
        let l: Line = serde_json::from_slice(&buf)
            .map_err(|e| DumpError::malformed(format!("line {number}: {e}")))?;
        let at = || format!("line {number}");
        match l {
            Line::Header {
                format,
                version,
                block_size: bs,
            } => {
                if header || format != FORMAT || version != VERSION {
                    return Err(DumpError::malformed(format!(
                        "line {number}: not a {FORMAT} version {VERSION} header"
                    )));
                }
                if bs != block_size {
                    return Err(DumpError::malformed(format!(
                        "the dump is of blocks of {bs} tokens; this router's are {block_size}"
                    )));
                }
                dump.block_size = bs;
                header = true;
            }
            _ if !header => {
                return Err(DumpError::malformed(
                    "the dump does not start with its header",
                ))
            }
            Line::Worker(w) => {
                let w = totals.worker(w, at)?;
                let key = (w.worker_id, w.dp_rank);
                dump.workers.push((
                    w,
                    WorkerSnapshot {
                        worker: key,
                        ..Default::default()
                    },
                ));
            }
            Line::Name {
                engine,
                ours,
                namespace,
                refs,
            } => {
                let snap = last_worker(&mut dump.workers, "line", number, "a name")?;
                totals.add(true, snap.names.len(), 1, at)?;
                snap.names.push(NameEntry {
                    engine,
                    ours,
                    namespace,
                    refs,
                });
            }
            Line::Hold { tier, hash, count } => {
                let snap = last_worker(&mut dump.workers, "line", number, "a holding")?;
                totals.add(false, snap.holdings.len(), 1, at)?;
                let tier = Tier::from_medium_name(&tier).map_err(|_| {
                    DumpError::malformed(format!("line {number}: unknown tier {tier:?}"))
                })?;
                snap.holdings.push(Holding { tier, hash, count });
            }
            Line::Group {
                group,
                spec,
                window,
            } => {
                let snap = last_worker(&mut dump.workers, "line", number, "a group")?;
                totals.add(false, snap.groups.len(), 1, at)?;
                snap.groups.push(group_entry(group, &spec, window));
            }
            Line::GroupHold {
                group,
                hash,
                count,
                pending,
            } => {
                let snap = last_worker(&mut dump.workers, "line", number, "a group's block")?;
                totals.add(false, snap.group_holdings.len(), 1, at)?;
                snap.group_holdings.push(GroupHolding {
                    group,
                    hash,
                    count,
                    pending,
                });
            }
            Line::Page {
                engine,
                parent,
                tokens,
                index,
                prev_block,
                block,
                namespace,
                refs,
            } => {
                let snap = last_worker(&mut dump.workers, "line", number, "a page")?;
                totals.add(false, snap.pages.len(), 1, at)?;
                snap.pages.push(page_entry((
                    engine, parent, tokens, index, prev_block, block, namespace, refs,
                )));
            }
            Line::End { workers } => {
                if workers != totals.keys.len() {
                    return Err(DumpError::malformed(format!(
                        "the end line counts {workers} workers; the dump has {}",
                        totals.keys.len()
                    )));
                }
                ended = true;
            }
        }
    }
    if !ended {
        return Err(DumpError::malformed(
            "the dump ends without its end line (incomplete)",
        ));
    }
    Ok(totals.finish(dump))
}

/// A record of the msgpack form.
#[derive(Debug, Serialize, Deserialize)]
enum Record {
    Header {
        format: String,
        version: u32,
        block_size: usize,
    },
    Worker(DumpWorker),
    /// `(engine, ours, namespace, refs)`.
    Names(Vec<(u64, u64, u64, u32)>),
    /// `(tier, hash, count)`.
    Holds(Vec<(u8, u64, u32)>),
    /// `(group, kind, window)`.
    Groups(Vec<(u32, String, Option<u32>)>),
    /// `(group, hash, count, pending)`.
    GroupHolds(Vec<(u32, u64, u32, bool)>),
    /// `(engine, parent, tokens, index, prev_block, block, namespace, refs)`.
    Pages(Vec<PageTuple>),
    End {
        workers: usize,
    },
}

fn record(out: &mut impl Write, r: &Record) -> std::io::Result<()> {
    rmp_serde::encode::write(out, r).map_err(std::io::Error::other)
}

/// Writes `dump` in the msgpack form.
pub fn write_msgpack(dump: &Dump, out: &mut impl Write) -> std::io::Result<()> {
    record(
        out,
        &Record::Header {
            format: FORMAT.into(),
            version: VERSION,
            block_size: dump.block_size,
        },
    )?;
    for (w, snap) in &dump.workers {
        record(out, &Record::Worker(w.clone()))?;
        for chunk in snap.names.chunks(MSGPACK_ENTRIES_PER_RECORD) {
            let names = chunk
                .iter()
                .map(|n| (n.engine, n.ours, n.namespace, n.refs))
                .collect();
            record(out, &Record::Names(names))?;
        }
        for chunk in snap.holdings.chunks(MSGPACK_ENTRIES_PER_RECORD) {
            let holds = chunk
                .iter()
                .map(|h| (h.tier.index() as u8, h.hash, h.count))
                .collect();
            record(out, &Record::Holds(holds))?;
        }
        for chunk in snap.groups.chunks(MSGPACK_ENTRIES_PER_RECORD) {
            let groups = chunk
                .iter()
                .map(|g| (g.group, g.kind.name().to_owned(), g.window))
                .collect();
            record(out, &Record::Groups(groups))?;
        }
        for chunk in snap.group_holdings.chunks(MSGPACK_ENTRIES_PER_RECORD) {
            let holds = chunk
                .iter()
                .map(|h| (h.group, h.hash, h.count, h.pending))
                .collect();
            record(out, &Record::GroupHolds(holds))?;
        }
        let mut pages = Vec::new();
        let mut tokens = 0;
        for p in &snap.pages {
            if pages.len() == MSGPACK_ENTRIES_PER_RECORD
                || (!pages.is_empty() && tokens + p.tokens.len() > MSGPACK_PAGE_TOKENS)
            {
                record(out, &Record::Pages(std::mem::take(&mut pages)))?;
                tokens = 0;
            }
            tokens += p.tokens.len();
            pages.push(page_tuple(p));
        }
        if !pages.is_empty() {
            record(out, &Record::Pages(pages))?;
        }
    }
    record(
        out,
        &Record::End {
            workers: dump.workers.len(),
        },
    )
}

/// Reads the msgpack form written by [`write_msgpack`], with the limits of [`read`].
pub fn read_msgpack(
    input: impl Read,
    block_size: usize,
    holdings_max: usize,
) -> Result<Dump, String> {
    read_msgpack_with(input, block_size, &DumpLimits::per_worker(holdings_max))
        .map(|b| b.dump)
        .map_err(|e| e.message)
}

/// Reads the msgpack form written by [`write_msgpack`] within `limits`, as [`read_with`].
/// Records are decoded from a bounded buffer, so a length the input claims never sizes an
/// allocation beyond the bytes there.
pub fn read_msgpack_with(
    input: impl Read,
    block_size: usize,
    limits: &DumpLimits,
) -> Result<Bootstrap, DumpError> {
    let mut input = Bounded {
        inner: input,
        read: 0,
        max: limits.bytes,
        deadline: limits.deadline,
    };
    let mut dump = Dump::default();
    let mut totals = Totals::new(limits);
    let mut header = false;
    let mut ended = false;
    let mut buf: Vec<u8> = Vec::new();
    let mut start = 0;
    let mut eof = false;
    for number in 1.. {
        // Decode the next record from what is buffered; read more while it is incomplete.
        let r = loop {
            if start == buf.len() && eof {
                break None;
            }
            let mut rest = &buf[start..];
            // Reading from the buffered bytes: a string or array claiming more than is there
            // fails at the end of them.
            match Record::deserialize(&mut rmp_serde::Deserializer::new(&mut rest)) {
                Ok(r) => {
                    start = buf.len() - rest.len();
                    break Some(r);
                }
                Err(e) if eof => {
                    return Err(DumpError::malformed(format!(
                        "record {number}: {e} (cut or malformed)"
                    )));
                }
                Err(e) if buf.len() - start > MSGPACK_RECORD_BYTES_MAX => {
                    return Err(DumpError::malformed(format!(
                        "record {number} is malformed or longer than {MSGPACK_RECORD_BYTES_MAX} \
                         bytes: {e}"
                    )));
                }
                Err(_) => {
                    buf.drain(..start);
                    start = 0;
                    let had = buf.len();
                    buf.resize(had + (64 << 10), 0);
                    let n = loop {
                        match input.read(&mut buf[had..]) {
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            other => break other,
                        }
                    }
                    .map_err(|e| DumpError::io(&format!("record {number}"), &e))?;
                    buf.truncate(had + n);
                    eof = n == 0;
                }
            }
        };
        let Some(r) = r else { break };
        if ended {
            return Err(DumpError::malformed(format!(
                "record {number} follows the end record"
            )));
        }
        let at = || format!("record {number}");
        match r {
            Record::Header {
                format,
                version,
                block_size: bs,
            } => {
                if header || format != FORMAT || version != VERSION {
                    return Err(DumpError::malformed(format!(
                        "record {number}: not a {FORMAT} version {VERSION} header"
                    )));
                }
                if bs != block_size {
                    return Err(DumpError::malformed(format!(
                        "the dump is of blocks of {bs} tokens; this router's are {block_size}"
                    )));
                }
                dump.block_size = bs;
                header = true;
            }
            _ if !header => {
                return Err(DumpError::malformed(
                    "the dump does not start with its header",
                ))
            }
            Record::Worker(w) => {
                let w = totals.worker(w, at)?;
                let key = (w.worker_id, w.dp_rank);
                dump.workers.push((
                    w,
                    WorkerSnapshot {
                        worker: key,
                        ..Default::default()
                    },
                ));
            }
            Record::Names(names) => {
                let snap = last_worker(&mut dump.workers, "record", number, "names")?;
                totals.add(true, snap.names.len(), names.len(), at)?;
                snap.names
                    .extend(
                        names
                            .into_iter()
                            .map(|(engine, ours, namespace, refs)| NameEntry {
                                engine,
                                ours,
                                namespace,
                                refs,
                            }),
                    );
            }
            Record::Holds(holds) => {
                let snap = last_worker(&mut dump.workers, "record", number, "holdings")?;
                totals.add(false, snap.holdings.len(), holds.len(), at)?;
                for (tier, hash, count) in holds {
                    let tier = *Tier::ALL.get(usize::from(tier)).ok_or_else(|| {
                        DumpError::malformed(format!("record {number}: unknown tier {tier}"))
                    })?;
                    snap.holdings.push(Holding { tier, hash, count });
                }
            }
            Record::Groups(groups) => {
                let snap = last_worker(&mut dump.workers, "record", number, "groups")?;
                totals.add(false, snap.groups.len(), groups.len(), at)?;
                snap.groups.extend(
                    groups
                        .into_iter()
                        .map(|(group, spec, window)| group_entry(group, &spec, window)),
                );
            }
            Record::GroupHolds(holds) => {
                let snap = last_worker(&mut dump.workers, "record", number, "groups' blocks")?;
                totals.add(false, snap.group_holdings.len(), holds.len(), at)?;
                snap.group_holdings.extend(holds.into_iter().map(
                    |(group, hash, count, pending)| GroupHolding {
                        group,
                        hash,
                        count,
                        pending,
                    },
                ));
            }
            Record::Pages(pages) => {
                let snap = last_worker(&mut dump.workers, "record", number, "pages")?;
                totals.add(false, snap.pages.len(), pages.len(), at)?;
                snap.pages.extend(pages.into_iter().map(page_entry));
            }
            Record::End { workers } => {
                if workers != totals.keys.len() {
                    return Err(DumpError::malformed(format!(
                        "the end record counts {workers} workers; the dump has {}",
                        totals.keys.len()
                    )));
                }
                ended = true;
            }
        }
    }
    if !ended {
        return Err(DumpError::malformed(
            "the dump ends without its end record (incomplete)",
        ));
    }
    Ok(totals.finish(dump))
}

/// Whether a failed request ended in a timeout: ureq reports one as an I/O error of kind
/// `TimedOut` (or `WouldBlock`, which some platforms give for a socket's read timeout).
fn timed_out(e: &ureq::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ) {
                return true;
            }
        }
        source = s.source();
    }
    false
}

/// Fetches `url`'s dump (`URL/dump`), for a router of `block_size`, within `limits`: asks for
/// msgpack and reads whichever form the sibling sends.
pub fn fetch(url: &str, block_size: usize, limits: &DumpLimits) -> Result<Bootstrap, DumpError> {
    let url = format!("{}/dump", url.trim_end_matches('/'));
    let mut request = ureq::get(&url).set("Accept", MSGPACK_MEDIA_TYPE);
    if let Some(deadline) = limits.deadline {
        // ureq's timeout covers the whole exchange, body included.
        let left = deadline.saturating_duration_since(Instant::now());
        request = request.timeout(left.max(Duration::from_millis(1)));
    }
    let response = request.call().map_err(|e| {
        let late = limits.deadline.is_some_and(|d| Instant::now() >= d);
        if timed_out(&e) || late {
            DumpError::new(
                "timeout",
                format!("GET {url}: {e} (--bootstrap-timeout-secs)"),
            )
        } else {
            DumpError::new("fetch", format!("GET {url}: {e}"))
        }
    })?;
    let msgpack = response.content_type() == MSGPACK_MEDIA_TYPE;
    let body = response.into_reader();
    if msgpack {
        read_msgpack_with(body, block_size, limits)
    } else {
        read_with(body, block_size, limits)
    }
    .map_err(|e| DumpError::new(e.why, format!("{url}: {}", e.message)))
}

/// Why [`start`] failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The dump failed or was refused and `--bootstrap-required` was given.
    #[error("--bootstrap-from {url}: {error} (--bootstrap-required: not starting without it)")]
    Bootstrap {
        /// The sibling.
        url: String,
        /// Why its dump was not read.
        error: DumpError,
    },
    /// Following the workers failed.
    #[error(transparent)]
    Transport(#[from] kvbm_events::TransportError),
}

/// Starts a router of `config` following `workers`, first restoring the dump of the sibling at
/// `bootstrap` if one is given. A dump that cannot be fetched or is refused stops the start with
/// `--bootstrap-required`; without it the router starts without the dump, logs why, and counts
/// it in `kv_router_bootstrap_refused_total{why}`. Workers of the dump left out are counted in
/// `kv_router_bootstrap_workers_skipped_total`.
pub fn start(
    config: crate::config::RouterConfig,
    workers: Vec<crate::config::WorkerSpec>,
    bootstrap: Option<&str>,
) -> Result<crate::state::Router, StartError> {
    let mut refused = None;
    let mut read = 0;
    let mut skipped = 0;
    let dump = match bootstrap {
        None => None,
        Some(url) => {
            let limits = DumpLimits::from_config(&config, &workers);
            let started = Instant::now();
            match fetch(url, config.block_size, &limits) {
                Ok(b) => {
                    let blocks: usize = b.dump.workers.iter().map(|(_, s)| s.holdings.len()).sum();
                    read = blocks;
                    skipped = b.skipped;
                    tracing::info!(%url, workers = b.dump.workers.len(), skipped, blocks, secs = started.elapsed().as_secs_f64(), "bootstrapped from a sibling");
                    Some(b.dump)
                }
                Err(error) if config.bootstrap_required => {
                    return Err(StartError::Bootstrap {
                        url: url.to_owned(),
                        error,
                    });
                }
                Err(e) => {
                    tracing::error!(%url, why = e.why, error = %e, "--bootstrap-from: the sibling's dump is refused; starting without it (workers follow from --workers, --workers-file and /register; --bootstrap-required stops instead)");
                    refused = Some(e.why);
                    None
                }
            }
        }
    };
    let router = crate::state::Router::start_from(config, workers, dump)?;
    let metrics = router.metrics();
    if let Some(why) = refused {
        metrics.bootstrap_refused.with_label_values(&[why]).inc();
    }
    metrics.bootstrap_workers_skipped.inc_by(skipped as u64);
    metrics.bootstrap_blocks.set(read as i64);
    Ok(router)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Dump {
        Dump {
            block_size: 16,
            workers: vec![(
                DumpWorker {
                    worker_id: 7,
                    dp_rank: 1,
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    replay_endpoint: Some("tcp://127.0.0.1:5558".into()),
                    last_seq: Some(u64::MAX - 1),
                    http_url: Some("http://127.0.0.1:8001".into()),
                },
                WorkerSnapshot {
                    worker: (7, 1),
                    names: vec![NameEntry {
                        engine: u64::MAX,
                        ours: 3,
                        namespace: 0,
                        refs: 2,
                    }],
                    holdings: vec![
                        Holding {
                            tier: Tier::Gpu,
                            hash: 3,
                            count: 1,
                        },
                        Holding {
                            tier: Tier::Disk,
                            hash: 3,
                            count: 1,
                        },
                    ],
                    groups: vec![
                        GroupEntry {
                            group: 0,
                            kind: GroupKind::SlidingWindow,
                            window: Some(128),
                        },
                        GroupEntry {
                            group: 1,
                            kind: GroupKind::FullAttention,
                            window: None,
                        },
                    ],
                    group_holdings: vec![
                        GroupHolding {
                            group: 0,
                            hash: 3,
                            count: 2,
                            pending: false,
                        },
                        GroupHolding {
                            group: 0,
                            hash: u64::MAX,
                            count: 1,
                            pending: true,
                        },
                    ],
                    pages: vec![
                        PageEntry {
                            engine: 9,
                            parent: None,
                            tokens: vec![1],
                            index: 1,
                            prev_block: None,
                            block: None,
                            namespace: 0,
                            refs: 1,
                        },
                        PageEntry {
                            engine: 10,
                            parent: Some(9),
                            tokens: vec![2],
                            index: 2,
                            prev_block: Some(4),
                            block: Some(u64::MAX),
                            namespace: 5,
                            refs: 3,
                        },
                    ],
                },
            )],
        }
    }

    /// A dump with more entries than one msgpack record takes.
    fn big() -> Dump {
        let mut d = sample();
        let snap = &mut d.workers[0].1;
        for i in 0..(MSGPACK_ENTRIES_PER_RECORD as u64 * 2 + 5) {
            snap.names.push(NameEntry {
                engine: i,
                ours: i.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                namespace: i % 3,
                refs: 1 + (i % 4) as u32,
            });
            snap.holdings.push(Holding {
                tier: Tier::ALL[(i % 3) as usize],
                hash: i.wrapping_mul(31),
                count: 1,
            });
            snap.group_holdings.push(GroupHolding {
                group: (i % 2) as u32,
                hash: i,
                count: 1,
                pending: i % 5 == 0,
            });
            // Pages of 40 tokens: a Pages record is cut at its token bound before its entries'.
            snap.pages.push(PageEntry {
                engine: i,
                parent: i.checked_sub(1),
                tokens: (0..40).map(|t| t + i as u32).collect(),
                index: 1 + (i % 4) as u32,
                prev_block: None,
                block: (i % 4 == 3).then_some(i),
                namespace: 0,
                refs: 1,
            });
        }
        d
    }

    #[test]
    fn msgpack_dumps_round_trip_and_bad_ones_are_refused() {
        for dump in [
            sample(),
            big(),
            Dump {
                block_size: 16,
                workers: vec![],
            },
        ] {
            let mut bytes = Vec::new();
            write_msgpack(&dump, &mut bytes).unwrap();
            assert_eq!(read_msgpack(&bytes[..], 16, 1 << 20).unwrap(), dump);
            // Read a byte at a time: records cut across reads decode all the same.
            struct Dribble<'a>(&'a [u8]);
            impl std::io::Read for Dribble<'_> {
                fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
                    let n = self.0.len().min(out.len()).min(1);
                    out[..n].copy_from_slice(&self.0[..n]);
                    self.0 = &self.0[n..];
                    Ok(n)
                }
            }
            if dump.workers.len() == 1 && dump.workers[0].1.names.len() < 10 {
                assert_eq!(read_msgpack(Dribble(&bytes), 16, 1 << 20).unwrap(), dump);
            }
        }
        let mut bytes = Vec::new();
        write_msgpack(&big(), &mut bytes).unwrap();
        let mut ndjson = Vec::new();
        write(&big(), &mut ndjson).unwrap();
        assert!(
            bytes.len() * 2 < ndjson.len(),
            "{} vs {}",
            bytes.len(),
            ndjson.len()
        );
        // Another block size, every cut, limits, an unknown tier, garbage, a huge claimed length.
        assert!(read_msgpack(&bytes[..], 32, 1 << 20)
            .unwrap_err()
            .contains("16 tokens"));
        for cut in [1, 7, bytes.len() / 2, bytes.len() - 1] {
            assert!(
                read_msgpack(&bytes[..cut], 16, 1 << 20).is_err(),
                "cut at {cut}"
            );
        }
        assert!(read_msgpack(&bytes[..], 16, 100)
            .unwrap_err()
            .contains("more than 100"));
        let mut bad_tier = Vec::new();
        let mut d = sample();
        d.workers[0].1.holdings.clear();
        write_msgpack(&d, &mut bad_tier).unwrap();
        let end = bad_tier.len();
        let mut tail = Vec::new();
        record(&mut tail, &Record::Holds(vec![(7, 1, 1)])).unwrap();
        record(&mut tail, &Record::End { workers: 1 }).unwrap();
        let mut without_end = Vec::new();
        record(&mut without_end, &Record::End { workers: 1 }).unwrap();
        bad_tier.truncate(end - without_end.len());
        bad_tier.extend_from_slice(&tail);
        assert!(read_msgpack(&bad_tier[..], 16, 100)
            .unwrap_err()
            .contains("unknown tier 7"));
        assert!(read_msgpack(&b"\xc1\xc1\xc1"[..], 16, 10).is_err());
        // A map claiming a 4 GiB string for the record name: refused, nothing that size made.
        let mut claim = vec![0x81, 0xdb, 0xff, 0xff, 0xff, 0xff];
        claim.extend(std::iter::repeat_n(b'x', MSGPACK_RECORD_BYTES_MAX + 100));
        assert!(read_msgpack(&claim[..], 16, 10).is_err());
        // The NDJSON form is not the msgpack one.
        assert!(read_msgpack(&ndjson[..], 16, 1 << 20).is_err());
    }

    #[test]
    fn dumps_round_trip_and_bad_ones_are_refused() {
        let mut bytes = Vec::new();
        write(&sample(), &mut bytes).unwrap();
        assert_eq!(read(&bytes[..], 16, 100).unwrap(), sample());
        // Another block size, a cut dump, a dump over the limits, garbage.
        assert!(read(&bytes[..], 32, 100).unwrap_err().contains("16 tokens"));
        let cut = &bytes[..bytes.len() - 20];
        assert!(read(cut, 16, 100).is_err());
        assert!(read(&bytes[..], 16, 1).unwrap_err().contains("more than 1"));
        assert!(read(&b"{\"kind\":\"end\",\"workers\":0}\n"[..], 16, 10).is_err());
        let long = vec![b'x'; LINE_BYTES_MAX + 10];
        assert!(read(&long[..], 16, 10).unwrap_err().contains("longer"));
    }
}
