//! The cache file and both I/O engines on real files: round trips, refusals, permissions, locks.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use kvbm_disk::{
    open_engine, AlignedBuf, BufOp, CacheFile, CacheFileOptions, DiskError, EngineChoice,
    EngineKind, IoMode, IoOp, OpKind,
};
use rand::{RngCore, SeedableRng};

const BLOCK: usize = 64 * 1024;

fn op(kind: OpKind, offset: u64, buf: usize, at: usize, len: usize) -> BufOp {
    BufOp {
        kind,
        offset,
        buf,
        at,
        len,
    }
}

fn open(dir: &std::path::Path, blocks: usize) -> Arc<CacheFile> {
    Arc::new(
        CacheFile::open(
            dir,
            "cache.kvbm",
            (blocks * BLOCK) as u64,
            CacheFileOptions::default(),
        )
        .unwrap(),
    )
}

fn round_trip(choice: EngineChoice, expected: EngineKind) {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let blocks = 96;
    let engine = open_engine(choice, open(dir.path(), blocks), 16).unwrap();
    assert_eq!(engine.kind(), expected);

    // Write every block from one buffer, in several jobs.
    let mut data = AlignedBuf::new(blocks * BLOCK).unwrap();
    rng.fill_bytes(data.as_mut_slice());
    let original = data.as_slice().to_vec();
    let ops: Vec<_> = (0..blocks)
        .map(|b| op(OpKind::Write, (b * BLOCK) as u64, 0, b * BLOCK, BLOCK))
        .collect();
    let (result, mut bufs) = engine.submit(&ops, vec![data]).unwrap().wait();
    result.unwrap();

    // Read them back in a scrambled order into a fresh buffer.
    let mut order: Vec<usize> = (0..blocks).collect();
    order.reverse();
    let back = AlignedBuf::new(blocks * BLOCK).unwrap();
    let ops: Vec<_> = order
        .iter()
        .enumerate()
        .map(|(i, &b)| op(OpKind::Read, (b * BLOCK) as u64, 0, i * BLOCK, BLOCK))
        .collect();
    let tickets: Vec<_> = ops.chunks(7).map(|chunk| chunk.to_vec()).collect();
    let mut back = Some(back);
    let mut results = Vec::new();
    for chunk in tickets {
        let (r, mut b) = engine
            .submit(&chunk, vec![back.take().unwrap()])
            .unwrap()
            .wait();
        results.push(r);
        back = b.pop();
    }
    assert!(results.iter().all(Result::is_ok));
    let back = back.unwrap();
    for (i, &b) in order.iter().enumerate() {
        assert!(
            back.as_slice()[i * BLOCK..][..BLOCK] == original[b * BLOCK..][..BLOCK],
            "block {b}"
        );
    }
    drop(bufs.pop());
}

#[test]
fn io_uring_round_trips_many_blocks() {
    round_trip(EngineChoice::IoUring, EngineKind::IoUring);
}

#[test]
fn psync_round_trips_many_blocks() {
    round_trip(EngineChoice::Psync, EngineKind::Psync);
}

#[test]
fn unaligned_or_out_of_range_requests_are_refused_before_any_io() {
    let dir = tempfile::tempdir().unwrap();
    for choice in [EngineChoice::IoUring, EngineChoice::Psync] {
        let engine = open_engine(choice, open(dir.path(), 4), 4).unwrap();
        let buf = || vec![AlignedBuf::new(2 * BLOCK).unwrap()];
        let cases: &[(&str, BufOp)] = &[
            ("offset", op(OpKind::Write, 512, 0, 0, 4096)),
            ("length", op(OpKind::Write, 0, 0, 0, 1000)),
            ("address", op(OpKind::Read, 0, 0, 100, 4096)),
            ("zero length", op(OpKind::Read, 0, 0, 0, 0)),
            (
                "past the file",
                op(OpKind::Write, (4 * BLOCK) as u64, 0, 0, 4096),
            ),
            ("past the buffer", op(OpKind::Write, 0, 0, BLOCK, 2 * BLOCK)),
            ("no such buffer", op(OpKind::Write, 0, 1, 0, 4096)),
        ];
        for (name, op) in cases {
            match engine.submit(&[*op], buf()) {
                Err(DiskError::Invalid(msg)) => assert!(!msg.is_empty(), "{name}"),
                other => panic!("{name}: {other:?}"),
            }
        }
    }
}

#[test]
fn raw_submissions_keep_their_memory_alive_until_done() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(EngineChoice::IoUring, open(dir.path(), 8), 8).unwrap();
    let mut buf = AlignedBuf::new(8 * BLOCK).unwrap();
    buf.as_mut_slice().fill(0xAB);
    let ops = (0..8)
        .map(|b| IoOp {
            kind: OpKind::Write,
            offset: (b * BLOCK) as u64,
            addr: buf.addr() + (b * BLOCK) as u64,
            len: BLOCK,
            lead: None,
        })
        .collect();
    // SAFETY: `buf` moves into the keep-alive, so it outlives the I/O.
    let ticket = unsafe { engine.submit_raw(ops, Box::new(buf)) }.unwrap();
    ticket.wait().0.unwrap();
    let (r, bufs) = engine
        .submit(
            &[op(OpKind::Read, 0, 0, 0, 8 * BLOCK)],
            vec![AlignedBuf::new(8 * BLOCK).unwrap()],
        )
        .unwrap()
        .wait();
    r.unwrap();
    assert!(bufs[0].as_slice().iter().all(|&b| b == 0xAB));
}

#[test]
fn dropping_the_engine_finishes_queued_work() {
    let dir = tempfile::tempdir().unwrap();
    let file = open(dir.path(), 32);
    for choice in [EngineChoice::IoUring, EngineChoice::Psync] {
        let engine = open_engine(choice, file.clone(), 2).unwrap();
        let mut buf = AlignedBuf::new(32 * BLOCK).unwrap();
        buf.as_mut_slice().fill(choice as u8 + 1);
        let ops: Vec<_> = (0..32)
            .map(|b| op(OpKind::Write, (b * BLOCK) as u64, 0, b * BLOCK, BLOCK))
            .collect();
        let ticket = engine.submit(&ops, vec![buf]).unwrap();
        drop(engine);
        assert!(ticket.is_done(), "{choice:?}");
        ticket.wait().0.unwrap();
        let check = open_engine(EngineChoice::Psync, file.clone(), 1).unwrap();
        let (r, bufs) = check
            .submit(
                &[op(OpKind::Read, 0, 0, 0, 32 * BLOCK)],
                vec![AlignedBuf::new(32 * BLOCK).unwrap()],
            )
            .unwrap()
            .wait();
        r.unwrap();
        assert!(bufs[0].as_slice().iter().all(|&b| b == choice as u8 + 1));
    }
}

#[test]
fn files_are_private_preallocated_and_locked() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("kvbm-cache");
    let file = CacheFile::open(&dir, "cache.kvbm", 1 << 20, CacheFileOptions::default()).unwrap();
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    let meta = std::fs::metadata(file.path()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), 1 << 20);
    assert!(
        std::os::unix::fs::MetadataExt::blocks(&meta) * 512 >= 1 << 20,
        "space is allocated, not sparse"
    );
    assert_eq!(file.io_mode(), IoMode::Direct, "ext4 and xfs take O_DIRECT");
    // A second opener (another process, or this one) is refused while the first holds it.
    let no_wait = CacheFileOptions {
        lock_wait: std::time::Duration::ZERO,
        ..Default::default()
    };
    match CacheFile::open(&dir, "cache.kvbm", 1 << 20, no_wait) {
        Err(DiskError::Locked { path, .. }) => assert_eq!(path, file.path()),
        other => panic!("expected Locked, got {other:?}"),
    }
    drop(file);
    // Released on drop; an existing file with loose permissions is narrowed; it can shrink.
    std::fs::set_permissions(
        dir.join("cache.kvbm"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let again = CacheFile::open(
        &dir,
        "cache.kvbm",
        1 << 19,
        CacheFileOptions {
            disable_o_direct: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(again.io_mode(), IoMode::Buffered);
    assert_eq!(
        std::fs::metadata(again.path())
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    assert_eq!(std::fs::metadata(again.path()).unwrap().len(), 1 << 19);
}

#[test]
fn unusable_directories_and_full_disks_are_clear_errors() {
    let parent = tempfile::tempdir().unwrap();
    let not_a_dir = parent.path().join("file");
    std::fs::write(&not_a_dir, b"x").unwrap();
    match CacheFile::open(
        &not_a_dir.join("sub"),
        "cache.kvbm",
        4096,
        CacheFileOptions::default(),
    ) {
        Err(err @ DiskError::Directory { .. }) => assert!(err.to_string().contains("sub"), "{err}"),
        other => panic!("expected a directory error, got {other:?}"),
    }
    // Far more than the disk holds: fallocate fails, and the error says the disk is full.
    match CacheFile::open(
        parent.path(),
        "huge.kvbm",
        1 << 60,
        CacheFileOptions::default(),
    ) {
        Err(err) => assert!(err.is_no_space(), "{err}"),
        Ok(_) => panic!("a 1 EiB cache file was allocated"),
    }
    assert_eq!(
        "psync".parse::<EngineChoice>().unwrap(),
        EngineChoice::Psync
    );
    assert!("spdk".parse::<EngineChoice>().is_err());
}

#[test]
fn a_lead_segment_and_its_payload_move_as_one_contiguous_range() {
    for choice in [EngineChoice::IoUring, EngineChoice::Psync] {
        let dir = tempfile::tempdir().unwrap();
        let engine = open_engine(choice, open(dir.path(), 4), 4).unwrap();
        let mut header = AlignedBuf::new(4096).unwrap();
        header.as_mut_slice().fill(0x11);
        let mut payload = AlignedBuf::new(BLOCK).unwrap();
        payload.as_mut_slice().fill(0x22);
        let write = IoOp {
            kind: OpKind::Write,
            offset: BLOCK as u64,
            addr: payload.addr(),
            len: BLOCK,
            lead: Some((header.addr(), 4096)),
        };
        // SAFETY: both buffers move into the keep-alive.
        let ticket =
            unsafe { engine.submit_raw(vec![write], Box::new((header, payload))) }.unwrap();
        ticket.wait().0.unwrap();
        // The file holds the header, then the payload, contiguously.
        let (r, bufs) = engine
            .submit(
                &[op(OpKind::Read, BLOCK as u64, 0, 0, 2 * BLOCK)],
                vec![AlignedBuf::new(2 * BLOCK).unwrap()],
            )
            .unwrap()
            .wait();
        r.unwrap();
        let bytes = bufs[0].as_slice();
        assert!(
            bytes[..4096].iter().all(|&b| b == 0x11),
            "{choice:?}: header"
        );
        assert!(
            bytes[4096..4096 + BLOCK].iter().all(|&b| b == 0x22),
            "{choice:?}: payload"
        );
        // And a vectored read splits them again.
        let header = AlignedBuf::new(4096).unwrap();
        let payload = AlignedBuf::new(BLOCK).unwrap();
        let (h, p) = (header.addr(), payload.addr());
        let read = IoOp {
            kind: OpKind::Read,
            offset: BLOCK as u64,
            addr: p,
            len: BLOCK,
            lead: Some((h, 4096)),
        };
        let both = std::sync::Arc::new((header, payload));
        // SAFETY: the buffers are shared with the keep-alive and read only after the wait.
        let ticket = unsafe { engine.submit_raw(vec![read], Box::new(both.clone())) }.unwrap();
        ticket.wait().0.unwrap();
        assert!(
            both.0.as_slice().iter().all(|&b| b == 0x11)
                && both.1.as_slice().iter().all(|&b| b == 0x22)
        );
        // A misaligned lead is refused.
        let bad = IoOp {
            lead: Some((h + 1, 4096)),
            ..read
        };
        assert!(matches!(
            // SAFETY: refused before any I/O.
            unsafe { engine.submit_raw(vec![bad], Box::new(())) },
            Err(DiskError::Invalid(_))
        ));
    }
}

/// Opens `name` in `dir` with default options, small.
fn open_small(dir: &std::path::Path, name: &str) -> Result<CacheFile, DiskError> {
    CacheFile::open(dir, name, 1 << 16, CacheFileOptions::default())
}

#[test]
fn a_planted_symlink_is_not_followed_and_its_target_is_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("kvbm-rank0.cache")).unwrap();
    let err = open_small(&dir, "kvbm-rank0.cache").unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "the target's mode is untouched");
    // A hard link to another file of ours is refused too (it would overwrite that file).
    std::fs::remove_file(dir.join("kvbm-rank0.cache")).unwrap();
    std::fs::hard_link(&victim, dir.join("kvbm-rank0.cache")).unwrap();
    let err = open_small(&dir, "kvbm-rank0.cache").unwrap_err();
    assert!(err.to_string().contains("one link"), "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

#[test]
fn file_names_stay_inside_the_cache_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    for name in ["../x", "a/b", "..", ".", "", "/etc/passwd"] {
        match open_small(&dir, name) {
            Err(DiskError::Invalid(msg)) => assert!(msg.contains("plain file name"), "{msg}"),
            other => panic!("{name:?} accepted: {other:?}"),
        }
    }
    assert!(
        !tmp.path().join("x").exists(),
        "nothing was created outside"
    );
}

#[test]
fn a_directory_others_can_write_to_is_refused_unless_sticky() {
    let tmp = tempfile::tempdir().unwrap();
    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = open_small(&open, "c.cache").unwrap_err();
    assert!(err.to_string().contains("other users"), "{err}");
    assert!(!open.join("c.cache").exists());
    // With the sticky bit (as /tmp has) others cannot replace our file: accepted.
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
    open_small(&open, "c.cache").unwrap();
}
