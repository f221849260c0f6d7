"""KV cache events of the host and disk tiers, as kvbm's leader reports them.

With vLLM installed, the connector turns them into vLLM's own event classes so that vLLM's
publisher carries them next to its GPU events; these dataclasses are what a caller without vLLM
gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union


@dataclass(frozen=True)
class BlockStored:
    """Blocks became resident in ``medium`` ("CPU_PINNED" or "DISK")."""

    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_name: Optional[str]
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left ``medium``."""

    block_hashes: List[int]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the tiers was dropped."""


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def from_tuples(raw) -> List[KvEvent]:
    """kvbm's native event tuples (kind, medium, hashes, parent, tokens, block size, lora)."""
    out: List[KvEvent] = []
    for kind, medium, hashes, parent, tokens, block_size, lora in raw:
        if kind == "stored":
            out.append(BlockStored(list(hashes), parent, list(tokens), block_size, lora, medium))
        elif kind == "removed":
            out.append(BlockRemoved(list(hashes), medium))
        else:
            out.append(AllBlocksCleared())
    return out
