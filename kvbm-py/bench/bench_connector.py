"""kvbm's connector, measured from Python.

1. The leader's cost per scheduler step with 256 running requests (decode steps: each request
   gains a token per step, a block completes every 16 steps), timing only kvbm's calls
   (build_connector_meta, update_connector_output, take_events), and build_connector_meta alone.
   Target: build_connector_meta under 1 ms p99, with block completions staggered and aligned.
2. The worker's copy throughput through Python (KvbmWorker.save / load on a KV cache in host
   memory laid out as vLLM 0.33 lays it out, `--layout`, LBNHC by default, or the older
   per-layer `outer_first` tensors; emulated device), next to `kvbm-bench offload` (the Rust
   bench) on the same shape and layout in the same run, and the Rust bench's memcpy yardstick.
   Both run kvbm-core's copy engine. Target: at least 0.95x.
3. With `--disk`: the worker's disk tier through Python (host pool -> cache file and back,
   zero-copy through the registered pinned pool) next to `kvbm-bench disk` (kvbm-disk's store on
   its own registered buffer) with the same block size and count, in the same run. Target: at
   least 0.9x.

Run from the repository root after `pip install ./kvbm-py` and
`cargo build --release -p kvbm-bench`:

    .venv/bin/python kvbm-py/bench/bench_connector.py [--blocks 512] [--layout BLNHC] [--disk DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace as NS

import numpy as np

os.environ.setdefault("KVBM_DEVICE", "emulated")

from kvbm.leader import KvbmLeader  # noqa: E402
from kvbm.testing import KV_CACHE_LAYOUTS, HostTensor, allocate_kv_cache, host_array  # noqa: E402
from kvbm.worker import KvbmWorker  # noqa: E402


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_leader(requests=256, prompt_tokens=2048, steps=320, block=16, aligned=False):
    """Per-step cost of kvbm's scheduler-side calls. Prompt lengths differ by a few tokens so that
    block completions spread over the steps as in a real batch; with ``aligned`` every request
    completes a block in the same step (the worst case: 256 offloads in one step)."""
    leader = KvbmLeader(block, host_blocks=requests * (prompt_tokens + steps) // block + 1024)
    reqs = []
    for i in range(requests):
        length = prompt_tokens + (0 if aligned else i % block)
        tokens = list(range(i * 100_000, i * 100_000 + length))
        r = NS(request_id=f"r{i}", prompt_token_ids=tokens, all_token_ids=list(tokens), num_tokens=len(tokens),
               cache_salt=None, lora_request=None)
        leader.get_num_new_matched_tokens(r, 0)
        ids = list(range(i * 200, i * 200 + 200))
        leader.update_state_after_alloc(r, NS(get_block_ids=lambda ids=ids: (ids,)), 0)
        reqs.append((r, ids))
    # The prefill step (not timed): every prompt block is offloaded.
    new = [NS(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, block_ids=(ids,), num_computed_tokens=0)
           for r, ids in reqs]
    leader.build_connector_meta(NS(scheduled_new_reqs=new, scheduled_cached_reqs=None,
                                   num_scheduled_tokens={r.request_id: r.num_tokens for r, _ in reqs}))
    leader.take_events()
    per_step, build_only, saved = [], [], 0
    empty_output = NS(finished_sending=None, finished_recving=None, invalid_block_ids=None)
    for step in range(steps):
        # The scheduler's side of the step (not timed): one token each.
        computed = []
        for r, _ in reqs:
            computed.append(r.num_tokens)
            r.all_token_ids.append(step)
            r.num_tokens += 1
        cached = NS(req_ids=[r.request_id for r, _ in reqs], resumed_req_ids=(),
                    new_block_ids=[None] * len(reqs), num_computed_tokens=computed)
        out = NS(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                 num_scheduled_tokens={r.request_id: 1 for r, _ in reqs})
        t = time.perf_counter()
        meta = leader.build_connector_meta(out)
        built = time.perf_counter()
        leader.update_connector_output(empty_output)
        leader.take_events()
        per_step.append((time.perf_counter() - t) * 1e3)
        build_only.append((built - t) * 1e3)
        saved += sum(len(p) for _, p in meta.offloads)
    return {
        "requests": requests,
        "steps": steps,
        "blocks_saved": saved,
        "step_ms_p50": statistics.median(per_step),
        "step_ms_p99": percentile(per_step, 0.99),
        "step_ms_max": max(per_step),
        "build_ms_p50": statistics.median(build_only),
        "build_ms_p99": percentile(build_only, 0.99),
        "build_ms_max": max(build_only),
    }


def bench_worker(blocks, layout="LBNHC", layers=28, heads=8, head_size=128, block=16, batch=64, rounds=3):
    # Stand-in GPU memory mapped with huge pages, as the emulated device maps its own (with 4 KiB
    # pages this VM makes scattered writes several times slower: that would measure the stand-in).
    rng = np.random.default_rng(1)
    if layout in KV_CACHE_LAYOUTS:
        caches, raw = allocate_kv_cache(layers, blocks, heads, block, 2 * head_size, "uint16", layout, huge_pages=True)
        raw[...] = rng.integers(-128, 127, size=raw.shape, dtype=np.int8)

        def block_of(a, b):
            return a[b]
    else:
        shape = (2, blocks, block, heads, head_size)
        caches = {f"layer.{i}": HostTensor(host_array(shape, huge_pages=True)) for i in range(layers)}
        for t in caches.values():
            t.array[...] = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)

        def block_of(a, b):
            return a[:, b]
    probe = list(caches)[5]
    reference = block_of(caches[probe].array, blocks // 2).copy()
    worker = KvbmWorker(host_blocks=blocks)
    worker.register_kv_caches(caches)
    w = worker.native
    assert w.wait_host_ready(600), "host memory not pinned"
    bytes_per_block = w.bytes_per_block
    saves, loads = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        for start in range(0, blocks, batch):
            w.offload([(b, b) for b in range(start, min(blocks, start + batch))], [])
        w.wait_offloads()
        saves.append(blocks * bytes_per_block / (time.perf_counter() - t) / 1e9)
        for t_ in caches.values():
            block_of(t_.array, blocks // 2)[...] = 0
        t = time.perf_counter()
        for start in range(0, blocks, batch):
            # One load per step, as the connector issues them (blocks moved by one).
            w.onboard([(b, (b + 1) % blocks) for b in range(start, min(blocks, start + batch))])
        w.wait_onboards()
        loads.append(blocks * bytes_per_block / (time.perf_counter() - t) / 1e9)
        assert np.array_equal(block_of(caches[probe].array, (blocks // 2 + 1) % blocks), reference), "loaded bytes differ"
        # Put blocks back where they were for the next round.
        for start in range(0, blocks, batch):
            w.onboard([(b, b) for b in range(start, min(blocks, start + batch))])
        w.wait_onboards()
    return {
        "layout": layout,
        "copies_per_block": w.runs_per_block,
        "blocks": blocks,
        "bytes_per_block": bytes_per_block,
        "batch": batch,
        "d2h_gbps": statistics.median(saves),
        "h2d_gbps": statistics.median(loads),
    }


def bench_worker_disk(blocks, directory, layout="BLNHC", layers=28, heads=8, head_size=128, block=16, rounds=3):
    """The connector worker's disk tier: every host block written to the cache file, then read
    back, through the native worker (the same calls the step plan makes)."""
    import kvbm

    rng = np.random.default_rng(2)
    caches, raw = allocate_kv_cache(layers, blocks, heads, block, 2 * head_size, "uint16", layout, huge_pages=True)
    raw[...] = rng.integers(-128, 127, size=raw.shape, dtype=np.int8)
    config = kvbm.Config.from_env({"DYN_KVBM_DISK_CACHE_DIR": directory, "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(blocks),
                                   "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(blocks)})
    worker = KvbmWorker(host_blocks=blocks, disk_blocks=blocks, config=config)
    worker.register_kv_caches(caches)
    w = worker.native
    assert w.wait_host_ready(600), "host memory not pinned"
    deadline = time.time() + 60
    while w.stats()["disk_registered"] is None and time.time() < deadline:
        time.sleep(0.05)
    w.offload([(b, b) for b in range(blocks)], [])
    w.wait_offloads()
    probe = raw.reshape(blocks, -1)[blocks // 2].copy() if layout.startswith("B") else None
    bytes_per_block = w.bytes_per_block
    writes, reads = [], []
    for r in range(rounds):
        t = time.perf_counter()
        w.disk_write([(b, b, 1000 * r + b, b"") for b in range(blocks)])
        w.wait_disk()
        writes.append(blocks * bytes_per_block / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        missed = w.disk_read([(b, b, 1000 * r + b) for b in range(blocks)])
        reads.append(blocks * bytes_per_block / (time.perf_counter() - t) / 1e9)
        assert missed == [], f"{len(missed)} blocks missed"
    if probe is not None:
        raw.reshape(blocks, -1)[blocks // 2 + 1] = 0
        w.onboard([(blocks // 2, blocks // 2 + 1)])
        w.wait_onboards()
        assert np.array_equal(raw.reshape(blocks, -1)[blocks // 2 + 1], probe), "bytes read back differ"
    stats = w.stats()
    worker.shutdown()
    return {
        "blocks": blocks,
        "bytes_per_block": bytes_per_block,
        "fixed_buffers": stats["disk_registered"],
        "write_gbps": statistics.median(writes),
        "read_gbps": statistics.median(reads),
        "write_all": writes,
        "read_all": reads,
    }


def bench_rust_disk(blocks, bytes_per_block, directory, repo):
    exe = os.path.join(repo, "target", "release", "kvbm-bench")
    if not os.path.exists(exe):
        return None
    out = subprocess.run([exe, "disk", "--blocks", str(blocks), "--block-bytes", str(bytes_per_block),
                          "--dir", directory, "--iterations", "3", "--no-fio", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_rust(blocks, layout, repo, engine="manager"):
    exe = os.path.join(repo, "target", "release", "kvbm-bench")
    if not os.path.exists(exe):
        return None
    flag = layout.lower().replace("_", "-")
    # The copy engine's default limits on both sides (16 blocks a batch, 4 batches in flight).
    out = subprocess.run([exe, "offload", "--blocks", str(blocks), "--layout", flag,
                          "--engine", engine, "--json"],
                         capture_output=True, text=True,
                         check=True, env=dict(os.environ, KVBM_DEVICE="emulated"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--layout", default="LBNHC", choices=sorted(KV_CACHE_LAYOUTS) + ["outer_first"])
    parser.add_argument("--engine", default="split", choices=["split", "manager"],
                        help="kvbm-bench offload's engine to compare with (split: the leader and worker the "
                             "connector runs; manager: the block manager)")
    parser.add_argument("--disk", metavar="DIR", help="also measure the disk tier, with cache files in DIR")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    leader = bench_leader()
    aligned = bench_leader(aligned=True)
    for name, r in (("staggered", leader), ("aligned", aligned)):
        print(f"leader, {r['requests']} running requests, {r['steps']} decode steps, block completions "
              f"{name} ({r['blocks_saved']} blocks offloaded): per step p50 {r['step_ms_p50']:.3f} ms, "
              f"p99 {r['step_ms_p99']:.3f} ms, max {r['step_ms_max']:.3f} ms; build_connector_meta alone "
              f"p50 {r['build_ms_p50']:.3f} ms, p99 {r['build_ms_p99']:.3f} ms, max {r['build_ms_max']:.3f} ms "
              "(target < 1 ms p99)")
    # Alternate Rust and Python so that the machine's noise hits both.
    rust_first = bench_rust(args.blocks, args.layout, repo, args.engine)
    py = bench_worker(args.blocks, args.layout)
    rust_second = bench_rust(args.blocks, args.layout, repo, args.engine)
    result = {"leader": leader, "leader_aligned": aligned, "python_worker": py}
    if rust_first and rust_second:
        rust = {k: statistics.mean([rust_first[k], rust_second[k]]) for k in ("d2h_gbps", "h2d_gbps", "memcpy_gbps")}
        result["rust_bench"] = rust
        for d in ("d2h", "h2d"):
            ratio = py[f"{d}_gbps"] / rust[f"{d}_gbps"]
            result[f"python_vs_rust_{d}"] = ratio
        print(f"worker copies, {args.layout}, {args.blocks} blocks of {py['bytes_per_block']} bytes "
              f"({py['copies_per_block']} copies each), {py['batch']} blocks per call:")
        print(f"  python  d2h {py['d2h_gbps']:.2f} GB/s  h2d {py['h2d_gbps']:.2f} GB/s")
        print(f"  rust ({args.engine}) d2h {rust['d2h_gbps']:.2f} GB/s  h2d {rust['h2d_gbps']:.2f} GB/s  "
              f"(memcpy {rust['memcpy_gbps']:.2f})")
        print(f"  python / rust: d2h {result['python_vs_rust_d2h']:.2f}x  h2d {result['python_vs_rust_h2d']:.2f}x (target >= 0.95)")
    else:
        print(f"worker copies: python d2h {py['d2h_gbps']:.2f} GB/s h2d {py['h2d_gbps']:.2f} GB/s "
              "(build kvbm-bench in release for the side-by-side)")
    if args.disk:
        import tempfile

        with tempfile.TemporaryDirectory(dir=args.disk) as d1, tempfile.TemporaryDirectory(dir=args.disk) as d2:
            # Alternate again: Rust, Python, Rust.
            probe = bench_worker_disk(8, d1)  # the block size the worker uses
            size = probe["bytes_per_block"]
            first = bench_rust_disk(args.blocks, size, d2, repo)
            disk = bench_worker_disk(args.blocks, d1)
            second = bench_rust_disk(args.blocks, size, d2, repo)
        result["python_worker_disk"] = disk
        print(f"disk tier, {args.blocks} blocks of {size} bytes (fixed buffers: {disk['fixed_buffers']}):")
        print(f"  python worker  write {disk['write_gbps']:.2f} GB/s  read {disk['read_gbps']:.2f} GB/s")
        if first and second:
            rust = {k: statistics.mean([first[k], second[k]]) for k in ("write_gbps", "read_gbps")}
            result["rust_disk"] = rust
            for d in ("write", "read"):
                result[f"python_vs_rust_disk_{d}"] = disk[f"{d}_gbps"] / rust[f"{d}_gbps"]
            print(f"  kvbm-bench disk write {rust['write_gbps']:.2f} GB/s  read {rust['read_gbps']:.2f} GB/s")
            print(f"  python / rust: write {result['python_vs_rust_disk_write']:.2f}x  "
                  f"read {result['python_vs_rust_disk_read']:.2f}x (target >= 0.90)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
