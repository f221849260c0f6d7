//! The leader's per-request bookkeeping for vLLM's scheduler: what each running request has
//! (its GPU block ids, how many tokens vLLM counts computed, its blocks' sequence hashes), how far
//! its blocks are offloaded, what it matched, and whether vLLM must keep its blocks after it
//! finished. The engine's tokens stay with the engine: each call takes only the tokens of the
//! blocks it needs hashed.
//!
//! Invariants:
//! - A request's hashes are those of its first full blocks, in order, chained from the first.
//! - Nothing from `unbacked_from` on is offloaded while vLLM still counts it computed (its GPU
//!   bytes are garbage until vLLM recomputes it after a load error).
//! - A finished request stays tracked while its offloads or its asynchronous onboard may still
//!   touch its GPU blocks (vLLM keeps them until the workers report it).

use std::collections::HashMap;

use kvbm_events::{BlockHasher, SequenceHash};

use crate::leader::{Leader, TokenRun};
use crate::CoreError;

/// What the leader tracks of one request.
#[derive(Debug, Default, Clone)]
struct Request {
    block_ids: Vec<u32>,
    computed: usize,
    hashes: Vec<u64>,
    /// Blocks (from the first) already in the host tier or offloaded.
    offloaded_blocks: usize,
    had_offloads: bool,
    /// The last match: (first block, blocks found, asynchronous, of them in the host tier).
    matched: Option<(usize, usize, bool, usize)>,
    /// The last onboard planned: blocks from the host tier, then from disk.
    hit_blocks: (usize, usize),
    lora: Option<String>,
    salt: Option<String>,
    finished: bool,
    /// The first block vLLM counts computed that the leader could not back.
    unbacked_from: Option<usize>,
    /// An asynchronous onboard is in flight.
    onboarding: bool,
}

/// A scheduled request as vLLM's scheduler output names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduled {
    /// `scheduled_new_reqs`: its GPU block ids and computed tokens.
    New {
        /// vLLM's request id.
        request: String,
        /// Its GPU block ids (first KV cache group).
        block_ids: Vec<u32>,
        /// `num_computed_tokens`.
        computed: usize,
        /// LoRA adapter name.
        lora: Option<String>,
        /// Cache salt.
        salt: Option<String>,
    },
    /// `scheduled_cached_reqs`: new GPU block ids (appended, or all of them when resumed) and
    /// computed tokens.
    Cached {
        /// vLLM's request id.
        request: String,
        /// Block ids added in this step (None: none).
        new_block_ids: Option<Vec<u32>>,
        /// Whether it resumed after a preemption (its block ids start over).
        resumed: bool,
        /// `num_computed_tokens`.
        computed: usize,
    },
}

/// Blocks of one request that become complete in this step: their tokens are
/// `[first_token, end_token)` of the request's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSpan {
    /// Index of the request in the list given to [`Requests::schedule`].
    pub index: usize,
    /// First token.
    pub first_token: usize,
    /// One past the last token.
    pub end_token: usize,
}

/// The leader's requests.
#[derive(Debug, Default)]
pub struct Requests {
    block_size: usize,
    by_id: HashMap<String, Request>,
    /// The step's completions, from `schedule` to `offload_spans`: (request, first block, end
    /// block).
    pending: Vec<(String, usize, usize)>,
}

impl Requests {
    /// Requests of blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            ..Default::default()
        }
    }

    /// Blocks of `request` whose hashes are known (the caller passes the tokens after them).
    pub fn hashed_blocks(&self, request: &str) -> usize {
        self.by_id.get(request).map_or(0, |r| r.hashes.len())
    }

    /// `get_num_new_matched_tokens`: hashes the prompt's full blocks up to (not including) the
    /// block of its last token, from `new_tokens` (the tokens after the blocks already hashed,
    /// whole blocks), and counts how many blocks after `num_computed` the host tier holds, then
    /// how many continue on disk. Returns (tokens found, asynchronous) and remembers the match
    /// for [`Self::allocated`].
    #[allow(clippy::too_many_arguments)] // vLLM's call and the request's identity, as given
    pub fn match_prefix(
        &mut self,
        leader: &Leader,
        request: &str,
        new_tokens: &[u32],
        num_computed: usize,
        num_tokens: usize,
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> Result<(usize, bool), CoreError> {
        let b = self.block_size;
        let r = self.entry(request, lora, salt);
        let start = num_computed / b;
        // Never the whole prompt: vLLM computes at least the last token.
        let limit = num_tokens.saturating_sub(1) / b;
        extend_hashes(b, r, new_tokens, limit)?;
        if limit <= start {
            r.matched = None;
            return Ok((0, false));
        }
        let (on_host, on_disk) = leader.count_prefix_tiers(&r.hashes[start..limit]);
        let found = on_host + on_disk;
        let asynchronous = on_disk > 0;
        r.matched = (found > 0).then_some((start, found, asynchronous, on_host));
        Ok((found * b, asynchronous))
    }

    /// `update_state_after_alloc`: records the GPU blocks vLLM allocated and plans the onboard
    /// of the remembered match into them. Returns whether the onboard is asynchronous.
    pub fn allocated(
        &mut self,
        leader: &mut Leader,
        request: &str,
        block_ids: Vec<u32>,
        num_external_tokens: usize,
    ) -> Result<bool, CoreError> {
        let b = self.block_size;
        let r = self.entry(request, None, None);
        if !block_ids.is_empty() {
            r.block_ids = block_ids;
        }
        let matched = r.matched.take();
        r.hit_blocks = (0, 0);
        let Some((start, found, asynchronous, on_host)) =
            matched.filter(|_| num_external_tokens > 0)
        else {
            return Ok(false);
        };
        let wanted = found.min(num_external_tokens / b);
        if r.block_ids.len() < start + wanted || r.hashes.len() < start + wanted {
            tracing::warn!(
                request,
                blocks = r.block_ids.len(),
                wanted,
                start,
                "too few GPU blocks for the matched blocks; not onboarding"
            );
            return Ok(false);
        }
        let got = leader.plan_onboard(
            request,
            &r.hashes[start..start + wanted],
            &r.block_ids[start..start + wanted],
            asynchronous,
        )?;
        if got < wanted {
            // Evicted since they were counted: vLLM recomputes these (the plan reports them).
            r.unbacked_from = Some(start + got);
        }
        let from_host = on_host.min(wanted);
        r.hit_blocks = (from_host, wanted - from_host);
        // Reported in finished_recving even when nothing could be held (then all failed).
        r.onboarding |= asynchronous;
        // Blocks onboarded from the host tier are there already; those read from disk join it
        // when the onboard finished (`Leader::release`): none is offloaded from the GPU again.
        r.offloaded_blocks = r.offloaded_blocks.max(start + got);
        Ok(asynchronous)
    }

    /// `get_external_cache_hit_sources`: splits the `tokens` vLLM granted to the request's last
    /// onboard into (from the host tier, from disk), host first as the onboard reads them; the
    /// two add up to `tokens`. None when no onboard was planned for it.
    pub fn hit_sources(&self, request: &str, tokens: usize) -> Option<(usize, usize)> {
        let (host, disk) = self.by_id.get(request)?.hit_blocks;
        if host + disk == 0 {
            return None;
        }
        let host_tokens = if disk == 0 {
            tokens
        } else {
            tokens.min(host * self.block_size)
        };
        Some((host_tokens, tokens - host_tokens))
    }

    /// `build_connector_meta`, first half: applies the scheduler's output (`scheduled`), then
    /// with `work` the step's scheduled tokens per request (index into `scheduled`'s order is
    /// not needed: (request, scheduled tokens, the request's token count)), returns the token
    /// spans of the blocks that become complete in this step, for [`Self::offload_spans`].
    pub fn schedule(
        &mut self,
        scheduled: Vec<Scheduled>,
        work: &[(String, usize, usize)],
    ) -> Vec<TokenSpan> {
        let b = self.block_size;
        for s in scheduled {
            match s {
                Scheduled::New {
                    request,
                    block_ids,
                    computed,
                    lora,
                    salt,
                } => {
                    let r = self.entry(&request, lora.as_deref(), salt.as_deref());
                    r.block_ids = block_ids;
                    r.computed = computed;
                }
                Scheduled::Cached {
                    request,
                    new_block_ids,
                    resumed,
                    computed,
                } => {
                    let Some(r) = self.by_id.get_mut(&request) else {
                        continue;
                    };
                    match (resumed, new_block_ids) {
                        (true, ids) => r.block_ids = ids.unwrap_or_default(),
                        (false, Some(ids)) => r.block_ids.extend(ids),
                        (false, None) => {}
                    }
                    r.computed = computed;
                }
            }
        }
        self.pending.clear();
        let mut spans = Vec::new();
        for (index, (request, scheduled, num_tokens)) in work.iter().enumerate() {
            let Some(r) = self.by_id.get_mut(request) else {
                continue;
            };
            // Saturating: counts from the engine are not trusted not to overflow.
            let mut full = (r.computed.saturating_add(*scheduled) / b)
                .min(r.block_ids.len())
                .min(num_tokens / b);
            if let Some(from) = r.unbacked_from {
                if r.computed > from.saturating_mul(b) {
                    full = full.min(from); // vLLM has not rolled back yet
                } else {
                    r.unbacked_from = None; // recomputed from there on: offloaded as it fills
                }
            }
            let first = r.offloaded_blocks;
            if full > first {
                spans.push(TokenSpan {
                    index,
                    first_token: first * b,
                    end_token: full * b,
                });
                self.pending.push((request.clone(), first, full));
            }
        }
        spans
    }

    /// `build_connector_meta`, second half: the tokens of each span [`Self::schedule`] returned,
    /// in its order; hashes, registers and plans the offloads of those blocks.
    pub fn offload_spans(
        &mut self,
        leader: &mut Leader,
        tokens: Vec<Vec<u32>>,
    ) -> Result<(), CoreError> {
        let pending = std::mem::take(&mut self.pending);
        if tokens.len() != pending.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} token spans for {} requests",
                tokens.len(),
                pending.len()
            )));
        }
        let mut runs = Vec::with_capacity(pending.len());
        for ((request, first, full), tokens) in pending.iter().zip(tokens) {
            let r = &self.by_id[request];
            let parent = first.checked_sub(1).and_then(|p| r.hashes.get(p).copied());
            runs.push((
                request.clone(),
                TokenRun {
                    tokens,
                    parent,
                    lora_name: r.lora.clone(),
                    salt: r.salt.clone(),
                },
                r.block_ids[*first..*full].to_vec(),
            ));
        }
        let done = leader.plan_offloads(runs)?;
        for ((request, first, full), (hashes, offloaded)) in pending.into_iter().zip(done) {
            let r = self.by_id.get_mut(&request).expect("tracked");
            r.hashes.truncate(first);
            r.hashes.extend(hashes);
            r.offloaded_blocks = full;
            r.had_offloads |= offloaded > 0;
        }
        Ok(())
    }

    /// `request_finished`: true when vLLM must keep the request's GPU blocks until the workers
    /// report it (offloads of it were planned, or its asynchronous onboard is in flight); the
    /// request is forgotten otherwise.
    pub fn finished(&mut self, request: &str) -> bool {
        let Some(r) = self.by_id.get_mut(request) else {
            return false;
        };
        if r.had_offloads || r.onboarding {
            r.finished = true;
            return true;
        }
        self.by_id.remove(request);
        false
    }

    /// `update_connector_output`: asynchronous onboards that ended (their holds are released)
    /// and finished requests the workers are done with.
    pub fn connector_output(
        &mut self,
        leader: &mut Leader,
        finished_recving: &[String],
        finished_sending: &[String],
    ) {
        for request in finished_recving {
            if let Some(r) = self.by_id.get_mut(request) {
                if r.onboarding {
                    r.onboarding = false;
                    leader.release(request);
                    if r.finished && !r.had_offloads {
                        self.by_id.remove(request);
                    }
                }
            }
        }
        for request in finished_sending {
            if self.by_id.get(request).is_some_and(|r| r.finished) {
                self.by_id.remove(request);
            }
        }
    }

    /// The requests tracked (finished ones wait for their workers).
    pub fn tracked(&self) -> Vec<String> {
        self.by_id.keys().cloned().collect()
    }

    fn entry(&mut self, request: &str, lora: Option<&str>, salt: Option<&str>) -> &mut Request {
        self.by_id
            .entry(request.to_owned())
            .or_insert_with(|| Request {
                lora: lora.map(str::to_owned),
                salt: salt.map(str::to_owned),
                ..Default::default()
            })
    }
}

/// Extends `r`'s hashes with those of `tokens` (whole blocks after the hashed ones), up to
/// `limit` blocks.
fn extend_hashes(
    block_size: usize,
    r: &mut Request,
    tokens: &[u32],
    limit: usize,
) -> Result<(), CoreError> {
    let have = r.hashes.len();
    let need = limit.saturating_sub(have);
    if tokens.len() < need * block_size {
        return Err(CoreError::InvalidArgument(format!(
            "{} tokens to hash blocks {have}..{limit} of {block_size}",
            tokens.len()
        )));
    }
    if need == 0 {
        return Ok(());
    }
    let hasher = BlockHasher::new(block_size, r.lora.as_deref(), r.salt.as_deref());
    let parent = r.hashes.last().copied().map(SequenceHash);
    let hashed = hasher.sequence_hashes(parent, &tokens[..need * block_size]);
    r.hashes.extend(hashed.into_iter().map(|h| h.0));
    Ok(())
}
