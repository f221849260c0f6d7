//! Token ids for the trace's anonymous blocks, as text the router tokenizes back to the same ids.
//!
//! Token j of the sequence named by key k is `xxh3_64(k, j; seed) mod V`; a Mooncake block is the
//! first 512 (or, for a partial last block, fewer) tokens of its hash id's sequence, so equal ids
//! give equal tokens and a partial block is a prefix of the full one. Token t is written as the
//! word `w{t}`, words separated by single spaces. The replay's model directory holds a WordLevel
//! `tokenizer.json` over exactly those words (a whitespace pre-tokenizer, no normalizer, no
//! post-processor, hence no BOS): text → ids is the identity on the words, and kvbm-router
//! (`ModelTokenizer::from_dir`) and the mocker load it as they load a real model's.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context};

use super::trace::Part;
#[cfg(test)]
use super::trace::MOONCAKE_BLOCK_TOKENS;

/// The default vocabulary size.
pub const VOCAB_DEFAULT: u32 = 16_384;
/// The unknown-word token WordLevel needs; it sits after the `w*` words and is never produced.
const UNK: &str = "<unk>";

/// The mapping from trace keys to token ids.
#[derive(Debug, Clone, Copy)]
pub struct TokenMap {
    pub seed: u64,
    pub vocab: u32,
}

impl TokenMap {
    /// Token `j` of the sequence named by `key`.
    pub fn token(&self, key: u64, j: u64) -> u32 {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&key.to_le_bytes());
        bytes[8..].copy_from_slice(&j.to_le_bytes());
        (xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, self.seed) % u64::from(self.vocab)) as u32
    }

    /// Appends the ids of `part` to `out`.
    pub fn extend(&self, part: &Part, out: &mut Vec<u32>) {
        match part {
            Part::Blocks {
                hash_ids,
                len,
                block,
            } => {
                let mut left = *len;
                for &id in hash_ids {
                    let n = left.min(*block);
                    out.extend((0..n as u64).map(|j| self.token(id, j)));
                    left -= n;
                }
            }
            Part::Stream { key, len } => out.extend((0..*len as u64).map(|j| self.token(*key, j))),
        }
    }
}

/// Appends `ids` as words to `text` (a space before each word unless `text` is empty).
pub fn write_words(ids: &[u32], text: &mut String) {
    text.reserve(ids.len() * 7);
    for &id in ids {
        if !text.is_empty() {
            text.push(' ');
        }
        let _ = write!(text, "w{id}");
    }
}

/// The id of one word of this vocabulary (`w{t}` with `t < vocab`), if it is one.
pub fn word_id(word: &str, vocab: u32) -> Option<u32> {
    let digits = word.strip_prefix('w')?;
    if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
        return None;
    }
    digits.parse::<u32>().ok().filter(|&t| t < vocab)
}

/// Writes `tokenizer.json` and `tokenizer_config.json` for a `vocab`-word vocabulary into `dir`.
pub fn write_model_dir(dir: &Path, vocab: u32) -> anyhow::Result<()> {
    if vocab == 0 {
        bail!("the vocabulary needs at least one word");
    }
    let mut words = serde_json::Map::with_capacity(vocab as usize + 1);
    for t in 0..vocab {
        words.insert(format!("w{t}"), t.into());
    }
    words.insert(UNK.to_owned(), vocab.into());
    // The Hugging Face `tokenizers` serialization of a WordLevel model (tokenizers 0.2x).
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": UNK},
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tokenizer)?)
        .with_context(|| format!("writing {}", dir.join("tokenizer.json").display()))?;
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1u64 << 30,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&config)?,
    )?;
    Ok(())
}

/// Loads `dir` with the router's tokenizer and checks that `ids`, written as words, come back
/// exactly (the whole replay rests on it).
pub fn check_round_trip(dir: &Path, ids: &[u32]) -> anyhow::Result<()> {
    let tokenizer =
        kvbm_router::tokenize::ModelTokenizer::from_dir(dir).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut text = String::new();
    write_words(ids, &mut text);
    let back = tokenizer
        .encode_prompt(&text, true)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if back != ids {
        let at = back.iter().zip(ids).position(|(a, b)| a != b);
        bail!(
            "the replay's tokenizer does not round-trip: {} ids in, {} out, first difference at {at:?}",
            ids.len(),
            back.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAP: TokenMap = TokenMap {
        seed: 7,
        vocab: 1000,
    };

    fn ids(part: &Part) -> Vec<u32> {
        let mut out = Vec::new();
        MAP.extend(part, &mut out);
        out
    }

    #[test]
    fn equal_hash_ids_give_equal_tokens_and_partial_blocks_are_exact_prefixes() {
        let a = ids(&Part::Blocks {
            hash_ids: vec![5, 6, 7],
            len: 2 * 512 + 100,
            block: MOONCAKE_BLOCK_TOKENS,
        });
        let b = ids(&Part::Blocks {
            hash_ids: vec![5, 6, 8],
            len: 3 * 512,
            block: MOONCAKE_BLOCK_TOKENS,
        });
        let c = ids(&Part::Blocks {
            hash_ids: vec![9, 6],
            len: 1024,
            block: MOONCAKE_BLOCK_TOKENS,
        });
        assert_eq!(a.len(), 1124);
        assert_eq!(b.len(), 1536);
        assert_eq!(c.len(), 1024);
        // Shared ids 5, 6: the first 1024 tokens agree; the third blocks differ.
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1124], b[1024..1124]);
        // Id 6 in second place gives the same block whatever came before; id 9 differs from 5.
        assert_eq!(a[512..1024], c[512..1024]);
        assert_ne!(a[..512], c[..512]);
        // A partial block is the start of the full one.
        let full7 = ids(&Part::Blocks {
            hash_ids: vec![7],
            len: 512,
            block: MOONCAKE_BLOCK_TOKENS,
        });
        assert_eq!(a[1024..], full7[..100]);
        assert!(a.iter().all(|&t| t < MAP.vocab));
        // Another seed, other tokens.
        let other = TokenMap { seed: 8, ..MAP };
        let mut d = Vec::new();
        other.extend(
            &Part::Blocks {
                hash_ids: vec![5],
                len: 512,
                block: MOONCAKE_BLOCK_TOKENS,
            },
            &mut d,
        );
        assert_ne!(a[..512], d[..]);
    }

    #[test]
    fn words_parse_back_to_ids() {
        let mut text = String::new();
        write_words(&[0, 12, 999], &mut text);
        assert_eq!(text, "w0 w12 w999");
        let back: Vec<_> = text.split(' ').map(|w| word_id(w, 1000)).collect();
        assert_eq!(back, vec![Some(0), Some(12), Some(999)]);
        for bad in ["w1000", "w", "x1", "w01", "w-1", "<unk>"] {
            assert_eq!(word_id(bad, 1000), None, "{bad}");
        }
    }

    #[test]
    fn the_router_tokenizer_loads_the_model_dir_and_round_trips_exactly() {
        let dir = tempfile::tempdir().unwrap();
        write_model_dir(dir.path(), 16_384).unwrap();
        let map = TokenMap {
            seed: 1,
            vocab: 16_384,
        };
        let mut ids = Vec::new();
        map.extend(
            &Part::Blocks {
                hash_ids: vec![1, 2, 3, 4],
                len: 2000,
                block: MOONCAKE_BLOCK_TOKENS,
            },
            &mut ids,
        );
        // Every id at least once, and the ends of the range.
        ids.extend(0..16_384);
        check_round_trip(dir.path(), &ids).unwrap();
        // And through the router's own API: no BOS, one id per word.
        let t = kvbm_router::tokenize::ModelTokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(
            t.encode_prompt("w5 w16383  w0\nw7", true).unwrap(),
            vec![5, 16_383, 0, 7]
        );
        // A word outside the vocabulary is the unknown token, which no replay id ever is.
        assert_eq!(t.encode_prompt("w16384", false).unwrap(), vec![16_384]);
        // The check fails when the ids do not come back (a vocabulary too small for them).
        let small = tempfile::tempdir().unwrap();
        write_model_dir(small.path(), 100).unwrap();
        assert!(check_round_trip(small.path(), &[5, 150]).is_err());
    }
}
