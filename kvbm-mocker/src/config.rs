//! The mocker's flags, its model/GPU presets and the step-time model they feed.
//!
//! Step time (simulated seconds) of one engine step:
//!
//! ```text
//! step = overhead
//!      + prefill_tokens      * t_prefill        (linear layers of each prompt token computed)
//!      + decode_seqs         * t_decode_seq     (linear layers of each decoded token)
//!      + decode_kv_tokens    * t_attn_decode    (KV read by the decodes: each decode's context)
//!      + prefill_attn_pairs  * t_attn_prefill   (query x key pairs of the prefill chunks)
//! ```
//!
//! where `decode_kv_tokens` is the sum of every decoding request's context length and
//! `prefill_attn_pairs` is, for each prefill chunk of `c` tokens after a prefix of `p` tokens,
//! `c * (p + c / 2)` (causal attention: the chunk's i-th token sees `p + i` keys).
//!
//! Presets derive the coefficients from published figures (each named where it is used):
//! `t_prefill = t_decode_seq = 2 * params / (peak_bf16_flops * mfu)` (2 FLOPs per parameter per
//! token), `overhead = weight_bytes / (hbm_bytes_per_s * mbu)` (every step reads the weights once),
//! `t_attn_decode = kv_bytes_per_token / (hbm_bytes_per_s * mbu)` (a decode reads its context's
//! KV), `t_attn_prefill = 4 * layers * q_heads * head_dim / (peak_bf16_flops * mfu)` (QK^T and AV,
//! 2 FLOPs per multiply-add each). MFU 0.5 and MBU 0.8 are assumptions, stated here and
//! overridable through the coefficients themselves. KV bytes per token =
//! `layers * kv_heads * head_dim * 2 (K and V) * 2 (bf16)`. Default GPU blocks = (0.9 of HBM -
//! weights) / (KV bytes per block), as vLLM's `--gpu-memory-utilization 0.9` (activations
//! ignored).

use clap::Parser;
use serde::Serialize;

/// Model FLOPs utilisation assumed for compute-bound work.
pub const MFU: f64 = 0.5;
/// Memory bandwidth utilisation assumed for memory-bound work.
pub const MBU: f64 = 0.8;

/// A model on a GPU (or a tensor-parallel group of GPUs), from published figures.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Preset {
    /// The name `--preset` takes.
    pub name: &'static str,
    /// What it stands for.
    pub about: &'static str,
    /// Parameters (model card).
    pub params: f64,
    /// Transformer layers (config.json `num_hidden_layers`).
    pub layers: u32,
    /// Query heads (`num_attention_heads`).
    pub q_heads: u32,
    /// KV heads (`num_key_value_heads`).
    pub kv_heads: u32,
    /// Head dimension (`head_dim`, or hidden / heads).
    pub head_dim: u32,
    /// GPUs the model is split over (tensor parallel).
    pub gpus: u32,
    /// Dense bf16 peak of one GPU, FLOP/s (NVIDIA H100 SXM datasheet: 989 TFLOPS dense).
    pub gpu_bf16_flops: f64,
    /// HBM bandwidth of one GPU, bytes/s (H100 SXM datasheet: 3.35 TB/s).
    pub gpu_hbm_bytes_per_s: f64,
    /// HBM of one GPU, bytes (H100 SXM: 80 GB).
    pub gpu_hbm_bytes: f64,
}

const H100_FLOPS: f64 = 989e12;
const H100_HBM_BW: f64 = 3.35e12;
const H100_HBM: f64 = 80e9;

/// The presets `--list-presets` prints.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "llama3-8b-h100",
        about: "Llama 3.1 8B (8.03e9 params, 32 layers, 32 q / 8 kv heads x 128) on one H100 SXM",
        params: 8.03e9,
        layers: 32,
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        gpus: 1,
        gpu_bf16_flops: H100_FLOPS,
        gpu_hbm_bytes_per_s: H100_HBM_BW,
        gpu_hbm_bytes: H100_HBM,
    },
    Preset {
        name: "qwen3-32b-h100",
        about: "Qwen3 32B (32.8e9 params, 64 layers, 64 q / 8 kv heads x 128) on one H100 SXM",
        params: 32.8e9,
        layers: 64,
        q_heads: 64,
        kv_heads: 8,
        head_dim: 128,
        gpus: 1,
        gpu_bf16_flops: H100_FLOPS,
        gpu_hbm_bytes_per_s: H100_HBM_BW,
        gpu_hbm_bytes: H100_HBM,
    },
    Preset {
        name: "llama3-70b-4xh100",
        about:
            "Llama 3.1 70B (70.6e9 params, 80 layers, 64 q / 8 kv heads x 128) on 4 H100 SXM, TP4",
        params: 70.6e9,
        layers: 80,
        q_heads: 64,
        kv_heads: 8,
        head_dim: 128,
        gpus: 4,
        gpu_bf16_flops: H100_FLOPS,
        gpu_hbm_bytes_per_s: H100_HBM_BW,
        gpu_hbm_bytes: H100_HBM,
    },
];

/// The preset named `name`.
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

impl Preset {
    /// KV cache bytes per token (all layers, K and V, bf16).
    pub fn kv_bytes_per_token(&self) -> f64 {
        f64::from(self.layers) * f64::from(self.kv_heads) * f64::from(self.head_dim) * 4.0
    }

    /// The step-time model this preset gives.
    pub fn cost(&self) -> StepCost {
        let flops = self.gpu_bf16_flops * f64::from(self.gpus) * MFU;
        let hbm = self.gpu_hbm_bytes_per_s * f64::from(self.gpus) * MBU;
        let per_token = 2.0 * self.params / flops;
        StepCost {
            overhead: self.params * 2.0 / hbm,
            t_prefill: per_token,
            t_decode_seq: per_token,
            t_attn_decode: self.kv_bytes_per_token() / hbm,
            t_attn_prefill: 4.0
                * f64::from(self.layers)
                * f64::from(self.q_heads)
                * f64::from(self.head_dim)
                / flops,
            kv_bytes_per_token: self.kv_bytes_per_token(),
        }
    }

    /// GPU blocks of `block_size` tokens that fit in 0.9 of HBM after the weights.
    pub fn default_gpu_blocks(&self, block_size: usize) -> usize {
        let free = 0.9 * self.gpu_hbm_bytes * f64::from(self.gpus) - 2.0 * self.params;
        (free / (self.kv_bytes_per_token() * block_size as f64)).max(1.0) as usize
    }
}

/// The coefficients of the step-time model (see the module docs), simulated seconds.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct StepCost {
    /// Fixed cost of a step (weights read once).
    pub overhead: f64,
    /// Per prompt token computed.
    pub t_prefill: f64,
    /// Per decoding sequence.
    pub t_decode_seq: f64,
    /// Per context token a decode attends to.
    pub t_attn_decode: f64,
    /// Per query x key pair of a prefill chunk.
    pub t_attn_prefill: f64,
    /// KV bytes per token (for tier load times).
    pub kv_bytes_per_token: f64,
}

/// What one step did, as the cost model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// Prompt (or recomputed) tokens computed.
    pub prefill_tokens: u64,
    /// Sequences that decoded one token.
    pub decode_seqs: u64,
    /// Sum of the decoding sequences' context lengths.
    pub decode_kv_tokens: u64,
    /// Sum over prefill chunks of `chunk * (prefix + chunk / 2)`.
    pub prefill_attn_pairs: f64,
}

impl StepCost {
    /// Simulated duration of a step of this shape.
    pub fn step_seconds(&self, s: &StepShape) -> f64 {
        self.overhead
            + s.prefill_tokens as f64 * self.t_prefill
            + s.decode_seqs as f64 * self.t_decode_seq
            + s.decode_kv_tokens as f64 * self.t_attn_decode
            + s.prefill_attn_pairs * self.t_attn_prefill
    }

    /// Prompt tokens per simulated second of one worker prefilling fresh prompts at a full
    /// budget of `budget` tokens per step (one chunk of `budget` tokens after no prefix).
    pub fn prefill_tokens_per_sec(&self, budget: usize) -> f64 {
        let b = budget as f64;
        let shape = StepShape {
            prefill_tokens: budget as u64,
            prefill_attn_pairs: b * b / 2.0,
            ..Default::default()
        };
        b / self.step_seconds(&shape)
    }
}

/// `kvbm-mocker`'s command line.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvbm-mocker",
    about = "A simulated vLLM fleet: N workers answering vLLM's OpenAI API and publishing vLLM's KV events"
)]
pub struct Args {
    /// Workers to run.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// HTTP port of worker 0 (worker i: BASE + i); 0 picks free ports.
    #[arg(long, default_value_t = 0)]
    pub http_port: u16,
    /// KV event PUB port of worker 0 (worker i: ZBASE + 2i, replay ROUTER ZBASE + 2i + 1); 0
    /// picks free ports.
    #[arg(long, default_value_t = 0)]
    pub zmq_port: u16,
    /// Directory with tokenizer.json (+ optional tokenizer_config.json with a chat template).
    #[arg(long)]
    pub model_path: Option<std::path::PathBuf>,
    /// Model id served (default: the model directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Model/GPU preset (see --list-presets).
    #[arg(long, default_value = "llama3-8b-h100")]
    pub preset: String,
    /// Prints the presets and exits.
    #[arg(long)]
    pub list_presets: bool,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// GPU blocks per worker (default: from the preset).
    #[arg(long)]
    pub gpu_blocks: Option<usize>,
    /// Host (CPU pinned) blocks per worker; 0: no host tier.
    #[arg(long, default_value_t = 0)]
    pub host_blocks: usize,
    /// Disk blocks per worker; 0: no disk tier.
    #[arg(long, default_value_t = 0)]
    pub disk_blocks: usize,
    /// Blocks of a shared pool every worker of this process reaches (kvbm's shared tier on
    /// Redis / Valkey, modelled); 0: none. What reaches a worker's host tier is written to it.
    #[arg(long, default_value_t = 0)]
    pub shared_blocks: usize,
    /// The shared pool's name in events (`ownership`).
    #[arg(long, default_value = "mocker-pool")]
    pub shared_pool: String,
    /// Simulated time runs this many times faster than wall time.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Also writes the worker lines to this file (atomically, by rename).
    #[arg(long)]
    pub ready_file: Option<std::path::PathBuf>,
    /// Token budget of one step (vLLM's --max-num-batched-tokens).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Running sequences at most (vLLM's --max-num-seqs).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// max_tokens of a request that sets none (vLLM's completions default is 16; its chat
    /// default, the context left, is not modelled).
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u32,
    /// At most one SSE chunk per this many wall milliseconds per request.
    #[arg(long, default_value_t = 20)]
    pub stream_interval_ms: u64,
    /// Host-to-device bandwidth, GB/s (loads from the host tier).
    #[arg(long, default_value_t = 25.0)]
    pub host_gbps: f64,
    /// Disk read bandwidth, GB/s (loads from the disk tier).
    #[arg(long, default_value_t = 6.0)]
    pub disk_gbps: f64,
    /// Shared pool read bandwidth, GB/s (loads over the network from the shared tier).
    #[arg(long, default_value_t = 2.0)]
    pub shared_gbps: f64,
    /// Tokio threads serving HTTP for all workers.
    #[arg(long, default_value_t = 2)]
    pub http_threads: usize,
    /// Calibration: fixed seconds per step (default: the preset's).
    #[arg(long)]
    pub overhead: Option<f64>,
    /// Calibration: seconds per prefill token.
    #[arg(long)]
    pub t_prefill: Option<f64>,
    /// Calibration: seconds per decoding sequence.
    #[arg(long)]
    pub t_decode_seq: Option<f64>,
    /// Calibration: seconds per context token attended by a decode.
    #[arg(long)]
    pub t_attn_decode: Option<f64>,
    /// Calibration: seconds per query x key pair of a prefill chunk.
    #[arg(long)]
    pub t_attn_prefill: Option<f64>,
    /// Calibration: KV bytes per token (tier load sizes).
    #[arg(long)]
    pub kv_bytes_per_token: Option<f64>,
}

/// Everything one worker's engine needs, checked.
#[derive(Debug, Clone, Serialize)]
pub struct EngineConfig {
    /// Preset name.
    pub preset: String,
    /// Tokens per block.
    pub block_size: usize,
    /// GPU blocks.
    pub gpu_blocks: usize,
    /// Host blocks (0: none).
    pub host_blocks: usize,
    /// Disk blocks (0: none).
    pub disk_blocks: usize,
    /// The fleet's shared pool's blocks (0: none).
    pub shared_blocks: usize,
    /// The shared pool's name.
    pub shared_pool: String,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Running sequences at most.
    pub max_num_seqs: usize,
    /// Simulated / wall time.
    pub speedup: f64,
    /// Host-to-device bytes/s.
    pub host_bytes_per_s: f64,
    /// Disk read bytes/s.
    pub disk_bytes_per_s: f64,
    /// Shared pool read bytes/s.
    pub shared_bytes_per_s: f64,
    /// The step-time model.
    pub cost: StepCost,
}

/// A flag with a value it cannot take.
#[derive(Debug, thiserror::Error)]
#[error("--{flag} {value}: {why}")]
pub struct FlagError {
    /// The flag, without dashes.
    pub flag: &'static str,
    /// The value given.
    pub value: String,
    /// Why it is refused.
    pub why: String,
}

fn bad(flag: &'static str, value: impl ToString, why: impl Into<String>) -> FlagError {
    FlagError {
        flag,
        value: value.to_string(),
        why: why.into(),
    }
}

fn positive(flag: &'static str, v: f64) -> Result<f64, FlagError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(bad(flag, v, "must be a positive number"))
    }
}

fn non_negative(flag: &'static str, v: f64) -> Result<f64, FlagError> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(bad(flag, v, "must be a finite number >= 0"))
    }
}

impl Args {
    /// The engine configuration these flags give, or the first flag refused.
    pub fn engine_config(&self) -> Result<EngineConfig, FlagError> {
        let p = preset(&self.preset).ok_or_else(|| {
            let names: Vec<_> = PRESETS.iter().map(|p| p.name).collect();
            bad(
                "preset",
                &self.preset,
                format!("unknown preset; one of {}", names.join(", ")),
            )
        })?;
        if self.workers == 0 || self.workers > 1024 {
            return Err(bad("workers", self.workers, "must be 1 ..= 1024"));
        }
        if self.block_size == 0 || self.block_size > 4096 {
            return Err(bad("block-size", self.block_size, "must be 1 ..= 4096"));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(bad("max-num-batched-tokens", 0, "must be at least 1"));
        }
        if self.max_num_seqs == 0 {
            return Err(bad("max-num-seqs", 0, "must be at least 1"));
        }
        if self.http_threads == 0 || self.http_threads > 64 {
            return Err(bad("http-threads", self.http_threads, "must be 1 ..= 64"));
        }
        let gpu_blocks = self
            .gpu_blocks
            .unwrap_or_else(|| p.default_gpu_blocks(self.block_size));
        if gpu_blocks == 0 || gpu_blocks >= u32::MAX as usize / 2 {
            return Err(bad("gpu-blocks", gpu_blocks, "must be 1 ..= 2^31"));
        }
        if self.host_blocks >= u32::MAX as usize / 2 {
            return Err(bad("host-blocks", self.host_blocks, "must be below 2^31"));
        }
        if self.disk_blocks >= u32::MAX as usize / 2 {
            return Err(bad("disk-blocks", self.disk_blocks, "must be below 2^31"));
        }
        if self.shared_blocks >= u32::MAX as usize / 2 {
            return Err(bad(
                "shared-blocks",
                self.shared_blocks,
                "must be below 2^31",
            ));
        }
        if self.shared_pool.is_empty() || self.shared_pool.len() > 128 {
            return Err(bad(
                "shared-pool",
                &self.shared_pool,
                "must be 1 to 128 bytes",
            ));
        }
        for (flag, port) in [("http-port", self.http_port), ("zmq-port", self.zmq_port)] {
            let span = if flag == "zmq-port" { 2 } else { 1 };
            if port != 0 && usize::from(port) + span * self.workers > 65536 {
                return Err(bad(
                    flag,
                    port,
                    format!("{} workers run past port 65535", self.workers),
                ));
            }
        }
        let mut cost = p.cost();
        let overrides = [
            ("overhead", self.overhead, &mut cost.overhead),
            ("t-prefill", self.t_prefill, &mut cost.t_prefill),
            ("t-decode-seq", self.t_decode_seq, &mut cost.t_decode_seq),
            ("t-attn-decode", self.t_attn_decode, &mut cost.t_attn_decode),
            (
                "t-attn-prefill",
                self.t_attn_prefill,
                &mut cost.t_attn_prefill,
            ),
        ];
        for (flag, value, slot) in overrides {
            if let Some(v) = value {
                *slot = non_negative(flag, v)?;
            }
        }
        if let Some(v) = self.kv_bytes_per_token {
            cost.kv_bytes_per_token = positive("kv-bytes-per-token", v)?;
        }
        Ok(EngineConfig {
            preset: p.name.to_owned(),
            block_size: self.block_size,
            gpu_blocks,
            host_blocks: self.host_blocks,
            disk_blocks: self.disk_blocks,
            shared_blocks: self.shared_blocks,
            shared_pool: self.shared_pool.clone(),
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            speedup: positive("speedup", self.speedup)?,
            host_bytes_per_s: positive("host-gbps", self.host_gbps)? * 1e9,
            disk_bytes_per_s: positive("disk-gbps", self.disk_gbps)? * 1e9,
            shared_bytes_per_s: positive("shared-gbps", self.shared_gbps)? * 1e9,
            cost,
        })
    }
}

/// `--list-presets`' text.
pub fn presets_text(block_size: usize) -> String {
    let mut out = String::new();
    for p in PRESETS {
        let c = p.cost();
        out.push_str(&format!(
            "{}: {}\n  overhead {:.3e} s, t_prefill {:.3e} s, t_decode_seq {:.3e} s, t_attn_decode {:.3e} s, t_attn_prefill {:.3e} s, kv {} B/token, default gpu blocks {} (block {block_size}), prefill {:.0} tokens/s at 8192/step\n",
            p.name,
            p.about,
            c.overhead,
            c.t_prefill,
            c.t_decode_seq,
            c.t_attn_decode,
            c.t_attn_prefill,
            c.kv_bytes_per_token,
            p.default_gpu_blocks(block_size),
            c.prefill_tokens_per_sec(8192),
        ));
    }
    out
}
