"""kvbm's Prometheus metrics, under the names Dynamo KVBM's users already graph.

``DYN_KVBM_METRICS=1`` serves them on ``DYN_KVBM_METRICS_PORT`` (default 6880), on 127.0.0.1
unless ``DYN_KVBM_METRICS_HOST`` says otherwise. Counters keep Dynamo's exact series names (no
``_total`` suffix), so they are exposed untyped.

One vLLM instance, one port: vLLM runs the scheduler (kvbm's leader) in its EngineCore process
and each GPU worker in that process (one GPU) or in a process per rank (the multiprocessing
executor, tensor parallelism). Only the scheduler side listens. Workers in other processes
publish their values to a private directory (``DYN_KVBM_METRICS_DIR``, by default
``<tmp>/kvbm-metrics-<uid>``, mode 0700, one subdirectory per port) as one small JSON file per
process, rewritten at most every :data:`PUBLISH_INTERVAL_S` and removed at shutdown; the server
merges them on every scrape. A worker's counters move after its last engine call too (reads and
writes finish in the background, and an idle engine calls nothing), so a thread of the worker
refreshes and rewrites its file every :data:`PUBLISH_INTERVAL_S` while a value changed: a scrape
is at most about that much behind. The leader's metrics are its own; a worker metric is the sum over
ranks for bytes (each rank moves its shard) and for the shared tier's outages and timeouts (each
rank has its own connections), and the largest rank's value for block counts (every rank copies
its shard of the same blocks) and for ``kvbm_shared_down`` (1 while any rank's tier is out). Files of processes that no longer exist are ignored
and removed.

The values are kvbm-core's counters (the leader's matches, a worker's copies), copied in under
these names by the native ``metrics()`` of each; Python counts only what it alone sees (tokens
looked up, load errors reported to vLLM).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

log = logging.getLogger("kvbm")

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
    "kvbm_shared_cache_hit_rate": (
        "gauge",
        "Shared tier (Redis / Valkey) prefix hits over lookups (past the host and disk tiers), in blocks",
    ),
    "kvbm_shared_read_blocks": ("counter", "Shared tier blocks read into host memory by this worker"),
    "kvbm_shared_read_misses": ("counter", "Shared tier blocks read that were missing, refused or late"),
    "kvbm_shared_write_blocks": ("counter", "Host blocks this worker queued for the shared tier"),
    "kvbm_shared_outages": ("counter", "Times the shared tier went out on a worker (server down, hung or refusing TLS)"),
    "kvbm_shared_timeouts": ("counter", "Shared tier calls of the workers that ran past their bound"),
    "kvbm_shared_writes_dropped": (
        "counter",
        "Blocks the workers did not write to the shared tier (it was out, or its writes in flight at their bound)",
    ),
    "kvbm_shared_writes_refused": ("counter", "Blocks whose shared tier write the server refused (e.g. OOM)"),
    "kvbm_shared_bad_values": (
        "counter",
        "Shared tier values the workers refused (corrupt, truncated, another model's or tenant's): misses",
    ),
    "kvbm_shared_down": ("gauge", "1 while a worker's shared tier is out (in backoff), else 0"),
}

#: Metrics the leader (scheduler side) keeps; the rest are the workers'.
LEADER_METRICS = frozenset(
    {
        "kvbm_matched_tokens",
        "kvbm_lookup_tokens",
        "kvbm_host_cache_hit_rate",
        "kvbm_disk_cache_hit_rate",
        "kvbm_shared_cache_hit_rate",
        "kvbm_host_blocks_registered",
        "kvbm_host_blocks_capacity",
    }
)
#: Worker metrics added up over ranks (the rest: the largest rank's value).
SUMMED_OVER_RANKS = frozenset(
    {"kvbm_offload_bytes_d2h", "kvbm_onboard_bytes_h2d", "kvbm_shared_outages", "kvbm_shared_timeouts"}
)
#: A worker process rewrites its file at most this often (and once more at shutdown).
PUBLISH_INTERVAL_S = 0.25


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


def merge(own: Dict[str, float], workers: List[Dict[str, float]]) -> Dict[str, float]:
    """The instance's values: the serving process's own (leader and any in-process worker) with
    the other worker processes' (see the module's text for the rules)."""
    out = dict(own)
    for snap in workers:
        for name, value in snap.items():
            if name not in METRICS or name in LEADER_METRICS:
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
            if name in SUMMED_OVER_RANKS:
                out[name] = out.get(name, 0.0) + value
            else:
                out[name] = max(out.get(name, 0.0), value)
    return out


def _private_dir(path: str) -> Optional[str]:
    """``path`` as a directory of ours, mode 0700 (created if missing); None, with a warning,
    when it is a symlink, not a directory, or another user's."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        log.warning("kvbm metrics: cannot use %s (%s); other processes' metrics are not merged", path, e)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning(
            "kvbm metrics: %s is not a private directory of this user (a symlink, another "
            "user's, or open to others); other processes' metrics are not merged",
            path,
        )
        return None
    return path


def metrics_dir(port: int) -> Optional[str]:
    """The directory where this instance's worker processes publish (see the module's text)."""
    base = os.environ.get("DYN_KVBM_METRICS_DIR") or os.path.join(
        tempfile.gettempdir(), f"kvbm-metrics-{os.getuid()}"
    )
    if _private_dir(base) is None:
        return None
    return _private_dir(os.path.join(base, str(int(port))))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_start(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22), so that a
    file of a dead process whose pid was reused is not taken for the new process's; None where
    /proc cannot say."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat_line = f.read(4096)
        return int(stat_line.rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def read_published(directory: Optional[str]) -> List[Dict[str, float]]:
    """The snapshots other live processes published in ``directory`` (stale files removed)."""
    if not directory:
        return []
    out = []
    me = os.getpid()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        stem = name[:-5] if name.endswith(".json") else name[:-9] if name.endswith(".json.tmp") else None
        if stem is None or "-" not in stem:
            continue
        try:
            pid = int(stem.rsplit("-", 1)[1])
        except ValueError:
            continue
        path = os.path.join(directory, name)
        if pid == me:
            continue  # this process's workers share its own values
        if not _alive(pid):
            try:
                os.unlink(path)
            except OSError:
                pass
            continue
        if name.endswith(".tmp"):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                data = json.loads(f.read(1 << 16))
        except (OSError, ValueError):
            continue  # being replaced, or not ours to read
        if not isinstance(data, dict):
            continue
        started = data.get("_pid_start")
        if started is not None and started != _proc_start(pid):
            # Another process now has that pid: the file's writer is gone.
            try:
                os.unlink(path)
            except OSError:
                pass
            continue
        out.append(data)
    return out


class WorkerPublisher:
    """A worker process's side: writes its values for the instance's server to merge."""

    def __init__(self, metrics: Metrics, rank: int, directory: str) -> None:
        self._metrics = metrics
        self._path = os.path.join(directory, f"rank{int(rank)}-{os.getpid()}.json")
        self._last = 0.0
        self._lock = threading.Lock()
        self._pid_start = _proc_start(os.getpid())
        # What the file holds now (None: nothing written yet).
        self._written: Optional[Dict[str, float]] = None
        self._closed = threading.Event()
        self._refresher: Optional[threading.Thread] = None

    @property
    def path(self) -> str:
        return self._path

    def publish(self, force: bool = False, changed_only: bool = False) -> None:
        """Writes the values now (``force``) or unless written in the last
        :data:`PUBLISH_INTERVAL_S`; with ``changed_only``, only if they differ from the file's."""
        now = time.monotonic()
        with self._lock:
            if self._closed.is_set():
                return
            if not force and now - self._last < PUBLISH_INTERVAL_S:
                return
            snap = {k: v for k, v in self._metrics.snapshot().items() if k not in LEADER_METRICS}
            snap["_pid_start"] = self._pid_start
            if changed_only and snap == self._written:
                return
            self._last = now
            self._written = snap
            tmp = self._path + ".tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(snap, f)
                os.replace(tmp, self._path)
            except OSError as e:
                log.debug("kvbm metrics: cannot publish to %s: %s", self._path, e)

    def keep_fresh(self, refresh: Callable[[], None]) -> None:
        """From now on, every :data:`PUBLISH_INTERVAL_S` until :meth:`close`, a daemon thread
        calls ``refresh`` (which copies the native counters in) and rewrites the file if a value
        changed. Once per publisher; an exception of ``refresh`` is logged and the values
        written as they are."""
        with self._lock:
            if self._refresher is not None or self._closed.is_set():
                return
            self._refresher = threading.Thread(
                target=self._refresh_loop, args=(refresh,), name="kvbm-metrics", daemon=True
            )
            self._refresher.start()

    def _refresh_loop(self, refresh: Callable[[], None]) -> None:
        while not self._closed.wait(PUBLISH_INTERVAL_S):
            try:
                refresh()
            except Exception as e:  # noqa: BLE001 - a metrics thread must not die of it
                log.debug("kvbm metrics: refreshing the worker's values failed: %s", e)
            self.publish(force=True, changed_only=True)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for path in (self._path, self._path + ".tmp"):
                try:
                    os.unlink(path)
                except OSError:
                    pass


def publisher_from_env(rank: int, metrics: Optional[Metrics] = None) -> Optional[WorkerPublisher]:
    """A worker's publisher when ``DYN_KVBM_METRICS`` is on (None when off or when its
    directory cannot be used)."""
    from . import _kvbm

    server = _kvbm.metrics_server()
    if server is None:
        return None
    directory = metrics_dir(server[1])
    if directory is None:
        return None
    pub = WorkerPublisher(metrics or _GLOBAL, rank, directory)
    pub.publish(force=True)
    return pub


def _collector(metrics: Metrics, directory: Optional[str] = None):
    from prometheus_client.metrics_core import Metric

    class _Collector:
        def collect(self):
            values = merge(metrics.snapshot(), read_published(directory))
            for name, value in values.items():
                kind, help_text = METRICS[name]
                # prometheus_client names counters' TYPE line "<name>_total" (OpenMetrics);
                # Dynamo's series have no suffix, so counters are exposed untyped under their
                # exact names.
                m = Metric(name, help_text, "gauge" if kind == "gauge" else "unknown")
                m.add_sample(name, {}, value)
                yield m

    return _Collector()


def serve_from_env(metrics: Optional[Metrics] = None) -> Optional[int]:
    """Starts the metrics server if ``DYN_KVBM_METRICS`` is on (once per process): the scheduler
    side's, which also serves the values of the instance's worker processes. Returns the port,
    or None when off. A port in use is reported, not fatal."""
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
        registry.register(_collector(metrics or _GLOBAL, metrics_dir(port)))
        try:
            _SERVER = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            log.warning(
                "kvbm metrics: cannot listen on %s:%s (%s); metrics are not served", host, port, e
            )
            return None
    return port
