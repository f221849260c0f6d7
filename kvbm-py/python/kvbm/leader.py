"""The scheduler side of kvbm's vLLM connector, independent of vLLM.

:class:`KvbmLeader` follows vLLM's scheduler through the connector contract (see
``DynamoConnector``) using only the attributes it reads from vLLM's objects, so tests can drive
it with plain stand-ins. It only converts: the per-request bookkeeping (GPU block ids, computed
tokens, hashes, how far each request is offloaded, its match, its holds), the tiers, the
registry and the step's plan are kvbm-core's (``kvbm_core::requests``, ``kvbm_core::leader``);
Python keeps each request object for its tokens and hands over only the tokens of the blocks
kvbm-core asks for.

What it does each step:

- ``get_num_new_matched_tokens``: counts the prompt's full blocks, after vLLM's own GPU prefix
  hit, that the host tier holds and then those continuing on disk, stopping at the first miss
  and never covering the whole prompt (vLLM must compute at least one token).
- ``update_state_after_alloc``: holds the matched host and disk blocks and pairs them with the
  GPU blocks vLLM allocated (disk blocks through staging host blocks). A match held in host
  memory only is onboarded synchronously within the worker's step (answered with async False);
  one that reaches the disk tier is onboarded asynchronously (async True): the worker reads the
  disk and copies in the background, vLLM holds the request until the workers report it in
  ``finished_recving``, and its blocks stay held until then.
- ``build_connector_meta``: for every scheduled request, the blocks that become complete in this
  step are registered in the host tier (write-through offload) and paired with their GPU blocks
  for the workers to offload; host blocks admitted to disk (seen twice) get a disk block to be
  written to. The plan goes to the workers as bytes.
- ``request_finished``: True when offloads of the request were planned (the workers report it in
  ``finished_sending`` once they completed) or its asynchronous onboard still runs (reported in
  ``finished_recving``); until then vLLM keeps its GPU blocks.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

from . import _kvbm
from .events import KvEvent, from_tuples
from .metadata import KvbmConnectorMetadata
from .metrics import Metrics, global_metrics

log = logging.getLogger("kvbm")


def _tokens(request: Any):
    tokens = getattr(request, "all_token_ids", None)
    if tokens is None:
        tokens = request.prompt_token_ids
    return tokens


def _per_group(block_ids: Any) -> List[List[int]]:
    """GPU block ids per KV cache group, from vLLM's ``KVCacheBlocks`` (``get_block_ids()``: a
    tuple with one list per group) or the scheduler output's tuple of lists; a flat list is one
    group's."""
    if block_ids is None:
        return []
    if hasattr(block_ids, "get_block_ids"):
        block_ids = block_ids.get_block_ids()
    if len(block_ids) and isinstance(block_ids[0], (list, tuple)):
        return [list(ids) for ids in block_ids]
    return [list(block_ids)]


class KvbmLeader:
    """The scheduler side: the host tier's block ids, its registry, the step's instructions."""

    def __init__(
        self,
        block_size: int,
        host_blocks: int,
        *,
        disk_blocks: int = 0,
        disk_filter_disabled: bool = False,
        metrics: Optional[Metrics] = None,
        recovery: Optional[Tuple[str, int, str]] = None,
        groups: Optional[List[Tuple[str, int]]] = None,
        config: Optional["_kvbm.Config"] = None,
        model_fingerprint: int = 0,
        world_size: int = 1,
    ) -> None:
        self.block_size = int(block_size)
        #: The model's KV cache groups ((kind, window tokens) each), None for one
        #: full-attention group.
        self.groups = groups
        # With DYN_KVBM_SHARED_URL in ``config``, the shared tier: its keys name
        # ``model_fingerprint`` (kvbm.vllm_integration.connector derives it from vLLM's config,
        # the same in every worker) and each of the ``world_size`` ranks' shards.
        self._native = _kvbm.Leader(
            self.block_size,
            int(host_blocks),
            int(disk_blocks),
            bool(disk_filter_disabled),
            groups,
            config=config,
            model_fingerprint=int(model_fingerprint),
            world_size=int(world_size),
        )
        #: Disk blocks adopted from the workers' files at start.
        self.adopted_disk_blocks = 0
        if recovery is not None and int(disk_blocks) > 0:
            # (disk directory, world size, vLLM instance id): the workers' cache files, opened
            # before the scheduler starts, may hold blocks of an earlier run (kvbm.recovery).
            from .recovery import read_agreed

            disk_dir, world_size, instance = recovery
            found, why = read_agreed(disk_dir, int(world_size), str(instance))
            if why:
                log.warning("kvbm leader: adopting no disk block: %s", why)
            elif found:
                outside = [e for e in found if e[0] >= int(disk_blocks)]
                if outside:
                    log.warning(
                        "kvbm leader: adopting no disk block: %d recovered blocks lie outside the "
                        "%d disk blocks configured now",
                        len(outside),
                        int(disk_blocks),
                    )
                    found = []
                try:
                    self.adopted_disk_blocks = self._native.adopt_disk(found) if found else 0
                except _kvbm.KvbmError as e:
                    # The tier starts empty (the slots are overwritten as it fills): a bad
                    # recovery file never keeps vLLM from starting.
                    log.warning("kvbm leader: adopting no disk block: %s", e)
                    self.adopted_disk_blocks = 0
                log.info(
                    "kvbm leader: adopted %d disk blocks that %d rank(s) recovered",
                    self.adopted_disk_blocks,
                    int(world_size),
                )
        self._metrics = metrics or global_metrics()
        self._metrics.set("kvbm_host_blocks_capacity", host_blocks)
        # The request objects (or vLLM's NewRequestData), for their tokens: kvbm-core's leader
        # keeps everything else of a request (block ids, computed tokens, hashes, offloads).
        self._objs: Dict[str, Any] = {}
        self._step = 0

    # -- helpers --------------------------------------------------------------------------

    @property
    def native(self) -> "_kvbm.Leader":
        """The native leader (tiers, registry, per-request bookkeeping)."""
        return self._native

    # -- the contract -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        rid = request.request_id
        self._objs[rid] = request
        b = self.block_size
        num_tokens = request.num_tokens
        limit = max(0, (num_tokens - 1) // b)
        have = self._native.hashed_blocks(rid)
        new_tokens = list(_tokens(request)[have * b : limit * b]) if limit > have else []
        lora = getattr(request, "lora_request", None)
        found, is_async = self._native.match_request(
            rid,
            new_tokens,
            num_computed_tokens,
            num_tokens,
            getattr(lora, "lora_name", None) if lora is not None else None,
            getattr(request, "cache_salt", None),
        )
        start = num_computed_tokens // b
        if limit > start:
            self._metrics.inc("kvbm_lookup_tokens", (limit - start) * b)
        return found, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._objs[request.request_id] = request
        self._native.allocated(request.request_id, _per_group(blocks), max(0, int(num_external_tokens)))

    def hit_sources(self, request: Any, num_external_tokens: int) -> Dict[str, int]:
        """``get_external_cache_hit_sources``: the external tokens vLLM granted the request's
        last onboard, split by the tier they come from (``"host"``, ``"disk"``; only non-zero
        counts; they add up to ``num_external_tokens``). Tokens of a request kvbm planned no
        onboard for are ``"external_unspecified"``, and so are those from the shared tier:
        vLLM 0.33's ``CacheHitSource`` (vllm/v1/metrics/cache_hit_source.py) names that member
        for a remote store."""
        n = int(num_external_tokens)
        if n <= 0:
            return {}
        split = self._native.hit_sources(request.request_id, n)
        if split is None:
            return {"external_unspecified": n}
        host, disk, shared = split
        return {k: v for k, v in (("host", host), ("disk", disk), ("external_unspecified", shared)) if v}

    def build_connector_meta(self, scheduler_output: Any) -> KvbmConnectorMetadata:
        objs = self._objs
        # A hybrid model's current block tables: vLLM nulls and frees sliding-window and Mamba
        # blocks in place, so a table kept by appending new block ids goes stale (vLLM 0.33's
        # scheduler offers the current ones during this call only:
        # SchedulerOutput.kv_connector_block_state, vllm/v1/core/sched/output.py).
        state = getattr(scheduler_output, "kv_connector_block_state", None) if self.groups else None

        mamba = [g for g, (kind, _) in enumerate(self.groups or ()) if kind == "mamba"]
        offers = (getattr(state, "boundary_state_offloads", None) or {}) if state is not None else {}
        b = self.block_size

        def current(rid: str) -> Optional[List[List[int]]]:
            if state is None:
                return None
            ids = state.get_block_ids(rid)
            if ids is None:
                return None
            tables = _per_group(ids)
            if mamba:
                # A Mamba group's blocks are stored only where vLLM hands over a boundary state
                # with its exact block (boundary_state_offloads: group, block, boundary tokens;
                # vLLM says these "cannot be reconstructed from a connector's append-only block
                # table", scheduler.py): kept at the position of the block ending at that
                # boundary, every other position of the group is left out (null).
                offered = {(g, blk, tokens) for g, blk, tokens in offers.get(rid, ())}
                for g in mamba:
                    if g < len(tables):
                        tables[g] = [
                            blk if (g, blk, (i + 1) * b) in offered else 0 for i, blk in enumerate(tables[g])
                        ]
            return tables

        new = []
        for req in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            if req.req_id not in objs:
                objs[req.req_id] = req  # never asked about (e.g. no prompt blocks): tokens from here
            lora = getattr(req, "lora_request", None)
            tables = current(req.req_id)
            new.append(
                (
                    req.req_id,
                    tables if tables is not None else _per_group(req.block_ids),
                    req.num_computed_tokens,
                    getattr(lora, "lora_name", None) if lora is not None else None,
                    getattr(objs[req.req_id], "cache_salt", None),
                )
            )
        cached_out = []
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            for rid, new_ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
                tables = current(rid)
                if tables is not None:
                    # The whole current table replaces the kept one, as for a resumed request.
                    cached_out.append((rid, tables, True, computed))
                    continue
                ids = None if new_ids is None else _per_group(new_ids)
                cached_out.append((rid, ids, rid in resumed, computed))
        work = []
        get = objs.get
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            obj = get(rid)
            if obj is not None:
                work.append((rid, scheduled, len(_tokens(obj))))
        # kvbm-core decides which blocks complete; it takes only their tokens.
        spans = self._native.schedule(new, cached_out, work)
        if spans:
            self._native.offload_spans(
                [list(_tokens(objs[work[i][0]])[first:end]) for i, first, end in spans]
            )
        plan = self._native.take_plan(sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        meta = KvbmConnectorMetadata(step=self._step, plan=bytes(plan))
        self._step += 1
        self._metrics.set("kvbm_host_blocks_registered", self._native.counts()["registered"])
        self._metrics.update(self._native.metrics())
        return meta

    def request_finished(self, request: Any, block_ids: Any = None) -> Tuple[bool, Optional[dict]]:
        # True while offloads of it or its asynchronous load may still touch its GPU blocks:
        # vLLM then keeps them until the workers report it (finished_sending, or
        # finished_recving for a load; vllm/v1/core/sched/scheduler.py,
        # _update_from_kv_xfer_finished).
        self._objs.pop(request.request_id, None)
        return self._native.request_finished(request.request_id), None

    def update_connector_output(self, connector_output: Any) -> None:
        bad = getattr(connector_output, "kv_connector_worker_meta", None)
        if bad is not None and (getattr(bad, "bad_host_blocks", None) or getattr(bad, "bad_disk_blocks", None)):
            # Blocks a worker could not fill: never matched again.
            self._native.discard(sorted(bad.bad_host_blocks), sorted(bad.bad_disk_blocks))
        recving = list(getattr(connector_output, "finished_recving", None) or ())
        sending = list(getattr(connector_output, "finished_sending", None) or ())
        if recving or sending:
            self._native.connector_output(recving, sending)

    def take_events(self) -> List[KvEvent]:
        return from_tuples(self._native.take_events())

    def reset_cache(self) -> bool:
        """Drops the tiers' contents; False (nothing dropped) while blocks are being copied."""
        try:
            self._native.reset()
        except _kvbm.KvbmError as e:
            log.warning("kvbm: cache reset refused: %s", e)
            return False
        return True

    # -- inspection -------------------------------------------------------------------------

    def tracked_requests(self) -> List[str]:
        """Request ids the leader still tracks (finished ones wait for their workers)."""
        return self._native.tracked_requests()

    def counts(self) -> Dict[str, int]:
        return dict(self._native.counts())


def host_blocks_for(config: "_kvbm.Config", bytes_per_block: int, world_size: int) -> int:
    """Host blocks per rank for blocks of ``bytes_per_block`` bytes on each of ``world_size``
    ranks (``DYN_KVBM_CPU_CACHE_GB`` is the total over the ranks)."""
    return config.host_blocks(int(bytes_per_block), int(world_size))


__all__: Iterable[str] = ["KvbmLeader", "host_blocks_for"]
