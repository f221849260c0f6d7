//! The cache file: one preallocated file in a private directory, locked by one process.
//!
//! Invariants:
//! - The directory is created 0700 and the file 0600 (an existing file is narrowed to 0600).
//! - An exclusive `flock` is held for the file's lifetime: a second process (or a second open in
//!   this one) gets [`DiskError::Locked`], never a shared file. A lock still held is waited for up
//!   to [`CacheFileOptions::lock_wait`] (a process that just died may still hold it while the
//!   kernel tears down its io_uring), then reported with the time waited.
//! - Nothing here follows a planted link or uses someone else's file: the name is one plain path
//!   component (no `/`, no `..`), the file is opened with `O_NOFOLLOW`, and it must be a regular
//!   file owned by this user with a single link; a directory that other users may write into
//!   without the sticky bit is refused (they could swap the file).
//! - The file is preallocated with `fallocate`; where the file system refuses it, the file is sized
//!   with `set_len` instead (sparse), with one warning.
//! - O_DIRECT unless disabled; when the file system refuses it (EINVAL), the file is opened
//!   buffered with one warning, and [`CacheFile::io_mode`] says so.

use std::fs::{File, OpenOptions, Permissions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::fcntl::{Flock, FlockArg};

use crate::DiskError;

/// Mode of cache files.
pub const CACHE_FILE_MODE: u32 = 0o600;
/// Mode of the cache directory when kvbm creates it.
pub const CACHE_DIR_MODE: u32 = 0o700;

/// How the file is read and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// O_DIRECT: no page cache.
    Direct,
    /// Through the page cache (O_DIRECT disabled or refused).
    Buffered,
}

/// How long a lock held by another process is waited for by default.
pub const LOCK_WAIT_DEFAULT: std::time::Duration = std::time::Duration::from_secs(3);
/// How often a held lock is tried again while waiting.
const LOCK_RETRY_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);

/// How to open a cache file.
#[derive(Debug, Clone, Copy)]
pub struct CacheFileOptions {
    /// Never use O_DIRECT (`DYN_KVBM_DISK_DISABLE_O_DIRECT`).
    pub disable_o_direct: bool,
    /// How long to wait for a lock another process holds before reporting
    /// [`DiskError::Locked`]. Default [`LOCK_WAIT_DEFAULT`].
    pub lock_wait: std::time::Duration,
}

impl Default for CacheFileOptions {
    fn default() -> Self {
        Self {
            disable_o_direct: false,
            lock_wait: LOCK_WAIT_DEFAULT,
        }
    }
}

/// Checks that `name` is one plain path component, so that the file stays in its directory.
pub fn check_file_name(name: &str) -> Result<(), DiskError> {
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0');
    if plain {
        Ok(())
    } else {
        Err(DiskError::Invalid(format!(
            "cache file name {name:?}: must be a plain file name inside the cache directory"
        )))
    }
}

/// Checks an open file: a regular file, owned by this user, with one link (not someone else's
/// file, not a hard link to another of ours).
pub(crate) fn check_private(file: &File, path: &Path) -> Result<(), DiskError> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata().map_err(|source| DiskError::File {
        path: path.to_owned(),
        call: "fstat",
        source,
    })?;
    let euid = nix::unistd::geteuid().as_raw();
    if !meta.file_type().is_file() || meta.uid() != euid || meta.nlink() != 1 {
        return Err(DiskError::Invalid(format!(
            "cache file {}: not a regular file of this user (uid {euid}) with one link (uid {}, \
             {} links); refusing to use it",
            path.display(),
            meta.uid(),
            meta.nlink()
        )));
    }
    Ok(())
}

/// Checks that other users cannot replace files in `dir`: owned by this user or root, and not
/// writable by group or others unless the sticky bit keeps them from touching our files (as in
/// `/tmp`).
fn check_dir(dir: &Path) -> Result<(), DiskError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|source| DiskError::Directory {
        path: dir.to_owned(),
        source,
    })?;
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid && meta.uid() != 0 {
        return Err(DiskError::Invalid(format!(
            "cache directory {}: owned by uid {}, not this user (uid {euid}) or root, who could \
             replace the cache file",
            dir.display(),
            meta.uid()
        )));
    }
    let mode = meta.mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(DiskError::Invalid(format!(
            "cache directory {}: mode {:o} lets other users replace the cache file; use a \
             directory only this user can write to (kvbm creates its own 0700)",
            dir.display(),
            mode & 0o7777
        )));
    }
    Ok(())
}

/// An open, locked, sized cache file.
#[derive(Debug)]
pub struct CacheFile {
    file: Flock<File>,
    path: PathBuf,
    len: u64,
    mode: IoMode,
}

/// Opens with O_DIRECT unless disabled; when the file system refuses it (EINVAL), opens buffered.
/// `open(direct)` opens the file with or without O_DIRECT.
fn open_direct_or_buffered<F>(
    options: CacheFileOptions,
    open: impl Fn(bool) -> std::io::Result<F>,
) -> std::io::Result<(F, IoMode)> {
    if options.disable_o_direct {
        return Ok((open(false)?, IoMode::Buffered));
    }
    match open(true) {
        Ok(file) => Ok((file, IoMode::Direct)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((open(false)?, IoMode::Buffered)),
        Err(e) => Err(e),
    }
}

/// Takes `lock` (a non-blocking flock) on `file`, trying again while another holder has it for
/// up to `wait`; then [`DiskError::Locked`] with the time waited.
fn lock_waiting(
    file: File,
    lock: FlockArg,
    wait: std::time::Duration,
    path: &Path,
) -> Result<Flock<File>, DiskError> {
    let started = std::time::Instant::now();
    let mut unlocked = Some(file);
    let locked = retry_while_busy(wait, LOCK_RETRY_INTERVAL, || {
        let file = unlocked.take().expect("tried again only while unlocked");
        match Flock::lock(file, lock) {
            Ok(locked) => Attempt::Done(Ok(locked)),
            Err((back, nix::errno::Errno::EWOULDBLOCK)) => {
                unlocked = Some(back);
                Attempt::Busy
            }
            Err((_, errno)) => Attempt::Done(Err(errno)),
        }
    });
    match locked {
        Some(Ok(file)) => Ok(file),
        Some(Err(errno)) => Err(DiskError::File {
            path: path.to_owned(),
            call: "flock",
            source: errno.into(),
        }),
        None => Err(DiskError::Locked {
            path: path.to_owned(),
            waited: started.elapsed(),
        }),
    }
}

/// Opens `path` (created 0600 when `write`) without following a link, with O_DIRECT unless
/// refused or disabled, and checks it is a private file of this user.
fn open_private(
    path: &Path,
    options: CacheFileOptions,
    write: bool,
) -> Result<(File, IoMode), DiskError> {
    let open = |direct: bool| {
        let mut flags = libc::O_CLOEXEC | libc::O_NOFOLLOW;
        if direct {
            flags |= libc::O_DIRECT;
        }
        let mut o = OpenOptions::new();
        o.read(true).custom_flags(flags);
        if write {
            o.write(true)
                .create(true)
                .truncate(false)
                .mode(CACHE_FILE_MODE);
        }
        o.open(path)
    };
    let (file, mode) = open_direct_or_buffered(options, open).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            DiskError::Invalid(format!(
                "cache file {}: is a symbolic link; refusing to follow it",
                path.display()
            ))
        } else {
            DiskError::File {
                path: path.to_owned(),
                call: "open",
                source: e,
            }
        }
    })?;
    check_private(&file, path)?;
    Ok((file, mode))
}

/// One try at something that may be busy.
enum Attempt<T> {
    Busy,
    Done(T),
}

/// Tries `attempt` until it is done or `wait` has passed (at least once), sleeping `interval`
/// between tries; None if it stayed busy.
fn retry_while_busy<T>(
    wait: std::time::Duration,
    interval: std::time::Duration,
    mut attempt: impl FnMut() -> Attempt<T>,
) -> Option<T> {
    let started = std::time::Instant::now();
    loop {
        if let Attempt::Done(value) = attempt() {
            return Some(value);
        }
        if started.elapsed() >= wait {
            return None;
        }
        std::thread::sleep(interval.min(wait.saturating_sub(started.elapsed())));
    }
}

static O_DIRECT_REFUSED_WARNED: AtomicBool = AtomicBool::new(false);
static FALLOCATE_REFUSED_WARNED: AtomicBool = AtomicBool::new(false);

impl CacheFile {
    /// Opens (creating if needed) `dir/name`, locks it, and sizes it to `len_bytes`.
    pub fn open(
        dir: &Path,
        name: &str,
        len_bytes: u64,
        options: CacheFileOptions,
    ) -> Result<Self, DiskError> {
        check_file_name(name)?;
        let dir_error = |source| DiskError::Directory {
            path: dir.to_owned(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(CACHE_DIR_MODE)
            .create(dir)
            .map_err(dir_error)?;
        nix::unistd::access(
            dir,
            nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK,
        )
        .map_err(|errno| dir_error(errno.into()))?;
        check_dir(dir)?;

        let path = dir.join(name);
        let file_error = |call, source| DiskError::File {
            path: path.clone(),
            call,
            source,
        };
        let (file, mode) = open_private(&path, options, true)?;
        if mode == IoMode::Buffered
            && !options.disable_o_direct
            && !O_DIRECT_REFUSED_WARNED.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(path = %path.display(), "the file system refuses O_DIRECT; using buffered disk I/O");
        }
        let file = lock_waiting(
            file,
            FlockArg::LockExclusiveNonblock,
            options.lock_wait,
            &path,
        )?;
        file.set_permissions(Permissions::from_mode(CACHE_FILE_MODE))
            .map_err(|e| file_error("fchmod", e))?;

        let current = file.metadata().map_err(|e| file_error("fstat", e))?.len();
        if current > len_bytes {
            file.set_len(len_bytes)
                .map_err(|e| file_error("ftruncate", e))?;
        } else if current < len_bytes {
            let len = i64::try_from(len_bytes)
                .map_err(|_| DiskError::Invalid(format!("cache file of {len_bytes} bytes")))?;
            match nix::fcntl::fallocate(
                file.as_raw_fd(),
                nix::fcntl::FallocateFlags::empty(),
                0,
                len,
            ) {
                Ok(()) => {}
                Err(nix::errno::Errno::EOPNOTSUPP) => {
                    if !FALLOCATE_REFUSED_WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(path = %path.display(), "the file system refuses fallocate; the cache file is sparse");
                    }
                    file.set_len(len_bytes)
                        .map_err(|e| file_error("ftruncate", e))?;
                }
                Err(errno) => return Err(file_error("fallocate", errno.into())),
            }
        }
        Ok(Self {
            file,
            path,
            len: len_bytes,
            mode,
        })
    }

    /// Opens the existing `dir/name` read-only, for inspection: no directory is created, the
    /// file is neither created, sized nor narrowed, and a *shared* lock keeps kvbm (which takes
    /// it exclusively) out while it is open, and it out while kvbm runs.
    pub fn open_read_only(
        dir: &Path,
        name: &str,
        options: CacheFileOptions,
    ) -> Result<Self, DiskError> {
        check_file_name(name)?;
        check_dir(dir)?;
        let path = dir.join(name);
        let file_error = |call, source| DiskError::File {
            path: path.clone(),
            call,
            source,
        };
        let (file, mode) = open_private(&path, options, false)?;
        let file = lock_waiting(file, FlockArg::LockSharedNonblock, options.lock_wait, &path)?;
        let len = file.metadata().map_err(|e| file_error("fstat", e))?.len();
        Ok(Self {
            file,
            path,
            len,
            mode,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a file of 0 bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// O_DIRECT or buffered.
    pub fn io_mode(&self) -> IoMode {
        self.mode
    }

    /// Flushes written data to the device (`fdatasync`).
    pub fn sync_data(&self) -> Result<(), DiskError> {
        self.file.sync_data().map_err(|source| DiskError::File {
            path: self.path.clone(),
            call: "fdatasync",
            source,
        })
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An opener for a file system that refuses O_DIRECT (as ramfs and some FUSE ones do).
    fn refusing(direct: bool) -> std::io::Result<&'static str> {
        if direct {
            Err(std::io::Error::from_raw_os_error(libc::EINVAL))
        } else {
            Ok("buffered file")
        }
    }

    #[test]
    fn a_busy_lock_is_tried_again_until_it_is_free_or_the_wait_is_over() {
        let long = std::time::Duration::from_secs(600);
        let tick = std::time::Duration::from_millis(1);
        // Free on the fourth try: taken, after three more tries.
        let mut tries = 0;
        let got = retry_while_busy(long, tick, || {
            tries += 1;
            if tries < 4 {
                Attempt::Busy
            } else {
                Attempt::Done(tries)
            }
        });
        assert_eq!(got, Some(4));
        // Never free: one try with no wait, then given up.
        let mut tries = 0;
        let got: Option<()> = retry_while_busy(std::time::Duration::ZERO, tick, || {
            tries += 1;
            Attempt::Busy
        });
        assert_eq!((got, tries), (None, 1));
    }

    #[test]
    fn o_direct_refused_with_einval_falls_back_to_buffered() {
        let got = open_direct_or_buffered(CacheFileOptions::default(), refusing).unwrap();
        assert_eq!(got, ("buffered file", IoMode::Buffered));
        let accepting = |direct: bool| Ok::<_, std::io::Error>(direct);
        assert_eq!(
            open_direct_or_buffered(CacheFileOptions::default(), accepting).unwrap(),
            (true, IoMode::Direct)
        );
        let disabled = CacheFileOptions {
            disable_o_direct: true,
            ..Default::default()
        };
        assert_eq!(
            open_direct_or_buffered(disabled, accepting).unwrap(),
            (false, IoMode::Buffered)
        );
        // Other errors are errors, not a reason to go buffered.
        let denied = |_: bool| Err::<(), _>(std::io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(
            open_direct_or_buffered(CacheFileOptions::default(), denied)
                .unwrap_err()
                .raw_os_error(),
            Some(libc::EACCES)
        );
    }
}
