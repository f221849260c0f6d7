//! `kvbm._kvbm`: the native half of the `kvbm` Python package.
//!
//! - [`Config`]: kvbm's configuration from the environment (Dynamo KVBM's variable names) or
//!   keyword overrides; errors name the variable and the value.
//! - [`sequence_hashes`]: the block identity shared with the router and Dynamo.
//! - [`Leader`]: the scheduler side's logical state: the host tier's pool of block ids, its
//!   registry and eviction, and the event stream.
//! - [`Worker`]: a GPU worker's bytes: the registered KV cache tensors, its shard of the pinned
//!   host pool, and the copy streams.
//!
//! Every Rust error becomes one of a few exception classes carrying the Rust message; a panic
//! is caught at the boundary and raised as `KvbmError`; copies and waits release the GIL.

#![deny(unsafe_code)]

mod config;
mod leader;
mod worker;

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kvbm_core::BlockHasher;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    _kvbm,
    KvbmError,
    PyException,
    "Base class of kvbm's errors."
);
pyo3::create_exception!(
    _kvbm,
    ConfigError,
    KvbmError,
    "A configuration value (environment variable or keyword) is invalid; the message names it."
);
pyo3::create_exception!(
    _kvbm,
    DeviceError,
    KvbmError,
    "The device layer failed: no driver, an allocation, a copy."
);
pyo3::create_exception!(
    _kvbm,
    DiskError,
    KvbmError,
    "The disk tier failed: its directory, its cache file, an I/O."
);
pyo3::create_exception!(
    _kvbm,
    LayoutError,
    KvbmError,
    "KV cache tensors or block ids that do not fit the layout."
);

fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// Runs `f`, turning a panic into `KvbmError` so that none crosses into Python.
/// The one mapping from kvbm-core's typed errors to the Python exceptions: configuration (and a
/// shared tier that cannot be set up as configured) -> `ConfigError`, layouts and bad arguments -> `LayoutError`, the device -> `DeviceError`, the
/// disk tier -> `DiskError`, anything else (a busy or exhausted pool, a failed transfer) ->
/// `KvbmError`.
pub(crate) fn core_err(e: kvbm_core::CoreError) -> PyErr {
    use kvbm_core::CoreError as E;
    let text = e.to_string();
    match e {
        E::Config(_) | E::Shared(_) => ConfigError::new_err(text),
        E::InvalidLayout(_) | E::InvalidArgument(_) => LayoutError::new_err(text),
        E::Device(_) => DeviceError::new_err(text),
        E::Disk(_) => DiskError::new_err(text),
        E::Exhausted { .. } | E::TransferFailed(_) | E::Busy(_) | E::EngineClosed => {
            KvbmError::new_err(text)
        }
    }
}

pub(crate) fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => Err(KvbmError::new_err(format!(
            "internal error in kvbm (please report it): {}",
            panic_message(payload.as_ref())
        ))),
    }
}

thread_local! {
    /// The locks (their addresses) of Leaders and Workers this thread holds now.
    static HELD: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A guard of a Leader's or Worker's lock that marks the lock held by this thread until it is
/// dropped, so that a call from this thread meanwhile (Python code run under the lock: a
/// finalizer, a callback) raises instead of waiting forever on itself.
pub(crate) struct Held<G> {
    guard: G,
    key: usize,
}

impl<G> Drop for Held<G> {
    fn drop(&mut self) {
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(at) = held.iter().rposition(|&k| k == self.key) {
                held.swap_remove(at);
            }
        });
    }
}

impl<G: std::ops::Deref> std::ops::Deref for Held<G> {
    type Target = G::Target;
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: std::ops::DerefMut> std::ops::DerefMut for Held<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

/// Refuses a call on the thread that holds the lock at `key` already: waiting would never end.
fn not_held_here(key: usize) -> PyResult<()> {
    if HELD.with(|held| held.borrow().contains(&key)) {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(
            "re-entrant call into a kvbm Leader or Worker from the thread inside a call on it \
             (from Python code run meanwhile, such as a finalizer); call it once that call \
             has returned",
        ));
    }
    Ok(())
}

/// Takes the lock at `key` with `try_now`, else waiting without the GIL with `wait` (so that
/// the holder, which may need the GIL to finish, is never blocked by the waiter), then trying
/// again with the GIL held. A call on the thread that holds it raises `RuntimeError`.
fn take<G>(
    py: Python<'_>,
    key: usize,
    mut try_now: impl FnMut() -> Option<G>,
    wait: impl Fn() + Send + Sync,
) -> PyResult<Held<G>> {
    not_held_here(key)?;
    loop {
        if let Some(guard) = try_now() {
            HELD.with(|held| held.borrow_mut().push(key));
            return Ok(Held { guard, key });
        }
        py.allow_threads(&wait);
    }
}

/// Locks `mutex` for a call from Python; calls from several Python threads on one object are
/// thereby serialized instead of failing PyO3's borrow check. No Python object is made or
/// dropped under it; should Python code still run under it and call back from this thread, that
/// call raises `RuntimeError` ("re-entrant call").
pub(crate) fn lock_serialized<'a, T: Send>(
    py: Python<'_>,
    mutex: &'a parking_lot::Mutex<T>,
) -> PyResult<Held<parking_lot::MutexGuard<'a, T>>> {
    let key = mutex as *const _ as usize;
    take(py, key, || mutex.try_lock(), || drop(mutex.lock()))
}

/// As [`lock_serialized`], shared (several readers at once).
pub(crate) fn read_serialized<'a, T: Send + Sync>(
    py: Python<'_>,
    lock: &'a parking_lot::RwLock<T>,
) -> PyResult<Held<parking_lot::RwLockReadGuard<'a, T>>> {
    let key = lock as *const _ as usize;
    take(py, key, || lock.try_read(), || drop(lock.read()))
}

/// As [`lock_serialized`], exclusive.
pub(crate) fn write_serialized<'a, T: Send + Sync>(
    py: Python<'_>,
    lock: &'a parking_lot::RwLock<T>,
) -> PyResult<Held<parking_lot::RwLockWriteGuard<'a, T>>> {
    let key = lock as *const _ as usize;
    take(py, key, || lock.try_write(), || drop(lock.write()))
}

/// Refuses a size argument above `max` with a `ValueError` naming it and its value.
pub(crate) fn check_size(name: &str, value: usize, max: usize, why: &str) -> PyResult<()> {
    if value > max {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{name}={value}: at most {max} ({why})"
        )));
    }
    Ok(())
}

/// The longest timeout a wait takes, in seconds (a day): longer ones are refused.
pub(crate) const TIMEOUT_S_MAX: f64 = 86_400.0;

/// A timeout in seconds from Python: finite, not negative, at most [`TIMEOUT_S_MAX`]; anything
/// else (NaN, infinities, negative or huge values) is a `ValueError` naming `name`.
pub(crate) fn timeout_of(name: &str, seconds: f64) -> PyResult<std::time::Duration> {
    if !(0.0..=TIMEOUT_S_MAX).contains(&seconds) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{name}={seconds}: must be a number of seconds from 0 to {TIMEOUT_S_MAX}"
        )));
    }
    Ok(std::time::Duration::from_secs_f64(seconds))
}

/// Sequence hashes of every full block of `tokens` (a partial tail is ignored), continuing from
/// `parent` (the sequence hash of the block before `tokens[0]`). `lora_name` and `cache_salt`
/// seed the hash as Dynamo's router does.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, lora_name=None, cache_salt=None, parent=None))]
fn sequence_hashes(
    py: Python<'_>,
    tokens: Vec<u32>,
    block_size: usize,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
    parent: Option<u64>,
) -> PyResult<Vec<u64>> {
    guard(|| {
        if block_size == 0 {
            return Err(LayoutError::new_err("block_size must be at least 1"));
        }
        check_size(
            "block_size",
            block_size,
            kvbm_core::leader::BLOCK_SIZE_MAX,
            "tokens per block",
        )?;
        let hasher = BlockHasher::new(block_size, lora_name, cache_salt);
        Ok(py.allow_threads(|| {
            hasher
                .sequence_hashes(parent.map(kvbm_core::SequenceHash), &tokens)
                .into_iter()
                .map(|h| h.0)
                .collect()
        }))
    })
}

/// Installs kvbm's log output (stderr) with a tracing filter such as "info" or
/// "kvbm_core=debug" (the syntax of `DYN_LOG`). A second call changes nothing.
#[pyfunction]
fn init_logging(filter: &str) -> PyResult<()> {
    guard(|| {
        let filter = tracing_subscriber::EnvFilter::try_new(filter)
            .map_err(|e| ConfigError::new_err(format!("DYN_LOG={filter:?}: {e}")))?;
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
        Ok(())
    })
}

/// The KV cache layout the connector asks vLLM for: `KVBM_KV_CACHE_LAYOUT` (default "BLNHC"),
/// or None for `auto`. Raises `ConfigError` naming the variable and the value.
#[pyfunction]
#[pyo3(signature = (overrides=None))]
fn required_kv_cache_layout(
    overrides: Option<std::collections::HashMap<String, String>>,
) -> PyResult<Option<&'static str>> {
    guard(|| {
        let overrides = overrides.unwrap_or_default();
        kvbm_core::config::kv_cache_layout(|name| {
            overrides
                .get(name)
                .cloned()
                .or_else(|| std::env::var(name).ok())
        })
        .map(|layout| layout.map(|l| l.name()))
        .map_err(|e| ConfigError::new_err(e.to_string()))
    })
}

/// The device back end `auto` picks on this machine: "cuda" or "emulated".
#[pyfunction]
fn device_kind() -> PyResult<String> {
    guard(|| {
        kvbm_core::default_device_kind()
            .map(str::to_owned)
            .map_err(core_err)
    })
}

/// A worker's kvbm-core counters under Dynamo KVBM's metric names (the copies it made).
pub(crate) fn worker_metrics<'py>(
    py: Python<'py>,
    m: &kvbm_core::MetricsSnapshot,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("kvbm_offload_blocks_d2h", m.offload_blocks_d2h)?;
    d.set_item("kvbm_offload_blocks_h2d", m.offload_blocks_h2d)?;
    d.set_item("kvbm_onboard_blocks_h2d", m.onboard_blocks_h2d)?;
    d.set_item("kvbm_onboard_blocks_d2d", m.onboard_blocks_d2d)?;
    d.set_item("kvbm_offload_bytes_d2h", m.bytes_d2h)?;
    d.set_item("kvbm_onboard_bytes_h2d", m.bytes_h2d)?;
    d.set_item("kvbm_disk_read_blocks", m.disk_read_blocks)?;
    d.set_item("kvbm_disk_read_misses", m.disk_read_misses)?;
    d.set_item("kvbm_offload_skipped_blocks", m.offload_skipped_blocks)?;
    d.set_item("kvbm_transfer_errors", m.transfer_errors)?;
    d.set_item("kvbm_disk_write_failures", m.disk_write_failures)?;
    d.set_item("kvbm_load_errors", m.load_errors)?;
    d.set_item("kvbm_shared_read_blocks", m.shared_read_blocks)?;
    d.set_item("kvbm_shared_read_misses", m.shared_read_misses)?;
    d.set_item("kvbm_shared_write_blocks", m.shared_write_blocks)?;
    Ok(d)
}

/// The leader's kvbm-core counters under Dynamo KVBM's metric names (what it matched).
pub(crate) fn leader_metrics<'py>(
    py: Python<'py>,
    m: &kvbm_core::MetricsSnapshot,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("kvbm_matched_tokens", m.matched_tokens)?;
    d.set_item("kvbm_host_cache_hit_rate", m.host_cache_hit_rate)?;
    d.set_item("kvbm_disk_cache_hit_rate", m.disk_cache_hit_rate)?;
    d.set_item("kvbm_shared_cache_hit_rate", m.shared_cache_hit_rate)?;
    Ok(d)
}

#[pymodule]
fn _kvbm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvbmError", py.get_type::<KvbmError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("DiskError", py.get_type::<DiskError>())?;
    m.add_function(wrap_pyfunction!(sequence_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(device_kind, m)?)?;
    m.add_function(wrap_pyfunction!(required_kv_cache_layout, m)?)?;
    m.add_function(wrap_pyfunction!(worker::describe_kv_caches, m)?)?;
    m.add_function(wrap_pyfunction!(worker::encode_plan, m)?)?;
    m.add_function(wrap_pyfunction!(worker::decode_plan, m)?)?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add_function(wrap_pyfunction!(config::metrics_server, m)?)?;
    m.add_class::<config::Config>()?;
    m.add_class::<leader::Leader>()?;
    m.add_class::<worker::Worker>()?;
    m.add_class::<worker::CopyHold>()?;
    Ok(())
}
