"""kvbm's connector on vLLM 0.33's own hybrid path: vLLM's planner groups the layers and places
them in one buffer (``allocate_kv_cache``), vLLM's ``KVCacheManager`` hands out every group's
block ids, and kvbm's leader and worker (the same classes ``DynamoConnector`` delegates to)
offload what a forward pass wrote and load it back for a later request, asynchronously, as vLLM
0.33's scheduler drives a connector with external tokens (``Scheduler.schedule``:
``get_num_new_matched_tokens``, ``allocate_slots(num_external_computed_tokens=...,
delay_cache_blocks=True)``, ``update_state_after_alloc``, ``build_connector_meta``; the worker's
``start_load_kv`` and ``get_finished``).

The "forward pass" writes into every layer of a group, at that group's block, bytes derived from
the layer's name and the block's whole token prefix (a Mamba state block: the prefix up to the
state's boundary). After vLLM's GPU cache is dropped, a request sharing the prefix is served by
kvbm, and every real block of every group vLLM allocated for the hit must hold exactly the bytes
of its layers for its prefix; the null block and every block vLLM did not allocate stay zero.

Run: PYTHONPATH=.vllm-0.33:kvbm-py/hma .venv-vllm/bin/python -m pytest kvbm-py/hma -q
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch

import vllm033 as v
from vllm.v1.core.sched.output import KVConnectorBlockState

from kvbm.leader import KvbmLeader
from kvbm.vllm_integration.connector import _group_kinds
from kvbm.worker import KvbmWorker

MEMORY = 4 << 20


def prefix_key(tokens: List[int]) -> int:
    return zlib.crc32(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())


def page_pattern(layer: str, tokens: List[int], nbytes: int) -> torch.Tensor:
    """The bytes one layer's page holds for a block whose prefix is ``tokens``."""
    seed = zlib.crc32(layer.encode(), prefix_key(tokens))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (nbytes,), generator=g, dtype=torch.int8)


class Engine:
    """One vLLM instance's scheduler-side block manager and KV cache, with kvbm's leader and
    one worker (tensor-parallel size 1) in this process on kvbm's emulated device."""

    def __init__(self, shape: v.ModelShape, host_blocks: int = 256):
        v.install_hybrid_platform()
        self.p = v.plan(shape, MEMORY)
        self.kv = v.allocate(self.p)
        self.bs = self.p.scheduler_block_size
        kcc = self.p.kv_cache_config
        self.groups = _group_kinds(kcc, self.bs)
        assert self.groups is not None, "a hybrid model plans its groups"
        self.manager = v.make_manager(self.p)
        self.leader = KvbmLeader(self.bs, host_blocks, groups=self.groups)
        self.worker = KvbmWorker(host_blocks=host_blocks, disk_blocks=0, kv_cache_config=kcc, device="emulated")
        self.worker.register_kv_caches(self.kv)
        self.requests: Dict[str, object] = {}

    # -- vLLM's side ----------------------------------------------------------------------

    def forward(self, request, start: int, end: int) -> None:
        """What the model writes for tokens [start, end) of ``request``: every attention
        layer's pages of the blocks those tokens complete or touch, and every Mamba layer's
        state block at ``end``."""
        tables = self.manager.get_block_ids(request.request_id)
        tokens = list(request.all_token_ids)
        for g, group in enumerate(self.p.groups):
            kind = v.group_kind(group.kv_cache_spec)
            ids = tables[g]
            if kind == "mamba":
                idx = (end + self.bs - 1) // self.bs - 1
                self._write(group, ids[idx], tokens[:end])
                continue
            for i in range(start // self.bs, (end + self.bs - 1) // self.bs):
                if ids[i] != 0:
                    self._write(group, ids[i], tokens[: min(end, (i + 1) * self.bs)])

    def _write(self, group, block_id: int, tokens: List[int]) -> None:
        assert block_id != 0, "vLLM never hands out the null block to write"
        for name in group.layer_names:
            page = v.page_bytes(self.kv[name][block_id])
            page.copy_(page_pattern(name, tokens, page.numel()))

    def expected(self, group, tokens: List[int]) -> List[torch.Tensor]:
        return [page_pattern(name, tokens, v.page_bytes(self.kv[name][1]).numel()) for name in group.layer_names]

    def scheduler_output(self, new=(), scheduled: Dict[str, int] = None):
        return SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(
                    req_id=r.request_id,
                    block_ids=tuple(self.manager.get_block_ids(r.request_id)),
                    num_computed_tokens=r.num_computed_tokens,
                    lora_request=None,
                )
                for r in new
            ],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
            num_scheduled_tokens=dict(scheduled or {}),
            preempted_req_ids=set(),
            kv_connector_block_state=KVConnectorBlockState(
                req_ids={r.request_id for r in new},
                resolve_block_ids=lambda rid: tuple(self.manager.get_block_ids(rid)),
                boundary_state_offloads={},
            ),
        )

    def step(self, out) -> None:
        """The connector's calls around one forward pass, then the workers' report."""
        meta = self.leader.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()

    def finished(self, finished_ids=()):
        sending, recving = self.worker.get_finished(set(finished_ids))
        self.leader.update_connector_output(
            SimpleNamespace(finished_sending=sending or set(), finished_recving=recving or set(), kv_connector_worker_meta=None)
        )
        return sending or set(), recving or set()

    # -- whole requests ---------------------------------------------------------------------

    def prefill_and_offload(self, rid: str, tokens: List[int]) -> None:
        req = v.make_request(self.p, rid, tokens)
        self.manager.new_step_starts()
        computed, hit, _ = self.manager.get_computed_blocks(req)
        assert hit == 0
        assert self.leader.get_num_new_matched_tokens(req, 0) == (0, False)
        assert self.manager.allocate_slots(req, len(tokens)) is not None
        self.leader.update_state_after_alloc(req, self.manager.get_blocks(rid), 0)
        self.forward(req, 0, len(tokens))
        self.step(self.scheduler_output(new=[req], scheduled={rid: len(tokens)}))
        req.num_computed_tokens = len(tokens)
        # Finished: vLLM keeps every group's blocks until the workers report the offloads.
        delay, _ = self.leader.request_finished(req, self.manager.get_block_ids(rid))
        assert delay
        for _ in range(200):
            sending, _ = self.finished([rid])
            if rid in sending:
                break
            self.step(self.scheduler_output())
        else:
            raise AssertionError("offloads never reported")
        self.manager.free(req)

    def drop_gpu_cache(self) -> None:
        """vLLM's own prefix cache forgets everything and the device memory is cleared, so only
        kvbm can serve what follows."""
        assert self.manager.reset_prefix_cache()
        v.backing_buffer(self.kv).zero_()

    def load(self, rid: str, tokens: List[int]):
        """A request whose prefix kvbm holds, as vLLM's scheduler admits an asynchronous load."""
        req = v.make_request(self.p, rid, tokens)
        self.manager.new_step_starts()
        computed, local, _ = self.manager.get_computed_blocks(req)
        assert local == 0
        found, asynchronous = self.leader.get_num_new_matched_tokens(req, 0)
        assert asynchronous, "a hybrid model's loads are asynchronous"
        blocks = self.manager.allocate_slots(
            req, 0, num_new_computed_tokens=0, new_computed_blocks=computed,
            num_external_computed_tokens=found, delay_cache_blocks=True,
        )
        assert blocks is not None
        self.leader.update_state_after_alloc(req, self.manager.get_blocks(rid), found)
        self.step(self.scheduler_output())
        for _ in range(200):
            _, recving = self.finished()
            if rid in recving:
                break
            self.step(self.scheduler_output())
        else:
            raise AssertionError("load never reported")
        return req, found


def tokens_of(seed: int, n: int) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 30000, (n,), generator=g).tolist()


SHAPES = [v.TINY_GPT_OSS, v.TINY_GEMMA3, v.TINY_QWEN3_NEXT]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_loaded_block_of_every_group_holds_its_own_bytes(shape):
    e = Engine(shape)
    bs = e.bs
    prompt = tokens_of(1, 10 * bs + 5)
    e.prefill_and_offload("a", prompt)
    e.drop_gpu_cache()
    # B shares A's first 10 blocks and goes on differently.
    b = prompt[: 10 * bs] + tokens_of(2, 7)
    req, found = e.load("b", b)
    assert found == 10 * bs, (found, e.groups)
    tables = e.manager.get_block_ids("b")
    checked = 0
    for g, group in enumerate(e.p.groups):
        kind = v.group_kind(group.kv_cache_spec)
        ids = tables[g][:10]
        real = [i for i, b_id in enumerate(ids) if b_id != 0]
        if kind == "full":
            assert real == list(range(10))
        elif kind == "sliding":
            # vLLM keeps the window's blocks before the hit only (allocate_external_computed_blocks).
            window = group.kv_cache_spec.sliding_window
            assert real == list(range(10 - (window - 1 + bs - 1) // bs, 10))
        else:
            # Mamba align mode: the state at the hit lives in its last block.
            assert real == [9]
        for i in real:
            want = e.expected(group, b[: (i + 1) * bs])
            got = v.group_block_bytes(e.p, e.kv, g, ids[i])
            for name, w, x in zip(group.layer_names, want, got):
                assert torch.equal(w, x), f"group {g} ({kind}) block {i} (id {ids[i]}) layer {name}"
                checked += 1
    assert checked > 0
    # The null block was never written.
    for name in e.kv:
        assert not v.page_bytes(e.kv[name][0]).any(), f"null block written in {name}"
    # Nothing outside the loaded blocks was written either.
    loaded = {b_id for t in tables for b_id in t[:10] if b_id}
    pages = {b_id for b_id in range(1, e.p.kv_cache_config.num_blocks) if b_id not in loaded}
    for name in list(e.kv)[:2]:
        for b_id in list(pages)[:64]:
            assert not v.page_bytes(e.kv[name][b_id]).any(), f"block {b_id} of {name} written"

