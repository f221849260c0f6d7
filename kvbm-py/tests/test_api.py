"""The native API: hashes, configuration errors, the leader's host tier, the worker's copies."""

import json
import os

import numpy as np
import pytest

import kvbm
from kvbm.testing import allocate_kv_cache
from kvbm.worker import KvbmWorker, describe_kv_caches

from conftest import LAYOUTS_033, REPO, SIMULATED_GPU, HostTensor, block_view, make_caches

#: Copies per block for 3 layers of 2 heads (the older 5-D tensors: K and V apart per layer).
RUNS = {
    "LBNHC": 3,
    "LBHNC": 3,
    "LHBNC": 6,
    "BLNHC": 1,
    "BLHNC": 1,
    "BHLNC": 1,
    "MLA-LBNHC": 3,
    "MLA-BLNHC": 1,
    "outer_first": 6,
    "block_first": 3,
    "mla": 3,
}


def test_sequence_hashes_equal_the_reference_vectors():
    path = os.path.join(REPO, "kvbm-events", "tests", "data", "block-hashes.json")
    cases = json.load(open(path))["cases"]
    checked = 0
    for case in cases:
        got = kvbm.sequence_hashes(
            case["tokens"], case["block_size"], case.get("lora_name"), case.get("cache_namespace")
        )
        if "sequence_hashes" in case:
            assert got == [int(h) for h in case["sequence_hashes"]], case["name"]
        # The first block's sequence hash is its block hash (LoRA and namespace seed it).
        assert got[:1] == [int(h) for h in case["local_block_hashes"][:1]], case["name"]
        checked += 1
    assert checked == len(cases) >= 8
    # Continuing from a parent gives the same chain as hashing at once.
    tokens = list(range(64))
    whole = kvbm.sequence_hashes(tokens, 16)
    tail = kvbm.sequence_hashes(tokens[32:], 16, parent=whole[1])
    assert whole[2:] == tail
    assert kvbm.sequence_hashes(tokens, 16, cache_salt="x") != whole


@pytest.mark.parametrize(
    "variable,value",
    [
        ("DYN_KVBM_CPU_CACHE_GB", "abc"),
        ("DYN_KVBM_CPU_CACHE_GB", "-1"),
        ("DYN_KVBM_MAX_TRANSFER_BATCH_SIZE", "0"),
        ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "many"),
    ],
)
def test_bad_configuration_names_the_variable_and_the_value(monkeypatch, variable, value):
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "1")
    monkeypatch.setenv(variable, value)
    with pytest.raises(kvbm.ConfigError) as e:
        kvbm.Config.from_env()
    assert variable in str(e.value) and value in str(e.value)
    assert isinstance(e.value, kvbm.KvbmError)


def test_configuration_from_keywords_and_environment(monkeypatch):
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_GB", raising=False)
    with pytest.raises(kvbm.ConfigError, match="DYN_KVBM_CPU_CACHE_GB"):
        kvbm.Config.from_env()
    c = kvbm.Config.from_env({"DYN_KVBM_CPU_CACHE_GB": "0.001", "DYN_KVBM_MAX_TRANSFER_BATCH_SIZE": "8"})
    # 10^6 bytes over two ranks of 1000-byte blocks: 500 each.
    assert c.host_blocks(1000, 2) == 500
    assert c.max_transfer_batch_size == 8
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "7")
    assert kvbm.Config.from_env().host_blocks(1 << 20) == 7


def _blocks(tokens, block_size):
    hashes = kvbm.sequence_hashes(tokens, block_size)
    return [
        (h, hashes[i - 1] if i else None, tokens[i * block_size : (i + 1) * block_size])
        for i, h in enumerate(hashes)
    ]


def test_leader_offloads_matches_holds_evicts_and_reports_events():
    leader = kvbm.Leader(4, 3)
    blocks = _blocks(list(range(16)), 4)  # 4 blocks, tier of 3
    ids = leader.offload(blocks[:3])
    assert sorted(ids) == [0, 1, 2]
    assert leader.offload(blocks[:2]) == [None, None], "already resident: nothing to save"
    hashes = [b[0] for b in blocks]
    assert leader.count_prefix(hashes) == 3
    assert leader.count_prefix(hashes[1:]) == 2
    events = leader.take_events()
    assert events == [("stored", "CPU_PINNED", hashes[:3], None, list(range(12)), 4, None, None)]
    # Blocks handed out stay held two steps: no room for a fourth yet.
    assert leader.offload(blocks[3:]) == [None]
    assert leader.counts()["held"] == 3
    leader.end_step()
    leader.end_step()
    assert leader.counts()["held"] == 0
    assert leader.offload(blocks[3:]) != [None]
    events = leader.take_events()
    assert [e[0] for e in events] == ["removed", "stored"]
    assert events[1][3] == hashes[2], "the stored block names its parent"
    assert len(leader.registered_hashes()) == 3
    assert leader.hold_onboard(hashes[:2]) == ([], []), "block 0 was evicted: no prefix"
    assert len(leader.hold_onboard(hashes[1:3])[0]) == 2
    with pytest.raises(kvbm.LayoutError):
        leader.offload([(1, None, [1, 2, 3])])  # 3 tokens in a 4-token block


@pytest.mark.parametrize("kind", LAYOUTS_033 + ["MLA-LBNHC", "MLA-BLNHC", "outer_first", "block_first", "mla"])
def test_worker_round_trips_blocks_byte_exactly(kind):
    caches = make_caches(kind, layers=3, num_blocks=8, block_size=4, heads=2, head_size=8)
    rng = np.random.default_rng(7)
    for t in caches.values():
        t.array[...] = rng.integers(0, 1 << 16, size=t.array.shape, dtype=np.uint16)
    before = {name: [block_view(t, kind, b) for b in range(8)] for name, t in caches.items()}
    worker = KvbmWorker(host_blocks=5)
    worker.register_kv_caches(caches)
    w = worker.native
    assert (w.num_layers, w.num_blocks, w.host_blocks, w.device_kind) == (3, 8, 5, "cuda" if SIMULATED_GPU else "emulated")
    assert w.runs_per_block == RUNS[kind], "one copy per contiguous run of a block"
    assert w.layout_name == (kind.upper().removeprefix("MLA-") if kind.upper()[-5:] in LAYOUTS_033 else "per-layer tensors")
    w.offload([(1, 0), (6, 4), (3, 2)], ["r"])
    w.wait_offloads()
    assert w.poll_offloads() == ["r"]
    for t in caches.values():
        t.array[...] = 0
    w.onboard([(0, 7), (4, 0), (2, 5)])
    assert w.wait_onboards()
    assert w.take_failed() == []
    for name, t in caches.items():
        assert np.array_equal(block_view(t, kind, 7), before[name][1])
        assert np.array_equal(block_view(t, kind, 0), before[name][6])
        assert np.array_equal(block_view(t, kind, 5), before[name][3])
        assert not block_view(t, kind, 1).any(), "only the loaded blocks are written"
    stats = w.stats()
    assert stats["bytes_offloaded"] == stats["bytes_onboarded"] == 3 * w.bytes_per_block
    with pytest.raises(kvbm.LayoutError, match="outside"):
        w.onboard([(5, 0)])
    with pytest.raises(kvbm.LayoutError, match="outside"):
        w.offload([(8, 0)], [])


def refused(caches, *words):
    with pytest.raises(kvbm.LayoutError) as err:
        KvbmWorker(host_blocks=2).register_kv_caches(caches)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert "BLNHC" in str(err.value), "the error says what is supported"


def test_layouts_that_kvbm_cannot_copy_are_refused_clearly():
    refused({"l0": HostTensor(np.zeros((3, 4), dtype=np.uint16))}, '"l0"', "[3, 4]", "axes")
    # The content axis transposed away from the innermost place.
    transposed = HostTensor(np.zeros((4, 2, 8, 4), dtype=np.uint16).transpose(0, 1, 3, 2))
    refused({"l0": transposed}, '"l0"', "[4, 2, 4, 8]", "[64, 32, 1, 4]", "not contiguous")
    # Heads that alias each other.
    base = np.zeros((4, 1, 4, 8), dtype=np.uint16)
    aliased = np.lib.stride_tricks.as_strided(base, shape=(4, 2, 4, 8), strides=(64, 0, 16, 2))
    refused({"l0": HostTensor(aliased)}, "share bytes")
    # A layer with another block count than the others.
    caches = make_caches("outer_first", 2, 4, 4, 2, 8)
    caches["extra"] = HostTensor(np.zeros((2, 5, 4, 2, 8), dtype=np.uint16))
    refused(caches, '"extra"', "[2, 5, 4, 2, 8]", "not a multiple")
    with pytest.raises(kvbm.LayoutError):
        KvbmWorker(host_blocks=2).register_kv_caches({})
    with pytest.raises(kvbm.LayoutError):
        kvbm.Worker({}, 4, 2)
    with pytest.raises(kvbm.LayoutError, match="GPU blocks"):
        kvbm.Worker(make_caches("BLNHC", 1, 4, 4, 2, 8), 0, 2)


class Lying(HostTensor):
    """A tensor stand-in that reports another shape, strides or address than its memory has."""

    def __init__(self, tensor, shape=None, strides=None, shift=0):
        super().__init__(tensor.array, storage=tensor.storage)
        self._shape, self._strides, self._shift = shape, strides, shift

    @property
    def shape(self):
        return self._shape or self.array.shape

    def stride(self):
        return self._strides or super().stride()

    def data_ptr(self):
        return super().data_ptr() + self._shift


def test_no_address_or_size_from_python_is_trusted():
    """A wrong shape, stride or address would have kvbm read or write outside the tensor (a
    segfault, or another buffer's bytes): each is refused before any byte is addressed."""
    good = make_caches("LBNHC", 2, 4, 4, 2, 8)
    name, t = next(iter(good.items()))
    lies = [
        Lying(t, shape=(16, 2, 4, 16)),  # more blocks than the whole buffer holds
        Lying(t, strides=(2048, 16, 32, 1)),  # blocks farther apart than the buffer allows
        Lying(t, shift=1 << 20),  # an address past the buffer
        Lying(t, strides=(-256, 16, 32, 1)),  # a negative stride
    ]
    for lie in lies:
        caches = dict(good)
        caches[name] = lie
        with pytest.raises(kvbm.LayoutError, match=name.replace(".", r"\.")):
            KvbmWorker(host_blocks=2).register_kv_caches(caches)
        with pytest.raises(kvbm.LayoutError):
            describe_kv_caches(caches, 4)

    class NoStorage:
        shape, device = (4, 2, 4, 16), "cpu"

        def data_ptr(self):
            return 4096

        def stride(self):
            return (128, 16, 32, 1)

        def element_size(self):
            return 2

    with pytest.raises(kvbm.LayoutError, match="untyped_storage"):
        KvbmWorker(host_blocks=2).register_kv_caches({"l0": NoStorage()})


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_overlaid_cache_groups_are_copied_once(layout):
    """vLLM's cache groups alias the same bytes from offset 0 (kv_cache_planning.py,
    get_kv_cache_config_from_groups): a block's bytes move once, and every group's view of a
    loaded block holds what was saved."""
    caches, raw = allocate_kv_cache(3, 8, 2, 4, 16, layout=layout, groups=2)
    assert len(caches) == 6
    raw[...] = np.random.default_rng(3).integers(-128, 127, size=raw.shape, dtype=np.int8)
    before = {name: [t.array[b].copy() for b in range(8)] for name, t in caches.items()}
    worker = KvbmWorker(host_blocks=4)
    worker.register_kv_caches(caches)
    w = worker.native
    assert w.distinct_layers == 3 and w.num_layers == 6
    assert w.bytes_per_block == 3 * 2 * 4 * 16 * 2
    w.offload([(2, 0)], ["r"])
    w.wait_offloads()
    raw[...] = 0
    w.onboard([(0, 5)])
    assert w.wait_onboards()
    for name, t in caches.items():
        assert np.array_equal(t.array[5], before[name][2]), name
    assert w.stats()["bytes_offloaded"] == w.bytes_per_block


def test_kernel_blocks_are_one_block_per_vllm_block():
    """vLLM splits a 4-token block into 2-token kernel blocks (create_kv_cache_views): the views
    have twice the blocks; the connector's block ids are vLLM's (kv_cache_config.num_blocks)."""

    class Config:
        num_blocks = 6
        kv_cache_layout = "LBNHC"

    caches, raw = allocate_kv_cache(2, 6, 2, 4, 16, layout="LBNHC", kernel_block_size=2)
    assert next(iter(caches.values())).shape == (12, 2, 2, 16)
    raw[...] = np.random.default_rng(5).integers(-128, 127, size=raw.shape, dtype=np.int8)
    before = {name: t.array[2:4].copy() for name, t in caches.items()}  # vLLM block 1
    worker = KvbmWorker(host_blocks=2, kv_cache_config=Config())
    worker.register_kv_caches(caches)
    w = worker.native
    assert (w.num_blocks, w.runs_per_block) == (6, 2)
    w.offload([(1, 0)], ["r"])
    w.wait_offloads()
    raw[...] = 0
    w.onboard([(0, 4)])
    assert w.wait_onboards()
    for name, t in caches.items():
        assert np.array_equal(t.array[8:10], before[name]), name
        assert not t.array[:8].any() and not t.array[10:].any()


def test_describe_names_the_layout_the_strides_follow():
    for layout in LAYOUTS_033:
        d = describe_kv_caches(make_caches(layout, 3, 4, 4, 2, 8))
        assert (d["layout"], d["runs_per_block"], d["layers"]) == (layout, RUNS[layout], 3)
        assert d["bytes_per_block"] == 3 * 4 * 2 * 16 * 2


def test_the_connector_asks_vllm_for_a_block_outermost_layout(monkeypatch):
    from kvbm.vllm_integration.connector import DynamoConnector

    monkeypatch.delenv("KVBM_KV_CACHE_LAYOUT", raising=False)
    assert DynamoConnector.get_required_kvcache_layout(None) == "BLNHC"
    monkeypatch.setenv("KVBM_KV_CACHE_LAYOUT", "bhlnc")
    assert DynamoConnector.get_required_kvcache_layout(None) == "BHLNC"
    ask = kvbm._kvbm.required_kv_cache_layout
    assert ask({"KVBM_KV_CACHE_LAYOUT": "lbnhc"}) == "LBNHC"
    assert ask({"KVBM_KV_CACHE_LAYOUT": "NHD"}) == "LBNHC"
    assert ask({"KVBM_KV_CACHE_LAYOUT": "auto"}) is None
    with pytest.raises(kvbm.ConfigError, match="KVBM_KV_CACHE_LAYOUT.*diagonal"):
        ask({"KVBM_KV_CACHE_LAYOUT": "diagonal"})


def disk_worker(tmp_path, kind, num_blocks, host_blocks, disk_blocks, seed):
    """Caches of random bytes (2 layers) registered with a worker that has a disk tier."""
    caches = make_caches(kind, layers=2, num_blocks=num_blocks, block_size=4, heads=2, head_size=8)
    rng = np.random.default_rng(seed)
    for t in caches.values():
        t.array[...] = rng.integers(0, 1 << 16, size=t.array.shape, dtype=np.uint16)
    config = kvbm.Config.from_env(
        {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(host_blocks), "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
    )
    worker = KvbmWorker(host_blocks=host_blocks, disk_blocks=disk_blocks, config=config)
    worker.register_kv_caches(caches)
    return caches, worker.native


def test_worker_disk_tier_round_trips_and_a_bad_block_is_a_miss(tmp_path):
    caches, w = disk_worker(tmp_path, "block_first", num_blocks=6, host_blocks=4, disk_blocks=8, seed=3)
    before = {name: block_view(t, "block_first", 2) for name, t in caches.items()}
    assert w.disk_blocks == 8
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and (files[0].stat().st_mode & 0o777) == 0o600
    # GPU 2 -> host 1 -> disk 5, then disk 5 -> host 3 (staging) -> GPU 4.
    w.offload([(2, 1)], ["r"])
    w.disk_write([(1, 5, 0xABC, [1, 2, 3])])
    w.wait_disk()
    assert w.metrics()["kvbm_offload_blocks_h2d"] == 1
    assert w.disk_read([(5, 3, 0xABC)]) == []
    w.onboard([(3, 4)])
    assert w.wait_onboards()
    for name, t in caches.items():
        assert np.array_equal(block_view(t, "block_first", 4), before[name])
    # The wrong key (or a slot never written) is a miss: nothing is loaded, the GPU block is
    # reported failed, and its contents stay as they were.
    marker = {name: block_view(t, "block_first", 0) for name, t in caches.items()}
    assert w.disk_read([(5, 2, 0xDEF), (6, 0, 0xABC)]) == [2, 0]
    w.onboard([(2, 0), (0, 1)])
    w.wait_onboards()
    assert w.take_failed() == [0, 1]
    for name, t in caches.items():
        assert np.array_equal(block_view(t, "block_first", 0), marker[name])
    # Three disk blocks read, two missed: core's counters.
    m = w.metrics()
    assert (m["kvbm_disk_read_blocks"], m["kvbm_disk_read_misses"]) == (3, 2)
    with pytest.raises(kvbm.LayoutError, match="outside"):
        w.disk_write([(0, 8, 1, [])])
    no_disk = KvbmWorker(host_blocks=2)
    no_disk.register_kv_caches(make_caches("mla", 1, 2, 4, 1, 8))
    with pytest.raises(kvbm.LayoutError, match="without a disk tier"):
        no_disk.native.disk_read([(0, 0, 1)])


def test_leader_admits_to_disk_and_matches_host_then_disk():
    leader = kvbm.Leader(4, 3, disk_blocks=8, disk_filter_disabled=True)
    blocks = _blocks(list(range(24)), 4)  # 6 blocks
    hashes = [b[0] for b in blocks]
    leader.offload(blocks[:3])
    writes = leader.take_disk_writes()
    assert [w[2] for w in writes] == hashes[:3], "every block admitted (filter off)"
    assert all(len(w[3]) > 0 for w in writes), "identity bytes for the block header"
    assert leader.counts()["disk_registered"] == 3
    events = leader.take_events()
    assert [(e[0], e[1]) for e in events] == [("stored", "CPU_PINNED"), ("stored", "DISK")]
    for _ in range(2):
        leader.end_step()
    leader.offload(blocks[3:])  # evicts blocks 0..3 from the 3-block host tier
    assert leader.take_disk_writes() != []
    # Every host block is held by the step's copies: no room to stage a disk block yet.
    assert leader.count_prefix_tiers(hashes) == (0, 0)
    for _ in range(2):
        leader.end_step()
    # Six blocks on disk, three host blocks to stage them in.
    assert leader.count_prefix_tiers(hashes) == (0, 3)
    host, reads = leader.hold_onboard(hashes[:4])
    assert host == [] and [r[0] for r in reads] == [w[1] for w in writes[:3]]
    assert [r[2] for r in reads] == hashes[:3], "only as many staging host blocks as are free"
    assert len({r[1] for r in reads}) == 3
    with_filter = kvbm.Leader(4, 8, disk_blocks=8)
    with_filter.offload(blocks[:2])
    assert with_filter.take_disk_writes() == [], "seen once: not admitted"
    with_filter.hold_onboard(hashes[:2])
    assert [w[2] for w in with_filter.take_disk_writes()] == hashes[:2], "seen twice: admitted"


def test_asynchronous_loads_run_in_the_background_and_report_failures(tmp_path):
    caches, w = disk_worker(tmp_path, "outer_first", num_blocks=6, host_blocks=4, disk_blocks=4, seed=5)
    before = {name: block_view(t, "outer_first", 1) for name, t in caches.items()}
    w.offload([(1, 0)], ["r"])
    w.disk_write([(0, 2, 77, [])])
    w.wait_disk()
    # Disk 2 -> staging host 3 -> GPU 4; a second load whose key is wrong fails GPU block 5.
    w.onboard_async("a", [(2, 3, 77)], [(3, 4)])
    w.onboard_async("b", [(2, 1, 78)], [(1, 5)])
    w.wait_async()
    assert sorted(w.poll_async()) == [("a", []), ("b", [5])]
    assert w.poll_async() == []
    for name, t in caches.items():
        assert np.array_equal(block_view(t, "outer_first", 4), before[name])


def test_an_asynchronous_load_holds_its_blocks_until_released():
    leader = kvbm.Leader(4, 4, disk_blocks=4, disk_filter_disabled=True)
    blocks = _blocks(list(range(8)), 4)
    hashes = [b[0] for b in blocks]
    leader.offload(blocks)
    leader.take_disk_writes()
    for _ in range(2):
        leader.end_step()
    host, reads = leader.hold_onboard(hashes, "req")
    assert len(host) == 2 and reads == []
    for _ in range(4):
        leader.end_step()
    assert leader.counts()["held"] == 2, "held past the two steps until released"
    assert leader.release("req") is True
    assert leader.counts()["held"] == 0
    assert leader.release("req") is False


@pytest.mark.parametrize(
    "variable,value",
    [
        ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "1000000000000"),
        ("DYN_KVBM_DISK_CACHE_GB", "1000000000"),
        ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "100000000000000"),
    ],
)
def test_sizes_that_do_not_fit_the_machine_name_the_variable(tmp_path, variable, value):
    """Huge sizes used to pass validation and fail later in mmap or the disk store with no
    variable named."""
    env = {"DYN_KVBM_CPU_CACHE_GB": "0.01", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path), variable: value}
    config = kvbm.Config.from_env(env)
    with pytest.raises(kvbm.ConfigError, match=f"{variable}=.{value}.*do not fit"):
        KvbmWorker(config=config).register_kv_caches(make_caches("BLNHC", 2, 4, 4, 2, 8))
    assert list(tmp_path.iterdir()) == [], "nothing was created"


def test_the_type_stubs_name_exactly_the_native_api():
    """_kvbm.pyi is what editors and type checkers see: every public name of the native classes
    and functions is in it, and nothing it names is missing from the module."""
    import ast
    import os

    import kvbm._kvbm as native

    stub = ast.parse(open(os.path.join(os.path.dirname(kvbm.__file__), "_kvbm.pyi")).read())
    for node in stub.body:
        if isinstance(node, ast.ClassDef) and node.name in ("Leader", "Worker", "Config", "CopyHold"):
            declared = {n.name for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"}
            real = {n for n in dir(getattr(native, node.name)) if not n.startswith("__")}
            assert declared == real, (node.name, sorted(declared ^ real))
    functions = {n.name for n in stub.body if isinstance(n, ast.FunctionDef)}
    real = {n for n in dir(native) if callable(getattr(native, n)) and n[0].islower()}
    assert functions == real, sorted(functions ^ real)
