"""Stand-ins for what vLLM hands kvbm: KV cache tensors in host memory (numpy arrays behind a
tensor-like object) on kvbm's emulated device."""

import os

import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class HostTensor:
    """The part of torch.Tensor kvbm reads: data_ptr(), shape, stride(), dtype, element_size()."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def shape(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    @property
    def dtype(self):
        return self.array.dtype

    def element_size(self) -> int:
        return self.array.itemsize

    @property
    def device(self):
        return "cpu"


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
