//! The router's tokenizer: the token ids a vLLM 0.33 worker computes for a request, computed in
//! the router so that prefix overlap is scored on the same ids (one token off and no block
//! hash matches).
//!
//! It owns a model's `tokenizer.json` (the Hugging Face `tokenizers` crate, pure Rust: the
//! `fancy-regex` engine instead of onig) and its chat template(s), rendered by minijinja set up
//! as transformers' Jinja2 environment ([`jinja`]). It does not own the HTTP shapes around it,
//! model names, truncation to a context length, or multimodal content (refused).
//!
//! What it reproduces, step by step, each named after the code it follows:
//! - **Loading** (transformers 5, `tokenization_utils_base.py` `_from_pretrained` and
//!   `tokenization_utils_tokenizers.py` `TokenizersBackend.__init__`): the pipeline of
//!   `tokenizer.json` as it is (`add_bos_token`/`add_eos_token` in the config are ignored when a
//!   `tokenizer.json` exists, as transformers 5 drops them); the named special tokens (`bos_token`
//!   .. `mask_token`, strings or `{"content": ...}`) and the config's `added_tokens_decoder` entries
//!   that the file lacks are added, as transformers adds them. Templates: `chat_template.jinja`
//!   and `additional_chat_templates/*.jinja` take priority over the config's `chat_template` (a
//!   string, or a list of `{name, template}`); `chat_template.json` is the last resort. With
//!   several templates, `tool_use` serves requests with tools and `default` the others
//!   (`get_chat_template`).
//! - **Prompts** (vLLM `renderers/base.py` `BaseRenderer._tokenize_prompt`):
//!   `encode(prompt, add_special_tokens)`.
//! - **Chats** (vLLM `entrypoints/openai/chat_completion/protocol.py` and
//!   `entrypoints/serve/tokenize/protocol.py` for the fields and defaults;
//!   `renderers/online_renderer.py` `OnlineRenderer.preprocess_chat` and `renderers/params.py`
//!   `merge_kwargs`/`ChatParams.with_defaults` for how the template's keyword arguments are
//!   merged; `renderers/chat_utils/chat_message.py` `parse_chat_messages` and
//!   `_postprocess_messages` for the conversation the template sees; `renderers/hf.py`
//!   `_detect_content_format` ([`content_format`]), `safe_apply_chat_template` and
//!   `resolve_chat_template_kwargs`; then transformers' `apply_chat_template` and
//!   `render_jinja_template`: messages without their null fields, reasoning aliases,
//!   `continue_final_message`'s tag and trim, special tokens as template variables), then the
//!   rendered text is encoded with the request's `add_special_tokens` (false by default: the
//!   template writes its own BOS; `true` gives the BOS twice, as vLLM does).
//!
//! Invariants: a request cannot make the router do unbounded work. Prompt text and a chat's
//! strings are bounded by [`PROMPT_BYTES_MAX`], a render by [`TEMPLATE_FUEL_MAX`] (minijinja fuel)
//! and its output by [`RENDERED_BYTES_MAX`], `strftime_now`'s format by 256 bytes. Encoding costs
//! a few bytes per byte of text: windows of [`ENCODE_CELL_BYTES`], ids only, each window's
//! first words checked against the previous window's, else the text is encoded whole, so the ids
//! are always `encode`'s. Nothing here panics on input (the tokenizer and the template engine run
//! under `catch_unwind` as a last guard). Every refusal is a
//! [`TokenizeError`] the HTTP layer turns into a 400.
//!
//! Known limits: a request's own `chat_template` is refused (vLLM refuses it too unless
//! `--trust-request-chat-template`); `truncate_prompt_tokens` is not applied (the ids are then
//! the untruncated prompt's); vLLM's server-side defaults (`--chat-template`,
//! `--default-chat-template-kwargs`, `--chat-template-content-format`) are not read: the router
//! assumes the workers run with the model's own template; integers beyond 64 bits in JSON
//! arrive as floats; the `/tokenize` body's `reasoning_content` is renamed to `reasoning` as the
//! chat completions body's is (vLLM's `/tokenize` ignores it; the chat route, which the router
//! serves, reads it).

mod content_format;
mod jinja;

use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use serde_json::{Map, Value as Json};

pub use content_format::ContentFormat;

/// Bytes of prompt text, or of all the strings of a chat request, the tokenizer accepts.
pub const PROMPT_BYTES_MAX: usize = 8 << 20;
/// Bytes a chat template may render.
pub const RENDERED_BYTES_MAX: usize = 16 << 20;
/// minijinja fuel for one render: about that many instructions, or 64 bytes of allocated data
/// per unit. A 64-turn chat of the fixtures' templates uses under 20 000.
pub const TEMPLATE_FUEL_MAX: u64 = 4_000_000;

/// The grid windows end on (see [`ModelTokenizer::encode_ids`]): a window ends at a multiple of
/// this many bytes (or at the text's end), so that two prompts sharing a prefix cut it at the same
/// places and a window's words can be cached under the prefix that ends it. The tokenizer's
/// working memory is about 130 bytes per byte of a window; a window grows (doubling) only past a
/// word longer than its margins.
pub const ENCODE_CELL_BYTES: usize = 2 << 10;
/// Bytes at a window's end whose words are not trusted (its cut may change them); the words of
/// the next such stretch are tokenized again by the next window and must come out the same.
const ENCODE_WINDOW_MARGIN: usize = 128;

/// Words the word cache holds by default before it starts over (see [`WordCache`]): seven eighths
/// of 64K, the most a table of 65,536 slots takes (32 bytes a slot: 2 MiB), with up to 4 ids a
/// word on average (0.9 MiB): about 3 MiB in all.
pub const WORD_CACHE_WORDS_DEFAULT: usize = 57_344;
/// The most words [`ModelTokenizer::with_word_cache`] takes (offsets into its ids stay in `u32`).
const WORD_CACHE_WORDS_MAX: usize = 1 << 24;
/// Ids a cached word may have at most (a word of [`WORD_CACHE_WORD_BYTES_MAX`] bytes a token
/// each); a word with more is tokenized each time.
const WORD_CACHE_WORD_IDS_MAX: usize = 64;
/// The longest split the word cache keeps: longer ones are rarely seen twice.
const WORD_CACHE_WORD_BYTES_MAX: usize = 64;

/// [`normalized_bytes_per_byte`] for a normalizer it does not know.
const NORMALIZED_BYTES_PER_BYTE_UNKNOWN: usize = 11;
/// The most [`normalized_bytes_per_byte`] answers (a chain of expanding normalizers).
const NORMALIZED_BYTES_PER_BYTE_MAX: usize = 64;

/// How many bytes of normalized text one byte of input can become at most, for the
/// `normalizer` entry of a `tokenizer.json`: 1 for none; Unicode's bounds on UTF-8 growth for
/// the normalization forms (3 for NFC and NFD, 11 for NFKC and NFKD; SentencePiece's compiled
/// NFKC maps are taken as NFKC), 3 for case and accent folding and BERT's (a CJK character gets
/// a space on each side), a replacement's length per byte matched, a prefix's length added to
/// each byte (a prefix per split, and a split is at least a byte), the product for a sequence.
fn normalized_bytes_per_byte(normalizer: &Json) -> usize {
    let factor = match normalizer.get("type").and_then(Json::as_str) {
        None if normalizer.is_null() => 1,
        None => NORMALIZED_BYTES_PER_BYTE_UNKNOWN,
        Some("Sequence") => normalizer
            .get("normalizers")
            .and_then(Json::as_array)
            .map_or(NORMALIZED_BYTES_PER_BYTE_UNKNOWN, |all| {
                all.iter().fold(1usize, |f, n| {
                    f.saturating_mul(normalized_bytes_per_byte(n))
                })
            }),
        Some("NFC" | "NFD" | "Lowercase" | "StripAccents" | "BertNormalizer") => 3,
        Some("NFKC" | "NFKD" | "Precompiled") => 11,
        Some("Strip" | "Nmt") => 1,
        Some("ByteLevel") => 2,
        Some("Replace") => normalizer
            .get("content")
            .and_then(Json::as_str)
            .map_or(NORMALIZED_BYTES_PER_BYTE_UNKNOWN, |c| c.len().max(1)),
        Some("Prepend") => normalizer
            .get("prepend")
            .and_then(Json::as_str)
            .map_or(NORMALIZED_BYTES_PER_BYTE_UNKNOWN, |p| 1 + p.len()),
        Some(_) => NORMALIZED_BYTES_PER_BYTE_UNKNOWN,
    };
    factor.clamp(1, NORMALIZED_BYTES_PER_BYTE_MAX)
}

/// The words of one window, flat: word `i` lies at `spans[i].0..spans[i].1` in the text and its
/// ids end at `spans[i].2` in `ids` (they start where word `i - 1`'s end).
#[derive(Debug, Default)]
struct WindowWords {
    spans: Vec<(usize, usize, usize)>,
    ids: Vec<u32>,
    /// Its words whose ids came from the word cache, and those the model tokenized.
    from_cache: usize,
    from_model: usize,
}

impl WindowWords {
    fn len(&self) -> usize {
        self.spans.len()
    }

    fn end(&self, i: usize) -> usize {
        self.spans[i].1
    }

    fn ids_of(&self, i: usize) -> &[u32] {
        let from = if i == 0 { 0 } else { self.spans[i - 1].2 };
        &self.ids[from..self.spans[i].2]
    }

    /// Whether its first words are `check`, position and ids.
    fn starts_with(&self, check: &[WordIds]) -> bool {
        self.len() >= check.len()
            && check.iter().enumerate().all(|(i, w)| {
                let (start, end, _) = self.spans[i];
                w.start == start && w.end == end && w.ids == self.ids_of(i)
            })
    }

    /// The ids of its first `n` words.
    fn ids_before(&self, n: usize) -> &[u32] {
        match n {
            0 => &[],
            n => &self.ids[..self.spans[n - 1].2],
        }
    }

    /// Words `range`, each with its own ids.
    fn owned(&self, range: std::ops::Range<usize>) -> Vec<WordIds> {
        range
            .map(|i| WordIds {
                start: self.spans[i].0,
                end: self.spans[i].1,
                ids: self.ids_of(i).to_vec(),
            })
            .collect()
    }
}

/// One word of a window (a split of the pre-tokenizer): where it lies in the text, its ids.
#[derive(Debug, Clone, PartialEq, Eq)]
struct WordIds {
    start: usize,
    end: usize,
    ids: Vec<u32>,
}

/// The model's ids for one split of the pre-tokenizer, by its text: `Model::tokenize` is a
/// function of that text alone, and words repeat (Zipf), so most words of a prompt skip the
/// model, its per-token `String`s and its vocabulary's cold hash map. Models for which it is not
/// (BPE with dropout, a Unigram model set to sample: `alpha`, which `tokenizer.json` cannot set
/// today) get no cache. Keyed by XXH3-128 of the split under a seed drawn at start (as the prefix cache
/// is: a client that cannot see the seed cannot aim a collision at a word; the table's own hash
/// is the key's low half), held to a number of words and 4 ids a word, then emptied and filled
/// again (the words of the current traffic come back first). The model runs outside the lock,
/// and a window's new words are stored only if the lock is free then (it is a cache).
#[derive(Debug)]
struct WordCache {
    seed: u64,
    words_max: usize,
    inner: parking_lot::RwLock<WordCacheInner>,
}

#[derive(Debug, Default)]
struct WordCacheInner {
    /// Key → where its ids lie in `ids` (offset, count).
    words: std::collections::HashMap<u128, (u32, u32), std::hash::BuildHasherDefault<KeyHash>>,
    ids: Vec<u32>,
}

/// The table hash of a key that is already a keyed hash: its low 64 bits.
#[derive(Debug, Default)]
struct KeyHash(u64);

impl std::hash::Hasher for KeyHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u128 keys are hashed; anything else still gets a usable (if slow) hash.
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u128(&mut self, key: u128) {
        self.0 = key as u64;
    }
}

impl WordCache {
    fn new(words_max: usize) -> Self {
        Self {
            seed: rand::random(),
            words_max: words_max.min(WORD_CACHE_WORDS_MAX),
            inner: parking_lot::RwLock::new(WordCacheInner::default()),
        }
    }

    fn key(&self, word: &str) -> Option<u128> {
        (word.len() <= WORD_CACHE_WORD_BYTES_MAX)
            .then(|| xxhash_rust::xxh3::xxh3_128_with_seed(word.as_bytes(), self.seed))
    }

    /// Stores the words of one window that missed, unless another thread holds the lock.
    fn insert(&self, fresh: &[(u128, std::ops::Range<usize>)], ids: &[u32]) {
        if fresh.is_empty() {
            return;
        }
        let Some(mut inner) = self.inner.try_write() else {
            return;
        };
        let ids_max = 4 * self.words_max;
        if inner.ids.capacity() == 0 {
            inner.words.reserve(self.words_max);
            inner.ids.reserve_exact(ids_max);
        }
        for (key, range) in fresh {
            if range.len() > WORD_CACHE_WORD_IDS_MAX.min(ids_max) || inner.words.contains_key(key) {
                continue;
            }
            if inner.words.len() >= self.words_max || inner.ids.len() + range.len() > ids_max {
                inner.words.clear();
                inner.ids.clear();
            }
            // Below 4 * WORD_CACHE_WORDS_MAX ids: the offset and count fit in u32.
            let at = inner.ids.len() as u32;
            inner.ids.extend_from_slice(&ids[range.clone()]);
            inner.words.insert(*key, (at, range.len() as u32));
        }
    }

    /// Words and ids held.
    fn usage(&self) -> (usize, usize) {
        let inner = self.inner.read();
        (inner.words.len(), inner.ids.len())
    }
}

/// The named special tokens transformers passes to every template (`special_tokens_map`).
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// transformers' `continue_final_message_tag` (`render_jinja_template`).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Why a request could not be tokenized, or a model not loaded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The request is malformed or asks for what the router cannot reproduce (a 400).
    #[error("{0}")]
    BadRequest(String),
    /// The model has no chat template for this request (a 400, as vLLM answers).
    #[error("the model has no chat template; chat requests need one (vLLM: \"default chat template is no longer allowed\")")]
    NoChatTemplate,
    /// The chat template raised (`raise_exception`) or failed while rendering (a 400).
    #[error("chat template: {0}")]
    Template(String),
    /// The model directory could not be loaded (at start).
    #[error("loading the tokenizer: {0}")]
    Load(String),
    /// The tokenizer failed on the text.
    #[error("encoding: {0}")]
    Encode(String),
}

/// A model's tokenizer and chat templates, built once and shared (`Send + Sync`).
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// `special_tokens_map`: name and text of each named special token the config sets.
    special_tokens: Vec<(&'static str, String)>,
    /// The compiled templates, named as in `env`.
    templates: Vec<ChatTemplate>,
    /// Whether the templates came as a named set (transformers' dict form) or one string.
    named_templates: bool,
    env: minijinja::Environment<'static>,
    /// The special tokens the post-processor puts before and after a sequence, without and with
    /// `add_special_tokens`; None where [`Self::encode_ids`] must use the whole `encode`.
    special_wrap: [Option<(Vec<u32>, Vec<u32>)>; 2],
    /// Windows already tokenized, by the prefix that ends them (see [`Self::with_prefix_cache`]).
    prefix_cache: Option<PrefixCache>,
    /// The model's ids by split ([`WordCache`]); None for a model whose `tokenize` is not a
    /// function of the split.
    word_cache: Option<WordCache>,
    /// Whether the model's `tokenize` is a function of the split (all but BPE with dropout and a
    /// sampling Unigram model).
    deterministic_model: bool,
    /// Tokens a byte of text gives at most ([`Self::rest_tokens_max`]): a token covers at least
    /// one byte of the normalized text (one character where the model works on characters),
    /// so this is how many bytes the normalizer may make of one ([`normalized_bytes_per_byte`]).
    tokens_per_byte_max: usize,
}

/// What [`ModelTokenizer::encode_prompt_until`] made of a text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Encoded {
    /// The ids of the text's first `text_bytes - untokenized_bytes` bytes; all of them, with the
    /// post-processor's special tokens at both ends, when `untokenized_bytes` is 0.
    pub ids: Vec<u32>,
    /// Bytes at the text's end left untokenized because the caller said stop.
    pub untokenized_bytes: usize,
    /// Bytes whose ids came from the prefix cache.
    pub cached_bytes: usize,
    /// The text's bytes.
    pub text_bytes: usize,
    /// Words (splits of the pre-tokenizer) whose ids came from the word cache ([`WordCache`]),
    /// and words the model tokenized, in the windows tokenized.
    pub words_from_cache: usize,
    pub words_from_model: usize,
}

impl Encoded {
    /// Tokens the whole text has: exact when it was all tokenized; else the ids so far and the
    /// untokenized bytes at the rate the tokenized ones came at.
    pub fn estimated_tokens(&self) -> usize {
        if self.untokenized_bytes == 0 {
            return self.ids.len();
        }
        let done = self.text_bytes - self.untokenized_bytes;
        let rate = self.ids.len() as f64 / done.max(1) as f64;
        self.ids.len() + (self.untokenized_bytes as f64 * rate).ceil() as usize
    }
}

/// One committed window: what a prompt whose text up to `end` hashes to its key gets without
/// tokenizing, when its walk reaches `end` from `start` (always, for the same prefix).
#[derive(Debug)]
struct CachedWindow {
    start: usize,
    end: usize,
    /// It ends the text (its words all committed, none to check).
    last: bool,
    /// The ids of the words in `start..commit_at`.
    ids: Vec<u32>,
    commit_at: usize,
    /// The words the next window must reproduce.
    check: Vec<WordIds>,
}

impl CachedWindow {
    fn bytes(&self) -> usize {
        // The entry, its key and the map's links, then what it owns.
        std::mem::size_of::<Self>()
            + 64
            + self.ids.capacity() * 4
            + self
                .check
                .iter()
                .map(|w| std::mem::size_of::<WordIds>() + w.ids.capacity() * 4)
                .sum::<usize>()
    }
}

/// Tokenized windows keyed by XXH3-128 of the text before their end, under a seed drawn at start
/// (a client cannot aim a collision at another's prompt), least recently used out first, held
/// to a byte budget.
#[derive(Debug)]
struct PrefixCache {
    seed: u64,
    budget: usize,
    inner: parking_lot::Mutex<PrefixCacheInner>,
}

#[derive(Debug)]
struct PrefixCacheInner {
    windows: lru::LruCache<u128, std::sync::Arc<CachedWindow>>,
    bytes: usize,
}

impl PrefixCache {
    fn get(&self, key: u128) -> Option<std::sync::Arc<CachedWindow>> {
        self.inner.lock().windows.get(&key).cloned()
    }

    fn insert(&self, key: u128, window: CachedWindow) {
        let size = window.bytes();
        if size > self.budget {
            return;
        }
        let mut inner = self.inner.lock();
        if let Some(old) = inner.windows.put(key, std::sync::Arc::new(window)) {
            inner.bytes -= old.bytes();
        }
        inner.bytes += size;
        while inner.bytes > self.budget {
            match inner.windows.pop_lru() {
                Some((_, w)) => inner.bytes -= w.bytes(),
                None => break,
            }
        }
    }
}

/// What the post-processor puts around one sequence: found by processing a one-token sequence
/// with an id no vocabulary has. None if the tokenizer truncates or pads (then the wrap depends
/// on the length) or the marker does not come out exactly once.
fn special_wrap(
    tokenizer: &tokenizers::Tokenizer,
    add_special_tokens: bool,
) -> Option<(Vec<u32>, Vec<u32>)> {
    if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
        return None;
    }
    const MARKER: u32 = u32::MAX;
    let one = tokenizers::Encoding::from_tokens(
        vec![tokenizers::Token::new(MARKER, "a".to_owned(), (0, 1))],
        0,
    );
    let processed = catch_unwind(AssertUnwindSafe(|| {
        tokenizer.post_process(one, None, add_special_tokens)
    }))
    .ok()?
    .ok()?;
    let ids = processed.get_ids();
    let at = ids.iter().position(|&i| i == MARKER)?;
    if ids[at + 1..].contains(&MARKER) {
        return None;
    }
    Some((ids[..at].to_vec(), ids[at + 1..].to_vec()))
}

struct ChatTemplate {
    name: String,
    /// The template as the model ships it (transformers checks it for `"content"`, vLLM for
    /// the developer role).
    source: String,
    content_format: ContentFormat,
    /// The template's undeclared variables, as minijinja finds them.
    variables: HashSet<String>,
    /// Why minijinja could not compile it, if it could not (reported per request).
    compile_error: Option<String>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("vocab_size", &self.tokenizer.get_vocab_size(true))
            .field("special_tokens", &self.special_tokens)
            .field(
                "templates",
                &self.templates.iter().map(|t| &t.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl ModelTokenizer {
    /// Loads `dir`: `tokenizer.json` (required), `tokenizer_config.json`, `chat_template.jinja`,
    /// `additional_chat_templates/*.jinja`, `chat_template.json` (optional).
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizeError> {
        let load = |what: &str, e: &dyn std::fmt::Display| {
            TokenizeError::Load(format!("{}: {what}: {e}", dir.display()))
        };
        let bytes = std::fs::read(dir.join("tokenizer.json"))
            .map_err(|e| load("reading tokenizer.json", &e))?;
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| load("parsing tokenizer.json", &e))?;

        let config = match std::fs::read(dir.join("tokenizer_config.json")) {
            Ok(b) => serde_json::from_slice::<Json>(&b)
                .map_err(|e| load("parsing tokenizer_config.json", &e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Object(Map::new()),
            Err(e) => return Err(load("reading tokenizer_config.json", &e)),
        };
        let special_tokens: Vec<(&'static str, String)> = SPECIAL_TOKEN_NAMES
            .iter()
            .filter_map(|name| token_text(config.get(*name)?).map(|t| (*name, t)))
            .collect();
        add_missing_tokens(&mut tokenizer, &config, &special_tokens);

        let (sources, named_templates) =
            template_sources(dir, &config).map_err(|e| load("reading the chat template", &e))?;
        let mut env = jinja::environment(TEMPLATE_FUEL_MAX)
            .map_err(|e| load("setting up the template engine", &e))?;
        let mut templates = Vec::new();
        for (name, source) in sources {
            let compile_error = env
                .add_template_owned(name.clone(), jinja::rewrite_generation_tags(&source))
                .err();
            let variables = match &compile_error {
                None => env
                    .get_template(&name)
                    .map(|t| t.undeclared_variables(false))
                    .unwrap_or_default(),
                Some(e) => {
                    tracing::warn!(template = %name, error = %e, "chat template does not compile; chat requests will fail");
                    HashSet::new()
                }
            };
            templates.push(ChatTemplate {
                content_format: content_format::detect(&source),
                name,
                source,
                variables,
                compile_error: compile_error.map(|e| e.to_string()),
            });
        }
        let tokens_per_byte_max = serde_json::from_slice::<Json>(&bytes)
            .map_or(NORMALIZED_BYTES_PER_BYTE_UNKNOWN, |j| {
                j.get("normalizer").map_or(1, normalized_bytes_per_byte)
            });
        // BPE's dropout makes `tokenize` random (the crate's own cache is off then too), and so
        // would a Unigram model's sampling.
        let random_model = match tokenizer.get_model() {
            tokenizers::ModelWrapper::BPE(bpe) => bpe.dropout.is_some_and(|p| p > 0.0),
            tokenizers::ModelWrapper::Unigram(unigram) => {
                unigram.alpha.is_some_and(|a| a != 0.0) || unigram.nbest_size.is_some()
            }
            _ => false,
        };
        Ok(Self {
            special_wrap: [false, true].map(|add| special_wrap(&tokenizer, add)),
            tokens_per_byte_max,
            tokenizer,
            special_tokens,
            templates,
            named_templates,
            env,
            prefix_cache: None,
            word_cache: (!random_model).then(|| WordCache::new(WORD_CACHE_WORDS_DEFAULT)),
            deterministic_model: !random_model,
        })
    }

    /// With a cache of tokenized windows of at most `bytes` (none if 0): a prompt that repeats an
    /// earlier one's text (the history of a conversation, a shared system prompt) tokenizes only
    /// what follows the repeated part, windows of [`ENCODE_CELL_BYTES`] at a time.
    pub fn with_prefix_cache(mut self, bytes: usize) -> Self {
        self.prefix_cache = (bytes > 0).then(|| PrefixCache {
            seed: rand::random(),
            budget: bytes,
            inner: parking_lot::Mutex::new(PrefixCacheInner {
                windows: lru::LruCache::unbounded(), // bounded: evicted to `budget` bytes on insert
                bytes: 0,
            }),
        });
        self
    }

    /// With a cache of the model's ids for up to `words` distinct words (none if 0, or if the
    /// model's `tokenize` is random); [`Self::from_dir`] gives one of
    /// [`WORD_CACHE_WORDS_DEFAULT`]. See [`WordCache`].
    pub fn with_word_cache(mut self, words: usize) -> Self {
        self.word_cache = (words > 0 && self.deterministic_model).then(|| WordCache::new(words));
        self
    }

    /// Bytes the prefix cache holds, and windows.
    pub fn prefix_cache_usage(&self) -> (usize, usize) {
        self.prefix_cache.as_ref().map_or((0, 0), |c| {
            let inner = c.inner.lock();
            (inner.bytes, inner.windows.len())
        })
    }

    /// As vLLM's `/v1/completions` and `/tokenize` with a prompt string.
    pub fn encode_prompt(
        &self,
        prompt: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        Ok(self
            .encode_prompt_until(prompt, add_special_tokens, &mut |_, _| true)?
            .ids)
    }

    /// As [`Self::encode_prompt`], asking `more` before each window it has to tokenize (from the
    /// second on) whether to go on, with the ids so far and at most how many tokens the rest can
    /// add ([`Self::rest_tokens_max`]); stopped, the ids are a prefix of the prompt's and the rest
    /// is counted in [`Encoded::untokenized_bytes`].
    pub fn encode_prompt_until(
        &self,
        prompt: &str,
        add_special_tokens: bool,
        more: &mut dyn FnMut(&[u32], usize) -> bool,
    ) -> Result<Encoded, TokenizeError> {
        if prompt.len() > PROMPT_BYTES_MAX {
            return Err(TokenizeError::BadRequest(format!(
                "the prompt has {} bytes; the router tokenizes at most {PROMPT_BYTES_MAX}",
                prompt.len()
            )));
        }
        self.encode_until(prompt, add_special_tokens, more)
    }

    /// As [`Self::encode_chat`], stopping where `more` says (see [`Self::encode_prompt_until`]).
    pub fn encode_chat_until(
        &self,
        chat: &ChatRequest,
        more: &mut dyn FnMut(&[u32], usize) -> bool,
    ) -> Result<Encoded, TokenizeError> {
        let rendered = self.prepare_chat(chat)?;
        self.encode_until(&rendered.text, rendered.add_special_tokens, more)
    }

    /// The chat template's text, as transformers' `apply_chat_template(tokenize=False)` renders
    /// it for vLLM.
    pub fn render_chat(&self, chat: &ChatRequest) -> Result<String, TokenizeError> {
        Ok(self.prepare_chat(chat)?.text)
    }

    /// As vLLM's `/v1/chat/completions` and `/tokenize` with messages.
    pub fn encode_chat(&self, chat: &ChatRequest) -> Result<Vec<u32>, TokenizeError> {
        let rendered = self.prepare_chat(chat)?;
        self.encode(&rendered.text, rendered.add_special_tokens)
    }

    /// The ids of `Tokenizer::encode` itself, on the whole text at once: the reference
    /// [`Self::encode_prompt`] must agree with (tests and measurements).
    #[doc(hidden)]
    pub fn encode_whole(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// At most how many tokens `bytes` of text not tokenized yet add to a prompt's ids, special
    /// tokens at its end included: a bound for the router's prefix probe, which stops
    /// tokenizing where even that many could not change the pick. Far above what text gives
    /// (prose runs at three to six bytes a token, and the bound is one token a byte without a
    /// normalizer).
    pub fn rest_tokens_max(&self, bytes: usize, add_special_tokens: bool) -> usize {
        let suffix = self.special_wrap[usize::from(add_special_tokens)]
            .as_ref()
            .map_or(0, |(_, suffix)| suffix.len());
        bytes.saturating_mul(self.tokens_per_byte_max) + suffix
    }

    /// Whether the model ships a chat template.
    pub fn has_chat_template(&self) -> bool {
        !self.templates.is_empty()
    }

    /// The content format vLLM would detect for the template a request without tools gets.
    pub fn content_format(&self) -> Option<ContentFormat> {
        self.select_template(false).ok().map(|t| t.content_format)
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        Ok(self
            .encode_until(text, add_special_tokens, &mut |_, _| true)?
            .ids)
    }

    fn encode_until(
        &self,
        text: &str,
        add_special_tokens: bool,
        more: &mut dyn FnMut(&[u32], usize) -> bool,
    ) -> Result<Encoded, TokenizeError> {
        catch_unwind(AssertUnwindSafe(|| {
            self.encode_ids(text, add_special_tokens, more)
        }))
        .map_err(|_| TokenizeError::Encode("the tokenizer panicked".into()))?
        .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// The ids `Tokenizer::encode` gives, at a cost of a few bytes per byte of text: the same
    /// pipeline (added tokens, normalizer, pre-tokenizer, model, then the post-processor's special
    /// tokens), run over windows (see [`Self::window_ids`]), each word's tokens reduced to their
    /// ids as soon as the model returns them. `encode` itself keeps, per token, a `String`,
    /// offsets, a word index and masks, and per byte of text an alignment pair in each word's
    /// normalized string: over 100 bytes per byte of prompt. A tokenizer that truncates or pads,
    /// or text whose windows do not join exactly, goes the usual way (whole, never stopped early).
    ///
    /// Windows end on a grid of [`ENCODE_CELL_BYTES`], so a window is a function of the text up
    /// to its end: with the prefix cache on, its committed ids are stored under a keyed hash of
    /// that prefix and a later prompt with the same prefix takes them without tokenizing. Before
    /// each window it must tokenize, `more` gets the ids so far (from the second window on) and
    /// may stop the work there: the router stops once no worker holds all of their blocks.
    fn encode_ids(
        &self,
        text: &str,
        add_special_tokens: bool,
        more: &mut dyn FnMut(&[u32], usize) -> bool,
    ) -> tokenizers::Result<Encoded> {
        let t = &self.tokenizer;
        let whole = || -> tokenizers::Result<Encoded> {
            Ok(Encoded {
                ids: t.encode_fast(text, add_special_tokens)?.get_ids().to_vec(),
                text_bytes: text.len(),
                ..Encoded::default()
            })
        };
        let Some((prefix, suffix)) = &self.special_wrap[usize::from(add_special_tokens)] else {
            return whole();
        };
        let mut ids = prefix.clone();
        let mut cached_bytes = 0usize;
        let (mut words_from_cache, mut words_from_model) = (0usize, 0usize);
        // Splits of the last window that the next window must reproduce before it is trusted.
        let mut check: Vec<WordIds> = Vec::new();
        let mut start = 0usize;
        let mut window = ENCODE_CELL_BYTES;
        // The prefix hash runs forward only: every window ends past the one before.
        let mut hasher = self
            .prefix_cache
            .as_ref()
            .map(|c| xxhash_rust::xxh3::Xxh3::with_seed(c.seed));
        let mut hashed_to = 0usize;
        let mut asked_at = usize::MAX;
        loop {
            let want = start.saturating_add(window).max(hashed_to + 1);
            let mut end = want
                .div_ceil(ENCODE_CELL_BYTES)
                .saturating_mul(ENCODE_CELL_BYTES)
                .min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            let last = end == text.len();
            let key = hasher.as_mut().map(|h| {
                h.update(&text.as_bytes()[hashed_to..end]);
                h.digest128()
            });
            hashed_to = end;
            if let (Some(key), Some(cache)) = (key, &self.prefix_cache) {
                let hit = cache
                    .get(key)
                    .filter(|w| w.start == start && w.end == end && w.last == last);
                if let Some(w) = hit {
                    // Its words were checked against this same previous window when stored.
                    ids.extend_from_slice(&w.ids);
                    cached_bytes += w.commit_at - start;
                    if last {
                        break;
                    }
                    check.clone_from(&w.check);
                    start = w.commit_at;
                    window = ENCODE_CELL_BYTES;
                    continue;
                }
            }
            if start > 0 && asked_at != ids.len() {
                asked_at = ids.len();
                if !more(
                    &ids,
                    self.rest_tokens_max(text.len() - start, add_special_tokens),
                ) {
                    return Ok(Encoded {
                        ids,
                        untokenized_bytes: text.len() - start,
                        cached_bytes,
                        text_bytes: text.len(),
                        words_from_cache,
                        words_from_model,
                    });
                }
            }
            let words = self.window_ids(text, start, end, last)?;
            words_from_cache += words.from_cache;
            words_from_model += words.from_model;
            if !words.starts_with(&check) {
                tracing::debug!(
                    at = start,
                    "tokenizer windows do not join exactly; encoding the prompt whole"
                );
                return whole();
            }
            let (delta, commit_at, next_check) = if last {
                (words.ids, end, Vec::new())
            } else {
                // Commit up to the last word ending a margin before the window's end; the words
                // of the next margin are checked when the next window starts at the commit point.
                let commit_limit = end - 2 * ENCODE_WINDOW_MARGIN;
                let check_limit = end - ENCODE_WINDOW_MARGIN;
                let n = words.len();
                let committed = (0..n).take_while(|&i| words.end(i) <= commit_limit).count();
                let checked = (committed..n)
                    .take_while(|&i| words.end(i) <= check_limit)
                    .count();
                if committed == 0 || checked == 0 || words.end(committed - 1) <= start {
                    // A word longer than the margins: a wider window.
                    // The same start again, checked against the same words.
                    window = window.saturating_mul(2);
                    continue;
                }
                let next_check = words.owned(committed..committed + checked);
                let commit_at = words.end(committed - 1);
                let cut = words.ids_before(committed).len();
                let mut ids = words.ids;
                ids.truncate(cut);
                (ids, commit_at, next_check)
            };
            ids.extend_from_slice(&delta);
            if let (Some(key), Some(cache)) = (key, &self.prefix_cache) {
                // The window's ids were collected with room to spare; the cache holds them tight.
                let mut delta = delta;
                delta.shrink_to_fit();
                // A last window serves the same prompt again (a retry, n > 1, a system prompt
                // alone).
                cache.insert(
                    key,
                    CachedWindow {
                        start,
                        end,
                        last,
                        ids: delta,
                        commit_at,
                        check: next_check.clone(),
                    },
                );
            }
            if last {
                break;
            }
            check = next_check;
            start = commit_at;
            window = ENCODE_CELL_BYTES;
        }
        ids.extend_from_slice(suffix);
        ids.shrink_to_fit();
        Ok(Encoded {
            ids,
            untokenized_bytes: 0,
            cached_bytes,
            text_bytes: text.len(),
            words_from_cache,
            words_from_model,
        })
    }

    /// The words of `text[start..end]` and their ids (positions in `text`), all of them if `last`,
    /// else those ending at least [`ENCODE_WINDOW_MARGIN`] before `end` (the window's cut may
    /// change the words near it).
    fn window_ids(
        &self,
        text: &str,
        start: usize,
        end: usize,
        last: bool,
    ) -> tokenizers::Result<WindowWords> {
        use tokenizers::{Model, OffsetReferential, OffsetType, PreTokenizer};
        let t = &self.tokenizer;
        let mut pretokenized = t
            .get_added_vocabulary()
            .extract_and_normalize(t.get_normalizer(), &text[start..end]);
        if let Some(pre) = t.get_pre_tokenizer() {
            pre.pre_tokenize(&mut pretokenized)?;
        }
        let limit = if last {
            usize::MAX
        } else {
            end - start - ENCODE_WINDOW_MARGIN.min(end - start)
        };
        let mut words = WindowWords::default();
        // The words that missed the word cache, by key and where their ids lie in `words.ids`;
        // stored once the window is done.
        let mut fresh = Vec::new();
        {
            let mut cached = self.word_cache.as_ref().map(|c| (c, c.inner.read()));
            for (piece, (from, to), tokens) in
                pretokenized.get_splits(OffsetReferential::Original, OffsetType::None)
            {
                if to > limit {
                    break;
                }
                match tokens {
                    // An added token, matched before normalization.
                    Some(tokens) => words.ids.extend(tokens.iter().map(|t| t.id)),
                    None => {
                        let key = cached.as_ref().and_then(|(c, _)| c.key(piece));
                        let hit = key.and_then(|k| {
                            let inner = &cached.as_ref()?.1;
                            let &(at, n) = inner.words.get(&k)?;
                            inner.ids.get(at as usize..at as usize + n as usize)
                        });
                        match hit {
                            Some(ids) => {
                                words.ids.extend_from_slice(ids);
                                words.from_cache += 1;
                            }
                            None => {
                                words.from_model += 1;
                                let at = words.ids.len();
                                // Outside the lock: a long split may take the model a while.
                                let model = || t.get_model().tokenize(piece);
                                let tokens = match cached.as_mut() {
                                    Some((_, guard)) => {
                                        parking_lot::RwLockReadGuard::unlocked(guard, model)
                                    }
                                    None => model(),
                                }?;
                                words.ids.extend(tokens.iter().map(|t| t.id));
                                if let Some(key) = key {
                                    fresh.push((key, at..words.ids.len()));
                                }
                            }
                        }
                    }
                }
                words
                    .spans
                    .push((start + from, start + to, words.ids.len()));
            }
        }
        if let Some(cache) = &self.word_cache {
            cache.insert(&fresh, &words.ids);
        }
        Ok(words)
    }

    /// Words and ids the word cache holds ([`WordCache`]).
    pub fn word_cache_usage(&self) -> (usize, usize) {
        self.word_cache.as_ref().map_or((0, 0), WordCache::usage)
    }

    /// transformers' `get_chat_template(None, tools)`.
    fn select_template(&self, with_tools: bool) -> Result<&ChatTemplate, TokenizeError> {
        let by_name = |name: &str| self.templates.iter().find(|t| t.name == name);
        if !self.named_templates {
            return self.templates.first().ok_or(TokenizeError::NoChatTemplate);
        }
        let chosen = if with_tools {
            by_name("tool_use").or_else(|| by_name("default"))
        } else {
            by_name("default")
        };
        chosen.ok_or(TokenizeError::NoChatTemplate)
    }

    fn prepare_chat(&self, chat: &ChatRequest) -> Result<Rendered, TokenizeError> {
        if chat.add_generation_prompt && chat.continue_final_message {
            return Err(bad(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        let mut input_bytes = 0usize;
        for v in chat.messages.iter().chain(chat.tools.iter()) {
            input_bytes = input_bytes.saturating_add(json_text_bytes(v));
        }
        for (k, v) in &chat.chat_template_kwargs {
            input_bytes = input_bytes
                .saturating_add(k.len())
                .saturating_add(json_text_bytes(v));
        }
        if input_bytes > PROMPT_BYTES_MAX {
            return Err(bad(format!(
                "the chat has {input_bytes} bytes of text; the router tokenizes at most {PROMPT_BYTES_MAX}"
            )));
        }

        // The keyword arguments, merged as vLLM merges them: the request's
        // chat_template_kwargs overridden by its flags (`build_chat_params`), over the defaults
        // tools=<request tools>, tokenize=False (`preprocess_chat`), where a null or "auto"
        // value of the request's does not override (`ChatParams.with_defaults`).
        let mut kwargs: Map<String, Json> = Map::new();
        if let Some(tools) = chat.tools.as_ref().filter(|t| !t.is_null()) {
            kwargs.insert("tools".into(), tools.clone());
        }
        kwargs.insert("tokenize".into(), Json::Bool(false));
        for (k, v) in &chat.chat_template_kwargs {
            if !(v.is_null() || v.as_str() == Some("auto")) {
                kwargs.insert(k.clone(), v.clone());
            }
        }
        kwargs.insert(
            "add_generation_prompt".into(),
            Json::Bool(chat.add_generation_prompt),
        );
        kwargs.insert(
            "continue_final_message".into(),
            Json::Bool(chat.continue_final_message),
        );
        if kwargs.get("chat_template").is_some_and(|v| !v.is_null()) {
            return Err(bad("a chat_template in chat_template_kwargs is refused: the router renders the model's own template"));
        }
        kwargs.remove("chat_template");
        let tools = kwargs.remove("tools").filter(|t| !t.is_null());
        let tokenize = kwargs.remove("tokenize").is_some_and(|v| truthy(&v));

        let template = self.select_template(tools.is_some())?;
        if let Some(e) = &template.compile_error {
            return Err(TokenizeError::Template(e.clone()));
        }

        let mut conversation = parse_conversation(&chat.messages, template.content_format)?;
        if conversation.iter().any(|m| role_of(m) == Some("developer"))
            && !(template.source.contains("\"developer\"")
                || template.source.contains("'developer'"))
        {
            conversation = consolidate_system_messages(developer_to_system(conversation));
        }

        // `resolve_chat_template_kwargs` keeps only what the template reads or
        // apply_chat_template names. Dropping a variable the template never reads changes
        // nothing it renders, so all are kept (minijinja's undeclared_variables misses a
        // variable that is only ever sliced, `s[1:]`); what matters is the refusals: a kept
        // `self` or `conversation` (always kept: apply_chat_template names them), `messages`
        // (every template reads it) or a read `conversations` collide with the arguments
        // transformers passes itself (a TypeError, 400 in vLLM).
        for name in ["self", "conversation", "messages"] {
            if kwargs.contains_key(name) {
                return Err(bad(format!("chat_template_kwargs may not set `{name}`")));
            }
        }
        if kwargs.contains_key("conversations") && template.variables.contains("conversations") {
            return Err(bad("chat_template_kwargs may not set `conversations`"));
        }
        for name in ["sanitize_control_tokens", "return_assistant_tokens_mask"] {
            if kwargs.remove(name).is_some_and(|v| truthy(&v)) {
                return Err(bad(format!(
                    "chat_template_kwargs.{name} is not served by the router"
                )));
            }
        }
        for name in [
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "tokenizer_kwargs",
        ] {
            let value = kwargs.remove(name);
            if tokenize && value.is_some_and(|v| truthy(&v)) {
                return Err(bad(format!(
                    "chat_template_kwargs.{name} with tokenize is not served by the router"
                )));
            }
        }
        let add_generation_prompt = kwargs
            .remove("add_generation_prompt")
            .is_some_and(|v| truthy(&v));
        let continue_final = kwargs
            .remove("continue_final_message")
            .is_some_and(|v| truthy(&v));
        let documents = kwargs.remove("documents").filter(|d| !d.is_null());
        if let Some(docs) = &documents {
            let ok = docs
                .as_array()
                .is_some_and(|a| a.iter().all(Json::is_object));
            if !ok {
                return Err(bad(
                    "Documents should be a list of dicts with 'title' and 'text' keys!",
                ));
            }
        }

        // transformers' apply_chat_template and render_jinja_template.
        if conversation.is_empty() {
            return Err(bad("Cannot apply chat template to an empty conversation. Provide at least one message."));
        }
        for message in &mut conversation {
            message.retain(|_, v| !v.is_null());
        }
        let mut conversation: Vec<Map<String, Json>> = conversation
            .into_iter()
            .map(alias_reasoning_fields)
            .collect();
        let final_text = if continue_final {
            Some(tag_final_message(&mut conversation, &template.source)?)
        } else {
            None
        };

        let mut context: BTreeMap<String, minijinja::Value> = BTreeMap::new();
        for (name, text) in &self.special_tokens {
            context.insert((*name).to_string(), minijinja::Value::from(text.as_str()));
        }
        for (k, v) in &kwargs {
            context.insert(
                k.clone(),
                minijinja::Value::from(minijinja::value::Serde(v)),
            );
        }
        context.insert(
            "messages".into(),
            minijinja::Value::from(minijinja::value::Serde(&conversation)),
        );
        context.insert(
            "tools".into(),
            minijinja::Value::from(minijinja::value::Serde(&tools)),
        );
        context.insert(
            "documents".into(),
            minijinja::Value::from(minijinja::value::Serde(&documents)),
        );
        context.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(add_generation_prompt),
        );

        let mut text = self.render(&template.name, context)?;
        if let Some(final_text) = final_text {
            text = trim_after_tag(text, &final_text)?;
        }
        Ok(Rendered {
            text,
            // With tokenize=True transformers encodes the text itself, without special
            // tokens, and vLLM takes those ids as they are.
            add_special_tokens: chat.add_special_tokens && !tokenize,
        })
    }

    fn render(
        &self,
        name: &str,
        context: BTreeMap<String, minijinja::Value>,
    ) -> Result<String, TokenizeError> {
        let template = self
            .env
            .get_template(name)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        let mut out = BoundedWriter {
            buf: Vec::new(),
            max: RENDERED_BYTES_MAX,
            overflowed: false,
        };
        let result = catch_unwind(AssertUnwindSafe(|| {
            template
                .render_captured_to(minijinja::Value::from(context), &mut out)
                .map(|_| ())
        }))
        .map_err(|_| TokenizeError::Template("the template engine panicked".into()))?;
        if out.overflowed {
            return Err(TokenizeError::Template(format!(
                "the template rendered more than {RENDERED_BYTES_MAX} bytes"
            )));
        }
        result.map_err(template_error)?;
        String::from_utf8(out.buf)
            .map_err(|_| TokenizeError::Template("the template rendered invalid UTF-8".into()))
    }
}

struct Rendered {
    text: String,
    add_special_tokens: bool,
}

/// An `io::Write` into memory that refuses to grow past `max` bytes.
struct BoundedWriter {
    buf: Vec<u8>,
    max: usize,
    overflowed: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.max {
            self.overflowed = true;
            return Err(std::io::Error::other("rendered output too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn template_error(e: minijinja::Error) -> TokenizeError {
    match e.kind() {
        minijinja::ErrorKind::OutOfFuel => TokenizeError::Template(format!(
            "the template needed more than its budget of {TEMPLATE_FUEL_MAX} fuel"
        )),
        // raise_exception's message as the template wrote it, as vLLM reports it.
        minijinja::ErrorKind::InvalidOperation => TokenizeError::Template(
            e.detail()
                .map(str::to_string)
                .unwrap_or_else(|| e.to_string()),
        ),
        _ => TokenizeError::Template(e.to_string()),
    }
}

fn bad(message: impl Into<String>) -> TokenizeError {
    TokenizeError::BadRequest(message.into())
}

/// Python's truthiness of a JSON value.
fn truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

/// The bytes of all strings (keys included) in a JSON value.
fn json_text_bytes(v: &Json) -> usize {
    match v {
        Json::String(s) => s.len(),
        Json::Array(a) => a
            .iter()
            .fold(0usize, |n, x| n.saturating_add(json_text_bytes(x))),
        Json::Object(o) => o.iter().fold(0usize, |n, (k, x)| {
            n.saturating_add(k.len()).saturating_add(json_text_bytes(x))
        }),
        _ => 8,
    }
}

/// A special token's text from the config: a string or transformers' AddedToken dict.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Adds what transformers adds on load: `added_tokens_decoder` entries (by id order) and named
/// special tokens the tokenizer does not already hold as added tokens.
fn add_missing_tokens(
    tokenizer: &mut tokenizers::Tokenizer,
    config: &Json,
    special_tokens: &[(&'static str, String)],
) {
    let mut present: HashSet<String> = tokenizer
        .get_added_tokens_decoder()
        .values()
        .map(|t| t.content.clone())
        .collect();
    let mut to_add: Vec<tokenizers::AddedToken> = Vec::new();
    if let Some(decoder) = config.get("added_tokens_decoder").and_then(Json::as_object) {
        let mut entries: Vec<(u64, &Map<String, Json>)> = decoder
            .iter()
            .filter_map(|(id, t)| Some((id.parse().ok()?, t.as_object()?)))
            .collect();
        entries.sort_by_key(|(id, _)| *id);
        for (_, t) in entries {
            let Some(content) = t.get("content").and_then(Json::as_str) else {
                continue;
            };
            if !present.insert(content.to_string()) {
                continue;
            }
            let flag = |k: &str, default: bool| t.get(k).and_then(Json::as_bool).unwrap_or(default);
            let special = flag("special", false);
            to_add.push(
                tokenizers::AddedToken::from(content.to_string(), special)
                    .lstrip(flag("lstrip", false))
                    .rstrip(flag("rstrip", false))
                    .single_word(flag("single_word", false))
                    .normalized(flag("normalized", !special)),
            );
        }
    }
    for (_, text) in special_tokens {
        if present.insert(text.clone()) {
            to_add.push(tokenizers::AddedToken::from(text.clone(), true).normalized(false));
        }
    }
    if !to_add.is_empty() {
        let _ = tokenizer.add_tokens(to_add);
    }
}

/// The model's chat templates by name, and whether they form a named set.
fn template_sources(
    dir: &Path,
    config: &Json,
) -> Result<(Vec<(String, String)>, bool), std::io::Error> {
    let read_optional = |path: &Path| match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    };
    let mut files: Vec<(String, String)> = Vec::new();
    if let Some(s) = read_optional(&dir.join("chat_template.jinja"))? {
        files.push(("default".into(), s));
    }
    let extra_dir = dir.join("additional_chat_templates");
    if extra_dir.is_dir() {
        let mut extra: Vec<(String, String)> = Vec::new();
        for entry in std::fs::read_dir(&extra_dir)? {
            let path = entry?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
                continue;
            }
            let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            extra.push((stem.to_string(), std::fs::read_to_string(&path)?));
        }
        extra.sort();
        files.extend(extra);
    }
    if !files.is_empty() {
        let named = !(files.len() == 1 && files[0].0 == "default");
        return Ok((files, named));
    }
    match config.get("chat_template") {
        Some(Json::String(s)) => return Ok((vec![("default".into(), s.clone())], false)),
        Some(Json::Array(list)) => {
            let named: Vec<(String, String)> = list
                .iter()
                .filter_map(|t| {
                    Some((
                        t.get("name")?.as_str()?.to_string(),
                        t.get("template")?.as_str()?.to_string(),
                    ))
                })
                .collect();
            return Ok((named, true));
        }
        _ => {}
    }
    if let Some(s) = read_optional(&dir.join("chat_template.json"))? {
        if let Ok(Json::Object(o)) = serde_json::from_str::<Json>(&s) {
            if let Some(Json::String(t)) = o.get("chat_template") {
                return Ok((vec![("default".into(), t.clone())], false));
            }
        }
    }
    Ok((Vec::new(), false))
}

fn role_of(message: &Map<String, Json>) -> Option<&str> {
    message.get("role").and_then(Json::as_str)
}

/// vLLM's content part types that carry text, and the field holding it.
fn text_field(part_type: &str) -> Option<&'static str> {
    Some(match part_type {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        _ => return None,
    })
}

/// Part types (and keys) vLLM treats as media: not served by the router.
const MEDIA_PART_KEYS: [&str; 10] = [
    "image_url",
    "input_image",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

/// One parsed content part: text, or a tool reference (kept as a dict for "openai" templates).
enum Part {
    Text(String),
    ToolReference(Json),
}

/// vLLM's `parse_chat_message_content_part` for text-only content.
fn parse_part(part: &Json) -> Result<Option<Part>, TokenizeError> {
    let multimodal = || bad("multimodal content parts are not served by the router");
    let obj = match part {
        Json::String(s) => return Ok(Some(Part::Text(s.clone()))),
        Json::Object(o) => o,
        _ => return Err(bad("a content part must be an object or a string")),
    };
    let part_type = obj.get("type").filter(|t| !t.is_null());
    let uuid = obj.get("uuid").filter(|u| !u.is_null());
    match part_type {
        Some(Json::String(t)) if uuid.is_none() => {
            if let Some(field) = text_field(t) {
                return match obj.get(field) {
                    None | Some(Json::Null) if t == "text" || t == "refusal" => Ok(None),
                    Some(Json::String(s)) => Ok(Some(Part::Text(s.clone()))),
                    _ => Err(bad(format!(
                        "content part of type '{t}' needs a string '{field}'"
                    ))),
                };
            }
            if t == "tool_reference" {
                return tool_reference(obj.get("name"));
            }
            if MEDIA_PART_KEYS.contains(&t.as_str()) {
                return Err(multimodal());
            }
            Err(bad(format!("Unsupported chat content part type: '{t}'")))
        }
        Some(t) if !t.is_string() => Err(bad("Invalid 'type' field in multimodal part.")),
        _ => {
            if MEDIA_PART_KEYS.iter().any(|k| obj.contains_key(*k)) {
                return Err(multimodal());
            }
            if obj.contains_key("tool_reference") {
                return tool_reference(obj.get("name"));
            }
            Err(bad("Missing 'type' field in multimodal part."))
        }
    }
}

fn tool_reference(name: Option<&Json>) -> Result<Option<Part>, TokenizeError> {
    match name {
        Some(Json::String(n)) => Ok(Some(Part::ToolReference(Json::String(n.clone())))),
        None | Some(Json::Null) => Err(bad("a tool_reference part needs a name")),
        Some(_) => Err(bad("a tool_reference name must be a string")),
    }
}

/// vLLM's `parse_chat_messages` (text only) and `_postprocess_messages`: the conversation the
/// template gets.
fn parse_conversation(
    messages: &[Json],
    format: ContentFormat,
) -> Result<Vec<Map<String, Json>>, TokenizeError> {
    let mut conversation = Vec::with_capacity(messages.len());
    for message in messages {
        let msg = message
            .as_object()
            .ok_or_else(|| bad("each message must be an object"))?;
        let role = match msg.get("role") {
            Some(Json::String(r)) => r.as_str(),
            _ => return Err(bad("each message needs a string 'role'")),
        };
        let mut parts: Vec<Json> = match msg.get("content") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::String(s)) => vec![serde_json::json!({"type": "text", "text": s})],
            Some(Json::Array(a)) => a.clone(),
            Some(_) => {
                return Err(bad(
                    "a message's content must be a string, a list of parts or null",
                ))
            }
        };
        if role == "system" {
            parts = strip_billing_header(parts);
        }
        let mut parsed = Vec::with_capacity(parts.len());
        for part in &parts {
            if let Some(p) = parse_part(part)? {
                parsed.push(p);
            }
        }
        let content = match format {
            ContentFormat::String => Json::String(
                parsed
                    .iter()
                    .map(|p| match p {
                        Part::Text(t) => t.as_str(),
                        Part::ToolReference(n) => n.as_str().unwrap_or_default(),
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            ContentFormat::OpenAi => Json::Array(
                parsed
                    .into_iter()
                    .map(|p| match p {
                        Part::Text(t) => serde_json::json!({"type": "text", "text": t}),
                        Part::ToolReference(n) => {
                            serde_json::json!({"type": "tool_reference", "name": n})
                        }
                    })
                    .collect(),
            ),
        };
        let mut out = Map::new();
        out.insert("role".into(), Json::String(role.to_string()));
        out.insert("content".into(), content);
        match role {
            "assistant" => {
                if let Some(calls) = msg.get("tool_calls").filter(|c| !c.is_null()) {
                    out.insert("tool_calls".into(), validated_tool_calls(calls)?);
                }
                match msg.get("reasoning") {
                    None | Some(Json::Null) => {}
                    Some(Json::Object(o))
                        if o.get("type").and_then(Json::as_str) == Some("prompt_embeds") =>
                    {
                        return Err(bad("prompt_embeds reasoning is not served by the router"));
                    }
                    Some(r) => {
                        out.insert("reasoning".into(), r.clone());
                        out.insert("reasoning_content".into(), r.clone());
                    }
                }
            }
            "tool" => {
                if let Some(id) = msg.get("tool_call_id") {
                    out.insert("tool_call_id".into(), id.clone());
                }
                if let Some(Json::Array(items)) = out.get("content") {
                    let all_text = items
                        .iter()
                        .all(|i| i.get("type").and_then(Json::as_str) == Some("text"));
                    if all_text {
                        let joined = items
                            .iter()
                            .filter_map(|i| i.get("text").and_then(Json::as_str))
                            .collect::<Vec<_>>()
                            .join("\n");
                        out.insert("content".into(), Json::String(joined));
                    }
                }
            }
            _ => {}
        }
        if let Some(Json::String(name)) = msg.get("name") {
            out.insert("name".into(), Json::String(name.clone()));
        }
        if let Some(Json::String(task)) = msg.get("task") {
            out.insert("task".into(), Json::String(task.clone()));
        }
        if role == "developer" {
            out.insert(
                "tools".into(),
                msg.get("tools").cloned().unwrap_or(Json::Null),
            );
        }
        conversation.push(out);
    }
    for message in &mut conversation {
        postprocess_tool_calls(message)?;
    }
    Ok(conversation)
}

/// vLLM's `_strip_claude_code_billing_header`: a system text part starting with the billing
/// header loses its first line (and is dropped when nothing remains).
fn strip_billing_header(parts: Vec<Json>) -> Vec<Json> {
    const HEADER: &str = "x-anthropic-billing-header";
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let text = match &part {
            Json::String(s) => Some(s.as_str()),
            Json::Object(o) if o.get("type").and_then(Json::as_str) == Some("text") => {
                o.get("text").and_then(Json::as_str)
            }
            _ => None,
        };
        let Some(text) = text.filter(|t| t.starts_with(HEADER)) else {
            out.push(part);
            continue;
        };
        let rest = text
            .split_once('\n')
            .map(|(_, r)| r.to_string())
            .unwrap_or_default();
        if rest.is_empty() {
            continue;
        }
        out.push(match part {
            Json::String(_) => Json::String(rest),
            Json::Object(mut o) => {
                o.insert("text".into(), Json::String(rest));
                Json::Object(o)
            }
            other => other,
        });
    }
    out
}

/// The assistant's tool calls as pydantic leaves them after validating openai's
/// `ChatCompletionMessageFunctionToolCallParam` (fields in its order `id`, `function`
/// (`arguments`, `name`), `type`; other keys dropped).
fn validated_tool_calls(calls: &Json) -> Result<Json, TokenizeError> {
    let items = calls
        .as_array()
        .ok_or_else(|| bad("assistant tool_calls must be a list"))?;
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Some(obj) = item.as_object() else {
            out.push(item.clone());
            continue;
        };
        let mut call = Map::new();
        if let Some(id) = obj.get("id") {
            call.insert("id".into(), id.clone());
        }
        if let Some(function) = obj.get("function") {
            let function = match function.as_object() {
                Some(f) => {
                    let mut fo = Map::new();
                    for key in ["arguments", "name"] {
                        if let Some(v) = f.get(key) {
                            fo.insert(key.into(), v.clone());
                        }
                    }
                    Json::Object(fo)
                }
                None => function.clone(),
            };
            call.insert("function".into(), function);
        }
        if let Some(t) = obj.get("type") {
            call.insert("type".into(), t.clone());
        }
        out.push(Json::Object(call));
    }
    Ok(Json::Array(out))
}

/// vLLM's `_postprocess_messages`: tool-call arguments become a dict (`{}` when missing, not
/// JSON, or JSON but not an object); an empty list of tool calls is dropped.
fn postprocess_tool_calls(message: &mut Map<String, Json>) -> Result<(), TokenizeError> {
    if role_of(message) != Some("assistant") {
        return Ok(());
    }
    let Some(Json::Array(calls)) = message.get_mut("tool_calls") else {
        return Ok(());
    };
    if calls.is_empty() {
        message.remove("tool_calls");
        return Ok(());
    }
    for item in calls.iter_mut() {
        let obj = item
            .as_object_mut()
            .ok_or_else(|| bad("assistant tool_calls entries must be objects."))?;
        let is_function = obj
            .get("type")
            .is_none_or(|t| t.as_str() == Some("function"));
        let Some(function) = obj
            .get_mut("function")
            .and_then(Json::as_object_mut)
            .filter(|_| is_function)
        else {
            return Err(bad(
                "chat completions only support assistant tool_calls of type 'function'.",
            ));
        };
        let parsed = match function.get("arguments") {
            Some(args) if truthy(args) => match args {
                Json::Object(_) => args.clone(),
                Json::String(s) => match serde_json::from_str::<Json>(s) {
                    Ok(v @ Json::Object(_)) => v,
                    _ => Json::Object(Map::new()),
                },
                _ => Json::Object(Map::new()),
            },
            _ => Json::Object(Map::new()),
        };
        function.insert("arguments".into(), parsed);
    }
    Ok(())
}

/// vLLM's `_convert_developer_to_system`.
fn developer_to_system(conversation: Vec<Map<String, Json>>) -> Vec<Map<String, Json>> {
    conversation
        .into_iter()
        .map(|mut m| {
            if role_of(&m) == Some("developer") {
                m.insert("role".into(), Json::String("system".into()));
                m.remove("tools");
            }
            m
        })
        .collect()
}

/// vLLM's `_consolidate_system_messages`: all system messages merged into one, first.
fn consolidate_system_messages(conversation: Vec<Map<String, Json>>) -> Vec<Map<String, Json>> {
    let mut system_texts: Vec<String> = Vec::new();
    let mut others = Vec::new();
    let mut merge = false;
    for (i, m) in conversation.iter().enumerate() {
        if role_of(m) == Some("system") {
            if i > 0 || !system_texts.is_empty() {
                merge = true;
            }
            let text = match m.get("content") {
                Some(Json::String(s)) => s.clone(),
                Some(Json::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| match p {
                        Json::String(s) => Some(s.as_str()),
                        Json::Object(o) => o.get("text").and_then(Json::as_str),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            if !text.is_empty() {
                system_texts.push(text);
            }
        } else {
            others.push(m.clone());
        }
    }
    if !merge {
        return conversation;
    }
    let mut merged = Map::new();
    merged.insert("role".into(), Json::String("system".into()));
    merged.insert("content".into(), Json::String(system_texts.join("\n\n")));
    std::iter::once(merged).chain(others).collect()
}

/// transformers' `_alias_reasoning_fields`: a message's reasoning under `thinking` (first) and
/// `reasoning_content` too.
fn alias_reasoning_fields(message: Map<String, Json>) -> Map<String, Json> {
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| message.get(*k).filter(|v| !v.is_null()).cloned());
    let Some(reasoning) = reasoning else {
        return message;
    };
    let mut out = Map::new();
    out.insert("thinking".into(), reasoning.clone());
    for (k, v) in message {
        out.insert(k, v);
    }
    out.insert("reasoning_content".into(), reasoning);
    out
}

/// transformers' `continue_final_message` preparation: the tag appended to the final message's
/// content (to its last text part for a list); returns the text to look for after rendering.
fn tag_final_message(
    conversation: &mut [Map<String, Json>],
    template_source: &str,
) -> Result<String, TokenizeError> {
    let last = conversation
        .last_mut()
        .ok_or_else(|| bad("continue_final_message is set but the conversation is empty!"))?;
    let Some(content) = last.get_mut("content") else {
        return Err(bad(
            "continue_final_message is set but the final message has no \"content\" to continue!",
        ));
    };
    if !template_source.contains("content") {
        return Err(bad("continue_final_message is set to \"content\" but this is not an accepted field in the chat_template"));
    }
    match content {
        Json::Array(blocks) => {
            for block in blocks.iter_mut().rev() {
                if let Some(Json::String(text)) = block.get_mut("text") {
                    let original = text.clone();
                    text.push_str(CONTINUE_TAG);
                    return Ok(original);
                }
            }
            Err(bad("continue_final_message is set but we could not find any text to continue in the final message!"))
        }
        Json::String(text) => {
            let original = text.clone();
            text.push_str(CONTINUE_TAG);
            Ok(original)
        }
        _ => Err(bad(
            "continue_final_message is set but the final message's content is not text",
        )),
    }
}

/// transformers' cut after rendering with `continue_final_message`: the text ends where the
/// tag was (trailing whitespace trimmed too when the template had trimmed the tag's space).
fn trim_after_tag(rendered: String, final_text: &str) -> Result<String, TokenizeError> {
    let tag = CONTINUE_TAG.trim_end();
    if !rendered.contains(jinja::py_trim(final_text)) || !rendered.contains(tag) {
        return Err(bad(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template",
        ));
    }
    let at = rendered.rfind(tag).unwrap_or(rendered.len());
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_string())
    } else {
        Ok(rendered[..at]
            .trim_end_matches(jinja::is_py_space)
            .to_string())
    }
}

/// A chat request's fields that decide its token ids.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<serde_json::Value>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub add_special_tokens: bool,
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    pub tools: Option<serde_json::Value>,
}

impl ChatRequest {
    /// Reads the fields vLLM reads from an OpenAI chat request body (or a /tokenize chat body),
    /// with vLLM's defaults (`add_generation_prompt` true, `continue_final_message` and
    /// `add_special_tokens` false); `documents` and `reasoning_effort` (with the
    /// `enable_thinking` it implies) join the template's keyword arguments as vLLM's
    /// `build_chat_params` adds them; tools take the shape vLLM's `model_dump` gives them.
    /// Refuses what it cannot honour (a per-request chat template, both flags set, malformed
    /// fields) with [`TokenizeError::BadRequest`].
    pub fn from_body(body: &serde_json::Value) -> Result<Self, TokenizeError> {
        let obj = body
            .as_object()
            .ok_or_else(|| bad("the request body must be a JSON object"))?;
        let mut messages = match obj.get("messages") {
            Some(Json::Array(m)) => m.clone(),
            _ => return Err(bad("'messages' must be a list")),
        };
        // ChatCompletionRequest._normalize_messages_before: reasoning_content -> reasoning.
        for m in &mut messages {
            if let Some(o) = m.as_object_mut() {
                if let Some(rc) = o.remove("reasoning_content").filter(|v| !v.is_null()) {
                    if o.get("reasoning").is_none_or(Json::is_null) {
                        o.insert("reasoning".into(), rc);
                    }
                }
            }
        }
        let flag = |name: &str, default: bool| -> Result<bool, TokenizeError> {
            match obj.get(name) {
                None => Ok(default),
                Some(v) => lax_bool(v).ok_or_else(|| bad(format!("'{name}' must be a boolean"))),
            }
        };
        if obj.get("continue_final_message").is_some_and(truthy)
            && obj.get("add_generation_prompt").is_some_and(truthy)
        {
            return Err(bad(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        let add_generation_prompt = flag("add_generation_prompt", true)?;
        let continue_final_message = flag("continue_final_message", false)?;
        let add_special_tokens = flag("add_special_tokens", false)?;
        if obj.get("chat_template").is_some_and(|t| !t.is_null()) {
            return Err(bad("a per-request chat_template is refused: the router renders the model's own template (vLLM needs --trust-request-chat-template for it)"));
        }
        let mut kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Json::Null) => Map::new(),
            Some(Json::Object(o)) => o.clone(),
            Some(_) => return Err(bad("'chat_template_kwargs' must be an object")),
        };
        if kwargs.get("chat_template").is_some_and(|t| !t.is_null()) {
            return Err(bad("a chat_template in chat_template_kwargs is refused: the router renders the model's own template"));
        }
        // build_chat_params: these override the request's kwargs when set.
        let user_sets_thinking = kwargs.contains_key("enable_thinking");
        match obj.get("documents") {
            None | Some(Json::Null) => {}
            Some(d) => {
                kwargs.insert("documents".into(), d.clone());
            }
        }
        match obj.get("reasoning_effort") {
            None | Some(Json::Null) => {}
            Some(Json::String(effort)) => {
                kwargs.insert("reasoning_effort".into(), Json::String(effort.clone()));
                if !user_sets_thinking {
                    kwargs.insert("enable_thinking".into(), Json::Bool(effort != "none"));
                }
            }
            Some(_) => return Err(bad("'reasoning_effort' must be a string")),
        }
        let tools = match obj.get("tools") {
            None | Some(Json::Null) => None,
            Some(t) => Some(normalize_tools(t)?),
        };
        Ok(Self {
            messages,
            add_generation_prompt,
            continue_final_message,
            add_special_tokens,
            chat_template_kwargs: kwargs,
            tools,
        })
    }
}

/// pydantic's lax boolean: JSON booleans, 0/1, and the strings it accepts.
fn lax_bool(v: &Json) -> Option<bool> {
    match v {
        Json::Bool(b) => Some(*b),
        Json::Number(n) => match n.as_f64() {
            Some(0.0) => Some(false),
            Some(1.0) => Some(true),
            _ => None,
        },
        Json::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}

/// Tools as vLLM hands them to the template: `ChatCompletionToolsParam.model_dump()`, i.e.
/// `{"type": "function", "function": {"name", "description", "parameters"[, "strict"]
/// [, "defer_loading"]}[, "defer_loading"]}` with unknown keys dropped and null description
/// and parameters kept.
fn normalize_tools(tools: &Json) -> Result<Json, TokenizeError> {
    let list = tools
        .as_array()
        .ok_or_else(|| bad("'tools' must be a list"))?;
    let mut out = Vec::with_capacity(list.len());
    for tool in list {
        let tool = tool
            .as_object()
            .ok_or_else(|| bad("each tool must be an object"))?;
        match tool.get("type") {
            None => {}
            Some(Json::String(t)) if t == "function" => {}
            Some(_) => return Err(bad("a tool's type must be \"function\"")),
        }
        let function = tool
            .get("function")
            .and_then(Json::as_object)
            .ok_or_else(|| bad("a tool needs a 'function' object"))?;
        let name = function
            .get("name")
            .and_then(Json::as_str)
            .ok_or_else(|| bad("a tool function needs a string 'name'"))?;
        let optional = |key: &str, ok: fn(&Json) -> bool| -> Result<Json, TokenizeError> {
            match function.get(key) {
                None | Some(Json::Null) => Ok(Json::Null),
                Some(v) if ok(v) => Ok(v.clone()),
                Some(_) => Err(bad(format!("a tool function's '{key}' has the wrong type"))),
            }
        };
        let bool_field = |v: Option<&Json>, what: &str| -> Result<Json, TokenizeError> {
            match v {
                None | Some(Json::Null) => Ok(Json::Null),
                Some(v) => lax_bool(v)
                    .map(Json::Bool)
                    .ok_or_else(|| bad(format!("'{what}' must be a boolean"))),
            }
        };
        let tool_defer = bool_field(tool.get("defer_loading"), "defer_loading")?;
        let mut function_defer = bool_field(function.get("defer_loading"), "defer_loading")?;
        if !tool_defer.is_null() && function_defer.is_null() {
            function_defer = tool_defer.clone();
        }
        let strict = bool_field(function.get("strict"), "strict")?;
        let mut f = Map::new();
        f.insert("name".into(), Json::String(name.to_string()));
        f.insert(
            "description".into(),
            optional("description", Json::is_string)?,
        );
        f.insert(
            "parameters".into(),
            optional("parameters", Json::is_object)?,
        );
        if !strict.is_null() {
            f.insert("strict".into(), strict);
        }
        if !function_defer.is_null() {
            f.insert("defer_loading".into(), function_defer);
        }
        let mut t = Map::new();
        t.insert("type".into(), Json::String("function".into()));
        t.insert("function".into(), Json::Object(f));
        if !tool_defer.is_null() {
            t.insert("defer_loading".into(), tool_defer);
        }
        out.push(Json::Object(t));
    }
    Ok(Json::Array(out))
}

#[cfg(test)]
mod tests {
    use super::jinja::{py_float_repr, strftime};

    #[test]
    fn how_many_bytes_a_normalizer_may_make_of_one() {
        use super::normalized_bytes_per_byte as f;
        use serde_json::json;
        assert_eq!(f(&serde_json::Value::Null), 1);
        assert_eq!(f(&json!({"type": "NFC"})), 3);
        assert_eq!(f(&json!({"type": "NFKC"})), 11);
        assert_eq!(
            f(&json!({"type": "Precompiled", "precompiled_charsmap": "AA"})),
            11
        );
        // Llama 2's: a prefix and spaces replaced by a three-byte character.
        let llama2 = json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        ]});
        assert_eq!(f(&llama2), 4 * 3);
        assert_eq!(
            f(&json!({"type": "Replace", "pattern": {"String": "ab"}, "content": ""})),
            1
        );
        assert_eq!(f(&json!({"type": "SomethingNew"})), 11);
        assert_eq!(f(&json!({"type": "Sequence"})), 11);
        let deep = json!({"type": "Sequence", "normalizers": [
            {"type": "NFKC"}, {"type": "NFKC"}, {"type": "NFKC"},
        ]});
        assert_eq!(f(&deep), 64, "capped");
    }

    #[test]
    fn python_float_repr() {
        for (f, expected) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (100.0, "100.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(py_float_repr(f), expected, "{f:e}");
        }
    }

    #[test]
    fn strftime_formats() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of the year.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-07-26 13:05:09");
        assert_eq!(
            strftime("%A %B %-d, %I %p, day %j, %y %e %%", t),
            "Friday July 26, 01 PM, day 208, 24 26 %"
        );
        assert_eq!(
            strftime("%F %T %D %Q", 0),
            "1970-01-01 00:00:00 01/01/70 %Q"
        );
        assert_eq!(strftime("%a %d %b %Y", 951_782_400), "Tue 29 Feb 2000");
    }
}
