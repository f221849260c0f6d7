"""Failed loads are never served: each fault ends as exactly the affected GPU blocks in
``get_block_ids_with_load_errors`` (reported no later than the request's ``finished_recving``, as
vLLM 0.33's ``KVConnectorBase_V1.get_block_ids_with_load_errors`` requires), and every other
loaded block holds exactly the bytes of the tokens it was matched for, never another request's.

The leader and the worker run in this process with vLLM 0.33's worker order
(``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv`` before the forward for
synchronous loads, ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``), on a KV
cache allocated as vLLM 0.33 allocates it (BLNHC, one buffer). Faults: a corrupt disk block, a
disk read that fails (the file cut short under the store), and host blocks evicted between the
match and the allocation.
"""

from dataclasses import dataclass, field
from typing import List, Set

import numpy as np

import kvbm
from kvbm.leader import KvbmLeader
from kvbm.testing import allocate_kv_cache
from kvbm.worker import KvbmWorker
from vllm_objects import Blocks, ConnectorOutput
from vllm_objects import CachedRequestData as Cached
from vllm_objects import NewRequestData as New
from vllm_objects import SchedulerOutput as Out

BLOCK = 4
LAYERS = 2
GPU_BLOCKS = 32


@dataclass
class Request:
    request_id: str
    prompt_token_ids: List[int]
    num_computed_tokens: int = 0
    cache_salt: None = None
    lora_request: None = None
    all_token_ids: List[int] = field(default_factory=list)

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


class Engine:
    """kvbm's leader and worker, driven as vLLM 0.33 drives a connector, on host memory."""

    def __init__(self, tmp_path, host_blocks, disk_blocks):
        self.caches, self.raw = allocate_kv_cache(LAYERS, GPU_BLOCKS, 2, BLOCK, 16, layout="BLNHC")
        config = kvbm.Config.from_env(
            {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(host_blocks), "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
        )
        self.leader = KvbmLeader(BLOCK, host_blocks, disk_blocks=disk_blocks, disk_filter_disabled=True)
        self.worker = KvbmWorker(host_blocks=host_blocks, disk_blocks=disk_blocks, config=config)
        self.worker.register_kv_caches(self.caches)
        self.errors: Set[int] = set()
        self.recving: Set[str] = set()

    def write(self, block, seed):
        """What a forward pass writes into a GPU block: bytes that depend on `seed` (the tokens)."""
        rng = np.random.default_rng(seed)
        for t in self.caches.values():
            t.array[block] = rng.integers(0, 1 << 16, size=t.array[block].shape, dtype=np.uint16)

    def read(self, block):
        return [t.array[block].copy() for t in self.caches.values()]

    def step(self, out, forward=lambda: None, finished=()):
        meta = self.leader.build_connector_meta(out)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        for name in self.caches:
            w.wait_for_layer_load(name)
        forward()
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        w.native.wait_async()  # this test's loads finish within the step
        w.native.wait_disk()
        sending, recving = w.get_finished(set(finished))
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.errors |= errors
        self.recving |= set(recving or ())
        bad = w.build_connector_worker_meta()
        self.leader.update_connector_output(
            ConnectorOutput(set(sending or ()), set(recving or ()), errors, kv_connector_worker_meta=bad)
        )
        return meta

    def prefill(self, request, ids, seeds):
        """Schedules a new request whose forward writes its full blocks, then finishes it."""
        self.leader.get_num_new_matched_tokens(request, 0)
        self.leader.update_state_after_alloc(request, Blocks(ids), 0)

        def forward():
            for block, seed in zip(ids, seeds):
                self.write(block, seed)

        out = Out([New(request.request_id, request.prompt_token_ids, (ids,), 0)], Cached(),
                  {request.request_id: request.num_tokens}, set())
        self.step(out, forward)
        self.leader.request_finished(request, (ids,))
        self.step(Out([], Cached(), {}, {request.request_id}), finished=[request.request_id])


def tokens(first, blocks):
    return list(range(first, first + blocks * BLOCK)) + [7]  # a partial last block


def test_a_corrupt_and_an_unreadable_disk_block_fail_exactly_their_gpu_blocks(tmp_path):
    e = Engine(tmp_path, host_blocks=5, disk_blocks=16)
    a = Request("A", tokens(1000, 5))
    e.prefill(a, list(range(0, 6)), seeds=range(100, 105))
    saved = {b: e.read(b) for b in range(5)}
    # B's blocks push A's out of the 5-block host tier; A's copies stay on disk.
    e.prefill(Request("B", tokens(5000, 5)), list(range(6, 12)), seeds=range(200, 205))

    # C shares A's prompt: its 5 blocks come back from disk, asynchronously.
    c = Request("C", tokens(1000, 5))
    n, is_async = e.leader.get_num_new_matched_tokens(c, 0)
    assert (n, is_async) == (20, True)
    ids = list(range(20, 26))
    e.leader.update_state_after_alloc(c, Blocks(ids), n)
    meta = e.leader.build_connector_meta(Out([], Cached(), {}, set()))
    (rid, reads, pairs), = meta.async_onboards
    assert rid == "C" and len(reads) == 5
    # The cache file: a 4 KiB superblock, then 16 slots of (4 KiB header + payload area).
    store_file = tmp_path / "kvbm-rank0.cache"
    slot_bytes = (store_file.stat().st_size - 4096) // 16
    by_block = {k: reads[k][0] for k in range(5)}  # C's block index -> disk slot
    # Fault 1: the disk copy of C's block 1 is corrupt (one payload byte flipped).
    with open(store_file, "r+b") as f:
        f.seek(4096 + by_block[1] * slot_bytes + 4096 + 123)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    # Fault 2: the disk copy in the highest slot C reads cannot be read: the file is cut short
    # inside it (every other slot C reads lies before it).
    last = max(range(5), key=lambda k: by_block[k])
    assert last != 1
    with open(store_file, "r+b") as f:
        f.truncate(4096 + by_block[last] * slot_bytes + 4096 + 100)
    # Run the load that metadata asked for.
    w = e.worker
    w.handle_preemptions(meta)
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    w.native.wait_async()
    sending, recving = w.get_finished(set())
    errors = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    assert recving == {"C"}
    assert errors == {ids[1], ids[last]}, "exactly the GPU blocks whose disk copies failed"
    for k in set(range(5)) - {1, last}:
        got = e.read(ids[k])
        assert all(np.array_equal(g, s) for g, s in zip(got, saved[k])), f"block {k} holds A's tokens' bytes"
    e.leader.update_connector_output(ConnectorOutput(set(sending or ()), recving, errors))


def test_host_blocks_evicted_between_match_and_allocation_are_load_errors(tmp_path):
    e = Engine(tmp_path, host_blocks=5, disk_blocks=0)
    a = Request("A", tokens(1000, 5))
    e.prefill(a, list(range(0, 6)), seeds=range(100, 105))
    saved = {b: e.read(b) for b in range(5)}
    # C matches A's 5 blocks in host memory (a synchronous load)...
    c = Request("C", tokens(1000, 5))
    assert e.leader.get_num_new_matched_tokens(c, 0) == (20, False)
    # ...but before vLLM allocates C's blocks, B's offload evicts A's least recently used
    # blocks, the first of the prefix among them, so nothing of it can be loaded any more.
    b = Request("B", tokens(5000, 3))
    e.prefill(b, list(range(6, 10)), seeds=range(200, 203))
    ids = list(range(20, 26))
    e.leader.update_state_after_alloc(c, Blocks(ids), 20)
    out = Out([New("C", c.prompt_token_ids, (ids,), 20)], Cached(), {"C": 1}, set(), has_sync_kv_loads=True)
    e.errors.clear()
    e.step(out)
    # Every promised block is reported (vLLM recomputes them) and none was written with bytes.
    assert e.errors == set(ids[:5])
    for k in range(5):
        assert not any(g.any() for g in e.read(ids[k])), f"GPU block {ids[k]} was written"
    # A's surviving blocks stay matchable afterwards only if the prefix survives: it does not.
    assert e.leader.get_num_new_matched_tokens(Request("D", tokens(1000, 5)), 0) == (0, False)


def test_a_block_whose_load_failed_is_never_saved_as_if_it_held_data(tmp_path):
    """A GPU block whose load failed holds garbage until vLLM recomputes it. If the step's save
    copied it, the host tier would serve that garbage under the block's hash to later requests:
    the worker skips such saves and marks their host blocks bad, so a load from them fails."""
    e = Engine(tmp_path, host_blocks=8, disk_blocks=4)
    w = e.worker.native
    e.write(3, seed=9)
    # Host block 0 gets its bytes from a disk read that misses (no block under that key).
    assert w.disk_read([(0, 0, 12345)]) == [0]
    w.onboard([(0, 5)])  # so GPU block 5's load fails (reported by take_failed below)
    w.wait_onboards()
    w.offload([(5, 1), (3, 2)], ["r"])  # block 5 is skipped, block 3 is saved
    w.wait_offloads()
    assert w.poll_offloads() == ["r"], "the request's save is still reported done"
    failed_before = set(w.take_failed())
    assert failed_before == {5}
    w.onboard([(1, 6), (2, 7)])
    w.wait_onboards()
    assert set(w.take_failed()) == {6}, "the skipped save's host block is never served"
    assert all(np.array_equal(a, b) for a, b in zip(e.read(7), e.read(3)))


def test_a_block_whose_offload_could_not_run_is_dropped_by_the_leader(tmp_path):
    """The leader registers a block when it plans its offload. If the worker cannot fill that
    host block (here: the GPU block's own load failed in the same step, so its bytes are
    garbage), the worker reports it through vLLM's worker-to-scheduler channel
    (build_connector_worker_meta -> update_connector_output) and the leader drops it: the host
    tier announces its removal and never matches it again."""
    e = Engine(tmp_path, host_blocks=8, disk_blocks=4)
    a = Request("A", tokens(1000, 2))
    e.leader.get_num_new_matched_tokens(a, 0)
    e.leader.update_state_after_alloc(a, Blocks([4, 5, 6]), 0)
    out = Out([New("A", a.prompt_token_ids, ([4, 5, 6],), 0)], Cached(), {"A": a.num_tokens}, set())
    w = e.worker.native

    def failed_load_of_block_5():
        # GPU block 5 (A's second block) gets a failed load in this step (a disk read that
        # misses into staging host block 7, then a load from it).
        assert w.disk_read([(0, 7, 999)]) == [7]
        w.onboard([(7, 5)])
        w.wait_onboards()

    e.leader.take_events()
    e.step(out, forward=failed_load_of_block_5)
    hashes = kvbm.sequence_hashes(a.prompt_token_ids[: 2 * BLOCK], BLOCK)
    assert e.errors == {5}
    # The first block is served from the host tier; the second was dropped, and said so.
    assert e.leader.native.count_prefix(hashes) == 1
    removed = [ev for ev in e.leader.take_events() if type(ev).__name__ == "BlockRemoved"]
    # Its disk copy (admitted at once: the filter is off) was never written: dropped too.
    assert [(ev.block_hashes, ev.medium) for ev in removed] == [([hashes[1]], "CPU_PINNED"), ([hashes[1]], "DISK")]
    assert e.leader.native.count_prefix_tiers(hashes) == (1, 0)


def test_a_request_aborted_during_its_asynchronous_load_keeps_its_blocks_until_the_load_ends(tmp_path):
    """vLLM 0.33 frees a finished request's GPU blocks at once unless request_finished says
    True; an asynchronous load still copies into them, so the leader says True and the blocks
    are freed when the workers report the request in finished_recving."""
    e = Engine(tmp_path, host_blocks=5, disk_blocks=16)
    e.prefill(Request("A", tokens(1000, 5)), list(range(0, 6)), seeds=range(100, 105))
    e.prefill(Request("B", tokens(5000, 5)), list(range(6, 12)), seeds=range(200, 205))
    c = Request("C", tokens(1000, 5))
    n, is_async = e.leader.get_num_new_matched_tokens(c, 0)
    assert is_async and n == 20
    e.leader.update_state_after_alloc(c, Blocks(list(range(20, 26))), n)
    meta = e.leader.build_connector_meta(Out([], Cached(), {}, set()))
    assert [rid for rid, _, _ in meta.async_onboards] == ["C"]
    # The client goes away while the load runs.
    assert e.leader.request_finished(c, (list(range(20, 26)),)) == (True, None)
    assert "C" in e.leader.tracked_requests()
    w = e.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    w.native.wait_async()
    sending, recving = w.get_finished({"C"})
    w.clear_connector_metadata()
    assert recving == {"C"} and not sending, "finished through finished_recving, not sending"
    e.leader.update_connector_output(ConnectorOutput(set(), recving, w.get_block_ids_with_load_errors()))
    assert "C" not in e.leader.tracked_requests()
