//! The slot store on real files, through both engines: round trips, damage read as counted
//! misses, and recovery after restarts.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use kvbm_disk::format::{BlockMismatch, FormatError, HEADER_BYTES};
use kvbm_disk::{
    AlignedBuf, DiskStore, EngineChoice, Lookup, Miss, StoreOptions, WriteOutcome,
    CHECKPOINT_SUFFIX,
};

/// Not a multiple of 4 KiB on purpose: the slot's payload area is 12 KiB.
const PAYLOAD: usize = 10_000;
const SLOTS: usize = 24;

fn options(engine: EngineChoice, fingerprint: u64) -> StoreOptions {
    StoreOptions {
        layout_fingerprint: fingerprint,
        payload_bytes: PAYLOAD,
        slots: SLOTS,
        queue_depth: 8,
        engine,
        file: Default::default(),
        write_failures_max: 8,
    }
}

fn open(dir: &Path, engine: EngineChoice, fingerprint: u64) -> (DiskStore, kvbm_disk::Recovered) {
    DiskStore::open(dir, "cache.kvbm", options(engine, fingerprint)).unwrap()
}

fn block(key: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::new(PAYLOAD).unwrap();
    let mut x = key | 1;
    for b in &mut buf.as_mut_slice()[..PAYLOAD] {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    buf
}

fn key_of(slot: u32) -> u64 {
    0xABCD_0000 + u64::from(slot) * 7
}

fn write_all(store: &DiskStore, slots: impl Iterator<Item = u32>) {
    for slot in slots {
        assert_eq!(
            store
                .write(slot, key_of(slot), &block(key_of(slot)))
                .unwrap(),
            WriteOutcome::Stored
        );
    }
}

fn read(store: &DiskStore, slot: u32, key: u64) -> (Lookup, AlignedBuf) {
    let mut out = AlignedBuf::new(PAYLOAD).unwrap();
    let lookup = store.read(slot, key, &mut out).unwrap();
    (lookup, out)
}

fn assert_hit(store: &DiskStore, slot: u32) {
    let (lookup, out) = read(store, slot, key_of(slot));
    assert_eq!(lookup, Lookup::Hit, "slot {slot}");
    assert!(
        out.as_slice()[..PAYLOAD] == block(key_of(slot)).as_slice()[..PAYLOAD],
        "slot {slot} bytes"
    );
}

/// Offset of a slot's payload in the file (superblock, then header + 12 KiB per slot).
fn payload_offset(slot: u32) -> u64 {
    (HEADER_BYTES + slot as usize * (HEADER_BYTES + 12288) + HEADER_BYTES) as u64
}

fn scribble(dir: &Path, offset: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("cache.kvbm"))
        .unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

fn for_both_engines(check: impl Fn(EngineChoice)) {
    for engine in [EngineChoice::IoUring, EngineChoice::Psync] {
        check(engine);
    }
}

#[test]
fn blocks_round_trip_and_unknown_slots_miss() {
    for_both_engines(|engine| {
        let dir = tempfile::tempdir().unwrap();
        let (store, recovered) = open(dir.path(), engine, 1);
        assert!(recovered.initialised && recovered.blocks.is_empty());
        assert_eq!(store.payload_area_bytes(), 12288);
        write_all(&store, 0..SLOTS as u32);
        for slot in (0..SLOTS as u32).rev() {
            assert_hit(&store, slot);
        }
        assert_eq!(
            read(&store, 3, 12345).0,
            Lookup::Miss(Miss::NotStored),
            "another key"
        );
        // Overwriting a slot replaces its block.
        assert_eq!(
            store.write(5, 777, &block(777)).unwrap(),
            WriteOutcome::Stored
        );
        assert_eq!(read(&store, 5, key_of(5)).0, Lookup::Miss(Miss::NotStored));
        assert_eq!(read(&store, 5, 777).0, Lookup::Hit);
        let stats = store.stats();
        assert_eq!(
            (stats.writes_ok, stats.read_hits, stats.read_corrupt),
            (SLOTS as u64 + 1, SLOTS as u64 + 1, 0)
        );
        assert!(
            store
                .read(SLOTS as u32, 1, &mut AlignedBuf::new(PAYLOAD).unwrap())
                .is_err(),
            "slot out of range"
        );
        assert!(
            store
                .read(0, 1, &mut AlignedBuf::new(4096).unwrap())
                .is_err(),
            "buffer too small"
        );
    });
}

#[test]
fn a_torn_write_or_a_flipped_byte_reads_as_a_counted_miss() {
    for_both_engines(|engine| {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(dir.path(), engine, 1);
        write_all(&store, 0..4);
        // Torn: the payload was overwritten after the header landed.
        scribble(dir.path(), payload_offset(1), &[0u8; 4096]);
        // Flipped: one byte of the payload.
        scribble(dir.path(), payload_offset(2) + 9_999, &[0x5A]);
        // A header whose checksum no longer matches.
        scribble(
            dir.path(),
            payload_offset(3) - HEADER_BYTES as u64 + 20,
            &[0xFF],
        );
        assert_hit(&store, 0);
        assert_eq!(
            read(&store, 1, key_of(1)).0,
            Lookup::Miss(Miss::Mismatch(BlockMismatch::PayloadChecksum))
        );
        assert_eq!(
            read(&store, 2, key_of(2)).0,
            Lookup::Miss(Miss::Mismatch(BlockMismatch::PayloadChecksum))
        );
        assert_eq!(
            read(&store, 3, key_of(3)).0,
            Lookup::Miss(Miss::Mismatch(BlockMismatch::Header(
                FormatError::BadChecksum
            )))
        );
        assert_eq!(store.stats().read_corrupt, 3);
        // Damaged slots are not read again until rewritten.
        assert_eq!(read(&store, 1, key_of(1)).0, Lookup::Miss(Miss::NotStored));
        write_all(&store, 1..2);
        assert_hit(&store, 1);
    });
}

#[test]
fn a_file_truncated_under_the_store_reads_as_misses() {
    for_both_engines(|engine| {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(dir.path(), engine, 1);
        write_all(&store, 0..SLOTS as u32);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("cache.kvbm"))
            .unwrap();
        file.set_len(payload_offset(12)).unwrap();
        assert_hit(&store, 11);
        match read(&store, 20, key_of(20)).0 {
            Lookup::Miss(Miss::Io(_)) | Lookup::Miss(Miss::Mismatch(_)) => {}
            other => panic!("a block past the end of the file read as {other:?}"),
        }
        drop(store);
        // After a restart the file is full size again. Slots whose headers survived are listed
        // (slot 12's header sits before the cut, its payload after it); every read still
        // verifies, so slot 12 reads as a miss.
        let (store, recovered) = open(dir.path(), engine, 1);
        assert!(!recovered.from_checkpoint && !recovered.initialised);
        assert_eq!(
            recovered.blocks.iter().map(|b| b.slot).collect::<Vec<_>>(),
            (0..13).collect::<Vec<u32>>()
        );
        assert_hit(&store, 0);
        assert_eq!(
            read(&store, 12, key_of(12)).0,
            Lookup::Miss(Miss::Mismatch(BlockMismatch::PayloadChecksum))
        );
    });
}

#[test]
fn restart_recovers_blocks_from_a_checkpoint_or_by_scanning() {
    for_both_engines(|engine| {
        let dir = tempfile::tempdir().unwrap();
        let expected: Vec<(u32, u64)> = (0..10).map(|s| (s, key_of(s))).collect();
        let (store, _) = open(dir.path(), engine, 9);
        write_all(&store, 0..10);
        store.close().unwrap();
        let checkpoint = dir.path().join(format!("cache.kvbm{CHECKPOINT_SUFFIX}"));
        assert!(checkpoint.exists());

        // Clean shutdown: the index comes from the checkpoint, which is then consumed.
        let (store, recovered) = open(dir.path(), engine, 9);
        assert!(recovered.from_checkpoint);
        let found: Vec<(u32, u64)> = recovered.blocks.iter().map(|b| (b.slot, b.key)).collect();
        assert_eq!(found, expected);
        assert!(
            !checkpoint.exists(),
            "a checkpoint must not outlive the open that used it"
        );
        for slot in 0..10 {
            assert_hit(&store, slot);
        }
        // More writes, then a crash (no close): the next open scans and sees them too.
        write_all(&store, 10..12);
        drop(store);
        let (store, recovered) = open(dir.path(), engine, 9);
        assert!(!recovered.from_checkpoint && !recovered.initialised);
        assert_eq!(recovered.blocks.len(), 12);
        assert_hit(&store, 11);
        store.close().unwrap();

        // A damaged checkpoint is ignored in favour of a scan.
        let mut bytes = std::fs::read(&checkpoint).unwrap();
        bytes[45] ^= 1;
        std::fs::write(&checkpoint, &bytes).unwrap();
        let (store, recovered) = open(dir.path(), engine, 9);
        assert!(!recovered.from_checkpoint);
        assert_eq!(recovered.blocks.len(), 12);
        assert_hit(&store, 3);
    });
}

#[test]
fn another_layout_discards_the_contents_for_good() {
    for_both_engines(|engine| {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(dir.path(), engine, 1);
        write_all(&store, 0..6);
        store.close().unwrap();
        let (store, recovered) = open(dir.path(), engine, 2);
        assert!(recovered.initialised && recovered.blocks.is_empty());
        assert_eq!(read(&store, 0, key_of(0)).0, Lookup::Miss(Miss::NotStored));
        drop(store);
        // Back to the first layout: the old blocks belong to a discarded epoch and stay gone.
        let (_, recovered) = open(dir.path(), engine, 1);
        assert!(recovered.initialised && recovered.blocks.is_empty());
    });
}

#[test]
fn metadata_comes_back_from_a_scan_and_from_a_checkpoint_and_damage_drops_the_slot() {
    for_both_engines(|engine| {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(dir.path(), engine, 3);
        let meta = |slot: u32| {
            format!(
                "parent={} tokens=[{slot},{slot},{slot}]",
                slot.wrapping_sub(1)
            )
            .into_bytes()
        };
        for slot in 0..4 {
            let outcome = store
                .write_with_metadata(slot, key_of(slot), &block(key_of(slot)), &meta(slot))
                .unwrap();
            assert_eq!(outcome, WriteOutcome::Stored);
        }
        let too_long = vec![0u8; kvbm_disk::format::METADATA_BYTES_MAX + 1];
        assert!(store
            .write_with_metadata(5, 5, &block(5), &too_long)
            .is_err());
        // Crash, then scan.
        drop(store);
        let (store, recovered) = open(dir.path(), engine, 3);
        assert!(!recovered.from_checkpoint);
        for b in &recovered.blocks {
            assert_eq!(b.metadata, meta(b.slot), "slot {}", b.slot);
        }
        assert_eq!(recovered.blocks.len(), 4);
        // Clean shutdown, then the checkpoint.
        store.close().unwrap();
        let (store, recovered) = open(dir.path(), engine, 3);
        assert!(recovered.from_checkpoint);
        assert_eq!(
            recovered
                .blocks
                .iter()
                .map(|b| b.metadata.clone())
                .collect::<Vec<_>>(),
            (0..4).map(meta).collect::<Vec<_>>()
        );
        drop(store);
        // A flipped metadata byte: that slot is not recovered by a scan.
        scribble(
            dir.path(),
            payload_offset(2) - HEADER_BYTES as u64 + 81,
            b"#",
        );
        let (_, recovered) = open(dir.path(), engine, 3);
        assert_eq!(
            recovered.blocks.iter().map(|b| b.slot).collect::<Vec<_>>(),
            vec![0, 1, 3]
        );
    });
}

#[test]
fn framed_blocks_move_as_one_op_and_use_registered_buffers() {
    use kvbm_disk::{ReadRequest, WriteRequest};
    for_both_engines(|engine| {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(dir.path(), engine, 4);
        // Each block: 4 KiB header room, then its 12 KiB payload area.
        let stride = HEADER_BYTES + store.payload_area_bytes();
        let mut buf = AlignedBuf::new(8 * stride).unwrap();
        for slot in 0..8u32 {
            let at = slot as usize * stride + HEADER_BYTES;
            buf.as_mut_slice()[at..at + PAYLOAD]
                .copy_from_slice(&block(key_of(slot)).as_slice()[..PAYLOAD]);
        }
        // SAFETY: `buf` outlives the store (dropped after it, below).
        unsafe { store.register_buffers(&[(buf.addr(), buf.len())]) }.unwrap();
        let base = buf.addr();
        let payload_addr = |slot: u32| base + (slot as usize * stride + HEADER_BYTES) as u64;
        let writes: Vec<WriteRequest> = (0..8)
            .map(|slot| WriteRequest {
                slot,
                key: key_of(slot),
                addr: payload_addr(slot),
                metadata: b"m",
                framed: true,
            })
            .collect();
        // SAFETY: the payloads and their header rooms lie in `buf`, used by nothing else meanwhile.
        let outcomes = unsafe { store.write_raw(&writes, Box::new(())) }.unwrap();
        assert!(outcomes.iter().all(|o| *o == WriteOutcome::Stored));
        // Unframed reads see the same blocks: the on-disk format does not depend on framing.
        for slot in 0..8 {
            assert_hit(&store, slot);
        }
        // Framed reads back into the (scrubbed) buffer.
        buf.as_mut_slice().fill(0);
        let reads: Vec<ReadRequest> = (0..8)
            .map(|slot| ReadRequest {
                slot,
                key: key_of(slot),
                addr: payload_addr(slot),
                framed: true,
            })
            .collect();
        // SAFETY: as above.
        let lookups = unsafe { store.read_raw(&reads, Box::new(())) }.unwrap();
        assert!(lookups.iter().all(|l| *l == Lookup::Hit), "{lookups:?}");
        for slot in 0..8u32 {
            let at = slot as usize * stride + HEADER_BYTES;
            assert!(
                buf.as_slice()[at..at + PAYLOAD] == block(key_of(slot)).as_slice()[..PAYLOAD],
                "slot {slot}"
            );
        }
        match engine {
            EngineChoice::IoUring => assert_eq!(
                store.engine().fixed_ops(),
                16,
                "8 writes and 8 reads from the registered buffer"
            ),
            _ => assert_eq!(store.engine().fixed_ops(), 0),
        }
        drop(store);
        drop(buf);
    });
}
