"""Stand-ins for what vLLM hands kvbm: KV cache tensors in host memory (numpy arrays behind a
tensor-like object, `kvbm.testing.HostTensor`) on kvbm's emulated device.

Kinds: vLLM 0.33's layouts ("LBNHC", "BLNHC", ...: one backing buffer, per-layer `[B, H, N, C]`
views, built by `kvbm.testing.allocate_kv_cache`, which follows vLLM's `allocate_kv_cache`),
"MLA-<layout>" (0.33's MLA: one head, the latent as content), and the per-layer tensors of
older releases ("outer_first" `[2, B, N, H, D]`, "block_first" `[B, 2, N, H, D]`, "mla"
`[B, N, D]`).

With `KVBM_TEST_SIMULATED_GPU=1` (and kvbm-cuda-sim installed as `libcuda.so` on
`LD_LIBRARY_PATH`, as scripts/test.sh does), `make_caches` puts the caches in device memory of
the simulated CUDA driver, as `cuda:0` tensors: every test built on it then runs the worker's
CUDA path (registration, pinned host tier, async copies, events), and the driver checks each
copy. Tests that hold a stream build host tensors themselves and stay on the emulated device."""

import os

import numpy as np
import pytest

from kvbm.testing import KV_CACHE_LAYOUTS, CudaDevice, HostTensor, allocate_kv_cache, simulated_gpu_array

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

#: The caches of `make_caches` are simulated device memory.
SIMULATED_GPU = os.environ.get("KVBM_TEST_SIMULATED_GPU") == "1"

#: vLLM 0.33's layouts, then the older shapes.
LAYOUTS_033 = sorted(KV_CACHE_LAYOUTS)


def make_caches(kind: str, layers: int, num_blocks: int, block_size: int, heads: int, head_size: int, dtype=np.uint16):
    """Per-layer KV caches laid out as vLLM lays them out."""
    if kind.upper() in KV_CACHE_LAYOUTS:
        # K and V side by side in the content axis: C = 2 x head_size.
        caches, _ = allocate_kv_cache(
            layers, num_blocks, heads, block_size, 2 * head_size, dtype, kind, simulated_gpu=SIMULATED_GPU
        )
        return caches
    if kind.upper().startswith("MLA-"):
        # One latent per token, as large as K and V of all heads, so tests can share patterns.
        caches, _ = allocate_kv_cache(
            layers, num_blocks, 1, block_size, 2 * heads * head_size, dtype, kind[4:], simulated_gpu=SIMULATED_GPU
        )
        return caches
    if kind == "outer_first":
        shape = (2, num_blocks, block_size, heads, head_size)
    elif kind == "block_first":
        shape = (num_blocks, 2, block_size, heads, head_size)
    elif kind == "mla":
        shape = (num_blocks, block_size, heads * head_size)
    else:
        raise ValueError(kind)
    if SIMULATED_GPU:
        return {
            f"model.layers.{i}.self_attn.attn": HostTensor(simulated_gpu_array(shape, dtype), device=CudaDevice(0))
            for i in range(layers)
        }
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
