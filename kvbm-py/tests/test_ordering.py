"""The hazards of asynchronous saves under vLLM 0.33's call order, and the waits that close them.

vLLM 0.33's worker calls ``handle_preemptions`` first in every step, then runs ``start_load_kv``
before the forward only when the step has synchronous loads, otherwise after it
(vllm/v1/worker/gpu/kv_connector.py, ``ActiveKVConnector.pre_forward``). Its scheduler frees a
preempted request's GPU blocks without telling the connector (vllm/v1/core/sched/scheduler.py,
``_preempt_request``) and may hand them to another request in that same step, whose forward
then overwrites them. So:

1. ``handle_preemptions`` must not return while a save still reads a preempted request's blocks;
2. a load must not read a host block while the save writing it is still in flight;
3. but a load must not wait for saves it does not depend on.

The emulated D2H stream is *held* so that a save stays queued, in flight for everything above
it, for as long as the test needs: no timing decides the outcome. Without the waits, the
overwrite or the load happens while the save is queued and the bytes come out wrong.
"""

import threading

import numpy as np

from kvbm.metadata import KvbmConnectorMetadata
from kvbm.testing import allocate_kv_cache
from kvbm.worker import KvbmWorker


def setup(layout):
    caches, _ = allocate_kv_cache(2, 8, 2, 4, 16, layout=layout)
    worker = KvbmWorker(host_blocks=4)
    worker.register_kv_caches(caches)
    return caches, worker


def forward_writes(caches, block, seed):
    """What a forward pass writes into one GPU block, per layer."""
    rng = np.random.default_rng(seed)
    written = {}
    for name, t in caches.items():
        t.array[block] = rng.integers(0, 1 << 16, size=t.array[block].shape, dtype=np.uint16)
        written[name] = t.array[block].copy()
    return written


def step(worker, meta, has_sync_kv_loads=False):
    """One worker step in vLLM 0.33's order."""
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    if has_sync_kv_loads:
        worker.start_load_kv(None)
    for name in worker._layers:
        worker.wait_for_layer_load(name)
    if not has_sync_kv_loads:
        worker.start_load_kv(None)
    worker.wait_for_save()
    worker.get_finished(set())
    worker.clear_connector_metadata()


def in_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join(timeout=0.5)
    return t


def test_a_preempted_requests_blocks_are_not_reused_while_its_save_reads_them():
    for layout in ["BLNHC", "LBNHC"]:
        caches, worker = setup(layout)
        saved = forward_writes(caches, 3, seed=1)
        hold = worker.native._hold_stream("d2h")
        # Step 1: request A completes GPU block 3; its save (to host block 0) stays queued.
        step(worker, KvbmConnectorMetadata.build(step=1, offloads=[("A", [(3, 0)])]))
        # Step 2: vLLM preempted A and gave block 3 to B, whose forward overwrites it as soon as
        # handle_preemptions returns.
        meta = KvbmConnectorMetadata.build(step=2, preempted=["A"])

        def preempt_then_forward():
            worker.handle_preemptions(meta)
            forward_writes(caches, 3, seed=2)

        t = in_thread(preempt_then_forward)
        waiting = t.is_alive()  # the save cannot have run: the stream is held
        hold.release()
        t.join(timeout=60)
        assert not t.is_alive()
        assert waiting, "handle_preemptions returned while A's save was still queued"
        # Step 3: request C loads host block 0 into block 6: A's bytes, not B's.
        step(worker, KvbmConnectorMetadata.build(step=3, onboards=[("C", [(0, 6)])]), has_sync_kv_loads=True)
        for name, t in caches.items():
            assert np.array_equal(t.array[6], saved[name]), (layout, name)
        assert worker.native.stats()["offload_waits"] >= 1
        worker.shutdown()


def test_a_load_waits_for_the_save_into_its_host_block_and_for_no_other():
    caches, worker = setup("BLNHC")
    earlier = forward_writes(caches, 2, seed=3)
    step(worker, KvbmConnectorMetadata.build(step=1, offloads=[("A", [(2, 1)])]))
    worker.native.wait_offloads()  # host block 1 holds block 2's bytes
    pending = forward_writes(caches, 3, seed=4)
    hold = worker.native._hold_stream("d2h")
    step(worker, KvbmConnectorMetadata.build(step=2, offloads=[("B", [(3, 0)])]))  # queued behind the hold

    # A load of host block 1 does not depend on B's queued save: it completes while held.
    t = in_thread(lambda: step(worker, KvbmConnectorMetadata.build(step=3, onboards=[("C", [(1, 5)])]), True))
    t.join(timeout=60)
    assert not t.is_alive(), "a load waited for a save it does not read"
    for name, a in caches.items():
        assert np.array_equal(a.array[5], earlier[name])

    # A load of host block 0 reads what B's save writes: it waits for it.
    t = in_thread(lambda: step(worker, KvbmConnectorMetadata.build(step=4, onboards=[("D", [(0, 6)])]), True))
    waiting = t.is_alive()
    hold.release()
    t.join(timeout=60)
    assert not t.is_alive()
    assert waiting, "the load did not wait for the save into its host block"
    for name, a in caches.items():
        assert np.array_equal(a.array[6], pending[name]), name
    worker.shutdown()


def test_sleep_mode_waits_for_a_queued_save_before_vllm_frees_the_memory():
    """vLLM frees the KV cache memory as soon as unregister_kv_caches returns (sleep mode): a
    save still queued reads that memory, so unregister must wait for it."""
    caches, worker = setup("BLNHC")
    saved = forward_writes(caches, 3, seed=5)
    hold = worker.native._hold_stream("d2h")
    step(worker, KvbmConnectorMetadata.build(step=1, offloads=[("A", [(3, 0)])]))
    t = in_thread(worker.unregister_kv_caches)
    waiting = t.is_alive()  # the save cannot have run: the stream is held
    hold.release()
    t.join(timeout=60)
    assert not t.is_alive()
    assert waiting, "unregister_kv_caches returned while a save still read the KV caches"
    # What "freeing" leaves in the memory does not reach the host tier.
    for t_ in caches.values():
        t_.array[...] = 0
    worker.restore_kv_caches()
    step(worker, KvbmConnectorMetadata.build(step=2, onboards=[("C", [(0, 6)])]), has_sync_kv_loads=True)
    for name, t_ in caches.items():
        assert np.array_equal(t_.array[6], saved[name]), name
    worker.shutdown()
