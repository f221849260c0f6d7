//! The router's tokenizer against the reference: every case of the committed fixtures
//! (`tests/data/tokenizer/<model>/expected.json`, written by `generate.py` from transformers and
//! vLLM 0.33's chat path) must give the same text and the same ids; the Jinja cases
//! (`tests/data/tokenizer/jinja_cases.json`) check the template environment against Jinja2
//! feature by feature; and the refusals (no template, a template that raises, malformed
//! requests, the work bounds) must come back as the right error.

use std::path::{Path, PathBuf};

use kvbm_router::tokenize::{ChatRequest, ContentFormat, ModelTokenizer, TokenizeError};
use serde_json::{json, Value};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer")
}

fn load(model: &str) -> ModelTokenizer {
    ModelTokenizer::from_dir(&data_dir().join(model)).unwrap_or_else(|e| panic!("{model}: {e}"))
}

fn expected(model: &str) -> Value {
    let text = std::fs::read_to_string(data_dir().join(model).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The error kinds expected.json names.
fn kind(e: &TokenizeError) -> &'static str {
    match e {
        TokenizeError::BadRequest(_) => "bad_request",
        TokenizeError::NoChatTemplate => "no_chat_template",
        TokenizeError::Template(_) => "template",
        TokenizeError::Load(_) => "load",
        TokenizeError::Encode(_) => "encode",
    }
}

/// Tokenizes one chat body; the rendered text and the ids, or the error.
fn chat(tok: &ModelTokenizer, body: &Value) -> Result<(String, Vec<u32>), TokenizeError> {
    let request = ChatRequest::from_body(body)?;
    let text = tok.render_chat(&request)?;
    let ids = tok.encode_chat(&request)?;
    Ok((text, ids))
}

/// Every case of one model's expected.json; returns how many were checked.
fn check_model(model: &str) -> usize {
    let tok = load(model);
    let exp = expected(model);
    let mut failures = Vec::new();
    let mut checked = 0;
    for case in exp["prompts"].as_array().unwrap() {
        let add = case["add_special_tokens"].as_bool().unwrap();
        let got = tok
            .encode_prompt(case["prompt"].as_str().unwrap(), add)
            .unwrap();
        if got != ids(&case["ids"]) {
            failures.push(format!(
                "prompt {} (add_special_tokens={add}): {got:?} != {}",
                case["name"], case["ids"]
            ));
        }
        checked += 1;
    }
    for case in exp["chats"].as_array().unwrap() {
        match chat(&tok, &case["request"]) {
            Ok((text, got)) => {
                if text != case["text"].as_str().unwrap() {
                    failures.push(format!(
                        "chat {}: text {text:?} != {}",
                        case["name"], case["text"]
                    ));
                } else if got != ids(&case["ids"]) {
                    failures.push(format!(
                        "chat {}: ids {got:?} != {}",
                        case["name"], case["ids"]
                    ));
                }
            }
            Err(e) => failures.push(format!("chat {}: {e}", case["name"])),
        }
        checked += 1;
    }
    for case in exp["errors"].as_array().unwrap() {
        let want = case["error"].as_str().unwrap();
        match chat(&tok, &case["request"]) {
            Ok((text, _)) => failures.push(format!(
                "error {}: rendered {text:?}, want {want}",
                case["name"]
            )),
            Err(e) if kind(&e) != want => failures.push(format!(
                "error {}: {e} is {}, want {want}",
                case["name"],
                kind(&e)
            )),
            Err(_) => {}
        }
        checked += 1;
    }
    assert!(
        failures.is_empty(),
        "{model}: {} of {checked} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    checked
}

#[test]
fn chatml_matches_reference() {
    assert!(check_model("chatml") > 50);
}

#[test]
fn llama3_matches_reference() {
    assert!(check_model("llama3") > 50);
}

#[test]
fn parts_matches_reference() {
    assert!(check_model("parts") > 50);
}

#[test]
fn content_formats_as_vllm_detects_them() {
    assert_eq!(load("chatml").content_format(), Some(ContentFormat::String));
    assert_eq!(load("llama3").content_format(), Some(ContentFormat::String));
    assert_eq!(load("parts").content_format(), Some(ContentFormat::OpenAi));
}

/// Each Jinja case renders its template (as the model's chat template) with its request, as
/// transformers' Jinja2 environment does.
#[test]
fn jinja_environment_matches_jinja2() {
    let text = std::fs::read_to_string(data_dir().join("jinja_cases.json")).unwrap();
    let cases: Value = serde_json::from_str(&text).unwrap();
    let tokenizer_json = std::fs::read(data_dir().join("chatml/tokenizer.json")).unwrap();
    let mut failures = Vec::new();
    let cases = cases["cases"].as_array().unwrap();
    for case in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), &tokenizer_json).unwrap();
        let config =
            json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": case["template"]});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let tok = ModelTokenizer::from_dir(dir.path()).unwrap();
        let got = ChatRequest::from_body(&case["request"]).and_then(|r| tok.render_chat(&r));
        match (&got, case.get("text"), case.get("error")) {
            (Ok(text), Some(want), _) if text == want.as_str().unwrap() => {}
            (Err(e), _, Some(want)) if kind(e) == want.as_str().unwrap() => {}
            _ => failures.push(format!(
                "{}: got {got:?}, want {}",
                case["name"],
                case.get("text").or(case.get("error")).unwrap()
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} Jinja cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// A model directory in a temporary folder: the chatml tokenizer with `config` as its
/// tokenizer_config.json.
fn model_with(config: Value) -> (tempfile::TempDir, ModelTokenizer) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        data_dir().join("chatml/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let tok = ModelTokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}

fn user(text: &str) -> Value {
    json!({"messages": [{"role": "user", "content": text}]})
}

#[test]
fn a_model_without_a_template_refuses_chats_but_encodes_prompts() {
    let (_dir, tok) = model_with(json!({"eos_token": "<|im_end|>"}));
    assert!(!tok.has_chat_template());
    let request = ChatRequest::from_body(&user("hi")).unwrap();
    assert!(matches!(
        tok.encode_chat(&request),
        Err(TokenizeError::NoChatTemplate)
    ));
    assert!(!tok.encode_prompt("hi", true).unwrap().is_empty());
    // No tokenizer_config.json at all is the same.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        data_dir().join("chatml/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let tok = ModelTokenizer::from_dir(dir.path()).unwrap();
    assert!(matches!(
        tok.encode_chat(&request),
        Err(TokenizeError::NoChatTemplate)
    ));
}

#[test]
fn loading_failures_are_load_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        ModelTokenizer::from_dir(dir.path()),
        Err(TokenizeError::Load(_))
    ));
    std::fs::write(dir.path().join("tokenizer.json"), "{not json").unwrap();
    assert!(matches!(
        ModelTokenizer::from_dir(dir.path()),
        Err(TokenizeError::Load(_))
    ));
    std::fs::copy(
        data_dir().join("chatml/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "[1,").unwrap();
    assert!(matches!(
        ModelTokenizer::from_dir(dir.path()),
        Err(TokenizeError::Load(_))
    ));
}

#[test]
fn templates_that_raise_or_fail_are_template_errors() {
    for (name, template, want) in [
        (
            "raise",
            "{{ raise_exception('no ' + messages[0].role + ' here') }}",
            "no user here",
        ),
        (
            "undefined_attribute",
            "{{ messages[0].nothing.deeper }}",
            "",
        ),
        ("bad_call", "{{ messages[0].content.nope() }}", ""),
        ("syntax", "{% for m in messages %}{{ m.content }}", ""),
        (
            "fuel",
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "fuel",
        ),
        (
            "output_size",
            "{% for i in range(40) %}{{ messages[0].content * 1000000 }}{% endfor %}",
            "",
        ),
        (
            "tojson_undefined",
            "{{ nothing | tojson }}",
            "not JSON serializable",
        ),
    ] {
        let (_dir, tok) = model_with(json!({"chat_template": template}));
        let request = ChatRequest::from_body(&user("hi")).unwrap();
        match tok.encode_chat(&request) {
            Err(TokenizeError::Template(message)) => {
                assert!(message.contains(want), "{name}: {message:?} lacks {want:?}")
            }
            other => panic!("{name}: {other:?}"),
        }
    }
}

#[test]
fn malformed_requests_are_bad_requests() {
    let tok = load("chatml");
    for (name, body) in [
        ("not_an_object", json!([1, 2])),
        ("no_messages", json!({"prompt": "x"})),
        ("messages_not_a_list", json!({"messages": {"role": "user"}})),
        ("message_not_an_object", json!({"messages": ["hi"]})),
        ("no_role", json!({"messages": [{"content": "hi"}]})),
        (
            "role_not_a_string",
            json!({"messages": [{"role": 3, "content": "hi"}]}),
        ),
        (
            "content_a_number",
            json!({"messages": [{"role": "user", "content": 5}]}),
        ),
        (
            "image_part",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
        ),
        (
            "untyped_part",
            json!({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}),
        ),
        (
            "unknown_part",
            json!({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}),
        ),
        (
            "text_not_a_string",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}),
        ),
        (
            "both_flags",
            json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": true, "continue_final_message": true}),
        ),
        (
            "flag_not_a_bool",
            json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "maybe"}),
        ),
        (
            "request_template",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}),
        ),
        (
            "kwargs_template",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
        ),
        (
            "kwargs_not_an_object",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}),
        ),
        (
            "kwargs_messages",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}),
        ),
        (
            "kwargs_sanitize",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"sanitize_control_tokens": true}}),
        ),
        (
            "tools_not_a_list",
            json!({"messages": [{"role": "user", "content": "x"}], "tools": {"type": "function"}}),
        ),
        (
            "tool_without_name",
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]}),
        ),
        (
            "tool_wrong_type",
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
        ),
        (
            "tool_call_not_function",
            json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "custom", "custom": {}}]}]}),
        ),
        ("empty", json!({"messages": []})),
        (
            "continue_without_content_in_template",
            json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false, "continue_final_message": true, "chat_template_kwargs": {}}),
        ),
    ] {
        let result = ChatRequest::from_body(&body).and_then(|r| tok.encode_chat(&r));
        // The chatml template names "content", so its continue case renders: checked below.
        if name == "continue_without_content_in_template" {
            assert!(result.is_ok(), "{name}: {result:?}");
            continue;
        }
        assert!(
            matches!(result, Err(TokenizeError::BadRequest(_))),
            "{name}: {result:?}"
        );
    }
    // A template that never names "content" cannot continue a final message (transformers).
    let (_dir, tok) =
        model_with(json!({"chat_template": "{% for m in messages %}{{ m['role'] }}{% endfor %}"}));
    let body = json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false, "continue_final_message": true});
    let result = ChatRequest::from_body(&body).and_then(|r| tok.encode_chat(&r));
    assert!(
        matches!(result, Err(TokenizeError::BadRequest(_))),
        "{result:?}"
    );
}

#[test]
fn sizes_are_bounded() {
    let tok = load("chatml");
    let big = "a".repeat(kvbm_router::tokenize::PROMPT_BYTES_MAX + 1);
    assert!(matches!(
        tok.encode_prompt(&big, false),
        Err(TokenizeError::BadRequest(_))
    ));
    let request = ChatRequest::from_body(&user(&big)).unwrap();
    assert!(matches!(
        tok.encode_chat(&request),
        Err(TokenizeError::BadRequest(_))
    ));
    // A long but allowed chat goes through within the fuel budget.
    let turns: Vec<Value> = (0..256)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("turn {i} ").repeat(200)}))
        .collect();
    let request = ChatRequest::from_body(&json!({"messages": turns})).unwrap();
    assert!(tok.encode_chat(&request).unwrap().len() > 100_000);
}

#[test]
fn named_templates_pick_tool_use_for_tools() {
    let (_dir, tok) = model_with(json!({"chat_template": [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"}
    ]}));
    let plain = ChatRequest::from_body(&user("x")).unwrap();
    assert_eq!(tok.render_chat(&plain).unwrap(), "Dx");
    let with_tools = ChatRequest::from_body(&json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]})).unwrap();
    assert_eq!(tok.render_chat(&with_tools).unwrap(), "T1");
    // chat_template.jinja takes priority over the config's template.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        data_dir().join("chatml/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        json!({"chat_template": "config"}).to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "file {{ messages | length }}\n",
    )
    .unwrap();
    let tok = ModelTokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.render_chat(&plain).unwrap(), "file 1");
}

#[test]
fn strftime_now_writes_today() {
    let (_dir, tok) = model_with(json!({"chat_template": "{{ strftime_now('%Y-%m-%d') }}"}));
    let text = tok
        .render_chat(&ChatRequest::from_body(&user("x")).unwrap())
        .unwrap();
    assert_eq!(text.len(), 10, "{text}");
    assert!(text.starts_with("20"), "{text}");
}

#[test]
fn strftime_now_refuses_a_huge_format() {
    // A format the template builds for itself: bounded by fuel only, its output several times
    // longer (`%A` is 9 bytes for 2).
    let (_dir, tok) = model_with(json!({"chat_template": "{{ strftime_now('%A' * 200000) }}"}));
    let e = match tok.render_chat(&ChatRequest::from_body(&user("x")).unwrap()) {
        Ok(text) => panic!("rendered {} bytes", text.len()),
        Err(e) => e,
    };
    assert_eq!(kind(&e), "template", "{e}");
    assert!(e.to_string().contains("at most 256"), "{e}");
    // A format at the cap still works.
    let (_dir, tok) = model_with(json!({"chat_template": "{{ strftime_now('%Y' * 128) }}"}));
    let text = tok
        .render_chat(&ChatRequest::from_body(&user("x")).unwrap())
        .unwrap();
    assert_eq!(text.len(), 4 * 128);
}

/// A long text with what moves word boundaries: special tokens, line ends, runs of spaces,
/// digits, letters with accents and other scripts, and one word longer than a tokenizing window.
fn long_text(specials: &[&str]) -> String {
    let mut text = String::new();
    let mut i = 0usize;
    while text.len() < 150_000 {
        let piece = match i % 9 {
            0 => "The router's index holds 1234567 blocks; it's fast.".to_owned(),
            1 => "\r\n\n   \t ".to_owned(),
            2 => specials[i % specials.len()].to_owned(),
            3 => " déjà vu — 日本語のテキスト ".to_owned(),
            4 => "    indented(x) == y?!\n".to_owned(),
            5 => format!("{i}{i}{i}"),
            6 if i == 6 * 9 + 6 => "w".repeat(70_000),
            _ => " and so on, ".to_owned(),
        };
        text.push_str(&piece);
        i += 1;
    }
    text
}

#[test]
fn long_prompts_get_the_ids_of_a_whole_encode() {
    for (model, specials) in [
        ("chatml", &["<|im_start|>", "<|im_end|>", "<think>"][..]),
        ("llama3", &["<|begin_of_text|>", "<|eot_id|>"][..]),
        ("parts", &["<s>", "</s>"][..]),
    ] {
        let tok = load(model);
        let text = long_text(specials);
        // One of the two settings per model, by turns (each encode takes seconds in a debug build).
        let add = model != "llama3";
        let windowed = tok.encode_prompt(&text, add).unwrap();
        let whole = tok.encode_whole(&text, add).unwrap();
        assert_eq!(windowed.len(), whole.len(), "{model} add={add}");
        assert!(windowed == whole, "{model} add={add}: the ids differ");
    }
}

#[test]
fn a_pipeline_whose_windows_do_not_join_falls_back_to_a_whole_encode() {
    // A byte-level pre-tokenizer that adds a space before the text: each window's first word
    // would get it, so the windows' check fails and the text is encoded whole.
    let (_dir, tok) = edited_model("chatml", |json| {
        let pres = json["pre_tokenizer"]["pretokenizers"]
            .as_array_mut()
            .unwrap();
        for p in pres.iter_mut() {
            if p["type"] == "ByteLevel" {
                p["add_prefix_space"] = json!(true);
            }
        }
    });
    let text = long_text(&["<|im_start|>"]);
    assert!(tok.encode_prompt(&text, true).unwrap() == tok.encode_whole(&text, true).unwrap());
}

/// About `bytes` bytes of what moves word boundaries (as [`long_text`], no word longer than a
/// window), different for each `seed`.
fn mixed_text(bytes: usize, seed: usize) -> String {
    let mut text = String::new();
    let mut i = seed;
    while text.len() < bytes {
        let piece = match i % 7 {
            0 => format!("The router's index holds {i} blocks; it's fast. "),
            1 => "\r\n\n   \t ".to_owned(),
            2 => " déjà vu — 日本語のテキスト ".to_owned(),
            3 => "    indented(x) == y?!\n".to_owned(),
            4 => format!("{i}{i}{i}"),
            5 => "<|im_start|>".to_owned(),
            _ => " and so on, ".to_owned(),
        };
        text.push_str(&piece);
        i += 1;
    }
    text
}

fn cut(text: &str, mut at: usize) -> &str {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    &text[..at]
}

#[test]
fn windows_from_the_prefix_cache_give_the_ids_of_a_whole_encode() {
    use kvbm_router::tokenize::ENCODE_CELL_BYTES;
    let tok = load("chatml").with_prefix_cache(64 << 20);
    let base = mixed_text(24_000, 0);
    let go_on = &mut |_: &[u32], _: usize| true;
    let first = tok.encode_prompt_until(&base, true, go_on).unwrap();
    assert_eq!(first.cached_bytes, 0, "an empty cache");
    assert!(first.ids == tok.encode_whole(&base, true).unwrap());
    // The same prompt again: every window from the cache, the last one too.
    let again = tok.encode_prompt_until(&base, true, go_on).unwrap();
    assert_eq!(again.cached_bytes, base.len());
    assert!(again.ids == first.ids);
    // Prefixes of it cut anywhere (on the grid, around it, inside a multi-byte character), then
    // new text: the ids of a whole encode, the shared windows taken from the cache.
    for at in [
        1,
        ENCODE_CELL_BYTES - 1,
        ENCODE_CELL_BYTES,
        5 * ENCODE_CELL_BYTES + 1,
        12_345,
    ] {
        let text = format!("{}{}", cut(&base, at), mixed_text(5_000, at));
        let e = tok.encode_prompt_until(&text, true, go_on).unwrap();
        assert!(
            e.ids == tok.encode_whole(&text, true).unwrap(),
            "cut at {at}: the ids differ"
        );
        assert_eq!(e.untokenized_bytes, 0);
        // All but the window the new text starts in (and the one before, whose margin reaches
        // into it) came from the cache.
        assert!(
            e.cached_bytes + 2 * ENCODE_CELL_BYTES >= at,
            "cut at {at}: only {} bytes from the cache",
            e.cached_bytes
        );
    }
    let (bytes, windows) = tok.prefix_cache_usage();
    assert!(
        bytes > 0 && windows > 10,
        "{bytes} bytes in {windows} windows"
    );
}

#[test]
fn the_prefix_cache_keeps_to_its_budget_and_stays_exact() {
    // About two texts' windows: the six texts overflow it.
    let budget = 40 << 10;
    let tok = load("llama3").with_prefix_cache(budget);
    for seed in 0..6 {
        let text = mixed_text(12_000, seed * 1000);
        for _ in 0..2 {
            let e = tok
                .encode_prompt_until(&text, false, &mut |_, _| true)
                .unwrap();
            assert!(
                e.ids == tok.encode_whole(&text, false).unwrap(),
                "seed {seed}"
            );
            let (bytes, _) = tok.prefix_cache_usage();
            assert!(bytes <= budget, "{bytes} bytes held, budget {budget}");
        }
    }
    // The newest text's windows are still there (least recently used go first), the oldest's not.
    let newest = mixed_text(12_000, 5000);
    let e = tok
        .encode_prompt_until(&newest, false, &mut |_, _| true)
        .unwrap();
    assert_eq!(e.cached_bytes, newest.len());
    let oldest = mixed_text(12_000, 0);
    let e = tok
        .encode_prompt_until(&oldest, false, &mut |_, _| true)
        .unwrap();
    assert_eq!(e.cached_bytes, 0);
}

#[test]
fn a_stopped_encode_gives_a_prefix_of_the_ids_and_estimates_the_rest() {
    let tok = load("chatml");
    let text = mixed_text(20_000, 7);
    let whole = tok.encode_whole(&text, true).unwrap();
    // `more` sees growing prefixes of the ids, and a bound for the tokens after them that the
    // whole encode keeps to; the third time it says stop.
    let mut seen: Vec<(Vec<u32>, usize)> = Vec::new();
    let e = tok
        .encode_prompt_until(&text, true, &mut |ids, rest| {
            seen.push((ids.to_vec(), rest));
            seen.len() < 3
        })
        .unwrap();
    assert_eq!(seen.len(), 3);
    for (i, (ids, rest)) in seen.iter().enumerate() {
        assert!(!ids.is_empty() && whole.starts_with(ids), "call {i}");
        assert!(i == 0 || ids.len() > seen[i - 1].0.len(), "call {i}");
        assert!(
            ids.len() + rest >= whole.len(),
            "call {i}: {} ids then at most {rest} of {}",
            ids.len(),
            whole.len()
        );
        assert!(
            i == 0 || *rest < seen[i - 1].1,
            "call {i}: the bound shrinks"
        );
    }
    let seen: Vec<Vec<u32>> = seen.into_iter().map(|(ids, _)| ids).collect();
    assert!(e.ids == seen[2], "stopped where it was told");
    assert!(e.untokenized_bytes > 0 && e.untokenized_bytes < text.len());
    let estimate = e.estimated_tokens() as f64;
    let exact = whole.len() as f64;
    assert!(
        (estimate / exact - 1.0).abs() < 0.15,
        "estimated {estimate} tokens of {exact}"
    );
    // A caller that never stops gets the whole encode, and an exact count.
    let all = tok
        .encode_prompt_until(&text, true, &mut |_, _| true)
        .unwrap();
    assert!(all.ids == whole);
    assert_eq!(all.estimated_tokens(), whole.len());
}

#[test]
fn the_rest_bound_holds_for_text_the_normalizer_lengthens() {
    // chatml normalizes to NFC: U+0344 (2 bytes) becomes U+0308 U+0301 (4), U+1F82 (3 bytes) a
    // letter and three accents (8); llama3 has no normalizer and byte-level tokens. Whatever the
    // cut, the tokens after it stay within the bound the probe is given for the bytes after it.
    let odd = "\u{344}\u{1F82}\u{FB2C}\u{2126}";
    for (model, texts) in [
        (
            "chatml",
            vec![
                odd.repeat(300),
                format!("{}{}", mixed_text(3_000, 3), odd.repeat(200)),
            ],
        ),
        (
            "llama3",
            vec![mixed_text(6_000, 5), "\u{1F600}\u{7}\u{0}x".repeat(400)],
        ),
    ] {
        let tok = load(model);
        for text in texts {
            let whole = tok.encode_whole(&text, true).unwrap();
            for at in (0..text.len())
                .step_by(97)
                .filter(|&at| text.is_char_boundary(at))
            {
                let before = tok.encode_whole(&text[..at], true).unwrap();
                // Tokens past the cut: the whole encode less the ids the prefix shares with it.
                let shared = whole
                    .iter()
                    .zip(&before)
                    .take_while(|(a, b)| a == b)
                    .count();
                let after = whole.len() - shared;
                let bound = tok.rest_tokens_max(text.len() - at, true);
                assert!(
                    after <= bound,
                    "{model}, cut at {at}: {after} tokens, bound {bound}"
                );
            }
        }
    }
}

/// The fixture `model` with its `tokenizer.json` changed by `edit`, in a temporary directory.
fn edited_model(model: &str, edit: impl FnOnce(&mut Value)) -> (tempfile::TempDir, ModelTokenizer) {
    let dir = tempfile::tempdir().unwrap();
    let src = data_dir().join(model);
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    edit(&mut json);
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    std::fs::copy(
        src.join("tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    let tok = ModelTokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}

/// Checks `tok`'s windowed encode of a few texts against its whole encode: with every cache
/// size (none, one emptied again and again while a window is stored, the default), read twice
/// (the second time every word from the cache, none from the model), and stopped after three
/// windows (a prefix of the whole encode, not the fallback to it).
fn check_word_cache(name: &str, dir: &Path, add: bool) {
    use kvbm_router::tokenize::WORD_CACHE_WORDS_DEFAULT;
    for words in [0, 7, WORD_CACHE_WORDS_DEFAULT] {
        let tok = ModelTokenizer::from_dir(dir)
            .unwrap()
            .with_word_cache(words);
        for seed in [0, 1, 2, 0] {
            let text = mixed_text(9_000, seed * 3);
            let whole = tok.encode_whole(&text, add).unwrap();
            let e = tok
                .encode_prompt_until(&text, add, &mut |_, _| true)
                .unwrap();
            assert!(
                e.ids == whole,
                "{name}, {words} words, seed {seed}: the ids differ"
            );
            let (held, ids) = tok.word_cache_usage();
            assert!(held <= words && ids <= 4 * words, "{held} words, {ids} ids");
            assert!(
                e.words_from_model > 0 || e.words_from_cache > 0,
                "{name}: no words"
            );
            if words == 0 {
                assert_eq!(e.words_from_cache, 0);
            }
            let again = tok
                .encode_prompt_until(&text, add, &mut |_, _| true)
                .unwrap();
            assert!(
                again.ids == whole,
                "{name}, {words} words: the second pass differs"
            );
            if words == WORD_CACHE_WORDS_DEFAULT {
                assert!(held > 0, "{name}: nothing cached");
                assert_eq!(again.words_from_model, 0, "{name}: words missed the cache");
            }
            let mut asked = 0;
            let stopped = tok
                .encode_prompt_until(&text, add, &mut |_, _| {
                    asked += 1;
                    asked < 3
                })
                .unwrap();
            assert_eq!(asked, 3, "{name}: the windows did not join");
            assert!(stopped.untokenized_bytes > 0 && whole.starts_with(&stopped.ids));
        }
    }
}

#[test]
fn the_word_cache_gives_the_models_ids_and_starts_over_when_full() {
    // The fixtures (byte-level BPE), and one model of each other kind the crate loads: a
    // WordPiece (BERT's normalizer and pre-tokenizer), a Unigram (SentencePiece's Metaspace) and
    // a WordLevel (the replay's), their vocabularies made here from the test text's characters.
    for (model, add) in [("llama3", false), ("chatml", true), ("parts", true)] {
        check_word_cache(model, &data_dir().join(model), add);
    }
    let text: String = (0..8).map(|seed| mixed_text(9_000, seed * 3)).collect();
    let mut chars: Vec<char> = text
        .to_lowercase()
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    chars.sort_unstable();
    chars.dedup();
    let words = [
        "the", "router", "index", "holds", "blocks", "fast", "and", "so", "on", "indented",
    ];
    let mut vocab = serde_json::Map::new();
    for t in ["[UNK]"]
        .into_iter()
        .map(str::to_owned)
        .chain(chars.iter().flat_map(|c| [c.to_string(), format!("##{c}")]))
        .chain(words.iter().flat_map(|w| [w.to_string(), format!("##{w}")]))
    {
        let id = vocab.len();
        vocab.entry(t).or_insert(json!(id));
    }
    let d = model_dir(json!({
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab},
    }));
    check_word_cache("wordpiece", d.path(), true);
    let mut pieces = vec![json!(["<unk>", 0.0]), json!(["\u{2581}", -2.0])];
    pieces.extend(chars.iter().map(|c| json!([c.to_string(), -5.0])));
    pieces.extend(words.iter().map(|w| json!([format!("\u{2581}{w}"), -3.0])));
    pieces.extend(words.iter().map(|w| json!([w.to_string(), -4.0])));
    let d = model_dir(json!({
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "never",
                          "split": true},
        "model": {"type": "Unigram", "unk_id": 0, "vocab": pieces, "byte_fallback": false},
    }));
    check_word_cache("unigram", d.path(), true);
    let mut vocab = serde_json::Map::new();
    for (id, w) in text.split_whitespace().enumerate() {
        vocab.entry(w.to_owned()).or_insert(json!(id));
    }
    vocab.insert("[UNK]".into(), json!(vocab.len()));
    let d = model_dir(json!({
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    }));
    check_word_cache("wordlevel", d.path(), true);
    // Splits longer than 64 bytes are not kept (llama3's pre-tokenizer makes one split of a
    // space and a word of letters).
    let tok = load("llama3");
    let text = format!(" {}", "x".repeat(100)).repeat(50);
    let e = tok
        .encode_prompt_until(&text, false, &mut |_, _| true)
        .unwrap();
    assert!(e.ids == tok.encode_whole(&text, false).unwrap());
    assert_eq!(tok.word_cache_usage(), (0, 0));
    assert!(e.words_from_model > 0 && e.words_from_cache == 0);
}

/// A model directory with a `tokenizer.json` of `parts` (normalizer, pre-tokenizer, model) and
/// nothing else to it.
fn model_dir(parts: Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut json = json!({"version": "1.0", "truncation": null, "padding": null,
                          "added_tokens": [], "post_processor": null, "decoder": null});
    for (k, v) in parts.as_object().unwrap() {
        json[k] = v.clone();
    }
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    dir
}

#[test]
fn a_model_with_bpe_dropout_gets_no_word_cache() {
    // With dropout, BPE's `tokenize` of a word differs from call to call: no cache may hold it.
    let (_dir, tok) = edited_model("llama3", |json| json["model"]["dropout"] = json!(0.5));
    let text = mixed_text(9_000, 1);
    tok.encode_prompt_until(&text, false, &mut |_, _| true)
        .unwrap();
    assert_eq!(tok.word_cache_usage(), (0, 0));
    let tok = tok.with_word_cache(1 << 10);
    tok.encode_prompt_until(&text, false, &mut |_, _| true)
        .unwrap();
    assert_eq!(tok.word_cache_usage(), (0, 0));
    // With a dropout of 0, the same model keeps words.
    let (_dir, tok) = edited_model("llama3", |json| json["model"]["dropout"] = json!(0.0));
    tok.encode_prompt_until(&text, false, &mut |_, _| true)
        .unwrap();
    assert!(tok.word_cache_usage().0 > 0);
}
