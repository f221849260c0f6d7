//! The shared tier's client: a Redis / Valkey store (standalone or Cluster) reached through the
//! `redis` crate on a small tokio runtime of this store's own, with a blocking, time-bounded API
//! for the engine's threads.
//!
//! Invariants:
//! - No call waits past its bound: a prefix lookup past `lookup_timeout` is a miss, a read past
//!   `read_timeout` is a miss, and writes are never waited for (a batch past `writes_in_flight`
//!   is dropped and counted). A slow or dead server makes the tier a miss; it never stalls a step.
//! - An outage (refused or dropped connection, I/O error, a read or write batch past its bound)
//!   takes the tier out for a backoff that doubles from [`BACKOFF_MIN`] to [`BACKOFF_MAX`];
//!   meanwhile lookups and reads are misses and writes are dropped, all counted, and the first
//!   call after the backoff tries again. A late lookup is a miss but not an outage: lookups have
//!   a connection of their own and a short bound, and a server busy with writes is not dead. A
//!   reply the server refuses (`OOM` under `maxmemory` with `noeviction`, ...) is counted and
//!   is not an outage. `MOVED` and `ASK` during a Cluster's resharding are followed by the
//!   client.
//! - Every value read is checked by [`super::decode_value`]; a bad one is a miss, counted by
//!   reason.
//! - Calls from inside another tokio runtime are safe: the caller's thread only waits on a
//!   channel, never enters this store's runtime; dropping the store shuts its runtime down in
//!   the background.

use std::future::Future;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use kvbm_events::SequenceHash;
use parking_lot::Mutex;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{
    Cmd, FromRedisValue, IntoConnectionInfo, RedisError, RedisResult, RedisWrite, ToRedisArgs,
};
use tokio::sync::Semaphore;

use super::{
    block_key, decode_value, redact_url, value_parts, BadValue, SharedOptions, ValueFor,
    VALUE_HEADER_BYTES,
};
use crate::pool::BlockIdentity;
use crate::CoreError;

/// First backoff after an outage.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest backoff.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Extra time the caller's thread waits for an answer past the call's own bound.
const WAIT_SLACK: Duration = Duration::from_millis(100);

/// What the shared tier did, since its start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedCounts {
    /// Prefix lookups asked.
    pub lookups: u64,
    /// Blocks those lookups found.
    pub lookup_hits: u64,
    /// Lookups answered as misses because the server was out (in backoff).
    pub lookups_skipped: u64,
    /// Blocks asked for by reads.
    pub reads: u64,
    /// Blocks read and taken (checked).
    pub read_hits: u64,
    /// Blocks asked for that the server did not have.
    pub read_missing: u64,
    /// Blocks not asked for: the server was out (in backoff).
    pub reads_skipped: u64,
    /// Blocks whose read the server refused (an error reply: `LOADING`, `NOAUTH`, ...).
    pub read_refused: u64,
    /// Values refused by reason ([`BadValue::ALL`]'s order).
    pub bad_values: [u64; 6],
    /// Blocks written (acknowledged by the server).
    pub writes: u64,
    /// Bytes of the values written.
    pub write_bytes: u64,
    /// Blocks not written: the server was out.
    pub writes_dropped_down: u64,
    /// Blocks not written: `writes_in_flight` batches were already in flight.
    pub writes_dropped_busy: u64,
    /// Blocks whose write the server refused (e.g. `OOM`), or that were not one block of the
    /// store's layout (the rest of that call was refused with them).
    pub writes_refused: u64,
    /// Calls that timed out.
    pub timeouts: u64,
    /// Outages (the tier went out).
    pub outages: u64,
    /// Recoveries (the tier came back).
    pub recoveries: u64,
    /// The tier is usable now (not in an outage).
    pub up: bool,
}

#[derive(Default)]
struct Counters {
    lookups: AtomicU64,
    lookup_hits: AtomicU64,
    lookups_skipped: AtomicU64,
    reads: AtomicU64,
    read_hits: AtomicU64,
    read_missing: AtomicU64,
    reads_skipped: AtomicU64,
    read_refused: AtomicU64,
    bad_values: [AtomicU64; 6],
    writes: AtomicU64,
    write_bytes: AtomicU64,
    writes_dropped_down: AtomicU64,
    writes_dropped_busy: AtomicU64,
    writes_refused: AtomicU64,
    timeouts: AtomicU64,
    outages: AtomicU64,
    recoveries: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Whether the tier is usable, and when to try again after an outage.
struct Health {
    state: Mutex<(u32, Option<Instant>)>,
    up: AtomicBool,
    /// Lookups late in a row: at [`LATE_LOOKUPS_MAX`] the tier backs off as for an outage.
    late_lookups: AtomicU32,
}

/// Lookups late in a row that take the tier out for a backoff: one late answer is a busy server
/// (a miss), several in a row would add a lookup's timeout to every request.
pub const LATE_LOOKUPS_MAX: u32 = 3;

impl Health {
    fn usable(&self) -> bool {
        self.state.lock().1.is_none_or(|at| Instant::now() >= at)
    }

    fn failed(&self, counters: &Counters) {
        let mut s = self.state.lock();
        s.0 = s.0.saturating_add(1);
        let backoff = BACKOFF_MIN
            .saturating_mul(1u32 << (s.0 - 1).min(16))
            .min(BACKOFF_MAX);
        s.1 = Some(Instant::now() + backoff);
        if self.up.swap(false, Ordering::Relaxed) {
            add(&counters.outages, 1);
        }
    }

    fn succeeded(&self, counters: &Counters) {
        let mut s = self.state.lock();
        *s = (0, None);
        if !self.up.swap(true, Ordering::Relaxed) {
            add(&counters.recoveries, 1);
        }
    }
}

/// An error that says the server cannot be reached (rather than a refused command).
fn is_outage(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_unrecoverable_error()
}

#[derive(Clone)]
enum Handle {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Handle {
    async fn query<T: FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Handle::Single(c) => cmd.query_async(c).await,
            Handle::Cluster(c) => cmd.query_async(c).await,
        }
    }

    /// Every command's answer, in order, in one round trip: one pipeline to a standalone
    /// server (one write, one read, each command's error kept apart); on a cluster, every
    /// command at once on the multiplexed connection (a pipeline must stay within one node's
    /// slots, and a prefix's keys spread over every node).
    async fn query_all<T: FromRedisValue>(&self, cmds: Vec<Cmd>) -> Vec<RedisResult<T>> {
        let n = cmds.len();
        match self {
            Handle::Single(c) => {
                let mut pipe = redis::pipe();
                for cmd in cmds {
                    pipe.add_command(cmd);
                }
                pipe.ignore_errors();
                let mut c = c.clone();
                match pipe.query_async::<Vec<RedisResult<T>>>(&mut c).await {
                    Ok(all) if all.len() == n => all,
                    Ok(all) => {
                        let e = RedisError::from(std::io::Error::other(format!(
                            "{} answers to {n} commands",
                            all.len()
                        )));
                        (0..n).map(|_| Err(e.clone())).collect()
                    }
                    Err(e) => (0..n).map(|_| Err(e.clone())).collect(),
                }
            }
            Handle::Cluster(_) => {
                join_all(cmds.into_iter().map(|cmd| {
                    let mut h = self.clone();
                    async move { h.query::<T>(&cmd).await }
                }))
                .await
            }
        }
    }
}

/// The connection: a standalone server's reconnecting multiplexed connection, or a Cluster
/// connection, made by a task of its own (so that no call's bound cancels it halfway) on first
/// use and again after an attempt failed.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster {
        client: Arc<ClusterClient>,
        conn: Arc<Mutex<Option<ClusterConnection>>>,
        connecting: Arc<AtomicBool>,
        connect_timeout: Duration,
    },
}

impl Conn {
    async fn handle(&self) -> RedisResult<Handle> {
        match self {
            Conn::Single(c) => Ok(Handle::Single(c.clone())),
            Conn::Cluster {
                client,
                conn,
                connecting,
                connect_timeout,
            } => {
                if let Some(c) = conn.lock().as_ref() {
                    return Ok(Handle::Cluster(c.clone()));
                }
                if !connecting.swap(true, Ordering::AcqRel) {
                    let (client, slot, flag) = (client.clone(), conn.clone(), connecting.clone());
                    let limit = *connect_timeout;
                    tokio::spawn(async move {
                        let made = tokio::time::timeout(limit, client.get_async_connection()).await;
                        match made {
                            Ok(Ok(c)) => *slot.lock() = Some(c),
                            Ok(Err(e)) => {
                                tracing::warn!(error = %e, "shared tier: cannot connect to the cluster")
                            }
                            Err(_) => {
                                tracing::warn!("shared tier: connecting to the cluster timed out")
                            }
                        }
                        flag.store(false, Ordering::Release);
                    });
                }
                // Wait briefly for a connection being made; otherwise this call is a miss.
                for _ in 0..10 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if let Some(c) = conn.lock().as_ref() {
                        return Ok(Handle::Cluster(c.clone()));
                    }
                }
                Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::NotConnected,
                    "not connected to the cluster yet",
                )))
            }
        }
    }
}

/// One block to write: its identity and its bytes (one block of the store's layout).
#[derive(Debug, Clone)]
pub struct SharedPut {
    /// The block.
    pub identity: BlockIdentity,
    /// Its bytes.
    pub payload: Arc<[u8]>,
}

/// A block read back and checked: the value as the server sent it, not copied again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedBlock {
    /// Its identity as written.
    pub identity: BlockIdentity,
    value: Vec<u8>,
    payload_at: usize,
}

impl SharedBlock {
    /// The block's bytes.
    pub fn payload(&self) -> &[u8] {
        &self.value[self.payload_at..]
    }
}

/// A block's value as the three pieces [`value_parts`] gives, written into the command as one
/// argument (one copy of the payload, into the command's buffer).
struct ValueArg<'a> {
    header: [u8; VALUE_HEADER_BYTES],
    identity: Vec<u8>,
    payload: &'a [u8],
}

impl ToRedisArgs for ValueArg<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + RedisWrite,
    {
        let mut w = out.writer_for_next_arg();
        // Writing into the command's in-memory buffer cannot fail.
        let _ = w.write_all(&self.header);
        let _ = w.write_all(&self.identity);
        let _ = w.write_all(self.payload);
    }
}

/// What a prefix lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixLookup {
    /// Blocks of the prefix found, every shard of each.
    pub found: usize,
    /// `Some(found)` when the server said the block after them is not there (a shard of it
    /// missing); None when that is not known (the prefix ran to the end, or the answer was late,
    /// an error, or not asked).
    pub missing: Option<usize>,
}

/// The shared tier of one worker: blocks of one layout (its fingerprint) in one store.
pub struct SharedStore {
    /// Taken only by `Drop`.
    runtime: Option<tokio::runtime::Runtime>,
    conn: Conn,
    /// Prefix lookups' own connection: their small commands never queue behind megabytes of
    /// writes.
    lookup_conn: Conn,
    options: SharedOptions,
    fingerprint: u64,
    /// What a value's header names: the key's fingerprint, with the writer's layout folded in
    /// ([`Self::with_layout`]).
    value_fingerprint: u64,
    payload_bytes: usize,
    health: Arc<Health>,
    counters: Arc<Counters>,
    writes: Arc<Semaphore>,
}

impl Drop for SharedStore {
    fn drop(&mut self) {
        // Not `Runtime::drop`, which panics when the store is dropped inside async code.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedStore")
            .field("options", &self.options)
            .field("fingerprint", &format_args!("{:016x}", self.fingerprint))
            .field("payload_bytes", &self.payload_bytes)
            .finish_non_exhaustive()
    }
}

impl SharedStore {
    /// A store for blocks of `payload_bytes` in a pool of layout `fingerprint`. Connects
    /// lazily: a server that is down now is an outage of the tier, not an error here; only
    /// options that cannot work (a URL that does not parse) are.
    pub fn open(
        options: SharedOptions,
        fingerprint: u64,
        payload_bytes: usize,
    ) -> Result<Self, CoreError> {
        let bad = |what: String| CoreError::Shared(what);
        if options.urls.is_empty() {
            return Err(bad("no server URL".into()));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvbm-shared")
            .enable_all()
            .build()
            .map_err(|e| bad(format!("cannot start the shared tier's runtime: {e}")))?;
        let infos = options
            .urls
            .iter()
            .map(|u| {
                let info = u
                    .as_str()
                    .into_connection_info()
                    .map_err(|e| bad(format!("{}: not a usable server URL: {e}", redact_url(u))))?;
                Ok(match &options.password {
                    Some(p) => {
                        let redis = info.redis_settings().clone().set_password(p);
                        info.set_redis_settings(redis)
                    }
                    None => info,
                })
            })
            .collect::<Result<Vec<_>, CoreError>>()?;
        // TLS: the given authorities (else the system's roots) and client certificate; the
        // files were read and checked when the options were.
        let certificates = options.tls.as_ref().map(|t| redis::TlsCertificates {
            client_tls: t.client.as_ref().map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
            root_cert: t.ca.clone(),
        });
        let connect = |runtime: &tokio::runtime::Runtime| -> Result<Conn, CoreError> {
            Ok(if options.cluster {
                let mut builder = ClusterClient::builder(infos.clone())
                    .connection_timeout(options.connect_timeout)
                    .response_timeout(options.read_timeout.max(options.write_timeout))
                    .retries(3);
                if let Some(c) = &certificates {
                    builder = builder.certs(c.clone());
                }
                let client = builder
                    .build()
                    .map_err(|e| bad(format!("cannot use the cluster's seed nodes: {e}")))?;
                Conn::Cluster {
                    client: Arc::new(client),
                    conn: Arc::new(Mutex::new(None)),
                    connecting: Arc::new(AtomicBool::new(false)),
                    connect_timeout: options.connect_timeout,
                }
            } else {
                let client = match &certificates {
                    Some(c) => redis::Client::build_with_tls(infos[0].clone(), c.clone())
                        .map_err(|e| bad(format!("cannot use the TLS settings: {e}")))?,
                    None => redis::Client::open(infos[0].clone())
                        .map_err(|e| bad(format!("cannot use the server URL: {e}")))?,
                };
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(options.connect_timeout))
                    .set_response_timeout(Some(options.read_timeout.max(options.write_timeout)))
                    .set_number_of_retries(1)
                    .set_max_delay(BACKOFF_MAX);
                let _entered = runtime.enter();
                let manager = ConnectionManager::new_lazy_with_config(client, config)
                    .map_err(|e| bad(format!("cannot set up the connection: {e}")))?;
                Conn::Single(manager)
            })
        };
        let conn = connect(&runtime)?;
        let lookup_conn = connect(&runtime)?;
        let writes = Arc::new(Semaphore::new(options.writes_in_flight.max(1)));
        Ok(Self {
            runtime: Some(runtime),
            conn,
            lookup_conn,
            options,
            fingerprint,
            value_fingerprint: fingerprint,
            payload_bytes,
            health: Arc::new(Health {
                state: Mutex::new((0, None)),
                up: AtomicBool::new(true),
                late_lookups: AtomicU32::new(0),
            }),
            counters: Arc::new(Counters::default()),
            writes,
        })
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("the runtime lives until drop")
    }

    /// The options in use.
    pub fn options(&self) -> &SharedOptions {
        &self.options
    }

    /// The layout fingerprint of the blocks this store reads and writes.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The same store, its values checked against the reader's own layout as well: keys stay
    /// under the fingerprint given to [`Self::open`] (which a leader that never sees the layout
    /// can compute, [`super::shard_fingerprint`]), while every value names that fingerprint
    /// folded with `layout` ([`super::value_fingerprint`]). A worker of another layout that
    /// wrote under the same key is then refused (a mismatch, a miss), never served.
    pub fn with_layout(mut self, layout: u64) -> Self {
        self.value_fingerprint = super::value_fingerprint(self.fingerprint, layout);
        self
    }

    /// Whether the tier takes calls now (not backing off after an outage).
    pub fn usable(&self) -> bool {
        self.health.usable()
    }

    /// Counts `n` writes dropped before they reached [`Self::write`] because the tier was out.
    pub fn count_dropped_down(&self, n: usize) {
        add(&self.counters.writes_dropped_down, n as u64);
    }

    /// Bytes of one block.
    pub fn payload_bytes(&self) -> usize {
        self.payload_bytes
    }

    /// The tier's counters.
    pub fn counts(&self) -> SharedCounts {
        let c = &*self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SharedCounts {
            lookups: g(&c.lookups),
            lookup_hits: g(&c.lookup_hits),
            lookups_skipped: g(&c.lookups_skipped),
            reads: g(&c.reads),
            read_hits: g(&c.read_hits),
            read_missing: g(&c.read_missing),
            reads_skipped: g(&c.reads_skipped),
            read_refused: g(&c.read_refused),
            bad_values: std::array::from_fn(|i| g(&c.bad_values[i])),
            writes: g(&c.writes),
            write_bytes: g(&c.write_bytes),
            writes_dropped_down: g(&c.writes_dropped_down),
            writes_dropped_busy: g(&c.writes_dropped_busy),
            writes_refused: g(&c.writes_refused),
            timeouts: g(&c.timeouts),
            outages: g(&c.outages),
            recoveries: g(&c.recoveries),
            up: self.health.up.load(Ordering::Relaxed),
        }
    }

    fn key(&self, tenant: u64, hash: SequenceHash) -> String {
        block_key(&self.options.key_prefix, self.fingerprint, tenant, hash)
    }

    /// Runs `work` on the store's runtime, bounded by `limit`; None when it did not finish in
    /// time (counted; an outage too when `late_is_outage`).
    fn bounded<T: Send + 'static>(
        &self,
        limit: Duration,
        late_is_outage: bool,
        work: impl Future<Output = T> + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.rt().spawn(async move {
            if let Ok(v) = tokio::time::timeout(limit, work).await {
                let _ = tx.send(v);
            }
        });
        match rx.recv_timeout(limit + WAIT_SLACK) {
            Ok(v) => Some(v),
            Err(_) => {
                add(&self.counters.timeouts, 1);
                if late_is_outage {
                    self.health.failed(&self.counters);
                }
                None
            }
        }
    }

    /// Notes the outcome of a call's commands: any outage error takes the tier out.
    fn settle<T>(&self, results: &[RedisResult<T>]) {
        let outage = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .find(|e| is_outage(e));
        match outage {
            Some(e) => {
                tracing::warn!(error = %e, "shared tier: the server cannot be reached; the tier is a miss until it can");
                self.health.failed(&self.counters);
            }
            None => self.health.succeeded(&self.counters),
        }
    }

    /// How many of `hashes` (a prefix, in order) the store holds from the first on, for
    /// `tenant`: one round trip for the whole prefix, bounded by `lookup_timeout`. 0 when the
    /// tier is out or the answer is late.
    pub fn lookup(&self, tenant: u64, hashes: &[SequenceHash]) -> usize {
        self.lookup_shards(tenant, hashes, &[self.fingerprint])
    }

    /// [`Self::lookup`] of a block whose shards live under several fingerprints (one per
    /// tensor-parallel rank, [`super::shard_fingerprint`]): a block counts only when every
    /// shard of it is there, since a rank that misses its shard would fail the load. One round
    /// trip for all of them.
    pub fn lookup_shards(
        &self,
        tenant: u64,
        hashes: &[SequenceHash],
        fingerprints: &[u64],
    ) -> usize {
        self.lookup_prefix(tenant, hashes, fingerprints).found
    }

    /// [`Self::lookup_shards`], saying also whether the block after the prefix found is known
    /// to be gone: the server answered that a shard of it does not exist (not late, not an
    /// error, not past `lookup_blocks_max`).
    pub fn lookup_prefix(
        &self,
        tenant: u64,
        hashes: &[SequenceHash],
        fingerprints: &[u64],
    ) -> PrefixLookup {
        let none = PrefixLookup {
            found: 0,
            missing: None,
        };
        add(&self.counters.lookups, 1);
        if hashes.is_empty() || fingerprints.is_empty() {
            return none;
        }
        if !self.health.usable() {
            add(&self.counters.lookups_skipped, 1);
            return none;
        }
        let prefix = &self.options.key_prefix;
        let keys: Vec<String> = hashes
            .iter()
            .take(self.options.lookup_blocks_max)
            .flat_map(|h| {
                fingerprints
                    .iter()
                    .map(move |fp| block_key(prefix, *fp, tenant, *h))
            })
            .collect();
        let conn = self.lookup_conn.clone();
        // A late answer is a miss, not an outage: a busy server is not a dead one (its
        // connection failing is).
        let answer = self.bounded(self.options.lookup_timeout, false, async move {
            let handle = match conn.handle().await {
                Ok(h) => h,
                Err(e) => return vec![Err(e)],
            };
            let asks: Vec<Cmd> = keys
                .iter()
                .map(|k| {
                    let mut cmd = redis::cmd("EXISTS");
                    cmd.arg(k);
                    cmd
                })
                .collect();
            handle.query_all::<bool>(asks).await
        });
        let Some(results) = answer else {
            let late = self.health.late_lookups.fetch_add(1, Ordering::Relaxed) + 1;
            if late >= LATE_LOOKUPS_MAX {
                self.health.late_lookups.store(0, Ordering::Relaxed);
                tracing::warn!(
                    late,
                    "shared tier: lookups late in a row; the tier is a miss for a backoff"
                );
                self.health.failed(&self.counters);
            }
            return none;
        };
        self.health.late_lookups.store(0, Ordering::Relaxed);
        self.settle(&results);
        let found = results
            .chunks(fingerprints.len())
            .take_while(|shards| {
                shards.len() == fingerprints.len() && shards.iter().all(|r| matches!(r, Ok(true)))
            })
            .count();
        add(&self.counters.lookup_hits, found as u64);
        let missing = results
            .chunks(fingerprints.len())
            .nth(found)
            .filter(|shards| {
                shards.len() == fingerprints.len()
                    && shards.iter().all(|r| r.is_ok())
                    && shards.iter().any(|r| matches!(r, Ok(false)))
            })
            .map(|_| found);
        PrefixLookup { found, missing }
    }

    /// Reads `hashes` for `tenant`, bounded by `read_timeout`: each block checked, or None (not
    /// there, refused by [`decode_value`], or the tier out or late). The commands go out
    /// together; each value is checked on the caller's thread as it arrives, while the rest are
    /// still coming in.
    pub fn read(&self, tenant: u64, hashes: &[SequenceHash]) -> Vec<Option<SharedBlock>> {
        add(&self.counters.reads, hashes.len() as u64);
        let mut out: Vec<Option<SharedBlock>> = vec![None; hashes.len()];
        if hashes.is_empty() {
            return out;
        }
        if !self.health.usable() {
            add(&self.counters.reads_skipped, hashes.len() as u64);
            return out;
        }
        let keys: Vec<String> = hashes.iter().map(|h| self.key(tenant, *h)).collect();
        let conn = self.conn.clone();
        let limit = self.options.read_timeout;
        let (tx, rx) = crossbeam_channel::bounded(hashes.len());
        self.rt().spawn(async move {
            let work = async {
                let handle = match conn.handle().await {
                    Ok(h) => h,
                    Err(e) => {
                        let _ = tx.send((0, Err(e)));
                        return;
                    }
                };
                let asks = keys.into_iter().enumerate().map(|(i, k)| {
                    let mut h = handle.clone();
                    let tx = tx.clone();
                    async move {
                        let mut cmd = redis::cmd("GET");
                        cmd.arg(k);
                        let r = h.query::<Option<Vec<u8>>>(&cmd).await;
                        let _ = tx.send((i, r));
                    }
                });
                join_all(asks).await;
            };
            let _ = tokio::time::timeout(limit, work).await;
        });
        let deadline = Instant::now() + limit + WAIT_SLACK;
        let mut outage: Option<RedisError> = None;
        let mut answered = 0;
        while answered < hashes.len() {
            let Ok((i, r)) = rx.recv_deadline(deadline) else {
                break;
            };
            answered += 1;
            match r {
                Ok(Some(bytes)) => {
                    let hash = hashes[i];
                    let want = ValueFor {
                        fingerprint: self.value_fingerprint,
                        tenant,
                        hash,
                        payload_bytes: self.payload_bytes,
                    };
                    match decode_value(&bytes, want) {
                        Ok((identity, _)) => {
                            add(&self.counters.read_hits, 1);
                            out[i] = Some(SharedBlock {
                                identity,
                                payload_at: bytes.len() - self.payload_bytes,
                                value: bytes,
                            });
                        }
                        Err(why) => self.bad_value(why, hash),
                    }
                }
                Ok(None) => add(&self.counters.read_missing, 1),
                // A connection that could not be made answers once for all, then the channel
                // closes.
                Err(e) if is_outage(&e) => outage = Some(e),
                Err(e) => {
                    tracing::debug!(error = %e, "shared tier: the server refused a read");
                    add(&self.counters.read_refused, 1);
                }
            }
        }
        if answered < hashes.len() && outage.is_none() {
            // Late: what arrived is kept; the tier backs off.
            add(&self.counters.timeouts, 1);
            self.health.failed(&self.counters);
        } else {
            match outage {
                Some(e) => self.settle::<()>(&[Err(e)]),
                None => self.health.succeeded(&self.counters),
            }
        }
        out
    }

    fn bad_value(&self, why: BadValue, hash: SequenceHash) {
        add(&self.counters.bad_values[why.index()], 1);
        tracing::warn!(hash = %format_args!("{:016x}", hash.0), reason = %why, "shared tier: a stored value was refused (a miss)");
    }

    /// Queues `blocks` of `tenant` (a prefix, in order) for writing in batches of
    /// `write_batch_blocks`, each a pipelined round of `SET key value [PX ttl]`; returns at once.
    /// From the first block whose payload is not one block of this store's layout on, nothing
    /// is written (counted as refused). Returns the blocks queued; the rest were dropped (tier
    /// out, or `writes_in_flight` batches already in flight; counted), and what is queued is
    /// always a prefix of `blocks`.
    pub fn write(&self, tenant: u64, blocks: &[SharedPut]) -> usize {
        let given = blocks.len();
        let blocks: Vec<&SharedPut> = blocks
            .iter()
            .take_while(|b| b.payload.len() == self.payload_bytes)
            .collect();
        add(&self.counters.writes_refused, (given - blocks.len()) as u64);
        if blocks.is_empty() {
            return 0;
        }
        if !self.health.usable() {
            add(&self.counters.writes_dropped_down, blocks.len() as u64);
            return 0;
        }
        let mut queued = 0;
        let mut busy = false;
        for batch in blocks.chunks(self.options.write_batch_blocks.max(1)) {
            // Once a batch is dropped, so is the rest: a prefix with a hole is found only up to
            // the hole, so blocks after it would be stored for nothing.
            let permit = match busy {
                true => None,
                false => self.writes.clone().try_acquire_owned().ok(),
            };
            let Some(permit) = permit else {
                busy = true;
                add(&self.counters.writes_dropped_busy, batch.len() as u64);
                continue;
            };
            let ttl_ms = self.options.ttl.map(|t| t.as_millis().max(1) as u64);
            let (cmds, sizes): (Vec<Cmd>, Vec<u64>) = batch
                .iter()
                .map(|b| {
                    let (header, identity) =
                        value_parts(self.value_fingerprint, tenant, &b.identity, &b.payload);
                    let bytes = (header.len() + identity.len() + b.payload.len()) as u64;
                    let mut cmd = redis::cmd("SET");
                    cmd.arg(self.key(tenant, b.identity.sequence_hash))
                        .arg(ValueArg {
                            header,
                            identity,
                            payload: &b.payload,
                        });
                    if let Some(ms) = ttl_ms {
                        cmd.arg("PX").arg(ms);
                    }
                    (cmd, bytes)
                })
                .unzip();
            queued += cmds.len();
            let conn = self.conn.clone();
            let counters = self.counters.clone();
            let health = self.health.clone();
            let limit = self.options.write_timeout;
            self.rt().spawn(async move {
                let _permit = permit;
                let n = cmds.len() as u64;
                let work = async {
                    let handle = conn.handle().await?;
                    let answers = handle.query_all::<()>(cmds).await;
                    Ok::<_, RedisError>(
                        answers
                            .into_iter()
                            .zip(&sizes)
                            .map(|(r, bytes)| r.map(|_| *bytes))
                            .collect::<Vec<_>>(),
                    )
                };
                match tokio::time::timeout(limit, work).await {
                    Err(_) => {
                        add(&counters.timeouts, 1);
                        add(&counters.writes_dropped_down, n);
                        health.failed(&counters);
                    }
                    Ok(Err(e)) => {
                        add(&counters.writes_dropped_down, n);
                        if is_outage(&e) {
                            health.failed(&counters);
                        }
                    }
                    Ok(Ok(results)) => {
                        let mut outage = false;
                        for r in results {
                            match r {
                                Ok(bytes) => {
                                    add(&counters.writes, 1);
                                    add(&counters.write_bytes, bytes);
                                }
                                Err(e) if is_outage(&e) => {
                                    outage = true;
                                    add(&counters.writes_dropped_down, 1);
                                }
                                Err(e) => {
                                    tracing::debug!(error = %e, "shared tier: the server refused a write");
                                    add(&counters.writes_refused, 1);
                                }
                            }
                        }
                        if outage {
                            health.failed(&counters);
                        } else {
                            health.succeeded(&counters);
                        }
                    }
                }
            });
        }
        queued
    }

    /// Waits, up to `limit`, until no write is in flight; false when some still are.
    pub fn flush(&self, limit: Duration) -> bool {
        let all = self.options.writes_in_flight.max(1) as u32;
        let writes = self.writes.clone();
        self.bounded(limit, false, async move {
            writes.acquire_many(all).await.is_ok()
        })
        .unwrap_or(false)
    }
}
