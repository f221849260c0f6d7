//! Settings read once from the environment, the first time the driver needs them.

use std::sync::OnceLock;

/// `1` aborts the process on the first violation, with the violation on stderr.
pub const STRICT_ENV: &str = "KVBM_SIM_STRICT";
/// A file each violation is appended to, one line each, as it happens.
pub const REPORT_ENV: &str = "KVBM_SIM_REPORT";
/// The driver version reported by `cuDriverGetVersion` (default 12080, CUDA 12.8).
pub const DRIVER_VERSION_ENV: &str = "KVBM_SIM_DRIVER_VERSION";
/// Seed of the per-operation delays streams insert (default: no delays).
pub const JITTER_SEED_ENV: &str = "KVBM_SIM_JITTER_SEED";
/// Largest delay in microseconds a stream inserts before an operation (default 200 with a seed).
pub const JITTER_US_ENV: &str = "KVBM_SIM_JITTER_US";
/// Bytes of "device memory" (default 80 GiB); allocations past it fail with out-of-memory.
pub const MEMORY_BYTES_ENV: &str = "KVBM_SIM_MEMORY_BYTES";

/// Default driver version: CUDA 12.8, the first with `cuMemcpyBatchAsync`.
pub const DRIVER_VERSION_DEFAULT: i32 = 12080;
/// Default device memory size.
pub const MEMORY_BYTES_DEFAULT: u64 = 80 << 30;
/// Default largest jitter delay when only a seed is given.
pub const JITTER_US_MAX_DEFAULT: u64 = 200;

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub strict: bool,
    pub report_path: Option<std::path::PathBuf>,
    pub driver_version: i32,
    pub memory_bytes: u64,
    /// (seed, largest delay in microseconds), when jitter is on.
    pub jitter: Option<(u64, u64)>,
}

pub(crate) fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(Config::from_env)
}

impl Config {
    fn from_env() -> Self {
        let jitter_us_max = parse(JITTER_US_ENV).unwrap_or(JITTER_US_MAX_DEFAULT);
        Self {
            strict: std::env::var(STRICT_ENV).is_ok_and(|v| v.trim() == "1"),
            report_path: std::env::var_os(REPORT_ENV)
                .filter(|p| !p.is_empty())
                .map(Into::into),
            driver_version: parse(DRIVER_VERSION_ENV).unwrap_or(DRIVER_VERSION_DEFAULT),
            memory_bytes: parse(MEMORY_BYTES_ENV).unwrap_or(MEMORY_BYTES_DEFAULT),
            jitter: parse::<u64>(JITTER_SEED_ENV).map(|seed| (seed, jitter_us_max)),
        }
    }
}

/// Parses a variable; a value that does not parse stops the process with a message naming it,
/// since a test run on a silently ignored setting would prove nothing.
fn parse<T: std::str::FromStr>(name: &str) -> Option<T> {
    let value = std::env::var(name).ok()?;
    match value.trim().parse() {
        Ok(v) => Some(v),
        Err(_) => {
            eprintln!("kvbm-cuda-sim: {name}={value:?} does not parse");
            std::process::abort();
        }
    }
}
