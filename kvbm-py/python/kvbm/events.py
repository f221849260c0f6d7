"""KV cache events of the host and disk tiers, as kvbm's leader reports them.

With vLLM installed, the connector turns them into vLLM's own event classes so that vLLM's
publisher carries them next to its GPU events; these dataclasses are what a caller without vLLM
gets.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Union


# Named tuples, not frozen dataclasses: a step in which 256 requests each complete a block
# produces 256 events, and the leader's budget for the whole step is under a millisecond.
class BlockStored(NamedTuple):
    """Blocks became resident in ``medium`` ("CPU_PINNED" or "DISK"), or with ``ownership``
    set, in that shared pool (medium "STORAGE", locality "REMOTE", as vLLM 0.33 publishes a tier
    that is not the publisher's own)."""

    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_name: Optional[str]
    medium: str
    ownership: Optional[str] = None

    @property
    def locality(self) -> Optional[str]:
        return "REMOTE" if self.ownership is not None else None


class BlockRemoved(NamedTuple):
    """Blocks left ``medium`` (or the shared pool ``ownership``)."""

    block_hashes: List[int]
    medium: str
    ownership: Optional[str] = None

    @property
    def locality(self) -> Optional[str]:
        return "REMOTE" if self.ownership is not None else None


class AllBlocksCleared(NamedTuple):
    """Every block of the tiers was dropped."""


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def from_tuples(raw) -> List[KvEvent]:
    """kvbm's native event tuples (kind, medium, hashes, parent, tokens, block size, lora,
    shared pool)."""
    out: List[KvEvent] = []
    append = out.append
    for kind, medium, hashes, parent, tokens, block_size, lora, pool in raw:
        if kind == "stored":
            append(BlockStored(hashes, parent, tokens, block_size, lora, medium, pool))
        elif kind == "removed":
            append(BlockRemoved(hashes, medium, pool))
        else:
            append(AllBlocksCleared())
    return out
