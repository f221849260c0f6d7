//! `frontend_cost`: the router's own cost per OpenAI request (issue 13, "Measured"), model time
//! excluded: tokenizing the prompt or chat (`kvbm_router::tokenize`), then scoring and choosing a
//! worker (`Router::route_among`: block hashes, the index's prefix match, the link and cooldown
//! filters, the cost, the load bookkeeping), each timed on its own, p50 and p99 over many calls.
//!
//!     cargo run --release -p kvbm-router --example frontend_cost -- --workers 64
//!
//! The router is the real one (`Router::start`): its ZMQ subscriber follows `--workers` XPUB
//! sockets on loopback that publish vLLM-format event batches (`encode_batch`: engine hashes
//! unrelated to the router's, with tokens, chained by parent), and its pump alone writes the
//! index; timing starts once the index holds every worker's blocks. Each worker holds
//! `--blocks-per-worker` blocks of 16 tokens: sequences of 512 blocks that open with one of 32
//! shared system prompts (Zipf popularity), and, on 3 workers in 8, a prefix of each measured
//! prompt: on the GPU (a quarter to all of it), moved to host memory (stored on the GPU, offloaded,
//! evicted), or split GPU / host / disk as an offloading engine leaves it (the tail moved down).
//!
//! The prompts are generated English-like prose cut to `--tokens` tokens by the tokenizer of
//! `--model-dir` (default: the chatml fixture of the tokenizer tests, a 1 472-token vocabulary;
//! a real model's directory can be given); the chat is the same text as seven alternating turns
//! after a system message. Routing is timed on the prompt's ids; each routed request is finished
//! right after (timed apart), so load does not build up.
//!
//! Representative numbers (2-core VM shared with other work, 2026-12-02, release build, the
//! defaults: 64 workers of 4 096 blocks, the chatml fixture; ranges over 4 runs), p50 / p99 in µs:
//!
//! | step | 1 024 tokens | 8 193 tokens |
//! | --- | --- | --- |
//! | tokenize prompt | 490-730 / 750-950 | 4 300-6 700 / 7 300-9 500 |
//! | tokenize chat (7 turns) | 550-830 / 910-1 020 | 4 200-6 800 / 6 100-9 600 |
//! | block hashes | 0.5-0.7 / 0.6-0.8 | 3.8-4.6 / 5.7-6.5 |
//! | query | 2.9-4.5 / 4.5-6.1 | 6.9-8.6 / 10-12.7 |
//! | route (score and choose) | 9-14 / 12-20 | 12.8-13.4 / 19-24.5 |
//!
//! Routing stays far under issue 13's 100 µs p99 at 8K tokens with 64 workers; tokenizing is
//! 98-99% of the router's own cost. Route minus query (4-10 µs, whatever the prompt's length)
//! grows with the workers: one run at 256 workers of 1 024 blocks routed in 47-65 / 157-177 µs.
//!
//! The front end's own path (the last rows printed): it tokenizes in 2 KiB windows only while
//! some worker holds every block so far, and keeps tokenized windows in its prefix cache. One run
//! (2026-12-05, 16 workers, the chatml fixture; the same machine tokenized a whole 8 193-token
//! prompt in 9.1-9.3 ms that day), p50: the same prompt again 23 µs at 8 193 tokens, 8 µs at
//! 1 024; the next turn of a conversation a worker holds (its prefix cached) 0.86 ms / 0.43 ms; a
//! prompt no worker has seen (tokenizing stops after the first windows) 0.76 ms / 0.82 ms.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use clap::Parser;
use kvbm_events::{
    encode_batch, BlockHasher, BlockRemoved, BlockStored, KvEvent, LinkState, SequenceHash, Tier,
    WorkerEndpoint,
};
use kvbm_router::config::WorkerSpec;
use kvbm_router::state::RequestTokens;
use kvbm_router::tokenize::{ChatRequest, ModelTokenizer};
use kvbm_router::{Router, RouterConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

/// Tokens per block (vLLM's default; the router's `--block-size` default).
const BLOCK_SIZE: usize = 16;
/// Blocks per filler sequence.
const SEQUENCE_BLOCKS: usize = 512;
/// Shared system prompts the filler sequences open with.
const SYSTEM_PROMPTS: usize = 32;
/// Events per published batch at most (a batch stays far under the subscriber's 16 MiB).
const BATCH_EVENTS_MAX: usize = 16;
/// How long the index may take to hold every worker's blocks.
const POPULATE_WAIT_MAX: Duration = Duration::from_secs(120);

#[derive(Parser, Debug)]
#[command(about = "The router's own cost per OpenAI request: tokenize, score and choose")]
struct Args {
    /// Workers (each its own ZMQ XPUB socket on 127.0.0.1).
    #[arg(long, default_value_t = 64)]
    workers: usize,
    /// Blocks each worker's index holds (of 16 tokens).
    #[arg(long, default_value_t = 4096)]
    blocks_per_worker: usize,
    /// Prompt sizes in tokens, comma-separated.
    #[arg(long, default_value = "1024,8192", value_delimiter = ',')]
    tokens: Vec<usize>,
    /// Timed calls per routing row (route, finished, query, block hashes).
    #[arg(long, default_value_t = 5000)]
    iterations: usize,
    /// Timed calls per tokenizing row (prompt, chat, and tokenize + route).
    #[arg(long, default_value_t = 300)]
    tokenize_iterations: usize,
    /// The model directory (tokenizer.json, tokenizer_config.json); default: the chatml fixture.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Seed of the generated text and blocks.
    #[arg(long, default_value_t = 13)]
    seed: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(args.workers > 0, "--workers must be at least 1");
    ensure!(
        args.iterations > 0 && args.tokenize_iterations > 0,
        "--iterations and --tokenize-iterations must be at least 1"
    );
    ensure!(
        args.tokens.iter().all(|&t| t >= BLOCK_SIZE),
        "--tokens: each size must be at least one block ({BLOCK_SIZE} tokens)"
    );
    let model_dir = args.model_dir.clone().unwrap_or_else(|| {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/tokenizer/chatml"
        ))
    });
    let tokenizer = ModelTokenizer::from_dir(&model_dir)
        .with_context(|| format!("loading the tokenizer of {}", model_dir.display()))?;

    let mut prompts = Vec::new();
    for (i, &target) in args.tokens.iter().enumerate() {
        prompts.push(Prompt::new(
            &tokenizer,
            target,
            args.seed.wrapping_add(i as u64),
        )?);
    }

    let workload = Workload::generate(&args, &prompts);
    let ctx = zmq::Context::new();
    let mut sockets = Vec::with_capacity(args.workers);
    for _ in 0..args.workers {
        let xpub = ctx.socket(zmq::XPUB)?;
        xpub.set_linger(0)?;
        xpub.set_sndhwm(0)?;
        xpub.bind("tcp://127.0.0.1:*")?;
        let endpoint = xpub
            .get_last_endpoint()?
            .map_err(|_| anyhow::anyhow!("a non-UTF-8 endpoint"))?;
        sockets.push((xpub, endpoint));
    }
    let specs = sockets
        .iter()
        .enumerate()
        .map(|(w, (_, endpoint))| WorkerSpec {
            events: WorkerEndpoint {
                worker_id: w as u64,
                dp_rank: 0,
                endpoint: endpoint.clone(),
                replay: None,
            },
            // Never called (nothing is forwarded here); named as the front end's workers are,
            // since its prefix probe considers only workers it could forward to.
            http: Some(format!("http://127.0.0.1:{}", 9000 + w)),
        })
        .collect();
    let config = RouterConfig {
        block_size: BLOCK_SIZE,
        ..RouterConfig::default()
    };
    let populate = Instant::now();
    let router = Router::start(config, specs).context("starting the router")?;
    publish(&sockets, &workload)?;
    wait_for_index(&router, &workload)?;
    let populate_s = populate.elapsed().as_secs_f64();

    // The front end's own tokenizer: with the prefix cache (`--tokenizer-cache-mb`' default).
    let cached = ModelTokenizer::from_dir(&model_dir)?
        .with_prefix_cache(kvbm_router::config::TOKENIZER_CACHE_MB_DEFAULT << 20);
    let mut rows: Vec<Row> = Vec::new();
    let mut overlaps = Vec::new();
    for p in &prompts {
        rows.extend(measure(&args, &tokenizer, &router, p)?);
        rows.extend(measure_front_end(&args, &cached, &router, p)?);
        overlaps.push(overlap_line(&router, p)?);
    }

    let command: Vec<String> = std::env::args().skip(1).collect();
    println!(
        "command: cargo run --release -p kvbm-router --example frontend_cost --{}{}",
        if command.is_empty() { "" } else { " " },
        command.join(" ")
    );
    if cfg!(debug_assertions) {
        println!("(debug build: not representative; run with --release)");
    }
    println!(
        "{} workers, {} blocks each ({} (worker, block) pairs), {} CPUs; index populated over ZMQ in {:.1} s; tokenizer {}",
        args.workers,
        args.blocks_per_worker,
        workload.pairs(),
        std::thread::available_parallelism().map_or(0, usize::from),
        populate_s,
        model_dir.file_name().map_or("?".into(), |n| n.to_string_lossy()),
    );
    for line in &overlaps {
        println!("{line}");
    }
    println!();
    println!("| step | prompt tokens | calls | p50 µs | p99 µs | max µs |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} |",
            r.step,
            r.tokens,
            r.samples_us.len(),
            percentile(&r.samples_us, 0.5),
            percentile(&r.samples_us, 0.99),
            percentile(&r.samples_us, 1.0),
        );
    }
    drop(router);
    drop(sockets);
    Ok(())
}

/// One measured prompt: its text, its ids, and the chat made of the same text.
struct Prompt {
    text: String,
    ids: Vec<u32>,
    chat: serde_json::Value,
    chat_tokens: usize,
}

impl Prompt {
    /// Prose of at least `target` tokens (and a word fewer would be under it).
    fn new(tokenizer: &ModelTokenizer, target: usize, seed: u64) -> anyhow::Result<Self> {
        let mut words = 256;
        let (full, ends) = loop {
            let (full, ends) = prose(words, seed);
            if tokenizer.encode_prompt(&full, true)?.len() >= target {
                break (full, ends);
            }
            ensure!(words < 1 << 22, "no text of {target} tokens");
            words *= 2;
        };
        // The fewest words reaching `target` tokens.
        let (mut lo, mut hi) = (1, ends.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if tokenizer.encode_prompt(&full[..ends[mid - 1]], true)?.len() >= target {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let words_used = lo;
        let text = full[..ends[words_used - 1]].to_owned();
        let ids = tokenizer.encode_prompt(&text, true)?;
        // Seven turns, user first and last, after a system message.
        let turns = 7;
        let mut messages =
            vec![json!({"role": "system", "content": "You are a helpful assistant."})];
        let mut start = 0;
        for t in 0..turns {
            let end_word = words_used * (t + 1) / turns;
            let end = if end_word == 0 { 0 } else { ends[end_word - 1] };
            let role = if t % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": text[start..end].trim()}));
            start = end;
        }
        let chat = json!({"model": "m", "messages": messages});
        let chat_tokens = tokenizer
            .encode_chat(&ChatRequest::from_body(&chat)?)?
            .len();
        Ok(Self {
            text,
            ids,
            chat,
            chat_tokens,
        })
    }

    /// The ids' full blocks.
    fn blocks(&self) -> usize {
        self.ids.len() / BLOCK_SIZE
    }
}

/// `words` words of English-like prose (sentences, paragraphs), the same words for the same seed
/// whatever `words` is; with the byte offset where each word (and its punctuation) ends.
fn prose(words: usize, seed: u64) -> (String, Vec<usize>) {
    const WORDS: [&str; 72] = [
        "the",
        "router",
        "reads",
        "every",
        "worker's",
        "events",
        "and",
        "keeps",
        "an",
        "index",
        "of",
        "blocks",
        "held",
        "in",
        "GPU",
        "memory",
        "host",
        "disk",
        "a",
        "request",
        "whose",
        "prefix",
        "matches",
        "is",
        "sent",
        "to",
        "where",
        "its",
        "cache",
        "already",
        "lives",
        "model",
        "tokens",
        "attention",
        "layers",
        "when",
        "load",
        "grows",
        "latency",
        "falls",
        "we",
        "measure",
        "each",
        "step",
        "twice",
        "with",
        "care",
        "because",
        "noise",
        "hides",
        "small",
        "costs",
        "between",
        "calls",
        "2048",
        "17",
        "fast",
        "slow",
        "engine",
        "offload",
        "score",
        "choose",
        "weights",
        "temperature",
        "prefill",
        "decode",
        "batch",
        "queue",
        "time",
        "users",
        "ask",
        "questions",
    ];
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = String::new();
    let mut ends = Vec::with_capacity(words);
    let mut in_sentence = 0;
    let mut sentence_len = rng.gen_range(6..20);
    let mut sentences = 0;
    for _ in 0..words {
        let w = WORDS[rng.gen_range(0..WORDS.len())];
        if in_sentence == 0 {
            let mut c = w.chars();
            if let Some(first) = c.next() {
                out.extend(first.to_uppercase());
                out.push_str(c.as_str());
            }
        } else {
            out.push(if rng.gen_bool(0.08) { ',' } else { ' ' });
            if out.ends_with(',') {
                out.push(' ');
            }
            out.push_str(w);
        }
        in_sentence += 1;
        if in_sentence == sentence_len {
            out.push(if rng.gen_bool(0.1) { '?' } else { '.' });
            sentences += 1;
            in_sentence = 0;
            sentence_len = rng.gen_range(6..20);
            out.push_str(if sentences % 5 == 0 { "\n\n" } else { " " });
        }
        ends.push(out.trim_end().len());
    }
    (out, ends)
}

/// A run of blocks of one sequence: its tokens, the engine's hashes and the router's.
struct Sequence {
    tokens: Vec<u32>,
    engine: Vec<u64>,
    ours: Vec<u64>,
}

impl Sequence {
    fn new(tokens: Vec<u32>) -> Self {
        let hasher = BlockHasher::new(BLOCK_SIZE, None, None);
        let ours = hasher
            .sequence_hashes(None, &tokens)
            .into_iter()
            .map(|h| h.0)
            .collect();
        let mut engine: Vec<u64> = Vec::with_capacity(tokens.len() / BLOCK_SIZE);
        for block in tokens.chunks_exact(BLOCK_SIZE) {
            engine.push(engine_hash(engine.last().copied(), block));
        }
        Self {
            tokens,
            engine,
            ours,
        }
    }
}

/// The engine's hash of a block (as vLLM's SHA-256 prefix-cache hash: its parent's and its
/// tokens, through another function than the router's).
fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(8 + 4 * tokens.len());
    bytes.extend_from_slice(&parent.unwrap_or(0x5ca1_ab1e).to_be_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_be_bytes());
    }
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 0x00e4_610e)
}

/// What one worker publishes, and what its index should then hold.
#[derive(Default)]
struct WorkerEvents {
    events: Vec<KvEvent>,
    /// Per block (router hash): held on each tier.
    held: std::collections::HashMap<u64, [bool; 3]>,
}

impl WorkerEvents {
    fn tier_index(tier: Tier) -> usize {
        Tier::ALL.iter().position(|&t| t == tier).unwrap_or(0)
    }

    /// Stores blocks `from..to` of `seq` in `tier`, chained to the block before them.
    fn store(&mut self, seq: &Sequence, from: usize, to: usize, tier: Tier) {
        if from >= to {
            return;
        }
        self.events.push(KvEvent::BlockStored(BlockStored {
            tier,
            block_hashes: seq.engine[from..to]
                .iter()
                .map(|&h| SequenceHash(h))
                .collect(),
            parent_hash: from.checked_sub(1).map(|p| SequenceHash(seq.engine[p])),
            token_ids: seq.tokens[from * BLOCK_SIZE..to * BLOCK_SIZE].to_vec(),
            block_size: BLOCK_SIZE as u32,
            lora_name: None,
        }));
        for &h in &seq.ours[from..to] {
            self.held.entry(h).or_default()[Self::tier_index(tier)] = true;
        }
    }

    /// Removes blocks `from..to` of `seq` from `tier`, tail first.
    fn remove(&mut self, seq: &Sequence, from: usize, to: usize, tier: Tier) {
        if from >= to {
            return;
        }
        self.events.push(KvEvent::BlockRemoved(BlockRemoved {
            tier,
            block_hashes: seq.engine[from..to]
                .iter()
                .rev()
                .map(|&h| SequenceHash(h))
                .collect(),
        }));
        for &h in &seq.ours[from..to] {
            if let Some(tiers) = self.held.get_mut(&h) {
                tiers[Self::tier_index(tier)] = false;
            }
        }
    }

    /// Blocks held on each tier.
    fn blocks(&self) -> [usize; 3] {
        let mut n = [0; 3];
        for tiers in self.held.values() {
            for (count, &on) in n.iter_mut().zip(tiers) {
                *count += usize::from(on);
            }
        }
        n
    }

    fn distinct(&self) -> usize {
        self.held
            .values()
            .filter(|t| t.iter().any(|&on| on))
            .count()
    }
}

/// Every worker's events.
struct Workload {
    workers: Vec<WorkerEvents>,
}

impl Workload {
    fn generate(args: &Args, prompts: &[Prompt]) -> Self {
        let mut rng = StdRng::seed_from_u64(args.seed ^ 0x0b10_c45e);
        let random_tokens = |n: usize, rng: &mut StdRng| -> Vec<u32> {
            (0..n).map(|_| rng.gen_range(0..150_000)).collect()
        };
        let systems: Vec<Vec<u32>> = (0..SYSTEM_PROMPTS)
            .map(|_| {
                let blocks = rng.gen_range(64..=256);
                random_tokens(blocks * BLOCK_SIZE, &mut rng)
            })
            .collect();
        let measured: Vec<Sequence> = prompts
            .iter()
            .map(|p| Sequence::new(p.ids[..p.blocks() * BLOCK_SIZE].to_vec()))
            .collect();
        let mut workers = Vec::with_capacity(args.workers);
        for w in 0..args.workers {
            let mut we = WorkerEvents::default();
            // A quarter to all of each measured prompt, by worker.
            let quarters = 1 + (w / 8) % 4;
            for seq in &measured {
                let n = seq.ours.len();
                let k = n * quarters / 4;
                match w % 8 {
                    // On the GPU.
                    0 => we.store(seq, 0, k, Tier::Gpu),
                    // Offloaded to host memory, then evicted from the GPU.
                    1 => {
                        we.store(seq, 0, k, Tier::Gpu);
                        we.store(seq, 0, k, Tier::Host);
                        we.remove(seq, 0, k, Tier::Gpu);
                    }
                    // All of it computed; the tail half moved down: a quarter to host memory,
                    // the last quarter on to disk.
                    2 => {
                        we.store(seq, 0, n, Tier::Gpu);
                        we.store(seq, n / 2, n, Tier::Host);
                        we.store(seq, n * 3 / 4, n, Tier::Disk);
                        we.remove(seq, n / 2, n, Tier::Gpu);
                        we.remove(seq, n * 3 / 4, n, Tier::Host);
                    }
                    _ => {}
                }
            }
            // Filler: sequences opening with a shared system prompt, each storing what the worker
            // lacks, until it holds its blocks.
            while we.distinct() < args.blocks_per_worker {
                let system = &systems[zipf(SYSTEM_PROMPTS, &mut rng)];
                let mut tokens = system.clone();
                let rest = SEQUENCE_BLOCKS.saturating_sub(system.len() / BLOCK_SIZE);
                tokens.extend(random_tokens(rest * BLOCK_SIZE, &mut rng));
                let seq = Sequence::new(tokens);
                let first = seq
                    .ours
                    .iter()
                    .position(|h| !we.held.get(h).is_some_and(|t| t[0]))
                    .unwrap_or(seq.ours.len());
                let needed = args.blocks_per_worker - we.distinct();
                let to = (first + needed).min(seq.ours.len());
                we.store(&seq, first, to, Tier::Gpu);
            }
            workers.push(we);
        }
        Self { workers }
    }

    fn pairs(&self) -> usize {
        self.workers
            .iter()
            .map(|w| w.blocks().iter().sum::<usize>())
            .sum()
    }
}

/// A Zipf-ish draw over `n` items (weight 1/rank).
fn zipf(n: usize, rng: &mut StdRng) -> usize {
    let harmonic: f64 = (1..=n).map(|k| 1.0 / k as f64).sum();
    let mut x = rng.gen::<f64>() * harmonic;
    for k in 1..=n {
        x -= 1.0 / k as f64;
        if x <= 0.0 {
            return k - 1;
        }
    }
    n - 1
}

/// Waits until the router has subscribed to every socket, then sends each worker's batches
/// (`[topic, seq, payload]`, vLLM's frames), sequence numbers from 0.
fn publish(sockets: &[(zmq::Socket, String)], workload: &Workload) -> anyhow::Result<()> {
    for (w, (xpub, _)) in sockets.iter().enumerate() {
        let deadline = Instant::now() + POPULATE_WAIT_MAX;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("the router never subscribed to worker {w}");
            }
            if xpub.poll(zmq::POLLIN, left.as_millis() as i64)? > 0 {
                // XPUB hands over subscriptions as messages: 1 then the topic.
                if xpub.recv_bytes(0)?.first() == Some(&1) {
                    break;
                }
            }
        }
    }
    let mut payload = Vec::new();
    for ((xpub, _), we) in sockets.iter().zip(&workload.workers) {
        for (seq, batch) in we.events.chunks(BATCH_EVENTS_MAX).enumerate() {
            payload.clear();
            encode_batch(0.0, batch, Some(0), &mut payload);
            let frames: [&[u8]; 3] = [b"", &(seq as u64).to_be_bytes(), &payload];
            xpub.send_multipart(frames, 0)?;
        }
    }
    Ok(())
}

/// Polls the router's workers until each holds what its events say and its link is up.
fn wait_for_index(router: &Router, workload: &Workload) -> anyhow::Result<()> {
    let deadline = Instant::now() + POPULATE_WAIT_MAX;
    let expected: Vec<[usize; 3]> = workload.workers.iter().map(WorkerEvents::blocks).collect();
    loop {
        let workers = router.workers();
        let behind: Vec<String> = workers
            .iter()
            .filter(|(info, blocks, _, link)| {
                *blocks != expected[info.worker_id as usize]
                    || link.as_ref().map(|l| l.state) != Some(LinkState::Connected)
            })
            .map(|(info, blocks, _, link)| {
                format!(
                    "worker {}: {:?} of {:?} blocks, link {:?}, {} unfilled gaps",
                    info.worker_id,
                    blocks,
                    expected[info.worker_id as usize],
                    link.as_ref().map(|l| l.state),
                    info.unfilled_gaps
                )
            })
            .collect();
        if workers.len() == expected.len() && behind.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the index did not hold every worker's blocks within {POPULATE_WAIT_MAX:?}: {}",
                behind.join("; ")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One row of the table: what was timed, on which prompt, every call's microseconds.
struct Row {
    step: &'static str,
    tokens: usize,
    samples_us: Vec<f64>,
}

/// Times `f` `iterations` times after a tenth as many untimed calls.
fn time_us(
    iterations: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<f64>> {
    for _ in 0..iterations.div_ceil(10) {
        f()?;
    }
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let start = Instant::now();
        f()?;
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    Ok(samples)
}

fn measure(
    args: &Args,
    tokenizer: &ModelTokenizer,
    router: &Router,
    p: &Prompt,
) -> anyhow::Result<Vec<Row>> {
    let request = RequestTokens {
        token_ids: &p.ids,
        untokenized_tokens: 0,
        lora_name: None,
        cache_salt: None,
    };
    let n = p.ids.len();
    let mut rows = Vec::new();
    let mut row = |step, tokens, samples_us| {
        rows.push(Row {
            step,
            tokens,
            samples_us,
        })
    };

    row(
        "tokenize prompt (`encode_prompt`)",
        n,
        time_us(args.tokenize_iterations, || {
            std::hint::black_box(tokenizer.encode_prompt(&p.text, true)?);
            Ok(())
        })?,
    );
    row(
        "tokenize chat (`ChatRequest::from_body` + `encode_chat`)",
        p.chat_tokens,
        time_us(args.tokenize_iterations, || {
            let chat = ChatRequest::from_body(&p.chat)?;
            std::hint::black_box(tokenizer.encode_chat(&chat)?);
            Ok(())
        })?,
    );
    let hasher = BlockHasher::new(BLOCK_SIZE, None, None);
    row(
        "block hashes alone (part of query and route)",
        n,
        time_us(args.iterations, || {
            std::hint::black_box(hasher.sequence_hashes(None, &p.ids));
            Ok(())
        })?,
    );
    row(
        "query (`Router::query`: hashes + match, every worker)",
        n,
        time_us(args.iterations, || {
            std::hint::black_box(router.query(&request));
            Ok(())
        })?,
    );
    // Route, then finish untimed; the finish is timed in a loop of its own below.
    let mut route_us = Vec::with_capacity(args.iterations);
    let mut finished_us = Vec::with_capacity(args.iterations);
    for i in 0..args.iterations + args.iterations.div_ceil(10) {
        let start = Instant::now();
        let answer = router.route_among(&request, None, |_| true, true)?;
        let routed = start.elapsed();
        let start = Instant::now();
        let known = router.finished(&answer.request_id);
        let finished = start.elapsed();
        ensure!(known, "the router forgot request {}", answer.request_id);
        if i >= args.iterations.div_ceil(10) {
            route_us.push(routed.as_secs_f64() * 1e6);
            finished_us.push(finished.as_secs_f64() * 1e6);
        }
    }
    row("**score and choose (`Router::route_among`)**", n, route_us);
    row("finished (`Router::finished`)", n, finished_us);
    row(
        "tokenize prompt + route + finished",
        n,
        time_us(args.tokenize_iterations, || {
            let ids = tokenizer.encode_prompt(&p.text, true)?;
            let request = RequestTokens {
                token_ids: &ids,
                untokenized_tokens: 0,
                lora_name: None,
                cache_salt: None,
            };
            let answer = router.route_among(&request, None, |_| true, true)?;
            router.finished(&answer.request_id);
            Ok(())
        })?,
    );
    Ok(rows)
}

/// What the front end does for a prompt (`serve_openai`): tokenize as far as an overlap can reach
/// and the pick is not yet sure (`encode_prompt_until` with a `PrefixProbe`, the prefix cache
/// on), route, finish.
fn front_end(tokenizer: &ModelTokenizer, router: &Router, text: &str) -> anyhow::Result<usize> {
    let mut probe = router.prefix_probe(None, None);
    let encoded =
        tokenizer.encode_prompt_until(text, true, &mut |ids, rest| probe.worth_more(ids, rest))?;
    let request = RequestTokens {
        token_ids: &encoded.ids,
        untokenized_tokens: encoded.estimated_tokens() - encoded.ids.len(),
        lora_name: None,
        cache_salt: None,
    };
    let answer = router.route_among(&request, None, |_| true, true)?;
    router.finished(&answer.request_id);
    Ok(encoded.ids.len())
}

/// The front end's path for three kinds of request of `p`'s size: the prompt again (workers hold
/// all of it, the cache has seen it), a conversation's next turn (the prompt, which workers hold,
/// then a new question of an eighth of its length), and a prompt never seen (a unique opening
/// line: no worker holds its first block, the cache has none of its windows).
fn measure_front_end(
    args: &Args,
    tokenizer: &ModelTokenizer,
    router: &Router,
    p: &Prompt,
) -> anyhow::Result<Vec<Row>> {
    let n = p.ids.len();
    let calls = args.tokenize_iterations + args.tokenize_iterations.div_ceil(10);
    // The texts are made before timing.
    let question_bytes = p.text.len() / 8;
    let next_turns: Vec<String> = (0..calls as u64)
        .map(|t| {
            let (question, _) = prose(question_bytes / 4, args.seed ^ (t + 1));
            let mut cut = question_bytes.min(question.len());
            while !question.is_char_boundary(cut) {
                cut -= 1;
            }
            format!("{}\n\nTurn {t}: {}", p.text, &question[..cut])
        })
        .collect();
    let unseen: Vec<String> = (0..calls)
        .map(|t| format!("Request {t}. {}", p.text))
        .collect();
    let mut rows = Vec::new();
    rows.push(Row {
        step: "**front end: the same prompt again** (cached, held)",
        tokens: n,
        samples_us: time_us(args.tokenize_iterations, || {
            std::hint::black_box(front_end(tokenizer, router, &p.text)?);
            Ok(())
        })?,
    });
    for (step, texts, tokens) in [
        (
            "**front end: next turn** (prompt cached and held, new question)",
            &next_turns,
            n + n / 8,
        ),
        (
            "**front end: a prompt never seen** (no worker holds it)",
            &unseen,
            n,
        ),
    ] {
        let mut next = texts.iter();
        rows.push(Row {
            step,
            tokens,
            samples_us: time_us(args.tokenize_iterations, || {
                let text = next.next().context("more calls than texts")?;
                std::hint::black_box(front_end(tokenizer, router, text)?);
                Ok(())
            })?,
        });
    }
    Ok(rows)
}

/// Which workers hold part of the prompt, and what the router chose for it.
fn overlap_line(router: &Router, p: &Prompt) -> anyhow::Result<String> {
    let request = RequestTokens {
        token_ids: &p.ids,
        untokenized_tokens: 0,
        lora_name: None,
        cache_salt: None,
    };
    let q = router.query(&request);
    let with = |f: fn(&kvbm_router::state::TierOverlap) -> usize| {
        q.workers.iter().filter(|w| f(&w.overlap) > 0).count()
    };
    let answer = router.route_among(&request, None, |_| true, true)?;
    router.finished(&answer.request_id);
    Ok(format!(
        "{}-token prompt ({} blocks): overlap on GPU at {} workers, host {}, disk {}; routed to worker {} ({} GPU + {} host + {} disk blocks, cost {:.1})",
        p.ids.len(),
        q.request_blocks,
        with(|o| o.gpu_blocks),
        with(|o| o.host_blocks),
        with(|o| o.disk_blocks),
        answer.worker_id,
        answer.overlap.gpu_blocks,
        answer.overlap.host_blocks,
        answer.overlap.disk_blocks,
        answer.cost,
    ))
}

/// The `q` quantile of `values` by nearest rank (NaN when empty).
fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}
