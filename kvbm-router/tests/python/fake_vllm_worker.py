"""A scripted stand-in for one `vllm serve` process (vLLM 0.33), for the router's end-to-end tests.

It owns what a router sees of a vLLM worker, and nothing else:

- the OpenAI-compatible HTTP server (GET /v1/models, POST /v1/completions and
  /v1/chat/completions, streaming and not, POST /tokenize, GET /health), tokenizing as vLLM
  does with the model directory's own tokenizer;
- the KV event stream, encoded and published as vLLM publishes it (msgspec structs of
  vllm/distributed/kv_events.py on a ZMQ PUB socket, with the ROUTER replay socket), hashed with
  vLLM's default block hash (sha256 over pickled (parent, tokens, extra keys), as ints).

It does not run a model: each request "computes" its prompt (the prompt's full blocks become held
on the GPU and are published, the blocks already held are not), then yields a fixed, per-worker
sequence of output tokens, one per step, `--step-delay-s` apart, so a test can cancel mid-stream.
A client that goes away (EOF on the socket, or a failed write) aborts the request, as vLLM's
`with_cancellation` / StreamingResponse disconnect handling does.

Test controls (not vLLM's): GET /stats; POST /evict_gpu (offload to the CPU tier, then drop from
the GPU, as vLLM's offloading connector and block pool report it); POST /fail {"mode": M} with M
"close" (drop each generate request's connection unanswered, as a worker dying before its first
byte), "unavailable" (answer 503), "prefill" (send a stream's headers, then drop it before its first
event) or "midstream" (drop a streamed answer after two steps), and
{"mode": null} to serve again. POST /reset_prefix_cache is vLLM's own (AllBlocksCleared).

Run: `python fake_vllm_worker.py --worker-id 1 --http-port 0 --zmq-port 0 --model-path DIR`;
the first line on stdout is one JSON object with the bound ports.

Every behaviour copied from vLLM names its source (paths relative to the `vllm` package of
vLLM 0.33). Where the fake is simpler than vLLM, the comment says so.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import pickle
import queue
import select
import socket
import sys
import threading
import time
import uuid
from collections import deque
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Union

import msgspec
import zmq

# ---------------------------------------------------------------------------------------------
# KV events: mirrors of vllm/distributed/kv_events.py (same class names, field order, defaults
# and msgspec options; msgspec encodes by these, so the bytes on the wire are vLLM's).
# ---------------------------------------------------------------------------------------------

# vllm/v1/core/kv_cache_utils.py: `ExternalBlockHash: TypeAlias = bytes | int`.
ExternalBlockHash = Union[bytes, int]

MEDIUM_GPU = "GPU"  # vllm/distributed/kv_events.py MEDIUM_GPU
MEDIUM_CPU = "CPU"  # vllm/distributed/kv_events.py MEDIUM_CPU


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vllm/distributed/kv_events.py EventBatch: `[ts, events, data_parallel_rank]`."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vllm/distributed/kv_events.py KVCacheEvent: maps tagged `"type": "<ClassName>"`."""


class BlockStored(KVCacheEvent):
    """vllm/distributed/kv_events.py BlockStored (fields in vLLM's order)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """vllm/distributed/kv_events.py BlockRemoved."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """vllm/distributed/kv_events.py AllBlocksCleared."""


class KVEventBatch(EventBatch):
    """vllm/distributed/kv_events.py KVEventBatch."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---------------------------------------------------------------------------------------------
# Block hashes: vLLM's defaults (prefix_caching_hash_algo "sha256" in vllm/config/cache.py,
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 in vllm/envs.py).
# ---------------------------------------------------------------------------------------------


def sha256(value: Any) -> bytes:
    """vllm/utils/hashing.py sha256: SHA-256 of the pickled object (highest protocol)."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """vllm/v1/core/kv_cache_utils.py init_none_hash + resolve_none_hash_seed: for a
    cryptographic hash the seed is PYTHONHASHSEED if set, else the fixed "vllm-none-hash"."""
    seed = os.getenv("PYTHONHASHSEED")
    return sha256(seed if seed is not None else "vllm-none-hash")


NONE_HASH = none_hash()


def hash_block_tokens(parent: bytes | None, tokens: list[int], extra_keys: tuple | None) -> bytes:
    """vllm/v1/core/kv_cache_utils.py hash_block_tokens: hash of (parent or NONE_HASH,
    tuple(tokens), extra_keys)."""
    if not parent:
        parent = NONE_HASH
    return sha256((parent, tuple(tokens), extra_keys))


def external_hash(block_hash: bytes) -> int:
    """vllm/v1/core/kv_cache_utils.py maybe_convert_block_hash with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (the default): the low 64 bits, big-endian."""
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


def block_extra_keys(block_index: int, lora: tuple[str, str] | None,
                     cache_salt: str | None) -> tuple | None:
    """vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys for a text request: the
    LoRA key ("lora", name, path) on every block, then ("cache_salt", salt) on the first block
    only; None when there are none."""
    keys: list[tuple] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(keys: tuple | None) -> list | None:
    """vllm/v1/core/kv_cache_utils.py to_event_extra_keys for one block: untagged, the LoRA name
    and the cache salt bare (key[1])."""
    return None if keys is None else [key[1] for key in keys]


def request_block_hashes(token_ids: list[int], block_size: int,
                         lora: tuple[str, str] | None = None,
                         cache_salt: str | None = None) -> list[tuple[bytes, tuple | None]]:
    """vllm/v1/core/kv_cache_utils.py get_request_block_hasher: one chained hash per full block,
    with its extra keys. A plain text request (no LoRA, multimodal input, cache salt or prompt
    embeddings) has none: generate_block_hash_extra_keys returns None."""
    hashes: list[tuple[bytes, tuple | None]] = []
    parent: bytes | None = None
    for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        extra = block_extra_keys(i, lora, cache_salt)
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append((parent, extra))
    return hashes


# ---------------------------------------------------------------------------------------------
# The publisher: vllm/distributed/kv_events.py ZmqEventPublisher.
# ---------------------------------------------------------------------------------------------


class ZmqEventPublisher:
    """One thread owns both sockets (ZMQ sockets are not thread-safe), as in vLLM's
    ZmqEventPublisher._publisher_thread: batches come through a bounded queue, each is sent as
    (topic, 8-byte big-endian sequence number, msgpack payload) and kept in a replay buffer; the
    ROUTER socket answers a request for `start_seq` with every buffered batch from there, then
    the end marker (seq -1, empty payload), as _service_replay does."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    BUFFER_STEPS_MAX = 10_000  # vLLM's default buffer_steps
    QUEUE_MAX = 100_000  # vLLM's default max_queue_size
    HWM = 100_000  # vLLM's default hwm

    def __init__(self, host: str, pub_port: int, replay_port: int | None, rank: int, topic: str):
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.HWM)
        self._pub.bind(f"tcp://{host}:{pub_port}")
        self.pub_port = _bound_port(self._pub)
        self._replay = None
        self.replay_port = None
        if replay_port is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (self.BUFFER_STEPS_MAX + 1))
            self._replay.bind(f"tcp://{host}:{replay_port}")
            self.replay_port = _bound_port(self._replay)
        self._rank = rank
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=self.QUEUE_MAX)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.BUFFER_STEPS_MAX)
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self.published = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="zmq-publisher")
        self._thread.start()

    def publish(self, events: list, timeout_s: float = 10.0) -> None:
        """Queues one batch (vllm/v1/core/sched/scheduler.py update_from_output builds
        `KVEventBatch(ts=time.time(), events=events)` per step; EventPublisher.publish stamps
        the data-parallel rank) and waits until it is on the wire, so that a caller answering
        after this returns has published first."""
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
        sent = threading.Event()
        self._queue.put((batch, sent), timeout=timeout_s)
        if not sent.wait(timeout_s):
            raise RuntimeError("KV event publisher did not send within the deadline")

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while self._running:
            if self._replay is not None and self._replay.poll(0):
                self._service_replay()
            try:
                batch, sent = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            seq = next(self._seq)
            payload = self._encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.published += 1
            sent.set()

    def _service_replay(self) -> None:
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            return
        client_id, _, start_seq_bytes = frame
        start_seq = int.from_bytes(start_seq_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client_id, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client_id, b"", b"", self.END_SEQ, b""))


def _bound_port(sock: zmq.Socket) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return int(endpoint.rsplit(":", 1)[1])


# ---------------------------------------------------------------------------------------------
# The engine's block holdings (a prefix cache without capacity limits).
# ---------------------------------------------------------------------------------------------


class HeldBlock(msgspec.Struct):
    parent: bytes | None
    token_ids: list[int]
    lora_name: str | None = None
    extra_keys: tuple | None = None


class BlockHoldings:
    """Which blocks the worker holds on its GPU and in its CPU (offload) tier, by vLLM block hash,
    in the order they were stored. Callers hold `Worker.lock`."""

    def __init__(self) -> None:
        self.gpu: dict[bytes, HeldBlock] = {}
        self.cpu: dict[bytes, HeldBlock] = {}


# ---------------------------------------------------------------------------------------------
# Tokenization, as vLLM's renderer does it for an HF tokenizer.
# ---------------------------------------------------------------------------------------------


class RequestError(Exception):
    """An error answered in vLLM's shape (vllm/entrypoints/serve/engine/protocol.py
    ErrorResponse/ErrorInfo, built by vllm/entrypoints/serve/exception_handling/error_response.py
    create_error_response)."""

    def __init__(self, status: HTTPStatus, message: str, err_type: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict:
        return {
            "error": {
                "message": str(self),
                "type": self.err_type,
                "param": self.param,
                "code": int(self.status),
            }
        }


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError(HTTPStatus.BAD_REQUEST, message, "BadRequestError", param)


def _chat_reference():
    """The one reading of vLLM 0.33's chat steps in this repository: `vllm_chat_ids` of the
    tokenizer fixtures' generator (tests/data/tokenizer/generate.py), which the fixtures' expected
    ids come from. The fake renders and tokenizes chats with it rather than with a second copy."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / "generate.py"
    spec = importlib.util.spec_from_file_location("kvbm_tokenizer_fixture_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Tokenizer:
    def __init__(self, model_path: str, content_format: str):
        # vLLM loads the HF tokenizer with AutoTokenizer (vllm/tokenizers/hf.py).
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.content_format = content_format
        self._reference = _chat_reference()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """vllm/renderers/base.py _tokenize_prompt: `tokenizer(text, **kwargs)["input_ids"]` with
        TokenizeParams.get_encode_kwargs (vllm/renderers/params.py): add_special_tokens from the
        request, truncation only past max_model_len (not modelled: prompts here are short)."""
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _chat(self, body: dict) -> tuple[str, list[int]]:
        """The chat template's text and its ids, as vLLM renders and tokenizes a chat request for
        an HF tokenizer (vllm/entrypoints/openai/chat_completion/protocol.py build_chat_params,
        vllm/renderers/online_renderer.py preprocess_chat, vllm/renderers/hf.py
        render_messages_async and safe_apply_chat_template, apply_chat_template(tokenize=False),
        then vllm/renderers/base.py _tokenize_prompt with the request's add_special_tokens,
        default False): see generate.py vllm_chat_ids, step by step. What vLLM refuses, or a
        template that raises, is a 400 with the reason."""
        if body.get("chat_template") is not None:
            # vllm/renderers/online_renderer.py validate_chat_template: a request's own template
            # needs --trust-request-chat-template, which the fake never has.
            raise bad_request("Chat template is passed with request, but "
                              "--trust-request-chat-template is not set. Refused request "
                              "with untrusted chat template.", "chat_template")
        if "messages" not in body:
            raise bad_request("messages is required", "messages")
        ref = self._reference
        try:
            return ref.vllm_chat_ids(self.tok, body, self.content_format)
        except (ref.BadRequest, ref.TemplateFailed) as e:
            raise bad_request(str(e)) from e

    def render_chat(self, body: dict) -> str:
        return self._chat(body)[0]

    def encode_chat(self, body: dict) -> list[int]:
        return self._chat(body)[1]

    def decode(self, ids: list[int]) -> str:
        # vLLM detokenizes output with skip_special_tokens=True by default (SamplingParams).
        return self.tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# The worker.
# ---------------------------------------------------------------------------------------------

OUTPUT_TEXT = " the quick brown fox jumps over the lazy dog and says hello world again"


def output_token_ids(tokenizer: Tokenizer, worker_id: int, count: int) -> list[int]:
    """The fixed output of worker `worker_id`: the tokens of a per-worker sentence, repeated as
    needed. Tests call this too, to know the text a worker answers."""
    ids = tokenizer.encode(f" worker {worker_id} says{OUTPUT_TEXT}", add_special_tokens=False)
    assert ids, "the tokenizer encodes the output sentence to no tokens"
    return list(itertools.islice(itertools.cycle(ids), count))


class Aborted(Exception):
    """The client went away."""


FAIL_MODES = (None, "close", "unavailable", "prefill", "midstream")


class Worker:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.worker_id = args.worker_id
        self.block_size = args.block_size
        # vLLM serves the model under --served-model-name, by default the --model string as given
        # (vllm/entrypoints/openai/models/serving.py BaseModelPath).
        self.model_name = args.model_name or args.model_path
        self.tokenizer = Tokenizer(args.model_path, args.chat_template_content_format)
        self.publisher = ZmqEventPublisher(
            args.host,
            args.zmq_port,
            None if args.replay_port < 0 else args.replay_port,
            args.data_parallel_rank,
            args.topic,
        )
        self.lock = threading.Lock()
        self.held = BlockHoldings()
        self.requests = 0
        self.completed = 0
        self.aborted = 0
        self.running = 0
        self.last_prompt_token_ids: list[int] = []
        self.last_request_path = ""
        # Test control (FAIL_MODES): "close" drops each generate request's connection without a
        # byte of answer (a worker that dies before its first byte); "unavailable" answers 503
        # as vLLM does when its engine cannot take requests; "midstream" sends the headers and
        # the first two steps of a streamed answer, then drops the connection (a worker that
        # dies while decoding); "prefill" sends a stream's headers (vLLM's StreamingResponse does so
        # before it queues the request) and drops the connection before the first event (a
        # worker dying during prefill); None serves normally.
        self.fail_mode: str | None = None
        self.refused = 0

    # -- engine side ------------------------------------------------------------------------

    def cache_blocks(self, token_ids: list[int], num_tokens: int, done: set[bytes],
                     lora: tuple[str, str] | None = None, cache_salt: str | None = None) -> None:
        """Publishes BlockStored (medium GPU) for the full blocks of `token_ids[:num_tokens]` this
        worker does not hold yet, as vllm/v1/core/block_pool.py cache_full_blocks does when a step
        completes blocks: one event for the run of new blocks, parent = the hash of the block
        before the first (None at the start), token_ids of those blocks, block_size, lora None,
        extra_keys one None per block (to_event_extra_keys of plain blocks), group_idx 0
        (_build_block_stored_event). `done` are the blocks this request has already accounted for.
        """
        keyed = request_block_hashes(token_ids[:num_tokens], self.block_size, lora, cache_salt)
        hashes = [h for h, _ in keyed]
        extras = [e for _, e in keyed]
        lora_name = lora[0] if lora else None
        events = []
        with self.lock:
            run: list[int] = []
            for i, h in enumerate(hashes):
                if h in done:
                    continue
                done.add(h)
                if h in self.held.gpu:  # a prefix-cache hit: vLLM publishes nothing for it
                    if run:
                        events.append(self._stored(hashes, extras, token_ids, run, lora_name))
                        run = []
                    continue
                parent = hashes[i - 1] if i > 0 else None
                self.held.gpu[h] = HeldBlock(
                    parent, token_ids[i * self.block_size : (i + 1) * self.block_size],
                    lora_name, extras[i])
                run.append(i)
            if run:
                events.append(self._stored(hashes, extras, token_ids, run, lora_name))
        if events:
            self.publisher.publish(events)

    def _stored(self, hashes: list[bytes], extras: list, token_ids: list[int], run: list[int],
                lora_name: str | None) -> BlockStored:
        """vllm/v1/core/block_pool.py _build_block_stored_event: lora_name from the request's
        LoRA (lora_id is deprecated; 1 here when set), extra_keys one untagged entry per block."""
        first, last = run[0], run[-1]
        bs = self.block_size
        return BlockStored(
            block_hashes=[external_hash(hashes[i]) for i in run],
            parent_block_hash=external_hash(hashes[first - 1]) if first > 0 else None,
            token_ids=token_ids[first * bs : (last + 1) * bs],
            block_size=bs,
            lora_id=1 if lora_name else None,
            medium=MEDIUM_GPU,
            lora_name=lora_name,
            extra_keys=[event_extra_keys(extras[i]) for i in run],
            group_idx=0,
        )

    def evict_gpu(self, external_hashes: list[int] | None) -> dict:
        """Offloads the chosen GPU blocks to the CPU tier and drops them from the GPU.

        The CPU stores are published as vLLM's offloading connector publishes them with
        self-describing events (vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py
        OffloadingEventsTracker._take_stored_event, one offloaded chunk of one block each): one
        BlockStored per block, medium "CPU", its own parent hash, its tokens, block_size,
        extra_keys None, group_idx 0, kv_cache_spec_kind "full_attention". The GPU removals then
        follow as vllm/v1/core/block_pool.py _emit_block_removed_events writes them when blocks
        are evicted: one BlockRemoved per block, medium "GPU", group_idx 0. The offload happens
        before the eviction (the connector stores a block once computed), so the two go out as
        two batches, stores first."""
        with self.lock:
            if external_hashes is None:
                chosen = list(self.held.gpu)
            else:
                wanted = set(external_hashes)
                chosen = [h for h in self.held.gpu if external_hash(h) in wanted]
            stores, removals = [], []
            for h in chosen:
                block = self.held.gpu.pop(h)
                if h not in self.held.cpu:
                    self.held.cpu[h] = block
                    stores.append(BlockStored(
                        block_hashes=[external_hash(h)],
                        parent_block_hash=external_hash(block.parent) if block.parent else None,
                        token_ids=list(block.token_ids),
                        block_size=self.block_size,
                        lora_id=1 if block.lora_name else None,
                        medium=MEDIUM_CPU,
                        lora_name=block.lora_name,
                        extra_keys=(None if block.extra_keys is None
                                    else [event_extra_keys(block.extra_keys)]),
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                    ))
                removals.append(BlockRemoved(block_hashes=[external_hash(h)], medium=MEDIUM_GPU, group_idx=0))
        if stores:
            self.publisher.publish(stores)
        if removals:
            self.publisher.publish(removals)
        return {"evicted_gpu": len(removals), "stored_cpu": len(stores)}

    def reset_prefix_cache(self) -> dict:
        """vllm/v1/core/block_pool.py reset_prefix_cache: every GPU hash dropped, one
        AllBlocksCleared (the fake's CPU tier is dropped with it)."""
        with self.lock:
            self.held.gpu.clear()
            self.held.cpu.clear()
        self.publisher.publish([AllBlocksCleared()])
        return {"success": True}

    def stats(self) -> dict:
        with self.lock:
            return {
                "worker_id": self.worker_id,
                "requests": self.requests,
                "completed": self.completed,
                "aborted": self.aborted,
                "running": self.running,
                "refused": self.refused,
                "last_prompt_token_ids": list(self.last_prompt_token_ids),
                "last_request_path": self.last_request_path,
                "gpu_blocks": len(self.held.gpu),
                "cpu_blocks": len(self.held.cpu),
                "gpu_block_hashes": [external_hash(h) for h in self.held.gpu],
                "cpu_block_hashes": [external_hash(h) for h in self.held.cpu],
                "event_batches_published": self.publisher.published,
            }

    def check_model(self, body: dict) -> None:
        """vllm/entrypoints/serve/engine/serving.py _check_model: an absent or empty model is the
        base model; any other name than the served one is 404 NotFoundError."""
        model = body.get("model")
        if model and model != self.model_name and model not in self.args.lora_name:
            raise RequestError(
                HTTPStatus.NOT_FOUND,
                f"The model `{model}` does not exist. Valid aliases: {self.model_name}.",
                "NotFoundError",
                "model",
            )


# ---------------------------------------------------------------------------------------------
# HTTP.
# ---------------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked streaming, as uvicorn serves
    server_version = "fake-vllm"
    worker: Worker  # set on the class by main()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib's name)
        if self.worker.args.verbose:
            sys.stderr.write(f"[worker {self.worker.worker_id}] {format % args}\n")

    # -- plumbing -------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _json_body(self) -> dict:
        raw = self._read_body()
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:
            raise bad_request(f"invalid JSON: {e}") from e
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return body

    def _send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _peer_gone(self) -> bool:
        """True once the client has closed its side: the socket reads EOF. (A read that returns
        data means a pipelined request; none is expected while a response is in flight.)"""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _write_chunk(self, text: str) -> None:
        data = text.encode()
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise Aborted() from e

    # -- routes -----------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 (stdlib's name)
        w = self.worker
        if self.path == "/v1/models":
            # vllm/entrypoints/openai/models/serving.py show_available_models (ModelList/ModelCard
            # of vllm/entrypoints/serve/engine/protocol.py, dumped with model_dump()).
            now = int(time.time())
            self._send_json(200, {
                "object": "list",
                "data": [{
                    "id": w.model_name,
                    "object": "model",
                    "created": now,
                    "owned_by": "vllm",
                    "root": w.args.model_path,
                    "parent": None,
                    "max_model_len": w.args.max_model_len,
                    "permission": [{
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": now,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }],
                }],
            })
        elif self.path == "/health":
            # vllm/entrypoints/serve/instrumentator/health.py: 200, empty body.
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/stats":
            self._send_json(200, w.stats())
        else:
            self._send_json(404, {"detail": "Not Found"})  # FastAPI's unknown-route answer

    def do_POST(self) -> None:  # noqa: N802 (stdlib's name)
        w = self.worker
        try:
            body = self._json_body()
            if self.path == "/v1/completions":
                self._generate(body, chat=False)
            elif self.path == "/v1/chat/completions":
                self._generate(body, chat=True)
            elif self.path == "/tokenize":
                self._tokenize(body)
            elif self.path == "/evict_gpu":
                hashes = body.get("block_hashes")
                self._send_json(200, w.evict_gpu(None if hashes is None else [int(h) for h in hashes]))
            elif self.path == "/fail":
                mode = body.get("mode")
                if mode not in FAIL_MODES:
                    raise bad_request(f"mode is one of {FAIL_MODES}", "mode")
                with w.lock:
                    w.fail_mode = mode
                self._send_json(200, {"mode": mode})
            elif self.path.startswith("/reset_prefix_cache"):
                self._send_json(200, w.reset_prefix_cache())
            else:
                self._send_json(404, {"detail": "Not Found"})
        except RequestError as e:
            self._send_json(int(e.status), e.body())
        except Aborted:
            self.close_connection = True

    def _tokenize(self, body: dict) -> None:
        """vllm/entrypoints/serve/tokenize/serving.py: TokenizeCompletionRequest (prompt,
        add_special_tokens default True) or TokenizeChatRequest (messages, add_special_tokens
        default False), answered as TokenizeResponse."""
        w = self.worker
        w.check_model(body)
        if "messages" in body:
            ids = w.tokenizer.encode_chat(body)
        elif isinstance(body.get("prompt"), str):
            ids = w.tokenizer.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
        else:
            raise bad_request("prompt or messages is required")
        self._send_json(200, {"count": len(ids), "max_model_len": w.args.max_model_len,
                              "tokens": ids, "token_strs": None})

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        w = self.worker
        if chat:
            return w.tokenizer.encode_chat(body)
        prompt = body.get("prompt")
        # CompletionRequest.prompt: a string, a list of one string, or token ids. The fake serves
        # one prompt per request (vLLM batches several; not modelled).
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return w.tokenizer.encode(prompt, bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise bad_request("the fake worker takes one prompt: a string or a list of token ids", "prompt")

    def _generate(self, body: dict, chat: bool) -> None:
        w = self.worker
        with w.lock:
            refuse = w.fail_mode == "close"
            w.refused += refuse
        if refuse:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        with w.lock:
            unavailable = w.fail_mode == "unavailable"
            midstream = w.fail_mode == "midstream"
            prefill_death = w.fail_mode == "prefill" and bool(body.get("stream"))
            w.refused += unavailable or prefill_death
        if unavailable:
            # vllm/entrypoints/serve/exception_handling/error_response.py: a retryable
            # GenerationError is a ServiceUnavailableError with status 503.
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not taking requests",
                               "ServiceUnavailableError")
        w.check_model(body)
        for unsupported in ("n", "best_of"):
            if body.get(unsupported) not in (None, 1):
                raise bad_request(f"the fake worker serves {unsupported}=1 only", unsupported)
        if body.get("echo") or body.get("logprobs") or body.get("use_beam_search"):
            raise bad_request("the fake worker does not do echo, logprobs or beam search")
        prompt_ids = self._prompt_ids(body, chat)
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        # Without max_tokens vLLM generates up to max_model_len; the fake "reaches EOS" after
        # --output-tokens tokens (finish_reason "stop"), or stops at max_tokens ("length").
        natural = w.args.output_tokens
        count = natural if max_tokens is None else min(int(max_tokens), natural)
        finish_reason = "length" if max_tokens is not None and int(max_tokens) < natural else "stop"
        out_ids = output_token_ids(w.tokenizer, w.worker_id, count)
        stream = bool(body.get("stream"))
        stream_options = body.get("stream_options") or {}
        # vllm/entrypoints/serve/utils/api_utils.py should_include_usage
        include_usage = stream and bool(stream_options.get("include_usage"))
        include_continuous = include_usage and bool(stream_options.get("continuous_usage_stats"))
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())

        with w.lock:
            w.requests += 1
            w.running += 1
            w.last_prompt_token_ids = list(prompt_ids)
            w.last_request_path = self.path
        outcome = "aborted"
        try:
            if stream:
                # Starlette's StreamingResponse sends the headers before the first body chunk.
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                if prefill_death:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    raise Aborted()
            model = body.get("model")
            # vLLM's --lora-modules name=path: the adapter's path joins its hash key.
            lora = (model, f"/adapters/{model}") if model in w.args.lora_name else None
            salt = body.get("cache_salt")
            pieces = self._run_engine(prompt_ids, out_ids, lora, salt if isinstance(salt, str) else None)
            if midstream and stream:
                pieces = self._die_after(pieces, 2)
            if stream:
                emit = self._stream_chat if chat else self._stream_completion
                emit(pieces, request_id, created, finish_reason, len(prompt_ids),
                     include_usage, include_continuous)
                self._write_chunk("data: [DONE]\n\n")
                try:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError as e:
                    raise Aborted() from e
            else:
                text = "".join(delta for delta, _ in pieces)
                self._send_json(200, self._full_response(chat, request_id, created, text,
                                                         finish_reason, len(prompt_ids), len(out_ids)))
            outcome = "completed"
        except Aborted:
            self.close_connection = True
        finally:
            with w.lock:
                w.running -= 1
                if outcome == "completed":
                    w.completed += 1
                else:
                    w.aborted += 1

    def _die_after(self, pieces, n: int):
        """The first `n` steps, then the connection drops as if the process died."""
        for k, piece in enumerate(pieces):
            if k == n:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                raise Aborted()
            yield piece

    def _run_engine(self, prompt_ids: list[int], out_ids: list[int],
                    lora: tuple[str, str] | None = None, cache_salt: str | None = None):
        """Yields (text delta, is last) per engine step, checking for a departed client
        between steps (vLLM aborts the request then: vllm/entrypoints/serve/utils/api_utils.py
        with_cancellation, and the StreamingResponse disconnect for streams)."""
        w = self.worker
        if self._peer_gone():
            raise Aborted()
        time.sleep(w.args.prefill_delay_s)
        done: set[bytes] = set()
        # The first step computes the prompt; its full blocks are cached and their events go out
        # at the end of the step (vllm/v1/core/sched/scheduler.py update_from_output), before the
        # step's output reaches the client.
        w.cache_blocks(prompt_ids, len(prompt_ids), done, lora, cache_salt)
        all_ids = list(prompt_ids)
        text_so_far = ""
        for k, tok in enumerate(out_ids):
            if k > 0:
                time.sleep(w.args.step_delay_s)
                if self._peer_gone():
                    raise Aborted()
                # Each decode step computes the previously sampled token; blocks it fills are
                # cached like the prompt's (the last sampled token is never computed).
                w.cache_blocks(all_ids, len(all_ids), done, lora, cache_salt)
            all_ids.append(tok)
            # Incremental detokenization: the new text of the output so far, withholding an
            # incomplete UTF-8 character (vllm/v1/engine/detokenizer.py does the same).
            text = w.tokenizer.decode(all_ids[len(prompt_ids):])
            if text.endswith("\ufffd") and k + 1 < len(out_ids):
                delta = ""
            else:
                delta, text_so_far = text[len(text_so_far):], text
            yield delta, k + 1 == len(out_ids)

    def _stream_completion(self, pieces, request_id, created, finish_reason, n_prompt,
                           include_usage, include_continuous) -> None:
        """vllm/entrypoints/openai/completion/serving.py completion_stream_generator: one
        CompletionStreamResponse per step dumped with exclude_unset=True, the finish reason on the
        last; with include_usage a final chunk with empty choices and usage (exclude_none=True)."""
        w = self.worker
        n_out = 0
        for delta, last in pieces:
            n_out += 1
            chunk = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": w.model_name,
                "choices": [{
                    "index": 0,
                    "text": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason if last else None,
                    "stop_reason": None,
                    "prompt_token_ids": None,
                    "token_ids": None,
                    "weight_versions": None,
                }],
                "kv_transfer_params": None,
            }
            if include_continuous:
                chunk["usage"] = usage(n_prompt, n_out)
            self._write_chunk(f"data: {json.dumps(chunk)}\n\n")
        if include_usage:
            self._write_chunk("data: " + json.dumps({
                "id": request_id, "object": "text_completion", "created": created,
                "model": w.model_name, "choices": [], "usage": usage(n_prompt, n_out),
            }) + "\n\n")

    def _stream_chat(self, pieces, request_id, created, finish_reason, n_prompt,
                     include_usage, include_continuous) -> None:
        """vllm/entrypoints/openai/chat_completion/serving.py chat_completion_stream_generator(_raw):
        on the first engine output, a chunk with delta {role, content: ""}; then one chunk per
        step with delta {content}; the last carries finish_reason and stop_reason; chunks dumped
        with exclude_unset=True; with include_usage a final chunk with empty choices and usage."""
        w = self.worker
        first = True
        n_out = 0
        for delta, last in pieces:
            if first:
                chunk = {
                    "id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": w.model_name,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}],
                }
                if include_continuous:
                    chunk["usage"] = usage(n_prompt, 0)
                self._write_chunk(f"data: {json.dumps(chunk)}\n\n")
                first = False
            n_out += 1
            choice: dict[str, Any] = {"index": 0, "delta": {"content": delta}, "logprobs": None,
                                      "finish_reason": None, "token_ids": None}
            if last:
                choice.update(finish_reason=finish_reason, stop_reason=None, weight_versions=None)
            chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                     "model": w.model_name, "choices": [choice], "kv_transfer_params": None}
            if include_continuous:
                chunk["usage"] = usage(n_prompt, n_out)
            self._write_chunk(f"data: {json.dumps(chunk)}\n\n")
        if include_usage:
            self._write_chunk("data: " + json.dumps({
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": w.model_name, "choices": [], "usage": usage(n_prompt, n_out),
            }) + "\n\n")

    def _full_response(self, chat, request_id, created, text, finish_reason, n_prompt, n_out) -> dict:
        """CompletionResponse / ChatCompletionResponse (vllm/entrypoints/openai/*/protocol.py),
        dumped with model_dump() by the api_router: every field, None included."""
        w = self.worker
        common = {"id": request_id, "created": created, "model": w.model_name,
                  "service_tier": None, "system_fingerprint": None, "usage": usage(n_prompt, n_out),
                  "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        if chat:
            return {**common, "object": "chat.completion", "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None,
                            "annotations": None, "audio": None, "function_call": None,
                            "reasoning": None},
                "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                "token_ids": None,
            }], "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        return {**common, "object": "text_completion", "choices": [{
            "index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
            "prompt_token_ids": None,
        }]}


def usage(n_prompt: int, n_out: int) -> dict:
    """vllm/entrypoints/serve/engine/protocol.py UsageInfo."""
    return {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
            "completion_tokens": n_out, "prompt_tokens_details": None}



def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--zmq-port", type=int, default=0, help="KV events PUB port; 0 picks one")
    p.add_argument("--replay-port", type=int, default=0,
                   help="KV events replay (ROUTER) port; 0 picks one, -1 disables it")
    p.add_argument("--model-path", required=True, help="directory with the HF tokenizer files")
    p.add_argument("--model-name", default=None,
                   help="served model name (vLLM's --served-model-name; default: --model-path)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chat-template-content-format", choices=("string", "openai"), default="string",
                   help="how message content reaches the template (vLLM's flag; its 'auto' "
                   "detection is not modelled)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--output-tokens", type=int, default=8,
                   help="tokens generated when max_tokens does not stop earlier")
    p.add_argument("--prefill-delay-s", type=float, default=0.0)
    p.add_argument("--step-delay-s", type=float, default=0.05,
                   help="time between output tokens (chunks)")
    p.add_argument("--data-parallel-rank", type=int, default=0)
    p.add_argument("--lora-name", action="append", default=[],
                   help="a LoRA adapter served under this model name (vLLM's --lora-modules); "
                        "its requests' blocks are hashed and published with it")
    p.add_argument("--topic", default="", help="KV events topic (vLLM's default: empty)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)

    worker = Worker(args)
    Handler.worker = worker
    server = ThreadingHTTPServer((args.host, args.http_port), Handler)
    server.daemon_threads = True
    print(json.dumps({
        "worker_id": args.worker_id,
        "pid": os.getpid(),
        "http_port": server.server_address[1],
        "zmq_port": worker.publisher.pub_port,
        "replay_port": worker.publisher.replay_port,
    }), flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        worker.publisher.close()


if __name__ == "__main__":
    main()
