//! `Worker`: one GPU worker's bytes: its registered KV cache tensors, its shard of the pinned host
//! pool, and a copy stream per direction.
//!
//! The GPU side is whatever vLLM hands over: per-layer views of one backing buffer (vLLM 0.33,
//! any `KVCacheLayout`) or older per-layer tensors; kvbm-core's layout module turns their shapes
//! and strides into each block's runs (`BlockLayout::from_views`).
//!
//! Invariants:
//! - The worker keeps a reference to every registered tensor, so their memory outlives every
//!   copy (the one `unsafe` call, `register_gpu`, relies on it).
//! - A host block is read (by a load, a disk write) or overwritten (by a disk read) only after
//!   every save into it completed (`wait_saves_touching`).
//! - The GPU blocks a save reads are not overwritten while it runs: vLLM frees a request's
//!   blocks either after `finished_sending` (which waits for its saves) or, on preemption, right
//!   after `handle_preemptions`, which waits for the preempted requests' saves
//!   (`wait_saves_of`). Nothing else frees a block a save reads (see ARCHITECTURE.md).
//! - A load that fails, or that reads a host block whose save failed, reports its GPU blocks in
//!   `take_failed` (vLLM then recomputes them); nothing is loaded from a bad host block.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use kvbm_disk::{
    AlignedBuf, CacheFileOptions, DiskStore, EngineChoice, Lookup, StoreOptions, WriteOutcome,
};
use parking_lot::{Condvar, Mutex};

use kvbm_core::layout::{BlockLayout, KvLayout, TensorView};
use kvbm_cuda::{
    BackendChoice, Completion, CopyPiece, CopyStream, Device, Direction, GpuRegion, HostRegion,
    HostRegionOptions, Transfer,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{guard, DeviceError, DiskError, LayoutError};

/// Block pairs: (gpu, host) for saves, (host, gpu) for loads.
type Pairs = Vec<(u32, u32)>;

/// Disk writes queued for the writer thread at most; a step with more waits (without the GIL)
/// for the writer to catch up.
const DISK_WRITES_QUEUED_MAX: usize = 1024;
/// Asynchronous loads queued for the loader thread at most; more wait (without the GIL).
const ASYNC_LOADS_QUEUED_MAX: usize = 256;

/// How long a copy may wait for its host memory to be pinned.
const HOST_READY_TIMEOUT: Duration = Duration::from_secs(300);

struct PendingSave {
    completion: Completion,
    requests: Vec<String>,
    host_blocks: HashSet<u32>,
}

/// One disk write: host block, disk slot, key, identity bytes.
type DiskWrite = (u32, u32, u64, Vec<u8>);

/// Disk writes queued or running, by the host block they read and the slot they write.
#[derive(Default)]
struct DiskPending {
    by_host: HashMap<u32, usize>,
    by_slot: HashMap<u32, usize>,
    written: u64,
    write_failures: u64,
}

impl DiskPending {
    fn busy(&self, host: Option<u32>, slot: Option<u32>) -> bool {
        host.is_some_and(|h| self.by_host.contains_key(&h))
            || slot.is_some_and(|d| self.by_slot.contains_key(&d))
    }

    fn done(&mut self, host: u32, slot: u32, ok: bool) {
        for (map, k) in [(&mut self.by_host, host), (&mut self.by_slot, slot)] {
            if let Some(n) = map.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&k);
                }
            }
        }
        if ok {
            self.written += 1;
        } else {
            self.write_failures += 1;
        }
    }
}

/// This worker's disk tier: its cache file, and a thread writing host blocks into it.
struct DiskSide {
    store: Arc<DiskStore>,
    jobs: Option<Sender<DiskWrite>>,
    pending: SharedPending,
    thread: Option<JoinHandle<()>>,
    reads: u64,
    misses: u64,
}

impl Drop for DiskSide {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits (the caller releases the GIL) until no queued write reads `host` or writes `slot`.
fn wait_for_writes(pending: &SharedPending, host: Option<u32>, slot: Option<u32>) {
    let (lock, cv) = &**pending;
    let mut p = lock.lock();
    while p.busy(host, slot) {
        cv.wait(&mut p);
    }
}

/// Reads disk blocks ((disk, host, key)) into host blocks, each after any queued write of its
/// slot or reading its host block; returns the host blocks that missed (a block that fails
/// verification, a key that differs, an I/O error).
fn read_into_host(
    store: &DiskStore,
    pending: &SharedPending,
    host: &HostRegion,
    layout: &BlockLayout,
    bytes: usize,
    reads: &[(u32, u32, u64)],
) -> Vec<u32> {
    let Ok(mut buf) = AlignedBuf::new(store.payload_area_bytes()) else {
        return reads.iter().map(|&(_, h, _)| h).collect();
    };
    let mut missed = Vec::new();
    for &(d, h, key) in reads {
        wait_for_writes(pending, Some(h), Some(d));
        let hit = matches!(store.read(d, key, &mut buf), Ok(Lookup::Hit))
            && host
                .write(host_offset(host, layout, h), &buf.as_slice()[..bytes])
                .is_ok();
        if !hit {
            missed.push(h);
        }
    }
    missed
}

impl DiskSide {
    fn wait_for(&self, host: Option<u32>, slot: Option<u32>) {
        wait_for_writes(&self.pending, host, slot);
    }

    fn wait_all(&self) {
        let (lock, cv) = &*self.pending;
        let mut p = lock.lock();
        while !p.by_slot.is_empty() {
            cv.wait(&mut p);
        }
    }
}

/// A finished asynchronous load: (request, GPU blocks that failed).
type LoadDone = (String, Vec<u32>);

/// Disk writes in flight, shared with the threads that wait on them.
type SharedPending = Arc<(Mutex<DiskPending>, Condvar)>;

/// One asynchronous load: disk reads into staging host blocks, then host blocks to GPU blocks.
struct AsyncLoad {
    request: String,
    reads: Vec<(u32, u32, u64)>,
    pairs: Pairs,
}

/// The thread running asynchronous loads, one at a time, in order; dropping it waits for them.
struct AsyncLoader {
    jobs: Option<Sender<AsyncLoad>>,
    /// Finished loads: (request, GPU blocks that failed).
    done: Arc<Mutex<Vec<LoadDone>>>,
    /// Loads queued or running.
    busy: Arc<(Mutex<usize>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for AsyncLoader {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the asynchronous loader needs of the worker (clones: regions are reference-counted).
struct LoaderContext {
    kv: KvLayout,
    gpu: BlockLayout,
    gpu_regions: Vec<GpuRegion>,
    host: HostRegion,
    host_layout: BlockLayout,
    h2d: Arc<CopyStream>,
    disk: Option<(Arc<DiskStore>, SharedPending)>,
}

impl LoaderContext {
    /// Runs one load; returns the GPU blocks that did not get their bytes.
    fn run(&self, job: &AsyncLoad) -> Vec<u32> {
        let bad_hosts: HashSet<u32> = match &self.disk {
            _ if job.reads.is_empty() => HashSet::new(),
            None => job.reads.iter().map(|&(_, h, _)| h).collect(),
            Some((store, pending)) => read_into_host(
                store,
                pending,
                &self.host,
                &self.host_layout,
                self.kv.bytes_per_block(),
                &job.reads,
            )
            .into_iter()
            .collect(),
        };
        let (bad, good): (Pairs, Pairs) =
            job.pairs.iter().partition(|(h, _)| bad_hosts.contains(h));
        let mut failed: Vec<u32> = bad.iter().map(|&(_, g)| g).collect();
        if good.is_empty() {
            return failed;
        }
        let end = good.iter().map(|&(h, _)| h).max().unwrap_or(0) as usize + 1;
        let ready = self
            .host
            .wait_ready(end * self.kv.host_stride_bytes(), HOST_READY_TIMEOUT);
        let mut pieces = Vec::new();
        let planned = ready
            && good.iter().all(|&(h, g)| {
                self.host_layout
                    .copy_pieces_into(h as usize, &self.gpu, g as usize, &mut pieces)
                    .is_ok()
            });
        let copied = planned && {
            self.h2d
                .submit(transfer_of(&pieces, &self.gpu_regions, &self.host))
                .and_then(|c| c.wait())
                .is_ok()
        };
        if !copied {
            failed.extend(good.iter().map(|&(_, g)| g));
        }
        failed
    }
}

struct PendingLoad {
    completion: Completion,
    gpu_blocks: Vec<u32>,
}

/// A GPU worker's side of kvbm.
#[pyclass(module = "kvbm._kvbm")]
pub struct Worker {
    device: Device,
    kv: KvLayout,
    gpu: BlockLayout,
    gpu_regions: Vec<GpuRegion>,
    /// vLLM's layout name the tensors follow ("BLNHC", ...), or "per-layer tensors".
    layout_name: String,
    /// Per layer, the load stage that brings its bytes in (see `BlockLayout::ready_after`).
    ready_after: Vec<u32>,
    /// The load stages, ascending: the last layers of a block's runs.
    stages: Vec<u32>,
    /// Declared before `_tensors`: dropped (and joined) first, as it copies into them.
    loader: Option<AsyncLoader>,
    _tensors: Vec<PyObject>,
    host: HostRegion,
    host_layout: BlockLayout,
    host_blocks: usize,
    d2h: CopyStream,
    h2d: Arc<CopyStream>,
    saves: Vec<PendingSave>,
    /// Save transfers not yet complete, per request.
    save_pending: HashMap<String, usize>,
    /// Requests whose saves all completed since the last `poll_saves`.
    save_done: Vec<String>,
    /// Host blocks whose save failed.
    bad_host: HashSet<u32>,
    /// The loads in flight, per stage (indexed by the stage's layer).
    loads: Vec<Option<PendingLoad>>,
    failed: Vec<u32>,
    disk: Option<DiskSide>,
    bytes_saved: u64,
    bytes_loaded: u64,
    /// Times a preemption or a load had to wait for a save still in flight.
    save_waits: u64,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("kv", &self.kv)
            .field("layout", &self.layout_name)
            .field("runs_per_block", &self.gpu.runs_per_block())
            .field("gpu_blocks", &self.gpu.num_blocks())
            .field("host_blocks", &self.host_blocks)
            .field("device", &self.device.kind().as_str())
            .finish()
    }
}

fn layout_err(e: impl std::fmt::Display) -> PyErr {
    LayoutError::new_err(e.to_string())
}

fn device_err(e: impl std::fmt::Display) -> PyErr {
    DeviceError::new_err(e.to_string())
}

/// Reads one tensor's view from the tensor itself (`data_ptr()`, `shape`, `stride()`,
/// `element_size()`) and checks that every byte it addresses lies inside the memory it owns
/// (`untyped_storage()`: `data_ptr()` and `nbytes()`), so that no address or size crosses from
/// Python unchecked.
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
    match view.span() {
        Some((start, len))
            if start >= base
                && base
                    .checked_add(nbytes)
                    .is_some_and(|end| start + len as u64 <= end) =>
        {
            Ok(view)
        }
        span => Err(LayoutError::new_err(format!(
            "KV cache tensor {name:?} of shape {:?}, strides {:?} and {elem_bytes} bytes per \
             element addresses {span:?} (start, bytes), outside its storage ({base:#x}, \
             {nbytes} bytes)",
            view.shape, view.strides
        ))),
    }
}

/// The views of `kv_caches` (layer name -> tensor), in order, each checked by `view_of`.
fn views_of(kv_caches: &Bound<'_, PyDict>) -> PyResult<(Vec<PyObject>, Vec<TensorView>)> {
    let mut tensors = Vec::with_capacity(kv_caches.len());
    let mut views = Vec::with_capacity(kv_caches.len());
    for (name, tensor) in kv_caches.iter() {
        let name = name.str()?.to_string();
        views.push(view_of(&name, &tensor)?);
        tensors.push(tensor.unbind());
    }
    Ok((tensors, views))
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
        let (_, views) = views_of(kv_caches)?;
        let placed = BlockLayout::from_views(&views, num_blocks).map_err(layout_err)?;
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

#[pymethods]
impl Worker {
    /// Registers vLLM's KV cache tensors and maps a pinned host pool of `host_blocks` blocks.
    ///
    /// `kv_caches` maps layer names to tensors (torch tensors, or anything with `data_ptr()`,
    /// `shape`, `stride()`, `element_size()` and `untyped_storage()`); every tensor is checked
    /// against its storage before any byte is addressed. Any layout vLLM hands over works: 0.33's `[B, H, N,
    /// C]` views of one buffer in every `KVCacheLayout`, MLA, the older 5-D tensors; each block's
    /// runs come from the strides. `num_blocks` is vLLM's block count (a view with a multiple of
    /// it holds kernel blocks). `outer_dim` (2 for K and V, 1 for MLA) names what the content
    /// axis holds, for the KV shape; the bytes moved do not depend on it. A layout that cannot be
    /// addressed raises `LayoutError` naming the tensor, its shape and strides.
    ///
    /// With `disk_blocks` above 0 the worker opens its disk cache file `disk_file` in `disk_dir`
    /// (created 0700, the file 0600; one file per rank, locked while open). The connector's disk
    /// tier starts empty: what an earlier run left there is overwritten as slots are reused.
    #[new]
    #[pyo3(signature = (kv_caches, num_blocks, host_blocks, *, outer_dim=None, device="auto", device_index=0, disk_blocks=0, disk_dir=None, disk_file=None, disk_disable_o_direct=false, disk_engine="auto"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kv_caches: &Bound<'_, PyDict>,
        num_blocks: usize,
        host_blocks: usize,
        outer_dim: Option<usize>,
        device: &str,
        device_index: usize,
        disk_blocks: usize,
        disk_dir: Option<String>,
        disk_file: Option<String>,
        disk_disable_o_direct: bool,
        disk_engine: &str,
    ) -> PyResult<Self> {
        guard(|| {
            let (tensors, views) = views_of(kv_caches)?;
            if views.is_empty() {
                return Err(LayoutError::new_err("no KV cache tensor to register"));
            }
            if num_blocks == 0 || host_blocks == 0 {
                return Err(LayoutError::new_err(format!(
                    "{num_blocks} GPU blocks and {host_blocks} host blocks: both must be above 0"
                )));
            }
            let placed = BlockLayout::from_views(&views, num_blocks).map_err(layout_err)?;
            let mut kv = placed.kv;
            let mut gpu = placed.layout;
            if let Some(outer) = outer_dim.filter(|&o| o != kv.outer_dim) {
                let total = kv.outer_dim * kv.inner_dim;
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
                .map_err(layout_err)?;
                gpu = gpu.with_kv(kv).map_err(layout_err)?;
            }
            let layout_name = placed
                .physical
                .map_or_else(|| "per-layer tensors".to_owned(), |p| p.name().to_owned());
            let choice: BackendChoice = device.parse().map_err(device_err)?;
            let device = Device::open(choice, device_index).map_err(device_err)?;
            let mut gpu_regions = Vec::with_capacity(placed.spans.len());
            for &(addr, len) in &placed.spans {
                #[allow(unsafe_code)]
                // SAFETY: each span is the memory one or more of `tensors` address with their
                // shapes and strides (computed from them by `from_views`), and `view_of` checked
                // that each tensor's addresses lie inside its own storage; the worker keeps a
                // reference to every tensor for as long as it (and so any copy) lives.
                let region =
                    unsafe { device.register_gpu(addr, len, device_index) }.map_err(device_err)?;
                gpu_regions.push(region);
            }
            let ready_after = gpu.ready_after();
            let tensors_count = ready_after.len();
            let mut stages = Vec::new();
            gpu.for_each_run(0, |_, _, _, (_, last)| stages.push(last));
            stages.sort_unstable();
            stages.dedup();
            let host_bytes = host_blocks
                .checked_mul(kv.host_stride_bytes())
                .ok_or_else(|| LayoutError::new_err("host pool size overflows"))?;
            let host = py
                .allow_threads(|| device.alloc_host(host_bytes, HostRegionOptions::default()))
                .map_err(device_err)?;
            let host_layout = BlockLayout::host(kv, host_blocks, host.addr());
            let disk = if disk_blocks > 0 {
                let dir = disk_dir
                    .unwrap_or_else(|| kvbm_core::config::default_disk_dir().display().to_string());
                let file = disk_file.unwrap_or_else(|| format!("kvbm-rank{device_index}.cache"));
                let engine: EngineChoice = disk_engine
                    .parse()
                    .map_err(|e: kvbm_disk::DiskError| DiskError::new_err(e.to_string()))?;
                let options = StoreOptions {
                    layout_fingerprint: kvbm_core::disk::layout_fingerprint(&kv, gpu.geometry_id()),
                    payload_bytes: kv.bytes_per_block(),
                    slots: disk_blocks,
                    queue_depth: 8,
                    engine,
                    file: CacheFileOptions {
                        disable_o_direct: disk_disable_o_direct,
                        ..Default::default()
                    },
                    write_failures_max: 8,
                };
                let (store, _recovered) = py
                    .allow_threads(|| DiskStore::open(Path::new(&dir), &file, options))
                    .map_err(|e| DiskError::new_err(format!("disk cache {dir}/{file}: {e}")))?;
                Some(start_disk(
                    Arc::new(store),
                    host.clone(),
                    host_layout.clone(),
                    kv,
                )?)
            } else {
                None
            };
            let d2h = device
                .copy_stream(Direction::DeviceToHost)
                .map_err(device_err)?;
            let h2d = Arc::new(
                device
                    .copy_stream(Direction::HostToDevice)
                    .map_err(device_err)?,
            );
            let loader = start_loader(LoaderContext {
                kv,
                gpu: gpu.clone(),
                gpu_regions: gpu_regions.clone(),
                host: host.clone(),
                host_layout: host_layout.clone(),
                h2d: h2d.clone(),
                disk: disk.as_ref().map(|d| (d.store.clone(), d.pending.clone())),
            })?;
            Ok(Self {
                device,
                kv,
                gpu,
                gpu_regions,
                layout_name,
                ready_after,
                stages,
                loader: Some(loader),
                _tensors: tensors,
                host,
                host_layout,
                host_blocks,
                d2h,
                h2d,
                saves: Vec::new(),
                save_pending: HashMap::new(),
                save_done: Vec::new(),
                bad_host: HashSet::new(),
                loads: (0..tensors_count).map(|_| None).collect(),
                failed: Vec::new(),
                disk,
                bytes_saved: 0,
                bytes_loaded: 0,
                save_waits: 0,
            })
        })
    }

    /// vLLM's name of the layout the tensors follow ("BLNHC", ...), or "per-layer tensors".
    #[getter]
    fn layout_name(&self) -> &str {
        &self.layout_name
    }

    /// Contiguous runs per block on the GPU side: the copies (DMAs) one block takes.
    #[getter]
    fn runs_per_block(&self) -> usize {
        self.gpu.runs_per_block()
    }

    /// Distinct layer pages per block (tensors addressing the same bytes count once).
    #[getter]
    fn distinct_layers(&self) -> usize {
        self.kv.num_layers
    }

    /// Tensors (layers) registered.
    #[getter]
    fn num_layers(&self) -> usize {
        self.ready_after.len()
    }

    /// GPU blocks per layer tensor.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.gpu.num_blocks()
    }

    /// Host blocks of this worker's shard.
    #[getter]
    fn host_blocks(&self) -> usize {
        self.host_blocks
    }

    /// Bytes of one block on this worker (all layers, K and V).
    #[getter]
    fn bytes_per_block(&self) -> usize {
        self.kv.bytes_per_block()
    }

    /// "cuda" or "emulated".
    #[getter]
    fn device_kind(&self) -> &'static str {
        self.device.kind().as_str()
    }

    /// Starts copying GPU blocks into host blocks (`pairs` of (gpu, host)) on the D2H stream, on
    /// behalf of `requests` (each counts it as one of its pending saves).
    fn save(
        &mut self,
        py: Python<'_>,
        pairs: Vec<(u32, u32)>,
        requests: Vec<String>,
    ) -> PyResult<()> {
        guard(|| {
            if pairs.is_empty() {
                return Ok(());
            }
            self.check(&pairs.iter().map(|&(g, h)| (h, g)).collect::<Vec<_>>())?;
            // A GPU block whose load failed in this step holds no valid bytes: it is not saved,
            // and its host block is marked bad, so no later load serves it.
            let (unloaded, pairs): (Pairs, Pairs) = pairs
                .into_iter()
                .partition(|(g, _)| self.failed.contains(g));
            self.bad_host.extend(unloaded.iter().map(|&(_, h)| h));
            if pairs.is_empty() {
                // Nothing to copy: the requests are done with this save at once.
                for r in requests {
                    if !self.save_pending.contains_key(&r) {
                        self.save_done.push(r);
                    }
                }
                return Ok(());
            }
            self.wait_blocks_ready(py, pairs.iter().map(|&(_, h)| h))?;
            if let Some(disk) = &self.disk {
                // A disk write still reading one of these host blocks finishes first.
                py.allow_threads(|| {
                    for &(_, h) in &pairs {
                        disk.wait_for(Some(h), None);
                    }
                });
            }
            let mut pieces = Vec::with_capacity(pairs.len() * self.gpu.runs_per_block());
            for &(g, h) in &pairs {
                self.gpu
                    .copy_pieces_into(g as usize, &self.host_layout, h as usize, &mut pieces)
                    .map_err(layout_err)?;
            }
            let transfer = transfer_of(&pieces, &self.gpu_regions, &self.host);
            self.bytes_saved += transfer.bytes();
            let completion = self.d2h.submit(transfer).map_err(device_err)?;
            for r in &requests {
                *self.save_pending.entry(r.clone()).or_insert(0) += 1;
            }
            for &(_, h) in &pairs {
                self.bad_host.remove(&h);
            }
            self.saves.push(PendingSave {
                completion,
                requests,
                host_blocks: pairs.iter().map(|&(_, h)| h).collect(),
            });
            Ok(())
        })
    }

    /// Waits for the saves started on behalf of any of `requests` (vLLM's preempted requests,
    /// whose GPU blocks it reuses as soon as `handle_preemptions` returns); returns how many
    /// save transfers it waited for.
    fn wait_saves_of(&mut self, py: Python<'_>, requests: Vec<String>) -> PyResult<usize> {
        guard(|| {
            let wanted: HashSet<&str> = requests.iter().map(String::as_str).collect();
            Ok(self.wait_saves_where(py, |s| {
                s.requests.iter().any(|r| wanted.contains(r.as_str()))
            }))
        })
    }

    /// Keeps the D2H stream (`"d2h"`) or the H2D stream (`"h2d"`) from starting further copies
    /// until `release()` is called on the returned hold. Emulated device only; for tests that
    /// need a copy in flight for as long as they look.
    fn _hold_stream(&self, direction: &str) -> PyResult<CopyHold> {
        guard(|| {
            let stream: &CopyStream = match direction {
                "d2h" => &self.d2h,
                "h2d" => &self.h2d,
                other => {
                    return Err(DeviceError::new_err(format!(
                        "stream {other:?}: expected d2h or h2d"
                    )))
                }
            };
            let hold = stream.hold().map_err(device_err)?;
            Ok(CopyHold {
                hold: Mutex::new(Some(hold)),
            })
        })
    }

    /// Waits for every save started so far (the GIL is released meanwhile).
    fn wait_saves(&mut self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            let saves = std::mem::take(&mut self.saves);
            let results: Vec<bool> =
                py.allow_threads(|| saves.iter().map(|s| s.completion.wait().is_ok()).collect());
            for (save, ok) in saves.into_iter().zip(results) {
                self.settle(save, ok);
            }
            Ok(())
        })
    }

    /// Requests whose saves have all completed since the last call (without waiting).
    fn poll_saves(&mut self) -> PyResult<Vec<String>> {
        guard(|| {
            let mut still = Vec::with_capacity(self.saves.len());
            for save in std::mem::take(&mut self.saves) {
                match save.completion.poll() {
                    Ok(false) => still.push(save),
                    Ok(true) => self.settle(save, true),
                    Err(_) => self.settle(save, false),
                }
            }
            self.saves = still;
            Ok(std::mem::take(&mut self.save_done))
        })
    }

    /// Starts loading host blocks into GPU blocks (`pairs` of (host, gpu)) on the H2D stream, one
    /// transfer per load stage (per layer, or per group of layers whose runs are merged), after
    /// the saves into those host blocks completed.
    fn load(&mut self, py: Python<'_>, pairs: Vec<(u32, u32)>) -> PyResult<()> {
        guard(|| {
            if pairs.is_empty() {
                return Ok(());
            }
            self.check(&pairs)?;
            let hosts: HashSet<u32> = pairs.iter().map(|&(h, _)| h).collect();
            self.wait_saves_touching(py, &hosts);
            self.wait_loads(py)?;
            // Blocks whose saved copy is bad are reported, not loaded.
            let (bad, good): (Pairs, Pairs) = pairs
                .into_iter()
                .partition(|(h, _)| self.bad_host.contains(h));
            self.failed.extend(bad.iter().map(|&(_, g)| g));
            if good.is_empty() {
                return Ok(());
            }
            self.wait_blocks_ready(py, good.iter().map(|&(h, _)| h))?;
            for &stage in &self.stages {
                let mut pieces = Vec::new();
                for &(h, g) in &good {
                    self.host_layout
                        .copy_runs_into(
                            h as usize,
                            &self.gpu,
                            g as usize,
                            |(_, last)| last == stage,
                            &mut pieces,
                        )
                        .map_err(layout_err)?;
                }
                let transfer = transfer_of(&pieces, &self.gpu_regions, &self.host);
                self.bytes_loaded += transfer.bytes();
                match self.h2d.submit(transfer) {
                    Ok(completion) => {
                        self.loads[stage as usize] = Some(PendingLoad {
                            completion,
                            gpu_blocks: good.iter().map(|&(_, g)| g).collect(),
                        })
                    }
                    Err(_) => self.failed.extend(good.iter().map(|&(_, g)| g)),
                }
            }
            Ok(())
        })
    }

    /// Waits until layer `layer`'s loads are in place (the stage holding its runs, and the
    /// stages before it on the same stream); False if any failed (their blocks are then
    /// reported by `take_failed`).
    fn wait_layer(&mut self, py: Python<'_>, layer: usize) -> PyResult<bool> {
        guard(|| {
            let Some(&stage) = self.ready_after.get(layer) else {
                return Err(LayoutError::new_err(format!(
                    "layer {layer} of {}",
                    self.ready_after.len()
                )));
            };
            let mut ok = true;
            for slot in &mut self.loads[..=stage as usize] {
                let Some(load) = slot.take() else {
                    continue;
                };
                let done = py.allow_threads(|| load.completion.wait().is_ok());
                if !done {
                    self.failed.extend(load.gpu_blocks);
                }
                ok &= done;
            }
            Ok(ok)
        })
    }

    /// Waits for every layer's loads; False if any failed.
    fn wait_loads(&mut self, py: Python<'_>) -> PyResult<bool> {
        guard(|| self.wait_layer(py, self.ready_after.len() - 1))
    }

    /// GPU blocks whose loads failed since the last call, sorted, without repeats.
    fn take_failed(&mut self) -> PyResult<Vec<u32>> {
        guard(|| {
            let mut f = std::mem::take(&mut self.failed);
            f.sort_unstable();
            f.dedup();
            Ok(f)
        })
    }

    /// Queues writes of host blocks to disk (`writes` of (host, disk, key, identity bytes)),
    /// after this step's saves into those host blocks completed.
    fn disk_write(&mut self, py: Python<'_>, writes: Vec<DiskWrite>) -> PyResult<()> {
        guard(|| {
            if writes.is_empty() {
                return Ok(());
            }
            let Some(disk) = &self.disk else {
                return Err(LayoutError::new_err(
                    "disk writes for a worker without a disk tier",
                ));
            };
            for (h, d, _, _) in &writes {
                if *h as usize >= self.host_blocks || *d as usize >= disk.store.slots() {
                    return Err(LayoutError::new_err(format!(
                        "host block {h} / disk block {d} outside {} host / {} disk blocks",
                        self.host_blocks,
                        disk.store.slots()
                    )));
                }
            }
            let hosts: HashSet<u32> = writes.iter().map(|w| w.0).collect();
            self.wait_saves_touching(py, &hosts);
            let disk = self.disk.as_ref().expect("checked");
            {
                let mut p = disk.pending.0.lock();
                for (h, d, _, _) in &writes {
                    *p.by_host.entry(*h).or_insert(0) += 1;
                    *p.by_slot.entry(*d).or_insert(0) += 1;
                }
            }
            let jobs = disk.jobs.clone().expect("open while the worker lives");
            let pending = disk.pending.clone();
            // A full queue is backpressure: wait for the writer, without the GIL.
            py.allow_threads(move || {
                for w in writes {
                    let (h, d) = (w.0, w.1);
                    if jobs.send(w).is_err() {
                        pending.0.lock().done(h, d, false);
                        pending.1.notify_all();
                    }
                }
            });
            Ok(())
        })
    }

    /// Reads disk blocks into host blocks (`reads` of (disk, host, key)) now, after any queued
    /// write of those slots; returns the host blocks that missed (corrupt, never written,
    /// another key), which later loads report as failed instead of copying.
    fn disk_read(&mut self, py: Python<'_>, reads: Vec<(u32, u32, u64)>) -> PyResult<Vec<u32>> {
        guard(|| {
            if reads.is_empty() {
                return Ok(Vec::new());
            }
            let Some(disk) = &self.disk else {
                return Err(LayoutError::new_err(
                    "disk reads for a worker without a disk tier",
                ));
            };
            for (d, h, _) in &reads {
                if *h as usize >= self.host_blocks || *d as usize >= disk.store.slots() {
                    return Err(LayoutError::new_err(format!(
                        "disk block {d} / host block {h} outside {} disk / {} host blocks",
                        disk.store.slots(),
                        self.host_blocks
                    )));
                }
            }
            let hosts: HashSet<u32> = reads.iter().map(|&(_, h, _)| h).collect();
            self.wait_saves_touching(py, &hosts);
            self.wait_blocks_ready(py, reads.iter().map(|&(_, h, _)| h))?;
            let disk = self.disk.as_ref().expect("checked");
            let (host, layout, bytes) = (&self.host, &self.host_layout, self.kv.bytes_per_block());
            let missed: Vec<u32> = py.allow_threads(|| {
                read_into_host(&disk.store, &disk.pending, host, layout, bytes, &reads)
            });
            let disk = self.disk.as_mut().expect("checked");
            disk.reads += reads.len() as u64;
            disk.misses += missed.len() as u64;
            self.bad_host.extend(missed.iter().copied());
            for &(_, h, _) in &reads {
                if !missed.contains(&h) {
                    self.bad_host.remove(&h);
                }
            }
            Ok(missed)
        })
    }

    /// Starts an asynchronous load for `request` on the worker's loader thread: disk reads (of
    /// (disk, staging host, key)) into staging host blocks, then host blocks into GPU blocks
    /// (`pairs` of (host, gpu)), after the saves into any of those host blocks completed.
    /// `poll_loads` reports it when done.
    fn load_async(
        &mut self,
        py: Python<'_>,
        request: String,
        reads: Vec<(u32, u32, u64)>,
        pairs: Vec<(u32, u32)>,
    ) -> PyResult<()> {
        guard(|| {
            self.check(&pairs)?;
            if let Some(disk) = &self.disk {
                if let Some((d, ..)) = reads
                    .iter()
                    .find(|(d, ..)| *d as usize >= disk.store.slots())
                {
                    return Err(LayoutError::new_err(format!(
                        "disk block {d} outside {} disk blocks",
                        disk.store.slots()
                    )));
                }
            }
            self.check(&reads.iter().map(|&(_, h, _)| (h, 0)).collect::<Vec<_>>())?;
            let hosts: HashSet<u32> = reads
                .iter()
                .map(|&(_, h, _)| h)
                .chain(pairs.iter().map(|&(h, _)| h))
                .collect();
            self.wait_saves_touching(py, &hosts);
            let loader = self.loader.as_ref().expect("present until dropped");
            *loader.busy.0.lock() += 1;
            let jobs = loader.jobs.clone().expect("open while the worker lives");
            let job = AsyncLoad {
                request,
                reads,
                pairs,
            };
            // A full queue is backpressure: wait for the loader, without the GIL.
            let sent = py.allow_threads(move || jobs.send(job));
            if sent.is_err() {
                *loader.busy.0.lock() -= 1;
                return Err(DeviceError::new_err("the asynchronous loader has stopped"));
            }
            Ok(())
        })
    }

    /// Waits until every asynchronous load started so far finished (`poll_loads` then reports
    /// them all).
    fn wait_loads_async(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            let loader = self.loader.as_ref().expect("present until dropped");
            let busy = loader.busy.clone();
            py.allow_threads(|| {
                let (lock, cv) = &*busy;
                let mut n = lock.lock();
                while *n > 0 {
                    cv.wait(&mut n);
                }
            });
            Ok(())
        })
    }

    /// Asynchronous loads finished since the last call: (request, GPU blocks that failed).
    fn poll_loads(&mut self) -> PyResult<Vec<LoadDone>> {
        guard(|| {
            let loader = self.loader.as_ref().expect("present until dropped");
            Ok(std::mem::take(&mut *loader.done.lock()))
        })
    }

    /// Waits until every queued disk write finished.
    fn wait_disk(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            if let Some(disk) = &self.disk {
                py.allow_threads(|| disk.wait_all());
            }
            Ok(())
        })
    }

    /// Disk blocks of this worker's file (0 without a disk tier).
    #[getter]
    fn disk_blocks(&self) -> usize {
        self.disk.as_ref().map_or(0, |d| d.store.slots())
    }

    /// Waits until the whole host pool is pinned (or `timeout_s` passed); returns whether it is.
    #[pyo3(signature = (timeout_s=300.0))]
    fn wait_host_ready(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        guard(|| {
            let host = self.host.clone();
            let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
            Ok(py.allow_threads(|| host.wait_ready(host.len(), timeout)))
        })
    }

    /// Copy counters: bytes_saved, bytes_loaded, saves_in_flight, bad_host_blocks.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let d = PyDict::new(py);
            d.set_item("bytes_saved", self.bytes_saved)?;
            d.set_item("bytes_loaded", self.bytes_loaded)?;
            d.set_item("saves_in_flight", self.saves.len())?;
            d.set_item("save_waits", self.save_waits)?;
            d.set_item("bad_host_blocks", self.bad_host.len())?;
            d.set_item("host_ready_bytes", self.host.ready_bytes())?;
            if let Some(disk) = &self.disk {
                let p = disk.pending.0.lock();
                d.set_item("disk_written", p.written)?;
                d.set_item("disk_write_failures", p.write_failures)?;
                d.set_item("disk_writes_pending", p.by_slot.values().sum::<usize>())?;
                d.set_item("disk_reads", disk.reads)?;
                d.set_item("disk_misses", disk.misses)?;
            }
            Ok(d)
        })
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// A hold on one of a worker's copy streams (see `Worker._hold_stream`).
#[pyclass(module = "kvbm._kvbm")]
#[derive(Debug)]
pub struct CopyHold {
    hold: Mutex<Option<kvbm_cuda::StreamHold>>,
}

#[pymethods]
impl CopyHold {
    /// Lets the stream run again (idempotent).
    fn release(&self) {
        self.hold.lock().take();
    }
}

impl Worker {
    /// Waits (without the GIL) for the save transfers `pick` selects, settles them, and returns
    /// how many there were.
    fn wait_saves_where(&mut self, py: Python<'_>, pick: impl Fn(&PendingSave) -> bool) -> usize {
        let (chosen, rest): (Vec<PendingSave>, Vec<PendingSave>) =
            std::mem::take(&mut self.saves).into_iter().partition(pick);
        self.saves = rest;
        if chosen.is_empty() {
            return 0;
        }
        let results: Vec<bool> =
            py.allow_threads(|| chosen.iter().map(|s| s.completion.wait().is_ok()).collect());
        let n = chosen.len();
        for (save, ok) in chosen.into_iter().zip(results) {
            self.settle(save, ok);
        }
        self.save_waits += 1;
        n
    }

    /// Waits for the saves writing any of `hosts` (the same stream keeps earlier saves first,
    /// so a later save into the same block is never overtaken).
    fn wait_saves_touching(&mut self, py: Python<'_>, hosts: &HashSet<u32>) {
        self.wait_saves_where(py, |s| !s.host_blocks.is_disjoint(hosts));
    }

    /// Checks (host, gpu) pairs against the pools' sizes.
    fn check(&self, pairs: &[(u32, u32)]) -> PyResult<()> {
        for &(h, g) in pairs {
            if h as usize >= self.host_blocks || g as usize >= self.gpu.num_blocks() {
                return Err(LayoutError::new_err(format!(
                    "host block {h} / GPU block {g} outside {} host / {} GPU blocks",
                    self.host_blocks,
                    self.gpu.num_blocks()
                )));
            }
        }
        Ok(())
    }

    /// Waits (without the GIL) until the host blocks' memory is pinned.
    fn wait_blocks_ready(&self, py: Python<'_>, blocks: impl Iterator<Item = u32>) -> PyResult<()> {
        let Some(last) = blocks.max() else {
            return Ok(());
        };
        let end = (last as usize + 1) * self.kv.host_stride_bytes();
        if self.host.ready_bytes() >= end {
            return Ok(());
        }
        let host = self.host.clone();
        if py.allow_threads(|| host.wait_ready(end, HOST_READY_TIMEOUT)) {
            Ok(())
        } else {
            Err(DeviceError::new_err(format!(
                "host memory not pinned after {HOST_READY_TIMEOUT:?} ({} of {end} bytes ready)",
                self.host.ready_bytes()
            )))
        }
    }

    fn settle(&mut self, save: PendingSave, ok: bool) {
        if !ok {
            self.bad_host.extend(save.host_blocks);
        }
        for r in save.requests {
            if let Some(n) = self.save_pending.get_mut(&r) {
                *n -= 1;
                if *n == 0 {
                    self.save_pending.remove(&r);
                    self.save_done.push(r);
                }
            }
        }
    }
}

/// A transfer of `pieces` between the GPU regions and the host pool, keeping both alive.
fn transfer_of(pieces: &[CopyPiece], gpu_regions: &[GpuRegion], host: &HostRegion) -> Transfer {
    let mut transfer = Transfer::with_capacity(pieces.len());
    for p in pieces {
        transfer.push(p.src, p.dst, p.len);
    }
    for r in gpu_regions {
        transfer.keep(r.clone());
    }
    transfer.keep(host.clone());
    transfer
}

/// Byte offset of host block `h`'s payload in the host region.
fn host_offset(host: &HostRegion, layout: &BlockLayout, h: u32) -> usize {
    (layout.block_start(h as usize) - host.addr()) as usize
}

/// Starts the thread that writes host blocks to disk.
fn start_disk(
    store: Arc<DiskStore>,
    host: HostRegion,
    layout: BlockLayout,
    kv: KvLayout,
) -> PyResult<DiskSide> {
    let (jobs, receiver) = crossbeam_channel::bounded::<DiskWrite>(DISK_WRITES_QUEUED_MAX);
    let pending: Arc<(Mutex<DiskPending>, Condvar)> = Arc::default();
    let (thread_store, thread_pending) = (store.clone(), pending.clone());
    let thread = std::thread::Builder::new()
        .name("kvbm-py-disk".into())
        .spawn(move || {
            let bytes = kv.bytes_per_block();
            let mut buf = AlignedBuf::new(thread_store.payload_area_bytes()).ok();
            for (h, d, key, metadata) in receiver {
                let ok = buf.as_mut().is_some_and(|buf| {
                    host.read(
                        host_offset(&host, &layout, h),
                        &mut buf.as_mut_slice()[..bytes],
                    )
                    .is_ok()
                        && matches!(
                            thread_store.write_with_metadata(d, key, buf, &metadata),
                            Ok(WriteOutcome::Stored)
                        )
                });
                let (lock, cv) = &*thread_pending;
                lock.lock().done(h, d, ok);
                cv.notify_all();
            }
        })
        .map_err(|e| DeviceError::new_err(format!("cannot start the disk writer: {e}")))?;
    Ok(DiskSide {
        store,
        jobs: Some(jobs),
        pending,
        thread: Some(thread),
        reads: 0,
        misses: 0,
    })
}

/// Starts the thread that runs asynchronous loads.
fn start_loader(context: LoaderContext) -> PyResult<AsyncLoader> {
    let (jobs, receiver) = crossbeam_channel::bounded::<AsyncLoad>(ASYNC_LOADS_QUEUED_MAX);
    let done: Arc<Mutex<Vec<LoadDone>>> = Arc::default();
    let busy: Arc<(Mutex<usize>, Condvar)> = Arc::default();
    let (thread_done, thread_busy) = (done.clone(), busy.clone());
    let thread = std::thread::Builder::new()
        .name("kvbm-py-load".into())
        .spawn(move || {
            for job in receiver {
                let failed = context.run(&job);
                thread_done.lock().push((job.request, failed));
                let (lock, cv) = &*thread_busy;
                *lock.lock() -= 1;
                cv.notify_all();
            }
        })
        .map_err(|e| DeviceError::new_err(format!("cannot start the loader: {e}")))?;
    Ok(AsyncLoader {
        jobs: Some(jobs),
        done,
        busy,
        thread: Some(thread),
    })
}
