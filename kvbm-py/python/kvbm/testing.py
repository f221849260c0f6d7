"""Stand-ins for engine tensors, for tests, benchmarks and dry runs without a GPU.

:class:`HostTensor` puts a numpy array behind the part of ``torch.Tensor`` kvbm reads
(``data_ptr()``, ``shape``, ``stride()``, ``dtype``, ``element_size()``, ``device``); kvbm then
treats it as GPU memory on its emulated device. :func:`host_array` maps such memory, optionally
with huge pages as the emulated device maps its own. Needs numpy.
"""

from __future__ import annotations

import mmap
from typing import Sequence


class HostTensor:
    """A numpy array seen as a (CPU) tensor."""

    device = "cpu"

    def __init__(self, array) -> None:
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
