#!/usr/bin/env python3
"""Builds the tokenizer fixtures the router's tokenizer is tested against, and the ids the
reference path produces for them.

Run from the repository root with the project's virtual environment:

    .venv/bin/python kvbm-router/tests/data/tokenizer/generate.py

Each model directory (`chatml/`, `llama3/`, `parts/`) gets a `tokenizer.json` (a byte-level BPE
trained here on the embedded corpus, so it is deterministic and needs no model hub), a
`tokenizer_config.json` that `transformers.AutoTokenizer.from_pretrained` loads (chat template,
named special tokens, the added-tokens decoder), and `expected.json`: for every case, the ids the
reference produces.

The reference for a plain prompt is `tokenizer.encode(prompt, add_special_tokens=...)`, which is
what vLLM's completion and /tokenize paths do (vllm/renderers/base.py `BaseRenderer._tokenize_prompt`
calls the tokenizer with `TokenizeParams.get_encode_kwargs()`; no truncation when no length
limit applies). For a chat it is `vllm_chat_ids` below, which follows vLLM 0.33 step by step (see
the comments there); vLLM itself cannot be imported here (it needs torch), so the steps are
written out, each naming the vLLM function it follows.

`expected.json` also holds `errors`: requests the reference refuses, with the kind of refusal
("template": the template raised; "bad_request": vLLM or transformers refused the input before or
after rendering).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 3000

# The split patterns of the two families (the GPT-4-style pattern Llama 3 uses, with numbers in
# runs of at most three digits, and the variant Qwen2 uses, with one digit per piece).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog did not mind; it was asleep.",
    "A key-value cache keeps the attention keys and values of every token a model has seen,",
    "so that a request sharing a prefix with an earlier one can skip recomputing that prefix.",
    "Routers send each request to the worker that already holds most of its prefix in memory.",
    "I'm sure they'll say it's fine, but we've seen what happens when you don't check the logs.",
    "She said: \"Don't worry, I'd rather be early than late.\" He replied, 'We're ready.'",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 4096 65536 3.14159 2.71828 1e-9 -17",
    "Dates and times: 2024-07-26, 12:30:45, 26 Jul 2024, Friday, December 2023.",
    "Today Date: Cutting Knowledge Date: Environment: ipython tools functions arguments",
    "You are a helpful assistant. You are a friendly chatbot who answers briefly.",
    "system user assistant tool developer function name description parameters",
    "def hash_block(tokens, parent=None):\n    h = 0\n    for t in tokens:\n        h = (h * 31 + t) & 0xFFFFFFFF\n    return h\n",
    "fn main() {\n    let v: Vec<u32> = (0..16).collect();\n    println!(\"{:?}\", v);\n}\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot product",
    "SELECT id, name FROM workers WHERE load < 0.75 ORDER BY overlap DESC LIMIT 1;",
    "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}",
    "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>\n<tool_response>\nsunny\n</tool_response>",
    "\t\tIndented with tabs\n    and with spaces\n\n\nand blank lines\r\nand CRLF endings\r\n",
    "Unicode: naïve café résumé façade jalapeño Ångström Zürich São Paulo",
    "Deutsch: Grüße aus München, übermäßig schön. Français: où est la bibliothèque ?",
    "Русский: Привет, как дела? Всё хорошо, спасибо.",
    "Ελληνικά: Καλημέρα κόσμε. العربية: مرحبا بالعالم. עברית: שלום עולם.",
    "中文：你好，世界！东京和北京。日本語：こんにちは、世界。한국어: 안녕하세요 세계",
    "Emoji: 🙂 👍 🚀 🔥 ❤️ 👩‍💻 🇫🇷 and symbols: → ← ≤ ≥ ± × ÷ ∑ ∞ € £ ¥ ©",
    "Math: ∀x ∈ ℝ, x² ≥ 0. ∫₀¹ f(x) dx. α β γ δ ε λ μ π σ ω",
]


WORDS = (
    "cache block token prefix worker router request model memory host disk tier event hash "
    "prompt chat template system user assistant tool function call argument result error "
    "timeout retry stream chunk latency throughput queue batch layer head sequence offset "
    "the a an of to in on for with from by at as is are was were be been it this that these "
    "fast slow large small first last next previous every each some many few all none "
    "read write copy move send receive open close start stop run wait check count keep drop "
    "schön grün über café naïve привет мир данные 数据 缓存 模型 キャッシュ 東京 世界 🙂 🚀"
).split()


def corpus_lines() -> list[str]:
    # The corpus above, repeated so its common pieces get merged, plus sentences drawn from WORDS
    # with a fixed seed: every run trains the same merges.
    import random

    rng = random.Random(13)
    lines = CORPUS * 8
    for i in range(4000):
        n = rng.randint(4, 14)
        words = [rng.choice(WORDS) for _ in range(n)]
        if i % 5 == 0:
            words.append(str(rng.randint(0, 10**rng.randint(1, 7))))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";\n", ":\n\t"]))
    return lines


CHATML_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nAnswer a call with a JSON object inside <tool_call></tool_call> tags.<|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.reasoning_content %}
            {{- '\n<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n' }}
        {%- endif %}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- set ns = namespace(turns=0, last_role="") %}

{#- The system message is pulled out of the conversation. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions. Call one with a JSON object.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool', 'ipython'] %}
        {{- raise_exception("Unsupported role '" + message['role'] + "': use user, assistant or tool") }}
    {%- endif %}
    {%- if loop.first and message['role'] == 'assistant' %}
        {{- raise_exception('The conversation must start with a user message after the system prompt') }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- set ns.last_role = message['role'] %}
    {%- if message['role'] == 'assistant' and message.tool_calls is defined %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for tool_call in message.tool_calls %}
            {%- set call = tool_call.function %}
            {{- '{"name": "' + call.name + '", "parameters": ' }}
            {{- call.arguments | tojson }}
            {{- "}" }}
        {%- endfor %}
        {{- "<|eom_id|>" }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- generation %}
        {{- message['content'] | trim }}
        {%- endgeneration %}
        {{- '<|eot_id|>' }}
    {%- elif message['role'] in ['tool', 'ipython'] %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# A template that reads the content parts itself (vLLM's "openai" content format: the parts reach
# the template as a list of {"type": "text", "text": ...} dicts), in the style of the multimodal
# families, with a block-level `strip`/`title` and a macro.
PARTS_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- else -%}
                {{- '<unk>' -}}
            {%- endif -%}
            {%- if not loop.last %} | {% endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{{ bos_token }}
{%- for message in messages %}
{{ '### ' + message['role'] | title + ':\n' }}
{{- render_content(message['content']) | trim }}
{%- if message.tool_calls is defined %}
{{ 'calls: ' + message.tool_calls | tojson }}
{%- endif %}
{{ eos_token if message['role'] == 'assistant' else '' }}
{%- endfor %}
{%- if add_generation_prompt %}
### Assistant:
{% endif %}
"""


def build_tokenizer(split: str, specials: list[str], plain_added: list[str], nfc: bool,
                    vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if plain_added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added])
    return tok


def added_tokens_decoder(tok: Tokenizer) -> dict[str, dict]:
    out = {}
    for idx, at in sorted(tok.get_added_tokens_decoder().items()):
        out[str(idx)] = {
            "content": at.content,
            "lstrip": at.lstrip,
            "normalized": at.normalized,
            "rstrip": at.rstrip,
            "single_word": at.single_word,
            "special": at.special,
        }
    return out


def write_model(name: str, tok: Tokenizer, config: dict) -> Path:
    d = HERE / name
    d.mkdir(exist_ok=True)
    tok.save(str(d / "tokenizer.json"), pretty=False)
    config = {
        "added_tokens_decoder": added_tokens_decoder(tok),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        **config,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return d


def make_chatml() -> Path:
    tok = build_tokenizer(
        QWEN2_SPLIT,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        plain_added=["<think>", "</think>", "<tool_call>", "</tool_call>"],
        nfc=True,
    )
    # Qwen's post-processor adds nothing (ByteLevel with trim_offsets off).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return write_model(
        "chatml",
        tok,
        {
            # As Qwen checkpoints name it: transformers 5 then rebuilds the pipeline from the
            # vocabulary and merges with Qwen2Tokenizer's own normalizer and pre-tokenizer (the same
            # as this tokenizer.json's), keeping the file's post-processor.
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "chat_template": CHATML_TEMPLATE,
        },
    )


def make_llama3() -> Path:
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<|reserved_special_token_0|>",
    ]
    tok = build_tokenizer(LLAMA3_SPLIT, specials=specials, plain_added=[], nfc=False)
    bos = "<|begin_of_text|>"
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            ),
        ]
    )
    return write_model(
        "llama3",
        tok,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": "<|eot_id|>",
            "chat_template": LLAMA3_TEMPLATE,
        },
    )


def make_parts() -> Path:
    # No post-processor in the file, and add_bos_token in the config, which transformers 5 drops
    # when a tokenizer.json exists (tokenization_utils_base.py `_from_pretrained` pops
    # add_bos_token/add_eos_token), so `TokenizersBackend.update_post_processor` builds a
    # post-processor that adds nothing: no BOS on plain encodes; the template writes its own.
    tok = build_tokenizer(LLAMA3_SPLIT, specials=["<s>", "</s>", "<unk>"], plain_added=[], nfc=False)
    write_model(
        "parts",
        tok,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            # The AddedToken form of a named token, as older checkpoints write it.
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                          "normalized": False, "rstrip": False, "single_word": False},
            "eos_token": "</s>",
            "unk_token": "<unk>",
        },
    )
    # The template in its own file, as newer checkpoints ship it.
    (HERE / "parts" / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    return HERE / "parts"


# ---------------------------------------------------------------------------------------------
# The reference: vLLM 0.33's chat path, step by step.
# ---------------------------------------------------------------------------------------------


class BadRequest(Exception):
    """What vLLM answers with 400 before the template runs (or transformers' ValueError)."""


class TemplateFailed(Exception):
    """The template raised (`raise_exception`) or failed while rendering (vLLM: 400)."""


def raised_in_template(e: BaseException) -> bool:
    import jinja2

    if isinstance(e, jinja2.TemplateError):
        return True
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


def _text_of_part(part) -> str | None:
    # vllm/renderers/chat_utils/chat_message.py `parse_chat_message_content_part`: a str part is
    # text; a dict part of a text type ("text", "input_text", "output_text", "refusal",
    # "thinking") gives its text (the refusal part its "refusal", the thinking part its
    # "thinking"); a text part whose text is None is skipped. Media parts are not served here.
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise BadRequest("content part must be an object or a string")
    ptype = part.get("type")
    if ptype is None:
        raise BadRequest("Missing 'type' field in multimodal part.")
    key = {"text": "text", "input_text": "text", "output_text": "text",
           "refusal": "refusal", "thinking": "thinking"}.get(ptype)
    if key is None:
        raise BadRequest(f"unsupported content part type {ptype!r}")
    return part.get(key)


def vllm_conversation(messages: list, content_format: str) -> list[dict]:
    """vllm/renderers/chat_utils/chat_message.py `parse_chat_messages` ->
    `parse_chat_message_content` -> `parse_chat_message_content_parts`, then
    `_postprocess_messages`, for text-only messages."""
    if not isinstance(messages, list):
        raise BadRequest("messages must be a list")
    conversation = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest("each message needs a string role")
        role = msg["role"]
        content = msg.get("content")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise BadRequest("content must be a string, a list of parts or null")
        # (`_strip_claude_code_billing_header` for system messages: only text parts starting with
        # "x-anthropic-billing-header"; not exercised by these cases.)
        texts = [t for t in (_text_of_part(p) for p in content) if t is not None]
        if content_format == "openai":
            out = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
        else:
            out = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                out["tool_calls"] = [validated_tool_call(c) for c in msg["tool_calls"]]
            if msg.get("reasoning") is not None:
                out["reasoning"] = msg["reasoning"]
                out["reasoning_content"] = msg["reasoning"]
        elif role == "tool":
            if "tool_call_id" in msg:
                out["tool_call_id"] = msg["tool_call_id"]
            if isinstance(out["content"], list):
                out["content"] = "\n".join(p["text"] for p in out["content"])
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
        if isinstance(msg.get("task"), str):
            out["task"] = msg["task"]
        if role == "developer":
            out["tools"] = msg.get("tools")
        conversation.append(out)
    # `_postprocess_messages`: tool-call arguments given as a JSON string become a dict.
    for m in conversation:
        calls = m.get("tool_calls")
        if m["role"] != "assistant" or not isinstance(calls, list):
            continue
        if not calls:
            m.pop("tool_calls")
            continue
        for item in calls:
            if not isinstance(item, dict):
                raise BadRequest("assistant tool_calls entries must be objects.")
            fn = item.get("function")
            if item.get("type", "function") != "function" or not isinstance(fn, dict):
                raise BadRequest("chat completions only support assistant tool_calls of type 'function'.")
            args = fn.get("arguments")
            if args:
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        args = None
                if not isinstance(args, dict):
                    args = {}
                fn["arguments"] = args
            else:
                fn["arguments"] = {}
    return conversation


def vllm_developer_to_system(conversation: list[dict], template: str) -> list[dict]:
    """vllm/renderers/hf.py `safe_apply_chat_template`: when a message has role "developer" and the
    template never names that role (`_detect_developer_role_support`), developer messages become
    system messages (`_convert_developer_to_system`) and all system messages are merged into the
    first (`_consolidate_system_messages`)."""
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    if '"developer"' in template or "'developer'" in template:
        return conversation
    converted = []
    for m in conversation:
        if m["role"] == "developer":
            m = dict(m)
            m["role"] = "system"
            m.pop("tools", None)
        converted.append(m)
    system_texts, rest, merge = [], [], False
    for i, m in enumerate(converted):
        if m["role"] == "system":
            if i > 0 or system_texts:
                merge = True
            c = m.get("content", "")
            if isinstance(c, list):
                c = "\n".join(p["text"] if isinstance(p, dict) else p for p in c
                              if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
            if c:
                system_texts.append(c)
        else:
            rest.append(m)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *rest]


# The named parameters of transformers' `apply_chat_template`, which vLLM lets through
# (vllm/renderers/hf.py `_get_hf_base_chat_template_params`).
HF_BASE_PARAMS = {
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


def template_variables(template: str) -> set[str]:
    import jinja2.meta
    import transformers.utils.chat_template_utils as hf

    compiled = hf._compile_jinja_template(template)
    return set(jinja2.meta.find_undeclared_variables(compiled.environment.parse(template)))


def vllm_chat_ids(tok, body: dict, content_format: str) -> tuple[str, list[int]]:
    """The ids vLLM 0.33 computes for a /tokenize chat body (and, with the same fields, for
    /v1/chat/completions):

    1. vllm/entrypoints/serve/tokenize/protocol.py `TokenizeChatRequest`: defaults
       add_generation_prompt=True, continue_final_message=False, add_special_tokens=False;
       `check_generation_prompt` refuses both flags set.
    2. `TokenizeChatRequest.build_chat_params`: chat_template_kwargs = request kwargs overridden by
       add_generation_prompt/continue_final_message (`merge_kwargs`); vllm/renderers/online_renderer.py
       `OnlineRenderer.preprocess_chat` adds defaults tools=<request tools>, tokenize=False (for a
       Hugging Face tokenizer), which the request's kwargs override (`ChatParams.with_defaults`).
    3. vllm/renderers/hf.py `HfRenderer.render_messages_async`: `parse_chat_messages_async`
       (text parts joined with "\\n" for a "string" content-format template), then
       `safe_apply_chat_template`: developer role conversion, `resolve_chat_template_kwargs`
       (keeps the kwargs the template reads or apply_chat_template names), then
       `tokenizer.apply_chat_template(conversation, tools=..., chat_template=..., tokenize=False,
       **kwargs)`.
    4. vllm/renderers/base.py `BaseRenderer._tokenize_prompt`: the rendered text is encoded with
       `add_special_tokens` from the request (False by default for chat).
    """
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    add_generation_prompt = body.get("add_generation_prompt", True)
    continue_final_message = body.get("continue_final_message", False)
    add_special_tokens = body.get("add_special_tokens", False)
    tool_dicts = None if body.get("tools") is None else [tool_model_dump(t) for t in body["tools"]]
    chat_kwargs = merge_kwargs(
        body.get("chat_template_kwargs"),
        dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message),
    )
    defaults = merge_kwargs(None, dict(tools=tool_dicts, tokenize=False))
    kwargs = merge_kwargs(defaults, chat_kwargs)  # ChatParams.with_defaults
    kwargs = merge_kwargs(kwargs, dict(chat_template=None, return_dict=False))  # get_apply_chat_template_kwargs
    # safe_apply_chat_template's own parameters.
    tools = kwargs.pop("tools", None)
    if kwargs.pop("chat_template", None) is not None:
        raise BadRequest("per-request chat templates are refused")
    tokenize = kwargs.pop("tokenize", True)
    if tokenize:
        raise BadRequest("tokenize=True in chat_template_kwargs: not exercised by these fixtures")

    template = tok.get_chat_template(None, tools)
    conversation = vllm_conversation(body["messages"], content_format)
    conversation = vllm_developer_to_system(conversation, template)
    accept = (template_variables(template) | HF_BASE_PARAMS) - {"chat_template", "tokenize"}
    kwargs = {k: v for k, v in kwargs.items() if k in accept}
    try:
        text = tok.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)
    except Exception as e:
        # vLLM answers 400 either way; the fixtures tell a failure inside the template's code
        # ("template") from transformers refusing the input around it ("bad_request").
        if raised_in_template(e):
            raise TemplateFailed(str(e)) from e
        raise BadRequest(str(e)) from e
    ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    return text, list(ids)


def merge_kwargs(defaults: dict | None, overrides: dict | None) -> dict:
    """vllm/renderers/params.py `merge_kwargs`: overrides whose value is None or "auto" do not
    override."""
    defaults = defaults or {}
    overrides = overrides or {}
    return defaults | {k: v for k, v in overrides.items() if v not in (None, "auto")}


def tool_model_dump(tool: dict) -> dict:
    """What `ChatCompletionToolsParam.model_dump()` gives for a request's tool
    (vllm/entrypoints/openai/chat_completion/protocol.py `ChatCompletionToolsParam` and
    vllm/entrypoints/generate/base/protocol.py `FunctionDefinition`): type, function (name,
    description, parameters, then strict and defer_loading when set), then defer_loading when
    set; other keys dropped; a tool's defer_loading is copied into its function when the
    function has none (`_propagate_defer_loading`)."""
    if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise BadRequest("tools must be function tools")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str):
        raise BadRequest("a tool function needs a name")
    out_fn = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
    defer = tool.get("defer_loading")
    fn_defer = fn.get("defer_loading")
    if defer is not None and fn_defer is None:
        fn_defer = defer
    if fn.get("strict") is not None:
        out_fn["strict"] = fn["strict"]
    if fn_defer is not None:
        out_fn["defer_loading"] = fn_defer
    out = {"type": "function", "function": out_fn}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def validated_tool_call(item):
    """A tool call as pydantic leaves it after validating the message against openai's
    TypedDicts (what vLLM's request model does): fields in the TypedDict's order, extras
    dropped."""
    from openai.types.chat import ChatCompletionMessageFunctionToolCallParam
    from pydantic import TypeAdapter

    validated = TypeAdapter(ChatCompletionMessageFunctionToolCallParam).validate_python(item)
    return json.loads(json.dumps(validated))


# ---------------------------------------------------------------------------------------------
# The cases.
# ---------------------------------------------------------------------------------------------

PROMPTS = [
    ("english", "The quick brown fox jumps over the lazy dog."),
    ("leading_space", " leading space and trailing space "),
    ("empty", ""),
    ("whitespace_runs", "a    b\n\n\n  c\t\td   \n   e"),
    ("crlf", "line one\r\nline two\r\n\r\nend"),
    ("numbers", "1234567 3.14159 2024-07-26 0x7FFF -42 1e-9 10000000000"),
    ("contractions", "I'm sure they'LL say it's fine, WE'VE seen it; don't."),
    ("code_python", "def f(x):\n    return x * 2  # double\n\n\nprint(f(21))\n"),
    ("code_rust", "fn main() { let v: Vec<u32> = (0..16).collect(); }"),
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'),
    ("unicode_latin", "naïve café résumé — Zürich, São Paulo, Ångström"),
    ("unicode_cjk", "你好，世界！こんにちは、世界。안녕하세요"),
    ("unicode_emoji", "ok 🙂👍🚀 family 👩‍💻 flag 🇫🇷 heart ❤️"),
    ("unicode_rare", "unseen: ᚠᛇᚻ ꧁꧂ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u0000 \ufeff bom"),
    ("nfc_decomposed", "cafe\u0301 and e\u0301te\u0301"),
    ("special_text", "<|im_start|>user\nhi<|im_end|> <|begin_of_text|><|eot_id|> <s></s>"),
    ("plain_added", "<think>hmm</think> <tool_call>x</tool_call>"),
    ("long", "The router sends each request to the worker holding its prefix. " * 40),
]

CHATS = [
    ("user_only", {"messages": [{"role": "user", "content": "Hello there!"}]}),
    ("system_and_user", {"messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is a KV cache?"}]}),
    ("multi_turn", {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about routers."}]}),
    ("no_generation_prompt", {"add_generation_prompt": False, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}]}),
    ("continue_final_message", {"add_generation_prompt": False, "continue_final_message": True,
                                "messages": [
        {"role": "user", "content": "Write a haiku about caches."},
        {"role": "assistant", "content": "Blocks of memory "}]}),
    ("continue_final_parts", {"add_generation_prompt": False, "continue_final_message": True,
                              "messages": [
        {"role": "user", "content": "Count to five."},
        {"role": "assistant", "content": [{"type": "text", "text": "One, two,"},
                                          {"type": "text", "text": "three"}]}]}),
    ("content_parts", {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "First part."},
                                     {"type": "text", "text": "Second part."},
                                     "a bare string part"]}]}),
    ("content_parts_input_text", {"messages": [
        {"role": "user", "content": [{"type": "input_text", "text": "Alpha"},
                                     {"type": "text", "text": None},
                                     {"type": "text", "text": "Beta"}]}]}),
    ("add_special_tokens", {"add_special_tokens": True, "messages": [
        {"role": "user", "content": "Does the BOS come twice?"}]}),
    ("unicode_messages", {"messages": [
        {"role": "system", "content": "Réponds en français, s'il te plaît. 🙂"},
        {"role": "user", "content": "東京の天気は？  Привет!\n\n\tTabs too."}]}),
    ("special_tokens_in_content", {"messages": [
        {"role": "user", "content": "Ignore this: <|im_end|><|eot_id|><|start_header_id|>"}]}),
    ("whitespace_content", {"messages": [
        {"role": "system", "content": "   padded system   \n"},
        {"role": "user", "content": "\n\n  padded user  \n\n"}]}),
    ("empty_content", {"messages": [{"role": "user", "content": ""}]}),
    ("null_content", {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Still there?"}]}),
    ("name_field", {"messages": [{"role": "user", "content": "Hi", "name": "alice"}]}),
    ("reasoning", {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "\nSimple arithmetic.\n"},
        {"role": "user", "content": "And 3+3?"}]}),
    ("kwargs_thinking_off", {"chat_template_kwargs": {"enable_thinking": False},
                             "messages": [{"role": "user", "content": "Quick answer please."}]}),
    ("kwargs_date", {"chat_template_kwargs": {"date_string": "01 Jan 2026", "unused": [1, 2]},
                     "messages": [{"role": "user", "content": "What day is it?"}]}),
    ("kwargs_override_bos", {"chat_template_kwargs": {"bos_token": "<|reserved_special_token_0|>"},
                             "messages": [{"role": "user", "content": "Custom BOS."}]}),
    ("kwargs_generation_flag_ignored", {"add_generation_prompt": False,
                                        "chat_template_kwargs": {"add_generation_prompt": True},
                                        "messages": [{"role": "user", "content": "Flag?"}]}),
    ("tools", {"tools": [
        {"type": "function", "function": {
            "name": "get_weather", "description": "Weather for a city <with> 'quotes' & \"more\"",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "ratio": {"type": "number", "default": 0.5},
                "flags": {"type": "array", "items": {"type": "boolean"}, "default": [True, False, None]}},
                "required": ["city"]}}}],
        "messages": [{"role": "user", "content": "Weather in Paris?"}]}),
    ("tool_calls", {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2, \"note\": \"é/ü\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24°C"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Also windy"}]},
        {"role": "user", "content": "Thanks!"}]}),
    ("tool_calls_bad_arguments", {"messages": [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}},
            {"id": "d", "type": "function", "function": {"name": "g", "arguments": "[1, 2]"}},
            {"id": "e", "type": "function", "function": {"name": "h", "arguments": ""}}]},
        {"role": "tool", "content": "done"}]}),
    ("tools_sparse", {"tools": [
        {"function": {"name": "ping"}, "extra_key": 1},
        {"type": "function", "defer_loading": True,
         "function": {"name": "lookup", "description": "Find \u00e9l\u00e8ves", "strict": True,
                      "parameters": {"type": "object", "properties": {}}, "unknown": "x"}}],
        "messages": [{"role": "user", "content": "Ping?"}]}),
    ("tool_call_key_order", {"messages": [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [1.5, 2e20, true, null]}"},
             "id": "x1", "extra": "dropped"}]},
        {"role": "tool", "content": "ok"}]}),
    ("kwargs_null_and_auto", {"chat_template_kwargs": {"enable_thinking": None, "date_string": "auto"},
                              "messages": [{"role": "user", "content": "Defaults stay."}]}),
    ("kwargs_tools_override", {"tools": [{"type": "function", "function": {"name": "a"}}],
                               "chat_template_kwargs": {"tools": [{"name": "from_kwargs"}]},
                               "messages": [{"role": "user", "content": "Which tools?"}]}),
    ("developer_role", {"messages": [
        {"role": "system", "content": "System one."},
        {"role": "developer", "content": "Developer rules."},
        {"role": "user", "content": "Hi"}]}),
    ("second_system", {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Late system note."},
        {"role": "user", "content": "Again"}]}),
]

ERRORS = [
    ("both_flags", {"add_generation_prompt": True, "continue_final_message": True,
                    "messages": [{"role": "user", "content": "x"}]}),
    ("empty_conversation", {"messages": []}),
]

MODEL_ERRORS = {
    "llama3": [
        ("bad_role", {"messages": [{"role": "critic", "content": "this is bad"}]}),
        ("assistant_first", {"messages": [
            {"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}),
    ],
}


def generate_expected(model_dir: Path, content_format: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = []
    for name, text in PROMPTS:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            prompts.append({"name": name, "prompt": text, "add_special_tokens": add, "ids": list(ids)})
    chats = []
    errors = []
    for name, body in CHATS + ERRORS + MODEL_ERRORS.get(model_dir.name, []):
        try:
            text, ids = vllm_chat_ids(tok, copy.deepcopy(body), content_format)
        except BadRequest as e:
            errors.append({"name": name, "request": body, "error": "bad_request", "message": str(e)})
            continue
        except TemplateFailed as e:
            errors.append({"name": name, "request": body, "error": "template", "message": str(e)})
            continue
        chats.append({"name": name, "request": body, "text": text, "ids": ids})
    return {
        "generated_by": "kvbm-router/tests/data/tokenizer/generate.py",
        "content_format": content_format,
        "prompts": prompts,
        "chats": chats,
        "errors": errors,
    }


# ---------------------------------------------------------------------------------------------
# Jinja cases: one feature of transformers' Jinja2 environment each, rendered as the model's chat
# template (with the chatml tokenizer, bos "<s>", eos "</s>") through the same reference path.
# ---------------------------------------------------------------------------------------------

JINJA_VALUES = {
    "xs": ["a", "b", "c"],
    "obj": {"a": 1, "k": "v", "n": None, "f": 1.5, "nested": {"l": [1, "two", None, True]},
            "html": "<&>'\"", "uni": "é😀"},
    "objs": [{"n": 1, "s": "x"}, {"n": 3, "s": "y"}, {"n": 2, "s": "z"}],
    "s": "  xa b\u001fAa x\n",
    "nums": [3, 1.5, -2, 10000000000000000.0, 1e-05],
}

JINJA_CASES = [
    ("print_literals", "{{ true }}|{{ false }}|{{ none }}|{{ True }}|{{ None }}|{{ 1.0 }}|{{ 2.5e20 }}|{{ 0.00001 }}|{{ 7 }}|{{ -3 }}|{{ -0.0 }}"),
    ("print_values", "{{ nums }}|{% for n in nums %}{{ n }};{% endfor %}|{{ obj.f }}|{{ obj.n }}"),
    ("print_containers", "{{ [1, 'a', none, true, 1.5] }}|{{ {'k': 'v', 'n': none} }}|{{ messages[0] }}|{{ obj }}"),
    ("print_reprs", "{{ [\"it's\", 'say \"hi\"', 'both \\' \"', 'tab\there', 'nl\n', 'uni é'] }}"),
    ("tojson_default", "{{ obj | tojson }}|{{ xs | tojson }}|{{ 'x' | tojson }}|{{ none | tojson }}|{{ nums | tojson }}"),
    ("tojson_indent", "{{ obj | tojson(indent=2) }}|{{ xs | tojson(indent=0) }}|{{ objs | tojson(indent='\t') }}|{{ {} | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}"),
    ("tojson_options", "{{ obj | tojson(sort_keys=true) }}|{{ obj | tojson(ensure_ascii=true) }}|{{ obj | tojson(separators=(',', ':')) }}|{{ obj | tojson(true) }}"),
    ("tojson_escapes", "{{ '\u0001\u007f\u2028 \\\\ \"q\" \n\t😀é' | tojson }}|{{ '\u0001\u007f😀é' | tojson(ensure_ascii=true) }}"),
    ("tojson_messages", "{{ messages | tojson }}"),
    ("str_methods_space", "[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}][{{ s.split() }}]"),
    ("str_methods", "[{{ s.strip('x ') }}][{{ 'a,b,,c'.split(',') }}][{{ 'a b c'.split(' ', 1) }}][{{ s.upper() }}][{{ s.lower() }}][{{ 'hello wORLD'.title() }}][{{ 'hELLO'.capitalize() }}][{{ s.replace('a', 'b') }}][{{ s.startswith('  x') }}][{{ s.endswith('x') }}][{{ s.find('a') }}][{{ s.count('a') }}][{{ ', '.join(xs) }}]"),
    ("dict_methods", "{% for k, v in obj.items() %}{{ k }}={{ v }};{% endfor %}|{{ obj.keys() | list }}|{{ obj.values() | list | length }}|{{ obj.get('missing', 'dflt') }}|{{ obj.get('a') }}|{{ obj.get('missing') }}"),
    ("filters_lists", "{{ xs | join(', ') }}|{{ [true, none, 1.5, 'x'] | join('-') }}|{{ xs | length }}|{{ xs | first }}|{{ xs | last }}|{{ xs | reverse | list }}|{{ ['b', 'c', 'a'] | sort | list }}|{{ ['a', 'b', 'a'] | unique | list }}|{{ xs | map('upper') | list }}|{{ objs | map(attribute='n') | join }}|{{ objs | selectattr('n', 'equalto', 2) | list | length }}|{{ objs | sort(attribute='n', reverse=true) | map(attribute='s') | join }}|{{ xs | select('equalto', 'b') | list }}|{{ xs | reject('equalto', 'b') | list }}|{{ objs | join(', ', attribute='s') }}"),
    ("filters_values", "{{ missing | default('d') }}|{{ '' | default('d', true) }}|{{ s | trim }}|{{ 'xxhixx' | trim('x') }}|{{ 3.7 | int }}|{{ '42' | int + 1 }}|{{ 2 | float }}|{{ 1 | string }}|{{ true | string }}|{{ none | string }}|{{ [1, true] | string }}|{{ 'straße' | upper }}|{{ 'hello world-foo bar_baz' | title }}|{{ 'hELLO wORLD' | capitalize }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ 'abc' | list }}|{{ obj | length }}|{{ 'a\nb' | indent(2) }}"),
    ("filters_round", "{{ 3.14159 | round(2) }}|{{ 2.7 | round }}|{{ 2.4 | round(0, 'ceil') }}|{{ -3 | abs }}"),
    ("filters_dicts", "{% for k, v in obj | dictsort %}{{ k }};{% endfor %}|{% for k, v in obj | items %}{{ k }};{% endfor %}"),
    ("tests", "{{ 'a' is string }}{{ xs is sequence }}{{ 'a' is sequence }}{{ obj is sequence }}{{ obj is mapping }}{{ xs is mapping }}{{ 1 is number }}{{ true is number }}{{ 1 is integer }}{{ true is integer }}{{ 1.0 is float }}{{ none is none }}{{ missing is defined }}{{ missing is undefined }}{{ xs is iterable }}{{ 1 is iterable }}{{ 'a' is iterable }}{{ obj is iterable }}{{ missing is iterable }}{{ missing is sequence }}{{ true is true }}{{ 1 is true }}{{ false is false }}{{ true is boolean }}{{ 3 is odd }}{{ 4 is even }}{{ 6 is divisibleby 3 }}"),
    ("loops", "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }}{% if not loop.first %}<{{ loop.previtem }}{% endif %}{% if not loop.last %}>{{ loop.nextitem }}{% endif %}{{ loop.cycle('o', 'e') }};{% endfor %}"),
    ("loop_controls", "{% for x in xs %}{% if x == 'b' %}{% continue %}{% endif %}{{ x }}{% endfor %}|{% for x in xs %}{% if x == 'b' %}{% break %}{% endif %}{{ x }}{% endfor %}|{% for x in [] %}{{ x }}{% else %}empty{% endfor %}|{% for x in xs if x != 'a' %}{{ loop.index }}{{ x }}{% endfor %}"),
    ("loop_nested", "{% for a in xs %}{% for b in xs %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }}|{% endfor %}"),
    ("loop_string_and_dict", "{% for c in 'abc' %}{{ c }},{% endfor %}|{% for k in obj %}{{ k }},{% endfor %}"),
    ("namespace", "{% set ns = namespace(c=0, s='', found=false) %}{% for x in xs %}{% set ns.c = ns.c + 1 %}{% set ns.s = ns.s ~ x %}{% if x == 'b' %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.c }} {{ ns.s }} {{ ns.found }}"),
    ("scoping", "{% set x = 'outer' %}{% for i in [1] %}{% set x = 'inner' %}{{ x }}{% endfor %}{{ x }}{% if true %}{% set y = 'if-set' %}{% endif %}{{ y }}"),
    ("whitespace_blocks", "{% for m in messages %}\n  {% if m.role == 'user' %}\n    U: {{ m.content }}\n  {% endif %}\n{% endfor %}\nend\n"),
    ("whitespace_markers", "A  {%- if true -%}  B  {%+ if true %}C{% endif %}{% endif %}\n  {{- ' D ' -}}  E\n  {{ 'F' }}  \n\n"),
    ("whitespace_comments", "a\n  {# a comment #}\nb\n{#- trimmed -#}\n  c {# inline #} d\n"),
    ("whitespace_trailing_newlines", "x\n\n"),
    ("set_block", "{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]"),
    ("macros", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} {{ greet('b', punct='?') }} {{ greet(name='c') }}"),
    ("macro_caller", "{% macro wrap() %}[{{ caller() }}]{% endmacro %}{% call wrap() %}inside {{ xs[0] }}{% endcall %}"),
    ("slicing", "{{ xs[1:] }}|{{ xs[-1] }}|{{ xs[::-1] }}|{{ s[2:4] }}|{{ messages[-1].content }}|{{ xs[:-1] }}|{{ xs[10] }}|{{ 'hello'[1] }}"),
    ("operators", "{{ 'a' in xs }} {{ 'k' in obj }} {{ 'ell' in 'hello' }} {{ 'z' not in xs }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }} {{ 1 + 2.5 }} {{ -7 // 2 }} {{ 10 / 5 }} {{ 0.1 + 0.2 }} {{ 'a' ~ 1 ~ 2.5 }} {{ 'x' * 3 }} {{ [1] + [2] }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] == [1, 2] }} {{ none or 'x' }} {{ 'a' and 'b' }} {{ 0 or [] }} {{ 'y' if true else 'n' }}[{{ 'y' if none }}] {{ not xs }}"),
    ("literals", "{{ dict(a=1, b='two') }} {{ {'x': [1, {'y': none}]} | tojson }} {{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ (1, 2) | list }} {{ 'a\\nb' }} {{ \"q'uote\" }}"),
    ("format", "{{ '%s-%d' | format('a', 3) }} {{ '{}-{}'.format('a', 3) }} {{ '{x}!'.format(x=1) }}"),
    ("generation_block", "{% for m in messages %}{% generation %}\n  {{ m.content }}\n{% endgeneration %}|{%- generation -%}  trimmed  {%- endgeneration -%}|{% endfor %}"),
    ("raw", "{% raw %}{{ not rendered }}{% endraw %}"),
    ("undefined_prints_empty", "[{{ missing }}][{{ messages[5] }}][{{ obj.missing }}][{{ obj['missing'] }}][{{ missing | length }}]"),
    ("undefined_attribute_fails", "{{ missing.attr }}"),
    ("none_attribute", "{% set n = none %}[{{ n.attr }}]"),
    ("raise_exception", "{% if messages | length < 5 %}{{ raise_exception('need 5 messages, got ' ~ (messages | length)) }}{% endif %}"),
    ("zero_division", "{{ 1 / 0 }}"),
    ("concat_type_error", "{{ 'a' + 1 }}"),
    ("special_tokens", "{{ bos_token }}|{{ eos_token }}|{{ unk_token is defined }}|{{ pad_token }}"),
    ("flags", "{{ add_generation_prompt }}|{{ tools }}|{{ documents }}|{{ continue_final_message is defined }}"),
]


def generate_jinja_cases() -> dict:
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(HERE / "chatml" / "tokenizer.json", Path(tmp) / "tokenizer.json")
        config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ 1 }}"}
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
        tok = AutoTokenizer.from_pretrained(tmp)
    cases = []
    for name, template in JINJA_CASES:
        body = {"messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": copy.deepcopy(JINJA_VALUES)}
        tok.chat_template = template
        case = {"name": name, "template": template, "request": body}
        try:
            text, _ = vllm_chat_ids(tok, copy.deepcopy(body), "string")
            case["text"] = text
        except TemplateFailed as e:
            case["error"], case["message"] = "template", str(e)
        except BadRequest as e:
            case["error"], case["message"] = "bad_request", str(e)
        cases.append(case)
    return {"generated_by": "kvbm-router/tests/data/tokenizer/generate.py", "cases": cases}


FIXTURES = [("chatml", make_chatml, "string"), ("llama3", make_llama3, "string"),
            ("parts", make_parts, "openai")]


def main() -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name, make, content_format in FIXTURES:
        d = make()
        expected = generate_expected(d, content_format)
        (d / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
        size = (d / "tokenizer.json").stat().st_size
        print(f"{name}: tokenizer.json {size} bytes, {len(expected['prompts'])} prompts, "
              f"{len(expected['chats'])} chats, {len(expected['errors'])} errors")
    jinja = generate_jinja_cases()
    (HERE / "jinja_cases.json").write_text(json.dumps(jinja, indent=1, ensure_ascii=False) + "\n")
    print(f"jinja_cases.json: {len(jinja['cases'])} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
