//! The disk tier's policy and formats: which host blocks go to disk (admission, applied by the
//! leader), the identity kept with each disk block (so a restart can announce it again), the
//! layout fingerprint and store options of a cache file, and the zero-copy hand-off of host
//! blocks to kvbm-disk ([`handoff`], used by the worker).
//!
//! Invariants (the mechanism lives in `crate::worker`, the decisions in `crate::leader`):
//! - A disk block is findable (and announced) as soon as its write is planned; the worker reads a
//!   slot only after every queued write into it, and a failed write's block leaves the tier.
//! - A block read back that fails verification (torn, foreign, corrupt) is a miss, never data,
//!   and leaves the tier.

pub(crate) mod handoff;

use std::collections::HashMap;
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvbm_disk::{CacheFileOptions, EngineChoice, StoreOptions};
use kvbm_events::SequenceHash;

use crate::layout::KvLayout;
use crate::pool::BlockIdentity;
use crate::CoreError;

/// A block is admitted to disk when its decayed sighting count reaches this: a second sighting
/// within about one half-life of the first.
pub const ADMIT_THRESHOLD: f64 = 1.5;
/// Half-life of sighting counts.
pub const ADMISSION_HALF_LIFE: Duration = Duration::from_secs(600);
/// Hashes the admission filter remembers at most.
pub const ADMISSION_ENTRIES_MAX: usize = 1 << 20;

/// Bytes one block of `kv` takes on disk: its contiguous stride plus the block header.
pub fn slot_bytes(kv: &KvLayout) -> usize {
    kv.contiguous_stride_bytes() + kvbm_disk::format::HEADER_BYTES
}

/// Fingerprint of a KV layout and of the canonical order of a block's bytes (the GPU layout's
/// [`BlockLayout::geometry_id`]), stored with the disk cache: a file written for another layout
/// is discarded on open.
pub fn layout_fingerprint(kv: &KvLayout, geometry_id: u64) -> u64 {
    let fields = [
        kv.num_layers as u64,
        kv.outer_dim as u64,
        kv.block_size_tokens as u64,
        kv.inner_dim as u64,
        kv.dtype_bytes as u64,
        geometry_id,
    ];
    let bytes: Vec<u8> = fields.iter().flat_map(|f| f.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// The disk admission policy: "seen at least twice, counts decaying over time" (as Dynamo's
/// disk offload filter), or everything when disabled.
#[derive(Debug)]
pub struct Admission {
    disabled: bool,
    half_life: Duration,
    entries: HashMap<SequenceHash, (f64, Instant)>,
}

impl Admission {
    /// A filter; `disabled` admits every block on first sight.
    pub fn new(disabled: bool, half_life: Duration) -> Self {
        Self {
            disabled,
            half_life,
            entries: HashMap::new(),
        }
    }

    /// Records a sighting of `hash` at `now`; true when the block should go to disk.
    pub fn observe(&mut self, hash: SequenceHash, now: Instant) -> bool {
        if self.disabled {
            return true;
        }
        if self.entries.len() >= ADMISSION_ENTRIES_MAX && !self.entries.contains_key(&hash) {
            self.shrink(now);
        }
        let half_life = self.half_life.as_secs_f64().max(f64::MIN_POSITIVE);
        let entry = self.entries.entry(hash).or_insert((0.0, now));
        let age = now.saturating_duration_since(entry.1).as_secs_f64();
        entry.0 = entry.0 * 0.5f64.powf(age / half_life) + 1.0;
        entry.1 = now;
        entry.0 >= ADMIT_THRESHOLD
    }

    /// Forgets the weakest half of the entries (bounded memory).
    fn shrink(&mut self, now: Instant) {
        let half_life = self.half_life.as_secs_f64().max(f64::MIN_POSITIVE);
        let mut scored: Vec<(f64, SequenceHash)> = self
            .entries
            .iter()
            .map(|(h, (count, at))| {
                (
                    count
                        * 0.5f64.powf(now.saturating_duration_since(*at).as_secs_f64() / half_life),
                    *h,
                )
            })
            .collect();
        scored.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, h) in scored.iter().take(scored.len() / 2 + 1) {
            self.entries.remove(h);
        }
    }

    /// Hashes remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The metadata kvbm keeps with a disk block: enough to announce it after a restart.
/// `version 1 u8 | flags u8 (1 = parent, 2 = lora, 4 = group) | parent u64 | tokens u32 count,
/// u32 each | lora length u16, bytes | group u16 (with flag 4)`, little-endian.
pub fn encode_identity(identity: &BlockIdentity) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + identity.tokens.len() * 4);
    out.push(1);
    let flags = u8::from(identity.parent.is_some())
        | (u8::from(identity.lora_name.is_some()) << 1)
        | (u8::from(identity.group.is_some()) << 2);
    out.push(flags);
    out.extend_from_slice(&identity.parent.map_or(0, |p| p.0).to_le_bytes());
    out.extend_from_slice(&(identity.tokens.len() as u32).to_le_bytes());
    for t in identity.tokens.iter() {
        out.extend_from_slice(&t.to_le_bytes());
    }
    let lora = identity.lora_name.as_deref().unwrap_or("").as_bytes();
    out.extend_from_slice(&(lora.len().min(u16::MAX as usize) as u16).to_le_bytes());
    out.extend_from_slice(&lora[..lora.len().min(u16::MAX as usize)]);
    if let Some(group) = identity.group {
        out.extend_from_slice(&group.to_le_bytes());
    }
    out
}

/// Reads what [`encode_identity`] wrote for the block with `hash`; `None` for anything else.
pub fn decode_identity(hash: SequenceHash, bytes: &[u8]) -> Option<BlockIdentity> {
    let (&version, rest) = bytes.split_first()?;
    let (&flags, rest) = rest.split_first()?;
    if version != 1 || flags & !7 != 0 {
        return None;
    }
    let parent = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
    let count = u32::from_le_bytes(rest.get(8..12)?.try_into().ok()?) as usize;
    let tokens_end = 12usize.checked_add(count.checked_mul(4)?)?;
    let tokens: Vec<u32> = rest
        .get(12..tokens_end)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let lora_len =
        u16::from_le_bytes(rest.get(tokens_end..tokens_end + 2)?.try_into().ok()?) as usize;
    let lora_end = tokens_end + 2 + lora_len;
    let lora = rest.get(tokens_end + 2..lora_end)?;
    let group = if flags & 4 != 0 {
        Some(u16::from_le_bytes(
            rest.get(lora_end..lora_end + 2)?.try_into().ok()?,
        ))
    } else {
        None
    };
    if rest.len() != lora_end + 2 * usize::from(group.is_some()) {
        return None;
    }
    Some(BlockIdentity {
        sequence_hash: hash,
        parent: (flags & 1 != 0).then_some(SequenceHash(parent)),
        tokens: tokens.into(),
        lora_name: if flags & 2 != 0 {
            Some(std::str::from_utf8(lora).ok()?.into())
        } else {
            None
        },
        group,
    })
}

/// Starts the thread that takes `receiver`'s jobs one at a time until every sender is gone.
pub(crate) fn spawn_writer<T: Send + 'static>(
    name: &str,
    receiver: crossbeam_channel::Receiver<T>,
    mut run: impl FnMut(T) + Send + 'static,
) -> Result<JoinHandle<()>, CoreError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            for job in receiver {
                run(job);
            }
        })
        .map_err(|e| CoreError::Disk(format!("cannot start {name}: {e}")))
}

/// The store options of a disk tier for blocks of `kv` in the order `geometry_id` names.
pub(crate) fn store_options(options: &DiskOptions, kv: KvLayout, geometry_id: u64) -> StoreOptions {
    StoreOptions {
        layout_fingerprint: match options.layout_salt {
            0 => layout_fingerprint(&kv, geometry_id),
            salt => layout_fingerprint(&kv, geometry_id ^ salt.rotate_left(17)),
        },
        payload_bytes: kv.bytes_per_block(),
        slots: options.blocks,
        queue_depth: options.queue_depth,
        engine: options.engine,
        file: CacheFileOptions {
            disable_o_direct: options.disable_o_direct,
            // kvbm's default directory lives in the shared temporary directory: it must be
            // this user's own (no link, no group or other bits).
            private_dir: options.dir == crate::config::default_disk_dir(),
            ..Default::default()
        },
        write_failures_max: 8,
    }
}

/// Where and how the disk tier lives.
#[derive(Debug, Clone)]
pub struct DiskOptions {
    /// Directory of the cache file (`DYN_KVBM_DISK_CACHE_DIR`).
    pub dir: PathBuf,
    /// The cache file's name (one per worker).
    pub file_name: String,
    /// Blocks on disk.
    pub blocks: usize,
    /// Buffered I/O (`DYN_KVBM_DISK_DISABLE_O_DIRECT`).
    pub disable_o_direct: bool,
    /// Admit every host block (`DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER`).
    pub filter_disabled: bool,
    /// Disk operations in flight.
    pub queue_depth: usize,
    /// io_uring, psync, or auto.
    pub engine: EngineChoice,
    /// What else decides which bytes a block holds besides its layout (a hybrid model's KV cache
    /// groups: their kinds and which layers each owns), folded into the file's layout
    /// fingerprint; 0 for nothing (the fingerprint is then the layout's alone).
    pub layout_salt: u64,
}
