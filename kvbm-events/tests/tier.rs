//! Tier medium names: what we publish and what we accept.

use kvbm_events::Tier;

#[test]
fn published_names_round_trip() {
    for tier in Tier::ALL {
        assert_eq!(Tier::from_medium_name(tier.medium_name()), Ok(tier));
    }
}

#[test]
fn other_engines_names_map_to_tiers() {
    let cases = [
        ("GPU", Some(Tier::Gpu)),
        ("DEVICE", Some(Tier::Gpu)),
        ("cpu", Some(Tier::Host)),
        ("CPU_PINNED", Some(Tier::Host)),
        ("CPU_TIER1", Some(Tier::Host)),
        // Dynamo KVBM's second CPU tier is its disk tier (the wire vectors' medium table).
        ("CPU_TIER2", Some(Tier::Disk)),
        ("DISK", Some(Tier::Disk)),
        ("STORAGE", Some(Tier::Disk)),
        ("NVME", Some(Tier::Disk)),
        ("EXTERNAL", None),
        ("NETWORK", None),
        ("REMOTE", None),
        ("SHARED", None),
        ("", None),
        ("TAPE", None),
    ];
    for (name, expected) in cases {
        assert_eq!(
            Tier::from_medium_name(name).ok(),
            expected,
            "medium {name:?}"
        );
    }
}
