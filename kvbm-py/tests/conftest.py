"""Stand-ins for what vLLM hands kvbm: KV cache tensors in host memory (numpy arrays behind a
tensor-like object, `kvbm.testing.HostTensor`) on kvbm's emulated device."""

import os

import numpy as np
import pytest

from kvbm.testing import HostTensor

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def make_caches(kind: str, layers: int, num_blocks: int, block_size: int, heads: int, head_size: int, dtype=np.uint16):
    """Per-layer KV caches shaped as vLLM shapes them."""
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
    if kind == "block_first":
        return a[block].copy()
    return a[block].copy()


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    monkeypatch.setenv("KVBM_DEVICE", "emulated")
