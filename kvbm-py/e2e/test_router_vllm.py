"""kvbm-router's OpenAI front end in front of two real `vllm serve` workers with kvbm's
connector, routing by the KV events vLLM itself publishes (`--kv-events-config`, ZMQ; vLLM's own
block hashes, which the router translates through the events' token ids into its own), kvbm's
host-tier events joining vLLM's stream.

Each worker first computes a prefix of its own, asked directly as another front end would; then
a request sharing worker i's prefix, sent to the router, must go to worker i, for both workers
(no tie-break passes this). A new prefix sent through the router twice lands on the same worker
both times. The worker that served each request is read from the router's `x-kvbm-worker`
header and checked against the workers' own request counters.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time

import pytest

from conftest import MODEL_NAME, REQUEST_TIMEOUT_S, document, http, metric, question

START_DEADLINE_S = 60.0
POLL_DEADLINE_S = 60.0


def router_bin():
    return os.environ.get("KVBM_ROUTER_BIN")


class Router:
    def __init__(self, argv, log_path):
        self.log_path = log_path
        self._log = open(log_path, "w", buffering=1)
        self._lines = queue.Queue()
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
                                      text=True, env=dict(os.environ, DYN_LOG="debug"), start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        prefix = "kvbm-router listening on "
        end = time.monotonic() + START_DEADLINE_S
        while True:
            try:
                line = self._lines.get(timeout=0.5).strip()
            except queue.Empty:
                line = ""
                if self.popen.poll() is not None or time.monotonic() > end:
                    pytest.fail(f"kvbm-router did not start:\n{log_path.read_text()[-4000:]}")
            if line.startswith(prefix):
                self.url = line[len(prefix):].strip().rstrip("/")
                break

    def _read(self):
        for line in self.popen.stdout:
            self._log.write(line)
            self._lines.put(line)

    def workers(self):
        _, raw = http("GET", f"{self.url}/workers", timeout=10)
        return {w["worker_id"]: w for w in json.loads(raw)["workers"]}

    def complete(self, prompt: str) -> int:
        headers, raw = http("POST", f"{self.url}/v1/completions", {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert json.loads(raw)["choices"][0]["text"] is not None
        return int(headers["x-kvbm-worker"].split(":")[0])

    def stop(self):
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def wait_until(probe, what, deadline_s=POLL_DEADLINE_S):
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        try:
            last = probe()
        except OSError as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}; last: {last!r}")


def requests_served(server) -> float:
    return metric(server.metrics(), "vllm:request_success_total")


@pytest.fixture(scope="module")
def fleet(servers, model_dir, tmp_path_factory):
    binary = router_bin()
    if not binary:
        pytest.skip("KVBM_ROUTER_BIN is not set")
    env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "64"}
    workers = [servers.start(f"worker{i}", connector=True, env=env, kv_events=True) for i in range(2)]
    for w in workers:
        w.wait_ready()
    spec = ";".join(
        f"{i}=tcp://127.0.0.1:{w.kv_events_port},replay=tcp://127.0.0.1:{w.kv_replay_port},http={w.url}"
        for i, w in enumerate(workers))
    router = Router([binary, "--http-port", "0", "--model-path", str(model_dir), "--model-name", MODEL_NAME,
                     "--block-size", "32", "--workers", spec, "--worker-response-timeout-secs",
                     str(int(REQUEST_TIMEOUT_S))], tmp_path_factory.mktemp("router") / "router.log")
    try:
        wait_until(lambda: set(router.workers()) == {0, 1}, "the router to list both workers")
        # ZMQ PUB drops what it sends before the router's subscription arrives, and vLLM
        # publishes only from an engine step: each worker serves a short warm-up prompt (one
        # block, then its device cache is reset) until the router has counted a batch from it.
        for i, w in enumerate(workers):
            attempt = iter(range(1000))

            def synced(i=i, w=w):
                w.complete(document(9000 + next(attempt), words=24), max_tokens=1)
                w.reset_device_cache()
                return router.workers()[i].get("batches", 0) > 0
            wait_until(synced, f"a KV event batch from worker {i}")
        yield router, workers
    finally:
        router.stop()


def test_a_prefix_each_worker_computed_attracts_its_requests(fleet):
    router, workers = fleet
    docs = {i: document(100 + i) for i in range(2)}
    for i, w in enumerate(workers):
        w.complete(docs[i] + question(0), max_tokens=4)
    for i in range(2):
        wait_until(lambda i=i: router.workers()[i]["blocks"]["gpu"] >= 16,
                   f"the router to index worker {i}'s prefix from vLLM's events")
    for i, w in enumerate(workers):
        before = [requests_served(x) for x in workers]
        got = router.complete(docs[i] + question(1))
        assert got == i, f"a request sharing worker {i}'s prefix went to worker {got}"
        after = [requests_served(x) for x in workers]
        assert after[i] == before[i] + 1 and after[1 - i] == before[1 - i]


def test_a_new_prefix_stays_with_the_worker_that_computed_it(fleet):
    router, workers = fleet
    doc = document(200)
    first = router.complete(doc + question(0))
    wait_until(lambda: router.workers()[first]["blocks"]["gpu"] >= 16, "the new prefix indexed")
    for q in (1, 2):
        assert router.complete(doc + question(q)) == first
    # kvbm's host tier reaches the router through vLLM's stream too.
    assert router.workers()[first]["blocks"]["host"] > 0
