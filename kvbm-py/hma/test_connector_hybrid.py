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

import os
import pickle
import time
import zlib
from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch

import vllm033 as v
from vllm.v1.core.sched.output import KVConnectorBlockState

import kvbm
from kvbm.leader import KvbmLeader
from kvbm.vllm_integration.connector import _group_kinds
from kvbm.worker import KvbmWorker

MEMORY = 4 << 20

#: Run on the CUDA back end over kvbm-cuda-sim (scripts/test.sh sets it, with the simulated
#: driver as libcuda.so on LD_LIBRARY_PATH).
SIMULATED_GPU = os.environ.get("KVBM_TEST_SIMULATED_GPU") == "1"


def on_simulated_gpu(kv: Dict[str, torch.Tensor]):
    """vLLM's views, the same shapes, strides and offsets, over a buffer of the simulated CUDA
    driver's device memory: as ``cuda:0`` tensors for kvbm (``kvbm.testing.HostTensor``), and as
    torch views of the same bytes for the test's forward pass and checks."""
    import numpy as np

    from kvbm.testing import CudaDevice, HostTensor, simulated_gpu_array

    buf = v.backing_buffer(kv)
    sim = simulated_gpu_array((buf.numel(),), "uint8")
    tbuf = torch.from_numpy(sim).view(torch.int8)
    base = buf.data_ptr()
    for_test, for_kvbm = {}, {}
    for name, t in kv.items():
        esize = t.element_size()
        offset = t.data_ptr() - base
        assert offset % esize == 0
        for_test[name] = torch.as_strided(tbuf.view(t.dtype), t.shape, t.stride(), offset // esize)
        # numpy has no bfloat16: kvbm reads only element sizes, so 2-byte ints stand in.
        np_dtype = {1: np.int8, 2: np.uint16, 4: np.uint32}[esize]
        arr = np.lib.stride_tricks.as_strided(
            sim[offset:].view(np_dtype), shape=tuple(t.shape), strides=tuple(st * esize for st in t.stride())
        )
        for_kvbm[name] = HostTensor(arr, storage=sim, device=CudaDevice(0))
    return for_test, for_kvbm


def prefix_key(tokens: List[int]) -> int:
    return zlib.crc32(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())


def page_pattern(layer: str, tokens: List[int], nbytes: int, rank: int = 0) -> torch.Tensor:
    """The bytes one layer's page holds on ``rank`` for a block whose prefix is ``tokens``."""
    seed = zlib.crc32(f"{layer}@{rank}".encode(), prefix_key(tokens))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (nbytes,), generator=g, dtype=torch.int8)


class Engine:
    """One vLLM instance's scheduler-side block manager and, per tensor-parallel rank, its KV
    cache (one rank's shard, as vLLM plans it for that TP size) with a kvbm worker, all in this
    process on kvbm's emulated device; kvbm's leader plans for all of them."""

    def __init__(self, shape: v.ModelShape, host_blocks: int = 256, disk_blocks: int = 0, disk_dir=None, tp: int = 1):
        v.install_hybrid_platform()
        self.p = v.plan(shape, MEMORY, tp=tp)
        self.bs = self.p.scheduler_block_size
        kcc = self.p.kv_cache_config
        self.groups = _group_kinds(kcc, self.bs)
        assert self.groups is not None, "a hybrid model plans its groups"
        self.manager = v.make_manager(self.p)
        self.leader = KvbmLeader(self.bs, host_blocks, disk_blocks=disk_blocks, disk_filter_disabled=True, groups=self.groups)
        self.ranks = []
        for rank in range(tp):
            kv = v.allocate(self.p)
            registered = kv
            if SIMULATED_GPU:
                kv, registered = on_simulated_gpu(kv)
            config = None
            if disk_blocks:
                d = disk_dir / f"rank{rank}"
                d.mkdir()
                config = kvbm.Config.from_env({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(host_blocks), "DYN_KVBM_DISK_CACHE_DIR": str(d)})
            worker = KvbmWorker(
                host_blocks=host_blocks, disk_blocks=disk_blocks, kv_cache_config=kcc,
                device=None if SIMULATED_GPU else "emulated", config=config, world_size=tp, rank=rank,
            )
            worker.register_kv_caches(registered)
            self.ranks.append((kv, worker))
        self.kv = self.ranks[0][0]

    # -- vLLM's side ----------------------------------------------------------------------

    def forward(self, request, start: int, end: int) -> None:
        """What the model writes for tokens [start, end) of ``request`` on every rank: every
        attention layer's pages of the blocks those tokens complete or touch, and every Mamba
        layer's state block at ``end``."""
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
        for rank, (kv, _) in enumerate(self.ranks):
            for name in group.layer_names:
                page = v.page_bytes(kv[name][block_id])
                page.copy_(page_pattern(name, tokens, page.numel(), rank))

    def expected(self, group, tokens: List[int], rank: int = 0) -> List[torch.Tensor]:
        kv = self.ranks[rank][0]
        return [page_pattern(name, tokens, v.page_bytes(kv[name][1]).numel(), rank) for name in group.layer_names]

    def scheduler_output(self, new=(), cached=(), scheduled: Dict[str, int] = None, preempted=()):
        """vLLM's SchedulerOutput as a connector reads it: new requests with every group's
        table, cached ones with the block ids added this step (None when no group got one),
        and the current tables (kv_connector_block_state)."""
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
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.request_id for r, _ in cached],
                new_block_ids=[ids for _, ids in cached],
                num_computed_tokens=[r.num_computed_tokens for r, _ in cached],
                resumed_req_ids=set(),
            ),
            num_scheduled_tokens=dict(scheduled or {}),
            preempted_req_ids=set(preempted),
            # As Scheduler.schedule builds it: Mamba boundary states drained every step.
            kv_connector_block_state=KVConnectorBlockState(
                req_ids={r.request_id for r in new} | {r.request_id for r, _ in cached},
                resolve_block_ids=lambda rid: tuple(self.manager.get_block_ids(rid)),
                boundary_state_offloads=self.manager.take_boundary_state_offloads(),
            ),
        )

    def step(self, out) -> None:
        """The connector's calls around one forward pass on every rank (vLLM pickles the
        metadata to each worker process)."""
        meta = pickle.loads(pickle.dumps(self.leader.build_connector_meta(out)))
        for _, worker in self.ranks:
            # vLLM 0.33 calls it first, with the step's metadata (ActiveKVConnector.pre_forward).
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            worker.clear_connector_metadata()

    def finished(self, finished_ids=()):
        """The workers' reports, aggregated as vLLM's KVOutputAggregator does: a request is
        finished once every rank reported it."""
        if not hasattr(self, "_seen"):
            self._seen = {"sending": {}, "recving": {}}
        done = {"sending": set(), "recving": set()}
        for rank, (_, worker) in enumerate(self.ranks):
            sending, recving = worker.get_finished(set(finished_ids))
            for kind, ids in (("sending", sending), ("recving", recving)):
                for rid in ids or ():
                    seen = self._seen[kind].setdefault(rid, set())
                    seen.add(rank)
                    if len(seen) == len(self.ranks):
                        done[kind].add(rid)
                        del self._seen[kind][rid]
        self.leader.update_connector_output(
            SimpleNamespace(finished_sending=done["sending"], finished_recving=done["recving"], kv_connector_worker_meta=None)
        )
        return done["sending"], done["recving"]

    # -- whole requests ---------------------------------------------------------------------

    def prefill_and_offload(self, rid: str, tokens: List[int]) -> None:
        """Prefills ``tokens`` in two steps, as vLLM's scheduler splits a prompt for a Mamba
        hybrid (``Scheduler._mamba_block_aligned_split``: the first chunk ends at the last block
        boundary before the prompt's last token, where the state is cached), then finishes."""
        req = v.make_request(self.p, rid, tokens)
        self.manager.new_step_starts()
        computed, hit, _ = self.manager.get_computed_blocks(req)
        assert hit == 0
        assert self.leader.get_num_new_matched_tokens(req, 0) == (0, False)
        boundary = (len(tokens) - 1) // self.bs * self.bs
        first = True
        for start, end in ((0, boundary), (boundary, len(tokens))):
            added = self.manager.allocate_slots(req, end - start)
            assert added is not None
            if first:
                self.leader.update_state_after_alloc(req, self.manager.get_blocks(rid), 0)
            self.forward(req, start, end)
            if first:
                out = self.scheduler_output(new=[req], scheduled={rid: end - start})
            else:
                out = self.scheduler_output(cached=[(req, added.get_block_ids(allow_none=True))], scheduled={rid: end - start})
            self.step(out)
            req.num_computed_tokens = end
            self.manager.new_step_starts()
            first = False
        # Finished: vLLM keeps every group's blocks until the workers report the offloads.
        delay, _ = self.leader.request_finished(req, self.manager.get_block_ids(rid))
        assert delay
        deadline = time.monotonic() + 60
        while rid not in self.finished([rid])[0]:
            assert time.monotonic() < deadline, "offloads never reported"
            self.step(self.scheduler_output())
            time.sleep(0.002)
        self.manager.free(req)

    def drop_gpu_cache(self) -> None:
        """vLLM's own prefix cache forgets everything and the device memory is cleared, so only
        kvbm can serve what follows."""
        assert self.manager.reset_prefix_cache()
        for kv, _ in self.ranks:
            v.backing_buffer(kv).zero_()

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
        deadline = time.monotonic() + 60
        while rid not in self.finished()[1]:
            assert time.monotonic() < deadline, "load never reported"
            self.step(self.scheduler_output())
            time.sleep(0.002)
        return req, found


def tokens_of(seed: int, n: int) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 30000, (n,), generator=g).tolist()


SHAPES = [v.TINY_GPT_OSS, v.TINY_GEMMA3, v.TINY_QWEN3_NEXT]


def check_loaded(e: Engine, rid: str, tokens: List[int], blocks: int, untouched: bool = True) -> int:
    """Every real block of every group vLLM allocated for ``rid``'s hit of ``blocks`` blocks
    holds, on every rank, its layers' bytes for its prefix; the null block and every block
    outside the hit hold nothing. Returns how many pages were compared."""
    bs = e.bs
    tables = e.manager.get_block_ids(rid)
    checked = 0
    for g, group in enumerate(e.p.groups):
        kind = v.group_kind(group.kv_cache_spec)
        ids = tables[g][:blocks]
        real = [i for i, b_id in enumerate(ids) if b_id != 0]
        if kind == "full":
            assert real == list(range(blocks))
        elif kind == "sliding":
            # vLLM keeps the window's blocks before the hit only (allocate_external_computed_blocks).
            window = group.kv_cache_spec.sliding_window
            assert real == list(range(blocks - (window - 1 + bs - 1) // bs, blocks))
        else:
            # Mamba align mode: the state at the hit lives in its last block.
            assert real == [blocks - 1]
        for rank, (kv, _) in enumerate(e.ranks):
            for i in real:
                want = e.expected(group, tokens[: (i + 1) * bs], rank)
                got = [v.page_bytes(kv[name][ids[i]]) for name in group.layer_names]
                for name, w, x in zip(group.layer_names, want, got):
                    assert torch.equal(w, x), f"rank {rank} group {g} ({kind}) block {i} (id {ids[i]}) layer {name}"
                    checked += 1
    loaded = {b_id for t in tables for b_id in t[:blocks] if b_id}
    for kv, _ in e.ranks if untouched else ():
        for name in kv:
            assert not v.page_bytes(kv[name][0]).any(), f"null block written in {name}"
        untouched = [b_id for b_id in range(1, e.p.kv_cache_config.num_blocks) if b_id not in loaded][:64]
        for name in list(kv)[:2]:
            for b_id in untouched:
                assert not v.page_bytes(kv[name][b_id]).any(), f"block {b_id} of {name} written"
    return checked


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_loaded_block_of_every_group_holds_its_own_bytes(shape):
    e = Engine(shape)
    bs = e.bs
    prompt = tokens_of(1, 10 * bs + 5)
    e.prefill_and_offload("a", prompt)
    e.drop_gpu_cache()
    # B shares A's first 10 blocks and goes on differently.
    b = prompt[: 10 * bs] + tokens_of(2, 7)
    _, found = e.load("b", b)
    assert found == 10 * bs, (found, e.groups)
    assert check_loaded(e, "b", b, 10) > 0


@pytest.mark.parametrize("shape", [v.TINY_GPT_OSS, v.TINY_QWEN3_NEXT], ids=lambda s: s.name)
def test_two_tensor_parallel_ranks_each_load_their_own_shard(shape):
    e = Engine(shape, tp=2)
    bs = e.bs
    prompt = tokens_of(5, 6 * bs + 3)
    e.prefill_and_offload("a", prompt)
    e.drop_gpu_cache()
    b = prompt[: 6 * bs] + tokens_of(6, 4)
    _, found = e.load("b", b)
    assert found == 6 * bs
    assert check_loaded(e, "b", b, 6) > 0


@pytest.mark.parametrize(
    "shape, host_blocks",
    # Gemma 3 stores every block of its 6 groups (48 a prompt); Qwen3-Next its 8 attention
    # blocks and one state per Mamba group (11 a prompt).
    [(v.TINY_GEMMA3, 96), (v.TINY_QWEN3_NEXT, 16)],
    ids=["tiny-gemma3", "tiny-qwen3-next"],
)
def test_blocks_evicted_from_host_memory_come_back_from_disk(shape, host_blocks, tmp_path):
    e = Engine(shape, host_blocks=host_blocks, disk_blocks=512, disk_dir=tmp_path)
    bs = e.bs
    prompt = tokens_of(7, 8 * bs + 1)
    e.prefill_and_offload("a", prompt)
    # Other prompts push A's blocks out of the host tier (they stay on disk).
    for k in range(3):
        e.prefill_and_offload(f"x{k}", tokens_of(100 + k, 8 * bs + 1))
    def from_disk():
        return sum(w.native.metrics().get("kvbm_onboard_blocks_d2d", 0) for _, w in e.ranks)

    before = from_disk()
    e.drop_gpu_cache()
    b = prompt[: 8 * bs] + tokens_of(8, 5)
    _, found = e.load("b", b)
    assert found == 8 * bs
    assert from_disk() > before, "the hit came from disk"
    assert check_loaded(e, "b", b, 8) > 0


def test_older_window_blocks_may_go_but_the_windows_own_may_not():
    # vLLM's SlidingWindowManager accepts a hit where the window's blocks before it are cached,
    # whatever happened to older ones (find_longest_cache_hit); kvbm reports the same.
    e = Engine(v.TINY_GPT_OSS, host_blocks=24)
    bs = e.bs
    window_blocks = (e.p.groups[0].kv_cache_spec.sliding_window - 1 + bs - 1) // bs
    prompt = tokens_of(9, 10 * bs + 5)  # 10 blocks x 2 groups = 20 of 24 host blocks
    e.prefill_and_offload("a", prompt)
    b = prompt[: 10 * bs] + tokens_of(11, 3)
    # Another prompt of 6 blocks (12 host blocks) evicts A's 8 oldest: its window group's
    # blocks 0..7, registered first, which no hit at 10 blocks needs.
    e.prefill_and_offload("x", tokens_of(10, 6 * bs + 1))
    found, _ = e.leader.get_num_new_matched_tokens(v.make_request(e.p, "b1", b), 0)
    assert found == 10 * bs
    # One more block (2 host blocks) evicts the window's own blocks 8 and 9: no group-wide hit
    # remains (a shorter one would need blocks 6 and 7, gone too), though full attention still
    # holds all ten.
    assert window_blocks == 2
    e.prefill_and_offload("y", tokens_of(12, bs + 1))
    found, _ = e.leader.get_num_new_matched_tokens(v.make_request(e.p, "b2", b), 0)
    assert found == 0


@pytest.mark.parametrize("shape", [v.TINY_GPT_OSS, v.TINY_QWEN3_NEXT], ids=lambda s: s.name)
def test_a_preempted_request_resumes_from_what_kvbm_offloaded(shape):
    # vLLM preempts a running request (Scheduler._preempt_request: its blocks freed right after
    # the workers' handle_preemptions, num_computed_tokens back to 0); when it is scheduled again
    # kvbm serves what it offloaded before, and it resumes (vLLM 0.33's V2 runner sends it as a
    # new request with its whole tables).
    e = Engine(shape)
    bs = e.bs
    prompt = tokens_of(13, 10 * bs + 5)
    req = v.make_request(e.p, "a", prompt)
    e.manager.new_step_starts()
    assert e.leader.get_num_new_matched_tokens(req, 0) == (0, False)
    assert e.manager.allocate_slots(req, 10 * bs) is not None
    e.leader.update_state_after_alloc(req, e.manager.get_blocks("a"), 0)
    e.forward(req, 0, 10 * bs)
    e.step(e.scheduler_output(new=[req], scheduled={"a": 10 * bs}))
    req.num_computed_tokens = 10 * bs
    # Preempted in the next step: the workers finish its offloads before vLLM reuses its blocks.
    e.step(e.scheduler_output(preempted=["a"]))
    e.manager.free(req)
    req.num_computed_tokens = 0
    e.drop_gpu_cache()
    # Scheduled again: kvbm's hit, loaded asynchronously.
    e.manager.new_step_starts()
    computed, local, _ = e.manager.get_computed_blocks(req)
    assert local == 0
    found, asynchronous = e.leader.get_num_new_matched_tokens(req, 0)
    assert (found, asynchronous) == (10 * bs, True)
    assert e.manager.allocate_slots(
        req, 0, num_new_computed_tokens=0, new_computed_blocks=computed,
        num_external_computed_tokens=found, delay_cache_blocks=True,
    ) is not None
    e.leader.update_state_after_alloc(req, e.manager.get_blocks("a"), found)
    e.step(e.scheduler_output())
    deadline = time.monotonic() + 60
    while "a" not in e.finished()[1]:
        assert time.monotonic() < deadline, "load never reported"
        e.step(e.scheduler_output())
        time.sleep(0.002)
    assert check_loaded(e, "a", prompt, 10) > 0
    # It resumes: the rest of its prompt, as a new request with its whole tables.
    req.num_computed_tokens = found
    e.manager.new_step_starts()
    assert e.manager.allocate_slots(req, 5) is not None
    e.forward(req, found, found + 5)
    e.step(e.scheduler_output(new=[req], scheduled={"a": 5}))
    assert check_loaded(e, "a", prompt, 10, untouched=False) > 0



def test_a_hit_gone_before_its_load_fails_the_request_never_as_block_errors():
    # vLLM 0.33 raises on block-level load errors with several groups
    # (scheduler.py, _handle_invalid_blocks); a load kvbm cannot back must come back as a failed
    # request (get_transfer_results().failed_recving, also in finished_recving), which vLLM
    # recomputes (_handle_failed_recving).
    e = Engine(v.TINY_GPT_OSS)
    bs = e.bs
    prompt = tokens_of(21, 6 * bs + 3)
    e.prefill_and_offload("a", prompt)
    e.drop_gpu_cache()
    req = v.make_request(e.p, "b", prompt)
    e.manager.new_step_starts()
    computed, _, _ = e.manager.get_computed_blocks(req)
    found, asynchronous = e.leader.get_num_new_matched_tokens(req, 0)
    assert (found, asynchronous) == (6 * bs, True)
    # Between vLLM's two calls the tiers lose everything (a cache reset here).
    assert e.leader.reset_cache()
    assert e.manager.allocate_slots(
        req, 0, num_new_computed_tokens=0, new_computed_blocks=computed,
        num_external_computed_tokens=found, delay_cache_blocks=True,
    ) is not None
    e.leader.update_state_after_alloc(req, e.manager.get_blocks("b"), found)
    e.step(e.scheduler_output())
    (_, worker), = e.ranks
    deadline = time.monotonic() + 60
    while True:
        r = worker.get_transfer_results(set())
        assert worker.get_block_ids_with_load_errors() == set()
        if "b" in r.finished_recving:
            break
        assert time.monotonic() < deadline, "load never reported"
        e.step(e.scheduler_output())
        time.sleep(0.002)
    assert r.failed_recving == {"b"}
