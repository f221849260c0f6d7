//! The leader (the logical half): offloads registered and announced, matches across host and
//! disk, loads planned and held, disk writes of admitted blocks, holds released with the steps.

use kvbm_core::{CoreError, Leader, TokenRun};
use kvbm_events::{KvEvent, Tier};

const B: usize = 4;

fn run(first: u32, blocks: usize, parent: Option<u64>) -> TokenRun {
    TokenRun {
        tokens: (first..first + (blocks * B) as u32).collect(),
        parent,
        lora_name: None,
        salt: None,
    }
}

fn offload(leader: &mut Leader, runs: &[TokenRun]) -> Vec<kvbm_core::Offloaded> {
    let hashed = Leader::hash_runs(B, runs).unwrap();
    leader.offload_runs(runs, hashed).unwrap()
}

/// Replays the events of one tier into the set of hashes it holds.
fn replay(events: &[KvEvent], tier: Tier, into: &mut std::collections::BTreeSet<u64>) {
    for e in events {
        match e {
            KvEvent::BlockStored(s) if s.tier == tier => {
                into.extend(s.block_hashes.iter().map(|h| h.0))
            }
            KvEvent::BlockRemoved(r) if r.tier == tier => {
                for h in &r.block_hashes {
                    into.remove(&h.0);
                }
            }
            KvEvent::AllBlocksCleared => into.clear(),
            KvEvent::SharedStored { .. } | KvEvent::SharedRemoved { .. } => {}
            _ => {}
        }
    }
}

#[test]
fn offloads_are_registered_once_and_matched_in_order() {
    let mut leader = Leader::new(B, 8, 0, false).unwrap();
    let done = offload(&mut leader, &[run(0, 3, None), run(100, 2, None)]);
    assert_eq!(done.len(), 2);
    assert_eq!(done[0].hashes.len(), 3);
    let ids: Vec<u32> = done
        .iter()
        .flat_map(|o| o.host.iter().flatten().copied())
        .collect();
    assert_eq!(ids.len(), 5, "every new block gets a host block");
    let unique: std::collections::HashSet<u32> = ids.iter().copied().collect();
    assert_eq!(unique.len(), 5);
    // The same blocks again: already there, nothing to save.
    let again = offload(&mut leader, &[run(0, 3, None)]);
    assert_eq!(again[0].host, vec![None, None, None]);
    assert_eq!(again[0].hashes, done[0].hashes);
    // A prefix match stops at the first block the tier lacks.
    let mut probe = done[0].hashes.clone();
    probe.push(12345);
    assert_eq!(leader.count_prefix_tiers(&probe), (3, 0));
    let plan = leader.hold_onboard(&done[0].hashes[..2], None);
    assert_eq!(
        plan.host,
        done[0].host[..2]
            .iter()
            .map(|h| h.unwrap())
            .collect::<Vec<_>>()
    );
    assert!(plan.disk_reads.is_empty());
    // Whole blocks only.
    let bad = TokenRun {
        tokens: vec![1, 2, 3],
        ..run(0, 0, None)
    };
    assert!(matches!(
        Leader::hash_runs(B, &[bad]),
        Err(CoreError::InvalidArgument(_))
    ));
}

#[test]
fn held_blocks_survive_until_their_steps_pass_and_events_replay_to_the_registry() {
    let mut leader = Leader::new(B, 4, 0, false).unwrap();
    let first = offload(&mut leader, &[run(0, 4, None)]);
    assert!(first[0].host.iter().all(Option::is_some));
    // Everything is held for two steps: nothing to spare for more.
    let blocked = offload(&mut leader, &[run(500, 2, None)]);
    assert_eq!(blocked[0].host, vec![None, None]);
    leader.end_step();
    leader.end_step();
    let later = offload(&mut leader, &[run(500, 2, None)]);
    assert!(
        later[0].host.iter().all(Option::is_some),
        "evicted once released"
    );
    let events = leader.take_events();
    let mut host = Default::default();
    replay(&events, Tier::Host, &mut host);
    let registered: std::collections::BTreeSet<u64> =
        leader.registered_hashes(Tier::Host).into_iter().collect();
    assert_eq!(host, registered);
    assert_eq!(leader.counts().host.evictions, 2);
}

#[test]
fn admitted_blocks_go_to_disk_and_come_back_through_staging_blocks() {
    let mut leader = Leader::new(B, 4, 8, true).unwrap();
    let done = offload(&mut leader, &[run(0, 3, None)]);
    let writes = leader.take_disk_writes().unwrap();
    assert_eq!(writes.len(), 3, "every block admitted with the filter off");
    let hosts: Vec<u32> = done[0].host.iter().map(|h| h.unwrap()).collect();
    assert_eq!(writes.iter().map(|w| w.host).collect::<Vec<_>>(), hosts);
    assert_eq!(
        writes.iter().map(|w| w.key).collect::<Vec<_>>(),
        done[0].hashes
    );
    // Push the host copies out; the disk copies remain and are matched after the host part.
    for _ in 0..2 {
        leader.end_step();
    }
    offload(&mut leader, &[run(900, 4, None)]);
    assert_eq!(leader.take_disk_writes().unwrap().len(), 4);
    // The new host blocks are held while their saves and disk writes run: nothing to stage into.
    assert_eq!(leader.count_prefix_tiers(&done[0].hashes), (0, 0));
    for _ in 0..2 {
        leader.end_step();
    }
    assert_eq!(leader.count_prefix_tiers(&done[0].hashes), (0, 3));
    let plan = leader.hold_onboard(&done[0].hashes, Some("r"));
    assert!(plan.host.is_empty());
    let keys: Vec<u64> = plan.disk_reads.iter().map(|r| r.key).collect();
    assert_eq!(keys, done[0].hashes);
    let disk: Vec<u32> = plan.disk_reads.iter().map(|r| r.disk).collect();
    assert_eq!(disk, writes.iter().map(|w| w.disk).collect::<Vec<_>>());
    // An asynchronous load holds its blocks until released, whatever the steps.
    for _ in 0..4 {
        leader.end_step();
    }
    let disk = leader.counts().disk.unwrap();
    assert_eq!(
        (disk.registered, disk.idle),
        (7, 4),
        "the load's 3 stay held"
    );
    assert!(leader.release("r"));
    assert!(!leader.release("r"));
    assert_eq!(leader.counts().disk.unwrap().idle, 7);
}

#[test]
fn blocks_a_worker_reports_bad_leave_the_registry_at_once_even_while_held() {
    let mut leader = Leader::new(B, 8, 4, true).unwrap();
    let done = offload(&mut leader, &[run(0, 3, None)]);
    let ids: Vec<u32> = done[0].host.iter().flatten().copied().collect();
    let writes = leader.take_disk_writes().unwrap();
    assert_eq!(writes.len(), 3);
    leader.take_events();
    // The offload into the second host block and the disk write of the third failed.
    assert_eq!(leader.discard(&[ids[1]], &[writes[2].disk]), 2);
    // Still held by the step's holds, yet no longer matched, and announced as removed.
    let (host, _) = leader.count_prefix_tiers(&done[0].hashes);
    assert_eq!(host, 1, "the prefix ends at the discarded block");
    let removed: Vec<(Tier, Vec<u64>)> = leader
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) => {
                Some((r.tier, r.block_hashes.iter().map(|h| h.0).collect()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        removed,
        vec![
            (Tier::Host, vec![done[0].hashes[1]]),
            (Tier::Disk, vec![done[0].hashes[2]])
        ]
    );
    // Ids not registered (or reported twice) are ignored.
    assert_eq!(leader.discard(&[ids[1], 7], &[3]), 0);
    // Once the holds end the slots are free again: the tier can take new blocks into them.
    for _ in 0..3 {
        leader.end_step();
    }
    let c = leader.counts();
    assert_eq!((c.host.registered, c.host.discarded), (2, 0));
}

mod requests {
    use kvbm_core::requests::{Requests, Scheduled};
    use kvbm_core::Leader;

    use super::B;

    fn tokens(first: u32, n: usize) -> Vec<u32> {
        (first..first + n as u32).collect()
    }

    /// One step: the scheduled requests, then the tokens of the spans asked for.
    fn step(
        req: &mut Requests,
        leader: &mut Leader,
        scheduled: Vec<Scheduled>,
        work: &[(String, usize, Vec<u32>)],
    ) -> kvbm_core::StepPlan {
        let w: Vec<(String, usize, usize)> = work
            .iter()
            .map(|(r, n, t)| (r.clone(), *n, t.len()))
            .collect();
        let spans = req.schedule(scheduled, &w).unwrap();
        let toks = spans
            .iter()
            .map(|s| work[s.index].2[s.first_token..s.end_token].to_vec())
            .collect();
        req.offload_spans(leader, toks).unwrap();
        leader.take_plan(vec![]).unwrap()
    }

    #[test]
    fn requests_offload_as_blocks_complete_and_match_later_prompts() {
        let mut leader = Leader::new(B, 16, 0, false).unwrap();
        let mut req = Requests::new(B);
        // A: a 10-token prompt in GPU blocks 0..3, prefilled in one step: 2 full blocks.
        let a = tokens(100, 10);
        assert_eq!(
            req.match_prefix(&leader, "a", &a[..8], 0, 10, None, None)
                .unwrap(),
            (0, false)
        );
        assert!(!req
            .allocated(&mut leader, "a", vec![vec![0, 1, 2]], 0)
            .unwrap());
        let plan = step(
            &mut req,
            &mut leader,
            vec![Scheduled::New {
                request: "a".into(),
                block_ids: vec![vec![0, 1, 2]],
                computed: 0,
                lora: None,
                salt: None,
            }],
            &[("a".into(), 10, a.clone())],
        );
        assert_eq!(plan.offloads.len(), 1);
        assert_eq!(
            plan.offloads[0]
                .pairs
                .iter()
                .map(|p| p.0)
                .collect::<Vec<_>>(),
            vec![0, 1]
        );
        // Two decode steps: the third block completes at token 12, offloaded once.
        let mut a2 = a.clone();
        a2.extend([7, 8]);
        let plan = step(
            &mut req,
            &mut leader,
            vec![Scheduled::Cached {
                request: "a".into(),
                new_block_ids: None,
                resumed: false,
                computed: 10,
            }],
            &[("a".into(), 2, a2.clone())],
        );
        assert_eq!(
            plan.offloads[0].pairs,
            vec![(2, plan.offloads[0].pairs[0].1)]
        );
        assert!(
            req.finished("a"),
            "it offloaded: vLLM waits for finished_sending"
        );
        req.connector_output(&mut leader, &[], &["a".to_string()]);
        assert!(req.tracked().is_empty());
        // B shares A's first 12 tokens: 3 blocks match (not the block of its last token).
        let mut b = a2[..12].to_vec();
        b.extend([1, 2, 3]);
        assert_eq!(
            req.match_prefix(&leader, "b", &b[..12], 0, 15, None, None)
                .unwrap(),
            (12, false)
        );
        assert!(!req
            .allocated(&mut leader, "b", vec![vec![5, 6, 7, 8]], 12)
            .unwrap());
        let plan = leader.take_plan(vec![]).unwrap();
        assert_eq!(
            plan.onboards[0]
                .pairs
                .iter()
                .map(|p| p.1)
                .collect::<Vec<_>>(),
            vec![5, 6, 7]
        );
        // A request that never offloaded is forgotten at once.
        assert!(!req.finished("b"));
        assert!(req.tracked().is_empty());
    }

    fn scheduled_new(request: &str, block_ids: Vec<u32>, computed: usize) -> Scheduled {
        Scheduled::New {
            request: request.into(),
            block_ids: vec![block_ids],
            computed,
            lora: None,
            salt: None,
        }
    }

    fn hashes_of(tokens: &[u32]) -> Vec<u64> {
        kvbm_events::BlockHasher::new(B, None, None)
            .sequence_hashes(None, tokens)
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    /// A prompt whose blocks only disk holds: A computes and offloads 3 blocks (written to
    /// disk), they leave the host tier, B matches them on disk. Returns the leader, the
    /// requests, B's tokens and B's asynchronous onboard's disk reads.
    fn disk_hit() -> (Leader, Requests, Vec<u32>, Vec<kvbm_core::DiskRead>) {
        let mut leader = Leader::new(B, 8, 16, true).unwrap();
        let mut req = Requests::new(B);
        let a = tokens(500, 13);
        step(
            &mut req,
            &mut leader,
            vec![scheduled_new("a", vec![0, 1, 2, 3], 0)],
            &[("a".into(), 13, a.clone())],
        );
        for _ in 0..3 {
            leader.take_plan(vec![]).unwrap();
        }
        assert_eq!(leader.evict_idle_host(), 3);
        let (found, asynchronous) = req
            .match_prefix(&leader, "b", &a[..12], 0, 13, None, None)
            .unwrap();
        assert_eq!((found, asynchronous), (12, true));
        assert!(req
            .allocated(&mut leader, "b", vec![vec![10, 11, 12, 13]], 12)
            .unwrap());
        assert_eq!(req.hit_sources("b", 12), Some((0, 12, 0)));
        let plan = leader.take_plan(vec![]).unwrap();
        let reads = plan.async_onboards[0].disk_reads.clone();
        assert_eq!(reads.len(), 3);
        (leader, req, a, reads)
    }

    #[test]
    fn a_disk_hit_becomes_a_host_block_and_is_not_offloaded_again() {
        let (mut leader, mut req, a, reads) = disk_hit();
        let hashes = hashes_of(&a[..12]);
        assert_eq!(leader.count_prefix_tiers(&hashes), (0, 3));
        leader.take_events();
        // The workers report B's onboard finished: its staging blocks join the host tier.
        req.connector_output(&mut leader, &["b".to_string()], &[]);
        assert_eq!(leader.count_prefix_tiers(&hashes), (3, 0));
        let mut host = std::collections::BTreeSet::new();
        super::replay(&leader.take_events(), kvbm_events::Tier::Host, &mut host);
        assert_eq!(host, hashes.iter().copied().collect());
        // They are the very host blocks the disk reads landed in.
        let staged: std::collections::BTreeSet<u32> = reads.iter().map(|r| r.host).collect();
        let registered: std::collections::BTreeSet<u32> = hashes
            .iter()
            .map(|&h| {
                leader
                    .host_pool()
                    .lookup(kvbm_events::SequenceHash(h))
                    .expect("registered")
                    .id()
                    .0
            })
            .collect();
        assert_eq!(registered, staged);
        // B prefills its last token: nothing of the loaded prefix is offloaded from the GPU.
        let plan = step(
            &mut req,
            &mut leader,
            vec![scheduled_new("b", vec![10, 11, 12, 13], 12)],
            &[("b".into(), 1, a.clone())],
        );
        assert!(plan.offloads.is_empty(), "{:?}", plan.offloads);
    }

    #[test]
    fn a_staging_block_whose_disk_read_failed_never_joins_the_host_tier() {
        let (mut leader, mut req, a, reads) = disk_hit();
        let hashes = hashes_of(&a[..12]);
        // The worker reports the second read's host block bad in the same output.
        leader.discard(&[reads[1].host], &[]);
        req.connector_output(&mut leader, &["b".to_string()], &[]);
        // The first joined; the second did not (so neither did the third: a prefix stops).
        assert!(leader
            .host_pool()
            .lookup(kvbm_events::SequenceHash(hashes[0]))
            .is_some());
        assert!(leader
            .host_pool()
            .lookup(kvbm_events::SequenceHash(hashes[1]))
            .is_none());
        assert_eq!(leader.count_prefix_tiers(&hashes).0, 1);
    }

    #[test]
    fn unbacked_blocks_are_not_offloaded_until_vllm_recomputes_them() {
        let mut leader = Leader::new(B, 4, 0, false).unwrap();
        let mut req = Requests::new(B);
        let a = tokens(0, 13);
        req.match_prefix(&leader, "a", &a[..12], 0, 13, None, None)
            .unwrap();
        req.allocated(&mut leader, "a", vec![vec![0, 1, 2, 3]], 0)
            .unwrap();
        step(
            &mut req,
            &mut leader,
            vec![Scheduled::New {
                request: "a".into(),
                block_ids: vec![vec![0, 1, 2, 3]],
                computed: 0,
                lora: None,
                salt: None,
            }],
            &[("a".into(), 13, a.clone())],
        );
        for _ in 0..3 {
            leader.take_plan(vec![]).unwrap();
        }
        // B matches all 3; A's blocks are evicted before B's allocation (4 new blocks fill the
        // tier), so the onboard backs none of them: B's blocks from 0 on are unbacked.
        let (found, _) = req
            .match_prefix(&leader, "b", &a[..12], 0, 13, None, None)
            .unwrap();
        assert_eq!(found, 12);
        let other = tokens(1000, 16);
        req.match_prefix(&leader, "x", &other[..12], 0, 16, None, None)
            .unwrap();
        step(
            &mut req,
            &mut leader,
            vec![Scheduled::New {
                request: "x".into(),
                block_ids: vec![vec![20, 21, 22, 23]],
                computed: 0,
                lora: None,
                salt: None,
            }],
            &[("x".into(), 16, other)],
        );
        req.allocated(&mut leader, "b", vec![vec![8, 9, 10, 11]], 12)
            .unwrap();
        let plan = leader.take_plan(vec![]).unwrap();
        assert_eq!(
            plan.load_errors.len(),
            3 - plan.onboards.iter().map(|o| o.pairs.len()).sum::<usize>()
        );
        let backed: usize = plan.onboards.iter().map(|o| o.pairs.len()).sum();
        assert!(backed < 3, "something was evicted");
        // vLLM still counts the unbacked blocks computed: nothing from there is offloaded.
        let plan = step(
            &mut req,
            &mut leader,
            vec![Scheduled::New {
                request: "b".into(),
                block_ids: vec![vec![8, 9, 10, 11]],
                computed: 12,
                lora: None,
                salt: None,
            }],
            &[("b".into(), 1, a.clone())],
        );
        let offloaded: Vec<u32> = plan
            .offloads
            .iter()
            .flat_map(|o| o.pairs.iter().map(|p| p.0))
            .collect();
        assert!(
            offloaded.iter().all(|&g| (g as usize) < 8 + backed),
            "{offloaded:?}"
        );
        // vLLM rolled back to the first unbacked block and recomputes: offloaded as it fills.
        let plan = step(
            &mut req,
            &mut leader,
            vec![Scheduled::Cached {
                request: "b".into(),
                new_block_ids: None,
                resumed: false,
                computed: backed * B,
            }],
            &[("b".into(), 13 - backed * B, a.clone())],
        );
        let offloaded: Vec<u32> = plan
            .offloads
            .iter()
            .flat_map(|o| o.pairs.iter().map(|p| p.0))
            .collect();
        assert_eq!(offloaded, (8 + backed as u32..11).collect::<Vec<_>>());
    }
}
