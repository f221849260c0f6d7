//! KV cache events on the wire: the msgpack payload vLLM, SGLang and Dynamo exchange.
//!
//! A payload is `[ts, events, rank]`. Events are maps tagged by `"type"` (current engines) or
//! positional arrays whose first element is the type name (older vLLM):
//! `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium]`,
//! `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
//!
//! Invariants:
//! - Decoding never panics and never allocates from a length the input merely claims (rmpv caps
//!   preallocation; nesting is limited to [`DECODE_DEPTH_MAX`]); malformed bytes are a
//!   [`DecodeError`].
//! - Unknown fields are ignored; unknown event types are skipped and counted; placeholder stores
//!   (no tokens, block size 0) are skipped and counted, never indexed.
//! - Hashes arrive as uint64 (vLLM) or int64 (SGLang); a negative one is its two's complement.
//!   vLLM's bytes form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) is read as vLLM's int form is
//!   made from it: the last 8 bytes, big-endian.
//! - vLLM's per-block `extra_keys` are read for what the router can hash: the LoRA name and the
//!   cache salt (a bare string in the first block of a prompt). Multimodal keys, prompt-embeds
//!   digests and a LoRA known only by id are recorded as the first block the router cannot
//!   identify ([`WireEvent::Stored`]'s `unhashable_from`), never guessed.
//! - A medium that names no local tier, or `locality: "REMOTE"`, is kept apart in
//!   [`Location::NotLocal`], never mixed into the local tiers. A missing medium means GPU.
//! - The encoder writes vLLM's current form exactly as vLLM's msgpack encoder does.

use rmpv::Value;

use crate::{BlockRemoved, BlockStored, KvEvent, SequenceHash, Tier};

/// Deepest nesting accepted in a payload.
pub const DECODE_DEPTH_MAX: usize = 16;

/// Where a decoded event's blocks live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local tier of the publishing worker.
    Local(Tier),
    /// A shared or remote pool, or a medium no local tier answers to (the name as sent).
    NotLocal(String),
}

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireEvent {
    /// Blocks stored.
    Stored {
        /// Where.
        location: Location,
        /// The blocks' hashes, in prefix order.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first, if any.
        parent: Option<u64>,
        /// The blocks' tokens.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter name.
        lora_name: Option<String>,
        /// The cache salt the first block was hashed with (vLLM's `extra_keys`), if any.
        cache_salt: Option<String>,
        /// The first block whose engine hash covers more than its tokens, LoRA and salt
        /// (multimodal inputs, prompt embeddings, a LoRA known only by id): the router cannot
        /// compute that block's identity, nor any after it.
        unhashable_from: Option<usize>,
    },
    /// Blocks removed.
    Removed {
        /// Where.
        location: Location,
        /// The blocks' hashes.
        block_hashes: Vec<u64>,
    },
    /// Everything of this publisher is gone.
    Cleared,
}

impl WireEvent {
    /// The event as kvbm's own, when it concerns a local tier.
    pub fn to_local(&self) -> Option<KvEvent> {
        let hashes = |h: &[u64]| h.iter().map(|&x| SequenceHash(x)).collect();
        match self {
            WireEvent::Stored {
                location: Location::Local(tier),
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                ..
            } => Some(KvEvent::BlockStored(BlockStored {
                tier: *tier,
                block_hashes: hashes(block_hashes),
                parent_hash: parent.map(SequenceHash),
                token_ids: token_ids.clone(),
                block_size: *block_size,
                lora_name: lora_name.clone(),
            })),
            WireEvent::Removed {
                location: Location::Local(tier),
                block_hashes,
            } => Some(KvEvent::BlockRemoved(BlockRemoved {
                tier: *tier,
                block_hashes: hashes(block_hashes),
            })),
            WireEvent::Cleared => Some(KvEvent::AllBlocksCleared),
            _ => None,
        }
    }
}

/// A decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct WireBatch {
    /// The publisher's timestamp (seconds).
    pub ts: f64,
    /// The events kept, in order.
    pub events: Vec<WireEvent>,
    /// The data-parallel rank, when given.
    pub dp_rank: Option<u32>,
    /// Placeholder stores skipped (no tokens, block size 0).
    pub placeholders_skipped: usize,
    /// Events of a type this decoder does not know, skipped.
    pub unknown_skipped: usize,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack, truncated, or nested too deep.
    #[error("not a msgpack value: {0}")]
    Msgpack(String),
    /// Bytes left after the payload.
    #[error("{0} bytes after the payload")]
    TrailingBytes(usize),
    /// Msgpack, but not the shape of a KV event batch.
    #[error("malformed KV event batch: {0}")]
    Shape(String),
    /// Larger than the receiver accepts; not decoded.
    #[error("payload of {bytes} bytes is over the limit of {max}")]
    TooLarge {
        /// The payload's size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// Decodes one payload (the third frame of a ZMQ message).
pub fn decode_batch(bytes: &[u8]) -> Result<WireBatch, DecodeError> {
    let mut reader = bytes;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, DECODE_DEPTH_MAX)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !reader.is_empty() {
        return Err(DecodeError::TrailingBytes(reader.len()));
    }
    let Value::Array(parts) = value else {
        return Err(shape("the payload is not an array"));
    };
    if parts.len() < 2 {
        return Err(shape("the payload has fewer than 2 elements"));
    }
    let ts = match &parts[0] {
        Value::F64(x) => *x,
        Value::F32(x) => f64::from(*x),
        Value::Integer(i) => i.as_f64().ok_or_else(|| shape("bad timestamp"))?,
        _ => return Err(shape("the timestamp is not a number")),
    };
    let Value::Array(raw_events) = &parts[1] else {
        return Err(shape("the events are not an array"));
    };
    let dp_rank = match parts.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => {
            Some(as_u32(v).ok_or_else(|| shape("the rank is not a small unsigned integer"))?)
        }
    };
    let mut batch = WireBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        dp_rank,
        placeholders_skipped: 0,
        unknown_skipped: 0,
    };
    for raw in raw_events {
        match decode_event(raw)? {
            Decoded::Event(event) => batch.events.push(event),
            Decoded::Placeholder => batch.placeholders_skipped += 1,
            Decoded::Unknown => batch.unknown_skipped += 1,
        }
    }
    Ok(batch)
}

enum Decoded {
    Event(WireEvent),
    Placeholder,
    Unknown,
}

/// The fields of an event: a map tagged by `"type"`, or a positional array.
enum Fields<'a> {
    Map {
        kind: &'a str,
        entries: &'a [(Value, Value)],
    },
    Array {
        kind: &'a str,
        /// Elements after the type name.
        items: &'a [Value],
        /// Their names, in order.
        names: &'static [&'static str],
    },
}

impl<'a> Fields<'a> {
    fn of(raw: &'a Value) -> Result<Self, DecodeError> {
        match raw {
            Value::Map(entries) => {
                let kind = entries
                    .iter()
                    .find(|(k, _)| k.as_str() == Some("type"))
                    .and_then(|(_, v)| v.as_str())
                    .ok_or_else(|| shape("an event map without a string \"type\""))?;
                Ok(Fields::Map { kind, entries })
            }
            Value::Array(items) => {
                let kind = items
                    .first()
                    .and_then(Value::as_str)
                    .ok_or_else(|| shape("an event array without a type name"))?;
                let names: &'static [&'static str] = match kind {
                    "BlockStored" => &[
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                        "lora_id",
                        "medium",
                    ],
                    "BlockRemoved" => &["block_hashes", "medium"],
                    _ => &[],
                };
                Ok(Fields::Array {
                    kind,
                    items: &items[1..],
                    names,
                })
            }
            _ => Err(shape("an event is neither a map nor an array")),
        }
    }

    fn kind(&self) -> &'a str {
        match self {
            Fields::Map { kind, .. } | Fields::Array { kind, .. } => kind,
        }
    }

    /// The field's value; nil counts as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
        let value = match self {
            Fields::Map { entries, .. } => entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            Fields::Array { items, names, .. } => names
                .iter()
                .position(|n| *n == key)
                .and_then(|i| items.get(i)),
        };
        value.filter(|v| !v.is_nil())
    }
}

fn decode_event(raw: &Value) -> Result<Decoded, DecodeError> {
    let f = Fields::of(raw)?;
    let get = |k: &str| f.get(k);
    let location = || -> Result<Location, DecodeError> {
        let medium = match get("medium") {
            None => "GPU",
            Some(v) => v.as_str().ok_or_else(|| shape("medium is not a string"))?,
        };
        let remote = get("locality")
            .and_then(Value::as_str)
            .is_some_and(|l| l.eq_ignore_ascii_case("REMOTE"));
        Ok(match Tier::from_medium_name(medium) {
            Ok(tier) if !remote => Location::Local(tier),
            _ => Location::NotLocal(medium.to_owned()),
        })
    };
    let hashes = |key: &str| -> Result<Vec<u64>, DecodeError> {
        match get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| as_hash(v).ok_or_else(|| shape(format!("{key} holds a non-integer"))))
                .collect(),
            _ => Err(shape(format!("{key} is not an array"))),
        }
    };
    match f.kind() {
        "BlockStored" => {
            let token_ids: Vec<u32> = match get("token_ids") {
                None => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| as_u32(v).ok_or_else(|| shape("a token id is not a u32")))
                    .collect::<Result<_, _>>()?,
                Some(_) => return Err(shape("token_ids is not an array")),
            };
            let block_size = match get("block_size") {
                None => 0,
                Some(v) => as_u32(v).ok_or_else(|| shape("block_size is not a u32"))?,
            };
            let block_hashes = hashes("block_hashes")?;
            if token_ids.is_empty() && block_size == 0 {
                return Ok(Decoded::Placeholder);
            }
            let parent = match get("parent_block_hash") {
                None => None,
                Some(v) => {
                    Some(as_hash(v).ok_or_else(|| shape("parent_block_hash is not an integer"))?)
                }
            };
            let lora_name = get("lora_name").and_then(Value::as_str).map(str::to_owned);
            let (cache_salt, mut unhashable_from) =
                read_extra_keys(get("extra_keys"), lora_name.as_deref(), parent.is_none())?;
            if lora_name.is_none() && get("lora_id").is_some_and(|v| !v.is_nil()) {
                // An adapter known only by its id: its name seeds the hash.
                unhashable_from = Some(0);
            }
            Ok(Decoded::Event(WireEvent::Stored {
                location: location()?,
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
                unhashable_from,
            }))
        }
        "BlockRemoved" => Ok(Decoded::Event(WireEvent::Removed {
            location: location()?,
            block_hashes: hashes("block_hashes")?,
        })),
        "AllBlocksCleared" => Ok(Decoded::Event(WireEvent::Cleared)),
        _ => Ok(Decoded::Unknown),
    }
}

/// A hash: uint64 as is, int64 as its two's complement, bytes as their last 8 bytes read
/// big-endian (vLLM's own conversion of its bytes hashes to ints).
fn as_hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        Value::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        _ => None,
    }
}

/// Reads vLLM's per-block `extra_keys` (one entry per block, `nil` or an array of untagged keys:
/// the LoRA name, `[mm_identifier, offset]` pairs, the cache salt, prompt-embeds digests):
/// the cache salt of a prompt's first block (`first_is_root`: the event starts a prompt), and
/// the first block with a key the router cannot hash.
fn read_extra_keys(
    keys: Option<&Value>,
    lora_name: Option<&str>,
    first_is_root: bool,
) -> Result<(Option<String>, Option<usize>), DecodeError> {
    let entries = match keys {
        None => return Ok((None, None)),
        Some(Value::Array(entries)) => entries,
        Some(_) => return Err(shape("extra_keys is not an array")),
    };
    let mut salt = None;
    for (i, entry) in entries.iter().enumerate() {
        let items = match entry {
            Value::Nil => continue,
            Value::Array(items) => items,
            _ => return Err(shape("an extra_keys entry is neither nil nor an array")),
        };
        let mut rest = items.as_slice();
        // The LoRA name comes first when the event names one.
        if let (Some(name), Some(first)) = (lora_name, rest.first()) {
            if first.as_str() == Some(name) {
                rest = &rest[1..];
            }
        }
        for key in rest {
            match key.as_str() {
                // A bare string after the LoRA is the cache salt, only ever on a prompt's first
                // block.
                Some(s) if i == 0 && first_is_root && salt.is_none() => {
                    salt = Some(s.to_owned());
                }
                _ => return Ok((salt, Some(i))),
            }
        }
    }
    Ok((salt, None))
}

fn as_u32(v: &Value) -> Option<u32> {
    let Value::Integer(i) = v else { return None };
    i.as_u64().and_then(|x| u32::try_from(x).ok())
}

/// Encodes kvbm's events as one payload in vLLM's current map form (media `GPU`, `CPU_PINNED`,
/// `DISK`; `BlockStored` with a map16 header, as vLLM's encoder writes it).
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: Option<u32>, out: &mut Vec<u8>) {
    use rmp::encode as w;
    done(w::write_array_len(out, 3));
    done(w::write_f64(out, ts));
    done(w::write_array_len(out, events.len() as u32));
    for event in events {
        match event {
            KvEvent::BlockStored(s) => {
                // map16 with 8 entries: vLLM's BlockStored.
                out.extend_from_slice(&[0xde, 0x00, 0x08]);
                write_str(out, "type");
                write_str(out, "BlockStored");
                write_str(out, "block_hashes");
                write_hashes(out, &s.block_hashes);
                write_str(out, "parent_block_hash");
                match s.parent_hash {
                    Some(p) => done(w::write_uint(out, p.0)),
                    None => done(w::write_nil(out)),
                }
                write_str(out, "token_ids");
                done(w::write_array_len(out, s.token_ids.len() as u32));
                for &t in &s.token_ids {
                    done(w::write_uint(out, u64::from(t)));
                }
                write_str(out, "block_size");
                done(w::write_uint(out, u64::from(s.block_size)));
                write_str(out, "lora_id");
                done(w::write_nil(out));
                write_str(out, "medium");
                write_str(out, s.tier.medium_name());
                write_str(out, "lora_name");
                match &s.lora_name {
                    Some(name) => write_str(out, name),
                    None => done(w::write_nil(out)),
                }
            }
            KvEvent::BlockRemoved(r) => {
                done(w::write_map_len(out, 3));
                write_str(out, "type");
                write_str(out, "BlockRemoved");
                write_str(out, "block_hashes");
                write_hashes(out, &r.block_hashes);
                write_str(out, "medium");
                write_str(out, r.tier.medium_name());
            }
            KvEvent::AllBlocksCleared => {
                done(w::write_map_len(out, 1));
                write_str(out, "type");
                write_str(out, "AllBlocksCleared");
            }
        }
    }
    match dp_rank {
        Some(rank) => done(w::write_uint(out, u64::from(rank))),
        None => done(w::write_nil(out)),
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[SequenceHash]) {
    done(rmp::encode::write_array_len(out, hashes.len() as u32));
    for h in hashes {
        done(rmp::encode::write_uint(out, h.0));
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    done(rmp::encode::write_str(out, s));
}

/// Writing msgpack into a `Vec` cannot fail.
fn done<T, E: std::fmt::Debug>(result: Result<T, E>) {
    result.expect("writing to a Vec cannot fail");
}
