//! The tree-based decoder `decode_batch` was before it read msgpack in place (kept verbatim, for
//! tests only): it builds an `rmpv::Value` of the whole payload, then reads the batch from it.
//! The in-place decoder must agree with it on every input (see `tests/wire_decoder.rs`).

use kvbm_events::wire::DECODE_DEPTH_MAX;
use kvbm_events::{DecodeError, GroupKind, Location, Tier, WireBatch, WireEvent};
use rmpv::Value;

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// Decodes one payload, as `decode_batch` did.
pub fn decode_batch_reference(bytes: &[u8]) -> Result<WireBatch, DecodeError> {
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
        let pool = get("ownership")
            .and_then(Value::as_str)
            .filter(|p| !p.is_empty());
        Ok(match (Tier::from_medium_name(medium), pool) {
            (_, Some(pool)) if remote => Location::Shared(pool.to_owned()),
            (Ok(tier), _) if !remote => Location::Local(tier),
            _ => Location::NotLocal(medium.to_owned()),
        })
    };
    let group = || -> Result<Option<u32>, DecodeError> {
        match get("group_idx") {
            None => Ok(None),
            Some(v) => as_u32(v)
                .map(Some)
                .ok_or_else(|| shape("group_idx is not a u32")),
        }
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
            let location = location()?;
            let group = group()?;
            let group_kind = match get("kv_cache_spec_kind") {
                None => None,
                Some(v) => Some(
                    v.as_str()
                        .map(GroupKind::from_name)
                        .ok_or_else(|| shape("kv_cache_spec_kind is not a string"))?,
                ),
            };
            let sliding_window = match get("kv_cache_spec_sliding_window") {
                None => None,
                Some(v) => Some(
                    as_u32(v).ok_or_else(|| shape("kv_cache_spec_sliding_window is not a u32"))?,
                ),
            };
            Ok(Decoded::Event(WireEvent::Stored {
                location,
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
                unhashable_from,
                group,
                group_kind,
                sliding_window,
            }))
        }
        "BlockRemoved" => Ok(Decoded::Event(WireEvent::Removed {
            location: location()?,
            block_hashes: hashes("block_hashes")?,
            group: group()?,
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
