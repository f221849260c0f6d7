"""A warm restart of the connector's disk tier: the blocks the workers' cache files still hold
are adopted by the leader, so a restarted vLLM finds them.

Each worker opens its rank's cache file (``kvbm-rank<R>.cache``) when vLLM registers the KV
caches, and kvbm-core's recovery tells it which blocks the file holds (checked against the
file's superblock, the model and layout fingerprint, and each slot's header). The leader, in
vLLM's scheduler process, owns the disk tier's block ids and must know them before it hands out
any slot. vLLM creates the workers and registers their caches before it creates the scheduler
(``vllm/v1/engine/core.py``: the executor, then ``_initialize_kv_caches``, then the
``Scheduler``), so each worker writes what it found to ``kvbm-rank<R>.recovered`` next to its
cache file, tagged with the vLLM instance's id (``VllmConfig.instance_id``, the same in every
process of one instance), and the leader reads every rank's when it starts. Only blocks every
rank holds in the same slot under the same key and identity are adopted; a missing rank, a file
of another instance or an unreadable file adopts nothing (the slots are then overwritten as the
tier fills). The files are 0600, written atomically, and read with a size limit; nothing in
them is trusted further than kvbm-core's identity decoding and each block's checksum on read.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
from typing import List, Optional, Sequence, Tuple

log = logging.getLogger("kvbm")

Entry = Tuple[int, int, bytes]
FORMAT = "kvbm-recovered-v1"
#: Bytes of one rank's file at most (about a million blocks).
MAX_FILE_BYTES = 1 << 30


def recovered_path(disk_dir: str, rank: int) -> str:
    return os.path.join(disk_dir, f"kvbm-rank{int(rank)}.recovered")


def write_recovered(disk_dir: str, rank: int, instance: str, entries: Sequence[Entry]) -> str:
    """Writes what rank ``rank``'s cache file held, for the leader of vLLM instance
    ``instance``."""
    path = recovered_path(disk_dir, rank)
    body = json.dumps(
        {
            "format": FORMAT,
            "instance": str(instance),
            "rank": int(rank),
            "blocks": [[int(s), int(k), base64.b64encode(bytes(m)).decode()] for s, k, m in entries],
        }
    ).encode()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp)  # a leftover (or a planted link): never written through
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number here")


def _read_rank(disk_dir: str, rank: int, instance: str) -> Tuple[Optional[List[Entry]], str]:
    path = recovered_path(disk_dir, rank)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return None, f"rank {rank}: {path}: {e.strerror or e}"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None, f"rank {rank}: {path} is not a regular file"
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        return None, f"rank {rank}: {path} is larger than {MAX_FILE_BYTES} bytes"
    try:
        doc = json.loads(raw, parse_constant=_refuse_constant)
        if doc.get("format") != FORMAT or int(doc.get("rank", -1)) != rank:
            return None, f"rank {rank}: {path} is not a kvbm recovery file of this rank"
        if doc.get("instance") != instance:
            return None, f"rank {rank}: {path} was written by another vLLM instance"
        entries = []
        for slot, key, meta in doc["blocks"]:
            slot, key = int(slot), int(key)
            if not (0 <= slot < 1 << 32 and 0 <= key < 1 << 64):
                raise ValueError(f"slot {slot} or key {key} out of range")
            entries.append((slot, key, base64.b64decode(meta, validate=True)))
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        return None, f"rank {rank}: {path} is malformed ({e})"
    return entries, ""


def read_agreed(disk_dir: str, world_size: int, instance: str) -> Tuple[List[Entry], str]:
    """The blocks every rank's file held in the same slot under the same key and identity
    (sorted by slot), and why nothing was adopted when that is empty for a reason."""
    agreed = None
    for rank in range(int(world_size)):
        entries, why = _read_rank(disk_dir, rank, instance)
        if entries is None:
            return [], why
        found = set(entries)
        agreed = found if agreed is None else agreed & found
    out = sorted(agreed or (), key=lambda e: e[0])
    # One block per slot and per key: anything else is not a file kvbm wrote.
    if len({e[0] for e in out}) != len(out) or len({e[1] for e in out}) != len(out):
        return [], "the recovery files name a slot or a key twice"
    return out, ""


__all__ = ["read_agreed", "recovered_path", "write_recovered"]
