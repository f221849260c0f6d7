//! `Config`: kvbm's configuration as Python sees it.

use std::collections::HashMap;

use kvbm_core::{KvbmConfig, TierSize};
use pyo3::prelude::*;

use crate::{guard, ConfigError};

/// kvbm's configuration: read from the environment (`DYN_KVBM_*`), with keyword overrides that
/// take the place of the variables of the same name.
#[pyclass(module = "kvbm._kvbm", frozen)]
#[derive(Debug, Clone)]
pub struct Config {
    pub(crate) inner: KvbmConfig,
}

fn tier_blocks(size: TierSize, bytes_per_block: usize, world_size: usize) -> usize {
    size.blocks(bytes_per_block, world_size.max(1))
}

#[pymethods]
impl Config {
    /// Reads the environment; `overrides` maps variable names (e.g. `DYN_KVBM_CPU_CACHE_GB`) to
    /// values that win over the environment. Raises `ConfigError` naming the variable and the
    /// value when one is invalid, or when no tier has any capacity.
    #[staticmethod]
    #[pyo3(signature = (overrides=None))]
    fn from_env(overrides: Option<HashMap<String, String>>) -> PyResult<Self> {
        guard(|| {
            let overrides = overrides.unwrap_or_default();
            KvbmConfig::from_lookup(
                |name| {
                    overrides
                        .get(name)
                        .cloned()
                        .or_else(|| std::env::var(name).ok())
                },
                kvbm_core::config::machine_memory_bytes(),
            )
            .map(|inner| Self { inner })
            .map_err(|e| ConfigError::new_err(e.to_string()))
        })
    }

    /// Raises `ConfigError`, naming the variable and its value, when `world_size` ranks' host
    /// blocks of `host_block_bytes` exceed this machine's memory or their disk slots of
    /// `disk_slot_bytes` the free space of the disk directory.
    #[pyo3(signature = (host_block_bytes, disk_slot_bytes, world_size=1))]
    fn check_fits(
        &self,
        host_block_bytes: usize,
        disk_slot_bytes: usize,
        world_size: usize,
    ) -> PyResult<()> {
        guard(|| {
            self.inner
                .check_fits(host_block_bytes, disk_slot_bytes, world_size)
                .map_err(|e| ConfigError::new_err(e.to_string()))
        })
    }

    /// Host blocks for one of `world_size` ranks, with blocks of `bytes_per_block` per rank
    /// (`DYN_KVBM_CPU_CACHE_GB` is the total over the ranks).
    #[pyo3(signature = (bytes_per_block, world_size=1))]
    fn host_blocks(&self, bytes_per_block: usize, world_size: usize) -> usize {
        tier_blocks(self.inner.host, bytes_per_block, world_size)
    }

    /// Disk blocks for one of `world_size` ranks.
    #[pyo3(signature = (bytes_per_block, world_size=1))]
    fn disk_blocks(&self, bytes_per_block: usize, world_size: usize) -> usize {
        tier_blocks(self.inner.disk, bytes_per_block, world_size)
    }

    /// Blocks per transfer batch (`DYN_KVBM_MAX_TRANSFER_BATCH_SIZE`).
    #[getter]
    fn max_transfer_batch_size(&self) -> usize {
        self.inner.transfer_batch_blocks_max.get()
    }

    /// Transfer batches in flight (`DYN_KVBM_MAX_CONCURRENT_TRANSFERS`).
    #[getter]
    fn max_concurrent_transfers(&self) -> usize {
        self.inner.transfers_inflight_max.get()
    }

    /// The Prometheus port when `DYN_KVBM_METRICS` is on, else None.
    #[getter]
    fn metrics_port(&self) -> Option<u16> {
        self.inner.metrics_port
    }

    /// The address the metrics server binds (`DYN_KVBM_METRICS_HOST`).
    #[getter]
    fn metrics_host(&self) -> String {
        self.inner.metrics_host.to_string()
    }

    /// The log filter (`DYN_LOG`).
    #[getter]
    fn log_filter(&self) -> String {
        self.inner.log_filter.clone()
    }

    /// The disk cache directory.
    #[getter]
    fn disk_dir(&self) -> String {
        self.inner.disk_dir.display().to_string()
    }

    /// Whether every host block goes to disk (`DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER`).
    #[getter]
    fn disk_offload_filter_disabled(&self) -> bool {
        self.inner.disk_offload_filter_disabled
    }

    /// Buffered disk I/O instead of O_DIRECT (`DYN_KVBM_DISK_DISABLE_O_DIRECT`).
    #[getter]
    fn disk_disable_o_direct(&self) -> bool {
        self.inner.disk_disable_o_direct
    }

    /// The disk I/O engine (`KVBM_DISK_ENGINE`): "auto", "io_uring" or "psync".
    #[getter]
    fn disk_engine(&self) -> &'static str {
        match self.inner.disk_engine {
            kvbm_core::EngineChoice::Auto => "auto",
            kvbm_core::EngineChoice::IoUring => "io_uring",
            kvbm_core::EngineChoice::Psync => "psync",
        }
    }

    /// Whether a shared tier's server is configured (`DYN_KVBM_SHARED_URL`).
    #[getter]
    fn shared_url_set(&self) -> bool {
        self.inner.shared.is_some()
    }

    /// Where KV events are published over ZMQ, if anywhere.
    #[getter]
    fn kv_events_endpoint(&self) -> Option<String> {
        self.inner.kv_events_endpoint.clone()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

/// The shared tier's options for a leader or worker (`who`), when `config` names a server
/// (`DYN_KVBM_SHARED_URL`): None without one, or for a hybrid model (not supported by the
/// shared tier yet: it runs without it, and the connector warns). The keys name `model_fingerprint`, which both
/// the scheduler and every worker derive from vLLM's config; without it the tier is refused
/// (a `ConfigError`), since blocks of two models must never share keys.
pub(crate) fn shared_tier(
    config: Option<&KvbmConfig>,
    model_fingerprint: u64,
    hybrid: bool,
    who: &str,
) -> PyResult<Option<kvbm_core::shared::SharedOptions>> {
    let Some(options) = config.and_then(|c| c.shared.clone()) else {
        return Ok(None);
    };
    if hybrid {
        // The Python side warns (kvbm.vllm_integration.connector).
        return Ok(None);
    }
    if model_fingerprint == 0 {
        return Err(crate::ConfigError::new_err(format!(
            "DYN_KVBM_SHARED_URL is set, but this {who} was given no model fingerprint \
             (model_fingerprint=...): the shared tier's keys must name the model"
        )));
    }
    Ok(Some(options))
}

/// Where to serve the metrics, from the environment (or `overrides`): (host, port), or None when
/// `DYN_KVBM_METRICS` is off. Readable without a cache tier configured; a bad value raises
/// `ConfigError` naming the variable.
#[pyfunction]
#[pyo3(signature = (overrides=None))]
pub(crate) fn metrics_server(
    overrides: Option<HashMap<String, String>>,
) -> PyResult<Option<(String, u16)>> {
    guard(|| {
        let overrides = overrides.unwrap_or_default();
        kvbm_core::config::metrics_server(&|name: &str| {
            overrides
                .get(name)
                .cloned()
                .or_else(|| std::env::var(name).ok())
        })
        .map(|s| s.map(|(host, port)| (host.to_string(), port)))
        .map_err(|e| ConfigError::new_err(e.to_string()))
    })
}
