//! The shared tier's formats and configuration, without a server: keys keep models, layouts and
//! tenants apart; a stored value round-trips and any change to it (a flipped byte anywhere, a
//! cut at any length, another block's or layout's or tenant's value) is refused with a reason;
//! `DYN_KVBM_SHARED_*` parse, and every bad value names its variable without echoing a
//! password.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvbm_core::config::shared_options;
use kvbm_core::shared::{
    block_key, decode_value, encode_value, redact_url, shard_fingerprint, tenant_id, BadValue,
    SharedOptions, SharedTls, ValueFor, VALUE_HEADER_BYTES,
};
use kvbm_core::{BlockIdentity, ConfigError, SequenceHash};
use proptest::prelude::*;

fn identity(hash: u64, lora: Option<&str>) -> BlockIdentity {
    BlockIdentity {
        sequence_hash: SequenceHash(hash),
        parent: Some(SequenceHash(hash ^ 0x55)),
        tokens: (0..16u32)
            .map(|t| t * 7 + hash as u32)
            .collect::<Vec<_>>()
            .into(),
        lora_name: lora.map(Arc::from),
        group: None,
    }
}

fn want(fingerprint: u64, tenant: u64, hash: u64, payload_bytes: usize) -> ValueFor {
    ValueFor {
        fingerprint,
        tenant,
        hash: SequenceHash(hash),
        payload_bytes,
    }
}

#[test]
fn a_value_round_trips_with_its_identity() {
    let payload: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
    let id = identity(42, Some("adapter"));
    let value = encode_value(7, 9, &id, &payload);
    let (back, bytes) = decode_value(&value, want(7, 9, 42, 1000)).unwrap();
    assert_eq!(back, id);
    assert_eq!(bytes, &payload[..]);
}

#[test]
fn a_value_for_another_layout_tenant_block_or_size_is_refused() {
    let payload = vec![3u8; 256];
    let value = encode_value(7, 9, &identity(42, None), &payload);
    assert_eq!(
        decode_value(&value, want(8, 9, 42, 256)).unwrap_err(),
        BadValue::Mismatch
    );
    assert_eq!(
        decode_value(&value, want(7, 10, 42, 256)).unwrap_err(),
        BadValue::Mismatch
    );
    assert_eq!(
        decode_value(&value, want(7, 9, 43, 256)).unwrap_err(),
        BadValue::Mismatch
    );
    assert_eq!(
        decode_value(&value, want(7, 9, 42, 512)).unwrap_err(),
        BadValue::Length
    );
    let mut longer = value.clone();
    longer.push(0);
    assert_eq!(
        decode_value(&longer, want(7, 9, 42, 256)).unwrap_err(),
        BadValue::Length
    );
    assert_eq!(
        decode_value(b"hello", want(7, 9, 42, 256)).unwrap_err(),
        BadValue::Foreign
    );
    assert_eq!(
        decode_value(&[0u8; 200], want(7, 9, 42, 256)).unwrap_err(),
        BadValue::Foreign
    );
    let mut other_version = value.clone();
    other_version[8] = 2;
    assert_eq!(
        decode_value(&other_version, want(7, 9, 42, 256)).unwrap_err(),
        BadValue::Foreign
    );
}

proptest! {
    /// Any single flipped byte after the magic and version is refused (checksum, or a header
    /// field that no longer matches); a value cut at any length is refused.
    #[test]
    fn any_flipped_byte_or_cut_is_refused(
        pos in 12usize..(VALUE_HEADER_BYTES + 100 + 128),
        bit in 0u8..8,
        cut in 0usize..(VALUE_HEADER_BYTES + 100 + 128),
        seed in any::<u8>(),
    ) {
        let payload: Vec<u8> = (0..128u32).map(|i| (i as u8).wrapping_mul(seed | 1)).collect();
        let value = encode_value(1, 2, &identity(5, None), &payload);
        let w = want(1, 2, 5, 128);
        prop_assert!(decode_value(&value, w).is_ok());
        let pos = pos % value.len();
        let mut flipped = value.clone();
        flipped[pos] ^= 1 << bit;
        prop_assert!(decode_value(&flipped, w).is_err(), "flip at {}", pos);
        let cut = cut % value.len();
        prop_assert!(decode_value(&value[..cut], w).is_err(), "cut at {}", cut);
    }
}

#[test]
fn keys_and_tenants_keep_everyone_apart() {
    assert_eq!(tenant_id(None, None), 0);
    let a = tenant_id(Some("lora-a"), None);
    let b = tenant_id(None, Some("lora-a"));
    let c = tenant_id(Some("lora-a"), Some("salt"));
    let d = tenant_id(Some("lora-a"), Some("salt2"));
    // The adapter and the salt are tagged: the same string in either place is another tenant,
    // and no split of one string moves between them.
    let e = tenant_id(Some("ab"), Some("c"));
    let f = tenant_id(Some("a"), Some("bc"));
    let all = [a, b, c, d, e, f];
    for (i, x) in all.iter().enumerate() {
        assert_ne!(*x, 0);
        for y in &all[i + 1..] {
            assert_ne!(x, y);
        }
    }
    assert_eq!(tenant_id(Some("lora-a"), Some("salt")), c);
    // Each tensor-parallel rank's shard, and each split, is a fingerprint of its own.
    let shards = [
        shard_fingerprint(7, 0, 1),
        shard_fingerprint(7, 0, 2),
        shard_fingerprint(7, 1, 2),
        shard_fingerprint(8, 0, 1),
    ];
    for (i, x) in shards.iter().enumerate() {
        for y in &shards[i + 1..] {
            assert_ne!(x, y);
        }
    }
    assert_eq!(shard_fingerprint(7, 1, 2), shards[2]);
    assert_eq!(
        block_key("kvbm", 0xabc, 1, SequenceHash(0xff)),
        "kvbm:0000000000000abc:0000000000000001:00000000000000ff"
    );
}

#[test]
fn urls_are_shown_without_their_password() {
    assert_eq!(redact_url("redis://:secret@h:1"), "redis://:***@h:1");
    assert_eq!(
        redact_url("redis://user:secret@h:1/0"),
        "redis://user:***@h:1/0"
    );
    assert_eq!(redact_url("redis://token@h:1"), "redis://***@h:1");
    assert_eq!(redact_url("redis://h:1"), "redis://h:1");
    assert_eq!(
        redact_url("redis+unix:///tmp/r.sock?db=1&pass=secret"),
        "redis+unix:///tmp/r.sock?db=1&pass=***"
    );
    assert_eq!(
        redact_url("redis://u:secret@h:1/0?password=other"),
        "redis://u:***@h:1/0?password=***"
    );
    let mut o = SharedOptions::new(vec!["redis://:secret@h:1".into()]);
    o.password = Some("hunter2".into());
    let shown = format!("{o:?}");
    assert!(
        !shown.contains("secret") && !shown.contains("hunter2"),
        "{shown}"
    );
}

fn shared(vars: &[(&str, &str)]) -> Result<Option<SharedOptions>, ConfigError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    shared_options(&|name: &str| map.get(name).cloned())
}

#[test]
fn shared_tier_settings_parse() {
    assert_eq!(shared(&[]).unwrap(), None);
    assert_eq!(shared(&[("DYN_KVBM_SHARED_URL", " ")]).unwrap(), None);
    let o = shared(&[("DYN_KVBM_SHARED_URL", "redis://127.0.0.1:6379")])
        .unwrap()
        .unwrap();
    assert!(!o.cluster);
    assert_eq!(o.ttl, Some(Duration::from_secs(3600)));
    assert_eq!(o.key_prefix, "kvbm");
    let o = shared(&[
        (
            "DYN_KVBM_SHARED_URL",
            "redis://a:7000, redis://b:7001,redis://c:7002",
        ),
        ("DYN_KVBM_SHARED_PASSWORD", "pw"),
        ("DYN_KVBM_SHARED_KEY_PREFIX", "team-a"),
        ("DYN_KVBM_SHARED_TTL_SECS", "0"),
        ("DYN_KVBM_SHARED_LOOKUP_TIMEOUT_MS", "5"),
        ("DYN_KVBM_SHARED_READ_TIMEOUT_MS", "250"),
        ("DYN_KVBM_SHARED_WRITE_TIMEOUT_MS", "750"),
        ("DYN_KVBM_SHARED_CONNECT_TIMEOUT_MS", "100"),
        ("DYN_KVBM_SHARED_WRITE_BATCH_BLOCKS", "8"),
        ("DYN_KVBM_SHARED_WRITES_IN_FLIGHT", "2"),
    ])
    .unwrap()
    .unwrap();
    assert!(o.cluster);
    assert_eq!(o.urls.len(), 3);
    assert_eq!(o.urls[1], "redis://b:7001");
    assert_eq!(o.password.as_deref(), Some("pw"));
    assert_eq!(o.key_prefix, "team-a");
    assert_eq!(o.ttl, None);
    assert_eq!(o.lookup_timeout, Duration::from_millis(5));
    assert_eq!(o.read_timeout, Duration::from_millis(250));
    assert_eq!(o.write_timeout, Duration::from_millis(750));
    assert_eq!(o.connect_timeout, Duration::from_millis(100));
    assert_eq!((o.write_batch_blocks, o.writes_in_flight), (8, 2));
    let one_seed = shared(&[
        ("DYN_KVBM_SHARED_URL", "redis://a:7000"),
        ("DYN_KVBM_SHARED_CLUSTER", "1"),
    ])
    .unwrap()
    .unwrap();
    assert!(one_seed.cluster);
    assert_eq!(one_seed.tls, None);
}

fn tls_data(name: &str) -> String {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tls")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn tls_settings_read_their_files_and_name_what_is_wrong() {
    // rediss:// alone trusts the system's roots and shows no certificate.
    let o = shared(&[("DYN_KVBM_SHARED_URL", "rediss://cache.example:6380")])
        .unwrap()
        .unwrap();
    assert_eq!(o.tls, Some(SharedTls::default()));
    let (ca, cert, key) = (
        tls_data("ca.pem"),
        tls_data("client.pem"),
        tls_data("client.key"),
    );
    let o = shared(&[
        ("DYN_KVBM_SHARED_URL", "rediss://a:1,rediss://b:2"),
        ("DYN_KVBM_SHARED_TLS_CA_FILE", &ca),
        ("DYN_KVBM_SHARED_TLS_CERT_FILE", &cert),
        ("DYN_KVBM_SHARED_TLS_KEY_FILE", &key),
    ])
    .unwrap()
    .unwrap();
    let tls = o.tls.clone().unwrap();
    assert_eq!(tls.ca.as_deref(), Some(&std::fs::read(&ca).unwrap()[..]));
    let (c, k) = tls.client.unwrap();
    assert_eq!(c, std::fs::read(&cert).unwrap());
    assert_eq!(k, std::fs::read(&key).unwrap());
    // The key never reaches a log line.
    let shown = format!("{o:?}");
    assert!(!shown.contains("PRIVATE"), "{shown}");
    let err = |vars: &[(&str, &str)]| shared(vars).unwrap_err().to_string();
    let starts = |text: String, var: &str| {
        assert!(text.starts_with(&format!("{var}=")), "{text}");
        text
    };
    // TLS files without a TLS server.
    starts(
        err(&[
            ("DYN_KVBM_SHARED_URL", "redis://h:1"),
            ("DYN_KVBM_SHARED_TLS_CA_FILE", &ca),
        ]),
        "DYN_KVBM_SHARED_TLS_CA_FILE",
    );
    // A file that is not there, and one that holds no certificate.
    let text = starts(
        err(&[
            ("DYN_KVBM_SHARED_URL", "rediss://h:1"),
            ("DYN_KVBM_SHARED_TLS_CA_FILE", "/nonexistent/ca.pem"),
        ]),
        "DYN_KVBM_SHARED_TLS_CA_FILE",
    );
    assert!(text.contains("cannot read"), "{text}");
    let text = starts(
        err(&[
            ("DYN_KVBM_SHARED_URL", "rediss://h:1"),
            ("DYN_KVBM_SHARED_TLS_CA_FILE", &key),
        ]),
        "DYN_KVBM_SHARED_TLS_CA_FILE",
    );
    assert!(text.contains("no PEM certificate"), "{text}");
    starts(
        err(&[
            ("DYN_KVBM_SHARED_URL", "rediss://h:1"),
            ("DYN_KVBM_SHARED_TLS_KEY_FILE", &cert),
            ("DYN_KVBM_SHARED_TLS_CERT_FILE", &cert),
        ]),
        "DYN_KVBM_SHARED_TLS_KEY_FILE",
    );
    // A certificate without its key, and a key without its certificate.
    starts(
        err(&[
            ("DYN_KVBM_SHARED_URL", "rediss://h:1"),
            ("DYN_KVBM_SHARED_TLS_CERT_FILE", &cert),
        ]),
        "DYN_KVBM_SHARED_TLS_CERT_FILE",
    );
    starts(
        err(&[
            ("DYN_KVBM_SHARED_URL", "rediss://h:1"),
            ("DYN_KVBM_SHARED_TLS_KEY_FILE", &key),
        ]),
        "DYN_KVBM_SHARED_TLS_KEY_FILE",
    );
}

#[test]
fn bad_shared_tier_settings_name_the_variable_and_hide_passwords() {
    let url = |u: &str| shared(&[("DYN_KVBM_SHARED_URL", u)]).unwrap_err();
    for bad in [
        "http://h:1",
        "h:6379",
        "redis://h:1,,redis://g:2",
        "redis://:secret@h:notaport",
        // No certificate check is not on offer.
        "rediss://:secret@h:1/#insecure",
        // One cluster, one way of reaching it.
        "rediss://a:1,redis://b:2",
    ] {
        let e = url(bad);
        let text = e.to_string();
        assert!(text.starts_with("DYN_KVBM_SHARED_URL="), "{text}");
        assert!(!text.contains("secret"), "{text}");
    }
    let with = |var: &str, v: &str| {
        shared(&[("DYN_KVBM_SHARED_URL", "redis://h:1"), (var, v)])
            .unwrap_err()
            .to_string()
    };
    for (var, v) in [
        ("DYN_KVBM_SHARED_TTL_SECS", "-1"),
        ("DYN_KVBM_SHARED_TTL_SECS", "1h"),
        ("DYN_KVBM_SHARED_TTL_SECS", "99999999999"),
        ("DYN_KVBM_SHARED_LOOKUP_TIMEOUT_MS", "0"),
        ("DYN_KVBM_SHARED_READ_TIMEOUT_MS", "fast"),
        ("DYN_KVBM_SHARED_WRITE_BATCH_BLOCKS", "0"),
        ("DYN_KVBM_SHARED_WRITES_IN_FLIGHT", "1000"),
        ("DYN_KVBM_SHARED_KEY_PREFIX", "has space"),
        ("DYN_KVBM_SHARED_KEY_PREFIX", "{tag}"),
        ("DYN_KVBM_SHARED_KEY_PREFIX", ""),
        ("DYN_KVBM_SHARED_CLUSTER", "maybe"),
    ] {
        let text = with(var, v);
        assert!(text.starts_with(&format!("{var}=")), "{var}={v}: {text}");
    }
    // Several servers are a cluster: saying otherwise is an error.
    let e = shared(&[
        ("DYN_KVBM_SHARED_URL", "redis://a:1,redis://b:2"),
        ("DYN_KVBM_SHARED_CLUSTER", "0"),
    ])
    .unwrap_err();
    assert!(e.to_string().starts_with("DYN_KVBM_SHARED_CLUSTER="), "{e}");
    // The whole configuration reads it too.
    let map: HashMap<&str, &str> = [
        ("DYN_KVBM_CPU_CACHE_GB", "1"),
        ("DYN_KVBM_SHARED_URL", "ftp://x"),
    ]
    .into_iter()
    .collect();
    let e = kvbm_core::KvbmConfig::from_lookup(|n| map.get(n).map(|v| v.to_string()), 1 << 40)
        .unwrap_err();
    assert!(e.to_string().starts_with("DYN_KVBM_SHARED_URL="), "{e}");
}
