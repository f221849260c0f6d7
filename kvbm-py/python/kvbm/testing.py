"""Stand-ins for engine tensors, for tests, benchmarks and dry runs without a GPU.

:class:`HostTensor` puts a numpy array behind the part of ``torch.Tensor`` kvbm reads
(``data_ptr()``, ``shape``, ``stride()``, ``dtype``, ``element_size()``, ``device``,
``is_cuda``); kvbm then treats it as GPU memory on its emulated device. :func:`host_array` maps
such memory, optionally with huge pages as the emulated device maps its own.

On the simulated CUDA driver (kvbm-cuda-sim installed as ``libcuda.so`` on
``LD_LIBRARY_PATH``), :func:`simulated_gpu_array` allocates device memory with the driver's
``cuMemAlloc`` (the simulator's device memory is host memory, so numpy can stand in for the
engine's kernels writing it), and tensors over it say ``device.type == "cuda"``: the worker
then takes its CUDA path, as with vLLM's torch tensors. Needs numpy.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from typing import Sequence


class CudaDevice:
    """``torch.device("cuda", index)`` as far as kvbm reads it."""

    type = "cuda"

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def __str__(self) -> str:
        return f"cuda:{self.index}"

    __repr__ = __str__


class HostStorage:
    """The memory a :class:`HostTensor` lives in (torch's ``untyped_storage()``)."""

    def __init__(self, array) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def __array_interface__(self):
        """The array's (its read-only flag and type code tell kvbm what it may write)."""
        return self.array.__array_interface__


def _owner(array):
    """The outermost numpy array that ``array`` views (through slices and ``as_strided``)."""
    import numpy as np

    owner, at = array, getattr(array, "base", None)
    while at is not None:
        if isinstance(at, np.ndarray):
            owner = at
        at = getattr(at, "base", None)
    return owner


class HostTensor:
    """A numpy array seen as a tensor. ``storage`` is the contiguous array it views (found
    through the array's bases when not given). ``device`` is ``"cpu"``, or a
    :class:`CudaDevice` for arrays over simulated device memory (:func:`simulated_gpu_array`)."""

    def __init__(self, array, storage=None, device="cpu") -> None:
        self.array = array
        self.storage = storage if storage is not None else _owner(array)
        self.device = device

    @property
    def is_cuda(self) -> bool:
        return getattr(self.device, "type", self.device) == "cuda"

    def kvbm_current_stream(self) -> int:
        """What ``torch.cuda.current_stream().cuda_stream`` is to a torch tensor: the stream
        the engine writes this memory on. numpy writes synchronously: the legacy default
        stream (0), on which nothing is queued."""
        return 0

    def untyped_storage(self) -> HostStorage:
        return HostStorage(self.storage)

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
    def __array_interface__(self):
        """The array's (its read-only flag and type code tell kvbm what it may write)."""
        return self.array.__array_interface__


class _SimulatedDriver:
    """The CUDA driver library cudarc loads (``libcuda.so`` by name, as kvbm's native module
    does, so both get the same instance), with the primary context of device 0."""

    _lock = threading.Lock()
    _lib = None
    _ctx = None

    @classmethod
    def _check(cls, lib, result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed with CUresult {result}")

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._lib is None:
                lib = None
                for name in ("libcuda.so", "libcuda.so.1"):
                    try:
                        lib = ctypes.CDLL(name)
                        break
                    except OSError:
                        continue
                if lib is None or not hasattr(lib, "kvbm_sim_violations"):
                    raise RuntimeError(
                        "the simulated CUDA driver (kvbm-cuda-sim installed as libcuda.so) is not on "
                        "LD_LIBRARY_PATH"
                    )
                lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
                lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
                lib.kvbm_sim_violations.restype = ctypes.c_uint64
                cls._check(lib, lib.cuInit(0), "cuInit")
                ctx = ctypes.c_void_p()
                cls._check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
                cls._lib, cls._ctx = lib, ctx
            # The context is current per thread.
            cls._check(cls._lib, cls._lib.cuCtxSetCurrent(cls._ctx), "cuCtxSetCurrent")
            return cls._lib


def simulated_driver_violations() -> int:
    """How many violations the simulated driver recorded in this process."""
    return int(_SimulatedDriver.get().kvbm_sim_violations())


def simulated_gpu_array(shape: Sequence[int], dtype="uint16"):
    """A zeroed array of ``shape`` in device memory of the simulated CUDA driver (``cuMemAlloc``),
    freed with ``cuMemFree`` when the array and every view of it are gone."""
    import numpy as np

    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    size = max(count * dtype.itemsize, 1)
    lib = _SimulatedDriver.get()
    ptr = ctypes.c_uint64()
    _SimulatedDriver._check(lib, lib.cuMemAlloc_v2(ctypes.byref(ptr), size), "cuMemAlloc")
    raw = (ctypes.c_uint8 * size).from_address(ptr.value)
    raw_array = np.frombuffer(raw, dtype=np.uint8)
    raw_array[:] = 0
    # Not at interpreter exit: kvbm's native worker may still be alive then.
    weakref.finalize(raw, lambda p=ptr.value: _SimulatedDriver.get().cuMemFree_v2(p)).atexit = False
    return raw_array[: count * dtype.itemsize].view(dtype).reshape(shape)


def host_array(shape: Sequence[int], dtype="uint16", huge_pages: bool = False):
    """A zeroed array of ``shape``; with ``huge_pages``, in its own mapping advised for
    transparent huge pages (scattered writes into 4 KiB pages are much slower on some VMs)."""
    import numpy as np

    dtype = np.dtype(dtype)
    if not huge_pages:
        return np.zeros(shape, dtype=dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    m = mmap.mmap(-1, max(size, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


# vLLM 0.33's physical KV cache layouts (vllm/v1/kv_cache_layout.py, KVCacheLayout): the stride
# order, outermost first, of the logical axes [L, B, H, N, C].
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_strides(shape, order, fixed=(None,) * 5):
    """Byte strides in logical [L, B, H, N, C] order (vllm/v1/kv_cache_interface.py,
    ``compute_layout_strides``, without page padding)."""
    strides = [0] * 5
    current = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return strides


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    num_heads: int,
    block_size: int,
    content: int,
    dtype="uint16",
    layout: str = "LBNHC",
    groups: int = 1,
    kernel_block_size=None,
    huge_pages: bool = False,
    simulated_gpu: bool = False,
):
    """KV cache views laid out as vLLM 0.33 lays them out, in host memory (or with
    ``simulated_gpu``, in device memory of the simulated CUDA driver: see
    :func:`simulated_gpu_array`).

    Follows ``allocate_kv_cache`` (vllm/v1/worker/utils.py) and the ``KVCacheTensor`` placement of
    ``get_kv_cache_config_from_groups`` (vllm/v1/core/kv_cache_planning.py): one int8 backing
    buffer for every layer; per cache group one tensor placement starting at byte 0 (groups
    overlay each other), ``layer_stride`` and ``block_stride`` from ``compute_layout_strides``
    (a block-outermost layout packs all layers' pages into a block); each layer's view is
    ``as_strided`` over the buffer as ``[B, H, N, C bytes]`` and then viewed as ``dtype``
    (``create_kv_cache_views``), so it is not contiguous as an array. With
    ``kernel_block_size`` the views hold that many tokens per (kernel) block, ``block_size //
    kernel_block_size`` kernel blocks per block, as vLLM's kernel block splitting does.

    Returns ``(kv_caches, buffer)``: layer name -> :class:`HostTensor` (group 0's layers first,
    named ``model.layers.{i}.self_attn.attn``; group g > 0's layers ``...{i}.g{g}...``), and
    the backing numpy buffer.
    """
    import numpy as np

    order = KV_CACHE_LAYOUTS[layout.upper()]
    dtype = np.dtype(dtype)
    content_bytes = content * dtype.itemsize
    page = num_heads * block_size * content_bytes
    block_outermost = order[0] == 1
    # kv_cache_planning: bytes_per_block is every layer's page under a block-outermost layout.
    block_stride = num_layers * page if block_outermost else None
    planned = layout_strides(
        (num_layers, num_blocks, num_heads, block_size, content_bytes), order, (None, block_stride, None, None, None)
    )
    layer_stride, block_stride = planned[0], planned[1]
    size = num_blocks * num_layers * page
    if simulated_gpu:
        raw = simulated_gpu_array((size,), dtype="int8")
        device = CudaDevice(0)
    else:
        raw = host_array((size,), dtype="int8", huge_pages=huge_pages)
        device = "cpu"
    tokens = kernel_block_size or block_size
    ratio = block_size // tokens
    if ratio > 1:
        # create_kv_cache_views: kernel blocks split a dense page into equal parts.
        assert block_stride == page, "vLLM splits only dense, unpadded pages"
        block_stride //= ratio
    shape = (num_layers, num_blocks * ratio, num_heads, tokens, content_bytes)
    strides = layout_strides(shape, order, (layer_stride, block_stride, None, None, None))
    view_5d = np.lib.stride_tricks.as_strided(raw, shape=shape, strides=strides, writeable=True)
    caches = {}
    for g in range(groups):
        for layer in range(num_layers):
            name = f"model.layers.{layer}.self_attn.attn" if g == 0 else f"model.layers.{layer}.g{g}.self_attn.attn"
            caches[name] = HostTensor(view_5d[layer].view(dtype), storage=raw, device=device)
    return caches, raw


def allocate_hybrid_kv_cache(
    groups: Sequence[str],
    layers_per_group,
    num_blocks: int,
    num_heads: int,
    block_size: int,
    head_size: int,
    state_bytes: int,
    dtype="uint16",
    layout: str = "BLNHC",
    huge_pages: bool = False,
    simulated_gpu: bool = False,
):
    """A hybrid model's KV caches as vLLM 0.33's hybrid KV cache manager lays them out, in host
    memory (or, with ``simulated_gpu``, in the simulated driver's device memory).

    ``groups`` names each KV cache group's kind in vLLM's group order: ``"full"`` and
    ``"sliding"`` attention groups (``[B, H, N, C]`` views of ``dtype`` with K and V side by side,
    ``C = 2 x head_size``) and ``"mamba"`` groups (Mamba / linear-attention state: 1-byte
    ``[B, 1, 1, state_bytes]`` views, the ``MambaSpec`` having no dtype). Each group has
    ``layers_per_group`` layers (slots), or as many as its entry when it is a sequence (vLLM
    makes groups of the largest layer count when the counts are close, so a group may leave
    its last slots unused: ``_get_kv_cache_groups_uniform_page_size``). As
    ``get_kv_cache_config_from_groups``
    (vllm/v1/core/kv_cache_planning.py) places them: one int8 buffer, every group's slot ``i``
    at the same bytes ("groups alias from byte 0"), a Mamba page padded to the attention page
    (``Platform._align_hybrid_block_size``), block-outermost layouts packing all slots' pages
    into a block; views from ``create_kv_cache_views`` (vllm/v1/kv_cache_interface.py) with the
    planner's layer and block strides. Qwen3-Next's shape is ``("mamba", "mamba", "mamba",
    "full")`` (its first layers are linear attention, so group 0 is a Mamba group); gpt-oss's
    ``("sliding", "full")``.

    Returns ``(kv_caches, buffer, layer_names)``: layer name -> :class:`HostTensor` in group
    order (``model.layers.{i}.self_attn.attn`` for attention, ``model.layers.{i}.linear_attn``
    for Mamba, ``i`` numbering all layers), the backing numpy int8 buffer, and per group its
    layer names.
    """
    import numpy as np

    order = KV_CACHE_LAYOUTS[layout.upper()]
    dtype = np.dtype(dtype)
    content_bytes = 2 * head_size * dtype.itemsize
    page = num_heads * block_size * content_bytes
    if state_bytes > page:
        raise ValueError(f"a {state_bytes}-byte state does not fit a {page}-byte attention page")
    if isinstance(layers_per_group, int):
        counts = [layers_per_group] * len(groups)
    else:
        counts = [int(n) for n in layers_per_group]
        if len(counts) != len(groups):
            raise ValueError(f"{len(counts)} layer counts for {len(groups)} groups")
    slots = max(counts)
    if order[0] == 1:
        # Block-outermost: a block is every slot's page.
        layer_stride, block_stride = page, slots * page
    else:
        if order.index(0) > order.index(1) or order[1] not in (0, 1):
            raise ValueError(f"{layout}: vLLM pads Mamba pages only when L and B are the outer axes")
        layer_stride, block_stride = num_blocks * page, page
    size = num_blocks * slots * page
    if simulated_gpu:
        raw = simulated_gpu_array((size,), dtype="int8")
        device = CudaDevice(0)
    else:
        raw = host_array((size,), dtype="int8", huge_pages=huge_pages)
        device = "cpu"
    fixed = (layer_stride, block_stride, None, None, None)
    attention_shape = (slots, num_blocks, num_heads, block_size, content_bytes)
    attention = np.lib.stride_tricks.as_strided(
        raw, shape=attention_shape, strides=layout_strides(attention_shape, order, fixed), writeable=True
    )
    state_shape = (slots, num_blocks, 1, 1, state_bytes)
    states = np.lib.stride_tricks.as_strided(
        raw, shape=state_shape, strides=layout_strides(state_shape, order, fixed), writeable=True
    )
    caches = {}
    names = []
    for g, kind in enumerate(groups):
        group_names = []
        for slot in range(counts[g]):
            index = sum(counts[:g]) + slot
            if kind == "mamba":
                name = f"model.layers.{index}.linear_attn"
                caches[name] = HostTensor(states[slot], storage=raw, device=device)
            elif kind in ("full", "sliding"):
                name = f"model.layers.{index}.self_attn.attn"
                caches[name] = HostTensor(attention[slot].view(dtype), storage=raw, device=device)
            else:
                raise ValueError(f"group kind {kind!r}: expected full, sliding or mamba")
            group_names.append(name)
        names.append(group_names)
    return caches, raw, names
