"""vLLM 0.33's sleep mode (vllm/v1/worker/gpu_worker.py: ``sleep`` calls the connector's
``unregister_kv_caches`` and then frees the KV cache memory; ``wake_up`` maps it again and calls
``restore_kv_caches``). kvbm waits for every copy touching that memory, refuses any other until
the caches are restored, keeps its host tier meanwhile, and afterwards copies into the memory
as it now is. With KVBM_TEST_SIMULATED_GPU=1 (scripts/test.sh) the caches are device memory of
the simulated driver, strict: the old memory is really freed and new memory allocated at
another address, and a copy touching freed memory would abort the test."""

import gc

import numpy as np
import pytest

import kvbm
from kvbm.metadata import KvbmConnectorMetadata
from kvbm.worker import KvbmWorker

from conftest import block_view, make_caches

KIND = "LBNHC"
SHAPE = dict(layers=3, num_blocks=8, block_size=4, heads=2, head_size=8)


def test_copies_are_drained_refused_while_asleep_and_land_in_the_new_memory_after():
    caches = make_caches(KIND, **SHAPE)
    rng = np.random.default_rng(33)
    for t in caches.values():
        t.array[...] = rng.integers(0, 1 << 16, size=t.array.shape, dtype=np.uint16)
    before = {name: [block_view(t, KIND, b).copy() for b in range(8)] for name, t in caches.items()}
    names = list(caches)
    old_addr = next(iter(caches.values())).data_ptr()
    worker = KvbmWorker(host_blocks=6)
    worker.register_kv_caches(caches)
    # A step that offloads GPU blocks 1, 6, 3 into host blocks 0, 4, 2: the offloads may still
    # be in flight when vLLM goes to sleep.
    worker.bind_connector_metadata(KvbmConnectorMetadata.build(offloads=[("r", [(1, 0), (6, 4), (3, 2)])]))
    worker.start_load_kv()
    worker.wait_for_save()
    worker.unregister_kv_caches()
    worker.unregister_kv_caches()  # idempotent
    assert worker.native.suspended
    # vLLM frees the memory (the simulated driver: cuMemFree) and maps new memory on wake-up.
    del caches
    gc.collect()
    # While asleep, no copy may touch the KV caches.
    worker.clear_connector_metadata()
    worker.bind_connector_metadata(KvbmConnectorMetadata.build(onboards=[("s", [(0, 7)])]))
    with pytest.raises(kvbm.KvbmError, match="sleep mode"):
        worker.start_load_kv()
    # The refused load is reported, so that vLLM would recompute the block.
    assert worker.get_block_ids_with_load_errors() == {7}
    worker.clear_connector_metadata()
    fresh = make_caches(KIND, **SHAPE)
    fresh = {n: t for n, t in zip(names, fresh.values())}
    worker.restore_kv_caches(fresh)
    assert not worker.native.suspended
    # The host tier kept the offloaded blocks: loaded into the new memory, byte for byte.
    worker.bind_connector_metadata(KvbmConnectorMetadata.build(onboards=[("s", [(0, 7), (4, 0), (2, 5)])]))
    worker.start_load_kv()
    for name in names:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert worker.get_block_ids_with_load_errors() == set()
    for name, t in fresh.items():
        assert np.array_equal(block_view(t, KIND, 7), before[name][1])
        assert np.array_equal(block_view(t, KIND, 0), before[name][6])
        assert np.array_equal(block_view(t, KIND, 5), before[name][3])
    assert old_addr != 0
    worker.shutdown()


def test_restore_refuses_caches_of_another_shape_and_needs_an_unregister_first():
    caches = make_caches(KIND, **SHAPE)
    worker = KvbmWorker(host_blocks=4)
    worker.register_kv_caches(caches)
    worker.restore_kv_caches()  # registered: nothing to do
    worker.unregister_kv_caches()
    other = make_caches(KIND, **dict(SHAPE, heads=4))
    with pytest.raises(kvbm.KvbmError, match="differ"):
        worker.restore_kv_caches(other)
    assert worker.native.suspended
    worker.restore_kv_caches(caches)
    assert not worker.native.suspended
    worker.shutdown()


def test_an_async_load_refused_while_asleep_reports_its_staging_blocks_bad(tmp_path):
    """A disk hit's staging host block joins the host tier when its load is reported finished
    (kvbm-core's Leader::release); a load refused in sleep mode never read the disk, so its
    staging block must be reported bad first (the leader drops it before releasing), or the
    host tier would announce a block holding another sequence's bytes."""
    caches = make_caches(KIND, **SHAPE)
    config = kvbm.Config.from_env({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)})
    worker = KvbmWorker(host_blocks=4, disk_blocks=4, config=config)
    worker.register_kv_caches(caches)
    worker.unregister_kv_caches()
    # Disk block 2 -> staging host block 3 -> GPU block 5, for request "a".
    meta = KvbmConnectorMetadata.build(async_onboards=[("a", [(2, 3, 77)], [(3, 5)])])
    worker.bind_connector_metadata(meta)
    with pytest.raises(kvbm.KvbmError, match="sleep mode"):
        worker.start_load_kv()
    sending, recving = worker.get_finished(set())
    assert recving == {"a"}  # finished, so that vLLM does not wait for it forever ...
    assert worker.get_block_ids_with_load_errors() == {5}  # ... with its block recomputed
    bad = worker.build_connector_worker_meta()
    assert bad is not None and 3 in bad.bad_host_blocks
    worker.clear_connector_metadata()
    worker.restore_kv_caches()
    worker.shutdown()
