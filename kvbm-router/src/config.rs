//! The service's configuration: its command line (flags named as Dynamo's router names them) and
//! the `--workers` list.

use std::net::IpAddr;
use std::time::Duration;

use clap::Parser;
use kvbm_events::router::{SelectorConfig, BLOCKS_PER_WORKER_MAX_DEFAULT};
use kvbm_events::WorkerEndpoint;

/// Largest request body accepted by default (a 128K-token prompt as JSON is about 1 MB).
pub const MAX_BODY_BYTES_DEFAULT: usize = 4 << 20;
/// Longest time-to-live a flag may give (a week): longer ones are refused, not wrapped.
pub const TTL_SECS_MAX: u64 = 7 * 24 * 3600;
/// Longest request id accepted by default, in bytes.
pub const MAX_REQUEST_ID_BYTES_DEFAULT: usize = 256;
/// Routed requests tracked at most by default.
pub const MAX_TRACKED_REQUESTS_DEFAULT: usize = 100_000;
/// Workers registered at most by default.
pub const MAX_WORKERS_DEFAULT: usize = 1024;
/// Open HTTP connections at most by default.
pub const MAX_CONNECTIONS_DEFAULT: usize = 1024;
/// Seconds an HTTP connection may stay idle by default.
pub const HTTP_IDLE_TIMEOUT_SECS_DEFAULT: u64 = 60;

/// kvbm-router: follows workers' KV cache events (vLLM's ZMQ format, with kvbm's host and disk
/// tiers) and sends each request to the worker that holds most of its prefix, weighed against
/// how busy each worker is.
#[derive(Parser, Debug, Clone)]
#[command(name = "kvbm-router", version)]
pub struct Args {
    /// Workers to follow, separated by ';': "ID[:DP_RANK]=tcp://HOST:PORT[,replay=tcp://HOST:PORT]".
    /// ID is the worker id (u64), DP_RANK its data-parallel rank (default 0), then the engine's
    /// KV events PUB endpoint and, optionally, its replay (ROUTER) endpoint, used to fill gaps and
    /// to catch up when the router starts. More can be added with POST /register.
    #[arg(long, default_value = "")]
    pub workers: String,

    /// A sibling router's URL (http://HOST:PORT): its index is read from GET /dump at start,
    /// with its workers, and each is followed from the sequence number after the dump's.
    #[arg(long)]
    pub bootstrap_from: Option<String>,

    /// A file of workers, one per line in the --workers syntax ('#' starts a comment), re-read
    /// when it changes: workers that appear are registered, those that disappear unregistered.
    #[arg(long)]
    pub workers_file: Option<std::path::PathBuf>,

    /// Address the HTTP API listens on. Anything other than loopback exposes the API to the
    /// network; it has no authentication.
    #[arg(long, default_value = "127.0.0.1")]
    pub http_host: IpAddr,

    /// Port of the HTTP API (0 picks a free one; the address is printed on start).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,

    /// Tokens per KV block; must equal the engines' block size, or no hash will match.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,

    /// Weight of the prefill term of the cost (Dynamo's `--kv-overlap-score-weight`).
    #[arg(long, default_value_t = 1.0)]
    pub kv_overlap_score_weight: f64,

    /// Credit of a block found in a worker's pinned host memory, relative to one on its GPU.
    #[arg(long, default_value_t = 0.75)]
    pub router_host_cache_hit_weight: f64,

    /// Credit of a block found on a worker's local disk, relative to one on its GPU.
    #[arg(long, default_value_t = 0.25)]
    pub router_disk_cache_hit_weight: f64,

    /// 0 always picks the lowest cost; above 0, picks at random with weights
    /// exp(-(cost - min) / ((max - min) * T)), spreading load between near-equal workers.
    #[arg(long, default_value_t = 0.0)]
    pub router_temperature: f64,

    /// Cost of each request a worker is running, added to its decode blocks.
    #[arg(long, default_value_t = 0.0)]
    pub router_decode_active_request_weight: f64,

    /// Seconds a routed request counts toward its worker's load when the caller never reports its
    /// first token or its end (at most a week).
    #[arg(long, default_value_t = 600)]
    pub router_request_ttl_secs: u64,

    /// Seconds a routing decision counts the request's blocks as present on the chosen worker's
    /// GPU, so that sibling requests sent before its events arrive land on it too; the worker's
    /// own store of a block ends its prediction. 0 (the default) predicts nothing.
    #[arg(long, default_value_t = 0.0)]
    pub router_predicted_ttl_secs: f64,

    /// Longest request id accepted, in bytes (longer ones get 400).
    #[arg(long, default_value_t = MAX_REQUEST_ID_BYTES_DEFAULT)]
    pub max_request_id_bytes: usize,

    /// Routed requests whose load is tracked at most; beyond it a request is routed but its load
    /// is not tracked (counted in kv_router_requests_untracked_total).
    #[arg(long, default_value_t = MAX_TRACKED_REQUESTS_DEFAULT)]
    pub max_tracked_requests: usize,

    /// Workers registered at most (--workers, --workers-file and POST /register together).
    #[arg(long, default_value_t = MAX_WORKERS_DEFAULT)]
    pub max_workers: usize,

    /// Open HTTP connections at most; connections beyond it are closed at once (counted).
    #[arg(long, default_value_t = MAX_CONNECTIONS_DEFAULT)]
    pub max_connections: usize,

    /// Seconds an HTTP connection may stay without traffic before it is closed.
    #[arg(long, default_value_t = HTTP_IDLE_TIMEOUT_SECS_DEFAULT)]
    pub http_idle_timeout_secs: u64,

    /// Most (block, tier) holdings indexed per worker; stores beyond it are refused and counted
    /// (kv_cache_events_applied{status="worker_full"}).
    #[arg(long, default_value_t = BLOCKS_PER_WORKER_MAX_DEFAULT)]
    pub max_blocks_per_worker: usize,

    /// Distinct blocks to make room for in the index at start (0: grow as needed). Growing a large
    /// index pauses event processing while it rehashes; sizing it for the fleet avoids that.
    #[arg(long, default_value_t = 0)]
    pub index_capacity_blocks: usize,

    /// Largest request body accepted, in bytes (larger ones get 413).
    #[arg(long, default_value_t = MAX_BODY_BYTES_DEFAULT)]
    pub max_body_bytes: usize,
}

/// Why the configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A flag's value is out of range.
    #[error("--{flag}={value}: {why}")]
    Flag {
        /// The flag, without dashes.
        flag: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: &'static str,
    },
    /// A `--workers` entry did not parse.
    #[error("--workers entry {entry:?}: {why}")]
    Worker {
        /// The entry.
        entry: String,
        /// What is wrong.
        why: String,
    },
}

/// The validated configuration of a router.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// The selector's weights.
    pub selector: SelectorConfig,
    /// How long an unreported request counts toward load.
    pub request_ttl: Duration,
    /// Per-worker index limit.
    pub max_blocks_per_worker: usize,
    /// Distinct blocks the index makes room for at start.
    pub index_capacity_blocks: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// How long a routing decision predicts the request's blocks on its worker (zero: never).
    pub predicted_ttl: Duration,
    /// Longest request id.
    pub max_request_id_bytes: usize,
    /// Routed requests tracked at most.
    pub max_tracked_requests: usize,
    /// Workers registered at most.
    pub max_workers: usize,
    /// Open HTTP connections at most.
    pub max_connections: usize,
    /// Idle time after which an HTTP connection is closed.
    pub http_idle_timeout: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            selector: SelectorConfig::default(),
            request_ttl: Duration::from_secs(600),
            max_blocks_per_worker: BLOCKS_PER_WORKER_MAX_DEFAULT,
            index_capacity_blocks: 0,
            max_body_bytes: MAX_BODY_BYTES_DEFAULT,
            predicted_ttl: Duration::ZERO,
            max_request_id_bytes: MAX_REQUEST_ID_BYTES_DEFAULT,
            max_tracked_requests: MAX_TRACKED_REQUESTS_DEFAULT,
            max_workers: MAX_WORKERS_DEFAULT,
            max_connections: MAX_CONNECTIONS_DEFAULT,
            http_idle_timeout: Duration::from_secs(HTTP_IDLE_TIMEOUT_SECS_DEFAULT),
        }
    }
}

/// A whole number flag of at least 1 and at most `max`.
fn bounded(flag: &'static str, value: u64, max: u64) -> Result<u64, ConfigError> {
    if value == 0 || value > max {
        return Err(ConfigError::Flag {
            flag,
            value: value.to_string(),
            why: if value == 0 {
                "must be at least 1"
            } else {
                "is above the largest value accepted"
            },
        });
    }
    Ok(value)
}

fn weight(flag: &'static str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(ConfigError::Flag {
            flag,
            value: value.to_string(),
            why: "must be a finite number, 0 or more",
        })
    }
}

impl Args {
    /// The router configuration these flags describe.
    pub fn router_config(&self) -> Result<RouterConfig, ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::Flag {
                flag: "block-size",
                value: "0".into(),
                why: "must be at least 1",
            });
        }
        if self.block_size > u32::MAX as usize {
            return Err(ConfigError::Flag {
                flag: "block-size",
                value: self.block_size.to_string(),
                why: "is above the largest value accepted",
            });
        }
        if self.max_body_bytes == 0 {
            return Err(ConfigError::Flag {
                flag: "max-body-bytes",
                value: "0".into(),
                why: "must be at least 1",
            });
        }
        let request_ttl = bounded(
            "router-request-ttl-secs",
            self.router_request_ttl_secs,
            TTL_SECS_MAX,
        )?;
        let predicted = self.router_predicted_ttl_secs;
        if !(predicted.is_finite() && (0.0..=TTL_SECS_MAX as f64).contains(&predicted)) {
            return Err(ConfigError::Flag {
                flag: "router-predicted-ttl-secs",
                value: predicted.to_string(),
                why: "must be a number of seconds from 0 to a week",
            });
        }
        let idle = bounded(
            "http-idle-timeout-secs",
            self.http_idle_timeout_secs,
            TTL_SECS_MAX,
        )?;
        let max_request_id_bytes = bounded(
            "max-request-id-bytes",
            self.max_request_id_bytes as u64,
            1 << 20,
        )? as usize;
        let max_tracked_requests = bounded(
            "max-tracked-requests",
            self.max_tracked_requests as u64,
            1 << 30,
        )? as usize;
        let max_workers = bounded("max-workers", self.max_workers as u64, 1 << 16)? as usize;
        let max_connections =
            bounded("max-connections", self.max_connections as u64, 1 << 20)? as usize;
        Ok(RouterConfig {
            block_size: self.block_size,
            selector: SelectorConfig {
                prefill_load_scale: weight(
                    "kv-overlap-score-weight",
                    self.kv_overlap_score_weight,
                )?,
                decode_active_request_weight: weight(
                    "router-decode-active-request-weight",
                    self.router_decode_active_request_weight,
                )?,
                host_weight: weight(
                    "router-host-cache-hit-weight",
                    self.router_host_cache_hit_weight,
                )?,
                disk_weight: weight(
                    "router-disk-cache-hit-weight",
                    self.router_disk_cache_hit_weight,
                )?,
                temperature: weight("router-temperature", self.router_temperature)?,
            },
            request_ttl: Duration::from_secs(request_ttl),
            max_blocks_per_worker: self.max_blocks_per_worker,
            index_capacity_blocks: self.index_capacity_blocks,
            max_body_bytes: self.max_body_bytes,
            predicted_ttl: Duration::from_secs_f64(predicted),
            max_request_id_bytes,
            max_tracked_requests,
            max_workers,
            max_connections,
            http_idle_timeout: Duration::from_secs(idle),
        })
    }
}

fn check_endpoint(entry: &str, endpoint: &str) -> Result<(), ConfigError> {
    let ok = ["tcp://", "ipc://", "inproc://"]
        .iter()
        .any(|scheme| endpoint.len() > scheme.len() && endpoint.starts_with(scheme));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Worker {
            entry: entry.to_owned(),
            why: format!("{endpoint:?} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)"),
        })
    }
}

/// One worker: `ID[:DP_RANK]=ENDPOINT[,replay=ENDPOINT]`.
pub fn parse_worker(entry: &str) -> Result<WorkerEndpoint, ConfigError> {
    let entry = entry.trim();
    let bad = |why: String| ConfigError::Worker {
        entry: entry.to_owned(),
        why,
    };
    let (key, rest) = entry
        .split_once('=')
        .ok_or_else(|| bad("expected ID[:DP_RANK]=tcp://HOST:PORT".into()))?;
    let (id, rank) = match key.trim().split_once(':') {
        Some((id, rank)) => (id, Some(rank)),
        None => (key.trim(), None),
    };
    let worker_id: u64 = id
        .trim()
        .parse()
        .map_err(|_| bad(format!("worker id {id:?} is not an unsigned integer")))?;
    let dp_rank: u32 = match rank {
        Some(r) => r
            .trim()
            .parse()
            .map_err(|_| bad(format!("dp rank {r:?} is not an unsigned integer")))?,
        None => 0,
    };
    let mut parts = rest.split(',');
    let endpoint = parts.next().unwrap_or_default().trim().to_owned();
    check_endpoint(entry, &endpoint)?;
    let mut replay = None;
    for option in parts {
        match option.trim().split_once('=') {
            Some(("replay", value)) => {
                let value = value.trim();
                check_endpoint(entry, value)?;
                replay = Some(value.to_owned());
            }
            _ => {
                return Err(bad(format!(
                    "unknown option {option:?} (expected replay=...)"
                )))
            }
        }
    }
    Ok(WorkerEndpoint {
        worker_id,
        dp_rank,
        endpoint,
        replay,
    })
}

/// The `--workers` list; an id and rank may appear once.
pub fn parse_workers(spec: &str) -> Result<Vec<WorkerEndpoint>, ConfigError> {
    let mut out: Vec<WorkerEndpoint> = Vec::new();
    for entry in spec.split(';').filter(|e| !e.trim().is_empty()) {
        let w = parse_worker(entry)?;
        if out
            .iter()
            .any(|o| (o.worker_id, o.dp_rank) == (w.worker_id, w.dp_rank))
        {
            return Err(ConfigError::Worker {
                entry: entry.trim().to_owned(),
                why: format!("worker {}:{} is listed twice", w.worker_id, w.dp_rank),
            });
        }
        out.push(w);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_lists_parse_and_bad_entries_are_named() {
        let workers =
            parse_workers("1=tcp://127.0.0.1:5557; 2:3=tcp://h:1,replay=tcp://h:2;").unwrap();
        assert_eq!(workers.len(), 2);
        assert_eq!(
            workers[1],
            WorkerEndpoint {
                worker_id: 2,
                dp_rank: 3,
                endpoint: "tcp://h:1".into(),
                replay: Some("tcp://h:2".into()),
            }
        );
        assert_eq!(workers[0].dp_rank, 0);
        assert!(parse_workers("").unwrap().is_empty());
        for bad in [
            "x=tcp://h:1",
            "1:y=tcp://h:1",
            "1=http://h:1",
            "1=tcp://h:1,replay=nope",
            "1=tcp://h:1,other=tcp://h:2",
            "tcp://h:1",
            "1=tcp://h:1;1=tcp://h:2",
        ] {
            let e = parse_workers(bad).unwrap_err().to_string();
            assert!(e.contains("--workers entry"), "{bad}: {e}");
        }
    }

    #[test]
    fn flags_out_of_range_are_refused_with_their_name() {
        let mut args = Args::parse_from(["kvbm-router"]);
        assert_eq!(args.http_host.to_string(), "127.0.0.1");
        let config = args.router_config().unwrap();
        assert_eq!(config.selector, SelectorConfig::default());
        args.router_host_cache_hit_weight = -1.0;
        let e = args.router_config().unwrap_err().to_string();
        assert!(e.contains("--router-host-cache-hit-weight=-1"), "{e}");
        args.router_host_cache_hit_weight = 0.5;
        args.block_size = 0;
        assert!(args
            .router_config()
            .unwrap_err()
            .to_string()
            .contains("--block-size"));
        args.block_size = 16;
        // A time-to-live near u64::MAX would overflow every Instant it is added to.
        args.router_request_ttl_secs = u64::MAX - 1;
        let e = args.router_config().unwrap_err().to_string();
        assert!(
            e.contains("--router-request-ttl-secs=18446744073709551614"),
            "{e}"
        );
        args.router_request_ttl_secs = 600;
        for bad in [f64::NAN, -1.0, 1e30] {
            args.router_predicted_ttl_secs = bad;
            let e = args.router_config().unwrap_err().to_string();
            assert!(e.contains("--router-predicted-ttl-secs"), "{e}");
        }
        args.router_predicted_ttl_secs = 2.5;
        assert_eq!(
            args.router_config().unwrap().predicted_ttl,
            Duration::from_millis(2500)
        );
        args.max_workers = 0;
        assert!(args
            .router_config()
            .unwrap_err()
            .to_string()
            .contains("--max-workers=0"));
    }
}
