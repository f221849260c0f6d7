//! A directory that cannot be opened is reported with the open's own error (here EMFILE), not
//! as "not a directory". Alone in its test binary: it uses up the process's descriptors.

use std::os::fd::{AsFd, OwnedFd};

use kvbm_disk::{CacheFile, CacheFileOptions, DiskError};

#[test]
fn a_directory_open_failing_reports_its_own_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    std::fs::create_dir(&dir).unwrap();
    // Use up the descriptors (at most a few thousand: the soft limit is lowered first).
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct given.
    #[allow(unsafe_code)]
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        let lowered = libc::rlimit {
            rlim_cur: limit.rlim_cur.min(4096),
            rlim_max: limit.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lowered), 0);
    }
    let anchor = std::fs::File::open(tmp.path()).unwrap();
    let mut held: Vec<OwnedFd> = Vec::new();
    while let Ok(fd) = anchor.as_fd().try_clone_to_owned() {
        held.push(fd);
    }
    let result = CacheFile::open_read_only(&dir, "cache.kvbm", CacheFileOptions::default());
    drop(held);
    match result {
        Err(DiskError::Directory { source, .. }) => {
            assert_eq!(source.raw_os_error(), Some(libc::EMFILE), "{source}")
        }
        other => panic!("expected the directory's EMFILE, got {other:?}"),
    }
}
