"""Stand-ins for what vLLM hands kvbm: KV cache tensors in host memory (numpy arrays behind a
tensor-like object, `kvbm.testing.HostTensor`) on kvbm's emulated device.

Kinds: vLLM 0.33's layouts ("LBNHC", "BLNHC", ...: one backing buffer, per-layer `[B, H, N, C]`
views, built by `kvbm.testing.allocate_kv_cache`, which follows vLLM's `allocate_kv_cache`),
"MLA-<layout>" (0.33's MLA: one head, the latent as content), and the per-layer tensors of
older releases ("outer_first" `[2, B, N, H, D]`, "block_first" `[B, 2, N, H, D]`, "mla"
`[B, N, D]`)."""

import os

import numpy as np
import pytest

from kvbm.testing import KV_CACHE_LAYOUTS, HostTensor, allocate_kv_cache

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

#: vLLM 0.33's layouts, then the older shapes.
LAYOUTS_033 = sorted(KV_CACHE_LAYOUTS)


def make_caches(kind: str, layers: int, num_blocks: int, block_size: int, heads: int, head_size: int, dtype=np.uint16):
    """Per-layer KV caches laid out as vLLM lays them out."""
    if kind.upper() in KV_CACHE_LAYOUTS:
        # K and V side by side in the content axis: C = 2 x head_size.
        caches, _ = allocate_kv_cache(layers, num_blocks, heads, block_size, 2 * head_size, dtype, kind)
        return caches
    if kind.upper().startswith("MLA-"):
        # One latent per token, as large as K and V of all heads, so tests can share patterns.
        caches, _ = allocate_kv_cache(layers, num_blocks, 1, block_size, 2 * heads * head_size, dtype, kind[4:])
        return caches
    if kind == "outer_first":
        shape = (2, num_blocks, block_size, heads, head_size)
    elif kind == "block_first":
        shape = (num_blocks, 2, block_size, heads, head_size)
    elif kind == "mla":
        shape = (num_blocks, block_size, heads * head_size)
    else:
        raise ValueError(kind)
    return {f"model.layers.{i}.self_attn.attn": HostTensor(np.zeros(shape, dtype=dtype)) for i in range(layers)}


def block_view(tensor: HostTensor, kind: str, block: int) -> np.ndarray:
    """Every element of one block of one layer, in a fixed order."""
    a = tensor.array
    if kind == "outer_first":
        return a[:, block].copy()
    return a[block].copy()


def token_slot(tensor: HostTensor, kind: str, block: int, slot: int) -> np.ndarray:
    """A writable view of one token's KV in one block of one layer (every head, K and V)."""
    a = tensor.array
    if kind == "outer_first":
        return a[:, block, slot]
    if kind == "block_first":
        return a[block, :, slot]
    if kind == "mla":
        return a[block, slot]
    return a[block, :, slot, :]  # [B, H, N, C]


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    monkeypatch.setenv("KVBM_DEVICE", "emulated")
