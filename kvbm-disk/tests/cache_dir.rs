//! The cache directory is created and used safely: no symbolic link is followed on a component
//! kvbm creates, kvbm's own (private) directory must be this user's with no group or other
//! bits, and a directory the user named may be a link only when the link is the user's (or
//! root's).

use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::Path;

use kvbm_disk::{CacheFile, CacheFileOptions, DiskError};

/// A uid that is not this process's.
const OTHER_UID: u32 = 4_242_424;

fn private() -> CacheFileOptions {
    CacheFileOptions {
        private_dir: true,
        disable_o_direct: true,
        ..Default::default()
    }
}

fn shared() -> CacheFileOptions {
    CacheFileOptions {
        private_dir: false,
        ..private()
    }
}

fn refused(dir: &Path, options: CacheFileOptions, words: &[&str]) {
    match CacheFile::open(dir, "cache.kvbm", 1 << 16, options) {
        Err(DiskError::Invalid(message)) => {
            assert!(message.contains(&dir.display().to_string()), "{message}");
            for w in words {
                assert!(message.contains(w), "{w:?} not in {message}");
            }
        }
        other => panic!("expected {} refused, got {other:?}", dir.display()),
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[test]
fn a_private_directory_planted_as_a_link_is_refused_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
    let dir = tmp.path().join("kvbm-1000");
    symlink(&elsewhere, &dir).unwrap();
    refused(&dir, private(), &["symbolic link"]);
    assert!(
        std::fs::read_dir(&elsewhere).unwrap().next().is_none(),
        "nothing was created through the link"
    );
    match CacheFile::open_read_only(&dir, "cache.kvbm", private()) {
        Err(DiskError::Invalid(message)) => assert!(message.contains("symbolic link")),
        other => panic!("expected the link refused, got {other:?}"),
    }
}

#[test]
fn a_private_directory_open_to_others_or_of_another_user_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kvbm-open");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused(&dir, private(), &["mode 777"]);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).unwrap();
    refused(&dir, private(), &["mode 750"]);
    if is_root() {
        let theirs = tmp.path().join("kvbm-theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(OTHER_UID), None).unwrap();
        refused(&theirs, private(), &["owned by uid 4242424"]);
        // A user-named directory of another user is refused too (they could swap the file).
        refused(&theirs, shared(), &["owned by uid 4242424"]);
    }
}

#[test]
fn a_private_directory_is_created_0700_and_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a").join("kvbm-1000");
    let file = CacheFile::open(&dir, "cache.kvbm", 1 << 16, private()).unwrap();
    for d in [tmp.path().join("a"), dir.clone()] {
        let meta = std::fs::symlink_metadata(&d).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o7777, 0o700, "{}", d.display());
    }
    drop(file);
    // The same directory, existing and correct, is accepted.
    CacheFile::open(&dir, "cache.kvbm", 1 << 16, private()).unwrap();
    CacheFile::open_read_only(&dir, "cache.kvbm", private()).unwrap();
}

#[test]
fn a_named_directory_may_be_a_link_only_of_this_user() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    std::fs::create_dir(&target).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o700)).unwrap();
    let ours = tmp.path().join("ours");
    symlink(&target, &ours).unwrap();
    CacheFile::open(&ours, "cache.kvbm", 1 << 16, shared()).unwrap();
    if is_root() {
        let theirs = tmp.path().join("theirs");
        symlink(&target, &theirs).unwrap();
        std::os::unix::fs::lchown(&theirs, Some(OTHER_UID), None).unwrap();
        refused(
            &theirs,
            shared(),
            &["symbolic link", "owned by uid 4242424"],
        );
        refused(&theirs, CacheFileOptions::default(), &["symbolic link"]);
    }
}

#[test]
fn a_fifo_planted_as_the_checkpoint_is_ignored_without_blocking() {
    use kvbm_disk::{AlignedBuf, DiskStore, StoreOptions, CHECKPOINT_SUFFIX};
    let options = || StoreOptions {
        layout_fingerprint: 5,
        payload_bytes: 4096,
        slots: 4,
        queue_depth: 4,
        engine: Default::default(),
        file: shared(),
        write_failures_max: 8,
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    {
        let (store, _) = DiskStore::open(&dir, "cache.kvbm", options()).unwrap();
        store
            .write(0, 100, &AlignedBuf::new(4096).unwrap())
            .unwrap();
        store.close().unwrap();
    }
    let index = dir.join(format!("cache.kvbm{CHECKPOINT_SUFFIX}"));
    std::fs::remove_file(&index).unwrap();
    nix::unistd::mkfifo(&index, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    // Opening a FIFO for reading blocks until a writer comes: run the recovery aside.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let opened = DiskStore::open(&dir, "cache.kvbm", options()).map(|(_, r)| r);
        let _ = tx.send(opened.map(|r| (r.from_checkpoint, r.blocks.len())));
    });
    let recovered = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("recovery blocked on a FIFO planted as the checkpoint")
        .unwrap();
    assert_eq!(
        recovered,
        (false, 1),
        "the FIFO is ignored, the headers scanned"
    );
}

#[test]
fn a_directory_without_read_permission_is_usable() {
    if is_root() {
        return; // root reads any directory: nothing to check
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("write-only");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o300)).unwrap();
    CacheFile::open(&dir, "cache.kvbm", 1 << 16, shared()).unwrap();
}
