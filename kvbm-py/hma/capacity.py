"""KV capacity vLLM 0.33's own planner gives a hybrid model with HMA on and off.

Run: PYTHONPATH=.vllm-0.33:kvbm-py/hma .venv-vllm/bin/python kvbm-py/hma/capacity.py

HMA off is what vLLM plans when the KV connector is not a ``SupportsHMA`` (kvbm
before issue 24): ``disable_hybrid_kv_cache_manager`` makes ``get_kv_cache_groups``
turn every sliding-window layer into a full-attention one. Blocks come from
``get_kv_cache_config_from_groups``; "vLLM tokens" and "concurrency" are
``get_kv_cache_capacity`` (the "KV cache size: N tokens" line vLLM logs), which counts
a request at ``max_model_len`` in every group (a sliding group needs only its window
plus the in-flight tokens, ``SlidingWindowSpec.max_memory_usage_bytes``).
"""

from __future__ import annotations

import sys

import vllm033 as v

GiB = 1 << 30


def rows(memories_gib=(40, 10), max_model_len=131072, max_num_batched_tokens=8192):
    out = []
    for shape in (v.GPT_OSS_20B, v.GEMMA3_12B):
        for mem in memories_gib:
            res = {}
            for hma in (True, False):
                p = v.plan(
                    shape,
                    mem * GiB,
                    hma=hma,
                    max_model_len=max_model_len,
                    max_num_batched_tokens=max_num_batched_tokens,
                )
                tokens, conc = p.capacity()
                res[hma] = (p, tokens, conc)
            p_on, t_on, c_on = res[True]
            p_off, t_off, c_off = res[False]
            out.append(
                (
                    shape.name,
                    mem,
                    len(p_on.groups),
                    p_on.kv_cache_config.num_blocks,
                    t_on,
                    c_on,
                    p_off.kv_cache_config.num_blocks,
                    t_off,
                    c_off,
                )
            )
    return out


def main() -> None:
    max_model_len = 131072
    print(
        "| model | memory | groups (HMA on) | blocks on | vLLM tokens on | concurrency on "
        "| blocks off | vLLM tokens off | concurrency off | on / off |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, mem, ngroups, b_on, t_on, c_on, b_off, t_off, c_off in rows(
        max_model_len=max_model_len
    ):
        print(
            f"| {name} | {mem} GiB | {ngroups} | {b_on:,} | {t_on:,} | {c_on:.2f} "
            f"| {b_off:,} | {t_off:,} | {c_off:.2f} | {t_on / t_off:.2f}x |"
        )
    print()
    print(
        f"block size 16 tokens, bf16 KV, max_model_len {max_model_len:,}, "
        "max_num_batched_tokens 8192, layout LBNHC (FlashAttention). Command: "
        "PYTHONPATH=.vllm-0.33:kvbm-py/hma .venv-vllm/bin/python kvbm-py/hma/capacity.py",
        file=sys.stdout,
    )


if __name__ == "__main__":
    main()
