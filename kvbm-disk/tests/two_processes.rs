//! Two processes on one cache directory: the second is refused while the first holds the file,
//! and gets it (with the first's checkpoint) once the first has closed; `kvbm-disk-inspect`
//! changes nothing unless asked to.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use kvbm_disk::{AlignedBuf, DiskError, DiskStore, StoreOptions, WriteOutcome};

fn options() -> StoreOptions {
    StoreOptions {
        layout_fingerprint: 5,
        payload_bytes: 4096,
        slots: 8,
        queue_depth: 4,
        engine: Default::default(),
        file: Default::default(),
        write_failures_max: 8,
    }
}

#[test]
fn a_second_process_is_refused_until_the_first_closes() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, _) = DiskStore::open(dir.path(), "cache.kvbm", options()).unwrap();
        for slot in 0..3 {
            assert_eq!(
                store
                    .write(slot, 100 + u64::from(slot), &AlignedBuf::new(4096).unwrap())
                    .unwrap(),
                WriteOutcome::Stored
            );
        }
        store.close().unwrap();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbm-disk-inspect"))
        .args([
            dir.path().to_str().unwrap(),
            "cache.kvbm",
            "5",
            "4096",
            "8",
            "--hold",
            "--write",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim_end(),
        "layout_matches=true from_checkpoint=true blocks=3 engine=io_uring io_mode=Direct"
    );

    // This process is refused while the other holds the file.
    match DiskStore::open(dir.path(), "cache.kvbm", options()) {
        Err(DiskError::Locked { .. }) => {}
        other => panic!("expected Locked while another process holds the file, got {other:?}"),
    }
    // Closing the child's stdin makes it close the store (writing a checkpoint) and exit.
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let (_, recovered) = DiskStore::open(dir.path(), "cache.kvbm", options()).unwrap();
    assert!(recovered.from_checkpoint);
    let found: Vec<(u32, u64)> = recovered.blocks.iter().map(|b| (b.slot, b.key)).collect();
    assert_eq!(found, vec![(0, 100), (1, 101), (2, 102)]);
}

fn inspect(dir: &std::path::Path, fingerprint: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbm-disk-inspect"))
        .args([
            dir.to_str().unwrap(),
            "cache.kvbm",
            fingerprint,
            "4096",
            "8",
        ])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim_end().to_owned(),
    )
}

#[test]
fn inspecting_a_cache_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, _) = DiskStore::open(dir.path(), "cache.kvbm", options()).unwrap();
        for slot in 0..3 {
            let outcome = store
                .write(slot, 100 + u64::from(slot), &AlignedBuf::new(4096).unwrap())
                .unwrap();
            assert_eq!(outcome, WriteOutcome::Stored);
        }
        store.close().unwrap();
    }
    let snapshot = || {
        let mut names: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        names.sort();
        names
    };
    let before = snapshot();
    assert_eq!(before.len(), 2, "the cache file and its checkpoint");
    // The right layout: what kvbm would recover, from the checkpoint, which stays.
    let (ok, line) = inspect(dir.path(), "5");
    assert!(ok, "{line}");
    assert!(
        line.starts_with("layout_matches=true from_checkpoint=true blocks=3"),
        "{line}"
    );
    // Another layout: reported, not re-initialised.
    let (ok, line) = inspect(dir.path(), "6");
    assert!(ok, "{line}");
    assert!(
        line.starts_with("layout_matches=false from_checkpoint=false blocks=0"),
        "{line}"
    );
    assert_eq!(snapshot(), before, "inspection changed the cache");
    // A cache that is not there is an error, and nothing is created.
    let empty = tempfile::tempdir().unwrap();
    let (ok, line) = inspect(empty.path(), "5");
    assert!(!ok && line.starts_with("error:"), "{line}");
    assert_eq!(std::fs::read_dir(empty.path()).unwrap().count(), 0);
    // In-process too: an inspecting store refuses writes and closes without a checkpoint.
    let (store, recovered) = DiskStore::inspect(dir.path(), "cache.kvbm", options()).unwrap();
    assert_eq!(recovered.blocks.len(), 3);
    assert!(store.write(0, 1, &AlignedBuf::new(4096).unwrap()).is_err());
    store.close().unwrap();
    assert_eq!(snapshot(), before, "an inspecting store changed the cache");
    // And kvbm still recovers everything afterwards.
    let (_, recovered) = DiskStore::open(dir.path(), "cache.kvbm", options()).unwrap();
    assert!(recovered.from_checkpoint);
    assert_eq!(recovered.blocks.len(), 3);
}

#[test]
fn inspect_refuses_a_payload_size_beyond_the_format() {
    let dir = tempfile::tempdir().unwrap();
    for (payload, slots) in [
        ("18446744073709551615", "8"),
        ("1073741825", "8"),
        ("0", "8"),
        ("4096", "4294967296"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvbm-disk-inspect"))
            .args([
                dir.path().to_str().unwrap(),
                "cache.kvbm",
                "1",
                payload,
                slots,
                "--write",
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{payload} {slots}: {stderr}");
        let what = if slots == "8" {
            "PAYLOAD_BYTES"
        } else {
            "SLOTS"
        };
        assert!(stderr.contains(what), "{stderr}");
    }
    // Nothing was created.
    assert!(!dir.path().join("cache.kvbm").exists());
}

#[test]
fn a_store_refuses_a_slot_payload_beyond_one_io() {
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions {
        payload_bytes: usize::MAX,
        ..options()
    };
    match DiskStore::open(dir.path(), "cache.kvbm", options) {
        Err(DiskError::Invalid(message)) => assert!(message.contains("payload"), "{message}"),
        other => panic!("expected Invalid, got {other:?}"),
    }
}
