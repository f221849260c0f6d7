"""Fixtures for the router's front-end tests: scripted vLLM workers (fake_vllm_worker.py) and the
`kvbm-router` binary ($KVBM_ROUTER_BIN), each a subprocess that a test starts for itself and that
is stopped when the test ends. Ports are picked by the OS (port 0) and read back from each
process's first line on stdout. Waiting is bounded polling (`wait_until`), never a fixed sleep.

A failing test prints the tail of every process's log.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

HERE = Path(__file__).resolve().parent
WORKER_SCRIPT = HERE / "fake_vllm_worker.py"
TOKENIZER_DIR = HERE.parent / "data" / "tokenizer" / "chatml"
MODEL_NAME = "test-model"
BLOCK_SIZE = 16

START_DEADLINE_S = 60.0  # a worker imports transformers; a debug router starts in well under that
POLL_DEADLINE_S = 30.0
POLL_INTERVAL_S = 0.05
STOP_DEADLINE_S = 10.0
LOG_TAIL_LINES = 60


def router_bin() -> str | None:
    return os.environ.get("KVBM_ROUTER_BIN") or None


def wait_until(probe: Callable[[], Any], what: str, deadline_s: float = POLL_DEADLINE_S) -> Any:
    """Calls `probe` until it returns something truthy and returns that; fails the test with
    `what` and the last value seen once `deadline_s` has passed."""
    end = time.monotonic() + deadline_s
    last: Any = None
    while True:
        try:
            last = probe()
        except (OSError, urllib.error.URLError, ValueError) as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline_s:.0f} s waiting for {what}; last: {last!r}")
        time.sleep(POLL_INTERVAL_S)


def http_json(method: str, url: str, body: Any = None, timeout_s: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"null")


def post_bytes(url: str, body: bytes, timeout_s: float = 600.0) -> tuple[int, bytes]:
    """POSTs a JSON `body` (bytes); the status and the answer's bytes, an error status included."""
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def process_memory(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of process `pid` (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


class Process:
    """A child process whose stdout lines are read by a thread (so the pipe never fills): each
    goes to the log file and, for `first_line`, to a queue; stderr goes to the same log."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w", buffering=1)
        self._lines: queue.Queue[str] = queue.Queue()
        self.popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
            text=True, env=env, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self._log.write(line)
            self._lines.put(line)

    def first_line(self, accept: Callable[[str], Any], deadline_s: float = START_DEADLINE_S) -> Any:
        """The first stdout line `accept` takes (returns non-None for), or a failed test."""
        end = time.monotonic() + deadline_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                pytest.fail(f"{self.name} printed no start line within {deadline_s:.0f} s:\n"
                            f"{self.tail()}")
            try:
                line = self._lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self.popen.poll() is not None:
                    pytest.fail(f"{self.name} exited with {self.popen.returncode} before "
                                f"starting:\n{self.tail()}")
                continue
            got = accept(line.strip())
            if got is not None:
                return got

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Sends `sig` to the process (only ours, by pid) and waits for it; kills it if it
        outlives STOP_DEADLINE_S."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=STOP_DEADLINE_S)
        self._reader.join(timeout=2.0)

    def close(self) -> None:
        self.stop()
        self._log.close()

    def tail(self) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return "\n".join(f"  {self.name}| {line}" for line in lines)


@dataclass
class FakeWorker:
    worker_id: int
    process: Process
    http_port: int
    zmq_port: int
    replay_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def spec(self) -> str:
        """This worker in the router's --workers syntax."""
        return (f"{self.worker_id}=tcp://127.0.0.1:{self.zmq_port}"
                f",replay=tcp://127.0.0.1:{self.replay_port},http={self.url}")

    def stats(self) -> dict:
        return http_json("GET", f"{self.url}/stats")

    def evict_gpu(self, block_hashes: list[int] | None = None) -> dict:
        body = {} if block_hashes is None else {"block_hashes": block_hashes}
        return http_json("POST", f"{self.url}/evict_gpu", body)

    def fail_requests(self, mode: str | None) -> dict:
        return http_json("POST", f"{self.url}/fail", {"mode": mode})

    def complete(self, prompt: str, max_tokens: int = 4) -> dict:
        """A completion sent to this worker directly (not through the router)."""
        return http_json("POST", f"{self.url}/v1/completions",
                         {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens})

    def kill(self) -> None:
        self.process.stop(signal.SIGKILL)


@dataclass
class Router:
    process: Process
    url: str
    workers_started: list[FakeWorker] = field(default_factory=list)

    def workers(self) -> dict[int, dict]:
        """GET /workers, by worker id."""
        return {w["worker_id"]: w for w in http_json("GET", f"{self.url}/workers")["workers"]}

    def client(self, **kwargs: Any):
        import openai

        # No client-side retries: a retry must be the router's, or the test would not see it.
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", **kwargs)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture
def processes(request, tmp_path):
    """Every process a test starts; all stopped at the end, logs printed if the test failed."""
    started: list[Process] = []
    yield started
    for p in reversed(started):
        p.stop()
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for p in started:
            print(f"--- {p.name} log ({p.log_path}) ---\n{p.tail()}")
    for p in started:
        p.close()


@pytest.fixture
def tokenizer_dir() -> Path:
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"tokenizer fixture {TOKENIZER_DIR} is missing (tests/data/tokenizer/generate.py)")
    return TOKENIZER_DIR


@pytest.fixture
def start_workers(processes, tmp_path, tokenizer_dir):
    """start_workers(ids, **flags) -> [FakeWorker]: starts the workers concurrently, then reads
    each one's ports. Flags are fake_vllm_worker.py's, as keyword arguments."""

    def start(ids: list[int], **flags: Any) -> list[FakeWorker]:
        launched = []
        for wid in ids:
            argv = [sys.executable, str(WORKER_SCRIPT), "--worker-id", str(wid),
                    "--http-port", "0", "--zmq-port", "0", "--replay-port", "0",
                    "--model-path", str(tokenizer_dir), "--model-name", MODEL_NAME,
                    "--block-size", str(BLOCK_SIZE)]
            for key, value in flags.items():
                argv += [f"--{key.replace('_', '-')}", str(value)]
            p = Process(f"worker{wid}", argv, tmp_path / f"worker{wid}.log")
            processes.append(p)
            launched.append((wid, p))
        workers = []
        for wid, p in launched:
            info = p.first_line(lambda line: json.loads(line) if line.startswith("{") else None)
            workers.append(FakeWorker(wid, p, info["http_port"], info["zmq_port"],
                                      info["replay_port"]))
        return workers

    return start


@pytest.fixture
def start_router(processes, tmp_path, tokenizer_dir):
    """start_router(workers, *extra_flags) -> Router, once it lists every worker and has received
    a batch of KV events from each (see `sync_events`)."""
    binary = router_bin()
    if binary is None:
        pytest.skip("KVBM_ROUTER_BIN is not set")

    def start(workers: list[FakeWorker], *extra: str) -> Router:
        argv = [binary, "--http-port", "0", "--model-path", str(tokenizer_dir),
                "--model-name", MODEL_NAME, "--block-size", str(BLOCK_SIZE),
                "--workers", ";".join(w.spec() for w in workers), *extra]
        env = dict(os.environ)
        env.setdefault("DYN_LOG", "debug")
        p = Process("router", argv, tmp_path / "router.log", env=env)
        processes.append(p)
        prefix = "kvbm-router listening on "
        url = p.first_line(lambda line: line[len(prefix):].strip() if line.startswith(prefix) else None)
        router = Router(p, url.rstrip("/"), list(workers))
        wait_until(lambda: set(router.workers()) >= {w.worker_id for w in workers},
                   "the router to list every worker")
        sync_events(router, workers)
        return router

    return start


def sync_events(router: Router, workers: list[FakeWorker]) -> None:
    """Makes sure each worker's event stream reaches the router before a test relies on it.

    ZMQ PUB drops what it publishes before a subscriber's subscription has arrived, and a lost
    last batch shows no gap to fill; so each worker publishes a harmless batch (vLLM's
    reset_prefix_cache: AllBlocksCleared, on a worker that holds nothing yet) until the router
    counts one from it."""
    for w in workers:
        end = time.monotonic() + POLL_DEADLINE_S
        while True:
            http_json("POST", f"{w.url}/reset_prefix_cache")
            try:
                wait_until(lambda w=w: router.workers()[w.worker_id].get("batches", 0) > 0,
                           f"a KV event batch from worker {w.worker_id}", deadline_s=0.5)
                break
            except pytest.fail.Exception:
                if time.monotonic() > end:
                    raise


@pytest.fixture
def cluster(start_workers, start_router):
    """cluster(n=2, router_flags=(), **worker_flags) -> (Router, [FakeWorker]), worker ids 1..n."""

    def make(n: int = 2, router_flags: tuple[str, ...] = (), **worker_flags: Any):
        workers = start_workers(list(range(1, n + 1)), **worker_flags)
        return start_router(workers, *router_flags), workers

    return make
