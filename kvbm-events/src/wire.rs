//! KV cache events on the wire: the msgpack payload vLLM, SGLang and Dynamo exchange.
//!
//! A payload is `[ts, events, rank]`. Events are maps tagged by `"type"` (current engines) or
//! positional arrays whose first element is the type name (older vLLM):
//! `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium]`,
//! `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
//!
//! Invariants:
//! - Decoding never panics and never allocates from a length the input merely claims: it reads
//!   the bytes in place, allocating only for the events it keeps (capacities bounded by the bytes
//!   left), and skips whatever it does not keep without allocating; nesting is limited to
//!   [`DECODE_DEPTH_MAX`]; malformed bytes are a [`DecodeError`].
//! - Unknown fields are ignored; unknown event types are skipped and counted; placeholder stores
//!   (no tokens, block size 0) are skipped and counted, never indexed.
//! - Hashes arrive as uint64 (vLLM) or int64 (SGLang); a negative one is its two's complement.
//!   vLLM's bytes form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) is read as vLLM's int form is
//!   made from it: the last 8 bytes, big-endian.
//! - vLLM's per-block `extra_keys` are read for what the router can hash: the LoRA name and the
//!   cache salt (a bare string in the first block of a prompt). Multimodal keys, prompt-embeds
//!   digests and a LoRA known only by id are recorded as the first block the router cannot
//!   identify ([`WireEvent::Stored`]'s `unhashable_from`), never guessed.
//! - `locality: "REMOTE"` with a pool name in `ownership` is that shared pool's
//!   ([`Location::Shared`]); a medium that names no local tier, or `REMOTE` without a pool, is
//!   kept apart in [`Location::NotLocal`]; neither is ever mixed into the local tiers. A missing
//!   medium means GPU.
//! - vLLM 0.33's KV cache group fields are read from the map form (`BlockStored`: `group_idx`,
//!   `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`; `BlockRemoved`: `group_idx`; each
//!   omitted when `None`, as `omit_defaults` does). A stream without them decodes as before.
//!   An unknown kind name is [`GroupKind::Unknown`], never an error.
//! - The encoder writes vLLM's current form exactly as vLLM's msgpack encoder does.

use rmp::Marker;

use crate::{BlockRemoved, BlockStored, GroupKind, KvEvent, SequenceHash, Tier};

/// Deepest nesting accepted in a payload.
pub const DECODE_DEPTH_MAX: usize = 16;

/// Where a decoded event's blocks live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local tier of the publishing worker.
    Local(Tier),
    /// A shared pool other workers reach too, by its name (`locality` `REMOTE` with the pool
    /// in `ownership`, as vLLM 0.33 publishes a tier that is not the publisher's own).
    Shared(String),
    /// A remote store without a pool name, or a medium no local tier answers to (the name as
    /// sent).
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
        /// The KV cache group the blocks belong to (vLLM 0.33's `group_idx`); `None` from
        /// publishers without groups (older vLLM, SGLang, kvbm's own tiers).
        group: Option<u32>,
        /// The group's kind (`kv_cache_spec_kind`), when sent.
        group_kind: Option<GroupKind>,
        /// The group's sliding window in tokens (`kv_cache_spec_sliding_window`), when sent.
        sliding_window: Option<u32>,
    },
    /// Blocks removed.
    Removed {
        /// Where.
        location: Location,
        /// The blocks' hashes.
        block_hashes: Vec<u64>,
        /// The KV cache group the blocks left (vLLM 0.33's `group_idx`), when sent.
        group: Option<u32>,
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
                ..
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
///
/// Reads the msgpack bytes in place, in one pass: nothing is built but the events kept, and no
/// unknown field, skipped event or placeholder allocates. Errors are those of a decoder that reads
/// the whole value first: malformed msgpack anywhere (or nesting past [`DECODE_DEPTH_MAX`]) before
/// trailing bytes, trailing bytes before a bad shape, and the first bad shape in the order the
/// fields are read (the header, the rank, then each event in turn).
pub fn decode_batch(bytes: &[u8]) -> Result<WireBatch, DecodeError> {
    decode(bytes).map_err(|e| match e {
        // The pass stops at the first bad shape; what lies after it may outrank it.
        DecodeError::Shape(_) => outranking_error(bytes).unwrap_or(e),
        e => e,
    })
}

fn decode(bytes: &[u8]) -> Result<WireBatch, DecodeError> {
    let mut r = Reader::new(bytes);
    let header = read_header(&mut r)?;
    let mut batch = WireBatch {
        ts: header.ts,
        // Grown as events are kept: skipped ones take no room.
        events: Vec::new(),
        dp_rank: None,
        placeholders_skipped: 0,
        unknown_skipped: 0,
    };
    for _ in 0..header.events {
        match decode_event(&mut r, header.events_depth)? {
            Decoded::Event(event) => batch.events.push(event),
            Decoded::Placeholder => batch.placeholders_skipped += 1,
            Decoded::Unknown => batch.unknown_skipped += 1,
        }
    }
    batch.dp_rank = read_rank(&mut r, &header)?;
    for _ in 3..header.parts {
        r.skip(header.parts_depth)?;
    }
    if r.remaining() > 0 {
        return Err(DecodeError::TrailingBytes(r.remaining()));
    }
    Ok(batch)
}

/// The error that a bad shape found by [`decode`] yields to, if any: malformed msgpack or trailing
/// bytes anywhere, or a bad rank (read, in the payload's order, after the events).
#[cold]
fn outranking_error(bytes: &[u8]) -> Option<DecodeError> {
    let mut r = Reader::new(bytes);
    if let Err(e) = r.skip(DECODE_DEPTH_MAX) {
        return Some(e);
    }
    if r.remaining() > 0 {
        return Some(DecodeError::TrailingBytes(r.remaining()));
    }
    // Well-formed: the header, then the rank, come before any event.
    let mut r = Reader::new(bytes);
    let header = match read_header(&mut r) {
        Ok(header) => header,
        Err(e) => return Some(e),
    };
    for _ in 0..header.events {
        if let Err(e) = r.skip(header.events_depth) {
            return Some(e);
        }
    }
    read_rank(&mut r, &header).err()
}

/// `[ts, events, rank, ...]` up to the events' elements.
struct Header {
    ts: f64,
    /// Elements of the payload array.
    parts: u32,
    /// Depth budget of each of them.
    parts_depth: usize,
    /// Events in the events array.
    events: u32,
    /// Depth budget of each event.
    events_depth: usize,
}

fn read_header(r: &mut Reader<'_>) -> Result<Header, DecodeError> {
    let Head::Array {
        len: parts,
        depth: parts_depth,
    } = r.head(DECODE_DEPTH_MAX)?
    else {
        return Err(shape("the payload is not an array"));
    };
    if parts < 2 {
        return Err(shape("the payload has fewer than 2 elements"));
    }
    let ts = match r.head(parts_depth)? {
        Head::F64(x) => x,
        Head::F32(x) => f64::from(x),
        Head::Uint(x) => x as f64,
        Head::Int(x) => x as f64,
        _ => return Err(shape("the timestamp is not a number")),
    };
    let Head::Array {
        len: events,
        depth: events_depth,
    } = r.head(parts_depth)?
    else {
        return Err(shape("the events are not an array"));
    };
    Ok(Header {
        ts,
        parts,
        parts_depth,
        events,
        events_depth,
    })
}

/// The rank, the third element when there is one; `r` stands after the events.
fn read_rank(r: &mut Reader<'_>, header: &Header) -> Result<Option<u32>, DecodeError> {
    if header.parts < 3 {
        return Ok(None);
    }
    match r.head(header.parts_depth)? {
        Head::Nil => Ok(None),
        head => as_u32(head)
            .map(Some)
            .ok_or_else(|| shape("the rank is not a small unsigned integer")),
    }
}

enum Decoded {
    Event(WireEvent),
    Placeholder,
    Unknown,
}

/// An event's type, by its name.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Kind {
    /// `None` for a string that is not UTF-8 (no type name at all).
    fn of(name: &[u8]) -> Option<Kind> {
        match name {
            b"BlockStored" => Some(Kind::Stored),
            b"BlockRemoved" => Some(Kind::Removed),
            b"AllBlocksCleared" => Some(Kind::Cleared),
            other => std::str::from_utf8(other).is_ok().then_some(Kind::Unknown),
        }
    }

    /// The positional fields of the legacy array form, after the type name.
    fn positions(self) -> &'static [Field] {
        match self {
            Kind::Stored => &[
                Field::BlockHashes,
                Field::ParentBlockHash,
                Field::TokenIds,
                Field::BlockSize,
                Field::LoraId,
                Field::Medium,
            ],
            Kind::Removed => &[Field::BlockHashes, Field::Medium],
            Kind::Cleared | Kind::Unknown => &[],
        }
    }
}

/// The fields this decoder reads; any other is skipped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Field {
    Type,
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    LoraName,
    Medium,
    Locality,
    Ownership,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
}

impl Field {
    fn of(key: &[u8]) -> Option<Field> {
        Some(match key {
            b"type" => Field::Type,
            b"block_hashes" => Field::BlockHashes,
            b"parent_block_hash" => Field::ParentBlockHash,
            b"token_ids" => Field::TokenIds,
            b"block_size" => Field::BlockSize,
            b"lora_id" => Field::LoraId,
            b"lora_name" => Field::LoraName,
            b"medium" => Field::Medium,
            b"locality" => Field::Locality,
            b"ownership" => Field::Ownership,
            b"extra_keys" => Field::ExtraKeys,
            b"group_idx" => Field::GroupIdx,
            b"kv_cache_spec_kind" => Field::SpecKind,
            b"kv_cache_spec_sliding_window" => Field::SlidingWindow,
            _ => return None,
        })
    }
}

/// An integer array field (`block_hashes`, `token_ids`).
enum Ints<'a, T> {
    /// Not given, or not needed by the event's type.
    Absent,
    /// Given before the event's type: its bytes, read once the type says it is needed.
    Later(&'a [u8]),
    /// Read: its elements, or why not (a bad shape, reported in the fields' order).
    Read(Result<Vec<T>, DecodeError>),
}

/// An event's fields, each its first occurrence (a repeated key is ignored, nil included).
struct Fields<'a> {
    /// The depth budget of each field's value.
    depth: usize,
    /// The fields met so far, by `1 << Field as u16`.
    seen: u16,
    /// The type: `None` until known, `Some(None)` when it is not a string.
    kind: Option<Option<Kind>>,
    block_hashes: Ints<'a, u64>,
    token_ids: Ints<'a, u32>,
    parent: Option<Head<'a>>,
    block_size: Option<Head<'a>>,
    lora_id: Option<Head<'a>>,
    lora_name: Option<Head<'a>>,
    medium: Option<Head<'a>>,
    locality: Option<Head<'a>>,
    ownership: Option<Head<'a>>,
    group_idx: Option<Head<'a>>,
    spec_kind: Option<Head<'a>>,
    sliding_window: Option<Head<'a>>,
    /// The value's bytes (read only for a store).
    extra_keys: Option<&'a [u8]>,
}

impl<'a> Fields<'a> {
    fn new(depth: usize, kind: Option<Option<Kind>>) -> Self {
        Fields {
            depth,
            seen: 0,
            kind,
            block_hashes: Ints::Absent,
            token_ids: Ints::Absent,
            parent: None,
            block_size: None,
            lora_id: None,
            lora_name: None,
            medium: None,
            locality: None,
            ownership: None,
            group_idx: None,
            spec_kind: None,
            sliding_window: None,
            extra_keys: None,
        }
    }

    /// Reads the value of `field` from `r`, or skips it when the field was met before.
    fn read(&mut self, r: &mut Reader<'a>, field: Field) -> Result<(), DecodeError> {
        let bit = 1u16 << field as u16;
        if self.seen & bit != 0 {
            return r.skip(self.depth);
        }
        self.seen |= bit;
        let depth = self.depth;
        // Whether an integer array is needed: `None` while the type is not known.
        let needed = |stored_only: bool| match self.kind {
            None => None,
            Some(Some(Kind::Stored)) => Some(true),
            Some(Some(Kind::Removed)) => Some(!stored_only),
            Some(_) => Some(false),
        };
        match field {
            Field::BlockHashes => {
                self.block_hashes = match needed(false) {
                    Some(true) => {
                        let head = r.head(depth)?;
                        Ints::Read(read_hashes(r, head)?)
                    }
                    Some(false) => {
                        r.skip(depth)?;
                        Ints::Absent
                    }
                    None => Ints::Later(r.skip_and_take(depth)?),
                }
            }
            Field::TokenIds => {
                self.token_ids = match needed(true) {
                    Some(true) => {
                        let head = r.head(depth)?;
                        Ints::Read(read_token_ids(r, head)?)
                    }
                    Some(false) => {
                        r.skip(depth)?;
                        Ints::Absent
                    }
                    None => Ints::Later(r.skip_and_take(depth)?),
                }
            }
            Field::ExtraKeys => self.extra_keys = Some(r.skip_and_take(depth)?),
            Field::Type => {
                self.kind = Some(match r.whole(depth)? {
                    Head::Str(s) => Kind::of(s),
                    _ => None,
                })
            }
            Field::ParentBlockHash => self.parent = Some(r.whole(depth)?),
            Field::BlockSize => self.block_size = Some(r.whole(depth)?),
            Field::LoraId => self.lora_id = Some(r.whole(depth)?),
            Field::LoraName => self.lora_name = Some(r.whole(depth)?),
            Field::Medium => self.medium = Some(r.whole(depth)?),
            Field::Locality => self.locality = Some(r.whole(depth)?),
            Field::Ownership => self.ownership = Some(r.whole(depth)?),
            Field::GroupIdx => self.group_idx = Some(r.whole(depth)?),
            Field::SpecKind => self.spec_kind = Some(r.whole(depth)?),
            Field::SlidingWindow => self.sliding_window = Some(r.whole(depth)?),
        }
        Ok(())
    }

    /// A scalar field's value; nil counts as absent.
    fn get(field: Option<Head<'a>>) -> Option<Head<'a>> {
        field.filter(|h| !matches!(h, Head::Nil))
    }

    fn block_hashes(&mut self) -> Result<Vec<u64>, DecodeError> {
        match std::mem::replace(&mut self.block_hashes, Ints::Absent) {
            Ints::Absent => Err(shape("block_hashes is not an array")),
            Ints::Later(bytes) => {
                let mut r = Reader::new(bytes);
                let head = r.head(self.depth)?;
                read_hashes(&mut r, head)?
            }
            Ints::Read(result) => result,
        }
    }

    fn token_ids(&mut self) -> Result<Vec<u32>, DecodeError> {
        match std::mem::replace(&mut self.token_ids, Ints::Absent) {
            Ints::Absent => Ok(Vec::new()),
            Ints::Later(bytes) => {
                let mut r = Reader::new(bytes);
                let head = r.head(self.depth)?;
                read_token_ids(&mut r, head)?
            }
            Ints::Read(result) => result,
        }
    }

    /// `group_idx`: a u32 or absent.
    fn group(&self) -> Result<Option<u32>, DecodeError> {
        Self::get(self.group_idx)
            .map(|h| as_u32(h).ok_or_else(|| shape("group_idx is not a u32")))
            .transpose()
    }

    /// `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`.
    fn group_spec(&self) -> Result<(Option<GroupKind>, Option<u32>), DecodeError> {
        let kind = Self::get(self.spec_kind)
            .map(|h| {
                as_str(h)
                    .map(GroupKind::from_name)
                    .ok_or_else(|| shape("kv_cache_spec_kind is not a string"))
            })
            .transpose()?;
        let window = Self::get(self.sliding_window)
            .map(|h| as_u32(h).ok_or_else(|| shape("kv_cache_spec_sliding_window is not a u32")))
            .transpose()?;
        Ok((kind, window))
    }

    fn location(&self) -> Result<Location, DecodeError> {
        let medium = match Self::get(self.medium) {
            None => "GPU",
            Some(h) => as_str(h).ok_or_else(|| shape("medium is not a string"))?,
        };
        let remote = Self::get(self.locality)
            .and_then(as_str)
            .is_some_and(|l| l.eq_ignore_ascii_case("REMOTE"));
        // A pool named by `ownership` (a non-string or empty one names none).
        let pool = Self::get(self.ownership)
            .and_then(as_str)
            .filter(|p| !p.is_empty());
        Ok(match (tier_of(medium), remote, pool) {
            (_, true, Some(pool)) => Location::Shared(pool.to_owned()),
            (Some(tier), false, _) => Location::Local(tier),
            _ => Location::NotLocal(medium.to_owned()),
        })
    }
}

/// The local tier a medium names.
fn tier_of(medium: &str) -> Option<Tier> {
    // The names kvbm and vLLM write, without `from_medium_name`'s case folding.
    Tier::ALL
        .into_iter()
        .find(|t| t.medium_name() == medium)
        .or_else(|| Tier::from_medium_name(medium).ok())
}

fn decode_event<'a>(r: &mut Reader<'a>, depth: usize) -> Result<Decoded, DecodeError> {
    let mut f = match r.head(depth)? {
        Head::Map { len, depth } => {
            let mut f = Fields::new(depth, None);
            for _ in 0..len {
                let key = r.head(depth)?;
                match key {
                    Head::Str(key) => match Field::of(key) {
                        Some(name) => f.read(r, name)?,
                        None => r.skip(depth)?,
                    },
                    key => {
                        r.skip_body(key)?;
                        r.skip(depth)?;
                    }
                }
            }
            f
        }
        Head::Array { len, depth } => {
            let no_type = || shape("an event array without a type name");
            if len == 0 {
                return Err(no_type());
            }
            let Head::Str(name) = r.head(depth)? else {
                return Err(no_type());
            };
            let kind = Kind::of(name).ok_or_else(no_type)?;
            let mut f = Fields::new(depth, Some(Some(kind)));
            let positions = kind.positions();
            for i in 1..len as usize {
                match positions.get(i - 1) {
                    Some(&name) => f.read(r, name)?,
                    None => r.skip(depth)?,
                }
            }
            f
        }
        _ => return Err(shape("an event is neither a map nor an array")),
    };
    let kind = f
        .kind
        .flatten()
        .ok_or_else(|| shape("an event map without a string \"type\""))?;
    match kind {
        Kind::Stored => {
            let token_ids = f.token_ids()?;
            let block_size = match Fields::get(f.block_size) {
                None => 0,
                Some(h) => as_u32(h).ok_or_else(|| shape("block_size is not a u32"))?,
            };
            let block_hashes = f.block_hashes()?;
            if token_ids.is_empty() && block_size == 0 {
                return Ok(Decoded::Placeholder);
            }
            let parent = match Fields::get(f.parent) {
                None => None,
                Some(h) => {
                    Some(as_hash(h).ok_or_else(|| shape("parent_block_hash is not an integer"))?)
                }
            };
            let lora_name = Fields::get(f.lora_name).and_then(as_str).map(str::to_owned);
            let (cache_salt, mut unhashable_from) = read_extra_keys(
                f.extra_keys,
                f.depth,
                lora_name.as_deref(),
                parent.is_none(),
            )?;
            if lora_name.is_none() && Fields::get(f.lora_id).is_some() {
                // An adapter known only by its id: its name seeds the hash.
                unhashable_from = Some(0);
            }
            let location = f.location()?;
            let group = f.group()?;
            let (group_kind, sliding_window) = f.group_spec()?;
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
        Kind::Removed => Ok(Decoded::Event(WireEvent::Removed {
            location: f.location()?,
            block_hashes: f.block_hashes()?,
            group: f.group()?,
        })),
        Kind::Cleared => Ok(Decoded::Event(WireEvent::Cleared)),
        Kind::Unknown => Ok(Decoded::Unknown),
    }
}

/// Reads the integer array `head` starts, converting each element with `conv`. The outer error is
/// malformed msgpack (fatal); the inner one, a bad shape (reported in the fields' order), comes
/// after the whole array has been read.
fn read_ints<'a, T>(
    r: &mut Reader<'a>,
    head: Head<'a>,
    conv: impl Fn(Head<'a>) -> Option<T>,
    not_array: &str,
    bad_element: &str,
) -> Result<Result<Vec<T>, DecodeError>, DecodeError> {
    let Head::Array { len, depth } = head else {
        r.skip_body(head)?;
        return Ok(Err(shape(not_array)));
    };
    let mut out = Vec::with_capacity(r.capacity_for(len));
    // A copy the compiler can keep in registers; `r` catches up with it when it is left.
    let mut at = *r;
    for i in 0..len {
        let element = match at.int(depth) {
            Some(int) => int,
            None => {
                *r = at;
                let element = r.head(depth)?;
                at = *r;
                element
            }
        };
        match conv(element) {
            Some(x) => out.push(x),
            None => {
                *r = at;
                r.skip_body(element)?;
                for _ in i + 1..len {
                    r.skip(depth)?;
                }
                return Ok(Err(shape(bad_element)));
            }
        }
    }
    *r = at;
    Ok(Ok(out))
}

fn read_hashes<'a>(
    r: &mut Reader<'a>,
    head: Head<'a>,
) -> Result<Result<Vec<u64>, DecodeError>, DecodeError> {
    read_ints(
        r,
        head,
        as_hash,
        "block_hashes is not an array",
        "block_hashes holds a non-integer",
    )
}

fn read_token_ids<'a>(
    r: &mut Reader<'a>,
    head: Head<'a>,
) -> Result<Result<Vec<u32>, DecodeError>, DecodeError> {
    if matches!(head, Head::Nil) {
        return Ok(Ok(Vec::new()));
    }
    read_ints(
        r,
        head,
        as_u32,
        "token_ids is not an array",
        "a token id is not a u32",
    )
}

/// A hash: uint64 as is, int64 as its two's complement, bytes as their last 8 bytes read
/// big-endian (vLLM's own conversion of its bytes hashes to ints).
#[inline]
fn as_hash(h: Head<'_>) -> Option<u64> {
    match h {
        Head::Uint(x) => Some(x),
        Head::Int(x) => Some(x as u64),
        Head::Bin(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        _ => None,
    }
}

#[inline]
fn as_u32(h: Head<'_>) -> Option<u32> {
    match h {
        Head::Uint(x) => u32::try_from(x).ok(),
        _ => None,
    }
}

/// A string's text; `None` for anything else, or a string that is not UTF-8.
fn as_str(h: Head<'_>) -> Option<&str> {
    match h {
        Head::Str(s) => std::str::from_utf8(s).ok(),
        _ => None,
    }
}

/// Reads vLLM's per-block `extra_keys` (one entry per block, `nil` or an array of untagged keys:
/// the LoRA name, `[mm_identifier, offset]` pairs, the cache salt, prompt-embeds digests):
/// the cache salt of a prompt's first block (`first_is_root`: the event starts a prompt), and
/// the first block with a key the router cannot hash. `keys` is the value's bytes, already
/// checked to be well-formed, of depth budget `depth`.
fn read_extra_keys(
    keys: Option<&[u8]>,
    depth: usize,
    lora_name: Option<&str>,
    first_is_root: bool,
) -> Result<(Option<String>, Option<usize>), DecodeError> {
    let Some(keys) = keys else {
        return Ok((None, None));
    };
    let mut r = Reader::new(keys);
    let (entries, depth) = match r.head(depth)? {
        Head::Nil => return Ok((None, None)),
        Head::Array { len, depth } => (len, depth),
        _ => return Err(shape("extra_keys is not an array")),
    };
    let mut salt = None;
    for i in 0..entries as usize {
        let (items, depth) = match r.head(depth)? {
            Head::Nil => continue,
            Head::Array { len, depth } => (len, depth),
            _ => return Err(shape("an extra_keys entry is neither nil nor an array")),
        };
        for j in 0..items {
            let key = r.head(depth)?;
            let text = as_str(key);
            // The LoRA name comes first when the event names one.
            if j == 0 && lora_name.is_some() && text == lora_name {
                continue;
            }
            match text {
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

/// A msgpack value's head: a scalar whole, or a string, binary or extension with its bytes, or
/// the length of an array or map whose elements follow.
#[derive(Debug, Clone, Copy)]
enum Head<'a> {
    Nil,
    Bool,
    /// A non-negative integer, whatever its encoding.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    F32(f32),
    F64(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    /// `depth`: the depth budget of each element.
    Array {
        len: u32,
        depth: usize,
    },
    /// `depth`: the depth budget of each key and value.
    Map {
        len: u32,
        depth: usize,
    },
}

/// Reads msgpack values in place from a byte slice.
///
/// Depth is counted as rmpv (the tree decoder this one replaced) counts it, so that the same
/// payloads are too deep: every value takes a level; an array's or map's elements sit a level
/// below that; a binary's bytes need a level left, a string's or an extension's two.
#[derive(Clone, Copy)]
struct Reader<'a> {
    buf: &'a [u8],
    /// The slice's length at the start, to say where an error is.
    len: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader {
            buf,
            len: buf.len(),
        }
    }

    #[inline]
    fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// How many elements of an array claiming `len` to make room for: each takes at least a byte.
    #[inline]
    fn capacity_for(&self, len: u32) -> usize {
        (len as usize).min(self.buf.len())
    }

    #[cold]
    fn truncated(&self) -> DecodeError {
        DecodeError::Msgpack(format!(
            "the payload ends early (byte {} of {})",
            self.len - self.buf.len(),
            self.len
        ))
    }

    #[cold]
    fn too_deep(&self) -> DecodeError {
        DecodeError::Msgpack(format!(
            "nested deeper than the limit of {DECODE_DEPTH_MAX} (byte {})",
            self.len - self.buf.len()
        ))
    }

    #[inline]
    fn byte(&mut self) -> Result<u8, DecodeError> {
        match self.buf.split_first() {
            Some((&b, rest)) => {
                self.buf = rest;
                Ok(b)
            }
            None => Err(self.truncated()),
        }
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.buf.len() {
            return Err(self.truncated());
        }
        let (taken, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(taken)
    }

    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        match self.buf.split_first_chunk::<N>() {
            Some((&a, rest)) => {
                self.buf = rest;
                Ok(a)
            }
            None => Err(self.truncated()),
        }
    }

    #[inline]
    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.array().map(u16::from_be_bytes)
    }

    #[inline]
    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_be_bytes)
    }

    /// Takes one level of depth from `depth`.
    #[inline]
    fn descend(&self, depth: usize) -> Result<usize, DecodeError> {
        depth.checked_sub(1).ok_or_else(|| self.too_deep())
    }

    /// Reads a value's head, its body too when that is bytes; an array's or map's elements are
    /// left to read (or skip).
    #[inline]
    fn head(&mut self, depth: usize) -> Result<Head<'a>, DecodeError> {
        let depth = self.descend(depth)?;
        let signed = |x: i64| {
            if x < 0 {
                Head::Int(x)
            } else {
                Head::Uint(x as u64)
            }
        };
        Ok(match Marker::from_u8(self.byte()?) {
            Marker::FixPos(x) => Head::Uint(u64::from(x)),
            Marker::FixNeg(x) => Head::Int(i64::from(x)),
            // rmpv reads the reserved marker as nil.
            Marker::Null | Marker::Reserved => Head::Nil,
            Marker::True | Marker::False => Head::Bool,
            Marker::U8 => Head::Uint(u64::from(self.byte()?)),
            Marker::U16 => Head::Uint(u64::from(self.u16()?)),
            Marker::U32 => Head::Uint(u64::from(self.u32()?)),
            Marker::U64 => Head::Uint(u64::from_be_bytes(self.array()?)),
            Marker::I8 => signed(i64::from(self.byte()? as i8)),
            Marker::I16 => signed(i64::from(i16::from_be_bytes(self.array()?))),
            Marker::I32 => signed(i64::from(i32::from_be_bytes(self.array()?))),
            Marker::I64 => signed(i64::from_be_bytes(self.array()?)),
            Marker::F32 => Head::F32(f32::from_be_bytes(self.array()?)),
            Marker::F64 => Head::F64(f64::from_be_bytes(self.array()?)),
            Marker::FixStr(n) => Head::Str(self.body(usize::from(n), depth, 2)?),
            Marker::Str8 => {
                let n = usize::from(self.byte()?);
                Head::Str(self.body(n, depth, 2)?)
            }
            Marker::Str16 => {
                let n = usize::from(self.u16()?);
                Head::Str(self.body(n, depth, 2)?)
            }
            Marker::Str32 => {
                let n = self.u32()? as usize;
                Head::Str(self.body(n, depth, 2)?)
            }
            Marker::Bin8 => {
                let n = usize::from(self.byte()?);
                Head::Bin(self.body(n, depth, 1)?)
            }
            Marker::Bin16 => {
                let n = usize::from(self.u16()?);
                Head::Bin(self.body(n, depth, 1)?)
            }
            Marker::Bin32 => {
                let n = self.u32()? as usize;
                Head::Bin(self.body(n, depth, 1)?)
            }
            Marker::FixExt1 => self.ext(1, depth)?,
            Marker::FixExt2 => self.ext(2, depth)?,
            Marker::FixExt4 => self.ext(4, depth)?,
            Marker::FixExt8 => self.ext(8, depth)?,
            Marker::FixExt16 => self.ext(16, depth)?,
            Marker::Ext8 => {
                let n = usize::from(self.byte()?);
                self.ext(n, depth)?
            }
            Marker::Ext16 => {
                let n = usize::from(self.u16()?);
                self.ext(n, depth)?
            }
            Marker::Ext32 => {
                let n = self.u32()? as usize;
                self.ext(n, depth)?
            }
            Marker::FixArray(n) => Head::Array {
                len: u32::from(n),
                depth: self.descend(depth)?,
            },
            Marker::Array16 => {
                let len = u32::from(self.u16()?);
                Head::Array {
                    len,
                    depth: self.descend(depth)?,
                }
            }
            Marker::Array32 => {
                let len = self.u32()?;
                Head::Array {
                    len,
                    depth: self.descend(depth)?,
                }
            }
            Marker::FixMap(n) => Head::Map {
                len: u32::from(n),
                depth: self.descend(depth)?,
            },
            Marker::Map16 => {
                let len = u32::from(self.u16()?);
                Head::Map {
                    len,
                    depth: self.descend(depth)?,
                }
            }
            Marker::Map32 => {
                let len = self.u32()?;
                Head::Map {
                    len,
                    depth: self.descend(depth)?,
                }
            }
        })
    }

    /// [`Self::head`]'s fast path for an integer: `None` (nothing read) for anything else, an
    /// integer cut short, or no depth left. Free of branches on the integer's width, which varies
    /// at random in a run of token ids.
    #[inline(always)]
    fn int(&mut self, depth: usize) -> Option<Head<'a>> {
        let (&marker, rest) = self.buf.split_first()?;
        if depth == 0 {
            return None;
        }
        if marker < 0x80 {
            self.buf = rest;
            return Some(Head::Uint(u64::from(marker)));
        }
        // uint8/16/32/64 (0xcc..=0xcf) and int8/16/32/64 (0xd0..=0xd3): 1, 2, 4 or 8 bytes,
        // big-endian.
        let signed = match marker & 0xfc {
            0xcc => false,
            0xd0 => true,
            _ if marker >= 0xe0 => {
                self.buf = rest;
                return Some(Head::Int(i64::from(marker as i8)));
            }
            _ => return None,
        };
        let n = 1usize << (marker & 3);
        let word = match rest.first_chunk::<8>() {
            Some(word) => u64::from_be_bytes(*word),
            None => rest
                .get(..n)?
                .iter()
                .fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
                .wrapping_shl(64 - 8 * n as u32),
        };
        self.buf = &rest[n..];
        let shift = 64 - 8 * n as u32;
        Some(if signed {
            let x = (word as i64) >> shift;
            if x < 0 {
                Head::Int(x)
            } else {
                Head::Uint(x as u64)
            }
        } else {
            Head::Uint(word >> shift)
        })
    }

    /// The `n` bytes of a string or binary, which need `levels` levels left.
    #[inline]
    fn body(&mut self, n: usize, depth: usize, levels: usize) -> Result<&'a [u8], DecodeError> {
        if depth < levels {
            return Err(self.too_deep());
        }
        self.take(n)
    }

    /// An extension's type byte and `n` bytes, which need 2 levels left.
    fn ext(&mut self, n: usize, depth: usize) -> Result<Head<'a>, DecodeError> {
        self.byte()?;
        self.body(n, depth, 2)?;
        Ok(Head::Ext)
    }

    /// Skips what follows `head`: an array's or map's elements.
    fn skip_body(&mut self, head: Head<'a>) -> Result<(), DecodeError> {
        let (values, depth) = match head {
            Head::Array { len, depth } => (u64::from(len), depth),
            Head::Map { len, depth } => (2 * u64::from(len), depth),
            _ => return Ok(()),
        };
        for _ in 0..values {
            self.skip(depth)?;
        }
        Ok(())
    }

    /// Skips one value, checking it is well-formed; allocates nothing.
    fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        let head = self.head(depth)?;
        self.skip_body(head)
    }

    /// Reads one value whole: its head, an array's or map's elements skipped.
    fn whole(&mut self, depth: usize) -> Result<Head<'a>, DecodeError> {
        let head = self.head(depth)?;
        self.skip_body(head)?;
        Ok(head)
    }

    /// Skips one value and returns its bytes.
    fn skip_and_take(&mut self, depth: usize) -> Result<&'a [u8], DecodeError> {
        let start = self.buf;
        self.skip(depth)?;
        Ok(&start[..start.len() - self.buf.len()])
    }
}

/// The medium of a shared pool's events (vLLM 0.33's `MEDIUM_STORAGE`).
pub const SHARED_MEDIUM: &str = "STORAGE";

/// Encodes kvbm's events as one payload in vLLM's current map form (media `GPU`, `CPU_PINNED`,
/// `DISK`; `BlockStored` with a map16 header, as vLLM's encoder writes it; a shared pool's events
/// with medium `STORAGE`, `locality` `REMOTE` and the pool in `ownership`, the fields' order
/// vLLM's struct has).
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: Option<u32>, out: &mut Vec<u8>) {
    use rmp::encode as w;
    done(w::write_array_len(out, 3));
    done(w::write_f64(out, ts));
    done(w::write_array_len(out, events.len() as u32));
    for event in events {
        enum View<'a> {
            Stored(&'a BlockStored),
            Removed(&'a BlockRemoved),
            Cleared,
        }
        let (view, pool) = match event {
            KvEvent::BlockStored(s) => (View::Stored(s), None),
            KvEvent::BlockRemoved(r) => (View::Removed(r), None),
            KvEvent::AllBlocksCleared => (View::Cleared, None),
            KvEvent::SharedStored { pool, stored } => (View::Stored(stored), Some(pool)),
            KvEvent::SharedRemoved { pool, removed } => (View::Removed(removed), Some(pool)),
        };
        // A shared pool's event: vLLM 0.33's fields for a tier that is not the publisher's.
        let medium = |tier: Tier| match pool {
            Some(_) => SHARED_MEDIUM,
            None => tier.medium_name(),
        };
        let remote = |out: &mut Vec<u8>| {
            if let Some(pool) = pool {
                write_str(out, "locality");
                write_str(out, "REMOTE");
                write_str(out, "ownership");
                write_str(out, pool);
            }
        };
        let extra = if pool.is_some() { 2 } else { 0 };
        match view {
            View::Stored(s) => {
                // map16 with 8 entries: vLLM's BlockStored (10 for a shared pool's).
                out.extend_from_slice(&[0xde, 0x00, 0x08 + extra]);
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
                write_str(out, medium(s.tier));
                write_str(out, "lora_name");
                match &s.lora_name {
                    Some(name) => write_str(out, name),
                    None => done(w::write_nil(out)),
                }
                remote(out);
            }
            View::Removed(r) => {
                done(w::write_map_len(out, 3 + u32::from(extra)));
                write_str(out, "type");
                write_str(out, "BlockRemoved");
                write_str(out, "block_hashes");
                write_hashes(out, &r.block_hashes);
                write_str(out, "medium");
                write_str(out, medium(r.tier));
                remote(out);
            }
            View::Cleared => {
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
