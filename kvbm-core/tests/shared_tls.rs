//! The shared tier over TLS (`rediss://`) against real `redis-server`s started with TLS ports
//! and the test certificates in tests/data/tls: options come from the `DYN_KVBM_SHARED_*`
//! variables as a user sets them; a prefix written by one node is read byte-exact by another
//! through a server that authenticates its clients; a server whose certificate chains to another
//! authority, or a client without a certificate where one is required, gets nothing and
//! plants nothing; and the same sharing through a three-master cluster whose nodes speak TLS.

mod redis_server;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvbm_core::config::{
    shared_options, SHARED_TLS_CA_FILE, SHARED_TLS_CERT_FILE, SHARED_TLS_KEY_FILE, SHARED_URL,
};
use kvbm_core::shared::store::{SharedBlock, SharedPut};
use kvbm_core::shared::{SharedOptions, SharedStore};
use kvbm_core::{BlockIdentity, SequenceHash};
use redis_server::{tls_file, Cluster, Server};

const PAYLOAD: usize = 8192;
const FINGERPRINT: u64 = 0x7153_f00d;
const FLUSH: Duration = Duration::from_secs(10);

fn identity(i: u64) -> BlockIdentity {
    BlockIdentity {
        sequence_hash: SequenceHash(0x2000 + i),
        parent: (i > 0).then(|| SequenceHash(0x2000 + i - 1)),
        tokens: (0..16u32)
            .map(|t| t + 16 * i as u32)
            .collect::<Vec<_>>()
            .into(),
        lora_name: None,
        group: None,
    }
}

fn payload(i: u64) -> Arc<[u8]> {
    (0..PAYLOAD)
        .map(|b| (b as u64 * 37 + i * 11 + 3) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn puts(n: u64) -> Vec<SharedPut> {
    (0..n)
        .map(|i| SharedPut {
            identity: identity(i),
            payload: payload(i),
        })
        .collect()
}

fn hashes(n: u64) -> Vec<SequenceHash> {
    (0..n).map(|i| identity(i).sequence_hash).collect()
}

fn check_blocks(got: &[Option<SharedBlock>], n: u64) {
    assert_eq!(got.len(), n as usize);
    for (i, b) in got.iter().enumerate() {
        let b = b.as_ref().unwrap_or_else(|| panic!("block {i} missing"));
        assert_eq!(b.identity, identity(i as u64));
        assert_eq!(b.payload(), &payload(i as u64)[..], "block {i}");
    }
}

/// Options read from the environment variables `vars`, as the connector reads them.
fn from_env(vars: &[(&str, String)]) -> SharedOptions {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let mut o = shared_options(&|k: &str| map.get(k).cloned())
        .expect("valid options")
        .expect("a shared tier");
    o.lookup_timeout = Duration::from_millis(1000);
    o.connect_timeout = Duration::from_millis(2000);
    o.write_batch_blocks = 8;
    o.writes_in_flight = 16;
    o
}

fn file(name: &str) -> String {
    tls_file(name).display().to_string()
}

/// The variables for `url`, trusting `ca`, with the client certificate when `client`.
fn vars(url: String, ca: &str, client: bool) -> Vec<(&'static str, String)> {
    let mut v = vec![(SHARED_URL, url), (SHARED_TLS_CA_FILE, file(ca))];
    if client {
        v.push((SHARED_TLS_CERT_FILE, file("client.pem")));
        v.push((SHARED_TLS_KEY_FILE, file("client.key")));
    }
    v
}

fn keys_on(server: &Server) -> u64 {
    redis_server::ask(server.port, None, "DBSIZE")
        .trim_start_matches(':')
        .parse()
        .expect("DBSIZE")
}

#[test]
fn a_prefix_written_over_tls_is_read_byte_exact_by_another_node() {
    if !redis_server::available() {
        return;
    }
    // The server asks every client for a certificate from the test CA.
    let server = Server::start_tls(true, &[]);
    let first = SharedStore::open(
        from_env(&vars(server.tls_url(), "ca.pem", true)),
        FINGERPRINT,
        PAYLOAD,
    )
    .unwrap();
    assert_eq!(first.write(0, &puts(32)), 32);
    assert!(first.flush(FLUSH));
    assert_eq!(first.counts().writes, 32, "{:?}", first.counts());
    // Nothing travelled in the clear: the blocks are on the server under the tier's keys.
    assert_eq!(keys_on(&server), 32);
    // Another node: its own client, runtime and TLS session.
    let second = SharedStore::open(
        from_env(&vars(server.tls_url(), "ca.pem", true)),
        FINGERPRINT,
        PAYLOAD,
    )
    .unwrap();
    assert_eq!(second.lookup(0, &hashes(32)), 32);
    check_blocks(&second.read(0, &hashes(32)), 32);
    assert!(second.counts().up);
}

#[test]
fn an_unverified_server_or_a_client_without_its_certificate_gets_nothing_and_plants_nothing() {
    if !redis_server::available() {
        return;
    }
    let server = Server::start_tls(true, &[]);
    // A server whose certificate chains to another authority than the one trusted.
    let wrong_ca = SharedStore::open(
        from_env(&vars(server.tls_url(), "other-ca.pem", true)),
        FINGERPRINT,
        PAYLOAD,
    )
    .unwrap();
    // A client the server cannot authenticate.
    let no_cert = SharedStore::open(
        from_env(&vars(server.tls_url(), "ca.pem", false)),
        FINGERPRINT,
        PAYLOAD,
    )
    .unwrap();
    for s in [&wrong_ca, &no_cert] {
        s.write(0, &puts(8));
        s.flush(FLUSH);
        assert_eq!(s.lookup(0, &hashes(8)), 0);
        assert!(s.read(0, &hashes(8)).iter().all(Option::is_none));
        let c = s.counts();
        assert_eq!(c.writes, 0, "{c:?}");
        assert_eq!(c.read_hits, 0, "{c:?}");
    }
    assert_eq!(keys_on(&server), 0, "nothing was written");
    // The same server serves a client that shows its certificate and trusts the right CA.
    let good = SharedStore::open(
        from_env(&vars(server.tls_url(), "ca.pem", true)),
        FINGERPRINT,
        PAYLOAD,
    )
    .unwrap();
    assert_eq!(good.write(0, &puts(8)), 8);
    assert!(good.flush(FLUSH));
    assert_eq!(good.lookup(0, &hashes(8)), 8);
    // And the refused clients still see nothing.
    assert_eq!(wrong_ca.lookup(0, &hashes(8)), 0);
    assert_eq!(no_cert.lookup(0, &hashes(8)), 0);
}

#[test]
fn a_tls_cluster_of_three_masters_shares_blocks_across_its_slots() {
    if !redis_server::available() {
        return;
    }
    let cluster = Cluster::start_tls();
    let mut all = vars(cluster.tls_urls().join(","), "ca.pem", false);
    all.retain(|(k, _)| *k != SHARED_URL);
    all.push((SHARED_URL, cluster.tls_urls().join(",")));
    let first = SharedStore::open(from_env(&all), FINGERPRINT, PAYLOAD).unwrap();
    assert!(first.options().cluster);
    // A second node knows only one seed.
    let one = vec![
        (SHARED_URL, cluster.tls_urls()[2].clone()),
        (SHARED_TLS_CA_FILE, file("ca.pem")),
        (kvbm_core::config::SHARED_CLUSTER, "1".to_owned()),
    ];
    let second = SharedStore::open(from_env(&one), FINGERPRINT, PAYLOAD).unwrap();
    assert_eq!(first.write(0, &puts(48)), 48);
    assert!(first.flush(FLUSH));
    assert_eq!(first.counts().writes, 48, "{:?}", first.counts());
    assert_eq!(second.lookup(0, &hashes(48)), 48);
    check_blocks(&second.read(0, &hashes(48)), 48);
    let holding = cluster.nodes.iter().filter(|n| keys_on(n) > 0).count();
    assert_eq!(holding, 3, "the keys are spread over the masters");
}
