//! The slot store: fixed-size slots in one cache file, each a verified block under a u64 key.
//!
//! kvbm-disk addresses blocks by slot; which slot holds what, eviction and events are the
//! caller's policy (kvbm-core's disk pool). The store owns integrity:
//! - every write bumps the slot's generation and records key, length, payload checksum,
//!   generation and the file's block fingerprint in the slot header;
//! - every read is checked against the header, the expected key and generation, and the payload
//!   checksum; anything else is a counted miss ([`Lookup::Miss`]), never data;
//! - on open with the same layout, the slots' contents are recovered from the checkpoint written
//!   by [`DiskStore::close`] (then deleted), or else by scanning every slot header; with another
//!   layout (or no valid superblock) the file is re-initialised under a new epoch;
//! - after [`StoreOptions::write_failures_max`] consecutive failed write batches the store is
//!   degraded: writes are refused (and counted), reads of good blocks go on.
//!
//! Invariant: a slot is readable only after the write that filled it completed successfully; a
//! failed write leaves it unreadable.

use std::any::Any;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::format::{
    block_fingerprint, decode_metadata, encode_metadata, payload_checksum, verify_block,
    BlockHeader, BlockMismatch, Superblock, HEADER_BYTES, METADATA_BYTES_MAX,
};
use crate::{
    open_engine_with_buffers, AlignedBuf, BufOp, CacheFile, CacheFileOptions, DiskError,
    EngineChoice, IoEngine, IoOp, OpKind,
};

/// Suffix of the checkpoint file next to the cache file.
pub const CHECKPOINT_SUFFIX: &str = ".index";
/// Slots whose headers are read in one job during a recovery scan.
pub const SCAN_SLOTS_PER_JOB: usize = 256;
const CHECKPOINT_MAGIC: [u8; 8] = *b"KVBMIDX1";
/// The most payload bytes one slot holds: a slot's payload moves in one I/O (and one registered
/// buffer of at most 1 GiB), so a larger block cannot be stored.
pub const SLOT_PAYLOAD_BYTES_MAX: usize = 1 << 30;

/// How a store is laid out and run.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Fingerprint of the KV layout; a file written for another is discarded on open.
    pub layout_fingerprint: u64,
    /// Meaningful bytes per block.
    pub payload_bytes: usize,
    /// Slots in the file.
    pub slots: usize,
    /// Ops in flight.
    pub queue_depth: usize,
    /// I/O engine.
    pub engine: EngineChoice,
    /// O_DIRECT or not.
    pub file: CacheFileOptions,
    /// Consecutive failed write batches before the store refuses writes. Default 8.
    pub write_failures_max: u32,
}

/// What an open found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// Every block found, in slot order.
    pub blocks: Vec<RecoveredBlock>,
    /// The index came from a clean-shutdown checkpoint (else from a header scan, or nothing).
    pub from_checkpoint: bool,
    /// The file was (re)initialised: new, another layout, or no valid superblock.
    pub initialised: bool,
}

/// A block found on open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredBlock {
    /// Its slot.
    pub slot: u32,
    /// Its key.
    pub key: u64,
    /// The metadata it was written with.
    pub metadata: Vec<u8>,
}

/// One block to write: `payload_area_bytes` at `addr` into `slot` under `key`, with `metadata`
/// (at most [`crate::format::METADATA_BYTES_MAX`] bytes) kept in its header.
#[derive(Debug, Clone, Copy)]
pub struct WriteRequest<'a> {
    /// Target slot.
    pub slot: u32,
    /// The block's key.
    pub key: u64,
    /// Address of the payload (4 KiB-aligned, `payload_area_bytes` long).
    pub addr: u64,
    /// Opaque metadata returned on recovery.
    pub metadata: &'a [u8],
    /// The 4 KiB before `addr` is header room the store may overwrite: the block then moves as
    /// one contiguous op (from a registered buffer when `addr` lies in one). Otherwise the header
    /// comes from the store's own buffer in a vectored op.
    pub framed: bool,
}

/// One block to read: slot `slot` holding `key` into `payload_area_bytes` at `addr` (see
/// [`WriteRequest::framed`] for `framed`; a framed read also overwrites the header room).
#[derive(Debug, Clone, Copy)]
pub struct ReadRequest {
    /// Source slot.
    pub slot: u32,
    /// The key the slot must hold.
    pub key: u64,
    /// Address of the destination (4 KiB-aligned, `payload_area_bytes` long).
    pub addr: u64,
    /// Use the 4 KiB before `addr` as header room.
    pub framed: bool,
}

/// Why a read is not a hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Miss {
    /// The store holds no block with that key in that slot.
    NotStored,
    /// The bytes on disk are not the block (torn, corrupted, stale, foreign).
    Mismatch(BlockMismatch),
    /// The read failed.
    Io(String),
}

/// The outcome of a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The block's bytes are in the buffer, verified.
    Hit,
    /// Nothing usable; the buffer's contents are unspecified.
    Miss(Miss),
}

/// The outcome of a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Stored and readable.
    Stored,
    /// Not attempted: the store is degraded.
    Refused,
    /// The write failed; the slot holds nothing readable.
    Failed(String),
}

/// Counters since open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Blocks written.
    pub writes_ok: u64,
    /// Blocks whose write failed (ENOSPC, EIO, ...).
    pub write_failures: u64,
    /// Blocks refused while degraded.
    pub writes_refused: u64,
    /// Verified reads.
    pub read_hits: u64,
    /// Reads whose bytes failed verification.
    pub read_corrupt: u64,
    /// Reads that failed with an I/O error.
    pub read_errors: u64,
    /// True once writes are refused.
    pub degraded: bool,
}

#[derive(Default)]
struct Counters {
    writes_ok: AtomicU64,
    write_failures: AtomicU64,
    writes_refused: AtomicU64,
    read_hits: AtomicU64,
    read_corrupt: AtomicU64,
    read_errors: AtomicU64,
}

#[derive(Debug, Clone, Default)]
struct SlotMeta {
    key: u64,
    generation: u64,
    readable: bool,
    metadata: Arc<[u8]>,
}

struct StoreState {
    slots: Vec<SlotMeta>,
    consecutive_failures: u32,
    degraded: bool,
}

/// The disk store of one worker.
pub struct DiskStore {
    engine: IoEngine,
    file: Arc<CacheFile>,
    checkpoint_path: PathBuf,
    /// The checkpoint's name in the cache file's checked directory (opened relative to it).
    checkpoint_name: String,
    payload_bytes: usize,
    payload_area: usize,
    slot_count: usize,
    layout_fingerprint: u64,
    epoch: u64,
    block_fingerprint: u64,
    write_failures_max: u32,
    /// Opened by [`DiskStore::inspect`]: nothing is ever written to the file or the checkpoint.
    read_only: bool,
    state: Mutex<StoreState>,
    counters: Counters,
}

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStore")
            .field("file", &self.file.path())
            .field("slots", &self.slot_count)
            .field("payload_bytes", &self.payload_bytes)
            .field("engine", &self.engine.kind())
            .field("stats", &self.stats())
            .finish()
    }
}

/// (payload area per slot, file length) of a store of `options`, or why there is none.
fn file_geometry(options: &StoreOptions) -> Result<(usize, u64), DiskError> {
    if options.payload_bytes == 0 || options.slots == 0 || options.slots > u32::MAX as usize {
        return Err(DiskError::Invalid(format!(
            "a store of {} slots of {} bytes",
            options.slots, options.payload_bytes
        )));
    }
    if options.payload_bytes > SLOT_PAYLOAD_BYTES_MAX {
        return Err(DiskError::Invalid(format!(
            "payload of {} bytes per slot: at most {SLOT_PAYLOAD_BYTES_MAX} (one I/O per slot)",
            options.payload_bytes
        )));
    }
    let payload_area = options.payload_bytes.div_ceil(HEADER_BYTES) * HEADER_BYTES;
    let len = slot_bytes(payload_area)
        .checked_mul(options.slots as u64)
        .and_then(|n| n.checked_add(HEADER_BYTES as u64))
        .ok_or_else(|| DiskError::Invalid("the cache file size overflows".into()))?;
    Ok((payload_area, len))
}

fn slot_bytes(payload_area: usize) -> u64 {
    (HEADER_BYTES + payload_area) as u64
}

impl DiskStore {
    /// Opens (or creates) `dir/name` and recovers what it holds for this layout.
    pub fn open(
        dir: &Path,
        name: &str,
        options: StoreOptions,
    ) -> Result<(Self, Recovered), DiskError> {
        // SAFETY: no memory is registered.
        unsafe { Self::open_with_buffers(dir, name, options, &[]) }
    }

    /// As [`Self::open`], registering `buffers` (address, length; at most 1 GiB each) with
    /// io_uring, so that blocks moving to and from them use fixed-buffer I/O (no page pinning
    /// per request).
    ///
    /// # Safety
    /// Every registered range must stay valid memory for as long as the store lives.
    pub unsafe fn open_with_buffers(
        dir: &Path,
        name: &str,
        options: StoreOptions,
        buffers: &[(u64, usize)],
    ) -> Result<(Self, Recovered), DiskError> {
        let (payload_area, len) = file_geometry(&options)?;
        let file = Arc::new(CacheFile::open(dir, name, len, options.file)?);
        // SAFETY: the caller guarantees the registered ranges outlive the store and its engine.
        let engine = unsafe {
            open_engine_with_buffers(options.engine, file.clone(), options.queue_depth, buffers)
        }?;
        let (superblock_buf, found) = read_superblock(&engine)?;
        let geometry_matches = found.is_some_and(|sb| {
            sb.fingerprint == options.layout_fingerprint
                && sb.slot_payload_bytes == payload_area as u64
                && sb.slot_count == options.slots as u64
        });
        let mut store = Self::unrecovered(engine, file, dir, name, &options, false);
        let recovered = match found.filter(|_| geometry_matches) {
            Some(sb) => {
                store.set_epoch(sb.epoch);
                store.recover()?
            }
            None => {
                store.initialise(superblock_buf)?;
                Recovered {
                    blocks: Vec::new(),
                    from_checkpoint: false,
                    initialised: true,
                }
            }
        };
        Ok((store, recovered))
    }

    /// Opens the existing `dir/name` read-only and reports what kvbm would recover from it for
    /// `options`' layout, changing nothing: no file or directory is created, sized or
    /// re-initialised, the checkpoint is read but neither consumed nor written, and writes are
    /// refused. `Recovered::initialised` then means "does not hold this layout" (kvbm would start
    /// it afresh). A shared lock keeps kvbm out meanwhile.
    pub fn inspect(
        dir: &Path,
        name: &str,
        options: StoreOptions,
    ) -> Result<(Self, Recovered), DiskError> {
        let (payload_area, expected) = file_geometry(&options)?;
        let file = Arc::new(CacheFile::open_read_only(dir, name, options.file)?);
        let engine = crate::open_engine(options.engine, file.clone(), options.queue_depth)?;
        let mut store = Self::unrecovered(engine, file, dir, name, &options, true);
        let found = if store.file.len() == expected {
            read_superblock(&store.engine)?.1
        } else {
            None
        };
        let matches = found.filter(|sb| {
            sb.fingerprint == options.layout_fingerprint
                && sb.slot_payload_bytes == payload_area as u64
                && sb.slot_count == options.slots as u64
        });
        let recovered = match matches {
            Some(sb) => {
                store.set_epoch(sb.epoch);
                store.recover()?
            }
            None => Recovered {
                blocks: Vec::new(),
                from_checkpoint: false,
                initialised: true,
            },
        };
        Ok((store, recovered))
    }

    /// A store over `file` that knows nothing of its slots yet.
    fn unrecovered(
        engine: IoEngine,
        file: Arc<CacheFile>,
        dir: &Path,
        name: &str,
        options: &StoreOptions,
        read_only: bool,
    ) -> Self {
        Self {
            engine,
            file,
            checkpoint_path: dir.join(format!("{name}{CHECKPOINT_SUFFIX}")),
            checkpoint_name: format!("{name}{CHECKPOINT_SUFFIX}"),
            payload_bytes: options.payload_bytes,
            payload_area: options.payload_bytes.div_ceil(HEADER_BYTES) * HEADER_BYTES,
            slot_count: options.slots,
            layout_fingerprint: options.layout_fingerprint,
            epoch: 0,
            block_fingerprint: 0,
            write_failures_max: options.write_failures_max.max(1),
            read_only,
            state: Mutex::new(StoreState {
                slots: vec![SlotMeta::default(); options.slots],
                consecutive_failures: 0,
                degraded: false,
            }),
            counters: Counters::default(),
        }
    }

    /// Removes the checkpoint (relative to the checked directory), if there is one.
    fn remove_checkpoint(&self) {
        let _ = nix::unistd::unlinkat(
            Some(self.file.dir_fd()),
            self.checkpoint_name.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }

    fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.block_fingerprint = block_fingerprint(self.layout_fingerprint, epoch);
    }

    /// A new epoch and superblock; every old slot becomes foreign.
    fn initialise(&mut self, mut buf: AlignedBuf) -> Result<(), DiskError> {
        self.remove_checkpoint();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let mut seed = [0u8; 24];
        seed[..16].copy_from_slice(&now.to_le_bytes());
        seed[16..20].copy_from_slice(&std::process::id().to_le_bytes());
        self.set_epoch(xxh3_64(&seed) | 1);
        buf.as_mut_slice().fill(0);
        Superblock {
            fingerprint: self.layout_fingerprint,
            slot_payload_bytes: self.payload_area as u64,
            slot_count: self.slot_count as u64,
            epoch: self.epoch,
        }
        .encode(buf.as_mut_slice());
        let op = BufOp {
            kind: OpKind::Write,
            offset: 0,
            buf: 0,
            at: 0,
            len: HEADER_BYTES,
        };
        self.engine.submit(&[op], vec![buf])?.wait().0?;
        self.file.sync_data()
    }

    fn recover(&self) -> Result<Recovered, DiskError> {
        let from_checkpoint = match self.load_checkpoint() {
            Some(entries) => {
                let mut state = self.state.lock();
                for (slot, meta) in entries {
                    state.slots[slot as usize] = meta;
                }
                true
            }
            None => {
                self.scan_headers()?;
                false
            }
        };
        // A checkpoint describes one clean shutdown only: never reuse it after a later crash.
        if !self.read_only {
            self.remove_checkpoint();
        }
        let state = self.state.lock();
        let blocks = state
            .slots
            .iter()
            .enumerate()
            .filter(|(_, m)| m.readable)
            .map(|(i, m)| RecoveredBlock {
                slot: i as u32,
                key: m.key,
                metadata: m.metadata.to_vec(),
            })
            .collect();
        Ok(Recovered {
            blocks,
            from_checkpoint,
            initialised: false,
        })
    }

    fn scan_headers(&self) -> Result<(), DiskError> {
        for first in (0..self.slot_count).step_by(SCAN_SLOTS_PER_JOB) {
            let n = SCAN_SLOTS_PER_JOB.min(self.slot_count - first);
            let buf =
                AlignedBuf::new(n * HEADER_BYTES).map_err(|e| DiskError::Invalid(e.to_string()))?;
            let ops: Vec<BufOp> = (0..n)
                .map(|i| BufOp {
                    kind: OpKind::Read,
                    offset: self.slot_offset(first + i),
                    buf: 0,
                    at: i * HEADER_BYTES,
                    len: HEADER_BYTES,
                })
                .collect();
            let (result, bufs) = self.engine.submit(&ops, vec![buf])?.wait();
            result?;
            let mut state = self.state.lock();
            for i in 0..n {
                let bytes = &bufs[0].as_slice()[i * HEADER_BYTES..(i + 1) * HEADER_BYTES];
                // A slot is recovered only if its header and its metadata both check out.
                let (Ok(h), Ok(metadata)) = (BlockHeader::decode(bytes), decode_metadata(bytes))
                else {
                    continue;
                };
                if h.fingerprint == self.block_fingerprint
                    && h.payload_len == self.payload_bytes as u64
                {
                    state.slots[first + i] = SlotMeta {
                        key: h.key,
                        generation: h.generation,
                        readable: true,
                        metadata: metadata.into(),
                    };
                }
            }
        }
        Ok(())
    }

    fn slot_offset(&self, slot: usize) -> u64 {
        HEADER_BYTES as u64 + slot as u64 * slot_bytes(self.payload_area)
    }

    /// Slots in the store.
    pub fn slots(&self) -> usize {
        self.slot_count
    }

    /// Meaningful bytes per block.
    pub fn payload_bytes(&self) -> usize {
        self.payload_bytes
    }

    /// Bytes a block's buffer must span (the payload rounded up to 4 KiB).
    pub fn payload_area_bytes(&self) -> usize {
        self.payload_area
    }

    /// The engine in use.
    pub fn engine(&self) -> &IoEngine {
        &self.engine
    }

    /// Registers memory with the engine (io_uring fixed buffers; a no-op on psync), replacing
    /// what was registered; framed blocks inside it then move with fixed-buffer ops.
    ///
    /// # Safety
    /// Every range must stay valid memory for as long as the store lives.
    pub unsafe fn register_buffers(&self, buffers: &[(u64, usize)]) -> Result<(), DiskError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.engine.register_buffers(buffers) }
    }

    /// The cache file.
    pub fn file(&self) -> &CacheFile {
        &self.file
    }

    /// Counters since open.
    pub fn stats(&self) -> StoreStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StoreStats {
            writes_ok: get(&self.counters.writes_ok),
            write_failures: get(&self.counters.write_failures),
            writes_refused: get(&self.counters.writes_refused),
            read_hits: get(&self.counters.read_hits),
            read_corrupt: get(&self.counters.read_corrupt),
            read_errors: get(&self.counters.read_errors),
            degraded: self.state.lock().degraded,
        }
    }

    /// Writes one block from `payload` (at least [`Self::payload_area_bytes`] long).
    pub fn write(
        &self,
        slot: u32,
        key: u64,
        payload: &AlignedBuf,
    ) -> Result<WriteOutcome, DiskError> {
        self.write_with_metadata(slot, key, payload, &[])
    }

    /// Writes one block with metadata that recovery will return.
    pub fn write_with_metadata(
        &self,
        slot: u32,
        key: u64,
        payload: &AlignedBuf,
        metadata: &[u8],
    ) -> Result<WriteOutcome, DiskError> {
        self.check_buffer(payload.len())?;
        let request = WriteRequest {
            slot,
            key,
            addr: payload.addr(),
            metadata,
            framed: false,
        };
        // SAFETY: `payload` is borrowed for the whole call and `write_raw` waits for the I/O.
        let mut outcomes = unsafe { self.write_raw(&[request], Box::new(())) }?;
        Ok(outcomes.pop().expect("one write, one outcome"))
    }

    /// Reads one block into `out` (at least [`Self::payload_area_bytes`] long) and verifies it.
    pub fn read(&self, slot: u32, key: u64, out: &mut AlignedBuf) -> Result<Lookup, DiskError> {
        self.check_buffer(out.len())?;
        let request = ReadRequest {
            slot,
            key,
            addr: out.addr(),
            framed: false,
        };
        // SAFETY: `out` is borrowed mutably for the whole call and `read_raw` waits for the I/O.
        let mut lookups = unsafe { self.read_raw(&[request], Box::new(())) }?;
        Ok(lookups.pop().expect("one read, one lookup"))
    }

    fn check_buffer(&self, len: usize) -> Result<(), DiskError> {
        if len < self.payload_area {
            return Err(DiskError::Invalid(format!(
                "a {len}-byte buffer for {}-byte slots",
                self.payload_area
            )));
        }
        Ok(())
    }

    fn check_slots(&self, mut slots: impl Iterator<Item = u32>) -> Result<(), DiskError> {
        match slots.find(|&slot| slot as usize >= self.slot_count) {
            Some(slot) => Err(DiskError::Invalid(format!(
                "slot {slot} of {}",
                self.slot_count
            ))),
            None => Ok(()),
        }
    }

    /// Blocks per engine job: a group's I/O runs while the next group's checksums are computed
    /// (writes) or the previous group's payloads are verified (reads).
    fn group_blocks(&self) -> usize {
        (self.engine.queue_depth() / 2).max(1)
    }

    /// Writes blocks and waits for them. Each payload spans
    /// [`Self::payload_area_bytes`] bytes, 4 KiB-aligned; each block (header and payload) is one
    /// vectored I/O. Blocks go in groups, so that one group's checksums are computed while earlier
    /// groups are on the disk; a failed group fails its own blocks only.
    ///
    /// # Safety
    /// Each `[addr, addr + payload_area_bytes)` must be valid, readable memory, not written by
    /// anyone until this returns, and when framed `[addr - 4096, addr)` must be valid memory only
    /// this call uses; `keep` is dropped once the I/O completed.
    pub unsafe fn write_raw(
        &self,
        writes: &[WriteRequest<'_>],
        keep: Box<dyn Any + Send>,
    ) -> Result<Vec<WriteOutcome>, DiskError> {
        if self.read_only {
            return Err(DiskError::Invalid(format!(
                "{} was opened read-only for inspection",
                self.file.path().display()
            )));
        }
        self.check_slots(writes.iter().map(|w| w.slot))?;
        if let Some(w) = writes
            .iter()
            .find(|w| w.metadata.len() > METADATA_BYTES_MAX)
        {
            return Err(DiskError::Invalid(format!(
                "{} bytes of metadata for slot {}, more than {METADATA_BYTES_MAX}",
                w.metadata.len(),
                w.slot
            )));
        }
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let generations: Vec<u64> = {
            let mut state = self.state.lock();
            if state.degraded {
                self.counters
                    .writes_refused
                    .fetch_add(writes.len() as u64, Ordering::Relaxed);
                return Ok(vec![WriteOutcome::Refused; writes.len()]);
            }
            // Unreadable from now until the write is known to have landed.
            writes
                .iter()
                .map(|w| {
                    let meta = &mut state.slots[w.slot as usize];
                    meta.readable = false;
                    meta.generation += 1;
                    meta.generation
                })
                .collect()
        };
        let keep = Arc::new(Mutex::new(Some(keep)));
        let mut tickets = Vec::new();
        for (g, group) in writes.chunks(self.group_blocks()).enumerate() {
            let first = g * self.group_blocks();
            let mut headers = AlignedBuf::new(group.len() * HEADER_BYTES)
                .map_err(|e| DiskError::Invalid(e.to_string()))?;
            let mut ops = Vec::with_capacity(group.len());
            for (i, w) in group.iter().enumerate() {
                let WriteRequest {
                    slot,
                    key,
                    addr,
                    metadata,
                    framed,
                } = *w;
                // SAFETY: the caller guarantees the payload memory is valid and stable.
                let payload =
                    unsafe { std::slice::from_raw_parts(addr as *const u8, self.payload_bytes) };
                let mut header = [0u8; HEADER_BYTES];
                BlockHeader {
                    key,
                    payload_len: self.payload_bytes as u64,
                    payload_checksum: payload_checksum(payload),
                    generation: generations[first + i],
                    fingerprint: self.block_fingerprint,
                }
                .encode(&mut header);
                encode_metadata(metadata, &mut header)
                    .map_err(|e| DiskError::Invalid(e.to_string()))?;
                let offset = self.slot_offset(slot as usize);
                if framed {
                    let room = addr - HEADER_BYTES as u64;
                    // SAFETY: the caller gives the 4 KiB before `addr` as header room, valid and
                    // not used by anyone else until this returns.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            header.as_ptr(),
                            room as *mut u8,
                            HEADER_BYTES,
                        )
                    };
                    ops.push(IoOp {
                        kind: OpKind::Write,
                        offset,
                        addr: room,
                        len: HEADER_BYTES + self.payload_area,
                        lead: None,
                    });
                } else {
                    headers.as_mut_slice()[i * HEADER_BYTES..(i + 1) * HEADER_BYTES]
                        .copy_from_slice(&header);
                    let lead = Some((headers.addr() + (i * HEADER_BYTES) as u64, HEADER_BYTES));
                    ops.push(IoOp {
                        kind: OpKind::Write,
                        offset,
                        addr,
                        len: self.payload_area,
                        lead,
                    });
                }
            }
            // SAFETY: the payloads are the caller's (see above); this group's headers and a share
            // of the caller's keep-alive move into the job.
            tickets.push(unsafe {
                self.engine
                    .submit_raw(ops, Box::new((headers, keep.clone())))
            }?);
        }
        let results: Vec<Result<(), DiskError>> = tickets.into_iter().map(|t| t.wait().0).collect();
        drop(keep);

        let mut state = self.state.lock();
        let mut outcomes = Vec::with_capacity(writes.len());
        let mut first_error = None;
        for (group, result) in writes.chunks(self.group_blocks()).zip(results) {
            match result {
                Ok(()) => {
                    for w in group {
                        let meta = &mut state.slots[w.slot as usize];
                        meta.key = w.key;
                        meta.readable = true;
                        meta.metadata = w.metadata.into();
                    }
                    self.counters
                        .writes_ok
                        .fetch_add(group.len() as u64, Ordering::Relaxed);
                    outcomes.extend(std::iter::repeat_n(WriteOutcome::Stored, group.len()));
                }
                Err(err) => {
                    self.counters
                        .write_failures
                        .fetch_add(group.len() as u64, Ordering::Relaxed);
                    outcomes.extend(std::iter::repeat_n(
                        WriteOutcome::Failed(err.to_string()),
                        group.len(),
                    ));
                    first_error.get_or_insert(err);
                }
            }
        }
        match first_error {
            None => state.consecutive_failures = 0,
            Some(err) => {
                state.consecutive_failures += 1;
                if state.consecutive_failures >= self.write_failures_max && !state.degraded {
                    state.degraded = true;
                    tracing::error!(file = %self.file.path().display(), error = %err,
                        "disk tier degraded after repeated write failures: writes are refused, reads go on");
                } else {
                    tracing::warn!(error = %err, "disk write failed; blocks not stored");
                }
            }
        }
        Ok(outcomes)
    }

    /// Reads blocks, waits, and verifies each. Each block is one
    /// vectored I/O; groups are verified as they complete, while later groups are on the disk.
    ///
    /// # Safety
    /// Each `[addr, addr + payload_area_bytes)` (from `addr - 4096` when framed) must be valid,
    /// writable memory that nobody else reads or writes until this returns; `keep` is dropped once
    /// the I/O completed.
    pub unsafe fn read_raw(
        &self,
        reads: &[ReadRequest],
        keep: Box<dyn Any + Send>,
    ) -> Result<Vec<Lookup>, DiskError> {
        self.check_slots(reads.iter().map(|r| r.slot))?;
        // Decide what to read: only slots that hold the key, at the generation last written.
        let plan: Vec<Option<u64>> = {
            let state = self.state.lock();
            reads
                .iter()
                .map(|r| {
                    let meta = &state.slots[r.slot as usize];
                    (meta.readable && meta.key == r.key).then_some(meta.generation)
                })
                .collect()
        };
        let wanted: Vec<usize> = (0..reads.len()).filter(|&i| plan[i].is_some()).collect();
        let keep = Arc::new(Mutex::new(Some(keep)));
        let mut jobs = Vec::new();
        for group in wanted.chunks(self.group_blocks()) {
            let headers = Arc::new(
                AlignedBuf::new(group.len() * HEADER_BYTES)
                    .map_err(|e| DiskError::Invalid(e.to_string()))?,
            );
            let ops = group
                .iter()
                .enumerate()
                .map(|(j, &i)| {
                    let ReadRequest {
                        slot, addr, framed, ..
                    } = reads[i];
                    let offset = self.slot_offset(slot as usize);
                    if framed {
                        let room = addr - HEADER_BYTES as u64;
                        IoOp {
                            kind: OpKind::Read,
                            offset,
                            addr: room,
                            len: HEADER_BYTES + self.payload_area,
                            lead: None,
                        }
                    } else {
                        let lead = Some((headers.addr() + (j * HEADER_BYTES) as u64, HEADER_BYTES));
                        IoOp {
                            kind: OpKind::Read,
                            offset,
                            addr,
                            len: self.payload_area,
                            lead,
                        }
                    }
                })
                .collect();
            // SAFETY: the destinations are the caller's (see above); the header buffer is shared
            // with the job's keep-alive, so it outlives the I/O, and is read only after it.
            let ticket = unsafe {
                self.engine
                    .submit_raw(ops, Box::new((headers.clone(), keep.clone())))
            }?;
            jobs.push((group, headers, ticket));
        }

        let mut lookups: Vec<Lookup> = vec![Lookup::Miss(Miss::NotStored); reads.len()];
        for (group, headers, ticket) in jobs {
            let result = ticket.wait().0;
            for (j, &i) in group.iter().enumerate() {
                let ReadRequest {
                    slot,
                    key,
                    addr,
                    framed,
                } = reads[i];
                lookups[i] = match &result {
                    Err(err) => {
                        self.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                        Lookup::Miss(Miss::Io(err.to_string()))
                    }
                    Ok(()) => {
                        // SAFETY: the caller guarantees the destination memory; its read completed.
                        let payload = unsafe {
                            std::slice::from_raw_parts(addr as *const u8, self.payload_bytes)
                        };
                        let header: &[u8] = if framed {
                            // SAFETY: the caller gives the header room; the read into it completed.
                            unsafe {
                                std::slice::from_raw_parts(
                                    (addr - HEADER_BYTES as u64) as *const u8,
                                    HEADER_BYTES,
                                )
                            }
                        } else {
                            &headers.as_slice()[j * HEADER_BYTES..(j + 1) * HEADER_BYTES]
                        };
                        match verify_block(header, payload, key, self.block_fingerprint, plan[i]) {
                            Ok(_) => {
                                self.counters.read_hits.fetch_add(1, Ordering::Relaxed);
                                Lookup::Hit
                            }
                            Err(mismatch) => {
                                // Garbage stays garbage: not read again until rewritten.
                                self.state.lock().slots[slot as usize].readable = false;
                                self.counters.read_corrupt.fetch_add(1, Ordering::Relaxed);
                                Lookup::Miss(Miss::Mismatch(mismatch))
                            }
                        }
                    }
                };
            }
        }
        drop(keep);
        Ok(lookups)
    }

    /// Flushes the file and writes a checkpoint of the index, so the next open need not scan.
    pub fn close(self) -> Result<(), DiskError> {
        self.checkpoint()
    }

    /// As [`Self::close`] without giving the store up: for an owner that shuts down from `Drop`.
    /// The checkpoint describes the store now; a later write makes it stale, which is why the
    /// next open consumes it (a crash after further writes then falls back to a scan only if
    /// this was not called again after them).
    pub fn checkpoint(&self) -> Result<(), DiskError> {
        if self.read_only {
            return Ok(()); // inspection changes nothing, the checkpoint it read included
        }
        self.file.sync_data()?;
        let state = self.state.lock();
        let entries: Vec<_> = state
            .slots
            .iter()
            .enumerate()
            .filter(|(_, m)| m.readable)
            .collect();
        // Entries: slot, key, generation, metadata length (u64 each), then the metadata bytes.
        let mut bytes = Vec::with_capacity(48 + entries.len() * 32);
        bytes.extend_from_slice(&CHECKPOINT_MAGIC);
        bytes.extend_from_slice(&self.layout_fingerprint.to_le_bytes());
        bytes.extend_from_slice(&self.epoch.to_le_bytes());
        bytes.extend_from_slice(&(self.slot_count as u64).to_le_bytes());
        bytes.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        for (slot, meta) in &entries {
            bytes.extend_from_slice(&(*slot as u64).to_le_bytes());
            bytes.extend_from_slice(&meta.key.to_le_bytes());
            bytes.extend_from_slice(&meta.generation.to_le_bytes());
            bytes.extend_from_slice(&(meta.metadata.len() as u64).to_le_bytes());
            bytes.extend_from_slice(&meta.metadata);
        }
        let checksum = xxh3_64(&bytes);
        bytes.extend_from_slice(&checksum.to_le_bytes());
        write_private(
            self.file.dir_fd(),
            &self.checkpoint_name,
            &self.checkpoint_path,
            &bytes,
        )
    }

    /// (slot, what it holds) from a valid checkpoint of this file's layout and epoch.
    fn load_checkpoint(&self) -> Option<Vec<(u32, SlotMeta)>> {
        let bytes = read_private(
            self.file.dir_fd(),
            &self.checkpoint_name,
            &self.checkpoint_path,
        )?;
        let body_len = bytes.len().checked_sub(8)?;
        let (body, sum) = bytes.split_at(body_len);
        let u64_at = |at: usize| {
            body.get(at..at.checked_add(8)?)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        };
        if body.get(..8)? != CHECKPOINT_MAGIC
            || xxh3_64(body) != u64::from_le_bytes(sum.try_into().ok()?)
        {
            return None;
        }
        if u64_at(8)? != self.layout_fingerprint
            || u64_at(16)? != self.epoch
            || u64_at(24)? != self.slot_count as u64
        {
            return None;
        }
        let count = usize::try_from(u64_at(32)?)
            .ok()
            .filter(|&c| c <= self.slot_count)?;
        let mut at = 40;
        let mut entries = Vec::with_capacity(count);
        for _ in 0..count {
            let slot = u32::try_from(u64_at(at)?)
                .ok()
                .filter(|&s| (s as usize) < self.slot_count)?;
            let (key, generation) = (u64_at(at + 8)?, u64_at(at + 16)?);
            let len = usize::try_from(u64_at(at + 24)?)
                .ok()
                .filter(|&l| l <= METADATA_BYTES_MAX)?;
            let metadata = body.get(at + 32..at + 32 + len)?.into();
            entries.push((
                slot,
                SlotMeta {
                    key,
                    generation,
                    readable: true,
                    metadata,
                },
            ));
            at += 32 + len;
        }
        (at == body.len()).then_some(entries)
    }
}

fn read_superblock(engine: &IoEngine) -> Result<(AlignedBuf, Option<Superblock>), DiskError> {
    let buf = AlignedBuf::new(HEADER_BYTES).map_err(|e| DiskError::Invalid(e.to_string()))?;
    let op = BufOp {
        kind: OpKind::Read,
        offset: 0,
        buf: 0,
        at: 0,
        len: HEADER_BYTES,
    };
    let (result, mut bufs) = engine.submit(&[op], vec![buf])?.wait();
    result?;
    let buf = bufs.pop().expect("one buffer");
    let found = Superblock::decode(buf.as_slice()).ok();
    Ok((buf, found))
}

/// Opens `name` in the directory `dir` with `flags` (never following a link) as a `File`.
fn open_at(dir: RawFd, name: &str, flags: nix::fcntl::OFlag) -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let flags = flags | nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_CLOEXEC;
    let mode = nix::sys::stat::Mode::from_bits_truncate(crate::CACHE_FILE_MODE);
    let fd = nix::fcntl::openat(Some(dir), name, flags, mode)?;
    // SAFETY: `openat` just returned this descriptor, owned by nobody else.
    #[allow(unsafe_code)]
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// The contents of `name` in the directory `dir` (`path`, for messages) if it is a regular
/// file of this user: never followed through a link, and opened `O_NONBLOCK` so that a FIFO or
/// device planted in its place is refused by the `fstat` check instead of blocking the open.
fn read_private(dir: RawFd, name: &str, path: &Path) -> Option<Vec<u8>> {
    use nix::fcntl::OFlag;
    use std::io::Read;
    let mut file = open_at(dir, name, OFlag::O_RDONLY | OFlag::O_NONBLOCK).ok()?;
    crate::file::check_private(&file, path).ok()?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// Writes `bytes` to `name` in the directory `dir` (`path`, for messages) atomically: a 0600
/// temporary file beside it, renamed over it, both relative to `dir`.
fn write_private(dir: RawFd, name: &str, path: &Path, bytes: &[u8]) -> Result<(), DiskError> {
    use nix::fcntl::OFlag;
    use std::io::Write;
    let tmp = Path::new(name)
        .with_extension("tmp")
        .to_string_lossy()
        .into_owned();
    let file_error = |call, source| DiskError::File {
        path: path.to_owned(),
        call,
        source,
    };
    // A fresh file: whatever sits at the temporary name (a planted link included) is unlinked,
    // never written through.
    let _ = nix::unistd::unlinkat(
        Some(dir),
        tmp.as_str(),
        nix::unistd::UnlinkatFlags::NoRemoveDir,
    );
    let mut file = open_at(dir, &tmp, OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL)
        .map_err(|e| file_error("open", e))?;
    file.write_all(bytes).map_err(|e| file_error("write", e))?;
    file.sync_data().map_err(|e| file_error("fdatasync", e))?;
    nix::fcntl::renameat(Some(dir), tmp.as_str(), Some(dir), name)
        .map_err(|e| file_error("rename", e.into()))
}
