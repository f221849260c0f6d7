//! The in-place msgpack decoder against the tree-based one it replaced (`wire_reference`), on
//! generated batches of every shape and on damaged bytes; and what it allocates.
//!
//! Agreement is exact (the same batch, or the same error with the same text) except for malformed
//! msgpack, where both fail with [`DecodeError::Msgpack`] but word the cause differently.

mod wire_reference;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;

use kvbm_events::{
    decode_batch, encode_batch, BlockRemoved, BlockStored, DecodeError, KvEvent, Location,
    SequenceHash, Tier, WireBatch, WireEvent,
};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use wire_reference::decode_batch_reference;

// ---------------------------------------------------------------------------------------------
// Allocation accounting, per thread (tests run on threads of their own).

struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    // `try_with`: the thread-local may be gone while a thread is torn down.
    let _ = ALLOCATED.try_with(|a| a.set(a.get() + bytes));
}

// SAFETY: every call is passed on to `System` unchanged; counting touches no allocator state.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract for `alloc` is `System::alloc`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: as for `dealloc`, and the caller's contract for `realloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// `f`'s result and the bytes it allocated on this thread.
fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.with(Cell::get);
    let out = f();
    (out, ALLOCATED.with(Cell::get) - before)
}

// ---------------------------------------------------------------------------------------------
// Msgpack of any form: each value with a chosen width, not only the shortest encoding.

/// A msgpack value; `w` picks the encoding: 0 the shortest, each step up one wider form.
#[derive(Debug, Clone)]
enum M {
    Nil,
    /// `0xc1`, which msgpack reserves and rmpv reads as nil.
    Reserved,
    Bool(bool),
    Uint(u64, u8),
    /// Encoded with the signed markers (negative or not).
    Int(i64, u8),
    F32(f32),
    F64(f64),
    Str(Vec<u8>, u8),
    Bin(Vec<u8>, u8),
    Ext(i8, Vec<u8>, u8),
    Array(Vec<M>, u8),
    Map(Vec<(M, M)>, u8),
}

fn s(text: &str) -> M {
    M::Str(text.as_bytes().to_vec(), 0)
}

/// Of the forms that fit (`fits`, narrowest first), the shortest widened `w` times (as far as
/// there are wider ones).
fn pick(fits: &[bool], w: u8) -> usize {
    let fitting: Vec<usize> = (0..fits.len()).filter(|&i| fits[i]).collect();
    fitting[usize::from(w).min(fitting.len() - 1)]
}

fn write_len(out: &mut Vec<u8>, len: usize, w: u8, fix: Option<(u8, usize)>, wide: [u8; 3]) {
    let fix_fits = fix.is_some_and(|(_, max)| len <= max);
    let eight = wide[0] != 0;
    let fits = [
        fix_fits,
        eight && len <= 0xff,
        len <= 0xffff,
        len <= 0xffff_ffff,
    ];
    match pick(&fits, w) {
        0 => out.push(fix.unwrap().0 | len as u8),
        1 => out.extend([wide[0], len as u8]),
        2 => {
            out.push(wide[1]);
            out.extend((len as u16).to_be_bytes());
        }
        _ => {
            out.push(wide[2]);
            out.extend((len as u32).to_be_bytes());
        }
    }
}

fn encode(m: &M, out: &mut Vec<u8>) {
    match m {
        M::Nil => out.push(0xc0),
        M::Reserved => out.push(0xc1),
        M::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        M::Uint(x, w) => {
            let x = *x;
            let fits = [x < 0x80, x <= 0xff, x <= 0xffff, x <= 0xffff_ffff, true];
            match pick(&fits, *w) {
                0 => out.push(x as u8),
                1 => out.extend([0xcc, x as u8]),
                2 => {
                    out.push(0xcd);
                    out.extend((x as u16).to_be_bytes());
                }
                3 => {
                    out.push(0xce);
                    out.extend((x as u32).to_be_bytes());
                }
                _ => {
                    out.push(0xcf);
                    out.extend(x.to_be_bytes());
                }
            }
        }
        M::Int(x, w) => {
            let x = *x;
            let fits = [
                (-32..=127).contains(&x),
                i8::try_from(x).is_ok(),
                i16::try_from(x).is_ok(),
                i32::try_from(x).is_ok(),
                true,
            ];
            match pick(&fits, *w) {
                0 => out.push(x as i8 as u8),
                1 => out.extend([0xd0, x as i8 as u8]),
                2 => {
                    out.push(0xd1);
                    out.extend((x as i16).to_be_bytes());
                }
                3 => {
                    out.push(0xd2);
                    out.extend((x as i32).to_be_bytes());
                }
                _ => {
                    out.push(0xd3);
                    out.extend(x.to_be_bytes());
                }
            }
        }
        M::F32(x) => {
            out.push(0xca);
            out.extend(x.to_be_bytes());
        }
        M::F64(x) => {
            out.push(0xcb);
            out.extend(x.to_be_bytes());
        }
        M::Str(b, w) => {
            write_len(out, b.len(), *w, Some((0xa0, 31)), [0xd9, 0xda, 0xdb]);
            out.extend(b);
        }
        M::Bin(b, w) => {
            write_len(out, b.len(), *w, None, [0xc4, 0xc5, 0xc6]);
            out.extend(b);
        }
        M::Ext(ty, b, w) => {
            let fixext = match b.len() {
                1 => Some(0xd4),
                2 => Some(0xd5),
                4 => Some(0xd6),
                8 => Some(0xd7),
                16 => Some(0xd8),
                _ => None,
            };
            match fixext {
                Some(marker) if *w == 0 => out.push(marker),
                _ => write_len(
                    out,
                    b.len(),
                    w.saturating_sub(u8::from(fixext.is_some())),
                    None,
                    [0xc7, 0xc8, 0xc9],
                ),
            }
            out.push(*ty as u8);
            out.extend(b);
        }
        M::Array(items, w) => {
            write_len(out, items.len(), *w, Some((0x90, 15)), [0, 0xdc, 0xdd]);
            for item in items {
                encode(item, out);
            }
        }
        M::Map(entries, w) => {
            write_len(out, entries.len(), *w, Some((0x80, 15)), [0, 0xde, 0xdf]);
            for (k, v) in entries {
                encode(k, out);
                encode(v, out);
            }
        }
    }
}

fn bytes_of(m: &M) -> Vec<u8> {
    let mut out = Vec::new();
    encode(m, &mut out);
    out
}

// ---------------------------------------------------------------------------------------------
// Strategies.

fn width() -> impl Strategy<Value = u8> {
    prop_oneof![6 => Just(0u8), 1 => 1u8..4]
}

/// How far a generated batch strays: `bad` weighs values of the wrong type or range (against
/// about 10 for the right ones); `levels`, how deep values the decoder skips nest (past 3, deeper
/// than the depth limit allows where an event's field sits).
#[derive(Debug, Clone, Copy)]
struct Wild {
    bad: u32,
    levels: u32,
}

/// Only what decodes (save for the odd placeholder or unknown event, which are skipped).
const TAME: Wild = Wild { bad: 0, levels: 3 };
/// Anything, often.
const WILD: Wild = Wild { bad: 1, levels: 6 };

/// Text, sometimes not UTF-8.
fn text() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => "[a-zA-Z_]{0,12}".prop_map(String::into_bytes),
        1 => Just(vec![0xff, 0xfe, b'x']),
        1 => proptest::collection::vec(any::<u8>(), 0..40),
    ]
}

fn scalar() -> impl Strategy<Value = M> {
    prop_oneof![
        Just(M::Nil),
        Just(M::Reserved),
        any::<bool>().prop_map(M::Bool),
        (any::<u64>(), width()).prop_map(|(x, w)| M::Uint(x, w)),
        (0u64..300, width()).prop_map(|(x, w)| M::Uint(x, w)),
        (any::<i64>(), width()).prop_map(|(x, w)| M::Int(x, w)),
        any::<f32>().prop_map(M::F32),
        any::<f64>().prop_map(M::F64),
        (text(), width()).prop_map(|(b, w)| M::Str(b, w)),
        (proptest::collection::vec(any::<u8>(), 0..20), width()).prop_map(|(b, w)| M::Bin(b, w)),
        (
            any::<i8>(),
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..20),
                proptest::collection::vec(any::<u8>(), 16..=16)
            ],
            width()
        )
            .prop_map(|(t, b, w)| M::Ext(t, b, w)),
    ]
}

/// Any value, arrays and maps nested up to `levels` deep.
fn any_value(levels: u32) -> impl Strategy<Value = M> {
    scalar().prop_recursive(levels, 48, 6, |inner| {
        prop_oneof![
            (proptest::collection::vec(inner.clone(), 0..6), width())
                .prop_map(|(v, w)| M::Array(v, w)),
            (
                proptest::collection::vec((inner.clone(), inner), 0..4),
                width()
            )
                .prop_map(|(v, w)| M::Map(v, w)),
        ]
    })
}

fn uint(range: impl Strategy<Value = u64>) -> impl Strategy<Value = M> {
    (range, width()).prop_map(|(x, w)| M::Uint(x, w))
}

fn int(range: impl Strategy<Value = i64>) -> impl Strategy<Value = M> {
    (range, width()).prop_map(|(x, w)| M::Int(x, w))
}

/// `good`, or, when `x` allows bad values, `bad` once in `1 + odds` draws.
fn or_bad(
    x: Wild,
    odds: u32,
    good: impl Strategy<Value = M> + 'static,
    bad: impl Strategy<Value = M> + 'static,
) -> BoxedStrategy<M> {
    if x.bad == 0 {
        good.boxed()
    } else {
        prop_oneof![odds => good, x.bad => bad].boxed()
    }
}

/// Some `v` with probability `p` (0 and 1 included), else none.
fn maybe(p: f64, v: impl Strategy<Value = M> + 'static) -> BoxedStrategy<Option<M>> {
    if p >= 1.0 {
        v.prop_map(Some).boxed()
    } else if p <= 0.0 {
        Just(None).boxed()
    } else {
        proptest::option::weighted(p, v).boxed()
    }
}

fn hash(x: Wild) -> impl Strategy<Value = M> {
    or_bad(
        x,
        20,
        prop_oneof![
            3 => uint(any::<u64>()),
            1 => int(any::<i64>()),
            1 => int(-70_000i64..70_000),
            1 => (proptest::collection::vec(any::<u8>(), 1..12), width())
                .prop_map(|(b, w)| M::Bin(b, w)),
        ],
        prop_oneof![Just(M::Bin(vec![], 0)), any_value(x.levels)],
    )
}

fn array_of(
    item: impl Strategy<Value = M> + 'static,
    max: usize,
    x: Wild,
) -> impl Strategy<Value = M> {
    or_bad(
        x,
        10,
        (proptest::collection::vec(item, 0..max), width()).prop_map(|(v, w)| M::Array(v, w)),
        prop_oneof![Just(M::Nil), any_value(x.levels)],
    )
}

fn token(x: Wild) -> impl Strategy<Value = M> {
    or_bad(
        x,
        100,
        prop_oneof![
            50 => uint(0u64..200_000),
            2 => uint(0u64..=u64::from(u32::MAX)),
            2 => int(0i64..1000),
        ],
        prop_oneof![uint(any::<u64>()), int(i64::MIN..0), any_value(x.levels)],
    )
}

fn token_ids(x: Wild) -> impl Strategy<Value = M> {
    prop_oneof![20 => array_of(token(x), 40, x), 1 => Just(M::Nil)]
}

fn block_size(x: Wild) -> impl Strategy<Value = M> {
    or_bad(
        x,
        20,
        prop_oneof![5 => uint(0u64..64), 1 => int(0i64..64), 1 => Just(M::Nil)],
        prop_oneof![uint(any::<u64>()), int(-300i64..0), any_value(x.levels)],
    )
}

fn one_of(names: &'static [&'static str]) -> impl Strategy<Value = M> {
    (proptest::sample::select(names), width()).prop_map(|(n, w)| M::Str(n.as_bytes().to_vec(), w))
}

const LORAS: &[&str] = &["lora-a", "lora-b"];

/// Anything: a name that is not a string is no name.
fn lora_name(x: Wild) -> impl Strategy<Value = M> {
    prop_oneof![3 => one_of(LORAS), 2 => Just(M::Nil), 1 => any_value(x.levels)]
}

/// Anything: any id makes the adapter unhashable.
fn lora_id(x: Wild) -> impl Strategy<Value = M> {
    prop_oneof![3 => Just(M::Nil), 2 => uint(0u64..5), 1 => any_value(x.levels)]
}

/// vLLM 0.33's `kv_cache_spec_kind`: its names, others, nil; anything when `x` allows.
fn spec_kind(x: Wild) -> impl Strategy<Value = M> {
    or_bad(
        x,
        20,
        prop_oneof![
            3 => one_of(&["full_attention", "sliding_window", "mamba", "chunked_local_attention"]),
            1 => one_of(&["Full_Attention", "", "swa"]),
            1 => Just(M::Nil),
        ],
        any_value(x.levels),
    )
}

fn medium(x: Wild) -> impl Strategy<Value = M> {
    or_bad(
        x,
        20,
        prop_oneof![
            3 => one_of(&[
                "GPU", "gpu", "CPU_PINNED", "cpu", "CPU_TIER1", "DISK", "STORAGE", "NVME",
                "CPU_TIER2", "Device", "EXTERNAL", "REMOTE", "shared",
            ]),
            1 => Just(M::Nil),
        ],
        any_value(x.levels),
    )
}

/// Anything: what is not a string is not remote.
fn locality(x: Wild) -> impl Strategy<Value = M> {
    prop_oneof![
        3 => one_of(&["REMOTE", "remote", "LOCAL", "Remote"]),
        2 => Just(M::Nil),
        1 => any_value(x.levels),
    ]
}

/// A shared pool's name, or anything else.
fn ownership(x: Wild) -> impl Strategy<Value = M> {
    prop_oneof![
        6 => one_of(&["pool-a", "kvbm:0123456789abcdef"]),
        1 => one_of(&[""]),
        2 => Just(M::Nil),
        1 => any_value(x.levels),
    ]
}

/// vLLM's per-block `extra_keys`: nil, or an array of nil or arrays of keys.
fn extra_keys(x: Wild) -> impl Strategy<Value = M> {
    let key = prop_oneof![
        3 => one_of(LORAS),
        3 => one_of(&["salt-1", "salt-2"]),
        2 => (text(), any::<u32>()).prop_map(|(id, off)| M::Array(
            vec![M::Str(id, 0), M::Uint(u64::from(off), 0)],
            0
        )),
        1 => (proptest::collection::vec(any::<u8>(), 0..8), width())
            .prop_map(|(b, w)| M::Bin(b, w)),
        // Keys sit 2 levels deeper than other fields.
        1 => any_value(x.levels - 2),
    ];
    let entry = or_bad(
        x,
        20,
        prop_oneof![
            1 => Just(M::Nil),
            2 => (proptest::collection::vec(key, 0..4), width()).prop_map(|(v, w)| M::Array(v, w)),
        ],
        any_value(x.levels),
    );
    prop_oneof![10 => array_of(entry, 5, x), 1 => Just(M::Nil)]
}

fn event_type(x: Wild) -> impl Strategy<Value = M> {
    or_bad(
        x,
        30,
        prop_oneof![
            30 => one_of(&["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
            1 => one_of(&["Other", "blockstored", ""]),
        ],
        prop_oneof![
            Just(M::Str(b"Block\xffStored".to_vec(), 0)),
            any_value(x.levels)
        ],
    )
}

/// The known fields, each given or not, in a fixed order.
fn known_fields(x: Wild) -> impl Strategy<Value = Vec<(&'static str, Option<M>)>> {
    // A field every event needs is missing only when `x` allows bad values.
    let needed = if x.bad == 0 { 1.0 } else { 0.95 };
    let opt = maybe;
    (
        (
            opt(needed, event_type(x).boxed()),
            opt(needed, array_of(hash(x), 8, x).boxed()),
            opt(0.6, prop_oneof![5 => hash(x), 1 => Just(M::Nil)].boxed()),
            opt(0.9, token_ids(x).boxed()),
            opt(0.9, block_size(x).boxed()),
        ),
        (
            opt(0.3, lora_id(x).boxed()),
            opt(0.4, lora_name(x).boxed()),
            opt(0.7, medium(x).boxed()),
            opt(0.4, locality(x).boxed()),
            opt(0.4, extra_keys(x).boxed()),
        ),
        (
            opt(0.4, block_size(x).boxed()),
            opt(0.3, spec_kind(x).boxed()),
            opt(0.3, block_size(x).boxed()),
            opt(0.6, ownership(x).boxed()),
        ),
    )
        .prop_map(
            |(
                (ty, hashes, parent, tokens, size),
                (id, name, med, loc, extra),
                (group, kind, window, pool),
            )| {
                vec![
                    ("type", ty),
                    ("block_hashes", hashes),
                    ("parent_block_hash", parent),
                    ("token_ids", tokens),
                    ("block_size", size),
                    ("lora_id", id),
                    ("lora_name", name),
                    ("medium", med),
                    ("locality", loc),
                    ("ownership", pool),
                    ("extra_keys", extra),
                    ("group_idx", group),
                    ("kv_cache_spec_kind", kind),
                    ("kv_cache_spec_sliding_window", window),
                ]
            },
        )
}

/// An unknown field: a string key (or, rarely, any value as the key) and any value.
fn unknown_field(x: Wild) -> impl Strategy<Value = (M, M)> {
    let key = prop_oneof![
        6 => one_of(&["ts", "weird", "extra", "typ", "block_hashes_v2", "Type"]),
        1 => any_value(x.levels),
    ];
    (key, any_value(x.levels))
}

/// A map event: the known fields given, unknown ones, now and then a key repeated (with its value
/// again, or with any value when `x` allows bad ones), all in any order.
fn map_event(x: Wild) -> impl Strategy<Value = M> {
    let repeat = (
        0usize..10,
        maybe(if x.bad == 0 { 0.0 } else { 0.5 }, any_value(x.levels)),
    );
    (
        known_fields(x),
        proptest::collection::vec(unknown_field(x), 0..4),
        proptest::collection::vec(repeat, 0..2),
        width(),
    )
        .prop_flat_map(|(known, unknown, repeats, w)| {
            let mut entries: Vec<(M, M)> = known
                .iter()
                .filter_map(|(k, v)| v.clone().map(|v| (s(k), v)))
                .collect();
            for (i, value) in repeats {
                let (k, given) = &known[i];
                if let Some(value) = value.or_else(|| given.clone()) {
                    entries.push((s(k), value));
                }
            }
            entries.extend(unknown);
            Just(entries)
                .prop_shuffle()
                .prop_map(move |entries| M::Map(entries, w))
        })
}

/// A legacy positional event, cut short (only when `x` allows bad values) or lengthened.
fn array_event(x: Wild) -> impl Strategy<Value = M> {
    let shortest = if x.bad == 0 { 2 } else { 0 };
    (
        known_fields(x),
        shortest..=8usize,
        proptest::collection::vec(any_value(x.levels), 0..2),
        width(),
    )
        .prop_map(|(known, len, more, w)| {
            // Positions: type, block_hashes, parent, token_ids, block_size, lora_id, medium; or
            // for a removal type, block_hashes, medium.
            let removal = matches!(&known[0].1, Some(M::Str(t, _)) if t == b"BlockRemoved");
            let positions: &[usize] = if removal {
                &[0, 1, 7]
            } else {
                &[0, 1, 2, 3, 4, 5, 7]
            };
            let mut items: Vec<M> = positions
                .iter()
                .map(|&i| known[i].1.clone().unwrap_or(M::Nil))
                .take(len)
                .collect();
            if len == 8 {
                items.extend(more);
            }
            M::Array(items, w)
        })
}

fn event(x: Wild) -> impl Strategy<Value = M> {
    or_bad(
        x,
        30,
        prop_oneof![2 => map_event(x), 1 => array_event(x)],
        any_value(x.levels),
    )
}

/// A payload: mostly `[ts, events, rank]`, sometimes with more parts; when `x` allows bad values,
/// sometimes with fewer, or none of that shape.
fn batch(x: Wild) -> impl Strategy<Value = M> {
    let ts = or_bad(
        x,
        20,
        prop_oneof![
            6 => any::<f64>().prop_map(M::F64),
            1 => any::<f32>().prop_map(M::F32),
            1 => uint(any::<u64>()),
            1 => int(any::<i64>()),
            1 => int(-70_000i64..70_000),
        ],
        any_value(x.levels),
    );
    let events = or_bad(
        x,
        30,
        (proptest::collection::vec(event(x), 0..4), width()).prop_map(|(v, w)| M::Array(v, w)),
        any_value(x.levels),
    );
    let rank = or_bad(
        x,
        20,
        prop_oneof![3 => uint(0u64..16), 1 => int(0i64..300), 1 => Just(M::Nil)],
        prop_oneof![uint(any::<u64>()), int(-300i64..0), any_value(x.levels)],
    );
    let parts = (
        ts,
        events,
        maybe(0.9, rank),
        proptest::collection::vec(any_value(x.levels), 0..2),
        width(),
        if x.bad == 0 {
            Just(false).boxed()
        } else {
            proptest::bool::weighted(0.05).boxed()
        },
    )
        .prop_map(|(ts, events, rank, more, w, cut)| {
            let mut parts = vec![ts, events];
            if let Some(rank) = rank {
                parts.push(rank);
                parts.extend(more);
            }
            if cut {
                parts.truncate(1);
            }
            M::Array(parts, w)
        });
    or_bad(x, 30, parts, any_value(x.levels))
}

/// Tame batches and wild ones.
fn any_batch() -> impl Strategy<Value = M> {
    prop_oneof![batch(TAME), batch(WILD)]
}

/// A change to a payload's bytes.
#[derive(Debug, Clone)]
enum Damage {
    Truncate(prop::sample::Index),
    Flip(prop::sample::Index, u8),
    Set(prop::sample::Index, u8),
    Insert(prop::sample::Index, u8),
    Delete(prop::sample::Index),
    Append(u8),
}

fn damage() -> impl Strategy<Value = Damage> {
    // Bytes that change a value's type or claim a length.
    let marker = prop_oneof![
        any::<u8>(),
        proptest::sample::select(vec![
            0xc0u8, 0xc1, 0xc4, 0xc6, 0xc9, 0xcf, 0xd3, 0xd9, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0x9f,
            0x8f, 0xbf, 0xff, 0x00,
        ]),
    ];
    prop_oneof![
        any::<prop::sample::Index>().prop_map(Damage::Truncate),
        (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(i, m)| Damage::Flip(i, m)),
        (any::<prop::sample::Index>(), marker.clone()).prop_map(|(i, b)| Damage::Set(i, b)),
        (any::<prop::sample::Index>(), marker).prop_map(|(i, b)| Damage::Insert(i, b)),
        any::<prop::sample::Index>().prop_map(Damage::Delete),
        any::<u8>().prop_map(Damage::Append),
    ]
}

fn apply(bytes: &mut Vec<u8>, d: &Damage) {
    if bytes.is_empty() {
        return;
    }
    match d {
        Damage::Truncate(i) => bytes.truncate(i.index(bytes.len())),
        Damage::Flip(i, m) => {
            let i = i.index(bytes.len());
            bytes[i] ^= m;
        }
        Damage::Set(i, b) => {
            let i = i.index(bytes.len());
            bytes[i] = *b;
        }
        Damage::Insert(i, b) => bytes.insert(i.index(bytes.len() + 1), *b),
        Damage::Delete(i) => {
            bytes.remove(i.index(bytes.len()));
        }
        Damage::Append(b) => bytes.push(*b),
    }
}

// ---------------------------------------------------------------------------------------------
// Agreement.

/// The same batch (timestamps bit for bit, NaN included), or the same error: the same text for a
/// bad shape and the same count of trailing bytes; malformed msgpack is worded differently.
fn agree(bytes: &[u8]) -> Result<(), TestCaseError> {
    let new = decode_batch(bytes);
    let old = decode_batch_reference(bytes);
    let same = match (&new, &old) {
        (Ok(a), Ok(b)) => {
            a.ts.to_bits() == b.ts.to_bits()
                && WireBatch {
                    ts: 0.0,
                    ..a.clone()
                } == WireBatch {
                    ts: 0.0,
                    ..b.clone()
                }
        }
        (Err(DecodeError::Msgpack(_)), Err(DecodeError::Msgpack(_))) => true,
        (Err(a), Err(b)) => a == b,
        _ => false,
    };
    prop_assert!(
        same,
        "in place: {:?}\nreference: {:?}\nbytes: {:02x?}",
        new,
        old,
        bytes
    );
    Ok(())
}

fn engine_vectors() -> Vec<Vec<u8>> {
    let doc: serde_json::Value =
        serde_json::from_str(include_str!("data/kv-events-wire.json")).unwrap();
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            let hex = case["payload_hex"].as_str().unwrap();
            (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn generated_batches_decode_as_the_reference_does(payload in any_batch()) {
        agree(&bytes_of(&payload))?;
    }

    #[test]
    fn damaged_batches_decode_as_the_reference_does(
        payload in any_batch(),
        damages in proptest::collection::vec(damage(), 1..4),
    ) {
        let mut bytes = bytes_of(&payload);
        for d in &damages {
            apply(&mut bytes, d);
        }
        agree(&bytes)?;
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_decode_as_the_reference_does(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        agree(&bytes)?;
    }

    #[test]
    fn damaged_engine_vectors_decode_as_the_reference_does(
        case in any::<prop::sample::Index>(),
        damages in proptest::collection::vec(damage(), 0..4),
    ) {
        let vectors = engine_vectors();
        let mut bytes = vectors[case.index(vectors.len())].clone();
        for d in &damages {
            apply(&mut bytes, d);
        }
        agree(&bytes)?;
    }
}

#[test]
fn every_prefix_of_the_engine_vectors_decodes_as_the_reference_does() {
    for bytes in engine_vectors() {
        for cut in 0..=bytes.len() {
            agree(&bytes[..cut]).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-made cases where the two could part.

fn stored(entries: Vec<(M, M)>) -> Vec<u8> {
    bytes_of(&M::Array(
        vec![M::F64(1.0), M::Array(vec![M::Map(entries, 0)], 0), M::Nil],
        0,
    ))
}

fn u(x: u64) -> M {
    M::Uint(x, 0)
}

fn arr(items: Vec<M>) -> M {
    M::Array(items, 0)
}

#[test]
fn a_repeated_key_counts_at_its_first_occurrence() {
    // Nil first: absent, whatever follows.
    let bytes = stored(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), arr(vec![u(1)])),
        (s("token_ids"), arr(vec![u(5), u(6)])),
        (s("block_size"), u(2)),
        (s("medium"), M::Nil),
        (s("medium"), s("DISK")),
        (s("block_size"), u(4)),
    ]);
    agree(&bytes).unwrap();
    let batch = decode_batch(&bytes).unwrap();
    let WireEvent::Stored {
        location,
        block_size,
        ..
    } = &batch.events[0]
    else {
        panic!("{batch:?}")
    };
    assert_eq!((location, *block_size), (&Location::Local(Tier::Gpu), 2));
    // The type too: the first one decides, even when it is not a string.
    let bytes = stored(vec![(s("type"), u(1)), (s("type"), s("AllBlocksCleared"))]);
    agree(&bytes).unwrap();
    assert!(matches!(decode_batch(&bytes), Err(DecodeError::Shape(_))));
}

#[test]
fn fields_before_the_type_are_read_once_it_is_known() {
    for ty in ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"] {
        let bytes = stored(vec![
            (s("token_ids"), arr(vec![u(5), u(6)])),
            (s("block_hashes"), arr(vec![u(1), M::Int(-2, 0)])),
            (s("extra_keys"), arr(vec![arr(vec![s("salt")])])),
            (s("type"), s(ty)),
        ]);
        agree(&bytes).unwrap();
        assert!(decode_batch(&bytes).is_ok());
    }
}

#[test]
fn a_bad_shape_yields_to_malformed_msgpack_trailing_bytes_and_the_rank() {
    // An event with string hashes, then: a truncated event; a byte too many; a string rank.
    let bad = M::Map(
        vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), arr(vec![s("x")])),
        ],
        0,
    );
    let payload = |rank: M| bytes_of(&arr(vec![u(1), arr(vec![bad.clone()]), rank]));
    let mut truncated = payload(M::Nil);
    truncated[2] += 1; // one more event claimed than given
    agree(&truncated).unwrap();
    assert!(matches!(
        decode_batch(&truncated),
        Err(DecodeError::Msgpack(_))
    ));
    let mut trailing = payload(M::Nil);
    trailing.push(0);
    agree(&trailing).unwrap();
    assert_eq!(
        decode_batch(&trailing).unwrap_err(),
        DecodeError::TrailingBytes(1)
    );
    let rank = payload(s("x"));
    agree(&rank).unwrap();
    assert_eq!(
        decode_batch(&rank).unwrap_err().to_string(),
        "malformed KV event batch: the rank is not a small unsigned integer"
    );
}

#[test]
fn depth_is_counted_as_the_reference_counts_it() {
    // An unknown field nested n arrays deep around a scalar, a string, a binary or an extension.
    for leaf in [
        u(1),
        s("x"),
        M::Bin(vec![1], 0),
        M::Ext(1, vec![1], 0),
        arr(vec![]),
    ] {
        for n in 0..8 {
            let mut value = leaf.clone();
            for _ in 0..n {
                value = arr(vec![value]);
            }
            agree(&stored(vec![(s("type"), s("Other")), (s("deep"), value)])).unwrap();
        }
    }
}

#[test]
fn extra_keys_are_read_as_the_reference_reads_them() {
    let cases = [
        // The LoRA name, then the salt, on a prompt's first block.
        arr(vec![arr(vec![s("lora-a"), s("salt")]), M::Nil]),
        // A salt past the first block, a multimodal pair, a second salt.
        arr(vec![M::Nil, arr(vec![s("salt")])]),
        arr(vec![arr(vec![arr(vec![s("img"), u(0)])])]),
        arr(vec![arr(vec![s("salt"), s("again")])]),
        // Past the first unhashable block nothing more is read, malformed or not.
        arr(vec![arr(vec![u(3)]), u(7)]),
        arr(vec![u(7), arr(vec![u(3)])]),
        u(1),
    ];
    for keys in cases {
        for parent in [None, Some(u(9))] {
            let mut entries = vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), arr(vec![u(1), u(2)])),
                (s("token_ids"), arr(vec![u(5), u(6)])),
                (s("block_size"), u(1)),
                (s("lora_name"), s("lora-a")),
                (s("extra_keys"), keys.clone()),
            ];
            entries.extend(parent.map(|p| (s("parent_block_hash"), p)));
            agree(&stored(entries)).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Allocation.

#[test]
fn claimed_lengths_allocate_nothing() {
    let claim32 = |marker: u8| vec![marker, 0xff, 0xff, 0xff, 0xff];
    // The payload, the events, an event, a field of each kind, an unknown field of each kind.
    let mut cases: Vec<Vec<u8>> = vec![
        claim32(0xdd),
        [&[0x93, 0x01][..], &claim32(0xdd)].concat(),
        [&[0x93, 0x01, 0x91][..], &claim32(0xdf)].concat(),
        [&[0x93, 0x01, 0x91][..], &claim32(0xdd)].concat(),
    ];
    let event = |key: &str, value: &[u8]| {
        let mut b = vec![0x93, 0x01, 0x91, 0x82];
        b.extend(bytes_of(&s("type")));
        b.extend(bytes_of(&s("BlockStored")));
        b.extend(bytes_of(&s(key)));
        b.extend(value);
        b
    };
    for key in [
        "token_ids",
        "block_hashes",
        "extra_keys",
        "medium",
        "unknown",
    ] {
        for marker in [0xdd, 0xdf, 0xdb, 0xc6, 0xc9] {
            cases.push(event(key, &claim32(marker)));
        }
    }
    for bytes in cases {
        let (result, allocated) = allocated_by(|| decode_batch(&bytes));
        assert!(result.is_err(), "{bytes:02x?}");
        // The error's text, nothing more.
        assert!(allocated < 256, "{allocated} bytes for {bytes:02x?}");
        agree(&bytes).unwrap();
    }
}

/// A payload of kvbm's events with an engine's extras: unknown fields of every kind, events of an
/// unknown type and placeholders (all skipped).
fn with_extras(events: &[KvEvent], extras: bool) -> Vec<u8> {
    let junk = || {
        vec![
            (s("ext"), M::Ext(7, vec![0; 300], 2)),
            (s("bin"), M::Bin(vec![1; 5000], 0)),
            (
                s("nested"),
                arr(vec![M::Map(vec![(s("k"), arr(vec![s("v"); 200]))], 0); 3]),
            ),
            (u(5), M::F64(1.5)),
        ]
    };
    let mut out = Vec::new();
    for e in events {
        let mut entries = vec![(s("type"), s("BlockStored"))];
        let (hashes, tokens, size, medium) = match e {
            KvEvent::BlockStored(b) => (
                &b.block_hashes,
                b.token_ids.clone(),
                b.block_size,
                b.tier.medium_name(),
            ),
            KvEvent::BlockRemoved(b) => {
                entries[0].1 = s("BlockRemoved");
                (&b.block_hashes, vec![], 0, b.tier.medium_name())
            }
            KvEvent::AllBlocksCleared
            | KvEvent::SharedStored { .. }
            | KvEvent::SharedRemoved { .. } => unreachable!(),
        };
        entries.push((
            s("block_hashes"),
            arr(hashes.iter().map(|h| u(h.0)).collect()),
        ));
        if size > 0 {
            entries.push((
                s("token_ids"),
                arr(tokens.iter().map(|&t| u(u64::from(t))).collect()),
            ));
            entries.push((s("block_size"), u(u64::from(size))));
        }
        entries.push((s("medium"), s(medium)));
        if extras {
            entries.extend(junk());
        }
        out.push(M::Map(entries, 0));
        if extras {
            out.push(M::Map(
                [
                    vec![
                        (s("type"), s("SomethingNew")),
                        (s("token_ids"), arr(vec![u(1); 500])),
                    ],
                    junk(),
                ]
                .concat(),
                0,
            ));
            out.push(M::Map(
                vec![
                    (s("type"), s("BlockStored")),
                    (s("block_hashes"), arr(vec![])),
                    (s("token_ids"), arr(vec![])),
                    (s("block_size"), u(0)),
                ],
                0,
            ));
        }
    }
    bytes_of(&arr(vec![M::F64(2.0), arr(out), u(0)]))
}

fn some_events() -> Vec<KvEvent> {
    vec![
        KvEvent::BlockStored(BlockStored {
            tier: Tier::Gpu,
            block_hashes: (1..=40).map(SequenceHash).collect(),
            parent_hash: None,
            token_ids: (0..640).map(|t| t * 231).collect(),
            block_size: 16,
            lora_name: None,
        }),
        KvEvent::BlockRemoved(BlockRemoved {
            tier: Tier::Host,
            block_hashes: (1..=7).map(SequenceHash).collect(),
        }),
        KvEvent::BlockStored(BlockStored {
            tier: Tier::Disk,
            block_hashes: vec![SequenceHash(u64::MAX)],
            parent_hash: None,
            token_ids: (0..16).collect(),
            block_size: 16,
            lora_name: None,
        }),
    ]
}

/// The heap the decoded events hold.
fn kept_bytes(batch: &WireBatch) -> usize {
    let per_event = |e: &WireEvent| match e {
        WireEvent::Stored {
            block_hashes,
            token_ids,
            ..
        } => block_hashes.capacity() * 8 + token_ids.capacity() * 4,
        WireEvent::Removed { block_hashes, .. } => block_hashes.capacity() * 8,
        WireEvent::Cleared => 0,
    };
    batch.events.capacity() * std::mem::size_of::<WireEvent>()
        + batch.events.iter().map(per_event).sum::<usize>()
}

#[test]
fn unknown_fields_skipped_events_and_placeholders_allocate_nothing() {
    let events = some_events();
    let plain = with_extras(&events, false);
    let extras = with_extras(&events, true);
    assert!(extras.len() > 10 * plain.len());
    let (a, plain_allocated) = allocated_by(|| decode_batch(&plain).unwrap());
    let (b, extras_allocated) = allocated_by(|| decode_batch(&extras).unwrap());
    assert_eq!(a.events, b.events);
    assert_eq!((b.unknown_skipped, b.placeholders_skipped), (3, 3));
    assert_eq!(plain_allocated, extras_allocated);
    agree(&extras).unwrap();
}

#[test]
fn what_is_allocated_is_what_is_kept() {
    let mut bytes = Vec::new();
    let events = some_events();
    encode_batch(3.0, &events, Some(1), &mut bytes);
    let (batch, allocated) = allocated_by(|| decode_batch(&bytes).unwrap());
    assert_eq!(allocated, kept_bytes(&batch));
    let back: Vec<KvEvent> = batch.events.iter().map(|e| e.to_local().unwrap()).collect();
    assert_eq!(back, events);
    // The tree the reference builds first is many times that.
    let (_, reference_allocated) = allocated_by(|| decode_batch_reference(&bytes).unwrap());
    assert!(
        reference_allocated > 5 * allocated,
        "{reference_allocated} vs {allocated}"
    );
}

/// What `n` batches drawn from `strategy` decode to, by outcome.
fn outcomes(strategy: impl Strategy<Value = M>, n: usize) -> BTreeMap<String, usize> {
    let mut runner = TestRunner::deterministic();
    let mut seen = BTreeMap::new();
    let mut note = |what: &str, k: usize| *seen.entry(what.to_owned()).or_insert(0) += k;
    for _ in 0..n {
        let bytes = bytes_of(&strategy.new_tree(&mut runner).unwrap().current());
        match decode_batch(&bytes) {
            Ok(batch) => {
                note("ok", 1);
                note("placeholder", batch.placeholders_skipped);
                note("unknown", batch.unknown_skipped);
                for e in &batch.events {
                    match e {
                        WireEvent::Stored {
                            location,
                            parent,
                            lora_name,
                            cache_salt,
                            unhashable_from,
                            ..
                        } => {
                            note("stored", 1);
                            note("stored with a parent", usize::from(parent.is_some()));
                            note("lora", usize::from(lora_name.is_some()));
                            note("salt", usize::from(cache_salt.is_some()));
                            note("unhashable", usize::from(unhashable_from.is_some()));
                            note(
                                "not local",
                                usize::from(matches!(location, Location::NotLocal(_))),
                            );
                            note(
                                "shared pool",
                                usize::from(matches!(location, Location::Shared(_))),
                            );
                        }
                        WireEvent::Removed { .. } => note("removed", 1),
                        WireEvent::Cleared => note("cleared", 1),
                    }
                }
            }
            Err(DecodeError::Msgpack(_)) => note("msgpack", 1),
            Err(DecodeError::TrailingBytes(_)) => note("trailing", 1),
            Err(DecodeError::Shape(s)) => note(&s, 1),
            Err(e) => panic!("{e}"),
        }
    }
    seen
}

#[test]
fn the_generated_batches_cover_every_outcome() {
    let n = 2000;
    let tame = outcomes(batch(TAME), n);
    println!("tame: {tame:#?}");
    assert!(tame["ok"] > n * 9 / 10, "{tame:?}");
    for what in [
        "stored",
        "stored with a parent",
        "lora",
        "salt",
        "unhashable",
        "not local",
        "shared pool",
        "removed",
        "cleared",
        "placeholder",
        "unknown",
    ] {
        assert!(
            tame.get(what).copied().unwrap_or(0) > n / 100,
            "{what}: {tame:?}"
        );
    }
    let wild = outcomes(batch(WILD), 2 * n);
    println!("wild: {wild:#?}");
    // Every error the decoder has, but trailing bytes (only damage adds those).
    for what in [
        "ok",
        "msgpack",
        "the payload is not an array",
        "the payload has fewer than 2 elements",
        "the timestamp is not a number",
        "the events are not an array",
        "the rank is not a small unsigned integer",
        "an event is neither a map nor an array",
        "an event map without a string \"type\"",
        "an event array without a type name",
        "block_hashes is not an array",
        "block_hashes holds a non-integer",
        "token_ids is not an array",
        "a token id is not a u32",
        "block_size is not a u32",
        "parent_block_hash is not an integer",
        "medium is not a string",
        "extra_keys is not an array",
        "an extra_keys entry is neither nil nor an array",
    ] {
        assert!(wild.get(what).copied().unwrap_or(0) > 0, "{what}: {wild:?}");
    }
}
