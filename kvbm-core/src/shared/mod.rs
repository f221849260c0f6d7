//! The shared tier (Dynamo's G4): blocks in a Redis or Valkey store that every worker of a fleet
//! reaches, so that a prefix computed on one node is loaded, not recomputed, on another.
//!
//! This module holds the tier's policy and formats: which key a block lives under, what a stored
//! value holds and how it is checked, and the tier's options. The client that talks to the
//! server is [`store::SharedStore`].
//!
//! Invariants:
//! - A key names the fingerprint, the tenant (LoRA adapter and cache salt) and the block's
//!   sequence hash, so that no layout or tenant can be served another's blocks, even if their
//!   hashes collided. The fingerprint is the caller's: it must fold in the layout, the
//!   tensor-parallel shard ([`shard_fingerprint`]) and the model's identity (name and revision:
//!   two fine-tunes of one geometry have the same layout but not the same KV).
//! - The checksum detects torn, corrupt and misplaced values; it is not a signature. Whoever may
//!   write to the server may plant blocks, so the server is for the fleet alone (a password or
//!   ACL user per fleet).
//! - A value is checked whole on every read (magic, version, the fingerprint, tenant and hash it
//!   was written for, its lengths, a checksum over header and body): anything else is a miss,
//!   counted by reason, never data.
//! - The server's own memory policy evicts (`maxmemory` with `allkeys-lru`); every write sets a
//!   TTL when one is configured; kvbm never scans the keyspace.

pub mod store;

use std::time::Duration;

use kvbm_events::SequenceHash;
use xxhash_rust::xxh3::Xxh3;

use crate::disk::{decode_identity, encode_identity};
use crate::pool::BlockIdentity;

pub use store::{PrefixLookup, SharedCounts, SharedStore};

/// The medium of the shared tier's events (with `locality` `REMOTE` and the pool's name in
/// `ownership`, as vLLM 0.33 publishes a tier that is not the publisher's own).
pub const EVENT_MEDIUM: &str = kvbm_events::wire::SHARED_MEDIUM;

/// First bytes of every value kvbm stores.
pub const VALUE_MAGIC: [u8; 8] = *b"KVBMSHR1";
/// Version of the value format.
pub const VALUE_VERSION: u32 = 1;
/// Bytes of a value's header.
pub const VALUE_HEADER_BYTES: usize = 64;
/// Largest identity (the block's tokens, parent and adapter) a value may carry.
pub const IDENTITY_BYTES_MAX: usize = 1 << 20;

/// The tenant of a block: 0 for requests with neither a LoRA adapter nor a cache salt,
/// otherwise a hash of both (a salt is a tenant's own namespace, as vLLM treats it).
pub fn tenant_id(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    if lora_name.is_none() && cache_salt.is_none() {
        return 0;
    }
    let mut h = Xxh3::new();
    for (tag, part) in [(b'l', lora_name), (b's', cache_salt)] {
        if let Some(p) = part {
            h.update(&[tag]);
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p.as_bytes());
        }
    }
    // Never 0: that is the tenant of unsalted, adapter-less requests.
    h.digest().max(1)
}

/// The fingerprint a rank's shared blocks are stored under: its layout fingerprint (as the disk
/// tier's, [`crate::layout_fingerprint`]) with the rank's place in a tensor-parallel group. Each
/// rank holds its own shard of a block's KV, so two ranks' bytes for one sequence hash differ
/// and must never be served for each other, nor to a worker split another way.
pub fn shard_fingerprint(layout_fingerprint: u64, rank: usize, world_size: usize) -> u64 {
    let mut h = Xxh3::new();
    h.update(b"kvbm-shared-shard");
    h.update(&layout_fingerprint.to_le_bytes());
    h.update(&(rank as u64).to_le_bytes());
    h.update(&(world_size as u64).to_le_bytes());
    h.digest()
}

/// What the values of a key fingerprint name when written by a worker of layout `layout` (the
/// worker's [`crate::BlockLayout::geometry_id`]): a value moved to another shard's key, or
/// written by a worker laid out otherwise, fails its check.
pub fn value_fingerprint(key_fingerprint: u64, layout: u64) -> u64 {
    let mut h = Xxh3::new();
    h.update(b"kvbm-shared-value");
    h.update(&key_fingerprint.to_le_bytes());
    h.update(&layout.to_le_bytes());
    h.digest()
}

/// The key of a block: `PREFIX:FINGERPRINT:TENANT:HASH`, each number 16 hex digits.
pub fn block_key(prefix: &str, fingerprint: u64, tenant: u64, hash: SequenceHash) -> String {
    format!("{prefix}:{fingerprint:016x}:{tenant:016x}:{:016x}", hash.0)
}

/// What a stored value must have been written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueFor {
    /// The layout fingerprint of the reader's pool.
    pub fingerprint: u64,
    /// The tenant.
    pub tenant: u64,
    /// The block's sequence hash.
    pub hash: SequenceHash,
    /// Bytes of one block of the reader's layout.
    pub payload_bytes: usize,
}

/// Why a stored value was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum BadValue {
    /// Shorter than its header, or than the lengths its header states.
    #[error("truncated")]
    Truncated,
    /// Not written by kvbm, or by an incompatible version.
    #[error("not a kvbm block (magic or version)")]
    Foreign,
    /// Written for another layout fingerprint, tenant or block.
    #[error("written for another layout, tenant or block")]
    Mismatch,
    /// Its payload is not one block of the reader's layout, or bytes follow it.
    #[error("wrong length")]
    Length,
    /// Its checksum does not match its bytes.
    #[error("checksum mismatch")]
    Checksum,
    /// Its identity does not parse, or names another block.
    #[error("bad identity")]
    Identity,
}

impl BadValue {
    /// Every reason, in a fixed order (for per-reason counters).
    pub const ALL: [BadValue; 6] = [
        BadValue::Truncated,
        BadValue::Foreign,
        BadValue::Mismatch,
        BadValue::Length,
        BadValue::Checksum,
        BadValue::Identity,
    ];

    /// The reason's metric label.
    pub fn label(self) -> &'static str {
        match self {
            BadValue::Truncated => "truncated",
            BadValue::Foreign => "foreign",
            BadValue::Mismatch => "mismatch",
            BadValue::Length => "length",
            BadValue::Checksum => "checksum",
            BadValue::Identity => "identity",
        }
    }

    /// Position in [`Self::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

fn checksum(header: &[u8], body: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&header[..48]);
    h.update(&header[56..VALUE_HEADER_BYTES]);
    h.update(body);
    h.digest()
}

/// A value for the block `identity` of `tenant` in a pool of layout `fingerprint`:
/// `magic 8 | version u32 | identity length u32 | fingerprint u64 | tenant u64 | hash u64 |
/// payload length u64 | checksum u64 | 8 reserved (zero) | identity | payload`, little-endian;
/// the checksum is XXH3-64 of the header without it, then the identity and payload.
pub fn encode_value(
    fingerprint: u64,
    tenant: u64,
    identity: &BlockIdentity,
    payload: &[u8],
) -> Vec<u8> {
    let (header, id) = value_parts(fingerprint, tenant, identity, payload);
    let mut out = Vec::with_capacity(VALUE_HEADER_BYTES + id.len() + payload.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(&id);
    out.extend_from_slice(payload);
    out
}

/// The header and identity bytes of [`encode_value`]'s value (the payload follows them), for
/// writers that send the three pieces without joining them first.
pub fn value_parts(
    fingerprint: u64,
    tenant: u64,
    identity: &BlockIdentity,
    payload: &[u8],
) -> ([u8; VALUE_HEADER_BYTES], Vec<u8>) {
    let id = encode_identity(identity);
    let mut header = [0u8; VALUE_HEADER_BYTES];
    header[..8].copy_from_slice(&VALUE_MAGIC);
    header[8..12].copy_from_slice(&VALUE_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&(id.len() as u32).to_le_bytes());
    header[16..24].copy_from_slice(&fingerprint.to_le_bytes());
    header[24..32].copy_from_slice(&tenant.to_le_bytes());
    header[32..40].copy_from_slice(&identity.sequence_hash.0.to_le_bytes());
    header[40..48].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let mut h = Xxh3::new();
    h.update(&header[..48]);
    h.update(&header[56..]);
    h.update(&id);
    h.update(payload);
    header[48..56].copy_from_slice(&h.digest().to_le_bytes());
    (header, id)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks a stored value against what the reader asked for; its block's identity and payload.
pub fn decode_value(bytes: &[u8], want: ValueFor) -> Result<(BlockIdentity, &[u8]), BadValue> {
    if bytes.len() < VALUE_HEADER_BYTES {
        return Err(if bytes.starts_with(&VALUE_MAGIC[..bytes.len().min(8)]) {
            BadValue::Truncated
        } else {
            BadValue::Foreign
        });
    }
    if bytes[..8] != VALUE_MAGIC || u32_at(bytes, 8) != VALUE_VERSION {
        return Err(BadValue::Foreign);
    }
    let id_len = u32_at(bytes, 12) as usize;
    let payload_len = u64_at(bytes, 40);
    if u64_at(bytes, 16) != want.fingerprint
        || u64_at(bytes, 24) != want.tenant
        || u64_at(bytes, 32) != want.hash.0
    {
        return Err(BadValue::Mismatch);
    }
    if id_len > IDENTITY_BYTES_MAX || payload_len != want.payload_bytes as u64 {
        return Err(BadValue::Length);
    }
    let end = VALUE_HEADER_BYTES + id_len + want.payload_bytes;
    if bytes.len() < end {
        return Err(BadValue::Truncated);
    }
    if bytes.len() > end {
        return Err(BadValue::Length);
    }
    if u64_at(bytes, 48) != checksum(&bytes[..VALUE_HEADER_BYTES], &bytes[VALUE_HEADER_BYTES..]) {
        return Err(BadValue::Checksum);
    }
    let id_end = VALUE_HEADER_BYTES + id_len;
    let identity =
        decode_identity(want.hash, &bytes[VALUE_HEADER_BYTES..id_end]).ok_or(BadValue::Identity)?;
    Ok((identity, &bytes[id_end..]))
}

/// Where the shared tier lives and how kvbm uses it (`DYN_KVBM_SHARED_*`, see
/// [`crate::config`]).
#[derive(Clone, PartialEq, Eq)]
pub struct SharedOptions {
    /// Server URLs: one for a standalone server; a Cluster's seed nodes (`redis://HOST:PORT`).
    pub urls: Vec<String>,
    /// Talk to a Redis Cluster (several URLs, or `DYN_KVBM_SHARED_CLUSTER`).
    pub cluster: bool,
    /// Password, when not in the URLs.
    pub password: Option<String>,
    /// First part of every key.
    pub key_prefix: String,
    /// Lifetime of a stored block; None: until the server evicts it.
    pub ttl: Option<Duration>,
    /// Longest wait for a prefix lookup (one round trip for the whole prefix).
    pub lookup_timeout: Duration,
    /// Longest wait for reading blocks.
    pub read_timeout: Duration,
    /// Longest wait for a batch of writes.
    pub write_timeout: Duration,
    /// Longest wait for a connection.
    pub connect_timeout: Duration,
    /// Blocks per write batch.
    pub write_batch_blocks: usize,
    /// Write batches in flight; a batch past them is dropped (counted), never waited for.
    pub writes_in_flight: usize,
    /// Most blocks one prefix lookup asks about.
    pub lookup_blocks_max: usize,
    /// The pool's name in the tier's events (`ownership`), which the router groups the workers
    /// that reach one pool by; None: the key prefix and the model's fingerprint.
    pub pool: Option<String>,
    /// TLS (`rediss://` URLs): None for plain TCP.
    pub tls: Option<SharedTls>,
}

/// What a `rediss://` connection trusts and shows, as PEM bytes. The server's certificate is
/// always checked, host name included.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SharedTls {
    /// Certificate authorities the server's certificate must chain to; None: the system's
    /// trusted roots.
    pub ca: Option<Vec<u8>>,
    /// This client's certificate chain and private key, for a server that authenticates its
    /// clients.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for SharedTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key's bytes.
        f.debug_struct("SharedTls")
            .field("ca", &self.ca.as_ref().map(|c| c.len()))
            .field("client", &self.client.as_ref().map(|_| "***"))
            .finish()
    }
}

impl SharedOptions {
    /// Options for `urls` with every other setting at its default.
    pub fn new(urls: Vec<String>) -> Self {
        Self {
            cluster: urls.len() > 1,
            urls,
            password: None,
            key_prefix: "kvbm".into(),
            ttl: Some(Duration::from_secs(3600)),
            lookup_timeout: Duration::from_millis(50),
            read_timeout: Duration::from_millis(1000),
            write_timeout: Duration::from_millis(2000),
            connect_timeout: Duration::from_millis(500),
            pool: None,
            tls: None,
            write_batch_blocks: 32,
            writes_in_flight: 4,
            lookup_blocks_max: 4096,
        }
    }
}

/// A URL with its password (if any: `USER:PASSWORD@`, or `pass=` / `password=` in its query)
/// replaced, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((u, q)) => (u, Some(q)),
        None => (url, None),
    };
    let mut out = redact_userinfo(url);
    if let Some(q) = query {
        let parts: Vec<String> = q
            .split('&')
            .map(|kv| match kv.split_once('=') {
                Some((k, _))
                    if k.eq_ignore_ascii_case("pass") || k.eq_ignore_ascii_case("password") =>
                {
                    format!("{k}=***")
                }
                _ => kv.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&parts.join("&"));
    }
    out
}

fn redact_userinfo(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme + 3 => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            let shown = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                "***".to_owned()
            };
            format!("{}{}{}", &url[..scheme + 3], shown, &url[at..])
        }
        _ => url.to_owned(),
    }
}

impl std::fmt::Debug for SharedOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedOptions")
            .field(
                "urls",
                &self.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
            )
            .field("cluster", &self.cluster)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("key_prefix", &self.key_prefix)
            .field("ttl", &self.ttl)
            .field("lookup_timeout", &self.lookup_timeout)
            .field("read_timeout", &self.read_timeout)
            .field("write_timeout", &self.write_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("write_batch_blocks", &self.write_batch_blocks)
            .field("writes_in_flight", &self.writes_in_flight)
            .field("lookup_blocks_max", &self.lookup_blocks_max)
            .field("pool", &self.pool)
            .field("tls", &self.tls)
            .finish()
    }
}
