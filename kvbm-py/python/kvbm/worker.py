"""The GPU worker side of kvbm's vLLM connector, independent of vLLM.

:class:`KvbmWorker` registers vLLM's per-layer KV cache tensors (or anything exposing
``data_ptr()``, ``shape``, ``stride()``, ``dtype``, ``element_size()``), owns this rank's shard of
the pinned host pool and its copy streams, and executes the leader's instructions:

- ``start_load_kv``: waits for every earlier save (a host block is never read while a save into
  it runs, and the GPU blocks a save reads are not overwritten by this step's forward), reads
  the step's disk blocks into their staging host blocks, then starts the step's loads, one
  transfer per layer;
- ``wait_for_layer_load``: waits for that layer's transfer only;
- ``wait_for_save``: starts the step's saves (after the forward pass wrote the blocks), then
  queues the step's disk writes (after those saves completed);
- ``get_finished``: reports finished requests whose saves all completed, and requests whose
  asynchronous loads (disk reads, then the copy to the GPU, on the worker's loader thread) are
  done; their failed blocks are reported by ``get_block_ids_with_load_errors`` in the same pass.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from . import _kvbm
from ._kvbm import LayoutError
from .metadata import KvbmConnectorMetadata
from .metrics import Metrics, global_metrics

log = logging.getLogger("kvbm")


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def detect_layout(name: str, tensor: Any) -> Tuple[str, int, int, int]:
    """(shape kind, num_blocks, block_size, inner_dim) of one layer's KV cache tensor.

    vLLM's shapes: ``[2, num_blocks, block_size, kv_heads, head_size]`` (FlashAttention),
    ``[num_blocks, 2, block_size, kv_heads, head_size]`` (FlashInfer), and
    ``[num_blocks, block_size, head_size]`` (MLA). The tensor must be contiguous.
    """
    shape = tuple(int(d) for d in tensor.shape)
    stride = tuple(int(s) for s in tensor.stride())
    if stride != _contiguous_strides(shape):
        raise LayoutError(
            f"KV cache tensor {name!r} of shape {shape} has strides {stride}: kvbm needs it "
            f"contiguous ({_contiguous_strides(shape)})"
        )
    if len(shape) == 5 and shape[0] == 2:
        return "outer_first", shape[1], shape[2], shape[3] * shape[4]
    if len(shape) == 5 and shape[1] == 2:
        return "block_first", shape[0], shape[2], shape[3] * shape[4]
    if len(shape) == 3:
        return "mla", shape[0], shape[1], shape[2]
    raise LayoutError(
        f"KV cache tensor {name!r} has shape {shape}: expected [2, blocks, block_size, heads, "
        "head_size], [blocks, 2, block_size, heads, head_size] or [blocks, block_size, head_size]"
    )


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
    ) -> None:
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
        self._sync = None
        # Requests with saves in flight, requests that ever saved, finished ones awaiting saves.
        self._in_flight: Set[str] = set()
        self._saved: Set[str] = set()
        self._finished_waiting: Set[str] = set()
        self._load_errors: Set[int] = set()
        self._bytes_reported = (0, 0)

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
        kind, num_blocks, block_size, inner = detect_layout(names[0], tensors[0])
        first = tensors[0]
        for n, t in zip(names[1:], tensors[1:]):
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                raise LayoutError(
                    f"KV cache tensor {n!r} ({tuple(t.shape)}, {t.dtype}) differs from "
                    f"{names[0]!r} ({tuple(first.shape)}, {first.dtype}); kvbm needs one shape"
                )
            detect_layout(n, t)
        elem = int(first.element_size())
        outer = 1 if kind == "mla" else 2
        bytes_per_block = len(tensors) * outer * block_size * inner * elem
        # Sizes given here win; otherwise they come from the configuration (the environment).
        host_blocks, disk_blocks = self._host_blocks, self._disk_blocks
        config = self._config
        if config is None and host_blocks is None:
            config = _kvbm.Config.from_env()
        if host_blocks is None:
            host_blocks = config.host_blocks(bytes_per_block, self._world_size)
        if disk_blocks is None:
            disk_blocks = config.disk_blocks(bytes_per_block, self._world_size) if config else 0
        device, index = _device_of(first)
        if self._device is not None:
            device = self._device
        if device == "cuda":
            import torch  # type: ignore

            stream = torch.cuda.current_stream(index)
            self._sync = stream.synchronize
        self._native = _kvbm.Worker(
            tensors,
            [int(t.data_ptr()) for t in tensors],
            kind,
            num_blocks,
            block_size,
            inner,
            elem,
            int(host_blocks),
            device,
            index,
            int(disk_blocks),
            config.disk_dir if config is not None else None,
            f"kvbm-rank{self._rank}.cache",
            config.disk_disable_o_direct if config is not None else False,
            config.disk_engine if config is not None else "auto",
        )
        self._layers = {n: i for i, n in enumerate(names)}
        log.info(
            "kvbm worker: %d layers (%s), %d GPU blocks, %d host blocks of %d bytes, device %s",
            len(names),
            kind,
            num_blocks,
            host_blocks,
            bytes_per_block,
            self._native.device_kind,
        )

    def bind_connector_metadata(self, metadata: KvbmConnectorMetadata) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        w = self.native
        # Saves of earlier steps must be done before this step's forward writes GPU blocks.
        w.wait_saves()
        meta = self._meta
        if meta is None:
            return
        self._load_errors.update(meta.load_errors)
        reads = getattr(meta, "disk_reads", None)
        if reads:
            w.disk_read(reads)  # misses become load errors of their GPU blocks
        pairs = [p for _, ps in meta.loads for p in ps]
        if pairs:
            w.load(pairs)
        for rid, disk_reads, async_pairs in getattr(meta, "async_loads", None) or ():
            w.load_async(rid, disk_reads, async_pairs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if layer is not None:
            self.native.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any) -> None:
        # Saves start in wait_for_save, once the whole forward pass wrote the blocks: one
        # transfer per step rather than one per layer, and one stream sync on CUDA.
        return None

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        w = self.native
        if meta.saves:
            w.wait_loads()
            if self._sync is not None:
                self._sync()  # the forward's writes are on the compute stream
            pairs = [p for _, ps in meta.saves for p in ps]
            requests = [rid for rid, _ in meta.saves]
            w.save(pairs, requests)
            self._in_flight.update(requests)
            self._saved.update(requests)
        writes = getattr(meta, "disk_writes", None)
        if writes:
            w.disk_write(writes)

    def get_finished(self, finished_req_ids: Iterable[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        w = self.native
        for rid in w.poll_saves():
            self._in_flight.discard(rid)
        for rid in finished_req_ids or ():
            if rid in self._saved:
                self._finished_waiting.add(rid)
        done = {rid for rid in self._finished_waiting if rid not in self._in_flight}
        self._finished_waiting -= done
        self._saved -= done
        loaded = set()
        for rid, failed in w.poll_loads():
            loaded.add(rid)
            self._load_errors.update(failed)
        self._report_bytes()
        return (done or None), (loaded or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors = set(self.native.take_failed()) | self._load_errors
        self._load_errors = set()
        if errors:
            self._metrics.inc("kvbm_load_errors", len(errors))
        return errors

    def shutdown(self) -> None:
        if self._native is not None:
            self._native.wait_saves()
            self._native.wait_loads()
            self._native.wait_loads_async()
            self._native.wait_disk()

    def _report_bytes(self) -> None:
        stats = self.native.stats()
        saved, loaded = stats["bytes_saved"], stats["bytes_loaded"]
        self._metrics.inc("kvbm_offload_bytes_d2h", saved - self._bytes_reported[0])
        self._metrics.inc("kvbm_onboard_bytes_h2d", loaded - self._bytes_reported[1])
        self._bytes_reported = (saved, loaded)


__all__: List[str] = ["KvbmWorker", "detect_layout"]
