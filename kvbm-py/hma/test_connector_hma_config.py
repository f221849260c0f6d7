"""vLLM 0.33 keeps its hybrid KV cache manager on with ``DynamoConnector``, and the connector
plans exactly the groups vLLM's planner makes, refusing (at start, naming the group and its
spec) any group it cannot serve.

Run: PYTHONPATH=.vllm-0.33:kvbm-py/hma .venv-vllm/bin/python -m pytest kvbm-py/hma -q
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import vllm033 as v
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

import kvbm
from kvbm.vllm_integration.connector import DynamoConnector, _group_kinds


class NotHybridConnector(KVConnectorBase_V1):
    """A connector without SupportsHMA, for the contrast (vLLM turns HMA off for it)."""


def transfer(name: str, module: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role="kv_both")


def resolved(kv: KVTransferConfig):
    v.install_hybrid_platform()
    return VllmConfig(cache_config=CacheConfig(block_size=16), kv_transfer_config=kv)


def test_vllm_keeps_its_hybrid_kv_cache_manager_on_with_dynamo_connector(caplog):
    # vllm/config/vllm.py: HMA is turned off unless KVConnectorFactory.supports_hma_config,
    # i.e. issubclass(connector class, SupportsHMA).
    ours = transfer("DynamoConnector", "kvbm.vllm_integration.connector")
    assert KVConnectorFactory.supports_hma_config(ours)
    with caplog.at_level(logging.WARNING):
        cfg = resolved(ours)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert "Turning off hybrid kv cache manager" not in caplog.text
    # The same check turns it off for a connector that is not a SupportsHMA.
    caplog.clear()
    other = transfer("NotHybridConnector", __name__)
    assert not KVConnectorFactory.supports_hma_config(other)
    with caplog.at_level(logging.WARNING):
        cfg = resolved(other)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is True
    assert "Turning off hybrid kv cache manager" in caplog.text
    # request_finished_all_groups is implemented (SupportsHMA's abstract method).
    assert "request_finished_all_groups" in DynamoConnector.__dict__


@pytest.mark.parametrize(
    "shape, want",
    [
        (v.TINY_GPT_OSS, ["sliding_window", "full_attention"]),
        (v.TINY_GEMMA3, ["sliding_window"] * 5 + ["full_attention"]),
        (v.TINY_QWEN3_NEXT, ["mamba"] * 3 + ["full_attention"]),
    ],
    ids=lambda x: getattr(x, "name", ""),
)
def test_the_connector_plans_the_groups_vllms_planner_makes(shape, want):
    p = v.plan(shape, 4 << 20)
    kinds = _group_kinds(p.kv_cache_config, p.scheduler_block_size)
    assert [k for k, _ in kinds] == want
    for (k, w), group in zip(kinds, p.groups):
        if k == "sliding_window":
            assert w == group.kv_cache_spec.sliding_window
    # HMA off: one full-attention group, the plain path.
    off = v.plan(v.TINY_GPT_OSS, 4 << 20, hma=False)
    assert _group_kinds(off.kv_cache_config, off.scheduler_block_size) is None


def config_of(*specs):
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"model.layers.{i}.attn"]) for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups)


def attn(cls=FullAttentionSpec, **kw):
    return cls(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize(
    "bad, says",
    [
        (attn(SinkFullAttentionSpec, sink_len=4), "SinkFullAttentionSpec"),
        (
            MambaSpec(shapes=((4, 4),), dtypes=(torch.bfloat16,), block_size=16, mamba_cache_mode="none"),
            "'align' mode only",
        ),
        (attn(SlidingWindowSpec, sliding_window=64).__class__(block_size=32, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=64), "blocks of 32 tokens"),
    ],
    ids=["sink", "mamba-none", "block-size"],
)
def test_a_group_kvbm_cannot_serve_is_refused_naming_it(bad, says):
    with pytest.raises(kvbm.ConfigError) as e:
        _group_kinds(config_of(attn(), bad), 16)
    assert "KV cache group 1" in str(e.value) and says in str(e.value), str(e.value)


def test_chunked_local_attention_is_planned_with_its_chunk():
    cfg = config_of(attn(ChunkedLocalAttentionSpec, attention_chunk_size=8192), attn())
    assert _group_kinds(cfg, 16) == [("chunked_local_attention", 8192), ("full_attention", 0)]


def test_kvbms_own_events_carry_the_primary_groups_fields():
    # vLLM 0.33's BlockStored / BlockRemoved carry group_idx (and the spec kind on stores,
    # vllm/distributed/kv_events.py); kvbm announces its primary group's blocks only, under
    # that group's index and kind, encoded by vLLM's own classes.
    from kvbm.vllm_integration.connector import _event_group, _to_vllm_events
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    p = v.plan(v.TINY_GPT_OSS, 4 << 20)
    kinds = _group_kinds(p.kv_cache_config, p.scheduler_block_size)
    group = _event_group(p.kv_cache_config, kinds)
    assert group == {"group_idx": 1, "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None}
    stored = SimpleNamespace(block_hashes=[7, 8], parent_block_hash=None, token_ids=list(range(32)), block_size=16, medium="CPU_PINNED", lora_name=None)
    removed = SimpleNamespace(block_hashes=[7], medium="CPU_PINNED")
    # The converter dispatches on the class name, as kvbm.events' classes are named.
    Stored = type("BlockStored", (SimpleNamespace,), {})
    Removed = type("BlockRemoved", (SimpleNamespace,), {})
    out = _to_vllm_events([Stored(**vars(stored)), Removed(**vars(removed))], group)
    assert isinstance(out[0], BlockStored) and out[0].group_idx == 1 and out[0].kv_cache_spec_kind == "full_attention"
    assert isinstance(out[1], BlockRemoved) and out[1].group_idx == 1
    # Without groups (HMA off): the fields keep vLLM's defaults.
    plain = _to_vllm_events([Stored(**vars(stored))], None)
    assert plain[0].group_idx is None


def test_one_group_keeps_the_plain_path_only_where_vllm_keeps_every_block():
    # One full-attention group: exactly the path kvbm had before hybrid support.
    assert _group_kinds(config_of(attn()), 16) is None
    # One sliding-window group (all layers windowed, HMA on): vLLM's SlidingWindowManager nulls
    # blocks below the window, so it is planned as a group, never as plain full attention.
    assert _group_kinds(config_of(attn(SlidingWindowSpec, sliding_window=64)), 16) == [("sliding_window", 64)]
    # One group of a kind whose vLLM manager is not the plain one: refused, named.
    with pytest.raises(kvbm.ConfigError, match="KV cache group 0 .SinkFullAttentionSpec"):
        _group_kinds(config_of(attn(SinkFullAttentionSpec, sink_len=4)), 16)


def test_without_a_full_attention_group_kvbms_events_carry_no_group():
    # A router makes claims from a window or Mamba group's events never; kvbm's tiers hold the
    # primary group's blocks as a prefix, so they go out as plain claims.
    from kvbm.vllm_integration.connector import _event_group

    cfg = config_of(attn(SlidingWindowSpec, sliding_window=64), attn(SlidingWindowSpec, sliding_window=64))
    kinds = _group_kinds(cfg, 16)
    assert kinds == [("sliding_window", 64)] * 2
    assert _event_group(cfg, kinds) is None
