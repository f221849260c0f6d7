"""vLLM's call order, played for many steps, with kvbm's leader in this process and its worker in
another (the metadata pickled between them, as vLLM sends it), on KV caches in host memory.

A small scheduler stands in for vLLM's: requests arrive over time and share long prefixes,
prefills are chunked, one request is preempted and resumed, requests finish in another order than
they arrived, and GPU blocks are freed only when vLLM would free them. The "forward pass" writes,
for every token it computes, a pattern derived from the token's whole prefix, so a loaded block
holds the right bytes only if it was saved from, and loaded into, the right places.

The KV cache is built as vLLM 0.33 builds it (`kvbm.testing.allocate_kv_cache`, after
`allocate_kv_cache` in vllm/v1/worker/utils.py: one backing buffer, per-layer strided views) in
every `KVCacheLayout`, plus one run on the older per-layer tensors. The worker process follows
vLLM 0.33's call order (vllm/v1/worker/gpu/kv_connector.py, `ActiveKVConnector.pre_forward` and
`post_forward`): `handle_preemptions` first, then `start_load_kv` before the forward only when
the step has synchronous loads (`has_sync_kv_loads`, set by vllm/v1/core/sched/scheduler.py when
a request is scheduled with external tokens loaded synchronously), otherwise after it.

Run with the host tier alone, and with host and disk tiers on two tensor-parallel ranks (two
worker processes, each with its own shard of bytes and its own disk file, executing the same
metadata). Checked: a prefix saved by one request is matched by the next; every loaded block
equals what its tokens' forward pass wrote on that rank; no request hangs and no GPU, host or disk
block leaks; the tier events replay to exactly the tiers' contents.
"""

import multiprocessing as mp
import pickle
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import numpy as np
import pytest

from conftest import LAYOUTS_033
from kvbm.leader import KvbmLeader
from vllm_objects import Blocks, CachedRequestData, ConnectorOutput, NewRequestData, SchedulerOutput

BLOCK = 4
LAYERS = 3
HEADS = 2
HEAD_SIZE = 4
GPU_BLOCKS = 96
HOST_BLOCKS = 36
CHUNK = 24  # prefill tokens per request per step


def token_values(tokens: List[int]) -> List[int]:
    """A 16-bit value per position, depending on every token up to it."""
    out, crc = [], 0
    for t in tokens:
        crc = zlib.crc32(int(t).to_bytes(4, "little"), crc)
        out.append(crc & 0xFFFF)
    return out


def pattern(value: int, layer: int) -> np.ndarray:
    """One token's KV in one layer (every head, K and V), flat."""
    base = (value + layer * 31) & 0xFFFF
    return ((base + np.arange(2 * HEADS * HEAD_SIZE) * 17) & 0xFFFF).astype(np.uint16)


def receive(conn):
    """The worker's answer; a worker that died or hangs fails the test instead of hanging it."""
    assert conn.poll(60), "the worker process did not answer within 60 s"
    answer = conn.recv()
    if isinstance(answer, BaseException):
        raise AssertionError(f"the worker failed: {answer!r}")
    return answer


def worker_main(conn) -> None:
    try:
        run_worker(conn)
    except BaseException as e:  # report it to the test instead of dying silently
        conn.send(e)


def run_worker(conn) -> None:
    import os

    os.environ["KVBM_DEVICE"] = "emulated"
    from conftest import SIMULATED_GPU, make_caches, token_slot

    import kvbm
    from kvbm.worker import KvbmWorker

    kind, host_blocks, disk_blocks, disk_dir, rank = conn.recv()
    caches = make_caches(kind, LAYERS, GPU_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    config = kvbm.Config.from_env(
        {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(host_blocks), "DYN_KVBM_DISK_CACHE_DIR": disk_dir}
    )
    worker = KvbmWorker(host_blocks=host_blocks, disk_blocks=disk_blocks, config=config, rank=rank, world_size=2)
    # Each tensor-parallel rank holds its own shard: here, its own bytes for the same tokens.
    shard = rank * 4099
    worker.register_kv_caches(caches)
    # cuda:0 tensors (the simulated driver's memory) take the CUDA path whatever KVBM_DEVICE says.
    assert worker.native.device_kind == ("cuda" if SIMULATED_GPU else "emulated")
    names = list(caches)
    pending_async = {}

    def holds(name: str, layer: int, gpu: int, slot: int, v: int) -> bool:
        got = token_slot(caches[name], kind, gpu, slot)
        return np.array_equal(got, pattern(v + shard, layer).reshape(got.shape))

    while True:
        msg = conn.recv()
        if msg is None:
            break
        meta_bytes, writes, expect, finished_ids, async_expect, has_sync_kv_loads = msg
        pending_async.update(dict(async_expect))
        meta = pickle.loads(meta_bytes)
        # vLLM 0.33: handle_preemptions, bind, start_load_kv before the forward only with
        # synchronous loads (ActiveKVConnector.pre_forward / post_forward).
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        if has_sync_kv_loads:
            worker.start_load_kv(None)
        mismatches = []
        for layer, name in enumerate(names):
            worker.wait_for_layer_load(name)
            for gpu, values in expect:
                for slot, v in enumerate(values):
                    if not holds(name, layer, gpu, slot, v):
                        mismatches.append((name, gpu, slot))
            for gpu, slot, v in writes:
                target = token_slot(caches[name], kind, gpu, slot)
                target[...] = pattern(v + shard, layer).reshape(target.shape)
            worker.save_kv_layer(name, caches[name], None)
        if not has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        # The asynchronous loads of this step finish within it, so that what the leader holds,
        # and therefore what later requests match, does not depend on timing.
        worker.native.wait_async()
        sending, recving = worker.get_finished(set(finished_ids))
        for rid in recving or ():
            # An asynchronous load is done: its blocks must hold their tokens' bytes now.
            for layer, name in enumerate(names):
                for gpu, values in pending_async.pop(rid) if layer == LAYERS - 1 else pending_async[rid]:
                    for slot, v in enumerate(values):
                        if not holds(name, layer, gpu, slot, v):
                            mismatches.append((name, gpu, slot))
        errors = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        conn.send((sorted(sending or ()), sorted(recving or ()), sorted(errors), mismatches))
    worker.shutdown()
    conn.send("bye")


# -- stand-ins for vLLM's objects ----------------------------------------------------------------


@dataclass
class Request:
    request_id: str
    prompt_token_ids: List[int]
    max_tokens: int
    arrival: int
    all_token_ids: List[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: Optional[str] = None
    lora_request: None = None
    block_ids: List[int] = field(default_factory=list)
    outputs: int = 0
    matched_tokens: List[int] = field(default_factory=list)
    status: str = "waiting"  # waiting, loading, loaded, running, finishing, done
    was_preempted: bool = False
    ext_blocks: List[int] = field(default_factory=list)  # block indices loaded this admission
    pending_ext: int = 0  # tokens an asynchronous load brings

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def next_token(tokens: List[int]) -> int:
    return (tokens[-1] * 31 + len(tokens) * 7 + 3) % 50_000


@pytest.mark.parametrize(
    "kind,host_blocks,disk_blocks,ranks",
    [(kind, HOST_BLOCKS, 0, 1) for kind in LAYOUTS_033 + ["MLA-BLNHC", "outer_first"]]
    + [("BLNHC", 32, 160, 2), ("LBNHC", 32, 160, 2)],
    ids=[f"host-tier-{kind}" for kind in LAYOUTS_033 + ["MLA-BLNHC", "outer_first"]]
    + ["host-and-disk-tiers-two-ranks-BLNHC", "host-and-disk-tiers-two-ranks-LBNHC"],
)
def test_vllm_call_order_across_processes(tmp_path, kind, host_blocks, disk_blocks, ranks):
    system = list(range(1000, 1040))  # 10 shared blocks
    requests = [
        Request("r0", system + list(range(1, 14)), max_tokens=9, arrival=0),
        Request("r1", system + list(range(20, 31)), max_tokens=14, arrival=3),
        Request("r2", system + list(range(1, 9)) + [77] * 5, max_tokens=4, arrival=5),
        Request("r3", list(range(5000, 5070)), max_tokens=6, arrival=6),
        Request("r4", list(range(5000, 5070)), max_tokens=3, arrival=14),
        Request("r5", system + list(range(20, 31)), max_tokens=2, arrival=40),
    ]
    preempt = {("r1", 9)}  # (request, step): preempted then, resumed when blocks allow

    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(ranks):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(child,), daemon=True)
        proc.start()
        parent.send((kind, host_blocks, disk_blocks, str(tmp_path), rank))
        workers.append((parent, proc))

    def step_all(message):
        """Sends one step to every rank; merges their answers as vLLM's aggregator does: a
        request is finished sending once every rank reported it."""
        for conn, _ in workers:
            conn.send(message)
        answers = [receive(conn) for conn, _ in workers]
        sent, loaded = [], []
        for answer in answers:
            for rid in answer[0]:
                reports[rid] = reports.get(rid, 0) + 1
                if reports[rid] == ranks:
                    sent.append(rid)
            for rid in answer[1]:
                load_reports[rid] = load_reports.get(rid, 0) + 1
                if load_reports[rid] == ranks:
                    loaded.append(rid)
        return (
            sorted(sent),
            sorted(loaded),
            sorted(set().union(*(a[2] for a in answers))),
            [m for a in answers for m in a[3]],
        )

    reports: Dict[str, int] = {}
    load_reports: Dict[str, int] = {}

    leader = KvbmLeader(BLOCK, host_blocks, disk_blocks=disk_blocks, disk_filter_disabled=True)
    free = list(range(GPU_BLOCKS))
    models: Dict[str, Set[int]] = {"CPU_PINNED": set(), "DISK": set()}
    disk_reads = 0
    async_loads = 0
    finished_prev: Set[str] = set()
    awaiting_send: Dict[str, List[int]] = {}
    loaded_blocks = 0
    by_id = {r.request_id: r for r in requests}
    try:
        for step in range(80):
            new_reqs, cached = [], CachedRequestData()
            async_expect = []
            scheduled: Dict[str, int] = {}
            writes, expect = [], []
            preempted: Set[str] = set()
            has_sync_kv_loads = False
            # Preemption: vLLM frees the blocks at once and the request waits again.
            for r in requests:
                if (r.request_id, step) in preempt and r.status == "running":
                    free.extend(r.block_ids)
                    r.block_ids, r.num_computed_tokens = [], 0
                    r.status, r.was_preempted = "waiting", True
                    preempted.add(r.request_id)
            for r in requests:
                if r.status == "waiting" and r.arrival <= step and r.request_id not in preempted:
                    n_ext, is_async = leader.get_num_new_matched_tokens(r, 0)
                    again = leader.get_num_new_matched_tokens(r, 0)
                    assert again == (n_ext, is_async), "no side effects"
                    assert n_ext % BLOCK == 0 and n_ext < r.num_tokens
                    assert not is_async or disk_blocks, "only disk-backed loads are asynchronous"
                    need = (r.num_tokens + BLOCK) // BLOCK
                    if need > len(free):
                        continue
                    ids = [free.pop() for _ in range(need)]
                    leader.update_state_after_alloc(r, Blocks(ids), n_ext)
                    r.block_ids = ids
                    r.matched_tokens.append(n_ext)
                    r.ext_blocks = list(range(n_ext // BLOCK))
                    if is_async:
                        # vLLM parks it until the workers report the load in finished_recving.
                        values = token_values(r.all_token_ids)
                        async_expect.append(
                            (r.request_id, [(ids[k], values[k * BLOCK : (k + 1) * BLOCK]) for k in r.ext_blocks])
                        )
                        loaded_blocks += len(r.ext_blocks)
                        async_loads += 1
                        r.ext_blocks, r.pending_ext, r.status = [], n_ext, "loading"
                        continue
                    r.num_computed_tokens, r.status = n_ext, "running"
                    has_sync_kv_loads |= n_ext > 0
                    if r.was_preempted:
                        cached.req_ids.append(r.request_id)
                        cached.resumed_req_ids.add(r.request_id)
                        cached.new_block_ids.append((list(ids),))
                        cached.num_computed_tokens.append(n_ext)
                    else:
                        new_reqs.append(NewRequestData(r.request_id, list(r.prompt_token_ids), (list(ids),), n_ext))
                elif r.status == "loaded":
                    # Scheduled once loaded: its computed tokens are the loaded ones.
                    leader.update_state_after_alloc(r, Blocks(r.block_ids), 0)
                    r.num_computed_tokens, r.status = r.pending_ext, "running"
                    if r.was_preempted:
                        cached.req_ids.append(r.request_id)
                        cached.resumed_req_ids.add(r.request_id)
                        cached.new_block_ids.append((list(r.block_ids),))
                        cached.num_computed_tokens.append(r.pending_ext)
                    else:
                        new_reqs.append(
                            NewRequestData(r.request_id, list(r.prompt_token_ids), (list(r.block_ids),), r.pending_ext)
                        )
                elif r.status == "running" and not r.ext_blocks:
                    if r.num_tokens >= len(r.block_ids) * BLOCK:
                        if not free:
                            continue
                        new_id = free.pop()
                        r.block_ids.append(new_id)
                        cached.new_block_ids.append(([new_id],))
                    else:
                        cached.new_block_ids.append(None)
                    cached.req_ids.append(r.request_id)
                    cached.num_computed_tokens.append(r.num_computed_tokens)
                else:
                    continue
                todo = min(CHUNK, r.num_tokens - r.num_computed_tokens)
                scheduled[r.request_id] = todo
                values = token_values(r.all_token_ids)
                for p in range(r.num_computed_tokens, r.num_computed_tokens + todo):
                    writes.append((r.block_ids[p // BLOCK], p % BLOCK, values[p]))
                for k in r.ext_blocks:
                    expect.append((r.block_ids[k], values[k * BLOCK : (k + 1) * BLOCK]))
                loaded_blocks += len(r.ext_blocks)
                r.ext_blocks = []
            out = SchedulerOutput(new_reqs, cached, scheduled, finished_prev, preempted, has_sync_kv_loads)
            meta = leader.build_connector_meta(out)
            assert sum(len(p) for _, p in meta.onboards) == len(expect)
            disk_reads += len(meta.disk_reads) + sum(len(reads) for _, reads, _ in meta.async_onboards)
            sending, recving, errors, mismatches = step_all(
                (pickle.dumps(meta), writes, expect, sorted(finished_prev), async_expect, has_sync_kv_loads)
            )
            for rid in recving:
                assert by_id[rid].status == "loading", f"{rid} reported loaded without a load"
                by_id[rid].status = "loaded"
            assert mismatches == [], f"step {step}: loaded bytes differ at {mismatches[:5]}"
            assert errors == []
            finished_prev = set()
            # The step's results.
            for rid, n in scheduled.items():
                r = by_id[rid]
                r.num_computed_tokens += n
                if r.num_computed_tokens == r.num_tokens:
                    r.all_token_ids.append(next_token(r.all_token_ids))
                    r.outputs += 1
                    if r.outputs >= r.max_tokens:
                        r.status = "finishing"
                        delay, params = leader.request_finished(r, (list(r.block_ids),))
                        assert params is None
                        finished_prev.add(rid)
                        if delay:
                            awaiting_send[rid] = r.block_ids
                        else:
                            free.extend(r.block_ids)
                            r.status = "done"
                        r.block_ids = []
            for rid in sending:
                assert rid in awaiting_send, f"{rid} reported sent without being held"
                free.extend(awaiting_send.pop(rid))
                by_id[rid].status = "done"
            leader.update_connector_output(ConnectorOutput(set(sending), set(recving), set(errors)))
            for e in leader.take_events():
                name = type(e).__name__
                if name == "BlockStored":
                    model = models[e.medium]
                    assert not model & set(e.block_hashes), "stored twice without removal"
                    model |= set(e.block_hashes)
                elif name == "BlockRemoved":
                    model = models[e.medium]
                    assert set(e.block_hashes) <= model, "removed what was not stored"
                    model -= set(e.block_hashes)
            if all(r.status == "done" for r in requests) and not finished_prev:
                break
        else:
            raise AssertionError(f"requests hang: {[(r.request_id, r.status) for r in requests]}")
        # Two more empty steps release every hold.
        for _ in range(2):
            meta = leader.build_connector_meta(SchedulerOutput([], CachedRequestData(), {}, set(), set()))
            assert step_all((pickle.dumps(meta), [], [], [], [], False))[3] == []
    finally:
        for conn, proc in workers:
            if not proc.is_alive():
                continue  # it failed and said so: that error is the test's
            conn.send(None)
            assert receive(conn) == "bye"
            proc.join(timeout=30)
            assert proc.exitcode == 0

    # A prefix saved by one request is matched by the next ones.
    assert by_id["r1"].matched_tokens[0] == len(system), by_id["r1"].matched_tokens
    assert by_id["r2"].matched_tokens[0] >= len(system) + 8 - BLOCK
    assert by_id["r4"].matched_tokens[0] == (70 - 1) // BLOCK * BLOCK, "all but the last token"
    assert by_id["r1"].matched_tokens[1] > 0, "the preempted request reloads its own blocks"
    assert by_id["r5"].matched_tokens[0] > 0
    assert loaded_blocks > 40
    # Nothing leaks or hangs.
    assert sorted(free) == list(range(GPU_BLOCKS)), "GPU blocks leaked"
    assert leader.tracked_requests() == []
    counts = leader.counts()
    assert counts["held"] == 0 and counts["evictions"] > 0, counts
    # The events replay to the tiers' contents.
    assert models["CPU_PINNED"] == set(leader.native.registered_hashes("host"))
    assert models["DISK"] == set(leader.native.registered_hashes("disk"))
    if disk_blocks:
        assert counts["disk_held"] == 0 and disk_reads > 0, (counts, disk_reads)
        assert async_loads >= 2, "disk-backed loads run asynchronously"
        # One cache file per rank, each closed with its checkpoint (the index of what it holds).
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == sorted(
            f"kvbm-rank{r}.cache{ext}" for r in range(ranks) for ext in ("", ".index")
        ), names
    else:
        assert disk_reads == 0 and models["DISK"] == set()
