"""vLLM's KV event classes as kvbm builds them (tests only)."""

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class BlockStored:
    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


@dataclass
class BlockRemoved:
    block_hashes: List[int]
    medium: Optional[str]


@dataclass
class AllBlocksCleared:
    pass
