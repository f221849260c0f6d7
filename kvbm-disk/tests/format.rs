//! The on-disk format: round trips, and every kind of damage reads as an error, never a panic.

use kvbm_disk::format::{
    payload_checksum, verify_block, BlockHeader, BlockMismatch, FormatError, Superblock,
    HEADER_BYTES,
};
use proptest::prelude::*;

fn header(key: u64, payload: &[u8], generation: u64, fingerprint: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; HEADER_BYTES];
    BlockHeader {
        key,
        payload_len: payload.len() as u64,
        payload_checksum: payload_checksum(payload),
        generation,
        fingerprint,
    }
    .encode(&mut bytes);
    bytes
}

#[test]
fn a_good_block_verifies_and_each_kind_of_damage_is_named() {
    let payload = vec![7u8; 8192];
    let good = header(42, &payload, 3, 99);
    assert_eq!(
        verify_block(&good, &payload, 42, 99, Some(3)).unwrap().key,
        42
    );
    assert!(verify_block(&good, &payload, 42, 99, None).is_ok());

    let mut flipped = payload.clone();
    flipped[5000] ^= 1;
    struct Case<'a> {
        name: &'a str,
        header: Vec<u8>,
        payload: &'a [u8],
        key: u64,
        fingerprint: u64,
        generation: Option<u64>,
        expected: BlockMismatch,
    }
    let case = |name, header: &Vec<u8>, payload, key, fingerprint, generation, expected| Case {
        name,
        header: header.clone(),
        payload,
        key,
        fingerprint,
        generation,
        expected,
    };
    let zero = vec![0u8; HEADER_BYTES];
    let cases = [
        case(
            "never written",
            &zero,
            &payload[..],
            42,
            99,
            None,
            BlockMismatch::Header(FormatError::Empty),
        ),
        case(
            "flipped payload byte",
            &good,
            &flipped[..],
            42,
            99,
            None,
            BlockMismatch::PayloadChecksum,
        ),
        case(
            "another key",
            &good,
            &payload[..],
            43,
            99,
            None,
            BlockMismatch::OtherKey,
        ),
        case(
            "foreign layout",
            &good,
            &payload[..],
            42,
            100,
            None,
            BlockMismatch::ForeignFingerprint,
        ),
        case(
            "stale generation",
            &good,
            &payload[..],
            42,
            99,
            Some(4),
            BlockMismatch::StaleGeneration,
        ),
        case(
            "short payload",
            &good,
            &payload[..4096],
            42,
            99,
            None,
            BlockMismatch::Length(8192),
        ),
    ];
    for c in cases {
        assert_eq!(
            verify_block(&c.header, c.payload, c.key, c.fingerprint, c.generation).unwrap_err(),
            c.expected,
            "{}",
            c.name
        );
    }
}

#[test]
fn superblock_round_trips_and_refuses_other_versions_and_magic() {
    let sb = Superblock {
        fingerprint: 1,
        slot_payload_bytes: 4096 * 3,
        slot_count: 10,
        epoch: 77,
    };
    let mut bytes = vec![0u8; HEADER_BYTES];
    sb.encode(&mut bytes);
    assert_eq!(Superblock::decode(&bytes), Ok(sb));
    let mut other_version = bytes.clone();
    other_version[8] = 2;
    assert_eq!(
        Superblock::decode(&other_version),
        Err(FormatError::UnsupportedVersion(2))
    );
    let mut other_magic = bytes.clone();
    other_magic[0] = b'X';
    assert_eq!(Superblock::decode(&other_magic), Err(FormatError::BadMagic));
    assert_eq!(
        Superblock::decode(&bytes[..20]),
        Err(FormatError::Truncated(20))
    );
    // A block header is not a superblock and vice versa.
    assert_eq!(BlockHeader::decode(&bytes), Err(FormatError::BadMagic));
}

proptest! {
    #[test]
    fn headers_round_trip(key: u64, len in 0u64..1 << 40, sum: u64, generation: u64, fingerprint: u64) {
        let h = BlockHeader { key, payload_len: len, payload_checksum: sum, generation, fingerprint };
        let mut bytes = vec![0u8; 64];
        h.encode(&mut bytes);
        prop_assert_eq!(BlockHeader::decode(&bytes), Ok(h));
    }

    #[test]
    fn any_flipped_bit_of_a_header_is_detected(key: u64, generation: u64, byte in 0usize..64, bit in 0u8..8) {
        let h = BlockHeader { key, payload_len: 4096, payload_checksum: 5, generation, fingerprint: 6 };
        let mut bytes = vec![0u8; 64];
        h.encode(&mut bytes);
        bytes[byte] ^= 1 << bit;
        prop_assert!(BlockHeader::decode(&bytes).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = BlockHeader::decode(&bytes);
        let _ = Superblock::decode(&bytes);
        let _ = verify_block(&bytes, &bytes, 1, 2, Some(3));
    }

    #[test]
    fn arbitrary_bytes_behind_a_valid_magic_never_panic(rest in proptest::collection::vec(any::<u8>(), 0..120)) {
        let mut bytes = b"KVBMBLK1".to_vec();
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&rest);
        prop_assert!(BlockHeader::decode(&bytes).is_err() || bytes.len() >= 64);
    }
}
