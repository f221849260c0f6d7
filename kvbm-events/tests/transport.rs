//! KV events over real ZMQ sockets on loopback: kvbm's publisher and replay server, and the
//! subscriber's handling of gaps, replays, restarts and garbage from a scripted vLLM-like peer.

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use kvbm_events::{
    encode_batch, request_replay, BlockRemoved, EventPublisher, KvEvent, PublisherConfig,
    SequenceHash, SubscriberEvent, Tier, WorkerEndpoint, ZmqPublisher, ZmqSubscriber,
};

const WAIT: Duration = Duration::from_secs(10);

fn removed(h: u64) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        tier: Tier::Host,
        block_hashes: vec![SequenceHash(h)],
    })
}

fn next(rx: &Receiver<SubscriberEvent>) -> SubscriberEvent {
    rx.recv_timeout(WAIT)
        .expect("the subscriber reported nothing in time")
}

#[test]
fn events_published_by_kvbm_arrive_decoded_and_in_order() {
    let bus = EventPublisher::new();
    let publisher =
        ZmqPublisher::start(&bus, PublisherConfig::new("tcp://127.0.0.1:*", None)).unwrap();
    let (tx, rx) = crossbeam_channel::unbounded();
    let _sub = ZmqSubscriber::start(
        vec![WorkerEndpoint {
            worker_id: 7,
            dp_rank: 0,
            endpoint: publisher.endpoint().to_owned(),
            replay: None,
        }],
        tx,
    )
    .unwrap();
    // Until the subscription is up, messages are lost (ZMQ's slow joiner): send markers.
    let deadline = Instant::now() + WAIT;
    loop {
        bus.publish(KvEvent::AllBlocksCleared);
        if let Ok(SubscriberEvent::Batch { .. }) = rx.recv_timeout(Duration::from_millis(20)) {
            break;
        }
        assert!(Instant::now() < deadline, "the subscription never came up");
    }
    // Let the last markers drain.
    while rx.recv_timeout(Duration::from_millis(100)).is_ok() {}
    for h in 0..100 {
        bus.publish(removed(h));
    }
    let mut got = Vec::new();
    let mut last_seq = None;
    while got.len() < 100 {
        match next(&rx) {
            SubscriberEvent::Batch { worker, seq, batch } => {
                assert_eq!(worker, (7, 0));
                assert!(
                    last_seq.is_none_or(|s| seq == s + 1),
                    "sequence numbers are consecutive"
                );
                last_seq = Some(seq);
                got.extend(batch.events.iter().map(|e| e.to_local().unwrap()));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, (0..100).map(removed).collect::<Vec<_>>());
    assert_eq!(
        publisher
            .stats()
            .events_lost
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[test]
fn the_replay_socket_serves_buffered_batches_from_a_sequence_number() {
    let bus = EventPublisher::new();
    let mut config = PublisherConfig::new("tcp://127.0.0.1:*", Some("tcp://127.0.0.1:*".into()));
    config.replay_batches_max = 4;
    let publisher = ZmqPublisher::start(&bus, config).unwrap();
    // One event per batch: wait for each to be published before the next.
    for h in 0..6u64 {
        bus.publish(removed(h));
        let deadline = Instant::now() + WAIT;
        while publisher
            .stats()
            .batches
            .load(std::sync::atomic::Ordering::Relaxed)
            < h + 1
        {
            assert!(Instant::now() < deadline);
            std::thread::yield_now();
        }
    }
    let ctx = zmq::Context::new();
    let replayed = request_replay(&ctx, publisher.replay_endpoint().unwrap(), 3, WAIT).unwrap();
    // Only the last 4 batches (2..6) are kept; from 3 on that is 3, 4, 5.
    assert_eq!(
        replayed.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![3, 4, 5]
    );
    let events: Vec<KvEvent> = replayed
        .iter()
        .flat_map(|(_, p)| kvbm_events::decode_batch(p).unwrap().events)
        .map(|e| e.to_local().unwrap())
        .collect();
    assert_eq!(events, vec![removed(3), removed(4), removed(5)]);
    assert!(
        request_replay(&ctx, publisher.replay_endpoint().unwrap(), 99, WAIT)
            .unwrap()
            .is_empty()
    );
}

/// A scripted worker: an XPUB (which learns when a subscriber is listening) and a ROUTER that
/// replays the batches it is told to keep.
struct Peer {
    xpub: zmq::Socket,
    router: zmq::Socket,
    endpoint: String,
    replay: String,
    kept: Vec<(u64, Vec<u8>)>,
}

impl Peer {
    fn new(ctx: &zmq::Context) -> Self {
        let xpub = ctx.socket(zmq::XPUB).unwrap();
        xpub.bind("tcp://127.0.0.1:*").unwrap();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = xpub.get_last_endpoint().unwrap().unwrap();
        let replay = router.get_last_endpoint().unwrap().unwrap();
        Peer {
            xpub,
            router,
            endpoint,
            replay,
            kept: Vec::new(),
        }
    }

    fn wait_for_subscriber(&self) {
        assert!(
            self.xpub
                .poll(zmq::POLLIN, WAIT.as_millis() as i64)
                .unwrap()
                > 0,
            "no subscriber"
        );
        let subscription = self.xpub.recv_bytes(0).unwrap();
        assert_eq!(subscription.first(), Some(&1u8));
    }

    fn payload(h: u64) -> Vec<u8> {
        let mut out = Vec::new();
        encode_batch(1.0, &[removed(h)], Some(0), &mut out);
        out
    }

    fn send(&self, seq: u64, payload: &[u8]) {
        let frames: [&[u8]; 3] = [b"", &seq.to_be_bytes(), payload];
        self.xpub.send_multipart(frames, 0).unwrap();
    }

    /// Answers one replay request from what it kept.
    fn serve_replay(&self) {
        assert!(
            self.router
                .poll(zmq::POLLIN, WAIT.as_millis() as i64)
                .unwrap()
                > 0,
            "no replay request"
        );
        let frames = self.router.recv_multipart(0).unwrap();
        let start = u64::from_be_bytes(frames[2].as_slice().try_into().unwrap());
        for (seq, payload) in self.kept.iter().filter(|(s, _)| *s >= start) {
            let out: [&[u8]; 5] = [&frames[0], b"", b"", &seq.to_be_bytes(), payload];
            self.router.send_multipart(out, 0).unwrap();
        }
        let end: [&[u8]; 5] = [&frames[0], b"", b"", &u64::MAX.to_be_bytes(), b""];
        self.router.send_multipart(end, 0).unwrap();
    }
}

fn batch_seq(event: SubscriberEvent) -> u64 {
    match event {
        SubscriberEvent::Batch { seq, batch, .. } => {
            assert_eq!(
                batch.events[0].to_local().unwrap(),
                removed(seq),
                "batch {seq} holds its own event"
            );
            seq
        }
        other => panic!("expected a batch, got {other:?}"),
    }
}

/// Subscribes to `peer`; with a replay socket, the peer answers the subscriber's initial replay
/// request from what it keeps at that moment.
fn subscribe(peer: &Peer, with_replay: bool) -> (ZmqSubscriber, Receiver<SubscriberEvent>) {
    let (tx, rx) = crossbeam_channel::unbounded();
    let worker = WorkerEndpoint {
        worker_id: 1,
        dp_rank: 2,
        endpoint: peer.endpoint.clone(),
        replay: with_replay.then(|| peer.replay.clone()),
    };
    let sub = std::thread::scope(|scope| {
        let started = scope.spawn(|| ZmqSubscriber::start(vec![worker], tx));
        if with_replay {
            peer.serve_replay();
        }
        started.join().unwrap().unwrap()
    });
    peer.wait_for_subscriber();
    (sub, rx)
}

#[test]
fn a_gap_is_filled_from_the_replay_socket() {
    let ctx = zmq::Context::new();
    let mut peer = Peer::new(&ctx);
    // Nothing buffered yet when the subscriber synchronises.
    let (_sub, rx) = subscribe(&peer, true);
    peer.kept = vec![(1, Peer::payload(1)), (2, Peer::payload(2))];
    peer.send(0, &Peer::payload(0));
    assert_eq!(batch_seq(next(&rx)), 0);
    // 1 and 2 are "lost"; 3 arrives.
    peer.send(3, &Peer::payload(3));
    peer.serve_replay();
    assert_eq!(batch_seq(next(&rx)), 1);
    assert_eq!(batch_seq(next(&rx)), 2);
    assert_eq!(
        next(&rx),
        SubscriberEvent::Gap {
            worker: (1, 2),
            from: 1,
            to: 3,
            filled: true
        }
    );
    assert_eq!(batch_seq(next(&rx)), 3);
}

#[test]
fn gaps_without_replay_restarts_and_garbage_are_reported_and_survived() {
    let ctx = zmq::Context::new();
    let peer = Peer::new(&ctx);
    let (_sub, rx) = subscribe(&peer, false);
    peer.send(0, &Peer::payload(0));
    assert_eq!(batch_seq(next(&rx)), 0);
    peer.send(5, &Peer::payload(5));
    assert_eq!(
        next(&rx),
        SubscriberEvent::Gap {
            worker: (1, 2),
            from: 1,
            to: 5,
            filled: false
        }
    );
    assert_eq!(batch_seq(next(&rx)), 5);
    // Garbage: a payload that is not msgpack, then a message with the wrong number of frames.
    peer.send(6, b"\xc1\xff not msgpack");
    assert!(matches!(
        next(&rx),
        SubscriberEvent::Undecodable { seq: 6, .. }
    ));
    peer.xpub
        .send_multipart([&b"only"[..], &b"two"[..]], 0)
        .unwrap();
    assert!(matches!(next(&rx), SubscriberEvent::Undecodable { .. }));
    // A duplicate is ignored; the stream goes on.
    peer.send(6, &Peer::payload(6));
    peer.send(7, &Peer::payload(7));
    assert_eq!(batch_seq(next(&rx)), 7);
    // The engine restarted: its sequence starts again at 0.
    peer.send(0, &Peer::payload(0));
    assert_eq!(next(&rx), SubscriberEvent::Restart { worker: (1, 2) });
    assert_eq!(batch_seq(next(&rx)), 0);
}

#[test]
fn a_new_subscriber_first_reports_what_the_replay_socket_buffers() {
    let ctx = zmq::Context::new();
    let mut peer = Peer::new(&ctx);
    peer.kept = vec![(3, Peer::payload(3)), (4, Peer::payload(4))];
    let (_sub, rx) = subscribe(&peer, true);
    // Batches 0..3 are gone from the buffer: an unfilled gap, then what is buffered.
    assert_eq!(
        next(&rx),
        SubscriberEvent::Gap {
            worker: (1, 2),
            from: 0,
            to: 3,
            filled: false
        }
    );
    assert_eq!(batch_seq(next(&rx)), 3);
    assert_eq!(batch_seq(next(&rx)), 4);
    // The live stream goes on from there; what the replay already reported is skipped.
    peer.send(4, &Peer::payload(4));
    peer.send(5, &Peer::payload(5));
    assert_eq!(batch_seq(next(&rx)), 5);
}

/// Names of this process's threads, one per thread.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|n| n.trim_end().to_owned())
        .collect()
}

#[test]
fn zmqs_own_threads_carry_its_name_not_their_creators() {
    // libzmq starts a context's I/O thread and reaper with its first socket, on the thread
    // making it, and (as the zmq crate builds it) does not rename them: they would carry the
    // name of whoever subscribed first (a runtime's worker in the router), here "zmq-starter".
    let started = std::thread::Builder::new()
        .name("zmq-starter".into())
        .spawn(|| {
            let bus = EventPublisher::new();
            let publisher =
                ZmqPublisher::start(&bus, PublisherConfig::new("tcp://127.0.0.1:*", None)).unwrap();
            let (tx, rx) = crossbeam_channel::bounded(16);
            let sub = ZmqSubscriber::start(
                vec![WorkerEndpoint {
                    worker_id: 1,
                    dp_rank: 0,
                    endpoint: publisher.endpoint().to_owned(),
                    replay: None,
                }],
                tx,
            )
            .unwrap();
            (bus, publisher, sub, rx)
        })
        .unwrap()
        .join()
        .unwrap();
    let names = thread_names();
    assert!(
        !names.iter().any(|n| n == "zmq-starter"),
        "a thread outlived its starter under its name: {names:?}"
    );
    // Two contexts (publisher, subscriber), each with an I/O thread and a reaper.
    let zmq = names
        .iter()
        .filter(|n| *n == kvbm_events::transport::ZMQ_THREAD_NAME)
        .count();
    assert!(
        zmq >= 4,
        "ZMQ's threads under their name: {zmq} in {names:?}"
    );
    drop(started);
}
