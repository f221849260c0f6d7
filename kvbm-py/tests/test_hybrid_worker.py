"""The worker under vLLM 0.33's hybrid KV cache manager (HMA): a hybrid model's caches, the
fence after offloads of blocks vLLM frees mid-request, and load failures reported per request.

1. ``register_kv_caches`` gets every layer of every KV cache group (``gpu_model_runner.py``,
   ``initialize_kv_cache_tensors``), views of one int8 buffer whose groups alias the same bytes,
   Mamba / linear-attention state as 1-byte ``[B, 1, 1, state]`` views padded to the attention
   page (``create_kv_cache_views`` in ``vllm/v1/kv_cache_interface.py``, ``allocate_kv_cache``
   in ``vllm/v1/worker/utils.py``); ``kvbm.testing.allocate_hybrid_kv_cache`` builds them so. A
   block id names the same bytes in every group: a block moves once, whichever group owns it.
2. vLLM frees sliding-window and Mamba blocks of running requests in every ``allocate_slots``
   (``remove_skipped_blocks``, ``vllm/v1/core/kv_cache_manager.py``) and may overwrite them in
   the next step: a step whose plan sets ``fence_offloads`` returns from ``wait_for_save`` (on
   the emulated device, which has no engine stream) only once its offloads read them.
3. With several groups vLLM raises on block-level load errors (``_handle_invalid_blocks`` in
   ``vllm/v1/core/sched/scheduler.py``); failed asynchronous loads are reported per request in
   ``get_transfer_results(...).failed_recving`` (and in ``finished_recving``), which
   ``_handle_failed_recving`` recomputes.

The emulated D2H stream is held where a copy must stay in flight: no timing decides an outcome.
"""

import threading

import numpy as np
import pytest

import kvbm
from kvbm.metadata import KvbmConnectorMetadata
from kvbm.testing import allocate_hybrid_kv_cache
from kvbm.worker import KvbmWorker, describe_kv_caches

from conftest import SIMULATED_GPU

#: Qwen3-Next's shape: linear-attention (Mamba) groups first, then full attention.
QWEN3_NEXT = ("mamba", "mamba", "mamba", "full")
#: gpt-oss's shape: sliding-window attention (group 0) and full attention.
GPT_OSS = ("sliding", "full")
SLOTS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE = 3, 8, 2, 4, 8
PAGE = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2  # bytes of one attention page (uint16)
STATE = 72  # bytes of a Mamba state (padded to PAGE)


class Spec:
    """What kvbm reads of a ``KVCacheSpec``: attention specs have ``head_size``, ``MambaSpec``
    has none."""

    def __init__(self, head_size=None):
        if head_size is not None:
            self.head_size = head_size


class Group:
    def __init__(self, kind):
        self.kv_cache_spec = Spec(None if kind == "mamba" else HEAD_SIZE)


class KvCacheConfig:
    """What kvbm reads of vLLM's ``KVCacheConfig``."""

    def __init__(self, kinds, layout):
        self.num_blocks = BLOCKS
        self.kv_cache_layout = layout
        self.kv_cache_groups = [Group(k) for k in kinds]


def hybrid(kinds=QWEN3_NEXT, layout="BLNHC", seed=1, **worker_kwargs):
    caches, raw, names = allocate_hybrid_kv_cache(
        kinds, SLOTS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE, STATE, layout=layout, simulated_gpu=SIMULATED_GPU
    )
    raw[...] = np.random.default_rng(seed).integers(-128, 127, size=raw.shape, dtype=np.int8)
    worker = KvbmWorker(kv_cache_config=KvCacheConfig(kinds, layout), **worker_kwargs)
    worker.register_kv_caches(caches)
    return caches, raw, names, worker


def block_of(caches, block):
    """Every view's bytes of one block, per layer name."""
    return {name: t.array[block].copy() for name, t in caches.items()}


def assert_block(caches, block, expected, what):
    for name, t in caches.items():
        assert np.array_equal(t.array[block], expected[name]), (what, name)


def step(worker, meta, attention=(), sync_loads=False):
    """One worker step in vLLM 0.33's order (``vllm/v1/worker/gpu/kv_connector.py``); only
    attention layers get ``wait_for_layer_load`` (``maybe_transfer_kv_layer``)."""
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    if sync_loads:
        worker.start_load_kv(None)
    for name in attention:
        worker.wait_for_layer_load(name)
    if not sync_loads:
        worker.start_load_kv(None)
    worker.wait_for_save()
    results = worker.get_transfer_results(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return results, errors


@pytest.mark.parametrize("layout", ["BLNHC", "LBNHC"])
@pytest.mark.parametrize("kinds", [QWEN3_NEXT, GPT_OSS], ids=["qwen3-next", "gpt-oss"])
def test_a_hybrid_models_caches_register_and_round_trip_byte_exactly(kinds, layout):
    caches, raw, names, worker = hybrid(kinds, layout, host_blocks=4)
    w = worker.native
    assert w.device_kind == ("cuda" if SIMULATED_GPU else "emulated")
    assert len(caches) == len(kinds) * SLOTS
    assert w.layout_name == layout, "the attention views' layout, read through the aliasing"
    assert w.distinct_layers == SLOTS and w.bytes_per_block == SLOTS * PAGE
    assert w.runs_per_block == (1 if layout == "BLNHC" else SLOTS)
    d = describe_kv_caches(caches, BLOCKS)
    assert (d["layers"], d["bytes_per_block"], d["block_size"]) == (SLOTS, SLOTS * PAGE, BLOCK_SIZE)
    saved = block_of(caches, 2)
    attention = [n for g, kind in zip(names, kinds) if kind != "mamba" for n in g]
    step(worker, KvbmConnectorMetadata.build(step=1, offloads=[("A", [(2, 0)])]), attention)
    w.wait_offloads()
    raw[...] = 0
    # Loaded into block 5 for whichever group owns it now: every group's view of block 5 holds
    # what its view of block 2 held, Mamba states included; nothing else is written.
    step(worker, KvbmConnectorMetadata.build(step=2, onboards=[("B", [(0, 5)])]), attention, sync_loads=True)
    assert_block(caches, 5, saved, "loaded")
    for b in set(range(BLOCKS)) - {5}:
        assert not any(t.array[b].any() for t in caches.values()), b
    assert w.stats()["bytes_offloaded"] == SLOTS * PAGE, "aliased bytes are copied once"
    worker.shutdown()


def test_attention_layers_wait_for_their_own_slot_and_mamba_layers_get_no_call():
    """Layer-compact layout (LBNHC): slot i's run holds three Mamba states and an attention
    page; the attention layer of slot 0 may run once that run is in, before the other slots."""
    caches, raw, names, worker = hybrid(QWEN3_NEXT, "LBNHC", host_blocks=4)
    saved = block_of(caches, 1)
    step(worker, KvbmConnectorMetadata.build(step=1, offloads=[("A", [(1, 2)])]), names[3])
    worker.native.wait_offloads()
    raw[...] = 0
    worker.bind_connector_metadata(KvbmConnectorMetadata.build(step=2, onboards=[("B", [(2, 6)])]))
    worker.start_load_kv(None)
    for slot, name in enumerate(names[3]):
        worker.wait_for_layer_load(name)
        # This attention layer and the Mamba states sharing its slot are in place.
        for group in names:
            assert np.array_equal(caches[group[slot]].array[6], saved[group[slot]]), (slot, group[slot])
    worker.wait_for_save()
    worker.get_transfer_results(set())
    worker.clear_connector_metadata()
    assert_block(caches, 6, saved, "all layers")
    worker.shutdown()


def test_a_hybrid_block_round_trips_through_the_disk_tier(tmp_path):
    config = kvbm.Config.from_env(
        {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
    )
    caches, raw, names, worker = hybrid(QWEN3_NEXT, "BLNHC", host_blocks=4, disk_blocks=6, config=config)
    w = worker.native
    saved = block_of(caches, 3)
    # GPU 3 -> host 1 -> disk 4; then disk 4 -> staging host 2 -> GPU 7, asynchronously.
    w.offload([(3, 1)], ["r"])
    w.disk_write([(1, 4, 0xBEEF, [9])])
    w.wait_disk()
    raw[...] = 0
    w.onboard_async("a", [(4, 2, 0xBEEF)], [(2, 7)])
    w.wait_async()
    assert w.poll_async() == [("a", [])]
    assert_block(caches, 7, saved, "through disk")
    worker.shutdown()


@pytest.mark.parametrize("layout", ["BLNHC", "LBNHC"])
def test_slots_holding_mamba_states_only_register_and_round_trip(layout):
    """vLLM makes groups of the largest layer count when the counts are close
    (``_get_kv_cache_groups_uniform_page_size``): here 3 Mamba layers and 2 attention layers
    make 3 slots, the last holding a (73-byte) state only. A block is then 2 pages and a state,
    not a whole number of pages; the attention spec's K/V hint cannot describe it and is
    dropped rather than refusing the model."""
    kinds, counts, state = ("mamba", "full"), (3, 2), 73
    caches, raw, names = allocate_hybrid_kv_cache(
        kinds, counts, BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE, state, layout=layout, simulated_gpu=SIMULATED_GPU
    )
    raw[...] = np.random.default_rng(9).integers(-128, 127, size=raw.shape, dtype=np.int8)
    worker = KvbmWorker(host_blocks=2, kv_cache_config=KvCacheConfig(kinds, layout))
    worker.register_kv_caches(caches)
    w = worker.native
    assert w.bytes_per_block == 2 * PAGE + state
    saved = block_of(caches, 6)
    w.offload([(6, 1)], ["r"])
    w.wait_offloads()
    raw[...] = 0
    w.onboard([(1, 0)])
    assert w.wait_onboards()
    assert_block(caches, 0, saved, "loaded")
    for b in range(1, BLOCKS):
        assert not any(t.array[b].any() for t in caches.values()), b
    worker.shutdown()


def test_mamba_layout_errors_are_still_refused():
    caches, raw, names = allocate_hybrid_kv_cache(QWEN3_NEXT, SLOTS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE, STATE)
    # A Mamba view whose blocks lie at another distance than the attention views'.
    bad = dict(caches)
    t = caches[names[0][0]]
    bad[names[0][0]] = type(t)(
        np.lib.stride_tricks.as_strided(t.array, shape=(BLOCKS, 1, 1, STATE), strides=(t.array.strides[0] // 2, STATE, STATE, 1)),
        storage=raw,
    )
    with pytest.raises(kvbm.LayoutError, match="apart"):
        describe_kv_caches(bad, BLOCKS)


def in_thread(fn, timeout: float):
    t = threading.Thread(target=fn)
    t.start()
    t.join(timeout=timeout)
    return t


@pytest.mark.parametrize("fence", [True, False])
def test_a_fenced_step_returns_from_wait_for_save_only_after_its_offloads(fence):
    """vLLM 0.33 nulls and frees a sliding-window block that left the window, or a Mamba state
    block two steps old, in the next ``allocate_slots`` and may zero and overwrite it in the
    next forward. Here block 4's offload is held on the D2H stream; the next step's forward
    overwrites block 4 once ``wait_for_save`` returned."""
    if SIMULATED_GPU:
        pytest.skip("holds the emulated device's stream")
    caches, raw, names, worker = hybrid(GPT_OSS, "BLNHC", host_blocks=4)
    saved = block_of(caches, 4)
    hold = worker.native._hold_stream("d2h")
    worker.bind_connector_metadata(
        KvbmConnectorMetadata.build(step=1, offloads=[("A", [(4, 3)])], fence_offloads=fence)
    )
    worker.start_load_kv(None)

    def save_then_next_forward():
        worker.wait_for_save()
        raw.reshape(-1)[:] = 0  # the next step zeroes and overwrites the freed block

    # Fenced, it must still wait with the stream held (0.5 s shows it, whatever the load); not
    # fenced, it must return while the stream is held (given all the time it needs).
    t = in_thread(save_then_next_forward, timeout=0.5 if fence else 60)
    waiting = t.is_alive()
    hold.release()
    t.join(timeout=60)
    assert not t.is_alive()
    worker.get_transfer_results(set())
    worker.clear_connector_metadata()
    if not fence:
        assert not waiting, "a step without the fence waited for its offloads"
        worker.shutdown()
        return
    assert waiting, "wait_for_save returned while the fenced offload was still queued"
    step(worker, KvbmConnectorMetadata.build(step=2, onboards=[("B", [(3, 6)])]), sync_loads=True)
    assert_block(caches, 6, saved, "the offload read the block before it was overwritten")
    worker.shutdown()


def test_a_fenced_step_makes_vllms_stream_wait_on_the_cuda_path():
    """On the CUDA path (the simulated driver under KVBM_TEST_SIMULATED_GPU=1) the fence is a
    wait of vLLM's stream on the device; on the emulated device the host waits. Either way the
    next step reads what the offload copied."""
    caches, raw, names, worker = hybrid(QWEN3_NEXT, "LBNHC", host_blocks=4)
    saved = block_of(caches, 2)
    step(worker, KvbmConnectorMetadata.build(step=1, offloads=[("A", [(2, 1)])], fence_offloads=True))
    assert worker.last_fence == ("device" if SIMULATED_GPU else "host")
    step(worker, KvbmConnectorMetadata.build(step=2, offloads=[("A", [(3, 2)])]))
    assert worker.last_fence == "none"
    worker.native.wait_offloads()
    raw[...] = 0
    step(worker, KvbmConnectorMetadata.build(step=3, onboards=[("B", [(1, 6)])]), sync_loads=True)
    assert_block(caches, 6, saved, "after a fenced offload")
    worker.shutdown()


def offloaded(worker, pairs):
    """Host blocks filled from GPU blocks (`pairs` of (GPU, host))."""
    worker.native.offload(pairs, ["prefill"])
    worker.native.wait_offloads()


@pytest.mark.parametrize("groups", [len(QWEN3_NEXT), 1])
def test_failed_asynchronous_loads_are_reported_per_request_with_several_groups(groups):
    """The leader makes every load of a hybrid model asynchronous and puts the GPU blocks it
    could not back into the onboard's ``unbacked``; with several groups the request is reported
    in ``failed_recving`` (and ``finished_recving``), never as block errors."""
    caches, raw, names, worker = hybrid(QWEN3_NEXT, "BLNHC", host_blocks=4, num_kv_cache_groups=groups)
    saved = block_of(caches, 1)
    offloaded(worker, [(1, 0), (2, 1)])
    meta = KvbmConnectorMetadata.build(
        step=1,
        async_onboards=[("ok", [], [(0, 5)]), ("short", [], [(1, 6)])],
        unbacked={"short": [7]},
    )
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.native.wait_async()
    results = worker.get_transfer_results(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    assert results.finished_recving == {"ok", "short"}
    assert_block(caches, 5, saved, "the good load")
    if groups > 1:
        assert results.failed_recving == {"short"}
        assert errors == set(), "vLLM 0.33 raises on block errors with several groups"
    else:
        assert results.failed_recving == set()
        assert errors == {7}
    # Reported once.
    assert worker.get_transfer_results(set()).failed_recving == set()
    worker.shutdown()


def test_a_failed_disk_read_of_a_hybrid_load_fails_the_request(tmp_path):
    config = kvbm.Config.from_env(
        {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
    )
    caches, raw, names, worker = hybrid(QWEN3_NEXT, "BLNHC", host_blocks=4, disk_blocks=4, config=config)
    offloaded(worker, [(1, 0)])
    worker.native.disk_write([(0, 2, 77, [])])
    worker.native.wait_disk()
    # The key does not match what disk block 2 holds: the read fails, so does GPU block 5.
    meta = KvbmConnectorMetadata.build(step=1, async_onboards=[("r", [(2, 3, 78)], [(3, 5)])])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.native.wait_async()
    results = worker.get_transfer_results(set())
    assert (results.finished_recving, results.failed_recving) == ({"r"}, {"r"})
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()
    worker.shutdown()


def test_block_errors_outside_asynchronous_loads_are_never_handed_to_vllm_with_several_groups():
    caches, raw, names, worker = hybrid(QWEN3_NEXT, "BLNHC", host_blocks=4)
    assert worker._num_groups == len(QWEN3_NEXT), "taken from kv_cache_config"
    results, errors = step(worker, KvbmConnectorMetadata.build(step=1, load_errors=[3, 4]))
    assert errors == set() and results.failed_recving == set()
    assert worker.unreportable_load_errors == 2
    worker.shutdown()


def test_vllm_032s_get_finished_is_unchanged():
    caches, raw, names, worker = hybrid(QWEN3_NEXT, "BLNHC", host_blocks=4, num_kv_cache_groups=1)
    offloaded(worker, [(1, 0)])
    worker.bind_connector_metadata(
        KvbmConnectorMetadata.build(step=1, async_onboards=[("r", [], [(0, 5)])], unbacked={"r": [6]})
    )
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.native.wait_async()
    assert worker.get_finished(set()) == (None, {"r"})
    assert worker.get_block_ids_with_load_errors() == {6}
    worker.clear_connector_metadata()
    worker.shutdown()
