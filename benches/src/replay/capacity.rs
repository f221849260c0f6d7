//! The fleet's no-cache capacity for a trace's mix of requests, from the mocker's own step-time
//! model (GET /v1/kvbm/mocker, `engine.cost`), so that `--load 1.0` offers exactly the work its
//! workers can do when nothing is reused.
//!
//! The model (kvbm-mocker's `config.rs`): `step = overhead + prefill_tokens·t_prefill +
//! decode_seqs·t_decode_seq + decode_kv_tokens·t_attn_decode + prefill_attn_pairs·t_attn_prefill`,
//! a prefill chunk of c tokens after p computed ones counting c·(p + c/2) pairs, chunks of at most
//! `max_num_batched_tokens`. One request's work with nothing cached is then its prompt's prefill
//! and attention plus, per output token, one decode slot attending its context so far. The
//! per-step overhead is shared by every request in a step and left out: at the loads replayed,
//! steps carry many requests, and leaving it out errs toward more offered work, not less.
//!
//! Prefill throughput alone (the mocker's `prefill_tokens_per_sec`) overstates capacity for long
//! prompts: a 12K-token prompt with 343 output tokens (the conversation trace's means) costs
//! about 1.5× its linear prefill on the llama3-8b-h100 preset, attention and decodes included.

use anyhow::Context;
use serde_json::Value;

use super::trace::Session;

/// The coefficients of the mocker's step-time model that scale with work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkModel {
    pub t_prefill: f64,
    pub t_decode_seq: f64,
    pub t_attn_decode: f64,
    pub t_attn_prefill: f64,
    pub chunk: usize,
}

impl WorkModel {
    /// From the mocker's GET /v1/kvbm/mocker answer.
    pub fn from_info(info: &Value) -> anyhow::Result<Self> {
        let engine = &info["engine"];
        let cost = &engine["cost"];
        let f = |v: &Value, k: &str| {
            v[k].as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .with_context(|| format!("the mocker's /v1/kvbm/mocker has no usable {k}: {info}"))
        };
        Ok(Self {
            t_prefill: f(cost, "t_prefill")?,
            t_decode_seq: f(cost, "t_decode_seq")?,
            t_attn_decode: f(cost, "t_attn_decode")?,
            t_attn_prefill: f(cost, "t_attn_prefill")?,
            chunk: f(engine, "max_num_batched_tokens")?.max(1.0) as usize,
        })
    }

    /// Simulated seconds of work one request costs with nothing cached.
    pub fn request_seconds(&self, prompt: usize, output: usize) -> f64 {
        let mut pairs = 0.0;
        let mut done = 0usize;
        while done < prompt {
            let c = (prompt - done).min(self.chunk);
            pairs += c as f64 * (done as f64 + c as f64 / 2.0);
            done += c;
        }
        // Output token k (0-based) is decoded attending prompt + k tokens; the first comes with
        // the prefill's last step, so output - 1 decodes follow.
        let decodes = output.saturating_sub(1) as f64;
        let attended = decodes * prompt as f64 + decodes * (decodes + 1.0) / 2.0;
        prompt as f64 * self.t_prefill
            + pairs * self.t_attn_prefill
            + decodes * self.t_decode_seq
            + attended * self.t_attn_decode
    }

    /// Prompt tokens per simulated second one worker sustains on `sessions`' mix with nothing
    /// cached (answers at their requested lengths, each capped at `max_output`).
    pub fn no_cache_tokens_per_s(&self, sessions: &[Session], max_output: Option<usize>) -> f64 {
        let (mut tokens, mut seconds) = (0.0, 0.0);
        for s in sessions {
            for (prompt, turn) in s.prompt_lengths().into_iter().zip(&s.turns) {
                let output = max_output.map_or(turn.output_tokens, |m| turn.output_tokens.min(m));
                tokens += prompt as f64;
                seconds += self.request_seconds(prompt, output.max(1));
            }
        }
        if seconds > 0.0 {
            tokens / seconds
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> WorkModel {
        WorkModel {
            t_prefill: 1e-5,
            t_decode_seq: 2e-5,
            t_attn_decode: 1e-8,
            t_attn_prefill: 1e-9,
            chunk: 100,
        }
    }

    #[test]
    fn one_request_counts_chunked_attention_and_growing_decodes() {
        let m = model();
        // 250 tokens in chunks 100/100/50: pairs 100·50 + 100·150 + 50·225 = 31 250.
        // 3 output tokens: 2 decodes attending 251 and 252 tokens.
        let want = 250.0 * 1e-5 + 31_250.0 * 1e-9 + 2.0 * 2e-5 + 503.0 * 1e-8;
        assert!((m.request_seconds(250, 3) - want).abs() < 1e-15);
        // One output token: the prefill alone.
        let prefill_only = 250.0 * 1e-5 + 31_250.0 * 1e-9;
        assert!((m.request_seconds(250, 1) - prefill_only).abs() < 1e-15);
    }

    #[test]
    fn the_mockers_info_is_read_and_a_missing_coefficient_is_named() {
        let info = serde_json::json!({"engine": {"max_num_batched_tokens": 100, "cost": {
            "t_prefill": 1e-5, "t_decode_seq": 2e-5, "t_attn_decode": 1e-8, "t_attn_prefill": 1e-9}}});
        assert_eq!(WorkModel::from_info(&info).unwrap(), model());
        let mut bad = info.clone();
        bad["engine"]["cost"]["t_attn_decode"] = Value::Null;
        let e = WorkModel::from_info(&bad).unwrap_err().to_string();
        assert!(e.contains("t_attn_decode"), "{e}");
    }
}
