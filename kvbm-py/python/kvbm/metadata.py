"""What the leader tells the workers each step (pickled by vLLM between processes).

The instructions are kvbm-core's typed step plan, serialised to MessagePack bytes by the leader
(``Leader.take_plan``) and executed by the workers (``Worker.bind``): what crosses processes is
one ``bytes`` object, not Python tuples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from . import _kvbm

try:  # vLLM types the metadata with its own base class; kvbm's works without vLLM too.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorMetadata as _Base,
    )
except Exception:  # vLLM absent (or a version without it): a plain base.

    class _Base:  # type: ignore[no-redef]
        pass


try:  # vLLM 0.33's channel from the workers back to the scheduler's connector.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorWorkerMetadata as _WorkerBase,
    )
except Exception:

    class _WorkerBase:  # type: ignore[no-redef]
        pass


Pairs = List[Tuple[int, int]]


@dataclass
class KvbmConnectorMetadata(_Base):
    """One scheduler step's plan for every worker, as bytes (``plan``).

    Its parts, decoded on demand for inspection:

    - ``onboards``: per request id, (host block, GPU block) pairs to copy into the GPU before
      the layers that need them run.
    - ``offloads``: per request id, (GPU block, host block) pairs to copy out after the forward.
    - ``load_errors``: GPU block ids the leader promised but could not back (their host copies
      were evicted in between); workers report them so that vLLM recomputes them.
    - ``disk_reads``: (disk block, host block, key) to read before the onboards (into staging
      host blocks that the onboards then copy to the GPU).
    - ``disk_writes``: (host block, disk block, key, identity bytes) to write after the offloads.
    - ``async_onboards``: per request id, its disk reads and (host, GPU) pairs, onboarded in the
      background; the workers report the request in ``finished_recving`` when done.
    - ``preempted``: requests vLLM preempted in this step; their GPU blocks are reused right
      after ``handle_preemptions``, which waits for their offloads.
    """

    step: int = 0
    plan: bytes = b""

    @classmethod
    def build(cls, step: int = 0, **parts: Any) -> "KvbmConnectorMetadata":
        """A plan from its parts (keywords as listed above); for tests and tools."""
        return cls(step=step, plan=bytes(_kvbm.encode_plan(step, **parts)))

    def parts(self) -> Dict[str, Any]:
        """The plan's parts (decoded from the bytes)."""
        if not self.plan:
            return dict(_kvbm.decode_plan(_kvbm.encode_plan(self.step)))
        return dict(_kvbm.decode_plan(self.plan))

    @property
    def onboards(self) -> List[Tuple[str, Pairs]]:
        return self.parts()["onboards"]

    @property
    def offloads(self) -> List[Tuple[str, Pairs]]:
        return self.parts()["offloads"]

    @property
    def disk_reads(self) -> List[Tuple[int, int, int]]:
        return self.parts()["disk_reads"]

    @property
    def disk_writes(self) -> List[Tuple[int, int, int, bytes]]:
        return self.parts()["disk_writes"]

    @property
    def async_onboards(self) -> List[Tuple[str, List[Tuple[int, int, int]], Pairs]]:
        return self.parts()["async_onboards"]

    @property
    def load_errors(self) -> List[int]:
        return self.parts()["load_errors"]

    @property
    def preempted(self) -> List[str]:
        return self.parts()["preempted"]


@dataclass
class KvbmWorkerMetadata(_WorkerBase):
    """What a worker tells the leader after a step (vLLM 0.33 aggregates every worker's through
    ``aggregate`` and hands it to the scheduler's ``update_connector_output``): host blocks whose
    offload failed and disk blocks whose write or read failed. The leader drops them, so that it
    never matches a block a worker cannot serve."""

    bad_host_blocks: frozenset = frozenset()
    bad_disk_blocks: frozenset = frozenset()

    def aggregate(self, other: "KvbmWorkerMetadata") -> "KvbmWorkerMetadata":
        return KvbmWorkerMetadata(
            self.bad_host_blocks | getattr(other, "bad_host_blocks", frozenset()),
            self.bad_disk_blocks | getattr(other, "bad_disk_blocks", frozenset()),
        )
