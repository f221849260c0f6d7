//! The traces `kvbm-bench replay` reads, both JSON lines, turned into one plan: sessions of turns.
//!
//! **Mooncake** (FAST'25 release, `FAST25-release/traces/*.jsonl` of kvcache-ai/Mooncake), one
//! request a line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [u64, ...]}`, one id per 512-token block of the prompt, the last block partial;
//! equal ids stand for equal blocks. Each request becomes a session of one turn.
//!
//! **Sessions** (this crate's own), one conversation a line:
//!
//! ```json
//! {"start": 12.5, "system": {"id": 3, "tokens": 900},
//!  "turns": [{"user_tokens": 120, "output_tokens": 200},
//!            {"user_tokens": 40, "output_tokens": 80, "think_s": 6.0}]}
//! ```
//!
//! - `start`: seconds from the trace's start at which the first turn is sent (trace clock, scaled
//!   as Mooncake's timestamps are);
//! - `system` (optional): a shared system prompt: sessions with the same `id` begin with the same
//!   `tokens` tokens (the shorter one a prefix of the longer);
//! - `turns` (at least one): `user_tokens` new user tokens, `output_tokens` the answer's length,
//!   `think_s` (default 0, trace seconds, scaled with the timestamps) the pause between the
//!   previous turn's answer finishing and this turn being sent. Turn k's prompt is turn k-1's
//!   prompt + turn k-1's answer (as the worker streamed it) + turn k's user tokens, so each turn
//!   repeats the whole conversation so far, as a chat client does.
//!
//! A malformed line (bad JSON, missing field, an empty session, hash ids that do not fit
//! `input_length`) stops the read with an error naming the file and line.

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

/// Tokens per Mooncake block (`hash_ids` entry).
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// Which format a trace file is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Mooncake,
    Sessions,
}

/// Where a stretch of prompt tokens comes from (see `tokens::TokenMap`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Mooncake blocks: `block` tokens of each id (512 as traced), the last id's first
    /// `len - block * (n - 1)` only.
    Blocks {
        hash_ids: Vec<u64>,
        len: usize,
        block: usize,
    },
    /// The first `len` tokens of the endless sequence named by `key`.
    Stream { key: u64, len: usize },
}

impl Part {
    pub fn len(&self) -> usize {
        match self {
            Part::Blocks { len, .. } | Part::Stream { len, .. } => *len,
        }
    }
}

/// One turn of a session: what the user adds, how long the answer is, the pause before it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub user: Part,
    pub output_tokens: usize,
    /// Trace seconds between the previous answer's end and this turn (0 for the first).
    pub think_s: f64,
}

/// A conversation: a start time, an optional shared prefix, its turns.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// Trace seconds from the trace's origin.
    pub start: f64,
    pub prefix: Option<Part>,
    pub turns: Vec<Turn>,
}

impl Session {
    /// The nominal prompt length of each turn (answers at their requested length).
    pub fn prompt_lengths(&self) -> Vec<usize> {
        let mut history = self.prefix.as_ref().map_or(0, Part::len);
        let mut out = Vec::with_capacity(self.turns.len());
        for turn in &self.turns {
            let prompt = history + turn.user.len();
            out.push(prompt);
            history = prompt + turn.output_tokens.max(1);
        }
        out
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MooncakeLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    hash_ids: Vec<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionLine {
    start: f64,
    #[serde(default)]
    system: Option<SystemLine>,
    turns: Vec<TurnLine>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SystemLine {
    id: u64,
    tokens: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TurnLine {
    user_tokens: usize,
    output_tokens: usize,
    #[serde(default)]
    think_s: f64,
}

/// Namespaces of stream keys, so that a session's tokens never reuse a Mooncake id's.
const KEY_SYSTEM: u64 = 1;
const KEY_USER: u64 = 2;
pub(crate) const KEY_ANSWER: u64 = 3;

/// A key for `Part::Stream` from a namespace and two numbers.
pub fn stream_key(namespace: u64, a: u64, b: u64) -> u64 {
    let mut bytes = [0u8; 24];
    bytes[..8].copy_from_slice(&namespace.to_le_bytes());
    bytes[8..16].copy_from_slice(&a.to_le_bytes());
    bytes[16..].copy_from_slice(&b.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 0x5e55_1045)
}

/// Reads the first `limit` entries (requests or sessions) of `path`.
pub fn read(path: &Path, format: Format, limit: Option<usize>) -> anyhow::Result<Vec<Session>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the trace {}", path.display()))?;
    parse(&text, format, limit).with_context(|| format!("trace {}", path.display()))
}

/// Parses trace text; blank lines are skipped, anything else malformed is an error with its line.
pub fn parse(text: &str, format: Format, limit: Option<usize>) -> anyhow::Result<Vec<Session>> {
    let mut sessions = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if limit.is_some_and(|n| sessions.len() >= n) {
            break;
        }
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let number = index + 1;
        let session = match format {
            Format::Mooncake => mooncake(line),
            Format::Sessions => session(line, index as u64),
        }
        .with_context(|| format!("line {number}"))?;
        sessions.push(session);
    }
    if sessions.is_empty() {
        bail!("no requests in the trace");
    }
    Ok(sessions)
}

fn mooncake(line: &str) -> anyhow::Result<Session> {
    let r: MooncakeLine = serde_json::from_str(line)?;
    let n = r.hash_ids.len();
    if r.input_length == 0 || n == 0 {
        bail!(
            "an empty prompt (input_length {}, {n} hash ids)",
            r.input_length
        );
    }
    if !((n - 1) * MOONCAKE_BLOCK_TOKENS < r.input_length
        && r.input_length <= n * MOONCAKE_BLOCK_TOKENS)
    {
        bail!(
            "{n} hash ids of {MOONCAKE_BLOCK_TOKENS} tokens cannot hold input_length {}",
            r.input_length
        );
    }
    if !r.timestamp.is_finite() || r.timestamp < 0.0 {
        bail!("timestamp {} is not a time", r.timestamp);
    }
    Ok(Session {
        start: r.timestamp / 1000.0,
        prefix: None,
        turns: vec![Turn {
            user: Part::Blocks {
                hash_ids: r.hash_ids,
                len: r.input_length,
                block: MOONCAKE_BLOCK_TOKENS,
            },
            output_tokens: r.output_length,
            think_s: 0.0,
        }],
    })
}

fn session(line: &str, index: u64) -> anyhow::Result<Session> {
    let s: SessionLine = serde_json::from_str(line)?;
    if !s.start.is_finite() || s.start < 0.0 {
        bail!("start {} is not a time", s.start);
    }
    if s.turns.is_empty() {
        bail!("a session without turns");
    }
    let prefix = s.system.map(|sys| Part::Stream {
        key: stream_key(KEY_SYSTEM, sys.id, 0),
        len: sys.tokens,
    });
    let mut turns = Vec::with_capacity(s.turns.len());
    for (t, turn) in s.turns.into_iter().enumerate() {
        if !turn.think_s.is_finite() || turn.think_s < 0.0 {
            bail!("turn {}: think_s {} is not a duration", t + 1, turn.think_s);
        }
        if t == 0 && turn.user_tokens == 0 && prefix.as_ref().is_none_or(|p| p.len() == 0) {
            bail!("turn 1 has an empty prompt");
        }
        turns.push(Turn {
            user: Part::Stream {
                key: stream_key(KEY_USER, index, t as u64),
                len: turn.user_tokens,
            },
            output_tokens: turn.output_tokens,
            think_s: turn.think_s,
        });
    }
    Ok(Session {
        start: s.start,
        prefix,
        turns,
    })
}

/// Shrinks a trace for quick functional runs: each Mooncake hash id stands for `block_tokens`
/// tokens instead of 512 (the last block scaled in proportion, rounded up), and answers are cut
/// to `max_output_tokens`. Which requests share which blocks is unchanged.
pub fn shrink(sessions: &mut [Session], block_tokens: usize, max_output_tokens: Option<usize>) {
    for s in sessions {
        for turn in &mut s.turns {
            if let Part::Blocks {
                hash_ids,
                len,
                block,
            } = &mut turn.user
            {
                if block_tokens != *block && block_tokens > 0 {
                    let n = hash_ids.len();
                    let last = *len - *block * (n - 1);
                    *len = block_tokens * (n - 1) + (last * block_tokens).div_ceil(*block);
                    *block = block_tokens;
                }
            }
            if let Some(m) = max_output_tokens {
                turn.output_tokens = turn.output_tokens.min(m);
            }
        }
    }
}

/// How trace time maps to simulated time: `sim = (trace - origin) * factor`.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Scale {
    pub origin: f64,
    pub factor: f64,
    /// The trace's span (first to last start), trace seconds.
    pub trace_span_s: f64,
    /// Prompt tokens of every turn (answers at their nominal length).
    pub prompt_tokens: u64,
    /// Prompt tokens per simulated second offered (prompt_tokens / scaled span; 0 if no span).
    pub offered_prompt_tokens_per_s: f64,
}

/// The scale at which `sessions` offer `target_tokens_per_s` prompt tokens per simulated second
/// (all prompt tokens over the span of the start times). A trace whose requests all start at
/// once is sent at once (factor 1).
pub fn scale_for(sessions: &[Session], target_tokens_per_s: f64) -> Scale {
    let origin = sessions
        .iter()
        .map(|s| s.start)
        .fold(f64::INFINITY, f64::min);
    let last = sessions.iter().map(|s| s.start).fold(0.0, f64::max);
    let span = (last - origin).max(0.0);
    let prompt_tokens: u64 = sessions
        .iter()
        .flat_map(|s| s.prompt_lengths())
        .map(|n| n as u64)
        .sum();
    let factor = if span > 0.0 && target_tokens_per_s > 0.0 {
        prompt_tokens as f64 / target_tokens_per_s / span
    } else {
        1.0
    };
    Scale {
        origin,
        factor,
        trace_span_s: span,
        prompt_tokens,
        offered_prompt_tokens_per_s: if span > 0.0 {
            prompt_tokens as f64 / (span * factor)
        } else {
            0.0
        },
    }
}

impl Scale {
    /// Simulated seconds of a trace time.
    pub fn sim(&self, trace_s: f64) -> f64 {
        (trace_s - self.origin) * self.factor
    }
    /// Simulated seconds of a trace duration.
    pub fn sim_duration(&self, trace_s: f64) -> f64 {
        trace_s * self.factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_become_one_turn_sessions_in_order() {
        let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\n\
                    {\"timestamp\": 1500, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [1]}\n";
        let s = parse(text, Format::Mooncake, None).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[1].start, 1.5);
        assert_eq!(
            s[0].turns[0].user,
            Part::Blocks {
                hash_ids: vec![1, 2],
                len: 600,
                block: 512
            }
        );
        assert_eq!(s[0].prompt_lengths(), vec![600]);
        // Shrunk to 64 tokens a block: 64 + ceil(88 / 8) = 75; the second 1 block of 64.
        let mut small = s.clone();
        shrink(&mut small, 64, Some(3));
        assert_eq!(small[0].prompt_lengths(), vec![75]);
        assert_eq!(small[1].prompt_lengths(), vec![64]);
        assert_eq!(small[0].turns[0].output_tokens, 3);
        assert_eq!(small[1].turns[0].output_tokens, 0);
        let mut same = s.clone();
        shrink(&mut same, 512, None);
        assert_eq!(same, s);
        let first = parse(text, Format::Mooncake, Some(1)).unwrap();
        assert_eq!(first.len(), 1);
    }

    #[test]
    fn malformed_lines_are_errors_naming_the_line() {
        let good =
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}";
        for (bad, says) in [
            ("{\"timestamp\": 0, \"input_length\": 10}", "missing field"),
            ("not json", "expected"),
            (
                "{\"timestamp\": 0, \"input_length\": 1025, \"output_length\": 5, \"hash_ids\": [1, 2]}",
                "cannot hold",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 5, \"hash_ids\": [1, 2]}",
                "cannot hold",
            ),
            (
                "{\"timestamp\": -4, \"input_length\": 5, \"output_length\": 5, \"hash_ids\": [1]}",
                "not a time",
            ),
        ] {
            let text = format!("{good}\n{good}\n{bad}\n");
            let err = format!("{:#}", parse(&text, Format::Mooncake, None).unwrap_err());
            assert!(err.contains("line 3"), "{err}");
            assert!(err.contains(says), "{err}");
        }
        let err = format!("{:#}", parse("\n", Format::Mooncake, None).unwrap_err());
        assert!(err.contains("no requests"), "{err}");
    }

    #[test]
    fn session_prompts_grow_by_each_answer_and_user_turn() {
        let text = "{\"start\": 2, \"system\": {\"id\": 7, \"tokens\": 100}, \"turns\": [\
                    {\"user_tokens\": 10, \"output_tokens\": 20}, \
                    {\"user_tokens\": 5, \"output_tokens\": 0, \"think_s\": 3}, \
                    {\"user_tokens\": 1, \"output_tokens\": 4}]}\n\
                    {\"start\": 0, \"system\": {\"id\": 7, \"tokens\": 50}, \"turns\": [{\"user_tokens\": 1, \"output_tokens\": 1}]}";
        let s = parse(text, Format::Sessions, None).unwrap();
        // 100 + 10; + 20 answer + 5; + 1 (an empty answer still yields one token) + 1.
        assert_eq!(s[0].prompt_lengths(), vec![110, 135, 137]);
        assert_eq!(s[0].turns[1].think_s, 3.0);
        // The same system id gives the same key; users of different sessions differ.
        let key = |p: &Option<Part>| match p {
            Some(Part::Stream { key, .. }) => *key,
            _ => panic!("no system prompt"),
        };
        assert_eq!(key(&s[0].prefix), key(&s[1].prefix));
        assert_ne!(s[0].turns[0].user, s[1].turns[0].user);
    }

    #[test]
    fn malformed_sessions_are_errors_naming_the_line() {
        for (bad, says) in [
            ("{\"start\": 0, \"turns\": []}", "without turns"),
            ("{\"start\": 0, \"turns\": [{\"user_tokens\": 0, \"output_tokens\": 3}]}", "empty prompt"),
            ("{\"start\": 0, \"turns\": [{\"user_tokens\": 3, \"output_tokens\": 3, \"think_s\": -1}]}", "not a duration"),
            ("{\"start\": 0, \"turns\": [{\"user_tokens\": 3}]}", "missing field"),
            ("{\"start\": 0, \"turns\": [], \"extra\": 1}", "unknown field"),
        ] {
            let text = format!("{{\"start\": 0, \"turns\": [{{\"user_tokens\": 3, \"output_tokens\": 3}}]}}\n{bad}");
            let err = format!("{:#}", parse(&text, Format::Sessions, None).unwrap_err());
            assert!(err.contains("line 2"), "{err}");
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn scaling_offers_the_target_prompt_token_rate() {
        // Three requests of 1000 tokens over 10 trace seconds: 3000 tokens. At 600 tokens/s the
        // span must last 5 simulated seconds, so the factor is 0.5.
        let text = (0..3)
            .map(|i| {
                format!(
                    "{{\"timestamp\": {}, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [{i}, 9]}}",
                    10_000 + i * 5000
                )
            })
            .collect::<Vec<_>>()
            .join("\n");
        let s = parse(&text, Format::Mooncake, None).unwrap();
        let scale = scale_for(&s, 600.0);
        assert_eq!(scale.prompt_tokens, 3000);
        assert!((scale.factor - 0.5).abs() < 1e-12, "{scale:?}");
        assert!((scale.offered_prompt_tokens_per_s - 600.0).abs() < 1e-9);
        assert_eq!(scale.sim(10.0), 0.0);
        assert!((scale.sim(20.0) - 5.0).abs() < 1e-12);
        assert!((scale.sim_duration(4.0) - 2.0).abs() < 1e-12);
        // All at once: sent at once.
        let one = parse(
            "{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}",
            Format::Mooncake,
            None,
        )
        .unwrap();
        let scale = scale_for(&one, 600.0);
        assert_eq!(scale.factor, 1.0);
        assert_eq!(scale.sim(0.005), 0.0);
    }

    #[test]
    fn the_committed_trace_parses_whole() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mooncake-conversation.jsonl");
        let s = read(&path, Format::Mooncake, None).unwrap();
        assert_eq!(s.len(), 12_031);
    }
}
