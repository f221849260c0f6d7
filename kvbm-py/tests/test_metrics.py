"""DYN_KVBM_METRICS serves Prometheus text with Dynamo KVBM's metric names."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_vars)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=120
    )


def test_metrics_are_served_with_dynamos_names():
    port = free_port()
    done = run(
        f"""
        import urllib.request
        from kvbm.leader import KvbmLeader
        from kvbm.metrics import serve_from_env
        from types import SimpleNamespace as NS
        assert serve_from_env() == {port}
        leader = KvbmLeader(4, 8)
        out = NS(scheduled_new_reqs=[NS(req_id="x", prompt_token_ids=list(range(9)),
                                        block_ids=([0, 1, 2],), num_computed_tokens=0)],
                 scheduled_cached_reqs=None, num_scheduled_tokens={{"x": 9}})
        req = NS(request_id="x", prompt_token_ids=list(range(9)), all_token_ids=list(range(9)),
                 num_tokens=9, cache_salt=None, lora_request=None)
        leader.get_num_new_matched_tokens(req, 0)
        leader.build_connector_meta(out)
        body = urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        print(body)
        """,
        DYN_KVBM_METRICS="1",
        DYN_KVBM_METRICS_PORT=str(port),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # Blocks are counted by the worker's engine when their copies complete (no worker here);
    # the leader counts what it decides: lookups, matches, residency.
    assert "kvbm_offload_blocks_d2h 0.0" in lines
    assert "kvbm_host_blocks_registered 2.0" in lines
    assert "kvbm_lookup_tokens 8.0" in lines
    assert "kvbm_matched_tokens 0.0" in lines
    assert "# TYPE kvbm_offload_blocks_d2h unknown" in lines or "# TYPE kvbm_offload_blocks_d2h untyped" in lines
    assert "kvbm_host_blocks_capacity 8.0" in lines


def test_metrics_off_by_default_and_a_bad_port_is_named():
    done = run(
        """
        from kvbm.metrics import serve_from_env
        print(serve_from_env())
        """
    )
    assert done.stdout.strip() == "None", done.stderr
    done = run(
        """
        import kvbm
        from kvbm.metrics import serve_from_env
        try:
            serve_from_env()
        except kvbm.ConfigError as e:
            print(e)
        """,
        DYN_KVBM_METRICS="1",
        DYN_KVBM_METRICS_PORT="http",
    )
    assert "DYN_KVBM_METRICS_PORT" in done.stdout and "http" in done.stdout, done.stderr


def test_dyn_log_sets_the_filter_and_a_bad_one_is_named():
    done = run("import kvbm, logging; print(logging.getLogger('kvbm').level)", DYN_LOG="debug")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "10"
    done = run("import kvbm", DYN_LOG="kvbm_core=notalevel")
    assert done.returncode != 0
    assert "DYN_LOG" in done.stderr


def test_hit_rates_are_the_leaders_block_counts_per_tier():
    import kvbm

    leader = kvbm.Leader(4, 8, disk_blocks=8, disk_filter_disabled=True)
    tokens = list(range(16))
    hashes = kvbm.sequence_hashes(tokens, 4)
    blocks = [(h, hashes[i - 1] if i else None, tokens[4 * i : 4 * i + 4]) for i, h in enumerate(hashes)]
    leader.offload(blocks[:2])  # two blocks in the host tier
    assert leader.count_prefix_tiers(hashes) == (2, 0)
    m = leader.metrics()
    # 2 of 4 blocks hit in host memory; 0 of the 2 looked up past it hit on disk.
    assert m["kvbm_host_cache_hit_rate"] == 0.5
    assert m["kvbm_disk_cache_hit_rate"] == 0.0
    assert m["kvbm_matched_tokens"] == 8
    leader.take_disk_writes()  # both admitted at once (filter off): now on disk too
    assert leader.count_prefix_tiers(hashes) == (2, 0)
    assert leader.metrics()["kvbm_host_cache_hit_rate"] == 0.5


def test_merge_takes_the_leaders_own_sums_bytes_and_takes_the_largest_rank_for_blocks():
    from kvbm.metrics import merge

    own = {"kvbm_matched_tokens": 64.0, "kvbm_offload_blocks_d2h": 0.0, "kvbm_offload_bytes_d2h": 0.0}
    ranks = [
        {"kvbm_offload_blocks_d2h": 10, "kvbm_offload_bytes_d2h": 100, "kvbm_matched_tokens": 999},
        {"kvbm_offload_blocks_d2h": 12, "kvbm_offload_bytes_d2h": 120, "not_ours": 5, "kvbm_disk_read_blocks": "x"},
    ]
    got = merge(own, ranks)
    assert got["kvbm_matched_tokens"] == 64.0  # a worker's file never overrides the leader's
    assert got["kvbm_offload_blocks_d2h"] == 12.0  # every rank copies its shard of the same blocks
    assert got["kvbm_offload_bytes_d2h"] == 220.0  # bytes add up over ranks
    assert "not_ours" not in got and "kvbm_disk_read_blocks" not in got


def test_worker_processes_values_are_served_on_the_schedulers_port(tmp_path):
    """vLLM runs its scheduler (kvbm's leader) and each worker in separate processes: only the
    scheduler side listens, and its page carries the workers' values; a worker that has exited
    no longer counts."""
    port = free_port()
    env = dict(os.environ, DYN_KVBM_METRICS="1", DYN_KVBM_METRICS_PORT=str(port),
               DYN_KVBM_METRICS_DIR=str(tmp_path / "m"))
    worker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import sys
            from kvbm.metrics import Metrics, publisher_from_env
            m = Metrics()
            m.update({"kvbm_offload_blocks_d2h": 7, "kvbm_offload_bytes_d2h": 700})
            pub = publisher_from_env(rank=1, metrics=m)
            pub.publish(force=True)
            print(pub.path, flush=True)
            sys.stdin.readline()
            """)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        path = worker.stdout.readline().strip()
        assert path.endswith(f"rank1-{worker.pid}.json")
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
        server = f"""
            import urllib.request
            from kvbm.leader import KvbmLeader
            from kvbm.metrics import serve_from_env
            assert serve_from_env() == {port}
            KvbmLeader(4, 8)
            print(urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
            """
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(server)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert "kvbm_offload_blocks_d2h 7.0" in lines
        assert "kvbm_offload_bytes_d2h 700.0" in lines
        assert "kvbm_host_blocks_capacity 8.0" in lines
    finally:
        worker.stdin.close()
        worker.wait(timeout=30)
    # The worker is gone: its values leave the page and its file is removed.
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(server)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "kvbm_offload_blocks_d2h 0.0" in done.stdout.splitlines(), done.stderr
    assert not os.path.exists(path)


def test_a_metrics_directory_that_is_not_private_is_refused(tmp_path):
    from kvbm.metrics import _private_dir

    target = tmp_path / "t"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(target, link)
    assert _private_dir(str(link)) is None
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    assert _private_dir(str(open_dir)) is None
    assert _private_dir(str(tmp_path / "new")) == str(tmp_path / "new")


def test_a_file_left_by_a_process_whose_pid_was_reused_is_ignored_and_removed(tmp_path):
    import json as _json

    from kvbm.metrics import read_published

    d = tmp_path / "port"
    d.mkdir(mode=0o700)
    # This test's parent is alive, but it did not start at tick 1: the file is not its.
    stale = d / f"rank0-{os.getppid()}.json"
    stale.write_text(_json.dumps({"kvbm_offload_blocks_d2h": 5, "_pid_start": 1}))
    assert read_published(str(d)) == []
    assert not stale.exists()


def test_a_workers_values_reach_its_file_after_its_last_engine_call(tmp_path):
    """A worker's counters move after vLLM's last call into it (a shared-tier read or a write
    finishes in the background; an idle engine calls nothing), and a call inside the last
    PUBLISH_INTERVAL_S skips writing: the refresher writes them anyway, and nothing after
    close()."""
    from kvbm.metrics import PUBLISH_INTERVAL_S, Metrics, WorkerPublisher

    directory = tmp_path / "m"
    directory.mkdir(mode=0o700)
    native = {"kvbm_shared_read_blocks": 1.0}
    m = Metrics()
    pub = WorkerPublisher(m, rank=0, directory=str(directory))

    def file_value():
        with open(pub.path) as f:
            return json.load(f).get("kvbm_shared_read_blocks")

    m.update(native)
    pub.publish(force=True)
    pub.keep_fresh(lambda: m.update(native))
    native["kvbm_shared_read_blocks"] = 64.0
    pub.publish()  # within the interval: skipped, as the engine's last call would be
    deadline = time.monotonic() + 10.0
    while file_value() != 64.0:
        assert time.monotonic() < deadline, f"the file still says {file_value()}"
        time.sleep(PUBLISH_INTERVAL_S / 5)
    pub.close()
    assert not os.path.exists(pub.path)
    native["kvbm_shared_read_blocks"] = 65.0
    time.sleep(3 * PUBLISH_INTERVAL_S)
    assert not os.path.exists(pub.path), "a closed publisher wrote again"
