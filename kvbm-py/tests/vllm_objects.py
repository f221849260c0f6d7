"""Stand-ins for the objects vLLM 0.33's scheduler hands a connector, with the fields kvbm reads
(vllm/v1/core/sched/output.py: ``NewRequestData``, ``CachedRequestData``, ``SchedulerOutput``;
vllm/v1/outputs.py: ``KVConnectorOutput``; vllm/v1/core/kv_cache_manager.py:
``KVCacheBlocks.get_block_ids``)."""

from dataclasses import dataclass, field
from typing import Dict, List, Set


class Blocks:
    """``KVCacheBlocks``: GPU block ids per KV cache group (one group here)."""

    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (list(self.ids),)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: List[int]
    block_ids: tuple
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: List[str] = field(default_factory=list)
    resumed_req_ids: Set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: List[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Dict[str, int]
    finished_req_ids: Set[str]
    preempted_req_ids: Set[str] = field(default_factory=set)
    # Set by the scheduler when a request is scheduled with external tokens loaded
    # synchronously (vllm/v1/core/sched/scheduler.py); the worker then loads before the forward.
    has_sync_kv_loads: bool = False


@dataclass
class ConnectorOutput:
    finished_sending: Set[str]
    finished_recving: Set[str]
    invalid_block_ids: Set[int]
    # vllm/v1/outputs.py KVConnectorOutput: the workers' aggregated KVConnectorWorkerMetadata.
    kv_connector_worker_meta: object = None
