//! The leader's per-group planning for hybrid models (vLLM's hybrid KV cache manager): each
//! group's blocks offloaded from its own GPU blocks under its own keys, hits that every group
//! accepts as vLLM's own managers would (`vllm/v1/core/single_type_kv_cache_manager.py`), loads
//! of exactly the blocks each group needs into that group's GPU blocks, and events for the
//! primary group only.

use std::collections::{BTreeSet, HashMap};

use kvbm_core::requests::{Requests, Scheduled};
use kvbm_core::{GroupKind, Groups, Leader, StepPlan, NULL_BLOCK};
use kvbm_events::{BlockHasher, KvEvent, Tier};

const B: usize = 4;

fn tokens(first: u32, n: usize) -> Vec<u32> {
    (first..first + n as u32).collect()
}

/// gpt-oss's shape: a sliding-window group first (window 8 tokens: cdiv(7, 4) = 2 blocks), then
/// full attention.
fn swa_full() -> Groups {
    Groups::new(
        vec![
            GroupKind::SlidingWindow { window_tokens: 8 },
            GroupKind::Full,
        ],
        B,
    )
    .unwrap()
}

/// Qwen3-Next's shape: a Mamba group (align mode) and full attention.
fn mamba_full() -> Groups {
    Groups::new(vec![GroupKind::MambaAlign, GroupKind::Full], B).unwrap()
}

/// A prefill of `prompt` in one step with the given per-group GPU blocks; returns the plan.
fn prefill(
    req: &mut Requests,
    leader: &mut Leader,
    id: &str,
    prompt: &[u32],
    ids: Vec<Vec<u32>>,
    computed: usize,
) -> StepPlan {
    let work = vec![(id.to_string(), prompt.len() - computed, prompt.len())];
    let spans = req
        .schedule(
            vec![Scheduled::New {
                request: id.into(),
                block_ids: ids,
                computed,
                lora: None,
                salt: None,
            }],
            &work,
        )
        .unwrap();
    let toks = spans
        .iter()
        .map(|s| prompt[s.first_token..s.end_token].to_vec())
        .collect();
    req.offload_spans(leader, toks).unwrap();
    leader.take_plan(vec![]).unwrap()
}

/// Request "a" prefills `prompt` in one step with the given per-group GPU blocks, finishes,
/// and its workers report its offloads done.
fn offload_a(req: &mut Requests, leader: &mut Leader, prompt: &[u32], ids: Vec<Vec<u32>>) {
    prefill(req, leader, "a", prompt, ids, 0);
    req.finished("a");
    req.connector_output(leader, &[], &["a".into()]);
}

fn hashes(prompt: &[u32], blocks: usize) -> Vec<u64> {
    BlockHasher::new(B, None, None)
        .sequence_hashes(None, &prompt[..blocks * B])
        .into_iter()
        .map(|h| h.0)
        .collect()
}

/// GPU block -> host block of every offload in `plan`.
fn offloaded(plan: &StepPlan) -> HashMap<u32, u32> {
    plan.offloads
        .iter()
        .flat_map(|o| o.pairs.iter().copied())
        .collect()
}

/// GPU blocks an onboard of `plan` fills, in order.
fn onboarded(plan: &StepPlan) -> BTreeSet<u32> {
    plan.onboards
        .iter()
        .flat_map(|o| o.pairs.iter().map(|p| p.1))
        .chain(
            plan.async_onboards
                .iter()
                .flat_map(|o| o.pairs.iter().map(|p| p.1)),
        )
        .collect()
}

#[test]
fn every_group_offloads_its_own_gpu_blocks_under_its_own_keys() {
    let mut leader = Leader::new(B, 64, 0, false).unwrap();
    let mut req = Requests::with_groups(swa_full());
    let prompt = tokens(100, 22); // 5 full blocks
                                  // vLLM's block tables: the window group's blocks 100.., full attention's 200.. (one pool,
                                  // so the ids never repeat across groups).
    let ids = vec![(100..106).collect(), (200..206).collect()];
    let plan = prefill(&mut req, &mut leader, "a", &prompt, ids, 0);
    let pairs = offloaded(&plan);
    assert!(plan.fence_offloads, "window blocks can be reused next step");
    let gpu: BTreeSet<u32> = pairs.keys().copied().collect();
    assert_eq!(
        gpu,
        (100..105).chain(200..205).collect(),
        "5 blocks of each group"
    );
    // Ten host blocks: no two groups share one.
    assert_eq!(pairs.values().collect::<BTreeSet<_>>().len(), 10);
    // The full-attention group (the primary) keys blocks by their sequence hashes.
    let held: BTreeSet<u64> = leader.registered_hashes(Tier::Host).into_iter().collect();
    let h = hashes(&prompt, 5);
    assert!(h.iter().all(|x| held.contains(x)));
    let groups = swa_full();
    assert!(h.iter().all(|&x| held.contains(&groups.key(0, x))));
    assert_eq!(held.len(), 10);
}

#[test]
fn the_null_block_is_never_copied_and_a_window_with_a_hole_is_no_hit() {
    let mut leader = Leader::new(B, 64, 0, false).unwrap();
    let mut req = Requests::with_groups(swa_full());
    let prompt = tokens(100, 42); // 10 full blocks
                                  // vLLM freed window block 4 before it was offloaded (its table says null there).
    let mut window: Vec<u32> = (100..111).collect();
    window[4] = NULL_BLOCK;
    let ids = vec![window, (200..211).collect()];
    let plan = prefill(&mut req, &mut leader, "a", &prompt, ids, 0);
    assert!(!offloaded(&plan).contains_key(&NULL_BLOCK));
    assert_eq!(offloaded(&plan).len(), 19);
    assert!(req.finished("a"));
    req.connector_output(&mut leader, &[], &["a".into()]);

    // B shares 10 blocks and asks for more: hits end where the window holds its 2 blocks.
    let mut b = prompt[..40].to_vec();
    b.extend(tokens(900, 9));
    let (found, asynchronous) = req
        .match_prefix(&leader, "b", &b[..48], 0, b.len(), None, None)
        .unwrap();
    // n = 10 needs window blocks 8, 9: held. (A hole at 4 only bars n = 5 and 6.) A hybrid
    // model's loads are asynchronous (a Mamba state must land before vLLM reads it, and only an
    // asynchronous load can fail as a request).
    assert_eq!((found, asynchronous), (40, true));
    // C shares only 6 blocks: n = 6 needs 4, 5 (4 missing), n = 5 needs 3, 4; n = 4 needs 2, 3.
    let mut c = prompt[..24].to_vec();
    c.extend(tokens(700, 9));
    let (found, _) = req
        .match_prefix(&leader, "c", &c[..32], 0, c.len(), None, None)
        .unwrap();
    assert_eq!(found, 16);
}

#[test]
fn a_hit_loads_the_whole_prefix_of_full_attention_and_only_the_window_of_the_other_group() {
    let mut leader = Leader::new(B, 64, 0, false).unwrap();
    let mut req = Requests::with_groups(swa_full());
    let prompt = tokens(100, 42);
    let ids = vec![(100..111).collect(), (200..211).collect()];
    offload_a(&mut req, &mut leader, &prompt, ids);

    let b = prompt[..41].to_vec(); // 10 blocks, the last token computed by vLLM
    let (found, asynchronous) = req
        .match_prefix(&leader, "b", &b[..40], 0, b.len(), None, None)
        .unwrap();
    assert_eq!((found, asynchronous), (40, true));
    // vLLM's allocation for an external hit of 10 blocks: the window group keeps real blocks
    // for the last two only (null below the window), full attention for all ten.
    let mut window = vec![NULL_BLOCK; 8];
    window.extend([308, 309, 310]);
    let full: Vec<u32> = (400..411).collect();
    assert!(req
        .allocated(&mut leader, "b", vec![window, full], 40)
        .unwrap());
    let plan = leader.take_plan(vec![]).unwrap();
    assert_eq!(
        onboarded(&plan),
        [308, 309].into_iter().chain(400..410).collect()
    );
    assert!(plan.load_errors.is_empty() && plan.async_onboards[0].unbacked.is_empty());
    // The hit is from the host tier: sources split accordingly.
    assert_eq!(req.hit_sources("b", 40), Some((40, 0, 0)));
}

#[test]
fn a_mamba_group_hits_only_where_a_state_was_kept() {
    let mut leader = Leader::new(B, 64, 0, false).unwrap();
    let mut req = Requests::with_groups(mamba_full());
    let prompt = tokens(100, 26); // 6 full blocks
                                  // vLLM's align mode: the state is kept in the block of the step's last boundary; earlier
                                  // blocks of the Mamba group are null.
    let mut states = vec![NULL_BLOCK; 7];
    states[5] = 105;
    let ids = vec![states, (200..207).collect()];
    let plan = prefill(&mut req, &mut leader, "a", &prompt, ids, 0);
    assert_eq!(
        offloaded(&plan).len(),
        7,
        "6 attention blocks and one state"
    );
    req.finished("a");
    req.connector_output(&mut leader, &[], &["a".into()]);

    // A longer prompt sharing all 6 blocks: the state at block 6's end is there.
    let mut b = prompt[..24].to_vec();
    b.extend(tokens(900, 9));
    let (found, _) = req
        .match_prefix(&leader, "b", &b[..32], 0, b.len(), None, None)
        .unwrap();
    assert_eq!(found, 24);
    let mut states = vec![NULL_BLOCK; 9];
    states[5] = 505;
    assert!(req
        .allocated(&mut leader, "b", vec![states, (600..609).collect()], 24)
        .unwrap());
    let plan = leader.take_plan(vec![]).unwrap();
    assert_eq!(
        onboarded(&plan),
        [505].into_iter().chain(600..606).collect()
    );
    // A prompt sharing 4 blocks only: no state at that boundary, so no hit at all (vLLM would
    // have to recompute the state from the start).
    let mut c = prompt[..16].to_vec();
    c.extend(tokens(700, 9));
    let (found, _) = req
        .match_prefix(&leader, "c", &c[..24], 0, c.len(), None, None)
        .unwrap();
    assert_eq!(found, 0);
}

#[test]
fn only_the_primary_groups_blocks_are_announced() {
    let mut leader = Leader::new(B, 8, 0, false).unwrap();
    let mut req = Requests::with_groups(swa_full());
    let prompt = tokens(100, 18); // 4 blocks x 2 groups = all 8 host blocks
    let ids = vec![(100..105).collect(), (200..205).collect()];
    offload_a(&mut req, &mut leader, &prompt, ids);
    for _ in 0..3 {
        leader.end_step();
    }
    // Another prompt evicts everything.
    let other = tokens(5000, 18);
    let ids = vec![(300..305).collect(), (400..405).collect()];
    prefill(&mut req, &mut leader, "b", &other, ids, 0);
    let events = leader.take_events();
    let primary_a: BTreeSet<u64> = hashes(&prompt, 4).into_iter().collect();
    let primary_b: BTreeSet<u64> = hashes(&other, 4).into_iter().collect();
    let mut stored = BTreeSet::new();
    let mut removed = BTreeSet::new();
    for e in &events {
        match e {
            KvEvent::BlockStored(s) => stored.extend(s.block_hashes.iter().map(|h| h.0)),
            KvEvent::BlockRemoved(r) => removed.extend(r.block_hashes.iter().map(|h| h.0)),
            KvEvent::AllBlocksCleared => {}
            KvEvent::SharedStored { .. } | KvEvent::SharedRemoved { .. } => {}
        }
    }
    assert_eq!(stored, &primary_a | &primary_b);
    assert_eq!(removed, primary_a);
}

#[test]
fn block_ids_for_another_number_of_groups_are_refused_naming_the_request() {
    let mut leader = Leader::new(B, 8, 0, false).unwrap();
    let mut req = Requests::with_groups(swa_full());
    let e = req
        .schedule(
            vec![Scheduled::New {
                request: "r1".into(),
                block_ids: vec![vec![1, 2]],
                computed: 0,
                lora: None,
                salt: None,
            }],
            &[],
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("r1") && e.contains("1 KV cache groups") && e.contains("2"),
        "{e}"
    );
    let e = req
        .allocated(&mut leader, "r2", vec![vec![1], vec![2], vec![3]], 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("r2"), "{e}");
}

#[test]
fn disk_hits_of_both_groups_are_read_into_staging_blocks_asynchronously() {
    let mut leader = Leader::new(B, 32, 64, true).unwrap();
    let mut req = Requests::with_groups(swa_full());
    let prompt = tokens(100, 26); // 6 blocks
    let ids = vec![(100..107).collect(), (200..207).collect()];
    offload_a(&mut req, &mut leader, &prompt, ids);
    for _ in 0..3 {
        leader.take_plan(vec![]).unwrap();
    }
    assert!(leader.evict_idle_host() >= 12);
    let b = prompt[..25].to_vec();
    let (found, asynchronous) = req
        .match_prefix(&leader, "b", &b[..24], 0, b.len(), None, None)
        .unwrap();
    assert_eq!((found, asynchronous), (24, true));
    let mut window = vec![NULL_BLOCK; 4];
    window.extend([504, 505, 506]);
    assert!(req
        .allocated(&mut leader, "b", vec![window, (600..607).collect()], 24)
        .unwrap());
    let plan = leader.take_plan(vec![]).unwrap();
    assert_eq!(plan.async_onboards.len(), 1);
    let onboard = &plan.async_onboards[0];
    assert_eq!(
        onboard.disk_reads.len(),
        8,
        "6 full-attention blocks and 2 of the window"
    );
    assert_eq!(
        onboarded(&plan),
        [504, 505].into_iter().chain(600..606).collect()
    );
    // Every pair's host block is a staging block a disk read fills.
    let staged: BTreeSet<u32> = onboard.disk_reads.iter().map(|r| r.host).collect();
    assert!(onboard.pairs.iter().all(|p| staged.contains(&p.0)));
}

#[test]
fn blocks_gone_since_the_match_fail_the_request_not_as_block_load_errors() {
    // vLLM 0.33 raises on block-level load errors with several groups
    // (`scheduler.py:_handle_invalid_blocks`); they must fail the asynchronous load instead.
    let mut leader = Leader::new(B, 64, 0, false).unwrap();
    let mut req = Requests::with_groups(swa_full());
    let prompt = tokens(100, 26);
    let ids = vec![(100..107).collect(), (200..207).collect()];
    offload_a(&mut req, &mut leader, &prompt, ids);
    for _ in 0..3 {
        leader.take_plan(vec![]).unwrap();
    }
    let b = prompt[..25].to_vec();
    let (found, _) = req
        .match_prefix(&leader, "b", &b[..24], 0, b.len(), None, None)
        .unwrap();
    assert_eq!(found, 24);
    // Evicted between vLLM's two calls.
    assert_eq!(leader.evict_idle_host(), 12);
    let mut window = vec![NULL_BLOCK; 4];
    window.extend([504, 505, 506]);
    assert!(req
        .allocated(&mut leader, "b", vec![window, (600..607).collect()], 24)
        .unwrap());
    let plan = leader.take_plan(vec![]).unwrap();
    assert!(plan.load_errors.is_empty());
    let unbacked: BTreeSet<u32> = plan.async_onboards[0].unbacked.iter().copied().collect();
    assert_eq!(unbacked, [504, 505].into_iter().chain(600..606).collect());
}

fn identity(hash: u64, first: u32) -> kvbm_core::BlockIdentity {
    kvbm_core::BlockIdentity {
        sequence_hash: kvbm_events::SequenceHash(hash),
        parent: None,
        tokens: tokens(first, B).into(),
        lora_name: None,
        group: None,
    }
}

#[test]
fn a_staging_block_never_evicts_a_host_block_the_same_onboard_needs() {
    // Keys of several groups are not one prefix: one group's copy may be on disk only while the
    // next group's is the host tier's least recently used block. Staging the first must not
    // evict the second.
    let mut leader = Leader::new(B, 4, 8, false).unwrap();
    let (on_disk, on_host) = (0xD15C, 0x4057);
    // Seen twice: admitted to disk, written, then gone from host memory.
    leader
        .offload_identities(vec![identity(on_disk, 0)])
        .unwrap();
    leader
        .offload_identities(vec![identity(on_disk, 0)])
        .unwrap();
    assert_eq!(leader.take_plan(vec![]).unwrap().disk_writes.len(), 1);
    for _ in 0..3 {
        leader.end_step();
    }
    assert_eq!(leader.evict_idle_host(), 1);
    // The host tier fills up, the needed block first (so the least recently used).
    leader
        .offload_identities(vec![
            identity(on_host, 10),
            identity(0xF1, 20),
            identity(0xF2, 30),
            identity(0xF3, 40),
        ])
        .unwrap();
    for _ in 0..3 {
        leader.end_step();
    }
    let backed = leader
        .plan_onboard_keys("r", &[on_disk, on_host], &[10, 11], true)
        .unwrap();
    assert_eq!(backed, vec![true, true]);
    let plan = leader.take_plan(vec![]).unwrap();
    assert!(plan.async_onboards[0].unbacked.is_empty());
    assert_eq!(plan.async_onboards[0].disk_reads.len(), 1);
}

#[test]
fn a_grant_off_a_block_boundary_fails_the_load_as_a_whole() {
    // vLLM may lower kvbm's offer (`cap_external_hit`); off a block boundary its allocation puts
    // a Mamba state elsewhere than kvbm would load it.
    let mut leader = Leader::new(B, 64, 0, false).unwrap();
    let mut req = Requests::with_groups(mamba_full());
    let prompt = tokens(100, 26);
    let mut states = vec![NULL_BLOCK; 7];
    states[5] = 105;
    offload_a(
        &mut req,
        &mut leader,
        &prompt,
        vec![states, (200..207).collect()],
    );
    let b = prompt[..25].to_vec();
    let (found, _) = req
        .match_prefix(&leader, "b", &b[..24], 0, b.len(), None, None)
        .unwrap();
    assert_eq!(found, 24);
    let mut states = vec![NULL_BLOCK; 7];
    states[5] = 505;
    assert!(req
        .allocated(&mut leader, "b", vec![states, (600..607).collect()], 22)
        .unwrap());
    let plan = leader.take_plan(vec![]).unwrap();
    let job = &plan.async_onboards[0];
    assert!(job.pairs.is_empty() && job.disk_reads.is_empty());
    assert!(!job.unbacked.is_empty());
    assert!(plan.load_errors.is_empty());
}

#[test]
fn a_table_that_does_not_reach_the_hit_fails_the_load_as_a_whole() {
    let mut leader = Leader::new(B, 64, 0, false).unwrap();
    let mut req = Requests::with_groups(swa_full());
    let prompt = tokens(100, 26);
    offload_a(
        &mut req,
        &mut leader,
        &prompt,
        vec![(100..107).collect(), (200..207).collect()],
    );
    let b = prompt[..25].to_vec();
    let (found, _) = req
        .match_prefix(&leader, "b", &b[..24], 0, b.len(), None, None)
        .unwrap();
    assert_eq!(found, 24);
    // The window group's table stops at 5 blocks where the hit needs 6.
    assert!(req
        .allocated(
            &mut leader,
            "b",
            vec![vec![0, 0, 0, 0, 504], (600..607).collect()],
            24
        )
        .unwrap());
    let plan = leader.take_plan(vec![]).unwrap();
    let job = &plan.async_onboards[0];
    assert!(job.pairs.is_empty(), "nothing loaded: {job:?}");
    assert!(!job.unbacked.is_empty());
}
