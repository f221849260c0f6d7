"""The router as a user deploys it: the official `openai` client talks to `kvbm-router` in front of
scripted vLLM workers (fake_vllm_worker.py), which tokenize, answer and publish KV events as
vLLM 0.33 does, with their own engine hashes.

Each test starts its own workers and router (conftest.py) and waits by bounded polling only.
Skipped when KVBM_ROUTER_BIN is unset.
"""

from __future__ import annotations

import random

import pytest

from conftest import (
    BLOCK_SIZE,
    MODEL_NAME,
    TOKENIZER_DIR,
    FakeWorker,
    Router,
    router_bin,
    wait_until,
)

pytestmark = pytest.mark.skipif(router_bin() is None, reason="KVBM_ROUTER_BIN is not set")

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

import fake_vllm_worker  # noqa: E402 (after the skips: it needs msgspec, zmq, transformers)

SHARED_BLOCKS_MIN = 20
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@pytest.fixture(scope="module")
def reference():
    """The model's tokenizer as transformers loads it: the reference for prompt ids."""
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"tokenizer fixture {TOKENIZER_DIR} is missing")
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def fake_tokenizer():
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"tokenizer fixture {TOKENIZER_DIR} is missing")
    return fake_vllm_worker.Tokenizer(str(TOKENIZER_DIR), "string")


def prose(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def prompt_ids(reference, prompt: str) -> list[int]:
    """vLLM's ids for a completion prompt (add_special_tokens=True)."""
    return list(reference(prompt, add_special_tokens=True)["input_ids"])


def chat_ids(reference, messages: list[dict]) -> list[int]:
    """vLLM's ids for a chat request: the template's text, then encoded without special tokens."""
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(reference(text, add_special_tokens=False)["input_ids"])


def shared_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // BLOCK_SIZE


def sharing_prompts(reference, seed: int, count: int) -> list[str]:
    """`count` completion prompts that share a prefix of at least SHARED_BLOCKS_MIN full blocks
    and then differ (checked on the tokens, not assumed from the text)."""
    prefix = prose(seed, 600)
    prompts = [f"{prefix} {prose(seed * 1000 + i, 40)}" for i in range(count)]
    ids = [prompt_ids(reference, p) for p in prompts]
    for other in ids[1:]:
        assert shared_blocks(ids[0], other) >= SHARED_BLOCKS_MIN
        assert other != ids[0]
    return prompts


def expected_text(fake_tokenizer, worker_id: int, count: int) -> str:
    return fake_tokenizer.decode(fake_vllm_worker.output_token_ids(fake_tokenizer, worker_id, count))


def served_by(raw) -> int:
    """The worker id in the router's `x-kvbm-worker: ID:RANK` header."""
    value = raw.headers.get("x-kvbm-worker")
    assert value, f"no x-kvbm-worker header in {dict(raw.headers)}"
    return int(value.split(":")[0])


def complete(router: Router, prompt: str, max_tokens: int = 4) -> tuple[int, object]:
    raw = router.client().completions.with_raw_response.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens)
    return served_by(raw), raw.parse()


def wait_idle(router: Router) -> None:
    wait_until(lambda: all(v["load"]["requests"] == 0 and v["load"]["prefill_tokens"] == 0
                           and v["load"]["decode_blocks"] == 0
                           for v in router.workers().values()),
               "no load on any worker in the router's /workers")


def wait_indexed(router: Router, worker: FakeWorker) -> dict:
    """Until the router's block counts for `worker` equal what the worker holds."""
    def probe():
        st = worker.stats()
        view = router.workers()[worker.worker_id]["blocks"]
        held = {"gpu": st["gpu_blocks"], "host": st["cpu_blocks"], "disk": 0}
        return view if view == held else None

    return wait_until(probe, f"the router's /workers blocks for worker {worker.worker_id} to "
                             "equal the worker's holdings")


def by_id(workers: list[FakeWorker]) -> dict[int, FakeWorker]:
    return {w.worker_id: w for w in workers}


# ---------------------------------------------------------------------------------------------
# a. The OpenAI surface, answered correctly.
# ---------------------------------------------------------------------------------------------


def test_models_list(cluster):
    router, _ = cluster(2)
    models = router.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_is_answered_by_a_worker(cluster, reference, fake_tokenizer, stream):
    router, workers = cluster(2)
    prompt = "The quick brown fox jumps over the lazy dog. " + prose(1, 30)
    raw = router.client().completions.with_raw_response.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=5, stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}))
    wid = served_by(raw)
    expected = expected_text(fake_tokenizer, wid, 5)
    ids = prompt_ids(reference, prompt)
    if stream:
        chunks = list(raw.parse())
        texts = [c.choices[0].text for c in chunks if c.choices]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert "".join(texts) == expected
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.prompt_tokens == len(ids)
    else:
        answer = raw.parse()
        assert answer.choices[0].text == expected
        assert answer.choices[0].finish_reason == "length"
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), 5)
        assert answer.model == MODEL_NAME
    stats = {w.worker_id: w.stats() for w in workers}
    assert stats[wid]["last_prompt_token_ids"] == ids
    assert {k: s["requests"] for k, s in stats.items()} == {w.worker_id: int(w.worker_id == wid)
                                                            for w in workers}
    assert stats[wid]["completed"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_completion_is_answered_by_a_worker(cluster, reference, fake_tokenizer, stream):
    router, workers = cluster(2)
    messages = [{"role": "system", "content": "You are a terse assistant. " + prose(2, 20)},
                {"role": "user", "content": "Say something about " + prose(3, 10)}]
    raw = router.client().chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, stream=stream)
    wid = served_by(raw)
    expected = expected_text(fake_tokenizer, wid, 8)  # the worker's natural length: "stop"
    if stream:
        chunks = list(raw.parse())
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"
    else:
        answer = raw.parse()
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].message.content == expected
        assert answer.choices[0].finish_reason == "stop"
    assert by_id(workers)[wid].stats()["last_prompt_token_ids"] == chat_ids(reference, messages)


# ---------------------------------------------------------------------------------------------
# b, c. Routing by KV overlap, from the workers' own events.
# ---------------------------------------------------------------------------------------------


def test_shared_prefix_goes_to_the_worker_that_served_it(cluster, reference):
    router, workers = cluster(3)
    first, second = sharing_prompts(reference, seed=10, count=2)
    wid, _ = complete(router, first)
    view = wait_indexed(router, by_id(workers)[wid])
    assert view["gpu"] >= SHARED_BLOCKS_MIN
    wait_idle(router)

    again, _ = complete(router, second)
    assert again == wid
    assert by_id(workers)[wid].stats()["requests"] == 2
    assert sum(w.stats()["requests"] for w in workers) == 2


def test_prefix_held_by_each_worker_attracts_its_requests(cluster, reference):
    """Each worker computes its own prefix (asked directly, as another front end would); then a
    request sharing worker i's prefix goes to worker i, for every i: no tie-break can pass this."""
    router, workers = cluster(3)
    prompts = {w.worker_id: sharing_prompts(reference, seed=20 + w.worker_id, count=2)
               for w in workers}
    for w in workers:
        w.complete(prompts[w.worker_id][0])
    for w in workers:
        wait_indexed(router, w)
    wait_idle(router)

    for w in workers:
        got, _ = complete(router, prompts[w.worker_id][1])
        assert got == w.worker_id, f"a request sharing worker {w.worker_id}'s prefix went to {got}"
        wait_idle(router)


def test_host_tier_hold_still_attracts_after_gpu_eviction(cluster, reference):
    router, workers = cluster(3)
    first, second, third = sharing_prompts(reference, seed=30, count=3)
    wid, _ = complete(router, first)
    holder = by_id(workers)[wid]
    wait_indexed(router, holder)
    wait_idle(router)
    assert complete(router, second)[0] == wid

    evicted = holder.evict_gpu()
    assert evicted["evicted_gpu"] > 0 and evicted["stored_cpu"] == evicted["evicted_gpu"]
    view = wait_indexed(router, holder)
    assert view["gpu"] == 0 and view["host"] >= SHARED_BLOCKS_MIN
    wait_idle(router)

    assert complete(router, third)[0] == wid


def test_host_tier_holds_of_each_worker_attract_their_requests(cluster, reference):
    router, workers = cluster(3)
    prompts = {w.worker_id: sharing_prompts(reference, seed=40 + w.worker_id, count=2)
               for w in workers}
    for w in workers:
        w.complete(prompts[w.worker_id][0])
        w.evict_gpu()
    for w in workers:
        view = wait_indexed(router, w)
        assert view["gpu"] == 0 and view["host"] >= SHARED_BLOCKS_MIN
    wait_idle(router)

    for w in workers:
        got, _ = complete(router, prompts[w.worker_id][1])
        assert got == w.worker_id, f"a request sharing worker {w.worker_id}'s host-tier prefix " \
                                   f"went to {got}"
        wait_idle(router)


def test_lora_and_cache_salt_requests_match_only_their_own_blocks(cluster, reference):
    """vLLM hashes a LoRA request's blocks with the adapter and a salted request's first block with
    its salt, and says so in its events (lora_name, extra_keys): the router must match such a
    request to those blocks, and never a plain request to them. Each routed request below has
    its own blocks on one worker and the plain blocks of the same prompt on the other, so it
    lands right only if the router hashed it with its adapter or salt."""
    import conftest

    router, workers = cluster(2, router_flags=("--lora-names", "adapter-a"), lora_name="adapter-a")
    client = router.client()
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "adapter-a"]
    first, second = sharing_prompts(reference, seed=130, count=2)
    ids = prompt_ids(reference, first)
    full = len(ids) // BLOCK_SIZE
    a, b = workers

    def gpu_overlap(**seeds) -> dict[int, int]:
        answer = conftest.http_json("POST", f"{router.url}/query", {"token_ids": ids, **seeds})
        return {w["worker_id"]: w["overlap"]["gpu_blocks"] for w in answer["workers"]}

    def direct(worker: FakeWorker, **body) -> None:
        conftest.http_json("POST", f"{worker.url}/v1/completions",
                           {"prompt": first, "max_tokens": 2, **body})

    # Worker a: the adapter's blocks of `first`; worker b: the plain ones.
    direct(a, model="adapter-a")
    direct(b, model=MODEL_NAME)
    wait_indexed(router, a)
    wait_indexed(router, b)
    assert gpu_overlap(lora_name="adapter-a") == {a.worker_id: full, b.worker_id: 0}
    assert gpu_overlap()[a.worker_id] == 0, "a plain request matched the adapter's blocks"
    raw = client.completions.with_raw_response.create(model="adapter-a", prompt=second, max_tokens=2)
    assert served_by(raw) == a.worker_id
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=second, max_tokens=2)
    assert served_by(raw) == b.worker_id
    wait_idle(router)

    # Worker a also gets tenant-1's salted blocks of `first`.
    direct(a, model=MODEL_NAME, cache_salt="tenant-1")
    wait_indexed(router, a)
    assert gpu_overlap(cache_salt="tenant-1") == {a.worker_id: full, b.worker_id: 0}
    # Another tenant's salt changes the first block's hash, and so every block after it.
    assert all(n == 0 for n in gpu_overlap(cache_salt="tenant-2").values())
    raw = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt=second, max_tokens=2, extra_body={"cache_salt": "tenant-1"})
    assert served_by(raw) == a.worker_id


# ---------------------------------------------------------------------------------------------
# d. Cancellation.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_cancelled_stream_releases_load_and_aborts_on_the_worker(cluster, api):
    # 400 tokens 50 ms apart: the request would run 20 s if nothing cancelled it.
    router, workers = cluster(2, output_tokens=400, step_delay_s=0.05)
    client = router.client()
    if api == "completions":
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt=prose(50, 200), stream=True)
    else:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prose(51, 200)}], stream=True)
    wid = served_by(raw)
    worker = by_id(workers)[wid]
    stream = raw.parse()
    next(iter(stream))
    assert router.workers()[wid]["load"]["requests"] == 1
    assert worker.stats()["running"] == 1
    stream.close()

    wait_until(lambda: router.workers()[wid]["load"] == {"prefill_tokens": 0, "decode_blocks": 0,
                                                         "requests": 0},
               f"worker {wid}'s load in the router to return to nothing")
    stats = wait_until(lambda: (s := worker.stats())["aborted"] == 1 and s["running"] == 0 and s,
                       f"worker {wid} to count the request aborted")
    assert stats["completed"] == 0


def test_client_gone_before_the_worker_answers_releases_load_and_aborts(cluster):
    """A whole (not streamed) answer: the client gives up while the worker is still computing the
    prompt. The router drops the worker's connection and the request's load at once."""
    router, workers = cluster(2, prefill_delay_s=3.0)
    client = router.client(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=MODEL_NAME, prompt=prose(52, 40), max_tokens=2)
    # Well before the worker would have answered (3 s): nothing counts toward any worker.
    wait_until(lambda: all(v["load"]["requests"] == 0 for v in router.workers().values()),
               "the request's load to be released", deadline_s=1.5)
    stats = wait_until(lambda: (s := [w.stats() for w in workers]) and
                       sum(x["aborted"] for x in s) == 1 and s,
                       "the worker to count the request aborted")
    assert sum(x["completed"] for x in stats) == 0
    m = metrics(router)
    assert m[("kv_router_frontend_outcomes_total", (("outcome", "cancelled"),))] == 1


# ---------------------------------------------------------------------------------------------
# e. Workers that fail.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_worker_dropping_the_request_before_its_first_byte_is_retried(cluster, reference,
                                                                      fake_tokenizer, stream):
    """The worker holding the prefix (the router's first choice) drops the connection without
    answering; the router tries the next best and the client never sees the failure."""
    router, workers = cluster(2)
    first, second = sharing_prompts(reference, seed=60, count=2)
    holder = workers[0]
    holder.complete(first)
    wait_indexed(router, holder)
    holder.fail_requests("close")

    raw = router.client().completions.with_raw_response.create(
        model=MODEL_NAME, prompt=second, max_tokens=3, stream=stream)
    wid = served_by(raw)
    text = ("".join(c.choices[0].text for c in raw.parse() if c.choices) if stream
            else raw.parse().choices[0].text)
    assert wid == workers[1].worker_id
    assert text == expected_text(fake_tokenizer, wid, 3)
    assert holder.stats()["refused"] == 1, "the router never tried the worker holding the prefix"
    assert workers[1].stats()["completed"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_killed_worker_is_survived(cluster, reference, fake_tokenizer, stream):
    router, workers = cluster(2)
    first, second = sharing_prompts(reference, seed=70, count=2)
    wid, _ = complete(router, first)
    holder = by_id(workers)[wid]
    survivor = next(w for w in workers if w.worker_id != wid)
    wait_indexed(router, holder)
    wait_idle(router)
    holder.kill()

    raw = router.client().completions.with_raw_response.create(
        model=MODEL_NAME, prompt=second, max_tokens=3, stream=stream)
    got = served_by(raw)
    text = ("".join(c.choices[0].text for c in raw.parse() if c.choices) if stream
            else raw.parse().choices[0].text)
    assert got == survivor.worker_id
    assert text == expected_text(fake_tokenizer, got, 3)


# ---------------------------------------------------------------------------------------------
# f. Errors a client sees.
# ---------------------------------------------------------------------------------------------


def test_workers_whose_events_are_unreachable_are_still_served_by_load(
        start_workers, processes, tmp_path, tokenizer_dir, fake_tokenizer):
    """A worker whose KV event endpoint does not answer (events off, a firewall) is not routed to
    while another's is up; when none is, the front end still serves requests, by load alone."""
    import os
    import socket

    import conftest

    workers = start_workers([1, 2])
    dead = []
    for _ in workers:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead.append(s.getsockname()[1])
    spec = ";".join(f"{w.worker_id}=tcp://127.0.0.1:{port},http={w.url}"
                    for w, port in zip(workers, dead))
    argv = [conftest.router_bin(), "--http-port", "0", "--model-path", str(tokenizer_dir),
            "--model-name", MODEL_NAME, "--block-size", str(BLOCK_SIZE), "--workers", spec]
    p = conftest.Process("router", argv, tmp_path / "router.log", env=dict(os.environ))
    processes.append(p)
    prefix = "kvbm-router listening on "
    url = p.first_line(lambda line: line[len(prefix):].strip() if line.startswith(prefix) else None)
    router = Router(p, url.rstrip("/"), list(workers))
    wait_until(lambda: all(v["link"]["state"] == "retrying" for v in router.workers().values())
               and len(router.workers()) == 2, "both event links retrying")
    served = set()
    for i in range(6):
        wid, answer = complete(router, f"request {i} " + prose(140 + i, 10), max_tokens=2)
        assert answer.choices[0].text == expected_text(fake_tokenizer, wid, 2)
        served.add(wid)
        wait_idle(router)
    assert served <= {1, 2} and served


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_unknown_model_is_not_found(cluster, api):
    router, workers = cluster(2)
    client = router.client()
    with pytest.raises(openai.NotFoundError) as err:
        if api == "completions":
            client.completions.create(model="no-such-model", prompt="hello", max_tokens=2)
        else:
            client.chat.completions.create(model="no-such-model", max_tokens=2,
                                           messages=[{"role": "user", "content": "hello"}])
    assert err.value.status_code == 404
    assert isinstance(err.value.body, dict) and err.value.body.get("message")
    assert sum(w.stats()["requests"] for w in workers) == 0


def test_no_live_worker_is_503(cluster):
    router, workers = cluster(2)
    for w in workers:
        w.kill()
    with pytest.raises(openai.APIStatusError) as err:
        router.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
    assert err.value.status_code == 503
    assert isinstance(err.value.body, dict) and err.value.body.get("message")


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_worker_dying_mid_stream_gives_the_client_an_error_event(cluster, reference, api):
    """After the first byte nothing can be retried: the client gets what the worker sent, then an
    SSE error event (the openai client raises it), and the worker is left out of routing."""
    router, workers = cluster(2, output_tokens=40)
    for w in workers:
        w.fail_requests("midstream")
    client = router.client()
    if api == "completions":
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt=prose(80, 50), max_tokens=30, stream=True)
    else:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prose(81, 50)}], stream=True)
    wid = served_by(raw)
    received = []
    with pytest.raises(openai.APIError) as err:
        for chunk in raw.parse():
            received.append(chunk)
    assert len(received) >= 1, "the chunks the worker sent before dying did not reach the client"
    assert "failed in the middle of the answer" in str(err.value.body or err.value.message)
    view = router.workers()[wid]
    assert view["cooldown_secs"] > 0, "the worker that died mid-answer was not marked"
    wait_idle(router)
    m = metrics(router)
    assert m[("kv_router_frontend_outcomes_total", (("outcome", "worker_error"),))] == 1
    assert m[("kv_router_worker_failures_total", ())] == 1


def test_worker_answering_503_is_retried_on_the_next_best(cluster, reference, fake_tokenizer):
    router, workers = cluster(2)
    first, second = sharing_prompts(reference, seed=90, count=2)
    holder, other = workers
    holder.complete(first)
    wait_indexed(router, holder)
    holder.fail_requests("unavailable")

    wid, answer = complete(router, second, max_tokens=3)
    assert wid == other.worker_id
    assert answer.choices[0].text == expected_text(fake_tokenizer, wid, 3)
    assert holder.stats()["refused"] == 1, "the router never tried the worker holding the prefix"
    m = metrics(router)
    assert m[("kv_router_frontend_retries_total", ())] == 1
    assert router.workers()[holder.worker_id]["cooldown_secs"] > 0


def test_stream_whose_worker_dies_during_prefill_is_retried(cluster, reference, fake_tokenizer):
    """vLLM sends a stream's 200 headers before it computes the prompt; a worker dying then has
    sent the client nothing yet, so the router still retries on the next best."""
    router, workers = cluster(2)
    first, second = sharing_prompts(reference, seed=95, count=2)
    holder, other = workers
    holder.complete(first)
    wait_indexed(router, holder)
    holder.fail_requests("prefill")

    raw = router.client().completions.with_raw_response.create(
        model=MODEL_NAME, prompt=second, max_tokens=3, stream=True)
    assert served_by(raw) == other.worker_id
    text = "".join(c.choices[0].text for c in raw.parse() if c.choices)
    assert text == expected_text(fake_tokenizer, other.worker_id, 3)
    assert holder.stats()["refused"] == 1, "the router never tried the worker holding the prefix"


def test_cooling_worker_still_serves_when_no_other_can(cluster, fake_tokenizer):
    """A worker that failed is passed over for a while, but not when every other fails too."""
    router, workers = cluster(2)
    a, b = workers
    a.fail_requests("unavailable")
    b.fail_requests("unavailable")
    with pytest.raises(openai.APIStatusError) as err:
        complete(router, "first " + prose(96, 10), max_tokens=2)
    assert err.value.status_code == 503
    assert all(v["cooldown_secs"] > 0 for v in router.workers().values())
    # Both cooling; one recovers: requests are served by it rather than refused.
    a.fail_requests(None)
    wid, answer = complete(router, "second " + prose(97, 10), max_tokens=2)
    assert wid == a.worker_id
    assert answer.choices[0].text == expected_text(fake_tokenizer, wid, 2)


def test_worker_client_error_is_passed_on_not_retried(cluster):
    """A 400 from the worker is the client's problem: passed on as the worker wrote it."""
    router, workers = cluster(2)
    with pytest.raises(openai.BadRequestError) as err:
        router.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2, n=2)
    assert err.value.status_code == 400
    assert "n=1" in err.value.body["message"]
    m = metrics(router)
    assert m.get(("kv_router_frontend_retries_total", ()), 0) == 0
    assert m[("kv_router_frontend_outcomes_total", (("outcome", "worker_status"),))] == 1
    assert all(v["cooldown_secs"] == 0 for v in router.workers().values())


# ---------------------------------------------------------------------------------------------
# g. Bounds, metrics, logs, registration.
# ---------------------------------------------------------------------------------------------


def metrics(router: Router) -> dict:
    """The router's /metrics samples, by (name, sorted labels)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{router.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_and_decision_log(cluster, reference):
    router, workers = cluster(2)
    first, second = sharing_prompts(reference, seed=100, count=2)
    wid, _ = complete(router, first)
    wait_indexed(router, by_id(workers)[wid])
    wait_idle(router)
    raw = router.client().completions.with_raw_response.create(
        model=MODEL_NAME, prompt=second, max_tokens=3, stream=True)
    list(raw.parse())
    wait_idle(router)

    m = metrics(router)
    labels = lambda rtype: (("endpoint", "completions"), ("model", MODEL_NAME),  # noqa: E731
                            ("request_type", rtype), ("status", "success"))
    assert m[("dynamo_frontend_requests_total", labels("unary"))] == 1
    assert m[("dynamo_frontend_requests_total", labels("stream"))] == 1
    model = (("model", MODEL_NAME),)
    # Time to first token is a stream's (a whole answer's first chunk is all of it).
    assert m[("dynamo_frontend_time_to_first_token_seconds_count", model)] == 1
    assert m[("dynamo_frontend_request_duration_seconds_count", model)] == 2
    assert m[("dynamo_frontend_inflight_requests", model)] == 0
    assert m[("kv_router_frontend_tokenize_seconds_count", (("kind", "prompt"),))] == 2
    assert m[("kv_router_frontend_routing_seconds_count", ())] == 2
    # The second request's overlap: at least the shared prefix on the GPU tier.
    assert m[("kv_router_frontend_overlap_blocks_count", (("tier", "gpu"),))] == 2
    assert m[("kv_router_frontend_overlap_blocks_sum", (("tier", "gpu"),))] >= SHARED_BLOCKS_MIN
    assert m[("kv_router_frontend_outcomes_total", (("outcome", "success"),))] == 2

    log = router.process.log_path.read_text()
    decisions = [line for line in log.splitlines() if "routing decision" in line]
    assert len(decisions) == 2, decisions
    assert f"worker={wid}:0" in decisions[1] and "overlap_gpu_blocks=" in decisions[1]
    gpu = int(decisions[1].split("overlap_gpu_blocks=")[1].split()[0])
    assert gpu >= SHARED_BLOCKS_MIN


def test_bodies_are_bounded_and_checked(cluster):
    import json as _json
    import urllib.error
    import urllib.request

    router, workers = cluster(2, router_flags=("--max-body-bytes", "4096"))
    with pytest.raises(openai.APIStatusError) as err:
        router.client().completions.create(model=MODEL_NAME, prompt="x " * 5000, max_tokens=2)
    assert err.value.status_code == 413
    assert err.value.body["type"] == "PayloadTooLargeError"
    for body in (b"{not json", b"[1, 2]"):
        req = urllib.request.Request(f"{router.url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(req, timeout=10)
        assert http_err.value.code == 400
        answer = _json.loads(http_err.value.read())
        assert answer["error"]["code"] == 400 and answer["error"]["message"]
    assert sum(w.stats()["requests"] for w in workers) == 0


def test_long_request_outlives_the_idle_connection_timeout(cluster, fake_tokenizer):
    """A request that waits on its worker longer than --http-idle-timeout-secs is not an idle
    connection: it is answered."""
    router, workers = cluster(2, router_flags=("--http-idle-timeout-secs", "1"),
                              prefill_delay_s=2.5)
    wid, answer = complete(router, "a slow prompt " + prose(110, 20), max_tokens=2)
    assert answer.choices[0].text == expected_text(fake_tokenizer, wid, 2)


def test_registered_worker_with_http_url_is_served(start_workers, start_router, monkeypatch):
    """A worker added at run time by POST /register, which needs the admin token when one is set
    (otherwise anyone reaching the router could register a "worker" and receive requests)."""
    import json as _json
    import urllib.error
    import urllib.request

    import conftest

    token = "a-token-of-some-length"
    monkeypatch.setenv("KVBM_ROUTER_ADMIN_TOKEN", token)
    first, second = start_workers([1, 2])
    router = start_router([first])
    assert router.workers()[1]["http_url"] == first.url
    body = {"worker_id": 2, "endpoint": f"tcp://127.0.0.1:{second.zmq_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{second.replay_port}", "http_url": second.url}

    def register(auth: str | None) -> int:
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = auth
        req = urllib.request.Request(f"{router.url}/register", data=_json.dumps(body).encode(),
                                     method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    assert register(None) == 401
    assert register("Bearer " + token[:-1] + "x") == 401
    assert set(router.workers()) == {1}
    assert register("Bearer " + token) == 200
    conftest.sync_events(router, [second])
    assert router.workers()[2]["http_url"] == second.url
    first.fail_requests("close")
    wid, _ = complete(router, "hello there " + prose(120, 10), max_tokens=2)
    assert wid == 2
