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

use std::sync::Arc;

use crate::groups::{Groups, NULL_BLOCK};
use crate::leader::{Leader, SharedHit, TokenRun};
use crate::pool::BlockIdentity;
use crate::shared::tenant_id;
use crate::{CoreError, Tier};

/// What the leader tracks of one request.
#[derive(Debug, Default, Clone)]
struct Request {
    /// GPU block ids per KV cache group (one list for a model of one group).
    block_ids: Vec<Vec<u32>>,
    computed: usize,
    hashes: Vec<u64>,
    /// Blocks (from the first) already in the host tier or offloaded.
    offloaded_blocks: usize,
    had_offloads: bool,
    /// The last match: (first block, blocks found, asynchronous, of them in the host tier).
    matched: Option<(usize, usize, bool, usize)>,
    /// Of the last match, the blocks found in the shared tier (the last ones).
    matched_shared: SharedHit,
    /// The last onboard planned: blocks from the host tier, from disk, from the shared tier.
    hit_blocks: (usize, usize, usize),
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
        /// Its GPU block ids, per KV cache group.
        block_ids: Vec<Vec<u32>>,
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
        /// Block ids added in this step, per KV cache group (None: none).
        new_block_ids: Option<Vec<Vec<u32>>>,
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
#[derive(Debug)]
pub struct Requests {
    block_size: usize,
    groups: Groups,
    by_id: HashMap<String, Request>,
    /// The step's completions, from `schedule` to `offload_spans`: (request, first block, end
    /// block).
    pending: Vec<(String, usize, usize)>,
}

impl Requests {
    /// Requests of blocks of `block_size` tokens, for a model of one full-attention group.
    pub fn new(block_size: usize) -> Self {
        Self::with_groups(Groups::single(block_size))
    }

    /// Requests of a model with the KV cache groups `groups` (a hybrid model's: see
    /// [`crate::groups`]).
    pub fn with_groups(groups: Groups) -> Self {
        Self {
            block_size: groups.block_size(),
            groups,
            by_id: HashMap::new(),
            pending: Vec::new(),
        }
    }

    /// The model's KV cache groups.
    pub fn groups(&self) -> &Groups {
        &self.groups
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
        let r = entry_in(&mut self.by_id, request, lora, salt);
        let start = num_computed / b;
        // Never the whole prompt: vLLM computes at least the last token.
        let limit = num_tokens.saturating_sub(1) / b;
        let hashed_before = r.hashes.len();
        extend_hashes(b, r, new_tokens, limit)?;
        r.matched_shared = SharedHit::default();
        if limit <= start {
            r.matched = None;
            return Ok((0, false));
        }
        if !self.groups.is_single_full() {
            return Ok(match_groups(&self.groups, leader, r, start, limit));
        }
        let (on_host, on_disk, shared) = if leader.has_shared() {
            let tenant = tenant_id(r.lora.as_deref(), r.salt.as_deref());
            let (host, disk, shared) = leader.count_prefix_shared(&r.hashes[start..limit], tenant);
            let first = start + host + disk;
            r.matched_shared = SharedHit {
                blocks: shared,
                tenant,
                identities: identities_of(b, r, new_tokens, hashed_before, first..first + shared),
            };
            (host, disk, shared)
        } else {
            let (host, disk) = leader.count_prefix_tiers(&r.hashes[start..limit]);
            (host, disk, 0)
        };
        let found = on_host + on_disk + shared;
        let asynchronous = on_disk + shared > 0;
        r.matched = (found > 0).then_some((start, found, asynchronous, on_host));
        Ok((found * b, asynchronous))
    }

    /// `update_state_after_alloc`: records the GPU blocks vLLM allocated and plans the onboard
    /// of the remembered match into them. Returns whether the onboard is asynchronous.
    pub fn allocated(
        &mut self,
        leader: &mut Leader,
        request: &str,
        block_ids: Vec<Vec<u32>>,
        num_external_tokens: usize,
    ) -> Result<bool, CoreError> {
        let b = self.block_size;
        check_groups(&self.groups, request, &block_ids)?;
        let groups = self.groups.clone();
        let r = self.entry(request, None, None);
        if block_ids.iter().any(|ids| !ids.is_empty()) {
            r.block_ids = block_ids;
        }
        if !groups.is_single_full() {
            return allocated_groups(&groups, leader, request, r, num_external_tokens);
        }
        let matched = r.matched.take();
        let mut shared = std::mem::take(&mut r.matched_shared);
        r.hit_blocks = (0, 0, 0);
        let Some((start, found, asynchronous, on_host)) =
            matched.filter(|_| num_external_tokens > 0)
        else {
            return Ok(false);
        };
        let wanted = found.min(num_external_tokens / b);
        // The shared blocks are the hit's last: vLLM may grant fewer tokens than offered.
        let local = found - shared.blocks;
        shared.blocks = wanted.saturating_sub(local);
        shared.identities.truncate(shared.blocks);
        let from_shared = shared.blocks;
        let primary_len = r.block_ids.first().map_or(0, Vec::len);
        if primary_len < start + wanted || r.hashes.len() < start + wanted {
            tracing::warn!(
                request,
                blocks = primary_len,
                wanted,
                start,
                "too few GPU blocks for the matched blocks; not onboarding"
            );
            return Ok(false);
        }
        let got = leader.plan_onboard_with(
            request,
            &r.hashes[start..start + wanted],
            &r.block_ids[0][start..start + wanted],
            asynchronous,
            shared,
        )?;
        if got < wanted {
            // Evicted since they were counted: vLLM recomputes these (the plan reports them).
            r.unbacked_from = Some(start + got);
        }
        let from_host = on_host.min(wanted);
        r.hit_blocks = (from_host, wanted - from_host - from_shared, from_shared);
        // Reported in finished_recving even when nothing could be held (then all failed).
        r.onboarding |= asynchronous;
        // Blocks onboarded from the host tier are there already; those read from disk join it
        // when the onboard finished (`Leader::release`): none is offloaded from the GPU again.
        r.offloaded_blocks = r.offloaded_blocks.max(start + got);
        Ok(asynchronous)
    }

    /// `get_external_cache_hit_sources`: splits the `tokens` vLLM granted to the request's last
    /// onboard into (from the host tier, from disk, from the shared tier), in the order the
    /// onboard reads them; the three add up to `tokens`. None when no onboard was planned for
    /// it.
    pub fn hit_sources(&self, request: &str, tokens: usize) -> Option<(usize, usize, usize)> {
        let (host, disk, shared) = self.by_id.get(request)?.hit_blocks;
        if host + disk + shared == 0 {
            return None;
        }
        let b = self.block_size;
        // Each tier takes its blocks' tokens in order; the last tier with blocks takes the
        // rest (a grant that ends inside a block, or one larger than the blocks).
        let last = if shared > 0 {
            2
        } else if disk > 0 {
            1
        } else {
            0
        };
        let mut left = tokens;
        let mut out = [0usize; 3];
        for (i, blocks) in [host, disk, shared].into_iter().enumerate() {
            let take = if i == last {
                left
            } else {
                left.min(blocks * b)
            };
            out[i] = take;
            left -= take;
        }
        Some((out[0], out[1], out[2]))
    }

    /// `build_connector_meta`, first half: applies the scheduler's output (`scheduled`), then
    /// with `work` the step's scheduled tokens per request (index into `scheduled`'s order is
    /// not needed: (request, scheduled tokens, the request's token count)), returns the token
    /// spans of the blocks that become complete in this step, for [`Self::offload_spans`].
    pub fn schedule(
        &mut self,
        scheduled: Vec<Scheduled>,
        work: &[(String, usize, usize)],
    ) -> Result<Vec<TokenSpan>, CoreError> {
        let b = self.block_size;
        for s in &scheduled {
            let (request, ids) = match s {
                Scheduled::New {
                    request, block_ids, ..
                } => (request, Some(block_ids)),
                Scheduled::Cached {
                    request,
                    new_block_ids,
                    ..
                } => (request, new_block_ids.as_ref()),
            };
            if let Some(ids) = ids {
                check_groups(&self.groups, request, ids)?;
            }
        }
        let primary = self.groups.primary();
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
                        (false, Some(ids)) => {
                            r.block_ids.resize(ids.len(), Vec::new());
                            for (have, new) in r.block_ids.iter_mut().zip(ids) {
                                have.extend(new);
                            }
                        }
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
                .min(r.block_ids.get(primary).map_or(0, Vec::len))
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
        Ok(spans)
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
            // Per group, its blocks of the span (a shorter list ends in null blocks).
            let ids: Vec<Vec<u32>> = r
                .block_ids
                .iter()
                .map(|ids| {
                    (*first..*full)
                        .map(|i| ids.get(i).copied().unwrap_or(NULL_BLOCK))
                        .collect()
                })
                .collect();
            runs.push((
                request.clone(),
                TokenRun {
                    tokens,
                    parent,
                    lora_name: r.lora.clone(),
                    salt: r.salt.clone(),
                },
                ids,
            ));
        }
        let done = if self.groups.is_single_full() {
            leader.plan_offloads(
                runs.into_iter()
                    .map(|(request, run, ids)| {
                        (request, run, ids.into_iter().next().unwrap_or_default())
                    })
                    .collect(),
            )?
        } else {
            leader.plan_offloads_grouped(&self.groups, runs)?
        };
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
                    // Blocks a worker could not load (a shared value gone, refused or late; a
                    // bad disk read) are recomputed from the first of them: offloaded again
                    // as they fill, never skipped as if loaded.
                    let failed = leader.take_failed_loads(request);
                    if let Some(first) = r.hashes.iter().position(|h| failed.contains(h)) {
                        r.unbacked_from = Some(r.unbacked_from.map_or(first, |u| u.min(first)));
                        r.offloaded_blocks = r.offloaded_blocks.min(first);
                    }
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
        entry_in(&mut self.by_id, request, lora, salt)
    }
}

fn entry_in<'a>(
    by_id: &'a mut HashMap<String, Request>,
    request: &str,
    lora: Option<&str>,
    salt: Option<&str>,
) -> &'a mut Request {
    {
        by_id.entry(request.to_owned()).or_insert_with(|| Request {
            lora: lora.map(str::to_owned),
            salt: salt.map(str::to_owned),
            ..Default::default()
        })
    }
}

/// Refuses GPU block ids for another number of KV cache groups than the model has.
fn check_groups(groups: &Groups, request: &str, ids: &[Vec<u32>]) -> Result<(), CoreError> {
    if ids.len() == groups.len() || ids.iter().all(Vec::is_empty) {
        return Ok(());
    }
    Err(CoreError::InvalidArgument(format!(
        "request {request}: GPU block ids of {} KV cache groups for a model of {}",
        ids.len(),
        groups.len()
    )))
}

/// [`Requests::match_prefix`] for a hybrid model: the longest hit every group accepts
/// ([`Groups::longest_hit`]) whose disk reads fit the staging room, asynchronous when any of its
/// blocks is read from disk.
fn match_groups(
    groups: &Groups,
    leader: &Leader,
    r: &mut Request,
    start: usize,
    limit: usize,
) -> (usize, bool) {
    let b = groups.block_size();
    // Where each group's copy of each block is, from `start` on.
    let tiers: Vec<Vec<Option<Tier>>> = (0..groups.len())
        .map(|g| {
            r.hashes[start..limit]
                .iter()
                .map(|&h| leader.locate(groups.key(g, h)))
                .collect()
        })
        .collect();
    let present = |g: usize, i: usize| tiers[g][i - start].is_some();
    let mut end = groups.longest_hit(start, limit, present);
    while end > start {
        let (mut host, mut disk) = (0, 0);
        for (g, tiers) in tiers.iter().enumerate() {
            for i in groups.needed(g, start, end) {
                match tiers[i - start] {
                    Some(Tier::Host) => host += 1,
                    _ => disk += 1,
                }
            }
        }
        if disk <= leader.staging_room(host) {
            break;
        }
        // Too many disk reads to stage now: a shorter hit needs fewer.
        end = groups.longest_hit(start, end - 1, present);
    }
    let found = end - start;
    let primary_host = (start..end)
        .take_while(|&i| tiers[groups.primary()][i - start] == Some(Tier::Host))
        .count();
    let primary_disk = found - primary_host;
    leader.count_lookup(limit - start, primary_host, primary_disk, found * b);
    // Always asynchronous: vLLM copies a Mamba state out of the hit block before a synchronous
    // load would land (`preprocess_mamba` runs before `start_load_kv`), and with several groups
    // a load can fail only as a whole request of an asynchronous load (`failed_recving`;
    // `_handle_invalid_blocks` refuses block-level load errors).
    let asynchronous = found > 0;
    r.matched = (found > 0).then_some((start, found, asynchronous, primary_host));
    (found * b, asynchronous)
}

/// [`Requests::allocated`] for a hybrid model: plans, per group, the onboard of the blocks the
/// granted hit needs ([`Groups::needed`]) into that group's GPU blocks.
fn allocated_groups(
    groups: &Groups,
    leader: &mut Leader,
    request: &str,
    r: &mut Request,
    num_external_tokens: usize,
) -> Result<bool, CoreError> {
    let b = groups.block_size();
    let matched = r.matched.take();
    r.hit_blocks = (0, 0, 0);
    let Some((start, found, asynchronous, on_host)) = matched.filter(|_| num_external_tokens > 0)
    else {
        return Ok(false);
    };
    let end = start + found.min(num_external_tokens / b);
    let mut keys = Vec::new();
    let mut gpu = Vec::new();
    // (block index) per planned copy, for the first block that could not be backed.
    let mut blocks = Vec::new();
    let mut short = false;
    for (g, ids) in r.block_ids.iter().enumerate().take(groups.len()) {
        let needed = groups.needed(g, start, end);
        if ids.len() < needed.end || r.hashes.len() < needed.end {
            // Never seen from vLLM: a table that does not reach the hit. The load fails as a
            // whole below (vLLM then recomputes), rather than leave blocks it counts loaded
            // unwritten.
            tracing::warn!(
                request,
                group = g,
                blocks = ids.len(),
                end,
                "too few GPU blocks for the matched blocks; failing the load"
            );
            short = true;
        }
        // Every real block vLLM allocated for the hit gets its bytes (vLLM does not zero the
        // blocks of a group an asynchronous load fills: `get_loaded_kv_cache_group_ids`), which
        // for vLLM's own allocation are exactly the blocks the hit needs
        // (`allocate_external_computed_blocks` pads the others with the null block).
        let last = needed.end.min(ids.len()).min(r.hashes.len());
        for (i, &id) in ids.iter().enumerate().take(last).skip(start) {
            if id == NULL_BLOCK {
                // vLLM keeps no block there: nothing to load (and never the null block).
                continue;
            }
            keys.push(groups.key(g, r.hashes[i]));
            gpu.push(id);
            blocks.push(i);
        }
    }
    if short || num_external_tokens % b != 0 {
        // A table short of the hit (above), or a grant that ends inside a block (vLLM lowered
        // kvbm's offer: its allocation then puts a Mamba state at another block than kvbm's):
        // the load fails as a whole and vLLM recomputes the request.
        if !short {
            tracing::warn!(
                request,
                num_external_tokens,
                "a hybrid model's hit granted off a block boundary; failing its load"
            );
        }
        leader.fail_onboard(request, gpu);
        r.unbacked_from = Some(start);
        r.onboarding = true;
        return Ok(true);
    }
    let backed = leader.plan_onboard_keys(request, &keys, &gpu, asynchronous)?;
    // Blocks from the first that was not backed on: vLLM recomputes them (the plan reports the
    // GPU blocks as load errors), so nothing from there is offloaded before it did.
    let first_bad = blocks
        .iter()
        .zip(&backed)
        .filter(|(_, ok)| !**ok)
        .map(|(&i, _)| i)
        .min();
    let got = first_bad.map_or(end, |i| i.max(start));
    if got < end {
        r.unbacked_from = Some(got);
    }
    let from_host = on_host.min(got - start);
    r.hit_blocks = (from_host, got - start - from_host, 0);
    r.onboarding |= asynchronous;
    r.offloaded_blocks = r.offloaded_blocks.max(got);
    Ok(asynchronous)
}

/// The identities of `r`'s blocks `blocks` when this call's `tokens` (the tokens of the blocks
/// from `hashed_before` on) cover them; empty otherwise.
fn identities_of(
    block_size: usize,
    r: &Request,
    tokens: &[u32],
    hashed_before: usize,
    blocks: std::ops::Range<usize>,
) -> Vec<BlockIdentity> {
    if blocks.is_empty() || blocks.start < hashed_before || blocks.end > r.hashes.len() {
        return Vec::new();
    }
    let lora: Option<Arc<str>> = r.lora.as_deref().map(Arc::from);
    let mut out = Vec::with_capacity(blocks.len());
    for i in blocks {
        let at = (i - hashed_before) * block_size;
        let Some(block) = tokens.get(at..at + block_size) else {
            return Vec::new();
        };
        out.push(BlockIdentity {
            sequence_hash: SequenceHash(r.hashes[i]),
            parent: i.checked_sub(1).map(|p| SequenceHash(r.hashes[p])),
            tokens: Arc::from(block),
            lora_name: lora.clone(),
            group: None,
        });
    }
    out
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
