//! The in-process event bus: ordering, bounded queues, counted drops, visible gaps.

use std::time::Duration;

use kvbm_events::{BlockRemoved, EventPublisher, KvEvent, SequenceHash, Tier};

fn removed(h: u64) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        tier: Tier::Host,
        block_hashes: vec![SequenceHash(h)],
    })
}

#[test]
fn sequence_numbers_start_at_zero_and_have_no_holes() {
    let publisher = EventPublisher::new();
    let mut sub = publisher.subscribe(16);
    for i in 0..10 {
        assert_eq!(publisher.publish(removed(i)), i);
    }
    let got = sub.drain();
    assert_eq!(got.len(), 10);
    for (i, d) in got.iter().enumerate() {
        assert_eq!(d.record.seq, i as u64);
        assert_eq!(d.missed_before, 0);
        assert_eq!(d.record.event, removed(i as u64));
    }
}

#[test]
fn a_slow_subscriber_loses_events_counted_and_sees_the_gap() {
    let publisher = EventPublisher::new();
    let mut slow = publisher.subscribe(4);
    let mut fast = publisher.subscribe(64);
    for i in 0..10 {
        publisher.publish(removed(i));
    }
    // The slow queue held 0..4; 4..10 were dropped for it.
    assert_eq!(slow.dropped(), 6);
    assert_eq!(publisher.dropped_total(), 6);
    let first: Vec<u64> = slow.drain().iter().map(|d| d.record.seq).collect();
    assert_eq!(first, vec![0, 1, 2, 3]);
    publisher.publish(removed(10));
    let next = slow.recv_timeout(Duration::from_secs(5)).expect("event 10");
    assert_eq!(next.record.seq, 10);
    assert_eq!(next.missed_before, 6);
    assert_eq!(slow.missed_seen(), 6);
    // The fast subscriber lost nothing.
    assert_eq!(fast.drain().len(), 11);
    assert_eq!(fast.dropped(), 0);
}

#[test]
fn a_late_subscriber_starts_at_the_next_sequence_number() {
    let publisher = EventPublisher::new();
    publisher.publish(KvEvent::AllBlocksCleared);
    let mut sub = publisher.subscribe(4);
    publisher.publish(removed(1));
    let d = sub.try_recv().unwrap();
    assert_eq!((d.record.seq, d.missed_before), (1, 0));
}

#[test]
fn dropped_subscribers_are_forgotten() {
    let publisher = EventPublisher::new();
    let sub = publisher.subscribe(1);
    assert_eq!(publisher.subscriber_count(), 1);
    drop(sub);
    publisher.publish(removed(0));
    assert_eq!(publisher.subscriber_count(), 0);
    assert_eq!(publisher.dropped_total(), 0);
}

#[test]
fn publishing_from_many_threads_keeps_each_subscriber_in_order() {
    let publisher = EventPublisher::new();
    let mut sub = publisher.subscribe(100_000);
    std::thread::scope(|s| {
        for t in 0..4 {
            let p = publisher.clone();
            s.spawn(move || {
                for i in 0..1000 {
                    p.publish(removed(t * 1000 + i));
                }
            });
        }
    });
    let seqs: Vec<u64> = sub.drain().iter().map(|d| d.record.seq).collect();
    assert_eq!(seqs, (0..4000).collect::<Vec<_>>());
}
