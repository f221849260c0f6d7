"""The shared tier through the connector: two vLLM instances ("nodes", each its own interpreter
with a scheduler-side and a worker-side ``DynamoConnector``, its own host pool) share one real
``redis-server`` (DYN_KVBM_SHARED_URL). A prompt the first computed is a hit on the second
(``get_num_new_matched_tokens`` offers it as an asynchronous load, vLLM 0.33's
``load_kv_async``), loaded byte-exact into other GPU blocks and reported in
``finished_recving``. Without the model's fingerprint a configured tier is refused."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

HERE = os.path.dirname(__file__)

NODE = textwrap.dedent(
    """
    import sys
    import numpy as np
    from types import SimpleNamespace as NS
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvbm.vllm_integration.connector import DynamoConnector
    from kvbm.testing import allocate_kv_cache

    role = sys.argv[1]
    spec = NS(page_size_bytes=2 * 4 * 2 * 8 * 2, head_size=4, num_kv_heads=2)
    kvcc = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["a", "b"])],
              num_blocks=8, kv_cache_layout="BLNHC")
    cfg = NS(cache_config=NS(block_size=4, cache_dtype="auto"),
             parallel_config=NS(tensor_parallel_size=1),
             model_config=NS(model="tiny-test-model", revision=None, dtype="float16"))
    leader = DynamoConnector(cfg, KVConnectorRole.SCHEDULER, kvcc)
    worker = DynamoConnector(cfg, KVConnectorRole.WORKER, kvcc)
    caches, _ = allocate_kv_cache(2, 8, 2, 4, 8, layout="BLNHC")
    worker.register_kv_caches(caches)

    def pattern(name, block):
        arr = caches[name].array[block]
        seed = sum(map(ord, name)) * 131 + block * 7
        return ((np.arange(arr.size, dtype=np.uint32) * 2654435761 + seed) % 65521).astype(arr.dtype).reshape(arr.shape)

    def run_step(meta):
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()

    tokens = list(range(100, 109))  # two full blocks and one token
    req = NS(request_id="x", prompt_token_ids=tokens, all_token_ids=tokens, num_tokens=9,
             num_computed_tokens=0, cache_salt=None, lora_request=None)
    found, is_async = leader.get_num_new_matched_tokens(req, 0)
    if role == "first":
        assert (found, is_async) == (0, False), (found, is_async)
        for name in caches:
            for b in range(8):
                caches[name].array[b] = pattern(name, b)
        out = NS(scheduled_new_reqs=[NS(req_id="x", prompt_token_ids=tokens, block_ids=([0, 1, 2],),
                                        num_computed_tokens=0)],
                 scheduled_cached_reqs=None, num_scheduled_tokens={"x": 9})
        meta = leader.build_connector_meta(out)
        run_step(meta)
        native = worker._work().native
        assert native.wait_shared(10.0), "the shared writes were sent"
        counts = native.shared_counts()
        assert counts["writes"] == 2, counts
        # The metrics page's names (kvbm.metrics.METRICS) carry the tier's work.
        assert native.metrics()["kvbm_shared_write_blocks"] == 2
        assert native.metrics()["kvbm_shared_read_blocks"] == 0
        # The pool's store reaches vLLM's event classes as vLLM 0.33 writes a remote tier's.
        pool = [e for e in leader.take_events() if getattr(e, "locality", None) == "REMOTE"]
        assert len(pool) == 1, pool
        assert pool[0].medium == "STORAGE" and pool[0].ownership.startswith("kvbm:"), pool[0]
        assert len(pool[0].block_hashes) == 2
    elif role == "corrupted":
        # The values are there (the lookup finds them) but do not check: misses, counted.
        assert (found, is_async) == (8, True), (found, is_async)
        blocks = NS(get_block_ids=lambda: ([4, 5, 6],), get_unhashed_block_ids=lambda: [])
        leader.update_state_after_alloc(req, blocks, 8)
        out = NS(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={})
        run_step(leader.build_connector_meta(out))
        worker._work().native.wait_async()
        worker.get_finished(set())
        assert worker.get_block_ids_with_load_errors(), "the corrupt blocks failed their load"
        m = worker._work().native.metrics()
        # Both asked for, both refused by the check, both failed.
        assert (m["kvbm_shared_read_blocks"], m["kvbm_shared_read_misses"]) == (2, 2), m
        assert (m["kvbm_shared_bad_values"], m["kvbm_load_errors"]) == (2, 2), m
        # A bad value is a miss, not an outage.
        assert (m["kvbm_shared_down"], m["kvbm_shared_outages"]) == (0, 0), m
    else:
        assert (found, is_async) == (8, True), (found, is_async)
        blocks = NS(get_block_ids=lambda: ([4, 5, 6],), get_unhashed_block_ids=lambda: [])
        leader.update_state_after_alloc(req, blocks, 8)
        out = NS(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={})
        meta = leader.build_connector_meta(out)
        run_step(meta)
        worker._work().native.wait_async()
        sent, recving = worker.get_finished(set())
        assert recving == {"x"}, recving
        assert worker.get_block_ids_with_load_errors() == set()
        m = worker._work().native.metrics()
        assert (m["kvbm_shared_read_blocks"], m["kvbm_shared_read_misses"]) == (2, 0), m
        failures = ("kvbm_shared_outages", "kvbm_shared_timeouts", "kvbm_shared_writes_dropped",
                    "kvbm_shared_writes_refused", "kvbm_shared_bad_values", "kvbm_shared_down")
        assert all(m[f] == 0 for f in failures), m
        assert leader._leader._native.metrics()["kvbm_shared_cache_hit_rate"] == 1.0
        for name in caches:
            for src, dst in ((0, 4), (1, 5)):
                assert np.array_equal(caches[name].array[dst], pattern(name, src)), (name, src)
    worker.shutdown()
    print("ok")
    """
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url():
    if shutil.which("redis-server") is None:
        if os.environ.get("KVBM_TEST_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed, and KVBM_TEST_REQUIRE_REDIS=1 requires it")
        pytest.skip("redis-server is not installed")
    port = free_port()
    workdir = tempfile.mkdtemp()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert time.time() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    server.kill()
    server.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def node_env(url):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "fake_vllm"), HERE, env.get("PYTHONPATH", "")])
    env["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"] = "16"
    env["KVBM_DEVICE"] = "emulated"
    env["DYN_KVBM_SHARED_URL"] = url
    return env


def run_node(role, url):
    done = subprocess.run([sys.executable, "-c", NODE, role], env=node_env(url), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_a_prompt_computed_by_one_instance_is_loaded_by_another_through_redis(redis_url):
    run_node("first", redis_url)
    run_node("second", redis_url)


def test_corrupt_values_are_misses_counted_on_the_metrics_page(redis_url):
    run_node("first", redis_url)
    port = redis_url.rsplit(":", 1)[1]
    cli = ["redis-cli", "-p", port]
    keys = subprocess.run(cli + ["--scan"], capture_output=True, text=True, check=True).stdout.split()
    assert len(keys) == 2, keys
    for key in keys:
        # Past the header: the checksum no longer matches.
        subprocess.run(cli + ["SETRANGE", key, "100", "garbage"], capture_output=True, check=True)
    run_node("corrupted", redis_url)


def test_a_configured_shared_tier_needs_the_models_fingerprint(redis_url, monkeypatch):
    import kvbm

    monkeypatch.setenv("DYN_KVBM_SHARED_URL", redis_url)
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "16")
    config = kvbm.Config.from_env()
    assert config.shared_url_set
    with pytest.raises(kvbm.ConfigError, match="DYN_KVBM_SHARED_URL"):
        kvbm._kvbm.Leader(4, 8, config=config)
    leader = kvbm._kvbm.Leader(4, 8, config=config, model_fingerprint=7)
    assert leader.count_prefix([1, 2]) == 0


def test_the_model_fingerprint_names_the_model_as_served(tmp_path, monkeypatch):
    """Two nodes share blocks only for the same computation: the same checkpoint (not only
    its path), the same resolved config, quantization and split, and the same namespace."""
    from types import SimpleNamespace as NS

    from kvbm.vllm_integration.connector import model_fingerprint

    monkeypatch.delenv("DYN_KVBM_SHARED_NAMESPACE", raising=False)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 4096)

    def cfg(**model):
        base = dict(model=str(tmp_path), revision=None, dtype="bfloat16", quantization=None,
                    hf_config=NS(rope_theta=10000.0, num_hidden_layers=2), hf_overrides=None)
        base.update(model)
        return NS(model_config=NS(**base), cache_config=NS(cache_dtype="auto"),
                  parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1))

    base = model_fingerprint(cfg(), None, 16)
    assert base == model_fingerprint(cfg(), None, 16), "deterministic"
    different = [
        model_fingerprint(cfg(hf_config=NS(rope_theta=500000.0, num_hidden_layers=2)), None, 16),
        model_fingerprint(cfg(quantization="fp8"), None, 16),
        model_fingerprint(cfg(dtype="float16"), None, 16),
        model_fingerprint(cfg(), None, 32),
    ]
    assert base not in different
    # Another fine-tune at the same path: same names and sizes, other weights.
    weights.write_bytes(bytes(reversed(range(256))) * 4096)
    tuned = model_fingerprint(cfg(), None, 16)
    assert tuned != base
    monkeypatch.setenv("DYN_KVBM_SHARED_NAMESPACE", "team-a")
    assert model_fingerprint(cfg(), None, 16) not in (base, tuned)


def test_a_shared_lookup_runs_without_the_gil(redis_url, monkeypatch):
    """A prompt's lookup in the shared tier is a round trip to the server, as long as its
    timeout when the server hangs; vLLM's other Python threads (the API server's, in one
    process) must run meanwhile. The server is stopped (SIGSTOP) so the lookup takes its whole
    timeout; a thread counting in pure Python must advance during the call, which it cannot
    while the call holds the GIL."""
    import signal
    import threading

    import kvbm

    port = int(redis_url.rsplit(":", 1)[1])
    pid = subprocess.run(["redis-cli", "-p", str(port), "info", "server"], capture_output=True,
                         text=True, check=True).stdout
    pid = int(next(line.split(":")[1] for line in pid.splitlines() if line.startswith("process_id:")))
    monkeypatch.setenv("DYN_KVBM_SHARED_URL", redis_url)
    monkeypatch.setenv("DYN_KVBM_SHARED_LOOKUP_TIMEOUT_MS", "400")
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "16")
    leader = kvbm._kvbm.Leader(4, 16, config=kvbm.Config.from_env(), model_fingerprint=7)
    # A first lookup opens the connection while the server answers.
    assert leader.match_request("warm", list(range(8)), 0, 8) == (0, False)
    stamps = []
    stop = threading.Event()

    def spin():
        n = 0
        while not stop.is_set():
            n += 1
            if n % 100 == 0:
                stamps.append(time.monotonic())

    t = threading.Thread(target=spin)
    os.kill(pid, signal.SIGSTOP)
    try:
        t.start()
        started = time.monotonic()
        found = leader.match_request("x", list(range(100, 132)), 0, 32)
        ended = time.monotonic()
    finally:
        stop.set()
        os.kill(pid, signal.SIGCONT)
        t.join()
    assert found == (0, False), "a late lookup is a miss"
    assert ended - started >= 0.3, "the lookup waited for the hung server"
    # Python hands the GIL over at most every switch interval (5 ms): a call that held it would
    # leave no stamp well inside its span.
    inside = [s for s in stamps if started + 0.1 < s < ended - 0.1]
    assert inside, "the counting thread did not run during the lookup"
