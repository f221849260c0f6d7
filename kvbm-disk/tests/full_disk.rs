//! A full disk degrades the store, never the process: writes past a file-size limit fail with
//! EFBIG, are counted, and after repeated failures the store refuses writes while reads go on.
//!
//! This file holds one test on purpose: it lowers the process's RLIMIT_FSIZE, so it runs in a test
//! binary (a process) of its own.

use kvbm_disk::{AlignedBuf, DiskStore, EngineChoice, Lookup, StoreOptions, WriteOutcome};

#[test]
fn writes_past_a_size_limit_fail_counted_then_degrade_while_reads_go_on() {
    for engine in [EngineChoice::IoUring, EngineChoice::Psync] {
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions {
            layout_fingerprint: 1,
            payload_bytes: 4096,
            slots: 16,
            queue_depth: 4,
            engine,
            file: Default::default(),
            write_failures_max: 3,
        };
        let (store, _) = DiskStore::open(dir.path(), "cache.kvbm", options).unwrap();
        let payload = AlignedBuf::new(4096).unwrap();
        assert_eq!(store.write(0, 100, &payload).unwrap(), WriteOutcome::Stored);

        // Writes past 64 KiB now fail with EFBIG (SIGXFSZ ignored, as a server would).
        // SAFETY: setting a signal disposition and a resource limit of this test process.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: 64 * 1024,
                rlim_max: libc::RLIM_INFINITY,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
        for slot in 10..13 {
            match store.write(slot, slot as u64, &payload).unwrap() {
                WriteOutcome::Failed(reason) => {
                    assert!(reason.contains("File too large"), "{reason}")
                }
                other => panic!("{engine:?}: a write past the limit gave {other:?}"),
            }
        }
        let stats = store.stats();
        assert_eq!(stats.write_failures, 3);
        assert!(stats.degraded);
        assert_eq!(store.write(1, 1, &payload).unwrap(), WriteOutcome::Refused);
        assert_eq!(store.stats().writes_refused, 1);
        // The good block still reads.
        let mut out = AlignedBuf::new(4096).unwrap();
        assert_eq!(store.read(0, 100, &mut out).unwrap(), Lookup::Hit);
        // Failed slots hold nothing readable.
        assert_ne!(store.read(10, 10, &mut out).unwrap(), Lookup::Hit);
        // SAFETY: restoring this test process's limit for the next engine.
        unsafe {
            let limit = libc::rlimit {
                rlim_cur: libc::RLIM_INFINITY,
                rlim_max: libc::RLIM_INFINITY,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
    }
}
