"""kvbm's shared tier inside real `vllm serve` processes (vLLM's CPU build): two "nodes", one
after the other, each its own server with its own host tier and no disk tier, share one real
`redis-server` over TLS (`rediss://`, the test CA of kvbm-core/tests/data/tls, the server's
certificate checked).

Node A computes four documents' prompts and writes what reaches its host tier to the server;
A is then stopped, so nothing but the server holds those blocks. Node B, started fresh, gets
the same prompts: its scheduler finds their prefixes in the shared tier, vLLM loads them
asynchronously (`load_kv_async`), and every greedy output must equal, token for token, A's
(which computed everything). vLLM's own per-source counter
(`vllm:prompt_tokens_cached_by_source_total{source="external_unspecified"}`, the member of
vllm/v1/metrics/cache_hit_source.py's `CacheHitSource` for a remote store) and kvbm's counters
on the one metrics port show that the tokens came from the pool, none missing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from conftest import REPO, document, free_port, metric, question

DOCS = 4
PROMPTS = [document(40 + i) + question(5) for i in range(DOCS)]
#: Full 32-token blocks of each document's prompt that a load can cover (about 540 tokens).
BLOCKS_PER_PROMPT = 16
TLS = REPO / "kvbm-core" / "tests" / "data" / "tls"
START_DEADLINE_S = 20.0
WRITE_DEADLINE_S = 60.0
METRICS_DEADLINE_S = 10.0


def ask(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(command + b"\r\n")
        return s.recv(256)


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """A redis-server with a plain port (for this test's own checks) and a TLS port (kvbm's)."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    work = tmp_path_factory.mktemp("redis")
    port, tls_port = free_port(), free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(work), "--tls-port", str(tls_port),
         "--tls-cert-file", str(TLS / "server.pem"), "--tls-key-file", str(TLS / "server.key"),
         "--tls-ca-cert-file", str(TLS / "ca.pem"), "--tls-auth-clients", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    end = time.monotonic() + START_DEADLINE_S
    while True:
        try:
            if ask(port, b"PING").startswith(b"+PONG"):
                break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > end:
            pytest.fail("redis-server did not start")
        time.sleep(0.05)
    yield {"port": port, "url": f"rediss://127.0.0.1:{tls_port}"}
    server.kill()
    server.wait()


def keys(redis) -> int:
    return int(ask(redis["port"], b"DBSIZE").strip().lstrip(b":"))


def settled_kvbm_metrics(server, name: str, least: float):
    """The server's kvbm metrics once ``name`` reached ``least`` (or after METRICS_DEADLINE_S):
    a worker process's counters reach the scheduler's port within kvbm.metrics'
    PUBLISH_INTERVAL_S, not at once."""
    end = time.monotonic() + METRICS_DEADLINE_S
    while True:
        got = server.kvbm_metrics()
        if metric(got, name) >= least or time.monotonic() > end:
            return got
        time.sleep(0.1)


def node_env(redis):
    return {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "128",
        "DYN_KVBM_SHARED_URL": redis["url"],
        "DYN_KVBM_SHARED_TLS_CA_FILE": str(TLS / "ca.pem"),
        # Generous for a loaded 2-core machine: a late lookup is a miss, which would fail the
        # test for the machine's sake, not kvbm's.
        "DYN_KVBM_SHARED_LOOKUP_TIMEOUT_MS": "2000",
        "DYN_KVBM_SHARED_READ_TIMEOUT_MS": "10000",
        "DYN_LOG": "info",
    }


@pytest.fixture(scope="module")
def nodes(servers, redis):
    got = {}
    a = servers.start("node-a", connector=True, env=node_env(redis), kvbm_metrics_port=free_port()).wait_ready()
    got["a"] = {p: a.complete(p) for p in PROMPTS}
    # The writes are behind the host tier and never waited for by a request: wait for them here.
    end = time.monotonic() + WRITE_DEADLINE_S
    while keys(redis) < DOCS * BLOCKS_PER_PROMPT and time.monotonic() < end:
        time.sleep(0.2)
    got["keys_after_a"] = keys(redis)
    got["kvbm_a"] = settled_kvbm_metrics(a, "kvbm_shared_write_blocks", DOCS * BLOCKS_PER_PROMPT)
    got["vllm_a"] = a.metrics()
    a.stop()
    got["log_a"] = a.log()

    b = servers.start("node-b", connector=True, env=node_env(redis), kvbm_metrics_port=free_port()).wait_ready()
    got["b"] = {p: b.complete(p) for p in PROMPTS}
    got["kvbm_b"] = settled_kvbm_metrics(b, "kvbm_shared_read_blocks", DOCS * BLOCKS_PER_PROMPT)
    got["vllm_b"] = b.metrics()
    b.stop()
    got["log_b"] = b.log()
    return got


def test_node_a_computes_and_writes_its_blocks_to_the_server(nodes):
    assert nodes["keys_after_a"] >= DOCS * BLOCKS_PER_PROMPT, nodes["keys_after_a"]
    assert metric(nodes["kvbm_a"], "kvbm_shared_write_blocks") >= DOCS * BLOCKS_PER_PROMPT
    # Nothing to find before A wrote it.
    assert metric(nodes["vllm_a"], "vllm:prompt_tokens_cached_by_source_total",
                  source="external_unspecified") == 0


def test_node_b_loads_every_prefix_from_the_server_and_answers_token_for_token_as_a(nodes):
    for p in PROMPTS:
        assert nodes["b"][p]["prompt_token_ids"] == nodes["a"][p]["prompt_token_ids"]
        assert nodes["b"][p]["token_ids"] == nodes["a"][p]["token_ids"], f"prompt #{PROMPTS.index(p)} differs"
    k, v = nodes["kvbm_b"], nodes["vllm_b"]
    # Each prompt's full blocks, all from the pool (B's host tier started empty, it has no disk).
    assert metric(k, "kvbm_shared_read_blocks") >= DOCS * BLOCKS_PER_PROMPT
    assert metric(k, "kvbm_shared_read_misses") == 0
    assert metric(k, "kvbm_load_errors") == 0
    assert metric(k, "kvbm_shared_cache_hit_rate") > 0
    shared = metric(v, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified")
    assert shared >= DOCS * BLOCKS_PER_PROMPT * 32, shared
    assert metric(v, "vllm:prompt_tokens_cached_by_source_total", source="host") == 0
    # The TLS session held throughout: the tier never went out on either node.
    for log in (nodes["log_a"], nodes["log_b"]):
        assert "shared tier: the server cannot be reached" not in log
