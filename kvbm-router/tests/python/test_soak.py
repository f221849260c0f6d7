"""Soak: the router under everything a hostile or careless peer can do, all at once, for a fixed
number of rounds; at the end its file descriptors and memory are back within a stated margin of
where they were after the first round, and `/healthz` answered throughout.

At once, in every round:
- a registrar registers WORKERS_PER_ROUND workers through `POST /register`, registers each
  again (a re-registration drops and re-creates the subscription), then unregisters them all;
- streaming clients run completions through the router to two scripted vLLM workers;
- slow clients, more than `--max-connections` of them, trickle request headers one byte at a
  time and reconnect whenever the router cuts them;
- a large-prompt client sends LARGE_PROMPT_BYTES prompts to `/tokenize`;
- a hostile worker, registered like any other, publishes undecodable and oversized frames on
  its KV events socket;
- and the router itself was started with `--bootstrap-from` a hostile sibling that streams a
  valid but endless dump.

The margins (stated here, checked at the end):
- file descriptors: at most FD_MARGIN more than after the first round (sockets of connections
  still closing);
- resident memory: at most RSS_MARGIN_MIB more than after the first round (allocator slack).

Bounded in time: ROUNDS rounds of at least ROUND_S seconds each (a round ends when its
registrations are done and each client made progress); the whole test takes about a minute.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import (MODEL_NAME, Process, post_bytes, process_memory, router_bin, sync_events,
                      wait_until)

pytestmark = pytest.mark.skipif(router_bin() is None, reason="KVBM_ROUTER_BIN is not set")

openai = pytest.importorskip("openai")
zmq = pytest.importorskip("zmq")

ROUNDS = 10
ROUND_S = 2.0
WORKERS_PER_ROUND = 40  # each registered twice: 80 registrations a round, 800 in all
MAX_CONNECTIONS = 24
SLOW_CLIENTS = 40  # more than MAX_CONNECTIONS
LARGE_PROMPT_BYTES = 256 << 10
HEALTH_DEADLINE_S = 5.0
FD_MARGIN = 16
RSS_MARGIN_MIB = 96
BOOTSTRAP_MAX_BYTES = 4 << 20


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_rss_mib(pid: int) -> float:
    return process_memory(pid)[0] / 2**20


def post(url: str, body: dict, timeout_s: float = 30.0) -> tuple[int, bytes]:
    return post_bytes(url, json.dumps(body).encode(), timeout_s)


class HostileSibling:
    """An HTTP server whose `GET /dump` is a valid NDJSON dump that never ends: one worker after
    another, each with as many holdings as a worker may have."""

    def __init__(self) -> None:
        sent = self.sent = [0]

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # noqa: D102 (quiet)
                pass

            def do_GET(self) -> None:  # noqa: N802 (stdlib's name)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.end_headers()
                try:
                    self.wfile.write(json.dumps({"kind": "header", "format": "kvbm-router-dump",
                                                 "version": 1, "block_size": 16}).encode() + b"\n")
                    for wid in range(1, 1 << 40):
                        lines = [json.dumps({"kind": "worker", "worker_id": wid, "dp_rank": 0,
                                             "endpoint": f"tcp://127.0.0.1:{1 + wid % 60000}",
                                             "replay_endpoint": None, "last_seq": 7,
                                             "http_url": None})]
                        lines += [json.dumps({"kind": "hold", "tier": "GPU", "hash": h,
                                              "count": 1}) for h in range(wid << 12, (wid << 12) + 512)]
                        chunk = ("\n".join(lines) + "\n").encode()
                        self.wfile.write(chunk)
                        sent[0] += len(chunk)
                except OSError:
                    pass  # the router hung up: what it should do

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class HostileWorker:
    """A KV events publisher that sends frames no decoder should accept, and oversized ones."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        rng = random.Random(23)
        seq = 0
        while not self.stop.is_set():
            seq += 1
            payload = (bytes(rng.getrandbits(8) for _ in range(64)) if seq % 4
                       else b"\x91" + b"\xff" * (2 << 20))
            try:
                self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.Again:
                pass
            self.stop.wait(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.pub.close(0)


class SlowClients:
    """`count` connections that each send one byte of a request's headers every `every_s`, never
    finishing; a connection the router closes is opened again."""

    REQUEST = b"GET /healthz HTTP/1.1\r\nHost: soak\r\nX-Padding: " + b"a" * 4096

    def __init__(self, port: int, count: int, every_s: float = 0.25) -> None:
        self.port, self.count, self.every_s = port, count, every_s
        self.stop = threading.Event()
        self.cut = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            s.setblocking(False)
            return s
        except OSError:
            return None

    def _run(self) -> None:
        conns: list[tuple[socket.socket | None, int]] = [(self._open(), 0)
                                                         for _ in range(self.count)]
        while not self.stop.is_set():
            for i, (s, at) in enumerate(conns):
                alive = s is not None
                if alive:
                    try:
                        s.send(self.REQUEST[at % len(self.REQUEST):][:1])
                        if s.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                            alive = False
                    except BlockingIOError:
                        pass
                    except OSError:
                        alive = False
                if alive:
                    conns[i] = (s, at + 1)
                else:
                    if s is not None:
                        s.close()
                        self.cut += 1
                    conns[i] = (self._open(), 0)
            self.stop.wait(self.every_s)
        for s, _ in conns:
            if s is not None:
                s.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class Loop:
    """Runs `step` over and over on a thread until stopped; counts successes and keeps errors."""

    def __init__(self, name: str, step) -> None:
        self.name, self.step = name, step
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
                self.ok += 1
            except Exception as e:  # noqa: BLE001 (every failure is reported by the test)
                self.errors.append(f"{type(e).__name__}: {e}")
                self.stop.wait(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def test_router_soak_returns_to_its_footprint_and_keeps_answering(
        processes, tmp_path, tokenizer_dir, start_workers):
    binary = router_bin()
    workers = start_workers([1, 2], step_delay_s=0.01, output_tokens=4)
    sibling = HostileSibling()
    hostile = HostileWorker()
    argv = [binary, "--http-port", "0", "--model-path", str(tokenizer_dir),
            "--model-name", MODEL_NAME, "--block-size", "16",
            "--workers", ";".join(w.spec() for w in workers),
            "--max-connections", str(MAX_CONNECTIONS),
            "--http-header-timeout-secs", "1", "--http-body-timeout-secs", "2",
            "--bootstrap-from", sibling.url,
            "--bootstrap-max-bytes", str(BOOTSTRAP_MAX_BYTES), "--bootstrap-timeout-secs", "20"]
    env = dict(os.environ)
    env.setdefault("DYN_LOG", "info")
    router_proc = Process("router", argv, tmp_path / "router.log", env=env)
    processes.append(router_proc)
    prefix = "kvbm-router listening on "
    url = router_proc.first_line(
        lambda line: line[len(prefix):].strip().rstrip("/") if line.startswith(prefix) else None)
    pid = router_proc.popen.pid
    # The hostile sibling's dump was cut at the byte cap: the router started without it.
    assert sibling.sent[0] < 16 * BOOTSTRAP_MAX_BYTES, sibling.sent[0]
    from conftest import Router  # the fixture's handle type, for sync_events
    handle = Router(router_proc, url, list(workers))
    wait_until(lambda: set(handle.workers()) >= {1, 2}, "the router to list both workers")
    sync_events(handle, workers)
    port = int(url.rsplit(":", 1)[1])

    health_failures: list[str] = []
    health_worst = [0.0]

    def health() -> None:
        start = time.monotonic()
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=HEALTH_DEADLINE_S) as r:
                r.read()
        except OSError as e:
            health_failures.append(f"{time.monotonic() - start:.2f} s: {e}")
        health_worst[0] = max(health_worst[0], time.monotonic() - start)
        time.sleep(0.05)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60.0)

    def stream() -> None:
        words = random.choice(["alpha bravo", "charlie delta", "echo foxtrot"]) * 40
        chunks = client.completions.create(model=MODEL_NAME, prompt=words, max_tokens=4,
                                           stream=True)
        assert sum(1 for _ in chunks) >= 1

    large_text = ("golf hotel india juliet " * (LARGE_PROMPT_BYTES // 24 + 1))[:LARGE_PROMPT_BYTES]

    def large() -> None:
        status, body = post(f"{url}/tokenize", {"model": MODEL_NAME, "prompt": large_text},
                            timeout_s=120)
        # Served, or refused for want of memory budget (a 503 or 429 is a bound doing its job).
        assert status in (200, 429, 503), (status, body[:200])

    def register_round(r: int) -> None:
        for i in range(WORKERS_PER_ROUND):
            wid = 100 + i
            for _ in range(2):  # register, then register again (replaces the subscription)
                status, body = post(f"{url}/register", {
                    "worker_id": wid, "dp_rank": 0,
                    "endpoint": f"tcp://127.0.0.1:{hostile.port}"})
                assert status == 200, f"round {r}: register {wid}: {status} {body[:300]!r}"
        for i in range(WORKERS_PER_ROUND):
            status, body = post(f"{url}/unregister", {"worker_id": 100 + i, "dp_rank": 0})
            assert status == 200, f"round {r}: unregister: {status} {body[:300]!r}"

    loops = [Loop("health", health), Loop("stream-a", stream), Loop("stream-b", stream),
             Loop("large", large)]
    slow = SlowClients(port, SLOW_CLIENTS)
    baseline = None
    try:
        for r in range(ROUNDS):
            start = time.monotonic()
            before = [lp.ok for lp in loops]
            register_round(r)
            # Every client made progress this round (bounded: a stuck client fails the test).
            wait_until(lambda: all(lp.ok > b for lp, b in zip(loops, before)),
                       f"every client to make progress in round {r}", deadline_s=120)
            time.sleep(max(0.0, ROUND_S - (time.monotonic() - start)))
            if r == 0:
                baseline = (proc_fds(pid), proc_rss_mib(pid))
    finally:
        slow.close()
        for lp in loops:
            lp.close()
        hostile.close()
        sibling.close()

    assert router_proc.alive(), router_proc.tail()
    assert not health_failures, f"/healthz failed {len(health_failures)} times: {health_failures[:5]}"
    assert health_worst[0] < HEALTH_DEADLINE_S
    for lp in loops[1:]:
        assert not lp.errors, f"{lp.name}: {lp.errors[:5]}"
    assert slow.cut > 0, "no slow client was ever cut"

    base_fds, base_rss = baseline
    # Connections the clients just closed may take a moment to be reaped.
    wait_until(lambda: proc_fds(pid) <= base_fds + FD_MARGIN,
               f"the router's descriptors back within {FD_MARGIN} of {base_fds} "
               f"(now {proc_fds(pid)})")
    rss = proc_rss_mib(pid)
    assert rss <= base_rss + RSS_MARGIN_MIB, (
        f"resident memory {rss:.0f} MiB, {rss - base_rss:.0f} MiB above the first round's "
        f"{base_rss:.0f} MiB (margin {RSS_MARGIN_MIB} MiB)")
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        metrics = parse_metrics(resp.read().decode())
    # Each bound did its job and said so in /metrics.
    assert metrics.get('kv_router_bootstrap_refused_total{why="bytes"}') == 1, metrics
    hostile_frames = (metrics.get('kv_router_subscriber_total{what="undecodable"}', 0)
                      + metrics.get('kv_router_subscriber_total{what="oversized"}', 0))
    assert hostile_frames > 0, "the hostile worker's frames were not counted"
    cut = (metrics.get('kv_router_connections_deadline_total{phase="headers"}', 0)
           + metrics.get("kv_router_connections_evicted_total", 0))
    assert cut > 0
    # Only the two scripted workers are left, and only their sockets.
    assert metrics["kv_router_workers"] == 2
    assert metrics["kv_router_subscriber_sockets"] <= 2 * 4, metrics["kv_router_subscriber_sockets"]
    print(f"soak: fds {base_fds} -> {proc_fds(pid)}, rss {base_rss:.0f} -> {rss:.0f} MiB, "
          f"/healthz worst {health_worst[0]:.2f} s over {loops[0].ok} probes, "
          f"{loops[1].ok + loops[2].ok} streams, {loops[3].ok} large prompts, "
          f"{ROUNDS * WORKERS_PER_ROUND * 2} registrations, {slow.cut} slow clients cut, "
          f"{hostile_frames:.0f} hostile frames counted")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {"name{labels}": value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
