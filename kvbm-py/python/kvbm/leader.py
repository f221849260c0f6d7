"""The scheduler side of kvbm's vLLM connector, independent of vLLM.

:class:`KvbmLeader` follows vLLM's scheduler through the connector contract (see
``DynamoConnector``) using only the attributes it reads from vLLM's objects, so tests can drive
it with plain stand-ins.

What it does each step:

- ``get_num_new_matched_tokens``: counts the prompt's full blocks, after vLLM's own GPU prefix
  hit, that the host tier holds and then those continuing on disk, stopping at the first miss
  and never covering the whole prompt (vLLM must compute at least one token). No side effects.
- ``update_state_after_alloc``: holds the matched host and disk blocks and pairs them with the
  GPU blocks vLLM allocated (disk blocks through staging host blocks). A match held in host
  memory only is loaded synchronously within the worker's step (answered with async False); one
  that reaches the disk tier is loaded asynchronously (async True): the worker reads the disk and
  copies in the background, vLLM holds the request until the workers report it in
  ``finished_recving``, and its blocks stay held until then.
- ``build_connector_meta``: for every scheduled request, the blocks that become complete in this
  step are registered in the host tier (write-through offload) and paired with their GPU blocks
  for the workers to save; host blocks admitted to disk (seen twice) get a disk block to be
  written to.
- ``request_finished``: True when the request had saves, which the workers then report in
  ``finished_sending`` once they completed; until then vLLM keeps its GPU blocks.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

from . import _kvbm
from .events import KvEvent, from_tuples
from .metadata import KvbmConnectorMetadata
from .metrics import Metrics, global_metrics

log = logging.getLogger("kvbm")


class _Request:
    """What the leader tracks of one request."""

    __slots__ = (
        "request",
        "block_ids",
        "computed",
        "hashes",
        "offloaded_blocks",
        "had_offloads",
        "match",
        "lora",
        "salt",
        "finished",
        "unbacked_from",
    )

    def __init__(self, request: Any) -> None:
        self.request = request
        self.block_ids: List[int] = []
        self.computed = 0
        self.hashes: List[int] = []
        # Blocks (from the first) already in the host tier or offloaded.
        self.offloaded_blocks = 0
        self.had_offloads = False
        self.match: Optional[Tuple[int, int]] = None
        lora = getattr(request, "lora_request", None)
        self.lora = getattr(lora, "lora_name", None) if lora is not None else None
        self.salt = getattr(request, "cache_salt", None)
        self.finished = False
        # The first block vLLM counts as computed that the leader could not back (a load error):
        # its GPU bytes are garbage until vLLM recomputes it, so nothing from it on is offloaded
        # while vLLM still counts it computed.
        self.unbacked_from: Optional[int] = None


def _tokens(request: Any):
    tokens = getattr(request, "all_token_ids", None)
    if tokens is None:
        tokens = request.prompt_token_ids
    return tokens


def _group0(block_ids: Any) -> List[int]:
    """GPU block ids of the first KV cache group (kvbm manages one group)."""
    if block_ids is None:
        return []
    if hasattr(block_ids, "get_block_ids"):
        block_ids = block_ids.get_block_ids()
    if len(block_ids) and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids)


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
    ) -> None:
        self.block_size = int(block_size)
        self._native = _kvbm.Leader(
            self.block_size, int(host_blocks), int(disk_blocks), bool(disk_filter_disabled)
        )
        self._metrics = metrics or global_metrics()
        self._metrics.set("kvbm_host_blocks_capacity", host_blocks)
        self._requests: Dict[str, _Request] = {}
        self._onboarding: set = set()
        self._step = 0

    # -- helpers --------------------------------------------------------------------------

    @property
    def native(self) -> "_kvbm.Leader":
        """The native host tier (counts, registered hashes)."""
        return self._native

    def _state(self, request: Any) -> _Request:
        rid = request.request_id
        st = self._requests.get(rid)
        if st is None:
            st = _Request(request)
            self._requests[rid] = st
        else:
            st.request = request
        return st

    def _hashes(self, st: _Request, blocks: int) -> List[int]:
        """Sequence hashes of the request's first ``blocks`` full blocks (computed once)."""
        have = len(st.hashes)
        if blocks > have:
            b = self.block_size
            tokens = _tokens(st.request)[have * b : blocks * b]
            st.hashes.extend(
                _kvbm.sequence_hashes(
                    list(tokens),
                    b,
                    st.lora,
                    st.salt,
                    st.hashes[-1] if st.hashes else None,
                )
            )
        return st.hashes

    # -- the contract -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        st = self._state(request)
        b = self.block_size
        start = num_computed_tokens // b
        # Never the whole prompt: vLLM computes at least the last token.
        limit = max(0, (request.num_tokens - 1) // b)
        if limit <= start:
            st.match = None
            return 0, False
        hashes = self._hashes(st, limit)
        on_host, on_disk = self._native.count_prefix_tiers(hashes[start:limit])
        found = on_host + on_disk
        is_async = on_disk > 0
        self._metrics.inc("kvbm_lookup_tokens", (limit - start) * b)
        st.match = (start, found, is_async) if found else None
        return found * b, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._state(request)
        ids = _group0(blocks)
        if ids:
            st.block_ids = ids
        if num_external_tokens <= 0 or st.match is None:
            st.match = None
            return
        start, found, is_async = st.match
        st.match = None
        wanted = min(found, num_external_tokens // self.block_size)
        if len(ids) < start + wanted:
            log.warning(
                "request %s: %d GPU blocks for %d loaded blocks from %d; not loading",
                request.request_id,
                len(ids),
                wanted,
                start,
            )
            return
        rid = request.request_id
        got = self._native.plan_onboard(
            rid, st.hashes[start : start + wanted], ids[start : start + wanted], bool(is_async)
        )
        if got < wanted:
            # Evicted since they were counted: vLLM must recompute these (the plan reports them).
            st.unbacked_from = start + got
        if is_async:
            # Reported in finished_recving even when nothing could be held (then all failed).
            self._onboarding.add(rid)
        # Blocks onboarded from the host tier are there already; those from disk are offloaded
        # again as they complete (a no-op when the host tier still holds them).
        st.offloaded_blocks = max(st.offloaded_blocks, start + got if not is_async else start)

    def build_connector_meta(self, scheduler_output: Any) -> KvbmConnectorMetadata:
        b = self.block_size
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            st = self._requests.get(new.req_id)
            if st is None:
                st = _Request(new)  # never asked about (e.g. no prompt blocks): tokens from here
                self._requests[new.req_id] = st
            st.block_ids = _group0(new.block_ids)
            st.computed = new.num_computed_tokens
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            for i, rid in enumerate(cached.req_ids):
                st = self._requests.get(rid)
                if st is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if rid in resumed:
                    st.block_ids = _group0(new_ids)
                elif new_ids is not None:
                    st.block_ids.extend(_group0(new_ids))
                st.computed = cached.num_computed_tokens[i]
        # Blocks that complete in this step, per request: hashed, registered and paired in one
        # native call for the whole step, whatever the number of requests.
        work = []
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(rid)
            if st is None:
                continue
            tokens = _tokens(st.request)
            full = min((st.computed + scheduled) // b, len(st.block_ids), len(tokens) // b)
            if st.unbacked_from is not None:
                if st.computed > st.unbacked_from * b:
                    full = min(full, st.unbacked_from)  # vLLM has not rolled back yet
                else:
                    st.unbacked_from = None  # recomputed from there on: saved as it fills
            first = st.offloaded_blocks
            if full > first:
                work.append((rid, st, first, full, tokens[first * b : full * b]))
        if work:
            results = self._native.plan_offloads(
                [
                    (rid, span, st.hashes[first - 1] if first else None, st.lora, st.salt, st.block_ids[first:full])
                    for rid, st, first, full, span in work
                ]
            )
            for (rid, st, first, full, _), (hashes, offloaded) in zip(work, results):
                del st.hashes[first:]
                st.hashes.extend(hashes)
                st.offloaded_blocks = full
                if offloaded:
                    st.had_offloads = True
        plan = self._native.take_plan(sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        meta = KvbmConnectorMetadata(step=self._step, plan=bytes(plan))
        self._step += 1
        self._metrics.set("kvbm_host_blocks_registered", self._native.counts()["registered"])
        self._metrics.update(self._native.metrics())
        return meta

    def request_finished(self, request: Any, block_ids: Any = None) -> Tuple[bool, Optional[dict]]:
        st = self._requests.get(request.request_id)
        if st is None:
            return False, None
        if st.had_offloads:
            # The workers report it in finished_sending once its offloads completed.
            st.finished = True
            st.request = None
            return True, None
        if request.request_id in self._onboarding:
            # Finished (aborted) while its asynchronous onboard still copies into its GPU blocks:
            # vLLM keeps them until the workers report the request in finished_recving, which
            # frees them then (vllm/v1/core/sched/scheduler.py, _update_from_kv_xfer_finished).
            st.finished = True
            st.request = None
            return True, None
        del self._requests[request.request_id]
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            if rid in self._onboarding:
                self._onboarding.discard(rid)
                self._native.release(rid)
                st = self._requests.get(rid)
                if st is not None and st.finished and not st.had_offloads:
                    del self._requests[rid]
        bad = getattr(connector_output, "kv_connector_worker_meta", None)
        if bad is not None and (getattr(bad, "bad_host_blocks", None) or getattr(bad, "bad_disk_blocks", None)):
            # Blocks a worker could not fill: never matched again.
            self._native.discard(sorted(bad.bad_host_blocks), sorted(bad.bad_disk_blocks))
        for rid in getattr(connector_output, "finished_sending", None) or ():
            st = self._requests.get(rid)
            if st is not None and st.finished:
                del self._requests[rid]

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
        """Request ids the leader still tracks (finished ones wait for their saves)."""
        return list(self._requests)

    def counts(self) -> Dict[str, int]:
        return dict(self._native.counts())


def host_blocks_for(config: "_kvbm.Config", bytes_per_block: int, world_size: int) -> int:
    """Host blocks per rank for blocks of ``bytes_per_block`` bytes on each of ``world_size``
    ranks (``DYN_KVBM_CPU_CACHE_GB`` is the total over the ranks)."""
    return config.host_blocks(int(bytes_per_block), int(world_size))


__all__: Iterable[str] = ["KvbmLeader", "host_blocks_for"]
