//! `Leader`: the Python face of kvbm-core's [`kvbm_core::Leader`] (the scheduler side's host and
//! disk tiers of block ids). Conversions only: tuples and dicts in and out, core's errors
//! through `core_err`, hashing without the GIL.

use kvbm_core::leader::{self as core, OffloadBlock};
use kvbm_core::requests::{Requests, Scheduled};
use kvbm_core::{KvEvent, Tier};
use parking_lot::{Mutex, MutexGuard};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{core_err, guard, LayoutError};

/// One event as Python sees it: (kind, medium, block hashes, parent, token ids, block size,
/// lora name, shared pool name (None: the worker's own tier)).
type EventTuple = (
    &'static str,
    &'static str,
    Vec<u64>,
    Option<u64>,
    Vec<u32>,
    u32,
    Option<String>,
    Option<String>,
);

/// A disk read for an onboard: (disk block, staging host block, key).
type DiskRead = (u32, u32, u64);

/// A disk write: (host block, disk block, key, identity bytes for the block's header).
type DiskWrite = (u32, u32, u64, Vec<u8>);

/// A new request: (id, GPU block ids, computed tokens, LoRA name, cache salt).
type NewTuple = (String, Vec<Vec<u32>>, usize, Option<String>, Option<String>);
/// A cached request: (id, new GPU block ids or None, resumed, computed tokens).
type CachedTuple = (String, Option<Vec<Vec<u32>>>, bool, usize);

/// The scheduler side's host and disk tiers (kvbm-core's leader). Calls from several threads
/// are serialized: each waits, without the GIL, for the one before it.
#[pyclass(module = "kvbm._kvbm", frozen)]
#[derive(Debug)]
pub struct Leader {
    state: Mutex<LeaderState>,
}

struct LeaderState {
    inner: core::Leader,
    /// The per-request bookkeeping of vLLM's scheduler side.
    requests: Requests,
}

impl std::fmt::Debug for LeaderState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl Leader {
    fn lock(&self, py: Python<'_>) -> PyResult<crate::Held<MutexGuard<'_, LeaderState>>> {
        crate::lock_serialized(py, &self.state)
    }
}

#[pymethods]
impl Leader {
    /// A host tier of `host_blocks` blocks of `block_size` tokens, and a disk tier of
    /// `disk_blocks` (0: none). Host blocks go to disk when seen twice (registered, then matched
    /// again) within about ten minutes, or at once with `disk_filter_disabled`.
    ///
    /// `groups`: a hybrid model's KV cache groups in vLLM's order, each `(kind, window
    /// tokens)` with kind `"full_attention"`, `"sliding_window"` (with its window),
    /// `"chunked_local_attention"` (with its chunk) or `"mamba"` (vLLM's `align` mode); None:
    /// one full-attention group. Block ids are then
    /// given per group everywhere.
    #[new]
    #[pyo3(signature = (block_size, host_blocks, disk_blocks=0, disk_filter_disabled=false, groups=None, *, config=None, model_fingerprint=0, world_size=1))]
    #[allow(clippy::too_many_arguments)] // vLLM's sizes, then the shared tier's
    fn new(
        block_size: usize,
        host_blocks: usize,
        disk_blocks: usize,
        disk_filter_disabled: bool,
        groups: Option<Vec<(String, usize)>>,
        config: Option<PyRef<'_, crate::config::Config>>,
        model_fingerprint: u64,
        world_size: usize,
    ) -> PyResult<Self> {
        guard(|| {
            // Sizes that do not fit are the caller's values: a ValueError naming the argument.
            core::check_sizes(
                block_size,
                host_blocks,
                disk_blocks,
                kvbm_core::config::machine_memory_bytes(),
            )
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
            let groups = match groups {
                None => kvbm_core::Groups::single(block_size),
                Some(list) => {
                    let kinds = list
                        .into_iter()
                        .enumerate()
                        .map(|(g, (kind, window))| group_kind(g, &kind, window))
                        .collect::<PyResult<Vec<_>>>()?;
                    kvbm_core::Groups::new(kinds, block_size)
                        .map_err(|e| PyValueError::new_err(e.to_string()))?
                }
            };
            let shared = crate::config::shared_tier(
                config.as_ref().map(|c| &c.inner),
                model_fingerprint,
                !groups.is_single_full(),
                "leader",
            )?;
            let world = world_size.max(1);
            let mut leader =
                core::Leader::new(block_size, host_blocks, disk_blocks, disk_filter_disabled)
                    .map_err(core_err)?;
            if let Some(options) = shared {
                // Each rank's shard lives under its own key fingerprint; the leader's store
                // only looks up, so its own fingerprint and block size do not matter.
                let fingerprints: Vec<u64> = (0..world)
                    .map(|r| kvbm_core::shared::shard_fingerprint(model_fingerprint, r, world))
                    .collect();
                let store = kvbm_core::shared::SharedStore::open(options, fingerprints[0], 0)
                    .map_err(core_err)?;
                leader = leader.with_shared(store, fingerprints);
            }
            Ok(leader)
                .map(|inner| Self {
                    state: Mutex::new(LeaderState {
                        inner,
                        requests: Requests::with_groups(groups),
                    }),
                })
                .map_err(core_err)
        })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        Ok(s.inner.block_size())
    }

    /// The current step (incremented by `end_step`).
    #[getter]
    fn step(&self, py: Python<'_>) -> PyResult<u64> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        Ok(s.inner.step())
    }

    /// How many of `hashes`, from the first, the host tier holds (no side effects).
    fn count_prefix(&self, py: Python<'_>, hashes: Vec<u64>) -> PyResult<usize> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| Ok(s.inner.count_prefix(&hashes)))
    }

    /// (host, disk): how many of `hashes`, from the first, the host tier holds, then how many
    /// more continue on disk and can be onboarded now. No side effects.
    fn count_prefix_tiers(&self, py: Python<'_>, hashes: Vec<u64>) -> PyResult<(usize, usize)> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| Ok(s.inner.count_prefix_tiers(&hashes)))
    }

    /// Holds what an onboard of `hashes` needs: (host blocks of the held prefix, disk reads of
    /// (disk block, staging host block, key) for the blocks continuing it on disk). Held two
    /// steps, or, with `request_id` (an asynchronous onboard), until `release(request_id)`.
    #[pyo3(signature = (hashes, request_id=None))]
    fn hold_onboard(
        &self,
        py: Python<'_>,
        hashes: Vec<u64>,
        request_id: Option<String>,
    ) -> PyResult<(Vec<u32>, Vec<DiskRead>)> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            let plan = s.inner.hold_onboard(&hashes, request_id.as_deref());
            let reads = plan
                .disk_reads
                .iter()
                .map(|r| (r.disk, r.host, r.key))
                .collect();
            Ok((plan.host, reads))
        })
    }

    /// Drops host and disk blocks the workers reported bad (their offload or disk write failed,
    /// or a disk block failed verification); returns how many were registered.
    fn discard(&self, py: Python<'_>, host: Vec<u32>, disk: Vec<u32>) -> PyResult<usize> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| Ok(s.inner.discard(&host, &disk)))
    }

    /// Releases what an asynchronous onboard of `request_id` held (when its onboard finished).
    fn release(&self, py: Python<'_>, request_id: &str) -> PyResult<bool> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| Ok(s.inner.release(request_id)))
    }

    /// Adopts what the workers' disk files held when they opened ((disk block, key, identity
    /// bytes), as `Worker.take_recovered_disk` gives them, agreed by every rank): each block
    /// with a readable identity joins the disk tier and is announced. Only while the disk tier
    /// is empty. Returns how many were adopted.
    fn adopt_disk(&self, py: Python<'_>, found: Vec<(u32, u64, Vec<u8>)>) -> PyResult<usize> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| s.inner.adopt_disk(found).map_err(core_err))
    }

    /// The disk writes of the blocks admitted since the last call, as (host block, disk block,
    /// key, identity bytes).
    fn take_disk_writes(&self, py: Python<'_>) -> PyResult<Vec<DiskWrite>> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            let writes = s.inner.take_disk_writes().map_err(core_err)?;
            Ok(writes
                .into_iter()
                .map(|w| (w.host, w.disk, w.key, w.identity))
                .collect())
        })
    }

    /// Registers the blocks ((sequence hash, parent hash, tokens)) not in the host tier yet and
    /// returns, per block, the host block id to offload it into, or None.
    #[pyo3(signature = (blocks, lora_name=None))]
    fn offload(
        &self,
        py: Python<'_>,
        blocks: Vec<(u64, Option<u64>, Vec<u32>)>,
        lora_name: Option<String>,
    ) -> PyResult<Vec<Option<u32>>> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            let blocks = blocks
                .into_iter()
                .map(|(hash, parent, tokens)| OffloadBlock {
                    hash,
                    parent,
                    tokens,
                })
                .collect();
            s.inner
                .offload(blocks, lora_name.as_deref())
                .map_err(core_err)
        })
    }

    /// Closes the step: its plan as MessagePack bytes (for the workers' `bind`), with the disk
    /// writes admitted meanwhile and the requests vLLM preempted; then ends the step.
    fn take_plan<'py>(
        &self,
        py: Python<'py>,
        preempted: Vec<String>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            let plan = s.inner.take_plan(preempted).map_err(core_err)?;
            Ok(crate::worker::plan_bytes(py, &plan))
        })
    }

    // -- vLLM's scheduler side, per request ---------------------------------------------------

    /// Blocks of `request` already hashed: `match_request` takes the tokens after them.
    fn hashed_blocks(&self, py: Python<'_>, request: &str) -> PyResult<usize> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        Ok(s.requests.hashed_blocks(request))
    }

    /// `get_num_new_matched_tokens`: `new_tokens` are the request's tokens after its hashed
    /// blocks (whole blocks, up to the block of its last token). Returns (tokens found on host
    /// and disk after `num_computed`, asynchronous).
    #[pyo3(signature = (request, new_tokens, num_computed, num_tokens, lora_name=None, cache_salt=None))]
    #[allow(clippy::too_many_arguments)]
    fn match_request(
        &self,
        py: Python<'_>,
        request: &str,
        new_tokens: Vec<u32>,
        num_computed: usize,
        num_tokens: usize,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<(usize, bool)> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        // Hashing, and with a shared tier its lookup (a round trip to the server, bounded by
        // its timeout), run without the GIL: vLLM's other threads (the API server's, in one
        // process) go on meanwhile.
        guard(|| {
            let (requests, inner) = (&mut s.requests, &s.inner);
            py.allow_threads(|| {
                requests.match_prefix(
                    inner,
                    request,
                    &new_tokens,
                    num_computed,
                    num_tokens,
                    lora_name,
                    cache_salt,
                )
            })
            .map_err(core_err)
        })
    }

    /// `get_external_cache_hit_sources`: the `tokens` of the request's last onboard split into
    /// (from the host tier, from disk, from the shared tier), or None when none was planned.
    fn hit_sources(
        &self,
        py: Python<'_>,
        request: &str,
        tokens: usize,
    ) -> PyResult<Option<(usize, usize, usize)>> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        Ok(s.requests.hit_sources(request, tokens))
    }

    /// `update_state_after_alloc`: the request's GPU block ids and the external tokens vLLM
    /// granted; plans the onboard of its match. Returns whether it is asynchronous.
    fn allocated(
        &self,
        py: Python<'_>,
        request: &str,
        block_ids: Vec<Vec<u32>>,
        num_external_tokens: usize,
    ) -> PyResult<bool> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            s.requests
                .allocated(&mut s.inner, request, block_ids, num_external_tokens)
                .map_err(core_err)
        })
    }

    /// `build_connector_meta`, first half: the scheduler's new requests ((id, block ids,
    /// computed tokens, LoRA, salt)) and cached ones ((id, new block ids or None, resumed,
    /// computed tokens)), and per scheduled request (id, scheduled tokens, its token count).
    /// Returns the spans (index into `work`, first token, end token) whose tokens
    /// `offload_spans` takes, in that order.
    fn schedule(
        &self,
        py: Python<'_>,
        new: Vec<NewTuple>,
        cached: Vec<CachedTuple>,
        work: Vec<(String, usize, usize)>,
    ) -> PyResult<Vec<(usize, usize, usize)>> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            let mut scheduled: Vec<Scheduled> = new
                .into_iter()
                .map(
                    |(request, block_ids, computed, lora, salt)| Scheduled::New {
                        request,
                        block_ids,
                        computed,
                        lora,
                        salt,
                    },
                )
                .collect();
            scheduled.extend(cached.into_iter().map(
                |(request, new_block_ids, resumed, computed)| Scheduled::Cached {
                    request,
                    new_block_ids,
                    resumed,
                    computed,
                },
            ));
            Ok(s.requests
                .schedule(scheduled, &work)
                .map_err(core_err)?
                .into_iter()
                .map(|s| (s.index, s.first_token, s.end_token))
                .collect())
        })
    }

    /// `build_connector_meta`, second half: the tokens of each span `schedule` returned.
    /// Hashing and registration run without the GIL.
    fn offload_spans(&self, py: Python<'_>, tokens: Vec<Vec<u32>>) -> PyResult<()> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            let (requests, inner) = (&mut s.requests, &mut s.inner);
            py.allow_threads(|| requests.offload_spans(inner, tokens))
                .map_err(core_err)
        })
    }

    /// `request_finished`: True when vLLM must keep the request's blocks until the workers
    /// report it.
    fn request_finished(&self, py: Python<'_>, request: &str) -> PyResult<bool> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        Ok(s.requests.finished(request))
    }

    /// `update_connector_output`: asynchronous onboards that ended, finished offloads.
    fn connector_output(
        &self,
        py: Python<'_>,
        finished_recving: Vec<String>,
        finished_sending: Vec<String>,
    ) -> PyResult<()> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        s.requests
            .connector_output(&mut s.inner, &finished_recving, &finished_sending);
        Ok(())
    }

    /// The requests tracked (finished ones wait for their workers).
    fn tracked_requests(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        Ok(s.requests.tracked())
    }

    /// kvbm-core's counters of this leader, under Dynamo's metric names.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // The dict is made once the lock is released (making it may run finalizers).
        let snapshot = guard(|| Ok(self.lock(py)?.inner.metrics().snapshot()))?;
        guard(|| crate::leader_metrics(py, &snapshot))
    }

    /// Ends a step: blocks handed out two steps ago become evictable again.
    fn end_step(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            s.inner.end_step();
            Ok(())
        })
    }

    /// Drops every held block and clears the tiers' registries (one `AllBlocksCleared`).
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| s.inner.reset().map_err(core_err))
    }

    /// The events since the last call, as (kind, medium, hashes, parent, tokens, block size,
    /// lora name) with kind "stored", "removed" or "cleared".
    fn take_events(&self, py: Python<'_>) -> PyResult<Vec<EventTuple>> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            Ok(s.inner
                .take_events()
                .into_iter()
                .map(|event| {
                    let stored = |s: kvbm_core::BlockStoredEvent, medium, pool| {
                        (
                            "stored",
                            medium,
                            s.block_hashes.iter().map(|h| h.0).collect(),
                            s.parent_hash.map(|h| h.0),
                            s.token_ids,
                            s.block_size,
                            s.lora_name,
                            pool,
                        )
                    };
                    let removed = |r: kvbm_core::BlockRemovedEvent, medium, pool| {
                        (
                            "removed",
                            medium,
                            r.block_hashes.iter().map(|h| h.0).collect(),
                            None,
                            Vec::new(),
                            0,
                            None,
                            pool,
                        )
                    };
                    match event {
                        KvEvent::BlockStored(s) => {
                            let medium = s.tier.medium_name();
                            stored(s, medium, None)
                        }
                        KvEvent::BlockRemoved(r) => {
                            let medium = r.tier.medium_name();
                            removed(r, medium, None)
                        }
                        KvEvent::SharedStored { pool, stored: s } => {
                            stored(s, kvbm_core::shared::EVENT_MEDIUM, Some(pool))
                        }
                        KvEvent::SharedRemoved { pool, removed: r } => {
                            removed(r, kvbm_core::shared::EVENT_MEDIUM, Some(pool))
                        }
                        KvEvent::AllBlocksCleared => {
                            ("cleared", "", Vec::new(), None, Vec::new(), 0, None, None)
                        }
                    }
                })
                .collect())
        })
    }

    /// The host tier's counts (capacity, free, registered, idle, held, evictions,
    /// deduplicated), the disk tier's (`disk_`-prefixed) and `events_lost`.
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // The dict is made once the lock is released (making it may run finalizers).
        let counts = guard(|| Ok(self.lock(py)?.inner.counts()))?;
        guard(|| {
            let (c, d) = (counts.host, PyDict::new(py));
            if let Some(k) = counts.disk {
                d.set_item("disk_capacity", k.capacity)?;
                d.set_item("disk_registered", k.registered)?;
                d.set_item("disk_held", k.registered - k.idle)?;
                d.set_item("disk_evictions", k.evictions)?;
            }
            d.set_item("capacity", c.capacity)?;
            d.set_item("free", c.free)?;
            d.set_item("registered", c.registered)?;
            d.set_item("idle", c.idle)?;
            d.set_item("held", c.registered - c.idle)?;
            d.set_item("evictions", c.evictions)?;
            d.set_item("deduplicated", c.deduplicated)?;
            d.set_item("events_lost", counts.events_lost)?;
            Ok(d)
        })
    }

    /// The hashes a tier ("host" or "disk") holds (for checks).
    #[pyo3(signature = (tier="host"))]
    fn registered_hashes(&self, py: Python<'_>, tier: &str) -> PyResult<Vec<u64>> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        guard(|| {
            let tier = match tier {
                "host" => Tier::Host,
                "disk" => Tier::Disk,
                other => {
                    return Err(LayoutError::new_err(format!(
                        "tier {other:?}: expected host or disk"
                    )))
                }
            };
            Ok(s.inner.registered_hashes(tier))
        })
    }

    /// Calls `f` while this leader's lock is held (for tests of calls back into the leader from
    /// Python code run under the lock, which raise `RuntimeError`).
    fn _with_lock_held(&self, py: Python<'_>, f: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        let _held = self.lock(py)?;
        Ok(f.call0()?.unbind())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let mut g = self.lock(py)?;
        let s = &mut *g;
        Ok(format!("{s:?}"))
    }
}

/// A group's kind from its name (`Leader(groups=...)`); an unknown one is a ValueError naming
/// the group.
fn group_kind(group: usize, kind: &str, window: usize) -> PyResult<kvbm_core::GroupKind> {
    match kind {
        "full_attention" => Ok(kvbm_core::GroupKind::Full),
        "sliding_window" => Ok(kvbm_core::GroupKind::SlidingWindow {
            window_tokens: window,
        }),
        "chunked_local_attention" => Ok(kvbm_core::GroupKind::ChunkedLocal {
            chunk_tokens: window,
        }),
        "mamba" => Ok(kvbm_core::GroupKind::MambaAlign),
        other => Err(PyValueError::new_err(format!(
            "KV cache group {group}: kind {other:?} is not one kvbm serves \
             (full_attention, sliding_window, chunked_local_attention, mamba)"
        ))),
    }
}
