//! The shared tier against real servers (`redis-server` on loopback, see `redis_server`): blocks
//! written by one store are found and read byte-exact by another (another "node": its own
//! client and runtime); lookups count a contiguous prefix; tenants and layouts never see each
//! other's blocks; corrupt, truncated and foreign values are misses counted by reason; a server
//! killed mid-run makes the tier a miss within its timeout and the tier comes back with the
//! server; `OOM` refusals are counted without taking the tier out; a password is used; every
//! write carries its TTL; and the same through a three-master Redis Cluster.

mod redis_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_core::shared::store::{SharedBlock, SharedPut};
use kvbm_core::shared::{block_key, encode_value, tenant_id, BadValue, SharedOptions, SharedStore};
use kvbm_core::{BlockIdentity, SequenceHash};
use redis_server::{Cluster, Server};

const PAYLOAD: usize = 8192;
const FINGERPRINT: u64 = 0xfeed_f00d;
const FLUSH: Duration = Duration::from_secs(10);

fn identity(i: u64) -> BlockIdentity {
    BlockIdentity {
        sequence_hash: SequenceHash(0x1000 + i),
        parent: (i > 0).then(|| SequenceHash(0x1000 + i - 1)),
        tokens: (0..16u32)
            .map(|t| t + 16 * i as u32)
            .collect::<Vec<_>>()
            .into(),
        lora_name: None,
        group: None,
    }
}

fn payload(i: u64, salt: u8) -> Arc<[u8]> {
    (0..PAYLOAD)
        .map(|b| (b as u64 * 131 + i * 7 + salt as u64) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn puts(n: u64, salt: u8) -> Vec<SharedPut> {
    (0..n)
        .map(|i| SharedPut {
            identity: identity(i),
            payload: payload(i, salt),
        })
        .collect()
}

fn hashes(n: u64) -> Vec<SequenceHash> {
    (0..n).map(|i| identity(i).sequence_hash).collect()
}

fn options(urls: Vec<String>) -> SharedOptions {
    let mut o = SharedOptions::new(urls);
    o.lookup_timeout = Duration::from_millis(500);
    o.write_batch_blocks = 8;
    o.writes_in_flight = 16;
    o
}

fn store(urls: Vec<String>) -> SharedStore {
    SharedStore::open(options(urls), FINGERPRINT, PAYLOAD).unwrap()
}

fn raw(server: &Server) -> redis::Connection {
    redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap()
}

fn check_blocks(got: &[Option<SharedBlock>], n: u64, salt: u8) {
    assert_eq!(got.len(), n as usize);
    for (i, b) in got.iter().enumerate() {
        let b = b.as_ref().unwrap_or_else(|| panic!("block {i} missing"));
        assert_eq!(b.identity, identity(i as u64));
        assert_eq!(b.payload(), &payload(i as u64, salt)[..], "block {i}");
    }
}

#[test]
fn a_prefix_written_by_one_node_is_read_byte_exact_by_another() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let first = store(vec![server.url()]);
    let second = store(vec![server.url()]);
    assert_eq!(second.lookup(0, &hashes(20)), 0);
    assert_eq!(first.write(0, &puts(20, 1)), 20);
    assert!(first.flush(FLUSH));
    assert_eq!(first.counts().writes, 20);
    assert_eq!(second.lookup(0, &hashes(20)), 20);
    // Only a contiguous prefix counts: a hole at 5 stops it there.
    let mut con = raw(&server);
    let key = block_key("kvbm", FINGERPRINT, 0, identity(5).sequence_hash);
    redis::cmd("DEL").arg(&key).query::<()>(&mut con).unwrap();
    assert_eq!(second.lookup(0, &hashes(20)), 5);
    let got = second.read(0, &hashes(5));
    check_blocks(&got, 5, 1);
    let c = second.counts();
    assert_eq!((c.read_hits, c.lookup_hits), (5, 20 + 5));
    assert_eq!(c.bad_values, [0; 6]);
    // A block of the wrong size is not written.
    let mut wrong = puts(1, 1);
    wrong[0].payload = vec![0u8; 10].into();
    assert_eq!(first.write(0, &wrong), 0);
}

#[test]
fn tenants_and_layouts_never_see_each_others_blocks() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let s = store(vec![server.url()]);
    let alice = tenant_id(None, Some("alice"));
    let bob = tenant_id(None, Some("bob"));
    assert_eq!(s.write(alice, &puts(4, 2)), 4);
    assert!(s.flush(FLUSH));
    assert_eq!(s.lookup(alice, &hashes(4)), 4);
    assert_eq!(s.lookup(bob, &hashes(4)), 0);
    assert_eq!(s.lookup(0, &hashes(4)), 0);
    assert!(s.read(bob, &hashes(4)).iter().all(Option::is_none));
    // Another layout (fingerprint) sees nothing either.
    let other = SharedStore::open(options(vec![server.url()]), FINGERPRINT + 1, PAYLOAD).unwrap();
    assert_eq!(other.lookup(alice, &hashes(4)), 0);
    // Alice's value copied under Bob's key is refused: it says it is Alice's.
    let mut con = raw(&server);
    let h = identity(0).sequence_hash;
    let value: Vec<u8> = redis::cmd("GET")
        .arg(block_key("kvbm", FINGERPRINT, alice, h))
        .query(&mut con)
        .unwrap();
    redis::cmd("SET")
        .arg(block_key("kvbm", FINGERPRINT, bob, h))
        .arg(value)
        .query::<()>(&mut con)
        .unwrap();
    assert_eq!(s.lookup(bob, &hashes(1)), 1);
    assert!(s.read(bob, &hashes(1))[0].is_none());
    assert_eq!(s.counts().bad_values[BadValue::Mismatch.index()], 1);
}

#[test]
fn corrupt_truncated_and_foreign_values_are_misses_counted_by_reason() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let s = store(vec![server.url()]);
    assert_eq!(s.write(0, &puts(6, 3)), 6);
    assert!(s.flush(FLUSH));
    let mut con = raw(&server);
    let key = |i: u64| block_key("kvbm", FINGERPRINT, 0, identity(i).sequence_hash);
    let good = |i: u64| encode_value(FINGERPRINT, 0, &identity(i), &payload(i, 3));
    let mut set = |i: u64, v: Vec<u8>| {
        redis::cmd("SET")
            .arg(key(i))
            .arg(v)
            .query::<()>(&mut con)
            .unwrap()
    };
    let mut flipped = good(0);
    flipped[5000] ^= 0x10;
    set(0, flipped);
    let mut cut = good(1);
    cut.truncate(cut.len() - 100);
    set(1, cut);
    set(2, b"not a kvbm block".to_vec());
    // Written for another layout under this layout's key.
    set(
        3,
        encode_value(FINGERPRINT ^ 1, 0, &identity(3), &payload(3, 3)),
    );
    // Another block's value under this block's key.
    set(4, good(5));
    let got = s.read(0, &hashes(6));
    assert!(
        got[..5].iter().all(Option::is_none),
        "bad values were taken"
    );
    let last = got[5].as_ref().expect("the good block is served");
    assert_eq!(last.identity, identity(5));
    assert_eq!(last.payload(), &payload(5, 3)[..]);
    let c = s.counts();
    let bad = |r: BadValue| c.bad_values[r.index()];
    assert_eq!(bad(BadValue::Checksum), 1);
    assert_eq!(bad(BadValue::Truncated), 1);
    assert_eq!(bad(BadValue::Foreign), 1);
    assert_eq!(bad(BadValue::Mismatch), 2);
    assert!(c.up, "bad values are not an outage");
}

#[test]
fn a_killed_server_is_a_miss_and_the_tier_comes_back_with_it() {
    if !redis_server::available() {
        return;
    }
    let mut server = Server::start(&[]);
    let s = store(vec![server.url()]);
    assert_eq!(s.write(0, &puts(4, 4)), 4);
    assert!(s.flush(FLUSH));
    assert_eq!(s.lookup(0, &hashes(4)), 4);
    server.kill();
    // Every call returns, as a miss; none waits much past its bound (500 ms lookups, 1 s
    // reads; the generous limit only catches a call that hangs).
    let started = Instant::now();
    for _ in 0..20 {
        assert_eq!(s.lookup(0, &hashes(4)), 0);
        assert!(s.read(0, &hashes(4)).iter().all(Option::is_none));
        s.write(0, &puts(4, 4));
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "calls against a dead server took {:?}",
        started.elapsed()
    );
    let c = s.counts();
    assert!(!c.up && c.outages >= 1, "{c:?}");
    assert!(c.lookups_skipped > 0, "backoff skips lookups: {c:?}");
    assert!(c.writes_dropped_down > 0, "{c:?}");
    // The server comes back (empty): the tier follows once its backoff allows a try.
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        s.write(0, &puts(4, 5));
        s.flush(FLUSH);
        if s.lookup(0, &hashes(4)) == 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the tier did not come back: {:?}",
            s.counts()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    check_blocks(&s.read(0, &hashes(4)), 4, 5);
    let c = s.counts();
    assert!(c.up && c.recoveries >= 1, "{c:?}");
}

#[test]
fn a_full_server_refuses_writes_without_taking_the_tier_out() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]);
    let s = store(vec![server.url()]);
    // 8 tenants' 64 blocks of 8 KiB: 4 MiB, twice what the server may hold.
    for round in 0..8u64 {
        assert_eq!(s.write(round, &puts(64, round as u8)), 64);
        assert!(s.flush(FLUSH));
    }
    let c = s.counts();
    assert!(c.writes_refused > 0, "{c:?}");
    assert_eq!(c.writes + c.writes_refused, 8 * 64, "{c:?}");
    assert!(c.up && c.outages == 0, "OOM is not an outage: {c:?}");
    // What was stored is still served.
    assert_eq!(s.lookup(0, &hashes(64)), 64);
    check_blocks(&s.read(0, &hashes(64)), 64, 0);
}

#[test]
fn a_password_is_used_and_every_block_has_its_ttl() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&["--requirepass", "s3cret"]);
    let without = store(vec![server.url()]);
    assert_eq!(without.write(0, &puts(2, 6)), 2);
    assert!(without.flush(FLUSH));
    let c = without.counts();
    assert_eq!(c.writes, 0, "written without the password: {c:?}");
    assert_eq!(c.writes_refused + c.writes_dropped_down, 2, "{c:?}");
    let mut o = options(vec![server.url()]);
    o.password = Some("s3cret".into());
    o.ttl = Some(Duration::from_secs(120));
    let with = SharedStore::open(o, FINGERPRINT, PAYLOAD).unwrap();
    assert_eq!(with.write(0, &puts(2, 6)), 2);
    assert!(with.flush(FLUSH));
    assert_eq!(with.counts().writes, 2);
    assert_eq!(with.lookup(0, &hashes(2)), 2);
    let mut con = redis::Client::open(format!("redis://:s3cret@127.0.0.1:{}", server.port))
        .unwrap()
        .get_connection()
        .unwrap();
    for h in hashes(2) {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(block_key("kvbm", FINGERPRINT, 0, h))
            .query(&mut con)
            .unwrap();
        assert!(ttl > 0 && ttl <= 120_000, "{ttl}");
    }
}

#[test]
fn a_cluster_of_three_masters_shares_blocks_across_its_slots() {
    if !redis_server::available() {
        return;
    }
    let cluster = Cluster::start();
    let first = store(cluster.urls());
    // A second node knows only one seed.
    let mut o = options(vec![cluster.urls()[1].clone()]);
    o.cluster = true;
    let second = SharedStore::open(o, FINGERPRINT, PAYLOAD).unwrap();
    assert_eq!(first.write(0, &puts(48, 7)), 48);
    assert!(first.flush(FLUSH));
    assert_eq!(first.counts().writes, 48, "{:?}", first.counts());
    assert_eq!(second.lookup(0, &hashes(48)), 48);
    check_blocks(&second.read(0, &hashes(48)), 48, 7);
    // The keys are spread over the masters (no hash tag pins a prefix to one node).
    let holding = cluster
        .nodes
        .iter()
        .filter(|n| {
            redis_server::ask(n.port, None, "DBSIZE")
                .trim_start_matches(':')
                .parse::<u64>()
                .unwrap_or(0)
                > 0
        })
        .count();
    assert_eq!(holding, 3);
}

/// `CLUSTER` subcommand `args` on `node`, through a plain (non-cluster) connection.
fn cluster_cmd<T: redis::FromRedisValue>(node: &Server, args: &[&str]) -> T {
    let mut cmd = redis::cmd("CLUSTER");
    for a in args {
        cmd.arg(*a);
    }
    cmd.query(&mut raw(node))
        .unwrap_or_else(|e| panic!("CLUSTER {args:?} on {}: {e}", node.port))
}

#[test]
fn a_resharding_cluster_is_followed_through_ask_and_moved() {
    if !redis_server::available() {
        return;
    }
    let cluster = Cluster::start();
    let s = store(cluster.urls());
    assert_eq!(s.write(0, &puts(48, 9)), 48);
    assert!(s.flush(FLUSH));
    // The client has learnt the slot map.
    check_blocks(&s.read(0, &hashes(48)), 48, 9);
    let key = |i: u64| block_key("kvbm", FINGERPRINT, 0, identity(i).sequence_hash);
    let slot: i64 = cluster_cmd(&cluster.nodes[0], &["KEYSLOT", &key(0)]);
    let slot = slot.to_string();
    let from = cluster
        .nodes
        .iter()
        .position(|n| cluster_cmd::<i64>(n, &["COUNTKEYSINSLOT", &slot]) > 0)
        .expect("a node holds block 0's slot");
    let to = (from + 1) % 3;
    let (a, b) = (&cluster.nodes[from], &cluster.nodes[to]);
    let id_a: String = cluster_cmd(a, &["MYID"]);
    let id_b: String = cluster_cmd(b, &["MYID"]);
    // Halfway through a migration of the slot: block 0's key has moved, any other key of the
    // slot has not. The old owner answers ASK for the moved key; the client must follow it
    // (ASKING) to the new owner without taking the tier out.
    let _: () = cluster_cmd(b, &["SETSLOT", &slot, "IMPORTING", &id_a]);
    let _: () = cluster_cmd(a, &["SETSLOT", &slot, "MIGRATING", &id_b]);
    let migrate = |k: &str| {
        let _: () = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(b.port)
            .arg(k)
            .arg(0)
            .arg(5000)
            .query(&mut raw(a))
            .unwrap_or_else(|e| panic!("MIGRATE {k}: {e}"));
    };
    let held: i64 = cluster_cmd(a, &["COUNTKEYSINSLOT", &slot]);
    migrate(&key(0));
    assert_eq!(cluster_cmd::<i64>(a, &["COUNTKEYSINSLOT", &slot]), held - 1);
    assert_eq!(cluster_cmd::<i64>(b, &["COUNTKEYSINSLOT", &slot]), 1);
    assert_eq!(s.lookup(0, &hashes(48)), 48, "{:?}", s.counts());
    check_blocks(&s.read(0, &hashes(48)), 48, 9);
    // The migration ends: the rest of the slot's keys move and every node names the new
    // owner. The client's map is now stale: the old owner answers MOVED.
    let rest: Vec<String> = cluster_cmd(a, &["GETKEYSINSLOT", &slot, "1000"]);
    for k in &rest {
        migrate(k);
    }
    for n in &cluster.nodes {
        let _: () = cluster_cmd(n, &["SETSLOT", &slot, "NODE", &id_b]);
    }
    assert_eq!(cluster_cmd::<i64>(a, &["COUNTKEYSINSLOT", &slot]), 0);
    assert!(cluster_cmd::<i64>(b, &["COUNTKEYSINSLOT", &slot]) >= 1);
    assert_eq!(s.lookup(0, &hashes(48)), 48, "{:?}", s.counts());
    check_blocks(&s.read(0, &hashes(48)), 48, 9);
    // New writes into the moved slot land at its new owner.
    let before: i64 = cluster_cmd(b, &["COUNTKEYSINSLOT", &slot]);
    let _: () = redis::cmd("DEL").arg(key(0)).query(&mut raw(b)).unwrap();
    assert_eq!(s.write(0, &puts(1, 9)), 1);
    assert!(s.flush(FLUSH));
    assert_eq!(cluster_cmd::<i64>(b, &["COUNTKEYSINSLOT", &slot]), before);
    check_blocks(&s.read(0, &hashes(48)), 48, 9);
    let c = s.counts();
    assert!(c.up && c.outages == 0, "{c:?}");
    assert_eq!(
        (c.read_refused, c.writes_refused, c.read_missing),
        (0, 0, 0),
        "{c:?}"
    );
}

#[test]
fn writes_past_the_batches_in_flight_are_dropped_and_counted_never_waited_for() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let mut o = options(vec![server.url()]);
    o.writes_in_flight = 1;
    o.write_batch_blocks = 4;
    let s = SharedStore::open(o, FINGERPRINT, PAYLOAD).unwrap();
    // A first write, answered, so that the connection is up before the server stops.
    assert_eq!(s.write(0, &puts(4, 7)), 4);
    assert!(s.flush(FLUSH));
    // Stopped, the server cannot answer the first batch before the later ones are offered (a
    // fast answer would otherwise free the slot and nothing would be dropped).
    server.signal("STOP");
    let queued = s.write(0, &puts(64, 8));
    server.signal("CONT");
    assert!(s.flush(FLUSH));
    let c = s.counts();
    // The first batch goes; with it in flight every later one is dropped, so that what is
    // written stays a prefix (a block after a hole could never be found).
    assert_eq!(queued, 4);
    assert_eq!(c.writes, 4 + queued as u64);
    assert_eq!(c.writes_dropped_busy, 64 - queued as u64);
}

/// A hung server (SIGSTOP: connections stay open, nothing answers) is the case a bound must
/// cover: each call returns within its own bound (lookup 500 ms, read 1 s here, plus a generous
/// margin for a loaded machine), writes return at once, and the tier serves again once the
/// server resumes.
#[test]
fn a_hung_server_never_holds_a_call_past_its_bound() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start(&[]);
    let s = store(vec![server.url()]);
    assert_eq!(s.write(0, &puts(4, 9)), 4);
    assert!(s.flush(FLUSH));
    assert_eq!(s.lookup(0, &hashes(4)), 4);
    server.signal("STOP");
    let margin = Duration::from_secs(2);
    // One late lookup is a busy server (a miss); LATE_LOOKUPS_MAX in a row take the tier out,
    // so that requests stop paying the lookup's timeout.
    for i in 1..=kvbm_core::shared::store::LATE_LOOKUPS_MAX {
        assert_eq!(s.lookup(0, &hashes(4)), 0);
        let c = s.counts();
        let last = i == kvbm_core::shared::store::LATE_LOOKUPS_MAX;
        assert_eq!(
            (c.outages, c.up),
            (u64::from(last), !last),
            "after {i}: {c:?}"
        );
    }
    for _ in 0..3 {
        let t = Instant::now();
        assert_eq!(s.lookup(0, &hashes(4)), 0);
        assert!(
            t.elapsed() < s.options().lookup_timeout + margin,
            "lookup took {:?}",
            t.elapsed()
        );
        let t = Instant::now();
        assert!(s.read(0, &hashes(4)).iter().all(Option::is_none));
        assert!(
            t.elapsed() < s.options().read_timeout + margin,
            "read took {:?}",
            t.elapsed()
        );
        let t = Instant::now();
        s.write(0, &puts(4, 9));
        assert!(t.elapsed() < margin, "write took {:?}", t.elapsed());
    }
    let c = s.counts();
    assert!(c.timeouts >= 1, "{c:?}");
    server.signal("CONT");
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.lookup(0, &hashes(4)) != 4 {
        assert!(
            Instant::now() < deadline,
            "the tier did not come back: {:?}",
            s.counts()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    check_blocks(&s.read(0, &hashes(4)), 4, 9);
}
