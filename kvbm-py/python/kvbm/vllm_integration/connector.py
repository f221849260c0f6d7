"""``DynamoConnector``: kvbm as a vLLM KV connector, a drop-in for Dynamo KVBM's.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "DynamoConnector",
        "kv_role": "kv_both", "kv_connector_module_path": "kvbm.vllm_integration.connector"}'

Tuned with Dynamo KVBM's environment variables (``DYN_KVBM_CPU_CACHE_GB``, ...). Every method
delegates to :class:`kvbm.leader.KvbmLeader` (scheduler role) or :class:`kvbm.worker.KvbmWorker`
(worker role), which hold the logic and need no vLLM.

Without vLLM installed this module still imports (so that tools can inspect it); creating a
connector then raises with the command that installs vLLM.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, List, Optional, Set, Tuple

from .. import _kvbm
from ..leader import KvbmLeader
from ..metadata import KvbmConnectorMetadata
from ..metrics import publisher_from_env, serve_from_env
from ..worker import KvbmWorker

log = logging.getLogger("kvbm")

VLLM_MISSING = (
    "kvbm's DynamoConnector runs inside vLLM, which is not installed here: "
    "pip install vllm (kvbm follows vLLM 0.33's connector interface)"
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorRole,
    )

    HAVE_VLLM = True
except ImportError:  # vLLM absent: importable, not usable.
    HAVE_VLLM = False

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in where vLLM is absent (creating a connector then raises)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    KVConnectorRole = None  # type: ignore[assignment]

try:
    # vLLM keeps its hybrid KV cache manager on only for connectors of this class
    # (vllm/config/vllm.py; KVConnectorFactory.supports_hma_config: issubclass).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # type: ignore
except ImportError:

    class SupportsHMA:  # type: ignore[no-redef]
        """Stand-in where vLLM (or its hybrid support) is absent."""


def _role_name(role: Any) -> str:
    name = getattr(role, "name", str(role))
    return "scheduler" if "SCHEDULER" in name.upper() else "worker"


#: An operator's namespace folded into the shared tier's model fingerprint: nodes share blocks only
#: when they give the same one (for checkpoints kvbm cannot tell apart, e.g. a hub id served from
#: caches that hold different snapshots).
SHARED_NAMESPACE = "DYN_KVBM_SHARED_NAMESPACE"


def _checkpoint_identity(path: str) -> str:
    """Names and sizes of a local checkpoint's weight files, with a digest of a slice from the
    middle and the end of each (two fine-tunes of one architecture have the same names, sizes and
    headers, not the same weights); "" for a path that is not a local directory."""
    import hashlib
    import os

    if not path or not os.path.isdir(path):
        return ""
    parts = []
    for name in sorted(os.listdir(path)):
        if not name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
            continue
        full = os.path.join(path, name)
        try:
            size = os.path.getsize(full)
            digest = hashlib.blake2b(digest_size=16)
            with open(full, "rb") as f:
                for at in (size // 2, max(0, size - (1 << 20))):
                    f.seek(at)
                    digest.update(f.read(1 << 20))
            parts.append(f"{name}:{size}:{digest.hexdigest()}")
        except OSError:
            parts.append(f"{name}:unreadable")
    return ";".join(parts)


def _hf_config_identity(model: Any) -> str:
    """The resolved Hugging Face config (RoPE scaling, heads, overrides applied), as JSON."""
    import json

    config = getattr(model, "hf_config", None)
    if config is None:
        return ""
    try:
        return config.to_json_string(use_diff=False)
    except Exception:  # not a transformers config (tests' stand-ins)
        try:
            return json.dumps(vars(config), sort_keys=True, default=str)
        except TypeError:
            return repr(config)


def model_fingerprint(vllm_config: Any, kv_cache_config: Any, block_size: int) -> int:
    """What the shared tier's keys name (kvbm-core's ``shared``): the model as served, since two
    nodes may share KV only when it is the same computation: its name and revision, its resolved
    Hugging Face config (RoPE scaling and overrides change K), quantization and dtypes, a local
    checkpoint's weight files (two fine-tunes of one architecture), the block size and the
    tensor- and pipeline-parallel split, and ``DYN_KVBM_SHARED_NAMESPACE``. The scheduler and
    every worker derive the same value from the same vLLM config."""
    import hashlib
    import json
    import os

    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    name = str(getattr(model, "model", "") or "")
    parts = [
        "kvbm-shared-model-v2",
        name,
        str(getattr(model, "revision", "") or ""),
        _hf_config_identity(model),
        json.dumps(getattr(model, "hf_overrides", None) or {}, sort_keys=True, default=str),
        str(getattr(model, "quantization", "") or ""),
        str(getattr(model, "dtype", "") or ""),
        str(getattr(cache, "cache_dtype", "") or ""),
        str(int(block_size)),
        str(int(getattr(parallel, "tensor_parallel_size", 1) or 1)),
        str(int(getattr(parallel, "pipeline_parallel_size", 1) or 1)),
        _checkpoint_identity(name),
        os.environ.get(SHARED_NAMESPACE, ""),
    ]
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _bytes_per_block(kv_cache_config: Any, block_size: int) -> int:
    """Bytes of one block on one rank, from vLLM's KV cache config: what one GPU block id
    addresses. With several groups that is every group's share of the one buffer they overlay
    (vllm/v1/core/kv_cache_planning.py, get_kv_cache_config_from_groups: every tensor spans the
    buffer, ``num_blocks`` blocks), as vLLM's own OffloadingConnector sizes it
    (``kv_cache_tensors[0].size // num_blocks``); with one group, its pages."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not groups:
        raise _kvbm.LayoutError("kv_cache_config has no KV cache group: cannot size kvbm's tiers")
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or []
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    if len(groups) > 1 and tensors and num_blocks > 0:
        # Every tensor of a hybrid plan spans the whole buffer (the groups alias from byte 0).
        return int(tensors[0].size) // num_blocks
    group = groups[0]
    spec = group.kv_cache_spec
    layers = len(getattr(group, "layer_names", []) or []) or 1
    page = getattr(spec, "page_size_bytes", None)
    if page is None:
        page = 2 * block_size * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
    return int(page) * layers


#: vLLM's KV cache spec classes kvbm serves, by name, with the group kind kvbm plans them as
#: (vllm/v1/kv_cache_interface.py). A subclass of one of them that is not listed (RSWASpec,
#: SinkFullAttentionSpec, HiddenStateCacheSpec, ...) changes the hit or free rules and is refused.
_SERVED_SPECS = {
    "FullAttentionSpec": "full_attention",
    "MLAAttentionSpec": "full_attention",
    "SlidingWindowSpec": "sliding_window",
    "SlidingWindowMLASpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "MambaSpec": "mamba",
}


def _plain_manager(spec: Any) -> bool:
    """Whether vLLM runs ``spec``'s group with its plain full-attention manager (every block of
    the prefix kept, none nulled), as vLLM 0.33's registry says
    (``KVCacheSpecRegistry.get_manager_class``, vllm/v1/kv_cache_spec_registry.py). Where vLLM cannot be asked (no vLLM, a stand-in spec), the
    group is taken as full attention, as before hybrid support."""
    try:
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # type: ignore
        from vllm.v1.kv_cache_interface import KVCacheSpec  # type: ignore
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # type: ignore
    except ImportError:
        return True
    if not isinstance(spec, KVCacheSpec):
        return True
    try:
        return KVCacheSpecRegistry.get_manager_class(spec, None) is FullAttentionManager
    except Exception:  # noqa: BLE001 - an unregistered spec: not one kvbm knows to serve
        return False


def _group_kinds(kv_cache_config: Any, block_size: int) -> Optional[List[Tuple[str, int]]]:
    """The KV cache groups of vLLM's hybrid KV cache manager as kvbm's leader plans them:
    ``(kind, window tokens)`` per group in vLLM's order, or None for a model of one
    full-attention group (the plain path). A group kvbm cannot serve is refused with a
    ConfigError naming the group and its spec, never served wrongly."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    kinds: List[Tuple[str, int]] = []
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        kind = _SERVED_SPECS.get(name)
        where = f"KV cache group {g} ({name}, layers {list(getattr(group, 'layer_names', []))[:3]}...)"
        if len(groups) == 1 and (kind == "full_attention" or (kind is None and _plain_manager(spec))):
            # One group whose blocks vLLM keeps for the whole prefix (full attention): the plain
            # path, exactly as before hybrid support.
            return None
        if kind is None:
            if name == "UniformTypeKVCacheSpecs":
                inner = {type(s).__name__ for s in (getattr(spec, "kv_cache_specs", None) or {}).values()}
                if inner and all(_SERVED_SPECS.get(n) == "full_attention" for n in inner):
                    kinds.append(("full_attention", 0))
                    continue
            raise _kvbm.ConfigError(f"{where}: kvbm does not serve this kind of KV cache group")
        if getattr(group, "enable_kv_transfer", True) is False or getattr(spec, "prefix_cacheable", True) is False:
            raise _kvbm.ConfigError(f"{where}: vLLM does not transfer or prefix-cache it")
        spec_block = int(getattr(spec, "block_size", block_size) or block_size)
        if spec_block != block_size:
            raise _kvbm.ConfigError(
                f"{where}: blocks of {spec_block} tokens where the scheduler's are {block_size}; "
                "kvbm needs one block size for every group"
            )
        if kind == "sliding_window":
            # The blocks vLLM allocates real for a hit reach ``extra_retained_tokens`` below the
            # window (allocate_external_computed_blocks): the window kvbm loads covers them.
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
            kinds.append((kind, window))
        elif kind == "chunked_local_attention":
            kinds.append((kind, int(spec.attention_chunk_size)))
        elif kind == "mamba":
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode != "align":
                raise _kvbm.ConfigError(
                    f"{where}: Mamba cache mode {mode!r}; kvbm serves Mamba states in vLLM's "
                    "'align' mode only (enable prefix caching: --enable-prefix-caching)"
                )
            kinds.append((kind, 0))
        else:
            kinds.append((kind, 0))
    if len(kinds) <= 1 and all(k == "full_attention" for k, _ in kinds):
        return None
    return kinds


def _struct_fields(cls) -> frozenset:
    return frozenset(getattr(cls, "__struct_fields__", ()) or ())


def _event_group(kv_cache_config: Any, kinds: Optional[List[Tuple[str, int]]]) -> Optional[dict]:
    """For a hybrid model, the group fields kvbm's own events carry (vLLM 0.33's
    ``BlockStored.group_idx`` / ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``,
    ``BlockRemoved.group_idx``): kvbm announces its primary group's blocks only (the first
    full-attention group, else group 0; kvbm-core ``groups``), so a router counts them as that
    group's, as it counts vLLM's own events of it."""
    if not kinds:
        return None
    primary = next((g for g, (k, _) in enumerate(kinds) if k == "full_attention"), None)
    if primary is None:
        # No full-attention group: kvbm's tiers still hold the primary group's blocks as a
        # prefix, which a router takes as claims only without a group (a window or Mamba
        # group's events never make claims there).
        return None
    spec = kv_cache_config.kv_cache_groups[primary].kv_cache_spec
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind  # type: ignore

        kind = get_kv_cache_spec_kind(spec).value
    except (ImportError, AttributeError):
        kind = kinds[primary][0]
    return {"group_idx": primary, "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": None}


def _pool_fields(event) -> dict:
    """A shared pool's event fields as vLLM 0.33 names them (``locality``, ``ownership``;
    vllm/distributed/kv_events.py); none for a tier of the worker's own."""
    pool = getattr(event, "ownership", None)
    return {"locality": "REMOTE", "ownership": pool} if pool is not None else {}


def _to_vllm_events(events, group: Optional[dict] = None):
    """kvbm's events as vLLM's KV cache event classes (host and disk media), built with the
    fields the installed vLLM's classes have (vllm/distributed/kv_events.py: 0.32 and 0.33 both
    require ``lora_name``). An event that cannot be built is dropped with a warning, never
    passed on as kvbm's own object: vLLM's publisher would encode it as a bare array that no
    subscriber can decode, and a router would then drop the whole batch, vLLM's own GPU events
    included."""
    try:
        from vllm.distributed import kv_events as ve  # type: ignore
    except ImportError:
        return events
    stored_fields = _struct_fields(ve.BlockStored)
    removed_fields = _struct_fields(ve.BlockRemoved)
    out = []
    for e in events:
        kind = type(e).__name__
        if getattr(e, "ownership", None) is not None:
            fields_known = stored_fields if kind == "BlockStored" else removed_fields
            if fields_known and "ownership" not in fields_known:
                # A vLLM without a pool field would publish the shared pool's blocks as this
                # worker's own storage tier: not published at all.
                continue
        try:
            if kind == "BlockStored":
                fields = {
                    "block_hashes": list(e.block_hashes),
                    "parent_block_hash": e.parent_block_hash,
                    "token_ids": list(e.token_ids),
                    "block_size": e.block_size,
                    "lora_id": None,
                    "medium": e.medium,
                    "lora_name": e.lora_name,
                    **(group or {}),
                    **_pool_fields(e),
                }
                if stored_fields:
                    fields = {k: v for k, v in fields.items() if k in stored_fields}
                out.append(ve.BlockStored(**fields))
            elif kind == "BlockRemoved":
                fields = {"block_hashes": list(e.block_hashes), "medium": e.medium, **_pool_fields(e)}
                if group:
                    fields["group_idx"] = group["group_idx"]
                if removed_fields:
                    fields = {k: v for k, v in fields.items() if k in removed_fields}
                out.append(ve.BlockRemoved(**fields))
            else:
                out.append(ve.AllBlocksCleared())
        except TypeError as err:
            global _EVENTS_DROPPED
            _EVENTS_DROPPED += 1
            if _EVENTS_DROPPED == 1:
                log.warning("kvbm: a %s event does not fit this vLLM's event class (%s); dropped", kind, err)
    return out


#: kvbm events that could not be turned into vLLM's classes.
_EVENTS_DROPPED = 0


def _as_cache_hit_sources(split):
    """kvbm's {"host": n, "disk": m} as vLLM's ``CacheHitSource`` keys
    (vllm/v1/metrics/cache_hit_source.py); plain strings where vLLM has no such enum."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore
    except ImportError:
        return split
    return {CacheHitSource(k): v for k, v in split.items()}


class DynamoConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,valid-type]
    """kvbm's vLLM KV connector (scheduler and worker roles).

    A ``SupportsHMA`` connector: vLLM 0.33 keeps its hybrid KV cache manager on with it, and
    kvbm's leader plans every KV cache group with that group's own block ids and hit rule
    (kvbm-core's ``groups``)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if not HAVE_VLLM:
            raise RuntimeError(VLLM_MISSING)
        try:
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        except TypeError:
            super().__init__(vllm_config, role)  # type: ignore[call-arg]
        self._role = _role_name(role)
        block_size = int(vllm_config.cache_config.block_size)
        parallel = getattr(vllm_config, "parallel_config", None)
        world = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        config = _kvbm.Config.from_env()
        if self._role == "scheduler":
            # One port per vLLM instance: the scheduler side serves it, with the values the
            # workers (in this process or their own) publish (kvbm.metrics).
            serve_from_env()
        self._leader: Optional[KvbmLeader] = None
        self._worker: Optional[KvbmWorker] = None
        # Both roles size the tiers from the same numbers (vLLM hands both the KV cache config),
        # so that block ids agree; a worker without one sizes from its tensors.
        host_blocks: Optional[int] = None
        disk_blocks: Optional[int] = None
        #: The hybrid model's KV cache groups (None: one full-attention group).
        self._groups = _group_kinds(kv_cache_config, block_size) if kv_cache_config is not None else None
        self._event_group = _event_group(kv_cache_config, self._groups)
        if self._groups is not None:
            log.info("kvbm: KV cache groups %s", ", ".join(f"{g}: {k}" + (f"({w})" if w else "") for g, (k, w) in enumerate(self._groups)))
        if self._role == "scheduler" or getattr(kv_cache_config, "kv_cache_groups", None):
            per_block = _bytes_per_block(kv_cache_config, block_size)
            host_blocks = config.host_blocks(per_block, world)
            disk_blocks = config.disk_blocks(per_block, world)
        if host_blocks == 0:
            # Disk blocks come back through the host tier: it must exist.
            raise _kvbm.ConfigError(
                "the host tier has no block: set DYN_KVBM_CPU_CACHE_GB (or "
                "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS) above 0; the disk tier needs it too"
            )
        # The same in the scheduler and every worker of this vLLM instance (kvbm.recovery).
        instance_id = str(getattr(vllm_config, "instance_id", "") or "") or None
        fingerprint = model_fingerprint(vllm_config, kv_cache_config, block_size)
        # The shared tier's shards: one per rank of the tensor- and pipeline-parallel group (each
        # holds its own heads of its own layers).
        shards = world * int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        if config.shared_url_set and self._groups is not None and len(self._groups) > 1:
            log.warning(
                "kvbm: the shared tier (DYN_KVBM_SHARED_URL) does not serve hybrid models yet; "
                "running without it"
            )
        if self._role == "scheduler":
            self._leader = KvbmLeader(
                block_size,
                host_blocks,
                disk_blocks=disk_blocks,
                disk_filter_disabled=config.disk_offload_filter_disabled,
                recovery=(config.disk_dir, world, instance_id) if instance_id else None,
                groups=self._groups,
                config=config,
                model_fingerprint=fingerprint,
                world_size=shards,
            )
            log.info(
                "kvbm leader: %d host and %d disk blocks of %d tokens",
                host_blocks,
                disk_blocks,
                block_size,
            )
        else:
            rank = int(getattr(parallel, "rank", 0) or 0)
            self._worker = KvbmWorker(
                publisher=publisher_from_env(rank),
                host_blocks=host_blocks,
                disk_blocks=disk_blocks,
                world_size=world,
                rank=rank,
                config=config,
                kv_cache_config=kv_cache_config,
                instance_id=instance_id,
                model_fingerprint=fingerprint,
                shards=shards,
            )

    # -- scheduler role -----------------------------------------------------------------------

    def _lead(self) -> KvbmLeader:
        if self._leader is None:
            raise RuntimeError("a scheduler-side method was called on a worker-side connector")
        return self._leader

    def _work(self) -> KvbmWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on a scheduler-side connector")
        return self._worker

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        return self._lead().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._lead().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        # vLLM (0.32+) splits its cached-prompt-token metrics by source with this
        # (vllm/v1/core/sched/scheduler.py, after update_state_after_alloc; the counts must add
        # up to num_external_tokens). kvbm's tiers are host memory and disk.
        split = self._lead().hit_sources(request, num_external_tokens)
        return _as_cache_hit_sources(split)

    def build_connector_meta(self, scheduler_output: Any) -> KvbmConnectorMetadata:
        return self._lead().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._lead().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> Tuple[bool, Optional[dict]]:
        return self._lead().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Tuple[bool, Optional[dict]]:
        # vLLM 0.33 calls this (and never request_finished) for a SupportsHMA connector
        # (vllm/v1/core/sched/scheduler.py, _connector_finished): True keeps every group's
        # blocks until the workers report the request in finished_sending.
        return self._lead().request_finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        if self._leader is None:
            return ()
        return _to_vllm_events(self._leader.take_events(), self._event_group)

    def reset_cache(self) -> Optional[bool]:
        if self._leader is None:
            return False
        return self._leader.reset_cache()

    # -- worker role --------------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        """BLNHC (block-outermost: one block of every layer is one contiguous run, so one DMA per
        block each way) unless ``KVBM_KV_CACHE_LAYOUT`` names another vLLM layout, or ``auto``
        for none. vLLM keeps it when every attention backend supports it and otherwise warns and
        uses its own choice, which the worker then reads from the tensors' strides."""
        return _kvbm.required_kv_cache_layout()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._work().handle_preemptions(kv_connector_metadata)

    def register_kv_caches(self, kv_caches: Any) -> None:
        self._work().register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33's sleep mode (supports_sleep_mode is left True): drained, then no copy
        # touches the KV cache memory until restore_kv_caches.
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        try:
            super().bind_connector_metadata(connector_metadata)  # type: ignore[misc]
        except AttributeError:
            pass
        self._work().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        try:
            super().clear_connector_metadata()  # type: ignore[misc]
        except AttributeError:
            pass
        self._work().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._work().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return self._work().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        # vLLM 0.33's model runner asks this (its default wraps get_finished): a hybrid model's
        # failed asynchronous loads are reported per request in failed_recving, the only way
        # vLLM takes them with several KV cache groups (scheduler.py, _handle_failed_recving;
        # _handle_invalid_blocks raises on block ids then).
        r = self._work().get_transfer_results(finished_req_ids)
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
                KVConnectorTransferResults,
            )
        except ImportError:  # an older vLLM calls get_finished instead
            return r
        return KVConnectorTransferResults(
            finished_sending=set(r.finished_sending),
            finished_recving=set(r.finished_recving),
            failed_recving=set(r.failed_recving),
        )

    def get_block_ids_with_load_errors(self) -> Set[int]:
        if self._worker is None:
            return set()
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        # Host and disk blocks that went bad in this step, for the leader to drop.
        if self._worker is None:
            return None
        return self._worker.build_connector_worker_meta()

    # -- both ---------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> Any:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: Any = None) -> Any:
        return None

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> Any:
        # kvbm serves its own metrics (DYN_KVBM_METRICS); nothing joins vLLM's registry.
        return None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


__all__ = ["DynamoConnector", "HAVE_VLLM", "VLLM_MISSING"]
