"""What the leader tells the workers each step (pickled by vLLM between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

try:  # vLLM types the metadata with its own base class; kvbm's works without vLLM too.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorMetadata as _Base,
    )
except Exception:  # vLLM absent (or a version without it): a plain base.

    class _Base:  # type: ignore[no-redef]
        pass


Pairs = List[Tuple[int, int]]


@dataclass
class KvbmConnectorMetadata(_Base):
    """One scheduler step's instructions for every worker.

    - ``loads``: per request id, (host block, GPU block) pairs to copy into the GPU before the
      forward pass.
    - ``saves``: per request id, (GPU block, host block) pairs to copy out after it.
    - ``load_errors``: GPU block ids the leader promised but could not back (their host copies
      were evicted in between); workers report them so that vLLM recomputes them.
    - ``disk_reads``: (disk block, host block, key) to read before the loads (the host blocks
      are staging blocks that the loads then copy to the GPU).
    - ``disk_writes``: (host block, disk block, key, identity bytes) to write after the saves.
    - ``async_loads``: per request id, its disk reads and (host, GPU) pairs, loaded in the
      background; the workers report the request in ``finished_recving`` when done.
    - ``preempted``: requests vLLM preempted in this step; their GPU blocks are reused right
      after ``handle_preemptions``, which waits for their saves.
    """

    step: int = 0
    loads: List[Tuple[str, Pairs]] = field(default_factory=list)
    saves: List[Tuple[str, Pairs]] = field(default_factory=list)
    load_errors: List[int] = field(default_factory=list)
    disk_reads: List[Tuple[int, int, int]] = field(default_factory=list)
    disk_writes: List[Tuple[int, int, int, List[int]]] = field(default_factory=list)
    async_loads: List[Tuple[str, List[Tuple[int, int, int]], Pairs]] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)
