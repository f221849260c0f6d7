"""kvbm's cost and benefit inside a real `vllm serve` (vLLM's CPU build), measured, not asserted.

    .venv-vllm/bin/python kvbm-py/e2e/bench_vllm.py [--rounds 5] [--out results.json]

Part 1, overhead per step: three servers of the tiny model run side by side (no connector; a
connector that does nothing, `noop_connector.py`, the yardstick for vLLM's connector path
itself; kvbm's DynamoConnector with a host tier) and are measured in turn, round after round,
so that the machine's noise falls on all three alike: decode step time (vLLM's own
`vllm:inter_token_latency_seconds` over one request generating 96 tokens; the client's view,
(last token - first token) / 95, is reported too) and the time to the first token of a short
prompt. Reported: medians per
server and kvbm's overhead against the do-nothing connector.

Part 2, benefit: a random model large enough that prefill dominates on CPU (8 layers, hidden
1024, made locally); TTFT of a prompt that shares 90% of its tokens with one computed before,
(a) recomputed (a server without connector and without prefix caching), (b) loaded from kvbm's
host tier (the device cache reset in between), (c) loaded from kvbm's disk tier (the server
restarted on the same disk directory, so host memory and the device cache are empty; prompts
with the same documents and tails never computed before).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from conftest import CONNECTOR, Servers, document, metric, question  # noqa: E402

NOOP = {"kv_connector": "NoopConnector", "kv_role": "kv_both", "kv_connector_module_path": "noop_connector"}


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def make_model(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(out), *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def overhead(work: Path, rounds: int) -> dict:
    model = make_model(work / "tiny")
    servers = Servers(model, work)
    env = {"PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "256"}
    started = {
        "none": servers.start("none", connector=False, env=env),
        "noop": servers.start("noop", connector=NOOP, env=env),
        "kvbm": servers.start("kvbm", connector=CONNECTOR, env=env),
    }
    try:
        for s in started.values():
            s.wait_ready()
        itl = {k: [] for k in started}
        server_itl = {k: [] for k in started}
        ttft = {k: [] for k in started}
        for r in range(rounds):
            for name, s in started.items():
                before = s.metrics()
                first, last = s.stream(document(500 + r, words=40) + question(r), 96)
                after = s.metrics()
                itl[name].append((last - first) / 95)
                # The server's own inter-token latency (vllm:inter_token_latency_seconds), free
                # of how the client's reads bunch tokens.
                d_sum = metric(after, "vllm:inter_token_latency_seconds_sum") - metric(
                    before, "vllm:inter_token_latency_seconds_sum")
                d_count = metric(after, "vllm:inter_token_latency_seconds_count") - metric(
                    before, "vllm:inter_token_latency_seconds_count")
                server_itl[name].append(d_sum / d_count if d_count else float("nan"))
                first, _ = s.stream(document(700 + r, words=60), 1)
                ttft[name].append(first)
        out = {name: {"decode_step_ms": 1e3 * med(server_itl[name]),
                      "decode_step_ms_client": 1e3 * med(itl[name]),
                      "ttft_short_ms": 1e3 * med(ttft[name]),
                      "decode_step_ms_per_round": [round(1e3 * x, 3) for x in server_itl[name]]}
               for name in started}
        out["kvbm_vs_noop_decode"] = out["kvbm"]["decode_step_ms"] / out["noop"]["decode_step_ms"]
        out["noop_vs_none_decode"] = out["noop"]["decode_step_ms"] / out["none"]["decode_step_ms"]
        return out
    finally:
        for s in started.values():
            s.stop()


def benefit(work: Path, prompts: int) -> dict:
    model = make_model(work / "big", "--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "4",
                       "--init-std", "0.05")
    servers = Servers(model, work)
    disk = work / "disk"
    disk.mkdir()
    env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "512", "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "1024",
           "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "1", "DYN_KVBM_DISK_CACHE_DIR": str(disk)}
    common = dict(gpu_blocks=80, max_model_len=2048)
    # About 1,000 tokens: 90% a shared document, 10% the question.
    firsts = [document(900 + i, words=500) + question(0) for i in range(prompts)]
    seconds = [document(900 + i, words=500) + question(1) + " " + document(1900 + i, words=55) for i in range(prompts)]
    # After the restart: the same documents, tails that were never computed.
    thirds = [document(900 + i, words=500) + question(2) + " " + document(2900 + i, words=55) for i in range(prompts)]
    res = {"recompute": [], "host": [], "disk": [], "first_compute": []}
    ref = servers.start("recompute", connector=False, prefix_caching=False, **common).wait_ready()
    try:
        ref.stream(firsts[0], 1)  # warm-up
        for p in seconds:
            res["recompute"].append(ref.stream(p, 1)[0])
    finally:
        ref.stop()
    s = servers.start("kvbm", connector=True, env=env, **common).wait_ready()
    try:
        s.stream(document(5000, words=100), 1)  # warm-up
        for p in firsts:
            res["first_compute"].append(s.stream(p, 1)[0])
        time.sleep(1.0)  # offloads and disk writes land
        for p in seconds:
            s.reset_device_cache()
            res["host"].append(s.stream(p, 1)[0])
    finally:
        s.stop()
    s2 = servers.start("kvbm-restarted", connector=True, env=env, **common).wait_ready()
    try:
        s2.stream(document(5001, words=100), 1)  # warm-up
        for p in thirds:
            res["disk"].append(s2.stream(p, 1)[0])
        kv = s2.metrics()
    finally:
        s2.stop()
    out = {k: {"ttft_ms_median": 1e3 * med(v), "ttft_ms": [round(1e3 * x, 1) for x in v]} for k, v in res.items()}
    out["disk_hits_tokens"] = metric(kv, "vllm:prompt_tokens_cached_by_source_total", source="disk")
    out["speedup_host"] = out["recompute"]["ttft_ms_median"] / out["host"]["ttft_ms_median"]
    out["speedup_disk"] = out["recompute"]["ttft_ms_median"] / out["disk"]["ttft_ms_median"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--only", choices=["overhead", "benefit"])
    p.add_argument("--out")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvbm-bench-vllm-") as d:
        work = Path(d)
        if args.only in (None, "overhead"):
            (work / "o").mkdir()
            results["overhead"] = overhead(work / "o", args.rounds)
            print(json.dumps(results["overhead"], indent=2), flush=True)
        if args.only in (None, "benefit"):
            (work / "b").mkdir()
            results["benefit"] = benefit(work / "b", args.prompts)
            print(json.dumps(results["benefit"], indent=2), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
