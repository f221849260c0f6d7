//! Configuration from the environment, with Dynamo KVBM's variable names, validated once.
//!
//! Invariants: a value that does not parse, is negative, is not finite, or does not fit the
//! machine is an error naming the variable and the value; both tiers at zero is an error naming
//! both variables; nothing downstream re-checks these values.

use std::num::NonZeroUsize;

/// Host tier size in GB (10^9 bytes, float, total across tensor-parallel ranks).
pub const CPU_CACHE_GB: &str = "DYN_KVBM_CPU_CACHE_GB";
/// Exact host tier size in blocks; wins over [`CPU_CACHE_GB`].
pub const CPU_CACHE_OVERRIDE_NUM_BLOCKS: &str = "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS";
/// Disk tier size in GB.
pub const DISK_CACHE_GB: &str = "DYN_KVBM_DISK_CACHE_GB";
/// Exact disk tier size in blocks; wins over [`DISK_CACHE_GB`].
pub const DISK_CACHE_OVERRIDE_NUM_BLOCKS: &str = "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS";
/// Directory of the disk cache files.
pub const DISK_CACHE_DIR: &str = "DYN_KVBM_DISK_CACHE_DIR";
/// Buffered disk I/O instead of O_DIRECT.
pub const DISK_DISABLE_O_DIRECT: &str = "DYN_KVBM_DISK_DISABLE_O_DIRECT";
/// Write every host block to disk, not only reused ones.
pub const DISABLE_DISK_OFFLOAD_FILTER: &str = "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER";
/// kvbm's disk engine: `auto`, `io_uring` or `psync`.
pub const DISK_ENGINE: &str = kvbm_disk::ENGINE_ENV;
/// The KV cache layout kvbm's vLLM connector asks vLLM for (`get_required_kvcache_layout`):
/// one of vLLM 0.33's names (default `BLNHC`, one contiguous run per block), or `auto` to leave
/// vLLM's own choice.
pub const KV_CACHE_LAYOUT: &str = "KVBM_KV_CACHE_LAYOUT";
/// Where to publish KV events over ZMQ (a PUB socket; e.g. `tcp://127.0.0.1:5557`).
pub const KV_EVENTS_ENDPOINT: &str = "DYN_KVBM_KV_EVENTS_ENDPOINT";
/// Where to serve replays of recent KV event batches (a ROUTER socket).
pub const KV_EVENTS_REPLAY_ENDPOINT: &str = "DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT";
/// Blocks per transfer batch.
pub const MAX_TRANSFER_BATCH_SIZE: &str = "DYN_KVBM_MAX_TRANSFER_BATCH_SIZE";
/// Transfer batches in flight.
pub const MAX_CONCURRENT_TRANSFERS: &str = "DYN_KVBM_MAX_CONCURRENT_TRANSFERS";
/// Serve Prometheus metrics.
pub const METRICS: &str = "DYN_KVBM_METRICS";
/// Port of the metrics server.
pub const METRICS_PORT: &str = "DYN_KVBM_METRICS_PORT";
/// Address the metrics server binds (default 127.0.0.1).
pub const METRICS_HOST: &str = "DYN_KVBM_METRICS_HOST";
/// Log filter (tracing `EnvFilter` syntax).
pub const LOG: &str = "DYN_LOG";
/// The shared tier's server (Redis or Valkey): `redis://[USER:PASSWORD@]HOST:PORT[/DB]`
/// (`rediss://` for TLS), or a Cluster's seed nodes separated by commas. Unset: no shared tier.
pub const SHARED_URL: &str = "DYN_KVBM_SHARED_URL";
/// Talk to a Redis Cluster even through one seed URL (several URLs imply it).
pub const SHARED_CLUSTER: &str = "DYN_KVBM_SHARED_CLUSTER";
/// The server's password, when it is not in the URL.
pub const SHARED_PASSWORD: &str = "DYN_KVBM_SHARED_PASSWORD";
/// First part of every key kvbm stores (default `kvbm`).
pub const SHARED_KEY_PREFIX: &str = "DYN_KVBM_SHARED_KEY_PREFIX";
/// The shared pool's name in the tier's events (`ownership`; default the key prefix and the
/// model's fingerprint): workers that publish one name are taken by the router to reach one
/// pool.
pub const SHARED_POOL: &str = "DYN_KVBM_SHARED_POOL";
/// Lifetime of a stored block in seconds (default 3600; 0: until the server evicts it).
pub const SHARED_TTL_SECS: &str = "DYN_KVBM_SHARED_TTL_SECS";
/// Longest wait for a prefix lookup, in milliseconds (default 50).
pub const SHARED_LOOKUP_TIMEOUT_MS: &str = "DYN_KVBM_SHARED_LOOKUP_TIMEOUT_MS";
/// Longest wait for reading blocks, in milliseconds (default 1000).
pub const SHARED_READ_TIMEOUT_MS: &str = "DYN_KVBM_SHARED_READ_TIMEOUT_MS";
/// Longest wait for a batch of writes, in milliseconds (default 2000).
pub const SHARED_WRITE_TIMEOUT_MS: &str = "DYN_KVBM_SHARED_WRITE_TIMEOUT_MS";
/// Longest wait for a connection, in milliseconds (default 500).
pub const SHARED_CONNECT_TIMEOUT_MS: &str = "DYN_KVBM_SHARED_CONNECT_TIMEOUT_MS";
/// Blocks per write batch (default 32).
pub const SHARED_WRITE_BATCH_BLOCKS: &str = "DYN_KVBM_SHARED_WRITE_BATCH_BLOCKS";
/// Write batches in flight (default 4); a batch past them is dropped, never waited for.
pub const SHARED_WRITES_IN_FLIGHT: &str = "DYN_KVBM_SHARED_WRITES_IN_FLIGHT";
/// PEM file of the certificate authorities a `rediss://` server's certificate must chain to
/// (default: the system's trusted roots).
pub const SHARED_TLS_CA_FILE: &str = "DYN_KVBM_SHARED_TLS_CA_FILE";
/// PEM file of this client's certificate chain, for a server that authenticates its clients
/// (`tls-auth-clients yes`); needs [`SHARED_TLS_KEY_FILE`].
pub const SHARED_TLS_CERT_FILE: &str = "DYN_KVBM_SHARED_TLS_CERT_FILE";
/// PEM file of the private key of [`SHARED_TLS_CERT_FILE`].
pub const SHARED_TLS_KEY_FILE: &str = "DYN_KVBM_SHARED_TLS_KEY_FILE";
/// Longest accepted shared-tier timeout, in milliseconds.
pub const SHARED_TIMEOUT_MS_MAX: usize = 600_000;
/// Longest accepted shared-tier TTL, in seconds (30 days).
pub const SHARED_TTL_SECS_MAX: u64 = 30 * 24 * 3600;

/// Largest accepted [`MAX_TRANSFER_BATCH_SIZE`].
pub const TRANSFER_BATCH_BLOCKS_MAX: usize = 1024;
/// Largest accepted [`MAX_CONCURRENT_TRANSFERS`].
pub const CONCURRENT_TRANSFERS_MAX: usize = 64;
/// Bytes in the GB of the size variables.
pub const BYTES_PER_GB: f64 = 1e9;

/// A configuration value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// One variable's value is wrong.
    #[error("{variable}={value:?}: {reason}")]
    Invalid {
        /// The variable.
        variable: &'static str,
        /// Its value as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Neither tier has any capacity.
    #[error(
        "no cache tier configured: {CPU_CACHE_GB} and {DISK_CACHE_GB} are both 0 or unset \
         (set one of them, or {CPU_CACHE_OVERRIDE_NUM_BLOCKS} / {DISK_CACHE_OVERRIDE_NUM_BLOCKS}, above 0)"
    )]
    NoTier,
}

/// A tier's size as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierSize {
    /// From the GB variable, in bytes.
    Bytes(u64),
    /// From the override variable, in blocks.
    Blocks(usize),
}

impl TierSize {
    /// Blocks of `bytes_per_block` this size holds for one of `world_size` ranks.
    pub fn blocks(self, bytes_per_block: usize, world_size: usize) -> usize {
        match self {
            TierSize::Blocks(n) => n,
            TierSize::Bytes(bytes) => {
                let per_rank = bytes / world_size.max(1) as u64;
                (per_rank / bytes_per_block.max(1) as u64) as usize
            }
        }
    }

    fn is_zero(self) -> bool {
        matches!(self, TierSize::Bytes(0) | TierSize::Blocks(0))
    }
}

/// kvbm's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvbmConfig {
    /// Host tier size. Default 0.
    pub host: TierSize,
    /// Disk tier size. Default 0.
    pub disk: TierSize,
    /// Blocks per transfer batch. Default 16.
    pub transfer_batch_blocks_max: NonZeroUsize,
    /// Transfer batches in flight. Default 4.
    pub transfers_inflight_max: NonZeroUsize,
    /// Port to serve Prometheus metrics on, when enabled. Default off (port 6880 when on).
    pub metrics_port: Option<u16>,
    /// Address the metrics server binds.
    pub metrics_host: std::net::IpAddr,
    /// How the copy streams copy (`KVBM_COPY_COALESCE`, `KVBM_COPY_BATCH`).
    pub copy: kvbm_cuda::StreamOptions,
    /// Log filter. Default "info".
    pub log_filter: String,
    /// Directory of the disk cache files. Default: `kvbm-<uid>` in the system temp dir
    pub disk_dir: std::path::PathBuf,
    /// Buffered disk I/O instead of O_DIRECT. Default off.
    pub disk_disable_o_direct: bool,
    /// Write every host block to disk instead of those seen twice. Default off.
    pub disk_offload_filter_disabled: bool,
    /// The GPU layout the vLLM connector asks for (`KVBM_KV_CACHE_LAYOUT`). Default BLNHC;
    /// `None` (`auto`) asks for nothing.
    pub kv_cache_layout: Option<crate::layout::PhysicalLayout>,
    /// The disk I/O engine (`KVBM_DISK_ENGINE`). Default auto.
    pub disk_engine: kvbm_disk::EngineChoice,
    /// ZMQ endpoint for KV events. Default none (no ZMQ publishing).
    pub kv_events_endpoint: Option<String>,
    /// ZMQ endpoint for replays of KV events. Default none.
    pub kv_events_replay_endpoint: Option<String>,
    /// The shared tier (`DYN_KVBM_SHARED_*`). Default none.
    pub shared: Option<crate::shared::SharedOptions>,
}

/// The shared tier's options (`DYN_KVBM_SHARED_*`): None when [`SHARED_URL`] is unset or empty.
/// Readable without a local tier configured.
pub fn shared_options(
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<Option<crate::shared::SharedOptions>, ConfigError> {
    use crate::shared::{redact_url, SharedOptions};
    use std::time::Duration;
    let Some(raw) = lookup(SHARED_URL).filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let shown = raw
        .split(',')
        .map(|u| redact_url(u.trim()))
        .collect::<Vec<_>>()
        .join(",");
    let mut urls = Vec::new();
    for url in raw.split(',').map(str::trim) {
        if url.is_empty() {
            return Err(invalid(SHARED_URL, &shown, "an empty URL in the list"));
        }
        if !(url.starts_with("redis://")
            || url.starts_with("rediss://")
            || url.starts_with("redis+unix://"))
        {
            return Err(invalid(
                SHARED_URL,
                &shown,
                "expected redis://[USER:PASSWORD@]HOST:PORT or rediss:// for TLS (several, \
                 comma-separated, for a cluster)",
            ));
        }
        // The client would take `#insecure` as "check no certificate"; this build has no such
        // mode (a man in the middle could then plant blocks), and says how to trust a private CA.
        if url.starts_with("rediss://") && url.contains('#') {
            return Err(invalid(
                SHARED_URL,
                &shown,
                format!(
                    "a rediss:// URL takes no #fragment (#insecure is not supported: give the \
                     server's certificate authority in {SHARED_TLS_CA_FILE})"
                ),
            ));
        }
        if redis::IntoConnectionInfo::into_connection_info(url).is_err() {
            return Err(invalid(
                SHARED_URL,
                &shown,
                format!("{} is not a usable server URL", redact_url(url)),
            ));
        }
        urls.push(url.to_owned());
    }
    let tls = urls.iter().filter(|u| u.starts_with("rediss://")).count();
    if tls != 0 && tls != urls.len() {
        return Err(invalid(
            SHARED_URL,
            &shown,
            "mixes rediss:// and redis://: every server of a cluster is reached the same way",
        ));
    }
    let mut o = SharedOptions::new(urls);
    o.tls = shared_tls(lookup, tls != 0)?;
    if let Some(v) = lookup(SHARED_CLUSTER) {
        let on = parse_flag(&v)
            .ok_or_else(|| invalid(SHARED_CLUSTER, &v, "expected 0, 1, true or false"))?;
        if !on && o.urls.len() > 1 {
            return Err(invalid(
                SHARED_CLUSTER,
                &v,
                format!("{SHARED_URL} names several servers, which only a cluster can be"),
            ));
        }
        o.cluster = on;
    }
    if o.urls.iter().any(|u| u.starts_with("redis+unix://")) && o.cluster {
        return Err(invalid(
            SHARED_URL,
            &shown,
            "a cluster is reached over TCP (redis://HOST:PORT)",
        ));
    }
    o.password = lookup(SHARED_PASSWORD).filter(|p| !p.is_empty());
    if let Some(v) = lookup(SHARED_KEY_PREFIX) {
        let ok = !v.is_empty()
            && v.len() <= 64
            && v.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}');
        if !ok {
            return Err(invalid(
                SHARED_KEY_PREFIX,
                &v,
                "expected 1 to 64 printable ASCII characters, without spaces or braces",
            ));
        }
        o.key_prefix = v;
    }
    if let Some(v) = lookup(SHARED_POOL) {
        let ok = !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic());
        if !ok {
            return Err(invalid(
                SHARED_POOL,
                &v,
                "expected 1 to 128 printable ASCII characters, without spaces",
            ));
        }
        o.pool = Some(v);
    }
    if let Some(v) = lookup(SHARED_TTL_SECS) {
        let secs = v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|s| *s <= SHARED_TTL_SECS_MAX)
            .ok_or_else(|| {
                invalid(
                    SHARED_TTL_SECS,
                    &v,
                    format!("expected whole seconds from 0 (no TTL) to {SHARED_TTL_SECS_MAX}"),
                )
            })?;
        o.ttl = (secs > 0).then(|| Duration::from_secs(secs));
    }
    let ms = |var: &'static str, default: Duration| -> Result<Duration, ConfigError> {
        Ok(match lookup(var) {
            None => default,
            Some(_) => {
                Duration::from_millis(count(lookup, var, 1, SHARED_TIMEOUT_MS_MAX)?.get() as u64)
            }
        })
    };
    o.lookup_timeout = ms(SHARED_LOOKUP_TIMEOUT_MS, o.lookup_timeout)?;
    o.read_timeout = ms(SHARED_READ_TIMEOUT_MS, o.read_timeout)?;
    o.write_timeout = ms(SHARED_WRITE_TIMEOUT_MS, o.write_timeout)?;
    o.connect_timeout = ms(SHARED_CONNECT_TIMEOUT_MS, o.connect_timeout)?;
    o.write_batch_blocks = count(
        lookup,
        SHARED_WRITE_BATCH_BLOCKS,
        o.write_batch_blocks,
        TRANSFER_BATCH_BLOCKS_MAX,
    )?
    .get();
    o.writes_in_flight = count(
        lookup,
        SHARED_WRITES_IN_FLIGHT,
        o.writes_in_flight,
        CONCURRENT_TRANSFERS_MAX,
    )?
    .get();
    Ok(Some(o))
}

/// Where to serve the metrics (`DYN_KVBM_METRICS`, `DYN_KVBM_METRICS_PORT`,
/// `DYN_KVBM_METRICS_HOST`): None when off. Readable without a cache tier configured.
pub fn metrics_server(
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<Option<(std::net::IpAddr, u16)>, ConfigError> {
    let on = match lookup(METRICS) {
        None => false,
        Some(v) if v.trim().is_empty() => false,
        Some(v) => {
            parse_flag(&v).ok_or_else(|| invalid(METRICS, &v, "expected 0, 1, true or false"))?
        }
    };
    let port = match lookup(METRICS_PORT) {
        None => 6880,
        Some(v) => v
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| invalid(METRICS_PORT, &v, "expected a port number from 1 to 65535"))?,
    };
    let host = match lookup(METRICS_HOST) {
        None => std::net::Ipv4Addr::LOCALHOST.into(),
        Some(v) => v
            .trim()
            .parse::<std::net::IpAddr>()
            .map_err(|_| invalid(METRICS_HOST, &v, "expected an IP address (e.g. 127.0.0.1)"))?,
    };
    Ok(on.then_some((host, port)))
}

/// How the copy streams copy: `KVBM_COPY_COALESCE` and `KVBM_COPY_BATCH` (0 or 1, default 1).
pub fn copy_options(
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<kvbm_cuda::StreamOptions, ConfigError> {
    let mut options = kvbm_cuda::StreamOptions::default();
    for (var, field) in [
        (kvbm_cuda::COALESCE_ENV, &mut options.coalesce),
        (kvbm_cuda::BATCH_COPY_ENV, &mut options.batch_copy),
    ] {
        if let Some(v) = lookup(var) {
            *field = parse_flag(&v).ok_or_else(|| invalid(var, &v, "expected 0 or 1"))?;
        }
    }
    Ok(options)
}

impl KvbmConfig {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok(), machine_memory_bytes())
    }

    /// Reads variables through `lookup`, checking host sizes against `machine_memory_bytes`.
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
        machine_memory_bytes: u64,
    ) -> Result<Self, ConfigError> {
        let host = tier_size(
            &lookup,
            CPU_CACHE_GB,
            CPU_CACHE_OVERRIDE_NUM_BLOCKS,
            Some(machine_memory_bytes),
        )?;
        let disk = tier_size(&lookup, DISK_CACHE_GB, DISK_CACHE_OVERRIDE_NUM_BLOCKS, None)?;
        if host.is_zero() && disk.is_zero() {
            return Err(ConfigError::NoTier);
        }
        let transfer_batch_blocks_max = count(
            &lookup,
            MAX_TRANSFER_BATCH_SIZE,
            16,
            TRANSFER_BATCH_BLOCKS_MAX,
        )?;
        let transfers_inflight_max = count(
            &lookup,
            MAX_CONCURRENT_TRANSFERS,
            4,
            CONCURRENT_TRANSFERS_MAX,
        )?;
        let metrics = metrics_server(&lookup)?;
        let flag = |var: &'static str| match lookup(var) {
            None => Ok(false),
            Some(v) => {
                parse_flag(&v).ok_or_else(|| invalid(var, &v, "expected 0, 1, true or false"))
            }
        };
        let disk_dir = match lookup(DISK_CACHE_DIR) {
            None => default_disk_dir(),
            Some(v) if v.trim().is_empty() => {
                return Err(invalid(DISK_CACHE_DIR, &v, "empty path"))
            }
            Some(v) => std::path::PathBuf::from(v),
        };
        let disk_engine = match lookup(DISK_ENGINE) {
            None => kvbm_disk::EngineChoice::Auto,
            Some(v) => v
                .parse()
                .map_err(|_| invalid(DISK_ENGINE, &v, "expected auto, io_uring or psync"))?,
        };
        let endpoint = |var: &'static str| match lookup(var) {
            None => Ok(None),
            Some(v)
                if ["tcp://", "ipc://", "inproc://"]
                    .iter()
                    .any(|p| v.starts_with(p)) =>
            {
                Ok(Some(v))
            }
            Some(v) => Err(invalid(
                var,
                &v,
                "expected a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)",
            )),
        };
        let kv_events_endpoint = endpoint(KV_EVENTS_ENDPOINT)?;
        let kv_events_replay_endpoint = endpoint(KV_EVENTS_REPLAY_ENDPOINT)?;
        if kv_events_replay_endpoint.is_some() && kv_events_endpoint.is_none() {
            let v = kv_events_replay_endpoint.clone().unwrap_or_default();
            return Err(invalid(
                KV_EVENTS_REPLAY_ENDPOINT,
                &v,
                format!("needs {KV_EVENTS_ENDPOINT} too"),
            ));
        }
        Ok(Self {
            kv_cache_layout: kv_cache_layout(&lookup)?,
            kv_events_endpoint,
            kv_events_replay_endpoint,
            shared: shared_options(&lookup)?,
            disk_engine,
            disk_dir,
            disk_disable_o_direct: flag(DISK_DISABLE_O_DIRECT)?,
            disk_offload_filter_disabled: flag(DISABLE_DISK_OFFLOAD_FILTER)?,
            host,
            disk,
            transfer_batch_blocks_max,
            transfers_inflight_max,
            metrics_port: metrics.map(|(_, port)| port),
            metrics_host: metrics.map_or(std::net::Ipv4Addr::LOCALHOST.into(), |(host, _)| host),
            copy: copy_options(&lookup)?,
            log_filter: lookup(LOG).unwrap_or_else(|| "info".to_owned()),
        })
    }
}

impl KvbmConfig {
    /// Checks that the tiers fit this machine before anything is allocated: `world_size` ranks'
    /// host blocks of `host_block_bytes` within its memory, and their disk slots of
    /// `disk_slot_bytes` within the free space of the disk directory (or of its nearest existing
    /// parent). The error names the variable and the value that asked for too much.
    pub fn check_fits(
        &self,
        host_block_bytes: usize,
        disk_slot_bytes: usize,
        world_size: usize,
    ) -> Result<(), ConfigError> {
        self.check_fits_within(
            host_block_bytes,
            disk_slot_bytes,
            world_size,
            machine_memory_bytes(),
            free_disk_bytes(&self.disk_dir),
        )
    }

    /// [`Self::check_fits`] against given limits.
    pub fn check_fits_within(
        &self,
        host_block_bytes: usize,
        disk_slot_bytes: usize,
        world_size: usize,
        memory_bytes: u64,
        disk_free_bytes: u64,
    ) -> Result<(), ConfigError> {
        let tiers = [
            (
                self.host,
                host_block_bytes,
                memory_bytes,
                "this machine's memory",
                CPU_CACHE_GB,
                CPU_CACHE_OVERRIDE_NUM_BLOCKS,
            ),
            (
                self.disk,
                disk_slot_bytes,
                disk_free_bytes,
                "the free space of the disk cache directory",
                DISK_CACHE_GB,
                DISK_CACHE_OVERRIDE_NUM_BLOCKS,
            ),
        ];
        for (size, per_block, limit, what, gb_var, blocks_var) in tiers {
            let blocks = size.blocks(per_block, world_size) as u64;
            let total = blocks
                .checked_mul(per_block as u64)
                .and_then(|b| b.checked_mul(world_size.max(1) as u64));
            if total.is_none_or(|t| t > limit) {
                let (variable, value) = match size {
                    TierSize::Blocks(n) => (blocks_var, n.to_string()),
                    TierSize::Bytes(b) => (gb_var, format!("{}", b as f64 / BYTES_PER_GB)),
                };
                return Err(invalid(
                    variable,
                    &value,
                    format!(
                        "{blocks} blocks of {per_block} bytes on each of {} ranks do not fit {what} \
                         ({:.1} GB)",
                        world_size.max(1),
                        limit as f64 / BYTES_PER_GB
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Bytes the disk cache may use in `dir`: the free space for this user (in `dir`, or in its
/// nearest existing parent; unknown: unlimited) plus what kvbm's own cache files there
/// (`kvbm-rank*.cache`) already take, since a restart reuses them.
pub fn free_disk_bytes(dir: &std::path::Path) -> u64 {
    let mut at = Some(dir);
    let mut free = u64::MAX;
    while let Some(path) = at {
        if let Ok(stat) = nix::sys::statvfs::statvfs(path) {
            // fsblkcnt_t and c_ulong are u64 on the 64-bit targets kvbm builds for.
            free = stat.blocks_available().saturating_mul(stat.fragment_size());
            break;
        }
        at = path.parent();
    }
    let ours: u64 = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("kvbm-rank") && name.ends_with(".cache")
        })
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum();
    free.saturating_add(ours)
}

/// The disk cache's directory when `DYN_KVBM_DISK_CACHE_DIR` is unset: `kvbm-<uid>` in the
/// system temporary directory, private to this user (created 0700; the disk store refuses it if
/// someone else owns it or may write into it).
pub fn default_disk_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kvbm-{}", nix::unistd::geteuid().as_raw()))
}

/// The layout `KVBM_KV_CACHE_LAYOUT` asks for (read alone: vLLM asks for it before the tiers
/// are configured).
pub fn kv_cache_layout(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<crate::layout::PhysicalLayout>, ConfigError> {
    match lookup(KV_CACHE_LAYOUT) {
        None => Ok(Some(crate::layout::PhysicalLayout::Blnhc)),
        Some(v) if v.trim().eq_ignore_ascii_case("auto") => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| {
            invalid(
                KV_CACHE_LAYOUT,
                &v,
                "expected auto or one of vLLM's layouts: LBNHC, LBHNC, LHBNC, BLHNC, BLNHC, BHLNC",
            )
        }),
    }
}

/// The `DYN_KVBM_SHARED_TLS_*` files, read and checked now so that a wrong path or a file that
/// holds no PEM object is named at start-up rather than failing every connection later.
fn shared_tls(
    lookup: &impl Fn(&str) -> Option<String>,
    rediss: bool,
) -> Result<Option<crate::shared::SharedTls>, ConfigError> {
    let read = |variable: &'static str, what: &str, begin: &[&str]| {
        let Some(path) = lookup(variable).filter(|v| !v.trim().is_empty()) else {
            return Ok(None);
        };
        if !rediss {
            return Err(invalid(
                variable,
                &path,
                format!("TLS files need a rediss:// URL in {SHARED_URL}"),
            ));
        }
        let bytes = std::fs::read(&path)
            .map_err(|e| invalid(variable, &path, format!("cannot read {what}: {e}")))?;
        let text = String::from_utf8_lossy(&bytes);
        if !begin
            .iter()
            .any(|b| text.contains(&format!("-----BEGIN {b}-----")))
        {
            return Err(invalid(
                variable,
                &path,
                format!("holds no PEM {what} (-----BEGIN {}-----)", begin[0]),
            ));
        }
        Ok(Some(bytes))
    };
    let ca = read(SHARED_TLS_CA_FILE, "certificate", &["CERTIFICATE"])?;
    let cert = read(SHARED_TLS_CERT_FILE, "certificate", &["CERTIFICATE"])?;
    let key = read(
        SHARED_TLS_KEY_FILE,
        "private key",
        &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"],
    )?;
    let client = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(
                SHARED_TLS_CERT_FILE,
                &lookup(SHARED_TLS_CERT_FILE).unwrap_or_default(),
                format!("a client certificate needs its key in {SHARED_TLS_KEY_FILE}"),
            ))
        }
        (None, Some(_)) => {
            return Err(invalid(
                SHARED_TLS_KEY_FILE,
                &lookup(SHARED_TLS_KEY_FILE).unwrap_or_default(),
                format!("a client key needs its certificate in {SHARED_TLS_CERT_FILE}"),
            ))
        }
    };
    Ok(rediss.then_some(crate::shared::SharedTls { ca, client }))
}

fn invalid(variable: &'static str, value: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        variable,
        value: value.to_owned(),
        reason: reason.into(),
    }
}

fn parse_flag(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" | "" => Some(false),
        _ => None,
    }
}

fn tier_size(
    lookup: &impl Fn(&str) -> Option<String>,
    gb_var: &'static str,
    blocks_var: &'static str,
    memory_limit_bytes: Option<u64>,
) -> Result<TierSize, ConfigError> {
    // Validate the GB value even when the override wins: a typo should not pass silently.
    let bytes = match lookup(gb_var) {
        None => 0,
        Some(v) => {
            let gb: f64 = v
                .trim()
                .parse()
                .map_err(|_| invalid(gb_var, &v, "not a number of GB"))?;
            if !gb.is_finite() {
                return Err(invalid(gb_var, &v, "not a finite number"));
            }
            if gb < 0.0 {
                return Err(invalid(gb_var, &v, "negative"));
            }
            let bytes = gb * BYTES_PER_GB;
            if let Some(limit) = memory_limit_bytes {
                if bytes > limit as f64 {
                    return Err(invalid(
                        gb_var,
                        &v,
                        format!(
                            "larger than this machine's memory ({:.1} GB)",
                            limit as f64 / BYTES_PER_GB
                        ),
                    ));
                }
            }
            bytes as u64
        }
    };
    match lookup(blocks_var) {
        None => Ok(TierSize::Bytes(bytes)),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(TierSize::Blocks)
            .map_err(|_| invalid(blocks_var, &v, "not a non-negative whole number of blocks")),
    }
}

fn count(
    lookup: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    default: usize,
    max: usize,
) -> Result<NonZeroUsize, ConfigError> {
    let value = match lookup(var) {
        None => default,
        Some(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| invalid(var, &v, format!("expected a whole number from 1 to {max}")))?,
    };
    Ok(NonZeroUsize::new(value).expect("checked above zero"))
}

/// Total physical memory of this machine in bytes (u64::MAX when it cannot be read).
pub fn machine_memory_bytes() -> u64 {
    nix::sys::sysinfo::sysinfo()
        .map(|info| info.ram_total())
        .unwrap_or(u64::MAX)
}
