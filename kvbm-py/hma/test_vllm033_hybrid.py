"""Facts about vLLM 0.33's hybrid KV cache path (HMA) that kvbm's connector relies on.

Run: PYTHONPATH=.vllm-0.33:kvbm-py/hma .venv-vllm/bin/python -m pytest kvbm-py/hma -q

Every test runs vLLM's own planner, allocation and KVCacheManager (see vllm033.py) and
names the vLLM function whose behaviour it pins down.
"""

from __future__ import annotations

from math import prod
from types import SimpleNamespace

import pytest
import torch

import vllm033 as v
from vllm.config import CacheConfig, VllmConfig
from vllm.platforms import current_platform
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

GiB = 1 << 30
TINY_MEMORY = 1 << 20

# Qwen3-Next's attention block, which holds one Mamba state page: 544 with the SSM state in
# bfloat16, 1056 in float32. vllm/platforms/cpu.py (CpuPlatform.check_and_update_config) keeps
# the SSM state in float32 on a CPU with AVX-512 BF16 unless its GDN backend takes bfloat16, so
# which one a run sees depends on the host; the tests read it from the plan.
QWEN3_NEXT_BLOCK = {torch.bfloat16: 544, torch.float32: 1056}

EXPECTED_GROUPS = {
    # shape name -> (kinds in group order, layers per group, block size; None: Qwen3-Next's)
    "gpt-oss-20b": (["sliding", "full"], 12, 16),
    "gemma-3-12b": (["sliding"] * 5 + ["full"], 8, 16),
    "qwen3-next-80b-a3b": (["mamba"] * 3 + ["full"], 12, None),
}


def qwen3_next_block(p):
    """The block size vLLM chose for a Qwen3-Next plan, by its SSM state's dtype."""
    return QWEN3_NEXT_BLOCK[p.groups[0].kv_cache_spec.dtypes[1]]


@pytest.fixture(scope="module")
def full_plans():
    """The real shapes planned with HMA on for 1 GiB (grouping only, no allocation)."""
    return {s.name: v.plan(s, GiB) for s in v.FULL_SHAPES}


@pytest.fixture(scope="module")
def tiny():
    """Tiny shapes with HMA on: plan, allocated tensors, backing buffer."""
    out = {}
    for s in v.TINY_SHAPES:
        p = v.plan(s, TINY_MEMORY)
        kv = v.allocate(p)
        out[s.name] = SimpleNamespace(plan=p, kv=kv, buf=v.backing_buffer(kv))
    return out


def test_platform_keeps_hma_on_without_connector():
    """VllmConfig.__post_init__ (vllm/config/vllm.py): with the platform reporting
    support_hybrid_kv_cache() (CudaPlatformBase in vllm/platforms/cuda.py) and no KV
    connector, disable_hybrid_kv_cache_manager resolves to False."""
    v.install_hybrid_platform()
    vc = VllmConfig(cache_config=CacheConfig(block_size=16))
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False


@pytest.mark.parametrize("name", sorted(EXPECTED_GROUPS))
def test_hma_groups_per_shape(full_plans, name):
    """get_kv_cache_groups -> _get_kv_cache_groups_uniform_page_size
    (vllm/v1/core/kv_cache_planning.py): one group per layer kind, split into groups of
    the smallest kind's layer count, every group the same page size, full attention
    last; groups list layers in model order."""
    p = full_plans[name]
    kinds, layers_per_group, block_size = EXPECTED_GROUPS[name]
    block_size = block_size or qwen3_next_block(p)
    assert [v.group_kind(g.kv_cache_spec) for g in p.groups] == kinds
    assert all(len(g.layer_names) == layers_per_group for g in p.groups)
    assert {g.kv_cache_spec.block_size for g in p.groups} == {block_size}
    assert len({g.kv_cache_spec.page_size_bytes for g in p.groups}) == 1
    grouped = sorted(n for g in p.groups for n in g.layer_names)
    assert grouped == sorted(p.shape.layer_names())
    # every layer sits in a group of its own kind
    kind_of = {"full": "full", "sliding": "sliding", "gdn": "mamba"}
    for i, k in enumerate(p.shape.kinds):
        g = p.group_of(p.shape.layer_name(i))
        assert v.group_kind(p.groups[g].kv_cache_spec) == kind_of[k]


@pytest.mark.parametrize("shape", [v.GPT_OSS_20B, v.GEMMA3_12B])
def test_hma_off_is_one_full_group(shape):
    """unify_hybrid_kv_cache_specs / _promote_local_kv_cache_specs
    (vllm/v1/core/kv_cache_planning.py): with disable_hybrid_kv_cache_manager (a
    connector without SupportsHMA) every sliding layer becomes FullAttentionSpec
    (the window kept as a field), one group holds all layers, and half (gpt-oss) or
    a sixth (Gemma 3) as many blocks fit in the same memory."""
    on = v.plan(shape, GiB)
    off = v.plan(shape, GiB, hma=False)
    assert len(off.groups) == 1
    spec = off.groups[0].kv_cache_spec
    assert type(spec) is FullAttentionSpec and spec.sliding_window == shape.sliding_window
    assert len(off.groups[0].layer_names) == len(shape.kinds)
    ratio = len(shape.kinds) // len(on.groups[0].layer_names)
    assert on.kv_cache_config.num_blocks // off.kv_cache_config.num_blocks == ratio


def test_hma_off_mamba_hybrid_fails_to_plan():
    """_promote_local_kv_cache_specs raises for MambaSpec next to attention: a Mamba
    hybrid cannot start with HMA off (the warning in VllmConfig.__post_init__)."""
    with pytest.raises(ValueError, match="Failed to promote"):
        v.plan(v.QWEN3_NEXT_80B, GiB, hma=False)


def test_qwen3_next_block_size_and_state(full_plans):
    """Platform._align_hybrid_block_size (vllm/platforms/interface.py): the attention
    block grows to the smallest multiple of the kernel alignment (FlashAttention:
    MultipleOf(16)) whose page holds the Mamba state, the Mamba page is padded to the
    attention page, and align mode sets mamba_block_size to the block size. State
    shapes from Qwen3NextForCausalLM.get_mamba_state_shape_from_config."""
    p = full_plans["qwen3-next-80b-a3b"]
    cc = p.vllm_config.cache_config
    assert cc.mamba_cache_mode == "align"
    gdn = p.shape.gdn
    conv_dim = 2 * gdn.num_k_heads * gdn.head_k_dim + gdn.num_v_heads * gdn.head_v_dim
    mamba = p.groups[0].kv_cache_spec
    assert isinstance(mamba, MambaSpec)
    assert sorted(mamba.shapes) == sorted(
        [(gdn.conv_kernel - 1, conv_dim), (gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim)]
    ) or sorted(mamba.shapes) == sorted(
        [(conv_dim, gdn.conv_kernel - 1), (gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim)]
    )
    ssm_dtype = torch.float32 if cc.mamba_ssm_cache_dtype == "float32" else torch.bfloat16
    assert mamba.dtypes == (torch.bfloat16, ssm_dtype)
    block = QWEN3_NEXT_BLOCK[ssm_dtype]
    state = mamba.state_content_size_bytes
    attn_token = 2 * p.shape.num_kv_heads * p.shape.head_size * 2
    assert cc.block_size == 16 * cdiv(state, 16 * attn_token) == block
    assert cc.mamba_block_size == cc.block_size == mamba.block_size
    assert mamba.page_size_bytes == cc.block_size * attn_token == cc.mamba_page_size_padded
    assert mamba.page_size_bytes > state
    assert p.scheduler_block_size == p.hash_block_size == block


def _check_attention_view(t, p, name, num_blocks):
    spec = p.specs[name]
    bs = spec.block_size
    h, d = p.shape.num_kv_heads, p.shape.head_size
    # create_kv_cache_views: [B, H, N, C] with C = K|V (head_size + head_size_v),
    # LBNHC layout (token-major within a block, heads inside a token).
    assert t.dtype == p.shape.dtype
    assert tuple(t.shape) == (num_blocks, h, bs, 2 * d)
    assert t.stride() == (bs * h * 2 * d, 2 * d, h * 2 * d, 1)


@pytest.mark.parametrize("shape", v.TINY_SHAPES, ids=lambda s: s.name)
def test_register_kv_caches_tensors(tiny, shape):
    """allocate_kv_cache (vllm/v1/worker/utils.py) / create_kv_cache_views
    (vllm/v1/kv_cache_interface.py): one int8 backing tensor; attention layers get a
    [blocks, kv_heads, block_size, 2*head] view of the KV dtype, Mamba layers a
    1-byte [blocks, 1, 1, state_bytes] int8 view whose block stride is the padded
    page."""
    t = tiny[shape.name]
    p, kv = t.plan, t.kv
    nb = p.kv_cache_config.num_blocks
    assert set(kv) == set(shape.layer_names())
    storage = t.buf.untyped_storage().data_ptr()
    for name, tensor in kv.items():
        assert tensor.untyped_storage().data_ptr() == storage
        assert tensor.device.type == "cpu"
        spec = p.specs[name]
        if isinstance(spec, MambaSpec):
            assert tensor.dtype == torch.int8
            assert tuple(tensor.shape) == (nb, 1, 1, spec.state_content_size_bytes)
            page = p.groups[p.group_of(name)].kv_cache_spec.page_size_bytes
            assert tensor.stride() == (page, spec.state_content_size_bytes, spec.state_content_size_bytes, 1)
        else:
            _check_attention_view(tensor, p, name, nb)


@pytest.mark.parametrize("name", sorted(EXPECTED_GROUPS))
def test_register_kv_caches_tensors_real_shapes(name):
    """Same as above for the real shapes, on a few blocks of memory."""
    shape = {s.name: s for s in v.FULL_SHAPES}[name]
    probe = v.plan(shape, GiB)
    bytes_per_block = sum(
        len(t.layers) * probe.groups[probe.group_of(t.layers[0])].kv_cache_spec.page_size_bytes
        for t in probe.kv_cache_config.kv_cache_tensors[:1]
    )
    p = v.plan(shape, 4 * bytes_per_block)
    assert p.kv_cache_config.num_blocks == 4
    kv = v.allocate(p)
    for layer, tensor in kv.items():
        spec = p.specs[layer]
        if isinstance(spec, MambaSpec):
            assert tensor.dtype == torch.int8
            assert tuple(tensor.shape) == (4, 1, 1, spec.state_content_size_bytes)
            assert tensor.stride()[0] == spec.page_size_bytes if spec.page_size_padded else True
        else:
            _check_attention_view(tensor, p, layer, 4)


@pytest.mark.parametrize(
    "shape,layer_a,layer_b",
    [
        (v.TINY_GPT_OSS, 0, 1),
        (v.TINY_GEMMA3, 2, 5),
        (v.TINY_QWEN3_NEXT, 0, 3),
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_groups_alias_one_buffer(tiny, shape, layer_a, layer_b):
    """get_kv_cache_config_from_groups places every group from byte 0 ("Groups alias
    from byte 0"), so the l-th layer of each group covers the same bytes: block N of a
    layer in group A and block N of the same-position layer in group B are one page.
    Checked by writing through one layer's view and reading the raw buffer and the
    other layer's view."""
    t = tiny[shape.name]
    p, kv, buf = t.plan, t.kv, t.buf
    a, b = shape.layer_name(layer_a), shape.layer_name(layer_b)
    assert p.group_of(a) != p.group_of(b)
    block = 7
    start, end = v.block_byte_range(p, a, block)
    assert (start, end) == v.block_byte_range(p, b, block)
    buf.zero_()
    pattern = torch.arange(end - start, dtype=torch.int64).remainder(251).add(1).to(torch.int8)
    # write a's block N through its own view
    va = v.page_bytes(kv[a][block])
    n = va.numel()
    va.copy_(pattern[:n])
    # the raw buffer holds it at the placement's byte range, nothing outside
    assert torch.equal(buf[start : start + n], pattern[:n])
    assert int(buf[:start].count_nonzero()) == 0 and int(buf[end:].count_nonzero()) == 0
    # group b's same-position layer reads the same bytes for the same block id
    vb = v.page_bytes(kv[b][block])
    m = min(n, vb.numel())
    assert torch.equal(vb[:m], pattern[:m])
    # and a different block id is elsewhere
    s2, _ = v.block_byte_range(p, a, block + 1)
    assert s2 == start + p.kv_cache_config.kv_cache_tensors[0].block_stride


def test_mamba_page_unpacks_as_bind_kv_cache(tiny):
    """MambaBase.bind_kv_cache (vllm/model_executor/layers/mamba/abstract.py): the
    [B, 1, 1, C] int8 page holds the states back to back (conv first, then the
    recurrent state) at the start of each padded page; bytes past C are padding."""
    t = tiny["tiny-qwen3-next"]
    p, kv = t.plan, t.kv
    name = v.TINY_QWEN3_NEXT.layer_name(0)
    spec = p.specs[name]
    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer, kv[name])
    conv, ssm = layer.kv_cache
    assert tuple(conv.shape[1:]) == spec.shapes[0] and tuple(ssm.shape[1:]) == spec.shapes[1]
    t.buf.zero_()
    ssm[5].fill_(1.0)
    start, _ = v.block_byte_range(p, name, 5)
    conv_bytes = prod(spec.shapes[0]) * spec.dtypes[0].itemsize
    ssm_bytes = prod(spec.shapes[1]) * spec.dtypes[1].itemsize
    nz = t.buf.nonzero().flatten()
    assert int(nz.min()) >= start + conv_bytes
    assert int(nz.max()) < start + conv_bytes + ssm_bytes
    assert conv_bytes + ssm_bytes == spec.state_content_size_bytes < spec.page_size_bytes


def _tokens(n, seed=0):
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


def test_each_group_has_its_own_block_ids(tiny):
    """KVCacheManager.get_block_ids returns one list per group; every group allocates
    from the one BlockPool, so no real block id appears in two groups (the null block,
    id 0, may) (vllm/v1/core/kv_cache_coordinator.py allocate_new_blocks)."""
    for name in ("tiny-gpt-oss", "tiny-gemma3", "tiny-qwen3-next"):
        p = tiny[name].plan
        mgr = v.make_manager(p)
        null = mgr.block_pool.null_block.block_id
        req = v.make_request(p, "r0", _tokens(100))
        pf = v.prefill(mgr, req, chunk_tokens=32)
        ids = pf.block_ids
        assert len(ids) == len(p.groups)
        seen: dict[int, int] = {}
        for g, group_ids in enumerate(ids):
            for b in group_ids:
                if b == null:
                    continue
                assert seen.setdefault(b, g) == g, f"{name}: block {b} in groups {seen[b]} and {g}"
        full = [g for g, grp in enumerate(p.groups) if v.group_kind(grp.kv_cache_spec) == "full"]
        assert full and all(null not in ids[g] and len(ids[g]) == cdiv(100, 16) for g in full)
        mgr.free(req)


def test_sliding_window_blocks_outside_window_are_null(tiny):
    """SlidingWindowManager.remove_skipped_blocks / get_num_skipped_tokens
    (vllm/v1/core/single_type_kv_cache_manager.py), called from
    KVCacheManager.allocate_slots for the tokens computed before the step: the
    sliding group's blocks wholly before the window become the null block (one step
    late); the full group keeps them all."""
    p = tiny["tiny-gpt-oss"].plan
    bs = 16
    window = v.TINY_GPT_OSS.sliding_window
    mgr = v.make_manager(p)
    null = mgr.block_pool.null_block.block_id
    req = v.make_request(p, "r0", _tokens(160))
    pf = v.prefill(mgr, req, chunk_tokens=32)
    sw_mgr = v.group_managers(mgr)[0]
    assert isinstance(sw_mgr, v.SlidingWindowManager)
    # each step's allocation nulls the blocks out of the window of the tokens
    # computed before it: after the last chunk (128 -> 160) that is 128 tokens
    for step, done in zip(pf.steps, range(0, 160, 32)):
        sliding, full = step
        skipped = max(0, done - (window - 1)) // bs
        assert sw_mgr.get_num_skipped_tokens(done) // bs == skipped
        assert sliding[:skipped] == [null] * skipped
        assert null not in sliding[skipped:]
        assert null not in full and len(full) == len(sliding) == (done + 32) // bs
    # the next pass (a decode step's allocate_slots) catches up to 160 tokens
    mgr.remove_skipped_blocks(req.request_id, 160)
    sliding, full = mgr.get_block_ids(req.request_id)
    skipped = (160 - (window - 1)) // bs
    assert skipped == 8 and sliding[:skipped] == [null] * skipped
    assert null not in sliding[skipped:] and null not in full
    mgr.free(req)


@pytest.mark.parametrize("shape", [v.TINY_GPT_OSS, v.TINY_GEMMA3], ids=lambda s: s.name)
def test_sliding_window_hit_keeps_only_window_blocks(tiny, shape):
    """SlidingWindowManager.find_longest_cache_hit with the default sparse retention
    (CacheConfig.prefix_cache_retention_interval = 0, reachable_block_mask): a sliding
    group caches only the window's blocks before the request's replay boundary
    (prompt - 1, block-aligned), so a second request's hit stops there even though the
    full group holds the whole prompt; older sliding positions are the null block.
    HybridKVCacheCoordinator.find_longest_cache_hit gives every group the same hit
    length."""
    p = tiny[shape.name].plan
    bs = 16
    mgr = v.make_manager(p)
    null = mgr.block_pool.null_block.block_id
    prompt = _tokens(160, seed=3)
    first = v.prefill(mgr, v.make_request(p, "a", prompt), chunk_tokens=32)
    mgr.free(first.request)
    second = v.prefill(mgr, v.make_request(p, "b", prompt + _tokens(40, seed=9)), chunk_tokens=64)
    hit = (len(prompt) - 1) // bs * bs
    assert second.num_hit_tokens == hit == 144
    window_blocks = cdiv(shape.sliding_window - 1, bs)
    kinds = [v.group_kind(g.kv_cache_spec) for g in p.groups]
    assert "sliding" in kinds and "full" in kinds
    for g, kind in enumerate(kinds):
        got, had = second.hit_block_ids[g], first.block_ids[g]
        assert len(got) == hit // bs
        if kind == "full":
            assert got == had[: hit // bs]
        else:
            assert null not in got[-window_blocks:]
            assert got[-window_blocks:] == had[hit // bs - window_blocks : hit // bs]
            assert set(got[:-window_blocks]) == {null}


def test_mamba_align_hit_is_block_aligned_state(tiny):
    """MambaManager.find_longest_cache_hit in align mode
    (vllm/v1/core/single_type_kv_cache_manager.py): the hit is a whole number of
    blocks and only its last block (N/block_size - 1) holds a state; earlier hit
    positions are the null block. The attention group's hit covers the same tokens."""
    p = tiny["tiny-qwen3-next"].plan
    bs = p.vllm_config.cache_config.block_size
    mgr = v.make_manager(p)
    null = mgr.block_pool.null_block.block_id
    prompt = _tokens(100, seed=5)
    # chunks end on block boundaries (48, 96) as the scheduler splits them in align
    # mode, so the states at 48 and 96 tokens are cached
    first = v.prefill(mgr, v.make_request(p, "a", prompt), chunk_tokens=48)
    mgr.free(first.request)
    second = v.prefill(mgr, v.make_request(p, "b", prompt + _tokens(30, seed=11)), chunk_tokens=64)
    hit = second.num_hit_tokens
    assert hit > 0 and hit % bs == 0 and hit <= 100
    n = hit // bs
    for g, group in enumerate(p.groups):
        ids = second.hit_block_ids[g]
        assert len(ids) == n
        if v.group_kind(group.kv_cache_spec) == "mamba":
            assert ids[-1] != null and set(ids[:-1]) <= {null}
        else:
            assert null not in ids
    assert isinstance(v.group_managers(mgr)[0], v.MambaManager)


def test_capacity_hma_on_exceeds_off(full_plans):
    """get_kv_cache_capacity (vllm/v1/core/kv_cache_utils.py): for the same memory,
    HMA on holds more tokens than HMA off for both sliding-window shapes."""
    for shape in (v.GPT_OSS_20B, v.GEMMA3_12B):
        on, _ = v.plan(shape, 10 * GiB).capacity()
        off, _ = v.plan(shape, 10 * GiB, hma=False).capacity()
        assert on > off


def test_stand_in_platform_mirrors_cuda(monkeypatch):
    """VllmConfig.__post_init__ turns HMA off on a platform whose
    support_hybrid_kv_cache() is False (the base Platform in
    vllm/platforms/interface.py); install_hybrid_platform gives it CUDA's answer
    (CudaPlatformBase.support_hybrid_kv_cache, vllm/platforms/cuda.py) and HMA stays
    on. monkeypatch restores the platform class afterwards."""
    cls = type(current_platform)
    monkeypatch.setattr(cls, "support_hybrid_kv_cache", classmethod(lambda _c: False))
    off = VllmConfig(cache_config=CacheConfig(block_size=16))
    assert off.scheduler_config.disable_hybrid_kv_cache_manager is True
    v.install_hybrid_platform()
    on = VllmConfig(cache_config=CacheConfig(block_size=16))
    assert on.scheduler_config.disable_hybrid_kv_cache_manager is False


@pytest.mark.parametrize("shape", v.TINY_SHAPES, ids=lambda s: s.name)
def test_group_block_ids_address_only_their_group(tiny, shape):
    """allocate_kv_cache + KVCacheManager.get_block_ids: writing each group's blocks
    through that group's own ids (kv_cache_groups[g].layer_names) never touches another
    group's blocks, and every group reads back its own bytes. Reading a group's layers
    at another group's ids returns the other group's bytes: one group's ids used for
    all layers loads wrong data."""
    t = tiny[shape.name]
    p, kv = t.plan, t.kv
    t.buf.zero_()
    mgr = v.make_manager(p)
    null = mgr.block_pool.null_block.block_id
    req = v.make_request(p, "r", _tokens(96, seed=17))
    ids = v.prefill(mgr, req, chunk_tokens=32).block_ids

    def fill(g, pos, b):
        return (g * 37 + pos * 5 + b) % 120 + 1

    live = {g: [(pos, b) for pos, b in enumerate(ids[g]) if b != null] for g in range(len(ids))}
    # each page is the layer's placement in the backing buffer (KVCacheTensor offset,
    # layer_stride, block_stride), in the group's layer order
    base = t.buf.data_ptr()
    for g, blocks in live.items():
        for _, b in blocks:
            pages = v.group_block_bytes(p, kv, g, b)
            for name, page in zip(p.groups[g].layer_names, pages):
                start, end = v.block_byte_range(p, name, b)
                assert page.data_ptr() - base == start and page.numel() <= end - start
    for g, blocks in live.items():
        assert blocks
        for pos, b in blocks:
            for page in v.group_block_bytes(p, kv, g, b):
                page.fill_(fill(g, pos, b))
    for g, blocks in live.items():
        for pos, b in blocks:
            for page in v.group_block_bytes(p, kv, g, b):
                assert bool((page == fill(g, pos, b)).all())
    # cross-group: group 0's layers at the last group's ids hold the last group's bytes
    last = len(ids) - 1
    pos, b = live[last][0]
    page = v.group_block_bytes(p, kv, 0, b)[0]
    assert bool((page == fill(last, pos, b)).all())
    assert b not in ids[0]
    mgr.free(req)


def test_hma_off_manager_has_one_group_without_null_blocks():
    """With HMA off (connector without SupportsHMA) the manager has one group
    (UnitaryKVCacheCoordinator) and keeps every block of the sliding layers: nothing
    is dropped outside the window."""
    p = v.plan(v.TINY_GPT_OSS, TINY_MEMORY, hma=False)
    mgr = v.make_manager(p)
    null = mgr.block_pool.null_block.block_id
    req = v.make_request(p, "r", _tokens(160, seed=2))
    ids = v.prefill(mgr, req, chunk_tokens=32).block_ids
    mgr.remove_skipped_blocks(req.request_id, 160)
    assert len(ids) == 1 and len(ids[0]) == 10 and null not in ids[0]
    assert mgr.get_block_ids(req.request_id) == (ids[0],)


@pytest.mark.parametrize("shape", [v.GPT_OSS_20B, v.QWEN3_NEXT_80B], ids=lambda s: s.name)
def test_tp2_rank_shapes(shape):
    """One TP=2 rank: KV heads halved (ModelConfig.get_num_kv_heads), GDN state halved
    (gated_delta_net_state_shape divides heads and conv channels by TP); for
    Qwen3-Next the block size stays 544 (Platform._align_hybrid_block_size on the
    halved state and halved attention page)."""
    p1 = v.plan(shape, 64 << 20)
    p2 = v.plan(shape, 64 << 20, tp=2)
    assert [v.group_kind(g.kv_cache_spec) for g in p2.groups] == [
        v.group_kind(g.kv_cache_spec) for g in p1.groups
    ]
    for name, spec in p2.specs.items():
        spec1 = p1.specs[name]
        if isinstance(spec, MambaSpec):
            assert spec.state_content_size_bytes * 2 == spec1.state_content_size_bytes
        else:
            assert spec.num_kv_heads * 2 == spec1.num_kv_heads
    assert p2.vllm_config.cache_config.block_size == p1.vllm_config.cache_config.block_size
    # half the bytes per page, so about twice the blocks in the same memory
    for g1, g2 in zip(p1.groups, p2.groups):
        assert g2.kv_cache_spec.page_size_bytes * 2 == g1.kv_cache_spec.page_size_bytes
    assert p2.kv_cache_config.num_blocks in (
        2 * p1.kv_cache_config.num_blocks,
        2 * p1.kv_cache_config.num_blocks + 1,
    )
