"""The router's `POST /tokenize` against the reference, live: for each model directory (the
committed fixtures, and one tokenizer this test builds for itself), the expected ids are computed
here, now, with transformers through vLLM 0.33's steps (`vllm_chat_ids` in
tests/data/tokenizer/generate.py, which names the vLLM function behind each step), and the router
binary ($KVBM_ROUTER_BIN, started with `--model-path DIR`) must answer every case with the same
ids, and refuse with a 400 what the reference refuses.

The Rust tests (tests/tokenize.rs) check the same cases against the committed expected.json
without Python; this test is what catches a fixture that no longer matches the installed
transformers, and the HTTP layer's handling of the request fields.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import Process, router_bin

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parent.parent / "data" / "tokenizer"


def load_generator():
    spec = importlib.util.spec_from_file_location("tokenizer_fixture_generator", DATA / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator()

# A template unlike the fixtures' (turn markers built from the role, a system prompt folded into
# the first user turn, alternation enforced with raise_exception, loop.index0 arithmetic, a
# namespace, tojson with sort_keys), for the tokenizer built here.
BUILT_TEMPLATE = r"""{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' -%}
    {%- set ns.system = messages[0]['content'] ~ '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' ~ role ~ '\n' -}}
    {%- if loop.first %}{{ ns.system }}{% endif -%}
    {{- message['content'] | trim -}}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if tools -%}
    {{- '<tools>' ~ (tools | tojson(sort_keys=true)) ~ '</tools>\n' -}}
{%- endif -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

BUILT_CHATS = [
    ("alternating", {"messages": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "  What is a KV block?  "},
        {"role": "assistant", "content": "A fixed run of tokens' keys and values."},
        {"role": "user", "content": "And a prefix hit? 🙂"}]}),
    ("tools_sorted", {"tools": [{"type": "function", "function": {
        "name": "route", "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}}}],
        "messages": [{"role": "user", "content": "Route it."}]}),
    ("not_alternating", {"messages": [
        {"role": "user", "content": "one"}, {"role": "user", "content": "two"}]}),
    ("continue", {"add_generation_prompt": False, "continue_final_message": True, "messages": [
        {"role": "user", "content": "Finish: the cache"},
        {"role": "assistant", "content": "holds"}]}),
]


def build_model(directory: Path) -> Path:
    """A byte-level BPE tokenizer trained here (a different split pattern and vocabulary size
    from the fixtures'), with BUILT_TEMPLATE and a BOS the template writes itself."""
    from tokenizers import processors

    tok = gen.build_tokenizer(gen.QWEN2_SPLIT, specials=["<bos>", "<eos>", "<start_of_turn>",
                                                         "<end_of_turn>"], plain_added=["<tools>"],
                              nfc=False, vocab_size=1200)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 $B:1",
        special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"added_tokens_decoder": gen.added_tokens_decoder(tok), "bos_token": "<bos>",
              "eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": BUILT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def reference_cases(model_dir: Path, content_format: str, chats) -> list[dict]:
    """Every case with what the reference answers: ids, or that it refuses."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cases = []
    for name, text in gen.PROMPTS:
        for add in (True, False):
            cases.append({"name": f"prompt {name} add_special_tokens={add}",
                          "body": {"prompt": text, "add_special_tokens": add},
                          "ids": list(tok.encode(text, add_special_tokens=add))})
    for name, body in chats:
        case = {"name": f"chat {name}", "body": body}
        try:
            _, case["ids"] = gen.vllm_chat_ids(tok, copy.deepcopy(body), content_format)
        except (gen.BadRequest, gen.TemplateFailed) as e:
            case["refused"] = str(e)
        cases.append(case)
    return cases


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def start_router(processes, tmp_path: Path, model_dir: Path) -> str:
    binary = router_bin()
    if binary is None:
        pytest.skip("KVBM_ROUTER_BIN is not set")
    p = Process(f"router-{model_dir.name}", [binary, "--http-port", "0", "--model-path",
                                             str(model_dir)],
                tmp_path / f"router-{model_dir.name}.log")
    processes.append(p)
    prefix = "kvbm-router listening on "
    url = p.first_line(lambda line: line[len(prefix):].strip() if line.startswith(prefix) else None)
    return url.rstrip("/")


def check_router(url: str, cases: list[dict]) -> None:
    failures = []
    for case in cases:
        status, answer = post(f"{url}/tokenize", case["body"])
        if "refused" in case:
            if status != 400:
                failures.append(f"{case['name']}: {status} {answer}, want 400 ({case['refused']})")
            continue
        if status != 200:
            failures.append(f"{case['name']}: {status} {answer}")
        elif answer.get("tokens") != case["ids"] or answer.get("count") != len(case["ids"]):
            failures.append(f"{case['name']}: {answer.get('tokens')} != {case['ids']}")
    assert not failures, f"{len(failures)} of {len(cases)} cases differ:\n" + "\n".join(failures)


FIXTURE_MODELS = [(name, fmt) for name, _, fmt in gen.FIXTURES]


@pytest.mark.parametrize("model,content_format", FIXTURE_MODELS, ids=[m for m, _ in FIXTURE_MODELS])
def test_router_tokenizes_fixture_models_as_the_reference(model, content_format, processes,
                                                           tmp_path):
    model_dir = DATA / model
    if not (model_dir / "tokenizer.json").exists():
        pytest.skip(f"fixture {model_dir} is missing (run generate.py)")
    url = start_router(processes, tmp_path, model_dir)
    chats = gen.CHATS + gen.ERRORS + gen.MODEL_ERRORS.get(model, [])
    check_router(url, reference_cases(model_dir, content_format, chats))


def test_router_tokenizes_a_model_built_here_as_the_reference(processes, tmp_path):
    if router_bin() is None:
        pytest.skip("KVBM_ROUTER_BIN is not set")
    model_dir = build_model(tmp_path / "built")
    cases = reference_cases(model_dir, "string", BUILT_CHATS + gen.CHATS[:6])
    assert any("refused" in c for c in cases) and any("ids" in c for c in cases)
    url = start_router(processes, tmp_path, model_dir)
    check_router(url, cases)
