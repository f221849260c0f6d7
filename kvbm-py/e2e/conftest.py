"""A real `vllm serve` (vLLM's CPU build) with kvbm's connector, for the real-engine tests.

Run by scripts/vllm-e2e.sh with the interpreter of the environment that
scripts/install-vllm-cpu.sh made (vLLM, torch and kvbm installed). Each server is a process
group of its own (the API server, vLLM's EngineCore and its worker process), started on a free
loopback port, waited for on /health (bounded), and stopped with SIGTERM (SIGKILL after a
deadline). A failing test prints the tail of every server's log.

Every server runs the same tiny model (make_tiny_model.py, made once per session) with the same
engine geometry: 32-token blocks (vLLM's CPU attention takes multiples of 32), a small device
cache (`--num-gpu-blocks-override`, so that a few prompts evict each other), float32, eager.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
START_DEADLINE_S = float(os.environ.get("KVBM_E2E_START_DEADLINE_S", "300"))
STOP_DEADLINE_S = 60.0
REQUEST_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 80

CONNECTOR = {
    "kv_connector": "DynamoConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "kvbm.vllm_integration.connector",
}


#: Ports free_port handed out in this session: never handed out twice (a port released by its
#: probe can be the kernel's next answer too).
_HANDED_OUT: set = set()


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


#: A server that loses a port to another process between free_port and its bind (vLLM and its
#: engine also pick free ports of their own) is started again on fresh ports, at most this often.
START_ATTEMPTS = 3


def http(method: str, url: str, body=None, timeout: float = REQUEST_TIMEOUT_S):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
        return resp.headers, raw


def parse_prometheus(text: str) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """{(name, sorted labels): value} of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)", line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            pass
    return out


def metric(page, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for (n, ls), v in page.items():
        if n == name and all((k, val) in ls for k, val in labels.items()):
            total += v
    return total


class VllmServer:
    """One `vllm serve` of the tiny model."""

    def __init__(self, name: str, model: Path, log_dir: Path, *, connector, prefix_caching: bool = True,
                 gpu_blocks: int = 40, env: Optional[Dict[str, str]] = None, kv_events: bool = False,
                 kvbm_metrics_port: Optional[int] = None, max_model_len: int = MAX_MODEL_LEN,
                 extra_args: tuple = ()):
        self.name = name
        self._model, self._log_dir = model, log_dir
        self._options = dict(connector=connector, prefix_caching=prefix_caching, gpu_blocks=gpu_blocks,
                             env=env, kv_events=kv_events, max_model_len=max_model_len, extra_args=extra_args)
        self.kvbm_metrics_port = kvbm_metrics_port
        self.attempt = 0
        self._launch()

    def _launch(self) -> None:
        """Starts `vllm serve` on fresh ports (its HTTP port, and with kv_events vLLM's KV event
        publisher and replay socket), logging to this attempt's file."""
        o, model, log_dir, name = self._options, self._model, self._log_dir, self.name
        connector, prefix_caching, gpu_blocks = o["connector"], o["prefix_caching"], o["gpu_blocks"]
        env, kv_events, max_model_len, extra_args = o["env"], o["kv_events"], o["max_model_len"], o["extra_args"]
        kvbm_metrics_port = self.kvbm_metrics_port
        self.attempt += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        suffix = "" if self.attempt == 1 else f".{self.attempt}"
        self.log_path = log_dir / f"{name}{suffix}.log"
        #: vLLM's KV event publisher and its replay socket (with kv_events).
        self.kv_events_port = free_port() if kv_events else None
        self.kv_replay_port = free_port() if kv_events else None
        argv = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(max_model_len), "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(gpu_blocks),
            "--enforce-eager", "--dtype", "float32", "--seed", "0",
            "--max-num-seqs", "8",
            *extra_args,
        ]
        if not prefix_caching:
            argv.append("--no-enable-prefix-caching")
        if connector:
            # True: kvbm's DynamoConnector as the README names it; a dict: that config.
            config = CONNECTOR if connector is True else connector
            argv += ["--kv-transfer-config", json.dumps(config)]
        if kv_events:
            argv += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                # vLLM binds only a wildcard endpoint and connects to any other
                # (vllm/distributed/kv_events.py, ZmqEventPublisher._is_bind_endpoint); the
                # router connects to 127.0.0.1. The replay socket is always bound.
                "endpoint": f"tcp://*:{self.kv_events_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.kv_replay_port}",
                "topic": "kv-events",
            })]
        full_env = dict(os.environ)
        full_env.update({
            # /reset_prefix_cache (drops the device cache only, unless asked for more).
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })
        if kvbm_metrics_port is not None:
            full_env.update({"DYN_KVBM_METRICS": "1", "DYN_KVBM_METRICS_PORT": str(kvbm_metrics_port)})
        full_env.update(env or {})
        self._log = open(self.log_path, "w", buffering=1)
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=full_env, start_new_session=True, cwd=str(log_dir))

    def wait_ready(self, deadline_s: float = START_DEADLINE_S) -> "VllmServer":
        end = time.monotonic() + deadline_s
        while True:
            if self.popen.poll() is not None:
                if "Address already in use" in self.log() and self.attempt < START_ATTEMPTS:
                    # Another process took a port between free_port and vLLM's bind: the whole
                    # start again on fresh ports (callers read the ports after wait_ready).
                    self.stop()
                    self._log.close()
                    self._launch()
                    end = time.monotonic() + deadline_s
                    continue
                pytest.fail(f"{self.name} exited with {self.popen.returncode} while starting:\n{self.tail()}")
            try:
                http("GET", f"{self.url}/health", timeout=2)
                return self
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > end:
                pytest.fail(f"{self.name} not up within {deadline_s:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def complete(self, prompt: str, max_tokens: int = 16) -> dict:
        _, raw = http("POST", f"{self.url}/v1/completions", {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True,
        })
        choice = json.loads(raw)["choices"][0]
        return {"text": choice["text"], "token_ids": choice.get("token_ids"),
                "prompt_token_ids": choice.get("prompt_token_ids")}

    def stream(self, prompt: str, max_tokens: int) -> Tuple[float, float]:
        """A streamed greedy completion of exactly `max_tokens` tokens: (seconds to the first
        token, seconds to the last), measured on this side of the socket."""
        body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        stamps = []
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            for line in resp:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    stamps.append(time.perf_counter())
        if not stamps:
            raise RuntimeError("no token streamed")
        return stamps[0] - start, stamps[-1] - start

    def metrics(self):
        _, raw = http("GET", f"{self.url}/metrics", timeout=10)
        return parse_prometheus(raw.decode())

    def kvbm_metrics(self):
        _, raw = http("GET", f"http://127.0.0.1:{self.kvbm_metrics_port}/metrics", timeout=10)
        return parse_prometheus(raw.decode())

    def settled_kvbm_metrics(self, deadline_s: float = 15.0, gap_s: float = 0.6):
        """kvbm's metrics once two scrapes ``gap_s`` apart agree (or after ``deadline_s``): the
        worker process's counters reach the scheduler's port a refresh interval after they move
        (kvbm.metrics' PUBLISH_INTERVAL_S), and its copies may still be finishing after the last
        answer."""
        end = time.monotonic() + deadline_s
        last = self.kvbm_metrics()
        while time.monotonic() < end:
            time.sleep(gap_s)
            now = self.kvbm_metrics()
            if now == last:
                break
            last = now
        return last

    def reset_device_cache(self) -> bool:
        _, raw = http("POST", f"{self.url}/reset_prefix_cache")
        return bool(json.loads(raw or b"{}").get("success", True))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stops the server's whole process group; returns its exit code."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=STOP_DEADLINE_S)
        # The engine's and workers' processes too, should any outlive the API server.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.popen.returncode

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self) -> str:
        lines = self.log().splitlines()[-LOG_TAIL_LINES:]
        return "\n".join(f"  {self.name}| {line}" for line in lines)


# -- prompts ----------------------------------------------------------------------------------

SYLLABLES = "ka lo mi ne ru sa to vi be da fo gu he ji pe qu wo xe yu zo".split()


def document(seed: int, words: int = 300) -> str:
    """A long prompt prefix (about 540 tokens of the tiny model: 16 full blocks)."""
    rnd = random.Random(seed)
    return " ".join("".join(rnd.choice(SYLLABLES) for _ in range(rnd.randint(1, 3))) for _ in range(words))


def question(seed: int) -> str:
    rnd = random.Random(10_000 + seed)
    return " question " + " ".join(rnd.choice(SYLLABLES) for _ in range(rnd.randint(6, 12))) + "?"


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    given = os.environ.get("KVBM_E2E_MODEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("model")
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return out


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


class Servers:
    def __init__(self, model: Path, log_dir: Path):
        self.model = model
        self.log_dir = log_dir
        self.started: List[VllmServer] = []

    def start(self, name: str, **kwargs) -> VllmServer:
        server = VllmServer(name, self.model, self.log_dir, **kwargs)
        self.started.append(server)
        return server


@pytest.fixture(scope="module")
def servers(request, model_dir, tmp_path_factory):
    """Starts servers for a module; stops them all at its end, printing their logs' tails if
    any test of the module failed."""
    s = Servers(model_dir, tmp_path_factory.mktemp("servers"))
    yield s
    for server in reversed(s.started):
        server.stop()
    failed = any(getattr(item, "report_call", None) is not None and item.report_call.failed
                 for item in request.session.items if item.module is request.module)
    if failed:
        for server in s.started:
            print(f"--- {server.name} log ({server.log_path}) ---\n{server.tail()}")
