"""The GPU worker side of kvbm's vLLM connector, independent of vLLM.

:class:`KvbmWorker` registers vLLM's KV cache tensors (or anything exposing ``data_ptr()``,
``shape``, ``stride()``, ``element_size()``, ``device``), owns this rank's shard of the pinned host
pool and its copy streams, and executes the leader's step plans. Everything that moves bytes is
kvbm-core's worker (``_kvbm.Worker``); this class only follows vLLM's call order. Any layout vLLM hands over is
taken: vLLM 0.33's ``[B, H, N, C]`` views of one backing buffer in every ``KVCacheLayout`` (the
views are not contiguous tensors), MLA, and the older per-layer 5-D tensors; kvbm-core derives
each block's runs from the shapes and strides, so under a block-outermost layout (BLNHC, which
the connector asks vLLM for) one block is one copy in each direction.

vLLM 0.33's worker order (``vllm/v1/worker/gpu/kv_connector.py``, ``ActiveKVConnector``):
``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv`` before the forward only
when the step has synchronous loads (otherwise after it), ``wait_for_layer_load`` /
``save_kv_layer`` inside the forward, ``wait_for_save``, ``get_finished``,
``get_block_ids_with_load_errors``, ``clear_connector_metadata``. So:

- ``handle_preemptions``: waits for the offloads of the requests vLLM preempted in this step,
  whose GPU blocks vLLM hands to other requests (and the forward overwrites) as soon as it
  returns;
- ``start_load_kv``: reads the step's disk blocks into their staging host blocks and starts the
  step's onboards (one job per onboard stage: per layer, or per block under a block-outermost
  layout), each after the offloads into the host blocks it reads; asynchronous onboards go to
  the worker's loaders, several at once;
- ``wait_for_layer_load``: waits for the stage holding that layer;
- ``wait_for_save``: starts the step's offloads, ordered on the device after the forward pass
  that writes the blocks (an event on vLLM's stream; the host does not wait), then
  queues the step's disk writes (after the offloads into those host blocks);
- ``wait_for_save`` on a plan with ``fence_offloads`` (the step offloads blocks of a
  sliding-window or Mamba group, which vLLM frees mid-request and may overwrite in the next
  step): vLLM's stream then waits on the device for the step's offloads (the emulated device:
  the host waits);
- ``get_finished`` (0.32) / ``get_transfer_results`` (0.33): reports finished requests whose
  offloads all completed (vLLM frees their GPU blocks only then), and requests whose
  asynchronous onboards are done; their failed blocks are reported by
  ``get_block_ids_with_load_errors`` in the same pass, or, for a model of several KV cache
  groups (where vLLM 0.33 refuses block errors), the requests in ``failed_recving``.

A hybrid model's caches (vLLM 0.33's hybrid KV cache manager) are taken as they come: every
layer of every group, views of one buffer whose groups alias the same bytes, Mamba /
linear-attention state as 1-byte views inside the attention pages; a block is the union of
their bytes, copied once, whichever group owns the block id. Mamba layers get no
``wait_for_layer_load`` (vLLM calls it for attention layers only).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from . import _kvbm
from ._kvbm import LayoutError
from .metadata import KvbmConnectorMetadata, KvbmWorkerMetadata
from .metrics import Metrics, global_metrics

log = logging.getLogger("kvbm")

def _num_blocks_of(shape: Sequence[int]) -> int:
    """vLLM's block count as a tensor shows it (used when no ``kv_cache_config`` says it)."""
    if len(shape) == 5 and shape[0] == 2:
        return int(shape[1])  # [2, B, N, H, D]
    return int(shape[0])  # [B, H, N, C], [B, 2, N, H, D], [B, N, D]


def _attention_head_size(kv_cache_config: Any) -> Optional[int]:
    """The head size of the first KV cache group whose spec has one: an attention group. A
    hybrid model's group 0 may be a Mamba / linear-attention group, whose ``MambaSpec`` has no
    ``head_size`` (``vllm/v1/kv_cache_interface.py``)."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        head_size = getattr(getattr(group, "kv_cache_spec", None), "head_size", None)
        if head_size:
            return int(head_size)
    return None


def _outer_dim(kv_cache_config: Any, shapes: Sequence[Sequence[int]]) -> Optional[int]:
    """2 when a 0.33 view's content axis is K and V side by side, 1 for MLA's latent, from the
    attention spec (``head_size``) and the attention views among ``shapes`` (a hybrid model's
    Mamba views are ``[B, 1, 1, state bytes]``); None when the shapes themselves say it or
    nothing does."""
    if not shapes or len(shapes[0]) != 4:
        return None
    head_size = _attention_head_size(kv_cache_config)
    if not head_size:
        return None
    content = {int(shape[-1]) for shape in shapes if len(shape) == 4}
    if 2 * head_size in content:
        return 2
    return 1 if head_size in content else None


def _num_kv_cache_groups(kv_cache_config: Any) -> int:
    """vLLM's KV cache groups (``kv_cache_config.kv_cache_groups``), at least 1."""
    return max(1, len(getattr(kv_cache_config, "kv_cache_groups", None) or ()))


def _layout_salt(kv_cache_config: Any) -> int:
    """For a model of several KV cache groups, what decides which layers' bytes a block holds
    besides its layout: each group's spec kind, window and layer names (vLLM's planner assigns
    layers to groups; `_get_kv_cache_groups_uniform_page_size`). It joins the disk file's
    fingerprint, so a file written under another grouping is discarded, never read into other
    layers. 0 (nothing) for one group, whose files stay as they were."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) < 2:
        return 0
    import hashlib

    desc = repr(
        [
            (
                type(g.kv_cache_spec).__name__,
                getattr(g.kv_cache_spec, "sliding_window", None),
                getattr(g.kv_cache_spec, "attention_chunk_size", None),
                list(getattr(g, "layer_names", []) or []),
            )
            for g in groups
        ]
    )
    return int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8).digest(), "little") or 1


class TransferResults:
    """What ``get_transfer_results`` reports, with the fields of vLLM 0.33's
    ``KVConnectorTransferResults`` (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``);
    a failed receive is in ``finished_recving`` too."""

    __slots__ = ("finished_sending", "finished_recving", "failed_recving")

    def __init__(self, finished_sending: Set[str], finished_recving: Set[str], failed_recving: Set[str]) -> None:
        self.finished_sending = finished_sending
        self.finished_recving = finished_recving
        self.failed_recving = failed_recving

    def __repr__(self) -> str:
        return (
            f"TransferResults(finished_sending={self.finished_sending}, "
            f"finished_recving={self.finished_recving}, failed_recving={self.failed_recving})"
        )


def describe_kv_caches(kv_caches: Dict[str, Any], num_blocks: Optional[int] = None) -> Dict[str, Any]:
    """How kvbm would address these tensors: layout name, runs per block, bytes per block,
    distinct layers. Raises ``LayoutError`` (naming the tensor, its shape and strides) for a
    layout kvbm cannot address or a tensor that reaches outside its storage."""
    if not kv_caches:
        raise LayoutError("register_kv_caches: no KV cache tensors")
    first = next(iter(kv_caches.values()))
    return _kvbm.describe_kv_caches(dict(kv_caches), num_blocks or _num_blocks_of(tuple(first.shape)))


def _device_of(tensor: Any) -> Tuple[str, int]:
    device = getattr(tensor, "device", None)
    kind = getattr(device, "type", None) or str(device or "cpu")
    if kind.startswith("cuda"):
        index = getattr(device, "index", None)
        return "cuda", int(index or 0)
    # Host memory (tests, CPU stand-ins): the emulated device copies it with memcpy.
    return "emulated", 0


class KvbmWorker:
    """One GPU worker's side of kvbm: registered tensors, pinned host shard, copy streams."""

    def __init__(
        self,
        *,
        host_blocks: Optional[int] = None,
        disk_blocks: Optional[int] = None,
        world_size: int = 1,
        rank: int = 0,
        config: Optional["_kvbm.Config"] = None,
        metrics: Optional[Metrics] = None,
        device: Optional[str] = None,
        kv_cache_config: Any = None,
        publisher: Any = None,
        instance_id: Optional[str] = None,
        num_kv_cache_groups: Optional[int] = None,
        model_fingerprint: int = 0,
        shards: Optional[int] = None,
    ) -> None:
        self._kv_cache_config = kv_cache_config
        # vLLM 0.33 refuses block-level load errors for a model of several KV cache groups
        # (scheduler.py, _handle_invalid_blocks raises): failed loads are then reported per
        # request (get_transfer_results' failed_recving). Given, or from kv_cache_config.
        self._num_groups = int(num_kv_cache_groups or _num_kv_cache_groups(kv_cache_config))
        # Requests whose asynchronous loads failed, not reported yet (several groups only).
        self._failed_recving: Set[str] = set()
        # GPU blocks that failed outside an asynchronous load, which vLLM cannot take with
        # several groups: dropped (logged), counted here.
        self.unreportable_load_errors = 0
        # Publishes this worker's values for the instance's metrics server when that runs in
        # another process (kvbm.metrics.WorkerPublisher).
        self._publisher = publisher
        # With it, what this rank's disk file held is written for the leader of the same vLLM
        # instance to adopt (kvbm.recovery).
        self._instance_id = instance_id
        # The shared tier's keys name it (see KvbmLeader).
        self._model_fingerprint = int(model_fingerprint)
        # This rank's shard among them (tensor x pipeline parallel; default the world size).
        self._shards = int(shards) if shards else int(world_size)
        self._host_blocks = host_blocks
        self._disk_blocks = disk_blocks
        self._world_size = int(world_size)
        self._rank = int(rank)
        self._config = config
        self._metrics = metrics or global_metrics()
        self._device = device
        self._native: Optional[_kvbm.Worker] = None
        self._layers: Dict[str, int] = {}
        self._meta: Optional[KvbmConnectorMetadata] = None
        self._has_offloads = False
        self._failed: Set[int] = set()
        self._bad_host: Set[int] = set()
        self._bad_disk: Set[int] = set()
        # The CUDA stream vLLM runs the forward pass on, as a handle (CUDA only).
        self._stream = None
        self.last_fence = "none"

    @property
    def native(self) -> "_kvbm.Worker":
        if self._native is None:
            raise RuntimeError("register_kv_caches() has not been called")
        return self._native

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        if not kv_caches:
            raise LayoutError("register_kv_caches: no KV cache tensors")
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        shape = tuple(int(d) for d in tensors[0].shape)
        kcc = self._kv_cache_config
        num_blocks = int(getattr(kcc, "num_blocks", 0) or 0) or _num_blocks_of(shape)
        described = _kvbm.describe_kv_caches(dict(kv_caches), num_blocks)
        bytes_per_block = int(described["bytes_per_block"])
        # Sizes given here win; otherwise they come from the configuration (the environment).
        host_blocks, disk_blocks = self._host_blocks, self._disk_blocks
        config = self._config
        if config is None and host_blocks is None:
            config = _kvbm.Config.from_env()
        if host_blocks is None:
            host_blocks = config.host_blocks(bytes_per_block, self._world_size)
        if disk_blocks is None:
            disk_blocks = config.disk_blocks(bytes_per_block, self._world_size) if config else 0
        if config is not None:
            # Sizes that do not fit the machine are named now, not met as an allocation failure.
            config.check_fits(described["host_block_bytes"], described["disk_slot_bytes"], self._world_size)
        device, index = _device_of(tensors[0])
        if self._device is not None:
            device = self._device
        if device == "cuda":
            # kvbm.testing's tensors over simulated device memory bring their own.
            self._stream = getattr(tensors[0], "kvbm_current_stream", None)
            if self._stream is None:
                import torch  # type: ignore

                # The stream current when the step's copies start (vLLM may run the forward on
                # another one than at registration).
                self._stream = lambda: int(torch.cuda.current_stream(index).cuda_stream)
        self._native = _kvbm.Worker(
            dict(kv_caches),
            num_blocks,
            int(host_blocks),
            config=config,
            outer_dim=_outer_dim(kcc, [tuple(t.shape) for t in tensors]),
            device=device,
            device_index=index,
            disk_blocks=int(disk_blocks),
            disk_file=f"kvbm-rank{self._rank}.cache",
            layout_salt=_layout_salt(kcc),
            model_fingerprint=self._model_fingerprint,
            rank=self._rank,
            world_size=self._shards,
        )
        self._layers = {n: i for i, n in enumerate(names)}
        if self._publisher is not None:
            # The counters move after the engine's last call (see kvbm.metrics).
            self._publisher.keep_fresh(self._refresh_metrics)
        # vLLM's own tensors: restore_kv_caches re-reads them (sleep mode may remap them).
        self._kv_caches = dict(kv_caches)
        if int(disk_blocks) > 0 and self._instance_id is not None:
            from .recovery import write_recovered

            found = self._native.take_recovered_disk()
            disk_dir = (config or _kvbm.Config.from_env()).disk_dir
            try:
                write_recovered(disk_dir, self._rank, self._instance_id, found)
            except OSError as e:
                log.warning("kvbm worker: cannot record the %d recovered disk blocks: %s", len(found), e)
            else:
                log.info("kvbm worker: rank %d's disk file holds %d blocks", self._rank, len(found))
        expected = getattr(kcc, "kv_cache_layout", None)
        got = self._native.layout_name
        if expected and got != "per-layer tensors" and str(expected).upper() != got:
            log.warning(
                "kvbm worker: vLLM says the KV cache layout is %s, the tensors' strides say %s; "
                "kvbm follows the strides",
                expected,
                got,
            )
        log.info(
            "kvbm worker: %d layers (%s, %d copies per block), %d GPU blocks, %d host blocks of "
            "%d bytes, device %s",
            len(names),
            got,
            self._native.runs_per_block,
            num_blocks,
            host_blocks,
            bytes_per_block,
            self._native.device_kind,
        )

    def bind_connector_metadata(self, metadata: KvbmConnectorMetadata) -> None:
        self._meta = metadata
        self._has_offloads = self.native.bind(metadata.plan) if metadata.plan else False

    def clear_connector_metadata(self) -> None:
        self._meta = None
        self._has_offloads = False
        if self._native is not None:
            self._native.clear()

    def handle_preemptions(self, metadata: Optional[KvbmConnectorMetadata] = None) -> None:
        """vLLM frees a preempted request's GPU blocks without asking the connector and reuses
        them in this very step: its offloads, which read those blocks, must be done first."""
        if self._native is None:
            return
        if metadata is not None and metadata is not self._meta:
            # vLLM 0.33 calls this before binding the step's metadata.
            self.bind_connector_metadata(metadata)
        self._native.handle_preemptions()

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        if self._meta is not None:
            if self._stream is not None and self.native.plan_has_loads:
                # The onboards' target blocks may still have writes queued on vLLM's stream
                # (with asynchronous scheduling, e.g. zeroing of new blocks): the copies wait
                # for them on the device, the host does not.
                self._order_after_engine("h2d")
            self.native.start_onboards()

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if layer is not None:
            self.native.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any) -> None:
        # Offloads start in wait_for_save, once the whole forward pass was queued: one job per
        # step rather than one per layer, ordered after the forward on the device.
        return None

    def wait_for_save(self) -> None:
        if self._meta is None:
            return
        if self._has_offloads and self._stream is not None:
            # The forward pass writes the blocks on vLLM's stream: the offloads wait for it on
            # the device (an event recorded there, waited on by the copy stream), and the host
            # goes on to prepare the next step, as vLLM's own offloading does.
            self._order_after_engine("d2h")
        self.native.start_offloads()
        if self._has_offloads:
            self._fence_offloads()

    def _fence_offloads(self) -> None:
        """When the step's plan asks for it (it offloads blocks of a sliding-window or Mamba
        group, which vLLM frees mid-request without telling the connector and may zero and
        overwrite in the next step: ``remove_skipped_blocks`` in every ``allocate_slots``),
        vLLM's stream waits on the device for the step's offloads; on the emulated device, or
        should that fail, the host waits for them here (slower, never wrong)."""
        stream = None
        if self._stream is not None:
            try:
                stream = int(self._stream())
            except Exception as e:  # noqa: BLE001 - no stream: the host waits
                log.warning("kvbm worker: cannot read vLLM's stream (%s); the host waits for the offloads", e)
        # "device", "host" or "none" (no fence asked): how the last step was fenced.
        self.last_fence = self.native.fence_offloads(stream)

    def _order_after_engine(self, direction: str) -> None:
        """Orders the step's copies after vLLM's stream on the device; should the driver refuse
        that, the host waits for the stream instead (slower, never wrong), and the step's copies
        still start, so that nothing planned is left unreported."""
        try:
            self.native.order_after_stream(direction, self._stream())
        except Exception as e:  # a driver error: fall back to the host waiting
            if not getattr(self, "_order_warned", False):
                self._order_warned = True
                log.warning("kvbm worker: cannot order copies after vLLM's stream (%s); synchronising instead", e)
            try:
                import torch  # type: ignore

                torch.cuda.current_stream().synchronize()
            except Exception:  # noqa: BLE001 - nothing more can be done here
                pass

    def get_finished(self, finished_req_ids: Iterable[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """vLLM 0.32's report (0.33 calls :meth:`get_transfer_results`)."""
        # One native report per step: vLLM asks for the load errors right after.
        sending, recving, failed, bad_host, bad_disk = self.native.report(list(finished_req_ids or ()))
        failed_loads = self.native.take_failed_onboards()
        if self._num_groups > 1:
            # Per request: the blocks of failed asynchronous loads never become block errors.
            self._failed_recving.update(r for r, _ in failed_loads)
            self._drop_unreportable(set(failed) - {b for _, blocks in failed_loads for b in blocks})
        else:
            self._failed.update(failed)
        self._bad_host.update(bad_host)
        self._bad_disk.update(bad_disk)
        self._report_metrics()
        return (set(sending) or None), (set(recving) or None)

    def get_transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        """vLLM 0.33's report (``KVConnectorBase_V1.get_transfer_results``, called by the model
        runner instead of ``get_finished``): finished sends and receives, and, for a model of
        several KV cache groups, the requests whose asynchronous loads failed
        (``failed_recving``, also in ``finished_recving``), which vLLM recomputes
        (``scheduler.py``, ``_handle_failed_recving``)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        return TransferResults(set(sending or ()), set(recving or ()) | failed, failed)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """GPU blocks that failed to load; always empty for a model of several KV cache groups,
        where vLLM 0.33 raises on any (``scheduler.py``, ``_handle_invalid_blocks``)."""
        errors = self._failed | set(self.native.take_failed())
        self._failed = set()
        if self._num_groups > 1:
            self._drop_unreportable(errors)
            return set()
        return errors

    def _drop_unreportable(self, blocks: Set[int]) -> None:
        """Failed GPU blocks outside any asynchronous load, with several KV cache groups: vLLM
        has no way to take them (the leader makes every load of such a model asynchronous, so
        none are expected); logged and counted, never handed to vLLM."""
        if blocks:
            self.unreportable_load_errors += len(blocks)
            log.warning(
                "kvbm worker: %d GPU blocks failed outside an asynchronous load of a model with %d KV "
                "cache groups; vLLM cannot take block errors there (not reported): %s",
                len(blocks),
                self._num_groups,
                sorted(blocks)[:16],
            )

    def build_connector_worker_meta(self) -> Optional[KvbmWorkerMetadata]:
        """The blocks that went bad since the last step, for the leader to drop (None if none)."""
        if not self._bad_host and not self._bad_disk:
            return None
        meta = KvbmWorkerMetadata(frozenset(self._bad_host), frozenset(self._bad_disk))
        self._bad_host, self._bad_disk = set(), set()
        return meta

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep mode frees the KV cache memory after this
        (vllm/v1/worker/gpu_worker.py, ``sleep`` and ``discard``): every copy touching it is
        waited for, and none is started until ``restore_kv_caches``. The host and disk tiers
        keep their blocks. Idempotent."""
        if self._native is not None:
            self._native.suspend()

    def restore_kv_caches(self, kv_caches: Optional[Dict[str, Any]] = None) -> None:
        """After vLLM's ``wake_up``: registers the KV caches again, wherever their memory now
        is (the same layout and block count, or ``LayoutError``): vLLM's own tensors as
        registered (vLLM calls this without arguments), or ``kv_caches``. Idempotent."""
        if kv_caches is not None:
            self._kv_caches = dict(kv_caches)
        if self._native is not None and self._native.suspended:
            self._native.restore(self._kv_caches)

    def shutdown(self) -> None:
        if self._native is not None:
            self._native.shutdown()
        if self._publisher is not None:
            self._publisher.close()

    def _report_metrics(self) -> None:
        """kvbm-core's counters of this worker, exported under Dynamo's names (they are
        cumulative in core: set, not added)."""
        self._refresh_metrics()
        if self._publisher is not None:
            self._publisher.publish()

    def _refresh_metrics(self) -> None:
        native = self._native
        if native is not None:
            self._metrics.update(native.metrics())


__all__: List[str] = ["KvbmWorker", "TransferResults", "describe_kv_caches"]
