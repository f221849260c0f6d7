"""The scripted vLLM worker against what it stands in for, without the router: its tokenization
against the ids the tokenizer fixtures recorded from vLLM 0.33's steps (tests/data/tokenizer/
*/expected.json, written by generate.py, whose vllm_chat_ids the worker's chat path calls: for
chats this checks the worker's plumbing around it), its KV events against vLLM's wire form and default
block hash (restated here from vllm/utils/hashing.py sha256 and vllm/v1/core/kv_cache_utils.py
hash_block_tokens), replay, and abort on disconnect.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import time

import pytest

from conftest import BLOCK_SIZE, MODEL_NAME, TOKENIZER_DIR, http_json, wait_until

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")
pytest.importorskip("transformers")

import fake_vllm_worker  # noqa: E402 (after the skips)

FIXTURES = TOKENIZER_DIR.parent
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def vllm_hash_chain(token_ids: list[int]) -> list[int]:
    """vLLM's default block hashes as ints: sha256 of the pickled (parent, tokens, None), the
    first parent being sha256 of the pickled seed "vllm-none-hash" (PYTHONHASHSEED unset), the
    low 64 bits big-endian."""
    def sha(obj) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent = sha("vllm-none-hash")
    out = []
    for i in range(len(token_ids) // BLOCK_SIZE):
        parent = sha((parent, tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


@pytest.mark.parametrize("model", ["chatml", "llama3", "parts"])
def test_tokenizes_as_vllm(model):
    path = FIXTURES / model
    if not (path / "expected.json").exists():
        pytest.skip(f"tokenizer fixture {path} is missing")
    expected = json.loads((path / "expected.json").read_text())
    tok = fake_vllm_worker.Tokenizer(str(path), expected["content_format"])
    for case in expected["prompts"]:
        assert tok.encode(case["prompt"], case["add_special_tokens"]) == case["ids"], case["name"]
    for case in expected["chats"]:
        assert tok.render_chat(case["request"]) == case["text"], case["name"]
        assert tok.encode_chat(case["request"]) == case["ids"], case["name"]
    for case in expected["errors"]:
        with pytest.raises(fake_vllm_worker.RequestError) as err:
            tok.encode_chat(case["request"])
        assert err.value.status == 400, case["name"]


@pytest.fixture
def subscriber(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ctx = zmq.Context.instance()
    sockets = []

    def connect(worker, kind=zmq.SUB):
        sock = ctx.socket(kind)
        sockets.append(sock)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"tcp://127.0.0.1:{worker.zmq_port}")
            # Wait until the subscription is in place: publish until one batch arrives.
            def arrived():
                http_json("POST", f"{worker.url}/reset_prefix_cache")
                return sock.poll(200)
            wait_until(arrived, "the worker's first batch on the subscriber")
            while sock.poll(200):
                sock.recv_multipart()
        else:
            sock.connect(f"tcp://127.0.0.1:{worker.replay_port}")
        return sock

    yield connect
    for s in sockets:
        s.close(linger=0)


def next_batch(sock) -> tuple[int, list, object]:
    assert sock.poll(10_000), "no KV event batch within 10 s"
    topic, seq, payload = sock.recv_multipart()
    assert topic == b"" and len(seq) == 8
    raw = msgspec.msgpack.decode(payload)
    typed = msgspec.msgpack.Decoder(fake_vllm_worker.KVEventBatch).decode(payload)
    return int.from_bytes(seq, "big"), raw, typed


def test_kv_events_are_vllms(start_workers, subscriber, tokenizer_dir):
    (worker,) = start_workers([7])
    sub = subscriber(worker)
    tok = fake_vllm_worker.Tokenizer(str(tokenizer_dir), "string")
    rng = random.Random(7)
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
    prompt = " ".join(rng.choice(words) for _ in range(120))
    ids = tok.encode(prompt, True)
    hashes = vllm_hash_chain(ids)
    assert len(hashes) >= 4

    worker.complete(prompt, max_tokens=1)
    seq, raw, batch = next_batch(sub)
    # EventBatch is array_like: [ts, events, data_parallel_rank]; events are maps tagged "type"
    # with vLLM's field order, defaults (None) omitted except the fields without a default.
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
    (event,) = raw[1]
    assert list(event) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium", "lora_name", "extra_keys", "group_idx"]
    assert event["type"] == "BlockStored" and event["medium"] == "GPU"
    assert event["block_hashes"] == hashes and event["parent_block_hash"] is None
    assert event["token_ids"] == ids[:len(hashes) * BLOCK_SIZE]
    assert event["extra_keys"] == [None] * len(hashes) and event["group_idx"] == 0

    # A prompt sharing the first two blocks: only the new blocks, parented on the second.
    other = ids[:2 * BLOCK_SIZE] + ids[2 * BLOCK_SIZE:][::-1]
    http_json("POST", f"{worker.url}/v1/completions",
              {"model": MODEL_NAME, "prompt": other, "max_tokens": 1})
    _, raw, _ = next_batch(sub)
    (event,) = raw[1]
    other_hashes = vllm_hash_chain(other)
    assert event["block_hashes"] == other_hashes[2:]
    assert event["parent_block_hash"] == hashes[1]

    # Eviction: CPU copies (one event per block, own parent), then GPU removals.
    evicted = worker.evict_gpu([hashes[0]])
    assert evicted == {"evicted_gpu": 1, "stored_cpu": 1}
    _, raw, _ = next_batch(sub)
    (stored,) = raw[1]
    assert (stored["type"], stored["medium"], stored["block_hashes"], stored["parent_block_hash"]) \
        == ("BlockStored", "CPU", [hashes[0]], None)
    assert stored["kv_cache_spec_kind"] == "full_attention"
    last_seq, raw, _ = next_batch(sub)
    assert raw[1] == [{"type": "BlockRemoved", "block_hashes": [hashes[0]], "medium": "GPU",
                       "group_idx": 0}]

    # Replay from the start: every batch again, then the end marker.
    replay = subscriber(worker, zmq.DEALER)
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while True:
        assert replay.poll(10_000)
        frames = replay.recv_multipart()
        if frames[2] == END_SEQ:
            break
        seqs.append(int.from_bytes(frames[2], "big"))
    assert seqs == list(range(last_seq + 1))


def test_client_disconnect_aborts(start_workers):
    import openai

    (worker,) = start_workers([3], output_tokens=400, step_delay_s=0.05)
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model=MODEL_NAME, prompt="hello", stream=True)
    next(iter(stream))
    assert worker.stats()["running"] == 1
    stream.close()
    started = time.monotonic()
    stats = wait_until(lambda: (s := worker.stats())["aborted"] == 1 and s["running"] == 0 and s,
                       "the worker to count the request aborted")
    assert stats["completed"] == 0 and time.monotonic() - started < 20
