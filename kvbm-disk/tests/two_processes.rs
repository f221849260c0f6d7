//! Two processes on one cache directory: the second is refused while the first holds the file,
//! and gets it (with the first's checkpoint) once the first has closed.

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
        "initialised=false from_checkpoint=true blocks=3 engine=io_uring io_mode=Direct"
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
