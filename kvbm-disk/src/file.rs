//! The cache file: one preallocated file in a private directory, locked by one process.
//!
//! Invariants:
//! - The directory is created 0700 and the file 0600 (an existing file is narrowed to 0600).
//! - An exclusive, non-blocking `flock` is held for the file's lifetime: a second process (or a
//!   second open in this one) gets [`DiskError::Locked`], never a shared file.
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

/// How to open a cache file.
#[derive(Debug, Clone, Copy, Default)]
pub struct CacheFileOptions {
    /// Never use O_DIRECT (`DYN_KVBM_DISK_DISABLE_O_DIRECT`).
    pub disable_o_direct: bool,
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

        let path = dir.join(name);
        let file_error = |call, source| DiskError::File {
            path: path.clone(),
            call,
            source,
        };
        let open = |direct: bool| {
            let mut flags = libc::O_CLOEXEC;
            if direct {
                flags |= libc::O_DIRECT;
            }
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(CACHE_FILE_MODE)
                .custom_flags(flags)
                .open(&path)
        };
        let (file, mode) =
            open_direct_or_buffered(options, open).map_err(|e| file_error("open", e))?;
        if mode == IoMode::Buffered
            && !options.disable_o_direct
            && !O_DIRECT_REFUSED_WARNED.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(path = %path.display(), "the file system refuses O_DIRECT; using buffered disk I/O");
        }
        let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => locked,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Err(DiskError::Locked { path }),
            Err((_, errno)) => return Err(file_error("flock", errno.into())),
        };
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
