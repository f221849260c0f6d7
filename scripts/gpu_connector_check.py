"""The connector's worker side on real tensors: KV caches laid out as vLLM 0.33 lays them out
(one backing buffer, per-layer [B, H, N, C] views in LBNHC, vLLM's default, and BLNHC, what kvbm
asks for) and as older releases did (per-layer [2, B, N, H, D] tensors); torch CUDA tensors on a
GPU, numpy arrays in a dry run (KVBM_GPU_CHECK_DEVICE=emulated), numpy arrays over the simulated
CUDA driver's device memory as cuda:0 tensors (KVBM_GPU_CHECK_DEVICE=simulated: the worker's CUDA
path on kvbm-cuda-sim); registered with KvbmWorker, many blocks saved to the pinned host
pool and loaded back into other GPU blocks, some through the disk tier, every byte compared with
the tensors. Prints a summary line per layout and one JSON line. Run by gpu-check.sh."""

import json
import os
import sys
import tempfile
import time

import kvbm
from kvbm.testing import (
    KV_CACHE_LAYOUTS,
    CudaDevice,
    HostTensor,
    allocate_kv_cache,
    host_array,
    layout_strides,
    simulated_gpu_array,
)
from kvbm.worker import KvbmWorker

DEVICE = os.environ.get("KVBM_GPU_CHECK_DEVICE", "cuda")
LAYERS, HEADS, HEAD, BLOCK = 28, 8, 128, 16
BLOCKS = int(os.environ.get("KVBM_GPU_CHECK_CONNECTOR_BLOCKS", "1024" if DEVICE == "cuda" else "64"))
DISK = min(128, BLOCKS // 4)


def make(shape):
    if DEVICE == "cuda":
        import torch

        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
        return t
    import numpy as np

    simulated = DEVICE == "simulated"
    a = simulated_gpu_array(shape) if simulated else host_array(shape, huge_pages=True)
    a[...] = np.random.default_rng(len(shape)).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return HostTensor(a, device=CudaDevice(0) if simulated else "cpu")


def make_vllm(layout):
    """vLLM 0.33's allocation (vllm/v1/worker/utils.py, allocate_kv_cache): one int8 buffer,
    per-layer views as_strided in bytes, then viewed as bf16."""
    content = 2 * HEAD
    if DEVICE != "cuda":
        caches, raw = allocate_kv_cache(
            LAYERS, BLOCKS, HEADS, BLOCK, content, "uint16", layout, huge_pages=True, simulated_gpu=DEVICE == "simulated"
        )
        import numpy as np

        raw[...] = np.random.default_rng(9).integers(-128, 127, size=raw.shape, dtype=np.int8)
        return caches
    import torch

    order = KV_CACHE_LAYOUTS[layout]
    page = HEADS * BLOCK * content * 2
    fixed_block = LAYERS * page if order[0] == 1 else None
    planned = layout_strides((LAYERS, BLOCKS, HEADS, BLOCK, content * 2), order, (None, fixed_block, None, None, None))
    strides = layout_strides((LAYERS, BLOCKS, HEADS, BLOCK, content * 2), order, (planned[0], planned[1], None, None, None))
    raw = torch.empty(LAYERS * BLOCKS * page, dtype=torch.int8, device="cuda")
    raw.random_(-128, 127)
    view_5d = torch.as_strided(raw, (LAYERS, BLOCKS, HEADS, BLOCK, content * 2), strides)
    return {f"model.layers.{i}.self_attn.attn": view_5d[i].view(torch.bfloat16) for i in range(LAYERS)}


def block(t, kind, b):
    x = t if DEVICE == "cuda" else t.array
    return (x[:, b] if kind == "outer_first" else x[b]).clone() if DEVICE == "cuda" else (
        x[:, b] if kind == "outer_first" else x[b]).copy()


def equal(a, b):
    if DEVICE == "cuda":
        import torch

        return torch.equal(a, b)
    return (a == b).all()


def zero(t, kind, b):
    x = t if DEVICE == "cuda" else t.array
    if kind == "outer_first":
        x[:, b] = 0
    else:
        x[b] = 0


def sync():
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()


def check(kind):
    if kind in KV_CACHE_LAYOUTS:
        caches = make_vllm(kind)
    else:
        shape = (2, BLOCKS, BLOCK, HEADS, HEAD) if kind == "outer_first" else (BLOCKS, 2, BLOCK, HEADS, HEAD)
        caches = {f"model.layers.{i}.self_attn.attn": make(shape) for i in range(LAYERS)}
    sync()
    half = BLOCKS // 2
    with tempfile.TemporaryDirectory() as tmp:
        config = kvbm.Config.from_env(
            {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(BLOCKS), "DYN_KVBM_DISK_CACHE_DIR": tmp}
        )
        worker = KvbmWorker(host_blocks=BLOCKS, disk_blocks=DISK, config=config)
        worker.register_kv_caches(caches)
        w = worker.native
        assert w.wait_host_ready(600)
        ref = {n: [block(t, kind, b) for b in range(half)] for n, t in list(caches.items())[:4]}
        nbytes = half * w.bytes_per_block
        t0 = time.perf_counter()
        w.offload([(b, b) for b in range(half)], ["check"])
        w.wait_offloads()
        d2h = nbytes / (time.perf_counter() - t0) / 1e9
        # Into other GPU blocks (the upper half), after scribbling over them.
        for t in caches.values():
            for b in range(half, BLOCKS):
                zero(t, kind, b)
        sync()
        t0 = time.perf_counter()
        w.onboard([(b, half + b) for b in range(half)])
        ok = w.wait_onboards()
        h2d = nbytes / (time.perf_counter() - t0) / 1e9
        mismatches = sum(
            0 if equal(block(caches[n], kind, half + b), ref[n][b]) else 1 for n in ref for b in range(half)
        )
        # Through the disk tier: host -> disk, disk -> a staging host block -> GPU.
        writes = [(b, b, 1000 + b, []) for b in range(DISK)]
        t0 = time.perf_counter()
        w.disk_write(writes)
        w.wait_disk()
        disk_write = DISK * w.bytes_per_block / (time.perf_counter() - t0) / 1e9
        staging = [BLOCKS - 1 - b for b in range(DISK)]
        t0 = time.perf_counter()
        missed = w.disk_read([(b, staging[b], 1000 + b) for b in range(DISK)])
        disk_read = DISK * w.bytes_per_block / (time.perf_counter() - t0) / 1e9
        for t in caches.values():
            for b in range(half, half + DISK):
                zero(t, kind, b)
        sync()
        w.onboard([(staging[b], half + b) for b in range(DISK)])
        ok &= w.wait_onboards()
        disk_mismatches = sum(
            0 if equal(block(caches[n], kind, half + b), ref[n][b]) else 1 for n in ref for b in range(DISK)
        )
        failed = w.take_failed()
        worker.shutdown()
    return {
        "layout": kind,
        "copies_per_block": w.runs_per_block,
        "device": w.device_kind,
        "blocks": half,
        "bytes_per_block": w.bytes_per_block,
        "d2h_gbps": d2h,
        "h2d_gbps": h2d,
        "disk_write_gbps": disk_write,
        "disk_read_gbps": disk_read,
        "verified": bool(ok and mismatches == 0 and disk_mismatches == 0 and not missed and not failed),
        "mismatches": mismatches + disk_mismatches,
    }


def main():
    results = [check(kind) for kind in ("LBNHC", "BLNHC", "outer_first")]
    for r in results:
        print(
            f"connector worker {r['device']} {r['layout']}: {r['blocks']} blocks of {r['bytes_per_block']} bytes "
            f"({r['copies_per_block']} copies each), "
            f"D2H {r['d2h_gbps']:.2f} GB/s, H2D {r['h2d_gbps']:.2f} GB/s, disk write {r['disk_write_gbps']:.2f} GB/s, "
            f"disk read {r['disk_read_gbps']:.2f} GB/s, verified {r['verified']}"
        )
    summary = {
        "d2h_gbps": min(r["d2h_gbps"] for r in results),
        "h2d_gbps": min(r["h2d_gbps"] for r in results),
        "verified": all(r["verified"] for r in results),
        "device": results[0]["device"],
        "layouts": results,
    }
    print(json.dumps(summary))
    return 0 if summary["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
