"""The connector class against vLLM's contract: every method, importable with and without vLLM."""

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(__file__)


def contract_methods():
    path = os.path.join(HERE, "data", "vllm_connector_methods.txt")
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def test_every_contract_method_is_defined_by_the_connector_itself():
    from kvbm.vllm_integration.connector import DynamoConnector

    methods = contract_methods()
    assert len(methods) == 28
    for name in methods:
        assert name in DynamoConnector.__dict__, f"DynamoConnector lacks {name}"
        assert callable(getattr(DynamoConnector, name))
    sig = inspect.signature(DynamoConnector.get_num_new_matched_tokens)
    assert list(sig.parameters) == ["self", "request", "num_computed_tokens"]


def test_without_vllm_the_module_imports_and_says_how_to_get_it():
    from kvbm.vllm_integration import connector

    assert connector.HAVE_VLLM is False
    with pytest.raises(RuntimeError, match="pip install vllm"):
        connector.DynamoConnector(None, None, None)


def test_with_vllm_the_connector_is_a_vllm_connector_in_both_roles():
    # A separate interpreter with the stand-in vLLM on its path.
    script = textwrap.dedent(
        """
        import numpy as np
        from types import SimpleNamespace as NS
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1, KVConnectorRole)
        from kvbm.vllm_integration.connector import DynamoConnector, HAVE_VLLM
        assert HAVE_VLLM and issubclass(DynamoConnector, KVConnectorBase_V1)
        spec = NS(page_size_bytes=2 * 4 * 2 * 8 * 2)
        kv_cache_config = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["a", "b"])])
        cfg = NS(cache_config=NS(block_size=4), parallel_config=NS(tensor_parallel_size=1))
        leader = DynamoConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
        req = NS(request_id="x", prompt_token_ids=list(range(9)), all_token_ids=list(range(9)),
                 num_tokens=9, num_computed_tokens=0, cache_salt=None, lora_request=None)
        assert leader.get_num_new_matched_tokens(req, 0) == (0, False)
        out = NS(scheduled_new_reqs=[NS(req_id="x", prompt_token_ids=list(range(9)),
                                        block_ids=([0, 1, 2],), num_computed_tokens=0)],
                 scheduled_cached_reqs=None, num_scheduled_tokens={"x": 9})
        meta = leader.build_connector_meta(out)
        assert [len(p) for _, p in meta.offloads] == [2]
        events = list(leader.take_events())
        assert type(events[0]).__module__ == "vllm.distributed.kv_events", events
        assert events[0].medium == "CPU_PINNED" and len(events[0].block_hashes) == 2
        assert leader.request_finished(req, ([0, 1, 2],)) == (True, None)
        assert DynamoConnector.get_required_kvcache_layout(cfg) == "BLNHC"
        # The worker side gets what vLLM 0.33 hands it: the KV cache config (block count,
        # resolved layout) and per-layer views of one buffer (vllm/v1/worker/utils.py).
        from kvbm.testing import allocate_kv_cache
        spec.head_size, spec.num_kv_heads = 4, 2
        kv_cache_config.num_blocks, kv_cache_config.kv_cache_layout = 8, "BLNHC"
        worker = DynamoConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
        caches, _ = allocate_kv_cache(2, 8, 2, 4, 8, layout="BLNHC")
        worker.register_kv_caches(caches)
        native = worker._work().native
        assert (native.layout_name, native.runs_per_block, native.host_blocks) == ("BLNHC", 1, 16)
        # vLLM 0.33's order without synchronous loads: start_load_kv after the forward.
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        worker.shutdown()
        sent, _ = worker.get_finished({"x"})
        assert sent == {"x"}, sent
        leader.update_connector_output(NS(finished_sending=sent, finished_recving=None,
                                          invalid_block_ids=set()))
        leader.update_connector_output(NS(finished_sending={"unknown"}, finished_recving={"y"},
                                          invalid_block_ids=None))
        assert worker.get_block_ids_with_load_errors() == set()
        print("ok")
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(HERE, "fake_vllm"), HERE, env.get("PYTHONPATH", "")]
    )
    env["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"] = "16"
    env["KVBM_DEVICE"] = "emulated"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_connector_with_bad_configuration_names_the_variable():
    script = textwrap.dedent(
        """
        from types import SimpleNamespace as NS
        import kvbm
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from kvbm.vllm_integration.connector import DynamoConnector
        cfg = NS(cache_config=NS(block_size=4), parallel_config=NS(tensor_parallel_size=1))
        try:
            DynamoConnector(cfg, KVConnectorRole.SCHEDULER, None)
        except kvbm.ConfigError as e:
            print(e)
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "fake_vllm"), env.get("PYTHONPATH", "")])
    env["DYN_KVBM_CPU_CACHE_GB"] = "abc"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "DYN_KVBM_CPU_CACHE_GB" in done.stdout and "abc" in done.stdout
