"""vLLM 0.33's KV event classes (vllm/distributed/kv_events.py) as far as kvbm builds them
(tests only): the same fields in the same order, the same required ones (``lora_name`` has no
default in 0.32 and 0.33), and ``__struct_fields__`` as msgspec structs have it."""

from dataclasses import dataclass, fields
from typing import Any, List, Optional


@dataclass
class BlockStored:
    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Any]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


@dataclass
class BlockRemoved:
    block_hashes: List[int]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


@dataclass
class AllBlocksCleared:
    pass


for _cls in (BlockStored, BlockRemoved, AllBlocksCleared):
    _cls.__struct_fields__ = tuple(f.name for f in fields(_cls))
