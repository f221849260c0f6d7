"""kvbm's Prometheus metrics, under the names Dynamo KVBM's users already graph.

``DYN_KVBM_METRICS=1`` serves them on ``DYN_KVBM_METRICS_PORT`` (default 6880), on 127.0.0.1
unless ``DYN_KVBM_METRICS_HOST`` says otherwise. Counters keep Dynamo's exact series names (no
``_total`` suffix), so they are exposed untyped.

The values are kvbm-core's counters (the leader's matches, a worker's copies), copied in under
these names by the native ``metrics()`` of each; Python counts only what it alone sees (tokens
looked up, load errors reported to vLLM).
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

# name -> (type, help)
METRICS: Dict[str, Tuple[str, str]] = {
    "kvbm_offload_blocks_d2h": ("counter", "Blocks offloaded from GPU to pinned host memory"),
    "kvbm_offload_blocks_h2d": ("counter", "Blocks offloaded from host memory to disk"),
    "kvbm_onboard_blocks_h2d": ("counter", "Blocks onboarded from host memory to the GPU"),
    "kvbm_onboard_blocks_d2d": ("counter", "Blocks onboarded from disk to the GPU"),
    "kvbm_matched_tokens": ("counter", "Prompt tokens found in kvbm's tiers"),
    "kvbm_lookup_tokens": ("counter", "Prompt tokens looked up in kvbm's tiers"),
    "kvbm_load_errors": ("counter", "GPU blocks whose load failed (recomputed by the engine)"),
    "kvbm_offload_bytes_d2h": ("counter", "Bytes copied from GPU to host memory"),
    "kvbm_onboard_bytes_h2d": ("counter", "Bytes copied from host memory to the GPU"),
    "kvbm_host_cache_hit_rate": ("gauge", "Host tier prefix hits over lookups, in blocks"),
    "kvbm_disk_cache_hit_rate": ("gauge", "Disk tier prefix hits over lookups (past the host tier), in blocks"),
    "kvbm_disk_read_blocks": ("counter", "Disk blocks read into host memory by this worker"),
    "kvbm_disk_read_misses": ("counter", "Disk blocks read that failed verification or I/O"),
    "kvbm_offload_skipped_blocks": ("counter", "Offloads not done (no room, or the queue at its bound)"),
    "kvbm_transfer_errors": ("counter", "Copy batches that failed"),
    "kvbm_disk_write_failures": ("counter", "Host blocks whose disk write failed or was refused"),
    "kvbm_host_blocks_registered": ("gauge", "Blocks resident in the host tier"),
    "kvbm_host_blocks_capacity": ("gauge", "Blocks the host tier holds at most"),
}


class Metrics:
    """Thread-safe values of :data:`METRICS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Dict[str, float] = {name: 0.0 for name in METRICS}

    def inc(self, name: str, amount: float = 1.0) -> None:
        if amount:
            with self._lock:
                self._values[name] += amount

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name] = float(value)

    def get(self, name: str) -> float:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> Dict[str, float]:
        with self._lock:
            return dict(self._values)

    def update(self, values: Dict[str, float]) -> None:
        """Sets every value of ``values`` (a native ``metrics()`` dict) at once."""
        with self._lock:
            for name, value in values.items():
                self._values[name] = float(value)


_GLOBAL = Metrics()
_SERVER_LOCK = threading.Lock()
_SERVER: Optional[object] = None


def global_metrics() -> Metrics:
    """The process's metrics (shared by its leader or worker)."""
    return _GLOBAL


def _collector(metrics: Metrics):
    from prometheus_client.metrics_core import Metric

    class _Collector:
        def collect(self):
            for name, value in metrics.snapshot().items():
                kind, help_text = METRICS[name]
                # prometheus_client names counters' TYPE line "<name>_total" (OpenMetrics);
                # Dynamo's series have no suffix, so counters are exposed untyped under their
                # exact names.
                m = Metric(name, help_text, "gauge" if kind == "gauge" else "unknown")
                m.add_sample(name, {}, value)
                yield m

    return _Collector()


def serve_from_env(metrics: Optional[Metrics] = None) -> Optional[int]:
    """Starts the metrics server if ``DYN_KVBM_METRICS`` is on (once per process); returns the
    port, or None when off. A port in use is reported, not fatal."""
    from . import _kvbm

    # Read and checked by kvbm-core's configuration, like every other variable.
    server = _kvbm.metrics_server()
    if server is None:
        return None
    host, port = server
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is not None:
            return port
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_collector(metrics or _GLOBAL))
        try:
            _SERVER = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            import logging

            logging.getLogger("kvbm").warning(
                "kvbm metrics: cannot listen on %s:%s (%s); metrics are not served", host, port, e
            )
            return None
    return port
