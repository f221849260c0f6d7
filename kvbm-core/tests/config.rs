//! Configuration from Dynamo's variable names: defaults, overrides, and every error.

use std::collections::HashMap;

use kvbm_core::{ConfigError, KvbmConfig, TierSize};

const MEMORY: u64 = 24_000_000_000;

fn load(vars: &[(&str, &str)]) -> Result<KvbmConfig, ConfigError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    KvbmConfig::from_lookup(|name| map.get(name).cloned(), MEMORY)
}

#[test]
fn defaults_and_sizes() {
    let c = load(&[("DYN_KVBM_CPU_CACHE_GB", "4")]).unwrap();
    assert_eq!(c.host, TierSize::Bytes(4_000_000_000));
    assert_eq!(c.disk, TierSize::Bytes(0));
    assert_eq!(c.transfer_batch_blocks_max.get(), 16);
    assert_eq!(c.transfers_inflight_max.get(), 4);
    assert_eq!(c.metrics_port, None);
    assert_eq!(c.log_filter, "info");
    // GB is 10^9 bytes, split across ranks, floored to whole blocks.
    assert_eq!(c.host.blocks(1_000_000, 1), 4000);
    assert_eq!(c.host.blocks(1_000_000, 2), 2000);
    assert_eq!(TierSize::Bytes(2_500_000).blocks(1_000_000, 1), 2);
}

#[test]
fn overrides_win_and_other_settings_parse() {
    let c = load(&[
        ("DYN_KVBM_CPU_CACHE_GB", "4"),
        ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "123"),
        ("DYN_KVBM_DISK_CACHE_GB", "0.5"),
        ("DYN_KVBM_MAX_TRANSFER_BATCH_SIZE", "32"),
        ("DYN_KVBM_MAX_CONCURRENT_TRANSFERS", "8"),
        ("DYN_KVBM_METRICS", "1"),
        ("DYN_KVBM_METRICS_PORT", "9100"),
        ("DYN_LOG", "debug"),
    ])
    .unwrap();
    assert_eq!(c.host, TierSize::Blocks(123));
    assert_eq!(c.host.blocks(1_000_000, 4), 123);
    assert_eq!(c.disk, TierSize::Bytes(500_000_000));
    assert_eq!(c.transfer_batch_blocks_max.get(), 32);
    assert_eq!(c.transfers_inflight_max.get(), 8);
    assert_eq!(c.metrics_port, Some(9100));
    assert_eq!(c.log_filter, "debug");
    assert_eq!(c.disk_dir, kvbm_core::config::default_disk_dir());
    assert!(c.disk_dir.starts_with(std::env::temp_dir()) && c.disk_dir != std::env::temp_dir());
    assert!(!c.disk_disable_o_direct && !c.disk_offload_filter_disabled);
    let d = load(&[
        ("DYN_KVBM_DISK_CACHE_GB", "1"),
        ("DYN_KVBM_DISK_CACHE_DIR", "/var/cache/kvbm"),
        ("DYN_KVBM_DISK_DISABLE_O_DIRECT", "1"),
        ("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true"),
    ])
    .unwrap();
    assert_eq!(d.disk_dir, std::path::PathBuf::from("/var/cache/kvbm"));
    assert!(d.disk_disable_o_direct && d.disk_offload_filter_disabled);
    assert_eq!(d.disk_engine, kvbm_disk::EngineChoice::Auto);
    let p = load(&[
        ("DYN_KVBM_DISK_CACHE_GB", "1"),
        ("KVBM_DISK_ENGINE", "psync"),
    ])
    .unwrap();
    assert_eq!(p.disk_engine, kvbm_disk::EngineChoice::Psync);
    let z = load(&[
        ("DYN_KVBM_CPU_CACHE_GB", "1"),
        ("DYN_KVBM_KV_EVENTS_ENDPOINT", "tcp://127.0.0.1:5557"),
        ("DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT", "tcp://127.0.0.1:5558"),
    ])
    .unwrap();
    assert_eq!(
        z.kv_events_endpoint.as_deref(),
        Some("tcp://127.0.0.1:5557")
    );
    assert_eq!(
        z.kv_events_replay_endpoint.as_deref(),
        Some("tcp://127.0.0.1:5558")
    );
    assert_eq!(
        load(&[
            ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "10"),
            ("DYN_KVBM_METRICS", "true")
        ])
        .unwrap()
        .metrics_port,
        Some(6880)
    );
}

#[test]
fn both_tiers_zero_is_an_error_naming_both_variables() {
    for vars in [
        &[][..],
        &[("DYN_KVBM_CPU_CACHE_GB", "0")][..],
        &[
            ("DYN_KVBM_CPU_CACHE_GB", "4"),
            ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "0"),
        ][..],
    ] {
        let err = load(vars).unwrap_err();
        assert_eq!(err, ConfigError::NoTier);
        let text = err.to_string();
        assert!(
            text.contains("DYN_KVBM_CPU_CACHE_GB") && text.contains("DYN_KVBM_DISK_CACHE_GB"),
            "{text}"
        );
    }
}

#[test]
fn every_bad_value_names_the_variable_and_the_value() {
    let cases: &[(&str, &str)] = &[
        ("DYN_KVBM_CPU_CACHE_GB", "lots"),
        ("DYN_KVBM_CPU_CACHE_GB", "-1"),
        ("DYN_KVBM_CPU_CACHE_GB", "NaN"),
        ("DYN_KVBM_CPU_CACHE_GB", "inf"),
        ("DYN_KVBM_CPU_CACHE_GB", "25"),
        ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "-5"),
        ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "1.5"),
        ("DYN_KVBM_DISK_CACHE_GB", "-0.1"),
        ("DYN_KVBM_DISK_CACHE_GB", "nan"),
        ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "many"),
        ("DYN_KVBM_MAX_TRANSFER_BATCH_SIZE", "0"),
        ("DYN_KVBM_MAX_TRANSFER_BATCH_SIZE", "4096"),
        ("DYN_KVBM_MAX_TRANSFER_BATCH_SIZE", "x"),
        ("DYN_KVBM_MAX_CONCURRENT_TRANSFERS", "0"),
        ("DYN_KVBM_MAX_CONCURRENT_TRANSFERS", "65"),
        ("DYN_KVBM_METRICS", "maybe"),
        ("DYN_KVBM_METRICS_PORT", "0"),
        ("DYN_KVBM_METRICS_PORT", "70000"),
        ("DYN_KVBM_DISK_CACHE_DIR", " "),
        ("DYN_KVBM_DISK_DISABLE_O_DIRECT", "sometimes"),
        ("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "2"),
        ("KVBM_DISK_ENGINE", "spdk"),
        ("DYN_KVBM_KV_EVENTS_ENDPOINT", "127.0.0.1:5557"),
        ("DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT", "tcp://127.0.0.1:5558"),
    ];
    for &(variable, value) in cases {
        // A valid host size so that only the variable under test can be wrong.
        let mut vars = vec![("DYN_KVBM_CPU_CACHE_GB", "1")];
        vars.retain(|(k, _)| *k != variable);
        vars.push((variable, value));
        match load(&vars) {
            Err(ConfigError::Invalid {
                variable: v,
                value: got,
                ..
            }) => {
                assert_eq!((v, got.as_str()), (variable, value));
            }
            other => panic!("{variable}={value:?} gave {other:?}"),
        }
        let text = load(&vars).unwrap_err().to_string();
        assert!(text.contains(variable) && text.contains(value), "{text}");
    }
}

#[test]
fn tiers_that_do_not_fit_the_machine_are_refused_naming_the_variable() {
    let check = |vars: &[(&str, &str)], world: usize| {
        let c = load(vars).unwrap();
        // 10 GB of memory, 20 GB of free disk; 1 MB host blocks, 2 MB disk slots.
        c.check_fits_within(1 << 20, 2 << 20, world, 10_000_000_000, 20_000_000_000)
    };
    let refused =
        |vars: &[(&str, &str)], world: usize, variable: &str, value: &str| match check(vars, world)
        {
            Err(ConfigError::Invalid {
                variable: v,
                value: got,
                reason,
            }) => {
                assert_eq!((v, got.as_str()), (variable, value), "{reason}");
                assert!(reason.contains("do not fit"), "{reason}");
            }
            other => panic!("{vars:?} on {world} ranks: {other:?}"),
        };
    check(&[("DYN_KVBM_CPU_CACHE_GB", "8")], 1).unwrap();
    check(&[("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "9000")], 1).unwrap();
    refused(
        &[("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "20000")],
        1,
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",
        "20000",
    );
    // The override is per rank: four ranks of 5000 blocks need 20 GB.
    refused(
        &[("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "5000")],
        4,
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",
        "5000",
    );
    check(
        &[
            ("DYN_KVBM_CPU_CACHE_GB", "1"),
            ("DYN_KVBM_DISK_CACHE_GB", "19"),
        ],
        2,
    )
    .unwrap();
    refused(
        &[
            ("DYN_KVBM_CPU_CACHE_GB", "1"),
            ("DYN_KVBM_DISK_CACHE_GB", "50"),
        ],
        1,
        "DYN_KVBM_DISK_CACHE_GB",
        "50",
    );
    refused(
        &[
            ("DYN_KVBM_CPU_CACHE_GB", "1"),
            ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "100000000000000"),
        ],
        1,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS",
        "100000000000000",
    );
}

#[test]
fn copy_options_and_the_metrics_address_are_read_here_too() {
    let c = load(&[("DYN_KVBM_CPU_CACHE_GB", "1")]).unwrap();
    assert!(c.copy.coalesce && c.copy.batch_copy);
    assert_eq!(c.metrics_host.to_string(), "127.0.0.1");
    let c = load(&[
        ("DYN_KVBM_CPU_CACHE_GB", "1"),
        ("KVBM_COPY_COALESCE", "0"),
        ("KVBM_COPY_BATCH", "false"),
        ("DYN_KVBM_METRICS", "1"),
        ("DYN_KVBM_METRICS_HOST", "0.0.0.0"),
    ])
    .unwrap();
    assert!(!c.copy.coalesce && !c.copy.batch_copy);
    assert_eq!(c.metrics_host.to_string(), "0.0.0.0");
    for (var, value) in [
        ("KVBM_COPY_COALESCE", "maybe"),
        ("KVBM_COPY_BATCH", "2"),
        ("DYN_KVBM_METRICS_HOST", "localhost:80"),
    ] {
        let err = load(&[("DYN_KVBM_CPU_CACHE_GB", "1"), (var, value)]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(var) && text.contains(value), "{text}");
    }
    // The metrics server's settings read without any cache tier configured.
    let lookup = |name: &str| (name == "DYN_KVBM_METRICS").then(|| "1".to_owned());
    assert_eq!(
        kvbm_core::config::metrics_server(&lookup).unwrap(),
        Some((std::net::Ipv4Addr::LOCALHOST.into(), 6880))
    );
}
