"""What the bindings cannot serve safely is refused with a Python exception, never a crash:
sizes that do not fit, memory kvbm must not write (read-only, immutable, Python objects),
timeouts that are not a number of seconds; calls from several threads are serialized."""

import math
import mmap
import os
import threading

import numpy as np
import pytest

import kvbm
from kvbm.testing import HostTensor

from conftest import SIMULATED_GPU, make_caches

SHAPE = (4, 2, 4, 2, 8)  # [blocks, K/V, tokens, heads, head size]: the older 5-D layout


def caches_of(array):
    return {"model.layers.0.self_attn.attn": HostTensor(array)}


def worker(host_blocks=2, **kwargs):
    return kvbm.Worker(make_caches("block_first", 1, 4, 4, 2, 8), 4, host_blocks, **kwargs)


# -- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, name",
    [
        # Beyond 32-bit block ids: refused on any machine, whatever its memory.
        ((16, 2**32), "host_blocks=4294967296: at most 4294967294 blocks \\(block ids are 32-bit"),
        ((16, 4, 2**32), "disk_blocks=4294967296: at most"),
        ((16, 2**32, 2**32), "host_blocks=4294967296"),
        ((2**40, 4), "block_size=1099511627776"),
    ],
)
def test_leader_sizes_that_do_not_fit_are_a_value_error(args, name):
    """`kvbm.Leader(16, 2**31)` aborted the process (an allocation of 32 GiB failing)."""
    with pytest.raises(ValueError, match=name):
        kvbm.Leader(*args)
    with pytest.raises(OverflowError):
        kvbm.Leader(16, 2**64)
    with pytest.raises(OverflowError):
        kvbm.Leader(16, -1)


def test_sequence_hashes_refuse_a_block_size_beyond_the_bound():
    with pytest.raises(ValueError, match="block_size="):
        kvbm.sequence_hashes([1, 2, 3], 2**40)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(host_blocks=2**32), "host_blocks=4294967296: at most 4294967294 blocks"),
        (dict(host_blocks=2**40), "host_blocks=1099511627776: at most"),
        (dict(async_onboards_max=2**62), "async_onboards_max="),
        (dict(batch_blocks_max=2**62), "batch_blocks_max="),
        (dict(inflight_max=2**62), "inflight_max="),
        (dict(disk_blocks=2**62), "disk_blocks="),
    ],
)
def test_worker_sizes_that_do_not_fit_are_a_value_error(kwargs, name):
    with pytest.raises(ValueError, match=name):
        worker(**kwargs)


def machine_memory_bytes():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


LEADER_BYTES_PER_BLOCK = 128  # kvbm_core::leader::BOOKKEEPING_BYTES_PER_BLOCK


@pytest.mark.skipif(
    2**31 * LEADER_BYTES_PER_BLOCK <= machine_memory_bytes() // 2,
    reason="this machine's memory would hold the bookkeeping: the leader would allocate it",
)
def test_leader_bookkeeping_beyond_half_of_memory_names_that_bound():
    with pytest.raises(ValueError, match=r"host_blocks=2147483648: .*half of this machine's memory") as e:
        kvbm.Leader(16, 2**31)
    assert "32-bit" not in str(e.value)


@pytest.mark.skipif(
    2**31 * 256 <= machine_memory_bytes(),
    reason="this machine's memory would hold the pinned pool: the worker would pin it",
)
def test_worker_host_pool_beyond_memory_names_that_bound():
    # 2**31 blocks of 256 bytes (the `worker()` layout): 512 GiB.
    with pytest.raises(ValueError, match=r"host_blocks=2147483648: .*do not fit this machine's memory") as e:
        worker(host_blocks=2**31)
    assert "32-bit" not in str(e.value)


def test_token_counts_that_would_overflow_are_not_an_internal_error():
    leader = kvbm.Leader(4, 8)
    spans = leader.schedule([("r", [[0, 1]], 2**64 - 1, None, None)], [], [("r", 2**64 - 1, 8)])
    assert spans == [(0, 0, 8)]


# -- memory kvbm must not write -----------------------------------------------------------------


def test_a_read_only_array_is_refused():
    array = np.zeros(SHAPE, np.uint16)
    array.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        kvbm.Worker(caches_of(array), 4, 2)


def test_an_array_over_bytes_is_refused():
    """An array over an immutable `bytes` object: kvbm would have written into the bytes."""
    data = bytes(int(np.prod(SHAPE)) * 2)
    array = np.frombuffer(data, np.uint16).reshape(SHAPE)
    with pytest.raises(TypeError, match="read-only"):
        kvbm.Worker(caches_of(array), 4, 2)
    # bytes themselves are no tensor.
    with pytest.raises((TypeError, kvbm.LayoutError)):
        kvbm.Worker({"l0": data}, 4, 2)


def test_an_object_array_is_refused():
    """Object pointers would be copied without their reference counts (a crash at teardown)."""
    array = np.empty(SHAPE[:-1] + (1,), dtype=object)
    array[...] = 0
    with pytest.raises(TypeError, match="Python objects"):
        kvbm.Worker(caches_of(array), 4, 2)
    with pytest.raises(TypeError, match="Python objects"):
        kvbm._kvbm.describe_kv_caches(caches_of(array), 4)


class Interfaceless:
    """A torch-like tensor that says nothing of its memory but where it is (as torch does)."""

    def __init__(self, array):
        self.array, self.shape, self.device = array, array.shape, "cpu"

    def data_ptr(self):
        return int(self.array.ctypes.data)

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self):
        return self.array.itemsize

    def untyped_storage(self):
        array = self.array

        class Storage:
            def data_ptr(self):
                return int(array.ctypes.data)

            def nbytes(self):
                return int(array.nbytes)

        return Storage()


@pytest.mark.skipif(SIMULATED_GPU, reason="the emulated device loads into host memory")
def test_a_tensor_over_read_only_memory_is_refused():
    """A load into a read-only mapping segfaulted: the emulated device checks the mappings."""
    size = int(np.prod(SHAPE)) * 2
    read_only = mmap.mmap(-1, size, prot=mmap.PROT_READ)
    array = np.frombuffer(read_only, np.uint16).reshape(SHAPE)
    with pytest.raises(TypeError, match="not writable"):
        kvbm.Worker({"l0": Interfaceless(array)}, 4, 2)
    # The message names the tensor (its index and layer name), read from the maps once.
    good = Interfaceless(np.zeros(SHAPE, np.uint16))
    with pytest.raises(TypeError, match=r'KV cache tensor 1 \("layer.1".*not writable'):
        kvbm.Worker({"layer.0": good, "layer.1": Interfaceless(array)}, 4, 2)
    # The same tensor over writable memory is accepted.
    writable = Interfaceless(np.zeros(SHAPE, np.uint16))
    w = kvbm.Worker({"l0": writable}, 4, 2)
    w.offload([(0, 0)], ["r"])
    w.wait_offloads()
    w.onboard([(0, 1)])
    assert w.wait_onboards()


def test_a_read_only_restore_is_refused():
    w = worker()
    w.suspend()
    array = np.zeros(SHAPE, np.uint16)
    array.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        w.restore(caches_of(array))
    assert w.suspended


# -- timeouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [1e300, math.inf, -math.inf, math.nan, -1.0, 86400.5])
def test_timeouts_that_are_not_seconds_are_a_value_error(timeout):
    w = worker()
    with pytest.raises(ValueError, match="timeout_s="):
        w.wait_host_ready(timeout)
    assert w.wait_host_ready(30.0)
    assert w.wait_host_ready(0)


# -- threads ------------------------------------------------------------------------------------


def hammer(target, threads=4):
    errors = []

    def run():
        try:
            target()
        except Exception as e:  # noqa: BLE001 - every failure is the test's finding
            errors.append(repr(e))

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts), "a thread hung"
    assert errors == []


def test_threads_on_one_worker_are_serialized():
    """Two threads on one Worker got RuntimeError('Already borrowed')."""
    w = worker(host_blocks=4)

    def run():
        for _ in range(150):
            w.offload([(0, 0), (1, 1)], ["r"])
            w.wait_offloads()
            w.poll_offloads()
            w.onboard([(0, 2)])
            w.wait_onboards()
            w.stats()
            assert w.num_blocks == 4

    hammer(run)
    assert w.take_failed() == []


def test_threads_on_one_leader_are_serialized():
    leader = kvbm.Leader(4, 64)

    def run():
        base = threading.get_ident() % 100_000 * 1000
        for i in range(200):
            h = base + i
            leader.offload([(h, None, [1, 2, 3, 4])])
            leader.count_prefix([h])
            leader.take_events()
            leader.end_step()
            leader.counts()

    hammer(run)


# -- the default disk cache directory -----------------------------------------------------------


def default_dir_worker(tmp_path, monkeypatch):
    """A worker with a disk tier in kvbm's default directory, `$TMPDIR/kvbm-<uid>`."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("DYN_KVBM_DISK_CACHE_DIR", raising=False)
    return worker(disk_blocks=4, disk_disable_o_direct=True)


def test_a_default_directory_planted_as_a_link_is_refused(tmp_path, monkeypatch):
    """Another user's `$TMPDIR/kvbm-<uid>` symlink to a directory of theirs was followed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / f"kvbm-{os.geteuid()}").symlink_to(elsewhere)
    with pytest.raises(kvbm.DiskError, match="symbolic link"):
        default_dir_worker(tmp_path, monkeypatch)
    assert list(elsewhere.iterdir()) == [], "nothing was created through the link"


def test_a_default_directory_open_to_others_or_of_another_user_is_refused(tmp_path, monkeypatch):
    planted = tmp_path / f"kvbm-{os.geteuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(kvbm.DiskError, match="mode 777"):
        default_dir_worker(tmp_path, monkeypatch)
    # Private means no group or other bits at all, not only none that write.
    planted.chmod(0o750)
    with pytest.raises(kvbm.DiskError, match="mode 750"):
        default_dir_worker(tmp_path, monkeypatch)
    planted.chmod(0o1777)
    with pytest.raises(kvbm.DiskError, match="mode 1777"):
        default_dir_worker(tmp_path, monkeypatch)
    if os.geteuid() == 0:
        planted.chmod(0o700)
        os.chown(planted, 4242424, -1)
        with pytest.raises(kvbm.DiskError, match="owned by uid 4242424"):
            default_dir_worker(tmp_path, monkeypatch)


def test_the_default_directory_is_created_private_and_reused(tmp_path, monkeypatch):
    w = default_dir_worker(tmp_path, monkeypatch)
    assert w.disk_blocks == 4
    del w
    made = tmp_path / f"kvbm-{os.geteuid()}"
    assert made.is_dir() and not made.is_symlink()
    assert made.stat().st_mode & 0o7777 == 0o700
    assert default_dir_worker(tmp_path, monkeypatch).disk_blocks == 4


# -- calls back into a Leader or Worker from code kvbm runs ------------------------------------


def within(seconds, fn):
    """`fn()` on a thread given `seconds`: a call that waits forever fails the test, not hangs it."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call hung: it waited on a lock its own thread holds"
    return result


@pytest.mark.skipif(SIMULATED_GPU, reason="host tensors on the emulated device")
def test_tensors_released_by_restore_may_call_the_worker():
    """`restore` dropped the old tensors under the worker's lock: a finalizer calling the worker
    waited forever on the lock its own thread held."""
    seen = []

    class Finalized(HostTensor):
        def __del__(self):
            try:
                seen.append(w.stats()["bytes_offloaded"])
            except Exception as e:  # noqa: BLE001
                seen.append(e)

    w = kvbm.Worker({"l0": Finalized(np.zeros(SHAPE, np.uint16))}, 4, 2)
    w.suspend()
    result = within(20, lambda: w.restore(caches_of(np.zeros(SHAPE, np.uint16))))
    assert "error" not in result, result
    assert seen == [0], "the finalizer ran after the lock was released and got its answer"


def test_a_reentrant_call_raises_instead_of_waiting_forever():
    """Python code that runs while a Leader's or Worker's lock is held (a finalizer, say) and
    calls the same object from the same thread gets a RuntimeError, not a deadlock."""
    leader = kvbm.Leader(4, 8)
    result = within(20, lambda: leader._with_lock_held(leader.counts))
    assert isinstance(result.get("error"), RuntimeError), result
    assert "re-entrant call" in str(result["error"])
    assert leader.counts()["capacity"] == 8, "the lock was released"
    w = worker()
    for call in (w.stats, w.metrics, lambda: w.suspend()):
        result = within(20, lambda: w._with_lock_held(call))
        assert isinstance(result.get("error"), RuntimeError), result
        assert "re-entrant call" in str(result["error"])
    assert w.stats()["bytes_offloaded"] == 0
