//! Block and sequence hashes against the reference implementation's vectors.

use kvbm_events::{BlockHash, BlockHasher, SequenceHash};
use serde_json::Value;

const VECTORS: &str = include_str!("data/block-hashes.json");

fn parse_hashes(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("hash list")
        .iter()
        .map(|h| h.as_str().expect("decimal string").parse().expect("u64"))
        .collect()
}

#[test]
fn every_vector_case_matches() {
    let doc: Value = serde_json::from_str(VECTORS).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 9, "vector file lost cases");
    let mut checked_sequences = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
            .collect();
        let block_size = case["block_size"].as_u64().unwrap() as usize;
        let hasher = BlockHasher::new(
            block_size,
            case["lora_name"].as_str(),
            case["cache_namespace"].as_str(),
        );
        let got: Vec<u64> = hasher.block_hashes(&tokens).iter().map(|h| h.0).collect();
        assert_eq!(
            got,
            parse_hashes(&case["local_block_hashes"]),
            "case {name}: block hashes"
        );
        if let Some(expected) = case.get("sequence_hashes") {
            let got: Vec<u64> = hasher
                .sequence_hashes(None, &tokens)
                .iter()
                .map(|h| h.0)
                .collect();
            assert_eq!(got, parse_hashes(expected), "case {name}: sequence hashes");
            checked_sequences += 1;
        }
    }
    assert!(checked_sequences >= 5);
}

#[test]
fn sequence_hashes_continue_from_a_parent() {
    let hasher = BlockHasher::new(16, None, None);
    let tokens: Vec<u32> = (0..64).collect();
    let whole = hasher.sequence_hashes(None, &tokens);
    let tail = hasher.sequence_hashes(Some(whole[1]), &tokens[32..]);
    assert_eq!(&whole[2..], &tail[..]);
}

#[test]
fn empty_lora_and_namespace_count_as_absent() {
    let plain = BlockHasher::new(16, None, None);
    assert_eq!(BlockHasher::new(16, Some(""), Some("")), plain);
    assert_ne!(BlockHasher::new(16, Some("a"), None), plain);
    assert_ne!(BlockHasher::new(16, None, Some("a")), plain);
}

#[test]
fn chaining_depends_on_order_and_parent() {
    let a = BlockHash(1);
    let b = BlockHash(2);
    let ab = SequenceHash::chain(Some(SequenceHash::chain(None, a)), b);
    let ba = SequenceHash::chain(Some(SequenceHash::chain(None, b)), a);
    assert_ne!(ab, ba);
    assert_eq!(SequenceHash::chain(None, a), SequenceHash(1));
}
