//! `Worker`: the Python face of kvbm-core's worker (the physical half of the split engine).
//! Conversions only: it reads each tensor's view from the tensor itself, has core check it
//! against the tensor's storage, and forwards plans (bytes) and calls to
//! [`kvbm_core::Worker`], releasing the GIL around everything that may wait.
//!
//! Invariants:
//! - The worker keeps a reference to every registered tensor, so their memory outlives every
//!   copy (the one `unsafe` call, `register_spans`, relies on it); the core worker is dropped
//!   (and its copies finished) before the tensors.

use std::time::Duration;

use kvbm_core::layout::{BlockLayout, KvLayout, TensorView};
use kvbm_core::plan::{AsyncOnboard, DiskRead, DiskWrite, StepPlan};
use kvbm_core::worker::OffloadFence;
use kvbm_core::{check_view_within, DiskOptions, Metrics, TransferLimits, WorkerOptions};
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::{check_size, core_err, guard, LayoutError};
use pyo3::exceptions::PyValueError;

/// Most asynchronous onboards a worker runs at once (`async_onboards_max`).
pub const ASYNC_ONBOARDS_MAX: usize = 1024;

/// Reads one tensor's view (`data_ptr()`, `shape`, `stride()`, `element_size()`) and has core
/// check that every byte it addresses lies inside the memory it owns (`untyped_storage()`:
/// `data_ptr()` and `nbytes()`), so that no address or size crosses from Python unchecked.
fn view_of(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<TensorView> {
    let bad = |what: &str, e: PyErr| {
        LayoutError::new_err(format!("KV cache tensor {name:?}: {what}: {e}"))
    };
    let addr: u64 = tensor
        .call_method0("data_ptr")
        .and_then(|v| v.extract())
        .map_err(|e| bad("data_ptr()", e))?;
    let shape: Vec<usize> = tensor
        .getattr("shape")
        .and_then(|v| v.extract())
        .map_err(|e| bad("shape", e))?;
    let strides: Vec<usize> = tensor
        .call_method0("stride")
        .and_then(|v| v.extract())
        .map_err(|e| bad("stride() (negative strides are not supported)", e))?;
    let elem_bytes: usize = tensor
        .call_method0("element_size")
        .and_then(|v| v.extract())
        .map_err(|e| bad("element_size()", e))?;
    let storage = tensor.call_method0("untyped_storage").map_err(|e| {
        bad(
            "untyped_storage() (kvbm checks each tensor against its memory)",
            e,
        )
    })?;
    let base: u64 = storage
        .call_method0("data_ptr")
        .and_then(|v| v.extract())
        .map_err(|e| bad("untyped_storage().data_ptr()", e))?;
    let nbytes: u64 = storage
        .call_method0("nbytes")
        .and_then(|v| v.extract())
        .map_err(|e| bad("untyped_storage().nbytes()", e))?;
    let view = TensorView {
        name: name.to_owned(),
        addr,
        shape,
        strides,
        elem_bytes,
    };
    check_view_within(&view, base, nbytes).map_err(core_err)?;
    Ok(view)
}

/// Refuses a tensor whose memory kvbm must not write or copy, as far as the tensor says through
/// the standard interfaces (on itself and on its storage): the buffer protocol (read-only
/// buffers, `bytes`), `__array_interface__` / `__cuda_array_interface__` (the read-only flag,
/// object type codes), and a `dtype` holding Python objects (numpy's `hasobject`): kvbm would
/// copy object pointers without their reference counts. torch tensors expose none of these
/// flags and are writable.
fn check_plain_writable(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<()> {
    let refuse = |why: String| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "KV cache tensor {name:?}: {why}; kvbm loads blocks into the KV caches, which must \
             be writable memory of plain (numeric) elements"
        ))
    };
    let storage = tensor.call_method0("untyped_storage").ok();
    let mut objects = vec![("the tensor", tensor.clone())];
    if let Some(storage) = storage {
        objects.push(("its storage", storage));
    }
    for (what, obj) in objects {
        if let Ok(dtype) = obj.getattr("dtype") {
            if dtype
                .getattr("hasobject")
                .and_then(|v| v.extract::<bool>())
                .unwrap_or(false)
            {
                return Err(refuse(format!(
                    "{what} has dtype {dtype}, which holds Python objects"
                )));
            }
        }
        if obj.is_instance_of::<PyBytes>() {
            return Err(refuse(format!("{what} is an immutable bytes object")));
        }
        if let Ok(view) = pyo3::types::PyMemoryView::from(&obj) {
            if view.getattr("readonly")?.extract::<bool>()? {
                return Err(refuse(format!("{what} is a read-only buffer")));
            }
        }
        for interface in ["__array_interface__", "__cuda_array_interface__"] {
            let Ok(desc) = obj.getattr(interface) else {
                continue;
            };
            let Ok(desc) = desc.downcast_into::<PyDict>() else {
                continue;
            };
            if let Some(data) = desc.get_item("data")? {
                let readonly = data
                    .get_item(1)
                    .and_then(|v| v.extract::<bool>())
                    .unwrap_or(false);
                if readonly {
                    return Err(refuse(format!("{what} is read-only ({interface})")));
                }
            }
            if let Some(typestr) = desc.get_item("typestr")? {
                if typestr.extract::<String>().is_ok_and(|t| t.contains('O')) {
                    return Err(refuse(format!(
                        "{what} holds Python objects ({interface} typestr {typestr})"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Refuses tensors (of host memory, on the emulated device) whose bytes lie outside this
/// process's writable mappings: a load into them would fault. `spans` holds each tensor's name
/// and the bytes it addresses; `/proc/self/maps` is read once for all of them.
fn check_writable(spans: &[(String, u64, usize)]) -> PyResult<()> {
    let ranges: Vec<(u64, u64)> = spans.iter().map(|(_, a, l)| (*a, *l as u64)).collect();
    if let Some(i) = kvbm_core::first_unwritable_range(&ranges).map_err(core_err)? {
        let (name, addr, len) = &spans[i];
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "KV cache tensor {i} ({name:?}, {len} bytes at {addr:#x}) is not writable memory; \
             kvbm loads blocks into the KV caches"
        )));
    }
    Ok(())
}

/// The views of `kv_caches` (layer name -> tensor), in order, each checked by `view_of`.
fn views_of(
    kv_caches: &Bound<'_, PyDict>,
) -> PyResult<(Vec<PyObject>, Vec<TensorView>, Vec<String>)> {
    let mut tensors = Vec::with_capacity(kv_caches.len());
    let mut views = Vec::with_capacity(kv_caches.len());
    let mut names = Vec::with_capacity(kv_caches.len());
    for (name, tensor) in kv_caches.iter() {
        let name = name.str()?.to_string();
        views.push(view_of(&name, &tensor)?);
        check_plain_writable(&name, &tensor)?;
        tensors.push(tensor.unbind());
        names.push(name);
    }
    Ok((tensors, views, names))
}

/// Each tensor's name and the bytes it addresses (address, length).
fn named_spans(views: &[TensorView], names: Vec<String>) -> Vec<(String, u64, usize)> {
    views
        .iter()
        .zip(names)
        .filter_map(|(v, name)| v.span().map(|(a, l)| (name, a, l)))
        .collect()
}

/// How kvbm addresses `kv_caches` (layer name -> tensor, as for `Worker`): a dict with `layout`
/// (vLLM's name, or "per-layer tensors"), `runs_per_block`, `bytes_per_block`, `layers`
/// (distinct layer pages) and `block_size`. Raises `LayoutError` naming the tensor, its shape
/// and strides when the layout cannot be addressed or a tensor reaches outside its storage.
#[pyfunction]
pub(crate) fn describe_kv_caches<'py>(
    py: Python<'py>,
    kv_caches: &Bound<'py, PyDict>,
    num_blocks: usize,
) -> PyResult<Bound<'py, PyDict>> {
    guard(|| {
        let (_, views, _) = views_of(kv_caches)?;
        let placed = BlockLayout::from_views(&views, num_blocks).map_err(core_err)?;
        let d = PyDict::new(py);
        d.set_item(
            "layout",
            placed.physical.map_or("per-layer tensors", |p| p.name()),
        )?;
        d.set_item("runs_per_block", placed.layout.runs_per_block())?;
        d.set_item("bytes_per_block", placed.kv.bytes_per_block())?;
        d.set_item("host_block_bytes", placed.kv.host_stride_bytes())?;
        d.set_item("disk_slot_bytes", kvbm_core::disk::slot_bytes(&placed.kv))?;
        d.set_item("layers", placed.kv.num_layers)?;
        d.set_item("block_size", placed.kv.block_size_tokens)?;
        Ok(d)
    })
}

/// A step report as Python sees it (see `Worker.report`).
type ReportTuple = (Vec<String>, Vec<String>, Vec<u32>, Vec<u32>, Vec<u32>);

/// One disk write as Python passes it: (host, disk, key, identity bytes).
type DiskWriteTuple = (u32, u32, u64, Vec<u8>);

/// A GPU worker's side of kvbm: kvbm-core's worker over vLLM's tensors. Calls from several
/// threads are serialized: those that change the worker wait, without the GIL, for every other
/// call; those that only read or wait run beside each other.
#[pyclass(module = "kvbm._kvbm", frozen)]
#[derive(Debug)]
pub struct Worker {
    state: RwLock<WorkerState>,
}

struct WorkerState {
    /// Declared before `tensors`; taken and dropped (its copies finished, its threads joined)
    /// first, without the GIL, in `Drop`.
    inner: Option<kvbm_core::Worker>,
    tensors: Vec<PyObject>,
    /// vLLM's layout name the tensors follow ("BLNHC", ...), or "per-layer tensors".
    layout_name: String,
    device_index: usize,
    outer_dim: Option<usize>,
}

type GpuSide = (
    Vec<PyObject>,
    kvbm_core::layout::ViewsLayout,
    KvLayout,
    BlockLayout,
    String,
    Vec<(String, u64, usize)>,
);

/// The KV caches' GPU side: the tensors (kept alive), where each block's runs lie, the KV
/// layout (with `outer_dim` when the cache spec says K and V share the content axis) and the
/// layout's vLLM name.
fn gpu_side(
    kv_caches: &Bound<'_, PyDict>,
    num_blocks: usize,
    outer_dim: Option<usize>,
) -> PyResult<GpuSide> {
    let (tensors, views, names) = views_of(kv_caches)?;
    let spans = named_spans(&views, names);
    if views.is_empty() {
        return Err(LayoutError::new_err("no KV cache tensor to register"));
    }
    let placed = BlockLayout::from_views(&views, num_blocks).map_err(core_err)?;
    let mut kv = placed.kv;
    let mut gpu = placed.layout.clone();
    // A hybrid model's views (attention pages and 1-byte Mamba states) may be described as
    // their bytes (slots holding states only): the hint then describes nothing and is dropped.
    let mixed = views.iter().any(|v| v.elem_bytes != views[0].elem_bytes);
    let total = kv.outer_dim * kv.inner_dim;
    let outer_dim = outer_dim.filter(|&o| !(mixed && o > 0 && total % o != 0));
    if let Some(outer) = outer_dim.filter(|&o| o != kv.outer_dim) {
        if outer == 0 || total % outer != 0 {
            return Err(LayoutError::new_err(format!(
                "outer_dim {outer} does not divide the {total} elements per token"
            )));
        }
        kv = KvLayout::new(
            kv.num_layers,
            outer,
            kv.block_size_tokens,
            total / outer,
            kv.dtype_bytes,
        )
        .map_err(core_err)?;
        gpu = gpu.with_kv(kv).map_err(core_err)?;
    }
    let layout_name = placed
        .physical
        .map_or_else(|| "per-layer tensors".to_owned(), |p| p.name().to_owned());
    Ok((tensors, placed, kv, gpu, layout_name, spans))
}

impl std::fmt::Debug for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("inner", &self.inner)
            .field("layout", &self.layout_name)
            .finish()
    }
}

#[pymethods]
impl Worker {
    /// Registers vLLM's KV cache tensors and maps a pinned host pool of `host_blocks` blocks.
    ///
    /// `kv_caches` maps layer names to tensors (torch tensors, or anything with `data_ptr()`,
    /// `shape`, `stride()`, `element_size()` and `untyped_storage()`); every tensor is checked
    /// against its storage before any byte is addressed. Any layout vLLM hands over works: 0.33's
    /// `[B, H, N, C]` views of one buffer in every `KVCacheLayout`, MLA, the older 5-D tensors;
    /// each block's runs come from the strides. `num_blocks` is vLLM's block count (a view with
    /// a multiple of it holds kernel blocks). `outer_dim` (2 for K and V, 1 for MLA) names what
    /// the content axis holds, for the KV shape; the bytes moved do not depend on it. A layout
    /// that cannot be addressed raises `LayoutError` naming the tensor, its shape and strides.
    /// A tensor kvbm must not write raises `TypeError`: read-only or immutable memory (as the
    /// buffer protocol or `__array_interface__` says, or, on the emulated device, outside the
    /// process's writable mappings) or elements holding Python objects. Sizes that do not fit
    /// (`host_blocks` beyond the machine's memory, `disk_blocks` beyond 32-bit ids,
    /// `async_onboards_max`, `batch_blocks_max`, `inflight_max` beyond their bounds) raise
    /// `ValueError` naming the argument.
    ///
    /// With `disk_blocks` above 0 the worker opens its disk cache file `disk_file` in `disk_dir`
    /// (created 0700, the file 0600; one file per rank, locked while open). The connector's disk
    /// tier starts empty: what an earlier run left there is overwritten as slots are reused.
    /// With `config` (a `Config`), the copy engine's limits and copy options
    /// (`DYN_KVBM_MAX_TRANSFER_BATCH_SIZE`, `DYN_KVBM_MAX_CONCURRENT_TRANSFERS`,
    /// `KVBM_COPY_*`) and the disk tier's directory, I/O mode and engine come from it (keywords
    /// given here win); `async_onboards_max` asynchronous onboards run at once. `layout_salt`
    /// (a hybrid model's KV cache groups: kinds and layers) joins the disk file's layout
    /// fingerprint, so a file written under another grouping is discarded on open.
    #[new]
    #[pyo3(signature = (kv_caches, num_blocks, host_blocks, *, config=None, outer_dim=None, device="auto", device_index=0, disk_blocks=0, disk_dir=None, disk_file=None, disk_disable_o_direct=None, disk_engine=None, batch_blocks_max=None, inflight_max=None, async_onboards_max=4, layout_salt=0, model_fingerprint=0, rank=0, world_size=1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kv_caches: &Bound<'_, PyDict>,
        num_blocks: usize,
        host_blocks: usize,
        config: Option<PyRef<'_, crate::config::Config>>,
        outer_dim: Option<usize>,
        device: &str,
        device_index: usize,
        disk_blocks: usize,
        disk_dir: Option<String>,
        disk_file: Option<String>,
        disk_disable_o_direct: Option<bool>,
        disk_engine: Option<&str>,
        batch_blocks_max: Option<usize>,
        inflight_max: Option<usize>,
        async_onboards_max: usize,
        layout_salt: u64,
        model_fingerprint: u64,
        rank: usize,
        world_size: usize,
    ) -> PyResult<Self> {
        guard(|| {
            if num_blocks == 0 || host_blocks == 0 {
                return Err(LayoutError::new_err(format!(
                    "{num_blocks} GPU blocks and {host_blocks} host blocks: both must be above 0"
                )));
            }
            check_size(
                "async_onboards_max",
                async_onboards_max,
                ASYNC_ONBOARDS_MAX,
                "asynchronous onboards at once",
            )?;
            check_size(
                "batch_blocks_max",
                batch_blocks_max.unwrap_or(0),
                kvbm_core::config::TRANSFER_BATCH_BLOCKS_MAX,
                "as DYN_KVBM_MAX_TRANSFER_BATCH_SIZE",
            )?;
            check_size(
                "inflight_max",
                inflight_max.unwrap_or(0),
                kvbm_core::config::CONCURRENT_TRANSFERS_MAX,
                "as DYN_KVBM_MAX_CONCURRENT_TRANSFERS",
            )?;
            check_size(
                "disk_blocks",
                disk_blocks,
                u32::MAX as usize - 1,
                "block ids are 32-bit",
            )?;
            let (tensors, placed, kv, gpu, layout_name, spans) =
                gpu_side(kv_caches, num_blocks, outer_dim)?;
            // The pinned host pool must fit this machine's memory.
            let memory = kvbm_core::config::machine_memory_bytes();
            let host_bytes = (host_blocks as u64).saturating_mul(kv.host_stride_bytes() as u64);
            if host_blocks >= u32::MAX as usize {
                return Err(PyValueError::new_err(format!(
                    "host_blocks={host_blocks}: at most {} blocks (block ids are 32-bit)",
                    u32::MAX - 1
                )));
            }
            if host_bytes > memory {
                return Err(PyValueError::new_err(format!(
                    "host_blocks={host_blocks}: {host_blocks} host blocks of {} bytes do not fit \
                     this machine's memory ({memory} bytes)",
                    kv.host_stride_bytes()
                )));
            }
            let dev = kvbm_core::open_device(device, device_index).map_err(core_err)?;
            if dev.kind() == kvbm_core::DeviceKind::Emulated {
                check_writable(&spans)?;
            }
            #[allow(unsafe_code)]
            // SAFETY: each span is the memory one or more of `tensors` address with their
            // shapes and strides (computed from them by `from_views`), and `view_of` had core
            // check that each tensor's addresses lie inside its own storage; this object keeps a
            // reference to every tensor, and drops the core worker (finishing its copies) first.
            let regions =
                unsafe { kvbm_core::Worker::register_spans(&dev, &placed.spans, device_index) }
                    .map_err(core_err)?;
            let config = config.map(|c| c.inner.clone());
            let mut limits = TransferLimits::default();
            if let Some(c) = &config {
                limits.batch_blocks_max = c.transfer_batch_blocks_max.get();
                limits.inflight_max = c.transfers_inflight_max.get();
                limits.copy = c.copy;
            }
            limits.batch_blocks_max = batch_blocks_max.unwrap_or(limits.batch_blocks_max);
            limits.inflight_max = inflight_max.unwrap_or(limits.inflight_max);
            let disk = if disk_blocks > 0 {
                let dir = match (disk_dir, &config) {
                    (Some(d), _) => d.into(),
                    (None, Some(c)) => c.disk_dir.clone(),
                    (None, None) => kvbm_core::config::default_disk_dir(),
                };
                let engine = match (disk_engine, &config) {
                    (Some(e), _) => e
                        .parse::<kvbm_core::EngineChoice>()
                        .map_err(|e| crate::DiskError::new_err(e.to_string()))?,
                    (None, Some(c)) => c.disk_engine,
                    (None, None) => kvbm_core::EngineChoice::Auto,
                };
                Some(DiskOptions {
                    dir,
                    file_name: disk_file
                        .unwrap_or_else(|| format!("kvbm-rank{device_index}.cache")),
                    blocks: disk_blocks,
                    disable_o_direct: disk_disable_o_direct
                        .or(config.as_ref().map(|c| c.disk_disable_o_direct))
                        .unwrap_or(false),
                    filter_disabled: false,
                    queue_depth: 16,
                    engine,
                    layout_salt,
                })
            } else {
                None
            };
            let shared = crate::config::shared_tier(
                config.as_ref(),
                model_fingerprint,
                layout_salt != 0,
                "worker",
            )?
            .map(|options| kvbm_core::SharedWorkerOptions {
                options,
                key_fingerprint: kvbm_core::shared::shard_fingerprint(
                    model_fingerprint,
                    rank,
                    world_size.max(1),
                ),
            });
            let options = WorkerOptions {
                host_blocks,
                limits,
                async_onboards_max,
                disk,
                host_ready_timeout: Duration::from_secs(300),
                shared,
                ..WorkerOptions::default()
            };
            let metrics = std::sync::Arc::new(Metrics::default());
            let inner = py
                .allow_threads(|| kvbm_core::Worker::new(dev, kv, gpu, regions, options, metrics))
                .map_err(core_err)?;
            Ok(Self {
                state: RwLock::new(WorkerState {
                    inner: Some(inner),
                    tensors,
                    layout_name,
                    device_index,
                    outer_dim,
                }),
            })
        })
    }

    /// vLLM's name of the layout the tensors follow ("BLNHC", ...), or "per-layer tensors".
    #[getter]
    fn layout_name(&self, py: Python<'_>) -> PyResult<String> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.layout_name.clone())
    }

    /// Contiguous runs per block on the GPU side: the copies (DMAs) one block takes.
    #[getter]
    fn runs_per_block(&self, py: Python<'_>) -> PyResult<usize> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().gpu_layout().runs_per_block())
    }

    /// Distinct layer pages per block (tensors addressing the same bytes count once).
    #[getter]
    fn distinct_layers(&self, py: Python<'_>) -> PyResult<usize> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().kv().num_layers)
    }

    /// Tensors (layers) registered.
    #[getter]
    fn num_layers(&self, py: Python<'_>) -> PyResult<usize> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().num_tensors())
    }

    /// GPU blocks per layer tensor.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().gpu_layout().num_blocks())
    }

    /// Host blocks of this worker's shard.
    #[getter]
    fn host_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().host_blocks())
    }

    /// Bytes of one block on this worker (all layers, K and V).
    #[getter]
    fn bytes_per_block(&self, py: Python<'_>) -> PyResult<usize> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().kv().bytes_per_block())
    }

    /// "cuda" or "emulated".
    #[getter]
    fn device_kind(&self, py: Python<'_>) -> PyResult<&'static str> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().device().kind().as_str())
    }

    /// Disk blocks of this worker's file (0 without a disk tier).
    #[getter]
    fn disk_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().disk_blocks())
    }

    // -- vLLM's step ------------------------------------------------------------------------

    /// Binds a step's plan (the leader's `take_plan` bytes); returns whether it offloads
    /// anything (the caller then syncs its compute stream before `start_offloads`).
    fn bind(&self, py: Python<'_>, plan: &[u8]) -> PyResult<bool> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let plan = StepPlan::from_bytes(plan).map_err(core_err)?;
            let offloads = !plan.offloads.is_empty();
            s.w_mut().bind(plan);
            Ok(offloads)
        })
    }

    /// Whether the bound plan loads anything into GPU blocks (onboards, asynchronous ones, or
    /// the disk reads that feed them): only then are the step's loads ordered after vLLM's
    /// stream.
    #[getter]
    fn plan_has_loads(&self, py: Python<'_>) -> PyResult<bool> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().plan().is_some_and(|p| {
            !p.onboards.is_empty() || !p.async_onboards.is_empty() || !p.disk_reads.is_empty()
        }))
    }

    /// Drops the bound plan.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        s.w_mut().clear();
        Ok(())
    }

    /// Waits for the offloads of the bound plan's preempted requests; returns how many offload
    /// jobs it waited for.
    fn handle_preemptions(&self, py: Python<'_>) -> PyResult<usize> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            Ok(py.allow_threads(|| inner.handle_preemptions()))
        })
    }

    /// Starts the bound plan's onboards (disk reads, synchronous and asynchronous onboards).
    fn start_onboards(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.start_onboards())
                .map_err(core_err)
        })
    }

    /// Starts the bound plan's offloads and queues its disk writes.
    fn start_offloads(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.start_offloads())
                .map_err(core_err)
        })
    }

    /// After `start_offloads` (vLLM's `wait_for_save`), when the bound plan sets
    /// `fence_offloads` (the step offloads blocks of a sliding-window or Mamba group, which
    /// vLLM may free and overwrite in the next step without telling the connector): keeps
    /// vLLM's later GPU work from running before the step's offloads read those blocks. With
    /// `stream` (vLLM's current CUDA stream) that stream waits for them on the device; on the
    /// emulated device, without a stream, or should the driver refuse, the host waits for the
    /// offloads here. Returns "device", "host", or "none" (no fence asked, or no offload).
    #[pyo3(signature = (stream=None))]
    fn fence_offloads(&self, py: Python<'_>, stream: Option<u64>) -> PyResult<&'static str> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            let fence = py.allow_threads(|| inner.fence_offloads(stream));
            Ok(match fence {
                OffloadFence::None => "none",
                OffloadFence::Device => "device",
                OffloadFence::Host => "host",
            })
        })
    }

    /// Requests whose asynchronous onboards finished with failed GPU blocks, as `report`
    /// reported them since the last call: a list of (request, failed GPU blocks). For a model
    /// of several KV cache groups, whose failures vLLM 0.33 takes per request only.
    fn take_failed_onboards(&self, py: Python<'_>) -> PyResult<Vec<(String, Vec<u32>)>> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| Ok(s.w_mut().take_failed_onboards()))
    }

    /// What finished since the last report: (finished requests whose offloads all completed,
    /// requests whose asynchronous onboards completed, GPU blocks whose onboards failed, host
    /// blocks and disk blocks that went bad, for the leader to drop).
    fn report(&self, py: Python<'_>, finished: Vec<String>) -> PyResult<ReportTuple> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let r = s.w_mut().report(&finished);
            Ok((
                r.finished_offloading,
                r.finished_onboarding,
                r.failed_blocks,
                r.bad_host_blocks,
                r.bad_disk_blocks,
            ))
        })
    }

    /// Orders this worker's later copies in `direction` (`"d2h"` for offloads, `"h2d"` for
    /// onboards) after everything queued so far on the CUDA stream `stream` (vLLM's current
    /// stream, `torch.cuda.current_stream().cuda_stream`), on the device; the host does not
    /// wait. Nothing to do on the emulated device.
    fn order_after_stream(&self, py: Python<'_>, direction: &str, stream: u64) -> PyResult<()> {
        let g = self.read(py)?;
        let s = &*g;
        guard(|| {
            let direction = direction_of(direction)?;
            s.w()
                .order_after_stream(direction, stream)
                .map_err(core_err)
        })
    }

    /// vLLM's sleep mode (`unregister_kv_caches`): waits for every copy touching the KV caches,
    /// then refuses any other until `restore`. Idempotent.
    fn suspend(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.suspend());
            Ok(())
        })
    }

    /// Whether the KV caches are unregistered (`suspend` without `restore` since).
    #[getter]
    fn suspended(&self, py: Python<'_>) -> PyResult<bool> {
        let g = self.read(py)?;
        let s = &*g;
        Ok(s.w().is_suspended())
    }

    /// vLLM's `restore_kv_caches`: registers the KV caches again (the same layout, possibly
    /// at other addresses). Only after `suspend`.
    fn restore(&self, py: Python<'_>, kv_caches: &Bound<'_, PyDict>) -> PyResult<()> {
        guard(|| {
            let suspended_error = || {
                LayoutError::new_err("restore: the KV caches are registered (call suspend first)")
            };
            // The tensors are read (Python code) without the lock held, then checked again.
            let (num_blocks, outer_dim) = {
                let s = self.read(py)?;
                if !s.w().is_suspended() {
                    return Err(suspended_error());
                }
                (s.w().gpu_layout().num_blocks(), s.outer_dim)
            };
            let (tensors, placed, kv, gpu, layout_name, spans) =
                gpu_side(kv_caches, num_blocks, outer_dim)?;
            let mut g = self.write(py)?;
            let s = &mut *g;
            if !s.w().is_suspended() {
                return Err(suspended_error());
            }
            if s.w().device().kind() == kvbm_core::DeviceKind::Emulated {
                check_writable(&spans)?;
            }
            let device_index = s.device_index;
            let inner = s.w_mut();
            #[allow(unsafe_code)]
            // SAFETY: as in `new`: the spans are the tensors' own memory, checked against their
            // storages; `tensors` replaces the kept references only once the core worker uses
            // the new regions, and the old regions saw no copy since `suspend`.
            let regions = unsafe {
                kvbm_core::Worker::register_spans(inner.device(), &placed.spans, device_index)
            }
            .map_err(core_err)?;
            py.allow_threads(|| inner.remap_gpu(kv, gpu, regions))
                .map_err(core_err)?;
            // The old tensors are dropped once the lock is released: dropping them may run
            // Python code (finalizers) that calls this worker.
            let old = std::mem::replace(&mut s.tensors, tensors);
            s.layout_name = layout_name;
            drop(g);
            drop(old);
            Ok(())
        })
    }

    /// What this rank's disk file held when it opened, as (disk block, key, identity bytes),
    /// for the leader's `adopt_disk` (once: later calls return nothing).
    fn take_recovered_disk(&self, py: Python<'_>) -> PyResult<Vec<(u32, u64, Vec<u8>)>> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| Ok(s.w_mut().take_recovered_disk()))
    }

    /// Waits for everything in flight.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.shutdown());
            Ok(())
        })
    }

    // -- the mechanisms, one at a time (tests, tools) ---------------------------------------

    /// Starts offloading GPU blocks into host blocks (`pairs` of (gpu, host)) on behalf of
    /// `requests`.
    fn offload(
        &self,
        py: Python<'_>,
        pairs: Vec<(u32, u32)>,
        requests: Vec<String>,
    ) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.offload(&pairs, &requests))
                .map_err(core_err)
        })
    }

    /// Waits for the offloads started on behalf of any of `requests`; returns how many offload
    /// jobs it waited for.
    fn wait_offloads_of(&self, py: Python<'_>, requests: Vec<String>) -> PyResult<usize> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            Ok(py.allow_threads(|| inner.wait_offloads_of(&requests)))
        })
    }

    /// Waits for every offload started so far.
    fn wait_offloads(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.wait_offloads());
            Ok(())
        })
    }

    /// Requests whose offloads have all completed since the last call (without waiting).
    fn poll_offloads(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| Ok(s.w_mut().poll_offloads()))
    }

    /// Starts onboarding host blocks into GPU blocks (`pairs` of (host, gpu)), one job per
    /// onboard stage, after the offloads into those host blocks completed.
    fn onboard(&self, py: Python<'_>, pairs: Vec<(u32, u32)>) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.onboard(&pairs)).map_err(core_err)
        })
    }

    /// Waits until layer `layer`'s onboards are in place; False if any failed.
    fn wait_layer(&self, py: Python<'_>, layer: usize) -> PyResult<bool> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.wait_layer(layer))
                .map_err(core_err)
        })
    }

    /// Waits for every layer's onboards; False if any failed.
    fn wait_onboards(&self, py: Python<'_>) -> PyResult<bool> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let inner = s.w_mut();
            py.allow_threads(|| inner.wait_onboards()).map_err(core_err)
        })
    }

    /// GPU blocks whose onboards failed since the last call, sorted, without repeats.
    fn take_failed(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| Ok(s.w_mut().take_failed()))
    }

    /// Queues disk writes (`writes` of (host, disk, key, identity bytes)) after the offloads
    /// into those host blocks completed.
    fn disk_write(&self, py: Python<'_>, writes: Vec<DiskWriteTuple>) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let writes = writes
                .into_iter()
                .map(|(host, disk, key, identity)| DiskWrite {
                    host,
                    disk,
                    key,
                    identity,
                })
                .collect();
            let inner = s.w_mut();
            py.allow_threads(|| inner.disk_write(writes))
                .map_err(core_err)
        })
    }

    /// Reads disk blocks into host blocks now (`reads` of (disk, host, key)); returns the host
    /// blocks that missed.
    fn disk_read(&self, py: Python<'_>, reads: Vec<(u32, u32, u64)>) -> PyResult<Vec<u32>> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let reads = disk_reads(reads);
            let inner = s.w_mut();
            py.allow_threads(|| inner.disk_read(&reads))
                .map_err(core_err)
        })
    }

    /// Queues an asynchronous onboard for `request`: disk reads (of (disk, staging host, key))
    /// then host blocks into GPU blocks (`pairs` of (host, gpu)).
    fn onboard_async(
        &self,
        py: Python<'_>,
        request: String,
        reads: Vec<(u32, u32, u64)>,
        pairs: Vec<(u32, u32)>,
    ) -> PyResult<()> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| {
            let job = AsyncOnboard {
                request,
                disk_reads: disk_reads(reads),
                pairs,
                unbacked: Vec::new(),
                shared_reads: Vec::new(),
                tenant: 0,
            };
            let inner = s.w_mut();
            py.allow_threads(|| inner.onboard_async(job))
                .map_err(core_err)
        })
    }

    /// Waits until every asynchronous onboard queued so far finished.
    fn wait_async(&self, py: Python<'_>) -> PyResult<()> {
        let g = self.read(py)?;
        let s = &*g;
        guard(|| {
            let inner = s.w();
            py.allow_threads(|| inner.wait_async());
            Ok(())
        })
    }

    /// Waits until the shared tier's queued writes were copied out and, up to `timeout`
    /// seconds, sent; false when some were still in flight (or there is no shared tier).
    fn wait_shared(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let limit = crate::timeout_of("timeout", timeout)?;
        let g = self.read(py)?;
        let s = &*g;
        guard(|| {
            let inner = s.w();
            Ok(py.allow_threads(|| inner.wait_shared(limit)))
        })
    }

    /// The shared tier's counters (`writes`, `read_hits`, `outages`, ...; `bad_values` by
    /// reason), or None without a shared tier.
    fn shared_counts<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let g = self.read(py)?;
        let Some(c) = g.w().shared_counts() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        for (k, v) in [
            ("lookups", c.lookups),
            ("lookup_hits", c.lookup_hits),
            ("reads", c.reads),
            ("read_hits", c.read_hits),
            ("read_missing", c.read_missing),
            ("reads_skipped", c.reads_skipped),
            ("read_refused", c.read_refused),
            ("writes", c.writes),
            ("write_bytes", c.write_bytes),
            ("writes_dropped_down", c.writes_dropped_down),
            ("writes_dropped_busy", c.writes_dropped_busy),
            ("writes_refused", c.writes_refused),
            ("timeouts", c.timeouts),
            ("outages", c.outages),
            ("recoveries", c.recoveries),
        ] {
            d.set_item(k, v)?;
        }
        let bad = PyDict::new(py);
        for why in kvbm_core::shared::BadValue::ALL {
            bad.set_item(why.label(), c.bad_values[why.index()])?;
        }
        d.set_item("bad_values", bad)?;
        d.set_item("up", c.up)?;
        Ok(Some(d))
    }

    /// Asynchronous onboards finished since the last call: (request, GPU blocks that failed).
    fn poll_async(&self, py: Python<'_>) -> PyResult<Vec<(String, Vec<u32>)>> {
        let mut g = self.write(py)?;
        let s = &mut *g;
        guard(|| Ok(s.w_mut().poll_async()))
    }

    /// Waits until every queued disk write finished.
    fn wait_disk(&self, py: Python<'_>) -> PyResult<()> {
        let g = self.read(py)?;
        let s = &*g;
        guard(|| {
            let inner = s.w();
            py.allow_threads(|| inner.wait_disk());
            Ok(())
        })
    }

    /// Waits until the whole host pool is pinned (or `timeout_s` passed); returns whether it is.
    /// `timeout_s` is seconds from 0 to a day (86400); NaN, infinities, negative or longer values
    /// raise `ValueError`.
    #[pyo3(signature = (timeout_s=300.0))]
    fn wait_host_ready(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        let timeout = crate::timeout_of("timeout_s", timeout_s)?;
        let g = self.read(py)?;
        let s = &*g;
        guard(|| {
            let inner = s.w();
            Ok(py.allow_threads(|| inner.wait_host_ready(timeout)))
        })
    }

    /// Copy counters: bytes_offloaded, bytes_onboarded, offloads_in_flight, offload_waits,
    /// bad_host_blocks, host_ready_bytes, disk_writes_pending, disk_registered.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // The dict is made once the lock is released (making it may run finalizers).
        let (st, disk_registered) = guard(|| {
            let s = self.read(py)?;
            Ok((s.w().stats(), s.w().disk_registered()))
        })?;
        guard(|| {
            let d = PyDict::new(py);
            d.set_item("bytes_offloaded", st.bytes_offloaded)?;
            d.set_item("bytes_onboarded", st.bytes_onboarded)?;
            d.set_item("offloads_in_flight", st.offloads_in_flight)?;
            d.set_item("offload_waits", st.offload_waits)?;
            d.set_item("bad_host_blocks", st.bad_host_blocks)?;
            d.set_item("host_ready_bytes", st.host_ready_bytes)?;
            d.set_item("disk_writes_pending", st.disk_writes_pending)?;
            d.set_item("disk_registered", disk_registered)?;
            Ok(d)
        })
    }

    /// kvbm-core's counters of this worker, under Dynamo's metric names.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (snapshot, shared) = guard(|| {
            let g = self.read(py)?;
            Ok((g.w().metrics().snapshot(), g.w().shared_counts()))
        })?;
        let d = guard(|| crate::worker_metrics(py, &snapshot))?;
        // The shared tier's failures, where there is one (kvbm.metrics names them).
        if let Some(c) = shared {
            for (name, value) in [
                ("kvbm_shared_outages", c.outages),
                ("kvbm_shared_timeouts", c.timeouts),
                (
                    "kvbm_shared_writes_dropped",
                    c.writes_dropped_down + c.writes_dropped_busy,
                ),
                ("kvbm_shared_writes_refused", c.writes_refused),
                ("kvbm_shared_bad_values", c.bad_values.iter().sum()),
                ("kvbm_shared_down", u64::from(!c.up)),
            ] {
                d.set_item(name, value)?;
            }
        }
        Ok(d)
    }

    /// Keeps the D2H stream (`"d2h"`) or the H2D stream (`"h2d"`) from starting further copies
    /// until `release()` is called on the returned hold. Emulated device only; for tests that
    /// need a copy in flight for as long as they look.
    fn _hold_stream(&self, py: Python<'_>, direction: &str) -> PyResult<CopyHold> {
        let g = self.read(py)?;
        let s = &*g;
        guard(|| {
            let direction = direction_of(direction)?;
            let hold = s.w().hold_stream(direction).map_err(core_err)?;
            Ok(CopyHold {
                hold: Mutex::new(Some(hold)),
            })
        })
    }

    /// Calls `f` while this worker's lock is held (shared), for tests of calls back into the
    /// worker from Python code run under the lock, which raise `RuntimeError`.
    fn _with_lock_held(&self, py: Python<'_>, f: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let _held = self.read(py)?;
        Ok(f.call0()?.unbind())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let g = self.read(py)?;
        Ok(format!("Worker{:?}", &*g))
    }
}

/// `"d2h"` (offloads) or `"h2d"` (onboards) as a copy direction.
fn direction_of(name: &str) -> PyResult<kvbm_core::Direction> {
    match name {
        "d2h" => Ok(kvbm_core::Direction::DeviceToHost),
        "h2d" => Ok(kvbm_core::Direction::HostToDevice),
        other => Err(crate::DeviceError::new_err(format!(
            "direction {other:?}: expected d2h or h2d"
        ))),
    }
}

fn disk_reads(reads: Vec<(u32, u32, u64)>) -> Vec<DiskRead> {
    reads
        .into_iter()
        .map(|(disk, host, key)| DiskRead { disk, host, key })
        .collect()
}

impl Worker {
    fn read(&self, py: Python<'_>) -> PyResult<crate::Held<RwLockReadGuard<'_, WorkerState>>> {
        crate::read_serialized(py, &self.state)
    }

    fn write(&self, py: Python<'_>) -> PyResult<crate::Held<RwLockWriteGuard<'_, WorkerState>>> {
        crate::write_serialized(py, &self.state)
    }
}

impl WorkerState {
    fn w(&self) -> &kvbm_core::Worker {
        self.inner.as_ref().expect("present until dropped")
    }

    fn w_mut(&mut self) -> &mut kvbm_core::Worker {
        self.inner.as_mut().expect("present until dropped")
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Joining the loaders and the disk writer may wait for copies: not with the GIL held.
        if let Some(inner) = self.state.get_mut().inner.take() {
            Python::with_gil(|py| py.allow_threads(move || drop(inner)));
        }
    }
}

/// A hold on one of a worker's copy streams (see `Worker._hold_stream`).
#[pyclass(module = "kvbm._kvbm")]
#[derive(Debug)]
pub struct CopyHold {
    hold: Mutex<Option<kvbm_core::StreamHold>>,
}

#[pymethods]
impl CopyHold {
    /// Lets the stream run again (idempotent).
    fn release(&self) {
        self.hold.lock().take();
    }
}

/// The plan bytes as a Python `bytes` object.
pub(crate) fn plan_bytes<'py>(py: Python<'py>, plan: &StepPlan) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &plan.to_bytes())
}

/// An onboard or offload as Python passes it: (request, pairs).
type RequestPairs = (String, Vec<(u32, u32)>);
/// An asynchronous onboard as Python passes it: (request, disk reads, pairs).
type AsyncTuple = (String, Vec<(u32, u32, u64)>, Vec<(u32, u32)>);

/// A step plan's bytes from its parts (tests and tools; the leader builds its own);
/// `unbacked` maps an asynchronous onboard's request to GPU blocks it cannot fill.
#[pyfunction]
#[pyo3(signature = (step=0, *, preempted=Vec::new(), disk_reads=Vec::new(), onboards=Vec::new(), async_onboards=Vec::new(), offloads=Vec::new(), disk_writes=Vec::new(), load_errors=Vec::new(), fence_offloads=false, unbacked=std::collections::HashMap::new()))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn encode_plan<'py>(
    py: Python<'py>,
    step: u64,
    preempted: Vec<String>,
    disk_reads: Vec<(u32, u32, u64)>,
    onboards: Vec<RequestPairs>,
    async_onboards: Vec<AsyncTuple>,
    offloads: Vec<RequestPairs>,
    disk_writes: Vec<DiskWriteTuple>,
    load_errors: Vec<u32>,
    fence_offloads: bool,
    mut unbacked: std::collections::HashMap<String, Vec<u32>>,
) -> PyResult<Bound<'py, PyBytes>> {
    guard(|| {
        let plan = StepPlan {
            step,
            preempted,
            disk_reads: self::disk_reads(disk_reads),
            onboards: onboards
                .into_iter()
                .map(|(request, pairs)| kvbm_core::Onboard { request, pairs })
                .collect(),
            async_onboards: async_onboards
                .into_iter()
                .map(|(request, reads, pairs)| AsyncOnboard {
                    unbacked: unbacked.remove(&request).unwrap_or_default(),
                    request,
                    disk_reads: self::disk_reads(reads),
                    pairs,
                    shared_reads: Vec::new(),
                    tenant: 0,
                })
                .collect(),
            offloads: offloads
                .into_iter()
                .map(|(request, pairs)| kvbm_core::Offload { request, pairs })
                .collect(),
            disk_writes: disk_writes
                .into_iter()
                .map(|(host, disk, key, identity)| DiskWrite {
                    host,
                    disk,
                    key,
                    identity,
                })
                .collect(),
            load_errors,
            fence_offloads,
            shared_writes: Vec::new(),
        };
        Ok(plan_bytes(py, &plan))
    })
}

/// A step plan's parts from its bytes, as `encode_plan` takes them (for inspection); malformed
/// bytes raise `LayoutError`.
#[pyfunction]
pub(crate) fn decode_plan<'py>(py: Python<'py>, plan: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    guard(|| {
        let p = StepPlan::from_bytes(plan).map_err(core_err)?;
        let reads = |rs: &[DiskRead]| -> Vec<(u32, u32, u64)> {
            rs.iter().map(|r| (r.disk, r.host, r.key)).collect()
        };
        let d = PyDict::new(py);
        d.set_item("step", p.step)?;
        d.set_item("preempted", p.preempted.clone())?;
        d.set_item("disk_reads", reads(&p.disk_reads))?;
        let onboards: Vec<RequestPairs> = p
            .onboards
            .into_iter()
            .map(|o| (o.request, o.pairs))
            .collect();
        d.set_item("onboards", onboards)?;
        d.set_item(
            "async_onboards",
            p.async_onboards
                .iter()
                .map(|o| (o.request.clone(), reads(&o.disk_reads), o.pairs.clone()))
                .collect::<Vec<_>>(),
        )?;
        let offloads: Vec<RequestPairs> = p
            .offloads
            .into_iter()
            .map(|o| (o.request, o.pairs))
            .collect();
        d.set_item("offloads", offloads)?;
        d.set_item(
            "disk_writes",
            p.disk_writes
                .iter()
                .map(|w| (w.host, w.disk, w.key, PyBytes::new(py, &w.identity)))
                .collect::<Vec<_>>(),
        )?;
        d.set_item("load_errors", p.load_errors.clone())?;
        d.set_item("fence_offloads", p.fence_offloads)?;
        d.set_item(
            "unbacked",
            p.async_onboards
                .iter()
                .filter(|o| !o.unbacked.is_empty())
                .map(|o| (o.request.clone(), o.unbacked.clone()))
                .collect::<std::collections::HashMap<_, _>>(),
        )?;
        Ok(d)
    })
}
