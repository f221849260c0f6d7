"""kvbm: a KV block manager for LLM inference.

kvbm keeps reusable attention KV blocks in pinned host memory (and on disk) next to the GPU,
offloads them as requests complete blocks, brings them back when a later request shares the
prefix, and publishes tier-annotated KV cache events for a KV-aware router.

Most users only name the vLLM connector::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "DynamoConnector",
        "kv_role": "kv_both", "kv_connector_module_path": "kvbm.vllm_integration.connector"}'

The pieces it is made of are importable on their own (no vLLM needed): :class:`Config`,
:class:`kvbm.leader.KvbmLeader` (scheduler side), :class:`kvbm.worker.KvbmWorker` (GPU worker
side), :func:`sequence_hashes`, and the exceptions below.
"""

import logging as _logging
import os as _os

from ._kvbm import (
    Config,
    ConfigError,
    DeviceError,
    DiskError,
    KvbmError,
    LayoutError,
    Leader,
    Worker,
    device_kind,
    init_logging,
    sequence_hashes,
)

__all__ = [
    "Config",
    "ConfigError",
    "DeviceError",
    "DiskError",
    "KvbmError",
    "LayoutError",
    "Leader",
    "Worker",
    "device_kind",
    "sequence_hashes",
]

# DYN_LOG sets the log filter of kvbm's Rust side (tracing's syntax, e.g. "info" or
# "kvbm_core=debug") and the level of the "kvbm" Python logger.
_filter = _os.environ.get("DYN_LOG")
if _filter:
    init_logging(_filter)
    _level = _filter.split(",")[0].split("=")[-1].strip().upper()
    if _level in ("TRACE", "DEBUG", "INFO", "WARN", "WARNING", "ERROR"):
        _logging.getLogger("kvbm").setLevel(
            {"TRACE": "DEBUG", "WARN": "WARNING"}.get(_level, _level)
        )
