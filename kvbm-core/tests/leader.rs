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
